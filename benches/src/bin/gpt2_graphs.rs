//! GPT-2 training steps submitted four ways on one device, side by side:
//! `eager` (every task inferred and placed each step, automatic replay
//! off), `auto` (the same submissions with automatic replay on, the
//! builder's default: after a few identical steps each is submitted from
//! the memoised analysis), `replay` (the step
//! recorded once and replayed: on CUDA one task record per step, each
//! kernel its own launch) and `graph` (`RuntimeBuilder::graphs`: on CUDA
//! the step captured once into a CUDA graph, one launch per step; on the
//! CPU a sequential run on one stream thread). Prints, per mode, the median
//! step time, the median *host* time per step (from the step's first
//! submission until the submitting thread is free again, before the
//! synchronisation: what dispatch costs the host), the last loss, and a
//! last line `graph_step_ratio=<graph/eager> graph_host_ratio=<graph/eager>
//! auto_host_ratio=<auto/eager>`.
//! Whether the modes' losses agree is printed too. Figures only; nothing is
//! asserted.
//!
//! A step is the trainer's one-rank step: the batch upload and AdamW's step
//! scalars as ordinary tasks, then zero_grad, forward, backward, the
//! gradient norm and clip factor, and the AdamW update (the part that is
//! recorded). Modes alternate round by round; each round builds a fresh
//! runtime and model from the same parameters and tokens, runs `--warmup`
//! steps (the recording and the capture among them), then `--steps`
//! measured steps. The placement trial is off (it waits for a schedule's
//! first replays as they are submitted; the trainer runs it).
//!
//! ```text
//! cargo run --release -p braid-benches --bin gpt2_graphs -- --device cuda --model small \
//!     --batch-size 4 --seq-len 64 --rounds 3 --steps 20
//! ```

use std::time::Instant;

use anyhow::{bail, Context, Result};
use braid::{BackendKind, Runtime, Schedule};
use braid_benches::{cli, median, StorageArgs};
use braid_gpt2::checkpoint::AdamWHyper;
use braid_gpt2::config::Gpt2Config;
use braid_gpt2::model::{init_params, Gpt2Model, Rng};
use braid_gpt2::optim::AdamW;
use clap::Parser;

#[derive(Parser, Debug)]
#[command(about = "GPT-2 steps submitted eagerly, memoised, replayed, and replayed as a graph")]
struct Args {
    /// Model: gpt2 (124M), small, tiny, ...
    #[arg(long, default_value = "small")]
    model: String,
    /// Sequences per step (B).
    #[arg(long, default_value_t = 4, value_parser = cli::at_least(1))]
    batch_size: usize,
    /// Tokens per sequence (T).
    #[arg(long, default_value_t = 64, value_parser = cli::at_least(1))]
    seq_len: usize,
    /// `cuda` (device 0) or `cpu`.
    #[arg(long, default_value = "cuda")]
    device: String,
    /// Compute streams.
    #[arg(long, default_value_t = 2, value_parser = cli::at_least(1))]
    streams: usize,
    /// Unmeasured steps at the start of every round (at least 3: the
    /// recording is the third step, as in the trainer).
    #[arg(long, default_value_t = 4)]
    warmup: usize,
    /// Measured steps per mode per round.
    #[arg(long, default_value_t = 10)]
    steps: usize,
    /// Rounds; each runs every mode.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Seed of the parameters and tokens.
    #[arg(long, default_value_t = 1337)]
    seed: u64,
    #[command(flatten)]
    storage: StorageArgs,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Eager,
    Auto,
    Replay,
    Graph,
}

const MODES: [Mode; 4] = [Mode::Eager, Mode::Auto, Mode::Replay, Mode::Graph];

/// One mode's measurements over every round.
#[derive(Default)]
struct Tally {
    step_s: Vec<f64>,
    host_s: Vec<f64>,
    losses: Vec<Vec<f32>>,
    note: Option<String>,
}

/// Runs one round of `mode`: warm-up, then measured steps. Returns every
/// step's loss, and the measured steps' (step, host) seconds.
fn round(
    a: &Args,
    cfg: &Gpt2Config,
    backend: BackendKind,
    mode: Mode,
    params: &[f32],
    tally: &mut Tally,
) -> Result<()> {
    let rt = Runtime::builder()
        .backend(backend)
        .compute_streams(a.streams)
        .graphs(mode == Mode::Graph)
        .auto_replay(mode == Mode::Auto)
        // The placement trial (on by default on CUDA) waits for each of a
        // schedule's first sixteen replays: the measured steps would time
        // the trial's waits, not dispatch (run 8). Every mode keeps the
        // placement its policy gives.
        .placement_trial(false)
        .build()?;
    if let Some(dev) = rt.cuda_device() {
        braid_gpt2::kernels::preload(dev)?;
    }
    let mut model =
        Gpt2Model::with_options(&rt, cfg, a.batch_size, a.seq_len, a.storage.options())?;
    model.upload_params(&rt, params)?;
    let mut opt = AdamW::for_model(&rt, &model, AdamWHyper::default(), Some(1.0))?;
    rt.synchronize()?;
    let mut rng = Rng::new(a.seed ^ 0x6A47);
    let bt = a.batch_size * a.seq_len;
    let (mut x, mut y) = (vec![0u32; bt], vec![0u32; bt]);
    let mut schedule: Option<Schedule<'_>> = None;
    let mut losses = Vec::new();
    for step in 0..a.warmup + a.steps {
        for (x, y) in x.iter_mut().zip(y.iter_mut()) {
            *x = (rng.next_u64() % cfg.vocab_size as u64) as u32;
            *y = (rng.next_u64() % cfg.vocab_size as u64) as u32;
        }
        model.upload_batch(&rt, &x, Some(&y))?;
        opt.advance(&rt)?;
        let t0 = Instant::now();
        let submit = |rt: &Runtime, model: &mut Gpt2Model, opt: &mut AdamW| -> braid::Result<()> {
            let e = |e: braid_gpt2::error::Gpt2Error| braid::Error::Config(e.to_string());
            model.zero_grad(rt).map_err(e)?;
            model.forward_for_backward(rt).map_err(e)?;
            model.backward(rt, 1.0, |_| Ok(())).map_err(e)?;
            opt.clip(rt, model.grads().map_err(e)?).map_err(e)?;
            opt.update_recorded(rt, model.params(), model.grads().map_err(e)?)
                .map_err(e)
        };
        match (mode, &schedule) {
            (Mode::Eager | Mode::Auto, _) => submit(&rt, &mut model, &mut opt)?,
            (_, Some(s)) => {
                s.replay()?;
            }
            // The third step is recorded, as the trainer does.
            (_, None) if step >= 2 => {
                schedule = Some(rt.record("train step", |rt| submit(rt, &mut model, &mut opt))?);
            }
            (_, None) => submit(&rt, &mut model, &mut opt)?,
        }
        let host = t0.elapsed().as_secs_f64();
        rt.synchronize()?;
        let total = t0.elapsed().as_secs_f64();
        losses.push(model.read_loss(&rt)?);
        if step >= a.warmup {
            tally.step_s.push(total);
            tally.host_s.push(host);
        }
    }
    if mode == Mode::Auto {
        let s = rt.stats();
        tally.note = Some(format!(
            "{} tasks memoised, {} divergences",
            s.auto_replayed, s.auto_divergences
        ));
    }
    if mode == Mode::Graph {
        let s = schedule.as_ref().context("no schedule was recorded")?;
        tally.note = Some(match s.graph_refusal() {
            None => format!("{} graph launches", rt.stats().graph_replays),
            Some(why) => format!("refused: {why}"),
        });
    }
    tally.losses.push(losses);
    Ok(())
}

fn main() -> Result<()> {
    let a = Args::parse();
    braid_gpt2::kernels::switches::check_environment()?;
    let cfg = Gpt2Config::from_name(&a.model)?;
    if a.warmup < 3 || a.steps == 0 || a.rounds == 0 {
        bail!("--warmup must be at least 3, --steps and --rounds at least 1");
    }
    let backend = match a.device.as_str() {
        "cuda" => BackendKind::Cuda { device: 0 },
        "cpu" => BackendKind::Cpu,
        d => bail!("--device is cuda or cpu, not `{d}`"),
    };
    println!(
        "gpt2_graphs: model {} ({} parameters), B {} x T {}, {} compute streams on {}",
        a.model,
        cfg.num_parameters(),
        a.batch_size,
        a.seq_len,
        a.streams,
        a.device
    );
    let params = init_params(&cfg, a.seed);
    let mut tallies: Vec<Tally> = MODES.iter().map(|_| Tally::default()).collect();
    for r in 0..a.rounds {
        for k in 0..MODES.len() {
            let i = (k + r) % MODES.len();
            round(&a, &cfg, backend, MODES[i], &params, &mut tallies[i])
                .with_context(|| format!("round {r}, {:?}", MODES[i]))?;
        }
    }
    for (m, t) in MODES.iter().zip(&tallies) {
        println!(
            "{:<7} step {:>8.2} ms  host {:>8.3} ms per step (medians of {})  last loss {:.4}{}",
            format!("{m:?}").to_lowercase(),
            median(&t.step_s) * 1e3,
            median(&t.host_s) * 1e3,
            t.step_s.len(),
            t.losses
                .last()
                .and_then(|l| l.last())
                .copied()
                .unwrap_or(f32::NAN),
            t.note
                .as_ref()
                .map(|n| format!("  ({n})"))
                .unwrap_or_default()
        );
    }
    let same = tallies.iter().all(|t| t.losses == tallies[0].losses);
    println!(
        "losses bit-identical across modes: {}",
        if same { "yes" } else { "no" }
    );
    let ratio = |m: Mode, f: fn(&Tally) -> &Vec<f64>| {
        let i = MODES.iter().position(|&x| x == m).expect("a mode");
        median(f(&tallies[i])) / median(f(&tallies[0]))
    };
    println!(
        "graph_step_ratio={:.3} graph_host_ratio={:.3} auto_host_ratio={:.3}",
        ratio(Mode::Graph, |t| &t.step_s),
        ratio(Mode::Graph, |t| &t.host_s),
        ratio(Mode::Auto, |t| &t.host_s)
    );
    Ok(())
}

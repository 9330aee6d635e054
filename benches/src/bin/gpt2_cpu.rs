//! GPT-2 data-parallel training on CPU ranks: the `single` placement policy
//! (everything, collectives included, on one stream per rank: no overlap)
//! against the default policy (the trainer's replayed step) and the default
//! policy with every step submitted eagerly (`replay: false`), in the same run
//! (with `--oversubscribed`, also
//! the default policy on every compute stream whatever the core budget: the
//! placement before the budget). The variants take turns within each round,
//! in an order that rotates round by round; each training run starts from the
//! same initial parameters and data and leaves its first step out of the
//! timing (warm-up). Prints step time, tokens/s, the share of communication
//! time hidden under computation and the compute streams each rank used, and
//! ends with the default policy's speed-up over `single`: the geometric mean
//! of the rounds' paired ratios (step time of `single` / step time of the
//! default, both measured in the same round). Figures only; nothing is
//! asserted.
//!
//! The default policy places compute tasks on each rank's share of the
//! process's core budget (`BRAID_CPU_CORES`, else the cores the process may
//! use), so ranks × streams may exceed the cores without oversubscribing them.
//!
//! `cargo run --release -p braid-benches --bin gpt2_cpu -- --ranks 2 --steps 4 --rounds 2 [--oversubscribed]`

use anyhow::Result;
use braid::trace::Span;
use braid::{BackendKind, Policy};
use braid_benches::cli;
use braid_gpt2::config::Gpt2Config;
use braid_gpt2::data::TokenSource;
use braid_gpt2::trainer::{train, StartState, TrainOptions, TrainReport};
use clap::Parser;
use std::collections::BTreeSet;

#[derive(Parser, Debug)]
#[command(about = "GPT-2 CPU data-parallel training: single-stream placement vs the default")]
struct Args {
    /// Model name (tiny, small, ...).
    #[arg(long, default_value = "small")]
    model: String,
    /// CPU ranks (threads; 1 to 1,024).
    #[arg(long, default_value_t = 2, value_parser = cli::cpu_ranks)]
    ranks: usize,
    /// Compute streams per rank.
    #[arg(long, default_value_t = 2, value_parser = cli::at_least(1))]
    streams: usize,
    /// Sequences per rank per step.
    #[arg(long, default_value_t = 4, value_parser = cli::at_least(1))]
    batch_size: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 64, value_parser = cli::at_least(1))]
    seq_len: usize,
    /// Measured steps per policy per round (plus one warm-up step; at least
    /// 1).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..u64::MAX))]
    steps: u64,
    /// Rounds; each runs every variant (at least 1).
    #[arg(long, default_value_t = 2, value_parser = cli::at_least(1))]
    rounds: usize,
    /// Also run the default policy with `oversubscribe` (every compute stream
    /// of every rank, whatever the core budget): the placement before the
    /// budget, in the same rounds.
    #[arg(long)]
    oversubscribed: bool,
    /// Gradient bucket cap, MiB.
    #[arg(long, default_value_t = 25.0, value_parser = cli::positive_f64)]
    bucket_cap_mb: f64,
    /// First bucket's cap, MiB.
    #[arg(long, default_value_t = 1.0, value_parser = cli::positive_f64)]
    first_bucket_mb: f64,
}

#[derive(Default)]
struct Tally {
    step_s: Vec<f64>,
    hidden: Vec<f64>,
    comm_s: Vec<f64>,
}

impl Tally {
    fn add(&mut self, r: &TrainReport) {
        self.step_s.push(r.mean_step_seconds());
        self.hidden.push(r.hidden_comm_share());
        self.comm_s
            .push(r.comm_seconds() / r.measured_steps().max(1) as f64);
    }
    fn mean(v: &[f64]) -> f64 {
        v.iter().sum::<f64>() / v.len().max(1) as f64
    }
}

/// Per rank, how many compute streams its tasks ran on and the most the
/// placement policy could use (from the placement recorded in each span).
fn streams_used(r: &TrainReport) -> String {
    let per_rank: Vec<String> = r
        .profiles
        .iter()
        .map(|p| {
            let compute = |s: &&Span| !p.streams[s.stream].is_comm;
            let used: BTreeSet<usize> = p.spans.iter().filter(compute).map(|s| s.stream).collect();
            let usable = p
                .spans
                .iter()
                .map(|s| s.placement.usable)
                .max()
                .unwrap_or(0);
            format!("{}/{usable}", used.len())
        })
        .collect();
    per_rank.join(" ")
}

fn main() -> Result<()> {
    let a = Args::parse();
    let cfg = Gpt2Config::from_name(&a.model)?;
    let data = if cfg.vocab_size >= braid_gpt2::data::GPT2_VOCAB_SIZE {
        TokenSource::resolve("builtin")?
    } else {
        // Tokens the model's vocabulary holds.
        let ids: Vec<u32> = (0..32_768u32)
            .map(|i| (i * 7 + i / 13) % cfg.vocab_size as u32)
            .collect();
        TokenSource::from_ids(&ids, "synthetic")?
    };
    let start = StartState::fresh(&cfg, 1);
    let base = TrainOptions {
        model: cfg,
        batch_size: a.batch_size,
        seq_len: a.seq_len,
        steps: a.steps + 1,
        backend: BackendKind::Cpu,
        ranks: a.ranks,
        streams: a.streams,
        bucket_cap_bytes: (a.bucket_cap_mb * (1 << 20) as f64) as usize,
        first_bucket_bytes: (a.first_bucket_mb * (1 << 20) as f64) as usize,
        ..TrainOptions::default()
    };
    let tokens = a.batch_size * a.seq_len * a.ranks;
    println!(
        "gpt2_cpu: model {} ({} parameters), {} ranks x {} streams, {} tokens per step, \
         {} measured steps x {} rounds per policy",
        a.model,
        cfg.num_parameters(),
        a.ranks,
        a.streams,
        tokens,
        a.steps,
        a.rounds
    );
    println!("cores: {}", braid::topo::describe());
    // (name, policy, oversubscribe, replay): `single` first, the default
    // second, the default eager third.
    let default = Policy::default().name();
    let mut variants = vec![
        ("single".to_string(), Policy::Single, false, true),
        (default.to_string(), Policy::default(), false, true),
        (format!("{default} eager"), Policy::default(), false, false),
    ];
    if a.oversubscribed {
        variants.push((
            format!("{default}+oversubscribe"),
            Policy::default(),
            true,
            true,
        ));
    }
    let n = variants.len();
    let mut tallies: Vec<Tally> = variants.iter().map(|_| Tally::default()).collect();
    // ratios[v][round]: step time of `single` / step time of variant v.
    let mut ratios: Vec<Vec<f64>> = vec![Vec::with_capacity(a.rounds); n];
    for round in 0..a.rounds {
        // Rotate the order so no variant always runs first.
        for i in (0..n).map(|k| (k + round) % n) {
            let (name, policy, oversubscribe, replay) = &variants[i];
            let opts = TrainOptions {
                policy: *policy,
                oversubscribe: *oversubscribe,
                replay: *replay,
                ..base.clone()
            };
            let r = train(&opts, start.clone(), &data, &|_| {})?;
            println!(
                "round {round} {name:<22} step {:>8.1} ms  {:>8.0} tokens/s  comm {:>7.1} ms/step, {:>3.0}% hidden, \
                 compute streams used/usable per rank {}",
                r.mean_step_seconds() * 1e3,
                r.tokens_per_second(),
                r.comm_seconds() * 1e3 / r.measured_steps().max(1) as f64,
                100.0 * r.hidden_comm_share(),
                streams_used(&r)
            );
            tallies[i].add(&r);
        }
        for v in 1..n {
            let ratio = tallies[0].step_s[round] / tallies[v].step_s[round];
            println!(
                "round {round} speed-up of {} over single: {ratio:.3}x",
                variants[v].0
            );
            ratios[v].push(ratio);
        }
    }
    println!();
    for ((name, ..), t) in variants.iter().zip(&tallies) {
        let step = Tally::mean(&t.step_s);
        println!(
            "{name:<22} mean step {:>8.1} ms  {:>8.0} tokens/s  comm {:>7.1} ms/step  hidden {:>3.0}%",
            step * 1e3,
            tokens as f64 / step,
            Tally::mean(&t.comm_s) * 1e3,
            100.0 * Tally::mean(&t.hidden)
        );
    }
    // Geometric mean of the paired per-round ratios: each pairs runs taken
    // back to back, so slow drifts of the machine's load cancel. The
    // default's line comes last.
    let geomean = |r: &[f64]| (r.iter().map(|x| x.ln()).sum::<f64>() / r.len().max(1) as f64).exp();
    // Replay against eager, paired by round (the default policy both).
    let replay: Vec<f64> = (0..a.rounds)
        .map(|r| tallies[2].step_s[r] / tallies[1].step_s[r])
        .collect();
    println!("replay over eager ({default}): {:.3}x", geomean(&replay));
    for v in (2..n).chain([1]) {
        println!(
            "speed-up of {} over single: {:.3}x",
            variants[v].0,
            geomean(&ratios[v])
        );
    }
    Ok(())
}

//! GPT-2 training steps on one GPU, fp32: the `single` placement policy
//! (every task on one stream: no overlap) against the default policy, in the
//! same run. Prints step time, tokens/s, their ratio, how much of the step
//! two compute streams were busy at once, the critical path, and peak device
//! memory. Figures only; nothing is asserted.
//!
//! A step is what the trainer does on one rank: zero the gradients, forward
//! (with the batch upload), backward, AdamW with global-norm clipping as
//! tasks, then a synchronisation and the loss read back. Tokens are random
//! (a fixed seed), new each step.
//!
//! The policies alternate round by round (`single` first in even rounds, the
//! default first in odd ones). Each round builds a fresh runtime and model for
//! the policy from the same initial parameters, runs `--warmup` steps
//! (allocation, cuBLAS handles, pools), then `--steps` measured steps; only
//! one model lives at a time, so `B 8 × T 1024` of the 124M model (about
//! 40 GB of activations, gradients and optimizer state: the program prints
//! its plan) fits an 80 GB GPU. With `--interleave` both models live at once,
//! are warmed up, and the measured steps alternate one by one (memory for
//! two models). Step times are medians; the overlap and critical-path
//! figures come from the runtime's device-timed profile of the measured
//! steps.
//! With `--profile-step FILE` one more step of each policy is traced
//! (Chrome trace, device-timed spans): the default policy's to `FILE`, the
//! single-stream one's next to it (`FILE` with `.single` before the
//! extension).
//!
//! ```text
//! cargo run --release -p braid-benches --bin gpt2_gpu -- \
//!     --batch-size 8 --seq-len 1024 --rounds 3 --steps 5 --profile-step gpt2_step.json
//! ```

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use braid::trace::Summary;
use braid::{BackendKind, Policy, Runtime};
use braid_benches::{cli, median, StorageArgs};
use braid_gpt2::checkpoint::AdamWHyper;
use braid_gpt2::config::Gpt2Config;
use braid_gpt2::kernels::cpu::Dtype;
use braid_gpt2::model::{
    attention_scratch_bytes, init_params, Fusion, Gpt2Model, Rng, GRADIENT_RING,
};
use braid_gpt2::optim::{AdamW, NORM_SCRATCH};
use braid_gpt2::reference::ActivationLayout;
use braid_gpt2::trainer::model_runtime;
use clap::Parser;

#[derive(Parser, Debug)]
#[command(about = "GPT-2 training steps on one GPU: single-stream placement vs the default")]
struct Args {
    /// Model: gpt2 (124M), gpt2-medium, small, tiny, ...
    #[arg(long, default_value = "gpt2")]
    model: String,
    /// Sequences per step (B).
    #[arg(long, default_value_t = 8, value_parser = cli::at_least(1))]
    batch_size: usize,
    /// Tokens per sequence (T).
    #[arg(long, default_value_t = 1024, value_parser = cli::at_least(1))]
    seq_len: usize,
    /// Compute streams of each runtime (`single` puts every task on stream 0).
    #[arg(long, default_value_t = 2, value_parser = cli::at_least(1))]
    streams: usize,
    /// The policy compared with `single`: affinity or round-robin.
    #[arg(long, default_value = "affinity")]
    policy: String,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// Unmeasured steps at the start of every round.
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Measured steps per policy per round.
    #[arg(long, default_value_t = 5)]
    steps: usize,
    /// Rounds; each runs both policies.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Write a Chrome trace of one step of each policy (FILE for the default
    /// policy, FILE with `.single` before the extension for `single`).
    #[arg(long)]
    profile_step: Option<PathBuf>,
    /// Keep both models alive and alternate the measured steps one by one
    /// (needs memory for two models: about 80 GB at the 124M model's
    /// B 8 × T 1024, so use it with a smaller batch there). Default: the
    /// policies alternate round by round, one model at a time.
    #[arg(long)]
    interleave: bool,
    /// Seed of the initial parameters and of the tokens.
    #[arg(long, default_value_t = 1337)]
    seed: u64,
    #[command(flatten)]
    storage: StorageArgs,
    /// The GPU's peak rate in TFLOP/s that the model FLOPs utilisation
    /// (MFU) is a share of. Default: an H100/H200 SXM's dense rate for the
    /// dtype (989 in bf16 on tensor cores, 67 in fp32 without TF32).
    #[arg(long, value_parser = cli::positive_f64)]
    peak_tflops: Option<f64>,
}

/// FLOPs of one training step per token, llm.c's count: 6 per parameter
/// (forward, and backward twice) plus the attention's `12·L·C·T`.
fn flops_per_token(cfg: &Gpt2Config, t: usize) -> f64 {
    6.0 * cfg.num_parameters() as f64 + 12.0 * (cfg.num_layers * cfg.channels * t) as f64
}

/// The measurements of one policy over every round.
#[derive(Default)]
struct Tally {
    step_s: Vec<f64>,
    overlap: Vec<f64>,
    busy_ms: Vec<Vec<f64>>,
    critical_ms: Vec<f64>,
    hidden: Vec<f64>,
}

impl Tally {
    /// Records one block of measured steps (and prints it).
    fn add(
        &mut self,
        label: &str,
        policy: Policy,
        times: &[f64],
        s: &Summary,
        loss: f32,
        tokens: usize,
    ) {
        let steps = times.len().max(1) as f64;
        let step = median(times);
        let overlap = s.overlap_ns as f64 / s.wall_ns.max(1) as f64;
        let critical = s.critical_path_ns as f64 / 1e6 / steps;
        println!(
            "{label} {:<12} step {:>8.1} ms (median of {}, min {:.1})  {:>9.0} tokens/s  \
             2+ streams busy {:>4.1}%  critical path {:>7.1} ms/step  loss {loss:.4}",
            policy.name(),
            step * 1e3,
            times.len(),
            times.iter().copied().fold(f64::INFINITY, f64::min) * 1e3,
            tokens as f64 / step,
            100.0 * overlap,
            critical,
        );
        self.step_s.extend(times);
        self.overlap.push(overlap);
        self.busy_ms.push(
            s.streams
                .iter()
                .map(|x| x.busy_ns as f64 / 1e6 / steps)
                .collect(),
        );
        self.critical_ms.push(critical);
        self.hidden.push(s.hidden_share());
    }
}

/// The device and its peak memory use, sampled after each block of steps.
#[derive(Default)]
struct Memory {
    device: Option<String>,
    pool_high: u64,
    used: usize,
}

impl Memory {
    fn device_line(&mut self, rt: &Runtime) {
        if let (None, Some(dev)) = (&self.device, rt.cuda_device()) {
            let (major, minor) = dev.compute_capability();
            self.device = Some(format!(
                "device {} ({}, sm_{major}{minor}, {} SMs, {:.1} GiB)",
                dev.ordinal(),
                dev.name(),
                dev.sm_count(),
                gib(dev.total_memory() as f64)
            ));
        }
    }

    fn sample(&mut self, rt: &Runtime) {
        let Some(dev) = rt.cuda_device() else { return };
        if let Ok((free, total)) = dev.memory_info() {
            self.used = self.used.max(total.saturating_sub(free));
        }
        if let Ok(p) = dev.pool_stats() {
            self.pool_high = self.pool_high.max(p.used_high);
        }
    }
}

/// With `--profile-step`, one more step of `run`, traced.
fn trace_one_step(a: &Args, cfg: &Gpt2Config, run: &mut Run, policy: Policy) -> Result<()> {
    let Some(path) = &a.profile_step else {
        return Ok(());
    };
    let path = if policy == Policy::Single {
        tagged(path, "single")
    } else {
        path.clone()
    };
    run.rt.clear_profile();
    run.step(cfg.vocab_size)?;
    run.rt
        .write_trace(&path)
        .with_context(|| format!("writing {}", path.display()))?;
    let s = run.rt.profile().summary();
    println!(
        "trace of one {} step: {} ({} tasks, {:.1} ms, 2+ streams busy {:.1} ms)",
        policy.name(),
        path.display(),
        s.tasks,
        s.wall_ns as f64 / 1e6,
        s.overlap_ns as f64 / 1e6
    );
    Ok(())
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

fn gib(bytes: f64) -> f64 {
    bytes / (1u64 << 30) as f64
}

/// `path` with `.tag` before its extension.
fn tagged(path: &Path, tag: &str) -> PathBuf {
    let stem = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "trace".into());
    let name = match path.extension() {
        Some(e) => format!("{stem}.{tag}.{}", e.to_string_lossy()),
        None => format!("{stem}.{tag}"),
    };
    path.with_file_name(name)
}

/// One model with its optimizer on one runtime.
struct Run {
    rt: Runtime,
    model: Gpt2Model,
    opt: AdamW,
    rng: Rng,
    x: Vec<u32>,
    y: Vec<u32>,
}

impl Run {
    fn new(a: &Args, cfg: &Gpt2Config, policy: Policy, params: &[f32]) -> Result<Self> {
        // The same streams for both policies: `single` just leaves all but
        // stream 0 idle.
        let rt = model_runtime(BackendKind::Cuda { device: a.device }, a.streams, policy, 0)
            .with_context(|| format!("a CUDA runtime on device {}", a.device))?;
        let model =
            Gpt2Model::with_options(&rt, cfg, a.batch_size, a.seq_len, a.storage.options())?;
        model.upload_params(&rt, params)?;
        let hyper = AdamWHyper {
            learning_rate: 3e-4,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        };
        let opt = AdamW::for_model(&rt, &model, hyper, Some(1.0))?;
        rt.synchronize()?;
        let bt = a.batch_size * a.seq_len;
        Ok(Run {
            rt,
            model,
            opt,
            rng: Rng::new(a.seed ^ 0x70CE),
            x: vec![0; bt],
            y: vec![0; bt],
        })
    }

    /// One training step, synchronised; returns its loss.
    fn step(&mut self, vocab: usize) -> Result<f32> {
        for (x, y) in self.x.iter_mut().zip(self.y.iter_mut()) {
            *x = (self.rng.next_u64() % vocab as u64) as u32;
            *y = (self.rng.next_u64() % vocab as u64) as u32;
        }
        let rt = &self.rt;
        self.model.zero_grad(rt)?;
        self.model.forward(rt, &self.x, Some(&self.y))?;
        self.model.backward(rt, 1.0, |_| Ok(()))?;
        self.opt
            .step(rt, self.model.params(), self.model.grads()?)?;
        rt.synchronize()?;
        Ok(self.model.read_loss(rt)?)
    }
}

fn main() -> Result<()> {
    let a = Args::parse();
    let cfg = Gpt2Config::from_name(&a.model)?;
    let other: Policy = a.policy.parse()?;
    if other == Policy::Single {
        bail!("--policy is the policy compared with `single`: affinity or round-robin");
    }
    if a.steps == 0 || a.rounds == 0 {
        bail!("--steps and --rounds must be at least 1");
    }
    // The kernels' switches (BRAID_ATTENTION, BRAID_CUBLASLT_*, ...): a value
    // naming no choice would otherwise time the default under its label.
    braid_gpt2::kernels::switches::check_environment()?;
    let count = braid::cuda::cuda_available()
        .context("gpt2_gpu needs a CUDA GPU; no usable CUDA driver")?;
    if a.device >= count {
        bail!(
            "gpt2_gpu needs CUDA device {}, but this machine has {count}",
            a.device
        );
    }

    // What the model allocates in fp32 without fusion (the figure is
    // printed for that layout only; the pool's high-water mark below is
    // measured for every layout).
    let plain = a.storage.dtype == Dtype::F32 && !a.storage.fusion().any();
    let np = cfg.num_parameters();
    let (b, t) = (a.batch_size, a.seq_len);
    let acts = ActivationLayout::stored(&cfg, b, t, Fusion::NONE, false, Dtype::F32).total * 4;
    let dacts =
        ActivationLayout::stored_gradients(&cfg, b, t, Fusion::NONE, Dtype::F32, GRADIENT_RING)
            .total
            * 4;
    let scratch = attention_scratch_bytes(b, t, cfg.channels, cfg.num_heads, Dtype::F32);
    let chunks_bound = np.div_ceil(braid_gpt2::optim::MAX_CHUNK) + cfg.num_layers + 3;
    let optim = 2 * np * 4 + chunks_bound * (NORM_SCRATCH + 1) * 8;
    let planned = (2 * np * 4 + acts + dacts + scratch + optim) as f64;
    println!(
        "gpt2_gpu: model {} ({np} parameters), B {b} x T {t} = {} tokens per step, {}, \
         fused kernels: {}, {} compute streams, {other} vs single",
        a.model,
        b * t,
        a.storage.dtype,
        a.storage.fusion(),
        a.streams
    );
    if plain {
        println!(
            "buffers: params+grads {:.2} GiB, activations {:.2} GiB, activation grads {:.2} GiB, \
         attention scratch {:.2} GiB, AdamW {:.2} GiB: {:.2} GiB",
            gib((2 * np * 4) as f64),
            gib(acts as f64),
            gib(dacts as f64),
            gib(scratch as f64),
            gib(optim as f64),
            gib(planned)
        );
    }

    let params = init_params(&cfg, a.seed);
    let policies = [Policy::Single, other];
    let mut tallies: Vec<Tally> = policies.iter().map(|_| Tally::default()).collect();
    let mut mem = Memory::default();
    if a.interleave {
        // Both models live; measured steps alternate one by one.
        let mut runs = Vec::new();
        for &policy in &policies {
            let mut run = Run::new(&a, &cfg, policy, &params)?;
            mem.device_line(&run.rt);
            for _ in 0..a.warmup {
                run.step(cfg.vocab_size)?;
            }
            run.rt.clear_profile();
            runs.push(run);
        }
        let n = a.steps * a.rounds;
        let mut times: Vec<Vec<f64>> = (0..2).map(|_| Vec::with_capacity(n)).collect();
        let mut loss = [f32::NAN; 2];
        for k in 0..n {
            let order = if k % 2 == 0 { [0, 1] } else { [1, 0] };
            for i in order {
                let t0 = Instant::now();
                loss[i] = runs[i].step(cfg.vocab_size)?;
                times[i].push(t0.elapsed().as_secs_f64());
            }
        }
        for (i, run) in runs.iter_mut().enumerate() {
            mem.sample(&run.rt);
            let summary = run.rt.profile().summary();
            tallies[i].add(
                "interleaved",
                policies[i],
                &times[i],
                &summary,
                loss[i],
                b * t,
            );
            trace_one_step(&a, &cfg, run, policies[i])?;
        }
    } else {
        for round in 0..a.rounds {
            let order = if round % 2 == 0 { [0, 1] } else { [1, 0] };
            for i in order {
                let policy = policies[i];
                let mut run = Run::new(&a, &cfg, policy, &params)?;
                mem.device_line(&run.rt);
                for _ in 0..a.warmup {
                    run.step(cfg.vocab_size)?;
                }
                run.rt.clear_profile();
                let mut times = Vec::with_capacity(a.steps);
                let mut loss = f32::NAN;
                for _ in 0..a.steps {
                    let t0 = Instant::now();
                    loss = run.step(cfg.vocab_size)?;
                    times.push(t0.elapsed().as_secs_f64());
                }
                mem.sample(&run.rt);
                let summary = run.rt.profile().summary();
                tallies[i].add(
                    &format!("round {round}"),
                    policy,
                    &times,
                    &summary,
                    loss,
                    b * t,
                );
                if round + 1 == a.rounds {
                    trace_one_step(&a, &cfg, &mut run, policy)?;
                }
                // Frees the model before the next one is allocated.
                drop(run);
            }
        }
    }
    let device_line = mem.device.clone();
    let (peak_pool, peak_used) = (mem.pool_high, mem.used);

    println!();
    if let Some(d) = &device_line {
        println!("{d}");
    }
    let tokens = (b * t) as f64;
    let peak = a.peak_tflops.unwrap_or(match a.storage.dtype {
        Dtype::Bf16 => 989.0,
        Dtype::F32 => 67.0,
    });
    let step_flops = flops_per_token(&cfg, t) * tokens;
    let mut step_of = Vec::new();
    for (p, tally) in policies.iter().zip(&tallies) {
        let step = median(&tally.step_s);
        step_of.push(step);
        let busy: Vec<String> = (0..tally.busy_ms.first().map_or(0, Vec::len))
            .map(|s| {
                let v: Vec<f64> = tally
                    .busy_ms
                    .iter()
                    .filter_map(|r| r.get(s).copied())
                    .collect();
                format!("{:.1}", mean(&v))
            })
            .collect();
        println!(
            "{:<12} step {:>8.1} ms (median of {} steps; mean {:.1})  {:>9.0} tokens/s  \
             MFU {:.1}%  2+ streams busy {:>4.1}% of the step  critical path {:.1} ms  busy \
             per stream [{}] ms  comm hidden {:.0}% (one GPU: no collectives)",
            p.name(),
            step * 1e3,
            tally.step_s.len(),
            mean(&tally.step_s) * 1e3,
            tokens / step,
            100.0 * step_flops / step / (peak * 1e12),
            100.0 * mean(&tally.overlap),
            mean(&tally.critical_ms),
            busy.join(", "),
            100.0 * mean(&tally.hidden)
        );
    }
    println!(
        "MFU: {:.2} TFLOP a step ({:.0} per token, 6N + 12LCT) over the median step, \
         as a share of {peak} TFLOP/s (--peak-tflops)",
        step_flops / 1e12,
        flops_per_token(&cfg, t)
    );
    println!(
        "speed-up of {} over single: {:.3}x (step time single / {})",
        other.name(),
        step_of[0] / step_of[1],
        other.name()
    );
    println!(
        "peak device memory: {:.2} GiB high-water of the allocation pool (live buffers), {:.2} \
         GiB in use on the device after the measured steps (cuMemGetInfo: pool reserve, \
         contexts, cuBLAS workspaces){}",
        gib(peak_pool as f64),
        gib(peak_used as f64),
        if plain {
            format!("; {:.2} GiB of model buffers planned", gib(planned))
        } else {
            String::new()
        }
    );
    // What ran the attention when BRAID_ATTENTION=cudnn asked for cuDNN.
    for line in braid_gpt2::kernels::flash_attention::cudnn_report() {
        println!("{line}");
    }
    Ok(())
}

//! Two programs on one node: a latency-critical one (GPT-2 `tiny` forward
//! at batch 1, requests at a fixed rate) beside a best-effort GPT-2 training
//! run (2 CPU ranks by default; one GPU rank with `--device cuda`), threads
//! of one process, each with its own runtime (on CUDA both on device 0: the
//! latency-critical runtime's streams at the context's greatest priority,
//! the best-effort one's launches held back while it has work). Each is
//! measured alone, then both together, with their classes
//! (`latency-critical`, `best-effort`) and, as the baseline, both `normal`
//! (what sharing did before classes existed), all in the same run. Prints
//! latency p50/p99 and training throughput for each, and ends with
//! `lc_p99_ratio=<shared/solo> be_throughput_ratio=<shared/solo>` for the
//! run with classes. Figures only; nothing is asserted.
//!
//! Each program runs alone as it runs by default: the serving program as
//! latency-critical, the training run as `normal` (since 2026-11-29; before,
//! it ran alone as best-effort too). So `be_throughput_ratio` counts what
//! being best-effort costs the training as well as what sharing does: on
//! CUDA, no graphs and launches in 1 ms bundles; on the CPU, the idle
//! policy and the core budget of best-effort runtimes.
//!
//! The flags are checked before anything runs (an unknown `--be-model`, a
//! `--request-tokens` or `--be-seq-len` longer than its model takes, a
//! batch the training refuses), each error naming its flag. A training
//! model whose vocabulary is smaller than GPT-2's (`--be-model tiny`, 512
//! ids) trains on the built-in data's ids folded into its vocabulary (id
//! modulo the vocabulary size).
//!
//! A request is one forward pass: upload the tokens, run the model, read the
//! logits back; its latency runs from the moment it is due (a fixed
//! schedule, `--period-ms` apart) to the logits in hand, so a request that
//! could not start on time counts its wait. Training throughput leaves the
//! first step (recording, warm-up) out, so `--be-steps` is at least 2 (and
//! `--requests` at least 1). A shared run that served no request (the
//! training run ended before the first was due) says "no requests were
//! served", and its latency figures in the last line are NaN.
//!
//! The shared runs also split the requests by when they were due: before
//! the training run's first step ended (its start: allocation, kernel
//! loading, cuBLAS set-up, the first step) and after (its steady state),
//! and print the p99 of each. On a GPU the start dominates the tail: module
//! loads and large allocations stall every stream of the device, whatever
//! its priority. `lc_p99_steady_ratio` (the steady state's p99 over the solo
//! p99) follows the last line's two figures. To say where the tail comes
//! from, each shared run also prints its slowest requests (when they were
//! due, from the moment both programs started) beside the training run's
//! timeline: when each of its steps ended and when it returned.
//!
//! A p99 of a few hundred requests rests on two or three of them, so each
//! shared run also prints a 90% bootstrap interval of its p99 ratio and the
//! share of its requests slower than the solo p99 (about 1% when sharing
//! costs nothing); the last line ends with that share, `lc_over_solo_p99`.
//!
//! With `--be-spare-sms N` (CUDA) the best-effort training run's kernels
//! stay off N of the device's SMs (`RuntimeBuilder::spare_sms`), which the
//! requests' kernels then always find free: a GPU cannot preempt a running
//! kernel, so without it a request waits for the training blocks ahead of
//! it to finish.
//!
//! With `--realtime` the latency-critical runtime's threads (and the
//! thread serving its requests) run at a real-time policy where the OS
//! allows it (`RuntimeBuilder::realtime`).
//!
//! With `--be-bundle-us N` (CUDA) the best-effort training run keeps at
//! most about N µs of device work launched and unfinished on each stream
//! (`RuntimeBuilder::device_bundle`; 1,000 by default): what a request's
//! kernels may find running beside them.
//!
//! With `--lc-replay` the latency-critical program records its forward pass
//! once and replays it per request (on CUDA one graph launch), as serving
//! programs do; alone and shared alike.
//!
//! `cargo run --release -p braid-benches --bin multi_tenant -- --requests 150 --period-ms 20`
//! `… -- --device cuda --be-model gpt2 --be-batch-size 8 --be-seq-len 1024 --period-ms 5`

use anyhow::{Context, Result};
use braid::{BackendKind, Class, Runtime, Schedule};
use braid_benches::cli;
use braid_gpt2::config::Gpt2Config;
use braid_gpt2::data::{Split, TokenSource};
use braid_gpt2::model::{init_params, Dtype, Gpt2Model};
use braid_gpt2::trainer::{train, StartState, TrainOptions};
use clap::Parser;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

#[derive(Parser, Debug)]
#[command(about = "A latency-critical program beside a best-effort one: alone and together")]
struct Args {
    /// Requests of the solo latency-critical run (the shared runs issue
    /// requests for as long as training lasts). At least 1.
    #[arg(long, default_value_t = 150, value_parser = parse_requests)]
    requests: usize,
    /// Time between requests, ms (above 0: a request's latency counts from
    /// when it is due).
    #[arg(long, default_value_t = 20.0, value_parser = cli::positive_f64)]
    period_ms: f64,
    /// Tokens per request (batch 1).
    #[arg(long, default_value_t = 64, value_parser = cli::at_least(1))]
    request_tokens: usize,
    /// The training run's model.
    #[arg(long, default_value = "small")]
    be_model: String,
    /// Training steps (the first is left out of the throughput, so at
    /// least 2).
    #[arg(long, default_value_t = 12, value_parser = parse_be_steps)]
    be_steps: u64,
    /// Training ranks: CPU threads (default 2), or GPUs from device 0 with
    /// `--device cuda` (default 1).
    #[arg(long, value_parser = cli::cpu_ranks)]
    be_ranks: Option<usize>,
    /// Training sequences per step.
    #[arg(long, default_value_t = 4, value_parser = cli::at_least(1))]
    be_batch_size: usize,
    /// Training tokens per sequence.
    #[arg(long, default_value_t = 64, value_parser = cli::at_least(1))]
    be_seq_len: usize,
    /// Rounds of the whole measurement (each program alone, then together),
    /// the last line giving the median of the rounds' ratios: on a shared,
    /// noisy machine one round's p99 ratio spreads widely.
    #[arg(long, default_value_t = 1, value_parser = cli::at_least(1))]
    rounds: usize,
    /// cpu, or cuda (both programs on GPU 0; the training run in bf16, with
    /// one rank unless --be-ranks says otherwise).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// The latency-critical runtime's threads at a real-time policy
    /// (`RuntimeBuilder::realtime`: SCHED_FIFO, where the OS allows it),
    /// alone and shared alike.
    #[arg(long)]
    realtime: bool,
    /// On CUDA, SMs the training run leaves to the latency-critical one
    /// (`RuntimeBuilder::spare_sms`: its compute streams in a green context
    /// over the others), in the shared run with classes only: alone it
    /// trains on every SM, so the throughput ratio counts what sparing
    /// costs. Default 0: every SM.
    #[arg(long, default_value_t = 0)]
    be_spare_sms: u32,
    /// The latency-critical program records its forward pass once and
    /// replays it for each request (`Runtime::record`; on CUDA one graph
    /// launch, graphs being the default there), alone and shared alike, as
    /// a serving program would; else each request submits its tasks.
    #[arg(long)]
    lc_replay: bool,
    /// On CUDA, the best-effort training run's launch window in µs
    /// (`RuntimeBuilder::device_bundle`: the device time of its launched,
    /// unfinished kernels each stream keeps at most), in the shared run with
    /// classes. Default: the builder's, 1,000.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    be_bundle_us: Option<u64>,
}

/// `--requests`: the solo run's percentiles need at least one request.
fn parse_requests(s: &str) -> std::result::Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("0 requests: the solo run needs at least 1 to measure a latency".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("{e}")),
    }
}

/// `--be-steps`: the first step is left out of the throughput, so one step
/// leaves nothing to measure.
fn parse_be_steps(s: &str) -> std::result::Result<u64, String> {
    match s.parse::<u64>() {
        Ok(n @ (0 | 1)) => Err(format!(
            "{n} training step(s): at least 2 are needed, the first being left out of the \
             throughput"
        )),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("{e}")),
    }
}

impl Args {
    /// Checks the flags that the arguments' parsers cannot check alone,
    /// before anything runs; each error names its flag.
    fn check(&self) -> Result<()> {
        let backend = self.backend()?;
        let lc = Gpt2Config::tiny();
        if self.request_tokens > lc.max_seq_len {
            anyhow::bail!(
                "--request-tokens {}: the latency-critical model (GPT-2 `tiny`) takes at most {} \
                 tokens",
                self.request_tokens,
                lc.max_seq_len
            );
        }
        let cfg = self.be_config()?;
        if self.be_seq_len > cfg.max_seq_len {
            anyhow::bail!(
                "--be-seq-len {}: the training model (--be-model {}) takes at most {} tokens",
                self.be_seq_len,
                self.be_model,
                cfg.max_seq_len
            );
        }
        let _ = backend;
        train_options(self, Class::Normal, (0, None))?
            .check()
            .context(
                "the training run's flags (--be-model, --be-batch-size, --be-seq-len, --be-ranks)",
            )?;
        Ok(())
    }

    /// The training run's model (`--be-model`).
    fn be_config(&self) -> Result<Gpt2Config> {
        Gpt2Config::from_name(&self.be_model).with_context(|| {
            format!(
                "--be-model {}: expected gpt2, gpt2-medium, gpt2-large, gpt2-xl, small or tiny",
                self.be_model
            )
        })
    }

    fn backend(&self) -> Result<BackendKind> {
        match self.device.as_str() {
            "cpu" => Ok(BackendKind::Cpu),
            "cuda" => Ok(BackendKind::Cuda { device: 0 }),
            other => anyhow::bail!("--device {other}: expected cpu or cuda"),
        }
    }
}

/// Latencies of a run of requests, ms.
struct Latency(Vec<f64>);

impl Latency {
    /// Percentile `p`; `None` when no request was served.
    fn pct(&self, p: f64) -> Option<f64> {
        let mut v = self.0.clone();
        v.sort_by(f64::total_cmp);
        pct_sorted(&v, p)
    }

    /// The share of the requests slower than `ms`.
    fn share_over(&self, ms: f64) -> f64 {
        self.0.iter().filter(|&&x| x > ms).count() as f64 / self.0.len().max(1) as f64
    }
}

/// Percentile `p` of the sorted `v` (nearest rank); `None` for an empty `v`.
fn pct_sorted(v: &[f64], p: f64) -> Option<f64> {
    let i = ((p * v.len() as f64).ceil() as usize).clamp(1, v.len().max(1)) - 1;
    v.get(i).copied()
}

/// A 90% interval of `shared`'s p99 over `solo`'s, from 1,000 bootstrap
/// resamples of each (with replacement, the same size). A p99 of 150
/// requests is their second slowest, so one stalled request moves it: the
/// interval says how far the ratio could have fallen by chance. The
/// generator is seeded, so the same latencies give the same interval.
/// `None` when either run served no request.
fn p99_ratio_interval(solo: &Latency, shared: &Latency) -> Option<(f64, f64)> {
    const RESAMPLES: usize = 1000;
    if solo.0.is_empty() || shared.0.is_empty() {
        return None;
    }
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move |n: usize| {
        // xorshift64*
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        (state.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 33) as usize % n
    };
    let mut resampled_p99 = |x: &[f64], buf: &mut Vec<f64>| {
        buf.clear();
        buf.extend((0..x.len()).map(|_| x[next(x.len())]));
        buf.sort_by(f64::total_cmp);
        pct_sorted(buf, 0.99).unwrap_or(f64::NAN)
    };
    let mut buf = Vec::new();
    let mut ratios: Vec<f64> = (0..RESAMPLES)
        .map(|_| {
            let a = resampled_p99(&shared.0, &mut buf);
            a / resampled_p99(&solo.0, &mut buf)
        })
        .collect();
    ratios.sort_by(f64::total_cmp);
    Some((pct_sorted(&ratios, 0.05)?, pct_sorted(&ratios, 0.95)?))
}

/// What one round measured, for the run with classes (the latency
/// figures NaN when the shared run served no request).
#[derive(Clone, Copy)]
struct Figures {
    /// Shared p99 over solo p99.
    p99_ratio: f64,
    /// Training throughput shared over solo.
    throughput_ratio: f64,
    /// The p99 of the requests due after the training run's first step,
    /// over the solo p99.
    steady_ratio: f64,
    /// The share of shared requests slower than the solo p99 (about 0.01
    /// if sharing cost nothing).
    over_solo_p99: f64,
}

/// The training run's timeline in a shared run, from one clock.
struct Timeline {
    /// When both programs started.
    t0: Instant,
    /// Set when the training run's first step has ended.
    steady: AtomicBool,
    /// When each step ended, ms after `t0`.
    step_ends: Mutex<Vec<f64>>,
}

impl Timeline {
    fn ms(&self) -> f64 {
        self.t0.elapsed().as_secs_f64() * 1e3
    }
}

/// What a run of requests measured.
struct Served {
    /// Every request's latency.
    all: Latency,
    /// The latencies of the requests due after the training run's first step.
    steady: Latency,
    /// The slowest requests: (due, ms after the timeline's start; latency).
    slowest: Vec<(f64, f64)>,
}

/// Serves requests at a fixed rate until `count` are done or `stop` is set;
/// with a training run's `timeline`, also sorts the requests by when they
/// were due against it.
fn serve(
    a: &Args,
    class: Class,
    count: usize,
    stop: Option<&AtomicBool>,
    timeline: Option<&Timeline>,
) -> Result<Served> {
    let cfg = Gpt2Config::tiny();
    let rt = Runtime::builder()
        .backend(a.backend()?)
        .compute_streams(1)
        .class(class)
        .realtime(a.realtime && class == Class::LatencyCritical)
        .build()?;
    let mut model = Gpt2Model::new(&rt, &cfg, 1, a.request_tokens)?;
    model.upload_params(&rt, &init_params(&cfg, 7))?;
    let tokens: Vec<u32> = (0..a.request_tokens as u32)
        .map(|i| (i * 37 + 11) % cfg.vocab_size as u32)
        .collect();
    // Warm-up: the first passes allocate and measure.
    for _ in 0..5 {
        request(&rt, &mut model, &tokens, None)?;
    }
    // With --lc-replay, the forward pass (on the tokens uploaded before each
    // replay) recorded once; its first replays capture and warm it.
    let recorded = if a.lc_replay {
        let e = |e: braid_gpt2::error::Gpt2Error| braid::Error::Config(e.to_string());
        let s = rt.record("request", |rt| model.forward_uploaded(rt).map_err(e))?;
        model.read_logits(&rt)?;
        for _ in 0..3 {
            request(&rt, &mut model, &tokens, Some(&s))?;
        }
        Some(s)
    } else {
        None
    };
    let period = Duration::from_secs_f64(a.period_ms / 1e3);
    let start = Instant::now();
    let (mut lat, mut steady_lat, mut slowest) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0.. {
        let done = stop.map_or(i >= count, |s| s.load(Ordering::Acquire));
        if done {
            break;
        }
        let due = start + period * i as u32;
        if let Some(wait) = due.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
        let in_steady_state = timeline.is_some_and(|t| t.steady.load(Ordering::Acquire));
        request(&rt, &mut model, &tokens, recorded.as_ref())?;
        let ms = due.elapsed().as_secs_f64() * 1e3;
        lat.push(ms);
        if in_steady_state {
            steady_lat.push(ms);
        }
        if let Some(t) = timeline {
            let due_ms = due.saturating_duration_since(t.t0).as_secs_f64() * 1e3;
            slowest.push((due_ms, ms));
        }
    }
    slowest.sort_by(|x, y| y.1.total_cmp(&x.1));
    slowest.truncate(SLOWEST);
    Ok(Served {
        all: Latency(lat),
        steady: Latency(steady_lat),
        slowest,
    })
}

/// One request: the tokens uploaded, the forward pass (submitted, or the
/// `recorded` one replayed), the logits read back.
fn request(
    rt: &Runtime,
    model: &mut Gpt2Model,
    tokens: &[u32],
    recorded: Option<&Schedule<'_>>,
) -> Result<()> {
    match recorded {
        Some(s) => {
            model.upload_batch(rt, tokens, None)?;
            s.replay()?;
        }
        None => model.forward(rt, tokens, None)?,
    }
    model.read_logits(rt)?;
    Ok(())
}

/// How many of a shared run's slowest requests it prints.
const SLOWEST: usize = 5;

/// The training run's options: of `class`, leaving `spare_sms` to other
/// programs, with a launch window of `bundle_us`.
fn train_options(
    a: &Args,
    class: Class,
    (spare_sms, bundle_us): (u32, Option<u64>),
) -> Result<TrainOptions> {
    let cfg = a.be_config()?;
    let backend = a.backend()?;
    let gpu = matches!(backend, BackendKind::Cuda { .. });
    Ok(TrainOptions {
        model: cfg,
        batch_size: a.be_batch_size,
        seq_len: a.be_seq_len,
        steps: a.be_steps,
        backend,
        ranks: a.be_ranks.unwrap_or(if gpu { 1 } else { 2 }),
        class: Some(class),
        spare_sms,
        device_bundle: bundle_us.map(Duration::from_micros),
        dtype: if gpu { Dtype::Bf16 } else { Dtype::F32 },
        trace: None,
        ..TrainOptions::default()
    })
}

/// The built-in training data, its GPT-2 token ids folded into a smaller
/// vocabulary of `vocab` ids (id modulo `vocab`) where they do not fit
/// (`--be-model tiny`).
fn training_data(vocab: usize) -> Result<TokenSource> {
    let data = TokenSource::builtin(Split::Train)?;
    if data.check_vocab(vocab).is_ok() {
        return Ok(data);
    }
    let folded: Vec<u16> = data
        .tokens()
        .iter()
        .map(|&t| (usize::from(t) % vocab) as u16)
        .collect();
    let origin = format!("{} (ids modulo {vocab})", data.origin());
    Ok(TokenSource::from_tokens(folded, origin))
}

/// Trains, leaving `spare_sms` to other programs, and returns tokens/s over
/// the steps after the first; records its steps in `timeline`, if given.
fn train_be(
    a: &Args,
    class: Class,
    levers: (u32, Option<u64>),
    timeline: Option<&Timeline>,
) -> Result<f64> {
    let opts = train_options(a, class, levers)?;
    let data = training_data(opts.model.vocab_size)?;
    let report = train(&opts, StartState::fresh(&opts.model, 1), &data, &|_| {
        if let Some(t) = timeline {
            t.step_ends.lock().expect("timeline").push(t.ms());
            t.steady.store(true, Ordering::Release);
        }
    })?;
    if let Some((n, of)) = report.spared_sms {
        println!("  the training run left {n} of the device's {of} SMs to the requests");
    }
    let steps = report.steps.get(1..).unwrap_or_default();
    if steps.is_empty() {
        anyhow::bail!(
            "the training run ended after {} step(s): no step after the first to measure",
            report.steps.len()
        );
    }
    let tokens: usize = steps.iter().map(|s| s.tokens).sum();
    let secs: f64 = steps.iter().map(|s| s.seconds).sum();
    Ok(tokens as f64 / secs.max(1e-9))
}

/// Both programs at once: training in a thread, requests while it runs.
/// Returns the requests' measures, the training throughput, and the
/// training run's step ends and return (ms after both started).
fn shared(a: &Args, lc: Class, be: Class) -> Result<(Served, f64, Vec<f64>, f64)> {
    let stop = AtomicBool::new(false);
    let timeline = Timeline {
        t0: Instant::now(),
        steady: AtomicBool::new(false),
        step_ends: Mutex::new(Vec::new()),
    };
    std::thread::scope(|s| {
        let trainer = s.spawn(|| {
            // Only the run with classes spares SMs; the baseline with both
            // normal shares the device as before classes existed.
            let levers = match be {
                Class::BestEffort => (a.be_spare_sms, a.be_bundle_us),
                _ => (0, None),
            };
            let r = train_be(a, be, levers, Some(&timeline));
            let returned = timeline.ms();
            stop.store(true, Ordering::Release);
            (r, returned)
        });
        let served = on_own_thread(|| serve(a, lc, 0, Some(&stop), Some(&timeline)));
        let (tput, returned) = trainer.join().expect("the training thread panicked");
        let ends = std::mem::take(&mut *timeline.step_ends.lock().expect("timeline"));
        Ok((served?, tput?, ends, returned))
    })
}

/// One round: each program alone, then both together without and with
/// classes. Returns the run with classes' figures.
fn round(a: &Args) -> Result<Figures> {
    let solo_lc = on_own_thread(|| serve(a, Class::LatencyCritical, a.requests, None, None))?.all;
    let (Some(solo_p50), Some(solo_p99)) = (solo_lc.pct(0.5), solo_lc.pct(0.99)) else {
        anyhow::bail!("latency-critical alone: no requests were served");
    };
    println!(
        "latency-critical alone: {} requests, p50 {solo_p50:.3} ms, p99 {solo_p99:.3} ms",
        solo_lc.0.len(),
    );
    // The training run alone as it runs by default (normal): the ratio
    // then counts what being best-effort costs it too.
    let solo_be = train_be(a, Class::Normal, (0, None), None)?;
    println!("training alone (normal, as it runs by default): {solo_be:.0} tokens/s");
    let mut last = None;
    for (label, lc, be) in [
        ("both normal (no classes)", Class::Normal, Class::Normal),
        (
            "latency-critical + best-effort",
            Class::LatencyCritical,
            Class::BestEffort,
        ),
    ] {
        let (served, tput, ends, returned) = shared(a, lc, be)?;
        let (lat, steady) = (&served.all, &served.steady);
        let ratio = tput / solo_be;
        let (Some(p50_ms), Some(p99_ms), Some((lo, hi))) = (
            lat.pct(0.5),
            lat.pct(0.99),
            p99_ratio_interval(&solo_lc, lat),
        ) else {
            // The training run ended before the first request was due.
            println!(
                "together, {label}: no requests were served; training {tput:.0} tokens/s \
                 ({ratio:.2}x alone as normal)"
            );
            last = Some(Figures {
                p99_ratio: f64::NAN,
                throughput_ratio: ratio,
                steady_ratio: f64::NAN,
                over_solo_p99: f64::NAN,
            });
            continue;
        };
        let p99 = p99_ms / solo_p99;
        let over = lat.share_over(solo_p99);
        println!(
            "together, {label}: {} requests, p50 {p50_ms:.3} ms, p99 {p99_ms:.3} ms ({p99:.2}x \
             alone, 90% interval {lo:.2}-{hi:.2}x by resampling; {:.1}% of requests slower \
             than the solo p99); training {tput:.0} tokens/s ({ratio:.2}x alone as normal)",
            lat.0.len(),
            over * 100.0,
        );
        let steady_p99 = steady.pct(0.99).unwrap_or(f64::NAN);
        let steady_ratio = steady_p99 / solo_p99;
        println!(
            "  of which due after the training run's first step: {} requests, p99 {:.3} ms \
             ({steady_ratio:.2}x alone)",
            steady.0.len(),
            steady_p99,
        );
        let slowest: Vec<String> = served
            .slowest
            .iter()
            .map(|(due, ms)| format!("+{due:.0} ({ms:.1} ms)"))
            .collect();
        let ends: Vec<String> = ends.iter().map(|e| format!("+{e:.0}")).collect();
        println!(
            "  slowest requests, due at ms after the start: {}; training steps ended at {}, \
             the run returned at +{returned:.0}",
            slowest.join(", "),
            ends.join(", ")
        );
        last = Some(Figures {
            p99_ratio: p99,
            throughput_ratio: ratio,
            steady_ratio,
            over_solo_p99: over,
        });
    }
    Ok(last.expect("the run with classes ran"))
}

/// The median of `x` (the mean of the middle two for an even count).
fn median(mut x: Vec<f64>) -> f64 {
    x.sort_by(f64::total_cmp);
    let n = x.len();
    if n % 2 == 1 {
        x[n / 2]
    } else {
        (x[n / 2 - 1] + x[n / 2]) / 2.0
    }
}

/// Runs `f` on a thread of its own: a thread that submits to a real-time
/// latency-critical runtime takes `SCHED_FIFO` for good, and threads it
/// starts later inherit it (the training run's among them).
fn on_own_thread<T: Send>(f: impl FnOnce() -> T + Send) -> T {
    std::thread::scope(|s| s.spawn(f).join().expect("the serving thread panicked"))
}

/// Whether a latency-critical runtime's stream thread got `SCHED_FIFO`
/// (`--realtime`): the OS may refuse it (no `CAP_SYS_NICE`, `ulimit -r` 0).
/// Read from `/proc/thread-self/stat` (field 41, the policy: 1 is FIFO).
fn realtime_granted(a: &Args) -> Result<bool> {
    let rt = Runtime::builder()
        .backend(a.backend()?)
        .compute_streams(1)
        .class(Class::LatencyCritical)
        .realtime(true)
        .build()?;
    // A body for either backend (a CPU-only `run` has no body on CUDA):
    // each reads the policy of the stream thread it runs on.
    fn policy() -> u32 {
        let stat = std::fs::read_to_string("/proc/thread-self/stat").unwrap_or_default();
        let after_name = stat.rsplit(')').next().unwrap_or("");
        after_name
            .split_whitespace()
            .nth(41 - 3)
            .and_then(|p| p.parse().ok())
            .unwrap_or(0)
    }
    let seen = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
    let (on_cpu, on_gpu) = (seen.clone(), seen.clone());
    rt.task("policy").run_any(
        (),
        move |()| on_cpu.store(policy(), Ordering::Relaxed),
        move |(), _| on_gpu.store(policy(), Ordering::Relaxed),
    )?;
    rt.synchronize()?;
    Ok(seen.load(Ordering::Relaxed) == 1)
}

fn main() -> Result<()> {
    let a = Args::parse();
    a.check()?;
    braid_gpt2::kernels::switches::check_environment()?;
    if a.realtime {
        let granted = on_own_thread(|| realtime_granted(&a))?;
        println!(
            "real-time latency-critical threads: {}",
            if granted {
                "SCHED_FIFO granted"
            } else {
                "refused by the OS (default policy)"
            }
        );
    }
    let mut rounds = Vec::new();
    for r in 0..a.rounds {
        if a.rounds > 1 {
            println!("round {}:", r + 1);
        }
        rounds.push(round(&a)?);
    }
    let pick = |f: fn(&Figures) -> f64| median(rounds.iter().map(f).collect());
    if a.rounds > 1 {
        println!("medians of {} rounds:", rounds.len());
    }
    println!(
        "lc_p99_ratio={:.3} be_throughput_ratio={:.3} lc_p99_steady_ratio={:.3} \
         lc_over_solo_p99={:.4}",
        pick(|r| r.p99_ratio),
        pick(|r| r.throughput_ratio),
        pick(|r| r.steady_ratio),
        pick(|r| r.over_solo_p99),
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `--requests 0` and `--be-steps` below 2 are refused when the
    /// arguments are parsed, saying why (they panicked in the percentiles,
    /// or printed 0 tokens/s and a NaN ratio).
    #[test]
    fn counts_that_measure_nothing_are_refused() {
        let parse = |args: &[&str]| {
            Args::try_parse_from(std::iter::once("multi_tenant").chain(args.iter().copied()))
        };
        let err = parse(&["--requests", "0"]).unwrap_err().to_string();
        assert!(err.contains("at least 1"), "{err}");
        for steps in ["0", "1"] {
            let err = parse(&["--be-steps", steps]).unwrap_err().to_string();
            assert!(err.contains("at least 2"), "{err}");
        }
        let a = parse(&["--requests", "1", "--be-steps", "2"]).unwrap();
        assert_eq!((a.requests, a.be_steps), (1, 2));
        assert!(parse(&["--requests", "x"]).is_err());
    }

    /// An empty latency list has no percentiles and no interval (a shared
    /// run that served no request), rather than a panic.
    #[test]
    fn no_requests_have_no_percentiles() {
        let none = Latency(Vec::new());
        let some = Latency(vec![3.0, 1.0, 2.0]);
        assert_eq!(none.pct(0.99), None);
        assert_eq!(some.pct(0.5), Some(2.0));
        assert_eq!(some.pct(0.99), Some(3.0));
        assert_eq!(p99_ratio_interval(&some, &none), None);
        assert_eq!(p99_ratio_interval(&none, &some), None);
        assert_eq!(
            p99_ratio_interval(&some, &some).map(|(lo, _)| lo > 0.0),
            Some(true)
        );
        assert_eq!(none.share_over(1.0), 0.0);
    }
}

//! Per-task cost of dependency inference plus dispatch: submits N empty tasks
//! of a given shape and times submission through completion.
//!
//! `--mode eager` (the default) submits every task through inference and
//! placement, automatic replay off. `--mode auto` leaves automatic replay on
//! and warms up with enough identical steps that the timed ones are submitted
//! from the memoised analysis (each repetition is one step: submit, then
//! synchronize). `--mode replay` (or `--replay`) records the shape once
//! (`Runtime::record`) and times one replay of it per repetition.
//! `--mode graph` does the same with `RuntimeBuilder::graphs` on: each
//! replay is one unit, on the CPU every task in order on one stream thread
//! (the cost of the unit's bookkeeping and of the bodies' calls, with no
//! hand-off between threads; on CUDA this would be one graph launch).
//!
//! `--held` splits the eager cost in two: every stream thread is first held
//! by a task that blocks until all N tasks are submitted, so submission
//! (inference, placement, hand-off, with no stream thread running beside
//! it) and execution (the stream threads draining their queues, with no
//! submitter beside them) are timed apart; the line then also gives
//! `submit_ns_per_task=` and `drain_ns_per_task=` (medians). Their sum
//! against the plain eager figure is what running the two sides at once
//! costs (cross-core traffic and wake-ups).
//!
//! `cargo run --release -p braid-benches --bin dag_overhead -- --shape chain --tasks 100000 [--mode replay]`

use braid::{BackendKind, Policy, Runtime};
use braid_benches::{buffers, cli, run, submit, Shape};
use clap::Parser;
use std::time::Instant;

#[derive(Parser, Debug)]
#[command(about = "Per-task overhead of Braid's dependency inference and dispatch")]
struct Args {
    /// chain, fanout, random or pingpong (a chain pinned alternately to
    /// streams 0 and 1: what a cross-stream hand-off costs, against chain).
    #[arg(long, default_value = "chain")]
    shape: Shape,
    /// Number of tasks (at least 1).
    #[arg(long, default_value_t = 100_000, value_parser = cli::at_least(1))]
    tasks: usize,
    /// Compute streams (at least 1; 2 for pingpong).
    #[arg(long, default_value_t = 2, value_parser = cli::at_least(1))]
    streams: usize,
    /// Placement policy.
    #[arg(long, default_value = "affinity")]
    policy: Policy,
    /// Repetitions (the best and the median are printed; at least 1).
    #[arg(long, default_value_t = 5, value_parser = cli::at_least(1))]
    reps: usize,
    /// eager, auto, replay or graph.
    #[arg(long, default_value = "eager")]
    mode: Mode,
    /// Same as `--mode replay`.
    #[arg(long)]
    replay: bool,
    /// Eager only: time submission and execution apart (see above).
    #[arg(long)]
    held: bool,
    /// The runtime's launch window (tasks submitted and not finished before
    /// the submitter waits; the builder's default when not given).
    #[arg(long, value_parser = cli::at_least(1))]
    window: Option<usize>,
    /// Every body on its stream's thread: no short task run by the
    /// submitter (`RuntimeBuilder::inline_short_tasks(false)`).
    #[arg(long)]
    no_inline: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Mode {
    Eager,
    Auto,
    Replay,
    Graph,
}

fn main() -> anyhow::Result<()> {
    let mut a = Args::parse();
    if a.replay {
        a.mode = Mode::Replay;
    }
    if a.shape == Shape::PingPong && a.streams < 2 {
        anyhow::bail!(
            "--shape pingpong alternates streams 0 and 1: it needs --streams 2 or more, not {}",
            a.streams
        );
    }
    if a.held && a.mode != Mode::Eager {
        anyhow::bail!(
            "--held times eager submission only (not with --mode {:?})",
            a.mode
        );
    }
    let mut builder = Runtime::builder()
        .backend(BackendKind::Cpu)
        .compute_streams(a.streams)
        .policy(a.policy)
        .auto_replay(a.mode == Mode::Auto)
        .graphs(a.mode == Mode::Graph)
        .inline_short_tasks(!a.no_inline);
    if let Some(w) = a.window {
        builder = builder.launch_window(w);
    }
    if a.held {
        // Room for every task of a repetition behind the held streams.
        builder = builder.launch_window(2 * a.tasks + 64);
    }
    let rt = builder.build()?;
    let bufs = buffers(&rt, a.shape, a.tasks)?;
    let mut ns = Vec::with_capacity(a.reps);
    let mut split: Vec<(f64, f64)> = Vec::new();
    if a.held {
        run(&rt, a.shape, a.tasks, &bufs)?; // warm-up
        for _ in 0..a.reps {
            let (sub, drain) = held(&rt, a.shape, a.tasks, &bufs, a.streams)?;
            let per = |d: std::time::Duration| d.as_nanos() as f64 / a.tasks as f64;
            split.push((per(sub), per(drain)));
            ns.push(per(sub + drain));
        }
    } else if matches!(a.mode, Mode::Replay | Mode::Graph) {
        let step = rt.record("shape", |rt| submit(rt, a.shape, a.tasks, &bufs))?;
        rt.synchronize()?;
        step.replay()?.wait()?; // warm-up
        for _ in 0..a.reps {
            let t = Instant::now();
            step.replay()?;
            rt.synchronize()?;
            ns.push(t.elapsed().as_nanos() as f64 / a.tasks as f64);
        }
        let (streams, waits) = step.placement();
        eprintln!("replayed placement: {streams} streams, {waits} cross-stream waits per replay");
    } else {
        // Warm-up; in auto mode enough identical steps to be memoised.
        let warm = if a.mode == Mode::Auto { 5 } else { 1 };
        for _ in 0..warm {
            run(&rt, a.shape, a.tasks, &bufs)?;
        }
        for _ in 0..a.reps {
            let t = Instant::now();
            run(&rt, a.shape, a.tasks, &bufs)?;
            ns.push(t.elapsed().as_nanos() as f64 / a.tasks as f64);
        }
    }
    ns.sort_by(f64::total_cmp);
    let s = rt.stats();
    let held_figures = if split.is_empty() {
        String::new()
    } else {
        let median = |mut v: Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        format!(
            " submit_ns_per_task={:.1} drain_ns_per_task={:.1}",
            median(split.iter().map(|x| x.0).collect()),
            median(split.iter().map(|x| x.1).collect())
        )
    };
    println!(
        "shape={:?} mode={}{} tasks={} streams={} policy={} ns_per_task={:.1} best_ns_per_task={:.1} waits={} elided_waits={} memoised={} inline={}{held_figures}",
        a.shape,
        format!("{:?}", a.mode).to_lowercase(),
        if a.held { "-held" } else { "" },
        a.tasks,
        a.streams,
        a.policy,
        ns[ns.len() / 2],
        ns[0],
        s.waits,
        s.elided_waits,
        s.auto_replayed,
        s.inline
    );
    Ok(())
}

/// One held repetition: each compute stream first runs a task that blocks
/// until every task of the shape is submitted; returns (submission time,
/// execution time after the release).
fn held(
    rt: &Runtime,
    shape: braid_benches::Shape,
    tasks: usize,
    bufs: &[braid::Buffer],
    streams: usize,
) -> anyhow::Result<(std::time::Duration, std::time::Duration)> {
    let release = std::sync::Arc::new(std::sync::Barrier::new(streams + 1));
    for s in 0..streams {
        let r = release.clone();
        rt.task("hold").on_stream(s).run((), move |_| {
            r.wait();
        })?;
    }
    let t = Instant::now();
    submit(rt, shape, tasks, bufs)?;
    let sub = t.elapsed();
    let t = Instant::now();
    release.wait();
    rt.synchronize()?;
    Ok((sub, t.elapsed()))
}

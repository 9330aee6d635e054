//! Per-task cost of dependency inference plus dispatch: submits N empty tasks
//! of a given shape and times submission through completion.
//!
//! `--mode eager` (the default) submits every task through inference and
//! placement, automatic replay off. `--mode auto` leaves automatic replay on
//! and warms up with enough identical steps that the timed ones are submitted
//! from the memoised analysis (each repetition is one step: submit, then
//! synchronize). `--mode replay` (or `--replay`) records the shape once
//! (`Runtime::record`) and times one replay of it per repetition.
//!
//! `cargo run --release -p braid-benches --bin dag_overhead -- --shape chain --tasks 100000 [--mode replay]`

use braid::{BackendKind, Policy, Runtime};
use braid_benches::{buffers, run, submit, Shape};
use clap::Parser;
use std::time::Instant;

#[derive(Parser, Debug)]
#[command(about = "Per-task overhead of Braid's dependency inference and dispatch")]
struct Args {
    /// chain, fanout, random or pingpong (a chain pinned alternately to
    /// streams 0 and 1: what a cross-stream hand-off costs, against chain).
    #[arg(long, default_value = "chain")]
    shape: Shape,
    /// Number of tasks.
    #[arg(long, default_value_t = 100_000)]
    tasks: usize,
    /// Compute streams.
    #[arg(long, default_value_t = 2)]
    streams: usize,
    /// Placement policy.
    #[arg(long, default_value = "affinity")]
    policy: Policy,
    /// Repetitions (the best and the median are printed).
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// eager, auto or replay.
    #[arg(long, default_value = "eager")]
    mode: Mode,
    /// Same as `--mode replay`.
    #[arg(long)]
    replay: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Mode {
    Eager,
    Auto,
    Replay,
}

fn main() -> anyhow::Result<()> {
    let mut a = Args::parse();
    if a.replay {
        a.mode = Mode::Replay;
    }
    let rt = Runtime::builder()
        .backend(BackendKind::Cpu)
        .compute_streams(a.streams)
        .policy(a.policy)
        .auto_replay(a.mode == Mode::Auto)
        .build()?;
    let bufs = buffers(&rt, a.shape, a.tasks)?;
    let mut ns = Vec::with_capacity(a.reps);
    if a.mode == Mode::Replay {
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
    println!(
        "shape={:?} mode={} tasks={} streams={} policy={} ns_per_task={:.1} best_ns_per_task={:.1} waits={} elided_waits={} memoised={}",
        a.shape,
        format!("{:?}", a.mode).to_lowercase(),
        a.tasks,
        a.streams,
        a.policy,
        ns[ns.len() / 2],
        ns[0],
        s.waits,
        s.elided_waits,
        s.auto_replayed
    );
    Ok(())
}

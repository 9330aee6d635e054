//! Per-task cost of dependency inference plus dispatch: submits N empty tasks
//! of a given shape and times submission through completion.
//!
//! With `--replay`, the shape is recorded once (`Runtime::record`) and each
//! repetition times one replay of it through completion: no inference, no
//! placement.
//!
//! `cargo run --release -p braid-benches --bin dag_overhead -- --shape chain --tasks 100000 [--replay]`

use braid::{BackendKind, Policy, Runtime};
use braid_benches::{buffers, run, submit, Shape};
use clap::Parser;
use std::time::Instant;

#[derive(Parser, Debug)]
#[command(about = "Per-task overhead of Braid's dependency inference and dispatch")]
struct Args {
    /// chain, fanout or random.
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
    /// Time replays of the recorded shape instead of eager submission.
    #[arg(long)]
    replay: bool,
}

fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    let rt = Runtime::builder()
        .backend(BackendKind::Cpu)
        .compute_streams(a.streams)
        .policy(a.policy)
        .build()?;
    let bufs = buffers(&rt, a.shape, a.tasks)?;
    let mut ns = Vec::with_capacity(a.reps);
    if a.replay {
        let step = rt.record("shape", |rt| submit(rt, a.shape, a.tasks, &bufs))?;
        rt.synchronize()?;
        step.replay()?.wait()?; // warm-up
        for _ in 0..a.reps {
            let t = Instant::now();
            step.replay()?;
            rt.synchronize()?;
            ns.push(t.elapsed().as_nanos() as f64 / a.tasks as f64);
        }
    } else {
        run(&rt, a.shape, a.tasks.min(10_000), &bufs)?; // warm-up
        for _ in 0..a.reps {
            let t = Instant::now();
            run(&rt, a.shape, a.tasks, &bufs)?;
            ns.push(t.elapsed().as_nanos() as f64 / a.tasks as f64);
        }
    }
    ns.sort_by(f64::total_cmp);
    let s = rt.stats();
    println!(
        "shape={:?} mode={} tasks={} streams={} policy={} ns_per_task={:.1} best_ns_per_task={:.1} waits={} elided_waits={}",
        a.shape,
        if a.replay { "replay" } else { "eager" },
        a.tasks,
        a.streams,
        a.policy,
        ns[ns.len() / 2],
        ns[0],
        s.waits,
        s.elided_waits
    );
    Ok(())
}

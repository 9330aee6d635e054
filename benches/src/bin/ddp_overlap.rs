//! Data-parallel training of a toy MLP on CPU ranks: gradient buckets
//! all-reduced during the backward pass (the `Reducer`) against the same
//! program with one all-reduce of all gradients after backward, in the same
//! run (alternating rounds, same runtime, same buffers). Prints the step
//! times, their ratio, and the share of communication time hidden under
//! computation (from the profile summary).
//!
//! `cargo run --release -p braid-benches --bin ddp_overlap -- --ranks 2`

use braid::comm::{BucketConfig, ReduceOp};
use braid::{launch, BackendKind, Reducer, Runtime};
use braid_benches::cli;
use braid_benches::toy_mlp::Mlp;
use clap::Parser;
use std::time::Instant;

#[derive(Parser, Debug)]
#[command(
    about = "Bucketed, overlapped all-reduce vs one all-reduce after backward (toy MLP, CPU ranks)"
)]
struct Args {
    /// Number of ranks (1 to 1,024).
    #[arg(long, default_value_t = 2, value_parser = cli::cpu_ranks)]
    ranks: usize,
    /// Layer widths, input first (at least two, each at least 1).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "256,768,768,768,768,128",
        value_parser = cli::at_least(1)
    )]
    dims: Vec<usize>,
    /// Rows per rank per step.
    #[arg(long, default_value_t = 32, value_parser = cli::at_least(1))]
    batch: usize,
    /// Compute streams per rank.
    #[arg(long, default_value_t = 2, value_parser = cli::at_least(1))]
    compute_streams: usize,
    /// Bucket cap, KiB.
    #[arg(long, default_value_t = 1024, value_parser = cli::at_least(1))]
    cap_kib: usize,
    /// First bucket's cap, KiB.
    #[arg(long, default_value_t = 256, value_parser = cli::at_least(1))]
    first_cap_kib: usize,
    /// Measured steps per mode per round.
    #[arg(long, default_value_t = 5, value_parser = cli::at_least(1))]
    steps: usize,
    /// Rounds (each runs both modes).
    #[arg(long, default_value_t = 6, value_parser = cli::at_least(1))]
    rounds: usize,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Mode {
    Bucketed,
    AfterBackward,
}

/// Per mode: step times (seconds), comm time, hidden comm time.
#[derive(Debug, Default, Clone)]
struct Stats {
    steps: Vec<f64>,
    comm_ns: u64,
    hidden_ns: u64,
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    anyhow::ensure!(a.dims.len() >= 2, "--dims needs at least two widths");
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let n_params: usize = a.dims.windows(2).map(|w| w[0] * w[1] + w[1]).sum();
    let flops = 6.0 * (a.batch * n_params) as f64;
    println!(
        "# ddp_overlap: {} ranks x {} compute streams, dims {:?}, batch {}/rank, {:.2} M params ({:.1} MiB of gradients), {:.0} MFLOP/step/rank, {cores} hardware threads",
        a.ranks,
        a.compute_streams,
        a.dims,
        a.batch,
        n_params as f64 / 1e6,
        n_params as f64 * 4.0 / (1 << 20) as f64,
        flops / 1e6
    );
    let cfg = BucketConfig::default()
        .cap_bytes(a.cap_kib << 10)
        .first_cap_bytes(a.first_cap_kib << 10);
    let results = launch(a.ranks, |rank, comm| {
        let rt = Runtime::builder()
            .backend(BackendKind::Cpu)
            .compute_streams(a.compute_streams)
            .comm_streams(1)
            .rank(rank)
            .profile(true)
            .build()?;
        let m = Mlp::new(&rt, &a.dims, a.batch)?;
        m.init(&rt, Some(&comm))?;
        let mut red = Reducer::new(comm.bind(&rt)?, &m.grads, m.specs(), cfg.clone())?;
        let mut step = 0u64;
        let mut run = |mode: Mode, red: &mut Reducer| -> braid::Result<f64> {
            let t = Instant::now();
            m.load_batch(&rt, step, rank * a.batch..(rank + 1) * a.batch)?;
            match mode {
                Mode::Bucketed => m.gradients(&rt, Some(red))?,
                Mode::AfterBackward => {
                    m.gradients(&rt, None)?;
                    comm.bind(&rt)?
                        .all_reduce::<f32>(&m.grads.whole(), ReduceOp::Avg)?;
                }
            }
            m.sgd(&rt, 1e-3)?;
            rt.synchronize()?;
            step += 1;
            Ok(t.elapsed().as_secs_f64())
        };
        // Warm-up, including the reducer's rebuild after its first step.
        for _ in 0..2 {
            run(Mode::Bucketed, &mut red)?;
            run(Mode::AfterBackward, &mut red)?;
        }
        let mut stats = [Stats::default(), Stats::default()];
        for _ in 0..a.rounds {
            for (k, mode) in [Mode::Bucketed, Mode::AfterBackward]
                .into_iter()
                .enumerate()
            {
                rt.clear_profile();
                for _ in 0..a.steps {
                    let t = run(mode, &mut red)?;
                    stats[k].steps.push(t);
                }
                let s = rt.profile().summary();
                stats[k].comm_ns += s.comm_ns;
                stats[k].hidden_ns += s.comm_hidden_ns;
            }
        }
        Ok((stats, red.buckets().len()))
    });
    let per_rank = results.into_iter().collect::<braid::Result<Vec<_>>>()?;
    let buckets = per_rank[0].1;
    println!(
        "{:<16} {:>12} {:>12} {:>12} {:>14}",
        "mode", "median_ms", "best_ms", "comm_ms/step", "hidden_share"
    );
    let mut med = [0.0; 2];
    for (k, name) in [
        (0, format!("bucketed ({buckets})")),
        (1, "after backward".to_string()),
    ] {
        // Step time: the slowest rank's median.
        let m = per_rank
            .iter()
            .map(|(s, _)| median(&s[k].steps))
            .fold(0.0, f64::max);
        let best = per_rank
            .iter()
            .map(|(s, _)| s[k].steps.iter().copied().fold(f64::INFINITY, f64::min))
            .fold(0.0, f64::max);
        let (comm, hidden): (u64, u64) = per_rank
            .iter()
            .map(|(s, _)| (s[k].comm_ns, s[k].hidden_ns))
            .fold((0, 0), |(a, b), (c, d)| (a + c, b + d));
        let n_steps = (per_rank.len() * per_rank[0].0[k].steps.len()) as f64;
        med[k] = m;
        println!(
            "{name:<16} {:>12.2} {:>12.2} {:>12.2} {:>13.0}%",
            m * 1e3,
            best * 1e3,
            comm as f64 / 1e6 / n_steps,
            if comm > 0 {
                100.0 * hidden as f64 / comm as f64
            } else {
                0.0
            }
        );
    }
    println!(
        "speed-up of bucketed over after-backward: {:.3}x (median step time ratio)",
        med[1] / med[0]
    );
    Ok(())
}

//! All-reduce bandwidth of the CPU collectives (`LocalComm`: ranks are threads
//! of this process), in the units nccl-tests uses:
//!
//! * `algbw = bytes / time` — the size of the data over the time of one
//!   all-reduce, as the slowest rank saw it;
//! * `busbw = algbw × 2(n − 1)/n` — what each rank's link would have to carry
//!   in a ring all-reduce, comparable across rank counts.
//!
//! Every rank submits `iters` in-place all-reduces back to back (they queue on
//! the comm stream) and synchronises; the time of one is the elapsed time over
//! `iters`, the maximum over ranks.
//!
//! `cargo run --release -p braid-benches --bin allreduce_bw -- --ranks 2,4`

use braid::comm::{Comm, ReduceOp};
use braid::{launch, BackendKind, Runtime};
use braid_benches::cli;
use clap::Parser;
use std::time::Instant;

#[derive(Parser, Debug)]
#[command(about = "All-reduce bandwidth of Braid's CPU collectives (nccl-tests units)")]
struct Args {
    /// Rank counts to measure, comma-separated (1 to 1,024).
    #[arg(long, value_delimiter = ',', default_value = "2,4", value_parser = cli::cpu_ranks)]
    ranks: Vec<usize>,
    /// Smallest message, bytes: a positive multiple of 4 (f32 elements).
    #[arg(long, default_value_t = 4 << 10, value_parser = parse_min_bytes)]
    min_bytes: usize,
    /// Largest message, bytes (at least --min-bytes).
    #[arg(long, default_value_t = 64 << 20)]
    max_bytes: usize,
    /// Size factor between consecutive messages (at least 2).
    #[arg(long, default_value_t = 4, value_parser = cli::at_least(2))]
    step_factor: usize,
    /// Bytes each rank moves per measurement (sets the iteration count:
    /// between 5 and 1000 all-reduces per size).
    #[arg(long, default_value_t = 512 << 20)]
    budget: usize,
    /// Out of place (separate input and output) instead of in place.
    #[arg(long)]
    out_of_place: bool,
}

/// `--min-bytes`: the messages are f32 elements, and every size measured is
/// this one times a power of `--step-factor`, so it must hold whole elements
/// (a size that does not would be reported as bytes the all-reduce never
/// moved).
fn parse_min_bytes(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(0) => Err("0 bytes: the smallest message needs at least one f32 (4 bytes)".into()),
        Ok(n) if n % 4 != 0 => Err(format!(
            "{n} bytes is not a multiple of 4: the messages are f32 elements"
        )),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("`{s}` is not a byte count: {e}")),
    }
}

fn measure(comm: &Comm, rt: &Runtime, bytes: usize, iters: usize, oop: bool) -> braid::Result<f64> {
    let comm = comm.bind(rt)?;
    let n = bytes / 4;
    let a = rt.alloc("send", n * 4)?;
    let b = rt.alloc("recv", n * 4)?;
    let (av, bv) = (a.whole(), b.whole());
    let once = || -> braid::Result<()> {
        if oop {
            comm.all_reduce_into::<f32>(&av, &bv, ReduceOp::Sum)?;
        } else {
            comm.all_reduce::<f32>(&av, ReduceOp::Sum)?;
        }
        Ok(())
    };
    // Warm up (page faults, thread wake-ups), then line the ranks up.
    for _ in 0..2 {
        once()?;
    }
    comm.barrier()?;
    rt.synchronize()?;
    let t = Instant::now();
    for _ in 0..iters {
        once()?;
    }
    rt.synchronize()?;
    Ok(t.elapsed().as_secs_f64() / iters as f64)
}

fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    if a.max_bytes < a.min_bytes {
        anyhow::bail!(
            "--max-bytes {} is below --min-bytes {}: no message size to measure",
            a.max_bytes,
            a.min_bytes
        );
    }
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    println!(
        "# braid CPU all-reduce (LocalComm, f32 sum, {}), {cores} hardware threads",
        if a.out_of_place {
            "out of place"
        } else {
            "in place"
        }
    );
    println!("# algbw = bytes / time; busbw = algbw * 2(n-1)/n (nccl-tests)");
    println!(
        "{:>6} {:>12} {:>7} {:>12} {:>12} {:>12}",
        "ranks", "bytes", "iters", "time_us", "algbw_GB/s", "busbw_GB/s"
    );
    let mut sizes = Vec::new();
    let mut s = Some(a.min_bytes);
    while let Some(bytes) = s.filter(|&b| b <= a.max_bytes) {
        sizes.push(bytes);
        s = bytes.checked_mul(a.step_factor);
    }
    for &w in &a.ranks {
        let sizes = &sizes;
        let results = launch(w, |rank, comm| {
            let rt = Runtime::builder()
                .backend(BackendKind::Cpu)
                .compute_streams(1)
                .comm_streams(1)
                .rank(rank)
                .build()?;
            sizes
                .iter()
                .map(|&bytes| {
                    let iters = (a.budget / bytes).clamp(5, 1000);
                    measure(&comm, &rt, bytes, iters, a.out_of_place).map(|t| (bytes, iters, t))
                })
                .collect::<braid::Result<Vec<_>>>()
        });
        let per_rank = results.into_iter().collect::<braid::Result<Vec<_>>>()?;
        for i in 0..sizes.len() {
            let (bytes, iters, _) = per_rank[0][i];
            let t = per_rank.iter().map(|r| r[i].2).fold(0.0, f64::max);
            let algbw = bytes as f64 / t / 1e9;
            let busbw = algbw * 2.0 * (w as f64 - 1.0) / w as f64;
            println!(
                "{w:>6} {bytes:>12} {iters:>7} {:>12.1} {algbw:>12.3} {busbw:>12.3}",
                t * 1e6
            );
        }
    }
    Ok(())
}

//! The step simulator: from a Chrome trace Braid wrote, predict the step time,
//! communication time, hidden share and critical path on another machine,
//! rank count, stream count or placement policy, and write the predicted
//! step as a Chrome trace (docs/simulator.md).
//!
//! ```sh
//! braid-gpt2 train --model small --ranks 1 --policy single --reduce-single-rank --trace t.json
//! cargo run --release -p braid-benches --bin simulate -- \
//!     --trace t.json --ranks 1,2,4 --streams 2 --policy affinity --machine cpu --out predicted.json
//! ```
//!
//! The last line is `predicted_step_ms=<x> hidden_share=<y>` for the last rank
//! count asked.

use anyhow::{bail, Result};
use braid_benches::cli;
use braid_benches::simulate::{
    self, graph::StepChoice, machine::Machine, trace::Trace, SimConfig, SimPolicy, StepGraph,
};
use clap::Parser;
use std::path::PathBuf;

#[derive(Parser, Debug)]
#[command(about = "Predict a Braid step on other machines, rank counts and policies from a trace")]
struct Args {
    /// A Chrome trace written by Braid (`braid-gpt2 train --trace`). For a
    /// one-rank trace to predict several ranks, train with
    /// `--reduce-single-rank` so the trace holds the gradient buckets.
    #[arg(long)]
    trace: PathBuf,
    /// The rank of the trace whose step is simulated.
    #[arg(long, default_value_t = 0)]
    rank: usize,
    /// Rank counts to predict, comma-separated (1 to 1024 or more).
    #[arg(long, value_delimiter = ',', default_value = "1")]
    ranks: Vec<usize>,
    /// Compute streams per rank (default: as traced).
    #[arg(long, value_parser = cli::at_least(1))]
    streams: Option<usize>,
    /// Placement: single, recorded (the traced streams), eager (Braid's
    /// eager affinity rule) or affinity (the default: what replayed steps
    /// run, earliest finish time).
    #[arg(long, default_value = "affinity")]
    policy: SimPolicy,
    /// A built-in machine: cpu, h100-nvlink, h100-ib, pcie.
    #[arg(long, default_value = "cpu")]
    machine: String,
    /// A machine description in JSON (the fields of `simulate::machine::Machine`);
    /// overrides --machine.
    #[arg(long)]
    machine_file: Option<PathBuf>,
    /// CPU machine: cores shared by every rank (default: this host's).
    #[arg(long, default_value_t = 0)]
    cores: usize,
    /// CPU machine: cores' worth of other work running beside the ranks
    /// (a shared machine).
    #[arg(long, value_parser = cli::non_negative_f64)]
    background: Option<f64>,
    /// CPU machine: cores' worth of other work beside the traced run.
    #[arg(long, value_parser = cli::non_negative_f64)]
    traced_background: Option<f64>,
    /// GPU machine: kernel sharing σ (a compute task runs 1 + σ·(k − 1) times
    /// slower while k of its rank's compute tasks run)
    #[arg(long, value_parser = cli::non_negative_f64)]
    gpu_sharing: Option<f64>,
    /// CPU machine: memory contention γ (a task runs 1 + γ·(busy cores − 1)
    /// times slower).
    #[arg(long, value_parser = cli::non_negative_f64)]
    contention: Option<f64>,
    /// Multiply compute durations (on top of the machine's factor).
    #[arg(long, default_value_t = 1.0, value_parser = cli::positive_f64)]
    compute_scale: f64,
    /// CPU: use every compute stream whatever the cores (no core budget).
    #[arg(long)]
    oversubscribe: bool,
    /// Simulate complete step K (from 0) as it is, instead of the last
    /// complete step with each task's median duration over all of them.
    #[arg(long)]
    step: Option<usize>,
    /// The name of the task that begins a step (default: the trace's first).
    #[arg(long)]
    step_start: Option<String>,
    /// Host time between steps, ms (default: as traced).
    #[arg(long, value_parser = cli::non_negative_f64)]
    host_gap_ms: Option<f64>,
    /// Write the predicted step (last rank count) as a Chrome trace here.
    #[arg(long)]
    out: Option<PathBuf>,
    /// A trace of the run being predicted: print its measured step beside
    /// the prediction for the last rank count (and the error).
    #[arg(long)]
    measured: Option<PathBuf>,
    /// Rank skew, as `--measured` reports a trace's fitted skew: how far
    /// apart the slowest and fastest ranks end their backward (0: every rank
    /// in lock step; default: the machine's, fitted for `cpu`).
    #[arg(long)]
    skew: Option<f64>,
    /// Take the rank skew from this trace of several ranks (its measured
    /// skew; --skew wins over it).
    #[arg(long)]
    skew_from: Option<PathBuf>,
    /// With --measured of several ranks: also print each collective of each
    /// complete step on every rank (ready, start, end).
    #[arg(long)]
    skew_detail: bool,
    /// Tasks of the critical path to print (0: all).
    #[arg(long, default_value_t = 0)]
    path_tasks: usize,
    /// Another trace of the same program (e.g. one step on a GPU): take its
    /// compute durations by task name, keeping this trace's tasks, edges and
    /// collectives (tasks it lacks are scaled by the median ratio).
    #[arg(long)]
    durations_from: Option<PathBuf>,
    /// Multiply the bytes of the gathers of per-rank rows (the reducer's
    /// `all_gather rows: …`, proportional to each rank's tokens): predict a
    /// batch F times the traced one's tokens per rank from a small trace
    /// (the other collectives' bytes depend on the parameters only).
    #[arg(long, default_value_t = 1.0)]
    rows_scale: f64,
}

fn ms(ns: u64) -> f64 {
    ns as f64 / 1e6
}

fn main() -> Result<()> {
    let a = Args::parse();
    if a.ranks.is_empty() || a.ranks.contains(&0) {
        bail!("--ranks needs positive rank counts");
    }
    let trace = Trace::read(&a.trace)?;
    let traced_ranks = trace.ranks.len();
    let r = trace.rank(a.rank)?;
    let choice = a.step.map_or(StepChoice::Median, StepChoice::Index);
    let mut g = StepGraph::from_trace(r, traced_ranks, choice, a.step_start.as_deref())?;
    if let Some(p) = &a.durations_from {
        let other = Trace::read(p)?;
        let o = other.rank(0)?;
        let og = StepGraph::from_trace(o, other.ranks.len(), StepChoice::Median, None)?;
        let (matched, scaled) = g.durations_from(&og);
        println!(
            "durations from {}: {matched} tasks by name, {scaled} scaled by the median ratio",
            p.display()
        );
    }
    if a.rows_scale != 1.0 {
        if !(a.rows_scale > 0.0 && a.rows_scale.is_finite()) {
            bail!("--rows-scale needs a positive factor, not {}", a.rows_scale);
        }
        let n = g.scale_row_gathers(a.rows_scale);
        println!(
            "rows scaled by {}: {n} gathers of per-rank rows",
            a.rows_scale
        );
    }
    if let Some(h) = a.host_gap_ms {
        g.host_gap_ns = (h * 1e6).round() as u64;
    }
    let machine = match &a.machine_file {
        Some(p) => Machine::from_file(p)?,
        None => Machine::builtin(&a.machine, a.cores)?,
    };
    let mut machine = machine;
    if let Some(b) = a.background {
        machine.background = b;
    }
    if let Some(b) = a.traced_background {
        machine.traced_background = b;
    }
    if let Some(s) = a.gpu_sharing {
        machine.gpu_sharing = s;
    }
    if let Some(c) = a.contention {
        machine.contention = c;
    }
    if let Some(p) = &a.skew_from {
        let st = Trace::read(p)?;
        let sk = simulate::skew::measure(&st, a.step_start.as_deref())?;
        machine.rank_skew = sk.fitted_skew();
        println!(
            "rank skew from {} ({} ranks, {} complete steps): {:.3}",
            p.display(),
            sk.ranks,
            sk.steps.len(),
            machine.rank_skew
        );
    }
    if let Some(s) = a.skew {
        machine.rank_skew = s;
    }
    if !(0.0..1.9).contains(&machine.rank_skew) {
        bail!("the rank skew must be in [0, 1.9): {}", machine.rank_skew);
    }
    let streams = a.streams.unwrap_or(g.traced_streams);
    let comm = g.nodes.iter().filter(|n| n.is_comm()).count();
    let missing = g
        .nodes
        .iter()
        .filter(|n| n.collective.is_some() && n.bytes.is_none())
        .count();
    println!(
        "trace {} rank {}: {} tasks per step ({} collectives{}), traced with {} rank(s) x {} \
         compute stream(s), {} complete steps; {} step {:.3} ms (host time between steps {:.3} ms)",
        a.trace.display(),
        a.rank,
        g.nodes.len(),
        comm,
        if missing > 0 {
            format!(", {missing} without bytes: inferred from their duration")
        } else {
            String::new()
        },
        g.traced_ranks,
        g.traced_streams,
        g.complete_steps,
        match choice {
            StepChoice::Median => "median".to_string(),
            StepChoice::Index(k) => format!("step {k}:"),
        },
        ms(g.measured_step_ns),
        ms(g.host_gap_ns),
    );
    if comm == 0 && a.ranks.iter().any(|&n| n > 1) {
        println!(
            "warning: the trace has no collectives, so more ranks add no communication \
             (train with --reduce-single-rank for a one-rank trace that keeps the buckets)"
        );
    }
    println!("machine {}", machine.describe());
    println!(
        "{:>6} {:>7} {:>6} {:>11} {:>11} {:>9} {:>7} {:>13}",
        "ranks", "streams", "usable", "step ms", "makespan ms", "comm ms", "hidden", "critical ms"
    );
    let mut last = None;
    for &n in &a.ranks {
        let cfg = SimConfig {
            ranks: n,
            streams,
            policy: a.policy,
            compute_scale: a.compute_scale,
            oversubscribe: a.oversubscribe,
        };
        let (p, runs) = simulate::predict_ranks(&g, &machine, &cfg);
        println!(
            "{:>6} {:>7} {:>6} {:>11.3} {:>11.3} {:>9.3} {:>6.1}% {:>13.3}",
            n,
            streams,
            p.usable,
            ms(p.step_ns),
            ms(p.makespan_ns),
            ms(p.comm_ns()),
            100.0 * p.hidden_share(),
            ms(p.summary.critical_path_ns),
        );
        if p.factors.len() > 1 {
            println!(
                "{:>6} rank skew {}: {} ranks simulated (compute ×{}), hidden {}, comm {} ms",
                "",
                machine.rank_skew,
                p.factors.len(),
                p.factors
                    .iter()
                    .map(|f| format!("{f:.3}"))
                    .collect::<Vec<_>>()
                    .join("/"),
                p.rank_summaries
                    .iter()
                    .map(|s| format!("{:.1}%", 100.0 * s.hidden_share()))
                    .collect::<Vec<_>>()
                    .join("/"),
                p.rank_summaries
                    .iter()
                    .map(|s| format!("{:.3}", ms(s.comm_ns)))
                    .collect::<Vec<_>>()
                    .join("/"),
            );
        }
        last = Some((p, runs));
    }
    let (p, runs) = last.expect("at least one rank count");
    let shown: Vec<&str> = if a.path_tasks == 0 || p.critical_path.len() <= a.path_tasks {
        p.critical_path.iter().map(String::as_str).collect()
    } else {
        let k = a.path_tasks;
        let mut v: Vec<&str> = p.critical_path[..k / 2]
            .iter()
            .map(String::as_str)
            .collect();
        v.push("…");
        v.extend(
            p.critical_path[p.critical_path.len() - (k - k / 2)..]
                .iter()
                .map(String::as_str),
        );
        v
    };
    println!(
        "critical path ({} ranks): {:.3} ms over {} tasks: {}",
        p.ranks,
        ms(p.summary.critical_path_ns),
        p.critical_path.len(),
        shown.join(" -> ")
    );
    if let Some(out) = &a.out {
        let profs: Vec<_> = runs
            .iter()
            .enumerate()
            .map(|(j, r)| simulate::profile_of_rank(&g, r, j))
            .collect();
        braid::trace::write_chrome_trace(out, &profs.iter().collect::<Vec<_>>())?;
        println!("predicted trace {}", out.display());
    }
    if let Some(mpath) = &a.measured {
        let mt = Trace::read(mpath)?;
        let mr = mt.rank(a.rank)?;
        let mg = StepGraph::from_trace(mr, mt.ranks.len(), choice, a.step_start.as_deref())?;
        let steps = mr.steps(a.step_start.as_deref());
        let k = steps
            .iter()
            .enumerate()
            .filter(|(k, s)| s.complete && k + 1 < steps.len())
            .map(|(k, _)| k)
            .next_back()
            .unwrap_or(0);
        let ms_sum = simulate::traced_summary(mr, &steps[k]);
        let err =
            100.0 * (p.step_ns as f64 - mg.measured_step_ns as f64) / mg.measured_step_ns as f64;
        println!(
            "measured {} rank {} ({} ranks): step {:.3} ms (median of {}), comm {:.3} ms, \
             hidden {:.1}% (its last complete step); predicted {:.3} ms: error {:+.1}%",
            mpath.display(),
            a.rank,
            mt.ranks.len(),
            ms(mg.measured_step_ns),
            mg.complete_steps,
            ms(ms_sum.comm_ns),
            100.0 * ms_sum.hidden_share(),
            ms(p.step_ns),
            err
        );
        if mt.ranks.len() > 1 {
            let sk = simulate::skew::measure(&mt, a.step_start.as_deref())?;
            for line in sk.report(a.skew_detail) {
                println!("{line}");
            }
        }
    }
    println!(
        "predicted_step_ms={:.3} hidden_share={:.3}",
        ms(p.step_ns),
        p.hidden_share()
    );
    Ok(())
}

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

use anyhow::{anyhow, bail, Result};
use braid_benches::cli;
use braid_benches::simulate::{
    self,
    cost::Collective,
    graph::StepChoice,
    machine::Machine,
    trace::{RankTrace, Trace},
    SimConfig, SimPolicy, StepGraph, MAX_RANKS, MAX_TIME_NS,
};
use clap::Parser;
use std::path::{Path, PathBuf};

#[derive(Parser, Debug)]
#[command(
    about = "Predict a Braid step on other machines, rank counts and policies from a trace",
    // `--skew -0.5` reaches the range check (which names the flag) instead
    // of clap's "unexpected argument".
    allow_negative_numbers = true
)]
struct Args {
    /// A Chrome trace written by Braid (`braid-gpt2 train --trace`). For a
    /// one-rank trace to predict several ranks, train with
    /// `--reduce-single-rank` so the trace holds the gradient buckets.
    #[arg(long)]
    trace: PathBuf,
    /// The rank of the trace whose step is simulated.
    #[arg(long, default_value_t = 0)]
    rank: usize,
    /// Rank counts to predict, comma-separated (1 to 1,048,576).
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

/// The rank skew as every line prints it.
fn skew_str(s: f64) -> String {
    format!("{s:.3}")
}

/// A number in an error: `1e300`, not three hundred digits.
fn num(x: f64) -> String {
    if x != 0.0 && !(1e-3..1e6).contains(&x.abs()) {
        format!("{x:e}")
    } else {
        format!("{x}")
    }
}

/// Reads the trace `path` that `flag` names; errors name the flag and file.
fn read_trace(flag: &str, path: &Path) -> Result<Trace> {
    Trace::read(path).map_err(|e| anyhow!("{flag} {}: {e:#}", path.display()))
}

/// Rank `rank` of `trace` (read from `path`, named by `flag`), checked for
/// the step start; an error names the file.
fn rank_of<'t>(
    trace: &'t Trace,
    flag: &str,
    path: &Path,
    rank: usize,
    start: Option<&str>,
) -> Result<&'t RankTrace> {
    let r = trace.rank(rank).map_err(|e| {
        anyhow!(
            "{flag} {}: {e} (it holds rank(s) {})",
            path.display(),
            trace
                .ranks
                .iter()
                .map(|r| r.rank.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        )
    })?;
    r.check_step_start(start)
        .map_err(|e| anyhow!("--step-start: {e} ({flag} {})", path.display()))?;
    Ok(r)
}

/// The step graph of `r`, and a warning when the trace has fewer than two
/// complete steps: no two of its segments hold the same tasks, so the step
/// taken may be an eager first step or one cut short.
fn step_graph(
    r: &RankTrace,
    traced_ranks: usize,
    choice: StepChoice,
    start: Option<&str>,
    flag: &str,
    path: &Path,
    warnings: &mut Vec<String>,
) -> Result<StepGraph> {
    let g = StepGraph::from_trace(r, traced_ranks, choice, start)
        .map_err(|e| anyhow!("{flag} {}: {e:#}", path.display()))?;
    if g.complete_steps < 2 {
        warnings.push(format!(
            "warning: {flag} {} rank {}: {} complete step (of {} cut at `{}`; no two hold the \
             same tasks): it is simulated as it is, which in a run of two steps is an eager \
             first step and in a trace cut short may be a partial one; trace more steps \
             (e.g. braid-gpt2 train --steps 12) or name the task that begins a step \
             (--step-start)",
            path.display(),
            r.rank,
            g.complete_steps,
            r.steps(start).len(),
            start
                .or(r.tasks.first().map(|t| t.name.as_str()))
                .unwrap_or(""),
        ));
    }
    Ok(g)
}

/// The critical path as printed: every task, or with `k` > 0 the first
/// `⌈k/2⌉` and the last `⌊k/2⌋` around an ellipsis.
fn path_shown(path: &[String], k: usize) -> Vec<&str> {
    if k == 0 || path.len() <= k {
        return path.iter().map(String::as_str).collect();
    }
    let head = k - k / 2;
    let mut v: Vec<&str> = path[..head].iter().map(String::as_str).collect();
    v.push("…");
    v.extend(path[path.len() - k / 2..].iter().map(String::as_str));
    v
}

/// Whether `a` and `b` name the same existing file (through links too).
fn same_file(a: &Path, b: &Path) -> bool {
    if a == b {
        return true;
    }
    if let (Ok(x), Ok(y)) = (a.canonicalize(), b.canonicalize()) {
        if x == y {
            return true;
        }
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        if let (Ok(x), Ok(y)) = (std::fs::metadata(a), std::fs::metadata(b)) {
            return (x.dev(), x.ino()) == (y.dev(), y.ino());
        }
    }
    false
}

/// Refuses an `--out` that names one of the inputs (it would be
/// overwritten, and `--measured` was read after it was written), a
/// directory, or a file that cannot be written.
fn check_out(out: &Path, inputs: &[(&str, &Path)]) -> Result<()> {
    for (flag, p) in inputs {
        if same_file(out, p) {
            bail!(
                "--out {} names the {flag} file: it would be overwritten; write the \
                 predicted trace elsewhere",
                out.display()
            );
        }
    }
    if out.is_dir() {
        bail!("--out {} is a directory: name a file", out.display());
    }
    let dir = match out.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    if !dir.is_dir() {
        bail!("--out {}: no directory {}", out.display(), dir.display());
    }
    // Writable: opened to append (nothing written), removed again when it
    // was not there.
    let existed = out.exists();
    std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(out)
        .map_err(|e| anyhow!("--out {}: cannot write it: {e}", out.display()))?;
    if !existed {
        let _ = std::fs::remove_file(out);
    }
    Ok(())
}

fn main() -> Result<()> {
    let a = Args::parse();
    if a.ranks.is_empty() || a.ranks.contains(&0) {
        bail!("--ranks needs positive rank counts");
    }
    if let Some(&n) = a.ranks.iter().find(|&&n| n > MAX_RANKS) {
        bail!("--ranks {n}: at most {MAX_RANKS} ranks are simulated");
    }
    if !(a.rows_scale > 0.0 && a.rows_scale.is_finite()) {
        bail!("--rows-scale needs a positive factor, not {}", a.rows_scale);
    }
    if let Some(s) = a.skew {
        if !(0.0..1.9).contains(&s) {
            bail!("--skew {s}: the rank skew must be in [0, 1.9)");
        }
    }
    let host_gap_ns = match a.host_gap_ms {
        Some(h) if h * 1e6 >= MAX_TIME_NS as f64 => bail!(
            "--host-gap-ms {}: at most {} ms (2^53 ns, the longest time the simulator \
             represents)",
            num(h),
            MAX_TIME_NS / 1_000_000
        ),
        h => h.map(|h| (h * 1e6).round() as u64),
    };
    if let Some(out) = &a.out {
        let mut inputs: Vec<(&str, &Path)> = vec![("--trace", &a.trace)];
        for (flag, p) in [
            ("--measured", &a.measured),
            ("--skew-from", &a.skew_from),
            ("--durations-from", &a.durations_from),
            ("--machine-file", &a.machine_file),
        ] {
            if let Some(p) = p {
                inputs.push((flag, p));
            }
        }
        check_out(out, &inputs)?;
    }
    let start = a.step_start.as_deref();
    let mut warnings = Vec::new();
    let trace = read_trace("--trace", &a.trace)?;
    let traced_ranks = trace.ranks.len();
    let r = rank_of(&trace, "--trace", &a.trace, a.rank, start)?;
    let choice = a.step.map_or(StepChoice::Median, StepChoice::Index);
    let mut g = step_graph(
        r,
        traced_ranks,
        choice,
        start,
        "--trace",
        &a.trace,
        &mut warnings,
    )?;
    let mut notes = Vec::new();
    if let Some(p) = &a.durations_from {
        let other = read_trace("--durations-from", p)?;
        let o = rank_of(&other, "--durations-from", p, 0, None)?;
        let og = step_graph(
            o,
            other.ranks.len(),
            StepChoice::Median,
            None,
            "--durations-from",
            p,
            &mut warnings,
        )?;
        let (matched, scaled) = g.durations_from(&og);
        notes.push(format!(
            "durations from {}: {matched} tasks by name, {scaled} scaled by the median ratio",
            p.display()
        ));
    }
    if a.rows_scale != 1.0 {
        let most = g
            .nodes
            .iter()
            .filter(|n| Collective::grows_with_ranks(&n.name))
            .filter_map(|n| n.bytes)
            .max()
            .unwrap_or(0);
        if most as f64 * a.rows_scale >= MAX_TIME_NS as f64 {
            bail!(
                "--rows-scale {}: the gathers of per-rank rows would move {:.3e} bytes, more \
                 than the simulator represents",
                num(a.rows_scale),
                most as f64 * a.rows_scale
            );
        }
        let n = g.scale_row_gathers(a.rows_scale);
        notes.push(format!(
            "rows scaled by {}: {n} gathers of per-rank rows",
            a.rows_scale
        ));
    }
    if let Some(h) = host_gap_ns {
        g.host_gap_ns = h;
    }
    let machine = match &a.machine_file {
        Some(p) => Machine::from_file(p).map_err(|e| anyhow!("--machine-file: {e:#}"))?,
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
    let longest = g
        .nodes
        .iter()
        .filter(|n| !n.is_comm())
        .map(|n| n.dur_ns)
        .max()
        .unwrap_or(0);
    if longest as f64 * machine.compute_scale * a.compute_scale >= MAX_TIME_NS as f64 {
        bail!(
            "--compute-scale {}: the longest task ({:.3} ms traced) would take more than 2^53 \
             ns (104 days), longer than the simulator represents",
            num(a.compute_scale),
            ms(longest)
        );
    }
    // Where the rank skew comes from: a flag or file the user gave (a skew
    // the simulated ranks cannot show is then refused), or the machine's
    // default (then noted, and the step run in lock step).
    let mut skew_source = a
        .machine_file
        .as_ref()
        .map(|p| format!("`rank_skew` in --machine-file {}", p.display()));
    if let Some(p) = &a.skew_from {
        let st = read_trace("--skew-from", p)?;
        let sk = simulate::skew::measure(&st, start)
            .map_err(|e| anyhow!("--skew-from {}: {e:#}", p.display()))?;
        machine.rank_skew = sk.fitted_skew();
        if !(0.0..1.9).contains(&machine.rank_skew) {
            bail!(
                "--skew-from {}: its fitted rank skew {} is outside [0, 1.9)",
                p.display(),
                machine.rank_skew
            );
        }
        notes.push(format!(
            "rank skew from {} ({} ranks, {} complete steps): {}",
            p.display(),
            sk.ranks,
            sk.steps.len(),
            skew_str(machine.rank_skew)
        ));
        skew_source = Some(format!("--skew-from {}", p.display()));
    }
    if let Some(s) = a.skew {
        machine.rank_skew = s;
        skew_source = Some(format!("--skew {s}"));
    }
    if !(0.0..1.9).contains(&machine.rank_skew) {
        bail!("the rank skew must be in [0, 1.9): {}", machine.rank_skew);
    }
    // The measured run, read (and its rank checked) before any output.
    let measured = match &a.measured {
        Some(mpath) => {
            let mt = read_trace("--measured", mpath)?;
            let mr = rank_of(&mt, "--measured", mpath, a.rank, start)?;
            let mg = step_graph(
                mr,
                mt.ranks.len(),
                choice,
                start,
                "--measured",
                mpath,
                &mut warnings,
            )?;
            let sk = if mt.ranks.len() > 1 {
                Some(
                    simulate::skew::measure(&mt, start)
                        .map_err(|e| anyhow!("--measured {}: {e:#}", mpath.display()))?,
                )
            } else {
                None
            };
            Some((mpath, mt, mg, sk))
        }
        None => None,
    };
    let streams = a.streams.unwrap_or(g.traced_streams);
    // Every prediction first: a refusal comes before any output.
    let mut preds = Vec::with_capacity(a.ranks.len());
    for &n in &a.ranks {
        let cfg = SimConfig {
            ranks: n,
            streams,
            policy: a.policy,
            compute_scale: a.compute_scale,
            oversubscribe: a.oversubscribe,
        };
        let (p, runs) = simulate::predict_ranks(&g, &machine, &cfg);
        if p.step_ns >= MAX_TIME_NS {
            bail!(
                "the predicted step at {n} ranks is longer than 2^53 ns (104 days), longer than \
                 the simulator represents: check --ranks, --compute-scale, --rows-scale and \
                 --host-gap-ms"
            );
        }
        if let Some(max) = p.unreachable_skew {
            let why = format!(
                "the simulated ranks end their backward at most {} apart at {n} ranks under \
                 --policy {} (its collectives bring the ranks together), however far their \
                 speeds spread",
                skew_str(max),
                a.policy.name()
            );
            match &skew_source {
                Some(src) => bail!(
                    "{src}: a rank skew of {} cannot be reached: {why}; pass --skew {:.3} or \
                     less, or --skew 0 for lock step",
                    skew_str(machine.rank_skew),
                    (max * 1000.0).floor() / 1000.0
                ),
                None => notes.push(format!(
                    "note: the machine's rank skew {} cannot be reached: {why}; simulated in \
                     lock step at {n} ranks (--skew sets another)",
                    skew_str(machine.rank_skew)
                )),
            }
        }
        preds.push((n, p, runs));
    }
    for w in &warnings {
        println!("{w}");
    }
    for line in &notes {
        println!("{line}");
    }
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
    for (n, p, runs) in preds {
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
                skew_str(machine.rank_skew),
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
    println!(
        "critical path ({} ranks): {:.3} ms over {} tasks: {}",
        p.ranks,
        ms(p.summary.critical_path_ns),
        p.critical_path.len(),
        path_shown(&p.critical_path, a.path_tasks).join(" -> ")
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
    if let Some((mpath, mt, mg, sk)) = &measured {
        let mr = mt.rank(a.rank)?;
        let steps = mr.steps(start);
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
        if let Some(sk) = sk {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// `--path-tasks 1` printed only the last task (`… -> e`): the first
    /// half took `k / 2` = 0 tasks. The first half now takes the odd one.
    #[test]
    fn a_shortened_path_keeps_its_first_task() {
        let path: Vec<String> = ["a", "b", "c", "d", "e"].map(String::from).to_vec();
        assert_eq!(path_shown(&path, 1), ["a", "…"]);
        assert_eq!(path_shown(&path, 2), ["a", "…", "e"]);
        assert_eq!(path_shown(&path, 3), ["a", "b", "…", "e"]);
        assert_eq!(path_shown(&path, 0), ["a", "b", "c", "d", "e"]);
        assert_eq!(path_shown(&path, 5), ["a", "b", "c", "d", "e"]);
    }
}

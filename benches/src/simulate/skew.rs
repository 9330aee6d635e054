//! Rank skew as a multi-rank trace shows it: per complete step and per
//! collective, each rank's *ready* time (the end of the collective's last
//! predecessor on that rank: the bucket's last writer), its *start* (when its
//! comm stream began the task: its arrival) and its *end*; per rank the hidden
//! share of each step and of the whole run (`braid::trace::Summary`, as the
//! trainer's report computes it).
//!
//! The ranks of one process share one clock (`braid`'s trace epoch), so times
//! compare across ranks. A collective moves data only once every rank has
//! arrived (CPU ranks: the arrival barrier of `comm/local.rs`; NCCL: the
//! kernel waits for its peers), so on a rank that arrived early the traced
//! span holds the wait for the last one.

use super::cost::Collective;
use super::graph::{occurrences, step_preds, StepGraph};
use super::machine::Machine;
use super::sched::{simulate_ranks, skew_factors, SimConfig, SimRun};
use super::trace::{RankTrace, StepSlice, Trace};
use anyhow::{bail, Result};
use braid::trace::Summary;
use braid::TaskKind;
use std::collections::HashMap;

/// One collective of one step on every rank (times on the process clock,
/// ns; vectors by rank).
#[derive(Debug, Clone)]
pub struct CollectiveTimes {
    /// Task name.
    pub name: String,
    /// Its occurrence among the step's tasks of that name.
    pub occurrence: usize,
    /// Bytes (rank 0's span), if recorded.
    pub bytes: Option<u64>,
    /// The end of its last predecessor in the step (the step's start if it
    /// has none).
    pub ready_ns: Vec<u64>,
    /// Its span's start: the rank's arrival.
    pub start_ns: Vec<u64>,
    /// Its span's end.
    pub end_ns: Vec<u64>,
    /// On every rank its last predecessor to end was a compute (not a
    /// communication) task: its ready times are where that rank's compute
    /// got to (a collective after another collective is ready when that one
    /// ends, at the same time on every rank).
    pub compute_ready: bool,
    /// On every rank a task of the step waits for it (the loss all-reduce,
    /// read only after the step, is not awaited).
    pub awaited: bool,
}

impl CollectiveTimes {
    /// When the last rank arrived: the earliest the data can move.
    pub fn group_start_ns(&self) -> u64 {
        self.start_ns.iter().copied().max().unwrap_or(0)
    }

    /// Latest ready minus earliest ready, ns.
    pub fn ready_spread_ns(&self) -> u64 {
        spread(&self.ready_ns)
    }

    /// How long rank `r` waited in the collective for the last rank, ns.
    pub fn wait_ns(&self, r: usize) -> u64 {
        self.group_start_ns().saturating_sub(self.start_ns[r])
    }

    /// From the last arrival to the last end: the collective's own time, ns.
    pub fn transfer_ns(&self) -> u64 {
        self.end_ns
            .iter()
            .copied()
            .max()
            .unwrap_or(0)
            .saturating_sub(self.group_start_ns())
    }
}

fn spread(v: &[u64]) -> u64 {
    let lo = v.iter().copied().min().unwrap_or(0);
    let hi = v.iter().copied().max().unwrap_or(0);
    hi - lo
}

/// One complete step on every rank.
#[derive(Debug, Clone)]
pub struct StepSkew {
    /// Index among the complete steps (from 0).
    pub step: usize,
    /// Each rank's first task start, ns.
    pub start_ns: Vec<u64>,
    /// Each rank's last compute (non-comm) task end, ns.
    pub compute_end_ns: Vec<u64>,
    /// Each rank's compute busy time (union of its non-comm spans), ns.
    pub compute_busy_ns: Vec<u64>,
    /// The step's collectives, in rank 0's submission order.
    pub collectives: Vec<CollectiveTimes>,
    /// Each rank's summary of the step.
    pub summaries: Vec<Summary>,
}

impl StepSkew {
    /// Latest minus earliest compute end, ns.
    pub fn compute_end_spread_ns(&self) -> u64 {
        spread(&self.compute_end_ns)
    }

    /// Latest minus earliest step start, ns.
    pub fn start_spread_ns(&self) -> u64 {
        spread(&self.start_ns)
    }

    /// The rank whose compute ended last.
    pub fn slowest(&self) -> usize {
        (0..self.compute_end_ns.len())
            .max_by_key(|&r| self.compute_end_ns[r])
            .unwrap_or(0)
    }

    /// Mean over ranks of the step's hidden share (ranks with communication).
    pub fn hidden_share(&self) -> f64 {
        mean_hidden(&self.summaries)
    }
}

/// Mean hidden share over the summaries that have communication, as the
/// trainer's report averages its ranks (`TrainReport::hidden_comm_share`).
pub fn mean_hidden(s: &[Summary]) -> f64 {
    mean_or_zero(
        s.iter()
            .filter(|s| s.comm_ns > 0)
            .map(Summary::hidden_share),
    )
}

/// The mean of `v`, 0 when it is empty.
fn mean_or_zero(v: impl IntoIterator<Item = f64>) -> f64 {
    let (sum, n) = v
        .into_iter()
        .fold((0.0, 0usize), |(s, n), x| (s + x, n + 1));
    if n == 0 {
        0.0
    } else {
        sum / n as f64
    }
}

/// Hidden time over communication time, both summed over the summaries (0
/// without communication).
pub fn pooled_hidden(s: &[Summary]) -> f64 {
    let comm: u64 = s.iter().map(|s| s.comm_ns).sum();
    let hidden: u64 = s.iter().map(|s| s.comm_hidden_ns).sum();
    if comm == 0 {
        0.0
    } else {
        hidden as f64 / comm as f64
    }
}

/// A multi-rank trace's skew.
#[derive(Debug, Clone)]
pub struct MeasuredSkew {
    /// Ranks in the trace.
    pub ranks: usize,
    /// The complete steps every rank has.
    pub steps: Vec<StepSkew>,
    /// Each rank's summary of its whole trace (every step, the eager ones
    /// included): the figures the trainer prints.
    pub run: Vec<Summary>,
}

fn median_u64(mut v: Vec<u64>) -> u64 {
    if v.is_empty() {
        return 0;
    }
    v.sort_unstable();
    v[v.len() / 2]
}

impl MeasuredSkew {
    /// Median over steps of the compute-end spread, ns.
    pub fn median_compute_end_spread_ns(&self) -> u64 {
        median_u64(
            self.steps
                .iter()
                .map(StepSkew::compute_end_spread_ns)
                .collect(),
        )
    }

    /// Median over steps and collectives of the ready spread, ns.
    pub fn median_ready_spread_ns(&self) -> u64 {
        median_u64(
            self.steps
                .iter()
                .flat_map(|s| s.collectives.iter().map(CollectiveTimes::ready_spread_ns))
                .collect(),
        )
    }

    /// Median over steps of the step-start spread, ns.
    pub fn median_start_spread_ns(&self) -> u64 {
        median_u64(self.steps.iter().map(StepSkew::start_spread_ns).collect())
    }

    /// Median over steps of the compute busy time, per rank, ns.
    pub fn median_compute_busy_ns(&self) -> Vec<u64> {
        (0..self.ranks)
            .map(|r| median_u64(self.steps.iter().map(|s| s.compute_busy_ns[r]).collect()))
            .collect()
    }

    /// Mean over ranks of the whole run's hidden share (the trainer's figure).
    pub fn run_hidden_share(&self) -> f64 {
        mean_hidden(&self.run)
    }

    /// The rank skew of the model (`Machine::rank_skew`) that this trace
    /// shows, the mean of [`Self::step_skews`] (the mean, not the median:
    /// the exposed time grows with the skew, so the rare far-skewed step
    /// counts).
    pub fn fitted_skew(&self) -> f64 {
        mean_or_zero(self.step_skews())
    }

    /// Each complete step's skew: per rank, when its compute last made a
    /// collective that the step waits for ready (the latest ready time of
    /// the collectives made ready by compute and awaited,
    /// [`CollectiveTimes::compute_ready`], [`CollectiveTimes::awaited`]:
    /// the end of its backward). The spread of that over the ranks, over
    /// the time from the earliest step start to the latest of them, is `e`;
    /// in the model the fastest rank's compute takes `(1 − f/2)/(1 + f/2)`
    /// times as long as the slowest's, so it gets there `e` of the way
    /// earlier for `f = 2e/(2 − e)`, and waits that long at the end of the
    /// step with nothing to hide it. (Earlier collectives are not used: ranks that
    /// re-place their step by their own measured durations can run the
    /// same tasks in another order, so an earlier bucket's ready times
    /// differ without either rank being ahead at the end.) Steps with no
    /// such collective are left out.
    pub fn step_skews(&self) -> Vec<f64> {
        self.steps
            .iter()
            .filter_map(|s| {
                let t0 = s.start_ns.iter().copied().min()?;
                let last: Vec<u64> = (0..self.ranks)
                    .map(|r| {
                        s.collectives
                            .iter()
                            .filter(|c| c.compute_ready && c.awaited)
                            .map(|c| c.ready_ns[r])
                            .max()
                    })
                    .collect::<Option<_>>()?;
                let hi = last.iter().copied().max()?;
                // The fastest is ready `e` of the way earlier than the
                // slowest: (1 − f/2) = (1 − e)(1 + f/2).
                let e = spread(&last) as f64 / hi.saturating_sub(t0).max(1) as f64;
                Some(2.0 * e / (2.0 - e))
            })
            .collect()
    }

    /// Each rank's hidden share over the complete steps together (hidden
    /// over communication time, summed over steps).
    pub fn pooled_hidden_shares(&self) -> Vec<f64> {
        (0..self.ranks)
            .map(|r| {
                let (h, c) = self.steps.iter().fold((0u64, 0u64), |(h, c), s| {
                    (
                        h + s.summaries[r].comm_hidden_ns,
                        c + s.summaries[r].comm_ns,
                    )
                });
                if c == 0 {
                    0.0
                } else {
                    h as f64 / c as f64
                }
            })
            .collect()
    }

    /// The rank mean of [`Self::pooled_hidden_shares`]: what a prediction's
    /// hidden share is compared with.
    pub fn steps_hidden_share(&self) -> f64 {
        mean_or_zero(self.pooled_hidden_shares())
    }

    /// Mean over the complete steps of their (rank-mean) hidden share.
    pub fn mean_step_hidden_share(&self) -> f64 {
        mean_or_zero(self.steps.iter().map(StepSkew::hidden_share))
    }
}

/// The summary of tasks `s` of rank `r` (a step, or the whole trace).
fn summary_of(r: &RankTrace, s: &StepSlice) -> Summary {
    super::traced_summary(r, s)
}

/// Union length of intervals.
fn busy(mut v: Vec<(u64, u64)>) -> u64 {
    v.sort_unstable();
    let mut total = 0;
    let mut cur: Option<(u64, u64)> = None;
    for (a, b) in v {
        match cur {
            Some((c, d)) if a <= d => cur = Some((c, d.max(b))),
            _ => {
                if let Some((c, d)) = cur {
                    total += d - c;
                }
                cur = Some((a, b));
            }
        }
    }
    total + cur.map_or(0, |(c, d)| d - c)
}

/// The skew of simulated ranks in [`MeasuredSkew::step_skews`]'s terms:
/// per rank the latest ready time of the collectives made ready by compute
/// that some task waits for; `e`, their spread over the latest (every
/// simulated rank starts at 0); `2e/(2 − e)`. `None` when the step has no
/// such collective.
pub fn simulated_skew(g: &StepGraph, runs: &[SimRun]) -> Option<f64> {
    let mut awaited = vec![false; g.nodes.len()];
    for &p in g.nodes.iter().flat_map(|n| &n.preds) {
        awaited[p] = true;
    }
    // The collectives made ready by compute on every rank, and waited for.
    let ready: Vec<Vec<u64>> = g
        .nodes
        .iter()
        .enumerate()
        .filter(|(i, n)| n.collective.is_some() && awaited[*i])
        .filter_map(|(_, n)| {
            runs.iter()
                .map(|run| {
                    let (end, p) = n.preds.iter().map(|&p| (run.tasks[p].end_ns, p)).max()?;
                    (!g.nodes[p].is_comm()).then_some(end)
                })
                .collect::<Option<Vec<u64>>>()
        })
        .collect();
    let last: Vec<u64> = (0..runs.len())
        .map(|j| ready.iter().map(|r| r[j]).max())
        .collect::<Option<_>>()?;
    let hi = last.iter().copied().max()?;
    let e = spread(&last) as f64 / hi.max(1) as f64;
    Some(2.0 * e / (2.0 - e))
}

/// The spread of compute factors (`sched::skew_factors`) at which the
/// simulated ranks of `g` on `m` under `cfg` are `skew` apart at the end of
/// their backward, as [`simulated_skew`] measures it: the same figure a
/// trace's [`MeasuredSkew::fitted_skew`] gives. On a CPU machine they differ:
/// a rank that waits frees cores for the slower ones, which closes part of
/// the gap. Found by bisection (the gap grows with the spread); `skew`
/// itself when the step has no collective to measure it at.
///
/// `Err(max)` when even the largest spread (1.9: factors ×1.95 and ×0.05)
/// leaves the ranks less than `skew` apart, `max` being how far apart they
/// then are: a step whose collectives bring the ranks together (under
/// `single` every collective waits on the compute stream, so only the
/// compute since the previous one can drift). Until 2026-11-29 this
/// returned the largest spread, and the prediction ran one rank at 1.95
/// times its speed without a word.
pub fn solve_factor_spread(
    g: &StepGraph,
    m: &Machine,
    cfg: &SimConfig,
    skew: f64,
) -> Result<f64, f64> {
    const MAX: f64 = 1.9;
    if skew <= 0.0 || cfg.ranks < 2 {
        return Ok(0.0);
    }
    let at = |s: f64| {
        let f = skew_factors(cfg.ranks, s, super::MAX_SKEW_RANKS);
        simulated_skew(g, &simulate_ranks(g, m, cfg, &f))
    };
    let Some(hi_skew) = at(MAX) else {
        return Ok(skew.min(MAX));
    };
    if hi_skew <= skew {
        return Err(hi_skew);
    }
    let (mut lo, mut hi) = (0.0, MAX);
    for _ in 0..40 {
        let mid = 0.5 * (lo + hi);
        match at(mid) {
            Some(v) if v < skew => lo = mid,
            _ => hi = mid,
        }
    }
    Ok(0.5 * (lo + hi))
}

/// A collective on one rank: ready, start, end, bytes, whether its last
/// predecessor to end was a compute task, whether a task of the step waits
/// for it.
type Timing = (u64, u64, u64, Option<u64>, bool, bool);

/// Reads the skew out of a trace with several ranks (`start`: the name that
/// begins a step, as for [`RankTrace::steps`]).
pub fn measure(trace: &Trace, start: Option<&str>) -> Result<MeasuredSkew> {
    let ranks = trace.ranks.len();
    if ranks < 2 {
        bail!("rank skew needs a trace with several ranks (it has {ranks})");
    }
    for r in &trace.ranks {
        r.check_step_start(start)?;
    }
    // Each rank's complete steps.
    let per_rank: Vec<Vec<StepSlice>> = trace
        .ranks
        .iter()
        .map(|r| r.steps(start).into_iter().filter(|s| s.complete).collect())
        .collect();
    let n = per_rank.iter().map(Vec::len).min().unwrap_or(0);
    if per_rank.iter().any(|v| v.len() != n) {
        bail!(
            "the ranks have different numbers of complete steps: {:?}",
            per_rank.iter().map(Vec::len).collect::<Vec<_>>()
        );
    }
    let mut steps = Vec::with_capacity(n);
    // Step by step: the `k`-th complete step of every rank.
    let mut iters: Vec<_> = per_rank.iter().map(|v| v.iter()).collect();
    for k in 0..n {
        let slices: Vec<&StepSlice> = iters.iter_mut().filter_map(Iterator::next).collect();
        // Per rank: (name, occurrence) → the collective's `Timing`, and rank
        // 0's order.
        let mut maps: Vec<HashMap<(String, usize), Timing>> = Vec::new();
        let mut order: Vec<(String, usize)> = Vec::new();
        let (mut starts, mut ends, mut busys, mut sums) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (ri, r) in trace.ranks.iter().enumerate() {
            let s = slices[ri];
            let tasks = &r.tasks[s.first..s.end];
            let step_start = tasks.iter().map(|t| t.start_ns).min().unwrap_or(0);
            let preds = step_preds(tasks);
            let occ = occurrences(tasks.iter().map(|t| t.name.as_str()));
            let mut awaited = vec![false; tasks.len()];
            for &p in preds.iter().flatten() {
                awaited[p] = true;
            }
            let mut m = HashMap::new();
            for (i, t) in tasks.iter().enumerate() {
                // Collectives only: a comm-stream task that is not one (the
                // tied split's local sparse-row add) waits for no rank.
                if t.kind != TaskKind::Comm || Collective::from_task_name(&t.name).is_none() {
                    continue;
                }
                let last = preds[i]
                    .iter()
                    .map(|&p| (tasks[p].start_ns + tasks[p].dur_ns, p))
                    .max();
                let ready = last.map_or(step_start, |l| l.0);
                let by_compute = last.is_some_and(|l| tasks[l.1].kind != TaskKind::Comm);
                let key = (t.name.clone(), occ[i]);
                if ri == 0 {
                    order.push(key.clone());
                }
                m.insert(
                    key,
                    (
                        ready,
                        t.start_ns,
                        t.start_ns + t.dur_ns,
                        t.bytes,
                        by_compute,
                        awaited[i],
                    ),
                );
            }
            maps.push(m);
            starts.push(step_start);
            let compute: Vec<(u64, u64)> = tasks
                .iter()
                .filter(|t| t.kind != TaskKind::Comm)
                .map(|t| (t.start_ns, t.start_ns + t.dur_ns))
                .collect();
            ends.push(compute.iter().map(|c| c.1).max().unwrap_or(step_start));
            busys.push(busy(compute));
            sums.push(summary_of(r, s));
        }
        let collectives = order
            .into_iter()
            .filter(|key| maps.iter().all(|m| m.contains_key(key)))
            .map(|key| {
                let at = |f: fn(&Timing) -> u64| -> Vec<u64> {
                    maps.iter().map(|m| f(&m[&key])).collect()
                };
                CollectiveTimes {
                    bytes: maps[0][&key].3,
                    ready_ns: at(|x| x.0),
                    start_ns: at(|x| x.1),
                    end_ns: at(|x| x.2),
                    compute_ready: maps.iter().all(|m| m[&key].4),
                    awaited: maps.iter().all(|m| m[&key].5),
                    name: key.0,
                    occurrence: key.1,
                }
            })
            .collect();
        steps.push(StepSkew {
            step: k,
            start_ns: starts,
            compute_end_ns: ends,
            compute_busy_ns: busys,
            collectives,
            summaries: sums,
        });
    }
    let run = trace
        .ranks
        .iter()
        .map(|r| {
            summary_of(
                r,
                &StepSlice {
                    first: 0,
                    end: r.tasks.len(),
                    complete: false,
                },
            )
        })
        .collect();
    Ok(MeasuredSkew { ranks, steps, run })
}

fn ms(ns: u64) -> f64 {
    ns as f64 / 1e6
}

fn pct(v: &[f64]) -> String {
    v.iter()
        .map(|h| format!("{:.0}%", 100.0 * h))
        .collect::<Vec<_>>()
        .join("/")
}

impl MeasuredSkew {
    /// A report, one line per step and a summary line; `detail`: also each
    /// collective of each step.
    pub fn report(&self, detail: bool) -> Vec<String> {
        let mut out = Vec::new();
        out.push(format!(
            "measured skew over {} complete steps of {} ranks (ms; per rank r0/r1/...):",
            self.steps.len(),
            self.ranks
        ));
        for s in &self.steps {
            let t0 = s.start_ns.iter().copied().min().unwrap_or(0);
            let rel = |v: &[u64]| {
                v.iter()
                    .map(|&x| format!("{:.1}", ms(x.saturating_sub(t0))))
                    .collect::<Vec<_>>()
                    .join("/")
            };
            let waits: Vec<u64> = (0..self.ranks)
                .map(|r| s.collectives.iter().map(|c| c.wait_ns(r)).sum())
                .collect();
            let ready: Vec<u64> = s
                .collectives
                .iter()
                .map(CollectiveTimes::ready_spread_ns)
                .collect();
            out.push(format!(
                "  step {:>2}: start {} compute end {} (spread {:.1}, slowest r{}), busy {}, \
                 bucket ready spread median {:.1} max {:.1}, wait {}, comm {}, hidden {}",
                s.step,
                rel(&s.start_ns),
                rel(&s.compute_end_ns),
                ms(s.compute_end_spread_ns()),
                s.slowest(),
                s.compute_busy_ns
                    .iter()
                    .map(|&b| format!("{:.1}", ms(b)))
                    .collect::<Vec<_>>()
                    .join("/"),
                ms(median_u64(ready.clone())),
                ms(ready.iter().copied().max().unwrap_or(0)),
                waits
                    .iter()
                    .map(|&w| format!("{:.1}", ms(w)))
                    .collect::<Vec<_>>()
                    .join("/"),
                s.summaries
                    .iter()
                    .map(|x| format!("{:.1}", ms(x.comm_ns)))
                    .collect::<Vec<_>>()
                    .join("/"),
                pct(&s
                    .summaries
                    .iter()
                    .map(Summary::hidden_share)
                    .collect::<Vec<_>>()),
            ));
        }
        for s in self.steps.iter().filter(|_| detail) {
            let t0 = s.start_ns.iter().copied().min().unwrap_or(0);
            out.push(format!(
                "  step {} collectives (ms from the step's first start): ready / start / end per rank",
                s.step
            ));
            for c in &s.collectives {
                let rel = |v: &[u64]| {
                    v.iter()
                        .map(|&x| format!("{:.1}", ms(x.saturating_sub(t0))))
                        .collect::<Vec<_>>()
                        .join("/")
                };
                out.push(format!(
                    "    {:<24} {:>10} B  ready {:<14} start {:<14} end {:<14} transfer {:.2}",
                    format!("{}#{}", c.name, c.occurrence),
                    c.bytes.unwrap_or(0),
                    rel(&c.ready_ns),
                    rel(&c.start_ns),
                    rel(&c.end_ns),
                    ms(c.transfer_ns()),
                ));
            }
        }
        out.push(format!(
            "  complete steps: hidden {} (mean {:.1}%), fitted rank skew {:.3} (per step {})",
            pct(&self.pooled_hidden_shares()),
            100.0 * self.steps_hidden_share(),
            self.fitted_skew(),
            self.step_skews()
                .iter()
                .map(|f| format!("{f:.3}"))
                .collect::<Vec<_>>()
                .join(" ")
        ));
        out.push(format!(
            "  medians: step-start spread {:.1} ms, compute-end spread {:.1} ms, bucket ready \
             spread {:.1} ms, compute busy {} ms; hidden: steps {:.1}% (rank mean), whole run {} \
             (mean {:.1}%, the trainer's figure)",
            ms(self.median_start_spread_ns()),
            ms(self.median_compute_end_spread_ns()),
            ms(self.median_ready_spread_ns()),
            self.median_compute_busy_ns()
                .iter()
                .map(|&b| format!("{:.1}", ms(b)))
                .collect::<Vec<_>>()
                .join("/"),
            100.0 * self.mean_step_hidden_share(),
            pct(&self
                .run
                .iter()
                .map(Summary::hidden_share)
                .collect::<Vec<_>>()),
            100.0 * self.run_hidden_share(),
        ));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::simulate::trace::TraceTask;

    const MS: u64 = 1_000_000;

    /// Three steps of `upload`, `x`, an all-reduce after `x`, `y`
    /// (independent of the all-reduce) and `z` (after it); `x` ends at
    /// `x_end` ms into the step and `y` takes `y_ms`; the all-reduce ends at
    /// 70 ms.
    fn rank(rank: usize, x_end: u64, y_ms: u64) -> RankTrace {
        let mut tasks = Vec::new();
        for k in 0..3u64 {
            let t = 100 * MS * k;
            let id = 10 * k;
            let task =
                |id: u64, name: &str, kind, stream, a: u64, b: u64, preds: Vec<u64>| TraceTask {
                    id,
                    name: name.into(),
                    kind,
                    stream,
                    start_ns: t + a * MS,
                    dur_ns: (b - a) * MS,
                    preds,
                    bytes: None,
                    side: false,
                };
            tasks.push(task(id, "upload", TaskKind::Host, 0, 0, 1, vec![]));
            tasks.push(task(id + 1, "x", TaskKind::Compute, 0, 1, x_end, vec![id]));
            tasks.push(task(
                id + 2,
                "all_reduce",
                TaskKind::Comm,
                1,
                x_end,
                70,
                vec![id + 1],
            ));
            tasks.push(task(
                id + 3,
                "y",
                TaskKind::Compute,
                0,
                x_end,
                x_end + y_ms,
                vec![id + 1],
            ));
            // Waits for the all-reduce (as the optimizer waits for a bucket).
            tasks.push(task(
                id + 4,
                "z",
                TaskKind::Compute,
                0,
                70,
                71,
                vec![id + 2],
            ));
        }
        RankTrace {
            rank,
            streams: vec!["compute 0".into(), "comm 0".into()],
            tasks,
        }
    }

    #[test]
    fn ready_times_waits_and_hidden_shares_per_rank() {
        let trace = Trace {
            ranks: vec![rank(0, 50, 10), rank(1, 30, 5)],
        };
        let m = measure(&trace, None).unwrap();
        assert_eq!((m.ranks, m.steps.len()), (2, 3));
        let s = &m.steps[1];
        let c = &s.collectives[0];
        assert_eq!(c.name, "all_reduce");
        assert!(c.compute_ready && c.awaited);
        assert_eq!(c.ready_ns, vec![150 * MS, 130 * MS]);
        assert_eq!(c.group_start_ns(), 150 * MS);
        assert_eq!((c.wait_ns(0), c.wait_ns(1)), (0, 20 * MS));
        assert_eq!(c.transfer_ns(), 20 * MS);
        assert_eq!(s.compute_end_ns, vec![171 * MS, 171 * MS]);
        // Rank 0 hides 10 of 20 ms, rank 1 5 of 40.
        let h = m.pooled_hidden_shares();
        assert!(
            (h[0] - 0.5).abs() < 1e-9 && (h[1] - 0.125).abs() < 1e-9,
            "{h:?}"
        );
        assert!((m.steps_hidden_share() - 0.3125).abs() < 1e-9);
        // Ready 20 ms apart, 50 ms after the step's start: e = 0.4, the
        // fastest at 0.6 of the slowest's time, factors 1.25 and 0.75:
        // skew 0.5.
        assert!((m.fitted_skew() - 0.5).abs() < 1e-9, "{}", m.fitted_skew());
        assert!(m.report(true).len() > 3);
        // One rank: no skew to measure.
        assert!(measure(
            &Trace {
                ranks: vec![rank(0, 50, 10)]
            },
            None
        )
        .is_err());
    }
}

//! The simulated run of one rank's step: placement onto `S` compute streams
//! and one comm stream, then execution.
//!
//! **Placement** happens in submission order, as Braid does it (a policy
//! decides at submission; each stream is a FIFO):
//!
//! * `single`: every task on stream 0, collectives included (Braid's
//!   `Policy::Single`: the no-overlap baseline);
//! * `recorded`: the stream the trace gives it (modulo `S`);
//! * `eager`: Braid's eager `Affinity` rule: continue the stream of the latest
//!   predecessor when that predecessor is still its stream's last task (side
//!   work excepted), else the least-loaded usable stream (load: tasks placed
//!   there, all unfinished when a step is submitted at once);
//! * `affinity` (default): what Braid's replayed steps run, the re-placement
//!   by earliest finish time (`sched/replay.rs`, HEFT's rule with a hand-off
//!   cost per predecessor on another stream and per extra stream woken, the
//!   tasks taken in program order or by upward rank, whichever predicts the
//!   shorter step), falling back to one stream when that does not beat
//!   running the tasks one after the other. It follows the predecessor's
//!   stream for a chain and otherwise picks the stream that is free first.
//!
//! Under the other policies collectives go to the comm stream. The *usable*
//! compute streams are `S`, except on a CPU machine under
//! `eager`/`affinity`, where the ranks of the process share its cores as
//! Braid's core budget does: `max(1, cores/ranks)` each (unless
//! `oversubscribe`).
//!
//! **Execution** is event-driven. A stream starts its next task when the
//! previous one ended and every predecessor has ended (plus the hand-off
//! cost for one on another stream). Every rank runs the same step (data
//! parallelism). In lock step one simulated rank stands for all and a
//! collective starts when its inputs are ready; with rank skew
//! ([`simulate_ranks`]) several ranks run side by side at different compute
//! speeds and a collective moves data only once every rank has arrived. On a
//! CPU machine the threads of every rank share the cores (processor
//! sharing): while `k` tasks of this rank that use a core run, each advances
//! at `min(1, cores / t) / (1 + γ·(min(t, cores) − 1))` of its speed, with
//! `t = ranks·k + background` (`background`: other work on a shared
//! machine; `γ`: the machine's memory contention); compute and host tasks
//! use a core, collectives too when the machine says so. A traced CPU
//! duration is first brought back to an unshared one with the same rule,
//! from the overlap it had in the trace (`traced_ranks·(1 + overlap) +
//! traced_background` threads).

use super::cost::Collective;
use super::graph::StepGraph;
use super::machine::{Backend, Machine};
use braid::{PlaceReason, TaskKind};

/// A placement policy of the simulator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SimPolicy {
    /// One compute stream.
    Single,
    /// The traced streams.
    Recorded,
    /// Braid's eager affinity rule.
    Eager,
    /// Braid's default as replayed steps run it (earliest finish time).
    Affinity,
}

impl SimPolicy {
    /// Its name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            SimPolicy::Single => "single",
            SimPolicy::Recorded => "recorded",
            SimPolicy::Eager => "eager",
            SimPolicy::Affinity => "affinity",
        }
    }
}

impl std::str::FromStr for SimPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "single" => Ok(SimPolicy::Single),
            "recorded" => Ok(SimPolicy::Recorded),
            "eager" => Ok(SimPolicy::Eager),
            "affinity" | "default" => Ok(SimPolicy::Affinity),
            _ => Err(format!(
                "unknown policy `{s}` (single, recorded, eager, affinity)"
            )),
        }
    }
}

/// What to simulate.
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// Data-parallel ranks.
    pub ranks: usize,
    /// Compute streams per rank.
    pub streams: usize,
    /// Placement policy.
    pub policy: SimPolicy,
    /// Multiplies compute durations (on top of the machine's factor).
    pub compute_scale: f64,
    /// CPU: every compute stream, whatever the cores.
    pub oversubscribe: bool,
}

/// A simulated task.
#[derive(Debug, Clone, Copy)]
pub struct Placed {
    /// Stream: `0..streams` compute, `streams` the comm stream.
    pub stream: usize,
    /// Why it went there.
    pub reason: PlaceReason,
    /// Start, ns from the step's start.
    pub start_ns: u64,
    /// End, ns.
    pub end_ns: u64,
}

/// The simulated step.
#[derive(Debug, Clone)]
pub struct SimRun {
    /// Per node, in submission order.
    pub tasks: Vec<Placed>,
    /// Compute streams (the comm stream is index `streams`).
    pub streams: usize,
    /// Usable compute streams.
    pub usable: usize,
    /// Last end, ns.
    pub makespan_ns: u64,
    /// Each node's duration before any core sharing, ns.
    pub nominal_ns: Vec<u64>,
}

/// Each node's duration on `m` with `cfg.ranks` ranks, before core sharing:
/// collectives priced by the fabric (bytes from the trace, else inferred
/// from the traced duration at the traced rank count), compute scaled.
pub fn durations(g: &StepGraph, m: &Machine, cfg: &SimConfig) -> Vec<u64> {
    let scale = m.compute_scale * cfg.compute_scale;
    g.nodes
        .iter()
        .map(|n| match n.collective {
            Some(c) => {
                let bytes = n.bytes.or_else(|| {
                    m.fabric
                        .infer_bytes(c, n.dur_ns as f64 * 1e-9, g.traced_ranks)
                });
                // A per-rank contribution gathered: the traced output had
                // one per traced rank, the simulated one per rank.
                let bytes = match Collective::grows_with_ranks(&n.name) {
                    true => bytes.map(|b| b / g.traced_ranks.max(1) as u64 * cfg.ranks as u64),
                    false => bytes,
                };
                match bytes {
                    Some(b) => (m.fabric.time(c, b, cfg.ranks).0 * 1e9).round() as u64,
                    // Neither bytes nor a traced run that moved any: keep it.
                    None => n.dur_ns,
                }
            }
            None if n.is_comm() => n.dur_ns,
            None => {
                // Undo the sharing the traced duration went through.
                let traced = g.traced_ranks.max(1) as f64 * (1.0 + n.overlap) + m.traced_background;
                let own = if m.backend == Backend::Cpu {
                    m.cpu_rate(traced)
                } else {
                    m.gpu_rate(1.0 + n.overlap)
                };
                (n.dur_ns as f64 * own * scale).round() as u64
            }
        })
        .collect()
}

/// Usable compute streams for `cfg` on `m`.
pub fn usable_streams(m: &Machine, cfg: &SimConfig) -> usize {
    let s = cfg.streams.max(1);
    match cfg.policy {
        SimPolicy::Single => 1,
        SimPolicy::Recorded => s,
        SimPolicy::Eager | SimPolicy::Affinity => {
            if m.backend == Backend::Cpu && !cfg.oversubscribe {
                (m.cores / cfg.ranks.max(1)).clamp(1, s)
            } else {
                s
            }
        }
    }
}

/// Each node's stream and why, and the order the nodes enter their streams'
/// FIFOs (program order, or for `affinity` the order it placed them in).
fn place(
    g: &StepGraph,
    dur: &[u64],
    cfg: &SimConfig,
    usable: usize,
    handoff: u64,
) -> (Vec<(usize, PlaceReason)>, Vec<usize>) {
    let comm = cfg.streams.max(1);
    let n = g.nodes.len();
    let mut out = vec![(0, PlaceReason::Single); n];
    let mut order: Vec<usize> = (0..n).collect();
    match cfg.policy {
        SimPolicy::Single | SimPolicy::Recorded => {
            for (i, node) in g.nodes.iter().enumerate() {
                out[i] = if cfg.policy == SimPolicy::Single {
                    // Braid's `Single` places collectives on stream 0 too.
                    (0, PlaceReason::Single)
                } else if node.is_comm() {
                    (comm, PlaceReason::Comm)
                } else {
                    (
                        node.traced_stream.unwrap_or(0) % comm,
                        PlaceReason::Replayed,
                    )
                };
            }
        }
        SimPolicy::Eager => {
            let mut tail: Vec<Option<usize>> = vec![None; comm + 1];
            let mut load = vec![0u64; comm + 1];
            for (i, node) in g.nodes.iter().enumerate() {
                let (s, why) = if node.is_comm() {
                    (comm, PlaceReason::Comm)
                } else {
                    let least = |avoid: Option<usize>| {
                        (0..usable)
                            .filter(|&s| Some(s) != avoid || usable == 1)
                            .min_by_key(|&s| (load[s], s))
                            .unwrap_or(0)
                    };
                    let latest = node.preds.iter().max().map(|&p| out[p].0);
                    match latest {
                        Some(s) if s < usable && tail[s] == node.preds.iter().max().copied() => {
                            if node.side {
                                (least(Some(s)), PlaceReason::Side)
                            } else {
                                (s, PlaceReason::Chain)
                            }
                        }
                        Some(s) if node.side => (least(Some(s)), PlaceReason::Side),
                        _ => (least(None), PlaceReason::LeastLoaded),
                    }
                };
                out[i] = (s, why);
                tail[s] = Some(i);
                load[s] += 1;
            }
        }
        SimPolicy::Affinity => {
            // As `Plan::replaced` does: HEFT in program order and in
            // upward-rank order, the shorter predicted makespan kept
            // (program order on a tie), unless one stream is as good.
            let program: Vec<usize> = (0..n).collect();
            let ranked = by_upward_rank(g, dur, handoff);
            let (a, span_a) = heft(g, dur, &program, comm, usable, handoff);
            let (b, span_b) = heft(g, dur, &ranked, comm, usable, handoff);
            let (placed, makespan) = if span_b < span_a {
                order = ranked;
                (b, span_b)
            } else {
                (a, span_a)
            };
            out = placed;
            let serial: u64 = (0..n)
                .filter(|&i| !g.nodes[i].is_comm())
                .map(|i| dur[i])
                .sum();
            if serial <= makespan {
                // No better than one stream: the one most tasks were on, in
                // program order.
                order = (0..n).collect();
                let home = (0..usable)
                    .max_by_key(|&s| {
                        let k = out.iter().filter(|o| o.0 == s).count();
                        (k, std::cmp::Reverse(s))
                    })
                    .unwrap_or(0);
                for (i, o) in out.iter_mut().enumerate() {
                    if !g.nodes[i].is_comm() {
                        o.0 = home;
                    }
                }
            }
        }
    }
    (out, order)
}

/// The nodes by decreasing upward rank (duration plus the longest path
/// after, `handoff` per edge), ties in program order; collectives keep their
/// program order (a virtual edge from each to the next), as
/// `Plan::by_upward_rank` does.
fn by_upward_rank(g: &StepGraph, dur: &[u64], handoff: u64) -> Vec<usize> {
    let n = g.nodes.len();
    let mut succs: Vec<Vec<usize>> = vec![Vec::new(); n];
    let mut last_comm: Option<usize> = None;
    for (i, node) in g.nodes.iter().enumerate() {
        for &p in &node.preds {
            succs[p].push(i);
        }
        if node.is_comm() {
            if let Some(p) = last_comm {
                succs[p].push(i);
            }
            last_comm = Some(i);
        }
    }
    braid::upward_rank_order(dur, &succs, handoff)
}

/// Earliest-finish-time placement of the nodes taken in `order`
/// (topological): each compute node on the usable stream where it would
/// finish first (its traced stream on a tie), collectives on the comm
/// stream. Returns the placement by node and the predicted makespan.
fn heft(
    g: &StepGraph,
    dur: &[u64],
    order: &[usize],
    comm: usize,
    usable: usize,
    handoff: u64,
) -> (Vec<(usize, PlaceReason)>, u64) {
    let n = g.nodes.len();
    let mut out = vec![(0, PlaceReason::Replayed); n];
    let mut avail = vec![0u64; comm + 1];
    let mut used = vec![false; comm + 1];
    let mut finish = vec![0u64; n];
    for (k, &i) in order.iter().enumerate() {
        let node = &g.nodes[i];
        let recorded = if node.is_comm() {
            comm
        } else {
            node.traced_stream.unwrap_or(0) % usable
        };
        let eft = |s: usize, out: &[(usize, PlaceReason)]| {
            let ready = node
                .preds
                .iter()
                .map(|&p| finish[p] + if out[p].0 == s { 0 } else { handoff })
                .max()
                .unwrap_or(0);
            let start = if used[s] || k == 0 { avail[s] } else { handoff };
            ready.max(start) + dur[i]
        };
        let mut best = (recorded, eft(recorded, &out));
        if !node.is_comm() {
            for s in (0..usable).filter(|&s| s != recorded) {
                let e = eft(s, &out);
                if e < best.1 {
                    best = (s, e);
                }
            }
        }
        let why = if node.is_comm() {
            PlaceReason::Comm
        } else {
            PlaceReason::Replayed
        };
        out[i] = (best.0, why);
        finish[i] = best.1;
        avail[best.0] = best.1;
        used[best.0] = true;
    }
    (out, finish.iter().copied().max().unwrap_or(0))
}

/// Simulates step `g` on machine `m` under `cfg`, every rank in lock step
/// (one rank stands for all: [`simulate_ranks`] with one rank at speed 1).
pub fn simulate(g: &StepGraph, m: &Machine, cfg: &SimConfig) -> SimRun {
    simulate_ranks(g, m, cfg, &[1.0])
        .pop()
        .expect("one simulated rank")
}

/// The time factors of the compute tasks of the ranks simulated for rank
/// skew `skew` (docs/simulator.md, "Rank skew"): `min(ranks, max_ranks)`
/// ranks whose factors spread evenly from `1 + skew/2` (the slowest, first)
/// to `1 − skew/2` (the fastest, last), around the modelled speed (the
/// lock-step model predicts the mean rank). No skew (or one rank): one rank
/// at 1.
pub fn skew_factors(ranks: usize, skew: f64, max_ranks: usize) -> Vec<f64> {
    let k = ranks.min(max_ranks.max(2));
    if skew <= 0.0 || k < 2 {
        return vec![1.0];
    }
    let skew = skew.min(1.9);
    (0..k)
        .map(|j| 1.0 + skew / 2.0 - skew * j as f64 / (k - 1) as f64)
        .collect()
}

/// Simulates step `g` on `m` under `cfg` as `factors.len()` ranks run it
/// side by side, rank `j`'s compute (non-communication) durations multiplied
/// by `factors[j]`. They stand for the `cfg.ranks` ranks: on a CPU machine
/// each of them counts for `cfg.ranks / factors.len()` ranks' busy threads.
/// A collective's span starts on each rank when that rank's comm stream
/// reaches it and its inputs are ready (its arrival), but it moves no data
/// until every rank has arrived (a ring all-reduce, or the CPU ranks'
/// arrival barrier); then it runs for its priced time and ends on every
/// rank at once. Time spent waiting for the last rank is part of the span,
/// as in a trace. With identical factors every rank runs exactly the
/// one-rank (lock-step) simulation.
pub fn simulate_ranks(g: &StepGraph, m: &Machine, cfg: &SimConfig, factors: &[f64]) -> Vec<SimRun> {
    let base = durations(g, m, cfg);
    let usable = usable_streams(m, cfg);
    let handoff = (m.handoff_us * 1e3).round() as u64;
    let copies = factors.len().max(1);
    let n = g.nodes.len();
    let nstreams = cfg.streams.max(1) + 1;
    // Per rank: its durations, placement and stream FIFOs.
    let mut durs: Vec<Vec<u64>> = Vec::with_capacity(copies);
    let mut placed: Vec<Vec<(usize, PlaceReason)>> = Vec::with_capacity(copies);
    let mut fifo: Vec<Vec<usize>> = vec![Vec::new(); copies * nstreams];
    for (j, &f) in factors.iter().enumerate() {
        let dur: Vec<u64> = base
            .iter()
            .zip(&g.nodes)
            .map(|(&d, node)| {
                if node.is_comm() || f == 1.0 {
                    d
                } else {
                    (d as f64 * f.max(0.0)).round() as u64
                }
            })
            .collect();
        let (p, order) = place(g, &dur, cfg, usable, handoff);
        for &i in &order {
            fifo[j * nstreams + p[i].0].push(j * n + i);
        }
        durs.push(dur);
        placed.push(p);
    }
    // Tasks and streams of every rank, flattened: task `j·n + i`, stream
    // `j·nstreams + s`.
    let total = copies * n;
    let stream_of = |t: usize| (t / n) * nstreams + placed[t / n][t % n].0;
    let mut head = vec![0usize; copies * nstreams];
    let mut busy: Vec<Option<usize>> = vec![None; copies * nstreams];
    let mut remaining: Vec<f64> = durs.iter().flatten().map(|&d| d as f64).collect();
    let mut start = vec![0u64; total];
    let mut end: Vec<Option<f64>> = vec![None; total];
    // How many ranks have started each collective.
    let mut arrived = vec![0usize; n];
    let uses_core = |t: usize| match g.nodes[t % n].kind {
        TaskKind::Comm => m.backend == Backend::Cpu && m.comm_uses_cores,
        _ => m.backend == Backend::Cpu,
    };
    let shares_sms =
        |t: usize| m.backend == Backend::Gpu && g.nodes[t % n].kind == TaskKind::Compute;
    // A collective waits (moves nothing, uses nothing) until every rank has
    // arrived; other tasks of the comm stream (a local sparse-row add) do
    // not wait.
    let waiting = |t: usize, arrived: &[usize]| {
        g.nodes[t % n].collective.is_some() && copies > 1 && arrived[t % n] < copies
    };
    let mut now = 0.0f64;
    let mut done = 0usize;
    while done < total {
        // Start what can start now; note the earliest future start.
        let mut next_start = f64::INFINITY;
        for q in 0..copies * nstreams {
            if busy[q].is_some() || head[q] >= fifo[q].len() {
                continue;
            }
            let t = fifo[q][head[q]];
            let (j, i) = (t / n, t % n);
            let mut ready = 0.0f64;
            let mut blocked = false;
            for &p in &g.nodes[i].preds {
                match end[j * n + p] {
                    Some(e) => {
                        let hop = if stream_of(j * n + p) == q {
                            0.0
                        } else {
                            handoff as f64
                        };
                        ready = ready.max(e + hop);
                    }
                    None => blocked = true,
                }
            }
            if blocked {
                continue;
            }
            if ready <= now {
                busy[q] = Some(t);
                head[q] += 1;
                start[t] = now.round() as u64;
                if g.nodes[i].collective.is_some() {
                    arrived[i] += 1;
                }
            } else {
                next_start = next_start.min(ready);
            }
        }
        // Rates under core sharing: every rank's busy threads (each
        // simulated rank standing for `ranks / copies` ranks) and the
        // background.
        let cores_busy = busy
            .iter()
            .flatten()
            .filter(|&&t| uses_core(t) && !waiting(t, &arrived))
            .count();
        let rate_core = if cores_busy > 0 {
            let threads = if copies == 1 {
                (cfg.ranks.max(1) * cores_busy) as f64
            } else {
                cores_busy as f64 * cfg.ranks.max(1) as f64 / copies as f64
            };
            m.cpu_rate(threads + m.background.max(0.0))
        } else {
            1.0
        };
        // GPU: each rank's running kernels share its SMs.
        let mut kernels = vec![0usize; copies];
        for &t in busy.iter().flatten() {
            if shares_sms(t) {
                kernels[t / n] += 1;
            }
        }
        let rate = |t: usize| {
            if waiting(t, &arrived) {
                0.0
            } else if uses_core(t) {
                rate_core
            } else if shares_sms(t) {
                m.gpu_rate(kernels[t / n] as f64)
            } else {
                1.0
            }
        };
        let next_end = busy
            .iter()
            .flatten()
            .filter(|&&t| rate(t) > 0.0)
            .map(|&t| now + remaining[t] / rate(t))
            .fold(f64::INFINITY, f64::min);
        let tnext = next_end.min(next_start);
        if !tnext.is_finite() {
            // Nothing runs and nothing can start: a cycle (cannot happen
            // with predecessors earlier in submission order).
            break;
        }
        let dt = tnext - now;
        for slot in busy.iter_mut() {
            if let Some(t) = *slot {
                let r = rate(t);
                if r == 0.0 {
                    continue;
                }
                // A task whose projected end is `tnext` ends now, whatever is
                // left of it after the subtraction: far from 0, `now +
                // remaining / rate` rounds, and a remainder left by that
                // rounding could round back to `now` (no progress: the loop
                // never ended, at 10^8 ranks or a compute scale of 10^300).
                let ends = now + remaining[t] / r <= tnext;
                remaining[t] -= dt * r;
                if ends || remaining[t] <= 1e-3 {
                    remaining[t] = 0.0;
                    end[t] = Some(tnext);
                    *slot = None;
                    done += 1;
                }
            }
        }
        now = tnext;
    }
    (0..copies)
        .map(|j| {
            let tasks: Vec<Placed> = (0..n)
                .map(|i| Placed {
                    stream: placed[j][i].0,
                    reason: placed[j][i].1,
                    start_ns: start[j * n + i],
                    end_ns: end[j * n + i].unwrap_or(now).round() as u64,
                })
                .collect();
            let makespan_ns = tasks.iter().map(|t| t.end_ns).max().unwrap_or(0);
            SimRun {
                tasks,
                streams: cfg.streams.max(1),
                usable,
                makespan_ns,
                nominal_ns: durs[j].clone(),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::simulate::cost::{Collective, Fabric, Link};
    use crate::simulate::graph::Node;

    const MS: u64 = 1_000_000;

    fn node(name: &str, ms: u64, preds: &[usize]) -> Node {
        Node {
            name: name.into(),
            kind: TaskKind::Compute,
            collective: None,
            traced_stream: Some(0),
            dur_ns: ms * MS,
            bytes: None,
            side: false,
            preds: preds.to_vec(),
            overlap: 0.0,
        }
    }

    /// A 100 MB all-reduce after `preds`.
    fn all_reduce(preds: &[usize]) -> Node {
        let mut d = node("all_reduce bucket 0", 0, preds);
        d.kind = TaskKind::Comm;
        d.collective = Some(Collective::AllReduce);
        d.traced_stream = None;
        d.bytes = Some(100_000_000);
        d
    }

    /// One traced rank's step of `nodes`.
    fn step(nodes: Vec<Node>, host_gap_ns: u64) -> StepGraph {
        StepGraph {
            nodes,
            host_gap_ns,
            measured_step_ns: 0,
            traced_ranks: 1,
            traced_streams: 1,
            complete_steps: 1,
        }
    }

    /// a → b, a → c, c → all-reduce d (100 MB), b + d → e.
    fn graph() -> StepGraph {
        step(
            vec![
                node("a", 10, &[]),
                node("b", 20, &[0]),
                node("c", 30, &[0]),
                all_reduce(&[2]),
                node("e", 5, &[1, 3]),
            ],
            MS,
        )
    }

    /// 2 ranks at 10 GB/s, no latency: the all-reduce takes B/β = 10 ms.
    fn machine(backend: Backend, cores: usize) -> Machine {
        Machine {
            name: "test".into(),
            backend,
            cores,
            fabric: Fabric {
                intra: Link {
                    gbps: 10.0,
                    latency_us: 0.0,
                },
                inter: None,
                ranks_per_node: 8,
                launch_us: 0.0,
                tree_efficiency: 0.5,
                local_gbps: 0.0,
            },
            compute_scale: 1.0,
            handoff_us: 0.0,
            comm_uses_cores: false,
            background: 0.0,
            contention: 0.0,
            gpu_sharing: 0.0,
            traced_background: 0.0,
            rank_skew: 0.0,
        }
    }

    fn cfg(ranks: usize, streams: usize, policy: SimPolicy) -> SimConfig {
        SimConfig {
            ranks,
            streams,
            policy,
            compute_scale: 1.0,
            oversubscribe: false,
        }
    }

    fn times(r: &SimRun) -> Vec<(usize, u64, u64)> {
        r.tasks
            .iter()
            .map(|t| (t.stream, t.start_ns / MS, t.end_ns / MS))
            .collect()
    }

    /// A gather of per-rank rows (`all_gather rows…`, 10 MB traced at one
    /// rank) moves (n-1)/n of n contributions at n ranks: 4 ranks, 10 GB/s
    /// → 30 MB in 3 ms. A gather of a fixed whole (ZeRO-1's parameters)
    /// moves (n-1)/n of it: 0.75 ms.
    #[test]
    fn gathers_of_per_rank_rows_grow_with_the_ranks() {
        let gather = |name: &str| {
            let mut d = node(name, 0, &[]);
            d.kind = TaskKind::Comm;
            d.collective = Some(Collective::AllGather);
            d.traced_stream = None;
            d.bytes = Some(10_000_000);
            d
        };
        let g = step(
            vec![
                gather("all_gather rows: rows of wte"),
                gather("all_gather params 0"),
            ],
            0,
        );
        let d = durations(&g, &machine(Backend::Gpu, 0), &cfg(4, 1, SimPolicy::Single));
        assert_eq!(d, vec![3 * MS, 3 * MS / 4]);
    }

    /// Far from 0 the event loop's times round: a task's remainder left by
    /// that rounding could project an end equal to `now`, and the loop made
    /// no progress (10^8 CPU ranks sharing 2 cores, or a compute scale of
    /// 10^300, never ended). Every task ends, at its projected time.
    #[test]
    fn the_event_loop_progresses_far_from_zero() {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let g = graph();
            let m = machine(Backend::Cpu, 2);
            let mut c = cfg(100_000_000, 2, SimPolicy::Affinity);
            let many = simulate(&g, &m, &c);
            c.ranks = 2;
            // Steps near 10^17 ns (the program refuses steps past 2^53 ns;
            // sums past u64 would overflow).
            c.compute_scale = 1e9;
            let huge = simulate(&g, &m, &c);
            tx.send((many.makespan_ns, huge.makespan_ns)).unwrap();
        });
        let (many, huge) = rx
            .recv_timeout(std::time::Duration::from_secs(60))
            .expect("the simulation ended");
        // 10^8 ranks on 2 cores: every task 5·10^7 times slower or more,
        // on the chain a → c → e (45 ms of compute).
        assert!(many >= 45 * MS * 50_000_000, "{many}");
        assert!(huge >= 45 * MS * 1_000_000_000, "{huge}");
    }

    #[test]
    fn single_stream_runs_in_submission_order() {
        let r = simulate(
            &graph(),
            &machine(Backend::Gpu, 0),
            &cfg(2, 1, SimPolicy::Single),
        );
        // The all-reduce too: Braid's `single` runs collectives on stream 0.
        assert_eq!(
            times(&r),
            vec![
                (0, 0, 10),
                (0, 10, 30),
                (0, 30, 60),
                (0, 60, 70),
                (0, 70, 75)
            ]
        );
        assert_eq!(r.makespan_ns, 75 * MS);
    }

    /// GPU sharing: two independent 20 ms kernels on two streams end
    /// together at 20 ms with σ 0 (independent devices), at 40 ms with σ 1
    /// (one device's throughput shared: the pair takes their sum), at
    /// 20·(1 + σ) in between.
    #[test]
    fn kernels_on_two_streams_share_the_gpu() {
        let mut g = step(
            vec![
                node("a", 20, &[]),
                node("b", 20, &[]),
                node("c", 1, &[0, 1]),
            ],
            MS,
        );
        g.nodes[1].traced_stream = Some(1);
        g.traced_streams = 2;
        for (sigma, both_end) in [(0.0, 20), (0.5, 30), (1.0, 40)] {
            let m = Machine {
                gpu_sharing: sigma,
                ..machine(Backend::Gpu, 0)
            };
            let r = simulate(&g, &m, &cfg(1, 2, SimPolicy::Recorded));
            let ends: Vec<u64> = r.tasks.iter().map(|t| t.end_ns / MS).collect();
            assert_eq!(ends, vec![both_end, both_end, both_end + 1], "σ {sigma}");
        }
        // On one stream nothing is shared: the sum, whatever σ.
        let m = Machine {
            gpu_sharing: 1.0,
            ..machine(Backend::Gpu, 0)
        };
        assert_eq!(
            simulate(&g, &m, &cfg(1, 1, SimPolicy::Single)).makespan_ns,
            41 * MS
        );
    }

    /// Under `single` nothing overlaps a collective, even where the graph
    /// would let it: an independent compute task waits behind it on stream 0
    /// (under `recorded` it runs beside it on the comm stream).
    #[test]
    fn single_hides_no_communication() {
        let mut g = graph();
        // Task 4 (5 ms) no longer needs the all-reduce (task 3).
        g.nodes[4].preds.retain(|&p| p != 3);
        let m = machine(Backend::Gpu, 0);
        let single = simulate(&g, &m, &cfg(2, 1, SimPolicy::Single));
        assert!(single.tasks.iter().all(|t| t.stream == 0));
        assert_eq!(single.makespan_ns, 75 * MS);
        let rec = simulate(&g, &m, &cfg(2, 1, SimPolicy::Recorded));
        assert_eq!(rec.tasks[3].stream, 1);
        assert!(rec.makespan_ns < 75 * MS, "{}", rec.makespan_ns);
    }

    #[test]
    fn affinity_spreads_the_independent_branch_and_the_comm_overlaps() {
        let r = simulate(
            &graph(),
            &machine(Backend::Gpu, 0),
            &cfg(2, 2, SimPolicy::Affinity),
        );
        // b stays on a's stream (a tie keeps the traced one), c finishes
        // first on the idle stream 1, the all-reduce follows c on the comm
        // stream (2) while b runs.
        assert_eq!(
            times(&r),
            vec![
                (0, 0, 10),
                (0, 10, 30),
                (1, 10, 40),
                (2, 40, 50),
                (0, 50, 55)
            ]
        );
        // The same graph at one rank: the all-reduce costs nothing.
        let r1 = simulate(
            &graph(),
            &machine(Backend::Gpu, 0),
            &cfg(1, 2, SimPolicy::Affinity),
        );
        assert_eq!(r1.makespan_ns, 45 * MS);
    }

    #[test]
    fn cpu_threads_share_the_cores() {
        // One core, one rank, two streams: b and c share the core from 10 ms
        // (half speed each) until b ends at 50; c ends alone at 60.
        let r = simulate(
            &graph(),
            &machine(Backend::Cpu, 1),
            &SimConfig {
                oversubscribe: true,
                ..cfg(1, 2, SimPolicy::Affinity)
            },
        );
        assert_eq!(&times(&r)[..3], &[(0, 0, 10), (0, 10, 50), (1, 10, 60)]);
        // Two ranks on that core: everything at half speed.
        let r2 = simulate(
            &graph(),
            &machine(Backend::Cpu, 1),
            &SimConfig {
                oversubscribe: true,
                ..cfg(2, 2, SimPolicy::Affinity)
            },
        );
        assert_eq!(&times(&r2)[..3], &[(0, 0, 20), (0, 20, 100), (1, 20, 120)]);
        // Two ranks on two cores under the core budget: one usable stream.
        let m = machine(Backend::Cpu, 2);
        let c = cfg(2, 2, SimPolicy::Affinity);
        assert_eq!(usable_streams(&m, &c), 1);
        // Background work of one core on two cores, one rank, one stream:
        // 2 cores / (1 + 1) threads, full speed.
        let m = Machine {
            background: 1.0,
            ..machine(Backend::Cpu, 2)
        };
        let r = simulate(&graph(), &m, &cfg(1, 1, SimPolicy::Single));
        assert_eq!(r.makespan_ns, 65 * MS);
        // Two background cores' worth: 2/3 speed, 65 ms of compute in 97.5.
        let m = Machine {
            background: 2.0,
            ..m
        };
        let r = simulate(&graph(), &m, &cfg(1, 1, SimPolicy::Single));
        assert_eq!(r.makespan_ns, 97_500_000);
    }

    #[test]
    fn eager_affinity_chains_and_sends_side_work_away() {
        let mut g = graph();
        g.nodes[2].side = true;
        let r = simulate(&g, &machine(Backend::Gpu, 0), &cfg(2, 2, SimPolicy::Eager));
        let s: Vec<(usize, PlaceReason)> = r.tasks.iter().map(|t| (t.stream, t.reason)).collect();
        assert_eq!(
            s,
            vec![
                (0, PlaceReason::LeastLoaded),
                (0, PlaceReason::Chain),
                (1, PlaceReason::Side),
                (2, PlaceReason::Comm),
                // Its latest predecessor is the all-reduce (comm stream):
                // the least-loaded compute stream.
                (1, PlaceReason::LeastLoaded),
            ]
        );
        assert_eq!(r.makespan_ns, 55 * MS);
    }

    #[test]
    fn handoffs_cost_time() {
        let m = Machine {
            handoff_us: 1000.0,
            ..machine(Backend::Gpu, 0)
        };
        let r = simulate(&graph(), &m, &cfg(2, 2, SimPolicy::Recorded));
        // Recorded: all compute on stream 0; the all-reduce waits 1 ms for
        // c (another stream), e waits 1 ms for it.
        assert_eq!(
            times(&r),
            vec![
                (0, 0, 10),
                (0, 10, 30),
                (0, 30, 60),
                (2, 61, 71),
                (0, 72, 77)
            ]
        );
    }
    /// Identical ranks side by side run exactly the lock-step simulation,
    /// on a GPU and on shared CPU cores (where each simulated rank counts
    /// for `ranks / simulated` ranks' threads).
    #[test]
    fn ranks_at_one_speed_run_the_lock_step_simulation() {
        assert_eq!(skew_factors(4, 0.0, 8), vec![1.0]);
        assert_eq!(skew_factors(1, 0.3, 8), vec![1.0]);
        let g = graph();
        for (m, c) in [
            (machine(Backend::Gpu, 0), cfg(2, 2, SimPolicy::Affinity)),
            (
                Machine {
                    background: 0.5,
                    contention: 0.2,
                    gpu_sharing: 0.0,
                    ..machine(Backend::Cpu, 2)
                },
                SimConfig {
                    oversubscribe: true,
                    ..cfg(16, 2, SimPolicy::Affinity)
                },
            ),
        ] {
            let one = simulate(&g, &m, &c);
            for k in [2, 4] {
                let runs = simulate_ranks(&g, &m, &c, &vec![1.0; k]);
                assert_eq!(runs.len(), k);
                for r in &runs {
                    assert_eq!(times(r), times(&one));
                    assert_eq!(
                        r.tasks.iter().map(|t| t.end_ns).collect::<Vec<_>>(),
                        one.tasks.iter().map(|t| t.end_ns).collect::<Vec<_>>()
                    );
                    assert_eq!(r.makespan_ns, one.makespan_ns);
                }
            }
        }
    }

    /// The all-reduce moves data only once the last rank is ready: the fast
    /// rank's span starts at its own arrival and holds the wait; both end
    /// together, the collective's time after the slow rank's arrival.
    #[test]
    fn a_collective_starts_when_the_last_rank_is_ready() {
        let runs = simulate_ranks(
            &graph(),
            &machine(Backend::Gpu, 0),
            &cfg(2, 1, SimPolicy::Recorded),
            &[1.0, 0.5],
        );
        // Slow rank: c ends at 60, the all-reduce runs 60-70.
        assert_eq!(
            times(&runs[0]),
            vec![
                (0, 0, 10),
                (0, 10, 30),
                (0, 30, 60),
                (1, 60, 70),
                (0, 70, 75)
            ]
        );
        // Fast rank (half the compute time): c ends at 30; it arrives at 30
        // and waits for the slow rank until 60.
        let fast: Vec<(u64, u64)> = runs[1]
            .tasks
            .iter()
            .map(|t| (t.start_ns / 100_000, t.end_ns / 100_000))
            .collect();
        assert_eq!(
            fast,
            vec![(0, 50), (50, 150), (150, 300), (300, 700), (700, 725)]
        );
        assert_eq!(skew_factors(2, 0.5, 8), vec![1.25, 0.75]);
        assert_eq!(skew_factors(3, 0.5, 8), vec![1.25, 1.0, 0.75]);
        assert_eq!(skew_factors(1024, 0.7, 8).len(), 8);
    }

    /// A rank that finishes its compute long before the slowest one waits
    /// in the collective with nothing to hide it: the pooled hidden share
    /// falls, and more skew lowers it further.
    #[test]
    fn skew_beyond_the_backward_lowers_the_hidden_share() {
        let g = short_tail();
        let c = cfg(2, 1, SimPolicy::Recorded);
        let hidden = |skew: f64| {
            let m = Machine {
                rank_skew: skew,
                ..machine(Backend::Gpu, 0)
            };
            crate::simulate::predict_ranks(&g, &m, &c)
        };
        let (p0, _) = hidden(0.0);
        assert_eq!(p0.factors, vec![1.0]);
        assert!(
            (p0.hidden_share() - 0.5).abs() < 1e-9,
            "{}",
            p0.hidden_share()
        );
        // Skew 0.5 on a GPU (no shared cores): compute ×1.25 on the slow
        // rank, ×0.75 on the fast one. Slow: c ends at 25, the all-reduce
        // runs 25-35 beside b (25-31.25): 6.25 of 10 ms hidden. Fast: c ends
        // at 15, b 15-18.75, the all-reduce span from its arrival at 15 to
        // 35: 3.75 of 20 ms. Pooled: 10 of 30 ms. (The spread is found by
        // bisection on whole nanoseconds: equal to 1e-6.)
        let (p5, runs) = hidden(0.5);
        assert_eq!(p5.factors.len(), 2);
        assert!((p5.factors[0] - 1.25).abs() < 1e-6 && (p5.factors[1] - 0.75).abs() < 1e-6);
        let near = |ns: u64, ms: f64| (ns as f64 - ms * 1e6).abs() < 100.0;
        assert!(near(runs[0].tasks[2].start_ns, 25.0));
        assert!(near(runs[1].tasks[2].start_ns, 15.0));
        assert!(near(runs[1].tasks[2].end_ns, 35.0));
        assert!(
            (p5.hidden_share() - 1.0 / 3.0).abs() < 1e-6,
            "{}",
            p5.hidden_share()
        );
        // The slow rank sets the step: e (1 ms × 1.25) after the all-reduce.
        assert!(near(p5.step_ns, 36.25));
        let (p8, _) = hidden(0.8);
        assert!(p8.hidden_share() < p5.hidden_share());
    }

    /// a → c → all-reduce (10 ms at 2 ranks); a → b (5 ms), which overlaps
    /// half of it; e after both.
    fn short_tail() -> StepGraph {
        step(
            vec![
                node("a", 10, &[]),
                node("c", 10, &[0]),
                all_reduce(&[1]),
                node("b", 5, &[0, 1]),
                node("e", 1, &[2, 3]),
            ],
            0,
        )
    }

    /// On shared cores a rank that waits frees its core, so the slow rank
    /// catches up: to end the backward `s` apart (a trace's fitted skew)
    /// the compute factors must spread wider than `s`. Without shared
    /// cores the spread is `s` itself.
    #[test]
    fn the_factor_spread_gives_the_skew_a_trace_would_show() {
        use crate::simulate::skew::{simulated_skew, solve_factor_spread};
        let g = short_tail();
        let c = SimConfig {
            oversubscribe: true,
            ..cfg(2, 1, SimPolicy::Recorded)
        };
        let gpu = machine(Backend::Gpu, 0);
        let s = solve_factor_spread(&g, &gpu, &c, 0.4).unwrap();
        assert!((s - 0.4).abs() < 1e-6, "{s}");
        // Two ranks on one core: half speed while both compute.
        let cpu = machine(Backend::Cpu, 1);
        let s = solve_factor_spread(&g, &cpu, &c, 0.4).unwrap();
        assert!(s > 0.45, "{s}");
        let runs = simulate_ranks(&g, &cpu, &c, &skew_factors(2, s, 8));
        let got = simulated_skew(&g, &runs).unwrap();
        assert!((got - 0.4).abs() < 1e-3, "{got}");
        // At the skew itself the ranks end closer than 0.4.
        let runs = simulate_ranks(&g, &cpu, &c, &skew_factors(2, 0.4, 8));
        assert!(simulated_skew(&g, &runs).unwrap() < 0.39);
        // No skew, or one rank: no spread.
        assert_eq!(solve_factor_spread(&g, &cpu, &c, 0.0), Ok(0.0));
        assert_eq!(
            solve_factor_spread(&g, &cpu, &cfg(1, 1, SimPolicy::Recorded), 0.4),
            Ok(0.0)
        );
    }

    /// Under `single` each collective waits on the one stream, so the
    /// ranks drift apart only over the compute since the previous one: a
    /// short last stretch (1 ms after 10) cannot show a skew of 0.4 however
    /// far the factors spread. That is reported (the skew reached at the
    /// widest spread) instead of simulating ranks at ×1.95 and ×0.05, and
    /// the prediction runs in lock step, saying so.
    #[test]
    fn a_skew_the_ranks_cannot_show_is_reported_not_saturated() {
        use crate::simulate::skew::solve_factor_spread;
        let g = step(
            vec![
                node("a", 10, &[]),
                all_reduce(&[0]),
                node("c", 1, &[1]),
                all_reduce(&[2]),
                node("e", 1, &[3]),
            ],
            0,
        );
        let m = Machine {
            rank_skew: 0.4,
            ..machine(Backend::Gpu, 0)
        };
        let c = cfg(2, 1, SimPolicy::Single);
        let max = solve_factor_spread(&g, &m, &c, 0.4).unwrap_err();
        assert!(max > 0.0 && max < 0.4, "{max}");
        // A skew below that is found.
        let s = solve_factor_spread(&g, &m, &c, max / 2.0).unwrap();
        assert!(s > 0.0 && s < 1.9, "{s}");
        let (p, runs) = crate::simulate::predict_ranks(&g, &m, &c);
        assert_eq!(p.factors, vec![1.0]);
        assert_eq!(p.unreachable_skew, Some(max));
        assert_eq!(runs.len(), 1);
    }
}

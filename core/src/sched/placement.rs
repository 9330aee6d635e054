//! Placement: which stream runs a task, and why.
//!
//! A policy sees the task's kind and priority, where its latest predecessor
//! runs and whether that stream has moved on since, and how many tasks each
//! stream has queued. It returns a stream index and a [`Placement`] (the rule
//! it applied, recorded in the trace). Communication tasks always go to the
//! communication streams, by their index alone, so collective order is the
//! same on every rank whatever happens to compute tasks.
//!
//! **The core budget.** Stream threads of a CPU runtime are busy threads: two
//! ranks of one process with two compute streams each are four busy threads,
//! and on two cores they only take turns (issue 10 measured `affinity` at
//! 0.91–1.00× of `single` there). So the CPU runtimes of a process share a
//! budget of cores ([`crate::topo::cpu_budget`], or the builder's
//! `cpu_cores`): each registers with [`CoreBudget`] while it lives, and
//! `Affinity` places compute tasks on the first [`CoreBudget`] share of its
//! compute streams only (see [`fair_shares`] for the rule). Communication
//! streams are not counted: a comm thread mostly waits for its peers. CUDA
//! runtimes do not register (their stream threads mostly block on the
//! device). Runtimes built with `oversubscribe(true)` (placement over every
//! compute stream, as before the budget), `Single` runtimes (1 stream) and
//! `RoundRobin` runtimes (every compute stream) register what they use
//! without being limited, so the budgeted runtimes leave those cores to them.

use super::cost::HANDOFF_NS;
use crate::kind::{PlaceReason, Placement, Priority, TaskKind};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

/// How tasks are spread over streams.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Policy {
    /// Everything on stream 0, communication included: the sequential baseline
    /// every benchmark compares against.
    Single,
    /// Compute tasks cycle over the compute streams; communication goes to the
    /// communication streams.
    RoundRobin,
    /// Keep a task on the stream of its latest predecessor when that stream has
    /// not moved on to other work (no event needed, no conflict); otherwise the
    /// least-loaded compute stream. `Side` tasks leave their predecessor's
    /// stream free for the main chain. Communication goes to the
    /// communication streams.
    #[default]
    Affinity,
}

impl Policy {
    /// All policies, for tests and benchmarks that sweep them.
    pub const ALL: [Policy; 3] = [Policy::Single, Policy::RoundRobin, Policy::Affinity];

    /// The policy's command-line name.
    pub fn name(self) -> &'static str {
        match self {
            Policy::Single => "single",
            Policy::RoundRobin => "round-robin",
            Policy::Affinity => "affinity",
        }
    }
}

impl std::str::FromStr for Policy {
    type Err = crate::Error;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "single" => Ok(Policy::Single),
            "round-robin" | "roundrobin" | "rr" => Ok(Policy::RoundRobin),
            "affinity" | "default" => Ok(Policy::Affinity),
            _ => Err(crate::Error::Config(format!(
                "unknown placement policy `{s}` (expected single, round-robin or affinity)"
            ))),
        }
    }
}

impl std::fmt::Display for Policy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What a policy knows about the task being placed.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Request<'a> {
    pub kind: TaskKind,
    pub priority: Priority,
    /// Stream of the latest (most recently submitted) unfinished predecessor,
    /// and whether that predecessor is still the last task on its stream.
    pub latest_pred: Option<(usize, bool)>,
    /// For communication tasks: which communication stream (modulo their count).
    pub comm_index: usize,
    /// What earliest-finish placement knows (CPU runtimes; `None` on CUDA).
    pub timing: Option<Timing<'a>>,
}

/// The cost model's view of a task being placed: when it could start and how
/// long it should take on each stream, all in nanoseconds on the process's
/// clock.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Timing<'a> {
    /// Now, except for a chain, which needs no clock (0).
    pub now: u64,
    /// The task continues a chain: every unfinished predecessor is on the
    /// latest one's compute stream, that predecessor is the stream's last
    /// task, and the task is not side work. Its stream then finishes first —
    /// elsewhere it would wait for the same predecessors plus a hand-off.
    pub chain: bool,
    /// The estimate for the task's name (`None`: never measured yet).
    pub dur: Option<u64>,
    /// Stream and predicted finish of each unfinished predecessor.
    pub preds: &'a [(usize, u64)],
    /// The predicted time each stream finishes what is queued on it.
    pub free_at: &'a [u64],
}

impl Timing<'_> {
    /// When the task would finish on stream `s`, which has `load` unfinished
    /// tasks: after its predecessors (plus a hand-off for each on another
    /// stream) and after the stream's queue (plus a wake-up if the stream is
    /// idle, its thread perhaps asleep), then its estimated duration (0 when
    /// unknown).
    pub(crate) fn finish_on(&self, s: usize, load: u64) -> u64 {
        let ready = self
            .preds
            .iter()
            .map(|&(ps, f)| if ps == s { f } else { f + HANDOFF_NS })
            .max()
            .unwrap_or(0);
        let start = if load == 0 {
            self.now + HANDOFF_NS
        } else {
            self.now.max(self.free_at.get(s).copied().unwrap_or(0))
        };
        ready.max(start) + self.dur.unwrap_or(0)
    }
}

/// The small trait every placement policy implements.
pub(crate) trait Place: Send {
    /// `load(s)` is the number of tasks placed on stream `s` not yet
    /// completed (read from the stream threads' counters only when asked).
    /// Returns the stream and why.
    fn place(&mut self, req: &Request<'_>, load: &dyn Fn(usize) -> u64) -> (usize, Placement);

    /// How many compute streams the policy may use now.
    fn usable(&self) -> usize;

    /// The record of a task whose stream was decided without the policy
    /// (pinned by the code, by the placement file, by its bundle).
    fn decided(&self, reason: PlaceReason, priority: Priority) -> Placement {
        placement(reason, self.usable(), priority)
    }
}

fn placement(reason: PlaceReason, usable: usize, priority: Priority) -> Placement {
    Placement {
        reason,
        usable: usable.min(u16::MAX as usize) as u16,
        priority,
    }
}

/// The stream layout: compute streams first, then communication streams.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Layout {
    pub compute: usize,
    pub comm: usize,
}

impl Layout {
    /// Where a communication task goes: its communication stream, by its
    /// index alone. Without communication streams, compute stream 0: the
    /// collectives of one communicator must run in program order on one
    /// stream (each takes its place in the ranks' sequence as it runs), so
    /// they may not spread over the compute streams as compute does.
    fn comm_stream(&self, req: &Request<'_>) -> Option<usize> {
        (req.kind == TaskKind::Comm).then(|| match self.comm {
            0 => 0,
            n => self.compute + req.comm_index % n,
        })
    }

    /// The least-loaded of compute streams `0..usable`, avoiding `avoid`
    /// when another is usable; the lowest index on ties.
    fn least_loaded(
        &self,
        usable: usize,
        load: &dyn Fn(usize) -> u64,
        avoid: Option<usize>,
    ) -> usize {
        let mut best = None;
        for s in 0..usable.clamp(1, self.compute) {
            if Some(s) == avoid && usable > 1 {
                continue;
            }
            let l = load(s);
            if best.is_none_or(|(_, bl)| l < bl) {
                best = Some((s, l));
            }
        }
        best.map_or(0, |(s, _)| s)
    }
}

/// How many compute streams a policy may use: this runtime's share of the
/// core budget, kept up to date by [`CoreBudget`] as runtimes come and go
/// (read once per placement, relaxed: any recent value is a valid choice).
#[derive(Debug, Clone)]
pub(crate) struct Share(Arc<AtomicUsize>);

impl Share {
    /// A share that never changes.
    pub(crate) fn fixed(n: usize) -> Self {
        Share(Arc::new(AtomicUsize::new(n.max(1))))
    }

    pub(crate) fn get(&self) -> usize {
        self.0.load(Ordering::Relaxed).max(1)
    }
}

pub(crate) fn make(policy: Policy, layout: Layout, share: Share) -> Box<dyn Place> {
    match policy {
        Policy::Single => Box::new(Single),
        Policy::RoundRobin => Box::new(RoundRobin { layout, next: 0 }),
        Policy::Affinity => Box::new(Affinity { layout, share }),
    }
}

struct Single;

impl Place for Single {
    fn place(&mut self, req: &Request<'_>, _: &dyn Fn(usize) -> u64) -> (usize, Placement) {
        (0, placement(PlaceReason::Single, 1, req.priority))
    }

    fn usable(&self) -> usize {
        1
    }
}

struct RoundRobin {
    layout: Layout,
    next: usize,
}

impl Place for RoundRobin {
    fn place(&mut self, req: &Request<'_>, _: &dyn Fn(usize) -> u64) -> (usize, Placement) {
        let n = self.layout.compute;
        if let Some(s) = self.layout.comm_stream(req) {
            return (s, placement(PlaceReason::Comm, n, req.priority));
        }
        let s = self.next % n;
        self.next = self.next.wrapping_add(1);
        (s, placement(PlaceReason::RoundRobin, n, req.priority))
    }

    fn usable(&self) -> usize {
        self.layout.compute
    }
}

struct Affinity {
    layout: Layout,
    share: Share,
}

impl Place for Affinity {
    fn place(&mut self, req: &Request<'_>, load: &dyn Fn(usize) -> u64) -> (usize, Placement) {
        let usable = self.usable();
        let measured = req.timing.filter(|t| t.dur.is_some());
        let (s, why) = if let Some(s) = self.layout.comm_stream(req) {
            (s, PlaceReason::Comm)
        } else if let Some(t) = measured {
            self.earliest_finish(req, &t, usable, load)
        } else {
            match req.latest_pred {
                // The predecessor is the tail of a usable compute stream:
                // continue the chain there, unless this is side work that
                // should leave it to the chain.
                Some((s, true)) if s < usable && req.priority != Priority::Side => {
                    (s, PlaceReason::Chain)
                }
                Some((s, _)) if req.priority == Priority::Side => (
                    self.layout.least_loaded(usable, load, Some(s)),
                    PlaceReason::Side,
                ),
                _ => (
                    self.layout.least_loaded(usable, load, None),
                    PlaceReason::LeastLoaded,
                ),
            }
        };
        (s, placement(why, usable, req.priority))
    }

    fn usable(&self) -> usize {
        self.share.get().min(self.layout.compute)
    }
}

impl Affinity {
    /// A task whose duration is estimated goes to the usable compute stream
    /// where it would finish first ([`Timing::finish_on`]), the latest
    /// predecessor's stream on ties (else the lowest index). Short tasks thus
    /// stay with their predecessors — a hand-off or a wake-up costs more than
    /// they do — and long independent ones spread out. `Side` work still
    /// avoids its predecessor's stream when another is usable.
    fn earliest_finish(
        &self,
        req: &Request<'_>,
        t: &Timing<'_>,
        usable: usize,
        load: &dyn Fn(usize) -> u64,
    ) -> (usize, PlaceReason) {
        let pred = req.latest_pred.map(|(s, _)| s);
        let side = req.priority == Priority::Side;
        // A chain keeps its stream while usable: no stream's load is read.
        if let Some(s) = pred.filter(|&s| t.chain && s < usable) {
            return (s, PlaceReason::Chain);
        }
        let avoid = pred.filter(|_| side && usable > 1);
        let mut best: Option<(usize, u64)> = None;
        for s in 0..usable.clamp(1, self.layout.compute) {
            if Some(s) == avoid {
                continue;
            }
            let f = t.finish_on(s, load(s));
            let better = match best {
                None => true,
                Some((b, bf)) => f < bf || (f == bf && Some(s) == pred && Some(b) != pred),
            };
            if better {
                best = Some((s, f));
            }
        }
        let s = best.map_or(0, |(s, _)| s);
        (
            s,
            if side {
                PlaceReason::Side
            } else {
                PlaceReason::EarliestFinish
            },
        )
    }
}

/// What a runtime asks of the core budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Claim {
    /// The budget as this runtime sees it (the process's, or its builder's).
    pub budget: usize,
    /// Compute streams it would keep busy.
    pub demand: usize,
    /// Whether its share may be smaller than its demand (`Affinity` without
    /// `oversubscribe`); otherwise it always gets its demand.
    pub flexible: bool,
    /// Whether the runtime is best-effort: its threads run at idle priority,
    /// so it divides the budget among best-effort runtimes only, and takes
    /// nothing from the others.
    pub best_effort: bool,
}

/// The shares of the core budget, one per claim, in the claims' order (the
/// order the runtimes registered in). A fixed claim gets its demand. The
/// flexible ones divide what the fixed ones leave by water-filling: smallest
/// demand first, each gets `min(demand, max(1, left / claims left))`, so a
/// runtime that needs less than an even split leaves the rest to the others,
/// no runtime gets fewer than one stream, and the shares never add up to more
/// than the budget unless that minimum forces it. With equal demands and
/// `budget = runtimes × k` every runtime gets `k` (2 ranks on 2 cores: one
/// compute stream each; 1 rank: both); a remainder goes to the latest
/// registered (4 cores, 3 ranks of 2 streams: 1, 1, 2), since a core left
/// idle helps no rank. Each claim is computed against its own `budget`.
/// Best-effort claims and the others are two separate divisions of the
/// budget: a best-effort runtime's threads run at idle priority and take only
/// the cycles the others leave, so it reduces no other share.
pub(crate) fn fair_shares(claims: &[Claim]) -> Vec<usize> {
    let share_of = |i: usize| -> usize {
        let me = claims[i];
        if !me.flexible {
            return me.demand.max(1);
        }
        let peer = |c: &Claim| c.best_effort == me.best_effort;
        let fixed: usize = claims
            .iter()
            .filter(|c| !c.flexible && peer(c))
            .map(|c| c.demand)
            .sum();
        let mut left = me.budget.saturating_sub(fixed);
        let mut order: Vec<usize> = (0..claims.len())
            .filter(|&j| claims[j].flexible && peer(&claims[j]))
            .collect();
        order.sort_by_key(|&j| (claims[j].demand, j));
        let mut n = order.len();
        for j in order {
            let give = claims[j].demand.min((left / n).max(1));
            if j == i {
                return give.max(1);
            }
            left = left.saturating_sub(give);
            n -= 1;
        }
        unreachable!("a flexible claim is in the order")
    };
    (0..claims.len()).map(share_of).collect()
}

/// The process-wide registry of live CPU runtimes and their claims on the
/// core budget. Registering or leaving recomputes every share
/// ([`fair_shares`]) and publishes it to each runtime's [`Share`]. Plain std
/// primitives: a process-wide static, part of no loom model.
#[derive(Debug, Default)]
pub(crate) struct CoreBudget {
    live: Mutex<Vec<(u64, Claim, Share)>>,
}

impl CoreBudget {
    /// The process's registry.
    pub(crate) fn global() -> &'static Arc<CoreBudget> {
        static GLOBAL: OnceLock<Arc<CoreBudget>> = OnceLock::new();
        GLOBAL.get_or_init(Arc::default)
    }

    /// Registers runtime `id` with `claim`; its share lives in the lease's
    /// [`Share`] until the lease drops.
    pub(crate) fn join(self: &Arc<Self>, id: u64, claim: Claim) -> Lease {
        let share = Share::fixed(claim.demand);
        let mut live = self.lock();
        live.push((id, claim, share.clone()));
        Self::publish(&live);
        Lease {
            budget: self.clone(),
            id,
            share,
        }
    }

    /// How many runtimes are registered.
    #[cfg(test)]
    pub(crate) fn live(&self) -> usize {
        self.lock().len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<(u64, Claim, Share)>> {
        self.live.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn publish(live: &[(u64, Claim, Share)]) {
        let claims: Vec<Claim> = live.iter().map(|(_, c, _)| *c).collect();
        for ((_, _, share), n) in live.iter().zip(fair_shares(&claims)) {
            share.0.store(n, Ordering::Relaxed);
        }
    }
}

/// A runtime's registration with the [`CoreBudget`]; leaving on drop.
#[derive(Debug)]
pub(crate) struct Lease {
    budget: Arc<CoreBudget>,
    id: u64,
    share: Share,
}

impl Lease {
    /// The share the registry keeps up to date.
    pub(crate) fn share(&self) -> Share {
        self.share.clone()
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let mut live = self.budget.lock();
        live.retain(|(id, _, _)| *id != self.id);
        CoreBudget::publish(&live);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(v: &[u64]) -> impl Fn(usize) -> u64 + '_ {
        move |s| v[s]
    }

    fn req(kind: TaskKind, latest_pred: Option<(usize, bool)>) -> Request<'static> {
        Request {
            kind,
            priority: Priority::Main,
            latest_pred,
            comm_index: 0,
            timing: None,
        }
    }

    fn all(compute: usize) -> Share {
        Share::fixed(compute)
    }

    #[test]
    fn earliest_finish_keeps_short_tasks_with_their_predecessor() {
        let l = Layout {
            compute: 2,
            comm: 0,
        };
        let mut p = make(Policy::Affinity, l, all(2));
        // A 100 ns task whose predecessor (predicted to finish at 1,000) is
        // on stream 0, which moved on (not its tail): the least-loaded rule
        // would pick idle stream 1; the hand-off and the wake-up cost more
        // than waiting for stream 0's queue (predicted free at 2,000).
        let t = Timing {
            now: 900,
            chain: false,
            dur: Some(100),
            preds: &[(0, 1_000)],
            free_at: &[2_000, 0],
        };
        let r = Request {
            timing: Some(t),
            ..req(TaskKind::Compute, Some((0, false)))
        };
        let (s, why) = p.place(&r, &at(&[2, 0]));
        assert_eq!((s, why.reason), (0, PlaceReason::EarliestFinish));
        assert_eq!(t.finish_on(0, 2), 2_100);
        // Elsewhere: after the predecessor plus a hand-off (the wake-up, from
        // 900, ends earlier).
        assert_eq!(t.finish_on(1, 0), 1_000 + HANDOFF_NS + 100);
        // Unmeasured, the same task falls back to the least-loaded rule.
        let r = Request {
            timing: Some(Timing { dur: None, ..t }),
            ..r
        };
        assert_eq!(
            p.place(&r, &at(&[2, 0])),
            (1, placement(PlaceReason::LeastLoaded, 2, Priority::Main))
        );
        // A chain continuation keeps its stream however busy the model
        // thinks it is, and reads no load (`at` would panic past stream 1).
        let chain = Request {
            timing: Some(Timing {
                chain: true,
                free_at: &[1 << 40, 0],
                ..t
            }),
            ..req(TaskKind::Compute, Some((0, true)))
        };
        assert_eq!(
            p.place(&chain, &at(&[])),
            (0, placement(PlaceReason::Chain, 2, Priority::Main))
        );
    }

    #[test]
    fn earliest_finish_spreads_long_independent_tasks() {
        let l = Layout {
            compute: 2,
            comm: 0,
        };
        let mut p = make(Policy::Affinity, l, all(2));
        // Stream 0 is busy with a 1 ms task; a 1 ms task with no unfinished
        // predecessor starts sooner on idle stream 1, wake-up included.
        let t = Timing {
            now: 0,
            chain: false,
            dur: Some(1_000_000),
            preds: &[],
            free_at: &[1_000_000, 0],
        };
        let r = Request {
            timing: Some(t),
            ..req(TaskKind::Compute, None)
        };
        assert_eq!(p.place(&r, &at(&[1, 0])).0, 1);
        // Ties go to the latest predecessor's stream.
        let t = Timing {
            now: 0,
            chain: false,
            dur: Some(10),
            preds: &[(1, 50), (0, 50)],
            free_at: &[0, 0],
        };
        let r = Request {
            timing: Some(t),
            ..req(TaskKind::Compute, Some((1, true)))
        };
        assert_eq!(p.place(&r, &at(&[1, 1])).0, 1);
        // Side work avoids its predecessor's stream even when staying is faster.
        let r = Request {
            priority: Priority::Side,
            ..r
        };
        assert_eq!(
            p.place(&r, &at(&[1, 1])),
            (0, placement(PlaceReason::Side, 2, Priority::Side))
        );
    }

    #[test]
    fn affinity_continues_chains_and_forks_to_idle_streams() {
        let l = Layout {
            compute: 3,
            comm: 1,
        };
        let mut p = make(Policy::Affinity, l, all(3));
        let (s, why) = p.place(&req(TaskKind::Compute, Some((2, true))), &at(&[0, 0, 5, 0]));
        assert_eq!((s, why.reason, why.usable), (2, PlaceReason::Chain, 3));
        // The predecessor's stream moved on: pick the least loaded.
        let (s, why) = p.place(
            &req(TaskKind::Compute, Some((2, false))),
            &at(&[3, 1, 5, 0]),
        );
        assert_eq!((s, why.reason), (1, PlaceReason::LeastLoaded));
        let (s, why) = p.place(&req(TaskKind::Comm, Some((0, true))), &at(&[0, 0, 0, 9]));
        assert_eq!((s, why.reason), (3, PlaceReason::Comm));
        let side = Request {
            priority: Priority::Side,
            ..req(TaskKind::Compute, Some((0, true)))
        };
        let (s, why) = p.place(&side, &at(&[0, 2, 1, 0]));
        assert_eq!(
            (s, why.reason, why.priority),
            (2, PlaceReason::Side, Priority::Side)
        );
        assert_eq!(
            p.decided(PlaceReason::Pinned, Priority::Main).reason,
            PlaceReason::Pinned
        );
    }

    #[test]
    fn single_and_round_robin() {
        let l = Layout {
            compute: 2,
            comm: 1,
        };
        let mut s = make(Policy::Single, l, all(2));
        let (st, why) = s.place(&req(TaskKind::Comm, None), &at(&[0, 0, 0]));
        assert_eq!((st, why.reason, why.usable), (0, PlaceReason::Single, 1));
        let mut rr = make(Policy::RoundRobin, l, all(2));
        let got: Vec<usize> = (0..4)
            .map(|_| rr.place(&req(TaskKind::Compute, None), &at(&[0, 0, 0])).0)
            .collect();
        assert_eq!(got, vec![0, 1, 0, 1]);
        assert_eq!(rr.place(&req(TaskKind::Comm, None), &at(&[0, 0, 0])).0, 2);
    }

    /// With no communication stream, every collective goes to compute
    /// stream 0 under every policy, however loaded it is.
    #[test]
    fn without_a_comm_stream_collectives_stay_on_stream_0() {
        let l = Layout {
            compute: 3,
            comm: 0,
        };
        for policy in Policy::ALL {
            let mut p = make(policy, l, all(3));
            for i in 0..4 {
                let r = Request {
                    comm_index: i,
                    ..req(TaskKind::Comm, Some((2, true)))
                };
                let (s, _) = p.place(&r, &at(&[9, 0, 0]));
                assert_eq!(s, 0, "{policy:?}, collective {i}");
            }
        }
    }

    fn flex(budget: usize, demand: usize) -> Claim {
        Claim {
            budget,
            demand,
            flexible: true,
            best_effort: false,
        }
    }

    #[test]
    fn fair_shares_split_the_budget() {
        // The machine: two cores.
        assert_eq!(fair_shares(&[flex(2, 2)]), vec![2]);
        assert_eq!(fair_shares(&[flex(2, 2), flex(2, 2)]), vec![1, 1]);
        // Never below one stream, even past the budget.
        assert_eq!(fair_shares(&[flex(2, 2); 3]), vec![1, 1, 1]);
        // Never above the demand; what one leaves goes to the others.
        assert_eq!(fair_shares(&[flex(8, 1), flex(8, 8)]), vec![1, 7]);
        // A remainder goes to the latest registered.
        assert_eq!(fair_shares(&[flex(4, 2); 3]), vec![1, 1, 2]);
        // Fixed claims (oversubscribe, Single, RoundRobin) keep their demand
        // and the flexible ones leave it to them.
        let fixed = Claim {
            flexible: false,
            ..flex(4, 3)
        };
        assert_eq!(fair_shares(&[fixed, flex(4, 4)]), vec![3, 1]);
        assert_eq!(fair_shares(&[fixed, flex(2, 4)]), vec![3, 1]);
        // Best-effort runtimes divide the budget among themselves and take
        // nothing from the others.
        let be = Claim {
            best_effort: true,
            ..flex(2, 2)
        };
        assert_eq!(fair_shares(&[flex(2, 2), be]), vec![2, 2]);
        assert_eq!(fair_shares(&[be, flex(2, 2), be]), vec![1, 2, 1]);
    }

    /// Independent tasks (no predecessor) over `n` placements: the streams used.
    fn streams_used(p: &mut dyn Place, n: usize) -> Vec<usize> {
        let mut load = [0u64; 4];
        let mut used = Vec::new();
        for _ in 0..n {
            let (s, why) = p.place(&req(TaskKind::Compute, None), &|i| load[i]);
            assert_eq!(why.reason, PlaceReason::LeastLoaded);
            load[s] += 1;
            if !used.contains(&s) {
                used.push(s);
            }
        }
        used.sort_unstable();
        used
    }

    #[test]
    fn two_runtimes_on_two_cores_use_one_compute_stream_each() {
        let budget = Arc::new(CoreBudget::default());
        let l = Layout {
            compute: 2,
            comm: 1,
        };
        let claim = flex(2, 2);
        let a = budget.join(1, claim);
        let mut pa = make(Policy::Affinity, l, a.share());
        // Alone: both compute streams.
        assert_eq!(pa.usable(), 2);
        assert_eq!(streams_used(&mut *pa, 4), vec![0, 1]);
        // A second rank joins: one each, and the first sees it at once.
        let b = budget.join(2, claim);
        let mut pb = make(Policy::Affinity, l, b.share());
        assert_eq!((pa.usable(), pb.usable()), (1, 1));
        assert_eq!(streams_used(&mut *pa, 4), vec![0]);
        assert_eq!(streams_used(&mut *pb, 4), vec![0]);
        // A chain on a stream no longer usable moves to a usable one.
        let (s, why) = pa.place(&req(TaskKind::Compute, Some((1, true))), &at(&[0, 0, 0]));
        assert_eq!(
            (s, why.reason, why.usable),
            (0, PlaceReason::LeastLoaded, 1)
        );
        // Side work shares the one usable stream.
        let side = Request {
            priority: Priority::Side,
            ..req(TaskKind::Compute, Some((0, true)))
        };
        assert_eq!(pa.place(&side, &at(&[0, 0, 0])).0, 0);
        // Communication keeps its own stream.
        assert_eq!(pb.place(&req(TaskKind::Comm, None), &at(&[0, 0, 0])).0, 2);
        // The second leaves: the first gets both back.
        drop(b);
        assert_eq!(budget.live(), 1);
        assert_eq!(pa.usable(), 2);
        drop(a);
        assert_eq!(budget.live(), 0);
    }

    #[test]
    fn oversubscribe_keeps_every_stream() {
        let budget = Arc::new(CoreBudget::default());
        let l = Layout {
            compute: 2,
            comm: 1,
        };
        let fixed = Claim {
            flexible: false,
            ..flex(2, 2)
        };
        let a = budget.join(1, fixed);
        let b = budget.join(2, fixed);
        let mut pa = make(Policy::Affinity, l, a.share());
        let mut pb = make(Policy::Affinity, l, b.share());
        assert_eq!(streams_used(&mut *pa, 4), vec![0, 1]);
        assert_eq!(streams_used(&mut *pb, 4), vec![0, 1]);
        // A budgeted runtime beside them gets the minimum.
        let c = budget.join(3, flex(2, 2));
        assert_eq!(make(Policy::Affinity, l, c.share()).usable(), 1);
        assert_eq!(pa.usable(), 2);
    }
}

//! The step simulator (`cargo run --release -p braid-benches --bin simulate`):
//! from a Chrome trace Braid wrote, predict the step on another machine,
//! rank count, stream count or placement policy.
//!
//! * [`trace`] reads the trace and cuts a step out of it;
//! * [`graph`] turns one rank's step into a task graph ([`StepGraph`]);
//! * [`machine`] describes machines (built-in or a JSON file);
//! * [`cost`] prices collectives (NCCL ring and tree, α–β);
//! * [`sched`] places and runs the graph ([`simulate`]; with rank skew
//!   several ranks side by side, [`sched::simulate_ranks`]);
//! * [`skew`] reads rank skew out of a trace with several ranks;
//! * this module turns a simulated run into figures computed the way
//!   `braid::trace::Summary` computes them (a [`braid::trace::Profile`] is
//!   built and summarised) and into a Chrome trace.
//!
//! `docs/simulator.md` says what it models and how well it predicted the
//! runs it was checked against.

pub mod cost;
pub mod graph;
pub mod machine;
pub mod sched;
pub mod skew;
pub mod trace;

pub use graph::{StepChoice, StepGraph};
pub use machine::Machine;
pub use sched::{simulate, SimConfig, SimPolicy, SimRun};

use braid::trace::{Profile, Span, StreamInfo, Summary};
use braid::{Placement, Priority};

/// The figures of one simulated step.
#[derive(Debug, Clone)]
pub struct Prediction {
    /// Ranks simulated.
    pub ranks: usize,
    /// The step's tasks from first start to last end, ns.
    pub makespan_ns: u64,
    /// The step time: makespan plus the traced host time between steps, ns.
    pub step_ns: u64,
    /// The summary of the simulated step (comm time, hidden share, critical
    /// path), as `braid::trace::Summary` computes it: the slowest rank's
    /// when ranks are skewed (see `rank_summaries`, and
    /// [`Prediction::hidden_share`] for the figure to report).
    pub summary: Summary,
    /// Names of the tasks along the critical path (dependency edges,
    /// simulated durations), first to last.
    pub critical_path: Vec<String>,
    /// Usable compute streams.
    pub usable: usize,
    /// Each simulated rank's summary, the slowest (the one `summary` is)
    /// first; one when the ranks run in lock step (no rank skew).
    pub rank_summaries: Vec<Summary>,
    /// Each simulated rank's compute time factor (`sched::skew_factors`
    /// of the spread that gives the machine's rank skew,
    /// `skew::solve_factor_spread`).
    pub factors: Vec<f64>,
    /// When the machine's rank skew is more than the simulated ranks can
    /// show (`skew::solve_factor_spread`'s `Err`): the most they show, at
    /// the widest spread. The step is then simulated in lock step.
    pub unreachable_skew: Option<f64>,
}

impl Prediction {
    /// Share of communication time hidden under compute over the simulated
    /// ranks together (hidden time summed over them over communication time
    /// summed over them). Which rank is the slow one changes from step to
    /// step in measured runs, so over a run each rank takes every simulated
    /// rank's part, and its hidden share (the trainer's figure: hidden over
    /// communication time of all its steps) is this pooled share. Without
    /// skew it is the one rank's.
    pub fn hidden_share(&self) -> f64 {
        skew::pooled_hidden(&self.rank_summaries)
    }

    /// Communication time per rank, averaged over the simulated ranks, ns.
    pub fn comm_ns(&self) -> u64 {
        let n = self.rank_summaries.len().max(1) as u64;
        self.rank_summaries.iter().map(|s| s.comm_ns).sum::<u64>() / n
    }
}

/// The longest time the simulator represents, ns (2^53 ns, about 104
/// days): beyond it the event loop's `f64` times lose whole nanoseconds and
/// a step's figures no longer add up. Longer steps (a compute scale of
/// 10^300, 10^8 CPU ranks sharing two cores) are refused.
pub const MAX_TIME_NS: u64 = 1 << 53;

/// At most this many ranks are simulated (2^20): far beyond any data-parallel
/// run, and a bound on the ranks' product with the other figures.
pub const MAX_RANKS: usize = 1 << 20;

/// At most this many ranks are simulated side by side for rank skew; they
/// stand for all the ranks (evenly spread speeds).
pub const MAX_SKEW_RANKS: usize = 8;

/// The simulated step as a Braid profile (rank 0; ids are positions in the
/// step).
pub fn profile(g: &StepGraph, run: &SimRun) -> Profile {
    profile_of_rank(g, run, 0)
}

/// The simulated step of rank `rank` as a Braid profile.
pub fn profile_of_rank(g: &StepGraph, run: &SimRun, rank: usize) -> Profile {
    let mut streams: Vec<StreamInfo> = (0..run.streams)
        .map(|s| StreamInfo {
            name: format!("compute {s}"),
            is_comm: false,
        })
        .collect();
    streams.push(StreamInfo {
        name: "comm 0".into(),
        is_comm: true,
    });
    let mut spans: Vec<Span> = g
        .nodes
        .iter()
        .zip(&run.tasks)
        .enumerate()
        .map(|(i, (n, p))| Span {
            id: i as u64,
            name: n.name.clone().into(),
            scope: None,
            kind: n.kind,
            stream: p.stream,
            placement: Placement {
                reason: p.reason,
                usable: run.usable as u16,
                priority: if n.is_comm() {
                    Priority::Comm
                } else if n.side {
                    Priority::Side
                } else {
                    Priority::Main
                },
            },
            start_ns: p.start_ns,
            end_ns: p.end_ns,
            preds: n.preds.iter().map(|&p| p as u64).collect(),
            ok: true,
            bytes: n.bytes.unwrap_or(0),
            // The model's collectives start when every rank is there.
            wait_ns: 0,
        })
        .collect();
    spans.sort_by_key(|s| s.start_ns);
    Profile {
        rank,
        streams,
        spans,
        ..Profile::default()
    }
}

/// The critical path over the dependency edges, with the simulated
/// durations: its length (ns) and the nodes along it, first to last.
pub fn critical_path(g: &StepGraph, run: &SimRun) -> (u64, Vec<usize>) {
    let n = g.nodes.len();
    let mut longest = vec![0u64; n];
    let mut via: Vec<Option<usize>> = vec![None; n];
    for i in 0..n {
        let d = run.tasks[i].end_ns - run.tasks[i].start_ns;
        let best = g.nodes[i].preds.iter().map(|&p| (longest[p], p)).max();
        longest[i] = d + best.map_or(0, |b| b.0);
        via[i] = best.map(|b| b.1);
    }
    let Some((len, last)) = (0..n).map(|i| (longest[i], i)).max() else {
        return (0, Vec::new());
    };
    let mut path = vec![last];
    while let Some(p) = via[*path.last().unwrap_or(&last)] {
        path.push(p);
    }
    path.reverse();
    (len, path)
}

/// Simulates `g` on `m` under `cfg` and summarises it; the run is the
/// slowest rank's (see [`predict_ranks`]).
pub fn predict(g: &StepGraph, m: &Machine, cfg: &SimConfig) -> (Prediction, SimRun) {
    let (p, mut runs) = predict_ranks(g, m, cfg);
    (p, runs.swap_remove(0))
}

/// Simulates `g` on `m` under `cfg` with the machine's rank skew
/// (`m.rank_skew`: ranks simulated side by side, their compute factors
/// spread so that they end the backward that far apart,
/// `skew::solve_factor_spread`) and
/// summarises it: the step ends with the last rank's last task, the
/// critical path is the slowest rank's, the hidden share is pooled over the
/// ranks ([`Prediction::hidden_share`]). Returns every simulated rank's run,
/// the slowest first. A skew the simulated ranks cannot show is simulated
/// in lock step, [`Prediction::unreachable_skew`] saying so (the program
/// refuses it when `--skew` asked for it, and notes it for a machine's
/// default).
pub fn predict_ranks(g: &StepGraph, m: &Machine, cfg: &SimConfig) -> (Prediction, Vec<SimRun>) {
    let (spread, unreachable_skew) = match skew::solve_factor_spread(g, m, cfg, m.rank_skew) {
        Ok(s) => (s, None),
        Err(max) => (0.0, Some(max)),
    };
    let factors = sched::skew_factors(cfg.ranks, spread, MAX_SKEW_RANKS);
    let runs = sched::simulate_ranks(g, m, cfg, &factors);
    let rank_summaries: Vec<Summary> = runs
        .iter()
        .enumerate()
        .map(|(j, r)| profile_of_rank(g, r, j).summary())
        .collect();
    let run = &runs[0];
    let (_, path) = critical_path(g, run);
    let makespan_ns = runs.iter().map(|r| r.makespan_ns).max().unwrap_or(0);
    (
        Prediction {
            ranks: cfg.ranks,
            makespan_ns,
            step_ns: makespan_ns.saturating_add(g.host_gap_ns),
            summary: rank_summaries[0].clone(),
            critical_path: path.iter().map(|&i| g.nodes[i].name.clone()).collect(),
            usable: run.usable,
            rank_summaries,
            factors,
            unreachable_skew,
        },
        runs,
    )
}

/// The summary of a rank's traced step (the same figures as a
/// prediction's, from the trace's own spans).
pub fn traced_summary(r: &trace::RankTrace, s: &trace::StepSlice) -> Summary {
    let streams = r
        .streams
        .iter()
        .enumerate()
        .map(|(i, n)| StreamInfo {
            name: n.clone(),
            is_comm: r.is_comm_stream(i),
        })
        .collect();
    let spans = r.tasks[s.first..s.end]
        .iter()
        .map(|t| Span {
            id: t.id,
            name: t.name.clone().into(),
            scope: None,
            kind: t.kind,
            stream: t.stream,
            placement: Placement {
                reason: braid::PlaceReason::Replayed,
                usable: 0,
                priority: Priority::Main,
            },
            start_ns: t.start_ns,
            end_ns: t.start_ns + t.dur_ns,
            preds: t.preds.iter().copied().collect(),
            ok: true,
            bytes: t.bytes.unwrap_or(0),
            wait_ns: 0,
        })
        .collect();
    Profile {
        rank: r.rank,
        streams,
        spans,
        ..Profile::default()
    }
    .summary()
}

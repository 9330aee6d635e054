//! Record once, replay: a recorded schedule is the tasks of one program
//! step with their streams and the minimal cross-stream waits between them,
//! resolved once; a replay runs it again with no dependency inference and no
//! placement. The protocol is in README.md beside this file ("Replay").
//!
//! * Recording happens under the runtime's lock, beside ordinary submission:
//!   every task submitted while the recorder is set runs as usual (the
//!   recording run is the schedule's first run) and is also kept — its name,
//!   stream, accesses and body (shared, so it can run again). Its predecessors
//!   *within the schedule* come from the recorder's own tracker, which never
//!   retires a task: a predecessor that had already finished when the
//!   recording submitted its dependent is still an edge of the schedule.
//! * [`Plan::new`] turns the kept tasks into one program per stream: each
//!   step lists the waits it needs, as `(stream, position)` pairs local to the
//!   schedule, elided with vector clocks exactly as eager submission does;
//!   the stream of the last task ends with a *join* that waits for every
//!   other stream's last step. The join is the replay's one task record.
//! * To the tracker a replay is one unit before it and one unit per stream
//!   after it: [`submit`] asks for the unfinished tasks the union of the
//!   schedule's accesses conflicts with (the external predecessors), makes
//!   every used stream wait for them before its first step, records each
//!   used stream's part (`Plan::parts`: the union of its tasks' accesses,
//!   ended by its last task; on one stream, or materialised, the whole
//!   union with the join), and shifts the local positions by each stream's
//!   current sequence number.
//! * On the CPU a stream's share of a replay is one queue item: the stream
//!   thread runs its program in a loop (`worker::run_program`). On CUDA (and
//!   when asked, for tests) the replay is *materialised*: one task record per
//!   step, with the precomputed waits and predecessors, through the ordinary
//!   launch path.

use super::{
    cross_waits, Clock, Item, Launch, Record, Shared, SubmitState, TaskBody, TaskShared, FAILED,
    PENDING,
};
use crate::ctx::{Access, Body, CommHook, SharedBody};
use crate::error::Error;
use crate::graph::{Region, TaskRef, Tracker, Union};
use crate::kind::TaskKind;
use crate::sync::{Arc, AtomicU8, Ordering};
use smallvec::SmallVec;
use std::borrow::Cow;

/// The step index of a stream's join (no task).
pub(crate) const JOIN: u32 = u32::MAX;

/// One task as recorded.
#[derive(Clone)]
pub(crate) struct RecTask {
    pub(crate) name: Cow<'static, str>,
    /// The scope it was recorded in (its replays' spans show it).
    pub(crate) scope: Option<std::sync::Arc<str>>,
    pub(crate) kind: TaskKind,
    pub(crate) stream: u16,
    pub(crate) accesses: SmallVec<[Access; 4]>,
    pub(crate) body: SharedBody,
    pub(crate) comm_hook: Option<CommHook>,
    /// Predecessors within the schedule, by index.
    pub(crate) preds: SmallVec<[u32; 4]>,
    /// Placed by the policy on a compute stream (not pinned, not a
    /// collective): a re-placement may move it to another compute stream.
    pub(crate) movable: bool,
}

/// A recorded task as the recorder's tracker sees it: never retired.
#[derive(Clone, Copy)]
struct Local(u32);

impl TaskRef for Local {
    fn id(&self) -> u64 {
        self.0 as u64
    }
    fn retired(&self) -> bool {
        false
    }
}

/// What is kept while a schedule is recorded.
pub(crate) struct Recorder {
    /// Keep the bodies (an explicit recording, replayed with them), or only
    /// the analysis (automatic replay: each step brings new bodies).
    keep_bodies: bool,
    first_id: u64,
    tracker: Tracker<Local>,
    tasks: Vec<RecTask>,
    /// The recorded tasks' ids, increasing (other work — a replay during an
    /// automatic recording — may take ids in between).
    ids: Vec<u64>,
    /// The last recorded task of each stream.
    tails: Vec<Option<u32>>,
    local: Vec<Local>,
}

impl Recorder {
    /// Starts a recording whose first task will get id `first_id`.
    pub(crate) fn new(first_id: u64) -> Self {
        Self::with_bodies(first_id, true)
    }

    /// A recording that keeps the bodies or not.
    pub(crate) fn with_bodies(first_id: u64, keep_bodies: bool) -> Self {
        Recorder {
            keep_bodies,
            first_id,
            tracker: Tracker::default(),
            tasks: Vec::new(),
            ids: Vec::new(),
            tails: Vec::new(),
            local: Vec::new(),
        }
    }

    /// Keeps the task being submitted (id `id`, on stream `s`) and returns
    /// its body: shared between this run and the replays when the recorder
    /// keeps bodies, else as it came (it runs once). `after` are its
    /// explicit edges (`TaskBuilder::after`); the schedule's data edges come
    /// from the recorder's own tracker.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn keep(
        &mut self,
        id: u64,
        s: usize,
        (name, kind, movable, side): (&Cow<'static, str>, TaskKind, bool, bool),
        scope: Option<std::sync::Arc<str>>,
        accesses: &SmallVec<[Access; 4]>,
        comm_hook: &Option<CommHook>,
        body: Body,
        after: &[Arc<TaskShared>],
    ) -> TaskBody {
        let index = self.tasks.len() as u32;
        debug_assert!(id >= self.first_id && self.ids.last().is_none_or(|&l| l < id));
        self.local.clear();
        for a in accesses {
            let (buf, range) = (a.view.buf.id(), a.view.range());
            self.tracker.preds(buf, range, a.mode, &mut self.local);
        }
        let mut preds: SmallVec<[u32; 4]> = self.local.iter().map(|l| l.0).collect();
        // Explicit edges (`TaskBuilder::after`) to recorded tasks.
        for p in after {
            if let Ok(l) = self.ids.binary_search(&p.id) {
                let l = l as u32;
                if !preds.contains(&l) {
                    preds.push(l);
                }
            }
        }
        self.ids.push(id);
        for a in accesses {
            let (buf, range) = (a.view.buf.id(), a.view.range());
            self.tracker.record(buf, range, a.mode, &Local(index));
        }
        let (kept, body) = if self.keep_bodies {
            let b = std::sync::Arc::new(crate::ctx::BodyCell::new(body));
            (b.clone(), TaskBody::Shared(b))
        } else {
            let none: Body = crate::ctx::body(|_| Ok(()));
            (
                std::sync::Arc::new(crate::ctx::BodyCell::new(none)),
                TaskBody::Once(body),
            )
        };
        // Eager placement saw only unfinished predecessors: a task whose
        // predecessor had already finished was placed as if it had none, which
        // a plan (whose edges are all there) would pay for in cross-stream
        // waits. An analysis-only plan places it as `Affinity` would have with
        // the predecessor unfinished: on its stream when it is still that
        // stream's last recorded task. (Not for kept bodies: a recorded body
        // runs on the stream it was recorded on.)
        let mut s = s as u16;
        if !self.keep_bodies && movable && !side {
            if let Some(&p) = preds.iter().max() {
                let ps = self.tasks[p as usize].stream;
                if self.tails.get(ps as usize) == Some(&Some(p)) {
                    s = ps;
                }
            }
        }
        if self.tails.len() <= s as usize {
            self.tails.resize(s as usize + 1, None);
        }
        self.tails[s as usize] = Some(index);
        self.tasks.push(RecTask {
            name: name.clone(),
            scope,
            kind,
            stream: s,
            accesses: if self.keep_bodies {
                accesses.clone()
            } else {
                SmallVec::new()
            },
            body: kept,
            comm_hook: comm_hook.clone(),
            preds,
            movable,
        });
        body
    }

    /// Whether this is an automatic (analysis-only) recording.
    pub(crate) fn is_auto(&self) -> bool {
        !self.keep_bodies
    }

    /// The kept tasks, in submission order.
    pub(crate) fn into_tasks(self) -> Vec<RecTask> {
        self.tasks
    }
}

/// One step of a stream's program.
pub(crate) struct Step {
    /// The task's index in the schedule, or [`JOIN`].
    pub(crate) task: u32,
    /// Waits `(stream, position)`, positions local to the schedule (from 1).
    pub(crate) waits: SmallVec<[(u16, u32); 2]>,
    /// Another stream's step waits for this one: its completion must be
    /// published at once (others are published in batches).
    pub(crate) signal: bool,
    /// The task's body and predecessors, copied here so a stream thread's
    /// loop reads its program sequentially (the task records are cold).
    pub(crate) body: Option<SharedBody>,
    pub(crate) preds: SmallVec<[u32; 4]>,
}

/// A recorded schedule, resolved: what a replay runs.
pub(crate) struct Plan {
    pub(crate) name: Cow<'static, str>,
    pub(crate) tasks: Vec<RecTask>,
    /// Each stream's program (empty for a stream the schedule does not use).
    pub(crate) programs: Vec<Vec<Step>>,
    /// The stream whose program ends with the join.
    pub(crate) join_stream: usize,
    /// Each stream's vector clock after its program, local positions.
    finals: Vec<SmallVec<[u32; 8]>>,
    /// For each task: its stream's program and its position there (from 1).
    pub(crate) position: Vec<u32>,
    /// For each task: its stream's vector clock right after it, local
    /// positions (what its completion implies).
    pub(crate) clocks: Vec<SmallVec<[u32; 8]>>,
    /// The union of the tasks' accesses: what the replay is to the tracker
    /// (materialised, as a graph, or on one stream).
    pub(crate) union: std::sync::Arc<Union>,
    /// Its finer units, when it uses more than one stream (else empty):
    /// for each stream, the index of its last task and the union of its
    /// tasks' accesses. A CPU replay is one unit per stream to the tracker,
    /// so a later task that touches only what one stream's part touched
    /// waits for that part, not for the whole replay.
    pub(crate) parts: Vec<Option<(u32, std::sync::Arc<Union>)>>,
    /// Streams with work.
    pub(crate) used: u16,
    /// Compute streams the placement could use when the plan was made (the
    /// trace's `usable`): set by whoever knows it, else the streams used.
    pub(crate) usable: u16,
}

impl Plan {
    /// Resolves recorded tasks into per-stream programs for `streams` streams,
    /// joined on the last task's stream.
    pub(crate) fn new(name: Cow<'static, str>, tasks: Vec<RecTask>, streams: usize) -> Plan {
        let f = tasks.last().map_or(0, |t| t.stream as usize);
        Plan::joined_on(name, tasks, streams, f)
    }

    /// [`Plan::new`], joined on stream `f`: the stream a graph of the plan
    /// is launched on (`sched::split` joins a graph with collectives on
    /// their communication stream).
    pub(crate) fn joined_on(
        name: Cow<'static, str>,
        tasks: Vec<RecTask>,
        streams: usize,
        f: usize,
    ) -> Plan {
        let zero: SmallVec<[u32; 8]> = SmallVec::from_elem(0, streams);
        let mut clocks = vec![zero.clone(); streams];
        let mut task_clock: Vec<SmallVec<[u32; 8]>> = Vec::with_capacity(tasks.len());
        let mut position = Vec::with_capacity(tasks.len());
        let mut programs: Vec<Vec<Step>> = (0..streams).map(|_| Vec::new()).collect();
        for (i, t) in tasks.iter().enumerate() {
            let s = t.stream as usize;
            // The latest predecessor on each other stream.
            let mut latest: SmallVec<[(u16, u32, usize); 4]> = SmallVec::new();
            for &p in &t.preds {
                let (ps, pos) = (tasks[p as usize].stream, position[p as usize]);
                if ps as usize == s {
                    continue;
                }
                match latest.iter_mut().find(|l| l.0 == ps) {
                    Some(l) if l.1 < pos => *l = (ps, pos, p as usize),
                    Some(_) => {}
                    None => latest.push((ps, pos, p as usize)),
                }
            }
            latest.sort_unstable();
            let mut waits = SmallVec::new();
            for (j, pos, p) in latest {
                if clocks[s][j as usize] >= pos {
                    continue;
                }
                waits.push((j, pos));
                let pc = task_clock[p].clone();
                merge(&mut clocks[s], &pc);
            }
            let pos = programs[s].len() as u32 + 1;
            clocks[s][s] = pos;
            position.push(pos);
            task_clock.push(clocks[s].clone());
            programs[s].push(Step {
                task: i as u32,
                waits,
                signal: false,
                body: Some(t.body.clone()),
                preds: t.preds.clone(),
            });
        }
        // The join: on stream `f`, after every other stream's end.
        let mut waits = SmallVec::new();
        for j in 0..streams {
            let len = programs[j].len() as u32;
            if j != f && len > 0 && clocks[f][j] < len {
                waits.push((j as u16, len));
                let cj = clocks[j].clone();
                merge(&mut clocks[f], &cj);
            }
        }
        clocks[f][f] = programs[f].len() as u32 + 1;
        programs[f].push(Step {
            task: JOIN,
            waits,
            signal: false,
            body: None,
            preds: SmallVec::new(),
        });
        let waited: Vec<(u16, u32)> = programs
            .iter()
            .flat_map(|p| p.iter().flat_map(|st| st.waits.iter().copied()))
            .collect();
        for (j, pos) in waited {
            programs[j as usize][pos as usize - 1].signal = true;
        }
        let used = programs.iter().filter(|p| !p.is_empty()).count() as u16;
        let (union, parts) = unions(&tasks, &programs, used > 1);
        Plan {
            used,
            parts,
            usable: used,
            name,
            tasks,
            programs,
            join_stream: f,
            finals: clocks,
            position,
            clocks: task_clock,
            union,
        }
    }

    /// Streams with work and cross-stream waits, the joins included.
    pub(crate) fn shape(&self) -> (usize, usize) {
        let streams = self.used as usize;
        let waits = self
            .programs
            .iter()
            .flat_map(|p| p.iter().map(|s| s.waits.len()))
            .sum();
        (streams, waits)
    }

    /// Whether any recorded task is a collective.
    pub(crate) fn has_collectives(&self) -> bool {
        self.tasks.iter().any(|t| t.kind == TaskKind::Comm)
    }

    /// Number of recorded tasks.
    pub(crate) fn len(&self) -> usize {
        self.tasks.len()
    }

    /// Steps on every stream, the join included.
    pub(crate) fn steps(&self) -> u64 {
        self.tasks.len() as u64 + 1
    }

    /// Each task's last measured duration, by task index; `None` until
    /// every task has been measured.
    pub(crate) fn measured(&self) -> Option<Vec<u64>> {
        self.tasks.iter().map(|t| t.body.nanos()).collect()
    }

    /// Whether some movable task is on another stream than the first
    /// compute stream (what [`movable_on_first_stream`] would change).
    ///
    /// [`movable_on_first_stream`]: Self::movable_on_first_stream
    pub(crate) fn spread(&self) -> bool {
        self.tasks.iter().any(|t| t.movable && t.stream != 0)
    }

    /// The same schedule with every movable task on compute stream 0, as if
    /// recorded there: [`Plan::replaced`] keeps a task's recorded stream on
    /// a tie, so ranks whose recordings placed tasks differently re-place
    /// them alike from this (the ranks' agreed re-placement). Also the
    /// placement trial's one-stream placement (`sched::trial`).
    pub(crate) fn movable_on_first_stream(&self) -> Plan {
        let mut tasks = self.tasks.clone();
        for t in tasks.iter_mut().filter(|t| t.movable) {
            t.stream = 0;
        }
        let mut p = Plan::new(self.name.clone(), tasks, self.programs.len());
        p.usable = self.usable;
        p
    }

    /// The same schedule placed by earliest finish time (HEFT's rule) from
    /// each task's duration `dur` (by task index; [`Plan::measured`], or
    /// what the ranks of a group agreed on): taking the tasks in an order, a
    /// movable task goes to the compute stream among the first `compute`
    /// where it would finish first, counting `sync_ns` for each predecessor
    /// on another stream and once for each extra stream the plan starts
    /// using (its thread must be woken); ties keep the recorded stream.
    /// `None` until every task has been measured.
    ///
    /// Two orders are tried, and the one with the shorter predicted makespan
    /// kept (program order on a tie): program order, and HEFT's priority
    /// order, by decreasing upward rank (a task's duration plus the longest
    /// path after it, `sync_ns` per edge), so a task on a long path runs
    /// before independent work that could wait. Both are topological. Tasks
    /// that are not movable (pinned, bundled, collectives) keep their program
    /// order on their stream: collectives stay in the same order on every
    /// rank, whatever each rank measured.
    ///
    /// Short tasks thus gather on one stream (a cross-stream hand-off costs
    /// more than it saves) and long independent ones spread out. If the
    /// predicted makespan is no better than running every movable task on
    /// one stream, they all go to the compute stream most of them were on,
    /// in program order.
    pub(crate) fn replaced(&self, dur: &[u64], compute: usize, sync_ns: u64) -> Plan {
        debug_assert_eq!(dur.len(), self.tasks.len());
        let program: Vec<usize> = (0..self.tasks.len()).collect();
        let ranked = self.by_upward_rank(dur, sync_ns);
        let (a, span_a) = self.place_in(&program, dur, compute, sync_ns);
        let (b, span_b) = self.place_in(&ranked, dur, compute, sync_ns);
        let (order, streams, makespan) = if span_b < span_a {
            (ranked, b, span_b)
        } else {
            (program, a, span_a)
        };
        // Greedy placement can spread a graph of short tasks whose hand-offs
        // then dominate: keep it only if it beats one stream (the predicted
        // makespan against the sum of the durations), so the cost model never
        // predicts worse than the `single` baseline.
        let serial: u64 = dur.iter().sum();
        let mut tasks = self.tasks.clone();
        if serial <= makespan {
            let home = (0..compute.max(1))
                .max_by_key(|&s| {
                    let n = tasks.iter().filter(|t| t.stream as usize == s).count();
                    (n, std::cmp::Reverse(s))
                })
                .unwrap_or(0) as u16;
            for t in tasks.iter_mut().filter(|t| t.movable) {
                t.stream = home;
            }
        } else {
            for (t, s) in tasks.iter_mut().zip(streams) {
                t.stream = s;
            }
            tasks = permuted(tasks, &order);
        }
        let mut p = Plan::new(self.name.clone(), tasks, self.programs.len());
        p.usable = compute as u16;
        p
    }

    /// The task indices by decreasing upward rank, ties in program order
    /// (see [`replaced`](Self::replaced) and
    /// [`upward_rank_order`](crate::graph::upward_rank_order)), with a
    /// virtual edge between consecutive fixed tasks of a stream.
    fn by_upward_rank(&self, dur: &[u64], sync_ns: u64) -> Vec<usize> {
        let mut succs: Vec<Vec<usize>> = vec![Vec::new(); self.tasks.len()];
        let mut last_fixed: Vec<Option<usize>> = vec![None; self.programs.len()];
        for (i, t) in self.tasks.iter().enumerate() {
            for &p in &t.preds {
                succs[p as usize].push(i);
            }
            if !t.movable {
                // Program order among the stream's fixed tasks: a virtual edge.
                let s = t.stream as usize;
                if let Some(p) = last_fixed[s] {
                    succs[p].push(i);
                }
                last_fixed[s] = Some(i);
            }
        }
        crate::graph::upward_rank_order(dur, &succs, sync_ns)
    }

    /// Places the tasks taken in `order` (topological) by earliest finish
    /// time; returns each task's stream (by task index) and the predicted
    /// makespan.
    fn place_in(
        &self,
        order: &[usize],
        dur: &[u64],
        compute: usize,
        sync_ns: u64,
    ) -> (Vec<u16>, u64) {
        let mut stream: Vec<u16> = self.tasks.iter().map(|t| t.stream).collect();
        let mut avail = vec![0u64; self.programs.len()];
        let mut used = vec![false; self.programs.len()];
        let mut finish = vec![0u64; self.tasks.len()];
        for (k, &i) in order.iter().enumerate() {
            let t = &self.tasks[i];
            let recorded = t.stream as usize;
            let eft = |s: usize| {
                let ready = t
                    .preds
                    .iter()
                    .map(|&p| {
                        let p = p as usize;
                        let hop = if stream[p] as usize == s { 0 } else { sync_ns };
                        finish[p] + hop
                    })
                    .max()
                    .unwrap_or(0);
                // An extra stream costs a wake-up; the first one is free.
                let start = if used[s] || k == 0 { avail[s] } else { sync_ns };
                ready.max(start) + dur[i]
            };
            let mut best = (recorded, eft(recorded));
            if t.movable {
                for s in (0..compute.max(1)).filter(|&s| s != recorded) {
                    let e = eft(s);
                    if e < best.1 {
                        best = (s, e);
                    }
                }
            }
            stream[i] = best.0 as u16;
            finish[i] = best.1;
            avail[best.0] = best.1;
            used[best.0] = true;
        }
        (stream, finish.iter().copied().max().unwrap_or(0))
    }
}

/// `tasks` in `order` (a topological order of their indices), each task's
/// predecessors renumbered to match.
fn permuted(tasks: Vec<RecTask>, order: &[usize]) -> Vec<RecTask> {
    let mut at = vec![0u32; tasks.len()];
    for (k, &i) in order.iter().enumerate() {
        at[i] = k as u32;
    }
    let mut slots: Vec<Option<RecTask>> = tasks.into_iter().map(Some).collect();
    order
        .iter()
        .map(|&i| {
            let mut t = slots[i].take().expect("an order names each task once");
            for p in t.preds.iter_mut() {
                *p = at[*p as usize];
            }
            t
        })
        .collect()
}

/// The union of the tasks' accesses and, if `split`, each stream's part:
/// its last task and the union of its tasks' accesses.
#[allow(clippy::type_complexity)]
fn unions(
    tasks: &[RecTask],
    programs: &[Vec<Step>],
    split: bool,
) -> (
    std::sync::Arc<Union>,
    Vec<Option<(u32, std::sync::Arc<Union>)>>,
) {
    let of = |steps: &mut dyn Iterator<Item = &RecTask>| {
        Union::new(steps.flat_map(|t| {
            t.accesses
                .iter()
                .map(|a| (a.view.buf.id(), a.view.range(), a.mode.writes()))
        }))
    };
    let whole = of(&mut tasks.iter());
    if !split {
        return (std::sync::Arc::new(whole), Vec::new());
    }
    let in_program = |p: &[Step]| {
        p.iter()
            .filter(|st| st.task != JOIN)
            .map(|st| &tasks[st.task as usize])
            .collect::<Vec<_>>()
    };
    let parts = programs.iter().map(|p| {
        let mine = in_program(p);
        (!mine.is_empty()).then(|| of(&mut mine.into_iter()))
    });
    let (whole, parts) = Union::family(whole, parts);
    let last = programs
        .iter()
        .map(|p| p.iter().rev().find(|st| st.task != JOIN));
    let parts = parts
        .into_iter()
        .zip(last)
        .map(|(u, l)| Some((l?.task, std::sync::Arc::new(u?))))
        .collect();
    (std::sync::Arc::new(whole), parts)
}

fn merge(into: &mut [u32], from: &[u32]) {
    for (c, &f) in into.iter_mut().zip(from) {
        *c = (*c).max(f);
    }
}

/// One replay in flight, as the CPU stream threads run it.
pub(crate) struct Run {
    pub(crate) plan: std::sync::Arc<Plan>,
    /// Each stream's sequence number before the replay.
    pub(crate) base: Clock,
    /// The id of the schedule's first task in this run.
    pub(crate) id_base: u64,
    /// Waits on the external predecessors, per stream, before its first step.
    pub(crate) entry: Vec<SmallVec<[(u16, u64); 4]>>,
    /// Unfinished tasks submitted before the replay that it depends on.
    pub(crate) external: SmallVec<[Arc<TaskShared>; 4]>,
    /// What of each external predecessor's accesses the schedule met, by
    /// task id: if one fails, the tasks whose accesses meet its regions are
    /// skipped, and the others run (as they would if submitted again).
    pub(crate) regions: Vec<(u64, Region)>,
    /// Each task's status in this run, written only when it is not OK (a
    /// status byte written per step would bounce cache lines between the
    /// stream threads running neighbouring tasks).
    pub(crate) status: Box<[AtomicU8]>,
    /// Some task of this run failed or was skipped (then read `status`).
    pub(crate) any_failed: crate::sync::AtomicBool,
    /// The first error a task of this run failed with (not a skip's), for
    /// the tasks skipped after it and the join to name as their root. With
    /// several independent failures in one run, they all name the first.
    pub(crate) root: std::sync::OnceLock<Box<Error>>,
    /// The join: the replay's task record (its handle; its tracker entry
    /// unless the plan has parts).
    pub(crate) unit: Arc<TaskShared>,
    /// With the plan's parts: per stream, the record that stands for its
    /// part to the tracker (the id and position of the stream's last task),
    /// finished by the stream thread right after that task. Else empty.
    pub(crate) ends: Vec<Option<Arc<TaskShared>>>,
    /// Measure each body's duration (for re-placement).
    pub(crate) measure: bool,
    /// Every task on the one stream this run was pushed to, in the
    /// schedule's order, counted as one completion (a graph replay on the
    /// CPU, `sched::capture`); else each stream runs its program.
    pub(crate) sequential: bool,
}

impl Run {
    /// The first failed task of this run, if any (statuses of the tasks
    /// the caller has waited for).
    pub(crate) fn failed_task(&self, among: impl IntoIterator<Item = u32>) -> Option<u32> {
        if !self.any_failed.load(Ordering::Acquire) {
            return None;
        }
        among
            .into_iter()
            .find(|&i| self.status[i as usize].load(Ordering::Acquire) >= FAILED)
    }

    /// Keeps `e` as the run's root error if it is the first failure of its
    /// own (a skip carries the root it was skipped for).
    pub(crate) fn note_root(&self, e: &Error) {
        let root = match e {
            Error::DependencyFailed { root: Some(r), .. } => r.clone(),
            Error::DependencyFailed { root: None, .. } => return,
            e => Box::new(e.clone()),
        };
        let _ = self.root.set(root);
    }

    /// The run's root error, if a task of it failed.
    pub(crate) fn root_error(&self) -> Option<Box<Error>> {
        self.root.get().cloned()
    }

    /// Records a task's failure (or skip) in this run.
    pub(crate) fn fail(&self, i: usize, status: u8) {
        self.status[i].store(status, Ordering::Release);
        self.any_failed.store(true, Ordering::Release);
    }

    /// The first task of stream `s`'s part of this run that failed or was
    /// skipped, if any.
    pub(crate) fn part_failure(&self, s: usize) -> Option<u32> {
        let steps = self.plan.programs[s].iter().map(|st| st.task);
        self.failed_task(steps.filter(|&t| t != JOIN))
    }
}

/// How a replay is submitted.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct How {
    /// One task record per step through the ordinary launch path (CUDA),
    /// else one program per stream.
    pub(crate) materialise: bool,
    /// Wait for everything submitted so far on every stream first (the first
    /// replay of a re-placed plan).
    pub(crate) fence: bool,
    /// Measure the bodies' durations.
    pub(crate) measure: bool,
}

/// Submits one replay of `plan`; returns its join. Runs under the runtime's
/// lock, like `sched::submit`.
pub(crate) fn submit(
    st: &mut SubmitState,
    shared: &Shared,
    plan: &std::sync::Arc<Plan>,
    how: How,
) -> Arc<TaskShared> {
    let nstreams = shared.streams.len();
    let mut regions = Vec::new();
    let mut ext = external_preds(st, shared, plan, &mut regions);
    let used: SmallVec<[usize; 8]> = (0..nstreams)
        .filter(|&s| !plan.programs[s].is_empty())
        .collect();
    let base: Clock = st.placed.iter().copied().collect();
    let mut entry: Vec<SmallVec<[(u16, u64); 4]>> = vec![SmallVec::new(); nstreams];
    for &s in &used {
        entry[s] = cross_waits(&mut st.clocks[s], s, &ext, &mut st.stats);
        if how.fence {
            fence(&mut st.clocks[s], s, &base, &mut entry[s]);
        }
        st.stats.waits += entry[s].len() as u64;
    }
    let id_base = st.next_id;
    st.next_id += plan.steps();
    // With parts, each used stream's part gets its record (from the
    // stream's clock before its program); then the stream's clock advances
    // past its program, whose last step is the stream's tail: the part's
    // record, or (set by `join_record`) the join.
    let split = !how.materialise && !plan.parts.is_empty();
    let mut ends = vec![None; if split { nstreams } else { 0 }];
    for &s in &used {
        if split {
            ends[s] = part_record(st, plan, s, id_base, &base);
        }
        advance(&mut st.clocks[s], &plan.finals[s], &base);
        st.placed[s] += plan.programs[s].len() as u64;
        super::live::placed(shared, s, st.placed[s]);
        st.tail[s] = ends
            .get(s)
            .and_then(Option::as_ref)
            .map_or(u64::MAX, |e| e.id);
    }
    let unit = join_record(st, plan, id_base, TaskKind::Host);
    if !split {
        st.tracker.record_unit(&unit, &plan.union);
    }
    st.stats.replays += 1;
    st.stats.replayed_tasks += plan.len() as u64;
    shared
        .submitted
        .fetch_add(plan.steps(), crate::sync::Ordering::Relaxed);
    let external: SmallVec<[Arc<TaskShared>; 4]> = ext.drain(..).collect();
    st.preds = ext;
    if how.materialise {
        push_tasks(
            shared,
            plan,
            &base,
            id_base,
            &entry,
            (&external, &regions),
            &unit,
        );
    } else {
        let run = Arc::new(Run {
            plan: plan.clone(),
            base,
            id_base,
            entry,
            external,
            regions,
            status: (0..plan.len()).map(|_| AtomicU8::new(PENDING)).collect(),
            any_failed: crate::sync::AtomicBool::new(false),
            root: std::sync::OnceLock::new(),
            unit: unit.clone(),
            ends,
            measure: how.measure,
            sequential: false,
        });
        for &s in &used {
            shared.streams[s].queue.push(Item::Program(run.clone()));
        }
    }
    unit
}

/// Adds to `waits` what stream `s` must wait for to start after every task
/// placed so far on the other streams (`placed`, each stream's sequence
/// number), except what its vector clock `clock` already implies, and
/// advances the clock: a replay's fence.
pub(crate) fn fence(
    clock: &mut Clock,
    s: usize,
    placed: &[u64],
    waits: &mut SmallVec<[(u16, u64); 4]>,
) {
    for (j, &seq) in placed.iter().enumerate().filter(|&(j, _)| j != s) {
        if clock[j] < seq {
            waits.push((j as u16, seq));
            clock[j] = seq;
        }
    }
}

/// The unfinished tasks submitted before a replay of `plan` that it depends
/// on (the union of its accesses against the tracker), in a vector taken
/// from `st.preds` (give it back); in `regions`, what of their accesses the
/// union met ([`Tracker::preds_of_union`]).
pub(crate) fn external_preds(
    st: &mut SubmitState,
    shared: &Shared,
    plan: &Plan,
    regions: &mut Vec<(u64, Region)>,
) -> Vec<Arc<TaskShared>> {
    for id in shared.dropped.drain() {
        st.tracker.forget(id);
    }
    let mut ext = std::mem::take(&mut st.preds);
    ext.clear();
    st.tracker.preds_of_union(&plan.union, &mut ext, regions);
    ext
}

/// The regions of a replay's external predecessors (all, or the failed
/// ones), by buffer: which of them a task's accesses depend on.
pub(crate) struct ExternalIndex {
    /// Per buffer, `(external predecessor, region)`.
    by_buf: std::collections::HashMap<u64, SmallVec<[(usize, Region); 2]>>,
    /// Regions that are units (earlier replays' parts), any buffer.
    units: Vec<(usize, Region)>,
}

impl ExternalIndex {
    /// Indexes the `regions` (by task id) of the tasks of `external` that
    /// failed, by their position in `external`. Read once every external
    /// predecessor has finished.
    pub(crate) fn of_failed(external: &[Arc<TaskShared>], regions: &[(u64, Region)]) -> Self {
        Self::of(external, regions, |e| e.failed())
    }

    /// Indexes the `regions` of the tasks of `external` that `keep` takes,
    /// by their position in `external`.
    pub(crate) fn of(
        external: &[Arc<TaskShared>],
        regions: &[(u64, Region)],
        keep: impl Fn(&TaskShared) -> bool,
    ) -> Self {
        let mut ix = ExternalIndex {
            by_buf: Default::default(),
            units: Vec::new(),
        };
        for (id, r) in regions {
            let Some(k) = external.iter().position(|e| e.id == *id && keep(e)) else {
                continue;
            };
            match r {
                Region::Range { buf, .. } => {
                    ix.by_buf.entry(*buf).or_default().push((k, r.clone()))
                }
                Region::Unit(_) => ix.units.push((k, r.clone())),
            }
        }
        ix
    }

    /// The first indexed external predecessor (by position) that task `t`'s
    /// accesses depend on, if any.
    pub(crate) fn first_met(&self, t: &RecTask) -> Option<usize> {
        self.met(t).next()
    }

    /// The indexed external predecessors (by position) that task `t`'s
    /// accesses depend on, in access order (a predecessor met by two
    /// accesses comes twice).
    pub(crate) fn met<'a>(&'a self, t: &'a RecTask) -> impl Iterator<Item = usize> + 'a {
        t.accesses.iter().flat_map(move |a| {
            let (buf, range) = (a.view.buf.id(), a.view.range());
            let on_buf = self.by_buf.get(&buf).map(|v| &v[..]).unwrap_or(&[]);
            on_buf
                .iter()
                .chain(&self.units)
                .filter(move |(_, r)| r.conflicts(buf, &range, a.mode))
                .map(|(k, _)| *k)
        })
    }
}

/// A replay's one task record on the plan's join stream (the join, or a
/// graph launch), recorded in the tracker as the unit with the union of
/// the schedule's accesses.
pub(crate) fn unit_record(
    st: &mut SubmitState,
    plan: &Plan,
    id_base: u64,
    kind: TaskKind,
) -> Arc<TaskShared> {
    let unit = join_record(st, plan, id_base, kind);
    st.tracker.record_unit(&unit, &plan.union);
    unit
}

/// The record of stream `s`'s part of a CPU replay (`Plan::parts`; `None`
/// if the stream has none), recorded in the tracker with the part's union:
/// it has the id and position of the stream's last task, and the clock
/// that task implies on top of the stream's clock before its program.
fn part_record(
    st: &mut SubmitState,
    plan: &Plan,
    s: usize,
    id_base: u64,
    base: &[u64],
) -> Option<Arc<TaskShared>> {
    let (last, union) = plan.parts[s].as_ref()?;
    let i = *last as usize;
    let mut clock = st.clocks[s].clone();
    advance(&mut clock, &plan.clocks[i], base);
    let end = TaskShared::new(Record {
        id: id_base + i as u64,
        name: plan.name.clone(),
        scope: None,
        kind: plan.tasks[i].kind,
        stream: s,
        seq: base[s] + plan.position[i] as u64,
        clock,
        placement: replayed(plan),
        eft: 0,
        cost: super::cost::NO_SLOT,
    });
    st.tracker.record_unit(&end, union);
    Some(end)
}

/// Advances `clock` by a plan's vector clock `local` (positions local to
/// the schedule, 0 for none), shifted by each stream's `base`.
fn advance(clock: &mut Clock, local: &[u32], base: &[u64]) {
    for (j, &c) in local.iter().enumerate() {
        if c > 0 {
            clock[j] = clock[j].max(base[j] + c as u64);
        }
    }
}

/// A replay's one task record on the plan's join stream (the join, or a
/// graph launch), not yet in the tracker; the stream's tail.
fn join_record(st: &mut SubmitState, plan: &Plan, id_base: u64, kind: TaskKind) -> Arc<TaskShared> {
    let f = plan.join_stream;
    let unit = TaskShared::new(Record {
        id: id_base + plan.len() as u64,
        name: plan.name.clone(),
        scope: None,
        kind,
        stream: f,
        seq: st.placed[f],
        clock: st.clocks[f].clone(),
        placement: replayed(plan),
        eft: 0,
        cost: super::cost::NO_SLOT,
    });
    st.tail[f] = unit.id;
    unit
}

/// The materialised replay: one task record per step, pushed in the
/// schedule's order; the join (`unit`) last, depending on every task.
///
/// A task's predecessors (whose failure skips it) are its predecessors in
/// the schedule and the external predecessors its own accesses meet
/// (`regions`, [`ExternalIndex`]): as if it were submitted again, and as a
/// program run skips (semantics 9). The first step of each stream waits
/// for every external predecessor (`entry`), so it also holds the others,
/// for their events, not their failures (`Launch::wait_only`).
fn push_tasks(
    shared: &Shared,
    plan: &Plan,
    base: &[u64],
    id_base: u64,
    entry: &[SmallVec<[(u16, u64); 4]>],
    (external, regions): (&[Arc<TaskShared>], &[(u64, Region)]),
    unit: &Arc<TaskShared>,
) {
    let abs = |waits: &[(u16, u32)], first: Option<usize>| {
        let mut w: SmallVec<[(u16, u64); 4]> = first
            .map(|s| entry[s].iter().copied().collect())
            .unwrap_or_default();
        w.extend(waits.iter().map(|&(j, m)| (j, base[j as usize] + m as u64)));
        w
    };
    let index = (!external.is_empty()).then(|| ExternalIndex::of(external, regions, |_| true));
    // Appends to `preds` the external predecessors not in it, only waited
    // for; returns how many.
    let wait_for_others = |preds: &mut SmallVec<[Arc<TaskShared>; 4]>| -> u32 {
        let known = preds.len();
        for e in external {
            if !preds[..known].iter().any(|p| Arc::ptr_eq(p, e)) {
                preds.push(e.clone());
            }
        }
        (preds.len() - known) as u32
    };
    let mut made: Vec<Arc<TaskShared>> = Vec::with_capacity(plan.len());
    for (i, t) in plan.tasks.iter().enumerate() {
        let s = t.stream as usize;
        let pos = plan.position[i];
        let first = (pos == 1).then_some(s);
        let step = &plan.programs[s][pos as usize - 1];
        let mut preds: SmallVec<[Arc<TaskShared>; 4]> =
            t.preds.iter().map(|&p| made[p as usize].clone()).collect();
        let own = preds.len();
        for k in index.iter().flat_map(|ix| ix.met(t)) {
            if !preds[own..].iter().any(|p| Arc::ptr_eq(p, &external[k])) {
                preds.push(external[k].clone());
            }
        }
        let wait_only = if first.is_some() {
            wait_for_others(&mut preds)
        } else {
            0
        };
        let task = TaskShared::new(Record {
            id: id_base + i as u64,
            name: t.name.clone(),
            scope: t.scope.clone(),
            kind: t.kind,
            stream: s,
            seq: base[s] + pos as u64,
            clock: Clock::new(),
            placement: replayed(plan),
            eft: 0,
            cost: super::cost::NO_SLOT,
        });
        let launch = Launch {
            waits: abs(&step.waits, first),
            preds,
            wait_only,
            accesses: t.accesses.clone(),
            body: TaskBody::Shared(t.body.clone()),
            comm_hook: t.comm_hook.clone(),
        };
        shared.streams[s]
            .queue
            .push(Item::Task(task.clone(), launch));
        made.push(task);
    }
    let f = plan.join_stream;
    let join = plan.programs[f]
        .last()
        .expect("a program ends with its join");
    let first = (plan.programs[f].len() == 1).then_some(f);
    // The join fails with the replay's tasks, as a program run's does: an
    // external predecessor no task met does not fail it.
    let mut preds: SmallVec<[Arc<TaskShared>; 4]> = made.into_iter().collect();
    let wait_only = if first.is_some() {
        wait_for_others(&mut preds)
    } else {
        0
    };
    let launch = Launch {
        waits: abs(&join.waits, first),
        preds,
        wait_only,
        accesses: SmallVec::new(),
        body: TaskBody::Join,
        comm_hook: None,
    };
    shared.streams[f]
        .queue
        .push(Item::Task(unit.clone(), launch));
}

/// The placement record of a replayed task.
pub(crate) fn replayed(plan: &Plan) -> crate::kind::Placement {
    crate::kind::Placement {
        reason: crate::kind::PlaceReason::Replayed,
        usable: plan.usable,
        priority: crate::kind::Priority::Main,
    }
}

/// The error of a replay's join when one of its tasks (or an external
/// predecessor) failed: the replay names the task that failed.
pub(crate) fn join_error(plan: &Plan, cause: &str, root: Option<Box<Error>>) -> Error {
    Error::DependencyFailed {
        task: plan.name.to_string(),
        cause: cause.to_string(),
        root,
    }
}

#[cfg(all(test, not(loom)))]
pub(crate) mod tests {
    use super::*;
    use crate::ctx::BodyCell;

    /// A recorded task on `stream` after `preds`, measured at `ns`.
    pub(crate) fn task(stream: u16, preds: &[u32], ns: u64) -> RecTask {
        let body = std::sync::Arc::new(BodyCell::new(crate::ctx::body(|_| Ok(()))));
        body.measured(ns);
        RecTask {
            name: "t".into(),
            scope: None,
            kind: TaskKind::Compute,
            stream,
            accesses: SmallVec::new(),
            body,
            comm_hook: None,
            preds: preds.iter().copied().collect(),
            movable: true,
        }
    }

    /// 300 random schedules (`(streams, tasks)`) from a fixed xorshift64
    /// sequence seeded with `seed`: 1 to `max_streams` streams, up to 40
    /// tasks, each after each earlier task with probability 0.15, of the
    /// kind `kind` gives a random number below 100.
    pub(crate) fn random_schedules(
        seed: u64,
        max_streams: u64,
        kind: impl Fn(u64) -> TaskKind,
    ) -> Vec<(usize, Vec<RecTask>)> {
        let mut x = seed;
        let mut next = |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        };
        (0..300)
            .map(|_| {
                let streams = 1 + next(max_streams) as usize;
                let n = 1 + next(40) as usize;
                let tasks = (0..n)
                    .map(|i| {
                        let preds: Vec<u32> = (0..i as u32).filter(|_| next(100) < 15).collect();
                        let mut t = task(next(streams as u64) as u16, &preds, 1);
                        t.kind = kind(next(100));
                        t
                    })
                    .collect();
                (streams, tasks)
            })
            .collect()
    }

    /// Re-placed from its measured durations (`None`: not all measured).
    fn re_placed(p: Plan, compute: usize, sync_ns: u64) -> Option<Plan> {
        p.measured().map(|d| p.replaced(&d, compute, sync_ns))
    }

    fn streams(p: &Plan) -> Vec<u16> {
        p.tasks.iter().map(|t| t.stream).collect()
    }

    #[test]
    fn waits_are_local_and_elided_and_the_join_closes_every_stream() {
        // 0 on s0; 1 on s1 after 0; 2 on s0 after 1; 3 on s1 after 0 (implied).
        let p = Plan::new(
            "p".into(),
            vec![
                task(0, &[], 1),
                task(1, &[0], 1),
                task(0, &[1], 1),
                task(1, &[0], 1),
            ],
            3,
        );
        let waits: Vec<Vec<(u16, u32)>> = p.programs[1].iter().map(|s| s.waits.to_vec()).collect();
        assert_eq!(waits, vec![vec![(0, 1)], vec![], vec![(0, 2)]]);
        assert_eq!(p.join_stream, 1);
        let join = p.programs[1].last().unwrap();
        assert_eq!((join.task, join.waits.to_vec()), (JOIN, vec![(0, 2)]));
        assert!(p.programs[0][0].signal && p.programs[0][1].signal);
        assert!(p.programs[2].is_empty());
    }

    #[test]
    fn replacement_gathers_short_tasks_and_spreads_long_independent_ones() {
        // Short tasks alternating over two streams: one stream is better.
        let short: Vec<RecTask> = (0..6).map(|i| task(i % 2, &[], 100)).collect();
        let p = re_placed(Plan::new("short".into(), short, 2), 2, 5_000).unwrap();
        assert_eq!(streams(&p), vec![0; 6]);
        // Two long independent chains recorded on one stream: spread.
        let long = vec![
            task(0, &[], 1_000_000),
            task(0, &[], 1_000_000),
            task(0, &[0], 1_000_000),
            task(0, &[1], 1_000_000),
        ];
        let p = re_placed(Plan::new("long".into(), long, 2), 2, 5_000).unwrap();
        assert_eq!(streams(&p), vec![0, 1, 0, 1]);
        // Unmeasured tasks: no replacement yet.
        let mut t = task(0, &[], 1);
        t.body = std::sync::Arc::new(BodyCell::new(crate::ctx::body(|_| Ok(()))));
        assert!(re_placed(Plan::new("x".into(), vec![t], 1), 1, 0).is_none());
    }

    fn named(mut t: RecTask, name: &'static str) -> RecTask {
        t.name = name.into();
        t
    }

    fn names(p: &Plan) -> Vec<&str> {
        p.tasks.iter().map(|t| t.name.as_ref()).collect()
    }

    #[test]
    fn a_long_path_goes_first() {
        const MS: u64 = 1_000_000;
        // Program order: two independent 10 ms tasks, then a 1 ms task with
        // a 10 ms successor. In that order the chain starts last (21 ms);
        // by upward rank it starts first and the independent tasks fill in
        // around it (20 ms).
        let tasks = vec![
            named(task(0, &[], 10 * MS), "x1"),
            named(task(0, &[], 10 * MS), "x2"),
            named(task(0, &[], MS), "b"),
            named(task(0, &[2], 10 * MS), "c"),
        ];
        let p = re_placed(Plan::new("p".into(), tasks, 2), 2, 5_000).unwrap();
        assert_eq!(names(&p), ["b", "x1", "x2", "c"]);
        assert_eq!(streams(&p), [0, 1, 0, 1]);
        // `c`'s predecessor, renumbered: `b`, now first.
        assert_eq!(p.tasks[3].preds.to_vec(), [0]);
        // Where program order is as good, it is kept.
        let chain = vec![named(task(0, &[], MS), "a"), named(task(0, &[0], MS), "b")];
        let p = re_placed(Plan::new("q".into(), chain, 2), 2, 5_000).unwrap();
        assert_eq!(names(&p), ["a", "b"]);
    }

    #[test]
    fn fixed_tasks_keep_their_program_order() {
        const MS: u64 = 1_000_000;
        // Two collectives on stream 2 (not movable): the second one heads a
        // long path, the first none, but they stay in program order.
        let mut c1 = named(task(2, &[], MS), "c1");
        let mut c2 = named(task(2, &[], MS), "c2");
        (c1.movable, c2.movable) = (false, false);
        c1.kind = TaskKind::Comm;
        c2.kind = TaskKind::Comm;
        let tasks = vec![
            named(task(0, &[], 10 * MS), "x"),
            c1,
            c2,
            named(task(0, &[2], 30 * MS), "after c2"),
        ];
        let p = re_placed(Plan::new("p".into(), tasks, 3), 2, 5_000).unwrap();
        let order = names(&p);
        let at = |n: &str| order.iter().position(|&m| m == n).unwrap();
        assert!(at("c1") < at("c2"), "{order:?}");
        assert!(at("c2") < at("after c2"), "{order:?}");
    }
}

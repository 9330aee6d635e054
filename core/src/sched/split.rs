//! Graph replay split around collectives and host tasks.
//!
//! Host work cannot go into a graph (uploads and read-backs synchronise),
//! and by default a collective does not either: its body takes the
//! communicator's next index when it runs and registers the completion check
//! the watchdog aborts through. With
//! [`crate::RuntimeBuilder::graph_collectives`] the collectives of one
//! communication stream (the first collective's) go into the graphs, each
//! with a launch hook that does that host work at every launch
//! (`sched::capture`), and a graph that holds some is launched on that
//! stream, so its collectives keep one order with the stream's others.
//! A schedule that holds tasks kept out is cut, in its own order, into
//! *parts*: each maximal run of capturable tasks becomes a plan of its own
//! (a CUDA graph, or on the CPU a sequential run: `sched::capture`), and each
//! collective or host task stays an ordinary task with its recorded body, on
//! its recorded stream. A replay submits the parts in order, each as one
//! unit to the tracker, and ends with a join that depends on every part: its
//! handle is the replay's.
//!
//! Why this keeps the program's results (semantics 1): the parts, submitted
//! in the schedule's order, are what submitting its tasks in that order
//! would be, grouped; each part waits for the unfinished work its accesses
//! conflict with (the tracker), and for the earlier parts the schedule has an
//! edge from (explicit `after` edges among the recorded tasks included).
//! Why it keeps the overlap: the data-parallel step is backward, a bucket's
//! all-reduce, more backward, and the next part of the backward does not
//! touch the bucket being reduced, so the collective on the communication
//! stream runs beside the next graph on the compute stream.

use super::capture::{self, Unit};
use super::replay::{self, Plan, RecTask};
use super::{cross_waits, Item, Launch, Record, Shared, SubmitState, TaskBody, TaskShared};
use crate::kind::TaskKind;
use crate::sync::Arc;
use smallvec::SmallVec;

/// A piece of a schedule, in the schedule's order.
pub(crate) enum Part<U> {
    /// A run of capturable tasks: its own plan (task indices local), and
    /// what it is launched as once made.
    Graph { plan: std::sync::Arc<Plan>, unit: U },
    /// Task `task` of the schedule, submitted as an ordinary task.
    Eager { task: u32 },
}

/// A schedule cut into parts, each with the earlier parts it has an edge
/// from.
pub(crate) struct Split<U> {
    pub(crate) parts: Vec<(Part<U>, SmallVec<[u32; 4]>)>,
    /// Why the collectives that `graph_collectives` asked to capture are
    /// ordinary tasks between the graphs instead: the capture with them
    /// failed (`Runtime::submit_graph_replay`). `None` otherwise.
    pub(crate) collectives_left_out: Option<String>,
}

/// Which tasks stay out of graphs: host work always, and collectives
/// except those on `comm`.
#[derive(Clone, Copy)]
struct Keep {
    /// The stream whose collectives are captured, if any are.
    comm: Option<u16>,
}

impl Keep {
    /// For `plan`: with `collectives`, the first collective's stream.
    fn of(plan: &Plan, collectives: bool) -> Keep {
        let first = plan.tasks.iter().find(|t| t.kind == TaskKind::Comm);
        Keep {
            comm: first.filter(|_| collectives).map(|t| t.stream),
        }
    }

    /// Whether task `t` stays out of graphs.
    fn eager(self, t: &RecTask) -> bool {
        match t.kind {
            TaskKind::Host => true,
            TaskKind::Comm => self.comm != Some(t.stream),
            _ => false,
        }
    }

    /// The stream a graph of `tasks` is joined on: the captured
    /// collectives' stream if it holds one.
    fn join(self, tasks: &[RecTask]) -> Option<usize> {
        let comm = self.comm?;
        let holds = tasks
            .iter()
            .any(|t| t.kind == TaskKind::Comm && t.stream == comm);
        holds.then_some(comm as usize)
    }
}

/// Cuts `plan` into parts, or says why it has no part to capture; with
/// `collectives`, the collectives of the first one's stream are captured.
/// A plan with nothing to cut is one part: the plan itself (joined on the
/// captured collectives' stream if it holds some).
pub(crate) fn split(plan: &std::sync::Arc<Plan>, collectives: bool) -> Result<Split<()>, String> {
    let keep = Keep::of(plan, collectives);
    let eager = |t: &RecTask| keep.eager(t);
    if plan.tasks.iter().all(eager) {
        let t = plan.tasks.first().map_or("", |t| t.name.as_ref());
        return Err(format!(
            "no task can be captured (every task, `{t}` first, is a collective or host work: \
             uploads and read-backs synchronise)"
        ));
    }
    if !plan.tasks.iter().any(eager) {
        let whole = match keep.join(&plan.tasks) {
            Some(f) if f != plan.join_stream => {
                let p = sub_plan(plan, plan.name.clone(), plan.tasks.clone(), keep);
                std::sync::Arc::new(p)
            }
            _ => plan.clone(),
        };
        let whole = Part::Graph {
            plan: whole,
            unit: (),
        };
        return Ok(Split {
            parts: vec![(whole, SmallVec::new())],
            collectives_left_out: None,
        });
    }
    // `at[i]`: task i's part and its index there.
    let mut at: Vec<(u32, u32)> = Vec::with_capacity(plan.len());
    let mut parts: Vec<(Part<()>, SmallVec<[u32; 4]>)> = Vec::new();
    // The run of capturable tasks being gathered, and its earlier parts.
    let mut run: Gathered = Default::default();
    for (i, t) in plan.tasks.iter().enumerate() {
        if eager(t) && !run.0.is_empty() {
            parts.push(graph_part(plan, &parts, std::mem::take(&mut run), keep));
        }
        // The part this task is in: the next one.
        let k = parts.len() as u32;
        let mut after: SmallVec<[u32; 4]> = SmallVec::new();
        let mut local: SmallVec<[u32; 4]> = SmallVec::new();
        for &p in &t.preds {
            match at[p as usize] {
                (pk, pi) if pk == k => local.push(pi),
                (pk, _) if !after.contains(&pk) => after.push(pk),
                _ => {}
            }
        }
        if eager(t) {
            at.push((k, 0));
            parts.push((Part::Eager { task: i as u32 }, after));
        } else {
            at.push((k, run.0.len() as u32));
            for a in after {
                if !run.1.contains(&a) {
                    run.1.push(a);
                }
            }
            let mut t = t.clone();
            t.preds = local;
            run.0.push(t);
        }
    }
    if !run.0.is_empty() {
        parts.push(graph_part(plan, &parts, run, keep));
    }
    Ok(Split {
        parts,
        collectives_left_out: None,
    })
}

/// Capturable tasks gathered for a part (predecessors local to it), with
/// the earlier parts it has an edge from.
type Gathered = (Vec<RecTask>, SmallVec<[u32; 4]>);

/// The next part of `plan` after `parts`: the gathered tasks as a plan, after
/// their earlier parts and the graph part before it (graph parts run one
/// after another: on CUDA they share the capture's cuBLAS workspaces),
/// joined on the captured collectives' stream if it holds some.
fn graph_part(
    plan: &Plan,
    parts: &[(Part<()>, SmallVec<[u32; 4]>)],
    (tasks, mut after): Gathered,
    keep: Keep,
) -> (Part<()>, SmallVec<[u32; 4]>) {
    let k = parts.len();
    let previous = parts
        .iter()
        .rposition(|(p, _)| matches!(p, Part::Graph { .. }));
    if let Some(g) = previous.map(|g| g as u32).filter(|g| !after.contains(g)) {
        after.push(g);
    }
    let name = format!("{}[{k}]", plan.name);
    let part = Part::Graph {
        plan: std::sync::Arc::new(sub_plan(plan, name.into(), tasks, keep)),
        unit: (),
    };
    (part, after)
}

/// `tasks` (some or all of `plan`'s) as a plan of their own on `plan`'s
/// streams, joined on the captured collectives' stream if they hold some
/// (else on the last task's).
fn sub_plan(
    plan: &Plan,
    name: std::borrow::Cow<'static, str>,
    tasks: Vec<RecTask>,
    keep: Keep,
) -> Plan {
    let streams = plan.programs.len();
    let mut p = match keep.join(&tasks) {
        Some(f) => Plan::joined_on(name, tasks, streams, f),
        None => Plan::new(name, tasks, streams),
    };
    p.usable = plan.usable;
    p
}

impl<U> Split<U> {
    /// Makes each graph part's unit from its plan and its unit so far with
    /// `make`, in order; the first error wins.
    pub(crate) fn made<V>(
        self,
        mut make: impl FnMut(&std::sync::Arc<Plan>, U) -> Result<V, String>,
    ) -> Result<Split<V>, String> {
        let parts = self
            .parts
            .into_iter()
            .map(|(p, after)| {
                let p = match p {
                    Part::Graph { plan, unit } => {
                        let unit = make(&plan, unit)?;
                        Part::Graph { plan, unit }
                    }
                    Part::Eager { task } => Part::Eager { task },
                };
                Ok((p, after))
            })
            .collect::<Result<_, String>>()?;
        Ok(Split {
            parts,
            collectives_left_out: self.collectives_left_out,
        })
    }

    /// `(graph parts, tasks kept out of graphs)`.
    pub(crate) fn shape(&self) -> (usize, usize) {
        let graphs = self
            .parts
            .iter()
            .filter(|(p, _)| matches!(p, Part::Graph { .. }))
            .count();
        (graphs, self.parts.len() - graphs)
    }
}

/// Captures every graph part of `split` (a cut of `plan`) on CUDA, sharing
/// one set of cuBLAS handles: the caller holds the runtime's lock and every
/// task submitted so far has completed. An `Err` says why the schedule is
/// not a graph; nothing ran, and the streams are out of capture mode.
pub(crate) fn capture_cuda(
    split: Split<()>,
    plan: &Plan,
    cuda: &crate::backend::gpu::CudaBackend,
) -> Result<Split<Unit>, String> {
    let graph_streams: Vec<usize> = split
        .parts
        .iter()
        .filter_map(|(p, _)| match p {
            Part::Graph { plan, .. } => Some(plan),
            Part::Eager { .. } => None,
        })
        .flat_map(|plan| plan.tasks.iter().map(|t| t.stream as usize))
        .collect();
    let cap = capture::Capturer::new(cuda, plan.programs.len(), graph_streams)?;
    let graphs = split.made(|part, ()| cap.capture(part))?;
    let handles = std::sync::Arc::new(cap.into_handles());
    graphs.made(|plan, graph| {
        let step = capture::CudaStep::new(graph, handles.clone(), plan.clone());
        Ok(Unit::Cuda(std::sync::Arc::new(step)))
    })
}

/// Submits one graph replay of `plan`, cut as `split`; returns the task
/// whose handle is the replay's. Runs under the runtime's lock. `fence`:
/// the first graph replay (each graph part waits for everything submitted
/// before it on every stream: earlier runs ran its bodies on other
/// streams).
pub(crate) fn submit(
    st: &mut SubmitState,
    shared: &Shared,
    plan: &Plan,
    split: &Split<Unit>,
    fence: bool,
) -> Arc<TaskShared> {
    st.stats.replays += 1;
    st.stats.replayed_tasks += plan.len() as u64;
    st.stats.graph_replays += 1;
    let mut made: Vec<Arc<TaskShared>> = Vec::with_capacity(split.parts.len());
    for (part, after) in &split.parts {
        let after: SmallVec<[Arc<TaskShared>; 4]> =
            after.iter().map(|&k| made[k as usize].clone()).collect();
        let task = match part {
            Part::Graph { plan, unit } => capture::submit(st, shared, plan, unit, fence, &after),
            Part::Eager { task } => submit_recorded(st, shared, plan, *task as usize, &after),
        };
        made.push(task);
    }
    match &made[..] {
        [one] => one.clone(),
        _ => submit_join(st, shared, plan, made),
    }
}

/// Submits recorded task `i` of `plan` as an ordinary task on its recorded
/// stream, with its recorded body, after `after` and whatever its accesses
/// conflict with.
fn submit_recorded(
    st: &mut SubmitState,
    shared: &Shared,
    plan: &Plan,
    i: usize,
    after: &[Arc<TaskShared>],
) -> Arc<TaskShared> {
    let t = &plan.tasks[i];
    let s = t.stream as usize;
    let mut preds = super::inferred_preds(st, shared, &t.accesses);
    super::add_after(&mut preds, after);
    let (task, waits) = place(
        st,
        shared,
        s,
        &preds,
        (t.name.clone(), t.kind, t.scope.clone()),
        plan,
    );
    for a in &t.accesses {
        st.tracker
            .record(a.view.buf.id(), a.view.range(), a.mode, &task);
    }
    let launch = Launch {
        waits,
        preds: preds.drain(..).collect(),
        wait_only: 0,
        accesses: t.accesses.clone(),
        body: TaskBody::Shared(t.body.clone()),
        comm_hook: t.comm_hook.clone(),
    };
    st.preds = preds;
    shared.streams[s]
        .queue
        .push(Item::Task(task.clone(), launch));
    task
}

/// The replay's end: a task on the last part's stream that depends on every
/// part (its failure names the first task of the replay that failed).
fn submit_join(
    st: &mut SubmitState,
    shared: &Shared,
    plan: &Plan,
    parts: Vec<Arc<TaskShared>>,
) -> Arc<TaskShared> {
    let s = parts.last().expect("a split has parts").stream as usize;
    let (task, waits) = place(
        st,
        shared,
        s,
        &parts,
        (plan.name.clone(), TaskKind::Host, None),
        plan,
    );
    let launch = Launch {
        waits,
        preds: parts.into_iter().collect(),
        wait_only: 0,
        accesses: SmallVec::new(),
        body: TaskBody::Join,
        comm_hook: None,
    };
    shared.streams[s]
        .queue
        .push(Item::Task(task.clone(), launch));
    task
}

/// Places a task record on stream `s` after `preds`: its sequence number,
/// its id, and the cross-stream waits it needs.
fn place(
    st: &mut SubmitState,
    shared: &Shared,
    s: usize,
    preds: &[Arc<TaskShared>],
    (name, kind, scope): (
        std::borrow::Cow<'static, str>,
        TaskKind,
        Option<std::sync::Arc<str>>,
    ),
    plan: &Plan,
) -> (Arc<TaskShared>, SmallVec<[(u16, u64); 4]>) {
    let waits = cross_waits(&mut st.clocks[s], s, preds, &mut st.stats);
    st.stats.waits += waits.len() as u64;
    let (id, seq) = super::next_slot(&mut st.placed, &mut st.tail, &mut st.next_id, shared, s);
    st.clocks[s][s] = seq;
    let task = TaskShared::new(Record {
        id,
        name,
        scope,
        kind,
        stream: s,
        seq,
        clock: st.clocks[s].clone(),
        placement: replay::replayed(plan),
        eft: 0,
        cost: super::cost::NO_SLOT,
    });
    (task, waits)
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    /// A recorded task of `kind` on `stream` after `preds`.
    fn task(kind: TaskKind, stream: u16, preds: &[u32]) -> RecTask {
        let mut t = crate::sched::replay::tests::task(stream, preds, 1);
        t.kind = kind;
        t
    }

    fn plan(tasks: Vec<RecTask>, streams: usize) -> std::sync::Arc<Plan> {
        std::sync::Arc::new(Plan::new("step".into(), tasks, streams))
    }

    /// Each task's part and index there, checking that the parts hold the
    /// schedule's tasks in its order and keep every edge: inside a part as
    /// a local edge, across parts as an `after` entry of the later part.
    fn check(p: &Plan, s: &Split<()>, collectives: bool) -> Vec<(usize, usize)> {
        let keep = Keep::of(p, collectives);
        let eager = |t: &RecTask| keep.eager(t);
        let mut at = Vec::new();
        for (k, (part, _)) in s.parts.iter().enumerate() {
            match part {
                Part::Graph { plan, .. } => {
                    assert!(plan.tasks.iter().all(|t| !eager(t)));
                    // Launched on the captured collectives' stream if it
                    // holds one.
                    if let Some(f) = keep.join(&plan.tasks) {
                        assert_eq!(plan.join_stream, f);
                    }
                    at.extend((0..plan.len()).map(|i| (k, i)));
                }
                Part::Eager { task } => {
                    assert_eq!(*task as usize, at.len());
                    assert!(eager(&p.tasks[*task as usize]));
                    at.push((k, 0));
                }
            }
        }
        assert_eq!(at.len(), p.len(), "every task in one part");
        // Each graph part comes after the graph part before it.
        let graphs: Vec<usize> = (0..s.parts.len())
            .filter(|&k| matches!(s.parts[k].0, Part::Graph { .. }))
            .collect();
        for w in graphs.windows(2) {
            assert!(s.parts[w[1]].1.contains(&(w[0] as u32)), "{w:?}");
        }
        for (i, t) in p.tasks.iter().enumerate() {
            let (k, li) = at[i];
            for &q in &t.preds {
                let (qk, qi) = at[q as usize];
                if qk == k {
                    let Part::Graph { plan, .. } = &s.parts[k].0 else {
                        panic!("an edge inside an eager part")
                    };
                    assert!(plan.tasks[li].preds.contains(&(qi as u32)), "{q} -> {i}");
                } else {
                    assert!(qk < k && s.parts[k].1.contains(&(qk as u32)), "{q} -> {i}");
                }
            }
        }
        at
    }

    #[test]
    fn a_schedule_is_cut_around_its_collectives_and_host_tasks() {
        use TaskKind::{Comm, Compute as C, Host};
        let p = plan(
            vec![
                task(C, 0, &[]),
                task(C, 1, &[0]),
                task(Comm, 2, &[1]),
                task(C, 0, &[0]),
                task(C, 1, &[2]),
                task(Host, 0, &[]),
                task(Comm, 2, &[]),
                task(C, 0, &[3]),
            ],
            3,
        );
        let s = split(&p, false).unwrap();
        assert_eq!(s.shape(), (3, 3));
        assert_eq!(
            check(&p, &s, false),
            [
                (0, 0),
                (0, 1),
                (1, 0),
                (2, 0),
                (2, 1),
                (3, 0),
                (4, 0),
                (5, 0)
            ]
        );
        let after: Vec<Vec<u32>> = s.parts.iter().map(|(_, a)| a.to_vec()).collect();
        assert_eq!(
            after,
            [vec![], vec![0], vec![0, 1], vec![], vec![], vec![2]]
        );
        let Part::Graph { plan: g, .. } = &s.parts[2].0 else {
            panic!("part 2 is a graph")
        };
        assert_eq!(g.name, "step[2]");
        assert!(g.tasks.iter().all(|t| t.preds.is_empty()));
    }

    #[test]
    fn nothing_to_cut_is_the_plan_itself_and_nothing_to_capture_is_refused() {
        let p = plan(vec![task(TaskKind::Compute, 0, &[]); 3], 1);
        let s = split(&p, false).unwrap();
        let Part::Graph { plan: whole, .. } = &s.parts[0].0 else {
            panic!("one graph")
        };
        assert!(std::sync::Arc::ptr_eq(whole, &p) && s.parts.len() == 1);
        let p = plan(
            vec![task(TaskKind::Host, 0, &[]), task(TaskKind::Comm, 1, &[0])],
            2,
        );
        let why = split(&p, false).err().expect("refused");
        assert!(why.contains("no task can be captured"), "{why}");
        // Host work alone is refused with collectives captured too.
        let p = plan(vec![task(TaskKind::Host, 0, &[])], 1);
        assert!(split(&p, true).is_err());
    }

    #[test]
    fn captured_collectives_of_one_stream_go_into_graphs_launched_on_it() {
        use TaskKind::{Comm, Compute as C, Host};
        // Collectives on stream 2 (the first one's) and on stream 3.
        let p = plan(
            vec![
                task(C, 0, &[]),
                task(Comm, 2, &[0]),
                task(C, 1, &[0]),
                task(Comm, 3, &[2]),
                task(C, 0, &[1]),
                task(Host, 0, &[]),
                task(C, 1, &[]),
            ],
            4,
        );
        let s = split(&p, true).unwrap();
        // [0, 1, 2] | 3 | [4] | 5 | [6]
        assert_eq!(s.shape(), (3, 2));
        assert_eq!(
            check(&p, &s, true),
            [(0, 0), (0, 1), (0, 2), (1, 0), (2, 0), (3, 0), (4, 0)]
        );
        let joins: Vec<Option<usize>> = s
            .parts
            .iter()
            .map(|(p, _)| match p {
                Part::Graph { plan, .. } => Some(plan.join_stream),
                Part::Eager { .. } => None,
            })
            .collect();
        assert_eq!(joins, [Some(2), None, Some(0), None, Some(1)]);
        // Nothing kept out: the whole plan, joined on the collectives'
        // stream rather than the last task's.
        let p = plan(vec![task(Comm, 1, &[]), task(C, 0, &[0])], 2);
        assert_eq!(p.join_stream, 0);
        let s = split(&p, true).unwrap();
        let Part::Graph { plan: whole, .. } = &s.parts[0].0 else {
            panic!("one graph")
        };
        assert_eq!((s.parts.len(), whole.join_stream), (1, 1));
        check(&p, &s, true);
        // Without: cut around the collective.
        assert_eq!(split(&p, false).unwrap().shape(), (1, 1));
    }

    #[test]
    fn random_schedules_keep_every_edge() {
        let kind = |r: u64| match r % 6 {
            0 => TaskKind::Comm,
            1 => TaskKind::Host,
            _ => TaskKind::Compute,
        };
        let schedules =
            crate::sched::replay::tests::random_schedules(0x2545_f491_4f6c_dd1d, 4, kind);
        for (streams, tasks) in schedules {
            let p = plan(tasks, streams);
            for collectives in [false, true] {
                if let Ok(s) = split(&p, collectives) {
                    check(&p, &s, collectives);
                }
            }
        }
    }
}

//! Graph replay: a recorded schedule run as one unit on one stream.
//!
//! On CUDA ([`Capturer`]) the schedule's tasks are captured once into a
//! CUDA graph: the origin stream (the plan's join stream) begins a capture,
//! every other stream the plan uses joins it through an event (the fork),
//! the bodies run in the schedule's order on the submitting thread — each
//! enqueues its kernels on its stream, which records them instead of running
//! them — with the plan's cross-stream waits as events recorded after the
//! step waited for and waited on before the step that waits, and every
//! stream rejoins the origin at the end. A replay is then one
//! `cuGraphLaunch` on the origin stream: one task record, one launch, no
//! per-task host work.
//!
//! On the CPU the same unit is a *sequential run*: one queue item on the
//! origin stream's thread, which runs every task of the schedule in its
//! order and completes once. It has no speed to offer (a CPU step's tasks
//! lose their overlap); it is how the submission side of graph replay — one
//! unit, its waits, its clocks, its failures — is tested on every machine.
//!
//! What is not captured: host tasks, and collectives unless the runtime
//! captures them ([`crate::RuntimeBuilder::graph_collectives`]) (a schedule
//! that holds some is cut around them, `sched::split`, and each run of other
//! tasks is captured on its own), and on CUDA any body that fails while
//! captured or registers a completion check (the replay falls back to one
//! task record per step, and [`crate::Schedule::graph_refusal`] says why).
//! A captured collective registers a launch hook instead
//! ([`GraphLaunch`]): the host work of each launch (its index, its
//! watchdog, its completion check), which [`CudaStep::launch`] runs around
//! the graph's launch.
//!
//! A graph bakes in every kernel argument at capture: values that change
//! from step to step must live in device buffers the kernels read, which is
//! the argument-block design replay already has (docs/replay.md).
//!
//! `BodyCell`'s invariant (calls of a recorded body never overlap) holds:
//! the capture runs after every earlier task has completed, under the
//! runtime's lock; a CPU sequential run's first replay is fenced behind
//! everything submitted before it, and later ones follow it on one stream.

use super::replay::{Plan, Run};
use super::{cross_waits, Item, Launch, Shared, SubmitState, TaskBody, TaskShared};
use crate::backend::gpu::{CudaBackend, GraphLaunch, LaunchHook, StreamDriver};
use crate::backend::DeviceCtx;
use crate::cuda::{Capture, CudaEvent, CudaGraph, EventKind};
use crate::kind::TaskKind;
use crate::sync::{Arc, AtomicU8};
use smallvec::SmallVec;

/// One operation of a capture, in the order it is issued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Op {
    /// The stream joins the capture: it waits for the origin's start.
    Fork(u16),
    /// Run task `i`'s body on its stream.
    Run(u32),
    /// Record an event on the stream (mark `k`, numbered in issue order).
    Mark(u16),
    /// The stream waits for mark `k`.
    Wait(u16, u32),
    /// The stream rejoins the origin: the origin waits for its end.
    Join(u16),
}

/// The capture of `plan` as operations: forks, then each task in the
/// schedule's order, preceded by the waits its program step issues and
/// followed by a mark when another step waits for it, then the joins.
pub(crate) fn ops(plan: &Plan) -> Vec<Op> {
    let f = plan.join_stream;
    let used: SmallVec<[u16; 8]> = (0..plan.programs.len())
        .filter(|&s| s != f && !plan.programs[s].is_empty())
        .map(|s| s as u16)
        .collect();
    let mut ops: Vec<Op> = used.iter().map(|&s| Op::Fork(s)).collect();
    // marks[(stream, position)] = mark number.
    let mut marks: std::collections::HashMap<(u16, u32), u32> = Default::default();
    for (i, t) in plan.tasks.iter().enumerate() {
        let s = t.stream;
        let pos = plan.position[i];
        let step = &plan.programs[s as usize][pos as usize - 1];
        for w in &step.waits {
            ops.push(Op::Wait(s, marks[w]));
        }
        ops.push(Op::Run(i as u32));
        if step.signal {
            marks.insert((s, pos), marks.len() as u32);
            ops.push(Op::Mark(s));
        }
    }
    ops.extend(used.iter().map(|&s| Op::Join(s)));
    ops
}

/// A captured graph and the launch hooks its bodies registered, in the
/// order they were captured.
pub(crate) type Captured = (CudaGraph, Vec<LaunchHook>);

/// A schedule (or a part of one) captured as a CUDA graph, with what its
/// kernels use.
pub(crate) struct CudaStep {
    graph: CudaGraph,
    /// What each launch needs done on the host (captured collectives), in
    /// capture order.
    hooks: std::sync::Arc<[LaunchHook]>,
    /// The cuBLAS handles the bodies were captured with: they own
    /// workspace the graph's kernels use (shared by the graphs of one
    /// schedule, which run one after another: `sched::split`).
    _cublas: std::sync::Arc<Vec<crate::cuda::CublasHandle>>,
    /// The plan captured: its tasks' accesses hold the buffers the graph's
    /// kernels use, so a launch in flight (whose task holds this step)
    /// keeps them, as an ordinary task's accesses do, even once the
    /// program has dropped the schedule and the buffers.
    _plan: std::sync::Arc<Plan>,
}

impl CudaStep {
    /// A captured graph with the handles its kernels use.
    pub(crate) fn new(
        (graph, hooks): Captured,
        cublas: std::sync::Arc<Vec<crate::cuda::CublasHandle>>,
        plan: std::sync::Arc<Plan>,
    ) -> Self {
        CudaStep {
            graph,
            hooks: hooks.into(),
            _cublas: cublas,
            _plan: plan,
        }
    }

    /// Launches the whole step on `ctx`'s stream, with each launch hook's
    /// `before` ahead of it (the first error stops the launch; the hooks
    /// after it are skipped) and each one's `after` once it is enqueued (the
    /// first error wins; every hook runs). A launch that fails tells every
    /// hook (`not_launched`): the collectives in the graph will not run.
    pub(crate) fn launch(&self, ctx: &DeviceCtx<'_>) -> crate::Result<()> {
        let DeviceCtx::Cuda(c) = ctx else {
            return Err(crate::Error::Config(
                "a CUDA graph reached a CPU stream".into(),
            ));
        };
        around_launch(
            &self.hooks,
            || Ok(self.graph.launch(c.stream())?),
            |h, t| h.after(t, c),
        )
    }

    /// What a launch that will not happen (a predecessor failed) owes its
    /// hooks: each is told it was skipped. `None` without hooks.
    pub(crate) fn comm_hook(&self) -> Option<crate::ctx::CommHook> {
        if self.hooks.is_empty() {
            return None;
        }
        Some(std::sync::Arc::new(SkippedLaunch(self.hooks.clone())))
    }
}

/// A graph launch's hooks, told together when the launch is skipped. A
/// replay queues the collectives in the graph through their recorded
/// tasks' own hooks, not through this.
struct SkippedLaunch(std::sync::Arc<[LaunchHook]>);

impl crate::ctx::CommEvents for SkippedLaunch {
    fn skipped(&self, why: &crate::Error) {
        self.0.iter().for_each(|h| GraphLaunch::skipped(&**h, why))
    }

    fn queued(&self) {}
}

/// Runs `launch` between `hooks`' `before` and `after` (`after` calls each
/// hook's): [`CudaStep::launch`]'s protocol, apart from CUDA so that it is
/// tested without a GPU.
fn around_launch(
    hooks: &[LaunchHook],
    launch: impl FnOnce() -> crate::Result<()>,
    mut after: impl FnMut(&dyn GraphLaunch, u64) -> crate::Result<()>,
) -> crate::Result<()> {
    let mut tokens: SmallVec<[u64; 8]> = SmallVec::with_capacity(hooks.len());
    for (k, h) in hooks.iter().enumerate() {
        match h.before() {
            Ok(t) => tokens.push(t),
            Err(e) => {
                hooks[k + 1..].iter().for_each(|h| h.skipped(&e));
                return Err(e);
            }
        }
    }
    if let Err(e) = launch() {
        hooks
            .iter()
            .zip(&tokens)
            .for_each(|(h, &t)| h.not_launched(t, &e));
        return Err(e);
    }
    let mut outcome = Ok(());
    for (h, t) in hooks.iter().zip(tokens) {
        let r = after(&**h, t);
        if outcome.is_ok() {
            outcome = r;
        }
    }
    outcome
}

fn fail(what: &str, e: &dyn std::fmt::Display) -> String {
    format!("{what}: {e}")
}

/// What the captures of one schedule share: a driver per stream its graphs
/// use, each with a cuBLAS handle made before any capture (making one, or
/// its cuBLASLt workspace, allocates, which a capture refuses). The caller
/// holds the runtime's lock and every task submitted so far has completed.
pub(crate) struct Capturer<'a> {
    cuda: &'a CudaBackend,
    drivers: Vec<Option<StreamDriver>>,
}

impl<'a> Capturer<'a> {
    /// Drivers with handles for `streams` (with repeats) of `cuda`'s
    /// `n` streams.
    pub(crate) fn new(
        cuda: &'a CudaBackend,
        n: usize,
        streams: impl IntoIterator<Item = usize>,
    ) -> Result<Self, String> {
        let mut drivers: Vec<Option<StreamDriver>> = (0..n).map(|_| None).collect();
        for s in streams {
            if drivers[s].is_none() {
                let d = cuda.driver(s);
                let h = crate::cuda::CublasHandle::new(&d.stream)
                    .map_err(|e| fail("creating a cuBLAS handle", &e))?;
                h.prepare_for_capture()
                    .map_err(|e| fail("making a cuBLASLt workspace", &e))?;
                // The workspace is allocated in stream order on `s`; the
                // graphs run it elsewhere: let the allocation complete.
                d.stream
                    .synchronize()
                    .map_err(|e| fail("synchronising a stream", &e))?;
                let _ = d.cublas.set(h);
                drivers[s] = Some(d);
            }
        }
        Ok(Capturer { cuda, drivers })
    }

    /// The handles, which the graphs' kernels use.
    pub(crate) fn into_handles(self) -> Vec<crate::cuda::CublasHandle> {
        self.drivers
            .into_iter()
            .flatten()
            .filter_map(|d| d.cublas.into_inner())
            .collect()
    }

    /// Captures `plan` (every task on a stream with a driver) into a graph
    /// on its join stream, with the launch hooks its bodies registered. An
    /// `Err` says why it is not a graph; nothing ran, and the streams are
    /// out of capture mode.
    pub(crate) fn capture(&self, plan: &Plan) -> Result<Captured, String> {
        let cuda = self.cuda;
        let origin = &cuda.streams[plan.join_stream];
        let capture = Capture::begin(origin).map_err(|e| fail("beginning the capture", &e))?;
        let event = |s: usize| -> Result<CudaEvent, String> {
            let ev = CudaEvent::new(&cuda.device, EventKind::Sync)
                .map_err(|e| fail("creating an event", &e))?;
            ev.record(&cuda.streams[s])
                .map_err(|e| fail("recording an event", &e))?;
            Ok(ev)
        };
        let wait = |s: usize, ev: &CudaEvent| {
            cuda.streams[s]
                .wait_event(ev)
                .map_err(|e| fail("waiting on an event", &e))
        };
        // `marks[k]` is mark `k` of `ops` (a `Wait` names it by that
        // number); the fork and join events live apart, kept until the
        // capture ends.
        let mut marks: Vec<CudaEvent> = Vec::new();
        let mut kept: Vec<CudaEvent> = Vec::new();
        let mut forked: Vec<usize> = Vec::new();
        let hooks = std::cell::RefCell::new(Vec::new());
        let mut outcome: Result<(), String> = Ok(());
        for op in ops(plan) {
            let r = match op {
                Op::Fork(s) => event(plan.join_stream).and_then(|ev| {
                    wait(s as usize, &ev)?;
                    forked.push(s as usize);
                    kept.push(ev);
                    Ok(())
                }),
                Op::Mark(s) => event(s as usize).map(|ev| marks.push(ev)),
                Op::Wait(s, k) => wait(s as usize, &marks[k as usize]),
                Op::Run(i) => run_captured(plan, i as usize, &self.drivers, &hooks),
                Op::Join(s) => event(s as usize).and_then(|ev| {
                    wait(plan.join_stream, &ev)?;
                    kept.push(ev);
                    Ok(())
                }),
            };
            if let Err(e) = r {
                outcome = Err(e);
                break;
            }
        }
        if let Err(e) = outcome {
            // Rejoin what was forked so the capture can end cleanly;
            // dropping it ends the capture and discards the graph.
            for &s in &forked {
                if let Ok(ev) = event(s) {
                    let _ = wait(plan.join_stream, &ev);
                }
            }
            drop(capture);
            return Err(e);
        }
        let graph = capture
            .finish()
            .map_err(|e| fail("ending the capture", &e))?;
        graph
            .upload(origin)
            .map_err(|e| fail("uploading the graph", &e))?;
        Ok((graph, hooks.into_inner()))
    }
}

/// Runs task `i`'s body on its stream's driver, capturing what it launches;
/// the launch hooks it registers go into `hooks`.
fn run_captured(
    plan: &Plan,
    i: usize,
    drivers: &[Option<StreamDriver>],
    hooks: &std::cell::RefCell<Vec<LaunchHook>>,
) -> Result<(), String> {
    let t = &plan.tasks[i];
    let d = drivers[t.stream as usize]
        .as_ref()
        .expect("a driver for every used stream");
    // SAFETY: every earlier call of this body has returned (the capture
    // runs after everything submitted completed, under the runtime's lock),
    // and the capture calls it once (`BodyCell`'s invariant).
    let body = unsafe { t.body.get() };
    let ctx = DeviceCtx::Cuda(d.capture_ctx(hooks));
    let (outcome, checks) = super::worker::call_body(&t.name, body, ctx);
    outcome.map_err(|e| format!("task `{}` failed while captured: {e}", t.name))?;
    if !checks.is_empty() {
        return Err(format!(
            "task `{}` registers a completion check, which a graph cannot run",
            t.name
        ));
    }
    Ok(())
}

/// What a graph replay runs.
#[derive(Clone)]
pub(crate) enum Unit {
    /// The CPU's sequential run of the plan.
    Cpu,
    /// The captured graph.
    Cuda(std::sync::Arc<CudaStep>),
}

/// Submits `plan` (a whole schedule or a part of one: `sched::split`) as one
/// task on its join stream; returns it. Runs under the runtime's lock, like
/// `replay::submit`. `fence`: the unit waits for everything submitted before
/// on every stream (the first graph replay: earlier replays ran the same
/// bodies on other streams). `after`: earlier parts of the same replay it
/// has an edge from.
pub(crate) fn submit(
    st: &mut SubmitState,
    shared: &Shared,
    plan: &std::sync::Arc<Plan>,
    unit: &Unit,
    fence: bool,
    after: &[Arc<TaskShared>],
) -> Arc<TaskShared> {
    let f = plan.join_stream;
    // A graph runs whole or not at all: any external predecessor that
    // fails skips it, whatever of its accesses met the graph's.
    let mut ext = super::replay::external_preds(st, shared, plan, &mut Vec::new());
    super::add_after(&mut ext, after);
    let mut waits = cross_waits(&mut st.clocks[f], f, &ext, &mut st.stats);
    if fence {
        super::replay::fence(&mut st.clocks[f], f, &st.placed, &mut waits);
    }
    st.stats.waits += waits.len() as u64;
    st.placed[f] += 1;
    st.clocks[f][f] = st.placed[f];
    super::live::placed(shared, f, st.placed[f]);
    let id_base = st.next_id;
    st.next_id += plan.steps();
    let external: SmallVec<[Arc<TaskShared>; 4]> = ext.drain(..).collect();
    st.preds = ext;
    let task = super::replay::unit_record(st, plan, id_base, TaskKind::Compute);
    shared
        .submitted
        .fetch_add(1, crate::sync::Ordering::Relaxed);
    // On CUDA the unit's waits and predecessors go into its launch; on the
    // CPU into the sequential run.
    let item = match unit {
        Unit::Cuda(step) => Item::Task(
            task.clone(),
            Launch {
                waits,
                preds: external,
                wait_only: 0,
                accesses: SmallVec::new(),
                body: TaskBody::Graph(step.clone()),
                comm_hook: step.comm_hook(),
            },
        ),
        Unit::Cpu => {
            let mut entry = vec![SmallVec::new(); shared.streams.len()];
            entry[f] = waits;
            Item::Program(Arc::new(Run {
                plan: plan.clone(),
                base: SmallVec::new(),
                id_base,
                entry,
                external,
                regions: Vec::new(),
                status: (0..plan.len())
                    .map(|_| AtomicU8::new(super::PENDING))
                    .collect(),
                any_failed: crate::sync::AtomicBool::new(false),
                root: std::sync::OnceLock::new(),
                unit: task.clone(),
                ends: Vec::new(),
                measure: false,
                sequential: true,
            }))
        }
    };
    shared.streams[f].queue.push(item);
    task
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::sched::replay::RecTask;
    use std::collections::HashSet;

    /// A recorded task on `stream` after `preds`.
    fn task(stream: u16, preds: &[u32]) -> RecTask {
        crate::sched::replay::tests::task(stream, preds, 1)
    }

    /// The capture's beginning, as a node.
    const START: u32 = u32::MAX;

    /// Interprets `ops` as stream capture does: a node per `Run`, each after
    /// what its stream had reached (its earlier nodes and the marks it
    /// waited for). Returns each task's node predecessors and the
    /// predecessors of the capture's end (what the origin reached).
    fn interpret(plan: &Plan, ops: &[Op]) -> (Vec<HashSet<u32>>, HashSet<u32>) {
        let f = plan.join_stream;
        let n = plan.programs.len();
        let mut reached: Vec<Option<HashSet<u32>>> = vec![None; n];
        reached[f] = Some(HashSet::from([START]));
        let mut marks: Vec<HashSet<u32>> = Vec::new();
        let mut before: Vec<HashSet<u32>> = vec![HashSet::new(); plan.len()];
        for &op in ops {
            match op {
                Op::Fork(s) => {
                    assert!(reached[s as usize].is_none(), "forked twice");
                    reached[s as usize] = reached[f].clone();
                }
                Op::Run(i) => {
                    let s = plan.tasks[i as usize].stream as usize;
                    let r = reached[s].as_mut().expect("a stream in the capture");
                    before[i as usize] = std::mem::replace(r, HashSet::from([i]));
                }
                Op::Mark(s) => marks.push(reached[s as usize].clone().expect("captured")),
                Op::Wait(s, k) => {
                    let m = marks[k as usize].clone();
                    reached[s as usize].as_mut().expect("captured").extend(m);
                }
                Op::Join(s) => {
                    let r = reached[s as usize].take().expect("joined once");
                    reached[f].as_mut().unwrap().extend(r);
                }
            }
        }
        assert!(
            reached
                .iter()
                .enumerate()
                .all(|(s, r)| r.is_some() == (s == f)),
            "every forked stream rejoined"
        );
        (before, reached[f].take().unwrap())
    }

    /// Whether node `a` comes before node `b` in the captured graph.
    fn precedes(before: &[HashSet<u32>], a: u32, b: u32) -> bool {
        let mut todo = vec![b];
        let mut seen = HashSet::new();
        while let Some(x) = todo.pop() {
            if x == START || !seen.insert(x) {
                continue;
            }
            if before[x as usize].contains(&a) {
                return true;
            }
            todo.extend(before[x as usize].iter().copied());
        }
        false
    }

    fn check(plan: &Plan) {
        let ops = ops(plan);
        let runs: Vec<u32> = ops
            .iter()
            .filter_map(|o| match o {
                Op::Run(i) => Some(*i),
                _ => None,
            })
            .collect();
        assert_eq!(runs, (0..plan.len() as u32).collect::<Vec<_>>());
        let (before, end) = interpret(plan, &ops);
        for (i, t) in plan.tasks.iter().enumerate() {
            for &p in &t.preds {
                assert!(precedes(&before, p, i as u32), "edge {p} -> {i} lost");
            }
            let i = i as u32;
            let ends_after = end.contains(&i) || end.iter().any(|&e| precedes(&before, i, e));
            assert!(ends_after, "task {i} not before the end");
        }
    }

    #[test]
    fn a_capture_keeps_every_edge_and_ends_after_every_task() {
        // A diamond over three streams, a chain, and an unused stream.
        let p = Plan::new(
            "p".into(),
            vec![
                task(0, &[]),
                task(1, &[0]),
                task(2, &[0]),
                task(0, &[1, 2]),
                task(1, &[]),
            ],
            4,
        );
        check(&p);
        let o = ops(&p);
        // The origin is the last task's stream; the others fork and join.
        assert_eq!(p.join_stream, 1);
        assert_eq!(&o[..2], &[Op::Fork(0), Op::Fork(2)]);
        assert_eq!(&o[o.len() - 2..], &[Op::Join(0), Op::Join(2)]);
        // One stream: no forks, joins, marks or waits.
        let p = Plan::new("c".into(), vec![task(0, &[]), task(0, &[0])], 2);
        assert_eq!(ops(&p), vec![Op::Run(0), Op::Run(1)]);
    }

    /// A launch hook that notes what happens to it in `log`, and whose
    /// `before` fails when asked.
    struct Noting {
        k: u64,
        fails: bool,
        log: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
    }

    impl GraphLaunch for Noting {
        fn before(&self) -> crate::Result<u64> {
            self.log.lock().unwrap().push(format!("before {}", self.k));
            match self.fails {
                true => Err(crate::Error::Config(format!("hook {} fails", self.k))),
                false => Ok(10 + self.k),
            }
        }
        fn after(&self, _: u64, _: &crate::CudaTaskCtx<'_>) -> crate::Result<()> {
            unreachable!("the tests pass `after` as a closure")
        }
        fn skipped(&self, _: &crate::Error) {
            self.log.lock().unwrap().push(format!("skipped {}", self.k));
        }
        fn not_launched(&self, t: u64, _: &crate::Error) {
            self.log.lock().unwrap().push(format!("not launched {t}"));
        }
    }

    #[test]
    fn launch_hooks_run_before_and_after_the_launch_or_are_skipped() {
        type Log = std::sync::Arc<std::sync::Mutex<Vec<String>>>;
        let hooks = |fails: &[bool], log: &Log| -> Vec<LaunchHook> {
            fails
                .iter()
                .enumerate()
                .map(|(k, &fails)| {
                    let h = Noting {
                        k: k as u64,
                        fails,
                        log: log.clone(),
                    };
                    std::sync::Arc::new(h) as LaunchHook
                })
                .collect()
        };
        // `after` fails for token 11 (hook 1) and 12 (hook 2).
        let run = |fails: &[bool], launch_fails: bool| {
            let log: Log = Default::default();
            let hs = hooks(fails, &log);
            let r = around_launch(
                &hs,
                || {
                    log.lock().unwrap().push("launch".into());
                    match launch_fails {
                        true => Err(crate::Error::Config("launch fails".into())),
                        false => Ok(()),
                    }
                },
                |_, t| {
                    log.lock().unwrap().push(format!("after {t}"));
                    match t {
                        11 | 12 => Err(crate::Error::Config(format!("after {t} fails"))),
                        _ => Ok(()),
                    }
                },
            );
            let log = log.lock().unwrap().clone();
            (r.err().map(|e| e.to_string()), log.join(", "))
        };
        // Every `before`, the launch, every `after`; the first error wins.
        let (e, log) = run(&[false; 3], false);
        assert_eq!(
            log,
            "before 0, before 1, before 2, launch, after 10, after 11, after 12"
        );
        assert!(e.unwrap().contains("after 11 fails"));
        // A failing `before`: no launch, the hooks after it skipped.
        let (e, log) = run(&[false, true, false], false);
        assert_eq!(log, "before 0, before 1, skipped 2");
        assert!(e.unwrap().contains("hook 1 fails"));
        // A failing launch: every hook told so with its token, no `after`.
        let (e, log) = run(&[false, false], true);
        assert_eq!(
            log,
            "before 0, before 1, launch, not launched 10, not launched 11"
        );
        assert!(e.unwrap().contains("launch fails"));
        // No hooks: the launch alone.
        assert_eq!(run(&[], false), (None, "launch".to_string()));
    }

    #[test]
    fn random_plans_capture_every_edge() {
        let plans = crate::sched::replay::tests::random_schedules(0x9e37_79b9_7f4a_7c15, 5, |_| {
            TaskKind::Compute
        });
        for (streams, tasks) in plans {
            check(&Plan::new("r".into(), tasks, streams));
        }
    }
}

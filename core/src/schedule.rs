//! Record once, replay: [`Runtime::record`] and [`Schedule`]. The design is
//! in docs/replay.md; the scheduling side in
//! `sched/replay.rs`.

use crate::buffer::AsView;
use crate::error::{Error, Result};
use crate::sched::replay::{How, Plan};
use crate::sched::trial::{Trial, TrialOutcome, TrialPlacement};
use crate::{Runtime, TaskHandle};
use std::borrow::Cow;
use std::fmt;
use std::sync::{Arc, Mutex};

/// A recorded program step: the tasks one call of [`Runtime::record`]
/// submitted, with their streams and the cross-stream waits between them,
/// resolved once. [`Schedule::replay`] runs the same tasks again — the same
/// bodies on the same data — with no dependency inference and no placement.
///
/// A replay is equivalent, bit for bit, to submitting the same tasks again,
/// and composes with ordinary submissions before and after it: the engine
/// sees a replay as one unit with the union of its tasks' accesses, so it
/// waits for earlier tasks that touch what the schedule touches, and later
/// tasks that touch it wait for it. On the CPU, a replay that uses several
/// streams is one unit per stream to later tasks: a task that touches only
/// what the replay's tasks on one stream touched waits for those tasks, not
/// for the whole replay (docs/replay.md, "Finer units").
///
/// Values that change from step to step live in buffers the tasks read;
/// [`Schedule::replay_with`] writes such a block and replays.
pub struct Schedule<'rt> {
    rt: &'rt Runtime,
    /// The current plan; replaced once, from measured durations (CPU).
    plan: Mutex<Arc<Plan>>,
    /// Whether the plan has been re-placed (or never will be).
    settled: std::sync::atomic::AtomicBool,
    /// What the ranks of a group agreed to place the plan from
    /// (`BoundComm::agree_placement`); used by the next replay.
    agreed: Mutex<Option<Agreement>>,
    /// Graph replay ([`crate::RuntimeBuilder::graphs`]): not tried yet, the
    /// unit to launch, or why the schedule is not a graph.
    graph: Mutex<GraphSlot>,
    /// The placement trial ([`crate::RuntimeBuilder::placement_trial`]), or
    /// `None` for a schedule without one.
    trial: Mutex<Option<PlacementTrial>>,
    /// The recorded collectives' hooks, each told when a replay queues it
    /// (its communicator counts it as issued; see [`Schedule::replay`]).
    collectives: Vec<crate::ctx::CommHook>,
}

/// A schedule's placement trial: its bookkeeping, the placement `plan` and
/// `graph` hold now, and the plan and graph slot of the other one (dropped
/// once the trial has decided against it).
struct PlacementTrial {
    trial: Trial,
    current: TrialPlacement,
    other: Option<(Arc<Plan>, GraphSlot)>,
}

/// What the ranks of a group agreed on for re-placing one schedule.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Agreement {
    /// Place from these durations (by task index) on this many compute
    /// streams: the same inputs, so the same plan, on every rank.
    Place { dur: Vec<u64>, compute: usize },
    /// Some rank cannot re-place (not every task measured, or its schedule
    /// already settled): every rank keeps the recording's placement.
    Keep,
}

/// A schedule's graph, once its first replay has tried to make one.
pub(crate) enum GraphSlot {
    Untried,
    Ready(Arc<crate::sched::split::Split<crate::sched::capture::Unit>>),
    Refused(String),
}

impl fmt::Debug for Schedule<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let plan = self.plan();
        f.debug_struct("Schedule")
            .field("name", &plan.name)
            .field("tasks", &plan.len())
            .finish()
    }
}

impl Runtime {
    /// Runs `program` — which submits tasks as usual, and may synchronise —
    /// and records every task submitted to this runtime while it runs, by
    /// any thread: a task another thread (a data loader) submits meanwhile
    /// is recorded too, and every replay runs it again, so submit such work
    /// to another runtime or outside the recording. Record from one thread
    /// at a time. The tasks run now, as
    /// ordinary tasks: the recording is the schedule's first run. Their
    /// bodies are kept, so they must be callable again (`FnMut`).
    ///
    /// The schedule's edges are every dependency among the recorded tasks
    /// (including those on tasks already finished when their dependent was
    /// submitted) and explicit `after` edges among them; dependencies on
    /// tasks submitted before the recording are found again at each replay.
    ///
    /// Every task submitted while the recording is on is recorded, from any
    /// thread: [`Runtime::upload`] too (each replay copies the data the
    /// recording's upload was given; values that change from replay to
    /// replay go through [`Schedule::replay_with`] or an upload before the
    /// replay). [`Runtime::read_vec`] is refused while a recording is on.
    ///
    /// Errors: a recording already in progress (`Error::Usage`), or the
    /// error `program` returns (the tasks it submitted still run).
    pub fn record(
        &self,
        name: impl Into<Cow<'static, str>>,
        program: impl FnOnce(&Runtime) -> Result<()>,
    ) -> Result<Schedule<'_>> {
        /// Stops the recording if `program` panics.
        struct Stop<'a>(&'a Runtime, bool);
        impl Drop for Stop<'_> {
            fn drop(&mut self) {
                if self.1 {
                    self.0.stop_recording();
                }
            }
        }
        self.start_recording()?;
        let mut stop = Stop(self, true);
        let outcome = program(self);
        stop.1 = false;
        let recorder = self.stop_recording();
        outcome?;
        let recorder = recorder
            .ok_or_else(|| Error::Usage("the recording was stopped by someone else".into()))?;
        let mut plan = Plan::new(name.into(), recorder.into_tasks(), self.streams());
        plan.usable = self.usable_compute_streams() as u16;
        // Re-placement from durations measured on the host: CPU programs only
        // (a CUDA body's host time is its launch, not its kernels).
        // A graph keeps the recording's placement (a capture is made once).
        let settled = self.replays_materialised() || !self.config_replace() || self.config_graphs();
        // Whether streams beat one stream is measured where a replay is one
        // unit (CUDA): the other placement is made now, captured when tried.
        let trial = (self.config_placement_trial() && plan.spread()).then(|| PlacementTrial {
            trial: Trial::new(),
            current: TrialPlacement::Recorded,
            other: Some((Arc::new(plan.movable_on_first_stream()), GraphSlot::Untried)),
        });
        let collectives = plan
            .tasks
            .iter()
            .filter_map(|t| t.comm_hook.clone())
            .collect();
        Ok(Schedule {
            rt: self,
            collectives,
            plan: Mutex::new(Arc::new(plan)),
            settled: settled.into(),
            agreed: Mutex::new(None),
            graph: Mutex::new(GraphSlot::Untried),
            trial: Mutex::new(trial),
        })
    }
}

impl<'rt> Schedule<'rt> {
    /// Runs the schedule again. Returns at once with the handle of the
    /// replay's end: waiting on it waits for every task of the replay, and
    /// fails with [`Error::DependencyFailed`] naming the first task that
    /// failed (the failure itself is reported, once, at the next
    /// synchronisation point, like any task's). Tasks that depend on a failed
    /// task are skipped; later replays and tasks run as usual.
    ///
    /// On the CPU backend, once every recorded task has a measured duration,
    /// the schedule is placed again by earliest finish time (a cost model:
    /// short tasks gather on one stream, long independent ones spread out);
    /// the first replay of the new placement waits for everything submitted
    /// before it. Results do not depend on placement. The ranks of a group
    /// each measure their own durations and so could place differently;
    /// `BoundComm::agree_placement` makes them place alike.
    ///
    /// With a placement trial ([`crate::RuntimeBuilder::placement_trial`],
    /// on CUDA by default) the first replays of a schedule spread over
    /// several streams alternate between its placement and one stream, and
    /// each returns once it has completed; the faster placement is kept
    /// ([`placement_trial`](Self::placement_trial)).
    pub fn replay(&self) -> Result<TaskHandle> {
        let (timed, switched) = self.trial_begin();
        let h = self.replay_placed(switched)?;
        // Queued: issued, as a submitted collective is, before it runs (a
        // rank that returns now leaves after them, not before).
        for c in &self.collectives {
            c.queued();
        }
        if timed && h.wait_unreported() {
            self.trial_completed(crate::clock::now_ns());
        }
        Ok(h)
    }

    /// What this schedule's placement trial measured and kept, once it has
    /// decided; `None` before, or for a schedule without a trial (the CPU's
    /// per-stream programs, trials off, or a placement on one stream
    /// already).
    pub fn placement_trial(&self) -> Option<TrialOutcome> {
        let t = self.trial.lock().unwrap_or_else(|e| e.into_inner());
        t.as_ref().and_then(|t| t.trial.outcome())
    }

    /// Before a replay: puts in place the placement the trial gives it.
    /// Returns (whether the replay is timed, whether the placement changed).
    fn trial_begin(&self) -> (bool, bool) {
        let mut t = self.trial.lock().unwrap_or_else(|e| e.into_inner());
        let Some(t) = t.as_mut() else {
            return (false, false);
        };
        let want = t.trial.placement();
        let switched = want != t.current;
        if switched {
            if let Some((plan, graph)) = t.other.as_mut() {
                std::mem::swap(
                    &mut *self.plan.lock().unwrap_or_else(|e| e.into_inner()),
                    plan,
                );
                std::mem::swap(
                    &mut *self.graph.lock().unwrap_or_else(|e| e.into_inner()),
                    graph,
                );
                t.current = want;
            }
        }
        if !t.trial.running() {
            // Decided, and the kept placement in place: the other's graph
            // goes (its last replay has completed).
            t.other = None;
        }
        (t.trial.running(), switched)
    }

    /// A timed replay of the trial completed at `at_ns`.
    fn trial_completed(&self, at_ns: u64) {
        let mut t = self.trial.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(t) = t.as_mut() {
            t.trial.completed(at_ns);
        }
    }

    /// [`replay`](Self::replay) with the current placement; `switched`: it
    /// has just changed, so the replay waits for everything before it.
    fn replay_placed(&self, switched: bool) -> Result<TaskHandle> {
        use std::sync::atomic::Ordering::{Acquire, Release};
        if self.rt.config_graphs() {
            if let Some(h) = self.rt.submit_graph_replay(&self.plan(), &self.graph)? {
                return Ok(h);
            }
        }
        let mut how = How {
            materialise: self.rt.replays_materialised(),
            fence: switched,
            measure: false,
        };
        // The plan stays locked until the replay is submitted: two threads
        // replaying one schedule submit in turn, each with the plan current
        // then, so a replay after a re-placement never runs the old plan
        // beside the new one (a recorded body is called by one thread at a
        // time: `BodyCell`'s invariant).
        let mut plan = self.plan.lock().unwrap_or_else(|e| e.into_inner());
        if !self.settled.load(Acquire) {
            how.measure = true;
            let agreed = self.agreed.lock().unwrap_or_else(|e| e.into_inner()).take();
            let handoff = crate::sched::cost::HANDOFF_NS;
            let new = match agreed {
                // Agreed inputs start from one recorded placement on
                // every rank too (ties keep a task's recorded stream).
                Some(Agreement::Place { dur, compute }) => Some(
                    plan.movable_on_first_stream()
                        .replaced(&dur, compute, handoff),
                ),
                Some(Agreement::Keep) => {
                    self.settled.store(true, Release);
                    None
                }
                None => plan
                    .measured()
                    .map(|dur| plan.replaced(&dur, self.rt.usable_compute_streams(), handoff)),
            };
            if let Some(p) = new {
                *plan = Arc::new(p);
                self.settled.store(true, Release);
                how.fence = true;
            }
        }
        self.rt.submit_replay(&plan, how)
    }

    /// What this rank brings to a placement agreement: each task's measured
    /// duration and its usable compute streams, or `None` when it will not
    /// re-place (already settled, or not every task measured yet).
    pub(crate) fn placement_inputs(&self) -> Option<(Vec<u64>, usize)> {
        if self.settled.load(std::sync::atomic::Ordering::Acquire) {
            return None;
        }
        let dur = self.plan().measured()?;
        Some((dur, self.rt.usable_compute_streams()))
    }

    /// Sets what the next replay re-places from (see `placement_inputs`).
    pub(crate) fn set_agreement(&self, a: Agreement) {
        *self.agreed.lock().unwrap_or_else(|e| e.into_inner()) = Some(a);
    }

    fn plan(&self) -> Arc<Plan> {
        self.plan.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Whether the schedule has been placed again from measured durations.
    #[doc(hidden)]
    pub fn replaced(&self) -> bool {
        self.settled.load(std::sync::atomic::Ordering::Acquire)
            && !self.rt.replays_materialised()
            && self.rt.config_replace()
    }

    /// Copies `args` into `block` (an ordinary task, which the replay's tasks
    /// that read `block` wait for), then replays: the per-replay argument
    /// block for values that change from step to step (step number, learning
    /// rate, data offsets).
    pub fn replay_with<T: bytemuck::Pod>(
        &self,
        block: impl AsView,
        args: &[T],
    ) -> Result<TaskHandle> {
        self.rt.upload(block, args)?;
        self.replay()
    }

    /// Why this schedule does not replay as a graph, once a replay has
    /// tried ([`crate::RuntimeBuilder::graphs`]): no task of it can be
    /// captured (all are collectives or host work), or what failed during
    /// its capture. `None` while untried, when it is a graph, or with graphs
    /// off.
    pub fn graph_refusal(&self) -> Option<String> {
        match &*self.graph.lock().unwrap_or_else(|e| e.into_inner()) {
            GraphSlot::Refused(why) => Some(why.clone()),
            GraphSlot::Untried | GraphSlot::Ready(_) => None,
        }
    }

    /// How a graph replay runs this schedule, once a replay has made it a
    /// graph: `(graphs, tasks outside them)` per replay. A schedule with
    /// collectives or host tasks is cut around them (docs/replay.md): each
    /// run of other tasks between them is one graph, and they run as
    /// ordinary tasks. `None` while untried, when refused, or with graphs
    /// off.
    pub fn graph_shape(&self) -> Option<(usize, usize)> {
        match &*self.graph.lock().unwrap_or_else(|e| e.into_inner()) {
            GraphSlot::Ready(split) => Some(split.shape()),
            GraphSlot::Untried | GraphSlot::Refused(_) => None,
        }
    }

    /// Why this schedule's collectives are not inside its graphs although
    /// [`crate::RuntimeBuilder::graph_collectives`] asked for it, once a
    /// replay has made it a graph: the capture with them failed (a
    /// communicator that cannot be captured, say), and the graphs were cut
    /// around them instead ([`Schedule::graph_shape`] shows the cut).
    /// `None` when they are inside, or were never asked in.
    pub fn graph_collectives_left_out(&self) -> Option<String> {
        match &*self.graph.lock().unwrap_or_else(|e| e.into_inner()) {
            GraphSlot::Ready(split) => split.collectives_left_out.clone(),
            GraphSlot::Untried | GraphSlot::Refused(_) => None,
        }
    }

    /// The schedule's name.
    pub fn name(&self) -> String {
        self.plan().name.to_string()
    }

    /// Number of recorded tasks.
    pub fn len(&self) -> usize {
        self.plan().len()
    }

    /// Whether no task was recorded.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// How the current placement uses the streams: `(streams with work,
    /// cross-stream waits per replay)`.
    pub fn placement(&self) -> (usize, usize) {
        self.plan().shape()
    }

    /// The recorded tasks' names and streams, in the order the current plan
    /// runs them (a re-placement may reorder them; for tests and tools).
    #[doc(hidden)]
    pub fn task_order(&self) -> Vec<(String, usize)> {
        let plan = self.plan();
        plan.tasks
            .iter()
            .map(|t| (t.name.to_string(), t.stream as usize))
            .collect()
    }

    /// The runtime the schedule replays on.
    pub fn runtime(&self) -> &'rt Runtime {
        self.rt
    }
}

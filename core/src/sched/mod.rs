//! Submission, placement and the stream threads. The protocol is in README.md
//! beside this file.

pub(crate) mod auto;
pub(crate) mod capture;
pub(crate) mod cost;
pub(crate) mod gate;
pub(crate) mod live;
pub(crate) mod placement;
pub(crate) mod queue;
pub(crate) mod replay;
pub(crate) mod scoped;
pub(crate) mod split;
pub(crate) mod tenants;
pub(crate) mod trial;
mod worker;

#[cfg(all(test, loom))]
mod loom_tests;

use crate::buffer::Dropped;
use crate::ctx::{Access, Body, CommHook, SharedBody};
use crate::error::{Error, Result};
use crate::graph::{TaskRef, Tracker};
use crate::kind::PlaceReason;
use crate::kind::TaskKind;
use crate::sync::{lock, Arc, AtomicU64, AtomicU8, Mutex, Ordering};
use crate::trace::Span;
use gate::Gate;
use placement::{Place, Request, Timing};
use queue::Queue;
use smallvec::SmallVec;
use std::borrow::Cow;
use std::cell::Cell;
use std::fmt;
use std::sync::OnceLock;

pub(crate) use worker::{panic_message, spawn as spawn_worker};

const PENDING: u8 = 0;
const OK: u8 = 1;
const FAILED: u8 = 2;
const SKIPPED: u8 = 3;

/// A vector clock: entry `j` is the highest sequence number of stream `j`
/// known to be complete before the point it describes.
pub(crate) type Clock = SmallVec<[u64; 8]>;

/// The part of a task every thread may look at.
pub(crate) struct TaskShared {
    /// Global submission index (the specification's order).
    pub(crate) id: u64,
    pub(crate) name: Cow<'static, str>,
    /// The scope it was submitted in (copied into its span).
    pub(crate) scope: Option<std::sync::Arc<str>>,
    pub(crate) kind: TaskKind,
    pub(crate) stream: u16,
    /// Why it went to `stream` (copied into its span).
    pub(crate) placement: crate::kind::Placement,
    /// Position in its stream's FIFO, from 1.
    pub(crate) seq: u64,
    /// The stream's vector clock right after this task: what its completion
    /// implies. Written before the task is published, then only read.
    pub(crate) clock: Clock,
    /// Predicted finish (ns, process clock) from the cost model; 0 when the
    /// runtime makes no predictions (CUDA, replays).
    pub(crate) eft: u64,
    /// Its name's duration-estimate slot ([`cost::NO_SLOT`]: not measured).
    pub(crate) cost: u32,
    status: AtomicU8,
    error: OnceLock<Error>,
    /// CUDA: the event recorded after the task's work on its stream; other
    /// streams wait on it. Set by the launching stream thread before it
    /// advances its `launched` gate.
    pub(crate) event: OnceLock<crate::cuda::CudaEvent>,
}

impl std::fmt::Debug for TaskShared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Task#{}({})", self.id, self.name)
    }
}

/// What a new task record is made of (the rest starts pending and empty).
pub(crate) struct Record {
    pub(crate) id: u64,
    pub(crate) name: Cow<'static, str>,
    pub(crate) scope: Option<std::sync::Arc<str>>,
    pub(crate) kind: TaskKind,
    pub(crate) stream: usize,
    pub(crate) seq: u64,
    pub(crate) clock: Clock,
    pub(crate) placement: crate::kind::Placement,
    pub(crate) eft: u64,
    pub(crate) cost: u32,
}

/// The status an outcome publishes: `OK`, `SKIPPED` for a dependency that
/// failed, else `FAILED`.
pub(crate) fn status_of(outcome: &Result<(), Error>) -> u8 {
    match outcome {
        Ok(()) => OK,
        Err(Error::DependencyFailed { .. }) => SKIPPED,
        Err(_) => FAILED,
    }
}

impl TaskShared {
    /// A pending task record.
    pub(crate) fn new(r: Record) -> Arc<TaskShared> {
        Arc::new(TaskShared {
            id: r.id,
            name: r.name,
            scope: r.scope,
            kind: r.kind,
            stream: r.stream as u16,
            seq: r.seq,
            clock: r.clock,
            eft: r.eft,
            cost: r.cost,
            placement: r.placement,
            status: AtomicU8::new(PENDING),
            error: OnceLock::new(),
            event: OnceLock::new(),
        })
    }

    pub(crate) fn is_finished(&self) -> bool {
        self.status.load(Ordering::Acquire) != PENDING
    }

    pub(crate) fn failed(&self) -> bool {
        self.status.load(Ordering::Acquire) >= FAILED
    }

    pub(crate) fn finish(&self, outcome: Result<(), Error>) {
        let st = status_of(&outcome);
        if let Err(e) = outcome {
            let _ = self.error.set(e);
        }
        self.status.store(st, Ordering::Release);
    }

    /// The error a failed task's failure comes from: the root of the one
    /// it was skipped for, else its own.
    pub(crate) fn root_error(&self) -> Option<Box<Error>> {
        match self.error.get()? {
            Error::DependencyFailed { root, .. } => root.clone(),
            e => Some(Box::new(e.clone())),
        }
    }

    /// The task a failed task's failure comes from: the cause it was
    /// skipped for, else its own name.
    pub(crate) fn root_cause(&self) -> String {
        match self.error.get() {
            Some(Error::DependencyFailed { cause, .. }) => cause.clone(),
            _ => self.name.to_string(),
        }
    }

    fn outcome(&self) -> Result<()> {
        match self.status.load(Ordering::Acquire) {
            OK => Ok(()),
            PENDING => unreachable!("outcome of an unfinished task"),
            _ => Err(self
                .error
                .get()
                .cloned()
                .unwrap_or_else(|| Error::TaskFailed {
                    task: self.name.to_string(),
                    message: "unknown failure".into(),
                })),
        }
    }
}

impl TaskRef for Arc<TaskShared> {
    fn id(&self) -> u64 {
        self.id
    }
    fn retired(&self) -> bool {
        self.status.load(Ordering::Acquire) == OK
    }
}

/// What a stream thread needs to run a task, besides its identity: the
/// waits it must issue first, its predecessors and its body. Travels in the
/// stream's queue beside the task record (not inside it: the record is
/// shared with the tracker and the handles, the launch is the stream
/// thread's alone, and a smaller record is fewer cache lines crossing
/// between the submitting thread and the stream thread).
pub(crate) struct Launch {
    /// Cross-stream waits `(stream, seq)` not already implied by earlier waits.
    pub(crate) waits: SmallVec<[(u16, u64); 4]>,
    /// Unfinished predecessors (a failed one means this task is skipped),
    /// then the last `wait_only` of them, which are not: tasks `waits` names
    /// (on CUDA their events are found here) whose failures are not this
    /// task's (a materialised replay's external predecessors that its step
    /// does not meet: `replay::push_tasks`).
    pub(crate) preds: SmallVec<[Arc<TaskShared>; 4]>,
    /// How many of `preds`, at its end, are only waited for (0 but in a
    /// materialised replay; a count, not a list, to keep `Launch` small):
    /// [`skip_on`] gives the others.
    pub(crate) wait_only: u32,
    pub(crate) accesses: SmallVec<[Access; 4]>,
    pub(crate) body: TaskBody,
    /// Called when the task is skipped because a predecessor failed.
    pub(crate) comm_hook: Option<CommHook>,
}

/// The predecessors of a launch whose failure skips its task: `preds`
/// without its last `wait_only` (`Launch::wait_only`).
pub(crate) fn skip_on(preds: &[Arc<TaskShared>], wait_only: u32) -> &[Arc<TaskShared>] {
    &preds[..preds.len() - wait_only as usize]
}

/// A task's body as its stream thread gets it.
pub(crate) enum TaskBody {
    /// Runs once (an eager task).
    Once(Body),
    /// Owned by a recorded schedule and run again on every replay.
    Shared(SharedBody),
    /// The end of a replay: no body, only its waits and predecessors.
    Join,
    /// A whole replay captured as a CUDA graph, launched at once.
    Graph(std::sync::Arc<capture::CudaStep>),
}

/// What a stream's queue carries: one task with its launch, or a stream's
/// share of a replay (its whole precomputed program, run by the CPU stream
/// thread in a loop).
#[allow(clippy::large_enum_variant)] // boxing the launch would cost an allocation per task; the queue's slots are reused
pub(crate) enum Item {
    Task(Arc<TaskShared>, Launch),
    Program(Arc<replay::Run>),
}

/// Per-stream state shared with its thread.
pub(crate) struct StreamShared {
    pub(crate) name: String,
    pub(crate) is_comm: bool,
    /// Sequence number of the last completed task.
    pub(crate) done: Gate,
    /// Sequence number of the last launched task (CUDA: its end event is
    /// recorded; on the CPU launch and completion coincide, and only `done`
    /// is used).
    pub(crate) launched: Gate,
    pub(crate) queue: Queue<Item>,
    /// Spans recorded by this stream's thread (only it pushes; uncontended).
    pub(crate) spans: Mutex<Vec<Span>>,
    /// How many spans `clear_profile` has removed from `spans` so far
    /// (changed and read under its lock): a live-view client's position
    /// counts from the first span ever recorded, so a clear between two of
    /// its frames does not skip the spans recorded after it.
    pub(crate) spans_cleared: AtomicU64,
    /// Sequence number of the last task placed on the stream: a mirror of
    /// the submitter's count, kept only while a live view is attached (it
    /// reads the queue depth from it).
    pub(crate) placed: AtomicU64,
    /// The task the stream's thread is running, kept only for the live view
    /// ([`Shared::live`]).
    pub(crate) running: Mutex<Option<crate::trace::live::Running>>,
    /// The sequence number of the last task its submitter chose to run
    /// inline ([`run_inline`]; 0: none yet): the stream's thread waits for
    /// `done` to reach it before it runs anything else. Written under the
    /// runtime's lock before any later task of the stream is queued.
    pub(crate) inline: AtomicU64,
}

/// State shared by the runtime handle and its stream threads.
pub(crate) struct Shared {
    pub(crate) runtime_id: u64,
    pub(crate) rank: usize,
    pub(crate) streams: Vec<StreamShared>,
    /// Number of tasks completed on any stream.
    pub(crate) completed: Gate,
    /// Number of tasks submitted.
    pub(crate) submitted: AtomicU64,
    /// Failures not yet reported at a synchronisation point: (task id, error).
    pub(crate) errors: Mutex<Vec<(u64, Error)>>,
    pub(crate) dropped: Arc<Dropped>,
    pub(crate) profiling: bool,
    /// The program's priority class among the process's runtimes.
    pub(crate) class: crate::kind::Class,
    /// A best-effort CUDA stream's launch window, ns
    /// (`RuntimeBuilder::device_bundle`, `tenants::DeviceBundle`).
    pub(crate) device_bundle_ns: u64,
    /// Latency-critical threads ask for a real-time policy
    /// (`RuntimeBuilder::realtime`).
    pub(crate) realtime: bool,
    /// Pin the stream threads (`RuntimeBuilder::pin_threads`).
    pub(crate) pin_threads: bool,
    /// A live view is attached (`RuntimeBuilder::live`): stream threads
    /// publish the task they run, and busy periods are timed.
    pub(crate) live: bool,
    /// Profiling: whether the runtime is busy, and its busy periods.
    pub(crate) busy: Mutex<live::Busy>,
    /// CPU stream threads measure bodies into `estimates` and submission
    /// places by earliest finish time once a name is measured (`cost.rs`).
    pub(crate) measure: bool,
    /// Short tasks may run on the submitting thread
    /// (`RuntimeBuilder::inline_short_tasks`; CPU, not best-effort).
    pub(crate) inline: bool,
    pub(crate) estimates: cost::Estimates,
}

thread_local! {
    /// The runtime whose task this thread is running, if any.
    static IN_TASK_OF: Cell<u64> = const { Cell::new(0) };
}

impl Shared {
    /// Blocks until `t` has finished, whatever its outcome; an error (named
    /// `what`) from inside a task of this runtime, or of a latency-critical
    /// one when this runtime is best-effort, which could deadlock.
    fn wait_finished(&self, t: &TaskShared, what: &'static str) -> Result<()> {
        // Refused inside a task even when `t` has finished: whether it has
        // is timing, and an error that depends on it would come and go.
        self.check_may_wait(what)?;
        tenants::program_thread(self);
        self.streams[t.stream as usize].done.wait_at_least(t.seq);
        Ok(())
    }

    pub(crate) fn check_not_in_task(&self, what: &'static str) -> Result<()> {
        if IN_TASK_OF.with(Cell::get) == self.runtime_id {
            return Err(Error::WaitInsideTask { what });
        }
        Ok(())
    }

    /// [`check_not_in_task`](Self::check_not_in_task), and for a best-effort
    /// runtime an error (named `what`) on a thread running a task of a
    /// latency-critical runtime: admission holds this runtime's tasks back
    /// until that task finishes, which it cannot while it waits for them.
    pub(crate) fn check_may_wait(&self, what: &'static str) -> Result<()> {
        self.check_not_in_task(what)?;
        if self.class == crate::kind::Class::BestEffort
            && tenants::is_latency_critical(IN_TASK_OF.with(Cell::get))
        {
            return Err(Error::WaitOnBestEffort { what });
        }
        Ok(())
    }

    pub(crate) fn wait_task(&self, t: &TaskShared) -> Result<()> {
        self.wait_finished(t, "TaskHandle::wait")?;
        let r = t.outcome();
        if r.is_err() {
            // Reported here: not again at the next synchronize.
            lock(&self.errors).retain(|(id, _)| *id != t.id);
        }
        r
    }
}

/// Everything the submitting threads share, behind the runtime's one lock.
pub(crate) struct SubmitState {
    tracker: Tracker<Arc<TaskShared>>,
    placer: Box<dyn Place>,
    /// Placers for the other policies a placement file names, by policy.
    pub(crate) scope_placers: Vec<(placement::Policy, Box<dyn Place>)>,
    /// The number of compute streams (a file's `comm:i` is stream
    /// `compute + i`).
    pub(crate) compute: usize,
    /// Last sequence number placed on each stream.
    placed: Vec<u64>,
    /// Id of the last task placed on each stream.
    tail: Vec<u64>,
    clocks: Vec<Clock>,
    next_id: u64,
    preds: Vec<Arc<TaskShared>>,
    /// Task names to duration-estimate slots.
    names: cost::Names,
    /// Predicted time each stream finishes its queue (the cost model's).
    free_at: Vec<u64>,
    /// Set while a schedule is being recorded: every submitted task is kept.
    pub(crate) recorder: Option<replay::Recorder>,
    /// Automatic replay of repeated steps (`None`: off).
    pub(crate) auto: Option<auto::Auto>,
    pub(crate) stats: Stats,
}

/// Counters of what the scheduler did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// Tasks submitted.
    pub tasks: u64,
    /// Dependency edges to unfinished tasks.
    pub edges: u64,
    /// Cross-stream waits issued (events waited on).
    pub waits: u64,
    /// Cross-stream dependencies whose wait was implied by an earlier wait on
    /// the same stream (vector clocks) and so not issued.
    pub elided_waits: u64,
    /// Replays of recorded schedules.
    pub replays: u64,
    /// Tasks run by replays (not counted in `tasks`: none was inferred or
    /// placed).
    pub replayed_tasks: u64,
    /// Tasks submitted through an automatically memoised step (counted in
    /// `tasks` too): placed and given their waits from the plan, not inferred.
    pub auto_replayed: u64,
    /// Memoised steps the program left part-way (the rest ran eagerly).
    pub auto_divergences: u64,
    /// Replays run as one unit: a CUDA graph launch, or on the CPU one
    /// sequential run (counted in `replays` too).
    pub graph_replays: u64,
    /// Eager tasks run on the submitting thread
    /// (`RuntimeBuilder::inline_short_tasks`; counted in `tasks` too).
    pub inline: u64,
}

impl SubmitState {
    pub(crate) fn new(placer: Box<dyn Place>, streams: usize) -> Self {
        SubmitState {
            tracker: Tracker::default(),
            placer,
            scope_placers: Vec::new(),
            compute: streams,
            placed: vec![0; streams],
            tail: vec![u64::MAX; streams],
            clocks: vec![Clock::from_elem(0, streams); streams],
            next_id: 0,
            preds: Vec::new(),
            names: cost::Names::default(),
            free_at: vec![0; streams],
            recorder: None,
            auto: None,
            stats: Stats::default(),
        }
    }

    /// Sequence numbers each stream must reach for everything submitted so far
    /// to be complete.
    pub(crate) fn frontier(&self) -> Vec<u64> {
        self.placed.clone()
    }

    /// The id the next submitted task will get.
    pub(crate) fn next_id(&self) -> u64 {
        self.next_id
    }

    pub(crate) fn prune_finished(&mut self) {
        self.tracker.prune(|t| t.is_finished());
    }
}

/// What `submit` needs besides the state.
pub(crate) struct NewTask {
    pub(crate) name: Cow<'static, str>,
    pub(crate) kind: TaskKind,
    pub(crate) priority: crate::kind::Priority,
    pub(crate) comm_index: usize,
    pub(crate) stream: Option<usize>,
    pub(crate) accesses: SmallVec<[Access; 4]>,
    pub(crate) after: SmallVec<[Arc<TaskShared>; 2]>,
    pub(crate) body: Body,
    pub(crate) comm_hook: Option<CommHook>,
    /// The scope the task was submitted in, with its placement decision.
    pub(crate) scope: Option<std::sync::Arc<scoped::ScopeTag>>,
}

/// What a task's scope decided about its placement (communication tasks:
/// nothing; they keep their communication stream).
struct ScopePlace {
    priority: crate::kind::Priority,
    /// A stream the file or the task's bundle gives it, and why.
    stream: Option<(usize, crate::kind::PlaceReason)>,
    policy: Option<placement::Policy>,
    /// The bundle to set, if its first task is being placed.
    bundle: Option<std::sync::Arc<scoped::Bundle>>,
}

impl ScopePlace {
    fn of(t: &NewTask, compute: usize) -> ScopePlace {
        use crate::kind::{PlaceReason, Priority};
        use scoped::StreamChoice;
        let mut sp = ScopePlace {
            priority: t.priority,
            stream: None,
            policy: None,
            bundle: None,
        };
        let Some(tag) = t.scope.as_ref().filter(|_| t.kind != TaskKind::Comm) else {
            return sp;
        };
        let d = &tag.decision;
        sp.priority = d.priority.unwrap_or(t.priority);
        sp.policy = d.policy;
        match d.stream {
            Some(StreamChoice::Compute(i)) => sp.stream = Some((i, PlaceReason::Scoped)),
            Some(StreamChoice::Comm(i)) => sp.stream = Some((compute + i, PlaceReason::Scoped)),
            Some(StreamChoice::Side) => sp.priority = Priority::Side,
            Some(StreamChoice::Policy) | None => {}
        }
        if let (None, Some(b)) = (sp.stream, &tag.bundle) {
            match b.stream() {
                Some(s) => sp.stream = Some((s, PlaceReason::Bundled)),
                None => sp.bundle = Some(b.clone()),
            }
        }
        sp
    }
}

/// The longest estimated duration of a task that may run on its submitting
/// thread (`RuntimeBuilder::inline_short_tasks`): about what handing a task
/// to a stream thread that is spinning costs on the 2-core development VM
/// (0.3–1 µs, docs/engine.md), a wake-up of a sleeping one costing ~30 µs.
pub const INLINE_MAX_NS: u64 = 2_000;

/// Infers the task's predecessors, places it, computes its waits and hands it
/// to its stream, or returns its launch for the caller to run inline
/// ([`run_inline`]) once it has let go of the runtime's lock. Runs under the
/// runtime's lock; never blocks on a stream.
pub(crate) fn submit(
    st: &mut SubmitState,
    shared: &Shared,
    t: NewTask,
) -> (Arc<TaskShared>, Option<Launch>) {
    if st.auto.is_some() {
        if t.scope.as_ref().is_some_and(|s| !s.decision.replay) {
            // The placement file turned replay off for this scope: its
            // step is never memoised.
            auto::Auto::foreign(st);
        } else {
            let h = auto::task_hash(&t);
            if auto::Auto::admit(st, shared, &t, h) {
                return auto::submit_memoised(st, shared, t);
            }
        }
    }
    let sp = ScopePlace::of(&t, st.compute);
    let mut preds = inferred_preds(st, shared, &t.accesses);
    add_after(&mut preds, &t.after);

    // Placement (with the cost model's view on the CPU).
    let latest = preds.iter().max_by_key(|p| p.id);
    let cost = cost_slot(st, shared, &t);
    let pred_times: SmallVec<[(usize, u64); 8]> = if shared.measure {
        preds.iter().map(|p| (p.stream as usize, p.eft)).collect()
    } else {
        SmallVec::new()
    };
    // A chain continuation stays on its stream whatever the clock says
    // (`placement::Timing::chain`): the clock is read only for the others.
    // (Should the core budget have just taken that stream away, the placer
    // weighs the streams without the clock, for this one task.)
    let chain = latest.is_some_and(|p| {
        !shared.streams[p.stream as usize].is_comm
            && st.tail[p.stream as usize] == p.id
            && preds.iter().all(|q| q.stream == p.stream)
    }) && sp.priority != crate::kind::Priority::Side;
    let timing = shared.measure.then(|| Timing {
        now: if chain { 0 } else { crate::clock::now_ns() },
        chain,
        dur: shared.estimates.get(cost),
        preds: &pred_times,
        free_at: &st.free_at,
    });
    // Each stream's load is read at most once per submission (another
    // thread writes the `done` gate: each read may miss the cache).
    let placed = &st.placed;
    let seen: SmallVec<[Cell<u64>; 8]> = placed.iter().map(|_| Cell::new(u64::MAX)).collect();
    let load = |i: usize| {
        if seen[i].get() == u64::MAX {
            seen[i].set(placed[i] - shared.streams[i].done.get().min(placed[i]));
        }
        seen[i].get()
    };
    let (s, placement) = match (t.stream, sp.stream) {
        (Some(s), _) => (s, st.placer.decided(PlaceReason::Pinned, sp.priority)),
        (None, Some((s, why))) => (s, st.placer.decided(why, sp.priority)),
        (None, None) => {
            let req = Request {
                kind: t.kind,
                priority: sp.priority,
                latest_pred: latest
                    .map(|p| (p.stream as usize, st.tail[p.stream as usize] == p.id)),
                comm_index: t.comm_index,
                timing,
            };
            let placer = match sp.policy {
                Some(p) => match st.scope_placers.iter_mut().find(|(q, _)| *q == p) {
                    Some((_, placer)) => placer,
                    None => &mut st.placer,
                },
                None => &mut st.placer,
            };
            placer.place(&req, &load)
        }
    };
    if let Some(b) = &sp.bundle {
        b.set(s);
    }
    // A chain continues its predecessor's stream: busy until then.
    let eft = timing.map_or(0, |tm| {
        let busy = placement.reason == crate::kind::PlaceReason::Chain;
        tm.finish_on(s, if busy { 1 } else { load(s) })
    });
    st.free_at[s] = eft;

    // Waits: the latest predecessor on each other stream, unless this stream's
    // clock already covers it.
    let waits = cross_waits(&mut st.clocks[s], s, &preds, &mut st.stats);
    let clock = &mut st.clocks[s];
    let (edges, nwaits) = (preds.len() as u64, waits.len() as u64);
    let (id, seq) = next_slot(&mut st.placed, &mut st.tail, &mut st.next_id, shared, s);
    clock[s] = seq;
    let body = match &mut st.recorder {
        Some(rec) => rec.keep(
            id,
            s,
            (
                &t.name,
                t.kind,
                // Pinned by the code or the file, bundled, or a collective:
                // a re-placement keeps it where it is.
                t.stream.is_none()
                    && sp.stream.is_none()
                    && sp.bundle.is_none()
                    && t.kind != TaskKind::Comm,
                sp.priority == crate::kind::Priority::Side,
            ),
            t.scope.as_ref().map(|s| s.path.clone()),
            &t.accesses,
            &t.comm_hook,
            t.body,
            &t.after,
        ),
        None => TaskBody::Once(t.body),
    };
    let task = TaskShared::new(Record {
        id,
        name: t.name,
        scope: t.scope.map(|s| s.path.clone()),
        kind: t.kind,
        stream: s,
        seq,
        clock: clock.clone(),
        placement,
        eft,
        cost,
    });
    let launch = Launch {
        waits,
        preds: preds.drain(..).collect(),
        wait_only: 0,
        accesses: t.accesses,
        body,
        comm_hook: t.comm_hook,
    };
    for a in &launch.accesses {
        st.tracker
            .record(a.view.buf.id(), a.view.range(), a.mode, &task);
    }
    st.stats.tasks += 1;
    st.stats.edges += edges;
    st.stats.waits += nwaits;
    st.preds = preds;
    hand_off(st, shared, task, launch)
}

/// Takes the next position on stream `s` and the next task id for a new
/// task record, under the lock: the stream's placed count (and the live
/// view's), the id, the stream's tail and the submitted count. Returns
/// `(id, seq)`.
pub(crate) fn next_slot(
    placed: &mut [u64],
    tail: &mut [u64],
    next_id: &mut u64,
    shared: &Shared,
    s: usize,
) -> (u64, u64) {
    placed[s] += 1;
    let seq = placed[s];
    live::placed(shared, s, seq);
    let id = *next_id;
    *next_id += 1;
    tail[s] = id;
    // Relaxed: the busy period's decision is ordered by its lock, which
    // this thread takes after the increment (`live::Busy`).
    let before = shared.submitted.fetch_add(1, Ordering::Relaxed);
    live::submitted(shared, before);
    (id, seq)
}

/// The duration-estimate slot of `t`'s name ([`cost::NO_SLOT`] where the
/// runtime neither measures nor bounds a best-effort launch window by name,
/// `tenants::DeviceBundle`).
pub(crate) fn cost_slot(st: &mut SubmitState, shared: &Shared, t: &NewTask) -> u32 {
    match &t.name {
        _ if !shared.measure && shared.class != crate::kind::Class::BestEffort => cost::NO_SLOT,
        Cow::Borrowed(name) => st.names.slot_static(name),
        Cow::Owned(name) => st.names.slot(name),
    }
}

/// Hands a placed task to its stream's queue, or returns its launch for the
/// caller to run inline ([`run_inline`]): a measured short task with nothing
/// to wait for, on a stream that has finished everything placed on it (so
/// its thread is idle and the task is next in its order either way).
pub(crate) fn hand_off(
    st: &mut SubmitState,
    shared: &Shared,
    task: Arc<TaskShared>,
    launch: Launch,
) -> (Arc<TaskShared>, Option<Launch>) {
    let s = task.stream as usize;
    let inline = shared.inline
        && task.kind != TaskKind::Comm
        && matches!(launch.body, TaskBody::Once(_))
        && launch.preds.is_empty()
        && launch.waits.is_empty()
        && shared
            .estimates
            .get(task.cost)
            .is_some_and(|e| e <= INLINE_MAX_NS)
        && shared.streams[s].done.get() + 1 == task.seq
        && IN_TASK_OF.with(Cell::get) != shared.runtime_id
        // Not at the idle policy of a best-effort thread that submits it.
        && !(shared.class == crate::kind::Class::LatencyCritical
            && tenants::on_best_effort_thread());
    if inline {
        shared.streams[s].inline.store(task.seq, Ordering::Release);
        st.stats.inline += 1;
        return (task, Some(launch));
    }
    shared.streams[s]
        .queue
        .push(Item::Task(task.clone(), launch));
    (task, None)
}

/// Adds the explicit predecessors `after` to `preds`: each one not yet
/// retired (unfinished, or finished with a failure, which skips the
/// dependent) and not already there.
pub(crate) fn add_after(preds: &mut Vec<Arc<TaskShared>>, after: &[Arc<TaskShared>]) {
    for p in after {
        if !p.retired() && !preds.iter().any(|q| q.id == p.id) {
            preds.push(p.clone());
        }
    }
}

/// The unfinished tasks that `accesses` conflict with (dependency
/// inference), in a vector taken from `st.preds` (give it back).
pub(crate) fn inferred_preds(
    st: &mut SubmitState,
    shared: &Shared,
    accesses: &[Access],
) -> Vec<Arc<TaskShared>> {
    for id in shared.dropped.drain() {
        st.tracker.forget(id);
    }
    let mut preds = std::mem::take(&mut st.preds);
    preds.clear();
    for a in accesses {
        st.tracker
            .preds(a.view.buf.id(), a.view.range(), a.mode, &mut preds);
    }
    preds
}

thread_local! {
    /// Tasks this thread ran inline, for the cost model's sampling.
    static INLINE_RUN: Cell<u32> = const { Cell::new(0) };
}

/// Runs a task [`submit`] chose to run inline, on the calling (submitting)
/// thread, as its stream's thread would have: its stream's next task, timed,
/// traced and completed the same way. Call without the runtime's lock.
pub(crate) fn run_inline(shared: &Shared, task: &TaskShared, launch: Launch) {
    let outer = IN_TASK_OF.with(|c| c.replace(shared.runtime_id));
    let mark = tenants::enter_class(shared.class);
    let mut n = INLINE_RUN.with(Cell::get);
    worker::execute(shared, task.stream as usize, task, launch, &mut n);
    INLINE_RUN.with(|c| c.set(n));
    tenants::leave_class(mark);
    IN_TASK_OF.with(|c| c.set(outer));
}

/// The cross-stream waits a task on stream `s` needs for `preds`: the latest
/// predecessor on each other stream, unless `clock` (stream `s`'s vector
/// clock) already covers it; each wait issued merges that predecessor's clock.
pub(crate) fn cross_waits(
    clock: &mut Clock,
    s: usize,
    preds: &[Arc<TaskShared>],
    stats: &mut Stats,
) -> SmallVec<[(u16, u64); 4]> {
    let mut waits = SmallVec::new();
    let mut by_stream: SmallVec<[&Arc<TaskShared>; 4]> = SmallVec::new();
    for p in preds {
        if p.stream as usize == s {
            continue;
        }
        match by_stream.iter_mut().find(|q| q.stream == p.stream) {
            Some(q) if q.seq < p.seq => *q = p,
            Some(_) => {}
            None => by_stream.push(p),
        }
    }
    by_stream.sort_by_key(|p| p.stream);
    for p in by_stream {
        let j = p.stream as usize;
        if clock[j] >= p.seq {
            stats.elided_waits += 1; // implied by an earlier wait
            continue;
        }
        waits.push((p.stream, p.seq));
        for (c, &pc) in clock.iter_mut().zip(p.clock.iter()) {
            *c = (*c).max(pc);
        }
    }
    waits
}

/// A submitted task. Waiting on it is a synchronisation point.
#[derive(Clone)]
pub struct TaskHandle {
    pub(crate) task: Arc<TaskShared>,
    pub(crate) shared: Arc<Shared>,
}

impl fmt::Debug for TaskHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TaskHandle")
            .field("name", &self.task.name)
            .field("stream", &self.task.stream)
            .finish()
    }
}

impl TaskHandle {
    /// Blocks until the task has completed; returns its error if it failed or
    /// was skipped because a dependency failed.
    pub fn wait(&self) -> Result<()> {
        self.shared.wait_task(&self.task)
    }

    /// The task's name.
    pub fn name(&self) -> &str {
        &self.task.name
    }

    /// The stream the task was placed on.
    pub fn stream(&self) -> usize {
        self.task.stream as usize
    }

    /// Whether the task has finished (successfully or not).
    pub fn is_done(&self) -> bool {
        self.task.is_finished()
    }

    /// Blocks until the task has finished, without reporting its outcome:
    /// a failure is still reported by `wait` or the next synchronisation
    /// point. `false` (without waiting) from inside a task.
    pub(crate) fn wait_unreported(&self) -> bool {
        self.shared
            .wait_finished(&self.task, "a placement trial")
            .is_ok()
    }
}

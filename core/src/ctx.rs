//! What the scheduler hands a task body: its declared accesses (as records
//! the tracker reads) and its context (the task's name, its device). Below
//! the scheduler, which builds a [`TaskCtx`] for every body it runs, and above
//! the backends and buffers. Users never see a `TaskCtx`: the typed bodies of
//! [`TaskBuilder::run`](crate::TaskBuilder::run) and friends get their data
//! and, on CUDA, a [`CudaTaskCtx`](crate::CudaTaskCtx).

use crate::backend::DeviceCtx;
use crate::buffer::View;
use crate::error::{Result, TaskError};
use crate::graph::Mode;
use std::cell::RefCell;
use std::fmt;

pub(crate) use crate::backend::Check;

/// One declared access, resolved to its buffer.
#[derive(Clone)]
pub(crate) struct Access {
    pub view: View,
    pub mode: Mode,
}

/// A task body as the scheduler runs it.
pub(crate) type Body = smallbox::SmallBox<
    dyn FnMut(&TaskCtx<'_>) -> Result<(), TaskError> + Send + 'static,
    smallbox::space::S8,
>;

/// A task body in its record's inline slot: no allocation for a closure of up
/// to eight words (the common case: the resolved views and a few captured
/// values), a heap box only for a larger one. The slot is what made
/// `dag_overhead` 0.82× (chain), 0.90× (fan-out) and 0.83× (random) of the
/// boxed body, paired whole-process runs: a box was allocated by the
/// submitting thread and freed by the stream thread, and the two contended
/// for the allocator's arena lock (docs/engine.md).
pub(crate) fn body<F>(f: F) -> Body
where
    F: FnMut(&TaskCtx<'_>) -> Result<(), TaskError> + Send + 'static,
{
    smallbox::smallbox!(f)
}

/// A body kept by a recorded schedule, run once per replay.
pub(crate) type SharedBody = std::sync::Arc<BodyCell>;

/// A re-runnable body without a lock. Invariant: it is only ever called by
/// the thread of its task's stream — the recording run and every replay
/// (programs and materialised tasks alike) place a recorded task on the
/// stream it was recorded on, and each stream has exactly one thread — so
/// calls never overlap. (A mutex here cost a cache-missing atomic per step.)
///
/// A recorded task may move to another stream when its schedule is
/// re-placed from measured durations (`Plan::replaced`); the first replay of
/// the new plan waits for everything already submitted to every stream
/// first, so no call of the old placement overlaps one of the new.
pub(crate) struct BodyCell {
    body: std::cell::UnsafeCell<Body>,
    /// The body's last measured duration in nanoseconds (`u64::MAX`: none
    /// yet), written by the stream thread that ran it.
    nanos: std::sync::atomic::AtomicU64,
}

// SAFETY: the body is `Send`; calls are confined to one thread at a time by
// the invariant above, and `call` is the only access.
unsafe impl Sync for BodyCell {}

impl BodyCell {
    pub(crate) fn new(body: Body) -> Self {
        BodyCell {
            body: std::cell::UnsafeCell::new(body),
            nanos: std::sync::atomic::AtomicU64::new(u64::MAX),
        }
    }

    /// Records a measured duration.
    pub(crate) fn measured(&self, ns: u64) {
        self.nanos
            .store(ns.min(u64::MAX - 1), std::sync::atomic::Ordering::Release);
    }

    /// The last measured duration, if any.
    pub(crate) fn nanos(&self) -> Option<u64> {
        let ns = self.nanos.load(std::sync::atomic::Ordering::Acquire);
        (ns != u64::MAX).then_some(ns)
    }

    /// The body, to call it.
    ///
    /// # Safety
    /// Only the thread of the task's stream may call this, and only while no
    /// other reference from `get` is alive (stream threads run one task at a
    /// time).
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn get(&self) -> &mut Body {
        // SAFETY: exclusive by the caller's contract.
        unsafe { &mut *self.body.get() }
    }
}

/// What a collective's task tells its communicator besides running it.
pub(crate) trait CommEvents: Send + Sync {
    /// The task is skipped because a predecessor failed, with the task's
    /// error (`Error::DependencyFailed`, with its root where known): the
    /// collective poisons its communicator with it, so the other ranks
    /// fail, saying why, instead of waiting.
    fn skipped(&self, why: &crate::Error);
    /// A replay of the schedule it was recorded in queued it again: one
    /// more collective issued, so that a rank that leaves with replays
    /// still queued is not taken to stop short of them.
    fn queued(&self);
}

/// A collective task's [`CommEvents`].
pub(crate) type CommHook = std::sync::Arc<dyn CommEvents>;

/// The context a body runs in.
pub(crate) struct TaskCtx<'a> {
    name: &'a str,
    device: DeviceCtx<'a>,
    checks: RefCell<Vec<Check>>,
}

impl fmt::Debug for TaskCtx<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TaskCtx").field("name", &self.name).finish()
    }
}

impl<'a> TaskCtx<'a> {
    pub(crate) fn new(name: &'a str, device: DeviceCtx<'a>) -> Self {
        TaskCtx {
            name,
            device,
            checks: RefCell::new(Vec::new()),
        }
    }

    /// Registers `check` to run when this task's work has completed: on the
    /// CPU right after the body returns, on CUDA once the task's end event has
    /// completed on the device (CUDA bodies register theirs through
    /// [`CudaTaskCtx::on_complete`](crate::CudaTaskCtx::on_complete)). An
    /// error from it fails the task, as if the body had returned it.
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn on_complete(&self, check: impl FnOnce() -> Result<()> + Send + 'static) {
        self.checks.borrow_mut().push(Box::new(check));
    }

    /// The checks registered so far, the CUDA context's included.
    pub(crate) fn take_checks(&self) -> Vec<Check> {
        let mut checks = std::mem::take(&mut *self.checks.borrow_mut());
        if let DeviceCtx::Cuda(c) = &self.device {
            checks.append(&mut c.take_checks());
        }
        checks
    }

    /// The task's name.
    pub(crate) fn name(&self) -> &str {
        self.name
    }

    /// The device-specific context.
    pub(crate) fn device(&self) -> &DeviceCtx<'a> {
        &self.device
    }
}

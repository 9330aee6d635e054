//! Tasks: what a program submits (the builder) and what it gets back (handles).
//! The top of the engine's layering, beside the runtime: it hands finished
//! task records to the scheduler.

use crate::access::{Accesses, Target};
use crate::backend::gpu::CudaTaskCtx;
use crate::ctx::{Access, Body};
use crate::error::{Error, Result, TaskError};
use crate::kind::{Priority, TaskKind};
use crate::sched::{NewTask, TaskHandle, TaskShared};
use crate::sync::Arc;
use smallvec::SmallVec;
use std::borrow::Cow;
use std::fmt;

/// Builds one task: name, accesses, kind, priority, then [`TaskBuilder::run`].
#[must_use = "a task is submitted only by `run`"]
pub struct TaskBuilder<'rt> {
    pub(crate) rt: &'rt crate::Runtime,
    pub(crate) name: Cow<'static, str>,
    pub(crate) accesses: SmallVec<[Access; 4]>,
    pub(crate) kind: TaskKind,
    pub(crate) priority: Priority,
    pub(crate) after: SmallVec<[Arc<TaskShared>; 2]>,
    pub(crate) comm_index: usize,
    pub(crate) stream: Option<usize>,
    pub(crate) comm_hook: Option<crate::ctx::CommHook>,
    /// The name of a task of another runtime given to `after`: refused at
    /// submission (its stream and clock mean nothing to this runtime).
    pub(crate) foreign_after: Option<Cow<'static, str>>,
}

impl fmt::Debug for TaskBuilder<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TaskBuilder")
            .field("name", &self.name)
            .field("accesses", &self.accesses.len())
            .field("kind", &self.kind)
            .finish()
    }
}

impl<'rt> TaskBuilder<'rt> {
    /// Sets the task's kind (default: compute).
    pub fn kind(mut self, kind: TaskKind) -> Self {
        self.kind = kind;
        if kind == TaskKind::Comm {
            self.priority = Priority::Comm;
        }
        self
    }

    /// Sets the scheduling hint (default: main).
    pub fn priority(mut self, p: Priority) -> Self {
        self.priority = p;
        self
    }

    /// Which communication stream a comm task uses (modulo their number).
    pub fn comm_stream(mut self, index: usize) -> Self {
        self.comm_index = index;
        self
    }

    /// Pins the task to stream `index`, overriding the placement policy.
    pub fn on_stream(mut self, index: usize) -> Self {
        self.stream = Some(index);
        self
    }

    /// Adds an explicit edge: the task runs after `h` (rarely needed; data
    /// dependencies are inferred).
    /// `h` must be a task of the same runtime; one of another runtime is
    /// refused when the task is submitted (wait for it first instead:
    /// [`TaskHandle::wait`]).
    pub fn after(mut self, h: &TaskHandle) -> Self {
        if h.shared.runtime_id != self.rt.id() {
            self.foreign_after
                .get_or_insert_with(|| h.task.name.clone());
        } else {
            self.after.push(h.task.clone());
        }
        self
    }

    /// Submits the task with a CPU body: `body` gets the host data of
    /// `accesses` (`&[T]` for each read token, `&mut [T]` for each write), in
    /// the shape of the set, and returns `()` or a `Result`.
    ///
    /// Returns once the task is submitted; the body runs later on the stream
    /// the task is placed on — or, for a task the cost model has measured as
    /// shorter than a hand-off to a stream thread, with nothing to wait for
    /// and an idle stream, on this thread inside this call
    /// ([`crate::RuntimeBuilder::inline_short_tasks`], on by default). So a
    /// body must not take a lock the submitting thread holds while it
    /// submits. Errors here are misuse found at submission: a buffer of another
    /// runtime, a stream index out of range, a view that is not a whole
    /// aligned `[T]`, two tokens that overlap where one writes, or a runtime
    /// whose backend is not the CPU (use [`TaskBuilder::run_any`] there).
    pub fn run<A, F, R>(self, accesses: A, body: F) -> Result<TaskHandle>
    where
        A: Accesses,
        F: for<'a> FnMut(A::Host<'a>) -> R + Send + 'static,
        R: TaskResult + 'static,
    {
        self.submit_typed(accesses, Some(body), None::<NoCuda<A, R>>)
    }

    /// Submits the task with a CUDA body: `body` gets typed device addresses
    /// of `accesses` ([`DevSlice`](crate::DevSlice) for each read token,
    /// [`DevSliceMut`](crate::DevSliceMut) for each write) and the task's
    /// CUDA context (its stream and cuBLAS handle). It enqueues work on the
    /// stream and returns; the task completes when that work has.
    pub fn run_cuda<A, G, R>(self, accesses: A, body: G) -> Result<TaskHandle>
    where
        A: Accesses,
        G: for<'a> FnMut(A::Device<'a>, &CudaTaskCtx<'a>) -> R + Send + 'static,
        R: TaskResult + 'static,
    {
        self.submit_typed(accesses, None::<NoCpu<A, R>>, Some(body))
    }

    /// Submits the task with a body per backend (StarPU's codelet, candle's
    /// `CustomOp`): `cpu` as in [`TaskBuilder::run`], `cuda` as in
    /// [`TaskBuilder::run_cuda`]; the runtime's backend picks one.
    pub fn run_any<A, F, G, R, S>(self, accesses: A, cpu: F, cuda: G) -> Result<TaskHandle>
    where
        A: Accesses,
        F: for<'a> FnMut(A::Host<'a>) -> R + Send + 'static,
        G: for<'a> FnMut(A::Device<'a>, &CudaTaskCtx<'a>) -> S + Send + 'static,
        R: TaskResult + 'static,
        S: TaskResult + 'static,
    {
        self.submit_typed(accesses, Some(cpu), Some(cuda))
    }

    fn submit_typed<A, F, G, R, S>(
        mut self,
        accesses: A,
        cpu: Option<F>,
        cuda: Option<G>,
    ) -> Result<TaskHandle>
    where
        A: Accesses,
        F: for<'a> FnMut(A::Host<'a>) -> R + Send + 'static,
        G: for<'a> FnMut(A::Device<'a>, &CudaTaskCtx<'a>) -> S + Send + 'static,
        R: TaskResult + 'static,
        S: TaskResult + 'static,
    {
        let backend = self.rt.backend_name();
        let to = |device| Target {
            runtime: self.rt.id(),
            device,
        };
        let body: Body = match (backend, cpu, cuda) {
            ("cpu", Some(f), _) => {
                let raw = accesses
                    .resolve(to(false))
                    .map_err(|e| e.for_task(&self.name))?;
                crate::access::collect(&self.name, accesses, &mut self.accesses)?;
                let mut f = f;
                crate::ctx::body(move |_ctx| {
                    // SAFETY: `raw` was resolved for the host from the set
                    // `collect` just checked; the tracker runs this body only
                    // while no other task writes what it reads or touches
                    // what it writes; the task's declared accesses hold the
                    // buffers until it completes.
                    let data = unsafe { A::host(&raw) };
                    f(data).into_task_result()
                })
            }
            ("cuda", _, Some(g)) => {
                let raw = accesses
                    .resolve(to(true))
                    .map_err(|e| e.for_task(&self.name))?;
                crate::access::collect(&self.name, accesses, &mut self.accesses)?;
                let mut g = g;
                crate::ctx::body(move |ctx| {
                    let cu = ctx.device().cuda().ok_or_else(|| {
                        Error::Usage(format!(
                            "task `{}` has a CUDA body but ran on a host stream",
                            ctx.name()
                        ))
                    })?;
                    g(A::device(&raw), cu).into_task_result()
                })
            }
            (backend, _, _) => {
                return Err(Error::NoBody {
                    task: self.name.to_string(),
                    backend,
                })
            }
        };
        self.into_new_task(body)
    }
}

impl TaskBuilder<'_> {
    fn into_new_task(self, body: Body) -> Result<TaskHandle> {
        if let Some(other) = &self.foreign_after {
            return Err(Error::Usage(format!(
                "task `{}` is to run after task `{other}` of another runtime; an edge joins \
                 tasks of one runtime (wait for the other task first: `TaskHandle::wait`)",
                self.name
            )));
        }
        self.rt.submit(NewTask {
            name: self.name,
            kind: self.kind,
            priority: self.priority,
            comm_index: self.comm_index,
            stream: self.stream,
            accesses: self.accesses,
            after: self.after,
            body,
            comm_hook: self.comm_hook,
            scope: self.rt.scopes.current(),
        })
    }

    /// Tells `hook` when the task is skipped because a task it depends on
    /// failed (in every run, replays included), and when a replay queues
    /// it again (a collective's communicator counts it).
    pub(crate) fn comm_hook(mut self, hook: crate::ctx::CommHook) -> Self {
        self.comm_hook = Some(hook);
        self
    }
}

type NoCpu<A, R> = fn(<A as Accesses>::Host<'_>) -> R;
type NoCuda<A, R> = for<'a> fn(<A as Accesses>::Device<'a>, &CudaTaskCtx<'a>) -> R;

/// What a task body may return: `()`, or a `Result` whose error fails the
/// task (it is reported, naming the task, at the next synchronisation point).
pub trait TaskResult {
    /// The body's outcome as the engine records it.
    fn into_task_result(self) -> Result<(), TaskError>;
}

impl TaskResult for () {
    fn into_task_result(self) -> Result<(), TaskError> {
        Ok(())
    }
}

impl TaskResult for Result<(), TaskError> {
    fn into_task_result(self) -> Result<(), TaskError> {
        self
    }
}

impl crate::Runtime {
    /// Starts a task named `name`.
    pub fn task(&self, name: impl Into<Cow<'static, str>>) -> TaskBuilder<'_> {
        TaskBuilder {
            rt: self,
            name: name.into(),
            accesses: SmallVec::new(),
            kind: TaskKind::Compute,
            priority: Priority::Main,
            after: SmallVec::new(),
            comm_index: 0,
            stream: None,
            comm_hook: None,
            foreign_after: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::ctx::{Access, TaskCtx};
    use crate::graph::Mode;
    use crate::{BackendKind, Buffer, Error, Result, Runtime, TaskBuilder, TaskHandle};

    /// Submits `body` with the raw context the scheduler hands every body
    /// (the typed forms are built on it), declaring `mode` on `x`.
    fn raw(
        b: TaskBuilder<'_>,
        x: &Buffer,
        mode: Mode,
        body: impl FnMut(&TaskCtx<'_>) + Send + 'static,
    ) -> Result<TaskHandle> {
        let mut b = b;
        b.accesses.push(Access {
            view: x.whole(),
            mode,
        });
        let mut body = body;
        b.into_new_task(crate::ctx::body(move |ctx| {
            body(ctx);
            Ok(())
        }))
    }

    #[test]
    fn completion_checks_can_fail_the_task() {
        let rt = Runtime::builder()
            .backend(BackendKind::Cpu)
            .compute_streams(2)
            .build()
            .unwrap();
        let x = rt.alloc("x", 4).unwrap();
        let ok = raw(rt.task("fine"), &x, Mode::Write, |ctx| {
            ctx.on_complete(|| Ok(()));
        })
        .unwrap();
        ok.wait().unwrap();
        let bad = raw(rt.task("aborted later"), &x, Mode::ReadWrite, |ctx| {
            ctx.on_complete(|| {
                Err(Error::Device {
                    backend: "test",
                    op: "check".into(),
                    message: "the device said no".into(),
                })
            });
        })
        .unwrap();
        let dep = rt.task("after").run(x.read::<f32>(), |_| ()).unwrap();
        assert!(matches!(bad.wait(), Err(Error::Device { .. })));
        assert!(matches!(dep.wait(), Err(Error::DependencyFailed { .. })));
        rt.synchronize().unwrap();
    }
}

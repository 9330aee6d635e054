//! Tasks: what a program submits, what a task body sees, and handles.

use crate::access::Accesses;
use crate::backend::gpu::CudaTaskCtx;
use crate::backend::DeviceCtx;
use crate::buffer::{AsView, View};
use crate::error::{Error, Result, TaskError};
use crate::graph::Mode;
use crate::sched::{Shared, TaskShared};
use crate::sync::Arc;
use smallvec::SmallVec;
use std::borrow::Cow;
use std::cell::RefCell;
use std::fmt;

/// What a task does; decides which streams it may run on and how the trace
/// summary accounts for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum TaskKind {
    /// A kernel or other computation (compute streams).
    #[default]
    Compute,
    /// A collective or other communication (communication streams).
    Comm,
    /// A memory copy.
    Copy,
    /// Work done by the host on a stream's behalf (uploads, read-backs).
    Host,
}

impl TaskKind {
    /// The kind's name in traces.
    pub fn name(self) -> &'static str {
        match self {
            TaskKind::Compute => "compute",
            TaskKind::Comm => "comm",
            TaskKind::Copy => "copy",
            TaskKind::Host => "host",
        }
    }
}

/// A scheduling hint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Priority {
    /// On the critical path (the default).
    #[default]
    Main,
    /// Off the critical path: placement keeps it away from the main chain's
    /// stream so it runs beside it (e.g. weight gradients in backward).
    Side,
    /// Communication (comm streams run at the highest device priority).
    Comm,
}

/// One declared access, resolved to its buffer.
#[derive(Clone)]
pub(crate) struct Access {
    pub view: View,
    pub mode: Mode,
}

pub(crate) type Body = Box<dyn FnOnce(&TaskCtx<'_>) -> Result<(), TaskError> + Send + 'static>;

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
    /// Declares that the task reads `v`.
    pub fn read(mut self, v: impl AsView) -> Self {
        self.accesses.push(Access {
            view: v.as_view(),
            mode: Mode::Read,
        });
        self
    }

    /// Declares that the task overwrites `v` without reading it.
    pub fn write(mut self, v: impl AsView) -> Self {
        self.accesses.push(Access {
            view: v.as_view(),
            mode: Mode::Write,
        });
        self
    }

    /// Declares that the task reads and writes `v`.
    pub fn read_write(mut self, v: impl AsView) -> Self {
        self.accesses.push(Access {
            view: v.as_view(),
            mode: Mode::ReadWrite,
        });
        self
    }

    /// Declares an access in the given mode.
    pub fn access(mut self, v: impl AsView, mode: Mode) -> Self {
        self.accesses.push(Access {
            view: v.as_view(),
            mode,
        });
        self
    }

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
    pub fn after(mut self, h: &TaskHandle) -> Self {
        self.after.push(h.task.clone());
        self
    }

    /// Submits the task with a CPU body: `body` gets the host data of
    /// `accesses` (`&[T]` for each read token, `&mut [T]` for each write), in
    /// the shape of the set, and returns `()` or a `Result`.
    ///
    /// Returns at once; the body runs later on the stream the task is placed
    /// on. Errors here are misuse found at submission: a buffer of another
    /// runtime, a stream index out of range, a view that is not a whole
    /// aligned `[T]`, two tokens that overlap where one writes, or a runtime
    /// whose backend is not the CPU (use [`TaskBuilder::run_any`] there).
    pub fn run<A, F, R>(self, accesses: A, body: F) -> Result<TaskHandle>
    where
        A: Accesses,
        F: for<'a> FnOnce(A::Host<'a>) -> R + Send + 'static,
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
        G: for<'a> FnOnce(A::Device, &CudaTaskCtx<'a>) -> R + Send + 'static,
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
        F: for<'a> FnOnce(A::Host<'a>) -> R + Send + 'static,
        G: for<'a> FnOnce(A::Device, &CudaTaskCtx<'a>) -> S + Send + 'static,
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
        F: for<'a> FnOnce(A::Host<'a>) -> R + Send + 'static,
        G: for<'a> FnOnce(A::Device, &CudaTaskCtx<'a>) -> S + Send + 'static,
        R: TaskResult + 'static,
        S: TaskResult + 'static,
    {
        crate::access::collect(&self.name, &accesses, &mut self.accesses)?;
        let backend = self.rt.backend_name();
        let body: Body = match (backend, cpu, cuda) {
            ("cpu", Some(f), _) => Box::new(move |_ctx| {
                // SAFETY: the tracker runs this body only while no other task
                // writes what it reads or touches what it writes, the
                // submission check made its write tokens disjoint from every
                // other token, and the launch holds the buffers.
                let data = unsafe { accesses.host() }?;
                f(data).into_task_result()
            }),
            ("cuda", _, Some(g)) => Box::new(move |ctx| {
                let cu = ctx.device().cuda().ok_or_else(|| Error::WrongDevice {
                    buffer: ctx.name().to_string(),
                    actual: "the host",
                    wanted: "a CUDA stream",
                })?;
                g(accesses.device()?, cu).into_task_result()
            }),
            (backend, _, _) => {
                return Err(Error::NoBody {
                    task: self.name.to_string(),
                    backend,
                })
            }
        };
        let rt = self.rt;
        rt.submit(self, body)
    }

    /// Submits the task with a body that gets the raw task context, for
    /// accesses declared with [`TaskBuilder::access`] (the low-level form the
    /// FFI and the collectives build on).
    #[doc(hidden)]
    pub fn run_ctx<F>(self, body: F) -> Result<TaskHandle>
    where
        F: FnOnce(&TaskCtx<'_>) -> Result<(), TaskError> + Send + 'static,
    {
        let rt = self.rt;
        rt.submit(self, Box::new(body))
    }
}

type NoCpu<A, R> = fn(<A as Accesses>::Host<'_>) -> R;
type NoCuda<A, R> = fn(<A as Accesses>::Device, &CudaTaskCtx<'_>) -> R;

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

fn check_elems<T>(v: &View) -> Result<()> {
    let sz = size_of::<T>();
    if sz == 0 || v.len() % sz != 0 {
        return Err(Error::Misaligned {
            buffer: v.buf.name().to_string(),
            range: v.range(),
            ty: std::any::type_name::<T>(),
        });
    }
    Ok(())
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
}

type Borrow = (u64, usize, usize, bool);

/// A check run once the task's work has completed (see [`TaskCtx::on_complete`]).
pub(crate) type Check = Box<dyn FnOnce() -> Result<()> + Send + 'static>;

/// What a task body sees: its declared data, and the stream it runs on.
///
/// Data is reachable only here, only for the accesses the task declared and
/// only in the declared mode: `read` gives shared slices of any declared
/// access; `write` gives an exclusive slice of a declared `write` or
/// `read_write` access. Asking for the same bytes twice while one of the
/// borrows is exclusive is an error ([`Error::BorrowConflict`]), so safe code
/// can never hold aliasing slices.
pub struct TaskCtx<'a> {
    pub(crate) name: &'a str,
    pub(crate) accesses: &'a [Access],
    pub(crate) stream: usize,
    pub(crate) rank: usize,
    pub(crate) device: DeviceCtx<'a>,
    /// Host borrows handed out so far: (buffer id, start, end, exclusive).
    borrows: RefCell<SmallVec<[Borrow; 4]>>,
    checks: RefCell<Vec<Check>>,
}

impl fmt::Debug for TaskCtx<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TaskCtx")
            .field("name", &self.name)
            .field("stream", &self.stream)
            .finish()
    }
}

impl<'a> TaskCtx<'a> {
    pub(crate) fn new(
        name: &'a str,
        accesses: &'a [Access],
        stream: usize,
        rank: usize,
        device: DeviceCtx<'a>,
    ) -> Self {
        TaskCtx {
            name,
            accesses,
            stream,
            rank,
            device,
            borrows: RefCell::new(SmallVec::new()),
            checks: RefCell::new(Vec::new()),
        }
    }

    /// Registers `check` to run when this task's work has completed: on the
    /// CPU right after the body returns, on CUDA once the task's end event has
    /// completed on the device. An error from it fails the task, as if the
    /// body had returned it — the way asynchronous device-side failures (an
    /// aborted collective, say) reach the task that caused them.
    pub fn on_complete(&self, check: impl FnOnce() -> Result<()> + Send + 'static) {
        self.checks.borrow_mut().push(Box::new(check));
    }

    pub(crate) fn take_checks(&self) -> Vec<Check> {
        let mut checks = std::mem::take(&mut *self.checks.borrow_mut());
        if let DeviceCtx::Cuda(c) = &self.device {
            checks.append(&mut c.take_checks());
        }
        checks
    }

    /// The task's name.
    pub fn name(&self) -> &str {
        self.name
    }

    /// Index of the stream the task runs on.
    pub fn stream_index(&self) -> usize {
        self.stream
    }

    /// The rank of the runtime (0 unless set by the builder or a launcher).
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The device-specific context (the raw CUDA stream on GPUs).
    pub fn device(&self) -> &DeviceCtx<'a> {
        &self.device
    }

    /// Shared host slice of a declared access (any mode) covering `v`.
    pub fn read<T: bytemuck::Pod>(&self, v: impl AsView) -> Result<&[T]> {
        let v = v.as_view();
        let (ptr, len) = self.borrow_host::<T>(&v, false, true)?;
        // SAFETY: `borrow_host` checked that `v` lies inside a declared access of
        // this task, that the bytes are a whole aligned `[T]`, and recorded the
        // borrow so no exclusive borrow of overlapping bytes exists or can be
        // taken while this context lives; the dependency tracker guarantees no
        // other task writes these bytes while this one runs, and the buffer's
        // storage outlives the task (the launch holds it).
        Ok(unsafe { std::slice::from_raw_parts(ptr.cast::<T>(), len) })
    }

    /// Exclusive host slice of a declared `write` or `read_write` access covering `v`.
    #[allow(clippy::mut_from_ref)]
    pub fn write<T: bytemuck::Pod>(&self, v: impl AsView) -> Result<&mut [T]> {
        let v = v.as_view();
        let (ptr, len) = self.borrow_host::<T>(&v, true, true)?;
        // SAFETY: as in `read`, and the recorded exclusive borrow makes any other
        // borrow of overlapping bytes through this context fail, so this is the
        // only reference to them.
        Ok(unsafe { std::slice::from_raw_parts_mut(ptr.cast::<T>(), len) })
    }

    /// Raw device address of a declared access covering `v` on a GPU buffer,
    /// for launching kernels. `write` asks for a writable access.
    pub fn device_ptr(&self, v: impl AsView, write: bool) -> Result<u64> {
        let v = v.as_view();
        self.check_declared(&v, write)?;
        v.buf
            .inner
            .storage
            .device_ptr(v.start)
            .ok_or_else(|| Error::WrongDevice {
                buffer: v.buf.name().to_string(),
                actual: v.buf.inner.storage.device_name(),
                wanted: "a GPU",
            })
    }

    /// Copies the bytes of a declared access covering `v` into a new vector,
    /// on any backend (on CUDA: a copy on the task's stream, waited for).
    pub fn read_to_vec<T: bytemuck::Pod>(&self, v: impl AsView) -> Result<Vec<T>> {
        let v = v.as_view();
        match &self.device {
            DeviceCtx::Cuda(c) => {
                self.check_declared(&v, false)?;
                check_elems::<T>(&v)?;
                let ptr = self.device_ptr(&v, false)?;
                let mut bytes = vec![0u8; v.len()];
                crate::backend::gpu::download(c.stream(), ptr, &mut bytes)?;
                Ok(bytemuck::pod_collect_to_vec(&bytes))
            }
            _ => {
                // A copy: no borrow outlives this call, so none is recorded.
                let (ptr, len) = self.borrow_host::<T>(&v, false, false)?;
                // SAFETY: as in `read`; the slice lives only for this copy.
                Ok(unsafe { std::slice::from_raw_parts(ptr.cast::<T>(), len) }.to_vec())
            }
        }
    }

    /// Overwrites a declared writable access covering `v` with `data`, on any
    /// backend (on CUDA: a copy on the task's stream, waited for).
    pub fn write_from_slice<T: bytemuck::Pod>(&self, v: impl AsView, data: &[T]) -> Result<()> {
        let v = v.as_view();
        let bytes: &[u8] = bytemuck::cast_slice(data);
        if bytes.len() != v.len() {
            return Err(Error::Misaligned {
                buffer: v.buf.name().to_string(),
                range: v.range(),
                ty: std::any::type_name::<T>(),
            });
        }
        match &self.device {
            DeviceCtx::Cuda(c) => {
                let ptr = self.device_ptr(&v, true)?;
                crate::backend::gpu::upload(c.stream(), ptr, bytes)
            }
            _ => {
                let (ptr, len) = self.borrow_host::<u8>(&v, true, false)?;
                // SAFETY: as in `write`; the slice lives only for this copy.
                unsafe { std::slice::from_raw_parts_mut(ptr, len) }.copy_from_slice(bytes);
                Ok(())
            }
        }
    }

    fn check_declared(&self, v: &View, write: bool) -> Result<()> {
        let ok = self.accesses.iter().any(|a| {
            a.view.buf.id() == v.buf.id()
                && a.view.start <= v.start
                && v.end <= a.view.end
                && (!write || a.mode.writes())
        });
        if ok {
            Ok(())
        } else {
            Err(Error::Undeclared {
                task: self.name.to_string(),
                buffer: v.buf.name().to_string(),
                range: v.range(),
                mode: if write { "write" } else { "read" },
            })
        }
    }

    /// Checks a host access to `v` and, with `keep`, records it as a borrow
    /// that lasts as long as the context.
    fn borrow_host<T>(&self, v: &View, write: bool, keep: bool) -> Result<(*mut u8, usize)> {
        self.check_declared(v, write)?;
        let sz = size_of::<T>();
        let base = v
            .buf
            .inner
            .storage
            .host_ptr()
            .ok_or_else(|| Error::WrongDevice {
                buffer: v.buf.name().to_string(),
                actual: v.buf.inner.storage.device_name(),
                wanted: "the host",
            })?;
        // SAFETY: `v.start <= v.end <= len` holds for every view (checked when
        // the view was made), so the offset stays inside the allocation.
        let ptr = unsafe { base.add(v.start) };
        if sz == 0 || v.len() % sz != 0 || (ptr as usize) % align_of::<T>() != 0 {
            return Err(Error::Misaligned {
                buffer: v.buf.name().to_string(),
                range: v.range(),
                ty: std::any::type_name::<T>(),
            });
        }
        let mut b = self.borrows.borrow_mut();
        let id = v.buf.id();
        if b.iter()
            .any(|&(bid, s, e, w)| bid == id && s < v.end && v.start < e && (w || write))
        {
            return Err(Error::BorrowConflict {
                task: self.name.to_string(),
                buffer: v.buf.name().to_string(),
                range: v.range(),
            });
        }
        if keep {
            b.push((id, v.start, v.end, write));
        }
        Ok((ptr, v.len() / sz))
    }
}

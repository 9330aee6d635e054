//! The C++ bridge of Braid, through [`cxx`].
//!
//! This crate builds `libbraid_cxx.a`: the engine, this bridge and the C++
//! task trampoline (`src/glue.cc`) in one static library. C++ programs use it
//! through `cpp/include/braid/braid.hpp`, an idiomatic C++17 layer (RAII
//! handles, `std::function` task bodies, exceptions) over the generated
//! header `braid-ffi/src/lib.rs.h`; nobody is meant to call the bridge
//! directly.
//!
//! # Boundary rules
//!
//! * **No Rust panic crosses into C++.** Every bridge function that can fail
//!   runs under [`guard`], which turns a panic into an `Err`; cxx turns an
//!   `Err` into a `rust::Error` exception on the C++ side, and braid.hpp
//!   rethrows it as `braid::Error`.
//! * **No C++ exception crosses into Rust.** A C++ task body is called only
//!   through `call_task` (glue.cc), which is `noexcept` and catches everything;
//!   a throwing body becomes the task's error, exactly like a Rust task body
//!   returning `Err`.
//! * **Declared means enforced.** A C++ body reaches buffer contents only via
//!   [`Ctx::read`] / [`Ctx::write`], which go through Braid's checked
//!   accessors ([`braid::TaskCtx::read`] / [`braid::TaskCtx::write`]): an
//!   undeclared access is an exception inside the body, which then fails the
//!   task with Braid's `Undeclared` message.

#![deny(unsafe_op_in_unsafe_fn)]

use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};

use cxx::UniquePtr;

#[cxx::bridge(namespace = "braid::ffi")]
mod bridge {
    /// Which device a runtime drives.
    #[derive(Debug)]
    enum BackendKind {
        Auto,
        Cpu,
        Cuda,
    }

    /// How tasks are spread over streams.
    #[derive(Debug)]
    enum Policy {
        Single,
        RoundRobin,
        Affinity,
    }

    /// What a task does.
    #[derive(Debug)]
    enum TaskKind {
        Compute,
        Comm,
        Copy,
        Host,
    }

    /// A scheduling hint.
    #[derive(Debug)]
    enum Priority {
        Main,
        Side,
        Comm,
    }

    /// How a task touches a view.
    #[derive(Debug)]
    enum Mode {
        Read,
        Write,
        ReadWrite,
    }

    /// How an all-reduce or reduce-scatter combines the ranks' elements.
    #[derive(Debug)]
    enum ReduceOp {
        Sum,
        Avg,
        Max,
        Min,
    }

    /// Element type of a collective's data.
    #[derive(Debug)]
    enum DType {
        F32,
        F64,
        I32,
        Bf16,
    }

    /// Which collective.
    #[derive(Debug)]
    enum CollectiveKind {
        AllReduce,
        ReduceScatter,
        AllGather,
        Broadcast,
    }

    /// One collective to submit (its data comes separately).
    #[derive(Debug)]
    struct CollectiveSpec {
        kind: CollectiveKind,
        /// For all-reduce and reduce-scatter.
        op: ReduceOp,
        /// For broadcast.
        root: usize,
        dtype: DType,
        /// The task's name; empty for the collective's own (`all_reduce`, …).
        name: String,
    }

    /// How one rank of `launch` ended.
    #[derive(Debug)]
    struct RankOutcome {
        ok: bool,
        /// Braid's message when it failed.
        error: String,
    }

    /// Everything `RuntimeBuilder` takes.
    #[derive(Debug)]
    struct RuntimeConfig {
        backend: BackendKind,
        /// CUDA device ordinal (with `BackendKind::Cuda`).
        device: usize,
        compute_streams: usize,
        comm_streams: usize,
        policy: Policy,
        launch_window: usize,
        profile: bool,
        /// Chrome trace written when the runtime drops; empty for none.
        trace: String,
        rank: usize,
    }

    /// A host slice handed to a C++ task body: `len` elements at address `ptr`.
    #[derive(Debug)]
    struct RawSlice {
        ptr: usize,
        len: usize,
    }

    /// Busy time of one stream.
    #[derive(Debug)]
    struct StreamBusy {
        name: String,
        busy_ns: u64,
        tasks: usize,
    }

    /// One task's execution, as the profile recorded it.
    #[derive(Debug)]
    struct SpanRecord {
        id: u64,
        name: String,
        kind: TaskKind,
        stream: usize,
        start_ns: u64,
        end_ns: u64,
        ok: bool,
    }

    /// The profile summary.
    #[derive(Debug)]
    struct SummaryRecord {
        tasks: usize,
        wall_ns: u64,
        streams: Vec<StreamBusy>,
        overlap_ns: u64,
        comm_ns: u64,
        comm_hidden_ns: u64,
        critical_path_ns: u64,
        /// The summary as Braid prints it.
        text: String,
    }

    extern "Rust" {
        type Runtime;
        type Buffer;
        type View;
        type TaskSpec;
        type TaskHandle;
        type Ctx;
        type Comm;
        type CommGroup;
        type Profile;
        type TraceSet;

        fn version() -> &'static str;
        fn default_config() -> RuntimeConfig;
        fn new_runtime(cfg: &RuntimeConfig) -> Result<Box<Runtime>>;

        fn backend_name(self: &Runtime) -> &'static str;
        fn streams(self: &Runtime) -> usize;
        fn compute_streams(self: &Runtime) -> usize;
        fn rank(self: &Runtime) -> usize;
        fn alloc(self: &Runtime, name: &str, bytes: usize) -> Result<Box<Buffer>>;
        fn upload(self: &Runtime, v: &View, data: &[u8]) -> Result<Box<TaskHandle>>;
        fn read_bytes(self: &Runtime, v: &View, elem_size: usize) -> Result<Vec<u8>>;
        fn submit(
            self: &Runtime,
            spec: Box<TaskSpec>,
            body: UniquePtr<TaskFn>,
        ) -> Result<Box<TaskHandle>>;
        fn synchronize(self: &Runtime) -> Result<()>;
        fn summary(self: &Runtime) -> SummaryRecord;
        fn spans(self: &Runtime) -> Vec<SpanRecord>;
        fn clear_profile(self: &Runtime);
        fn write_trace(self: &Runtime, path: &str) -> Result<()>;
        fn profile(self: &Runtime) -> Box<Profile>;

        fn rank(self: &Profile) -> usize;
        fn summary(self: &Profile) -> SummaryRecord;
        fn spans(self: &Profile) -> Vec<SpanRecord>;
        fn clone_profile(p: &Profile) -> Box<Profile>;
        fn new_trace_set() -> Box<TraceSet>;
        fn add(self: &mut TraceSet, p: &Profile);
        fn write(self: &TraceSet, path: &str) -> Result<()>;

        fn launch_local(
            world_size: usize,
            timeout_ms: u64,
            comm_stream: usize,
            body: UniquePtr<RankFn>,
        ) -> Result<Vec<RankOutcome>>;
        fn local_group(
            world_size: usize,
            timeout_ms: u64,
            comm_stream: usize,
        ) -> Result<Box<CommGroup>>;
        fn take(self: &mut CommGroup, rank: usize) -> Result<Box<Comm>>;

        fn clone_comm(c: &Comm) -> Box<Comm>;
        fn rank(self: &Comm) -> usize;
        fn world_size(self: &Comm) -> usize;
        fn comm_stream(self: &Comm) -> usize;
        fn backend(self: &Comm) -> &'static str;
        fn issued(self: &Comm) -> u64;
        fn poisoned(self: &Comm) -> String;
        fn abort(self: &Comm, reason: &str);
        fn submit_in_place(
            self: &Comm,
            rt: &Runtime,
            spec: &CollectiveSpec,
            v: &View,
        ) -> Result<Box<TaskHandle>>;
        fn submit_out_of_place(
            self: &Comm,
            rt: &Runtime,
            spec: &CollectiveSpec,
            send: &View,
            recv: &View,
        ) -> Result<Box<TaskHandle>>;
        fn barrier(self: &Comm, rt: &Runtime, name: &str) -> Result<Box<TaskHandle>>;

        fn len(self: &Buffer) -> usize;
        fn name(self: &Buffer) -> &str;
        fn clone_buffer(b: &Buffer) -> Box<Buffer>;
        fn whole(self: &Buffer) -> Box<View>;
        fn view(self: &Buffer, start: usize, end: usize) -> Result<Box<View>>;

        fn clone_view(v: &View) -> Box<View>;
        fn sub_view(self: &View, start: usize, end: usize) -> Result<Box<View>>;
        fn start(self: &View) -> usize;
        fn end(self: &View) -> usize;
        fn len(self: &View) -> usize;
        fn buffer(self: &View) -> Box<Buffer>;

        fn new_task(name: &str) -> Box<TaskSpec>;
        fn access(self: &mut TaskSpec, v: &View, mode: Mode);
        fn set_kind(self: &mut TaskSpec, kind: TaskKind);
        fn set_priority(self: &mut TaskSpec, p: Priority);
        fn after(self: &mut TaskSpec, h: &TaskHandle);
        fn on_stream(self: &mut TaskSpec, index: usize);
        fn comm_stream(self: &mut TaskSpec, index: usize);

        fn clone_handle(h: &TaskHandle) -> Box<TaskHandle>;
        fn wait(self: &TaskHandle) -> Result<()>;
        fn name(self: &TaskHandle) -> &str;
        fn stream(self: &TaskHandle) -> usize;
        fn is_done(self: &TaskHandle) -> bool;

        fn name(self: &Ctx) -> &str;
        fn stream_index(self: &Ctx) -> usize;
        fn rank(self: &Ctx) -> usize;
        fn is_cpu(self: &Ctx) -> bool;
        fn cuda_stream(self: &Ctx) -> usize;
        fn read(self: &Ctx, v: &View, elem_size: usize, elem_align: usize) -> Result<RawSlice>;
        fn write(self: &Ctx, v: &View, elem_size: usize, elem_align: usize) -> Result<RawSlice>;
        fn device_ptr(self: &Ctx, v: &View, write: bool) -> Result<u64>;
    }

    unsafe extern "C++" {
        include!("braid-ffi/src/glue.h");

        /// A C++ task body (`std::function<void(const Ctx&)>`).
        type TaskFn;

        /// Runs the body; never throws. `false` and a message when it threw.
        fn call_task(f: Pin<&mut TaskFn>, ctx: &Ctx, error: &mut String) -> bool;

        /// A C++ rank function for `launch_local`
        /// (`std::function<void(std::size_t, const Comm&)>`).
        type RankFn;

        /// Runs the rank function of `rank`; never throws. `false` and a
        /// message when it threw. Called concurrently from every rank's thread.
        fn call_rank(f: &RankFn, rank: usize, comm: &Comm, error: &mut String) -> bool;
    }
}

pub use bridge::{
    BackendKind, CollectiveKind, CollectiveSpec, DType, Mode, Policy, Priority, RankOutcome,
    RawSlice, ReduceOp, RuntimeConfig, SpanRecord, StreamBusy, SummaryRecord, TaskKind,
};

/// The error every fallible bridge function returns; cxx throws it in C++ as
/// `rust::Error` with this message.
#[derive(Debug, Clone)]
pub struct FfiError(pub String);

impl fmt::Display for FfiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for FfiError {}

impl From<braid::Error> for FfiError {
    fn from(e: braid::Error) -> Self {
        FfiError(e.to_string())
    }
}

type FfiResult<T> = Result<T, FfiError>;

/// Runs `f`, turning a panic into an error so that it never unwinds into C++.
fn guard<T>(what: &str, f: impl FnOnce() -> Result<T, braid::Error>) -> FfiResult<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r.map_err(FfiError::from),
        Err(p) => {
            let msg = p
                .downcast_ref::<&str>()
                .map(|s| (*s).to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "non-string panic payload".into());
            Err(FfiError(format!("braid panicked in {what}: {msg}")))
        }
    }
}

fn version() -> &'static str {
    env!("CARGO_PKG_VERSION")
}

fn default_config() -> RuntimeConfig {
    RuntimeConfig {
        backend: BackendKind::Auto,
        device: 0,
        compute_streams: 2,
        comm_streams: 1,
        policy: Policy::Affinity,
        launch_window: 4096,
        profile: false,
        trace: String::new(),
        rank: 0,
    }
}

fn to_error(what: &str) -> braid::Error {
    braid::Error::Config(format!(
        "unknown {what} (the C++ enum holds a value Braid does not know)"
    ))
}

fn new_runtime(cfg: &RuntimeConfig) -> FfiResult<Box<Runtime>> {
    guard("Runtime::build", || {
        let backend = match cfg.backend {
            BackendKind::Auto => braid::BackendKind::Auto,
            BackendKind::Cpu => braid::BackendKind::Cpu,
            BackendKind::Cuda => braid::BackendKind::Cuda { device: cfg.device },
            _ => return Err(to_error("backend")),
        };
        let policy = match cfg.policy {
            Policy::Single => braid::Policy::Single,
            Policy::RoundRobin => braid::Policy::RoundRobin,
            Policy::Affinity => braid::Policy::Affinity,
            _ => return Err(to_error("policy")),
        };
        let mut b = braid::Runtime::builder()
            .backend(backend)
            .compute_streams(cfg.compute_streams)
            .comm_streams(cfg.comm_streams)
            .policy(policy)
            .launch_window(cfg.launch_window)
            .profile(cfg.profile)
            .rank(cfg.rank);
        if !cfg.trace.is_empty() {
            b = b.trace(cfg.trace.as_str());
        }
        Ok(Box::new(Runtime(b.build()?)))
    })
}

/// A Braid runtime owned by C++ (`braid::Runtime`).
#[derive(Debug)]
pub struct Runtime(pub braid::Runtime);

impl Runtime {
    fn backend_name(&self) -> &'static str {
        self.0.backend_name()
    }

    fn streams(&self) -> usize {
        self.0.streams()
    }

    fn compute_streams(&self) -> usize {
        self.0.compute_streams()
    }

    fn rank(&self) -> usize {
        self.0.rank()
    }

    fn alloc(&self, name: &str, bytes: usize) -> FfiResult<Box<Buffer>> {
        guard("Runtime::alloc", || {
            Ok(Box::new(Buffer(self.0.alloc(name.to_string(), bytes)?)))
        })
    }

    fn upload(&self, v: &View, data: &[u8]) -> FfiResult<Box<TaskHandle>> {
        guard("Runtime::upload", || {
            Ok(Box::new(TaskHandle(self.0.upload(&v.0, data)?)))
        })
    }

    fn read_bytes(&self, v: &View, elem_size: usize) -> FfiResult<Vec<u8>> {
        guard("Runtime::read_vec", || {
            if elem_size == 0 || v.0.len() % elem_size != 0 {
                return Err(braid::Error::Misaligned {
                    buffer: v.0.buffer().name().to_string(),
                    range: v.0.range(),
                    ty: element_name(elem_size),
                });
            }
            self.0.read_vec::<u8>(&v.0)
        })
    }

    fn submit(
        &self,
        spec: Box<TaskSpec>,
        body: UniquePtr<bridge::TaskFn>,
    ) -> FfiResult<Box<TaskHandle>> {
        guard("TaskBuilder::run", || {
            if body.is_null() {
                return Err(braid::Error::Config(format!(
                    "task `{}` was submitted without a body",
                    spec.name
                )));
            }
            let TaskSpec {
                name,
                accesses,
                kind,
                priority,
                after,
                stream,
                comm_index,
            } = *spec;
            let mut b = self
                .0
                .task(name)
                .kind(kind)
                .priority(priority)
                .comm_stream(comm_index);
            for (v, m) in accesses {
                b = b.access(v, m);
            }
            for h in &after {
                b = b.after(h);
            }
            if let Some(s) = stream {
                b = b.on_stream(s);
            }
            let body = CppBody(body);
            Ok(Box::new(TaskHandle(b.run_ctx(move |ctx| body.call(ctx))?)))
        })
    }

    fn synchronize(&self) -> FfiResult<()> {
        guard("Runtime::synchronize", || self.0.synchronize())
    }

    fn summary(&self) -> SummaryRecord {
        summary_record(&self.0.profile())
    }

    fn spans(&self) -> Vec<SpanRecord> {
        span_records(&self.0.profile())
    }

    fn clear_profile(&self) {
        self.0.clear_profile()
    }

    fn write_trace(&self, path: &str) -> FfiResult<()> {
        guard("Runtime::write_trace", || self.0.write_trace(path))
    }

    fn profile(&self) -> Box<Profile> {
        Box::new(Profile(self.0.profile()))
    }
}

fn summary_record(p: &braid::trace::Profile) -> SummaryRecord {
    let s = p.summary();
    SummaryRecord {
        tasks: s.tasks,
        wall_ns: s.wall_ns,
        streams: s
            .streams
            .iter()
            .map(|b| StreamBusy {
                name: b.name.clone(),
                busy_ns: b.busy_ns,
                tasks: b.tasks,
            })
            .collect(),
        overlap_ns: s.overlap_ns,
        comm_ns: s.comm_ns,
        comm_hidden_ns: s.comm_hidden_ns,
        critical_path_ns: s.critical_path_ns,
        text: s.to_string(),
    }
}

fn span_records(p: &braid::trace::Profile) -> Vec<SpanRecord> {
    p.spans
        .iter()
        .map(|s| SpanRecord {
            id: s.id,
            name: s.name.to_string(),
            kind: kind_to_ffi(s.kind),
            stream: s.stream,
            start_ns: s.start_ns,
            end_ns: s.end_ns,
            ok: s.ok,
        })
        .collect()
}

fn kind_to_ffi(k: braid::TaskKind) -> TaskKind {
    match k {
        braid::TaskKind::Compute => TaskKind::Compute,
        braid::TaskKind::Comm => TaskKind::Comm,
        braid::TaskKind::Copy => TaskKind::Copy,
        braid::TaskKind::Host => TaskKind::Host,
    }
}

fn element_name(size: usize) -> &'static str {
    match size {
        1 => "a 1-byte C++ element",
        2 => "a 2-byte C++ element",
        4 => "a 4-byte C++ element",
        8 => "an 8-byte C++ element",
        16 => "a 16-byte C++ element",
        _ => "the C++ element type",
    }
}

/// A C++ task body on its way to a stream thread.
struct CppBody(UniquePtr<bridge::TaskFn>);

// SAFETY: the body is moved to exactly one stream thread, which calls it at most
// once and then drops it; no other thread touches it after submission, so the
// only requirement is that a `std::function` may be invoked and destroyed on a
// thread other than the one that built it. That holds for `std::function`
// itself; what the user's lambda captures is the user's responsibility, as it
// is for any C++ callback run on a worker thread (documented in braid.hpp).
unsafe impl Send for CppBody {}

impl CppBody {
    /// Calls the body (taking `self` whole, so the closure captures the `Send`
    /// wrapper rather than the bare `UniquePtr`).
    fn call(mut self, ctx: &braid::TaskCtx<'_>) -> Result<(), braid::TaskError> {
        let ctx = Ctx {
            ptr: (ctx as *const braid::TaskCtx<'_>).cast::<braid::TaskCtx<'static>>(),
        };
        let mut error = String::new();
        if bridge::call_task(self.0.pin_mut(), &ctx, &mut error) {
            Ok(())
        } else {
            Err(error.into())
        }
    }
}

/// A buffer handle owned by C++ (`braid::Buffer`).
#[derive(Debug, Clone)]
pub struct Buffer(pub braid::Buffer);

impl Buffer {
    fn len(&self) -> usize {
        self.0.len()
    }

    fn name(&self) -> &str {
        self.0.name()
    }

    fn whole(&self) -> Box<View> {
        Box::new(View(self.0.whole()))
    }

    fn view(&self, start: usize, end: usize) -> FfiResult<Box<View>> {
        guard("Buffer::view", || {
            Ok(Box::new(View(self.0.view(start..end)?)))
        })
    }
}

fn clone_buffer(b: &Buffer) -> Box<Buffer> {
    Box::new(b.clone())
}

/// A view handle owned by C++ (`braid::View`).
#[derive(Debug, Clone)]
pub struct View(pub braid::View);

impl View {
    fn sub_view(&self, start: usize, end: usize) -> FfiResult<Box<View>> {
        guard("View::view", || {
            Ok(Box::new(View(self.0.view(start..end)?)))
        })
    }

    fn start(&self) -> usize {
        self.0.range().start
    }

    fn end(&self) -> usize {
        self.0.range().end
    }

    fn len(&self) -> usize {
        self.0.len()
    }

    fn buffer(&self) -> Box<Buffer> {
        Box::new(Buffer(self.0.buffer().clone()))
    }
}

fn clone_view(v: &View) -> Box<View> {
    Box::new(v.clone())
}

/// A task being built on the C++ side (`braid::TaskBuilder`); submitted by
/// [`Runtime::submit`].
#[derive(Debug)]
pub struct TaskSpec {
    name: String,
    accesses: Vec<(braid::View, braid::Mode)>,
    kind: braid::TaskKind,
    priority: braid::Priority,
    after: Vec<braid::TaskHandle>,
    stream: Option<usize>,
    comm_index: usize,
}

fn new_task(name: &str) -> Box<TaskSpec> {
    Box::new(TaskSpec {
        name: name.to_string(),
        accesses: Vec::new(),
        kind: braid::TaskKind::Compute,
        priority: braid::Priority::Main,
        after: Vec::new(),
        stream: None,
        comm_index: 0,
    })
}

impl TaskSpec {
    fn access(&mut self, v: &View, mode: Mode) {
        let mode = match mode {
            Mode::Read => braid::Mode::Read,
            Mode::Write => braid::Mode::Write,
            // An unknown value is treated as the strictest mode.
            _ => braid::Mode::ReadWrite,
        };
        self.accesses.push((v.0.clone(), mode));
    }

    fn set_kind(&mut self, kind: TaskKind) {
        self.kind = match kind {
            TaskKind::Comm => braid::TaskKind::Comm,
            TaskKind::Copy => braid::TaskKind::Copy,
            TaskKind::Host => braid::TaskKind::Host,
            _ => braid::TaskKind::Compute,
        };
        // As `braid::TaskBuilder::kind` does: communication gets comm priority.
        if self.kind == braid::TaskKind::Comm {
            self.priority = braid::Priority::Comm;
        }
    }

    fn set_priority(&mut self, p: Priority) {
        self.priority = match p {
            Priority::Side => braid::Priority::Side,
            Priority::Comm => braid::Priority::Comm,
            _ => braid::Priority::Main,
        };
    }

    fn after(&mut self, h: &TaskHandle) {
        self.after.push(h.0.clone());
    }

    fn on_stream(&mut self, index: usize) {
        self.stream = Some(index);
    }

    fn comm_stream(&mut self, index: usize) {
        self.comm_index = index;
    }
}

/// A submitted task (`braid::TaskHandle`).
#[derive(Debug, Clone)]
pub struct TaskHandle(pub braid::TaskHandle);

impl TaskHandle {
    fn wait(&self) -> FfiResult<()> {
        guard("TaskHandle::wait", || self.0.wait())
    }

    fn name(&self) -> &str {
        self.0.name()
    }

    fn stream(&self) -> usize {
        self.0.stream()
    }

    fn is_done(&self) -> bool {
        self.0.is_done()
    }
}

fn clone_handle(h: &TaskHandle) -> Box<TaskHandle> {
    Box::new(h.clone())
}

/// The running task's context as a C++ body sees it (`braid::TaskContext`).
///
/// It is made only by [`CppBody::call`], on its stack, around the one call of
/// the body, and C++ cannot make, copy or move an opaque Rust type; so the
/// pointer it holds is valid whenever one of its methods runs (a C++ body that
/// keeps the reference past its return holds a dangling reference, as with any
/// C++ callback argument). The lifetime is erased only because cxx cannot name
/// it in safe bridge functions.
pub struct Ctx {
    ptr: *const braid::TaskCtx<'static>,
}

impl fmt::Debug for Ctx {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.inner().fmt(f)
    }
}

impl Ctx {
    fn inner(&self) -> &braid::TaskCtx<'_> {
        // SAFETY: see the type's comment: `ptr` points to the task context that
        // `CppBody::call` borrowed for the whole life of this `Ctx`.
        unsafe { &*self.ptr }
    }

    fn name(&self) -> &str {
        self.inner().name()
    }

    fn stream_index(&self) -> usize {
        self.inner().stream_index()
    }

    fn rank(&self) -> usize {
        self.inner().rank()
    }

    fn is_cpu(&self) -> bool {
        self.inner().device().is_cpu()
    }

    /// The raw CUDA stream (`CUstream`) the task runs on, as an address; 0 on
    /// the CPU.
    fn cuda_stream(&self) -> usize {
        self.inner().device().cuda_stream() as usize
    }

    /// Checks that `v` is a whole, aligned slice of elements of `size` bytes
    /// before borrowing it (host memory is 64-byte aligned, so the view's
    /// offset decides the alignment).
    fn check_typed(v: &braid::View, size: usize, align: usize) -> braid::Result<()> {
        let ok = size != 0
            && align != 0
            && align.is_power_of_two()
            && v.len() % size == 0
            && v.range().start % align == 0;
        if ok {
            Ok(())
        } else {
            Err(braid::Error::Misaligned {
                buffer: v.buffer().name().to_string(),
                range: v.range(),
                ty: element_name(size),
            })
        }
    }

    fn read(&self, v: &View, elem_size: usize, elem_align: usize) -> FfiResult<RawSlice> {
        guard("TaskContext::read", || {
            Self::check_typed(&v.0, elem_size, elem_align)?;
            let bytes = self.inner().read::<u8>(&v.0)?;
            Ok(RawSlice {
                ptr: bytes.as_ptr() as usize,
                len: bytes.len() / elem_size,
            })
        })
    }

    fn write(&self, v: &View, elem_size: usize, elem_align: usize) -> FfiResult<RawSlice> {
        guard("TaskContext::write", || {
            Self::check_typed(&v.0, elem_size, elem_align)?;
            let bytes = self.inner().write::<u8>(&v.0)?;
            Ok(RawSlice {
                ptr: bytes.as_mut_ptr() as usize,
                len: bytes.len() / elem_size,
            })
        })
    }

    fn device_ptr(&self, v: &View, write: bool) -> FfiResult<u64> {
        guard("TaskContext::device_ptr", || {
            self.inner().device_ptr(&v.0, write)
        })
    }
}

/// A snapshot of a runtime's recorded spans (`braid::Profile`).
#[derive(Debug, Clone)]
pub struct Profile(pub braid::trace::Profile);

impl Profile {
    fn rank(&self) -> usize {
        self.0.rank
    }

    fn summary(&self) -> SummaryRecord {
        summary_record(&self.0)
    }

    fn spans(&self) -> Vec<SpanRecord> {
        span_records(&self.0)
    }
}

fn clone_profile(p: &Profile) -> Box<Profile> {
    Box::new(p.clone())
}

/// Profiles to write into one Chrome trace (one process per rank).
#[derive(Debug, Default)]
pub struct TraceSet(Vec<braid::trace::Profile>);

fn new_trace_set() -> Box<TraceSet> {
    Box::default()
}

impl TraceSet {
    fn add(&mut self, p: &Profile) {
        self.0.push(p.0.clone());
    }

    fn write(&self, path: &str) -> FfiResult<()> {
        guard("write_trace", || {
            let refs: Vec<&braid::trace::Profile> = self.0.iter().collect();
            braid::trace::write_chrome_trace(path, &refs)
        })
    }
}

fn local_config(timeout_ms: u64, comm_stream: usize) -> braid::LocalCommConfig {
    let mut cfg =
        braid::LocalCommConfig::default().timeout(std::time::Duration::from_millis(timeout_ms));
    cfg.comm_stream = comm_stream;
    cfg
}

/// A C++ rank function shared by the rank threads of [`launch_local`].
struct CppRankFn(UniquePtr<bridge::RankFn>);

// SAFETY: the rank function is only ever called through a shared reference
// (`std::function::operator()` is const) and dropped once, after every rank
// thread has been joined. Calling it from several threads at once is what
// `braid::launch` documents; its captures must allow that, as for any C++
// function handed to a thread pool.
unsafe impl Sync for CppRankFn {}
// SAFETY: as above; the launcher only borrows it across its scoped threads.
unsafe impl Send for CppRankFn {}

impl CppRankFn {
    /// Calls the rank function (a method, so closures capture the `Sync`
    /// wrapper rather than the bare `UniquePtr`).
    fn call(&self, rank: usize, comm: braid::Comm) -> braid::Result<()> {
        let Some(f) = self.0.as_ref() else {
            return Err(braid::Error::Config(
                "launch was given an empty rank function".into(),
            ));
        };
        let comm = Comm(comm);
        let mut error = String::new();
        if bridge::call_rank(f, rank, &comm, &mut error) {
            Ok(())
        } else {
            Err(braid::Error::TaskFailed {
                task: format!("rank {rank}"),
                message: error,
            })
        }
    }
}

/// Runs the C++ rank function on `world_size` CPU rank threads
/// ([`braid::launch_with`]); one outcome per rank, in rank order.
fn launch_local(
    world_size: usize,
    timeout_ms: u64,
    comm_stream: usize,
    body: UniquePtr<bridge::RankFn>,
) -> FfiResult<Vec<RankOutcome>> {
    guard("launch", || {
        if world_size == 0 {
            return Err(braid::Error::Config(
                "launch needs at least one rank".into(),
            ));
        }
        if body.is_null() {
            return Err(braid::Error::Config(
                "launch was given an empty rank function".into(),
            ));
        }
        let f = CppRankFn(body);
        let results = braid::launch_with(
            world_size,
            local_config(timeout_ms, comm_stream),
            |rank, comm| f.call(rank, comm),
        );
        Ok(results
            .into_iter()
            .map(|r| match r {
                Ok(()) => RankOutcome {
                    ok: true,
                    error: String::new(),
                },
                Err(e) => RankOutcome {
                    ok: false,
                    error: e.to_string(),
                },
            })
            .collect())
    })
}

/// The communicators of a group of CPU ranks, handed out one by one (for
/// programs that start their rank threads themselves).
#[derive(Debug)]
pub struct CommGroup(Vec<Option<braid::LocalComm>>);

fn local_group(
    world_size: usize,
    timeout_ms: u64,
    comm_stream: usize,
) -> FfiResult<Box<CommGroup>> {
    guard("local_group", || {
        if world_size == 0 {
            return Err(braid::Error::Config(
                "a group needs at least one rank".into(),
            ));
        }
        let comms = braid::LocalComm::group(world_size, local_config(timeout_ms, comm_stream));
        Ok(Box::new(CommGroup(comms.into_iter().map(Some).collect())))
    })
}

impl CommGroup {
    fn take(&mut self, rank: usize) -> FfiResult<Box<Comm>> {
        guard("local_group", || {
            let world = self.0.len();
            match self.0.get_mut(rank).map(Option::take) {
                Some(Some(c)) => Ok(Box::new(Comm(braid::Comm::new(c)))),
                Some(None) => Err(braid::Error::Config(format!(
                    "the communicator of rank {rank} was already taken"
                ))),
                None => Err(braid::Error::Config(format!(
                    "rank {rank} is not a rank of a group of {world}"
                ))),
            }
        })
    }
}

/// A communicator (`braid::Communicator`): submits collectives as tasks.
#[derive(Debug, Clone)]
pub struct Comm(pub braid::Comm);

fn clone_comm(c: &Comm) -> Box<Comm> {
    Box::new(c.clone())
}

fn reduce_op(op: ReduceOp) -> braid::Result<braid::comm::ReduceOp> {
    Ok(match op {
        ReduceOp::Sum => braid::comm::ReduceOp::Sum,
        ReduceOp::Avg => braid::comm::ReduceOp::Avg,
        ReduceOp::Max => braid::comm::ReduceOp::Max,
        ReduceOp::Min => braid::comm::ReduceOp::Min,
        _ => return Err(to_error("reduce operation")),
    })
}

fn collective(
    spec: &CollectiveSpec,
) -> braid::Result<(braid::comm::CollectiveKind, braid::comm::DType)> {
    use braid::comm::CollectiveKind as K;
    let kind = match spec.kind {
        CollectiveKind::AllReduce => K::AllReduce(reduce_op(spec.op)?),
        CollectiveKind::ReduceScatter => K::ReduceScatter(reduce_op(spec.op)?),
        CollectiveKind::AllGather => K::AllGather,
        CollectiveKind::Broadcast => K::Broadcast { root: spec.root },
        _ => return Err(to_error("collective")),
    };
    let dtype = match spec.dtype {
        DType::F32 => braid::comm::DType::F32,
        DType::F64 => braid::comm::DType::F64,
        DType::I32 => braid::comm::DType::I32,
        DType::Bf16 => braid::comm::DType::Bf16,
        _ => return Err(to_error("element type")),
    };
    Ok((kind, dtype))
}

impl Comm {
    fn rank(&self) -> usize {
        self.0.rank()
    }

    fn world_size(&self) -> usize {
        self.0.world_size()
    }

    fn comm_stream(&self) -> usize {
        self.0.comm_stream()
    }

    fn backend(&self) -> &'static str {
        self.0.communicator().backend()
    }

    fn issued(&self) -> u64 {
        self.0.issued()
    }

    fn poisoned(&self) -> String {
        self.0.poisoned().map(|e| e.to_string()).unwrap_or_default()
    }

    fn abort(&self, reason: &str) {
        self.0.abort(reason)
    }

    fn submit_with(
        &self,
        rt: &Runtime,
        spec: &CollectiveSpec,
        buffers: braid::comm::Buffers,
    ) -> braid::Result<Box<TaskHandle>> {
        let (kind, dtype) = collective(spec)?;
        let name = if spec.name.is_empty() {
            kind.name().to_string()
        } else {
            spec.name.clone()
        };
        Ok(Box::new(TaskHandle(
            self.0
                .bind(&rt.0)?
                .submit_named(name, kind, dtype, buffers)?,
        )))
    }

    fn submit_in_place(
        &self,
        rt: &Runtime,
        spec: &CollectiveSpec,
        v: &View,
    ) -> FfiResult<Box<TaskHandle>> {
        guard("Communicator::submit", || {
            self.submit_with(rt, spec, braid::comm::Buffers::InPlace(v.0.clone()))
        })
    }

    fn submit_out_of_place(
        &self,
        rt: &Runtime,
        spec: &CollectiveSpec,
        send: &View,
        recv: &View,
    ) -> FfiResult<Box<TaskHandle>> {
        guard("Communicator::submit", || {
            let buffers = braid::comm::Buffers::OutOfPlace {
                send: send.0.clone(),
                recv: recv.0.clone(),
            };
            self.submit_with(rt, spec, buffers)
        })
    }

    fn barrier(&self, rt: &Runtime, name: &str) -> FfiResult<Box<TaskHandle>> {
        guard("Communicator::barrier", || {
            let name = if name.is_empty() { "barrier" } else { name };
            let h = self.0.bind(&rt.0)?.submit_named(
                name.to_string(),
                braid::comm::CollectiveKind::Barrier,
                braid::comm::DType::F32,
                braid::comm::Buffers::None,
            )?;
            Ok(Box::new(TaskHandle(h)))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cpu(profile: bool) -> Box<Runtime> {
        let mut cfg = default_config();
        cfg.backend = BackendKind::Cpu;
        cfg.profile = profile;
        new_runtime(&cfg).expect("cpu runtime")
    }

    #[test]
    fn buffers_views_and_readback() {
        let rt = cpu(false);
        let b = rt.alloc("x", 16).unwrap();
        let v = b.view(4, 12).unwrap();
        assert_eq!((v.start(), v.end(), v.len()), (4, 12, 8));
        let data: Vec<u8> = (0..8).collect();
        rt.upload(&v, &data).unwrap().wait().unwrap();
        let back = rt.read_bytes(&b.whole(), 4).unwrap();
        assert_eq!(&back[4..12], &data[..]);
        let err = b.view(8, 32).unwrap_err();
        assert!(err.0.contains("out of bounds"), "{err}");
        assert!(rt.read_bytes(&v, 3).is_err());
    }

    #[test]
    fn config_errors_are_errors() {
        let mut cfg = default_config();
        cfg.backend = BackendKind::Cpu;
        cfg.compute_streams = 0;
        assert!(new_runtime(&cfg).is_err());
    }

    #[test]
    fn typed_checks() {
        let rt = cpu(false);
        let b = rt.alloc("x", 16).unwrap();
        assert!(Ctx::check_typed(&b.0.view(0..16).unwrap(), 4, 4).is_ok());
        assert!(Ctx::check_typed(&b.0.view(2..6).unwrap(), 4, 4).is_err());
        assert!(Ctx::check_typed(&b.0.view(0..6).unwrap(), 4, 4).is_err());
        assert!(Ctx::check_typed(&b.0.view(0..6).unwrap(), 0, 1).is_err());
    }

    #[test]
    fn guard_turns_panics_into_errors() {
        let e = guard::<()>("test", || panic!("boom")).unwrap_err();
        assert!(e.0.contains("boom") && e.0.contains("test"), "{e}");
    }
}

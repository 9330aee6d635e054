//! The C++ bridge of Braid, through [`cxx`].
//!
//! This crate builds `libbraid_cxx.a`: the engine, this bridge and the C++
//! task trampoline (`src/glue.cc`) in one static library. C++ programs use it
//! through `cpp/include/braid/braid.hpp`, an idiomatic C++17 layer (RAII
//! handles, typed access tokens, exceptions) over the generated header
//! `braid-ffi/src/lib.rs.h`; nobody is meant to call the bridge directly.
//!
//! # Boundary rules
//!
//! * **No Rust panic crosses into C++.** Every bridge function that can fail
//!   runs under `guard`, which turns a panic into an `Err`; cxx turns an
//!   `Err` into a `rust::Error` exception on the C++ side, and braid.hpp
//!   rethrows it as `braid::Error`.
//! * **No C++ exception crosses into Rust.** A C++ task body is called only
//!   through `call_host` / `call_cuda` (glue.cc), which are `noexcept` and
//!   catch everything; a throwing body becomes the task's error, exactly like
//!   a Rust task body returning `Err`.
//! * **Declared means enforced, and declared once.** A C++ task names each
//!   access once, as a typed token (`braid::read<float>(x)`); the header
//!   declares the tokens here (`TaskSpec::access`: view, mode, element size
//!   and alignment) and the task is submitted with them as a
//!   `Vec<`[`braid::DynAccess`]`>` through [`braid::TaskBuilder::run_any`]
//!   (or `run` / `run_cuda` when C++ gave one body). The body gets exactly the
//!   bytes of those accesses, in declaration order ([`RawAccess`]), and the
//!   header's trampoline turns them into the lambda's typed spans:
//!   `braid::Span<const T>` for a read, `braid::Span<T>` for a write. A view
//!   that is not a whole, aligned run of its element type, and two tokens that
//!   overlap where one writes, are refused at submission.

#![deny(unsafe_op_in_unsafe_fn)]

use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use braid::{CudaTaskCtx, DevBytes, HostBytes};
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

    /// A program's priority class among the runtimes of a process
    /// (docs/tenants.md).
    #[derive(Debug)]
    enum Class {
        LatencyCritical,
        Normal,
        BestEffort,
    }

    /// A builder setting whose default depends on the backend
    /// (`RuntimeBuilder::graphs`, `RuntimeBuilder::placement_trial`: on for
    /// CUDA), or as asked.
    #[derive(Debug)]
    enum Switch {
        Default,
        On,
        Off,
    }

    /// What a schedule's placement trial measured and kept
    /// (`braid::Schedule::placement_trial`); `decided` false before (or
    /// without a trial), the rest 0 then.
    #[derive(Debug)]
    struct TrialRecord {
        decided: bool,
        recorded_ns: u64,
        one_stream_ns: u64,
        kept_one_stream: bool,
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
        /// A placement file (docs/scopes.md) read at build; empty for none
        /// (then `BRAID_PLACEMENT`, if set).
        placement: String,
        /// The program's priority class.
        tenant_class: Class,
        /// `tenant_class` was set (`priority_class`): it then wins over a
        /// placement file's class, which applies otherwise.
        tenant_class_set: bool,
        /// The live view's socket (`braid top`); empty for none (then
        /// `BRAID_LIVE`, if set).
        live: String,
        /// Replays run as one unit (`RuntimeBuilder::graphs`).
        graphs: Switch,
        /// Collectives captured into those units
        /// (`RuntimeBuilder::graph_collectives`).
        graph_collectives: bool,
        /// Recorded placements timed against one stream
        /// (`RuntimeBuilder::placement_trial`).
        placement_trial: Switch,
        /// Repeated steps are memoised (`RuntimeBuilder::auto_replay`).
        auto_replay: bool,
        /// Short tasks may run on the submitting thread
        /// (`RuntimeBuilder::inline_short_tasks`).
        inline_short_tasks: bool,
        /// The CPU cores the process may use, as this runtime counts them
        /// (`RuntimeBuilder::cpu_cores`); 0: the default (`BRAID_CPU_CORES`
        /// when set, else the cores detected).
        cpu_cores: usize,
        /// Affinity placement uses every compute stream whatever the core
        /// budget (`RuntimeBuilder::oversubscribe`).
        oversubscribe: bool,
        /// A latency-critical runtime's threads at a real-time policy
        /// (`RuntimeBuilder::realtime`).
        realtime: bool,
        /// On CUDA, SMs the compute streams leave to other programs
        /// (`RuntimeBuilder::spare_sms`; 0: none).
        spare_sms: u32,
        /// A best-effort CUDA runtime's launch window in µs
        /// (`RuntimeBuilder::device_bundle`; negative: the builder's, 1 ms;
        /// 0 is refused at build).
        device_bundle_us: i64,
    }

    /// The bytes of one declared access as a C++ body gets them: a host
    /// address on the CPU, a device address on CUDA.
    #[derive(Debug)]
    struct RawAccess {
        addr: usize,
        /// Length in bytes (a whole number of the token's elements).
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
        /// The scope it was submitted in; empty outside any scope.
        scope: String,
    }

    /// What the scheduler did (`braid::Stats`; see its fields).
    #[derive(Debug)]
    struct StatsRecord {
        tasks: u64,
        edges: u64,
        waits: u64,
        elided_waits: u64,
        replays: u64,
        replayed_tasks: u64,
        auto_replayed: u64,
        auto_divergences: u64,
        graph_replays: u64,
        inline_tasks: u64,
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
        comm_wait_ns: u64,
        transfer_ns: u64,
        transfer_hidden_ns: u64,
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
        type Schedule;
        type Comm;
        type CommGroup;
        type Profile;
        type TraceSet;
        type Scope;

        fn version() -> &'static str;
        fn default_config() -> RuntimeConfig;
        fn new_runtime(cfg: &RuntimeConfig) -> Result<Box<Runtime>>;

        fn backend_name(self: &Runtime) -> &'static str;
        fn streams(self: &Runtime) -> usize;
        fn compute_streams(self: &Runtime) -> usize;
        fn rank(self: &Runtime) -> usize;
        fn priority_class(self: &Runtime) -> Class;
        fn spared_sms(self: &Runtime) -> u32;
        fn alloc(self: &Runtime, name: &str, bytes: usize) -> Result<Box<Buffer>>;
        fn upload(self: &Runtime, v: &View, data: &[u8]) -> Result<Box<TaskHandle>>;
        fn read_bytes(self: &Runtime, v: &View, elem_size: usize) -> Result<Vec<u8>>;
        fn new_task(self: &Runtime, name: &str) -> Box<TaskSpec>;
        fn submit_task(spec: Box<TaskSpec>, body: UniquePtr<TaskFn>) -> Result<Box<TaskHandle>>;
        fn synchronize(self: &Runtime) -> Result<()>;
        fn enter_scope(self: &Runtime, name: &str) -> Result<Box<Scope>>;
        fn current_scope(self: &Runtime) -> String;
        fn path(self: &Scope) -> String;
        fn record(
            self: &Runtime,
            name: &str,
            program: UniquePtr<RecordFn>,
        ) -> Result<Box<Schedule>>;
        fn replay(self: &Schedule) -> Result<Box<TaskHandle>>;
        fn len(self: &Schedule) -> usize;
        fn name(self: &Schedule) -> String;
        fn placement_streams(self: &Schedule) -> usize;
        fn placement_waits(self: &Schedule) -> usize;
        fn graph_refusal(self: &Schedule) -> String;
        fn graph_collectives_left_out(self: &Schedule) -> String;
        fn graph_parts(self: &Schedule) -> usize;
        fn graph_tasks_between(self: &Schedule) -> usize;
        fn placement_trial(self: &Schedule) -> TrialRecord;
        fn summary(self: &Runtime) -> SummaryRecord;
        fn stats(self: &Runtime) -> StatsRecord;
        fn spans(self: &Runtime) -> Vec<SpanRecord>;
        fn clear_profile(self: &Runtime);
        fn write_trace(self: &Runtime, path: &str) -> Result<()>;
        fn profile(self: &Runtime) -> Box<Profile>;

        fn rank(self: &Profile) -> usize;
        fn summary(self: &Profile) -> SummaryRecord;
        fn spans(self: &Profile) -> Vec<SpanRecord>;
        fn since(self: &Profile, t_ns: u64) -> Box<Profile>;
        fn clone_profile(p: &Profile) -> Box<Profile>;
        fn timeline_now_ns() -> u64;
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
        fn agree_placement(self: &Comm, rt: &Runtime, schedule: &Schedule) -> Result<()>;

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

        fn access(self: &mut TaskSpec, v: &View, mode: Mode, elem_size: usize, elem_align: usize);
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
    }

    unsafe extern "C++" {
        include!("braid-ffi/src/glue.h");

        /// A C++ task: a CPU body, a CUDA body, or both.
        type TaskFn;

        /// Whether the task has a CPU body.
        fn has_host_body(f: &TaskFn) -> bool;
        /// Whether the task has a CUDA body.
        fn has_cuda_body(f: &TaskFn) -> bool;
        /// Runs the CPU body on the host bytes of the task's accesses; never
        /// throws. `false` and a message when it threw.
        fn call_host(f: &TaskFn, data: &[RawAccess], error: &mut String) -> bool;
        /// Runs the CUDA body on the device bytes of the task's accesses and
        /// the raw stream (`CUstream`) the task runs on; never throws.
        fn call_cuda(f: &TaskFn, data: &[RawAccess], stream: usize, error: &mut String) -> bool;

        /// A C++ rank function for `launch_local`
        /// (`std::function<void(std::size_t, const Comm&)>`).
        type RankFn;

        /// Runs the rank function of `rank`; never throws. `false` and a
        /// message when it threw. Called concurrently from every rank's thread.
        fn call_rank(f: &RankFn, rank: usize, comm: &Comm, error: &mut String) -> bool;

        /// A C++ recording program for `Runtime::record`
        /// (`std::function<void()>`, which submits the tasks to record).
        type RecordFn;

        /// Runs the recording program; never throws. `false` and a message
        /// when it threw. Called once, on the thread that called `record`.
        fn call_record(f: &RecordFn, error: &mut String) -> bool;
    }
}

pub use bridge::{
    BackendKind, Class, CollectiveKind, CollectiveSpec, DType, Mode, Policy, Priority, RankOutcome,
    RawAccess, ReduceOp, RuntimeConfig, SpanRecord, StatsRecord, StreamBusy, SummaryRecord, Switch,
    TaskKind, TrialRecord,
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
fn guard<T>(what: &str, f: impl FnOnce() -> braid::Result<T>) -> FfiResult<T> {
    guard_ffi(what, || f().map_err(FfiError::from))
}

/// [`guard`] for a body that makes its own messages.
fn guard_ffi<T>(what: &str, f: impl FnOnce() -> FfiResult<T>) -> FfiResult<T> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|p| {
        let msg = p
            .downcast_ref::<&str>()
            .map(|s| (*s).to_string())
            .or_else(|| p.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "non-string panic payload".into());
        Err(FfiError(format!("braid panicked in {what}: {msg}")))
    })
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
        placement: String::new(),
        tenant_class: Class::Normal,
        tenant_class_set: false,
        live: String::new(),
        graphs: Switch::Default,
        graph_collectives: false,
        placement_trial: Switch::Default,
        auto_replay: true,
        inline_short_tasks: true,
        cpu_cores: 0,
        oversubscribe: false,
        realtime: false,
        spare_sms: 0,
        device_bundle_us: -1,
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
            .auto_replay(cfg.auto_replay)
            .inline_short_tasks(cfg.inline_short_tasks)
            .oversubscribe(cfg.oversubscribe)
            .realtime(cfg.realtime)
            .spare_sms(cfg.spare_sms)
            .rank(cfg.rank);
        if cfg.cpu_cores > 0 {
            b = b.cpu_cores(cfg.cpu_cores);
        }
        if let Ok(us) = u64::try_from(cfg.device_bundle_us) {
            b = b.device_bundle(std::time::Duration::from_micros(us));
        }
        if !cfg.trace.is_empty() {
            b = b.trace(cfg.trace.as_str());
        }
        if !cfg.placement.is_empty() {
            b = b.placement_file(cfg.placement.as_str());
        }
        if !cfg.live.is_empty() {
            b = b.live(cfg.live.as_str());
        }
        b = match cfg.graphs {
            Switch::Default => b,
            Switch::On => b.graphs(true),
            Switch::Off => b.graphs(false),
            _ => return Err(to_error("graphs setting")),
        };
        b = b.graph_collectives(cfg.graph_collectives);
        b = match cfg.placement_trial {
            Switch::Default => b,
            Switch::On => b.placement_trial(true),
            Switch::Off => b.placement_trial(false),
            _ => return Err(to_error("placement trial setting")),
        };
        // Only when set: a class set in code wins over a placement file's.
        if cfg.tenant_class_set {
            b = b.class(match cfg.tenant_class {
                Class::LatencyCritical => braid::Class::LatencyCritical,
                Class::Normal => braid::Class::Normal,
                Class::BestEffort => braid::Class::BestEffort,
                _ => return Err(to_error("class")),
            });
        }
        Ok(Box::new(Runtime(Arc::new(Engine(b.build()?)))))
    })
}

/// The engine the C++ handles share: the `braid::Runtime` of a C++
/// `braid::Runtime`, kept alive by it, by the schedules recorded on it and by
/// unsubmitted task builders. Whichever of them goes last drops it: the
/// engine then waits for its tasks, stops its threads and writes its trace.
#[derive(Debug)]
pub struct Engine(braid::Runtime);

impl std::ops::Deref for Engine {
    type Target = braid::Runtime;

    fn deref(&self) -> &braid::Runtime {
        &self.0
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        // Tasks submitted after the C++ `Runtime` went (through a schedule or
        // a builder) have no one left to report their errors to.
        settle(&self.0, "the last handle of the runtime");
    }
}

/// Waits for every task of `rt` and prints an error nobody has reported yet
/// to stderr: the engine only logs it through `tracing`, which a C++
/// program rarely subscribes to, so a failure would otherwise go unseen.
/// Never panics (it runs in `Drop`).
fn settle(rt: &braid::Runtime, what: &str) {
    match catch_unwind(AssertUnwindSafe(|| rt.synchronize())) {
        Ok(Ok(())) => {}
        // Dropped inside one of its own tasks: nothing can be waited for here
        // (the engine's own drop lets the streams finish on their own).
        Ok(Err(braid::Error::WaitInsideTask { .. })) => {}
        Ok(Err(e)) => {
            let msg = e.to_string().replace('\n', "; ");
            eprintln!("braid: {what} was destroyed with an unreported task error: {msg}");
        }
        Err(_) => eprintln!("braid: {what} was destroyed and waiting for its tasks panicked"),
    }
}

/// A Braid runtime owned by C++ (`braid::Runtime`). Shared, so that a
/// [`Schedule`] recorded on it, or a task builder, can keep the engine alive.
#[derive(Debug)]
pub struct Runtime(pub Arc<Engine>);

impl Drop for Runtime {
    /// Destroying the C++ `Runtime` waits for every task and reports an
    /// unreported failure, as documented, even while a schedule still holds
    /// the engine (its threads and the trace then go with the last holder).
    fn drop(&mut self) {
        settle(&self.0, "the Runtime");
    }
}

/// An open scope owned by C++ (`braid::Scope`): closed when destroyed, on
/// the thread that opened it (the C++ class is neither copyable nor
/// movable across threads by contract; see docs/cpp.md).
#[derive(Debug)]
pub struct Scope(braid::Scope);

impl Scope {
    /// The scope's full path; empty for a scope opened with an empty name.
    fn path(&self) -> String {
        self.0.path().unwrap_or("").to_string()
    }
}

/// A recorded schedule owned by C++ (`braid::Schedule`).
#[derive(Debug)]
pub struct Schedule {
    // Declared before `_rt`, so dropped first: it borrows the runtime `_rt`
    // keeps alive.
    step: braid::Schedule<'static>,
    _rt: Arc<Engine>,
}

impl Schedule {
    fn replay(&self) -> FfiResult<Box<TaskHandle>> {
        guard("Schedule::replay", || {
            Ok(Box::new(TaskHandle(self.step.replay()?)))
        })
    }

    fn len(&self) -> usize {
        self.step.len()
    }

    fn name(&self) -> String {
        self.step.name()
    }

    fn placement_streams(&self) -> usize {
        self.step.placement().0
    }

    fn placement_waits(&self) -> usize {
        self.step.placement().1
    }

    /// Why the schedule is not replayed as a graph; empty when it is (or
    /// graphs are off, or no replay has tried yet).
    fn graph_refusal(&self) -> String {
        self.step.graph_refusal().unwrap_or_default()
    }

    /// Why the collectives are not inside the graphs although
    /// `graph_collectives` asked them in
    /// ([`braid::Schedule::graph_collectives_left_out`]); empty otherwise.
    fn graph_collectives_left_out(&self) -> String {
        self.step.graph_collectives_left_out().unwrap_or_default()
    }

    /// Graphs per replay ([`braid::Schedule::graph_shape`]); 0 when the
    /// schedule is not replayed as graphs.
    fn graph_parts(&self) -> usize {
        self.step.graph_shape().map_or(0, |(g, _)| g)
    }

    /// Collectives and host tasks run between the graphs per replay.
    fn graph_tasks_between(&self) -> usize {
        self.step.graph_shape().map_or(0, |(_, e)| e)
    }

    /// The placement trial's outcome ([`braid::Schedule::placement_trial`]).
    fn placement_trial(&self) -> TrialRecord {
        match self.step.placement_trial() {
            Some(o) => TrialRecord {
                decided: true,
                recorded_ns: o.recorded_ns,
                one_stream_ns: o.one_stream_ns,
                kept_one_stream: o.kept == braid::TrialPlacement::OneStream,
            },
            None => TrialRecord {
                decided: false,
                recorded_ns: 0,
                one_stream_ns: 0,
                kept_one_stream: false,
            },
        }
    }
}

impl Runtime {
    /// Records what the C++ `program` submits ([`braid::Runtime::record`]).
    fn record(&self, name: &str, program: UniquePtr<bridge::RecordFn>) -> FfiResult<Box<Schedule>> {
        guard("Runtime::record", || {
            let Some(f) = program.as_ref() else {
                return Err(braid::Error::Config(format!(
                    "record `{name}` was given an empty program"
                )));
            };
            let rt = Arc::clone(&self.0);
            let step = rt.record(name.to_string(), |_| {
                let mut error = String::new();
                if bridge::call_record(f, &mut error) {
                    Ok(())
                } else {
                    Err(braid::Error::TaskFailed {
                        task: format!("the recording program of `{name}`"),
                        message: error,
                    })
                }
            })?;
            // SAFETY: `step` borrows the runtime inside the `Arc` `rt`, whose
            // heap address never changes; the `Schedule` keeps that `Arc` and
            // drops `step` first (field order), so the borrow is valid for as
            // long as `step` exists, whatever C++ does with the `Runtime`.
            let step: braid::Schedule<'static> = unsafe { std::mem::transmute(step) };
            Ok(Box::new(Schedule { step, _rt: rt }))
        })
    }
}

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

    fn priority_class(&self) -> Class {
        match self.0.class() {
            braid::Class::LatencyCritical => Class::LatencyCritical,
            braid::Class::Normal => Class::Normal,
            braid::Class::BestEffort => Class::BestEffort,
        }
    }

    fn spared_sms(&self) -> u32 {
        self.0.spared_sms().unwrap_or(0)
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
            // A copy: the element's alignment does not matter.
            check_elements(&v.0, elem_size, 1)?;
            self.0.read_vec::<u8>(&v.0)
        })
    }

    /// A task to build: it holds the engine, so a C++ `TaskBuilder` stays
    /// usable (and safe) after its `Runtime` is destroyed.
    fn new_task(&self, name: &str) -> Box<TaskSpec> {
        Box::new(TaskSpec {
            rt: Arc::clone(&self.0),
            name: name.to_string(),
            accesses: Vec::new(),
            kind: braid::TaskKind::Compute,
            priority: braid::Priority::Main,
            after: Vec::new(),
            stream: None,
            comm_index: 0,
        })
    }

    fn synchronize(&self) -> FfiResult<()> {
        guard("Runtime::synchronize", || self.0.synchronize())
    }

    /// Opens a scope ([`braid::Runtime::scope`]) until the box drops.
    fn enter_scope(&self, name: &str) -> FfiResult<Box<Scope>> {
        guard("Runtime::scope", || Ok(Box::new(Scope(self.0.scope(name)))))
    }

    /// The innermost scope this thread has open; empty for none.
    fn current_scope(&self) -> String {
        self.0.current_scope().as_deref().unwrap_or("").to_string()
    }

    fn summary(&self) -> SummaryRecord {
        summary_record(&self.0.profile())
    }

    fn stats(&self) -> StatsRecord {
        let s = self.0.stats();
        StatsRecord {
            tasks: s.tasks,
            edges: s.edges,
            waits: s.waits,
            elided_waits: s.elided_waits,
            replays: s.replays,
            replayed_tasks: s.replayed_tasks,
            auto_replayed: s.auto_replayed,
            auto_divergences: s.auto_divergences,
            graph_replays: s.graph_replays,
            inline_tasks: s.inline,
        }
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
        comm_wait_ns: s.comm_wait_ns,
        transfer_ns: s.transfer_ns,
        transfer_hidden_ns: s.transfer_hidden_ns,
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
            scope: s.scope.as_deref().unwrap_or("").to_string(),
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

/// Checks that `v` is a whole, aligned run of elements of `size` bytes
/// aligned to `align` (host and device memory are at least 64-byte aligned,
/// so the view's offset decides the alignment).
fn check_elements(v: &braid::View, size: usize, align: usize) -> braid::Result<()> {
    let ok =
        size != 0 && align.is_power_of_two() && v.len() % size == 0 && v.range().start % align == 0;
    if ok {
        Ok(())
    } else {
        Err(braid::Error::Misaligned {
            task: None,
            buffer: v.buffer().name().to_string(),
            range: v.range(),
            ty: element_name(size),
        })
    }
}

/// The accesses C++ declared for task `task`, checked against their element
/// types, as the engine's byte accesses (which it checks for aliasing).
fn dyn_accesses(task: &str, accesses: Vec<TypedAccess>) -> FfiResult<Vec<braid::DynAccess>> {
    accesses
        .into_iter()
        .map(|a| {
            check_elements(&a.view, a.elem_size, a.elem_align)
                .map_err(|e| FfiError(format!("task `{task}`: {e}")))?;
            Ok(a.view.access(a.mode))
        })
        .collect()
}

/// A C++ task (its CPU body, its CUDA body or both) on its way to a stream
/// thread.
struct CppBody(UniquePtr<bridge::TaskFn>);

// SAFETY: the body is called on one stream thread at a time (once, or once
// per replay when it was recorded: replays of one schedule never run a task
// concurrently with itself) and dropped once; `submit` shares it between the CPU and the CUDA closure of one task,
// of which the engine runs exactly one (or none, for a skipped task), so it is
// never called from two threads, nor while it is being dropped. What remains
// is that a `std::function` may be invoked and destroyed on a thread other
// than the one that built it: that holds for `std::function` itself, and what
// the user's lambda captures is the user's responsibility, as for any C++
// callback run on a worker thread (documented in braid.hpp).
unsafe impl Send for CppBody {}
// SAFETY: see `Send`: no two threads ever use the body at the same time.
unsafe impl Sync for CppBody {}

impl CppBody {
    /// Runs the CPU body on the host bytes of the task's accesses.
    fn host(&self, mut data: Vec<HostBytes<'_>>) -> Result<(), braid::TaskError> {
        let raw: Vec<RawAccess> = data
            .iter_mut()
            .map(|b| match b {
                HostBytes::Read(s) => RawAccess {
                    addr: s.as_ptr() as usize,
                    len: s.len(),
                },
                HostBytes::Write(s) => RawAccess {
                    addr: s.as_mut_ptr() as usize,
                    len: s.len(),
                },
            })
            .collect();
        // `data` keeps the borrows alive (and unused) while C++ works on them.
        self.call(|f, error| bridge::call_host(f, &raw, error))
    }

    /// Runs the CUDA body on the device bytes of the task's accesses, with
    /// the task's stream.
    fn cuda(&self, data: &[DevBytes], cu: &CudaTaskCtx<'_>) -> Result<(), braid::TaskError> {
        let raw = data
            .iter()
            .map(|d| {
                Ok(RawAccess {
                    addr: usize::try_from(d.ptr)
                        .map_err(|_| "a device address does not fit a host pointer")?,
                    len: d.len,
                })
            })
            .collect::<Result<Vec<_>, &str>>()?;
        let stream = cu.stream().raw() as usize;
        self.call(|f, error| bridge::call_cuda(f, &raw, stream, error))
    }

    fn call(
        &self,
        run: impl FnOnce(&bridge::TaskFn, &mut String) -> bool,
    ) -> Result<(), braid::TaskError> {
        let f = self.0.as_ref().ok_or("the task's body is missing")?;
        let mut error = String::new();
        if run(f, &mut error) {
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
/// `Runtime::submit`.
#[derive(Debug)]
pub struct TaskSpec {
    rt: Arc<Engine>,
    name: String,
    accesses: Vec<TypedAccess>,
    kind: braid::TaskKind,
    priority: braid::Priority,
    after: Vec<braid::TaskHandle>,
    stream: Option<usize>,
    comm_index: usize,
}

/// Submits a task built by C++ to the engine its spec holds.
fn submit_task(spec: Box<TaskSpec>, body: UniquePtr<bridge::TaskFn>) -> FfiResult<Box<TaskHandle>> {
    guard_ffi("TaskBuilder::run", || {
        let TaskSpec {
            rt,
            name,
            accesses,
            kind,
            priority,
            after,
            stream,
            comm_index,
        } = *spec;
        let (host, cuda) = match body.as_ref() {
            Some(f) => (bridge::has_host_body(f), bridge::has_cuda_body(f)),
            None => (false, false),
        };
        if !host && !cuda {
            return Err(braid::Error::Config(format!(
                "task `{name}` was submitted without a body"
            ))
            .into());
        }
        let accesses = dyn_accesses(&name, accesses)?;
        let mut b = rt
            .task(name)
            .kind(kind)
            .priority(priority)
            .comm_stream(comm_index);
        for h in &after {
            b = b.after(h);
        }
        if let Some(s) = stream {
            b = b.on_stream(s);
        }
        // One body object behind both closures: the engine runs one of them.
        let cpu = Arc::new(CppBody(body));
        let gpu = Arc::clone(&cpu);
        let cpu = move |data: Vec<HostBytes<'_>>| cpu.host(data);
        let gpu = move |data: Vec<DevBytes>, cu: &CudaTaskCtx<'_>| gpu.cuda(&data, cu);
        let h = match (host, cuda) {
            (true, true) => b.run_any(accesses, cpu, gpu),
            (true, false) => b.run(accesses, cpu),
            (false, _) => b.run_cuda(accesses, gpu),
        }?;
        Ok(Box::new(TaskHandle(h)))
    })
}

/// One token of a C++ task: a view, a mode and the element type's layout.
#[derive(Debug)]
struct TypedAccess {
    view: braid::View,
    mode: braid::Mode,
    elem_size: usize,
    elem_align: usize,
}

impl TaskSpec {
    /// Declares a token (checked when the task is submitted).
    fn access(&mut self, v: &View, mode: Mode, elem_size: usize, elem_align: usize) {
        let mode = match mode {
            Mode::Read => braid::Mode::Read,
            Mode::Write => braid::Mode::Write,
            // An unknown value is treated as the strictest mode.
            _ => braid::Mode::ReadWrite,
        };
        self.accesses.push(TypedAccess {
            view: v.0.clone(),
            mode,
            elem_size,
            elem_align,
        });
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

    fn since(&self, t_ns: u64) -> Box<Profile> {
        Box::new(Profile(self.0.since(t_ns)))
    }
}

fn timeline_now_ns() -> u64 {
    braid::trace::now_ns()
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

    /// Submits one collective as a task of `rt`, named `name` (or after the
    /// collective when empty): the one place the bridge calls the
    /// collectives' task API.
    fn submit(
        &self,
        rt: &Runtime,
        name: &str,
        kind: braid::comm::CollectiveKind,
        dtype: braid::comm::DType,
        buffers: braid::comm::Buffers,
    ) -> braid::Result<Box<TaskHandle>> {
        let name = if name.is_empty() { kind.name() } else { name };
        let h = self
            .0
            .bind(&rt.0)?
            .submit_named(name.to_string(), kind, dtype, buffers)?;
        Ok(Box::new(TaskHandle(h)))
    }

    fn submit_spec(
        &self,
        rt: &Runtime,
        spec: &CollectiveSpec,
        buffers: braid::comm::Buffers,
    ) -> FfiResult<Box<TaskHandle>> {
        guard("Communicator::submit", || {
            let (kind, dtype) = collective(spec)?;
            self.submit(rt, &spec.name, kind, dtype, buffers)
        })
    }

    fn submit_in_place(
        &self,
        rt: &Runtime,
        spec: &CollectiveSpec,
        v: &View,
    ) -> FfiResult<Box<TaskHandle>> {
        self.submit_spec(rt, spec, braid::comm::Buffers::InPlace(v.0.clone()))
    }

    fn submit_out_of_place(
        &self,
        rt: &Runtime,
        spec: &CollectiveSpec,
        send: &View,
        recv: &View,
    ) -> FfiResult<Box<TaskHandle>> {
        let buffers = braid::comm::Buffers::OutOfPlace {
            send: send.0.clone(),
            recv: recv.0.clone(),
        };
        self.submit_spec(rt, spec, buffers)
    }

    fn barrier(&self, rt: &Runtime, name: &str) -> FfiResult<Box<TaskHandle>> {
        guard("Communicator::barrier", || {
            use braid::comm::{Buffers, CollectiveKind, DType};
            self.submit(rt, name, CollectiveKind::Barrier, DType::F32, Buffers::None)
        })
    }

    /// [`braid::BoundComm::agree_placement`] on `rt`.
    fn agree_placement(&self, rt: &Runtime, schedule: &Schedule) -> FfiResult<()> {
        guard("Communicator::agree_placement", || {
            self.0.bind(&rt.0)?.agree_placement(&schedule.step)
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
        assert!(check_elements(&b.0.view(0..16).unwrap(), 4, 4).is_ok());
        assert!(check_elements(&b.0.view(2..6).unwrap(), 4, 4).is_err());
        assert!(check_elements(&b.0.view(2..6).unwrap(), 4, 1).is_ok());
        assert!(check_elements(&b.0.view(0..6).unwrap(), 4, 4).is_err());
        assert!(check_elements(&b.0.view(0..6).unwrap(), 0, 1).is_err());
        assert!(check_elements(&b.0.view(0..6).unwrap(), 2, 3).is_err());
    }

    #[test]
    fn tokens_are_checked_against_their_element_type() {
        let rt = cpu(false);
        let b = rt.alloc("x", 16).unwrap();
        let mut spec = rt.new_task("t");
        spec.access(&b.whole(), Mode::Read, 4, 4);
        spec.access(&b.view(4, 8).unwrap(), Mode::Write, 2, 2);
        let acc = dyn_accesses(&spec.name, spec.accesses).unwrap();
        let modes: Vec<_> = acc.iter().map(|a| (a.view().range(), a.mode())).collect();
        assert_eq!(
            modes,
            vec![(0..16, braid::Mode::Read), (4..8, braid::Mode::Write)]
        );
        let mut spec = rt.new_task("odd");
        spec.access(&b.view(2, 10).unwrap(), Mode::ReadWrite, 4, 4);
        let e = dyn_accesses(&spec.name, spec.accesses).unwrap_err();
        assert!(
            e.0.contains("task `odd`") && e.0.contains("aligned slice") && e.0.contains("2..10"),
            "{e}"
        );
    }

    #[test]
    fn a_task_without_a_body_is_refused() {
        let rt = cpu(false);
        let e = submit_task(rt.new_task("empty"), UniquePtr::null()).unwrap_err();
        assert!(
            e.0.contains("empty") && e.0.contains("without a body"),
            "{e}"
        );
    }

    #[test]
    fn guard_turns_panics_into_errors() {
        let e = guard::<()>("test", || panic!("boom")).unwrap_err();
        assert!(e.0.contains("boom") && e.0.contains("test"), "{e}");
    }
}

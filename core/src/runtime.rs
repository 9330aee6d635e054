//! The runtime: configuration, buffers, submission and synchronisation.

use crate::backend::{Backend, BackendKind};
use crate::buffer::{AsView, Buffer, BufferInner, Dropped};
use crate::error::{Error, Result};
use crate::kind::{Class, TaskKind};
use crate::sched::placement::{self, Claim, CoreBudget, Layout, Lease, Policy, Share};
use crate::sched::tenants::transfer;
use crate::sched::TaskHandle;
use crate::sched::{self, gate::Gate, queue::Queue, NewTask, Shared, StreamShared, SubmitState};
use crate::scope::{PlacementFile, Scope, Scopes};
use crate::sync::{lock, next_id, Arc, AtomicU64, IdKind, Mutex, Ordering};
use crate::trace::{Profile, StreamInfo};
use std::borrow::Cow;
use std::convert::Infallible;
use std::path::PathBuf;

#[cfg(all(unix, not(loom)))]
type LiveRegistration = crate::trace::live::Registration;
/// Nothing to register where the live view is unavailable.
#[cfg(not(all(unix, not(loom))))]
type LiveRegistration = ();

/// Configures a [`Runtime`].
#[derive(Debug, Clone)]
pub struct RuntimeBuilder {
    backend: BackendKind,
    compute_streams: usize,
    comm_streams: usize,
    policy: Policy,
    window: usize,
    profile: bool,
    trace: Option<PathBuf>,
    rank: usize,
    replay_as_tasks: bool,
    /// `None`: the backend's default ([`Runtime::config_graphs`]).
    graphs: Option<bool>,
    graph_collectives: bool,
    /// `None`: the backend's default ([`Runtime::config_placement_trial`]).
    placement_trial: Option<bool>,
    replace: bool,
    auto_replay: bool,
    cpu_cores: Option<usize>,
    oversubscribe: bool,
    pin_threads: bool,
    inline_short_tasks: bool,
    live: Option<PathBuf>,
    class: Class,
    /// The class was set in code ([`RuntimeBuilder::class`]): it wins over
    /// a placement file's.
    class_set: bool,
    realtime: bool,
    spare_sms: u32,
    device_bundle: std::time::Duration,
    placement: Option<PlacementSource>,
}

/// Where a runtime's placement file comes from.
#[derive(Debug, Clone)]
enum PlacementSource {
    Path(PathBuf),
    File(std::sync::Arc<PlacementFile>),
}

/// The environment variable naming a placement file for runtimes whose
/// builder names none.
pub const PLACEMENT_ENV: &str = "BRAID_PLACEMENT";

/// The most streams (compute and communication together) a runtime may
/// have. Each stream keeps a vector clock of every stream (the elision of
/// waits already implied), so a runtime's clocks take 8·n² bytes: 8 MiB at
/// this bound, where 20,000 streams took 3.2 GB and an allocation failure
/// aborted the process. No device runs more streams at once than this.
pub const MAX_STREAMS: usize = 1024;

impl Default for RuntimeBuilder {
    fn default() -> Self {
        RuntimeBuilder {
            backend: BackendKind::Auto,
            compute_streams: 2,
            comm_streams: 1,
            policy: Policy::Affinity,
            window: 4096,
            profile: false,
            trace: None,
            rank: 0,
            replay_as_tasks: false,
            graphs: None,
            graph_collectives: false,
            placement_trial: None,
            replace: true,
            auto_replay: true,
            cpu_cores: None,
            oversubscribe: false,
            pin_threads: cfg!(feature = "hwloc"),
            inline_short_tasks: true,
            // Set and empty counts as unset, as `BRAID_PLACEMENT` does.
            live: std::env::var_os("BRAID_LIVE")
                .filter(|p| !p.is_empty())
                .map(PathBuf::from),
            class: Class::Normal,
            class_set: false,
            realtime: false,
            spare_sms: 0,
            device_bundle: crate::sched::tenants::DEVICE_BUNDLE,
            placement: None,
        }
    }
}

/// The placement file `BRAID_PLACEMENT` names: its errors say that the
/// variable named it (a program that does not name one may not know it is
/// set).
fn placement_from_env(path: &std::path::Path) -> Result<PlacementFile> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| Error::io("reading the placement file BRAID_PLACEMENT names", path, e))?;
    PlacementFile::parse(&text, format!("{} (from {PLACEMENT_ENV})", path.display()))
}

impl RuntimeBuilder {
    /// Which device to drive (default: auto).
    pub fn backend(mut self, b: BackendKind) -> Self {
        self.backend = b;
        self
    }

    /// Number of compute streams (default 2; with the communication
    /// streams, at most [`MAX_STREAMS`]).
    pub fn compute_streams(mut self, n: usize) -> Self {
        self.compute_streams = n;
        self
    }

    /// Number of communication streams (default 1). With none, collectives
    /// run on compute stream 0, in program order, among its compute tasks.
    pub fn comm_streams(mut self, n: usize) -> Self {
        self.comm_streams = n;
        self
    }

    /// The placement policy (default: affinity).
    pub fn policy(mut self, p: Policy) -> Self {
        self.policy = p;
        self
    }

    /// How many submitted tasks may be unfinished before submission blocks
    /// (default 4096): back-pressure, so the program never races far ahead of
    /// the device.
    pub fn launch_window(mut self, n: usize) -> Self {
        self.window = n;
        self
    }

    /// Record a span per task (for [`Runtime::profile`]). Off by default: it
    /// costs two clock reads per task.
    pub fn profile(mut self, on: bool) -> Self {
        self.profile = on;
        self
    }

    /// Record spans and write a Chrome trace to `path` when the runtime
    /// drops (`build` refuses a path in a directory that does not exist, a
    /// directory, and a file another live runtime of the process traces to:
    /// the last to drop would replace the other's trace).
    pub fn trace(mut self, path: impl Into<PathBuf>) -> Self {
        self.trace = Some(path.into());
        self.profile = true;
        self
    }

    /// The rank this runtime plays in a data-parallel job (the trace's process).
    pub fn rank(mut self, r: usize) -> Self {
        self.rank = r;
        self
    }

    /// Replays run as one task record per step through the ordinary launch
    /// path, as on CUDA, instead of one program per CPU stream. For tests of
    /// that path on machines without a GPU.
    #[doc(hidden)]
    pub fn replay_as_tasks(mut self, on: bool) -> Self {
        self.replay_as_tasks = on;
        self
    }

    /// Replays of recorded schedules run as one unit (default: on with a
    /// CUDA backend, except for a best-effort runtime; off on the CPU). On
    /// CUDA a schedule is captured into a CUDA graph at its first replay
    /// (fork and join through events) and each replay is one graph launch;
    /// on the CPU a replay runs every task in order on one stream thread
    /// (the CPU's model of a graph launch, with no overlap: for tests).
    /// A schedule with collectives or host tasks is cut around them: each
    /// run of other tasks between them is a graph, and they run as ordinary
    /// tasks, so a collective overlaps the next graph
    /// ([`crate::Schedule::graph_shape`]). A schedule whose capture fails,
    /// or that has nothing to capture, replays as before
    /// ([`crate::Schedule::graph_refusal`] says why). Values that change
    /// between replays must live in buffers the kernels read: a graph keeps
    /// the kernel arguments of its capture.
    pub fn graphs(mut self, on: bool) -> Self {
        self.graphs = Some(on);
        self
    }

    /// With graph replay ([`RuntimeBuilder::graphs`]), capture collectives
    /// into the graphs too instead of cutting the graphs around them
    /// (default: off). The collectives of one communication stream (the
    /// schedule's first collective's) go in; a graph that holds some is
    /// launched on that stream, so they keep one order with its other
    /// collectives. At each launch the host does what each collective's
    /// body would: takes its index (a poisoned communicator fails the
    /// launch), and on CUDA hands the launch's end event to the NCCL
    /// watchdog and checks for an abort once it completes; a graph that is
    /// skipped poisons the communicator, so the other ranks fail instead of
    /// waiting. When the capture fails (a communicator that cannot be
    /// captured: any but NCCL on CUDA), the graphs are cut around the
    /// collectives, as without this switch, with a `tracing` warning. On
    /// the CPU the collectives run in the graph's sequential run. Ranks may
    /// choose differently: each still issues its collectives in program
    /// order. docs/replay.md, "Collectives inside graphs".
    pub fn graph_collectives(mut self, on: bool) -> Self {
        self.graph_collectives = on;
        self
    }

    /// Whether the first replays of a recorded schedule whose tasks use
    /// several compute streams are a trial of its placement against one
    /// stream, timed, the faster kept (default: on for CUDA; docs/replay.md,
    /// "The placement trial"). Sixteen replays are waited for as they are
    /// submitted; results do not depend on it. On the CPU a schedule's
    /// replays run as per-stream programs placed by the cost model
    /// ([`replace_schedules`](Self::replace_schedules)), and the trial
    /// applies only to replays made tasks (on CUDA, or for tests).
    pub fn placement_trial(mut self, on: bool) -> Self {
        self.placement_trial = Some(on);
        self
    }

    /// Whether recorded schedules are placed again from their tasks' measured
    /// durations (default: on; CPU backend only). Off keeps the placement the
    /// recording run got.
    pub fn replace_schedules(mut self, on: bool) -> Self {
        self.replace = on;
        self
    }

    /// Automatic replay (default: on): after a few identical steps (what is
    /// submitted between two `synchronize` calls: the same task names, kinds
    /// and accesses in the same order), in a row or repeating with a period
    /// of up to 4 steps (double-buffered data), later identical steps are
    /// submitted from the memoised analysis — no inference, no placement —
    /// and the moment a step diverges it continues eagerly, nothing lost
    /// (docs/replay.md). Off: every task is inferred and placed as it comes.
    /// An explicit [`Runtime::record`] saves the hand-off of each task too.
    pub fn auto_replay(mut self, on: bool) -> Self {
        self.auto_replay = on;
        self
    }

    /// The CPU cores the process may use, as this runtime counts them
    /// (default: `BRAID_CPU_CORES` when set, else the cores detected by
    /// [`crate::topo::cpu_cores`]). The CPU runtimes alive in the process
    /// share them: under [`Policy::Affinity`] this runtime places compute
    /// tasks on its share of its compute streams only, so that busy stream
    /// threads across the ranks of a process do not outnumber the cores (two
    /// ranks on two cores: one compute stream each; one rank: both).
    /// Communication streams are not counted. CUDA runtimes ignore it.
    pub fn cpu_cores(mut self, n: usize) -> Self {
        self.cpu_cores = Some(n);
        self
    }

    /// Let [`Policy::Affinity`] use every compute stream whatever the core
    /// budget (default false; the behaviour before the budget existed). The
    /// runtime still counts against the budget, so budgeted runtimes beside
    /// it leave its cores to it.
    pub fn oversubscribe(mut self, on: bool) -> Self {
        self.oversubscribe = on;
        self
    }

    /// Pin each stream thread to one place of the process's CPUs (default:
    /// off; on with the `hwloc` feature): a logical CPU of the affinity mask
    /// on Linux, a physical core with hwloc; each thread goes to the place
    /// with the fewest pinned threads of its stream index or lower, across
    /// the process's runtimes, so two ranks' busy compute threads land on
    /// different cores. The submitting thread is left alone. The
    /// environment variable `BRAID_PIN_THREADS` overrides it for every
    /// runtime (`1` pins, `0` does not; another value fails `build`).
    /// Elsewhere, or where binding fails, threads stay unpinned.
    pub fn pin_threads(mut self, on: bool) -> Self {
        self.pin_threads = on;
        self
    }

    /// CPU: run a short task on the submitting thread, inside the call that
    /// submits it (default: on). Only a task the cost model has measured at
    /// under [`INLINE_MAX_NS`](crate::INLINE_MAX_NS), whose predecessors
    /// have all completed and whose stream has finished everything placed on
    /// it before, and only in a `normal` or latency-critical runtime and
    /// outside a task: handing such a task to its stream's thread costs more
    /// than running it. It still counts as its stream's next task (its span,
    /// its place in the stream's order; `Stats::inline` counts them). Off:
    /// every body runs on its stream's thread, for bodies that depend on
    /// which thread runs them (thread-locals, CPU affinity) or take a lock
    /// their submitter may hold while it submits (an inline body would wait
    /// for it inside the submitting call: a deadlock).
    pub fn inline_short_tasks(mut self, on: bool) -> Self {
        self.inline_short_tasks = on;
        self
    }

    /// Serve a live view of this runtime (`braid top`) on the local socket
    /// at `path` (default: `BRAID_LIVE` when set and not empty). `{rank}` in the path is
    /// replaced by the runtime's rank; runtimes of one process that name the
    /// same socket share it. Turns profiling on: the live view and the
    /// Chrome trace read the same spans. Unix only.
    pub fn live(mut self, path: impl Into<PathBuf>) -> Self {
        self.live = Some(path.into());
        self
    }

    /// The program's priority class among the runtimes of the process
    /// (default: normal). While a latency-critical runtime has unfinished
    /// tasks, best-effort runtimes start no new task; best-effort CPU stream
    /// threads run at the idle scheduling priority and divide the core
    /// budget among themselves only. See docs/tenants.md.
    ///
    /// A class set here wins over a placement file's `[runtime] class`
    /// (the builder's file, or the one `BRAID_PLACEMENT` names, which may
    /// have been written for another program of the process); the file's
    /// class applies to runtimes whose builder sets none.
    pub fn class(mut self, class: Class) -> Self {
        self.class = class;
        self.class_set = true;
        self
    }

    /// A latency-critical runtime's threads ask the OS for a real-time
    /// policy (Linux `SCHED_FIFO`, its lowest priority) — its stream threads
    /// and every thread that submits to it or waits on it, for good
    /// (default: off; `build` refuses it for other classes). Then nothing
    /// below real time, best-effort work or another process, runs on a core
    /// a latency-critical thread wants: the idle policy alone does not
    /// guarantee that (docs/tenants.md). It needs `CAP_SYS_NICE` or a
    /// non-zero `RLIMIT_RTPRIO`; where the OS refuses, the threads keep the
    /// default policy and a warning says so once. A latency-critical task
    /// body that never ends holds its core (the kernel's real-time
    /// throttling leaves others 5% of it).
    pub fn realtime(mut self, on: bool) -> Self {
        self.realtime = on;
        self
    }

    /// On CUDA, leave `n` of the device's SMs to the other programs on it:
    /// this runtime's compute streams are made in a green context over the
    /// rest, so its kernels never run on those `n` (default 0: every SM).
    /// For a best-effort runtime beside a latency-critical one, whose
    /// kernels then always find SMs free instead of waiting for the
    /// best-effort blocks ahead of them to finish (a GPU cannot preempt a
    /// running kernel; docs/tenants.md). The driver rounds `n` up to its
    /// partition size (a multiple of 8 on an H100):
    /// [`Runtime::spared_sms`] says how many were left. Its communication
    /// streams stay on every SM. Ignored on the CPU backend, where the
    /// classes already divide the cores. `build` fails, naming the driver's
    /// reason, where the driver has no green contexts (before 12.4) or `n`
    /// leaves no SM.
    pub fn spare_sms(mut self, n: u32) -> Self {
        self.spare_sms = n;
        self
    }

    /// On CUDA, for a best-effort runtime: how much device time of its
    /// launched, unfinished kernels each of its streams keeps at most (its
    /// launch window, estimated from each task name's measured device time;
    /// default 1 ms; docs/tenants.md, "Kernels in bundles"). A
    /// latency-critical kernel can find up to this much best-effort work
    /// launched ahead of it; a smaller window leaves it less, and costs the
    /// best-effort runtime more gaps between launches. Ignored by other
    /// classes and on the CPU. `build` refuses zero.
    pub fn device_bundle(mut self, window: std::time::Duration) -> Self {
        self.device_bundle = window;
        self
    }

    /// Reads the placement file at `path` when the runtime is built
    /// (docs/scopes.md): it maps scope patterns to streams, priorities,
    /// policies, bundling and replay. A file that cannot be read or parsed,
    /// or that names a stream the runtime lacks, fails `build` with an
    /// error naming the line. Without it, the file named by the
    /// `BRAID_PLACEMENT` environment variable is used, if set.
    pub fn placement_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.placement = Some(PlacementSource::Path(path.into()));
        self
    }

    /// Uses a parsed placement file (see [`RuntimeBuilder::placement_file`]).
    pub fn placement(mut self, file: PlacementFile) -> Self {
        self.placement = Some(PlacementSource::File(std::sync::Arc::new(file)));
        self
    }

    /// The placement file: the builder's, else `BRAID_PLACEMENT`'s, checked
    /// against the runtime's streams.
    fn placement_file_checked(&self) -> Result<Option<std::sync::Arc<PlacementFile>>> {
        use std::sync::Arc;
        let file = match &self.placement {
            Some(PlacementSource::File(f)) => Some(f.clone()),
            Some(PlacementSource::Path(p)) => Some(Arc::new(PlacementFile::load(p)?)),
            None => match std::env::var_os(PLACEMENT_ENV) {
                Some(p) if !p.is_empty() => Some(Arc::new(placement_from_env(p.as_ref())?)),
                _ => None,
            },
        };
        if let Some(f) = &file {
            f.check(self.compute_streams, self.comm_streams)?;
        }
        Ok(file)
    }

    /// The runtime's claim on the core budget (CPU runtimes only).
    fn claim(&self) -> Result<Claim> {
        let budget = match self.cpu_cores {
            Some(0) => return Err(Error::Config("`cpu_cores` must be at least 1".into())),
            Some(n) => n,
            None => crate::topo::cpu_budget()?,
        };
        let (demand, flexible) = match self.policy {
            Policy::Single => (1, false),
            Policy::RoundRobin => (self.compute_streams, false),
            Policy::Affinity => (self.compute_streams, !self.oversubscribe),
        };
        Ok(Claim {
            budget,
            demand,
            flexible,
            best_effort: self.class == Class::BestEffort,
        })
    }

    /// Serves `shared` on the live view's socket, if one is configured.
    fn serve_live(&self, shared: &Arc<Shared>) -> Result<Option<LiveRegistration>> {
        let Some(path) = &self.live else {
            return Ok(None);
        };
        if path.as_os_str().is_empty() {
            return Err(Error::Config(
                "the live view's socket path (`RuntimeBuilder::live`) is empty".into(),
            ));
        }
        let path = PathBuf::from(
            path.to_string_lossy()
                .replace("{rank}", &self.rank.to_string()),
        );
        #[cfg(all(unix, not(loom)))]
        {
            let weak = Arc::downgrade(shared);
            let source: std::sync::Weak<dyn crate::trace::live::Source> = weak;
            crate::trace::live::register(&path, shared.runtime_id, source).map(Some)
        }
        #[cfg(not(all(unix, not(loom))))]
        {
            let _ = shared;
            Err(Error::Config(format!(
                "the live view (`{}`) needs Unix domain sockets",
                path.display()
            )))
        }
    }

    /// Starts the runtime's stream threads.
    pub fn build(mut self) -> Result<Runtime> {
        if self.compute_streams == 0 {
            return Err(Error::Config(
                "at least one compute stream is needed".into(),
            ));
        }
        let n = self.compute_streams.saturating_add(self.comm_streams);
        if n > MAX_STREAMS {
            return Err(Error::Config(format!(
                "{} compute and {} communication streams are too many (at most {MAX_STREAMS} in \
                 all)",
                self.compute_streams, self.comm_streams,
            )));
        }
        if self.window == 0 {
            return Err(Error::Config("the launch window must be at least 1".into()));
        }
        if self.device_bundle.is_zero() {
            return Err(Error::Config(
                "the device bundle (`device_bundle`) must be longer than zero".into(),
            ));
        }
        crate::topo::pin_env()?;
        // The trace is written when the runtime drops, where an error can
        // only be printed: a path it cannot be written to is refused now.
        let mut trace_claim = None;
        if let Some(path) = &self.trace {
            if let Some(why) = crate::fs::unwritable(path) {
                return Err(Error::Config(format!("trace `{}`: {why}", path.display())));
            }
            trace_claim = TraceClaim::take(path)?;
        }
        // The placement file is read and checked before anything starts.
        // Its `[runtime]` class applies where the code set none: a class set
        // in code wins (`BRAID_PLACEMENT` reaches every runtime of the
        // process, and its file may have been written for another of
        // them). Its real-time setting and spared SMs override the
        // builder's, unless the code's class overrode another class of the
        // file's: they were then meant for a runtime of that class.
        let placement = self.placement_file_checked()?;
        let mut class_from_file = false;
        if let Some(f) = &placement {
            let other_program = self.class_set && f.class().is_some_and(|c| c != self.class);
            if !self.class_set {
                if let Some(c) = f.class() {
                    self.class = c;
                    class_from_file = true;
                }
            }
            if !other_program {
                self.realtime = f.realtime().unwrap_or(self.realtime);
                self.spare_sms = f.spare_sms().unwrap_or(self.spare_sms);
            }
        }
        if self.realtime && self.class != Class::LatencyCritical {
            return Err(placement
                .as_ref()
                .and_then(|f| f.realtime_refused(self.class))
                .unwrap_or_else(|| {
                    let from = match placement.as_ref().filter(|_| class_from_file) {
                        Some(f) => format!(" (`runtime.class` in placement file `{}`)", f.origin()),
                        None => String::new(),
                    };
                    Error::Config(format!(
                        "real-time threads are for latency-critical runtimes; this one is {}{from}",
                        self.class.name()
                    ))
                }));
        }
        let backend = Backend::open(
            self.backend,
            crate::backend::gpu::StreamSet {
                compute: self.compute_streams,
                comm: self.comm_streams,
                class: self.class,
                spare_sms: self.spare_sms,
            },
        )?;
        let runtime_id = next_id(IdKind::Runtime);
        // CPU stream threads are busy threads: register with the process's
        // core budget. CUDA stream threads mostly block: they do not count.
        let lease = match backend {
            Backend::Cpu => Some(CoreBudget::global().join(runtime_id, self.claim()?)),
            Backend::Cuda(_) => None,
        };
        let share = lease
            .as_ref()
            .map_or_else(|| Share::fixed(self.compute_streams), Lease::share);
        let mut streams = Vec::with_capacity(n);
        for s in 0..n {
            let is_comm = s >= self.compute_streams;
            let name = if is_comm {
                format!("comm {}", s - self.compute_streams)
            } else {
                format!("compute {s}")
            };
            streams.push(StreamShared {
                name,
                is_comm,
                done: Gate::default(),
                launched: Gate::default(),
                queue: Queue::new(),
                spans: Mutex::new(Vec::new()),
                spans_cleared: AtomicU64::new(0),
                placed: AtomicU64::new(0),
                running: Mutex::new(None),
                inline: AtomicU64::new(0),
            });
        }
        let shared = Arc::new(Shared {
            runtime_id,
            rank: self.rank,
            streams,
            completed: Gate::default(),
            submitted: AtomicU64::new(0),
            errors: Mutex::new(Vec::new()),
            dropped: Arc::new(Dropped::default()),
            profiling: self.profile || self.live.is_some(),
            live: self.live.is_some(),
            busy: Mutex::new(Default::default()),
            class: self.class,
            device_bundle_ns: u64::try_from(self.device_bundle.as_nanos()).unwrap_or(u64::MAX),
            realtime: self.realtime,
            pin_threads: self.pin_threads,
            measure: matches!(backend, Backend::Cpu),
            inline: self.inline_short_tasks
                && matches!(backend, Backend::Cpu)
                && self.class != Class::BestEffort,
            estimates: Default::default(),
        });
        let layout = Layout {
            compute: self.compute_streams,
            comm: self.comm_streams,
        };
        let mut state = SubmitState::new(placement::make(self.policy, layout, share.clone()), n);
        state.compute = self.compute_streams;
        if let Some(f) = &placement {
            for p in f.policies() {
                if p != self.policy && !state.scope_placers.iter().any(|(q, _)| *q == p) {
                    let placer = placement::make(p, layout, share.clone());
                    state.scope_placers.push((p, placer));
                }
            }
        }
        let auto_replay = placement
            .as_ref()
            .and_then(|f| f.auto_replay())
            .unwrap_or(self.auto_replay);
        if auto_replay {
            state.auto = Some(sched::auto::Auto::default());
        }
        let live = self.serve_live(&shared)?;
        let tenant =
            (self.class == Class::LatencyCritical).then(|| sched::tenants::register(&shared));
        let mut threads = Vec::with_capacity(n);
        // Where compute stream 0 is pinned (the comm streams go elsewhere).
        let mut home = None;
        for s in 0..n {
            let driver = match &backend {
                Backend::Cpu => None,
                Backend::Cuda(c) => Some(c.driver(s)),
            };
            let pin =
                crate::topo::stream_pin(s, shared.streams[s].is_comm, home, shared.pin_threads);
            if s == 0 {
                home = pin.place();
            }
            match sched::spawn_worker(shared.clone(), s, driver, pin) {
                Ok(t) => threads.push(t),
                Err(e) => {
                    for st in &shared.streams {
                        st.queue.close();
                    }
                    return Err(Error::Config(format!("cannot start stream thread: {e}")));
                }
            }
        }
        Ok(Runtime {
            scopes: Scopes::new(runtime_id, placement),
            shared,
            seen_completed: AtomicU64::new(0),
            state: Mutex::new(state),
            threads,
            backend,
            share,
            _lease: lease,
            _live: live,
            _tenant: tenant,
            _trace_claim: trace_claim,
            config: self,
        })
    }
}

/// A trace file held by a live runtime of the process. Each runtime writes
/// its trace to its file when it drops, so two runtimes given one path
/// (two tenants of a process, say) would leave only the last one's: the
/// second is refused at `build`. Released after the runtime has written.
/// Not taken for what is not a regular file (`/dev/null`, a pipe).
struct TraceClaim(PathBuf);

static TRACE_PATHS: std::sync::Mutex<Vec<PathBuf>> = std::sync::Mutex::new(Vec::new());

impl TraceClaim {
    fn take(path: &std::path::Path) -> Result<Option<TraceClaim>> {
        if path.exists() && !path.is_file() {
            return Ok(None);
        }
        // One file, however it is named: its directory resolved (links,
        // `..`, a relative path).
        let key = std::fs::canonicalize(path).unwrap_or_else(|_| {
            let dir = match path.parent() {
                Some(d) if !d.as_os_str().is_empty() => d,
                _ => std::path::Path::new("."),
            };
            match (std::fs::canonicalize(dir), path.file_name()) {
                (Ok(d), Some(name)) => d.join(name),
                _ => path.to_path_buf(),
            }
        });
        let mut held = TRACE_PATHS.lock().unwrap_or_else(|e| e.into_inner());
        if held.contains(&key) {
            return Err(Error::Config(format!(
                "trace `{}`: another runtime of this process writes its trace there (each \
                 runtime writes its own when it drops, and the last would replace the \
                 others'); give each runtime its own path",
                path.display()
            )));
        }
        held.push(key.clone());
        Ok(Some(TraceClaim(key)))
    }
}

impl Drop for TraceClaim {
    fn drop(&mut self) {
        let mut held = TRACE_PATHS.lock().unwrap_or_else(|e| e.into_inner());
        held.retain(|p| *p != self.0);
    }
}

/// The engine: owns the streams and buffers; tasks are submitted to it.
///
/// `Runtime` is `Sync`: several threads may submit; submission order is the
/// order in which submissions take the runtime's lock.
///
/// Dropping it waits for every task. A task error that no synchronisation
/// point reported is then only logged (a `tracing` warning: invisible
/// without a subscriber), since `drop` cannot return it: call
/// [`synchronize`](Self::synchronize) before the last drop to get it.
/// (The C++ `~Runtime` prints it to stderr.)
pub struct Runtime {
    shared: Arc<Shared>,
    /// The last value of `shared.completed` this runtime read (back-pressure).
    seen_completed: AtomicU64,
    state: Mutex<SubmitState>,
    threads: Vec<std::thread::JoinHandle<()>>,
    backend: Backend,
    /// This runtime's share of the core budget (its compute streams on CUDA).
    share: Share,
    /// Its registration with the core budget (CPU), left on drop, after the
    /// stream threads are joined.
    _lease: Option<Lease>,
    /// Its place on the live view's socket, left on drop.
    _live: Option<LiveRegistration>,
    /// A latency-critical runtime's registration with the process's classes.
    _tenant: Option<sched::tenants::Registration>,
    /// Its trace file, held until it has written it (after `Drop::drop`).
    _trace_claim: Option<TraceClaim>,
    config: RuntimeBuilder,
    /// The placement file and the scopes resolved from it.
    pub(crate) scopes: Scopes,
}

impl std::fmt::Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runtime")
            .field("id", &self.shared.runtime_id)
            .field("backend", &self.backend.name())
            .field("streams", &self.shared.streams.len())
            .field("policy", &self.config.policy)
            .finish()
    }
}

impl Runtime {
    /// A builder with the defaults: auto backend, 2 compute streams, 1 comm
    /// stream, affinity placement.
    pub fn builder() -> RuntimeBuilder {
        RuntimeBuilder::default()
    }

    /// The CPU backend with default settings.
    pub fn cpu() -> Result<Runtime> {
        Self::builder().backend(BackendKind::Cpu).build()
    }

    /// The backend's name (`cpu` or `cuda`).
    pub fn backend_name(&self) -> &'static str {
        self.backend.name()
    }

    /// Total number of streams (compute, then comm).
    pub fn streams(&self) -> usize {
        self.shared.streams.len()
    }

    /// The CUDA device this runtime drives, if any.
    pub fn cuda_device(&self) -> Option<&crate::cuda::CudaDevice> {
        match &self.backend {
            Backend::Cpu => None,
            Backend::Cuda(c) => Some(&c.device),
        }
    }

    /// Number of compute streams.
    pub fn compute_streams(&self) -> usize {
        self.config.compute_streams
    }

    /// How many compute streams the placement policy may use now: under
    /// [`Policy::Affinity`] on the CPU, this runtime's share of the process's
    /// core budget (it changes as CPU runtimes start and stop; see
    /// [`RuntimeBuilder::cpu_cores`]); 1 under `Single`; otherwise every
    /// compute stream.
    pub fn usable_compute_streams(&self) -> usize {
        match self.config.policy {
            Policy::Single => 1,
            Policy::RoundRobin => self.config.compute_streams,
            Policy::Affinity => self.share.get().min(self.config.compute_streams),
        }
    }

    /// Opens scope `name` (`"forward/layer3"`; nested in the scope this
    /// thread has open on this runtime, if any, so its path is the
    /// enclosing path joined with `name` by `/`) until the guard drops.
    /// Every task this thread submits to the runtime meanwhile is tagged
    /// with the path (the trace's `scope` argument) and placed as the
    /// placement file says for it (docs/scopes.md). Empty segments are
    /// ignored; an empty name opens nothing.
    ///
    /// ```
    /// # let rt = braid::Runtime::cpu()?;
    /// let _fwd = rt.scope("forward");
    /// let layer = rt.scope("layer3");
    /// assert_eq!(layer.path(), Some("forward/layer3"));
    /// # Ok::<(), braid::Error>(())
    /// ```
    pub fn scope(&self, name: &str) -> Scope {
        self.scopes.enter(name)
    }

    /// The path of the innermost scope this thread has open on this runtime.
    pub fn current_scope(&self) -> Option<std::sync::Arc<str>> {
        self.scopes.current().map(|t| t.path.clone())
    }

    /// The placement file this runtime was built with, if any.
    pub fn placement_file(&self) -> Option<&PlacementFile> {
        self.scopes.file()
    }

    /// The program's priority class: the builder's, or where the builder
    /// set none the placement file's `[runtime] class` (else normal).
    pub fn class(&self) -> Class {
        self.shared.class
    }

    /// On CUDA with [`RuntimeBuilder::spare_sms`]: how many of the device's
    /// SMs this runtime's compute kernels never run on (the request, as the
    /// driver rounded it). `None` on the CPU or when none are spared.
    pub fn spared_sms(&self) -> Option<u32> {
        match &self.backend {
            Backend::Cpu => None,
            Backend::Cuda(c) => c.green.as_ref().map(|g| g.spared()),
        }
    }

    /// The placement policy.
    pub fn policy(&self) -> Policy {
        self.config.policy
    }

    /// This runtime's rank.
    pub fn rank(&self) -> usize {
        self.shared.rank
    }

    /// The process-unique id of this runtime (the owner its buffers record).
    pub(crate) fn id(&self) -> u64 {
        self.shared.runtime_id
    }

    /// Allocates `bytes` zeroed bytes on the runtime's device.
    pub fn alloc(&self, name: impl Into<Cow<'static, str>>, bytes: usize) -> Result<Buffer> {
        let name = name.into();
        // The device's error, with the buffer it was for.
        let storage = self.backend.alloc(bytes).map_err(|e| match e {
            Error::Device {
                backend, message, ..
            } => Error::Device {
                backend,
                op: format!("allocating buffer `{name}` ({bytes} bytes)"),
                message,
            },
            e => e,
        })?;
        Ok(Buffer {
            inner: Arc::new(BufferInner {
                id: next_id(IdKind::Buffer),
                runtime: self.shared.runtime_id,
                name,
                len: bytes,
                storage,
                on_drop: self.shared.dropped.clone(),
            }),
        })
    }

    /// Allocates a buffer holding a copy of `data` (the upload is a task).
    pub fn alloc_from<T: bytemuck::Pod>(
        &self,
        name: impl Into<Cow<'static, str>>,
        data: &[T],
    ) -> Result<Buffer> {
        let buf = self.alloc(name, std::mem::size_of_val(data))?;
        self.upload(&buf, data)?;
        Ok(buf)
    }

    /// Copies `data` into `v` (a write task named `upload`; returns at once).
    pub fn upload<T: bytemuck::Pod>(&self, v: impl AsView, data: &[T]) -> Result<TaskHandle> {
        self.upload_named("upload", v, data)
    }

    /// [`upload`](Self::upload) as a task named `name` (what the trace
    /// shows).
    pub fn upload_named<T: bytemuck::Pod>(
        &self,
        name: impl Into<Cow<'static, str>>,
        v: impl AsView,
        data: &[T],
    ) -> Result<TaskHandle> {
        let v = v.as_view();
        let src: &[u8] = bytemuck::cast_slice(data);
        if src.len() != v.len() {
            return Err(Error::Usage(format!(
                "upload of {} bytes into a view of {} bytes of `{}`",
                src.len(),
                v.len(),
                v.buffer().name()
            )));
        }
        // The task uploads a copy (the caller's slice may go before it
        // runs); a copy the host cannot hold is an error, not an abort.
        let mut bytes = Vec::new();
        bytes
            .try_reserve_exact(src.len())
            .map_err(|_| Error::Device {
                backend: "cpu",
                op: format!("copying an upload into `{}`", v.buffer().name()),
                message: format!("out of host memory allocating {} bytes", src.len()),
            })?;
        bytes.extend_from_slice(src);
        // One copy of the data, shared by whichever body the backend runs.
        let host = Arc::new(bytes);
        let dev_bytes = host.clone();
        // A best-effort runtime's long copies go in bundles (`transfer`).
        let class = self.shared.class;
        self.task(name).kind(TaskKind::Host).run_any(
            v.write::<u8>(),
            move |dst| {
                let Ok(()) = transfer(class, dst.len(), |r| {
                    dst[r.clone()].copy_from_slice(&host[r]);
                    Ok::<_, Infallible>(())
                });
            },
            move |dst, cu| {
                transfer(class, dev_bytes.len(), |r| {
                    let at = dst.ptr() + r.start as u64;
                    crate::backend::gpu::upload(cu.stream(), at, &dev_bytes[r])
                })?;
                Ok(())
            },
        )
    }

    /// Reads `v` back after every earlier write to it (a synchronisation point
    /// for this view only).
    pub fn read_vec<T: bytemuck::Pod>(&self, v: impl AsView) -> Result<Vec<T>> {
        self.read_vec_named("read back", v)
    }

    /// [`read_vec`](Self::read_vec) as a task named `name`.
    pub(crate) fn read_vec_named<T: bytemuck::Pod>(
        &self,
        name: &'static str,
        v: impl AsView,
    ) -> Result<Vec<T>> {
        // Refused before a read task is submitted that nobody would wait for.
        self.shared.check_may_wait("Runtime::read_vec")?;
        let v = v.as_view();
        if lock(&self.state)
            .recorder
            .as_ref()
            .is_some_and(|r| !r.is_auto())
        {
            return Err(Error::Usage(format!(
                "`Runtime::read_vec` of `{}` while a schedule is being recorded: the read-back \
                 would be recorded, and every replay would read into a result nobody sees; \
                 read after `record` returns, or after a replay",
                v.buffer().name()
            )));
        }
        let sz = size_of::<T>();
        if sz == 0 || v.len() % sz != 0 {
            return Err(Error::Misaligned {
                task: None,
                buffer: v.buffer().name().to_string(),
                range: v.range(),
                ty: std::any::type_name::<T>(),
            });
        }
        let out = Arc::new(Mutex::new(Vec::<u8>::new()));
        let (sink, dev_sink) = (out.clone(), out.clone());
        let class = self.shared.class;
        let h = self.task(name).kind(TaskKind::Host).run_any(
            v.read::<u8>(),
            move |src| {
                let mut bytes = Vec::with_capacity(src.len());
                let Ok(()) = transfer(class, src.len(), |r| {
                    bytes.extend_from_slice(&src[r]);
                    Ok::<_, Infallible>(())
                });
                *lock(&sink) = bytes;
            },
            move |src, cu| {
                let mut bytes = vec![0u8; src.len()];
                transfer(class, src.len(), |r| {
                    let at = src.ptr() + r.start as u64;
                    crate::backend::gpu::download(cu.stream(), at, &mut bytes[r])
                })?;
                *lock(&dev_sink) = bytes;
                Ok(())
            },
        )?;
        h.wait()?;
        let bytes = std::mem::take(&mut *lock(&out));
        Ok(bytemuck::pod_collect_to_vec(&bytes))
    }

    pub(crate) fn submit(&self, b: NewTask) -> Result<TaskHandle> {
        let _span = tracing::trace_span!("submit", task = %b.name).entered();
        if let Some(s) = b.stream {
            if s >= self.streams() {
                return Err(Error::Usage(format!(
                    "task `{}` pinned to stream {s}, but the runtime has {} streams",
                    b.name,
                    self.streams()
                )));
            }
        }
        self.before_submitting();
        let (task, inline) = {
            let mut st = lock(&self.state);
            sched::submit(&mut st, &self.shared, b)
        };
        if let Some(launch) = inline {
            // Outside the lock: the body may submit tasks itself.
            sched::run_inline(&self.shared, &task, launch);
        }
        Ok(TaskHandle {
            task,
            shared: self.shared.clone(),
        })
    }

    /// What every submission does first: waits for room in the launch
    /// window and gives the submitting thread its class's spin-waits (and
    /// real-time policy). (A busy period starts as the first task is
    /// counted, `sched::live::submitted`.)
    fn before_submitting(&self) {
        self.wait_for_room();
        sched::tenants::program_thread(&self.shared);
    }

    /// Back-pressure: waits until the launch window has room (not from inside
    /// a task of this runtime, which the window might be waiting for).
    fn wait_for_room(&self) {
        // `completed` is written by every stream thread; read it only when the
        // last value seen says the window may be full, so the common case
        // touches no shared cache line.
        let window = self.config.window as u64;
        let submitted = self.shared.submitted.load(Ordering::Relaxed);
        if submitted >= window + self.seen_completed.load(Ordering::Relaxed) {
            let done = self.shared.completed.get();
            if done + window <= submitted && self.shared.check_may_wait("submit").is_ok() {
                // Full: wait until half the window has drained (hysteresis), so
                // a submitter that outpaces the streams sleeps once per half
                // window, not once per task.
                self.shared
                    .completed
                    .wait_at_least(submitted + 1 - window.div_ceil(2).min(window));
            }
            self.seen_completed
                .store(self.shared.completed.get(), Ordering::Relaxed);
        }
    }

    /// Starts recording every task submitted from now on (`Runtime::record`).
    pub(crate) fn start_recording(&self) -> Result<()> {
        let mut st = lock(&self.state);
        if st.recorder.as_ref().is_some_and(|r| r.is_auto()) {
            // An automatic recording gives way to an explicit one.
            st.recorder = None;
        }
        if st.recorder.is_some() {
            return Err(Error::Usage(
                "a schedule is already being recorded on this runtime".into(),
            ));
        }
        sched::auto::Auto::foreign(&mut st);
        let first = st.next_id();
        st.recorder = Some(sched::replay::Recorder::new(first));
        Ok(())
    }

    /// Stops recording; the tasks kept, if a recording was on.
    pub(crate) fn stop_recording(&self) -> Option<sched::replay::Recorder> {
        lock(&self.state).recorder.take()
    }

    /// Whether schedules are re-placed from measured durations.
    pub(crate) fn config_replace(&self) -> bool {
        self.config.replace
    }

    /// Whether replays run as one task record per step (CUDA, or asked).
    pub(crate) fn replays_materialised(&self) -> bool {
        self.config.replay_as_tasks || !matches!(self.backend, Backend::Cpu)
    }

    /// Whether replays run as one unit ([`RuntimeBuilder::graphs`]): as the
    /// builder says, else on CUDA unless best-effort (whose kernels go in
    /// bounded bundles, docs/tenants.md, which a graph launch cannot be).
    pub(crate) fn config_graphs(&self) -> bool {
        self.config.graphs.unwrap_or_else(|| {
            matches!(self.backend, Backend::Cuda(_)) && self.shared.class != Class::BestEffort
        })
    }

    /// Whether recorded schedules begin with a placement trial
    /// ([`RuntimeBuilder::placement_trial`]): replays made tasks only, by
    /// default on CUDA.
    pub(crate) fn config_placement_trial(&self) -> bool {
        self.replays_materialised()
            && self
                .config
                .placement_trial
                .unwrap_or(matches!(self.backend, Backend::Cuda(_)))
    }

    /// Submits one replay of `plan` as one unit (a CUDA graph launch, or a
    /// sequential run on the CPU), capturing it first when `slot` is untried.
    /// `Ok(None)`: the schedule is not a graph (`slot` says why); replay it
    /// the ordinary way.
    pub(crate) fn submit_graph_replay(
        &self,
        plan: &std::sync::Arc<sched::replay::Plan>,
        slot: &std::sync::Mutex<crate::schedule::GraphSlot>,
    ) -> Result<Option<TaskHandle>> {
        use crate::schedule::GraphSlot;
        use sched::capture::Unit;
        self.before_submitting();
        // The slot before the runtime's lock, always: a capture lets go of
        // the runtime's lock while it waits (below) and takes it again.
        let mut slot = slot.lock().unwrap_or_else(|e| e.into_inner());
        let mut st = lock(&self.state);
        Self::check_replay_allowed(&st, plan)?;
        let (split, fence) = match &*slot {
            GraphSlot::Ready(u) => (u.clone(), false),
            GraphSlot::Refused(_) => return Ok(None),
            GraphSlot::Untried => {
                let collectives = self.config.graph_collectives;
                let made = match (sched::split::split(plan, collectives), &self.backend) {
                    (Err(why), _) => Err(why),
                    (Ok(split), Backend::Cpu) => split.made(|_, ()| Ok(Unit::Cpu)),
                    (Ok(_), Backend::Cuda(_)) if self.shared.class == Class::BestEffort => Err(
                        "a best-effort runtime keeps about a millisecond of work in flight \
                             (docs/tenants.md); a graph launches its whole schedule at once"
                            .to_string(),
                    ),
                    (Ok(_), Backend::Cuda(_))
                        if self.shared.check_not_in_task("capture").is_err() =>
                    {
                        Err(
                            "first replayed from inside a task, which a capture would wait for"
                                .to_string(),
                        )
                    }
                    (Ok(split), Backend::Cuda(c)) => {
                        // No body of the schedule may be running, and no
                        // stream launching, while it captures.
                        st = self.lock_when_idle(st, plan)?;
                        match sched::split::capture_cuda(split, plan, c) {
                            // Collectives that cannot be captured (or any
                            // other refusal): the graphs cut around them,
                            // as without `graph_collectives`.
                            Err(why) if collectives && plan.has_collectives() => {
                                tracing::warn!(
                                    schedule = %plan.name,
                                    "collectives not captured, graphs cut around them: {why}"
                                );
                                let cut = sched::split::split(plan, false)
                                    .and_then(|split| sched::split::capture_cuda(split, plan, c));
                                cut.map(|split| sched::split::Split {
                                    collectives_left_out: Some(why),
                                    ..split
                                })
                            }
                            made => made,
                        }
                    }
                };
                match made {
                    Ok(split) => {
                        let split = std::sync::Arc::new(split);
                        *slot = GraphSlot::Ready(split.clone());
                        (split, true)
                    }
                    Err(why) => {
                        tracing::warn!(schedule = %plan.name, "not replayed as a graph: {why}");
                        *slot = GraphSlot::Refused(why);
                        return Ok(None);
                    }
                }
            }
        };
        sched::auto::Auto::foreign(&mut st);
        let task = sched::split::submit(&mut st, &self.shared, plan, &split, fence);
        Ok(Some(TaskHandle {
            task,
            shared: self.shared.clone(),
        }))
    }

    /// Waits until every stream has completed its tasks up to `frontier`.
    fn wait_done(&self, frontier: &[u64]) {
        sched::tenants::program_thread(&self.shared);
        for (s, &seq) in self.shared.streams.iter().zip(frontier) {
            s.done.wait_at_least(seq);
        }
    }

    /// The runtime's lock, once every task submitted so far has completed:
    /// waits without it (a running body may submit, which takes it), then
    /// checks again under it, until nothing is left; a replay of `plan`
    /// must still be allowed then.
    fn lock_when_idle<'a>(
        &'a self,
        mut st: crate::sync::MutexGuard<'a, sched::SubmitState>,
        plan: &sched::replay::Plan,
    ) -> Result<crate::sync::MutexGuard<'a, sched::SubmitState>> {
        loop {
            let frontier = st.frontier();
            let streams = &self.shared.streams;
            if streams
                .iter()
                .zip(&frontier)
                .all(|(s, &seq)| s.done.get() >= seq)
            {
                return Ok(st);
            }
            drop(st);
            self.wait_done(&frontier);
            st = lock(&self.state);
            Self::check_replay_allowed(&st, plan)?;
        }
    }

    /// Refuses a replay while a schedule is being recorded.
    fn check_replay_allowed(st: &sched::SubmitState, plan: &sched::replay::Plan) -> Result<()> {
        if st.recorder.as_ref().is_some_and(|r| !r.is_auto()) {
            return Err(Error::Usage(format!(
                "schedule `{}` replayed while a schedule is being recorded",
                plan.name
            )));
        }
        Ok(())
    }

    /// Submits one replay of `plan`; returns the handle of its end.
    pub(crate) fn submit_replay(
        &self,
        plan: &std::sync::Arc<sched::replay::Plan>,
        how: sched::replay::How,
    ) -> Result<TaskHandle> {
        let _span = tracing::trace_span!("replay", schedule = %plan.name).entered();
        self.before_submitting();
        let task = {
            let mut st = lock(&self.state);
            Self::check_replay_allowed(&st, plan)?;
            // A replay is foreign work to automatic replay's step.
            sched::auto::Auto::foreign(&mut st);
            sched::replay::submit(&mut st, &self.shared, plan, how)
        };
        Ok(TaskHandle {
            task,
            shared: self.shared.clone(),
        })
    }

    /// Waits for every task submitted so far; returns the errors of tasks that
    /// failed since the last synchronisation point (dependents of a failed
    /// task are skipped and not reported separately). The runtime stays usable.
    pub fn synchronize(&self) -> Result<()> {
        let _span = tracing::trace_span!("synchronize").entered();
        self.shared.check_may_wait("Runtime::synchronize")?;
        let frontier = {
            let mut st = lock(&self.state);
            sched::auto::Auto::boundary(&mut st);
            st.frontier()
        };
        self.wait_done(&frontier);
        let mut errors: Vec<Error> = std::mem::take(&mut *lock(&self.shared.errors))
            .into_iter()
            .map(|(_, e)| e)
            .collect();
        // Errors the CUDA layer found in `Drop` (a failed free, event destroy)
        // are recorded on the device and reported here, as cudarc does.
        if let Backend::Cuda(c) = &self.backend {
            errors.extend(c.device.take_deferred_errors().into_iter().map(Error::from));
        }
        // Everything before this point is finished: forget it, failures
        // included, so new work does not inherit reported failures.
        lock(&self.state).prune_finished();
        match Error::join(errors) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// What the scheduler has done so far.
    pub fn stats(&self) -> crate::sched::Stats {
        lock(&self.state).stats
    }

    /// The spans recorded so far (empty unless profiling is on).
    pub fn profile(&self) -> Profile {
        let mut spans = Vec::new();
        for s in &self.shared.streams {
            spans.extend(lock(&s.spans).iter().cloned());
        }
        spans.sort_by_key(|s| (s.start_ns, s.stream));
        Profile {
            rank: self.shared.rank,
            streams: self
                .shared
                .streams
                .iter()
                .map(|s| StreamInfo {
                    name: s.name.clone(),
                    is_comm: s.is_comm,
                })
                .collect(),
            spans,
            class: Some(self.shared.class),
            busy: lock(&self.shared.busy).periods.clone(),
        }
    }

    /// Forgets the spans and busy periods recorded so far (e.g. after
    /// warm-up steps).
    pub fn clear_profile(&self) {
        for s in &self.shared.streams {
            let mut spans = lock(&s.spans);
            s.spans_cleared
                .fetch_add(spans.len() as u64, Ordering::Relaxed);
            spans.clear();
        }
        lock(&self.shared.busy).periods.clear();
    }

    /// Writes this runtime's profile as a Chrome trace.
    pub fn write_trace(&self, path: impl AsRef<std::path::Path>) -> Result<()> {
        crate::trace::write_chrome_trace(path, &[&self.profile()])
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        // Dropped by one of its own tasks (a body held the last handle): the
        // stream threads cannot be joined from here; closing their queues lets
        // them finish the queued work and exit on their own.
        let on_own_thread = self.shared.check_not_in_task("drop").is_err();
        if !on_own_thread {
            if let Err(e) = self.synchronize() {
                tracing::warn!("runtime dropped with unreported task errors: {e}");
            }
        }
        for s in &self.shared.streams {
            s.queue.close();
        }
        if on_own_thread {
            self.threads.clear();
            return;
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        if let Some(path) = self.config.trace.clone() {
            if let Err(e) = self.write_trace(&path) {
                eprintln!("braid: {e}");
            }
        }
    }
}

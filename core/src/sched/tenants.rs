//! Priority classes across the runtimes of one process (`Class`).
//!
//! GPUs cannot preempt a running kernel, and a CPU stream thread does not
//! stop in the middle of a task, so a latency-critical task is protected by
//! admission, not preemption: a best-effort stream thread starts a task (or
//! a replayed step) only while no latency-critical runtime of the process has
//! an unfinished task. A latency-critical task therefore waits for at most the
//! best-effort work already started — one task per best-effort stream on the
//! CPU, about a millisecond of launched kernels per best-effort stream on
//! CUDA ([`DeviceBundle`]), one bundle of a long transfer ([`transfer`]).
//!
//! On the CPU the operating system also helps: best-effort stream threads run
//! at `SCHED_IDLE` (Linux), so a task already running yields its core the
//! moment a latency-critical (or normal) thread wants it. Raising a priority
//! needs privileges; lowering one does not, so latency-critical threads keep
//! the default policy.
//!
//! A best-effort runtime waits while latency-critical work keeps arriving:
//! best effort is what it is. Its failures stay its own (errors are per
//! runtime); nothing here waits on a best-effort runtime.

use super::Shared;
use crate::sync::Ordering;
use std::sync::atomic::AtomicUsize;
use std::sync::{RwLock, Weak};
use std::time::Duration;

/// The latency-critical runtimes alive in the process.
static LATENCY_CRITICAL: RwLock<Vec<(u64, Weak<Shared>)>> = RwLock::new(Vec::new());
/// How many there are (read first: the common case has none).
static COUNT: AtomicUsize = AtomicUsize::new(0);

/// How long a held-back best-effort thread sleeps between looks.
const POLL: Duration = Duration::from_micros(20);

/// A latency-critical runtime's registration; leaving on drop.
#[derive(Debug)]
pub(crate) struct Registration(u64);

/// Registers `shared` (a latency-critical runtime) until the registration
/// drops.
pub(crate) fn register(shared: &crate::sync::Arc<Shared>) -> Registration {
    let id = shared.runtime_id;
    #[cfg(not(loom))]
    let weak = crate::sync::Arc::downgrade(shared);
    #[cfg(loom)]
    let weak: Weak<Shared> = Weak::new();
    let mut lc = LATENCY_CRITICAL.write().unwrap_or_else(|p| p.into_inner());
    lc.push((id, weak));
    COUNT.store(lc.len(), Ordering::Release);
    Registration(id)
}

impl Drop for Registration {
    fn drop(&mut self) {
        let mut lc = LATENCY_CRITICAL.write().unwrap_or_else(|p| p.into_inner());
        lc.retain(|(id, _)| *id != self.0);
        COUNT.store(lc.len(), Ordering::Release);
    }
}

/// Whether a latency-critical runtime of the process has unfinished tasks.
pub(crate) fn latency_critical_busy() -> bool {
    if COUNT.load(Ordering::Acquire) == 0 {
        return false;
    }
    let lc = LATENCY_CRITICAL.read().unwrap_or_else(|p| p.into_inner());
    lc.iter()
        .filter_map(|(_, w)| w.upgrade())
        .any(|s| s.submitted.load(Ordering::Acquire) > s.completed.get())
}

/// Whether `runtime_id` names a latency-critical runtime of the process.
pub(crate) fn is_latency_critical(runtime_id: u64) -> bool {
    if runtime_id == 0 || COUNT.load(Ordering::Acquire) == 0 {
        return false;
    }
    let lc = LATENCY_CRITICAL.read().unwrap_or_else(|p| p.into_inner());
    lc.iter().any(|(id, _)| *id == runtime_id)
}

thread_local! {
    /// This thread is a stream thread of a best-effort CPU runtime.
    static BEST_EFFORT: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// This thread belongs to a best-effort program: a stream thread of a
    /// best-effort runtime (CPU or CUDA), or a thread that entered the class
    /// (`Class::BestEffort.enter()`). A latency-critical runtime it submits
    /// to or waits on never promotes it ([`program_thread`]). Unlike
    /// [`BEST_EFFORT`], a task run inline does not change it.
    static BEST_EFFORT_THREAD: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether the calling thread belongs to a best-effort program (a
/// best-effort runtime's stream thread, or a thread that entered the
/// class): a latency-critical task it submits is not run inline on it,
/// where it would run at the idle policy (`sched::hand_off`).
pub(crate) fn on_best_effort_thread() -> bool {
    BEST_EFFORT_THREAD.with(std::cell::Cell::get)
}

/// Marks the calling thread as a stream thread of a runtime of `class`
/// (any backend) for [`program_thread`].
pub(crate) fn mark_program_thread(class: crate::kind::Class) {
    BEST_EFFORT_THREAD.with(|b| b.set(class == crate::kind::Class::BestEffort));
}

/// Marks the calling thread as a stream thread of a runtime of `class`.
pub(crate) fn mark_stream_thread(class: crate::kind::Class) {
    BEST_EFFORT.with(|b| b.set(class == crate::kind::Class::BestEffort));
}

/// Marks the calling thread as running a task of `class` (one run inline,
/// on whatever thread submitted it), returning the mark to restore after:
/// [`preemption_point`] pauses the task by its own class, not the
/// thread's. (A latency-critical task that a best-effort body submitted and
/// ran inline would otherwise pause there until latency-critical work
/// ended, its own included: forever.)
pub(crate) fn enter_class(class: crate::kind::Class) -> bool {
    BEST_EFFORT.with(|b| b.replace(class == crate::kind::Class::BestEffort))
}

/// Restores the mark [`enter_class`] returned.
pub(crate) fn leave_class(mark: bool) {
    BEST_EFFORT.with(|b| b.set(mark));
}

/// Called by a thread that submits to, or waits on, the runtime of
/// `shared`: a thread of a latency-critical program stops yielding in its
/// spin-waits (`sync::set_no_yield`), and with `realtime` takes the
/// real-time policy, for good. Not a thread of a best-effort program (a
/// best-effort runtime's stream thread whose task body asks a
/// latency-critical runtime for something, or a thread that entered the
/// best-effort class): it stays at its own class's policy, or the training
/// would run at real time beside the program that asked for it.
pub(crate) fn program_thread(shared: &Shared) {
    if shared.class == crate::kind::Class::LatencyCritical
        && !BEST_EFFORT_THREAD.with(std::cell::Cell::get)
    {
        crate::sync::set_no_yield();
        if shared.realtime {
            enter_realtime();
        }
    }
}

/// Gives the calling thread the lowest real-time priority (Linux
/// `SCHED_FIFO` 1), once per thread (`RuntimeBuilder::realtime`). Where the
/// OS refuses (no `CAP_SYS_NICE`, `RLIMIT_RTPRIO` 0), the thread keeps its
/// policy and the process warns once.
pub(crate) fn enter_realtime() {
    thread_local! {
        static ASKED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    }
    if ASKED.with(|a| a.replace(true)) {
        return;
    }
    #[cfg(target_os = "linux")]
    {
        static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
        if let Err(e) = set_policy(libc::SCHED_FIFO, 1) {
            if !WARNED.swap(true, Ordering::AcqRel) {
                tracing::warn!(
                    "latency-critical threads asked for SCHED_FIFO and the OS refused ({e}): \
                     they keep the default policy (it needs CAP_SYS_NICE or RLIMIT_RTPRIO >= 1)"
                );
            }
        }
    }
}

/// Puts the calling thread back to the default policy if it inherited a
/// real-time one: Linux threads start with their creator's policy, and a
/// thread that submitted to a real-time latency-critical runtime keeps
/// `SCHED_FIFO` for good ([`enter_realtime`]), so a runtime it builds
/// later would otherwise run its stream threads at real time too (a
/// best-effort training run beside the very program that asked for it).
/// The live view's and the watchdog's threads call it; a runtime's stream
/// threads call [`leave_inherited_policy`], which also leaves an inherited
/// idle policy. Leaving a real-time policy needs no privilege.
pub(crate) fn leave_inherited_realtime() {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: pid 0 names the calling thread; no pointers.
        let policy = unsafe { libc::sched_getscheduler(0) };
        if policy == libc::SCHED_FIFO || policy == libc::SCHED_RR {
            if let Err(e) = set_policy(libc::SCHED_OTHER, 0) {
                tracing::debug!("leaving an inherited real-time policy: {e}");
            }
        }
    }
}

/// Puts a stream thread of a runtime of `class` back to the default policy
/// if it inherited one its class does not give: a real-time policy unless
/// the runtime asked for real time itself (`realtime`), as
/// [`leave_inherited_realtime`] does, and the idle policy unless the
/// runtime is best-effort. Linux threads start with their creator's policy,
/// so a latency-critical or normal runtime built by a thread that called
/// `Class::BestEffort.enter()` (a best-effort program's rank thread, say)
/// would otherwise run its stream threads at `SCHED_IDLE`. (Braid never
/// changes a thread's nice value, so there is none to undo.) Leaving the
/// idle policy needs `CAP_SYS_NICE` or an `RLIMIT_NICE` of at least 20
/// (the kernel counts `SCHED_IDLE` as nice 20); where the OS refuses, the
/// thread keeps it and the process warns once.
pub(crate) fn leave_inherited_policy(class: crate::kind::Class, realtime: bool) {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: pid 0 names the calling thread; no pointers.
        let policy = unsafe { libc::sched_getscheduler(0) };
        let real_time = policy == libc::SCHED_FIFO || policy == libc::SCHED_RR;
        let idle = policy == libc::SCHED_IDLE;
        if real_time && !realtime {
            if let Err(e) = set_policy(libc::SCHED_OTHER, 0) {
                tracing::debug!("leaving an inherited real-time policy: {e}");
            }
        } else if idle && class != crate::kind::Class::BestEffort {
            static WARNED: std::sync::atomic::AtomicBool =
                std::sync::atomic::AtomicBool::new(false);
            if let Err(e) = set_policy(libc::SCHED_OTHER, 0) {
                if !WARNED.swap(true, Ordering::AcqRel) {
                    tracing::warn!(
                        "a {} runtime's stream threads inherited SCHED_IDLE from the thread that \
                         built the runtime (one that called `Class::BestEffort.enter()`), and \
                         the OS refused the default policy ({e}; it needs CAP_SYS_NICE or \
                         RLIMIT_NICE >= 20): they keep the idle policy. Build the runtime on a \
                         thread that has not entered best-effort",
                        class.name()
                    );
                }
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (class, realtime);
}

/// Gives the calling thread scheduling `policy` at `priority` (Linux).
#[cfg(target_os = "linux")]
fn set_policy(policy: libc::c_int, priority: libc::c_int) -> std::io::Result<()> {
    let param = libc::sched_param {
        sched_priority: priority,
    };
    // SAFETY: `param` is a valid `sched_param` for the call's duration; pid 0
    // names the calling thread.
    match unsafe { libc::sched_setscheduler(0, policy, &param) } {
        0 => Ok(()),
        _ => Err(std::io::Error::last_os_error()),
    }
}

/// A point inside a long task body where a best-effort task may pause.
///
/// In a task of a best-effort CPU runtime, returns once no latency-critical
/// runtime of the process has an unfinished task (it sleeps meanwhile);
/// anywhere else it returns at once (a thread-local read). Admission stops a
/// best-effort task from *starting* while latency-critical work runs; this
/// stops one that had already started, at the next point its body reaches,
/// so the memory system and the caches are left to the latency-critical
/// program (on a machine with few cores they are what a request waits for:
/// docs/tenants.md). A body calls it between pieces of work that leave no
/// lock held and nothing half-published (the GPT-2 CPU attention calls it
/// once per row). Where a body pauses never changes what it computes.
///
/// Latency-critical work must not wait for best-effort work (admission has
/// the same rule): a request that waits for a paused task waits forever.
pub fn preemption_point() {
    if BEST_EFFORT.with(std::cell::Cell::get) {
        wait_for_latency_critical();
    }
}

/// Called by a best-effort stream thread before it starts a task: returns
/// once no latency-critical task is unfinished.
pub(crate) fn admit(shared: &Shared) {
    if shared.class == crate::kind::Class::BestEffort {
        wait_for_latency_critical();
    }
}

/// How long one bundle of a best-effort transfer should take: what a
/// latency-critical program's own transfer or task waits behind at most,
/// once the transfer has started.
const TRANSFER_BUNDLE_NS: u128 = 1_000_000;
/// A best-effort transfer's first bundle, before its rate is known; a
/// transfer this short is one bundle.
const FIRST_TRANSFER_BUNDLE: usize = 4 << 20;
/// Bounds on a bundle sized from a measured rate.
const TRANSFER_BUNDLES: std::ops::RangeInclusive<usize> = (256 << 10)..=(256 << 20);

/// Copies `len` bytes by calling `copy` on ranges of them, in order. For a
/// best-effort runtime a long transfer goes in bundles: the first
/// [`FIRST_TRANSFER_BUNDLE`] bytes, then bundles sized from the rate the
/// previous one ran at to take about [`TRANSFER_BUNDLE_NS`], and between
/// two bundles the copy waits while a latency-critical runtime of the
/// process has unfinished work. A copy cannot be preempted once started,
/// and a copy engine does not order copies by stream priority, so without
/// bundles a latency-critical request's few bytes could wait behind a
/// whole model's parameters. Other classes copy in one call.
pub(crate) fn transfer<E>(
    class: crate::kind::Class,
    len: usize,
    mut copy: impl FnMut(std::ops::Range<usize>) -> Result<(), E>,
) -> Result<(), E> {
    if class != crate::kind::Class::BestEffort {
        return copy(0..len);
    }
    let (mut at, mut bundle) = (0, FIRST_TRANSFER_BUNDLE);
    while at < len {
        if at > 0 {
            wait_for_latency_critical();
        }
        let end = len.min(at + bundle);
        let start = std::time::Instant::now();
        copy(at..end)?;
        let ns = start.elapsed().as_nanos().max(1);
        let sized = (end - at) as u128 * TRANSFER_BUNDLE_NS / ns;
        bundle = (sized.min(usize::MAX as u128) as usize)
            .clamp(*TRANSFER_BUNDLES.start(), *TRANSFER_BUNDLES.end());
        at = end;
    }
    Ok(())
}

/// How much launched-but-unfinished device work a best-effort CUDA stream
/// keeps at most (estimated) by default: the bundle a latency-critical
/// kernel may find queued ahead of it on that stream
/// (`RuntimeBuilder::device_bundle`).
pub(crate) const DEVICE_BUNDLE: std::time::Duration = std::time::Duration::from_millis(1);
/// A task of a name not yet timed is charged this share of a window: five
/// of them fill it.
const UNTIMED_TASKS_PER_BUNDLE: u64 = 5;

/// The launch window of a best-effort CUDA stream thread, in device time.
///
/// A CUDA stream thread launches a task and moves on: without a bound, a
/// best-effort stream can have a whole training step queued on the device
/// before a latency-critical request arrives, and admission (which only
/// stops new launches) cannot take it back. Stream priorities let the
/// request's blocks go first as blocks free up, but not past a kernel whose
/// blocks hold the SMs, nor past work that shares its hardware queue. So a
/// best-effort stream keeps at most about a window of work in flight
/// ([`DEVICE_BUNDLE`] unless the builder says otherwise): before each
/// launch the thread waits for its oldest tasks until the new one fits (one
/// task always fits in an empty window). Each task is charged its name's
/// device time, measured from its start and end events (an exponentially
/// weighted mean, weight 1/4 on the newest, kept by this thread: not the
/// placement's cost model, which a CUDA runtime leaves empty), or a fifth
/// of the window ([`UNTIMED_TASKS_PER_BUNDLE`]) before the first
/// measurement.
#[derive(Debug)]
pub(crate) struct DeviceBundle {
    estimates: std::collections::HashMap<u32, u64>,
    in_flight_ns: u64,
    window_ns: u64,
}

impl DeviceBundle {
    /// An empty window of `window_ns` of device time (at least 1).
    pub(crate) fn new(window_ns: u64) -> Self {
        DeviceBundle {
            estimates: Default::default(),
            in_flight_ns: 0,
            window_ns: window_ns.max(1),
        }
    }

    /// What launching a task of estimate slot `slot` charges the window.
    pub(crate) fn charge(&self, slot: u32) -> u64 {
        self.estimates
            .get(&slot)
            .copied()
            .unwrap_or(self.window_ns / UNTIMED_TASKS_PER_BUNDLE)
            .max(1)
    }

    /// Whether a task charged `ns` must wait for the oldest task in flight
    /// before it launches.
    pub(crate) fn full(&self, ns: u64) -> bool {
        self.in_flight_ns > 0 && self.in_flight_ns + ns > self.window_ns
    }

    /// A task charged `ns` was launched.
    pub(crate) fn launched(&mut self, ns: u64) {
        self.in_flight_ns += ns;
    }

    /// A task of `slot` charged `charged` completed after `measured` ns of
    /// device time (if its events could be read).
    pub(crate) fn completed(&mut self, slot: u32, charged: u64, measured: Option<u64>) {
        self.in_flight_ns = self.in_flight_ns.saturating_sub(charged);
        if let Some(ns) = measured {
            self.estimates
                .entry(slot)
                .and_modify(|e| *e = *e - *e / 4 + ns / 4)
                .or_insert(ns);
        }
    }
}

/// Sleeps until no latency-critical task of the process is unfinished.
fn wait_for_latency_critical() {
    while latency_critical_busy() {
        std::thread::sleep(POLL);
    }
}

// Here rather than in `kind.rs`, which stays a leaf: what a class does to a
// thread is this module's business.
impl crate::kind::Class {
    /// Gives the calling thread this class's scheduling policy: the idle
    /// policy for best-effort (Linux; a system that refuses leaves the
    /// thread as it was); for latency-critical, spin-waits that never
    /// yield their core (a yield can hand it to an idle-policy thread for
    /// a whole time slice); nothing for normal. A runtime applies it to its
    /// own stream threads, and a latency-critical runtime to the threads
    /// that submit to it or wait on it (but not to a thread that entered
    /// best-effort, nor to a best-effort runtime's stream thread); a
    /// best-effort program applies it to the threads that submit its tasks,
    /// so its host work yields too.
    pub fn enter(self) {
        BEST_EFFORT_THREAD.with(|b| b.set(self == crate::kind::Class::BestEffort));
        match self {
            crate::kind::Class::BestEffort => lower_this_thread(),
            crate::kind::Class::LatencyCritical => crate::sync::set_no_yield(),
            crate::kind::Class::Normal => {}
        }
    }
}

/// Lowers the calling (stream) thread to the idle scheduling policy, for a
/// best-effort CPU runtime. Best effort: a system that refuses keeps the
/// default policy.
fn lower_this_thread() {
    #[cfg(target_os = "linux")]
    if let Err(e) = set_policy(libc::SCHED_IDLE, 0) {
        tracing::debug!("SCHED_IDLE refused: {e}");
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::{DeviceBundle, DEVICE_BUNDLE};
    use crate::kind::Class;
    use crate::{BackendKind, Runtime};

    /// Whether spin-waits yield in a thread that submits to a runtime of
    /// `class`, and in that runtime's stream thread.
    fn yields_in(class: Class) -> (bool, bool) {
        std::thread::spawn(move || {
            let rt = Runtime::builder()
                .backend(BackendKind::Cpu)
                .compute_streams(1)
                .oversubscribe(true)
                .inline_short_tasks(false)
                .class(class)
                .build()
                .unwrap();
            let out = rt.alloc("out", 1).unwrap();
            rt.task("look")
                .run(out.write::<u8>(), |o| {
                    o[0] = u8::from(crate::sync::yields())
                })
                .unwrap();
            let stream = rt.read_vec::<u8>(&out).unwrap()[0] == 1;
            (crate::sync::yields(), stream)
        })
        .join()
        .unwrap()
    }

    /// The ranges a transfer of `len` bytes by a runtime of `class` copies.
    fn bundles(class: Class, len: usize) -> Vec<std::ops::Range<usize>> {
        let mut seen = Vec::new();
        super::transfer(class, len, |r| {
            seen.push(r);
            Ok::<_, ()>(())
        })
        .unwrap();
        seen
    }

    /// Other classes copy in one call; a best-effort runtime copies a long
    /// transfer in bundles, in order, every byte once, each within the
    /// bounds.
    #[test]
    fn best_effort_transfers_go_in_bundles() {
        let len = (super::FIRST_TRANSFER_BUNDLE * 5) / 2 + 3;
        assert_eq!(bundles(Class::Normal, len), vec![0..len]);
        assert_eq!(bundles(Class::LatencyCritical, len), vec![0..len]);
        assert_eq!(bundles(Class::BestEffort, 1000), vec![0..1000]);
        let b = bundles(Class::BestEffort, len);
        assert!(b.len() >= 2, "{b:?}");
        assert_eq!(b[0], 0..super::FIRST_TRANSFER_BUNDLE);
        let mut at = 0;
        for r in &b {
            assert_eq!(r.start, at, "{b:?}");
            assert!(r.end > r.start, "{b:?}");
            assert!(r.end - r.start <= *super::TRANSFER_BUNDLES.end(), "{b:?}");
            if r.end < len {
                assert!(r.end - r.start >= *super::TRANSFER_BUNDLES.start(), "{b:?}");
            }
            at = r.end;
        }
        assert_eq!(at, len);
    }

    /// A failed bundle ends the transfer with its error.
    #[test]
    fn a_failed_bundle_ends_the_transfer() {
        let len = super::FIRST_TRANSFER_BUNDLE * 3;
        let mut calls = 0;
        let r = super::transfer(Class::BestEffort, len, |_| {
            calls += 1;
            if calls == 2 {
                Err("bundle 2")
            } else {
                Ok(())
            }
        });
        assert_eq!((r, calls), (Err("bundle 2"), 2));
    }

    /// Between two bundles a best-effort transfer waits while a
    /// latency-critical runtime has unfinished work: work that became
    /// unfinished during the first bundle is finished when the second
    /// starts.
    #[test]
    fn a_best_effort_transfer_waits_between_bundles() {
        use std::sync::atomic::{AtomicBool, Ordering};
        use std::sync::Arc;
        let lc = Runtime::builder()
            .backend(BackendKind::Cpu)
            .compute_streams(1)
            .oversubscribe(true)
            .class(Class::LatencyCritical)
            .build()
            .unwrap();
        let x = lc.alloc("x", 4).unwrap();
        let served = Arc::new(AtomicBool::new(false));
        let mut bundle = 0;
        super::transfer(Class::BestEffort, super::FIRST_TRANSFER_BUNDLE + 1, |_| {
            bundle += 1;
            if bundle == 1 {
                let served = served.clone();
                lc.task("request")
                    .run(x.write::<u8>(), move |_| {
                        std::thread::sleep(std::time::Duration::from_millis(50));
                        served.store(true, Ordering::SeqCst);
                    })
                    .unwrap();
            } else {
                assert!(
                    served.load(Ordering::SeqCst),
                    "bundle {bundle} began beside an unfinished latency-critical task"
                );
            }
            Ok::<_, ()>(())
        })
        .unwrap();
        assert_eq!(bundle, 2);
        lc.synchronize().unwrap();
    }

    /// A latency-critical program's threads, its own stream threads and the
    /// threads that submit to it, never yield in a spin-wait (a yield can
    /// hand the core to an idle-policy thread for a whole time slice); a
    /// normal program's do.
    #[test]
    fn latency_critical_threads_do_not_yield_in_spin_waits() {
        assert_eq!(yields_in(Class::LatencyCritical), (false, false));
        assert_eq!(yields_in(Class::Normal), (true, true));
    }

    /// A best-effort runtime's stream thread whose task body submits to a
    /// latency-critical runtime, and waits on it, is not promoted: its
    /// spin-waits keep yielding (and it takes no real-time policy, which
    /// `core/tests/tenants.rs` checks where the process may use one).
    #[test]
    fn a_best_effort_stream_thread_is_not_promoted_by_a_latency_critical_runtime() {
        let one = |class: Class| {
            Runtime::builder()
                .backend(BackendKind::Cpu)
                .compute_streams(1)
                .oversubscribe(true)
                .class(class)
                .build()
                .unwrap()
        };
        let server = std::sync::Arc::new(one(Class::LatencyCritical));
        let be = one(Class::BestEffort);
        let out = be.alloc("out", 1).unwrap();
        let lc = server.clone();
        be.task("asks the server")
            .run(out.write::<u8>(), move |o| {
                let x = lc.alloc("x", 1).unwrap();
                lc.task("answer")
                    .run(x.write::<u8>(), |_| ())
                    .unwrap()
                    .wait()
                    .unwrap();
                lc.synchronize().unwrap();
                o[0] = u8::from(crate::sync::yields());
            })
            .unwrap();
        assert_eq!(be.read_vec::<u8>(&out).unwrap(), vec![1]);
    }

    /// A best-effort CUDA stream's window: one task always fits when nothing
    /// is in flight; untimed tasks fill it five at a time; a measured name
    /// is charged its device time (a weighted mean that moves a quarter of
    /// the way to each new sample); completions free what was charged.
    #[test]
    fn the_device_bundle_holds_about_a_millisecond() {
        const DEVICE_BUNDLE_NS: u64 = DEVICE_BUNDLE.as_nanos() as u64;
        assert_eq!(DEVICE_BUNDLE_NS, 1_000_000);
        let mut b = DeviceBundle::new(DEVICE_BUNDLE_NS);
        assert!(
            !b.full(10 * DEVICE_BUNDLE_NS),
            "an empty window takes any task"
        );
        let untimed = b.charge(7);
        assert_eq!(untimed, DEVICE_BUNDLE_NS / 5);
        let mut launched = 0;
        while !b.full(untimed) {
            b.launched(untimed);
            launched += 1;
        }
        assert_eq!(launched, 5);
        b.completed(7, untimed, Some(400_000));
        assert_eq!(b.charge(7), 400_000);
        assert!(
            b.full(400_000),
            "800k in flight and 400k more exceed the window"
        );
        assert!(!b.full(200_000));
        for _ in 0..4 {
            b.completed(7, untimed, Some(800_000));
        }
        assert_eq!(b.in_flight_ns, 0);
        // 400k, then four samples of 800k: 500k, 575k, 631,250, 673,438
        // (integer quarters).
        assert_eq!(b.charge(7), 673_438);
        b.launched(673_438);
        assert!(b.full(673_438), "two such tasks exceed the window");
        assert!(!b.full(DEVICE_BUNDLE_NS - 673_438));
        // A task measured at 0 ns still counts as in flight.
        b.completed(9, 1, Some(0));
        assert_eq!(b.charge(9), 1);
    }

    /// A window of another size (`RuntimeBuilder::device_bundle`): untimed
    /// tasks are a fifth of it, a measured one fits only while the window
    /// has room, and a window shorter than five nanoseconds still charges
    /// each untimed task 1.
    #[test]
    fn a_device_bundle_of_another_size_holds_that_much() {
        let mut b = DeviceBundle::new(250_000);
        assert_eq!(b.charge(3), 50_000);
        b.completed(3, 0, Some(100_000));
        b.launched(100_000);
        b.launched(100_000);
        assert!(!b.full(50_000));
        assert!(b.full(50_001), "250,001 ns would exceed the window");
        assert_eq!(DeviceBundle::new(3).charge(1), 1);
        assert_eq!(DeviceBundle::new(0).window_ns, 1);
    }

    /// A zero device bundle is refused when the runtime is built, naming
    /// the setting.
    #[test]
    fn a_zero_device_bundle_is_refused() {
        let e = Runtime::builder()
            .backend(BackendKind::Cpu)
            .device_bundle(std::time::Duration::ZERO)
            .build()
            .expect_err("a zero window is refused")
            .to_string();
        assert!(e.contains("device_bundle"), "{e}");
    }
}

//! Topology: the CPU cores this process may use (the budget CPU runtimes
//! share, see [`cpu_budget`]), and pinning stream threads to places: physical
//! cores with hwloc (feature `hwloc`), logical CPUs without it on Linux.
//!
//! Without the feature, the budget comes from the standard library alone;
//! off Linux, pinning is a no-op; `describe` says which.

use crate::error::{Error, Result};
use std::sync::OnceLock;

/// The environment variable that overrides the detected core budget
/// (a positive integer).
pub const CPU_CORES_ENV: &str = "BRAID_CPU_CORES";

/// The cores this process may use, as detected once: the logical CPUs of
/// `std::thread::available_parallelism` (which respects the affinity mask and
/// a cgroup CPU quota) and, with the `hwloc` feature, no more than the
/// physical cores that the process's CPU binding touches (two busy threads on
/// the hyperthreads of one core do not run twice as fast). At least 1.
pub fn cpu_cores() -> usize {
    static DETECTED: OnceLock<usize> = OnceLock::new();
    *DETECTED.get_or_init(|| {
        let logical = std::thread::available_parallelism().map_or(1, |n| n.get());
        #[cfg(feature = "hwloc")]
        let logical = imp::cores_in_binding().map_or(logical, |c| c.min(logical));
        logical.max(1)
    })
}

/// The core budget the CPU runtimes of this process share: `BRAID_CPU_CORES`
/// when set, else [`cpu_cores`]. A runtime's builder can override it
/// (`RuntimeBuilder::cpu_cores`). An unparsable or zero value is an
/// [`Error::Config`].
pub fn cpu_budget() -> Result<usize> {
    match std::env::var(CPU_CORES_ENV) {
        Ok(v) => parse_budget(&v),
        Err(_) => Ok(cpu_cores()),
    }
}

fn parse_budget(v: &str) -> Result<usize> {
    match v.trim().parse::<usize>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(Error::Config(format!(
            "{CPU_CORES_ENV}=`{v}`: expected a positive number of cores"
        ))),
    }
}

/// The environment variable that decides for every runtime whether its
/// stream threads are pinned: `1` (or `true`, `yes`, `on`) pins, `0` (or
/// `false`, `no`, `off`, empty) does not; unset, each runtime's builder
/// decides (`RuntimeBuilder::pin_threads`). Any other value is an
/// [`Error::Config`] when a runtime is built.
pub const PIN_THREADS_ENV: &str = "BRAID_PIN_THREADS";

/// What `BRAID_PIN_THREADS` says, read once: `Ok(None)` when unset.
pub(crate) fn pin_env() -> Result<Option<bool>> {
    static ENV: OnceLock<std::result::Result<Option<bool>, String>> = OnceLock::new();
    ENV.get_or_init(|| match std::env::var(PIN_THREADS_ENV) {
        Ok(v) => parse_pin(&v).map(Some),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(v)) => Err(format!("{v:?}")),
    })
    .clone()
    .map_err(|v| {
        Error::Config(format!(
            "{PIN_THREADS_ENV}=`{v}`: expected 1 or 0 (true/false, yes/no, on/off)"
        ))
    })
}

/// A value of `BRAID_PIN_THREADS` as a decision; `Err` carries the value.
fn parse_pin(v: &str) -> std::result::Result<bool, String> {
    match v.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" | "" => Ok(false),
        _ => Err(v.to_string()),
    }
}

/// How stream threads are pinned, in words (for `describe`).
fn pin_text() -> &'static str {
    match (pin::places().is_some(), pin_env().ok().flatten()) {
        (false, _) => "not pinned (binding unavailable)",
        (true, Some(true)) => "pinned",
        (true, Some(false)) => "not pinned",
        (true, None) => "pinned where a runtime asks",
    }
}

/// A human-readable description of the machine's topology as Braid sees it.
#[cfg(not(feature = "hwloc"))]
pub fn describe() -> String {
    format!(
        "{} logical CPUs, core budget {}, stream threads {} (build with the `hwloc` feature for the full topology)",
        std::thread::available_parallelism().map_or(1, |n| n.get()),
        budget_text(),
        pin_text()
    )
}

fn budget_text() -> String {
    match cpu_budget() {
        Ok(n) if std::env::var_os(CPU_CORES_ENV).is_some() => format!("{n} (from {CPU_CORES_ENV})"),
        Ok(n) => n.to_string(),
        Err(e) => e.to_string(),
    }
}

/// Where a stream thread is to be pinned: chosen by the thread that starts
/// the runtime's stream threads, in stream order (so the comm streams know
/// where compute stream 0 went), and bound by the stream thread itself
/// ([`StreamPin::bind`]). Holds its place in the process's load table until
/// the pinned thread exits (or, never bound, until dropped).
pub(crate) struct StreamPin(Option<pin::Ticket>);

/// Where stream `stream` of a runtime goes, when the runtime `asked` for
/// pinning (or `BRAID_PIN_THREADS` says so); `home` is where the runtime's
/// compute stream 0 went (`None`: not pinned, or not started yet).
///
/// A place is a core with hwloc, a logical CPU of the process's binding
/// without it. Low compute stream indices are the busy ones (placement fills
/// compute stream 0 first, and a runtime limited by the core budget uses
/// only its first streams), so compute stream `s` goes to the place with the
/// fewest live pinned compute threads of streams `0..=s`, across every
/// runtime of the process (ties: the fewest pinned threads, then the lowest
/// place): two ranks' stream 0 land on two places, not both on the first.
/// A comm stream goes to a place other than its own runtime's compute
/// stream 0 (where there is another), the one with the fewest comm threads
/// (ties as above): a rank's collectives then run beside its own compute,
/// not in its turns. Two ranks on two cores: rank 0 computes on core 0 and
/// communicates on core 1, rank 1 the other way round.
pub(crate) fn stream_pin(stream: usize, comm: bool, home: Option<usize>, asked: bool) -> StreamPin {
    StreamPin(
        pin_env()
            .ok()
            .flatten()
            .unwrap_or(asked)
            .then(|| pin::choose(stream, comm, home))
            .flatten(),
    )
}

impl StreamPin {
    /// The place chosen (`None`: not pinned).
    pub(crate) fn place(&self) -> Option<usize> {
        self.0.as_ref().map(pin::Ticket::place)
    }

    /// Pins the calling thread to the chosen place. A failure (no
    /// permission, unsupported OS) leaves the thread unpinned.
    pub(crate) fn bind(self) {
        if let Some(t) = self.0 {
            pin::bind(t);
        }
    }
}

/// The places and their load, shared by the two ways of binding.
mod pin {
    use std::cell::RefCell;
    use std::sync::Mutex;

    /// Compute stream indices at or above this share one pinning class.
    const CLASSES: usize = 8;

    /// The live pinned stream threads of one place.
    #[derive(Debug, Clone, Copy, Default)]
    struct Load {
        /// Compute streams, by stream-index class.
        compute: [u32; CLASSES],
        comm: u32,
    }

    impl Load {
        fn total(&self) -> u32 {
            self.compute.iter().sum::<u32>() + self.comm
        }
    }

    /// Where threads may be pinned, and per place its live pinned threads.
    pub(super) struct Places<P> {
        pub(super) places: Vec<P>,
        load: Mutex<Vec<Load>>,
    }

    impl<P> Places<P> {
        pub(super) fn new(places: Vec<P>) -> Option<Places<P>> {
            (!places.is_empty()).then(|| Places {
                load: Mutex::new(vec![Load::default(); places.len()]),
                places,
            })
        }
    }

    /// A stream thread's place in the load table; released when dropped
    /// (by the pinned thread's thread-local destructor at its exit).
    pub(crate) struct Ticket {
        place: usize,
        /// A compute stream's class, `None` for a comm stream.
        class: Option<usize>,
    }

    impl Ticket {
        pub(crate) fn place(&self) -> usize {
            self.place
        }
    }

    impl Drop for Ticket {
        fn drop(&mut self) {
            if let Some(p) = places() {
                let mut load = p.load.lock().unwrap_or_else(|e| e.into_inner());
                let l = &mut load[self.place];
                match self.class {
                    Some(c) => l.compute[c] -= 1,
                    None => l.comm -= 1,
                }
            }
        }
    }

    thread_local! {
        static PINNED: RefCell<Option<Ticket>> = const { RefCell::new(None) };
    }

    /// The place for a stream thread (the rule: [`super::stream_pin`]),
    /// counted in the load table.
    pub(super) fn choose(stream: usize, comm: bool, home: Option<usize>) -> Option<Ticket> {
        let p = places()?;
        let mut load = p.load.lock().unwrap_or_else(|e| e.into_inner());
        let n = load.len();
        let ticket = if comm {
            let place = (0..n)
                .filter(|&c| n == 1 || Some(c) != home)
                .min_by_key(|&c| (load[c].comm, load[c].total(), c))?;
            load[place].comm += 1;
            Ticket { place, class: None }
        } else {
            let class = stream.min(CLASSES - 1);
            let busy = |c: usize| load[c].compute[..=class].iter().sum::<u32>();
            let place = (0..n).min_by_key(|&c| (busy(c), load[c].total(), c))?;
            load[place].compute[class] += 1;
            Ticket {
                place,
                class: Some(class),
            }
        };
        Some(ticket)
    }

    /// Binds the calling thread to the ticket's place and keeps the ticket
    /// until the thread exits (or releases it at once if binding failed).
    pub(super) fn bind(t: Ticket) {
        let Some(p) = places() else { return };
        if super::imp::bind(&p.places[t.place]) {
            PINNED.with(|g| *g.borrow_mut() = Some(t));
        }
    }

    pub(super) fn places() -> Option<&'static Places<super::imp::Place>> {
        super::imp::places()
    }
}

/// Binding with hwloc: a place is a physical core (its processing units
/// inside the process's binding).
#[cfg(feature = "hwloc")]
mod imp {
    use super::pin::Places;
    use hwlocality::cpu::binding::CpuBindingFlags;
    use hwlocality::cpu::cpuset::CpuSet;
    use hwlocality::object::types::ObjectType;
    use hwlocality::Topology;
    use std::sync::OnceLock;

    pub(super) type Place = CpuSet;

    fn topology() -> Option<&'static Topology> {
        static TOPO: OnceLock<Option<Topology>> = OnceLock::new();
        TOPO.get_or_init(|| Topology::new().ok()).as_ref()
    }

    pub(super) fn places() -> Option<&'static Places<CpuSet>> {
        static PLACES: OnceLock<Option<Places<CpuSet>>> = OnceLock::new();
        PLACES
            .get_or_init(|| {
                let topo = topology()?;
                let binding = topo.cpu_binding(CpuBindingFlags::PROCESS).ok();
                let cores: Vec<CpuSet> = topo
                    .objects_with_type(ObjectType::Core)
                    .filter_map(|c| {
                        let set = c.cpuset()?.clone_target();
                        let set = match &binding {
                            Some(b) => &set & b,
                            None => set,
                        };
                        (!set.is_empty()).then_some(set)
                    })
                    .collect();
                Places::new(cores)
            })
            .as_ref()
    }

    pub(super) fn bind(core: &CpuSet) -> bool {
        topology().is_some_and(|t| t.bind_cpu(core, CpuBindingFlags::THREAD).is_ok())
    }

    /// Physical cores the process's CPU binding touches.
    pub(super) fn cores_in_binding() -> Option<usize> {
        places().map(|p| p.places.len())
    }

    /// The machine's packages, cores and processing units as hwloc sees them.
    pub fn describe() -> String {
        match Topology::new() {
            Ok(t) => format!(
                "{} packages, {} cores, {} processing units (hwloc); {} cores in this process's binding, core budget {}, stream threads {}",
                t.objects_with_type(ObjectType::Package).count(),
                t.objects_with_type(ObjectType::Core).count(),
                t.objects_with_type(ObjectType::PU).count(),
                cores_in_binding().unwrap_or(0),
                super::budget_text(),
                super::pin_text()
            ),
            Err(e) => format!("hwloc could not read the topology: {e}"),
        }
    }
}

#[cfg(feature = "hwloc")]
pub use imp::describe;

/// Binding without hwloc (Linux): a place is one logical CPU of the
/// process's affinity mask as it was at the first pin, ordered so that the
/// first CPU of every physical core comes before any hyperthread sibling
/// (the kernel's `thread_siblings_list`): a place is chosen lowest first on
/// ties, so busy threads get cores of their own before they share one.
#[cfg(all(not(feature = "hwloc"), target_os = "linux"))]
mod imp {
    use super::pin::Places;
    use std::sync::OnceLock;

    pub(super) type Place = usize;

    pub(super) fn places() -> Option<&'static Places<usize>> {
        static PLACES: OnceLock<Option<Places<usize>>> = OnceLock::new();
        PLACES
            .get_or_init(|| {
                // SAFETY: a zeroed cpu_set_t is a valid empty set, filled by
                // sched_getaffinity for this thread (pid 0), read with CPU_ISSET.
                let cpus = unsafe {
                    let mut set: libc::cpu_set_t = std::mem::zeroed();
                    if libc::sched_getaffinity(0, size_of::<libc::cpu_set_t>(), &mut set) != 0 {
                        return None;
                    }
                    (0..libc::CPU_SETSIZE as usize)
                        .filter(|&c| libc::CPU_ISSET(c, &set))
                        .collect()
                };
                Places::new(spread_over_cores(cpus, |c| {
                    let f = format!("/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list");
                    parse_cpu_list(&std::fs::read_to_string(f).ok()?)
                }))
            })
            .as_ref()
    }

    /// A kernel CPU list (`0-3,8,10-11`) as CPU numbers; `None` if malformed.
    pub(super) fn parse_cpu_list(s: &str) -> Option<Vec<usize>> {
        let mut out = Vec::new();
        for part in s.trim().split(',').filter(|p| !p.is_empty()) {
            match part.split_once('-') {
                Some((a, b)) => {
                    let (a, b): (usize, usize) = (a.parse().ok()?, b.parse().ok()?);
                    if a > b {
                        return None;
                    }
                    out.extend(a..=b);
                }
                None => out.push(part.parse().ok()?),
            }
        }
        Some(out)
    }

    /// `cpus` with every physical core's first CPU (in the mask) before any
    /// core's second, and so on; in CPU order within each rank. `siblings(c)`
    /// is the CPUs sharing `c`'s core, `c` included (`None`: unknown, taken
    /// as `c` alone).
    pub(super) fn spread_over_cores(
        cpus: Vec<usize>,
        siblings: impl Fn(usize) -> Option<Vec<usize>>,
    ) -> Vec<usize> {
        let mut keyed: Vec<(usize, usize)> = cpus
            .iter()
            .map(|&c| {
                let nth = siblings(c).map_or(0, |s| {
                    s.iter().filter(|&&x| x < c && cpus.contains(&x)).count()
                });
                (nth, c)
            })
            .collect();
        keyed.sort_unstable();
        keyed.into_iter().map(|(_, c)| c).collect()
    }

    pub(super) fn bind(cpu: &usize) -> bool {
        // SAFETY: a zeroed cpu_set_t with one CPU set (`cpu` came from the
        // affinity mask, so it is below CPU_SETSIZE), for this thread.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(*cpu, &mut set);
            libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &set) == 0
        }
    }
}

/// No binding (neither hwloc nor Linux).
#[cfg(all(not(feature = "hwloc"), not(target_os = "linux")))]
mod imp {
    use super::pin::Places;

    pub(super) type Place = ();

    pub(super) fn places() -> Option<&'static Places<()>> {
        None
    }

    pub(super) fn bind(_: &()) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budget_from_the_environment() {
        assert_eq!(parse_budget("3").unwrap(), 3);
        assert_eq!(parse_budget(" 16\n").unwrap(), 16);
        for bad in ["0", "-1", "two", ""] {
            assert!(matches!(parse_budget(bad), Err(Error::Config(_))), "{bad}");
        }
        assert!(cpu_cores() >= 1);
    }

    #[cfg(all(not(feature = "hwloc"), target_os = "linux"))]
    #[test]
    fn places_take_one_cpu_of_every_core_first() {
        use imp::{parse_cpu_list, spread_over_cores};
        assert_eq!(
            parse_cpu_list("0-3,8,10-11\n"),
            Some(vec![0, 1, 2, 3, 8, 10, 11])
        );
        assert_eq!(parse_cpu_list("5"), Some(vec![5]));
        for bad in ["3-1", "a", "1-", "1,,x"] {
            assert_eq!(parse_cpu_list(bad), None, "{bad:?}");
        }
        // Siblings numbered apart (cpu i and i + 4 share a core): unchanged.
        let apart = |c: usize| Some(vec![c % 4, c % 4 + 4]);
        assert_eq!(
            spread_over_cores((0..8).collect(), apart),
            (0..8).collect::<Vec<_>>()
        );
        // Siblings side by side (0 and 1 share a core, 2 and 3, ...).
        let adjacent = |c: usize| Some(vec![c & !1, c | 1]);
        assert_eq!(
            spread_over_cores((0..8).collect(), adjacent),
            vec![0, 2, 4, 6, 1, 3, 5, 7]
        );
        // A mask without CPU 0: CPU 1 is its core's first in the mask.
        assert_eq!(
            spread_over_cores((1..8).collect(), adjacent),
            vec![1, 2, 4, 6, 3, 5, 7]
        );
        // Unknown siblings: CPU order.
        assert_eq!(spread_over_cores(vec![0, 1, 2], |_| None), vec![0, 1, 2]);
    }

    #[test]
    fn the_pinning_variable_overrides_the_builder_and_refuses_other_values() {
        let decide = |env: Option<&str>, asked| env.map(|v| parse_pin(v).unwrap()).unwrap_or(asked);
        for asked in [false, true] {
            for on in ["1", " 1\n", "true", "Yes", "ON"] {
                assert!(decide(Some(on), asked), "{on:?}");
            }
            for off in ["0", "", "false", "no", "Off"] {
                assert!(!decide(Some(off), asked), "{off:?}");
            }
            assert_eq!(decide(None, asked), asked);
        }
        for bad in ["2", "maybe", "pinned"] {
            assert_eq!(parse_pin(bad), Err(bad.to_string()));
        }
    }
}

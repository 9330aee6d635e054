//! Topology: the CPU cores this process may use (the budget CPU runtimes
//! share, see [`cpu_budget`]), and pinning stream threads to cores with hwloc
//! (feature `hwloc`).
//!
//! Without the feature, the budget comes from the standard library alone,
//! pinning is a no-op and `describe` says so.

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

/// Pins the calling stream thread to a core chosen by its stream index.
#[cfg(not(feature = "hwloc"))]
pub(crate) fn pin_stream_thread(_stream: usize) {}

/// A human-readable description of the machine's topology as Braid sees it.
#[cfg(not(feature = "hwloc"))]
pub fn describe() -> String {
    format!(
        "{} logical CPUs, core budget {} (build with the `hwloc` feature for the full topology and thread pinning)",
        std::thread::available_parallelism().map_or(1, |n| n.get()),
        budget_text()
    )
}

fn budget_text() -> String {
    match cpu_budget() {
        Ok(n) if std::env::var_os(CPU_CORES_ENV).is_some() => format!("{n} (from {CPU_CORES_ENV})"),
        Ok(n) => n.to_string(),
        Err(e) => e.to_string(),
    }
}

#[cfg(feature = "hwloc")]
mod imp {
    use hwlocality::cpu::binding::CpuBindingFlags;
    use hwlocality::cpu::cpuset::CpuSet;
    use hwlocality::object::types::ObjectType;
    use hwlocality::Topology;
    use std::cell::RefCell;
    use std::sync::{Mutex, OnceLock};

    /// Stream indices at or above this share one pinning class.
    const CLASSES: usize = 8;

    /// The topology, the cores the process may run on (each as the part of
    /// its cpuset inside the process's binding) and, per core, how many live
    /// pinned stream threads of each stream-index class it holds.
    struct Pins {
        topo: Topology,
        cores: Vec<CpuSet>,
        load: Mutex<Vec<[u32; CLASSES]>>,
    }

    fn pins() -> Option<&'static Pins> {
        static PINS: OnceLock<Option<Pins>> = OnceLock::new();
        PINS.get_or_init(|| {
            let topo = Topology::new().ok()?;
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
            if cores.is_empty() {
                return None;
            }
            let load = Mutex::new(vec![[0; CLASSES]; cores.len()]);
            Some(Pins { topo, cores, load })
        })
        .as_ref()
    }

    /// Physical cores the process's CPU binding touches.
    pub(super) fn cores_in_binding() -> Option<usize> {
        pins().map(|p| p.cores.len())
    }

    /// A pinned thread's place in the load table; released when the thread
    /// exits (thread-local destructor).
    struct Pinned {
        core: usize,
        class: usize,
    }

    impl Drop for Pinned {
        fn drop(&mut self) {
            if let Some(p) = pins() {
                let mut load = p.load.lock().unwrap_or_else(|e| e.into_inner());
                load[self.core][self.class] -= 1;
            }
        }
    }

    thread_local! {
        static PINNED: RefCell<Option<Pinned>> = const { RefCell::new(None) };
    }

    /// Pins the calling stream thread to one core of the process's binding.
    /// Low stream indices are the busy ones (placement fills compute stream
    /// 0 first, and a runtime limited by the core budget uses only its first
    /// streams), so stream `s` goes to the core with the fewest live pinned
    /// threads of streams `0..=s`, across every runtime of the process (ties:
    /// fewest pinned threads, then the lowest core): two ranks' stream 0 land
    /// on two cores, not both on core 0. Failures (no permission,
    /// unsupported OS) leave the thread unpinned.
    pub(crate) fn pin_stream_thread(stream: usize) {
        let Some(p) = pins() else { return };
        let class = stream.min(CLASSES - 1);
        let core = {
            let mut load = p.load.lock().unwrap_or_else(|e| e.into_inner());
            let key = |c: usize| {
                let busy: u32 = load[c][..=class].iter().sum();
                (busy, load[c].iter().sum::<u32>(), c)
            };
            let Some(core) = (0..load.len()).min_by_key(|&c| key(c)) else {
                return;
            };
            load[core][class] += 1;
            core
        };
        let pinned = Pinned { core, class };
        if p.topo
            .bind_cpu(&p.cores[core], CpuBindingFlags::THREAD)
            .is_ok()
        {
            PINNED.with(|g| *g.borrow_mut() = Some(pinned));
        }
    }

    /// The machine's packages, cores and processing units as hwloc sees them.
    pub fn describe() -> String {
        match Topology::new() {
            Ok(t) => format!(
                "{} packages, {} cores, {} processing units (hwloc); {} cores in this process's binding, core budget {}",
                t.objects_with_type(ObjectType::Package).count(),
                t.objects_with_type(ObjectType::Core).count(),
                t.objects_with_type(ObjectType::PU).count(),
                cores_in_binding().unwrap_or(0),
                super::budget_text()
            ),
            Err(e) => format!("hwloc could not read the topology: {e}"),
        }
    }
}

#[cfg(feature = "hwloc")]
pub use imp::describe;
#[cfg(feature = "hwloc")]
pub(crate) use imp::pin_stream_thread;

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
}

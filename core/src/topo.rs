//! Topology: pinning stream threads to cores with hwloc (feature `hwloc`).
//!
//! Without the feature, pinning is a no-op and `describe` says so.

/// Pins the calling stream thread to a core chosen by its stream index.
#[cfg(not(feature = "hwloc"))]
pub(crate) fn pin_stream_thread(_stream: usize) {}

/// A human-readable description of the machine's topology as Braid sees it.
#[cfg(not(feature = "hwloc"))]
pub fn describe() -> String {
    format!(
        "{} logical CPUs (build with the `hwloc` feature for the full topology and thread pinning)",
        std::thread::available_parallelism().map_or(1, |n| n.get())
    )
}

#[cfg(feature = "hwloc")]
mod imp {
    use hwlocality::cpu::binding::CpuBindingFlags;
    use hwlocality::object::types::ObjectType;
    use hwlocality::Topology;

    /// Pins the calling stream thread to one core, round-robin by stream index.
    /// Failures (no permission, unsupported OS) leave the thread unpinned.
    pub(crate) fn pin_stream_thread(stream: usize) {
        let Ok(topo) = Topology::new() else { return };
        let cores: Vec<_> = topo.objects_with_type(ObjectType::Core).collect();
        if cores.is_empty() {
            return;
        }
        if let Some(set) = cores[stream % cores.len()].cpuset() {
            let _ = topo.bind_cpu(set, CpuBindingFlags::THREAD);
        }
    }

    /// The machine's packages, cores and processing units as hwloc sees them.
    pub fn describe() -> String {
        match Topology::new() {
            Ok(t) => format!(
                "{} packages, {} cores, {} processing units (hwloc)",
                t.objects_with_type(ObjectType::Package).count(),
                t.objects_with_type(ObjectType::Core).count(),
                t.objects_with_type(ObjectType::PU).count()
            ),
            Err(e) => format!("hwloc could not read the topology: {e}"),
        }
    }
}

#[cfg(feature = "hwloc")]
pub use imp::describe;
#[cfg(feature = "hwloc")]
pub(crate) use imp::pin_stream_thread;

//! The process-wide clock every span is timed on (a leaf module: the stream
//! threads, the CUDA backend's timeline anchor and the trace all read it).

use std::sync::OnceLock;
use std::time::Instant;

/// Nanoseconds since a process-wide epoch, so the spans of every runtime of a
/// process (one per rank) share one timeline.
pub(crate) fn now_ns() -> u64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    EPOCH.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

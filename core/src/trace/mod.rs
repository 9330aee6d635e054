//! Profiles: spans recorded by stream threads, Chrome trace export and the
//! summary every user wants (busy time, overlap, hidden communication, the
//! critical path).
//!
//! Each stream thread pushes its spans into its own buffer (one uncontended
//! lock per task, taken only when profiling is on); nothing is merged until a
//! profile is asked for.

mod chrome;
mod event;
pub mod live;
mod summary;

pub use chrome::{write_chrome_trace, HostTraceGuard};
pub use event::read_chrome_trace;
#[cfg(all(unix, not(loom)))] // the live view's server (sched/live.rs)
pub(crate) use event::span_event;
pub use summary::{StreamBusy, Summary};

use crate::kind::{Placement, TaskKind};
use smallvec::SmallVec;
use std::borrow::Cow;
use std::sync::Arc;

/// One task's execution on its stream.
#[derive(Debug, Clone)]
pub struct Span {
    /// The task's submission index.
    pub id: u64,
    /// The task's name.
    pub name: Cow<'static, str>,
    /// The scope it was submitted in (`forward/layer3`; `Runtime::scope`),
    /// the Chrome trace's `scope` argument.
    pub scope: Option<Arc<str>>,
    /// The task's kind.
    pub kind: TaskKind,
    /// The stream it ran on.
    pub stream: usize,
    /// Why placement put it there (the Chrome trace's `placed`,
    /// `usable_streams` and `priority` arguments).
    pub placement: Placement,
    /// Start, in nanoseconds on the process-wide timeline.
    pub start_ns: u64,
    /// End, in nanoseconds on the process-wide timeline.
    pub end_ns: u64,
    /// Submission indices of the unfinished tasks it depended on.
    pub preds: SmallVec<[u64; 4]>,
    /// Whether the task completed without error.
    pub ok: bool,
    /// The largest of the task's declared accesses, in bytes (a collective's
    /// buffer: the data of an all-reduce or broadcast, the whole gathered or
    /// scattered buffer of an all-gather or reduce-scatter). The Chrome
    /// trace's `bytes` argument; what the step simulator prices a
    /// collective by.
    pub bytes: u64,
    /// Of the span, the time a collective waited for the other ranks to
    /// reach it (CPU ranks: the local communicator's barriers; 0 for other
    /// tasks, and on CUDA, where NCCL waits on the device). A rank that is
    /// ahead waits here for one that is behind: it is skew between the
    /// ranks, not data moving. The Chrome trace's `wait_us` argument.
    pub wait_ns: u64,
}

#[cfg(not(loom))]
thread_local! {
    /// The peer wait the task running on this thread has noted so far
    /// ([`note_peer_wait`]).
    static PEER_WAIT: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Adds `ns` to the running task's [`Span::wait_ns`]: called by a collective
/// body on its stream thread for the time it waited for other ranks.
pub(crate) fn note_peer_wait(ns: u64) {
    #[cfg(not(loom))]
    PEER_WAIT.with(|w| w.set(w.get().saturating_add(ns)));
    #[cfg(loom)]
    let _ = ns;
}

/// The peer wait noted on this thread since the last call, reset to 0: the
/// stream thread takes it after each task body.
pub(crate) fn take_peer_wait() -> u64 {
    #[cfg(not(loom))]
    return PEER_WAIT.with(|w| w.replace(0));
    #[cfg(loom)]
    0
}

/// A stream as it appears in a profile.
#[derive(Debug, Clone)]
pub struct StreamInfo {
    /// Its name (`compute 0`, `comm 0`).
    pub name: String,
    /// Whether it is a communication stream.
    pub is_comm: bool,
}

/// The spans one runtime recorded, with its rank and streams.
#[derive(Debug, Clone, Default)]
pub struct Profile {
    /// The runtime's rank (the trace's process id).
    pub rank: usize,
    /// Its streams, by index.
    pub streams: Vec<StreamInfo>,
    /// Every recorded span, sorted by start time.
    pub spans: Vec<Span>,
    /// The runtime's priority class (`None` in a trace that does not say).
    pub class: Option<crate::Class>,
    /// Its busy periods, `(start_ns, end_ns)` in order: from a submission
    /// to an idle runtime until every submitted task had finished — a
    /// request's latency, for a program that serves one request at a time.
    /// The trace's `busy periods` track.
    pub busy: Vec<(u64, u64)>,
}

impl Profile {
    /// The summary of this profile.
    pub fn summary(&self) -> Summary {
        Summary::of(self)
    }

    /// The spans that started at or after `t_ns` (on the timeline of
    /// [`now_ns`]), with the same rank and streams: for example the steps
    /// after a warm-up, cut at a synchronisation point taken with
    /// [`now_ns`]. Dependency edges to tasks left out stay in each span's
    /// `preds` (they name no span, and the summary's critical path ignores
    /// them).
    pub fn since(&self, t_ns: u64) -> Profile {
        Profile {
            rank: self.rank,
            streams: self.streams.clone(),
            spans: self
                .spans
                .iter()
                .filter(|s| s.start_ns >= t_ns)
                .cloned()
                .collect(),
            class: self.class,
            busy: self.busy.iter().filter(|b| b.0 >= t_ns).copied().collect(),
        }
    }
}

/// Now, in nanoseconds on the process-wide timeline every span is timed on
/// ([`Span::start_ns`]; CUDA spans are mapped onto it): a host-side mark to
/// cut a profile with ([`Profile::since`]) or to place host events beside
/// the spans.
pub fn now_ns() -> u64 {
    crate::clock::now_ns()
}

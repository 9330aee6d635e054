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
}

impl Profile {
    /// The summary of this profile.
    pub fn summary(&self) -> Summary {
        Summary::of(self)
    }
}

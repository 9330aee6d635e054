//! The runtime's side of the live view (`trace::live`): a frame of what
//! each stream is doing, and the spans recorded since the client's last one.

use super::Shared;
use crate::clock::now_ns;
use crate::sync::lock;
use crate::trace::live::Running;

#[cfg(all(unix, not(loom)))]
impl crate::trace::live::Source for Shared {
    fn frame(&self, cursors: &mut Vec<usize>) -> serde_json::Value {
        use crate::sync::Ordering;
        use serde_json::{json, Value};
        cursors.resize(self.streams.len(), 0);
        let mut events = Vec::new();
        let streams: Vec<Value> = self
            .streams
            .iter()
            .zip(cursors.iter_mut())
            .map(|(st, cursor)| {
                let spans = lock(&st.spans);
                // `clear_profile` empties the log: start again from its head.
                if *cursor > spans.len() {
                    *cursor = 0;
                }
                events.extend(
                    spans[*cursor..]
                        .iter()
                        .map(|s| crate::trace::span_event(self.rank, s)),
                );
                *cursor = spans.len();
                drop(spans);
                let placed = st.placed.load(Ordering::Relaxed);
                let running = lock(&st.running).as_ref().map(|r: &Running| {
                    json!({"task": r.id, "name": r.name, "scope": r.scope.as_deref(),
                           "since_us": r.start_ns as f64 / 1e3})
                });
                json!({
                    "name": st.name,
                    "is_comm": st.is_comm,
                    "queued": placed.saturating_sub(st.done.get()),
                    "running": running,
                })
            })
            .collect();
        json!({
            "rank": self.rank,
            "runtime": self.runtime_id,
            "now_us": now_ns() as f64 / 1e3,
            "class": self.class.name(),
            "busy": busy_summary(self),
            "streams": streams,
            "events": events,
        })
    }
}

/// Live view: the submitter placed stream `s`'s task number `seq`; mirrored
/// where the live view reads it (queue depth) without the submitter's lock.
pub(crate) fn placed(shared: &Shared, s: usize, seq: u64) {
    if shared.live {
        shared.streams[s]
            .placed
            .store(seq, crate::sync::Ordering::Relaxed);
    }
}

/// How many busy periods the live view keeps.
const BUSY_PERIODS: usize = 4096;

/// Live view: a submission is about to be made; if the runtime is idle it
/// becomes busy now. (A completion racing with it can at worst mis-time one
/// period: this is a monitoring figure.)
pub(crate) fn submitting(shared: &Shared) {
    use crate::sync::Ordering;
    if shared.live && shared.submitted.load(Ordering::Acquire) == shared.completed.get() {
        shared.busy_since.store(now_ns().max(1), Ordering::Release);
    }
}

/// Live view: `done` tasks have completed; if that is every submitted one,
/// the busy period ends and its length is kept.
pub(crate) fn completed(shared: &Shared, done: u64) {
    use crate::sync::Ordering;
    if !shared.live || done != shared.submitted.load(Ordering::Acquire) {
        return;
    }
    let since = shared.busy_since.swap(0, Ordering::AcqRel);
    if since != 0 {
        let mut log = lock(&shared.busy_periods);
        if log.len() == BUSY_PERIODS {
            log.pop_front();
        }
        log.push_back(now_ns().saturating_sub(since));
    }
}

#[cfg(all(unix, not(loom)))]
/// The `busy` object of a frame: how many periods are kept, and their
/// median, 99th percentile and longest, µs.
fn busy_summary(shared: &Shared) -> serde_json::Value {
    let mut v: Vec<u64> = lock(&shared.busy_periods).iter().copied().collect();
    if v.is_empty() {
        return serde_json::Value::Null;
    }
    v.sort_unstable();
    let pct = |p: f64| {
        let i = ((p * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1;
        v[i] as f64 / 1e3
    };
    serde_json::json!({"n": v.len(), "p50_us": pct(0.5), "p99_us": pct(0.99), "max_us": pct(1.0)})
}

/// A task as [`running`] publishes it: submission index, name, scope.
pub(crate) type Now<'a> = (
    u64,
    &'a std::borrow::Cow<'static, str>,
    &'a Option<std::sync::Arc<str>>,
);

/// Publishes (or clears) what stream `s` runs, when a live view is attached.
pub(crate) fn running(shared: &Shared, s: usize, task: Option<Now<'_>>) {
    if shared.live {
        *lock(&shared.streams[s].running) = task.map(|(id, name, scope)| Running {
            id,
            name: name.clone(),
            scope: scope.clone(),
            start_ns: now_ns(),
        });
    }
}

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
            "streams": streams,
            "events": events,
        })
    }
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

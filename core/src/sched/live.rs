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
        let first = cursors.is_empty();
        let now = now_ns();
        cursors.resize(self.streams.len(), 0);
        let mut events = Vec::new();
        let streams: Vec<Value> = self
            .streams
            .iter()
            .zip(cursors.iter_mut())
            .map(|(st, cursor)| {
                let spans = lock(&st.spans);
                // The cursor counts spans ever recorded; `clear_profile`
                // removed the first `cleared` (those this client had not
                // read yet are gone).
                let cleared = st.spans_cleared.load(Ordering::Relaxed) as usize;
                let from = match first {
                    true => backlog_from(&spans, now, BACKLOG_SPANS, BACKLOG_NS),
                    false => cursor.saturating_sub(cleared).min(spans.len()),
                };
                events.extend(
                    spans[from..]
                        .iter()
                        .map(|s| crate::trace::span_event(self.rank, s)),
                );
                *cursor = cleared + spans.len();
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
            "now_us": now as f64 / 1e3,
            "class": self.class.name(),
            "busy": busy_summary(self),
            "streams": streams,
            "events": events,
        })
    }
}

/// What a client's first frame holds of what ran before it attached, per
/// stream: the spans that ended in the last 5 minutes, at most 100,000 of
/// them. `braid top` keeps 30 s by default (`--history`); a backlog of
/// every span since the start grew without bound (the trainer's passed
/// 256 MiB, a line `braid top` refuses, after about 25 minutes) and was
/// held and parsed whole by the client.
#[cfg(all(unix, not(loom)))]
const BACKLOG_NS: u64 = 300_000_000_000;
#[cfg(all(unix, not(loom)))]
const BACKLOG_SPANS: usize = 100_000;

/// Where a first frame starts in a stream's `spans` at `now`: the last
/// `max_spans` of them, and of those only the ones that ended within
/// `max_ns` (a stream's spans end in the order it ran them).
#[cfg(all(unix, not(loom)))]
fn backlog_from(spans: &[crate::trace::Span], now: u64, max_spans: usize, max_ns: u64) -> usize {
    let cutoff = now.saturating_sub(max_ns);
    let recent = spans.partition_point(|s| s.end_ns < cutoff);
    recent.max(spans.len().saturating_sub(max_spans))
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

/// How many of the latest busy periods a live frame summarises.
#[cfg(all(unix, not(loom)))]
const BUSY_PERIODS: usize = 4096;

/// Profiling: when the runtime is busy (a task submitted and not yet
/// completed), and the busy periods so far. Both decisions — a submission
/// opens a period, a completion closes one — are made under its lock, after
/// the count they change has moved: whichever comes second sees the other's
/// count. (Made on counts read without it, a submission that found the
/// runtime busy and a completion that found it idle could pass each other:
/// the period closed, none opened, and a whole step ran outside any.)
#[derive(Debug, Default)]
pub(crate) struct Busy {
    /// When the open period began, ns on the process timeline; 0: none.
    since: u64,
    /// The closed periods, `(start_ns, end_ns)` (a request's latency, for
    /// a program that serves one request at a time).
    pub(crate) periods: Vec<(u64, u64)>,
}

impl Busy {
    /// The task that took the submitted count past `before` was counted;
    /// `completed` was read after that, under the lock. If every earlier
    /// task had completed, a period opens at `now` (if none is open).
    pub(crate) fn submitted(&mut self, before: u64, completed: u64, now: u64) {
        if before == completed && self.since == 0 {
            self.since = now.max(1);
        }
    }

    /// `done` tasks have completed; `submitted` was read after that, under
    /// the lock. If that is every submitted task, the open period closes at
    /// `now`.
    pub(crate) fn completed(&mut self, done: u64, submitted: u64, now: u64) {
        if done == submitted && self.since != 0 {
            let start = std::mem::take(&mut self.since);
            self.periods.push((start, now.max(start)));
        }
    }

    /// Whether a period is open.
    #[cfg(all(test, loom))]
    pub(crate) fn open(&self) -> bool {
        self.since != 0
    }
}

/// Profiling: the task that took the runtime's submitted count past
/// `before` was counted ([`Busy::submitted`]).
pub(crate) fn submitted(shared: &Shared, before: u64) {
    if shared.profiling {
        let mut busy = lock(&shared.busy);
        busy.submitted(before, shared.completed.get(), now_ns());
    }
}

/// Profiling: `done` tasks have completed ([`Busy::completed`]). The
/// count read before the lock only spares it when a later task was
/// counted: the runtime is busy then, whatever the lock would see. (A
/// submission has no such shortcut: a completed count read without the
/// lock may be one the completion's check, made under it, already missed.)
pub(crate) fn completed(shared: &Shared, done: u64) {
    use crate::sync::Ordering;
    if shared.profiling && done == shared.submitted.load(Ordering::Acquire) {
        let mut busy = lock(&shared.busy);
        busy.completed(done, shared.submitted.load(Ordering::Acquire), now_ns());
    }
}

#[cfg(all(unix, not(loom)))]
/// The `busy` object of a frame: how many of the latest periods it covers,
/// and their median, 99th percentile and longest, µs.
fn busy_summary(shared: &Shared) -> serde_json::Value {
    let busy = lock(&shared.busy);
    let log = &busy.periods;
    let latest = &log[log.len().saturating_sub(BUSY_PERIODS)..];
    match crate::trace::live::BusyPeriods::of(latest.iter().map(|(a, z)| z - a)) {
        None => serde_json::Value::Null,
        Some(b) => serde_json::json!({"n": b.n, "p50_us": b.p50_ns as f64 / 1e3,
            "p99_us": b.p99_ns as f64 / 1e3, "max_us": b.max_ns as f64 / 1e3}),
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
        running_since(shared, s, task.map(|t| (t, now_ns())));
    }
}

/// Publishes (or clears) what stream `s` runs and since when (ns on the
/// process timeline): a CUDA stream's oldest unfinished task once its start
/// event has completed on the device.
pub(crate) fn running_since(shared: &Shared, s: usize, task: Option<(Now<'_>, u64)>) {
    if shared.live {
        *lock(&shared.streams[s].running) = task.map(|((id, name, scope), start_ns)| Running {
            id,
            name: name.clone(),
            scope: scope.clone(),
            start_ns,
        });
    }
}

#[cfg(all(test, unix, not(loom)))]
mod tests {
    use super::backlog_from;
    use crate::trace::Span;

    fn ending_at(ends: &[u64]) -> Vec<Span> {
        ends.iter()
            .enumerate()
            .map(|(i, &end_ns)| Span {
                id: i as u64,
                name: "t".into(),
                kind: crate::TaskKind::Compute,
                stream: 0,
                placement: crate::Placement {
                    reason: crate::PlaceReason::Pinned,
                    usable: 1,
                    priority: crate::Priority::Main,
                },
                start_ns: end_ns.saturating_sub(1),
                end_ns,
                preds: Default::default(),
                ok: true,
                bytes: 0,
                wait_ns: 0,
                scope: None,
            })
            .collect()
    }

    /// A first frame takes the spans that ended within the window, and of
    /// those at most the last `max_spans`.
    #[test]
    fn a_first_frame_takes_the_recent_spans_only() {
        let spans = ending_at(&[10, 20, 30, 40, 50, 60]);
        // Ended at 35 or later (now 45, a window of 10): from index 3.
        assert_eq!(backlog_from(&spans, 45, 100, 10), 3);
        // At most 2 of them.
        assert_eq!(backlog_from(&spans, 45, 2, 10), 4);
        // A window longer than the run: all, up to the count.
        assert_eq!(backlog_from(&spans, 60, 100, 1_000), 0);
        assert_eq!(backlog_from(&spans, 60, 6, 1_000), 0);
        assert_eq!(backlog_from(&spans, 60, 5, 1_000), 1);
        // Nothing recent: none.
        assert_eq!(backlog_from(&spans, 1_000, 100, 10), 6);
        assert_eq!(backlog_from(&[], 5, 100, 10), 0);
    }
}

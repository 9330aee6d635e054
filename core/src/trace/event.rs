//! One span as a Chrome trace event, both ways: what the trace file holds and
//! what the live view streams (one event format, one log).
//!
//! A task is a complete (`X`) event: `name`, `cat` (its kind), `pid` (the
//! rank), `tid` (the stream), `ts` and `dur` in microseconds, and `args`:
//! `task` (submission index), `ok`, `after` (predecessors), `placed`,
//! `usable_streams`, `priority`, `bytes`, for a collective that waited for
//! other ranks `wait_us` (microseconds) and, for a task submitted inside a
//! named scope, `scope`. Streams are `thread_name`
//! metadata (`M`) events. The process's `process_name` event carries the
//! runtime's priority class (`args.class`; a `process_labels` event shows
//! it in viewers), and its busy periods are complete events named `busy`
//! (`cat` `busy`) on a track of their own after the streams, `busy periods`,
//! whose `thread_name` event says `"track": "busy"`.

use super::{Profile, Span, StreamInfo};
use crate::error::{Error, Result};
use crate::kind::{PlaceReason, Placement, Priority, TaskKind};
use serde_json::{json, Value};
use std::collections::BTreeMap;

/// The name of the busy periods' track and the `cat` of their events.
const BUSY: &str = "busy";

/// The metadata events that name rank `p.rank`'s process and stream tracks.
pub(crate) fn metadata_events(p: &Profile, out: &mut Vec<Value>) {
    let pid = p.rank;
    let mut name = json!({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                          "args": {"name": format!("rank {}", p.rank)}});
    if let Some(c) = p.class {
        name["args"]["class"] = Value::from(c.name());
        out.push(
            json!({"ph": "M", "name": "process_labels", "pid": pid, "tid": 0,
                        "args": {"labels": c.name()}}),
        );
    }
    out.push(name);
    out.push(
        json!({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0,
                    "args": {"sort_index": p.rank}}),
    );
    for (tid, s) in p.streams.iter().enumerate() {
        out.push(
            json!({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                        "args": {"name": s.name}}),
        );
        out.push(
            json!({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
                        "args": {"sort_index": tid}}),
        );
    }
}

/// Rank `p.rank`'s busy periods as complete events on a track after its
/// streams, named by a metadata event (none when it has none).
pub(crate) fn busy_events(p: &Profile, out: &mut Vec<Value>) {
    if p.busy.is_empty() {
        return;
    }
    let (pid, tid) = (p.rank, p.streams.len());
    out.push(
        json!({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                    "args": {"name": "busy periods", "track": BUSY}}),
    );
    out.push(
        json!({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
                    "args": {"sort_index": tid}}),
    );
    out.extend(p.busy.iter().map(|&(a, z)| {
        json!({"ph": "X", "name": BUSY, "cat": BUSY, "pid": pid, "tid": tid,
               "ts": a as f64 / 1e3, "dur": z.saturating_sub(a) as f64 / 1e3})
    }));
}

/// The category of the dependency arrows, [`flow_events`].
const DEPENDENCY: &str = "dependency";

/// Rank `p.rank`'s dependencies across streams as flow events, so that a
/// viewer (Perfetto, `chrome://tracing`) draws an arrow from each
/// predecessor's span to the span on another stream that waited for it:
/// the cross-stream waits the engine issued, seen. A start (`s`) inside
/// the predecessor's span and a finish (`f`, bound to the enclosing span)
/// at the waiting task's start; `id`s numbered from `*next` up, unique in
/// the file. Dependencies on one stream are its order already, and a
/// predecessor outside the profile (cleared, or in an earlier cut) has no
/// span to start from: neither gets an arrow.
pub(crate) fn flow_events(p: &Profile, next: &mut u64, out: &mut Vec<Value>) {
    let at: std::collections::HashMap<u64, &Span> = p.spans.iter().map(|s| (s.id, s)).collect();
    for s in &p.spans {
        for pred in s.preds.iter().filter_map(|id| at.get(id)) {
            if pred.stream == s.stream {
                continue;
            }
            let id = *next;
            *next += 1;
            let mid = pred.start_ns + pred.end_ns.saturating_sub(pred.start_ns) / 2;
            out.push(
                json!({"ph": "s", "name": "waits for", "cat": DEPENDENCY, "id": id,
                            "pid": p.rank, "tid": pred.stream, "ts": mid as f64 / 1e3}),
            );
            out.push(
                json!({"ph": "f", "bp": "e", "name": "waits for", "cat": DEPENDENCY,
                            "id": id, "pid": p.rank, "tid": s.stream,
                            "ts": s.start_ns as f64 / 1e3}),
            );
        }
    }
}

/// Span `s` of rank `pid` as a complete (`X`) event.
pub(crate) fn span_event(pid: usize, s: &Span) -> Value {
    let mut event = json!({
        "ph": "X",
        "name": s.name,
        "cat": s.kind.name(),
        "pid": pid,
        "tid": s.stream,
        "ts": s.start_ns as f64 / 1e3,
        "dur": (s.end_ns.saturating_sub(s.start_ns)) as f64 / 1e3,
        "args": {
            "task": s.id,
            "ok": s.ok,
            "after": s.preds.as_slice(),
            "placed": s.placement.reason.name(),
            "usable_streams": s.placement.usable,
            "priority": s.placement.priority.name(),
            "bytes": s.bytes,
        },
    });
    if let Some(scope) = &s.scope {
        event["args"]["scope"] = Value::from(scope.as_ref());
    }
    if s.wait_ns > 0 {
        event["args"]["wait_us"] = Value::from(s.wait_ns as f64 / 1e3);
    }
    event
}

/// Microseconds (a trace's and the live view's unit) to nanoseconds; absent
/// or not a number reads as 0.
pub(super) fn us_to_ns(v: Option<&Value>) -> u64 {
    (v.and_then(Value::as_f64).unwrap_or(0.0) * 1e3)
        .round()
        .max(0.0) as u64
}

/// The span a complete event describes, with its rank; `None` for an event
/// that is not a Braid task (a host span, metadata). Fields a Braid trace
/// always has but an older one may lack take neutral values (`bytes` 0,
/// placement `pinned`, priority `main`).
pub(crate) fn span_of_event(e: &Value) -> Option<(usize, Span)> {
    if e.get("ph").and_then(Value::as_str) != Some("X") {
        return None;
    }
    let args = e.get("args")?;
    let id = args.get("task").and_then(Value::as_u64)?;
    let str_arg = |k: &str| args.get(k).and_then(Value::as_str).unwrap_or("");
    let start_ns = us_to_ns(e.get("ts"));
    let span = Span {
        id,
        name: e
            .get("name")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string()
            .into(),
        kind: TaskKind::from_name(e.get("cat").and_then(Value::as_str).unwrap_or(""))
            .unwrap_or_default(),
        stream: e.get("tid").and_then(Value::as_u64).unwrap_or(0) as usize,
        placement: Placement {
            reason: PlaceReason::from_name(str_arg("placed")).unwrap_or(PlaceReason::Pinned),
            usable: args
                .get("usable_streams")
                .and_then(Value::as_u64)
                .unwrap_or(1)
                .min(u16::MAX as u64) as u16,
            priority: Priority::from_name(str_arg("priority")).unwrap_or_default(),
        },
        start_ns,
        end_ns: start_ns.saturating_add(us_to_ns(e.get("dur"))),
        preds: args
            .get("after")
            .and_then(Value::as_array)
            .map(|v| v.iter().filter_map(Value::as_u64).collect())
            .unwrap_or_default(),
        ok: args.get("ok").and_then(Value::as_bool).unwrap_or(true),
        bytes: args.get("bytes").and_then(Value::as_u64).unwrap_or(0),
        wait_ns: us_to_ns(args.get("wait_us")),
        scope: args.get("scope").and_then(Value::as_str).map(Into::into),
    };
    Some((
        e.get("pid").and_then(Value::as_u64).unwrap_or(0) as usize,
        span,
    ))
}

/// Reads a Chrome trace Braid wrote ([`super::write_chrome_trace`]) back
/// into one profile per rank, by increasing rank: the JSON object form
/// (`{"traceEvents": [...]}`) or a bare array of events. Events that are
/// not Braid tasks are skipped; a trace without any is an error, and so is
/// a task or busy period whose times Braid never writes (no `ts` or `dur`,
/// a negative one, or an end past 10^15 µs), named by its index and name.
pub fn read_chrome_trace(json: &str) -> Result<Vec<Profile>> {
    let bad = |why: String| Error::BadTrace(format!("trace: {why}"));
    let doc: Value = serde_json::from_str(json).map_err(|e| bad(e.to_string()))?;
    let events = match &doc {
        Value::Object(o) => o
            .get("traceEvents")
            .and_then(Value::as_array)
            .ok_or_else(|| bad("no `traceEvents` array".into()))?,
        Value::Array(a) => a,
        _ => return Err(bad("neither an object nor an array".into())),
    };
    let mut ranks: BTreeMap<usize, Profile> = BTreeMap::new();
    let profile = |ranks: &mut BTreeMap<usize, Profile>, rank| {
        ranks.entry(rank).or_insert_with(|| Profile {
            rank,
            ..Profile::default()
        });
    };
    for (i, e) in events.iter().enumerate() {
        let rank = e.get("pid").and_then(Value::as_u64).unwrap_or(0) as usize;
        // A runtime has at most `u16::MAX` streams; tracks are kept as a
        // dense list, so a larger id is refused rather than allocated.
        if let Some(tid) = e.get("tid").and_then(Value::as_u64) {
            if tid > u64::from(u16::MAX) && str_of(e, "ph").is_some_and(|p| p == "X" || p == "M") {
                return Err(bad(format!(
                    "track {tid} of an event is beyond any runtime's streams ({} at most)",
                    u16::MAX
                )));
            }
        }
        if let Some((rank, span)) = span_of_event(e) {
            check_times(i, e).map_err(bad)?;
            profile(&mut ranks, rank);
            let p = ranks.get_mut(&rank).expect("inserted above");
            p.spans.push(span);
        } else if str_of(e, "ph") == Some("X") && str_of(e, "cat") == Some(BUSY) {
            check_times(i, e).map_err(bad)?;
            profile(&mut ranks, rank);
            let start = us_to_ns(e.get("ts"));
            let p = ranks.get_mut(&rank).expect("inserted above");
            p.busy.push((start, start + us_to_ns(e.get("dur"))));
        } else if str_of(e, "ph") == Some("M") && str_of(e, "name") == Some("process_name") {
            profile(&mut ranks, rank);
            let p = ranks.get_mut(&rank).expect("inserted above");
            p.class = e
                .pointer("/args/class")
                .and_then(Value::as_str)
                .and_then(crate::Class::from_name);
        } else if str_of(e, "ph") == Some("M")
            && str_of(e, "name") == Some("thread_name")
            && e.pointer("/args/track").is_none()
        {
            let tid = e.get("tid").and_then(Value::as_u64).unwrap_or(0) as usize;
            let name = e
                .pointer("/args/name")
                .and_then(Value::as_str)
                .unwrap_or("");
            profile(&mut ranks, rank);
            let p = ranks.get_mut(&rank).expect("inserted above");
            name_stream(p, tid, name);
        }
    }
    let mut out: Vec<Profile> = ranks
        .into_values()
        .filter(|p| !p.spans.is_empty())
        .collect();
    if out.is_empty() {
        return Err(bad(
            "it holds no task events (X events with args.task)".into()
        ));
    }
    for p in &mut out {
        p.spans.sort_by_key(|s| (s.start_ns, s.stream));
        p.busy.sort_unstable();
        let tracks = p.spans.iter().map(|s| s.stream + 1).max().unwrap_or(0);
        while p.streams.len() < tracks {
            let tid = p.streams.len();
            name_stream(p, tid, &format!("stream {tid}"));
        }
    }
    Ok(out)
}

/// The latest instant a trace's event may end at, µs: 10^15 µs, 31 years
/// after its process started (Braid's timeline is nanoseconds since then,
/// a `u64`, so nothing past 584 years is even representable). Far above any
/// run, and far enough below the `u64` limit that instants and their sums
/// stay exact.
const MAX_END_US: f64 = 1e15;

/// Why the times of event `i` (`e`, a task or busy period the reader takes)
/// are not what Braid writes, if they are not: Braid writes every complete
/// event it reads back with a `ts` and a `dur`, neither negative, on its
/// process's timeline. (Metadata events have neither, and are not checked;
/// nor are events the reader skips.)
fn check_times(i: usize, e: &Value) -> std::result::Result<(), String> {
    let time = |k: &str| -> std::result::Result<(f64, &Value), String> {
        let v = e.get(k).ok_or_else(|| format!("it has no `{k}`"))?;
        let x = v
            .as_f64()
            .ok_or_else(|| format!("its `{k}` {v} is not a number"))?;
        if x < 0.0 {
            return Err(format!("its `{k}` {v} is negative"));
        }
        Ok((x, v))
    };
    let why = (|| {
        let (ts, v) = time("ts")?;
        let (dur, _) = time("dur")?;
        if ts + dur > MAX_END_US {
            return Err(format!(
                "it ends past {MAX_END_US:e} µs (its `ts` is {v}): \
                 further from its process's start than any run"
            ));
        }
        Ok(())
    })();
    why.map_err(|why| {
        let name = str_of(e, "name").unwrap_or("");
        format!("event {i} (`{name}`): {why}")
    })
}

/// The string field `k` of event `e`, if it has one.
fn str_of<'a>(e: &'a Value, k: &str) -> Option<&'a str> {
    e.get(k).and_then(Value::as_str)
}

/// Names track `tid` of `p` (a stream is a communication stream when its
/// name starts with `comm`, as the runtime names them).
fn name_stream(p: &mut Profile, tid: usize, name: &str) {
    if p.streams.len() <= tid {
        p.streams.resize_with(tid + 1, || StreamInfo {
            name: String::new(),
            is_comm: false,
        });
    }
    p.streams[tid] = StreamInfo {
        name: name.to_string(),
        is_comm: name.starts_with("comm"),
    };
}

//! Reading a Chrome trace Braid wrote (`braid::trace::write_chrome_trace`)
//! back into tasks, and cutting one training step out of it.
//!
//! What the trace holds, per rank (`pid`): one thread track per stream
//! (`thread_name` metadata: `compute 0`, `comm 0`), and per task a complete
//! (`X`) event with its kind (`cat`), stream (`tid`), start and duration
//! (µs), and `args`: `task` (submission index), `after` (the submission
//! indices of its unfinished predecessors), `priority`, `placed` and `bytes`
//! (its largest declared access: a collective's buffer size; absent in traces
//! written before the simulator existed).
//!
//! A step is a run of tasks, in submission order, whose names repeat from
//! step to step. [`RankTrace::steps`] cuts the sequence at each task named
//! like the rank's first task (by default) whose predecessor in submission
//! order has another name, and keeps as *complete* the segments whose name
//! sequence is the most common one (the first eager steps, whose bucket
//! layout is not yet rebuilt, and the trailing read-backs differ).

use anyhow::{anyhow, bail, Context, Result};
use braid::TaskKind;
use serde_json::Value;
use std::collections::{BTreeMap, HashMap};

/// One task as the trace recorded it.
#[derive(Debug, Clone)]
pub struct TraceTask {
    /// Submission index (`args.task`).
    pub id: u64,
    /// Task name.
    pub name: String,
    /// Task kind (`cat`).
    pub kind: TaskKind,
    /// Stream index (`tid`).
    pub stream: usize,
    /// Start, ns on the process timeline.
    pub start_ns: u64,
    /// Duration, ns.
    pub dur_ns: u64,
    /// Predecessor submission indices (`args.after`).
    pub preds: Vec<u64>,
    /// Largest declared access in bytes (`args.bytes`), if recorded.
    pub bytes: Option<u64>,
    /// Whether the task was submitted with `Priority::Side`.
    pub side: bool,
}

/// The tasks and streams of one rank.
#[derive(Debug, Clone, Default)]
pub struct RankTrace {
    /// The rank (`pid`).
    pub rank: usize,
    /// Stream names by index (`tid`); a stream is a comm stream when its name
    /// starts with `comm`.
    pub streams: Vec<String>,
    /// Tasks in submission order.
    pub tasks: Vec<TraceTask>,
}

/// A whole trace: every rank it holds.
#[derive(Debug, Clone, Default)]
pub struct Trace {
    /// Ranks by increasing rank.
    pub ranks: Vec<RankTrace>,
}

fn kind_of(cat: &str) -> TaskKind {
    match cat {
        "comm" => TaskKind::Comm,
        "copy" => TaskKind::Copy,
        "host" => TaskKind::Host,
        _ => TaskKind::Compute,
    }
}

fn us_to_ns(v: &Value) -> u64 {
    (v.as_f64().unwrap_or(0.0) * 1e3).round().max(0.0) as u64
}

impl Trace {
    /// Parses a Chrome trace (the JSON object form, `{"traceEvents": [...]}`,
    /// or a bare array of events).
    pub fn parse(json: &str) -> Result<Trace> {
        let doc: Value = serde_json::from_str(json).context("the trace is not JSON")?;
        let events = match &doc {
            Value::Object(o) => o
                .get("traceEvents")
                .and_then(Value::as_array)
                .ok_or_else(|| anyhow!("no `traceEvents` array"))?,
            Value::Array(a) => a,
            _ => bail!("a trace is an object with `traceEvents` or an array of events"),
        };
        let mut ranks: BTreeMap<usize, RankTrace> = BTreeMap::new();
        for e in events {
            let pid = e.get("pid").and_then(Value::as_u64).unwrap_or(0) as usize;
            let tid = e.get("tid").and_then(Value::as_u64).unwrap_or(0) as usize;
            let r = ranks.entry(pid).or_insert_with(|| RankTrace {
                rank: pid,
                ..RankTrace::default()
            });
            match e.get("ph").and_then(Value::as_str) {
                Some("M") if e.get("name").and_then(Value::as_str) == Some("thread_name") => {
                    let name = e
                        .pointer("/args/name")
                        .and_then(Value::as_str)
                        .unwrap_or("")
                        .to_string();
                    if r.streams.len() <= tid {
                        r.streams.resize(tid + 1, String::new());
                    }
                    r.streams[tid] = name;
                }
                Some("X") => {
                    let args = e.get("args");
                    let Some(id) = args.and_then(|a| a.get("task")).and_then(Value::as_u64) else {
                        // Not a Braid task event (a host span, say).
                        continue;
                    };
                    let preds = args
                        .and_then(|a| a.get("after"))
                        .and_then(Value::as_array)
                        .map(|v| v.iter().filter_map(Value::as_u64).collect())
                        .unwrap_or_default();
                    r.tasks.push(TraceTask {
                        id,
                        name: e
                            .get("name")
                            .and_then(Value::as_str)
                            .unwrap_or("")
                            .to_string(),
                        kind: kind_of(e.get("cat").and_then(Value::as_str).unwrap_or("")),
                        stream: tid,
                        start_ns: us_to_ns(e.get("ts").unwrap_or(&Value::Null)),
                        dur_ns: us_to_ns(e.get("dur").unwrap_or(&Value::Null)),
                        preds,
                        bytes: args.and_then(|a| a.get("bytes")).and_then(Value::as_u64),
                        side: args.and_then(|a| a.get("priority")).and_then(Value::as_str)
                            == Some("side"),
                    });
                }
                _ => {}
            }
        }
        let mut ranks: Vec<RankTrace> = ranks
            .into_values()
            .filter(|r| !r.tasks.is_empty())
            .collect();
        for r in &mut ranks {
            r.tasks.sort_by_key(|t| t.id);
            let max_tid = r.tasks.iter().map(|t| t.stream).max().unwrap_or(0);
            if r.streams.len() <= max_tid {
                r.streams.resize(max_tid + 1, String::new());
            }
        }
        if ranks.is_empty() {
            bail!("the trace holds no Braid task events (X events with args.task)");
        }
        Ok(Trace { ranks })
    }

    /// Reads and parses a trace file.
    pub fn read(path: &std::path::Path) -> Result<Trace> {
        let s =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        Trace::parse(&s).with_context(|| format!("parsing {}", path.display()))
    }

    /// The trace of rank `rank`.
    pub fn rank(&self, rank: usize) -> Result<&RankTrace> {
        self.ranks
            .iter()
            .find(|r| r.rank == rank)
            .ok_or_else(|| anyhow!("the trace has no rank {rank}"))
    }
}

/// One step of a rank, cut out of its trace.
#[derive(Debug, Clone)]
pub struct StepSlice {
    /// Index of the first task in [`RankTrace::tasks`].
    pub first: usize,
    /// One past the last task.
    pub end: usize,
    /// Whether its name sequence is the common one.
    pub complete: bool,
}

impl RankTrace {
    /// Whether stream `s` is a communication stream.
    pub fn is_comm_stream(&self, s: usize) -> bool {
        self.streams.get(s).is_some_and(|n| n.starts_with("comm"))
    }

    /// Compute streams of the traced run (streams that are not comm streams).
    pub fn compute_streams(&self) -> usize {
        (0..self.streams.len())
            .filter(|&s| !self.is_comm_stream(s))
            .count()
            .max(1)
    }

    /// The steps, cut at each task named `start` (default: the first task's
    /// name) that follows a task with another name.
    pub fn steps(&self, start: Option<&str>) -> Vec<StepSlice> {
        let Some(first) = self.tasks.first() else {
            return Vec::new();
        };
        let anchor = start.unwrap_or(&first.name);
        let mut cuts: Vec<usize> = (0..self.tasks.len())
            .filter(|&i| {
                self.tasks[i].name == anchor && (i == 0 || self.tasks[i - 1].name != anchor)
            })
            .collect();
        if cuts.first() != Some(&0) {
            cuts.insert(0, 0);
        }
        let mut slices: Vec<StepSlice> = cuts
            .iter()
            .enumerate()
            .map(|(k, &a)| StepSlice {
                first: a,
                end: cuts.get(k + 1).copied().unwrap_or(self.tasks.len()),
                complete: false,
            })
            .collect();
        let key = |s: &StepSlice| -> Vec<&str> {
            self.tasks[s.first..s.end]
                .iter()
                .map(|t| t.name.as_str())
                .collect()
        };
        let mut counts: HashMap<Vec<&str>, usize> = HashMap::new();
        for s in &slices {
            *counts.entry(key(s)).or_default() += 1;
        }
        // The most common sequence; on ties the one that comes last.
        let best = slices
            .iter()
            .enumerate()
            .max_by_key(|(i, s)| (counts[&key(s)], *i))
            .map(|(_, s)| key(s));
        if let Some(best) = best {
            let flags: Vec<bool> = slices.iter().map(|s| key(s) == best).collect();
            for (s, f) in slices.iter_mut().zip(flags) {
                s.complete = f;
            }
        }
        slices
    }

    /// The wall time of step `k` as the trainer sees it: from its first
    /// task's start to the next step's first start (host time between steps
    /// included), or to its last end for the last step.
    pub fn step_period_ns(&self, steps: &[StepSlice], k: usize) -> u64 {
        let s = &steps[k];
        let start = self.tasks[s.first..s.end]
            .iter()
            .map(|t| t.start_ns)
            .min()
            .unwrap_or(0);
        match steps.get(k + 1) {
            Some(n) => self.tasks[n.first..n.end]
                .iter()
                .map(|t| t.start_ns)
                .min()
                .unwrap_or(start)
                .saturating_sub(start),
            None => self.step_span_ns(s),
        }
    }

    /// From a step's first task start to its last task end.
    pub fn step_span_ns(&self, s: &StepSlice) -> u64 {
        let ts = &self.tasks[s.first..s.end];
        let a = ts.iter().map(|t| t.start_ns).min().unwrap_or(0);
        let b = ts.iter().map(|t| t.start_ns + t.dur_ns).max().unwrap_or(0);
        b.saturating_sub(a)
    }
}

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
//! order has another name, and keeps as *complete* the segments whose names
//! (as a multiset: a replay re-placed by upward rank submits the same tasks
//! in another order) are the most common ones (the first eager steps, whose
//! bucket layout is not yet rebuilt, and the trailing read-backs differ).

use anyhow::{anyhow, Context, Result};
use braid::{Priority, TaskKind};
use std::collections::HashMap;

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

impl Trace {
    /// Parses a Chrome trace Braid wrote (read by
    /// [`braid::trace::read_chrome_trace`]: the JSON object form or a bare
    /// array of events). A `bytes` of 0 (traces written before the argument
    /// existed) reads as unknown. The ranks' placement agreement
    /// ([`braid::comm::AGREEMENT_TASK`], once, between the recording and
    /// the first replay) is part of no step and is left out.
    pub fn parse(json: &str) -> Result<Trace> {
        let profiles = braid::trace::read_chrome_trace(json)?;
        let ranks = profiles
            .into_iter()
            .map(|p| {
                let mut tasks: Vec<TraceTask> = p
                    .spans
                    .iter()
                    .filter(|s| s.name != braid::comm::AGREEMENT_TASK)
                    .map(|s| TraceTask {
                        id: s.id,
                        name: s.name.to_string(),
                        kind: s.kind,
                        stream: s.stream,
                        start_ns: s.start_ns,
                        dur_ns: s.end_ns - s.start_ns,
                        preds: s.preds.to_vec(),
                        bytes: (s.bytes > 0).then_some(s.bytes),
                        side: s.placement.priority == Priority::Side,
                    })
                    .collect();
                tasks.sort_by_key(|t| t.id);
                RankTrace {
                    rank: p.rank,
                    streams: p.streams.into_iter().map(|s| s.name).collect(),
                    tasks,
                }
            })
            .collect();
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
    /// Whether its names (as a multiset) are the common ones.
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
        // Each step's task names as a multiset (sorted), made once: the same
        // tasks in another submission order are the same step.
        let keys: Vec<Vec<&str>> = slices
            .iter()
            .map(|s| {
                let mut names: Vec<&str> = self.tasks[s.first..s.end]
                    .iter()
                    .map(|t| t.name.as_str())
                    .collect();
                names.sort_unstable();
                names
            })
            .collect();
        let mut counts: HashMap<&[&str], usize> = HashMap::new();
        for k in &keys {
            *counts.entry(k).or_default() += 1;
        }
        // The most common multiset; on ties the one that comes last, but
        // not the last segment's unless it is the only one: it holds the
        // run's final read-backs (or a truncated trace's cut-off step), so
        // when no segment repeats (a run of two or three steps) it was
        // picked over the steps. Where its tasks are the common ones it is
        // still marked complete. When no segment repeats, the largest: in a
        // run of three steps the second step, not the first step's
        // optimizer tail (the first step is cut in two at its second
        // upload).
        let candidates = keys.len() - usize::from(keys.len() > 1);
        let best = (0..candidates).max_by_key(|&i| {
            let count = counts[keys[i].as_slice()];
            (count, if count == 1 { keys[i].len() } else { 0 }, i)
        });
        if let Some(best) = best {
            for (s, k) in slices.iter_mut().zip(&keys) {
                s.complete = *k == keys[best];
            }
        }
        slices
    }

    /// Refuses a step start that names no task of this rank: the trace
    /// would be one segment, simulated as one complete step.
    pub fn check_step_start(&self, start: Option<&str>) -> Result<()> {
        match start {
            Some(name) if !self.tasks.iter().any(|t| t.name == name) => Err(anyhow!(
                "no task named `{name}` (the step start) in rank {}'s trace",
                self.rank
            )),
            _ => Ok(()),
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn task(id: u64, name: &str) -> TraceTask {
        TraceTask {
            id,
            name: name.into(),
            kind: TaskKind::Compute,
            stream: 0,
            start_ns: id * 10,
            dur_ns: 1,
            preds: Vec::new(),
            bytes: None,
            side: false,
        }
    }

    /// Steps holding the same tasks in another submission order (a replay
    /// re-placed by upward rank) are the same step; a step with other tasks
    /// is not.
    #[test]
    fn reordered_steps_are_the_same_step() {
        let names = [
            "upload",
            "a",
            "b",
            "c", // step 0
            "upload",
            "a",
            "c",
            "b", // step 1: reordered
            "upload",
            "c",
            "a",
            "b", // step 2: reordered
            "upload",
            "a",
            "b",
            "read back", // step 3: other tasks
        ];
        let r = RankTrace {
            rank: 0,
            streams: vec!["compute 0".into()],
            tasks: names
                .iter()
                .enumerate()
                .map(|(i, n)| task(i as u64, n))
                .collect(),
        };
        let complete: Vec<bool> = r.steps(None).iter().map(|s| s.complete).collect();
        assert_eq!(complete, [true, true, true, false]);
    }

    fn rank_of(names: &[&str]) -> RankTrace {
        RankTrace {
            rank: 0,
            streams: vec!["compute 0".into()],
            tasks: names
                .iter()
                .enumerate()
                .map(|(i, n)| task(i as u64, n))
                .collect(),
        }
    }

    /// A run of two steps: no segment repeats. The last segment (the second
    /// step with the run's read-backs) was the complete step; the first is
    /// now, and the last only when it is the one segment.
    #[test]
    fn the_read_backs_are_no_complete_step() {
        let r = rank_of(&["upload", "a", "b", "upload", "a", "c", "read back"]);
        let complete: Vec<bool> = r.steps(None).iter().map(|s| s.complete).collect();
        assert_eq!(complete, [true, false]);
        // No repeat: the largest segment but the last (a run of three
        // steps: the second step, not the first step's tail).
        let r = rank_of(&[
            "upload",
            "a",
            "upload",
            "b",
            "c",
            "d",
            "upload",
            "b",
            "c",
            "read back",
        ]);
        let complete: Vec<bool> = r.steps(None).iter().map(|s| s.complete).collect();
        assert_eq!(complete, [false, true, false]);
        let r = rank_of(&[
            "upload",
            "a",
            "b",
            "c",
            "upload",
            "d",
            "upload",
            "b",
            "c",
            "read back",
        ]);
        let complete: Vec<bool> = r.steps(None).iter().map(|s| s.complete).collect();
        assert_eq!(complete, [true, false, false]);
        let r = rank_of(&["upload", "a", "read back"]);
        let complete: Vec<bool> = r.steps(None).iter().map(|s| s.complete).collect();
        assert_eq!(complete, [true]);
        // The last segment is complete when it holds the common tasks.
        let r = rank_of(&["upload", "a", "upload", "a"]);
        let complete: Vec<bool> = r.steps(None).iter().map(|s| s.complete).collect();
        assert_eq!(complete, [true, true]);
    }

    #[test]
    fn a_step_start_that_names_no_task_is_refused() {
        let r = rank_of(&["upload", "a", "upload", "a"]);
        assert!(r.check_step_start(None).is_ok());
        assert!(r.check_step_start(Some("a")).is_ok());
        let e = r.check_step_start(Some("nosuch")).unwrap_err().to_string();
        assert!(e.contains("`nosuch`"), "{e}");
    }
}

//! One rank's step as a task graph: what the scheduler simulates.

use super::cost::Collective;
use super::trace::{RankTrace, StepSlice};
use anyhow::{bail, Result};
use braid::TaskKind;
use std::collections::HashMap;

/// A task of the step.
#[derive(Debug, Clone)]
pub struct Node {
    /// Its name.
    pub name: String,
    /// Its kind.
    pub kind: TaskKind,
    /// The collective it runs, if it is one (from its name).
    pub collective: Option<Collective>,
    /// Stream in the traced run; `None` for a comm stream.
    pub traced_stream: Option<usize>,
    /// Duration in the traced run, ns.
    pub dur_ns: u64,
    /// Its largest declared access, bytes (a collective's buffer).
    pub bytes: Option<u64>,
    /// Submitted with `Priority::Side`.
    pub side: bool,
    /// Predecessors, indices into the step (all smaller than its own).
    pub preds: Vec<usize>,
    /// Mean number of other compute (non-comm) tasks of its rank running
    /// while it ran in the traced step (time-weighted): how contended its
    /// traced duration was.
    pub overlap: f64,
}

impl Node {
    /// Runs on a communication stream.
    pub fn is_comm(&self) -> bool {
        self.kind == TaskKind::Comm
    }
}

/// One step of one rank.
#[derive(Debug, Clone)]
pub struct StepGraph {
    /// Tasks in submission order.
    pub nodes: Vec<Node>,
    /// Host time per step outside the tasks (the traced step's period minus
    /// its span), ns.
    pub host_gap_ns: u64,
    /// The traced step's period (its wall time as the trainer sees it), ns.
    pub measured_step_ns: u64,
    /// Ranks in the traced run.
    pub traced_ranks: usize,
    /// Compute streams in the traced run.
    pub traced_streams: usize,
    /// Complete steps found in the trace.
    pub complete_steps: usize,
}

/// Which step to take from the trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepChoice {
    /// The structure of the last complete step with each task's median
    /// duration over every complete step (and the median period).
    Median,
    /// Complete step `k` (from 0) as it is.
    Index(usize),
}

/// Each name's occurrence among the names before it: `a b a` gives `0 0 1`.
pub(crate) fn occurrences<'a>(names: impl Iterator<Item = &'a str>) -> Vec<usize> {
    let mut seen: HashMap<&str, usize> = HashMap::new();
    names
        .map(|n| {
            let k = seen.entry(n).or_default();
            *k += 1;
            *k - 1
        })
        .collect()
}

fn median(mut v: Vec<u64>) -> u64 {
    if v.is_empty() {
        return 0;
    }
    v.sort_unstable();
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2
    }
}

/// Each task's predecessors as indices into `tasks` (one step, in
/// submission order), all smaller than its own. An id inside the step with
/// no span is the join of a replay: it stands for every task submitted
/// before it; an id before the step was complete when the step started.
pub fn step_preds(tasks: &[super::trace::TraceTask]) -> Vec<Vec<usize>> {
    let Some((first, last)) = tasks.first().zip(tasks.last()) else {
        return Vec::new();
    };
    let index: HashMap<u64, usize> = tasks.iter().enumerate().map(|(i, t)| (t.id, i)).collect();
    let (lo, hi) = (first.id, last.id);
    tasks
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let mut preds: Vec<usize> = Vec::new();
            for &p in &t.preds {
                match index.get(&p) {
                    Some(&j) if j < i => preds.push(j),
                    Some(_) => {}
                    None if p > lo && p < hi => {
                        preds.extend((0..i).filter(|&j| tasks[j].id < p));
                    }
                    None => {}
                }
            }
            preds.sort_unstable();
            preds.dedup();
            preds
        })
        .collect()
}

/// Time-weighted mean number of other non-comm tasks running during task `i`.
fn overlap_of(tasks: &[super::trace::TraceTask], i: usize) -> f64 {
    let t = &tasks[i];
    if t.kind == TaskKind::Comm || t.dur_ns == 0 {
        return 0.0;
    }
    let (a, b) = (t.start_ns, t.start_ns + t.dur_ns);
    let shared: u64 = tasks
        .iter()
        .enumerate()
        .filter(|(j, u)| *j != i && u.kind != TaskKind::Comm)
        .map(|(_, u)| {
            let (c, d) = (u.start_ns, u.start_ns + u.dur_ns);
            b.min(d).saturating_sub(a.max(c))
        })
        .sum();
    shared as f64 / t.dur_ns as f64
}

impl StepGraph {
    /// The step `choice` of rank trace `r` (`start`: the name that begins a
    /// step; default the rank's first task's), traced with `traced_ranks`
    /// ranks.
    pub fn from_trace(
        r: &RankTrace,
        traced_ranks: usize,
        choice: StepChoice,
        start: Option<&str>,
    ) -> Result<StepGraph> {
        r.check_step_start(start)?;
        let steps = r.steps(start);
        let complete: Vec<usize> = (0..steps.len()).filter(|&k| steps[k].complete).collect();
        // The last complete step that has a successor (its period includes
        // the host time before the next step), else the last complete one.
        let with_next: Vec<usize> = complete
            .iter()
            .copied()
            .filter(|&k| k + 1 < steps.len())
            .collect();
        let pick = match choice {
            StepChoice::Median => with_next.last().or(complete.last()).copied(),
            StepChoice::Index(i) => complete.get(i).copied(),
        };
        let Some(k) = pick else {
            bail!(
                "no such complete step in rank {}'s trace ({} complete of {} steps)",
                r.rank,
                complete.len(),
                steps.len()
            );
        };
        let s: &StepSlice = &steps[k];
        let tasks = &r.tasks[s.first..s.end];
        let mut nodes = Vec::with_capacity(tasks.len());
        for ((i, t), preds) in tasks.iter().enumerate().zip(step_preds(tasks)) {
            nodes.push(Node {
                name: t.name.clone(),
                kind: t.kind,
                collective: (t.kind == TaskKind::Comm)
                    .then(|| Collective::from_task_name(&t.name))
                    .flatten(),
                traced_stream: (!r.is_comm_stream(t.stream)).then_some(t.stream),
                dur_ns: t.dur_ns,
                bytes: t.bytes,
                side: t.side,
                preds,
                overlap: overlap_of(tasks, i),
            });
        }
        let (mut period, mut gap) = (
            r.step_period_ns(&steps, k),
            r.step_period_ns(&steps, k)
                .saturating_sub(r.step_span_ns(s)),
        );
        if choice == StepChoice::Median {
            // Each task's median duration over the complete steps. They hold
            // the same tasks, maybe in another submission order (a replay
            // re-placed by upward rank), so a task is matched by its name and
            // its occurrence among the step's tasks of that name.
            let by_name: Vec<HashMap<(&str, usize), u64>> = complete
                .iter()
                .map(|&c| {
                    let tasks = &r.tasks[steps[c].first..steps[c].end];
                    let occ = occurrences(tasks.iter().map(|t| t.name.as_str()));
                    tasks
                        .iter()
                        .zip(occ)
                        .map(|(t, k)| ((t.name.as_str(), k), t.dur_ns))
                        .collect()
                })
                .collect();
            let occ = occurrences(nodes.iter().map(|n| n.name.as_str()));
            let durs: Vec<u64> = nodes
                .iter()
                .zip(occ)
                .map(|(n, k)| {
                    let key = (n.name.as_str(), k);
                    median(
                        by_name
                            .iter()
                            .filter_map(|m| m.get(&key).copied())
                            .collect(),
                    )
                })
                .collect();
            for (n, d) in nodes.iter_mut().zip(durs) {
                n.dur_ns = d;
            }
            if !with_next.is_empty() {
                period = median(
                    with_next
                        .iter()
                        .map(|&c| r.step_period_ns(&steps, c))
                        .collect(),
                );
                gap = median(
                    with_next
                        .iter()
                        .map(|&c| {
                            r.step_period_ns(&steps, c)
                                .saturating_sub(r.step_span_ns(&steps[c]))
                        })
                        .collect(),
                );
            }
        }
        Ok(StepGraph {
            nodes,
            host_gap_ns: gap,
            measured_step_ns: period,
            traced_ranks,
            traced_streams: r.compute_streams(),
            complete_steps: complete.len(),
        })
    }
}

impl StepGraph {
    /// Takes the compute durations of another trace of the same program
    /// (`other`, e.g. one GPU step) by task name, keeping this graph's
    /// structure: its tasks, edges and collectives (their bytes). A task the
    /// other trace does not have — or a non-collective communication task —
    /// is scaled by the median ratio of the matched durations. A task split
    /// into numbered pieces here (`logits backward weight 0` … `3`) that the
    /// other trace ran whole (`logits backward weight`) takes an equal share
    /// of the whole's duration. Also takes the other trace's host time
    /// between steps. Returns (matched, scaled).
    pub fn durations_from(&mut self, other: &StepGraph) -> (usize, usize) {
        let mut by_name: HashMap<String, u64> = HashMap::new();
        for n in other.nodes.iter().filter(|n| n.collective.is_none()) {
            by_name.entry(n.name.clone()).or_insert(n.dur_ns);
        }
        let mut pieces: HashMap<&str, u64> = HashMap::new();
        for n in self.nodes.iter().filter(|n| n.collective.is_none()) {
            if let Some(whole) = piece_of(&n.name)
                .filter(|w| !by_name.contains_key(&n.name) && by_name.contains_key(*w))
            {
                *pieces.entry(whole).or_default() += 1;
            }
        }
        let shares: Vec<(String, u64)> = pieces
            .into_iter()
            .map(|(whole, k)| (whole.to_string(), k))
            .collect();
        for (whole, k) in shares {
            let d = by_name[&whole] / k;
            for n in self
                .nodes
                .iter()
                .filter(|n| piece_of(&n.name) == Some(whole.as_str()))
            {
                by_name.entry(n.name.clone()).or_insert(d);
            }
        }
        let mut ratios: Vec<f64> = self
            .nodes
            .iter()
            .filter(|n| n.collective.is_none() && n.dur_ns > 0)
            .filter_map(|n| {
                by_name
                    .get(n.name.as_str())
                    .map(|&d| d as f64 / n.dur_ns as f64)
            })
            .collect();
        ratios.sort_by(f64::total_cmp);
        let ratio = ratios.get(ratios.len() / 2).copied().unwrap_or(1.0);
        let (mut matched, mut scaled) = (0, 0);
        for n in self.nodes.iter_mut().filter(|n| n.collective.is_none()) {
            match by_name.get(n.name.as_str()) {
                Some(&d) => {
                    n.dur_ns = d;
                    matched += 1;
                }
                None => {
                    n.dur_ns = (n.dur_ns as f64 * ratio).round() as u64;
                    scaled += 1;
                }
            }
            // The other run's durations are its own: no sharing to undo.
            n.overlap = 0.0;
        }
        self.host_gap_ns = other.host_gap_ns;
        self.measured_step_ns = other.measured_step_ns;
        (matched, scaled)
    }
}

impl StepGraph {
    /// Multiplies the bytes of every gather of per-rank rows
    /// ([`Collective::grows_with_ranks`]) by `factor`; returns how many.
    pub fn scale_row_gathers(&mut self, factor: f64) -> usize {
        let mut n = 0;
        for node in &mut self.nodes {
            if node.collective.is_some() && Collective::grows_with_ranks(&node.name) {
                node.bytes = node.bytes.map(|b| (b as f64 * factor).round() as u64);
                n += 1;
            }
        }
        n
    }
}

/// The whole task a numbered piece belongs to: `"x y"` for `"x y 3"`.
fn piece_of(name: &str) -> Option<&str> {
    let (whole, k) = name.rsplit_once(' ')?;
    (!k.is_empty() && k.bytes().all(|b| b.is_ascii_digit())).then_some(whole)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn occurrences_count_each_name_apart() {
        let names = ["a", "b", "a", "read back", "a", "read back"];
        assert_eq!(occurrences(names.into_iter()), [0, 0, 1, 0, 2, 1]);
    }

    fn node(name: &str, dur_ns: u64, collective: Option<Collective>) -> Node {
        Node {
            name: name.into(),
            kind: if collective.is_some() {
                TaskKind::Comm
            } else {
                TaskKind::Compute
            },
            collective,
            traced_stream: None,
            dur_ns,
            bytes: Some(1024),
            side: false,
            preds: Vec::new(),
            overlap: 0.5,
        }
    }

    fn graph(nodes: Vec<Node>, host_gap_ns: u64) -> StepGraph {
        StepGraph {
            nodes,
            host_gap_ns,
            measured_step_ns: 1_000,
            traced_ranks: 1,
            traced_streams: 2,
            complete_steps: 1,
        }
    }

    #[test]
    fn durations_from_another_trace_by_name_the_rest_scaled() {
        let ar = Collective::from_task_name("all_reduce bucket 0");
        assert!(ar.is_some());
        let mut g = graph(
            vec![
                node("a", 100, None),
                node("b", 200, None),
                node("all_reduce bucket 0", 50, ar),
            ],
            7,
        );
        let other = graph(vec![node("a", 10, None), node("c", 5, None)], 3);
        assert_eq!(g.durations_from(&other), (1, 1));
        let d: Vec<u64> = g.nodes.iter().map(|n| n.dur_ns).collect();
        // `a` by name; `b` by the median ratio (10/100); the collective kept
        // (the fabric prices it from its bytes).
        assert_eq!(d, vec![10, 20, 50]);
        assert_eq!(g.host_gap_ns, 3);
        assert!(g.nodes[..2].iter().all(|n| n.overlap == 0.0));
    }

    /// Pieces `w 0` … `w 3` of a task the other trace ran whole as `w`
    /// take a quarter of its duration each; a numbered name the other trace
    /// has itself keeps its own.
    #[test]
    fn numbered_pieces_share_the_whole_tasks_duration() {
        let mut g = graph(
            (0..4)
                .map(|i| node(&format!("w {i}"), 100, None))
                .chain([node("L 3", 100, None)])
                .collect(),
            0,
        );
        let other = graph(vec![node("w", 80, None), node("L 3", 7, None)], 0);
        assert_eq!(g.durations_from(&other), (5, 0));
        let d: Vec<u64> = g.nodes.iter().map(|n| n.dur_ns).collect();
        assert_eq!(d, vec![20, 20, 20, 20, 7]);
    }
}

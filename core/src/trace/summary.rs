//! The summary of a profile.

use super::Profile;
use crate::kind::TaskKind;
use std::collections::HashMap;
use std::fmt;

/// Busy time of one stream.
#[derive(Debug, Clone)]
pub struct StreamBusy {
    /// The stream's name.
    pub name: String,
    /// Time it spent running tasks, in nanoseconds.
    pub busy_ns: u64,
    /// Tasks it ran.
    pub tasks: usize,
}

/// What a profile says about overlap.
#[derive(Debug, Clone, Default)]
pub struct Summary {
    /// Tasks in the profile.
    pub tasks: usize,
    /// From the first task's start to the last task's end.
    pub wall_ns: u64,
    /// Busy time of each stream.
    pub streams: Vec<StreamBusy>,
    /// Time during which two or more streams were busy at once.
    pub overlap_ns: u64,
    /// Time during which communication tasks ran.
    pub comm_ns: u64,
    /// Part of `comm_ns` during which a non-communication task also ran.
    pub comm_hidden_ns: u64,
    /// Part of `comm_ns` that collectives spent waiting for other ranks to
    /// reach them ([`Span::wait_ns`](super::Span::wait_ns); CPU ranks only):
    /// skew between the ranks, which no overlap can hide once the faster
    /// rank has run out of compute.
    pub comm_wait_ns: u64,
    /// Part of `comm_ns` after each collective's wait (the data moving),
    /// and of that, the part during which a non-communication task also
    /// ran. Counting each span's wait at its start (where the arrival
    /// barrier is; the later barriers' waits are short).
    pub transfer_ns: u64,
    /// See [`transfer_ns`](Self::transfer_ns).
    pub transfer_hidden_ns: u64,
    /// Longest chain of dependent tasks, weighted by their durations, over
    /// the edges the spans record ([`Span::preds`](super::Span::preds)):
    /// an eager task records only the predecessors still unfinished when
    /// it was submitted, so a chain restarts at a synchronisation and
    /// wherever a task's predecessors had already finished (a lower bound
    /// then); a replayed task records every edge of its schedule.
    pub critical_path_ns: u64,
}

/// Sorted, merged (disjoint) intervals.
fn union(mut v: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    v.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(v.len());
    for (s, e) in v {
        match out.last_mut() {
            Some(last) if s <= last.1 => last.1 = last.1.max(e),
            _ => out.push((s, e)),
        }
    }
    out
}

fn total(v: &[(u64, u64)]) -> u64 {
    v.iter().map(|(s, e)| e - s).sum()
}

/// Length of the intersection of two sorted disjoint interval lists.
fn intersection(a: &[(u64, u64)], b: &[(u64, u64)]) -> u64 {
    let (mut i, mut j, mut sum) = (0, 0, 0);
    while i < a.len() && j < b.len() {
        let s = a[i].0.max(b[j].0);
        let e = a[i].1.min(b[j].1);
        if s < e {
            sum += e - s;
        }
        if a[i].1 < b[j].1 {
            i += 1;
        } else {
            j += 1;
        }
    }
    sum
}

impl Summary {
    pub(crate) fn of(p: &Profile) -> Summary {
        let spans = &p.spans;
        if spans.is_empty() {
            return Summary::default();
        }
        let start = spans.iter().map(|s| s.start_ns).min().unwrap_or(0);
        let end = spans.iter().map(|s| s.end_ns).max().unwrap_or(0);
        let mut per_stream: Vec<Vec<(u64, u64)>> = vec![Vec::new(); p.streams.len()];
        for s in spans {
            if s.stream < per_stream.len() {
                per_stream[s.stream].push((s.start_ns, s.end_ns));
            }
        }
        let streams = per_stream
            .iter()
            .zip(&p.streams)
            .map(|(v, info)| StreamBusy {
                name: info.name.clone(),
                tasks: v.len(),
                busy_ns: total(&union(v.clone())),
            })
            .collect();
        // Sweep: +1 at each stream-busy start, -1 at each end.
        let mut edges: Vec<(u64, i32)> = Vec::new();
        for v in &per_stream {
            for (s, e) in union(v.clone()) {
                edges.push((s, 1));
                edges.push((e, -1));
            }
        }
        edges.sort_unstable();
        let (mut active, mut last, mut overlap) = (0i32, 0u64, 0u64);
        for (t, d) in edges {
            if active >= 2 {
                overlap += t - last;
            }
            active += d;
            last = t;
        }
        let comm_spans = || spans.iter().filter(|s| s.kind == TaskKind::Comm);
        let comm = union(comm_spans().map(|s| (s.start_ns, s.end_ns)).collect());
        let transfer = union(
            comm_spans()
                .map(|s| ((s.start_ns + s.wait_ns).min(s.end_ns), s.end_ns))
                .collect(),
        );
        let compute = union(
            spans
                .iter()
                .filter(|s| s.kind != TaskKind::Comm)
                .map(|s| (s.start_ns, s.end_ns))
                .collect(),
        );
        // Critical path over the recorded dependency edges, in submission order.
        let mut order: Vec<&super::Span> = spans.iter().collect();
        order.sort_unstable_by_key(|s| s.id);
        let mut longest: HashMap<u64, u64> = HashMap::with_capacity(order.len());
        let mut critical = 0;
        for s in order {
            let before = s.preds.iter().filter_map(|p| longest.get(p)).max().copied();
            let l = before.unwrap_or(0) + (s.end_ns - s.start_ns);
            critical = critical.max(l);
            longest.insert(s.id, l);
        }
        let (comm_ns, transfer_ns) = (total(&comm), total(&transfer));
        Summary {
            tasks: spans.len(),
            wall_ns: end - start,
            streams,
            overlap_ns: overlap,
            comm_ns,
            comm_hidden_ns: intersection(&comm, &compute),
            comm_wait_ns: comm_ns - transfer_ns,
            transfer_ns,
            transfer_hidden_ns: intersection(&transfer, &compute),
            critical_path_ns: critical,
        }
    }

    /// Share of the wall time during which two or more streams were busy.
    pub fn overlap_share(&self) -> f64 {
        if self.wall_ns == 0 {
            0.0
        } else {
            self.overlap_ns as f64 / self.wall_ns as f64
        }
    }

    /// Share of communication time hidden under computation (0 when there was
    /// no communication).
    pub fn hidden_share(&self) -> f64 {
        if self.comm_ns == 0 {
            0.0
        } else {
            self.comm_hidden_ns as f64 / self.comm_ns as f64
        }
    }

    /// Share of the communication time after the waits for other ranks
    /// ([`transfer_ns`](Self::transfer_ns)) hidden under computation (0
    /// when there was none).
    pub fn transfer_hidden_share(&self) -> f64 {
        if self.transfer_ns == 0 {
            0.0
        } else {
            self.transfer_hidden_ns as f64 / self.transfer_ns as f64
        }
    }
}

fn ms(ns: u64) -> f64 {
    ns as f64 / 1e6
}

impl fmt::Display for Summary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "tasks            {}", self.tasks)?;
        writeln!(f, "wall time        {:.3} ms", ms(self.wall_ns))?;
        for s in &self.streams {
            let pct = if self.wall_ns > 0 {
                100.0 * s.busy_ns as f64 / self.wall_ns as f64
            } else {
                0.0
            };
            writeln!(
                f,
                "busy {:<11} {:.3} ms ({pct:.0}%, {} tasks)",
                s.name,
                ms(s.busy_ns),
                s.tasks
            )?;
        }
        writeln!(f, "2+ streams busy  {:.3} ms", ms(self.overlap_ns))?;
        writeln!(
            f,
            "comm time        {:.3} ms, {:.0}% hidden under compute",
            ms(self.comm_ns),
            100.0 * self.hidden_share()
        )?;
        if self.comm_wait_ns > 0 {
            writeln!(
                f,
                "comm waiting     {:.3} ms for other ranks; the rest {:.0}% hidden",
                ms(self.comm_wait_ns),
                100.0 * self.transfer_hidden_share()
            )?;
        }
        write!(f, "critical path    {:.3} ms", ms(self.critical_path_ns))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::{Span, StreamInfo};

    fn span(id: u64, stream: usize, kind: TaskKind, s: u64, e: u64, preds: &[u64]) -> Span {
        Span {
            id,
            name: "t".into(),
            scope: None,
            kind,
            stream,
            placement: crate::kind::Placement {
                reason: crate::kind::PlaceReason::Pinned,
                usable: 1,
                priority: crate::kind::Priority::Main,
            },
            start_ns: s,
            end_ns: e,
            preds: preds.iter().copied().collect(),
            ok: true,
            bytes: 0,
            wait_ns: 0,
        }
    }

    /// The summary of `spans` on streams `compute 0` and `comm 0`.
    fn compute_and_comm(spans: Vec<Span>) -> Summary {
        profile(spans).summary()
    }

    fn profile(spans: Vec<Span>) -> Profile {
        Profile {
            rank: 0,
            streams: vec![
                StreamInfo {
                    name: "compute 0".into(),
                    is_comm: false,
                },
                StreamInfo {
                    name: "comm 0".into(),
                    is_comm: true,
                },
            ],
            spans,
            ..Profile::default()
        }
    }

    /// A profile cut at a mark: the spans that started before it are left
    /// out, the edges to them ignored.
    #[test]
    fn a_profile_since_a_mark_summarises_the_later_spans() {
        let p = profile(vec![
            span(0, 1, TaskKind::Comm, 0, 10, &[]), // exposed, before the mark
            span(1, 0, TaskKind::Compute, 12, 20, &[0]),
            span(2, 1, TaskKind::Comm, 15, 20, &[1]),
        ]);
        assert_eq!((p.summary().comm_ns, p.summary().comm_hidden_ns), (15, 5));
        let later = p.since(11);
        assert_eq!(later.spans.len(), 2);
        assert_eq!(later.streams.len(), 2);
        let s = later.summary();
        assert_eq!((s.comm_ns, s.comm_hidden_ns, s.wall_ns), (5, 5, 8));
        assert_eq!(s.critical_path_ns, 13);
        assert!(p.since(21).summary().comm_ns == 0);
    }

    #[test]
    fn overlap_hidden_comm_and_critical_path() {
        let s = compute_and_comm(vec![
            span(0, 0, TaskKind::Compute, 0, 10, &[]),
            span(1, 0, TaskKind::Compute, 10, 20, &[0]),
            span(2, 1, TaskKind::Comm, 5, 25, &[0]),
        ]);
        assert_eq!(s.wall_ns, 25);
        assert_eq!(s.overlap_ns, 15);
        assert_eq!(s.comm_ns, 20);
        assert_eq!(s.comm_hidden_ns, 15);
        assert_eq!(s.critical_path_ns, 30);
        assert_eq!(s.streams[0].busy_ns, 20);
        assert_eq!((s.comm_wait_ns, s.transfer_ns), (0, 20));
    }

    /// A collective that waited for the other ranks: its wait (at its start)
    /// is counted apart, and the transfer after it is hidden where compute
    /// ran beside it.
    #[test]
    fn peer_waits_are_counted_apart_from_transfers() {
        let mut comm = span(2, 1, TaskKind::Comm, 5, 40, &[]);
        comm.wait_ns = 20; // waiting 5..25, moving data 25..40
        let s = compute_and_comm(vec![span(0, 0, TaskKind::Compute, 0, 30, &[]), comm]);
        assert_eq!((s.comm_ns, s.comm_hidden_ns), (35, 25));
        assert_eq!(
            (s.comm_wait_ns, s.transfer_ns, s.transfer_hidden_ns),
            (20, 15, 5)
        );
        assert!((s.transfer_hidden_share() - 1.0 / 3.0).abs() < 1e-12);
        assert!(s
            .to_string()
            .contains("comm waiting     0.000 ms for other ranks; the rest 33% hidden"));
    }
}

//! Placement: which stream runs a task.
//!
//! A policy sees the task's kind and priority, where its latest predecessor
//! runs and whether that stream has moved on since, and how many tasks each
//! stream has queued. It returns a stream index. Policies are deterministic
//! functions of that input and their own state, so the same program places the
//! same way on every rank (which keeps collective order identical).

use crate::kind::{Priority, TaskKind};

/// How tasks are spread over streams.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Policy {
    /// Everything on stream 0, communication included: the sequential baseline
    /// every benchmark compares against.
    Single,
    /// Compute tasks cycle over the compute streams; communication goes to the
    /// communication streams.
    RoundRobin,
    /// Keep a task on the stream of its latest predecessor when that stream has
    /// not moved on to other work (no event needed, no conflict); otherwise the
    /// least-loaded compute stream. `Side` tasks leave their predecessor's
    /// stream free for the main chain. Communication goes to the
    /// communication streams.
    #[default]
    Affinity,
}

impl Policy {
    /// All policies, for tests and benchmarks that sweep them.
    pub const ALL: [Policy; 3] = [Policy::Single, Policy::RoundRobin, Policy::Affinity];

    /// The policy's command-line name.
    pub fn name(self) -> &'static str {
        match self {
            Policy::Single => "single",
            Policy::RoundRobin => "round-robin",
            Policy::Affinity => "affinity",
        }
    }
}

impl std::str::FromStr for Policy {
    type Err = crate::Error;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "single" => Ok(Policy::Single),
            "round-robin" | "roundrobin" | "rr" => Ok(Policy::RoundRobin),
            "affinity" | "default" => Ok(Policy::Affinity),
            _ => Err(crate::Error::Config(format!(
                "unknown placement policy `{s}` (expected single, round-robin or affinity)"
            ))),
        }
    }
}

impl std::fmt::Display for Policy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What a policy knows about the task being placed.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Request {
    pub kind: TaskKind,
    pub priority: Priority,
    /// Stream of the latest (most recently submitted) unfinished predecessor,
    /// and whether that predecessor is still the last task on its stream.
    pub latest_pred: Option<(usize, bool)>,
    /// For communication tasks: which communication stream (modulo their count).
    pub comm_index: usize,
}

/// The small trait every placement policy implements.
pub(crate) trait Place: Send {
    /// `load(s)` is the number of tasks placed on stream `s` not yet
    /// completed (read from the stream threads' counters only when asked).
    fn place(&mut self, req: &Request, load: &dyn Fn(usize) -> u64) -> usize;
}

/// The stream layout: compute streams first, then communication streams.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Layout {
    pub compute: usize,
    pub comm: usize,
}

impl Layout {
    fn comm_stream(&self, req: &Request) -> Option<usize> {
        (req.kind == TaskKind::Comm && self.comm > 0)
            .then(|| self.compute + req.comm_index % self.comm)
    }

    fn least_loaded(&self, load: &dyn Fn(usize) -> u64, avoid: Option<usize>) -> usize {
        let mut best = None;
        for s in 0..self.compute {
            if Some(s) == avoid && self.compute > 1 {
                continue;
            }
            let l = load(s);
            if best.is_none_or(|(_, bl)| l < bl) {
                best = Some((s, l));
            }
        }
        best.map_or(0, |(s, _)| s)
    }
}

pub(crate) fn make(policy: Policy, layout: Layout) -> Box<dyn Place> {
    match policy {
        Policy::Single => Box::new(Single),
        Policy::RoundRobin => Box::new(RoundRobin { layout, next: 0 }),
        Policy::Affinity => Box::new(Affinity { layout }),
    }
}

struct Single;

impl Place for Single {
    fn place(&mut self, _: &Request, _: &dyn Fn(usize) -> u64) -> usize {
        0
    }
}

struct RoundRobin {
    layout: Layout,
    next: usize,
}

impl Place for RoundRobin {
    fn place(&mut self, req: &Request, _: &dyn Fn(usize) -> u64) -> usize {
        if let Some(s) = self.layout.comm_stream(req) {
            return s;
        }
        let s = self.next % self.layout.compute;
        self.next = self.next.wrapping_add(1);
        s
    }
}

struct Affinity {
    layout: Layout,
}

impl Place for Affinity {
    fn place(&mut self, req: &Request, load: &dyn Fn(usize) -> u64) -> usize {
        if let Some(s) = self.layout.comm_stream(req) {
            return s;
        }
        match req.latest_pred {
            // The predecessor is the tail of a compute stream: continue the chain
            // there, unless this is side work that should leave it to the chain.
            Some((s, true)) if s < self.layout.compute && req.priority != Priority::Side => s,
            Some((s, _)) if req.priority == Priority::Side => {
                self.layout.least_loaded(load, Some(s))
            }
            _ => self.layout.least_loaded(load, None),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(v: &[u64]) -> impl Fn(usize) -> u64 + '_ {
        move |s| v[s]
    }

    fn req(kind: TaskKind, latest_pred: Option<(usize, bool)>) -> Request {
        Request {
            kind,
            priority: Priority::Main,
            latest_pred,
            comm_index: 0,
        }
    }

    #[test]
    fn affinity_continues_chains_and_forks_to_idle_streams() {
        let l = Layout {
            compute: 3,
            comm: 1,
        };
        let mut p = make(Policy::Affinity, l);
        assert_eq!(
            p.place(&req(TaskKind::Compute, Some((2, true))), &at(&[0, 0, 5, 0])),
            2
        );
        // The predecessor's stream moved on: pick the least loaded.
        assert_eq!(
            p.place(
                &req(TaskKind::Compute, Some((2, false))),
                &at(&[3, 1, 5, 0])
            ),
            1
        );
        assert_eq!(
            p.place(&req(TaskKind::Comm, Some((0, true))), &at(&[0, 0, 0, 9])),
            3
        );
        let side = Request {
            priority: Priority::Side,
            ..req(TaskKind::Compute, Some((0, true)))
        };
        assert_eq!(p.place(&side, &at(&[0, 2, 1, 0])), 2);
    }

    #[test]
    fn single_and_round_robin() {
        let l = Layout {
            compute: 2,
            comm: 1,
        };
        let mut s = make(Policy::Single, l);
        assert_eq!(s.place(&req(TaskKind::Comm, None), &at(&[0, 0, 0])), 0);
        let mut rr = make(Policy::RoundRobin, l);
        let got: Vec<usize> = (0..4)
            .map(|_| rr.place(&req(TaskKind::Compute, None), &at(&[0, 0, 0])))
            .collect();
        assert_eq!(got, vec![0, 1, 0, 1]);
        assert_eq!(rr.place(&req(TaskKind::Comm, None), &at(&[0, 0, 0])), 2);
    }
}

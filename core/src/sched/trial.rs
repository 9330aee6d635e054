//! The placement trial: whether a recorded schedule runs faster over the
//! streams it was recorded on or on one stream is measured, not modelled.
//!
//! On a GPU the CPU's cost model (`Plan::replaced`) does not apply: streams
//! are not processors, concurrent kernels share the SMs, and a saturated
//! GPU gains nothing from a second stream but its fork and join (run 7: the
//! affinity placement 0.97× of one stream at B 8, 1.07× at B 16). So the
//! first replays of a schedule whose movable tasks use more than one stream
//! are a trial (docs/replay.md, "The placement trial"): `WARMUP + SAMPLES + 1`
//! replays of the recorded placement, then as many with every movable task on
//! one stream, each waited for as it is submitted; per placement, the
//! `SAMPLES` intervals between consecutive completions after the warm-up (the
//! first replay of each captures its graph). The placement with the smaller
//! median interval is kept, the recorded one on a tie. Results do not depend
//! on placement (semantics 1), so the switch changes nothing but the time.
//!
//! This module is the bookkeeping only, with no clock of its own: `Schedule`
//! asks which placement a replay takes and reports when it completed.

/// Replays of each placement before its samples: the first captures its
/// graph (or warms its streams), the second settles.
pub(crate) const WARMUP: u32 = 2;
/// Intervals sampled per placement.
pub(crate) const SAMPLES: u32 = 5;
/// Replays of each placement in a trial: the warm-up, and one completion
/// before each sampled interval.
const PER_PLACEMENT: u32 = WARMUP + SAMPLES + 1;

/// One of the two placements a trial compares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TrialPlacement {
    /// The placement the recording got (the runtime's policy).
    Recorded,
    /// Every movable task on the first compute stream (collectives and
    /// pinned tasks stay where they were): the `single` policy's placement.
    OneStream,
}

/// What a placement trial measured and kept
/// ([`Schedule::placement_trial`](crate::Schedule::placement_trial)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TrialOutcome {
    /// Median interval between consecutive replays' completions, in ns,
    /// with the recorded placement.
    pub recorded_ns: u64,
    /// The same on one stream.
    pub one_stream_ns: u64,
    /// The placement later replays use.
    pub kept: TrialPlacement,
}

/// A trial in progress, or its outcome.
#[derive(Debug)]
pub(crate) struct Trial {
    /// The placement of the replays now being submitted.
    current: TrialPlacement,
    /// Replays of `current` completed so far.
    done: u32,
    /// When the last completed replay of `current` completed (ns).
    last: Option<u64>,
    /// Sampled intervals of the recorded placement, then of one stream.
    samples: [Vec<u64>; 2],
    outcome: Option<TrialOutcome>,
}

impl Trial {
    pub(crate) fn new() -> Trial {
        Trial {
            current: TrialPlacement::Recorded,
            done: 0,
            last: None,
            samples: [Vec::new(), Vec::new()],
            outcome: None,
        }
    }

    /// The placement the next replay takes.
    pub(crate) fn placement(&self) -> TrialPlacement {
        match self.outcome {
            Some(o) => o.kept,
            None => self.current,
        }
    }

    /// Whether the next replay is part of the trial (waited for, then
    /// reported through [`completed`](Self::completed)).
    pub(crate) fn running(&self) -> bool {
        self.outcome.is_none()
    }

    /// The trial's outcome, once decided.
    pub(crate) fn outcome(&self) -> Option<TrialOutcome> {
        self.outcome
    }

    /// A replay of the current placement completed at `at_ns` (a monotonic
    /// clock): samples the interval since the previous one after the
    /// warm-up, and moves to the next placement, or decides, after the
    /// last.
    pub(crate) fn completed(&mut self, at_ns: u64) {
        if self.outcome.is_some() {
            return;
        }
        self.done += 1;
        if let Some(prev) = self.last {
            if self.done > WARMUP + 1 {
                let i = self.current as usize;
                self.samples[i].push(at_ns.saturating_sub(prev));
            }
        }
        self.last = Some(at_ns);
        if self.done < PER_PLACEMENT {
            return;
        }
        match self.current {
            TrialPlacement::Recorded => {
                self.current = TrialPlacement::OneStream;
                self.done = 0;
                self.last = None;
            }
            TrialPlacement::OneStream => {
                let recorded_ns = median(&mut self.samples[0]);
                let one_stream_ns = median(&mut self.samples[1]);
                let kept = if one_stream_ns < recorded_ns {
                    TrialPlacement::OneStream
                } else {
                    TrialPlacement::Recorded
                };
                self.outcome = Some(TrialOutcome {
                    recorded_ns,
                    one_stream_ns,
                    kept,
                });
            }
        }
    }
}

/// The median (the lower of the middle two for an even count); 0 if empty.
fn median(v: &mut [u64]) -> u64 {
    if v.is_empty() {
        return 0;
    }
    v.sort_unstable();
    v[(v.len() - 1) / 2]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs a trial where a replay of the recorded placement takes `rec`
    /// ns and one on one stream `one`, the first of each `capture` ns more;
    /// returns the placements the replays took and the outcome.
    fn run(rec: u64, one: u64, capture: u64) -> (Vec<TrialPlacement>, TrialOutcome) {
        let mut t = Trial::new();
        let (mut now, mut taken) = (1_000u64, Vec::new());
        while t.running() {
            let p = t.placement();
            let first = taken.last() != Some(&p);
            taken.push(p);
            now += if p == TrialPlacement::Recorded {
                rec
            } else {
                one
            };
            if first {
                now += capture;
            }
            t.completed(now);
        }
        (taken, t.outcome().expect("decided"))
    }

    #[test]
    fn each_placement_is_tried_after_a_warm_up_and_the_faster_kept() {
        let (taken, o) = run(110, 100, 50_000);
        let per = PER_PLACEMENT as usize;
        assert_eq!(taken.len(), 2 * per);
        assert!(taken[..per].iter().all(|&p| p == TrialPlacement::Recorded));
        assert!(taken[per..].iter().all(|&p| p == TrialPlacement::OneStream));
        // The captures are in the warm-up: the medians are the step times.
        assert_eq!((o.recorded_ns, o.one_stream_ns), (110, 100));
        assert_eq!(o.kept, TrialPlacement::OneStream);
        let (_, o) = run(90, 100, 50_000);
        assert_eq!(o.kept, TrialPlacement::Recorded);
    }

    #[test]
    fn a_tie_keeps_the_recorded_placement_and_a_decided_trial_stays_decided() {
        let (_, o) = run(100, 100, 0);
        assert_eq!(o.kept, TrialPlacement::Recorded);
        let mut t = Trial::new();
        while t.running() {
            let p = t.placement();
            t.completed(if p == TrialPlacement::Recorded { 0 } else { 1 });
        }
        let decided = t.outcome();
        t.completed(u64::MAX);
        assert_eq!(t.outcome(), decided);
        assert_eq!(t.placement(), decided.unwrap().kept);
    }

    #[test]
    fn one_slow_step_does_not_decide() {
        // One interval of each placement 100x longer (a checkpoint, say):
        // the medians ignore it.
        let mut t = Trial::new();
        let (mut now, mut n) = (0u64, 0u32);
        while t.running() {
            n += 1;
            let p = t.placement();
            let base = if p == TrialPlacement::Recorded {
                100
            } else {
                120
            };
            now += if n % PER_PLACEMENT == 5 {
                base * 100
            } else {
                base
            };
            t.completed(now);
        }
        let o = t.outcome().unwrap();
        assert_eq!((o.recorded_ns, o.one_stream_ns), (100, 120));
        assert_eq!(o.kept, TrialPlacement::Recorded);
    }

    #[test]
    fn median_of_odd_even_and_empty() {
        assert_eq!(median(&mut [3, 1, 2]), 2);
        assert_eq!(median(&mut [4, 1, 3, 2]), 2);
        assert_eq!(median(&mut []), 0);
    }
}

//! The learning rate over a run: a linear warm-up, then a cosine decay to a
//! fraction of the peak (what nanoGPT and llm.c train GPT-2 with), or a
//! constant rate.

use crate::error::{Gpt2Error, Result};

/// How the learning rate of step `s` (from 1) follows from the peak rate.
///
/// - Warm-up: steps `1..=warmup_steps` take `peak · s / warmup_steps`.
/// - Then a cosine from the peak down to `peak · final_fraction`, reached
///   at step `decay_end` (the run's last step) and kept after it:
///   `min + (peak − min) · (1 + cos(π · (s − warmup) / (decay_end − warmup))) / 2`.
///
/// [`constant`](Self::constant) (no warm-up, a final fraction of 1) keeps
/// the peak at every step, bit for bit.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LrSchedule {
    /// Steps of linear warm-up (0: none).
    pub warmup_steps: u64,
    /// The step at which the decay ends (the run's last step).
    pub decay_end: u64,
    /// The rate after the decay, as a fraction of the peak (1: no decay).
    pub final_fraction: f32,
}

impl Default for LrSchedule {
    /// [`constant`](Self::constant).
    fn default() -> Self {
        Self::constant()
    }
}

impl LrSchedule {
    /// The peak rate at every step.
    pub fn constant() -> Self {
        LrSchedule {
            warmup_steps: 0,
            decay_end: 0,
            final_fraction: 1.0,
        }
    }

    /// A warm-up of `warmup_steps`, then a cosine decay to `final_fraction`
    /// of the peak at step `decay_end`.
    pub fn cosine(warmup_steps: u64, decay_end: u64, final_fraction: f32) -> Self {
        LrSchedule {
            warmup_steps,
            decay_end,
            final_fraction,
        }
    }

    /// An error naming the setting when the schedule cannot be followed.
    pub fn check(&self) -> Result<()> {
        let f = self.final_fraction;
        if !(f.is_finite() && (0.0..=1.0).contains(&f)) {
            return Err(Gpt2Error::InvalidSetting {
                what: "learning-rate schedule",
                reason: format!("the final fraction of the peak rate is {f}, not in 0..=1"),
            });
        }
        Ok(())
    }

    /// `"constant"` when the rate stays at the peak after the warm-up (a
    /// final fraction of 1: where a decay would end changes nothing),
    /// `"cosine"` otherwise: the kind of schedule [`rate`](Self::rate)
    /// follows, as `braid-gpt2 train --lr-schedule` names it.
    pub fn kind(&self) -> &'static str {
        if self.final_fraction == 1.0 {
            "constant"
        } else {
            "cosine"
        }
    }

    /// The rate of step `step` (from 1) for the peak rate `peak`.
    pub fn rate(&self, peak: f32, step: u64) -> f32 {
        let (warmup, end) = (self.warmup_steps, self.decay_end);
        if step <= warmup {
            return (peak as f64 * step as f64 / warmup as f64) as f32;
        }
        if self.final_fraction == 1.0 {
            return peak;
        }
        let low = peak as f64 * self.final_fraction as f64;
        if step >= end {
            return low as f32;
        }
        let ratio = (step - warmup) as f64 / (end - warmup) as f64;
        let cos = 0.5 * (1.0 + (std::f64::consts::PI * ratio).cos());
        (low + (peak as f64 - low) * cos) as f32
    }
}

#[cfg(test)]
mod tests {
    use super::LrSchedule;

    #[test]
    fn constant_is_the_peak_at_every_step() {
        let s = LrSchedule::constant();
        for step in [1, 2, 17, 1 << 40] {
            assert_eq!(s.rate(3e-4, step).to_bits(), 3e-4f32.to_bits());
        }
    }

    #[test]
    fn warm_up_then_cosine_to_the_final_fraction() {
        let s = LrSchedule::cosine(4, 40, 0.1);
        let r = |step| s.rate(2e-3, step);
        assert_eq!(r(1), 5e-4);
        assert_eq!(r(2), 1e-3);
        assert_eq!(r(4), 2e-3);
        // Half way through the decay: the mean of the peak and the floor.
        assert!((r(22) - 1.1e-3).abs() < 1e-9, "{}", r(22));
        assert!((r(40) - 2e-4).abs() < 1e-9, "{}", r(40));
        assert_eq!(r(41), r(40));
        // Falling all the way.
        for step in 4..40 {
            assert!(r(step + 1) < r(step), "step {step}");
        }
        // No decay: the peak after the warm-up.
        let flat = LrSchedule::cosine(3, 40, 1.0);
        assert_eq!((flat.kind(), s.kind()), ("constant", "cosine"));
        assert_eq!(flat.rate(1e-3, 2), (1e-3f32 as f64 * 2.0 / 3.0) as f32);
        assert_eq!(flat.rate(1e-3, 30), 1e-3);
        // A decay that ends with the warm-up (or before it) goes straight
        // to the floor.
        assert_eq!(LrSchedule::cosine(5, 5, 0.5).rate(1.0, 6), 0.5);
        assert_eq!(LrSchedule::cosine(5, 2, 0.5).rate(1.0, 6), 0.5);
    }

    #[test]
    fn a_final_fraction_outside_0_to_1_is_refused() {
        for f in [-0.1, 1.5, f32::NAN] {
            let e = LrSchedule::cosine(0, 10, f)
                .check()
                .unwrap_err()
                .to_string();
            assert!(e.contains("final fraction"), "{e}");
        }
        LrSchedule::cosine(0, 10, 0.0).check().unwrap();
    }
}

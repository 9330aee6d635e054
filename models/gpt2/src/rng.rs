//! The one seeded random number generator of braid-gpt2: weight
//! initialisation, sampling, test and benchmark data.
//!
//! It is rand's [`Xoshiro256PlusPlus`], seeded with `seed_from_u64`: a named
//! algorithm (not `StdRng`, which rand may swap for another), so a seed gives
//! the same numbers on every platform and every run with this `rand` version.
//! The built-in corpus keeps its own SplitMix64 (`data::builtin`): its text is
//! pinned byte for byte.
//!
//! `tools/nvrtc-check` includes this file by path: it uses only `rand`.

use rand::distr::OpenClosed01;
use rand::rngs::Xoshiro256PlusPlus;
use rand::{Rng as _, RngExt, SeedableRng};

/// A seeded random number generator (rand's Xoshiro256++), with the draws
/// braid-gpt2 needs.
#[derive(Debug, Clone)]
pub struct Rng(Xoshiro256PlusPlus);

impl Rng {
    /// The seed of the `n`-th stream drawn for a run seeded `seed` (an
    /// epoch's data order, a step's generated text): a function of the two
    /// only, so a resumed run draws what an uninterrupted one does.
    pub fn derived_seed(seed: u64, n: u64) -> u64 {
        seed ^ n.wrapping_mul(0x9e37_79b9_7f4a_7c15)
    }

    /// A generator seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        Rng(Xoshiro256PlusPlus::seed_from_u64(seed))
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0.next_u64()
    }

    /// Uniform in `[0, 1)`.
    pub fn uniform(&mut self) -> f64 {
        self.0.random()
    }

    /// Standard normal (Box–Muller).
    pub fn normal(&mut self) -> f32 {
        let u1: f64 = self.0.sample(OpenClosed01);
        let u2: f64 = self.0.random();
        ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
    }
}

/// `n` normal samples with standard deviation `std`, from a generator seeded
/// with `seed` (test and benchmark data).
pub fn randn(n: usize, std: f32, seed: u64) -> Vec<f32> {
    let mut rng = Rng::new(seed);
    (0..n).map(|_| rng.normal() * std).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeded_draws_repeat_and_look_normal() {
        let a = randn(20_000, 2.0, 7);
        assert_eq!(a, randn(20_000, 2.0, 7));
        assert_ne!(a, randn(20_000, 2.0, 8));
        let mean = a.iter().map(|&x| x as f64).sum::<f64>() / a.len() as f64;
        let var = a.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / a.len() as f64;
        assert!(
            mean.abs() < 0.05 && (var.sqrt() - 2.0).abs() < 0.05,
            "{mean} {var}"
        );
        let mut rng = Rng::new(1);
        assert!((0..1000)
            .map(|_| rng.uniform())
            .all(|u| (0.0..1.0).contains(&u)));
    }
}

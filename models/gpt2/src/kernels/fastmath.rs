//! `exp` and `tanh` for the CPU kernels' inner loops, and the row reductions
//! that go with them: branch-free `f32` code the compiler vectorises, where
//! the C library's `expf`/`tanhf` are one call per element.
//!
//! - [`exp`]: Cody–Waite range reduction `x = n·ln 2 + r` (`|r| ≤ ln 2 / 2`,
//!   `n` rounded to nearest with the `1.5·2²³` trick, so no rounding
//!   instruction is needed), a degree-6 polynomial for `e^r` (Cephes'
//!   `expf` coefficients), and `2ⁿ` put together from its bits. At most 1
//!   ulp from the true value in the test's sweep of 2²² points of
//!   `[-87.3, 88.3]` against `f64` (it asserts 2); `0` below `-87.34` (where
//!   `e^x` is subnormal, and for `-∞`), `+∞` above `88.37`, NaN for NaN.
//! - [`tanh`]: Cephes' `tanhf`: an odd polynomial for `|x| < 0.625`, else
//!   `1 - 2 / (e^{2|x|} + 1)` with [`exp`], the sign put back; `±1` beyond
//!   `|x| = 10`. At most 1 ulp in a sweep of 5·2²⁰ points of `[-12, 12]`
//!   (asserted: 2).
//!
//! Both compute every branch and select (no data-dependent jumps), so a
//! loop that calls them on slices vectorises. The kernels that use them
//! (softmax, the fused classifier, attention's softmax, GELU) therefore
//! differ from `expf`/`tanhf` in the last bits; the sequential reference
//! model uses the same kernels, so the engine still matches it bit for bit.
//!
//! [`row_max`] and [`row_sum_f64`] are the row reductions of those kernels:
//! eight interleaved lanes (a max is exact in any order; the `f64` sum of
//! `f32` terms is added in a fixed order, lane by lane), which vectorise
//! where one running total cannot.

/// Lanes of the row reductions.
const LANES: usize = 8;

const LOG2E: f32 = std::f32::consts::LOG2_E;
/// `ln 2` in two parts: `LN2_HI` has few mantissa bits, so `n·LN2_HI` is
/// exact for the `n` that occur.
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// `1.5·2²³`: adding it rounds an `f32` of magnitude below `2²²` to an
/// integer, which then sits in the low mantissa bits.
const ROUNDER: f32 = 12_582_912.0;
/// Below this, `e^x` is subnormal: the result is 0.
const EXP_MIN: f32 = -87.336_55;
/// Above this, `e^x` overflows `2¹²⁷·2`: the result is `+∞`.
const EXP_MAX: f32 = 88.376_26;

/// `e^x` (module docs: within 2 ulp; 0 below `-87.34`, `+∞` above `88.37`).
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    let xc = x.clamp(EXP_MIN, EXP_MAX);
    // n = round(x / ln 2), as a float and in the low mantissa bits of t.
    let t = xc * LOG2E + ROUNDER;
    let n = t - ROUNDER;
    let ni = (t.to_bits() as i32).wrapping_sub(ROUNDER.to_bits() as i32);
    let r = (xc - n * LN2_HI) - n * LN2_LO;
    let mut p = 1.987_569_1e-4f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5; // Cephes: 5.0000001201e-1, which is 0.5 in f32
    let y = p * (r * r) + r + 1.0;
    // 2ⁿ for n in [-126, 127]: a normal float's exponent field.
    let scale = f32::from_bits((ni.wrapping_add(127) as u32) << 23);
    let e = y * scale;
    let e = if x < EXP_MIN { 0.0 } else { e };
    if x > EXP_MAX {
        f32::INFINITY
    } else {
        e
    }
}

/// `tanh x` (module docs: within 2 ulp).
#[inline(always)]
pub fn tanh(x: f32) -> f32 {
    let a = x.abs();
    // (not `min`: a NaN must stay NaN)
    let a = if a > 10.0 { 10.0 } else { a };
    // |x| < 0.625: x + x·z·P(z), z = x².
    let z = x * x;
    let mut p = -5.704_988_7e-3f32;
    p = p * z + 2.063_909e-2;
    p = p * z - 5.373_971_6e-2;
    p = p * z + 1.333_144_2e-1;
    p = p * z - 3.333_328e-1;
    // (the sign copied: tanh is odd, and -0 must stay -0)
    let small = (p * z * x + x).copysign(x);
    // else: 1 - 2 / (e^{2|x|} + 1), with x's sign.
    let large = (1.0 - 2.0 / (exp(2.0 * a) + 1.0)).copysign(x);
    if a < 0.625 {
        small
    } else {
        large
    }
}

/// The largest element of `row` (`-∞` for an empty row; a NaN may be
/// skipped, as the comparisons are `x > m`).
#[inline(always)]
pub fn row_max(row: &[f32]) -> f32 {
    let mut m = [f32::NEG_INFINITY; LANES];
    let chunks = row.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for (m, &x) in m.iter_mut().zip(c) {
            *m = if x > *m { x } else { *m };
        }
    }
    let m = m.into_iter().fold(f32::NEG_INFINITY, f32::max);
    tail.iter().fold(m, |m, &x| m.max(x))
}

/// `Σ row` in `f64`: element `i` goes to lane `i % 8`, the lanes are added
/// in order at the end (a fixed order: the same bits every time).
#[inline(always)]
pub fn row_sum_f64(row: &[f32]) -> f64 {
    lane_sum_f64(row, |x| x as f64)
}

/// `Σ exp(x - m)` over `row` in `f64`: [`row_sum_f64`] of the
/// exponentials, the same bits, without storing them.
#[inline(always)]
pub fn exp_sum_f64(row: &[f32], m: f32) -> f64 {
    lane_sum_f64(row, |x| exp(x - m) as f64)
}

/// `Σ f(x)` over `row` in the lanes of [`row_sum_f64`]: element `i` to lane
/// `i % 8`, the lanes added in order at the end.
#[inline(always)]
pub fn lane_sum_f64<T: Copy>(row: &[T], f: impl Fn(T) -> f64) -> f64 {
    let mut s = [0.0f64; LANES];
    let chunks = row.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for (s, &x) in s.iter_mut().zip(c) {
            *s += f(x);
        }
    }
    for (s, &x) in s.iter_mut().zip(tail) {
        *s += f(x);
    }
    s.iter().sum()
}

/// `x ← exp(x - m)` over `row`, and their sum: [`exp_sum_f64`], the
/// exponentials left in place.
#[inline(always)]
pub fn exp_in_place_sum_f64(row: &mut [f32], m: f32) -> f64 {
    for x in row.iter_mut() {
        *x = exp(*x - m);
    }
    row_sum_f64(row)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Distance in units in the last place between `got` and the `f64`
    /// value `want` rounded to `f32`.
    fn ulps(got: f32, want: f64) -> u32 {
        let w = want as f32;
        let key = |x: f32| {
            let b = x.to_bits() as i32;
            if b < 0 {
                i32::MIN - b
            } else {
                b
            }
        };
        (key(got) as i64 - key(w) as i64).unsigned_abs() as u32
    }

    /// `n` points evenly over `[lo, hi]`.
    fn sweep(lo: f32, hi: f32, n: usize) -> impl Iterator<Item = f32> {
        (0..n).map(move |i| lo + (hi - lo) * (i as f32 / (n - 1) as f32))
    }

    #[test]
    fn exp_is_within_two_ulp_over_the_normal_range() {
        let mut worst = (0, 0.0f32);
        for x in sweep(-87.3, 88.3, 1 << 22).chain([0.0, -0.0, 1.0, -1.0, 1e-8, -1e-8]) {
            let u = ulps(exp(x), (x as f64).exp());
            if u > worst.0 {
                worst = (u, x);
            }
        }
        eprintln!("exp: worst {} ulp at {}", worst.0, worst.1);
        assert!(worst.0 <= 2, "exp: {} ulp at {}", worst.0, worst.1);
        assert_eq!(exp(0.0), 1.0);
    }

    #[test]
    fn exp_edges() {
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(-88.0), 0.0);
        assert_eq!(exp(-1e30), 0.0);
        assert_eq!(exp(89.0), f32::INFINITY);
        assert_eq!(exp(f32::INFINITY), f32::INFINITY);
        assert!(exp(f32::NAN).is_nan());
        // The last normal results on both sides.
        assert!(exp(EXP_MIN) > 0.0);
        assert!(exp(EXP_MAX).is_finite());
    }

    #[test]
    fn tanh_is_within_two_ulp() {
        let mut worst = (0, 0.0f32);
        let points = sweep(-12.0, 12.0, 1 << 22)
            .chain(sweep(-0.7, 0.7, 1 << 20))
            .chain([0.0, 1e-20, -1e-20, 1e-6, 0.625, -0.625, 9.0, 20.0, -20.0]);
        for x in points {
            let u = ulps(tanh(x), (x as f64).tanh());
            if u > worst.0 {
                worst = (u, x);
            }
        }
        eprintln!("tanh: worst {} ulp at {}", worst.0, worst.1);
        assert!(worst.0 <= 2, "tanh: {} ulp at {}", worst.0, worst.1);
        assert_eq!(tanh(0.0).to_bits(), 0.0f32.to_bits());
        assert_eq!(tanh(-0.0).to_bits(), (-0.0f32).to_bits());
        assert_eq!(tanh(f32::INFINITY), 1.0);
        assert_eq!(tanh(f32::NEG_INFINITY), -1.0);
        assert!(tanh(f32::NAN).is_nan());
    }

    #[test]
    fn exp_sums_agree_bit_for_bit() {
        for n in [0, 1, 7, 8, 9, 50257] {
            let row: Vec<f32> = (0..n)
                .map(|i| ((i * 37) % 101) as f32 * 0.3 - 15.0)
                .collect();
            let m = row_max(&row);
            let mut inplace = row.clone();
            let s = exp_in_place_sum_f64(&mut inplace, m);
            assert_eq!(exp_sum_f64(&row, m).to_bits(), s.to_bits(), "n {n}");
            assert!(inplace.iter().zip(&row).all(|(&e, &x)| e == exp(x - m)));
        }
    }

    #[test]
    fn row_reductions() {
        let row: Vec<f32> = (0..37).map(|i| ((i * 17) % 23) as f32 - 11.5).collect();
        assert_eq!(row_max(&row), 10.5);
        assert_eq!(row_max(&[]), f32::NEG_INFINITY);
        assert_eq!(row_max(&[-3.0]), -3.0);
        let exact: f64 = row.iter().map(|&x| x as f64).sum();
        assert_eq!(row_sum_f64(&row), exact); // small integers: exact in any order
        assert_eq!(row_sum_f64(&[]), 0.0);
    }
}

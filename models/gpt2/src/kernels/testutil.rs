//! Helpers for kernel unit tests: deterministic random data, closeness checks
//! and central finite differences.

pub(crate) use crate::rng::randn;

/// Asserts `|got - want| <= atol + rtol·|want|` elementwise, naming the worst element.
#[track_caller]
pub(crate) fn assert_close(got: &[f32], want: &[f32], atol: f32, rtol: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    let mut worst = (0usize, f32::NEG_INFINITY);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (g - w).abs();
        // A NaN anywhere is an infinite excess.
        let excess = if err.is_nan() {
            f32::INFINITY
        } else {
            err - (atol + rtol * w.abs())
        };
        if excess > worst.1 {
            worst = (i, excess);
        }
    }
    let (i, excess) = worst;
    assert!(
        excess <= 0.0,
        "{what}: element {i}: got {}, want {} (beyond tolerance by {excess})",
        got[i],
        want[i]
    );
}

/// Compares `analytic` (the gradient of `f` at `x`) with central differences
/// on up to 48 evenly spread coordinates.
#[track_caller]
pub(crate) fn fd_check(x: &[f32], analytic: &[f32], f: impl Fn(&[f32]) -> f64, what: &str) {
    assert_eq!(x.len(), analytic.len());
    let eps = 1e-2f32;
    let stride = x.len().div_ceil(48).max(1);
    let mut xp = x.to_vec();
    let mut max_grad = 0.0f64;
    let mut checked = 0;
    for i in (0..x.len()).step_by(stride) {
        xp[i] = x[i] + eps;
        let fp = f(&xp);
        xp[i] = x[i] - eps;
        let fm = f(&xp);
        xp[i] = x[i];
        let numeric = (fp - fm) / (2.0 * eps as f64);
        let a = analytic[i] as f64;
        max_grad = max_grad.max(a.abs());
        assert!(
            (a - numeric).abs() <= 2e-3 + 2e-2 * numeric.abs(),
            "{what}[{i}]: analytic {a}, finite difference {numeric}"
        );
        checked += 1;
    }
    assert!(checked > 0);
    assert!(
        max_grad > 1e-3,
        "{what}: gradient is (nearly) zero, the check means nothing"
    );
}

/// `(max |got - want|, max |got - want| / |want|)` over elements (the
/// relative error over elements with `|want| > 1e-3`, where it means
/// something), for reporting observed errors.
pub(crate) fn max_errors(got: &[f32], want: &[f32]) -> (f32, f32) {
    assert_eq!(got.len(), want.len());
    got.iter()
        .zip(want)
        .fold((0.0f32, 0.0f32), |(a, r), (&g, &w)| {
            let e = (g - w).abs();
            let rel = if w.abs() > 1e-3 { e / w.abs() } else { 0.0 };
            (a.max(e), r.max(rel))
        })
}

//! Softmax over the vocabulary and the cross-entropy loss.

use super::check_len;

/// `probs[bt, :] = softmax(logits[bt, :])`, numerically stable (the row
/// maximum is subtracted before `exp`).
pub fn softmax_forward(
    probs: &mut [f32], // (B, T, V)
    logits: &[f32],    // (B, T, V)
    b: usize,
    t: usize,
    v: usize,
) {
    check_len("softmax_forward", "probs", probs.len(), b * t * v);
    check_len("softmax_forward", "logits", logits.len(), b * t * v);
    for (probs_bt, logits_bt) in probs.chunks_exact_mut(v).zip(logits.chunks_exact(v)) {
        let maxval = logits_bt.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0.0f64;
        for (p, &l) in probs_bt.iter_mut().zip(logits_bt) {
            let e = (l - maxval).exp();
            *p = e;
            sum += e as f64;
        }
        let inv = (1.0 / sum) as f32;
        for p in probs_bt.iter_mut() {
            *p *= inv;
        }
    }
}

/// `losses[bt] = -ln(probs[bt, targets[bt]])`. Targets must be `< V`.
pub fn crossentropy_forward(
    losses: &mut [f32], // (B, T)
    probs: &[f32],      // (B, T, V)
    targets: &[u32],    // (B, T)
    b: usize,
    t: usize,
    v: usize,
) {
    check_len("crossentropy_forward", "losses", losses.len(), b * t);
    check_len("crossentropy_forward", "probs", probs.len(), b * t * v);
    check_len("crossentropy_forward", "targets", targets.len(), b * t);
    for ((loss, probs_bt), &tgt) in losses.iter_mut().zip(probs.chunks_exact(v)).zip(targets) {
        *loss = -probs_bt[tgt as usize].ln();
    }
}

/// The mean of the per-position losses (accumulated in `f64`).
pub fn mean_loss(losses: &[f32], // (B, T)
) -> f32 {
    let sum: f64 = losses.iter().map(|&l| l as f64).sum();
    (sum / losses.len() as f64) as f32
}

/// Backward of the mean cross-entropy through the softmax, straight to the
/// logits: `dlogits[bt, i] += (probs[bt, i] - [i == targets[bt]]) · dloss / (B·T)`.
///
/// `dloss` is the gradient of the objective with respect to the mean loss:
/// 1 for a plain step, `1 / accumulation_steps` when accumulating micro-batches.
pub fn crossentropy_softmax_backward(
    dlogits: &mut [f32], // (B, T, V)
    probs: &[f32],       // (B, T, V)
    targets: &[u32],     // (B, T)
    dloss: f32,
    b: usize,
    t: usize,
    v: usize,
) {
    check_len(
        "crossentropy_softmax_backward",
        "dlogits",
        dlogits.len(),
        b * t * v,
    );
    check_len(
        "crossentropy_softmax_backward",
        "probs",
        probs.len(),
        b * t * v,
    );
    check_len(
        "crossentropy_softmax_backward",
        "targets",
        targets.len(),
        b * t,
    );
    let d = dloss / (b * t) as f32;
    let rows = dlogits.chunks_exact_mut(v).zip(probs.chunks_exact(v));
    for ((dlogits_bt, probs_bt), &tgt) in rows.zip(targets) {
        for (dl, &p) in dlogits_bt.iter_mut().zip(probs_bt) {
            *dl += p * d;
        }
        dlogits_bt[tgt as usize] -= d;
    }
}

#[cfg(test)]
mod tests {
    use super::super::testutil::{fd_check, randn};
    use super::*;

    #[test]
    fn softmax_is_stable_for_large_logits() {
        let logits = [1000.0f32, 1000.0, -1000.0, 999.0];
        let mut probs = [0.0; 4];
        softmax_forward(&mut probs, &logits, 1, 1, 4);
        assert!(probs.iter().all(|p| p.is_finite()));
        assert!((probs.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert_eq!(probs[2], 0.0);
    }

    #[test]
    fn crossentropy_softmax_backward_matches_finite_differences() {
        let (b, t, v) = (2, 3, 7);
        let logits = randn(b * t * v, 2.0, 40);
        let targets = [0u32, 6, 3, 3, 1, 5];
        let loss_of = |logits: &[f32]| -> f64 {
            let mut probs = vec![0.0; b * t * v];
            let mut losses = vec![0.0; b * t];
            softmax_forward(&mut probs, logits, b, t, v);
            crossentropy_forward(&mut losses, &probs, &targets, b, t, v);
            // scaled so the gradient is O(1) and f32 rounding stays small
            mean_loss(&losses) as f64 * 3.0
        };
        let mut probs = vec![0.0; b * t * v];
        softmax_forward(&mut probs, &logits, b, t, v);
        let mut dlogits = vec![0.0; b * t * v];
        crossentropy_softmax_backward(&mut dlogits, &probs, &targets, 3.0, b, t, v);
        fd_check(&logits, &dlogits, loss_of, "dlogits");
    }
}

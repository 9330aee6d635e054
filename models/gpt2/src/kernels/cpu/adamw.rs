//! The optimizer: AdamW with PyTorch's semantics, and gradient-norm clipping.

use super::check_len;

/// One AdamW step over a run of parameters, `torch.optim.AdamW` semantics
/// (`amsgrad=False`, `maximize=False`), for step number `step` (1-based):
///
/// ```text
/// p -= lr · weight_decay · p              (decoupled weight decay)
/// m  = beta1 · m + (1 - beta1) · g
/// v  = beta2 · v + (1 - beta2) · g²
/// p -= lr / (1 - beta1^step) · m / (sqrt(v) / sqrt(1 - beta2^step) + eps)
/// ```
///
/// Weight decay applies to every element passed in. The reference trainer and
/// the PyTorch fixture (`scripts/make_reference.py`) decay all parameters, as
/// llm.c does; a caller that wants to exempt biases and layer norms calls this
/// per tensor with `weight_decay = 0` for those.
pub fn adamw_update(
    params: &mut [f32], // (N)
    grads: &[f32],      // (N)
    m: &mut [f32],      // (N) first moment, zero before step 1
    v: &mut [f32],      // (N) second moment, zero before step 1
    step: u64,
    lr: f32,
    beta1: f32,
    beta2: f32,
    eps: f32,
    weight_decay: f32,
) {
    let n = params.len();
    check_len("adamw_update", "grads", grads.len(), n);
    check_len("adamw_update", "m", m.len(), n);
    check_len("adamw_update", "v", v.len(), n);
    assert!(step >= 1, "adamw_update: steps are numbered from 1");
    let step = i32::try_from(step).unwrap_or(i32::MAX);
    let bias_correction1 = 1.0 - (beta1 as f64).powi(step);
    let bias_correction2_sqrt = (1.0 - (beta2 as f64).powi(step)).sqrt();
    let step_size = (lr as f64 / bias_correction1) as f32;
    let bias_correction2_sqrt = bias_correction2_sqrt as f32;
    let decay = 1.0 - lr * weight_decay;
    for (((p, &g), m), v) in params
        .iter_mut()
        .zip(grads)
        .zip(m.iter_mut())
        .zip(v.iter_mut())
    {
        *p *= decay;
        *m = beta1 * *m + (1.0 - beta1) * g;
        *v = beta2 * *v + (1.0 - beta2) * g * g;
        let denom = v.sqrt() / bias_correction2_sqrt + eps;
        *p -= step_size * *m / denom;
    }
}

/// The sum of squares of `grads`, in `f64`. Sum the partials of every bucket
/// (and rank) and take the square root for the global L2 norm.
pub fn grad_norm_sq(grads: &[f32], // (N)
) -> f64 {
    grads.iter().map(|&g| g as f64 * g as f64).sum()
}

/// The factor to multiply gradients by so their global L2 norm is at most
/// `max_norm`: `min(1, max_norm / (norm + 1e-6))`, as
/// `torch.nn.utils.clip_grad_norm_` computes it. A non-finite norm gives 1
/// (nothing sensible to scale; the caller decides whether to skip the step).
pub fn clip_scale(norm: f64, max_norm: f32) -> f32 {
    if !norm.is_finite() {
        return 1.0;
    }
    let coef = max_norm as f64 / (norm + 1e-6);
    coef.min(1.0) as f32
}

/// `x *= scale` elementwise (applies a [`clip_scale`] to gradients).
pub fn scale_in_place(
    x: &mut [f32], // (N)
    scale: f32,
) {
    if scale != 1.0 {
        for e in x {
            *e *= scale;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adamw_first_step_moves_each_parameter_by_about_lr() {
        // At step 1, m̂ = g and sqrt(v̂) = |g|, so the step is lr · sign(g).
        let mut p = vec![1.0f32, -2.0, 0.5];
        let g = [0.3f32, -0.01, 4.0];
        let (mut m, mut v) = (vec![0.0; 3], vec![0.0; 3]);
        let (lr, wd) = (0.01, 0.1);
        adamw_update(&mut p, &g, &mut m, &mut v, 1, lr, 0.9, 0.95, 1e-8, wd);
        let want = [
            1.0 * (1.0 - lr * wd) - lr,
            -2.0 * (1.0 - lr * wd) + lr,
            0.5 * (1.0 - lr * wd) - lr,
        ];
        for (a, b) in p.iter().zip(want) {
            assert!((a - b).abs() < 1e-6, "{a} vs {b}");
        }
        assert!((m[2] - 0.4).abs() < 1e-6 && (v[2] - 0.8).abs() < 1e-6);
    }

    #[test]
    fn clipping_follows_pytorch() {
        let g = [3.0f32, 4.0];
        let norm = grad_norm_sq(&g).sqrt();
        assert_eq!(norm, 5.0);
        let s = clip_scale(norm, 1.0);
        assert!((s - 0.2).abs() < 1e-6);
        assert_eq!(clip_scale(0.5, 1.0), 1.0);
        assert_eq!(clip_scale(f64::NAN, 1.0), 1.0);
    }
}

//! AdamW with PyTorch's semantics (decoupled weight decay), the optimizer's
//! update.
//!
//! The family's one home: the task [`update`], the CPU kernel
//! [`adamw_update`], its CUDA launcher [`adamw_update_cuda`] and `adamw.cu`.
//! The clip factor it may apply comes from [`super::norm`]. The mixed-precision
//! task [`update_mixed`] has a CUDA body for `f32` and bf16 storage
//! ([`adamw_update_mixed_cuda`], `adamw_update_mixed_{f32,bf16}`: compiled
//! under NVRTC, never yet run on a GPU).

use braid::cuda::KernelArgs;
use braid::{CudaTaskCtx, DevSlice, DevSliceMut, Result, TaskBuilder, TaskHandle, View};

use super::check_len;
use super::cuda_common::{by_dtype, task_result, Check, Kernel, Launcher, Program};
use super::storage::{convert, Storage};
use super::task::{submit, Task};
use crate::checkpoint::AdamWHyper;

pub(crate) static CUDA: Program = Program::new(
    "adamw.cu",
    include_str!("adamw.cu"),
    &[
        "adamw_update",
        "adamw_update_mixed_f32",
        "adamw_update_mixed_bf16",
    ],
);
static UPDATE: Kernel = Kernel::new(&CUDA, 0);
static UPDATE_MIXED_F32: Kernel = Kernel::new(&CUDA, 1);
static UPDATE_MIXED_BF16: Kernel = Kernel::new(&CUDA, 2);

// ---------------------------------------------------------------------------
// Task
// ---------------------------------------------------------------------------

/// Submits one AdamW step (step number `step`, from 1) on a run of
/// parameters and their moments as `task`. With `grad_scale`, each gradient
/// is multiplied by `grad_scale[0]` (the clip factor of
/// [`norm::clip_factor`](super::norm::clip_factor)) as it is read; `grads`
/// itself is not modified.
pub fn update(
    task: TaskBuilder<'_>,
    params: &View,             // (N)
    grads: &View,              // (N)
    m: &View,                  // (N) first moment, zero before step 1
    v: &View,                  // (N) second moment, zero before step 1
    grad_scale: Option<&View>, // (1)
    step: u64,
    h: AdamWHyper,
) -> Result<TaskHandle> {
    task.run_any(
        (
            params.read_write::<f32>(),
            grads.read::<f32>(),
            m.read_write::<f32>(),
            v.read_write::<f32>(),
            grad_scale.map(|s| s.read::<f32>()),
        ),
        move |(params, grads, m, v, scale)| {
            // The clip factor applied as the gradients are read: the same
            // products `scale_in_place` forms, into a copy.
            let scaled: Vec<f32>;
            let g = match scale {
                Some(s) if s[0] != 1.0 => {
                    scaled = grads.iter().map(|x| x * s[0]).collect();
                    &scaled[..]
                }
                _ => grads,
            };
            let AdamWHyper {
                learning_rate: lr,
                beta1,
                beta2,
                eps,
                weight_decay,
            } = h;
            adamw_update(params, g, m, v, step, lr, beta1, beta2, eps, weight_decay);
        },
        move |(params, grads, m, v, scale), cu| {
            task_result(adamw_update_cuda(
                cu,
                params,
                grads,
                m,
                v,
                scale,
                step,
                h.learning_rate,
                h.beta1,
                h.beta2,
                h.eps,
                h.weight_decay,
            ))
        },
    )
}

/// Submits one mixed-precision AdamW step as `task`:
/// [`adamw_update_mixed`] on the `f32` master weights, moments and the
/// stored gradients (times `grad_scale[0]` when given), then the stored
/// weights `params` are overwritten with the rounded master weights.
pub fn update_mixed<'rt>(
    task: impl Into<Task<'rt>>,
    params: &View,             // (N) stored weights, overwritten
    master: &View,             // (N) f32 master weights
    grads: &View,              // (N)
    m: &View,                  // (N) first moment, zero before step 1
    v: &View,                  // (N) second moment, zero before step 1
    grad_scale: Option<&View>, // (1)
    step: u64,
    h: AdamWHyper,
) -> Result<TaskHandle> {
    submit!(
        task,
        |S| (
            params.write::<S>(),
            master.read_write::<f32>(),
            grads.read::<S>(),
            m.read_write::<f32>(),
            v.read_write::<f32>(),
            grad_scale.map(|s| s.read::<f32>()),
        ),
        move |(params, master, grads, m, v, scale)| {
            adamw_update_mixed(params, master, grads, m, v, scale.map(|s| s[0]), step, h)
        },
        move |(params, master, grads, m, v, scale), cu| {
            let mixed = Mixed {
                params,
                master,
                grads,
                m,
                v,
                grad_scale: scale,
            };
            task_result(adamw_update_mixed_cuda(cu, mixed, step, h))
        },
    )
}

// ---------------------------------------------------------------------------
// CPU
// ---------------------------------------------------------------------------

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
///
/// The arithmetic is `f32`; the gradients are loaded from their storage type
/// (bf16 gradients update `f32` master weights, see [`adamw_update_mixed`]).
pub fn adamw_update<G: Storage>(
    params: &mut [f32], // (N)
    grads: &[G],        // (N)
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
    let StepScalars {
        step_size,
        bias_correction2_sqrt,
        decay,
    } = StepScalars::new(step, lr, beta1, beta2, weight_decay);
    for (((p, &g), m), v) in params
        .iter_mut()
        .zip(grads)
        .zip(m.iter_mut())
        .zip(v.iter_mut())
    {
        let g = g.load();
        *p *= decay;
        *m = beta1 * *m + (1.0 - beta1) * g;
        *v = beta2 * *v + (1.0 - beta2) * g * g;
        let denom = v.sqrt() / bias_correction2_sqrt + eps;
        *p -= step_size * *m / denom;
    }
}

/// Mixed precision (llm.c's `adamw_kernel3`): one [`adamw_update`] of the
/// `f32` master weights `master` from the stored gradients, `g · grad_scale`
/// when a clip factor is given, then `params = master` rounded to the
/// storage type (the weights the next forward pass reads).
pub fn adamw_update_mixed<S: Storage>(
    params: &mut [S],   // (N) stored weights, overwritten
    master: &mut [f32], // (N) f32 master weights
    grads: &[S],        // (N)
    m: &mut [f32],      // (N) first moment, zero before step 1
    v: &mut [f32],      // (N) second moment, zero before step 1
    grad_scale: Option<f32>,
    step: u64,
    h: AdamWHyper,
) {
    let n = master.len();
    check_len("adamw_update_mixed", "params", params.len(), n);
    check_len("adamw_update_mixed", "grads", grads.len(), n);
    let AdamWHyper {
        learning_rate: lr,
        beta1,
        beta2,
        eps,
        weight_decay,
    } = h;
    match grad_scale {
        Some(s) if s != 1.0 => {
            let g: Vec<f32> = grads.iter().map(|x| x.load() * s).collect();
            adamw_update(master, &g, m, v, step, lr, beta1, beta2, eps, weight_decay);
        }
        _ => adamw_update(
            master,
            grads,
            m,
            v,
            step,
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
        ),
    }
    convert(params, master);
}

// ---------------------------------------------------------------------------
// CUDA
// ---------------------------------------------------------------------------

/// The per-step scalars of an update, from the bias corrections computed in
/// `f64` on the host (the CPU kernel and the CUDA launcher share them).
struct StepScalars {
    /// `lr / (1 - beta1^step)`.
    step_size: f32,
    /// `sqrt(1 - beta2^step)`.
    bias_correction2_sqrt: f32,
    /// `1 - lr · weight_decay`.
    decay: f32,
}

impl StepScalars {
    fn new(step: u64, lr: f32, beta1: f32, beta2: f32, weight_decay: f32) -> StepScalars {
        let step = i32::try_from(step).unwrap_or(i32::MAX);
        let bias_correction1 = 1.0 - (beta1 as f64).powi(step);
        let bias_correction2_sqrt = (1.0 - (beta2 as f64).powi(step)).sqrt();
        StepScalars {
            step_size: (lr as f64 / bias_correction1) as f32,
            bias_correction2_sqrt: bias_correction2_sqrt as f32,
            decay: 1.0 - lr * weight_decay,
        }
    }
}

/// [`adamw_update`] on the task's stream; the bias corrections are computed
/// on the host in `f64` exactly as there. With `grad_scale`, each gradient is
/// multiplied by `grad_scale[0]` as it is read.
pub fn adamw_update_cuda(
    cu: &CudaTaskCtx<'_>,
    params: DevSliceMut<f32>,          // (N)
    grads: DevSlice<f32>,              // (N)
    m: DevSliceMut<f32>,               // (N)
    v: DevSliceMut<f32>,               // (N)
    grad_scale: Option<DevSlice<f32>>, // (1)
    step: u64,
    lr: f32,
    beta1: f32,
    beta2: f32,
    eps: f32,
    weight_decay: f32,
) -> Result<()> {
    let k = Check::new("adamw_update");
    if step == 0 {
        return Err(k.err("steps are numbered from 1".into()));
    }
    let n = params.len();
    k.exact("grads", &grads, "(N)", n)?;
    k.exact("m", &m, "(N)", n)?;
    k.exact("v", &v, "(N)", n)?;
    if let Some(s) = &grad_scale {
        k.exact("grad_scale", s, "(1)", 1)?;
    }
    if n == 0 {
        return Ok(());
    }
    let l = Launcher::new(k, cu);
    let sc = StepScalars::new(step, lr, beta1, beta2, weight_decay);
    let mut a = KernelArgs::new();
    a.ptr(params.ptr())
        .ptr(grads.ptr())
        .ptr(m.ptr())
        .ptr(v.ptr())
        .ptr(grad_scale.map_or(0, |s| s.ptr()))
        .i64(n as i64);
    a.f32(sc.step_size)
        .f32(sc.bias_correction2_sqrt)
        .f32(beta1)
        .f32(beta2)
        .f32(eps)
        .f32(sc.decay);
    // SAFETY: adamw_update(float* params, const float* grads, float* m, float*
    // v, const float* grad_scale, long long N, float step_size, float
    // bc2_sqrt, float beta1, float beta2, float eps, float decay); the four
    // arrays hold N, grad_scale 1 or null (checked).
    unsafe { l.launch(&UPDATE, l.linear(n, 256)?, &a) }
}

/// The tensors of one [`adamw_update_mixed_cuda`] call.
#[derive(Debug)]
pub struct Mixed<'a, S> {
    /// (N) stored weights, overwritten with the rounded master weights.
    pub params: DevSliceMut<'a, S>,
    /// (N) `f32` master weights.
    pub master: DevSliceMut<'a, f32>,
    /// (N) stored gradients.
    pub grads: DevSlice<'a, S>,
    /// (N) first moment, zero before step 1.
    pub m: DevSliceMut<'a, f32>,
    /// (N) second moment, zero before step 1.
    pub v: DevSliceMut<'a, f32>,
    /// (1) clip factor the gradients are multiplied by, if any.
    pub grad_scale: Option<DevSlice<'a, f32>>,
}

/// [`adamw_update_mixed`] on the task's stream, `f32` or bf16 storage: the
/// same operations in the same order (no FMA contraction, correctly rounded
/// square root and division, the bias corrections computed on the host as
/// for the CPU), so meant to be bit-identical with the CPU.
pub fn adamw_update_mixed_cuda<S: Storage>(
    cu: &CudaTaskCtx<'_>,
    t: Mixed<'_, S>,
    step: u64,
    h: AdamWHyper,
) -> Result<()> {
    let k = Check::new("adamw_update_mixed");
    if step == 0 {
        return Err(k.err("steps are numbered from 1".into()));
    }
    let n = t.master.len();
    k.exact("params", &t.params, "(N)", n)?;
    k.exact("grads", &t.grads, "(N)", n)?;
    k.exact("m", &t.m, "(N)", n)?;
    k.exact("v", &t.v, "(N)", n)?;
    if let Some(s) = &t.grad_scale {
        k.exact("grad_scale", s, "(1)", 1)?;
    }
    if n == 0 {
        return Ok(());
    }
    let l = Launcher::new(k, cu);
    let sc = StepScalars::new(step, h.learning_rate, h.beta1, h.beta2, h.weight_decay);
    let mut a = KernelArgs::new();
    a.ptr(t.params.ptr())
        .ptr(t.master.ptr())
        .ptr(t.grads.ptr())
        .ptr(t.m.ptr())
        .ptr(t.v.ptr())
        .ptr(t.grad_scale.map_or(0, |s| s.ptr()))
        .i64(n as i64);
    a.f32(sc.step_size)
        .f32(sc.bias_correction2_sqrt)
        .f32(h.beta1)
        .f32(h.beta2)
        .f32(h.eps)
        .f32(sc.decay);
    let kernel = by_dtype::<S>(&UPDATE_MIXED_F32, &UPDATE_MIXED_BF16);
    // SAFETY: adamw_update_mixed_{f32,bf16}(S* params, float* master, const
    // S* grads, float* m, float* v, const float* grad_scale, long long N,
    // float step_size, float bc2_sqrt, float beta1, float beta2, float eps,
    // float decay), S the storage type of params and grads; the five arrays
    // hold N, grad_scale 1 or null (checked).
    unsafe { l.launch(kernel, l.linear(n, 256)?, &a) }
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
}

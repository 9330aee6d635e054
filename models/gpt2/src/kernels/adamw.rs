//! AdamW with PyTorch's semantics (decoupled weight decay), the optimizer's
//! update.
//!
//! The family's one home: the task [`update`], the CPU kernel
//! [`adamw_update`], its CUDA launcher [`adamw_update_cuda`] and `adamw.cu`.
//! The clip factor it may apply comes from [`super::norm`]. The mixed-precision
//! task [`update_mixed`] has a CUDA body for `f32` and bf16 storage
//! ([`adamw_update_mixed_cuda`], `adamw_update_mixed_{f32,bf16}`).
//!
//! **Step scalars.** An update's per-step values (`lr / (1 − beta1^t)`,
//! `sqrt(1 − beta2^t)`, `1 − lr·weight_decay`) come from the step number at
//! submission ([`StepArg::Number`]) or from a buffer of three `f32`
//! ([`StepArg::Scalars`], filled with [`step_scalars`] by an ordinary task
//! before the update runs): the form a recorded step needs, since a replay
//! re-runs the update with the values its buffer holds then (docs/replay.md,
//! "Values that change from step to step live in buffers"). Both give the
//! same bits: the buffer holds what the number would have computed.

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

/// Where an update gets its per-step scalars (module docs).
#[derive(Debug, Clone, Copy)]
pub enum StepArg<'a> {
    /// Step `n`, from 1: the scalars are computed when the task is submitted.
    Number(u64),
    /// A view of three `f32`, `step_scalars(step, h)`, written before the
    /// task runs and read when it runs.
    Scalars(&'a View),
}

impl From<u64> for StepArg<'_> {
    fn from(step: u64) -> Self {
        StepArg::Number(step)
    }
}

impl<'a> StepArg<'a> {
    /// The step number (0 for a buffer) and the buffer, if any.
    fn split(self) -> (u64, Option<&'a View>) {
        match self {
            StepArg::Number(n) => (n, None),
            StepArg::Scalars(v) => (0, Some(v)),
        }
    }
}

/// The three per-step scalars of step `step` (from 1) for a
/// [`StepArg::Scalars`] buffer: `[lr / (1 − beta1^step),
/// sqrt(1 − beta2^step), 1 − lr·weight_decay]`, computed in `f64` and
/// rounded as the update computes them from a step number.
pub fn step_scalars(step: u64, h: AdamWHyper) -> [f32; 3] {
    StepScalars::for_step(step, h).to_array()
}

// ---------------------------------------------------------------------------
// Task
// ---------------------------------------------------------------------------

/// Submits one AdamW step (step number `step`, from 1) on a run of
/// parameters and their moments as `task`. With `grad_scale`, each gradient
/// is multiplied by `grad_scale[0]` (the clip factor of
/// [`norm::clip_factor`](super::norm::clip_factor)) as it is read; `grads`
/// itself is not modified.
pub fn update<'a>(
    task: TaskBuilder<'_>,
    params: &View,             // (N)
    grads: &View,              // (N)
    m: &View,                  // (N) first moment, zero before step 1
    v: &View,                  // (N) second moment, zero before step 1
    grad_scale: Option<&View>, // (1)
    step: impl Into<StepArg<'a>>,
    h: AdamWHyper,
) -> Result<TaskHandle> {
    let (step, scalars) = step.into().split();
    task.run_any(
        (
            params.read_write::<f32>(),
            grads.read::<f32>(),
            m.read_write::<f32>(),
            v.read_write::<f32>(),
            grad_scale.map(|s| s.read::<f32>()),
            scalars.map(|s| s.read::<f32>()),
        ),
        move |(params, grads, m, v, scale, scalars)| {
            // The clip factor applied as the gradients are read: the same
            // products `scale_in_place` forms.
            let s = scale.map_or(1.0, |s| s[0]);
            let sc = StepScalars::of(scalars, step, h);
            adamw_update_with(params, grads, s, m, v, &sc, h.beta1, h.beta2, h.eps);
        },
        move |(params, grads, m, v, scale, scalars), cu| {
            let t = Update {
                params,
                grads,
                m,
                v,
                grad_scale: scale,
            };
            task_result(adamw_update_cuda(cu, t, DevStep::of(scalars, step), h))
        },
    )
}

/// Submits one mixed-precision AdamW step as `task`:
/// [`adamw_update_mixed`] on the `f32` master weights, moments and the
/// stored gradients (times `grad_scale[0]` when given), then the stored
/// weights `params` are overwritten with the rounded master weights.
pub fn update_mixed<'rt, 'a>(
    task: impl Into<Task<'rt>>,
    params: &View,             // (N) stored weights, overwritten
    master: &View,             // (N) f32 master weights
    grads: &View,              // (N)
    m: &View,                  // (N) first moment, zero before step 1
    v: &View,                  // (N) second moment, zero before step 1
    grad_scale: Option<&View>, // (1)
    step: impl Into<StepArg<'a>>,
    h: AdamWHyper,
) -> Result<TaskHandle> {
    let (step, scalars) = step.into().split();
    submit!(
        task,
        |S| (
            params.write::<S>(),
            master.read_write::<f32>(),
            grads.read::<S>(),
            m.read_write::<f32>(),
            v.read_write::<f32>(),
            grad_scale.map(|s| s.read::<f32>()),
            scalars.map(|s| s.read::<f32>()),
        ),
        move |(params, master, grads, m, v, scale, scalars)| {
            let sc = StepScalars::of(scalars, step, h);
            adamw_update_mixed_with(params, master, grads, m, v, scale.map(|s| s[0]), &sc, h)
        },
        move |(params, master, grads, m, v, scale, scalars), cu| {
            let mixed = Mixed {
                params,
                master,
                grads,
                m,
                v,
                grad_scale: scale,
            };
            task_result(adamw_update_mixed_cuda(
                cu,
                mixed,
                DevStep::of(scalars, step),
                h,
            ))
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
/// the PyTorch fixture (`scripts/make_reference.py`) decay all parameters;
/// nanoGPT and llm.c exempt biases and layer norms, which
/// [`AdamW::decaying_only`](crate::optim::AdamW::decaying_only) does by
/// updating those with `weight_decay = 0`.
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
    assert!(step >= 1, "adamw_update: steps are numbered from 1");
    let sc = StepScalars::new(step, lr, beta1, beta2, weight_decay);
    adamw_update_with(params, grads, 1.0, m, v, &sc, beta1, beta2, eps);
}

/// [`adamw_update`] with its per-step scalars given, each gradient
/// multiplied by `grad_scale` (the clip factor) as it is read: the product
/// a scaled copy of the gradients would hold, without the copy (`x · 1.0`
/// is `x`, so an unclipped step computes what it did before).
#[allow(clippy::too_many_arguments)]
#[multiversion::multiversion(targets("x86_64+avx2"))]
fn adamw_update_with<G: Storage>(
    params: &mut [f32], // (N)
    grads: &[G],        // (N)
    grad_scale: f32,
    m: &mut [f32], // (N)
    v: &mut [f32], // (N)
    sc: &StepScalars,
    beta1: f32,
    beta2: f32,
    eps: f32,
) {
    let n = params.len();
    check_len("adamw_update", "grads", grads.len(), n);
    check_len("adamw_update", "m", m.len(), n);
    check_len("adamw_update", "v", v.len(), n);
    let StepScalars {
        step_size,
        bias_correction2_sqrt,
        decay,
    } = *sc;
    for (((p, &g), m), v) in params
        .iter_mut()
        .zip(grads)
        .zip(m.iter_mut())
        .zip(v.iter_mut())
    {
        let g = g.load() * grad_scale;
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
    assert!(step >= 1, "adamw_update_mixed: steps are numbered from 1");
    let sc = StepScalars::for_step(step, h);
    adamw_update_mixed_with(params, master, grads, m, v, grad_scale, &sc, h);
}

/// [`adamw_update_mixed`] with its per-step scalars given.
#[allow(clippy::too_many_arguments)]
fn adamw_update_mixed_with<S: Storage>(
    params: &mut [S],   // (N) stored weights, overwritten
    master: &mut [f32], // (N) f32 master weights
    grads: &[S],        // (N)
    m: &mut [f32],      // (N)
    v: &mut [f32],      // (N)
    grad_scale: Option<f32>,
    sc: &StepScalars,
    h: AdamWHyper,
) {
    let n = master.len();
    check_len("adamw_update_mixed", "params", params.len(), n);
    check_len("adamw_update_mixed", "grads", grads.len(), n);
    let (b1, b2, eps) = (h.beta1, h.beta2, h.eps);
    let s = grad_scale.unwrap_or(1.0);
    adamw_update_with(master, grads, s, m, v, sc, b1, b2, eps);
    convert(params, master);
}

// ---------------------------------------------------------------------------
// CUDA
// ---------------------------------------------------------------------------

/// The per-step scalars of an update, from the bias corrections computed in
/// `f64` on the host (the CPU kernel and the CUDA launcher share them).
#[derive(Debug, Clone, Copy)]
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

    /// [`new`](Self::new) with the hyper-parameters of `h`.
    fn for_step(step: u64, h: AdamWHyper) -> StepScalars {
        StepScalars::new(step, h.learning_rate, h.beta1, h.beta2, h.weight_decay)
    }

    fn to_array(self) -> [f32; 3] {
        [self.step_size, self.bias_correction2_sqrt, self.decay]
    }

    /// From a scalars buffer when the task has one (it must hold three),
    /// else from the step number (from 1).
    fn of(buffer: Option<&[f32]>, step: u64, h: AdamWHyper) -> StepScalars {
        match buffer {
            Some(b) => {
                check_len("adamw_update", "step scalars", b.len(), 3);
                StepScalars {
                    step_size: b[0],
                    bias_correction2_sqrt: b[1],
                    decay: b[2],
                }
            }
            None => {
                assert!(step >= 1, "adamw_update: steps are numbered from 1");
                StepScalars::for_step(step, h)
            }
        }
    }
}

/// Where a CUDA update gets its per-step scalars: computed on the host from
/// the step number, or read by the kernel from a device buffer of three.
#[derive(Debug)]
pub enum DevStep<'a> {
    /// Step `n`, from 1.
    Number(u64),
    /// `(3)` [`step_scalars`] in device memory.
    Scalars(DevSlice<'a, f32>),
}

impl<'a> DevStep<'a> {
    fn of(buffer: Option<DevSlice<'a, f32>>, step: u64) -> Self {
        match buffer {
            Some(b) => DevStep::Scalars(b),
            None => DevStep::Number(step),
        }
    }

    /// The kernel's `scalars` pointer (0: use the by-value scalars) and the
    /// by-value scalars (ignored by the kernel when the pointer is set).
    fn args(&self, k: &Check, h: AdamWHyper) -> Result<(u64, StepScalars)> {
        match self {
            DevStep::Number(0) => Err(k.err("steps are numbered from 1".into())),
            DevStep::Number(n) => Ok((0, StepScalars::for_step(*n, h))),
            DevStep::Scalars(b) => {
                k.exact("step scalars", b, "(3)", 3)?;
                let unused = StepScalars {
                    step_size: 0.0,
                    bias_correction2_sqrt: 1.0,
                    decay: 1.0,
                };
                Ok((b.ptr(), unused))
            }
        }
    }
}

/// The tensors of one [`adamw_update_cuda`] call.
#[derive(Debug)]
pub struct Update<'a> {
    /// (N) parameters, updated in place.
    pub params: DevSliceMut<'a, f32>,
    /// (N) gradients.
    pub grads: DevSlice<'a, f32>,
    /// (N) first moment, zero before step 1.
    pub m: DevSliceMut<'a, f32>,
    /// (N) second moment, zero before step 1.
    pub v: DevSliceMut<'a, f32>,
    /// (1) clip factor the gradients are multiplied by, if any.
    pub grad_scale: Option<DevSlice<'a, f32>>,
}

/// [`adamw_update`] on the task's stream; the bias corrections are computed
/// on the host in `f64` exactly as there, or read from a scalars buffer
/// ([`DevStep`]). With `grad_scale`, each gradient is multiplied by
/// `grad_scale[0]` as it is read.
pub fn adamw_update_cuda(
    cu: &CudaTaskCtx<'_>,
    t: Update<'_>,
    step: DevStep<'_>,
    h: AdamWHyper,
) -> Result<()> {
    let k = Check::new("adamw_update");
    let (scalars, sc) = step.args(&k, h)?;
    let n = t.params.len();
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
    let mut a = KernelArgs::new();
    a.ptr(t.params.ptr())
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
        .f32(sc.decay)
        .ptr(scalars);
    // SAFETY: adamw_update(float* params, const float* grads, float* m, float*
    // v, const float* grad_scale, long long N, float step_size, float
    // bc2_sqrt, float beta1, float beta2, float eps, float decay, const
    // float* scalars); the four arrays hold N, grad_scale 1 or null, scalars
    // 3 or null (checked).
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
    step: DevStep<'_>,
    h: AdamWHyper,
) -> Result<()> {
    let k = Check::new("adamw_update_mixed");
    let (scalars, sc) = step.args(&k, h)?;
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
        .f32(sc.decay)
        .ptr(scalars);
    let kernel = by_dtype::<S>(&UPDATE_MIXED_F32, &UPDATE_MIXED_BF16);
    // SAFETY: adamw_update_mixed_{f32,bf16}(S* params, float* master, const
    // S* grads, float* m, float* v, const float* grad_scale, long long N,
    // float step_size, float bc2_sqrt, float beta1, float beta2, float eps,
    // float decay, const float* scalars), S the storage type of params and
    // grads; the five arrays hold N, grad_scale 1 or null, scalars 3 or
    // null (checked).
    unsafe { l.launch(kernel, l.linear(n.div_ceil(MIXED_PER_THREAD), 256)?, &a) }
}

/// Elements of a mixed-precision update kernel's thread (`ADAMW_PER` in
/// adamw.cu: vector loads where aligned).
const MIXED_PER_THREAD: usize = 4;

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

//! Global-norm gradient clipping (PyTorch's `clip_grad_norm_`): the sum of
//! squares of a run of gradients, the clip factor from the partial sums, and
//! scaling.
//!
//! The family's one home: the tasks [`sum_squares`], [`clip_factor`],
//! [`scale`] and [`scale_by`], the CPU kernels ([`grad_norm_sq`],
//! [`global_norm`], [`clip_scale`], [`scale_in_place`]), their CUDA
//! launchers and `norm.cu`. On CUDA the norm is two kernels into device
//! memory ([`grad_norm_sq_partial_cuda`], [`grad_norm_sq_finalize_cuda`])
//! and the clip factor stays on the device, so clipping needs no host
//! synchronisation. [`sum_squares`], [`scale`] and [`scale_by`] have a CUDA
//! body for bf16 gradients too (the `*_bf16` kernels).

use braid::cuda::{KernelArgs, LaunchConfig};
use braid::{CudaTaskCtx, DevSlice, DevSliceMut, Result, TaskBuilder, TaskHandle, View};

use super::cuda_common::{by_dtype, task_result, Check, Kernel, Launcher, Program};
use super::fastmath;
use super::storage::Storage;
use super::task::{submit, Task};

pub(crate) static CUDA: Program = Program::new(
    "norm.cu",
    include_str!("norm.cu"),
    &[
        "grad_norm_sq_partial",
        "grad_norm_sq_finalize",
        "grad_clip_scale",
        "scale_inplace",
        "scale_inplace_dev",
        "grad_norm_sq_partial_bf16",
        "scale_inplace_bf16",
        "scale_inplace_dev_bf16",
    ],
);
static NORM_SQ_PARTIAL: Kernel = Kernel::new(&CUDA, 0);
static NORM_SQ_FINALIZE: Kernel = Kernel::new(&CUDA, 1);
static CLIP_SCALE: Kernel = Kernel::new(&CUDA, 2);
static SCALE_INPLACE: Kernel = Kernel::new(&CUDA, 3);
static SCALE_INPLACE_DEV: Kernel = Kernel::new(&CUDA, 4);
static NORM_SQ_PARTIAL_BF16: Kernel = Kernel::new(&CUDA, 5);
static SCALE_INPLACE_BF16: Kernel = Kernel::new(&CUDA, 6);
static SCALE_INPLACE_DEV_BF16: Kernel = Kernel::new(&CUDA, 7);

// ---------------------------------------------------------------------------
// Tasks
// ---------------------------------------------------------------------------

/// Submits `partial[0] = Σ grads²` (in `f64`) as `task`.
///
/// `scratch`: `f64` partial sums of the CUDA reduction (declared `write`,
/// unused on the CPU); its length fixes the reduction's grid, hence its
/// summation order: keep it the same from step to step (e.g.
/// [`GRAD_NORM_PARTIALS`]).
pub fn sum_squares<'rt>(
    task: impl Into<Task<'rt>>,
    partial: &View, // (1) f64
    scratch: &View, // (P) f64
    grads: &View,   // (N)
) -> Result<TaskHandle> {
    submit!(
        task,
        |S| (
            partial.write::<f64>(),
            scratch.write::<f64>(),
            grads.read::<S>(),
        ),
        |(partial, _scratch, grads)| partial[0] = grad_norm_sq(grads),
        |(partial, scratch, grads), cu| task_result(grad_norm_sq_cuda(cu, partial, scratch, grads)),
    )
}

/// Submits `scale[0] = min(1, max_norm / (sqrt(Σ partials) + 1e-6))` as
/// `task`: the clip factor of the global norm, the partials summed in order.
pub fn clip_factor(
    task: TaskBuilder<'_>,
    scale: &View,    // (1) f32
    partials: &View, // (K) f64
    max_norm: f32,
) -> Result<TaskHandle> {
    task.run_any(
        (scale.write::<f32>(), partials.read::<f64>()),
        move |(scale, partials)| scale[0] = clip_scale(global_norm(partials), max_norm),
        move |(scale, partials), cu| {
            task_result(grad_clip_scale_cuda(cu, scale, partials, max_norm))
        },
    )
}

/// Submits `x *= s` (a host scalar; nothing to do when `s == 1`) as `task`.
pub fn scale<'rt>(
    task: impl Into<Task<'rt>>,
    x: &View, // (N)
    s: f32,
) -> Result<TaskHandle> {
    submit!(
        task,
        |S| x.read_write::<S>(),
        move |x| scale_in_place(x, s),
        move |x, cu| task_result(scale_in_place_cuda(cu, x, s)),
    )
}

/// Submits `x *= scale[0]` (a factor computed by an earlier task, e.g.
/// [`clip_factor`]) as `task`.
pub fn scale_by<'rt>(
    task: impl Into<Task<'rt>>,
    x: &View,     // (N)
    scale: &View, // (1) f32
) -> Result<TaskHandle> {
    submit!(
        task,
        |S| (x.read_write::<S>(), scale.read::<f32>()),
        |(x, s)| scale_in_place(x, s[0]),
        |(x, s), cu| task_result(scale_in_place_by_cuda(cu, x, s)),
    )
}

// ---------------------------------------------------------------------------
// CPU
// ---------------------------------------------------------------------------

/// The sum of squares of `grads`, in `f64` (whatever their storage). Sum the
/// partials of every bucket (and rank) and take the square root for the
/// global L2 norm.
///
/// Summed in the lanes of [`fastmath::lane_sum_f64`]: a fixed order (the
/// same bits every time), and eight independent chains of adds that
/// vectorise, where one running total waited for each add in turn.
#[multiversion::multiversion(targets("x86_64+avx2"))]
pub fn grad_norm_sq<S: Storage>(grads: &[S], // (N)
) -> f64 {
    fastmath::lane_sum_f64(grads, |g| {
        let g = g.load() as f64;
        g * g
    })
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

/// The global L2 norm from per-chunk sums of squares, added in chunk order.
pub fn global_norm(partials: &[f64], // (K)
) -> f64 {
    partials.iter().sum::<f64>().sqrt()
}

/// `x *= scale` elementwise (applies a [`clip_scale`] to gradients).
pub fn scale_in_place<S: Storage>(
    x: &mut [S], // (N)
    scale: f32,
) {
    if scale != 1.0 {
        for e in x {
            *e = S::store(e.load() * scale);
        }
    }
}

// ---------------------------------------------------------------------------
// CUDA
// ---------------------------------------------------------------------------

/// A good number of gradient-norm partials ([`grad_norm_sq_partial_cuda`]'s
/// grid): enough blocks of 512 threads to fill a large GPU. Keep the count
/// fixed from step to step: the norm's summation order depends on it.
pub const GRAD_NORM_PARTIALS: usize = 512;

/// Stage 1 of the squared L2 norm: `partials[p]` = the sum of `g²` (in `f64`)
/// over the elements block `p` visits, for `P = partials.len()` blocks;
/// `f32` or bf16 gradients (each loaded exactly, the same order).
pub fn grad_norm_sq_partial_cuda<S: Storage>(
    cu: &CudaTaskCtx<'_>,
    partials: DevSliceMut<f64>, // (P)
    grads: DevSlice<S>,         // (N)
) -> Result<()> {
    let k = Check::new("grad_norm_sq_partial");
    let p = partials.len();
    k.dim("P", p)?;
    let l = Launcher::new(k, cu);
    let mut a = KernelArgs::new();
    a.ptr(partials.ptr())
        .ptr(grads.ptr())
        .i64(grads.len() as i64);
    let kernel = by_dtype::<S>(&NORM_SQ_PARTIAL, &NORM_SQ_PARTIAL_BF16);
    // SAFETY: grad_norm_sq_partial[_bf16](double* partials, const S* grads,
    // long long N), S the storage type of grads, writes partials[blockIdx.x]
    // for P blocks; grads holds N.
    unsafe { l.launch(kernel, LaunchConfig::grid_block(l.grid(p)?, 512), &a) }
}

/// Stage 2: `out[0] = Σ partials` (fixed order).
pub fn grad_norm_sq_finalize_cuda(
    cu: &CudaTaskCtx<'_>,
    out: DevSliceMut<f64>,   // (1)
    partials: DevSlice<f64>, // (P)
) -> Result<()> {
    let k = Check::new("grad_norm_sq_finalize");
    k.exact("out", &out, "(1)", 1)?;
    let pi = k.dim("P", partials.len())?;
    let l = Launcher::new(k, cu);
    let mut a = KernelArgs::new();
    a.ptr(out.ptr()).ptr(partials.ptr()).i32(pi);
    // SAFETY: grad_norm_sq_finalize(double* out, const double* partials, int
    // P); out (1), partials (P) (checked).
    unsafe { l.launch(&NORM_SQ_FINALIZE, LaunchConfig::grid_block(1, 1024), &a) }
}

/// `out[0] = Σ grads²` in `f64`: [`grad_norm_sq_partial_cuda`] into
/// `partials` (scratch, e.g. [`GRAD_NORM_PARTIALS`] long) then
/// [`grad_norm_sq_finalize_cuda`]. The device counterpart of
/// [`grad_norm_sq`].
pub fn grad_norm_sq_cuda<S: Storage>(
    cu: &CudaTaskCtx<'_>,
    out: DevSliceMut<f64>,      // (1)
    partials: DevSliceMut<f64>, // (P) scratch
    grads: DevSlice<S>,         // (N)
) -> Result<()> {
    grad_norm_sq_partial_cuda(cu, partials, grads)?;
    grad_norm_sq_finalize_cuda(cu, out, partials.as_read())
}

/// `scale[0] = min(1, max_norm / (sqrt(Σ_k norm_sq[k]) + 1e-6))`, 1 when the
/// norm is not finite: [`clip_scale`] of the [`global_norm`], on the device.
pub fn grad_clip_scale_cuda(
    cu: &CudaTaskCtx<'_>,
    scale: DevSliceMut<f32>, // (1)
    norm_sq: DevSlice<f64>,  // (K)
    max_norm: f32,
) -> Result<()> {
    let k = Check::new("grad_clip_scale");
    k.exact("scale", &scale, "(1)", 1)?;
    let ki = k.dim("K", norm_sq.len())?;
    let l = Launcher::new(k, cu);
    let mut a = KernelArgs::new();
    a.ptr(scale.ptr()).ptr(norm_sq.ptr()).i32(ki).f32(max_norm);
    // SAFETY: grad_clip_scale(float* scale, const double* norm_sq, int K,
    // float max_norm); scale (1), norm_sq (K) (checked).
    unsafe { l.launch(&CLIP_SCALE, LaunchConfig::grid_block(1, 1), &a) }
}

/// [`scale_in_place`] on the task's stream: `x *= scale`; nothing is
/// launched when `scale == 1` (as on the CPU). `f32` or bf16 storage;
/// bit-exact with the CPU.
pub fn scale_in_place_cuda<S: Storage>(
    cu: &CudaTaskCtx<'_>,
    x: DevSliceMut<S>, // (N)
    scale: f32,
) -> Result<()> {
    let n = x.len();
    if n == 0 || scale == 1.0 {
        return Ok(());
    }
    let l = Launcher::new(Check::new("scale_in_place"), cu);
    let mut a = KernelArgs::new();
    a.ptr(x.ptr()).i64(n as i64).f32(scale);
    let kernel = by_dtype::<S>(&SCALE_INPLACE, &SCALE_INPLACE_BF16);
    // SAFETY: scale_inplace[_bf16](S* x, long long N, float s), S the
    // storage type of x; x holds N.
    unsafe { l.launch(kernel, l.linear(n, 256)?, &a) }
}

/// `x *= scale[0]` with the factor read on the device (e.g. from
/// [`grad_clip_scale_cuda`]): clipping without a host synchronisation.
/// `f32` or bf16 storage; bit-exact with the CPU (a factor of exactly 1
/// rewrites every element unchanged, where the CPU skips the loop).
pub fn scale_in_place_by_cuda<S: Storage>(
    cu: &CudaTaskCtx<'_>,
    x: DevSliceMut<S>,    // (N)
    scale: DevSlice<f32>, // (1)
) -> Result<()> {
    let k = Check::new("scale_in_place_dev");
    k.exact("scale", &scale, "(1)", 1)?;
    let n = x.len();
    if n == 0 {
        return Ok(());
    }
    let l = Launcher::new(k, cu);
    let mut a = KernelArgs::new();
    a.ptr(x.ptr()).i64(n as i64).ptr(scale.ptr());
    let kernel = by_dtype::<S>(&SCALE_INPLACE_DEV, &SCALE_INPLACE_DEV_BF16);
    // SAFETY: scale_inplace_dev[_bf16](S* x, long long N, const float* s), S
    // the storage type of x; x holds N, s one float (checked).
    unsafe { l.launch(kernel, l.linear(n, 256)?, &a) }
}

#[cfg(test)]
mod tests {
    use super::*;

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

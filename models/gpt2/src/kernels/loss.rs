//! Softmax over the vocabulary and the cross-entropy loss.
//!
//! The family's one home: the tasks [`softmax`], [`softmax_crossentropy`],
//! [`mean`] and [`backward`], the CPU kernels ([`softmax_forward`],
//! [`crossentropy_forward`], [`mean_loss`], [`crossentropy_softmax_backward`]),
//! their CUDA launchers and `loss.cu`. On CUDA the softmax and the loss are
//! one fused kernel ([`softmax_crossentropy_forward_cuda`]); there is no
//! stand-alone cross-entropy launcher. Rows are `n = B·T` positions of a
//! vocabulary of `v`, stored `vp >= v` elements apart (the model pads its
//! logits rows to [`Gpt2Config::padded_vocab`](crate::config::Gpt2Config::padded_vocab);
//! the reference's are dense, `vp = v`). Columns `v..vp` are neither read
//! nor written.
//!
//! [`softmax`], [`softmax_crossentropy`] and [`backward`] have a CUDA body
//! for bf16 `probs`/`logits`/`dlogits` too (the `*_bf16` kernels); losses stay `f32`, and a loss is
//! computed from the target's `f32` probability before it is rounded, as on
//! the CPU.
//!
//! # Target ids
//!
//! The fused CUDA kernel reads `probs` at the target ids it finds on the
//! device, unchecked, so [`softmax_crossentropy`] and its launcher are
//! `unsafe` with the contract "every id is below `V`" (validate on the host
//! with [`check_tokens`](super::check_tokens) before upload). The backward
//! kernel only compares ids with column indices and is safe.

use braid::cuda::{KernelArgs, LaunchConfig};
use braid::{CudaTaskCtx, DevSlice, DevSliceMut, Result, TaskHandle, View};

use super::cuda_common::{by_dtype, task_result, Check, Kernel, Launcher, Program};
use super::fastmath;
use super::storage::Storage;
use super::task::{submit, Task};
use super::{check_len, check_stride};

pub(crate) static CUDA: Program = Program::new(
    "loss.cu",
    include_str!("loss.cu"),
    &[
        "softmax_crossentropy_forward",
        "crossentropy_softmax_backward",
        "loss_mean",
        "softmax_crossentropy_forward_bf16",
        "crossentropy_softmax_backward_bf16",
        // The fused classifier's (launched from fused_classifier.rs; here
        // for the block reductions it shares).
        "fused_classifier",
        "fused_classifier_bf16",
    ],
);
static SOFTMAX_CROSSENTROPY_FORWARD: Kernel = Kernel::new(&CUDA, 0);
static CROSSENTROPY_SOFTMAX_BACKWARD: Kernel = Kernel::new(&CUDA, 1);
static LOSS_MEAN: Kernel = Kernel::new(&CUDA, 2);
static SOFTMAX_CROSSENTROPY_FORWARD_BF16: Kernel = Kernel::new(&CUDA, 3);
static CROSSENTROPY_SOFTMAX_BACKWARD_BF16: Kernel = Kernel::new(&CUDA, 4);

// ---------------------------------------------------------------------------
// Tasks
// ---------------------------------------------------------------------------

/// Submits `probs = softmax(logits)` (over each row of `v`) as `task`.
pub fn softmax<'rt>(
    task: impl Into<Task<'rt>>,
    probs: &View,  // (N, Vp)
    logits: &View, // (N, Vp)
    n: usize,
    v: usize,
    vp: usize,
) -> Result<TaskHandle> {
    submit!(
        task,
        |S| (probs.write::<S>(), logits.read::<S>()),
        move |(probs, logits)| softmax_forward(probs, logits, 1, n, v, vp),
        move |(probs, logits), cu| {
            task_result(softmax_forward_cuda(cu, probs, logits, n, v, vp))
        },
    )
}

/// Submits `probs = softmax(logits); losses = -ln probs[targets]` as one
/// `task` (the two CPU kernels in turn; one fused kernel on CUDA).
///
/// # Safety
/// When the task runs, every id in `targets` is below `v` (module docs).
pub unsafe fn softmax_crossentropy<'rt>(
    task: impl Into<Task<'rt>>,
    probs: &View,   // (N, Vp)
    losses: &View,  // (N)
    logits: &View,  // (N, Vp)
    targets: &View, // (N) u32, each < V
    n: usize,
    v: usize,
    vp: usize,
) -> Result<TaskHandle> {
    submit!(
        task,
        |S| (
            probs.write::<S>(),
            losses.write::<f32>(),
            logits.read::<S>(),
            targets.read::<u32>(),
        ),
        move |(probs, losses, logits, targets)| {
            softmax_crossentropy_forward(probs, losses, logits, targets, 1, n, v, vp)
        },
        move |(probs, losses, logits, targets), cu| {
            // SAFETY: the ids are below V, this function's contract.
            task_result(unsafe {
                softmax_crossentropy_forward_cuda(cu, probs, losses, logits, targets, n, v, vp)
            })
        },
    )
}

/// Submits `loss[0] = mean(losses)` (accumulated in `f64`) as `task`.
///
/// The losses are `f32` whatever the storage type, so the task's dtype does
/// not matter.
pub fn mean<'rt>(
    task: impl Into<Task<'rt>>,
    loss: &View,   // (1)
    losses: &View, // (N)
) -> Result<TaskHandle> {
    task.into().builder.run_any(
        (loss.write::<f32>(), losses.read::<f32>()),
        |(loss, losses)| loss[0] = mean_loss(losses),
        |(loss, losses), cu| task_result(mean_loss_cuda(cu, loss, losses)),
    )
}

/// Submits the backward pass of the mean loss through the softmax as
/// `task`: `dlogits += (probs - onehot(targets)) · dloss / N`.
pub fn backward<'rt>(
    task: impl Into<Task<'rt>>,
    dlogits: &View, // (N, Vp) accumulated
    probs: &View,   // (N, Vp)
    targets: &View, // (N) u32
    dloss: f32,
    n: usize,
    v: usize,
    vp: usize,
) -> Result<TaskHandle> {
    submit!(
        task,
        |S| (
            dlogits.read_write::<S>(),
            probs.read::<S>(),
            targets.read::<u32>(),
        ),
        move |(dlogits, probs, targets)| {
            crossentropy_softmax_backward(dlogits, probs, targets, dloss, 1, n, v, vp)
        },
        move |(dlogits, probs, targets), cu| {
            task_result(crossentropy_softmax_backward_cuda(
                cu, dlogits, probs, targets, dloss, n, v, vp,
            ))
        },
    )
}

// ---------------------------------------------------------------------------
// CPU
// ---------------------------------------------------------------------------

/// `probs[bt, :] = softmax(logits[bt, :])`, numerically stable (the row
/// maximum is subtracted before `exp`). Computed in `f32` (the sum in `f64`);
/// a bf16 row is rounded once.
pub fn softmax_forward<S: Storage>(
    probs: &mut [S], // (B, T, Vp)
    logits: &[S],    // (B, T, Vp)
    b: usize,
    t: usize,
    v: usize,
    vp: usize,
) {
    let n = b * t;
    check_stride("softmax_forward", ("V", v), ("Vp", vp));
    check_len("softmax_forward", "probs", probs.len(), n * vp);
    check_len("softmax_forward", "logits", logits.len(), n * vp);
    for (probs_bt, logits_bt) in probs.chunks_exact_mut(vp).zip(logits.chunks_exact(vp)) {
        S::update_f32(&mut probs_bt[..v], |probs_bt| {
            softmax_row(probs_bt, &logits_bt[..v])
        });
    }
}

/// One row of [`softmax_forward`], into `f32`.
/// (Dispatched per row: called through `update_f32`'s closure, the row
/// would not inherit its caller's AVX2 code.)
#[multiversion::multiversion(targets("x86_64+avx2"))]
fn softmax_row<S: Storage>(
    probs_bt: &mut [f32], // (V)
    logits_bt: &[S],      // (V)
) {
    // The row widened into the output, its max, the exponentials in place
    // and their f64 sum (`fastmath`: vectorised passes over a row in cache).
    for (p, &l) in probs_bt.iter_mut().zip(logits_bt) {
        *p = l.load();
    }
    let maxval = fastmath::row_max(probs_bt);
    let sum = fastmath::exp_in_place_sum_f64(probs_bt, maxval);
    let inv = (1.0 / sum) as f32;
    for p in probs_bt.iter_mut() {
        *p *= inv;
    }
}

/// `losses[bt] = -ln(probs[bt, targets[bt]])`. Targets must be `< V`.
pub fn crossentropy_forward<S: Storage>(
    losses: &mut [f32], // (B, T)
    probs: &[S],        // (B, T, Vp)
    targets: &[u32],    // (B, T)
    b: usize,
    t: usize,
    v: usize,
    vp: usize,
) {
    check_stride("crossentropy_forward", ("V", v), ("Vp", vp));
    check_len("crossentropy_forward", "losses", losses.len(), b * t);
    check_len("crossentropy_forward", "probs", probs.len(), b * t * vp);
    check_len("crossentropy_forward", "targets", targets.len(), b * t);
    for ((loss, probs_bt), &tgt) in losses.iter_mut().zip(probs.chunks_exact(vp)).zip(targets) {
        *loss = -probs_bt[..v][tgt as usize].load().ln();
    }
}

/// [`softmax_forward`] and [`crossentropy_forward`] in one pass: the loss is
/// taken from the `f32` probabilities before they are stored, so with bf16
/// storage it is the loss of the `f32` softmax of the (bf16) logits, not of
/// the rounded probabilities (PyTorch autocast computes `cross_entropy` in
/// `f32` the same way). With `f32` storage it is exactly the two kernels in
/// turn. Targets must be `< V`.
pub fn softmax_crossentropy_forward<S: Storage>(
    probs: &mut [S],    // (B, T, Vp)
    losses: &mut [f32], // (B, T)
    logits: &[S],       // (B, T, Vp)
    targets: &[u32],    // (B, T)
    b: usize,
    t: usize,
    v: usize,
    vp: usize,
) {
    let (name, n) = ("softmax_crossentropy_forward", b * t);
    check_stride(name, ("V", v), ("Vp", vp));
    check_len(name, "probs", probs.len(), n * vp);
    check_len(name, "losses", losses.len(), n);
    check_len(name, "logits", logits.len(), n * vp);
    check_len(name, "targets", targets.len(), n);
    let rows = probs.chunks_exact_mut(vp).zip(logits.chunks_exact(vp));
    for ((probs_bt, logits_bt), (loss, &tgt)) in rows.zip(losses.iter_mut().zip(targets)) {
        S::update_f32(&mut probs_bt[..v], |probs_bt| {
            softmax_row(probs_bt, &logits_bt[..v]);
            *loss = -probs_bt[tgt as usize].ln();
        });
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
#[multiversion::multiversion(targets("x86_64+avx2"))]
pub fn crossentropy_softmax_backward<S: Storage>(
    dlogits: &mut [S], // (B, T, Vp)
    probs: &[S],       // (B, T, Vp)
    targets: &[u32],   // (B, T)
    dloss: f32,
    b: usize,
    t: usize,
    v: usize,
    vp: usize,
) {
    let (name, n) = ("crossentropy_softmax_backward", b * t);
    check_stride(name, ("V", v), ("Vp", vp));
    check_len(name, "dlogits", dlogits.len(), n * vp);
    check_len(name, "probs", probs.len(), n * vp);
    check_len(name, "targets", targets.len(), n);
    let d = dloss / n as f32;
    let rows = dlogits.chunks_exact_mut(vp).zip(probs.chunks_exact(vp));
    for ((dlogits_bt, probs_bt), &tgt) in rows.zip(targets) {
        // A bf16 row is rounded once, after the target's `- d`.
        S::update_f32(&mut dlogits_bt[..v], |dlogits_bt| {
            for (dl, &p) in dlogits_bt.iter_mut().zip(&probs_bt[..v]) {
                *dl += p.load() * d;
            }
            dlogits_bt[tgt as usize] -= d;
        });
    }
}

// ---------------------------------------------------------------------------
// CUDA
// ---------------------------------------------------------------------------

/// Threads per row of the softmax kernel (one block per row).
pub(crate) const SOFTMAX_BLOCK: u32 = 1024;

/// [`softmax_forward`] on the task's stream (row max subtracted; sums in
/// `f32` block trees).
pub fn softmax_forward_cuda<S: Storage>(
    cu: &CudaTaskCtx<'_>,
    probs: DevSliceMut<S>, // (N, Vp)
    logits: DevSlice<S>,   // (N, Vp)
    n: usize,
    v: usize,
    vp: usize,
) -> Result<()> {
    let k = Check::new("softmax_forward");
    let (ni, vi, vpi) = row_dims(&k, n, v, vp)?;
    let nv = k.mul(n, vp)?;
    k.exact("probs", &probs, "(N, Vp)", nv)?;
    k.exact("logits", &logits, "(N, Vp)", nv)?;
    let l = Launcher::new(k, cu);
    // SAFETY: null losses and targets (the kernel then skips the loss);
    // probs, logits (N, Vp), V <= Vp (checked).
    unsafe { launch_softmax_crossentropy::<S>(&l, probs.ptr(), 0, logits.ptr(), 0, [ni, vi, vpi]) }
}

/// `N`, `V` and `Vp` as the kernels' `int`s, `V <= Vp` checked (the loss
/// launchers' and the fused classifier's).
pub(crate) fn row_dims(k: &Check, n: usize, v: usize, vp: usize) -> Result<(i32, i32, i32)> {
    Ok((k.dim("N", n)?, k.dim("V", v)?, k.stride("Vp", vp, "V", v)?))
}

/// [`softmax_forward`] then [`crossentropy_forward`], in one kernel on the
/// task's stream.
///
/// # Safety
/// Every id in `targets` must be below `V`: the kernel reads `probs` at the
/// ids it finds on the device.
pub unsafe fn softmax_crossentropy_forward_cuda<S: Storage>(
    cu: &CudaTaskCtx<'_>,
    probs: DevSliceMut<S>,    // (N, Vp)
    losses: DevSliceMut<f32>, // (N)
    logits: DevSlice<S>,      // (N, Vp)
    targets: DevSlice<u32>,   // (N), each < V
    n: usize,
    v: usize,
    vp: usize,
) -> Result<()> {
    let k = Check::new("softmax_crossentropy_forward");
    let dims = row_dims(&k, n, v, vp)?;
    let nv = k.mul(n, vp)?;
    k.exact("probs", &probs, "(N, Vp)", nv)?;
    k.exact("losses", &losses, "(N)", n)?;
    k.exact("logits", &logits, "(N, Vp)", nv)?;
    k.exact("targets", &targets, "(N)", n)?;
    let l = Launcher::new(k, cu);
    // SAFETY: buffers checked; the row of probs is indexed by targets < V
    // (the caller's contract).
    unsafe {
        launch_softmax_crossentropy::<S>(
            &l,
            probs.ptr(),
            losses.ptr(),
            logits.ptr(),
            targets.ptr(),
            [dims.0, dims.1, dims.2],
        )
    }
}

/// Queues `softmax_crossentropy_forward`, one block of [`SOFTMAX_BLOCK`]
/// threads per row.
///
/// # Safety
/// The arguments match `softmax_crossentropy_forward(float* probs, float*
/// losses, const float* logits, const uint* targets, int N, int V, int
/// Vp)` (`[n, v, vp]`): `probs` and `logits` address `(N, Vp)` with
/// `V <= Vp`, `losses` and `targets` `(N)` or are both null (the kernel then
/// skips the loss), and every target is below `V`.
unsafe fn launch_softmax_crossentropy<S: Storage>(
    l: &Launcher<'_>,
    probs: u64,
    losses: u64,
    logits: u64,
    targets: u64,
    [n, v, vp]: [i32; 3],
) -> Result<()> {
    let mut a = KernelArgs::new();
    a.ptr(probs)
        .ptr(losses)
        .ptr(logits)
        .ptr(targets)
        .i32(n)
        .i32(v)
        .i32(vp);
    let cfg = LaunchConfig::grid_block(l.grid(n as usize)?, SOFTMAX_BLOCK);
    let kernel = by_dtype::<S>(
        &SOFTMAX_CROSSENTROPY_FORWARD,
        &SOFTMAX_CROSSENTROPY_FORWARD_BF16,
    );
    // SAFETY: the caller's contract (probs and logits stored as S).
    unsafe { l.launch(kernel, cfg, &a) }
}

/// [`mean_loss`] on the task's stream, accumulated in `f64`, written to
/// `loss[0]`.
pub fn mean_loss_cuda(
    cu: &CudaTaskCtx<'_>,
    loss: DevSliceMut<f32>, // (1)
    losses: DevSlice<f32>,  // (N)
) -> Result<()> {
    let k = Check::new("mean_loss");
    k.exact("loss", &loss, "(1)", 1)?;
    let ni = k.dim("N", losses.len())?;
    let l = Launcher::new(k, cu);
    let mut a = KernelArgs::new();
    a.ptr(loss.ptr()).ptr(losses.ptr()).i32(ni);
    // SAFETY: loss_mean(float* out, const float* losses, int N); out (1),
    // losses (N) (checked).
    unsafe { l.launch(&LOSS_MEAN, LaunchConfig::grid_block(1, 1024), &a) }
}

/// [`crossentropy_softmax_backward`] on the task's stream. Safe for any
/// target id: ids are only compared, never used as addresses.
pub fn crossentropy_softmax_backward_cuda<S: Storage>(
    cu: &CudaTaskCtx<'_>,
    dlogits: DevSliceMut<S>, // (N, Vp) accumulated
    probs: DevSlice<S>,      // (N, Vp)
    targets: DevSlice<u32>,  // (N)
    dloss: f32,
    n: usize,
    v: usize,
    vp: usize,
) -> Result<()> {
    let k = Check::new("crossentropy_softmax_backward");
    let (ni, vi, vpi) = row_dims(&k, n, v, vp)?;
    let (nv, nvp) = (k.mul(n, v)?, k.mul(n, vp)?);
    k.exact("dlogits", &dlogits, "(N, Vp)", nvp)?;
    k.exact("probs", &probs, "(N, Vp)", nvp)?;
    k.exact("targets", &targets, "(N)", n)?;
    let l = Launcher::new(k, cu);
    // The CPU kernel's scalar, computed the same way.
    let d = dloss / n as f32;
    let mut a = KernelArgs::new();
    a.ptr(dlogits.ptr())
        .ptr(probs.ptr())
        .ptr(targets.ptr())
        .f32(d)
        .i32(ni)
        .i32(vi)
        .i32(vpi);
    let kernel = by_dtype::<S>(
        &CROSSENTROPY_SOFTMAX_BACKWARD,
        &CROSSENTROPY_SOFTMAX_BACKWARD_BF16,
    );
    // SAFETY: crossentropy_softmax_backward[_bf16](S* dlogits, const S*
    // probs, const uint* targets, float d, int N, int V, int Vp), S the
    // storage type of dlogits and probs; buffers (N, Vp) with V <= Vp
    // checked; targets are compared with column indices only.
    unsafe { l.launch(kernel, l.linear(nv, 256)?, &a) }
}

#[cfg(test)]
mod tests {
    use super::super::testutil::{fd_check, randn};
    use super::*;

    #[test]
    fn softmax_is_stable_for_large_logits() {
        let logits = [1000.0f32, 1000.0, -1000.0, 999.0];
        let mut probs = [0.0; 4];
        softmax_forward(&mut probs, &logits, 1, 1, 4, 4);
        assert!(probs.iter().all(|p| p.is_finite()));
        assert!((probs.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert_eq!(probs[2], 0.0);
    }

    /// The softmax row is dispatched to an AVX2 copy where the CPU has one;
    /// it must give the bits of the same operations compiled for the
    /// baseline, as this test's own loop is (no FMA, the same order).
    #[test]
    fn the_dispatched_softmax_gives_the_baseline_bits() {
        let (n, v, vp) = (3, 1029, 1032);
        let logits = randn(n * vp, 4.0, 7);
        let mut probs = vec![0.0f32; n * vp];
        softmax_forward(&mut probs, &logits, 1, n, v, vp);
        for (got, row) in probs.chunks_exact(vp).zip(logits.chunks_exact(vp)) {
            let mut want = row[..v].to_vec();
            let m = fastmath::row_max(&want);
            let inv = (1.0 / fastmath::exp_in_place_sum_f64(&mut want, m)) as f32;
            for (g, w) in got[..v].iter().zip(&want) {
                assert_eq!(g.to_bits(), (w * inv).to_bits());
            }
        }
    }

    #[test]
    fn crossentropy_softmax_backward_matches_finite_differences() {
        let (b, t, v) = (2, 3, 7);
        let logits = randn(b * t * v, 2.0, 40);
        let targets = [0u32, 6, 3, 3, 1, 5];
        let loss_of = |logits: &[f32]| -> f64 {
            let mut probs = vec![0.0; b * t * v];
            let mut losses = vec![0.0; b * t];
            softmax_forward(&mut probs, logits, b, t, v, v);
            crossentropy_forward(&mut losses, &probs, &targets, b, t, v, v);
            // scaled so the gradient is O(1) and f32 rounding stays small
            mean_loss(&losses) as f64 * 3.0
        };
        let mut probs = vec![0.0; b * t * v];
        softmax_forward(&mut probs, &logits, b, t, v, v);
        let mut dlogits = vec![0.0; b * t * v];
        crossentropy_softmax_backward(&mut dlogits, &probs, &targets, 3.0, b, t, v, v);
        fd_check(&logits, &dlogits, loss_of, "dlogits");
    }
}

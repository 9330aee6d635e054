//! The fused classifier on the CPU: softmax, cross-entropy and the gradient
//! of the mean loss in one kernel, written over the logits in place, with no
//! `(B, T, V)` probability buffer; the reference algorithm for a future GPU
//! kernel (llm.c's `fused_classifier`), checked against the unfused
//! [`loss`](super::loss) kernels.
//!
//! # Algorithm
//!
//! Per row of logits (one position):
//!
//! 1. one pass finds the maximum `m` of the `V` real columns, and a second
//!    sums `s = Σ exp(x - m)` (the CUDA kernel folds both into one pass with
//!    the online softmax, rescaling its running sum whenever the maximum
//!    grows; on the CPU the row stays in cache between the two passes, and
//!    the plain max vectorises where the online rescale, a branch in the
//!    sum's dependency chain, did not: with it, the classifier's tasks took
//!    4.1× the unfused softmax and cross-entropy's time on the main job);
//! 2. `loss = m + ln s - x[target]` (the logsumexp form: no probability is
//!    formed, so a vanishing target probability gives a large finite loss,
//!    not `-ln 0`);
//! 3. with a `dloss`, the sum's pass leaves each `exp(x - m)` over its logit
//!    and one more pass writes the gradient of `dloss · mean(losses)` in
//!    place: `exp(x - m) / s · dloss / N - [i == target] · dloss / N`.
//!
//! # Padded vocabulary
//!
//! Rows have `Vp >= V` columns (llm.c pads GPT-2's 50,257 to 50,304 so the
//! classifier's matrix product is tensor-core friendly). Columns `V..Vp` are
//! padding: they are read by no sum, they do not change the loss, and their
//! gradient is written as 0. Targets must be below `V` (checked: the kernel
//! panics otherwise).
//!
//! # Numerics
//!
//! The exponentials are `f32` and the row sum accumulates them in `f64`, the
//! crate's CPU convention for row reductions (the unfused
//! [`softmax_forward`](super::loss::softmax_forward) does the same), in
//! eight interleaved partial sums added in a fixed order; everything else is
//! `f32`. Losses agree with the unfused `-ln softmax[target]` to about 1e-6
//! relative, gradients to about 1e-6 relative (the sum's order differs), not
//! bit for bit.
//!
//! # CUDA
//!
//! `fused_classifier` / `fused_classifier_bf16` in `loss.cu` (they share its
//! block reductions): one block of `CLASSIFIER_BLOCK` (256) threads per row,
//! each thread folding its columns into a running `(max, sum)` pair, the
//! pairs merged in a fixed tree (so the result does not depend on timing),
//! then the gradient pass: one read of the row for the losses, a second
//! read and a write for the gradient. Where the rows are 16-byte aligned
//! (the model's `Vp`, a multiple of 128) every access moves 16 bytes (8 bf16
//! or 4 f32), the padding is written without being read, and the `V % 8`
//! tail columns are taken one by one. The same f32 operations per element
//! as the CPU kernel, except that the maximum and the sum come from one
//! online pass, vector by vector (a vector's maximum first, then its
//! exponentials, summed pairwise in f32 and added to a `double` sum); the
//! sum is in a tree order rather than the CPU's eight lanes, and
//! `expf`/`log` are CUDA's (the CPU's exponential is
//! [`fastmath::exp`](super::fastmath::exp)): agreement to float tolerance,
//! not bit for bit. A target not below
//! `V` gives a NaN loss on CUDA (the CPU kernel panics); nothing is read
//! outside the row. Checked on an H200 (docs/gpu-validation.md, run 5).

use braid::cuda::KernelArgs;
use braid::cuda::LaunchConfig;
use braid::{CudaTaskCtx, DevSlice, DevSliceMut, Result, TaskHandle, View};

use super::cuda_common::{by_dtype, task_result, Check, Elems, Kernel, Launcher};
use super::fastmath::{exp_in_place_sum_f64, exp_sum_f64, row_max};
use super::loss::{row_dims, CUDA};
use super::storage::Storage;
use super::task::{submit, Task};
use super::{check_len, check_stride};

/// Threads per row of the fused classifier (any multiple of 32 up to 1024
/// works): 256 gives each thread 24 or 25 of a GPT-2 row's 6,283 16-byte
/// vectors and six blocks (rows) per SM at the bf16 kernel's 40 registers.
/// On an H100 at (8192, 50257 of 50304) bf16 (2026-11-26, the kernel alone,
/// CUDA events): losses 302 us, losses and gradient 889 us, where 512
/// threads took 330 and 880 us, 1024 (one block per SM) 514 and 1144 us,
/// and the kernel before the 16-byte rewrite (1024 threads) 525 and 1148 us.
pub(crate) const CLASSIFIER_BLOCK: u32 = 256;

static FUSED_CLASSIFIER: Kernel = Kernel::new(&CUDA, 5);
static FUSED_CLASSIFIER_BF16: Kernel = Kernel::new(&CUDA, 6);

/// Submits [`classifier_losses`] as a task: writes `losses`, reads the
/// logits (CPU and CUDA bodies).
pub fn losses<'rt>(
    task: impl Into<Task<'rt>>,
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
            losses.write::<f32>(),
            logits.read::<S>(),
            targets.read::<u32>(),
        ),
        move |(losses, logits, targets)| classifier_losses(losses, logits, targets, n, v, vp),
        move |(losses, logits, targets), cu| {
            task_result(classifier_losses_cuda(
                cu, losses, logits, targets, n, v, vp,
            ))
        },
    )
}

/// Submits [`fused_classifier`] with `Some(dloss)` as a task: writes
/// `losses` and the gradient over `logits` in place (declared
/// `read_write`; CPU and CUDA bodies).
pub fn forward_backward<'rt>(
    task: impl Into<Task<'rt>>,
    logits: &View,  // (N, Vp) in: logits; out: dlogits
    losses: &View,  // (N)
    targets: &View, // (N) u32, each < V
    dloss: f32,
    n: usize,
    v: usize,
    vp: usize,
) -> Result<TaskHandle> {
    submit!(
        task,
        |S| (
            logits.read_write::<S>(),
            losses.write::<f32>(),
            targets.read::<u32>(),
        ),
        move |(logits, losses, targets)| {
            fused_classifier(logits, losses, targets, Some(dloss), n, v, vp)
        },
        move |(logits, losses, targets), cu| {
            task_result(fused_classifier_cuda(
                cu,
                logits,
                losses,
                targets,
                Some(dloss),
                n,
                v,
                vp,
            ))
        },
    )
}

fn check(name: &str, logits: usize, losses: usize, targets: &[u32], n: usize, v: usize, vp: usize) {
    assert!(v > 0, "{name}: V is 0");
    check_stride(name, ("V", v), ("Vp", vp));
    check_len(name, "logits", logits, n * vp);
    check_len(name, "losses", losses, n);
    check_len(name, "targets", targets.len(), n);
    if let Some(&tgt) = targets.iter().find(|&&t| t as usize >= v) {
        panic!("{name}: target {tgt} is not below V ({v})");
    }
}

/// The losses alone (the first pass of [`fused_classifier`]):
/// `losses[row] = logsumexp(logits[row, ..V]) - logits[row, target]`.
pub fn classifier_losses<S: Storage>(
    losses: &mut [f32], // (N)
    logits: &[S],       // (N, Vp)
    targets: &[u32],    // (N), each < V
    n: usize,
    v: usize,
    vp: usize,
) {
    classifier_losses_f32(losses, &S::load_slice(logits), targets, n, v, vp)
}

/// [`classifier_losses`] in `f32`.
#[multiversion::multiversion(targets("x86_64+avx2"))]
fn classifier_losses_f32(
    losses: &mut [f32], // (N)
    logits: &[f32],     // (N, Vp)
    targets: &[u32],    // (N), each < V
    n: usize,
    v: usize,
    vp: usize,
) {
    check(
        "classifier_losses",
        logits.len(),
        losses.len(),
        targets,
        n,
        v,
        vp,
    );
    for ((row, loss), &tgt) in logits.chunks_exact(vp).zip(losses.iter_mut()).zip(targets) {
        let m = row_max(&row[..v]);
        let s = exp_sum_f64(&row[..v], m);
        *loss = (m as f64 + s.ln() - row[tgt as usize] as f64) as f32;
    }
}

/// The fused classifier over `n` rows (module docs): overwrites `losses`
/// with `logsumexp(logits[row, ..V]) - logits[row, target]` and, when
/// `dloss` is `Some`, overwrites `logits` with the gradient of
/// `dloss · mean(losses)`: `(softmax - onehot(target)) · dloss / n` on the
/// `V` real columns, 0 on the padding columns `V..Vp`. With `None` the
/// logits are left as they are.
pub fn fused_classifier<S: Storage>(
    logits: &mut [S],   // (N, Vp)
    losses: &mut [f32], // (N)
    targets: &[u32],    // (N), each < V
    dloss: Option<f32>,
    n: usize,
    v: usize,
    vp: usize,
) {
    S::update_f32(logits, |logits| {
        fused_classifier_f32(logits, losses, targets, dloss, n, v, vp)
    })
}

/// [`fused_classifier`] in `f32`.
#[multiversion::multiversion(targets("x86_64+avx2"))]
fn fused_classifier_f32(
    logits: &mut [f32], // (N, Vp)
    losses: &mut [f32], // (N)
    targets: &[u32],    // (N), each < V
    dloss: Option<f32>,
    n: usize,
    v: usize,
    vp: usize,
) {
    check(
        "fused_classifier",
        logits.len(),
        losses.len(),
        targets,
        n,
        v,
        vp,
    );
    let d = dloss.map(|dl| dl / n as f32);
    for ((row, loss), &tgt) in logits
        .chunks_exact_mut(vp)
        .zip(losses.iter_mut())
        .zip(targets)
    {
        let tgt = tgt as usize;
        let (m, x_tgt) = (row_max(&row[..v]), row[tgt] as f64);
        let Some(d) = d else {
            let s = exp_sum_f64(&row[..v], m);
            *loss = (m as f64 + s.ln() - x_tgt) as f32;
            continue;
        };
        // The exponentials go over the row as they are summed; one more
        // pass scales them into the gradient.
        let (real, padding) = row.split_at_mut(v);
        let s = exp_in_place_sum_f64(real, m);
        *loss = (m as f64 + s.ln() - x_tgt) as f32;
        let inv = (1.0 / s) as f32;
        for x in real.iter_mut() {
            *x = *x * inv * d;
        }
        real[tgt] -= d;
        padding.fill(0.0);
    }
}

/// [`classifier_losses`] on the task's stream (module docs, CUDA): the
/// logits are only read.
pub fn classifier_losses_cuda<S: Storage>(
    cu: &CudaTaskCtx<'_>,
    losses: DevSliceMut<f32>, // (N)
    logits: DevSlice<S>,      // (N, Vp)
    targets: DevSlice<u32>,   // (N), each < V
    n: usize,
    v: usize,
    vp: usize,
) -> Result<()> {
    let k = Check::new("classifier_losses");
    // SAFETY: `logits.ptr()` is `logits`' address; with `dloss: None` the
    // kernel only reads it, so the read-only slice is never written through.
    unsafe {
        launch::<S>(
            k,
            cu,
            (&logits, logits.ptr()),
            &losses,
            &targets,
            None,
            (n, v, vp),
        )
    }
}

/// [`fused_classifier`] on the task's stream (module docs, CUDA): the losses,
/// and with `Some(dloss)` the gradient of `dloss · mean(losses)` over the
/// logits in place.
#[allow(clippy::too_many_arguments)]
pub fn fused_classifier_cuda<S: Storage>(
    cu: &CudaTaskCtx<'_>,
    logits: DevSliceMut<S>,   // (N, Vp)
    losses: DevSliceMut<f32>, // (N)
    targets: DevSlice<u32>,   // (N), each < V
    dloss: Option<f32>,
    n: usize,
    v: usize,
    vp: usize,
) -> Result<()> {
    let k = Check::new("fused_classifier");
    // SAFETY: `logits.ptr()` is `logits`' address, and the slice is writable.
    unsafe {
        launch::<S>(
            k,
            cu,
            (&logits, logits.ptr()),
            &losses,
            &targets,
            dloss,
            (n, v, vp),
        )
    }
}

/// Checks the shapes of a fused classifier launch (`V` in `1..=Vp`, the
/// logits `(N, Vp)`, losses and targets `(N)`), then queues
/// `fused_classifier[_bf16]`, one block of [`CLASSIFIER_BLOCK`] threads per
/// row; `dloss: None` writes the losses only.
///
/// # Safety
/// `logits` is the logits' slice and its device address, writable unless
/// `dloss` is `None`.
unsafe fn launch<S: Storage>(
    k: Check,
    cu: &CudaTaskCtx<'_>,
    (logits, logits_ptr): (&impl Elems, u64),
    losses: &DevSliceMut<f32>,
    targets: &DevSlice<u32>,
    dloss: Option<f32>,
    (n, v, vp): (usize, usize, usize),
) -> Result<()> {
    let (ni, vi, vpi) = row_dims(&k, n, v, vp)?;
    k.exact("logits", logits, "(N, Vp)", k.mul(n, vp)?)?;
    k.exact("losses", losses, "(N)", n)?;
    k.exact("targets", targets, "(N)", n)?;
    let l = Launcher::new(k, cu);
    // The CPU kernel's scalar, computed the same way.
    let d = dloss.map_or(0.0, |dl| dl / n as f32);
    let mut a = KernelArgs::new();
    a.ptr(logits_ptr)
        .ptr(losses.ptr())
        .ptr(targets.ptr())
        .f32(d)
        .i32(dloss.is_some() as i32)
        .i32(ni)
        .i32(vi)
        .i32(vpi);
    let cfg = LaunchConfig::grid_block(l.grid(n)?, CLASSIFIER_BLOCK);
    let kernel = by_dtype::<S>(&FUSED_CLASSIFIER, &FUSED_CLASSIFIER_BF16);
    // SAFETY: fused_classifier[_bf16](S* logits, float* losses, const uint*
    // targets, float d, int write_grad, int N, int V, int Vp), S the logits'
    // storage type; shapes checked above, the logits' writability the
    // caller's contract.
    unsafe { l.launch(kernel, cfg, &a) }
}

#[cfg(test)]
mod tests {
    use super::super::loss::{
        crossentropy_forward, crossentropy_softmax_backward, softmax_forward,
    };
    use super::super::testutil::{assert_close, fd_check, max_errors, randn};
    use super::*;

    /// The unfused path: softmax, cross-entropy, and the backward from zero.
    fn unfused(
        logits: &[f32],
        targets: &[u32],
        dloss: f32,
        n: usize,
        v: usize,
    ) -> (Vec<f32>, Vec<f32>) {
        let mut probs = vec![f32::NAN; n * v];
        let mut losses = vec![f32::NAN; n];
        softmax_forward(&mut probs, logits, 1, n, v, v);
        crossentropy_forward(&mut losses, &probs, targets, 1, n, v, v);
        let mut dlogits = vec![0.0; n * v];
        crossentropy_softmax_backward(&mut dlogits, &probs, targets, dloss, 1, n, v, v);
        (losses, dlogits)
    }

    /// `logits` `(N, V)` padded to `(N, Vp)` with `fill` in the padding.
    fn pad(logits: &[f32], v: usize, vp: usize, fill: impl Fn(usize) -> f32) -> Vec<f32> {
        let mut out = Vec::with_capacity(logits.len() / v * vp);
        for (r, row) in logits.chunks_exact(v).enumerate() {
            out.extend_from_slice(row);
            out.extend((v..vp).map(|i| fill(r * vp + i)));
        }
        out
    }

    fn targets(n: usize, v: usize, seed: u64) -> Vec<u32> {
        let mut rng = crate::rng::Rng::new(seed);
        let mut t: Vec<u32> = (0..n).map(|_| (rng.next_u64() % v as u64) as u32).collect();
        // The first and last real columns are targets somewhere.
        t[0] = 0;
        t[n - 1] = v as u32 - 1;
        t
    }

    #[test]
    fn matches_unfused_losses_and_gradients() {
        let mut worst_loss = (0.0f32, 0.0f32);
        let mut worst_grad = (0.0f32, 0.0f32);
        // (N, V, std): a small vocabulary, an odd one, GPT-2's own with large
        // logits (so the running max moves often).
        for (i, &(n, v, std)) in [(6, 7, 2.0), (5, 1000, 4.0), (3, 50257, 8.0)]
            .iter()
            .enumerate()
        {
            let logits = randn(n * v, std, 200 + i as u64);
            let tg = targets(n, v, 210 + i as u64);
            for dloss in [1.0f32, 0.25] {
                let (want_losses, want_grad) = unfused(&logits, &tg, dloss, n, v);
                let mut got = logits.clone();
                let mut losses = vec![f32::NAN; n];
                fused_classifier(&mut got, &mut losses, &tg, Some(dloss), n, v, v);
                assert_close(
                    &losses,
                    &want_losses,
                    1e-5,
                    1e-6,
                    &format!("losses N{n} V{v}"),
                );
                assert_close(&got, &want_grad, 1e-9, 1e-5, &format!("dlogits N{n} V{v}"));
                let (el, eg) = (
                    max_errors(&losses, &want_losses),
                    max_errors(&got, &want_grad),
                );
                worst_loss = (worst_loss.0.max(el.0), worst_loss.1.max(el.1));
                worst_grad = (worst_grad.0.max(eg.0), worst_grad.1.max(eg.1));
            }
            // Without dloss only the losses are written.
            let mut same = logits.clone();
            let mut losses = vec![f32::NAN; n];
            fused_classifier(&mut same, &mut losses, &tg, None, n, v, v);
            assert_eq!(same, logits);
            assert!(losses.iter().all(|l| l.is_finite() && *l > 0.0));
            // The read-only loss kernel gives the same losses, bit for bit.
            let mut alone = vec![f32::NAN; n];
            classifier_losses(&mut alone, &logits, &tg, n, v, v);
            assert_eq!(alone, losses);
        }
        eprintln!(
            "fused classifier vs unfused: losses max abs {:e} rel {:e}; dlogits max abs {:e} rel {:e}",
            worst_loss.0, worst_loss.1, worst_grad.0, worst_grad.1
        );
    }

    #[test]
    fn padding_columns_are_masked() {
        let (n, v, vp) = (4, 37, 48);
        let logits = randn(n * v, 2.0, 220);
        let tg = targets(n, v, 221);
        let (want_losses, want_grad) = unfused(&logits, &tg, 1.0, n, v);
        // Padding holding huge values, and holding something else: neither
        // may change the loss or get a gradient.
        for fill in [|_| 1e4f32, |i| (i % 7) as f32 - 3.0] {
            let mut got = pad(&logits, v, vp, fill);
            let mut losses = vec![f32::NAN; n];
            fused_classifier(&mut got, &mut losses, &tg, Some(1.0), n, v, vp);
            assert_close(&losses, &want_losses, 1e-5, 1e-6, "padded losses");
            for (r, row) in got.chunks_exact(vp).enumerate() {
                assert!(
                    row[v..].iter().all(|&g| g == 0.0),
                    "row {r}: padding gradient"
                );
                assert_close(
                    &row[..v],
                    &want_grad[r * v..][..v],
                    1e-9,
                    1e-5,
                    "padded dlogits",
                );
                // A row of the gradient of the mean loss sums to 0.
                assert!(row.iter().sum::<f32>().abs() < 1e-6);
            }
        }
    }

    #[test]
    fn gradient_matches_finite_differences_with_padding() {
        let (n, v, vp) = (3, 9, 12);
        let logits = pad(&randn(n * v, 2.0, 230), v, vp, |i| i as f32);
        let tg = [4u32, 0, 8];
        let mut grad = logits.clone();
        let mut losses = vec![0.0; n];
        // scaled so the gradient is O(1) and f32 rounding stays small
        fused_classifier(&mut grad, &mut losses, &tg, Some(3.0), n, v, vp);
        fd_check(
            &logits,
            &grad,
            |x| {
                let mut x = x.to_vec();
                let mut losses = vec![0.0; n];
                fused_classifier(&mut x, &mut losses, &tg, None, n, v, vp);
                losses.iter().map(|&l| l as f64).sum::<f64>() / n as f64 * 3.0
            },
            "fused dlogits",
        );
    }

    #[test]
    fn loss_stays_finite_where_the_target_probability_underflows() {
        // softmax gives the target exactly 0 in f32; -ln 0 is infinite, the
        // logsumexp form gives the true loss, 200.
        let mut logits = vec![0.0f32, 200.0, 0.0];
        let mut losses = [0.0f32];
        fused_classifier(&mut logits, &mut losses, &[0], Some(1.0), 1, 3, 3);
        assert!((losses[0] - 200.0).abs() < 1e-3, "{}", losses[0]);
        assert_eq!(logits[0], -1.0);
    }

    #[test]
    #[should_panic(expected = "not below V")]
    fn a_target_in_the_padding_is_rejected() {
        let mut logits = vec![0.0f32; 8];
        let mut losses = [0.0f32];
        fused_classifier(&mut logits, &mut losses, &[6], Some(1.0), 1, 5, 8);
    }
}

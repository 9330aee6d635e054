//! `models/gpt2/src/kernels/loss.cu`: softmax and cross-entropy, forward and
//! backward, the mean loss, and the fused classifier. Rows of logits, probs
//! and dlogits are `Vp >= V` elements apart; columns `V..Vp` are padding.

use crate::check::{dim, ids_below, product, stride};
use crate::launch::Args;
use crate::Dim3;

/// `(N, N·Vp)` for `(N, V, Vp)`: `N, V >= 1`, `Vp >= V` (the launchers'
/// `row_dims`).
fn rows(k: &str, n: i32, v: i32, vp: i32) -> Result<(usize, usize), String> {
    let (n, v) = (dim(k, "N", n)?, dim(k, "V", v)?);
    let vp = stride(k, "Vp", vp, "V", v)?;
    Ok((n, product(k, &[n, vp])?))
}

twins! {
    /// `softmax_crossentropy_forward` (f32): `probs[n, :V] = softmax(logits[n,
    /// :V])` and, given `loss = Some((losses, targets))`, `losses[n] =
    /// -ln probs[n, targets[n]]` (every target below `V`: checked); without,
    /// both pointers are null and the kernel writes no loss. `probs`, `logits`
    /// `(N, Vp)`. The launcher (loss.rs, `launch_softmax_crossentropy`): one
    /// block per row, grid `N`, block `SOFTMAX_BLOCK` = 1024.
    pub fn softmax_crossentropy_forward(S = f32);
    /// [`softmax_crossentropy_forward`] with bf16 `probs` and `logits`
    /// (losses `f32`).
    pub fn softmax_crossentropy_forward_bf16(S = u16);
    fn(
        k,
        grid: Dim3,
        block: Dim3,
        probs: &mut [S],
        loss: Option<(&mut [f32], &[u32])>,
        logits: &[S],
        n: i32,
        v: i32,
        vp: i32,
    ) {
        let (rows_n, nvp) = rows(k, n, v, vp)?;
        let args = Args::new(k).output("probs", probs, nvp)?;
        let (losses, targets) = loss.unzip();
        let args = args
            .output_or_null("losses", losses, rows_n)?
            .input("logits", logits, nvp)?
            .input_or_null("targets", targets, rows_n)?
            .i32s([n, v, vp]);
        if let Some(t) = targets {
            ids_below(k, "targets", t, v as usize)?;
        }
        // SAFETY: probs and logits hold (N, Vp) with V <= Vp, and
        // softmax_crossentropy_forward[_bf16] touches columns < V of rows
        // < N; losses and targets hold N elements, or are both null (the
        // kernel then skips the loss); every target is below V (checked), so
        // probs[row, target] is inside.
        unsafe { args.launch(grid, block) }
    }
}

twins! {
    /// `crossentropy_softmax_backward` (f32): `dlogits[n, i] += probs[n, i] ·
    /// d`, then `dlogits[n, targets[n]] -= d`, over the `V` real columns.
    /// `d = dloss / N`, computed by the caller as the launcher does. The
    /// launcher (loss.rs, `crossentropy_softmax_backward_cuda`): one thread per
    /// used element, grid `ceil(N·V / 256)`, block 256.
    pub fn crossentropy_softmax_backward(S = f32);
    /// [`crossentropy_softmax_backward`] with bf16 storage.
    pub fn crossentropy_softmax_backward_bf16(S = u16);
    fn(
        k,
        grid: Dim3,
        block: Dim3,
        dlogits: &mut [S],
        probs: &[S],
        targets: &[u32],
        d: f32,
        n: i32,
        v: i32,
        vp: i32,
    ) {
        let (rows_n, nvp) = rows(k, n, v, vp)?;
        let args = Args::new(k)
            .output("dlogits", dlogits, nvp)?
            .input("probs", probs, nvp)?
            .input("targets", targets, rows_n)?
            .f32(d)
            .i32s([n, v, vp]);
        // SAFETY: dlogits and probs hold (N, Vp) with V <= Vp, targets N
        // (checked); crossentropy_softmax_backward[_bf16] touches row·Vp + i
        // for row < N, i < V, and only compares the targets with column
        // indices.
        unsafe { args.launch(grid, block) }
    }
}

/// `loss_mean`: `out[0]` = the mean of `losses` (`N`), in double. The
/// launcher (loss.rs, `mean_loss_cuda`): grid 1, block 1024.
pub fn loss_mean(
    grid: Dim3,
    block: Dim3,
    out: &mut [f32],
    losses: &[f32],
    n: i32,
) -> Result<(), String> {
    let k = "loss_mean";
    let args = Args::new(k)
        .output("out", out, 1)?
        .input("losses", losses, dim(k, "N", n)?)?
        .i32(n);
    // SAFETY: the kernel writes out[0] and reads losses[i] for i < N:
    // lengths checked above.
    unsafe { args.launch(grid, block) }
}

twins! {
    /// `fused_classifier` (f32): `losses[n] = logsumexp(logits[n, :V]) -
    /// logits[n, targets[n]]` (NaN for a target not below `V`) and, with
    /// `write_grad`, row `n` of `logits` overwritten with the gradient of the
    /// mean loss, `(softmax - onehot) · d` over the `V` real columns and 0 over
    /// the padding; `d = dloss / N`, computed by the caller as the launcher
    /// does. The launcher (fused_classifier.rs, `launch`): one block per row,
    /// grid `N`, block `CLASSIFIER_BLOCK` = 256; `write_grad` 0 (and `d` 0)
    /// for the losses alone.
    pub fn fused_classifier(S = f32);
    /// [`fused_classifier`] with bf16 logits (losses `f32`).
    pub fn fused_classifier_bf16(S = u16);
    fn(
        k,
        grid: Dim3,
        block: Dim3,
        logits: &mut [S],
        losses: &mut [f32],
        targets: &[u32],
        d: f32,
        write_grad: bool,
        n: i32,
        v: i32,
        vp: i32,
    ) {
        let (rows_n, nvp) = rows(k, n, v, vp)?;
        let args = Args::new(k)
            .output("logits", logits, nvp)?
            .output("losses", losses, rows_n)?
            .input("targets", targets, rows_n)?
            .f32(d)
            .i32s([i32::from(write_grad), n, v, vp]);
        // SAFETY: logits hold (N, Vp) with V <= Vp, losses and targets N
        // (checked). fused_classifier[_bf16] touches columns < Vp of rows < N,
        // and reads logits[row, target] only for a target below V, so any
        // target is safe.
        unsafe { args.launch(grid, block) }
    }
}

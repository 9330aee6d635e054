//! `models/gpt2/src/kernels/loss.cu`: softmax and cross-entropy, forward and
//! backward, the mean loss, and the fused classifier. Rows of logits, probs
//! and dlogits are `Vp >= V` elements apart; columns `V..Vp` are padding.

use std::ffi::c_int;

use bytemuck::Pod;

use super::{dim, ids_below, present, ptr_or_null, stride};
use crate::{finish, need, product, Dim3, Guarded};

#[rustfmt::skip]
mod ffi {
    use std::ffi::c_int;

    /// `softmax_crossentropy_forward[_bf16](S* probs, float* losses, const
    /// S* logits, const uint* targets, int N, int V, int Vp)`.
    pub type Softmax<S> = unsafe extern "C" fn(
        u32, u32, u32, u32, u32, u32,
        *mut S, *mut f32, *const S, *const u32, c_int, c_int, c_int,
    ) -> c_int;
    /// `crossentropy_softmax_backward[_bf16](S* dlogits, const S* probs,
    /// const uint* targets, float d, int N, int V, int Vp)`.
    pub type Backward<S> = unsafe extern "C" fn(
        u32, u32, u32, u32, u32, u32,
        *mut S, *const S, *const u32, f32, c_int, c_int, c_int,
    ) -> c_int;
    /// `fused_classifier[_bf16](S* logits, float* losses, const uint*
    /// targets, float d, int write_grad, int N, int V, int Vp)`.
    pub type Fused<S> = unsafe extern "C" fn(
        u32, u32, u32, u32, u32, u32,
        *mut S, *mut f32, *const u32, f32, c_int, c_int, c_int, c_int,
    ) -> c_int;

    extern "C" {
        pub fn emu_softmax_crossentropy_forward(
            gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32,
            probs: *mut f32, losses: *mut f32, logits: *const f32, targets: *const u32,
            n: c_int, v: c_int, vp: c_int,
        ) -> c_int;
        pub fn emu_softmax_crossentropy_forward_bf16(
            gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32,
            probs: *mut u16, losses: *mut f32, logits: *const u16, targets: *const u32,
            n: c_int, v: c_int, vp: c_int,
        ) -> c_int;
        pub fn emu_crossentropy_softmax_backward(
            gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32,
            dlogits: *mut f32, probs: *const f32, targets: *const u32, d: f32,
            n: c_int, v: c_int, vp: c_int,
        ) -> c_int;
        pub fn emu_crossentropy_softmax_backward_bf16(
            gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32,
            dlogits: *mut u16, probs: *const u16, targets: *const u32, d: f32,
            n: c_int, v: c_int, vp: c_int,
        ) -> c_int;
        pub fn emu_loss_mean(
            gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32,
            out: *mut f32, losses: *const f32, n: c_int,
        ) -> c_int;
        pub fn emu_fused_classifier(
            gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32,
            logits: *mut f32, losses: *mut f32, targets: *const u32, d: f32,
            write_grad: c_int, n: c_int, v: c_int, vp: c_int,
        ) -> c_int;
        pub fn emu_fused_classifier_bf16(
            gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32,
            logits: *mut u16, losses: *mut f32, targets: *const u32, d: f32,
            write_grad: c_int, n: c_int, v: c_int, vp: c_int,
        ) -> c_int;
    }
}

/// `(N, N·Vp)` for `(N, V, Vp)`: `N, V >= 1`, `Vp >= V` (the launchers'
/// `row_dims`).
fn rows(k: &str, n: i32, v: i32, vp: i32) -> Result<(usize, usize), String> {
    let (n, v) = (dim(k, "N", n)?, dim(k, "V", v)?);
    let vp = stride(k, "Vp", vp, "V", v)?;
    Ok((n, product(k, &[n, vp])?))
}

fn softmax<S: Pod>(
    k: &str,
    f: ffi::Softmax<S>,
    grid: Dim3,
    block: Dim3,
    probs: &mut [S],
    loss: Option<(&mut [f32], &[u32])>,
    logits: &[S],
    n: i32,
    v: i32,
    vp: i32,
) -> Result<(), String> {
    let (rows_n, nvp) = rows(k, n, v, vp)?;
    need(k, "probs", probs.len(), nvp)?;
    need(k, "logits", logits.len(), nvp)?;
    let (mut losses, mut targets) = (None, None);
    if let Some((l, t)) = loss {
        need(k, "losses", l.len(), rows_n)?;
        need(k, "targets", t.len(), rows_n)?;
        ids_below(k, "targets", t, v as usize)?;
        losses = Some(Guarded::output("losses", l));
        targets = Some(Guarded::input("targets", t));
    }
    let (mut p, mut x) = (
        Guarded::output("probs", probs),
        Guarded::input("logits", logits),
    );
    // SAFETY: `f` is softmax_crossentropy_forward[_bf16] (ffi::Softmax);
    // probs and logits hold (N, Vp) with V <= Vp, and the kernel touches
    // columns < V of rows < N; losses and targets hold N elements, or are
    // both null (the kernel then skips the loss); every target is below V
    // (checked), so probs[row, target] is inside.
    let rc = unsafe {
        f(
            grid.0,
            grid.1,
            grid.2,
            block.0,
            block.1,
            block.2,
            p.ptr(),
            ptr_or_null(&mut losses),
            x.ptr(),
            ptr_or_null(&mut targets),
            n,
            v,
            vp,
        )
    };
    finish(k, rc, present([Some(p), losses, Some(x), targets]))
}

/// `softmax_crossentropy_forward` (f32): `probs[n, :V] = softmax(logits[n,
/// :V])` and, given `loss = Some((losses, targets))`, `losses[n] =
/// -ln probs[n, targets[n]]` (every target below `V`: checked); without,
/// both pointers are null and the kernel writes no loss. `probs`, `logits`
/// `(N, Vp)`. The launcher (loss.rs, `launch_softmax_crossentropy`): one
/// block per row, grid `N`, block `SOFTMAX_BLOCK` = 1024.
pub fn softmax_crossentropy_forward(
    grid: Dim3,
    block: Dim3,
    probs: &mut [f32],
    loss: Option<(&mut [f32], &[u32])>,
    logits: &[f32],
    n: i32,
    v: i32,
    vp: i32,
) -> Result<(), String> {
    let f: ffi::Softmax<f32> = ffi::emu_softmax_crossentropy_forward;
    let k = "softmax_crossentropy_forward";
    softmax(k, f, grid, block, probs, loss, logits, n, v, vp)
}

/// [`softmax_crossentropy_forward`] with bf16 `probs` and `logits`
/// (losses `f32`).
pub fn softmax_crossentropy_forward_bf16(
    grid: Dim3,
    block: Dim3,
    probs: &mut [u16],
    loss: Option<(&mut [f32], &[u32])>,
    logits: &[u16],
    n: i32,
    v: i32,
    vp: i32,
) -> Result<(), String> {
    let f: ffi::Softmax<u16> = ffi::emu_softmax_crossentropy_forward_bf16;
    let k = "softmax_crossentropy_forward_bf16";
    softmax(k, f, grid, block, probs, loss, logits, n, v, vp)
}

fn backward<S: Pod>(
    k: &str,
    f: ffi::Backward<S>,
    grid: Dim3,
    block: Dim3,
    dlogits: &mut [S],
    probs: &[S],
    targets: &[u32],
    d: f32,
    n: i32,
    v: i32,
    vp: i32,
) -> Result<(), String> {
    let (rows_n, nvp) = rows(k, n, v, vp)?;
    need(k, "dlogits", dlogits.len(), nvp)?;
    need(k, "probs", probs.len(), nvp)?;
    need(k, "targets", targets.len(), rows_n)?;
    let (mut dl, mut p, mut t) = (
        Guarded::output("dlogits", dlogits),
        Guarded::input("probs", probs),
        Guarded::input("targets", targets),
    );
    // SAFETY: `f` is crossentropy_softmax_backward[_bf16] (ffi::Backward);
    // dlogits and probs hold (N, Vp) with V <= Vp, targets N (checked); the
    // kernel touches row·Vp + i for row < N, i < V, and only compares the
    // targets with column indices.
    let rc = unsafe {
        f(
            grid.0,
            grid.1,
            grid.2,
            block.0,
            block.1,
            block.2,
            dl.ptr(),
            p.ptr(),
            t.ptr(),
            d,
            n,
            v,
            vp,
        )
    };
    finish(k, rc, vec![dl, p, t])
}

/// `crossentropy_softmax_backward` (f32): `dlogits[n, i] += probs[n, i] ·
/// d`, then `dlogits[n, targets[n]] -= d`, over the `V` real columns.
/// `d = dloss / N`, computed by the caller as the launcher does. The
/// launcher (loss.rs, `crossentropy_softmax_backward_cuda`): one thread per
/// used element, grid `ceil(N·V / 256)`, block 256.
pub fn crossentropy_softmax_backward(
    grid: Dim3,
    block: Dim3,
    dlogits: &mut [f32],
    probs: &[f32],
    targets: &[u32],
    d: f32,
    n: i32,
    v: i32,
    vp: i32,
) -> Result<(), String> {
    let f: ffi::Backward<f32> = ffi::emu_crossentropy_softmax_backward;
    let k = "crossentropy_softmax_backward";
    backward(k, f, grid, block, dlogits, probs, targets, d, n, v, vp)
}

/// [`crossentropy_softmax_backward`] with bf16 storage.
pub fn crossentropy_softmax_backward_bf16(
    grid: Dim3,
    block: Dim3,
    dlogits: &mut [u16],
    probs: &[u16],
    targets: &[u32],
    d: f32,
    n: i32,
    v: i32,
    vp: i32,
) -> Result<(), String> {
    let f: ffi::Backward<u16> = ffi::emu_crossentropy_softmax_backward_bf16;
    let k = "crossentropy_softmax_backward_bf16";
    backward(k, f, grid, block, dlogits, probs, targets, d, n, v, vp)
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
    need(k, "out", out.len(), 1)?;
    need(k, "losses", losses.len(), dim(k, "N", n)?)?;
    let (mut o, mut l) = (
        Guarded::output("out", out),
        Guarded::input("losses", losses),
    );
    // SAFETY: loss_mean(float* out, const float* losses, int N) writes
    // out[0] and reads losses[i] for i < N: lengths checked above.
    let rc = unsafe {
        ffi::emu_loss_mean(
            grid.0,
            grid.1,
            grid.2,
            block.0,
            block.1,
            block.2,
            o.ptr(),
            l.ptr(),
            n,
        )
    };
    finish(k, rc, vec![o, l])
}

fn fused<S: Pod>(
    k: &str,
    f: ffi::Fused<S>,
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
) -> Result<(), String> {
    let (rows_n, nvp) = rows(k, n, v, vp)?;
    need(k, "logits", logits.len(), nvp)?;
    need(k, "losses", losses.len(), rows_n)?;
    need(k, "targets", targets.len(), rows_n)?;
    let (mut x, mut l, mut t) = (
        Guarded::output("logits", logits),
        Guarded::output("losses", losses),
        Guarded::input("targets", targets),
    );
    // SAFETY: `f` is fused_classifier[_bf16] (ffi::Fused); logits hold (N,
    // Vp) with V <= Vp, losses and targets N (checked). The kernel touches
    // columns < Vp of rows < N, and reads logits[row, target] only for a
    // target below V, so any target is safe.
    let rc = unsafe {
        f(
            grid.0,
            grid.1,
            grid.2,
            block.0,
            block.1,
            block.2,
            x.ptr(),
            l.ptr(),
            t.ptr(),
            d,
            c_int::from(write_grad),
            n,
            v,
            vp,
        )
    };
    finish(k, rc, vec![x, l, t])
}

/// `fused_classifier` (f32): `losses[n] = logsumexp(logits[n, :V]) -
/// logits[n, targets[n]]` (NaN for a target not below `V`) and, with
/// `write_grad`, row `n` of `logits` overwritten with the gradient of the
/// mean loss, `(softmax - onehot) · d` over the `V` real columns and 0 over
/// the padding; `d = dloss / N`, computed by the caller as the launcher
/// does. The launcher (fused_classifier.rs, `launch`): one block per row,
/// grid `N`, block `SOFTMAX_BLOCK` = 1024; `write_grad` 0 (and `d` 0) for
/// the losses alone.
pub fn fused_classifier(
    grid: Dim3,
    block: Dim3,
    logits: &mut [f32],
    losses: &mut [f32],
    targets: &[u32],
    d: f32,
    write_grad: bool,
    n: i32,
    v: i32,
    vp: i32,
) -> Result<(), String> {
    let f: ffi::Fused<f32> = ffi::emu_fused_classifier;
    let k = "fused_classifier";
    fused(
        k, f, grid, block, logits, losses, targets, d, write_grad, n, v, vp,
    )
}

/// [`fused_classifier`] with bf16 logits (losses `f32`).
pub fn fused_classifier_bf16(
    grid: Dim3,
    block: Dim3,
    logits: &mut [u16],
    losses: &mut [f32],
    targets: &[u32],
    d: f32,
    write_grad: bool,
    n: i32,
    v: i32,
    vp: i32,
) -> Result<(), String> {
    let f: ffi::Fused<u16> = ffi::emu_fused_classifier_bf16;
    let k = "fused_classifier_bf16";
    fused(
        k, f, grid, block, logits, losses, targets, d, write_grad, n, v, vp,
    )
}

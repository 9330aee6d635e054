//! `models/gpt2/src/kernels/norm.cu`: the squared gradient norm (partials,
//! then their sum), the clip factor, and scaling in place.

use crate::check::{count, dim, need};
use crate::launch::{launch, Arg, Elem};
use crate::Dim3;

fn partial<S: Elem>(
    k: &str,
    grid: Dim3,
    block: Dim3,
    partials: &mut [f64],
    grads: &[S],
    n: i64,
) -> Result<(), String> {
    need(k, "partials", partials.len(), grid.0 as usize)?;
    need(k, "grads", grads.len(), count(k, n)?)?;
    let args = vec![
        Arg::output("partials", partials),
        Arg::input("grads", grads),
        Arg::I64(n),
    ];
    // SAFETY: grad_norm_sq_partial[_bf16] writes partials[blockIdx.x]
    // (gridDim.x of them) and reads grads[i] for i < N (lengths checked
    // above).
    unsafe { launch(k, grid, block, args) }
}

/// `grad_norm_sq_partial` (f32 gradients): `partials[b]` = the sum of `g²`
/// (double) over the elements block `b` visits, grid-stride; `partials` has
/// `grid.0` elements. The launcher (norm.rs, `grad_norm_sq_partial_cuda`):
/// grid `P = partials.len()` (the model: `GRAD_NORM_PARTIALS` = 512), block
/// 512.
pub fn grad_norm_sq_partial(
    grid: Dim3,
    block: Dim3,
    partials: &mut [f64],
    grads: &[f32],
    n: i64,
) -> Result<(), String> {
    partial("grad_norm_sq_partial", grid, block, partials, grads, n)
}

/// [`grad_norm_sq_partial`] with bf16 gradients.
pub fn grad_norm_sq_partial_bf16(
    grid: Dim3,
    block: Dim3,
    partials: &mut [f64],
    grads: &[u16],
    n: i64,
) -> Result<(), String> {
    partial("grad_norm_sq_partial_bf16", grid, block, partials, grads, n)
}

/// `grad_norm_sq_finalize`: `out[0]` = the sum of `partials` (`P`). The
/// launcher (norm.rs, `grad_norm_sq_finalize_cuda`): grid 1, block 1024.
pub fn grad_norm_sq_finalize(
    grid: Dim3,
    block: Dim3,
    out: &mut [f64],
    partials: &[f64],
    p: i32,
) -> Result<(), String> {
    let k = "grad_norm_sq_finalize";
    need(k, "out", out.len(), 1)?;
    need(k, "partials", partials.len(), dim(k, "P", p)?)?;
    let args = vec![
        Arg::output("out", out),
        Arg::input("partials", partials),
        Arg::I32(p),
    ];
    // SAFETY: the kernel writes out[0] and reads partials[i] for i < P
    // (checked above).
    unsafe { launch(k, grid, block, args) }
}

/// `grad_clip_scale`: `scale[0] = min(1, max_norm / (sqrt(Σ norm_sq) +
/// 1e-6))`, 1 for a non-finite norm; `norm_sq` has `K` partial squared
/// norms. The launcher (norm.rs, `grad_clip_scale_cuda`): grid 1, block 1.
pub fn grad_clip_scale(
    grid: Dim3,
    block: Dim3,
    scale: &mut [f32],
    norm_sq: &[f64],
    k_parts: i32,
    max_norm: f32,
) -> Result<(), String> {
    let k = "grad_clip_scale";
    need(k, "scale", scale.len(), 1)?;
    need(k, "norm_sq", norm_sq.len(), dim(k, "K", k_parts)?)?;
    let args = vec![
        Arg::output("scale", scale),
        Arg::input("norm_sq", norm_sq),
        Arg::I32(k_parts),
        Arg::F32(max_norm),
    ];
    // SAFETY: the kernel writes scale[0] and reads norm_sq[k] for k < K
    // (checked above).
    unsafe { launch(k, grid, block, args) }
}

fn scale_host<S: Elem>(
    k: &str,
    grid: Dim3,
    block: Dim3,
    x: &mut [S],
    n: i64,
    s: f32,
) -> Result<(), String> {
    need(k, "x", x.len(), count(k, n)?)?;
    let args = vec![Arg::output("x", x), Arg::I64(n), Arg::F32(s)];
    // SAFETY: scale_inplace[_bf16] touches x[i] for i < N, the length of x
    // (checked).
    unsafe { launch(k, grid, block, args) }
}

/// `scale_inplace` (f32): `x *= s`. The launcher (norm.rs,
/// `scale_in_place_cuda`): nothing for `s == 1`, else one thread per
/// element, grid `ceil(N / 256)`, block 256.
pub fn scale_inplace(grid: Dim3, block: Dim3, x: &mut [f32], n: i64, s: f32) -> Result<(), String> {
    scale_host("scale_inplace", grid, block, x, n, s)
}

/// [`scale_inplace`] with bf16 storage.
pub fn scale_inplace_bf16(
    grid: Dim3,
    block: Dim3,
    x: &mut [u16],
    n: i64,
    s: f32,
) -> Result<(), String> {
    scale_host("scale_inplace_bf16", grid, block, x, n, s)
}

fn scale_dev<S: Elem>(
    k: &str,
    grid: Dim3,
    block: Dim3,
    x: &mut [S],
    n: i64,
    s: &[f32],
) -> Result<(), String> {
    need(k, "x", x.len(), count(k, n)?)?;
    need(k, "s", s.len(), 1)?;
    let args = vec![Arg::output("x", x), Arg::I64(n), Arg::input("s", s)];
    // SAFETY: scale_inplace_dev[_bf16] touches x[i] for i < N, the length
    // of x, and s[0] (checked).
    unsafe { launch(k, grid, block, args) }
}

/// `scale_inplace_dev` (f32): `x *= s[0]`, the factor read on the device.
/// The launcher (norm.rs, `scale_in_place_by_cuda`): one thread per element,
/// grid `ceil(N / 256)`, block 256.
pub fn scale_inplace_dev(
    grid: Dim3,
    block: Dim3,
    x: &mut [f32],
    n: i64,
    s: &[f32],
) -> Result<(), String> {
    scale_dev("scale_inplace_dev", grid, block, x, n, s)
}

/// [`scale_inplace_dev`] with bf16 storage.
pub fn scale_inplace_dev_bf16(
    grid: Dim3,
    block: Dim3,
    x: &mut [u16],
    n: i64,
    s: &[f32],
) -> Result<(), String> {
    scale_dev("scale_inplace_dev_bf16", grid, block, x, n, s)
}

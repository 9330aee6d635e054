//! `models/gpt2/src/kernels/norm.cu`: the squared gradient norm (partials,
//! then their sum), the clip factor, and scaling in place.

use crate::check::{count, dim};
use crate::launch::Args;
use crate::Dim3;

twins! {
    /// `grad_norm_sq_partial` (f32 gradients): `partials[b]` = the sum of `g²`
    /// (double) over the elements block `b` visits, grid-stride; `partials` has
    /// `grid.0` elements. The launcher (norm.rs, `grad_norm_sq_partial_cuda`):
    /// grid `P = partials.len()` (the model: `GRAD_NORM_PARTIALS` = 512), block
    /// 512.
    pub fn grad_norm_sq_partial(S = f32);
    /// [`grad_norm_sq_partial`] with bf16 gradients.
    pub fn grad_norm_sq_partial_bf16(S = u16);
    fn(k, grid: Dim3, block: Dim3, partials: &mut [f64], grads: &[S], n: i64) {
        let args = Args::new(k)
            .output("partials", partials, grid.0 as usize)?
            .input("grads", grads, count(k, n)?)?
            .i64(n);
        // SAFETY: grad_norm_sq_partial[_bf16] writes partials[blockIdx.x]
        // (gridDim.x of them) and reads grads[i] for i < N (lengths checked
        // above).
        unsafe { args.launch(grid, block) }
    }
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
    let args = Args::new(k)
        .output("out", out, 1)?
        .input("partials", partials, dim(k, "P", p)?)?
        .i32(p);
    // SAFETY: the kernel writes out[0] and reads partials[i] for i < P
    // (checked above).
    unsafe { args.launch(grid, block) }
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
    let args = Args::new(k)
        .output("scale", scale, 1)?
        .input("norm_sq", norm_sq, dim(k, "K", k_parts)?)?
        .i32(k_parts)
        .f32(max_norm);
    // SAFETY: the kernel writes scale[0] and reads norm_sq[k] for k < K
    // (checked above).
    unsafe { args.launch(grid, block) }
}

twins! {
    /// `scale_inplace` (f32): `x *= s`. The launcher (norm.rs,
    /// `scale_in_place_cuda`): nothing for `s == 1`, else one thread per
    /// element, grid `ceil(N / 256)`, block 256.
    pub fn scale_inplace(S = f32);
    /// [`scale_inplace`] with bf16 storage.
    pub fn scale_inplace_bf16(S = u16);
    fn(k, grid: Dim3, block: Dim3, x: &mut [S], n: i64, s: f32) {
        let args = Args::new(k).output("x", x, count(k, n)?)?.i64(n).f32(s);
        // SAFETY: scale_inplace[_bf16] touches x[i] for i < N, the length of x
        // (checked).
        unsafe { args.launch(grid, block) }
    }
}

twins! {
    /// `scale_inplace_dev` (f32): `x *= s[0]`, the factor read on the device.
    /// The launcher (norm.rs, `scale_in_place_by_cuda`): one thread per element,
    /// grid `ceil(N / 256)`, block 256.
    pub fn scale_inplace_dev(S = f32);
    /// [`scale_inplace_dev`] with bf16 storage.
    pub fn scale_inplace_dev_bf16(S = u16);
    fn(k, grid: Dim3, block: Dim3, x: &mut [S], n: i64, s: &[f32]) {
        let args = Args::new(k)
            .output("x", x, count(k, n)?)?
            .i64(n)
            .input("s", s, 1)?;
        // SAFETY: scale_inplace_dev[_bf16] touches x[i] for i < N, the length
        // of x, and s[0] (checked).
        unsafe { args.launch(grid, block) }
    }
}

//! `models/gpt2/src/kernels/norm.cu`: the squared gradient norm (partials,
//! then their sum), the clip factor, and scaling in place.

use bytemuck::Pod;

use super::{count, dim};
use crate::{finish, need, Dim3, Guarded};

#[rustfmt::skip]
mod ffi {
    use std::ffi::c_int;

    /// `grad_norm_sq_partial[_bf16](double* partials, const S* grads, long
    /// long N)`.
    pub type Partial<S> = unsafe extern "C" fn(
        u32, u32, u32, u32, u32, u32,
        *mut f64, *const S, i64,
    ) -> c_int;
    /// `scale_inplace[_bf16](S* x, long long N, float s)`.
    pub type Scale<S> = unsafe extern "C" fn(
        u32, u32, u32, u32, u32, u32,
        *mut S, i64, f32,
    ) -> c_int;
    /// `scale_inplace_dev[_bf16](S* x, long long N, const float* s)`.
    pub type ScaleDev<S> = unsafe extern "C" fn(
        u32, u32, u32, u32, u32, u32,
        *mut S, i64, *const f32,
    ) -> c_int;

    extern "C" {
        pub fn emu_grad_norm_sq_partial(
            gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32,
            partials: *mut f64, grads: *const f32, n: i64,
        ) -> c_int;
        pub fn emu_grad_norm_sq_partial_bf16(
            gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32,
            partials: *mut f64, grads: *const u16, n: i64,
        ) -> c_int;
        pub fn emu_grad_norm_sq_finalize(
            gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32,
            out: *mut f64, partials: *const f64, p: c_int,
        ) -> c_int;
        pub fn emu_grad_clip_scale(
            gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32,
            scale: *mut f32, norm_sq: *const f64, k: c_int, max_norm: f32,
        ) -> c_int;
        pub fn emu_scale_inplace(
            gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32,
            x: *mut f32, n: i64, s: f32,
        ) -> c_int;
        pub fn emu_scale_inplace_bf16(
            gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32,
            x: *mut u16, n: i64, s: f32,
        ) -> c_int;
        pub fn emu_scale_inplace_dev(
            gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32,
            x: *mut f32, n: i64, s: *const f32,
        ) -> c_int;
        pub fn emu_scale_inplace_dev_bf16(
            gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32,
            x: *mut u16, n: i64, s: *const f32,
        ) -> c_int;
    }
}

fn partial<S: Pod>(
    k: &str,
    f: ffi::Partial<S>,
    grid: Dim3,
    block: Dim3,
    partials: &mut [f64],
    grads: &[S],
    n: i64,
) -> Result<(), String> {
    need(k, "partials", partials.len(), grid.0 as usize)?;
    need(k, "grads", grads.len(), count(k, n)?)?;
    let (mut p, mut g) = (
        Guarded::output("partials", partials),
        Guarded::input("grads", grads),
    );
    // SAFETY: `f` is grad_norm_sq_partial[_bf16] (ffi::Partial); it writes
    // partials[blockIdx.x] (gridDim.x of them) and reads grads[i] for i < N
    // (lengths checked above).
    let rc = unsafe {
        f(
            grid.0,
            grid.1,
            grid.2,
            block.0,
            block.1,
            block.2,
            p.ptr(),
            g.ptr(),
            n,
        )
    };
    finish(k, rc, vec![p, g])
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
    let f: ffi::Partial<f32> = ffi::emu_grad_norm_sq_partial;
    partial("grad_norm_sq_partial", f, grid, block, partials, grads, n)
}

/// [`grad_norm_sq_partial`] with bf16 gradients.
pub fn grad_norm_sq_partial_bf16(
    grid: Dim3,
    block: Dim3,
    partials: &mut [f64],
    grads: &[u16],
    n: i64,
) -> Result<(), String> {
    let f: ffi::Partial<u16> = ffi::emu_grad_norm_sq_partial_bf16;
    let k = "grad_norm_sq_partial_bf16";
    partial(k, f, grid, block, partials, grads, n)
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
    let (mut o, mut ps) = (
        Guarded::output("out", out),
        Guarded::input("partials", partials),
    );
    // SAFETY: grad_norm_sq_finalize(double* out, const double* partials,
    // int P) writes out[0] and reads partials[i] for i < P (checked above).
    let rc = unsafe {
        ffi::emu_grad_norm_sq_finalize(
            grid.0,
            grid.1,
            grid.2,
            block.0,
            block.1,
            block.2,
            o.ptr(),
            ps.ptr(),
            p,
        )
    };
    finish(k, rc, vec![o, ps])
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
    let (mut s, mut ns) = (
        Guarded::output("scale", scale),
        Guarded::input("norm_sq", norm_sq),
    );
    // SAFETY: grad_clip_scale(float* scale, const double* norm_sq, int K,
    // float max_norm) writes scale[0] and reads norm_sq[k] for k < K
    // (checked above).
    let rc = unsafe {
        ffi::emu_grad_clip_scale(
            grid.0,
            grid.1,
            grid.2,
            block.0,
            block.1,
            block.2,
            s.ptr(),
            ns.ptr(),
            k_parts,
            max_norm,
        )
    };
    finish(k, rc, vec![s, ns])
}

fn scale_host<S: Pod>(
    k: &str,
    f: ffi::Scale<S>,
    grid: Dim3,
    block: Dim3,
    x: &mut [S],
    n: i64,
    s: f32,
) -> Result<(), String> {
    need(k, "x", x.len(), count(k, n)?)?;
    let mut gx = Guarded::output("x", x);
    // SAFETY: `f` is scale_inplace[_bf16] (ffi::Scale); it touches x[i] for
    // i < N, the length of x (checked).
    let rc = unsafe {
        f(
            grid.0,
            grid.1,
            grid.2,
            block.0,
            block.1,
            block.2,
            gx.ptr(),
            n,
            s,
        )
    };
    finish(k, rc, vec![gx])
}

/// `scale_inplace` (f32): `x *= s`. The launcher (norm.rs,
/// `scale_in_place_cuda`): nothing for `s == 1`, else one thread per
/// element, grid `ceil(N / 256)`, block 256.
pub fn scale_inplace(grid: Dim3, block: Dim3, x: &mut [f32], n: i64, s: f32) -> Result<(), String> {
    let f: ffi::Scale<f32> = ffi::emu_scale_inplace;
    scale_host("scale_inplace", f, grid, block, x, n, s)
}

/// [`scale_inplace`] with bf16 storage.
pub fn scale_inplace_bf16(
    grid: Dim3,
    block: Dim3,
    x: &mut [u16],
    n: i64,
    s: f32,
) -> Result<(), String> {
    let f: ffi::Scale<u16> = ffi::emu_scale_inplace_bf16;
    scale_host("scale_inplace_bf16", f, grid, block, x, n, s)
}

fn scale_dev<S: Pod>(
    k: &str,
    f: ffi::ScaleDev<S>,
    grid: Dim3,
    block: Dim3,
    x: &mut [S],
    n: i64,
    s: &[f32],
) -> Result<(), String> {
    need(k, "x", x.len(), count(k, n)?)?;
    need(k, "s", s.len(), 1)?;
    let (mut gx, mut gs) = (Guarded::output("x", x), Guarded::input("s", s));
    // SAFETY: `f` is scale_inplace_dev[_bf16] (ffi::ScaleDev); it touches
    // x[i] for i < N, the length of x, and s[0] (checked).
    let rc = unsafe {
        f(
            grid.0,
            grid.1,
            grid.2,
            block.0,
            block.1,
            block.2,
            gx.ptr(),
            n,
            gs.ptr(),
        )
    };
    finish(k, rc, vec![gx, gs])
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
    let f: ffi::ScaleDev<f32> = ffi::emu_scale_inplace_dev;
    scale_dev("scale_inplace_dev", f, grid, block, x, n, s)
}

/// [`scale_inplace_dev`] with bf16 storage.
pub fn scale_inplace_dev_bf16(
    grid: Dim3,
    block: Dim3,
    x: &mut [u16],
    n: i64,
    s: &[f32],
) -> Result<(), String> {
    let f: ffi::ScaleDev<u16> = ffi::emu_scale_inplace_dev_bf16;
    scale_dev("scale_inplace_dev_bf16", f, grid, block, x, n, s)
}

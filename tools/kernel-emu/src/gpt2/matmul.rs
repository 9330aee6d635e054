//! `models/gpt2/src/kernels/matmul.cu`: the bias kernels of the linear
//! layers (the products are cuBLAS calls, not emulated). Rows of the
//! `(N, OC)` side are `ld >= OC` elements apart; columns `OC..ld` are
//! neither read nor written.

use std::ffi::c_int;

use bytemuck::Pod;

use super::{dim, stride};
use crate::{finish, need, product, Dim3, Guarded};

#[rustfmt::skip]
mod ffi {
    use std::ffi::c_int;

    /// `bias_broadcast[_bf16](S* out, const S* bias, int N, int OC, int ld)`
    /// and `bias_backward[_bf16](S* dbias, const S* dout, int N, int OC,
    /// int ld)`: one signature.
    pub type Bias<S> = unsafe extern "C" fn(
        u32, u32, u32, u32, u32, u32,
        *mut S, *const S, c_int, c_int, c_int,
    ) -> c_int;

    extern "C" {
        pub fn emu_bias_broadcast(
            gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32,
            out: *mut f32, bias: *const f32, n: c_int, oc: c_int, ld: c_int,
        ) -> c_int;
        pub fn emu_bias_broadcast_bf16(
            gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32,
            out: *mut u16, bias: *const u16, n: c_int, oc: c_int, ld: c_int,
        ) -> c_int;
        pub fn emu_bias_backward(
            gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32,
            dbias: *mut f32, dout: *const f32, n: c_int, oc: c_int, ld: c_int,
        ) -> c_int;
        pub fn emu_bias_backward_bf16(
            gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32,
            dbias: *mut u16, dout: *const u16, n: c_int, oc: c_int, ld: c_int,
        ) -> c_int;
    }
}

/// Row lanes (warps) of `bias_backward`: `BIAS_GRAD_LANES` in matmul.cu.
pub const BIAS_GRAD_LANES: u32 = 32;

/// Both bias kernels: `rows` is the `(N, ld)` side (`out`, or `dout`) and
/// `vec` the `(OC)` side (`bias`, or `dbias`); the kernel writes the one
/// that is `&mut`.
fn bias_kernel<S: Pod>(
    k: &str,
    f: ffi::Bias<S>,
    grid: Dim3,
    block: Dim3,
    (first, second): (Guarded<'_>, Guarded<'_>),
    n: i32,
    oc: i32,
    ld: i32,
) -> Result<(), String> {
    let (mut a, mut b) = (first, second);
    // SAFETY: `f` is bias_broadcast[_bf16] or bias_backward[_bf16]
    // (ffi::Bias); the callers checked that the (N, ld) buffer holds N·ld
    // elements with ld >= OC and the (OC) buffer OC: every index the kernels
    // form, n·ld + o with n < N and o < OC, is inside.
    let rc: c_int = unsafe {
        f(
            grid.0,
            grid.1,
            grid.2,
            block.0,
            block.1,
            block.2,
            a.ptr(),
            b.ptr(),
            n,
            oc,
            ld,
        )
    };
    finish(k, rc, vec![a, b])
}

/// `(N, OC, ld)` checked: `N, OC >= 1`, `ld >= OC`; the `(N, ld)` side's
/// and the `(OC)` side's lengths.
fn bias_shape(
    k: &str,
    rows: (&str, usize),
    vec: (&str, usize),
    n: i32,
    oc: i32,
    ld: i32,
) -> Result<(), String> {
    let (n, oc) = (dim(k, "N", n)?, dim(k, "OC", oc)?);
    let ld = stride(k, "ld", ld, "OC", oc)?;
    need(k, rows.0, rows.1, product(k, &[n, ld])?)?;
    need(k, vec.0, vec.1, oc)
}

fn broadcast<S: Pod>(
    k: &str,
    f: ffi::Bias<S>,
    grid: Dim3,
    block: Dim3,
    out: &mut [S],
    bias: &[S],
    n: i32,
    oc: i32,
    ld: i32,
) -> Result<(), String> {
    bias_shape(k, ("out", out.len()), ("bias", bias.len()), n, oc, ld)?;
    let bufs = (Guarded::output("out", out), Guarded::input("bias", bias));
    bias_kernel(k, f, grid, block, bufs, n, oc, ld)
}

fn backward<S: Pod>(
    k: &str,
    f: ffi::Bias<S>,
    grid: Dim3,
    block: Dim3,
    dbias: &mut [S],
    dout: &[S],
    n: i32,
    oc: i32,
    ld: i32,
) -> Result<(), String> {
    bias_shape(k, ("dout", dout.len()), ("dbias", dbias.len()), n, oc, ld)?;
    let bufs = (
        Guarded::output("dbias", dbias),
        Guarded::input("dout", dout),
    );
    bias_kernel(k, f, grid, block, bufs, n, oc, ld)
}

/// `bias_broadcast` (f32): `out[n, o] = bias[o]`, `out` `(N, ld)`, `bias`
/// `(OC)`. The launcher (matmul.rs, `matmul_forward_cuda`): one thread per
/// used element, grid `ceil(N·OC / 256)`, block 256.
pub fn bias_broadcast(
    grid: Dim3,
    block: Dim3,
    out: &mut [f32],
    bias: &[f32],
    n: i32,
    oc: i32,
    ld: i32,
) -> Result<(), String> {
    let f: ffi::Bias<f32> = ffi::emu_bias_broadcast;
    broadcast("bias_broadcast", f, grid, block, out, bias, n, oc, ld)
}

/// [`bias_broadcast`] with bf16 storage (`u16` bit patterns).
pub fn bias_broadcast_bf16(
    grid: Dim3,
    block: Dim3,
    out: &mut [u16],
    bias: &[u16],
    n: i32,
    oc: i32,
    ld: i32,
) -> Result<(), String> {
    let f: ffi::Bias<u16> = ffi::emu_bias_broadcast_bf16;
    broadcast("bias_broadcast_bf16", f, grid, block, out, bias, n, oc, ld)
}

/// `bias_backward` (f32): `dbias[o] += Σ_n dout[n, o]`, `dbias` `(OC)`,
/// `dout` `(N, ld)`, summed by [`BIAS_GRAD_LANES`] warps in a fixed lane
/// order. The launcher (matmul.rs, `matmul_backward_weight_cuda`): grid
/// `ceil(OC / 32)`, block `32 · BIAS_GRAD_LANES`.
pub fn bias_backward(
    grid: Dim3,
    block: Dim3,
    dbias: &mut [f32],
    dout: &[f32],
    n: i32,
    oc: i32,
    ld: i32,
) -> Result<(), String> {
    let f: ffi::Bias<f32> = ffi::emu_bias_backward;
    backward("bias_backward", f, grid, block, dbias, dout, n, oc, ld)
}

/// [`bias_backward`] with bf16 storage (each `dbias` loaded, the f32 sums
/// added, rounded once).
pub fn bias_backward_bf16(
    grid: Dim3,
    block: Dim3,
    dbias: &mut [u16],
    dout: &[u16],
    n: i32,
    oc: i32,
    ld: i32,
) -> Result<(), String> {
    let f: ffi::Bias<u16> = ffi::emu_bias_backward_bf16;
    backward("bias_backward_bf16", f, grid, block, dbias, dout, n, oc, ld)
}

//! `models/gpt2/src/kernels/matmul.cu`: the bias kernels of the linear
//! layers (the products are cuBLAS calls, not emulated). Rows of the
//! `(N, OC)` side are `ld >= OC` elements apart; columns `OC..ld` are
//! neither read nor written.

use crate::check::{dim, need, product, stride};
use crate::launch::{launch, Arg, Elem};
use crate::Dim3;

/// Row lanes (warps) of `bias_backward`: `BIAS_GRAD_LANES` in matmul.cu.
pub const BIAS_GRAD_LANES: u32 = 32;

/// `(N, OC, ld)` checked: `N, OC >= 1`, `ld >= OC`; the `(N, ld)` side's
/// and the `(OC)` side's lengths.
fn bias_shape(
    k: &str,
    rows: (&str, usize),
    vec: (&str, usize),
    [n, oc, ld]: [i32; 3],
) -> Result<(), String> {
    let (n, oc) = (dim(k, "N", n)?, dim(k, "OC", oc)?);
    let ld = stride(k, "ld", ld, "OC", oc)?;
    need(k, rows.0, rows.1, product(k, &[n, ld])?)?;
    need(k, vec.0, vec.1, oc)
}

fn broadcast<S: Elem>(
    k: &str,
    grid: Dim3,
    block: Dim3,
    out: &mut [S],
    bias: &[S],
    dims: [i32; 3],
) -> Result<(), String> {
    bias_shape(k, ("out", out.len()), ("bias", bias.len()), dims)?;
    let mut args = vec![Arg::output("out", out), Arg::input("bias", bias)];
    args.extend(dims.map(Arg::I32));
    // SAFETY: out holds N·ld elements with ld >= OC, bias OC (checked): every
    // index the kernel forms, n·ld + o and o with n < N and o < OC, is
    // inside.
    unsafe { launch(k, grid, block, args) }
}

fn backward<S: Elem>(
    k: &str,
    grid: Dim3,
    block: Dim3,
    dbias: &mut [S],
    dout: &[S],
    dims: [i32; 3],
) -> Result<(), String> {
    bias_shape(k, ("dout", dout.len()), ("dbias", dbias.len()), dims)?;
    let mut args = vec![Arg::output("dbias", dbias), Arg::input("dout", dout)];
    args.extend(dims.map(Arg::I32));
    // SAFETY: dout holds N·ld elements with ld >= OC, dbias OC (checked):
    // every index the kernel forms, n·ld + o and o with n < N and o < OC, is
    // inside.
    unsafe { launch(k, grid, block, args) }
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
    broadcast("bias_broadcast", grid, block, out, bias, [n, oc, ld])
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
    broadcast("bias_broadcast_bf16", grid, block, out, bias, [n, oc, ld])
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
    backward("bias_backward", grid, block, dbias, dout, [n, oc, ld])
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
    backward("bias_backward_bf16", grid, block, dbias, dout, [n, oc, ld])
}

//! `models/gpt2/src/kernels/residual.cu`: the residual connection, forward
//! and backward, one thread per element.

use crate::check::{count, need};
use crate::launch::{launch, Arg, Elem};
use crate::Dim3;

fn forward<S: Elem>(
    k: &str,
    grid: Dim3,
    block: Dim3,
    (out, inp1, inp2): (&mut [S], &[S], &[S]),
    n: i64,
) -> Result<(), String> {
    let len = count(k, n)?;
    need(k, "out", out.len(), len)?;
    need(k, "inp1", inp1.len(), len)?;
    need(k, "inp2", inp2.len(), len)?;
    let args = vec![
        Arg::output("out", out),
        Arg::input("inp1", inp1),
        Arg::input("inp2", inp2),
        Arg::I64(n),
    ];
    // SAFETY: residual_forward[_bf16] touches element i < N of each buffer,
    // all N long (checked).
    unsafe { launch(k, grid, block, args) }
}

/// `residual_forward` (f32): `out = inp1 + inp2`. The launcher
/// (residual.rs, `residual_forward_cuda`): one thread per element, grid
/// `ceil(N / 256)`, block 256.
pub fn residual_forward(
    grid: Dim3,
    block: Dim3,
    out: &mut [f32],
    inp1: &[f32],
    inp2: &[f32],
    n: i64,
) -> Result<(), String> {
    forward("residual_forward", grid, block, (out, inp1, inp2), n)
}

/// [`residual_forward`] with bf16 storage.
pub fn residual_forward_bf16(
    grid: Dim3,
    block: Dim3,
    out: &mut [u16],
    inp1: &[u16],
    inp2: &[u16],
    n: i64,
) -> Result<(), String> {
    forward("residual_forward_bf16", grid, block, (out, inp1, inp2), n)
}

fn backward<S: Elem>(
    k: &str,
    grid: Dim3,
    block: Dim3,
    (dinp1, dinp2, dout): (&mut [S], &mut [S], &[S]),
    n: i64,
) -> Result<(), String> {
    let len = count(k, n)?;
    need(k, "dinp1", dinp1.len(), len)?;
    need(k, "dinp2", dinp2.len(), len)?;
    need(k, "dout", dout.len(), len)?;
    let args = vec![
        Arg::output("dinp1", dinp1),
        Arg::output("dinp2", dinp2),
        Arg::input("dout", dout),
        Arg::I64(n),
    ];
    // SAFETY: residual_backward[_bf16] touches element i < N of each
    // buffer, all N long (checked); dinp1 and dinp2 are distinct copies, so
    // they never alias.
    unsafe { launch(k, grid, block, args) }
}

/// `residual_backward` (f32): `dinp1 += dout; dinp2 += dout`. Launch as
/// [`residual_forward`] (residual.rs, `residual_backward_cuda`).
pub fn residual_backward(
    grid: Dim3,
    block: Dim3,
    dinp1: &mut [f32],
    dinp2: &mut [f32],
    dout: &[f32],
    n: i64,
) -> Result<(), String> {
    backward("residual_backward", grid, block, (dinp1, dinp2, dout), n)
}

/// [`residual_backward`] with bf16 storage.
pub fn residual_backward_bf16(
    grid: Dim3,
    block: Dim3,
    dinp1: &mut [u16],
    dinp2: &mut [u16],
    dout: &[u16],
    n: i64,
) -> Result<(), String> {
    backward(
        "residual_backward_bf16",
        grid,
        block,
        (dinp1, dinp2, dout),
        n,
    )
}

//! `models/gpt2/src/kernels/gelu.cu`: GELU (tanh approximation), forward
//! and backward, one thread per element.

use crate::check::{count, need};
use crate::launch::{launch, Arg, Elem};
use crate::Dim3;

fn forward<S: Elem>(
    k: &str,
    grid: Dim3,
    block: Dim3,
    out: &mut [S],
    inp: &[S],
    n: i64,
) -> Result<(), String> {
    let len = count(k, n)?;
    need(k, "out", out.len(), len)?;
    need(k, "inp", inp.len(), len)?;
    let args = vec![Arg::output("out", out), Arg::input("inp", inp), Arg::I64(n)];
    // SAFETY: gelu_forward[_bf16] touches out[i] and inp[i] for i < N, the
    // length of both (checked).
    unsafe { launch(k, grid, block, args) }
}

/// `gelu_forward` (f32): `out = 0.5·x·(1 + tanh(sqrt(2/π)·(x +
/// 0.044715·x³)))`. The launcher (gelu.rs, `gelu_forward_cuda`): one thread
/// per element, grid `ceil(N / 256)`, block 256.
pub fn gelu_forward(
    grid: Dim3,
    block: Dim3,
    out: &mut [f32],
    inp: &[f32],
    n: i64,
) -> Result<(), String> {
    forward("gelu_forward", grid, block, out, inp, n)
}

/// [`gelu_forward`] with bf16 storage.
pub fn gelu_forward_bf16(
    grid: Dim3,
    block: Dim3,
    out: &mut [u16],
    inp: &[u16],
    n: i64,
) -> Result<(), String> {
    forward("gelu_forward_bf16", grid, block, out, inp, n)
}

fn backward<S: Elem>(
    k: &str,
    grid: Dim3,
    block: Dim3,
    dinp: &mut [S],
    inp: &[S],
    dout: &[S],
    n: i64,
) -> Result<(), String> {
    let len = count(k, n)?;
    need(k, "dinp", dinp.len(), len)?;
    need(k, "inp", inp.len(), len)?;
    need(k, "dout", dout.len(), len)?;
    let args = vec![
        Arg::output("dinp", dinp),
        Arg::input("inp", inp),
        Arg::input("dout", dout),
        Arg::I64(n),
    ];
    // SAFETY: gelu_backward[_bf16] touches dinp[i], inp[i] and dout[i] for
    // i < N, the length of all three (checked).
    unsafe { launch(k, grid, block, args) }
}

/// `gelu_backward` (f32): `dinp += gelu'(inp) · dout`. Launch as
/// [`gelu_forward`] (gelu.rs, `gelu_backward_cuda`).
pub fn gelu_backward(
    grid: Dim3,
    block: Dim3,
    dinp: &mut [f32],
    inp: &[f32],
    dout: &[f32],
    n: i64,
) -> Result<(), String> {
    backward("gelu_backward", grid, block, dinp, inp, dout, n)
}

/// [`gelu_backward`] with bf16 storage.
pub fn gelu_backward_bf16(
    grid: Dim3,
    block: Dim3,
    dinp: &mut [u16],
    inp: &[u16],
    dout: &[u16],
    n: i64,
) -> Result<(), String> {
    backward("gelu_backward_bf16", grid, block, dinp, inp, dout, n)
}

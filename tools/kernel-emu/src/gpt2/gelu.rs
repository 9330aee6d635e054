//! `models/gpt2/src/kernels/gelu.cu`: GELU (tanh approximation), forward
//! and backward, one thread per element.

use bytemuck::Pod;

use super::count;
use crate::{finish, need, Dim3, Guarded};

#[rustfmt::skip]
mod ffi {
    use std::ffi::c_int;

    /// `gelu_forward[_bf16](S* out, const S* inp, long long N)`.
    pub type Forward<S> = unsafe extern "C" fn(
        u32, u32, u32, u32, u32, u32,
        *mut S, *const S, i64,
    ) -> c_int;
    /// `gelu_backward[_bf16](S* dinp, const S* inp, const S* dout, long long
    /// N)`.
    pub type Backward<S> = unsafe extern "C" fn(
        u32, u32, u32, u32, u32, u32,
        *mut S, *const S, *const S, i64,
    ) -> c_int;

    extern "C" {
        pub fn emu_gelu_forward(
            gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32,
            out: *mut f32, inp: *const f32, n: i64,
        ) -> c_int;
        pub fn emu_gelu_forward_bf16(
            gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32,
            out: *mut u16, inp: *const u16, n: i64,
        ) -> c_int;
        pub fn emu_gelu_backward(
            gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32,
            dinp: *mut f32, inp: *const f32, dout: *const f32, n: i64,
        ) -> c_int;
        pub fn emu_gelu_backward_bf16(
            gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32,
            dinp: *mut u16, inp: *const u16, dout: *const u16, n: i64,
        ) -> c_int;
    }
}

fn forward<S: Pod>(
    k: &str,
    f: ffi::Forward<S>,
    grid: Dim3,
    block: Dim3,
    out: &mut [S],
    inp: &[S],
    n: i64,
) -> Result<(), String> {
    let len = count(k, n)?;
    need(k, "out", out.len(), len)?;
    need(k, "inp", inp.len(), len)?;
    let (mut o, mut i) = (Guarded::output("out", out), Guarded::input("inp", inp));
    // SAFETY: `f` is gelu_forward[_bf16] (ffi::Forward); it touches
    // out[i] and inp[i] for i < N, the length of both (checked).
    let rc = unsafe {
        f(
            grid.0,
            grid.1,
            grid.2,
            block.0,
            block.1,
            block.2,
            o.ptr(),
            i.ptr(),
            n,
        )
    };
    finish(k, rc, vec![o, i])
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
    let f: ffi::Forward<f32> = ffi::emu_gelu_forward;
    forward("gelu_forward", f, grid, block, out, inp, n)
}

/// [`gelu_forward`] with bf16 storage.
pub fn gelu_forward_bf16(
    grid: Dim3,
    block: Dim3,
    out: &mut [u16],
    inp: &[u16],
    n: i64,
) -> Result<(), String> {
    let f: ffi::Forward<u16> = ffi::emu_gelu_forward_bf16;
    forward("gelu_forward_bf16", f, grid, block, out, inp, n)
}

fn backward<S: Pod>(
    k: &str,
    f: ffi::Backward<S>,
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
    let (mut d, mut i, mut g) = (
        Guarded::output("dinp", dinp),
        Guarded::input("inp", inp),
        Guarded::input("dout", dout),
    );
    // SAFETY: `f` is gelu_backward[_bf16] (ffi::Backward); it touches
    // dinp[i], inp[i] and dout[i] for i < N, the length of all three
    // (checked).
    let rc = unsafe {
        f(
            grid.0,
            grid.1,
            grid.2,
            block.0,
            block.1,
            block.2,
            d.ptr(),
            i.ptr(),
            g.ptr(),
            n,
        )
    };
    finish(k, rc, vec![d, i, g])
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
    let f: ffi::Backward<f32> = ffi::emu_gelu_backward;
    backward("gelu_backward", f, grid, block, dinp, inp, dout, n)
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
    let f: ffi::Backward<u16> = ffi::emu_gelu_backward_bf16;
    backward("gelu_backward_bf16", f, grid, block, dinp, inp, dout, n)
}

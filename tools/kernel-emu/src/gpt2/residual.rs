//! `models/gpt2/src/kernels/residual.cu`: the residual connection, forward
//! and backward, one thread per element.

use bytemuck::Pod;

use super::count;
use crate::{finish, need, Dim3, Guarded};

#[rustfmt::skip]
mod ffi {
    use std::ffi::c_int;

    /// `residual_forward[_bf16](S* out, const S* inp1, const S* inp2, long
    /// long N)`.
    pub type Forward<S> = unsafe extern "C" fn(
        u32, u32, u32, u32, u32, u32,
        *mut S, *const S, *const S, i64,
    ) -> c_int;
    /// `residual_backward[_bf16](S* dinp1, S* dinp2, const S* dout, long
    /// long N)`.
    pub type Backward<S> = unsafe extern "C" fn(
        u32, u32, u32, u32, u32, u32,
        *mut S, *mut S, *const S, i64,
    ) -> c_int;

    extern "C" {
        pub fn emu_residual_forward(
            gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32,
            out: *mut f32, inp1: *const f32, inp2: *const f32, n: i64,
        ) -> c_int;
        pub fn emu_residual_forward_bf16(
            gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32,
            out: *mut u16, inp1: *const u16, inp2: *const u16, n: i64,
        ) -> c_int;
        pub fn emu_residual_backward(
            gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32,
            dinp1: *mut f32, dinp2: *mut f32, dout: *const f32, n: i64,
        ) -> c_int;
        pub fn emu_residual_backward_bf16(
            gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32,
            dinp1: *mut u16, dinp2: *mut u16, dout: *const u16, n: i64,
        ) -> c_int;
    }
}

fn forward<S: Pod>(
    k: &str,
    f: ffi::Forward<S>,
    grid: Dim3,
    block: Dim3,
    out: &mut [S],
    inp1: &[S],
    inp2: &[S],
    n: i64,
) -> Result<(), String> {
    let len = count(k, n)?;
    need(k, "out", out.len(), len)?;
    need(k, "inp1", inp1.len(), len)?;
    need(k, "inp2", inp2.len(), len)?;
    let (mut o, mut a, mut b) = (
        Guarded::output("out", out),
        Guarded::input("inp1", inp1),
        Guarded::input("inp2", inp2),
    );
    // SAFETY: `f` is residual_forward[_bf16] (ffi::Forward); it touches
    // element i < N of each buffer, all N long (checked).
    let rc = unsafe {
        f(
            grid.0,
            grid.1,
            grid.2,
            block.0,
            block.1,
            block.2,
            o.ptr(),
            a.ptr(),
            b.ptr(),
            n,
        )
    };
    finish(k, rc, vec![o, a, b])
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
    let f: ffi::Forward<f32> = ffi::emu_residual_forward;
    forward("residual_forward", f, grid, block, out, inp1, inp2, n)
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
    let f: ffi::Forward<u16> = ffi::emu_residual_forward_bf16;
    forward("residual_forward_bf16", f, grid, block, out, inp1, inp2, n)
}

fn backward<S: Pod>(
    k: &str,
    f: ffi::Backward<S>,
    grid: Dim3,
    block: Dim3,
    dinp1: &mut [S],
    dinp2: &mut [S],
    dout: &[S],
    n: i64,
) -> Result<(), String> {
    let len = count(k, n)?;
    need(k, "dinp1", dinp1.len(), len)?;
    need(k, "dinp2", dinp2.len(), len)?;
    need(k, "dout", dout.len(), len)?;
    let (mut a, mut b, mut g) = (
        Guarded::output("dinp1", dinp1),
        Guarded::output("dinp2", dinp2),
        Guarded::input("dout", dout),
    );
    // SAFETY: `f` is residual_backward[_bf16] (ffi::Backward); it touches
    // element i < N of each buffer, all N long (checked); dinp1 and dinp2
    // are distinct copies, so they never alias.
    let rc = unsafe {
        f(
            grid.0,
            grid.1,
            grid.2,
            block.0,
            block.1,
            block.2,
            a.ptr(),
            b.ptr(),
            g.ptr(),
            n,
        )
    };
    finish(k, rc, vec![a, b, g])
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
    let f: ffi::Backward<f32> = ffi::emu_residual_backward;
    backward("residual_backward", f, grid, block, dinp1, dinp2, dout, n)
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
    let f: ffi::Backward<u16> = ffi::emu_residual_backward_bf16;
    let k = "residual_backward_bf16";
    backward(k, f, grid, block, dinp1, dinp2, dout, n)
}

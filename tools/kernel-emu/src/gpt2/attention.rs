//! `models/gpt2/src/kernels/attention.cu`: the permutes between the packed
//! `(B, T, 3C)` activation and the per-head `(B, NH, T, hs)` tensors, and
//! the causal softmax, forward and backward (the batched products between
//! them are cuBLAS calls, not emulated).

use bytemuck::Pod;

use super::dim;
use crate::{finish, need, product, Dim3, Guarded};

#[rustfmt::skip]
mod ffi {
    use std::ffi::c_int;

    /// `attention_permute[_bf16](S* q, S* k, S* v, const S* inp, int B, int
    /// T, int NH, int hs)`.
    pub type Permute<S> = unsafe extern "C" fn(
        u32, u32, u32, u32, u32, u32,
        *mut S, *mut S, *mut S, *const S, c_int, c_int, c_int, c_int,
    ) -> c_int;
    /// `attention_permute_backward[_bf16](S* dinp, const S* dq, const S*
    /// dk, const S* dv, int B, int T, int NH, int hs)`.
    pub type PermuteBackward<S> = unsafe extern "C" fn(
        u32, u32, u32, u32, u32, u32,
        *mut S, *const S, *const S, *const S, c_int, c_int, c_int, c_int,
    ) -> c_int;
    /// `attention_unpermute[_bf16](S* out, const S* vaccum, int B, int T,
    /// int NH, int hs)` and `attention_unpermute_backward[_bf16](S* dvaccum,
    /// const S* dout, ...)`.
    pub type Unpermute<S> = unsafe extern "C" fn(
        u32, u32, u32, u32, u32, u32,
        *mut S, *const S, c_int, c_int, c_int, c_int,
    ) -> c_int;
    /// `attention_softmax_forward[_bf16](S* att, const S* preatt, int BNH,
    /// int T, float scale)`.
    pub type SoftmaxForward<S> = unsafe extern "C" fn(
        u32, u32, u32, u32, u32, u32,
        *mut S, *const S, c_int, c_int, f32,
    ) -> c_int;
    /// `attention_softmax_backward[_bf16](S* dpreatt, const S* datt, const
    /// S* att, int BNH, int T, float scale)`.
    pub type SoftmaxBackward<S> = unsafe extern "C" fn(
        u32, u32, u32, u32, u32, u32,
        *mut S, *const S, *const S, c_int, c_int, f32,
    ) -> c_int;

    extern "C" {
        pub fn emu_attention_permute(
            gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32,
            q: *mut f32, k: *mut f32, v: *mut f32, inp: *const f32,
            b: c_int, t: c_int, nh: c_int, hs: c_int,
        ) -> c_int;
        pub fn emu_attention_permute_bf16(
            gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32,
            q: *mut u16, k: *mut u16, v: *mut u16, inp: *const u16,
            b: c_int, t: c_int, nh: c_int, hs: c_int,
        ) -> c_int;
        pub fn emu_attention_permute_backward(
            gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32,
            dinp: *mut f32, dq: *const f32, dk: *const f32, dv: *const f32,
            b: c_int, t: c_int, nh: c_int, hs: c_int,
        ) -> c_int;
        pub fn emu_attention_permute_backward_bf16(
            gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32,
            dinp: *mut u16, dq: *const u16, dk: *const u16, dv: *const u16,
            b: c_int, t: c_int, nh: c_int, hs: c_int,
        ) -> c_int;
        pub fn emu_attention_unpermute(
            gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32,
            out: *mut f32, vaccum: *const f32, b: c_int, t: c_int, nh: c_int, hs: c_int,
        ) -> c_int;
        pub fn emu_attention_unpermute_bf16(
            gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32,
            out: *mut u16, vaccum: *const u16, b: c_int, t: c_int, nh: c_int, hs: c_int,
        ) -> c_int;
        pub fn emu_attention_unpermute_backward(
            gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32,
            dvaccum: *mut f32, dout: *const f32, b: c_int, t: c_int, nh: c_int, hs: c_int,
        ) -> c_int;
        pub fn emu_attention_unpermute_backward_bf16(
            gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32,
            dvaccum: *mut u16, dout: *const u16, b: c_int, t: c_int, nh: c_int, hs: c_int,
        ) -> c_int;
        pub fn emu_attention_softmax_forward(
            gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32,
            att: *mut f32, preatt: *const f32, bnh: c_int, t: c_int, scale: f32,
        ) -> c_int;
        pub fn emu_attention_softmax_forward_bf16(
            gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32,
            att: *mut u16, preatt: *const u16, bnh: c_int, t: c_int, scale: f32,
        ) -> c_int;
        pub fn emu_attention_softmax_backward(
            gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32,
            dpreatt: *mut f32, datt: *const f32, att: *const f32, bnh: c_int, t: c_int,
            scale: f32,
        ) -> c_int;
        pub fn emu_attention_softmax_backward_bf16(
            gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32,
            dpreatt: *mut u16, datt: *const u16, att: *const u16, bnh: c_int, t: c_int,
            scale: f32,
        ) -> c_int;
    }
}

/// `B·NH·T·hs` (= `B·T·C`, the elements of a head tensor) for `(B, T, NH,
/// hs)`, each at least 1.
fn heads(k: &str, b: i32, t: i32, nh: i32, hs: i32) -> Result<usize, String> {
    let (b, t) = (dim(k, "B", b)?, dim(k, "T", t)?);
    let (nh, hs) = (dim(k, "NH", nh)?, dim(k, "hs", hs)?);
    product(k, &[b, t, nh, hs])
}

fn permute<S: Pod>(
    k: &str,
    f: ffi::Permute<S>,
    grid: Dim3,
    block: Dim3,
    (q, kk, v): (&mut [S], &mut [S], &mut [S]),
    inp: &[S],
    dims: [i32; 4],
) -> Result<(), String> {
    let n = heads(k, dims[0], dims[1], dims[2], dims[3])?;
    need(k, "q", q.len(), n)?;
    need(k, "k", kk.len(), n)?;
    need(k, "v", v.len(), n)?;
    need(k, "inp", inp.len(), product(k, &[n, 3])?)?;
    let (mut gq, mut gk, mut gv, mut i) = (
        Guarded::output("q", q),
        Guarded::output("k", kk),
        Guarded::output("v", v),
        Guarded::input("inp", inp),
    );
    let [b, t, nh, hs] = dims;
    // SAFETY: `f` is attention_permute[_bf16] (ffi::Permute); q, k and v
    // hold (B, NH, T, hs), inp (B, T, 3·NH·hs) (checked): the kernel touches
    // element idx < B·NH·T·hs of each head tensor and its places in inp.
    let rc = unsafe {
        f(
            grid.0,
            grid.1,
            grid.2,
            block.0,
            block.1,
            block.2,
            gq.ptr(),
            gk.ptr(),
            gv.ptr(),
            i.ptr(),
            b,
            t,
            nh,
            hs,
        )
    };
    finish(k, rc, vec![gq, gk, gv, i])
}

/// `attention_permute` (f32): `q`, `k`, `v` `(B, NH, T, hs)` from the packed
/// `inp` `(B, T, 3C)`, `C = NH·hs`. The launcher (attention.rs,
/// `attention_forward_cuda`): one thread per head element, grid
/// `ceil(B·T·C / 256)`, block 256.
pub fn attention_permute(
    grid: Dim3,
    block: Dim3,
    q: &mut [f32],
    k: &mut [f32],
    v: &mut [f32],
    inp: &[f32],
    b: i32,
    t: i32,
    nh: i32,
    hs: i32,
) -> Result<(), String> {
    let f: ffi::Permute<f32> = ffi::emu_attention_permute;
    let dims = [b, t, nh, hs];
    permute("attention_permute", f, grid, block, (q, k, v), inp, dims)
}

/// [`attention_permute`] with bf16 storage.
pub fn attention_permute_bf16(
    grid: Dim3,
    block: Dim3,
    q: &mut [u16],
    k: &mut [u16],
    v: &mut [u16],
    inp: &[u16],
    b: i32,
    t: i32,
    nh: i32,
    hs: i32,
) -> Result<(), String> {
    let f: ffi::Permute<u16> = ffi::emu_attention_permute_bf16;
    let dims = [b, t, nh, hs];
    permute(
        "attention_permute_bf16",
        f,
        grid,
        block,
        (q, k, v),
        inp,
        dims,
    )
}

fn permute_backward<S: Pod>(
    k: &str,
    f: ffi::PermuteBackward<S>,
    grid: Dim3,
    block: Dim3,
    dinp: &mut [S],
    (dq, dk, dv): (&[S], &[S], &[S]),
    dims: [i32; 4],
) -> Result<(), String> {
    let n = heads(k, dims[0], dims[1], dims[2], dims[3])?;
    need(k, "dinp", dinp.len(), product(k, &[n, 3])?)?;
    need(k, "dq", dq.len(), n)?;
    need(k, "dk", dk.len(), n)?;
    need(k, "dv", dv.len(), n)?;
    let (mut di, mut gq, mut gk, mut gv) = (
        Guarded::output("dinp", dinp),
        Guarded::input("dq", dq),
        Guarded::input("dk", dk),
        Guarded::input("dv", dv),
    );
    let [b, t, nh, hs] = dims;
    // SAFETY: `f` is attention_permute_backward[_bf16]
    // (ffi::PermuteBackward); dinp holds (B, T, 3·NH·hs), dq, dk and dv
    // (B, NH, T, hs) (checked): the kernel touches element idx < B·NH·T·hs
    // of each head tensor and its places in dinp.
    let rc = unsafe {
        f(
            grid.0,
            grid.1,
            grid.2,
            block.0,
            block.1,
            block.2,
            di.ptr(),
            gq.ptr(),
            gk.ptr(),
            gv.ptr(),
            b,
            t,
            nh,
            hs,
        )
    };
    finish(k, rc, vec![di, gq, gk, gv])
}

/// `attention_permute_backward` (f32): `dinp` `(B, T, 3C)` `+=` `dq | dk |
/// dv` `(B, NH, T, hs)`. The launcher (attention.rs,
/// `attention_backward_cuda`): grid `ceil(B·T·C / 256)`, block 256.
pub fn attention_permute_backward(
    grid: Dim3,
    block: Dim3,
    dinp: &mut [f32],
    dq: &[f32],
    dk: &[f32],
    dv: &[f32],
    b: i32,
    t: i32,
    nh: i32,
    hs: i32,
) -> Result<(), String> {
    let f: ffi::PermuteBackward<f32> = ffi::emu_attention_permute_backward;
    let k = "attention_permute_backward";
    permute_backward(k, f, grid, block, dinp, (dq, dk, dv), [b, t, nh, hs])
}

/// [`attention_permute_backward`] with bf16 storage (each sum in f32,
/// rounded once).
pub fn attention_permute_backward_bf16(
    grid: Dim3,
    block: Dim3,
    dinp: &mut [u16],
    dq: &[u16],
    dk: &[u16],
    dv: &[u16],
    b: i32,
    t: i32,
    nh: i32,
    hs: i32,
) -> Result<(), String> {
    let f: ffi::PermuteBackward<u16> = ffi::emu_attention_permute_backward_bf16;
    let k = "attention_permute_backward_bf16";
    permute_backward(k, f, grid, block, dinp, (dq, dk, dv), [b, t, nh, hs])
}

/// Both unpermutes: `dst` and `src` are the `(B, T, C)` and the `(B, NH,
/// T, hs)` tensor, in the kernel's order.
fn unpermute<S: Pod>(
    k: &str,
    f: ffi::Unpermute<S>,
    grid: Dim3,
    block: Dim3,
    (dst_name, dst): (&'static str, &mut [S]),
    (src_name, src): (&'static str, &[S]),
    [b, t, nh, hs]: [i32; 4],
) -> Result<(), String> {
    let n = heads(k, b, t, nh, hs)?;
    need(k, dst_name, dst.len(), n)?;
    need(k, src_name, src.len(), n)?;
    let (mut d, mut s) = (
        Guarded::output(dst_name, dst),
        Guarded::input(src_name, src),
    );
    // SAFETY: `f` is attention_unpermute[_bf16] or
    // attention_unpermute_backward[_bf16] (ffi::Unpermute); both buffers
    // hold B·NH·T·hs = B·T·C elements (checked) and the kernels touch
    // element idx < B·NH·T·hs of the head tensor and its place in the
    // (B, T, C) one.
    let rc = unsafe {
        f(
            grid.0,
            grid.1,
            grid.2,
            block.0,
            block.1,
            block.2,
            d.ptr(),
            s.ptr(),
            b,
            t,
            nh,
            hs,
        )
    };
    finish(k, rc, vec![d, s])
}

/// `attention_unpermute` (f32): `out` `(B, T, C)` from `vaccum` `(B, NH,
/// T, hs)`. The launcher (attention.rs, `attention_forward_cuda`): grid
/// `ceil(B·T·C / 256)`, block 256.
pub fn attention_unpermute(
    grid: Dim3,
    block: Dim3,
    out: &mut [f32],
    vaccum: &[f32],
    b: i32,
    t: i32,
    nh: i32,
    hs: i32,
) -> Result<(), String> {
    let f: ffi::Unpermute<f32> = ffi::emu_attention_unpermute;
    let (d, s) = (("out", out), ("vaccum", vaccum));
    unpermute("attention_unpermute", f, grid, block, d, s, [b, t, nh, hs])
}

/// [`attention_unpermute`] with bf16 storage.
pub fn attention_unpermute_bf16(
    grid: Dim3,
    block: Dim3,
    out: &mut [u16],
    vaccum: &[u16],
    b: i32,
    t: i32,
    nh: i32,
    hs: i32,
) -> Result<(), String> {
    let f: ffi::Unpermute<u16> = ffi::emu_attention_unpermute_bf16;
    let (d, s) = (("out", out), ("vaccum", vaccum));
    let k = "attention_unpermute_bf16";
    unpermute(k, f, grid, block, d, s, [b, t, nh, hs])
}

/// `attention_unpermute_backward` (f32): `dvaccum` `(B, NH, T, hs)`
/// overwritten from `dout` `(B, T, C)`. The launcher (attention.rs,
/// `attention_backward_cuda`): grid `ceil(B·T·C / 256)`, block 256.
pub fn attention_unpermute_backward(
    grid: Dim3,
    block: Dim3,
    dvaccum: &mut [f32],
    dout: &[f32],
    b: i32,
    t: i32,
    nh: i32,
    hs: i32,
) -> Result<(), String> {
    let f: ffi::Unpermute<f32> = ffi::emu_attention_unpermute_backward;
    let (d, s) = (("dvaccum", dvaccum), ("dout", dout));
    let k = "attention_unpermute_backward";
    unpermute(k, f, grid, block, d, s, [b, t, nh, hs])
}

/// [`attention_unpermute_backward`] with bf16 storage.
pub fn attention_unpermute_backward_bf16(
    grid: Dim3,
    block: Dim3,
    dvaccum: &mut [u16],
    dout: &[u16],
    b: i32,
    t: i32,
    nh: i32,
    hs: i32,
) -> Result<(), String> {
    let f: ffi::Unpermute<u16> = ffi::emu_attention_unpermute_backward_bf16;
    let (d, s) = (("dvaccum", dvaccum), ("dout", dout));
    let k = "attention_unpermute_backward_bf16";
    unpermute(k, f, grid, block, d, s, [b, t, nh, hs])
}

/// `B·NH·T·T` for `(BNH, T)`.
fn scores(k: &str, bnh: i32, t: i32) -> Result<usize, String> {
    let (bnh, t) = (dim(k, "BNH", bnh)?, dim(k, "T", t)?);
    product(k, &[bnh, t, t])
}

fn softmax_forward<S: Pod>(
    k: &str,
    f: ffi::SoftmaxForward<S>,
    grid: Dim3,
    block: Dim3,
    att: &mut [S],
    preatt: &[S],
    bnh: i32,
    t: i32,
    scale: f32,
) -> Result<(), String> {
    let n = scores(k, bnh, t)?;
    need(k, "att", att.len(), n)?;
    need(k, "preatt", preatt.len(), n)?;
    let (mut a, mut p) = (
        Guarded::output("att", att),
        Guarded::input("preatt", preatt),
    );
    // SAFETY: `f` is attention_softmax_forward[_bf16]
    // (ffi::SoftmaxForward); att and preatt hold (B·NH·T, T) (checked) and
    // the kernel touches columns < T of rows < B·NH·T.
    let rc = unsafe {
        f(
            grid.0,
            grid.1,
            grid.2,
            block.0,
            block.1,
            block.2,
            a.ptr(),
            p.ptr(),
            bnh,
            t,
            scale,
        )
    };
    finish(k, rc, vec![a, p])
}

/// `attention_softmax_forward` (f32): `att[r, t2]` = the softmax of `scale ·
/// preatt[r, :t+1]` for `t2 <= t`, 0 above, row `r = (b·NH + h)·T + t`. The
/// launcher (attention.rs, `attention_forward_cuda`): one warp per row,
/// grid `ceil(B·NH·T / 8)`, block 256, `scale` 1 (the product applied
/// `1 / sqrt(hs)`).
pub fn attention_softmax_forward(
    grid: Dim3,
    block: Dim3,
    att: &mut [f32],
    preatt: &[f32],
    bnh: i32,
    t: i32,
    scale: f32,
) -> Result<(), String> {
    let f: ffi::SoftmaxForward<f32> = ffi::emu_attention_softmax_forward;
    let k = "attention_softmax_forward";
    softmax_forward(k, f, grid, block, att, preatt, bnh, t, scale)
}

/// [`attention_softmax_forward`] with bf16 storage.
pub fn attention_softmax_forward_bf16(
    grid: Dim3,
    block: Dim3,
    att: &mut [u16],
    preatt: &[u16],
    bnh: i32,
    t: i32,
    scale: f32,
) -> Result<(), String> {
    let f: ffi::SoftmaxForward<u16> = ffi::emu_attention_softmax_forward_bf16;
    let k = "attention_softmax_forward_bf16";
    softmax_forward(k, f, grid, block, att, preatt, bnh, t, scale)
}

fn softmax_backward<S: Pod>(
    k: &str,
    f: ffi::SoftmaxBackward<S>,
    grid: Dim3,
    block: Dim3,
    dpreatt: &mut [S],
    datt: &[S],
    att: &[S],
    bnh: i32,
    t: i32,
    scale: f32,
) -> Result<(), String> {
    let n = scores(k, bnh, t)?;
    need(k, "dpreatt", dpreatt.len(), n)?;
    need(k, "datt", datt.len(), n)?;
    need(k, "att", att.len(), n)?;
    let (mut dp, mut da, mut a) = (
        Guarded::output("dpreatt", dpreatt),
        Guarded::input("datt", datt),
        Guarded::input("att", att),
    );
    // SAFETY: `f` is attention_softmax_backward[_bf16]
    // (ffi::SoftmaxBackward); the three buffers hold (B·NH·T, T) (checked)
    // and the kernel touches columns < T of rows < B·NH·T.
    let rc = unsafe {
        f(
            grid.0,
            grid.1,
            grid.2,
            block.0,
            block.1,
            block.2,
            dp.ptr(),
            da.ptr(),
            a.ptr(),
            bnh,
            t,
            scale,
        )
    };
    finish(k, rc, vec![dp, da, a])
}

/// `attention_softmax_backward` (f32): `dpreatt[r, t2] = scale · att[r, t2]
/// · (datt[r, t2] - Σ_{t3 <= t} att[r, t3] · datt[r, t3])` for `t2 <= t`, 0
/// above (overwrites). The launcher (attention.rs,
/// `attention_backward_cuda`): one warp per row, grid `ceil(B·NH·T / 8)`,
/// block 256, `scale = 1 / sqrt(hs)`.
pub fn attention_softmax_backward(
    grid: Dim3,
    block: Dim3,
    dpreatt: &mut [f32],
    datt: &[f32],
    att: &[f32],
    bnh: i32,
    t: i32,
    scale: f32,
) -> Result<(), String> {
    let f: ffi::SoftmaxBackward<f32> = ffi::emu_attention_softmax_backward;
    let k = "attention_softmax_backward";
    softmax_backward(k, f, grid, block, dpreatt, datt, att, bnh, t, scale)
}

/// [`attention_softmax_backward`] with bf16 storage.
pub fn attention_softmax_backward_bf16(
    grid: Dim3,
    block: Dim3,
    dpreatt: &mut [u16],
    datt: &[u16],
    att: &[u16],
    bnh: i32,
    t: i32,
    scale: f32,
) -> Result<(), String> {
    let f: ffi::SoftmaxBackward<u16> = ffi::emu_attention_softmax_backward_bf16;
    let k = "attention_softmax_backward_bf16";
    softmax_backward(k, f, grid, block, dpreatt, datt, att, bnh, t, scale)
}

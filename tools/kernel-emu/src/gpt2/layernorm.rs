//! `models/gpt2/src/kernels/layernorm.cu`: layer normalisation over `C`
//! channels of `N` rows, forward (alone, or fused with the residual sum),
//! and backward (the input gradient, then the parameter gradients).

use bytemuck::Pod;

use super::{dim, present, ptr_or_null};
use crate::{finish, need, product, Dim3, Guarded};

#[rustfmt::skip]
mod ffi {
    use std::ffi::c_int;

    /// `layernorm_forward[_bf16](S* out, float* mean, float* rstd, const S*
    /// inp, const S* weight, const S* bias, int N, int C)`.
    pub type Forward<S> = unsafe extern "C" fn(
        u32, u32, u32, u32, u32, u32,
        *mut S, *mut f32, *mut f32, *const S, *const S, *const S, c_int, c_int,
    ) -> c_int;
    /// `layernorm_residual_forward[_bf16](S* residual, S* out, float* mean,
    /// float* rstd, const S* inp1, const S* inp2, const S* weight, const S*
    /// bias, int N, int C)`.
    pub type ResidualForward<S> = unsafe extern "C" fn(
        u32, u32, u32, u32, u32, u32,
        *mut S, *mut S, *mut f32, *mut f32, *const S, *const S, *const S, *const S,
        c_int, c_int,
    ) -> c_int;
    /// `layernorm_backward_input[_bf16](S* dinp, const S* dres, const S*
    /// dout, const S* inp, const S* weight, const float* mean, const float*
    /// rstd, int N, int C)`.
    pub type BackwardInput<S> = unsafe extern "C" fn(
        u32, u32, u32, u32, u32, u32,
        *mut S, *const S, *const S, *const S, *const S, *const f32, *const f32,
        c_int, c_int,
    ) -> c_int;
    /// `layernorm_backward_params[_bf16](S* dweight, S* dbias, const S*
    /// dout, const S* inp, const float* mean, const float* rstd, int N, int
    /// C)`.
    pub type BackwardParams<S> = unsafe extern "C" fn(
        u32, u32, u32, u32, u32, u32,
        *mut S, *mut S, *const S, *const S, *const f32, *const f32, c_int, c_int,
    ) -> c_int;

    extern "C" {
        pub fn emu_layernorm_forward(
            gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32,
            out: *mut f32, mean: *mut f32, rstd: *mut f32, inp: *const f32,
            weight: *const f32, bias: *const f32, n: c_int, c: c_int,
        ) -> c_int;
        pub fn emu_layernorm_forward_bf16(
            gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32,
            out: *mut u16, mean: *mut f32, rstd: *mut f32, inp: *const u16,
            weight: *const u16, bias: *const u16, n: c_int, c: c_int,
        ) -> c_int;
        pub fn emu_layernorm_residual_forward(
            gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32,
            residual: *mut f32, out: *mut f32, mean: *mut f32, rstd: *mut f32,
            inp1: *const f32, inp2: *const f32, weight: *const f32, bias: *const f32,
            n: c_int, c: c_int,
        ) -> c_int;
        pub fn emu_layernorm_residual_forward_bf16(
            gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32,
            residual: *mut u16, out: *mut u16, mean: *mut f32, rstd: *mut f32,
            inp1: *const u16, inp2: *const u16, weight: *const u16, bias: *const u16,
            n: c_int, c: c_int,
        ) -> c_int;
        pub fn emu_layernorm_backward_input(
            gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32,
            dinp: *mut f32, dres: *const f32, dout: *const f32, inp: *const f32,
            weight: *const f32, mean: *const f32, rstd: *const f32, n: c_int, c: c_int,
        ) -> c_int;
        pub fn emu_layernorm_backward_input_bf16(
            gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32,
            dinp: *mut u16, dres: *const u16, dout: *const u16, inp: *const u16,
            weight: *const u16, mean: *const f32, rstd: *const f32, n: c_int, c: c_int,
        ) -> c_int;
        pub fn emu_layernorm_backward_params(
            gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32,
            dweight: *mut f32, dbias: *mut f32, dout: *const f32, inp: *const f32,
            mean: *const f32, rstd: *const f32, n: c_int, c: c_int,
        ) -> c_int;
        pub fn emu_layernorm_backward_params_bf16(
            gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32,
            dweight: *mut u16, dbias: *mut u16, dout: *const u16, inp: *const u16,
            mean: *const f32, rstd: *const f32, n: c_int, c: c_int,
        ) -> c_int;
    }
}

/// `(N, C, N·C)` for `(N, C)`, both at least 1.
fn shape(k: &str, n: i32, c: i32) -> Result<(usize, usize, usize), String> {
    let (n, c) = (dim(k, "N", n)?, dim(k, "C", c)?);
    Ok((n, c, product(k, &[n, c])?))
}

fn forward<S: Pod>(
    k: &str,
    f: ffi::Forward<S>,
    grid: Dim3,
    block: Dim3,
    out: &mut [S],
    mean: &mut [f32],
    rstd: &mut [f32],
    inp: &[S],
    weight: &[S],
    bias: &[S],
    n: i32,
    c: i32,
) -> Result<(), String> {
    let (rows, cols, nc) = shape(k, n, c)?;
    need(k, "out", out.len(), nc)?;
    need(k, "mean", mean.len(), rows)?;
    need(k, "rstd", rstd.len(), rows)?;
    need(k, "inp", inp.len(), nc)?;
    need(k, "weight", weight.len(), cols)?;
    need(k, "bias", bias.len(), cols)?;
    let (mut o, mut m, mut r) = (
        Guarded::output("out", out),
        Guarded::output("mean", mean),
        Guarded::output("rstd", rstd),
    );
    let (mut i, mut w, mut b) = (
        Guarded::input("inp", inp),
        Guarded::input("weight", weight),
        Guarded::input("bias", bias),
    );
    // SAFETY: `f` is layernorm_forward[_bf16] (ffi::Forward); out and inp
    // hold (N, C), mean and rstd N, weight and bias C (checked), and the
    // kernel touches rows < N, channels < C.
    let rc = unsafe {
        f(
            grid.0,
            grid.1,
            grid.2,
            block.0,
            block.1,
            block.2,
            o.ptr(),
            m.ptr(),
            r.ptr(),
            i.ptr(),
            w.ptr(),
            b.ptr(),
            n,
            c,
        )
    };
    finish(k, rc, vec![o, m, r, i, w, b])
}

/// `layernorm_forward` (f32): `out = (inp - mean) · rstd · weight + bias`
/// per row of `C`, saving `mean` and `rstd` (`N`). The launcher
/// (layernorm.rs, `forward_cuda`): one warp per row, grid `ceil(N / 8)`,
/// block 256 (`Launcher::warp_rows`).
pub fn layernorm_forward(
    grid: Dim3,
    block: Dim3,
    out: &mut [f32],
    mean: &mut [f32],
    rstd: &mut [f32],
    inp: &[f32],
    weight: &[f32],
    bias: &[f32],
    n: i32,
    c: i32,
) -> Result<(), String> {
    let f: ffi::Forward<f32> = ffi::emu_layernorm_forward;
    let k = "layernorm_forward";
    forward(k, f, grid, block, out, mean, rstd, inp, weight, bias, n, c)
}

/// [`layernorm_forward`] with bf16 `out`, `inp`, `weight`, `bias` (`mean`
/// and `rstd` stay `f32`).
pub fn layernorm_forward_bf16(
    grid: Dim3,
    block: Dim3,
    out: &mut [u16],
    mean: &mut [f32],
    rstd: &mut [f32],
    inp: &[u16],
    weight: &[u16],
    bias: &[u16],
    n: i32,
    c: i32,
) -> Result<(), String> {
    let f: ffi::Forward<u16> = ffi::emu_layernorm_forward_bf16;
    let k = "layernorm_forward_bf16";
    forward(k, f, grid, block, out, mean, rstd, inp, weight, bias, n, c)
}

fn residual_forward<S: Pod>(
    k: &str,
    f: ffi::ResidualForward<S>,
    grid: Dim3,
    block: Dim3,
    (residual, out, mean, rstd): (&mut [S], &mut [S], &mut [f32], &mut [f32]),
    (inp1, inp2, weight, bias): (&[S], &[S], &[S], &[S]),
    n: i32,
    c: i32,
) -> Result<(), String> {
    let (rows, cols, nc) = shape(k, n, c)?;
    need(k, "residual", residual.len(), nc)?;
    need(k, "out", out.len(), nc)?;
    need(k, "mean", mean.len(), rows)?;
    need(k, "rstd", rstd.len(), rows)?;
    need(k, "inp1", inp1.len(), nc)?;
    need(k, "inp2", inp2.len(), nc)?;
    need(k, "weight", weight.len(), cols)?;
    need(k, "bias", bias.len(), cols)?;
    let (mut res, mut o, mut m, mut r) = (
        Guarded::output("residual", residual),
        Guarded::output("out", out),
        Guarded::output("mean", mean),
        Guarded::output("rstd", rstd),
    );
    let (mut i1, mut i2, mut w, mut b) = (
        Guarded::input("inp1", inp1),
        Guarded::input("inp2", inp2),
        Guarded::input("weight", weight),
        Guarded::input("bias", bias),
    );
    // SAFETY: `f` is layernorm_residual_forward[_bf16]
    // (ffi::ResidualForward); residual, out, inp1 and inp2 hold (N, C), mean
    // and rstd N, weight and bias C (checked), and the kernel touches rows
    // < N, channels < C.
    let rc = unsafe {
        f(
            grid.0,
            grid.1,
            grid.2,
            block.0,
            block.1,
            block.2,
            res.ptr(),
            o.ptr(),
            m.ptr(),
            r.ptr(),
            i1.ptr(),
            i2.ptr(),
            w.ptr(),
            b.ptr(),
            n,
            c,
        )
    };
    finish(k, rc, vec![res, o, m, r, i1, i2, w, b])
}

/// `layernorm_residual_forward` (f32): `residual = inp1 + inp2`, then
/// [`layernorm_forward`] of the stored sum. Launch as
/// [`layernorm_forward`] (layernorm.rs, `forward_cuda`).
pub fn layernorm_residual_forward(
    grid: Dim3,
    block: Dim3,
    residual: &mut [f32],
    out: &mut [f32],
    mean: &mut [f32],
    rstd: &mut [f32],
    inp1: &[f32],
    inp2: &[f32],
    weight: &[f32],
    bias: &[f32],
    n: i32,
    c: i32,
) -> Result<(), String> {
    let f: ffi::ResidualForward<f32> = ffi::emu_layernorm_residual_forward;
    let outs = (residual, out, mean, rstd);
    let ins = (inp1, inp2, weight, bias);
    residual_forward(
        "layernorm_residual_forward",
        f,
        grid,
        block,
        outs,
        ins,
        n,
        c,
    )
}

/// [`layernorm_residual_forward`] with bf16 storage (`mean`, `rstd` `f32`).
pub fn layernorm_residual_forward_bf16(
    grid: Dim3,
    block: Dim3,
    residual: &mut [u16],
    out: &mut [u16],
    mean: &mut [f32],
    rstd: &mut [f32],
    inp1: &[u16],
    inp2: &[u16],
    weight: &[u16],
    bias: &[u16],
    n: i32,
    c: i32,
) -> Result<(), String> {
    let f: ffi::ResidualForward<u16> = ffi::emu_layernorm_residual_forward_bf16;
    let outs = (residual, out, mean, rstd);
    let ins = (inp1, inp2, weight, bias);
    let k = "layernorm_residual_forward_bf16";
    residual_forward(k, f, grid, block, outs, ins, n, c)
}

fn backward_input<S: Pod>(
    k: &str,
    f: ffi::BackwardInput<S>,
    grid: Dim3,
    block: Dim3,
    dinp: &mut [S],
    dres: Option<&[S]>,
    (dout, inp, weight): (&[S], &[S], &[S]),
    (mean, rstd): (&[f32], &[f32]),
    n: i32,
    c: i32,
) -> Result<(), String> {
    let (rows, cols, nc) = shape(k, n, c)?;
    need(k, "dinp", dinp.len(), nc)?;
    if let Some(dres) = dres {
        need(k, "dres", dres.len(), nc)?;
    }
    need(k, "dout", dout.len(), nc)?;
    need(k, "inp", inp.len(), nc)?;
    need(k, "weight", weight.len(), cols)?;
    need(k, "mean", mean.len(), rows)?;
    need(k, "rstd", rstd.len(), rows)?;
    let mut di = Guarded::output("dinp", dinp);
    let mut dr = dres.map(|d| Guarded::input("dres", d));
    let (mut go, mut i, mut w, mut m, mut r) = (
        Guarded::input("dout", dout),
        Guarded::input("inp", inp),
        Guarded::input("weight", weight),
        Guarded::input("mean", mean),
        Guarded::input("rstd", rstd),
    );
    // SAFETY: `f` is layernorm_backward_input[_bf16] (ffi::BackwardInput);
    // dinp, dout, inp and dres (or null) hold (N, C), weight C, mean and
    // rstd N (checked), and the kernel touches rows < N, channels < C.
    let rc = unsafe {
        f(
            grid.0,
            grid.1,
            grid.2,
            block.0,
            block.1,
            block.2,
            di.ptr(),
            ptr_or_null(&mut dr),
            go.ptr(),
            i.ptr(),
            w.ptr(),
            m.ptr(),
            r.ptr(),
            n,
            c,
        )
    };
    let bufs = [Some(di), dr, Some(go), Some(i), Some(w), Some(m), Some(r)];
    finish(k, rc, present(bufs))
}

/// `layernorm_backward_input` (f32): `dinp = base + (dnorm - mean(dnorm) -
/// norm · mean(dnorm · norm)) · rstd` per row, `base` = `dinp` itself
/// (accumulate) for `dres = None` (a null pointer), else `dres` (the
/// residual's gradient passed through). The launcher (layernorm.rs,
/// `backward_cuda`): one warp per row, grid `ceil(N / 8)`, block 256.
pub fn layernorm_backward_input(
    grid: Dim3,
    block: Dim3,
    dinp: &mut [f32],
    dres: Option<&[f32]>,
    dout: &[f32],
    inp: &[f32],
    weight: &[f32],
    mean: &[f32],
    rstd: &[f32],
    n: i32,
    c: i32,
) -> Result<(), String> {
    let f: ffi::BackwardInput<f32> = ffi::emu_layernorm_backward_input;
    let (ins, stats) = ((dout, inp, weight), (mean, rstd));
    let k = "layernorm_backward_input";
    backward_input(k, f, grid, block, dinp, dres, ins, stats, n, c)
}

/// [`layernorm_backward_input`] with bf16 `dinp`, `dres`, `dout`, `inp`,
/// `weight`.
pub fn layernorm_backward_input_bf16(
    grid: Dim3,
    block: Dim3,
    dinp: &mut [u16],
    dres: Option<&[u16]>,
    dout: &[u16],
    inp: &[u16],
    weight: &[u16],
    mean: &[f32],
    rstd: &[f32],
    n: i32,
    c: i32,
) -> Result<(), String> {
    let f: ffi::BackwardInput<u16> = ffi::emu_layernorm_backward_input_bf16;
    let (ins, stats) = ((dout, inp, weight), (mean, rstd));
    let k = "layernorm_backward_input_bf16";
    backward_input(k, f, grid, block, dinp, dres, ins, stats, n, c)
}

fn backward_params<S: Pod>(
    k: &str,
    f: ffi::BackwardParams<S>,
    grid: Dim3,
    block: Dim3,
    (dweight, dbias): (&mut [S], &mut [S]),
    (dout, inp, mean, rstd): (&[S], &[S], &[f32], &[f32]),
    n: i32,
    c: i32,
) -> Result<(), String> {
    let (rows, cols, nc) = shape(k, n, c)?;
    need(k, "dweight", dweight.len(), cols)?;
    need(k, "dbias", dbias.len(), cols)?;
    need(k, "dout", dout.len(), nc)?;
    need(k, "inp", inp.len(), nc)?;
    need(k, "mean", mean.len(), rows)?;
    need(k, "rstd", rstd.len(), rows)?;
    let (mut dw, mut db) = (
        Guarded::output("dweight", dweight),
        Guarded::output("dbias", dbias),
    );
    let (mut go, mut i, mut m, mut r) = (
        Guarded::input("dout", dout),
        Guarded::input("inp", inp),
        Guarded::input("mean", mean),
        Guarded::input("rstd", rstd),
    );
    // SAFETY: `f` is layernorm_backward_params[_bf16]
    // (ffi::BackwardParams); dweight and dbias hold C, dout and inp (N, C),
    // mean and rstd N (checked), and the kernel touches rows < N, channels
    // < C.
    let rc = unsafe {
        f(
            grid.0,
            grid.1,
            grid.2,
            block.0,
            block.1,
            block.2,
            dw.ptr(),
            db.ptr(),
            go.ptr(),
            i.ptr(),
            m.ptr(),
            r.ptr(),
            n,
            c,
        )
    };
    finish(k, rc, vec![dw, db, go, i, m, r])
}

/// `layernorm_backward_params` (f32): `dweight[c] += Σ_n norm[n, c] ·
/// dout[n, c]`, `dbias[c] += Σ_n dout[n, c]`, summed by 32 warps
/// (`LN_PARAMS_WARPS`) in a fixed lane order. The launcher (layernorm.rs,
/// `backward_cuda`): grid `ceil(C / 32)`, block `32 · 32`.
pub fn layernorm_backward_params(
    grid: Dim3,
    block: Dim3,
    dweight: &mut [f32],
    dbias: &mut [f32],
    dout: &[f32],
    inp: &[f32],
    mean: &[f32],
    rstd: &[f32],
    n: i32,
    c: i32,
) -> Result<(), String> {
    let f: ffi::BackwardParams<f32> = ffi::emu_layernorm_backward_params;
    let k = "layernorm_backward_params";
    let ins = (dout, inp, mean, rstd);
    backward_params(k, f, grid, block, (dweight, dbias), ins, n, c)
}

/// [`layernorm_backward_params`] with bf16 `dweight`, `dbias`, `dout`,
/// `inp` (each gradient loaded, the f32 sums added, rounded once).
pub fn layernorm_backward_params_bf16(
    grid: Dim3,
    block: Dim3,
    dweight: &mut [u16],
    dbias: &mut [u16],
    dout: &[u16],
    inp: &[u16],
    mean: &[f32],
    rstd: &[f32],
    n: i32,
    c: i32,
) -> Result<(), String> {
    let f: ffi::BackwardParams<u16> = ffi::emu_layernorm_backward_params_bf16;
    let k = "layernorm_backward_params_bf16";
    let ins = (dout, inp, mean, rstd);
    backward_params(k, f, grid, block, (dweight, dbias), ins, n, c)
}

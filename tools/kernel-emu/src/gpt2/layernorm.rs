//! `models/gpt2/src/kernels/layernorm.cu`: layer normalisation over `C`
//! channels of `N` rows, forward (alone, or fused with the residual sum),
//! and backward (the input gradient, then the parameter gradients).

use crate::check::{dim, need, product};
use crate::launch::{launch, Arg, Elem};
use crate::Dim3;

/// `(N, C, N·C)` for `(N, C)`, both at least 1.
fn shape(k: &str, n: i32, c: i32) -> Result<(usize, usize, usize), String> {
    let (n, c) = (dim(k, "N", n)?, dim(k, "C", c)?);
    Ok((n, c, product(k, &[n, c])?))
}

fn forward<S: Elem>(
    k: &str,
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
    let args = vec![
        Arg::output("out", out),
        Arg::output("mean", mean),
        Arg::output("rstd", rstd),
        Arg::input("inp", inp),
        Arg::input("weight", weight),
        Arg::input("bias", bias),
        Arg::I32(n),
        Arg::I32(c),
    ];
    // SAFETY: out and inp hold (N, C), mean and rstd N, weight and bias C
    // (checked), and layernorm_forward[_bf16] touches rows < N, channels
    // < C.
    unsafe { launch(k, grid, block, args) }
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
    let k = "layernorm_forward";
    forward(k, grid, block, out, mean, rstd, inp, weight, bias, n, c)
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
    let k = "layernorm_forward_bf16";
    forward(k, grid, block, out, mean, rstd, inp, weight, bias, n, c)
}

fn residual_forward<S: Elem>(
    k: &str,
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
    let args = vec![
        Arg::output("residual", residual),
        Arg::output("out", out),
        Arg::output("mean", mean),
        Arg::output("rstd", rstd),
        Arg::input("inp1", inp1),
        Arg::input("inp2", inp2),
        Arg::input("weight", weight),
        Arg::input("bias", bias),
        Arg::I32(n),
        Arg::I32(c),
    ];
    // SAFETY: residual, out, inp1 and inp2 hold (N, C), mean and rstd N,
    // weight and bias C (checked), and layernorm_residual_forward[_bf16]
    // touches rows < N, channels < C.
    unsafe { launch(k, grid, block, args) }
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
    let outs = (residual, out, mean, rstd);
    let ins = (inp1, inp2, weight, bias);
    residual_forward("layernorm_residual_forward", grid, block, outs, ins, n, c)
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
    let outs = (residual, out, mean, rstd);
    let ins = (inp1, inp2, weight, bias);
    let k = "layernorm_residual_forward_bf16";
    residual_forward(k, grid, block, outs, ins, n, c)
}

fn backward_input<S: Elem>(
    k: &str,
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
    let args = vec![
        Arg::output("dinp", dinp),
        Arg::input_or_null("dres", dres),
        Arg::input("dout", dout),
        Arg::input("inp", inp),
        Arg::input("weight", weight),
        Arg::input("mean", mean),
        Arg::input("rstd", rstd),
        Arg::I32(n),
        Arg::I32(c),
    ];
    // SAFETY: dinp, dout, inp and dres (or null) hold (N, C), weight C, mean
    // and rstd N (checked), and layernorm_backward_input[_bf16] touches rows
    // < N, channels < C.
    unsafe { launch(k, grid, block, args) }
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
    let (ins, stats) = ((dout, inp, weight), (mean, rstd));
    let k = "layernorm_backward_input";
    backward_input(k, grid, block, dinp, dres, ins, stats, n, c)
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
    let (ins, stats) = ((dout, inp, weight), (mean, rstd));
    let k = "layernorm_backward_input_bf16";
    backward_input(k, grid, block, dinp, dres, ins, stats, n, c)
}

fn backward_params<S: Elem>(
    k: &str,
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
    let args = vec![
        Arg::output("dweight", dweight),
        Arg::output("dbias", dbias),
        Arg::input("dout", dout),
        Arg::input("inp", inp),
        Arg::input("mean", mean),
        Arg::input("rstd", rstd),
        Arg::I32(n),
        Arg::I32(c),
    ];
    // SAFETY: dweight and dbias hold C, dout and inp (N, C), mean and rstd N
    // (checked), and layernorm_backward_params[_bf16] touches rows < N,
    // channels < C.
    unsafe { launch(k, grid, block, args) }
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
    let k = "layernorm_backward_params";
    let ins = (dout, inp, mean, rstd);
    backward_params(k, grid, block, (dweight, dbias), ins, n, c)
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
    let k = "layernorm_backward_params_bf16";
    let ins = (dout, inp, mean, rstd);
    backward_params(k, grid, block, (dweight, dbias), ins, n, c)
}

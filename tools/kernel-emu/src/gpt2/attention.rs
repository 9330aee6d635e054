//! `models/gpt2/src/kernels/attention.cu`: the permutes between the packed
//! `(B, T, 3C)` activation and the per-head `(B, NH, T, hs)` tensors, and
//! the causal softmax, forward and backward (the batched products between
//! them are cuBLAS calls, not emulated).

use crate::check::{dim, need, product};
use crate::launch::{launch, Arg, Elem};
use crate::Dim3;

/// `B·NH·T·hs` (= `B·T·C`, the elements of a head tensor) for `(B, T, NH,
/// hs)`, each at least 1.
fn heads(k: &str, b: i32, t: i32, nh: i32, hs: i32) -> Result<usize, String> {
    let (b, t) = (dim(k, "B", b)?, dim(k, "T", t)?);
    let (nh, hs) = (dim(k, "NH", nh)?, dim(k, "hs", hs)?);
    product(k, &[b, t, nh, hs])
}

fn permute<S: Elem>(
    k: &str,
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
    let mut args = vec![
        Arg::output("q", q),
        Arg::output("k", kk),
        Arg::output("v", v),
        Arg::input("inp", inp),
    ];
    args.extend(dims.map(Arg::I32));
    // SAFETY: q, k and v hold (B, NH, T, hs), inp (B, T, 3·NH·hs) (checked):
    // attention_permute[_bf16] touches element idx < B·NH·T·hs of each head
    // tensor and its places in inp.
    unsafe { launch(k, grid, block, args) }
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
    let dims = [b, t, nh, hs];
    permute("attention_permute", grid, block, (q, k, v), inp, dims)
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
    let dims = [b, t, nh, hs];
    permute("attention_permute_bf16", grid, block, (q, k, v), inp, dims)
}

fn permute_backward<S: Elem>(
    k: &str,
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
    let mut args = vec![
        Arg::output("dinp", dinp),
        Arg::input("dq", dq),
        Arg::input("dk", dk),
        Arg::input("dv", dv),
    ];
    args.extend(dims.map(Arg::I32));
    // SAFETY: dinp holds (B, T, 3·NH·hs), dq, dk and dv (B, NH, T, hs)
    // (checked): attention_permute_backward[_bf16] touches element
    // idx < B·NH·T·hs of each head tensor and its places in dinp.
    unsafe { launch(k, grid, block, args) }
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
    let k = "attention_permute_backward";
    permute_backward(k, grid, block, dinp, (dq, dk, dv), [b, t, nh, hs])
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
    let k = "attention_permute_backward_bf16";
    permute_backward(k, grid, block, dinp, (dq, dk, dv), [b, t, nh, hs])
}

/// Both unpermutes: `dst` and `src` are the `(B, T, C)` and the `(B, NH,
/// T, hs)` tensor, in the kernel's order.
fn unpermute<S: Elem>(
    k: &str,
    grid: Dim3,
    block: Dim3,
    (dst_name, dst): (&'static str, &mut [S]),
    (src_name, src): (&'static str, &[S]),
    [b, t, nh, hs]: [i32; 4],
) -> Result<(), String> {
    let n = heads(k, b, t, nh, hs)?;
    need(k, dst_name, dst.len(), n)?;
    need(k, src_name, src.len(), n)?;
    let mut args = vec![Arg::output(dst_name, dst), Arg::input(src_name, src)];
    args.extend([b, t, nh, hs].map(Arg::I32));
    // SAFETY: both buffers hold B·NH·T·hs = B·T·C elements (checked) and
    // attention_unpermute[_backward][_bf16] touches element
    // idx < B·NH·T·hs of the head tensor and its place in the (B, T, C)
    // one.
    unsafe { launch(k, grid, block, args) }
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
    let (d, s) = (("out", out), ("vaccum", vaccum));
    unpermute("attention_unpermute", grid, block, d, s, [b, t, nh, hs])
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
    let (d, s) = (("out", out), ("vaccum", vaccum));
    let k = "attention_unpermute_bf16";
    unpermute(k, grid, block, d, s, [b, t, nh, hs])
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
    let (d, s) = (("dvaccum", dvaccum), ("dout", dout));
    let k = "attention_unpermute_backward";
    unpermute(k, grid, block, d, s, [b, t, nh, hs])
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
    let (d, s) = (("dvaccum", dvaccum), ("dout", dout));
    let k = "attention_unpermute_backward_bf16";
    unpermute(k, grid, block, d, s, [b, t, nh, hs])
}

/// `B·NH·T·T` for `(BNH, T)`.
fn scores(k: &str, bnh: i32, t: i32) -> Result<usize, String> {
    let (bnh, t) = (dim(k, "BNH", bnh)?, dim(k, "T", t)?);
    product(k, &[bnh, t, t])
}

fn softmax_forward<S: Elem>(
    k: &str,
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
    let args = vec![
        Arg::output("att", att),
        Arg::input("preatt", preatt),
        Arg::I32(bnh),
        Arg::I32(t),
        Arg::F32(scale),
    ];
    // SAFETY: att and preatt hold (B·NH·T, T) (checked) and
    // attention_softmax_forward[_bf16] touches columns < T of rows
    // < B·NH·T.
    unsafe { launch(k, grid, block, args) }
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
    let k = "attention_softmax_forward";
    softmax_forward(k, grid, block, att, preatt, bnh, t, scale)
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
    let k = "attention_softmax_forward_bf16";
    softmax_forward(k, grid, block, att, preatt, bnh, t, scale)
}

fn softmax_backward<S: Elem>(
    k: &str,
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
    let args = vec![
        Arg::output("dpreatt", dpreatt),
        Arg::input("datt", datt),
        Arg::input("att", att),
        Arg::I32(bnh),
        Arg::I32(t),
        Arg::F32(scale),
    ];
    // SAFETY: the three buffers hold (B·NH·T, T) (checked) and
    // attention_softmax_backward[_bf16] touches columns < T of rows
    // < B·NH·T.
    unsafe { launch(k, grid, block, args) }
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
    let k = "attention_softmax_backward";
    softmax_backward(k, grid, block, dpreatt, datt, att, bnh, t, scale)
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
    let k = "attention_softmax_backward_bf16";
    softmax_backward(k, grid, block, dpreatt, datt, att, bnh, t, scale)
}

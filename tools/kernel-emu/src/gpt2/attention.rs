//! `models/gpt2/src/kernels/attention.cu`: the permutes between the packed
//! `(B, T, 3C)` activation and the per-head `(B, NH, T, hs)` tensors, and
//! the causal softmax, forward and backward (the batched products between
//! them are cuBLAS calls, not emulated).

use crate::check::{dim, product};
use crate::launch::{Args, Elem};
use crate::Dim3;

/// `B·NH·T·hs` (= `B·T·C`, the elements of a head tensor) for `(B, T, NH,
/// hs)`, each at least 1.
fn heads(k: &str, b: i32, t: i32, nh: i32, hs: i32) -> Result<usize, String> {
    let (b, t) = (dim(k, "B", b)?, dim(k, "T", t)?);
    let (nh, hs) = (dim(k, "NH", nh)?, dim(k, "hs", hs)?);
    product(k, &[b, t, nh, hs])
}

twins! {
    /// `attention_permute` (f32): `q`, `k`, `v` `(B, NH, T, hs)` from the packed
    /// `inp` `(B, T, 3C)`, `C = NH·hs`. The launcher (attention.rs,
    /// `attention_forward_cuda`): one thread per head element, grid
    /// `ceil(B·T·C / 256)`, block 256.
    pub fn attention_permute(S = f32);
    /// [`attention_permute`] with bf16 storage.
    pub fn attention_permute_bf16(S = u16);
    fn(
        kernel,
        grid: Dim3,
        block: Dim3,
        q: &mut [S],
        k: &mut [S],
        v: &mut [S],
        inp: &[S],
        b: i32,
        t: i32,
        nh: i32,
        hs: i32,
    ) {
        let n = heads(kernel, b, t, nh, hs)?;
        let args = Args::new(kernel)
            .output("q", q, n)?
            .output("k", k, n)?
            .output("v", v, n)?
            .input("inp", inp, product(kernel, &[n, 3])?)?
            .i32s([b, t, nh, hs]);
        // SAFETY: q, k and v hold (B, NH, T, hs), inp (B, T, 3·NH·hs)
        // (checked): attention_permute[_bf16] touches element
        // idx < B·NH·T·hs of each head tensor and its places in inp.
        unsafe { args.launch(grid, block) }
    }
}

twins! {
    /// `attention_permute_backward` (f32): `dinp` `(B, T, 3C)` `+=` `dq | dk |
    /// dv` `(B, NH, T, hs)`. The launcher (attention.rs,
    /// `attention_backward_cuda`): grid `ceil(B·T·C / 256)`, block 256.
    pub fn attention_permute_backward(S = f32);
    /// [`attention_permute_backward`] with bf16 storage (each sum in f32,
    /// rounded once).
    pub fn attention_permute_backward_bf16(S = u16);
    fn(
        k,
        grid: Dim3,
        block: Dim3,
        dinp: &mut [S],
        dq: &[S],
        dk: &[S],
        dv: &[S],
        b: i32,
        t: i32,
        nh: i32,
        hs: i32,
    ) {
        let n = heads(k, b, t, nh, hs)?;
        let args = Args::new(k)
            .output("dinp", dinp, product(k, &[n, 3])?)?
            .input("dq", dq, n)?
            .input("dk", dk, n)?
            .input("dv", dv, n)?
            .i32s([b, t, nh, hs]);
        // SAFETY: dinp holds (B, T, 3·NH·hs), dq, dk and dv (B, NH, T, hs)
        // (checked): attention_permute_backward[_bf16] touches element
        // idx < B·NH·T·hs of each head tensor and its places in dinp.
        unsafe { args.launch(grid, block) }
    }
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
    let args = Args::new(k)
        .output(dst_name, dst, n)?
        .input(src_name, src, n)?
        .i32s([b, t, nh, hs]);
    // SAFETY: both buffers hold B·NH·T·hs = B·T·C elements (checked) and
    // attention_unpermute[_backward][_bf16] touches element
    // idx < B·NH·T·hs of the head tensor and its place in the (B, T, C)
    // one.
    unsafe { args.launch(grid, block) }
}

twins! {
    /// `attention_unpermute` (f32): `out` `(B, T, C)` from `vaccum` `(B, NH,
    /// T, hs)`. The launcher (attention.rs, `attention_forward_cuda`): grid
    /// `ceil(B·T·C / 256)`, block 256.
    pub fn attention_unpermute(S = f32);
    /// [`attention_unpermute`] with bf16 storage.
    pub fn attention_unpermute_bf16(S = u16);
    fn(k, grid: Dim3, block: Dim3, out: &mut [S], vaccum: &[S], b: i32, t: i32, nh: i32, hs: i32) {
        let (d, s) = (("out", out), ("vaccum", vaccum));
        unpermute(k, grid, block, d, s, [b, t, nh, hs])
    }
}

twins! {
    /// `attention_unpermute_backward` (f32): `dvaccum` `(B, NH, T, hs)`
    /// overwritten from `dout` `(B, T, C)`. The launcher (attention.rs,
    /// `attention_backward_cuda`): grid `ceil(B·T·C / 256)`, block 256.
    pub fn attention_unpermute_backward(S = f32);
    /// [`attention_unpermute_backward`] with bf16 storage.
    pub fn attention_unpermute_backward_bf16(S = u16);
    fn(
        k,
        grid: Dim3,
        block: Dim3,
        dvaccum: &mut [S],
        dout: &[S],
        b: i32,
        t: i32,
        nh: i32,
        hs: i32,
    ) {
        let (d, s) = (("dvaccum", dvaccum), ("dout", dout));
        unpermute(k, grid, block, d, s, [b, t, nh, hs])
    }
}

/// `B·NH·T·T` for `(BNH, T)`.
fn scores(k: &str, bnh: i32, t: i32) -> Result<usize, String> {
    let (bnh, t) = (dim(k, "BNH", bnh)?, dim(k, "T", t)?);
    product(k, &[bnh, t, t])
}

twins! {
    /// `attention_softmax_forward` (f32): `att[r, t2]` = the softmax of `scale ·
    /// preatt[r, :t+1]` for `t2 <= t`, 0 above, row `r = (b·NH + h)·T + t`. The
    /// launcher (attention.rs, `attention_forward_cuda`): one warp per row,
    /// grid `ceil(B·NH·T / 8)`, block 256, `scale` 1 (the product applied
    /// `1 / sqrt(hs)`).
    pub fn attention_softmax_forward(S = f32);
    /// [`attention_softmax_forward`] with bf16 storage.
    pub fn attention_softmax_forward_bf16(S = u16);
    fn(k, grid: Dim3, block: Dim3, att: &mut [S], preatt: &[S], bnh: i32, t: i32, scale: f32) {
        let n = scores(k, bnh, t)?;
        let args = Args::new(k)
            .output("att", att, n)?
            .input("preatt", preatt, n)?
            .i32s([bnh, t])
            .f32(scale);
        // SAFETY: att and preatt hold (B·NH·T, T) (checked) and
        // attention_softmax_forward[_bf16] touches columns < T of rows
        // < B·NH·T.
        unsafe { args.launch(grid, block) }
    }
}

twins! {
    /// `attention_softmax_backward` (f32): `dpreatt[r, t2] = scale · att[r, t2]
    /// · (datt[r, t2] - Σ_{t3 <= t} att[r, t3] · datt[r, t3])` for `t2 <= t`, 0
    /// above (overwrites). The launcher (attention.rs,
    /// `attention_backward_cuda`): one warp per row, grid `ceil(B·NH·T / 8)`,
    /// block 256, `scale = 1 / sqrt(hs)`.
    pub fn attention_softmax_backward(S = f32);
    /// [`attention_softmax_backward`] with bf16 storage.
    pub fn attention_softmax_backward_bf16(S = u16);
    fn(
        k,
        grid: Dim3,
        block: Dim3,
        dpreatt: &mut [S],
        datt: &[S],
        att: &[S],
        bnh: i32,
        t: i32,
        scale: f32,
    ) {
        let n = scores(k, bnh, t)?;
        let args = Args::new(k)
            .output("dpreatt", dpreatt, n)?
            .input("datt", datt, n)?
            .input("att", att, n)?
            .i32s([bnh, t])
            .f32(scale);
        // SAFETY: the three buffers hold (B·NH·T, T) (checked) and
        // attention_softmax_backward[_bf16] touches columns < T of rows
        // < B·NH·T.
        unsafe { args.launch(grid, block) }
    }
}

twins! {
    /// `attention_decode` (f32): `out` `(C)` = the attention of the last of
    /// the packed rows `inp` `(T, 3C)` over all of them (decoding one
    /// position with a KV cache), `C = NH·hs`. The launcher (attention.rs,
    /// `attention_decode_cuda`): one block per head, grid `NH`, block 128,
    /// `T` at most the kernel's `DECODE_MAX_T` (4,096).
    pub fn attention_decode(S = f32);
    /// [`attention_decode`] with bf16 storage.
    pub fn attention_decode_bf16(S = u16);
    fn(k, grid: Dim3, block: Dim3, out: &mut [S], inp: &[S], t: i32, c: i32, nh: i32) {
        let (t, cu, nhu) = (dim(k, "T", t)?, dim(k, "C", c)?, dim(k, "NH", nh)?);
        if cu % nhu != 0 || t > 4096 {
            return Err(format!(
                "{k}: C ({cu}) is not NH ({nhu}) heads, or T ({t}) is past 4096"
            ));
        }
        let args = Args::new(k)
            .output("out", out, cu)?
            .input("inp", inp, product(k, &[t, cu, 3])?)?
            .i32s([t as i32, c, nh]);
        // SAFETY: out holds (C) and inp (T, 3C) (checked), T fits the
        // kernel's shared scores; attention_decode[_bf16] returns in blocks
        // past NH, and block h reads rows < T of inp in head h's channels
        // and writes that head's channels of out.
        unsafe { args.launch(grid, block) }
    }
}

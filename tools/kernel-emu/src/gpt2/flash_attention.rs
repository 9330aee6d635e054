//! `models/gpt2/src/kernels/flash_attention.cu` (f32 and bf16) and
//! `flash_attention_tc.cu` (bf16 on tensor cores, head sizes 16, 32, 64):
//! causal attention over the packed `(B, T, 3C)` activation, forward (`out`
//! and the log-sum-exp `lse`), and backward (`delta`, then dQ, then dK and
//! dV).

use crate::check::{nonneg, product};
use crate::launch::{Args, Elem};
use crate::Dim3;

/// flash_attention.cu's largest head size (its per-thread arrays).
pub const FA_MAX_HS: usize = 128;

/// `(B·T·C, B·NH·T)` for flash_attention.cu's kernels, or why `(B, T, C, NH)`
/// is not a shape they take.
fn fa_shape(k: &str, [b, t, c, nh]: [i32; 4]) -> Result<(usize, usize), String> {
    let [b, t, c, nh] = [b, t, c, nh].map(|x| nonneg(k, x));
    let (b, t, c, nh) = (b?, t?, c?, nh?);
    if nh == 0 || c % nh != 0 || c / nh > FA_MAX_HS {
        return Err(format!(
            "{k}: C ({c}) must be NH ({nh}) heads of at most {FA_MAX_HS} channels"
        ));
    }
    Ok((product(k, &[b, t, c])?, product(k, &[b, nh, t])?))
}

/// The forwards; `block_k` is the scalar kernels' last parameter (the
/// tensor-core kernels have none).
fn fa_forward<S: Elem>(
    k: &str,
    grid: Dim3,
    block: Dim3,
    (out, lse, inp): (&mut [S], &mut [f32], &[S]),
    dims: [i32; 4],
    block_k: Option<i32>,
) -> Result<(), String> {
    let (btc, bht) = fa_shape(k, dims)?;
    let mut args = Args::new(k)
        .output("out", out, btc)?
        .output("lse", lse, bht)?
        .input("inp", inp, product(k, &[btc, 3])?)?
        .i32s(dims);
    if let Some(block_k) = block_k {
        if block_k <= 0 {
            return Err(format!("{k}: block_k ({block_k}) must be positive"));
        }
        args = args.i32(block_k);
    }
    // SAFETY: the buffers have the (B, T, C), (B, NH, T) and (B, T, 3C)
    // elements the kernel indexes, with hs <= FA_MAX_HS (checked above).
    unsafe { args.launch(grid, block) }
}

/// The backwards, dQ and dK/dV: one signature (`accumulate` 0: `dinp`
/// written over, not read).
fn fa_backward<S: Elem>(
    k: &str,
    grid: Dim3,
    block: Dim3,
    dinp: &mut [S],
    ins: (&[f32], &[S], &[S], &[f32]),
    dims: [i32; 4],
    accumulate: i32,
) -> Result<(), String> {
    let args = fa_backward_args(k, dinp, ins, dims, accumulate)?;
    // SAFETY: the buffers have the (B, T, 3C), (B, NH, T), (B, T, C),
    // (B, T, 3C) and (B, NH, T) elements the kernel indexes, with
    // hs <= FA_MAX_HS (checked by `fa_backward_args`).
    unsafe { args.launch(grid, block) }
}

/// The arguments every backward kernel starts with, sizes checked:
/// `(dinp, delta, dout, inp, lse, B, T, C, NH, accumulate)`.
fn fa_backward_args<'a, S: Elem>(
    k: &'a str,
    dinp: &'a mut [S],
    (delta, dout, inp, lse): (&'a [f32], &'a [S], &'a [S], &'a [f32]),
    dims: [i32; 4],
    accumulate: i32,
) -> Result<Args<'a>, String> {
    let (btc, bht) = fa_shape(k, dims)?;
    let btc3 = product(k, &[btc, 3])?;
    Ok(Args::new(k)
        .output("dinp", dinp, btc3)?
        .input("delta", delta, bht)?
        .input("dout", dout, btc)?
        .input("inp", inp, btc3)?
        .input("lse", lse, bht)?
        .i32s(dims)
        .i32(accumulate))
}

twins! {
    /// `flash_attention_forward` (f32): `out` (B, T, C) and `lse` (B, NH, T) from
    /// `inp` (B, T, 3C), online softmax over key tiles of `block_k`. The
    /// launcher's configuration is grid `(ceil(T / 128), B·NH, 1)`, block
    /// `(128, 1, 1)`.
    pub fn flash_attention_forward(S = f32);
    /// [`flash_attention_forward`] with bf16 storage (`u16` bit patterns).
    pub fn flash_attention_forward_bf16(S = u16);
    fn(
        k,
        grid: Dim3,
        block: Dim3,
        out: &mut [S],
        lse: &mut [f32],
        inp: &[S],
        b: i32,
        t: i32,
        c: i32,
        nh: i32,
        block_k: i32,
    ) {
        let (bufs, dims) = ((out, lse, inp), [b, t, c, nh]);
        fa_forward(k, grid, block, bufs, dims, Some(block_k))
    }
}

twins! {
    /// `flash_attention_delta` (f32): `delta` (B, NH, T) = per head
    /// `rowsum(dout ∘ out)`. Launch as [`flash_attention_forward`].
    pub fn flash_attention_delta(S = f32);
    /// [`flash_attention_delta`] with bf16 storage.
    pub fn flash_attention_delta_bf16(S = u16);
    fn(
        k,
        grid: Dim3,
        block: Dim3,
        delta: &mut [f32],
        dout: &[S],
        out: &[S],
        b: i32,
        t: i32,
        c: i32,
        nh: i32,
    ) {
        let (btc, bht) = fa_shape(k, [b, t, c, nh])?;
        let args = Args::new(k)
            .output("delta", delta, bht)?
            .input("dout", dout, btc)?
            .input("out", out, btc)?
            .i32s([b, t, c, nh]);
        // SAFETY: the buffers have the (B, NH, T), (B, T, C) and (B, T, C)
        // elements the kernel indexes (checked above).
        unsafe { args.launch(grid, block) }
    }
}

twins! {
    /// `flash_attention_backward_dq` (f32): adds dQ into the query channels of
    /// `dinp` (B, T, 3C). Launch as [`flash_attention_forward`].
    pub fn flash_attention_backward_dq(S = f32);
    /// [`flash_attention_backward_dq`] with bf16 storage.
    pub fn flash_attention_backward_dq_bf16(S = u16);
    fn(
        k,
        grid: Dim3,
        block: Dim3,
        dinp: &mut [S],
        delta: &[f32],
        dout: &[S],
        inp: &[S],
        lse: &[f32],
        b: i32,
        t: i32,
        c: i32,
        nh: i32,
        accumulate: i32,
    ) {
        let ins = (delta, dout, inp, lse);
        fa_backward(k, grid, block, dinp, ins, [b, t, c, nh], accumulate)
    }
}

twins! {
    /// `flash_attention_backward_dkv` (f32): adds dK and dV into the key and
    /// value channels of `dinp` (B, T, 3C). Launch as [`flash_attention_forward`].
    pub fn flash_attention_backward_dkv(S = f32);
    /// [`flash_attention_backward_dkv`] with bf16 storage.
    pub fn flash_attention_backward_dkv_bf16(S = u16);
    fn(
        k,
        grid: Dim3,
        block: Dim3,
        dinp: &mut [S],
        delta: &[f32],
        dout: &[S],
        inp: &[S],
        lse: &[f32],
        b: i32,
        t: i32,
        c: i32,
        nh: i32,
        accumulate: i32,
    ) {
        let ins = (delta, dout, inp, lse);
        fa_backward(k, grid, block, dinp, ins, [b, t, c, nh], accumulate)
    }
}

// ---------------------------------------------------------------------------
// flash_attention_tc.cu: the tensor-core kernels (bf16, head sizes 16, 32, 64)
// ---------------------------------------------------------------------------

/// The head sizes `flash_attention_tc.cu` has kernels for.
pub const TC_HEAD_SIZES: [i32; 3] = [16, 32, 64];

/// Which build of `flash_attention_tc.cu`'s backward kernels to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TcBuild {
    /// The build the engine compiles by default.
    Default,
    /// `-DTC_BWD_CHUNK=16`: the staged tiles walked 16 rows at a time
    /// (`flash_attention_tc_chunk16_*`).
    Chunk16,
}

impl TcBuild {
    fn prefix(self) -> &'static str {
        match self {
            TcBuild::Default => "flash_attention_tc",
            TcBuild::Chunk16 => "flash_attention_tc_chunk16",
        }
    }
}

/// The kernel `{build's prefix}_{kernel}_hs{C / NH}_bf16`, refusing a head
/// size without one (each indexes exactly its head size's channels per
/// head).
fn tc_kernel(k: &str, build: TcBuild, kernel: &str, c: i32, nh: i32) -> Result<String, String> {
    if nh <= 0 || c % nh != 0 || !TC_HEAD_SIZES.contains(&(c / nh)) {
        return Err(format!(
            "{k}: C ({c}) must be NH ({nh}) heads of 16, 32 or 64 channels"
        ));
    }
    Ok(format!("{}_{kernel}_hs{}_bf16", build.prefix(), c / nh))
}

/// `flash_attention_tc_forward_bf16`: as [`flash_attention_forward_bf16`]
/// on tensor cores (key tiles of 64), the kernel for the head size `C / NH`
/// (`flash_attention_tc_forward_hs{16,32,64}_bf16`). Launch: grid
/// `(ceil(T / 64), B·NH, 1)`, block `(128, 1, 1)`.
pub fn flash_attention_tc_forward_bf16(
    grid: Dim3,
    block: Dim3,
    out: &mut [u16],
    lse: &mut [f32],
    inp: &[u16],
    b: i32,
    t: i32,
    c: i32,
    nh: i32,
) -> Result<(), String> {
    let k = &tc_kernel(
        "flash_attention_tc_forward_bf16",
        TcBuild::Default,
        "forward",
        c,
        nh,
    )?;
    fa_forward(k, grid, block, (out, lse, inp), [b, t, c, nh], None)
}

/// `flash_attention_tc_backward_dq_bf16`: as
/// [`flash_attention_backward_dq_bf16`] on tensor cores, from `build`.
/// Launch as [`flash_attention_tc_forward_bf16`].
pub fn flash_attention_tc_backward_dq_bf16(
    build: TcBuild,
    grid: Dim3,
    block: Dim3,
    dinp: &mut [u16],
    delta: &[f32],
    dout: &[u16],
    inp: &[u16],
    lse: &[f32],
    b: i32,
    t: i32,
    c: i32,
    nh: i32,
    accumulate: i32,
) -> Result<(), String> {
    let k = &tc_kernel(
        "flash_attention_tc_backward_dq_bf16",
        build,
        "backward_dq",
        c,
        nh,
    )?;
    let ins = (delta, dout, inp, lse);
    fa_backward(k, grid, block, dinp, ins, [b, t, c, nh], accumulate)
}

/// `flash_attention_tc_backward_dkv_ds_bf16`: as
/// [`flash_attention_tc_backward_dkv_bf16`] (default build), also storing
/// dSᵀ into `ds`, `(B, NH, T, T)` bf16 bits, row key, column query (`T`
/// even); what it does not store keeps its value.
#[allow(clippy::too_many_arguments)]
pub fn flash_attention_tc_backward_dkv_ds_bf16(
    grid: Dim3,
    block: Dim3,
    dinp: &mut [u16],
    (delta, dout, inp, lse): (&[f32], &[u16], &[u16], &[f32]),
    [b, t, c, nh]: [i32; 4],
    accumulate: i32,
    ds: &mut [u16],
) -> Result<(), String> {
    let k = &tc_kernel(
        "flash_attention_tc_backward_dkv_ds_bf16",
        TcBuild::Default,
        "backward_dkv_ds",
        c,
        nh,
    )?;
    if t % 2 != 0 {
        return Err(format!("{k}: T ({t}) must be even"));
    }
    let dims = [b, t, c, nh];
    let (_, bht) = fa_shape(k, dims)?;
    let bhtt = product(k, &[bht, nonneg(k, t)?])?;
    let args = fa_backward_args(k, dinp, (delta, dout, inp, lse), dims, accumulate)?
        .output("ds", ds, bhtt)?;
    // SAFETY: the buffers have the (B, T, 3C), (B, NH, T), (B, T, C),
    // (B, T, 3C), (B, NH, T) and (B, NH, T, T) elements the kernel indexes,
    // with a head size it has (checked above).
    unsafe { args.launch(grid, block) }
}

/// `flash_attention_tc_backward_dkv_bf16`: as
/// [`flash_attention_backward_dkv_bf16`] on tensor cores, from `build`.
/// Launch as [`flash_attention_tc_forward_bf16`].
pub fn flash_attention_tc_backward_dkv_bf16(
    build: TcBuild,
    grid: Dim3,
    block: Dim3,
    dinp: &mut [u16],
    delta: &[f32],
    dout: &[u16],
    inp: &[u16],
    lse: &[f32],
    b: i32,
    t: i32,
    c: i32,
    nh: i32,
    accumulate: i32,
) -> Result<(), String> {
    let k = &tc_kernel(
        "flash_attention_tc_backward_dkv_bf16",
        build,
        "backward_dkv",
        c,
        nh,
    )?;
    let ins = (delta, dout, inp, lse);
    fa_backward(k, grid, block, dinp, ins, [b, t, c, nh], accumulate)
}

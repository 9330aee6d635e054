//! Causal multi-head self-attention on a packed `qkv` activation.
//!
//! `inp` is `(B, T, 3C)`: for each position, the `C` query channels, then the
//! `C` key channels, then the `C` value channels; head `h` owns channels
//! `h·hs .. (h+1)·hs` of each, with `hs = C / NH`.
//!
//! The family's one home: the tasks [`forward`] and [`backward`], the CPU
//! kernels [`attention_forward`] and [`attention_backward`], their CUDA
//! launchers [`attention_forward_cuda`] and [`attention_backward_cuda`]
//! (llm.c's cuBLAS formulation: permute, batched products, softmax), and
//! `attention.cu`.
//!
//! # Differences between the backends
//!
//! - The CUDA kernels need scratch memory the CPU kernels keep on their
//!   stack: [`forward_scratch_bytes`] and [`backward_scratch_bytes`]. The
//!   tasks declare it (`write`) on every backend, so the task graph is the
//!   same everywhere; the CPU bodies ignore it.
//! - [`attention_forward_cuda`] leaves the masked (upper) triangle of
//!   `preatt` as the full `q·kᵀ` product wrote it, where the CPU writes 0;
//!   `att` is 0 there on both. Nothing reads that triangle.
//! - bf16 storage on CUDA is the same cuBLAS formulation with bf16 operands
//!   (`f32` accumulation; cuBLAS rounds each product to bf16) and bf16 twins
//!   of the permute and softmax kernels; the scratch holds the storage
//!   type, so `q`, `k`, `v` and the other intermediates are bf16. The
//!   softmax reads the scores as stored, rounded to bf16 (PyTorch's eager
//!   bf16 attention does the same); the CPU's bf16 kernel keeps them in
//!   `f32`. The two agree to bf16 tolerances, not bit for bit. (The first
//!   bf16 kernels followed the CPU's loops bit for bit, one warp per query
//!   row and one block per head for the backward pass: on an H200 they made
//!   a GPT-2 124M step 20× slower than `f32`, 2026-11-26.)

use braid::cuda::{Gemm, KernelArgs, LaunchConfig, Transpose};
use braid::{CudaTaskCtx, DevSlice, DevSliceMut, Result, TaskHandle, View};

use super::check_len;
use super::cuda_common::{by_dtype, task_result, Check, Kernel, Launcher, Program};
use super::fastmath;
use super::storage::{Dtype, Storage};
use super::task::{submit, Task};

pub(crate) static CUDA: Program = Program::new(
    "attention.cu",
    include_str!("attention.cu"),
    &[
        "attention_permute",
        "attention_permute_backward",
        "attention_unpermute",
        "attention_unpermute_backward",
        "attention_softmax_forward",
        "attention_softmax_backward",
        "attention_permute_bf16",
        "attention_permute_backward_bf16",
        "attention_unpermute_bf16",
        "attention_unpermute_backward_bf16",
        "attention_softmax_forward_bf16",
        "attention_softmax_backward_bf16",
        "attention_decode",
        "attention_decode_bf16",
    ],
);
static PERMUTE: Kernel = Kernel::new(&CUDA, 0);
static PERMUTE_BACKWARD: Kernel = Kernel::new(&CUDA, 1);
static UNPERMUTE: Kernel = Kernel::new(&CUDA, 2);
static UNPERMUTE_BACKWARD: Kernel = Kernel::new(&CUDA, 3);
static SOFTMAX_FORWARD: Kernel = Kernel::new(&CUDA, 4);
static SOFTMAX_BACKWARD: Kernel = Kernel::new(&CUDA, 5);
static PERMUTE_BF16: Kernel = Kernel::new(&CUDA, 6);
static PERMUTE_BACKWARD_BF16: Kernel = Kernel::new(&CUDA, 7);
static UNPERMUTE_BF16: Kernel = Kernel::new(&CUDA, 8);
static UNPERMUTE_BACKWARD_BF16: Kernel = Kernel::new(&CUDA, 9);
static SOFTMAX_FORWARD_BF16: Kernel = Kernel::new(&CUDA, 10);
static SOFTMAX_BACKWARD_BF16: Kernel = Kernel::new(&CUDA, 11);
static DECODE: Kernel = Kernel::new(&CUDA, 12);
static DECODE_BF16: Kernel = Kernel::new(&CUDA, 13);

/// Threads of a block of the decoding kernel (`DECODE_BLOCK` in
/// `attention.cu`).
const DECODE_BLOCK: u32 = 128;

/// The most positions [`attention_decode_cuda`] attends to: its scores, one
/// `f32` each, in a block's shared memory (`DECODE_MAX_T` in
/// `attention.cu`; 16 KiB, GPT-2's context is 1,024).
pub const DECODE_MAX_T: usize = 4096;

// ---------------------------------------------------------------------------
// Tasks
// ---------------------------------------------------------------------------

/// Submits causal self-attention on the packed `inp` as `task`: writes
/// `out`, the scaled scores `preatt` and the probabilities `att`.
///
/// `scratch`: exactly [`forward_scratch_bytes`] bytes for the CUDA
/// kernels (declared `write`; unused on the CPU). Its contents are dead
/// after the task, so one scratch view may serve every layer.
pub fn forward<'rt>(
    task: impl Into<Task<'rt>>,
    out: &View,     // (B, T, C)
    preatt: &View,  // (B, NH, T, T)
    att: &View,     // (B, NH, T, T)
    inp: &View,     // (B, T, 3C)
    scratch: &View, // forward_scratch_bytes
    b: usize,
    t: usize,
    c: usize,
    nh: usize,
) -> Result<TaskHandle> {
    submit!(
        task,
        |S| (
            out.write::<S>(),
            preatt.write::<S>(),
            att.write::<S>(),
            inp.read::<S>(),
            scratch.write::<S>(),
        ),
        move |(out, preatt, att, inp, _scratch)| {
            attention_forward(out, preatt, att, inp, b, t, c, nh)
        },
        move |(out, preatt, att, inp, scratch), cu| {
            task_result(attention_forward_cuda(
                cu, out, preatt, att, inp, scratch, b, t, c, nh,
            ))
        },
    )
}

/// Submits the backward pass of [`forward`] as `task`: accumulates the
/// query, key and value gradients into `dinp` (packed like `inp`), from
/// `inp` and the saved `att`.
///
/// `scratch`: exactly [`backward_scratch_bytes`] bytes (declared `write`;
/// unused on the CPU).
pub fn backward<'rt>(
    task: impl Into<Task<'rt>>,
    dinp: &View,    // (B, T, 3C) accumulated
    dout: &View,    // (B, T, C)
    inp: &View,     // (B, T, 3C)
    att: &View,     // (B, NH, T, T)
    scratch: &View, // backward_scratch_bytes
    b: usize,
    t: usize,
    c: usize,
    nh: usize,
) -> Result<TaskHandle> {
    submit!(
        task,
        |S| (
            dinp.read_write::<S>(),
            dout.read::<S>(),
            inp.read::<S>(),
            att.read::<S>(),
            scratch.write::<S>(),
        ),
        move |(dinp, dout, inp, att, _scratch)| {
            attention_backward(dinp, dout, inp, att, b, t, c, nh)
        },
        move |(dinp, dout, inp, att, scratch), cu| {
            task_result(attention_backward_cuda(
                cu, dinp, dout, inp, att, scratch, b, t, c, nh,
            ))
        },
    )
}

/// Submits the attention of one new position as `task` (decoding with a
/// KV cache): `out` (`C`) gets what [`forward`] writes for the last row of
/// the one sequence `inp` (`(T, 3C)`: the packed query, keys and values of
/// positions `0..T`, the last the new one), from the keys and values of
/// every row and the last row's query, without the `(NH, T, T)` scores.
/// The CPU body gives [`forward`]'s bits ([`attention_decode`]).
pub fn decode<'rt>(
    task: impl Into<Task<'rt>>,
    out: &View, // (C)
    inp: &View, // (T, 3C)
    t: usize,
    c: usize,
    nh: usize,
) -> Result<TaskHandle> {
    submit!(
        task,
        |S| (out.write::<S>(), inp.read::<S>()),
        move |(out, inp)| attention_decode(out, inp, t, c, nh),
        move |(out, inp), cu| task_result(attention_decode_cuda(cu, out, inp, t, c, nh)),
    )
}

/// Bytes of scratch [`attention_forward_cuda`] needs: `4·B·T·C` elements of
/// the storage type `dtype`, used as `q | k | v | vaccum`, each `(B, NH, T,
/// hs)` with `hs = C / NH`: the heads of `inp` permuted for the batched
/// products, and `att · v` before it is permuted back into `out`.
pub fn forward_scratch_bytes(b: usize, t: usize, c: usize, _nh: usize, dtype: Dtype) -> usize {
    4 * b * t * c * dtype.size()
}

/// Bytes of scratch [`attention_backward_cuda`] needs: `6·B·T·C + 2·B·NH·T·T`
/// elements of the storage type `dtype`, used as `q | k | v | dvaccum | dk | dv` (each `(B, NH, T, hs)`;
/// `dq` is written over `dvaccum` once that is consumed) then `datt |
/// dpreatt` (each `(B, NH, T, T)`). `q, k, v` are re-permuted from `inp`, so
/// nothing from the forward scratch needs to survive.
pub fn backward_scratch_bytes(b: usize, t: usize, c: usize, nh: usize, dtype: Dtype) -> usize {
    (6 * b * t * c + 2 * b * nh * t * t) * dtype.size()
}

// ---------------------------------------------------------------------------
// CPU
// ---------------------------------------------------------------------------

/// `out[b, t, h·hs..] = Σ_{t2 <= t} att[b, h, t, t2] · v[b, t2, h]` with
/// `att = softmax(q·k / sqrt(hs))` over the causal prefix.
///
/// Saves the scaled scores in `preatt` and the probabilities in `att`; the
/// masked upper triangle (`t2 > t`) of both is written as 0.
///
/// Computed in `f32` from the loaded `inp`; bf16 outputs are rounded once
/// as they are stored (the softmax and the weighted sum use the `f32`
/// scores, not the stored ones).
pub fn attention_forward<S: Storage>(
    out: &mut [S],    // (B, T, C)
    preatt: &mut [S], // (B, NH, T, T)
    att: &mut [S],    // (B, NH, T, T)
    inp: &[S],        // (B, T, 3C)
    b: usize,
    t: usize,
    c: usize,
    nh: usize,
) {
    assert!(
        nh > 0 && c % nh == 0,
        "attention_forward: C ({c}) not divisible by NH ({nh})"
    );
    check_len("attention_forward", "out", out.len(), b * t * c);
    check_len("attention_forward", "preatt", preatt.len(), b * nh * t * t);
    check_len("attention_forward", "att", att.len(), b * nh * t * t);
    check_len("attention_forward", "inp", inp.len(), b * t * 3 * c);
    let inp = S::load_slice(inp);
    S::update_f32(out, |out| {
        S::update_f32(preatt, |preatt| {
            S::update_f32(att, |att| {
                attention_forward_f32(out, preatt, att, &inp, b, t, c, nh)
            })
        })
    })
}

/// [`attention_forward`] in `f32`, shapes checked.
#[multiversion::multiversion(targets("x86_64+avx2"))]
fn attention_forward_f32(
    out: &mut [f32],    // (B, T, C)
    preatt: &mut [f32], // (B, NH, T, T)
    att: &mut [f32],    // (B, NH, T, T)
    inp: &[f32],        // (B, T, 3C)
    b: usize,
    t: usize,
    c: usize,
    nh: usize,
) {
    let hs = c / nh;
    let c3 = 3 * c;
    for bi in 0..b {
        let inp_b = &inp[bi * t * c3..][..t * c3];
        for ti in 0..t {
            // A best-effort task may pause here (one row of every head done).
            braid::preemption_point();
            for h in 0..nh {
                let row = ((bi * nh + h) * t + ti) * t;
                let (preatt_row, att_row) = (&mut preatt[row..][..t], &mut att[row..][..t]);
                let out_h = &mut out[(bi * t + ti) * c + h * hs..][..hs];
                attend_row(out_h, preatt_row, att_row, inp_b, ti, h, c, nh);
                preatt_row[ti + 1..].fill(0.0);
                att_row[ti + 1..].fill(0.0);
            }
        }
    }
}

/// Query row `ti` of head `h` against keys and values `0..=ti` of `inp_b`
/// (one sequence, `(T, 3C)`): the scaled scores into `preatt_row[..=ti]`,
/// their softmax into `att_row[..=ti]`, the weighted sum of the values into
/// `out_h` (`hs`). The one place this arithmetic is written: the whole
/// forward pass and the decoding of one position ([`attention_decode`])
/// give the same bits.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn attend_row(
    out_h: &mut [f32],
    preatt_row: &mut [f32],
    att_row: &mut [f32],
    inp_b: &[f32],
    ti: usize,
    h: usize,
    c: usize,
    nh: usize,
) {
    let (hs, c3) = (c / nh, 3 * c);
    let scale = 1.0 / (hs as f32).sqrt();
    let query = &inp_b[ti * c3 + h * hs..][..hs];
    // pass 1: scores and their maximum
    let mut maxval = f32::NEG_INFINITY;
    for t2 in 0..=ti {
        let key = &inp_b[t2 * c3 + c + h * hs..][..hs];
        let dot: f32 = query.iter().zip(key).map(|(&q, &k)| q * k).sum();
        let val = dot * scale;
        preatt_row[t2] = val;
        maxval = maxval.max(val);
    }

    // pass 2: softmax over the causal prefix
    att_row[..=ti].copy_from_slice(&preatt_row[..=ti]);
    let expsum = fastmath::exp_in_place_sum_f64(&mut att_row[..=ti], maxval);
    let inv = (1.0 / expsum) as f32;
    for a in &mut att_row[..=ti] {
        *a *= inv;
    }

    // pass 3: weighted sum of the values
    out_h.fill(0.0);
    for (t2, &a) in att_row[..=ti].iter().enumerate() {
        let value = &inp_b[t2 * c3 + 2 * c + h * hs..][..hs];
        for (o, &v) in out_h.iter_mut().zip(value) {
            *o += a * v;
        }
    }
}

/// Decoding, one position: `out` (`C`) is row `T − 1` of
/// [`attention_forward`]'s `out` for the one sequence `inp` (`(T, 3C)`, the
/// packed rows `0..T`), bit for bit, without the `(NH, T, T)` scores: the
/// last query attends to every key and value of `inp` (a KV cache's).
pub fn attention_decode<S: Storage>(
    out: &mut [S], // (C)
    inp: &[S],     // (T, 3C)
    t: usize,
    c: usize,
    nh: usize,
) {
    assert!(
        nh > 0 && c % nh == 0 && t > 0,
        "attention_decode: C ({c}) not divisible by NH ({nh}), or T = 0"
    );
    check_len("attention_decode", "out", out.len(), c);
    check_len("attention_decode", "inp", inp.len(), t * 3 * c);
    let inp = S::load_slice(inp);
    S::update_f32(out, |out| attention_decode_f32(out, &inp, t, c, nh))
}

/// [`attention_decode`] in `f32`, shapes checked.
#[multiversion::multiversion(targets("x86_64+avx2"))]
fn attention_decode_f32(out: &mut [f32], inp: &[f32], t: usize, c: usize, nh: usize) {
    let hs = c / nh;
    let (mut preatt_row, mut att_row) = (vec![0f32; t], vec![0f32; t]);
    for (h, out_h) in out.chunks_exact_mut(hs).enumerate() {
        attend_row(out_h, &mut preatt_row, &mut att_row, inp, t - 1, h, c, nh);
    }
}

/// Accumulates `dinp` (the query, key and value gradients, packed like `inp`)
/// from `dout`, using the probabilities `att` saved by [`attention_forward`].
///
/// Needs no `preatt` and no scratch gradient buffers (unlike llm.c, which
/// keeps `datt` and `dpreatt` activations): each row of `datt` is recomputed
/// into a local vector. Computed in `f32` from the loaded (stored)
/// arguments; a bf16 `dinp` is rounded once, at the end.
pub fn attention_backward<S: Storage>(
    dinp: &mut [S], // (B, T, 3C)
    dout: &[S],     // (B, T, C)
    inp: &[S],      // (B, T, 3C)
    att: &[S],      // (B, NH, T, T)
    b: usize,
    t: usize,
    c: usize,
    nh: usize,
) {
    assert!(
        nh > 0 && c % nh == 0,
        "attention_backward: C ({c}) not divisible by NH ({nh})"
    );
    check_len("attention_backward", "dinp", dinp.len(), b * t * 3 * c);
    check_len("attention_backward", "dout", dout.len(), b * t * c);
    check_len("attention_backward", "inp", inp.len(), b * t * 3 * c);
    check_len("attention_backward", "att", att.len(), b * nh * t * t);
    let (dout, inp, att) = (S::load_slice(dout), S::load_slice(inp), S::load_slice(att));
    S::update_f32(dinp, |dinp| {
        attention_backward_f32(dinp, &dout, &inp, &att, b, t, c, nh)
    })
}

/// [`attention_backward`] in `f32`, shapes checked.
#[multiversion::multiversion(targets("x86_64+avx2"))]
fn attention_backward_f32(
    dinp: &mut [f32], // (B, T, 3C)
    dout: &[f32],     // (B, T, C)
    inp: &[f32],      // (B, T, 3C)
    att: &[f32],      // (B, NH, T, T)
    b: usize,
    t: usize,
    c: usize,
    nh: usize,
) {
    let hs = c / nh;
    let c3 = 3 * c;
    let scale = 1.0 / (hs as f32).sqrt();
    let mut datt = vec![0.0f32; t]; // (T) one row of d(att)
    let mut dpreatt = vec![0.0f32; t]; // (T) one row of d(preatt)
    for bi in 0..b {
        let inp_b = &inp[bi * t * c3..][..t * c3];
        let dinp_b = &mut dinp[bi * t * c3..][..t * c3];
        for ti in 0..t {
            braid::preemption_point();
            for h in 0..nh {
                let row = ((bi * nh + h) * t + ti) * t;
                let att_row = &att[row..][..=ti];
                let dout_h = &dout[(bi * t + ti) * c + h * hs..][..hs];

                // backward through out = Σ att · v
                for (t2, &a) in att_row.iter().enumerate() {
                    let value = &inp_b[t2 * c3 + 2 * c + h * hs..][..hs];
                    datt[t2] = value.iter().zip(dout_h).map(|(&v, &g)| v * g).sum();
                    let dvalue = &mut dinp_b[t2 * c3 + 2 * c + h * hs..][..hs];
                    for (dv, &g) in dvalue.iter_mut().zip(dout_h) {
                        *dv += a * g;
                    }
                }

                // backward through the softmax: dpre = att · (datt - Σ att·datt)
                let dot: f64 = att_row
                    .iter()
                    .zip(&datt)
                    .map(|(&a, &d)| a as f64 * d as f64)
                    .sum();
                let dot = dot as f32;
                for ((dp, &a), &d) in dpreatt.iter_mut().zip(att_row).zip(&datt) {
                    *dp = a * (d - dot);
                }

                // backward through preatt = q·k · scale
                for t2 in 0..=ti {
                    let g = dpreatt[t2] * scale;
                    // query (row ti) and key (row t2) may be the same row of
                    // `inp`, but they are different channel ranges.
                    for i in 0..hs {
                        let q = inp_b[ti * c3 + h * hs + i];
                        let k = inp_b[t2 * c3 + c + h * hs + i];
                        dinp_b[ti * c3 + h * hs + i] += k * g;
                        dinp_b[t2 * c3 + c + h * hs + i] += q * g;
                    }
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------
// CUDA
// ---------------------------------------------------------------------------

/// Shape checks shared by the attention launchers; returns `(hs, B·NH)` and
/// the `int` dimensions `[B, T, NH, hs]`.
fn attention_dims(
    k: &Check,
    b: usize,
    t: usize,
    c: usize,
    nh: usize,
) -> Result<(usize, usize, [i32; 4])> {
    let (bi, ti, nhi) = (k.dim("B", b)?, k.dim("T", t)?, k.dim("NH", nh)?);
    k.dim("C", c)?;
    if c % nh != 0 {
        return Err(k.err(format!("C ({c}) is not divisible by NH ({nh})")));
    }
    let hs = c / nh;
    let bnh = k.mul(b, nh)?;
    k.dim("B·NH", bnh)?;
    k.dim("T·T", k.mul(t, t)?)?;
    k.dim("B·NH·T", k.mul(bnh, t)?)?;
    Ok((hs, bnh, [bi, ti, nhi, k.dim("hs", hs)?]))
}

/// [`attention_decode`] on the task's stream: a block per head
/// (`attention_decode[_bf16]`), at most [`DECODE_MAX_T`] positions.
pub fn attention_decode_cuda<S: Storage>(
    cu: &CudaTaskCtx<'_>,
    out: DevSliceMut<S>, // (C)
    inp: DevSlice<S>,    // (T, 3C)
    t: usize,
    c: usize,
    nh: usize,
) -> Result<()> {
    let k = Check::new("attention_decode");
    let (_, _, [_, ti, nhi, _]) = attention_dims(&k, 1, t, c, nh)?;
    if t == 0 || t > DECODE_MAX_T {
        return Err(k.err(format!("T ({t}) is not in 1..={DECODE_MAX_T}")));
    }
    k.exact("out", &out, "(C)", c)?;
    k.exact("inp", &inp, "(T, 3C)", k.mul(k.mul(t, c)?, 3)?)?;
    let l = Launcher::new(k, cu);
    let cfg = LaunchConfig {
        grid: (nhi as u32, 1, 1),
        block: (DECODE_BLOCK, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut a = KernelArgs::new();
    a.ptr(out.ptr())
        .ptr(inp.ptr())
        .i32(ti)
        .i32(c as i32)
        .i32(nhi);
    // SAFETY: attention_decode[_bf16](S* out, const S* inp, int T, int C,
    // int NH): out is (C), inp (T, 3C) (checked), T at most the kernel's
    // DECODE_MAX_T scores (checked); NH blocks.
    unsafe { l.launch(by_dtype::<S>(&DECODE, &DECODE_BF16), cfg, &a) }
}

/// [`attention_forward`] on the task's stream, llm.c's cuBLAS formulation
/// (see the module docs for `preatt`'s masked triangle).
///
/// `scratch`: exactly [`forward_scratch_bytes`] bytes.
pub fn attention_forward_cuda<S: Storage>(
    cu: &CudaTaskCtx<'_>,
    out: DevSliceMut<S>,     // (B, T, C)
    preatt: DevSliceMut<S>,  // (B, NH, T, T)
    att: DevSliceMut<S>,     // (B, NH, T, T)
    inp: DevSlice<S>,        // (B, T, 3C)
    scratch: DevSliceMut<S>, // 4 × (B, NH, T, hs): q | k | v | vaccum
    b: usize,
    t: usize,
    c: usize,
    nh: usize,
) -> Result<()> {
    let k = Check::new("attention_forward");
    let (hs, bnh, dims) = attention_dims(&k, b, t, c, nh)?;
    let btc = k.mul(k.mul(b, t)?, c)?;
    let tt = k.mul(t, t)?;
    let att_len = k.mul(bnh, tt)?;
    k.exact("out", &out, "(B, T, C)", btc)?;
    k.exact("preatt", &preatt, "(B, NH, T, T)", att_len)?;
    k.exact("att", &att, "(B, NH, T, T)", att_len)?;
    k.exact("inp", &inp, "(B, T, 3C)", k.mul(btc, 3)?)?;
    k.exact("scratch", &scratch, "4 × (B, NH, T, hs)", k.mul(btc, 4)?)?;
    let l = Launcher::new(k, cu);
    let (out, preatt, att, inp, scratch) =
        (out.ptr(), preatt.ptr(), att.ptr(), inp.ptr(), scratch.ptr());
    // The scratch holds `S` elements.
    let head = (btc * std::mem::size_of::<S>()) as u64;
    let (q, kk, v, vaccum) = (
        scratch,
        scratch + head,
        scratch + 2 * head,
        scratch + 3 * head,
    );
    let [bi, ti, nhi, hsi] = dims;
    let (s_tt, s_ths) = (tt as i64, (t * hs) as i64);
    let scale = 1.0 / (hs as f32).sqrt();

    let mut a = KernelArgs::new();
    a.ptr(q)
        .ptr(kk)
        .ptr(v)
        .ptr(inp)
        .i32(bi)
        .i32(ti)
        .i32(nhi)
        .i32(hsi);
    let permute = by_dtype::<S>(&PERMUTE, &PERMUTE_BF16);
    // SAFETY: attention_permute[_bf16](S* q, S* k, S* v, const S* inp, int
    // B, int T, int NH, int hs); q, k, v are disjoint head-sized parts of
    // the scratch, inp is (B, T, 3C) (checked).
    unsafe { l.launch(permute, l.linear(btc, 256)?, &a)? };
    // preatt = scale · q · kᵀ, per head.
    let g = Gemm::new(Transpose::N, Transpose::T, t, t, hs).scaled(scale, 0.0);
    // SAFETY: B·NH entries: q, k (T, hs) at stride T·hs, preatt (T, T) at
    // stride T·T, all inside their checked slices.
    unsafe { l.gemm_batched_as::<S>(&g, q, s_ths, kk, s_ths, preatt, s_tt, bnh)? };
    let mut a = KernelArgs::new();
    a.ptr(att).ptr(preatt).i32(bnh as i32).i32(ti).f32(1.0);
    let softmax = by_dtype::<S>(&SOFTMAX_FORWARD, &SOFTMAX_FORWARD_BF16);
    // SAFETY: attention_softmax_forward[_bf16](S* att, const S* preatt, int
    // BNH, int T, float scale); both (B·NH·T, T) (checked).
    unsafe { l.launch(softmax, l.warp_rows(bnh * t)?, &a)? };
    // vaccum = att · v, per head.
    let g = Gemm::new(Transpose::N, Transpose::N, t, hs, t);
    // SAFETY: att (T, T) at stride T·T, v and vaccum (T, hs) at stride T·hs.
    unsafe { l.gemm_batched_as::<S>(&g, att, s_tt, v, s_ths, vaccum, s_ths, bnh)? };
    let mut a = KernelArgs::new();
    a.ptr(out).ptr(vaccum).i32(bi).i32(ti).i32(nhi).i32(hsi);
    let unpermute = by_dtype::<S>(&UNPERMUTE, &UNPERMUTE_BF16);
    // SAFETY: attention_unpermute[_bf16](S* out, const S* vaccum, int B, int
    // T, int NH, int hs); out (B, T, C), vaccum head-sized (checked).
    unsafe { l.launch(unpermute, l.linear(btc, 256)?, &a) }
}

/// [`attention_backward`] on the task's stream: accumulates into `dinp`.
///
/// `scratch`: exactly [`backward_scratch_bytes`] bytes.
pub fn attention_backward_cuda<S: Storage>(
    cu: &CudaTaskCtx<'_>,
    dinp: DevSliceMut<S>,    // (B, T, 3C) accumulated
    dout: DevSlice<S>,       // (B, T, C)
    inp: DevSlice<S>,        // (B, T, 3C)
    att: DevSlice<S>,        // (B, NH, T, T)
    scratch: DevSliceMut<S>, // 6 × (B, NH, T, hs) + 2 × (B, NH, T, T)
    b: usize,
    t: usize,
    c: usize,
    nh: usize,
) -> Result<()> {
    let k = Check::new("attention_backward");
    let (hs, bnh, dims) = attention_dims(&k, b, t, c, nh)?;
    let btc = k.mul(k.mul(b, t)?, c)?;
    let tt = k.mul(t, t)?;
    let att_len = k.mul(bnh, tt)?;
    let scratch_len = k
        .mul(btc, 6)?
        .checked_add(k.mul(att_len, 2)?)
        .ok_or_else(|| k.err("scratch size overflows".into()))?;
    k.exact("dinp", &dinp, "(B, T, 3C)", k.mul(btc, 3)?)?;
    k.exact("dout", &dout, "(B, T, C)", btc)?;
    k.exact("inp", &inp, "(B, T, 3C)", k.mul(btc, 3)?)?;
    k.exact("att", &att, "(B, NH, T, T)", att_len)?;
    k.exact(
        "scratch",
        &scratch,
        "6 × (B, NH, T, hs) + 2 × (B, NH, T, T)",
        scratch_len,
    )?;
    let l = Launcher::new(k, cu);
    let (dinp, dout, inp, att, scratch) =
        (dinp.ptr(), dout.ptr(), inp.ptr(), att.ptr(), scratch.ptr());
    // The scratch holds `S` elements.
    let head = (btc * std::mem::size_of::<S>()) as u64; // bytes of one (B, NH, T, hs) tensor
    let (q, kk, v, dvaccum, dk, dv) = (
        scratch,
        scratch + head,
        scratch + 2 * head,
        scratch + 3 * head,
        scratch + 4 * head,
        scratch + 5 * head,
    );
    let dq = dvaccum; // dvaccum is consumed before dq is written
    let datt = scratch + 6 * head;
    let dpreatt = datt + (att_len * std::mem::size_of::<S>()) as u64;
    let [bi, ti, nhi, hsi] = dims;
    let (s_tt, s_ths) = (tt as i64, (t * hs) as i64);
    let scale = 1.0 / (hs as f32).sqrt();
    let lin = l.linear(btc, 256)?;

    let mut a = KernelArgs::new();
    a.ptr(q)
        .ptr(kk)
        .ptr(v)
        .ptr(inp)
        .i32(bi)
        .i32(ti)
        .i32(nhi)
        .i32(hsi);
    // SAFETY: attention_permute[_bf16] as in the forward pass; q, k, v are
    // disjoint head-sized parts of the checked scratch.
    unsafe { l.launch(by_dtype::<S>(&PERMUTE, &PERMUTE_BF16), lin, &a)? };
    let mut a = KernelArgs::new();
    a.ptr(dvaccum).ptr(dout).i32(bi).i32(ti).i32(nhi).i32(hsi);
    let unpermute = by_dtype::<S>(&UNPERMUTE_BACKWARD, &UNPERMUTE_BACKWARD_BF16);
    // SAFETY: attention_unpermute_backward(float* dvaccum, const float* dout,
    // int B, int T, int NH, int hs); dout (B, T, C), dvaccum head-sized.
    unsafe { l.launch(unpermute, lin, &a)? };
    // datt = dvaccum · vᵀ
    let g = Gemm::new(Transpose::N, Transpose::T, t, t, hs);
    // SAFETY: B·NH entries of (T, hs), (T, hs) -> (T, T) inside the scratch.
    unsafe { l.gemm_batched_as::<S>(&g, dvaccum, s_ths, v, s_ths, datt, s_tt, bnh)? };
    // dv = attᵀ · dvaccum
    let g = Gemm::new(Transpose::T, Transpose::N, t, hs, t);
    // SAFETY: B·NH entries of (T, T)ᵀ, (T, hs) -> (T, hs); att is checked.
    unsafe { l.gemm_batched_as::<S>(&g, att, s_tt, dvaccum, s_ths, dv, s_ths, bnh)? };
    let mut a = KernelArgs::new();
    a.ptr(dpreatt)
        .ptr(datt)
        .ptr(att)
        .i32(bnh as i32)
        .i32(ti)
        .f32(scale);
    let softmax = by_dtype::<S>(&SOFTMAX_BACKWARD, &SOFTMAX_BACKWARD_BF16);
    // SAFETY: attention_softmax_backward(float* dpreatt, const float* datt,
    // const float* att, int BNH, int T, float scale); all (B·NH·T, T), the
    // first two disjoint parts of the scratch.
    unsafe { l.launch(softmax, l.warp_rows(bnh * t)?, &a)? };
    // dq = dpreatt · k (over dvaccum, which dv above was its last reader)
    let g = Gemm::new(Transpose::N, Transpose::N, t, hs, t);
    // SAFETY: B·NH entries of (T, T), (T, hs) -> (T, hs) inside the scratch.
    unsafe { l.gemm_batched_as::<S>(&g, dpreatt, s_tt, kk, s_ths, dq, s_ths, bnh)? };
    // dk = dpreattᵀ · q
    let g = Gemm::new(Transpose::T, Transpose::N, t, hs, t);
    // SAFETY: as above.
    unsafe { l.gemm_batched_as::<S>(&g, dpreatt, s_tt, q, s_ths, dk, s_ths, bnh)? };
    let mut a = KernelArgs::new();
    a.ptr(dinp)
        .ptr(dq)
        .ptr(dk)
        .ptr(dv)
        .i32(bi)
        .i32(ti)
        .i32(nhi)
        .i32(hsi);
    // SAFETY: attention_permute_backward(float* dinp, const float* dq, const
    // float* dk, const float* dv, int B, int T, int NH, int hs); dinp is
    // (B, T, 3C) (checked), dq, dk, dv head-sized parts of the scratch.
    unsafe {
        l.launch(
            by_dtype::<S>(&PERMUTE_BACKWARD, &PERMUTE_BACKWARD_BF16),
            lin,
            &a,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::super::storage::Bf16;
    use super::super::testutil::{assert_close, fd_check, randn};
    use super::*;

    /// Decoding the last position of each prefix gives the whole forward
    /// pass's row, bit for bit, in f32 and bf16.
    #[test]
    fn decoding_a_position_is_the_forward_passs_row() {
        let (t, c, nh) = (7, 12, 3);
        let inp = randn(t * 3 * c, 1.0, 11);
        let full = |inp: &[f32], t: usize| {
            let mut out = vec![0f32; t * c];
            let mut scores = vec![0f32; nh * t * t];
            let mut att = scores.clone();
            attention_forward(&mut out, &mut scores, &mut att, inp, 1, t, c, nh);
            out
        };
        let whole = full(&inp, t);
        for p in 1..=t {
            let mut out = vec![0f32; c];
            attention_decode(&mut out, &inp[..p * 3 * c], p, c, nh);
            assert_eq!(out, whole[(p - 1) * c..p * c], "f32, {p} positions");
        }
        let inp16: Vec<Bf16> = inp.iter().map(|&x| Bf16::from_f32(x)).collect();
        let mut whole16 = vec![Bf16::from_f32(0.0); t * c];
        let mut scores = vec![Bf16::from_f32(0.0); nh * t * t];
        let mut att = scores.clone();
        attention_forward(&mut whole16, &mut scores, &mut att, &inp16, 1, t, c, nh);
        let mut out16 = vec![Bf16::from_f32(0.0); c];
        attention_decode(&mut out16, &inp16, t, c, nh);
        assert_eq!(out16, whole16[(t - 1) * c..]);
    }

    #[test]
    fn scratch_sizes() {
        let (b, t, c, nh) = (2, 5, 12, 3);
        for dtype in [Dtype::F32, Dtype::Bf16] {
            let e = dtype.size();
            assert_eq!(forward_scratch_bytes(b, t, c, nh, dtype), 4 * b * t * c * e);
            assert_eq!(
                backward_scratch_bytes(b, t, c, nh, dtype),
                (6 * b * t * c + 2 * b * nh * t * t) * e
            );
        }
    }

    const B: usize = 2;
    const T: usize = 4;
    const C: usize = 8;
    const NH: usize = 2;

    fn forward(inp: &[f32]) -> (Vec<f32>, Vec<f32>) {
        let mut out = vec![0.0; B * T * C];
        let mut preatt = vec![f32::NAN; B * NH * T * T];
        let mut att = vec![f32::NAN; B * NH * T * T];
        attention_forward(&mut out, &mut preatt, &mut att, inp, B, T, C, NH);
        assert!(preatt.iter().all(|x| x.is_finite()));
        (out, att)
    }

    #[test]
    fn attention_is_causal_and_rows_sum_to_one() {
        let inp = randn(B * T * 3 * C, 1.0, 30);
        let (out, att) = forward(&inp);
        for row in att.chunks_exact(T).enumerate() {
            let (r, a) = row;
            let ti = r % T;
            assert!((a.iter().sum::<f32>() - 1.0).abs() < 1e-6);
            assert!(a[ti + 1..].iter().all(|&x| x == 0.0));
        }
        // Position 0 attends only to itself: its output is its own value.
        for h in 0..NH {
            let hs = C / NH;
            let v0 = &inp[2 * C + h * hs..][..hs];
            assert_close(&out[h * hs..][..hs], v0, 1e-6, 1e-6, "out[0]");
        }
        // Changing the last position must not change earlier outputs.
        let mut inp2 = inp.clone();
        for x in &mut inp2[(T - 1) * 3 * C..T * 3 * C] {
            *x += 1.0;
        }
        let (out2, _) = forward(&inp2);
        assert_eq!(out[..(T - 1) * C], out2[..(T - 1) * C]);
    }

    #[test]
    fn attention_backward_matches_finite_differences() {
        let inp = randn(B * T * 3 * C, 1.0, 31);
        let probe = randn(B * T * C, 1.0, 32);
        let (_, att) = forward(&inp);
        let mut dinp = vec![0.0; inp.len()];
        attention_backward(&mut dinp, &probe, &inp, &att, B, T, C, NH);
        fd_check(
            &inp,
            &dinp,
            |x| {
                let (out, _) = forward(x);
                out.iter()
                    .zip(&probe)
                    .map(|(&o, &p)| o as f64 * p as f64)
                    .sum()
            },
            "attention dinp",
        );
    }
}

//! Layer normalisation over the channel dimension.
//!
//! The family's one home: the tasks [`forward`] and [`backward`], the CPU
//! kernels [`layernorm_forward`] and [`layernorm_backward`], their CUDA
//! launchers [`layernorm_forward_cuda`] and [`layernorm_backward_cuda`], and
//! `layernorm.cu`. Rows are `n = B·T` positions of `c` channels. Both tasks
//! have a CUDA body for bf16 storage too (the `*_bf16` kernels).
//!
//! # Fused with the residual connection
//!
//! GPT-2 normalises each residual sum right after forming it
//! (`residual2 = x + attproj; ln2 = layernorm(residual2)`, and `residual3`
//! with the next block's `ln1` or the final `lnf`). [`forward_residual`]
//! does both in one task and one read of each row (llm.c's
//! `fused_residual_forward`): the sum is stored, rounded as
//! [`residual::forward`](super::residual::forward) rounds it, and normalised
//! from its stored value, so the outputs are those of the two tasks, bit for
//! bit.
//!
//! Backward, the residual's gradient passes through unchanged: the gradient
//! of `residual2` is that of `residual3` plus `ln2`'s contribution. With
//! [`backward_residual`] the layer norm writes `dinp = dres + (its
//! gradient)` instead of accumulating into a zeroed `dinp` that a residual
//! backward task first filled with `dres`: the residual backward tasks
//! disappear, and the projections' output gradients (`dattproj`, `dfcproj`)
//! are the residual gradients themselves, so they need no buffers of their
//! own. Again bit for bit what the unfused tasks compute.

use braid::cuda::{KernelArgs, LaunchConfig};
use braid::{CudaTaskCtx, DevSlice, DevSliceMut, Result, TaskHandle, View};

use super::check_len;
use super::cuda_common::{by_dtype, task_result, Check, Kernel, Launcher, Program};
use super::storage::Storage;
use super::task::{submit, Task};

pub(crate) static CUDA: Program = Program::new(
    "layernorm.cu",
    include_str!("layernorm.cu"),
    &[
        "layernorm_forward",
        "layernorm_backward_input",
        "layernorm_backward_params_partial",
        "layernorm_forward_bf16",
        "layernorm_backward_input_bf16",
        "layernorm_backward_params_partial_bf16",
        "layernorm_residual_forward",
        "layernorm_residual_forward_bf16",
        "layernorm_backward_params_finish",
        "layernorm_backward_params_finish_bf16",
    ],
);
static FORWARD: Kernel = Kernel::new(&CUDA, 0);
static BACKWARD_INPUT: Kernel = Kernel::new(&CUDA, 1);
static PARAMS_PARTIAL: Kernel = Kernel::new(&CUDA, 2);
static FORWARD_BF16: Kernel = Kernel::new(&CUDA, 3);
static BACKWARD_INPUT_BF16: Kernel = Kernel::new(&CUDA, 4);
static PARAMS_PARTIAL_BF16: Kernel = Kernel::new(&CUDA, 5);
static RESIDUAL_FORWARD: Kernel = Kernel::new(&CUDA, 6);
static RESIDUAL_FORWARD_BF16: Kernel = Kernel::new(&CUDA, 7);
static PARAMS_FINISH: Kernel = Kernel::new(&CUDA, 8);
static PARAMS_FINISH_BF16: Kernel = Kernel::new(&CUDA, 9);

/// Rows per chunk the parameter gradients' first kernel aims at on CUDA
/// (`layernorm.cu`, `ln_params_partial`): each chunk's sums are a block's
/// work per 32 channels.
pub const PARAMS_CHUNK_ROWS: usize = 256;
/// At most this many row chunks.
pub const PARAMS_MAX_CHUNKS: usize = 64;

/// The row chunks of the parameter gradients' sums on CUDA for `n` rows:
/// `ceil(n / 256)`, 1 to 64. A function of `n` alone, so the sums are the
/// same, bit for bit, for every run of a shape.
pub fn params_chunks(n: usize) -> usize {
    n.div_ceil(PARAMS_CHUNK_ROWS).clamp(1, PARAMS_MAX_CHUNKS)
}

/// Bytes of scratch [`backward`] and [`backward_residual`] need on CUDA for
/// `n` rows of `c` channels: the row chunks' `f32` sums, `(chunks, 2, c)`
/// ([`params_chunks`]). The CPU body leaves the scratch untouched.
pub fn backward_scratch_bytes(n: usize, c: usize) -> usize {
    params_chunks(n) * 2 * c * 4
}

// ---------------------------------------------------------------------------
// Tasks
// ---------------------------------------------------------------------------

/// Submits `out, mean, rstd = layernorm(inp; weight, bias)` as `task`.
pub fn forward<'rt>(
    task: impl Into<Task<'rt>>,
    out: &View,    // (N, C)
    mean: &View,   // (N)
    rstd: &View,   // (N)
    inp: &View,    // (N, C)
    weight: &View, // (C)
    bias: &View,   // (C)
    n: usize,
    c: usize,
) -> Result<TaskHandle> {
    submit!(
        task,
        |S| (
            out.write::<S>(),
            mean.write::<f32>(),
            rstd.write::<f32>(),
            inp.read::<S>(),
            weight.read::<S>(),
            bias.read::<S>(),
        ),
        move |(out, mean, rstd, inp, w, bias)| {
            layernorm_forward(out, mean, rstd, inp, w, bias, 1, n, c)
        },
        move |(out, mean, rstd, inp, w, bias), cu| {
            task_result(layernorm_forward_cuda(
                cu, out, mean, rstd, inp, w, bias, n, c,
            ))
        },
    )
}

/// Submits the backward pass of [`forward`] as `task`: accumulates `dinp`,
/// `dweight` and `dbias`.
pub fn backward<'rt>(
    task: impl Into<Task<'rt>>,
    dinp: &View,    // (N, C) accumulated
    dweight: &View, // (C) accumulated
    dbias: &View,   // (C) accumulated
    dout: &View,    // (N, C)
    inp: &View,     // (N, C)
    weight: &View,  // (C)
    mean: &View,    // (N)
    rstd: &View,    // (N)
    scratch: &View, // backward_scratch_bytes
    n: usize,
    c: usize,
) -> Result<TaskHandle> {
    backward_residual(
        task, dinp, None, dweight, dbias, dout, inp, weight, mean, rstd, scratch, n, c,
    )
}

/// Submits `residual = inp1 + inp2; out, mean, rstd = layernorm(residual)`
/// as one task (module docs: bit for bit [`residual::forward`] then
/// [`forward`]).
///
/// [`residual::forward`]: super::residual::forward
pub fn forward_residual<'rt>(
    task: impl Into<Task<'rt>>,
    residual: &View, // (N, C)
    out: &View,      // (N, C)
    mean: &View,     // (N)
    rstd: &View,     // (N)
    inp1: &View,     // (N, C)
    inp2: &View,     // (N, C)
    weight: &View,   // (C)
    bias: &View,     // (C)
    n: usize,
    c: usize,
) -> Result<TaskHandle> {
    submit!(
        task,
        |S| (
            residual.write::<S>(),
            out.write::<S>(),
            mean.write::<f32>(),
            rstd.write::<f32>(),
            inp1.read::<S>(),
            inp2.read::<S>(),
            weight.read::<S>(),
            bias.read::<S>(),
        ),
        move |(res, out, mean, rstd, a, b, w, bias)| {
            layernorm_residual_forward(res, out, mean, rstd, a, b, w, bias, n, c)
        },
        move |(res, out, mean, rstd, a, b, w, bias), cu| {
            task_result(layernorm_residual_forward_cuda(
                cu, res, out, mean, rstd, a, b, w, bias, n, c,
            ))
        },
    )
}

/// Submits the backward pass of [`forward`] with the residual's gradient
/// passed through (module docs) when `dres` is given: OVERWRITES `dinp` with
/// `dres` plus the layer norm's input gradient, accumulates `dweight` and
/// `dbias`; bit for bit what a zeroed `dinp`, a residual backward task
/// adding `dres`, then [`backward`] give. With `None` it is [`backward`].
/// `dinp` is declared `read_write` either way (for an overwrite that orders
/// exactly as a `write` would: after its last writer and its readers).
pub fn backward_residual<'rt>(
    task: impl Into<Task<'rt>>,
    dinp: &View,         // (N, C) overwritten (accumulated without dres)
    dres: Option<&View>, // (N, C)
    dweight: &View,      // (C) accumulated
    dbias: &View,        // (C) accumulated
    dout: &View,         // (N, C)
    inp: &View,          // (N, C)
    weight: &View,       // (C)
    mean: &View,         // (N)
    rstd: &View,         // (N)
    scratch: &View,      // backward_scratch_bytes
    n: usize,
    c: usize,
) -> Result<TaskHandle> {
    let name = match dres {
        Some(_) => "layernorm_backward_residual",
        None => "layernorm_backward",
    };
    submit!(
        task,
        |S| (
            dinp.read_write::<S>(),
            dres.map(|d| d.read::<S>()),
            dweight.read_write::<S>(),
            dbias.read_write::<S>(),
            dout.read::<S>(),
            inp.read::<S>(),
            weight.read::<S>(),
            mean.read::<f32>(),
            rstd.read::<f32>(),
            scratch.write::<f32>(),
        ),
        move |(dinp, dres, dw, db, dout, inp, w, mean, rstd, _scratch)| {
            backward_rows(name, dinp, dres, dw, db, dout, inp, w, mean, rstd, n, c)
        },
        move |(dinp, dres, dw, db, dout, inp, w, mean, rstd, scratch), cu| {
            task_result(backward_cuda(
                cu, dinp, dres, dw, db, dout, inp, w, mean, rstd, scratch, n, c,
            ))
        },
    )
}

// ---------------------------------------------------------------------------
// CPU
// ---------------------------------------------------------------------------
/// The epsilon GPT-2 uses inside the square root (`layer_norm_epsilon`).
pub const LAYERNORM_EPS: f32 = 1e-5;

/// `out = (inp - mean) · rstd · weight + bias` per row, with the biased
/// variance; saves each row's `mean` and `rstd = 1 / sqrt(var + 1e-5)` for the
/// backward pass.
pub fn layernorm_forward<S: Storage>(
    out: &mut [S],    // (B, T, C)
    mean: &mut [f32], // (B, T)
    rstd: &mut [f32], // (B, T)
    inp: &[S],        // (B, T, C)
    weight: &[S],     // (C)
    bias: &[S],       // (C)
    b: usize,
    t: usize,
    c: usize,
) {
    let n = b * t;
    check_len("layernorm_forward", "out", out.len(), n * c);
    check_len("layernorm_forward", "mean", mean.len(), n);
    check_len("layernorm_forward", "rstd", rstd.len(), n);
    check_len("layernorm_forward", "inp", inp.len(), n * c);
    check_len("layernorm_forward", "weight", weight.len(), c);
    check_len("layernorm_forward", "bias", bias.len(), c);
    let rows = out.chunks_exact_mut(c).zip(inp.chunks_exact(c));
    for (row, (out_bt, inp_bt)) in rows.enumerate() {
        let m = inp_bt.iter().map(|&x| x.load() as f64).sum::<f64>() / c as f64;
        let var = inp_bt
            .iter()
            .map(|&x| {
                let d = x.load() as f64 - m;
                d * d
            })
            .sum::<f64>()
            / c as f64;
        let s = 1.0 / (var + LAYERNORM_EPS as f64).sqrt();
        let (m, s) = (m as f32, s as f32);
        for (((o, &x), &w), &bb) in out_bt.iter_mut().zip(inp_bt).zip(weight).zip(bias) {
            *o = S::store((x.load() - m) * s * w.load() + bb.load());
        }
        mean[row] = m;
        rstd[row] = s;
    }
}

/// Accumulates `dinp`, `dweight` and `dbias` from `dout`, using the `mean`
/// and `rstd` saved by [`layernorm_forward`].
pub fn layernorm_backward<S: Storage>(
    dinp: &mut [S],    // (B, T, C)
    dweight: &mut [S], // (C)
    dbias: &mut [S],   // (C)
    dout: &[S],        // (B, T, C)
    inp: &[S],         // (B, T, C)
    weight: &[S],      // (C)
    mean: &[f32],      // (B, T)
    rstd: &[f32],      // (B, T)
    b: usize,
    t: usize,
    c: usize,
) {
    let n = b * t;
    backward_rows(
        "layernorm_backward",
        dinp,
        None,
        dweight,
        dbias,
        dout,
        inp,
        weight,
        mean,
        rstd,
        n,
        c,
    )
}

/// `residual = inp1 + inp2`, then [`layernorm_forward`] of `residual` as
/// stored, row by row (module docs: bit for bit the two kernels in turn).
pub fn layernorm_residual_forward<S: Storage>(
    residual: &mut [S], // (N, C)
    out: &mut [S],      // (N, C)
    mean: &mut [f32],   // (N)
    rstd: &mut [f32],   // (N)
    inp1: &[S],         // (N, C)
    inp2: &[S],         // (N, C)
    weight: &[S],       // (C)
    bias: &[S],         // (C)
    n: usize,
    c: usize,
) {
    let name = "layernorm_residual_forward";
    check_len(name, "residual", residual.len(), n * c);
    check_len(name, "out", out.len(), n * c);
    check_len(name, "mean", mean.len(), n);
    check_len(name, "rstd", rstd.len(), n);
    check_len(name, "inp1", inp1.len(), n * c);
    check_len(name, "inp2", inp2.len(), n * c);
    check_len(name, "weight", weight.len(), c);
    check_len(name, "bias", bias.len(), c);
    for row in 0..n {
        let rows = row * c..(row + 1) * c;
        let res = &mut residual[rows.clone()];
        super::residual::residual_forward(res, &inp1[rows.clone()], &inp2[rows.clone()]);
        layernorm_forward(
            &mut out[rows],
            &mut mean[row..row + 1],
            &mut rstd[row..row + 1],
            res,
            weight,
            bias,
            1,
            1,
            c,
        );
    }
}

/// [`layernorm_backward`] with the residual's gradient passed through:
/// OVERWRITES `dinp` with `dres` plus the input gradient (module docs).
pub fn layernorm_backward_residual<S: Storage>(
    dinp: &mut [S],    // (N, C) overwritten
    dweight: &mut [S], // (C)
    dbias: &mut [S],   // (C)
    dres: &[S],        // (N, C)
    dout: &[S],        // (N, C)
    inp: &[S],         // (N, C)
    weight: &[S],      // (C)
    mean: &[f32],      // (N)
    rstd: &[f32],      // (N)
    n: usize,
    c: usize,
) {
    backward_rows(
        "layernorm_backward_residual",
        dinp,
        Some(dres),
        dweight,
        dbias,
        dout,
        inp,
        weight,
        mean,
        rstd,
        n,
        c,
    )
}

/// The backward pass of both: each `dinp` element becomes its base (`dres`
/// if given, else its own value) plus the input gradient, rounded once.
fn backward_rows<S: Storage>(
    name: &str,
    dinp: &mut [S],
    dres: Option<&[S]>,
    dweight: &mut [S],
    dbias: &mut [S],
    dout: &[S],
    inp: &[S],
    weight: &[S],
    mean: &[f32],
    rstd: &[f32],
    n: usize,
    c: usize,
) {
    check_len(name, "dinp", dinp.len(), n * c);
    if let Some(dres) = dres {
        check_len(name, "dres", dres.len(), n * c);
    }
    check_len(name, "dweight", dweight.len(), c);
    check_len(name, "dbias", dbias.len(), c);
    check_len(name, "dout", dout.len(), n * c);
    check_len(name, "inp", inp.len(), n * c);
    check_len(name, "weight", weight.len(), c);
    check_len(name, "mean", mean.len(), n);
    check_len(name, "rstd", rstd.len(), n);
    // The parameter gradients sum over every row: rounded once, at the end.
    S::update_f32(dweight, |dweight| {
        S::update_f32(dbias, |dbias| {
            for row in 0..n {
                let dout_bt = &dout[row * c..][..c];
                let inp_bt = &inp[row * c..][..c];
                let dinp_bt = &mut dinp[row * c..][..c];
                let dres_bt = dres.map(|d| &d[row * c..][..c]);
                let (m, s) = (mean[row], rstd[row]);
                // Two reductions: mean(dnorm) and mean(dnorm · norm).
                let mut dnorm_mean = 0.0f64;
                let mut dnorm_norm_mean = 0.0f64;
                for i in 0..c {
                    let norm_i = (inp_bt[i].load() - m) * s;
                    let dnorm_i = weight[i].load() * dout_bt[i].load();
                    dnorm_mean += dnorm_i as f64;
                    dnorm_norm_mean += (dnorm_i * norm_i) as f64;
                }
                let dnorm_mean = (dnorm_mean / c as f64) as f32;
                let dnorm_norm_mean = (dnorm_norm_mean / c as f64) as f32;
                for i in 0..c {
                    let dout_i = dout_bt[i].load();
                    let norm_i = (inp_bt[i].load() - m) * s;
                    let dnorm_i = weight[i].load() * dout_i;
                    dbias[i] += dout_i;
                    dweight[i] += norm_i * dout_i;
                    let d = (dnorm_i - dnorm_mean - norm_i * dnorm_norm_mean) * s;
                    let base = match dres_bt {
                        Some(r) => r[i].load(),
                        None => dinp_bt[i].load(),
                    };
                    dinp_bt[i] = S::store(base + d);
                }
            }
        })
    })
}

// ---------------------------------------------------------------------------
// CUDA
// ---------------------------------------------------------------------------

/// [`layernorm_forward`] on the task's stream (`f32` storage: statistics
/// reduced in `f32` warp trees where the CPU accumulates in `f64`; bf16
/// storage: in `f64` warp trees, the elementwise steps in the CPU's order).
pub fn layernorm_forward_cuda<S: Storage>(
    cu: &CudaTaskCtx<'_>,
    out: DevSliceMut<S>,    // (N, C)
    mean: DevSliceMut<f32>, // (N)
    rstd: DevSliceMut<f32>, // (N)
    inp: DevSlice<S>,       // (N, C)
    weight: DevSlice<S>,    // (C)
    bias: DevSlice<S>,      // (C)
    n: usize,
    c: usize,
) -> Result<()> {
    forward_cuda(cu, None, out, mean, rstd, inp, weight, bias, n, c)
}

/// [`layernorm_residual_forward`] on the task's stream: one warp per row
/// stores the sum, then normalises it exactly as [`layernorm_forward_cuda`]
/// does (the same warp code reading the stored sum), so the outputs are
/// those of the residual and layer-norm kernels in turn, bit for bit.
pub fn layernorm_residual_forward_cuda<S: Storage>(
    cu: &CudaTaskCtx<'_>,
    residual: DevSliceMut<S>, // (N, C)
    out: DevSliceMut<S>,      // (N, C)
    mean: DevSliceMut<f32>,   // (N)
    rstd: DevSliceMut<f32>,   // (N)
    inp1: DevSlice<S>,        // (N, C)
    inp2: DevSlice<S>,        // (N, C)
    weight: DevSlice<S>,      // (C)
    bias: DevSlice<S>,        // (C)
    n: usize,
    c: usize,
) -> Result<()> {
    forward_cuda(
        cu,
        Some((residual, inp2)),
        out,
        mean,
        rstd,
        inp1,
        weight,
        bias,
        n,
        c,
    )
}

/// Both forward launchers: with `residual = Some((residual, inp2))` the
/// fused kernel normalises `residual = inp + inp2`.
fn forward_cuda<S: Storage>(
    cu: &CudaTaskCtx<'_>,
    residual: Option<(DevSliceMut<S>, DevSlice<S>)>,
    out: DevSliceMut<S>,
    mean: DevSliceMut<f32>,
    rstd: DevSliceMut<f32>,
    inp: DevSlice<S>,
    weight: DevSlice<S>,
    bias: DevSlice<S>,
    n: usize,
    c: usize,
) -> Result<()> {
    let k = Check::new(match residual {
        Some(_) => "layernorm_residual_forward",
        None => "layernorm_forward",
    });
    let (ni, ci) = (k.dim("N", n)?, k.dim("C", c)?);
    let nc = k.mul(n, c)?;
    if let Some((res, inp2)) = &residual {
        k.exact("residual", res, "(N, C)", nc)?;
        k.exact("inp2", inp2, "(N, C)", nc)?;
    }
    k.exact("out", &out, "(N, C)", nc)?;
    k.exact("mean", &mean, "(N)", n)?;
    k.exact("rstd", &rstd, "(N)", n)?;
    let inp_name = if residual.is_some() { "inp1" } else { "inp" };
    k.exact(inp_name, &inp, "(N, C)", nc)?;
    k.exact("weight", &weight, "(C)", c)?;
    k.exact("bias", &bias, "(C)", c)?;
    let l = Launcher::new(k, cu);
    let mut a = KernelArgs::new();
    if let Some((res, _)) = &residual {
        a.ptr(res.ptr());
    }
    a.ptr(out.ptr())
        .ptr(mean.ptr())
        .ptr(rstd.ptr())
        .ptr(inp.ptr());
    if let Some((_, inp2)) = &residual {
        a.ptr(inp2.ptr());
    }
    a.ptr(weight.ptr()).ptr(bias.ptr()).i32(ni).i32(ci);
    let kernel = match residual {
        Some(_) => by_dtype::<S>(&RESIDUAL_FORWARD, &RESIDUAL_FORWARD_BF16),
        None => by_dtype::<S>(&FORWARD, &FORWARD_BF16),
    };
    // SAFETY: layernorm_forward[_bf16](S* out, float* mean, float* rstd,
    // const S* inp, const S* weight, const S* bias, int N, int C), or
    // layernorm_residual_forward[_bf16](S* residual, S* out, float* mean,
    // float* rstd, const S* inp1, const S* inp2, const S* weight, const S*
    // bias, int N, int C): the arguments in that order, S the storage type of
    // all but mean and rstd, every buffer sized for N rows of C (checked);
    // residual disjoint from the inputs (distinct tokens of one task).
    unsafe { l.launch(kernel, l.warp_rows(n)?, &a) }
}

/// [`layernorm_backward`] on the task's stream: accumulates `dinp`,
/// `dweight`, `dbias`; `f32` or bf16 storage (with bf16, each gradient
/// element is loaded, gets all its contributions in `f32` and is rounded
/// once, as on the CPU).
pub fn layernorm_backward_cuda<S: Storage>(
    cu: &CudaTaskCtx<'_>,
    dinp: DevSliceMut<S>,      // (N, C) accumulated
    dweight: DevSliceMut<S>,   // (C) accumulated
    dbias: DevSliceMut<S>,     // (C) accumulated
    dout: DevSlice<S>,         // (N, C)
    inp: DevSlice<S>,          // (N, C)
    weight: DevSlice<S>,       // (C)
    mean: DevSlice<f32>,       // (N)
    rstd: DevSlice<f32>,       // (N)
    scratch: DevSliceMut<f32>, // (chunks, 2, C), backward_scratch_bytes
    n: usize,
    c: usize,
) -> Result<()> {
    backward_cuda(
        cu, dinp, None, dweight, dbias, dout, inp, weight, mean, rstd, scratch, n, c,
    )
}

/// The backward launcher of both tasks: `dres` `None` accumulates into
/// `dinp` ([`layernorm_backward_cuda`]); with `dres` it overwrites `dinp`
/// with `dres` plus the input gradient ([`layernorm_backward_residual`] on
/// the task's stream: the same kernel, given `dres` as the base).
fn backward_cuda<S: Storage>(
    cu: &CudaTaskCtx<'_>,
    dinp: DevSliceMut<S>,
    dres: Option<DevSlice<S>>,
    dweight: DevSliceMut<S>,
    dbias: DevSliceMut<S>,
    dout: DevSlice<S>,
    inp: DevSlice<S>,
    weight: DevSlice<S>,
    mean: DevSlice<f32>,
    rstd: DevSlice<f32>,
    scratch: DevSliceMut<f32>,
    n: usize,
    c: usize,
) -> Result<()> {
    let k = Check::new(if dres.is_some() {
        "layernorm_backward_residual"
    } else {
        "layernorm_backward"
    });
    let (ni, ci) = (k.dim("N", n)?, k.dim("C", c)?);
    let nc = k.mul(n, c)?;
    k.exact("dinp", &dinp, "(N, C)", nc)?;
    if let Some(dres) = &dres {
        k.exact("dres", dres, "(N, C)", nc)?;
    }
    k.exact("dweight", &dweight, "(C)", c)?;
    k.exact("dbias", &dbias, "(C)", c)?;
    k.exact("dout", &dout, "(N, C)", nc)?;
    k.exact("inp", &inp, "(N, C)", nc)?;
    k.exact("weight", &weight, "(C)", c)?;
    k.exact("mean", &mean, "(N)", n)?;
    k.exact("rstd", &rstd, "(N)", n)?;
    let chunks = params_chunks(n);
    k.rows("scratch", &scratch, "(chunks, 2, C) f32", c, 2 * chunks)?;
    let chunks_i = k.dim("chunks", chunks)?;
    let l = Launcher::new(k, cu);
    let mut a = KernelArgs::new();
    a.ptr(dinp.ptr())
        .ptr(dres.as_ref().map_or(0, |d| d.ptr()))
        .ptr(dout.ptr())
        .ptr(inp.ptr())
        .ptr(weight.ptr())
        .ptr(mean.ptr())
        .ptr(rstd.ptr())
        .i32(ni)
        .i32(ci);
    let kernel = by_dtype::<S>(&BACKWARD_INPUT, &BACKWARD_INPUT_BF16);
    // SAFETY: layernorm_backward_input[_bf16](S* dinp, const S* dres, const
    // S* dout, const S* inp, const S* weight, const float* mean, const float*
    // rstd, int N, int C), S the storage type of dinp, dres, dout, inp and
    // weight, buffers sized for N rows of C (checked); dres null (accumulate)
    // or disjoint from dinp (distinct tokens of one task).
    unsafe { l.launch(kernel, l.warp_rows(n)?, &a)? };
    // The parameter gradients: each row chunk's sums into the scratch,
    // then dweight and dbias accumulate the chunks in order.
    let mut a = KernelArgs::new();
    a.ptr(scratch.ptr())
        .ptr(dout.ptr())
        .ptr(inp.ptr())
        .ptr(mean.ptr())
        .ptr(rstd.ptr())
        .i32(ni)
        .i32(ci);
    let kernel = by_dtype::<S>(&PARAMS_PARTIAL, &PARAMS_PARTIAL_BF16);
    // A block of 8 warps (LN_PARAMS_WARPS) per 32 channels and row chunk.
    let cfg = LaunchConfig {
        grid: (l.grid(c.div_ceil(32))?, chunks_i as u32, 1),
        block: (32 * 8, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: layernorm_backward_params_partial[_bf16](float* part, const S*
    // dout, const S* inp, const float* mean, const float* rstd, int N, int
    // C), S the storage type of dout and inp, buffers sized for N rows of C
    // (checked), part at least (gridDim.y, 2, C) f32 (checked); part is the
    // task's own scratch, disjoint from the rest.
    unsafe { l.launch(kernel, cfg, &a)? };
    let mut a = KernelArgs::new();
    a.ptr(dweight.ptr())
        .ptr(dbias.ptr())
        .ptr(scratch.ptr())
        .i32(ci)
        .i32(chunks_i);
    let kernel = by_dtype::<S>(&PARAMS_FINISH, &PARAMS_FINISH_BF16);
    // SAFETY: layernorm_backward_params_finish[_bf16](S* dweight, S* dbias,
    // const float* part, int C, int R): dweight and dbias hold C (checked),
    // part (R, 2, C) f32 written by the launch above on this stream.
    unsafe { l.launch(kernel, l.linear(c, 256)?, &a) }
}

#[cfg(test)]
mod tests {
    use super::super::residual::{residual_backward, residual_forward};
    use super::super::storage::Bf16;
    use super::super::testutil::{fd_check, randn};
    use super::*;

    fn stored<S: Storage>(n: usize, std: f32, seed: u64) -> Vec<S> {
        randn(n, std, seed).into_iter().map(S::store).collect()
    }

    fn bits<S: Storage>(x: &[S]) -> Vec<u32> {
        x.iter().map(|v| v.load().to_bits()).collect()
    }

    /// The fused residual + layer norm against the two kernels in turn, bit
    /// for bit: forward, and backward with the residual's gradient passed
    /// through against a zeroed `dinp` + a residual backward + the
    /// accumulating layer-norm backward. Odd sizes; `S` f32 or bf16.
    fn residual_fusion_is_exact<S: Storage>() {
        let (n, c) = (7, 45);
        let (a, b) = (stored::<S>(n * c, 1.0, 40), stored::<S>(n * c, 1.0, 41));
        let w: Vec<S> = randn(c, 0.3, 42)
            .iter()
            .map(|x| S::store(1.0 + x))
            .collect();
        let bias = stored::<S>(c, 0.3, 43);
        let zero = || vec![S::store(0.0); n * c];
        let (mut res, mut out) = (zero(), zero());
        let (mut mean, mut rstd) = (vec![0.0; n], vec![0.0; n]);
        residual_forward(&mut res, &a, &b);
        layernorm_forward(&mut out, &mut mean, &mut rstd, &res, &w, &bias, 1, n, c);
        let (mut fres, mut fout) = (zero(), zero());
        let (mut fmean, mut frstd) = (vec![0.0; n], vec![0.0; n]);
        layernorm_residual_forward(
            &mut fres, &mut fout, &mut fmean, &mut frstd, &a, &b, &w, &bias, n, c,
        );
        assert_eq!(bits(&fres), bits(&res), "residual");
        assert_eq!(bits(&fout), bits(&out), "out");
        assert_eq!(fmean, mean, "mean");
        assert_eq!(frstd, rstd, "rstd");

        let (dres, dout) = (stored::<S>(n * c, 1.0, 44), stored::<S>(n * c, 1.0, 45));
        let (dw0, db0) = (stored::<S>(c, 0.1, 46), stored::<S>(c, 0.1, 47));
        // Unfused: zeroed dinp, += dres (the residual backward; its other
        // output is the projection's gradient), += the layer norm's.
        let (mut dinp, mut dproj) = (zero(), zero());
        let (mut dw, mut db) = (dw0.clone(), db0.clone());
        residual_backward(&mut dinp, &mut dproj, &dres);
        layernorm_backward(
            &mut dinp, &mut dw, &mut db, &dout, &res, &w, &mean, &rstd, 1, n, c,
        );
        // Fused: dinp starts as garbage and is overwritten.
        let mut fdinp = stored::<S>(n * c, 5.0, 48);
        let (mut fdw, mut fdb) = (dw0.clone(), db0.clone());
        layernorm_backward_residual(
            &mut fdinp, &mut fdw, &mut fdb, &dres, &dout, &res, &w, &mean, &rstd, n, c,
        );
        assert_eq!(bits(&fdinp), bits(&dinp), "dinp");
        assert_eq!(bits(&fdw), bits(&dw), "dweight");
        assert_eq!(bits(&fdb), bits(&db), "dbias");
        // The projection's gradient the fused path aliases: dres itself.
        assert_eq!(bits(&dproj), bits(&dres), "dproj");
        // Not vacuous: the layer norm's term changed dinp.
        assert_ne!(bits(&fdinp), bits(&dres));
    }

    #[test]
    fn residual_fusion_is_exact_f32() {
        residual_fusion_is_exact::<f32>();
    }

    #[test]
    fn residual_fusion_is_exact_bf16() {
        residual_fusion_is_exact::<Bf16>();
    }

    #[test]
    fn layernorm_backward_matches_finite_differences() {
        let (b, t, c) = (2, 3, 8);
        let inp = randn(b * t * c, 1.0, 10);
        let weight: Vec<f32> = randn(c, 0.3, 11).iter().map(|w| 1.0 + w).collect();
        let bias = randn(c, 0.3, 12);
        let probe = randn(b * t * c, 1.0, 13);
        let objective = |inp: &[f32], weight: &[f32], bias: &[f32]| -> f64 {
            let (mut out, mut mean, mut rstd) =
                (vec![0.0; b * t * c], vec![0.0; b * t], vec![0.0; b * t]);
            layernorm_forward(&mut out, &mut mean, &mut rstd, inp, weight, bias, b, t, c);
            out.iter()
                .zip(&probe)
                .map(|(&o, &p)| o as f64 * p as f64)
                .sum()
        };
        let (mut out, mut mean, mut rstd) =
            (vec![0.0; b * t * c], vec![0.0; b * t], vec![0.0; b * t]);
        layernorm_forward(
            &mut out, &mut mean, &mut rstd, &inp, &weight, &bias, b, t, c,
        );
        let mut dinp = vec![0.0; b * t * c];
        let mut dweight = vec![0.0; c];
        let mut dbias = vec![0.0; c];
        layernorm_backward(
            &mut dinp,
            &mut dweight,
            &mut dbias,
            &probe,
            &inp,
            &weight,
            &mean,
            &rstd,
            b,
            t,
            c,
        );
        fd_check(
            &inp,
            &dinp,
            |x| objective(x, &weight, &bias),
            "layernorm dinp",
        );
        fd_check(
            &weight,
            &dweight,
            |w| objective(&inp, w, &bias),
            "layernorm dweight",
        );
        fd_check(
            &bias,
            &dbias,
            |bb| objective(&inp, &weight, bb),
            "layernorm dbias",
        );
    }
}

//! Layer normalisation over the channel dimension.
//!
//! The family's one home: the tasks [`forward`] and [`backward`], the CPU
//! kernels [`layernorm_forward`] and [`layernorm_backward`], their CUDA
//! launchers [`layernorm_forward_cuda`] and [`layernorm_backward_cuda`], and
//! `layernorm.cu`. Rows are `n = B·T` positions of `c` channels. Both tasks
//! have a CUDA body for bf16 storage too (the `*_bf16` kernels: compiled
//! under NVRTC, never yet run on a GPU).

use braid::cuda::KernelArgs;
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
        "layernorm_backward_params",
        "layernorm_forward_bf16",
        "layernorm_backward_input_bf16",
        "layernorm_backward_params_bf16",
    ],
);
static FORWARD: Kernel = Kernel::new(&CUDA, 0);
static BACKWARD_INPUT: Kernel = Kernel::new(&CUDA, 1);
static BACKWARD_PARAMS: Kernel = Kernel::new(&CUDA, 2);
static FORWARD_BF16: Kernel = Kernel::new(&CUDA, 3);
static BACKWARD_INPUT_BF16: Kernel = Kernel::new(&CUDA, 4);
static BACKWARD_PARAMS_BF16: Kernel = Kernel::new(&CUDA, 5);

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
    n: usize,
    c: usize,
) -> Result<TaskHandle> {
    submit!(
        task,
        |S| (
            dinp.read_write::<S>(),
            dweight.read_write::<S>(),
            dbias.read_write::<S>(),
            dout.read::<S>(),
            inp.read::<S>(),
            weight.read::<S>(),
            mean.read::<f32>(),
            rstd.read::<f32>(),
        ),
        move |(dinp, dw, db, dout, inp, w, mean, rstd)| {
            layernorm_backward(dinp, dw, db, dout, inp, w, mean, rstd, 1, n, c)
        },
        move |(dinp, dw, db, dout, inp, w, mean, rstd), cu| {
            task_result(layernorm_backward_cuda(
                cu, dinp, dw, db, dout, inp, w, mean, rstd, n, c,
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
    check_len("layernorm_backward", "dinp", dinp.len(), n * c);
    check_len("layernorm_backward", "dweight", dweight.len(), c);
    check_len("layernorm_backward", "dbias", dbias.len(), c);
    check_len("layernorm_backward", "dout", dout.len(), n * c);
    check_len("layernorm_backward", "inp", inp.len(), n * c);
    check_len("layernorm_backward", "weight", weight.len(), c);
    check_len("layernorm_backward", "mean", mean.len(), n);
    check_len("layernorm_backward", "rstd", rstd.len(), n);
    // The parameter gradients sum over every row: rounded once, at the end.
    S::update_f32(dweight, |dweight| {
        S::update_f32(dbias, |dbias| {
            for row in 0..n {
                let dout_bt = &dout[row * c..][..c];
                let inp_bt = &inp[row * c..][..c];
                let dinp_bt = &mut dinp[row * c..][..c];
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
                    dinp_bt[i] = S::store(dinp_bt[i].load() + d);
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
    let k = Check::new("layernorm_forward");
    let (ni, ci) = (k.dim("N", n)?, k.dim("C", c)?);
    let nc = k.mul(n, c)?;
    k.exact("out", &out, "(N, C)", nc)?;
    k.exact("mean", &mean, "(N)", n)?;
    k.exact("rstd", &rstd, "(N)", n)?;
    k.exact("inp", &inp, "(N, C)", nc)?;
    k.exact("weight", &weight, "(C)", c)?;
    k.exact("bias", &bias, "(C)", c)?;
    let l = Launcher::new(k, cu);
    let mut a = KernelArgs::new();
    a.ptr(out.ptr())
        .ptr(mean.ptr())
        .ptr(rstd.ptr())
        .ptr(inp.ptr())
        .ptr(weight.ptr())
        .ptr(bias.ptr())
        .i32(ni)
        .i32(ci);
    let kernel = by_dtype::<S>(&FORWARD, &FORWARD_BF16);
    // SAFETY: layernorm_forward[_bf16](S* out, float* mean, float* rstd,
    // const S* inp, const S* weight, const S* bias, int N, int C), S the
    // storage type of out, inp, weight and bias, with every buffer sized for
    // N rows of C (checked).
    unsafe { l.launch(kernel, l.warp_rows(n)?, &a) }
}

/// [`layernorm_backward`] on the task's stream: accumulates `dinp`,
/// `dweight`, `dbias`; `f32` or bf16 storage (with bf16, each gradient
/// element is loaded, gets all its contributions in `f32` and is rounded
/// once, as on the CPU).
pub fn layernorm_backward_cuda<S: Storage>(
    cu: &CudaTaskCtx<'_>,
    dinp: DevSliceMut<S>,    // (N, C) accumulated
    dweight: DevSliceMut<S>, // (C) accumulated
    dbias: DevSliceMut<S>,   // (C) accumulated
    dout: DevSlice<S>,       // (N, C)
    inp: DevSlice<S>,        // (N, C)
    weight: DevSlice<S>,     // (C)
    mean: DevSlice<f32>,     // (N)
    rstd: DevSlice<f32>,     // (N)
    n: usize,
    c: usize,
) -> Result<()> {
    let k = Check::new("layernorm_backward");
    let (ni, ci) = (k.dim("N", n)?, k.dim("C", c)?);
    let nc = k.mul(n, c)?;
    k.exact("dinp", &dinp, "(N, C)", nc)?;
    k.exact("dweight", &dweight, "(C)", c)?;
    k.exact("dbias", &dbias, "(C)", c)?;
    k.exact("dout", &dout, "(N, C)", nc)?;
    k.exact("inp", &inp, "(N, C)", nc)?;
    k.exact("weight", &weight, "(C)", c)?;
    k.exact("mean", &mean, "(N)", n)?;
    k.exact("rstd", &rstd, "(N)", n)?;
    let l = Launcher::new(k, cu);
    let mut a = KernelArgs::new();
    a.ptr(dinp.ptr())
        .ptr(dout.ptr())
        .ptr(inp.ptr())
        .ptr(weight.ptr())
        .ptr(mean.ptr())
        .ptr(rstd.ptr())
        .i32(ni)
        .i32(ci);
    let kernel = by_dtype::<S>(&BACKWARD_INPUT, &BACKWARD_INPUT_BF16);
    // SAFETY: layernorm_backward_input[_bf16](S* dinp, const S* dout, const
    // S* inp, const S* weight, const float* mean, const float* rstd, int N,
    // int C), S the storage type of dinp, dout, inp and weight, buffers sized
    // for N rows of C (checked).
    unsafe { l.launch(kernel, l.warp_rows(n)?, &a)? };
    let mut a = KernelArgs::new();
    a.ptr(dweight.ptr())
        .ptr(dbias.ptr())
        .ptr(dout.ptr())
        .ptr(inp.ptr())
        .ptr(mean.ptr())
        .ptr(rstd.ptr())
        .i32(ni)
        .i32(ci);
    let kernel = by_dtype::<S>(&BACKWARD_PARAMS, &BACKWARD_PARAMS_BF16);
    // SAFETY: layernorm_backward_params[_bf16](S* dweight, S* dbias, const
    // S* dout, const S* inp, const float* mean, const float* rstd, int N, int
    // C), S the storage type of the first four, same sizes.
    unsafe { l.launch(kernel, l.linear(c, 128)?, &a) }
}

#[cfg(test)]
mod tests {
    use super::super::testutil::{fd_check, randn};
    use super::*;

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

//! Residual connection: elementwise sum.
//!
//! The family's one home: the tasks [`forward`], [`backward`] and
//! [`accumulate`], the CPU kernels [`residual_forward`],
//! [`residual_backward`] and [`residual_accumulate`], the CUDA launchers
//! [`residual_forward_cuda`] and [`residual_backward_cuda`] (bit-exact with
//! the CPU; `accumulate` is the backward launch with one gradient), and
//! `residual.cu`. Every task has a CUDA body for bf16 storage too
//! (`residual_forward_bf16`, `residual_backward_bf16`).

use braid::cuda::KernelArgs;
use braid::{CudaTaskCtx, DevSlice, DevSliceMut, Result, TaskHandle, View};

use super::check_len;
use super::cuda_common::{by_dtype, task_result, Check, Kernel, Launcher, Program};
use super::storage::Storage;
use super::task::{submit, Task};

pub(crate) static CUDA: Program = Program::new(
    "residual.cu",
    include_str!("residual.cu"),
    &[
        "residual_forward",
        "residual_backward",
        "residual_forward_bf16",
        "residual_backward_bf16",
    ],
);
static FORWARD: Kernel = Kernel::new(&CUDA, 0);
static BACKWARD: Kernel = Kernel::new(&CUDA, 1);
static FORWARD_BF16: Kernel = Kernel::new(&CUDA, 2);
static BACKWARD_BF16: Kernel = Kernel::new(&CUDA, 3);

// ---------------------------------------------------------------------------
// Tasks
// ---------------------------------------------------------------------------

/// Submits `out = inp1 + inp2` as `task`.
pub fn forward<'rt>(
    task: impl Into<Task<'rt>>,
    out: &View,  // (N)
    inp1: &View, // (N)
    inp2: &View, // (N)
) -> Result<TaskHandle> {
    submit!(
        task,
        |S| (out.write::<S>(), inp1.read::<S>(), inp2.read::<S>()),
        |(out, a, b)| residual_forward(out, a, b),
        |(out, a, b), cu| task_result(residual_forward_cuda(cu, out, a, b)),
    )
}

/// Submits `dinp1 += dout; dinp2 += dout` as `task`.
pub fn backward<'rt>(
    task: impl Into<Task<'rt>>,
    dinp1: &View, // (N) accumulated
    dinp2: &View, // (N) accumulated
    dout: &View,  // (N)
) -> Result<TaskHandle> {
    submit!(
        task,
        |S| (
            dinp1.read_write::<S>(),
            dinp2.read_write::<S>(),
            dout.read::<S>(),
        ),
        |(d1, d2, dout)| residual_backward(d1, d2, dout),
        |(d1, d2, dout), cu| task_result(residual_backward_cuda(cu, d1, Some(d2), dout)),
    )
}

/// Submits `dst += src` (elementwise, equal lengths) as `task`: a gradient
/// made in a buffer of its own added into the one it belongs to (GPT-2's
/// padded classifier weight gradient into `wte`'s).
pub fn accumulate<'rt>(
    task: impl Into<Task<'rt>>,
    dst: &View, // (N) accumulated
    src: &View, // (N)
) -> Result<TaskHandle> {
    submit!(
        task,
        |S| (dst.read_write::<S>(), src.read::<S>()),
        |(dst, src)| residual_accumulate(dst, src),
        |(dst, src), cu| task_result(residual_backward_cuda(cu, dst, None, src)),
    )
}

// ---------------------------------------------------------------------------
// CPU
// ---------------------------------------------------------------------------

/// `out = inp1 + inp2`.
pub fn residual_forward<S: Storage>(
    out: &mut [S], // (N)
    inp1: &[S],    // (N)
    inp2: &[S],    // (N)
) {
    let n = out.len();
    check_len("residual_forward", "inp1", inp1.len(), n);
    check_len("residual_forward", "inp2", inp2.len(), n);
    for ((o, &a), &b) in out.iter_mut().zip(inp1).zip(inp2) {
        *o = S::store(a.load() + b.load());
    }
}

/// `dinp1 += dout; dinp2 += dout`.
pub fn residual_backward<S: Storage>(
    dinp1: &mut [S], // (N)
    dinp2: &mut [S], // (N)
    dout: &[S],      // (N)
) {
    let n = dout.len();
    check_len("residual_backward", "dinp1", dinp1.len(), n);
    check_len("residual_backward", "dinp2", dinp2.len(), n);
    for ((d1, d2), &g) in dinp1.iter_mut().zip(dinp2.iter_mut()).zip(dout) {
        let g = g.load();
        *d1 = S::store(d1.load() + g);
        *d2 = S::store(d2.load() + g);
    }
}

/// `dst += src`: each element loaded, the sum rounded once.
pub fn residual_accumulate<S: Storage>(
    dst: &mut [S], // (N)
    src: &[S],     // (N)
) {
    check_len("residual_accumulate", "src", src.len(), dst.len());
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = S::store(d.load() + s.load());
    }
}

// ---------------------------------------------------------------------------
// CUDA
// ---------------------------------------------------------------------------

/// [`residual_forward`] on the task's stream, `f32` or bf16 storage.
/// Bit-exact with the CPU.
pub fn residual_forward_cuda<S: Storage>(
    cu: &CudaTaskCtx<'_>,
    out: DevSliceMut<S>, // (N)
    inp1: DevSlice<S>,   // (N)
    inp2: DevSlice<S>,   // (N)
) -> Result<()> {
    let k = Check::new("residual_forward");
    let n = out.len();
    k.exact("inp1", &inp1, "(N)", n)?;
    k.exact("inp2", &inp2, "(N)", n)?;
    if n == 0 {
        return Ok(());
    }
    let l = Launcher::new(k, cu);
    let mut a = KernelArgs::new();
    a.ptr(out.ptr())
        .ptr(inp1.ptr())
        .ptr(inp2.ptr())
        .i64(n as i64);
    let kernel = by_dtype::<S>(&FORWARD, &FORWARD_BF16);
    // SAFETY: residual_forward[_bf16](S* out, const S* inp1, const S* inp2,
    // long long N), S the storage type of all three; all N.
    unsafe { l.launch(kernel, l.linear(n, 256)?, &a) }
}

/// [`residual_backward`] on the task's stream, `f32` or bf16 storage, or
/// [`residual_accumulate`] with no `dinp2` (the kernel skips a null one).
/// Bit-exact with the CPU.
pub fn residual_backward_cuda<S: Storage>(
    cu: &CudaTaskCtx<'_>,
    dinp1: DevSliceMut<S>,         // (N) accumulated
    dinp2: Option<DevSliceMut<S>>, // (N) accumulated
    dout: DevSlice<S>,             // (N)
) -> Result<()> {
    let k = Check::new("residual_backward");
    let n = dinp1.len();
    if let Some(d2) = &dinp2 {
        k.exact("dinp2", d2, "(N)", n)?;
    }
    k.exact("dout", &dout, "(N)", n)?;
    if n == 0 {
        return Ok(());
    }
    let l = Launcher::new(k, cu);
    let mut a = KernelArgs::new();
    a.ptr(dinp1.ptr())
        .ptr(dinp2.as_ref().map_or(0, |d| d.ptr()))
        .ptr(dout.ptr())
        .i64(n as i64);
    let kernel = by_dtype::<S>(&BACKWARD, &BACKWARD_BF16);
    // SAFETY: residual_backward[_bf16](S* dinp1, S* dinp2, const S* dout,
    // long long N), S the storage type of all three; all N, dinp2 null or
    // disjoint from dinp1 (the engine checked the task's write tokens at
    // submission).
    unsafe { l.launch(kernel, l.linear(n, 256)?, &a) }
}

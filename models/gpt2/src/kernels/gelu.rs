//! GELU, tanh approximation (`gelu_new` in Hugging Face, `approximate="tanh"`
//! in PyTorch): `0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`.
//!
//! The family's one home: the tasks [`forward`] and [`backward`], the CPU
//! kernels [`gelu_forward`] and [`gelu_backward`], their CUDA launchers
//! [`gelu_forward_cuda`] and [`gelu_backward_cuda`], and `gelu.cu` (same
//! constants, same order of operations). Both tasks have a CUDA body for
//! bf16 storage too (`gelu_forward_bf16`, `gelu_backward_bf16`).

use braid::cuda::{KernelArgs, LaunchConfig};
use braid::{CudaTaskCtx, DevSlice, DevSliceMut, Result, TaskHandle, View};

use super::cuda_common::{by_dtype, task_result, Check, Kernel, Launcher, Program};
use super::fastmath;
use super::storage::{Dtype, Storage};
use super::task::{submit, Task};
use super::{check_len, GradWrite};

pub(crate) static CUDA: Program = Program::new(
    "gelu.cu",
    include_str!("gelu.cu"),
    &[
        "gelu_forward",
        "gelu_backward",
        "gelu_forward_bf16",
        "gelu_backward_bf16",
    ],
);
static FORWARD: Kernel = Kernel::new(&CUDA, 0);
static BACKWARD: Kernel = Kernel::new(&CUDA, 1);
static FORWARD_BF16: Kernel = Kernel::new(&CUDA, 2);
static BACKWARD_BF16: Kernel = Kernel::new(&CUDA, 3);

// ---------------------------------------------------------------------------
// Tasks
// ---------------------------------------------------------------------------

/// Submits `out = gelu(inp)` (elementwise, equal lengths) as `task`.
pub fn forward<'rt>(
    task: impl Into<Task<'rt>>,
    out: &View, // (N)
    inp: &View, // (N)
) -> Result<TaskHandle> {
    submit!(
        task,
        |S| (out.write::<S>(), inp.read::<S>()),
        |(out, inp)| gelu_forward(out, inp),
        |(out, inp), cu| task_result(gelu_forward_cuda(cu, out, inp)),
    )
}

/// Submits `dinp += gelu'(inp) · dout` (or `=`, by `write`) as `task`.
pub fn backward<'rt>(
    task: impl Into<Task<'rt>>,
    dinp: &View, // (N) accumulated or overwritten
    write: GradWrite,
    inp: &View,  // (N)
    dout: &View, // (N)
) -> Result<TaskHandle> {
    submit!(
        task,
        |S| (dinp.read_write::<S>(), inp.read::<S>(), dout.read::<S>(),),
        move |(dinp, inp, dout)| {
            write.prepare(dinp);
            gelu_backward(dinp, inp, dout)
        },
        move |(dinp, inp, dout), cu| task_result(gelu_backward_cuda(cu, dinp, write, inp, dout)),
    )
}

// ---------------------------------------------------------------------------
// CPU
// ---------------------------------------------------------------------------

const GELU_SCALING_FACTOR: f32 = 0.797_884_6; // sqrt(2 / pi)
const GELU_CUBIC: f32 = 0.044_715;

/// `out = gelu(inp)` elementwise.
#[multiversion::multiversion(targets("x86_64+avx2"))]
pub fn gelu_forward<S: Storage>(
    out: &mut [S], // (N)
    inp: &[S],     // (N)
) {
    check_len("gelu_forward", "inp", inp.len(), out.len());
    for (o, &x) in out.iter_mut().zip(inp) {
        let x = x.load();
        let cube = GELU_CUBIC * x * x * x;
        *o = S::store(0.5 * x * (1.0 + fastmath::tanh(GELU_SCALING_FACTOR * (x + cube))));
    }
}

/// `dinp += gelu'(inp) · dout` elementwise.
#[multiversion::multiversion(targets("x86_64+avx2"))]
pub fn gelu_backward<S: Storage>(
    dinp: &mut [S], // (N)
    inp: &[S],      // (N)
    dout: &[S],     // (N)
) {
    check_len("gelu_backward", "inp", inp.len(), dinp.len());
    check_len("gelu_backward", "dout", dout.len(), dinp.len());
    for ((d, &x), &g) in dinp.iter_mut().zip(inp).zip(dout) {
        let (x, g) = (x.load(), g.load());
        let cube = GELU_CUBIC * x * x * x;
        let tanh_out = fastmath::tanh(GELU_SCALING_FACTOR * (x + cube));
        // sech² = 1 - tanh², which stays finite where cosh would overflow.
        let sech2 = 1.0 - tanh_out * tanh_out;
        let local_grad = 0.5 * (1.0 + tanh_out)
            + x * 0.5 * sech2 * GELU_SCALING_FACTOR * (1.0 + 3.0 * GELU_CUBIC * x * x);
        *d = S::store(d.load() + local_grad * g);
    }
}

// ---------------------------------------------------------------------------
// CUDA
// ---------------------------------------------------------------------------

/// [`gelu_forward`] on the task's stream, `f32` or bf16 storage
/// (`gelu_forward_bf16`: the CPU's operations in its order, but CUDA's
/// `tanhf` against the CPU's [`fastmath::tanh`], so a bf16 result may
/// differ from the CPU's by one bf16 ulp).
pub fn gelu_forward_cuda<S: Storage>(
    cu: &CudaTaskCtx<'_>,
    out: DevSliceMut<S>, // (N)
    inp: DevSlice<S>,    // (N)
) -> Result<()> {
    let k = Check::new("gelu_forward");
    let n = out.len();
    k.exact("inp", &inp, "(N)", n)?;
    if n == 0 {
        return Ok(());
    }
    let l = Launcher::new(k, cu);
    let mut a = KernelArgs::new();
    a.ptr(out.ptr()).ptr(inp.ptr()).i64(n as i64);
    // SAFETY: gelu_forward[_bf16](S* out, const S* inp, long long N), S the
    // storage type of both slices; both N.
    unsafe {
        l.launch(
            by_dtype::<S>(&FORWARD, &FORWARD_BF16),
            elementwise::<S>(&l, n)?,
            &a,
        )
    }
}

/// [`gelu_backward`] on the task's stream: `dinp += gelu'(inp) · dout` (`=` for
/// [`GradWrite::Set`]: `dinp` not read),
/// `f32` or bf16 storage (as [`gelu_forward_cuda`]).
pub fn gelu_backward_cuda<S: Storage>(
    cu: &CudaTaskCtx<'_>,
    dinp: DevSliceMut<S>, // (N) accumulated or overwritten
    write: GradWrite,
    inp: DevSlice<S>,  // (N)
    dout: DevSlice<S>, // (N)
) -> Result<()> {
    let k = Check::new("gelu_backward");
    let n = dinp.len();
    k.exact("inp", &inp, "(N)", n)?;
    k.exact("dout", &dout, "(N)", n)?;
    if n == 0 {
        return Ok(());
    }
    let l = Launcher::new(k, cu);
    let mut a = KernelArgs::new();
    a.ptr(dinp.ptr())
        .ptr(inp.ptr())
        .ptr(dout.ptr())
        .i64(n as i64)
        .i32(write.accumulate());
    let kernel = by_dtype::<S>(&BACKWARD, &BACKWARD_BF16);
    // SAFETY: gelu_backward[_bf16](S* dinp, const S* inp, const S* dout,
    // long long N, int accumulate), S the storage type of all three; all N.
    unsafe { l.launch(kernel, elementwise::<S>(&l, n)?, &a) }
}

/// The launch of the kernels over `n` elements: one thread per element in
/// `f32`, per [`BF16_PER_THREAD`] elements in bf16 (16-byte loads).
fn elementwise<S: Storage>(l: &Launcher<'_>, n: usize) -> Result<LaunchConfig> {
    let per = if S::DTYPE == Dtype::Bf16 {
        BF16_PER_THREAD
    } else {
        1
    };
    l.linear(n.div_ceil(per), 256)
}

/// Elements of a bf16 kernel's thread (`GELU_PER` in gelu.cu).
const BF16_PER_THREAD: usize = 8;

#[cfg(test)]
mod tests {
    use super::super::testutil::{assert_close, fd_check, randn};
    use super::*;

    #[test]
    fn gelu_matches_known_values() {
        let x = [-3.0f32, -1.0, 0.0, 0.5, 2.0];
        let mut y = [0.0; 5];
        gelu_forward(&mut y, &x);
        // torch.nn.functional.gelu(x, approximate="tanh")
        let want = [-0.003_637_392, -0.158_808, 0.0, 0.345_714, 1.954_597_7];
        assert_close(&y, &want, 1e-6, 1e-5, "gelu");
    }

    #[test]
    fn gelu_backward_matches_finite_differences() {
        let x = randn(64, 1.5, 1);
        let w = randn(64, 1.0, 2);
        let mut dx = vec![0.0; 64];
        gelu_backward(&mut dx, &x, &w);
        fd_check(
            &x,
            &dx,
            |x| {
                let mut y = vec![0.0; 64];
                gelu_forward(&mut y, x);
                y.iter().zip(&w).map(|(&a, &b)| a as f64 * b as f64).sum()
            },
            "gelu dinp",
        );
    }
}

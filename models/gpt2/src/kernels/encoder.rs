//! Token + position embedding: `encoded = wte[tokens] + wpe[:T]`.
//!
//! The family's one home: the tasks [`forward`] and [`backward`], the CPU
//! kernels [`encoder_forward`] and [`encoder_backward`], their CUDA launchers
//! [`encoder_forward_cuda`] and [`encoder_backward_cuda`], and `encoder.cu`.
//! [`forward`] and [`backward`] have a CUDA body for bf16 storage too (the
//! `*_bf16` kernels), and so has [`backward_positions`] (the position half
//! alone, [`encoder_backward_positions_cuda`]).
//!
//! # Token ids
//!
//! The CUDA kernels index `wte` (`dwte`) with ids they read on the device,
//! where they cannot be checked without a host synchronisation, so the
//! launchers and the tasks are `unsafe` with the contract "every id is below
//! the vocabulary size `V`" (validate on the host with
//! [`check_tokens`](super::check_tokens) before the ids are uploaded). The CPU
//! kernels index with bounds checks: a bad id panics there, failing the task.

use braid::cuda::{KernelArgs, LaunchConfig};
use braid::{CudaTaskCtx, DevSlice, DevSliceMut, Result, TaskHandle, View};

use super::check_len;
use super::cuda_common::{by_dtype, task_result, Check, Kernel, Launcher, Program};
use super::storage::{Dtype, Storage};
use super::task::{submit, Task};

pub(crate) static CUDA: Program = Program::new(
    "encoder.cu",
    include_str!("encoder.cu"),
    &[
        "encoder_forward",
        "encoder_backward_wpe",
        "encoder_backward_wte",
        "encoder_forward_bf16",
        "encoder_backward_wpe_bf16",
        "encoder_backward_wte_bf16",
        "encoder_backward_links",
    ],
);
static FORWARD: Kernel = Kernel::new(&CUDA, 0);
static BACKWARD_WPE: Kernel = Kernel::new(&CUDA, 1);
static BACKWARD_WTE: Kernel = Kernel::new(&CUDA, 2);
static FORWARD_BF16: Kernel = Kernel::new(&CUDA, 3);
static BACKWARD_WPE_BF16: Kernel = Kernel::new(&CUDA, 4);
static BACKWARD_WTE_BF16: Kernel = Kernel::new(&CUDA, 5);
static BACKWARD_LINKS: Kernel = Kernel::new(&CUDA, 6);

// ---------------------------------------------------------------------------
// Tasks
// ---------------------------------------------------------------------------

/// Submits `out = wte[tokens] + wpe[:T]` as `task` ([`encoder_forward`] on
/// the CPU, [`encoder_forward_cuda`] on CUDA).
///
/// # Safety
/// When the task runs, every id in `tokens` is below `V` (the rows of `wte`):
/// the CUDA kernel reads `wte` at the ids it finds, unchecked (module docs).
pub unsafe fn forward<'rt>(
    task: impl Into<Task<'rt>>,
    out: &View,    // (B, T, C)
    tokens: &View, // (B, T) u32, each < V
    wte: &View,    // (V, C)
    wpe: &View,    // (maxT, C), maxT >= T
    b: usize,
    t: usize,
    c: usize,
) -> Result<TaskHandle> {
    submit!(
        task,
        |S| (
            out.write::<S>(),
            tokens.read::<u32>(),
            wte.read::<S>(),
            wpe.read::<S>(),
        ),
        move |(out, tokens, wte, wpe)| encoder_forward(out, tokens, wte, wpe, b, t, c),
        move |(out, tokens, wte, wpe), cu| {
            // SAFETY: the ids are below V, this function's contract.
            task_result(unsafe { encoder_forward_cuda(cu, out, tokens, wte, wpe, b, t, c) })
        },
    )
}

/// Submits `dwte[tokens] += dout; dwpe[:T] += Σ_b dout` as `task`.
///
/// `links` is scratch of `B·T` `u32` (declared written on every backend, so
/// the task graph is the same everywhere; the CPU body ignores it): the bf16
/// CUDA body chains each token's positions there
/// ([`encoder_backward_cuda`]).
///
/// # Safety
/// As for [`forward`]: every id in `tokens` is below `V` (the rows of
/// `dwte`) when the task runs.
#[allow(clippy::too_many_arguments)]
pub unsafe fn backward<'rt>(
    task: impl Into<Task<'rt>>,
    dwte: &View,   // (V, C) accumulated
    dwpe: &View,   // (maxT, C), maxT >= T, accumulated
    dout: &View,   // (B, T, C)
    tokens: &View, // (B, T) u32, each < V
    links: &View,  // (B, T) u32 scratch
    b: usize,
    t: usize,
    c: usize,
) -> Result<TaskHandle> {
    submit!(
        task,
        |S| (
            dwte.read_write::<S>(),
            dwpe.read_write::<S>(),
            dout.read::<S>(),
            tokens.read::<u32>(),
            links.write::<u32>(),
        ),
        move |(dwte, dwpe, dout, tokens, _links)| {
            encoder_backward(dwte, dwpe, dout, tokens, b, t, c)
        },
        move |(dwte, dwpe, dout, tokens, links), cu| {
            // SAFETY: the ids are below V, this function's contract.
            task_result(unsafe {
                encoder_backward_cuda(cu, dwte, dwpe, dout, tokens, links, b, t, c)
            })
        },
    )
}

/// Submits `dwpe[:T] += Σ_b dout` as `task`: the position half of
/// [`backward`], for a program that hands the token rows (`dout` itself, at
/// the rows `tokens`) to the gradient reducer as a separate contribution
/// ([`braid::Reducer::sparse_ready`]).
pub fn backward_positions<'rt>(
    task: impl Into<Task<'rt>>,
    dwpe: &View, // (maxT, C), maxT >= T, accumulated
    dout: &View, // (B, T, C)
    b: usize,
    t: usize,
    c: usize,
) -> Result<TaskHandle> {
    submit!(
        task,
        |S| (dwpe.read_write::<S>(), dout.read::<S>()),
        move |(dwpe, dout)| encoder_backward_positions(dwpe, dout, b, t, c),
        move |(dwpe, dout), cu| {
            task_result(encoder_backward_positions_cuda(cu, dwpe, dout, b, t, c))
        },
    )
}

// ---------------------------------------------------------------------------
// CPU
// ---------------------------------------------------------------------------

/// Accumulates the position-embedding gradient only:
/// `dwpe[t, :] += dout[b, t, :]`, in the order [`encoder_backward`] does.
pub fn encoder_backward_positions<S: Storage>(
    dwpe: &mut [S], // (maxT, C), maxT >= T
    dout: &[S],     // (B, T, C)
    b: usize,
    t: usize,
    c: usize,
) {
    check_len("encoder_backward_positions", "dout", dout.len(), b * t * c);
    assert!(
        dwpe.len() >= t * c,
        "encoder_backward_positions: `dwpe` has fewer than T rows"
    );
    // Rounded once, after every contribution (a row gets `B` of them).
    S::update_f32(&mut dwpe[..t * c], |dwpe| {
        for (bt, dout_bt) in dout.chunks_exact(c).enumerate() {
            let dwpe_t = &mut dwpe[(bt % t) * c..][..c];
            for (d, &g) in dwpe_t.iter_mut().zip(dout_bt) {
                *d += g.load();
            }
        }
    });
}
/// `out[b, t, :] = wte[tokens[b, t], :] + wpe[t, :]`.
///
/// Every token must be `< V` (see [`check_tokens`](super::check_tokens));
/// `wpe` may have more rows than `t` (`maxT >= T`).
pub fn encoder_forward<S: Storage>(
    out: &mut [S],  // (B, T, C)
    tokens: &[u32], // (B, T)
    wte: &[S],      // (V, C)
    wpe: &[S],      // (maxT, C), maxT >= T
    b: usize,
    t: usize,
    c: usize,
) {
    check_len("encoder_forward", "out", out.len(), b * t * c);
    check_len("encoder_forward", "tokens", tokens.len(), b * t);
    assert!(
        wpe.len() >= t * c,
        "encoder_forward: `wpe` has fewer than T rows"
    );
    for (bt, (out_bt, &tok)) in out.chunks_exact_mut(c).zip(tokens).enumerate() {
        let pos = bt % t;
        let wte_ix = &wte[tok as usize * c..][..c];
        let wpe_t = &wpe[pos * c..][..c];
        for ((o, &e), &p) in out_bt.iter_mut().zip(wte_ix).zip(wpe_t) {
            *o = S::store(e.load() + p.load());
        }
    }
}

/// Accumulates the embedding gradients: `dwte[tokens[b, t], :] += dout[b, t, :]`
/// and `dwpe[t, :] += dout[b, t, :]`.
pub fn encoder_backward<S: Storage>(
    dwte: &mut [S], // (V, C)
    dwpe: &mut [S], // (maxT, C), maxT >= T
    dout: &[S],     // (B, T, C)
    tokens: &[u32], // (B, T)
    b: usize,
    t: usize,
    c: usize,
) {
    check_len("encoder_backward", "dout", dout.len(), b * t * c);
    check_len("encoder_backward", "tokens", tokens.len(), b * t);
    // Each gradient row adds its contributions in (b, t) order either way.
    // A row of a repeated token is rounded once, after all its contributions.
    S::update_f32(dwte, |dwte| {
        for (dout_bt, &tok) in dout.chunks_exact(c).zip(tokens) {
            let dwte_ix = &mut dwte[tok as usize * c..][..c];
            for (d, &g) in dwte_ix.iter_mut().zip(dout_bt) {
                *d += g.load();
            }
        }
    });
    encoder_backward_positions(dwpe, dout, b, t, c);
}

// ---------------------------------------------------------------------------
// CUDA
// ---------------------------------------------------------------------------

/// [`encoder_forward`] on the task's stream, `f32` or bf16 storage.
/// Bit-exact with the CPU.
///
/// # Safety
/// Every id in `tokens` must be below `V` (the rows of `wte`): the kernel
/// reads `wte` at the ids it finds on the device. Everything else is checked.
pub unsafe fn encoder_forward_cuda<S: Storage>(
    cu: &CudaTaskCtx<'_>,
    out: DevSliceMut<S>,   // (B, T, C)
    tokens: DevSlice<u32>, // (B, T), each < V
    wte: DevSlice<S>,      // (V, C)
    wpe: DevSlice<S>,      // (maxT, C), maxT >= T
    b: usize,
    t: usize,
    c: usize,
) -> Result<()> {
    let k = Check::new("encoder_forward");
    let (bi, ti, ci) = (k.dim("B", b)?, k.dim("T", t)?, k.dim("C", c)?);
    let bt = k.mul(b, t)?;
    let btc = k.mul(bt, c)?;
    k.exact("out", &out, "(B, T, C)", btc)?;
    k.exact("tokens", &tokens, "(B, T)", bt)?;
    k.rows("wte", &wte, "(V, C)", c, 1)?;
    k.rows("wpe", &wpe, "(maxT, C)", c, t)?;
    let l = Launcher::new(k, cu);
    let mut a = KernelArgs::new();
    a.ptr(out.ptr())
        .ptr(tokens.ptr())
        .ptr(wte.ptr())
        .ptr(wpe.ptr())
        .i32(bi)
        .i32(ti)
        .i32(ci);
    let kernel = by_dtype::<S>(&FORWARD, &FORWARD_BF16);
    // SAFETY: encoder_forward[_bf16](S*, const uint*, const S*, const S*,
    // int B, int T, int C), S the storage type of out, wte and wpe; out and
    // tokens hold B·T·C and B·T elements, wpe at least T rows; wte rows are
    // indexed by ids < V (the caller's contract).
    unsafe { l.launch(kernel, l.linear(btc, 256)?, &a) }
}

/// [`encoder_backward_positions`] on the task's stream, each element's `B`
/// contributions summed in `b` order: bit-exact with the CPU. Only the
/// first `T` rows of `dwpe` are touched.
pub fn encoder_backward_positions_cuda<S: Storage>(
    cu: &CudaTaskCtx<'_>,
    dwpe: DevSliceMut<S>, // (maxT, C), maxT >= T, accumulated
    dout: DevSlice<S>,    // (B, T, C)
    b: usize,
    t: usize,
    c: usize,
) -> Result<()> {
    let k = Check::new("encoder_backward_positions");
    let (bi, ti, ci) = (k.dim("B", b)?, k.dim("T", t)?, k.dim("C", c)?);
    k.rows("dwpe", &dwpe, "(maxT, C)", c, t)?;
    k.exact("dout", &dout, "(B, T, C)", k.mul(k.mul(b, t)?, c)?)?;
    let l = Launcher::new(k, cu);
    let mut a = KernelArgs::new();
    a.ptr(dwpe.ptr()).ptr(dout.ptr()).i32(bi).i32(ti).i32(ci);
    let kernel = by_dtype::<S>(&BACKWARD_WPE, &BACKWARD_WPE_BF16);
    // SAFETY: encoder_backward_wpe[_bf16](S* dwpe, const S* dout, int B, int
    // T, int C), S the storage type of both, touches the first T rows of dwpe
    // and all of dout (checked).
    unsafe { l.launch(kernel, l.linear(t * c, 256)?, &a) }
}

/// Number of token-residue classes `encoder_backward_wte` splits `dwte` into
/// (`gridDim.y`); any value gives the same result.
const WTE_PARTS: u32 = 32;

/// [`encoder_backward`] on the task's stream, summed in `(b, t)` order:
/// bit-exact with the CPU. Only the first `T` rows of `dwpe` are touched.
/// With bf16 storage every touched gradient element is loaded, gets all its
/// contributions in `f32` and is rounded once, as on the CPU: a first kernel
/// links each position to the token's next one in `links` (`B·T` `u32`
/// scratch), and the `dwte` kernel gives each token's first position a
/// block that walks the token's chain (work `O(B·T·C)` in all). `links` is
/// unused with `f32` storage, where each contribution is added in place in
/// `(b, t)` order.
///
/// # Safety
/// Every id in `tokens` must be below `V` (the rows of `dwte`): the kernel
/// writes `dwte` at the ids it finds on the device.
pub unsafe fn encoder_backward_cuda<S: Storage>(
    cu: &CudaTaskCtx<'_>,
    dwte: DevSliceMut<S>,    // (V, C) accumulated
    dwpe: DevSliceMut<S>,    // (maxT, C), maxT >= T, accumulated
    dout: DevSlice<S>,       // (B, T, C)
    tokens: DevSlice<u32>,   // (B, T), each < V
    links: DevSliceMut<u32>, // (B, T) scratch
    b: usize,
    t: usize,
    c: usize,
) -> Result<()> {
    let k = Check::new("encoder_backward");
    let ci = k.dim("C", c)?;
    let bt = k.mul(b, t)?;
    let bti = k.dim("B·T", bt)?;
    k.rows("dwte", &dwte, "(V, C)", c, 1)?;
    k.exact("dout", &dout, "(B, T, C)", k.mul(bt, c)?)?;
    k.exact("tokens", &tokens, "(B, T)", bt)?;
    k.exact("links", &links, "(B, T)", bt)?;
    // Every shape checked before the first launch (this one checks its own).
    encoder_backward_positions_cuda(cu, dwpe, dout, b, t, c)?;
    let l = Launcher::new(k, cu);
    let mut a = KernelArgs::new();
    a.ptr(dwte.ptr()).ptr(dout.ptr()).ptr(tokens.ptr());
    if S::DTYPE == Dtype::Bf16 {
        let mut l_args = KernelArgs::new();
        l_args.ptr(links.ptr()).ptr(tokens.ptr()).i32(bti);
        // SAFETY: encoder_backward_links(uint* links, const uint* tokens, int
        // BT); both hold B·T elements (checked).
        unsafe { l.launch(&BACKWARD_LINKS, l.linear(bt, 256)?, &l_args)? };
        a.ptr(links.ptr());
    }
    a.i32(bti).i32(ci);
    let cfg = if S::DTYPE == Dtype::Bf16 {
        // One block per position; the first position of each token works.
        LaunchConfig::grid_block(l.grid(bt)?, 128)
    } else {
        LaunchConfig {
            grid: (l.grid(c.div_ceil(128))?, WTE_PARTS, 1),
            block: (128, 1, 1),
            shared_mem_bytes: 0,
        }
    };
    let kernel = by_dtype::<S>(&BACKWARD_WTE, &BACKWARD_WTE_BF16);
    // SAFETY: encoder_backward_wte(float* dwte, const float* dout, const
    // uint* tokens, int BT, int C), or encoder_backward_wte_bf16 with `const
    // uint* links` after `tokens` (the chains the launch above wrote): dout,
    // tokens and links hold B·T rows (checked); dwte rows are indexed by ids
    // < V (the caller's contract).
    unsafe { l.launch(kernel, cfg, &a) }
}

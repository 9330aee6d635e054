//! Runs CUDA kernel sources on the CPU, so that `cargo test` can check their
//! indexing and arithmetic against the Rust CPU kernels on a machine with no
//! GPU (README.md).
//!
//! g++ compiles each `.cu` file with `csrc/cuda_emu.h`, a shim for the subset
//! of CUDA C++ the kernels use; `csrc/emu.cpp` runs a launch block after
//! block, a fiber per thread, with real `__syncthreads`, warp shuffles and the
//! bf16 tensor-core MMA. Every function here runs one kernel:
//! `(grid, block, the kernel's arguments)`, buffers as slices (bf16 as `u16`
//! bit patterns), `int`s as `i32`. It returns an error instead of hanging or
//! aborting when a kernel breaks a rule the emulator checks: a barrier that can
//! never complete (say, `__syncthreads` after some threads returned), an
//! unsupported shuffle mask, `__trap()`, an invalid launch configuration.
//!
//! # Buffers
//!
//! The kernel never sees the caller's slices: each is copied into a buffer
//! with 64 KiB of canary bytes (`0xff`, a NaN in f32 and bf16) on each side,
//! and outputs are copied back only after a successful launch whose canaries
//! are intact. A kernel that writes slightly out of bounds therefore gets an
//! error naming the buffer and element; one that reads out of bounds reads
//! NaN. The wrappers also check every slice's length against the kernel's
//! documented shape, and the emulator checks the types of the arguments
//! against the kernel's parameters. A kernel whose indexing is wrong by more than the
//! canaries can still write anywhere, as on a GPU: these functions are for
//! tests of kernels under development, not for production use.

// The wrappers take the kernels' parameter lists.
#![allow(clippy::too_many_arguments)]

/// A CUDA `dim3`: `(x, y, z)`.
pub type Dim3 = (u32, u32, u32);

mod check;
mod launch;

/// The f32 and the bf16 wrapper of one kernel, from one parameter list and
/// one body:
///
/// ```text
/// twins! {
///     /// `gelu_forward` (f32): ...
///     pub fn gelu_forward(S = f32);
///     /// [`gelu_forward`] with bf16 storage.
///     pub fn gelu_forward_bf16(S = u16);
///     fn(k, grid: Dim3, block: Dim3, out: &mut [S], inp: &[S], n: i64) {
///         // ... with `k` the kernel's name
///     }
/// }
/// ```
///
/// defines `pub fn gelu_forward(grid: Dim3, block: Dim3, out: &mut [f32],
/// inp: &[f32], n: i64) -> Result<(), String>` with the first doc comment,
/// and `gelu_forward_bf16` with `u16` for `S` and the second, each running
/// the body with `k` its own name (the kernel's, as in the `.cu` file). `S`
/// is replaced in parameters typed `&mut [S]`, `&[S]`, `Option<&[S]>` or
/// `Option<&mut [S]>`;
/// other parameters keep their types.
macro_rules! twins {
    (
        $(#[$doc_a:meta])* pub fn $a:ident(S = $ea:ident);
        $(#[$doc_b:meta])* pub fn $b:ident(S = $eb:ident);
        fn($k:ident, $($params:tt)*) $body:block
    ) => {
        twins!(@fn [$(#[$doc_a])*] $a $ea $k [] [$($params)*] $body);
        twins!(@fn [$(#[$doc_b])*] $b $eb $k [] [$($params)*] $body);
    };
    // The parameters one at a time, `S` replaced by the element type `$e`.
    (@fn $doc:tt $name:ident $e:ident $k:ident [$($done:tt)*]
        [$p:ident: &mut [S] $(, $($rest:tt)*)?] $body:block) => {
        twins!(@fn $doc $name $e $k [$($done)* $p: &mut [$e],] [$($($rest)*)?] $body);
    };
    (@fn $doc:tt $name:ident $e:ident $k:ident [$($done:tt)*]
        [$p:ident: &[S] $(, $($rest:tt)*)?] $body:block) => {
        twins!(@fn $doc $name $e $k [$($done)* $p: &[$e],] [$($($rest)*)?] $body);
    };
    (@fn $doc:tt $name:ident $e:ident $k:ident [$($done:tt)*]
        [$p:ident: Option<&[S]> $(, $($rest:tt)*)?] $body:block) => {
        twins!(@fn $doc $name $e $k [$($done)* $p: Option<&[$e]>,] [$($($rest)*)?] $body);
    };
    (@fn $doc:tt $name:ident $e:ident $k:ident [$($done:tt)*]
        [$p:ident: Option<&mut [S]> $(, $($rest:tt)*)?] $body:block) => {
        twins!(@fn $doc $name $e $k [$($done)* $p: Option<&mut [$e]>,] [$($($rest)*)?] $body);
    };
    (@fn $doc:tt $name:ident $e:ident $k:ident [$($done:tt)*]
        [$p:ident: $t:ty $(, $($rest:tt)*)?] $body:block) => {
        twins!(@fn $doc $name $e $k [$($done)* $p: $t,] [$($($rest)*)?] $body);
    };
    (@fn [$($doc:tt)*] $name:ident $e:ident $k:ident [$($done:tt)*] [] $body:block) => {
        $($doc)*
        pub fn $name($($done)*) -> Result<(), String> {
            let $k = stringify!($name);
            $body
        }
    };
}

// The GPT-2 kernel families, a module per `.cu` file under src/gpt2/.
mod gpt2;
pub use gpt2::*;

// The engine's own kernels (cuda/kernels/).
mod engine;
pub use engine::*;

use check::{nonneg, product, threads_1d};
use launch::Args;

// ---------------------------------------------------------------------------
// selftest.cu
// ---------------------------------------------------------------------------

/// `selftest_block_sum`: `out[block]` = the sum of the block's elements of
/// `inp` (zero past `n`), by a shared-memory tree (selftest.cu). 1-D launch;
/// `out` has `grid.0` elements, `inp` at least `n`.
pub fn selftest_block_sum(
    grid: Dim3,
    block: Dim3,
    out: &mut [f32],
    inp: &[f32],
    n: i32,
) -> Result<(), String> {
    let k = "selftest_block_sum";
    threads_1d(k, grid, block)?;
    let args = Args::new(k)
        .output("out", out, grid.0 as usize)?
        .input_at_least("inp", inp, nonneg(k, n)?)?
        .i32(n);
    // SAFETY: the kernel writes out[blockIdx.x] and reads in[i] for i < n:
    // lengths checked above.
    unsafe { args.launch(grid, block) }
}

/// `selftest_warp_sum`: every thread's `out` element = its warp's sum of
/// `inp` (zero past `n`), by a `__shfl_xor_sync` butterfly. 1-D launch; `out`
/// has an element per thread, `inp` at least `n`.
pub fn selftest_warp_sum(
    grid: Dim3,
    block: Dim3,
    out: &mut [f32],
    inp: &[f32],
    n: i32,
) -> Result<(), String> {
    let k = "selftest_warp_sum";
    let threads = threads_1d(k, grid, block)?;
    let args = Args::new(k)
        .output("out", out, threads)?
        .input_at_least("inp", inp, nonneg(k, n)?)?
        .i32(n);
    // SAFETY: the kernel writes out[thread] and reads in[i] for i < n:
    // lengths checked above.
    unsafe { args.launch(grid, block) }
}

/// `selftest_shuffles`: twelve `i32` per thread, each shuffle and vote mode
/// on `v = 100 * warp + lane` (selftest.cu lists them). 1-D launch.
pub fn selftest_shuffles(grid: Dim3, block: Dim3, out: &mut [i32]) -> Result<(), String> {
    let k = "selftest_shuffles";
    let threads = threads_1d(k, grid, block)?;
    let args = Args::new(k).output("out", out, product(k, &[threads, 12])?)?;
    // SAFETY: the kernel writes out[12 * thread ..][..12]: length checked
    // above.
    unsafe { args.launch(grid, block) }
}

/// `selftest_mma`: one `mma_bf16_16816` per warp `w`: `d[128 w..][..128]`
/// (16 × 8 f32, row-major) += `a[256 w..][..256]` (16 × 16 bf16, row-major)
/// times `b[128 w..][..128]` (16 × 8 bf16, k × n row-major). 1-D launch of
/// whole warps.
pub fn selftest_mma(
    grid: Dim3,
    block: Dim3,
    d: &mut [f32],
    a: &[u16],
    b: &[u16],
) -> Result<(), String> {
    let k = "selftest_mma";
    let threads = threads_1d(k, grid, block)?;
    if block.0 % 32 != 0 {
        return Err(format!("{k}: blockDim.x must be a multiple of 32"));
    }
    let warps = threads / 32;
    let args = Args::new(k)
        .output("d", d, product(k, &[warps, 128])?)?
        .input("a", a, product(k, &[warps, 256])?)?
        .input("b", b, product(k, &[warps, 128])?)?;
    // SAFETY: the kernel touches the 128, 256 and 128 elements of each warp:
    // lengths checked above.
    unsafe { args.launch(grid, block) }
}

/// `selftest_ldmatrix_mma`: `d` (16 × 16 f32, row-major) = `a` (16 × 16
/// bf16, row-major) times `b` (16 × 16 bf16, k × n row-major), by one warp
/// whose B registers come from `ldmatrix_x4_trans` (`trans`) or
/// `ldmatrix_x4` over `bᵀ` (the tensor-core flash attention's patterns).
/// One block of 32 threads.
pub fn selftest_ldmatrix_mma(
    d: &mut [f32],
    a: &[u16],
    b: &[u16],
    trans: bool,
) -> Result<(), String> {
    let k = "selftest_ldmatrix_mma";
    let args = Args::new(k)
        .output("d", d, 256)?
        .input("a", a, 256)?
        .input("b", b, 256)?
        .i32(i32::from(trans));
    // SAFETY: one warp touches elements 0..256 of each: lengths checked above.
    unsafe { args.launch((1, 1, 1), (32, 1, 1)) }
}

/// `selftest_fault`: a kernel that breaks a barrier rule, by `mode`
/// (selftest.cu: 0 `__syncthreads` after an early return, 1 different
/// barriers in one warp, 2 a shuffle after a lane returned, 3 a partial
/// shuffle mask, 4 `__trap()`, 5 a shuffle past the end of a partial warp,
/// 6 and 7 a write one element past either end of `out`, 8 lanes of a warp
/// at different shuffles, 9 a race on shared memory). Expected to fail;
/// `out` (an element per thread) is written if it does not.
pub fn selftest_fault(grid: Dim3, block: Dim3, out: &mut [f32], mode: i32) -> Result<(), String> {
    let k = "selftest_fault";
    let threads = threads_1d(k, grid, block)?;
    let args = Args::new(k).output("out", out, threads)?.i32(mode);
    // SAFETY: the kernel writes out[thread], or out[thread ± 1] (modes 6 and
    // 7), one element into the canaries: length checked above.
    unsafe { args.launch(grid, block) }
}

//! GPT-2's kernels, one module per kernel family, each the family's one
//! home (candle's `CustomOp { cpu_fwd, cuda_fwd }`, StarPU's codelet, llm.c's
//! `llmc/*.cuh`):
//!
//! - **the tasks**: functions that take a [`TaskBuilder`](braid::TaskBuilder)
//!   (the task's name, priority, …; or a [`Task`](task::Task), the builder
//!   with a storage dtype), the [`View`](braid::View)s the kernel
//!   touches and its sizes, declare exactly those accesses as typed tokens
//!   (`out.write::<f32>()`, `inp.read::<f32>()`) and submit with
//!   [`run_any`](braid::TaskBuilder::run_any): one body per backend, picked
//!   at submission. The task graph is the same on every backend by
//!   construction. [`Gpt2Model`](crate::model::Gpt2Model) and
//!   [`AdamW`](crate::optim::AdamW) are made of these calls.
//! - **the CPU kernels**, plain functions on slices after llm.c's
//!   `train_gpt2.c` (`layernorm_forward`, …), which the CPU bodies call and
//!   the sequential [`Reference`](crate::reference::Reference) calls directly
//!   ([`cpu`] lists them).
//! - **the CUDA launchers** (`layernorm_forward_cuda`, …), which take the
//!   task's typed device slices and its [`CudaTaskCtx`](braid::CudaTaskCtx),
//!   check the shapes and queue the family's kernels (and cuBLAS products) on
//!   the task's stream.
//! - **the `.cu` program** beside the module (`layernorm.cu`), compiled by
//!   NVRTC at run time ([`kernel_sources`] lists them for the compile check).
//!
//! | module | tasks | `.cu` |
//! |---|---|---|
//! | [`encoder`] | `forward`, `backward` (`unsafe`: token ids) | `encoder.cu` |
//! | [`layernorm`] | `forward`, `backward`, and fused with the residual `forward_residual`, `backward_residual` | `layernorm.cu` |
//! | [`matmul`] | `forward`, `backward_input`, `backward_weight` | `matmul.cu` + cuBLAS |
//! | [`attention`] | `forward`, `backward` | `attention.cu` + cuBLAS |
//! | [`gelu`] | `forward`, `backward` | `gelu.cu` |
//! | [`residual`] | `forward`, `backward` | `residual.cu` |
//! | [`loss`] | `softmax`, `softmax_crossentropy` (`unsafe`: target ids), `mean`, `backward` | `loss.cu` |
//! | [`adamw`] | `update` | `adamw.cu` |
//! | [`norm`] | `sum_squares`, `clip_factor`, `scale`, `scale_by` | `norm.cu` |
//! | [`fill`] | `zero` | (a memset) |
//! | [`flash_attention`] | `forward`, `backward` | `flash_attention.cu` |
//! | [`fused_classifier`] | `losses`, `forward_backward` | `loss.cu` |
//!
//! [`storage`] holds the storage types ([`Dtype`](storage::Dtype), the
//! [`Storage`] element trait) and [`task`] the
//! [`Task`](task::Task) every task function takes: a `TaskBuilder` (an `f32`
//! task) or a builder with a dtype. bf16 tasks have a CUDA body in the
//! families with `*_bf16` kernels ([`encoder`] `forward`/`backward`,
//! [`layernorm`], [`matmul`] (cuBLAS bf16 products), [`attention`] (cuBLAS
//! bf16 products), [`gelu`], [`residual`], [`loss`]
//! `softmax`/`softmax_crossentropy`/`backward`, [`norm`]
//! `sum_squares`/`scale`/`scale_by`, [`adamw`] `update_mixed`, and the fused
//! [`flash_attention`] and [`fused_classifier`] in both dtypes; first run
//! on a GPU on 2026-11-26, docs/gpu-validation.md; [`fill`] zeroes bytes,
//! any dtype, on both backends). The bf16
//! kernels share `bf16.cuh`'s load/store helpers through `#include
//! "bf16.cuh"`: NVRTC reads no files, so the header goes with every program
//! ([`kernel_headers`]).
//!
//! Shared CUDA plumbing (the per-device program cache, shape checks,
//! launching on the task's stream) is in `cuda_common.rs`.
//!
//! # Conventions
//!
//! - **Shapes** are given by explicit `b, t, c, ...` arguments and written next
//!   to each argument (`// (B, T, C)`), row-major. The CPU kernels take one
//!   `(B, T, C)` activation where the row-wise tasks and launchers take
//!   `(N, C)` with `N = B·T`: the tasks call them with `B = 1, T = N`, the
//!   same memory. Slices must have exactly the documented length; on the CPU
//!   a mismatch is a programming error and panics (an `assert!` at the top of
//!   the kernel, before any work; in a task, the task fails with the message),
//!   a CUDA launcher returns [`braid::Error::Device`] naming the argument
//!   before it queues anything.
//! - **Single-threaded CPU kernels.** Parallelism comes from the engine running
//!   independent kernels as concurrent tasks; matrix products go through `gemm`
//!   with `Parallelism::None`. The elementwise and row loops that dominate
//!   (softmax, the classifier, attention, GELU, AdamW) are compiled a second
//!   time for AVX2 (`multiversion`, picked at run time; no FMA, so the same
//!   bits as the baseline build).
//! - **Forward kernels overwrite** their outputs (declared `write`).
//! - **Backward kernels accumulate** (`+=`) into every gradient they are given,
//!   parameter gradients and activation gradients alike, as llm.c does
//!   (declared `read_write`): the caller zeroes gradient buffers before a
//!   backward pass (or not, to accumulate micro-batches). The input
//!   gradients of [`matmul::backward_input`], [`gelu::backward`] and
//!   [`flash_attention::backward`] can instead be written over
//!   ([`GradWrite::Set`]) where the task is the gradient's only writer in the
//!   step: no zeroing task, and on CUDA no read of the old values.
//! - **Tokens** are `u32` ids. Kernels index embedding rows with them, so the
//!   caller validates them first with [`check_tokens`]; out-of-range ids are an
//!   input error to report, not something kernels check. On CUDA they cannot
//!   be checked at all without a host synchronisation: the tasks and
//!   launchers that index memory with ids are `unsafe` (see [`encoder`] and
//!   [`loss`]).
//! - **Storage.** The CPU kernels are generic over the element they store,
//!   `f32` or bf16 ([`storage::Storage`]): they load every element to `f32`,
//!   compute in `f32` and round once as they store (a gradient they
//!   accumulate into is rounded once, after all their contributions). Saved
//!   statistics (layer norm `mean`/`rstd`, per-position losses) and the
//!   optimizer's master weights and moments are always `f32`. With `f32`
//!   storage the kernels are bit for bit what they were before bf16.
//! - **Numerics.** CPU reductions over a row (layer norm statistics, softmax
//!   denominators, the gradient norm) accumulate in `f64`; everything else is
//!   `f32`. The exception is [`flash_attention`], `f32` throughout, as the
//!   GPU kernel it is the reference for would be. The CUDA kernels reduce in `f32` trees and cuBLAS sums products in
//!   its own order, so the backends agree to about 1e-4 relative (the
//!   tolerances of `tests/cuda_kernels/`), not bit for bit; encoder,
//!   residual and scaling are bit-exact. Every CUDA kernel is deterministic:
//!   no atomics, a fixed reduction order for a given shape.

// llm.c-style kernels take every dimension as its own argument.
#![allow(clippy::too_many_arguments)]

pub mod adamw;
pub mod attention;
mod cuda_common;
pub mod encoder;
pub mod fastmath;
pub mod fill;
pub mod flash_attention;
pub mod fused_classifier;
pub mod gelu;
pub mod layernorm;
pub mod loss;
pub mod matmul;
pub mod norm;
pub mod residual;
pub mod storage;
pub mod switches;
pub mod task;

#[cfg(test)]
mod bf16_tests;
#[cfg(test)]
pub(crate) mod testutil;

use cuda_common::Program;
use storage::Storage;

/// How a backward task writes an input gradient.
///
/// Either way the task declares the gradient `read_write` (the order the
/// engine gives it is the same), and the bits are those of a zeroing task
/// followed by `Add`, but for the sign of a zero (`+0 + -0` is `+0`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GradWrite {
    /// `dinp += …`: one of several contributions, into a zeroed buffer.
    Add,
    /// `dinp = …`: the gradient's only writer, over whatever it held.
    Set,
}

impl GradWrite {
    /// The CPU kernels accumulate: a `Set` gradient is zeroed first.
    pub(crate) fn prepare<S: Storage>(self, dinp: &mut [S]) {
        if self == GradWrite::Set {
            dinp.fill(S::store(0.0));
        }
    }

    /// The CUDA kernels' `accumulate` argument (`int`).
    pub(crate) fn accumulate(self) -> i32 {
        i32::from(self == GradWrite::Add)
    }
}

/// The backends (by [`braid::Runtime::backend_name`]) the tasks have a body
/// for.
pub const KERNEL_BACKENDS: &[&str] = &["cpu", "cuda"];

/// Every family's CUDA program.
static PROGRAMS: [&Program; 11] = [
    &encoder::CUDA,
    &layernorm::CUDA,
    &matmul::CUDA,
    &attention::CUDA,
    &gelu::CUDA,
    &residual::CUDA,
    &loss::CUDA,
    &adamw::CUDA,
    &norm::CUDA,
    &flash_attention::CUDA,
    &flash_attention::CUDA_TC,
];

/// Every GPT-2 CUDA program as `(file name, source)`, e.g. for an NVRTC
/// compile check (with [`kernel_headers`]). The launchers compile them through
/// [`KernelCache::global`](braid::cuda::KernelCache::global) on first use,
/// once per device.
pub fn kernel_sources() -> Vec<(&'static str, &'static str)> {
    PROGRAMS.iter().map(|p| (p.file, p.source)).collect()
}

/// The headers the programs of [`kernel_sources`] may include, as
/// `(name, text)`: give them to NVRTC with each program
/// ([`braid::cuda::compile_with_headers`]).
pub fn kernel_headers() -> &'static [braid::cuda::Header<'static>] {
    cuda_common::HEADERS
}

/// Compiles (or loads from NVRTC's disk cache) and looks up every GPT-2
/// kernel `device` can run now (a program that needs a newer compute
/// capability, such as the tensor-core attention's, is skipped: its
/// launchers take another path there), so a compile error surfaces here
/// rather than in the first task, and no task pays for NVRTC. Optional:
/// launchers load what they need on first use. Use
/// [`braid::Runtime::cuda_device`] for `device`.
pub fn preload(device: &braid::cuda::CudaDevice) -> braid::Result<()> {
    PROGRAMS
        .iter()
        .filter(|p| p.supports(device))
        .try_for_each(|p| p.preload(device))
}

/// The CPU kernels by their llm.c names, as the sequential
/// [`Reference`](crate::reference::Reference) and the tests call them.
pub mod cpu {
    pub use super::adamw::{adamw_update, adamw_update_mixed};
    pub use super::attention::{attention_backward, attention_decode, attention_forward};
    pub use super::encoder::{encoder_backward, encoder_forward};
    pub use super::flash_attention::{flash_attention_backward, flash_attention_forward};
    pub use super::fused_classifier::{classifier_losses, fused_classifier};
    pub use super::gelu::{gelu_backward, gelu_forward};
    pub use super::layernorm::{layernorm_backward, layernorm_forward, LAYERNORM_EPS};
    pub use super::loss::{
        crossentropy_forward, crossentropy_softmax_backward, mean_loss,
        softmax_crossentropy_forward, softmax_forward,
    };
    pub use super::matmul::{matmul_backward_input, matmul_backward_weight, matmul_forward};
    pub use super::norm::{clip_scale, global_norm, grad_norm_sq, scale_in_place};
    pub use super::residual::{residual_accumulate, residual_backward, residual_forward};
    pub use super::storage::{convert, Bf16, Dtype, Storage};
    pub use super::{check_tokens, TokenError};
}

use thiserror::Error;

/// A token id is not below the vocabulary size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
#[error("token {token} at position {index} is outside the vocabulary (size {vocab_size})")]
pub struct TokenError {
    /// Position of the first bad token in the slice.
    pub index: usize,
    /// The bad token id.
    pub token: u32,
    /// The vocabulary size it was checked against.
    pub vocab_size: usize,
}

/// Checks that every id in `tokens` is `< vocab_size`; reports the first that
/// is not. Call it on inputs and targets before handing them to kernels.
pub fn check_tokens(tokens: &[u32], vocab_size: usize) -> Result<(), TokenError> {
    match tokens.iter().position(|&tok| tok as usize >= vocab_size) {
        None => Ok(()),
        Some(index) => Err(TokenError {
            index,
            token: tokens[index],
            vocab_size,
        }),
    }
}

/// Panics with the kernel and argument name if `s` does not have `expected` elements.
#[track_caller]
fn check_len(kernel: &str, arg: &str, len: usize, expected: usize) {
    assert!(
        len == expected,
        "{kernel}: `{arg}` has {len} elements, expected {expected}"
    );
}

/// Panics unless rows `stride` elements apart hold `width` elements each
/// (`stride >= width`): a padded row's stride and its used width, each with
/// its name. The CUDA launchers' twin is `cuda_common::Check::stride`.
fn check_stride(kernel: &str, (width_name, width): (&str, usize), (name, stride): (&str, usize)) {
    assert!(
        stride >= width,
        "{kernel}: row stride {name} ({stride}) is below {width_name} ({width})"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every kernel a launcher uses is an `extern "C" __global__` of its
    /// family's program, so a lookup by name cannot miss (between `void`
    /// and the name, at most one macro: launch bounds).
    #[test]
    fn every_kernel_is_declared_in_its_program() {
        let declares = |source: &str, name: &str| {
            source.lines().any(|line| {
                let Some(rest) = line.strip_prefix("extern \"C\" __global__ void ") else {
                    return false;
                };
                let Some(before) = rest.split_once(&format!("{name}(")).map(|(b, _)| b) else {
                    return false;
                };
                let before = before.trim();
                before.is_empty()
                    || before
                        .chars()
                        .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
            })
        };
        for p in PROGRAMS {
            assert!(p.file.ends_with(".cu"));
            for name in p.kernels {
                assert!(
                    declares(p.source, name),
                    "{} does not declare `{name}`",
                    p.file
                );
            }
        }
        assert_eq!(kernel_sources().len(), PROGRAMS.len());
    }

    /// Every program with `_bf16` kernels includes `bf16.cuh` (the bf16 load
    /// and store helpers), which is among the headers given to NVRTC; no
    /// program defines the helpers itself.
    #[test]
    fn bf16_programs_include_the_shared_header() {
        let include = "#include \"bf16.cuh\"";
        assert!(kernel_headers().iter().any(|(n, h)| *n == "bf16.cuh"
            && h.contains("bf16_store(float x)")
            && h.contains("#pragma once")));
        let mut with_bf16 = 0;
        for p in PROGRAMS {
            let has_bf16 = p.kernels.iter().any(|k| k.ends_with("_bf16"));
            assert_eq!(
                has_bf16,
                p.source.contains(include),
                "{}: bf16 kernels and the bf16.cuh include go together",
                p.file
            );
            assert!(
                !p.source.contains("bf16_store(float x)"),
                "{} defines bf16_store itself instead of including bf16.cuh",
                p.file
            );
            with_bf16 += has_bf16 as usize;
        }
        assert!(
            with_bf16 >= 3,
            "gelu, residual and encoder have bf16 kernels"
        );
    }

    #[test]
    fn check_tokens_reports_the_first_bad_id() {
        assert_eq!(check_tokens(&[0, 1, 511], 512), Ok(()));
        assert_eq!(
            check_tokens(&[0, 512, 7, 900], 512),
            Err(TokenError {
                index: 1,
                token: 512,
                vocab_size: 512
            })
        );
        assert!(check_tokens(&[u32::MAX], 50257).is_err());
    }
}

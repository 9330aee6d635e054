//! GPT-2 kernels on host slices, after llm.c's `train_gpt2.c`.
//!
//! Conventions, shared by every kernel here:
//!
//! - **Shapes** are given by explicit `b, t, c, ...` arguments and written next
//!   to each slice argument (`// (B, T, C)`), row-major. Slices must have exactly
//!   the documented length; a mismatch is a programming error and panics (an
//!   `assert!` at the top of the kernel, before any work).
//! - **Single-threaded.** Parallelism comes from the engine running independent
//!   kernels as concurrent tasks; matrix products go through `gemm` with
//!   `Parallelism::None`.
//! - **Forward kernels overwrite** their outputs.
//! - **Backward kernels accumulate** (`+=`) into every gradient they are given,
//!   parameter gradients and activation gradients alike, as llm.c does: the
//!   caller zeroes gradient buffers before a backward pass (or not, to
//!   accumulate micro-batches). The exception is noted on the kernel.
//! - **Tokens** are `u32` ids. Kernels index embedding rows with them, so the
//!   caller validates them first with [`check_tokens`]; out-of-range ids are an
//!   input error to report, not something kernels check.
//! - Reductions over a row (layer norm statistics, softmax denominators, the
//!   gradient norm) accumulate in `f64`; everything else is `f32`.

// llm.c-style kernels take every dimension as its own argument.
#![allow(clippy::too_many_arguments)]

mod adamw;
mod attention;
mod encoder;
mod gelu;
mod layernorm;
mod loss;
mod matmul;
mod residual;

pub use adamw::{adamw_update, clip_scale, grad_norm_sq, scale_in_place};
pub use attention::{attention_backward, attention_forward};
pub use encoder::{encoder_backward, encoder_forward};
pub use gelu::{gelu_backward, gelu_forward};
pub use layernorm::{layernorm_backward, layernorm_forward, LAYERNORM_EPS};
pub use loss::{crossentropy_forward, crossentropy_softmax_backward, mean_loss, softmax_forward};
pub use matmul::{matmul_backward_input, matmul_backward_weight, matmul_forward};
pub use residual::{residual_backward, residual_forward};

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

#[cfg(test)]
pub(crate) mod testutil;

#[cfg(test)]
mod tests {
    use super::*;

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

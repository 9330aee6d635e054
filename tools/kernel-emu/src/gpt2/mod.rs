//! The GPT-2 kernel families of `models/gpt2/src/kernels` other than flash
//! attention (`lib.rs`), a module per `.cu` file: the same wrappers
//! (`(grid, block, the kernel's arguments)`, lengths checked, every buffer
//! [`Guarded`], bf16 as `u16` bits), re-exported at the crate root.
//!
//! Each wrapper documents the launch configuration of its Rust launcher in
//! `models/gpt2/src/kernels/<family>.rs`, which the tests reproduce; the
//! wrappers check what memory safety needs (every index the kernel can form
//! is inside its buffer, for any grid and block), not that the configuration
//! is the launcher's.

use super::{nonneg, Guarded};

mod adamw;
mod attention;
mod encoder;
mod gelu;
mod layernorm;
mod loss;
mod matmul;
mod norm;
mod residual;

pub use adamw::*;
pub use attention::*;
pub use encoder::*;
pub use gelu::*;
pub use layernorm::*;
pub use loss::*;
pub use matmul::*;
pub use norm::*;
pub use residual::*;

/// A dimension the kernel divides by or takes as a row width: at least 1
/// (as the launchers' `Check::dim` requires).
fn dim(kernel: &str, name: &str, x: i32) -> Result<usize, String> {
    match nonneg(kernel, x)? {
        0 => Err(format!("{kernel}: {name} is 0")),
        d => Ok(d),
    }
}

/// A 64-bit element count (the `long long N` of the elementwise kernels).
fn count(kernel: &str, x: i64) -> Result<usize, String> {
    usize::try_from(x).map_err(|_| format!("{kernel}: negative size {x}"))
}

/// A row stride: at least the row's used width (`Check::stride`).
fn stride(kernel: &str, name: &str, ld: i32, width: &str, w: usize) -> Result<usize, String> {
    let s = dim(kernel, name, ld)?;
    if s < w {
        return Err(format!(
            "{kernel}: row stride {name} ({s}) is below {width} ({w})"
        ));
    }
    Ok(s)
}

/// Every id in `ids` is below `bound` (the kernels index rows with them).
fn ids_below(kernel: &str, name: &str, ids: &[u32], bound: usize) -> Result<(), String> {
    match ids.iter().position(|&i| i as usize >= bound) {
        None => Ok(()),
        Some(p) => Err(format!(
            "{kernel}: {name}[{p}] = {} is not below {bound}",
            ids[p]
        )),
    }
}

/// An optional buffer's address for the kernel: null for `None`.
fn ptr_or_null<T>(g: &mut Option<Guarded<'_>>) -> *mut T {
    g.as_mut().map_or(std::ptr::null_mut(), |g| g.ptr())
}

/// The present buffers of `bufs`, for [`finish`](super::finish).
fn present<'a>(bufs: impl IntoIterator<Item = Option<Guarded<'a>>>) -> Vec<Guarded<'a>> {
    bufs.into_iter().flatten().collect()
}

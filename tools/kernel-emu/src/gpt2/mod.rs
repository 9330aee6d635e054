//! The GPT-2 kernel families of `models/gpt2/src/kernels`, a module per
//! `.cu` file (flash_attention.cu and flash_attention_tc.cu share one): the
//! wrappers (`(grid, block, the kernel's arguments)`, lengths checked, every
//! buffer guarded, bf16 as `u16` bits), re-exported at the crate root.
//!
//! Each wrapper documents the launch configuration of its Rust launcher in
//! `models/gpt2/src/kernels/<family>.rs`, which the tests reproduce; the
//! wrappers check what memory safety needs (every index the kernel can form
//! is inside its buffer, for any grid and block), not that the configuration
//! is the launcher's.

mod adamw;
mod attention;
mod encoder;
mod flash_attention;
mod gelu;
mod layernorm;
mod loss;
mod matmul;
mod norm;
mod residual;

pub use adamw::*;
pub use attention::*;
pub use encoder::*;
pub use flash_attention::*;
pub use gelu::*;
pub use layernorm::*;
pub use loss::*;
pub use matmul::*;
pub use norm::*;
pub use residual::*;

//! GPT-2 kernels. [`cpu`] holds the host versions: plain single-threaded
//! functions on slices, in llm.c's style (`op_forward` / `op_backward`, a shape
//! comment on every argument). The engine runs each call as one task.

pub mod cpu;
pub mod cuda;

pub use cpu::{check_tokens, TokenError};

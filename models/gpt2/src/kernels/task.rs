//! The task a kernel family submits: a [`TaskBuilder`] and the storage
//! [`Dtype`] of the tensors it touches.
//!
//! Every task function takes `impl Into<Task>`, so a plain
//! [`TaskBuilder`] (`rt.task("…")`) is an `f32` task, as before, and
//! [`Task::new`] names another dtype. A family with CUDA kernels submits
//! with `submit!`: a body per backend ([`TaskBuilder::run_any`]) on every
//! dtype, the CUDA launcher picking the `f32` or the `*_bf16` kernel. Every
//! task of the model has both bodies (a task with a CPU body only would
//! fail to submit on CUDA with [`braid::Error::NoBody`] naming it).
//!
//! The bf16 CUDA kernels (`*_bf16` in the families' `.cu` files, and
//! cuBLAS's bf16 product): `tests/cuda_kernels/` compares each with its
//! CPU kernel when a GPU is present (first run on an H200, 2026-11-26).

use braid::TaskBuilder;

use super::storage::Dtype;

/// A task to submit and the storage type of its tensors.
pub struct Task<'rt> {
    pub(crate) builder: TaskBuilder<'rt>,
    pub(crate) dtype: Dtype,
}

impl<'rt> Task<'rt> {
    /// `builder`, its tensors stored as `dtype`.
    pub fn new(builder: TaskBuilder<'rt>, dtype: Dtype) -> Self {
        Task { builder, dtype }
    }

    /// Sets the task's priority ([`TaskBuilder::priority`]).
    pub fn priority(self, p: braid::Priority) -> Self {
        Task {
            builder: self.builder.priority(p),
            dtype: self.dtype,
        }
    }

    /// The storage type of the task's tensors.
    pub fn dtype(&self) -> Dtype {
        self.dtype
    }
}

impl std::fmt::Debug for Task<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Task")
            .field("dtype", &self.dtype)
            .finish_non_exhaustive()
    }
}

impl<'rt> From<TaskBuilder<'rt>> for Task<'rt> {
    /// An `f32` task.
    fn from(builder: TaskBuilder<'rt>) -> Self {
        Task::new(builder, Dtype::F32)
    }
}

/// Submits a [`Task`] with tokens written once for a storage type `$S`, with
/// both bodies on every dtype ([`TaskBuilder::run_any`]): `$tokens`, `$cpu`
/// and `$cuda` are expanded once per storage type, so the CUDA launcher is
/// generic over it and picks the `f32` or the `_bf16` kernel:
/// `submit!(task, |S| (out.write::<S>(), …), cpu_body, cuda_body)`.
macro_rules! submit {
    ($task:expr, |$S:ident| $tokens:expr, $cpu:expr, $cuda:expr $(,)?) => {{
        let task: $crate::kernels::task::Task<'_> = $task.into();
        match task.dtype {
            $crate::kernels::storage::Dtype::F32 => {
                #[allow(dead_code)]
                type $S = f32;
                task.builder.run_any($tokens, $cpu, $cuda)
            }
            $crate::kernels::storage::Dtype::Bf16 => {
                #[allow(dead_code)]
                type $S = $crate::kernels::storage::Bf16;
                task.builder.run_any($tokens, $cpu, $cuda)
            }
        }
    }};
}
pub(crate) use submit;

//! Zeroing a view: how gradient and activation-gradient buffers start a
//! backward pass (its kernels accumulate). A byte fill on the CPU, a
//! `cuMemsetD8Async` on the task's stream on CUDA; no `.cu` program.

use braid::{CudaTaskCtx, DevSliceMut, Result, TaskHandle, View};

use super::cuda_common::task_result;
use super::task::Task;

/// Submits `out = 0` (every byte, any element type, so any
/// [`Dtype`](super::storage::Dtype)) as `task`.
pub fn zero<'rt>(task: impl Into<Task<'rt>>, out: &View) -> Result<TaskHandle> {
    task.into().builder.run_any(
        out.write::<u8>(),
        |out| out.fill(0),
        |out, cu| task_result(zero_cuda(cu, out)),
    )
}

/// Zeroes `out` on the task's stream.
pub fn zero_cuda(cu: &CudaTaskCtx<'_>, out: DevSliceMut<u8>) -> Result<()> {
    if out.is_empty() {
        return Ok(());
    }
    // SAFETY: `out` is a declared `write` token of the running task: a live
    // device buffer of the stream's device, exclusive to this task until its
    // end event, which the engine records on this stream after the memset.
    unsafe { braid::cuda::memory::memset_d8_async(out.ptr(), 0, out.len(), cu.stream()) }
        .map_err(braid::Error::from)
}

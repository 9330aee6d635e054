//! Zeroing a view: how gradient and activation-gradient buffers start a
//! backward pass (its kernels accumulate). A byte fill on the CPU, a
//! `cuMemsetD8Async` on the task's stream on CUDA; no `.cu` program. And
//! copying one view into another (a `cuMemcpyDtoDAsync` on CUDA).

use braid::{CudaTaskCtx, DevSlice, DevSliceMut, Result, TaskHandle, View};

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

/// Submits `dst = src` (bytes; the views have the same length) as `task`.
pub fn copy<'rt>(task: impl Into<Task<'rt>>, src: &View, dst: &View) -> Result<TaskHandle> {
    if src.len() != dst.len() {
        return Err(braid::Error::Config(format!(
            "copy: {} bytes into {}",
            src.len(),
            dst.len()
        )));
    }
    task.into().builder.run_any(
        (src.read::<u8>(), dst.write::<u8>()),
        |(src, dst)| dst.copy_from_slice(src),
        |(src, dst), cu| task_result(copy_cuda(cu, src, dst)),
    )
}

/// Copies `src` into `dst` on the task's stream.
pub fn copy_cuda(cu: &CudaTaskCtx<'_>, src: DevSlice<u8>, dst: DevSliceMut<u8>) -> Result<()> {
    if dst.is_empty() {
        return Ok(());
    }
    // SAFETY: `src` and `dst` are declared tokens of the running task, of
    // the same length (checked at submission), on the stream's device; the
    // submission check refused them if they overlap; the engine keeps
    // conflicting tasks off them until this task's end event.
    unsafe { braid::cuda::memory::memcpy_dtod_async(dst.ptr(), src.ptr(), dst.len(), cu.stream()) }
        .map_err(braid::Error::from)
}

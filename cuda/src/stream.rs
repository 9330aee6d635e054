//! CUDA streams with priorities.
//!
//! Every stream Braid creates is **non-blocking** (`CU_STREAM_NON_BLOCKING`): it
//! never synchronises implicitly with the legacy default stream, so the only
//! ordering between streams is the event waits the engine inserts (Semantics 4).
//! Compute streams use the normal (lowest) priority; communication streams use
//! the *highest* priority the context offers (`cuCtxGetStreamPriorityRange`), so
//! that an all-reduce's kernels are scheduled ahead of queued compute blocks.

use std::sync::Arc;

use cudarc::driver::result::{self, stream::StreamKind};
use cudarc::driver::sys as drv;

use super::device::CudaDevice;
use super::error::{CudaResult, Named};
use super::green::GreenContext;

/// Scheduling priority of a stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamPriority {
    /// The context's least priority (the default for compute streams).
    Normal,
    /// The context's greatest priority (communication streams).
    High,
    /// An explicit CUDA priority value, clamped into the context's range.
    Exact(i32),
}

impl StreamPriority {
    /// The CUDA priority value on `device` (smaller is higher).
    fn value(self, device: &CudaDevice) -> i32 {
        let (least, greatest) = device.stream_priority_range();
        match self {
            StreamPriority::Normal => least,
            StreamPriority::High => greatest,
            // Numerically: greatest <= p <= least.
            StreamPriority::Exact(p) => p.clamp(greatest, least),
        }
    }
}

/// An owned, non-blocking CUDA stream. Clones share it; destroyed with the last clone.
#[derive(Clone)]
pub struct CudaStream {
    inner: Arc<StreamInner>,
}

struct StreamInner {
    raw: drv::CUstream,
    device: CudaDevice,
    priority: i32,
    /// The green context it was made in, kept alive until the stream is
    /// destroyed; `None` for a stream of the primary context.
    green: Option<GreenContext>,
}

// SAFETY: a `CUstream` is a driver handle usable from any thread on which its
// context is current; every method binds the context first. The driver
// serialises work submitted to one stream from several threads (the engine still
// drives each stream from one thread to keep FIFO order meaningful).
unsafe impl Send for StreamInner {}
// SAFETY: see `Send`; `&StreamInner` exposes only the immutable handle.
unsafe impl Sync for StreamInner {}

impl std::fmt::Debug for CudaStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaStream")
            .field("raw", &self.inner.raw)
            .field("device", &self.inner.device.ordinal())
            .field("priority", &self.inner.priority)
            .field("green", &self.inner.green)
            .finish()
    }
}

impl CudaStream {
    /// Creates a non-blocking stream with the given priority on `device`.
    pub fn new(device: &CudaDevice, priority: StreamPriority) -> CudaResult<Self> {
        device.bind_to_thread()?;
        let prio = priority.value(device);
        // Context current. Destroyed in `Drop for StreamInner`.
        let raw = result::stream::create_with_priority(StreamKind::NonBlocking, prio)
            .named("cuStreamCreateWithPriority")?;
        Ok(CudaStream {
            inner: Arc::new(StreamInner {
                raw,
                device: device.clone(),
                priority: prio,
                green: None,
            }),
        })
    }

    /// A non-blocking stream of `green`: its kernels run on the green
    /// context's SMs only (see [`GreenContext`]). Everything else about it
    /// is a primary-context stream's: its device is the green context's.
    pub fn in_green(green: &GreenContext, priority: StreamPriority) -> CudaResult<Self> {
        let device = green.device();
        device.bind_to_thread()?;
        let prio = priority.value(device);
        let mut raw: drv::CUstream = std::ptr::null_mut();
        // SAFETY: the green context is alive (and kept alive by the stream);
        // the driver requires the non-blocking flag. Destroyed in `Drop for
        // StreamInner`.
        unsafe {
            drv::cuGreenCtxStreamCreate(
                &mut raw,
                green.raw(),
                drv::CUstream_flags::CU_STREAM_NON_BLOCKING as std::ffi::c_uint,
                prio,
            )
        }
        .result()
        .named("cuGreenCtxStreamCreate")?;
        Ok(CudaStream {
            inner: Arc::new(StreamInner {
                raw,
                device: device.clone(),
                priority: prio,
                green: Some(green.clone()),
            }),
        })
    }

    /// The green context it runs in, if any.
    pub fn green(&self) -> Option<&GreenContext> {
        self.inner.green.as_ref()
    }

    /// A compute stream (normal priority).
    pub fn compute(device: &CudaDevice) -> CudaResult<Self> {
        Self::new(device, StreamPriority::Normal)
    }

    /// A communication stream (highest priority).
    pub fn comm(device: &CudaDevice) -> CudaResult<Self> {
        Self::new(device, StreamPriority::High)
    }

    /// The raw handle, for launches and library calls. Valid while `self` lives.
    #[inline]
    pub fn raw(&self) -> drv::CUstream {
        self.inner.raw
    }

    /// The device this stream belongs to.
    #[inline]
    pub fn device(&self) -> &CudaDevice {
        &self.inner.device
    }

    /// The CUDA priority value it was created with (smaller is higher).
    pub fn priority(&self) -> i32 {
        self.inner.priority
    }

    /// Blocks the calling thread until all work queued on this stream is done.
    pub fn synchronize(&self) -> CudaResult<()> {
        self.inner.device.bind_to_thread()?;
        // SAFETY: the stream is alive.
        unsafe { result::stream::synchronize(self.inner.raw) }.named("cuStreamSynchronize")
    }

    /// `Ok(true)` when all queued work is done, `Ok(false)` while some is pending.
    pub fn query(&self) -> CudaResult<bool> {
        self.inner.device.bind_to_thread()?;
        // SAFETY: the stream is alive. (cudarc's checked layer has no
        // `cuStreamQuery`.)
        let status = unsafe { drv::cuStreamQuery(self.inner.raw) };
        if status == drv::CUresult::CUDA_ERROR_NOT_READY {
            Ok(false)
        } else {
            status.result().named("cuStreamQuery").map(|()| true)
        }
    }

    /// True when both handles are the same stream.
    pub fn same_stream(&self, other: &CudaStream) -> bool {
        self.inner.raw == other.inner.raw
    }
}

/// Anything that names a stream: a [`CudaStream`], or a raw `CUstream` handed
/// out by the engine, wrapped in [`RawStream`]. Collectives and launches accept
/// either.
pub trait AsRawStream {
    /// The raw handle.
    fn raw_stream(&self) -> drv::CUstream;
    /// Its device, when known (a [`RawStream`] does not know it; calls then skip
    /// the same-device check, which becomes part of their safety contract).
    fn stream_device(&self) -> Option<&CudaDevice>;
}

impl AsRawStream for CudaStream {
    fn raw_stream(&self) -> drv::CUstream {
        self.inner.raw
    }
    fn stream_device(&self) -> Option<&CudaDevice> {
        Some(&self.inner.device)
    }
}

/// A borrowed raw stream handle (e.g. the one a task body runs on). It must
/// belong to the device of the object it is used with and outlive the call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RawStream(pub drv::CUstream);

// SAFETY: a plain handle value; using it is governed by the `unsafe` contracts
// of the functions that take it.
unsafe impl Send for RawStream {}
// SAFETY: see `Send`.
unsafe impl Sync for RawStream {}

impl AsRawStream for RawStream {
    fn raw_stream(&self) -> drv::CUstream {
        self.0
    }
    fn stream_device(&self) -> Option<&CudaDevice> {
        None
    }
}

impl Drop for StreamInner {
    fn drop(&mut self) {
        // Destroying a stream with pending work is allowed: the driver releases it
        // once the work completes.
        let r = self.device.bind_to_thread().and_then(|()| {
            // SAFETY: last owner of the handle; never used again.
            unsafe { result::stream::destroy(self.raw) }.named("cuStreamDestroy")
        });
        if let Err(e) = r {
            self.device.record_deferred(e);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn priorities_follow_the_range() {
        if !super::super::gpu_or_skip("stream::priorities_follow_the_range") {
            return;
        }
        let dev = CudaDevice::open(0).unwrap();
        let (least, greatest) = dev.stream_priority_range();
        let c = CudaStream::compute(&dev).unwrap();
        let m = CudaStream::comm(&dev).unwrap();
        assert_eq!(c.priority(), least);
        assert_eq!(m.priority(), greatest);
        assert!(m.priority() <= c.priority());
        let x = CudaStream::new(&dev, StreamPriority::Exact(-1000)).unwrap();
        assert_eq!(x.priority(), greatest);
        c.synchronize().unwrap();
        assert!(m.query().unwrap());
    }
}

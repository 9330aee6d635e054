//! A CUDA device and its primary context.
//!
//! [`CudaDevice`] is a cheap `Arc` handle. Opening a device retains its primary
//! context (released when the last handle, including the ones held by streams,
//! events and buffers, is dropped), reads the attributes the engine needs
//! (compute capability for NVRTC, the stream priority range for comm streams),
//! and configures the device's default memory pool so that stream-ordered frees
//! keep their memory for reuse instead of returning it to the driver at every
//! synchronisation (release threshold = `u64::MAX`).

use std::sync::{Arc, Mutex};

use cudarc::driver::{result, sys as drv};

use super::error::{catch_panic, CudaError, CudaResult, Named};

/// Handle to one CUDA device (its primary context). Clones share it.
#[derive(Clone)]
pub struct CudaDevice {
    inner: Arc<DeviceInner>,
}

struct DeviceInner {
    ordinal: usize,
    cu_device: drv::CUdevice,
    ctx: drv::CUcontext,
    name: String,
    compute_capability: (u32, u32),
    sm_count: u32,
    total_memory: usize,
    /// `(least, greatest)` as CUDA reports it: numerically *smaller* is higher
    /// priority, so `greatest <= least` (e.g. `(0, -5)`).
    priority_range: (i32, i32),
    mem_pool: drv::CUmemoryPool,
    deferred: Mutex<Vec<CudaError>>,
}

// SAFETY: `CUcontext` and `CUmemoryPool` are process-wide driver handles. The
// driver API is thread-safe, and every call made through them first makes the
// context current on the calling thread (`bind_to_thread`). The only mutable
// state is behind a `Mutex`.
unsafe impl Send for DeviceInner {}
// SAFETY: see `Send`; shared references only read immutable fields or lock.
unsafe impl Sync for DeviceInner {}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDevice")
            .field("ordinal", &self.inner.ordinal)
            .field("name", &self.inner.name)
            .field("compute_capability", &self.inner.compute_capability)
            .field("sm_count", &self.inner.sm_count)
            .finish()
    }
}

/// Memory-pool occupancy of a device (bytes), from `cuMemPoolGetAttribute`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PoolStats {
    /// Memory currently backed by the pool (reserved from the driver).
    pub reserved_current: u64,
    /// High-water mark of `reserved_current`.
    pub reserved_high: u64,
    /// Memory currently handed out to live allocations.
    pub used_current: u64,
    /// High-water mark of `used_current`.
    pub used_high: u64,
}

fn attribute(dev: drv::CUdevice, attr: drv::CUdevice_attribute) -> CudaResult<i32> {
    // SAFETY: `dev` came from `cuDeviceGet`.
    unsafe { result::device::get_attribute(dev, attr) }.named("cuDeviceGetAttribute")
}

impl CudaDevice {
    /// Opens device `ordinal` (0-based, as `CUDA_VISIBLE_DEVICES` renumbers them)
    /// and makes its primary context current on the calling thread.
    pub fn open(ordinal: usize) -> CudaResult<Self> {
        let count = super::cuda_available()?;
        if ordinal >= count {
            return Err(CudaError::NoSuchDevice { ordinal, count });
        }
        catch_panic("opening a CUDA device", || Self::open_inner(ordinal))
    }

    fn open_inner(ordinal: usize) -> CudaResult<Self> {
        use drv::CUdevice_attribute as A;
        // The driver is initialised by `cuda_available`.
        let cu_device = result::device::get(ordinal as i32).named("cuDeviceGet")?;

        // SAFETY: `cu_device` came from `cuDeviceGet`. Balanced by
        // `cuDevicePrimaryCtxRelease_v2` in `Drop for DeviceInner`.
        let ctx =
            unsafe { result::primary_ctx::retain(cu_device) }.named("cuDevicePrimaryCtxRetain")?;
        // From here on, `guard` releases the retain if a later step fails.
        struct Release(drv::CUdevice);
        impl Drop for Release {
            fn drop(&mut self) {
                // SAFETY: balances the successful retain above.
                let _ = unsafe { result::primary_ctx::release(self.0) };
            }
        }
        let guard = Release(cu_device);

        // SAFETY: `ctx` is the retained primary context.
        unsafe { result::ctx::set_current(ctx) }.named("cuCtxSetCurrent")?;

        let name = result::device::get_name(cu_device).named("cuDeviceGetName")?;

        let major = attribute(cu_device, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
        let minor = attribute(cu_device, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
        let sm_count = attribute(cu_device, A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
        let pools = attribute(cu_device, A::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED)?;
        if pools == 0 {
            return Err(CudaError::InvalidArgument(format!(
                "device {ordinal} ({name}) does not support stream-ordered memory pools \
                 (cuMemAllocAsync); Braid needs them"
            )));
        }

        // SAFETY: valid device.
        let total_memory =
            unsafe { result::device::total_mem(cu_device) }.named("cuDeviceTotalMem")?;

        // The context is current (set above).
        let (least, greatest) =
            result::stream::get_priority_range().named("cuCtxGetStreamPriorityRange")?;

        // SAFETY: valid device. The default pool lives as long as the device and
        // is never destroyed by us.
        let mem_pool = unsafe { result::device::get_default_mem_pool(cu_device) }
            .named("cuDeviceGetDefaultMemPool")?;
        let mut threshold: u64 = u64::MAX;
        // SAFETY: the pool is valid; RELEASE_THRESHOLD takes a `cuuint64_t*`, and
        // the pointer is valid for the call.
        unsafe {
            result::mem_pool::set_attribute(
                mem_pool,
                drv::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&mut threshold as *mut u64).cast(),
            )
        }
        .named("cuMemPoolSetAttribute(RELEASE_THRESHOLD)")?;

        std::mem::forget(guard);
        Ok(CudaDevice {
            inner: Arc::new(DeviceInner {
                ordinal,
                cu_device,
                ctx,
                name,
                compute_capability: (major as u32, minor as u32),
                sm_count: sm_count as u32,
                total_memory,
                priority_range: (least, greatest),
                mem_pool,
                deferred: Mutex::new(Vec::new()),
            }),
        })
    }

    /// Number of visible devices (see [`super::cuda_available`]).
    pub fn count() -> CudaResult<usize> {
        super::cuda_available()
    }

    /// Makes this device's primary context current on the calling thread, if it
    /// is not already. Cheap enough to call before every driver call.
    #[inline]
    pub fn bind_to_thread(&self) -> CudaResult<()> {
        // The driver is loaded and initialised (a device exists).
        let cur = result::ctx::get_current().named("cuCtxGetCurrent")?;
        if cur != Some(self.inner.ctx) {
            // SAFETY: `ctx` is retained for as long as `self.inner` lives.
            unsafe { result::ctx::set_current(self.inner.ctx) }.named("cuCtxSetCurrent")?;
        }
        Ok(())
    }

    /// Blocks until all work on all streams of this device is done (`cuCtxSynchronize`).
    pub fn synchronize(&self) -> CudaResult<()> {
        self.bind_to_thread()?;
        result::ctx::synchronize().named("cuCtxSynchronize")
    }

    /// 0-based ordinal.
    pub fn ordinal(&self) -> usize {
        self.inner.ordinal
    }

    /// Marketing name, e.g. `NVIDIA H100 80GB HBM3`.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// `(major, minor)`, e.g. `(9, 0)` for H100.
    pub fn compute_capability(&self) -> (u32, u32) {
        self.inner.compute_capability
    }

    /// NVRTC real architecture for this device, e.g. `sm_90`.
    pub fn arch(&self) -> String {
        let (ma, mi) = self.inner.compute_capability;
        format!("sm_{ma}{mi}")
    }

    /// Number of streaming multiprocessors.
    pub fn sm_count(&self) -> u32 {
        self.inner.sm_count
    }

    /// Total device memory in bytes.
    pub fn total_memory(&self) -> usize {
        self.inner.total_memory
    }

    /// `(least, greatest)` stream priorities; numerically smaller is higher.
    pub fn stream_priority_range(&self) -> (i32, i32) {
        self.inner.priority_range
    }

    /// `(free, total)` bytes from `cuMemGetInfo`.
    pub fn memory_info(&self) -> CudaResult<(usize, usize)> {
        self.bind_to_thread()?;
        result::mem_get_info().named("cuMemGetInfo")
    }

    /// Occupancy of the default memory pool.
    pub fn pool_stats(&self) -> CudaResult<PoolStats> {
        use drv::CUmemPool_attribute as P;
        let get = |attr| -> CudaResult<u64> {
            let mut v: u64 = 0;
            // SAFETY: these four attributes are `cuuint64_t`; pool valid; the
            // pointer is valid for the call.
            unsafe {
                result::mem_pool::get_attribute(
                    self.inner.mem_pool,
                    attr,
                    (&mut v as *mut u64).cast(),
                )
            }
            .named("cuMemPoolGetAttribute")?;
            Ok(v)
        };
        Ok(PoolStats {
            reserved_current: get(P::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)?,
            reserved_high: get(P::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH)?,
            used_current: get(P::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)?,
            used_high: get(P::CU_MEMPOOL_ATTR_USED_MEM_HIGH)?,
        })
    }

    /// Returns pool memory not in use to the driver, keeping at least `keep_bytes`.
    /// Only memory whose frees have completed on the device is released.
    pub fn trim_pool(&self, keep_bytes: usize) -> CudaResult<()> {
        self.bind_to_thread()?;
        // SAFETY: pool valid for the device's lifetime.
        unsafe { result::mem_pool::trim_to(self.inner.mem_pool, keep_bytes) }
            .named("cuMemPoolTrimTo")
    }

    /// Records an error found where it could not be returned (a `Drop`). The
    /// engine drains these at its next synchronisation point.
    pub fn record_deferred(&self, err: CudaError) {
        if let Ok(mut v) = self.inner.deferred.lock() {
            v.push(err);
        }
    }

    /// Takes the errors recorded by `Drop` impls since the last call.
    pub fn take_deferred_errors(&self) -> Vec<CudaError> {
        self.inner
            .deferred
            .lock()
            .map(|mut v| std::mem::take(&mut *v))
            .unwrap_or_default()
    }

    /// True when both handles refer to the same opened device.
    pub fn same_device(&self, other: &CudaDevice) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner) || self.inner.ctx == other.inner.ctx
    }

    /// The driver's device handle.
    pub(crate) fn cu_device(&self) -> drv::CUdevice {
        self.inner.cu_device
    }

    /// Raw primary context (for FFI interop only).
    pub fn raw_context(&self) -> drv::CUcontext {
        self.inner.ctx
    }

    pub(crate) fn check_same(&self, other: &CudaDevice, what: &'static str) -> CudaResult<()> {
        if self.same_device(other) {
            Ok(())
        } else {
            Err(CudaError::DeviceMismatch {
                what,
                expected: self.ordinal(),
                got: other.ordinal(),
            })
        }
    }
}

impl Drop for DeviceInner {
    fn drop(&mut self) {
        // SAFETY: balances the retain in `open_inner`. Every object created in
        // this context holds a `CudaDevice` clone, so none outlives this.
        let _ = unsafe { result::primary_ctx::release(self.cu_device) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn open_reports_device_facts() {
        if !super::super::gpu_or_skip("device::open_reports_device_facts") {
            return;
        }
        let dev = CudaDevice::open(0).unwrap();
        let (ma, _) = dev.compute_capability();
        assert!(ma >= 7, "{dev:?}");
        assert!(dev.sm_count() > 0);
        let (least, greatest) = dev.stream_priority_range();
        assert!(greatest <= least);
        // Binding from another thread works and is idempotent.
        let d2 = dev.clone();
        std::thread::spawn(move || {
            d2.bind_to_thread().unwrap();
            d2.bind_to_thread().unwrap();
            d2.synchronize().unwrap();
        })
        .join()
        .unwrap();
        eprintln!("{dev:?} arch={} mem={}", dev.arch(), dev.total_memory());
    }

    #[test]
    fn bad_ordinal_is_an_error() {
        if !super::super::gpu_or_skip("device::bad_ordinal_is_an_error") {
            return;
        }
        let err = CudaDevice::open(10_000).unwrap_err();
        assert!(matches!(err, CudaError::NoSuchDevice { .. }), "{err:?}");
    }
}

//! A CUDA device and its primary context.
//!
//! [`CudaDevice`] is a cheap `Arc` handle. Opening a device retains its primary
//! context (released when the last handle, including the ones held by streams,
//! events and buffers, is dropped), reads the attributes the engine needs
//! (compute capability for NVRTC, the stream priority range for comm streams),
//! and configures the device's default memory pool so that stream-ordered frees
//! keep their memory for reuse instead of returning it to the driver at every
//! synchronisation (release threshold = `u64::MAX`).

use std::ffi::CStr;
use std::sync::{Arc, Mutex};

use cudarc::driver::sys as drv;

use super::error::{catch_panic, check, CudaError, CudaResult};

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
    let mut v = 0i32;
    // SAFETY: `dev` came from `cuDeviceGet`; `v` is valid for one write.
    check("cuDeviceGetAttribute", unsafe {
        drv::cuDeviceGetAttribute(&mut v, attr, dev)
    })?;
    Ok(v)
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
        let mut cu_device: drv::CUdevice = 0;
        // SAFETY: driver initialised by `cuda_available`; out-pointer valid.
        check("cuDeviceGet", unsafe {
            drv::cuDeviceGet(&mut cu_device, ordinal as i32)
        })?;

        let mut ctx: drv::CUcontext = std::ptr::null_mut();
        // SAFETY: `cu_device` is valid; out-pointer valid. Balanced by
        // `cuDevicePrimaryCtxRelease_v2` in `Drop for DeviceInner`.
        check("cuDevicePrimaryCtxRetain", unsafe {
            drv::cuDevicePrimaryCtxRetain(&mut ctx, cu_device)
        })?;
        // From here on, `guard` releases the retain if a later step fails.
        struct Release(drv::CUdevice);
        impl Drop for Release {
            fn drop(&mut self) {
                // SAFETY: balances the successful retain above.
                unsafe { drv::cuDevicePrimaryCtxRelease_v2(self.0) };
            }
        }
        let guard = Release(cu_device);

        // SAFETY: `ctx` is the retained primary context.
        check("cuCtxSetCurrent", unsafe { drv::cuCtxSetCurrent(ctx) })?;

        let mut name_buf = [0 as std::ffi::c_char; 256];
        // SAFETY: buffer valid for `len` bytes; the driver NUL-terminates.
        check("cuDeviceGetName", unsafe {
            drv::cuDeviceGetName(name_buf.as_mut_ptr(), name_buf.len() as i32, cu_device)
        })?;
        // SAFETY: NUL-terminated by the driver within the buffer.
        let name = unsafe { CStr::from_ptr(name_buf.as_ptr()) }
            .to_string_lossy()
            .into_owned();

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

        let mut total_memory = 0usize;
        // SAFETY: valid device and out-pointer.
        check("cuDeviceTotalMem", unsafe {
            drv::cuDeviceTotalMem_v2(&mut total_memory, cu_device)
        })?;

        let (mut least, mut greatest) = (0i32, 0i32);
        // SAFETY: the context is current (set above); out-pointers valid.
        check("cuCtxGetStreamPriorityRange", unsafe {
            drv::cuCtxGetStreamPriorityRange(&mut least, &mut greatest)
        })?;

        let mut mem_pool: drv::CUmemoryPool = std::ptr::null_mut();
        // SAFETY: valid device; out-pointer valid. The default pool lives as long
        // as the device and is never destroyed by us.
        check("cuDeviceGetDefaultMemPool", unsafe {
            drv::cuDeviceGetDefaultMemPool(&mut mem_pool, cu_device)
        })?;
        let mut threshold: u64 = u64::MAX;
        // SAFETY: RELEASE_THRESHOLD takes a `cuuint64_t*`; the pointer is valid.
        check("cuMemPoolSetAttribute(RELEASE_THRESHOLD)", unsafe {
            drv::cuMemPoolSetAttribute(
                mem_pool,
                drv::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&mut threshold as *mut u64).cast(),
            )
        })?;

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
        let mut cur: drv::CUcontext = std::ptr::null_mut();
        // SAFETY: the driver is loaded and initialised (a device exists);
        // out-pointer valid.
        check("cuCtxGetCurrent", unsafe { drv::cuCtxGetCurrent(&mut cur) })?;
        if cur != self.inner.ctx {
            // SAFETY: `ctx` is retained for as long as `self.inner` lives.
            check("cuCtxSetCurrent", unsafe {
                drv::cuCtxSetCurrent(self.inner.ctx)
            })?;
        }
        Ok(())
    }

    /// Blocks until all work on all streams of this device is done (`cuCtxSynchronize`).
    pub fn synchronize(&self) -> CudaResult<()> {
        self.bind_to_thread()?;
        // SAFETY: context current.
        check("cuCtxSynchronize", unsafe { drv::cuCtxSynchronize() })
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
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: context current; out-pointers valid.
        check("cuMemGetInfo", unsafe {
            drv::cuMemGetInfo_v2(&mut free, &mut total)
        })?;
        Ok((free, total))
    }

    /// Occupancy of the default memory pool.
    pub fn pool_stats(&self) -> CudaResult<PoolStats> {
        use drv::CUmemPool_attribute as P;
        let get = |attr| -> CudaResult<u64> {
            let mut v: u64 = 0;
            // SAFETY: these four attributes are `cuuint64_t`; pool valid.
            check("cuMemPoolGetAttribute", unsafe {
                drv::cuMemPoolGetAttribute(self.inner.mem_pool, attr, (&mut v as *mut u64).cast())
            })?;
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
        check("cuMemPoolTrimTo", unsafe {
            drv::cuMemPoolTrimTo(self.inner.mem_pool, keep_bytes)
        })
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
        unsafe {
            drv::cuDevicePrimaryCtxRelease_v2(self.cu_device);
        }
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

//! SM partitions: CUDA green contexts (driver 12.4 and later).
//!
//! A GPU cannot preempt a running kernel, and stream priorities only decide
//! which queued block goes next to an SM that frees up. A program that must
//! answer quickly beside a long-running one therefore waits for the other's
//! blocks to finish, whatever the priorities. A *green context* runs its
//! streams' kernels on a subset of the device's SMs only. Giving the
//! long-running program a green context over all the SMs but a few leaves
//! those few free for everyone else: the quick program's kernels (on the
//! primary context, which spans every SM) always find them idle.
//!
//! A green context retains the primary context, and the driver documents
//! its `CUcontext` as treated like the primary one for everything but
//! execution resources; so buffers, events, kernels and cuBLAS handles made
//! on the primary context are expected to work on its streams unchanged
//! (the GPU tests here check it; not yet run on a GPU). Only the streams
//! differ: [`CudaStream::in_green`] makes one whose kernels run on the
//! partition.
//!
//! [`CudaStream::in_green`]: super::CudaStream::in_green

use std::sync::Arc;

use cudarc::driver::sys as drv;

use super::device::CudaDevice;
use super::error::{catch_panic, CudaError, CudaResult, Named};

/// A green context over part of a device's SMs. Clones share it; destroyed
/// with the last clone (streams made in it hold a clone).
#[derive(Clone)]
pub struct GreenContext {
    inner: Arc<GreenInner>,
}

struct GreenInner {
    raw: drv::CUgreenCtx,
    device: CudaDevice,
    /// SMs its kernels may run on.
    sm_count: u32,
    /// SMs of the device they never run on.
    spared: u32,
}

// SAFETY: a `CUgreenCtx` is a driver handle; the only calls made with it
// (stream creation, destruction) are thread-safe in the driver, and it is
// never made current on a thread.
unsafe impl Send for GreenInner {}
// SAFETY: see `Send`; `&GreenInner` exposes only the immutable handle.
unsafe impl Sync for GreenInner {}

impl std::fmt::Debug for GreenContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GreenContext")
            .field("device", &self.inner.device.ordinal())
            .field("sm_count", &self.inner.sm_count)
            .field("spared", &self.inner.spared)
            .finish()
    }
}

impl GreenContext {
    /// A green context over all of `device`'s SMs but at least `spare`,
    /// which its kernels never use. The driver rounds the spared group up
    /// to its partition granularity (on compute capability 9.0, a multiple
    /// of 8 SMs): [`GreenContext::spared`] says how many it spared.
    ///
    /// Errors: `spare` is 0 or leaves no SM; the driver has no green
    /// contexts (older than 12.4, or the device does not support them).
    pub fn all_but(device: &CudaDevice, spare: u32) -> CudaResult<Self> {
        let total = device.sm_count();
        if spare == 0 || spare >= total {
            return Err(CudaError::InvalidArgument(format!(
                "cannot spare {spare} of the {total} SMs of device {} ({}): \
                 spare at least 1 and leave at least one",
                device.ordinal(),
                device.name()
            )));
        }
        catch_panic("creating a green context (driver 12.4 or later)", || {
            Self::all_but_inner(device, spare)
        })
    }

    fn all_but_inner(device: &CudaDevice, spare: u32) -> CudaResult<Self> {
        device.bind_to_thread()?;
        let mut all = zeroed_resource();
        // SAFETY: the driver fills `all`, valid for the call.
        unsafe {
            drv::cuDeviceGetDevResource(
                device.cu_device(),
                &mut all,
                drv::CUdevResourceType::CU_DEV_RESOURCE_TYPE_SM,
            )
        }
        .result()
        .named("cuDeviceGetDevResource")?;
        let (mut spared, mut rest) = (zeroed_resource(), zeroed_resource());
        let mut groups: std::ffi::c_uint = 1;
        // SAFETY: one result slot for the one group asked; `all` is the
        // device's SM resource; every pointer is valid for the call.
        unsafe {
            drv::cuDevSmResourceSplitByCount(&mut spared, &mut groups, &all, &mut rest, 0, spare)
        }
        .result()
        .named("cuDevSmResourceSplitByCount")?;
        // SAFETY: both were filled as SM resources by the split.
        let (spared_sms, rest_sms) = unsafe {
            (
                spared.__bindgen_anon_1.sm.smCount,
                rest.__bindgen_anon_1.sm.smCount,
            )
        };
        if groups != 1 || rest_sms == 0 {
            return Err(CudaError::InvalidArgument(format!(
                "the {} SMs of device {} ({}) cannot be split into {spare} spared and \
                 the rest (the driver made {groups} group(s) of {spared_sms}, \
                 leaving {rest_sms})",
                device.sm_count(),
                device.ordinal(),
                device.name()
            )));
        }
        let mut desc: drv::CUdevResourceDesc = std::ptr::null_mut();
        // SAFETY: `rest` is one SM resource made by the split.
        unsafe { drv::cuDevResourceGenerateDesc(&mut desc, &mut rest, 1) }
            .result()
            .named("cuDevResourceGenerateDesc")?;
        let mut raw: drv::CUgreenCtx = std::ptr::null_mut();
        // SAFETY: `desc` was generated above for this device. The flag is
        // the one the driver requires. Destroyed in `Drop for GreenInner`.
        unsafe {
            drv::cuGreenCtxCreate(
                &mut raw,
                desc,
                device.cu_device(),
                drv::CUgreenCtxCreate_flags::CU_GREEN_CTX_DEFAULT_STREAM as std::ffi::c_uint,
            )
        }
        .result()
        .named("cuGreenCtxCreate")?;
        Ok(GreenContext {
            inner: Arc::new(GreenInner {
                raw,
                device: device.clone(),
                sm_count: rest_sms,
                spared: spared_sms,
            }),
        })
    }

    /// SMs its kernels may run on.
    pub fn sm_count(&self) -> u32 {
        self.inner.sm_count
    }

    /// SMs of the device its kernels never run on (the spared group, as
    /// rounded by the driver).
    pub fn spared(&self) -> u32 {
        self.inner.spared
    }

    /// Its device.
    pub fn device(&self) -> &CudaDevice {
        &self.inner.device
    }

    pub(crate) fn raw(&self) -> drv::CUgreenCtx {
        self.inner.raw
    }
}

/// An empty resource for the driver to fill.
fn zeroed_resource() -> drv::CUdevResource {
    // SAFETY: a plain C struct (an enum tag whose 0 is `INVALID`, bytes and a
    // union of plain integers), for which all zeroes is a valid value.
    unsafe { std::mem::zeroed() }
}

impl Drop for GreenInner {
    fn drop(&mut self) {
        // Every stream made in it holds a clone, so none outlives it.
        let r = self.device.bind_to_thread().and_then(|()| {
            // SAFETY: created once, destroyed once.
            unsafe { drv::cuGreenCtxDestroy(self.raw) }
                .result()
                .named("cuGreenCtxDestroy")
        });
        if let Err(e) = r {
            self.device.record_deferred(e);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::memory::DeviceBuffer;
    use super::super::nvrtc::{CudaModule, KernelArgs, LaunchConfig};
    use super::super::stream::{CudaStream, StreamPriority};
    use super::*;

    /// How many distinct SMs the blocks of one launch on `s` ran on.
    fn distinct_sms(dev: &CudaDevice, s: &CudaStream) -> usize {
        let m = CudaModule::from_source(dev, super::super::test_kernels::SPIN, "spin.cu").unwrap();
        let f = m.function("where_blocks_ran").unwrap();
        let blocks = 8 * dev.sm_count() as usize;
        let out = DeviceBuffer::zeroed(s, blocks * 4).unwrap();
        let mut args = KernelArgs::new();
        args.ptr(out.device_ptr()).i64(200_000);
        let cfg = LaunchConfig {
            grid: (blocks as u32, 1, 1),
            block: (32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: signature (unsigned*, long long) matches; `out` holds one
        // u32 per block and lives past the sync in `to_host_vec`.
        unsafe { f.launch(s, cfg, &args).unwrap() };
        let ids: Vec<u32> = out.to_host_vec(s).unwrap();
        let set: std::collections::BTreeSet<u32> = ids.into_iter().collect();
        set.len()
    }

    #[test]
    fn green_streams_keep_kernels_off_the_spared_sms() {
        if !super::super::gpu_or_skip("green::green_streams_keep_kernels_off_the_spared_sms") {
            return;
        }
        let dev = CudaDevice::open(0).unwrap();
        let green = match GreenContext::all_but(&dev, 8) {
            Ok(g) => g,
            Err(e) => panic!("a green context sparing 8 SMs on {dev:?}: {e}"),
        };
        eprintln!("{green:?} of {} SMs", dev.sm_count());
        assert!(green.spared() >= 8, "{green:?}");
        assert_eq!(green.sm_count() + green.spared(), dev.sm_count());
        let primary = CudaStream::compute(&dev).unwrap();
        let in_green = CudaStream::in_green(&green, StreamPriority::Normal).unwrap();
        let on_primary = distinct_sms(&dev, &primary);
        let on_green = distinct_sms(&dev, &in_green);
        eprintln!("distinct SMs: primary {on_primary}, green {on_green}");
        assert!(
            on_primary > green.sm_count() as usize,
            "the primary context's launch used {on_primary} SMs, no more than the \
             green context's {}: the check cannot tell them apart",
            green.sm_count()
        );
        assert!(
            on_green <= green.sm_count() as usize,
            "a green stream's launch used {on_green} SMs, more than its {}",
            green.sm_count()
        );
    }

    #[test]
    fn sparing_nothing_or_everything_is_refused() {
        if !super::super::gpu_or_skip("green::sparing_nothing_or_everything_is_refused") {
            return;
        }
        let dev = CudaDevice::open(0).unwrap();
        for spare in [0, dev.sm_count()] {
            let e = GreenContext::all_but(&dev, spare).unwrap_err();
            assert!(e.to_string().contains("cannot spare"), "{e}");
        }
    }
}

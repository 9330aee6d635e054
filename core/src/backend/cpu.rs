//! The CPU backend: a stream is an OS thread running its FIFO, an event is a
//! completion counter the waiting stream blocks on, buffers are host memory.

use crate::error::{Error, Result};
use std::alloc::Layout;
use std::ptr::NonNull;

/// Host allocations are aligned for any element type and for SIMD loads.
pub(crate) const ALIGN: usize = 64;

/// Zero-initialised, 64-byte aligned host memory.
#[derive(Debug)]
pub(crate) struct HostMem {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: `HostMem` owns its allocation exclusively; access to the bytes is
// coordinated by the engine (dependency order plus the task context's borrow
// checks), never through shared `&HostMem` alone.
unsafe impl Send for HostMem {}
// SAFETY: as above; `&HostMem` exposes only the raw pointer and length.
unsafe impl Sync for HostMem {}

impl HostMem {
    pub(crate) fn zeroed(len: usize) -> Result<Self> {
        if len == 0 {
            // Aligned as every allocation is, so an empty view is an aligned
            // empty slice of any element type the submission check admits.
            #[repr(C, align(64))]
            struct Aligned([u8; ALIGN]);
            const _: () = assert!(std::mem::align_of::<Aligned>() == ALIGN);
            return Ok(HostMem {
                ptr: NonNull::<Aligned>::dangling().cast(),
                len,
            });
        }
        let layout = Layout::from_size_align(len, ALIGN).map_err(|e| Error::Device {
            backend: "cpu",
            op: "alloc".into(),
            message: format!("no allocation can hold {len} bytes: {e}"),
        })?;
        // SAFETY: `layout` has non-zero size.
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(p).ok_or_else(|| Error::Device {
            backend: "cpu",
            op: "alloc".into(),
            message: format!("out of host memory allocating {len} bytes"),
        })?;
        Ok(HostMem { ptr, len })
    }

    pub(crate) fn ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl Drop for HostMem {
    fn drop(&mut self) {
        if self.len != 0 {
            // SAFETY: allocated in `zeroed` with exactly this layout.
            unsafe {
                std::alloc::dealloc(
                    self.ptr.as_ptr(),
                    Layout::from_size_align_unchecked(self.len, ALIGN),
                )
            }
        }
    }
}

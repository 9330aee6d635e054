//! Stream-ordered device memory, pinned host memory and copies.
//!
//! # Allocation
//!
//! [`DeviceBuffer::alloc`] calls `cuMemAllocAsync` on a stream: the memory comes
//! from the device's default pool and is usable by work queued on that stream
//! after the call (and by other streams once they wait on an event recorded after
//! it). The pool's release threshold is `u64::MAX` (set when the device is
//! opened), so freed memory stays in the pool for reuse rather than going back to
//! the driver; this is what makes per-step activations cheap, with no
//! hand-written caching allocator.
//!
//! # Freeing (Semantics 7)
//!
//! A buffer is freed *stream-ordered*: `cuMemFreeAsync(ptr, s)` returns the
//! memory to the pool once the work queued on `s` before it has run. A buffer
//! touched by several streams may be freed only after every task that touched it
//! completed, so the engine calls [`DeviceBuffer::free_after`] with the last-use
//! event of each stream that touched it: the free stream waits on each event and
//! then frees. Dropping a buffer without that frees it on its *home* stream (the
//! one it was allocated on): correct only when every other stream that touched it
//! has been waited on by the home stream already.
//!
//! # Copies
//!
//! * The safe slice copies ([`DeviceBuffer::copy_from_host`],
//!   [`DeviceBuffer::copy_to_host`]) are queued on the given stream and then
//!   **block until that stream is idle**, because a borrowed host slice may be
//!   page-locked, in which case CUDA would read or write it after the call
//!   returned.
//! * Truly asynchronous copies go through [`PinnedHostBuffer`] and the `unsafe`
//!   `*_async` functions, whose contract is that the host memory stays alive and
//!   untouched until the stream has passed the copy (the engine guarantees this
//!   by holding the host buffer until the task's completion event fires).

use cudarc::driver::{result, sys as drv};

use super::device::CudaDevice;
use super::error::{CudaError, CudaResult, Named};
use super::event::CudaEvent;
use super::stream::CudaStream;

/// A raw device address (`CUdeviceptr`), as kernels, cuBLAS and NCCL take it.
pub type DevicePtr = u64;

/// Plain old data that may be copied byte-for-byte to and from the device.
///
/// # Safety
/// Every bit pattern of `size_of::<Self>()` bytes must be a valid value, and the
/// type must contain no padding and no pointers.
pub unsafe trait DeviceRepr: Copy + Send + Sync + 'static {}
// SAFETY: primitive numbers: no padding, every bit pattern valid.
unsafe impl DeviceRepr for u8 {}
// SAFETY: as above.
unsafe impl DeviceRepr for i8 {}
// SAFETY: as above.
unsafe impl DeviceRepr for u16 {}
// SAFETY: as above.
unsafe impl DeviceRepr for i16 {}
// SAFETY: as above.
unsafe impl DeviceRepr for u32 {}
// SAFETY: as above.
unsafe impl DeviceRepr for i32 {}
// SAFETY: as above.
unsafe impl DeviceRepr for u64 {}
// SAFETY: as above.
unsafe impl DeviceRepr for i64 {}
// SAFETY: as above.
unsafe impl DeviceRepr for f32 {}
// SAFETY: as above.
unsafe impl DeviceRepr for f64 {}

/// Device memory from the stream-ordered pool: `(ptr, bytes, device)` plus the
/// home stream used by `Drop`.
pub struct DeviceBuffer {
    ptr: DevicePtr,
    bytes: usize,
    home: CudaStream,
    freed: bool,
}

impl std::fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("bytes", &self.bytes)
            .field("device", &self.home.device().ordinal())
            .finish()
    }
}

// `DeviceBuffer` is `Send + Sync` automatically: `u64`, `usize`, `bool` and
// `CudaStream` are. The device memory itself is not Rust memory; who may touch it
// when is the engine's business (Semantics 8).

fn check_range(offset: usize, len: usize, size: usize) -> CudaResult<()> {
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(CudaError::OutOfBounds { offset, len, size }),
    }
}

impl DeviceBuffer {
    /// Allocates `bytes` (uninitialised) stream-ordered on `stream`.
    /// A zero-byte request allocates one byte so the pointer is valid and unique.
    pub fn alloc(stream: &CudaStream, bytes: usize) -> CudaResult<Self> {
        stream.device().bind_to_thread()?;
        // SAFETY: context current; stream alive. Freed by
        // `free_on`/`free_after`/`Drop`, exactly once (`freed` flag).
        let ptr =
            unsafe { result::malloc_async(stream.raw(), bytes.max(1)) }.named("cuMemAllocAsync")?;
        Ok(DeviceBuffer {
            ptr,
            bytes,
            home: stream.clone(),
            freed: false,
        })
    }

    /// Allocates and zero-fills (both queued on `stream`).
    pub fn zeroed(stream: &CudaStream, bytes: usize) -> CudaResult<Self> {
        let b = Self::alloc(stream, bytes)?;
        b.memset(stream, 0, bytes, 0)?;
        Ok(b)
    }

    /// Allocates on `stream` and uploads `data`; blocks until the upload is done.
    pub fn from_host<T: DeviceRepr>(stream: &CudaStream, data: &[T]) -> CudaResult<Self> {
        let b = Self::alloc(stream, std::mem::size_of_val(data))?;
        b.copy_from_host(stream, 0, data)?;
        Ok(b)
    }

    /// Size in bytes.
    #[inline]
    pub fn len_bytes(&self) -> usize {
        self.bytes
    }

    /// The device it lives on.
    #[inline]
    pub fn device(&self) -> &CudaDevice {
        self.home.device()
    }

    /// The stream it was allocated on (used by `Drop`).
    pub fn home_stream(&self) -> &CudaStream {
        &self.home
    }

    /// Base device address.
    #[inline]
    pub fn device_ptr(&self) -> DevicePtr {
        self.ptr
    }

    /// Device address of byte `offset`, checking that `offset..offset+len` fits.
    #[inline]
    pub fn ptr_at(&self, offset: usize, len: usize) -> CudaResult<DevicePtr> {
        check_range(offset, len, self.bytes)?;
        Ok(self.ptr + offset as u64)
    }

    /// Changes the stream `Drop` frees on (e.g. when ownership moves to another
    /// stream's tasks and the old home stream may be destroyed first).
    pub fn set_home_stream(&mut self, stream: &CudaStream) -> CudaResult<()> {
        self.device()
            .check_same(stream.device(), "new home stream")?;
        self.home = stream.clone();
        Ok(())
    }

    /// Frees stream-ordered on `stream`: the memory returns to the pool once the
    /// work queued on `stream` so far has completed.
    pub fn free_on(mut self, stream: &CudaStream) -> CudaResult<()> {
        self.device().check_same(stream.device(), "free stream")?;
        self.freed = true;
        free_async(self.device(), self.ptr, stream)
    }

    /// Semantics 7: makes `stream` wait on every event in `last_uses` (the
    /// last-use event of each stream that touched the buffer), then frees the
    /// buffer on `stream`. Nothing blocks on the host. If a wait fails the buffer
    /// is still freed on `stream` after a full stream synchronisation, so memory
    /// is never leaked or reused early; the error is returned.
    pub fn free_after(mut self, last_uses: &[&CudaEvent], stream: &CudaStream) -> CudaResult<()> {
        self.device().check_same(stream.device(), "free stream")?;
        self.freed = true;
        let mut first_err = None;
        for ev in last_uses {
            if let Err(e) = stream.wait_event(ev) {
                first_err.get_or_insert(e);
            }
        }
        if let Some(e) = first_err {
            // Fall back to the conservative order: wait for the whole device.
            let _ = self.device().synchronize();
            let _ = free_async(self.device(), self.ptr, stream);
            return Err(e);
        }
        free_async(self.device(), self.ptr, stream)
    }

    /// Queues `memset(ptr + offset, value, len)` on `stream` (asynchronous).
    pub fn memset(
        &self,
        stream: &CudaStream,
        offset: usize,
        len: usize,
        value: u8,
    ) -> CudaResult<()> {
        let dst = self.ptr_at(offset, len)?;
        self.device().check_same(stream.device(), "stream")?;
        stream.device().bind_to_thread()?;
        // SAFETY: range checked to lie inside this live allocation; stream alive.
        unsafe { result::memset_d8_async(dst, value, len, stream.raw()) }.named("cuMemsetD8Async")
    }

    /// Queues a fill of `count` 32-bit words starting at byte `offset` (4-aligned)
    /// with `bits` (e.g. `f32::to_bits(1.0)`).
    pub fn fill_u32(
        &self,
        stream: &CudaStream,
        offset: usize,
        count: usize,
        bits: u32,
    ) -> CudaResult<()> {
        if offset & 3 != 0 {
            return Err(CudaError::InvalidArgument(format!(
                "fill_u32 offset {offset} is not 4-aligned"
            )));
        }
        let dst = self.ptr_at(
            offset,
            count.checked_mul(4).ok_or(CudaError::OutOfBounds {
                offset,
                len: usize::MAX,
                size: self.bytes,
            })?,
        )?;
        self.device().check_same(stream.device(), "stream")?;
        stream.device().bind_to_thread()?;
        // SAFETY: range checked; 4-byte alignment holds because pool allocations
        // are at least 256-byte aligned and `offset` is a multiple of 4. (cudarc's
        // checked layer has no `cuMemsetD32Async`.)
        unsafe { drv::cuMemsetD32Async(dst, bits, count, stream.raw()) }
            .result()
            .named("cuMemsetD32Async")
    }

    /// Queues a device-to-device copy of `len` bytes from `src[src_offset..]` to
    /// `self[dst_offset..]` on `stream` (asynchronous).
    pub fn copy_from_device(
        &self,
        stream: &CudaStream,
        dst_offset: usize,
        src: &DeviceBuffer,
        src_offset: usize,
        len: usize,
    ) -> CudaResult<()> {
        let dst = self.ptr_at(dst_offset, len)?;
        let s = src.ptr_at(src_offset, len)?;
        self.device().check_same(stream.device(), "stream")?;
        self.device().check_same(src.device(), "source buffer")?;
        stream.device().bind_to_thread()?;
        // SAFETY: both ranges checked inside live allocations of this device.
        unsafe { result::memcpy_dtod_async(dst, s, len, stream.raw()) }.named("cuMemcpyDtoDAsync")
    }

    /// Uploads `src` to byte `offset`; queued on `stream`, then **blocks until
    /// `stream` is idle** (see the module docs for why).
    pub fn copy_from_host<T: DeviceRepr>(
        &self,
        stream: &CudaStream,
        offset: usize,
        src: &[T],
    ) -> CudaResult<()> {
        let len = std::mem::size_of_val(src);
        self.ptr_at(offset, len)?;
        self.device().check_same(stream.device(), "stream")?;
        // SAFETY: range checked; `src` stays borrowed until the stream sync below
        // returns, so the driver reads live, unmodified memory.
        unsafe { memcpy_htod_async(self.ptr + offset as u64, src.as_ptr().cast(), len, stream)? };
        stream.synchronize()
    }

    /// Downloads into `dst` from byte `offset`; queued on `stream`, then blocks
    /// until `stream` is idle.
    pub fn copy_to_host<T: DeviceRepr>(
        &self,
        stream: &CudaStream,
        offset: usize,
        dst: &mut [T],
    ) -> CudaResult<()> {
        let len = std::mem::size_of_val(dst);
        self.ptr_at(offset, len)?;
        self.device().check_same(stream.device(), "stream")?;
        // SAFETY: range checked; `dst` is exclusively borrowed until the stream
        // sync returns, and any bit pattern is a valid `T` (`DeviceRepr`).
        unsafe {
            memcpy_dtoh_async(
                dst.as_mut_ptr().cast(),
                self.ptr + offset as u64,
                len,
                stream,
            )?
        };
        stream.synchronize()
    }

    /// Downloads the whole buffer as `T`s (blocking, see [`copy_to_host`](Self::copy_to_host)).
    pub fn to_host_vec<T: DeviceRepr + Default>(&self, stream: &CudaStream) -> CudaResult<Vec<T>> {
        let n = self.bytes / std::mem::size_of::<T>();
        let mut v = vec![T::default(); n];
        self.copy_to_host(stream, 0, &mut v)?;
        Ok(v)
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if !self.freed {
            self.freed = true;
            if let Err(e) = free_async(self.home.device(), self.ptr, &self.home) {
                self.home.device().record_deferred(e);
            }
        }
    }
}

fn free_async(device: &CudaDevice, ptr: DevicePtr, stream: &CudaStream) -> CudaResult<()> {
    device.bind_to_thread()?;
    // SAFETY: `ptr` came from `cuMemAllocAsync` on this device and is freed exactly
    // once (callers set `freed` first); the stream is alive. Stream ordering makes
    // the memory reusable only after prior work on `stream` completes.
    unsafe { result::free_async(ptr, stream.raw()) }.named("cuMemFreeAsync")
}

/// Queues a host-to-device copy on `stream`.
///
/// # Safety
/// `src..src+bytes` must be readable host memory that stays alive and unmodified
/// until `stream` has executed the copy; `dst..dst+bytes` must be device memory
/// of the stream's device that no other stream accesses concurrently.
pub unsafe fn memcpy_htod_async(
    dst: DevicePtr,
    src: *const u8,
    bytes: usize,
    stream: &CudaStream,
) -> CudaResult<()> {
    stream.device().bind_to_thread()?;
    // SAFETY: forwarded to the caller's contract. (Raw call: cudarc's checked
    // `memcpy_htod_async` takes a slice, this takes a pointer and a length.)
    unsafe { drv::cuMemcpyHtoDAsync_v2(dst, src.cast(), bytes, stream.raw()) }
        .result()
        .named("cuMemcpyHtoDAsync")
}

/// Queues a device-to-host copy on `stream`.
///
/// # Safety
/// `dst..dst+bytes` must be writable host memory that stays alive and is neither
/// read nor written by the host until `stream` has executed the copy;
/// `src..src+bytes` must be device memory of the stream's device.
pub unsafe fn memcpy_dtoh_async(
    dst: *mut u8,
    src: DevicePtr,
    bytes: usize,
    stream: &CudaStream,
) -> CudaResult<()> {
    stream.device().bind_to_thread()?;
    // SAFETY: forwarded to the caller's contract. (Raw call, as in
    // `memcpy_htod_async`.)
    unsafe { drv::cuMemcpyDtoHAsync_v2(dst.cast(), src, bytes, stream.raw()) }
        .result()
        .named("cuMemcpyDtoHAsync")
}

/// Queues a device-to-device copy on `stream`.
///
/// # Safety
/// Both ranges must be device memory of the stream's device, alive until the copy
/// has run, and not accessed concurrently by other streams in conflicting ways.
pub unsafe fn memcpy_dtod_async(
    dst: DevicePtr,
    src: DevicePtr,
    bytes: usize,
    stream: &CudaStream,
) -> CudaResult<()> {
    stream.device().bind_to_thread()?;
    // SAFETY: forwarded to the caller's contract.
    unsafe { result::memcpy_dtod_async(dst, src, bytes, stream.raw()) }.named("cuMemcpyDtoDAsync")
}

/// Queues a byte memset on `stream`.
///
/// # Safety
/// `dst..dst+bytes` must be device memory of the stream's device, alive until the
/// memset has run.
pub unsafe fn memset_d8_async(
    dst: DevicePtr,
    value: u8,
    bytes: usize,
    stream: &CudaStream,
) -> CudaResult<()> {
    stream.device().bind_to_thread()?;
    // SAFETY: forwarded to the caller's contract.
    unsafe { result::memset_d8_async(dst, value, bytes, stream.raw()) }.named("cuMemsetD8Async")
}

/// Page-locked host memory (`cuMemHostAlloc`, portable): the staging area for
/// asynchronous copies. Zero-initialised.
pub struct PinnedHostBuffer {
    ptr: *mut u8,
    bytes: usize,
    device: CudaDevice,
}

// SAFETY: the allocation is owned exclusively by this value; access goes through
// `&self`/`&mut self` slices like a `Box<[u8]>`.
unsafe impl Send for PinnedHostBuffer {}
// SAFETY: `&PinnedHostBuffer` only gives shared `&[u8]` access.
unsafe impl Sync for PinnedHostBuffer {}

impl std::fmt::Debug for PinnedHostBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedHostBuffer")
            .field("bytes", &self.bytes)
            .finish()
    }
}

impl PinnedHostBuffer {
    /// Allocates `bytes` of pinned, zeroed host memory (usable with any context).
    pub fn new(device: &CudaDevice, bytes: usize) -> CudaResult<Self> {
        device.bind_to_thread()?;
        // SAFETY: context current. Freed in `Drop`.
        let p = unsafe { result::malloc_host(bytes.max(1), drv::CU_MEMHOSTALLOC_PORTABLE) }
            .named("cuMemHostAlloc")?;
        // SAFETY: the allocation is at least `bytes.max(1)` bytes and ours.
        unsafe { std::ptr::write_bytes(p.cast::<u8>(), 0, bytes.max(1)) };
        Ok(PinnedHostBuffer {
            ptr: p.cast(),
            bytes,
            device: device.clone(),
        })
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.bytes
    }

    /// True for a zero-byte buffer.
    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }

    /// Host pointer (for the `unsafe` async copies).
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr
    }

    /// Mutable host pointer (for the `unsafe` async copies).
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` is valid for `bytes` initialised bytes for our lifetime;
        // no `&mut` exists while `&self` is borrowed.
        unsafe { std::slice::from_raw_parts(self.ptr, self.bytes) }
    }

    /// The bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, with exclusive access through `&mut self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.bytes) }
    }
}

impl Drop for PinnedHostBuffer {
    fn drop(&mut self) {
        let r = self.device.bind_to_thread().and_then(|()| {
            // SAFETY: allocated by `cuMemHostAlloc`, freed once. The owner must not
            // drop it while an async copy using it is pending (the engine holds it
            // until the copy's completion event).
            unsafe { result::free_host(self.ptr.cast()) }.named("cuMemFreeHost")
        });
        if let Err(e) = r {
            self.device.record_deferred(e);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::event::EventKind;
    use super::*;

    #[test]
    fn upload_download_memset_free_after() {
        if !super::super::gpu_or_skip("memory::upload_download_memset_free_after") {
            return;
        }
        let dev = CudaDevice::open(0).unwrap();
        let s1 = CudaStream::compute(&dev).unwrap();
        let s2 = CudaStream::compute(&dev).unwrap();
        let data: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5).collect();
        let a = DeviceBuffer::from_host(&s1, &data).unwrap();
        assert_eq!(a.to_host_vec::<f32>(&s1).unwrap(), data);

        let b = DeviceBuffer::zeroed(&s1, 4000).unwrap();
        b.fill_u32(&s1, 16, 10, 2.0f32.to_bits()).unwrap();
        let v: Vec<f32> = b.to_host_vec(&s1).unwrap();
        assert_eq!(&v[..4], &[0.0; 4]);
        assert_eq!(&v[4..14], &[2.0; 10]);
        assert_eq!(v[14], 0.0);

        // Touched by two streams, freed after both last uses.
        let c = DeviceBuffer::alloc(&s1, 4000).unwrap();
        let e1 = CudaEvent::recorded(&s1, EventKind::Sync).unwrap();
        s2.wait_event(&e1).unwrap();
        c.copy_from_device(&s2, 0, &a, 0, 4000).unwrap();
        let e2 = CudaEvent::recorded(&s2, EventKind::Sync).unwrap();
        let e1b = CudaEvent::recorded(&s1, EventKind::Sync).unwrap();
        c.free_after(&[&e1b, &e2], &s1).unwrap();
        s1.synchronize().unwrap();

        assert!(matches!(
            a.ptr_at(3990, 20),
            Err(CudaError::OutOfBounds { .. })
        ));
        let stats = dev.pool_stats().unwrap();
        assert!(stats.used_current > 0 && stats.reserved_current >= stats.used_current);
        drop(a);
        drop(b);
        dev.synchronize().unwrap();
        assert!(dev.take_deferred_errors().is_empty());
    }

    #[test]
    fn pinned_async_roundtrip() {
        if !super::super::gpu_or_skip("memory::pinned_async_roundtrip") {
            return;
        }
        let dev = CudaDevice::open(0).unwrap();
        let s = CudaStream::compute(&dev).unwrap();
        let mut h = PinnedHostBuffer::new(&dev, 256).unwrap();
        for (i, b) in h.as_mut_slice().iter_mut().enumerate() {
            *b = i as u8;
        }
        let d = DeviceBuffer::alloc(&s, 256).unwrap();
        let mut back = PinnedHostBuffer::new(&dev, 256).unwrap();
        // SAFETY: both pinned buffers outlive the stream sync below.
        unsafe {
            memcpy_htod_async(d.device_ptr(), h.as_ptr(), 256, &s).unwrap();
            memcpy_dtoh_async(back.as_mut_ptr(), d.device_ptr(), 256, &s).unwrap();
        }
        s.synchronize().unwrap();
        assert_eq!(back.as_slice(), h.as_slice());
    }
}

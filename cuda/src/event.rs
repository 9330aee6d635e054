//! CUDA events: cross-stream waits, completion queries and device timing.
//!
//! Two kinds:
//!
//! * [`EventKind::Sync`] (`CU_EVENT_DISABLE_TIMING`): the cheapest event, for
//!   waits and completion only;
//! * [`EventKind::Timing`]: also carries a device timestamp, so
//!   [`CudaEvent::elapsed_ms`] works between two of them. A timing event can be
//!   waited on just like a sync event, so the engine records one timing event
//!   before and one after each task and uses the after-event for cross-stream
//!   waits too.
//!
//! # Pool protocol
//!
//! Creating an event costs a driver call (~1–2 µs); the engine needs two per
//! task. An [`EventPool`] keeps destroyed-by-drop events on a free list instead:
//! [`EventPool::acquire`] pops one (or creates one), and dropping the returned
//! [`CudaEvent`] pushes it back. An event returns to the pool only when its last
//! owner drops it, so an event the engine still holds (a vector-clock entry, a
//! pending span) is never handed out again and re-recorded under it.
//! Re-recording a returned event is safe for waits issued earlier:
//! `cuStreamWaitEvent` captures the event's state at the time of the call. The
//! free list is one `Mutex<Vec>`: acquire/release are a lock plus push/pop,
//! uncontended in practice (one dispatcher thread acquires; stream threads
//! release).
//!
//! # Timeline
//!
//! To place task spans from several streams on one time axis, the engine creates
//! a [`Timeline`] at start-up: it records a reference timing event and notes the
//! host clock. A span's start is `elapsed(reference, start_event)`. `elapsed`
//! returns `f32` milliseconds (≈0.5 µs resolution per CUDA's docs); far from the
//! reference the `f32` spacing grows (≈0.06 ms after 1000 s), so long runs should
//! re-anchor with [`Timeline::reanchor`] at a step boundary.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use cudarc::driver::{result, sys as drv};

use super::device::CudaDevice;
use super::error::{CudaResult, Named};
use super::stream::CudaStream;

// Both halves of a cross-stream wait live here, recording an event on a
// stream (below) and a stream waiting on one, so the stream module does not
// know events (no import cycle between the two).
impl CudaStream {
    /// Makes all future work on this stream wait until `event` (as last recorded)
    /// has completed. Asynchronous: the host does not block.
    #[inline]
    pub fn wait_event(&self, event: &CudaEvent) -> CudaResult<()> {
        self.device()
            .check_same(event.device(), "event waited on")?;
        self.device().bind_to_thread()?;
        // SAFETY: both handles are alive (borrowed) and belong to the current
        // context.
        unsafe {
            result::stream::wait_event(
                self.raw(),
                event.raw(),
                drv::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
        }
        .named("cuStreamWaitEvent")
    }
}

/// What an event can be used for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EventKind {
    /// Waits and queries only (`CU_EVENT_DISABLE_TIMING`).
    Sync,
    /// Waits, queries and [`CudaEvent::elapsed_ms`].
    Timing,
}

impl EventKind {
    fn flags(self) -> drv::CUevent_flags {
        match self {
            EventKind::Sync => drv::CUevent_flags::CU_EVENT_DISABLE_TIMING,
            EventKind::Timing => drv::CUevent_flags::CU_EVENT_DEFAULT,
        }
    }
}

/// An owned CUDA event (returned to its pool on drop, if it came from one).
pub struct CudaEvent {
    raw: drv::CUevent,
    kind: EventKind,
    device: CudaDevice,
    pool: Option<Arc<PoolInner>>,
}

// SAFETY: a `CUevent` is a driver handle usable from any thread on which its
// context is current; every method binds the context first. Recording and
// querying are internally synchronised by the driver.
unsafe impl Send for CudaEvent {}
// SAFETY: see `Send`; `&CudaEvent` only passes the immutable handle to the driver.
unsafe impl Sync for CudaEvent {}

impl std::fmt::Debug for CudaEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaEvent")
            .field("raw", &self.raw)
            .field("kind", &self.kind)
            .field("device", &self.device.ordinal())
            .field("pooled", &self.pool.is_some())
            .finish()
    }
}

fn create_raw(device: &CudaDevice, kind: EventKind) -> CudaResult<drv::CUevent> {
    device.bind_to_thread()?;
    result::event::create(kind.flags()).named("cuEventCreate")
}

fn destroy_raw(device: &CudaDevice, raw: drv::CUevent) {
    let r = device.bind_to_thread().and_then(|()| {
        // SAFETY: the caller owns `raw` and never uses it again. Destroying an
        // event whose recorded work is pending is allowed (released at completion).
        unsafe { result::event::destroy(raw) }.named("cuEventDestroy")
    });
    if let Err(e) = r {
        device.record_deferred(e);
    }
}

impl CudaEvent {
    /// Creates a standalone event (not pooled).
    pub fn new(device: &CudaDevice, kind: EventKind) -> CudaResult<Self> {
        Ok(CudaEvent {
            raw: create_raw(device, kind)?,
            kind,
            device: device.clone(),
            pool: None,
        })
    }

    /// Creates an event and records it on `stream` right away.
    pub fn recorded(stream: &CudaStream, kind: EventKind) -> CudaResult<Self> {
        let ev = Self::new(stream.device(), kind)?;
        ev.record(stream)?;
        Ok(ev)
    }

    /// Captures the work queued on `stream` so far; the event completes when
    /// that work has. Re-recording moves the capture point.
    #[inline]
    pub fn record(&self, stream: &CudaStream) -> CudaResult<()> {
        self.device
            .check_same(stream.device(), "stream recorded on")?;
        self.device.bind_to_thread()?;
        // SAFETY: event and stream alive and in the current context.
        unsafe { result::event::record(self.raw, stream.raw()) }.named("cuEventRecord")
    }

    /// Blocks the host until the recorded work is done.
    pub fn synchronize(&self) -> CudaResult<()> {
        self.device.bind_to_thread()?;
        // SAFETY: event alive.
        unsafe { result::event::synchronize(self.raw) }.named("cuEventSynchronize")
    }

    /// `Ok(true)` when the recorded work is done (or the event was never
    /// recorded), `Ok(false)` while it is pending.
    #[inline]
    pub fn query(&self) -> CudaResult<bool> {
        self.device.bind_to_thread()?;
        // SAFETY: event alive.
        match unsafe { result::event::query(self.raw) } {
            Err(e) if e.0 == drv::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            r => r.named("cuEventQuery").map(|()| true),
        }
    }

    /// Milliseconds from `start` to `end`, both [`EventKind::Timing`], both
    /// recorded and completed (on any streams of one device). An error
    /// `CUDA_ERROR_NOT_READY` ([`super::CudaError::is_not_ready`]) means one is
    /// still pending.
    pub fn elapsed_ms(start: &CudaEvent, end: &CudaEvent) -> CudaResult<f32> {
        if start.kind != EventKind::Timing || end.kind != EventKind::Timing {
            return Err(super::CudaError::InvalidArgument(
                "elapsed_ms needs two EventKind::Timing events".into(),
            ));
        }
        start.device.check_same(&end.device, "end event")?;
        start.device.bind_to_thread()?;
        // SAFETY: both events alive, timing-enabled, same context.
        unsafe { result::event::elapsed(start.raw, end.raw) }.named("cuEventElapsedTime")
    }

    /// Like [`elapsed_ms`](Self::elapsed_ms) but `Ok(None)` while pending.
    pub fn try_elapsed_ms(start: &CudaEvent, end: &CudaEvent) -> CudaResult<Option<f32>> {
        match Self::elapsed_ms(start, end) {
            Ok(ms) => Ok(Some(ms)),
            Err(e) if e.is_not_ready() => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// The raw handle (valid while `self` lives).
    #[inline]
    pub fn raw(&self) -> drv::CUevent {
        self.raw
    }

    /// Its kind.
    pub fn kind(&self) -> EventKind {
        self.kind
    }

    /// Its device.
    #[inline]
    pub fn device(&self) -> &CudaDevice {
        &self.device
    }
}

impl Drop for CudaEvent {
    fn drop(&mut self) {
        if let Some(pool) = self.pool.take() {
            if let Ok(mut free) = pool.free.lock() {
                if free.len() < pool.max_free {
                    free.push(self.raw);
                    return;
                }
            }
        }
        destroy_raw(&self.device, self.raw);
    }
}

/// A free list of events of one kind on one device. Clones share it.
#[derive(Clone)]
pub struct EventPool {
    inner: Arc<PoolInner>,
}

struct PoolInner {
    device: CudaDevice,
    kind: EventKind,
    max_free: usize,
    free: Mutex<Vec<drv::CUevent>>,
}

// SAFETY: the free list holds driver handles owned by the pool; see `CudaEvent`.
unsafe impl Send for PoolInner {}
// SAFETY: the only mutable state is behind the `Mutex`.
unsafe impl Sync for PoolInner {}

impl std::fmt::Debug for EventPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventPool")
            .field("device", &self.inner.device.ordinal())
            .field("kind", &self.inner.kind)
            .field("free", &self.free_len())
            .finish()
    }
}

impl EventPool {
    /// Default cap on idle events kept (beyond it, dropped events are destroyed).
    pub const DEFAULT_MAX_FREE: usize = 8192;

    /// An empty pool.
    pub fn new(device: &CudaDevice, kind: EventKind) -> Self {
        Self::with_capacity(device, kind, Self::DEFAULT_MAX_FREE)
    }

    /// An empty pool keeping at most `max_free` idle events.
    pub fn with_capacity(device: &CudaDevice, kind: EventKind, max_free: usize) -> Self {
        EventPool {
            inner: Arc::new(PoolInner {
                device: device.clone(),
                kind,
                max_free,
                free: Mutex::new(Vec::new()),
            }),
        }
    }

    /// Creates `n` idle events up front (off the hot path).
    pub fn prewarm(&self, n: usize) -> CudaResult<()> {
        let mut made = Vec::with_capacity(n);
        for _ in 0..n {
            made.push(create_raw(&self.inner.device, self.inner.kind)?);
        }
        self.inner
            .free
            .lock()
            .expect("event pool poisoned")
            .extend(made);
        Ok(())
    }

    /// An event from the free list, or a new one. Returned to the pool on drop.
    #[inline]
    pub fn acquire(&self) -> CudaResult<CudaEvent> {
        let reused = self.inner.free.lock().ok().and_then(|mut f| f.pop());
        let raw = match reused {
            Some(raw) => raw,
            None => create_raw(&self.inner.device, self.inner.kind)?,
        };
        Ok(CudaEvent {
            raw,
            kind: self.inner.kind,
            device: self.inner.device.clone(),
            pool: Some(self.inner.clone()),
        })
    }

    /// Acquires an event and records it on `stream`.
    #[inline]
    pub fn record(&self, stream: &CudaStream) -> CudaResult<CudaEvent> {
        let ev = self.acquire()?;
        ev.record(stream)?;
        Ok(ev)
    }

    /// Idle events currently held.
    pub fn free_len(&self) -> usize {
        self.inner.free.lock().map(|f| f.len()).unwrap_or(0)
    }

    /// The kind of event handed out.
    pub fn kind(&self) -> EventKind {
        self.inner.kind
    }
}

impl Drop for PoolInner {
    fn drop(&mut self) {
        let free = std::mem::take(self.free.get_mut().unwrap_or_else(|p| p.into_inner()));
        for raw in free {
            destroy_raw(&self.device, raw);
        }
    }
}

/// A common time axis for device spans: a reference timing event plus the host
/// instant at which it was recorded.
#[derive(Debug)]
pub struct Timeline {
    reference: CudaEvent,
    host_epoch: Instant,
}

impl Timeline {
    /// Records the reference event on `stream` now.
    pub fn start(stream: &CudaStream) -> CudaResult<Self> {
        let reference = CudaEvent::new(stream.device(), EventKind::Timing)?;
        let host_epoch = Instant::now();
        reference.record(stream)?;
        Ok(Timeline {
            reference,
            host_epoch,
        })
    }

    /// Re-records the reference on `stream` (call at a step boundary, after the
    /// spans of the previous step have been read).
    pub fn reanchor(&mut self, stream: &CudaStream) -> CudaResult<()> {
        self.host_epoch = Instant::now();
        self.reference.record(stream)
    }

    /// Milliseconds from the reference to `event` (a completed timing event).
    pub fn offset_ms(&self, event: &CudaEvent) -> CudaResult<f64> {
        CudaEvent::elapsed_ms(&self.reference, event).map(f64::from)
    }

    /// `(start_ms, duration_ms)` of a span bracketed by two completed timing events.
    pub fn span_ms(&self, start: &CudaEvent, end: &CudaEvent) -> CudaResult<(f64, f64)> {
        let s = self.offset_ms(start)?;
        let d = CudaEvent::elapsed_ms(start, end)?;
        Ok((s, f64::from(d)))
    }

    /// Host instant at which the reference was (approximately) recorded; lets
    /// host-side spans share the axis (offsets agree to within launch latency).
    pub fn host_epoch(&self) -> Instant {
        self.host_epoch
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_recycles_and_times() {
        if !super::super::gpu_or_skip("event::pool_recycles_and_times") {
            return;
        }
        let dev = CudaDevice::open(0).unwrap();
        let s = CudaStream::compute(&dev).unwrap();
        let pool = EventPool::new(&dev, EventKind::Timing);
        let tl = Timeline::start(&s).unwrap();
        let a = pool.record(&s).unwrap();
        let b = pool.record(&s).unwrap();
        let (raw_a, raw_b) = (a.raw(), b.raw());
        b.synchronize().unwrap();
        assert!(b.query().unwrap());
        let ms = CudaEvent::elapsed_ms(&a, &b).unwrap();
        assert!(ms >= 0.0);
        let (start, dur) = tl.span_ms(&a, &b).unwrap();
        assert!(start >= 0.0 && dur >= 0.0);
        drop(a);
        drop(b);
        assert_eq!(pool.free_len(), 2);
        let c = pool.acquire().unwrap();
        assert!(c.raw() == raw_a || c.raw() == raw_b);
        // Cross-stream wait on a timing event.
        let s2 = CudaStream::comm(&dev).unwrap();
        c.record(&s).unwrap();
        s2.wait_event(&c).unwrap();
        s2.synchronize().unwrap();
        // Sync events refuse timing.
        let x = CudaEvent::recorded(&s, EventKind::Sync).unwrap();
        assert!(CudaEvent::elapsed_ms(&x, &c).is_err());
    }
}

//! The one place the engine's concurrency primitives come from.
//!
//! Under `cfg(loom)` every primitive is loom's model-checked twin, so the small
//! concurrent pieces (gates, latches, the submission queue) can be checked
//! exhaustively with `RUSTFLAGS="--cfg loom" cargo test -p braid --lib loom`
//! (the CPU collectives' phase barrier among them, in `comm/local.rs`).

#[cfg(not(loom))]
pub(crate) use std::sync::{
    atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering},
    Arc, Condvar, Mutex, MutexGuard,
};

#[cfg(loom)]
pub(crate) use loom::sync::{
    atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering},
    Arc, Condvar, Mutex, MutexGuard,
};

#[cfg(not(loom))]
pub(crate) use std::sync::OnceLock;

/// loom has no `OnceLock`: this twin keeps std's API (`new`, `get`, `set`)
/// over a loom mutex, so loom sees the synchronisation a `set` and a `get`
/// perform. The value is boxed and, once set, never moved, replaced or
/// dropped before the cell, so `get` can hand out a reference that outlives
/// the lock.
#[cfg(loom)]
pub(crate) struct OnceLock<T> {
    cell: Mutex<Option<Box<T>>>,
}

#[cfg(loom)]
impl<T> OnceLock<T> {
    pub(crate) fn new() -> Self {
        OnceLock {
            cell: Mutex::new(None),
        }
    }

    pub(crate) fn get(&self) -> Option<&T> {
        let g = lock(&self.cell);
        let p: *const T = &**g.as_ref()?;
        drop(g);
        // SAFETY: the box behind `p` was set once and is never replaced nor
        // dropped while `self` lives (there is no `take`), so `p` stays valid
        // and unaliased by any `&mut` for the lifetime of `&self`.
        Some(unsafe { &*p })
    }

    pub(crate) fn set(&self, value: T) -> Result<(), T> {
        let mut g = lock(&self.cell);
        if g.is_some() {
            return Err(value);
        }
        *g = Some(Box::new(value));
        Ok(())
    }
}

/// Locks a mutex, ignoring poisoning: the engine never panics while holding one
/// of its own locks (task bodies run outside every lock), so a poisoned lock
/// still guards consistent data.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

/// Spins this many times before blocking on a condition variable.
#[cfg(not(loom))]
pub(crate) const SPIN: u32 = 64;
#[cfg(loom)]
pub(crate) const SPIN: u32 = 0;

#[inline]
pub(crate) fn spin_hint() {
    #[cfg(not(loom))]
    std::hint::spin_loop();
    #[cfg(loom)]
    loom::thread::yield_now();
}

thread_local! {
    /// This thread's spin-waits never yield (`set_no_yield`).
    static NO_YIELD: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Stops the calling thread's spin-waits from yielding: a thread of a
/// latency-critical program. A yield offers the core to any runnable
/// thread, and the scheduler gives it to a best-effort thread at the idle
/// policy if that is all there is, until its next tick (3–4 ms on the
/// development VM: the tail `multi_tenant` measured, docs/tenants.md);
/// after its spin the thread sleeps instead, and its wake-up preempts an
/// idle-policy thread at once.
pub(crate) fn set_no_yield() {
    NO_YIELD.with(|c| c.set(true));
}

/// Whether the calling thread's spin-waits yield.
pub(crate) fn yields() -> bool {
    !NO_YIELD.with(std::cell::Cell::get)
}

/// Turn `i` of a spin-wait: a pause, and every 64th turn a yield, so that
/// the thread being waited for can run on a machine with more busy threads
/// than cores (not in a thread of a latency-critical program:
/// [`set_no_yield`]).
#[inline]
pub(crate) fn spin_turn(i: u32) {
    if i % 64 == 63 && yields() {
        #[cfg(not(loom))]
        std::thread::yield_now();
    }
    spin_hint();
}

/// What a process-wide id numbers.
#[derive(Debug, Clone, Copy)]
pub(crate) enum IdKind {
    Runtime,
    Buffer,
}

/// The next process-wide id of `kind`, from 1. Plain std atomics even under
/// loom: statics need const constructors, and ids are part of no loom model.
pub(crate) fn next_id(kind: IdKind) -> u64 {
    static RUNTIMES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    static BUFFERS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    let counter = match kind {
        IdKind::Runtime => &RUNTIMES,
        IdKind::Buffer => &BUFFERS,
    };
    counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

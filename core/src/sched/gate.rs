//! `Gate`: a monotonically increasing counter that threads can wait on.
//!
//! Protocol. `value` only grows. A waiter first checks `value` (Acquire), spins
//! briefly, then registers in `waiters` (SeqCst), takes `lock` and re-checks
//! `value` (SeqCst) before sleeping on `cv`. An advancer stores `value`
//! (SeqCst) and then reads `waiters` (SeqCst); if any waiter is registered it
//! takes `lock` and notifies. Because both sides use SeqCst for the
//! store/load pair, either the advancer sees the registration (and notifies
//! under the lock, which the waiter holds while re-checking), or the waiter's
//! re-check sees the new value. No wake-up is lost, and the common case (no
//! waiter) costs the advancer one atomic store and one atomic load.

use crate::sync::{lock, spin_hint, AtomicU64, AtomicUsize, Condvar, Mutex, Ordering, SPIN};
use std::time::{Duration, Instant};

#[derive(Debug, Default)]
pub(crate) struct Gate {
    value: AtomicU64,
    waiters: AtomicUsize,
    lock: Mutex<()>,
    cv: Condvar,
}

impl Gate {
    pub(crate) fn get(&self) -> u64 {
        self.value.load(Ordering::Acquire)
    }

    /// Raises the value to `v` (never lowers it) and wakes waiters.
    pub(crate) fn advance_to(&self, v: u64) {
        self.value.fetch_max(v, Ordering::SeqCst);
        self.wake();
    }

    /// Adds `d` to the value and wakes waiters; returns the new value.
    pub(crate) fn add(&self, d: u64) -> u64 {
        let v = self.value.fetch_add(d, Ordering::SeqCst) + d;
        self.wake();
        v
    }

    fn wake(&self) {
        if self.waiters.load(Ordering::SeqCst) > 0 {
            let _g = lock(&self.lock);
            self.cv.notify_all();
        }
    }

    /// Blocks until the value is at least `target`.
    pub(crate) fn wait_at_least(&self, target: u64) {
        let ok = self.wait_inner(target, None);
        debug_assert!(ok);
    }

    /// Blocks until the value is at least `target` or `timeout` passes;
    /// returns whether the target was reached.
    #[cfg_attr(loom, allow(dead_code))]
    pub(crate) fn wait_at_least_for(&self, target: u64, timeout: Duration) -> bool {
        self.wait_inner(target, Some(Instant::now() + timeout))
    }

    fn wait_inner(&self, target: u64, deadline: Option<Instant>) -> bool {
        for _ in 0..SPIN {
            if self.get() >= target {
                return true;
            }
            spin_hint();
        }
        if self.get() >= target {
            return true;
        }
        self.waiters.fetch_add(1, Ordering::SeqCst);
        let mut g = lock(&self.lock);
        let reached = loop {
            if self.value.load(Ordering::SeqCst) >= target {
                break true;
            }
            match deadline {
                None => {
                    g = match self.cv.wait(g) {
                        Ok(g) => g,
                        Err(p) => p.into_inner(),
                    }
                }
                #[cfg(not(loom))]
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        break false;
                    }
                    g = match self.cv.wait_timeout(g, d - now) {
                        Ok((g, _)) => g,
                        Err(p) => p.into_inner().0,
                    }
                }
                #[cfg(loom)]
                Some(_) => unreachable!("loom models use untimed waits"),
            }
        };
        drop(g);
        self.waiters.fetch_sub(1, Ordering::SeqCst);
        reached
    }
}

//! `Gate`: a monotonically increasing counter that threads can wait on.
//!
//! Protocol. The counter lives in the low 63 bits of `word`; the top bit,
//! `SLEEPERS`, says that some thread may be asleep on `cv`. Both sides touch
//! `word` only with read-modify-write operations, so every access to it is
//! totally ordered (its modification order) without relying on `SeqCst`
//! between different atomics:
//!
//! * An advancer does `fetch_add` and, only if the value it replaced had
//!   `SLEEPERS` set, takes `lock` and notifies.
//! * A waiter checks the counter, then takes `lock`, counts itself in
//!   `sleepers` and sets `SLEEPERS` with `fetch_or`. If the value `fetch_or`
//!   returns already reaches the target, the advance happened first and it is
//!   done. Otherwise any later advance sees the bit and must take `lock`,
//!   which the waiter holds until `cv.wait` releases it, so the notification
//!   cannot be lost. The last sleeper to leave clears the bit under `lock`,
//!   so the common case (no sleeper) costs an advancer one atomic RMW.
//!
//! Checked by the loom models in `loom_tests.rs`.

use crate::sync::{lock, spin_hint, AtomicU64, Condvar, Mutex, Ordering, SPIN};

const SLEEPERS: u64 = 1 << 63;

#[derive(Debug, Default)]
pub(crate) struct Gate {
    word: AtomicU64,
    /// Threads asleep (or about to sleep) on `cv`; guarded by `lock`.
    lock: Mutex<usize>,
    cv: Condvar,
}

impl Gate {
    pub(crate) fn get(&self) -> u64 {
        self.word.load(Ordering::Acquire) & !SLEEPERS
    }

    /// Adds `d` to the counter and wakes sleepers; returns the new value.
    pub(crate) fn add(&self, d: u64) -> u64 {
        let prev = self.word.fetch_add(d, Ordering::AcqRel);
        if prev & SLEEPERS != 0 {
            let _g = lock(&self.lock);
            self.cv.notify_all();
        }
        (prev & !SLEEPERS) + d
    }

    /// Blocks until the counter is at least `target`.
    pub(crate) fn wait_at_least(&self, target: u64) {
        for _ in 0..SPIN {
            if self.get() >= target {
                return;
            }
            spin_hint();
        }
        if self.get() >= target {
            return;
        }
        let mut sleepers = lock(&self.lock);
        *sleepers += 1;
        while self.word.fetch_or(SLEEPERS, Ordering::AcqRel) & !SLEEPERS < target {
            sleepers = match self.cv.wait(sleepers) {
                Ok(g) => g,
                Err(p) => p.into_inner(),
            };
        }
        *sleepers -= 1;
        if *sleepers == 0 {
            self.word.fetch_and(!SLEEPERS, Ordering::AcqRel);
        }
    }
}

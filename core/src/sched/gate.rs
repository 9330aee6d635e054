//! `Gate`: a monotonically increasing counter that threads can wait on.
//!
//! Protocol. The counter lives in the low 63 bits of `word`; the top bit,
//! `SLEEPERS`, says that some thread may be asleep on `cv`. Both sides touch
//! `word` only with read-modify-write operations, so every access to it is
//! totally ordered (its modification order) without relying on `SeqCst`
//! between different atomics:
//!
//! * A waiter checks the counter, then takes `lock`, counts itself in
//!   `sleepers`, lowers `wake_at` to its target (the lowest target of the
//!   threads asleep) and sets `SLEEPERS` with `fetch_or`. If the value
//!   `fetch_or` returns already reaches the target, the advance happened first
//!   and it is done. Otherwise it sleeps; the last sleeper to leave clears the
//!   bit and `wake_at` under `lock`.
//! * An advancer does `fetch_add` and, only if the value it replaced had
//!   `SLEEPERS` set *and* the new value reaches `wake_at`, takes `lock`, resets
//!   `wake_at` and notifies everyone; each woken waiter that is not done
//!   registers its target again before sleeping. So a waiter is woken once,
//!   when its target is reached, not by every advance on the way (a stream
//!   waiting for another stream's task 500 tasks ahead, or the submitter
//!   waiting for half the launch window to drain, used to be woken by each
//!   completion), and the common case (no sleeper) costs an advancer one
//!   atomic RMW.
//!
//! Why no wake-up is lost: a waiter writes `wake_at` before its `fetch_or`
//! (both under `lock`). An advance ordered after that `fetch_or` reads, through
//! the release sequence on `word`, a `wake_at` at most the waiter's target,
//! unless a notification has reset it since — and then the waiter was woken
//! and checks again under `lock`. An advance ordered before the `fetch_or` is
//! seen in the value `fetch_or` returns.
//!
//! Checked by the loom models in `loom_tests.rs`.

use crate::sync::{lock, spin_turn, AtomicU64, Condvar, Mutex, Ordering, SPIN};

const SLEEPERS: u64 = 1 << 63;

#[derive(Debug)]
pub(crate) struct Gate {
    word: AtomicU64,
    /// The lowest target of the threads asleep (`u64::MAX`: none); written
    /// only under `lock`.
    wake_at: AtomicU64,
    /// Threads asleep (or about to sleep) on `cv`; guarded by `lock`.
    lock: Mutex<usize>,
    cv: Condvar,
}

impl Default for Gate {
    fn default() -> Self {
        Gate {
            word: AtomicU64::new(0),
            wake_at: AtomicU64::new(u64::MAX),
            lock: Mutex::new(0),
            cv: Condvar::new(),
        }
    }
}

impl Gate {
    pub(crate) fn get(&self) -> u64 {
        self.word.load(Ordering::Acquire) & !SLEEPERS
    }

    /// Adds `d` to the counter and wakes sleepers; returns the new value.
    pub(crate) fn add(&self, d: u64) -> u64 {
        let prev = self.word.fetch_add(d, Ordering::AcqRel);
        let new = (prev & !SLEEPERS) + d;
        if prev & SLEEPERS != 0 && new >= self.wake_at.load(Ordering::Acquire) {
            let _g = lock(&self.lock);
            self.wake_at.store(u64::MAX, Ordering::Release);
            self.cv.notify_all();
        }
        new
    }

    /// Blocks until the counter is at least `target`: spins first (yielding
    /// every 64 turns, so a thread it waits for can run on a busy machine),
    /// then sleeps. A futex wake-up costs ~30 µs on the development VM (an
    /// inter-processor interrupt through the hypervisor): a chain pinned
    /// alternately to two streams took 29.7 µs per task with 64 spins and
    /// 1.0 µs with 2,048 (`dag_overhead --shape pingpong`, paired), while the
    /// other shapes and GPT-2 on CPU ranks stayed within noise.
    pub(crate) fn wait_at_least(&self, target: u64) {
        for i in 0..SPIN * 32 {
            if self.get() >= target {
                return;
            }
            spin_turn(i);
        }
        if self.get() >= target {
            return;
        }
        let mut sleepers = lock(&self.lock);
        *sleepers += 1;
        loop {
            let lowest = self.wake_at.load(Ordering::Acquire).min(target);
            self.wake_at.store(lowest, Ordering::Release);
            if self.word.fetch_or(SLEEPERS, Ordering::AcqRel) & !SLEEPERS >= target {
                break;
            }
            sleepers = match self.cv.wait(sleepers) {
                Ok(g) => g,
                Err(p) => p.into_inner(),
            };
        }
        *sleepers -= 1;
        if *sleepers == 0 {
            self.word.fetch_and(!SLEEPERS, Ordering::AcqRel);
            self.wake_at.store(u64::MAX, Ordering::Release);
        }
    }
}

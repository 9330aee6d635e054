//! `Queue`: the FIFO between submitters and one stream thread.
//!
//! Protocol. Producers push under `inner`'s lock and notify `cv` only when the
//! consumer has said it is asleep (`sleeping`, written under the same lock, so
//! no flag race exists). The single consumer takes the whole backlog at once
//! (`pop_batch` swaps the deque out), so the lock is taken once per batch, not
//! once per task. `close` marks the queue closed; the consumer drains what is
//! left and then gets `false`. Items are delivered in push order.

use crate::sync::{lock, spin_turn, AtomicU64, Condvar, Mutex, Ordering};
use std::collections::VecDeque;

#[derive(Debug)]
struct Inner<T> {
    items: VecDeque<T>,
    closed: bool,
    sleeping: bool,
}

#[derive(Debug)]
pub(crate) struct Queue<T> {
    inner: Mutex<Inner<T>>,
    cv: Condvar,
    pushed: AtomicU64,
}

/// Spin iterations before the consumer sleeps (a few µs, yielding every 64).
#[cfg(not(loom))]
const IDLE_SPIN: u32 = 500;
#[cfg(loom)]
const IDLE_SPIN: u32 = 0;

impl<T> Queue<T> {
    pub(crate) fn new() -> Self {
        Queue {
            inner: Mutex::new(Inner {
                items: VecDeque::new(),
                closed: false,
                sleeping: false,
            }),
            cv: Condvar::new(),
            pushed: AtomicU64::new(0),
        }
    }

    pub(crate) fn push(&self, item: T) {
        let mut g = lock(&self.inner);
        g.items.push_back(item);
        self.pushed.fetch_add(1, Ordering::Release);
        if g.sleeping {
            g.sleeping = false;
            drop(g);
            self.cv.notify_one();
        }
    }

    pub(crate) fn close(&self) {
        let mut g = lock(&self.inner);
        g.closed = true;
        drop(g);
        self.cv.notify_one();
    }

    /// Like [`Queue::pop_batch`], but gives up after `timeout` with an empty
    /// `out` (returning `true`: the queue is still open).
    #[cfg(not(loom))]
    pub(crate) fn pop_batch_timeout(
        &self,
        out: &mut VecDeque<T>,
        timeout: std::time::Duration,
    ) -> bool {
        debug_assert!(out.is_empty());
        let mut g = lock(&self.inner);
        if g.items.is_empty() && !g.closed {
            g.sleeping = true;
            g = match self.cv.wait_timeout(g, timeout) {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
        }
        if !g.items.is_empty() {
            std::mem::swap(&mut g.items, out);
            return true;
        }
        !g.closed
    }

    /// Under loom: a non-blocking poll (loom models no timed waits).
    #[cfg(loom)]
    pub(crate) fn pop_batch_timeout(&self, out: &mut VecDeque<T>, _: std::time::Duration) -> bool {
        let mut g = lock(&self.inner);
        if !g.items.is_empty() {
            std::mem::swap(&mut g.items, out);
            return true;
        }
        !g.closed
    }

    /// Moves every queued item into `out` (which must be empty), blocking while
    /// the queue is empty. Returns `false` once the queue is closed and drained.
    pub(crate) fn pop_batch(&self, out: &mut VecDeque<T>) -> bool {
        debug_assert!(out.is_empty());
        let mut g = lock(&self.inner);
        loop {
            if !g.items.is_empty() {
                std::mem::swap(&mut g.items, out);
                return true;
            }
            if g.closed {
                return false;
            }
            // Spin without the lock for a little while before sleeping.
            let seen = self.pushed.load(Ordering::Acquire);
            drop(g);
            let mut more = false;
            for i in 0..IDLE_SPIN {
                if self.pushed.load(Ordering::Acquire) != seen {
                    more = true;
                    break;
                }
                spin_turn(i);
            }
            g = lock(&self.inner);
            if more || !g.items.is_empty() || g.closed {
                continue;
            }
            g.sleeping = true;
            g = match self.cv.wait(g) {
                Ok(g) => g,
                Err(p) => p.into_inner(),
            };
        }
    }
}

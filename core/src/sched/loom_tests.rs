//! loom models of the small concurrent core: the gate (event latch and
//! completion counter), the stream queue, and task status publication.
//! Run with `RUSTFLAGS="--cfg loom" cargo test -p braid --lib loom --release`.

use super::gate::Gate;
use super::queue::Queue;
use crate::sync::{Arc, AtomicU64, Ordering};
use loom::thread;
use std::collections::VecDeque;

#[test]
fn loom_gate_wakes_waiter() {
    loom::model(|| {
        let g = Arc::new(Gate::default());
        let g2 = g.clone();
        let t = thread::spawn(move || {
            g2.add(1);
        });
        g.wait_at_least(1);
        assert!(g.get() >= 1);
        t.join().unwrap();
    });
}

#[test]
fn loom_gate_two_advancers_two_targets() {
    loom::model(|| {
        let g = Arc::new(Gate::default());
        let (a, b) = (g.clone(), g.clone());
        let t1 = thread::spawn(move || {
            a.add(1);
        });
        let t2 = thread::spawn(move || {
            b.wait_at_least(1);
            b.add(1);
        });
        g.wait_at_least(2);
        assert_eq!(g.get(), 2);
        t1.join().unwrap();
        t2.join().unwrap();
    });
}

#[test]
fn loom_queue_delivers_in_order_then_closes() {
    // The consumer re-checks under the lock after its (lock-free) idle check,
    // which doubles the lock operations: allow more branches than the default.
    let mut model = loom::model::Builder::new();
    model.max_branches = 100_000;
    model.check(|| {
        let q = Arc::new(Queue::new());
        let p = q.clone();
        let t = thread::spawn(move || {
            p.push(1);
            p.push(2);
            p.close();
        });
        let mut got = Vec::new();
        let mut batch = VecDeque::new();
        while q.pop_batch(&mut batch) {
            got.extend(batch.drain(..));
        }
        assert_eq!(got, vec![1, 2]);
        t.join().unwrap();
    });
}

/// The stream-thread protocol in miniature: a producer publishes a value then
/// advances the stream's gate; a dependent on another thread waits on the
/// gate and must see the value (the event's happens-before edge).
#[test]
fn loom_completion_publishes_data() {
    loom::model(|| {
        let data = Arc::new(AtomicU64::new(0));
        let g = Arc::new(Gate::default());
        let (d2, g2) = (data.clone(), g.clone());
        let t = thread::spawn(move || {
            d2.store(42, Ordering::Relaxed);
            g2.add(1);
        });
        g.wait_at_least(1);
        assert_eq!(data.load(Ordering::Relaxed), 42);
        t.join().unwrap();
    });
}

/// Two sleepers with different targets and an advancer that passes the lower
/// one first: the advance that reaches only the lower target must not strand
/// the higher one (`wake_at` is re-registered after every notification).
#[test]
fn loom_gate_wakes_each_waiter_at_its_target() {
    // Three threads and two advances: bound the preemptions (loom's usual
    // remedy; three covers every wake-up race here) to keep it to seconds.
    let mut model = loom::model::Builder::new();
    model.preemption_bound = Some(3);
    model.check(|| {
        let g = Arc::new(Gate::default());
        let (a, b) = (g.clone(), g.clone());
        let adv = thread::spawn(move || {
            a.add(1);
            a.add(1);
        });
        let low = thread::spawn(move || {
            b.wait_at_least(1);
            assert!(b.get() >= 1);
        });
        g.wait_at_least(2);
        assert_eq!(g.get(), 2);
        adv.join().unwrap();
        low.join().unwrap();
    });
}

/// A busy period stays open while a task is submitted and not completed,
/// however a submission and the completion of the task before it
/// interleave (decided on counts read outside a common lock, a completion
/// that found the runtime idle closed the period while the submission
/// found it busy, and the next step ran outside any period).
#[test]
fn loom_busy_period_covers_a_racing_submission() {
    use super::live::Busy;
    use crate::sync::Mutex;
    loom::model(|| {
        // One task submitted, none completed, its period open.
        let submitted = Arc::new(AtomicU64::new(1));
        let completed = Arc::new(AtomicU64::new(0));
        let busy = Arc::new(Mutex::new(Busy::default()));
        busy.lock().unwrap().submitted(0, 0, 1);
        let (s, c, b) = (submitted.clone(), completed.clone(), busy.clone());
        let worker = thread::spawn(move || {
            let done = c.fetch_add(1, Ordering::AcqRel) + 1;
            if done == s.load(Ordering::Acquire) {
                let mut busy = b.lock().unwrap();
                busy.completed(done, s.load(Ordering::Acquire), 7);
            }
        });
        let before = submitted.fetch_add(1, Ordering::AcqRel);
        {
            let mut b = busy.lock().unwrap();
            b.submitted(before, completed.load(Ordering::Acquire), 5);
        }
        worker.join().unwrap();
        // The second task is submitted and not completed: a period is open.
        let b = busy.lock().unwrap();
        assert!(b.open(), "periods {:?}", b.periods);
        assert!(b.periods.len() <= 1);
    });
}

//! Short tasks run on the submitting thread (`RuntimeBuilder::inline_short_tasks`):
//! only where that cannot be told apart from the stream's thread running
//! them — same results, same order on the stream, never beside a task they
//! conflict with.

use braid::{BackendKind, Runtime, RuntimeBuilder};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::ThreadId;

fn cpu(inline: bool) -> RuntimeBuilder {
    Runtime::builder()
        .backend(BackendKind::Cpu)
        .compute_streams(2)
        .oversubscribe(true)
        .inline_short_tasks(inline)
}

/// A chain of short increments: with inline tasks on, once the name is
/// measured as short (and the stream found idle once), bodies run on the
/// submitting thread and the counter still sees every increment in order;
/// off, every body runs on a stream thread. Either way the result is the
/// sequential program's.
#[test]
fn a_short_chain_runs_on_the_submitting_thread_with_the_same_result() {
    const N: u32 = 2_000;
    for inline in [true, false] {
        let rt = cpu(inline).build().unwrap();
        let x = rt.alloc_from("x", &[0u32]).unwrap();
        let threads = Arc::new(Mutex::new(Vec::<ThreadId>::new()));
        let before = rt.stats();
        for i in 0..N {
            if i % 100 == 0 {
                // The stream idle (and from the second time on the name
                // measured): the next task finds its predecessor done and
                // its stream idle, and a chain run inline stays inline until
                // a slow sample (a busy machine) lifts the estimate.
                rt.synchronize().unwrap();
            }
            let t = threads.clone();
            rt.task("tick")
                .run(x.read_write::<u32>(), move |v| {
                    assert_eq!(v[0], i, "increment {i} saw {}", v[0]);
                    v[0] += 1;
                    t.lock().unwrap().push(std::thread::current().id());
                })
                .unwrap();
        }
        rt.synchronize().unwrap();
        let stats = rt.stats();
        assert_eq!(rt.read_vec::<u32>(&x).unwrap(), [N]);
        let me = std::thread::current().id();
        let here = threads.lock().unwrap().iter().filter(|&&t| t == me).count();
        assert_eq!(stats.tasks - before.tasks, u64::from(N));
        if inline {
            // An increment is far under `braid::INLINE_MAX_NS` on any machine that
            // runs these tests (how many run inline is the benchmark's
            // business: dag_overhead prints `inline=`).
            assert!(
                here > 0 && stats.inline - before.inline == here as u64,
                "{here} of {N} bodies on the submitting thread, stats say {}",
                stats.inline
            );
        } else {
            assert_eq!((here, stats.inline), (0, 0));
        }
    }
}

/// A task its submitter runs inline holds its stream: a conflicting task
/// that another thread submits meanwhile goes to the stream's queue (its
/// predecessor is not done), and the stream's thread must not start it
/// before the inline one ends. The inline body here is long on purpose (the
/// estimate, from earlier runs of the name, is short), so the two would
/// overlap if the stream's thread did not wait.
#[test]
fn a_stream_never_runs_a_task_beside_the_inline_one_before_it() {
    let rt = cpu(true).build().unwrap();
    let x = rt.alloc_from("x", &[0u32]).unwrap();
    let mut expected = 0u32;
    // Attempts until the long task did run inline (it does unless a busy
    // machine made the name's estimate long); every attempt must be exact.
    for attempt in 0.. {
        for _ in 0..50 {
            rt.task("tick")
                .on_stream(0)
                .run(x.read_write::<u32>(), |v| v[0] += 1)
                .unwrap();
        }
        rt.synchronize().unwrap();
        let before = rt.stats().inline;
        let busy = Arc::new(AtomicBool::new(false));
        let started = Arc::new(AtomicBool::new(false));
        let overlaps = Arc::new(AtomicUsize::new(0));
        std::thread::scope(|s| {
            s.spawn(|| {
                while !started.load(Ordering::SeqCst) {
                    std::thread::yield_now();
                }
                let (busy, overlaps) = (busy.clone(), overlaps.clone());
                rt.task("tick")
                    .on_stream(0)
                    .run(x.read_write::<u32>(), move |v| {
                        if busy.load(Ordering::SeqCst) {
                            overlaps.fetch_add(1, Ordering::SeqCst);
                        }
                        v[0] *= 2;
                    })
                    .unwrap();
            });
            let (b, st) = (busy.clone(), started.clone());
            rt.task("tick")
                .on_stream(0)
                .run(x.read_write::<u32>(), move |v| {
                    b.store(true, Ordering::SeqCst);
                    st.store(true, Ordering::SeqCst);
                    std::thread::sleep(std::time::Duration::from_millis(50));
                    v[0] += 1;
                    b.store(false, Ordering::SeqCst);
                })
                .unwrap();
        });
        rt.synchronize().unwrap();
        assert_eq!(
            overlaps.load(Ordering::SeqCst),
            0,
            "a task ran beside the inline one"
        );
        // The increments, the long one, then the doubling: program order.
        expected = (expected + 50 + 1) * 2;
        assert_eq!(rt.read_vec::<u32>(&x).unwrap(), [expected]);
        if rt.stats().inline == before + 1 {
            break;
        }
        // (10 attempts were not always enough on a loaded 2-core machine.)
        assert!(
            attempt < 40,
            "the long task never ran inline: {:?}",
            rt.stats()
        );
    }
}

/// A task that fails inline is reported like any other: its error at the
/// next synchronisation point, its dependents skipped.
#[test]
fn an_inline_failure_is_reported_and_skips_its_dependents() {
    let rt = cpu(true).build().unwrap();
    let x = rt.alloc_from("x", &[0u32]).unwrap();
    // Attempts until the failing task ran inline (see the test above).
    for attempt in 0.. {
        for _ in 0..50 {
            rt.task("maybe fail")
                .run(x.read_write::<u32>(), |v| v[0] += 1)
                .unwrap();
        }
        rt.synchronize().unwrap();
        let before = rt.stats().inline;
        let failed = rt
            .task("maybe fail")
            .run(x.read_write::<u32>(), |_| -> Result<(), braid::TaskError> {
                Err("inline failure".into())
            })
            .unwrap();
        let ran_inline = rt.stats().inline == before + 1;
        let after = rt
            .task("after")
            .run(x.read_write::<u32>(), |v| v[0] += 100)
            .unwrap();
        let e = rt.synchronize().unwrap_err().to_string();
        assert!(
            e.contains("inline failure") && e.contains("maybe fail"),
            "{e}"
        );
        assert!(failed.is_done() && after.is_done());
        assert!(after.wait().is_err(), "a dependent of the failed task ran");
        assert_eq!(rt.read_vec::<u32>(&x).unwrap(), [50 * (attempt + 1)]);
        if ran_inline {
            break;
        }
        assert!(attempt < 10, "the failing task never ran inline");
    }
}

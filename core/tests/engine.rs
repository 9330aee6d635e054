//! The engine's contract: ordering, overlap, errors, misuse, back-pressure.

mod common;

use braid::{BackendKind, Error, Policy, Runtime, TaskKind};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

fn rt(streams: usize) -> Runtime {
    common::cpu_runtime(streams, Policy::Affinity)
}

fn profiled(streams: usize, policy: Policy) -> Runtime {
    Runtime::builder()
        .backend(BackendKind::Cpu)
        .compute_streams(streams)
        .policy(policy)
        .profile(true)
        .build()
        .unwrap()
}

/// Two independent long tasks on two streams run at the same time: the trace
/// shows both streams busy at once and the wall time under the sum of the
/// durations (both read from the recorded spans).
#[test]
fn independent_tasks_overlap_in_the_trace() {
    let rt = profiled(2, Policy::Affinity);
    let a = rt.alloc("a", 4).unwrap();
    let b = rt.alloc("b", 4).unwrap();
    for buf in [&a, &b] {
        rt.task("long")
            .write(buf)
            .run_ctx(|_| {
                std::thread::sleep(Duration::from_millis(150));
                Ok(())
            })
            .unwrap();
    }
    rt.synchronize().unwrap();
    let prof = rt.profile();
    let long: Vec<_> = prof.spans.iter().filter(|s| s.name == "long").collect();
    assert_eq!(long.len(), 2);
    assert_ne!(
        long[0].stream, long[1].stream,
        "independent tasks share a stream"
    );
    let (x, y) = (long[0], long[1]);
    assert!(
        x.start_ns < y.end_ns && y.start_ns < x.end_ns,
        "spans do not intersect"
    );
    let s = prof.summary();
    let sum: u64 = long.iter().map(|s| s.end_ns - s.start_ns).sum();
    assert!(s.overlap_ns > 0);
    assert!(s.wall_ns < sum, "wall {} >= sum {}", s.wall_ns, sum);
}

/// With the single policy the same program is serial: the baseline.
#[test]
fn single_policy_never_overlaps() {
    let rt = profiled(4, Policy::Single);
    for i in 0..4 {
        let b = rt.alloc(format!("b{i}"), 4).unwrap();
        rt.task("t")
            .write(&b)
            .run_ctx(|_| {
                std::thread::sleep(Duration::from_millis(5));
                Ok(())
            })
            .unwrap();
    }
    rt.synchronize().unwrap();
    let s = rt.profile().summary();
    assert_eq!(s.overlap_ns, 0);
    assert_eq!(s.streams[0].tasks, 4);
}

#[test]
fn failing_task_skips_dependents_and_runtime_stays_usable() {
    for streams in 1..=4 {
        let rt = rt(streams);
        let x = rt.alloc("x", 16).unwrap();
        let y = rt.alloc("y", 16).unwrap();
        let ran = Arc::new(AtomicUsize::new(0));
        rt.task("bad")
            .write(&x)
            .run_ctx(|_| Err("disk on fire".into()))
            .unwrap();
        let r = ran.clone();
        let dep = rt
            .task("dependent")
            .read(&x)
            .write(&y)
            .run_ctx(move |_| {
                r.fetch_add(1, Ordering::SeqCst);
                Ok(())
            })
            .unwrap();
        // Independent work still runs.
        let z = rt.alloc("z", 4).unwrap();
        let ok = rt
            .task("independent")
            .write(&z)
            .run_ctx(|_| Ok(()))
            .unwrap();
        let e = rt.synchronize().unwrap_err();
        assert!(
            matches!(&e, Error::TaskFailed { task, message } if task == "bad" && message == "disk on fire"),
            "{e}"
        );
        assert!(e.to_string().contains("bad"));
        assert_eq!(
            ran.load(Ordering::SeqCst),
            0,
            "dependent of a failed task ran"
        );
        assert!(
            matches!(dep.wait(), Err(Error::DependencyFailed { task, cause }) if task == "dependent" && cause == "bad")
        );
        ok.wait().unwrap();
        // Reported once; afterwards the runtime works, the buffer included.
        rt.synchronize().unwrap();
        rt.upload(&x, &[1u32, 2, 3, 4]).unwrap();
        assert_eq!(rt.read_vec::<u32>(&x).unwrap(), vec![1, 2, 3, 4]);
    }
}

#[test]
fn panicking_task_is_an_error_naming_it() {
    let rt = rt(2);
    let x = rt.alloc("x", 4).unwrap();
    let h = rt
        .task("boom")
        .write(&x)
        .run_ctx(|_| panic!("kaboom {}", 7))
        .unwrap();
    let e = h.wait().unwrap_err();
    assert_eq!(
        e,
        Error::TaskPanicked {
            task: "boom".into(),
            message: "kaboom 7".into()
        }
    );
    // Reported by the handle: not again at synchronize.
    rt.synchronize().unwrap();
    rt.task("after")
        .write(&x)
        .run_ctx(|_| Ok(()))
        .unwrap()
        .wait()
        .unwrap();
}

#[test]
fn several_failures_are_all_reported() {
    let rt = rt(2);
    for i in 0..3 {
        let b = rt.alloc(format!("b{i}"), 4).unwrap();
        rt.task(format!("f{i}"))
            .write(&b)
            .run_ctx(|_| Err("no".into()))
            .unwrap();
    }
    match rt.synchronize().unwrap_err() {
        Error::Many(v) => assert_eq!(v.len(), 3),
        e => panic!("expected three errors, got {e}"),
    }
}

#[test]
fn undeclared_and_wrong_mode_access_fail_the_task() {
    let rt = rt(2);
    let x = rt.alloc("x", 16).unwrap();
    let y = rt.alloc("y", 16).unwrap();
    let (yy, xx) = (y.clone(), x.clone());
    rt.task("sneaky")
        .read(&x)
        .run_ctx(move |ctx| {
            ctx.read::<f32>(&yy)?;
            Ok(())
        })
        .unwrap();
    let e = rt.synchronize().unwrap_err();
    assert!(
        e.to_string().contains("sneaky") && e.to_string().contains("without declaring"),
        "{e}"
    );
    rt.task("reader-writes")
        .read(&x)
        .run_ctx(move |ctx| {
            ctx.write::<f32>(&xx)?;
            Ok(())
        })
        .unwrap();
    assert!(rt.synchronize().is_err());
    // A view beyond the declared one is undeclared too.
    let part = x.view(0..8).unwrap();
    let whole = x.clone();
    rt.task("too-far")
        .read(&part)
        .run_ctx(move |ctx| {
            ctx.read::<u8>(&whole)?;
            Ok(())
        })
        .unwrap();
    assert!(rt.synchronize().is_err());
}

#[test]
fn aliasing_borrows_are_refused() {
    let rt = rt(1);
    let x = rt.alloc("x", 16).unwrap();
    let xx = x.clone();
    let h = rt
        .task("alias")
        .read_write(&x)
        .run_ctx(move |ctx| {
            let _a = ctx.write::<u32>(&xx)?;
            let _b = ctx.read::<u32>(&xx)?;
            Ok(())
        })
        .unwrap();
    assert!(
        matches!(h.wait(), Err(Error::TaskFailed { message, .. }) if message.contains("twice"))
    );
}

#[test]
fn misuse_is_an_error_at_submission() {
    let a = rt(1);
    let b = rt(1);
    let x = a.alloc("x", 8).unwrap();
    assert!(matches!(x.view(4..12), Err(Error::ViewOutOfBounds { .. })));
    assert!(matches!(
        x.view_of::<f32>(1..3),
        Err(Error::ViewOutOfBounds { .. })
    ));
    let e = b.task("t").read(&x).run_ctx(|_| Ok(())).unwrap_err();
    assert!(matches!(e, Error::ForeignBuffer { .. }), "{e}");
    let e = a.task("t").on_stream(9).run_ctx(|_| Ok(())).unwrap_err();
    assert!(e.to_string().contains("stream 9"));
    assert!(Runtime::builder().compute_streams(0).build().is_err());
    let y = a.alloc("y", 6).unwrap();
    assert!(matches!(
        a.read_vec::<f32>(&y),
        Err(Error::Misaligned { .. })
    ));
}

#[test]
fn waiting_inside_a_task_is_an_error_not_a_deadlock() {
    let rt = Arc::new(rt(1));
    let inner = rt.clone();
    let h = rt
        .task("waits")
        .run_ctx(move |_| {
            inner.synchronize()?;
            Ok(())
        })
        .unwrap();
    let e = h.wait().unwrap_err();
    assert!(e.to_string().contains("synchronize"), "{e}");
    drop(h);
    // Drop the runtime from this thread (the task's clone may drop last on
    // the stream thread, which joins its own thread otherwise).
    rt.synchronize().unwrap();
}

#[test]
fn waits_implied_by_earlier_waits_are_elided() {
    let rt = Runtime::builder()
        .backend(BackendKind::Cpu)
        .compute_streams(3)
        .build()
        .unwrap();
    let a = rt.alloc("a", 4).unwrap();
    let b = rt.alloc("b", 4).unwrap();
    let c = rt.alloc("c", 4).unwrap();
    let gate = Arc::new(std::sync::Barrier::new(2));
    let g = gate.clone();
    // Keep stream 0 busy so nothing retires early.
    rt.task("a")
        .write(&a)
        .on_stream(0)
        .run_ctx(move |_| {
            g.wait();
            Ok(())
        })
        .unwrap();
    rt.task("b")
        .read(&a)
        .write(&b)
        .on_stream(1)
        .run_ctx(|_| Ok(()))
        .unwrap(); // waits 0:1
    rt.task("c")
        .read(&b)
        .write(&c)
        .on_stream(2)
        .run_ctx(|_| Ok(()))
        .unwrap(); // waits 1:1
                   // Depends on a (stream 0) and c (stream 2): c's clock already covers a.
    rt.task("d")
        .read(&a)
        .read(&c)
        .on_stream(2)
        .run_ctx(|_| Ok(()))
        .unwrap();
    let s = rt.stats();
    gate.wait();
    rt.synchronize().unwrap();
    assert_eq!(s.tasks, 4);
    assert_eq!(s.waits, 2, "{s:?}");
    assert_eq!(s.elided_waits, 1, "{s:?}");
}

#[test]
fn many_submitting_threads() {
    let rt = Arc::new(rt(3));
    let bufs: Vec<_> = (0..4)
        .map(|i| rt.alloc(format!("b{i}"), 4).unwrap())
        .collect();
    std::thread::scope(|sc| {
        for b in &bufs {
            let rt = rt.clone();
            sc.spawn(move || {
                for _ in 0..500 {
                    let v = b.clone();
                    rt.task("inc")
                        .read_write(b)
                        .run_ctx(move |ctx| {
                            ctx.write::<u32>(&v)?[0] += 1;
                            Ok(())
                        })
                        .unwrap();
                }
            });
        }
    });
    for b in &bufs {
        assert_eq!(rt.read_vec::<u32>(b).unwrap(), vec![500]);
    }
}

#[test]
fn launch_window_bounds_unfinished_tasks() {
    let rt = Runtime::builder()
        .backend(BackendKind::Cpu)
        .compute_streams(2)
        .launch_window(4)
        .build()
        .unwrap();
    let in_flight = Arc::new(AtomicUsize::new(0));
    let max_seen = Arc::new(AtomicUsize::new(0));
    for i in 0..64 {
        let b = rt.alloc(format!("b{i}"), 4).unwrap();
        let (f, m) = (in_flight.clone(), max_seen.clone());
        // Count submitted-but-unfinished tasks from the submitting side.
        f.fetch_add(1, Ordering::SeqCst);
        m.fetch_max(f.load(Ordering::SeqCst), Ordering::SeqCst);
        let f2 = f.clone();
        rt.task("t")
            .write(&b)
            .run_ctx(move |_| {
                std::thread::sleep(Duration::from_micros(200));
                f2.fetch_sub(1, Ordering::SeqCst);
                Ok(())
            })
            .unwrap();
    }
    rt.synchronize().unwrap();
    assert!(
        max_seen.load(Ordering::SeqCst) <= 5,
        "{}",
        max_seen.load(Ordering::SeqCst)
    );
}

#[test]
fn comm_tasks_go_to_comm_streams() {
    let rt = Runtime::builder()
        .backend(BackendKind::Cpu)
        .compute_streams(2)
        .comm_streams(2)
        .build()
        .unwrap();
    let x = rt.alloc("x", 4).unwrap();
    let h = rt
        .task("ar")
        .kind(TaskKind::Comm)
        .read_write(&x)
        .run_ctx(|_| Ok(()))
        .unwrap();
    assert_eq!(h.stream(), 2);
    let h = rt
        .task("ar1")
        .kind(TaskKind::Comm)
        .comm_stream(1)
        .read_write(&x)
        .run_ctx(|_| Ok(()))
        .unwrap();
    assert_eq!(h.stream(), 3);
    rt.synchronize().unwrap();
}

#[test]
fn chrome_trace_names_streams_and_tasks() {
    let dir = std::env::temp_dir().join(format!("braid-trace-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("t.json");
    {
        let rt = Runtime::builder()
            .backend(BackendKind::Cpu)
            .compute_streams(2)
            .trace(&path)
            .build()
            .unwrap();
        let x = rt.alloc("x", 4).unwrap();
        rt.task("hello").write(&x).run_ctx(|_| Ok(())).unwrap();
        rt.task("bye")
            .kind(TaskKind::Comm)
            .read(&x)
            .run_ctx(|_| Ok(()))
            .unwrap();
    }
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let ev = doc["traceEvents"].as_array().unwrap();
    let names: Vec<&str> = ev
        .iter()
        .filter(|e| e["name"] == "thread_name")
        .map(|e| e["args"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, vec!["compute 0", "compute 1", "comm 0"]);
    let hello = ev.iter().find(|e| e["name"] == "hello").unwrap();
    assert_eq!(hello["ph"], "X");
    let bye = ev.iter().find(|e| e["name"] == "bye").unwrap();
    assert_eq!(bye["tid"], 2);
    assert_eq!(bye["cat"], "comm");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A completion check registered by a body fails its task (the path by which
/// asynchronous device failures, like an aborted collective, reach the task).
#[test]
fn completion_checks_can_fail_the_task() {
    let rt = rt(2);
    let x = rt.alloc("x", 4).unwrap();
    let ok = rt
        .task("fine")
        .write(&x)
        .run_ctx(|ctx| {
            ctx.on_complete(|| Ok(()));
            Ok(())
        })
        .unwrap();
    ok.wait().unwrap();
    let bad = rt
        .task("aborted later")
        .read_write(&x)
        .run_ctx(|ctx| {
            ctx.on_complete(|| {
                Err(Error::Device {
                    backend: "test",
                    op: "check".into(),
                    message: "the device said no".into(),
                })
            });
            Ok(())
        })
        .unwrap();
    let dep = rt.task("after").read(&x).run_ctx(|_| Ok(())).unwrap();
    assert!(matches!(bad.wait(), Err(Error::Device { .. })));
    assert!(matches!(dep.wait(), Err(Error::DependencyFailed { .. })));
    rt.synchronize().unwrap();
}

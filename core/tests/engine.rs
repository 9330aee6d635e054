//! The engine's contract: ordering, overlap, errors, misuse, back-pressure.

mod common;

use braid::{
    Accesses, BackendKind, Buffer, Error, Policy, Priority, Runtime, RuntimeBuilder, TaskBuilder,
    TaskError, TaskHandle, TaskKind,
};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

fn rt(streams: usize) -> Runtime {
    common::cpu_runtime(streams, Policy::Affinity)
}

/// A CPU runtime with `streams` compute streams, to configure further. It
/// uses all of them whatever the core budget (`oversubscribe`): the tests of
/// this process run side by side, and placement here must not depend on how
/// many of their runtimes are alive.
fn cpu(streams: usize) -> RuntimeBuilder {
    Runtime::builder()
        .backend(BackendKind::Cpu)
        .compute_streams(streams)
        .oversubscribe(true)
}

fn profiled(streams: usize, policy: Policy) -> Runtime {
    cpu(streams).policy(policy).profile(true).build().unwrap()
}

/// Submits `task` with `accesses` and a body that does nothing.
fn empty<A: Accesses>(task: TaskBuilder<'_>, accesses: A) -> TaskHandle {
    task.run(accesses, |_| ()).unwrap()
}

/// Submits a task that writes `buf` and sleeps for `ms` milliseconds.
fn sleeper(rt: &Runtime, name: &'static str, buf: &Buffer, ms: u64) -> TaskHandle {
    rt.task(name)
        .run(buf.write::<u8>(), move |_| {
            std::thread::sleep(Duration::from_millis(ms))
        })
        .unwrap()
}

/// Submits a task that writes `buf` and fails with `message`.
fn failing(rt: &Runtime, name: String, buf: &Buffer, message: &'static str) -> TaskHandle {
    rt.task(name)
        .run(buf.write::<u8>(), move |_| -> Result<(), TaskError> {
            Err(message.into())
        })
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
        sleeper(&rt, "long", buf, 150);
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
        sleeper(&rt, "t", &b, 5);
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
        failing(&rt, "bad".into(), &x, "disk on fire");
        let r = ran.clone();
        let dep = rt
            .task("dependent")
            .run((x.read::<u32>(), y.write::<u32>()), move |_| {
                r.fetch_add(1, Ordering::SeqCst);
            })
            .unwrap();
        // Independent work still runs.
        let z = rt.alloc("z", 4).unwrap();
        let ok = empty(rt.task("independent"), z.write::<u32>());
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
            matches!(dep.wait(), Err(Error::DependencyFailed { task, cause, .. }) if task == "dependent" && cause == "bad")
        );
        ok.wait().unwrap();
        // Reported once; afterwards the runtime works, the buffer included.
        rt.synchronize().unwrap();
        rt.upload(&x, &[1u32, 2, 3, 4]).unwrap();
        assert_eq!(rt.read_vec::<u32>(&x).unwrap(), vec![1, 2, 3, 4]);
    }
}

/// A wait on a task skipped at the end of a chain of skips (here a
/// `read_vec`, the usual synchronisation point of one buffer) names the
/// error the chain started with, not only the task it waited for; eager,
/// and through a replay's skipped task and its join.
#[test]
fn a_skipped_task_names_the_root_failure_of_its_chain() {
    let rt = rt(2);
    let (x, y) = (rt.alloc("x", 16).unwrap(), rt.alloc("y", 16).unwrap());
    failing(&rt, "bad".into(), &x, "disk on fire");
    empty(rt.task("copy"), (x.read::<u32>(), y.write::<u32>()));
    let e = rt.read_vec::<u32>(&y).unwrap_err();
    match &e {
        Error::DependencyFailed {
            task,
            cause,
            root: Some(root),
        } => {
            assert_eq!((task.as_str(), cause.as_str()), ("read back", "copy"));
            assert!(
                matches!(&**root, Error::TaskFailed { task, message } if task == "bad" && message == "disk on fire"),
                "{root}"
            );
        }
        other => panic!("expected a skip naming its root, got {other:?}"),
    }
    assert!(
        e.to_string()
            .ends_with("failed: task `bad` failed: disk on fire"),
        "{e}"
    );
    assert!(rt.synchronize().is_err());

    // In a replay: a task that fails and one skipped after it, read back.
    let fail = Arc::new(AtomicUsize::new(0));
    let f = fail.clone();
    let step = rt
        .record("step", |rt| {
            let f = f.clone();
            rt.task("maybe bad")
                .run(x.write::<u8>(), move |_| -> Result<(), TaskError> {
                    match f.load(Ordering::SeqCst) {
                        0 => Ok(()),
                        _ => Err("out of paper".into()),
                    }
                })?;
            empty(rt.task("copy"), (x.read::<u32>(), y.write::<u32>()));
            Ok(())
        })
        .unwrap();
    rt.synchronize().unwrap();
    fail.store(1, Ordering::SeqCst);
    step.replay().unwrap();
    let e = rt.read_vec::<u32>(&y).unwrap_err();
    assert!(
        e.to_string()
            .ends_with("failed: task `maybe bad` failed: out of paper"),
        "{e}"
    );
    assert!(rt.synchronize().is_err());
    rt.upload(&y, &[7u32; 4]).unwrap();
    assert_eq!(rt.read_vec::<u32>(&y).unwrap(), vec![7; 4]);
}

/// An explicit edge (`TaskBuilder::after`) to a task that has already
/// failed, and finished, still skips the dependent: finished is not enough
/// to drop an edge, only finished without error is.
#[test]
fn an_explicit_edge_to_a_finished_failed_task_skips_the_dependent() {
    let rt = rt(2);
    let x = rt.alloc("x", 4).unwrap();
    let bad = failing(&rt, "bad".into(), &x, "gone");
    assert!(bad.wait().is_err());
    let after = rt.task("after bad").after(&bad).run((), |()| ()).unwrap();
    assert!(
        matches!(after.wait(), Err(Error::DependencyFailed { task, cause, .. }) if task == "after bad" && cause == "bad")
    );
    rt.synchronize().unwrap();
}

#[test]
fn panicking_task_is_an_error_naming_it() {
    let rt = rt(2);
    let x = rt.alloc("x", 4).unwrap();
    let h = rt
        .task("boom")
        .run(x.write::<u32>(), |_| -> () { panic!("kaboom {}", 7) })
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
    empty(rt.task("after"), x.write::<u32>()).wait().unwrap();
}

#[test]
fn several_failures_are_all_reported() {
    let rt = rt(2);
    for i in 0..3 {
        let b = rt.alloc(format!("b{i}"), 4).unwrap();
        failing(&rt, format!("f{i}"), &b, "no");
    }
    match rt.synchronize().unwrap_err() {
        Error::Many(v) => assert_eq!(v.len(), 3),
        e => panic!("expected three errors, got {e}"),
    }
}

/// A body reaches only what it declared, exactly as declared: a token of a
/// view gives a slice of that view and nothing around it. (Writing through a
/// read token, or reaching an undeclared buffer, does not compile: see the
/// `compile_fail` example in `braid::Accesses`' module.)
#[test]
fn a_body_gets_exactly_its_declared_views() {
    let rt = rt(2);
    let x = rt.alloc_from("x", &(0u8..16).collect::<Vec<_>>()).unwrap();
    let y = rt.alloc("y", 16).unwrap();
    let (part, out) = (x.view(4..12).unwrap(), y.view(8..16).unwrap());
    rt.task("part")
        .run((part.read::<u32>(), out.write::<u32>()), |(p, o)| {
            assert_eq!((p.len(), o.len()), (2, 2));
            o.copy_from_slice(p);
        })
        .unwrap();
    let mut want = vec![0u8; 8];
    want.extend(4u8..12);
    assert_eq!(rt.read_vec::<u8>(&y).unwrap(), want);
    // No tokens, no data.
    rt.task("nothing").run((), |()| ()).unwrap().wait().unwrap();
}

/// Naming the same bytes twice in one task, where one of the two writes, is
/// refused at submission (the body would get aliasing slices); so is a token
/// that is not a whole aligned `[T]`. A refused task never enters the graph:
/// the runtime counts no task for it and later tasks do not wait for it.
#[test]
fn conflicting_or_misaligned_tokens_refuse_the_whole_task() {
    let rt = rt(1);
    let x = rt.alloc_from("x", &[5u32; 4]).unwrap();
    let y = rt.alloc("y", 16).unwrap();
    let before = rt.stats().tasks;
    for e in [
        rt.task("alias")
            .run((x.read_write::<u32>(), x.read::<u32>()), |_| ())
            .unwrap_err(),
        rt.task("alias")
            .run(
                (y.write::<u32>(), x.read::<u32>(), x.write::<u32>()),
                |_| (),
            )
            .unwrap_err(),
    ] {
        assert!(
            matches!(&e, Error::BorrowConflict { task, buffer, .. } if task == "alias" && buffer == "x"),
            "{e}"
        );
    }
    let e = rt
        .task("odd")
        .run(
            (y.write::<u32>(), x.view(0..6).unwrap().read::<u32>()),
            |(y, _)| y.fill(9),
        )
        .unwrap_err();
    assert!(
        matches!(&e, Error::Misaligned { buffer, .. } if buffer == "x"),
        "{e}"
    );
    assert!(e.to_string().starts_with("task `odd`: bytes 0..6"), "{e}");
    assert_eq!(rt.stats().tasks, before);
    // Nothing ran, nothing is pending: both buffers are as they were.
    assert_eq!(rt.read_vec::<u32>(&x).unwrap(), vec![5; 4]);
    assert_eq!(rt.read_vec::<u32>(&y).unwrap(), vec![0; 4]);
    rt.synchronize().unwrap();
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
    // Elements whose bytes overflow: named as asked, of a buffer and a view.
    let huge = usize::MAX / 2..usize::MAX / 2 + 1;
    for e in [
        x.view_of::<u64>(huge.clone()).unwrap_err(),
        x.whole().view_of::<u64>(huge.clone()).unwrap_err(),
    ] {
        let want = format!("elements {huge:?} of `u64` in buffer `x`");
        assert!(e.to_string().starts_with(&want), "{e}");
    }
    let e = b.task("t").run(x.read::<u8>(), |_| ()).unwrap_err();
    assert!(matches!(e, Error::ForeignBuffer { .. }), "{e}");
    assert!(
        e.to_string()
            .starts_with("task `t`: buffer `x` belongs to another runtime"),
        "{e}"
    );
    let e = a.task("t").on_stream(9).run((), |()| ()).unwrap_err();
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
        .run((), move |()| -> Result<(), TaskError> {
            inner.synchronize()?;
            Ok(())
        })
        .unwrap();
    let e = h.wait().unwrap_err();
    assert!(e.to_string().contains("synchronize"), "{e}");
    drop(h);
    // Waiting on a task that has finished is refused too (whether it has
    // is timing: the error must not come and go), naming the call; so is
    // `read_vec`, naming itself, before it submits its read task.
    let x = rt.alloc("x", 4).unwrap();
    let first = rt.task("first").run(x.write::<u8>(), |_| ()).unwrap();
    first.wait().unwrap();
    let (inner, xv) = (rt.clone(), x.clone());
    let errors = Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = errors.clone();
    let before = rt.stats().tasks;
    rt.task("waits on a finished task")
        .run((), move |()| {
            let mut seen = seen.lock().unwrap();
            seen.push(first.wait().unwrap_err().to_string());
            seen.push(inner.read_vec::<u8>(&xv).unwrap_err().to_string());
        })
        .unwrap()
        .wait()
        .unwrap();
    let errors = errors.lock().unwrap().clone();
    assert!(errors[0].contains("`TaskHandle::wait`"), "{errors:?}");
    assert!(errors[1].contains("`Runtime::read_vec`"), "{errors:?}");
    assert_eq!(
        rt.stats().tasks,
        before + 1,
        "read_vec submitted a read task"
    );
    // Drop the runtime from this thread (the task's clone may drop last on
    // the stream thread, which joins its own thread otherwise).
    rt.synchronize().unwrap();
}

#[test]
fn waits_implied_by_earlier_waits_are_elided() {
    let rt = cpu(3).build().unwrap();
    let a = rt.alloc("a", 4).unwrap();
    let b = rt.alloc("b", 4).unwrap();
    let c = rt.alloc("c", 4).unwrap();
    let gate = Arc::new(std::sync::Barrier::new(2));
    let g = gate.clone();
    // Keep stream 0 busy so nothing retires early.
    rt.task("a")
        .on_stream(0)
        .run(a.write::<u8>(), move |_| {
            g.wait();
        })
        .unwrap();
    // Waits 0:1.
    empty(rt.task("b").on_stream(1), (a.read::<u8>(), b.write::<u8>()));
    // Waits 1:1.
    empty(rt.task("c").on_stream(2), (b.read::<u8>(), c.write::<u8>()));
    // Depends on a (stream 0) and c (stream 2): c's clock already covers a.
    empty(rt.task("d").on_stream(2), (a.read::<u8>(), c.read::<u8>()));
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
                    rt.task("inc")
                        .run(b.read_write::<u32>(), |x| x[0] += 1)
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
    let rt = cpu(2).launch_window(4).build().unwrap();
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
            .run(b.write::<u8>(), move |_| {
                std::thread::sleep(Duration::from_micros(200));
                f2.fetch_sub(1, Ordering::SeqCst);
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
    let rt = cpu(2).comm_streams(2).build().unwrap();
    let x = rt.alloc("x", 4).unwrap();
    let h = empty(rt.task("ar").kind(TaskKind::Comm), x.read_write::<u8>());
    assert_eq!(h.stream(), 2);
    let h = empty(
        rt.task("ar1").kind(TaskKind::Comm).comm_stream(1),
        x.read_write::<u8>(),
    );
    assert_eq!(h.stream(), 3);
    rt.synchronize().unwrap();
}

#[test]
fn chrome_trace_names_streams_and_tasks() {
    let dir = std::env::temp_dir().join(format!("braid-trace-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("t.json");
    {
        let rt = cpu(2).trace(&path).build().unwrap();
        let x = rt.alloc("x", 4).unwrap();
        empty(rt.task("hello"), x.write::<u8>());
        empty(rt.task("bye").kind(TaskKind::Comm), x.read::<u8>());
    }
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let ev = doc["traceEvents"].as_array().unwrap();
    let names: Vec<&str> = ev
        .iter()
        .filter(|e| e["name"] == "thread_name")
        .map(|e| e["args"]["name"].as_str().unwrap())
        .collect();
    // The streams, then the track of the runtime's busy periods.
    assert_eq!(
        names,
        vec!["compute 0", "compute 1", "comm 0", "busy periods"]
    );
    let hello = ev.iter().find(|e| e["name"] == "hello").unwrap();
    assert_eq!(hello["ph"], "X");
    let bye = ev.iter().find(|e| e["name"] == "bye").unwrap();
    assert_eq!(bye["tid"], 2);
    assert_eq!(bye["cat"], "comm");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Each task's trace event says why it went where it went.
#[test]
fn chrome_trace_records_placement_decisions() {
    let dir = std::env::temp_dir().join(format!("braid-placed-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("t.json");
    {
        let rt = cpu(2).trace(&path).build().unwrap();
        assert_eq!(rt.usable_compute_streams(), 2);
        let x = rt.alloc("x", 4).unwrap();
        let y = rt.alloc("y", 4).unwrap();
        // Still running when its successors are placed.
        sleeper(&rt, "first", &x, 100);
        empty(rt.task("next"), x.read_write::<u8>());
        empty(rt.task("aside").priority(Priority::Side), x.read::<u8>());
        empty(rt.task("pinned").on_stream(1), y.write::<u8>());
        empty(rt.task("bye").kind(TaskKind::Comm), x.read::<u8>());
        let single = cpu(2)
            .policy(Policy::Single)
            .trace(dir.join("single.json"))
            .build()
            .unwrap();
        let z = single.alloc("z", 4).unwrap();
        empty(single.task("alone"), z.write::<u8>());
    }
    let events = |file: &str| -> Vec<serde_json::Value> {
        let doc: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join(file)).unwrap()).unwrap();
        doc["traceEvents"].as_array().unwrap().clone()
    };
    let ev = events("t.json");
    let args = |name: &str| {
        ev.iter()
            .find(|e| e["name"] == name && e["ph"] == "X")
            .unwrap_or_else(|| panic!("no event {name}"))["args"]
            .clone()
    };
    for (task, placed, tid) in [
        ("first", "least-loaded", 0),
        ("next", "chain", 0),
        ("aside", "side", 1),
        ("pinned", "pinned", 1),
        ("bye", "comm", 2),
    ] {
        let a = args(task);
        assert_eq!(a["placed"], placed, "{task}: {a}");
        assert_eq!(a["usable_streams"], 2, "{task}: {a}");
        let e = ev.iter().find(|e| e["name"] == task).unwrap();
        assert_eq!(e["tid"], tid, "{task}");
    }
    assert_eq!(args("aside")["priority"], "side");
    assert_eq!(args("next")["priority"], "main");
    assert_eq!(args("bye")["priority"], "comm");
    let ev = events("single.json");
    let alone = ev.iter().find(|e| e["name"] == "alone").unwrap();
    assert_eq!(alone["args"]["placed"], "single");
    assert_eq!(alone["args"]["usable_streams"], 1);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// An allocation the device refuses names the buffer it was for.
#[test]
fn a_failed_allocation_names_the_buffer() {
    let rt = cpu(1).build().unwrap();
    match rt.alloc("huge", usize::MAX - 8) {
        Err(e @ braid::Error::Device { .. }) => {
            let m = e.to_string();
            assert!(m.contains("`huge`") && m.contains("bytes"), "{m}");
        }
        other => panic!("{other:?}"),
    }
    // The runtime is still usable.
    assert_eq!(rt.alloc("small", 8).unwrap().len(), 8);
}

/// A trace is written when the runtime drops, where a failure could only be
/// printed: `build` refuses a path it could not write.
#[test]
fn a_trace_path_that_cannot_be_written_fails_the_build() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("absent").join("t.json");
    for (path, says) in [
        (missing, "does not exist"),
        (dir.path().to_path_buf(), "is a directory"),
    ] {
        match cpu(1).trace(&path).build() {
            Err(braid::Error::Config(m)) => assert!(m.contains(says), "{m}"),
            other => panic!("{}: {other:?}", path.display()),
        }
    }
    let ok = dir.path().join("t.json");
    drop(cpu(1).trace(&ok).build().unwrap());
    assert!(ok.is_file());
}

/// Two live runtimes of a process may not share a trace file (the last to
/// drop would replace the other's trace): the second `build` is refused,
/// however the path is spelt; once the first has dropped (and written),
/// the path is free. `/dev/null` is not claimed.
#[test]
fn two_live_runtimes_may_not_share_a_trace_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.json");
    let first = cpu(1).trace(&path).build().unwrap();
    let other_spelling = dir.path().join(".").join("t.json");
    match cpu(1).trace(&other_spelling).build() {
        Err(braid::Error::Config(m)) => {
            assert!(m.contains("another runtime of this process"), "{m}")
        }
        other => panic!("{other:?}"),
    }
    drop(first);
    assert!(path.is_file());
    drop(cpu(1).trace(&path).build().unwrap());
    let null = std::path::Path::new("/dev/null");
    if null.exists() {
        let a = cpu(1).trace(null).build().unwrap();
        let b = cpu(1).trace(null).build().unwrap();
        drop((a, b));
    }
}

/// A trace read back ([`braid::trace::read_chrome_trace`]) is the profile
/// that was written: the same spans (µs precision), streams, summary, class
/// and busy periods (one at least per synchronisation: the runtime may also
/// go idle between two submissions).
#[test]
fn chrome_trace_reads_back_as_the_profile_written() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.json");
    let written = {
        let rt = cpu(2).rank(3).trace(&path).build().unwrap();
        let x = rt.alloc("x", 4).unwrap();
        let y = rt.alloc("y", 4).unwrap();
        sleeper(&rt, "first", &x, 2);
        rt.synchronize().unwrap();
        empty(rt.task("next"), x.read_write::<u8>());
        empty(rt.task("aside").priority(Priority::Side), y.write::<u8>());
        empty(rt.task("bye").kind(TaskKind::Comm), x.read::<u8>());
        rt.synchronize().unwrap();
        rt.profile()
    };
    let read = braid::trace::read_chrome_trace(&std::fs::read_to_string(&path).unwrap()).unwrap();
    assert_eq!(read.len(), 1);
    let back = &read[0];
    assert_eq!(back.rank, 3);
    let names = |p: &braid::trace::Profile| -> Vec<(String, bool)> {
        p.streams
            .iter()
            .map(|s| (s.name.clone(), s.is_comm))
            .collect()
    };
    assert_eq!(names(back), names(&written));
    assert_eq!(back.spans.len(), written.spans.len());
    let by_id = |p: &braid::trace::Profile| {
        let mut v = p.spans.clone();
        v.sort_by_key(|s| s.id);
        v
    };
    for (b, w) in by_id(back).iter().zip(by_id(&written).iter()) {
        assert_eq!(
            (b.id, &b.name, b.kind, b.stream),
            (w.id, &w.name, w.kind, w.stream)
        );
        assert_eq!((b.placement, b.ok, b.bytes), (w.placement, w.ok, w.bytes));
        assert_eq!(b.preds, w.preds);
        // Microseconds with three decimals in the file: within a nanosecond.
        assert!(
            b.start_ns.abs_diff(w.start_ns) <= 1,
            "{} vs {}",
            b.start_ns,
            w.start_ns
        );
        assert!(b.end_ns.abs_diff(w.end_ns) <= 2);
    }
    assert_eq!(back.class, Some(braid::Class::Normal));
    assert!(written.busy.len() >= 2, "{:?}", written.busy);
    assert_eq!(back.busy.len(), written.busy.len());
    for (b, w) in back.busy.iter().zip(&written.busy) {
        assert!(
            b.0.abs_diff(w.0) <= 1 && b.1.abs_diff(w.1) <= 2,
            "{b:?} vs {w:?}"
        );
    }
    // The first period holds the 2 ms sleeper.
    assert!(written.busy[0].1 - written.busy[0].0 >= 2_000_000);
    let (sb, sw) = (back.summary(), written.summary());
    assert_eq!((sb.tasks, sb.streams.len()), (sw.tasks, sw.streams.len()));
    assert!(sb.critical_path_ns.abs_diff(sw.critical_path_ns) <= 8);
    let bad = braid::trace::read_chrome_trace("{\"traceEvents\": []}").unwrap_err();
    assert!(bad.to_string().contains("no task events"), "{bad}");
    let bad = braid::trace::read_chrome_trace("[1, 2").unwrap_err();
    assert!(bad.to_string().starts_with("not a Braid trace"), "{bad}");
    // A track id no runtime has is refused, not allocated (tracks are a
    // dense list: a billion of them once took gigabytes).
    let huge =
        r#"[{"ph":"X","pid":0,"tid":1000000000,"ts":1,"dur":2,"name":"a","args":{"task":1}}]"#;
    let bad = braid::trace::read_chrome_trace(huge).unwrap_err();
    assert!(bad.to_string().contains("track 1000000000"), "{bad}");
}

/// Each dependency across streams is a flow event pair in the trace (an
/// arrow in the viewer): its start in the predecessor's span, its finish
/// at the waiting task's start on the other stream; none within a stream.
#[test]
fn chrome_trace_draws_cross_stream_dependencies() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.json");
    let written = {
        let rt = cpu(2).trace(&path).build().unwrap();
        let x = rt.alloc("x", 4).unwrap();
        let y = rt.alloc("y", 4).unwrap();
        empty(rt.task("a").on_stream(0), x.write::<u8>());
        empty(rt.task("b").on_stream(0), x.read_write::<u8>());
        empty(rt.task("c").on_stream(1), x.read::<u8>());
        empty(rt.task("d").on_stream(1), y.write::<u8>());
        rt.synchronize().unwrap();
        rt.profile()
    };
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let events = doc["traceEvents"].as_array().unwrap();
    let flows =
        |ph: &str| -> Vec<&serde_json::Value> { events.iter().filter(|e| e["ph"] == ph).collect() };
    let (starts, ends) = (flows("s"), flows("f"));
    let span = |name: &str| written.spans.iter().find(|s| s.name == name).unwrap();
    // `c` on stream 1 waits for `b` on stream 0; `b` after `a` is stream
    // 0's order, and `d` waits for nothing.
    assert!(span("c").preds.contains(&span("b").id));
    assert_eq!((starts.len(), ends.len()), (1, 1), "{starts:?} {ends:?}");
    let (s, f) = (starts[0], ends[0]);
    assert_eq!(s["id"], f["id"]);
    let us = |ns: u64| ns as f64 / 1e3;
    let (b, c) = (span("b"), span("c"));
    assert_eq!((s["tid"].as_u64(), f["tid"].as_u64()), (Some(0), Some(1)));
    let ts = s["ts"].as_f64().unwrap();
    assert!(us(b.start_ns) <= ts && ts <= us(b.end_ns), "{s} in {b:?}");
    assert_eq!(f["ts"].as_f64(), Some(us(c.start_ns)));
    assert_eq!(f["bp"], "e");
    // A reader of the trace skips them.
    let back = braid::trace::read_chrome_trace(&doc.to_string()).unwrap();
    assert_eq!(back[0].spans.len(), written.spans.len());
}

/// Under the default policy a CPU runtime places compute tasks on its share
/// of the core budget; communication keeps its own stream; `oversubscribe`
/// keeps every stream.
#[test]
fn core_budget_limits_affinity_compute_streams() {
    let budgeted = Runtime::builder()
        .backend(BackendKind::Cpu)
        .compute_streams(2)
        .cpu_cores(1)
        .build()
        .unwrap();
    assert_eq!(budgeted.usable_compute_streams(), 1);
    let bufs: Vec<Buffer> = (0..6)
        .map(|i| budgeted.alloc(format!("b{i}"), 4).unwrap())
        .collect();
    for b in &bufs {
        let h = sleeper(&budgeted, "independent", b, 2);
        assert_eq!(h.stream(), 0);
    }
    let h = empty(
        budgeted.task("ar").kind(TaskKind::Comm),
        bufs[0].read::<u8>(),
    );
    assert_eq!(h.stream(), 2);
    budgeted.synchronize().unwrap();
    let all = cpu(2).cpu_cores(1).build().unwrap();
    assert_eq!(all.usable_compute_streams(), 2);
    let e = Runtime::builder()
        .backend(BackendKind::Cpu)
        .cpu_cores(0)
        .build()
        .unwrap_err();
    assert!(matches!(e, Error::Config(_)), "{e}");
}

/// Ranks launched as threads of one process share the budget: two ranks on a
/// two-core budget use one compute stream each while both are alive.
#[test]
fn launched_ranks_share_the_core_budget() {
    let both_built = std::sync::Barrier::new(2);
    let usable = braid::launch(2, |rank, _comm| {
        let rt = Runtime::builder()
            .backend(BackendKind::Cpu)
            .compute_streams(2)
            .cpu_cores(2)
            .rank(rank)
            .build()?;
        both_built.wait();
        let n = rt.usable_compute_streams();
        both_built.wait();
        Ok(n)
    });
    for (rank, n) in usable.into_iter().enumerate() {
        assert_eq!(n.unwrap(), 1, "rank {rank}");
    }
}

/// Misuse the engine could not honour safely is refused at submission,
/// naming the task: an edge to a task of another runtime (its stream and
/// clock mean nothing here: merged, they once elided a real wait), an
/// element type aligned above the buffers' 64 bytes; too many streams fail
/// the build instead of overflowing.
#[test]
fn foreign_edges_overaligned_types_and_absurd_stream_counts_are_refused() {
    let (a, b) = (rt(2), rt(2));
    let y = b.alloc("y", 4).unwrap();
    let hb = b.task("on b").run(y.write::<u32>(), |_| ()).unwrap();
    let x = a.alloc("x", 4).unwrap();
    let err = a
        .task("on a")
        .after(&hb)
        .run(x.write::<u32>(), |_| ())
        .unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(err, Error::Usage(_)) && msg.contains("on a") && msg.contains("on b"),
        "{msg}"
    );
    a.synchronize().unwrap();
    b.synchronize().unwrap();

    #[derive(Clone, Copy)]
    #[repr(C, align(128))]
    struct Big([u8; 128]);
    // SAFETY: plain bytes, no padding (size 128, align 128).
    unsafe impl bytemuck::Zeroable for Big {}
    // SAFETY: as above.
    unsafe impl bytemuck::Pod for Big {}
    let big = a.alloc("big", 256).unwrap();
    let err = a
        .task("aligned")
        .run(big.read::<Big>(), |_| ())
        .unwrap_err();
    assert!(err.to_string().contains("128-byte alignment"), "{err}");
    // An empty buffer is an aligned empty slice of any admitted type.
    let empty = a.alloc("empty", 0).unwrap();
    a.task("empty")
        .run(empty.read::<u128>(), |v| assert!(v.is_empty()))
        .unwrap();
    a.synchronize().unwrap();

    let err = cpu(usize::MAX).comm_streams(1).build().unwrap_err();
    assert!(err.to_string().contains("too many"), "{err}");
    // The bound counts both kinds: a clear error, where 20,000 streams once
    // aborted the process allocating their clocks.
    let err = cpu(braid::MAX_STREAMS).comm_streams(1).build().unwrap_err();
    assert!(err.to_string().contains("at most 1024 in all"), "{err}");
}

/// A panic where the program's code runs outside the body itself — the
/// `Drop` of a value the body captured — fails the task like a panic in the
/// body, and the stream thread lives on (it once died, and every later
/// wait on its stream hung).
#[test]
fn a_panic_dropping_a_body_fails_the_task_and_the_stream_lives_on() {
    struct Bomb;
    impl Drop for Bomb {
        fn drop(&mut self) {
            panic!("bomb dropped");
        }
    }
    let rt = rt(1);
    let x = rt.alloc("x", 4).unwrap();
    let bomb = Bomb;
    rt.task("bomb")
        .run(x.write::<u32>(), move |x| {
            let _keep = &bomb;
            x[0] = 1;
        })
        .unwrap();
    let err = rt.synchronize().unwrap_err();
    assert!(
        matches!(&err, Error::TaskPanicked { task, message } if task == "bomb" && message.contains("bomb dropped")),
        "{err}"
    );
    rt.task("after")
        .run(x.write::<u32>(), |x| x[0] = 2)
        .unwrap();
    assert_eq!(rt.read_vec::<u32>(&x).unwrap(), vec![2]);
}

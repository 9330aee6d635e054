//! Priority classes across the runtimes of a process (`RuntimeBuilder::class`).

use braid::{BackendKind, Class, Runtime, TaskError};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

fn cpu(class: Class) -> Runtime {
    Runtime::builder()
        .backend(BackendKind::Cpu)
        .compute_streams(1)
        .oversubscribe(true)
        .class(class)
        .build()
        .unwrap()
}

/// A best-effort task does not start while a latency-critical task is
/// unfinished, and starts once it finishes; a normal runtime is not held
/// back. The best-effort runtime's results are those of its program.
#[test]
fn best_effort_waits_for_latency_critical_work() {
    let lc = cpu(Class::LatencyCritical);
    let be = cpu(Class::BestEffort);
    let normal = cpu(Class::Normal);
    let (release, gate) = mpsc::channel::<()>();
    let (started_tx, started) = mpsc::channel::<()>();
    let a = lc.alloc("a", 4).unwrap();
    lc.task("serve")
        .run(a.write::<u8>(), move |_| {
            started_tx.send(()).unwrap();
            let _ = gate.recv_timeout(Duration::from_secs(20));
        })
        .unwrap();
    started.recv_timeout(Duration::from_secs(10)).unwrap();
    let ran = Arc::new(AtomicBool::new(false));
    let b = be.alloc_from("b", &[1.0f32, 2.0]).unwrap();
    let flag = ran.clone();
    be.task("train")
        .run(b.read_write::<f32>(), move |b| {
            flag.store(true, Ordering::SeqCst);
            for x in b.iter_mut() {
                *x *= 3.0;
            }
        })
        .unwrap();
    let n = normal.alloc("n", 4).unwrap();
    normal
        .task("other")
        .run(n.write::<u8>(), |_| ())
        .unwrap()
        .wait()
        .unwrap();
    std::thread::sleep(Duration::from_millis(150));
    assert!(
        !ran.load(Ordering::SeqCst),
        "a best-effort task started beside an unfinished latency-critical one"
    );
    release.send(()).unwrap();
    lc.synchronize().unwrap();
    be.synchronize().unwrap();
    assert!(ran.load(Ordering::SeqCst));
    assert_eq!(be.read_vec::<f32>(&b).unwrap(), vec![3.0, 6.0]);
}

/// A latency-critical CPU runtime of one stream that runs short tasks
/// inline.
fn inlining_latency_critical() -> Runtime {
    Runtime::builder()
        .backend(BackendKind::Cpu)
        .compute_streams(1)
        .oversubscribe(true)
        .class(Class::LatencyCritical)
        .inline_short_tasks(true)
        .build()
        .unwrap()
}

/// A latency-critical task that a best-effort body submits never runs
/// inline on the best-effort stream thread, however short: there it would
/// run at the idle policy. It runs on its own stream (and a preemption
/// point in it returns at once: pausing would wait for latency-critical
/// work to end, its own included, forever).
#[test]
fn a_latency_critical_task_a_best_effort_body_submits_is_not_run_inline() {
    let lc = inlining_latency_critical();
    let be = cpu(Class::BestEffort);
    let x = lc.alloc_from("x", &[0u32]).unwrap();
    let (done_tx, done) = mpsc::channel::<(u32, u64)>();
    let b = be.alloc("b", 4).unwrap();
    be.task("submits to the other runtime")
        .run(b.write::<u8>(), move |_| {
            let before = lc.stats().inline;
            // Short ticks, the stream idle before each: measured as short,
            // they would run inline on any other thread.
            for _ in 0..200 {
                lc.task("tick")
                    .run(x.read_write::<u32>(), |v| {
                        braid::preemption_point();
                        v[0] += 1;
                    })
                    .unwrap();
                lc.synchronize().unwrap();
            }
            let ticks = lc.read_vec::<u32>(&x).unwrap()[0];
            done_tx.send((ticks, lc.stats().inline - before)).unwrap();
        })
        .unwrap();
    let Ok((ticks, inline)) = done.recv_timeout(Duration::from_secs(30)) else {
        // Its stream thread is stuck: dropping the runtime would wait.
        std::mem::forget(be);
        panic!("a latency-critical tick paused on the best-effort thread");
    };
    assert_eq!(ticks, 200);
    assert_eq!(inline, 0, "ticks ran inline on the best-effort thread");
    be.synchronize().unwrap();
}

/// The control for the test above: the same ticks submitted by a normal
/// thread do run inline (the runtime measured them as short).
#[test]
fn short_latency_critical_ticks_run_inline_on_a_normal_thread() {
    let lc = inlining_latency_critical();
    let x = lc.alloc_from("x", &[0u32]).unwrap();
    for _ in 0..200 {
        lc.task("tick")
            .run(x.read_write::<u32>(), |v| v[0] += 1)
            .unwrap();
        lc.synchronize().unwrap();
    }
    assert_eq!(lc.read_vec::<u32>(&x).unwrap(), vec![200]);
    assert!(lc.stats().inline > 0, "{:?}", lc.stats());
}

/// A best-effort program that fails harms no other: its error surfaces on
/// its own runtime, the latency-critical one's tasks complete.
#[test]
fn a_failing_best_effort_program_harms_no_other() {
    let lc = cpu(Class::LatencyCritical);
    let be = cpu(Class::BestEffort);
    let b = be.alloc("b", 4).unwrap();
    be.task("breaks")
        .run(b.write::<u8>(), |_| -> Result<(), TaskError> {
            panic!("best-effort bug")
        })
        .unwrap();
    be.task("after").run(b.read::<u8>(), |_| ()).unwrap();
    let x = lc.alloc_from("x", &[1.0f32; 8]).unwrap();
    for _ in 0..20 {
        lc.task("serve")
            .run(x.read_write::<f32>(), |x| {
                for v in x.iter_mut() {
                    *v += 1.0;
                }
            })
            .unwrap();
    }
    lc.synchronize().unwrap();
    assert_eq!(lc.read_vec::<f32>(&x).unwrap(), vec![21.0; 8]);
    let err = be.synchronize().unwrap_err();
    assert!(err.to_string().contains("best-effort bug"), "{err}");
}

/// The scheduling policies of this process's live-view threads (named
/// `braid-live…`).
#[cfg(target_os = "linux")]
fn live_thread_policies() -> Vec<i32> {
    let mut policies = Vec::new();
    for task in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
        let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        let Ok(tid) = task.file_name().to_string_lossy().parse::<libc::pid_t>() else {
            continue;
        };
        if comm.trim_end().starts_with("braid-live") {
            // SAFETY: a thread id of this process; no pointers.
            policies.push(unsafe { libc::sched_getscheduler(tid) });
        }
    }
    policies
}

/// The policy of the stream thread of `rt` (one compute stream).
#[cfg(target_os = "linux")]
fn stream_policy(rt: &Runtime) -> i32 {
    let out = rt.alloc("out", 4).unwrap();
    rt.task("policy")
        .run(out.write::<i32>(), |o| {
            // SAFETY: pid 0 names the calling thread.
            o[0] = unsafe { libc::sched_getscheduler(0) };
        })
        .unwrap();
    rt.read_vec::<i32>(&out).unwrap()[0]
}

/// Whether this process may put a thread through `policies` (policy and
/// priority, in turn; probed on a scratch thread), and the policy a thread
/// then ends at: `yes` where it may, `no` where it may not.
#[cfg(target_os = "linux")]
fn probe_policies(policies: &'static [(i32, i32)], yes: i32, no: i32) -> (bool, i32) {
    let allowed = std::thread::spawn(move || {
        policies.iter().all(|&(policy, priority)| {
            let param = libc::sched_param {
                sched_priority: priority,
            };
            // SAFETY: valid `sched_param`; pid 0 names this scratch thread.
            unsafe { libc::sched_setscheduler(0, policy, &param) == 0 }
        })
    })
    .join()
    .unwrap();
    (allowed, if allowed { yes } else { no })
}

/// Whether this process may give a thread `SCHED_FIFO`, and the policy a
/// real-time runtime's threads get here.
#[cfg(target_os = "linux")]
fn real_time_here() -> (bool, i32) {
    probe_policies(
        &[(libc::SCHED_FIFO, 1)],
        libc::SCHED_FIFO,
        libc::SCHED_OTHER,
    )
}

/// A latency-critical CPU runtime of one stream asking for real-time
/// threads (its tasks on the stream thread, not inline).
#[cfg(target_os = "linux")]
fn realtime_latency_critical() -> Runtime {
    Runtime::builder()
        .backend(BackendKind::Cpu)
        .compute_streams(1)
        .oversubscribe(true)
        .inline_short_tasks(false)
        .class(Class::LatencyCritical)
        .realtime(true)
        .build()
        .unwrap()
}

/// Best-effort CPU stream threads run at the idle scheduling policy; the
/// others keep the default.
#[cfg(target_os = "linux")]
#[test]
fn best_effort_threads_run_at_idle_priority() {
    let policy_in = |class: Class| stream_policy(&cpu(class));
    assert_eq!(policy_in(Class::BestEffort), libc::SCHED_IDLE);
    assert_eq!(policy_in(Class::Normal), libc::SCHED_OTHER);
    assert_eq!(policy_in(Class::LatencyCritical), libc::SCHED_OTHER);
}

/// With `realtime(true)`, a latency-critical runtime's stream thread and
/// the thread that submits to it run at `SCHED_FIFO` — where this process
/// may use it (probed on a scratch thread first); where it may not, both
/// keep the default policy and the runtime still works. Other classes
/// refuse the switch with an error naming the class.
#[cfg(target_os = "linux")]
#[test]
fn realtime_latency_critical_threads_get_a_real_time_policy_where_allowed() {
    let (allowed, want) = real_time_here();
    let (stream, submitter) = std::thread::spawn(|| {
        let rt = realtime_latency_critical();
        let stream = stream_policy(&rt);
        // SAFETY: pid 0 names the calling thread.
        (stream, unsafe { libc::sched_getscheduler(0) })
    })
    .join()
    .unwrap();
    assert_eq!(
        (stream, submitter),
        (want, want),
        "SCHED_FIFO allowed: {allowed}"
    );
    for class in [Class::Normal, Class::BestEffort] {
        let e = Runtime::builder()
            .backend(BackendKind::Cpu)
            .class(class)
            .realtime(true)
            .build()
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("latency-critical") && e.contains(class.name()),
            "{e}"
        );
    }
}

/// A thread that submitted to a real-time latency-critical runtime keeps
/// `SCHED_FIFO`, and Linux threads inherit their creator's policy: the
/// runtimes it builds afterwards still run their stream threads at their
/// own class's policy, not at real time (the training run that
/// `multi_tenant --realtime` starts beside its serving program did), and
/// the live view's threads they start at the default policy.
#[cfg(target_os = "linux")]
#[test]
fn runtimes_built_by_a_real_time_thread_do_not_inherit_real_time() {
    let (allowed, want) = real_time_here();
    let (submitter, normal, best_effort) = std::thread::spawn(move || {
        let lc = realtime_latency_critical();
        stream_policy(&lc);
        // SAFETY: pid 0 names the calling thread.
        let submitter = unsafe { libc::sched_getscheduler(0) };
        let normal = stream_policy(&cpu(Class::Normal));
        let best_effort = stream_policy(&cpu(Class::BestEffort));
        let dir = tempfile::tempdir().unwrap();
        let served = Runtime::builder()
            .backend(BackendKind::Cpu)
            .class(Class::BestEffort)
            .live(dir.path().join("live.sock"))
            .build()
            .unwrap();
        // The serving thread leaves real time as it starts.
        let t0 = std::time::Instant::now();
        while live_thread_policies().contains(&libc::SCHED_FIFO)
            && t0.elapsed() < Duration::from_secs(5)
        {
            std::thread::sleep(Duration::from_millis(5));
        }
        let live = live_thread_policies();
        assert!(!live.is_empty(), "no live-view thread found");
        assert!(
            live.iter().all(|&p| p == libc::SCHED_OTHER),
            "live-view threads' policies: {live:?} (SCHED_FIFO allowed: {allowed})"
        );
        drop(served);
        (submitter, normal, best_effort)
    })
    .join()
    .unwrap();
    assert_eq!(submitter, want, "SCHED_FIFO allowed: {allowed}");
    assert_eq!(normal, libc::SCHED_OTHER, "SCHED_FIFO allowed: {allowed}");
    assert_eq!(
        best_effort,
        libc::SCHED_IDLE,
        "SCHED_FIFO allowed: {allowed}"
    );
}

/// A builder with one stream (tasks on its thread), the class `class` if
/// set, and the placement file `file`.
#[cfg(target_os = "linux")]
fn with_file(file: &str, class: Option<Class>, realtime: bool) -> braid::Result<Runtime> {
    let mut b = Runtime::builder()
        .backend(BackendKind::Cpu)
        .compute_streams(1)
        .oversubscribe(true)
        .inline_short_tasks(false)
        .realtime(realtime)
        .placement(braid::PlacementFile::parse(file, "p.toml").unwrap());
    if let Some(class) = class {
        b = b.class(class);
    }
    b.build()
}

/// A placement file's `[runtime] class` and `realtime` apply where the
/// program's code sets no class: the file makes it best-effort
/// (idle-policy stream threads) or latency-critical with real-time threads
/// (where the process may use them). Real-time threads for a class other
/// than latency-critical fail `build`, naming the file's line when the file
/// asked for them, and the file's class when it set it.
#[cfg(target_os = "linux")]
#[test]
fn the_placement_file_sets_the_class_and_real_time_threads() {
    use braid::Error;
    let build = with_file;
    let rt = build("[runtime]\nclass = \"best-effort\"\n", None, false).unwrap();
    assert_eq!(rt.class(), Class::BestEffort);
    assert_eq!(stream_policy(&rt), libc::SCHED_IDLE);
    drop(rt);

    let (allowed, want) = real_time_here();
    let file = "[runtime]\nclass = \"latency-critical\"\nrealtime = true\n";
    let policy = std::thread::spawn(move || {
        let rt = build(file, None, false).unwrap();
        assert_eq!(rt.class(), Class::LatencyCritical);
        stream_policy(&rt)
    })
    .join()
    .unwrap();
    assert_eq!(policy, want, "SCHED_FIFO allowed: {allowed}");

    match build("[runtime]\n\nrealtime = true\n", Some(Class::Normal), false) {
        Err(Error::Placement {
            file,
            line,
            message,
        }) => {
            assert_eq!((file.as_str(), line), ("p.toml", 3), "{message}");
            assert!(
                message.contains("latency-critical") && message.contains("normal"),
                "{message}"
            );
        }
        other => panic!("expected a placement error, got {other:?}"),
    }
    let e = build("[runtime]\nclass = \"normal\"\n", None, true)
        .unwrap_err()
        .to_string();
    assert!(e.contains("runtime.class") && e.contains("p.toml"), "{e}");
}

/// A class set in code wins over the placement file's: a serving runtime
/// built with `Class::LatencyCritical` stays latency-critical (stream
/// threads at the default policy, not idle) when the file — as
/// `BRAID_PLACEMENT` names for every runtime of the process — says
/// `best-effort` for the training beside it. The file's `realtime` and
/// `spare_sms`, written for a runtime of its class, do not apply to one
/// whose code chose another class (a best-effort runtime is not refused
/// for the serving file's real-time threads); without a class in the file
/// they still do (and real-time threads are refused for a normal one).
#[cfg(target_os = "linux")]
#[test]
fn a_class_set_in_code_wins_over_the_placement_files() {
    let training = "[runtime]\nclass = \"best-effort\"\nspare_sms = 8\n";
    let serving = with_file(training, Some(Class::LatencyCritical), false).unwrap();
    assert_eq!(serving.class(), Class::LatencyCritical);
    assert_eq!(stream_policy(&serving), libc::SCHED_OTHER);
    let plain = with_file(training, None, false).unwrap();
    assert_eq!(plain.class(), Class::BestEffort);
    assert_eq!(stream_policy(&plain), libc::SCHED_IDLE);
    drop((serving, plain));

    let serving_file = "[runtime]\nclass = \"latency-critical\"\nrealtime = true\n";
    let trainer = with_file(serving_file, Some(Class::BestEffort), false).unwrap_or_else(|e| {
        panic!("the serving file's realtime refused a best-effort runtime: {e}")
    });
    assert_eq!(trainer.class(), Class::BestEffort);
    assert_eq!(stream_policy(&trainer), libc::SCHED_IDLE);
    drop(trainer);

    let e = with_file("[runtime]\nrealtime = true\n", Some(Class::Normal), false)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("latency-critical") && e.contains("normal"),
        "{e}"
    );
}

/// Sparing SMs (`RuntimeBuilder::spare_sms`, `[runtime] spare_sms`) is a
/// CUDA setting: on the CPU it is accepted, changes nothing and reports no
/// spared SMs, so one program runs on either backend. Results do not move.
#[test]
fn sparing_sms_changes_nothing_on_the_cpu() {
    use braid::PlacementFile;
    let run = |spare: u32, file: Option<&str>| {
        let mut b = Runtime::builder()
            .backend(BackendKind::Cpu)
            .compute_streams(2)
            .oversubscribe(true)
            .class(Class::BestEffort)
            .spare_sms(spare);
        if let Some(f) = file {
            b = b.placement(PlacementFile::parse(f, "p.toml").unwrap());
        }
        let rt = b.build().unwrap();
        assert_eq!(rt.spared_sms(), None);
        let x = rt.alloc("x", 4 * 64).unwrap();
        for k in 0..8 {
            rt.task("step")
                .run(x.write::<f32>(), move |x| {
                    for (i, v) in x.iter_mut().enumerate() {
                        *v = *v * 0.5 + (i * k) as f32;
                    }
                })
                .unwrap();
        }
        rt.read_vec::<f32>(&x).unwrap()
    };
    let plain = run(0, None);
    assert_eq!(run(16, None), plain);
    assert_eq!(run(0, Some("[runtime]\nspare_sms = 8\n")), plain);
}

/// A best-effort task that had already started when latency-critical work
/// arrived pauses at its next `preemption_point` until that work is done,
/// then goes on; in a normal runtime's task, or outside any task, the point
/// returns at once.
#[test]
fn a_started_best_effort_task_pauses_at_a_preemption_point() {
    let lc = cpu(Class::LatencyCritical);
    let be = cpu(Class::BestEffort);
    let normal = cpu(Class::Normal);
    // The best-effort task starts while the latency-critical runtime is idle.
    let (go_tx, go) = mpsc::channel::<()>();
    let (started_tx, started) = mpsc::channel::<()>();
    let passed = Arc::new(AtomicBool::new(false));
    let b = be.alloc("b", 4).unwrap();
    let flag = passed.clone();
    be.task("train")
        .run(b.write::<u8>(), move |_| {
            started_tx.send(()).unwrap();
            go.recv_timeout(Duration::from_secs(20)).unwrap();
            braid::preemption_point();
            flag.store(true, Ordering::SeqCst);
        })
        .unwrap();
    started.recv_timeout(Duration::from_secs(10)).unwrap();
    // Then a latency-critical task runs and stays unfinished.
    let (release, gate) = mpsc::channel::<()>();
    let (serving_tx, serving) = mpsc::channel::<()>();
    let a = lc.alloc("a", 4).unwrap();
    lc.task("serve")
        .run(a.write::<u8>(), move |_| {
            serving_tx.send(()).unwrap();
            let _ = gate.recv_timeout(Duration::from_secs(20));
        })
        .unwrap();
    serving.recv_timeout(Duration::from_secs(10)).unwrap();
    braid::preemption_point(); // not a task: returns at once
    let n = normal.alloc("n", 4).unwrap();
    normal
        .task("other")
        .run(n.write::<u8>(), |_| braid::preemption_point())
        .unwrap()
        .wait()
        .unwrap();
    go_tx.send(()).unwrap();
    std::thread::sleep(Duration::from_millis(150));
    assert!(
        !passed.load(Ordering::SeqCst),
        "a best-effort task went past its preemption point beside an unfinished latency-critical task"
    );
    release.send(()).unwrap();
    lc.synchronize().unwrap();
    be.synchronize().unwrap();
    assert!(passed.load(Ordering::SeqCst));
}

/// A best-effort runtime copies long uploads and reads in bundles
/// (docs/tenants.md): every byte arrives, in place, whatever the length.
#[test]
fn best_effort_uploads_and_reads_arrive_whole() {
    let be = cpu(Class::BestEffort);
    for len in [5usize, (9 << 20) + 3] {
        let data: Vec<u8> = (0..len).map(|i| (i * 31 + i / 4099) as u8).collect();
        let b = be.alloc("b", len).unwrap();
        be.upload(&b, &data).unwrap();
        assert!(be.read_vec::<u8>(&b).unwrap() == data, "{len} bytes");
        let part = b.view(len / 3..len).unwrap();
        assert!(
            be.read_vec::<u8>(part).unwrap() == data[len / 3..],
            "{len} bytes, from a third"
        );
    }
}

/// Whether this process may put a thread at `SCHED_IDLE` back to the
/// default policy (probed on a scratch thread: it needs `CAP_SYS_NICE` or
/// an `RLIMIT_NICE` of at least 20), and the policy a latency-critical or
/// normal runtime's stream threads get when built by an idle-policy thread.
#[cfg(target_os = "linux")]
fn idle_left_here() -> (bool, i32) {
    probe_policies(
        &[(libc::SCHED_IDLE, 0), (libc::SCHED_OTHER, 0)],
        libc::SCHED_OTHER,
        libc::SCHED_IDLE,
    )
}

/// A thread that entered the best-effort class (`Class::BestEffort.enter()`,
/// as a best-effort program's rank threads do) runs at `SCHED_IDLE`, and
/// Linux threads inherit their creator's policy: a latency-critical or
/// normal runtime it builds still runs its stream threads at the default
/// policy (where the process may leave the idle one), and a best-effort
/// one at the idle policy.
#[cfg(target_os = "linux")]
#[test]
fn runtimes_built_by_a_best_effort_thread_do_not_inherit_the_idle_policy() {
    let (allowed, want) = idle_left_here();
    let one_stream = |class: Class| {
        Runtime::builder()
            .backend(BackendKind::Cpu)
            .compute_streams(1)
            .oversubscribe(true)
            .inline_short_tasks(false)
            .class(class)
            .build()
            .unwrap()
    };
    let (creator, lc, normal, be) = std::thread::spawn(move || {
        Class::BestEffort.enter();
        // SAFETY: pid 0 names the calling thread.
        let creator = unsafe { libc::sched_getscheduler(0) };
        let lc = stream_policy(&one_stream(Class::LatencyCritical));
        let normal = stream_policy(&one_stream(Class::Normal));
        let be = stream_policy(&one_stream(Class::BestEffort));
        (creator, lc, normal, be)
    })
    .join()
    .unwrap();
    assert_eq!(creator, libc::SCHED_IDLE);
    assert_eq!(
        (lc, normal, be),
        (want, want, libc::SCHED_IDLE),
        "leaving SCHED_IDLE allowed: {allowed}"
    );
}

/// A best-effort runtime's stream thread whose task body submits to, and
/// waits on, a latency-critical runtime with real-time threads is not
/// promoted: it stays at the idle policy (were it promoted, the training
/// would run at `SCHED_FIFO` from then on, beside the program that asked
/// for real time). Where the process may not use `SCHED_FIFO` the test
/// cannot tell the difference.
#[cfg(target_os = "linux")]
#[test]
fn a_best_effort_stream_thread_is_never_promoted_to_real_time() {
    let (allowed, _) = real_time_here();
    let lc = Arc::new(realtime_latency_critical());
    let be = Runtime::builder()
        .backend(BackendKind::Cpu)
        .compute_streams(1)
        .oversubscribe(true)
        .class(Class::BestEffort)
        .build()
        .unwrap();
    assert_eq!(stream_policy(&be), libc::SCHED_IDLE);
    let b = be.alloc("b", 4).unwrap();
    let server = lc.clone();
    be.task("asks the server")
        .run(b.write::<u8>(), move |_| {
            let x = server.alloc("x", 4).unwrap();
            server
                .task("answer")
                .run(x.write::<u8>(), |_| ())
                .unwrap()
                .wait()
                .unwrap();
            server.read_vec::<u8>(&x).unwrap();
        })
        .unwrap();
    be.synchronize().unwrap();
    assert_eq!(
        stream_policy(&be),
        libc::SCHED_IDLE,
        "SCHED_FIFO allowed: {allowed}"
    );
    assert_eq!(stream_policy(&lc), real_time_here().1);
}

/// A latency-critical task that waits on a best-effort runtime (a task's
/// handle, `synchronize`, `read_vec`) would wait forever: best-effort tasks
/// do not start while a latency-critical task is unfinished. It gets an
/// error naming both classes and what to do instead, not a hang (the test
/// gives it 20 s); the best-effort task runs once the latency-critical one
/// ends.
#[test]
fn a_latency_critical_task_may_not_wait_on_a_best_effort_runtime() {
    let (lc, be) = (
        cpu(Class::LatencyCritical),
        Arc::new(cpu(Class::BestEffort)),
    );
    let a = lc.alloc("a", 4).unwrap();
    let b = be.alloc("b", 4).unwrap();
    let (handle_tx, handle) = mpsc::channel::<braid::TaskHandle>();
    let (said_tx, said) = mpsc::channel::<Vec<String>>();
    let trainer = be.clone();
    let weights = b.clone();
    lc.task("request")
        .run(a.write::<u8>(), move |_| {
            let h = handle.recv().unwrap();
            let errors = vec![
                h.wait().map_err(|e| e.to_string()),
                trainer.synchronize().map_err(|e| e.to_string()),
                trainer
                    .read_vec::<u8>(&weights)
                    .map(drop)
                    .map_err(|e| e.to_string()),
            ];
            said_tx
                .send(
                    errors
                        .into_iter()
                        .map(|r| r.err().unwrap_or_default())
                        .collect(),
                )
                .unwrap();
        })
        .unwrap();
    let h = be.task("weights").run(b.write::<u8>(), |_| ()).unwrap();
    handle_tx.send(h.clone()).unwrap();
    let Ok(said) = said.recv_timeout(Duration::from_secs(20)) else {
        // The latency-critical stream thread is stuck: dropping would wait.
        std::mem::forget((lc, be));
        panic!("a latency-critical task waiting on a best-effort runtime hung");
    };
    for (what, e) in [
        "TaskHandle::wait",
        "Runtime::synchronize",
        "Runtime::read_vec",
    ]
    .iter()
    .zip(&said)
    {
        assert!(
            e.contains(what)
                && e.contains("best-effort")
                && e.contains("latency-critical")
                && e.contains("wait outside"),
            "{what}: {e:?}"
        );
    }
    lc.synchronize().unwrap();
    h.wait().unwrap();
    be.synchronize().unwrap();
}

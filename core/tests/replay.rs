//! Record and replay: random programs recorded, replayed several times,
//! interleaved with eager tasks and followed by a program that diverges give,
//! bit for bit, the sequential result; failures inside a replay name the
//! task, skip its dependents and leave the runtime usable.

mod common;

use braid::{BackendKind, Error, Policy, Runtime, TaskKind};
use common::*;
use proptest::prelude::*;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

/// How replays run: one program per CPU stream (the CPU's default), one
/// task record per step (as on CUDA without graphs), or one unit (graphs:
/// a CUDA graph launch, on the CPU a sequential run).
#[derive(Debug, Clone, Copy)]
enum Mode {
    Programs,
    Tasks,
    Graph,
}

const MODES: [Mode; 3] = [Mode::Programs, Mode::Tasks, Mode::Graph];

fn in_mode(b: braid::RuntimeBuilder, m: Mode) -> braid::RuntimeBuilder {
    b.replay_as_tasks(matches!(m, Mode::Tasks))
        .graphs(matches!(m, Mode::Graph))
}

fn cases() -> u32 {
    std::env::var("BRAID_PROPTEST_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1500)
        / 3
}

/// How a random program is cut: an eager prefix, the recorded step, eager
/// tasks between some replays, and an eager suffix.
#[derive(Debug, Clone)]
struct Cut {
    step: std::ops::Range<usize>,
    between: std::ops::Range<usize>,
    replays: usize,
    /// Bit `k`: the `between` tasks are submitted before replay `k`.
    mask: u8,
}

fn cut(n: usize) -> impl Strategy<Value = Cut> {
    (0..=n, 0..=n, 0..=n, 1usize..4, any::<u8>()).prop_map(move |(a, b, c, replays, mask)| {
        let mut v = [a, b, c];
        v.sort_unstable();
        Cut {
            step: v[0]..v[1],
            between: v[1]..v[2],
            replays,
            mask,
        }
    })
}

/// The task sequence the replays stand for, in program order.
fn unrolled(p: &Program, c: &Cut) -> Program {
    let t = &p.tasks;
    let mut tasks: Vec<GenTask> = t[..c.step.start].to_vec();
    tasks.extend_from_slice(&t[c.step.clone()]);
    for k in 0..c.replays {
        if c.mask >> k & 1 == 1 {
            tasks.extend_from_slice(&t[c.between.clone()]);
        }
        tasks.extend_from_slice(&t[c.step.clone()]);
    }
    tasks.extend_from_slice(&t[c.between.end..]);
    Program {
        sizes: p.sizes.clone(),
        tasks,
    }
}

/// Some tasks are host tasks (one in five, by their salt): a graph replay
/// cuts the schedule around them, as around collectives.
fn kind(t: &GenTask) -> TaskKind {
    if t.salt % 5 == 0 {
        TaskKind::Host
    } else {
        TaskKind::Compute
    }
}

fn with_replays(rt: &Runtime, p: &Program, c: &Cut) -> Vec<Vec<u32>> {
    let bufs = alloc_buffers(rt, p);
    submit_tasks(rt, &bufs, &p.tasks[..c.step.start]);
    let step = rt
        .record("step", |rt| {
            submit_tasks_as(rt, &bufs, &p.tasks[c.step.clone()], kind);
            Ok(())
        })
        .unwrap();
    assert_eq!(step.len(), c.step.len());
    for k in 0..c.replays {
        if c.mask >> k & 1 == 1 {
            submit_tasks(rt, &bufs, &p.tasks[c.between.clone()]);
        }
        step.replay().unwrap();
    }
    // The program diverges: eager tasks again.
    submit_tasks(rt, &bufs, &p.tasks[c.between.end..]);
    read_back(rt, &bufs)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn replays_match_sequential(
        (p, c) in program(30).prop_flat_map(|p| { let n = p.tasks.len(); (Just(p), cut(n)) }),
        streams in 1usize..=8,
        policy in prop_oneof![Just(Policy::Single), Just(Policy::RoundRobin), Just(Policy::Affinity)],
        window in prop_oneof![Just(1usize), Just(3), Just(4096)],
        mode in prop_oneof![Just(Mode::Programs), Just(Mode::Tasks), Just(Mode::Graph)],
    ) {
        let expected = sequential(&unrolled(&p, &c));
        for backend in backends() {
            let rt = in_mode(Runtime::builder(), mode)
                .backend(backend)
                .compute_streams(streams)
                .policy(policy)
                .launch_window(window)
                .build()
                .unwrap();
            let got = with_replays(&rt, &p, &c);
            prop_assert_eq!(&got, &expected, "backend {:?}", backend);
        }
    }
}

/// Long steps replayed many times, on every stream count and policy.
#[test]
fn long_steps_replayed_many_times() {
    use proptest::strategy::ValueTree;
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    for streams in 1..=8 {
        for policy in Policy::ALL {
            for mode in MODES {
                let p = program(200).new_tree(&mut runner).unwrap().current();
                let n = p.tasks.len();
                let c = Cut {
                    step: n / 4..n / 2,
                    between: n / 2..n / 2 + 3.min(n - n / 2),
                    replays: 3,
                    mask: 0b101,
                };
                let rt = in_mode(Runtime::builder(), mode)
                    .backend(BackendKind::Cpu)
                    .compute_streams(streams)
                    .policy(policy)
                    .build()
                    .unwrap();
                assert_eq!(
                    with_replays(&rt, &p, &c),
                    sequential(&unrolled(&p, &c)),
                    "{streams} streams, {policy}, {mode:?}"
                );
            }
        }
    }
}

/// A CPU runtime of two compute streams that replays in `mode`.
fn runtime_in(mode: Mode) -> Runtime {
    in_mode(Runtime::builder(), mode)
        .backend(BackendKind::Cpu)
        .compute_streams(2)
        .build()
        .unwrap()
}

fn runtimes() -> Vec<Runtime> {
    MODES.into_iter().map(runtime_in).collect()
}

/// Records a step over `[x, y, z]`: "flaky" adds 1 to `x` and fails in its
/// second run (the first replay); with `copy_to`, the host task "copy x"
/// copies `x` there; "after flaky" copies `x` to `y`; "independent" adds 10
/// to `z`.
fn flaky_step<'rt>(
    rt: &'rt Runtime,
    [x, y, z]: [&braid::Buffer; 3],
    copy_to: Option<&braid::Buffer>,
) -> braid::Schedule<'rt> {
    let runs = Arc::new(AtomicU32::new(0));
    rt.record("step", |rt| {
        rt.task("flaky").run(x.read_write::<u32>(), move |x| {
            if runs.fetch_add(1, Ordering::Relaxed) == 1 {
                return Err("the second run fails".into());
            }
            x[0] += 1;
            Ok(())
        })?;
        if let Some(w) = copy_to {
            rt.task("copy x")
                .kind(TaskKind::Host)
                .run((x.read::<u32>(), w.write::<u32>()), |(x, w)| w[0] = x[0])?;
        }
        rt.task("after flaky")
            .run((x.read::<u32>(), y.write::<u32>()), |(x, y)| y[0] = x[0])?;
        rt.task("independent")
            .run(z.read_write::<u32>(), |z| z[0] += 10)?;
        Ok(())
    })
    .unwrap()
}

/// Asserts that a replay of the schedule "step" ended in `outcome` failed
/// for `cause` (`DependencyFailed`); `case` is printed with a failure.
fn replay_failed_for(outcome: braid::Result<()>, cause: &str, case: impl std::fmt::Debug) {
    match outcome {
        Err(Error::DependencyFailed { task, cause: c, .. }) => {
            assert_eq!((task.as_str(), c.as_str()), ("step", cause), "{case:?}");
        }
        other => panic!("{case:?}: expected the replay to name `{cause}`, got {other:?}"),
    }
}

#[test]
fn a_failing_task_in_a_replay_names_itself_and_skips_its_dependents() {
    for rt in runtimes() {
        let x = rt.alloc_from("x", &[1u32]).unwrap();
        let y = rt.alloc("y", 4).unwrap();
        let z = rt.alloc("z", 4).unwrap();
        let step = flaky_step(&rt, [&x, &y, &z], None);
        rt.synchronize().unwrap();
        replay_failed_for(step.replay().unwrap().wait(), "flaky", "");
        let e = rt.synchronize().unwrap_err().to_string();
        assert!(e.contains("flaky") && e.contains("second run fails"), "{e}");
        // The dependent was skipped, the independent task ran.
        assert_eq!(rt.read_vec::<u32>(&y).unwrap(), vec![2]);
        assert_eq!(rt.read_vec::<u32>(&z).unwrap(), vec![20]);
        // An eager task after the failed replay depends on it: skipped too;
        // reported at synchronize (nothing left to report: it was a skip).
        // Then the runtime and the schedule are usable again.
        rt.synchronize().unwrap();
        step.replay().unwrap().wait().unwrap();
        assert_eq!(rt.read_vec::<u32>(&x).unwrap(), vec![3]);
        assert_eq!(rt.read_vec::<u32>(&y).unwrap(), vec![3]);
        assert_eq!(rt.read_vec::<u32>(&z).unwrap(), vec![30]);
        let stats = rt.stats();
        assert_eq!((stats.replays, stats.replayed_tasks), (2, 6));
    }
}

/// A read-back inside a recording is refused, naming the buffer (every
/// replay would read into a result nobody sees); the recording goes on,
/// and after it reads work.
#[test]
fn a_read_back_inside_a_recording_is_refused() {
    let rt = Runtime::builder()
        .backend(BackendKind::Cpu)
        .build()
        .unwrap();
    let x = rt.alloc_from("x", &[1u32]).unwrap();
    let step = rt
        .record("step", |rt| {
            rt.task("bump").run(x.read_write::<u32>(), |x| x[0] += 1)?;
            let e = rt.read_vec::<u32>(&x).unwrap_err();
            assert!(
                matches!(&e, Error::Usage(m) if m.contains("`x`") && m.contains("recorded")),
                "{e}"
            );
            Ok(())
        })
        .unwrap();
    assert_eq!(step.len(), 1);
    step.replay().unwrap();
    assert_eq!(rt.read_vec::<u32>(&x).unwrap(), vec![3]);
}

/// A replay skipped behind a failed replay of the same schedule names the
/// task that failed as its cause, not the schedule (which read as the
/// schedule depending on itself).
#[test]
fn a_replay_behind_a_failed_replay_names_the_task_that_failed() {
    for (mode, rt) in MODES.into_iter().zip(runtimes()) {
        let x = rt.alloc_from("x", &[1u32]).unwrap();
        let y = rt.alloc("y", 4).unwrap();
        let z = rt.alloc("z", 4).unwrap();
        let step = flaky_step(&rt, [&x, &y, &z], None);
        rt.synchronize().unwrap();
        let (first, second) = (step.replay().unwrap(), step.replay().unwrap());
        replay_failed_for(first.wait(), "flaky", (mode, "first"));
        replay_failed_for(second.wait(), "flaky", (mode, "second"));
        let e = rt.synchronize().unwrap_err().to_string();
        assert!(e.contains("flaky") && e.contains("second run fails"), "{e}");
    }
}

/// Records a step with two parts: "slow" on compute stream 1 writes `b`,
/// "quick" on stream 0 writes `a` (`quick_last`: recorded after "slow",
/// so stream 0 also holds the replay's join). In every run after the
/// recording "slow" waits, for up to 10 s, for `go`, and the step's
/// `slow_saw_go` says whether it came: set by an eager task submitted
/// after the replay.
fn two_part_step<'rt>(
    rt: &'rt Runtime,
    [a, b]: [&braid::Buffer; 2],
    quick_last: bool,
    go: &Arc<std::sync::atomic::AtomicBool>,
) -> (braid::Schedule<'rt>, Arc<std::sync::atomic::AtomicBool>) {
    let saw = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let runs = AtomicU32::new(0);
    let (go, saw2) = (go.clone(), saw.clone());
    let quick = |rt: &Runtime| {
        rt.task("quick")
            .on_stream(0)
            .run(a.write::<u32>(), |a| a[0] += 1)
            .map(drop)
    };
    let step = rt
        .record("step", |rt| {
            if quick_last {
                // Nothing else on stream 0 before the join.
            } else {
                quick(rt)?;
            }
            rt.task("slow")
                .on_stream(1)
                .run(b.write::<u32>(), move |b| {
                    if runs.fetch_add(1, Ordering::Relaxed) > 0 {
                        let t0 = std::time::Instant::now();
                        while !go.load(Ordering::Acquire) && t0.elapsed().as_secs() < 10 {
                            std::thread::sleep(std::time::Duration::from_millis(1));
                        }
                        saw2.store(go.load(Ordering::Acquire), Ordering::Release);
                    }
                    b[0] += 1;
                })?;
            if quick_last {
                quick(rt)?;
            }
            Ok(())
        })
        .unwrap();
    (step, saw)
}

/// A CPU runtime with three compute streams and four zeroed `u32`s, `a` to
/// `d`.
fn three_streams_four_words() -> (Runtime, [braid::Buffer; 4]) {
    let rt = Runtime::builder()
        .backend(BackendKind::Cpu)
        .compute_streams(3)
        .build()
        .unwrap();
    let words = ["a", "b", "c", "d"].map(|n| rt.alloc_from(n, &[0u32]).unwrap());
    (rt, words)
}

/// Finer units: to the tracker a replay on several CPU streams is one unit
/// per stream, so an eager task that reads only what stream 0's part wrote
/// runs while stream 1's part is still running (it lets "slow" finish; if it
/// waited for the whole replay, "slow" would give up after 10 s and the
/// test fail). With the join on stream 0 too: that part is published as
/// soon as its last task ends, not with the join. A task that touches what
/// "slow" wrote still waits for it; results as in program order.
#[test]
fn an_eager_task_after_a_replay_waits_only_for_the_part_it_touches() {
    for quick_last in [false, true] {
        let (rt, [a, b, c, d]) = three_streams_four_words();
        let go = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (step, saw) = two_part_step(&rt, [&a, &b], quick_last, &go);
        rt.synchronize().unwrap();
        step.replay().unwrap();
        let go2 = go.clone();
        rt.task("reads a")
            .on_stream(2)
            .run((a.read::<u32>(), c.write::<u32>()), move |(a, c)| {
                c[0] = a[0] * 10;
                go2.store(true, Ordering::Release);
            })
            .unwrap();
        rt.task("reads b")
            .on_stream(2)
            .run((b.read::<u32>(), d.write::<u32>()), |(b, d)| {
                d[0] = b[0] * 10
            })
            .unwrap();
        rt.synchronize().unwrap();
        assert!(
            saw.load(Ordering::Acquire),
            "quick_last {quick_last}: the reader of `a` waited for the whole replay"
        );
        assert_eq!(rt.read_vec::<u32>(&c).unwrap(), vec![20]);
        assert_eq!(rt.read_vec::<u32>(&d).unwrap(), vec![20]);
    }
}

/// With finer units, a failure in one stream's part of a replay skips the
/// eager tasks that depend on that part and no others: here "fails" fails in
/// its second run (the replay), so the reader of `b` is skipped and the
/// reader of `a` runs; the replay's handle names the failed task; then the
/// schedule replays normally.
#[test]
fn a_failure_in_one_part_of_a_replay_skips_only_its_dependents() {
    let (rt, [a, b, c, d]) = three_streams_four_words();
    let runs = AtomicU32::new(0);
    let step = rt
        .record("step", |rt| {
            rt.task("fine")
                .on_stream(0)
                .run(a.read_write::<u32>(), |a| a[0] += 1)?;
            rt.task("fails")
                .on_stream(1)
                .run(b.read_write::<u32>(), move |b| {
                    if runs.fetch_add(1, Ordering::Relaxed) == 1 {
                        return Err("the second run fails".into());
                    }
                    b[0] += 1;
                    Ok(())
                })?;
            Ok(())
        })
        .unwrap();
    rt.synchronize().unwrap();
    let h = step.replay().unwrap();
    let ca = rt
        .task("reads a")
        .on_stream(2)
        .run((a.read::<u32>(), c.write::<u32>()), |(a, c)| c[0] = a[0])
        .unwrap();
    let db = rt
        .task("reads b")
        .on_stream(2)
        .run((b.read::<u32>(), d.write::<u32>()), |(b, d)| d[0] = b[0])
        .unwrap();
    replay_failed_for(h.wait(), "fails", "");
    ca.wait().unwrap();
    match db.wait() {
        Err(Error::DependencyFailed { task, .. }) => assert_eq!(task, "reads b"),
        other => panic!("expected `reads b` to be skipped, got {other:?}"),
    }
    let e = rt.synchronize().unwrap_err().to_string();
    assert!(e.contains("fails") && e.contains("second run fails"), "{e}");
    assert_eq!(rt.read_vec::<u32>(&c).unwrap(), vec![2]);
    assert_eq!(rt.read_vec::<u32>(&d).unwrap(), vec![0]);
    step.replay().unwrap().wait().unwrap();
    assert_eq!(rt.read_vec::<u32>(&a).unwrap(), vec![3]);
    assert_eq!(rt.read_vec::<u32>(&b).unwrap(), vec![2]);
}

/// A task submitted before a replay fails: the replay's tasks that depend
/// on it (directly, or through other tasks of the replay) are skipped, and
/// the others run, as they would if the step were submitted again; the
/// replay names the failed task. So in a program run and in a materialised
/// replay (one task record per step, CUDA without graphs), which gives each
/// step the external predecessors its accesses meet; "reads d and a" is
/// skipped for its own read of `a` while the task it follows runs. A graph
/// replay runs whole or not at all. Then the schedule replays normally.
#[test]
fn a_failure_before_a_replay_skips_only_the_tasks_that_depend_on_it() {
    for mode in MODES {
        let whole = matches!(mode, Mode::Graph);
        let rt = runtime_in(mode);
        let [a, b, c, d, e] = ["a", "b", "c", "d", "e"].map(|n| rt.alloc_from(n, &[0u32]).unwrap());
        let step = rt
            .record("step", |rt| {
                rt.task("reads a")
                    .run((a.read::<u32>(), c.write::<u32>()), |(a, c)| {
                        c[0] = a[0] + 1
                    })?;
                rt.task("independent")
                    .run(d.read_write::<u32>(), |d| d[0] += 1)?;
                rt.task("reads d and a").run(
                    (d.read::<u32>(), a.read::<u32>(), e.write::<u32>()),
                    |(d, a, e)| e[0] = d[0] + a[0],
                )?;
                rt.task("after reads a")
                    .run((c.read::<u32>(), b.write::<u32>()), |(c, b)| {
                        b[0] = c[0] * 10
                    })?;
                Ok(())
            })
            .unwrap();
        rt.synchronize().unwrap();
        rt.task("breaks a")
            .run(a.write::<u32>(), |_| Err("broken".into()))
            .unwrap();
        replay_failed_for(step.replay().unwrap().wait(), "breaks a", mode);
        let err = rt.synchronize().unwrap_err().to_string();
        assert!(
            err.contains("breaks a") && err.contains("broken"),
            "{mode:?}: {err}"
        );
        // The dependents kept the recording run's values; the independent
        // task ran again, unless the replay was skipped whole.
        let words = |rt: &Runtime| [&b, &c, &d, &e].map(|w| rt.read_vec::<u32>(w).unwrap()[0]);
        let ran = if whole { 1 } else { 2 };
        assert_eq!(words(&rt), [10, 1, ran, 1], "{mode:?}");
        step.replay().unwrap().wait().unwrap();
        assert_eq!(words(&rt), [10, 1, ran + 1, ran + 1], "{mode:?}");
    }
}

/// A graph replay cut around a host task (as around a collective): a
/// failure names the task that failed, and skips the later parts that
/// depend on the part it happened in, whole (a graph runs whole or not at
/// all) — here an independent task that shares a part with a dependent.
/// Without graphs only the dependents are skipped. Then the runtime and the
/// schedule are usable again.
#[test]
fn a_failure_in_a_cut_graph_replay_names_the_task_and_skips_later_parts() {
    for mode in MODES {
        let graph = matches!(mode, Mode::Graph);
        let rt = runtime_in(mode);
        let x = rt.alloc_from("x", &[1u32]).unwrap();
        let [y, w, z] = ["y", "w", "z"].map(|n| rt.alloc(n, 4).unwrap());
        let step = flaky_step(&rt, [&x, &y, &z], Some(&w));
        rt.synchronize().unwrap();
        replay_failed_for(step.replay().unwrap().wait(), "flaky", mode);
        let e = rt.synchronize().unwrap_err().to_string();
        assert!(e.contains("flaky") && e.contains("second run fails"), "{e}");
        assert_eq!(step.graph_shape(), graph.then_some((2, 1)), "{mode:?}");
        let read = |b: &braid::Buffer| rt.read_vec::<u32>(b).unwrap()[0];
        assert_eq!((read(&x), read(&w), read(&y)), (2, 2, 2), "{mode:?}");
        assert_eq!(read(&z), if graph { 10 } else { 20 }, "{mode:?}");
        step.replay().unwrap().wait().unwrap();
        assert_eq!((read(&x), read(&w), read(&y)), (3, 3, 3), "{mode:?}");
        assert_eq!(read(&z), if graph { 20 } else { 30 }, "{mode:?}");
    }
}

/// Explicit edges (`TaskBuilder::after`) among recorded tasks hold in every
/// replay, across the parts of a cut graph replay too: a host task after a
/// slow task on another stream, with no data between them, sees its effect.
#[test]
fn explicit_edges_hold_across_the_parts_of_a_graph_replay() {
    for mode in MODES {
        let rt = in_mode(Runtime::builder(), mode)
            .backend(BackendKind::Cpu)
            .compute_streams(2)
            .oversubscribe(true)
            .build()
            .unwrap();
        let a = rt.alloc("a", 4).unwrap();
        let runs = Arc::new(AtomicU32::new(0));
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let (r, r2, s) = (runs.clone(), runs.clone(), seen.clone());
        let step = rt
            .record("step", |rt| {
                let slow = rt
                    .task("slow")
                    .on_stream(1)
                    .run(a.write::<u32>(), move |a| {
                        std::thread::sleep(std::time::Duration::from_millis(20));
                        a[0] = r.fetch_add(1, Ordering::SeqCst) + 1;
                    })?;
                rt.task("host after slow")
                    .kind(TaskKind::Host)
                    .on_stream(0)
                    .after(&slow)
                    .run((), move |()| {
                        s.lock().unwrap().push(r2.load(Ordering::SeqCst));
                    })?;
                Ok(())
            })
            .unwrap();
        for _ in 0..3 {
            step.replay().unwrap();
        }
        rt.synchronize().unwrap();
        assert_eq!(*seen.lock().unwrap(), [1, 2, 3, 4], "{mode:?}");
        let graph = matches!(mode, Mode::Graph);
        assert_eq!(step.graph_shape(), graph.then_some((1, 1)), "{mode:?}");
    }
}

#[test]
fn a_panic_in_a_replay_is_reported_and_nothing_hangs() {
    for rt in runtimes() {
        let x = rt.alloc("x", 4).unwrap();
        let runs = Arc::new(AtomicU32::new(0));
        let r = runs.clone();
        let step = rt
            .record("step", |rt| {
                rt.task("panics later").run(x.write::<u32>(), move |x| {
                    assert!(r.fetch_add(1, Ordering::Relaxed) == 0, "boom");
                    x[0] = 1;
                })?;
                Ok(())
            })
            .unwrap();
        step.replay().unwrap();
        let after = rt.task("reader").run(x.read::<u32>(), |_| ()).unwrap();
        assert!(matches!(after.wait(), Err(Error::DependencyFailed { .. })));
        match rt.synchronize() {
            Err(Error::TaskPanicked { task, message }) => {
                assert_eq!(task, "panics later");
                assert!(message.contains("boom"));
            }
            other => panic!("expected the panic, got {other:?}"),
        }
        rt.task("writer")
            .run(x.write::<u32>(), |x| x[0] = 7)
            .unwrap();
        assert_eq!(rt.read_vec::<u32>(&x).unwrap(), vec![7]);
    }
}

#[test]
fn recording_refuses_nesting_and_replaying_inside_a_recording() {
    let rt = Runtime::cpu().unwrap();
    let x = rt.alloc("x", 4).unwrap();
    let step = rt
        .record("outer", |rt| {
            rt.task("inc").run(x.read_write::<u32>(), |x| x[0] += 1)?;
            let nested = rt.record("inner", |_| Ok(()));
            assert!(matches!(nested, Err(Error::Usage(_))), "{nested:?}");
            Ok(())
        })
        .unwrap();
    let _again = rt
        .record("other", |_| {
            let e = step.replay().unwrap_err();
            assert!(e.to_string().contains("outer"), "{e}");
            Ok(())
        })
        .unwrap();
    // An error from the program is returned; its tasks still ran.
    let e = rt
        .record("failing", |rt| {
            rt.task("inc").run(x.read_write::<u32>(), |x| x[0] += 1)?;
            Err(Error::Config("the program gave up".into()))
        })
        .unwrap_err();
    assert!(e.to_string().contains("gave up"));
    step.replay().unwrap();
    assert_eq!(rt.read_vec::<u32>(&x).unwrap(), vec![3]);
}

#[test]
fn replay_with_writes_the_argument_block_first() {
    for rt in runtimes() {
        let args = rt.alloc("args", 4).unwrap();
        let acc = rt.alloc("acc", 4).unwrap();
        let step = rt
            .record("step", |rt| {
                rt.task("add arg")
                    .run((args.read::<u32>(), acc.read_write::<u32>()), |(a, acc)| {
                        acc[0] = acc[0] * 10 + a[0]
                    })?;
                Ok(())
            })
            .unwrap();
        for k in 1..=4u32 {
            step.replay_with(&args, &[k]).unwrap();
        }
        assert_eq!(rt.read_vec::<u32>(&acc).unwrap(), vec![1234]);
    }
}

/// Collectives recorded in a schedule get a new index at each replay, so the
/// ranks keep matching; results equal the sequential sums.
#[test]
fn collectives_replay_across_ranks() {
    for mode in MODES {
        collectives_replay_in(mode);
    }
}

fn collectives_replay_in(mode: Mode) {
    let results = braid::launch(2, |rank, comm| -> braid::Result<Vec<f32>> {
        let rt = in_mode(Runtime::builder(), mode)
            .backend(BackendKind::Cpu)
            .rank(rank)
            .build()?;
        let comm = comm.bind(&rt)?;
        let x = rt.alloc_from("x", &[1.0f32 + comm.rank() as f32; 3])?;
        let step = rt.record("step", |rt| {
            rt.task("double").run(x.read_write::<f32>(), |x| {
                x.iter_mut().for_each(|v| *v *= 2.0)
            })?;
            comm.all_reduce::<f32>(&x.whole(), braid::comm::ReduceOp::Sum)?;
            Ok(())
        })?;
        step.replay()?;
        step.replay()?;
        // With graphs, the step is cut around its collective: one graph
        // (on the CPU a sequential run), then the all-reduce as a task.
        let graphs = matches!(mode, Mode::Graph);
        assert_eq!(step.graph_refusal(), None);
        assert_eq!(step.graph_shape(), graphs.then_some((1, 1)), "{mode:?}");
        assert_eq!(rt.stats().graph_replays, if graphs { 2 } else { 0 });
        let out = rt.read_vec::<f32>(&x)?;
        rt.synchronize()?;
        Ok(out)
    });
    // Each run doubles x on each rank, then sums over the two ranks.
    // Run 1: (2 + 4) = 6; run 2: 12 + 12 = 24; run 3: 48 + 48 = 96.
    for r in results {
        assert_eq!(r.unwrap(), vec![96.0; 3]);
    }
}

/// A CPU runtime of rank `rank` with two compute streams, replaying as
/// graphs or not, with the collectives inside them or not.
fn rank_runtime(rank: usize, graphs: bool, collectives: bool) -> braid::Result<Runtime> {
    Runtime::builder()
        .backend(BackendKind::Cpu)
        .compute_streams(2)
        .oversubscribe(true)
        .rank(rank)
        .graphs(graphs)
        .graph_collectives(collectives)
        .build()
}

/// With `graph_collectives(true)` the collectives go into the graph: a step
/// of two ranks with two all-reduces between compute tasks on two streams
/// is one graph (on the CPU a sequential run on the communication stream),
/// its collectives take a new index at each replay, so an eager all-reduce
/// after the replays still matches across ranks, and the results are those
/// of the step cut around its collectives.
#[test]
fn collectives_go_into_graphs_when_asked() {
    let run = |collectives: bool| {
        braid::launch(2, |rank, comm| -> braid::Result<(Vec<f32>, Vec<f32>)> {
            let rt = rank_runtime(rank, true, collectives)?;
            let comm = comm.bind(&rt)?;
            let x = rt.alloc_from("x", &[1.0f32 + rank as f32; 3])?;
            let y = rt.alloc_from("y", &[10.0f32 * (rank as f32 + 1.0); 2])?;
            let sum = braid::comm::ReduceOp::Sum;
            let step = rt.record("step", |rt| {
                rt.task("double")
                    .on_stream(0)
                    .run(x.read_write::<f32>(), |x| {
                        x.iter_mut().for_each(|v| *v *= 2.0)
                    })?;
                rt.task("y + 1")
                    .on_stream(1)
                    .run(y.read_write::<f32>(), |y| {
                        y.iter_mut().for_each(|v| *v += 1.0)
                    })?;
                comm.all_reduce::<f32>(&x.whole(), sum)?;
                comm.all_reduce::<f32>(&y.whole(), braid::comm::ReduceOp::Max)?;
                rt.task("x + 1")
                    .on_stream(0)
                    .run(x.read_write::<f32>(), |x| {
                        x.iter_mut().for_each(|v| *v += 1.0)
                    })?;
                Ok(())
            })?;
            for _ in 0..3 {
                step.replay()?;
            }
            // Cut: [double, y + 1] | all-reduce x | all-reduce y | [x + 1].
            let shape = if collectives { (1, 0) } else { (2, 2) };
            assert_eq!(step.graph_refusal(), None);
            assert_eq!(step.graph_shape(), Some(shape), "{collectives}");
            assert_eq!(rt.stats().graph_replays, 3);
            comm.all_reduce::<f32>(&x.whole(), sum)?;
            rt.synchronize()?;
            Ok((rt.read_vec::<f32>(&x)?, rt.read_vec::<f32>(&y)?))
        })
    };
    // The recording and three replays, then one more all-reduce of x.
    let (mut x, mut y) = ([1.0f32, 2.0], [10.0f32, 20.0]);
    for _ in 0..4 {
        let s: f32 = x.iter().map(|v| 2.0 * v).sum::<f32>() + 1.0;
        x = [s, s];
        let m = y.iter().map(|v| v + 1.0).fold(f32::MIN, f32::max);
        y = [m, m];
    }
    let want = (vec![2.0 * x[0]; 3], vec![y[0]; 2]);
    for collectives in [false, true] {
        for r in run(collectives) {
            assert_eq!(r.unwrap(), want, "collectives in graphs: {collectives}");
        }
    }
}

/// A task that fails inside a graph holding collectives skips the
/// collective that depends on it, which poisons the communicator: the other
/// rank's collective fails instead of waiting, every rank reports it, and
/// the runtimes stay usable.
#[test]
fn a_failure_in_a_graph_with_collectives_fails_every_rank() {
    let config = braid::LocalCommConfig::default().timeout(std::time::Duration::from_secs(30));
    let out = braid::launch_with(2, config, |rank, comm| -> braid::Result<Vec<u32>> {
        let rt = Runtime::builder()
            .backend(BackendKind::Cpu)
            .rank(rank)
            .graphs(true)
            .graph_collectives(true)
            .build()?;
        let comm = comm.bind(&rt)?;
        let x = rt.alloc_from("x", &[1.0f32; 4])?;
        let runs = Arc::new(AtomicU32::new(0));
        let step = rt.record("step", |rt| {
            rt.task("flaky").run(x.read_write::<f32>(), move |x| {
                // Rank 1 fails in its second run (the first replay).
                if rank == 1 && runs.fetch_add(1, Ordering::Relaxed) == 1 {
                    return Err("the second run fails".into());
                }
                x[0] += 1.0;
                Ok(())
            })?;
            comm.all_reduce::<f32>(&x.whole(), braid::comm::ReduceOp::Sum)?;
            Ok(())
        })?;
        let replayed = step.replay()?.wait();
        assert_eq!(step.graph_shape(), Some((1, 0)));
        let e = rt.synchronize().expect_err("the replay failed");
        assert!(replayed.is_err(), "rank {rank}: {replayed:?}");
        assert!(comm.poisoned().is_some(), "rank {rank}");
        // Usable again.
        let n = rt.alloc_from("n", &[1u32])?;
        rt.task("after").run(n.read_write::<u32>(), |n| n[0] += 1)?;
        let after = rt.read_vec::<u32>(&n)?;
        Err(Error::Config(format!("{e} / {after:?}")))
    });
    let msg = |r: &braid::Result<Vec<u32>>| match r {
        Err(Error::Config(m)) => m.clone(),
        other => panic!("{other:?}"),
    };
    let (m0, m1) = (msg(&out[0]), msg(&out[1]));
    assert!(
        m0.contains("skipped on this rank") && m0.ends_with("[2]"),
        "{m0}"
    );
    assert!(
        m1.contains("second run fails") && m1.ends_with("[2]"),
        "{m1}"
    );
}

/// With graphs on, a replay is one unit on one stream: the two independent
/// chains of a step recorded on two streams run in order on one thread, the
/// first graph replay after the recording's tasks, and the result is the
/// sequential one.
#[test]
fn graph_replays_run_as_one_unit() {
    let rt = in_mode(Runtime::builder(), Mode::Graph)
        .backend(BackendKind::Cpu)
        .compute_streams(2)
        .oversubscribe(true)
        .build()
        .unwrap();
    let a = rt.alloc_from("a", &[1u64]).unwrap();
    let b = rt.alloc_from("b", &[1u64]).unwrap();
    let step = rt
        .record("step", |rt| {
            for k in 0..4u64 {
                rt.task("a")
                    .run(a.read_write::<u64>(), move |a| a[0] = a[0] * 3 + k)?;
                rt.task("b")
                    .run(b.read_write::<u64>(), move |b| b[0] = b[0] * 5 + k)?;
            }
            Ok(())
        })
        .unwrap();
    assert_eq!(step.placement().0, 2, "the recording used both streams");
    for _ in 0..3 {
        step.replay().unwrap();
    }
    let (mut ea, mut eb) = (1u64, 1u64);
    for _ in 0..4 {
        for k in 0..4 {
            ea = ea * 3 + k;
            eb = eb * 5 + k;
        }
    }
    assert_eq!(rt.read_vec::<u64>(&a).unwrap(), vec![ea]);
    assert_eq!(rt.read_vec::<u64>(&b).unwrap(), vec![eb]);
    let st = rt.stats();
    assert_eq!(
        (st.replays, st.graph_replays, st.replayed_tasks),
        (3, 3, 24)
    );
    assert_eq!(step.graph_refusal(), None);
    // A host task (an upload) keeps a schedule out of graphs.
    let up = rt
        .record("upload", |rt| rt.upload(&a, &[7u64]).map(|_| ()))
        .unwrap();
    up.replay().unwrap();
    assert!(up.graph_refusal().unwrap().contains("host work"));
    assert_eq!(rt.stats().graph_replays, 3);
    assert_eq!(rt.read_vec::<u64>(&a).unwrap(), vec![7]);
}

/// On the CPU graphs are off unless asked for (a CPU "graph" runs a step in
/// order on one thread, losing its overlap): a default runtime replays a
/// step per stream, and `graphs(true)` as one unit.
#[test]
fn graphs_are_off_by_default_on_the_cpu() {
    for (asked, graphs) in [(None, 0), (Some(true), 2)] {
        let mut b = Runtime::builder()
            .backend(BackendKind::Cpu)
            .compute_streams(2)
            .oversubscribe(true);
        if let Some(on) = asked {
            b = b.graphs(on);
        }
        let rt = b.build().unwrap();
        let a = rt.alloc_from("a", &[1u64]).unwrap();
        let step = rt
            .record("step", |rt| {
                rt.task("a").run(a.read_write::<u64>(), |a| a[0] *= 3)?;
                Ok(())
            })
            .unwrap();
        step.replay().unwrap();
        step.replay().unwrap();
        assert_eq!(rt.read_vec::<u64>(&a).unwrap(), vec![27], "{asked:?}");
        let st = rt.stats();
        assert_eq!((st.replays, st.graph_replays), (2, graphs), "{asked:?}");
    }
}

/// The placement trial (replays made tasks, as on CUDA): the first replays
/// of a step recorded on two streams alternate between its placement and
/// one stream, then keep the faster; every replay gives the sequential
/// result, with graphs and without. Off by default on the CPU.
#[test]
fn a_placement_trial_keeps_results_and_decides() {
    for (graphs, trial) in [(false, Some(true)), (true, Some(true)), (true, None)] {
        let mut b = Runtime::builder()
            .backend(BackendKind::Cpu)
            .compute_streams(2)
            .oversubscribe(true)
            .replay_as_tasks(true)
            .graphs(graphs);
        if let Some(on) = trial {
            b = b.placement_trial(on);
        }
        let rt = b.build().unwrap();
        let a = rt.alloc_from("a", &[1u64]).unwrap();
        let c = rt.alloc_from("c", &[1u64]).unwrap();
        let step = rt
            .record("step", |rt| {
                for k in 0..4u64 {
                    rt.task("a").run(a.read_write::<u64>(), move |a| {
                        a[0] = (a[0] * 3 + k) % 1_000_003
                    })?;
                    rt.task("c").run(c.read_write::<u64>(), move |c| {
                        c[0] = (c[0] * 5 + k) % 1_000_003
                    })?;
                }
                Ok(())
            })
            .unwrap();
        assert_eq!(step.placement().0, 2, "the recording used both streams");
        let replays = 24;
        for i in 0..replays {
            step.replay().unwrap();
            if i == 3 {
                assert_eq!(step.placement_trial(), None, "decided after 4 replays");
            }
        }
        let (mut ea, mut ec) = (1u64, 1u64);
        for _ in 0..=replays {
            for k in 0..4 {
                ea = (ea * 3 + k) % 1_000_003;
                ec = (ec * 5 + k) % 1_000_003;
            }
        }
        assert_eq!(rt.read_vec::<u64>(&a).unwrap(), vec![ea], "graphs {graphs}");
        assert_eq!(rt.read_vec::<u64>(&c).unwrap(), vec![ec], "graphs {graphs}");
        let outcome = step.placement_trial();
        if trial.is_none() {
            assert_eq!(outcome, None, "no trial by default on the CPU");
            continue;
        }
        let o = outcome.expect("a trial of 16 replays has decided after 24");
        assert!(o.recorded_ns > 0 && o.one_stream_ns > 0, "{o:?}");
        let streams = match o.kept {
            braid::TrialPlacement::Recorded => 2,
            braid::TrialPlacement::OneStream => 1,
        };
        assert_eq!(step.placement().0, streams, "{o:?}");
    }
}

/// Once every recorded task has been measured, the schedule is placed again
/// from the durations (CPU); results stay those of the sequential program.
#[test]
fn replacement_from_measured_durations_keeps_results() {
    use proptest::strategy::ValueTree;
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    for streams in [2, 4] {
        let p = program(120).new_tree(&mut runner).unwrap().current();
        let rt = Runtime::builder()
            .backend(BackendKind::Cpu)
            .compute_streams(streams)
            .build()
            .unwrap();
        let bufs = alloc_buffers(&rt, &p);
        let step = rt
            .record("step", |rt| {
                submit_tasks(rt, &bufs, &p.tasks);
                Ok(())
            })
            .unwrap();
        rt.synchronize().unwrap(); // every task measured
        assert!(!step.replaced());
        for _ in 0..3 {
            step.replay().unwrap();
        }
        assert!(step.replaced());
        let tasks: Vec<GenTask> = (0..4).flat_map(|_| p.tasks.clone()).collect();
        let expected = sequential(&Program {
            sizes: p.sizes.clone(),
            tasks,
        });
        assert_eq!(read_back(&rt, &bufs), expected, "{streams} streams");
    }
    // Off by the builder switch.
    let rt = Runtime::builder()
        .backend(BackendKind::Cpu)
        .replace_schedules(false)
        .build()
        .unwrap();
    let x = rt.alloc("x", 4).unwrap();
    let step = rt
        .record("step", |rt| {
            rt.task("inc").run(x.read_write::<u32>(), |x| x[0] += 1)?;
            Ok(())
        })
        .unwrap();
    rt.synchronize().unwrap();
    step.replay().unwrap();
    assert!(!step.replaced());
    assert_eq!(rt.read_vec::<u32>(&x).unwrap(), vec![2]);
}

/// Submits two independent tasks `x1` and `x2` (on `a`, `b`), then a short
/// `head` (on `c`) and its long successor `tail` (reads `c`, updates `d`),
/// each sleeping its entry of `ms`: the shape whose re-placement may start
/// the path `head`, `tail` first.
fn long_path_step(
    rt: &Runtime,
    [a, b, c, d]: &[braid::Buffer; 4],
    ms: [u64; 4],
) -> braid::Result<()> {
    let sleep = |ms| std::thread::sleep(std::time::Duration::from_millis(ms));
    rt.task("x1").run(a.read_write::<u32>(), move |a| {
        sleep(ms[0]);
        a[0] += 1
    })?;
    rt.task("x2").run(b.read_write::<u32>(), move |b| {
        sleep(ms[1]);
        b[0] += 2
    })?;
    rt.task("head").run(c.read_write::<u32>(), move |c| {
        sleep(ms[2]);
        c[0] += 3
    })?;
    rt.task("tail")
        .run((c.read::<u32>(), d.read_write::<u32>()), move |(c, d)| {
            sleep(ms[3]);
            d[0] = d[0] * 2 + c[0]
        })?;
    Ok(())
}

/// The re-placement takes the tasks by upward rank when that predicts a
/// shorter step: a task heading a long chain, recorded after two long
/// independent ones, runs first on its stream in the replays; results stay
/// the sequential ones.
#[test]
fn replacement_runs_a_long_path_first() {
    let rt = Runtime::builder()
        .backend(BackendKind::Cpu)
        .compute_streams(2)
        // Both streams, whatever share of the cores the runtimes of tests
        // running beside this one leave it.
        .oversubscribe(true)
        .profile(true)
        .build()
        .unwrap();
    let bufs = ["a", "b", "c", "d"].map(|n| rt.alloc(n, 4).unwrap());
    let [a, b, c, d] = &bufs;
    let step = rt
        .record("step", |rt| long_path_step(rt, &bufs, [20, 20, 10, 20]))
        .unwrap();
    rt.synchronize().unwrap(); // every task measured
    for _ in 0..3 {
        step.replay().unwrap();
    }
    rt.synchronize().unwrap();
    assert!(step.replaced());
    // Four runs: a = 4, b = 8, c = 12, d = ((3·2 + 6)·2 + 9)·2 + 12.
    let read = |x: &braid::Buffer| rt.read_vec::<u32>(x).unwrap()[0];
    assert_eq!([read(a), read(b), read(c), read(d)], [4, 8, 12, 78]);
    // In the last replay `head` started with the replay, though recorded
    // after both 20 ms tasks: in program order it would have waited for one
    // of them on its stream (two streams, three tasks before `tail`;
    // predicted 50 ms in program order, 40 ms by upward rank: a margin that
    // measurement noise under load does not close).
    let prof = rt.profile();
    let last_start = |name: &str| {
        prof.spans
            .iter()
            .filter(|s| s.name == name)
            .map(|s| s.start_ns)
            .max()
            .unwrap()
    };
    let first = last_start("x1").min(last_start("x2"));
    let head = last_start("head");
    assert!(
        head < first + 10_000_000,
        "head started {} µs after the replay's first task",
        (head - first.min(head)) / 1000
    );
}

/// Two ranks that measured different durations re-place a schedule
/// differently on their own (so each would reach its collectives at another
/// point of its step), and alike once they agree: the same order and
/// streams on both. Rank 0's `tail` lasts 30 ms, rank 1's 1 ms: alone, rank
/// 0 starts the long path (`head`, `tail`) first and rank 1 keeps program
/// order; agreed on the maximum, both start it first.
#[test]
fn ranks_that_agree_place_a_schedule_alike() {
    let orders = braid::launch(2, |rank, comm| {
        let rt = Runtime::builder()
            .backend(BackendKind::Cpu)
            .compute_streams(2)
            .oversubscribe(true)
            .rank(rank)
            .build()?;
        let comm = comm.bind(&rt)?;
        let bufs = ["a", "b", "c", "d"].map(|n| rt.alloc(n, 4).unwrap());
        let tail_ms = if rank == 0 { 30 } else { 1 };
        let program = |rt: &Runtime| long_path_step(rt, &bufs, [10, 10, 1, tail_ms]);
        let mut orders = Vec::new();
        for agree in [false, true] {
            let step = rt.record("step", program)?;
            rt.synchronize()?; // every task measured
            if agree {
                comm.agree_placement(&step)?;
            }
            step.replay()?;
            rt.synchronize()?;
            orders.push(step.task_order());
        }
        Ok(orders)
    });
    let [r0, r1]: [Vec<Vec<(String, usize)>>; 2] = orders
        .into_iter()
        .map(|r| r.unwrap())
        .collect::<Vec<_>>()
        .try_into()
        .unwrap();
    let names = |o: &[(String, usize)]| o.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
    // Alone: each rank's own choice, and they differ.
    assert_eq!(names(&r0[0])[0], "head", "{:?}", r0[0]);
    assert_eq!(names(&r1[0]), ["x1", "x2", "head", "tail"], "{:?}", r1[0]);
    // Agreed: one plan on both ranks, the long path first.
    assert_eq!(r0[1], r1[1]);
    assert_eq!(names(&r1[1])[0], "head", "{:?}", r1[1]);
}

/// Automatic replay: a program repeated step after step (synchronising
/// between steps), with steps that diverge part-way, gives the sequential
/// result; repeated steps are submitted from the memoised analysis.
fn auto_steps(rt: &Runtime, p: &Program, steps: &[Option<usize>]) -> Vec<Vec<u32>> {
    let bufs = alloc_buffers(rt, p);
    for s in steps {
        match *s {
            None => submit_tasks(rt, &bufs, &p.tasks),
            // Diverge after `k` tasks: the rest in reverse order.
            Some(k) => {
                let k = k.min(p.tasks.len());
                submit_tasks(rt, &bufs, &p.tasks[..k]);
                let rest: Vec<GenTask> = p.tasks[k..].iter().rev().cloned().collect();
                submit_tasks(rt, &bufs, &rest);
            }
        }
        rt.synchronize().unwrap();
    }
    read_back(rt, &bufs)
}

fn auto_sequential(p: &Program, steps: &[Option<usize>]) -> Vec<Vec<u32>> {
    let mut tasks = Vec::new();
    for s in steps {
        match *s {
            None => tasks.extend_from_slice(&p.tasks),
            Some(k) => {
                let k = k.min(p.tasks.len());
                tasks.extend_from_slice(&p.tasks[..k]);
                tasks.extend(p.tasks[k..].iter().rev().cloned());
            }
        }
    }
    sequential(&Program {
        sizes: p.sizes.clone(),
        tasks,
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn automatic_replay_matches_sequential(
        p in program(30),
        steps in prop::collection::vec(prop_oneof![4 => Just(None), 1 => (0usize..30).prop_map(Some)], 1..12),
        streams in 1usize..=6,
        policy in prop_oneof![Just(Policy::Single), Just(Policy::RoundRobin), Just(Policy::Affinity)],
    ) {
        let expected = auto_sequential(&p, &steps);
        for backend in backends() {
            let rt = Runtime::builder()
                .backend(backend)
                .compute_streams(streams)
                .policy(policy)
                .auto_replay(true)
                .build()
                .unwrap();
            prop_assert_eq!(&auto_steps(&rt, &p, &steps), &expected, "backend {:?}", backend);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    /// Steps that repeat a pattern of 1 to 4 step variants (a variant leaves
    /// the program's order after some task, or keeps it), with one step
    /// swapped for another variant somewhere: periods detected, plans kept
    /// and left, results the sequential ones.
    #[test]
    fn automatic_replay_of_periodic_steps_matches_sequential(
        p in program(20),
        pattern in prop::collection::vec(prop_oneof![2 => Just(None), 1 => (0usize..20).prop_map(Some)], 1..=4),
        repeats in 3usize..7,
        swap in any::<prop::sample::Index>(),
        other in prop_oneof![Just(None), (0usize..20).prop_map(Some)],
        streams in 1usize..=4,
    ) {
        let mut steps: Vec<Option<usize>> = pattern.iter().cycle().take(pattern.len() * repeats).copied().collect();
        let at = swap.index(steps.len());
        steps[at] = other;
        let expected = auto_sequential(&p, &steps);
        let rt = Runtime::builder()
            .backend(BackendKind::Cpu)
            .compute_streams(streams)
            .build()
            .unwrap();
        prop_assert_eq!(&auto_steps(&rt, &p, &steps), &expected);
    }
}

#[test]
fn automatic_replay_memoises_repeated_steps_and_can_be_turned_off() {
    use proptest::strategy::ValueTree;
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let p = program(60).new_tree(&mut runner).unwrap().current();
    let n = p.tasks.len() as u64;
    let steps = [None, None, None, None, None, None, None, Some(3), None];
    for on in [true, false] {
        let rt = Runtime::builder()
            .backend(BackendKind::Cpu)
            .auto_replay(on)
            .build()
            .unwrap();
        assert_eq!(auto_steps(&rt, &p, &steps), auto_sequential(&p, &steps));
        let s = rt.stats();
        if on {
            // Step 1 also uploads the buffers; steps 2–4 are the same, so
            // step 5 is recorded and steps 6–7 are memoised; step 8 follows
            // the plan for 3 tasks (more if the reversed rest happens to
            // match), step 9 follows it again; the reads after the loop
            // leave it once more.
            assert!(s.auto_replayed >= 3 * n + 3, "{s:?}");
            assert!(s.auto_replayed <= 4 * n, "{s:?}");
            assert_eq!(s.auto_divergences, 2, "{s:?}");
        } else {
            assert_eq!((s.auto_replayed, s.auto_divergences), (0, 0));
        }
    }
}

/// A loop that alternates two data buffers (double buffering: step `i`
/// loads into buffer `i % 2` and computes from it) repeats with period 2:
/// both steps are memoised, the results are the sequential ones.
#[test]
fn double_buffered_steps_are_memoised() {
    let rt = Runtime::builder()
        .backend(BackendKind::Cpu)
        .compute_streams(2)
        .build()
        .unwrap();
    let bufs = [
        rt.alloc_from("data 0", &[0u64; 4]).unwrap(),
        rt.alloc_from("data 1", &[0u64; 4]).unwrap(),
    ];
    let acc = rt.alloc_from("acc", &[0u64; 4]).unwrap();
    rt.synchronize().unwrap();
    let steps = 12u64;
    for i in 0..steps {
        let b = &bufs[(i % 2) as usize];
        rt.task("load")
            .run(b.write::<u64>(), move |d| {
                for (k, x) in d.iter_mut().enumerate() {
                    *x = i * 10 + k as u64;
                }
            })
            .unwrap();
        rt.task("accumulate")
            .run((b.read::<u64>(), acc.read_write::<u64>()), |(d, a)| {
                for (a, d) in a.iter_mut().zip(d) {
                    *a = *a * 3 + d;
                }
            })
            .unwrap();
        rt.synchronize().unwrap();
    }
    let mut expect = [0u64; 4];
    for i in 0..steps {
        for (k, a) in expect.iter_mut().enumerate() {
            *a = *a * 3 + i * 10 + k as u64;
        }
    }
    // Steps 1-6 observed (each of the two occurs three times), 7 and 8
    // recorded, 9-12 memoised: 8 tasks.
    let s = rt.stats();
    assert_eq!((s.auto_replayed, s.auto_divergences), (8, 0), "{s:?}");
    assert_eq!(rt.read_vec::<u64>(&acc).unwrap(), expect.to_vec());
}

/// A memoised plan outlives one step that leaves it (an evaluation every few
/// steps): the step after follows it again. Two in a row drop it, and the
/// steps after are observed afresh.
#[test]
fn a_memoised_plan_survives_one_step_that_leaves_it() {
    use proptest::strategy::ValueTree;
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let p = program(60).new_tree(&mut runner).unwrap().current();
    let n = p.tasks.len() as u64;
    let run = |steps: &[Option<usize>]| {
        let rt = Runtime::builder()
            .backend(BackendKind::Cpu)
            .build()
            .unwrap();
        assert_eq!(auto_steps(&rt, &p, steps), auto_sequential(&p, steps));
        rt.stats()
    };
    let n5 = [None; 5];
    // Steps 6 and 7 memoised; step 8 (reversed) leaves the plan at its first
    // task; steps 9 and 10 follow it again, and the reads after the loop
    // leave it.
    let once = [&n5[..], &[None, None, Some(0), None, None]].concat();
    let s = run(&once);
    assert_eq!((s.auto_replayed, s.auto_divergences), (4 * n, 2), "{s:?}");
    // Steps 8 and 9 both leave it: dropped; step 10 and the reads are
    // observed, nothing after step 7 is memoised.
    let twice = [&n5[..], &[None, None, Some(0), Some(0), None]].concat();
    let s = run(&twice);
    assert_eq!((s.auto_replayed, s.auto_divergences), (2 * n, 2), "{s:?}");
}

/// A memoised step's tasks are not in the dependency tracker; a step
/// boundary (`synchronize`) hands the unfinished ones to the next eager
/// submission. Two ways another thread submits while they still run: while
/// the main thread's `synchronize` waits for them (`reader`), and after its
/// own `synchronize` made a boundary in the middle of the main thread's
/// step (`syncer`). Either way the submission follows what it reads.
/// (Each waits 50 ms for the other thread to reach the boundary; should it
/// take longer, the submission lands in the step and the test checks
/// eager inference instead.)
#[test]
fn submissions_from_another_thread_follow_a_memoised_steps_tasks() {
    use std::time::Duration;
    for syncer in [false, true] {
        let rt = Runtime::builder()
            .backend(BackendKind::Cpu)
            .compute_streams(3)
            .auto_replay(true)
            // The writer waits for this thread: it must not run on it.
            .inline_short_tasks(false)
            .build()
            .unwrap();
        let x = rt.alloc_from("x", &[0u32; 64]).unwrap();
        let y = rt.alloc_from("y", &[0u32; 64]).unwrap();
        let z = rt.alloc_from("z", &[0u32; 64]).unwrap();
        // The writer of step `s` waits until `released` reaches `s`.
        let released = Arc::new(AtomicU32::new(0));
        let write = |step: u32| {
            let released = released.clone();
            rt.task("write x")
                .on_stream(0)
                .run(x.write::<u32>(), move |x| {
                    while released.load(Ordering::Acquire) < step {
                        std::thread::sleep(Duration::from_millis(1));
                    }
                    x.fill(step);
                })
                .unwrap();
        };
        // On another stream than the writer's (the submission from the
        // other thread on a third, behind no queued task): only an edge
        // orders it after the writer.
        let copy = |to: &braid::Buffer, stream: usize| {
            rt.task("copy x")
                .on_stream(stream)
                .run((x.read::<u32>(), to.write::<u32>()), |(x, to)| {
                    to.copy_from_slice(x)
                })
                .unwrap();
        };
        for step in 1..=12u32 {
            write(step);
            if !syncer {
                copy(&y, 1);
            }
            if step < 12 {
                released.store(step, Ordering::Release);
                rt.synchronize().unwrap();
                continue;
            }
            assert!(rt.stats().auto_replayed > 0, "{:?}", rt.stats());
            std::thread::scope(|sc| {
                sc.spawn(|| {
                    if syncer {
                        // A boundary in the middle of the main thread's step.
                        rt.synchronize().unwrap();
                    } else {
                        std::thread::sleep(Duration::from_millis(50));
                        copy(&z, 2);
                        released.store(step, Ordering::Release);
                    }
                });
                if syncer {
                    std::thread::sleep(Duration::from_millis(50));
                    copy(&z, 2);
                    released.store(step, Ordering::Release);
                } else {
                    rt.synchronize().unwrap();
                }
            });
        }
        rt.synchronize().unwrap();
        assert_eq!(
            rt.read_vec::<u32>(&z).unwrap(),
            vec![12; 64],
            "syncer {syncer}"
        );
    }
}

/// Steps that replay an explicit schedule between eager tasks (the GPT-2
/// trainer's loop) are never memoised by automatic replay — the memoised
/// analysis would miss the replay — and give the sequential result.
#[test]
fn steps_with_explicit_replays_are_not_memoised() {
    for mode in MODES {
        let rt = in_mode(Runtime::builder(), mode)
            .backend(BackendKind::Cpu)
            .auto_replay(true)
            .build()
            .unwrap();
        let x = rt.alloc_from("x", &[1u64]).unwrap();
        let y = rt.alloc("y", 8).unwrap();
        let step = rt
            .record("step", |rt| {
                rt.task("double")
                    .run(x.read_write::<u64>(), |x| x[0] *= 2)?;
                Ok(())
            })
            .unwrap();
        let mut expect = 2u64;
        for i in 0..12u64 {
            rt.task("add")
                .run(x.read_write::<u64>(), move |x| x[0] += i)
                .unwrap();
            step.replay().unwrap();
            rt.task("copy")
                .run((x.read::<u64>(), y.write::<u64>()), |(x, y)| y[0] = x[0])
                .unwrap();
            rt.synchronize().unwrap();
            expect = (expect + i) * 2;
        }
        assert_eq!(rt.read_vec::<u64>(&y).unwrap(), vec![expect]);
        assert_eq!(rt.stats().auto_replayed, 0);
    }
}

/// A memoised step much longer than the stretch after which it forgets its
/// finished tasks (1,024): a task that fails early in a memoised step still
/// skips a dependent submitted 2,800 tasks later, and a step that leaves the
/// plan late gives the sequential result.
#[test]
fn long_memoised_steps_keep_failures_and_diverge_late() {
    const N: usize = 3000;
    const FAIL_STEP: u64 = 6;
    let rt = Runtime::builder()
        .backend(BackendKind::Cpu)
        .compute_streams(2)
        .auto_replay(true)
        .build()
        .unwrap();
    let bufs: Vec<_> = (0..7)
        .map(|i| rt.alloc_from(format!("b{i}"), &[1u64]).unwrap())
        .collect();
    let flag = rt.alloc_from("flag", &[0u64]).unwrap();
    let out = rt.alloc_from("out", &[0u64]).unwrap();
    // The sequential program, step by step: (buffers, flag, out).
    let mut want = ([1u64; 7], 0u64, 0u64);
    for step in 0..9u64 {
        // Step 8 leaves the plan after 2,500 tasks: the rest in reverse.
        let order: Vec<usize> = if step == 8 {
            (0..2500).chain((2500..N).rev()).collect()
        } else {
            (0..N).collect()
        };
        let memoised_before = rt.stats().auto_replayed;
        let mut flagger = None;
        let mut flag_result = Ok(());
        for &i in &order {
            if i == 1500 {
                // Let the flag task finish before the step passes the
                // sweeps at 2,048 tasks (whatever the machine's speed).
                // (A wait is a synchronisation point: it reports the
                // failure, and `synchronize` does not again.)
                let h: braid::TaskHandle = flagger.take().unwrap();
                flag_result = h.wait();
            }
            match i {
                100 => {
                    flagger = Some(
                        rt.task("flag")
                            .run(flag.write::<u64>(), move |f| {
                                assert!(step != FAIL_STEP, "injected failure");
                                f[0] = step;
                            })
                            .unwrap(),
                    );
                }
                2900 => {
                    rt.task("read flag")
                        .run((flag.read::<u64>(), out.write::<u64>()), move |(f, o)| {
                            o[0] = f[0] * 1000 + step
                        })
                        .unwrap();
                }
                _ => {
                    rt.task("mix")
                        .run(bufs[i % 7].read_write::<u64>(), move |b| {
                            b[0] = b[0].wrapping_mul(3).wrapping_add(i as u64)
                        })
                        .unwrap();
                }
            }
        }
        for &i in &order {
            match i {
                100 | 2900 => {}
                _ => want.0[i % 7] = want.0[i % 7].wrapping_mul(3).wrapping_add(i as u64),
            }
        }
        let r = rt.synchronize();
        if step == FAIL_STEP {
            assert!(
                rt.stats().auto_replayed - memoised_before >= N as u64,
                "step {step} was not memoised: {:?}",
                rt.stats()
            );
            r.unwrap();
            let e = flag_result.expect_err("the flag task failed");
            assert!(e.to_string().contains("flag"), "{e}");
            // The reader, 2,800 tasks later, was skipped: `out` keeps the
            // previous step's value.
        } else {
            r.unwrap();
            flag_result.unwrap();
            (want.1, want.2) = (step, step * 1000 + step);
        }
        assert_eq!(
            rt.read_vec::<u64>(&out).unwrap(),
            vec![want.2],
            "step {step}"
        );
    }
    let got: Vec<u64> = bufs
        .iter()
        .map(|b| rt.read_vec::<u64>(b).unwrap()[0])
        .collect();
    assert_eq!(got, want.0.to_vec());
    assert_eq!(rt.read_vec::<u64>(&flag).unwrap(), vec![want.1]);
    assert!(rt.stats().auto_divergences >= 1, "{:?}", rt.stats());
}

/// One operation of a random data-parallel step.
#[derive(Debug, Clone, Copy)]
enum RankOp {
    /// Compute on stream `s`: buffer `b` += `by` (by the rank, plus one, too).
    Add { b: usize, by: f64, s: usize },
    /// Compute on stream `s`: buffer `dst` = buffer `src`.
    Copy { src: usize, dst: usize, s: usize },
    /// Host work: buffer `b` doubled.
    Host { b: usize },
    /// All-reduce (sum) of buffer `b` over the ranks.
    AllReduce { b: usize },
}

/// Applies `op` to both ranks' buffers, as the sequential program does.
fn apply_rank_op(op: RankOp, data: &mut [Vec<f64>; 2]) {
    for (rank, d) in data.iter_mut().enumerate() {
        match op {
            RankOp::Add { b, by, .. } => d[b] += by * (rank as f64 + 1.0),
            RankOp::Copy { src, dst, .. } => d[dst] = d[src],
            RankOp::Host { b } => d[b] *= 2.0,
            RankOp::AllReduce { .. } => {}
        }
    }
    if let RankOp::AllReduce { b } = op {
        let s = data[0][b] + data[1][b];
        data[0][b] = s;
        data[1][b] = s;
    }
}

/// Submits `op` on this rank (each buffer holds 3 equal values).
fn submit_rank_op(
    rt: &Runtime,
    comm: &braid::BoundComm<'_>,
    bufs: &[braid::Buffer],
    op: RankOp,
) -> braid::Result<()> {
    let rank = comm.rank() as f64;
    match op {
        RankOp::Add { b, by, s } => rt
            .task("add")
            .on_stream(s)
            .run(bufs[b].read_write::<f64>(), move |x| {
                x.iter_mut().for_each(|v| *v += by * (rank + 1.0))
            })
            .map(drop),
        RankOp::Copy { src, dst, s } => rt
            .task("copy")
            .on_stream(s)
            .run(
                (bufs[src].read::<f64>(), bufs[dst].write::<f64>()),
                |(a, b)| b.copy_from_slice(a),
            )
            .map(drop),
        RankOp::Host { b } => rt
            .task("double")
            .kind(TaskKind::Host)
            .run(bufs[b].read_write::<f64>(), |x| {
                x.iter_mut().for_each(|v| *v *= 2.0)
            })
            .map(drop),
        RankOp::AllReduce { b } => comm
            .all_reduce::<f64>(&bufs[b].whole(), braid::comm::ReduceOp::Sum)
            .map(drop),
    }
}

/// Random data-parallel steps on two CPU ranks — compute tasks on two
/// streams, host tasks and all-reduces — recorded and replayed with eager
/// collectives between some replays, give the sequential program's values
/// in every replay mode: per-stream programs, graphs cut around the
/// collectives, and graphs with the collectives inside
/// (`RuntimeBuilder::graph_collectives`).
#[test]
fn random_steps_with_collectives_replay_like_the_sequential_program() {
    let mut x = 0x5851_f42d_4c95_7f2du64;
    let mut next = |n: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % n
    };
    const BUFS: usize = 4;
    for case in 0..30 {
        let len = 2 + next(10) as usize;
        let step: Vec<RankOp> = (0..len)
            .map(|_| match next(10) {
                0..=3 => RankOp::Add {
                    b: next(BUFS as u64) as usize,
                    by: 1.0 + next(3) as f64,
                    s: next(2) as usize,
                },
                4 | 5 => RankOp::Copy {
                    src: next(BUFS as u64) as usize,
                    dst: next(BUFS as u64) as usize,
                    s: next(2) as usize,
                },
                6 => RankOp::Host {
                    b: next(BUFS as u64) as usize,
                },
                _ => RankOp::AllReduce {
                    b: next(BUFS as u64) as usize,
                },
            })
            .filter(|op| !matches!(op, RankOp::Copy { src, dst, .. } if src == dst))
            .collect();
        let replays = 1 + next(3) as usize;
        // Bit k: an eager all-reduce of buffer 0 before replay k.
        let between = next(8);
        let mut want: [Vec<f64>; 2] =
            [0, 1].map(|r| (0..BUFS).map(|i| (r * 10 + i) as f64).collect());
        for k in 0..=replays {
            if k > 0 && between >> (k - 1) & 1 == 1 {
                apply_rank_op(RankOp::AllReduce { b: 0 }, &mut want);
            }
            for &op in &step {
                apply_rank_op(op, &mut want);
            }
        }
        for (graphs, collectives) in [(false, false), (true, false), (true, true)] {
            let step = &step;
            let got = braid::launch(2, |rank, comm| -> braid::Result<Vec<f64>> {
                let rt = rank_runtime(rank, graphs, collectives)?;
                let comm = comm.bind(&rt)?;
                let bufs: Vec<braid::Buffer> = (0..BUFS)
                    .map(|i| rt.alloc_from("b", &[(rank * 10 + i) as f64; 3]))
                    .collect::<braid::Result<_>>()?;
                let s = rt.record("step", |rt| {
                    step.iter()
                        .try_for_each(|&op| submit_rank_op(rt, &comm, &bufs, op))
                })?;
                for k in 0..replays {
                    if between >> k & 1 == 1 {
                        submit_rank_op(&rt, &comm, &bufs, RankOp::AllReduce { b: 0 })?;
                    }
                    s.replay()?;
                }
                rt.synchronize()?;
                let mut out = Vec::new();
                for b in &bufs {
                    let v = rt.read_vec::<f64>(b)?;
                    assert!(v.iter().all(|&e| e == v[0]), "case {case}: {v:?}");
                    out.push(v[0]);
                }
                Ok(out)
            });
            for (rank, r) in got.into_iter().enumerate() {
                let r = r.unwrap_or_else(|e| panic!("case {case} rank {rank}: {e}"));
                assert_eq!(
                    r, want[rank],
                    "case {case}, rank {rank}, graphs {graphs}, collectives in graphs \
                     {collectives}, {replays} replays, between {between:b}: {step:?}"
                );
            }
        }
    }
}

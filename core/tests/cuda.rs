//! The CUDA backend: detection, device-timed overlap, ordering through events.
//! GPU tests skip with a message when no device is present and fail instead
//! when `BRAID_REQUIRE_GPU=1`.

use braid::cuda::memory::memcpy_dtod_async;
use braid::cuda::{gpu_or_skip, test_kernels, CudaFunction, KernelArgs, KernelCache, LaunchConfig};
use braid::{BackendKind, Error, Runtime, TaskError, TaskKind};
use std::sync::Arc;

mod common;
use common::submit_spin_add;

/// A profiled CUDA runtime for `test`, or `None` (after saying so) without a GPU.
fn gpu_runtime(test: &str, streams: usize) -> Option<Runtime> {
    if !gpu_or_skip(test) {
        return None;
    }
    let rt = Runtime::builder()
        .backend(BackendKind::Cuda { device: 0 })
        .compute_streams(streams)
        .profile(true)
        .build()
        .expect("CUDA runtime");
    Some(rt)
}

/// Kernel `name` of the engine's spin test kernels, on the runtime's device.
fn spin_kernel(rt: &Runtime, name: &str) -> Arc<CudaFunction> {
    let dev = rt.cuda_device().unwrap().clone();
    let module = KernelCache::global()
        .module(&dev, test_kernels::SPIN, "spin.cu")
        .unwrap();
    Arc::new(module.function(name).unwrap())
}

/// Submits a task named `spin` that runs `spin` for `cycles` clock cycles on
/// one thread, writing the cycles spent to `out` (8 bytes); `on_launch` runs
/// in the body, as the task is launched.
fn submit_spin(
    rt: &Runtime,
    spin: &Arc<CudaFunction>,
    out: &braid::Buffer,
    cycles: i64,
    on_launch: impl Fn() + Send + 'static,
) {
    let f = spin.clone();
    rt.task("spin")
        .run_cuda(out.write::<i64>(), move |o, cu| -> Result<(), TaskError> {
            on_launch();
            let mut args = KernelArgs::new();
            args.i64(cycles).ptr(o.ptr());
            // SAFETY: `spin(long long, long long*)` with a declared 8-byte output.
            unsafe { f.launch(cu.stream(), LaunchConfig::grid_block(1, 1), &args)? };
            Ok(())
        })
        .unwrap();
}

/// Without a GPU, asking for CUDA is a clear error and `auto` falls back to
/// the CPU; with one, `auto` picks CUDA.
#[test]
fn detection_never_panics() {
    let auto = Runtime::builder().build().unwrap();
    match braid::cuda::cuda_available() {
        Ok(n) if n > 0 => assert_eq!(auto.backend_name(), "cuda"),
        _ => {
            assert_eq!(auto.backend_name(), "cpu");
            let e = Runtime::builder()
                .backend(BackendKind::Cuda { device: 0 })
                .build()
                .unwrap_err();
            assert!(
                matches!(
                    e,
                    Error::BackendUnavailable {
                        backend: "cuda",
                        ..
                    }
                ),
                "{e}"
            );
            assert!(e.to_string().contains("cuda"), "{e}");
        }
    }
}

/// Two spin kernels on two streams, free of dependencies, overlap on the
/// device: their device-timed spans intersect.
#[test]
fn spin_kernels_overlap_on_two_streams() {
    let Some(rt) = gpu_runtime("spin_kernels_overlap_on_two_streams", 2) else {
        return;
    };
    let spin = spin_kernel(&rt, "spin");
    let outs: Vec<_> = (0..2)
        .map(|i| rt.alloc(format!("out{i}"), 8).unwrap())
        .collect();
    // ~50 ms at ~2 GHz.
    let cycles: i64 = 100_000_000;
    for out in &outs {
        submit_spin(&rt, &spin, out, cycles, || {});
    }
    rt.synchronize().unwrap();
    for out in &outs {
        let spent = rt.read_vec::<i64>(out).unwrap()[0];
        assert!(spent >= cycles, "kernel did not run: {spent}");
    }
    let p = rt.profile();
    let spins: Vec<_> = p.spans.iter().filter(|s| s.name == "spin").collect();
    assert_eq!(spins.len(), 2);
    assert_ne!(spins[0].stream, spins[1].stream);
    let (a, b) = (spins[0], spins[1]);
    assert!(
        a.start_ns < b.end_ns && b.start_ns < a.end_ns,
        "device spans do not intersect: {a:?} {b:?}"
    );
    let s = p.summary();
    println!("{s}");
    assert!(s.overlap_ns > 0);
}

/// A slow writer on one stream and a reader on another: the reader sees the
/// written data only if the cross-stream event wait was issued.
#[test]
fn cross_stream_read_after_write_waits_for_the_event() {
    let Some(rt) = gpu_runtime("cross_stream_read_after_write_waits_for_the_event", 2) else {
        return;
    };
    let f = spin_kernel(&rt, "spin_then_add");
    let n = 1024usize;
    let x = rt.alloc_from("x", &vec![1.0f32; n]).unwrap();
    rt.task("slow add")
        .on_stream(0)
        .run_cuda(
            x.read_write::<f32>(),
            move |x, cu| -> Result<(), TaskError> {
                let mut args = KernelArgs::new();
                args.i64(50_000_000).ptr(x.ptr()).i32(n as i32).f32(2.0);
                // SAFETY: spin_then_add(long long, float*, int, float) over n declared floats.
                unsafe { f.launch(cu.stream(), LaunchConfig::linear(n, 256), &args)? };
                Ok(())
            },
        )
        .unwrap();
    let out = rt.alloc("copy", n * 4).unwrap();
    rt.task("copy on stream 1")
        .on_stream(1)
        .run_cuda(
            (x.read::<f32>(), out.write::<f32>()),
            |(src, dst), cu| -> Result<(), TaskError> {
                // SAFETY: both are declared accesses of this task, `n` floats
                // each, disjoint (two buffers), and the engine keeps every
                // conflicting task off them until this copy has run.
                unsafe { memcpy_dtod_async(dst.ptr(), src.ptr(), src.bytes(), cu.stream())? };
                Ok(())
            },
        )
        .unwrap();
    assert_eq!(rt.read_vec::<f32>(&out).unwrap(), vec![3.0f32; n]);
    assert!(rt.stats().waits >= 1);
}

/// Graph replay on CUDA: a step over two streams (a slow add on stream 0, a
/// copy and an add after it on stream 1, an independent add on stream 0) is
/// captured into a CUDA graph at its first replay and launched as one unit
/// afterwards; every replay gives the sequential result. A step whose body
/// synchronises cannot be captured: it says why and replays as before.
#[test]
fn graph_replays_match_the_sequential_program() {
    if !gpu_or_skip("graph_replays_match_the_sequential_program") {
        return;
    }
    let rt = Runtime::builder()
        .backend(BackendKind::Cuda { device: 0 })
        .compute_streams(2)
        .graphs(true)
        .profile(true)
        .build()
        .expect("CUDA runtime");
    let add = spin_kernel(&rt, "spin_then_add");
    let n = 4096usize;
    let x = rt.alloc_from("x", &vec![1.0f32; n]).unwrap();
    let y = rt.alloc("y", n * 4).unwrap();
    let z = rt.alloc_from("z", &vec![0.0f32; n]).unwrap();
    let add_task = |name: &'static str, s: usize, v: &braid::Buffer, spins: i64, by: f32| {
        submit_spin_add(&rt, &add, (name, s), v, spins, by)
    };
    let step = rt
        .record("step", |rt| {
            add_task("slow add x", 0, &x, 2_000_000, 2.0)?;
            rt.task("copy x to y").on_stream(1).run_cuda(
                (x.read::<f32>(), y.write::<f32>()),
                |(src, dst), cu| -> Result<(), TaskError> {
                    // SAFETY: declared accesses of this task, n floats each,
                    // two buffers.
                    unsafe { memcpy_dtod_async(dst.ptr(), src.ptr(), src.bytes(), cu.stream())? };
                    Ok(())
                },
            )?;
            add_task("add y", 1, &y, 0, 1.0)?;
            add_task("add z", 0, &z, 0, 3.0)?;
            Ok(())
        })
        .unwrap();
    for _ in 0..5 {
        step.replay().unwrap();
    }
    // Six runs: x = 1 + 2·6, y = x after the sixth add, + 1; z = 3·6.
    assert_eq!(rt.read_vec::<f32>(&x).unwrap(), vec![13.0; n]);
    assert_eq!(rt.read_vec::<f32>(&y).unwrap(), vec![14.0; n]);
    assert_eq!(rt.read_vec::<f32>(&z).unwrap(), vec![18.0; n]);
    assert_eq!(step.graph_refusal(), None);
    assert_eq!(rt.stats().graph_replays, 5);
    rt.synchronize().unwrap();

    // A body that synchronises its stream fails under capture: refused,
    // then replayed task by task with the right result.
    let f = add.clone();
    let sync_step = rt
        .record("synchronising", |rt| {
            rt.task("add and wait").run_cuda(
                z.read_write::<f32>(),
                move |v, cu| -> Result<(), TaskError> {
                    let mut args = KernelArgs::new();
                    args.i64(0).ptr(v.ptr()).i32(n as i32).f32(1.0);
                    // SAFETY: as above.
                    unsafe { f.launch(cu.stream(), LaunchConfig::linear(n, 256), &args)? };
                    cu.stream().synchronize()?;
                    Ok(())
                },
            )?;
            Ok(())
        })
        .unwrap();
    sync_step.replay().unwrap();
    sync_step.replay().unwrap();
    let why = sync_step
        .graph_refusal()
        .expect("a synchronising body is refused");
    assert!(why.contains("add and wait"), "{why}");
    assert_eq!(rt.read_vec::<f32>(&z).unwrap(), vec![21.0; n]);
    rt.synchronize().unwrap();
}

/// A communicator of one rank that runs on CUDA streams (an all-reduce over
/// one rank changes nothing, so it enqueues nothing) and, like any but
/// NCCL, cannot be captured into a graph.
#[derive(Debug)]
struct OneRank;

impl braid::comm::Communicator for OneRank {
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        1
    }
    fn backend(&self) -> &'static str {
        "one-rank"
    }
    fn run_cuda(
        &self,
        _: &braid::comm::Collective,
        _: braid::comm::DeviceData<'_>,
        _: &braid::CudaTaskCtx<'_>,
    ) -> braid::Result<()> {
        Ok(())
    }
}

/// With `graph_collectives`, a collective that cannot be captured leaves
/// its schedule's graphs cut around it, as without the switch: two graphs
/// with the all-reduce between them, the sequential results, and the
/// schedule says why (`Schedule::graph_collectives_left_out`).
#[test]
fn collectives_that_cannot_be_captured_leave_the_graphs_cut() {
    if !gpu_or_skip("collectives_that_cannot_be_captured_leave_the_graphs_cut") {
        return;
    }
    let rt = Runtime::builder()
        .backend(BackendKind::Cuda { device: 0 })
        .compute_streams(2)
        .graphs(true)
        .graph_collectives(true)
        .build()
        .expect("CUDA runtime");
    let comm = braid::Comm::new(OneRank).bind(&rt).unwrap();
    let add = spin_kernel(&rt, "spin_then_add");
    let n = 1024usize;
    let x = rt.alloc_from("x", &vec![1.0f32; n]).unwrap();
    let y = rt.alloc_from("y", &vec![0.0f32; n]).unwrap();
    let add_task = |name: &'static str, s: usize, v: &braid::Buffer| {
        submit_spin_add(&rt, &add, (name, s), v, 0, 1.0)
    };
    let step = rt
        .record("step", |_| {
            add_task("add x", 0, &x)?;
            comm.all_reduce::<f32>(&x.whole(), braid::comm::ReduceOp::Sum)?;
            add_task("add y", 1, &y)?;
            Ok(())
        })
        .unwrap();
    for _ in 0..3 {
        step.replay().unwrap();
    }
    assert_eq!(rt.read_vec::<f32>(&x).unwrap(), vec![5.0; n]);
    assert_eq!(rt.read_vec::<f32>(&y).unwrap(), vec![4.0; n]);
    assert_eq!(step.graph_refusal(), None);
    assert_eq!(step.graph_shape(), Some((2, 1)));
    let why = step
        .graph_collectives_left_out()
        .expect("says why they are out");
    assert!(why.contains("captured"), "{why}");
    rt.synchronize().unwrap();
}

/// Graphs are the default on CUDA: a runtime built without
/// `RuntimeBuilder::graphs` replays a recorded step as one graph launch,
/// except a best-effort one, whose kernels go in bounded bundles. Both give
/// the sequential result.
#[test]
fn recorded_steps_replay_as_graphs_by_default_except_best_effort() {
    if !gpu_or_skip("recorded_steps_replay_as_graphs_by_default_except_best_effort") {
        return;
    }
    for (class, graphs) in [
        (braid::Class::Normal, 3),
        (braid::Class::LatencyCritical, 3),
        (braid::Class::BestEffort, 0),
    ] {
        let rt = Runtime::builder()
            .backend(BackendKind::Cuda { device: 0 })
            .class(class)
            .build()
            .expect("CUDA runtime");
        let add = spin_kernel(&rt, "spin_then_add");
        let n = 1024usize;
        let x = rt.alloc_from("x", &vec![1.0f32; n]).unwrap();
        let step = rt
            .record("step", |rt| {
                for by in [2.0f32, 3.0] {
                    let f = add.clone();
                    rt.task("add").run_cuda(
                        x.read_write::<f32>(),
                        move |v, cu| -> Result<(), TaskError> {
                            let mut args = KernelArgs::new();
                            args.i64(0).ptr(v.ptr()).i32(n as i32).f32(by);
                            // SAFETY: spin_then_add(long long, float*, int,
                            // float) over n declared floats.
                            unsafe { f.launch(cu.stream(), LaunchConfig::linear(n, 256), &args)? };
                            Ok(())
                        },
                    )?;
                }
                Ok(())
            })
            .unwrap();
        for _ in 0..3 {
            step.replay().unwrap();
        }
        // Four runs of +2 +3.
        assert_eq!(rt.read_vec::<f32>(&x).unwrap(), vec![21.0; n], "{class:?}");
        assert_eq!(rt.stats().graph_replays, graphs, "{class:?}");
        assert_eq!(step.graph_refusal(), None, "{class:?}");
    }
}

/// The placement trial on CUDA (on by default): a step of two independent
/// chains of spinning kernels, recorded over two streams, runs about twice
/// as fast there as on one stream; the trial must measure that and keep the
/// recorded placement, and every replay gives the sequential result.
#[test]
fn the_placement_trial_keeps_two_streams_for_independent_spins() {
    if !gpu_or_skip("the_placement_trial_keeps_two_streams_for_independent_spins") {
        return;
    }
    let rt = Runtime::builder()
        .backend(BackendKind::Cuda { device: 0 })
        .compute_streams(2)
        .build()
        .expect("CUDA runtime");
    let add = spin_kernel(&rt, "spin_then_add");
    let n = 256usize;
    let x = rt.alloc_from("x", &vec![0.0f32; n]).unwrap();
    let z = rt.alloc_from("z", &vec![0.0f32; n]).unwrap();
    let step = rt
        .record("step", |rt| {
            for _ in 0..4 {
                for v in [&x, &z] {
                    let f = add.clone();
                    rt.task("spin add").run_cuda(
                        v.read_write::<f32>(),
                        move |v, cu| -> Result<(), TaskError> {
                            let mut args = KernelArgs::new();
                            // About 0.5 ms at 1.5-2 GHz, then +1.
                            args.i64(800_000).ptr(v.ptr()).i32(n as i32).f32(1.0);
                            // SAFETY: spin_then_add(long long, float*, int,
                            // float) over n declared floats.
                            unsafe { f.launch(cu.stream(), LaunchConfig::linear(n, 256), &args)? };
                            Ok(())
                        },
                    )?;
                }
            }
            Ok(())
        })
        .unwrap();
    assert_eq!(
        step.placement().0,
        2,
        "the chains were recorded on two streams"
    );
    for _ in 0..20 {
        step.replay().unwrap();
    }
    assert_eq!(rt.read_vec::<f32>(&x).unwrap(), vec![84.0; n]);
    assert_eq!(rt.read_vec::<f32>(&z).unwrap(), vec![84.0; n]);
    let o = step.placement_trial().expect("decided after 16 replays");
    eprintln!("placement trial: {o:?}");
    assert_eq!(o.kept, braid::TrialPlacement::Recorded, "{o:?}");
    assert!(o.one_stream_ns as f64 > 1.5 * o.recorded_ns as f64, "{o:?}");
    assert_eq!(step.placement().0, 2);
}

/// Random steps captured into CUDA graphs: tasks pinned to random streams,
/// each adding a constant to a buffer (some after a spin, so streams drift
/// apart) or copying one buffer into another, recorded once and replayed
/// as a graph one to three times. Every buffer must hold what the step run
/// that many times in program order gives. This is what the random-program
/// replay tests cannot check on CUDA (their bodies synchronise, so their
/// graphs are refused): the capture's forks, marks, waits and joins on
/// plans with random cross-stream edges. One task in four (never the first)
/// is marked host work, so the step is cut around it (`sched::split`): the
/// graphs of its parts and the tasks between them must keep every edge.
#[test]
fn random_steps_replay_as_graphs_like_the_sequential_program() {
    if !gpu_or_skip("random_steps_replay_as_graphs_like_the_sequential_program") {
        return;
    }
    let n = 1024usize;
    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move |below: usize| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        (seed % below as u64) as usize
    };
    for case in 0..40 {
        let streams = 1 + next(4);
        let rt = Runtime::builder()
            .backend(BackendKind::Cuda { device: 0 })
            .compute_streams(streams)
            .graphs(true)
            .build()
            .expect("CUDA runtime");
        let add = spin_kernel(&rt, "spin_then_add");
        let k = 2 + next(4);
        let init: Vec<f32> = (0..k).map(|i| i as f32).collect();
        let bufs: Vec<braid::Buffer> = init
            .iter()
            .map(|&v| rt.alloc_from("b", &vec![v; n]).unwrap())
            .collect();
        // (stream, source or None for an add, destination, addend, spins)
        let tasks: Vec<(usize, Option<usize>, usize, f32, i64)> = (0..5 + next(16))
            .map(|_| {
                let (s, dst) = (next(streams), next(k));
                if next(3) == 0 {
                    let src = (dst + 1 + next(k - 1)) % k;
                    (s, Some(src), dst, 0.0, 0)
                } else {
                    let spins = if next(2) == 0 { 0 } else { 200_000 };
                    (s, None, dst, (1 + next(3)) as f32, spins)
                }
            })
            .collect();
        let host: Vec<bool> = (0..tasks.len()).map(|i| i > 0 && next(4) == 0).collect();
        let submit = |rt: &Runtime| -> braid::Result<()> {
            for (&(s, src, dst, by, spins), &host) in tasks.iter().zip(&host) {
                let kind = if host {
                    TaskKind::Host
                } else {
                    TaskKind::Compute
                };
                let task = rt.task(format!("t{dst}")).on_stream(s).kind(kind);
                match src {
                    Some(src) => task.run_cuda(
                        (bufs[src].read::<f32>(), bufs[dst].write::<f32>()),
                        |(a, b), cu| -> Result<(), TaskError> {
                            // SAFETY: declared accesses of this task, n floats
                            // each, two distinct buffers.
                            unsafe { memcpy_dtod_async(b.ptr(), a.ptr(), a.bytes(), cu.stream())? };
                            Ok(())
                        },
                    )?,
                    None => {
                        let f = add.clone();
                        task.run_cuda(
                            bufs[dst].read_write::<f32>(),
                            move |v, cu| -> Result<(), TaskError> {
                                let mut args = KernelArgs::new();
                                args.i64(spins).ptr(v.ptr()).i32(n as i32).f32(by);
                                // SAFETY: spin_then_add(long long, float*, int,
                                // float) over n declared floats.
                                unsafe {
                                    f.launch(cu.stream(), LaunchConfig::linear(n, 256), &args)?
                                };
                                Ok(())
                            },
                        )?
                    }
                };
            }
            Ok(())
        };
        let step = rt.record("random step", submit).unwrap();
        let replays = 1 + next(3);
        for _ in 0..replays {
            step.replay().unwrap();
        }
        // The host's model: every element of a buffer holds the same value.
        let mut want = init.clone();
        for _ in 0..=replays {
            for &(_, src, dst, by, _) in &tasks {
                want[dst] = match src {
                    Some(src) => want[src],
                    None => want[dst] + by,
                };
            }
        }
        for (i, b) in bufs.iter().enumerate() {
            assert_eq!(
                rt.read_vec::<f32>(b).unwrap(),
                vec![want[i]; n],
                "case {case}: buffer {i} after {replays} graph replays of {tasks:?} on {streams} \
                 streams"
            );
        }
        assert_eq!(step.graph_refusal(), None, "case {case}");
        let (graphs, between) = step.graph_shape().expect("a graph");
        assert_eq!(between, host.iter().filter(|&&h| h).count(), "case {case}");
        assert!(graphs >= 1, "case {case}");
        assert_eq!(rt.stats().graph_replays, replays as u64, "case {case}");
        rt.synchronize().unwrap();
    }
}

/// A best-effort CUDA stream keeps about a millisecond of work in flight
/// (`docs/tenants.md`, "Kernels in bundles"): once a task name has been
/// timed, a task of 2 ms is launched only after the one before it has
/// finished on the device, where an unbounded stream launches them all at
/// once. Each body notes the host time of its launch; the device spans say
/// when each task ended.
#[test]
fn a_best_effort_stream_keeps_a_bundle_in_flight() {
    if !gpu_or_skip("a_best_effort_stream_keeps_a_bundle_in_flight") {
        return;
    }
    let rt = Runtime::builder()
        .backend(BackendKind::Cuda { device: 0 })
        .compute_streams(1)
        .class(braid::Class::BestEffort)
        .profile(true)
        .build()
        .expect("CUDA runtime");
    let spin = spin_kernel(&rt, "spin");
    // About 2 ms at 1.5–2 GHz.
    let cycles: i64 = 3_500_000;
    let out = rt.alloc("out", 8).unwrap();
    let launched = Arc::new(std::sync::Mutex::new(Vec::new()));
    let tasks = 12;
    for _ in 0..tasks {
        let launched = launched.clone();
        submit_spin(&rt, &spin, &out, cycles, move || {
            launched.lock().unwrap().push(braid::trace::now_ns())
        });
    }
    rt.synchronize().unwrap();
    assert!(rt.read_vec::<i64>(&out).unwrap()[0] >= cycles);
    let p = rt.profile();
    let mut spins: Vec<_> = p.spans.iter().filter(|s| s.name == "spin").collect();
    spins.sort_by_key(|s| s.start_ns);
    assert_eq!(spins.len(), tasks);
    let launched = launched.lock().unwrap().clone();
    let ms = |ns: u64| ns as f64 / 1e6;
    for s in &spins {
        assert!(
            s.end_ns - s.start_ns > 1_000_000,
            "a spin took {} ms",
            ms(s.end_ns - s.start_ns)
        );
    }
    // Untimed, the first five fit the window at once; once timed at about
    // 2 ms, each launch waits for the task before it (the host and device
    // timelines agree to well under a millisecond).
    for i in 8..tasks {
        let (launch, prev_end) = (launched[i], spins[i - 1].end_ns);
        assert!(
            launch + 500_000 >= prev_end,
            "task {i} launched at {:.3} ms, {:.3} ms before task {} ended",
            ms(launch),
            ms(prev_end - launch),
            i - 1
        );
    }
}

/// A runtime that spares SMs (`RuntimeBuilder::spare_sms`) runs its compute
/// kernels on the others only, and says how many it spared; without the
/// setting, a launch of the same kernel reaches more SMs than that. Each
/// block of `where_blocks_ran` writes the SM it ran on.
#[test]
fn a_runtime_that_spares_sms_keeps_its_kernels_off_them() {
    if !gpu_or_skip("a_runtime_that_spares_sms_keeps_its_kernels_off_them") {
        return;
    }
    let reached = |spare: u32| -> (usize, Option<u32>, u32) {
        let rt = Runtime::builder()
            .backend(BackendKind::Cuda { device: 0 })
            .compute_streams(1)
            .class(braid::Class::BestEffort)
            .spare_sms(spare)
            .build()
            .expect("CUDA runtime");
        let sms = rt.cuda_device().unwrap().sm_count();
        let f = spin_kernel(&rt, "where_blocks_ran");
        let blocks = 8 * sms as usize;
        let out = rt.alloc("smid", blocks * 4).unwrap();
        rt.task("where")
            .run_cuda(out.write::<u32>(), move |o, cu| -> Result<(), TaskError> {
                let mut args = KernelArgs::new();
                args.ptr(o.ptr()).i64(200_000);
                let cfg = LaunchConfig::grid_block(blocks as u32, 32);
                // SAFETY: `where_blocks_ran(unsigned*, long long)`, one u32
                // per block in the declared output.
                unsafe { f.launch(cu.stream(), cfg, &args)? };
                Ok(())
            })
            .unwrap();
        let ids = rt.read_vec::<u32>(&out).unwrap();
        let distinct: std::collections::BTreeSet<u32> = ids.into_iter().collect();
        (distinct.len(), rt.spared_sms(), sms)
    };
    let (everywhere, none, sms) = reached(0);
    assert_eq!(none, None);
    let (confined, spared, _) = reached(8);
    let spared = spared.expect("a runtime sparing 8 SMs reports how many it spared");
    eprintln!("{sms} SMs: all reached {everywhere}; sparing {spared}, reached {confined}");
    assert!(spared >= 8, "spared {spared} SMs, asked 8");
    let allowed = (sms - spared) as usize;
    assert!(
        everywhere > allowed,
        "without sparing, the launch reached {everywhere} SMs, no more than {allowed}: \
         the check cannot tell"
    );
    assert!(
        confined <= allowed,
        "sparing {spared} of {sms} SMs, the launch reached {confined} SMs"
    );
}

/// The live view (`braid top`) shows what a CUDA stream runs: its oldest
/// unfinished task once the device has started it (its start event has
/// completed), with the device's start time; nothing once it is done.
#[cfg(unix)]
#[test]
fn the_live_view_shows_the_kernel_a_cuda_stream_runs() {
    use braid::trace::live::Line;
    use std::io::{BufRead, BufReader};
    use std::os::unix::net::UnixStream;
    use std::time::{Duration, Instant};
    if !gpu_or_skip("the_live_view_shows_the_kernel_a_cuda_stream_runs") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("top.sock");
    let rt = Runtime::builder()
        .backend(BackendKind::Cuda { device: 0 })
        .compute_streams(1)
        .live(&sock)
        .build()
        .expect("CUDA runtime");
    let spin = spin_kernel(&rt, "spin");
    let out = rt.alloc("out", 8).unwrap();
    // About 1.5 s at 1.5–2 GHz: long enough for a few frames.
    let submitted = braid::trace::now_ns();
    submit_spin(&rt, &spin, &out, 2_500_000_000, || ());
    let running = |deadline: Instant| {
        let conn = UnixStream::connect(&sock).expect("the live socket accepts");
        conn.set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        for line in BufReader::new(conn).lines() {
            if let Line::Frame(f) = Line::parse(&line.unwrap()).unwrap() {
                if let Some(t) = f.streams[0].running.clone() {
                    return Some(t);
                }
            }
            if Instant::now() > deadline {
                break;
            }
        }
        None
    };
    let task = running(Instant::now() + Duration::from_millis(1000))
        .expect("no frame showed the spin running within a second");
    assert_eq!(task.name, "spin");
    assert!(
        task.since_ns >= submitted && task.since_ns <= braid::trace::now_ns(),
        "started at {} ns, submitted at {submitted} ns",
        task.since_ns
    );
    rt.synchronize().unwrap();
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        running(Instant::now() + Duration::from_millis(300)).is_none(),
        "a finished stream still shows a running task"
    );
}

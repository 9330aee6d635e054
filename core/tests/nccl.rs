//! NCCL through the `Communicator` trait, on one GPU (world size 1: one GPU
//! cannot hold two NCCL ranks; multi-rank paths are tested with CPU ranks).
//! Skips without a GPU; fails instead when `BRAID_REQUIRE_GPU=1`.

use braid::comm::{nccl::nccl_library_present, NcclCommunicator, ReduceOp};
use braid::cuda::gpu_or_skip;
use braid::cuda::memory::{memcpy_dtoh_async, memcpy_htod_async};
use braid::{BackendKind, Runtime};

mod common;

#[test]
fn nccl_world_size_one_collectives_as_tasks() {
    if !gpu_or_skip("nccl_world_size_one_collectives_as_tasks") {
        return;
    }
    assert!(
        nccl_library_present(),
        "a GPU is present but libnccl could not be loaded"
    );
    let rt = Runtime::builder()
        .backend(BackendKind::Cuda { device: 0 })
        .compute_streams(2)
        .comm_streams(1)
        .profile(true)
        .build()
        .unwrap();
    let comm = NcclCommunicator::single(&rt).unwrap().bind(&rt).unwrap();
    assert_eq!((comm.rank(), comm.world_size()), (0, 1));
    let data: Vec<f32> = (0..4099).map(|i| i as f32 * 0.5).collect();
    let x = rt.alloc_from("x", &data).unwrap();
    // A compute task writes x, then the all-reduce (avg over one rank) runs on
    // the comm stream after it, then a compute task reads the result.
    rt.task("scale")
        .run_cuda(
            x.read_write::<f32>(),
            |x, cu| -> Result<(), braid::TaskError> {
                let (s, mut v) = (cu.stream(), vec![0f32; x.len()]);
                // SAFETY: `x` is the task's declared read-write view, `x.bytes()`
                // bytes at `x.ptr()` on this stream's device; `v` holds as many
                // bytes and is not touched until the stream has synchronised.
                unsafe { memcpy_dtoh_async(v.as_mut_ptr().cast(), x.ptr(), x.bytes(), s)? };
                s.synchronize()?;
                v.iter_mut().for_each(|a| *a *= 2.0);
                // SAFETY: as above, the other way; `v` lives until the stream
                // has synchronised.
                unsafe { memcpy_htod_async(x.ptr(), v.as_ptr().cast(), x.bytes(), s)? };
                s.synchronize()?;
                Ok(())
            },
        )
        .unwrap();
    let h = comm.all_reduce::<f32>(&x.whole(), ReduceOp::Avg).unwrap();
    assert_eq!(h.stream(), 2, "collectives run on the comm stream");
    let y = rt.alloc("y", data.len() * 4).unwrap();
    comm.all_gather_into::<f32>(&x.whole(), &y.whole()).unwrap();
    comm.broadcast::<f32>(&y.whole(), 0).unwrap();
    comm.barrier().unwrap();
    rt.synchronize().unwrap();
    let want: Vec<f32> = data.iter().map(|a| a * 2.0).collect();
    assert_eq!(rt.read_vec::<f32>(&x).unwrap(), want);
    assert_eq!(rt.read_vec::<f32>(&y).unwrap(), want);
    let s = rt.profile().summary();
    assert!(
        s.comm_ns > 0,
        "collectives were traced on the comm stream: {s}"
    );
}

/// A CUDA runtime of two compute streams and a communication stream that
/// replays schedules as graphs, with their collectives inside them or not.
fn graph_runtime(collectives: bool) -> Runtime {
    Runtime::builder()
        .backend(BackendKind::Cuda { device: 0 })
        .compute_streams(2)
        .comm_streams(1)
        .graphs(true)
        .graph_collectives(collectives)
        .build()
        .unwrap()
}

/// With `graph_collectives(true)` a recorded step's NCCL collectives are
/// captured into its CUDA graph: the step (an add on x, x all-gathered into
/// y, an add on y, on two compute streams and the comm stream) is one graph,
/// each launch runs the collective again (y follows x), the results equal
/// those of the step cut around its collective, an eager collective after
/// the replays still runs, and a poisoned communicator fails the next
/// launch instead of hanging.
#[test]
fn nccl_collectives_replay_inside_graphs() {
    if !gpu_or_skip("nccl_collectives_replay_inside_graphs") {
        return;
    }
    for collectives in [false, true] {
        let rt = graph_runtime(collectives);
        let comm = NcclCommunicator::single(&rt).unwrap().bind(&rt).unwrap();
        let add = common::spin_then_add(&rt);
        let n = 4096usize;
        let x = rt.alloc_from("x", &vec![1.0f32; n]).unwrap();
        let y = rt.alloc_from("y", &vec![0.0f32; n]).unwrap();
        let add_task = |name: &'static str, s: usize, v: &braid::Buffer, by: f32| {
            common::submit_spin_add(&rt, &add, (name, s), v, 0, by)
        };
        let step = rt
            .record("step", |_| {
                add_task("add x", 0, &x, 1.0)?;
                comm.all_gather_into::<f32>(&x.whole(), &y.whole())?;
                add_task("add y", 1, &y, 1.0)?;
                Ok(())
            })
            .unwrap();
        for _ in 0..4 {
            step.replay().unwrap();
        }
        let case = format!("collectives in graphs: {collectives}");
        // Five runs: x = 1 + 5, y = x + 1.
        assert_eq!(rt.read_vec::<f32>(&x).unwrap(), vec![6.0; n], "{case}");
        assert_eq!(rt.read_vec::<f32>(&y).unwrap(), vec![7.0; n], "{case}");
        assert_eq!(step.graph_refusal(), None, "{case}");
        let shape = if collectives { (1, 0) } else { (2, 1) };
        assert_eq!(step.graph_shape(), Some(shape), "{case}");
        comm.all_reduce::<f32>(&y.whole(), ReduceOp::Sum).unwrap();
        rt.synchronize().unwrap();
        assert_eq!(rt.read_vec::<f32>(&y).unwrap(), vec![7.0; n], "{case}");
        // A poisoned communicator: the next replay's collective fails (in
        // a graph, its launch), nothing hangs.
        comm.abort("the test gives up");
        let e = step.replay().unwrap().wait().unwrap_err();
        let e = rt.synchronize().map(|_| e).unwrap_or_else(|e| e);
        assert!(e.to_string().contains("the test gives up"), "{case}: {e}");
    }
}

/// A graph holding a captured NCCL collective whose launch is skipped (a
/// host task before it failed) poisons the communicator, which aborts it:
/// the replay fails naming the host task, the runtime goes on, and dropping
/// the schedule, the communicator and the runtime returns. (With several
/// ranks NCCL's abort waits until every graph holding the communicator's
/// captured collectives is destroyed, which is why it runs on the watchdog
/// thread, `nccl_comm.rs`; at one rank NCCL's collectives are local copies
/// and hold no such reference, so this test cannot see that wait.)
#[test]
fn a_skipped_graph_with_nccl_collectives_fails_without_hanging() {
    use braid::{TaskError, TaskKind};
    use std::sync::atomic::{AtomicBool, Ordering};
    if !gpu_or_skip("a_skipped_graph_with_nccl_collectives_fails_without_hanging") {
        return;
    }
    let rt = graph_runtime(true);
    let comm = NcclCommunicator::single(&rt).unwrap().bind(&rt).unwrap();
    let add = common::spin_then_add(&rt);
    let n = 1024usize;
    let x = rt.alloc_from("x", &vec![1.0f32; n]).unwrap();
    let y = rt.alloc_from("y", &vec![0.0f32; n]).unwrap();
    let fail = std::sync::Arc::new(AtomicBool::new(false));
    let gate_fails = fail.clone();
    let step = rt
        .record("step", |rt| {
            rt.task("gate").kind(TaskKind::Host).run_cuda(
                x.read_write::<f32>(),
                move |_, _| -> Result<(), TaskError> {
                    match gate_fails.load(Ordering::Relaxed) {
                        true => Err("the gate fails".into()),
                        false => Ok(()),
                    }
                },
            )?;
            common::submit_spin_add(rt, &add, ("add x", 0), &x, 0, 1.0)?;
            comm.all_gather_into::<f32>(&x.whole(), &y.whole())?;
            common::submit_spin_add(rt, &add, ("add y", 1), &y, 0, 1.0)?;
            Ok(())
        })
        .unwrap();
    step.replay().unwrap().wait().unwrap();
    assert_eq!(step.graph_refusal(), None);
    assert_eq!(
        step.graph_shape().map(|(graphs, _)| graphs),
        Some(1),
        "the collective is inside the one graph"
    );
    fail.store(true, Ordering::Relaxed);
    let e = step.replay().unwrap().wait().unwrap_err();
    let e = rt.synchronize().map(|_| e).unwrap_or_else(|e| e);
    assert!(e.to_string().contains("gate"), "{e}");
    assert!(comm.poisoned().is_some(), "the skipped collective poisons");
    // The runtime goes on: an eager task after the failure.
    common::submit_spin_add(&rt, &add, ("after", 0), &x, 0, 1.0).unwrap();
    rt.synchronize().unwrap();
    // The recording and the first replay added 1 each; the failed replay
    // skipped its graph; then `after`.
    assert_eq!(rt.read_vec::<f32>(&x).unwrap(), vec![4.0; n]);
    drop(step);
    drop(comm);
    drop(rt);
}

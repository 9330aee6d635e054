//! CPU collectives: results against a sequential reference computed here
//! (bit for bit: the reference reduces in rank order, as the contract says),
//! for every collective, several sizes (0, 1, not divisible by the rank
//! count), dtypes and 1–8 ranks; plus timeouts, mismatches, departures,
//! panics and skipped collectives, each reaching every rank as an error.

use braid::comm::{Bf16, CollectiveKind, DType, Element, ReduceOp};
use braid::{
    launch, launch_with, BackendKind, BoundComm, Buffer, Error, LocalCommConfig, Runtime, View,
};
use rand::rngs::Xoshiro256PlusPlus as TestRng;
use rand::{RngExt, SeedableRng};
use std::fmt::Debug;
use std::sync::Mutex;
use std::time::Duration;

fn runtime(rank: usize) -> braid::Result<Runtime> {
    Runtime::builder()
        .backend(BackendKind::Cpu)
        .compute_streams(2)
        .comm_streams(1)
        .rank(rank)
        .build()
}

/// Element types under test, with the reference reduction.
trait TestElem: Element + Copy + PartialEq + Debug {
    fn gen(rng: &mut TestRng) -> Self;
    /// `op` over `xs` in rank order, with the communicator's arithmetic.
    fn reduce(xs: &[Self], op: ReduceOp) -> Self;
}

/// Floats spread over magnitudes 1e-3..1e3 with both signs, so the summation
/// order matters and a different order would show.
fn gen_f64(rng: &mut TestRng) -> f64 {
    const SCALE: [f64; 7] = [1e-3, 1e-2, 1e-1, 1.0, 1e1, 1e2, 1e3];
    let mant = rng.random_range(-10000..=10000) as f64 / 10000.0;
    mant * SCALE[rng.random_range(0..SCALE.len())]
}

macro_rules! float_elem {
    ($t:ty) => {
        impl TestElem for $t {
            fn gen(rng: &mut TestRng) -> Self {
                gen_f64(rng) as $t
            }
            fn reduce(xs: &[Self], op: ReduceOp) -> Self {
                let mut acc = xs[0];
                for &x in &xs[1..] {
                    acc = match op {
                        ReduceOp::Sum | ReduceOp::Avg => acc + x,
                        ReduceOp::Max => acc.max(x),
                        ReduceOp::Min => acc.min(x),
                    };
                }
                if op == ReduceOp::Avg {
                    acc /= xs.len() as $t;
                }
                acc
            }
        }
    };
}
float_elem!(f32);
float_elem!(f64);

impl TestElem for i32 {
    fn gen(rng: &mut TestRng) -> Self {
        // Large magnitudes, so sums wrap.
        rng.random()
    }
    fn reduce(xs: &[Self], op: ReduceOp) -> Self {
        match op {
            ReduceOp::Sum => xs.iter().fold(0i32, |a, &x| a.wrapping_add(x)),
            ReduceOp::Avg => (xs.iter().map(|&x| x as i64).sum::<i64>() / xs.len() as i64) as i32,
            ReduceOp::Max => *xs.iter().max().unwrap(),
            ReduceOp::Min => *xs.iter().min().unwrap(),
        }
    }
}

impl TestElem for Bf16 {
    fn gen(rng: &mut TestRng) -> Self {
        Bf16::from_f32(gen_f64(rng) as f32)
    }
    fn reduce(xs: &[Self], op: ReduceOp) -> Self {
        let fs: Vec<f32> = xs.iter().map(|x| x.to_f32()).collect();
        Bf16::from_f32(f32::reduce(&fs, op))
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    AllReduce(ReduceOp),
    ReduceScatter(ReduceOp),
    AllGather,
    Broadcast(usize),
}

#[derive(Debug, Clone, Copy)]
struct Case {
    id: u64,
    kind: Kind,
    dtype: DType,
    n: usize,
    in_place: bool,
}

fn input<T: TestElem>(case: &Case, rank: usize, len: usize) -> Vec<T> {
    let mut rng = TestRng::seed_from_u64((case.id << 40) ^ ((rank as u64) << 32));
    (0..len).map(|_| T::gen(&mut rng)).collect()
}

/// One value drawn from a generator seeded with `seed`.
fn one<T: TestElem>(seed: u64) -> T {
    T::gen(&mut TestRng::seed_from_u64(seed))
}

fn input_len(case: &Case, w: usize) -> usize {
    match case.kind {
        Kind::ReduceScatter(_) => case.n * w,
        _ => case.n,
    }
}

fn output_len(case: &Case, w: usize) -> usize {
    match case.kind {
        Kind::AllGather => case.n * w,
        _ => case.n,
    }
}

/// What each rank must hold after the case, as bytes (rank order).
fn expected<T: TestElem>(case: &Case, w: usize) -> Vec<Vec<u8>> {
    let inputs: Vec<Vec<T>> = (0..w)
        .map(|j| input::<T>(case, j, input_len(case, w)))
        .collect();
    let mut column = Vec::with_capacity(w);
    let mut reduce_at = |i: usize, op| {
        column.clear();
        column.extend(inputs.iter().map(|x| x[i]));
        T::reduce(&column, op)
    };
    let bytes = |v: &[T]| bytemuck::cast_slice::<T, u8>(v).to_vec();
    match case.kind {
        Kind::AllReduce(op) => {
            let all: Vec<T> = (0..case.n).map(|i| reduce_at(i, op)).collect();
            vec![bytes(&all); w]
        }
        Kind::ReduceScatter(op) => {
            let all: Vec<T> = (0..case.n * w).map(|i| reduce_at(i, op)).collect();
            (0..w)
                .map(|rank| {
                    let mine = &all[rank * case.n..(rank + 1) * case.n];
                    if case.in_place {
                        // The whole view: other chunks keep this rank's input.
                        let mut v = inputs[rank].clone();
                        v[rank * case.n..(rank + 1) * case.n].copy_from_slice(mine);
                        bytes(&v)
                    } else {
                        bytes(mine)
                    }
                })
                .collect()
        }
        Kind::AllGather => vec![bytes(&inputs.concat()); w],
        Kind::Broadcast(root) => vec![bytes(&inputs[root]); w],
    }
}

/// Submits the case on this rank; returns the view to read back.
fn submit<T: TestElem>(
    case: &Case,
    rt: &Runtime,
    comm: &BoundComm<'_>,
    rank: usize,
) -> braid::Result<View> {
    let w = comm.world_size();
    let data = input::<T>(case, rank, input_len(case, w));
    if case.in_place {
        // In-place all-gather: the view holds `n × w`; this rank's input is chunk `rank`.
        let buf: Buffer = match case.kind {
            Kind::AllGather => {
                let mut all = vec![one::<T>(u64::MAX); case.n * w];
                all[rank * case.n..(rank + 1) * case.n].copy_from_slice(&data);
                rt.alloc_from("inout", &all)?
            }
            _ => rt.alloc_from("inout", &data)?,
        };
        let v = buf.whole();
        match case.kind {
            Kind::AllReduce(op) => comm.all_reduce::<T>(&v, op)?,
            Kind::ReduceScatter(op) => comm.reduce_scatter::<T>(&v, op)?,
            Kind::AllGather => comm.all_gather::<T>(&v)?,
            Kind::Broadcast(root) => comm.broadcast::<T>(&v, root)?,
        };
        Ok(v)
    } else {
        let send = rt.alloc_from("send", &data)?.whole();
        // Garbage in the output, so a missing write shows.
        let junk = vec![one::<T>(u64::MAX - 1); output_len(case, w)];
        let recv = rt.alloc_from("recv", &junk)?.whole();
        match case.kind {
            Kind::AllReduce(op) => comm.all_reduce_into::<T>(&send, &recv, op)?,
            Kind::ReduceScatter(op) => comm.reduce_scatter_into::<T>(&send, &recv, op)?,
            Kind::AllGather => comm.all_gather_into::<T>(&send, &recv)?,
            Kind::Broadcast(root) => comm.broadcast_into::<T>(&send, &recv, root)?,
        };
        Ok(recv)
    }
}

fn cases(w: usize, sizes: &[usize], dtypes: &[DType]) -> Vec<Case> {
    let mut out = Vec::new();
    let ops = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min];
    for &dtype in dtypes {
        for &n in sizes {
            for in_place in [true, false] {
                let mut kinds: Vec<Kind> = ops.iter().map(|&op| Kind::AllReduce(op)).collect();
                kinds.push(Kind::ReduceScatter(ReduceOp::Sum));
                kinds.push(Kind::ReduceScatter(ReduceOp::Avg));
                kinds.push(Kind::AllGather);
                kinds.push(Kind::Broadcast(w - 1));
                kinds.push(Kind::Broadcast(0));
                for kind in kinds {
                    out.push(Case {
                        id: out.len() as u64 + 1,
                        kind,
                        dtype,
                        n,
                        in_place,
                    });
                }
            }
        }
    }
    out
}

fn submit_dyn(case: &Case, rt: &Runtime, comm: &BoundComm<'_>, rank: usize) -> braid::Result<View> {
    match case.dtype {
        DType::F32 => submit::<f32>(case, rt, comm, rank),
        DType::F64 => submit::<f64>(case, rt, comm, rank),
        DType::I32 => submit::<i32>(case, rt, comm, rank),
        DType::Bf16 => submit::<Bf16>(case, rt, comm, rank),
        _ => unreachable!(),
    }
}

fn expected_dyn(case: &Case, w: usize) -> Vec<Vec<u8>> {
    match case.dtype {
        DType::F32 => expected::<f32>(case, w),
        DType::F64 => expected::<f64>(case, w),
        DType::I32 => expected::<i32>(case, w),
        DType::Bf16 => expected::<Bf16>(case, w),
        _ => unreachable!(),
    }
}

/// Runs every case on `w` ranks, all queued on the comm stream before any is
/// read back; `jitter` makes ranks reach each collective at different times.
fn check_world(w: usize, sizes: &[usize], dtypes: &[DType], jitter: bool) {
    let cases = cases(w, sizes, dtypes);
    let results = launch(w, |rank, comm| {
        let rt = runtime(rank)?;
        let comm = comm.bind(&rt)?;
        let mut outs = Vec::new();
        for (i, case) in cases.iter().enumerate() {
            if jitter && (i + rank) % 3 == 0 {
                // Keep a compute stream busy for a while, and sometimes the
                // host too, so ranks reach each collective at different times.
                let d = Duration::from_micros(200 * ((i * 7 + rank * 13) % 5) as u64);
                rt.task("jitter").run((), move |()| std::thread::sleep(d))?;
                if (i + rank) % 2 == 0 {
                    std::thread::sleep(d);
                }
            }
            outs.push(submit_dyn(case, &rt, &comm, rank)?);
        }
        let bytes = outs
            .iter()
            .map(|v| rt.read_vec::<u8>(v))
            .collect::<braid::Result<Vec<_>>>()?;
        rt.synchronize()?;
        Ok(bytes)
    });
    let want: Vec<Vec<Vec<u8>>> = cases.iter().map(|c| expected_dyn(c, w)).collect();
    let mut per_rank = Vec::new();
    for (rank, r) in results.into_iter().enumerate() {
        let bytes = r.unwrap_or_else(|e| panic!("rank {rank} of {w} failed: {e}"));
        for ((case, got), want) in cases.iter().zip(&bytes).zip(&want) {
            let want = &want[rank];
            assert!(
                got == want,
                "{w} ranks, rank {rank}: {case:?} differs from the sequential reference"
            );
        }
        per_rank.push(bytes);
    }
    // Bit-identical on every rank where the collective's result is shared.
    for (c, case) in cases.iter().enumerate() {
        if matches!(
            case.kind,
            Kind::AllReduce(_) | Kind::AllGather | Kind::Broadcast(_)
        ) {
            for r in 1..w {
                assert_eq!(
                    per_rank[r][c], per_rank[0][c],
                    "{case:?}: rank {r} differs from rank 0"
                );
            }
        }
    }
}

const SIZES: &[usize] = &[0, 1, 2, 7, 1000, 4099];
const ALL: &[DType] = &[DType::F32, DType::F64, DType::I32, DType::Bf16];

#[test]
fn collectives_match_reference_1_to_4_ranks() {
    for w in 1..=4 {
        check_world(w, SIZES, ALL, false);
    }
}

#[test]
fn collectives_match_reference_5_to_8_ranks() {
    for w in 5..=8 {
        check_world(w, SIZES, ALL, false);
    }
}

/// Small enough for Miri (`cargo +nightly miri test -p braid --test
/// collectives small_world`), which checks the raw-pointer protocol.
#[test]
fn small_world_every_collective() {
    check_world(3, &[0, 5], &[DType::F32], false);
}

#[test]
fn large_collectives_match_reference() {
    // Many reduction blocks per chunk, and sizes no rank count divides.
    check_world(2, &[262_147], &[DType::F32], false);
    check_world(3, &[65_539], &[DType::Bf16, DType::I32], false);
    check_world(4, &[65_539], &[DType::F64], false);
}

#[test]
fn results_do_not_depend_on_timing() {
    for w in [3, 4] {
        check_world(w, &[1, 1000, 4099], ALL, true);
    }
}

#[test]
fn collectives_are_comm_tasks_ordered_by_their_accesses() {
    let results = launch(3, |rank, comm| {
        let rt = runtime(rank)?;
        let comm = comm.bind(&rt)?;
        let x = rt.alloc("x", 4 * 100)?;
        let r = rank as f32;
        // The writer sleeps: the all-reduce must still see its data.
        rt.task("slow write").run(x.write::<f32>(), move |x| {
            std::thread::sleep(Duration::from_millis(20));
            x.iter_mut().for_each(|v| *v = r + 1.0);
        })?;
        let h = comm.all_reduce::<f32>(&x.whole(), ReduceOp::Sum)?;
        assert_eq!(h.stream(), rt.compute_streams() + comm.comm_stream());
        // A later writer must wait for the all-reduce (write after read).
        rt.task("overwrite")
            .run(x.write::<f32>(), |x| x[0] = -1.0)?;
        let b = comm.barrier()?;
        let got = rt.read_vec::<f32>(&x)?;
        b.wait()?;
        assert_eq!(comm.issued(), 2);
        Ok(got)
    });
    for r in results {
        let got = r.unwrap();
        assert_eq!(got[0], -1.0);
        assert!(got[1..].iter().all(|&v| v == 6.0), "{:?}", &got[..4]);
    }
}

/// Collectives queued by replays count as issued when a rank's closure
/// returns: a rank that returned with its replays still queued was taken
/// to have left before them, and its peer failed at their first.
#[test]
fn collectives_queued_by_replays_count_as_issued() {
    let rts: Vec<Runtime> = (0..2).map(|r| runtime(r).unwrap()).collect();
    let xs: Vec<Buffer> = rts
        .iter()
        .enumerate()
        .map(|(r, rt)| rt.alloc_from("x", &[r as f32 + 1.0; 4]).unwrap())
        .collect();
    let issued = launch(2, |rank, comm| {
        let (rt, x) = (&rts[rank], &xs[rank]);
        let comm = comm.bind(rt)?;
        // Rank 0's replays are held back until after its closure returns.
        rt.task("slow").run(x.read_write::<f32>(), move |_| {
            if rank == 0 {
                std::thread::sleep(Duration::from_millis(200));
            }
        })?;
        let step = rt.record("step", |rt| {
            rt.task("halve").run(x.read_write::<f32>(), |x| {
                x.iter_mut().for_each(|v| *v *= 0.5)
            })?;
            comm.all_reduce::<f32>(&x.whole(), ReduceOp::Sum)?;
            Ok(())
        })?;
        for _ in 0..3 {
            step.replay()?;
        }
        Ok(comm.issued())
    });
    for i in issued {
        assert_eq!(i.unwrap(), 4);
    }
    // (1 + 2) / 2 = 1.5, then (0.75 + 0.75) = 1.5 at each replay.
    for (rt, x) in rts.iter().zip(&xs) {
        assert_eq!(rt.read_vec::<f32>(x).unwrap(), vec![1.5; 4]);
    }
}

/// A runtime without a communication stream runs its collectives on
/// compute stream 0, in program order: spread over the compute streams, a
/// rank whose first all-reduce waited for a slow writer ran its second
/// first, and the ranks summed each other's other buffer.
#[test]
fn without_a_comm_stream_collectives_keep_program_order() {
    let results = launch(2, |rank, comm| {
        let rt = Runtime::builder()
            .backend(BackendKind::Cpu)
            .compute_streams(2)
            .comm_streams(0)
            .oversubscribe(true)
            .rank(rank)
            .build()?;
        let comm = comm.bind(&rt)?;
        let x = rt.alloc_from("x", &[10.0f32 + rank as f32; 4])?;
        let y = rt.alloc_from("y", &[100.0f32 + 1000.0 * rank as f32; 4])?;
        // Each rank's other buffer is written by a slow task first.
        let slow = if rank == 0 { &y } else { &x };
        rt.task("slow").run(slow.read_write::<f32>(), |_| {
            std::thread::sleep(Duration::from_millis(100))
        })?;
        let hx = comm.all_reduce::<f32>(&x.whole(), ReduceOp::Sum)?;
        let hy = comm.all_reduce::<f32>(&y.whole(), ReduceOp::Sum)?;
        assert_eq!((hx.stream(), hy.stream()), (0, 0));
        Ok((rt.read_vec::<f32>(&x)?, rt.read_vec::<f32>(&y)?))
    });
    for r in results {
        let (x, y) = r.unwrap();
        assert_eq!((x, y), (vec![21.0; 4], vec![1200.0; 4]));
    }
}

/// A rank of a group made without the launcher whose communicator is
/// dropped has left: a peer at a later collective fails at once saying so,
/// not at the group's timeout.
#[test]
fn a_dropped_communicator_is_a_rank_that_left() {
    let config = LocalCommConfig {
        timeout: Duration::from_secs(120),
        ..LocalCommConfig::default()
    };
    let mut locals = braid::LocalComm::group(2, config).into_iter();
    let (l0, l1) = (locals.next().unwrap(), locals.next().unwrap());
    let one = |local: braid::LocalComm, rank: usize, collectives: usize| {
        let rt = runtime(rank)?;
        let comm = braid::Comm::new(local);
        let comm = comm.bind(&rt)?;
        let x = rt.alloc_from("x", &[1.0f32; 4])?;
        for _ in 0..collectives {
            ar_sum(&comm, &x)?;
        }
        rt.read_vec::<f32>(&x)
    };
    let leaver = std::thread::spawn(move || one(l1, 1, 1));
    let stayer = std::thread::spawn(move || one(l0, 0, 2));
    assert_eq!(leaver.join().unwrap().unwrap(), vec![2.0; 4]);
    let e = stayer.join().unwrap().unwrap_err().to_string();
    assert!(
        e.contains("rank 1 left after issuing 1 collective(s) (its communicator was dropped)"),
        "{e}"
    );
}

#[test]
fn misuse_is_caught_at_submission() {
    let out = launch(2, |rank, comm| {
        let rt = runtime(rank)?;
        let comm = comm.bind(&rt)?;
        let a = rt.alloc("a", 12)?;
        let b = rt.alloc("b", 16)?;
        // 3 f32s do not split over 2 ranks; sizes that do not fit; bad root.
        let errs = [
            comm.reduce_scatter::<f32>(&a.whole(), ReduceOp::Sum)
                .is_err(),
            comm.all_reduce_into::<f32>(&a.whole(), &b.whole(), ReduceOp::Sum)
                .is_err(),
            comm.all_gather_into::<f32>(&a.whole(), &b.whole()).is_err(),
            comm.broadcast::<f32>(&a.whole(), 2).is_err(),
            comm.all_reduce::<f64>(&a.whole(), ReduceOp::Sum).is_err(),
            comm.all_reduce_into::<f32>(&b.view(0..8)?, &b.view(4..12)?, ReduceOp::Sum)
                .is_err(),
        ];
        // None consumed an index: this all-reduce is #0 on both ranks.
        assert_eq!(comm.issued(), 0);
        comm.all_reduce::<f32>(&a.whole(), ReduceOp::Sum)?;
        rt.synchronize()?;
        Ok(errs)
    });
    for r in out {
        assert_eq!(r.unwrap(), [true; 6]);
    }
}

/// The `Error::Collective` inside `e` (possibly one of several).
fn collective(e: &Error) -> Option<(usize, u64, String)> {
    match e {
        Error::Collective {
            rank,
            index,
            message,
            ..
        } => Some((*rank, *index, message.clone())),
        Error::Many(v) => v.iter().find_map(collective),
        _ => None,
    }
}

fn short(ms: u64) -> LocalCommConfig {
    LocalCommConfig::default().timeout(Duration::from_millis(ms))
}

#[test]
fn a_late_rank_times_out_everywhere() {
    let out = launch_with(3, short(200), |rank, comm| {
        let rt = runtime(rank)?;
        let x = rt.alloc("x", 64)?;
        if rank == 2 {
            std::thread::sleep(Duration::from_millis(1200));
        }
        comm.bind(&rt)?
            .all_reduce::<f32>(&x.whole(), ReduceOp::Sum)?;
        rt.synchronize()
    });
    for (rank, r) in out.into_iter().enumerate() {
        let e = r.expect_err("every rank must fail");
        let (er, index, msg) = collective(&e).unwrap_or_else(|| panic!("rank {rank}: {e}"));
        assert_eq!((er, index), (rank, 0), "{e}");
        assert!(msg.contains("timed out"), "rank {rank}: {e}");
        assert!(msg.contains("rank 2"), "the error names the late rank: {e}");
    }
}

#[test]
fn a_rank_that_never_arrives_fails_everyone() {
    // Rank 1 leaves without issuing; the others learn it at once (not after
    // the 30 s timeout), and rank 1's own Ok becomes the job's error.
    let out = launch_with(3, short(30_000), |rank, comm| {
        let rt = runtime(rank)?;
        let x = rt.alloc("x", 64)?;
        if rank == 1 {
            return Ok(());
        }
        comm.bind(&rt)?
            .all_reduce::<f32>(&x.whole(), ReduceOp::Sum)?;
        rt.synchronize()
    });
    for (rank, r) in out.into_iter().enumerate() {
        let e = r.expect_err("every rank must fail");
        let (_, _, msg) = collective(&e).unwrap_or_else(|| panic!("rank {rank}: {e}"));
        assert!(msg.contains("rank 1 left"), "rank {rank}: {e}");
    }
}

/// A rank whose task never returns cannot be joined: the others fail within
/// the collective timeout, naming the collective, and `spawn_ranks` gives up
/// on the stuck rank after the grace period instead of hanging.
#[test]
fn a_rank_stuck_in_a_task_is_abandoned_after_the_grace_period() {
    let (unstick, stuck) = std::sync::mpsc::channel::<()>();
    let stuck = std::sync::Arc::new(Mutex::new(stuck));
    let started = std::time::Instant::now();
    let mut ranks = braid::comm::spawn_ranks(
        2,
        short(300),
        Duration::from_millis(200),
        move |rank, comm| {
            let rt = runtime(rank)?;
            let x = rt.alloc("x", 64)?;
            if rank == 1 {
                let stuck = stuck.clone();
                rt.task("never returns").run(x.write::<f32>(), move |_| {
                    // Until the test ends (a task that never returns).
                    let _ = stuck.lock().unwrap().recv();
                })?;
            }
            comm.bind(&rt)?
                .all_reduce::<f32>(&x.whole(), ReduceOp::Sum)?;
            rt.synchronize()
        },
    );
    let out = loop {
        if let Some(out) = ranks.poll(Duration::from_millis(50)) {
            break out;
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "spawn_ranks hung"
        );
    };
    let e = out[0].as_ref().expect_err("rank 0 must fail");
    let (_, _, msg) = collective(e).unwrap_or_else(|| panic!("rank 0: {e}"));
    assert!(msg.contains("timed out"), "{e}");
    assert!(
        e.to_string().contains("all_reduce"),
        "the error names the collective: {e}"
    );
    let e = out[1].as_ref().expect_err("rank 1 must fail");
    assert!(e.to_string().contains("abandoned"), "{e}");
    drop(unstick);
}

#[test]
fn a_panicking_rank_fails_everyone() {
    let out = launch_with(2, short(30_000), |rank, comm| {
        let rt = runtime(rank)?;
        let x = rt.alloc("x", 64)?;
        if rank == 0 {
            panic!("boom");
        }
        comm.bind(&rt)?
            .all_reduce::<f32>(&x.whole(), ReduceOp::Sum)?;
        rt.synchronize()
    });
    match &out[0] {
        Err(Error::TaskPanicked { task, message }) => {
            assert_eq!(task, "rank 0");
            assert_eq!(message, "boom");
        }
        other => panic!("rank 0: {other:?}"),
    }
    let e = out[1].as_ref().expect_err("rank 1 must fail");
    let (_, _, msg) = collective(e).unwrap();
    assert!(
        msg.contains("rank 0 left") && msg.contains("panicked: boom"),
        "{e}"
    );
}

#[test]
fn a_skipped_collective_fails_everyone() {
    // On rank 1 the all-reduce's input writer fails, so its all-reduce is
    // skipped; rank 0 must fail rather than wait.
    let seen = Mutex::new(Vec::new());
    let out = launch_with(2, short(30_000), |rank, comm| {
        let rt = runtime(rank)?;
        let comm = comm.bind(&rt)?;
        let x = rt.alloc("x", 64)?;
        rt.task("writer")
            .run(x.write::<f32>(), move |_| -> Result<(), braid::TaskError> {
                if rank == 1 {
                    Err("writer failed".into())
                } else {
                    Ok(())
                }
            })?;
        comm.all_reduce::<f32>(&x.whole(), ReduceOp::Sum)?;
        let r = rt.synchronize();
        seen.lock().unwrap().push((rank, comm.poisoned().is_some()));
        r
    });
    let e = out[0].as_ref().expect_err("rank 0 must fail");
    let (_, _, msg) = collective(e).unwrap();
    assert!(msg.contains("skipped"), "{e}");
    assert!(
        matches!(out[1], Err(Error::TaskFailed { .. })),
        "{:?}",
        out[1]
    );
    assert!(
        seen.lock().unwrap().iter().all(|&(_, p)| p),
        "both communicators are poisoned"
    );
}

type Issue = fn(&BoundComm<'_>, &Buffer) -> braid::Result<()>;

/// Runs `issue[rank]` on each rank, then a second all-reduce that must fail
/// fast because the communicator is poisoned. Every rank must report a
/// mismatch and then poison.
fn check_mismatch(what: &str, issue: &[Issue]) {
    let second = Mutex::new(Vec::new());
    let out = launch_with(issue.len(), short(5_000), |rank, comm| {
        let rt = runtime(rank)?;
        let comm = comm.bind(&rt)?;
        let x = rt.alloc("x", 4 * 12)?;
        issue[rank](&comm, &x)?;
        let first = rt.synchronize();
        comm.all_reduce::<f32>(&x.whole(), ReduceOp::Sum)?;
        second.lock().unwrap().push(rt.synchronize());
        first
    });
    for (rank, r) in out.into_iter().enumerate() {
        let e = r.expect_err(what);
        let (er, index, msg) = collective(&e).unwrap_or_else(|| panic!("{what}, rank {rank}: {e}"));
        assert_eq!((er, index), (rank, 0));
        assert!(msg.contains("mismatch"), "{what}, rank {rank}: {e}");
        // Every rank's message lists every rank's collective, and names
        // no rank as the odd one out (each would name another).
        for r in 0..issue.len() {
            assert!(
                msg.contains(&format!("rank {r}: ")),
                "{what}, rank {rank}: {e}"
            );
        }
        assert!(
            !msg.contains("issued a different"),
            "{what}, rank {rank}: {e}"
        );
    }
    for r in second.into_inner().unwrap() {
        let e = r.expect_err("a poisoned communicator fails later collectives");
        let (_, index, msg) = collective(&e).unwrap();
        assert_eq!(index, 1);
        assert!(msg.contains("poisoned"), "{e}");
    }
}

fn ar_sum(c: &BoundComm<'_>, x: &Buffer) -> braid::Result<()> {
    c.all_reduce::<f32>(&x.whole(), ReduceOp::Sum).map(drop)
}

#[test]
fn mismatches_fail_on_every_rank() {
    check_mismatch(
        "count",
        &[ar_sum, |c, x| {
            c.all_reduce::<f32>(&x.view_of::<f32>(0..8)?, ReduceOp::Sum)
                .map(drop)
        }],
    );
    check_mismatch(
        "dtype",
        &[ar_sum, |c, x| {
            c.all_reduce::<i32>(&x.whole(), ReduceOp::Sum).map(drop)
        }],
    );
    check_mismatch(
        "op",
        &[ar_sum, ar_sum, |c, x| {
            c.all_reduce::<f32>(&x.whole(), ReduceOp::Avg).map(drop)
        }],
    );
    check_mismatch(
        "kind",
        &[ar_sum, |c, x| c.broadcast::<f32>(&x.whole(), 0).map(drop)],
    );
    check_mismatch(
        "root",
        &[
            |c, x| c.broadcast::<f32>(&x.whole(), 0).map(drop),
            |c, x| c.broadcast::<f32>(&x.whole(), 1).map(drop),
        ],
    );
    check_mismatch("barrier", &[ar_sum, |c, _| c.barrier().map(drop)]);
}

#[test]
fn untyped_submission_and_signatures() {
    let out = launch(2, |rank, comm| {
        let rt = runtime(rank)?;
        let x = rt.alloc_from("x", &[rank as i32 + 1, 10])?;
        comm.bind(&rt)?.submit_named(
            "my all-reduce",
            CollectiveKind::AllReduce(ReduceOp::Max),
            DType::I32,
            braid::comm::Buffers::InPlace(x.whole()),
        )?;
        rt.read_vec::<i32>(&x)
    });
    for r in out {
        assert_eq!(r.unwrap(), vec![2, 10]);
    }
}

/// A rank that reaches an all-reduce 80 ms after the other: the early rank's
/// span records the wait (`Span::wait_ns`, the trace's `wait_us`), the late
/// one's barely any, and the summary counts the wait apart from the
/// transfer.
#[test]
fn the_early_rank_records_its_wait_for_the_late_one() {
    let late = Duration::from_millis(80);
    // The delay counts from when both ranks are ready, so a slow start of
    // rank 0 (a loaded CI machine) does not eat into it.
    let ready = std::sync::Barrier::new(2);
    let out = launch(2, |rank, comm| {
        let rt = Runtime::builder()
            .backend(BackendKind::Cpu)
            .compute_streams(1)
            .comm_streams(1)
            .rank(rank)
            .profile(true)
            .build()?;
        let x = rt.alloc_from("x", &[1.0f32; 1024])?;
        ready.wait();
        if rank == 1 {
            std::thread::sleep(late);
        }
        comm.bind(&rt)?
            .all_reduce::<f32>(&x.whole(), ReduceOp::Sum)?;
        rt.synchronize()?;
        Ok(rt.profile())
    });
    let profiles: Vec<_> = out.into_iter().map(Result::unwrap).collect();
    let wait = |p: &braid::trace::Profile| {
        let s = p.spans.iter().find(|s| s.name == "all_reduce").unwrap();
        assert!(s.wait_ns <= s.end_ns - s.start_ns, "wait within the span");
        s.wait_ns
    };
    let (early, late_wait) = (wait(&profiles[0]), wait(&profiles[1]));
    assert!(early >= 60_000_000, "the early rank waited {early} ns");
    assert!(late_wait < early / 4, "the late rank waited {late_wait} ns");
    let s = profiles[0].summary();
    assert_eq!(s.comm_wait_ns, early);
    assert_eq!(s.transfer_ns + s.comm_wait_ns, s.comm_ns);
    // Through a Chrome trace and back.
    let path = std::env::temp_dir().join(format!("braid-wait-{}.json", std::process::id()));
    braid::trace::write_chrome_trace(&path, &[&profiles[0], &profiles[1]]).unwrap();
    let back = braid::trace::read_chrome_trace(&std::fs::read_to_string(&path).unwrap()).unwrap();
    std::fs::remove_file(&path).ok();
    let w = wait(&back[0]);
    assert!(
        w.abs_diff(early) <= 1_000,
        "{w} ns read back against {early}"
    );
}

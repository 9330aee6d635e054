//! Data-parallel training of a toy MLP, forward and backward written as Braid
//! tasks, gradients all-reduced by the bucket reducer while the backward pass
//! runs. Checked against single-rank training on the concatenated batch, step
//! after step; plus the trace (an all-reduce starts before backward ends),
//! `no_sync` accumulation, bf16 compression and the reducer's errors.
//!
//! The model is the `ddp_overlap` benchmark's (`braid_benches::toy_mlp`):
//! what this file checks is what the benchmark times.

use braid::comm::{BucketConfig, Compression, ParamSpec, ReduceOp};
use braid::trace::Profile;
use braid::{launch, BackendKind, Comm, Error, Reducer, Runtime};
use braid_benches::toy_mlp::Mlp;

fn runtime(rank: usize) -> braid::Result<Runtime> {
    Runtime::builder()
        .backend(BackendKind::Cpu)
        .compute_streams(2)
        .comm_streams(1)
        .rank(rank)
        .profile(true)
        .build()
}

const DIMS: &[usize] = &[16, 32, 24, 8];
const LR: f32 = 0.05;
const STEPS: u64 = 5;

/// Single-rank training on the concatenated batch of `world × batch` rows:
/// the parameters after each step.
fn reference(world: usize, batch: usize) -> Vec<Vec<f32>> {
    let rt = runtime(0).unwrap();
    let m = Mlp::new(&rt, DIMS, world * batch).unwrap();
    m.init(&rt, None).unwrap();
    (0..STEPS)
        .map(|s| {
            m.load_batch(&rt, s, 0..world * batch).unwrap();
            m.gradients(&rt, None).unwrap();
            m.sgd(&rt, LR).unwrap();
            rt.read_vec::<f32>(&m.params).unwrap()
        })
        .collect()
}

/// Rank `rank`'s runtime and its model (initial parameters broadcast from
/// rank 0 over `comm`).
fn ddp_rank(
    rank: usize,
    comm: &Comm,
    dims: &[usize],
    batch: usize,
) -> braid::Result<(Runtime, Mlp)> {
    let rt = runtime(rank)?;
    let m = Mlp::new(&rt, dims, batch)?;
    m.init(&rt, Some(comm))?;
    Ok((rt, m))
}

/// The model's gradient reducer over `comm`, bound to `rt`.
fn reducer<'rt>(
    rt: &'rt Runtime,
    comm: &Comm,
    m: &Mlp,
    config: BucketConfig,
) -> braid::Result<Reducer<'rt>> {
    Reducer::new(comm.bind(rt)?, &m.grads, m.specs(), config)
}

fn small_buckets() -> BucketConfig {
    // 1 KiB first bucket, 3 KiB after: several buckets for 1536 parameters.
    BucketConfig::default()
        .first_cap_bytes(1024)
        .cap_bytes(3072)
}

struct RankRun {
    params: Vec<Vec<f32>>,
    buckets_before: usize,
    buckets_after: usize,
    rebuilt: bool,
}

fn train_ddp(world: usize, batch: usize) -> Vec<RankRun> {
    launch(world, |rank, comm| {
        let (rt, m) = ddp_rank(rank, &comm, DIMS, batch)?;
        let mut red = reducer(&rt, &comm, &m, small_buckets())?;
        let buckets_before = red.buckets().len();
        let mut params = Vec::new();
        for s in 0..STEPS {
            m.load_batch(&rt, s, rank * batch..(rank + 1) * batch)?;
            m.gradients(&rt, Some(&mut red))?;
            m.sgd(&rt, LR)?;
            params.push(rt.read_vec::<f32>(&m.params)?);
        }
        rt.synchronize()?;
        Ok(RankRun {
            params,
            buckets_before,
            buckets_after: red.buckets().len(),
            rebuilt: red.rebuilt(),
        })
    })
    .into_iter()
    .enumerate()
    .map(|(r, x)| x.unwrap_or_else(|e| panic!("rank {r}: {e}")))
    .collect()
}

fn assert_close(got: &[f32], want: &[f32], tol: f32, what: &str) {
    assert_eq!(got.len(), want.len());
    let mut worst = (0.0f32, 0);
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let err = (g - w).abs() / (1.0 + w.abs());
        if err > worst.0 || err.is_nan() {
            worst = (err, i);
        }
    }
    assert!(
        worst.0 <= tol,
        "{what}: element {} is {} instead of {} (relative error {:e} > {tol:e})",
        worst.1,
        got[worst.1],
        want[worst.1],
        worst.0
    );
}

fn check_ddp_matches_single_rank(world: usize) {
    let batch = 6;
    let want = reference(world, batch);
    let runs = train_ddp(world, batch);
    // The parameters move: the comparison is not vacuous.
    assert!(want[STEPS as usize - 1] != want[0]);
    for (rank, run) in runs.iter().enumerate() {
        assert!(run.rebuilt, "rank {rank} did not rebuild its buckets");
        // Initial reverse-layout buckets: [b2 b1 b0 W2] [W1] [W0]; rebuilt
        // from the backward order W2 b2 W1 b1 W0 b0, no two of which are
        // memory neighbours: six buckets.
        assert_eq!(
            (run.buckets_before, run.buckets_after),
            (3, 6),
            "rank {rank}"
        );
        for (s, want) in want.iter().enumerate() {
            assert_close(
                &run.params[s],
                want,
                2e-6,
                &format!("{world} ranks, rank {rank}, step {s}"),
            );
            // Every rank holds exactly the same parameters.
            assert!(
                run.params[s] == runs[0].params[s],
                "rank {rank} step {s} differs from rank 0"
            );
        }
    }
}

#[test]
fn ddp_with_2_ranks_matches_single_rank_training() {
    check_ddp_matches_single_rank(2);
}

#[test]
fn ddp_with_4_ranks_matches_single_rank_training() {
    check_ddp_matches_single_rank(4);
}

/// Per step: did some all-reduce start before the last backward task ended?
fn early_all_reduce(p: &Profile) -> bool {
    let bwd_end = p
        .spans
        .iter()
        .filter(|s| s.name.starts_with("bwd"))
        .map(|s| s.end_ns)
        .max()
        .expect("backward spans");
    let first_ar = p
        .spans
        .iter()
        .filter(|s| s.name.starts_with("all_reduce"))
        .map(|s| s.start_ns)
        .min()
        .expect("all-reduce spans");
    first_ar < bwd_end
}

/// Trains `steps` steps on 2 ranks with big enough layers that backward takes
/// a while; returns per rank: per step after the first, whether an all-reduce
/// started early, and the hidden comm time summed over those steps.
fn overlap_run(config: BucketConfig, steps: u64) -> Vec<(Vec<bool>, u64, u64)> {
    let dims = [64, 192, 192, 192, 32];
    // A backward pass of a few ms even beside the other tests of this file
    // on two cores (at 32 rows it was short enough that a comm thread the
    // OS scheduled late started only after it, now and then).
    let batch = 128;
    launch(2, |rank, comm| {
        let (rt, m) = ddp_rank(rank, &comm, &dims, batch)?;
        let mut red = reducer(&rt, &comm, &m, config.clone())?;
        let (mut early, mut hidden, mut comm_ns) = (Vec::new(), 0, 0);
        for s in 0..steps {
            m.load_batch(&rt, s, rank * batch..(rank + 1) * batch)?;
            rt.synchronize()?;
            rt.clear_profile();
            m.gradients(&rt, Some(&mut red))?;
            m.sgd(&rt, LR)?;
            rt.synchronize()?;
            if s > 0 {
                let p = rt.profile();
                early.push(early_all_reduce(&p));
                let sum = p.summary();
                hidden += sum.comm_hidden_ns;
                comm_ns += sum.comm_ns;
            }
        }
        Ok((early, hidden, comm_ns))
    })
    .into_iter()
    .map(|r| r.unwrap())
    .collect()
}

#[test]
fn all_reduce_overlaps_backward_in_the_trace() {
    // Small caps: after the rebuild the last layer's weights are a bucket of
    // their own, all-reduced while the earlier layers' backward runs.
    let config = BucketConfig::default()
        .first_cap_bytes(64 << 10)
        .cap_bytes(128 << 10);
    for (rank, (early, hidden, comm_ns)) in overlap_run(config, 6).into_iter().enumerate() {
        assert!(
            early.iter().any(|&e| e),
            "rank {rank}: no all-reduce started before backward ended in any step ({early:?})"
        );
        assert!(
            comm_ns > 0 && hidden > 0,
            "rank {rank}: no comm time hidden under compute"
        );
    }
    // Control: one bucket holding every gradient cannot start before the
    // last gradient is written, so the same measure says "no" every step.
    let one = BucketConfig::default()
        .first_cap_bytes(1 << 30)
        .rebuild(false);
    for (rank, (early, _, _)) in overlap_run(one, 3).into_iter().enumerate() {
        assert!(early.iter().all(|&e| !e), "rank {rank}: {early:?}");
    }
}

#[test]
fn no_sync_accumulates_then_reduces_the_sum() {
    let (world, batch) = (2, 5);
    let out = launch(world, |rank, comm| {
        let (rt, m) = ddp_rank(rank, &comm, DIMS, batch)?;
        let mut red = reducer(&rt, &comm, &m, small_buckets())?;
        let rows = rank * batch..(rank + 1) * batch;
        // Reduced gradients of micro-batch a (step 10) and b (step 11), each
        // in a synced step of its own.
        let mut single = Vec::new();
        for s in [10, 11] {
            m.zero_grad(&rt)?;
            m.load_batch(&rt, s, rows.clone())?;
            m.gradients(&rt, Some(&mut red))?;
            single.push(rt.read_vec::<f32>(&m.grads)?);
        }
        // Accumulate: a without sync, then b with sync.
        m.zero_grad(&rt)?;
        let before = comm.issued();
        {
            let mut quiet = red.no_sync();
            m.load_batch(&rt, 10, rows.clone())?;
            m.gradients(&rt, Some(&mut quiet))?;
        }
        let during = comm.issued() - before;
        assert!(red.is_sync());
        m.load_batch(&rt, 11, rows)?;
        m.gradients(&rt, Some(&mut red))?;
        let acc = rt.read_vec::<f32>(&m.grads)?;
        Ok((single, acc, during))
    });
    let mut first = None;
    for (rank, r) in out.into_iter().enumerate() {
        let (single, acc, during) = r.unwrap();
        assert_eq!(during, 0, "no collective while no_sync is on");
        let sum: Vec<f32> = single[0]
            .iter()
            .zip(&single[1])
            .map(|(a, b)| a + b)
            .collect();
        assert!(single[0] != single[1]);
        assert_close(
            &acc,
            &sum,
            1e-6,
            &format!("rank {rank}: accumulated vs summed"),
        );
        match &first {
            None => first = Some(acc),
            Some(f) => assert!(*f == acc, "rank {rank} differs from rank 0"),
        }
    }
}

#[test]
fn bf16_compression_matches_within_bf16_tolerance() {
    let (world, batch) = (3, 4);
    let grads = |compression: Compression| {
        launch(world, |rank, comm| {
            let (rt, m) = ddp_rank(rank, &comm, DIMS, batch)?;
            let config = small_buckets().compression(compression.clone());
            let mut red = reducer(&rt, &comm, &m, config)?;
            m.load_batch(&rt, 3, rank * batch..(rank + 1) * batch)?;
            m.gradients(&rt, Some(&mut red))?;
            rt.read_vec::<f32>(&m.grads)
        })
        .into_iter()
        .map(|r| r.unwrap())
        .collect::<Vec<_>>()
    };
    let exact = grads(Compression::None);
    let bf16 = grads(Compression::Bf16);
    let scale = exact[0].iter().fold(0.0f32, |a, g| a.max(g.abs()));
    for rank in 0..world {
        assert!(
            bf16[rank] == bf16[0],
            "rank {rank}: bf16 results differ across ranks"
        );
        let mut differs = false;
        for (g, e) in bf16[rank].iter().zip(&exact[rank]) {
            // Two roundings to 8 significant bits (compress, then the
            // averaged result), each within 2^-9 relative, plus the error of
            // averaging rounded inputs: within 2^-7 of the largest gradient.
            assert!(
                (g - e).abs() <= e.abs() / 128.0 + scale / 256.0,
                "{g} vs {e}"
            );
            differs |= g != e;
        }
        assert!(
            differs,
            "compression did not change anything: was it applied?"
        );
    }
}

#[test]
fn reducer_reports_unmarked_and_twice_marked_parameters() {
    let out = launch(2, |rank, comm| {
        let rt = runtime(rank)?;
        let m = Mlp::new(&rt, DIMS, 2)?;
        let mut red = reducer(&rt, &comm, &m, small_buckets())?;
        // Mark everything but b2 (index 5), and W0 twice.
        for p in [0, 1, 2, 3, 4] {
            red.grad_ready(p)?;
        }
        let twice = red.grad_ready(0).unwrap_err();
        let missing = red.finish().unwrap_err();
        // The collectives went out anyway (3 buckets + the rebuild broadcast),
        // so the ranks stay in step: a further all-reduce still works.
        let issued = comm.issued();
        let x = rt.alloc_from("x", &[rank as f32])?;
        comm.bind(&rt)?
            .all_reduce::<f32>(&x.whole(), ReduceOp::Sum)?;
        let sum = rt.read_vec::<f32>(&x)?;
        Ok((twice, missing, issued, sum))
    });
    for r in out {
        let (twice, missing, issued, sum) = r.unwrap();
        assert!(
            matches!(&twice, Error::Collective { message, .. } if message.contains("`W0` was marked ready twice")),
            "{twice}"
        );
        assert!(
            matches!(&missing, Error::Collective { message, .. } if message.contains("b2") && !message.contains("W0")),
            "{missing}"
        );
        assert_eq!(issued, 4);
        assert_eq!(sum, vec![1.0]);
    }
}

#[test]
fn reducer_rejects_bad_layouts() {
    let rt = runtime(0).unwrap();
    let g = rt.alloc("g", 40).unwrap();
    let comm = || braid::Comm::new(braid::LocalComm::group(1, Default::default()).remove(0));
    let bad = [
        vec![ParamSpec::new("a", 0..6), ParamSpec::new("b", 5..8)],
        vec![ParamSpec::new("a", 4..6), ParamSpec::new("b", 0..2)],
        vec![ParamSpec::new("a", 0..11)],
    ];
    for specs in bad {
        assert!(Reducer::new(
            comm().bind(&rt).unwrap(),
            &g,
            specs,
            BucketConfig::default()
        )
        .is_err());
    }
    let ok = vec![ParamSpec::new("a", 0..4), ParamSpec::new("b", 6..10)];
    let r = Reducer::new(comm().bind(&rt).unwrap(), &g, ok, BucketConfig::default()).unwrap();
    // A gap between parameters splits buckets (buckets are contiguous views
    // holding only gradients).
    assert_eq!(r.buckets().len(), 2);
}

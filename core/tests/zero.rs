//! ZeRO-1 in the reducer: buckets reduce-scattered (tails all-reduced), each
//! rank holding the averaged gradients of the ranges it owns, checked against
//! the average computed here; the owned ranges of all ranks tile every
//! bucket; the parameter all-gather gives every rank every owner's values;
//! the first step all-reduces while the buckets may still be rebuilt; a rank
//! that never issues its reduce-scatter fails the others with an error naming
//! it.

use std::time::Duration;

use braid::comm::{owned_ranges, BucketConfig, LocalCommConfig, ParamSpec};
use braid::{launch, launch_with, BackendKind, Error, Reducer, Runtime};

const SIZES: [usize; 3] = [10, 7, 5];
const N: usize = 22;

fn runtime(rank: usize) -> braid::Result<Runtime> {
    Runtime::builder()
        .backend(BackendKind::Cpu)
        .rank(rank)
        .build()
}

fn specs() -> Vec<ParamSpec> {
    let mut at = 0;
    SIZES
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            let p = ParamSpec::new(format!("p{i}"), at..at + n);
            at += n;
            p
        })
        .collect()
}

/// Caps that give each parameter a bucket of its own (5, 7 and 10
/// elements: with 3 ranks every bucket has a tail, the smallest a head of
/// one element per rank).
fn config() -> BucketConfig {
    BucketConfig::default()
        .first_cap_bytes(7 * 4)
        .cap_bytes(12 * 4)
        .shard(true)
}

fn grad(rank: usize, i: usize) -> f32 {
    ((i * 7 + rank * 13) % 11) as f32 * 0.25 - 1.0 + rank as f32 * 0.125
}

fn average(world: usize, i: usize) -> f64 {
    (0..world).map(|r| grad(r, i) as f64).sum::<f64>() / world as f64
}

/// What one rank saw over two steps.
struct Seen {
    /// Shards after the first step (`None` before: all-reduce).
    before: bool,
    owned: Vec<std::ops::Range<usize>>,
    tails: Vec<std::ops::Range<usize>>,
    grads: [Vec<f32>; 2],
    params: Vec<f32>,
}

fn two_steps(world: usize, rebuild: bool) -> Vec<Seen> {
    let out = launch(world, |rank, comm| {
        let rt = runtime(rank)?;
        let g: Vec<f32> = (0..N).map(|i| grad(rank, i)).collect();
        let grads = rt.alloc_from("grads", &g)?;
        let params = rt.alloc("params", N * 4)?;
        let mut red = Reducer::new(comm.bind(&rt)?, &grads, specs(), config().rebuild(rebuild))?;
        let before = red.shards().is_some();
        let mut seen = Vec::new();
        for _ in 0..2 {
            rt.upload(&grads, &g)?;
            for p in (0..SIZES.len()).rev() {
                red.grad_ready(p)?;
            }
            red.finish()?;
            seen.push(rt.read_vec::<f32>(&grads)?);
        }
        let shards = red.shards().expect("the layout is final after a step");
        let owned = owned_ranges(&shards);
        // Each rank writes its rank number into the ranges it owns, then the
        // all-gather spreads the heads.
        let mut mine = vec![-1f32; N];
        for r in &owned {
            mine[r.clone()].fill(rank as f32);
        }
        rt.upload(&params, &mine)?;
        red.all_gather_params(&params)?;
        Ok(Seen {
            before,
            owned: shards.iter().map(|s| s.owned.clone()).collect(),
            tails: shards.iter().map(|s| s.tail.clone()).collect(),
            grads: [seen[0].clone(), seen[1].clone()],
            params: rt.read_vec(&params)?,
        })
    });
    out.into_iter().map(|r| r.unwrap()).collect()
}

fn close(a: f32, b: f64) -> bool {
    (a as f64 - b).abs() <= 1e-6 * (1.0 + b.abs())
}

#[test]
fn shards_hold_the_average_and_the_gather_spreads_them() {
    for world in [1, 2, 3, 4] {
        for rebuild in [false, true] {
            let seen = two_steps(world, rebuild);
            let label = format!("{world} ranks, rebuild {rebuild}");
            // Every element is owned by exactly one rank, or is a tail (held
            // by all).
            let mut count = [0usize; N];
            for s in &seen {
                for r in &s.owned {
                    r.clone().for_each(|i| count[i] += 1);
                }
            }
            for t in &seen[0].tails {
                t.clone().for_each(|i| count[i] += 1);
            }
            assert_eq!(count, [1; N], "{label}");
            for (rank, s) in seen.iter().enumerate() {
                // With the rebuild on, the first step all-reduces (the buckets
                // may change at its end), so every element is averaged.
                assert_eq!(s.before, !rebuild, "{label}");
                if rebuild {
                    for i in 0..N {
                        assert!(close(s.grads[0][i], average(world, i)), "{label}: {i}");
                    }
                }
                for r in s.owned.iter().chain(&s.tails) {
                    for i in r.clone() {
                        assert!(
                            close(s.grads[1][i], average(world, i)),
                            "{label}, rank {rank}: gradient {i} is {} not {}",
                            s.grads[1][i],
                            average(world, i)
                        );
                    }
                }
                // Heads come from their owner; tails stay as every rank wrote
                // them (the same on all).
                for (r, o) in seen.iter().enumerate() {
                    for own in &o.owned {
                        for i in own.clone() {
                            assert_eq!(s.params[i], r as f32, "{label}, rank {rank}: param {i}");
                        }
                    }
                }
                for t in &s.tails {
                    for i in t.clone() {
                        assert_eq!(s.params[i], rank as f32, "{label}: tail {i}");
                    }
                }
            }
        }
    }
}

#[test]
fn sharding_is_refused_with_compression_and_gathers_need_shards() {
    let out = launch(2, |rank, comm| {
        let rt = runtime(rank)?;
        let grads = rt.alloc("grads", N * 4)?;
        let bad = Reducer::new(
            comm.bind(&rt)?,
            &grads,
            specs(),
            config().compression(braid::comm::Compression::Bf16),
        );
        let e = bad.expect_err("bf16 with sharding is refused").to_string();
        assert!(e.contains("compression"), "{e}");
        let red = Reducer::new(comm.bind(&rt)?, &grads, specs(), BucketConfig::default())?;
        let e = red.all_gather_params(&grads).unwrap_err().to_string();
        assert!(e.contains("sharded"), "{e}");
        Ok(())
    });
    for r in out {
        r.unwrap();
    }
}

#[test]
fn a_rank_that_never_reduces_fails_the_others_naming_the_reduce_scatter() {
    let cfg = LocalCommConfig::default().timeout(Duration::from_millis(500));
    let out = launch_with(3, cfg, |rank, comm| {
        let rt = runtime(rank)?;
        let grads = rt.alloc("grads", N * 4)?;
        let mut red = Reducer::new(comm.bind(&rt)?, &grads, specs(), config().rebuild(false))?;
        if rank == 1 {
            // Stops before its step; its reducer (and communicator) stay
            // alive until the others have given up.
            std::thread::sleep(Duration::from_millis(1500));
            return Ok(());
        }
        for p in (0..SIZES.len()).rev() {
            red.grad_ready(p)?;
        }
        red.finish()?;
        rt.synchronize()
    });
    for rank in [0, 2] {
        let e = out[rank].as_ref().expect_err("the others must fail");
        let op = match e {
            Error::Collective { op, .. } => op.clone(),
            Error::Many(v) => v
                .iter()
                .find_map(|e| match e {
                    Error::Collective { op, .. } => Some(op.clone()),
                    _ => None,
                })
                .unwrap_or_default(),
            _ => String::new(),
        };
        assert!(op.contains("reduce_scatter"), "rank {rank}: {e}");
    }
}

//! Data-parallel training of a toy MLP, forward and backward written as Braid
//! tasks, gradients all-reduced by the bucket reducer while the backward pass
//! runs. Checked against single-rank training on the concatenated batch, step
//! after step; plus the trace (an all-reduce starts before backward ends),
//! `no_sync` accumulation, bf16 compression and the reducer's errors.

use braid::comm::{BucketConfig, Compression, ParamSpec, ReduceOp};
use braid::trace::Profile;
use braid::{launch, BackendKind, BoundComm, Buffer, Error, Priority, Reducer, Runtime};
use std::ops::Range;

fn runtime(rank: usize) -> braid::Result<Runtime> {
    Runtime::builder()
        .backend(BackendKind::Cpu)
        .compute_streams(2)
        .comm_streams(1)
        .rank(rank)
        .profile(true)
        .build()
}

fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Uniform in [-1, 1).
fn uniform(seed: u64) -> f32 {
    (mix(seed) >> 40) as f32 / (1u64 << 23) as f32 - 1.0
}

/// A multi-layer perceptron: `L` linear layers, ReLU between them, squared
/// error loss `0.5 · mean_b |y_b − t_b|²`. Layout of the flat buffers: all
/// weights (layer order), then all biases — so the backward order (W, b of
/// the last layer first) is not the reverse layout order, and the reducer's
/// rebuild changes the buckets.
struct Mlp {
    dims: Vec<usize>,
    batch: usize,
    params: Buffer,
    grads: Buffer,
    /// Element ranges of W_i (`(dims[i+1], dims[i])`) and b_i (`(dims[i+1])`).
    w: Vec<Range<usize>>,
    b: Vec<Range<usize>>,
    /// acts[i]: (B, dims[i]); acts[0] is the input, acts[L] the output.
    acts: Vec<Buffer>,
    /// dz[i]: (B, dims[i+1]), gradient of the loss w.r.t. layer i's pre-activation.
    dz: Vec<Buffer>,
    /// (B, dims[L])
    target: Buffer,
}

impl Mlp {
    fn new(rt: &Runtime, dims: &[usize], batch: usize) -> braid::Result<Mlp> {
        let l = dims.len() - 1;
        let (mut w, mut b, mut at) = (Vec::new(), Vec::new(), 0);
        for i in 0..l {
            w.push(at..at + dims[i + 1] * dims[i]);
            at += dims[i + 1] * dims[i];
        }
        for i in 0..l {
            b.push(at..at + dims[i + 1]);
            at += dims[i + 1];
        }
        Ok(Mlp {
            dims: dims.to_vec(),
            batch,
            params: rt.alloc("params", at * 4)?,
            grads: rt.alloc("grads", at * 4)?,
            w,
            b,
            acts: (0..=l)
                .map(|i| rt.alloc(format!("act {i}"), batch * dims[i] * 4))
                .collect::<braid::Result<_>>()?,
            dz: (0..l)
                .map(|i| rt.alloc(format!("dz {i}"), batch * dims[i + 1] * 4))
                .collect::<braid::Result<_>>()?,
            target: rt.alloc("target", batch * dims[l] * 4)?,
        })
    }

    fn layers(&self) -> usize {
        self.dims.len() - 1
    }

    fn n_params(&self) -> usize {
        self.b[self.layers() - 1].end
    }

    /// Parameters in layout order: W_0..W_{L-1}, b_0..b_{L-1}.
    fn specs(&self) -> Vec<ParamSpec> {
        let mut v: Vec<ParamSpec> = (0..self.layers())
            .map(|i| ParamSpec::new(format!("W{i}"), self.w[i].clone()))
            .collect();
        v.extend((0..self.layers()).map(|i| ParamSpec::new(format!("b{i}"), self.b[i].clone())));
        v
    }

    fn w_index(&self, i: usize) -> usize {
        i
    }

    fn b_index(&self, i: usize) -> usize {
        self.layers() + i
    }

    fn initial_params(&self) -> Vec<f32> {
        let mut p = vec![0.0f32; self.n_params()];
        for i in 0..self.layers() {
            let scale = 1.0 / (self.dims[i] as f32).sqrt();
            for e in self.w[i].clone() {
                p[e] = uniform(0xA000_0000 + e as u64) * scale;
            }
            for e in self.b[i].clone() {
                p[e] = 0.1 * uniform(0xB000_0000 + e as u64);
            }
        }
        p
    }

    /// Uploads rows `rows` of step `step`'s global batch as this model's batch.
    fn load_batch(&self, rt: &Runtime, step: u64, rows: Range<usize>) -> braid::Result<()> {
        let (d0, dl) = (self.dims[0], self.dims[self.layers()]);
        assert_eq!(rows.len(), self.batch);
        let mut x = Vec::with_capacity(self.batch * d0);
        let mut t = Vec::with_capacity(self.batch * dl);
        for r in rows {
            let seed = (step << 48) ^ ((r as u64) << 24);
            x.extend((0..d0).map(|k| uniform(seed ^ k as u64)));
            t.extend((0..dl).map(|k| uniform(seed ^ (1 << 20) ^ k as u64)));
        }
        rt.upload(&self.acts[0], &x)?;
        rt.upload(&self.target, &t)?;
        Ok(())
    }

    fn forward(&self, rt: &Runtime) -> braid::Result<()> {
        let l = self.layers();
        for i in 0..l {
            let (n_in, n_out, bsz) = (self.dims[i], self.dims[i + 1], self.batch);
            let wv = self.params.view_of::<f32>(self.w[i].clone())?;
            let bv = self.params.view_of::<f32>(self.b[i].clone())?;
            let (x, y) = (self.acts[i].clone(), self.acts[i + 1].clone());
            let relu = i + 1 < l;
            let (wv2, bv2, x2, y2) = (wv.clone(), bv.clone(), x.clone(), y.clone());
            rt.task(format!("fwd {i}"))
                .read(&wv)
                .read(&bv)
                .read(&x)
                .write(&y)
                .run_ctx(move |ctx| {
                    let (w, b) = (ctx.read::<f32>(&wv2)?, ctx.read::<f32>(&bv2)?);
                    let (x, y) = (ctx.read::<f32>(&x2)?, ctx.write::<f32>(&y2)?);
                    for r in 0..bsz {
                        let xr = &x[r * n_in..(r + 1) * n_in];
                        for o in 0..n_out {
                            let wr = &w[o * n_in..(o + 1) * n_in];
                            let z = b[o] + xr.iter().zip(wr).map(|(a, b)| a * b).sum::<f32>();
                            y[r * n_out + o] = if relu { z.max(0.0) } else { z };
                        }
                    }
                    Ok(())
                })?;
        }
        Ok(())
    }

    /// Loss gradient, then layers from last to first; marks each parameter
    /// ready right after submitting the task that writes its gradient.
    fn backward(&self, rt: &Runtime, mut reducer: Option<&mut Reducer>) -> braid::Result<()> {
        let l = self.layers();
        let bsz = self.batch;
        let (y, t, dz) = (
            self.acts[l].clone(),
            self.target.clone(),
            self.dz[l - 1].clone(),
        );
        let (y2, t2, dz2) = (y.clone(), t.clone(), dz.clone());
        rt.task("loss grad")
            .read(&y)
            .read(&t)
            .write(&dz)
            .run_ctx(move |ctx| {
                let (y, t, d) = (
                    ctx.read::<f32>(&y2)?,
                    ctx.read::<f32>(&t2)?,
                    ctx.write::<f32>(&dz2)?,
                );
                let scale = 1.0 / bsz as f32;
                for ((d, y), t) in d.iter_mut().zip(y).zip(t) {
                    *d = (y - t) * scale;
                }
                Ok(())
            })?;
        for i in (0..l).rev() {
            let (n_in, n_out) = (self.dims[i], self.dims[i + 1]);
            let dz = self.dz[i].clone();
            let x = self.acts[i].clone();
            // dW_i += dz_iᵀ · x_i   (n_out, n_in)
            let gw = self.grads.view_of::<f32>(self.w[i].clone())?;
            let (dz2, x2, gw2) = (dz.clone(), x.clone(), gw.clone());
            rt.task(format!("bwd dW {i}"))
                .priority(Priority::Side)
                .read(&dz)
                .read(&x)
                .read_write(&gw)
                .run_ctx(move |ctx| {
                    let (d, x, g) = (
                        ctx.read::<f32>(&dz2)?,
                        ctx.read::<f32>(&x2)?,
                        ctx.write::<f32>(&gw2)?,
                    );
                    for r in 0..bsz {
                        let xr = &x[r * n_in..(r + 1) * n_in];
                        for o in 0..n_out {
                            let dv = d[r * n_out + o];
                            for (g, x) in g[o * n_in..(o + 1) * n_in].iter_mut().zip(xr) {
                                *g += dv * x;
                            }
                        }
                    }
                    Ok(())
                })?;
            if let Some(r) = reducer.as_deref_mut() {
                r.grad_ready(self.w_index(i))?;
            }
            // db_i += Σ_rows dz_i
            let gb = self.grads.view_of::<f32>(self.b[i].clone())?;
            let (dz2, gb2) = (dz.clone(), gb.clone());
            rt.task(format!("bwd db {i}"))
                .priority(Priority::Side)
                .read(&dz)
                .read_write(&gb)
                .run_ctx(move |ctx| {
                    let (d, g) = (ctx.read::<f32>(&dz2)?, ctx.write::<f32>(&gb2)?);
                    for r in 0..bsz {
                        for (g, d) in g.iter_mut().zip(&d[r * n_out..(r + 1) * n_out]) {
                            *g += d;
                        }
                    }
                    Ok(())
                })?;
            if let Some(r) = reducer.as_deref_mut() {
                r.grad_ready(self.b_index(i))?;
            }
            if i > 0 {
                // dz_{i-1} = (dz_i · W_i) ⊙ [x_i > 0]   (B, n_in)
                let wv = self.params.view_of::<f32>(self.w[i].clone())?;
                let prev = self.dz[i - 1].clone();
                let (dz2, wv2, x2, prev2) = (dz.clone(), wv.clone(), x.clone(), prev.clone());
                rt.task(format!("bwd dx {i}"))
                    .read(&dz)
                    .read(&wv)
                    .read(&x)
                    .write(&prev)
                    .run_ctx(move |ctx| {
                        let (d, w, x) = (
                            ctx.read::<f32>(&dz2)?,
                            ctx.read::<f32>(&wv2)?,
                            ctx.read::<f32>(&x2)?,
                        );
                        let p = ctx.write::<f32>(&prev2)?;
                        for r in 0..bsz {
                            let pr = &mut p[r * n_in..(r + 1) * n_in];
                            pr.iter_mut().for_each(|v| *v = 0.0);
                            for o in 0..n_out {
                                let dv = d[r * n_out + o];
                                for (p, w) in pr.iter_mut().zip(&w[o * n_in..(o + 1) * n_in]) {
                                    *p += dv * w;
                                }
                            }
                            for (p, x) in pr.iter_mut().zip(&x[r * n_in..(r + 1) * n_in]) {
                                if *x <= 0.0 {
                                    *p = 0.0;
                                }
                            }
                        }
                        Ok(())
                    })?;
            }
        }
        Ok(())
    }

    fn sgd(&self, rt: &Runtime, lr: f32) -> braid::Result<()> {
        let (p, g) = (self.params.whole(), self.grads.whole());
        let (p2, g2) = (p.clone(), g.clone());
        rt.task("sgd").read(&g).read_write(&p).run_ctx(move |ctx| {
            let (g, p) = (ctx.read::<f32>(&g2)?, ctx.write::<f32>(&p2)?);
            for (p, g) in p.iter_mut().zip(g) {
                *p -= lr * g;
            }
            Ok(())
        })?;
        self.zero_grad(rt)
    }

    fn zero_grad(&self, rt: &Runtime) -> braid::Result<()> {
        let g = self.grads.whole();
        let g2 = g.clone();
        rt.task("zero grad").write(&g).run_ctx(move |ctx| {
            ctx.write::<f32>(&g2)?.iter_mut().for_each(|v| *v = 0.0);
            Ok(())
        })?;
        Ok(())
    }

    /// Uploads the initial parameters on rank 0 and broadcasts them.
    fn init(&self, rt: &Runtime, comm: Option<&BoundComm<'_>>) -> braid::Result<()> {
        match comm {
            Some(c) => {
                if c.rank() == 0 {
                    rt.upload(&self.params, &self.initial_params())?;
                }
                c.broadcast::<f32>(&self.params.whole(), 0)?;
            }
            None => {
                rt.upload(&self.params, &self.initial_params())?;
            }
        }
        Ok(())
    }
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
            m.forward(&rt).unwrap();
            m.backward(&rt, None).unwrap();
            m.sgd(&rt, LR).unwrap();
            rt.read_vec::<f32>(&m.params).unwrap()
        })
        .collect()
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
        let rt = runtime(rank)?;
        let comm = comm.bind(&rt)?;
        let m = Mlp::new(&rt, DIMS, batch)?;
        m.init(&rt, Some(&comm))?;
        let mut red = Reducer::new(comm, &m.grads, m.specs(), small_buckets())?;
        let buckets_before = red.buckets().len();
        let mut params = Vec::new();
        for s in 0..STEPS {
            m.load_batch(&rt, s, rank * batch..(rank + 1) * batch)?;
            m.forward(&rt)?;
            m.backward(&rt, Some(&mut red))?;
            red.finish()?;
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
    let batch = 32;
    launch(2, |rank, comm| {
        let rt = runtime(rank)?;
        let comm = comm.bind(&rt)?;
        let m = Mlp::new(&rt, &dims, batch)?;
        m.init(&rt, Some(&comm))?;
        let mut red = Reducer::new(comm, &m.grads, m.specs(), config.clone())?;
        let (mut early, mut hidden, mut comm_ns) = (Vec::new(), 0, 0);
        for s in 0..steps {
            m.load_batch(&rt, s, rank * batch..(rank + 1) * batch)?;
            rt.synchronize()?;
            rt.clear_profile();
            m.forward(&rt)?;
            m.backward(&rt, Some(&mut red))?;
            red.finish()?;
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
        let rt = runtime(rank)?;
        let comm = comm.bind(&rt)?;
        let m = Mlp::new(&rt, DIMS, batch)?;
        m.init(&rt, Some(&comm))?;
        let mut red = Reducer::new(comm.clone(), &m.grads, m.specs(), small_buckets())?;
        let rows = rank * batch..(rank + 1) * batch;
        // Reduced gradients of micro-batch a (step 10) and b (step 11), each
        // in a synced step of its own.
        let mut single = Vec::new();
        for s in [10, 11] {
            m.zero_grad(&rt)?;
            m.load_batch(&rt, s, rows.clone())?;
            m.forward(&rt)?;
            m.backward(&rt, Some(&mut red))?;
            red.finish()?;
            single.push(rt.read_vec::<f32>(&m.grads)?);
        }
        // Accumulate: a without sync, then b with sync.
        m.zero_grad(&rt)?;
        let before = comm.issued();
        {
            let mut quiet = red.no_sync();
            m.load_batch(&rt, 10, rows.clone())?;
            m.forward(&rt)?;
            m.backward(&rt, Some(&mut quiet))?;
            quiet.finish()?;
        }
        let during = comm.issued() - before;
        assert!(red.is_sync());
        m.load_batch(&rt, 11, rows)?;
        m.forward(&rt)?;
        m.backward(&rt, Some(&mut red))?;
        red.finish()?;
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
            let rt = runtime(rank)?;
            let comm = comm.bind(&rt)?;
            let m = Mlp::new(&rt, DIMS, batch)?;
            m.init(&rt, Some(&comm))?;
            let cfg = small_buckets().compression(compression.clone());
            let mut red = Reducer::new(comm, &m.grads, m.specs(), cfg)?;
            m.load_batch(&rt, 3, rank * batch..(rank + 1) * batch)?;
            m.forward(&rt)?;
            m.backward(&rt, Some(&mut red))?;
            red.finish()?;
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
        let comm = comm.bind(&rt)?;
        let m = Mlp::new(&rt, DIMS, 2)?;
        let mut red = Reducer::new(comm.clone(), &m.grads, m.specs(), small_buckets())?;
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
        comm.all_reduce::<f32>(&x.whole(), ReduceOp::Sum)?;
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

//! Data-parallel training of a toy MLP on CPU ranks: gradient buckets
//! all-reduced during the backward pass (the `Reducer`) against the same
//! program with one all-reduce of all gradients after backward, in the same
//! run (alternating rounds, same runtime, same buffers). Prints the step
//! times, their ratio, and the share of communication time hidden under
//! computation (from the profile summary).
//!
//! `cargo run --release -p braid-benches --bin ddp_overlap -- --ranks 2`

use braid::comm::{BucketConfig, ParamSpec, ReduceOp};
use braid::{launch, BackendKind, Buffer, Comm, Priority, Reducer, Runtime};
use clap::Parser;
use std::ops::Range;
use std::time::Instant;

#[derive(Parser, Debug)]
#[command(
    about = "Bucketed, overlapped all-reduce vs one all-reduce after backward (toy MLP, CPU ranks)"
)]
struct Args {
    /// Number of ranks.
    #[arg(long, default_value_t = 2)]
    ranks: usize,
    /// Layer widths, input first.
    #[arg(long, value_delimiter = ',', default_value = "256,768,768,768,768,128")]
    dims: Vec<usize>,
    /// Rows per rank per step.
    #[arg(long, default_value_t = 32)]
    batch: usize,
    /// Compute streams per rank.
    #[arg(long, default_value_t = 2)]
    compute_streams: usize,
    /// Bucket cap, KiB.
    #[arg(long, default_value_t = 1024)]
    cap_kib: usize,
    /// First bucket's cap, KiB.
    #[arg(long, default_value_t = 256)]
    first_cap_kib: usize,
    /// Measured steps per mode per round.
    #[arg(long, default_value_t = 5)]
    steps: usize,
    /// Rounds (each runs both modes).
    #[arg(long, default_value_t = 6)]
    rounds: usize,
}

fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

fn uniform(seed: u64) -> f32 {
    (mix(seed) >> 40) as f32 / (1u64 << 23) as f32 - 1.0
}

/// Dot product with eight independent accumulators (so it vectorises).
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// The toy MLP (ReLU, squared error), layers as Braid tasks; weights then
/// biases in the flat buffers.
struct Mlp {
    dims: Vec<usize>,
    batch: usize,
    params: Buffer,
    grads: Buffer,
    w: Vec<Range<usize>>,
    b: Vec<Range<usize>>,
    acts: Vec<Buffer>,
    dz: Vec<Buffer>,
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

    fn specs(&self) -> Vec<ParamSpec> {
        let mut v: Vec<ParamSpec> = (0..self.layers())
            .map(|i| ParamSpec::new(format!("W{i}"), self.w[i].clone()))
            .collect();
        v.extend((0..self.layers()).map(|i| ParamSpec::new(format!("b{i}"), self.b[i].clone())));
        v
    }

    fn init(&self, rt: &Runtime, comm: &Comm) -> braid::Result<()> {
        if comm.rank() == 0 {
            let mut p = vec![0.0f32; self.b[self.layers() - 1].end];
            for i in 0..self.layers() {
                let scale = 1.0 / (self.dims[i] as f32).sqrt();
                for e in self.w[i].clone() {
                    p[e] = uniform(e as u64) * scale;
                }
            }
            rt.upload(&self.params, &p)?;
        }
        comm.bind(rt)?.broadcast::<f32>(&self.params.whole(), 0)?;
        Ok(())
    }

    fn load_batch(&self, rt: &Runtime, step: u64, rank: usize) -> braid::Result<()> {
        let (d0, dl) = (self.dims[0], self.dims[self.layers()]);
        let seed = (step << 40) ^ ((rank as u64) << 32);
        let x: Vec<f32> = (0..self.batch * d0)
            .map(|i| uniform(seed ^ i as u64))
            .collect();
        let t: Vec<f32> = (0..self.batch * dl)
            .map(|i| uniform(seed ^ (1 << 30) ^ i as u64))
            .collect();
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
            let (x, y) = (self.acts[i].whole(), self.acts[i + 1].whole());
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
                            let z = b[o] + dot(xr, &w[o * n_in..(o + 1) * n_in]);
                            y[r * n_out + o] = if relu { z.max(0.0) } else { z };
                        }
                    }
                    Ok(())
                })?;
        }
        Ok(())
    }

    fn backward(&self, rt: &Runtime, mut reducer: Option<&mut Reducer>) -> braid::Result<()> {
        let l = self.layers();
        let bsz = self.batch;
        let (y, t, dz) = (
            self.acts[l].whole(),
            self.target.whole(),
            self.dz[l - 1].whole(),
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
                for ((d, y), t) in d.iter_mut().zip(y).zip(t) {
                    *d = (y - t) / bsz as f32;
                }
                Ok(())
            })?;
        for i in (0..l).rev() {
            let (n_in, n_out) = (self.dims[i], self.dims[i + 1]);
            let (dz, x) = (self.dz[i].whole(), self.acts[i].whole());
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
                r.grad_ready(i)?;
            }
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
                r.grad_ready(l + i)?;
            }
            if i > 0 {
                let wv = self.params.view_of::<f32>(self.w[i].clone())?;
                let prev = self.dz[i - 1].whole();
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
        let g3 = g.clone();
        rt.task("zero grad").write(&g).run_ctx(move |ctx| {
            ctx.write::<f32>(&g3)?.iter_mut().for_each(|v| *v = 0.0);
            Ok(())
        })?;
        Ok(())
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Mode {
    Bucketed,
    AfterBackward,
}

/// Per mode: step times (seconds), comm time, hidden comm time.
#[derive(Debug, Default, Clone)]
struct Stats {
    steps: Vec<f64>,
    comm_ns: u64,
    hidden_ns: u64,
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    anyhow::ensure!(a.dims.len() >= 2, "--dims needs at least two widths");
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let n_params: usize = a.dims.windows(2).map(|w| w[0] * w[1] + w[1]).sum();
    let flops = 6.0 * (a.batch * n_params) as f64;
    println!(
        "# ddp_overlap: {} ranks x {} compute streams, dims {:?}, batch {}/rank, {:.2} M params ({:.1} MiB of gradients), {:.0} MFLOP/step/rank, {cores} hardware threads",
        a.ranks,
        a.compute_streams,
        a.dims,
        a.batch,
        n_params as f64 / 1e6,
        n_params as f64 * 4.0 / (1 << 20) as f64,
        flops / 1e6
    );
    let cfg = BucketConfig::default()
        .cap_bytes(a.cap_kib << 10)
        .first_cap_bytes(a.first_cap_kib << 10);
    let results = launch(a.ranks, |rank, comm| {
        let rt = Runtime::builder()
            .backend(BackendKind::Cpu)
            .compute_streams(a.compute_streams)
            .comm_streams(1)
            .rank(rank)
            .profile(true)
            .build()?;
        let m = Mlp::new(&rt, &a.dims, a.batch)?;
        m.init(&rt, &comm)?;
        let mut red = Reducer::new(comm.bind(&rt)?, &m.grads, m.specs(), cfg.clone())?;
        let mut step = 0u64;
        let mut run = |mode: Mode, red: &mut Reducer| -> braid::Result<f64> {
            let t = Instant::now();
            m.load_batch(&rt, step, rank)?;
            m.forward(&rt)?;
            match mode {
                Mode::Bucketed => {
                    m.backward(&rt, Some(red))?;
                    red.finish()?;
                }
                Mode::AfterBackward => {
                    m.backward(&rt, None)?;
                    comm.bind(&rt)?
                        .all_reduce::<f32>(&m.grads.whole(), ReduceOp::Avg)?;
                }
            }
            m.sgd(&rt, 1e-3)?;
            rt.synchronize()?;
            step += 1;
            Ok(t.elapsed().as_secs_f64())
        };
        // Warm-up, including the reducer's rebuild after its first step.
        for _ in 0..2 {
            run(Mode::Bucketed, &mut red)?;
            run(Mode::AfterBackward, &mut red)?;
        }
        let mut stats = [Stats::default(), Stats::default()];
        for _ in 0..a.rounds {
            for (k, mode) in [Mode::Bucketed, Mode::AfterBackward]
                .into_iter()
                .enumerate()
            {
                rt.clear_profile();
                for _ in 0..a.steps {
                    let t = run(mode, &mut red)?;
                    stats[k].steps.push(t);
                }
                let s = rt.profile().summary();
                stats[k].comm_ns += s.comm_ns;
                stats[k].hidden_ns += s.comm_hidden_ns;
            }
        }
        Ok((stats, red.buckets().len()))
    });
    let per_rank = results.into_iter().collect::<braid::Result<Vec<_>>>()?;
    let buckets = per_rank[0].1;
    println!(
        "{:<16} {:>12} {:>12} {:>12} {:>14}",
        "mode", "median_ms", "best_ms", "comm_ms/step", "hidden_share"
    );
    let mut med = [0.0; 2];
    for (k, name) in [
        (0, format!("bucketed ({buckets})")),
        (1, "after backward".to_string()),
    ] {
        // Step time: the slowest rank's median.
        let m = per_rank
            .iter()
            .map(|(s, _)| median(&s[k].steps))
            .fold(0.0, f64::max);
        let best = per_rank
            .iter()
            .map(|(s, _)| s[k].steps.iter().copied().fold(f64::INFINITY, f64::min))
            .fold(0.0, f64::max);
        let (comm, hidden): (u64, u64) = per_rank
            .iter()
            .map(|(s, _)| (s[k].comm_ns, s[k].hidden_ns))
            .fold((0, 0), |(a, b), (c, d)| (a + c, b + d));
        let n_steps = (per_rank.len() * per_rank[0].0[k].steps.len()) as f64;
        med[k] = m;
        println!(
            "{name:<16} {:>12.2} {:>12.2} {:>12.2} {:>13.0}%",
            m * 1e3,
            best * 1e3,
            comm as f64 / 1e6 / n_steps,
            if comm > 0 {
                100.0 * hidden as f64 / comm as f64
            } else {
                0.0
            }
        );
    }
    println!(
        "speed-up of bucketed over after-backward: {:.3}x (median step time ratio)",
        med[1] / med[0]
    );
    Ok(())
}

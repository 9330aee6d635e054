//! A toy multi-layer perceptron trained data-parallel on CPU ranks: forward
//! and backward written as Braid tasks, gradients all-reduced by the bucket
//! [`Reducer`] while the backward pass runs.
//!
//! One model for two users: the `ddp_overlap` benchmark times it, and the
//! workspace test `tests/tests/ddp_toy.rs` checks it against single-rank
//! training. The collectives it issues are in three places only:
//! [`Mlp::init`] (the broadcast of the initial parameters), [`mark_ready`]
//! and [`Mlp::gradients`] (the reducer's buckets).

use braid::comm::ParamSpec;
use braid::{Buffer, Comm, Priority, Reducer, Result, Runtime, View};
use braid_gpt2::rng::Rng;
use std::ops::Range;

/// `n` values uniform in [-1, 1), a pure function of `seed`.
pub fn uniform(seed: u64, n: usize) -> impl Iterator<Item = f32> {
    let mut rng = Rng::new(seed);
    (0..n).map(move |_| (2.0 * rng.uniform() - 1.0) as f32)
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

/// Marks parameter `param` ready on the reducer, if there is one.
pub fn mark_ready(reducer: Option<&mut Reducer>, param: usize) -> Result<()> {
    match reducer {
        Some(r) => r.grad_ready(param),
        None => Ok(()),
    }
}

/// A multi-layer perceptron: `L` linear layers, ReLU between them, squared
/// error loss `0.5 · mean_b |y_b − t_b|²`. Layout of the flat buffers: all
/// weights (layer order), then all biases — so the backward order (W, b of
/// the last layer first) is not the reverse layout order, and the reducer's
/// rebuild changes the buckets.
#[derive(Debug)]
pub struct Mlp {
    dims: Vec<usize>,
    batch: usize,
    /// All parameters, flat: W_0..W_{L-1}, b_0..b_{L-1}.
    pub params: Buffer,
    /// All gradients, in the layout of `params`.
    pub grads: Buffer,
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
    /// Allocates a model with layer widths `dims` (input first) for `batch`
    /// rows per step.
    pub fn new(rt: &Runtime, dims: &[usize], batch: usize) -> Result<Mlp> {
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
                .collect::<Result<_>>()?,
            dz: (0..l)
                .map(|i| rt.alloc(format!("dz {i}"), batch * dims[i + 1] * 4))
                .collect::<Result<_>>()?,
            target: rt.alloc("target", batch * dims[l] * 4)?,
        })
    }

    /// Number of linear layers.
    pub fn layers(&self) -> usize {
        self.dims.len() - 1
    }

    /// Number of parameters (and gradients).
    pub fn n_params(&self) -> usize {
        self.b[self.layers() - 1].end
    }

    /// Parameters in layout order: W_0..W_{L-1}, b_0..b_{L-1}.
    pub fn specs(&self) -> Vec<ParamSpec> {
        let mut v: Vec<ParamSpec> = (0..self.layers())
            .map(|i| ParamSpec::new(format!("W{i}"), self.w[i].clone()))
            .collect();
        v.extend((0..self.layers()).map(|i| ParamSpec::new(format!("b{i}"), self.b[i].clone())));
        v
    }

    /// Index of W_i in [`Mlp::specs`].
    fn w_index(&self, i: usize) -> usize {
        i
    }

    /// Index of b_i in [`Mlp::specs`].
    fn b_index(&self, i: usize) -> usize {
        self.layers() + i
    }

    /// The f32 elements `range` of `buf` (params or grads).
    fn part(buf: &Buffer, range: &Range<usize>) -> Result<View> {
        buf.view_of::<f32>(range.clone())
    }

    /// The initial parameters, a pure function of the layout.
    pub fn initial_params(&self) -> Vec<f32> {
        let mut p = vec![0.0f32; self.n_params()];
        for i in 0..self.layers() {
            let scale = 1.0 / (self.dims[i] as f32).sqrt();
            let (w, b) = (self.w[i].clone(), self.b[i].clone());
            for (e, u) in w.clone().zip(uniform(0xA000_0000 + i as u64, w.len())) {
                p[e] = u * scale;
            }
            for (e, u) in b.clone().zip(uniform(0xB000_0000 + i as u64, b.len())) {
                p[e] = 0.1 * u;
            }
        }
        p
    }

    /// Uploads the initial parameters: on rank 0 then broadcast to every
    /// rank of `comm`, or directly without one.
    pub fn init(&self, rt: &Runtime, comm: Option<&Comm>) -> Result<()> {
        let root = comm.is_none_or(|c| c.rank() == 0);
        if root {
            rt.upload(&self.params, &self.initial_params())?;
        }
        if let Some(c) = comm {
            c.bind(rt)?.broadcast::<f32>(&self.params.whole(), 0)?;
        }
        Ok(())
    }

    /// Uploads rows `rows` of step `step`'s global batch as this model's
    /// batch (so ranks that load disjoint rows together see the batch a
    /// single rank loading all of them sees).
    pub fn load_batch(&self, rt: &Runtime, step: u64, rows: Range<usize>) -> Result<()> {
        let (d0, dl) = (self.dims[0], self.dims[self.layers()]);
        assert_eq!(rows.len(), self.batch);
        let mut x = Vec::with_capacity(self.batch * d0);
        let mut t = Vec::with_capacity(self.batch * dl);
        for r in rows {
            let seed = (step << 48) ^ ((r as u64) << 24);
            x.extend(uniform(seed, d0));
            t.extend(uniform(seed ^ (1 << 20), dl));
        }
        rt.upload(&self.acts[0], &x)?;
        rt.upload(&self.target, &t)?;
        Ok(())
    }

    /// y_i = act(x_i · W_iᵀ + b_i), layer after layer.
    pub fn forward(&self, rt: &Runtime) -> Result<()> {
        let l = self.layers();
        for i in 0..l {
            let (n_in, n_out, bsz) = (self.dims[i], self.dims[i + 1], self.batch);
            let relu = i + 1 < l;
            let w = Self::part(&self.params, &self.w[i])?;
            let b = Self::part(&self.params, &self.b[i])?;
            rt.task(format!("fwd {i}")).run(
                (
                    w.read::<f32>(),
                    b.read::<f32>(),
                    self.acts[i].read::<f32>(),
                    self.acts[i + 1].write::<f32>(),
                ),
                move |(w, b, x, y)| {
                    for r in 0..bsz {
                        let xr = &x[r * n_in..(r + 1) * n_in];
                        for o in 0..n_out {
                            let z = b[o] + dot(xr, &w[o * n_in..(o + 1) * n_in]);
                            y[r * n_out + o] = if relu { z.max(0.0) } else { z };
                        }
                    }
                },
            )?;
        }
        Ok(())
    }

    /// Loss gradient, then layers from last to first; marks each parameter
    /// ready right after submitting the task that writes its gradient.
    pub fn backward(&self, rt: &Runtime, mut reducer: Option<&mut Reducer>) -> Result<()> {
        let l = self.layers();
        let bsz = self.batch;
        rt.task("loss grad").run(
            (
                self.acts[l].read::<f32>(),
                self.target.read::<f32>(),
                self.dz[l - 1].write::<f32>(),
            ),
            move |(y, t, d)| {
                let scale = 1.0 / bsz as f32;
                for ((d, y), t) in d.iter_mut().zip(y).zip(t) {
                    *d = (y - t) * scale;
                }
            },
        )?;
        for i in (0..l).rev() {
            let (n_in, n_out) = (self.dims[i], self.dims[i + 1]);
            let (dz, x) = (&self.dz[i], &self.acts[i]);
            // dW_i += dz_iᵀ · x_i   (n_out, n_in)
            let gw = Self::part(&self.grads, &self.w[i])?;
            rt.task(format!("bwd dW {i}"))
                .priority(Priority::Side)
                .run(
                    (dz.read::<f32>(), x.read::<f32>(), gw.read_write::<f32>()),
                    move |(d, x, g)| {
                        for r in 0..bsz {
                            let xr = &x[r * n_in..(r + 1) * n_in];
                            for o in 0..n_out {
                                let dv = d[r * n_out + o];
                                for (g, x) in g[o * n_in..(o + 1) * n_in].iter_mut().zip(xr) {
                                    *g += dv * x;
                                }
                            }
                        }
                    },
                )?;
            mark_ready(reducer.as_deref_mut(), self.w_index(i))?;
            // db_i += Σ_rows dz_i
            let gb = Self::part(&self.grads, &self.b[i])?;
            rt.task(format!("bwd db {i}"))
                .priority(Priority::Side)
                .run((dz.read::<f32>(), gb.read_write::<f32>()), move |(d, g)| {
                    for r in 0..bsz {
                        for (g, d) in g.iter_mut().zip(&d[r * n_out..(r + 1) * n_out]) {
                            *g += d;
                        }
                    }
                })?;
            mark_ready(reducer.as_deref_mut(), self.b_index(i))?;
            if i > 0 {
                // dz_{i-1} = (dz_i · W_i) ⊙ [x_i > 0]   (B, n_in)
                let w = Self::part(&self.params, &self.w[i])?;
                rt.task(format!("bwd dx {i}")).run(
                    (
                        dz.read::<f32>(),
                        w.read::<f32>(),
                        x.read::<f32>(),
                        self.dz[i - 1].write::<f32>(),
                    ),
                    move |(d, w, x, p)| {
                        for r in 0..bsz {
                            let pr = &mut p[r * n_in..(r + 1) * n_in];
                            pr.fill(0.0);
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
                    },
                )?;
            }
        }
        Ok(())
    }

    /// Forward and backward of the loaded batch; with a reducer, its buckets
    /// are all-reduced as they fill and the step is finished.
    pub fn gradients(&self, rt: &Runtime, mut reducer: Option<&mut Reducer>) -> Result<()> {
        self.forward(rt)?;
        self.backward(rt, reducer.as_deref_mut())?;
        match reducer {
            Some(r) => r.finish(),
            None => Ok(()),
        }
    }

    /// p -= lr · g, then zeroes the gradients.
    pub fn sgd(&self, rt: &Runtime, lr: f32) -> Result<()> {
        rt.task("sgd").run(
            (self.grads.read::<f32>(), self.params.read_write::<f32>()),
            move |(g, p)| {
                for (p, g) in p.iter_mut().zip(g) {
                    *p -= lr * g;
                }
            },
        )?;
        self.zero_grad(rt)
    }

    /// Zeroes the gradients.
    pub fn zero_grad(&self, rt: &Runtime) -> Result<()> {
        rt.task("zero grad")
            .run(self.grads.write::<f32>(), |g| g.fill(0.0))?;
        Ok(())
    }
}

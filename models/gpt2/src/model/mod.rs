//! GPT-2 as Braid tasks.
//!
//! # Buffers
//!
//! Four `f32` allocations hold everything, llm.c's way:
//!
//! ```text
//! params     (num_parameters)   ParamLayout order, per-layer contiguous
//! grads      (num_parameters)   the same layout; a DDP bucket is a view of it
//! acts       ActivationLayout::new(cfg, B, T)        every forward activation
//! dacts      ActivationLayout::gradients(cfg, B, T)  their gradients
//! ```
//!
//! plus `tokens` and `targets` (`(B, T)` `u32`) and `loss` (one `f32`).
//! Every tensor is a [`View`] of its allocation, so each task declares exactly
//! the bytes it touches: layer `l`'s layer norm reads layer `l`'s `ln1w` view,
//! not the parameter buffer. Tasks that touch disjoint views never wait for
//! each other; the engine orders the others (read-after-write,
//! write-after-read, write-after-write) in submission order.
//!
//! # Tasks
//!
//! One task per kernel call, submitted in the order of the sequential
//! [`Reference`](crate::reference::Reference) (llm.c's order). The backward
//! pass splits each matrix product into its input-gradient task
//! ([`Priority::Main`], the critical path) and its weight-gradient task
//! ([`Priority::Side`]), which the placement policy puts beside the main
//! chain, so weight gradients of layer `l` run while the input gradients of
//! layers `l, l-1, …` proceed. Zeroing gradients is a task too. The device
//! seam is `ops::Op::run` (the CPU kernels of `kernels::cpu`, or the CUDA
//! launchers of `kernels::cuda` with the same views); the graph itself does
//! not depend on the device.
//!
//! # Numerics
//!
//! Every task runs the same kernel on the same inputs as the reference, and
//! the engine's sequential consistency means every accumulation into a
//! gradient happens in submission order, which is the reference's order. So
//! the forward pass (logits, probabilities, loss) and the backward pass (every
//! activation and parameter gradient) are **bit-identical** to
//! [`Reference`](crate::reference::Reference) on any number of streams and under
//! any placement policy (`tests/engine_model.rs` checks it).
//!
//! On CUDA the kernels reduce in their own (fixed) orders and cuBLAS sums
//! products in its own, so results agree with the CPU and with PyTorch to
//! float tolerance, not bit for bit (`tests/cuda_model.rs`); they are still
//! deterministic for a given shape.

pub(crate) mod ops;
mod sample;

pub use ops::KERNEL_BACKENDS;
pub use sample::{sample_next, Sampler};

/// Whether the model's tasks can run on the backend named `backend`
/// ([`Runtime::backend_name`]): `cpu` and `cuda`.
pub fn runs_on(backend: &str) -> bool {
    KERNEL_BACKENDS.contains(&backend)
}

use braid::comm::ParamSpec;
use braid::{Buffer, Priority, Runtime, TaskHandle, View};

use crate::config::Gpt2Config;
use crate::error::{Gpt2Error, Result};
use crate::kernels::cuda;
use crate::layout::{ParamLayout, Span};
use crate::reference::ActivationLayout;
use ops::{submit, Op};

/// A parameter tensor's view and its index in [`ParamLayout::tensors`] (the
/// index the gradient reducer knows it by).
#[derive(Debug, Clone)]
struct PView {
    view: View,
    index: usize,
}

/// The twelve tensors of one block, as views of the parameter (or gradient)
/// buffer.
#[derive(Debug, Clone)]
struct LayerP {
    ln1w: PView,
    ln1b: PView,
    qkvw: PView,
    qkvb: PView,
    attprojw: PView,
    attprojb: PView,
    ln2w: PView,
    ln2b: PView,
    fcw: PView,
    fcb: PView,
    fcprojw: PView,
    fcprojb: PView,
}

/// Every parameter tensor as a view of one flat buffer.
#[derive(Debug, Clone)]
struct ParamViews {
    wte: PView,
    /// `(T, C)`: only the rows a `(B, T)` batch uses.
    wpe_t: PView,
    wpe: PView,
    layers: Vec<LayerP>,
    lnfw: PView,
    lnfb: PView,
}

impl ParamViews {
    fn new(buf: &Buffer, layout: &ParamLayout, t: usize) -> Result<Self> {
        let index_of = |s: Span| {
            layout
                .tensors
                .binary_search_by_key(&s.offset, |x| x.offset)
                .expect("every span is a tensor of the layout")
        };
        let pv = |s: Span| -> Result<PView> {
            Ok(PView {
                view: buf.view_of::<f32>(s.range())?,
                index: index_of(s),
            })
        };
        let span = |r: std::ops::Range<usize>| Span {
            offset: r.start,
            len: r.len(),
        };
        let c = layout.config().channels;
        let wpe = span(layout.wpe());
        let layers = (0..layout.config().num_layers)
            .map(|l| {
                let p = layout.layer(l);
                Ok(LayerP {
                    ln1w: pv(p.ln1w)?,
                    ln1b: pv(p.ln1b)?,
                    qkvw: pv(p.qkvw)?,
                    qkvb: pv(p.qkvb)?,
                    attprojw: pv(p.attprojw)?,
                    attprojb: pv(p.attprojb)?,
                    ln2w: pv(p.ln2w)?,
                    ln2b: pv(p.ln2b)?,
                    fcw: pv(p.fcw)?,
                    fcb: pv(p.fcb)?,
                    fcprojw: pv(p.fcprojw)?,
                    fcprojb: pv(p.fcprojb)?,
                })
            })
            .collect::<Result<_>>()?;
        Ok(ParamViews {
            wte: pv(span(layout.wte()))?,
            wpe_t: PView {
                view: buf.view_of::<f32>(wpe.offset..wpe.offset + t * c)?,
                index: index_of(wpe),
            },
            wpe: pv(wpe)?,
            layers,
            lnfw: pv(span(layout.lnfw()))?,
            lnfb: pv(span(layout.lnfb()))?,
        })
    }
}

/// One block's activations (or their gradients) as views.
#[derive(Debug, Clone)]
struct LayerA {
    ln1: View,
    ln1_mean: View,
    ln1_rstd: View,
    qkv: View,
    atty: View,
    preatt: View,
    att: View,
    attproj: View,
    residual2: View,
    ln2: View,
    ln2_mean: View,
    ln2_rstd: View,
    fch: View,
    fch_gelu: View,
    fcproj: View,
    residual3: View,
    /// The whole block (for zeroing gradients).
    all: View,
}

/// Every activation (or activation gradient) as a view of one buffer.
#[derive(Debug, Clone)]
struct ActViews {
    encoded: View,
    layers: Vec<LayerA>,
    lnf: View,
    lnf_mean: View,
    lnf_rstd: View,
    logits: View,
    probs: View,
    losses: View,
    /// From `lnf` to the end (for zeroing gradients).
    head: View,
}

impl ActViews {
    fn new(buf: &Buffer, a: &ActivationLayout) -> Result<Self> {
        let v = |s: Span| buf.view_of::<f32>(s.range());
        let layers = a
            .layers
            .iter()
            .map(|la| {
                Ok(LayerA {
                    ln1: v(la.ln1)?,
                    ln1_mean: v(la.ln1_mean)?,
                    ln1_rstd: v(la.ln1_rstd)?,
                    qkv: v(la.qkv)?,
                    atty: v(la.atty)?,
                    preatt: v(la.preatt)?,
                    att: v(la.att)?,
                    attproj: v(la.attproj)?,
                    residual2: v(la.residual2)?,
                    ln2: v(la.ln2)?,
                    ln2_mean: v(la.ln2_mean)?,
                    ln2_rstd: v(la.ln2_rstd)?,
                    fch: v(la.fch)?,
                    fch_gelu: v(la.fch_gelu)?,
                    fcproj: v(la.fcproj)?,
                    residual3: v(la.residual3)?,
                    all: buf.view_of::<f32>(la.ln1.offset..la.residual3.end())?,
                })
            })
            .collect::<Result<_>>()?;
        Ok(ActViews {
            encoded: v(a.encoded)?,
            layers,
            lnf: v(a.lnf)?,
            lnf_mean: v(a.lnf_mean)?,
            lnf_rstd: v(a.lnf_rstd)?,
            logits: v(a.logits)?,
            probs: v(a.probs)?,
            losses: v(a.losses)?,
            head: buf.view_of::<f32>(a.lnf.offset..a.total)?,
        })
    }

    /// The input of block `l`'s residual stream.
    fn residual_in(&self, l: usize) -> &View {
        if l == 0 {
            &self.encoded
        } else {
            &self.layers[l - 1].residual3
        }
    }
}

/// GPT-2 on a Braid runtime, for a fixed batch shape `(B, T)`.
///
/// Submission methods ([`forward`](Self::forward), [`backward`](Self::backward),
/// [`zero_grad`](Self::zero_grad)) return as soon as their tasks are submitted;
/// read-back methods (`read_*`) wait for the tasks that write what they read.
#[derive(Debug)]
pub struct Gpt2Model {
    cfg: Gpt2Config,
    layout: ParamLayout,
    b: usize,
    t: usize,
    params: Buffer,
    grads: Buffer,
    acts: Buffer,
    dacts: Buffer,
    tokens: Buffer,
    targets: Buffer,
    loss: Buffer,
    /// The prefix of the attention scratch buffer (see
    /// [`attention_scratch_bytes`]) the attention forward task declares:
    /// exactly what `kernels::cuda::attention_forward` takes.
    att_scratch_fwd: View,
    /// The prefix of the same buffer the attention backward task declares.
    att_scratch_bwd: View,
    p: ParamViews,
    g: ParamViews,
    a: ActViews,
    da: ActViews,
    /// Element ranges of the gradient zeroing tasks (and of the optimizer's
    /// chunks): the embeddings, each block, the final layer norm.
    groups: Vec<std::ops::Range<usize>>,
    has_targets: bool,
}

impl Gpt2Model {
    /// Allocates the model's buffers on `rt` for batches of `b` sequences of
    /// `t` tokens. Parameters and gradients start at zero.
    pub fn new(rt: &Runtime, cfg: &Gpt2Config, b: usize, t: usize) -> Result<Self> {
        cfg.validate()?;
        if b == 0 {
            return Err(Gpt2Error::InvalidSetting {
                what: "batch size",
                reason: "must be positive".into(),
            });
        }
        if t == 0 || t > cfg.max_seq_len {
            return Err(Gpt2Error::InvalidSetting {
                what: "sequence length",
                reason: format!(
                    "{t} is not in 1..={} (the model's context)",
                    cfg.max_seq_len
                ),
            });
        }
        let layout = ParamLayout::new(cfg);
        let al = ActivationLayout::new(cfg, b, t);
        let gl = ActivationLayout::gradients(cfg, b, t);
        let n = layout.total;
        let params = rt.alloc("params", n * 4)?;
        let grads = rt.alloc("grads", n * 4)?;
        let acts = rt.alloc("acts", al.total * 4)?;
        let dacts = rt.alloc("dacts", gl.total * 4)?;
        let tokens = rt.alloc("tokens", b * t * 4)?;
        let targets = rt.alloc("targets", b * t * 4)?;
        let loss = rt.alloc("loss", 4)?;
        let (c, nh) = (cfg.channels, cfg.num_heads);
        let scratch = rt.alloc("attention scratch", attention_scratch_bytes(b, t, c, nh))?;
        let att_scratch_fwd =
            scratch.view(0..cuda::attention_forward_scratch_bytes(b, t, c, nh))?;
        let att_scratch_bwd =
            scratch.view(0..cuda::attention_backward_scratch_bytes(b, t, c, nh))?;
        let mut groups = vec![layout.wte(), layout.wpe()];
        groups.extend((0..cfg.num_layers).map(|l| layout.layer_range(l)));
        groups.push(layout.lnfw().start..layout.lnfb().end);
        Ok(Gpt2Model {
            p: ParamViews::new(&params, &layout, t)?,
            g: ParamViews::new(&grads, &layout, t)?,
            a: ActViews::new(&acts, &al)?,
            da: ActViews::new(&dacts, &gl)?,
            cfg: *cfg,
            layout,
            b,
            t,
            params,
            grads,
            acts,
            dacts,
            tokens,
            targets,
            loss,
            att_scratch_fwd,
            att_scratch_bwd,
            groups,
            has_targets: false,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &Gpt2Config {
        &self.cfg
    }

    /// The parameter layout that the parameter and gradient buffers follow.
    pub fn layout(&self) -> &ParamLayout {
        &self.layout
    }

    /// Batch size `B`.
    pub fn batch_size(&self) -> usize {
        self.b
    }

    /// Sequence length `T`.
    pub fn seq_len(&self) -> usize {
        self.t
    }

    /// The flat parameter buffer.
    pub fn params(&self) -> &Buffer {
        &self.params
    }

    /// The flat gradient buffer (same layout as the parameters).
    pub fn grads(&self) -> &Buffer {
        &self.grads
    }

    /// The activation buffer ([`ActivationLayout::new`]).
    pub fn activations(&self) -> &Buffer {
        &self.acts
    }

    /// The activation-gradient buffer ([`ActivationLayout::gradients`]).
    pub fn activation_grads(&self) -> &Buffer {
        &self.dacts
    }

    /// `(1)` the mean loss of the last forward pass with targets.
    pub fn loss_view(&self) -> View {
        self.loss.whole()
    }

    /// `(B, T, V)` logits.
    pub fn logits_view(&self) -> &View {
        &self.a.logits
    }

    /// `(B, T, V)` probabilities.
    pub fn probs_view(&self) -> &View {
        &self.a.probs
    }

    /// `(B, T)` per-position losses.
    pub fn losses_view(&self) -> &View {
        &self.a.losses
    }

    /// The parameters as the gradient reducer sees them: every tensor of the
    /// layout, in layout order.
    pub fn param_specs(&self) -> Vec<ParamSpec> {
        self.layout
            .tensors
            .iter()
            .map(|t| ParamSpec::new(t.name.clone(), t.range()))
            .collect()
    }

    /// Element ranges that partition the parameters: the token embedding, the
    /// position embedding, each block, the final layer norm.
    pub fn param_groups(&self) -> &[std::ops::Range<usize>] {
        &self.groups
    }

    /// Copies `params` (layout order) into the parameter buffer (a task).
    pub fn upload_params(&self, rt: &Runtime, params: &[f32]) -> Result<()> {
        if params.len() != self.layout.total {
            return Err(Gpt2Error::LengthMismatch {
                what: "params".into(),
                expected: self.layout.total,
                found: params.len(),
            });
        }
        rt.upload(&self.params, params)?;
        Ok(())
    }

    /// The parameters, after every task submitted so far that writes them.
    pub fn read_params(&self, rt: &Runtime) -> Result<Vec<f32>> {
        Ok(rt.read_vec(&self.params)?)
    }

    /// The parameter gradients.
    pub fn read_grads(&self, rt: &Runtime) -> Result<Vec<f32>> {
        Ok(rt.read_vec(&self.grads)?)
    }

    /// The `(B, T, V)` logits of the last forward pass.
    pub fn read_logits(&self, rt: &Runtime) -> Result<Vec<f32>> {
        Ok(rt.read_vec(&self.a.logits)?)
    }

    /// The `(B, T, V)` probabilities of the last forward pass.
    pub fn read_probs(&self, rt: &Runtime) -> Result<Vec<f32>> {
        Ok(rt.read_vec(&self.a.probs)?)
    }

    /// The `(B, T)` per-position losses of the last forward pass with targets.
    pub fn read_losses(&self, rt: &Runtime) -> Result<Vec<f32>> {
        Ok(rt.read_vec(&self.a.losses)?)
    }

    /// The mean loss of the last forward pass with targets.
    pub fn read_loss(&self, rt: &Runtime) -> Result<f32> {
        Ok(rt.read_vec::<f32>(&self.loss)?[0])
    }

    fn check_ids(&self, what: &str, ids: &[u32]) -> Result<()> {
        let bt = self.b * self.t;
        if ids.len() != bt {
            return Err(Gpt2Error::LengthMismatch {
                what: what.into(),
                expected: bt,
                found: ids.len(),
            });
        }
        crate::data::check_ids(ids, self.cfg.vocab_size, what)
    }

    fn op(&self, rt: &Runtime, name: String, priority: Priority, op: Op) -> Result<TaskHandle> {
        Ok(submit(rt, name, priority, op)?)
    }

    /// Submits the forward pass on `tokens` `(B, T)`; with `targets` `(B, T)`
    /// also the per-position losses and their mean (read it with
    /// [`read_loss`](Self::read_loss)). Ids are checked against the vocabulary
    /// first; nothing is submitted if one is out of range.
    pub fn forward(&mut self, rt: &Runtime, tokens: &[u32], targets: Option<&[u32]>) -> Result<()> {
        self.check_ids("tokens", tokens)?;
        if let Some(targets) = targets {
            self.check_ids("targets", targets)?;
        }
        rt.upload(&self.tokens, tokens)?;
        if let Some(targets) = targets {
            rt.upload(&self.targets, targets)?;
        }
        self.has_targets = targets.is_some();
        let (b, t) = (self.b, self.t);
        let cfg = self.cfg;
        let (c, v, nh) = (cfg.channels, cfg.vocab_size, cfg.num_heads);
        let n = b * t;
        let (p, a) = (&self.p, &self.a);
        let main = Priority::Main;

        self.op(
            rt,
            "encoder forward".into(),
            main,
            Op::Encoder {
                out: a.encoded.clone(),
                tokens: self.tokens.whole(),
                wte: p.wte.view.clone(),
                wpe: p.wpe_t.view.clone(),
                b,
                t,
                c,
            },
        )?;
        for (l, (la, lp)) in a.layers.iter().zip(&p.layers).enumerate() {
            self.op(
                rt,
                format!("L{l} ln1 forward"),
                main,
                Op::LayerNorm {
                    out: la.ln1.clone(),
                    mean: la.ln1_mean.clone(),
                    rstd: la.ln1_rstd.clone(),
                    inp: a.residual_in(l).clone(),
                    weight: lp.ln1w.view.clone(),
                    bias: lp.ln1b.view.clone(),
                    n,
                    c,
                },
            )?;
            self.op(
                rt,
                format!("L{l} qkv forward"),
                main,
                Op::Matmul {
                    out: la.qkv.clone(),
                    inp: la.ln1.clone(),
                    weight: lp.qkvw.view.clone(),
                    bias: Some(lp.qkvb.view.clone()),
                    n,
                    c,
                    oc: 3 * c,
                },
            )?;
            self.op(
                rt,
                format!("L{l} attention forward"),
                main,
                Op::Attention {
                    out: la.atty.clone(),
                    preatt: la.preatt.clone(),
                    att: la.att.clone(),
                    inp: la.qkv.clone(),
                    scratch: self.att_scratch_fwd.clone(),
                    b,
                    t,
                    c,
                    nh,
                },
            )?;
            self.op(
                rt,
                format!("L{l} attproj forward"),
                main,
                Op::Matmul {
                    out: la.attproj.clone(),
                    inp: la.atty.clone(),
                    weight: lp.attprojw.view.clone(),
                    bias: Some(lp.attprojb.view.clone()),
                    n,
                    c,
                    oc: c,
                },
            )?;
            self.op(
                rt,
                format!("L{l} residual2 forward"),
                main,
                Op::Residual {
                    out: la.residual2.clone(),
                    a: a.residual_in(l).clone(),
                    b: la.attproj.clone(),
                },
            )?;
            self.op(
                rt,
                format!("L{l} ln2 forward"),
                main,
                Op::LayerNorm {
                    out: la.ln2.clone(),
                    mean: la.ln2_mean.clone(),
                    rstd: la.ln2_rstd.clone(),
                    inp: la.residual2.clone(),
                    weight: lp.ln2w.view.clone(),
                    bias: lp.ln2b.view.clone(),
                    n,
                    c,
                },
            )?;
            self.op(
                rt,
                format!("L{l} fc forward"),
                main,
                Op::Matmul {
                    out: la.fch.clone(),
                    inp: la.ln2.clone(),
                    weight: lp.fcw.view.clone(),
                    bias: Some(lp.fcb.view.clone()),
                    n,
                    c,
                    oc: 4 * c,
                },
            )?;
            self.op(
                rt,
                format!("L{l} gelu forward"),
                main,
                Op::Gelu {
                    out: la.fch_gelu.clone(),
                    inp: la.fch.clone(),
                },
            )?;
            self.op(
                rt,
                format!("L{l} fcproj forward"),
                main,
                Op::Matmul {
                    out: la.fcproj.clone(),
                    inp: la.fch_gelu.clone(),
                    weight: lp.fcprojw.view.clone(),
                    bias: Some(lp.fcprojb.view.clone()),
                    n,
                    c: 4 * c,
                    oc: c,
                },
            )?;
            self.op(
                rt,
                format!("L{l} residual3 forward"),
                main,
                Op::Residual {
                    out: la.residual3.clone(),
                    a: la.residual2.clone(),
                    b: la.fcproj.clone(),
                },
            )?;
        }
        let last = a.residual_in(cfg.num_layers).clone();
        self.op(
            rt,
            "lnf forward".into(),
            main,
            Op::LayerNorm {
                out: a.lnf.clone(),
                mean: a.lnf_mean.clone(),
                rstd: a.lnf_rstd.clone(),
                inp: last,
                weight: p.lnfw.view.clone(),
                bias: p.lnfb.view.clone(),
                n,
                c,
            },
        )?;
        self.op(
            rt,
            "logits forward".into(),
            main,
            Op::Matmul {
                out: a.logits.clone(),
                inp: a.lnf.clone(),
                weight: p.wte.view.clone(),
                bias: None,
                n,
                c,
                oc: v,
            },
        )?;
        if targets.is_none() {
            self.op(
                rt,
                "softmax forward".into(),
                main,
                Op::Softmax {
                    probs: a.probs.clone(),
                    logits: a.logits.clone(),
                    n,
                    v,
                },
            )?;
        } else {
            self.op(
                rt,
                "softmax crossentropy forward".into(),
                main,
                Op::SoftmaxCrossEntropy {
                    probs: a.probs.clone(),
                    losses: a.losses.clone(),
                    logits: a.logits.clone(),
                    targets: self.targets.whole(),
                    n,
                    v,
                },
            )?;
            self.op(
                rt,
                "mean loss".into(),
                main,
                Op::MeanLoss {
                    loss: self.loss.whole(),
                    losses: a.losses.clone(),
                },
            )?;
        }
        Ok(())
    }

    /// Submits tasks that zero the parameter gradients, one per
    /// [`param_group`](Self::param_groups).
    pub fn zero_grad(&self, rt: &Runtime) -> Result<()> {
        for (i, r) in self.groups.iter().enumerate() {
            self.op(
                rt,
                format!("zero grads {i}"),
                Priority::Side,
                Op::Zero {
                    out: self.grads.view_of::<f32>(r.clone())?,
                },
            )?;
        }
        Ok(())
    }

    /// Submits the backward pass of the last forward (which must have had
    /// targets): ACCUMULATES `dloss · ∂(mean loss)/∂params` into the gradient
    /// buffer, as [`Reference::backward`](crate::reference::Reference::backward)
    /// does. Call [`zero_grad`](Self::zero_grad) first for a plain step.
    ///
    /// `ready(i)` is called with parameter `i` (its index in
    /// [`ParamLayout::tensors`]) right after the last task writing its gradient
    /// is submitted, in backward order: hand it to
    /// [`Reducer::grad_ready`](braid::Reducer::grad_ready).
    pub fn backward(
        &mut self,
        rt: &Runtime,
        dloss: f32,
        mut ready: impl FnMut(usize) -> braid::Result<()>,
    ) -> Result<()> {
        if !self.has_targets {
            return Err(Gpt2Error::InvalidSetting {
                what: "backward pass",
                reason: "it needs a forward pass with targets first".into(),
            });
        }
        let (b, t) = (self.b, self.t);
        let cfg = self.cfg;
        let (c, v, nh) = (cfg.channels, cfg.vocab_size, cfg.num_heads);
        let n = b * t;
        let (p, g, a, da) = (&self.p, &self.g, &self.a, &self.da);
        let (main, side) = (Priority::Main, Priority::Side);

        // Activation gradients accumulate, so they start from zero: one task
        // per block, in the order backward needs them.
        self.op(
            rt,
            "zero dacts head".into(),
            side,
            Op::Zero {
                out: da.head.clone(),
            },
        )?;
        for l in (0..cfg.num_layers).rev() {
            self.op(
                rt,
                format!("L{l} zero dacts"),
                side,
                Op::Zero {
                    out: da.layers[l].all.clone(),
                },
            )?;
        }
        self.op(
            rt,
            "zero dacts encoded".into(),
            side,
            Op::Zero {
                out: da.encoded.clone(),
            },
        )?;

        self.op(
            rt,
            "crossentropy softmax backward".into(),
            main,
            Op::CrossEntropySoftmaxBackward {
                dlogits: da.logits.clone(),
                probs: a.probs.clone(),
                targets: self.targets.whole(),
                dloss,
                n,
                v,
            },
        )?;
        self.op(
            rt,
            "logits backward input".into(),
            main,
            Op::MatmulBackwardInput {
                dinp: da.lnf.clone(),
                dout: da.logits.clone(),
                weight: p.wte.view.clone(),
                n,
                c,
                oc: v,
            },
        )?;
        self.op(
            rt,
            "logits backward weight".into(),
            side,
            Op::MatmulBackwardWeight {
                dweight: g.wte.view.clone(),
                dbias: None,
                dout: da.logits.clone(),
                inp: a.lnf.clone(),
                n,
                c,
                oc: v,
            },
        )?;
        let last = cfg.num_layers;
        self.op(
            rt,
            "lnf backward".into(),
            main,
            Op::LayerNormBackward {
                dinp: da.residual_in(last).clone(),
                dweight: g.lnfw.view.clone(),
                dbias: g.lnfb.view.clone(),
                dout: da.lnf.clone(),
                inp: a.residual_in(last).clone(),
                weight: p.lnfw.view.clone(),
                mean: a.lnf_mean.clone(),
                rstd: a.lnf_rstd.clone(),
                n,
                c,
            },
        )?;
        ready(g.lnfb.index)?;
        ready(g.lnfw.index)?;

        for l in (0..cfg.num_layers).rev() {
            let (la, lda, lp, lg) = (&a.layers[l], &da.layers[l], &p.layers[l], &g.layers[l]);
            // residual3 = residual2 + fcproj
            self.op(
                rt,
                format!("L{l} residual3 backward"),
                main,
                Op::ResidualBackward {
                    da: lda.residual2.clone(),
                    db: lda.fcproj.clone(),
                    dout: lda.residual3.clone(),
                },
            )?;
            // fcproj = fch_gelu · fcprojwᵀ + fcprojb
            self.op(
                rt,
                format!("L{l} fcproj backward input"),
                main,
                Op::MatmulBackwardInput {
                    dinp: lda.fch_gelu.clone(),
                    dout: lda.fcproj.clone(),
                    weight: lp.fcprojw.view.clone(),
                    n,
                    c: 4 * c,
                    oc: c,
                },
            )?;
            self.op(
                rt,
                format!("L{l} fcproj backward weight"),
                side,
                Op::MatmulBackwardWeight {
                    dweight: lg.fcprojw.view.clone(),
                    dbias: Some(lg.fcprojb.view.clone()),
                    dout: lda.fcproj.clone(),
                    inp: la.fch_gelu.clone(),
                    n,
                    c: 4 * c,
                    oc: c,
                },
            )?;
            ready(lg.fcprojb.index)?;
            ready(lg.fcprojw.index)?;
            // fch_gelu = gelu(fch)
            self.op(
                rt,
                format!("L{l} gelu backward"),
                main,
                Op::GeluBackward {
                    dinp: lda.fch.clone(),
                    inp: la.fch.clone(),
                    dout: lda.fch_gelu.clone(),
                },
            )?;
            // fch = ln2 · fcwᵀ + fcb
            self.op(
                rt,
                format!("L{l} fc backward input"),
                main,
                Op::MatmulBackwardInput {
                    dinp: lda.ln2.clone(),
                    dout: lda.fch.clone(),
                    weight: lp.fcw.view.clone(),
                    n,
                    c,
                    oc: 4 * c,
                },
            )?;
            self.op(
                rt,
                format!("L{l} fc backward weight"),
                side,
                Op::MatmulBackwardWeight {
                    dweight: lg.fcw.view.clone(),
                    dbias: Some(lg.fcb.view.clone()),
                    dout: lda.fch.clone(),
                    inp: la.ln2.clone(),
                    n,
                    c,
                    oc: 4 * c,
                },
            )?;
            ready(lg.fcb.index)?;
            ready(lg.fcw.index)?;
            // ln2 = layernorm(residual2)
            self.op(
                rt,
                format!("L{l} ln2 backward"),
                main,
                Op::LayerNormBackward {
                    dinp: lda.residual2.clone(),
                    dweight: lg.ln2w.view.clone(),
                    dbias: lg.ln2b.view.clone(),
                    dout: lda.ln2.clone(),
                    inp: la.residual2.clone(),
                    weight: lp.ln2w.view.clone(),
                    mean: la.ln2_mean.clone(),
                    rstd: la.ln2_rstd.clone(),
                    n,
                    c,
                },
            )?;
            ready(lg.ln2b.index)?;
            ready(lg.ln2w.index)?;
            // residual2 = residual_in + attproj
            self.op(
                rt,
                format!("L{l} residual2 backward"),
                main,
                Op::ResidualBackward {
                    da: da.residual_in(l).clone(),
                    db: lda.attproj.clone(),
                    dout: lda.residual2.clone(),
                },
            )?;
            // attproj = atty · attprojwᵀ + attprojb
            self.op(
                rt,
                format!("L{l} attproj backward input"),
                main,
                Op::MatmulBackwardInput {
                    dinp: lda.atty.clone(),
                    dout: lda.attproj.clone(),
                    weight: lp.attprojw.view.clone(),
                    n,
                    c,
                    oc: c,
                },
            )?;
            self.op(
                rt,
                format!("L{l} attproj backward weight"),
                side,
                Op::MatmulBackwardWeight {
                    dweight: lg.attprojw.view.clone(),
                    dbias: Some(lg.attprojb.view.clone()),
                    dout: lda.attproj.clone(),
                    inp: la.atty.clone(),
                    n,
                    c,
                    oc: c,
                },
            )?;
            ready(lg.attprojb.index)?;
            ready(lg.attprojw.index)?;
            // atty = attention(qkv)
            self.op(
                rt,
                format!("L{l} attention backward"),
                main,
                Op::AttentionBackward {
                    dinp: lda.qkv.clone(),
                    dout: lda.atty.clone(),
                    inp: la.qkv.clone(),
                    att: la.att.clone(),
                    scratch: self.att_scratch_bwd.clone(),
                    b,
                    t,
                    c,
                    nh,
                },
            )?;
            // qkv = ln1 · qkvwᵀ + qkvb
            self.op(
                rt,
                format!("L{l} qkv backward input"),
                main,
                Op::MatmulBackwardInput {
                    dinp: lda.ln1.clone(),
                    dout: lda.qkv.clone(),
                    weight: lp.qkvw.view.clone(),
                    n,
                    c,
                    oc: 3 * c,
                },
            )?;
            self.op(
                rt,
                format!("L{l} qkv backward weight"),
                side,
                Op::MatmulBackwardWeight {
                    dweight: lg.qkvw.view.clone(),
                    dbias: Some(lg.qkvb.view.clone()),
                    dout: lda.qkv.clone(),
                    inp: la.ln1.clone(),
                    n,
                    c,
                    oc: 3 * c,
                },
            )?;
            ready(lg.qkvb.index)?;
            ready(lg.qkvw.index)?;
            // ln1 = layernorm(residual_in)
            self.op(
                rt,
                format!("L{l} ln1 backward"),
                main,
                Op::LayerNormBackward {
                    dinp: da.residual_in(l).clone(),
                    dweight: lg.ln1w.view.clone(),
                    dbias: lg.ln1b.view.clone(),
                    dout: lda.ln1.clone(),
                    inp: a.residual_in(l).clone(),
                    weight: lp.ln1w.view.clone(),
                    mean: la.ln1_mean.clone(),
                    rstd: la.ln1_rstd.clone(),
                    n,
                    c,
                },
            )?;
            ready(lg.ln1b.index)?;
            ready(lg.ln1w.index)?;
        }

        // encoded = wte[tokens] + wpe
        self.op(
            rt,
            "encoder backward".into(),
            main,
            Op::EncoderBackward {
                dwte: g.wte.view.clone(),
                dwpe: g.wpe_t.view.clone(),
                dout: da.encoded.clone(),
                tokens: self.tokens.whole(),
                b,
                t,
                c,
            },
        )?;
        ready(g.wpe.index)?;
        ready(g.wte.index)?;
        Ok(())
    }
}

/// Bytes of device scratch the attention tasks use: the larger of what the
/// GPU attention kernels need forward (`4·B·T·C` f32: the heads of `q`, `k`,
/// `v` permuted, and `att · v`) and backward (`6·B·T·C + 2·B·NH·T·T` f32),
/// as `kernels/cuda.rs` documents them. The forward task declares (`write`)
/// the forward size from the start of the buffer, the backward task the
/// backward size, exactly what the launchers take. The CPU kernels use none
/// of it; the task graph declares it on every backend so that the graph is
/// the same everywhere. One buffer serves every layer: the attention tasks
/// are in one chain anyway.
pub fn attention_scratch_bytes(b: usize, t: usize, c: usize, nh: usize) -> usize {
    cuda::attention_forward_scratch_bytes(b, t, c, nh)
        .max(cuda::attention_backward_scratch_bytes(b, t, c, nh))
}

/// GPT-2's initialisation (as in nanoGPT and llm.c): weights `N(0, 0.02)`, the
/// two residual projections of each block `N(0, 0.02 / sqrt(2L))`, biases 0,
/// layer-norm gains 1. Deterministic in `seed`.
pub fn init_params(cfg: &Gpt2Config, seed: u64) -> Vec<f32> {
    let layout = ParamLayout::new(cfg);
    let mut params = vec![0.0f32; layout.total];
    let mut rng = Rng::new(seed);
    let residual_std = 0.02 / (2.0 * cfg.num_layers as f32).sqrt();
    for t in &layout.tensors {
        let dst = &mut params[t.range()];
        let name = t.name.as_str();
        if name.ends_with(".bias") {
            continue;
        }
        if name.contains("ln_") {
            dst.fill(1.0);
            continue;
        }
        let std = if name.ends_with("attn.c_proj.weight") || name.ends_with("mlp.c_proj.weight") {
            residual_std
        } else {
            0.02
        };
        for x in dst {
            *x = rng.normal() * std;
        }
    }
    params
}

/// The seeded generator of initialisation and sampling ([`crate::rng`]).
pub use crate::rng::Rng;

//! GPT-2 as Braid tasks.
//!
//! # Buffers
//!
//! Four allocations of the storage type ([`ModelOptions::dtype`], `f32` by
//! default) hold everything, llm.c's way:
//!
//! ```text
//! params     (num_parameters)   ParamLayout order, per-layer contiguous
//! grads      (num_parameters)   the same layout; a DDP bucket is a view of it
//! acts       ActivationLayout::stored(cfg, B, T, …)  every forward activation
//! dacts      the same, gradients                      their gradients
//! ```
//!
//! plus `tokens` and `targets` (`(B, T)` `u32`), `loss` (one `f32`) and,
//! with bf16 storage, `master params` (`f32` master weights, the layout of
//! `params`).
//! Every tensor is a [`View`] of its allocation, held in the same structs
//! the layouts use, generic over the handle ([`LayerParams<View>`] for
//! [`LayerParams<Span>`](LayerParams), [`LayerActivations<View>`] for the
//! spans of [`ActivationLayout`]), so each task declares exactly the bytes it
//! touches: layer `l`'s layer norm reads layer `l`'s `ln1w` view, not the
//! parameter buffer. Tasks that touch disjoint views never wait for each
//! other; the engine orders the others (read-after-write, write-after-read,
//! write-after-write) in submission order.
//!
//! # Tasks
//!
//! [`forward`](Gpt2Model::forward) and [`backward`](Gpt2Model::backward)
//! read like the sequential [`Reference`](crate::reference::Reference): one
//! call per kernel, in llm.c's order, each call a task of its family in
//! [`crate::kernels`] (which declares the accesses and carries a CPU and a
//! CUDA body). The backward pass splits each matrix product into its
//! input-gradient task ([`Priority::Main`], the critical path) and its
//! weight-gradient task ([`Priority::Side`]), which the placement policy puts
//! beside the main chain, so weight gradients of layer `l` run while the
//! input gradients of layers `l, l-1, …` proceed. Zeroing gradients is a task
//! too. The graph does not depend on the device.
//!
//! # Token ids
//!
//! The encoder and loss tasks are `unsafe`: on CUDA their kernels index
//! memory with the ids they read on the device. The views they get here are
//! the model's private `tokens` and `targets` buffers, which are zero when
//! allocated and written only by [`Gpt2Model::forward`], after it checked
//! every id against the vocabulary on the host (`crate::data::check_ids`, the
//! check of [`crate::kernels::check_tokens`]); `V` is the configuration's
//! vocabulary, the row count of `wte` and the used width of every logits
//! and probability row.
//!
//! # Padded logits rows
//!
//! The `(B, T, V)` logits, probabilities and their gradients are stored in
//! rows of `Vp` ([`Gpt2Config::padded_vocab`]: 50,304 for GPT-2's 50,257),
//! so that every row starts aligned for the three classifier products; the
//! tasks read and write only the first `V` columns, and the `read_*`
//! methods return `(B, T, V)`.
//!
//! # Padded classifier weight
//!
//! An odd vocabulary keeps cuBLAS off its fast tiles for the classifier's
//! products even with aligned rows: on an H100, `(8192, 768) · (768,
//! 50257)` in bf16 took 6.7 ms against 0.8 ms at 50,304 columns
//! (`benches/src/bin/gemm_vocab.rs`, docs/gpu-validation.md run 6). So with
//! the fused classifier the model keeps a `(Vp, C)` classifier weight:
//! its first `V` rows a copy of `wte` made by a task at the start of every
//! forward pass (0.05 ms on the H100 at 124M), its other rows zero from the
//! allocation and never written. The logits product and the input-gradient
//! product run over all `Vp` columns:
//!
//! - the padding columns of the logits are `lnf · 0 = 0`; no kernel reads
//!   them as logits (the loss, softmax and sampling read the first `V`);
//! - the fused classifier writes the logits' gradient over the logits, and
//!   zeros over their padding columns, so the input-gradient product's sum
//!   over the padding adds exactly nothing.
//!
//! The weight-gradient product runs over `Vp` rows too, into a `(Vp, C)`
//! gradient buffer of its own (zeroed first, as the product accumulates),
//! whose first `V` rows a task then adds into `wte`'s gradient (on an H100
//! the product took 1.17 ms at 50,257 rows and 0.71 ms at 50,304; the zero
//! and the add move about 0.3 GB). `wte` itself keeps `V` rows
//! (checkpoints, Hugging Face weights and the parameter layout are
//! unchanged). Without the fused classifier the products stay at `V`
//! columns. The CPU's products gain nothing from the padding, so there the
//! model keeps no padded weight by default and the fused classifier's
//! products run over `V` (`ModelOptions::padded_classifier`; the main job
//! 0.97× the wall time without the copy, 6 pairs).
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
//! With bf16 storage the same holds (the engine model is bit-identical on any
//! streams and policy), against the kernels' bf16 versions: every kernel
//! computes in `f32` and rounds once as it stores (`tests/reference_pytorch_bf16.rs`
//! compares with PyTorch in bf16).
//!
//! On CUDA the kernels reduce in their own (fixed) orders and cuBLAS sums
//! products in its own, so results agree with the CPU and with PyTorch to
//! float tolerance, not bit for bit (`tests/reference_pytorch.rs`); they are
//! still deterministic for a given shape.

mod backward;
mod decode;
mod forward;
mod sample;

pub use crate::kernels::storage::Dtype;
pub use crate::kernels::KERNEL_BACKENDS;
pub use crate::reference::Fusion;
pub use sample::{sample_next, sample_with, Sampler, Sampling};

/// Whether the model's tasks can run on the backend named `backend`
/// ([`Runtime::backend_name`]): `cpu` and `cuda`.
pub fn runs_on(backend: &str) -> bool {
    KERNEL_BACKENDS.contains(&backend)
}

use braid::comm::ParamSpec;
use braid::{Buffer, Priority, Runtime, View};

use crate::config::Gpt2Config;
use crate::error::{Gpt2Error, Result};
use crate::kernels::storage::{convert, Bf16};
use crate::kernels::task::Task;
use crate::kernels::{attention, fill, flash_attention, layernorm};
use crate::layout::{LayerParams, ParamLayout, Span};
use crate::reference::{ActivationLayout, LayerActivations};

/// Every parameter tensor of the model as a `T`: a view of the parameter or
/// gradient buffer, or the tensor's index in [`ParamLayout::tensors`] (the
/// index the gradient reducer knows it by).
#[derive(Debug, Clone)]
struct Params<T> {
    /// `(V, C)`
    wte: T,
    /// `(T, C)` as views: only the rows a `(B, T)` batch uses.
    wpe: T,
    layers: Vec<LayerParams<T>>,
    /// `(C)`
    lnfw: T,
    /// `(C)`
    lnfb: T,
}

/// The view of elements `r` of `buf`, which stores `dtype` elements.
fn elems(buf: &Buffer, r: std::ops::Range<usize>, dtype: Dtype) -> braid::Result<View> {
    let es = dtype.size();
    buf.view(r.start * es..r.end * es)
}

impl Params<View> {
    fn views(buf: &Buffer, layout: &ParamLayout, t: usize, dtype: Dtype) -> Result<Self> {
        let view = |s: &Span| elems(buf, s.range(), dtype);
        let wpe = layout.wpe().start;
        Ok(Params {
            wte: elems(buf, layout.wte(), dtype)?,
            wpe: elems(buf, wpe..wpe + t * layout.config().channels, dtype)?,
            layers: (0..layout.config().num_layers)
                .map(|l| layout.layer(l).try_map(view))
                .collect::<braid::Result<_>>()?,
            lnfw: elems(buf, layout.lnfw(), dtype)?,
            lnfb: elems(buf, layout.lnfb(), dtype)?,
        })
    }
}

impl Params<usize> {
    /// Each tensor's index among [`Gpt2Model::param_specs`] when `wte` is
    /// handed over in `wte_pieces` pieces (`wte`: the first piece's).
    fn indices(layout: &ParamLayout, wte_pieces: usize) -> Self {
        let wte = layout
            .tensors
            .binary_search_by_key(&layout.wte().start, |x| x.offset)
            .expect("wte is a tensor of the layout");
        let index = |start: usize| {
            let i = layout
                .tensors
                .binary_search_by_key(&start, |x| x.offset)
                .expect("every span is a tensor of the layout");
            if i > wte {
                i + wte_pieces - 1
            } else {
                i
            }
        };
        Params {
            wte: index(layout.wte().start),
            wpe: index(layout.wpe().start),
            layers: (0..layout.config().num_layers)
                .map(|l| layout.layer(l).map(|s| index(s.offset)))
                .collect(),
            lnfw: index(layout.lnfw().start),
            lnfb: index(layout.lnfb().start),
        }
    }
}

/// Every activation (or activation gradient) as a view of one buffer: the
/// spans of an [`ActivationLayout`] made views.
#[derive(Debug, Clone)]
struct Acts {
    encoded: View,
    layers: Vec<LayerActivations<View>>,
    lnf: View,
    lnf_mean: View,
    lnf_rstd: View,
    logits: View,
    probs: View,
    losses: View,
    /// Gradients in a ring ([`ActivationLayout::stored_gradients`]): each
    /// block's ring slot and its residual pair (for zeroing); empty for the
    /// forward activations.
    blocks: Vec<(View, View)>,
    /// The layout's ring slots ([`ActivationLayout::ring`]; 0: no ring).
    ring: usize,
    /// From `lnf` to the end (for zeroing gradients).
    head: View,
}

impl Acts {
    /// `a` is a layout of `dtype` elements ([`ActivationLayout::stored`]).
    fn views(buf: &Buffer, a: &ActivationLayout, dtype: Dtype) -> Result<Self> {
        let v = |s: &Span| elems(buf, s.range(), dtype);
        Ok(Acts {
            encoded: v(&a.encoded)?,
            layers: a
                .layers
                .iter()
                .map(|la| la.try_map(v))
                .collect::<braid::Result<_>>()?,
            lnf: v(&a.lnf)?,
            lnf_mean: v(&a.lnf_mean)?,
            lnf_rstd: v(&a.lnf_rstd)?,
            logits: v(&a.logits)?,
            probs: v(&a.probs)?,
            losses: v(&a.losses)?,
            ring: a.ring,
            blocks: match a.ring {
                0 => Vec::new(),
                _ => a
                    .layers
                    .iter()
                    .map(|la| Ok((v(&la.ring_slot())?, v(&la.residual_pair())?)))
                    .collect::<braid::Result<_>>()?,
            },
            head: elems(buf, a.lnf.offset..a.total, dtype)?,
        })
    }

    /// The input of block `l`'s residual stream: `encoded`, or block
    /// `l - 1`'s output.
    fn residual_in(&self, l: usize) -> &View {
        if l == 0 {
            &self.encoded
        } else {
            &self.layers[l - 1].residual3
        }
    }

    /// The last block's output.
    fn residual_out(&self) -> &View {
        self.residual_in(self.layers.len())
    }
}

/// Row blocks of the tied embedding's classifier gradient when it is split
/// ([`Gpt2Model::set_split_tied`]): each block's all-reduce overlaps the
/// computation of the next. `wte` is the largest gradient of GPT-2 (31% of
/// 124M's parameters, 88% of `small`'s) and its classifier part the longest
/// weight-gradient task, so whole, its all-reduce could start only when
/// little of the backward pass was left to hide it.
pub const TIED_PIECES: usize = 4;

/// Ring slots of the activation gradients
/// ([`ActivationLayout::stored_gradients`]): block `l`'s gradients other than
/// the residual stream's reuse block `l + GRADIENT_RING`'s memory. Two slots
/// let block `l`'s weight gradients (side priority) run beside block
/// `l - 1`'s backward; at GPT-2 124M (`L` 12) they keep 2 of 12 blocks'
/// worth.
pub const GRADIENT_RING: usize = 2;

/// How [`Gpt2Model`] computes attention and the loss.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ModelOptions {
    /// Which fused kernels to use ([`Fusion`]: flash attention, the fused
    /// classifier, residual + layer norm, GELU recomputation), each on its
    /// own; none by default. [`Fusion::ALL`] is `braid-gpt2 train --fused`,
    /// the trainer's default on a GPU.
    /// Every fused kernel has a CUDA body too (docs/gpu-validation.md
    /// records where they ran). The results agree with the unfused path to
    /// float tolerance, not bit for bit.
    ///
    /// With the fused classifier [`Gpt2Model::read_probs`] is empty, a
    /// forward pass without targets computes no probabilities, and once
    /// [`Gpt2Model::backward`] is submitted the logits buffer holds the
    /// logits' gradient: read the logits before submitting the backward pass.
    pub fusion: Fusion,
    /// The storage type of parameters, gradients and activations
    /// ([`Dtype::F32`] by default). With [`Dtype::Bf16`] the model works the
    /// way llm.c's mixed precision does: bf16 parameters, gradients and
    /// activations, every kernel computing in `f32` (row reductions in
    /// `f64`) and rounding once as it stores; layer-norm statistics and
    /// losses stay `f32`; the model keeps `f32` master weights
    /// ([`Gpt2Model::master`]) that the optimizer updates and rounds into the
    /// bf16 parameters. Every kernel has a bf16 CUDA body (cuBLAS products
    /// with `f32` accumulation).
    pub dtype: Dtype,
    /// With the fused classifier and an odd vocabulary: whether the model
    /// keeps the padded `(Vp, C)` copy of `wte` as the classifier's weight
    /// (see "Padded classifier weight" above). `None`, the default: on
    /// CUDA, where the padded products are several times faster, not on
    /// the CPU, where the per-step copy costs more than it saves.
    /// `Some(_)` forces the choice (the CPU tests of the padded path).
    pub padded_classifier: Option<bool>,
    /// A model for forward passes only (sampling, evaluation; PyTorch's
    /// `torch.no_grad()`): no parameter gradients, activation gradients,
    /// backward scratch or master weights, and every block's activations
    /// in one slot that the next block overwrites
    /// ([`ActivationLayout::inference`]) — except each block's `qkv`, the
    /// KV cache of [`Gpt2Model::forward_position`], where that can run
    /// (batch size 1, no fused kernels). Parameters are uploaded rounded
    /// to the storage type. [`backward`](Gpt2Model::backward),
    /// [`zero_grad`](Gpt2Model::zero_grad), [`grads`](Gpt2Model::grads) and
    /// the other gradient methods fail with an error saying so.
    pub inference: bool,
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
    acts: Buffer,
    tokens: Buffer,
    targets: Buffer,
    loss: Buffer,
    /// The prefix of the attention scratch buffer (see
    /// [`attention_scratch_bytes`]) the attention forward task declares:
    /// exactly what [`attention::attention_forward_cuda`] takes (empty
    /// with the fused attention, whose forward pass takes none).
    att_scratch_fwd: View,
    /// The attention scratch buffer (see [`attention_scratch_bytes`]).
    att_scratch: Buffer,
    /// What only training uses; `None` in a model made for inference
    /// ([`ModelOptions::inference`]).
    training: Option<Training>,
    p: Params<View>,
    ids: Params<usize>,
    a: Acts,
    /// Element ranges of the gradient zeroing tasks (and of the optimizer's
    /// chunks): the embeddings, each block, the final layer norm.
    groups: Vec<std::ops::Range<usize>>,
    has_targets: bool,
    /// The tied embedding's gradient as two writers (see
    /// [`set_split_tied`](Self::set_split_tied)).
    split_tied: bool,
    /// With `split_tied`: the row blocks of `wte` its classifier gradient is
    /// made and handed over in, and their gradient views; else empty.
    wte_pieces: Vec<(std::ops::Range<usize>, View)>,
    fusion: Fusion,
    dtype: Dtype,
    /// As made ([`ModelOptions::padded_classifier`]).
    padded_classifier: Option<bool>,
    /// `Vp`: the row length of the logits, probabilities and their gradients.
    vp: usize,
    /// `f32` master weights (layout order) when `dtype` is not `f32`.
    master: Option<Buffer>,
    /// With the fused classifier and `Vp > V`: the classifier's `(Vp, C)`
    /// weight, `wte` copied into its first `V` rows at the start of every
    /// forward pass, the rest zero (see "Padded classifier weight" above).
    classifier_weight: Option<Buffer>,
}

/// The buffers of a model that only the backward pass and the optimizer
/// use ([`Gpt2Model`] holds them unless made for inference).
#[derive(Debug)]
struct Training {
    /// The parameter gradients, in the layout of the parameters.
    grads: Buffer,
    /// The activation gradients ([`ActivationLayout::stored_gradients`]).
    dacts: Buffer,
    g: Params<View>,
    da: Acts,
    /// The prefix of the attention scratch buffer the attention backward
    /// task declares.
    att_scratch_bwd: View,
    /// With [`flash_attention::dq_by_gemm`] on CUDA (bf16, fused
    /// attention): the attention backward's dSᵀ, `(B, NH, T, T)` bf16, zeroed
    /// at allocation and written only there (its masked elements stay 0).
    att_ds: Option<View>,
    /// `B·T` `u32` of scratch for the encoder backward task (the bf16 CUDA
    /// kernel chains each token's positions there).
    links: Buffer,
    /// The layer norms' backward scratch on CUDA (the row chunks' parameter
    /// gradient sums, [`layernorm::backward_scratch_bytes`]); one buffer
    /// for all of them, which run one after another anyway (each takes the
    /// residual gradient the one after it made).
    ln_scratch: Buffer,
    /// With the padded classifier weight: its `(Vp, C)` gradient, made in
    /// full each backward pass and its first `V` rows added into `wte`'s.
    classifier_grad: Option<Buffer>,
}

impl Training {
    /// The training buffers of a model of `cfg` for `(b, t)` batches, made
    /// with `opts`; `att_scratch_bwd` is the attention backward task's
    /// prefix of the attention scratch, `padded` whether the model keeps
    /// the padded classifier weight.
    fn new(
        rt: &Runtime,
        cfg: &Gpt2Config,
        (b, t): (usize, usize),
        opts: ModelOptions,
        layout: &ParamLayout,
        att_scratch_bwd: View,
        padded: bool,
    ) -> Result<Self> {
        let (fusion, dtype) = (opts.fusion, opts.dtype);
        let gl = ActivationLayout::stored_gradients(cfg, b, t, fusion, dtype, GRADIENT_RING);
        let (c, nh, es) = (cfg.channels, cfg.num_heads, dtype.size());
        let grads = rt.alloc("grads", layout.total * es)?;
        let dacts = rt.alloc("dacts", gl.total * es)?;
        let att_ds = if fusion.attention
            && flash_attention::dq_by_gemm()
            && dtype == Dtype::Bf16
            && rt.backend_name() == "cuda"
            && t % 2 == 0
            && flash_attention::TC_HEAD_SIZES.contains(&(c / nh))
        {
            let bytes = flash_attention::ds_bytes(b, t, nh);
            Some(rt.alloc("attention dS", bytes)?.whole())
        } else {
            None
        };
        let vp = gl.vp;
        Ok(Training {
            g: Params::views(&grads, layout, t, dtype)?,
            da: Acts::views(&dacts, &gl, dtype)?,
            grads,
            dacts,
            att_scratch_bwd,
            att_ds,
            links: rt.alloc("token links", b * t * 4)?,
            ln_scratch: rt.alloc(
                "layer norm scratch",
                layernorm::backward_scratch_bytes(b * t, c),
            )?,
            classifier_grad: match padded {
                true => Some(rt.alloc("classifier weight grad", vp * c * es)?),
                false => None,
            },
        })
    }
}

/// Makes the model's tasks: `rt.task(name)` with the model's storage dtype.
struct Tasks<'rt> {
    rt: &'rt Runtime,
    dtype: Dtype,
}

impl<'rt> Tasks<'rt> {
    fn task(&self, name: impl Into<std::borrow::Cow<'static, str>>) -> Task<'rt> {
        Task::new(self.rt.task(name), self.dtype)
    }
}

impl Gpt2Model {
    /// Allocates the model's buffers on `rt` for batches of `b` sequences of
    /// `t` tokens. Parameters and gradients start at zero.
    pub fn new(rt: &Runtime, cfg: &Gpt2Config, b: usize, t: usize) -> Result<Self> {
        Self::with_options(rt, cfg, b, t, ModelOptions::default())
    }

    /// [`new`](Self::new) with [`ModelOptions`].
    pub fn with_options(
        rt: &Runtime,
        cfg: &Gpt2Config,
        b: usize,
        t: usize,
        opts: ModelOptions,
    ) -> Result<Self> {
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
        // A bound on the activations' bytes (logits, attention matrices and
        // sixteen `C`-wide tensors a layer, at 8 bytes): the layout's sums
        // cannot overflow below it, and a shape past it is no allocation's.
        let bound = (|| {
            let per_layer = (cfg.num_heads.checked_mul(t)?.checked_mul(2)?)
                .checked_add(cfg.channels.checked_mul(16)?)?;
            let per_row = cfg
                .padded_vocab()
                .checked_add(cfg.num_layers.checked_mul(per_layer)?)?;
            b.checked_mul(t)?.checked_mul(per_row)?.checked_mul(8)
        })();
        if bound.is_none_or(|n| n > isize::MAX as usize) {
            return Err(Gpt2Error::InvalidSetting {
                what: "batch shape",
                reason: format!(
                    "batch {b} × {t} tokens of {cfg} needs more bytes than any address holds"
                ),
            });
        }
        let layout = ParamLayout::new(cfg);
        let (fusion, dtype, inference) = (opts.fusion, opts.dtype, opts.inference);
        let al = if inference {
            // The KV cache only where `forward_position` can use it.
            let keep_qkv = b == 1 && fusion == Fusion::NONE;
            ActivationLayout::inference(cfg, b, t, fusion, dtype, keep_qkv)
        } else {
            ActivationLayout::stored(cfg, b, t, fusion, false, dtype)
        };
        let (n, es) = (layout.total, dtype.size());
        let params = rt.alloc("params", n * es)?;
        let master = match dtype {
            Dtype::F32 => None,
            _ if inference => None,
            _ => Some(rt.alloc("master params", n * 4)?),
        };
        let acts = rt.alloc("acts", al.total * es)?;
        let tokens = rt.alloc("tokens", b * t * 4)?;
        let targets = rt.alloc("targets", b * t * 4)?;
        let loss = rt.alloc("loss", 4)?;
        let (c, nh) = (cfg.channels, cfg.num_heads);
        // One buffer, the forward task declaring a prefix and the backward
        // task another. The fused attention's forward pass declares none;
        // its backward pass keeps D = rowsum(dout ∘ out) there.
        let (fwd_bytes, bwd_bytes) = if fusion.attention {
            (0, flash_attention::backward_scratch_bytes(b, t, nh))
        } else {
            (
                attention::forward_scratch_bytes(b, t, c, nh, dtype),
                attention::backward_scratch_bytes(b, t, c, nh, dtype),
            )
        };
        let scratch_bytes = if inference {
            fwd_bytes
        } else {
            fwd_bytes.max(bwd_bytes)
        };
        let att_scratch = rt.alloc("attention scratch", scratch_bytes)?;
        let vp = al.vp;
        let padded = opts
            .padded_classifier
            .unwrap_or(rt.backend_name() == "cuda");
        let padded = fusion.classifier && vp > cfg.vocab_size && padded;
        let classifier_weight = match padded {
            true => Some(rt.alloc("classifier weight", vp * c * es)?),
            false => None,
        };
        let training = match inference {
            true => None,
            false => Some(Training::new(
                rt,
                cfg,
                (b, t),
                opts,
                &layout,
                att_scratch.view(0..bwd_bytes)?,
                padded,
            )?),
        };
        let mut groups = vec![layout.wte(), layout.wpe()];
        groups.extend((0..cfg.num_layers).map(|l| layout.layer_range(l)));
        groups.push(layout.lnfw().start..layout.lnfb().end);
        Ok(Gpt2Model {
            p: Params::views(&params, &layout, t, dtype)?,
            ids: Params::indices(&layout, 1),
            a: Acts::views(&acts, &al, dtype)?,
            cfg: *cfg,
            layout,
            b,
            t,
            params,
            acts,
            tokens,
            targets,
            loss,
            att_scratch_fwd: att_scratch.view(0..fwd_bytes)?,
            att_scratch,
            training,
            groups,
            has_targets: false,
            split_tied: false,
            wte_pieces: Vec::new(),
            fusion,
            padded_classifier: opts.padded_classifier,
            dtype,
            vp,
            master,
            classifier_weight,
        })
    }

    /// What only training uses, or the error of a model made for inference.
    fn training(&self) -> Result<&Training> {
        self.training
            .as_ref()
            .ok_or_else(|| Gpt2Error::InvalidSetting {
                what: "gradients",
                reason: "the model was made for inference (ModelOptions::inference) and has none"
                    .into(),
            })
    }

    /// Splits the tied embedding's gradient into its two writers, for data
    /// parallelism: [`backward`](Self::backward) marks `wte` ready right after
    /// the classifier's contribution (the first task of the backward pass, so
    /// its all-reduce overlaps everything after), and the encoder adds only
    /// the position gradient, leaving the token rows in the encoder's input
    /// gradient for [`tied_rows`](Self::tied_rows) — hand them to
    /// [`Reducer::sparse_ready`](braid::Reducer::sparse_ready) after the
    /// backward pass. Without a reducer that adds them, `wte`'s gradient
    /// misses the encoder's part. Every backend and dtype: the rows are of
    /// the model's storage type, as the reducer's gradients are.
    ///
    /// The classifier's part is made and handed over in [`TIED_PIECES`] row
    /// blocks of `wte`, each its own weight-gradient task and its own
    /// parameter in [`param_specs`](Self::param_specs) (so `ready` counts
    /// them, and the reducer can all-reduce each block while the next is
    /// computed): call this before making the reducer.
    pub fn set_split_tied(&mut self, on: bool) -> Result<()> {
        let (v, c) = (self.cfg.vocab_size, self.cfg.channels);
        let pieces = if on { TIED_PIECES.clamp(1, v) } else { 1 };
        let base = self.layout.wte().start;
        let grads = &self.training()?.grads;
        self.wte_pieces = match on {
            false => Vec::new(),
            true => (0..pieces)
                .map(|i| {
                    let rows = i * v / pieces..(i + 1) * v / pieces;
                    let view = elems(
                        grads,
                        base + rows.start * c..base + rows.end * c,
                        self.dtype,
                    )?;
                    Ok((rows, view))
                })
                .collect::<braid::Result<_>>()?,
        };
        self.ids = Params::indices(&self.layout, pieces);
        self.split_tied = on;
        Ok(())
    }

    /// Whether the tied gradient is split ([`set_split_tied`](Self::set_split_tied)).
    pub fn split_tied(&self) -> bool {
        self.split_tied
    }

    /// The encoder's contribution to `wte`'s gradient after a split backward
    /// pass: row `tokens[i]` of `wte` receives row `i` of the encoder's input
    /// gradient `(B·T, C)`; with the indices of `wte`'s pieces among
    /// [`param_specs`](Self::param_specs) (for
    /// [`Reducer::sparse_ready_range`](braid::Reducer::sparse_ready_range)).
    pub fn tied_rows(&self) -> Result<(std::ops::Range<usize>, braid::comm::SparseRows)> {
        let rows = braid::comm::SparseRows::new(
            self.tokens.whole(),
            self.training()?.da.encoded.clone(),
            self.cfg.channels,
        );
        let pieces = self.wte_pieces.len().max(1);
        Ok((self.ids.wte..self.ids.wte + pieces, rows))
    }

    /// The configuration.
    pub fn config(&self) -> &Gpt2Config {
        &self.cfg
    }

    /// Whether the model keeps the padded classifier weight
    /// ([`ModelOptions::padded_classifier`]; only with the fused classifier
    /// and an odd vocabulary).
    pub fn pads_classifier(&self) -> bool {
        self.classifier_weight.is_some()
    }

    /// The options the model was made with.
    pub fn options(&self) -> ModelOptions {
        ModelOptions {
            fusion: self.fusion,
            dtype: self.dtype,
            padded_classifier: self.padded_classifier,
            inference: self.training.is_none(),
        }
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

    /// The flat parameter buffer, of [`dtype`](Self::dtype) elements (the
    /// weights the forward pass reads).
    pub fn params(&self) -> &Buffer {
        &self.params
    }

    /// The storage type of parameters, gradients and activations.
    pub fn dtype(&self) -> Dtype {
        self.dtype
    }

    /// The `f32` master weights (layout order) of a model that stores its
    /// parameters in another type; `None` for an `f32` model, whose
    /// [`params`](Self::params) are its master weights.
    pub fn master(&self) -> Option<&Buffer> {
        self.master.as_ref()
    }

    /// The flat gradient buffer (same layout and type as the parameters);
    /// an error for a model made for inference.
    pub fn grads(&self) -> Result<&Buffer> {
        Ok(&self.training()?.grads)
    }

    /// Bytes of every buffer the model holds (parameters, gradients,
    /// activations and their gradients, master weights, scratch).
    pub fn device_bytes(&self) -> usize {
        let own = [
            &self.params,
            &self.acts,
            &self.tokens,
            &self.targets,
            &self.loss,
        ]
        .into_iter()
        .chain(&self.master)
        .chain(&self.classifier_weight)
        .map(Buffer::len)
        .sum::<usize>()
            + self.att_scratch.len();
        let training = self.training.as_ref().map_or(0, |tr| {
            [&tr.grads, &tr.dacts, &tr.links, &tr.ln_scratch]
                .into_iter()
                .chain(&tr.classifier_grad)
                .map(Buffer::len)
                .sum::<usize>()
                + tr.att_ds.as_ref().map_or(0, View::len)
        });
        own + training
    }

    /// The activation buffer ([`ActivationLayout::stored`], or for a model
    /// made for inference [`ActivationLayout::inference`]).
    pub fn activations(&self) -> &Buffer {
        &self.acts
    }

    /// The activation-gradient buffer ([`ActivationLayout::gradients`]); an
    /// error for a model made for inference.
    pub fn activation_grads(&self) -> Result<&Buffer> {
        Ok(&self.training()?.dacts)
    }

    /// `(1)` the mean loss of the last forward pass with targets.
    pub fn loss_view(&self) -> View {
        self.loss.whole()
    }

    /// `(B, T, Vp)` logits ([`Gpt2Config::padded_vocab`]; the first `V`
    /// columns of each row used), of [`dtype`](Self::dtype) elements.
    pub fn logits_view(&self) -> &View {
        &self.a.logits
    }

    /// `(B, T, Vp)` probabilities, as [`logits_view`](Self::logits_view)
    /// (empty with the fused classifier, [`Fusion::classifier`]).
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
        let c = self.cfg.channels;
        let wte = self.layout.wte();
        let mut specs = Vec::with_capacity(self.layout.tensors.len() + self.wte_pieces.len());
        for t in &self.layout.tensors {
            if t.offset == wte.start && !self.wte_pieces.is_empty() {
                specs.extend(self.wte_pieces.iter().map(|(rows, _)| {
                    ParamSpec::new(
                        format!("{}[rows {}..{}]", t.name, rows.start, rows.end),
                        wte.start + rows.start * c..wte.start + rows.end * c,
                    )
                }));
            } else {
                specs.push(ParamSpec::new(t.name.clone(), t.range()));
            }
        }
        specs
    }

    /// Element ranges that partition the parameters: the token embedding, the
    /// position embedding, each block, the final layer norm.
    pub fn param_groups(&self) -> &[std::ops::Range<usize>] {
        &self.groups
    }

    /// Copies `params` (layout order) into the parameter buffer; with
    /// another storage type, into the `f32` master weights (unless the
    /// model was made for inference), and rounded into the parameter
    /// buffer. In chunks of [`UPLOAD_CHUNK`] elements, each a task waited
    /// for before the next is made, so that loading holds one chunk's copy
    /// beside `params` and the model's buffers (an upload task keeps a copy
    /// of its data until it runs): it returns once the copies are done.
    pub fn upload_params(&self, rt: &Runtime, params: &[f32]) -> Result<()> {
        if params.len() != self.layout.total {
            return Err(Gpt2Error::LengthMismatch {
                what: "params".into(),
                expected: self.layout.total,
                found: params.len(),
            });
        }
        match &self.master {
            Some(master) => upload_chunks(rt, &master.whole(), params, Dtype::F32)?,
            // An inference model keeps none: the stored ones only.
            None if self.dtype != Dtype::F32 && self.training.is_some() => {
                return Err(Gpt2Error::InvalidSetting {
                    what: "master weights",
                    reason: "released to a sharded optimizer: parameters cannot be uploaded".into(),
                })
            }
            None => {}
        }
        self.upload_stored(rt, &self.params, params)
    }

    /// The parameters, after every task submitted so far that writes them:
    /// the `f32` master weights when the model has them (a model made for
    /// inference keeps none: its stored parameters as `f32`). An error once
    /// they were released to a sharded optimizer
    /// ([`release_master`](Self::release_master)).
    pub fn read_params(&self, rt: &Runtime) -> Result<Vec<f32>> {
        match &self.master {
            Some(master) => Ok(rt.read_vec(master)?),
            None if self.dtype == Dtype::F32 => Ok(rt.read_vec(&self.params)?),
            None if self.training.is_none() => self.read_stored_params(rt),
            None => Err(Gpt2Error::InvalidSetting {
                what: "master weights",
                reason: "released to a sharded optimizer: gather them from it \
                         (AdamW::gather_master)"
                    .into(),
            }),
        }
    }

    /// Drops the model's `f32` master weights (mixed precision), once a
    /// ZeRO-1 optimizer keeps its own shard of them
    /// ([`AdamW::owns_master`](crate::optim::AdamW::owns_master)): their
    /// memory is freed when the tasks using them are done. Later
    /// [`read_params`](Self::read_params) and
    /// [`upload_params`](Self::upload_params) calls fail.
    pub fn release_master(&mut self) {
        self.master = None;
    }

    /// The parameters as stored (the weights the forward pass reads), as
    /// `f32`: [`read_params`](Self::read_params) rounded to the storage type.
    pub fn read_stored_params(&self, rt: &Runtime) -> Result<Vec<f32>> {
        self.read_stored(rt, &self.params.whole())
    }

    /// The parameter gradients (as `f32`).
    pub fn read_grads(&self, rt: &Runtime) -> Result<Vec<f32>> {
        self.read_stored(rt, &self.training()?.grads.whole())
    }

    /// The `(B, T, V)` logits of the last forward pass (as `f32`).
    pub fn read_logits(&self, rt: &Runtime) -> Result<Vec<f32>> {
        Ok(self.unpad(self.read_stored(rt, &self.a.logits)?))
    }

    /// Row `row` (position `b·T + t`) of the logits, `(V)`, as `f32`.
    pub fn read_logits_row(&self, rt: &Runtime, row: usize) -> Result<Vec<f32>> {
        let rows = self.b * self.t;
        if row >= rows {
            return Err(Gpt2Error::InvalidSetting {
                what: "logits row",
                reason: format!(
                    "row {row} is not in 0..{rows} (B·T = {} × {})",
                    self.b, self.t
                ),
            });
        }
        let es = self.dtype.size();
        let start = row * self.vp * es;
        let view = self
            .a
            .logits
            .view(start..start + self.cfg.vocab_size * es)?;
        self.read_stored(rt, &view)
    }

    /// The `(B, T, V)` probabilities of the last forward pass (as `f32`;
    /// empty with the fused classifier, [`Fusion::classifier`]).
    pub fn read_probs(&self, rt: &Runtime) -> Result<Vec<f32>> {
        Ok(self.unpad(self.read_stored(rt, &self.a.probs)?))
    }

    /// The first `V` columns of each `Vp` row of `padded`.
    fn unpad(&self, padded: Vec<f32>) -> Vec<f32> {
        let (v, vp) = (self.cfg.vocab_size, self.vp);
        if v == vp {
            return padded;
        }
        padded
            .chunks_exact(vp)
            .flat_map(|r| &r[..v])
            .copied()
            .collect()
    }

    /// Reads a view of storage-type elements as `f32`.
    fn read_stored(&self, rt: &Runtime, view: &View) -> Result<Vec<f32>> {
        Ok(match self.dtype {
            Dtype::F32 => rt.read_vec(view)?,
            Dtype::Bf16 => {
                let h: Vec<Bf16> = rt.read_vec(view)?;
                h.iter().map(|x| x.to_f32()).collect()
            }
        })
    }

    /// Uploads `data` into `buf`, rounded to the storage type, in chunks
    /// ([`upload_params`](Self::upload_params)).
    fn upload_stored(&self, rt: &Runtime, buf: &Buffer, data: &[f32]) -> Result<()> {
        upload_chunks(rt, &buf.whole(), data, self.dtype)
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

    /// Submits the forward pass on `tokens` `(B, T)`; with `targets` `(B, T)`
    /// also the per-position losses and their mean (read it with
    /// [`read_loss`](Self::read_loss)). Ids are checked against the vocabulary
    /// first; nothing is submitted if one is out of range.
    pub fn forward(&mut self, rt: &Runtime, tokens: &[u32], targets: Option<&[u32]>) -> Result<()> {
        self.upload_batch(rt, tokens, targets)?;
        self.forward_uploaded(rt)
    }

    /// Checks and uploads a batch (`forward`'s first half): `tokens` `(B, T)`
    /// and, for a pass with a loss, `targets` `(B, T)`.
    pub fn upload_batch(
        &mut self,
        rt: &Runtime,
        tokens: &[u32],
        targets: Option<&[u32]>,
    ) -> Result<()> {
        self.check_ids("tokens", tokens)?;
        if let Some(targets) = targets {
            self.check_ids("targets", targets)?;
        }
        rt.upload(&self.tokens, tokens)?;
        if let Some(targets) = targets {
            rt.upload(&self.targets, targets)?;
        }
        self.has_targets = targets.is_some();
        Ok(())
    }

    /// Copies a batch that is already in buffers of the runtime into the
    /// model's token buffers ([`upload_batch`](Self::upload_batch) from
    /// views): `tokens` and `targets`, `(B, T)` `u32` each, whose ids the
    /// caller has checked ([`check_ids`](crate::data::check_ids)). The
    /// copies are tasks, so a recorded step replays on whatever the views
    /// hold then: a training step of several micro-batches (gradient
    /// accumulation) uploads them all before its tasks and copies each in
    /// before its forward pass.
    pub fn copy_batch(&mut self, rt: &Runtime, tokens: &View, targets: &View) -> Result<()> {
        let bt = self.b * self.t;
        for (what, v) in [("tokens", tokens), ("targets", targets)] {
            if v.len() != bt * 4 {
                return Err(Gpt2Error::LengthMismatch {
                    what: format!("{what} view (bytes / 4)"),
                    expected: bt,
                    found: v.len() / 4,
                });
            }
        }
        let task = |name: &'static str| rt.task(name).priority(Priority::Side);
        fill::copy(task("copy tokens"), tokens, &self.tokens.whole())?;
        fill::copy(task("copy targets"), targets, &self.targets.whole())?;
        self.has_targets = true;
        Ok(())
    }

    /// Submits the forward pass on the batch last uploaded (`forward`'s
    /// second half): the tasks read the batch from the model's token
    /// buffers, so a recorded step replays on whatever batch was uploaded
    /// before the replay.
    pub fn forward_uploaded(&self, rt: &Runtime) -> Result<()> {
        self.forward_pass(rt, true)
    }

    /// The forward pass of a training step, to be followed by
    /// [`backward`](Self::backward): [`forward_uploaded`](Self::forward_uploaded)
    /// without the losses when the model uses the fused classifier
    /// ([`Fusion::classifier`]). The fused classifier of the backward
    /// pass writes the losses and their mean in the same pass over the
    /// `(B, T, V)` logits as their gradient (llm.c's scheme), so the logits
    /// are read once per step instead of twice; [`read_loss`](Self::read_loss)
    /// is then the step's loss once `backward` has run. Unfused, it is
    /// `forward_uploaded` (the loss comes from the probabilities the
    /// backward pass reads).
    pub fn forward_for_backward(&self, rt: &Runtime) -> Result<()> {
        self.forward_pass(rt, !self.fusion.classifier)
    }

    /// Submits tasks that zero the parameter gradients, one per
    /// [`param_group`](Self::param_groups).
    pub fn zero_grad(&self, rt: &Runtime) -> Result<()> {
        let grads = &self.training()?.grads;
        for (i, r) in self.groups.iter().enumerate() {
            let task = rt.task(format!("zero grads {i}")).priority(Priority::Side);
            fill::zero(task, &elems(grads, r.clone(), self.dtype)?)?;
        }
        Ok(())
    }
}

/// Elements per upload task of [`Gpt2Model::upload_params`] (16 MiB of
/// `f32`).
pub const UPLOAD_CHUNK: usize = 1 << 22;

/// Uploads `data` into `view` (of `dtype` elements, `data.len()` of them),
/// rounded to `dtype`, [`UPLOAD_CHUNK`] elements a task, each waited for.
fn upload_chunks(rt: &Runtime, view: &View, data: &[f32], dtype: Dtype) -> Result<()> {
    let es = dtype.size();
    let mut rounded = Vec::new();
    for (i, chunk) in data.chunks(UPLOAD_CHUNK).enumerate() {
        let at = i * UPLOAD_CHUNK * es;
        let part = view.view(at..at + chunk.len() * es)?;
        let task = match dtype {
            Dtype::F32 => rt.upload(&part, chunk)?,
            Dtype::Bf16 => {
                rounded.resize(chunk.len(), Bf16::default());
                convert(&mut rounded, chunk);
                rt.upload(&part, &rounded)?
            }
        };
        task.wait()?;
    }
    Ok(())
}

/// Bytes of device scratch the attention tasks use: the larger of what the
/// GPU attention kernels need forward (`4·B·T·C` elements of the storage
/// type: the heads of `q`, `k`, `v` permuted, and `att · v`) and backward
/// (`6·B·T·C + 2·B·NH·T·T` elements),
/// as [`attention::forward_scratch_bytes`] and
/// [`attention::backward_scratch_bytes`] document them. The forward task declares (`write`)
/// the forward size from the start of the buffer, the backward task the
/// backward size, exactly what the launchers take. The CPU kernels use none
/// of it; the task graph declares it on every backend so that the graph is
/// the same everywhere. One buffer serves every layer: the attention tasks
/// are in one chain anyway.
pub fn attention_scratch_bytes(b: usize, t: usize, c: usize, nh: usize, dtype: Dtype) -> usize {
    attention::forward_scratch_bytes(b, t, c, nh, dtype)
        .max(attention::backward_scratch_bytes(b, t, c, nh, dtype))
}

/// GPT-2's initialisation (as in nanoGPT and llm.c): weights `N(0, 0.02)`, the
/// two residual projections of each block `N(0, 0.02 / sqrt(2L))`, biases 0,
/// layer-norm gains 1. Deterministic in `seed`.
///
/// # Panics
///
/// When `cfg` is invalid ([`Gpt2Config::validate`]) or the host cannot hold
/// the parameters ([`try_init_params`] says so with an error instead).
pub fn init_params(cfg: &Gpt2Config, seed: u64) -> Vec<f32> {
    try_init_params(cfg, seed).unwrap_or_else(|e| panic!("{e}"))
}

/// [`init_params`], with an error when `cfg` is invalid (the
/// [`ConfigError`](crate::config::ConfigError) of
/// [`Gpt2Config::validate`]) or the host's memory cannot hold the
/// parameters (instead of the allocator's abort).
pub fn try_init_params(cfg: &Gpt2Config, seed: u64) -> crate::error::Result<Vec<f32>> {
    cfg.validate()?;
    // Counted and reserved before the layout is made: a model of absurdly
    // many layers (a typo in a config file) would otherwise abort in the
    // layout's own allocations, before this could refuse it.
    let total = cfg.checked_num_parameters().unwrap_or(usize::MAX);
    let mut params = Vec::new();
    params
        .try_reserve_exact(total)
        .map_err(|_| crate::error::Gpt2Error::InvalidSetting {
            what: "model size",
            reason: format!(
                "out of host memory: {} bytes for the {total} parameters of {cfg}",
                total.saturating_mul(4),
            ),
        })?;
    let layout = ParamLayout::new(cfg);
    debug_assert_eq!(layout.total, total);
    params.resize(layout.total, 0.0f32);
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
    Ok(params)
}

/// The seeded generator of initialisation and sampling ([`crate::rng`]).
pub use crate::rng::Rng;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ConfigError;

    #[test]
    fn an_invalid_config_is_an_error_not_a_panic() {
        let cfg = Gpt2Config {
            num_heads: 3,
            ..Gpt2Config::tiny()
        };
        let err = try_init_params(&cfg, 1).unwrap_err();
        assert!(
            matches!(
                err,
                Gpt2Error::Config(ConfigError::HeadsDoNotDivide {
                    channels: 64,
                    num_heads: 3
                })
            ),
            "{err:?}"
        );
        let zero = Gpt2Config {
            num_layers: 0,
            ..Gpt2Config::tiny()
        };
        assert!(matches!(
            try_init_params(&zero, 1),
            Err(Gpt2Error::Config(ConfigError::Zero {
                field: "num_layers"
            }))
        ));
        let tiny = Gpt2Config::tiny();
        assert_eq!(
            try_init_params(&tiny, 1).unwrap().len(),
            tiny.num_parameters()
        );
    }

    /// A batch shape whose buffers are past any address, and a logits row
    /// outside the batch, are errors (they once overflowed, or read another
    /// buffer's bytes as logits).
    #[test]
    fn shapes_and_rows_out_of_range_are_errors() {
        let cfg = Gpt2Config::tiny();
        let rt =
            crate::trainer::model_runtime(braid::BackendKind::Cpu, 1, braid::Policy::Single, 0)
                .unwrap();
        let e = Gpt2Model::new(&rt, &cfg, usize::MAX / 8, 64).unwrap_err();
        assert!(e.to_string().contains("more bytes than any address"), "{e}");
        let mut m = Gpt2Model::new(&rt, &cfg, 2, 8).unwrap();
        m.upload_params(&rt, &init_params(&cfg, 1)).unwrap();
        m.forward(&rt, &[1; 16], None).unwrap();
        assert_eq!(m.read_logits_row(&rt, 15).unwrap().len(), cfg.vocab_size);
        for row in [16, usize::MAX / 2] {
            let e = m.read_logits_row(&rt, row).unwrap_err().to_string();
            assert!(e.contains(&format!("row {row} is not in 0..16")), "{e}");
        }
    }

    /// A model made for inference computes, bit for bit, the logits and
    /// losses of a training model (the same kernels on the same inputs,
    /// its blocks sharing one slot), unfused and fused, in f32 and bf16,
    /// at batch sizes 1 (which keeps the KV cache) and 3; it holds less
    /// than the training model less its gradients; and every gradient
    /// method says what it lacks.
    #[test]
    fn an_inference_model_computes_what_a_training_model_does() {
        let cfg = Gpt2Config::tiny();
        let params = init_params(&cfg, 7);
        let rt =
            crate::trainer::model_runtime(braid::BackendKind::Cpu, 2, braid::Policy::Affinity, 0)
                .unwrap();
        let t = 9;
        for dtype in [Dtype::F32, Dtype::Bf16] {
            for fusion in [Fusion::NONE, Fusion::ALL] {
                for b in [1, 3] {
                    let ids = |k: usize| -> Vec<u32> {
                        (0..b * t)
                            .map(|i| ((i * 31 + k) % cfg.vocab_size) as u32)
                            .collect()
                    };
                    let (x, y) = (ids(5), ids(11));
                    let run = |inference| {
                        let opts = ModelOptions {
                            dtype,
                            fusion,
                            inference,
                            ..ModelOptions::default()
                        };
                        let mut m = Gpt2Model::with_options(&rt, &cfg, b, t, opts).unwrap();
                        assert_eq!(m.options(), opts);
                        m.upload_params(&rt, &params).unwrap();
                        m.forward(&rt, &x, Some(&y)).unwrap();
                        let out = (
                            m.read_logits(&rt).unwrap(),
                            m.read_losses(&rt).unwrap(),
                            m.read_loss(&rt).unwrap().to_bits(),
                            m.read_stored_params(&rt).unwrap(),
                        );
                        (m, out)
                    };
                    let what = format!("{dtype}, {fusion}, B {b}");
                    let (training, trained) = run(false);
                    let (mut inference, inferred) = run(true);
                    assert!(trained == inferred, "{what}: results differ");
                    let grads = training.grads().unwrap().len();
                    assert!(
                        inference.device_bytes() < training.device_bytes() - grads,
                        "{what}: {} vs {} bytes",
                        inference.device_bytes(),
                        training.device_bytes()
                    );
                    // An inference model's parameters are its stored ones.
                    assert_eq!(inference.read_params(&rt).unwrap(), inferred.3, "{what}");
                    let errors = [
                        inference.grads().map(|_| ()),
                        inference.activation_grads().map(|_| ()),
                        inference.read_grads(&rt).map(|_| ()),
                        inference.zero_grad(&rt),
                        inference.tied_rows().map(|_| ()),
                        inference.set_split_tied(true),
                        inference.backward(&rt, 1.0, |_| Ok(())),
                    ];
                    for e in errors {
                        let e = e.unwrap_err().to_string();
                        assert!(e.contains("made for inference"), "{what}: {e}");
                    }
                }
            }
        }
        rt.synchronize().unwrap();
    }

    /// Parameters of more than one upload chunk (`small`: 7.3M) arrive
    /// whole, in f32 (bit for bit, master weights too) and bf16 (rounded).
    #[test]
    fn parameters_are_uploaded_whole_in_chunks() {
        let cfg = Gpt2Config::small();
        let params = init_params(&cfg, 3);
        assert!(params.len() > UPLOAD_CHUNK);
        let rt = Runtime::cpu().unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for (dtype, inference) in [
            (Dtype::F32, true),
            (Dtype::Bf16, true),
            (Dtype::Bf16, false),
        ] {
            let opts = ModelOptions {
                dtype,
                inference,
                ..ModelOptions::default()
            };
            let m = Gpt2Model::with_options(&rt, &cfg, 1, 4, opts).unwrap();
            m.upload_params(&rt, &params).unwrap();
            let mut rounded = vec![Bf16::default(); params.len()];
            convert(&mut rounded, &params);
            let want: Vec<f32> = match dtype {
                Dtype::F32 => params.clone(),
                Dtype::Bf16 => rounded.iter().map(|x| x.to_f32()).collect(),
            };
            let stored = m.read_stored_params(&rt).unwrap();
            assert!(
                bits(&stored) == bits(&want),
                "{dtype}, inference {inference}"
            );
            if !inference || dtype == Dtype::F32 {
                let master = m.read_params(&rt).unwrap();
                assert!(bits(&master) == bits(&params), "{dtype} master weights");
            }
        }
    }

    /// The inference layout: every block's activations in one slot but
    /// each block's `qkv` when kept, and far less than the stored layout.
    #[test]
    fn the_inference_layout_shares_one_block_slot() {
        let cfg = Gpt2Config::tiny();
        let (b, t) = (2, 16);
        let stored = ActivationLayout::stored(&cfg, b, t, Fusion::NONE, false, Dtype::F32);
        for keep_qkv in [false, true] {
            let shared =
                ActivationLayout::inference(&cfg, b, t, Fusion::NONE, Dtype::F32, keep_qkv);
            let first = &shared.layers[0];
            for (l, la) in shared.layers.iter().enumerate() {
                let same_qkv = la.qkv == first.qkv;
                assert_eq!(same_qkv, !keep_qkv || l == 0, "layer {l}");
                let without_qkv = |x: &LayerActivations| LayerActivations {
                    qkv: Span { offset: 0, len: 0 },
                    ..*x
                };
                assert_eq!(without_qkv(la), without_qkv(first), "layer {l}");
                assert_eq!(la.qkv.len, b * t * 3 * cfg.channels);
            }
            let block = stored.layers[1].ln1.offset - stored.layers[0].ln1.offset;
            let qkv = (cfg.num_layers - 1) * b * t * 3 * cfg.channels;
            let expected =
                stored.total - (cfg.num_layers - 1) * block + if keep_qkv { qkv } else { 0 };
            assert_eq!(shared.total, expected, "keep_qkv {keep_qkv}");
        }
    }
}

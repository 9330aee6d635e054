//! A plain sequential GPT-2: forward, backward and nothing else, built only
//! from the kernels in [`crate::kernels::cpu`], called one after another in
//! llm.c's order. The engine version submits the same kernels as tasks and is
//! compared against this; this is compared against PyTorch
//! (`tests/reference_pytorch.rs`).
//!
//! # Activation layout
//!
//! All activations of a forward pass live in one `f32` allocation, laid out by
//! [`ActivationLayout`]: the embedding output, then each layer's activations
//! contiguously, then the final layer norm, logits, probabilities and losses.
//! Every tensor is a [`Span`] of that allocation, so tasks can declare exactly
//! the views they read and write. Activation gradients use a second allocation
//! with the layout of [`ActivationLayout::gradients`]: the same tensors, except
//! that those without a gradient (layer-norm statistics, attention scores and
//! probabilities, softmax probabilities, losses) are empty spans.
//!
//! ```text
//! encoded            (B, T, C)      wte[tokens] + wpe
//! per layer l:
//!   ln1              (B, T, C)      layernorm(residual_in)
//!   ln1_mean         (B, T)
//!   ln1_rstd         (B, T)
//!   qkv              (B, T, 3C)     ln1 · qkvwᵀ + qkvb
//!   atty             (B, T, C)      attention output
//!   preatt           (B, NH, T, T)  scaled scores
//!   att              (B, NH, T, T)  softmax of the scores
//!   attproj          (B, T, C)      atty · attprojwᵀ + attprojb
//!   residual2        (B, T, C)      residual_in + attproj
//!   ln2              (B, T, C)      layernorm(residual2)
//!   ln2_mean         (B, T)
//!   ln2_rstd         (B, T)
//!   fch              (B, T, 4C)     ln2 · fcwᵀ + fcb
//!   fch_gelu         (B, T, 4C)     gelu(fch)
//!   fcproj           (B, T, C)      fch_gelu · fcprojwᵀ + fcprojb
//!   residual3        (B, T, C)      residual2 + fcproj: the layer's output
//! lnf                (B, T, C)      layernorm(residual3 of the last layer)
//! lnf_mean           (B, T)
//! lnf_rstd           (B, T)
//! logits             (B, T, V)      lnf · wteᵀ
//! probs              (B, T, V)      softmax(logits)
//! losses             (B, T)         -ln probs[target]
//! ```
//!
//! `residual_in` of layer 0 is `encoded`; of layer `l > 0`, layer `l-1`'s
//! `residual3`.
//!
//! The reference's rows of `logits` and `probs` are `V` long. The model's
//! ([`ActivationLayout::stored`]) are `Vp` long
//! ([`Gpt2Config::padded_vocab`]), the first `V` columns used: the same
//! tensors in wider rows.

use thiserror::Error;

use crate::config::{ConfigError, Gpt2Config};
use crate::kernels::cpu as k;
use crate::kernels::storage::Dtype;
use crate::kernels::TokenError;
use crate::layout::{ParamLayout, Span};

/// The activations of one transformer block (see the module docs), each as a
/// `T`: where it lies in the activation buffer ([`Span`], what
/// [`ActivationLayout`] holds), or a view of that buffer (the model's);
/// [`map`](Self::map) turns one into another.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LayerActivations<T = Span> {
    /// `(B, T, C)`
    pub ln1: T,
    /// `(B, T)`
    pub ln1_mean: T,
    /// `(B, T)`
    pub ln1_rstd: T,
    /// `(B, T, 3C)`
    pub qkv: T,
    /// `(B, T, C)`
    pub atty: T,
    /// `(B, NH, T, T)`
    pub preatt: T,
    /// `(B, NH, T, T)`
    pub att: T,
    /// `(B, T, C)`
    pub attproj: T,
    /// `(B, T, C)`
    pub residual2: T,
    /// `(B, T, C)`
    pub ln2: T,
    /// `(B, T)`
    pub ln2_mean: T,
    /// `(B, T)`
    pub ln2_rstd: T,
    /// `(B, T, 4C)`
    pub fch: T,
    /// `(B, T, 4C)`
    pub fch_gelu: T,
    /// `(B, T, C)`
    pub fcproj: T,
    /// `(B, T, C)`
    pub residual3: T,
}

impl<T> LayerActivations<T> {
    /// `f` of each activation, or its first error.
    pub fn try_map<U, E>(
        &self,
        mut f: impl FnMut(&T) -> Result<U, E>,
    ) -> Result<LayerActivations<U>, E> {
        Ok(LayerActivations {
            ln1: f(&self.ln1)?,
            ln1_mean: f(&self.ln1_mean)?,
            ln1_rstd: f(&self.ln1_rstd)?,
            qkv: f(&self.qkv)?,
            atty: f(&self.atty)?,
            preatt: f(&self.preatt)?,
            att: f(&self.att)?,
            attproj: f(&self.attproj)?,
            residual2: f(&self.residual2)?,
            ln2: f(&self.ln2)?,
            ln2_mean: f(&self.ln2_mean)?,
            ln2_rstd: f(&self.ln2_rstd)?,
            fch: f(&self.fch)?,
            fch_gelu: f(&self.fch_gelu)?,
            fcproj: f(&self.fcproj)?,
            residual3: f(&self.residual3)?,
        })
    }

    /// `f` of each activation.
    pub fn map<U>(&self, mut f: impl FnMut(&T) -> U) -> LayerActivations<U> {
        let never = self.try_map(|x| Ok::<U, std::convert::Infallible>(f(x)));
        match never {
            Ok(m) => m,
            Err(e) => match e {},
        }
    }
}

impl LayerActivations {
    /// The whole block, contiguous (from `ln1` to `residual3`).
    pub fn all(&self) -> Span {
        Span {
            offset: self.ln1.offset,
            len: self.residual3.end() - self.ln1.offset,
        }
    }

    /// In a gradient ring ([`ActivationLayout::stored_gradients`]): the
    /// block's ring slot, every gradient but the residual stream's (from
    /// `ln1` to `fcproj`, contiguous), shared with the blocks `ring` apart.
    pub fn ring_slot(&self) -> Span {
        Span {
            offset: self.ln1.offset,
            len: self.fcproj.end() - self.ln1.offset,
        }
    }

    /// In a gradient ring: the block's own `residual2` and `residual3`
    /// gradients, contiguous.
    pub fn residual_pair(&self) -> Span {
        Span {
            offset: self.residual2.offset,
            len: self.residual3.end() - self.residual2.offset,
        }
    }
}

/// Slots of the fused layout's GELU ring ([`ActivationLayout::fused`]): block
/// `l`'s `fch_gelu` lies in slot `l % GELU_RING`, and the backward pass
/// recomputes it from `fch` where a later block has overwritten it.
pub const GELU_RING: usize = 2;

/// Which fused kernels a model uses ([`ModelOptions::fusion`](crate::model::ModelOptions::fusion)),
/// each independent of the others; each changes which activations the
/// model keeps ([`ActivationLayout::stored`]) and which tasks it submits.
/// All agree with the unfused path to float tolerance, not bit for bit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Fusion {
    /// [`flash_attention`](crate::kernels::flash_attention): tiles, online
    /// softmax, probabilities recomputed in the backward pass; `att` holds
    /// a `(B, NH, T)` logsumexp per layer, and there is no `preatt`.
    pub attention: bool,
    /// [`fused_classifier`](crate::kernels::fused_classifier): no
    /// `(B, T, Vp)` probabilities; the backward pass writes the logits'
    /// gradient over the logits (no logits gradient buffer either), so
    /// read the logits before submitting it.
    pub classifier: bool,
    /// The residual sums fused with the layer norms after them
    /// ([`layernorm::forward_residual`](crate::kernels::layernorm::forward_residual),
    /// [`layernorm::backward_residual`](crate::kernels::layernorm::backward_residual)):
    /// no projection-output gradients, two tasks fewer per block each way.
    pub residual_layernorm: bool,
    /// The GELU outputs in a ring of [`GELU_RING`] slots instead of one
    /// `(B, T, 4C)` buffer per block, recomputed in the backward pass for
    /// the blocks whose slot was overwritten (llm.c's `recompute`).
    pub gelu_recompute: bool,
}

impl Fusion {
    /// No fused kernel (the default).
    pub const NONE: Fusion = Fusion {
        attention: false,
        classifier: false,
        residual_layernorm: false,
        gelu_recompute: false,
    };

    /// Every fused kernel (`braid-gpt2 train --fused`).
    pub const ALL: Fusion = Fusion {
        attention: true,
        classifier: true,
        residual_layernorm: true,
        gelu_recompute: true,
    };

    /// The names [`parse`](Self::parse) takes, in field order.
    pub const NAMES: [&'static str; 4] = [
        "attention",
        "classifier",
        "residual-layernorm",
        "gelu-recompute",
    ];

    /// Whether any fused kernel is on.
    pub fn any(&self) -> bool {
        *self != Fusion::NONE
    }

    /// A comma-separated list of [`NAMES`](Self::NAMES), `all` or `none`
    /// (`--fuse classifier,residual-layernorm`).
    pub fn parse(list: &str) -> Result<Fusion, String> {
        if list.trim().is_empty() {
            return Err(format!(
                "an empty list of fused kernels: give all, none or a list of {}",
                Fusion::NAMES.join(", ")
            ));
        }
        let mut f = Fusion::NONE;
        for name in list.split(',').map(str::trim).filter(|n| !n.is_empty()) {
            match name {
                "all" => f = Fusion::ALL,
                "none" => {}
                "attention" => f.attention = true,
                "classifier" => f.classifier = true,
                "residual-layernorm" => f.residual_layernorm = true,
                "gelu-recompute" => f.gelu_recompute = true,
                other => {
                    return Err(format!(
                        "unknown fused kernel `{other}`: expected all, none or a list of {}",
                        Fusion::NAMES.join(", ")
                    ))
                }
            }
        }
        Ok(f)
    }
}

impl std::fmt::Display for Fusion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let on = [
            self.attention,
            self.classifier,
            self.residual_layernorm,
            self.gelu_recompute,
        ];
        let names: Vec<&str> = Fusion::NAMES
            .iter()
            .zip(on)
            .filter_map(|(n, on)| on.then_some(*n))
            .collect();
        match names.len() {
            0 => f.write_str("none"),
            4 => f.write_str("all"),
            _ => f.write_str(&names.join(",")),
        }
    }
}

/// Where every activation of a `(B, T)` forward pass lies in one allocation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ActivationLayout {
    /// Batch size `B`.
    pub b: usize,
    /// Sequence length `T`.
    pub t: usize,
    /// `(B, T, C)`
    pub encoded: Span,
    /// One entry per layer.
    pub layers: Vec<LayerActivations>,
    /// `(B, T, C)`
    pub lnf: Span,
    /// `(B, T)`
    pub lnf_mean: Span,
    /// `(B, T)`
    pub lnf_rstd: Span,
    /// `(B, T, Vp)`: rows of [`vp`](Self::vp), the first `V` columns used.
    pub logits: Span,
    /// `(B, T, Vp)`, as `logits`.
    pub probs: Span,
    /// `(B, T)`
    pub losses: Span,
    /// Total elements.
    pub total: usize,
    /// The row length of `logits` and `probs`: `V` in the reference's
    /// layouts, [`Gpt2Config::padded_vocab`] in the model's
    /// ([`stored`](Self::stored), [`stored_gradients`](Self::stored_gradients)).
    pub vp: usize,
    /// Gradient ring slots ([`stored_gradients`](Self::stored_gradients)), or
    /// 0: every block its own contiguous span.
    pub ring: usize,
}

impl ActivationLayout {
    /// The forward activations of `cfg` for batches of `b` sequences of `t` tokens.
    pub fn new(cfg: &Gpt2Config, b: usize, t: usize) -> Self {
        Self::build(cfg, b, t, false, Fusion::NONE, 0, None, None)
    }

    /// The layout of a model that stores its activations as `dtype`
    /// ([`Gpt2Model`](crate::model::Gpt2Model)) with the fused kernels
    /// `fusion` ([`new`](Self::new) or [`gradients`](Self::gradients) by
    /// `gradients` with none, [`fused`](Self::fused) or
    /// [`fused_gradients`](Self::fused_gradients) with all), with spans
    /// counted in `dtype` elements. The statistics
    /// kept in `f32` whatever the storage (`*_mean`, `*_rstd`, `losses`, and
    /// with flash attention the logsumexp in `att`) then span `4 / dtype.size()`
    /// elements per value and start at a multiple of that, so that the byte
    /// range `span · dtype.size()` holds them as `f32`. Rows of `logits` and
    /// `probs` are [`Gpt2Config::padded_vocab`] long. And unfused, every
    /// layer's `preatt` is the same span, after `encoded`: the scores are
    /// an intermediate of the attention forward task (it writes them and
    /// reads them back for the softmax), and the backward pass reads only
    /// `att` (`attention::backward`), so one `(B, NH, T, T)` serves all
    /// layers, each layer's forward overwriting the one before (at GPT-2
    /// 124M, B 8 × T 1024: 11 × 201 MB fewer in bf16). It holds the last
    /// layer's scores after a forward pass.
    pub fn stored(
        cfg: &Gpt2Config,
        b: usize,
        t: usize,
        fusion: Fusion,
        gradients: bool,
        dtype: Dtype,
    ) -> Self {
        Self::build(cfg, b, t, gradients, fusion, 0, Some(dtype), None)
    }

    /// The activation gradients of [`stored`](Self::stored) (`gradients`
    /// true) in a ring of `ring` block slots (clamped to `1..=L`): block
    /// `l`'s gradients other than the residual stream's lie in slot
    /// `l % ring`, so the backward pass, which needs them only while it is in
    /// block `l`, reuses `ring` slots instead of keeping `L` blocks. The
    /// residual stream's gradients (`residual2`, `residual3`: written by one
    /// block, read by the next) stay one pair per block, after the slots.
    /// Each slot is contiguous ([`LayerActivations::ring_slot`]), and so is
    /// each block's pair ([`LayerActivations::residual_pair`]). Whoever
    /// accumulates into a slot must zero it between blocks
    /// ([`Gpt2Model::backward`](crate::model::Gpt2Model::backward) does, as a
    /// task the engine orders after the previous block's last reader of the
    /// slot).
    pub fn stored_gradients(
        cfg: &Gpt2Config,
        b: usize,
        t: usize,
        fusion: Fusion,
        dtype: Dtype,
        ring: usize,
    ) -> Self {
        let ring = ring.clamp(1, cfg.num_layers.max(1));
        Self::build(cfg, b, t, true, fusion, ring, Some(dtype), None)
    }

    /// The activations of a model for forward passes only
    /// ([`ModelOptions::inference`](crate::model::ModelOptions::inference)),
    /// as [`stored`](Self::stored) without gradients, except that every
    /// block's activations lie in the same span, one block slot after
    /// `encoded`, each block overwriting the one before: nothing reads a
    /// block's activations after the next block ran but the backward pass.
    /// The slot holds the residual stream too (block `l` reads the slot's
    /// `residual3`, block `l - 1`'s, before it writes its own), and the
    /// unfused `preatt` and the GELU outputs (no ring). With `keep_qkv`,
    /// each block keeps its own `qkv` after the slot, as the KV cache of
    /// [`Gpt2Model::forward_position`](crate::model::Gpt2Model::forward_position);
    /// without it `qkv` is in the slot too.
    pub fn inference(
        cfg: &Gpt2Config,
        b: usize,
        t: usize,
        fusion: Fusion,
        dtype: Dtype,
        keep_qkv: bool,
    ) -> Self {
        Self::build(cfg, b, t, false, fusion, 0, Some(dtype), Some(keep_qkv))
    }

    /// The forward activations of the fused kernels
    /// ([`flash_attention`](crate::kernels::flash_attention),
    /// [`fused_classifier`](crate::kernels::fused_classifier)): as
    /// [`new`](Self::new), except that each layer's `preatt` is empty and its
    /// `att` holds the attention's per-row logsumexp, `(B, NH, T)`, `probs`
    /// is empty, and the GELU outputs `fch_gelu` (`(B, T, 4C)`, the largest
    /// activation after attention's) share a ring of [`GELU_RING`] slots
    /// after `encoded`: the fused model recomputes a block's from its `fch`
    /// in the backward pass (llm.c's `recompute`), except for the last
    /// `GELU_RING` blocks, whose slots still hold them.
    pub fn fused(cfg: &Gpt2Config, b: usize, t: usize) -> Self {
        Self::build(cfg, b, t, false, Fusion::ALL, 0, None, None)
    }

    /// The activation gradients of the fused kernels: as
    /// [`gradients`](Self::gradients), except that `logits` is empty too (the
    /// fused classifier writes the logits' gradient over the logits), and so
    /// are each layer's `attproj` and `fcproj`: the fused residual + layer
    /// norm passes the residual's gradient through, so a projection's output
    /// gradient is `residual2`'s or `residual3`'s
    /// ([`layernorm::backward_residual`](crate::kernels::layernorm::backward_residual)).
    pub fn fused_gradients(cfg: &Gpt2Config, b: usize, t: usize) -> Self {
        Self::build(cfg, b, t, true, Fusion::ALL, 0, None, None)
    }

    /// The activation gradients: same tensors, but those that get no gradient
    /// (`*_mean`, `*_rstd`, `preatt`, `att`, `probs`, `losses`) are empty.
    pub fn gradients(cfg: &Gpt2Config, b: usize, t: usize) -> Self {
        Self::build(cfg, b, t, true, Fusion::NONE, 0, None, None)
    }

    /// `ring`: gradient ring slots (`grads` only), or 0 for none; `model`:
    /// the model's layout of that storage type ([`stored`](Self::stored)),
    /// or `None` for the reference's; `shared`: every block in one slot,
    /// keeping its own `qkv` or not ([`inference`](Self::inference)).
    #[allow(clippy::too_many_arguments)]
    fn build(
        cfg: &Gpt2Config,
        b: usize,
        t: usize,
        grads: bool,
        fusion: Fusion,
        ring: usize,
        model: Option<Dtype>,
        shared: Option<bool>,
    ) -> Self {
        let flash = fusion.attention;
        let gelu_ring = fusion.gelu_recompute && !grads && shared.is_none();
        let (c, nh) = (cfg.channels, cfg.num_heads);
        let bt = b * t;
        // Elements per `f32` statistic (1, or 2 for bf16 storage), the row
        // length of `logits` and `probs`, and whether the layers share one
        // `preatt` (see `stored`).
        let (stat, vp, shared_preatt) = match model {
            None => (1, cfg.vocab_size, false),
            Some(dtype) => (4 / dtype.size(), cfg.padded_vocab(), !flash && !grads),
        };
        let mut offset = 0usize;
        // `is_stat`: an `f32` statistic, `stat` elements per value, aligned.
        let mut span = |len: usize, has_grad: bool, is_stat: bool| {
            let len = if grads && !has_grad { 0 } else { len };
            let len = if is_stat {
                offset = offset.next_multiple_of(stat);
                len * stat
            } else {
                len
            };
            let s = Span { offset, len };
            offset += len;
            s
        };
        // One block; `residuals`: whether its residual stream has spans
        // here (a ring slot's do not).
        let block =
            |span: &mut dyn FnMut(usize, bool, bool) -> Span, residuals: bool| LayerActivations {
                ln1: span(bt * c, true, false),
                ln1_mean: span(bt, false, true),
                ln1_rstd: span(bt, false, true),
                qkv: span(bt * 3 * c, true, false),
                atty: span(bt * c, true, false),
                preatt: span(
                    if flash || shared_preatt {
                        0
                    } else {
                        b * nh * t * t
                    },
                    false,
                    false,
                ),
                att: span(b * nh * t * if flash { 1 } else { t }, false, flash),
                // Fused, the projections' gradients are the residual's.
                attproj: span(bt * c, !fusion.residual_layernorm, false),
                residual2: span(if residuals { bt * c } else { 0 }, true, false),
                ln2: span(bt * c, true, false),
                ln2_mean: span(bt, false, true),
                ln2_rstd: span(bt, false, true),
                fch: span(bt * 4 * c, true, false),
                // Fused forward: in the GELU ring instead (below).
                fch_gelu: span(if gelu_ring { 0 } else { bt * 4 * c }, true, false),
                fcproj: span(bt * c, !fusion.residual_layernorm, false),
                residual3: span(if residuals { bt * c } else { 0 }, true, false),
            };
        let encoded = span(bt * c, true, false);
        let preatt = span(if shared_preatt { b * nh * t * t } else { 0 }, false, false);
        let layers: Vec<LayerActivations> = if let Some(keep_qkv) = shared {
            let mut slot = block(&mut span, true);
            if shared_preatt {
                slot.preatt = preatt;
            }
            // Block 0 keeps the slot's own `qkv`.
            (0..cfg.num_layers)
                .map(|l| LayerActivations {
                    qkv: if keep_qkv && l > 0 {
                        span(bt * 3 * c, true, false)
                    } else {
                        slot.qkv
                    },
                    ..slot
                })
                .collect()
        } else if grads && ring > 0 {
            let slots: Vec<LayerActivations> = (0..ring).map(|_| block(&mut span, false)).collect();
            let pairs: Vec<(Span, Span)> = (0..cfg.num_layers)
                .map(|_| (span(bt * c, true, false), span(bt * c, true, false)))
                .collect();
            pairs
                .into_iter()
                .enumerate()
                .map(|(l, (residual2, residual3))| LayerActivations {
                    residual2,
                    residual3,
                    ..slots[l % ring]
                })
                .collect()
        } else {
            // The GELU ring's slots (none without it), then the blocks.
            let gelu: Vec<Span> = (0..if gelu_ring { GELU_RING } else { 0 })
                .map(|_| span(bt * 4 * c, true, false))
                .collect();
            (0..cfg.num_layers)
                .map(|l| {
                    let mut la = block(&mut span, true);
                    if shared_preatt {
                        la.preatt = preatt;
                    }
                    if gelu_ring {
                        la.fch_gelu = gelu[l % GELU_RING];
                    }
                    la
                })
                .collect()
        };
        let lnf = span(bt * c, true, false);
        let lnf_mean = span(bt, false, true);
        let lnf_rstd = span(bt, false, true);
        let logits = span(bt * vp, !fusion.classifier, false);
        let probs = span(if fusion.classifier { 0 } else { bt * vp }, false, false);
        let losses = span(bt, false, true);
        Self {
            b,
            t,
            encoded,
            layers,
            lnf,
            lnf_mean,
            lnf_rstd,
            logits,
            probs,
            losses,
            total: offset,
            vp,
            ring,
        }
    }

    /// The input of layer `l`'s residual stream: `encoded` for layer 0, else
    /// layer `l-1`'s `residual3`.
    pub fn residual_in(&self, l: usize) -> Span {
        if l == 0 {
            self.encoded
        } else {
            self.layers[l - 1].residual3
        }
    }

    /// The output of the last layer (the input of the final layer norm).
    pub fn residual_out(&self) -> Span {
        self.residual_in(self.layers.len())
    }
}

/// Why the reference model refused an input.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ReferenceError {
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// An input token or target is outside the vocabulary.
    #[error("{what}: {error}")]
    Token {
        /// `tokens` or `targets`.
        what: &'static str,
        /// The first bad id (in the message, so not also the `source()`).
        error: TokenError,
    },
    /// `T` is zero or longer than the model's `max_seq_len`.
    #[error("sequence length {t} is not in 1..={max_seq_len}")]
    SeqLen {
        /// Requested `T`.
        t: usize,
        /// The model's `maxT`.
        max_seq_len: usize,
    },
    /// The batch size is zero.
    #[error("batch size must be nonzero")]
    ZeroBatch,
    /// A buffer has the wrong number of elements.
    #[error("{what}: expected {expected} elements, got {got}")]
    Length {
        /// Which buffer.
        what: &'static str,
        /// Elements expected.
        expected: usize,
        /// Elements supplied.
        got: usize,
    },
    /// `backward` was called without a preceding `forward` with targets.
    #[error("backward needs a forward pass with targets first")]
    NoLoss,
}

/// The sequential model with its activation buffers, for a fixed `(B, T)`.
#[derive(Debug, Clone)]
pub struct Reference {
    cfg: Gpt2Config,
    params: ParamLayout,
    acts_layout: ActivationLayout,
    grads_layout: ActivationLayout,
    acts: Vec<f32>,      // ActivationLayout::new
    grad_acts: Vec<f32>, // ActivationLayout::gradients
    tokens: Vec<u32>,    // (B, T) of the last forward
    targets: Vec<u32>,   // (B, T) of the last forward, empty without targets
    loss: Option<f32>,
}

/// Mutable, pairwise-disjoint sub-slices of `buf`, in the order of `spans`.
/// Panics if two spans overlap (a bug in the layout).
fn split_spans<const N: usize>(buf: &mut [f32], spans: [Span; N]) -> [&mut [f32]; N] {
    let mut order: [usize; N] = std::array::from_fn(|i| i);
    order.sort_by_key(|&i| spans[i].offset);
    let mut out: [Option<&mut [f32]>; N] = std::array::from_fn(|_| None);
    let mut rest = buf;
    let mut base = 0;
    for &i in &order {
        let s = spans[i];
        assert!(s.offset >= base, "split_spans: overlapping spans");
        let (_, tail) = std::mem::take(&mut rest).split_at_mut(s.offset - base);
        let (mine, tail) = tail.split_at_mut(s.len);
        out[i] = Some(mine);
        rest = tail;
        base = s.end();
    }
    out.map(|o| o.expect("every span was assigned"))
}

impl Reference {
    /// A model of configuration `cfg` for batches of `b` sequences of `t` tokens.
    pub fn new(cfg: &Gpt2Config, b: usize, t: usize) -> Result<Self, ReferenceError> {
        cfg.validate()?;
        if t == 0 || t > cfg.max_seq_len {
            return Err(ReferenceError::SeqLen {
                t,
                max_seq_len: cfg.max_seq_len,
            });
        }
        if b == 0 {
            return Err(ReferenceError::ZeroBatch);
        }
        let acts_layout = ActivationLayout::new(cfg, b, t);
        let grads_layout = ActivationLayout::gradients(cfg, b, t);
        Ok(Self {
            cfg: *cfg,
            params: ParamLayout::new(cfg),
            acts: vec![0.0; acts_layout.total],
            grad_acts: vec![0.0; grads_layout.total],
            acts_layout,
            grads_layout,
            tokens: Vec::new(),
            targets: Vec::new(),
            loss: None,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &Gpt2Config {
        &self.cfg
    }

    /// The parameter layout that `params` and `grads` follow.
    pub fn param_layout(&self) -> &ParamLayout {
        &self.params
    }

    /// The layout of [`activations`](Self::activations).
    pub fn activation_layout(&self) -> &ActivationLayout {
        &self.acts_layout
    }

    /// All forward activations of the last forward pass.
    pub fn activations(&self) -> &[f32] {
        &self.acts
    }

    /// `(B, T, V)` logits of the last forward pass.
    pub fn logits(&self) -> &[f32] {
        self.acts_layout.logits.of(&self.acts)
    }

    /// `(B, T, V)` softmax probabilities of the last forward pass.
    pub fn probs(&self) -> &[f32] {
        self.acts_layout.probs.of(&self.acts)
    }

    /// `(B, T)` per-position losses of the last forward pass with targets.
    pub fn losses(&self) -> &[f32] {
        self.acts_layout.losses.of(&self.acts)
    }

    /// The mean loss of the last forward pass, if it had targets.
    pub fn loss(&self) -> Option<f32> {
        self.loss
    }

    fn check_len(what: &'static str, got: usize, expected: usize) -> Result<(), ReferenceError> {
        if got == expected {
            Ok(())
        } else {
            Err(ReferenceError::Length {
                what,
                expected,
                got,
            })
        }
    }

    /// Runs the model on `tokens` `(B, T)`; with `targets` `(B, T)` also the
    /// loss, whose mean it returns.
    pub fn forward(
        &mut self,
        params: &[f32],          // (num_parameters) in ParamLayout order
        tokens: &[u32],          // (B, T)
        targets: Option<&[u32]>, // (B, T)
    ) -> Result<Option<f32>, ReferenceError> {
        let (b, t) = (self.acts_layout.b, self.acts_layout.t);
        let cfg = self.cfg;
        let (v, c, nh) = (cfg.vocab_size, cfg.channels, cfg.num_heads);
        Self::check_len("params", params.len(), self.params.total)?;
        Self::check_len("tokens", tokens.len(), b * t)?;
        k::check_tokens(tokens, v).map_err(|error| ReferenceError::Token {
            what: "tokens",
            error,
        })?;
        if let Some(targets) = targets {
            Self::check_len("targets", targets.len(), b * t)?;
            k::check_tokens(targets, v).map_err(|error| ReferenceError::Token {
                what: "targets",
                error,
            })?;
        }
        self.loss = None;
        self.tokens.clear();
        self.tokens.extend_from_slice(tokens);
        self.targets.clear();

        let p = &self.params;
        let a = &self.acts_layout;
        let acts = &mut self.acts[..];
        let w = |r: std::ops::Range<usize>| &params[r];
        let ws = |s: Span| s.of(params);

        let [encoded] = split_spans(acts, [a.encoded]);
        k::encoder_forward(encoded, tokens, w(p.wte()), w(p.wpe()), b, t, c);

        for (l, la) in a.layers.iter().enumerate() {
            let lp = p.layer(l);
            let [residual, ln1, ln1_mean, ln1_rstd] =
                split_spans(acts, [a.residual_in(l), la.ln1, la.ln1_mean, la.ln1_rstd]);
            k::layernorm_forward(
                ln1,
                ln1_mean,
                ln1_rstd,
                residual,
                ws(lp.ln1w),
                ws(lp.ln1b),
                b,
                t,
                c,
            );
            let [ln1, qkv] = split_spans(acts, [la.ln1, la.qkv]);
            k::matmul_forward(qkv, ln1, ws(lp.qkvw), Some(ws(lp.qkvb)), b, t, c, 3 * c);
            let [qkv, atty, preatt, att] = split_spans(acts, [la.qkv, la.atty, la.preatt, la.att]);
            k::attention_forward(atty, preatt, att, qkv, b, t, c, nh);
            let [atty, attproj] = split_spans(acts, [la.atty, la.attproj]);
            k::matmul_forward(
                attproj,
                atty,
                ws(lp.attprojw),
                Some(ws(lp.attprojb)),
                b,
                t,
                c,
                c,
            );
            let [residual, attproj, residual2] =
                split_spans(acts, [a.residual_in(l), la.attproj, la.residual2]);
            k::residual_forward(residual2, residual, attproj);
            let [residual2, ln2, ln2_mean, ln2_rstd] =
                split_spans(acts, [la.residual2, la.ln2, la.ln2_mean, la.ln2_rstd]);
            k::layernorm_forward(
                ln2,
                ln2_mean,
                ln2_rstd,
                residual2,
                ws(lp.ln2w),
                ws(lp.ln2b),
                b,
                t,
                c,
            );
            let [ln2, fch] = split_spans(acts, [la.ln2, la.fch]);
            k::matmul_forward(fch, ln2, ws(lp.fcw), Some(ws(lp.fcb)), b, t, c, 4 * c);
            let [fch, fch_gelu] = split_spans(acts, [la.fch, la.fch_gelu]);
            k::gelu_forward(fch_gelu, fch);
            let [fch_gelu, fcproj] = split_spans(acts, [la.fch_gelu, la.fcproj]);
            k::matmul_forward(
                fcproj,
                fch_gelu,
                ws(lp.fcprojw),
                Some(ws(lp.fcprojb)),
                b,
                t,
                4 * c,
                c,
            );
            let [residual2, fcproj, residual3] =
                split_spans(acts, [la.residual2, la.fcproj, la.residual3]);
            k::residual_forward(residual3, residual2, fcproj);
        }

        let [residual, lnf, lnf_mean, lnf_rstd] =
            split_spans(acts, [a.residual_out(), a.lnf, a.lnf_mean, a.lnf_rstd]);
        k::layernorm_forward(
            lnf,
            lnf_mean,
            lnf_rstd,
            residual,
            w(p.lnfw()),
            w(p.lnfb()),
            b,
            t,
            c,
        );
        let [lnf, logits] = split_spans(acts, [a.lnf, a.logits]);
        k::matmul_forward(logits, lnf, w(p.wte()), None, b, t, c, v);
        let [logits, probs] = split_spans(acts, [a.logits, a.probs]);
        k::softmax_forward(probs, logits, b, t, v, v);

        if let Some(targets) = targets {
            let [probs, losses] = split_spans(acts, [a.probs, a.losses]);
            k::crossentropy_forward(losses, probs, targets, b, t, v, v);
            let loss = k::mean_loss(losses);
            self.targets.extend_from_slice(targets);
            self.loss = Some(loss);
        }
        Ok(self.loss)
    }

    /// Backward pass of the last forward (which must have had targets):
    /// ACCUMULATES `dloss · ∂(mean loss)/∂params` into `grads` (same layout as
    /// the parameters). Zero `grads` first for a plain step; pass
    /// `dloss = 1 / n` to average `n` accumulated micro-batches.
    pub fn backward(
        &mut self,
        params: &[f32],    // (num_parameters) the same as in forward
        grads: &mut [f32], // (num_parameters) accumulated into
        dloss: f32,
    ) -> Result<(), ReferenceError> {
        if self.loss.is_none() {
            return Err(ReferenceError::NoLoss);
        }
        Self::check_len("params", params.len(), self.params.total)?;
        Self::check_len("grads", grads.len(), self.params.total)?;
        let (b, t) = (self.acts_layout.b, self.acts_layout.t);
        let cfg = self.cfg;
        let (v, c, nh) = (cfg.vocab_size, cfg.channels, cfg.num_heads);
        let p = &self.params;
        let a = &self.acts_layout;
        let g = &self.grads_layout;
        let acts = &self.acts[..];
        let dacts = &mut self.grad_acts[..];
        let tokens = &self.tokens[..];
        let targets = &self.targets[..];
        let w = |r: std::ops::Range<usize>| &params[r];
        let ws = |s: Span| s.of(params);
        let x = |s: Span| s.of(acts);

        // Activation gradients accumulate, so they start from zero.
        dacts.fill(0.0);

        let [dlogits] = split_spans(dacts, [g.logits]);
        k::crossentropy_softmax_backward(dlogits, x(a.probs), targets, dloss, b, t, v, v);
        let [dlogits, dlnf] = split_spans(dacts, [g.logits, g.lnf]);
        k::matmul_backward_input(dlnf, dlogits, w(p.wte()), b, t, c, v);
        k::matmul_backward_weight(&mut grads[p.wte()], None, dlogits, x(a.lnf), b, t, c, v);

        let lnf_params = p.lnfw().start..p.lnfb().end;
        let (dlnfw, dlnfb) = grads[lnf_params].split_at_mut(c);
        let [dlnf, dresidual] = split_spans(dacts, [g.lnf, g.residual_out()]);
        k::layernorm_backward(
            dresidual,
            dlnfw,
            dlnfb,
            dlnf,
            x(a.residual_out()),
            w(p.lnfw()),
            x(a.lnf_mean),
            x(a.lnf_rstd),
            b,
            t,
            c,
        );

        for l in (0..cfg.num_layers).rev() {
            let (la, lg, lp) = (&a.layers[l], &g.layers[l], p.layer(l));
            let [dl1w, dl1b, dqkvw, dqkvb, dapw, dapb, dl2w, dl2b, dfcw, dfcb, dfpw, dfpb] =
                split_spans(
                    grads,
                    [
                        lp.ln1w,
                        lp.ln1b,
                        lp.qkvw,
                        lp.qkvb,
                        lp.attprojw,
                        lp.attprojb,
                        lp.ln2w,
                        lp.ln2b,
                        lp.fcw,
                        lp.fcb,
                        lp.fcprojw,
                        lp.fcprojb,
                    ],
                );

            // residual3 = residual2 + fcproj
            let [dresidual2, dfcproj, dresidual3] =
                split_spans(dacts, [lg.residual2, lg.fcproj, lg.residual3]);
            k::residual_backward(dresidual2, dfcproj, dresidual3);
            // fcproj = fch_gelu · fcprojwᵀ + fcprojb
            let [dfch_gelu, dfcproj] = split_spans(dacts, [lg.fch_gelu, lg.fcproj]);
            k::matmul_backward_input(dfch_gelu, dfcproj, ws(lp.fcprojw), b, t, 4 * c, c);
            k::matmul_backward_weight(dfpw, Some(dfpb), dfcproj, x(la.fch_gelu), b, t, 4 * c, c);
            // fch_gelu = gelu(fch)
            let [dfch, dfch_gelu] = split_spans(dacts, [lg.fch, lg.fch_gelu]);
            k::gelu_backward(dfch, x(la.fch), dfch_gelu);
            // fch = ln2 · fcwᵀ + fcb
            let [dln2, dfch] = split_spans(dacts, [lg.ln2, lg.fch]);
            k::matmul_backward_input(dln2, dfch, ws(lp.fcw), b, t, c, 4 * c);
            k::matmul_backward_weight(dfcw, Some(dfcb), dfch, x(la.ln2), b, t, c, 4 * c);
            // ln2 = layernorm(residual2)
            let [dresidual2, dln2] = split_spans(dacts, [lg.residual2, lg.ln2]);
            k::layernorm_backward(
                dresidual2,
                dl2w,
                dl2b,
                dln2,
                x(la.residual2),
                ws(lp.ln2w),
                x(la.ln2_mean),
                x(la.ln2_rstd),
                b,
                t,
                c,
            );
            // residual2 = residual_in + attproj
            let [dresidual, dattproj, dresidual2] =
                split_spans(dacts, [g.residual_in(l), lg.attproj, lg.residual2]);
            k::residual_backward(dresidual, dattproj, dresidual2);
            // attproj = atty · attprojwᵀ + attprojb
            let [datty, dattproj] = split_spans(dacts, [lg.atty, lg.attproj]);
            k::matmul_backward_input(datty, dattproj, ws(lp.attprojw), b, t, c, c);
            k::matmul_backward_weight(dapw, Some(dapb), dattproj, x(la.atty), b, t, c, c);
            // atty = attention(qkv)
            let [dqkv, datty] = split_spans(dacts, [lg.qkv, lg.atty]);
            k::attention_backward(dqkv, datty, x(la.qkv), x(la.att), b, t, c, nh);
            // qkv = ln1 · qkvwᵀ + qkvb
            let [dln1, dqkv] = split_spans(dacts, [lg.ln1, lg.qkv]);
            k::matmul_backward_input(dln1, dqkv, ws(lp.qkvw), b, t, c, 3 * c);
            k::matmul_backward_weight(dqkvw, Some(dqkvb), dqkv, x(la.ln1), b, t, c, 3 * c);
            // ln1 = layernorm(residual_in)
            let [dresidual, dln1] = split_spans(dacts, [g.residual_in(l), lg.ln1]);
            k::layernorm_backward(
                dresidual,
                dl1w,
                dl1b,
                dln1,
                x(a.residual_in(l)),
                ws(lp.ln1w),
                x(la.ln1_mean),
                x(la.ln1_rstd),
                b,
                t,
                c,
            );
        }

        // encoded = wte[tokens] + wpe
        let embeddings = p.wte().start..p.wpe().end;
        let (dwte, dwpe) = grads[embeddings].split_at_mut(p.wte().len());
        k::encoder_backward(dwte, dwpe, g.encoded.of(dacts), tokens, b, t, c);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn activation_layouts_are_contiguous_and_gradients_skip_statistics() {
        let cfg = Gpt2Config::tiny();
        let (b, t) = (2, 8);
        let a = ActivationLayout::new(&cfg, b, t);
        let g = ActivationLayout::gradients(&cfg, b, t);
        let c = cfg.channels;
        assert_eq!(a.encoded.offset, 0);
        assert_eq!(a.layers[0].ln1.offset, a.encoded.end());
        assert_eq!(a.layers[1].ln1.offset, a.layers[0].residual3.end());
        assert_eq!(a.losses.end(), a.total);
        assert_eq!(a.layers[1].att.len, b * cfg.num_heads * t * t);
        assert_eq!(g.layers[1].att.len, 0);
        assert_eq!(g.probs.len, 0);
        assert_eq!(g.layers[0].qkv.len, b * t * 3 * c);
        assert_eq!(a.residual_in(1), a.layers[0].residual3);
        assert!(g.total < a.total);
    }

    #[test]
    fn bad_inputs_are_errors_not_panics() {
        let cfg = Gpt2Config::tiny();
        let mut m = Reference::new(&cfg, 1, 4).unwrap();
        let params = vec![0.01; cfg.num_parameters()];
        let mut grads = vec![0.0; cfg.num_parameters()];
        assert_eq!(
            m.backward(&params, &mut grads, 1.0),
            Err(ReferenceError::NoLoss)
        );
        let err = m.forward(&params, &[1, 2, 512, 3], None).unwrap_err();
        assert!(
            matches!(err, ReferenceError::Token { what: "tokens", .. }),
            "{err}"
        );
        let err = m
            .forward(&params, &[1, 2, 3, 4], Some(&[0, 0, 0, 9999]))
            .unwrap_err();
        assert!(
            matches!(
                err,
                ReferenceError::Token {
                    what: "targets",
                    ..
                }
            ),
            "{err}"
        );
        let err = m.forward(&params, &[1, 2, 3], None).unwrap_err();
        assert!(matches!(err, ReferenceError::Length { what: "tokens", .. }));
        assert!(matches!(
            Reference::new(&cfg, 1, 65),
            Err(ReferenceError::SeqLen { t: 65, .. })
        ));
        assert_eq!(m.forward(&params, &[1, 2, 3, 4], None), Ok(None));
        assert_eq!(m.logits().len(), 4 * cfg.vocab_size);
    }

    /// Perturbs one parameter of each kind and compares the change in loss
    /// with the gradient (a whole-model finite-difference check).
    #[test]
    fn model_gradient_matches_finite_differences() {
        let cfg = Gpt2Config {
            max_seq_len: 8,
            vocab_size: 16,
            num_layers: 2,
            num_heads: 2,
            channels: 8,
        };
        let (b, t) = (2, 4);
        let lay = ParamLayout::new(&cfg);
        let mut params = crate::kernels::testutil::randn(lay.total, 0.3, 50);
        for name in ["ln_1.weight", "ln_2.weight"] {
            for l in 0..cfg.num_layers {
                let r = lay
                    .get(&format!("transformer.h.{l}.{name}"))
                    .unwrap()
                    .range();
                params[r].iter_mut().for_each(|x| *x += 1.0);
            }
        }
        params[lay.lnfw()].iter_mut().for_each(|x| *x += 1.0);
        let tokens = [1u32, 5, 9, 2, 15, 0, 7, 7];
        let targets = [5u32, 9, 2, 3, 0, 7, 7, 1];
        let mut m = Reference::new(&cfg, b, t).unwrap();
        m.forward(&params, &tokens, Some(&targets)).unwrap();
        let mut grads = vec![0.0; lay.total];
        m.backward(&params, &mut grads, 1.0).unwrap();
        let mut max_err = 0.0f64;
        for tensor in &lay.tensors {
            // a few elements of each tensor
            for j in [0, tensor.len / 2, tensor.len - 1] {
                let i = tensor.offset + j;
                let eps = 1e-2f32;
                let mut pp = params.clone();
                pp[i] += eps;
                let lp = m.forward(&pp, &tokens, Some(&targets)).unwrap().unwrap() as f64;
                pp[i] -= 2.0 * eps;
                let lm = m.forward(&pp, &tokens, Some(&targets)).unwrap().unwrap() as f64;
                let numeric = (lp - lm) / (2.0 * eps as f64);
                let err = (numeric - grads[i] as f64).abs();
                max_err = max_err.max(err);
                assert!(
                    err <= 1e-3 + 5e-2 * numeric.abs(),
                    "{}[{j}]: analytic {}, numeric {numeric}",
                    tensor.name,
                    grads[i]
                );
            }
        }
        assert!(max_err < 1e-2);
    }
}

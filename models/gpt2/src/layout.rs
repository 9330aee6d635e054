//! The flat parameter layout: one `f32` allocation holds every parameter, and
//! the gradients use the same layout in a second allocation (llm.c's scheme).
//!
//! The order is per-layer contiguous, so a data-parallel gradient bucket is a
//! contiguous view and becomes ready layer by layer during the backward pass:
//!
//! ```text
//! wte (V, C)  wpe (maxT, C)
//! for each layer l:
//!     ln1w (C)  ln1b (C)  qkvw (3C, C)  qkvb (3C)  attprojw (C, C)  attprojb (C)
//!     ln2w (C)  ln2b (C)  fcw (4C, C)   fcb (4C)   fcprojw (C, 4C)  fcprojb (C)
//! lnfw (C)  lnfb (C)
//! ```
//!
//! Matrices are stored `(out, in)` row-major, as in llm.c, so a linear layer
//! computes `out = inp · Wᵀ + b`. Hugging Face's `GPT2LMHeadModel` stores its
//! `Conv1D` weights (`c_attn`, `c_proj`, `c_fc`, `mlp.c_proj`) as `(in, out)`:
//! those tensors have [`ParamTensor::hf_transposed`] set, and
//! [`ParamTensor::copy_from_hf`] / [`ParamTensor::copy_to_hf`] transpose them.
//! The classifier is tied to `wte` (`lm_head.weight` is `transformer.wte.weight`).

use std::ops::Range;

use thiserror::Error;

use crate::config::Gpt2Config;

/// A contiguous run of elements in a flat buffer: `offset .. offset + len`.
///
/// `Copy`, unlike `Range<usize>`, so layouts of spans are `Copy` too.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Span {
    /// First element.
    pub offset: usize,
    /// Number of elements.
    pub len: usize,
}

impl Span {
    /// The span as a range of element indices.
    pub const fn range(self) -> Range<usize> {
        self.offset..self.offset + self.len
    }

    /// One past the last element.
    pub const fn end(self) -> usize {
        self.offset + self.len
    }

    /// The span's elements of `buf`.
    pub fn of<T>(self, buf: &[T]) -> &[T] {
        &buf[self.range()]
    }

    /// The span's elements of `buf`, mutably.
    pub fn of_mut<T>(self, buf: &mut [T]) -> &mut [T] {
        &mut buf[self.range()]
    }
}

impl From<Span> for Range<usize> {
    fn from(s: Span) -> Self {
        s.range()
    }
}

/// One named parameter tensor inside the flat buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamTensor {
    /// The Hugging Face `GPT2LMHeadModel` name, e.g. `transformer.h.3.attn.c_attn.weight`.
    pub name: String,
    /// Shape in this layout (matrices `(out, in)`).
    pub shape: Vec<usize>,
    /// First element in the flat buffer.
    pub offset: usize,
    /// Number of elements (the product of `shape`).
    pub len: usize,
    /// Whether Hugging Face stores it transposed, `(in, out)` (its `Conv1D` weights).
    pub hf_transposed: bool,
}

/// A tensor given to a Hugging Face conversion has the wrong number of elements.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum LayoutError {
    /// The source or destination slice has the wrong length.
    #[error("tensor `{name}`: expected {expected} elements, got {got}")]
    LengthMismatch {
        /// The tensor's Hugging Face name.
        name: String,
        /// Elements the layout expects.
        expected: usize,
        /// Elements supplied.
        got: usize,
    },
}

impl ParamTensor {
    /// The tensor's elements as a range of the flat buffer.
    pub fn range(&self) -> Range<usize> {
        self.offset..self.offset + self.len
    }

    /// The tensor's position as a [`Span`].
    pub fn span(&self) -> Span {
        Span {
            offset: self.offset,
            len: self.len,
        }
    }

    /// The shape Hugging Face stores: `shape` reversed for `Conv1D` weights.
    pub fn hf_shape(&self) -> Vec<usize> {
        if self.hf_transposed {
            self.shape.iter().rev().copied().collect()
        } else {
            self.shape.clone()
        }
    }

    /// Copies a tensor stored the Hugging Face way (`hf`, row-major in
    /// [`hf_shape`](Self::hf_shape)) into its place in the flat buffer `flat`,
    /// transposing `Conv1D` weights.
    pub fn copy_from_hf(&self, hf: &[f32], flat: &mut [f32]) -> Result<(), LayoutError> {
        self.check_len(hf.len())?;
        let dst = &mut flat[self.range()];
        if self.hf_transposed {
            // ours (out, in) <- hf (in, out)
            let (out_dim, in_dim) = (self.shape[0], self.shape[1]);
            for o in 0..out_dim {
                for i in 0..in_dim {
                    dst[o * in_dim + i] = hf[i * out_dim + o];
                }
            }
        } else {
            dst.copy_from_slice(hf);
        }
        Ok(())
    }

    /// Copies the tensor out of the flat buffer `flat` into `hf`, in the
    /// Hugging Face storage order (the inverse of [`copy_from_hf`](Self::copy_from_hf)).
    pub fn copy_to_hf(&self, flat: &[f32], hf: &mut [f32]) -> Result<(), LayoutError> {
        self.check_len(hf.len())?;
        let src = &flat[self.range()];
        if self.hf_transposed {
            let (out_dim, in_dim) = (self.shape[0], self.shape[1]);
            for o in 0..out_dim {
                for i in 0..in_dim {
                    hf[i * out_dim + o] = src[o * in_dim + i];
                }
            }
        } else {
            hf.copy_from_slice(src);
        }
        Ok(())
    }

    fn check_len(&self, got: usize) -> Result<(), LayoutError> {
        if got == self.len {
            Ok(())
        } else {
            Err(LayoutError::LengthMismatch {
                name: self.name.clone(),
                expected: self.len,
                got,
            })
        }
    }
}

/// The twelve tensors of one transformer block, each as a `T`: where it lies
/// in the flat buffer ([`Span`], what [`ParamLayout::layer`] gives), a view
/// of the parameter or gradient buffer (the model's), an index into
/// [`ParamLayout::tensors`], …; [`map`](Self::map) turns one into another.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LayerParams<T = Span> {
    /// `(C)` first layer norm weight.
    pub ln1w: T,
    /// `(C)` first layer norm bias.
    pub ln1b: T,
    /// `(3C, C)` query/key/value projection weight.
    pub qkvw: T,
    /// `(3C)` query/key/value projection bias.
    pub qkvb: T,
    /// `(C, C)` attention output projection weight.
    pub attprojw: T,
    /// `(C)` attention output projection bias.
    pub attprojb: T,
    /// `(C)` second layer norm weight.
    pub ln2w: T,
    /// `(C)` second layer norm bias.
    pub ln2b: T,
    /// `(4C, C)` MLP up projection weight.
    pub fcw: T,
    /// `(4C)` MLP up projection bias.
    pub fcb: T,
    /// `(C, 4C)` MLP down projection weight.
    pub fcprojw: T,
    /// `(C)` MLP down projection bias.
    pub fcprojb: T,
}

impl<T> LayerParams<T> {
    /// `f` of each tensor, or its first error.
    pub fn try_map<U, E>(
        &self,
        mut f: impl FnMut(&T) -> Result<U, E>,
    ) -> Result<LayerParams<U>, E> {
        Ok(LayerParams {
            ln1w: f(&self.ln1w)?,
            ln1b: f(&self.ln1b)?,
            qkvw: f(&self.qkvw)?,
            qkvb: f(&self.qkvb)?,
            attprojw: f(&self.attprojw)?,
            attprojb: f(&self.attprojb)?,
            ln2w: f(&self.ln2w)?,
            ln2b: f(&self.ln2b)?,
            fcw: f(&self.fcw)?,
            fcb: f(&self.fcb)?,
            fcprojw: f(&self.fcprojw)?,
            fcprojb: f(&self.fcprojb)?,
        })
    }

    /// `f` of each tensor.
    pub fn map<U>(&self, mut f: impl FnMut(&T) -> U) -> LayerParams<U> {
        let never = self.try_map(|x| Ok::<U, std::convert::Infallible>(f(x)));
        match never {
            Ok(m) => m,
            Err(e) => match e {},
        }
    }
}

/// The positions of all parameter tensors in the flat buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamLayout {
    /// Every tensor, in layout order.
    pub tensors: Vec<ParamTensor>,
    /// Total number of elements (= [`Gpt2Config::num_parameters`]).
    pub total: usize,
    cfg: Gpt2Config,
    wte: Span,
    wpe: Span,
    layers: Vec<LayerParams>,
    lnfw: Span,
    lnfb: Span,
}

struct Builder {
    tensors: Vec<ParamTensor>,
    offset: usize,
}

impl Builder {
    fn push(&mut self, name: String, shape: &[usize], hf_transposed: bool) -> Span {
        let len = shape.iter().product();
        let span = Span {
            offset: self.offset,
            len,
        };
        self.tensors.push(ParamTensor {
            name,
            shape: shape.to_vec(),
            offset: self.offset,
            len,
            hf_transposed,
        });
        self.offset += len;
        span
    }
}

impl ParamLayout {
    /// Lays out the parameters of `cfg`.
    ///
    /// Panics if `cfg` is invalid; call [`Gpt2Config::validate`] first on
    /// untrusted configurations.
    pub fn new(cfg: &Gpt2Config) -> Self {
        if let Err(e) = cfg.validate() {
            panic!("ParamLayout::new: {e}");
        }
        let (v, c, maxt) = (cfg.vocab_size, cfg.channels, cfg.max_seq_len);
        let mut b = Builder {
            tensors: Vec::with_capacity(4 + 12 * cfg.num_layers),
            offset: 0,
        };
        let wte = b.push("transformer.wte.weight".into(), &[v, c], false);
        let wpe = b.push("transformer.wpe.weight".into(), &[maxt, c], false);
        let layers = (0..cfg.num_layers)
            .map(|l| {
                let mut p = |suffix: &str, shape: &[usize], tr: bool| {
                    b.push(format!("transformer.h.{l}.{suffix}"), shape, tr)
                };
                LayerParams {
                    ln1w: p("ln_1.weight", &[c], false),
                    ln1b: p("ln_1.bias", &[c], false),
                    qkvw: p("attn.c_attn.weight", &[3 * c, c], true),
                    qkvb: p("attn.c_attn.bias", &[3 * c], false),
                    attprojw: p("attn.c_proj.weight", &[c, c], true),
                    attprojb: p("attn.c_proj.bias", &[c], false),
                    ln2w: p("ln_2.weight", &[c], false),
                    ln2b: p("ln_2.bias", &[c], false),
                    fcw: p("mlp.c_fc.weight", &[4 * c, c], true),
                    fcb: p("mlp.c_fc.bias", &[4 * c], false),
                    fcprojw: p("mlp.c_proj.weight", &[c, 4 * c], true),
                    fcprojb: p("mlp.c_proj.bias", &[c], false),
                }
            })
            .collect();
        let lnfw = b.push("transformer.ln_f.weight".into(), &[c], false);
        let lnfb = b.push("transformer.ln_f.bias".into(), &[c], false);
        debug_assert_eq!(b.offset, cfg.num_parameters());
        Self {
            tensors: b.tensors,
            total: b.offset,
            cfg: *cfg,
            wte,
            wpe,
            layers,
            lnfw,
            lnfb,
        }
    }

    /// The configuration this layout was made for.
    pub fn config(&self) -> &Gpt2Config {
        &self.cfg
    }

    /// The tensor with this Hugging Face name. `lm_head.weight` (tied) resolves
    /// to `transformer.wte.weight`.
    pub fn get(&self, name: &str) -> Option<&ParamTensor> {
        let name = if name == "lm_head.weight" {
            "transformer.wte.weight"
        } else {
            name
        };
        self.tensors.iter().find(|t| t.name == name)
    }

    /// Element positions of each tensor of layer `l`. Panics if `l >= L`.
    pub fn layer(&self, l: usize) -> LayerParams {
        self.layers[l]
    }

    /// The element ranges of the tensors of two or more dimensions (the
    /// embeddings and the linear layers' weights), in order, adjacent ones
    /// merged: what nanoGPT and llm.c decay
    /// ([`DecayOn::Matrices`](crate::optim::DecayOn)).
    pub fn matrix_ranges(&self) -> Vec<Range<usize>> {
        let mut out: Vec<Range<usize>> = Vec::new();
        for t in self.tensors.iter().filter(|t| t.shape.len() >= 2) {
            match out.last_mut() {
                Some(last) if last.end == t.offset => last.end = t.offset + t.len,
                _ => out.push(t.offset..t.offset + t.len),
            }
        }
        out
    }

    /// `(V, C)` token embedding, also the classifier weight.
    pub fn wte(&self) -> Range<usize> {
        self.wte.range()
    }

    /// `(maxT, C)` position embedding.
    pub fn wpe(&self) -> Range<usize> {
        self.wpe.range()
    }

    /// `(C)` final layer norm weight.
    pub fn lnfw(&self) -> Range<usize> {
        self.lnfw.range()
    }

    /// `(C)` final layer norm bias.
    pub fn lnfb(&self) -> Range<usize> {
        self.lnfb.range()
    }

    /// The whole of layer `l`, contiguous (from `ln1w` to `fcprojb`).
    pub fn layer_range(&self, l: usize) -> Range<usize> {
        let p = &self.layers[l];
        p.ln1w.offset..p.fcprojb.end()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiny_layout_is_contiguous_in_the_documented_order() {
        let cfg = Gpt2Config::tiny();
        let lay = ParamLayout::new(&cfg);
        assert_eq!(lay.total, cfg.num_parameters());
        assert_eq!(lay.tensors.len(), 4 + 12 * cfg.num_layers);
        let mut next = 0;
        for t in &lay.tensors {
            assert_eq!(t.offset, next, "{} is not contiguous", t.name);
            assert_eq!(t.len, t.shape.iter().product::<usize>());
            next += t.len;
        }
        assert_eq!(next, lay.total);
        let c = cfg.channels;
        assert_eq!(lay.wte(), 0..cfg.vocab_size * c);
        assert_eq!(lay.wpe().start, lay.wte().end);
        assert_eq!(lay.layer_range(0).start, lay.wpe().end);
        assert_eq!(lay.layer_range(0).end, lay.layer_range(1).start);
        assert_eq!(lay.layer_range(1).len(), Gpt2Config::layer_parameters(c));
        assert_eq!(lay.lnfw().start, lay.layer_range(1).end);
        assert_eq!(lay.lnfb().end, lay.total);
        let qkv = lay.get("transformer.h.1.attn.c_attn.weight").unwrap();
        assert_eq!(qkv.range(), lay.layer(1).qkvw.range());
        assert_eq!(qkv.shape, vec![3 * c, c]);
        assert_eq!(qkv.hf_shape(), vec![c, 3 * c]);
        assert!(qkv.hf_transposed);
        assert!(
            !lay.get("transformer.h.1.attn.c_attn.bias")
                .unwrap()
                .hf_transposed
        );
        assert_eq!(lay.get("lm_head.weight").unwrap().range(), lay.wte());
        assert!(lay.get("transformer.h.2.ln_1.weight").is_none());
    }

    /// llm.c's and nanoGPT's decayed tensors: the embeddings (merged) and
    /// each block's four linear weights, nothing of the biases or norms.
    #[test]
    fn the_matrices_are_the_embeddings_and_the_linear_weights() {
        let lay = ParamLayout::new(&Gpt2Config::tiny());
        let m = lay.matrix_ranges();
        let embeddings = lay.wte().start..lay.wpe().end;
        let mut want = vec![embeddings];
        for l in 0..2 {
            let p = lay.layer(l);
            want.extend([p.qkvw, p.attprojw, p.fcw, p.fcprojw].map(Span::range));
        }
        assert_eq!(m, want);
    }

    #[test]
    fn hf_conversion_transposes_conv1d_weights_and_round_trips() {
        let lay = ParamLayout::new(&Gpt2Config::tiny());
        let t = lay.get("transformer.h.0.mlp.c_proj.weight").unwrap();
        let (out_dim, in_dim) = (t.shape[0], t.shape[1]);
        let hf: Vec<f32> = (0..t.len).map(|i| i as f32).collect();
        let mut flat = vec![0.0; lay.total];
        t.copy_from_hf(&hf, &mut flat).unwrap();
        // hf[i][o] lands at ours[o][i]
        let (i, o) = (3, 5);
        assert_eq!(flat[t.offset + o * in_dim + i], hf[i * out_dim + o]);
        let mut back = vec![0.0; t.len];
        t.copy_to_hf(&flat, &mut back).unwrap();
        assert_eq!(back, hf);
        assert!(matches!(
            t.copy_from_hf(&hf[1..], &mut flat),
            Err(LayoutError::LengthMismatch { .. })
        ));
    }
}

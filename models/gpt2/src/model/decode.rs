//! Decoding one position at a time ([`Gpt2Model::forward_position`]): the
//! model's own activations are the KV cache.
//!
//! The packed `qkv` activation of a block, `(T, 3C)`, holds every earlier
//! position's keys and values already, so the forward pass of a new
//! position `p` is that of one row: the embedding of its token at position
//! `p`, then per block the layer norm, the products, the residuals and the
//! GELU of row `p` alone, and an attention of row `p`'s query over the keys
//! and values of rows `0..=p` ([`attention::decode`]). A sampler that adds
//! one token at a time pays one row's products per token instead of a whole
//! forward pass over its window.
//!
//! Every task but the attention is the forward pass's own kernel on row
//! views, so the row's activations and logits are what a forward pass over
//! the tokens `0..=p` computes for it, to float rounding: the attention's
//! arithmetic is the forward pass's own on the CPU, but a one-row product
//! takes another path of the matrix library (2e-7 apart in `f32` logits;
//! in bf16 a stored rounding can flip now and then), and CUDA's one-row
//! attention is a kernel of its own.

use std::ops::Range;

use braid::{Runtime, View};

use super::{Fusion, Gpt2Model, Tasks};
use crate::error::{Gpt2Error, Result};
use crate::kernels::{attention, encoder, gelu, layernorm, matmul, residual};

/// Rows `r` of `v`, an activation of `t` rows (one sequence).
fn rows(v: &View, t: usize, r: Range<usize>) -> Result<View> {
    let width = v.len() / t;
    Ok(v.view(r.start * width..r.end * width)?)
}

impl Gpt2Model {
    /// Submits the forward pass of position `pos` of the one sequence a
    /// model of batch size 1 holds, whose token there is `token`: the
    /// activations of row `pos` and its logits
    /// ([`read_logits_row`](Self::read_logits_row)`(pos)`), from the keys
    /// and values of rows `0..pos`, which an earlier
    /// [`forward`](Self::forward) or these calls computed for the tokens
    /// before it. Rows after `pos` are left as they are, and no probability
    /// or loss is computed.
    ///
    /// Refused for a batch size above 1, with fused kernels (a flash
    /// attention keeps no scores to continue; use [`Fusion::NONE`]), for a
    /// position outside the model's sequence length and for a token outside
    /// the vocabulary.
    pub fn forward_position(&mut self, rt: &Runtime, pos: usize, token: u32) -> Result<()> {
        let refuse = |reason: String| {
            Err(Gpt2Error::InvalidSetting {
                what: "decoding one position",
                reason,
            })
        };
        if self.b != 1 {
            return refuse(format!("the model's batch size is {}, not 1", self.b));
        }
        if self.fusion != Fusion::NONE {
            return refuse("the model has fused kernels; it needs Fusion::NONE".into());
        }
        if pos >= self.t {
            return refuse(format!(
                "position {pos} is past the model's sequence length {}",
                self.t
            ));
        }
        crate::data::check_ids(&[token], self.cfg.vocab_size, "token")?;
        let tasks = Tasks {
            rt,
            dtype: self.dtype,
        };
        let (t, c, nh) = (self.t, self.cfg.channels, self.cfg.num_heads);
        let (p, a) = (&self.p, &self.a);
        let row = |v: &View| rows(v, t, pos..pos + 1);
        let _decode = rt.scope("decode");
        let tokens = rows(&self.tokens.whole(), t, pos..pos + 1)?;
        rt.upload(&tokens, &[token])?;
        // SAFETY: the one token is checked against V above.
        unsafe {
            encoder::forward(
                tasks.task("encoder decode"),
                &row(&a.encoded)?,
                &tokens,
                &p.wte,
                &row(&p.wpe)?,
                1,
                1,
                c,
            )
        }?;
        for (l, (la, lp)) in a.layers.iter().zip(&p.layers).enumerate() {
            let task = |what: &str| tasks.task(format!("L{l} {what} decode"));
            let x = row(a.residual_in(l))?;
            let (ln1, qkv, atty, attproj) = (
                row(&la.ln1)?,
                row(&la.qkv)?,
                row(&la.atty)?,
                row(&la.attproj)?,
            );
            let (residual2, ln2, fch, fch_gelu, fcproj) = (
                row(&la.residual2)?,
                row(&la.ln2)?,
                row(&la.fch)?,
                row(&la.fch_gelu)?,
                row(&la.fcproj)?,
            );
            layernorm::forward(
                task("ln1"),
                &ln1,
                &row(&la.ln1_mean)?,
                &row(&la.ln1_rstd)?,
                &x,
                &lp.ln1w,
                &lp.ln1b,
                1,
                c,
            )?;
            matmul::forward(
                task("qkv"),
                &qkv,
                &ln1,
                &lp.qkvw,
                Some(&lp.qkvb),
                1,
                c,
                3 * c,
            )?;
            let cache = rows(&la.qkv, t, 0..pos + 1)?;
            attention::decode(task("attention"), &atty, &cache, pos + 1, c, nh)?;
            matmul::forward(
                task("attproj"),
                &attproj,
                &atty,
                &lp.attprojw,
                Some(&lp.attprojb),
                1,
                c,
                c,
            )?;
            residual::forward(task("residual2"), &residual2, &x, &attproj)?;
            layernorm::forward(
                task("ln2"),
                &ln2,
                &row(&la.ln2_mean)?,
                &row(&la.ln2_rstd)?,
                &residual2,
                &lp.ln2w,
                &lp.ln2b,
                1,
                c,
            )?;
            matmul::forward(task("fc"), &fch, &ln2, &lp.fcw, Some(&lp.fcb), 1, c, 4 * c)?;
            gelu::forward(task("gelu"), &fch_gelu, &fch)?;
            matmul::forward(
                task("fcproj"),
                &fcproj,
                &fch_gelu,
                &lp.fcprojw,
                Some(&lp.fcprojb),
                1,
                4 * c,
                c,
            )?;
            residual::forward(task("residual3"), &row(&la.residual3)?, &residual2, &fcproj)?;
        }
        let lnf = row(&a.lnf)?;
        layernorm::forward(
            tasks.task("lnf decode"),
            &lnf,
            &row(&a.lnf_mean)?,
            &row(&a.lnf_rstd)?,
            &row(a.residual_out())?,
            &p.lnfw,
            &p.lnfb,
            1,
            c,
        )?;
        let (w, oc) = self.classifier_weight();
        matmul::forward_ld(
            tasks.task("logits decode"),
            &row(&a.logits)?,
            &lnf,
            &w,
            None,
            1,
            c,
            oc,
            self.vp,
        )?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use braid::{BackendKind, Policy};

    use super::*;
    use crate::config::Gpt2Config;
    use crate::kernels::storage::Dtype;
    use crate::model::{init_params, ModelOptions, Sampler};
    use crate::trainer::model_runtime;

    fn runtime() -> Runtime {
        model_runtime(BackendKind::Cpu, 2, Policy::Affinity, 0).unwrap()
    }

    fn ids(n: usize, vocab: usize) -> Vec<u32> {
        (0..n).map(|i| ((i * 7919 + 13) % vocab) as u32).collect()
    }

    /// `row` within float rounding of `full` (measured: 2e-7 in f32, where
    /// a row's products take the matrix library's one-row path; 0 in bf16
    /// here, though a bf16 rounding can flip elsewhere).
    fn close(row: &[f32], full: &[f32], dtype: Dtype, p: usize) {
        let scale = full.iter().fold(1f32, |m, x| m.max(x.abs()));
        let d = row
            .iter()
            .zip(full)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(d <= 1e-5 * scale, "{dtype}: position {p} differs by {d}");
    }

    /// Each position decoded after a forward pass over a shorter prefix
    /// (whose padding rows it overwrites) has the logits a forward pass over
    /// the whole sequence gives that row, in f32 and bf16, in a training
    /// model and in one made for inference (whose blocks share one slot).
    #[test]
    fn a_decoded_position_has_the_full_forward_passs_logits() {
        let cfg = Gpt2Config::tiny();
        let rt = runtime();
        let t = 12;
        let tokens = ids(t, cfg.vocab_size);
        for (dtype, inference) in [Dtype::F32, Dtype::Bf16]
            .into_iter()
            .flat_map(|d| [(d, false), (d, true)])
        {
            let opts = ModelOptions {
                dtype,
                inference,
                ..ModelOptions::default()
            };
            let mut m = Gpt2Model::with_options(&rt, &cfg, 1, t, opts).unwrap();
            m.upload_params(&rt, &init_params(&cfg, 5)).unwrap();
            m.forward(&rt, &tokens, None).unwrap();
            let full: Vec<Vec<f32>> = (0..t).map(|p| m.read_logits_row(&rt, p).unwrap()).collect();
            let prefix = 4;
            let mut padded = tokens[..prefix].to_vec();
            padded.resize(t, 0);
            m.forward(&rt, &padded, None).unwrap();
            for (p, &token) in tokens.iter().enumerate().skip(prefix) {
                m.forward_position(&rt, p, token).unwrap();
                close(&m.read_logits_row(&rt, p).unwrap(), &full[p], dtype, p);
            }
            // From position 0, nothing computed before it.
            m.forward_position(&rt, 0, tokens[0]).unwrap();
            close(&m.read_logits_row(&rt, 0).unwrap(), &full[0], dtype, 0);
        }
    }

    /// The sampler draws the same tokens with and without the cache, also
    /// once its window is full and slides (every position moves: a forward
    /// pass again), and with it (the CPU's default) submits fewer tasks.
    #[test]
    fn the_sampler_draws_the_same_tokens_with_the_cache() {
        let cfg = Gpt2Config::tiny();
        let params = init_params(&cfg, 9);
        let draw = |cached: Option<bool>, temperature: f32| {
            let rt = runtime();
            let s = Sampler::new(&rt, &cfg, &params, 8, temperature, 3, Dtype::F32).unwrap();
            let mut s = match cached {
                Some(on) => s.with_kv_cache(on),
                None => s,
            };
            let before = rt.stats().tasks;
            let out = s.generate(&rt, &[1, 2, 3], 20, |_| Ok(())).unwrap();
            (out, rt.stats().tasks - before)
        };
        for temperature in [0.0, 1.0] {
            let (cached, cached_tasks) = draw(None, temperature);
            let (plain, plain_tasks) = draw(Some(false), temperature);
            assert_eq!(cached, plain);
            assert!(
                cached_tasks < plain_tasks,
                "{cached_tasks} vs {plain_tasks}"
            );
        }
    }

    /// `generate_until` stops after the token whose call breaks, returning
    /// the tokens so far (that one included): the start of what an
    /// uninterrupted run draws. An error from the callback is returned.
    #[test]
    fn generation_stops_when_the_callback_says_so() {
        let cfg = Gpt2Config::tiny();
        let params = init_params(&cfg, 9);
        let rt = runtime();
        let sampler = || Sampler::new(&rt, &cfg, &params, 16, 1.0, 5, Dtype::F32).unwrap();
        let all = sampler().generate(&rt, &[1, 2], 10, |_| Ok(())).unwrap();
        let mut seen = Vec::new();
        let cut = sampler()
            .generate_until(&rt, &[1, 2], 10, |t| {
                seen.push(t);
                Ok(match seen.len() {
                    4 => std::ops::ControlFlow::Break(()),
                    _ => std::ops::ControlFlow::Continue(()),
                })
            })
            .unwrap();
        assert_eq!((cut.as_slice(), seen.as_slice()), (&all[..4], &all[..4]));
        let e = sampler()
            .generate(&rt, &[1, 2], 10, |_| {
                Err(Gpt2Error::InvalidSetting {
                    what: "reader",
                    reason: "gone".into(),
                })
            })
            .unwrap_err();
        assert!(e.to_string().contains("gone"), "{e}");
    }

    #[test]
    fn decoding_refuses_what_it_cannot_continue() {
        let cfg = Gpt2Config::tiny();
        let rt = runtime();
        let mut two = Gpt2Model::new(&rt, &cfg, 2, 8).unwrap();
        let fused = ModelOptions {
            fusion: Fusion::ALL,
            ..ModelOptions::default()
        };
        let mut fused = Gpt2Model::with_options(&rt, &cfg, 1, 8, fused).unwrap();
        let mut one = Gpt2Model::new(&rt, &cfg, 1, 8).unwrap();
        let v = cfg.vocab_size as u32;
        for (e, what) in [
            (two.forward_position(&rt, 0, 1), "batch size is 2"),
            (fused.forward_position(&rt, 0, 1), "fused kernels"),
            (one.forward_position(&rt, 8, 1), "position 8 is past"),
            (one.forward_position(&rt, 0, v), "token"),
        ] {
            let e = e.unwrap_err().to_string();
            assert!(e.contains(what), "{what}: {e}");
        }
        rt.synchronize().unwrap();
    }
}

//! Text generation with the engine model on a fixed `(1, T)` window (causal
//! attention: the positions after the context do not affect the ones inside
//! it). The context takes one forward pass; each token drawn after it, while
//! the window still has room, takes the forward pass of its own position
//! only ([`Gpt2Model::forward_position`]: the model's activations are the KV
//! cache), the same logits to float rounding. Once the window is full
//! every position moves with each new token, and each token takes a forward
//! pass over the last `T` (llm.c's and nanoGPT's way for every token).
//!
//! On CUDA the sampler makes a forward pass per token for now: the one-row
//! attention kernel has not yet been run on a GPU (docs/gpu-validation.md);
//! [`Sampler::with_kv_cache`] turns it on.

use braid::Runtime;
use std::ops::ControlFlow;

use super::{Gpt2Model, ModelOptions, Rng};
use crate::config::Gpt2Config;
use crate::error::{Gpt2Error, Result};
use crate::kernels::fill;
use crate::kernels::storage::Dtype;

/// How the next token is drawn from a row of logits: the logits divided by
/// the temperature, then (if set) the top-k and top-p (nucleus) filters, as
/// Hugging Face's `generate` applies them, then a draw from the softmax of
/// what is left.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    /// 0: always the most likely token (the filters do not matter then);
    /// otherwise positive.
    pub temperature: f32,
    /// Only the `k` most likely tokens (with any tied with the k-th), if set;
    /// at least 1.
    pub top_k: Option<usize>,
    /// Only the most likely tokens whose probabilities (after top-k) first
    /// add up to at least `p`, if set; `0 < p <= 1`.
    pub top_p: Option<f32>,
}

impl Default for Sampling {
    /// Temperature 1, no filter: a draw from the model's distribution.
    fn default() -> Self {
        Sampling {
            temperature: 1.0,
            top_k: None,
            top_p: None,
        }
    }
}

impl Sampling {
    /// Refuses a temperature, `k` or `p` out of range, naming it.
    pub fn check(&self) -> Result<()> {
        let invalid = |what, reason: String| Err(Gpt2Error::InvalidSetting { what, reason });
        let t = self.temperature;
        if !(t.is_finite() && t >= 0.0) {
            return invalid(
                "temperature",
                format!("{t} is not 0 (greedy) or a positive number"),
            );
        }
        if self.top_k == Some(0) {
            return invalid("top-k", "0 keeps no token: give at least 1".into());
        }
        match self.top_p {
            Some(p) if !(p > 0.0 && p <= 1.0) => invalid("top-p", format!("{p} is not in (0, 1]")),
            _ => Ok(()),
        }
    }
}

/// Picks the next token from one row of logits: the most likely one when
/// `temperature` is 0, otherwise a draw from `softmax(logits / temperature)`.
/// Errors as [`sample_with`]'s.
pub fn sample_next(logits: &[f32], temperature: f32, rng: &mut Rng) -> Result<u32> {
    let how = Sampling {
        temperature,
        ..Sampling::default()
    };
    sample_with(logits, &how, rng)
}

/// Picks the next token from one row of logits as `how` says: one uniform
/// number of `rng` a draw (none when greedy), the tokens in id order, so a
/// filter that removes nothing leaves the draw as it was. An error for
/// settings [`Sampling::check`] refuses, or for no logits.
pub fn sample_with(logits: &[f32], how: &Sampling, rng: &mut Rng) -> Result<u32> {
    how.check()?;
    if logits.is_empty() {
        return Err(Gpt2Error::InvalidSetting {
            what: "logits",
            reason: "an empty row has no token to draw".into(),
        });
    }
    Ok(draw(logits, how, rng))
}

/// [`sample_with`] for settings already checked and a row that is not
/// empty.
fn draw(logits: &[f32], how: &Sampling, rng: &mut Rng) -> u32 {
    if how.temperature <= 0.0 || !how.temperature.is_finite() {
        let mut best = 0;
        for (i, &x) in logits.iter().enumerate() {
            if x > logits[best] {
                best = i;
            }
        }
        return best as u32;
    }
    let inv = 1.0 / how.temperature as f64;
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let mut weights: Vec<f64> = logits
        .iter()
        .map(|&x| ((x as f64 - max) * inv).exp())
        .collect();
    if let Some(k) = how.top_k.filter(|&k| k < logits.len()) {
        // The k-th largest logit; those below it go.
        let mut sorted = logits.to_vec();
        let (_, kth, _) = sorted.select_nth_unstable_by(k.max(1) - 1, |a, b| b.total_cmp(a));
        let kth = *kth;
        for (w, &x) in weights.iter_mut().zip(logits) {
            if x < kth {
                *w = 0.0;
            }
        }
    }
    if let Some(p) = how.top_p.filter(|&p| p < 1.0) {
        // The most likely first (ties: the lower id first); a token stays
        // while the ones before it add up to less than `p`.
        let total: f64 = weights.iter().sum();
        let mut order: Vec<usize> = (0..weights.len()).filter(|&i| weights[i] > 0.0).collect();
        order.sort_by(|&a, &b| weights[b].total_cmp(&weights[a]).then(a.cmp(&b)));
        let mut before = 0.0;
        for i in order {
            if before >= p as f64 * total {
                weights[i] = 0.0;
            }
            before += weights[i];
        }
    }
    let total: f64 = weights.iter().sum();
    let mut r = rng.uniform() * total;
    let mut last = 0;
    for (i, w) in weights.iter().enumerate() {
        if *w > 0.0 {
            if r < *w {
                return i as u32;
            }
            last = i;
        }
        r -= w;
    }
    // Rounding left `r` past the end: the last token still in.
    last as u32
}

/// Generates tokens with a model on a runtime.
#[derive(Debug)]
pub struct Sampler {
    model: Gpt2Model,
    rng: Rng,
    how: Sampling,
    /// Whether a token after the context takes one position's forward pass
    /// (module docs).
    kv_cache: bool,
}

impl Sampler {
    /// A sampler for `params` of `cfg` with a window of `window` tokens
    /// (at least 1; clamped to the model's context), the model storing
    /// `dtype`: it sees the last `window` tokens of its context (a longer
    /// prompt's first tokens are dropped). The temperature is 0 (greedy) or
    /// positive; anything else is an error.
    pub fn new(
        rt: &Runtime,
        cfg: &Gpt2Config,
        params: &[f32],
        window: usize,
        temperature: f32,
        seed: u64,
        dtype: Dtype,
    ) -> Result<Self> {
        let how = Sampling {
            temperature,
            ..Sampling::default()
        };
        let s = Self::unloaded(rt, cfg, window, dtype, how, seed)?;
        s.model.upload_params(rt, params)?;
        Ok(s)
    }

    /// A sampler whose model has no parameters yet (all zero).
    fn unloaded(
        rt: &Runtime,
        cfg: &Gpt2Config,
        window: usize,
        dtype: Dtype,
        how: Sampling,
        seed: u64,
    ) -> Result<Self> {
        how.check()?;
        if window == 0 {
            return Err(Gpt2Error::InvalidSetting {
                what: "sampling window",
                reason: "0 tokens: the model sees at least the last token".into(),
            });
        }
        let t = window.min(cfg.max_seq_len);
        let opts = ModelOptions {
            dtype,
            inference: true,
            ..ModelOptions::default()
        };
        Ok(Sampler {
            kv_cache: rt.cuda_device().is_none(),
            model: Gpt2Model::with_options(rt, cfg, 1, t, opts)?,
            rng: Rng::new(seed),
            how,
        })
    }

    /// A sampler for the parameters `model` holds now (copied on the
    /// device; the same configuration and storage type), with a window of
    /// `window` tokens (clamped to the model's context), drawing with
    /// `how` from `seed`. [`copy_params`](Self::copy_params) takes the
    /// model's parameters again after they change (a training run's).
    pub fn for_model(
        rt: &Runtime,
        model: &Gpt2Model,
        window: usize,
        how: Sampling,
        seed: u64,
    ) -> Result<Self> {
        let s = Self::unloaded(rt, model.config(), window, model.dtype(), how, seed)?;
        s.copy_params(rt, model)?;
        Ok(s)
    }

    /// Submits the copy of `model`'s parameters (as it stores them) into
    /// the sampler's model; the next [`generate`](Self::generate) draws
    /// from them. `model` is of the sampler's configuration and storage
    /// type.
    pub fn copy_params(&self, rt: &Runtime, model: &Gpt2Model) -> Result<()> {
        let (from, to) = (model.params(), self.model.params());
        if model.config() != self.model.config() || from.len() != to.len() {
            return Err(Gpt2Error::InvalidSetting {
                what: "sampler parameters",
                reason: "the model is not of the sampler's configuration and storage type".into(),
            });
        }
        fill::copy(rt.task("sampler params"), &from.whole(), &to.whole())?;
        Ok(())
    }

    /// Draws from `seed` from now on.
    pub fn reseed(&mut self, seed: u64) {
        self.rng = Rng::new(seed);
    }

    /// With `on`, each token drawn while the window has room takes the
    /// forward pass of its own position only; without, a forward pass over
    /// the whole window (module docs). On by default on the CPU, off on
    /// CUDA.
    pub fn with_kv_cache(mut self, on: bool) -> Self {
        self.kv_cache = on;
        self
    }

    /// The model the sampler runs (made for inference, batch size 1).
    pub fn model(&self) -> &Gpt2Model {
        &self.model
    }

    /// Draws with `how` from now on (its temperature replaces the one given
    /// to [`new`](Self::new)); refused, changing nothing, if out of range.
    pub fn set_sampling(&mut self, how: Sampling) -> Result<()> {
        how.check()?;
        self.how = how;
        Ok(())
    }

    /// Continues `context` (at least one token) by `n` tokens; calls
    /// `on_token` with each new token as soon as it is drawn. Returns the new
    /// tokens.
    ///
    /// An error from `on_token` stops generation at once, and `generate`
    /// returns it. To stop early without an error (a stop token, enough
    /// text, a reader gone), use [`generate_until`](Self::generate_until).
    pub fn generate(
        &mut self,
        rt: &Runtime,
        context: &[u32],
        n: usize,
        mut on_token: impl FnMut(u32) -> Result<()>,
    ) -> Result<Vec<u32>> {
        self.generate_until(rt, context, n, |t| {
            on_token(t).map(|()| ControlFlow::Continue(()))
        })
    }

    /// [`generate`](Self::generate), where `on_token` may also stop it:
    /// `Ok(ControlFlow::Break(()))` ends generation after that token, and
    /// the tokens drawn so far, that one included, are returned.
    pub fn generate_until(
        &mut self,
        rt: &Runtime,
        context: &[u32],
        n: usize,
        mut on_token: impl FnMut(u32) -> Result<ControlFlow<()>>,
    ) -> Result<Vec<u32>> {
        if context.is_empty() {
            return Err(Gpt2Error::InvalidSetting {
                what: "prompt",
                reason: "generation needs at least one context token".into(),
            });
        }
        let cfg = *self.model.config();
        crate::data::check_ids(context, cfg.vocab_size, "prompt")?;
        let t = self.model.seq_len();
        let mut window: Vec<u32> = context.iter().rev().take(t).rev().copied().collect();
        // `n` may be huge (generate until the reader stops): no room for
        // it is reserved up front.
        let mut out = Vec::with_capacity(n.min(4096));
        // How many of the window's first tokens the model's activations
        // hold.
        let mut computed = 0;
        for _ in 0..n {
            let len = window.len();
            // Only the last token is new: the window grew by the token drawn
            // last (once full, it slides instead, and every position moves).
            if self.kv_cache && computed + 1 == len {
                self.model.forward_position(rt, len - 1, window[len - 1])?;
            } else {
                let mut tokens = window.clone();
                tokens.resize(t, 0);
                self.model.forward(rt, &tokens, None)?;
            }
            computed = len;
            let logits = self.model.read_logits_row(rt, len - 1)?;
            // `how` was checked when it was set.
            let next = draw(&logits, &self.how, &mut self.rng);
            let flow = on_token(next)?;
            out.push(next);
            if flow.is_break() {
                break;
            }
            if window.len() == t {
                window.remove(0);
            }
            window.push(next);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn draws(logits: &[f32], how: Sampling, n: usize) -> Vec<u32> {
        let mut rng = Rng::new(7);
        (0..n).map(|_| draw(logits, &how, &mut rng)).collect()
    }

    fn with(temperature: f32, top_k: Option<usize>, top_p: Option<f32>) -> Sampling {
        Sampling {
            temperature,
            top_k,
            top_p,
        }
    }

    /// Probabilities 0.4, 0.3, 0.2, 0.1 (ids 3, 0, 2, 1) at temperature 1.
    fn four() -> Vec<f32> {
        [0.3f32, 0.1, 0.2, 0.4].iter().map(|p| p.ln()).collect()
    }

    #[test]
    fn top_k_keeps_the_k_most_likely_and_their_ties() {
        let l = four();
        assert!(draws(&l, with(1.0, Some(1), None), 200)
            .iter()
            .all(|&t| t == 3));
        let two = draws(&l, with(2.0, Some(2), None), 2000);
        assert!(two.iter().all(|&t| t == 3 || t == 0));
        assert!(two.contains(&0) && two.contains(&3));
        // Tied with the 2nd: both kept.
        let tied = [1.0f32, 5.0, 1.0, -9.0];
        let t = draws(&tied, with(1.0, Some(2), None), 4000);
        assert!(t.contains(&0) && t.contains(&2) && !t.contains(&3));
    }

    #[test]
    fn top_p_keeps_the_nucleus() {
        let l = four();
        // 0.4 < 0.5, 0.4 + 0.3 >= 0.5: ids 3 and 0, about 4 : 3.
        let d = draws(&l, with(1.0, None, Some(0.5)), 7000);
        assert!(d.iter().all(|&t| t == 3 || t == 0));
        let threes = d.iter().filter(|&&t| t == 3).count() as f64;
        assert!((threes / 7000.0 - 4.0 / 7.0).abs() < 0.03, "{threes}");
        // Exactly 0.4: the next token is not needed.
        let d = draws(&l, with(1.0, None, Some(0.4)), 500);
        assert!(d.iter().all(|&t| t == 3));
        // p 0.75 needs the third (0.4 + 0.3 < 0.75); after top-k 3 the
        // probabilities are renormalised (0.44, 0.33, 0.22): the first two
        // make 0.78, and p 0.75 no longer needs it; p 0.8 does.
        let d = draws(&l, with(1.0, None, Some(0.75)), 4000);
        assert!(d.contains(&2) && !d.contains(&1));
        let d = draws(&l, with(1.0, Some(3), Some(0.75)), 4000);
        assert!(d.iter().all(|&t| t == 3 || t == 0));
        let d = draws(&l, with(1.0, Some(3), Some(0.8)), 4000);
        assert!(d.contains(&2) && !d.contains(&1));
    }

    #[test]
    fn filters_that_remove_nothing_leave_the_draws_as_they_were() {
        let l: Vec<f32> = (0..300)
            .map(|i| ((i * 37 % 101) as f32 * 0.07).sin() * 3.0)
            .collect();
        let plain = draws(&l, with(0.8, None, None), 500);
        assert_eq!(plain, draws(&l, with(0.8, Some(300), Some(1.0)), 500));
        let mut rng = Rng::new(7);
        let old: Vec<u32> = (0..500)
            .map(|_| sample_next(&l, 0.8, &mut rng).unwrap())
            .collect();
        assert_eq!(plain, old);
        // The public draws check what they are given.
        let bad = with(1.0, Some(0), None);
        assert!(sample_with(&l, &bad, &mut rng).is_err());
        assert!(sample_with(&[], &with(1.0, None, None), &mut rng).is_err());
        assert!(sample_next(&l, f32::NAN, &mut rng).is_err());
        // Greedy ignores the filters.
        assert!(draws(&l, with(0.0, Some(5), Some(0.1)), 3)
            .iter()
            .all(|&t| t == draws(&l, with(0.0, None, None), 1)[0]));
    }

    #[test]
    fn settings_out_of_range_are_refused_by_name() {
        for (how, what) in [
            (with(-1.0, None, None), "temperature"),
            (with(f32::NAN, None, None), "temperature"),
            (with(1.0, Some(0), None), "top-k"),
            (with(1.0, None, Some(0.0)), "top-p"),
            (with(1.0, None, Some(1.5)), "top-p"),
            (with(1.0, None, Some(f32::NAN)), "top-p"),
        ] {
            let e = how.check().unwrap_err().to_string();
            assert!(e.contains(what), "{how:?}: {e}");
        }
        assert!(with(0.0, Some(1), Some(1.0)).check().is_ok());
    }
}

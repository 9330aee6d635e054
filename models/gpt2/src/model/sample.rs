//! Text generation with the engine model: one forward pass per new token over
//! a fixed `(1, T)` window (llm.c's way: causal attention means the positions
//! after the context do not affect the ones inside it).

use braid::Runtime;

use super::{Gpt2Model, ModelOptions, Rng};
use crate::config::Gpt2Config;
use crate::error::{Gpt2Error, Result};
use crate::kernels::storage::Dtype;

/// Picks the next token from one row of logits: the most likely one when
/// `temperature <= 0`, otherwise a draw from `softmax(logits / temperature)`.
pub fn sample_next(logits: &[f32], temperature: f32, rng: &mut Rng) -> u32 {
    if temperature <= 0.0 || !temperature.is_finite() {
        let mut best = 0;
        for (i, &x) in logits.iter().enumerate() {
            if x > logits[best] {
                best = i;
            }
        }
        return best as u32;
    }
    let inv = 1.0 / temperature as f64;
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let weights: Vec<f64> = logits
        .iter()
        .map(|&x| ((x as f64 - max) * inv).exp())
        .collect();
    let total: f64 = weights.iter().sum();
    let mut r = rng.uniform() * total;
    for (i, w) in weights.iter().enumerate() {
        if r < *w {
            return i as u32;
        }
        r -= w;
    }
    (logits.len() - 1) as u32
}

/// Generates tokens with a model on a runtime.
#[derive(Debug)]
pub struct Sampler {
    model: Gpt2Model,
    rng: Rng,
    temperature: f32,
}

impl Sampler {
    /// A sampler for `params` of `cfg` with a window of `window` tokens
    /// (clamped to the model's context), the model storing `dtype`. The
    /// temperature is 0 (greedy) or positive; anything else is an error.
    pub fn new(
        rt: &Runtime,
        cfg: &Gpt2Config,
        params: &[f32],
        window: usize,
        temperature: f32,
        seed: u64,
        dtype: Dtype,
    ) -> Result<Self> {
        if !(temperature.is_finite() && temperature >= 0.0) {
            return Err(Gpt2Error::InvalidSetting {
                what: "temperature",
                reason: format!("{temperature} is not 0 (greedy) or a positive number"),
            });
        }
        let t = window.clamp(1, cfg.max_seq_len);
        let opts = ModelOptions {
            dtype,
            ..ModelOptions::default()
        };
        let model = Gpt2Model::with_options(rt, cfg, 1, t, opts)?;
        model.upload_params(rt, params)?;
        Ok(Sampler {
            model,
            rng: Rng::new(seed),
            temperature,
        })
    }

    /// Continues `context` (at least one token) by `n` tokens; calls
    /// `on_token` with each new token as soon as it is drawn. Returns the new
    /// tokens.
    pub fn generate(
        &mut self,
        rt: &Runtime,
        context: &[u32],
        n: usize,
        mut on_token: impl FnMut(u32) -> Result<()>,
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
        for _ in 0..n {
            let len = window.len();
            let mut tokens = window.clone();
            tokens.resize(t, 0);
            self.model.forward(rt, &tokens, None)?;
            let logits = self.model.read_logits_row(rt, len - 1)?;
            let next = sample_next(&logits, self.temperature, &mut self.rng);
            on_token(next)?;
            out.push(next);
            if window.len() == t {
                window.remove(0);
            }
            window.push(next);
        }
        Ok(out)
    }
}

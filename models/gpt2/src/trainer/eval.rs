//! Evaluation of given parameters: the mean next-token loss over a token
//! source's consecutive windows.

use braid::Runtime;

use super::options::check_batch_shape;
use crate::config::Gpt2Config;
use crate::data::{eval_windows, TokenSource};
use crate::error::{Gpt2Error, Result};
use crate::model::{Gpt2Model, ModelOptions};

/// The result of [`evaluate`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EvalReport {
    /// Mean next-token cross-entropy (nats).
    pub loss: f64,
    /// Windows evaluated.
    pub windows: usize,
    /// Tokens predicted.
    pub tokens: usize,
}

/// What [`evaluate`] checks before it runs anything: `cfg` itself
/// ([`Gpt2Config::validate`]), the batch shape against it, the token ids
/// against its vocabulary, and that the tokens make at least one window.
/// Returns how many windows it scores.
pub fn check_eval(
    cfg: &Gpt2Config,
    source: &TokenSource,
    seq_len: usize,
    batch_size: usize,
) -> Result<usize> {
    cfg.validate()?;
    check_batch_shape(batch_size, seq_len, cfg)?;
    source.check_vocab(cfg.vocab_size)?;
    let total = eval_windows(source, seq_len)?.num_windows();
    if total == 0 {
        return Err(Gpt2Error::InvalidSetting {
            what: "evaluation data",
            reason: format!(
                "{}: too few tokens ({}) for one window of {seq_len} (a window needs {}: \
                 its tokens and the one after them)",
                source.origin(),
                source.len(),
                seq_len + 1
            ),
        });
    }
    Ok(total)
}

/// Mean next-token cross-entropy of `params` over the consecutive windows of
/// `source` (window `i` has inputs `i·T .. i·T+T-1` and predicts tokens
/// `i·T+1 .. i·T+T`), `batch_size` windows per forward pass, the model made
/// with `opts` (its storage type and fused kernels; the losses are summed
/// in `f64` either way) for inference ([`ModelOptions::inference`]).
#[allow(clippy::too_many_arguments)]
pub fn evaluate(
    rt: &Runtime,
    cfg: &Gpt2Config,
    params: &[f32],
    source: &TokenSource,
    seq_len: usize,
    batch_size: usize,
    opts: ModelOptions,
    mut on_batch: impl FnMut(usize, usize),
) -> Result<EvalReport> {
    let total = check_eval(cfg, source, seq_len, batch_size)?;
    // Forward passes only: no gradients, one block's activations.
    let opts = ModelOptions {
        inference: true,
        ..opts
    };
    // Windows are made a batch at a time: all of them at once would take 8
    // bytes per token of the source (their `u32` inputs and targets).
    let mut windows = eval_windows(source, seq_len)?;
    let mut model: Option<Gpt2Model> = None;
    let (mut sum, mut count) = (0.0f64, 0usize);
    let batches = total.div_ceil(batch_size);
    for i in 0..batches {
        let batch: Vec<_> = windows.by_ref().take(batch_size).collect();
        let b = batch.len();
        if model.as_ref().is_none_or(|m| m.batch_size() != b) {
            // The last batch's smaller model: the other one goes first
            // (its tasks done), so the two are never held together.
            if model.take().is_some() {
                rt.synchronize()?;
            }
            let m = Gpt2Model::with_options(rt, cfg, b, seq_len, opts)?;
            m.upload_params(rt, params)?;
            model = Some(m);
        }
        let m = model.as_mut().expect("just made");
        let x: Vec<u32> = batch
            .iter()
            .flat_map(|w| w.inputs.iter().copied())
            .collect();
        let y: Vec<u32> = batch
            .iter()
            .flat_map(|w| w.targets.iter().copied())
            .collect();
        m.forward(rt, &x, Some(&y))?;
        let losses = m.read_losses(rt)?;
        sum += losses.iter().map(|&l| l as f64).sum::<f64>();
        count += losses.len();
        on_batch(i + 1, batches);
    }
    rt.synchronize()?;
    Ok(EvalReport {
        loss: sum / count as f64,
        windows: total,
        tokens: count,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ConfigError;
    use crate::kernels::storage::Dtype;

    /// The fused kernels (`braid-gpt2 eval`'s default) score what the
    /// unfused reference path does, to float rounding, in f32 and bf16, on
    /// an odd shape (windows of 13, a last batch of one).
    #[test]
    fn fused_evaluation_follows_the_unfused_path() {
        use crate::model::{init_params, Fusion};
        let cfg = Gpt2Config::tiny();
        let params = init_params(&cfg, 4);
        let ids: Vec<u16> = (0..13 * 7 + 1).map(|i| (i * 37 % 509) as u16).collect();
        let source = TokenSource::from_tokens(ids, "odd");
        let rt =
            crate::trainer::model_runtime(braid::BackendKind::Cpu, 2, braid::Policy::Affinity, 0)
                .unwrap();
        for (dtype, rtol) in [(Dtype::F32, 1e-6), (Dtype::Bf16, 1e-3)] {
            let score = |fusion| {
                let opts = ModelOptions {
                    dtype,
                    fusion,
                    ..ModelOptions::default()
                };
                evaluate(&rt, &cfg, &params, &source, 13, 3, opts, |_, _| {}).unwrap()
            };
            let (plain, fused) = (score(Fusion::NONE), score(Fusion::ALL));
            assert_eq!((plain.windows, fused.tokens), (7, 7 * 13));
            assert!(
                (plain.loss - fused.loss).abs() <= rtol * plain.loss,
                "{dtype}: {} vs {}",
                plain.loss,
                fused.loss
            );
        }
    }

    #[test]
    fn check_eval_refuses_an_invalid_config() {
        let source = TokenSource::from_tokens(vec![1u16; 100], "test tokens");
        let cfg = Gpt2Config::tiny();
        assert_eq!(check_eval(&cfg, &source, 8, 2).unwrap(), 12);
        let bad = Gpt2Config {
            num_heads: 3,
            ..cfg
        };
        let err = check_eval(&bad, &source, 8, 2).unwrap_err();
        assert!(
            matches!(err, Gpt2Error::Config(ConfigError::HeadsDoNotDivide { .. })),
            "{err:?}"
        );
    }
}

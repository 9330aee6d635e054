//! Text generated during training ([`Generation`]): rank 0 continues the
//! prompt from the parameters a step has just updated, on its own runtime,
//! with a sampler of its own whose parameters are copied from the training
//! model on the device.

use braid::Runtime;

use super::options::Generation;
use crate::error::Result;
use crate::model::{Gpt2Model, Sampler};

/// The seed of the draws after step `step` of a run seeded `seed`
/// ([`TrainOptions::seed`](super::TrainOptions)): a function of the two
/// only, so a resumed run draws what an uninterrupted one does.
pub fn generation_seed(seed: u64, step: u64) -> u64 {
    seed ^ step.wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// The tokens `g` asks for after step `step`, drawn from
/// [`generation_seed`]. The sampler is made at the first call and kept in
/// `sampler`.
pub(super) fn generate(
    rt: &Runtime,
    model: &Gpt2Model,
    g: &Generation,
    sampler: &mut Option<Sampler>,
    seed: u64,
    step: u64,
) -> Result<Vec<u32>> {
    let _s = rt.scope("generation");
    let s = match sampler {
        Some(s) => {
            s.copy_params(rt, model)?;
            s
        }
        None => {
            let window = g.prompt.len().saturating_add(g.tokens);
            sampler.insert(Sampler::for_model(rt, model, window, g.how, seed)?)
        }
    };
    s.reseed(generation_seed(seed, step));
    s.generate(rt, &g.prompt, g.tokens, |_| Ok(()))
}

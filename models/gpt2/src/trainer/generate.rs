//! Text generated during training ([`Generation`]): each rank continues
//! the prompt from the parameters a step has just updated, on its own
//! runtime, with a sampler of its own whose parameters are copied from the
//! training model on the device (every rank draws the same tokens; rank 0
//! reports them).

use braid::Runtime;
use std::ops::ControlFlow;

use super::options::Generation;
use crate::error::Result;
use crate::model::{Gpt2Model, Sampler};

/// The seed of the draws after step `step` of a run seeded `seed`
/// ([`TrainOptions::seed`](super::TrainOptions)): a function of the two
/// only, so a resumed run draws what an uninterrupted one does.
pub fn generation_seed(seed: u64, step: u64) -> u64 {
    crate::rng::Rng::derived_seed(seed, step)
}

/// The tokens `g` asks for after step `step` of a run seeded `seed`
/// (`at`), drawn from [`generation_seed`]; fewer if `stop` says so before
/// they are all drawn (the run is stopping), none if it says so first. The
/// sampler is made at the first call and kept in `sampler`.
pub(super) fn generate(
    rt: &Runtime,
    model: &Gpt2Model,
    g: &Generation,
    sampler: &mut Option<Sampler>,
    (seed, step): (u64, u64),
    stop: &dyn Fn() -> bool,
) -> Result<Vec<u32>> {
    if stop() {
        return Ok(Vec::new());
    }
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
    // A stop ends the generation; the tokens so far are the sample.
    s.generate_until(rt, &g.prompt, g.tokens, |_| {
        Ok(match stop() {
            true => ControlFlow::Break(()),
            false => ControlFlow::Continue(()),
        })
    })
}

//! Validation during training ([`Validation`]): the held-out loss of the
//! parameters a step has just updated, scored by every rank's share of the
//! windows on the training model.

use braid::comm::{BoundComm, ReduceOp};
use braid::{Buffer, Runtime};

use super::options::Validation;
use crate::data::eval_windows;
use crate::error::Result;
use crate::model::Gpt2Model;

/// The mean next-token loss over `v`'s windows, batch `i` of them scored on
/// rank `i mod world`, the ranks' sums added through `comm` in `sums` (two
/// `f32`: the losses' sum and their count). A last batch of fewer windows
/// is filled with its first window, whose extra losses are left out. Every
/// rank calls it (a collective with several).
pub(super) fn validate(
    rt: &Runtime,
    model: &mut Gpt2Model,
    v: &Validation,
    comm: Option<(&BoundComm<'_>, &Buffer)>,
    rank: usize,
    world: usize,
) -> Result<f32> {
    let _s = rt.scope("validation");
    let (b, t) = (model.batch_size(), model.seq_len());
    // A batch of windows at a time (all of them at once would take 8 bytes
    // per token), each rank keeping its own.
    let mut windows = eval_windows(&v.data, t)?.take(v.windows).peekable();
    let (mut x, mut y) = (Vec::with_capacity(b * t), Vec::with_capacity(b * t));
    let (mut sum, mut count) = (0f64, 0usize);
    for i in 0.. {
        if windows.peek().is_none() {
            break;
        }
        let batch: Vec<_> = windows.by_ref().take(b).collect();
        if i % world != rank {
            continue;
        }
        x.clear();
        y.clear();
        for w in batch.iter().chain(std::iter::repeat(&batch[0])).take(b) {
            x.extend_from_slice(&w.inputs);
            y.extend_from_slice(&w.targets);
        }
        model.upload_batch(rt, &x, Some(&y))?;
        model.forward_uploaded(rt)?;
        let losses = model.read_losses(rt)?;
        let scored = &losses[..batch.len() * t];
        sum += scored.iter().map(|&l| f64::from(l)).sum::<f64>();
        count += scored.len();
    }
    let Some((c, sums)) = comm else {
        return Ok((sum / count as f64) as f32);
    };
    rt.upload(sums, &[sum as f32, count as f32])?;
    c.all_reduce::<f32>(&sums.whole(), ReduceOp::Sum)?;
    let total = rt.read_vec::<f32>(sums)?;
    Ok((f64::from(total[0]) / f64::from(total[1])) as f32)
}

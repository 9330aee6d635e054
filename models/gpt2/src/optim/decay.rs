//! Which parameters weight decay applies to ([`DecayOn`]): all of them
//! (PyTorch's `AdamW(model.parameters())`, the reference fixture), or the
//! matrices only (nanoGPT's and llm.c's GPT-2 training: the embeddings and
//! the linear layers' weights decay, the biases and layer norms do not).
//!
//! An optimizer decays its matrices only by updating the other elements in
//! chunks of their own with a weight decay of 0
//! ([`AdamW::decaying_only`]): the update chunks are cut where a decayed
//! range starts or ends. The moments stay packed as before, the norm's
//! chunks (and so the clip factor, bit for bit) are unchanged.

use std::ops::Range;

use braid::Runtime;

use super::AdamW;
use crate::error::{Gpt2Error, Result};

/// The parameters weight decay applies to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DecayOn {
    /// Every parameter (PyTorch's AdamW over `model.parameters()`).
    #[default]
    All,
    /// Tensors of two or more dimensions: `wte`, `wpe` and the linear
    /// layers' weights; no biases, no layer-norm weights (nanoGPT,
    /// llm.c).
    Matrices,
}

impl DecayOn {
    /// Its name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            DecayOn::All => "all",
            DecayOn::Matrices => "matrices",
        }
    }
}

impl std::fmt::Display for DecayOn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for DecayOn {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "all" => Ok(DecayOn::All),
            "matrices" => Ok(DecayOn::Matrices),
            _ => Err(format!("`{s}`: weight decay applies to all or matrices")),
        }
    }
}

/// `chunk` cut at every start and end of the `decayed` ranges inside it:
/// `(piece, decayed)` in order.
fn cut_at(chunk: &Range<usize>, decayed: &[Range<usize>]) -> Vec<(Range<usize>, bool)> {
    let mut cuts: Vec<usize> = decayed
        .iter()
        .flat_map(|r| [r.start, r.end])
        .filter(|&x| x > chunk.start && x < chunk.end)
        .collect();
    cuts.sort_unstable();
    cuts.dedup();
    let mut at = chunk.start;
    cuts.into_iter()
        .chain([chunk.end])
        .map(|end| {
            let piece = at..end;
            at = end;
            let decays = decayed.iter().any(|r| r.contains(&piece.start));
            (piece, decays)
        })
        .collect()
}

impl AdamW {
    /// This optimizer with weight decay on the elements of `decayed` only
    /// (sorted, disjoint element ranges: e.g.
    /// [`ParamLayout::matrix_ranges`](crate::layout::ParamLayout::matrix_ranges)),
    /// the others updated with a weight decay of 0. Call it before the
    /// first step; after an [`advance`](Self::advance) the next
    /// [`update_recorded`](Self::update_recorded) is refused until another
    /// `advance` has written the second buffer's scalars.
    pub fn decaying_only(mut self, rt: &Runtime, decayed: &[Range<usize>]) -> Result<Self> {
        if decayed.windows(2).any(|w| w[0].end > w[1].start) {
            return Err(Gpt2Error::InvalidSetting {
                what: "decayed ranges",
                reason: "they must be sorted and disjoint".into(),
            });
        }
        let (mut chunks, mut state_at, mut decays) = (Vec::new(), Vec::new(), Vec::new());
        for (c, &at) in self.chunks.iter().zip(&self.state_at) {
            for (piece, d) in cut_at(c, decayed) {
                state_at.push(at + (piece.start - c.start));
                chunks.push(piece);
                decays.push(d);
            }
        }
        (self.chunks, self.state_at, self.decays) = (chunks, state_at, decays);
        self.no_decay_scalars = Some(rt.alloc("adamw step scalars (no decay)", 12)?);
        // The new buffer holds no step's scalars yet.
        self.scalars_step = 0;
        Ok(self)
    }

    /// Whether update chunk `i` decays its parameters.
    pub(super) fn chunk_decays(&self, i: usize) -> bool {
        self.decays.get(i).copied().unwrap_or(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Made after an `advance`, the second scalars buffer is empty: the
    /// recorded update is refused until the next `advance` fills it.
    #[test]
    fn a_recorded_update_waits_for_an_advance_after_decaying_only() {
        let rt =
            crate::trainer::model_runtime(braid::BackendKind::Cpu, 1, braid::Policy::Single, 0)
                .unwrap();
        let hyper = crate::checkpoint::AdamWHyper::default();
        let (params, grads) = (rt.alloc("p", 16).unwrap(), rt.alloc("g", 16).unwrap());
        let (all, decayed) = (0..4, 0..2);
        let mut opt = AdamW::new(&rt, 4, vec![all], hyper, None).unwrap();
        opt.advance(&rt).unwrap();
        let mut opt = opt
            .decaying_only(&rt, std::slice::from_ref(&decayed))
            .unwrap();
        let e = opt.update_recorded(&rt, &params, &grads).unwrap_err();
        assert!(e.to_string().contains("without an advance"), "{e}");
        opt.advance(&rt).unwrap();
        opt.update_recorded(&rt, &params, &grads).unwrap();
        rt.synchronize().unwrap();
    }

    #[test]
    fn chunks_are_cut_where_the_decayed_ranges_start_and_end() {
        let decayed = [2..5, 7..9];
        assert_eq!(
            cut_at(&(0..10), &decayed),
            [
                (0..2, false),
                (2..5, true),
                (5..7, false),
                (7..9, true),
                (9..10, false)
            ]
        );
        assert_eq!(cut_at(&(3..4), &decayed), [(3..4, true)]);
        assert_eq!(cut_at(&(5..7), &decayed), [(5..7, false)]);
        assert_eq!(
            cut_at(&(4..8), &decayed),
            [(4..5, true), (5..7, false), (7..8, true)]
        );
        assert_eq!("matrices".parse(), Ok(DecayOn::Matrices));
        assert_eq!(DecayOn::default(), DecayOn::All);
        assert!("some"
            .parse::<DecayOn>()
            .unwrap_err()
            .contains("all or matrices"));
    }
}

//! ZeRO-1: AdamW on one rank's shard (see the parent module's docs and
//! braid's `comm/shard.rs` for the split of the buckets).
//!
//! A rank updates the ranges it owns ([`braid::comm::owned_ranges`]: its
//! slice of every bucket head and every bucket tail), with moments for
//! those only. The gradient norm counts every element once across the
//! ranks: each rank sums the squares of its head slices, rank 0 also of the
//! tails (every rank holds them), into `slots_per_rank` partials of its own
//! (the same count on every rank; unused ones stay zero); an all-gather
//! gives every rank every rank's partials, and the clip factor sums them in
//! the same order everywhere.

use std::ops::Range;

use braid::comm::{owned_ranges, BoundComm, BucketShard};
use braid::Runtime;

use super::{check_max_norm, cut, AdamW};
use crate::checkpoint::AdamWHyper;
use crate::error::{Gpt2Error, Result};

/// How a sharded optimizer sits among the ranks.
#[derive(Debug, Clone)]
pub(super) struct Shard {
    pub(super) world: usize,
    /// Partial sums per rank (rank 0's count, the largest).
    pub(super) slots_per_rank: usize,
    /// The buckets' split (for gathering the state).
    buckets: Vec<BucketShard>,
}

impl AdamW {
    /// A ZeRO-1 optimizer for `n` parameters on rank `rank` of `world`,
    /// whose gradient buckets are split as `shards` (from
    /// [`braid::Reducer::shards`]): it updates the ranges this rank owns,
    /// with zero moments for those only, at step 0.
    pub fn sharded(
        rt: &Runtime,
        n: usize,
        shards: &[BucketShard],
        rank: usize,
        world: usize,
        hyper: AdamWHyper,
        max_grad_norm: Option<f32>,
    ) -> Result<Self> {
        check_max_norm(max_grad_norm)?;
        if rank >= world {
            return Err(Gpt2Error::InvalidSetting {
                what: "optimizer shard",
                reason: format!("rank {rank} of {world} ranks"),
            });
        }
        let owned = owned_ranges(shards);
        if let Some(r) = owned.iter().find(|r| r.end > n) {
            return Err(Gpt2Error::InvalidSetting {
                what: "optimizer shard",
                reason: format!("range {r:?} is past the {n} parameters"),
            });
        }
        if owned.windows(2).any(|w| w[0].end > w[1].start) {
            return Err(Gpt2Error::InvalidSetting {
                what: "optimizer shard",
                reason: "the bucket shards overlap".into(),
            });
        }
        let ranges = |f: fn(&BucketShard) -> &Range<usize>| -> Vec<Range<usize>> {
            let mut v: Vec<Range<usize>> = shards
                .iter()
                .map(f)
                .filter(|r| !r.is_empty())
                .cloned()
                .collect();
            v.sort_by_key(|r| r.start);
            v
        };
        let heads = cut(&ranges(|s| &s.owned));
        let tails = cut(&ranges(|s| &s.tail));
        let slots_per_rank = heads.len() + tails.len();
        let counted = if rank == 0 {
            heads.into_iter().chain(tails).collect()
        } else {
            heads
        };
        let norm_chunks = counted
            .into_iter()
            .enumerate()
            .map(|(i, c)| (c, rank * slots_per_rank + i))
            .collect();
        let shard = Shard {
            world,
            slots_per_rank,
            buckets: shards.to_vec(),
        };
        Self::build(
            rt,
            n,
            cut(&owned),
            norm_chunks,
            Some(shard),
            hyper,
            max_grad_norm,
        )
    }

    /// The first half of a sharded step on every rank: this rank's sums of
    /// squares, an all-gather of every rank's partials through `comm`, and
    /// the clip factor of the global norm. On an unsharded optimizer the
    /// same as [`clip`](Self::clip) (no collective). Returns at once.
    pub fn clip_sharded(&mut self, comm: &BoundComm<'_>, grads: &braid::Buffer) -> Result<()> {
        let rt = comm.runtime();
        self.sum_squares(rt, grads)?;
        if let Some(s) = &self.shard {
            if s.world != comm.world_size() {
                return Err(Gpt2Error::InvalidSetting {
                    what: "optimizer shard",
                    reason: format!(
                        "sharded over {} ranks, the communicator has {}",
                        s.world,
                        comm.world_size()
                    ),
                });
            }
            if s.slots_per_rank > 0 {
                let all = self
                    .partials
                    .view_of::<f64>(0..s.slots_per_rank * s.world)?;
                comm.all_gather::<f64>(&all)?;
            }
        }
        self.clip_factor(rt)
    }

    /// The full moments `(m, v)` in layout order, after every submitted
    /// step: every rank's slices all-gathered through `comm` into a
    /// temporary buffer, the tails (held by every rank) copied from this
    /// rank. A collective: every rank calls it at the same point. Unsharded:
    /// [`read_state`](Self::read_state), no collective.
    pub fn gather_state(&self, comm: &BoundComm<'_>) -> Result<(Vec<f32>, Vec<f32>)> {
        let Some(s) = &self.shard else {
            return self.read_state(comm.runtime());
        };
        // One temporary full-size buffer serves both moments.
        let full = comm.runtime().alloc("gathered adam state", self.n * 4)?;
        Ok((
            self.gather_packed(comm, s, &self.m, &full)?,
            self.gather_packed(comm, s, &self.v, &full)?,
        ))
    }

    /// The full `f32` master weights in layout order when this optimizer
    /// keeps its own shard of them ([`owns_master`](Self::owns_master)),
    /// gathered as [`gather_state`](Self::gather_state) gathers the
    /// moments (a collective); `None` otherwise (no collective).
    pub fn gather_master(&self, comm: &BoundComm<'_>) -> Result<Option<Vec<f32>>> {
        match (&self.master, &self.shard) {
            (Some(master), Some(s)) => {
                let full = comm
                    .runtime()
                    .alloc("gathered master weights", self.n * 4)?;
                Ok(Some(self.gather_packed(comm, s, master, &full)?))
            }
            _ => Ok(None),
        }
    }

    /// A buffer packed like the moments (this rank's shard: moments, master
    /// weights), gathered from every rank through `full` (`n` f32) into
    /// layout order; the tails (held by every rank) come from this rank.
    fn gather_packed(
        &self,
        comm: &BoundComm<'_>,
        s: &Shard,
        state: &braid::Buffer,
        full: &braid::Buffer,
    ) -> Result<Vec<f32>> {
        let rt = comm.runtime();
        for b in s.buckets.iter().filter(|b| b.chunk > 0) {
            let at = self.state_offset(b.owned.start)?;
            comm.all_gather_into::<f32>(
                &state.view_of::<f32>(at..at + b.chunk)?,
                &full.view_of::<f32>(b.head.clone())?,
            )?;
        }
        let mut x: Vec<f32> = rt.read_vec(full)?;
        let packed: Vec<f32> = rt.read_vec(state)?;
        for b in s.buckets.iter().filter(|b| !b.tail.is_empty()) {
            let at = self.state_offset(b.tail.start)?;
            x[b.tail.clone()].copy_from_slice(&packed[at..at + b.tail.len()]);
        }
        Ok(x)
    }

    /// Where parameter `elem`'s moments sit in the packed state.
    fn state_offset(&self, elem: usize) -> Result<usize> {
        self.chunks
            .iter()
            .zip(&self.state_at)
            .find(|(c, _)| c.contains(&elem))
            .map(|(c, at)| at + (elem - c.start))
            .ok_or_else(|| Gpt2Error::InvalidSetting {
                what: "optimizer shard",
                reason: format!("parameter element {elem} is not in this rank's shard"),
            })
    }
}

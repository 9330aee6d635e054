//! The data-parallel training loader and the evaluation windows.
//!
//! # Sharding invariant
//!
//! All ranks share one global position `p` (the same on every rank, saved in
//! [`LoaderState`]). With per-rank batch `B`, sequence length `T` and `W`
//! ranks, one step consumes the `B·W·T + 1` tokens starting at `p`; rank `r`
//! reads the `B·T + 1` tokens starting at `p + r·B·T` and splits them into
//! `B` rows of inputs and targets shifted by one. Hence:
//!
//! > the concatenation over `r = 0..W` of rank `r`'s inputs (and targets) for a
//! > step equals the inputs (and targets) that a single rank with batch `B·W`
//! > reads for that step,
//!
//! and ranks read disjoint rows. Before a step, if `p + B·W·T + 1` exceeds the
//! data, `p` wraps to 0 and the epoch counter increases — the decision depends
//! only on global quantities, so every rank wraps on the same step. Everything is
//! deterministic: a loader restored from a saved state produces exactly the
//! batches the original would have produced next.
//!
//! With `N` [micro-batches](DataLoader::micro_batches) a step (gradient
//! accumulation) reads `N` batches one after the other, micro-batch `i` from
//! `p + i·B·W·T`, and the wrap is decided once, before its first one, for
//! the `N·B·W·T + 1` tokens of the whole step: a step never mixes the end of
//! one epoch with the start of the next, and it reads the rows that one rank
//! with batch `N·B·W` reads.
//!
//! # Shuffled
//!
//! [`DataLoader::shuffled`] visits the same rows in another order, a new one
//! each epoch, every window once (llm.c shuffles whole global batches
//! within a shard; nanoGPT draws random offsets with repetition): the data
//! is cut into the `n = (len − 1) / T` windows of
//! `T + 1` tokens starting at multiples of `T` (row `j` of the in-order
//! loader at position 0 is window `j`), an epoch's order is a permutation of
//! them drawn from the seed and the epoch number, and a step takes the next
//! `B·W` windows of it, rank `r` the `B` from `r·B` on. The position is
//! still `T` tokens per window taken, so the state, the wrap (fewer than
//! `B·W` windows left) and the sharding invariant are as above; with the
//! identity for an order it is the in-order loader.

use crate::data::tokens::Tokens;

use serde::{Deserialize, Serialize};

use crate::config::Gpt2Config;
use crate::data::source::{check_run, TokenSource};
use crate::error::{Gpt2Error, Result};

/// Where a [`DataLoader`] is: everything needed to resume it. Identical on every
/// rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub struct LoaderState {
    /// Global token offset where the next step starts (before any wrap).
    pub position: usize,
    /// How many times the data has wrapped around.
    pub epoch: u64,
}

/// One rank's batch: `inputs` and `targets`, each `(B, T)` row-major, with
/// `targets[b][t] = inputs[b][t + 1]` in the underlying stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    /// `(B, T)` input token ids.
    pub inputs: Vec<u32>,
    /// `(B, T)` target token ids (the next token of each input).
    pub targets: Vec<u32>,
    /// `B`.
    pub batch_size: usize,
    /// `T`.
    pub seq_len: usize,
}

/// Sharded, deterministic, resumable batches for data-parallel training (see the
/// module docs for the sharding invariant).
#[derive(Debug, Clone)]
pub struct DataLoader {
    tokens: Tokens,
    origin: String,
    batch_size: usize,
    seq_len: usize,
    rank: usize,
    world_size: usize,
    state: LoaderState,
    /// Shuffled: the seed, and the order of an epoch's windows.
    shuffle: Option<Shuffle>,
    /// The vocabulary every window read is checked against
    /// ([`checking_ids`](Self::checking_ids)).
    vocab: Option<usize>,
    /// Batches per step ([`micro_batches`](Self::micro_batches)), and how
    /// many of the current step's have been read.
    micro: usize,
    taken: usize,
}

/// A source of at most this many tokens (512 MiB of them) is checked
/// against the vocabulary whole when [`DataLoader::for_config`] makes a
/// loader, so that a bad id is reported before training; a larger one
/// (memory-mapped shards of billions of tokens, which that scan would read
/// in full before the first step) only window by window, as its batches
/// read them ([`DataLoader::checking_ids`]).
pub const UPFRONT_VOCAB_CHECK: usize = 1 << 28;

/// A shuffled loader's seed, and the epoch whose window order it holds.
#[derive(Debug, Clone)]
struct Shuffle {
    seed: u64,
    order: Option<(u64, Vec<u32>)>,
}

impl DataLoader {
    /// A loader for rank `rank` of `world_size`, with per-rank batch `batch_size`
    /// and sequence length `seq_len`, starting at the beginning of `source`.
    pub fn new(
        source: &TokenSource,
        batch_size: usize,
        seq_len: usize,
        rank: usize,
        world_size: usize,
    ) -> Result<Self> {
        let invalid = |reason: String| Err(Gpt2Error::InvalidLoader { reason });
        if batch_size == 0 || seq_len == 0 {
            return invalid(format!(
                "batch size ({batch_size}) and sequence length ({seq_len}) must be positive"
            ));
        }
        if world_size == 0 || rank >= world_size {
            return invalid(format!("rank {rank} is not below world size {world_size}"));
        }
        DataLoader {
            tokens: source.stream(),
            origin: source.origin().to_string(),
            batch_size,
            seq_len,
            rank,
            world_size,
            state: LoaderState::default(),
            shuffle: None,
            vocab: None,
            micro: 1,
            taken: 0,
        }
        .micro_batches(1)
    }

    /// This loader reading `n` batches a step (gradient accumulation), the
    /// wrap decided once a step (module docs). An error if the data holds
    /// fewer than the step's `n·B·W·T + 1` tokens (or that count overflows),
    /// or for `n = 0`.
    pub fn micro_batches(mut self, n: usize) -> Result<Self> {
        if n == 0 {
            return Err(Gpt2Error::InvalidLoader {
                reason: "micro-batches per step must be positive, not 0".into(),
            });
        }
        let needed = self
            .batch_size
            .checked_mul(self.world_size)
            .and_then(|x| x.checked_mul(self.seq_len))
            .and_then(|x| x.checked_mul(n))
            .and_then(|x| x.checked_add(1))
            .ok_or_else(|| Gpt2Error::InvalidLoader {
                reason: format!(
                    "{}batch size x world size x sequence length overflows",
                    if n > 1 {
                        format!("{n} micro-batches x ")
                    } else {
                        String::new()
                    }
                ),
            })?;
        if self.tokens.len() < needed {
            return Err(Gpt2Error::DatasetTooSmall {
                origin: self.origin,
                tokens: self.tokens.len(),
                needed,
                micro_batches: n,
                batch_size: self.batch_size,
                seq_len: self.seq_len,
                world_size: self.world_size,
            });
        }
        self.micro = n;
        self.taken = 0;
        Ok(self)
    }

    /// Checks every window a batch reads against a vocabulary of `vocab`
    /// ids: a batch with an id outside it is an error naming the id, its
    /// position and the data, and the loader stays where it was.
    pub fn checking_ids(mut self, vocab: usize) -> Self {
        self.vocab = Some(vocab);
        self
    }

    /// This loader taking the windows of each epoch in an order drawn from
    /// `seed` and the epoch (module docs, "Shuffled").
    pub fn shuffled(mut self, seed: u64) -> Self {
        self.shuffle = Some(Shuffle { seed, order: None });
        self
    }

    /// The order of epoch `epoch`'s windows for `seed`: a Fisher–Yates
    /// shuffle of `0..n` by a generator seeded from both. Windows are
    /// numbered in `u32` (4 bytes each, held for the epoch): more than
    /// `u32::MAX` of them are refused, not wrapped.
    fn window_order(seed: u64, epoch: u64, n: usize) -> Result<Vec<u32>> {
        let Ok(last) = u32::try_from(n) else {
            return Err(Gpt2Error::InvalidLoader {
                reason: format!(
                    "shuffling {n} windows: at most {} can be shuffled (their order takes 4 \
                     bytes each); use a longer --seq-len, or shards shuffled beforehand without \
                     --shuffle",
                    u32::MAX
                ),
            });
        };
        let mut rng = crate::rng::Rng::new(crate::rng::Rng::derived_seed(seed, epoch));
        let mut order: Vec<u32> = (0..last).collect();
        for i in (1..n).rev() {
            // Multiply-shift: an index in 0..=i (bias below 2^-32 here).
            let j = ((u128::from(rng.next_u64()) * (i as u128 + 1)) >> 64) as usize;
            order.swap(i, j);
        }
        Ok(order)
    }

    /// [`new`](Self::new) for training `cfg`: also checks that
    /// `seq_len <= cfg.max_seq_len`, and that every token id is below
    /// `cfg.vocab_size` (the error names the id and its position): the
    /// whole source now if it holds at most [`UPFRONT_VOCAB_CHECK`] tokens,
    /// and every window as batches read it ([`checking_ids`](Self::checking_ids)).
    pub fn for_config(
        source: &TokenSource,
        cfg: &Gpt2Config,
        batch_size: usize,
        seq_len: usize,
        rank: usize,
        world_size: usize,
    ) -> Result<Self> {
        if seq_len > cfg.max_seq_len {
            return Err(Gpt2Error::InvalidLoader {
                reason: format!(
                    "sequence length {seq_len} exceeds the model's max_seq_len {}",
                    cfg.max_seq_len
                ),
            });
        }
        if source.len() <= UPFRONT_VOCAB_CHECK {
            source.check_vocab(cfg.vocab_size)?;
        }
        Ok(Self::new(source, batch_size, seq_len, rank, world_size)?.checking_ids(cfg.vocab_size))
    }

    /// Per-rank batch size `B`.
    pub fn batch_size(&self) -> usize {
        self.batch_size
    }

    /// Sequence length `T`.
    pub fn seq_len(&self) -> usize {
        self.seq_len
    }

    /// This loader's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// Where the tokens came from.
    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// Tokens consumed per step by all ranks together, `N·B·W·T` (`N`
    /// micro-batches).
    pub fn tokens_per_step(&self) -> usize {
        self.micro * self.batch_size * self.world_size * self.seq_len
    }

    /// Steps in one pass over the data before it wraps.
    pub fn steps_per_epoch(&self) -> usize {
        (self.tokens.len() - 1) / self.tokens_per_step()
    }

    /// The state to save for resuming.
    pub fn state(&self) -> LoaderState {
        self.state
    }

    /// Restores a saved state. The position must lie within the data; it need not
    /// be a multiple of the step size (a run may resume with another world size).
    pub fn set_state(&mut self, state: LoaderState) -> Result<()> {
        if state.position > self.tokens.len() {
            return Err(Gpt2Error::BadLoaderPosition {
                position: state.position,
                tokens: self.tokens.len(),
            });
        }
        self.state = state;
        self.taken = 0;
        Ok(())
    }

    /// Back to the start of the data, epoch 0.
    pub fn reset(&mut self) {
        self.state = LoaderState::default();
        self.taken = 0;
    }

    /// Fills `inputs` and `targets` (each `B·T` long) with this rank's next
    /// batch (with micro-batches, the next one of the step).
    /// [`state`](Self::state) is resumable between steps: after the last
    /// micro-batch of one.
    pub fn next_batch_into(&mut self, inputs: &mut [u32], targets: &mut [u32]) -> Result<()> {
        let bt = self.batch_size * self.seq_len;
        if inputs.len() != bt || targets.len() != bt {
            return Err(Gpt2Error::InvalidLoader {
                reason: format!(
                    "batch buffers hold {} inputs and {} targets, expected B*T = {bt} each",
                    inputs.len(),
                    targets.len()
                ),
            });
        }
        let step = self.batch_size * self.world_size * self.seq_len;
        let before = self.state;
        if self.taken == 0 && self.state.position + self.tokens_per_step() + 1 > self.tokens.len() {
            self.state.position = 0;
            self.state.epoch += 1;
        }
        // Row `b` of this rank is row `first + b` of the step: in order the
        // `T + 1` tokens from `position + (first + b)·T`, shuffled the
        // window the epoch's order puts there.
        let (t, at, first) = (
            self.seq_len,
            self.state.position,
            self.rank * self.batch_size,
        );
        let order = match &mut self.shuffle {
            None => None,
            Some(Shuffle { seed, order }) => {
                let epoch = self.state.epoch;
                if order.as_ref().is_none_or(|(e, _)| *e != epoch) {
                    let n = (self.tokens.len() - 1) / t;
                    let o = Self::window_order(*seed, epoch, n);
                    *order = Some((epoch, o.inspect_err(|_| self.state = before)?));
                }
                order.as_ref().map(|(_, o)| o.as_slice())
            }
        };
        let rows = inputs.chunks_exact_mut(t).zip(targets.chunks_exact_mut(t));
        let mut window = vec![0u16; t + 1];
        for (b, (xs, ys)) in rows.enumerate() {
            let start = match order {
                None => at + (first + b) * t,
                Some(o) => o[at / t + first + b] as usize * t,
            };
            self.tokens.read(start, &mut window);
            if let Some(vocab_size) = self.vocab {
                if let Err(e) = check_run(&self.origin, &window, start, vocab_size) {
                    self.state = before;
                    return Err(e);
                }
            }
            for (i, (x, y)) in xs.iter_mut().zip(ys.iter_mut()).enumerate() {
                *x = u32::from(window[i]);
                *y = u32::from(window[i + 1]);
            }
        }
        self.state.position += step;
        self.taken = (self.taken + 1) % self.micro;
        Ok(())
    }

    /// This rank's next batch; the errors of
    /// [`next_batch_into`](Self::next_batch_into) (a token id past the
    /// vocabulary of [`checking_ids`](Self::checking_ids), too many windows
    /// to shuffle), after which the loader is where it was.
    pub fn next_batch(&mut self) -> Result<Batch> {
        let bt = self.batch_size * self.seq_len;
        let mut inputs = vec![0; bt];
        let mut targets = vec![0; bt];
        self.next_batch_into(&mut inputs, &mut targets)?;
        Ok(Batch {
            inputs,
            targets,
            batch_size: self.batch_size,
            seq_len: self.seq_len,
        })
    }
}

/// One evaluation window: `inputs` are tokens `i·T .. i·T+T-1` and `targets`
/// tokens `i·T+1 .. i·T+T`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EvalWindow {
    /// Window index `i`.
    pub index: usize,
    /// `(T)` input ids.
    pub inputs: Vec<u32>,
    /// `(T)` target ids.
    pub targets: Vec<u32>,
}

/// Consecutive, non-overlapping evaluation windows over a token stream; see
/// [`eval_windows`].
#[derive(Debug, Clone)]
pub struct EvalWindows {
    tokens: Tokens,
    seq_len: usize,
    next: usize,
    count: usize,
}

/// Iterates over the `(len - 1) / T` windows of `source`: window `i` has inputs
/// `i·T .. i·T+T-1` and targets `i·T+1 .. i·T+T`, so every token after the first
/// is predicted once. A trailing partial window is skipped. `seq_len` must be
/// positive.
pub fn eval_windows(source: &TokenSource, seq_len: usize) -> Result<EvalWindows> {
    if seq_len == 0 {
        return Err(Gpt2Error::InvalidLoader {
            reason: "evaluation sequence length must be positive".into(),
        });
    }
    let count = source.len().saturating_sub(1) / seq_len;
    Ok(EvalWindows {
        tokens: source.stream(),
        seq_len,
        next: 0,
        count,
    })
}

impl EvalWindows {
    /// Total number of windows.
    pub fn num_windows(&self) -> usize {
        self.count
    }
}

impl Iterator for EvalWindows {
    type Item = EvalWindow;

    fn next(&mut self) -> Option<EvalWindow> {
        if self.next >= self.count {
            return None;
        }
        let i = self.next;
        self.next += 1;
        let t = self.seq_len;
        let mut w = vec![0u16; t + 1];
        self.tokens.read(i * t, &mut w);
        Some(EvalWindow {
            index: i,
            inputs: w[..t].iter().map(|&x| u32::from(x)).collect(),
            targets: w[1..].iter().map(|&x| u32::from(x)).collect(),
        })
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let n = self.count - self.next;
        (n, Some(n))
    }
}

impl ExactSizeIterator for EvalWindows {}

#[cfg(test)]
mod tests {
    use super::*;

    /// More windows than `u32` numbers are refused (before any memory is
    /// taken for them), not wrapped into a short order; the largest count
    /// that fits is a permutation.
    #[test]
    fn window_orders_past_u32_are_refused() {
        let e = DataLoader::window_order(1, 0, u32::MAX as usize + 1).unwrap_err();
        assert!(e.to_string().contains("4294967296 windows"), "{e}");
        let mut o = DataLoader::window_order(1, 0, 1000).unwrap();
        o.sort_unstable();
        assert!(o.iter().copied().eq(0..1000));
    }
}

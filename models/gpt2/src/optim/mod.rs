//! AdamW with decoupled weight decay and global-norm gradient clipping, as
//! tasks.
//!
//! The parameters are split into fixed chunks (by default the model's
//! [`param_groups`](crate::model::Gpt2Model::param_groups); on the CPU,
//! large ones cut to at most [`MAX_CHUNK`] elements, see
//! [`AdamW::for_model`]). One step submits
//!
//! ```text
//! grad sumsq i   read grads[i]       write partials[i] (f64)                  one per chunk
//! clip scale     read partials       write scale = min(1, max/(norm+1e-6))    when clipping
//! adamw i        read scale, grads[i]   read_write params[i], m[i], v[i]      one per chunk
//! ```
//!
//! (the tasks of [`kernels::norm`](crate::kernels::norm) and
//! [`kernels::adamw`](crate::kernels::adamw)).
//!
//! The update multiplies each gradient by the clip factor as it reads it
//! (the products `scale_in_place` would form) and leaves `grads` as the
//! backward pass and the all-reduces left them. The sum-of-squares tasks
//! also declare a small per-chunk scratch (`write`) that a GPU reduction
//! needs and the CPU does not touch, so the graph is the same on every
//! backend.
//!
//! A chunk's sum of squares starts as soon as every task writing its gradients
//! (backward, and in data-parallel training the bucket all-reduces) is done, so
//! most of the norm is computed under the rest of the backward pass; the
//! update tasks are independent of each other and spread over the streams.
//!
//! The chunks are fixed by the layout, never by the gradient buckets (which
//! are rebuilt after the first step), so the partial sums, and hence every
//! result, do not depend on the bucketing: a resumed run is bit-identical to
//! an uninterrupted one. The norm sums the per-chunk `f64` partials in chunk
//! order, where the sequential reference sums all squares in one pass: the two
//! norms agree to `f64` rounding, and the clip factors (rounded to `f32`)
//! almost always bit for bit.
//!
//! # Sharded (ZeRO-1)
//!
//! [`AdamW::sharded`] (`zero.rs`) keeps state for a rank's shard only: its
//! update chunks cover the ranges it owns, the moments are packed (shard
//! order, `1/world` of the parameters), its sums of squares cover each
//! element once across the ranks, and [`AdamW::clip_sharded`] all-gathers
//! the partials before the clip factor, so the norm stays global and every
//! rank sums the same partials in the same order. Its chunks follow the
//! reducer's final buckets (cut at [`MAX_CHUNK`]) instead of the parameter
//! groups; those depend only on the program and the number of ranks, so a
//! run resumed at the same rank count is still bit-identical.

mod decay;
mod schedule;
mod zero;

pub use decay::DecayOn;
pub use schedule::LrSchedule;

use std::ops::Range;

use braid::{Buffer, Priority, Runtime};

use crate::checkpoint::AdamWHyper;
use crate::error::{Gpt2Error, Result};
use crate::kernels::adamw::StepArg;
use crate::kernels::storage::Dtype;
use crate::kernels::task::Task;
use crate::kernels::{adamw, fill, norm};
use crate::model::Gpt2Model;

/// The largest chunk (in elements) of one sum-of-squares or update task on
/// the CPU ([`AdamW::for_model`]).
pub const MAX_CHUNK: usize = 1 << 20;

/// `f64` partial sums a GPU sum-of-squares kernel writes per chunk (a fixed
/// count, so the summation order is fixed too).
pub const NORM_SCRATCH: usize = 512;

/// The optimizer: AdamW state on a runtime, and the tasks of one step.
#[derive(Debug)]
pub struct AdamW {
    /// The hyper-parameters, `learning_rate` that of the current step.
    hyper: AdamWHyper,
    /// The rate `schedule` scales (`set_learning_rate`).
    peak_lr: f32,
    schedule: LrSchedule,
    max_grad_norm: Option<f32>,
    n: usize,
    /// Update chunks (element ranges of the parameters), in order.
    chunks: Vec<Range<usize>>,
    /// Where each update chunk's moments start in `m` and `v`.
    state_at: Vec<usize>,
    /// Whether each update chunk decays its parameters (empty: all do;
    /// [`decaying_only`](Self::decaying_only)).
    decays: Vec<bool>,
    /// `(3)` f32: the step scalars of the chunks that do not decay (the
    /// third, `1 − lr·weight_decay`, is 1), once some do not.
    no_decay_scalars: Option<Buffer>,
    /// Sum-of-squares chunks and the partial slot each writes.
    norm_chunks: Vec<(Range<usize>, usize)>,
    /// Sharded: the rank's ranges, partials per rank, the bucket shards.
    shard: Option<zero::Shard>,
    /// `(state)` f32 each: the moments of the updated chunks, packed.
    m: Buffer,
    v: Buffer,
    /// `(slots)` f64: the chunks' sums of squares (every rank's, sharded).
    partials: Buffer,
    /// `(norm chunks, NORM_SCRATCH)` f64: device scratch of the sums of squares.
    scratch: Buffer,
    /// `(1)` f32: the clip factor.
    scale: Buffer,
    /// `(3)` f32: the step scalars a recorded update reads
    /// ([`advance`](Self::advance), [`update_recorded`](Self::update_recorded)).
    step_scalars: Buffer,
    /// The step whose scalars `step_scalars` holds (0: none written yet).
    scalars_step: u64,
    step: u64,
    /// The storage type of the parameters and gradients it is given.
    dtype: Dtype,
    /// The `f32` master weights it updates when `dtype` is not `f32`: the
    /// model's, in layout order, or (sharded, [`storing`](Self::storing))
    /// its own copy of the ranges it owns, packed like the moments (indexed
    /// by `state_at`; [`owns_master`](Self::owns_master)).
    master: Option<Buffer>,
}

impl AdamW {
    /// An optimizer for `n` parameters updated in `chunks` (element ranges
    /// that partition `0..n`, in order), with zero moments at step 0.
    /// `max_grad_norm` clips the global gradient norm (PyTorch's
    /// `clip_grad_norm_`); `None` never clips.
    pub fn new(
        rt: &Runtime,
        n: usize,
        chunks: Vec<Range<usize>>,
        hyper: AdamWHyper,
        max_grad_norm: Option<f32>,
    ) -> Result<Self> {
        let mut at = 0;
        for c in &chunks {
            if c.start != at || c.end <= c.start {
                return Err(Gpt2Error::InvalidSetting {
                    what: "optimizer chunks",
                    reason: format!("chunk {c:?} does not continue at element {at}"),
                });
            }
            at = c.end;
        }
        if at != n {
            return Err(Gpt2Error::InvalidSetting {
                what: "optimizer chunks",
                reason: format!("the chunks cover {at} of {n} parameters"),
            });
        }
        check_max_norm(max_grad_norm)?;
        let norm_chunks = chunks
            .iter()
            .cloned()
            .enumerate()
            .map(|(i, c)| (c, i))
            .collect();
        Self::build(rt, n, chunks, norm_chunks, None, hyper, max_grad_norm)
    }

    /// The optimizer with its state allocated: `chunks` are updated, with
    /// their moments packed in order; `norm_chunks` summed into their slots.
    fn build(
        rt: &Runtime,
        n: usize,
        chunks: Vec<Range<usize>>,
        norm_chunks: Vec<(Range<usize>, usize)>,
        shard: Option<zero::Shard>,
        hyper: AdamWHyper,
        max_grad_norm: Option<f32>,
    ) -> Result<Self> {
        let mut state_at = Vec::with_capacity(chunks.len());
        let mut state = 0;
        for c in &chunks {
            state_at.push(state);
            state += c.len();
        }
        let slots = match &shard {
            Some(s) => s.slots_per_rank * s.world,
            None => norm_chunks.len(),
        };
        Ok(AdamW {
            hyper,
            peak_lr: hyper.learning_rate,
            schedule: LrSchedule::constant(),
            max_grad_norm,
            n,
            m: rt.alloc("adam_m", state * 4)?,
            v: rt.alloc("adam_v", state * 4)?,
            partials: rt.alloc("grad norm partials", slots.max(1) * 8)?,
            scratch: rt.alloc(
                "grad norm scratch",
                norm_chunks.len().max(1) * NORM_SCRATCH * 8,
            )?,
            scale: rt.alloc("clip scale", 4)?,
            step_scalars: rt.alloc("adamw step scalars", 12)?,
            scalars_step: 0,
            chunks,
            state_at,
            decays: Vec::new(),
            no_decay_scalars: None,
            norm_chunks,
            shard,
            step: 0,
            dtype: Dtype::F32,
            master: None,
        })
    }

    /// An optimizer for `model`'s parameters, chunked by its parameter groups
    /// (cut to at most [`MAX_CHUNK`] elements). For a model that stores
    /// another type than `f32` ([`Gpt2Model::dtype`]) it updates the model's
    /// `f32` master weights ([`Gpt2Model::master`]) from the stored
    /// gradients and rounds them into the stored parameters (llm.c's mixed
    /// precision); the moments are `f32` either way.
    ///
    /// The chunks: on the CPU the groups cut to at most [`MAX_CHUNK`]
    /// elements, which the placement spreads over the compute streams; on a
    /// GPU the groups whole (15 for GPT-2 124M instead of 123), since there
    /// a chunk is one launch of a memory-bound kernel. In run 6 (H100,
    /// docs/gpu-validation.md) the 123 update chunks took 14.7 µs each
    /// against about 9 µs of memory traffic, every one of them after the
    /// clip factor, and the 37 sums of squares of `wte`'s chunks, complete
    /// last, ran one after another at the end of the step. The update is
    /// elementwise, so its results do not depend on the chunks; the norm's
    /// `f64` partials are grouped by them (the same every step).
    pub fn for_model(
        rt: &Runtime,
        model: &Gpt2Model,
        hyper: AdamWHyper,
        max_grad_norm: Option<f32>,
    ) -> Result<Self> {
        let chunks = chunks_for(model.param_groups(), rt.cuda_device().is_some());
        let opt = Self::new(rt, model.layout().total, chunks, hyper, max_grad_norm)?;
        opt.storing(rt, model)
    }

    /// This optimizer, updating `model`'s parameters as the model stores
    /// them: for a model that stores another type than `f32`, `f32` master
    /// weights, rounded into the stored parameters. Unsharded, those are the
    /// model's ([`Gpt2Model::master`]). Sharded (ZeRO-1), the optimizer
    /// keeps its own copy of the ranges it owns, packed like the moments
    /// (`1/world` of them; copied from the model's now, by tasks), so the
    /// model's full copy can be released ([`Gpt2Model::release_master`],
    /// when [`owns_master`](Self::owns_master)); [`gather_master`](Self::gather_master)
    /// gives the full master weights back.
    pub fn storing(mut self, rt: &Runtime, model: &Gpt2Model) -> Result<Self> {
        self.dtype = model.dtype();
        self.master = match (model.master(), &self.shard) {
            (Some(full), Some(_)) => {
                let packed = rt.alloc("master shard", self.m.len())?;
                for (i, (c, &at)) in self.chunks.iter().zip(&self.state_at).enumerate() {
                    fill::copy(
                        rt.task(format!("master shard {i}")),
                        &full.view_of::<f32>(c.clone())?,
                        &packed.view_of::<f32>(at..at + c.len())?,
                    )?;
                }
                Some(packed)
            }
            (full, _) => full.cloned(),
        };
        Ok(self)
    }

    /// Whether the optimizer keeps its own (sharded) master weights, so the
    /// model's copy is not needed ([`storing`](Self::storing)).
    pub fn owns_master(&self) -> bool {
        self.shard.is_some() && self.master.is_some()
    }

    /// The hyper-parameters.
    pub fn hyper(&self) -> &AdamWHyper {
        &self.hyper
    }

    /// Changes the learning rate of later steps (with a schedule, the peak
    /// rate it scales).
    pub fn set_learning_rate(&mut self, lr: f32) {
        self.peak_lr = lr;
        self.hyper.learning_rate = lr;
    }

    /// Follows `schedule` from the next step on: each step's rate is the
    /// schedule's for its number and the peak rate (the hyper-parameters'
    /// at construction, or the last [`set_learning_rate`](Self::set_learning_rate)).
    pub fn with_schedule(mut self, schedule: LrSchedule) -> Result<Self> {
        schedule.check()?;
        self.schedule = schedule;
        Ok(self)
    }

    /// Counts a step and sets its learning rate from the schedule.
    fn next_step(&mut self) {
        self.step += 1;
        self.hyper.learning_rate = self.schedule.rate(self.peak_lr, self.step);
    }

    /// The clipping threshold.
    pub fn max_grad_norm(&self) -> Option<f32> {
        self.max_grad_norm
    }

    /// Steps taken so far (AdamW's `t` of the last step).
    pub fn steps(&self) -> u64 {
        self.step
    }

    /// The update chunks.
    pub fn chunks(&self) -> &[Range<usize>] {
        &self.chunks
    }

    /// Whether the state covers one rank's shard only ([`AdamW::sharded`]).
    pub fn is_sharded(&self) -> bool {
        self.shard.is_some()
    }

    /// Bytes of optimizer state on this rank's device: the two `f32`
    /// moments of the elements it updates (all of them, or its shard), and
    /// the `f32` master weights it keeps itself (sharded mixed precision;
    /// unsharded, they are the model's and not counted here).
    pub fn state_bytes(&self) -> usize {
        let master = match (self.owns_master(), &self.master) {
            (true, Some(m)) => m.len(),
            _ => 0,
        };
        self.m.len() + self.v.len() + master
    }

    /// Restores the moments and the step count from full moments in layout
    /// order (a checkpoint's), taking the chunks this optimizer updates.
    pub fn load_state(&mut self, rt: &Runtime, m: &[f32], v: &[f32], step: u64) -> Result<()> {
        for (what, x) in [("adam_m", m), ("adam_v", v)] {
            if x.len() != self.n {
                return Err(Gpt2Error::LengthMismatch {
                    what: what.into(),
                    expected: self.n,
                    found: x.len(),
                });
            }
        }
        let pack = |x: &[f32]| -> Vec<f32> {
            self.chunks
                .iter()
                .flat_map(|c| x[c.clone()].iter().copied())
                .collect()
        };
        rt.upload(&self.m, &pack(m))?;
        rt.upload(&self.v, &pack(v))?;
        self.step = step;
        Ok(())
    }

    /// The moments `(m, v)` of the chunks this optimizer updates, packed in
    /// chunk order (unsharded: all of them, in layout order), after every
    /// submitted step. A sharded optimizer's full moments:
    /// [`gather_state`](Self::gather_state).
    pub fn read_state(&self, rt: &Runtime) -> Result<(Vec<f32>, Vec<f32>)> {
        Ok((rt.read_vec(&self.m)?, rt.read_vec(&self.v)?))
    }

    /// The global gradient norm (before clipping) of the last step.
    pub fn read_grad_norm(&self, rt: &Runtime) -> Result<f32> {
        let partials: Vec<f64> = rt.read_vec(&self.partials)?;
        Ok(norm::global_norm(&partials[..self.slots()]) as f32)
    }

    /// The partial sums the norm adds: one per chunk (sharded: every rank's).
    fn slots(&self) -> usize {
        match &self.shard {
            Some(s) => s.slots_per_rank * s.world,
            None => self.norm_chunks.len(),
        }
    }

    fn check_len(&self, what: &str, b: &Buffer) -> Result<()> {
        let es = self.dtype.size();
        if b.len() != self.n * es {
            return Err(Gpt2Error::LengthMismatch {
                what: what.into(),
                expected: self.n,
                found: b.len() / es,
            });
        }
        Ok(())
    }

    /// The view of elements `r` of a parameter or gradient buffer.
    fn elems(&self, b: &Buffer, r: &Range<usize>) -> Result<braid::View> {
        let es = self.dtype.size();
        Ok(b.view(r.start * es..r.end * es)?)
    }

    /// Submits one step: the global norm of `grads`, the clip factor, and the
    /// update of `params` and the moments with the clipped gradients
    /// (`grads` is left as it is). Returns at once. The same as
    /// [`clip`](Self::clip) then [`update`](Self::update).
    pub fn step(&mut self, rt: &Runtime, params: &Buffer, grads: &Buffer) -> Result<()> {
        self.clip(rt, grads)?;
        self.update(rt, params, grads)
    }

    /// Submits the first half of a step: the global norm of `grads` and the
    /// clip factor. Its tasks are the same every step (no step number), so a
    /// recorded training step can hold them, each then waiting only for the
    /// gradients it reads.
    pub fn clip(&mut self, rt: &Runtime, grads: &Buffer) -> Result<()> {
        if self.shard.is_some() {
            return Err(Gpt2Error::InvalidSetting {
                what: "optimizer",
                reason: "a sharded optimizer's norm needs every rank's partial sums: \
                         use clip_sharded"
                    .into(),
            });
        }
        self.sum_squares(rt, grads)?;
        self.clip_factor(rt)
    }

    /// Submits this rank's sums of squares, each into its slot.
    fn sum_squares(&self, rt: &Runtime, grads: &Buffer) -> Result<()> {
        self.check_len("grads", grads)?;
        // The norm is computed even without clipping, for logging. Chunks are
        // visited last layer first: the order in which the backward pass
        // (and a data-parallel reducer) finishes their gradients, so on a
        // stream that runs tasks in order, the early chunks' sums run while
        // the last gradients are still being reduced, instead of waiting
        // behind the first chunk (the embeddings, complete last). Each sum
        // goes to its own slot, and the norm adds the slots in chunk order:
        // the results do not depend on this order.
        for (i, (c, slot)) in self.norm_chunks.iter().enumerate().rev() {
            norm::sum_squares(
                Task::new(rt.task(format!("grad sumsq {i}")), self.dtype).priority(Priority::Side),
                &self.partials.view_of::<f64>(*slot..slot + 1)?,
                &self
                    .scratch
                    .view_of::<f64>(i * NORM_SCRATCH..(i + 1) * NORM_SCRATCH)?,
                &self.elems(grads, c)?,
            )?;
        }
        Ok(())
    }

    /// Submits the clip factor from every partial sum (when clipping).
    fn clip_factor(&self, rt: &Runtime) -> Result<()> {
        if let Some(max_norm) = self.max_grad_norm {
            let partials = self.partials.view_of::<f64>(0..self.slots())?;
            norm::clip_factor(
                rt.task("clip scale"),
                &self.scale.whole(),
                &partials,
                max_norm,
            )?;
        }
        Ok(())
    }

    /// Submits the second half of a step: the AdamW update of `params` and
    /// the moments with the gradients scaled by the factor of the last
    /// [`clip`](Self::clip). The step number is a kernel argument, fixed at
    /// submission: for an update inside a recorded step use
    /// [`advance`](Self::advance) and [`update_recorded`](Self::update_recorded).
    pub fn update(&mut self, rt: &Runtime, params: &Buffer, grads: &Buffer) -> Result<()> {
        self.next_step();
        self.submit_update(rt, params, grads, StepArg::Number(self.step), None)
    }

    /// Counts a step and submits a task that writes its scalars (learning
    /// rate and bias corrections) into the optimizer's step-scalars buffer,
    /// which [`update_recorded`](Self::update_recorded) reads. Call it
    /// outside a recording, before each run of the recorded step (the
    /// recording run too): `advance(rt)`, then record or replay.
    pub fn advance(&mut self, rt: &Runtime) -> Result<()> {
        self.next_step();
        let scalars = adamw::step_scalars(self.step, self.hyper);
        rt.upload_named("adamw step scalars", &self.step_scalars, &scalars)?;
        if let Some(b) = &self.no_decay_scalars {
            let scalars = adamw::step_scalars(self.step, self.no_decay_hyper());
            rt.upload_named("adamw step scalars (no decay)", b, &scalars)?;
        }
        self.scalars_step = self.step;
        Ok(())
    }

    /// Submits the update as [`update`](Self::update) does, but with the
    /// step's scalars read from the buffer the last [`advance`](Self::advance)
    /// wrote: tasks that are the same every step, so a recorded training
    /// step can hold them (each replay updates with the values `advance`
    /// wrote before it). Bit for bit the same update as `update`.
    pub fn update_recorded(&mut self, rt: &Runtime, params: &Buffer, grads: &Buffer) -> Result<()> {
        // The buffer must hold this step's scalars: not before the first
        // `advance`, nor after `load_state` moved the step without one.
        if self.scalars_step == 0 || self.scalars_step != self.step {
            return Err(Gpt2Error::InvalidSetting {
                what: "optimizer",
                reason: format!(
                    "update_recorded at step {} without an advance to it: the step scalars \
                     are unset or another step's",
                    self.step
                ),
            });
        }
        let scalars = self.step_scalars.whole();
        let no_decay = self.no_decay_scalars.as_ref().map(Buffer::whole);
        let no_decay = no_decay.as_ref().map(StepArg::Scalars);
        self.submit_update(rt, params, grads, StepArg::Scalars(&scalars), no_decay)
    }

    /// The hyper-parameters of the chunks that do not decay.
    fn no_decay_hyper(&self) -> AdamWHyper {
        AdamWHyper {
            weight_decay: 0.0,
            ..self.hyper
        }
    }

    /// The update tasks of one step, chunk by chunk; the chunks that do not
    /// decay read their scalars from `no_decay` (else from `step`'s number,
    /// with a weight decay of 0).
    fn submit_update(
        &self,
        rt: &Runtime,
        params: &Buffer,
        grads: &Buffer,
        step: StepArg<'_>,
        no_decay: Option<StepArg<'_>>,
    ) -> Result<()> {
        self.check_len("params", params)?;
        self.check_len("grads", grads)?;
        let scale = self.scale.whole();
        for (i, c) in self.chunks.iter().enumerate().rev() {
            let s = self.state_at[i]..self.state_at[i] + c.len();
            let (step, hyper) = match self.chunk_decays(i) {
                true => (step, self.hyper),
                false => (no_decay.unwrap_or(step), self.no_decay_hyper()),
            };
            if let Some(master) = &self.master {
                let at = if self.owns_master() {
                    s.clone()
                } else {
                    c.clone()
                };
                adamw::update_mixed(
                    Task::new(rt.task(format!("adamw {i}")), self.dtype),
                    &self.elems(params, c)?,
                    &master.view_of::<f32>(at)?,
                    &self.elems(grads, c)?,
                    &self.m.view_of::<f32>(s.clone())?,
                    &self.v.view_of::<f32>(s)?,
                    self.max_grad_norm.map(|_| &scale),
                    step,
                    hyper,
                )?;
                continue;
            }
            adamw::update(
                rt.task(format!("adamw {i}")),
                &params.view_of::<f32>(c.clone())?,
                &grads.view_of::<f32>(c.clone())?,
                &self.m.view_of::<f32>(s.clone())?,
                &self.v.view_of::<f32>(s)?,
                self.max_grad_norm.map(|_| &scale),
                step,
                hyper,
            )?;
        }
        Ok(())
    }
}

/// Checks a clipping threshold.
fn check_max_norm(max_grad_norm: Option<f32>) -> Result<()> {
    match max_grad_norm {
        Some(m) if !(m > 0.0 && m.is_finite()) => Err(Gpt2Error::InvalidSetting {
            what: "max gradient norm",
            reason: format!("{m} is not a positive number"),
        }),
        _ => Ok(()),
    }
}

/// The optimizer's chunks of the parameter groups `groups`: whole on a GPU,
/// else [`cut`].
fn chunks_for(groups: &[Range<usize>], gpu: bool) -> Vec<Range<usize>> {
    match gpu {
        true => groups.to_vec(),
        false => cut(groups),
    }
}

/// `ranges` cut into chunks of at most [`MAX_CHUNK`] elements, in order.
fn cut(ranges: &[Range<usize>]) -> Vec<Range<usize>> {
    let mut chunks = Vec::new();
    for g in ranges {
        let mut s = g.start;
        while s < g.end {
            let e = (s + MAX_CHUNK).min(g.end);
            chunks.push(s..e);
            s = e;
        }
    }
    chunks
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On a GPU the groups whole; on the CPU cut to at most `MAX_CHUNK`,
    /// in order, covering the same elements.
    #[test]
    fn chunks_are_the_groups_on_a_gpu_and_cut_on_the_cpu() {
        let groups = vec![0..3 * MAX_CHUNK + 5, 3 * MAX_CHUNK + 5..3 * MAX_CHUNK + 9];
        assert_eq!(chunks_for(&groups, true), groups);
        let cpu = chunks_for(&groups, false);
        assert_eq!(cpu.len(), 5);
        assert!(cpu.iter().all(|c| c.len() <= MAX_CHUNK && !c.is_empty()));
        assert!(cpu.windows(2).all(|w| w[0].end == w[1].start));
        assert_eq!((cpu[0].start, cpu[4].end), (0, 3 * MAX_CHUNK + 9));
    }
}

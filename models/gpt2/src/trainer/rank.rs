//! The body of one rank, whichever way it was launched: setup, the training
//! steps, the checkpoints, and what the rank hands back.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use braid::comm::{Bf16, BoundComm, BucketConfig, BucketShard, DType, ReduceOp};
use braid::trace::Profile;
use braid::{Comm, Reducer, Runtime};

use super::{CapReport, StartState, StepReport, TrainOptions};
use crate::checkpoint::{save_checkpoint, Checkpoint};
use crate::data::{DataLoader, TokenSource};
use crate::error::{Gpt2Error, Result};
use crate::model::{Dtype, Gpt2Model};
use crate::optim::AdamW;

/// How a rank's recorded step replayed as graphs.
pub(super) struct GraphOutcome {
    /// Replays launched as one unit (a CUDA graph).
    pub(super) launches: u64,
    /// Why the step is not a graph, if it was refused.
    pub(super) refusal: Option<String>,
    /// `(graphs, tasks between them)`, once it is one.
    pub(super) shape: Option<(usize, usize)>,
    /// Why its collectives are not inside the graphs although asked in.
    pub(super) collectives_left_out: Option<String>,
}

/// What a rank hands back.
pub(super) struct RankOutcome {
    /// The last step: the run's `steps`, or where it was asked to stop.
    pub(super) final_step: u64,
    pub(super) steps: Vec<StepReport>,
    pub(super) params: Option<Vec<f32>>,
    pub(super) hash: u64,
    pub(super) profile: Profile,
    /// When this run's first step had completed (on the spans' timeline),
    /// if more steps followed: the summary of the measured steps starts
    /// there, as the mean step time leaves the first step out.
    pub(super) steady_from: Option<u64>,
    pub(super) checkpoint: Option<PathBuf>,
    /// Bytes of AdamW state on this rank's device.
    pub(super) optimizer_bytes: usize,
    /// Bytes of the model's buffers on this rank's device, its sampler's
    /// included ([`Gpt2Model::device_bytes`]).
    pub(super) model_bytes: usize,
    /// Rank 0, auto bucket cap: what the reducer chose.
    pub(super) bucket_cap: Option<CapReport>,
    /// How the recorded step replayed as graphs.
    pub(super) graphs: GraphOutcome,
    /// What the recorded step's placement trial kept, once decided.
    pub(super) placement_trial: Option<braid::TrialOutcome>,
    /// `(spared, of)`: the SMs this rank's compute kernels left to other
    /// programs, of the device's (`braid::Runtime::spared_sms`).
    pub(super) spared_sms: Option<(u32, u32)>,
}

/// A hash of `x`'s bit patterns, for checking that ranks agree: eight
/// independent lanes over pairs of elements (so the multiplies overlap),
/// folded with the length and the tail. About 6 times faster than the
/// byte-wise FNV-1a it replaced (the `small` model's 7.3M parameters: 4.8
/// against 31 ms on the development VM; scaled to GPT-2 124M, about half a
/// second at the end of every run).
fn hash_f32s(x: &[f32]) -> u64 {
    const LANES: usize = 8;
    fn step(h: u64, w: u64) -> u64 {
        let h = (h ^ w).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        h ^ (h >> 32)
    }
    let mut lanes: [u64; LANES] = std::array::from_fn(|i| i as u64);
    let mut chunks = x.chunks_exact(2 * LANES);
    for c in &mut chunks {
        for (h, pair) in lanes.iter_mut().zip(c.chunks_exact(2)) {
            let w = u64::from(pair[0].to_bits()) | (u64::from(pair[1].to_bits()) << 32);
            *h = step(*h, w);
        }
    }
    let tail = chunks
        .remainder()
        .iter()
        .fold(x.len() as u64, |h, v| step(h, u64::from(v.to_bits())));
    lanes.into_iter().fold(tail, step)
}

/// A step's micro-batches on the device (gradient accumulation,
/// [`TrainOptions::grad_accum`] above 1): `(n, B, T)` token ids and
/// targets, and `(n)` mean losses.
struct MicroBatches {
    tokens: braid::Buffer,
    targets: braid::Buffer,
    losses: braid::Buffer,
}

impl MicroBatches {
    /// Checks and uploads the step's `n` micro-batches (`x`, `y`:
    /// `(n, B, T)`).
    fn upload(&self, rt: &Runtime, x: &[u32], y: &[u32], vocab: usize) -> Result<()> {
        crate::data::check_ids(x, vocab, "tokens")?;
        crate::data::check_ids(y, vocab, "targets")?;
        rt.upload(&self.tokens, x)?;
        rt.upload(&self.targets, y)?;
        Ok(())
    }

    /// Micro-batch `i` of `(n, B, T)` ids in `buf`.
    fn slot(buf: &braid::Buffer, model: &Gpt2Model, i: usize) -> Result<braid::View> {
        let len = model.batch_size() * model.seq_len() * 4;
        Ok(buf.view(i * len..(i + 1) * len)?)
    }

    /// Copies micro-batch `i` into the model (before its forward pass).
    fn copy_in(&self, rt: &Runtime, model: &mut Gpt2Model, i: usize) -> Result<()> {
        let tokens = Self::slot(&self.tokens, model, i)?;
        let targets = Self::slot(&self.targets, model, i)?;
        model.copy_batch(rt, &tokens, &targets)
    }

    /// Keeps micro-batch `i`'s mean loss (after its backward pass).
    fn keep_loss(&self, rt: &Runtime, model: &Gpt2Model, i: usize) -> Result<()> {
        let _s = rt.scope("report");
        let slot = self.losses.view(i * 4..(i + 1) * 4)?;
        let task = rt
            .task("keep micro-batch loss")
            .priority(braid::Priority::Side);
        crate::kernels::fill::copy(task, &model.loss_view(), &slot)?;
        Ok(())
    }

    /// Micro-batch `i` but the last: copied in, forward, `backward`, loss
    /// kept.
    fn pass(
        &self,
        rt: &Runtime,
        model: &mut Gpt2Model,
        i: usize,
        backward: impl FnOnce(&mut Gpt2Model) -> Result<()>,
    ) -> Result<()> {
        {
            let _s = rt.scope("data");
            self.copy_in(rt, model, i)?;
        }
        model.forward_for_backward(rt)?;
        backward(model)?;
        self.keep_loss(rt, model, i)
    }

    /// The step's loss: the mean of its micro-batches' mean losses (each
    /// over as many positions), summed in order.
    fn read_mean_loss(&self, rt: &Runtime) -> Result<f32> {
        let losses = rt.read_vec::<f32>(&self.losses)?;
        let sum: f64 = losses.iter().map(|&l| f64::from(l)).sum();
        Ok((sum / losses.len() as f64) as f32)
    }
}

/// What the ranks of this process share during a run: the profiles of the
/// ranks that failed, kept for the trace of a run that did not finish
/// (`train` writes it where the finished run's would go), and the step at
/// which they stop when asked to ([`TrainOptions::stop`]).
pub(super) struct RunShared {
    failed: Mutex<Vec<(usize, Profile)>>,
    /// The flag of [`TrainOptions::stop`], when this process holds every
    /// rank (else the flag is not honoured).
    stop: Option<Arc<AtomicBool>>,
    /// Set by the run itself (the caller's step callback panicked): the
    /// ranks stop as they do for the flag.
    halt: AtomicBool,
    /// The last step of every rank once the flag is seen (`u64::MAX`: none).
    stop_at: AtomicU64,
}

impl RunShared {
    /// For a run whose ranks are all in this process (`all_here`) or not.
    pub(super) fn new(opts: &TrainOptions, all_here: bool) -> Self {
        RunShared {
            failed: Mutex::new(Vec::new()),
            stop: opts.stop.clone().filter(|_| all_here),
            halt: AtomicBool::new(false),
            stop_at: AtomicU64::new(u64::MAX),
        }
    }

    fn push(&self, rank: usize, p: Profile) {
        self.failed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((rank, p));
    }

    /// Stops the ranks at a step's end, as [`TrainOptions::stop`] does.
    pub(super) fn halt(&self) {
        self.halt.store(true, Ordering::SeqCst);
    }

    /// The profiles kept, in rank order.
    pub(super) fn take(&self) -> Vec<Profile> {
        let mut v = std::mem::take(&mut *self.failed.lock().unwrap_or_else(|p| p.into_inner()));
        v.sort_by_key(|(rank, _)| *rank);
        v.into_iter().map(|(_, p)| p).collect()
    }

    /// Whether the run has been asked to stop ([`TrainOptions::stop`], or a
    /// rank's failure or panic).
    fn asked_to_stop(&self) -> bool {
        self.stop.as_ref().is_some_and(|f| f.load(Ordering::SeqCst))
            || self.halt.load(Ordering::SeqCst)
    }

    /// Whether a rank of `world` that has just finished `step` stops there.
    ///
    /// Every rank stops at the same step. With one rank, that is the step
    /// in which the flag is seen. With several, the first rank to see it
    /// names the next step: no other rank can have finished that step yet,
    /// since it ends with a collective (the loss's all-reduce) that waits
    /// for this rank, which has not submitted it. A rank that checked
    /// before the flag was set finishes the next step and stops there too.
    fn stops_after(&self, step: u64, world: usize) -> bool {
        if self.asked_to_stop() {
            let at = if world > 1 { step + 1 } else { step };
            self.stop_at.fetch_min(at, Ordering::SeqCst);
        }
        step >= self.stop_at.load(Ordering::SeqCst)
    }
}

/// The body of one rank (CPU thread, GPU thread or GPU process) on its
/// runtime `rt`. If it fails and the run writes a trace, the rank's profile
/// so far goes to `failed`.
#[allow(clippy::too_many_arguments)]
pub(super) fn run_rank(
    opts: &TrainOptions,
    rt: Runtime,
    rank: usize,
    world: usize,
    comm: Option<Comm>,
    start: &StartState,
    data: &TokenSource,
    on_step: &(dyn Fn(&StepReport) + Sync),
    shared: &RunShared,
) -> Result<RankOutcome> {
    let out = run_rank_on(opts, &rt, rank, world, comm, start, data, on_step, shared);
    if out.is_err() && opts.trace.is_some() {
        shared.push(rank, rt.profile());
    }
    out
}

#[allow(clippy::too_many_arguments)]
fn run_rank_on(
    opts: &TrainOptions,
    rt: &Runtime,
    rank: usize,
    world: usize,
    comm: Option<Comm>,
    start: &StartState,
    data: &TokenSource,
    on_step: &(dyn Fn(&StepReport) + Sync),
    shared: &RunShared,
) -> Result<RankOutcome> {
    let cfg = opts.model;
    let (b, t) = (opts.batch_size, opts.seq_len);
    let model_opts = crate::model::ModelOptions {
        fusion: opts.fusion,
        dtype: opts.dtype,
        ..Default::default()
    };
    let mut model = Gpt2Model::with_options(rt, &cfg, b, t, model_opts)?;
    {
        let _s = rt.scope("init");
        model.upload_params(rt, &start.params)?;
    }
    if start.moments.is_none() && start.step != 0 {
        return Err(Gpt2Error::InvalidSetting {
            what: "start state",
            reason: format!("step {} without optimizer moments", start.step),
        });
    }
    // `train` checked the data for the model (`DataLoader::for_config`)
    // before any rank started: each rank's loader only checks the windows
    // it reads.
    let mut loader = DataLoader::new(data, b, t, rank, world)?
        .checking_ids(cfg.vocab_size)
        .micro_batches(opts.grad_accum)?;
    if opts.shuffle {
        loader = loader.shuffled(opts.seed);
    }
    loader.set_state(start.loader)?;
    let comm = comm
        .filter(|_| world > 1 || opts.reduce_single_rank)
        .map(|c| c.bind(rt))
        .transpose()?;
    // The tied gradient's two writers, reduced on their own. Set before the
    // reducer is made: the classifier's part is handed over in pieces
    // (`param_specs`).
    model.set_split_tied(comm.is_some() && opts.splits_tied(world))?;
    let mut reducer = match &comm {
        Some(c) => {
            // Every rank starts from rank 0's parameters, as DDP does (with
            // bf16 storage: its master weights and their bf16 copy).
            let grad_dtype = match model.dtype() {
                Dtype::F32 => {
                    c.broadcast::<f32>(&model.params().whole(), 0)?;
                    DType::F32
                }
                Dtype::Bf16 => {
                    let master = model.master().expect("a bf16 model has master weights");
                    c.broadcast::<f32>(&master.whole(), 0)?;
                    c.broadcast::<Bf16>(&model.params().whole(), 0)?;
                    DType::Bf16
                }
            };
            Some(Reducer::new(
                c.clone(),
                model.grads()?,
                model.param_specs(),
                BucketConfig::default()
                    .cap_bytes(opts.bucket_cap_bytes)
                    .auto_cap(opts.auto_bucket_cap)
                    .first_cap_bytes(opts.first_bucket_bytes)
                    .compression(opts.compression.clone())
                    .shard(opts.zero == 1)
                    .dtype(grad_dtype),
            )?)
        }
        None => None,
    };
    // ZeRO-1's optimizer is made once the reducer's buckets are final (right
    // after the first step's `finish`, inside the step), the others now.
    let zero = opts.zero == 1 && reducer.is_some();
    let mut opt = match zero {
        true => None,
        false => Some(new_optimizer(rt, &model, opts, start, None, rank, world)?),
    };
    rt.synchronize()?;
    rt.clear_profile();

    // Gradient accumulation: the step's micro-batches are uploaded at its
    // start (outside a recording, as a single batch is), each copied into
    // the model before its forward pass, and each micro-batch's mean loss
    // kept in a slot of its `losses`.
    let accum = opts.grad_accum;
    let micro = match accum {
        1 => None,
        n => Some(MicroBatches {
            tokens: rt.alloc("micro-batch tokens", n * b * t * 4)?,
            targets: rt.alloc("micro-batch targets", n * b * t * 4)?,
            losses: rt.alloc("micro-batch losses", n * 4)?,
        }),
    };
    let tokens = b * t * world * accum;
    // The sampler of the generation during training, made when first used,
    // and the ranks' barrier after each.
    let mut sampler = None;
    let gen_barrier = match (&opts.generation, &comm) {
        (Some(_), Some(_)) => Some(rt.alloc("generation barrier", 4)?),
        _ => None,
    };
    // The ranks' validation sums, added across them.
    let val_sums = match (&opts.validation, &comm) {
        (Some(_), Some(_)) => Some(rt.alloc("validation sums", 8)?),
        _ => None,
    };
    let (mut x, mut y) = (vec![0u32; accum * b * t], vec![0u32; accum * b * t]);
    let mut steps = Vec::new();
    let mut checkpoint = None;
    // Every rank gathers the state to save (ZeRO-1: collectives); rank 0
    // writes it.
    let write = |model: &Gpt2Model,
                 opt: &AdamW,
                 reducer: Option<&Reducer<'_>>,
                 loader: &DataLoader,
                 step: u64|
     -> Result<Option<PathBuf>> {
        if rank != 0 && !opt.is_sharded() {
            return Ok(None);
        }
        let (params, adam_m, adam_v) = {
            let _s = rt.scope("checkpoint");
            full_state(rt, model, opt, reducer, comm.as_ref())?
        };
        if rank != 0 {
            return Ok(None);
        }
        // A step's loss and norm are of its gradients, before its update:
        // an update that sent a weight to infinity shows in the next step.
        // Such a state is not saved over the last good one.
        if params.iter().any(|x| !x.is_finite()) {
            return Err(Gpt2Error::StateNotFinite { step });
        }
        let dir = opts.checkpoint_dir.as_ref().expect("checked by the caller");
        save_checkpoint(
            dir,
            &Checkpoint {
                config: cfg,
                step,
                params,
                adam_m,
                adam_v,
                optimizer: *opt.hyper(),
                loader: loader.state(),
                rng_state: None,
                extra: opts.checkpoint_extras(world, data),
            },
        )?;
        Ok(Some(dir.clone()))
    };
    // Then every rank waits for rank 0's write, in the checkpoint's scope
    // (as `torch.distributed.barrier()` after a save): left to the next
    // step's first collective, the other ranks' wait for the write counted
    // as communication the summary could not tell from a slow all-reduce.
    let save = |model: &Gpt2Model,
                opt: &AdamW,
                reducer: Option<&Reducer<'_>>,
                loader: &DataLoader,
                step: u64|
     -> Result<Option<PathBuf>> {
        let saved = write(model, opt, reducer, loader, step)?;
        if let Some(c) = comm.as_ref() {
            let _s = rt.scope("checkpoint");
            c.barrier()?.wait()?;
        }
        Ok(saved)
    };
    // Steps after the first two of this run replay the third: by then the
    // reducer's bucket order is rebuilt and every step submits the same tasks.
    let first = start.step + 1;
    let mut schedule = None;
    let mut steady_from = None;
    // The last step of this run: `steps`, or an earlier one if it is asked
    // to stop.
    let mut final_step = opts.steps.max(start.step);
    // A fresh run scores the parameters it starts from (step 0's
    // validation), reported with its first step.
    let mut start_val_loss = match &opts.validation {
        Some(v) if start.step == 0 && first <= final_step => {
            let comm = comm.as_ref().zip(val_sums.as_ref());
            Some(super::validate::validate(
                rt, &mut model, v, comm, rank, world,
            )?)
        }
        _ => None,
    };
    for step in first..=final_step {
        let t0 = Instant::now();
        for (x, y) in x.chunks_exact_mut(b * t).zip(y.chunks_exact_mut(b * t)) {
            loader.next_batch_into(x, y)?;
        }
        {
            let _s = rt.scope("data");
            match &micro {
                None => model.upload_batch(rt, &x, Some(&y))?,
                Some(m) => m.upload(rt, &x, &y, cfg.vocab_size)?,
            }
        }
        if let Some(f) = opts.fault.filter(|f| (f.rank, f.step) == (rank, step)) {
            inject_fault(rt, model.grads()?, f.hang)?;
        }
        // ZeRO-1: the parameters updated by the last step are gathered at the
        // start of this one (from the second step of a run on), so the
        // gathers are part of a recorded step and each forward task waits
        // only for the gather of its own parameters.
        let gather = opt.as_ref().is_some_and(AdamW::is_sharded);
        // The step holds the AdamW update too, reading its step scalars from
        // a buffer written here, before the step's tasks (outside a
        // recording, so each replay sees its own step's values). Every step
        // submits the same tasks this way, eager, recorded or replayed.
        // ZeRO-1 makes its optimizer during the first step: it advances there.
        let advanced = match opt.as_mut() {
            Some(o) => {
                let _s = rt.scope("optimizer");
                o.advance(rt)?;
                true
            }
            None => false,
        };
        // Gradients, the reducer's buckets and the mean loss across ranks: the
        // same tasks every step, reading the batch just uploaded.
        let mut submit_step = |rt: &Runtime| -> Result<()> {
            if gather {
                if let Some(r) = &reducer {
                    let _s = rt.scope("reduce");
                    r.all_gather_params(model.params())?;
                }
            }
            {
                let _s = rt.scope("zero_grad");
                model.zero_grad(rt)?;
            }
            // Every micro-batch but the last adds its gradients unreduced
            // (PyTorch DDP's `no_sync()`); each is scaled by 1/accum.
            let dloss = 1.0 / accum as f32;
            if let Some(m) = &micro {
                for i in 0..accum - 1 {
                    m.pass(rt, &mut model, i, |model| {
                        model.backward(rt, dloss, |_| Ok(()))
                    })?;
                }
                let _s = rt.scope("data");
                m.copy_in(rt, &mut model, accum - 1)?;
            }
            model.forward_for_backward(rt)?;
            match &mut reducer {
                Some(r) => {
                    model.backward(rt, dloss, |p| r.grad_ready(p))?;
                    let _s = rt.scope("reduce");
                    if model.split_tied() {
                        let (wte, rows) = model.tied_rows()?;
                        r.sparse_ready_range(wte, rows)?;
                    }
                    r.finish()?;
                    if opt.is_none() {
                        if let Some(shards) = r.shards() {
                            let o =
                                new_optimizer(rt, &model, opts, start, Some(&shards), rank, world)?;
                            // Mixed precision: the optimizer keeps its shard
                            // of the master weights; the model's full copy
                            // goes (its memory, once its last task is done).
                            if o.owns_master() {
                                model.release_master();
                            }
                            opt = Some(o);
                        }
                    }
                }
                None => model.backward(rt, dloss, |_| Ok(()))?,
            }
            if let Some(m) = &micro {
                m.keep_loss(rt, &model, accum - 1)?;
            }
            let loss_view = micro
                .as_ref()
                .map_or_else(|| model.loss_view(), |m| m.losses.whole());
            if let Some(c) = &comm {
                // After the buckets, so it never holds them up on the comm
                // stream (it waits for the slowest rank's forward pass).
                let _s = rt.scope("reduce");
                c.all_reduce::<f32>(&loss_view, ReduceOp::Avg)?;
            }
            // The gradient norm and clip factor: the same tasks every step,
            // so in a replay each chunk's sum waits only for its gradients
            // (after a replay, eager tasks wait for all of it).
            let _s = rt.scope("optimizer");
            let opt = opt.as_mut().ok_or_else(|| Gpt2Error::InvalidSetting {
                what: "ZeRO-1",
                reason: "the reducer's buckets are still not final after the first step".into(),
            })?;
            match &comm {
                Some(c) if opt.is_sharded() => opt.clip_sharded(c, model.grads()?)?,
                _ => opt.clip(rt, model.grads()?)?,
            }
            if !advanced {
                opt.advance(rt)?;
            }
            opt.update_recorded(rt, model.params(), model.grads()?)?;
            Ok(())
        };
        let replayed = schedule.is_some();
        match &schedule {
            Some(s) => {
                braid::Schedule::replay(s)?;
            }
            None if opts.replay && step >= first + 2 => {
                let mut failed = None;
                let recorded = rt.record("train step", |rt| {
                    submit_step(rt).map_err(|e| {
                        let msg = e.to_string();
                        failed = Some(e);
                        braid::Error::Config(msg)
                    })
                });
                if let Some(e) = failed {
                    return Err(e);
                }
                schedule = Some(recorded?);
            }
            None => submit_step(rt)?,
        }
        let opt_ref = the_optimizer(opt.as_mut())?;
        rt.synchronize()?;
        if step == first && step < opts.steps {
            steady_from = Some(braid::trace::now_ns());
        }
        if let (Some(c), Some(s), false) = (&comm, &schedule, replayed) {
            // Just recorded: the ranks place the replays alike (each
            // measured its own durations), so each reaches each collective
            // at the same point of its step.
            let _s = rt.scope("reduce");
            c.agree_placement(s)?;
        }
        let (loss, grad_norm) = {
            let _s = rt.scope("report");
            let loss = match &micro {
                None => model.read_loss(rt)?,
                Some(m) => m.read_mean_loss(rt)?,
            };
            (loss, opt_ref.read_grad_norm(rt)?)
        };
        let seconds = t0.elapsed().as_secs_f64();
        let diverged = !(loss.is_finite() && grad_norm.is_finite());
        // Validation after the update (not timed with the step), on every
        // rank; ZeRO-1 gathers the updated shards first.
        let mut gathered = false;
        let val_loss = match &opts.validation {
            Some(v) if !diverged && (step % v.every == 0 || step == opts.steps) => {
                {
                    let _s = rt.scope("validation");
                    gather_params(&model, reducer.as_ref())?;
                    gathered = true;
                }
                let comm = comm.as_ref().zip(val_sums.as_ref());
                Some(super::validate::validate(
                    rt, &mut model, v, comm, rank, world,
                )?)
            }
            _ => None,
        };
        // Then the text: every rank draws the same tokens (so none waits
        // in a collective for another's generation), rank 0 reports them.
        let sample = match &opts.generation {
            Some(g) if !diverged && (step % g.every == 0 || step == opts.steps) => {
                let _s = rt.scope("generation");
                if !gathered {
                    gather_params(&model, reducer.as_ref())?;
                }
                let stop = || shared.asked_to_stop();
                let at = (opts.seed, step);
                let tokens = super::generate::generate(rt, &model, g, &mut sampler, at, &stop)?;
                if let (Some(c), Some(b)) = (&comm, &gen_barrier) {
                    // The ranks leave together (waiting here, before the
                    // next step's tasks): what one waits for another is the
                    // generation's, not the next step's.
                    c.all_reduce::<f32>(&b.whole(), ReduceOp::Sum)?.wait()?;
                }
                // None when a stop came before the first token.
                (rank == 0 && !tokens.is_empty()).then_some(tokens)
            }
            _ => None,
        };
        let report = StepReport {
            step,
            loss,
            grad_norm,
            lr: opt_ref.hyper().learning_rate,
            seconds,
            tokens,
            replayed,
            val_loss,
            start_val_loss: start_val_loss.take(),
            sample,
        };
        if rank == 0 {
            on_step(&report);
        }
        // Both figures are the same on every rank (the loss is averaged
        // across them, the norm is of the reduced gradients), so every rank
        // stops here, and none saves the state this step made.
        if diverged {
            return Err(Gpt2Error::Diverged {
                step,
                loss,
                grad_norm,
            });
        }
        let stopping = shared.stops_after(step, world);
        if let Some(every) = opts.checkpoint_every {
            // A stopping run saves once, at the end.
            let last = step == opts.steps || stopping;
            if step % every == 0 && !last && opts.checkpoint_dir.is_some() {
                if let Some(dir) = save(&model, opt_ref, reducer.as_ref(), &loader, step)? {
                    checkpoint = Some(dir);
                }
            }
        }
        steps.push(report);
        if stopping {
            final_step = step;
            break;
        }
    }
    let opt = match opt {
        Some(o) => o,
        // No step ran (a run resumed at its last step): the optimizer as it
        // would be, for the checkpoint.
        None => new_optimizer(
            rt,
            &model,
            opts,
            start,
            reducer.as_ref().and_then(Reducer::shards).as_deref(),
            rank,
            world,
        )?,
    };
    if opts.checkpoint_dir.is_some() {
        if let Some(dir) = save(&model, &opt, reducer.as_ref(), &loader, final_step)? {
            checkpoint = Some(dir);
        }
    } else if opt.is_sharded() {
        let _s = rt.scope("report");
        gather_params(&model, reducer.as_ref())?;
    }
    let params = {
        let _s = rt.scope("report");
        read_params(rt, &model, &opt, comm.as_ref())?
    };
    rt.synchronize()?;
    let bucket_cap = reducer.as_ref().and_then(|r| {
        r.cap_choice().map(|c| match c {
            Ok(c) => CapReport::Chosen(c.clone()),
            Err(why) => CapReport::Kept {
                cap_bytes: r.cap_bytes(),
                why: why.to_owned(),
            },
        })
    });
    // A run stopped after its first step has no steps after it to measure:
    // its summary is of the whole profile, as a one-step run's.
    let steady_from = steady_from.filter(|_| steps.len() > 1);
    Ok(RankOutcome {
        final_step,
        bucket_cap,
        steps,
        hash: hash_f32s(&params),
        params: (rank == 0).then_some(params),
        profile: rt.profile(),
        steady_from,
        checkpoint,
        optimizer_bytes: opt.state_bytes(),
        model_bytes: model.device_bytes()
            + sampler
                .as_ref()
                .map_or(0, |s: &crate::model::Sampler| s.model().device_bytes()),
        graphs: GraphOutcome {
            launches: rt.stats().graph_replays,
            refusal: schedule.as_ref().and_then(|s| s.graph_refusal()),
            shape: schedule.as_ref().and_then(|s| s.graph_shape()),
            collectives_left_out: schedule
                .as_ref()
                .and_then(|s| s.graph_collectives_left_out()),
        },
        placement_trial: schedule.as_ref().and_then(|s| s.placement_trial()),
        spared_sms: rt.spared_sms().zip(rt.cuda_device().map(|d| d.sm_count())),
    })
}

/// The optimizer of this rank, with the start state's moments: for every
/// parameter, or (ZeRO-1, `shards` given) for this rank's shard only.
fn new_optimizer(
    rt: &Runtime,
    model: &Gpt2Model,
    opts: &TrainOptions,
    start: &StartState,
    shards: Option<&[BucketShard]>,
    rank: usize,
    world: usize,
) -> Result<AdamW> {
    let mut opt = match shards {
        Some(s) => AdamW::sharded(
            rt,
            model.layout().total,
            s,
            rank,
            world,
            opts.optimizer,
            opts.max_grad_norm,
        )?
        .storing(rt, model)?,
        None => AdamW::for_model(rt, model, opts.optimizer, opts.max_grad_norm)?,
    }
    .with_schedule(opts.lr_schedule)?;
    // (Without decay there is nothing to exempt: the chunks stay whole.)
    if opts.weight_decay_on == crate::optim::DecayOn::Matrices && opts.optimizer.weight_decay != 0.0
    {
        opt = opt.decaying_only(rt, &model.layout().matrix_ranges())?;
    }
    if let Some((m, v)) = &start.moments {
        opt.load_state(rt, m, v, start.step)?;
    }
    Ok(opt)
}

/// ZeRO-1: submits the all-gathers of the updated parameters now (outside a
/// step), so that reading them sees every rank's update.
fn gather_params(model: &Gpt2Model, reducer: Option<&Reducer<'_>>) -> Result<()> {
    if let Some(r) = reducer.filter(|r| r.sharding()) {
        r.all_gather_params(model.params())?;
    }
    Ok(())
}

/// The parameters in layout order (with mixed precision, the `f32` master
/// weights): the model's, or gathered from a ZeRO-1 optimizer that keeps
/// its shard of the master weights (a collective: every rank calls it).
fn read_params(
    rt: &Runtime,
    model: &Gpt2Model,
    opt: &AdamW,
    comm: Option<&BoundComm<'_>>,
) -> Result<Vec<f32>> {
    if let Some(c) = comm {
        if let Some(p) = opt.gather_master(c)? {
            return Ok(p);
        }
    }
    model.read_params(rt)
}

/// The optimizer once the step has made it (ZeRO-1 makes it in the first
/// step, when the reducer's buckets are final), else an error.
fn the_optimizer(opt: Option<&mut AdamW>) -> Result<&mut AdamW> {
    opt.ok_or_else(|| Gpt2Error::InvalidSetting {
        what: "ZeRO-1",
        reason: "no optimizer after the step".into(),
    })
}

/// The parameters and the full AdamW moments, in layout order. ZeRO-1: the
/// parameters and the moments are all-gathered first (collectives: every
/// rank calls this at the same point); otherwise only read.
fn full_state(
    rt: &Runtime,
    model: &Gpt2Model,
    opt: &AdamW,
    reducer: Option<&Reducer<'_>>,
    comm: Option<&BoundComm<'_>>,
) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
    let (m, v) = match comm {
        Some(c) if opt.is_sharded() => {
            gather_params(model, reducer)?;
            opt.gather_state(c)?
        }
        _ => opt.read_state(rt)?,
    };
    Ok((read_params(rt, model, opt, comm)?, m, v))
}

/// The injected fault ([`super::Fault`]): a task at the start of the step
/// that writes the whole gradient buffer and panics, so every later task
/// touching the gradients — zeroing, the backward pass's weight gradients,
/// the step's gradient buckets, or a replay of the step as a whole — is
/// skipped, and with them this rank's collectives of the step. With `hang`
/// the task never returns: those tasks wait forever instead.
fn inject_fault(rt: &Runtime, grads: &braid::Buffer, hang: bool) -> Result<()> {
    rt.task("injected fault")
        .run(grads.read_write::<f32>(), move |_| -> () {
            if hang {
                loop {
                    std::thread::sleep(std::time::Duration::from_secs(3600));
                }
            }
            panic!("injected fault: this rank stops in the middle of its step")
        })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::hash_f32s;

    /// The agreement hash sees every bit of every element, the order of
    /// the elements and their count: one flipped bit anywhere (in the
    /// lanes or the tail, low or high), two swapped elements, or one more
    /// zero change it.
    #[test]
    fn the_parameter_hash_sees_every_bit_and_the_order() {
        let x: Vec<f32> = (0..37).map(|i| (i as f32 * 0.37).sin()).collect();
        let h = hash_f32s(&x);
        for i in 0..x.len() {
            for bit in [0, 13, 31] {
                let mut y = x.clone();
                y[i] = f32::from_bits(y[i].to_bits() ^ (1 << bit));
                assert_ne!(hash_f32s(&y), h, "element {i}, bit {bit}");
            }
        }
        let mut swapped = x.clone();
        swapped.swap(3, 4);
        assert_ne!(hash_f32s(&swapped), h);
        let mut longer = x.clone();
        longer.push(0.0);
        assert_ne!(hash_f32s(&longer), h);
        assert_eq!(hash_f32s(&x), h);
    }
}

//! Data-parallel training, evaluation and the summary of a run.
//!
//! # Flow of one rank
//!
//! ```text
//! setup   runtime (rank r), model buffers, AdamW state, DataLoader shard r/W,
//!         gradient Reducer over the gradient buffer (W > 1), broadcast of
//!         rank 0's parameters (W > 1)
//! step    upload batch → zero grads → forward
//!         → backward, calling Reducer::grad_ready after the last task writing
//!           each parameter's gradient (bucket all-reduces start under the
//!           rest of the backward pass) → Reducer::finish
//!         → all-reduce(avg) of the loss (W > 1)
//!         → per-chunk sum of squares → clip scale → per-chunk AdamW (its
//!           step scalars uploaded before the step)
//!         → synchronize, read loss and norm
//!         (from the third step of a run, everything from zero grads to AdamW
//!         replayed as one schedule)
//! end     rank 0 saves the checkpoint (params, m, v, step, loader state)
//! ```
//!
//! Every rank submits the same collectives in the same order (the buckets in
//! bucket order, the one-time bucket rebuild broadcast, then the loss
//! all-reduce), as the collectives require.
//!
//! With ZeRO-1 (`TrainOptions::zero`), the reducer reduce-scatters the
//! buckets from the second step on, the optimizer (`AdamW::sharded`, made
//! after the first step's backward pass, once the buckets are final) keeps
//! state for and updates this rank's shard, the norm's partial sums are
//! all-gathered, and each step starts with the all-gathers of the parameters
//! the last one updated; checkpoints gather the full state on every rank
//! (`docs/collectives.md`).
//!
//! # Ranks
//!
//! CPU ranks are threads of this process started by
//! [`braid::comm::spawn_ranks`],
//! each with its own [`Runtime`](braid::Runtime) and a [`LocalComm`](braid::LocalComm). GPU
//! ranks run the same per-rank code on a CUDA runtime, in one of three ways:
//!
//! * **one GPU** (`ranks == 1`): one CUDA runtime, no communicator (with
//!   `reduce_single_rank`, NCCL at one rank);
//! * **one process, N GPUs** (`ranks == N`, no torchrun variables): one
//!   runtime per device `d, d+1, …, d+N-1` (`d` from `cuda:d`), NCCL
//!   communicators made together (`ncclCommInitAll`), one thread per rank;
//! * **one process per GPU** under `torchrun` (`RANK`, `WORLD_SIZE`,
//!   `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`, read by
//!   [`DistEnv::launched`]): this process is rank `RANK` of `WORLD_SIZE` on
//!   device `LOCAL_RANK`, and joins the NCCL communicator through braid's
//!   TCP rendezvous at `MASTER_ADDR` ([`NcclCommunicator::join`](braid::comm::NcclCommunicator::join); the port
//!   is [`rendezvous_port`]'s); `ranks` is ignored. The report holds
//!   this process's rank only; rank 0 saves the checkpoint, and a rank `r > 0`
//!   writes its trace next to the requested one ([`rank_trace_path`]).
//!
//! A missing driver, device, NVRTC or NCCL is an error naming what is
//! missing, never a panic. The bf16 bucket compression runs on host buffers
//! only, so it is refused on GPUs.
//!
//! # Determinism
//!
//! Given the options, the data and the starting state, a run is deterministic
//! bit for bit: kernels are sequential, the engine is sequentially consistent,
//! the CPU all-reduce reduces each element in rank order, and the optimizer's
//! chunks are fixed. So a run resumed from a checkpoint continues exactly as
//! the uninterrupted run would have (`tests/ddp.rs`).
//!
//! # Files
//!
//! * `options.rs`: [`TrainOptions`] and [`StartState`];
//! * `report.rs`: [`StepReport`] and [`TrainReport`];
//! * `launch.rs`: the device, the ranks' runtimes and the three launch modes
//!   (CPU threads, one process with N GPUs, torchrun processes);
//! * `rank.rs`: the per-rank training loop;
//! * `eval.rs`: [`evaluate`] and [`EvalReport`];
//! * this file: [`train`], which checks the options and picks the launch mode.

mod eval;
mod generate;
mod launch;
mod metrics;
mod options;
mod rank;
mod report;
mod validate;

use braid::comm::Compression;
use braid::trace::{Profile, Summary};
use braid::BackendKind;

use crate::data::{DataLoader, TokenSource};
use crate::error::{Gpt2Error, Result};
use launch::{train_cpu, train_gpus, train_torchrun};

pub use eval::{check_eval, evaluate, EvalReport};
pub use generate::generation_seed;
pub use launch::{
    model_runtime, rank_trace_path, rendezvous_port, resolve_backend, resolve_train_backend,
    RENDEZVOUS_PORT_VAR,
};
pub use metrics::MetricsLog;
#[doc(hidden)]
pub use options::Fault;
pub use options::{Generation, Moments, StartState, TrainOptions, Validation};
pub use report::{CapReport, StepReport, TrainReport};

/// Where this process sits in a `torchrun` launch (braid's one parser of
/// `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`, …).
pub use braid::comm::DistEnv;

/// The summaries of one rank's profile `p`, the whole run's and the
/// steady state's (the spans from `steady_from` on, a mark on `p`'s
/// timeline), both of training alone ([`training_only`]). The steady
/// state is cut before the rest is taken out: taking it out moves the
/// later spans earlier, off the mark's timeline (cut after, a validation
/// before the mark dropped training spans after it from the summary).
fn summaries(p: &Profile, steady_from: Option<u64>) -> (Summary, Summary) {
    let whole = training_only(p).summary();
    let steady = match steady_from {
        Some(t) => training_only(&p.since(t)).summary(),
        None => whole.clone(),
    };
    (whole, steady)
}

/// `p` without the spans of the `validation`, `generation` and
/// `checkpoint` scopes (and the scopes inside them), and without the time
/// they took: the summaries are of training (a validation's collective
/// waits for the slowest rank's share, which would count as exposed
/// communication; a generation's host work between its tasks, or a
/// checkpoint's write to disk, as idle streams). `p` itself when it has
/// none (no copy).
///
/// Each run of such spans (in start order, with no training span starting
/// among them) is cut out of the timeline, from the end of the training
/// before it to the start of the training after it (the host work around
/// its tasks, such as making a sampler or writing a file, is its too):
/// every later time moves back by the cut's length. They run between
/// steps, with nothing of training in flight; a training span keeps its
/// whole length.
fn training_only(p: &Profile) -> std::borrow::Cow<'_, Profile> {
    let aside = |s: &braid::trace::Span| {
        s.scope.as_deref().is_some_and(|sc| {
            ["validation", "generation", "checkpoint"].iter().any(|&x| {
                sc.strip_prefix(x)
                    .is_some_and(|r| r.is_empty() || r.starts_with('/'))
            })
        })
    };
    if !p.spans.iter().any(aside) {
        return std::borrow::Cow::Borrowed(p);
    }
    let mut order: Vec<&braid::trace::Span> = p.spans.iter().collect();
    order.sort_by_key(|s| s.start_ns);
    let mut cuts: Vec<(u64, u64)> = Vec::new();
    let mut open: Option<(u64, u64)> = None;
    // The latest end of the training spans so far.
    let mut trained: Option<u64> = None;
    for s in order {
        match (aside(s), &mut open) {
            (true, Some((_, end))) => *end = (*end).max(s.end_ns),
            (true, None) => {
                let from = trained.map_or(s.start_ns, |t| t.min(s.start_ns));
                open = Some((from, s.end_ns));
            }
            (false, _) => {
                if let Some((a, _)) = open.take() {
                    cuts.push((a, s.start_ns.max(a)));
                }
                trained = Some(trained.map_or(s.end_ns, |t| t.max(s.end_ns)));
            }
        }
    }
    cuts.extend(open);
    // Overlapping cuts (a training span that started inside one) as one.
    let mut merged: Vec<(u64, u64)> = Vec::with_capacity(cuts.len());
    for (a, b) in cuts {
        match merged.last_mut() {
            Some((_, end)) if a <= *end => *end = (*end).max(b),
            _ => merged.push((a, b)),
        }
    }
    // The time cut out before `t`, taken off it.
    let moved = |t: u64| -> u64 { t - merged.iter().map(|&(a, b)| t.clamp(a, b) - a).sum::<u64>() };
    let spans = p
        .spans
        .iter()
        .filter(|s| !aside(s))
        .map(|s| braid::trace::Span {
            start_ns: moved(s.start_ns),
            end_ns: moved(s.end_ns),
            ..s.clone()
        })
        .collect();
    let busy = p
        .busy
        .iter()
        .map(|&(a, b)| (moved(a), moved(b)))
        .filter(|(a, b)| b > a)
        .collect();
    std::borrow::Cow::Owned(Profile {
        spans,
        streams: p.streams.clone(),
        busy,
        ..*p
    })
}

/// Trains data-parallel from `start` on `data`; `on_step` is called with
/// rank 0's report after each step, in order, before rank 0 goes on (on the
/// calling thread for CPU ranks, on rank 0's thread for GPU ranks), so a
/// [`TrainOptions::stop`] flag it sets stops the run at that step (with
/// several ranks possibly the next). If it panics, CPU ranks stop at a
/// step's end (saving what a stopped run saves) and the panic goes on from
/// here; on GPU ranks it fails rank 0, naming the panic, and the others
/// are stopped with it. A checkpoint directory that cannot be used is refused before the
/// first step. Returns the report after every rank has finished (and the
/// trace and the checkpoint, if asked for, are written). On failure the
/// error of the rank that failed first is returned, not the errors of the
/// ranks that stopped because of it. A run that finished but could not
/// write its trace returns its report all the same, with
/// [`TrainReport::trace_not_written`] saying why (the run's outputs are
/// then still the caller's to write).
pub fn train(
    opts: &TrainOptions,
    start: StartState,
    data: &TokenSource,
    on_step: &(dyn Fn(&StepReport) + Sync),
) -> Result<TrainReport> {
    opts.check()?;
    crate::kernels::switches::check_environment()?;
    if let Some(cfg) = start.config.filter(|c| *c != opts.model) {
        return Err(Gpt2Error::InvalidSetting {
            what: "start state",
            reason: format!(
                "its parameters are of a model of {cfg}, the options' model is {}",
                opts.model
            ),
        });
    }
    if start.params.len() != opts.model.num_parameters() {
        return Err(Gpt2Error::LengthMismatch {
            what: "initial params".into(),
            expected: opts.model.num_parameters(),
            found: start.params.len(),
        });
    }
    let backend = resolve_train_backend(opts)?;
    let dist = match backend {
        BackendKind::Cuda { .. } => DistEnv::launched()?,
        _ => None,
    };
    let world = dist.as_ref().map_or(opts.ranks, |d| d.world_size);
    if matches!(backend, BackendKind::Cuda { .. }) && matches!(opts.compression, Compression::Bf16)
    {
        return Err(Gpt2Error::InvalidSetting {
            what: "bucket compression",
            reason: "bf16 compression casts the buckets on host buffers (CPU ranks only); \
                     train on GPUs without compression"
                .into(),
        });
    }
    // Check the data once, before any rank starts.
    DataLoader::for_config(data, &opts.model, opts.batch_size, opts.seq_len, 0, world)?
        .micro_batches(opts.grad_accum)?;
    // And the checkpoint directory (made now, a file tried in it), which
    // only rank 0 writes: not found unusable at the end of the run.
    if let Some(dir) = opts
        .checkpoint_dir
        .as_ref()
        .filter(|_| dist.as_ref().is_none_or(|d| d.rank == 0))
    {
        crate::checkpoint::prepare_checkpoint_dir(dir)?;
    }
    // A torchrun launch of several processes has ranks elsewhere.
    let all_here = dist.as_ref().is_none_or(|d| d.world_size == 1);
    let shared = std::sync::Arc::new(rank::RunShared::new(opts, all_here));
    let outcomes = match backend {
        BackendKind::Cpu | BackendKind::Auto => train_cpu(opts, &start, data, on_step, &shared),
        BackendKind::Cuda { device } => match &dist {
            Some(env) => train_torchrun(opts, env, &start, data, on_step, &shared).map(|o| vec![o]),
            None => train_gpus(opts, device, &start, data, on_step, &shared),
        },
    };
    // This process's trace file, if the run writes one (`trace.json` for
    // rank 0 of a torchrun launch, `trace.rank1.json` for rank 1, …).
    let trace_path = opts
        .trace
        .as_ref()
        .map(|p| rank_trace_path(p, dist.as_ref().map_or(0, |d| d.rank)));
    let write_trace = |path: &std::path::Path, profiles: &[Profile]| {
        let refs: Vec<&Profile> = profiles.iter().collect();
        braid::trace::write_chrome_trace(path, &refs)
    };
    let outcomes = match outcomes {
        Ok(o) => o,
        Err(error) => {
            // The trace of the run up to the failure, where the finished
            // run's would go: the runs that fail are the ones a trace is
            // most wanted for.
            let profiles = shared.take();
            let Some(path) = trace_path.filter(|_| !profiles.is_empty()) else {
                return Err(error);
            };
            return Err(match write_trace(&path, &profiles) {
                Ok(()) => Gpt2Error::Failed {
                    error: Box::new(error),
                    trace: path,
                },
                Err(_) => error,
            });
        }
    };
    let mut report = TrainReport {
        steps: Vec::new(),
        final_step: opts.steps.max(start.step),
        params: Vec::new(),
        param_hashes: Vec::new(),
        profiles: Vec::new(),
        summaries: Vec::new(),
        whole_run: Vec::new(),
        ranks: world,
        process_rank: dist.as_ref().map(|d| d.rank),
        tokens_per_step: opts.batch_size * opts.seq_len * world * opts.grad_accum,
        backend: match backend {
            BackendKind::Cuda { .. } => "cuda",
            _ => "cpu",
        },
        trace: None,
        trace_not_written: None,
        checkpoint: None,
        optimizer_bytes: Vec::new(),
        model_bytes: Vec::new(),
        zero: opts.zero == 1 && (world > 1 || opts.reduce_single_rank),
        tied_split: opts.splits_tied(world),
        bucket_cap: None,
        graph_replays: Vec::new(),
        graph_refusal: None,
        graph_shape: None,
        graph_collectives: opts.graph_collectives && (world > 1 || opts.reduce_single_rank),
        graph_collectives_left_out: None,
        placement_trial: None,
        spared_sms: None,
        cudnn: crate::kernels::flash_attention::cudnn_report(),
    };
    for (i, o) in outcomes.into_iter().enumerate() {
        if i == 0 {
            report.final_step = o.final_step;
            report.steps = o.steps;
            report.params = o.params.unwrap_or_default();
            report.checkpoint = o.checkpoint;
        }
        report.bucket_cap = report.bucket_cap.take().or(o.bucket_cap);
        report.param_hashes.push(o.hash);
        report.optimizer_bytes.push(o.optimizer_bytes);
        report.model_bytes.push(o.model_bytes);
        report.graph_replays.push(o.graphs.launches);
        report.graph_refusal = report.graph_refusal.take().or(o.graphs.refusal);
        report.graph_shape = report.graph_shape.or(o.graphs.shape);
        report.graph_collectives_left_out = report
            .graph_collectives_left_out
            .take()
            .or(o.graphs.collectives_left_out);
        report.placement_trial = report.placement_trial.or(o.placement_trial);
        report.spared_sms = report.spared_sms.or(o.spared_sms);
        let (whole, steady) = summaries(&o.profile, o.steady_from);
        report.whole_run.push(whole);
        report.summaries.push(steady);
        report.profiles.push(o.profile);
    }
    if let Some(path) = trace_path {
        match write_trace(&path, &report.profiles) {
            Ok(()) => report.trace = Some(path),
            Err(e) => report.trace_not_written = Some(e),
        }
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use braid::trace::{Profile, Span};
    use braid::TaskKind;

    fn span(id: u64, scope: Option<&str>, start_ns: u64, end_ns: u64) -> Span {
        Span {
            id,
            name: "t".into(),
            scope: scope.map(Into::into),
            kind: TaskKind::Compute,
            stream: 0,
            placement: braid::Placement {
                reason: braid::PlaceReason::Pinned,
                usable: 1,
                priority: braid::Priority::Main,
            },
            start_ns,
            end_ns,
            preds: Default::default(),
            ok: true,
            bytes: 0,
            wait_ns: 0,
        }
    }

    /// Validation, generation and checkpoints leave the summaries with
    /// their spans and their time: a step, a host pause, a validation and a
    /// generation with a pause between their tasks, then a step, reads as
    /// two steps back to back; a training span that starts inside such a
    /// run keeps its length; a checkpoint's pause after its tasks goes too.
    #[test]
    fn the_summaries_leave_out_what_is_not_training() {
        let p = Profile {
            spans: vec![
                span(0, Some("forward"), 0, 10),
                span(1, Some("validation/forward"), 12, 20),
                span(2, Some("generation"), 25, 30),
                span(3, Some("generation/decode"), 33, 40),
                span(4, Some("forward"), 40, 50),
                span(5, Some("validations"), 50, 55),
                span(6, Some("generation"), 60, 70),
                span(7, Some("forward"), 65, 80),
                span(8, Some("checkpoint"), 85, 90),
                span(9, Some("report"), 100, 105),
            ],
            busy: vec![(0, 10), (12, 40), (40, 55), (60, 80), (85, 105)],
            ..Profile::default()
        };
        let t = super::training_only(&p);
        let kept: Vec<(u64, u64, u64)> = t
            .spans
            .iter()
            .map(|s| (s.id, s.start_ns, s.end_ns))
            .collect();
        // 10..40 is cut out (30 ns), 55..65 (10 ns) and 80..100 (20 ns,
        // a checkpoint and its write); a scope that only starts alike is
        // training.
        assert_eq!(
            kept,
            [
                (0, 0, 10),
                (4, 10, 20),
                (5, 20, 25),
                (7, 25, 40),
                (9, 40, 45)
            ]
        );
        assert_eq!(t.busy, [(0, 10), (10, 25), (25, 40), (40, 45)]);
        assert_eq!(t.summary().wall_ns, 45);
        let plain = Profile {
            spans: vec![span(0, Some("forward"), 0, 10)],
            ..Profile::default()
        };
        assert!(matches!(
            super::training_only(&plain),
            std::borrow::Cow::Borrowed(_)
        ));
    }

    /// The steady state from a mark after a validation keeps every
    /// training span after the mark (the validation's cut moved them
    /// before it when the mark was applied after the cut).
    #[test]
    fn the_steady_state_after_a_validation_keeps_its_steps() {
        let p = Profile {
            spans: vec![
                span(0, Some("validation/forward"), 0, 100),
                span(1, Some("forward"), 100, 110),
                span(2, Some("forward"), 120, 130),
                span(3, Some("backward"), 130, 150),
            ],
            busy: vec![(0, 110), (120, 150)],
            ..Profile::default()
        };
        let (whole, steady) = super::summaries(&p, Some(115));
        assert_eq!(whole.tasks, 3);
        assert_eq!(steady.tasks, 2);
        assert_eq!(steady.wall_ns, 30);
        let (_, all) = super::summaries(&p, None);
        assert_eq!(all.tasks, 3);
    }
}

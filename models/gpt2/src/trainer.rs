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
//!         → per-chunk sum of squares → clip scale → per-chunk AdamW
//!         → synchronize, read loss and norm
//! end     rank 0 saves the checkpoint (params, m, v, step, loader state)
//! ```
//!
//! Every rank submits the same collectives in the same order (the buckets in
//! bucket order, the one-time bucket rebuild broadcast, then the loss
//! all-reduce), as the collectives require.
//!
//! # Ranks
//!
//! CPU ranks are threads of this process started by [`braid::launch_with`],
//! each with its own [`Runtime`] and a [`LocalComm`](braid::LocalComm). GPU
//! ranks run the same per-rank code on a CUDA runtime, in one of three ways:
//!
//! * **one GPU** (`ranks == 1`): one CUDA runtime, no communicator;
//! * **one process, N GPUs** (`ranks == N`, no torchrun variables): one
//!   runtime per device `d, d+1, …, d+N-1` (`d` from `cuda:d`), NCCL
//!   communicators made together (`ncclCommInitAll`), one thread per rank;
//! * **one process per GPU** under `torchrun` (`RANK`, `WORLD_SIZE`,
//!   `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`, read by
//!   [`DistEnv::launched`]): this process is rank `RANK` of `WORLD_SIZE` on
//!   device `LOCAL_RANK`, and joins the NCCL communicator through braid's
//!   TCP rendezvous at `MASTER_ADDR` ([`NcclCommunicator::join`]; the port
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

use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use braid::comm::{BucketConfig, Compression, NcclCommunicator, ReduceOp, NCCL_TIMEOUT};
use braid::trace::{Profile, Summary};
use braid::{BackendKind, Comm, LocalCommConfig, Policy, Reducer, Runtime};

use crate::checkpoint::{save_checkpoint, AdamWHyper, Checkpoint};
use crate::config::Gpt2Config;
use crate::data::{eval_windows, DataLoader, LoaderState, TokenSource};
use crate::error::{Gpt2Error, Result};
use crate::model::{init_params, runs_on, Gpt2Model};
use crate::optim::AdamW;

/// Where this process sits in a `torchrun` launch (braid's one parser of
/// `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`, …).
pub use braid::comm::DistEnv;

/// Everything that shapes a training run.
#[derive(Debug, Clone)]
pub struct TrainOptions {
    /// The model.
    pub model: Gpt2Config,
    /// Sequences per rank per step (`B`).
    pub batch_size: usize,
    /// Tokens per sequence (`T`).
    pub seq_len: usize,
    /// Train until this many optimizer steps are done in total (a resumed run
    /// continues from its checkpoint's step).
    pub steps: u64,
    /// AdamW settings (constant learning rate).
    pub optimizer: AdamWHyper,
    /// Clip the global gradient norm to this (`None`: no clipping).
    pub max_grad_norm: Option<f32>,
    /// The device.
    pub backend: BackendKind,
    /// Data-parallel ranks (CPU: threads of this process).
    pub ranks: usize,
    /// Compute streams per rank.
    pub streams: usize,
    /// Placement policy.
    pub policy: Policy,
    /// Gradient bucket cap in bytes.
    pub bucket_cap_bytes: usize,
    /// Cap of the first gradient bucket in bytes.
    pub first_bucket_bytes: usize,
    /// Seed of the parameter initialisation (fresh runs).
    pub seed: u64,
    /// Where rank 0 saves checkpoints (`None`: no checkpoints).
    pub checkpoint_dir: Option<PathBuf>,
    /// Also save every this many steps (`None`: only at the end).
    pub checkpoint_every: Option<u64>,
    /// Write a Chrome trace of every rank here at the end.
    pub trace: Option<PathBuf>,
    /// How long a CPU rank waits for the others in a collective.
    pub comm_timeout: Duration,
    /// How gradient buckets travel (default: plain `f32`).
    /// [`Compression::Bf16`] runs on host buffers: CPU ranks only.
    pub compression: Compression,
}

impl Default for TrainOptions {
    /// The tiny model, 2 CPU ranks, `B 4 × T 32`, 10 steps, AdamW `lr 1e-3,
    /// betas (0.9, 0.95), wd 0.1`, clip at 1.0, PyTorch's bucket caps.
    fn default() -> Self {
        TrainOptions {
            model: Gpt2Config::tiny(),
            batch_size: 4,
            seq_len: 32,
            steps: 10,
            optimizer: AdamWHyper {
                learning_rate: 1e-3,
                beta1: 0.9,
                beta2: 0.95,
                eps: 1e-8,
                weight_decay: 0.1,
            },
            max_grad_norm: Some(1.0),
            backend: BackendKind::Cpu,
            ranks: 2,
            streams: 2,
            policy: Policy::Affinity,
            bucket_cap_bytes: 25 << 20,
            first_bucket_bytes: 1 << 20,
            seed: 1337,
            checkpoint_dir: None,
            checkpoint_every: None,
            trace: None,
            comm_timeout: braid::comm::DEFAULT_TIMEOUT,
            compression: Compression::None,
        }
    }
}

impl TrainOptions {
    fn check(&self) -> Result<()> {
        self.model.validate()?;
        let bad =
            |what: &'static str, reason: String| Err(Gpt2Error::InvalidSetting { what, reason });
        if self.ranks == 0 {
            return bad("number of ranks", "must be at least 1".into());
        }
        if self.streams == 0 {
            return bad("number of streams", "must be at least 1".into());
        }
        if self.batch_size == 0 {
            return bad("batch size", "must be positive".into());
        }
        if self.seq_len == 0 || self.seq_len > self.model.max_seq_len {
            return bad(
                "sequence length",
                format!(
                    "{} is not in 1..={} (the model's context)",
                    self.seq_len, self.model.max_seq_len
                ),
            );
        }
        if self.bucket_cap_bytes == 0 || self.first_bucket_bytes == 0 {
            return bad("bucket cap", "must be positive".into());
        }
        let lr = self.optimizer.learning_rate;
        if !(lr.is_finite() && lr > 0.0) {
            return bad("learning rate", format!("{lr} is not a positive number"));
        }
        if self.checkpoint_every == Some(0) {
            return bad("checkpoint interval", "must be at least 1 step".into());
        }
        Ok(())
    }
}

/// AdamW's first and second moments, in layout order.
pub type Moments = (Arc<Vec<f32>>, Arc<Vec<f32>>);

/// Where a run starts: parameters, optimizer state, step and data position.
#[derive(Debug, Clone)]
pub struct StartState {
    /// Parameters in layout order.
    pub params: Arc<Vec<f32>>,
    /// AdamW moments `(m, v)`, when resuming.
    pub moments: Option<Moments>,
    /// Steps already taken.
    pub step: u64,
    /// Data loader position.
    pub loader: LoaderState,
}

impl StartState {
    /// A fresh run from GPT-2's initialisation with `seed`.
    pub fn fresh(cfg: &Gpt2Config, seed: u64) -> Self {
        Self::from_params(init_params(cfg, seed))
    }

    /// A fresh run from given parameters (e.g. pretrained weights).
    pub fn from_params(params: Vec<f32>) -> Self {
        StartState {
            params: Arc::new(params),
            moments: None,
            step: 0,
            loader: LoaderState::default(),
        }
    }

    /// A run resumed from a checkpoint.
    pub fn from_checkpoint(c: Checkpoint) -> Self {
        StartState {
            params: Arc::new(c.params),
            moments: Some((Arc::new(c.adam_m), Arc::new(c.adam_v))),
            step: c.step,
            loader: c.loader,
        }
    }
}

/// One finished step, as rank 0 saw it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepReport {
    /// The step number (1-based, counting resumed steps).
    pub step: u64,
    /// Mean loss over the global batch.
    pub loss: f32,
    /// Global gradient norm before clipping.
    pub grad_norm: f32,
    /// Wall time of the step (submission to completion).
    pub seconds: f64,
    /// Tokens in the global batch.
    pub tokens: usize,
}

/// What a run did.
#[derive(Debug, Clone)]
pub struct TrainReport {
    /// The steps taken in this run, in order (rank 0's view; under torchrun,
    /// this process's rank: the losses are the global means on every rank).
    pub steps: Vec<StepReport>,
    /// The last step number (the checkpoint's step).
    pub final_step: u64,
    /// Rank 0's parameters at the end (empty in a torchrun process of
    /// another rank).
    pub params: Vec<f32>,
    /// A hash of each rank's final parameters (all equal in a correct run).
    pub param_hashes: Vec<u64>,
    /// Each rank's profile (this process's ranks).
    pub profiles: Vec<Profile>,
    /// Each rank's summary of its profile.
    pub summaries: Vec<Summary>,
    /// Number of ranks in the job.
    pub ranks: usize,
    /// Under torchrun: the rank this process played (the report then holds
    /// that rank alone). `None` when this process ran every rank.
    pub process_rank: Option<usize>,
    /// Tokens per step over all ranks.
    pub tokens_per_step: usize,
    /// The backend the ranks ran on.
    pub backend: &'static str,
    /// The trace written, if any.
    pub trace: Option<PathBuf>,
    /// The checkpoint written, if any.
    pub checkpoint: Option<PathBuf>,
}

impl TrainReport {
    /// Mean wall time per step, leaving out the first step of the run (warm-up)
    /// when there is more than one.
    pub fn mean_step_seconds(&self) -> f64 {
        let s = if self.steps.len() > 1 {
            &self.steps[1..]
        } else {
            &self.steps[..]
        };
        if s.is_empty() {
            0.0
        } else {
            s.iter().map(|x| x.seconds).sum::<f64>() / s.len() as f64
        }
    }

    /// Tokens processed per second (all ranks), from the mean step time.
    pub fn tokens_per_second(&self) -> f64 {
        let t = self.mean_step_seconds();
        if t > 0.0 {
            self.tokens_per_step as f64 / t
        } else {
            0.0
        }
    }

    /// Share of communication time hidden under computation, averaged over
    /// ranks (0 without communication).
    pub fn hidden_comm_share(&self) -> f64 {
        let with_comm: Vec<f64> = self
            .summaries
            .iter()
            .filter(|s| s.comm_ns > 0)
            .map(|s| s.hidden_share())
            .collect();
        if with_comm.is_empty() {
            0.0
        } else {
            with_comm.iter().sum::<f64>() / with_comm.len() as f64
        }
    }

    /// Communication time per rank, averaged, in seconds.
    pub fn comm_seconds(&self) -> f64 {
        if self.summaries.is_empty() {
            return 0.0;
        }
        self.summaries.iter().map(|s| s.comm_ns as f64).sum::<f64>()
            / self.summaries.len() as f64
            / 1e9
    }
}

impl fmt::Display for TrainReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let (Some(first), Some(last)) = (self.steps.first(), self.steps.last()) {
            writeln!(
                f,
                "loss             {:.4} (step {}) -> {:.4} (step {})",
                first.loss, first.step, last.loss, last.step
            )?;
        }
        writeln!(
            f,
            "ranks            {} on {} ({} tokens per step){}",
            self.ranks,
            self.backend,
            self.tokens_per_step,
            match self.process_rank {
                Some(r) => format!("; this process is rank {r}"),
                None => String::new(),
            }
        )?;
        writeln!(
            f,
            "mean step time   {:.1} ms",
            self.mean_step_seconds() * 1e3
        )?;
        writeln!(
            f,
            "throughput       {:.0} tokens/s",
            self.tokens_per_second()
        )?;
        writeln!(
            f,
            "communication    {:.1} ms per rank, {:.0}% hidden under compute",
            self.comm_seconds() * 1e3,
            100.0 * self.hidden_comm_share()
        )?;
        if let Some(s) = self.summaries.first() {
            let overlap = 100.0 * s.overlap_share();
            writeln!(
                f,
                "rank 0           {} tasks, 2+ streams busy {overlap:.0}% of {:.1} ms, critical path {:.1} ms",
                s.tasks,
                s.wall_ns as f64 / 1e6,
                s.critical_path_ns as f64 / 1e6
            )?;
        }
        if let Some(c) = &self.checkpoint {
            writeln!(f, "checkpoint       {}", c.display())?;
        }
        match &self.trace {
            Some(t) => write!(f, "trace            {}", t.display()),
            None => write!(f, "trace            (none; pass --trace FILE)"),
        }
    }
}

/// What `auto` means for the model: the device the engine picks when the
/// model's kernels run there ([`runs_on`]), the CPU otherwise. Other kinds
/// are returned as they are.
pub fn resolve_backend(kind: BackendKind) -> Result<BackendKind> {
    Ok(match kind {
        BackendKind::Auto => {
            let probe = Runtime::builder()
                .backend(BackendKind::Auto)
                .compute_streams(1)
                .comm_streams(0)
                .build()?;
            match probe.backend_name() {
                name if name != "cpu" && runs_on(name) => BackendKind::Cuda { device: 0 },
                _ => BackendKind::Cpu,
            }
        }
        other => other,
    })
}

/// The device a training run with `opts` uses. `auto` means the GPUs when the
/// job fits them — under torchrun (one GPU per process), or when this machine
/// has at least `opts.ranks` devices — and CPU ranks otherwise (so `auto`
/// with 2 ranks on a one-GPU machine trains on 2 CPU ranks). Other kinds are
/// returned as they are.
pub fn resolve_train_backend(opts: &TrainOptions) -> Result<BackendKind> {
    let kind = resolve_backend(opts.backend)?;
    if opts.backend != BackendKind::Auto || kind == BackendKind::Cpu {
        return Ok(kind);
    }
    if DistEnv::launched()?.is_some() || opts.ranks <= 1 {
        return Ok(kind);
    }
    Ok(match braid::cuda::cuda_available() {
        Ok(n) if n >= opts.ranks => kind,
        _ => BackendKind::Cpu,
    })
}

/// Builds a runtime for the model on `backend`, failing with a clear error
/// when the device is missing or the model's kernels do not run on it. On a
/// GPU the model's CUDA kernels are compiled (NVRTC, cached on disk) and
/// loaded now, so that a missing NVRTC or a compile error is reported here
/// and no step pays for it.
pub fn model_runtime(
    backend: BackendKind,
    streams: usize,
    policy: Policy,
    rank: usize,
) -> Result<Runtime> {
    let rt = Runtime::builder()
        .backend(resolve_backend(backend)?)
        .compute_streams(streams)
        .comm_streams(1)
        .policy(policy)
        .rank(rank)
        .profile(true)
        .build()?;
    if !runs_on(rt.backend_name()) {
        return Err(Gpt2Error::InvalidSetting {
            what: "device",
            reason: format!(
                "the GPT-2 kernels are wired into the model's tasks for {:?}, not for `{}`",
                crate::model::KERNEL_BACKENDS,
                rt.backend_name()
            ),
        });
    }
    if let Some(dev) = rt.cuda_device() {
        crate::kernels::preload(dev)?;
    }
    Ok(rt)
}

/// Builds a rank's runtime.
fn build_runtime(opts: &TrainOptions, backend: BackendKind, rank: usize) -> Result<Runtime> {
    model_runtime(backend, opts.streams, opts.policy, rank)
}

/// Where rank `rank` of a torchrun job writes its trace when rank 0 writes
/// `path`: `path` itself for rank 0, `trace.rank3.json` for rank 3 of
/// `trace.json`.
pub fn rank_trace_path(path: &std::path::Path, rank: usize) -> PathBuf {
    if rank == 0 {
        return path.to_path_buf();
    }
    let stem = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "trace".into());
    let name = match path.extension() {
        Some(ext) => format!("{stem}.rank{rank}.{}", ext.to_string_lossy()),
        None => format!("{stem}.rank{rank}"),
    };
    path.with_file_name(name)
}

/// What a rank hands back.
struct RankOutcome {
    steps: Vec<StepReport>,
    params: Option<Vec<f32>>,
    hash: u64,
    profile: Profile,
    checkpoint: Option<PathBuf>,
}

fn hash_f32s(x: &[f32]) -> u64 {
    // FNV-1a over the bit patterns.
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for v in x {
        for b in v.to_bits().to_le_bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

/// The body of one rank (CPU thread, GPU thread or GPU process) on its
/// runtime `rt`.
#[allow(clippy::too_many_arguments)]
fn run_rank(
    opts: &TrainOptions,
    rt: Runtime,
    rank: usize,
    world: usize,
    comm: Option<Comm>,
    start: &StartState,
    data: &TokenSource,
    on_step: &(dyn Fn(&StepReport) + Sync),
) -> Result<RankOutcome> {
    let cfg = opts.model;
    let (b, t) = (opts.batch_size, opts.seq_len);
    let mut model = Gpt2Model::new(&rt, &cfg, b, t)?;
    model.upload_params(&rt, &start.params)?;
    let mut opt = AdamW::for_model(&rt, &model, opts.optimizer, opts.max_grad_norm)?;
    if let Some((m, v)) = &start.moments {
        opt.load_state(&rt, m, v, start.step)?;
    } else if start.step != 0 {
        return Err(Gpt2Error::InvalidSetting {
            what: "start state",
            reason: format!("step {} without optimizer moments", start.step),
        });
    }
    let mut loader = DataLoader::for_config(data, &cfg, b, t, rank, world)?;
    loader.set_state(start.loader)?;
    let comm = comm
        .filter(|_| world > 1)
        .map(|c| c.bind(&rt))
        .transpose()?;
    let mut reducer = match &comm {
        Some(c) => {
            // Every rank starts from rank 0's parameters, as DDP does.
            c.broadcast::<f32>(&model.params().whole(), 0)?;
            Some(Reducer::new(
                c.clone(),
                model.grads(),
                model.param_specs(),
                BucketConfig::default()
                    .cap_bytes(opts.bucket_cap_bytes)
                    .first_cap_bytes(opts.first_bucket_bytes)
                    .compression(opts.compression.clone()),
            )?)
        }
        None => None,
    };
    rt.synchronize()?;
    rt.clear_profile();

    let tokens = b * t * world;
    let (mut x, mut y) = (vec![0u32; b * t], vec![0u32; b * t]);
    let mut steps = Vec::new();
    let mut checkpoint = None;
    let save =
        |model: &Gpt2Model, opt: &AdamW, loader: &DataLoader, step: u64| -> Result<PathBuf> {
            let dir = opts.checkpoint_dir.as_ref().expect("checked by the caller");
            let (adam_m, adam_v) = opt.read_state(&rt)?;
            let mut extra = BTreeMap::new();
            extra.insert("batch_size".into(), b.into());
            extra.insert("seq_len".into(), t.into());
            extra.insert("world_size".into(), world.into());
            extra.insert("seed".into(), opts.seed.into());
            extra.insert(
                "max_grad_norm".into(),
                opts.max_grad_norm.map(f64::from).into(),
            );
            save_checkpoint(
                dir,
                &Checkpoint {
                    config: cfg,
                    step,
                    params: model.read_params(&rt)?,
                    adam_m,
                    adam_v,
                    optimizer: *opt.hyper(),
                    loader: loader.state(),
                    rng_state: None,
                    extra,
                },
            )?;
            Ok(dir.clone())
        };
    for step in start.step + 1..=opts.steps.max(start.step) {
        let t0 = Instant::now();
        loader.next_batch_into(&mut x, &mut y)?;
        model.zero_grad(&rt)?;
        model.forward(&rt, &x, Some(&y))?;
        match &mut reducer {
            Some(r) => {
                model.backward(&rt, 1.0, |p| r.grad_ready(p))?;
                r.finish()?;
            }
            None => model.backward(&rt, 1.0, |_| Ok(()))?,
        }
        if let Some(c) = &comm {
            // After the buckets, so it never holds them up on the comm stream
            // (it waits for the slowest rank's forward pass).
            c.all_reduce::<f32>(&model.loss_view(), ReduceOp::Avg)?;
        }
        opt.step(&rt, model.params(), model.grads())?;
        rt.synchronize()?;
        let report = StepReport {
            step,
            loss: model.read_loss(&rt)?,
            grad_norm: opt.read_grad_norm(&rt)?,
            seconds: t0.elapsed().as_secs_f64(),
            tokens,
        };
        if rank == 0 {
            on_step(&report);
            if let Some(every) = opts.checkpoint_every {
                if step % every == 0 && step != opts.steps && opts.checkpoint_dir.is_some() {
                    checkpoint = Some(save(&model, &opt, &loader, step)?);
                }
            }
        }
        steps.push(report);
    }
    let final_step = opts.steps.max(start.step);
    let params = model.read_params(&rt)?;
    if rank == 0 && opts.checkpoint_dir.is_some() {
        checkpoint = Some(save(&model, &opt, &loader, final_step)?);
    }
    rt.synchronize()?;
    Ok(RankOutcome {
        steps,
        hash: hash_f32s(&params),
        params: (rank == 0).then_some(params),
        profile: rt.profile(),
        checkpoint,
    })
}

/// Whether an error is only a consequence of another rank's failure.
fn is_secondary(e: &Gpt2Error) -> bool {
    matches!(
        e,
        Gpt2Error::Engine(braid::Error::Collective { .. })
            | Gpt2Error::Engine(braid::Error::DependencyFailed { .. })
    )
}

/// Trains data-parallel from `start` on `data`; `on_step` is called by rank 0
/// after each step. Returns the report after every rank has finished (and the
/// trace and the checkpoint, if asked for, are written). On failure the
/// error of the rank that failed first is returned, not the errors of the
/// ranks that stopped because of it.
pub fn train(
    opts: &TrainOptions,
    start: StartState,
    data: &TokenSource,
    on_step: &(dyn Fn(&StepReport) + Sync),
) -> Result<TrainReport> {
    opts.check()?;
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
    DataLoader::for_config(data, &opts.model, opts.batch_size, opts.seq_len, 0, world)?;
    let outcomes = match backend {
        BackendKind::Cpu | BackendKind::Auto => train_cpu(opts, &start, data, on_step)?,
        BackendKind::Cuda { device } => match &dist {
            Some(env) => vec![train_torchrun(opts, env, &start, data, on_step)?],
            None => train_gpus(opts, device, &start, data, on_step)?,
        },
    };
    let mut report = TrainReport {
        steps: Vec::new(),
        final_step: opts.steps.max(start.step),
        params: Vec::new(),
        param_hashes: Vec::new(),
        profiles: Vec::new(),
        summaries: Vec::new(),
        ranks: world,
        process_rank: dist.as_ref().map(|d| d.rank),
        tokens_per_step: opts.batch_size * opts.seq_len * world,
        backend: match backend {
            BackendKind::Cuda { .. } => "cuda",
            _ => "cpu",
        },
        trace: None,
        checkpoint: None,
    };
    for (i, o) in outcomes.into_iter().enumerate() {
        if i == 0 {
            report.steps = o.steps;
            report.params = o.params.unwrap_or_default();
            report.checkpoint = o.checkpoint;
        }
        report.param_hashes.push(o.hash);
        report.summaries.push(o.profile.summary());
        report.profiles.push(o.profile);
    }
    if let Some(path) = &opts.trace {
        let path = rank_trace_path(path, dist.as_ref().map_or(0, |d| d.rank));
        let refs: Vec<&Profile> = report.profiles.iter().collect();
        braid::trace::write_chrome_trace(&path, &refs)?;
        report.trace = Some(path);
    }
    Ok(report)
}

/// The root cause among the ranks' errors: the first that is not a
/// consequence of another rank's failure.
fn root_cause(mut failures: Vec<(usize, Gpt2Error)>) -> Gpt2Error {
    let i = failures
        .iter()
        .position(|(_, e)| !is_secondary(e))
        .unwrap_or(0);
    failures.swap_remove(i).1
}

/// CPU ranks: threads of this process.
fn train_cpu(
    opts: &TrainOptions,
    start: &StartState,
    data: &TokenSource,
    on_step: &(dyn Fn(&StepReport) + Sync),
) -> Result<Vec<RankOutcome>> {
    let world = opts.ranks;
    // The ranks' own errors, kept apart from what the launcher makes of them.
    let failures: Mutex<Vec<(usize, Gpt2Error)>> = Mutex::new(Vec::new());
    let results = braid::launch_with(
        world,
        LocalCommConfig::default().timeout(opts.comm_timeout),
        |rank, comm| {
            build_runtime(opts, BackendKind::Cpu, rank)
                .and_then(|rt| run_rank(opts, rt, rank, world, Some(comm), start, data, on_step))
                .map_err(|e| {
                    let message = e.to_string();
                    failures
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .push((rank, e));
                    braid::Error::TaskFailed {
                        task: format!("rank {rank}"),
                        message,
                    }
                })
        },
    );
    let failures = failures.into_inner().unwrap_or_else(|p| p.into_inner());
    if !failures.is_empty() {
        return Err(root_cause(failures));
    }
    results
        .into_iter()
        .map(|r| r.map_err(Gpt2Error::from))
        .collect()
}

/// An NCCL failure while setting up GPU ranks, as the engine's collective
/// error.
fn nccl_setup_error(rank: usize, e: impl fmt::Display) -> Gpt2Error {
    Gpt2Error::Engine(braid::Error::Collective {
        rank,
        index: 0,
        op: "init".into(),
        message: e.to_string(),
    })
}

/// GPU ranks of this process: `opts.ranks` devices from `first`, one thread
/// and one runtime per device, NCCL communicators between them.
fn train_gpus(
    opts: &TrainOptions,
    first: usize,
    start: &StartState,
    data: &TokenSource,
    on_step: &(dyn Fn(&StepReport) + Sync),
) -> Result<Vec<RankOutcome>> {
    let world = opts.ranks;
    // Rank 0's runtime first: a missing driver or device is reported as the
    // engine finds it.
    let rt0 = build_runtime(opts, BackendKind::Cuda { device: first }, 0)?;
    if world == 1 {
        return Ok(vec![run_rank(opts, rt0, 0, 1, None, start, data, on_step)?]);
    }
    let count = braid::cuda::cuda_available().map_err(braid::Error::from)?;
    if first + world > count {
        return Err(Gpt2Error::InvalidSetting {
            what: "number of ranks",
            reason: format!(
                "{world} GPU ranks from cuda:{first} need devices {first}..={}, but this \
                 machine has {count} CUDA device(s); pass --ranks {} or fewer, or train on \
                 CPU ranks (--device cpu)",
                first + world - 1,
                count.saturating_sub(first).max(1)
            ),
        });
    }
    let mut rts = vec![rt0];
    for rank in 1..world {
        rts.push(build_runtime(
            opts,
            BackendKind::Cuda {
                device: first + rank,
            },
            rank,
        )?);
    }
    let devices: Vec<braid::cuda::CudaDevice> = rts
        .iter()
        .map(|rt| {
            rt.cuda_device()
                .cloned()
                .expect("a CUDA runtime has a device")
        })
        .collect();
    let comms: Vec<Comm> = braid::comm::nccl::NcclComm::init_all(&devices)
        .map_err(|e| nccl_setup_error(0, e))?
        .into_iter()
        .map(|c| Comm::new(NcclCommunicator::new(c, NCCL_TIMEOUT)))
        .collect();
    let failures: Mutex<Vec<(usize, Gpt2Error)>> = Mutex::new(Vec::new());
    let outcomes: Vec<Option<RankOutcome>> = std::thread::scope(|s| {
        let handles: Vec<_> = rts
            .into_iter()
            .zip(comms.iter().cloned())
            .enumerate()
            .map(|(rank, (rt, comm))| {
                let (comms, failures) = (&comms, &failures);
                let spawned = std::thread::Builder::new()
                    .name(format!("braid-gpt2 rank {rank}"))
                    .spawn_scoped(s, move || {
                        let run = std::panic::AssertUnwindSafe(|| {
                            run_rank(opts, rt, rank, world, Some(comm), start, data, on_step)
                        });
                        let result = std::panic::catch_unwind(run).unwrap_or_else(|p| {
                            let what = p
                                .downcast_ref::<&str>()
                                .map(|s| s.to_string())
                                .or_else(|| p.downcast_ref::<String>().cloned())
                                .unwrap_or_else(|| "a panic".into());
                            Err(Gpt2Error::Engine(braid::Error::TaskFailed {
                                task: format!("rank {rank}"),
                                message: format!("panicked: {what}"),
                            }))
                        });
                        match result {
                            Ok(o) => Some(o),
                            Err(e) => {
                                // The other ranks would wait for this one's
                                // collectives: abort them all now.
                                let why = format!("rank {rank} failed: {e}");
                                for c in comms {
                                    c.abort(&why);
                                }
                                failures
                                    .lock()
                                    .unwrap_or_else(|p| p.into_inner())
                                    .push((rank, e));
                                None
                            }
                        }
                    });
                if let Err(e) = &spawned {
                    let why = format!("the thread of rank {rank} could not be started: {e}");
                    for c in comms {
                        c.abort(&why);
                    }
                }
                spawned
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.ok().and_then(|h| h.join().ok().flatten()))
            .collect()
    });
    let failures = failures.into_inner().unwrap_or_else(|p| p.into_inner());
    if !failures.is_empty() {
        return Err(root_cause(failures));
    }
    outcomes
        .into_iter()
        .enumerate()
        .map(|(rank, o)| {
            o.ok_or_else(|| {
                Gpt2Error::Engine(braid::Error::TaskFailed {
                    task: format!("rank {rank}"),
                    message: "its thread could not be started".into(),
                })
            })
        })
        .collect()
}

/// Overrides the port of braid's own TCP rendezvous in a torchrun job.
pub const RENDEZVOUS_PORT_VAR: &str = "BRAID_MASTER_PORT";

/// The port of braid's TCP rendezvous (which hands the NCCL unique id from
/// rank 0 to the others) in a torchrun job whose `MASTER_PORT` is
/// `master_port`, reading variables through `get`:
///
/// * `BRAID_MASTER_PORT` when it is set;
/// * `MASTER_PORT + 1` when `TORCHELASTIC_USE_AGENT_STORE=True`: torchrun's
///   agent then serves its own store on `MASTER_PORT` (PyTorch's default
///   since the rendezvous store is shared; `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`
///   turns that off), so rank 0 could not listen there;
/// * `MASTER_PORT` otherwise.
///
/// Every rank sees the same variables, so every rank picks the same port.
pub fn rendezvous_port(master_port: u16, get: impl Fn(&str) -> Option<String>) -> Result<u16> {
    if let Some(v) = get(RENDEZVOUS_PORT_VAR).filter(|v| !v.trim().is_empty()) {
        return match v.trim().parse::<u16>() {
            Ok(p) if p != 0 => Ok(p),
            _ => Err(Gpt2Error::InvalidSetting {
                what: "distributed environment",
                reason: format!("{RENDEZVOUS_PORT_VAR}={v:?} is not a port"),
            }),
        };
    }
    let agent_store = get("TORCHELASTIC_USE_AGENT_STORE")
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("true") || v.trim() == "1");
    if agent_store {
        return master_port.checked_add(1).ok_or(Gpt2Error::InvalidSetting {
            what: "distributed environment",
            reason: format!(
                "MASTER_PORT={master_port} is torchrun's store; set {RENDEZVOUS_PORT_VAR} to a \
                 free port for braid's rendezvous"
            ),
        });
    }
    Ok(master_port)
}

/// This process's rank of a torchrun job: device `LOCAL_RANK`, NCCL through
/// the rendezvous at `MASTER_ADDR:MASTER_PORT`.
fn train_torchrun(
    opts: &TrainOptions,
    env: &DistEnv,
    start: &StartState,
    data: &TokenSource,
    on_step: &(dyn Fn(&StepReport) + Sync),
) -> Result<RankOutcome> {
    let rt = build_runtime(
        opts,
        BackendKind::Cuda {
            device: env.local_rank,
        },
        env.rank,
    )?;
    let comm = if env.world_size > 1 {
        let rdv_env = DistEnv {
            master_port: rendezvous_port(env.master_port, |k| std::env::var(k).ok())?,
            ..env.clone()
        };
        let endpoint = rdv_env.master_endpoint();
        Some(NcclCommunicator::join(&rt, &rdv_env).map_err(|e| {
            let hint = format!(
                " (braid's rendezvous used {endpoint}; set {RENDEZVOUS_PORT_VAR} to a port \
                 free on rank 0's host to choose another)"
            );
            match e {
                braid::Error::Collective {
                    rank,
                    index,
                    op,
                    message,
                } => braid::Error::Collective {
                    rank,
                    index,
                    op,
                    message: message + &hint,
                },
                other => other,
            }
        })?)
    } else {
        None
    };
    run_rank(
        opts,
        rt,
        env.rank,
        env.world_size,
        comm,
        start,
        data,
        on_step,
    )
}

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

/// Mean next-token cross-entropy of `params` over the consecutive windows of
/// `source` (window `i` has inputs `i·T .. i·T+T-1` and predicts tokens
/// `i·T+1 .. i·T+T`), `batch_size` windows per forward pass.
pub fn evaluate(
    rt: &Runtime,
    cfg: &Gpt2Config,
    params: &[f32],
    source: &TokenSource,
    seq_len: usize,
    batch_size: usize,
    mut on_batch: impl FnMut(usize, usize),
) -> Result<EvalReport> {
    if batch_size == 0 {
        return Err(Gpt2Error::InvalidSetting {
            what: "batch size",
            reason: "must be positive".into(),
        });
    }
    if seq_len == 0 || seq_len > cfg.max_seq_len {
        return Err(Gpt2Error::InvalidSetting {
            what: "sequence length",
            reason: format!(
                "{seq_len} is not in 1..={} (the model's context)",
                cfg.max_seq_len
            ),
        });
    }
    source.check_vocab(cfg.vocab_size)?;
    let windows: Vec<_> = eval_windows(source, seq_len)?.collect();
    if windows.is_empty() {
        return Err(Gpt2Error::DatasetTooSmall {
            origin: source.origin().to_string(),
            tokens: source.len(),
            needed: seq_len + 1,
            batch_size: 1,
            seq_len,
            world_size: 1,
        });
    }
    let mut model: Option<Gpt2Model> = None;
    let (mut sum, mut count) = (0.0f64, 0usize);
    for (i, batch) in windows.chunks(batch_size).enumerate() {
        let b = batch.len();
        if model.as_ref().is_none_or(|m| m.batch_size() != b) {
            let m = Gpt2Model::new(rt, cfg, b, seq_len)?;
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
        on_batch(i + 1, windows.len().div_ceil(batch_size));
    }
    rt.synchronize()?;
    Ok(EvalReport {
        loss: sum / count as f64,
        windows: windows.len(),
        tokens: count,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::path::Path;

    fn env(vars: &[(&str, &str)]) -> Result<Option<DistEnv>> {
        let m: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Ok(DistEnv::launched_from_vars(|k| m.get(k).cloned())?)
    }

    #[test]
    fn torchrun_variables() {
        assert_eq!(env(&[]).unwrap(), None);
        let e = env(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "1234"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(
            e,
            DistEnv {
                rank: 3,
                world_size: 4,
                local_rank: 1,
                local_world_size: 4,
                master_addr: "node0".into(),
                master_port: 1234
            }
        );
        let e = env(&[("RANK", "0"), ("WORLD_SIZE", "2")]).unwrap().unwrap();
        assert_eq!((e.local_rank, e.master_port), (0, 29500));
        for bad in [
            &[("RANK", "2"), ("WORLD_SIZE", "2")][..],
            &[("RANK", "0")][..],
            &[("RANK", "x"), ("WORLD_SIZE", "2")][..],
            &[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "99999")][..],
        ] {
            let err = env(bad).unwrap_err().to_string();
            assert!(err.contains("distributed environment"), "{err}");
        }
    }

    #[test]
    fn rendezvous_port_avoids_torchruns_store() {
        let port = |vars: &[(&str, &str)]| {
            let m: HashMap<String, String> = vars
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            rendezvous_port(29500, |k| m.get(k).cloned())
        };
        assert_eq!(port(&[]).unwrap(), 29500);
        assert_eq!(
            port(&[("TORCHELASTIC_USE_AGENT_STORE", "True")]).unwrap(),
            29501
        );
        assert_eq!(
            port(&[("TORCHELASTIC_USE_AGENT_STORE", "False")]).unwrap(),
            29500
        );
        assert_eq!(
            port(&[
                ("TORCHELASTIC_USE_AGENT_STORE", "True"),
                ("BRAID_MASTER_PORT", "40000")
            ])
            .unwrap(),
            40000
        );
        let err = port(&[("BRAID_MASTER_PORT", "0")]).unwrap_err().to_string();
        assert!(err.contains("BRAID_MASTER_PORT"), "{err}");
        assert_eq!(
            rank_trace_path(Path::new("out/t.json"), 0),
            Path::new("out/t.json")
        );
        assert_eq!(
            rank_trace_path(Path::new("out/t.json"), 3),
            Path::new("out/t.rank3.json")
        );
        assert_eq!(
            rank_trace_path(Path::new("trace"), 1),
            Path::new("trace.rank1")
        );
    }

    #[test]
    fn options_are_checked() {
        let ok = TrainOptions::default();
        ok.check().unwrap();
        for (opts, what) in [
            (
                TrainOptions {
                    ranks: 0,
                    ..ok.clone()
                },
                "ranks",
            ),
            (
                TrainOptions {
                    seq_len: 65,
                    ..ok.clone()
                },
                "sequence length",
            ),
            (
                TrainOptions {
                    checkpoint_every: Some(0),
                    ..ok.clone()
                },
                "checkpoint interval",
            ),
        ] {
            let err = opts.check().unwrap_err().to_string();
            assert!(err.contains(what), "{err}");
        }
    }
}

//! What shapes a run ([`TrainOptions`], checked before any rank starts) and
//! where it starts ([`StartState`]: fresh, from given parameters or from a
//! checkpoint).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use braid::comm::Compression;
use braid::{BackendKind, Policy};

use crate::checkpoint::{AdamWHyper, Checkpoint};
use crate::config::Gpt2Config;
use crate::data::{LoaderState, TokenSource};
use crate::error::{Gpt2Error, Result};
use crate::kernels::storage::Dtype;
use crate::model::init_params;
use serde_json::Value;

/// Everything that shapes a training run.
#[derive(Debug, Clone)]
pub struct TrainOptions {
    /// The model.
    pub model: Gpt2Config,
    /// Sequences per rank per step (`B`).
    pub batch_size: usize,
    /// Tokens per sequence (`T`).
    pub seq_len: usize,
    /// Take the data's windows in an order drawn from `seed`, a new one each
    /// epoch ([`DataLoader::shuffled`](crate::data::DataLoader::shuffled)),
    /// instead of in order (`false`, the default).
    pub shuffle: bool,
    /// Micro-batches per optimizer step (gradient accumulation; 1, the
    /// default: none). Each rank runs this many forward and backward passes
    /// of `batch_size` sequences per step, adding their gradients (each pass
    /// scaled by `1 / grad_accum`, so the step's gradient is that of the
    /// mean loss over all of them), and the reducer all-reduces the sum
    /// during the last pass's backward, as PyTorch DDP does under
    /// `no_sync()`. A step then trains on `grad_accum · batch_size ·
    /// seq_len · ranks` tokens, in the memory of one micro-batch. The
    /// tied gradient is reduced whole ([`splits_tied`](Self::splits_tied)).
    pub grad_accum: usize,
    /// Train until this many optimizer steps are done in total (a resumed run
    /// continues from its checkpoint's step); at least 1.
    pub steps: u64,
    /// AdamW settings; `learning_rate` is the peak rate of `lr_schedule`.
    pub optimizer: AdamWHyper,
    /// How the learning rate follows the step (default: constant; the
    /// CLI's default warms up and decays, `braid-gpt2 train --help`).
    pub lr_schedule: crate::optim::LrSchedule,
    /// Clip the global gradient norm to this (`None`: no clipping).
    pub max_grad_norm: Option<f32>,
    /// The parameters `optimizer.weight_decay` applies to: all (the
    /// default here, PyTorch's `AdamW(model.parameters())` and the
    /// reference fixture's) or the matrices only (nanoGPT's and llm.c's;
    /// `braid-gpt2 train`'s default).
    pub weight_decay_on: crate::optim::DecayOn,
    /// The device.
    pub backend: BackendKind,
    /// Data-parallel ranks (CPU: threads of this process).
    pub ranks: usize,
    /// Compute streams per rank.
    pub streams: usize,
    /// Placement policy.
    pub policy: Policy,
    /// CPU: let the default placement use every compute stream of every rank
    /// whatever the process's core budget (`RuntimeBuilder::oversubscribe`).
    pub oversubscribe: bool,
    /// Pin each rank's stream threads to cores
    /// ([`braid::RuntimeBuilder::pin_threads`]; a rank computes on one core
    /// and communicates on another). `None`, the default: pinned when
    /// several CPU ranks share this process's cores, where it keeps each
    /// rank's collectives beside its compute (docs/engine.md); not on GPUs.
    /// `BRAID_PIN_THREADS` overrides either way.
    pub pin_threads: Option<bool>,
    /// Gradient bucket cap in bytes (with `auto_bucket_cap`: the first
    /// step's cap, and the fallback).
    pub bucket_cap_bytes: usize,
    /// Choose the bucket cap after the first step from a model of the
    /// reducer calibrated on that step (`BucketConfig::auto_cap`; the CLI's
    /// `--bucket-cap-mb auto`). Several ranks, plain buckets (no
    /// compression); with one rank the cap stays.
    pub auto_bucket_cap: bool,
    /// Cap of the first gradient bucket in bytes.
    pub first_bucket_bytes: usize,
    /// The seed of the run, recorded in its checkpoints, and the seed of the
    /// data's order when `shuffle` is on. `train` does not initialise
    /// parameters: pass the same seed to [`StartState::fresh`].
    pub seed: u64,
    /// Where rank 0 saves checkpoints (`None`: no checkpoints); made if need
    /// be before the first step. A checkpoint already there is replaced (the
    /// command line refuses that without `--resume`).
    pub checkpoint_dir: Option<PathBuf>,
    /// Also save every this many steps (`None`: only at the end).
    pub checkpoint_every: Option<u64>,
    /// Write a Chrome trace of every rank here at the end.
    pub trace: Option<PathBuf>,
    /// How long a rank waits for the others in a collective before it
    /// fails, naming the collective: CPU ranks, and GPU ranks' NCCL
    /// communicators (whose watchdog then aborts the communicator).
    pub comm_timeout: Duration,
    /// How gradient buckets travel (default: plain `f32`).
    /// [`Compression::Bf16`] runs on host buffers: CPU ranks only.
    pub compression: Compression,
    /// Record the steady-state step (from the third step of a run: the
    /// reducer's buckets are rebuilt after the first) and replay it after:
    /// no dependency inference or placement per step. Off: every step is
    /// submitted eagerly (automatic replay off too,
    /// [`braid::RuntimeBuilder::auto_replay`]). The results are the same,
    /// bit for bit.
    pub replay: bool,
    /// Replay the recorded step as one unit ([`braid::RuntimeBuilder::graphs`]):
    /// on CUDA a CUDA graph captured at the first replay, one launch per
    /// step (a step with collectives, i.e. more than one rank, is cut
    /// around them: a graph per run of other tasks, the collectives as
    /// ordinary tasks between them). Off by default here; `braid-gpt2
    /// train` turns it on for one GPU rank.
    pub graphs: bool,
    /// With `graphs`, capture the step's collectives into its graphs too
    /// instead of cutting the graphs around them
    /// ([`braid::RuntimeBuilder::graph_collectives`]). Off by default.
    pub graph_collectives: bool,
    /// Run the gradient reducer (and the loss all-reduce) with one rank too,
    /// as PyTorch DDP does at world size 1: the collectives are no-ops, but
    /// the trace holds every bucket with its size and ready point, which the
    /// step simulator needs to predict more ranks from one
    /// (`benches/src/bin/simulate.rs`). Off by default.
    pub reduce_single_rank: bool,
    /// Reduce the tied embedding's two gradient writers on their own
    /// ([`Gpt2Model::set_split_tied`](crate::model::Gpt2Model::set_split_tied)): the
    /// classifier's dense part all-reduced as soon as it is written, at the
    /// start of the backward pass, the encoder's token rows exchanged at the
    /// end ([`braid::Reducer::sparse_ready`]). With a reducer only (ignored
    /// otherwise), on every backend and dtype, and only where it pays
    /// ([`TrainOptions::splits_tied`]: fewer token rows gathered at the end
    /// than the embedding's all-reduce would move there). On by default.
    pub tied_split: bool,
    /// The fused kernels the model uses
    /// ([`ModelOptions::fusion`](crate::model::ModelOptions)), none by
    /// default.
    pub fusion: crate::model::Fusion,
    /// The run's priority class among the Braid programs of the process
    /// (`best-effort` trains in the cycles a latency-critical program
    /// beside it leaves, docs/tenants.md). `None`, the default: the
    /// placement file's `[runtime] class`, else normal; a class set here
    /// wins over the file's.
    pub class: Option<braid::Class>,
    /// On CUDA, SMs of the device this run's compute kernels leave to the
    /// other programs on it ([`braid::RuntimeBuilder::spare_sms`]; 0, the
    /// default: none). For a best-effort run beside a latency-critical one.
    pub spare_sms: u32,
    /// On CUDA, for a best-effort run: its streams' launch window in device
    /// time ([`braid::RuntimeBuilder::device_bundle`]; `None`, the default:
    /// the builder's, 1 ms).
    pub device_bundle: Option<std::time::Duration>,
    /// ZeRO stage: 0 (off) or 1 (ZeRO-1, with a reducer: each bucket is
    /// reduce-scattered, each rank keeps AdamW state for and updates its
    /// shard only, the parameters are all-gathered at the start of the next
    /// step; see `docs/collectives.md`). Plain buckets only (no
    /// compression), `f32` or bf16 (`dtype`). With one
    /// rank and no reducer (`reduce_single_rank` off) it changes nothing.
    /// Default 0.
    pub zero: u8,
    /// The storage type of parameters, gradients and activations
    /// ([`ModelOptions::dtype`](crate::model::ModelOptions)): `f32` by
    /// default; bf16 (mixed precision, `f32` master weights and moments,
    /// gradient buckets all-reduced in bf16, the tied embedding's token rows
    /// exchanged in bf16).
    pub dtype: Dtype,
    /// A placement file (docs/scopes.md) every rank's runtime is built with:
    /// it places the model's scopes (`forward/layer{l}`, `backward/layer{l}`,
    /// `optimizer`, …) without changing the program. `None`: the file named
    /// by `BRAID_PLACEMENT`, if set.
    pub placement: Option<braid::PlacementFile>,
    /// Evaluate held-out data during training (`None`, the default: never).
    pub validation: Option<Validation>,
    /// Generate text during training (`None`, the default: never).
    pub generation: Option<Generation>,
    /// A flag that, once set (from a signal handler, another thread), stops
    /// the run early: every rank stops at the same step, the one in
    /// progress or the next, then saves the checkpoint and writes the trace
    /// as a finished run does ([`TrainReport::final_step`](super::TrainReport)
    /// is that step). Honoured when every rank is in this process (CPU
    /// ranks, one process driving its GPUs); a torchrun launch of several
    /// processes ignores it, since its processes would have to agree on the
    /// step. `None`, the default: the run goes to `steps`.
    pub stop: Option<Arc<AtomicBool>>,
    /// A fault to inject, for tests of what the other ranks do when one
    /// stops in the middle of a step. Not for training.
    #[doc(hidden)]
    pub fault: Option<Fault>,
}

/// The value a checkpoint saved before `key` was recorded had, where that
/// is known: settings added later, whose absence means the behaviour of the
/// time (no accumulation, data in order, every parameter decayed). `None`
/// for the others, and for extras that record nothing (not the trainer's).
fn implied(key: &str, extra: &BTreeMap<String, Value>) -> Option<Value> {
    if extra.is_empty() {
        return None;
    }
    match key {
        "grad_accum" => Some(1.into()),
        "data_order" => Some("in order".into()),
        "weight_decay_on" => Some(crate::optim::DecayOn::All.name().into()),
        _ => None,
    }
}

/// Validation during training ([`TrainOptions::validation`]): after every
/// `every` steps, and after the run's last step, the mean next-token loss of
/// the parameters just updated over the first `windows` windows of `data`
/// (windows of `seq_len` tokens, as [`evaluate`](super::evaluate) and
/// `braid-gpt2 eval --seq-len` score them), reported with the step
/// ([`StepReport::val_loss`](super::StepReport)). A fresh run also scores
/// the parameters it starts from, before its first step, as nanoGPT and
/// llm.c do at step 0 ([`StepReport::start_val_loss`](super::StepReport)).
/// The ranks score the
/// windows a batch of `batch_size` at a time, batch `i` on rank `i mod W`;
/// training is left exactly as it was (the same bits).
#[derive(Debug, Clone)]
pub struct Validation {
    /// The held-out tokens.
    pub data: TokenSource,
    /// Evaluate after every this many steps; at least 1.
    pub every: u64,
    /// Windows per evaluation, from the start of `data` (all of them if it
    /// has fewer); at least 1.
    pub windows: usize,
}

/// Text generated during training ([`TrainOptions::generation`]), as llm.c
/// prints a sample every few steps: after every `every` steps and after
/// the run's last, every rank continues `prompt` by `tokens` tokens drawn
/// with `how` from the parameters just updated (the same tokens on every
/// rank; a stop cuts them short), reported with the step
/// ([`StepReport::sample`](super::StepReport)). Each step's draws come from
/// the run's seed and the step number
/// ([`generation_seed`](super::generation_seed)), so a resumed run draws
/// what an uninterrupted one does; training is left exactly as it was (the
/// same bits).
#[derive(Debug, Clone, PartialEq)]
pub struct Generation {
    /// Generate after every this many steps; at least 1.
    pub every: u64,
    /// Tokens to generate; at least 1.
    pub tokens: usize,
    /// The tokens to continue (GPT-2's `<|endoftext|>` alone: the start of
    /// a document); at least one, each in the vocabulary.
    pub prompt: Vec<u32>,
    /// How each token is drawn (temperature 1 and no filter, llm.c's
    /// sampler, by default).
    pub how: crate::model::Sampling,
}

/// A task that panics (or, with `hang`, never returns) on rank `rank` at the
/// start of step `step`, eager or replayed: the step's gradient buckets
/// depend on it, so that rank's collectives of the step are skipped (or never
/// issued) and the others' cannot finish.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fault {
    /// The rank that fails.
    pub rank: usize,
    /// The step in which it fails.
    pub step: u64,
    /// The task never returns instead of panicking.
    pub hang: bool,
}

impl Default for TrainOptions {
    /// The tiny model, 2 CPU ranks, `B 4 × T 32`, 10 steps, AdamW `lr 1e-3,
    /// betas (0.9, 0.95), wd 0.1`, clip at 1.0, PyTorch's bucket caps.
    fn default() -> Self {
        TrainOptions {
            model: Gpt2Config::tiny(),
            batch_size: 4,
            seq_len: 32,
            grad_accum: 1,
            shuffle: false,
            steps: 10,
            optimizer: AdamWHyper {
                learning_rate: 1e-3,
                beta1: 0.9,
                beta2: 0.95,
                eps: 1e-8,
                weight_decay: 0.1,
            },
            lr_schedule: crate::optim::LrSchedule::constant(),
            max_grad_norm: Some(1.0),
            weight_decay_on: crate::optim::DecayOn::All,
            backend: BackendKind::Cpu,
            ranks: 2,
            streams: 2,
            policy: Policy::Affinity,
            oversubscribe: false,
            pin_threads: None,
            bucket_cap_bytes: 25 << 20,
            auto_bucket_cap: false,
            first_bucket_bytes: 1 << 20,
            seed: 1337,
            checkpoint_dir: None,
            checkpoint_every: None,
            trace: None,
            comm_timeout: braid::comm::DEFAULT_TIMEOUT,
            compression: Compression::None,
            replay: true,
            graphs: false,
            graph_collectives: false,
            reduce_single_rank: false,
            tied_split: true,
            fusion: crate::model::Fusion::NONE,
            class: None,
            spare_sms: 0,
            device_bundle: None,
            zero: 0,
            dtype: Dtype::F32,
            placement: None,
            validation: None,
            generation: None,
            stop: None,
            fault: None,
        }
    }
}

impl TrainOptions {
    /// Whether a run of `world` ranks splits the tied gradient: with a
    /// reducer (several ranks, or `reduce_single_rank`) and `tied_split` on,
    /// when the split's exchange at the end of the step is the smaller. The
    /// split all-reduces the classifier's part during the backward pass and
    /// gathers every rank's `B·T` token rows at the end: each rank receives
    /// `(W − 1)·B·T` rows. Whole, the embedding's ring all-reduce at the end
    /// moves `2·(W − 1)/W·V` rows per rank. So the split pays while
    /// `B·T·W < 2·V` (both over the same links; docs/collectives.md has the
    /// simulator's figures: at B 8 × T 1024 it wins on 8 H100s and loses on
    /// 2 × 8 over InfiniBand and on 64).
    ///
    /// Not with gradient accumulation (`grad_accum` above 1): the encoder's
    /// rows of every micro-batch but the last would have to be kept until
    /// the exchange.
    pub fn splits_tied(&self, world: usize) -> bool {
        let reducer = world > 1 || self.reduce_single_rank;
        let rows = self.batch_size * self.seq_len * world;
        reducer && self.tied_split && self.grad_accum == 1 && rows < 2 * self.model.vocab_size
    }

    /// The settings of a run of `world` ranks on `data` that decide its
    /// numbers, as `(key, what, value)`: a checkpoint keeps them in its
    /// extras ([`Checkpoint::extra`]), and a run that resumes it compares
    /// them ([`resume_differences`](Self::resume_differences)). The data
    /// is known by where it came from (a file by its canonical path,
    /// [`TokenSource::canonical_origin`]; `builtin:train`) and its length:
    /// another file, or the same one grown, is a change. The fused kernels
    /// are compared as a set: flash attention rounds otherwise everywhere,
    /// the fused classifier its losses (and in bf16 its gradients); the
    /// residual + layer norm and the GELU recomputation leave every bit of
    /// a CPU run as it was, but on CUDA in bf16 they change which cuBLASLt
    /// epilogue computes the GELU and its gradient; the set is compared
    /// whole on every device. The tied split as this run of `world` ranks
    /// takes it ([`splits_tied`](Self::splits_tied)): with several ranks it
    /// adds the ranks' rows after the average instead of before it, which
    /// rounds otherwise. The device (`cpu` or `cuda`: their kernels round
    /// differently), and on CUDA in bf16 with the fused attention which
    /// attention kernels were asked for
    /// ([`attention_kernels`](crate::kernels::flash_attention::attention_kernels)).
    /// How the steps are run (streams, policy, replay, graphs) is not among
    /// them: it does not change a bit; nor are the kernels' experimental
    /// environment switches (`BRAID_CUBLASLT_GELU`, …).
    fn result_settings(
        &self,
        world: usize,
        data: &TokenSource,
    ) -> Vec<(&'static str, &'static str, Value)> {
        let o = &self.optimizer;
        let s = &self.lr_schedule;
        // An `f32` as the `f64` of its shortest decimal (0.9, where
        // `f64::from` gives 0.8999999761581421): what a reader of the
        // checkpoint's header sees, and the same `f32` again.
        let f = |x: f32| Value::from(x.to_string().parse::<f64>().unwrap_or(f64::from(x)));
        // ZeRO-1 shards only what a reducer reduces.
        let zero = if world > 1 || self.reduce_single_rank {
            self.zero
        } else {
            0
        };
        let device = match self.backend {
            BackendKind::Auto => super::resolve_train_backend(self).unwrap_or(BackendKind::Cpu),
            kind => kind,
        };
        let on_gpu = matches!(device, BackendKind::Cuda { .. });
        let attention = (on_gpu && self.dtype == Dtype::Bf16 && self.fusion.attention).then(|| {
            (
                "attention",
                "attention kernels",
                crate::kernels::flash_attention::attention_kernels()
                    .to_string()
                    .into(),
            )
        });
        let mut settings = vec![
            ("data", "training data", data.canonical_origin().into()),
            ("data_tokens", "training tokens", data.len().into()),
            (
                "data_order",
                "data order",
                match self.shuffle {
                    true => format!("shuffled with seed {}", self.seed),
                    false => "in order".into(),
                }
                .into(),
            ),
            ("batch_size", "batch size", self.batch_size.into()),
            ("seq_len", "sequence length", self.seq_len.into()),
            (
                "grad_accum",
                "micro-batches per step",
                self.grad_accum.into(),
            ),
            ("world_size", "ranks", world.into()),
            ("zero", "ZeRO stage", u64::from(zero).into()),
            (
                "device",
                "device",
                if on_gpu { "cuda" } else { "cpu" }.into(),
            ),
            ("dtype", "storage type", self.dtype.name().into()),
            ("fusion", "fused kernels:", self.fusion.to_string().into()),
            (
                "tied_split",
                "tied gradient split",
                self.splits_tied(world).into(),
            ),
            (
                "compression",
                "gradient compression",
                match self.compression {
                    Compression::None => "none",
                    Compression::Bf16 => "bf16",
                    Compression::Hook(_) => "hook",
                }
                .into(),
            ),
            ("peak_lr", "peak learning rate", f(o.learning_rate)),
            ("beta1", "AdamW beta1", f(o.beta1)),
            ("beta2", "AdamW beta2", f(o.beta2)),
            ("eps", "AdamW epsilon", f(o.eps)),
            ("weight_decay", "weight decay", f(o.weight_decay)),
            (
                "weight_decay_on",
                "weight decay on",
                self.weight_decay_on.name().into(),
            ),
            (
                "max_grad_norm",
                "gradient clipping norm",
                self.max_grad_norm.map(f64::from).into(),
            ),
            ("lr_schedule", "learning-rate schedule", s.kind().into()),
            ("warmup_steps", "warm-up steps", s.warmup_steps.into()),
            (
                "lr_decay_end",
                "learning-rate decay to step",
                s.decay_end.into(),
            ),
            (
                "final_lr_fraction",
                "final learning-rate fraction",
                f(s.final_fraction),
            ),
        ];
        settings.extend(attention);
        settings
    }

    /// What a checkpoint of this run of `world` ranks on `data` keeps
    /// beside its tensors: the settings that decide its numbers (the data's
    /// origin and length among them), and the seed.
    pub fn checkpoint_extras(&self, world: usize, data: &TokenSource) -> BTreeMap<String, Value> {
        let mut extra: BTreeMap<String, Value> = self
            .result_settings(world, data)
            .into_iter()
            .map(|(k, _, v)| (k.to_owned(), v))
            .collect();
        extra.insert("seed".into(), self.seed.into());
        extra
    }

    /// How this run of `world` ranks on `data` differs from the one that
    /// saved a checkpoint with these extras, one line per setting (`what`:
    /// this run's value, the checkpoint's). Empty when the resumed run
    /// continues as the saved one would have, bit for bit. Settings the
    /// checkpoint does not record (an older one) are not compared; an
    /// older checkpoint's schedule kind is told by its final fraction, and
    /// its data path, recorded as given, is compared as the file it names
    /// from this run's directory. A schedule of another kind is named by
    /// its kind (`constant`, `cosine`), not by the parts the kinds differ
    /// in; where a constant rate's decay would end is not compared.
    pub fn resume_differences(
        &self,
        extra: &BTreeMap<String, Value>,
        world: usize,
        data: &TokenSource,
    ) -> Vec<String> {
        // Floats are kept as `f64` from `f32`: shown as the `f32` they were.
        let show = |v: &Value| match v {
            Value::Number(n) if n.is_f64() => {
                let x = n.as_f64().unwrap_or(0.0) as f32;
                match x.abs() {
                    a if a != 0.0 && !(1e-4..1e6).contains(&a) => format!("{x:e}"),
                    _ => format!("{x}"),
                }
            }
            Value::String(s) => s.clone(),
            Value::Bool(on) => if *on { "on" } else { "off" }.into(),
            Value::Null => "none".into(),
            v => v.to_string(),
        };
        let kind_now = self.lr_schedule.kind();
        let kind_then: Option<Value> = extra.get("lr_schedule").cloned().or_else(|| {
            let fraction = extra.get("final_lr_fraction")?.as_f64()? as f32;
            let s = crate::optim::LrSchedule {
                final_fraction: fraction,
                ..self.lr_schedule
            };
            Some(s.kind().into())
        });
        let kind_changed = kind_then.as_ref().is_some_and(|k| *k != kind_now);
        self.result_settings(world, data)
            .into_iter()
            .filter_map(|(key, what, now)| {
                let then = match key {
                    "lr_schedule" => kind_then.clone()?,
                    _ => extra.get(key).cloned().or_else(|| implied(key, extra))?,
                };
                let same = match key {
                    // The same file by another name: an older checkpoint's
                    // path as given, resolved from this run's directory.
                    "data" => {
                        now == then
                            || then
                                .as_str()
                                .and_then(|p| std::fs::canonicalize(p).ok())
                                .is_some_and(|p| now == p.display().to_string())
                    }
                    // Named by the kind instead.
                    "lr_decay_end" | "final_lr_fraction" if kind_changed => true,
                    // A constant rate ends no decay.
                    "lr_decay_end" if kind_now == "constant" => true,
                    // Floats as the `f32` they were: an older checkpoint
                    // kept them widened (0.8999999761581421 for 0.9).
                    _ => match (now.as_f64(), then.as_f64()) {
                        (Some(a), Some(b)) if now.is_f64() || then.is_f64() => a as f32 == b as f32,
                        _ => now == then,
                    },
                };
                (!same)
                    .then(|| format!("{what} {} (the checkpoint's: {})", show(&now), show(&then)))
            })
            .collect()
    }

    /// Checks the options before any rank starts ([`train`](super::train)
    /// does; a caller may too, to refuse bad options before it prints
    /// anything).
    pub fn check(&self) -> Result<()> {
        self.model.validate()?;
        let bad =
            |what: &'static str, reason: String| Err(Gpt2Error::InvalidSetting { what, reason });
        if self.ranks == 0 {
            return bad("number of ranks", "must be at least 1".into());
        }
        if self.streams == 0 {
            return bad("number of streams", "must be at least 1".into());
        }
        check_batch_shape(self.batch_size, self.seq_len, &self.model)?;
        if self.grad_accum == 0 {
            return bad(
                "gradient accumulation",
                "must be at least 1 micro-batch".into(),
            );
        }
        if let Some(v) = &self.validation {
            if v.every == 0 || v.windows == 0 {
                return bad(
                    "validation",
                    "its interval and its number of windows must be at least 1".into(),
                );
            }
            super::check_eval(&self.model, &v.data, self.seq_len, self.batch_size)?;
        }
        if let Some(g) = &self.generation {
            if g.every == 0 || g.tokens == 0 || g.prompt.is_empty() {
                return bad(
                    "generation",
                    "its interval, its number of tokens and its prompt must be at least 1".into(),
                );
            }
            crate::data::check_ids(&g.prompt, self.model.vocab_size, "generation prompt")?;
            g.how.check()?;
        }
        if self.bucket_cap_bytes == 0 || self.first_bucket_bytes == 0 {
            return bad("bucket cap", "must be positive".into());
        }
        // PyTorch's AdamW refuses the same values (0 trains nothing: the
        // parameters stay as they start, a way to score or export them).
        let lr = self.optimizer.learning_rate;
        if !(lr.is_finite() && lr >= 0.0) {
            return bad(
                "learning rate",
                format!("{lr} is not a number of 0 or more"),
            );
        }
        // PyTorch's AdamW refuses the same values.
        let o = &self.optimizer;
        for (what, x) in [("AdamW beta1", o.beta1), ("AdamW beta2", o.beta2)] {
            if !(0.0..1.0).contains(&x) {
                return bad(what, format!("{x} is not in [0, 1)"));
            }
        }
        for (what, x) in [("AdamW epsilon", o.eps), ("weight decay", o.weight_decay)] {
            if !(x.is_finite() && x >= 0.0) {
                return bad(what, format!("{x} is not a number at or above 0"));
            }
        }
        if let Some(c) = self.max_grad_norm.filter(|c| !(c.is_finite() && *c > 0.0)) {
            return bad(
                "gradient clipping norm",
                format!("{c} is not a positive number (`--grad-clip 0` turns clipping off)"),
            );
        }
        self.lr_schedule.check()?;
        if self.steps == 0 {
            return bad(
                "steps",
                "0 trains nothing: give the step to train to (at least 1)".into(),
            );
        }
        if self.auto_bucket_cap && !matches!(self.compression, Compression::None) {
            return bad(
                "bucket cap",
                "auto is chosen for plain buckets: with a compression, give the cap in MiB".into(),
            );
        }
        if self.zero > 1 {
            return bad(
                "ZeRO stage",
                format!("{} is not supported (0: off, 1: ZeRO-1)", self.zero),
            );
        }
        if self.zero == 1 && !matches!(self.compression, Compression::None) {
            return bad(
                "ZeRO stage",
                "ZeRO-1 reduce-scatters the buckets as they are: turn the compression off".into(),
            );
        }
        if self.checkpoint_every == Some(0) {
            return bad("checkpoint interval", "must be at least 1 step".into());
        }
        if self.checkpoint_every.is_some() && self.checkpoint_dir.is_none() {
            return bad(
                "checkpoint interval",
                "there is no checkpoint directory to save into (checkpoint_dir)".into(),
            );
        }
        if self.comm_timeout.is_zero() {
            return bad(
                "collective timeout",
                "0 fails every collective at once: give a positive duration".into(),
            );
        }
        if self.dtype != Dtype::F32 && matches!(self.compression, Compression::Bf16) {
            return bad(
                "compression",
                format!(
                    "{} gradients travel in bf16 already: drop --compression bf16",
                    self.dtype
                ),
            );
        }
        Ok(())
    }
}

/// Checks `batch_size` sequences of `seq_len` tokens for `cfg`: a positive
/// batch, a sequence length within the model's context (training and
/// evaluation alike).
pub(super) fn check_batch_shape(batch_size: usize, seq_len: usize, cfg: &Gpt2Config) -> Result<()> {
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
    Ok(())
}

/// AdamW's first and second moments, in layout order.
pub type Moments = (Arc<Vec<f32>>, Arc<Vec<f32>>);

/// Where a run starts: parameters, optimizer state, step and data position.
#[derive(Debug, Clone)]
pub struct StartState {
    /// The model the parameters are of, when known ([`fresh`](Self::fresh),
    /// [`from_checkpoint`](Self::from_checkpoint)): `train` refuses options
    /// for another model, even one with as many parameters.
    pub config: Option<Gpt2Config>,
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
    /// A fresh run from GPT-2's initialisation with `seed`. Panics where
    /// [`try_fresh`](Self::try_fresh) returns an error.
    pub fn fresh(cfg: &Gpt2Config, seed: u64) -> Self {
        Self {
            config: Some(*cfg),
            ..Self::from_params(init_params(cfg, seed))
        }
    }

    /// [`fresh`](Self::fresh), with an error for an invalid configuration
    /// or parameters the host's memory cannot hold.
    pub fn try_fresh(cfg: &Gpt2Config, seed: u64) -> Result<Self> {
        Ok(Self {
            config: Some(*cfg),
            ..Self::from_params(crate::model::try_init_params(cfg, seed)?)
        })
    }

    /// A fresh run from given parameters (e.g. pretrained weights); `train`
    /// checks only their number.
    pub fn from_params(params: Vec<f32>) -> Self {
        StartState {
            config: None,
            params: Arc::new(params),
            moments: None,
            step: 0,
            loader: LoaderState::default(),
        }
    }

    /// A run resumed from a checkpoint: its parameters, moments, step and
    /// data position. The run's settings are the `TrainOptions` given to
    /// [`train`](super::train), which does not compare them with the
    /// checkpoint's: [`TrainOptions::resume_differences`] on the
    /// checkpoint's `extra` lists those that differ (what `braid-gpt2 train
    /// --resume` prints), and the seed and shuffling are the options', not
    /// restored.
    pub fn from_checkpoint(c: Checkpoint) -> Self {
        StartState {
            config: Some(c.config),
            params: Arc::new(c.params),
            moments: Some((Arc::new(c.adam_m), Arc::new(c.adam_v))),
            step: c.step,
            loader: c.loader,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Accumulation, validation and generation settings that cannot run are refused
    /// before any rank starts, naming what is wrong.
    #[test]
    fn unusable_accumulation_validation_and_generation_are_refused() {
        let with = |grad_accum, every, windows, tokens: usize| TrainOptions {
            grad_accum,
            validation: Some(Validation {
                data: TokenSource::from_tokens(vec![1u16; tokens], "val.bin"),
                every,
                windows,
            }),
            ..TrainOptions::default()
        };
        let t = TrainOptions::default().seq_len;
        assert!(with(1, 1, 1, t + 1).check().is_ok());
        let none = TrainOptions {
            steps: 0,
            ..TrainOptions::default()
        };
        assert!(none
            .check()
            .unwrap_err()
            .to_string()
            .contains("0 trains nothing"));
        for (o, needle) in [
            (with(0, 1, 1, t + 1), "gradient accumulation"),
            (with(1, 0, 1, t + 1), "validation"),
            (with(1, 1, 0, t + 1), "validation"),
            (with(1, 1, 1, t), "too few tokens (32) for one window"),
        ] {
            let e = o.check().unwrap_err().to_string();
            assert!(e.contains(needle), "{e}");
        }
        let gen = |every, tokens, prompt: Vec<u32>, temperature| TrainOptions {
            generation: Some(Generation {
                every,
                tokens,
                prompt,
                how: crate::model::Sampling {
                    temperature,
                    ..Default::default()
                },
            }),
            ..TrainOptions::default()
        };
        let v = TrainOptions::default().model.vocab_size as u32;
        assert!(gen(1, 1, vec![v - 1], 1.0).check().is_ok());
        for (o, needle) in [
            (gen(0, 1, vec![1], 1.0), "generation"),
            (gen(1, 0, vec![1], 1.0), "generation"),
            (gen(1, 1, vec![], 1.0), "generation"),
            (gen(1, 1, vec![1, v], 1.0), "generation prompt"),
            (gen(1, 1, vec![1], -1.0), "temperature"),
        ] {
            let e = o.check().unwrap_err().to_string();
            assert!(e.contains(needle), "{e}");
        }
    }

    /// Floats are kept as their shortest decimal (what a reader of the
    /// checkpoint's header sees), and an older checkpoint's widened ones
    /// still compare equal.
    /// A learning rate of 0 is taken, as PyTorch's AdamW takes it (the
    /// parameters stay as they start); a negative or non-finite one is not.
    #[test]
    fn a_learning_rate_of_zero_is_taken() {
        let with = |learning_rate| TrainOptions {
            optimizer: AdamWHyper {
                learning_rate,
                ..TrainOptions::default().optimizer
            },
            ..TrainOptions::default()
        };
        assert!(with(0.0).check().is_ok());
        for lr in [-1e-3, f32::NAN, f32::INFINITY] {
            let e = with(lr).check().unwrap_err().to_string();
            assert!(e.contains("is not a number of 0 or more"), "{e}");
        }
    }

    #[test]
    fn float_extras_read_as_written() {
        let o = TrainOptions {
            optimizer: AdamWHyper {
                beta1: 0.9,
                learning_rate: 3e-4,
                ..TrainOptions::default().optimizer
            },
            max_grad_norm: Some(1.1),
            ..TrainOptions::default()
        };
        let data = TokenSource::from_tokens(vec![1u16; 100], "train.bin");
        let mut extra = o.checkpoint_extras(1, &data);
        let json = serde_json::to_string(&extra).unwrap();
        for want in [
            r#""beta1":0.9"#,
            r#""peak_lr":0.0003"#,
            r#""max_grad_norm":1.1"#,
        ] {
            assert!(json.contains(want), "{want} not in {json}");
        }
        for (key, x) in [("beta1", 0.9f32), ("peak_lr", 3e-4), ("max_grad_norm", 1.1)] {
            extra.insert(key.into(), Value::from(f64::from(x)));
        }
        assert!(json != serde_json::to_string(&extra).unwrap());
        assert_eq!(o.resume_differences(&extra, 1, &data), Vec::<String>::new());
        extra.insert("beta1".into(), Value::from(0.91));
        assert_eq!(
            o.resume_differences(&extra, 1, &data),
            ["AdamW beta1 0.9 (the checkpoint's: 0.91)"]
        );
    }

    /// A resumed run is compared with the saved one on the settings that
    /// decide its numbers only, and on those the checkpoint records.
    #[test]
    fn resume_differences_name_what_changed_and_only_that() {
        let saved = TrainOptions {
            lr_schedule: crate::optim::LrSchedule::cosine(4, 40, 0.1),
            ..TrainOptions::default()
        };
        let data = TokenSource::from_tokens(vec![1u16; 100], "train.bin");
        let extra = saved.checkpoint_extras(2, &data);
        assert!(saved.resume_differences(&extra, 2, &data).is_empty());
        // How the steps run changes no bit: not compared.
        let same_numbers = TrainOptions {
            streams: 7,
            policy: Policy::Single,
            replay: false,
            graphs: true,
            seed: 99,
            ..saved.clone()
        };
        assert!(same_numbers.resume_differences(&extra, 2, &data).is_empty());
        let other = TrainOptions {
            batch_size: saved.batch_size + 1,
            optimizer: AdamWHyper {
                learning_rate: 2e-3,
                ..saved.optimizer
            },
            max_grad_norm: None,
            lr_schedule: crate::optim::LrSchedule::cosine(4, 80, 0.1),
            dtype: Dtype::Bf16,
            grad_accum: 2,
            weight_decay_on: crate::optim::DecayOn::Matrices,
            ..saved.clone()
        };
        let other_data = TokenSource::from_tokens(vec![1u16; 120], "more.bin");
        let d = other.resume_differences(&extra, 4, &other_data);
        let want = [
            "training data more.bin (the checkpoint's: train.bin)".into(),
            "training tokens 120 (the checkpoint's: 100)".into(),
            format!(
                "batch size {} (the checkpoint's: {})",
                saved.batch_size + 1,
                saved.batch_size
            ),
            "micro-batches per step 2 (the checkpoint's: 1)".into(),
            "ranks 4 (the checkpoint's: 2)".into(),
            "storage type bf16 (the checkpoint's: fp32)".into(),
            // Gradient accumulation reduces the tied gradient whole.
            "tied gradient split off (the checkpoint's: on)".into(),
            format!(
                "peak learning rate 0.002 (the checkpoint's: {})",
                saved.optimizer.learning_rate
            ),
            "weight decay on matrices (the checkpoint's: all)".into(),
            format!(
                "gradient clipping norm none (the checkpoint's: {})",
                saved.max_grad_norm.unwrap()
            ),
            "learning-rate decay to step 80 (the checkpoint's: 40)".into(),
        ];
        assert_eq!(d, want);
        // Another device rounds otherwise; on CUDA in bf16 with the fused
        // attention, so may other attention kernels (recorded there only).
        let on_gpu = TrainOptions {
            backend: BackendKind::Cuda { device: 0 },
            ..saved.clone()
        };
        assert_eq!(
            on_gpu.resume_differences(&extra, 2, &data),
            ["device cuda (the checkpoint's: cpu)"]
        );
        assert!(!extra.contains_key("attention"));
        let fused_bf16 = TrainOptions {
            dtype: Dtype::Bf16,
            fusion: crate::model::Fusion::ALL,
            ..on_gpu
        };
        let gpu_extra = fused_bf16.checkpoint_extras(2, &data);
        assert_eq!(gpu_extra["device"], "cuda");
        assert!(gpu_extra.contains_key("attention"), "{gpu_extra:?}");
        // The same data by another name, or grown: each is said alone.
        let renamed = TokenSource::from_tokens(vec![1u16; 100], "copy.bin");
        assert_eq!(
            saved.resume_differences(&extra, 2, &renamed),
            ["training data copy.bin (the checkpoint's: train.bin)"]
        );
        let grown = TokenSource::from_tokens(vec![1u16; 101], "train.bin");
        assert_eq!(
            saved.resume_differences(&extra, 2, &grown),
            ["training tokens 101 (the checkpoint's: 100)"]
        );
        // An older checkpoint records fewer settings: only those compare,
        // and those added since with the behaviour of its time (no
        // accumulation, data in order, every parameter decayed).
        let old: BTreeMap<String, Value> = extra
            .into_iter()
            .filter(|(k, _)| k == "batch_size")
            .collect();
        let d = other.resume_differences(&old, 4, &other_data);
        assert_eq!(d[..2], want[2..4]);
        assert_eq!(d[2..], ["weight decay on matrices (the checkpoint's: all)"]);
        let shuffled = TrainOptions {
            shuffle: true,
            ..saved.clone()
        };
        assert_eq!(
            shuffled.resume_differences(&old, 2, &data),
            [format!(
                "data order shuffled with seed {} (the checkpoint's: in order)",
                saved.seed
            )]
        );
        assert!(saved
            .resume_differences(&BTreeMap::new(), 2, &data)
            .is_empty());
        // Far-off rates are shown in exponent form, not 31 digits.
        let wild = TrainOptions {
            optimizer: AdamWHyper {
                learning_rate: 1e30,
                ..saved.optimizer
            },
            ..saved.clone()
        };
        assert_eq!(
            saved.resume_differences(&wild.checkpoint_extras(2, &data), 2, &data),
            [format!(
                "peak learning rate {} (the checkpoint's: 1e30)",
                saved.optimizer.learning_rate
            )]
        );
    }

    /// The fused kernels and the tied split round otherwise: each is named
    /// as the command line takes it. The split is compared as the run takes
    /// it: with one rank and no reducer `--no-tied-split` changes nothing.
    #[test]
    fn resume_differences_name_the_fused_kernels_and_the_tied_split() {
        let saved = TrainOptions::default();
        let data = TokenSource::from_tokens(vec![1u16; 100], "train.bin");
        let extra = saved.checkpoint_extras(2, &data);
        assert_eq!(extra["fusion"], "none");
        assert_eq!(extra["tied_split"], true);
        let other = TrainOptions {
            fusion: crate::model::Fusion::parse("attention,classifier").unwrap(),
            tied_split: false,
            ..saved.clone()
        };
        assert_eq!(
            other.resume_differences(&extra, 2, &data),
            [
                "fused kernels: attention,classifier (the checkpoint's: none)",
                "tied gradient split off (the checkpoint's: on)",
            ]
        );
        let all = TrainOptions {
            fusion: crate::model::Fusion::ALL,
            ..saved.clone()
        };
        assert_eq!(
            saved.resume_differences(&all.checkpoint_extras(2, &data), 2, &data),
            ["fused kernels: none (the checkpoint's: all)"]
        );
        let one = saved.checkpoint_extras(1, &data);
        assert_eq!(one["tied_split"], false);
        let unsplit = TrainOptions {
            tied_split: false,
            ..saved.clone()
        };
        assert!(unsplit.resume_differences(&one, 1, &data).is_empty());
    }

    /// A file is compared by its canonical path, so the same file by
    /// another name is no change, whether the checkpoint recorded the
    /// canonical path or (an older one) the path as given; the built-in
    /// corpus by its name.
    #[test]
    fn resume_differences_know_a_file_by_any_of_its_names() {
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path();
        crate::data::write_token_file(d.join("t.bin"), &[1, 2, 3, 4]).unwrap();
        std::fs::create_dir(d.join("sub")).unwrap();
        let at = |p: std::path::PathBuf| TokenSource::open(p).unwrap();
        let plain = at(d.join("t.bin"));
        let o = TrainOptions::default();
        let extra = o.checkpoint_extras(2, &plain);
        let canonical = std::fs::canonicalize(d.join("t.bin")).unwrap();
        assert_eq!(extra["data"], canonical.display().to_string());
        for name in [d.join(".").join("t.bin"), d.join("sub/../t.bin")] {
            let same = at(name.clone());
            assert_ne!(same.origin(), plain.origin());
            assert!(
                o.resume_differences(&extra, 2, &same).is_empty(),
                "{name:?}"
            );
        }
        #[cfg(unix)]
        {
            std::os::unix::fs::symlink(d.join("t.bin"), d.join("link.bin")).unwrap();
            assert!(o
                .resume_differences(&extra, 2, &at(d.join("link.bin")))
                .is_empty());
        }
        // An older checkpoint's path as given.
        let mut old = extra.clone();
        old.insert(
            "data".into(),
            d.join("./sub/../t.bin").display().to_string().into(),
        );
        assert!(o.resume_differences(&old, 2, &plain).is_empty());
        // Another file with the same tokens is a change, named canonically.
        std::fs::copy(d.join("t.bin"), d.join("u.bin")).unwrap();
        let other = std::fs::canonicalize(d.join("u.bin")).unwrap();
        assert_eq!(
            o.resume_differences(&extra, 2, &at(d.join("sub/../u.bin"))),
            [format!(
                "training data {} (the checkpoint's: {})",
                other.display(),
                canonical.display()
            )]
        );
        // A file gone since is known by its path as given.
        std::fs::remove_file(d.join("u.bin")).unwrap();
        let gone = at(d.join("t.bin"));
        std::fs::remove_file(d.join("t.bin")).unwrap();
        assert_eq!(gone.canonical_origin(), gone.origin());
        // The built-in corpus: its name, whatever the directory holds.
        let train = TokenSource::builtin(crate::data::Split::Train).unwrap();
        let b = o.checkpoint_extras(2, &train);
        assert_eq!(b["data"], "builtin:train");
        assert!(o.resume_differences(&b, 2, &train).is_empty());
        let val = TokenSource::builtin(crate::data::Split::Val).unwrap();
        let d = o.resume_differences(&b, 2, &val);
        assert_eq!(
            d[0],
            "training data builtin:val (the checkpoint's: builtin:train)"
        );
    }

    /// Another kind of schedule is named by its kind, not by the parts the
    /// kinds differ in; within a kind, by the part; where a constant rate's
    /// decay would end is no change. An older checkpoint without the kind
    /// has it told by its final fraction.
    #[test]
    fn resume_differences_name_the_schedule_as_a_user_would() {
        let data = TokenSource::from_tokens(vec![1u16; 100], "train.bin");
        let with = |lr_schedule| TrainOptions {
            lr_schedule,
            ..TrainOptions::default()
        };
        let cosine = with(crate::optim::LrSchedule::cosine(4, 40, 0.1));
        let constant = with(crate::optim::LrSchedule::constant());
        let extra = cosine.checkpoint_extras(2, &data);
        assert_eq!(extra["lr_schedule"], "cosine");
        let want = [
            "learning-rate schedule constant (the checkpoint's: cosine)",
            "warm-up steps 0 (the checkpoint's: 4)",
        ];
        assert_eq!(constant.resume_differences(&extra, 2, &data), want);
        let mut old = extra.clone();
        old.remove("lr_schedule");
        assert_eq!(constant.resume_differences(&old, 2, &data), want);
        assert_eq!(
            cosine.resume_differences(&constant.checkpoint_extras(2, &data), 2, &data),
            [
                "learning-rate schedule cosine (the checkpoint's: constant)",
                "warm-up steps 4 (the checkpoint's: 0)",
            ]
        );
        // The parts within a kind.
        let shorter = with(crate::optim::LrSchedule::cosine(4, 30, 0.2));
        assert_eq!(
            shorter.resume_differences(&extra, 2, &data),
            [
                "learning-rate decay to step 30 (the checkpoint's: 40)",
                "final learning-rate fraction 0.2 (the checkpoint's: 0.1)",
            ]
        );
        // A cosine to 1 of the peak is a constant rate after its warm-up:
        // the decay's end changes nothing.
        let flat = |end| with(crate::optim::LrSchedule::cosine(0, end, 1.0));
        assert!(flat(40)
            .resume_differences(&flat(80).checkpoint_extras(2, &data), 2, &data)
            .is_empty());
        assert!(constant
            .resume_differences(&flat(80).checkpoint_extras(2, &data), 2, &data)
            .is_empty());
    }

    /// A checkpoint saved before a setting was recorded resumes without a
    /// note about it, whatever this run's value.
    #[test]
    fn settings_an_older_checkpoint_lacks_are_not_compared() {
        let data = TokenSource::from_tokens(vec![1u16; 100], "train.bin");
        let saved = TrainOptions::default();
        let mut old = saved.checkpoint_extras(2, &data);
        for key in ["fusion", "tied_split", "lr_schedule"] {
            old.remove(key);
        }
        let now = TrainOptions {
            fusion: crate::model::Fusion::ALL,
            tied_split: false,
            ..saved.clone()
        };
        assert!(now.resume_differences(&old, 2, &data).is_empty());
        // Only what it records: here the batch size.
        let batch: BTreeMap<String, Value> =
            old.into_iter().filter(|(k, _)| k == "batch_size").collect();
        let cosine_now = TrainOptions {
            lr_schedule: crate::optim::LrSchedule::cosine(4, 40, 0.1),
            ..now
        };
        assert!(cosine_now.resume_differences(&batch, 2, &data).is_empty());
    }

    /// The split where its exchange is the smaller (B·T·W < 2·V), with a
    /// reducer and `tied_split` on only.
    #[test]
    fn the_tied_split_is_chosen_where_its_exchange_is_smaller() {
        let o = TrainOptions {
            model: Gpt2Config::gpt2_124m(),
            batch_size: 8,
            seq_len: 1024,
            ..TrainOptions::default()
        };
        // 8 ranks: 65,536 rows gathered against 2 · 50,257; 16: 131,072.
        assert!(o.splits_tied(8));
        assert!(!o.splits_tied(16));
        assert!(!o.splits_tied(1), "no reducer at one rank");
        let one = TrainOptions {
            reduce_single_rank: true,
            ..o.clone()
        };
        assert!(one.splits_tied(1));
        let off = TrainOptions {
            tied_split: false,
            ..o.clone()
        };
        assert!(!off.splits_tied(8));
        // The main job: 2 ranks of B 4 × T 64 on `small`.
        assert!(TrainOptions::default().splits_tied(2));
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
            (
                TrainOptions {
                    zero: 2,
                    ..ok.clone()
                },
                "ZeRO stage",
            ),
            (
                TrainOptions {
                    zero: 1,
                    compression: Compression::Bf16,
                    ..ok.clone()
                },
                "ZeRO stage",
            ),
        ] {
            let err = opts.check().unwrap_err().to_string();
            assert!(err.contains(what), "{err}");
        }
    }

    /// What PyTorch's AdamW refuses (betas outside [0, 1), a negative or
    /// NaN epsilon or weight decay), and a clipping norm that is not
    /// positive; the edges it takes pass.
    #[test]
    fn optimizer_settings_are_checked_as_pytorch_does() {
        let ok = TrainOptions::default();
        let with = |optimizer: AdamWHyper| {
            TrainOptions {
                optimizer,
                ..ok.clone()
            }
            .check()
        };
        let h = ok.optimizer;
        for (bad, what) in [
            (AdamWHyper { beta1: 1.0, ..h }, "beta1"),
            (AdamWHyper { beta2: -0.1, ..h }, "beta2"),
            (
                AdamWHyper {
                    beta2: f32::NAN,
                    ..h
                },
                "beta2",
            ),
            (AdamWHyper { eps: -1e-8, ..h }, "epsilon"),
            (
                AdamWHyper {
                    weight_decay: f32::NAN,
                    ..h
                },
                "weight decay",
            ),
        ] {
            let err = with(bad).unwrap_err().to_string();
            assert!(err.contains(what), "{err}");
        }
        with(AdamWHyper {
            beta1: 0.0,
            eps: 0.0,
            weight_decay: 0.0,
            ..h
        })
        .unwrap();
        for clip in [0.0, -1.0, f32::NAN] {
            let o = TrainOptions {
                max_grad_norm: Some(clip),
                ..ok.clone()
            };
            let err = o.check().unwrap_err().to_string();
            assert!(err.contains("clipping"), "{err}");
        }
        TrainOptions {
            max_grad_norm: None,
            ..ok.clone()
        }
        .check()
        .unwrap();
    }
}

//! `braid-gpt2`: train GPT-2 data-parallel on Braid, evaluate it, sample from it.
//!
//! ```text
//! braid-gpt2                      # = train: small model, built-in data, 2 CPU ranks, trace.json
//! braid-gpt2 train --model small --data tokens.bin --steps 20 --ranks 4 --trace t.json
//! braid-gpt2 train --device cuda --ranks 1 --model gpt2 --batch-size 8 --seq-len 1024
//! torchrun --standalone --nproc-per-node 4 --no-python braid-gpt2 train --device cuda --model gpt2
//! braid-gpt2 eval --weights model.safetensors --tokens val.bin --seq-len 64
//! braid-gpt2 eval --checkpoint ckpt/ --tokens builtin:val --seq-len 64
//! braid-gpt2 sample --checkpoint ckpt/ --prompt "Once upon a time" --tokens 40
//! braid-gpt2 export --checkpoint ckpt/ --save-weights hf/   # hf/model.safetensors + config.json
//! ```
//!
//! Every input is checked before anything is written: a bad weights file,
//! token file, configuration or checkpoint stops the program with a message
//! naming the problem and a non-zero exit status, leaving existing files as
//! they were.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use braid::comm::Compression;
use braid::{BackendKind, Policy};
use braid_gpt2::checkpoint::{
    check_checkpoint_dir, checkpoint_file, load_checkpoint, load_checkpoint_params,
    lock_checkpoint_dir, AdamWHyper,
};
use braid_gpt2::config::Gpt2Config;
use braid_gpt2::data::{TokenSource, Tokenizer};
use braid_gpt2::kernels::flash_attention::{
    attention_from_env, set_attention_kernels, AttentionKernels,
};
use braid_gpt2::model::{try_init_params, Dtype, Fusion, ModelOptions, Sampler, Sampling};
use braid_gpt2::optim::LrSchedule;
use braid_gpt2::trainer::{
    check_eval, evaluate, model_runtime, resolve_train_backend, train, DistEnv, Generation,
    MetricsLog, StartState, StepReport, TrainOptions, Validation,
};
use braid_gpt2::weights::{load_hf_model, save_hf_model, HfOutput};
use clap::builder::TypedValueParser as _;
use clap::{Args, Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};

#[derive(Debug, Parser)]
#[command(
    name = "braid-gpt2",
    version,
    about = "GPT-2 as Braid tasks: data-parallel training, evaluation and sampling",
    long_about = "GPT-2 as Braid tasks: data-parallel training, evaluation and sampling.\n\n\
                  Without a command it trains the `small` model on the built-in data with \
                  2 CPU ranks and writes trace.json."
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Train (data-parallel over --ranks ranks).
    Train(Box<TrainArgs>),
    /// Mean next-token cross-entropy of weights on a token or text file.
    Eval(EvalArgs),
    /// Generate text.
    Sample(SampleArgs),
    /// Write a training checkpoint's parameters as Hugging Face weights.
    Export(ExportArgs),
    /// Tokenize a text file into an llm.c token file (.bin): the tokens
    /// `train --data TEXT` trains on, without tokenizing them at each run.
    Tokenize(TokenizeArgs),
}

#[derive(Debug, Args)]
#[command(args_override_self = true)]
struct TrainArgs {
    /// Model: tiny, small, gpt2, gpt2-medium, gpt2-large, gpt2-xl, or a JSON
    /// config file ({"max_seq_len", "vocab_size", "num_layers", "num_heads",
    /// "channels"}); a name wins over a file of that name (`./tiny` names
    /// the file). Default: small, or the configuration of --init-from /
    /// --resume.
    #[arg(long)]
    model: Option<String>,
    /// Training data: `builtin` (the built-in corpus's training split;
    /// `builtin:val` its validation split), a llm.c .bin token file,
    /// llm.c's shards by a pattern ('fineweb_train_*.bin': the files it
    /// matches in name order, one stream) or a UTF-8 text file.
    #[arg(long, default_value = "builtin")]
    data: String,
    /// Train until this many steps are done (a resumed run continues to
    /// it); at least 1.
    #[arg(long, default_value_t = 40)]
    steps: u64,
    /// Sequences per rank per step.
    #[arg(long, default_value_t = 4)]
    batch_size: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 64)]
    seq_len: usize,
    /// Take the data's windows of --seq-len tokens in a random order, a new
    /// one each epoch (drawn from --seed; resumable), instead of in order
    #[arg(long)]
    shuffle: bool,
    /// Micro-batches per step (gradient accumulation): each rank runs this
    /// many forward and backward passes of --batch-size sequences per
    /// optimizer step, adding their gradients, which are all-reduced once,
    /// under the last pass's backward. A step then trains on grad-accum ×
    /// batch-size × seq-len × ranks tokens in the memory of one
    /// micro-batch [default: 1]
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    grad_accum: Option<u64>,
    /// Evaluate held-out tokens after every N steps and after the last (and
    /// before the first step of a fresh run, as step 0): the mean next-token
    /// loss over --val-windows windows of --seq-len tokens of --val-data (as
    /// `eval --seq-len` scores them), printed with the step
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    val_every: Option<u64>,
    /// The held-out tokens of --val-every: builtin:val, a llm.c .bin token
    /// file, shards by a pattern ('fineweb_val_*.bin') or a UTF-8 text
    /// file. Default: builtin:val when --data is the built-in corpus
    #[arg(long, value_name = "DATA", requires = "val_every")]
    val_data: Option<String>,
    /// Windows per validation, from the start of --val-data (all of them if
    /// it has fewer) [default: 20 batches: 20 x batch-size x ranks]
    #[arg(
        long,
        value_name = "N",
        requires = "val_every",
        value_parser = clap::value_parser!(u64).range(1..)
    )]
    val_windows: Option<u64>,
    /// Generate text during training, as llm.c does: after every N steps
    /// and after the last, --sample-tokens tokens continuing
    /// --sample-prompt, drawn from the parameters just updated
    /// (temperature 1, from --seed and the step number; the same on every
    /// rank), printed after the step
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    sample_every: Option<u64>,
    /// Tokens generated each time (--sample-every) [default: 64]
    #[arg(
        long,
        value_name = "N",
        requires = "sample_every",
        value_parser = clap::value_parser!(u64).range(1..)
    )]
    sample_tokens: Option<u64>,
    /// The text the generated tokens continue (--sample-every) [default:
    /// the start of a document, GPT-2's <|endoftext|>]
    #[arg(long, value_name = "TEXT", requires = "sample_every")]
    sample_prompt: Option<String>,
    /// Tokens per optimizer step over all ranks (llm.c's total batch size):
    /// sets --grad-accum to this / (batch-size × seq-len × ranks), which
    /// must divide it
    #[arg(long, value_name = "TOKENS", conflicts_with = "grad_accum")]
    total_batch_size: Option<usize>,
    /// AdamW peak learning rate (see --lr-schedule).
    #[arg(long, allow_negative_numbers = true, default_value_t = 2e-3)]
    lr: f32,
    /// How the learning rate follows the step: `cosine` warms up linearly
    /// over --warmup-steps, then decays along a cosine to --min-lr-frac of
    /// --lr at the last step (nanoGPT's and llm.c's GPT-2 schedule);
    /// `constant` keeps --lr throughout (after any warm-up).
    #[arg(long, value_enum, default_value_t = LrScheduleArg::Cosine)]
    lr_schedule: LrScheduleArg,
    /// Steps of linear learning-rate warm-up to --lr: step s of N trains
    /// at s/N of --lr, so step 1 at --lr/N and step N at --lr [default: a
    /// tenth of --steps with the cosine schedule, none with the constant
    /// one; a resumed run: the checkpoint's]. Without one, AdamW's first steps move every weight by about
    /// --lr at once, and the gradient norm spikes.
    #[arg(long)]
    warmup_steps: Option<u64>,
    /// The learning rate at the last step, as a fraction of --lr (cosine)
    /// [default: 0.1]
    #[arg(long, allow_negative_numbers = true)]
    min_lr_frac: Option<f32>,
    /// The parameters --weight-decay applies to: matrices (the embeddings
    /// and the linear layers' weights; not the biases and layer norms, as
    /// nanoGPT and llm.c train GPT-2) or all (PyTorch's
    /// AdamW(model.parameters()))
    #[arg(
        long,
        default_value = "matrices",
        value_parser = clap::builder::PossibleValuesParser::new(["matrices", "all"])
            .map(|s| s.parse::<braid_gpt2::optim::DecayOn>().expect("one of the values"))
    )]
    weight_decay_on: braid_gpt2::optim::DecayOn,
    /// AdamW decoupled weight decay.
    #[arg(long, allow_negative_numbers = true, default_value_t = 0.1)]
    weight_decay: f32,
    /// Clip the global gradient norm to this (0: no clipping).
    #[arg(long, allow_negative_numbers = true, default_value_t = 1.0)]
    grad_clip: f32,
    /// auto, cpu, cuda or cuda:N. `auto` trains on GPUs when there are
    /// --ranks of them (or under torchrun), on CPU ranks otherwise.
    #[arg(long, default_value = "auto", value_parser = parse_device)]
    device: BackendKind,
    /// Data-parallel ranks. CPU: threads of this process. GPU: devices N,
    /// N+1, … of `cuda:N`, one thread each, NCCL between them. Under torchrun
    /// (RANK and WORLD_SIZE set) on GPUs, WORLD_SIZE decides and this is
    /// ignored: this process is rank RANK on device LOCAL_RANK. On the CPU a
    /// torchrun launch of one process (WORLD_SIZE=1) trains these ranks as
    /// a plain run does, and one of several processes is refused. Default:
    /// 2, or with `--device cuda:N` every GPU from N on.
    #[arg(long)]
    ranks: Option<usize>,
    /// Compute streams per rank.
    #[arg(long, default_value_t = 2)]
    streams: usize,
    /// Placement policy: single, round-robin or affinity.
    #[arg(long, default_value = "affinity", value_parser = parse_policy)]
    policy: Policy,
    /// CPU: use every compute stream of every rank, even when the ranks'
    /// streams outnumber the process's cores (by default the ranks share the
    /// cores: BRAID_CPU_CORES, else the cores the process may use).
    #[arg(long)]
    oversubscribe: bool,
    /// Pin each rank's stream threads to cores: true or false. Default: true
    /// for several CPU ranks (each computes on one core and communicates on
    /// another), false on GPUs. BRAID_PIN_THREADS (1 or 0) overrides it.
    #[arg(long)]
    pin_threads: Option<bool>,
    /// Gradient bucket cap in MiB, or `auto`: 25 MiB for the first step,
    /// then the cap a model of the reducer calibrated on that step predicts
    /// leaves the least communication after the backward pass. Default:
    /// `auto`, or 25 with --compression (whose buckets the model does not
    /// price).
    #[arg(long, value_parser = parse_cap)]
    bucket_cap_mb: Option<CapArg>,
    /// Cap of the first gradient bucket in MiB.
    #[arg(long, allow_negative_numbers = true, default_value_t = 1.0)]
    first_bucket_mb: f64,
    /// How gradient buckets travel: none (f32) or bf16 (CPU ranks only).
    #[arg(long, default_value = "none", value_parser = parse_compression)]
    compression: CompressionArg,
    /// Save a checkpoint (params, AdamW moments, step, data position) in this
    /// directory at the end.
    #[arg(long)]
    checkpoint_dir: Option<PathBuf>,
    /// Also save the checkpoint every N steps.
    #[arg(long, requires = "checkpoint_dir")]
    checkpoint_every: Option<u64>,
    /// Continue the checkpoint in --checkpoint-dir.
    #[arg(long, requires = "checkpoint_dir")]
    resume: bool,
    /// Start from Hugging Face GPT-2 weights (model.safetensors).
    #[arg(long, conflicts_with = "resume")]
    init_from: Option<PathBuf>,
    /// Save the final weights as Hugging Face safetensors: a file, or a
    /// directory (one that exists, or a path ending in `/`, made if need
    /// be) that gets model.safetensors and the config.json `transformers`'
    /// `from_pretrained` needs.
    #[arg(long)]
    save_weights: Option<PathBuf>,
    /// Write a Chrome trace (chrome://tracing, Perfetto) of every rank.
    #[arg(long, default_value = "trace.json")]
    trace: PathBuf,
    /// Do not write a trace.
    #[arg(long)]
    no_trace: bool,
    /// Write each step's figures to this file as JSON lines (step, loss,
    /// grad_norm, lr, seconds, tokens, replayed, and val_loss where
    /// validated), each as its step ends; with --resume the lines after the
    /// checkpoint's step are dropped and the run appends
    #[arg(long, value_name = "FILE")]
    metrics: Option<PathBuf>,
    /// Seed of the parameter initialisation and of --shuffle's order.
    /// Default: 1337, or with --resume the checkpoint's
    #[arg(long)]
    seed: Option<u64>,
    /// Submit every step eagerly instead of recording the steady-state step
    /// once and replaying it.
    #[arg(long)]
    no_replay: bool,
    /// Replay the recorded step as a CUDA graph: one launch per step (a
    /// step with collectives, i.e. more than one rank, is cut around them:
    /// a graph per run of other tasks). On by default for one GPU rank; on
    /// the CPU (where it must be asked for) each graph runs in order on one
    /// stream thread.
    #[arg(long, conflicts_with_all = ["no_replay", "no_graphs"])]
    graphs: bool,
    /// Replay the recorded step kernel by kernel, not as a CUDA graph.
    #[arg(long)]
    no_graphs: bool,
    /// Replay the step as graphs with its collectives (NCCL on CUDA)
    /// captured into them, instead of cutting the graphs around them
    /// (docs/replay.md, "Collectives inside graphs"); implies --graphs.
    #[arg(long, conflicts_with_all = ["no_replay", "no_graphs"])]
    graph_collectives: bool,
    /// A placement file (TOML, docs/scopes.md) mapping the model's scopes
    /// (forward/layer3, backward/layer*, optimizer, ...) to streams,
    /// priorities, policies and bundles; e.g. docs/placement.example.toml.
    /// Default: the file BRAID_PLACEMENT names, if set.
    #[arg(long)]
    placement: Option<PathBuf>,
    /// Run the gradient reducer with --ranks 1 too (its collectives are
    /// no-ops): the trace then holds every bucket, which the step simulator
    /// needs to predict more ranks from a one-rank trace.
    #[arg(long)]
    reduce_single_rank: bool,
    /// Reduce the tied embedding's gradient as one (its all-reduce then waits
    /// for the encoder's backward, the last task) instead of all-reducing the
    /// classifier's part at once and exchanging the encoder's rows at the end
    /// (the default while batch × sequence × ranks < 2 × vocabulary, where
    /// that exchange is the smaller).
    #[arg(long)]
    no_tied_split: bool,
    /// The run's priority class: latency-critical, normal or best-effort
    /// (best-effort CPU stream threads run at the idle scheduling priority;
    /// see docs/tenants.md). Without it: the placement file's `[runtime]
    /// class`, else normal; with it, it wins over the file's.
    #[arg(long, value_parser = parse_class)]
    class: Option<braid::Class>,
    /// On a GPU, leave this many of the device's SMs to the other programs
    /// on it: the run's compute kernels never use them (a green context; the
    /// driver rounds up to its partition size). For a best-effort run beside
    /// a serving one (docs/tenants.md). Default 0: every SM.
    #[arg(long, default_value_t = 0)]
    spare_sms: u32,
    /// Every fused kernel (`--fuse all`): flash attention, the fused
    /// classifier, residual + layer norm, GELU recomputation: no
    /// (B, NH, T, T) attention matrices and no (B, T, V) probabilities kept.
    /// The default on a GPU.
    #[arg(long, conflicts_with = "fuse")]
    fused: bool,
    /// Some fused kernels: a comma-separated list of attention, classifier,
    /// residual-layernorm, gelu-recompute (or all, none). Default: all on a
    /// GPU, classifier on the CPU.
    #[arg(long, value_parser = Fusion::parse)]
    fuse: Option<Fusion>,
    /// ZeRO stage: 0 (off) or 1 (ZeRO-1: gradient buckets reduce-scattered,
    /// AdamW state and update sharded over the ranks, parameters
    /// all-gathered under the next forward pass). Not with --compression
    /// (fp32 and bf16 storage both work). One rank has nothing to shard:
    /// there it changes nothing (a note says so) unless
    /// --reduce-single-rank runs the reducer.
    #[arg(long, default_value_t = 0)]
    zero: u8,
    /// Seconds a rank waits in a collective for the others before the job
    /// fails, naming the collective. The other ranks wait this long for rank
    /// 0 while it writes a --checkpoint-every checkpoint: keep it above
    /// that write's time (a large model on a slow disk).
    #[arg(long, allow_negative_numbers = true, default_value_t = 120.0)]
    comm_timeout: f64,
    /// Storage type of parameters, gradients and activations: fp32, or bf16
    /// (mixed precision: f32 master weights, moments and accumulation).
    /// Default: bf16 on GPUs, fp32 on CPU ranks.
    #[arg(long)]
    dtype: Option<Dtype>,
    /// Which kernels run the fused bf16 attention on a GPU: braid (Braid's
    /// flash attention on tensor cores), cudnn (cuDNN's fused attention,
    /// from the libcudnn of the nvidia-cudnn-cu13 wheel, docs/gpt2.md) or
    /// auto (cuDNN's where it loads and has an engine for the shape, Braid's
    /// otherwise). Default: BRAID_ATTENTION if set, else auto.
    #[arg(long)]
    attention: Option<AttentionKernels>,
    /// RANK:STEP[:hang] — make RANK panic (or, with `:hang`, run a task
    /// that never returns) in the middle of STEP (for tests of how the other
    /// ranks stop; not for training).
    #[arg(long, hide = true, value_parser = parse_fault)]
    inject_fault: Option<braid_gpt2::trainer::Fault>,
}

/// `RANK:STEP[:hang]` for `--inject-fault`.
fn parse_fault(s: &str) -> std::result::Result<braid_gpt2::trainer::Fault, String> {
    let bad = || format!("`{s}` is not RANK:STEP or RANK:STEP:hang (two whole numbers)");
    let (s, hang) = match s.strip_suffix(":hang") {
        Some(rest) => (rest, true),
        None => (s, false),
    };
    let (r, st) = s.split_once(':').ok_or_else(bad)?;
    Ok(braid_gpt2::trainer::Fault {
        rank: r.parse().map_err(|_| bad())?,
        step: st.parse().map_err(|_| bad())?,
        hang,
    })
}

impl Default for TrainArgs {
    fn default() -> Self {
        // The defaults clap would fill in.
        match Cli::parse_from(["braid-gpt2", "train"]).command {
            Some(Command::Train(a)) => *a,
            _ => unreachable!("`train` parses as the train command"),
        }
    }
}

#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("source").required(true).args(["weights", "checkpoint"])))]
struct EvalArgs {
    /// Hugging Face GPT-2 weights (model.safetensors).
    #[arg(long)]
    weights: Option<PathBuf>,
    /// A training checkpoint directory (its parameters are scored).
    #[arg(long)]
    checkpoint: Option<PathBuf>,
    /// Tokens to score: a llm.c .bin token file (or shards by a pattern), a
    /// UTF-8 text file, or
    /// `builtin:val` (`builtin:train`, `builtin`) for a split of the
    /// built-in corpus, as `train --data` takes.
    #[arg(long)]
    tokens: String,
    /// Window length T: window i predicts tokens i·T+1 … i·T+T. Default:
    /// the model's context (all the tokens but the last, when they are fewer).
    #[arg(long)]
    seq_len: Option<usize>,
    /// auto, cpu, cuda or cuda:N.
    #[arg(long, default_value = "auto", value_parser = parse_device)]
    device: BackendKind,
    /// Windows per forward pass.
    #[arg(long, default_value_t = 4)]
    batch_size: usize,
    /// Score the first N windows only (as `train --val-windows` does);
    /// default: all of them
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    windows: Option<u64>,
    /// Compute streams.
    #[arg(long, default_value_t = 2)]
    streams: usize,
    /// Storage type of the model: fp32, or bf16. Default: bf16 on a GPU,
    /// fp32 on the CPU.
    #[arg(long)]
    dtype: Option<Dtype>,
    /// The fused kernels, as train --fuse: a comma-separated list of
    /// attention, classifier, residual-layernorm, gelu-recompute, or all,
    /// or none (the unfused reference path). They keep no (B, NH, T, T)
    /// attention matrices and no (B, T, V) probabilities, and agree with
    /// the unfused path to float rounding [default: all]
    #[arg(long, value_parser = Fusion::parse)]
    fuse: Option<Fusion>,
}

#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("source").required(true).args(["weights", "checkpoint"])))]
struct SampleArgs {
    /// Hugging Face GPT-2 weights (model.safetensors).
    #[arg(long)]
    weights: Option<PathBuf>,
    /// A training checkpoint directory.
    #[arg(long)]
    checkpoint: Option<PathBuf>,
    /// Text to continue (default: start of a document); a literal
    /// `<|endoftext|>` in it is the EOT token. The output is the prompt,
    /// the generated text, then a newline.
    #[arg(long, default_value = "")]
    prompt: String,
    /// Tokens to generate.
    #[arg(long, default_value_t = 64)]
    tokens: usize,
    /// Samples to draw, each a continuation of the prompt, one after the
    /// other from the same seeded sampler (so they differ, unless every
    /// draw is the most likely token: --temperature 0 or --top-k 1),
    /// printed with a line `---` between them.
    #[arg(long, default_value_t = 1, value_name = "N",
          value_parser = clap::value_parser!(u64).range(1..))]
    num_samples: u64,
    /// Sampling temperature (0: always the most likely token).
    #[arg(long, allow_negative_numbers = true, default_value_t = 1.0)]
    temperature: f32,
    /// Draw only from the K most likely tokens (and any tied with the
    /// K-th). Default: no such limit.
    #[arg(long, value_name = "K")]
    top_k: Option<usize>,
    /// Draw only from the most likely tokens whose probabilities first add
    /// up to at least P (nucleus sampling; 0 < P <= 1). Default: no such
    /// limit.
    #[arg(long, allow_negative_numbers = true, value_name = "P")]
    top_p: Option<f32>,
    /// Seed of the sampler.
    #[arg(long, default_value_t = 1337)]
    seed: u64,
    /// auto, cpu, cuda or cuda:N.
    #[arg(long, default_value = "auto", value_parser = parse_device)]
    device: BackendKind,
    /// Storage type of the model: fp32, or bf16. Default: bf16 on a GPU,
    /// fp32 on the CPU.
    #[arg(long)]
    dtype: Option<Dtype>,
}

#[derive(Debug, Args)]
struct TokenizeArgs {
    /// The UTF-8 text (`-`: standard input).
    text: PathBuf,
    /// The token file to write (llm.c's format: a 256-int header, then the
    /// ids as uint16); replaced whole, never left half-written.
    output: PathBuf,
}

#[derive(Debug, Args)]
struct ExportArgs {
    /// The training checkpoint directory whose parameters are written.
    #[arg(long)]
    checkpoint: PathBuf,
    /// Where: a .safetensors file, or a directory (one that exists, or a
    /// path ending in `/`, made if need be) that gets model.safetensors and
    /// the config.json `transformers`' `from_pretrained` needs (as train
    /// --save-weights).
    #[arg(long)]
    save_weights: PathBuf,
}

/// The ranks when `--ranks` is not given: every GPU from `cuda:N` on when the
/// device is named (one at least, so that a missing GPU is reported by the
/// trainer), else 2 (CPU ranks, or GPUs under `auto` when there are two).
fn default_ranks(ranks: Option<usize>, device: BackendKind) -> usize {
    match (ranks, device) {
        (Some(n), _) => n,
        (None, BackendKind::Cuda { device }) => {
            braid::cuda::cuda_available().map_or(1, |n| n.saturating_sub(device).max(1))
        }
        (None, _) => 2,
    }
}

/// The validation of a run of `world` ranks (`--val-every`, `--val-data`,
/// `--val-windows`).
fn validation(
    a: &TrainArgs,
    cfg: &Gpt2Config,
    data: &TokenSource,
    world: usize,
) -> Result<Option<Validation>> {
    let Some(every) = a.val_every else {
        return Ok(None);
    };
    let spec = match (&a.val_data, data.origin()) {
        (Some(spec), _) => spec.as_str(),
        (None, "builtin:train") => "builtin:val",
        (None, _) => bail!(
            "--val-every needs --val-data (held-out tokens: a .bin token file or a text file) \
             unless --data is the built-in corpus's training split (builtin)"
        ),
    };
    let val = TokenSource::resolve(spec).with_context(|| format!("--val-data {spec}"))?;
    check_eval(cfg, &val, a.seq_len, a.batch_size)
        .with_context(|| format!("--val-data {spec} (windows of --seq-len {})", a.seq_len))?;
    let windows = a
        .val_windows
        .map_or(20 * a.batch_size * world, |n| n as usize);
    Ok(Some(Validation {
        data: val,
        every,
        windows,
    }))
}

/// The text generation during training (`--sample-every`,
/// `--sample-tokens`, `--sample-prompt`).
fn generation(a: &TrainArgs, cfg: &Gpt2Config) -> Result<Option<Generation>> {
    let Some(every) = a.sample_every else {
        return Ok(None);
    };
    let eot = braid_gpt2::data::EOT;
    let prompt = match a.sample_prompt.as_deref() {
        // An empty prompt is the start of a document, as `sample`'s.
        Some(text) if !text.is_empty() => {
            let ids = Tokenizer::gpt2()?.encode_with_eot(text);
            braid_gpt2::data::check_ids(&ids, cfg.vocab_size, "--sample-prompt").with_context(
                || {
                    format!(
                        "the --sample-prompt's tokens do not fit the model's vocabulary of {}",
                        cfg.vocab_size
                    )
                },
            )?;
            ids
        }
        _ if eot as usize >= cfg.vocab_size => bail!(
            "--sample-every starts its text at GPT-2's <|endoftext|> ({eot}), which the \
             model's vocabulary of {} lacks; give a --sample-prompt",
            cfg.vocab_size
        ),
        _ => vec![eot],
    };
    Ok(Some(Generation {
        every,
        tokens: a.sample_tokens.map_or(64, |n| n as usize),
        prompt,
        how: Sampling::default(),
    }))
}

/// The text `--sample-prompt` gives ("" for the start of a document).
fn sample_prompt(a: &TrainArgs) -> &str {
    a.sample_prompt.as_deref().unwrap_or_default()
}

/// The micro-batches per step of a run of `world` ranks: `--grad-accum`, or
/// `--total-batch-size` over the tokens of one micro-batch of every rank.
fn grad_accum(a: &TrainArgs, world: usize) -> Result<usize> {
    let Some(total) = a.total_batch_size else {
        return Ok(a.grad_accum.map_or(1, |n| n as usize));
    };
    let micro = a.batch_size * a.seq_len * world;
    if micro == 0 || total == 0 || total % micro != 0 {
        bail!(
            "--total-batch-size {total} is not a positive multiple of the {micro} tokens of one \
             micro-batch of every rank (--batch-size {} x --seq-len {} x {world} rank(s))",
            a.batch_size,
            a.seq_len
        );
    }
    Ok(total / micro)
}

/// The attention kernels of a training run: `--attention`, else
/// `BRAID_ATTENTION` (an error when it names none), else `auto`. cuDNN runs
/// only the fused bf16 attention on CUDA, so `--attention cudnn` on any
/// other run is refused rather than ignored; `auto`, which falls back to
/// Braid's kernels by design, and the variable, which may be set for a
/// whole shell, are not.
fn attention_kernels(
    flag: Option<AttentionKernels>,
    on_gpu: bool,
    dtype: Dtype,
    fusion: Fusion,
) -> Result<AttentionKernels> {
    let Some(k) = flag else {
        return Ok(attention_from_env()
            .map_err(anyhow::Error::msg)?
            .unwrap_or_default());
    };
    if k == AttentionKernels::Cudnn && !(on_gpu && dtype == Dtype::Bf16 && fusion.attention) {
        bail!(
            "--attention cudnn runs the fused bf16 attention on a GPU: it needs --device cuda, \
             --dtype bf16 and the fused attention (--fused, the GPU default), and this run is \
             on {}, {dtype}, fused kernels: {fusion}",
            if on_gpu { "a GPU" } else { "the CPU" }
        );
    }
    Ok(k)
}

/// The storage type when `--dtype` is not given: bf16 on a GPU (mixed
/// precision, as PyTorch's autocast and llm.c train), fp32 on the CPU.
fn default_dtype(on_gpu: bool) -> Dtype {
    if on_gpu {
        Dtype::Bf16
    } else {
        Dtype::F32
    }
}

/// The fused kernels when neither `--fused` nor `--fuse` is given: all of
/// them on a GPU (the fastest and smallest step there: docs/gpu-validation.md,
/// run 6), the classifier alone on the CPU (the only one that pays there:
/// docs/gpt2.md, "The command line").
fn default_fusion(on_gpu: bool) -> Fusion {
    if on_gpu {
        Fusion::ALL
    } else {
        Fusion {
            classifier: true,
            ..Fusion::NONE
        }
    }
}

fn parse_device(s: &str) -> std::result::Result<BackendKind, String> {
    s.parse().map_err(|e: braid::Error| e.to_string())
}

fn parse_class(s: &str) -> std::result::Result<braid::Class, String> {
    braid::Class::from_name(s)
        .ok_or_else(|| format!("`{s}` is not a class (latency-critical, normal or best-effort)"))
}

fn parse_policy(s: &str) -> std::result::Result<Policy, String> {
    s.parse().map_err(|e: braid::Error| e.to_string())
}

/// `--lr-schedule`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum LrScheduleArg {
    Cosine,
    Constant,
}

/// `--compression`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CompressionArg {
    None,
    Bf16,
}

/// `--bucket-cap-mb`: a size in MiB, or chosen by the run.
#[derive(Debug, Clone, Copy)]
enum CapArg {
    Mib(f64),
    Auto,
}

fn parse_cap(s: &str) -> std::result::Result<CapArg, String> {
    match s {
        "auto" => Ok(CapArg::Auto),
        _ => s
            .parse()
            .map(CapArg::Mib)
            .map_err(|_| format!("`{s}` is neither a number of MiB nor `auto`")),
    }
}

fn parse_compression(s: &str) -> std::result::Result<CompressionArg, String> {
    match s {
        "none" => Ok(CompressionArg::None),
        "bf16" => Ok(CompressionArg::Bf16),
        _ => Err(format!("unknown compression `{s}` (expected none or bf16)")),
    }
}

fn main() -> Result<()> {
    // Many set RUST_BACKTRACE=1 for good; anyhow then prints a backtrace
    // under every error, a missing file as much as a bug. Panics keep their
    // backtraces; an error shows one only when RUST_LIB_BACKTRACE asks (the
    // variable std and anyhow read before RUST_BACKTRACE). Set before any
    // thread starts.
    if std::env::var_os("RUST_LIB_BACKTRACE").is_none() {
        std::env::set_var("RUST_LIB_BACKTRACE", "0");
    }
    let cli = Cli::parse();
    braid_gpt2::kernels::switches::check_environment()?;
    explain_bus_errors();
    match cli.command {
        None => cmd_train(TrainArgs::default()),
        Some(Command::Train(a)) => cmd_train(*a),
        Some(Command::Eval(a)) => cmd_eval(a),
        Some(Command::Sample(a)) => cmd_sample(a),
        Some(Command::Export(a)) => cmd_export(a),
        Some(Command::Tokenize(a)) => cmd_tokenize(a),
    }
}

/// Token files are memory-mapped (`braid_gpt2::data::Tokens`): one that is
/// truncated while a run reads it (llm.c's scripts rewrite their `.bin`
/// files in place) ends the process with SIGBUS. This says so on stderr
/// first; the default action, restored as the handler runs, then ends the
/// process by the signal as before (the faulting read runs again).
fn explain_bus_errors() {
    extern "C" fn on_sigbus(_: libc::c_int) {
        const MSG: &[u8] = b"\nerror: bus error (SIGBUS): most likely a token file this run \
            maps was truncated or rewritten in place while the run read it (llm.c's \
            scripts rewrite their .bin files in place); leave the data unchanged \
            during a run, or write new files and rename them over the old\n";
        // SAFETY: write(2) is async-signal-safe; MSG outlives the call.
        unsafe { libc::write(2, MSG.as_ptr().cast(), MSG.len()) };
    }
    // SAFETY: a zeroed sigaction is valid; the handler only calls write(2).
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_sigbus as extern "C" fn(libc::c_int) as usize;
        sa.sa_flags = libc::SA_RESETHAND;
        libc::sigemptyset(&mut sa.sa_mask);
        // Without it a truncated file still ends the run, unexplained.
        libc::sigaction(libc::SIGBUS, &sa, std::ptr::null_mut());
    }
}

/// A model name or a JSON configuration file. A known name is the model it
/// names even when a file of that name is in the current directory (`./tiny`
/// names the file).
fn parse_model(spec: &str) -> Result<Gpt2Config> {
    if let Ok(cfg) = Gpt2Config::from_name(spec) {
        return Ok(cfg);
    }
    let path = Path::new(spec);
    if path.extension().is_some_and(|e| e == "json") || path.is_file() {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading model config {}", path.display()))?;
        let json: serde_json::Value = serde_json::from_str(&text)
            .with_context(|| format!("model config {} is not JSON", path.display()))?;
        let cfg =
            model_from_json(&json).with_context(|| format!("model config {}", path.display()))?;
        cfg.validate()
            .with_context(|| format!("model config {}", path.display()))?;
        return Ok(cfg);
    }
    Ok(Gpt2Config::from_name(spec)?)
}

/// Each size of a model config file: its key, then a Hugging Face GPT-2
/// `config.json`'s names for it.
const MODEL_KEYS: [(&str, &[&str]); 5] = [
    ("max_seq_len", &["n_positions", "n_ctx"]),
    ("vocab_size", &[]),
    ("num_layers", &["n_layer"]),
    ("num_heads", &["n_head"]),
    ("channels", &["n_embd"]),
];

/// The model a config file's JSON describes: Braid's keys
/// ([`MODEL_KEYS`], and no other: a misspelt key is an error, not a size
/// left out) or a Hugging Face GPT-2 `config.json` (its names for them;
/// its many other keys are allowed). A size given under two names must
/// agree, and be a non-negative integer.
fn model_from_json(json: &serde_json::Value) -> Result<Gpt2Config> {
    let Some(obj) = json.as_object() else {
        bail!("is not a JSON object of sizes");
    };
    let hf = obj.contains_key("model_type")
        || MODEL_KEYS
            .iter()
            .any(|(_, names)| names.iter().any(|n| obj.contains_key(*n)));
    if !hf {
        let known = |k: &str| MODEL_KEYS.iter().any(|(key, _)| *key == k);
        if let Some(k) = obj.keys().find(|k| !known(k)) {
            bail!(
                "unknown key `{k}` (the keys are {}; or give a Hugging Face GPT-2 config.json)",
                MODEL_KEYS.map(|(k, _)| k).join(", ")
            );
        }
    }
    let mut sizes = [0usize; 5];
    for ((key, names), size) in MODEL_KEYS.iter().zip(&mut sizes) {
        let mut found: Option<(&str, u64)> = None;
        for name in std::iter::once(key).chain(names.iter()) {
            let Some(v) = obj.get(*name) else { continue };
            let Some(n) = v.as_u64() else {
                bail!("`{name}` is {v}, not a non-negative integer");
            };
            match found {
                Some((first, m)) if m != n => {
                    bail!("`{first}` {m} and `{name}` {n} disagree: give one size")
                }
                _ => found = Some((name, n)),
            }
        }
        let Some((_, n)) = found else {
            let also = names
                .iter()
                .map(|n| format!(" or `{n}`"))
                .collect::<String>();
            bail!("lacks `{key}`{also} (a positive integer)");
        };
        *size = usize::try_from(n).with_context(|| format!("`{key}` {n} is too large"))?;
    }
    let [max_seq_len, vocab_size, num_layers, num_heads, channels] = sizes;
    Ok(Gpt2Config {
        max_seq_len,
        vocab_size,
        num_layers,
        num_heads,
        channels,
    })
}

/// Checks that the configuration the user named agrees with the one a file
/// implies.
fn agree(named: Option<&str>, found: Gpt2Config, source: &str) -> Result<Gpt2Config> {
    if let Some(spec) = named {
        let want = parse_model(spec)?;
        if want != found {
            bail!(
                "--model {spec} is {want}, but {source} holds a model with {found}; \
                 drop --model or pick the matching one"
            );
        }
    }
    Ok(found)
}

/// Writes a line to standard error as `eprintln!` does, except that a log
/// that cannot be written (its reader gone, `2>&1 | head`; its terminal
/// closed) does not end the program: a training run goes on and saves what
/// it makes.
macro_rules! say {
    ($($arg:tt)*) => {{
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

/// `--seed`'s default.
const DEFAULT_SEED: u64 = 1337;

fn cmd_train(a: TrainArgs) -> Result<()> {
    // 1. Everything is read and checked before anything is written.
    if a.steps == 0 {
        bail!("--steps 0 trains nothing: give the number of steps to train to (at least 1)");
    }
    let (cfg, start, resumed) = if a.resume {
        let dir = a
            .checkpoint_dir
            .as_ref()
            .expect("clap: --resume requires it");
        let ckpt = load_checkpoint(dir).context("--resume")?;
        let cfg = agree(a.model.as_deref(), ckpt.config, &dir.display().to_string())?;
        if ckpt.step >= a.steps {
            bail!(
                "the checkpoint in {} is at step {}, already at or past --steps {}",
                dir.display(),
                ckpt.step,
                a.steps
            );
        }
        let extra = ckpt.extra.clone();
        (cfg, StartState::from_checkpoint(ckpt), Some(extra))
    } else {
        if let Some(dir) = &a.checkpoint_dir {
            let file = checkpoint_file(dir);
            check_checkpoint_dir(dir)
                .with_context(|| format!("--checkpoint-dir {}", dir.display()))?;
            if file.exists() {
                bail!(
                    "{} already holds a checkpoint; pass --resume to continue it or choose \
                     another --checkpoint-dir (nothing was overwritten)",
                    dir.display()
                );
            }
        }
        let (cfg, params) = match &a.init_from {
            Some(path) => {
                let (found, params) = load_hf_model(path).context("--init-from")?;
                let cfg = agree(a.model.as_deref(), found, &path.display().to_string())?;
                (cfg, params)
            }
            None => {
                let cfg = parse_model(a.model.as_deref().unwrap_or("small"))?;
                (cfg, try_init_params(&cfg, a.seed.unwrap_or(DEFAULT_SEED))?)
            }
        };
        (cfg, StartState::from_params(params), None)
    };
    // Weights in the checkpoint directory the run will make are checked
    // once it is made (below).
    let weights_in_new_dir = a.save_weights.as_deref().is_some_and(|path| {
        let dir = a.checkpoint_dir.as_deref().filter(|d| !d.exists());
        dir.is_some_and(|d| path.parent().is_some_and(|p| same_file(p, d)))
    });
    if let Some(path) = a.save_weights.as_deref().filter(|_| !weights_in_new_dir) {
        check_weights_output(path, a.checkpoint_dir.as_deref())?;
    }
    if let Some(path) = (!a.no_trace).then_some(&a.trace) {
        if let Some(why) = braid::fs::unwritable(path) {
            bail!("--trace {}: {why}", path.display());
        }
    }
    check_outputs_apart(&a)?;
    let data = TokenSource::resolve(&a.data).with_context(|| format!("--data {}", a.data))?;
    // A large source (mapped shards) is checked as batches read it: a
    // scan now would read it all before the first step.
    if data.len() <= braid_gpt2::data::loader::UPFRONT_VOCAB_CHECK {
        data.check_vocab(cfg.vocab_size).with_context(|| {
            format!(
                "--data {} does not fit the model's vocabulary of {} tokens",
                a.data, cfg.vocab_size
            )
        })?;
    }
    // A cap travels between the ranks as two 31-bit halves; no bucket
    // needs more than a tebibyte anyway.
    const MAX_CAP_MIB: f64 = (1u64 << 20) as f64;
    let mib = |x: f64, what: &str| -> Result<usize> {
        if !(x.is_finite() && x > 0.0) {
            bail!("{what} must be a positive number of MiB, not {x:?}");
        }
        if x > MAX_CAP_MIB {
            bail!("{what} {x:?} is more than {MAX_CAP_MIB} MiB (1 TiB)");
        }
        Ok(((x * (1 << 20) as f64) as usize).max(4))
    };
    // `auto` by default, but a compression's buckets are not what the cap
    // model prices: they keep 25 MiB unless the cap is given.
    let cap = a.bucket_cap_mb.unwrap_or(match a.compression {
        CompressionArg::None => CapArg::Auto,
        _ => CapArg::Mib(25.0),
    });
    // Deadlines are `Instant`s: an absurd wait would overflow one.
    const YEAR: f64 = 365.0 * 24.0 * 3600.0;
    let secs = |x: f64, what: &str| -> Result<Duration> {
        if !(x.is_finite() && x > 0.0) {
            bail!("{what} must be a positive number of seconds, not {x:?}");
        }
        if x > YEAR {
            bail!("{what} {x:?} is more than a year ({YEAR} seconds)");
        }
        Ok(Duration::from_secs_f64(x))
    };
    let min_lr_frac = a.min_lr_frac.unwrap_or(0.1);
    if !(min_lr_frac.is_finite() && (0.0..=1.0).contains(&min_lr_frac)) {
        bail!("--min-lr-frac must be in 0..=1, not {min_lr_frac}");
    }
    if let (LrScheduleArg::Constant, Some(f)) = (a.lr_schedule, a.min_lr_frac) {
        bail!(
            "--min-lr-frac {f} is the cosine schedule's end; --lr-schedule constant keeps --lr \
             (drop one of them)"
        );
    }
    // A resumed run keeps the checkpoint's warm-up unless given one: the
    // default, a tenth of --steps, would move with a raised --steps and
    // send the rate back down into a warm-up the run had finished.
    let warmup_steps = a.warmup_steps.or_else(|| {
        resumed
            .as_ref()
            .and_then(|extra| extra.get("warmup_steps")?.as_u64())
    });
    let mut opts = TrainOptions {
        model: cfg,
        batch_size: a.batch_size,
        seq_len: a.seq_len,
        // Resolved with the ranks, below.
        grad_accum: 1,
        shuffle: a.shuffle,
        steps: a.steps,
        optimizer: AdamWHyper {
            learning_rate: a.lr,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: a.weight_decay,
        },
        lr_schedule: match a.lr_schedule {
            LrScheduleArg::Cosine => {
                let warmup = warmup_steps.unwrap_or(a.steps / 10);
                LrSchedule::cosine(warmup, a.steps, min_lr_frac)
            }
            LrScheduleArg::Constant => LrSchedule {
                warmup_steps: warmup_steps.unwrap_or(0),
                ..LrSchedule::constant()
            },
        },
        // 0 turns clipping off; anything else not positive is refused.
        weight_decay_on: a.weight_decay_on,
        max_grad_norm: (a.grad_clip != 0.0).then_some(a.grad_clip),
        backend: a.device,
        ranks: default_ranks(a.ranks, a.device),
        streams: a.streams,
        policy: a.policy,
        oversubscribe: a.oversubscribe,
        pin_threads: a.pin_threads,
        bucket_cap_bytes: match cap {
            CapArg::Mib(x) => mib(x, "--bucket-cap-mb")?,
            CapArg::Auto => 25 << 20,
        },
        auto_bucket_cap: matches!(cap, CapArg::Auto),
        first_bucket_bytes: mib(a.first_bucket_mb, "--first-bucket-mb")?,
        // A resumed run keeps its checkpoint's seed (its data order, with
        // --shuffle) unless one is given.
        seed: a.seed.unwrap_or_else(|| {
            resumed
                .as_ref()
                .and_then(|e| e.get("seed")?.as_u64())
                .unwrap_or(DEFAULT_SEED)
        }),
        checkpoint_dir: a.checkpoint_dir.clone(),
        checkpoint_every: a.checkpoint_every,
        trace: (!a.no_trace).then(|| a.trace.clone()),
        comm_timeout: secs(a.comm_timeout, "--comm-timeout")?,
        compression: match a.compression {
            CompressionArg::None => Compression::None,
            CompressionArg::Bf16 => Compression::Bf16,
        },
        replay: !a.no_replay,
        graphs: a.graphs,
        graph_collectives: a.graph_collectives,
        reduce_single_rank: a.reduce_single_rank,
        tied_split: !a.no_tied_split,
        class: a.class,
        spare_sms: a.spare_sms,
        device_bundle: None,
        fusion: Fusion::NONE,
        zero: a.zero,
        dtype: a.dtype.unwrap_or(Dtype::F32),
        // Resolved with the ranks, below.
        validation: None,
        generation: None,
        // --placement, else BRAID_PLACEMENT (which the runtimes would read
        // themselves): loaded here, so the run can say which file it uses.
        placement: match (&a.placement, std::env::var_os(braid::PLACEMENT_ENV)) {
            (Some(p), _) => Some(braid::PlacementFile::load(p).context("--placement")?),
            (None, Some(p)) if !p.is_empty() => {
                Some(braid::PlacementFile::load(&p).context(braid::PLACEMENT_ENV)?)
            }
            _ => None,
        },
        stop: None,
        fault: a.inject_fault,
    };
    let device = resolve_train_backend(&opts)?;
    let dist = match device {
        BackendKind::Cuda { .. } => DistEnv::launched()?,
        _ => {
            // CPU ranks are threads of one process: several torchrun
            // processes would each train a model of their own. A launch of
            // one process (WORLD_SIZE=1) trains as without torchrun;
            // variables that make no sense are refused, as on GPUs.
            let launched = DistEnv::launched().context(
                "the torchrun variables (RANK, WORLD_SIZE, ...) are invalid; unset them to \
                 train on CPU ranks, which are threads of this process (--ranks)",
            )?;
            if let Some(d) = launched {
                if d.world_size > 1 {
                    bail!(
                        "RANK={} WORLD_SIZE={} (a torchrun launch?) on the CPU: CPU ranks are \
                         threads of one process; run braid-gpt2 once with --ranks {}, or train \
                         on GPUs (--device cuda)",
                        d.rank,
                        d.world_size,
                        d.world_size
                    );
                }
            }
            None
        }
    };
    // The GPU defaults: bf16, and one rank's step replayed as a CUDA graph.
    let on_gpu = matches!(device, BackendKind::Cuda { .. });
    opts.dtype = a.dtype.unwrap_or(default_dtype(on_gpu));
    opts.fusion = match (a.fused, a.fuse) {
        (true, _) => Fusion::ALL,
        (false, Some(f)) => f,
        (false, None) => default_fusion(on_gpu),
    };
    let attention = attention_kernels(a.attention, on_gpu, opts.dtype, opts.fusion)?;
    set_attention_kernels(attention);
    let world = dist.as_ref().map_or(opts.ranks, |d| d.world_size);
    opts.grad_accum = grad_accum(&a, world)?;
    // The training settings first: a bad --seq-len or --batch-size is
    // named as such, not as a problem of the validation data it would
    // also be read with.
    opts.check()?;
    opts.validation = validation(&a, &cfg, &data, world)?;
    opts.generation = generation(&a, &cfg)?;
    // Not for a best-effort run: its runtime launches in bounded bundles
    // and refuses graphs (docs/tenants.md, "Kernels in bundles").
    opts.graphs = a.graphs
        || a.graph_collectives
        || (on_gpu
            && world == 1
            && !a.no_graphs
            && !a.no_replay
            && a.class.or(opts.placement.as_ref().and_then(|f| f.class()))
                != Some(braid::Class::BestEffort));
    let device_name = match (device, &dist) {
        (BackendKind::Cuda { .. }, Some(d)) => format!(
            "cuda:{} (torchrun rank {} of {})",
            d.local_rank, d.rank, d.world_size
        ),
        (BackendKind::Cuda { device }, None) if opts.ranks > 1 => {
            format!("cuda:{device}..=cuda:{}", device + opts.ranks - 1)
        }
        (BackendKind::Cuda { device }, None) => format!("cuda:{device}"),
        _ => "cpu".into(),
    };
    let ranks = world;
    opts.check()?;
    // Enough tokens for a step of every rank, said before anything is made.
    braid_gpt2::data::DataLoader::new(&data, opts.batch_size, opts.seq_len, 0, world)?;
    // ZeRO-1 shards what the reducer reduces, and one rank runs none
    // unless asked: the flag would do nothing unsaid.
    if opts.zero == 1 && world == 1 && !opts.reduce_single_rank {
        say!(
            "note: --zero 1 shards the optimizer over the ranks, and this run has one: it \
             trains as with --zero 0 (--reduce-single-rank runs ZeRO-1 with one rank)"
        );
    }
    // SMs are a GPU's: on the CPU the flag would do nothing unsaid.
    if opts.spare_sms > 0 && !on_gpu {
        say!(
            "note: --spare-sms {} leaves SMs of a GPU to other programs; this run is on the \
             CPU, where it does nothing",
            opts.spare_sms
        );
    }
    // A resumed run may change its settings (a new learning rate, more
    // ranks); it then no longer continues as the saved run would have, and
    // says so once.
    let differences = resumed.map_or(Vec::new(), |e| opts.resume_differences(&e, world, &data));
    if !differences.is_empty() && dist.as_ref().is_none_or(|d| d.rank == 0) {
        say!(
            "note: these settings differ from those of the run that saved the checkpoint, so \
             this run does not continue it exactly: {}",
            differences.join(", ")
        );
    }
    // The checkpoint directory is made now, as the run would make it, and a
    // file is tried in it: a directory the run cannot write to is found
    // before the first step, not after the last (rank 0 writes it; under
    // torchrun the other processes leave it alone). Then it is locked, and
    // held to the end: a second run naming the directory meanwhile is
    // refused, not left to overwrite this one's checkpoints.
    let _checkpoint_lock =
        match (a.checkpoint_dir.as_ref()).filter(|_| dist.as_ref().is_none_or(|d| d.rank == 0)) {
            Some(dir) => {
                let lock = lock_checkpoint_dir(dir)
                    .with_context(|| format!("--checkpoint-dir {}", dir.display()))?;
                if let Some(path) = a.save_weights.as_deref().filter(|_| weights_in_new_dir) {
                    check_weights_output(path, Some(dir))?;
                }
                Some(lock)
            }
            None => None,
        };

    // The metrics log (rank 0's), opened now: a file it cannot write is
    // found before the first step.
    let metrics = match a.metrics.as_ref() {
        Some(path) if dist.as_ref().is_none_or(|d| d.rank == 0) => Some(Mutex::new(
            MetricsLog::create(path, start.step)
                .with_context(|| format!("--metrics {}", path.display()))?,
        )),
        _ => None,
    };

    // Ctrl-C (or SIGTERM, or SIGHUP: the terminal closed) stops the run at
    // the end of a step, which then saves its checkpoint and writes its
    // trace as a finished run does; a second one ends the process at once.
    // Only where every rank is in this process: torchrun's processes would
    // have to agree on the step.
    let stop = Arc::new(AtomicBool::new(false));
    let caught = Arc::new(AtomicUsize::new(0));
    if dist.as_ref().is_none_or(|d| d.world_size == 1) {
        // A signal the process was started with ignored (SIGINT of `cmd &`
        // in a script, SIGHUP under nohup) stays ignored, as shells and
        // Python leave it.
        for sig in [SIGINT, SIGTERM, SIGHUP]
            .into_iter()
            .filter(|&s| !ignored_at_start(s))
        {
            // A word first, for a second signal: the process is about to end
            // by it, saving nothing more.
            let seen = Arc::clone(&stop);
            // SAFETY: the action loads an atomic and calls write(2), both
            // async-signal-safe; it allocates nothing and takes no lock.
            unsafe {
                signal_hook::low_level::register(sig, move || {
                    if seen.load(Ordering::SeqCst) {
                        const SAID: &[u8] =
                            b"\nbraid-gpt2: a second signal: stopping at once, saving nothing more\n";
                        libc::write(2, SAID.as_ptr().cast(), SAID.len());
                    }
                })
            }
            .context("installing the handler of Ctrl-C")?;
            // The default action next: it sees the flag only a first
            // signal has set, and ends the process by the signal.
            signal_hook::flag::register_conditional_default(sig, Arc::clone(&stop))
                .and_then(|_| signal_hook::flag::register_usize(sig, Arc::clone(&caught), sig as _))
                .and_then(|_| signal_hook::flag::register(sig, Arc::clone(&stop)))
                .context("installing the handler of Ctrl-C")?;
        }
        opts.stop = Some(Arc::clone(&stop));
    }

    // 2. Train.
    say!(
        "training {} ({} parameters) on {} ({} tokens): {} rank(s) on {device_name}, batch {} \
         x {} tokens per rank{}, {} stream(s) per rank, {} placement, {}{}, fused kernels: {}{}{}, \
         steps {}..={}",
        a.model
            .as_deref()
            .unwrap_or(if a.init_from.is_some() || a.resume {
                "the loaded model"
            } else {
                "small"
            }),
        cfg.num_parameters(),
        data.origin(),
        data.len(),
        ranks,
        a.batch_size,
        a.seq_len,
        match opts.grad_accum {
            1 => String::new(),
            n => format!(" x {n} micro-batches per step"),
        },
        a.streams,
        a.policy,
        opts.dtype,
        match (opts.graphs, on_gpu) {
            (true, true) => ", CUDA graph replay",
            // On the CPU a graph is a stream thread's program run in order.
            (true, false) => ", graph replay",
            (false, _) => "",
        },
        opts.fusion,
        match attention {
            _ if !(on_gpu && opts.dtype == Dtype::Bf16 && opts.fusion.attention) => "",
            AttentionKernels::Braid => "",
            AttentionKernels::Cudnn => " (attention through cuDNN)",
            AttentionKernels::Auto => " (attention through cuDNN where it has an engine)",
        },
        if opts.shuffle { ", data shuffled" } else { "" },
        start.step + 1,
        a.steps
    );
    if opts.lr_schedule.warmup_steps > a.steps {
        say!(
            "note: the warm-up of {} steps is longer than the run ({} steps): the learning rate \
             never reaches --lr {}",
            opts.lr_schedule.warmup_steps,
            a.steps,
            a.lr
        );
    }
    if let Some(f) = &opts.placement {
        // The file's replay switch overrides the flags'; its class applies
        // without --class (a class the run names wins).
        let class = match (f.class(), a.class) {
            (Some(c), Some(flag)) if c != flag => format!(
                ", class {} (--class, not the file's {})",
                flag.name(),
                c.name()
            ),
            (Some(c), _) => format!(", class {}", c.name()),
            (None, _) => String::new(),
        };
        say!("placement file {}: {} rule(s){class}", f.origin(), f.len());
    }
    if let Some(v) = &opts.validation {
        let all = braid_gpt2::data::eval_windows(&v.data, opts.seq_len)?.num_windows();
        let scored = v.windows.min(all);
        say!(
            "validation after every {} step(s) and the last: {scored} windows of {} tokens of {} \
             (`eval --windows {scored} --seq-len {}` scores the same)",
            v.every,
            opts.seq_len,
            v.data.origin(),
            opts.seq_len
        );
    }
    if let Some(g) = &opts.generation {
        let shown = match sample_prompt(&a) {
            "" => "<|endoftext|>".to_string(),
            p if p.chars().count() > 60 => format!("{:?}…", p.chars().take(60).collect::<String>()),
            p => format!("{p:?}"),
        };
        let cut = match g.prompt.len().checked_sub(cfg.max_seq_len) {
            Some(n) if n > 0 => format!(
                " (its last {} tokens: the prompt is {} and the model's context {})",
                cfg.max_seq_len,
                g.prompt.len(),
                cfg.max_seq_len
            ),
            _ => String::new(),
        };
        say!(
            "generation after every {} step(s) and the last: {} tokens continuing {shown}{cut}",
            g.every,
            g.tokens,
        );
    }
    let pb = ProgressBar::new(a.steps.saturating_sub(start.step));
    pb.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} steps  {msg}  [{elapsed_precise}]")
            .expect("valid template"),
    );
    // The generated text's decoder (made only then: a token file needs no
    // tokenizer otherwise).
    let tok = opts
        .generation
        .as_ref()
        .map(|_| Tokenizer::gpt2())
        .transpose()?;
    let on_step = |s: &StepReport| {
        if let Some(v) = s.start_val_loss {
            // The parameters the run started from, above the bar.
            let line = format!("step {:>5}  val loss {v:.4}", 0);
            match pb.is_hidden() {
                true => say!("{line}"),
                false => pb.println(line),
            }
        }
        let line = format!(
            "loss {:.4}  norm {:.3}  lr {:.2e}  {:.0} tokens/s{}",
            s.loss,
            s.grad_norm,
            s.lr,
            s.tokens as f64 / s.seconds,
            s.val_loss
                .map_or(String::new(), |v| format!("  val loss {v:.4}"))
        );
        if pb.is_hidden() {
            say!("step {:>5}  {line}  ({:.0} ms)", s.step, s.seconds * 1e3);
        } else if let Some(v) = s.val_loss {
            // Above the bar, where it stays.
            pb.println(format!("step {:>5}  val loss {v:.4}", s.step));
        }
        if let (Some(ids), Some(tok)) = (&s.sample, &tok) {
            // A token outside GPT-2's vocabulary (a model with a bigger
            // one) as `<id>`, as `sample` writes it.
            let mut text = tok.stream();
            let body: String = ids.iter().map(|&t| text.push(t)).collect();
            let block = format!(
                "step {:>5}  generated:\n---\n{}{body}{}\n---",
                s.step,
                sample_prompt(&a),
                text.finish()
            );
            if pb.is_hidden() {
                say!("{block}");
            } else {
                pb.println(block);
            }
        }
        pb.set_message(line);
        pb.inc(1);
        if let Some(log) = &metrics {
            log.lock().unwrap_or_else(|p| p.into_inner()).write(s);
        }
    };
    let report = train(&opts, start, &data, &on_step)?;
    pb.finish_and_clear();
    // A placement rule that applied to no scope did nothing: a typo, or a
    // scope the trainer does not open.
    if let Some(f) = opts
        .placement
        .as_ref()
        .filter(|_| report.process_rank.unwrap_or(0) == 0)
    {
        for (line, pattern) in f.unmatched() {
            say!(
                "note: the placement rule `{pattern}` ({} line {line}) matched no scope of this \
                 run, so it did nothing",
                f.origin()
            );
        }
    }

    // 3. Outputs (rank 0's, in a torchrun job). An output that is standard
    // output (`--trace /dev/stdout > t.json`) holds nothing else: the
    // summary goes to standard error then.
    let rank0 = report.process_rank.unwrap_or(0) == 0;
    let trace_path = (!a.no_trace).then_some(a.trace.as_path());
    let mut summary = summary_stream(&[a.save_weights.as_deref(), trace_path]);
    if let Some(path) = a.save_weights.as_ref().filter(|_| rank0) {
        save_weights(path, &report.params, &cfg, &mut summary)?;
    }
    // The report's first line is the first and the last loss.
    let _ = writeln!(summary, "{report}");
    let signal = caught.load(Ordering::SeqCst);
    if signal != 0 {
        let checkpoint = match &report.checkpoint {
            Some(dir) => format!("its checkpoint is in {}", dir.display()),
            None => "no checkpoint was saved (--checkpoint-dir)".into(),
        };
        if report.final_step < a.steps {
            say!(
                "stopped by a signal after step {} of {}: {checkpoint}{}",
                report.final_step,
                a.steps,
                if report.checkpoint.is_some() {
                    "; --resume continues it"
                } else {
                    ""
                }
            );
        } else {
            say!(
                "interrupted by a signal in the last step, which finished: the run is \
                 complete ({checkpoint})"
            );
        }
    }
    // Neither does a metrics log that failed (a full disk): the run went on
    // without it, and fails now, its outputs written.
    if let Some(log) = metrics.map(|m| m.into_inner().unwrap_or_else(|p| p.into_inner())) {
        if let Some(e) = log.error() {
            bail!(
                "--metrics {}: the run went on without its log after this failed: {e}",
                a.metrics
                    .as_ref()
                    .map_or(String::new(), |p| p.display().to_string())
            );
        }
    }
    // A run that finished but could not write its trace (`--trace
    // /dev/stdout | head`) has written its weights above; then it fails.
    if let Some(e) = report.trace_not_written.clone() {
        return Err(e).with_context(|| {
            format!(
                "--trace {}: the run finished, but its trace was not written",
                a.trace.display()
            )
        });
    }
    if signal != 0 {
        // The process ends by the signal it was stopped with (after the
        // outputs above), so a shell or a script sees the interruption (a
        // loop of runs stops; a shell's status 128 + the signal's number).
        let _ = std::io::stdout().flush();
        signal_hook::low_level::emulate_default_handler(signal as _)
            .context("ending the process by its signal")?;
    }
    Ok(())
}

/// Whether the process was started with `signal` ignored (a background job
/// of a non-interactive shell ignores SIGINT).
fn ignored_at_start(signal: std::ffi::c_int) -> bool {
    let mut old = std::mem::MaybeUninit::<libc::sigaction>::zeroed();
    // SAFETY: with a null new action, sigaction only writes the current one
    // into `old`, which is large enough for it.
    let found = unsafe { libc::sigaction(signal, std::ptr::null(), old.as_mut_ptr()) } == 0;
    // SAFETY: zeroed is a valid sigaction, and sigaction filled it when it succeeded.
    found && unsafe { old.assume_init() }.sa_sigaction == libc::SIG_IGN
}

/// The model `eval` or `sample` runs: Hugging Face weights, or the
/// parameters of a training checkpoint. Returns it with what to call it.
fn load_model(
    weights: Option<&Path>,
    checkpoint: Option<&Path>,
) -> Result<(Gpt2Config, Vec<f32>, String)> {
    match (weights, checkpoint) {
        (Some(w), _) => {
            let (cfg, params) = load_hf_model(w).context("--weights")?;
            Ok((cfg, params, w.display().to_string()))
        }
        (None, Some(dir)) => {
            let (c, params) = load_checkpoint_params(dir).context("--checkpoint")?;
            let name = format!("the checkpoint in {} (step {})", dir.display(), c.step);
            Ok((c.config, params, name))
        }
        (None, None) => unreachable!("clap requires one of them"),
    }
}

/// Refuses a run whose outputs name one file twice, or name one of its
/// inputs (a trace over the checkpoint, metrics over the training text,
/// weights over `--init-from`), before anything is written: each would
/// destroy the other. Streams (`/dev/stdout`, a pipe) are not files here.
fn check_outputs_apart(a: &TrainArgs) -> Result<()> {
    // A weights path's files: the weights, and a directory's config.json.
    let hf_files = |flag: &str, path: &Path| {
        let at = HfOutput::for_path(path);
        let config = at.dir.map(|(_, c)| (format!("{flag}'s config.json"), c));
        std::iter::once((flag.to_string(), at.weights)).chain(config)
    };
    let stream = |p: &Path| std::fs::metadata(p).is_ok_and(|m| !m.is_file() && !m.is_dir());
    let checkpoint = a.checkpoint_dir.as_ref().map(|d| {
        let what = format!("the checkpoint of --checkpoint-dir {}", d.display());
        (what, checkpoint_file(d))
    });
    let trace = (!a.no_trace).then(|| ("--trace".to_string(), a.trace.clone()));
    let metrics = (a.metrics.as_ref())
        .filter(|m| !stream(m))
        .map(|m| ("--metrics".to_string(), m.clone()));
    let outputs: Vec<(String, PathBuf)> = checkpoint
        .into_iter()
        .chain(trace)
        .chain(metrics)
        .chain(
            a.save_weights
                .iter()
                .flat_map(|w| hf_files("--save-weights", w)),
        )
        .collect();
    // Inputs named by a path, where a file is there (not a built-in
    // source, a shard pattern or a model's name).
    let model = (a.model.as_deref()).filter(|m| Gpt2Config::from_name(m).is_err());
    let named = [
        ("--data", Some(Path::new(&a.data))),
        ("--val-data", a.val_data.as_deref().map(Path::new)),
        ("--model", model.map(Path::new)),
        ("--placement", a.placement.as_deref()),
    ];
    let inputs: Vec<(String, PathBuf)> = named
        .into_iter()
        .filter_map(|(flag, p)| Some((flag.to_string(), p.filter(|p| p.is_file())?.into())))
        .chain(a.init_from.iter().flat_map(|i| hf_files("--init-from", i)))
        .collect();
    for (i, (what, path)) in outputs.iter().enumerate() {
        let clash = outputs[..i].iter().find(|(_, p)| same_file(path, p));
        if let Some((other, _)) = clash {
            bail!(
                "{what} {} is also {other}: each output needs a file of its own \
                 (nothing was written)",
                path.display()
            );
        }
        if let Some((input, _)) = inputs.iter().find(|(_, p)| same_file(path, p)) {
            bail!(
                "{what} {} is the file of {input}: writing it would destroy what the run \
                 reads (nothing was written)",
                path.display()
            );
        }
    }
    Ok(())
}

/// Refuses a `--save-weights` path that cannot be written, or that is the
/// file of the checkpoint in `checkpoint` (the weights would replace the
/// checkpoint), before any work.
fn check_weights_output(path: &Path, checkpoint: Option<&Path>) -> Result<()> {
    if let Some(dir) = checkpoint.filter(|d| same_file(path, &checkpoint_file(d))) {
        bail!(
            "--save-weights {} is the checkpoint's own file in {}: the weights would replace \
             the checkpoint; name another file",
            path.display(),
            dir.display()
        );
    }
    match HfOutput::for_path(path).unwritable() {
        Some(why) => bail!("--save-weights {}: {why}", path.display()),
        None => Ok(()),
    }
}

/// Whether `a` and `b` name the same file: the same file where both exist
/// (links followed), else the same name in the same directory.
fn same_file(a: &Path, b: &Path) -> bool {
    #[cfg(unix)]
    if let (Ok(x), Ok(y)) = (std::fs::metadata(a), std::fs::metadata(b)) {
        use std::os::unix::fs::MetadataExt;
        return (x.dev(), x.ino()) == (y.dev(), y.ino());
    }
    let place = |p: &Path| {
        let dir = match p.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        let dir = std::fs::canonicalize(dir)
            .or_else(|_| std::path::absolute(dir))
            .unwrap_or_else(|_| dir.to_path_buf());
        (dir, p.file_name().map(ToOwned::to_owned))
    };
    place(a) == place(b)
}

/// Where the summary lines go: standard output, unless one of `outputs` is
/// the file standard output goes to (`/dev/stdout`, or the file it is
/// redirected to), which must hold that output alone: then standard error.
fn summary_stream(outputs: &[Option<&Path>]) -> Box<dyn Write> {
    let stdout = Path::new("/dev/stdout");
    if outputs.iter().flatten().any(|p| same_file(p, stdout)) {
        Box::new(std::io::stderr())
    } else {
        Box::new(std::io::stdout())
    }
}

/// Writes `--save-weights` and says what was written to `summary`.
fn save_weights(
    path: &Path,
    params: &[f32],
    cfg: &Gpt2Config,
    summary: &mut dyn Write,
) -> Result<()> {
    let out = save_hf_model(path, params, cfg)
        .with_context(|| format!("--save-weights {}", path.display()))?;
    let _ = writeln!(summary, "weights          {}", out.weights.display());
    if let Some((_, config)) = &out.dir {
        let _ = writeln!(summary, "config           {}", config.display());
    }
    Ok(())
}

fn cmd_export(a: ExportArgs) -> Result<()> {
    check_weights_output(&a.save_weights, Some(&a.checkpoint))?;
    let (cfg, params, name) = load_model(None, Some(&a.checkpoint))?;
    say!(
        "writing the parameters of {name} to {}",
        a.save_weights.display()
    );
    let mut summary = summary_stream(&[Some(&a.save_weights)]);
    save_weights(&a.save_weights, &params, &cfg, &mut summary)
}

fn cmd_tokenize(a: TokenizeArgs) -> Result<()> {
    let stdin = a.text == Path::new("-");
    // `-` reads standard input; as the output it would be a file named
    // `-`, which nobody means.
    if a.output == Path::new("-") {
        bail!(
            "the output `-` would be a file named `-`: name a file, or /dev/stdout to write \
             the token file to standard output"
        );
    }
    if !stdin && same_file(&a.text, &a.output) {
        bail!(
            "{} is both the text and the output: the text would be replaced",
            a.output.display()
        );
    }
    if let Some(why) = braid::fs::unwritable(&a.output) {
        bail!("{}: {why}", a.output.display());
    }
    let (bytes, origin) = if stdin {
        let mut b = Vec::new();
        std::io::Read::read_to_end(&mut std::io::stdin(), &mut b)
            .context("reading the text from standard input")?;
        (b, "standard input".to_string())
    } else {
        let b = std::fs::read(&a.text).with_context(|| format!("reading {}", a.text.display()))?;
        (b, a.text.display().to_string())
    };
    if braid_gpt2::data::tokenfile::has_token_magic(&bytes) {
        bail!("{origin} is already a token file (it starts with llm.c's header)");
    }
    let tokens = TokenSource::from_text_bytes(&bytes, Path::new(&origin), origin.as_str())?;
    braid_gpt2::data::write_token_file(&a.output, &tokens.tokens())?;
    say!(
        "{} bytes of {origin} are {} tokens: {}",
        bytes.len(),
        tokens.len(),
        a.output.display()
    );
    Ok(())
}

fn cmd_eval(a: EvalArgs) -> Result<()> {
    let (cfg, params, name) = load_model(a.weights.as_deref(), a.checkpoint.as_deref())?;
    let tokens = TokenSource::resolve(&a.tokens).context("--tokens")?;
    let seq_len = a.seq_len.unwrap_or_else(|| {
        let all_but_last = tokens.len().saturating_sub(1).max(1);
        cfg.max_seq_len.min(all_but_last)
    });
    // The first windows only: their tokens and the one after them.
    let all = tokens.len();
    let tokens = match a
        .windows
        .map(|n| (n as usize).saturating_mul(seq_len).saturating_add(1))
    {
        Some(end) if end < tokens.len() => tokens.part(0..end, tokens.origin())?,
        _ => tokens,
    };
    check_eval(&cfg, &tokens, seq_len, a.batch_size)
        .with_context(|| format!("evaluating on {}", a.tokens))?;
    let rt = model_runtime(a.device, a.streams, Policy::Affinity, 0)?;
    let opts = ModelOptions {
        dtype: a.dtype.unwrap_or(default_dtype(rt.cuda_device().is_some())),
        fusion: a.fuse.unwrap_or(Fusion::ALL),
        ..ModelOptions::default()
    };
    say!(
        "evaluating {name} ({cfg}) on {} ({}), windows of {seq_len} tokens, {} per batch, on \
         {}, {}, fused kernels: {}",
        tokens.origin(),
        match tokens.len() {
            n if n == all => format!("{n} tokens"),
            n => format!("the first {n} of its {all} tokens"),
        },
        a.batch_size,
        rt.backend_name(),
        opts.dtype,
        opts.fusion
    );
    let r = evaluate(
        &rt,
        &cfg,
        &params,
        &tokens,
        seq_len,
        a.batch_size,
        opts,
        |i, n| {
            if i == n || i % 50 == 0 {
                say!("batch {i}/{n}");
            }
        },
    )
    .with_context(|| format!("evaluating on {}", a.tokens))?;
    say!(
        "{} windows, {} predicted tokens, perplexity {:.3}",
        r.windows,
        r.tokens,
        r.loss.exp()
    );
    quiet_if_gone(
        writeln!(std::io::stdout(), "loss={:.6}", r.loss),
        "the loss",
    )
}

/// The outcome of writing `what` to standard output: a reader that has gone
/// (`| head`) ends the program quietly, as `yes` would; any other error is
/// one.
fn quiet_if_gone(written: std::io::Result<()>, what: &str) -> Result<()> {
    match written {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
            Err(e).with_context(|| format!("writing {what} to standard output"))
        }
        _ => Ok(()),
    }
}

fn cmd_sample(a: SampleArgs) -> Result<()> {
    let (cfg, params, _) = load_model(a.weights.as_deref(), a.checkpoint.as_deref())?;
    let tok = Tokenizer::gpt2()?;
    let context = if a.prompt.is_empty() {
        if tok.eot() as usize >= cfg.vocab_size {
            bail!(
                "--prompt is empty, and the model's vocabulary of {} tokens lacks GPT-2's \
                 <|endoftext|> ({}) to start a document with; give a --prompt",
                cfg.vocab_size,
                tok.eot()
            );
        }
        vec![tok.eot()]
    } else {
        tok.encode_with_eot(&a.prompt)
    };
    braid_gpt2::data::check_ids(&context, cfg.vocab_size, "--prompt").with_context(|| {
        format!(
            "the prompt's tokens do not fit the model's vocabulary of {}",
            cfg.vocab_size
        )
    })?;
    // The model sees its context's worth of tokens: the prompt's last ones.
    if let Some(dropped) = context
        .len()
        .checked_sub(cfg.max_seq_len)
        .filter(|&n| n > 0)
    {
        say!(
            "note: the prompt is {} tokens and the model's context {}: its first {dropped} \
             tokens are dropped, and the model continues the last {}",
            context.len(),
            cfg.max_seq_len,
            cfg.max_seq_len
        );
    }
    let rt = model_runtime(a.device, 2, Policy::Affinity, 0)?;
    let Some(total) = context.len().checked_add(a.tokens) else {
        bail!(
            "--tokens {} is more tokens than can be counted (with the prompt's {})",
            a.tokens,
            context.len()
        );
    };
    let window = total.min(cfg.max_seq_len);
    let dtype = a.dtype.unwrap_or(default_dtype(rt.cuda_device().is_some()));
    let mut sampler = Sampler::new(&rt, &cfg, &params, window, a.temperature, a.seed, dtype)?;
    // The sampler's model holds its own copy.
    drop(params);
    sampler.set_sampling(Sampling {
        temperature: a.temperature,
        top_k: a.top_k,
        top_p: a.top_p,
    })?;
    let mut out = Output {
        w: std::io::stdout().lock(),
        error: None,
    };
    // A character spread over several tokens is written once its last
    // token is in; a token outside GPT-2's vocabulary (a model with a
    // bigger one) cannot be shown as text: it is written as `<id>`.
    for i in 0..a.num_samples {
        if (i > 0 && !out.put("---\n")) || !out.put(&a.prompt) {
            break;
        }
        let mut text = tok.stream();
        sampler.generate_until(&rt, &context, a.tokens, |t| {
            // A write that failed stops generation at once; the error is
            // `out.error`.
            Ok(match out.put(&text.push(t)) {
                true => std::ops::ControlFlow::Continue(()),
                false => std::ops::ControlFlow::Break(()),
            })
        })?;
        if out.error.is_some() {
            break;
        }
        // A character the last tokens left unfinished, as U+FFFD.
        out.put(&(text.finish() + "\n"));
    }
    quiet_if_gone(out.error.map_or(Ok(()), Err), "the sample")
}

/// Standard output of `sample`: text written and flushed as it comes, and
/// the first write error kept (after which nothing more is written).
struct Output<W> {
    w: W,
    error: Option<std::io::Error>,
}

impl<W: std::io::Write> Output<W> {
    /// Writes and flushes `s`; false once a write has failed.
    fn put(&mut self, s: &str) -> bool {
        if self.error.is_some() {
            return false;
        }
        match self.w.write_all(s.as_bytes()).and_then(|()| self.w.flush()) {
            Ok(()) => true,
            Err(e) => {
                self.error = Some(e);
                false
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::model_from_json;
    use serde_json::json;

    fn err(j: serde_json::Value) -> String {
        format!("{:#}", model_from_json(&j).unwrap_err())
    }

    /// Braid's keys, strictly; a Hugging Face config.json's, with its other
    /// keys; a size under two names must agree and be an integer.
    #[test]
    fn model_files_are_read_strictly() {
        let braid = json!({"max_seq_len": 32, "vocab_size": 512, "num_layers": 2,
                           "num_heads": 2, "channels": 16});
        let cfg = model_from_json(&braid).unwrap();
        assert_eq!(
            (
                cfg.max_seq_len,
                cfg.vocab_size,
                cfg.num_layers,
                cfg.num_heads,
                cfg.channels
            ),
            (32, 512, 2, 2, 16)
        );
        let hf = json!({"model_type": "gpt2", "n_positions": 32, "n_ctx": 32,
                        "vocab_size": 512, "n_layer": 2, "n_head": 2, "n_embd": 16,
                        "activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"]});
        assert_eq!(model_from_json(&hf).unwrap(), cfg);
        let mut typo = braid.clone();
        typo["num_layer"] = json!(7);
        assert!(err(typo).contains("unknown key `num_layer`"));
        let mut text = braid.clone();
        text["channels"] = json!("16");
        assert!(err(text).contains(r#"`channels` is "16", not a non-negative integer"#));
        let mut float = braid.clone();
        float["channels"] = json!(16.0);
        assert!(err(float).contains("`channels` is 16.0"));
        let mut both = braid.clone();
        both["n_layer"] = json!(3);
        assert!(err(both).contains("`num_layers` 2 and `n_layer` 3 disagree"));
        let mut hf_off = hf.clone();
        hf_off["n_ctx"] = json!(64);
        assert!(err(hf_off).contains("`n_positions` 32 and `n_ctx` 64 disagree"));
        let mut missing = braid.clone();
        missing.as_object_mut().unwrap().remove("channels");
        assert!(err(missing).contains("lacks `channels` or `n_embd`"));
        assert!(err(json!([1, 2])).contains("not a JSON object"));
    }
}

//! What a run reports: each step as rank 0 saw it ([`StepReport`]) and the
//! whole run ([`TrainReport`], with its throughput, communication figures and
//! printed summary).

use std::fmt;
use std::path::PathBuf;

use braid::comm::cap::CapChoice;
use braid::trace::{Profile, Summary};

/// One finished step, as rank 0 saw it (a line of a [`MetricsLog`](super::MetricsLog)).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct StepReport {
    /// The step number (1-based, counting resumed steps).
    pub step: u64,
    /// Mean loss over the global batch.
    pub loss: f32,
    /// Global gradient norm before clipping.
    pub grad_norm: f32,
    /// The step's learning rate (`TrainOptions::lr_schedule`).
    pub lr: f32,
    /// Wall time of the step (submission to completion).
    pub seconds: f64,
    /// Tokens in the global batch.
    pub tokens: usize,
    /// Whether the step was a replay of the recorded step.
    pub replayed: bool,
    /// The validation loss after the step's update, where the run
    /// evaluated ([`TrainOptions::validation`](super::TrainOptions)).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub val_loss: Option<f32>,
    /// On a fresh run's first step only: the validation loss of the
    /// parameters the run started from (step 0's), scored before the step.
    /// The metrics log writes it as a line of its own, step 0's.
    #[serde(skip)]
    pub start_val_loss: Option<f32>,
    /// The tokens generated after the step's update, where the run
    /// generated ([`TrainOptions::generation`](super::TrainOptions)); not
    /// in the metrics log.
    #[serde(skip)]
    pub sample: Option<Vec<u32>>,
}

/// What a run did.
#[derive(Debug, Clone)]
pub struct TrainReport {
    /// The steps taken in this run, in order (rank 0's view; under torchrun,
    /// this process's rank: the losses are the global means on every rank).
    pub steps: Vec<StepReport>,
    /// The last step number (the checkpoint's step): the run's `steps`, or
    /// an earlier one where [`TrainOptions::stop`](super::TrainOptions)
    /// stopped it.
    pub final_step: u64,
    /// Rank 0's parameters at the end (empty in a torchrun process of
    /// another rank).
    pub params: Vec<f32>,
    /// A hash of each rank's final parameters (all equal in a correct run).
    pub param_hashes: Vec<u64>,
    /// Each rank's profile (this process's ranks).
    pub profiles: Vec<Profile>,
    /// Each rank's summary of the measured steps: its profile from the end
    /// of this run's first step on (the warm-up, which the mean step time
    /// leaves out too: first collectives, the recording), or of the whole
    /// profile for a one-step run.
    pub summaries: Vec<Summary>,
    /// Each rank's summary of its whole profile, the first step included.
    pub whole_run: Vec<Summary>,
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
    /// Why the trace asked for was not written (a full disk, `--trace
    /// /dev/stdout` piped into a reader that has gone), if it was not: the
    /// run itself finished.
    pub trace_not_written: Option<braid::Error>,
    /// The checkpoint written, if any.
    pub checkpoint: Option<PathBuf>,
    /// Bytes of AdamW state (the two `f32` moments) on each rank's device:
    /// every parameter's, or with ZeRO-1 the rank's shard's.
    pub optimizer_bytes: Vec<usize>,
    /// Bytes of each rank's model buffers on its device (parameters,
    /// gradients, activations and their gradients, master weights,
    /// scratch; the sampler's model of `--sample-every` too):
    /// [`Gpt2Model::device_bytes`](crate::model::Gpt2Model::device_bytes).
    pub model_bytes: Vec<usize>,
    /// Whether the optimizer state was sharded (ZeRO-1).
    pub zero: bool,
    /// Whether the tied embedding's gradient was reduced as two writers
    /// ([`TrainOptions::splits_tied`](super::TrainOptions::splits_tied)).
    pub tied_split: bool,
    /// With [`TrainOptions::auto_bucket_cap`](super::TrainOptions::auto_bucket_cap)
    /// and several ranks: the cap rank 0 chose after the first step.
    pub bucket_cap: Option<CapReport>,
    /// Each rank's steps replayed as one unit (a CUDA graph launch; on the
    /// CPU one sequential run), with [`TrainOptions::graphs`](super::TrainOptions::graphs).
    pub graph_replays: Vec<u64>,
    /// Why the recorded step did not become a graph, if it was refused.
    pub graph_refusal: Option<String>,
    /// How a graph-replayed step runs (`braid::Schedule::graph_shape`,
    /// rank 0's): `(graphs, collectives and host tasks between them)`.
    pub graph_shape: Option<(usize, usize)>,
    /// Whether the step's collectives were asked into its graphs
    /// ([`TrainOptions::graph_collectives`](super::TrainOptions::graph_collectives),
    /// with a reducer).
    pub graph_collectives: bool,
    /// Why they are not inside them nonetheless (the capture with them
    /// failed and the graphs were cut around them:
    /// `braid::Schedule::graph_collectives_left_out`, rank 0's first).
    pub graph_collectives_left_out: Option<String>,
    /// What the recorded step's placement trial measured and kept
    /// (`braid::Schedule::placement_trial`, rank 0's; CUDA).
    pub placement_trial: Option<braid::TrialOutcome>,
    /// `(spared, of)`: the SMs rank 0's compute kernels left to other
    /// programs, of its device's, with
    /// [`TrainOptions::spare_sms`](super::TrainOptions::spare_sms) on CUDA.
    pub spared_sms: Option<(u32, u32)>,
    /// What ran the attention through cuDNN (`--attention cudnn` or
    /// `auto`), one line per shape and direction (and, under `auto`, what
    /// fell back to Braid's kernels and why)
    /// ([`cudnn_report`](crate::kernels::flash_attention::cudnn_report));
    /// empty when nothing did.
    pub cudnn: Vec<String>,
}

/// The bucket cap an auto run chose (rank 0's view; every rank uses it).
#[derive(Debug, Clone, PartialEq)]
pub enum CapReport {
    /// Chosen from the model of the reducer ([`braid::comm::cap`]).
    Chosen(CapChoice),
    /// The configured cap was kept, for the reason given.
    Kept {
        /// The cap kept, bytes.
        cap_bytes: usize,
        /// Why.
        why: String,
    },
}

impl CapReport {
    /// The cap the buckets used from the second step on, bytes.
    pub fn cap_bytes(&self) -> usize {
        match self {
            CapReport::Chosen(c) => c.chosen.cap_bytes,
            CapReport::Kept { cap_bytes, .. } => *cap_bytes,
        }
    }
}

fn mib(bytes: usize) -> String {
    let m = bytes as f64 / (1 << 20) as f64;
    if m.fract() == 0.0 {
        format!("{m:.0} MiB")
    } else {
        format!("{m} MiB")
    }
}

impl fmt::Display for CapReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CapReport::Chosen(c) => write!(
                f,
                "auto {}: predicted exposed {:.2} ms ({}: {:.2} ms, step 1 measured {:.2} ms); \
                 link {:.0} us + {:.3} ns/B from {} all-reduce(s)",
                mib(c.chosen.cap_bytes),
                c.chosen.exposed_ns / 1e6,
                mib(c.configured.cap_bytes),
                c.configured.exposed_ns / 1e6,
                c.measured_exposed_ns / 1e6,
                c.link.alpha_ns / 1e3,
                c.link.beta_ns_per_byte,
                c.samples
            ),
            CapReport::Kept { cap_bytes, why } => {
                write!(f, "auto kept {}: {why}", mib(*cap_bytes))
            }
        }
    }
}

impl TrainReport {
    /// Mean wall time per step, leaving out the first step of the run (warm-up)
    /// when there is more than one.
    pub fn mean_step_seconds(&self) -> f64 {
        let s = self.measured();
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

    /// Share of communication time hidden under computation over the
    /// measured steps ([`summaries`](Self::summaries)), averaged over ranks
    /// (0 without communication).
    pub fn hidden_comm_share(&self) -> f64 {
        mean_over_ranks_with_comm(&self.summaries, Summary::hidden_share)
    }

    /// The same over the whole run, the first step included
    /// ([`whole_run`](Self::whole_run)).
    pub fn hidden_comm_share_whole_run(&self) -> f64 {
        mean_over_ranks_with_comm(&self.whole_run, Summary::hidden_share)
    }

    /// Share of the communication time after the waits for other ranks
    /// hidden under computation ([`Summary::transfer_hidden_share`]) over
    /// the measured steps, averaged over ranks (0 without communication).
    pub fn hidden_transfer_share(&self) -> f64 {
        mean_over_ranks_with_comm(&self.summaries, Summary::transfer_hidden_share)
    }

    /// Communication time per rank over the measured steps, averaged, in
    /// seconds.
    pub fn comm_seconds(&self) -> f64 {
        self.per_rank_seconds(|s| s.comm_ns)
    }

    /// Of [`comm_seconds`](Self::comm_seconds), the time collectives waited
    /// for other ranks to reach them (CPU ranks; 0 on NCCL), averaged.
    pub fn comm_wait_seconds(&self) -> f64 {
        self.per_rank_seconds(|s| s.comm_wait_ns)
    }

    /// How many steps the summaries and the mean step time cover: this
    /// run's steps after the first, or its one step.
    pub fn measured_steps(&self) -> usize {
        self.measured().len()
    }

    /// The steps the summaries and the mean step time cover.
    fn measured(&self) -> &[StepReport] {
        match self.steps.len() {
            0 | 1 => &self.steps,
            _ => &self.steps[1..],
        }
    }

    fn per_rank_seconds(&self, f: impl Fn(&Summary) -> u64) -> f64 {
        if self.summaries.is_empty() {
            return 0.0;
        }
        self.summaries.iter().map(|s| f(s) as f64).sum::<f64>() / self.summaries.len() as f64 / 1e9
    }
}

fn mean_over_ranks_with_comm(summaries: &[Summary], f: impl Fn(&Summary) -> f64) -> f64 {
    let with_comm: Vec<f64> = summaries.iter().filter(|s| s.comm_ns > 0).map(f).collect();
    if with_comm.is_empty() {
        0.0
    } else {
        with_comm.iter().sum::<f64>() / with_comm.len() as f64
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
        let at_start = self
            .steps
            .first()
            .and_then(|s| Some((s.start_val_loss?, 0)));
        let mut validated = at_start.into_iter().chain(
            self.steps
                .iter()
                .filter_map(|s| Some((s.val_loss?, s.step))),
        );
        if let (Some(first), Some(last)) = (validated.clone().next(), validated.next_back()) {
            writeln!(
                f,
                "validation loss  {:.4} (step {}) -> {:.4} (step {})",
                first.0, first.1, last.0, last.1
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
            "communication    {:.1} ms per rank, {:.0}% hidden under compute{}",
            self.comm_seconds() * 1e3,
            100.0 * self.hidden_comm_share(),
            if self.tied_split {
                " (tied gradient split)"
            } else {
                ""
            }
        )?;
        // With more than one step, the summary covers the steps after the
        // first (`measured`); the whole run's share goes beside it.
        let m = self.measured();
        if let ([first, _, ..], Some(second), Some(last)) = (&self.steps[..], m.first(), m.last()) {
            if self.comm_seconds() > 0.0 {
                writeln!(
                    f,
                    "                 over steps {}-{} (as the mean step time); with step {}: {:.0}%",
                    second.step,
                    last.step,
                    first.step,
                    100.0 * self.hidden_comm_share_whole_run()
                )?;
            }
        }
        // On CUDA a graph's tasks have no spans of their own.
        let replayed = self.graph_replays.first().is_some_and(|&n| n > 0);
        if self.graph_collectives
            && self.graph_collectives_left_out.is_none()
            && self.backend == "cuda"
            && replayed
        {
            writeln!(
                f,
                "                 (not counting the collectives inside the step's CUDA \
                 graphs, which have no spans)"
            )?;
        }
        if self.comm_wait_seconds() > 0.0 {
            writeln!(
                f,
                "                 {:.1} ms of it waiting for other ranks; the rest {:.0}% hidden",
                self.comm_wait_seconds() * 1e3,
                100.0 * self.hidden_transfer_share()
            )?;
        }
        if let Some(c) = &self.bucket_cap {
            writeln!(f, "bucket cap       {c}")?;
        }
        if let Some(why) = &self.graph_refusal {
            writeln!(f, "graph replay     refused: {why}")?;
        } else if let Some(&n) = self.graph_replays.first().filter(|&&n| n > 0) {
            match self.graph_shape {
                Some((g, e)) if e > 0 => writeln!(
                    f,
                    "graph replay     {n} steps, each {g} graphs with {e} collectives \
                     or host tasks between them"
                )?,
                _ => writeln!(f, "graph replay     {n} steps launched as one graph each")?,
            }
            if let Some(why) = &self.graph_collectives_left_out {
                writeln!(
                    f,
                    "                 collectives not captured, graphs cut around them: {why}"
                )?;
            }
        }
        if let Some(t) = &self.placement_trial {
            let kept = match t.kept {
                braid::TrialPlacement::Recorded => "its streams",
                braid::TrialPlacement::OneStream => "one stream",
            };
            writeln!(
                f,
                "placement trial  a step {:.2} ms on its streams, {:.2} ms on one: kept {kept}",
                t.recorded_ns as f64 / 1e6,
                t.one_stream_ns as f64 / 1e6,
            )?;
        }
        if let Some((spared, of)) = self.spared_sms {
            writeln!(
                f,
                "SMs              compute on {} of {of}, {spared} left to other programs",
                of - spared
            )?;
        }
        for line in &self.cudnn {
            writeln!(f, "attention        {line}")?;
        }
        if let Some(&bytes) = self.model_bytes.first() {
            writeln!(
                f,
                "model buffers    {:.1} MiB on rank 0 (parameters, gradients, activations{})",
                bytes as f64 / (1 << 20) as f64,
                match self.steps.iter().any(|s| s.sample.is_some()) {
                    true => "; the sampler's model too",
                    false => "",
                }
            )?;
        }
        if let Some(&bytes) = self.optimizer_bytes.first() {
            writeln!(
                f,
                "optimizer state  {:.1} MiB on rank 0{}",
                bytes as f64 / (1 << 20) as f64,
                if self.zero { " (ZeRO-1 shard)" } else { "" }
            )?;
        }
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
        match (&self.trace, &self.trace_not_written) {
            (Some(t), _) => write!(f, "trace            {}", t.display()),
            (None, Some(e)) => write!(f, "trace            not written: {e}"),
            (None, None) => write!(f, "trace            (none; pass --trace FILE)"),
        }
    }
}

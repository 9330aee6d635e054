//! The DDP gradient bucket reducer.
//!
//! Parameters and gradients each live in one flat allocation (llm.c's
//! layout) of `f32` (or bf16, [`BucketConfig::dtype`]) gradients, so a bucket
//! is a view of the gradient buffer: a contiguous range of whole parameters. The reducer holds a [`BoundComm`], so it submits on
//! that communicator's runtime:
//!
//! ```
//! use braid::comm::{BucketConfig, ParamSpec};
//! use braid::{BackendKind, Reducer, Runtime};
//!
//! let out = braid::launch(2, |rank, comm| {
//!     let rt = Runtime::builder().backend(BackendKind::Cpu).rank(rank).build()?;
//!     let grads = rt.alloc_from("grads", &[rank as f32 + 1.0; 8])?; // (8,)
//!     let specs = vec![ParamSpec::new("w", 0..6), ParamSpec::new("b", 6..8)];
//!     let mut red = Reducer::new(comm.bind(&rt)?, &grads, specs, BucketConfig::default())?;
//!     // Backward: right after submitting the last task writing a gradient.
//!     red.grad_ready(1)?;
//!     red.grad_ready(0)?;
//!     red.finish()?; // end of backward
//!     rt.read_vec::<f32>(&grads)
//! });
//! for r in out {
//!     assert_eq!(r?, vec![1.5; 8]); // averaged over the ranks
//! }
//! # Ok::<(), braid::Error>(())
//! ```
//!
//! The program calls [`Reducer::grad_ready`] right after it submitted the
//! task that writes a parameter's last gradient contribution; once every
//! parameter of the next bucket is marked, the reducer submits that
//! bucket's all-reduce (average) with `read_write` on the bucket view. The
//! all-reduce *starts* when the engine's dependency inference says so — after
//! every task that writes into the view — never because of a host wait, so it
//! runs on the comm stream while the rest of the backward pass still runs on
//! the compute streams.
//!
//! # Bucket order
//!
//! Buckets are submitted strictly in bucket order (bucket `i + 1` waits for
//! bucket `i` to be complete), so every rank issues the same bucket
//! collectives in the same order even if ranks mark parameters in different
//! orders. Row contributions ([`Reducer::sparse_ready`]) are the exception:
//! their all-gathers go out when they are handed over, between whichever
//! buckets were submitted by then, so each must be handed over at the same
//! point on every rank — once the same parameters have been marked (in any
//! order), e.g. after every `grad_ready` of the step. Otherwise the ranks'
//! collectives do not match: the local communicator fails the step saying
//! so; over NCCL nothing checks it.
//!
//! # Forming buckets
//!
//! From an order of the parameters: walk it; a parameter joins the open bucket
//! when its range is adjacent in memory to the bucket's range (touching either
//! end) and the bucket stays within its cap (`first_cap_bytes` for the first
//! bucket, `cap_bytes` after); otherwise the open bucket closes and the
//! parameter opens the next one. A parameter larger than the cap gets a bucket
//! of its own. So buckets are maximal runs of memory-adjacent parameters in the
//! given order, split at the caps. The initial layout uses the *reverse* layout
//! order (backward produces the last layer's gradients first).
//!
//! # Rebuild
//!
//! The reducer records the order of the `grad_ready` calls of the first step
//! (their submission order: the order in which the program made gradients
//! ready, which is also the order in which it can submit their all-reduces;
//! completion order on the streams is not used, since it varies run to run
//! while the buckets must not). At the end of the first synchronised step
//! (`finish`), after that step's buckets, rank 0's recorded order (completed
//! with any parameter it never marked, in reverse layout order) is broadcast
//! with the communicator itself — a collective in the same position on every
//! rank — and every rank forms the new buckets from it with the rule above.
//! `finish` waits on the host for that one broadcast; no other host waits.
//! The rebuild happens once (as in PyTorch).
//!
//! # Choosing the cap
//!
//! With [`BucketConfig::auto_cap`] on (and more than one rank), the cap of
//! the rebuilt buckets comes from a model of this pipeline (`cap.rs`)
//! calibrated on the first synced step itself: at each `grad_ready` of that
//! step the reducer notes how many tasks the runtime had been given (a
//! task's submission index in the profile, as long as no recorded schedule
//! was replayed before that step: the trainer's first step is eager); at
//! `finish` it waits on the host (without consuming errors) for that step's
//! bucket all-reduces, and reads the runtime's profile: a parameter's
//! gradient was complete once every compute task submitted before its
//! `grad_ready` had ended (an upper bound: tasks running beside its last
//! writer count too), the backward pass ended with the last of them, and
//! each bucket's all-reduce took the shortest of its durations over the
//! ranks (one all-reduce of `f64` minimums: the rank that arrived last
//! waited least for the other ones). α and β are fitted to those
//! durations, rank 0 predicts every cap of [`CAP_CANDIDATES`](super::cap::CAP_CANDIDATES)
//! and broadcasts the chosen cap with the bucket order. Without a profile
//! (the runtime's profiling off) or a usable measurement, rank 0 keeps the
//! configured cap and says why ([`Reducer::cap_choice`]). A host wait, two
//! collectives and a profile read, once.
//!
//! # ZeRO-1
//!
//! With [`BucketConfig::shard`] on, once the layout is final (after the
//! rebuild, or at once without one) a synced bucket is reduce-scattered
//! instead of all-reduced (its last `len mod world` elements all-reduced),
//! so a rank holds the averaged gradients of its shard only;
//! [`Reducer::shards`] says which, and [`Reducer::all_gather_params`] puts
//! the ranks' updated parameters back. Until then (the first step) buckets
//! are all-reduced. The sparse contributions are exchanged as without
//! sharding and added to the whole gradient, whose shard is then right.
//! See `shard.rs`.
//!
//! # `no_sync`
//!
//! While sync is off ([`Reducer::no_sync`], [`Reducer::set_sync`]),
//! `grad_ready` only checks and records; no all-reduce is submitted, so the
//! gradients accumulate locally. The next synchronised step reduces the
//! accumulated gradients. Switch between steps, not inside one.

use super::cap::{choose_cap, CapChoice, CapInput, Link, CAP_CANDIDATES};
use super::layout::form_buckets;
pub use super::layout::{BucketInfo, ParamSpec};
use super::shard::BucketShard;
use super::{Bf16, BoundComm, Buffers, CollectiveKind, DType, ReduceOp};
use crate::buffer::{Buffer, View};
use crate::error::{Error, Result};
use crate::kind::TaskKind;
use crate::sched::TaskHandle;
use std::fmt;
use std::ops::{Deref, DerefMut};
use std::sync::Arc;

/// Reduces one bucket in place of the built-in all-reduce (e.g. a custom
/// compression). Called in bucket order, identically on every rank; it must
/// submit tasks (never wait) that leave the bucket averaged over the ranks.
pub trait BucketHook: Send + Sync + fmt::Debug {
    /// Submits the tasks that average `view` (the gradients of `bucket`, of
    /// the reducer's [`BucketConfig::dtype`]): collectives through `comm`,
    /// other tasks on `comm.runtime()`.
    fn reduce(&self, comm: &BoundComm<'_>, bucket: &BucketInfo, view: &View) -> Result<()>;
}

/// How buckets travel.
#[derive(Debug, Clone, Default)]
pub enum Compression {
    /// All-reduce the `f32` gradients.
    #[default]
    None,
    /// Cast the bucket to bf16 into a side buffer, all-reduce that (averaging
    /// in `f32`, rounding once), cast back into the bucket: three tasks on the
    /// comm stream, half the bytes. CPU backend only: the casts have no CUDA
    /// body, so on CUDA submitting them fails ([`Error::NoBody`]). For `f32`
    /// gradients only (bf16 gradients travel in bf16 as they are).
    Bf16,
    /// A user hook.
    Hook(Arc<dyn BucketHook>),
}

/// The largest bucket cap a [`Reducer`] keeps: `2^62 - 1` bytes (on 64-bit
/// targets). At the rebuild rank 0 broadcasts the cap as two non-negative
/// `i32`s of 31 bits each, so a larger cap cannot travel; a larger one
/// (`usize::MAX`, the natural "no cap") is lowered to this one, which no
/// gradient buffer reaches: after the first bucket (which `first_cap_bytes`
/// bounds), every run of memory-adjacent parameters is one bucket, as an
/// unbounded cap would make it.
pub const MAX_CAP_BYTES: usize = (u64::MAX >> 2) as usize;

/// Configures a [`Reducer`].
#[derive(Debug, Clone)]
pub struct BucketConfig {
    /// Bucket size cap in bytes (default 25 MiB). At least 1 ([`Reducer::new`]
    /// refuses 0); one above [`MAX_CAP_BYTES`] is taken as that one (one
    /// bucket per run of memory-adjacent parameters).
    pub cap_bytes: usize,
    /// Cap of the first bucket (default 1 MiB), so the first all-reduce starts
    /// early. It never travels (each rank forms its first bucket from it), so
    /// any value works; 0 makes the first bucket one parameter.
    pub first_cap_bytes: usize,
    /// Rebuild the buckets from the observed ready order after the first step
    /// (default on).
    pub rebuild: bool,
    /// How buckets travel (default: as they are).
    pub compression: Compression,
    /// ZeRO-1: reduce-scatter each bucket instead of all-reducing it, so
    /// each rank holds the averaged gradients of its shard only (default
    /// off; see `shard.rs` and [`Reducer::shards`]). Uncompressed buckets
    /// only, of either dtype (bf16 buckets are reduce-scattered in bf16).
    pub shard: bool,
    /// The element type of the gradient buffer: [`DType::F32`] (the
    /// default) or [`DType::Bf16`], whose buckets are all-reduced in bf16
    /// (averaged in `f32`, rounded once per element). Parameter ranges and
    /// bucket caps count elements and bytes of this type.
    pub dtype: DType,
    /// Choose the cap of the rebuilt buckets from a model of the reducer
    /// calibrated on the first synced step (default off; see the module
    /// docs). `cap_bytes` is the first step's cap and the fallback. Needs
    /// the rebuild and plain buckets (no compression or hook); with one
    /// rank there is nothing to choose and the cap stays.
    pub auto_cap: bool,
}

impl Default for BucketConfig {
    fn default() -> Self {
        BucketConfig {
            cap_bytes: 25 << 20,
            first_cap_bytes: 1 << 20,
            rebuild: true,
            compression: Compression::None,
            shard: false,
            dtype: DType::F32,
            auto_cap: false,
        }
    }
}

impl BucketConfig {
    /// Sets the bucket cap: at least 1; `usize::MAX` (anything above
    /// [`MAX_CAP_BYTES`]) for no cap.
    pub fn cap_bytes(mut self, b: usize) -> Self {
        self.cap_bytes = b;
        self
    }

    /// Sets the first bucket's cap.
    pub fn first_cap_bytes(mut self, b: usize) -> Self {
        self.first_cap_bytes = b;
        self
    }

    /// Turns the rebuild on or off.
    pub fn rebuild(mut self, on: bool) -> Self {
        self.rebuild = on;
        self
    }

    /// Sets the compression.
    pub fn compression(mut self, c: Compression) -> Self {
        self.compression = c;
        self
    }

    /// Turns ZeRO-1 sharding on or off.
    pub fn shard(mut self, on: bool) -> Self {
        self.shard = on;
        self
    }

    /// Sets the gradients' element type.
    pub fn dtype(mut self, d: DType) -> Self {
        self.dtype = d;
        self
    }

    /// Turns the cap choice ([`auto_cap`](Self::auto_cap)) on or off.
    pub fn auto_cap(mut self, on: bool) -> Self {
        self.auto_cap = on;
        self
    }
}

/// The gradient bucket reducer of one rank, submitting on the runtime its
/// communicator is bound to. See the module docs.
pub struct Reducer<'rt> {
    comm: BoundComm<'rt>,
    grads: Buffer,
    params: Vec<ParamSpec>,
    config: BucketConfig,
    buckets: Vec<BucketInfo>,
    views: Vec<View>,
    /// bf16 side buffers, one per bucket (with `Compression::Bf16`).
    side: Vec<Option<Buffer>>,
    param_bucket: Vec<usize>,
    /// Per step: which parameters were marked, how many are left per bucket,
    /// and the next bucket to submit.
    marked: Vec<bool>,
    remaining: Vec<usize>,
    next: usize,
    sync: bool,
    /// The first step's `grad_ready` order.
    order: Vec<usize>,
    recording: bool,
    rebuilt: bool,
    steps: u64,
    /// Row contributions of gradients with several writers (`sparse.rs`).
    sparse: super::sparse::Exchange,
    /// Auto cap, first synced step: per parameter, the runtime's task count
    /// at its `grad_ready` (`u64::MAX`: not marked).
    marks: Vec<u64>,
    /// Auto cap, first synced step: each bucket all-reduce's bytes and task.
    timed: Vec<(usize, TaskHandle)>,
    /// What rank 0 chose, or why it kept the configured cap.
    choice: Option<std::result::Result<CapChoice, String>>,
}

impl fmt::Debug for Reducer<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Reducer")
            .field("params", &self.params.len())
            .field("buckets", &self.buckets.len())
            .field("sync", &self.sync)
            .field("rebuilt", &self.rebuilt)
            .field("steps", &self.steps)
            .finish()
    }
}

impl<'rt> Reducer<'rt> {
    /// A reducer for the gradient buffer `grads` (of `config.dtype`
    /// elements), whose parameters are `params` in layout order (sorted,
    /// non-overlapping element ranges); its collectives and tasks go to
    /// `comm`'s runtime.
    pub fn new(
        comm: BoundComm<'rt>,
        grads: &Buffer,
        params: Vec<ParamSpec>,
        mut config: BucketConfig,
    ) -> Result<Reducer<'rt>> {
        let bad = |m: String| Err(Error::Config(format!("gradient reducer: {m}")));
        if config.cap_bytes == 0 {
            return bad(
                "the bucket cap (`cap_bytes`) is 0 bytes: give at least 1, or `usize::MAX` for no cap"
                    .into(),
            );
        }
        // A cap too large to travel at the rebuild means one bucket, as the
        // largest one that travels does.
        config.cap_bytes = config.cap_bytes.min(MAX_CAP_BYTES);
        let dtype = config.dtype;
        match (dtype, &config.compression) {
            (DType::F32, _) | (DType::Bf16, Compression::None | Compression::Hook(_)) => {}
            (DType::Bf16, Compression::Bf16) => {
                return bad(
                    "bf16 gradients cannot be compressed to bf16: they travel in bf16 as they are"
                        .into(),
                )
            }
            (other, _) => {
                return bad(format!(
                    "{} gradients are not supported (f32 or bf16)",
                    other.name()
                ))
            }
        }
        let size = dtype.size();
        if grads.len() % size != 0 {
            return bad(format!(
                "gradient buffer `{}` is not a whole number of {}s",
                grads.name(),
                dtype.name()
            ));
        }
        let n = grads.len() / size;
        let mut end = 0;
        for p in &params {
            if p.range.start > p.range.end || p.range.end > n {
                return bad(format!(
                    "parameter `{}` at {:?} does not fit the {n} gradients",
                    p.name, p.range
                ));
            }
            if p.range.start < end {
                return bad(format!(
                    "parameter `{}` at {:?} overlaps or precedes the previous one: list parameters in layout order",
                    p.name, p.range
                ));
            }
            end = p.range.end;
        }
        if config.shard && !matches!(config.compression, Compression::None) {
            return bad(
                "sharded buckets (ZeRO-1) travel as they are: turn the compression off".into(),
            );
        }
        if config.auto_cap && !(config.rebuild && matches!(config.compression, Compression::None)) {
            return bad(
                "the bucket cap is chosen (auto) at the rebuild, for plain buckets: turn the rebuild on and the compression off"
                    .into(),
            );
        }
        let order: Vec<usize> = (0..params.len()).rev().collect();
        let buckets = form_buckets(
            &params,
            &order,
            config.first_cap_bytes,
            config.cap_bytes,
            size,
        );
        let mut r = Reducer {
            comm,
            grads: grads.clone(),
            marked: vec![false; params.len()],
            param_bucket: vec![0; params.len()],
            params,
            config,
            buckets: Vec::new(),
            views: Vec::new(),
            side: Vec::new(),
            remaining: Vec::new(),
            next: 0,
            sync: true,
            order: Vec::new(),
            recording: true,
            rebuilt: false,
            steps: 0,
            sparse: Default::default(),
            marks: Vec::new(),
            timed: Vec::new(),
            choice: None,
        };
        r.set_layout(buckets)?;
        Ok(r)
    }

    /// The view of elements `r` (of the reducer's dtype) of `buf`, a buffer
    /// laid out like the gradients.
    fn elems(&self, buf: &Buffer, r: std::ops::Range<usize>) -> Result<View> {
        let size = self.config.dtype.size();
        buf.view(r.start * size..r.end * size)
    }

    fn set_layout(&mut self, buckets: Vec<BucketInfo>) -> Result<()> {
        let rt = self.comm.runtime();
        self.views = buckets
            .iter()
            .map(|b| self.elems(&self.grads, b.elems.clone()))
            .collect::<Result<_>>()?;
        self.side = match self.config.compression {
            Compression::Bf16 => buckets
                .iter()
                .map(|b| {
                    rt.alloc(format!("bf16 bucket {}", b.index), b.elems.len() * 2)
                        .map(Some)
                })
                .collect::<Result<_>>()?,
            _ => vec![None; buckets.len()],
        };
        for b in &buckets {
            for &p in &b.params {
                self.param_bucket[p] = b.index;
            }
        }
        self.buckets = buckets;
        self.reset_step();
        Ok(())
    }

    fn reset_step(&mut self) {
        self.marked.iter_mut().for_each(|m| *m = false);
        self.remaining = self.buckets.iter().map(|b| b.params.len()).collect();
        self.next = 0;
    }

    /// The communicator (bound to the reducer's runtime).
    pub fn comm(&self) -> &BoundComm<'rt> {
        &self.comm
    }

    /// The parameters, in layout order.
    pub fn params(&self) -> &[ParamSpec] {
        &self.params
    }

    /// The current buckets, in the order they are reduced.
    pub fn buckets(&self) -> &[BucketInfo] {
        &self.buckets
    }

    /// Whether the buckets have been rebuilt from the observed order.
    pub fn rebuilt(&self) -> bool {
        self.rebuilt
    }

    /// The `grad_ready` order recorded in the first step.
    pub fn ready_order(&self) -> &[usize] {
        &self.order
    }

    /// Steps finished so far.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// ZeRO-1: how this rank's buckets are split over the ranks, once the
    /// layout is final (sharding on, and the buckets rebuilt or the rebuild
    /// off); `None` before, or without sharding. From then on each synced
    /// bucket is reduce-scattered, and the rank holds the averaged gradients
    /// of its [`owned`](super::BucketShard::owned) slices and of the tails
    /// only. See `shard.rs`.
    pub fn shards(&self) -> Option<Vec<BucketShard>> {
        self.sharding().then(|| {
            let (rank, world) = (self.comm.rank(), self.comm.world_size());
            self.buckets
                .iter()
                .map(|b| BucketShard::new(b, rank, world))
                .collect()
        })
    }

    /// Whether synced buckets are reduce-scattered now (see
    /// [`shards`](Self::shards)).
    pub fn sharding(&self) -> bool {
        self.config.shard && (self.rebuilt || !self.config.rebuild)
    }

    /// ZeRO-1: submits the all-gathers that give every rank every rank's
    /// updated slices of `params` (the parameter buffer the gradients belong
    /// to, of the reducer's dtype): one in place per bucket head, in layout
    /// order, so the next forward pass's first layers arrive first. Returns
    /// at once; tasks reading the parameters wait for the all-gather of
    /// their range by dependency inference. Fails unless
    /// [`sharding`](Self::sharding).
    pub fn all_gather_params(&self, params: &Buffer) -> Result<()> {
        let Some(mut shards) = self.shards() else {
            return Err(self.error(
                "parameters are gathered only once the buckets are sharded (ZeRO-1 on, layout final)"
                    .into(),
            ));
        };
        if params.len() != self.grads.len() {
            return Err(self.error(format!(
                "parameter buffer `{}` has {} bytes, the gradients {}",
                params.name(),
                params.len(),
                self.grads.len()
            )));
        }
        shards.sort_by_key(|s| s.head.start);
        for s in shards.iter().filter(|s| s.chunk > 0) {
            self.comm.submit_named(
                format!("all_gather params {}", s.bucket),
                CollectiveKind::AllGather,
                self.config.dtype,
                Buffers::InPlace(self.elems(params, s.head.clone())?),
            )?;
        }
        Ok(())
    }

    /// Whether gradients are all-reduced this step.
    pub fn is_sync(&self) -> bool {
        self.sync
    }

    /// Turns all-reduces on or off (between steps).
    pub fn set_sync(&mut self, on: bool) {
        self.sync = on;
    }

    /// Turns all-reduces off until the guard drops (gradient accumulation).
    pub fn no_sync(&mut self) -> NoSync<'_, 'rt> {
        let prev = self.sync;
        self.sync = false;
        NoSync { r: self, prev }
    }

    /// Marks parameter `param` (its index in layout order) as having all its
    /// gradient contributions submitted. Submits every bucket that is now
    /// complete and next in order. Returns at once.
    pub fn grad_ready(&mut self, param: usize) -> Result<()> {
        let Some(p) = self.params.get(param) else {
            return Err(self.error(format!(
                "no parameter #{param} (there are {})",
                self.params.len()
            )));
        };
        if self.marked[param] {
            return Err(self.error(format!(
                "parameter `{}` was marked ready twice in one step",
                p.name
            )));
        }
        self.marked[param] = true;
        if self.recording {
            self.order.push(param);
            if self.calibrating() {
                if self.marks.is_empty() {
                    self.marks = vec![u64::MAX; self.params.len()];
                }
                self.marks[param] = self.comm.runtime().stats().tasks;
            }
        }
        let b = self.param_bucket[param];
        self.remaining[b] -= 1;
        if self.sync {
            while self.next < self.buckets.len() && self.remaining[self.next] == 0 {
                self.reduce_bucket(self.next)?;
                self.next += 1;
            }
        }
        Ok(())
    }

    /// Hands over a contribution to some rows of parameter `param`'s gradient
    /// that the program wrote *beside* the gradient (not into it): a gradient
    /// with several writers, each complete at its own point (the tied
    /// embedding: the classifier writes it all first, marked with
    /// [`grad_ready`](Self::grad_ready) and reduced at once; the encoder's rows
    /// come last). Exchanged now with two all-gathers; added, averaged, into
    /// the reduced gradient at [`finish`](Self::finish) (see `sparse.rs`).
    /// With sync off, added locally at once. The rows are of the gradients'
    /// storage type (`f32` or bf16).
    ///
    /// The all-gathers are submitted by this call, after the buckets
    /// submitted so far, so every rank must call it at the same point of
    /// its marking: once the same set of parameters has been marked with
    /// `grad_ready` (their order may differ), e.g. after every `grad_ready`
    /// of the step, and with the same contributions in the same order. A
    /// rank that calls it a bucket earlier or later issues its collectives
    /// in another order than the others (module docs, "Bucket order").
    pub fn sparse_ready(&mut self, param: usize, rows: super::SparseRows) -> Result<()> {
        self.sparse_ready_range(param..param + 1, rows)
    }

    /// [`sparse_ready`](Self::sparse_ready) for a gradient handed to the
    /// reducer as consecutive parameters `params` (pieces whose element
    /// ranges follow each other, each marked ready on its own: the tied
    /// embedding's classifier part in row blocks): the rows index the
    /// pieces together, as one matrix. Called at the same point of the
    /// marking on every rank, as `sparse_ready` is.
    pub fn sparse_ready_range(
        &mut self,
        params: std::ops::Range<usize>,
        rows: super::SparseRows,
    ) -> Result<()> {
        if params.is_empty() || params.end > self.params.len() {
            return Err(self.error(format!(
                "no parameters #{}..#{} (there are {})",
                params.start,
                params.end,
                self.params.len()
            )));
        }
        let pieces = &self.params[params];
        if let Some(w) = pieces
            .windows(2)
            .find(|w| w[0].range.end != w[1].range.start)
        {
            return Err(self.error(format!(
                "sparse rows: `{}` and `{}` do not follow each other",
                w[0].name, w[1].name
            )));
        }
        let name = match pieces {
            [one] => one.name.clone(),
            _ => format!("{} .. {}", pieces[0].name, pieces[pieces.len() - 1].name),
        };
        let range = pieces[0].range.start..pieces[pieces.len() - 1].range.end;
        let dtype = self.config.dtype;
        let size = dtype.size();
        let grad = self.grads.view(range.start * size..range.end * size)?;
        let comm = &self.comm;
        let refuse = |m| reducer_error(comm, format!("sparse rows of `{name}`: {m}"));
        self.sparse
            .take(comm, &name, grad, dtype, rows, self.sync, refuse)
    }

    /// Ends the backward pass of a step: submits every bucket not yet
    /// submitted (when syncing), rebuilds the buckets after the first synced
    /// step, and resets for the next step. Fails — after submitting, so every
    /// rank still issues the same collectives — if a parameter was never
    /// marked (its gradients are reduced as they are).
    pub fn finish(&mut self) -> Result<()> {
        let missing: Vec<&str> = self
            .params
            .iter()
            .zip(&self.marked)
            .filter(|(_, &m)| !m)
            .map(|(p, _)| p.name.as_str())
            .collect();
        let missing = if missing.is_empty() {
            None
        } else {
            Some(self.error(format!(
                "parameter(s) never marked ready in step {}: {}",
                self.steps,
                missing.join(", ")
            )))
        };
        let finish_mark = match self.calibrating() {
            true => self.comm.runtime().stats().tasks,
            false => 0,
        };
        self.recording = false;
        if self.sync {
            while self.next < self.buckets.len() {
                self.reduce_bucket(self.next)?;
                self.next += 1;
            }
            self.sparse.finish(&self.comm)?;
            if self.config.rebuild && !self.rebuilt {
                self.rebuild(finish_mark)?;
            }
        }
        self.steps += 1;
        self.reset_step();
        match missing {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    fn error(&self, message: String) -> Error {
        reducer_error(&self.comm, message)
    }

    fn reduce_bucket(&mut self, i: usize) -> Result<()> {
        let view = &self.views[i].clone();
        let avg = CollectiveKind::AllReduce(ReduceOp::Avg);
        if self.sharding() {
            let s = BucketShard::new(&self.buckets[i], self.comm.rank(), self.comm.world_size());
            let dtype = self.config.dtype;
            if s.chunk > 0 {
                self.comm.submit_named(
                    format!("reduce_scatter bucket {i}"),
                    CollectiveKind::ReduceScatter(ReduceOp::Avg),
                    dtype,
                    Buffers::InPlace(self.elems(&self.grads, s.head)?),
                )?;
            }
            if !s.tail.is_empty() {
                self.comm.submit_named(
                    format!("all_reduce bucket {i} tail"),
                    avg,
                    dtype,
                    Buffers::InPlace(self.elems(&self.grads, s.tail)?),
                )?;
            }
            return Ok(());
        }
        match &self.config.compression {
            Compression::None => {
                let h = self.comm.submit_named(
                    format!("all_reduce bucket {i}"),
                    avg,
                    self.config.dtype,
                    Buffers::InPlace(view.clone()),
                )?;
                if self.calibrating() {
                    self.timed.push((view.len(), h));
                }
            }
            Compression::Bf16 => {
                let side = self.side[i]
                    .clone()
                    .ok_or_else(|| self.error(format!("bucket {i} has no bf16 side buffer")))?;
                let rt = self.comm.runtime();
                let cs = self.comm.comm_stream();
                rt.task(format!("compress bucket {i}"))
                    .kind(TaskKind::Comm)
                    .comm_stream(cs)
                    .run((view.read::<f32>(), side.write::<Bf16>()), |(g, h)| {
                        for (h, g) in h.iter_mut().zip(g) {
                            *h = Bf16::from_f32(*g);
                        }
                    })?;
                self.comm.submit_named(
                    format!("all_reduce bucket {i} (bf16)"),
                    avg,
                    DType::Bf16,
                    Buffers::InPlace(side.whole()),
                )?;
                rt.task(format!("decompress bucket {i}"))
                    .kind(TaskKind::Comm)
                    .comm_stream(cs)
                    .run((side.read::<Bf16>(), view.write::<f32>()), |(h, g)| {
                        for (g, h) in g.iter_mut().zip(h) {
                            *g = h.to_f32();
                        }
                    })?;
            }
            Compression::Hook(h) => h.reduce(&self.comm, &self.buckets[i], view)?,
        }
        Ok(())
    }

    /// Whether this step's readiness and bucket timings are being noted
    /// for the cap choice (the first synced step, auto cap, several ranks).
    fn calibrating(&self) -> bool {
        self.config.auto_cap && self.sync && !self.rebuilt && self.comm.world_size() > 1
    }

    /// Rank 0's first-step order (and cap), broadcast, then the new buckets.
    fn rebuild(&mut self, finish_mark: u64) -> Result<()> {
        let n = self.params.len();
        let mut order = self.order.clone();
        let mut seen = vec![false; n];
        for &p in &order {
            seen[p] = true;
        }
        order.extend((0..n).rev().filter(|&p| !seen[p]));
        let mut cap = self.config.cap_bytes.min(MAX_CAP_BYTES);
        if self.config.auto_cap && self.comm.world_size() > 1 {
            let choice = self.choose(&order, finish_mark)?;
            if let Some(Ok(c)) = &choice {
                cap = c.chosen.cap_bytes.clamp(1, MAX_CAP_BYTES);
            }
            self.choice = choice;
        }
        self.timed.clear();
        self.marks.clear();
        let rt = self.comm.runtime();
        let buf = rt.alloc("bucket order", (n + 2) * 4)?;
        if self.comm.rank() == 0 {
            let mut ids: Vec<i32> = order.iter().map(|&p| p as i32).collect();
            ids.push((cap & 0x7fff_ffff) as i32);
            ids.push((cap >> 31) as i32);
            rt.upload(&buf, &ids)?;
        }
        self.comm.submit_named(
            "broadcast bucket order",
            CollectiveKind::Broadcast { root: 0 },
            DType::I32,
            Buffers::InPlace(buf.whole()),
        )?;
        let mut got: Vec<i32> = rt.read_vec(&buf)?;
        let (lo, hi) = (got[n] as usize, got[n + 1] as usize);
        let cap = lo | (hi << 31);
        if got[n] < 0 || got[n + 1] < 0 || cap == 0 {
            return Err(self.error(format!(
                "the bucket cap broadcast by rank 0 ({lo} + {hi}·2^31 bytes) is not a positive size"
            )));
        }
        got.truncate(n);
        let mut seen = vec![false; n];
        let mut order = Vec::with_capacity(n);
        for &g in &got {
            match usize::try_from(g) {
                Ok(p) if p < n && !seen[p] => {
                    seen[p] = true;
                    order.push(p);
                }
                _ => {
                    return Err(self.error(format!(
                        "the bucket order broadcast by rank 0 is not a permutation of the {n} parameters"
                    )))
                }
            }
        }
        self.config.cap_bytes = cap;
        let buckets = form_buckets(
            &self.params,
            &order,
            self.config.first_cap_bytes,
            self.config.cap_bytes,
            self.config.dtype.size(),
        );
        self.set_layout(buckets)?;
        self.rebuilt = true;
        Ok(())
    }

    /// The cap choice at the first rebuild (see the module docs): every
    /// rank waits for its buckets and takes part in the all-reduce of the
    /// durations; rank 0 returns its choice, or why it kept the configured
    /// cap; the other ranks `None`. Fails only if that all-reduce does.
    fn choose(
        &self,
        order: &[usize],
        finish_mark: u64,
    ) -> Result<Option<std::result::Result<CapChoice, String>>> {
        let rt = self.comm.runtime();
        // Not `TaskHandle::wait`: a failure stays for the program's next
        // synchronisation to report.
        for (_, h) in &self.timed {
            while !h.is_done() {
                std::thread::sleep(std::time::Duration::from_micros(50));
            }
        }
        let profile = rt.profile();
        let by_id: std::collections::HashMap<u64, &crate::trace::Span> =
            profile.spans.iter().map(|s| (s.id, s)).collect();
        let spans: Vec<Option<&&crate::trace::Span>> = self
            .timed
            .iter()
            .map(|(_, h)| by_id.get(&h.task.id))
            .collect();
        let mut durations: Vec<f64> = spans
            .iter()
            .map(|s| match s {
                Some(s) if s.ok => s.end_ns.saturating_sub(s.start_ns) as f64,
                _ => f64::INFINITY,
            })
            .collect();
        // When this rank's last bucket all-reduce of the step ended.
        let measured_end = spans.iter().flatten().map(|s| s.end_ns).max().unwrap_or(0);
        if !durations.is_empty() {
            let buf = rt.alloc_from("bucket timings", &durations)?;
            self.comm.submit_named(
                "all_reduce bucket timings",
                CollectiveKind::AllReduce(ReduceOp::Min),
                DType::F64,
                Buffers::InPlace(buf.whole()),
            )?;
            durations = rt.read_vec(&buf)?;
        }
        if self.comm.rank() != 0 {
            return Ok(None);
        }
        Ok(Some(self.predict_caps(
            &profile,
            order,
            finish_mark,
            &durations,
            measured_end,
        )))
    }

    /// Rank 0's half of [`choose`](Self::choose): the model's input from the
    /// profile, the link from the durations, the prediction.
    fn predict_caps(
        &self,
        profile: &crate::trace::Profile,
        order: &[usize],
        finish_mark: u64,
        durations: &[f64],
        measured_end: u64,
    ) -> std::result::Result<CapChoice, String> {
        if profile.spans.is_empty() {
            return Err("no profile (the runtime's profiling is off)".into());
        }
        if self.marks.is_empty() {
            return Err(
                "no ready times: the first synced step was not the first step (no_sync before it)"
                    .into(),
            );
        }
        // Compute tasks by submission index, with the latest end so far.
        let mut compute: Vec<(u64, u64)> = profile
            .spans
            .iter()
            .filter(|s| !profile.streams.get(s.stream).is_some_and(|i| i.is_comm))
            .filter(|s| s.kind != TaskKind::Comm)
            .map(|s| (s.id, s.end_ns))
            .collect();
        compute.sort_unstable();
        let mut latest = 0;
        for c in &mut compute {
            latest = latest.max(c.1);
            c.1 = latest;
        }
        let ended_before = |mark: u64| {
            let k = compute.partition_point(|c| c.0 < mark);
            (k > 0).then(|| compute[k - 1].1)
        };
        let backward_end = ended_before(finish_mark)
            .ok_or("the profile holds no compute task of the first step")?;
        let ready: Vec<u64> = (0..self.params.len())
            .map(|p| match self.marks.get(p) {
                Some(&m) if m != u64::MAX => ended_before(m).unwrap_or(0),
                _ => backward_end,
            })
            .collect();
        let samples: Vec<(usize, f64)> = self
            .timed
            .iter()
            .zip(durations)
            .filter(|(_, d)| d.is_finite())
            .map(|((b, _), &d)| (*b, d))
            .collect();
        let link = Link::fit(&samples).map_err(|e| e.to_string())?;
        let input = CapInput {
            params: &self.params,
            order,
            ready_ns: &ready,
            backward_end_ns: backward_end,
            elem_bytes: self.config.dtype.size(),
            first_cap_bytes: self.config.first_cap_bytes,
            shard_world: self.config.shard.then(|| self.comm.world_size()),
        };
        let (chosen, all) = choose_cap(&input, link, &CAP_CANDIDATES).map_err(|e| e.to_string())?;
        let configured = match all.iter().find(|p| p.cap_bytes == self.config.cap_bytes) {
            Some(p) => *p,
            None => super::cap::predict(&input, link, self.config.cap_bytes)
                .map_err(|e| e.to_string())?,
        };
        Ok(CapChoice {
            chosen,
            configured,
            all,
            link,
            samples: samples.len(),
            measured_exposed_ns: measured_end.saturating_sub(backward_end) as f64,
        })
    }

    /// With [`BucketConfig::auto_cap`], after the rebuild: on rank 0, the
    /// cap chosen and its predictions, or why the configured cap was kept;
    /// `None` on the other ranks, with one rank, or before the rebuild.
    pub fn cap_choice(&self) -> Option<std::result::Result<&CapChoice, &str>> {
        self.choice
            .as_ref()
            .map(|c| c.as_ref().map_err(String::as_str))
    }

    /// The cap of the buckets after the first one, bytes (after an auto
    /// rebuild, the chosen one).
    pub fn cap_bytes(&self) -> usize {
        self.config.cap_bytes
    }
}

/// The reducer's errors: a collective error of the reducer's rank, at the
/// communicator's current index.
fn reducer_error(comm: &BoundComm<'_>, message: String) -> Error {
    Error::Collective {
        rank: comm.rank(),
        index: comm.issued(),
        op: "gradient reducer".into(),
        message,
    }
}

/// Keeps all-reduces off while alive (see [`Reducer::no_sync`]); derefs to the
/// reducer.
#[derive(Debug)]
pub struct NoSync<'a, 'rt> {
    r: &'a mut Reducer<'rt>,
    prev: bool,
}

impl<'rt> Deref for NoSync<'_, 'rt> {
    type Target = Reducer<'rt>;
    fn deref(&self) -> &Reducer<'rt> {
        self.r
    }
}

impl<'rt> DerefMut for NoSync<'_, 'rt> {
    fn deref_mut(&mut self) -> &mut Reducer<'rt> {
        self.r
    }
}

impl Drop for NoSync<'_, '_> {
    fn drop(&mut self) {
        self.r.sync = self.prev;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ops::Range;

    fn specs(sizes: &[usize]) -> Vec<ParamSpec> {
        let mut at = 0;
        sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| {
                let p = ParamSpec::new(format!("p{i}"), at..at + n);
                at += n;
                p
            })
            .collect()
    }

    fn ranges(b: &[BucketInfo]) -> Vec<Range<usize>> {
        b.iter().map(|b| b.elems.clone()).collect()
    }

    #[test]
    fn reverse_layout_with_first_and_later_caps() {
        // 1 MiB = 262144 f32s; caps: first 1 MiB, then 25 MiB.
        let mib = 1 << 18;
        let p = specs(&[4 * mib, mib / 2, mib / 2, mib / 4, 30 * mib, mib]);
        let order: Vec<usize> = (0..p.len()).rev().collect();
        let b = form_buckets(&p, &order, 1 << 20, 25 << 20, 4);
        // p5 (1 MiB) fills the first bucket; p4 (30 MiB) is over the cap,
        // alone; then p3..p0 fit one 25 MiB bucket (5.25 MiB).
        assert_eq!(b.len(), 3);
        assert_eq!(b[0].params, vec![5]);
        assert_eq!(b[1].params, vec![4]);
        assert_eq!(b[2].params, vec![3, 2, 1, 0]);
        assert_eq!(b[2].elems, 0..p[3].range.end);
        for (i, x) in b.iter().enumerate() {
            assert_eq!(x.index, i);
        }
    }

    #[test]
    fn buckets_from_ready_order_are_runs_of_adjacent_params() {
        // Layout: w0 w1 w2 b0 b1 b2 (weights, then biases); backward order
        // w2 b2 w1 b1 w0 b0: no two consecutive ones are memory neighbours,
        // so each parameter gets a bucket of its own.
        let p = specs(&[100, 100, 100, 10, 10, 10]);
        let order = [2, 5, 1, 4, 0, 3];
        let b = form_buckets(&p, &order, 1 << 20, 1 << 20, 4);
        assert_eq!(b.len(), 6);
        // An order that visits memory neighbours in sequence merges them,
        // growing at either end.
        let order = [4, 3, 5, 1, 0, 2];
        let b = form_buckets(&p, &order, 1 << 20, 1 << 20, 4);
        assert_eq!(ranges(&b), vec![300..330, 0..300]);
        assert_eq!(b[0].params, vec![4, 3, 5]);
        // Caps split runs: the first cap 40 bytes = 10 f32s.
        let b = form_buckets(&p, &order, 40, 80, 4);
        assert_eq!(
            ranges(&b),
            vec![310..320, 300..310, 320..330, 100..200, 0..100, 200..300]
        );
        // In bf16 the same caps hold twice the elements: 20, then 40.
        let b = form_buckets(&p, &order, 40, 80, 2);
        assert_eq!(
            ranges(&b),
            vec![300..320, 320..330, 100..200, 0..100, 200..300]
        );
    }

    /// bf16 gradients: the buckets are views of bf16 elements, all-reduced
    /// in bf16 (averaged in f32, rounded once); the values are the f32
    /// average rounded.
    #[test]
    fn bf16_gradients_are_averaged_in_bf16() {
        use crate::{BackendKind, Runtime};
        let out = crate::launch(2, |rank, comm| {
            let rt = Runtime::builder()
                .backend(BackendKind::Cpu)
                .rank(rank)
                .build()?;
            // Ranks hold 1 + k/128 and 1 + 3k/128 (k < 4): bf16 values, whose
            // averages 1 + 2k/128 are bf16 values too.
            let mine: Vec<Bf16> = (0..12)
                .map(|k| Bf16::from_f32(1.0 + (2 * rank + 1) as f32 / 128.0 * (k % 4) as f32))
                .collect();
            let grads = rt.alloc_from("grads", &mine)?;
            let specs = specs(&[5, 4, 3]);
            let config = BucketConfig::default()
                .dtype(DType::Bf16)
                .first_cap_bytes(6)
                .cap_bytes(10);
            let mut red = Reducer::new(comm.bind(&rt)?, &grads, specs, config)?;
            assert_eq!(ranges(red.buckets()), vec![9..12, 5..9, 0..5]);
            for p in (0..3).rev() {
                red.grad_ready(p)?;
            }
            red.finish()?;
            rt.read_vec::<Bf16>(&grads)
        });
        for r in out {
            let got: Vec<f32> = r.unwrap().iter().map(|x| x.to_f32()).collect();
            let want: Vec<f32> = (0..12)
                .map(|k| 1.0 + 2.0 / 128.0 * (k % 4) as f32)
                .collect();
            assert_eq!(got, want);
        }
    }

    /// Auto cap on 2 ranks: rank 0 chooses from the first step's own
    /// timings, every rank rebuilds with that cap, and the averages stay
    /// right; without a profile the configured cap stays, and says why.
    #[test]
    fn auto_cap_is_chosen_on_rank_0_and_used_by_every_rank() {
        use crate::{BackendKind, Runtime};
        for profile in [true, false] {
            let out = crate::launch(2, |rank, comm| {
                let rt = Runtime::builder()
                    .backend(BackendKind::Cpu)
                    .rank(rank)
                    .profile(profile)
                    .build()?;
                // 4 parameters of 64K f32s (256 KiB each).
                let n = 1 << 16;
                let grads = rt.alloc("grads", 4 * n * 4)?;
                let config = BucketConfig::default().auto_cap(true);
                let mut red = Reducer::new(comm.bind(&rt)?, &grads, specs(&[n; 4]), config)?;
                for step in 0..2 {
                    for p in (0..4).rev() {
                        let v = grads.view_of::<f32>(p * n..(p + 1) * n)?;
                        let x = (rank + 1 + step) as f32;
                        rt.task(format!("grad {p}"))
                            .run(v.write::<f32>(), move |g| g.fill(x))?;
                        red.grad_ready(p)?;
                    }
                    red.finish()?;
                    let got = rt.read_vec::<f32>(&grads)?;
                    assert!(got.iter().all(|&g| g == 1.5 + step as f32), "step {step}");
                }
                let choice = red.cap_choice().map(|c| c.cloned().map_err(str::to_owned));
                Ok((red.cap_bytes(), choice))
            });
            let mut out = out.into_iter().map(|r| r.unwrap());
            let (cap0, choice0) = out.next().unwrap();
            let (cap1, choice1) = out.next().unwrap();
            assert_eq!(cap0, cap1, "the ranks' caps differ");
            assert_eq!(choice1, None, "only rank 0 reports");
            match (profile, choice0) {
                (true, Some(Ok(c))) => {
                    assert_eq!(c.chosen.cap_bytes, cap0);
                    assert!(CAP_CANDIDATES.contains(&cap0));
                    assert_eq!(c.configured.cap_bytes, 25 << 20);
                    assert_eq!(c.all.len(), CAP_CANDIDATES.len());
                    assert!(c.all.iter().all(|p| p.exposed_ns >= c.chosen.exposed_ns));
                    // Step 1: buckets 1 MiB (the first cap holds all four
                    // 256 KiB parameters): one all-reduce measured.
                    assert_eq!(c.samples, 1);
                }
                (false, Some(Err(why))) => {
                    assert!(why.contains("profiling is off"), "{why}");
                    assert_eq!(cap0, 25 << 20);
                }
                (p, c) => panic!("profile {p}: {c:?}"),
            }
        }
    }

    /// A cap of `usize::MAX` (no cap), or any above what the rebuild's
    /// broadcast carries, is kept as [`MAX_CAP_BYTES`]: the rebuild agrees
    /// on it on every rank and puts everything after the first bucket into
    /// one. It failed on every rank at
    /// the end of the first step. A cap of 0 is refused at once.
    #[test]
    fn a_cap_too_large_to_travel_means_one_bucket_and_0_is_refused() {
        use crate::{BackendKind, Runtime};
        for cap in [usize::MAX, 1 << 62, MAX_CAP_BYTES] {
            let out = crate::launch(2, |rank, comm| {
                let rt = Runtime::builder()
                    .backend(BackendKind::Cpu)
                    .rank(rank)
                    .build()?;
                let grads = rt.alloc_from("grads", &[rank as f32 + 1.0; 12])?;
                let config = BucketConfig::default().first_cap_bytes(4).cap_bytes(cap);
                let mut red = Reducer::new(comm.bind(&rt)?, &grads, specs(&[5, 4, 3]), config)?;
                assert_eq!(red.cap_bytes(), MAX_CAP_BYTES);
                for _ in 0..2 {
                    for p in (0..3).rev() {
                        red.grad_ready(p)?;
                    }
                    red.finish()?;
                }
                let buckets = ranges(red.buckets());
                Ok((buckets, red.cap_bytes(), rt.read_vec::<f32>(&grads)?))
            });
            for r in out {
                let (buckets, kept, grads) = r.unwrap();
                // The first bucket within its 4 bytes, the rest in one.
                assert_eq!(buckets, vec![9..12, 0..9], "cap {cap}");
                assert_eq!(kept, MAX_CAP_BYTES);
                assert_eq!(grads, vec![1.5; 12]);
            }
        }
        let err = refused(BucketConfig::default().cap_bytes(0));
        assert!(err.to_string().contains("`cap_bytes`) is 0 bytes"), "{err}");
    }

    /// The error `Reducer::new` gives one CPU rank with `config` over one
    /// parameter of 8 `f32` gradients.
    fn refused(config: BucketConfig) -> crate::Error {
        use crate::{BackendKind, Runtime};
        let out = crate::launch(1, |rank, comm| {
            let rt = Runtime::builder()
                .backend(BackendKind::Cpu)
                .rank(rank)
                .build()?;
            let grads = rt.alloc("grads", 8 * 4)?;
            let config = config.clone();
            Ok(Reducer::new(comm.bind(&rt)?, &grads, specs(&[8]), config).map(|_| ()))
        });
        out.into_iter().next().unwrap().unwrap().unwrap_err()
    }

    #[test]
    fn auto_cap_refuses_compression() {
        let config = BucketConfig::default()
            .auto_cap(true)
            .compression(Compression::Bf16);
        let err = refused(config);
        assert!(err.to_string().contains("compression off"), "{err}");
    }

    #[test]
    fn bf16_gradients_refuse_bf16_compression_and_f32_rows() {
        use crate::{BackendKind, Runtime};
        let out = crate::launch(1, |rank, comm| {
            let rt = Runtime::builder()
                .backend(BackendKind::Cpu)
                .rank(rank)
                .build()?;
            let grads = rt.alloc("grads", 8 * 2)?;
            let config = BucketConfig::default().dtype(DType::Bf16);
            let err = Reducer::new(
                comm.bind(&rt)?,
                &grads,
                specs(&[8]),
                config.clone().compression(Compression::Bf16),
            )
            .unwrap_err();
            assert!(err.to_string().contains("travel in bf16"), "{err}");
            // 8 bf16 elements: a spec of 9 does not fit.
            let err =
                Reducer::new(comm.bind(&rt)?, &grads, specs(&[9]), config.clone()).unwrap_err();
            assert!(err.to_string().contains("does not fit"), "{err}");
            let mut red = Reducer::new(comm.bind(&rt)?, &grads, specs(&[8]), config)?;
            let ids = rt.alloc("ids", 4)?.whole();
            let rows = crate::comm::SparseRows::new(ids, rt.alloc("rows", 8 * 4)?.whole(), 8);
            Ok(red.sparse_ready(0, rows).map(|_| ()))
        });
        let res = out.into_iter().next().unwrap().unwrap();
        let err = res.unwrap_err();
        // Row contributions of bf16 gradients are bf16: 8 f32s are refused.
        assert!(
            err.to_string().contains("need 16 bytes of bf16 rows"),
            "{err}"
        );
    }
}

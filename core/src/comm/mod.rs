//! Collectives as tasks.
//!
//! A collective (all-reduce, reduce-scatter, all-gather, broadcast, barrier) is
//! a task like any other: it declares its accesses on views, so the engine
//! orders it after the tasks that write its input and before the tasks that
//! read its output, and it runs on its communicator's comm stream. Because a
//! stream is a FIFO and every collective of one communicator goes to the same
//! comm stream, collectives start in submission order; a program that submits
//! the same collectives in the same order on every rank therefore issues them
//! identically everywhere (Semantics 5).
//!
//! ```
//! use braid::comm::ReduceOp;
//! use braid::{BackendKind, Runtime};
//!
//! let results = braid::launch(2, |rank, comm| {
//!     let rt = Runtime::builder().backend(BackendKind::Cpu).rank(rank).build()?;
//!     let comm = comm.bind(&rt)?; // this rank's collectives go to `rt`
//!     let x = rt.alloc_from("x", &[rank as f32 + 1.0; 4])?;
//!     comm.all_reduce::<f32>(&x.whole(), ReduceOp::Sum)?; // returns at once
//!     rt.read_vec::<f32>(&x) // waits for it
//! });
//! for r in results {
//!     assert_eq!(r?, vec![3.0; 4]);
//! }
//! # Ok::<(), braid::Error>(())
//! ```
//!
//! Three pieces:
//!
//! * [`Communicator`] — what a backend implements: *perform this collective
//!   with this data*. The data arrives resolved from the task's declared
//!   accesses: host bytes ([`HostData`]) in [`Communicator::run_host`] — the
//!   CPU implementation [`LocalComm`] reduces the host memory of ranks that are
//!   threads of one process — or device addresses ([`DeviceData`]) and the CUDA
//!   task context in [`Communicator::run_cuda`], where [`NcclCommunicator`]
//!   calls `ncclAllReduce` and friends on the task's stream.
//! * [`Comm`] — a rank's handle on a communicator (what [`launch()`] and
//!   [`NcclCommunicator::join`] give): cheap to clone, `'static`, shares the
//!   collective numbering and the poison (a failure fails later collectives
//!   fast, like `ncclCommAbort`) between its clones.
//! * [`BoundComm`] — a `Comm` bound to the [`Runtime`] its collectives run on
//!   ([`Comm::bind`]): the submission layer every backend shares. It checks
//!   view sizes, numbers collectives, submits each as a task of kind
//!   [`TaskKind::Comm`] on the communicator's comm stream with one access token
//!   per view (a `Vec` of [`DynAccess`]) and a CPU and a CUDA body
//!   ([`TaskBuilder::run_any`](crate::TaskBuilder::run_any)), and turns every
//!   failure into [`Error::Collective`].
//!
//! Around them: [`launch()`] (N CPU ranks as threads), and the DDP gradient
//! bucket [`Reducer`]. `docs/collectives.md` describes the protocols.
//!
//! # API change: typed tokens (the port off `TaskCtx`)
//!
//! | before | now |
//! |---|---|
//! | `comm.all_reduce::<f32>(&rt, &v, op)` (every call took the runtime) | `let comm = comm.bind(&rt)?;` once, then `comm.all_reduce::<f32>(&v, op)` |
//! | `comm.submit_named(&rt, name, kind, dtype, buffers)`, `barrier(&rt)`, … | the same on [`BoundComm`], without `&rt` |
//! | `Communicator::run(&self, ctx: &TaskCtx, op)`, reading views with `ctx.read/write/device_ptr` | [`Communicator::run_host`]`(op, HostData)` and [`Communicator::run_cuda`]`(op, DeviceData, &CudaTaskCtx)`, data already resolved |
//! | `ctx.on_complete(check)` | [`CudaTaskCtx::on_complete`] |
//! | `Reducer::new(&rt, comm, …)`, `grad_ready(&rt, p)`, `finish(&rt)` | `Reducer::new(comm.bind(&rt)?, …)`, `grad_ready(p)`, `finish()` |
//! | `BucketHook::reduce(&self, rt, comm, bucket, view)` | `reduce(&self, comm: &BoundComm, bucket, view)` (`comm.runtime()` for other tasks) |
//!
//! A `Comm` binds to one runtime for good: binding it to a second one is an
//! error (its collectives would no longer share one comm stream, and so one
//! order). `BoundComm<'rt>` borrows the runtime; the [`Reducer`] holds one and
//! so borrows it too.

mod agree;
mod bucket;
pub mod cap;
mod env;
mod in_graph;
mod launch;
mod layout;
mod local;
mod nccl_comm;
pub mod rendezvous;
mod shard;
mod sparse;

pub use agree::AGREEMENT_TASK;
/// The safe NCCL wrapper (`braid_cuda::nccl`), re-exported.
pub use braid_cuda::nccl;
pub use bucket::{
    BucketConfig, BucketHook, BucketInfo, Compression, NoSync, ParamSpec, Reducer, MAX_CAP_BYTES,
};
pub use env::{DistEnv, EnvError, DEFAULT_MASTER_ADDR, DEFAULT_MASTER_PORT};
pub use in_graph::CapturedCollective;
pub use launch::{launch, launch_with, spawn_ranks, Ranks};
pub use local::{LocalComm, LocalCommConfig, DEFAULT_TIMEOUT};
pub use nccl_comm::{NcclCommunicator, NCCL_TIMEOUT};
pub use shard::{owned_ranges, BucketShard};
pub use sparse::{sparse_add_chunk, sparse_links, RowElement, SparseRows};

use crate::access::{DevBytes, DynAccess, HostBytes};
use crate::backend::gpu::CudaTaskCtx;
use crate::buffer::View;
use crate::error::{Error, Result, TaskError};
use crate::graph::Mode;
use crate::kind::TaskKind;
use crate::sched::TaskHandle;
use crate::sync::{lock, Arc, AtomicBool, AtomicU64, Mutex, OnceLock, Ordering};
use crate::Runtime;
use std::borrow::Cow;
use std::fmt;
use std::ops::Deref;

/// Element type of a collective's data. It travels with the operation, so
/// ranks that disagree on it are detected rather than mis-summed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DType {
    /// 32-bit float.
    F32,
    /// 64-bit float.
    F64,
    /// 32-bit signed integer (sums wrap; averages truncate toward zero).
    I32,
    /// bfloat16, stored as its `u16` bit pattern ([`Bf16`]). Reduced in `f32`
    /// and rounded once (to nearest, ties to even) per element.
    Bf16,
}

impl DType {
    /// Size of one element in bytes.
    pub fn size(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F64 => 8,
            DType::Bf16 => 2,
        }
    }

    /// The type's name (`f32`, `bf16`, …).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::I32 => "i32",
            DType::Bf16 => "bf16",
        }
    }
}

/// A bfloat16 value as its bit pattern (the upper half of an `f32`).
#[repr(transparent)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, bytemuck::Pod, bytemuck::Zeroable)]
pub struct Bf16(pub u16);

impl Bf16 {
    /// Rounds `x` to the nearest bfloat16 (ties to even); NaN stays NaN.
    pub fn from_f32(x: f32) -> Bf16 {
        let bits = x.to_bits();
        if x.is_nan() {
            // Keep it a (quiet) NaN whatever its payload.
            return Bf16(((bits >> 16) as u16) | 0x0040);
        }
        let round = 0x7fff + ((bits >> 16) & 1);
        Bf16((bits.wrapping_add(round) >> 16) as u16)
    }

    /// The exact `f32` value.
    pub fn to_f32(self) -> f32 {
        f32::from_bits((self.0 as u32) << 16)
    }
}

/// Element types the typed helpers of [`Comm`] accept.
pub trait Element: bytemuck::Pod + Send + Sync + 'static {
    /// The matching [`DType`].
    const DTYPE: DType;
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
}
impl Element for f64 {
    const DTYPE: DType = DType::F64;
}
impl Element for i32 {
    const DTYPE: DType = DType::I32;
}
impl Element for Bf16 {
    const DTYPE: DType = DType::Bf16;
}

/// How an all-reduce or reduce-scatter combines the ranks' elements.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Sum.
    Sum,
    /// Sum divided by the number of ranks.
    Avg,
    /// Maximum.
    Max,
    /// Minimum.
    Min,
}

impl ReduceOp {
    /// The operation's name.
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Avg => "avg",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
        }
    }
}

/// Which collective, with its operation-specific parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CollectiveKind {
    /// Every rank ends with the reduction of every rank's input.
    AllReduce(ReduceOp),
    /// Rank `r` ends with chunk `r` of the reduction (`count` elements each).
    ReduceScatter(ReduceOp),
    /// Every rank ends with every rank's `count` elements, in rank order.
    AllGather,
    /// Every rank ends with `root`'s data.
    Broadcast {
        /// The rank whose data is sent.
        root: usize,
    },
    /// Every rank waits until all have arrived.
    Barrier,
}

impl CollectiveKind {
    /// The collective's name (`all_reduce`, …), used as the default task name.
    pub fn name(self) -> &'static str {
        match self {
            CollectiveKind::AllReduce(_) => "all_reduce",
            CollectiveKind::ReduceScatter(_) => "reduce_scatter",
            CollectiveKind::AllGather => "all_gather",
            CollectiveKind::Broadcast { .. } => "broadcast",
            CollectiveKind::Barrier => "barrier",
        }
    }
}

/// The data of a collective.
#[derive(Debug, Clone)]
pub enum Buffers {
    /// No data (a barrier).
    None,
    /// One view is both input and output. All-reduce and broadcast: the
    /// data itself. Reduce-scatter: `count × world` elements in, rank `r`'s
    /// result lands in chunk `r`. All-gather: `count × world` elements out,
    /// rank `r`'s input is chunk `r`. (NCCL's in-place conventions.)
    InPlace(View),
    /// Separate input and output views (they must not overlap).
    OutOfPlace {
        /// Input.
        send: View,
        /// Output.
        recv: View,
    },
}

/// One collective as a communicator performs it, inside its task body.
#[derive(Debug, Clone)]
pub struct Collective {
    /// Position on its communicator, from 0: the same collective has the same
    /// index on every rank.
    pub index: u64,
    /// What to do.
    pub kind: CollectiveKind,
    /// Element type.
    pub dtype: DType,
    /// Element count with NCCL's convention: all-reduce and broadcast, the
    /// data; reduce-scatter, each rank's output; all-gather, each rank's input.
    pub count: usize,
    /// The data.
    pub buffers: Buffers,
}

impl Collective {
    /// Input view: for in-place reduce-scatter the whole view, for in-place
    /// all-gather this rank's chunk of it. `None` for a barrier.
    pub fn send_view(&self, rank: usize) -> Result<Option<View>> {
        Ok(match &self.buffers {
            Buffers::None => None,
            Buffers::OutOfPlace { send, .. } => Some(send.clone()),
            Buffers::InPlace(v) => Some(match self.kind {
                CollectiveKind::AllGather => self.chunk(v, rank)?,
                _ => v.clone(),
            }),
        })
    }

    /// Output view: for in-place reduce-scatter this rank's chunk, for
    /// in-place all-gather the whole view. `None` for a barrier.
    pub fn recv_view(&self, rank: usize) -> Result<Option<View>> {
        Ok(match &self.buffers {
            Buffers::None => None,
            Buffers::OutOfPlace { recv, .. } => Some(recv.clone()),
            Buffers::InPlace(v) => Some(match self.kind {
                CollectiveKind::ReduceScatter(_) => self.chunk(v, rank)?,
                _ => v.clone(),
            }),
        })
    }

    fn chunk(&self, v: &View, rank: usize) -> Result<View> {
        let n = self.count * self.dtype.size();
        v.view(rank * n..(rank + 1) * n)
    }

    /// Whether the data is in place.
    pub fn in_place(&self) -> bool {
        matches!(self.buffers, Buffers::InPlace(_))
    }

    /// What ranks must agree on: kind (with its operation or root), element
    /// type and count.
    pub fn signature(&self) -> (CollectiveKind, DType, usize) {
        (self.kind, self.dtype, self.count)
    }

    /// A short description: `all_reduce(sum, f32 × 1024)`.
    pub fn describe(&self) -> String {
        describe(self.kind, self.dtype, self.count)
    }
}

pub(crate) fn describe(kind: CollectiveKind, dtype: DType, count: usize) -> String {
    let d = dtype.name();
    match kind {
        CollectiveKind::AllReduce(op) | CollectiveKind::ReduceScatter(op) => {
            format!("{}({}, {d} × {count})", kind.name(), op.name())
        }
        CollectiveKind::Broadcast { root } => format!("broadcast(root {root}, {d} × {count})"),
        CollectiveKind::AllGather => format!("all_gather({d} × {count})"),
        CollectiveKind::Barrier => "barrier".to_string(),
    }
}

/// A collective's data on the host, resolved from the accesses its task
/// declared (what [`Communicator::run_host`] gets). The shape follows
/// [`Collective::buffers`].
#[derive(Debug)]
pub enum HostData<'a> {
    /// No data (a barrier).
    None,
    /// The one view that is both input and output: writable
    /// ([`HostBytes::Write`]) except for the root of an in-place broadcast,
    /// which only reads it ([`HostBytes::Read`]).
    InPlace(HostBytes<'a>),
    /// Separate input and output.
    OutOfPlace {
        /// The input bytes.
        send: &'a [u8],
        /// The output bytes.
        recv: &'a mut [u8],
    },
}

/// A collective's data on a CUDA device, resolved from the accesses its task
/// declared (what [`Communicator::run_cuda`] gets). The shape follows
/// [`Collective::buffers`].
#[derive(Debug, Clone, Copy)]
pub enum DeviceData<'a> {
    /// No data (a barrier).
    None,
    /// The one view that is both input and output (read-only for the root of
    /// an in-place broadcast: `writes` is false there).
    InPlace(DevBytes<'a>),
    /// Separate input and output.
    OutOfPlace {
        /// The input.
        send: DevBytes<'a>,
        /// The output.
        recv: DevBytes<'a>,
    },
}

impl<'a> DeviceData<'a> {
    /// The input and output device addresses of `rank` for `op`, with NCCL's
    /// in-place conventions: in-place reduce-scatter writes chunk `rank` of
    /// the view, in-place all-gather reads chunk `rank` of it (a chunk is
    /// `op.count` elements). `(0, 0)` for a barrier.
    pub fn addresses(&self, op: &Collective, rank: usize) -> (u64, u64) {
        let chunk = (rank * op.count * op.dtype.size()) as u64;
        match self {
            DeviceData::None => (0, 0),
            DeviceData::InPlace(b) => match op.kind {
                CollectiveKind::ReduceScatter(_) => (b.ptr, b.ptr + chunk),
                CollectiveKind::AllGather => (b.ptr + chunk, b.ptr),
                _ => (b.ptr, b.ptr),
            },
            DeviceData::OutOfPlace { send, recv } => (send.ptr, recv.ptr),
        }
    }

    /// The device data of the tokens made by [`tokens`].
    fn from_parts(parts: Vec<DevBytes<'a>>) -> Result<DeviceData<'a>> {
        Ok(match *parts.as_slice() {
            [] => DeviceData::None,
            [b] => DeviceData::InPlace(b),
            [send, recv] if !send.writes && recv.writes => DeviceData::OutOfPlace { send, recv },
            _ => return Err(shape_error("device", parts.len())),
        })
    }
}

/// The access tokens of `op` on `rank`, one per view: in place `read_write`
/// (`read` for the root of a broadcast, which only sends), out of place
/// `read` on the input and `write` on the output.
fn tokens(op: &Collective, rank: usize) -> Vec<DynAccess> {
    match &op.buffers {
        Buffers::None => Vec::new(),
        Buffers::InPlace(v) => {
            let mode = match op.kind {
                CollectiveKind::Broadcast { root } if root == rank => Mode::Read,
                _ => Mode::ReadWrite,
            };
            vec![v.access(mode)]
        }
        Buffers::OutOfPlace { send, recv } => {
            vec![send.access(Mode::Read), recv.access(Mode::Write)]
        }
    }
}

fn shape_error(what: &str, n: usize) -> Error {
    Error::Config(format!(
        "internal error: a collective's task got {n} {what} accesses, not the shape it declared"
    ))
}

impl<'a> HostData<'a> {
    /// The host data of the tokens made by [`tokens`].
    fn from_parts(parts: Vec<HostBytes<'a>>) -> Result<HostData<'a>> {
        let n = parts.len();
        let mut it = parts.into_iter();
        Ok(match (it.next(), it.next(), it.next()) {
            (None, None, None) => HostData::None,
            (Some(b), None, None) => HostData::InPlace(b),
            (Some(HostBytes::Read(send)), Some(HostBytes::Write(recv)), None) => {
                HostData::OutOfPlace { send, recv }
            }
            _ => return Err(shape_error("host", n)),
        })
    }
}

/// What a collective backend implements: perform one collective, inside the
/// body of the task that stands for it, on the data that task declared.
///
/// The submission layer ([`BoundComm`]) has already checked the views against
/// the collective, declared one access per view (see [`HostData`]), placed the
/// task on stream [`comm_stream`] and numbered it. A backend implements the
/// body for the device it drives — [`run_host`] on the CPU backend,
/// [`run_cuda`] on CUDA; the other keeps its default, an error. Bodies run on
/// the stream thread and may block there (a CPU collective waits for its
/// peers; NCCL enqueues on the task's stream and returns). Collectives reach
/// them in their index order, one at a time.
///
/// [`comm_stream`]: Communicator::comm_stream
/// [`run_host`]: Communicator::run_host
/// [`run_cuda`]: Communicator::run_cuda
pub trait Communicator: Send + Sync + fmt::Debug {
    /// This rank, `0..world_size`.
    fn rank(&self) -> usize;

    /// Number of ranks.
    fn world_size(&self) -> usize;

    /// Which comm stream of the runtime its collectives run on (modulo their
    /// number; default 0).
    fn comm_stream(&self) -> usize {
        0
    }

    /// The backend's name (`local`, `nccl`).
    fn backend(&self) -> &'static str;

    /// Performs `op` on host memory (a task on the CPU backend). Default: an
    /// error saying this backend does not run there.
    fn run_host(&self, op: &Collective, data: HostData<'_>) -> Result<()> {
        let _ = data;
        Err(cannot(
            self.rank(),
            self.backend(),
            op,
            "run on the CPU backend",
        ))
    }

    /// Performs `op` on device memory: enqueues it on `cu`'s stream (a task on
    /// the CUDA backend). A failure found only once the work has completed on
    /// the device is reported through [`CudaTaskCtx::on_complete`]. Default:
    /// an error saying this backend does not run there.
    fn run_cuda(&self, op: &Collective, data: DeviceData<'_>, cu: &CudaTaskCtx<'_>) -> Result<()> {
        let _ = (data, cu);
        Err(cannot(
            self.rank(),
            self.backend(),
            op,
            "run on a CUDA stream",
        ))
    }

    /// Captures `op` into the CUDA graph `cu`'s stream is being captured
    /// into ([`crate::RuntimeBuilder::graph_collectives`]): enqueues it as
    /// [`Communicator::run_cuda`] would, registers nothing that runs once
    /// (no completion check: a capture refuses them), and returns what the
    /// communicator does at each launch of the graph. `op.index` is the
    /// index it would take now, for messages; each launch gives it a new
    /// one. Default: an error saying this backend cannot be captured (the
    /// schedule's graphs are then cut around its collectives, which run as
    /// ordinary tasks: `Schedule::graph_collectives_left_out` says why).
    fn capture_cuda(
        &self,
        op: &Collective,
        data: DeviceData<'_>,
        cu: &CudaTaskCtx<'_>,
    ) -> Result<Box<dyn CapturedCollective>> {
        let _ = (data, cu);
        Err(cannot(
            self.rank(),
            self.backend(),
            op,
            "be captured into a CUDA graph",
        ))
    }

    /// This rank will issue nothing more: its last [`Comm`] was dropped,
    /// with no collective queued, after `issued` collectives. A backend
    /// that can tells the other ranks, so that one waiting for a later
    /// collective fails at once instead of at its timeout. Default: nothing.
    fn left(&self, issued: u64) {
        let _ = issued;
    }

    /// Gives up: pending and later collectives of every rank fail instead of
    /// waiting (`ncclCommAbort`). Called by [`Comm`] when a collective of this
    /// rank failed or will never run (its task was skipped). Default: nothing.
    fn abort(&self, reason: &str) {
        let _ = reason;
    }
}

/// What a [`Communicator`]'s default methods return: the `backend`
/// communicator of `rank` cannot do `what` with `op`.
fn cannot(rank: usize, backend: &str, op: &Collective, what: &str) -> Error {
    Error::Collective {
        rank,
        index: op.index,
        op: op.describe(),
        message: format!("the `{backend}` communicator cannot {what}"),
    }
}

struct CommInner {
    imp: Box<dyn Communicator>,
    /// Collectives submitted so far, one by one or by replays (each replay
    /// adds its collectives as it is queued); held while submitting, so
    /// submissions and their tasks' order on the comm stream agree even
    /// when several threads submit.
    issued: Mutex<u64>,
    /// Collectives run (or skipped) so far: a collective's index is taken
    /// when its body runs, on the comm stream, so a replayed collective gets
    /// a new index each time (see `Job::run`).
    ran: AtomicU64,
    /// The first failure; later collectives fail fast with it.
    poisoned: OnceLock<Error>,
    /// The id of the runtime this communicator is bound to.
    runtime: OnceLock<u64>,
}

impl Drop for CommInner {
    /// The last `Comm` and the last queued collective are gone.
    fn drop(&mut self) {
        let issued = (*lock(&self.issued)).max(self.ran.load(Ordering::Acquire));
        self.imp.left(issued);
    }
}

impl CommInner {
    fn poison(&self, e: &Error) {
        if self.poisoned.set(e.clone()).is_ok() {
            self.imp.abort(&e.to_string());
        }
    }
}

/// A rank's handle on a communicator: what [`launch()`] and the NCCL
/// constructors give. Bind it to the runtime its collectives run on with
/// [`Comm::bind`] to submit them.
///
/// Cheap to clone; clones share the collective numbering and the poison, so
/// use one `Comm` (and its clones) per communicator.
#[derive(Clone)]
pub struct Comm {
    inner: Arc<CommInner>,
}

impl fmt::Debug for Comm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Comm")
            .field("backend", &self.inner.imp.backend())
            .field("rank", &self.rank())
            .field("world_size", &self.world_size())
            .field("issued", &self.issued())
            .finish()
    }
}

impl Comm {
    /// Wraps a backend's communicator.
    pub fn new(imp: impl Communicator + 'static) -> Comm {
        Comm {
            inner: Arc::new(CommInner {
                imp: Box::new(imp),
                issued: Mutex::new(0),
                ran: AtomicU64::new(0),
                poisoned: OnceLock::new(),
                runtime: OnceLock::new(),
            }),
        }
    }

    /// Binds the communicator to `rt`, the runtime of this rank its
    /// collectives run on. A communicator binds to one runtime for good
    /// (binding it again to the same one is fine): its collectives must share
    /// one comm stream to keep their order. Fails for another runtime.
    pub fn bind<'rt>(&self, rt: &'rt Runtime) -> Result<BoundComm<'rt>> {
        let id = rt.id();
        let _ = self.inner.runtime.set(id);
        match self.inner.runtime.get() {
            Some(&bound) if bound != id => Err(Error::Usage(format!(
                "the communicator of rank {} is bound to another runtime; one communicator \
                 submits to one runtime, so that its collectives keep one order",
                self.rank()
            ))),
            _ => Ok(BoundComm {
                comm: self.clone(),
                rt,
            }),
        }
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.inner.imp.rank()
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.inner.imp.world_size()
    }

    /// The comm stream index its collectives use.
    pub fn comm_stream(&self) -> usize {
        self.inner.imp.comm_stream()
    }

    /// The backend communicator.
    pub fn communicator(&self) -> &dyn Communicator {
        &*self.inner.imp
    }

    /// Number of collectives issued so far: submitted, one by one or by
    /// the replays of recorded schedules (a replay issues its collectives
    /// as it is queued, before they run).
    pub fn issued(&self) -> u64 {
        (*lock(&self.inner.issued)).max(self.inner.ran.load(Ordering::Acquire))
    }

    /// The failure that poisoned this communicator, if any.
    pub fn poisoned(&self) -> Option<Error> {
        self.inner.poisoned.get().cloned()
    }

    /// Aborts the communicator: this rank's pending and later collectives fail,
    /// and so do the other ranks' (for backends that can tell them).
    pub fn abort(&self, reason: &str) {
        let e = Error::Collective {
            rank: self.rank(),
            index: self.issued(),
            op: "abort".into(),
            message: reason.to_string(),
        };
        self.inner.poison(&e);
    }

    /// Checks the views against the collective; returns the element count.
    fn check(&self, name: &str, kind: CollectiveKind, dtype: DType, b: &Buffers) -> Result<usize> {
        let world = self.world_size();
        let sz = dtype.size();
        let bad = |msg: String| Err(Error::Usage(format!("collective `{name}`: {msg}")));
        let elems = |v: &View, what: &str| -> Result<usize> {
            if v.len() % sz != 0 {
                return Err(Error::Usage(format!(
                    "collective `{name}`: {what} view of `{}` has {} bytes, not a whole number of {}",
                    v.buffer().name(),
                    v.len(),
                    dtype.name()
                )));
            }
            // Buffers are aligned for every element type, so an element
            // boundary offset is an aligned address.
            if v.start % sz != 0 {
                return Err(Error::Misaligned {
                    task: Some(name.to_string()),
                    buffer: v.buffer().name().to_string(),
                    range: v.range(),
                    ty: dtype.name(),
                });
            }
            Ok(v.len() / sz)
        };
        let per_rank = |n: usize| -> Result<usize> {
            if n % world != 0 {
                return Err(Error::Usage(format!(
                    "collective `{name}`: {n} elements do not split evenly over {world} ranks"
                )));
            }
            Ok(n / world)
        };
        if let CollectiveKind::Broadcast { root } = kind {
            if root >= world {
                return bad(format!("broadcast root {root} is not a rank of {world}"));
            }
        }
        match (kind, b) {
            (CollectiveKind::Barrier, Buffers::None) => Ok(0),
            (CollectiveKind::Barrier, _) => bad("a barrier takes no data".into()),
            (_, Buffers::None) => bad(format!("{} needs data", kind.name())),
            (
                CollectiveKind::AllReduce(_) | CollectiveKind::Broadcast { .. },
                Buffers::InPlace(v),
            ) => elems(v, "the"),
            (CollectiveKind::ReduceScatter(_) | CollectiveKind::AllGather, Buffers::InPlace(v)) => {
                per_rank(elems(v, "the")?)
            }
            (_, Buffers::OutOfPlace { send, recv }) => {
                if send.buffer().id() == recv.buffer().id()
                    && send.start < recv.end
                    && recv.start < send.end
                {
                    return bad(format!(
                        "out-of-place input {:?} and output {:?} overlap (use the in-place form)",
                        send.range(),
                        recv.range()
                    ));
                }
                let (s, r) = (elems(send, "input")?, elems(recv, "output")?);
                let (count, ok) = match kind {
                    CollectiveKind::ReduceScatter(_) => (r, s == r * world),
                    CollectiveKind::AllGather => (s, r == s * world),
                    _ => (s, s == r),
                };
                if !ok {
                    return bad(format!(
                        "input of {s} and output of {r} elements do not fit {} over {world} ranks",
                        kind.name()
                    ));
                }
                Ok(count)
            }
        }
    }
}

/// One submitted collective, shared by its task's two bodies (CPU and CUDA;
/// the runtime runs one and drops the other at submission).
///
/// If it is dropped without having run — its task was skipped because a task
/// it depends on failed — the communicator is aborted, so the other ranks fail
/// now instead of waiting for a collective that will never come.
struct Job {
    inner: Arc<CommInner>,
    op: Collective,
    /// `kind(op, dtype × count)`, prefixed by the task's name if it differs.
    what: String,
    /// Set when a body ran, or when the submission failed (the task never
    /// existed, so nobody waits for it).
    settled: AtomicBool,
}

impl Job {
    /// The body: fail fast if poisoned, else `f`; a failure becomes an
    /// [`Error::Collective`] and poisons the communicator.
    ///
    /// The collective's index is taken here, when it runs: every collective of
    /// a communicator runs on its one comm stream, in submission order, so
    /// run order is program order on every rank — and a collective recorded
    /// in a schedule gets the next index at each replay.
    fn run(
        &self,
        f: impl FnOnce(&dyn Communicator, &Collective) -> Result<()>,
    ) -> std::result::Result<(), TaskError> {
        self.settled.store(true, Ordering::Relaxed);
        let index = self.take_index()?;
        let op = Collective {
            index,
            ..self.op.clone()
        };
        f(&*self.inner.imp, &op).map_err(|e| Box::new(self.fail(index, e)) as TaskError)
    }

    /// Takes the communicator's next index for this collective (a run, or
    /// a launch of the graph it is captured in); a poisoned communicator
    /// gives an error naming it instead.
    fn take_index(&self) -> Result<u64> {
        let index = self.inner.ran.fetch_add(1, Ordering::AcqRel);
        self.check_poison(index)?;
        Ok(index)
    }

    /// The error a poisoned communicator gives collective `index`.
    fn check_poison(&self, index: u64) -> Result<()> {
        match self.inner.poisoned.get() {
            Some(e) => Err(Error::Collective {
                rank: self.inner.imp.rank(),
                index,
                op: self.what.clone(),
                message: format!("communicator is poisoned by an earlier failure: {e}"),
            }),
            None => Ok(()),
        }
    }

    /// Collective `index` failed with `e`: as an [`Error::Collective`],
    /// which poisons the communicator.
    fn fail(&self, index: u64, e: Error) -> Error {
        let e = match e {
            e @ Error::Collective { .. } => e,
            other => Error::Collective {
                rank: self.inner.imp.rank(),
                index,
                op: self.what.clone(),
                message: other.to_string(),
            },
        };
        self.inner.poison(&e);
        e
    }

    fn skip_error(&self, index: u64, why: Option<&Error>) -> Error {
        let message = match why {
            Some(Error::DependencyFailed { cause, root, .. }) => format!(
                "skipped on this rank because `{cause}`, which it depends on, failed{}",
                crate::error::root_suffix(root)
            ),
            Some(other) => format!("skipped on this rank: {other}"),
            None => "skipped on this rank because a task it depends on failed".into(),
        };
        Error::Collective {
            rank: self.inner.imp.rank(),
            index,
            op: self.what.clone(),
            message,
        }
    }
}

impl Job {
    /// Its task was skipped (`why`, the task's error) because a task it
    /// depends on failed: the other ranks must not wait for it, and learn
    /// what failed.
    fn skipped(&self, why: &Error) {
        self.settled.store(true, Ordering::Relaxed);
        let index = self.inner.ran.fetch_add(1, Ordering::AcqRel);
        self.inner.poison(&self.skip_error(index, Some(why)));
    }

    /// A replay queued it again: one more collective issued.
    fn queued(&self) {
        *lock(&self.inner.issued) += 1;
    }
}

/// A collective task's events, for the engine, whose hooks are `std`
/// `Arc`s (the job's own is loom's under loom).
struct JobEvents(Arc<Job>);

impl crate::ctx::CommEvents for JobEvents {
    fn skipped(&self, why: &Error) {
        self.0.skipped(why)
    }

    fn queued(&self) {
        self.0.queued()
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        if !self.settled.load(Ordering::Relaxed) {
            let e = self.skip_error(self.op.index, None);
            self.inner.poison(&e);
        }
    }
}

/// A communicator bound to the runtime its collectives run on ([`Comm::bind`]):
/// submits collectives as tasks. Derefs to its [`Comm`] (rank, numbering,
/// poison, abort).
#[derive(Clone)]
pub struct BoundComm<'rt> {
    comm: Comm,
    rt: &'rt Runtime,
}

impl fmt::Debug for BoundComm<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BoundComm")
            .field("comm", &self.comm)
            .field("runtime", &self.rt)
            .finish()
    }
}

impl Deref for BoundComm<'_> {
    type Target = Comm;
    fn deref(&self) -> &Comm {
        &self.comm
    }
}

impl<'rt> BoundComm<'rt> {
    /// The runtime the collectives run on.
    pub fn runtime(&self) -> &'rt Runtime {
        self.rt
    }

    /// The communicator, unbound.
    pub fn comm(&self) -> &Comm {
        &self.comm
    }

    /// Submits a collective named after its kind. See [`BoundComm::submit_named`].
    pub fn submit(
        &self,
        kind: CollectiveKind,
        dtype: DType,
        buffers: Buffers,
    ) -> Result<TaskHandle> {
        self.submit_named(kind.name(), kind, dtype, buffers)
    }

    /// Submits a collective as the task `name`: checks the views against the
    /// kind and element type and the runtime (an error here consumes no
    /// index), declares one access per view (all-reduce, reduce-scatter and
    /// all-gather in place: `read_write` on the view; broadcast in place:
    /// `read` on the root, `read_write` elsewhere; out of place: `read` on the
    /// input, `write` on the output) and places the task on the
    /// communicator's comm stream. Returns at once.
    pub fn submit_named(
        &self,
        name: impl Into<Cow<'static, str>>,
        kind: CollectiveKind,
        dtype: DType,
        buffers: Buffers,
    ) -> Result<TaskHandle> {
        let name = name.into();
        let rank = self.rank();
        let count = self.comm.check(&name, kind, dtype, &buffers)?;
        let mut issued = lock(&self.comm.inner.issued);
        let op = Collective {
            index: *issued,
            kind,
            dtype,
            count,
            buffers,
        };
        let what = if name == kind.name() {
            op.describe()
        } else {
            format!("{name}: {}", op.describe())
        };
        let tokens = tokens(&op, rank);
        let job = Arc::new(Job {
            inner: self.comm.inner.clone(),
            op,
            what,
            settled: AtomicBool::new(false),
        });
        let (cpu, cuda, hook) = (job.clone(), job.clone(), job.clone());
        let submitted = self
            .rt
            .task(name)
            .kind(TaskKind::Comm)
            .comm_stream(self.comm_stream())
            .comm_hook(std::sync::Arc::new(JobEvents(hook)))
            .run_any(
                tokens,
                move |data| cpu.run(|imp, op| imp.run_host(op, HostData::from_parts(data)?)),
                move |data, cu| {
                    if cu.capturing() {
                        return Job::capture(&cuda, data, cu);
                    }
                    cuda.run(|imp, op| imp.run_cuda(op, DeviceData::from_parts(data)?, cu))
                },
            );
        match submitted {
            Ok(h) => {
                *issued += 1;
                Ok(h)
            }
            Err(e) => {
                // The task never existed: nobody waits for it, and its index
                // goes to the next collective.
                job.settled.store(true, Ordering::Relaxed);
                Err(e)
            }
        }
    }

    /// In-place all-reduce of the `T` elements of `v`.
    pub fn all_reduce<T: Element>(&self, v: &View, op: ReduceOp) -> Result<TaskHandle> {
        self.submit(
            CollectiveKind::AllReduce(op),
            T::DTYPE,
            Buffers::InPlace(v.clone()),
        )
    }

    /// All-reduce of `send` into `recv` (same element count).
    pub fn all_reduce_into<T: Element>(
        &self,
        send: &View,
        recv: &View,
        op: ReduceOp,
    ) -> Result<TaskHandle> {
        self.submit(
            CollectiveKind::AllReduce(op),
            T::DTYPE,
            out_of_place(send, recv),
        )
    }

    /// In-place reduce-scatter: `v` holds `count × world` elements; rank `r`'s
    /// reduced chunk lands in chunk `r` of `v` (the other chunks keep their
    /// input).
    pub fn reduce_scatter<T: Element>(&self, v: &View, op: ReduceOp) -> Result<TaskHandle> {
        self.submit(
            CollectiveKind::ReduceScatter(op),
            T::DTYPE,
            Buffers::InPlace(v.clone()),
        )
    }

    /// Reduce-scatter of `send` (`count × world` elements) into `recv` (`count`).
    pub fn reduce_scatter_into<T: Element>(
        &self,
        send: &View,
        recv: &View,
        op: ReduceOp,
    ) -> Result<TaskHandle> {
        self.submit(
            CollectiveKind::ReduceScatter(op),
            T::DTYPE,
            out_of_place(send, recv),
        )
    }

    /// In-place all-gather: `v` holds `count × world` elements; rank `r`
    /// contributes chunk `r`.
    pub fn all_gather<T: Element>(&self, v: &View) -> Result<TaskHandle> {
        self.submit(
            CollectiveKind::AllGather,
            T::DTYPE,
            Buffers::InPlace(v.clone()),
        )
    }

    /// All-gather of `send` (`count`) into `recv` (`count × world`, rank order).
    pub fn all_gather_into<T: Element>(&self, send: &View, recv: &View) -> Result<TaskHandle> {
        self.submit(
            CollectiveKind::AllGather,
            T::DTYPE,
            out_of_place(send, recv),
        )
    }

    /// In-place broadcast of `root`'s `v` to every rank's `v`.
    pub fn broadcast<T: Element>(&self, v: &View, root: usize) -> Result<TaskHandle> {
        self.submit(
            CollectiveKind::Broadcast { root },
            T::DTYPE,
            Buffers::InPlace(v.clone()),
        )
    }

    /// Broadcast of `root`'s `send` into every rank's `recv`.
    pub fn broadcast_into<T: Element>(
        &self,
        send: &View,
        recv: &View,
        root: usize,
    ) -> Result<TaskHandle> {
        self.submit(
            CollectiveKind::Broadcast { root },
            T::DTYPE,
            out_of_place(send, recv),
        )
    }

    /// A barrier: completes on each rank once every rank has reached it (in
    /// stream order: it waits for nothing else on its own rank).
    pub fn barrier(&self) -> Result<TaskHandle> {
        self.submit(CollectiveKind::Barrier, DType::F32, Buffers::None)
    }
}

fn out_of_place(send: &View, recv: &View) -> Buffers {
    Buffers::OutOfPlace {
        send: send.clone(),
        recv: recv.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounds_to_nearest_even() {
        assert_eq!(Bf16::from_f32(1.0).to_f32(), 1.0);
        // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1.0).
        assert_eq!(Bf16::from_f32(1.0 + 1.0 / 256.0).to_f32(), 1.0);
        // Just above halfway rounds up.
        assert_eq!(
            Bf16::from_f32(1.0 + 1.0 / 256.0 + 1.0 / 4096.0).to_f32(),
            1.0 + 1.0 / 128.0
        );
        assert!(Bf16::from_f32(f32::NAN).to_f32().is_nan());
        assert_eq!(Bf16::from_f32(f32::INFINITY).to_f32(), f32::INFINITY);
        assert_eq!(Bf16::from_f32(-2.5).to_f32(), -2.5);
    }

    #[test]
    fn descriptions() {
        let d = describe(CollectiveKind::AllReduce(ReduceOp::Avg), DType::F32, 10);
        assert_eq!(d, "all_reduce(avg, f32 × 10)");
        assert_eq!(describe(CollectiveKind::Barrier, DType::F32, 0), "barrier");
    }
}

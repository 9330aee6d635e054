//! NCCL behind the [`Communicator`] trait: a collective task's CUDA body
//! ([`Communicator::run_cuda`]) enqueues the NCCL call on the CUDA stream the
//! task runs on, with the device addresses of its declared views
//! ([`DeviceData`]). Ordering against the compute streams comes from the
//! engine's events, exactly as for a kernel.
//!
//! Timeouts: NCCL collectives are asynchronous, so a rank that never arrives
//! shows up as a collective that never completes on the device. A watchdog
//! thread per communicator checks the end event of every collective it has
//! enqueued; past the timeout, or as soon as NCCL reports an asynchronous
//! error while one is pending (a peer died, a network error), it calls
//! `ncclCommAbort`, which makes the pending NCCL kernels return, so the
//! stream drains instead of hanging. Every collective still pending then
//! fails its own task (through a completion check,
//! [`CudaTaskCtx::on_complete`]), with an error naming the collective that
//! timed out (or NCCL's error), and later collectives on the communicator
//! fail at once.
//!
//! The watchdog shares the state; dropping the communicator stops it (a flag,
//! then an unpark) and joins it, so the watchdog never outlives the
//! communicator nor ends up destroying the NCCL communicator itself. It
//! stops once no collective it watches is pending: one that is still
//! pending at the drop (enqueued, its task's handle dropped) is aborted at
//! its timeout as before, so a drop waits at most that long, where
//! `ncclCommDestroy` would wait for a kernel that may never finish.
//!
//! Every `ncclCommAbort` runs on the watchdog thread, also one that
//! [`Communicator::abort`] asks for (a poisoned communicator: a failed or
//! skipped collective, [`Comm::abort`]): that call only records the reason,
//! which fails later collectives at once, and wakes the watchdog. NCCL's abort
//! sets the flag that makes pending kernels return, then waits until every
//! CUDA graph holding one of the communicator's captured collectives
//! ([`crate::RuntimeBuilder::graph_collectives`]) has been destroyed (it
//! reclaims their plans). The thread that poisons is often a stream thread,
//! or one holding the schedule that owns such a graph; had it aborted, it
//! would wait for itself. The watchdog waits for nobody's progress: the graphs'
//! launch hooks keep the communicator, and so the watchdog, alive until they
//! are destroyed.

use super::nccl::{DataType, NcclComm, NcclError, NcclUniqueId, ReduceOp as NcclOp};
use super::rendezvous::exchange_id;
use super::DistEnv;
use super::{
    CapturedCollective, Collective, CollectiveKind, Comm, Communicator, DType, DeviceData, ReduceOp,
};
use crate::backend::gpu::CudaTaskCtx;
use crate::cuda::{CudaEvent, DeviceBuffer};
use crate::error::{Error, Result};
use crate::sync::{lock, Arc, AtomicBool, Mutex, OnceLock, Ordering};
use crate::Runtime;
use std::time::{Duration, Instant};

/// Default collective timeout of NCCL communicators.
pub const NCCL_TIMEOUT: Duration = Duration::from_secs(300);

struct Pending {
    index: u64,
    what: String,
    /// Completes once the collective has (shared by the collectives of
    /// one graph launch).
    event: std::sync::Arc<CudaEvent>,
    since: Instant,
}

struct Shared {
    comm: NcclComm,
    pending: Mutex<Vec<Pending>>,
    aborted: OnceLock<String>,
    /// Collectives that were still pending when the communicator was aborted.
    killed: Mutex<Vec<u64>>,
    timeout: Duration,
    /// Set by [`Communicator::abort`]: the watchdog calls `ncclCommAbort`
    /// (module docs).
    abort_requested: AtomicBool,
    /// Set when the communicator is dropped: the watchdog exits.
    stop: AtomicBool,
}

/// One NCCL rank as a [`Communicator`].
pub struct NcclCommunicator {
    shared: Arc<Shared>,
    /// One element of scratch for barriers (an all-reduce of nothing).
    scratch: Mutex<Option<DeviceBuffer>>,
    /// The watchdog thread (`new` fails without one); taken by `Drop`.
    watchdog: Option<std::thread::JoinHandle<()>>,
}

impl Drop for NcclCommunicator {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        if let Some(w) = self.watchdog.take() {
            w.thread().unpark();
            let _ = w.join();
        }
    }
}

impl std::fmt::Debug for NcclCommunicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclCommunicator")
            .field("rank", &self.shared.comm.rank())
            .field("world_size", &self.shared.comm.world_size())
            .finish()
    }
}

fn nccl_err(rank: usize, index: u64, op: &str, e: NcclError) -> Error {
    Error::Collective {
        rank,
        index,
        op: op.to_string(),
        message: e.to_string(),
    }
}

impl NcclCommunicator {
    /// Wraps an initialised NCCL communicator, with a watchdog that aborts it
    /// when a collective has not completed after `timeout`. Fails if the
    /// watchdog's thread cannot be started: without it nothing would time
    /// out, and aborts would run on threads that may wait for themselves
    /// (module docs).
    pub fn new(comm: NcclComm, timeout: Duration) -> Result<Self> {
        let shared = Arc::new(Shared {
            comm,
            pending: Mutex::new(Vec::new()),
            aborted: OnceLock::new(),
            killed: Mutex::new(Vec::new()),
            timeout,
            abort_requested: AtomicBool::new(false),
            stop: AtomicBool::new(false),
        });
        let sh = shared.clone();
        let watchdog = std::thread::Builder::new()
            .name("braid-nccl-watchdog".into())
            .spawn(move || {
                crate::sched::tenants::leave_inherited_realtime();
                watchdog(&sh)
            })
            .map_err(|e| Error::Config(format!("starting the NCCL watchdog thread: {e}")))?;
        Ok(NcclCommunicator {
            shared,
            scratch: Mutex::new(None),
            watchdog: Some(watchdog),
        })
    }

    /// The NCCL communicator of this process's rank in a `torchrun`-style job
    /// (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`): rank 0
    /// creates the unique id and sends it to the others through the TCP
    /// rendezvous; each rank then joins on the runtime's GPU.
    pub fn from_env(rt: &Runtime) -> Result<Comm> {
        let env = DistEnv::from_env().map_err(|e| Error::Config(e.to_string()))?;
        Self::join(rt, &env)
    }

    /// Joins the job described by `env` on the runtime's GPU, with the
    /// default collective timeout ([`NCCL_TIMEOUT`]).
    pub fn join(rt: &Runtime, env: &DistEnv) -> Result<Comm> {
        Self::join_with_timeout(rt, env, NCCL_TIMEOUT)
    }

    /// [`join`](Self::join), with collectives that fail (the communicator
    /// aborted, naming the collective) once one has waited `timeout` for
    /// the other ranks.
    pub fn join_with_timeout(rt: &Runtime, env: &DistEnv, timeout: Duration) -> Result<Comm> {
        let dev = rt.cuda_device().ok_or_else(|| Error::BackendUnavailable {
            backend: "nccl",
            reason: "NCCL needs a runtime on the CUDA backend".into(),
        })?;
        let collective = |e: String| Error::Collective {
            rank: env.rank,
            index: 0,
            op: "init".into(),
            message: e,
        };
        // Rank 0 makes the id once every rank has joined; all receive it.
        let bytes = exchange_id(&env.rendezvous_config(), || {
            NcclUniqueId::new()
                .map(|id| *id.as_bytes())
                .map_err(|e| e.to_string())
        })
        .map_err(|e| collective(e.to_string()))?;
        let id = NcclUniqueId::from_bytes(&bytes).map_err(|e| collective(e.to_string()))?;
        let comm = NcclComm::init_rank(dev, &id, env.rank, env.world_size)
            .map_err(|e| collective(e.to_string()))?;
        Ok(Comm::new(NcclCommunicator::new(comm, timeout)?))
    }

    /// A communicator of one rank on the runtime's GPU (world size 1).
    pub fn single(rt: &Runtime) -> Result<Comm> {
        Self::join(rt, &DistEnv::single())
    }
}

impl Shared {
    /// The error of collective `index` (`what`) on an aborted communicator.
    fn check_aborted(&self, index: u64, what: &str) -> Result<()> {
        match self.aborted.get() {
            Some(why) => Err(Error::Collective {
                rank: self.comm.rank(),
                index,
                op: what.to_string(),
                message: format!("the communicator was aborted: {why}"),
            }),
            None => Ok(()),
        }
    }
}

fn watchdog(sh: &Shared) {
    // When the collective now first in `pending` started to wait: when the
    // one before it completed, or its own enqueue if later. Collectives of
    // one communicator run in order on its one stream, so only the first
    // can be late, and a collective queued behind others (a program far
    // ahead of its device) is not timed while they run.
    let mut done_at = Instant::now();
    loop {
        std::thread::park_timeout(Duration::from_millis(20));
        let mut p = lock(&sh.pending);
        let before = p.len();
        p.retain(|x| !matches!(x.event.query(), Ok(true) | Err(_)));
        if p.len() < before {
            done_at = Instant::now();
        }
        let late = failure(sh, &p, done_at);
        // A requested abort (a poisoned communicator) or a late one: every
        // collective still pending fails with it (`killed`, read by their
        // completion checks), and so does any watched later (`watch`).
        // The reason is set under the lock, so none falls between.
        let abort = match late {
            Some(why) => {
                let _ = sh.aborted.set(why);
                sh.abort_requested.store(false, Ordering::Release);
                true
            }
            None => sh.abort_requested.swap(false, Ordering::AcqRel),
        };
        if abort {
            lock(&sh.killed).extend(p.iter().map(|x| x.index));
            p.clear();
        }
        let idle = p.is_empty();
        drop(p);
        // Also when a stop was asked for with it: the NCCL communicator is
        // not destroyed after an abort (`NcclComm`'s drop), which would
        // wait for kernels that may never finish.
        if abort {
            let _ = sh.comm.abort();
        }
        // Dropped: done once nothing is left to watch. A collective still
        // pending is watched to its end or its timeout, so the NCCL
        // communicator's destruction after the join never waits for a
        // kernel that cannot finish.
        if idle && sh.stop.load(Ordering::Acquire) {
            return;
        }
    }
}

/// Why the pending collectives `p` must be aborted, if they must: the first
/// has waited past the timeout since `done_at` (or its enqueue), or NCCL
/// reports an asynchronous error (a peer that died, a network error:
/// `ncclCommGetAsyncError`, asked only while a collective is pending),
/// which would otherwise surface only at the timeout.
fn failure(sh: &Shared, p: &[Pending], done_at: Instant) -> Option<String> {
    let x = p.first()?;
    if x.since.max(done_at).elapsed() > sh.timeout {
        return Some(format!(
            "collective #{} `{}` did not complete within {:?}",
            x.index, x.what, sh.timeout
        ));
    }
    match sh.comm.async_error() {
        Ok(()) | Err(NcclError::Aborted { .. }) => None,
        Err(e) => Some(format!(
            "NCCL reported an error while collective #{} `{}` was pending: {e}",
            x.index, x.what
        )),
    }
}

fn dtype(d: DType) -> DataType {
    match d {
        DType::F32 => DataType::F32,
        DType::F64 => DataType::F64,
        DType::I32 => DataType::I32,
        DType::Bf16 => DataType::BF16,
    }
}

fn op(o: ReduceOp) -> NcclOp {
    match o {
        ReduceOp::Sum => NcclOp::Sum,
        ReduceOp::Avg => NcclOp::Avg,
        ReduceOp::Max => NcclOp::Max,
        ReduceOp::Min => NcclOp::Min,
    }
}

impl NcclCommunicator {
    /// Enqueues collective `c` on `cu`'s stream (or into the graph it is
    /// captured into), unless the communicator was aborted; returns its
    /// description.
    fn enqueue(
        &self,
        c: &Collective,
        data: DeviceData<'_>,
        cu: &CudaTaskCtx<'_>,
    ) -> Result<String> {
        let what = c.describe();
        self.shared.check_aborted(c.index, &what)?;
        let rank = self.rank();
        let stream = cu.stream();
        let err = |e| nccl_err(rank, c.index, &what, e);
        // The root of an in-place broadcast only reads its data (the task
        // declared it so); NCCL is given the same address as its output and
        // reads it.
        let (send, recv) = data.addresses(c, rank);
        let dt = dtype(c.dtype);
        // SAFETY: `send` and `recv` are device addresses inside the views the
        // task declared (resolved from its access tokens), sized by `Comm`
        // for `count` elements of `dtype` with NCCL's conventions; the task
        // holds the buffers until the stream has finished the collective (a
        // graph's, until its launches have: the schedule holds them).
        unsafe {
            match c.kind {
                CollectiveKind::AllReduce(o) => {
                    self.shared
                        .comm
                        .all_reduce(send, recv, c.count, dt, op(o), stream)
                }
                CollectiveKind::ReduceScatter(o) => {
                    self.shared
                        .comm
                        .reduce_scatter(send, recv, c.count, dt, op(o), stream)
                }
                CollectiveKind::AllGather => {
                    self.shared.comm.all_gather(send, recv, c.count, dt, stream)
                }
                CollectiveKind::Broadcast { root } => self
                    .shared
                    .comm
                    .broadcast(send, recv, c.count, dt, root, stream),
                CollectiveKind::Barrier => {
                    // The scratch is made at the first barrier, outside a
                    // capture: one would record the allocation as a node of
                    // the graph (stream-ordered allocations are captured),
                    // memory that exists only once the graph has run. A
                    // barrier captured first is refused, and the graphs are
                    // cut around it.
                    let mut s = lock(&self.scratch);
                    if s.is_none() {
                        if cu.capturing() {
                            return Err(Error::Collective {
                                rank,
                                index: c.index,
                                op: what,
                                message: "a barrier is captured into a CUDA graph only after \
                                          an eager one (its scratch element is made then)"
                                    .into(),
                            });
                        }
                        *s = Some(DeviceBuffer::zeroed(stream, 4)?);
                    }
                    let p = s.as_ref().map_or(0, |b| b.device_ptr());
                    self.shared
                        .comm
                        .all_reduce(p, p, 1, DataType::F32, NcclOp::Sum, stream)
                }
            }
        }
        .map_err(err)?;
        Ok(what)
    }
}

/// Hands collective `index`, enqueued on `cu`'s stream, to the watchdog
/// (an event recorded after it: `CudaTaskCtx::mark`, one for every
/// collective of a graph launch), and registers the check that fails `cu`'s
/// task if the communicator was aborted while it was pending.
fn watch(shared: &Arc<Shared>, index: u64, what: String, cu: &CudaTaskCtx<'_>) -> Result<()> {
    let rank = shared.comm.rank();
    let event = cu.mark()?;
    {
        let mut p = lock(&shared.pending);
        p.push(Pending {
            index,
            what: what.clone(),
            event,
            since: Instant::now(),
        });
        // Aborted already (the reason is set under this lock): NCCL's
        // abort may have cut this collective short too.
        if shared.aborted.get().is_some() {
            lock(&shared.killed).push(index);
        }
    }
    // When the work has completed on the device: was it aborted?
    let shared = shared.clone();
    cu.on_complete(move || {
        let killed = lock(&shared.killed);
        match (killed.contains(&index), shared.aborted.get()) {
            (true, Some(why)) => Err(Error::Collective {
                rank,
                index,
                op: what,
                message: format!("aborted: {why}"),
            }),
            _ => Ok(()),
        }
    });
    Ok(())
}

/// An NCCL collective captured into a CUDA graph: at each launch, the
/// watchdog watches the launch (an event recorded after the whole graph,
/// one for all its collectives: `CudaTaskCtx::mark`) as collective
/// `index`, and the graph's task checks for an abort once it completes.
struct InGraph {
    shared: Arc<Shared>,
    what: String,
}

impl CapturedCollective for InGraph {
    /// A communicator aborted (by the watchdog: a timeout or NCCL's error)
    /// refuses the launch, as it refuses to enqueue an eager collective.
    fn check(&self, index: u64) -> Result<()> {
        self.shared.check_aborted(index, &self.what)
    }

    fn launched(&self, index: u64, cu: &CudaTaskCtx<'_>) -> Result<()> {
        watch(&self.shared, index, self.what.clone(), cu)
    }
}

impl Communicator for NcclCommunicator {
    fn rank(&self) -> usize {
        self.shared.comm.rank()
    }

    fn world_size(&self) -> usize {
        self.shared.comm.world_size()
    }

    fn backend(&self) -> &'static str {
        "nccl"
    }

    fn run_cuda(&self, c: &Collective, data: DeviceData<'_>, cu: &CudaTaskCtx<'_>) -> Result<()> {
        let what = self.enqueue(c, data, cu)?;
        watch(&self.shared, c.index, what, cu)
    }

    fn capture_cuda(
        &self,
        c: &Collective,
        data: DeviceData<'_>,
        cu: &CudaTaskCtx<'_>,
    ) -> Result<Box<dyn CapturedCollective>> {
        let what = self.enqueue(c, data, cu)?;
        Ok(Box::new(InGraph {
            shared: self.shared.clone(),
            what,
        }))
    }

    /// Records `reason` (later collectives fail with it at once) and has
    /// the watchdog thread abort the NCCL communicator (module docs): this
    /// thread does not wait.
    fn abort(&self, reason: &str) {
        let _ = self.shared.aborted.set(reason.to_string());
        self.shared.abort_requested.store(true, Ordering::Release);
        if let Some(w) = &self.watchdog {
            w.thread().unpark();
        }
    }
}

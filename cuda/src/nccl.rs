//! NCCL communicators over `cudarc::nccl` (dynamic loading).
//!
//! One [`NcclComm`] per GPU rank. Creation:
//!
//! * **one process per GPU** (torchrun style): rank 0 makes an [`NcclUniqueId`],
//!   a rendezvous (the engine's `braid::comm::rendezvous`) sends its 128 bytes to every rank,
//!   and each rank calls [`NcclComm::init_rank`] (blocks until all ranks joined);
//! * **one process for all GPUs of a node**: [`NcclComm::init_all`]
//!   (`ncclCommInitAll`), or [`NcclComm::init_local_ranks`] when a process drives
//!   several GPUs of a larger world (group-wrapped `ncclCommInitRank`s).
//!
//! Collectives ([`all_reduce`](NcclComm::all_reduce),
//! [`reduce_scatter`](NcclComm::reduce_scatter),
//! [`all_gather`](NcclComm::all_gather), [`broadcast`](NcclComm::broadcast)) take
//! raw device pointers — the engine hands them out of a task's declared views —
//! and a stream: a [`CudaStream`](crate::CudaStream), or the raw
//! stream a task body runs on wrapped in
//! [`RawStream`](crate::RawStream) (the communicator's
//! high-priority comm stream). They only
//! enqueue work; completion is observed with an event recorded after them.
//! Collectives on one communicator must be issued in the same order on every rank
//! (Semantics 5); NCCL hangs otherwise.
//!
//! # Errors and abort
//!
//! A failed call becomes [`NcclError::Call`] with `ncclGetErrorString` and
//! `ncclGetLastError`. [`NcclComm::async_error`] polls `ncclCommGetAsyncError`
//! (a peer died, a network error) for a watchdog; [`NcclComm::abort`] calls
//! `ncclCommAbort`, which kills the communicator's pending kernels and frees it.
//! NCCL allows the abort to come from another thread while a call is blocked
//! inside NCCL — that is how a hang is broken. Protocol: every call first
//! registers itself in `active` and then checks `aborted` (both `SeqCst`);
//! `abort` sets `aborted`, waits up to [`ABORT_GRACE`] for registered calls to
//! leave (calls that are merely enqueuing leave in microseconds), then aborts.
//! Every later call returns [`NcclError::Aborted`], and `Drop` does not destroy an
//! aborted communicator again.
//!
//! # Library
//!
//! cudarc looks for `libnccl.so` (and `.so.13`, `.so.12`, …) but not
//! `libnccl.so.2`, the only name NVIDIA's `nvidia-nccl-cu13` wheel ships. When
//! only `libnccl.so.2` is found, the error says so: add a directory with a
//! `libnccl.so -> libnccl.so.2` symlink to `LD_LIBRARY_PATH`
//! (`scripts/gpu-validate.sh` does this).

use std::ffi::CStr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use cudarc::nccl::{result, sys as nc};

use crate::{AsRawStream, CudaDevice, CudaError, DevicePtr};

/// How long [`NcclComm::abort`] waits for calls that are enqueuing to leave.
pub const ABORT_GRACE: Duration = Duration::from_millis(200);

/// Errors of the NCCL layer.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum NcclError {
    /// libnccl could not be loaded.
    #[error("NCCL library could not be loaded: {detail}")]
    LibraryMissing {
        /// What was found and what to do.
        detail: String,
    },
    /// An NCCL call returned an error.
    #[error("NCCL call {call} failed{}: {name} ({code}){}", rank_suffix(*.rank), detail_suffix(.detail))]
    Call {
        /// The NCCL function.
        call: &'static str,
        /// The rank of the communicator, when known.
        rank: Option<usize>,
        /// Raw `ncclResult_t`.
        code: u32,
        /// `ncclGetErrorString`.
        name: String,
        /// `ncclGetLastError`, often more specific (may be empty).
        detail: String,
    },
    /// The communicator was aborted; no further calls are possible.
    #[error("NCCL communicator of rank {rank} was aborted")]
    Aborted {
        /// Rank of the aborted communicator.
        rank: usize,
    },
    /// A CUDA error around an NCCL call.
    #[error(transparent)]
    Cuda(#[from] CudaError),
    /// Rejected before reaching NCCL.
    #[error("invalid NCCL argument: {0}")]
    InvalidArgument(String),
    /// cudarc panicked (e.g. a symbol missing from an old libnccl).
    #[error("cudarc panicked during {during}: {message}")]
    Panicked {
        /// What was being done.
        during: &'static str,
        /// Panic payload.
        message: String,
    },
}

fn rank_suffix(rank: Option<usize>) -> String {
    rank.map(|r| format!(" on rank {r}")).unwrap_or_default()
}

fn detail_suffix(detail: &str) -> String {
    if detail.is_empty() {
        String::new()
    } else {
        format!(": {detail}")
    }
}

/// Result alias of this module.
pub type NcclResult<T> = Result<T, NcclError>;

fn cstr_or_empty(p: *const std::ffi::c_char) -> String {
    if p.is_null() {
        String::new()
    } else {
        // SAFETY: NCCL returns NUL-terminated strings that live at least until the
        // next NCCL call on this thread; we copy immediately.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }
}

/// Names the call behind a result of cudarc's checked NCCL layer
/// (`cudarc::nccl::result`, or a raw status's `.result()`, which count
/// `ncclSuccess` and `ncclInProgress` as success): the bare status error
/// becomes [`NcclError::Call`] with the call, the rank, `ncclGetErrorString` and
/// `ncclGetLastError(comm)`.
trait Named<T> {
    fn named(self, call: &'static str, rank: Option<usize>, comm: nc::ncclComm_t) -> NcclResult<T>;
}

impl<T> Named<T> for Result<T, result::NcclError> {
    #[inline]
    fn named(self, call: &'static str, rank: Option<usize>, comm: nc::ncclComm_t) -> NcclResult<T> {
        self.map_err(|e| call_error(call, rank, comm, e.0))
    }
}

#[cold]
fn call_error(
    call: &'static str,
    rank: Option<usize>,
    comm: nc::ncclComm_t,
    r: nc::ncclResult_t,
) -> NcclError {
    // SAFETY: both functions accept any result code / a null or live comm.
    let name = cstr_or_empty(unsafe { nc::ncclGetErrorString(r) });
    // SAFETY: as above (`comm` is null or a live communicator).
    let detail = cstr_or_empty(unsafe { nc::ncclGetLastError(comm) });
    NcclError::Call {
        call,
        rank,
        code: r as u32,
        name,
        detail,
    }
}

/// "No communicator" for [`Named::named`] (`ncclGetLastError(NULL)`).
const NO_COMM: nc::ncclComm_t = std::ptr::null_mut();

fn catch<T>(during: &'static str, f: impl FnOnce() -> NcclResult<T>) -> NcclResult<T> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(p) => {
            let message = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "non-string panic".into());
            Err(NcclError::Panicked { during, message })
        }
    }
}

/// Whether `name` exists in a directory the dynamic loader searches (only used
/// to make the "library missing" message precise; no `dlopen`).
fn on_loader_path(name: &str) -> bool {
    let mut dirs: Vec<std::path::PathBuf> = std::env::var_os("LD_LIBRARY_PATH")
        .map(|p| std::env::split_paths(&p).collect())
        .unwrap_or_default();
    for d in [
        "/usr/local/cuda/lib64",
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib64",
        "/usr/lib",
        "/lib/x86_64-linux-gnu",
    ] {
        dirs.push(d.into());
    }
    dirs.iter().any(|d| d.join(name).exists())
}

/// True when cudarc can load libnccl. Cached.
pub fn nccl_library_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    *PRESENT.get_or_init(|| {
        // SAFETY: only tries `dlopen` on cudarc's candidate names.
        std::panic::catch_unwind(|| unsafe { nc::is_culib_present() }).unwrap_or(false)
    })
}

fn require_nccl() -> NcclResult<()> {
    if nccl_library_present() {
        return Ok(());
    }
    let detail = if on_loader_path("libnccl.so.2") {
        "libnccl.so.2 is on the loader path but cudarc looks for libnccl.so: put a directory holding a \
         symlink libnccl.so -> libnccl.so.2 on LD_LIBRARY_PATH (scripts/gpu-validate.sh does this)"
            .to_string()
    } else {
        "libnccl.so not found: install NCCL (e.g. the nvidia-nccl-cu13 wheel) and add its lib \
         directory to LD_LIBRARY_PATH"
            .to_string()
    };
    Err(NcclError::LibraryMissing { detail })
}

/// NCCL's version as `(major, minor, patch)`.
pub fn nccl_version() -> NcclResult<(u32, u32, u32)> {
    require_nccl()?;
    catch("ncclGetVersion", || {
        let v = result::get_nccl_version().named("ncclGetVersion", None, NO_COMM)? as u32;
        // NCCL_VERSION(X,Y,Z) = X*10000 + Y*100 + Z since 2.9 (X*1000 + Y*100 + Z before).
        Ok(if v >= 10000 {
            (v / 10000, (v % 10000) / 100, v % 100)
        } else {
            (v / 1000, (v % 1000) / 100, v % 100)
        })
    })
}

/// The 128-byte id every rank of a communicator must share.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct NcclUniqueId(pub [u8; NcclUniqueId::LEN]);

impl std::fmt::Debug for NcclUniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NcclUniqueId(")?;
        for b in &self.0[..8] {
            write!(f, "{b:02x}")?;
        }
        write!(f, "…)")
    }
}

impl NcclUniqueId {
    /// Size of the id in bytes (`NCCL_UNIQUE_ID_BYTES`).
    pub const LEN: usize = 128;

    /// A fresh id (`ncclGetUniqueId`; on rank 0 only). Needs libnccl, not a GPU.
    pub fn new() -> NcclResult<Self> {
        require_nccl()?;
        catch("ncclGetUniqueId", || {
            let id = result::get_uniqueid().named("ncclGetUniqueId", None, NO_COMM)?;
            Ok(Self::from_raw(&id))
        })
    }

    /// From the bytes received over the rendezvous.
    pub fn from_bytes(bytes: &[u8]) -> NcclResult<Self> {
        let arr: [u8; Self::LEN] = bytes.try_into().map_err(|_| {
            NcclError::InvalidArgument(format!(
                "an NCCL unique id is {} bytes, got {}",
                Self::LEN,
                bytes.len()
            ))
        })?;
        Ok(NcclUniqueId(arr))
    }

    /// The bytes to send over the rendezvous.
    pub fn as_bytes(&self) -> &[u8; Self::LEN] {
        &self.0
    }

    fn from_raw(id: &nc::ncclUniqueId) -> Self {
        let mut out = [0u8; Self::LEN];
        for (o, i) in out.iter_mut().zip(id.internal.iter()) {
            *o = *i as u8;
        }
        NcclUniqueId(out)
    }

    fn to_raw(self) -> nc::ncclUniqueId {
        let mut id = nc::ncclUniqueId { internal: [0; 128] };
        for (o, i) in id.internal.iter_mut().zip(self.0.iter()) {
            *o = *i as std::ffi::c_char;
        }
        id
    }
}

/// Reduction operator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    /// Sum.
    Sum,
    /// Mean over ranks (`ncclAvg`; NCCL ≥ 2.10).
    Avg,
    /// Product.
    Prod,
    /// Maximum.
    Max,
    /// Minimum.
    Min,
}

impl ReduceOp {
    fn raw(self) -> nc::ncclRedOp_t {
        match self {
            ReduceOp::Sum => nc::ncclRedOp_t::ncclSum,
            ReduceOp::Avg => nc::ncclRedOp_t::ncclAvg,
            ReduceOp::Prod => nc::ncclRedOp_t::ncclProd,
            ReduceOp::Max => nc::ncclRedOp_t::ncclMax,
            ReduceOp::Min => nc::ncclRedOp_t::ncclMin,
        }
    }
}

/// Element type of a collective.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataType {
    /// `float`.
    F32,
    /// `double`.
    F64,
    /// `half`.
    F16,
    /// `__nv_bfloat16`.
    BF16,
    /// `int32_t`.
    I32,
    /// `int64_t`.
    I64,
    /// `uint8_t`.
    U8,
}

impl DataType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DataType::F32 | DataType::I32 => 4,
            DataType::F64 | DataType::I64 => 8,
            DataType::F16 | DataType::BF16 => 2,
            DataType::U8 => 1,
        }
    }

    fn raw(self) -> nc::ncclDataType_t {
        match self {
            DataType::F32 => nc::ncclDataType_t::ncclFloat32,
            DataType::F64 => nc::ncclDataType_t::ncclFloat64,
            DataType::F16 => nc::ncclDataType_t::ncclFloat16,
            DataType::BF16 => nc::ncclDataType_t::ncclBfloat16,
            DataType::I32 => nc::ncclDataType_t::ncclInt32,
            DataType::I64 => nc::ncclDataType_t::ncclInt64,
            DataType::U8 => nc::ncclDataType_t::ncclUint8,
        }
    }
}

/// One rank's NCCL communicator, bound to one device.
pub struct NcclComm {
    raw: nc::ncclComm_t,
    rank: usize,
    world_size: usize,
    device: CudaDevice,
    aborted: AtomicBool,
    active: AtomicUsize,
}

// SAFETY: an `ncclComm_t` may be used from any thread (one call at a time per
// communicator is the engine's discipline: collectives of one communicator are
// issued by its comm stream's thread). `abort` from another thread is supported by
// NCCL and coordinated through `aborted`/`active` (see the module docs).
unsafe impl Send for NcclComm {}
// SAFETY: see `Send`.
unsafe impl Sync for NcclComm {}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclComm")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("device", &self.device.ordinal())
            .field("aborted", &self.aborted.load(Ordering::Relaxed))
            .finish()
    }
}

/// Marks a call in progress for the abort protocol.
struct Active<'a>(&'a AtomicUsize);
impl Drop for Active<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl NcclComm {
    /// Joins communicator `id` as `rank` of `world_size` on `device`. Blocks until
    /// every rank has joined (run the rendezvous, with its timeout, first).
    pub fn init_rank(
        device: &CudaDevice,
        id: &NcclUniqueId,
        rank: usize,
        world_size: usize,
    ) -> NcclResult<Self> {
        require_nccl()?;
        if rank >= world_size {
            return Err(NcclError::InvalidArgument(format!(
                "rank {rank} >= world size {world_size}"
            )));
        }
        device.bind_to_thread()?;
        let raw = catch("ncclCommInitRank", || {
            let mut comm: nc::ncclComm_t = std::ptr::null_mut();
            // SAFETY: the device's primary context is current (so NCCL's current
            // CUDA device is `device`); out-pointer valid; the id is passed by value.
            unsafe {
                result::comm_init_rank(&mut comm, world_size as i32, id.to_raw(), rank as i32)
            }
            .named("ncclCommInitRank", Some(rank), NO_COMM)?;
            Ok(comm)
        })?;
        Ok(Self::wrap(raw, rank, world_size, device))
    }

    /// Communicators for all `devices` of this process, rank `i` on `devices[i]`
    /// (`ncclCommInitAll`; single-process worlds only).
    pub fn init_all(devices: &[CudaDevice]) -> NcclResult<Vec<Self>> {
        require_nccl()?;
        if devices.is_empty() {
            return Err(NcclError::InvalidArgument(
                "init_all needs at least one device".into(),
            ));
        }
        devices[0].bind_to_thread()?;
        let ordinals: Vec<i32> = devices.iter().map(|d| d.ordinal() as i32).collect();
        let raws = catch("ncclCommInitAll", || {
            let mut comms: Vec<nc::ncclComm_t> = vec![std::ptr::null_mut(); devices.len()];
            // SAFETY: `comms` has room for `ndev` handles; `ordinals` lists `ndev`
            // device ordinals.
            unsafe {
                result::comm_init_all(comms.as_mut_ptr(), ordinals.len() as i32, ordinals.as_ptr())
            }
            .named("ncclCommInitAll", None, NO_COMM)?;
            Ok(comms)
        })?;
        let n = devices.len();
        Ok(raws
            .into_iter()
            .zip(devices)
            .enumerate()
            .map(|(i, (raw, d))| Self::wrap(raw, i, n, d))
            .collect())
    }

    /// Communicators for several local devices that are ranks `ranks[i]` of a
    /// larger world sharing `id` (group-wrapped `ncclCommInitRank`s).
    pub fn init_local_ranks(
        devices: &[CudaDevice],
        id: &NcclUniqueId,
        ranks: &[usize],
        world_size: usize,
    ) -> NcclResult<Vec<Self>> {
        require_nccl()?;
        if devices.len() != ranks.len() || devices.is_empty() {
            return Err(NcclError::InvalidArgument(
                "devices and ranks must be non-empty and of equal length".into(),
            ));
        }
        if let Some(r) = ranks.iter().find(|&&r| r >= world_size) {
            return Err(NcclError::InvalidArgument(format!(
                "rank {r} >= world size {world_size}"
            )));
        }
        let raws = catch("ncclCommInitRank (group)", || {
            let mut comms: Vec<nc::ncclComm_t> = vec![std::ptr::null_mut(); devices.len()];
            result::group_start().named("ncclGroupStart", None, NO_COMM)?;
            let mut first_err = None;
            for ((d, &rank), slot) in devices.iter().zip(ranks).zip(comms.iter_mut()) {
                let r = d.bind_to_thread().map_err(NcclError::from).and_then(|()| {
                    // SAFETY: the device's context is current; out-pointer valid.
                    unsafe {
                        result::comm_init_rank(slot, world_size as i32, id.to_raw(), rank as i32)
                    }
                    .named("ncclCommInitRank", Some(rank), NO_COMM)
                });
                if let Err(e) = r {
                    first_err.get_or_insert(e);
                }
            }
            // Closes the group opened above.
            let end = result::group_end().named("ncclGroupEnd", None, NO_COMM);
            if let Some(e) = first_err {
                return Err(e);
            }
            end?;
            Ok(comms)
        })?;
        Ok(raws
            .into_iter()
            .zip(devices)
            .zip(ranks)
            .map(|((raw, d), &r)| Self::wrap(raw, r, world_size, d))
            .collect())
    }

    fn wrap(raw: nc::ncclComm_t, rank: usize, world_size: usize, device: &CudaDevice) -> Self {
        NcclComm {
            raw,
            rank,
            world_size,
            device: device.clone(),
            aborted: AtomicBool::new(false),
            active: AtomicUsize::new(0),
        }
    }

    /// This communicator's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// The device it runs on.
    pub fn device(&self) -> &CudaDevice {
        &self.device
    }

    /// True after [`abort`](Self::abort).
    pub fn is_aborted(&self) -> bool {
        self.aborted.load(Ordering::SeqCst)
    }

    /// Registers a call (abort protocol) and prepares the thread.
    fn enter(&self, stream_device: Option<&CudaDevice>) -> NcclResult<Active<'_>> {
        self.active.fetch_add(1, Ordering::SeqCst);
        let guard = Active(&self.active);
        if self.aborted.load(Ordering::SeqCst) {
            return Err(NcclError::Aborted { rank: self.rank });
        }
        if let Some(d) = stream_device {
            self.device.check_same(d, "NCCL stream")?;
        }
        self.device.bind_to_thread()?;
        Ok(guard)
    }

    fn call<S: AsRawStream + ?Sized>(
        &self,
        name: &'static str,
        stream: &S,
        f: impl FnOnce(nc::cudaStream_t) -> Result<result::NcclStatus, result::NcclError>,
    ) -> NcclResult<()> {
        let _g = self.enter(stream.stream_device())?;
        let raw_stream = stream.raw_stream() as nc::cudaStream_t;
        catch(name, || {
            f(raw_stream).named(name, Some(self.rank), self.raw)?;
            Ok(())
        })
    }

    /// `recv[i] = op over ranks of send[i]`, `count` elements. In place when
    /// `send == recv`.
    ///
    /// # Safety
    /// `send` and `recv` must be device memory of this communicator's device
    /// holding `count` elements of `dtype`, alive and not accessed by other
    /// streams until the collective completes on `stream`; a `RawStream` must
    /// be a live stream of this communicator's device.
    pub unsafe fn all_reduce<S: AsRawStream + ?Sized>(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
        stream: &S,
    ) -> NcclResult<()> {
        self.call("ncclAllReduce", stream, |s| {
            // SAFETY: caller's contract on the buffers; comm live (checked in `enter`).
            unsafe {
                result::all_reduce(
                    send as *const _,
                    recv as *mut _,
                    count,
                    dtype.raw(),
                    op.raw(),
                    self.raw,
                    s,
                )
            }
        })
    }

    /// Reduces `world_size · recv_count` elements of `send` and leaves block
    /// `rank` (`recv_count` elements) of the result in `recv`.
    ///
    /// # Safety
    /// As [`all_reduce`](Self::all_reduce); `send` holds `world_size · recv_count`
    /// elements, `recv` holds `recv_count`.
    pub unsafe fn reduce_scatter<S: AsRawStream + ?Sized>(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        recv_count: usize,
        dtype: DataType,
        op: ReduceOp,
        stream: &S,
    ) -> NcclResult<()> {
        self.call("ncclReduceScatter", stream, |s| {
            // SAFETY: caller's contract on the buffers; comm live.
            unsafe {
                result::reduce_scatter(
                    send as *const _,
                    recv as *mut _,
                    recv_count,
                    dtype.raw(),
                    op.raw(),
                    self.raw,
                    s,
                )
            }
        })
    }

    /// Gathers `send_count` elements from every rank into `recv`, rank order.
    ///
    /// # Safety
    /// As [`all_reduce`](Self::all_reduce); `send` holds `send_count` elements,
    /// `recv` holds `world_size · send_count`.
    pub unsafe fn all_gather<S: AsRawStream + ?Sized>(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        send_count: usize,
        dtype: DataType,
        stream: &S,
    ) -> NcclResult<()> {
        self.call("ncclAllGather", stream, |s| {
            // SAFETY: caller's contract on the buffers; comm live.
            unsafe {
                result::all_gather(
                    send as *const _,
                    recv as *mut _,
                    send_count,
                    dtype.raw(),
                    self.raw,
                    s,
                )
            }
        })
    }

    /// Copies `count` elements from `send` on rank `root` to `recv` on every rank
    /// (`send` is only read on the root).
    ///
    /// # Safety
    /// As [`all_reduce`](Self::all_reduce).
    pub unsafe fn broadcast<S: AsRawStream + ?Sized>(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        count: usize,
        dtype: DataType,
        root: usize,
        stream: &S,
    ) -> NcclResult<()> {
        if root >= self.world_size {
            return Err(NcclError::InvalidArgument(format!(
                "root {root} >= world size {}",
                self.world_size
            )));
        }
        self.call("ncclBroadcast", stream, |s| {
            // SAFETY: caller's contract on the buffers; comm live.
            unsafe {
                result::broadcast(
                    send as *const _,
                    recv as *mut _,
                    count,
                    dtype.raw(),
                    root as i32,
                    self.raw,
                    s,
                )
            }
        })
    }

    /// `Ok(())` while healthy; the asynchronous error (remote rank failure,
    /// network error) once NCCL has one. For a watchdog waiting on comm events.
    pub fn async_error(&self) -> NcclResult<()> {
        let _g = self.enter(None)?;
        catch("ncclCommGetAsyncError", || {
            let mut r = nc::ncclResult_t::ncclSuccess;
            // SAFETY: comm live; out-pointer valid. (cudarc's checked layer has
            // no `ncclCommGetAsyncError`.)
            unsafe { nc::ncclCommGetAsyncError(self.raw, &mut r) }
                .result()
                .named("ncclCommGetAsyncError", Some(self.rank), self.raw)?;
            r.result()
                .named("(asynchronous NCCL error)", Some(self.rank), self.raw)?;
            Ok(())
        })
    }

    /// Aborts the communicator (`ncclCommAbort`): pending NCCL kernels are
    /// killed and resources freed. Idempotent; callable from any thread,
    /// including while another thread is blocked inside NCCL on this
    /// communicator. Afterwards every call returns [`NcclError::Aborted`].
    pub fn abort(&self) -> NcclResult<()> {
        if self.aborted.swap(true, Ordering::SeqCst) {
            return Ok(());
        }
        let deadline = Instant::now() + ABORT_GRACE;
        while self.active.load(Ordering::SeqCst) > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_micros(200));
        }
        self.device.bind_to_thread()?;
        catch("ncclCommAbort", || {
            // SAFETY: comm created by init and not yet destroyed (the `aborted`
            // swap above makes this the only abort, and Drop skips destroy).
            unsafe { result::comm_abort(self.raw) }.named(
                "ncclCommAbort",
                Some(self.rank),
                NO_COMM,
            )?;
            Ok(())
        })
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        if *self.aborted.get_mut() {
            return;
        }
        let r = self
            .device
            .bind_to_thread()
            .map_err(NcclError::from)
            .and_then(|()| {
                catch("ncclCommDestroy", || {
                    // SAFETY: last owner; comm live and not aborted. Destroy finalises
                    // (waits for this rank's pending operations) and frees.
                    unsafe { result::comm_destroy(self.raw) }.named(
                        "ncclCommDestroy",
                        Some(self.rank),
                        NO_COMM,
                    )?;
                    Ok(())
                })
            });
        if let Err(e) = r {
            self.device
                .record_deferred(CudaError::InvalidArgument(format!(
                    "dropping NCCL communicator: {e}"
                )));
        }
    }
}

/// Runs `f` between `ncclGroupStart` and `ncclGroupEnd`: required when one thread
/// issues collectives for several communicators of the same clique (one process
/// driving several GPUs), so NCCL launches them together instead of deadlocking.
pub fn group<R>(f: impl FnOnce() -> NcclResult<R>) -> NcclResult<R> {
    require_nccl()?;
    catch("ncclGroupStart", || {
        result::group_start().named("ncclGroupStart", None, NO_COMM)
    })?;
    let out = f();
    // Closes the group opened above, also when `f` failed.
    let end = catch("ncclGroupEnd", || {
        result::group_end().named("ncclGroupEnd", None, NO_COMM)
    });
    let out = out?;
    end?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{gpu_or_skip, CudaStream, DeviceBuffer};

    #[test]
    fn unique_id_bytes_roundtrip() {
        let id = NcclUniqueId([7u8; 128]);
        assert_eq!(NcclUniqueId::from_bytes(id.as_bytes()).unwrap(), id);
        assert!(NcclUniqueId::from_bytes(&[0u8; 12]).is_err());
        let raw = id.to_raw();
        assert_eq!(NcclUniqueId::from_raw(&raw), id);
    }

    #[test]
    fn missing_library_is_an_error_not_a_panic() {
        if nccl_library_present() {
            eprintln!("SKIPPED missing_library_is_an_error_not_a_panic: libnccl is present");
            return;
        }
        let e = NcclUniqueId::new().unwrap_err();
        assert!(matches!(e, NcclError::LibraryMissing { .. }), "{e}");
        eprintln!("as expected: {e}");
        assert!(nccl_version().is_err());
    }

    #[test]
    fn version_and_unique_id_need_no_gpu() {
        if !nccl_library_present() {
            eprintln!(
                "SKIPPED nccl::version_and_unique_id_need_no_gpu: {}",
                require_nccl().unwrap_err()
            );
            return;
        }
        let (major, minor, _) = nccl_version().unwrap();
        assert!(
            major == 2 && minor >= 18,
            "NCCL {major}.{minor} is older than 2.18"
        );
        let a = NcclUniqueId::new().unwrap();
        let b = NcclUniqueId::new().unwrap();
        assert_ne!(a, b, "two unique ids must differ");
    }

    #[test]
    fn error_messages_name_the_rank() {
        let e = NcclError::Call {
            call: "ncclAllReduce",
            rank: Some(3),
            code: 2,
            name: "unhandled system error".into(),
            detail: "socket closed".into(),
        };
        let s = e.to_string();
        assert!(
            s.contains("rank 3") && s.contains("socket closed") && s.contains("ncclAllReduce"),
            "{s}"
        );
    }

    /// All local GPUs, one process: all-reduce sum/avg, reduce-scatter,
    /// all-gather, broadcast, then abort. Runs with 1 GPU too (world of 1).
    #[test]
    fn collectives_on_all_local_gpus() {
        let test = "nccl::collectives_on_all_local_gpus";
        if !gpu_or_skip(test) {
            return;
        }
        if !nccl_library_present() {
            let why = require_nccl().unwrap_err();
            crate::skip(test, &format!("libnccl is missing: {why}"));
            return;
        }
        eprintln!("NCCL version {:?}", nccl_version().unwrap());
        let n = crate::cuda_available().unwrap();
        let devs: Vec<CudaDevice> = (0..n).map(|i| CudaDevice::open(i).unwrap()).collect();
        let streams: Vec<CudaStream> = devs.iter().map(|d| CudaStream::comm(d).unwrap()).collect();
        let comms = NcclComm::init_all(&devs).unwrap();
        let len = 1024usize;
        let bufs: Vec<DeviceBuffer> = streams
            .iter()
            .enumerate()
            .map(|(r, s)| DeviceBuffer::from_host(s, &vec![(r + 1) as f32; len]).unwrap())
            .collect();
        let outs: Vec<DeviceBuffer> = streams
            .iter()
            .map(|s| DeviceBuffer::zeroed(s, len * 4 * n).unwrap())
            .collect();
        let sum = (n * (n + 1) / 2) as f32;
        // Sum, in place.
        group(|| {
            for ((c, b), s) in comms.iter().zip(&bufs).zip(&streams) {
                // SAFETY: b holds len floats on c's device; synced below.
                unsafe {
                    c.all_reduce(
                        b.device_ptr(),
                        b.device_ptr(),
                        len,
                        DataType::F32,
                        ReduceOp::Sum,
                        s,
                    )?
                };
            }
            Ok(())
        })
        .unwrap();
        for (b, s) in bufs.iter().zip(&streams) {
            assert!(b.to_host_vec::<f32>(s).unwrap().iter().all(|&x| x == sum));
        }
        // Avg, out of place.
        group(|| {
            for (((c, b), o), s) in comms.iter().zip(&bufs).zip(&outs).zip(&streams) {
                // SAFETY: as above; outs hold >= len floats.
                unsafe {
                    c.all_reduce(
                        b.device_ptr(),
                        o.device_ptr(),
                        len,
                        DataType::F32,
                        ReduceOp::Avg,
                        s,
                    )?
                };
            }
            Ok(())
        })
        .unwrap();
        for (o, s) in outs.iter().zip(&streams) {
            let v: Vec<f32> = o.to_host_vec(s).unwrap();
            assert!(v[..len].iter().all(|&x| (x - sum).abs() < 1e-6));
        }
        // All-gather then reduce-scatter back.
        group(|| {
            for (((c, b), o), s) in comms.iter().zip(&bufs).zip(&outs).zip(&streams) {
                // SAFETY: recv holds n·len floats.
                unsafe { c.all_gather(b.device_ptr(), o.device_ptr(), len, DataType::F32, s)? };
            }
            Ok(())
        })
        .unwrap();
        group(|| {
            for (((c, b), o), s) in comms.iter().zip(&bufs).zip(&outs).zip(&streams) {
                // SAFETY: send holds n·len floats, recv holds len.
                unsafe {
                    c.reduce_scatter(
                        o.device_ptr(),
                        b.device_ptr(),
                        len,
                        DataType::F32,
                        ReduceOp::Sum,
                        s,
                    )?
                };
            }
            Ok(())
        })
        .unwrap();
        for (b, s) in bufs.iter().zip(&streams) {
            assert!(b
                .to_host_vec::<f32>(s)
                .unwrap()
                .iter()
                .all(|&x| x == sum * n as f32));
        }
        // Broadcast from the last rank.
        group(|| {
            for ((c, o), s) in comms.iter().zip(&outs).zip(&streams) {
                // SAFETY: len floats.
                unsafe {
                    c.broadcast(o.device_ptr(), o.device_ptr(), len, DataType::F32, n - 1, s)?
                };
            }
            Ok(())
        })
        .unwrap();
        for s in &streams {
            s.synchronize().unwrap();
        }
        assert!(comms[0].async_error().is_ok());
        comms[0].abort().unwrap();
        assert!(comms[0].is_aborted());
        // SAFETY: rejected before reaching NCCL.
        let e = unsafe { comms[0].all_reduce(0, 0, 1, DataType::F32, ReduceOp::Sum, &streams[0]) }
            .unwrap_err();
        assert!(matches!(e, NcclError::Aborted { rank: 0 }), "{e}");
        for c in &comms[1..] {
            c.abort().unwrap();
        }
    }
}

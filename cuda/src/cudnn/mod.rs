//! cuDNN's fused attention: causal scaled dot-product attention (SDPA),
//! forward with its softmax statistics and backward, through cuDNN's
//! backend graph API on bf16 tensors laid out as GPT-2 keeps them.
//!
//! # Layout
//!
//! The input is GPT-2's fused `qkv`, `(B, T, 3, NH, HS)` row-major: Q, K and
//! V are `[B, NH, T, HS]` views of it with strides `[3·T·C, HS, 3·C, 1]`
//! (`C = NH·HS`), at element offsets 0, `C` and `2C`. The output and its
//! gradient are `(B, T, NH, HS)`: strides `[T·C, HS, C, 1]`. The gradient
//! of `qkv` has `qkv`'s layout and is written over (not accumulated). The
//! statistics are `ln Σ exp(scaled scores)` per row, `(B, NH, T)` f32: the
//! log-sum-exp Braid's own fused attention keeps, so either backward can
//! follow either forward.
//!
//! # State
//!
//! One [`CudnnAttention`] serves the streams it was made for: one cuDNN
//! handle, bound to a stream for each call under a mutex; execution plans
//! cached by shape and direction (built at a shape's first call: the graph,
//! cuDNN's heuristics, the first engine configuration that finalizes), and
//! the reasons of those that found no engine (a later call fails at once
//! with them: [`CudnnAttention::no_engine`]); and one workspace per stream,
//! grown to the largest plan's need on every stream when a plan is built
//! (an outgrown one is kept until the handle goes: a graph captured before
//! may still use it). A plan's first call must not happen inside a CUDA
//! graph capture (it allocates); the call refuses, naming the shape.
//!
//! # Graphs
//!
//! `graph` describes each direction up to three ways ([`GraphKind`]),
//! tried in the order of `BRAID_CUDNN_SDPA` (`auto`: unified, band, then
//! composite, each where the cuDNN found has what it needs; `unified`,
//! `band` or `composite`: only that one). The first that cuDNN's
//! heuristics find an engine for is kept, and [`CudnnAttention::describe`]
//! says which.

mod backend;
mod graph;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use cudarc::cudnn::sys;
use cudarc::driver::sys as drv;

pub use backend::cudnn_library_present;
use backend::{api, check, Desc, RawHandle, Value};
pub use graph::GraphKind;

use super::error::{CudaError, CudaResult, Named};
use super::memory::{DeviceBuffer, DevicePtr};
use super::stream::CudaStream;

/// The shape of one causal attention: `b` batch rows, `nh` heads of `hs`
/// channels, `t` positions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SdpaShape {
    /// Batch rows.
    pub b: usize,
    /// Positions (queries and keys alike).
    pub t: usize,
    /// Heads.
    pub nh: usize,
    /// Channels per head.
    pub hs: usize,
}

impl SdpaShape {
    fn c(&self) -> usize {
        self.nh * self.hs
    }
}

/// Forward or backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Direction {
    /// Output and statistics from Q, K, V.
    Forward,
    /// dQ, dK, dV from Q, K, V, the output, its gradient and the statistics.
    Backward,
}

/// A built execution plan and what its variant packs need.
struct Plan {
    plan: Desc,
    kind: GraphKind,
    /// By-value scalars, `(uid, value)`.
    scalars: Vec<(i64, f32)>,
    /// Workspace tensors before cuDNN's part: `(uid, byte offset)`.
    scratch: Vec<(i64, usize)>,
    /// Bytes of the workspace before cuDNN's part.
    scratch_bytes: usize,
    /// The engine's global index (`CUDNN_ATTR_ENGINE_GLOBAL_INDEX`), for
    /// reports.
    engine: i64,
    /// Bytes of the whole workspace: the scratch tensors, then cuDNN's.
    workspace: usize,
    /// The operation graph and the descriptors it refers to, kept alive
    /// with the plan.
    _keep: Vec<Desc>,
}

struct State {
    handle: RawHandle,
    /// The graph kinds to try, in order.
    kinds: Vec<GraphKind>,
    plans: HashMap<(SdpaShape, Direction), Arc<Plan>>,
    /// Why a shape's direction has no plan: every graph kind was tried and
    /// none found an engine. Kept so that a later call fails at once instead
    /// of asking cuDNN's heuristics again.
    no_engine: HashMap<(SdpaShape, Direction), String>,
    /// One per stream, by the stream's raw handle.
    workspaces: HashMap<usize, DeviceBuffer>,
    /// Workspaces a larger one replaced: kept until the handle goes, since
    /// a CUDA graph captured before may still use them.
    outgrown: Vec<DeviceBuffer>,
}

// SAFETY: the handle is used only under the mutex, one call at a time, with
// the device's context current; cuDNN handles may move between threads.
unsafe impl Send for State {}

/// cuDNN's fused causal attention for a set of streams (module docs).
pub struct CudnnAttention {
    state: Mutex<State>,
    streams: Vec<CudaStream>,
    version: usize,
}

impl std::fmt::Debug for CudnnAttention {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudnnAttention")
            .field("version", &self.version)
            .field("streams", &self.streams.len())
            .finish()
    }
}

impl Drop for CudnnAttention {
    fn drop(&mut self) {
        let st = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        st.plans.clear();
        let device = self.streams[0].device();
        let r = device.bind_to_thread().and_then(|()| {
            let api = api()?;
            // SAFETY: made by `cudnnCreate` in `new`, destroyed once; the
            // plans that used it are gone.
            let status = unsafe { (api.destroy)(st.handle) };
            check(status, "cudnnDestroy", "the attention's handle")
        });
        if let Err(e) = r {
            device.record_deferred(e);
        }
    }
}

/// For tests that need cuDNN on a GPU: as [`gpu_or_skip`](crate::gpu_or_skip),
/// and then libcudnn. Returns `true` when both are there; otherwise prints
/// why the test is skipped and returns `false`, or panics under
/// `BRAID_REQUIRE_GPU=1` (the GPU validation run, where PyTorch's cuDNN
/// wheel is expected).
pub fn cudnn_or_skip(test: &str) -> bool {
    crate::gpu_or_skip(test) && (cudnn_library_present() || crate::skip(test, "no libcudnn"))
}

/// The environment variable that picks the graph kinds to try (module docs).
pub const SDPA_ENV: &str = "BRAID_CUDNN_SDPA";

/// The values [`SDPA_ENV`] takes (empty or unset: `auto`).
pub const SDPA_CHOICES: [&str; 4] = ["auto", "unified", "band", "composite"];

/// The graphs to try, in order ([`SDPA_ENV`], module docs).
fn kinds() -> CudaResult<Vec<GraphKind>> {
    match std::env::var(SDPA_ENV).as_deref() {
        Err(_) | Ok("auto") | Ok("") => Ok(vec![
            GraphKind::Unified,
            GraphKind::Band,
            GraphKind::Composite,
        ]),
        Ok("unified") => Ok(vec![GraphKind::Unified]),
        Ok("band") => Ok(vec![GraphKind::Band]),
        Ok("composite") => Ok(vec![GraphKind::Composite]),
        Ok(other) => Err(CudaError::InvalidArgument(format!(
            "BRAID_CUDNN_SDPA={other}: expected auto, unified, band or composite"
        ))),
    }
}

impl CudnnAttention {
    /// A cuDNN handle for `streams` (all of one device), with no plans yet,
    /// trying the graph kinds `BRAID_CUDNN_SDPA` names (module docs).
    pub fn new(streams: &[CudaStream]) -> CudaResult<Self> {
        Self::with_kinds(streams, &kinds()?)
    }

    /// [`new`](Self::new) trying only `kinds`, in that order.
    pub fn with_kinds(streams: &[CudaStream], kinds: &[GraphKind]) -> CudaResult<Self> {
        let first = streams
            .first()
            .ok_or_else(|| CudaError::InvalidArgument("cuDNN attention with no stream".into()))?;
        for s in streams {
            first
                .device()
                .check_same(s.device(), "cuDNN attention stream")?;
        }
        let api = api()?;
        let version = backend::version()?;
        if version < 90000 {
            return Err(CudaError::LibraryMissing {
                library: "libcudnn",
                what: format!("cuDNN {} is older than 9", version_string(version)),
                hint: "install the nvidia-cudnn-cu13 wheel (cuDNN 9)",
            });
        }
        first.device().bind_to_thread()?;
        let mut handle: RawHandle = std::ptr::null_mut();
        // SAFETY: a valid out-pointer; the device's context is current.
        let status = unsafe { (api.create)(&mut handle) };
        check(status, "cudnnCreate", "a handle")?;
        Ok(CudnnAttention {
            state: Mutex::new(State {
                handle,
                kinds: kinds.to_vec(),
                plans: HashMap::new(),
                no_engine: HashMap::new(),
                workspaces: HashMap::new(),
                outgrown: Vec::new(),
            }),
            streams: streams.to_vec(),
            version,
        })
    }

    /// cuDNN's version, e.g. `"9.13.0"`.
    pub fn version(&self) -> String {
        version_string(self.version)
    }

    /// Whether cuDNN takes `shape`'s `direction` here: a head size that is
    /// a multiple of 8 up to 128; for a backward, `T` above 1 (cuDNN's
    /// backward engines refuse one position) and, on cuDNN 9.15.0 or
    /// older, a multiple of 128 (cudnn-frontend adds a padding mask to work
    /// around those releases otherwise, which is not built here).
    pub fn takes(&self, shape: SdpaShape, direction: Direction) -> bool {
        takes(self.version, shape, direction)
    }

    /// Why `shape`'s `direction` has no plan, if building it was tried and
    /// no graph kind found an engine (the error that call returned).
    pub fn no_engine(&self, shape: SdpaShape, direction: Direction) -> Option<String> {
        let st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        st.no_engine.get(&(shape, direction)).cloned()
    }

    /// What runs a shape's `direction` once it has run: the graph, cuDNN's
    /// engine index and the workspace, e.g. `"composite graph, engine 6, 0 B
    /// workspace"`.
    pub fn describe(&self, shape: SdpaShape, direction: Direction) -> Option<String> {
        let st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        st.plans.get(&(shape, direction)).map(|p| {
            format!(
                "{} graph, engine {}, {} B workspace",
                p.kind.name(),
                p.engine,
                p.workspace
            )
        })
    }

    /// Causal attention forward on `stream`: writes `out` `(B, T, NH, HS)`
    /// and `stats` `(B, NH, T)` f32 from `qkv` `(B, T, 3, NH, HS)`, all bf16
    /// but `stats` (module docs). `true` when this call built the shape's
    /// plan (then [`describe`](Self::describe) has something new to say).
    ///
    /// # Safety
    /// The pointers address device memory of `stream`'s device holding those
    /// shapes, 16-byte aligned, `out` and `stats` disjoint from everything
    /// else, and no other stream touches them until the work is done.
    pub unsafe fn forward(
        &self,
        stream: &CudaStream,
        shape: SdpaShape,
        qkv: DevicePtr,
        out: DevicePtr,
        stats: DevicePtr,
    ) -> CudaResult<bool> {
        let c = shape.c() as u64 * 2;
        let ptrs = graph::forward_pointers(qkv, qkv + c, qkv + 2 * c, out, stats);
        // SAFETY: the caller's contract.
        unsafe { self.run(stream, shape, Direction::Forward, &ptrs) }
    }

    /// Causal attention backward on `stream`: writes `dqkv` (`qkv`'s layout,
    /// written over) from `qkv`, the forward's `out` and `stats`, and `dout`
    /// (`out`'s layout). `true` when this call built the shape's plan.
    ///
    /// # Safety
    /// As [`forward`](Self::forward); `dqkv` disjoint from the inputs.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn backward(
        &self,
        stream: &CudaStream,
        shape: SdpaShape,
        qkv: DevicePtr,
        out: DevicePtr,
        dout: DevicePtr,
        stats: DevicePtr,
        dqkv: DevicePtr,
    ) -> CudaResult<bool> {
        let c = shape.c() as u64 * 2;
        let ptrs = graph::backward_pointers(graph::BackwardPointers {
            q: qkv,
            k: qkv + c,
            v: qkv + 2 * c,
            o: out,
            d_o: dout,
            stats,
            dq: dqkv,
            dk: dqkv + c,
            dv: dqkv + 2 * c,
        });
        // SAFETY: the caller's contract.
        unsafe { self.run(stream, shape, Direction::Backward, &ptrs) }
    }

    /// Runs `direction` for `shape` on `stream` with the tensors `ptrs`
    /// (unique id, device address), building its plan first if it has none
    /// (then `true`).
    unsafe fn run(
        &self,
        stream: &CudaStream,
        shape: SdpaShape,
        direction: Direction,
        ptrs: &[(i64, DevicePtr)],
    ) -> CudaResult<bool> {
        let key = stream.raw() as usize;
        if !self.streams.iter().any(|s| s.raw() as usize == key) {
            return Err(CudaError::InvalidArgument(
                "cuDNN attention on a stream it was not made for".into(),
            ));
        }
        check_shape(shape)?;
        if !self.takes(shape, direction) {
            return Err(CudaError::InvalidArgument(format!(
                "cuDNN {} does not take attention {direction:?} of {shape:?} here (a \
                 backward needs T above 1, and a multiple of 128 before 9.15.1)",
                self.version()
            )));
        }
        stream.device().bind_to_thread()?;
        let mut guard = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let st = &mut *guard;
        let (plan, built) = match st.plans.get(&(shape, direction)) {
            Some(p) => (p.clone(), false),
            None => {
                if let Some(why) = st.no_engine.get(&(shape, direction)) {
                    return Err(CudaError::InvalidArgument(why.clone()));
                }
                if capturing(stream)? {
                    return Err(CudaError::InvalidArgument(format!(
                        "cuDNN attention {direction:?} for {shape:?} first ran inside a CUDA \
                         graph capture: its plan and workspace must be made before (run the \
                         step once eagerly)"
                    )));
                }
                let plan = match build(st, shape, direction, self.version) {
                    Ok(p) => Arc::new(p),
                    Err(CudaError::InvalidArgument(why)) => {
                        st.no_engine.insert((shape, direction), why.clone());
                        return Err(CudaError::InvalidArgument(why));
                    }
                    Err(e) => return Err(e),
                };
                for s in &self.streams {
                    let k = s.raw() as usize;
                    if st
                        .workspaces
                        .get(&k)
                        .is_none_or(|w| w.len_bytes() < plan.workspace)
                    {
                        let w = DeviceBuffer::alloc(s, plan.workspace)?;
                        s.synchronize()?;
                        st.outgrown.extend(st.workspaces.insert(k, w));
                    }
                }
                st.plans.insert((shape, direction), plan.clone());
                (plan, true)
            }
        };
        let api = api()?;
        // SAFETY: a live handle, used under the mutex; cuDNN's
        // `cudaStream_t` is the driver's `CUstream`.
        let set = unsafe { (api.set_stream)(st.handle, stream.raw() as *mut c_void) };
        check(set, "cudnnSetStream", "the attention's stream")?;
        let base = st.workspaces.get(&key).map_or(0, |w| w.device_ptr());
        let (mut uids, mut data): (Vec<i64>, Vec<*mut c_void>) =
            ptrs.iter().map(|&(u, p)| (u, p as *mut c_void)).unzip();
        // By-value scalars are bound to host memory, read when the work is
        // enqueued: `values` outlives the call.
        let values: Vec<f32> = plan.scalars.iter().map(|&(_, v)| v).collect();
        for (&(uid, _), v) in plan.scalars.iter().zip(&values) {
            uids.push(uid);
            data.push((v as *const f32).cast_mut().cast());
        }
        for &(uid, offset) in &plan.scratch {
            uids.push(uid);
            data.push((base + offset as u64) as *mut c_void);
        }
        let workspace = (base + plan.scratch_bytes as u64) as *mut c_void;
        let pack =
            Desc::new(sys::cudnnBackendDescriptorType_t::CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR)?;
        use sys::cudnnBackendAttributeName_t as A;
        pack.set(
            A::CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS as u32,
            Value::I64(&uids),
        )?
        .set(
            A::CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS as u32,
            Value::Ptrs(&data),
        )?
        .set(
            A::CUDNN_ATTR_VARIANT_PACK_WORKSPACE as u32,
            Value::Ptrs(&[workspace]),
        )?;
        let pack = pack.finalize("the attention's variant pack")?;
        // SAFETY: the plan was built for this shape; the pack's pointers are
        // the caller's tensors (its contract), the host scalars (alive until
        // this returns: cuDNN reads by-value tensors when it enqueues), and
        // this stream's workspace of at least the plan's size.
        let st_exec = unsafe { (api.execute)(st.handle, plan.plan.raw(), pack.raw()) };
        check(
            st_exec,
            "cudnnBackendExecute",
            &format!("attention {direction:?} for {shape:?}"),
        )?;
        Ok(built)
    }
}

/// [`CudnnAttention::takes`] for cuDNN `version`.
fn takes(version: usize, shape: SdpaShape, direction: Direction) -> bool {
    let backward = direction == Direction::Backward;
    let old = version <= 91500 && shape.t % 128 != 0;
    check_shape(shape).is_ok() && !(backward && (shape.t == 1 || old))
}

/// `91300` as `"9.13.0"`.
fn version_string(v: usize) -> String {
    format!("{}.{}.{}", v / 10000, v / 100 % 100, v % 100)
}

/// Whether `stream` is capturing a CUDA graph.
fn capturing(stream: &CudaStream) -> CudaResult<bool> {
    let mut status = drv::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: a live stream, a valid out-pointer.
    unsafe { drv::cuStreamIsCapturing(stream.raw(), &mut status) }
        .result()
        .named("cuStreamIsCapturing")?;
    Ok(status != drv::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
}

/// Whether cuDNN's attention engines take head size `hs`: a multiple of 8
/// up to 128 (a caller may ask before loading cuDNN at all).
pub fn takes_head_size(hs: usize) -> bool {
    hs % 8 == 0 && hs <= 128
}

/// Refuses shapes cuDNN's engines do not take, before any descriptor.
fn check_shape(s: SdpaShape) -> CudaResult<()> {
    if s.b == 0 || s.t == 0 || s.nh == 0 {
        return Err(CudaError::InvalidArgument(format!(
            "cuDNN attention of an empty shape {s:?}"
        )));
    }
    if !takes_head_size(s.hs) {
        return Err(CudaError::InvalidArgument(format!(
            "cuDNN attention needs a head size that is a multiple of 8 up to 128, not {}",
            s.hs
        )));
    }
    Ok(())
}

/// Builds `direction`'s plan for `shape`: each graph kind in turn, each with
/// cuDNN's heuristics' engine configurations in order, until one finalizes.
/// The error names every kind's reason.
fn build(st: &State, shape: SdpaShape, direction: Direction, version: usize) -> CudaResult<Plan> {
    let mut why = Vec::new();
    for &kind in &st.kinds {
        let built = graph::build(st.handle, shape, direction, kind, version);
        match built.and_then(|g| plan_of(st.handle, g, kind)) {
            Ok(p) => return Ok(p),
            Err(e) => why.push(format!("{} graph: {e}", kind.name())),
        }
    }
    Err(CudaError::InvalidArgument(format!(
        "cuDNN {} has no engine for attention {direction:?} of {shape:?}: {}",
        version_string(version),
        why.join("; ")
    )))
}

/// The first engine configuration of cuDNN's heuristics (mode A, then the
/// fallback list) that makes an execution plan for `g`.
fn plan_of(handle: RawHandle, g: graph::Built, kind: GraphKind) -> CudaResult<Plan> {
    use sys::cudnnBackendAttributeName_t as A;
    use sys::cudnnBackendAttributeType_t as T;
    use sys::cudnnBackendDescriptorType_t as D;
    let mut errors = Vec::new();
    for mode in [
        sys::cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_A,
        sys::cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_FALLBACK,
    ] {
        let heur = Desc::new(D::CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR)?;
        heur.set(
            A::CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH as u32,
            Value::Descs(&[&g.graph]),
        )?
        .set(A::CUDNN_ATTR_ENGINEHEUR_MODE as u32, Value::heur(mode))?;
        let heur = match heur.finalize("the engine heuristics") {
            Ok(h) => h,
            Err(e) => {
                errors.push(e.to_string());
                continue;
            }
        };
        let n = heur.count(
            A::CUDNN_ATTR_ENGINEHEUR_RESULTS as u32,
            T::CUDNN_TYPE_BACKEND_DESCRIPTOR as u32,
        )?;
        let configs = (0..n.max(0))
            .map(|_| Desc::new(D::CUDNN_BACKEND_ENGINECFG_DESCRIPTOR))
            .collect::<CudaResult<Vec<_>>>()?;
        let got = heur.get_descs(A::CUDNN_ATTR_ENGINEHEUR_RESULTS as u32, &configs)?;
        for cfg in configs.into_iter().take(got) {
            let plan = Desc::new(D::CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR)?;
            plan.set(
                A::CUDNN_ATTR_EXECUTION_PLAN_HANDLE as u32,
                Value::Handle(handle),
            )?
            .set(
                A::CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG as u32,
                Value::Descs(&[&cfg]),
            )?;
            match plan.finalize("an execution plan") {
                Ok(plan) => {
                    let workspace =
                        plan.get_i64(A::CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE as u32)?;
                    let engine = engine_index(&cfg).unwrap_or(-1);
                    let (scratch, scratch_bytes) = lay_out(&g.scratch);
                    let mut keep = g.keep;
                    keep.push(g.graph);
                    keep.push(cfg);
                    return Ok(Plan {
                        plan,
                        kind,
                        scalars: g.scalars,
                        scratch,
                        scratch_bytes,
                        engine,
                        workspace: scratch_bytes + workspace.max(0) as usize,
                        _keep: keep,
                    });
                }
                Err(e) => errors.push(e.to_string()),
            }
        }
        if got == 0 {
            errors.push(format!("heuristics mode {mode:?} offered no engine"));
        }
    }
    Err(CudaError::InvalidArgument(errors.join("; ")))
}

/// Byte offsets of workspace tensors laid out in order, each 256-byte
/// aligned, and the bytes they take.
fn lay_out(tensors: &[(i64, usize)]) -> (Vec<(i64, usize)>, usize) {
    let mut at = 0usize;
    let placed = tensors
        .iter()
        .map(|&(uid, bytes)| {
            let here = at;
            at = (at + bytes).next_multiple_of(256);
            (uid, here)
        })
        .collect();
    (placed, at)
}

/// The global index of the engine an engine configuration holds.
fn engine_index(cfg: &Desc) -> CudaResult<i64> {
    use sys::cudnnBackendAttributeName_t as A;
    use sys::cudnnBackendDescriptorType_t as D;
    let engine = Desc::new(D::CUDNN_BACKEND_ENGINE_DESCRIPTOR)?;
    cfg.get_descs(
        A::CUDNN_ATTR_ENGINECFG_ENGINE as u32,
        std::slice::from_ref(&engine),
    )?;
    engine.get_i64(A::CUDNN_ATTR_ENGINE_GLOBAL_INDEX as u32)
}

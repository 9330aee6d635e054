//! The CUDA backend as the engine sees it: one CUDA stream per engine stream,
//! the task context handed to bodies, and the per-stream driver used by the
//! stream thread (events for cross-stream waits and for device timing).
//!
//! A CUDA stream thread *launches* its tasks: it makes its stream wait on the
//! end events of predecessors on other streams, records a start event, runs
//! the body (which enqueues kernels and returns at once), and records an end
//! event. A task is *complete* only when its end event has completed on the
//! device; until then it keeps its buffers alive (semantics 7) and counts
//! against the launch window.

use super::cuda::{
    cudnn::CudnnAttention, stream::StreamPriority, CublasHandle, CudaDevice, CudaError, CudaEvent,
    CudaStream, DeviceBuffer, EventKind, EventPool, GreenContext, Timeline,
};
use super::Check;
use crate::error::{Error, Result};
use std::cell::{OnceCell, RefCell};
use std::sync::{Arc, OnceLock};

/// Per-runtime CUDA state.
#[derive(Debug)]
pub(crate) struct CudaBackend {
    pub(crate) device: CudaDevice,
    /// One CUDA stream per engine stream: compute streams at normal priority,
    /// communication streams at the highest.
    pub(crate) streams: Vec<CudaStream>,
    /// The green context the compute streams run in, when the runtime
    /// spares SMs ([`crate::RuntimeBuilder::spare_sms`]).
    pub(crate) green: Option<GreenContext>,
    /// Allocations and frees are ordered on this stream.
    alloc_stream: CudaStream,
    pub(crate) events: EventPool,
    pub(crate) timeline: Arc<TimelineAt>,
    /// cuDNN's attention for every stream, made at its first use.
    cudnn: Arc<CudnnSlot>,
}

/// cuDNN's fused attention for a runtime's compute streams, made at the
/// first task that asks for it ([`CudaTaskCtx::cudnn_attention`]) and
/// shared by every stream thread and graph capture: its plans and
/// per-stream workspaces are made once, outside any capture.
#[derive(Debug)]
struct CudnnSlot {
    streams: Vec<CudaStream>,
    made: OnceLock<std::result::Result<CudnnAttention, CudaError>>,
}

/// A device timeline anchored on the process-wide host timeline.
#[derive(Debug)]
pub(crate) struct TimelineAt {
    pub(crate) timeline: Timeline,
    /// `trace::now_ns()` when the reference event was recorded.
    pub(crate) epoch_ns: u64,
}

/// The streams a runtime asks of its backend.
#[derive(Debug, Clone, Copy)]
pub(crate) struct StreamSet {
    pub(crate) compute: usize,
    pub(crate) comm: usize,
    pub(crate) class: crate::kind::Class,
    /// SMs the compute streams leave to other programs (0: none).
    pub(crate) spare_sms: u32,
}

impl CudaBackend {
    /// Opens device `ordinal` with the streams of `set`. A latency-critical
    /// runtime's compute streams get the highest priority too, so its
    /// kernels are scheduled before those of other programs' streams as
    /// soon as blocks free up. With SMs to spare, the compute streams are
    /// made in a green context over the others; the communication streams
    /// (whose collectives other ranks wait for) stay on every SM.
    pub(crate) fn open(ordinal: usize, set: StreamSet) -> Result<Self> {
        let device = CudaDevice::open(ordinal)?;
        let green = match set.spare_sms {
            0 => None,
            n => Some(
                GreenContext::all_but(&device, n)
                    .map_err(|e| Error::Config(format!("sparing {n} SMs (`spare_sms`): {e}")))?,
            ),
        };
        let priority = match set.class {
            crate::kind::Class::LatencyCritical => StreamPriority::High,
            _ => StreamPriority::Normal,
        };
        let mut streams = Vec::with_capacity(set.compute + set.comm);
        for _ in 0..set.compute {
            streams.push(match &green {
                Some(g) => CudaStream::in_green(g, priority)?,
                None => CudaStream::new(&device, priority)?,
            });
        }
        for _ in 0..set.comm {
            streams.push(CudaStream::comm(&device)?);
        }
        let alloc_stream = CudaStream::compute(&device)?;
        let epoch_ns = crate::clock::now_ns();
        let timeline = Timeline::start(&alloc_stream)?;
        alloc_stream.synchronize()?;
        let events = EventPool::new(&device, EventKind::Timing);
        // Compute streams only: they run the attention, and each gets a
        // workspace as large as the largest plan's.
        let cudnn = Arc::new(CudnnSlot {
            streams: streams[..set.compute].to_vec(),
            made: OnceLock::new(),
        });
        Ok(CudaBackend {
            device,
            streams,
            green,
            alloc_stream,
            events,
            timeline: Arc::new(TimelineAt { timeline, epoch_ns }),
            cudnn,
        })
    }

    /// Zeroed device memory, ready for use on any stream when this returns.
    pub(crate) fn alloc(&self, bytes: usize) -> Result<DeviceBuffer> {
        let b = DeviceBuffer::zeroed(&self.alloc_stream, bytes)?;
        self.alloc_stream.synchronize()?;
        Ok(b)
    }

    pub(crate) fn driver(&self, s: usize) -> StreamDriver {
        StreamDriver {
            stream: self.streams[s].clone(),
            events: self.events.clone(),
            timeline: self.timeline.clone(),
            cublas: OnceCell::new(),
            cudnn: self.cudnn.clone(),
        }
    }
}

/// What a CUDA stream thread owns.
pub(crate) struct StreamDriver {
    pub(crate) stream: CudaStream,
    pub(crate) events: EventPool,
    pub(crate) timeline: Arc<TimelineAt>,
    /// Created on first use, bound to this stream for the thread's life.
    pub(crate) cublas: OnceCell<CublasHandle>,
    cudnn: Arc<CudnnSlot>,
}

impl StreamDriver {
    pub(crate) fn ctx(&self) -> CudaTaskCtx<'_> {
        CudaTaskCtx {
            stream: &self.stream,
            cublas: &self.cublas,
            cudnn: &self.cudnn,
            checks: RefCell::new(Vec::new()),
            capture: None,
            marked: OnceCell::new(),
        }
    }

    /// The context of a body run while its stream is captured into a CUDA
    /// graph (`sched::capture`): what it registers for each launch of the
    /// graph goes into `hooks`.
    pub(crate) fn capture_ctx<'a>(
        &'a self,
        hooks: &'a RefCell<Vec<LaunchHook>>,
    ) -> CudaTaskCtx<'a> {
        CudaTaskCtx {
            capture: Some(hooks),
            ..self.ctx()
        }
    }

    pub(crate) fn record(&self) -> Result<CudaEvent> {
        Ok(self.events.record(&self.stream)?)
    }

    /// `(start_ns, end_ns)` on the process timeline of a completed span.
    pub(crate) fn span_ns(&self, start: &CudaEvent, end: &CudaEvent) -> Result<(u64, u64)> {
        let (s_ms, d_ms) = self.timeline.timeline.span_ms(start, end)?;
        let s = self.timeline.epoch_ns as f64 + s_ms * 1e6;
        Ok((s.max(0.0) as u64, (s + d_ms * 1e6).max(0.0) as u64))
    }
}

/// What a task body running on a CUDA stream gets: the stream (raw handle via
/// [`CudaStream::raw`]), a cuBLAS handle bound to it, and checks to run once
/// the task's work has completed ([`CudaTaskCtx::on_complete`]).
pub struct CudaTaskCtx<'a> {
    stream: &'a CudaStream,
    cublas: &'a OnceCell<CublasHandle>,
    cudnn: &'a CudnnSlot,
    checks: RefCell<Vec<Check>>,
    /// While captured into a CUDA graph: the hooks of each launch.
    capture: Option<&'a RefCell<Vec<LaunchHook>>>,
    /// [`CudaTaskCtx::mark`]'s event, once recorded.
    marked: OnceCell<Arc<CudaEvent>>,
}

/// What a body captured into a CUDA graph needs done on the host at each
/// launch of the graph (a collective's index, its watchdog and its
/// completion check: `comm`), registered with
/// [`CudaTaskCtx::on_graph_launch`].
pub(crate) trait GraphLaunch: Send + Sync {
    /// Before a launch, in the stream's order: an error stops the launch
    /// (the graph's task fails with it) and the hooks after this one are
    /// told [`GraphLaunch::skipped`].
    fn before(&self) -> Result<u64>;
    /// Once the launch is enqueued on `cu`'s stream; `token` is what
    /// [`GraphLaunch::before`] returned. May register completion checks.
    fn after(&self, token: u64, cu: &CudaTaskCtx<'_>) -> Result<()>;
    /// The launch will not happen, for `why`: a predecessor of the graph
    /// failed (the launch's `DependencyFailed`), or an earlier hook's
    /// `before` did (its error).
    fn skipped(&self, why: &crate::Error);
    /// The launch failed after this hook's `before` gave `token`: what
    /// it stood for will not run this time.
    fn not_launched(&self, token: u64, e: &Error);
}

/// A registered [`GraphLaunch`].
pub(crate) type LaunchHook = Arc<dyn GraphLaunch>;

impl std::fmt::Debug for CudaTaskCtx<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaTaskCtx")
            .field("stream", self.stream)
            .finish()
    }
}

impl<'a> CudaTaskCtx<'a> {
    /// The stream the task runs on.
    pub fn stream(&self) -> &'a CudaStream {
        self.stream
    }

    /// The device.
    pub fn device(&self) -> &'a CudaDevice {
        self.stream.device()
    }

    /// The stream's cuBLAS handle (created on first use).
    pub fn cublas(&self) -> Result<&'a CublasHandle> {
        if let Some(h) = self.cublas.get() {
            return Ok(h);
        }
        let h = CublasHandle::new(self.stream)?;
        let _ = self.cublas.set(h);
        Ok(self.cublas.get().expect("just set"))
    }

    /// cuDNN's fused attention for the runtime's compute streams (a call
    /// from a task on a communication stream is refused), made at the first
    /// call (a cuDNN handle; plans and workspaces at each shape's first
    /// use, which must not be inside a CUDA graph capture). An error says
    /// why cuDNN is not there (no `libcudnn`, a version before 9).
    pub fn cudnn_attention(&self) -> Result<&'a CudnnAttention> {
        let slot = self.cudnn;
        match slot.made.get_or_init(|| CudnnAttention::new(&slot.streams)) {
            Ok(a) => Ok(a),
            Err(e) => Err(e.clone().into()),
        }
    }

    /// Registers `check` to run once the task's end event has completed on
    /// the device; an error from it fails the task, as if the body had
    /// returned it. This is how asynchronous device-side failures (an aborted
    /// collective, say) reach the task whose work they were.
    pub fn on_complete(&self, check: impl FnOnce() -> Result<()> + Send + 'static) {
        self.checks.borrow_mut().push(Box::new(check));
    }

    pub(crate) fn take_checks(&self) -> Vec<Check> {
        std::mem::take(&mut *self.checks.borrow_mut())
    }

    /// An event recorded on the task's stream at the first call, the same
    /// one at later calls: what an NCCL collective's task hands its
    /// watchdog, and the collectives of one graph launch share (one event a
    /// launch rather than one per collective).
    pub(crate) fn mark(&self) -> Result<Arc<CudaEvent>> {
        if let Some(ev) = self.marked.get() {
            return Ok(ev.clone());
        }
        let ev = Arc::new(CudaEvent::recorded(self.stream, EventKind::Sync)?);
        let _ = self.marked.set(ev.clone());
        Ok(ev)
    }

    /// Whether the body is being captured into a CUDA graph: what it
    /// enqueues is recorded, not run, and runs at each launch of the graph.
    pub(crate) fn capturing(&self) -> bool {
        self.capture.is_some()
    }

    /// Registers `hook` to run at each launch of the graph being captured.
    /// Refused outside a capture.
    pub(crate) fn on_graph_launch(&self, hook: LaunchHook) -> Result<()> {
        match self.capture {
            Some(hooks) => {
                hooks.borrow_mut().push(hook);
                Ok(())
            }
            None => Err(Error::Config(
                "a graph-launch hook registered outside a capture".into(),
            )),
        }
    }
}

/// Copies device bytes at `ptr` into `dst`, on `stream`, and waits for them.
pub(crate) fn download(stream: &CudaStream, ptr: u64, dst: &mut [u8]) -> Result<()> {
    // SAFETY: `ptr..ptr+len` lies inside a live device buffer (a declared access
    // of the running task, which holds the buffer); `dst` is valid for writes
    // of its length and outlives the copy because we synchronise before return.
    unsafe { super::cuda::memory::memcpy_dtoh_async(dst.as_mut_ptr(), ptr, dst.len(), stream)? };
    stream.synchronize()?;
    Ok(())
}

/// Copies `src` to device bytes at `ptr`, on `stream`, and waits for it.
pub(crate) fn upload(stream: &CudaStream, ptr: u64, src: &[u8]) -> Result<()> {
    // SAFETY: as in `download`, with `src` valid for reads until the stream
    // synchronises.
    unsafe { super::cuda::memory::memcpy_htod_async(ptr, src.as_ptr(), src.len(), stream)? };
    stream.synchronize()?;
    Ok(())
}

pub(crate) fn device_error(op: &str, e: CudaError) -> Error {
    Error::Device {
        backend: "cuda",
        op: op.to_string(),
        message: e.to_string(),
    }
}

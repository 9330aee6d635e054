//! CUDA graphs by stream capture: [`Capture`] begins capturing on an origin
//! stream, other streams join it through events (fork), everything launched on
//! the joined streams from the capturing thread is recorded instead of run,
//! and [`Capture::finish`] ends the capture and instantiates the graph as a
//! [`CudaGraph`], launched as one unit on any stream of the device.
//!
//! The capture uses `CU_STREAM_CAPTURE_MODE_THREAD_LOCAL`: an API call that is
//! not allowed while capturing (a synchronisation, a `cuMemAlloc`) fails on
//! the capturing thread, and other threads are not affected. Every stream
//! that joined must rejoin the origin (an event recorded on it, waited for on
//! the origin) before the capture ends, or the driver refuses it
//! (`CUDA_ERROR_STREAM_CAPTURE_UNJOINED`). A capture dropped without
//! `finish` (an error on the way) is ended and its graph discarded, so the
//! streams leave capture mode whatever happens.

use cudarc::driver::{result, sys as drv};

use super::device::CudaDevice;
use super::error::{CudaResult, Named};
use super::stream::CudaStream;

/// A capture in progress on an origin stream.
pub struct Capture {
    origin: CudaStream,
    /// Set once ended (by `finish` or `Drop`).
    ended: bool,
}

impl std::fmt::Debug for Capture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Capture")
            .field("origin", &self.origin)
            .field("ended", &self.ended)
            .finish()
    }
}

impl Capture {
    /// Begins capturing the work launched on `origin` from this thread.
    pub fn begin(origin: &CudaStream) -> CudaResult<Self> {
        origin.device().bind_to_thread()?;
        // SAFETY: the stream is alive and its context current.
        unsafe {
            result::stream::begin_capture(
                origin.raw(),
                drv::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            )
        }
        .named("cuStreamBeginCapture")?;
        Ok(Capture {
            origin: origin.clone(),
            ended: false,
        })
    }

    /// The origin stream.
    pub fn origin(&self) -> &CudaStream {
        &self.origin
    }

    /// Ends the capture and instantiates the graph. Its kernels keep the
    /// priorities of the streams they were captured from
    /// (`CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY`: capture copies a
    /// stream's priority into each kernel node), not the priority of the
    /// stream the graph is launched into: a graph runs its kernels as the
    /// streams would have (a communication stream's collectives ahead of
    /// the compute streams' kernels, when both are in one graph).
    pub fn finish(mut self) -> CudaResult<CudaGraph> {
        self.ended = true;
        let device = self.origin.device().clone();
        device.bind_to_thread()?;
        // SAFETY: the origin is capturing (begun in `begin`, not yet ended).
        let graph = unsafe { result::stream::end_capture(self.origin.raw()) }
            .named("cuStreamEndCapture")?;
        let graph = GraphHandle { raw: graph, device };
        // A driver that refuses the flag (it dates from CUDA 11.7) gets the
        // graph without it: the launch stream's priority for every kernel,
        // as before the flag was used.
        let with = drv::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY;
        let instantiate = |flags| {
            // SAFETY: `graph` is a valid graph just returned by the driver.
            unsafe { result::graph::instantiate(graph.raw, flags) }
        };
        let exec = instantiate(with)
            .or_else(|_| instantiate(drv::CUgraphInstantiate_flags(0)))
            .named("cuGraphInstantiateWithFlags")?;
        Ok(CudaGraph {
            exec,
            _graph: graph,
        })
    }
}

impl Drop for Capture {
    fn drop(&mut self) {
        if self.ended {
            return;
        }
        let device = self.origin.device();
        let r = device.bind_to_thread().and_then(|()| {
            // SAFETY: the origin is capturing; ending it returns the (possibly
            // invalidated) graph, which we destroy, or an error.
            match unsafe { result::stream::end_capture(self.origin.raw()) } {
                Ok(g) if !g.is_null() => {
                    // SAFETY: a graph the driver just handed us, used nowhere else.
                    unsafe { result::graph::destroy(g) }.named("cuGraphDestroy")
                }
                // An invalidated capture ends with an error: nothing to free.
                _ => Ok(()),
            }
        });
        if let Err(e) = r {
            device.record_deferred(e);
        }
    }
}

/// The captured graph, destroyed after its executable.
struct GraphHandle {
    raw: drv::CUgraph,
    device: CudaDevice,
}

impl Drop for GraphHandle {
    fn drop(&mut self) {
        let r = self.device.bind_to_thread().and_then(|()| {
            // SAFETY: owned, used by nothing else (its executable is gone).
            unsafe { result::graph::destroy(self.raw) }.named("cuGraphDestroy")
        });
        if let Err(e) = r {
            self.device.record_deferred(e);
        }
    }
}

/// An instantiated CUDA graph: the captured work, launched as one unit.
pub struct CudaGraph {
    exec: drv::CUgraphExec,
    // Declared after `exec`: dropped after the executable is destroyed.
    _graph: GraphHandle,
}

// SAFETY: graph and executable handles are driver objects usable from any
// thread with the context current; every method binds it first. The driver
// serialises launches of one executable.
unsafe impl Send for CudaGraph {}
// SAFETY: see `Send`; `&CudaGraph` only passes the immutable handle.
unsafe impl Sync for CudaGraph {}
// SAFETY: as for `CudaGraph`.
unsafe impl Send for GraphHandle {}
// SAFETY: as for `CudaGraph`.
unsafe impl Sync for GraphHandle {}

impl std::fmt::Debug for CudaGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaGraph")
            .field("exec", &self.exec)
            .finish()
    }
}

impl CudaGraph {
    /// Launches the graph on `stream`: it starts after the work queued on
    /// `stream` so far, and work queued later waits for all of it.
    pub fn launch(&self, stream: &CudaStream) -> CudaResult<()> {
        self._graph
            .device
            .check_same(stream.device(), "graph launch stream")?;
        stream.device().bind_to_thread()?;
        // SAFETY: executable and stream alive, in the current context.
        unsafe { result::graph::launch(self.exec, stream.raw()) }.named("cuGraphLaunch")
    }

    /// Uploads the executable to the device ahead of its first launch.
    pub fn upload(&self, stream: &CudaStream) -> CudaResult<()> {
        stream.device().bind_to_thread()?;
        // SAFETY: as in `launch`.
        unsafe { result::graph::upload(self.exec, stream.raw()) }.named("cuGraphUpload")
    }
}

impl Drop for CudaGraph {
    fn drop(&mut self) {
        let device = &self._graph.device;
        let r = device.bind_to_thread().and_then(|()| {
            // SAFETY: owned; a pending launch keeps its resources alive until
            // it completes (the driver defers the release).
            unsafe { result::graph::exec_destroy(self.exec) }.named("cuGraphExecDestroy")
        });
        if let Err(e) = r {
            device.record_deferred(e);
        }
    }
}

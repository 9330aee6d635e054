//! Backends: one closed enum at the boundary, the way candle's `Storage` does
//! it. Users pick a [`BackendKind`]; nothing in the public API is generic over
//! a backend.

pub(crate) mod cpu;
pub(crate) mod gpu;

/// The CUDA layer (crate `braid-cuda`) under the path engine code uses for it;
/// [`gpu`] is the engine's glue on top of it.
pub(crate) use braid_cuda as cuda;

use crate::error::{Error, Result};
use std::marker::PhantomData;

/// A check run once a task's work has completed (see
/// [`TaskCtx::on_complete`](crate::TaskCtx::on_complete)); an error fails the task.
pub(crate) type Check = Box<dyn FnOnce() -> Result<()> + Send + 'static>;

/// Which device a runtime drives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BackendKind {
    /// CUDA when a driver and a device are present, the CPU otherwise.
    #[default]
    Auto,
    /// Host threads as streams, host memory as buffers.
    Cpu,
    /// The CUDA device with this ordinal.
    Cuda {
        /// Device ordinal.
        device: usize,
    },
}

impl std::str::FromStr for BackendKind {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(BackendKind::Auto),
            "cpu" => Ok(BackendKind::Cpu),
            "cuda" | "gpu" => Ok(BackendKind::Cuda { device: 0 }),
            _ => match s.strip_prefix("cuda:").map(str::parse) {
                Some(Ok(device)) => Ok(BackendKind::Cuda { device }),
                _ => Err(Error::Config(format!(
                    "unknown device `{s}` (expected auto, cpu, cuda or cuda:N)"
                ))),
            },
        }
    }
}

impl From<cuda::CudaError> for Error {
    fn from(e: cuda::CudaError) -> Self {
        match e {
            cuda::CudaError::LibraryMissing { .. } => Error::BackendUnavailable {
                backend: "cuda",
                reason: e.to_string(),
            },
            e => Error::Device {
                backend: "cuda",
                op: "cuda".into(),
                message: e.to_string(),
            },
        }
    }
}

/// The storage behind a buffer.
#[derive(Debug)]
pub(crate) enum Storage {
    Host(cpu::HostMem),
    Device(cuda::DeviceBuffer),
}

impl Storage {
    pub(crate) fn host_ptr(&self) -> Option<*mut u8> {
        match self {
            Storage::Host(m) => Some(m.ptr()),
            Storage::Device(_) => None,
        }
    }

    pub(crate) fn device_ptr(&self, offset: usize) -> Option<u64> {
        match self {
            Storage::Host(_) => None,
            Storage::Device(b) => Some(b.device_ptr() + offset as u64),
        }
    }

    pub(crate) fn device_name(&self) -> &'static str {
        match self {
            Storage::Host(_) => "the host",
            Storage::Device(_) => "a CUDA device",
        }
    }
}

/// What the scheduler hands a body for its device: nothing on the CPU, the
/// stream it runs on (and its cuBLAS handle) on CUDA.
#[derive(Debug)]
pub(crate) enum DeviceCtx<'a> {
    /// The task runs on a host stream thread.
    Cpu(PhantomData<&'a ()>),
    /// The task runs on a CUDA stream.
    Cuda(gpu::CudaTaskCtx<'a>),
}

impl DeviceCtx<'_> {
    /// The CUDA context of the task, if it runs on CUDA.
    pub(crate) fn cuda(&self) -> Option<&gpu::CudaTaskCtx<'_>> {
        match self {
            DeviceCtx::Cpu(_) => None,
            DeviceCtx::Cuda(c) => Some(c),
        }
    }
}

/// The engine's view of a backend.
#[derive(Debug)]
pub(crate) enum Backend {
    Cpu,
    Cuda(gpu::CudaBackend),
}

impl Backend {
    pub(crate) fn open(kind: BackendKind, set: gpu::StreamSet) -> Result<Self> {
        match kind {
            BackendKind::Cpu => Ok(Backend::Cpu),
            BackendKind::Auto => match cuda::cuda_available() {
                Ok(n) if n > 0 => Ok(Backend::Cuda(gpu::CudaBackend::open(0, set)?)),
                _ => Ok(Backend::Cpu),
            },
            BackendKind::Cuda { device } => {
                let n = cuda::cuda_available()?;
                if device >= n {
                    return Err(Error::BackendUnavailable {
                        backend: "cuda",
                        reason: format!("device {device} requested, {n} present"),
                    });
                }
                Ok(Backend::Cuda(gpu::CudaBackend::open(device, set)?))
            }
        }
    }

    pub(crate) fn name(&self) -> &'static str {
        match self {
            Backend::Cpu => "cpu",
            Backend::Cuda(_) => "cuda",
        }
    }

    pub(crate) fn alloc(&self, bytes: usize) -> Result<Storage> {
        match self {
            Backend::Cpu => Ok(Storage::Host(cpu::HostMem::zeroed(bytes)?)),
            Backend::Cuda(c) => Ok(Storage::Device(c.alloc(bytes)?)),
        }
    }
}

//! Backends: one closed enum at the boundary, the way candle's `Storage` does
//! it. Users pick a [`BackendKind`]; nothing in the public API is generic over
//! a backend.

pub(crate) mod cpu;

use crate::error::{Error, Result};
use std::marker::PhantomData;

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

/// The storage behind a buffer.
#[derive(Debug)]
pub(crate) enum Storage {
    Host(cpu::HostMem),
}

impl Storage {
    pub(crate) fn host_ptr(&self) -> Option<*mut u8> {
        match self {
            Storage::Host(m) => Some(m.ptr()),
        }
    }

    pub(crate) fn device_ptr(&self, _offset: usize) -> Option<u64> {
        match self {
            Storage::Host(_) => None,
        }
    }

    pub(crate) fn device_name(&self) -> &'static str {
        match self {
            Storage::Host(_) => "the host",
        }
    }
}

/// What a task body gets for its device: nothing extra on the CPU, the raw
/// stream (and library handles) on CUDA.
#[derive(Debug)]
#[non_exhaustive]
pub enum DeviceCtx<'a> {
    /// The task runs on a host stream thread.
    Cpu(PhantomData<&'a ()>),
}

impl DeviceCtx<'_> {
    /// Whether the task runs on the CPU backend.
    pub fn is_cpu(&self) -> bool {
        matches!(self, DeviceCtx::Cpu(_))
    }
}

/// The engine's view of a backend.
#[derive(Debug)]
pub(crate) enum Backend {
    Cpu,
}

impl Backend {
    pub(crate) fn open(kind: BackendKind) -> Result<Self> {
        match kind {
            BackendKind::Auto | BackendKind::Cpu => Ok(Backend::Cpu),
            BackendKind::Cuda { .. } => Err(Error::BackendUnavailable {
                backend: "cuda",
                reason: "this build's CUDA backend is not wired yet".into(),
            }),
        }
    }

    pub(crate) fn name(&self) -> &'static str {
        match self {
            Backend::Cpu => "cpu",
        }
    }

    pub(crate) fn alloc(&self, bytes: usize) -> Result<Storage> {
        match self {
            Backend::Cpu => Ok(Storage::Host(cpu::HostMem::zeroed(bytes)?)),
        }
    }
}

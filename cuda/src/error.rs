//! The one error type of the CUDA layer.
//!
//! Every foreign call is checked where it is made: through a function of
//! cudarc's checked layer (`cudarc::driver::result`, `cudarc::nvrtc::result`,
//! `cudarc::cublas::result`, `cudarc::cublaslt::result`) or, where that layer has none, the raw call's
//! `.result()`; then `Named::named` turns cudarc's bare status error into a
//! [`CudaError`] naming the call that failed and carrying the library's own
//! message (`cuGetErrorName`/`cuGetErrorString`, `nvrtcGetErrorString`, the
//! cuBLAS status name). NVRTC compile failures carry the program log.

use cudarc::cublas::result::CublasError;
use cudarc::driver::result::DriverError;
use cudarc::driver::sys as drv;
use cudarc::nvrtc::result::NvrtcError;
use cudarc::nvrtc::sys as nv;

/// Everything that can go wrong in the CUDA backend.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum CudaError {
    /// A CUDA library could not be loaded (dynamic loading found no file).
    #[error("{library} could not be loaded ({what}); {hint}")]
    LibraryMissing {
        /// `"libcuda (the NVIDIA driver)"`, `"libnvrtc"`, `"libcublas"`, `"libnccl"`.
        library: &'static str,
        /// What was tried.
        what: String,
        /// What to do about it.
        hint: &'static str,
    },

    /// A driver API call returned an error status.
    #[error("CUDA driver call {call} failed: {name} ({code}): {message}")]
    Driver {
        /// The driver function, e.g. `"cuMemAllocAsync"`.
        call: &'static str,
        /// Raw `CUresult` value.
        code: i32,
        /// `cuGetErrorName`, e.g. `CUDA_ERROR_OUT_OF_MEMORY`.
        name: String,
        /// `cuGetErrorString`.
        message: String,
    },

    /// NVRTC rejected a kernel source. `log` is NVRTC's full program log.
    #[error("NVRTC failed to compile `{program}` for {arch}:\n{log}")]
    Compile {
        /// Program name (usually the `.cu` file name).
        program: String,
        /// `sm_XY` it was compiled for.
        arch: String,
        /// The compiler log, verbatim.
        log: String,
    },

    /// Any other NVRTC API failure (not a compile error).
    #[error("NVRTC call {call} failed: {message}")]
    Nvrtc {
        /// The NVRTC function.
        call: &'static str,
        /// `nvrtcGetErrorString`-like text.
        message: String,
    },

    /// A cuBLAS call failed.
    #[error("cuBLAS call {call} failed: {status}")]
    Cublas {
        /// The cuBLAS function.
        call: &'static str,
        /// The status name, e.g. `CUBLAS_STATUS_INVALID_VALUE`.
        status: String,
    },

    /// A cuDNN call failed (its backend API names what it was building).
    #[error("cuDNN call {call} failed on {what}: {status}{}", if message.is_empty() { String::new() } else { format!(": {message}") })]
    Cudnn {
        /// The cuDNN function.
        call: &'static str,
        /// What was being set, finalized or run.
        what: String,
        /// `cudnnGetErrorString` of the status.
        status: String,
        /// `cudnnGetLastErrorString`: cuDNN's own explanation, if any.
        message: String,
    },

    /// A module has no kernel of this name (check `extern "C"`).
    #[error("kernel `{kernel}` not found in module `{module}` (is it declared extern \"C\" __global__?)")]
    KernelNotFound {
        /// Module (program) name.
        module: String,
        /// Requested kernel name.
        kernel: String,
    },

    /// The device ordinal does not exist.
    #[error("CUDA device {ordinal} does not exist ({count} device(s) visible)")]
    NoSuchDevice {
        /// Requested ordinal.
        ordinal: usize,
        /// Devices visible to this process.
        count: usize,
    },

    /// A byte range fell outside a buffer.
    #[error("range {offset}..{offset}+{len} is outside a device buffer of {size} bytes")]
    OutOfBounds {
        /// Start of the range in bytes.
        offset: usize,
        /// Length of the range in bytes.
        len: usize,
        /// Size of the buffer in bytes.
        size: usize,
    },

    /// Objects from two different devices were mixed in one call.
    #[error("device mismatch: {what} is on device {got}, expected device {expected}")]
    DeviceMismatch {
        /// What was mismatched.
        what: &'static str,
        /// The device expected.
        expected: usize,
        /// The device found.
        got: usize,
    },

    /// An argument was rejected before reaching CUDA.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    /// A CUDA library panicked inside cudarc (e.g. a missing symbol in an old library).
    #[error("cudarc panicked during {during}: {message}")]
    Panicked {
        /// What was being done.
        during: &'static str,
        /// The panic payload, when it was a string.
        message: String,
    },

    /// An I/O error in the on-disk kernel cache (never fatal for compilation itself).
    #[error("kernel cache I/O error at {path}: {message}")]
    CacheIo {
        /// The file or directory.
        path: String,
        /// The OS error.
        message: String,
    },
}

impl CudaError {
    /// True when this is `CUDA_ERROR_NOT_READY` (work still pending), which
    /// queries report as "not yet" rather than as failure.
    pub fn is_not_ready(&self) -> bool {
        matches!(self, CudaError::Driver { code, .. } if *code == drv::CUresult::CUDA_ERROR_NOT_READY as i32)
    }

    /// True when this is an out-of-memory error from the driver.
    pub fn is_out_of_memory(&self) -> bool {
        matches!(self, CudaError::Driver { code, .. } if *code == drv::CUresult::CUDA_ERROR_OUT_OF_MEMORY as i32)
    }
}

/// Result alias of the CUDA layer.
pub type CudaResult<T> = Result<T, CudaError>;

/// Names the call behind a result of cudarc's checked layer.
///
/// cudarc's `result` modules (and the `.result()` methods on the raw status
/// enums) already turn a status into `Result<T, DriverError>` (or `CublasError`,
/// `NvrtcError`); that error carries only the status code. `.named("cuFoo")`
/// turns it into a [`CudaError`] that says which call failed, with the
/// library's own description of the status.
pub(crate) trait Named<T> {
    /// Converts the error, naming `call` as the call that failed.
    fn named(self, call: &'static str) -> CudaResult<T>;
}

impl<T> Named<T> for Result<T, DriverError> {
    #[inline]
    fn named(self, call: &'static str) -> CudaResult<T> {
        self.map_err(|e| driver_error(call, e))
    }
}

impl<T> Named<T> for Result<T, CublasError> {
    #[inline]
    fn named(self, call: &'static str) -> CudaResult<T> {
        self.map_err(|e| CudaError::Cublas {
            call,
            status: format!("{:?}", e.0),
        })
    }
}

impl<T> Named<T> for Result<T, cudarc::cublaslt::result::CublasError> {
    #[inline]
    fn named(self, call: &'static str) -> CudaResult<T> {
        self.map_err(|e| CudaError::Cublas {
            call,
            status: format!("{:?}", e.0),
        })
    }
}

impl<T> Named<T> for Result<T, NvrtcError> {
    #[inline]
    fn named(self, call: &'static str) -> CudaResult<T> {
        self.map_err(|e| CudaError::Nvrtc {
            call,
            message: nvrtc_message(e.0),
        })
    }
}

/// Builds a [`CudaError::Driver`] with the driver's name and description of
/// the status (`cuGetErrorName`, `cuGetErrorString`).
#[cold]
fn driver_error(call: &'static str, e: DriverError) -> CudaError {
    // `error_name`/`error_string` call the driver: it is loaded, since the
    // status came from it. The strings are static storage owned by the driver.
    let name = e
        .error_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|_| format!("{:?}", e.0));
    let message = e
        .error_string()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|_| "unknown error".to_string());
    CudaError::Driver {
        call,
        code: e.0 as i32,
        name,
        message,
    }
}

/// `nvrtcGetErrorString` of a status (cudarc's `NvrtcError` shows only the
/// enum name).
#[cold]
pub(crate) fn nvrtc_message(status: nv::nvrtcResult) -> String {
    // SAFETY: NVRTC is loaded (the status came from it); nvrtcGetErrorString
    // returns a static NUL-terminated string for any status.
    let p = unsafe { nv::nvrtcGetErrorString(status) };
    if p.is_null() {
        format!("{status:?}")
    } else {
        // SAFETY: non-null static string.
        unsafe { std::ffi::CStr::from_ptr(p) }
            .to_string_lossy()
            .into_owned()
    }
}

/// Runs `f`, turning a panic inside cudarc (missing library or symbol) into an error.
pub(crate) fn catch_panic<T>(
    during: &'static str,
    f: impl FnOnce() -> CudaResult<T>,
) -> CudaResult<T> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(payload) => {
            let message = if let Some(s) = payload.downcast_ref::<&str>() {
                (*s).to_string()
            } else if let Some(s) = payload.downcast_ref::<String>() {
                s.clone()
            } else {
                "non-string panic payload".to_string()
            };
            Err(CudaError::Panicked { during, message })
        }
    }
}

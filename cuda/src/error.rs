//! The one error type of the CUDA layer.
//!
//! Every foreign call goes through a `check_*` function here, which turns the raw
//! status into a [`CudaError`] naming the call that failed and carrying the
//! library's own message (`cuGetErrorName`/`cuGetErrorString`, the NVRTC log,
//! `cublasGetStatusString`).

use cudarc::cublas::sys as cublas_sys;
use cudarc::driver::sys as drv;

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

/// Checks a driver status, naming the call on failure.
#[inline]
pub(crate) fn check(call: &'static str, status: drv::CUresult) -> CudaResult<()> {
    if status == drv::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(driver_error(call, status))
    }
}

/// Builds a [`CudaError::Driver`] with the driver's name and description.
#[cold]
pub(crate) fn driver_error(call: &'static str, status: drv::CUresult) -> CudaError {
    let (name, message) = describe(status);
    CudaError::Driver {
        call,
        code: status as i32,
        name,
        message,
    }
}

fn describe(status: drv::CUresult) -> (String, String) {
    use std::ffi::CStr;
    let mut name_ptr: *const std::ffi::c_char = std::ptr::null();
    let mut msg_ptr: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: the driver library is loaded (we only get a status from it after
    // loading); both out-pointers are valid for one write; the returned strings
    // are static storage owned by the driver.
    let (n, m) = unsafe {
        (
            drv::cuGetErrorName(status, &mut name_ptr),
            drv::cuGetErrorString(status, &mut msg_ptr),
        )
    };
    let name = if n == drv::CUresult::CUDA_SUCCESS && !name_ptr.is_null() {
        // SAFETY: non-null, NUL-terminated static string from the driver.
        unsafe { CStr::from_ptr(name_ptr) }
            .to_string_lossy()
            .into_owned()
    } else {
        format!("{status:?}")
    };
    let message = if m == drv::CUresult::CUDA_SUCCESS && !msg_ptr.is_null() {
        // SAFETY: as above.
        unsafe { CStr::from_ptr(msg_ptr) }
            .to_string_lossy()
            .into_owned()
    } else {
        "unknown error".to_string()
    };
    (name, message)
}

/// Checks a cuBLAS status, naming the call on failure.
#[inline]
pub(crate) fn check_cublas(
    call: &'static str,
    status: cublas_sys::cublasStatus_t,
) -> CudaResult<()> {
    if status == cublas_sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(CudaError::Cublas {
            call,
            status: format!("{status:?}"),
        })
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

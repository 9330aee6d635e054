//! Braid's CUDA layer (crate `braid-cuda`): devices, streams, events, memory,
//! NVRTC kernels, cuBLAS and NCCL, over `cudarc` with dynamic loading. It knows
//! nothing of the engine; the engine (crate `braid`) builds its CUDA backend on
//! it and re-exports it as `braid::cuda`.
//!
//! # Layering
//!
//! Three layers, as in cudarc itself:
//!
//! 1. **raw**: `cudarc::{driver, nvrtc, cublas, nccl}::sys` — the foreign
//!    functions, resolved lazily from the shared libraries at first use;
//! 2. **checked**: cudarc's own checked layer — the `result` modules
//!    (`cudarc::driver::result::stream::create_with_priority`,
//!    `cudarc::nvrtc::result::compile_program`, …) and, for the few calls it does
//!    not wrap (`cuStreamQuery`, `cuMemsetD32Async`, the CUBIN getters,
//!    `cublasSetMathMode`, …), the raw status's `.result()`. Its errors carry
//!    only a status code, so every call site names itself (`.named("cuFoo")`),
//!    and a failure becomes a [`CudaError`] naming the call and carrying the
//!    library's message;
//! 3. **safe RAII types**: [`CudaDevice`], [`CudaStream`], [`CudaEvent`] /
//!    [`EventPool`], [`DeviceBuffer`], [`PinnedHostBuffer`],
//!    [`CudaModule`]/[`CudaFunction`], [`CublasHandle`] and [`nccl::NcclComm`].
//!    These (and `unsafe` functions taking them, such as
//!    [`memory::memcpy_htod_async`]) are what crosses module boundaries. Each
//!    owns its handle and releases it in `Drop`; errors found in `Drop` are
//!    recorded on the device ([`CudaDevice::take_deferred_errors`]) so the engine
//!    can report them at its next synchronisation point.
//!
//! We do **not** use cudarc's safe layer (`CudaContext`, `CudaStream`,
//! `CudaSlice`, …). By default it tracks read/write events per slice, which is
//! the engine's job here (Semantics 3 and 4) and would double the event traffic.
//! `CudaContext::disable_event_tracking` turns that off, but the rest still does
//! not fit: its `Drop` impls record only the last error *code* per context (we
//! keep every error, naming its call), a `CudaSlice` is freed on the one stream
//! it belongs to (the engine frees after the last uses on several streams,
//! [`DeviceBuffer::free_after`]), events are created one by one (the engine
//! recycles two per task through an [`EventPool`]), and opening a context leaves
//! the memory pool's release threshold at the driver's default.
//!
//! # Threads and contexts
//!
//! Every device is used through its *primary context*; a [`GreenContext`]
//! (part of the device's SMs) only makes streams, which use the primary
//! context's memory and modules (see [`green`]). All handles are plain
//! driver objects, usable from any thread once the context is current there, so
//! the types are `Send + Sync`. Every method that calls the driver first calls
//! [`CudaDevice::bind_to_thread`] (one `cuCtxGetCurrent`, a thread-local read in
//! the driver, and a `cuCtxSetCurrent` only when another context is current), so a
//! stream-driver thread needs no setup; calling `bind_to_thread` once when the
//! thread starts is still good practice since cuBLAS and NCCL calls made through
//! raw handles rely on it.
//!
//! # No driver, no panic
//!
//! cudarc panics when a library is missing. Every entry point here checks for the
//! library first ([`driver_library_present`] and friends,
//! [`nccl::nccl_library_present`]) and returns [`CudaError::LibraryMissing`]
//! instead; calls that could still panic inside cudarc (a symbol missing from an
//! old library) are wrapped in `catch_unwind`. [`cuda_available`] is the cheap
//! "is there a GPU?" probe for tests and for the backend selection.

#![deny(unsafe_op_in_unsafe_fn)]

pub mod cublas;
mod cublaslt;
pub mod cudnn;
pub mod device;
pub mod error;
pub mod event;
mod gemm;
pub mod graph;
pub mod green;
pub mod memory;
pub mod nccl;
pub mod nvrtc;
pub mod stream;

pub use cublas::{CublasHandle, Epilogue, Gemm, Transpose};
pub use device::{CudaDevice, PoolStats};
pub use error::{CudaError, CudaResult};
pub use event::{CudaEvent, EventKind, EventPool, Timeline};
pub use graph::{Capture, CudaGraph};
pub use green::GreenContext;
pub use memory::{DeviceBuffer, DevicePtr, DeviceRepr, PinnedHostBuffer};
pub use nvrtc::{
    compile, compile_with_headers, CompileOptions, CompiledKernel, CudaFunction, CudaModule,
    Header, KernelArgs, KernelCache, LaunchConfig,
};
pub use stream::{AsRawStream, CudaStream, RawStream, StreamPriority};

use std::sync::OnceLock;

use cudarc::driver::{result as drv_result, sys as drv};
use error::Named;

/// CUDA C sources of the engine's own test kernels (`cuda/kernels/`), for
/// [`KernelCache::module`]: `spin` / `spin_then_add` (busy-wait `clock64()`
/// cycles, for overlap tests) and `axpb`, `axpb_inplace`, `axpb_sum`, `fill`
/// (deterministic f32 arithmetic for the random-program property test; see the
/// comments in the files for exact semantics and launch shapes).
pub mod test_kernels {
    /// `cuda/kernels/spin.cu`.
    pub const SPIN: &str = include_str!("../kernels/spin.cu");
    /// `cuda/kernels/axpb.cu`.
    pub const AXPB: &str = include_str!("../kernels/axpb.cu");
}

/// CUDA C sources of the engine's own kernels (`cuda/kernels/`), compiled at
/// first use through [`KernelCache`].
pub mod engine_kernels {
    use crate::Header;

    /// `cuda/kernels/sparse_rows.cu`: the gradient reducer's row
    /// contributions (`sparse_rows_links`, `sparse_rows_add_f32`,
    /// `sparse_rows_add_bf16`). Includes [`HEADERS`].
    pub const SPARSE_ROWS: &str = include_str!("../kernels/sparse_rows.cu");

    /// The engine's shared CUDA headers, `(name, text)`, to hand NVRTC with
    /// any program that includes them (the model crates' programs too):
    /// `row_links.cuh`, the chains of repeated ids deterministic
    /// scatter-adds walk; `mma.cuh`, the bf16 tensor-core instructions.
    pub const HEADERS: &[Header<'static>] = &[ROW_LINKS_CUH, MMA_CUH];

    /// `cuda/kernels/row_links.cuh`, as an NVRTC header.
    pub const ROW_LINKS_CUH: Header<'static> =
        ("row_links.cuh", include_str!("../kernels/row_links.cuh"));

    /// `cuda/kernels/mma.cuh`, as an NVRTC header.
    pub const MMA_CUH: Header<'static> = ("mma.cuh", include_str!("../kernels/mma.cuh"));
}

/// Where users are told to look when the driver is missing.
const DRIVER_HINT: &str =
    "no NVIDIA driver is installed on this machine, or libcuda.so.1 is not on the loader path";

/// True when the CUDA driver library (`libcuda.so`) can be loaded. Cached.
pub fn driver_library_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    *PRESENT.get_or_init(|| {
        // SAFETY: `is_culib_present` only tries `dlopen` on cudarc's candidate
        // names and closes them again; it has no other precondition.
        std::panic::catch_unwind(|| unsafe { drv::is_culib_present() }).unwrap_or(false)
    })
}

/// True when NVRTC (`libnvrtc.so.13`) can be loaded. Cached.
pub fn nvrtc_library_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    *PRESENT.get_or_init(|| {
        // SAFETY: as in `driver_library_present`.
        std::panic::catch_unwind(|| unsafe { cudarc::nvrtc::sys::is_culib_present() })
            .unwrap_or(false)
    })
}

/// True when cuBLAS (`libcublas.so.13`) can be loaded. Cached.
pub fn cublas_library_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    *PRESENT.get_or_init(|| {
        // SAFETY: as in `driver_library_present`.
        std::panic::catch_unwind(|| unsafe { cudarc::cublas::sys::is_culib_present() })
            .unwrap_or(false)
    })
}

/// True when cuBLASLt (`libcublasLt.so.13`) can be loaded. Cached.
pub fn cublaslt_library_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    *PRESENT.get_or_init(|| {
        // SAFETY: as in `driver_library_present`.
        std::panic::catch_unwind(|| unsafe { cudarc::cublaslt::sys::is_culib_present() })
            .unwrap_or(false)
    })
}

pub(crate) fn require_driver() -> CudaResult<()> {
    if driver_library_present() {
        Ok(())
    } else {
        Err(CudaError::LibraryMissing {
            library: "libcuda (the NVIDIA driver)",
            what: "dlopen of libcuda.so / libcuda.so.1 failed".into(),
            hint: DRIVER_HINT,
        })
    }
}

pub(crate) fn require_nvrtc() -> CudaResult<()> {
    if nvrtc_library_present() {
        Ok(())
    } else {
        Err(CudaError::LibraryMissing {
            library: "libnvrtc",
            what: "dlopen of libnvrtc.so / libnvrtc.so.13 failed".into(),
            hint: "install the nvidia-cuda-nvrtc 13.0 wheel (scripts/install-nvrtc.sh) or a CUDA \
                   13 toolkit and add its lib directory to LD_LIBRARY_PATH",
        })
    }
}

pub(crate) fn require_cublas() -> CudaResult<()> {
    if cublas_library_present() {
        Ok(())
    } else {
        Err(CudaError::LibraryMissing {
            library: "libcublas",
            what: "dlopen of libcublas.so / libcublas.so.13 failed".into(),
            hint: "install the nvidia-cublas 13 wheel or a CUDA 13 toolkit and add its lib \
                   directory to LD_LIBRARY_PATH",
        })
    }
}

pub(crate) fn require_cublaslt() -> CudaResult<()> {
    if cublaslt_library_present() {
        Ok(())
    } else {
        Err(CudaError::LibraryMissing {
            library: "libcublasLt",
            what: "dlopen of libcublasLt.so / libcublasLt.so.13 failed".into(),
            hint: "install the nvidia-cublas 13 wheel or a CUDA 13 toolkit and add its lib \
                   directory to LD_LIBRARY_PATH",
        })
    }
}

/// `cuInit(0)` exactly once per process; the outcome is remembered.
pub(crate) fn init_driver() -> CudaResult<()> {
    static INIT: OnceLock<CudaResult<()>> = OnceLock::new();
    INIT.get_or_init(|| {
        require_driver()?;
        error::catch_panic("cuInit", || drv_result::init().named("cuInit"))
    })
    .clone()
}

/// Number of CUDA devices visible to this process. Never panics.
///
/// * no driver library → `Err(LibraryMissing)` with a clear message;
/// * a driver but no device (or `CUDA_VISIBLE_DEVICES=""`) → `Ok(0)`;
/// * any other driver failure → `Err(Driver { .. })`.
pub fn cuda_available() -> CudaResult<usize> {
    match init_driver() {
        Ok(()) => {}
        Err(CudaError::Driver { code, .. })
            if code == drv::CUresult::CUDA_ERROR_NO_DEVICE as i32 =>
        {
            return Ok(0)
        }
        Err(e) => return Err(e),
    }
    error::catch_panic("cuDeviceGetCount", || {
        let count = drv_result::device::get_count().named("cuDeviceGetCount")?;
        Ok(count.max(0) as usize)
    })
}

/// For tests that need a GPU: returns `true` when one is present; otherwise prints
/// why the test is skipped and returns `false` — or panics when
/// `BRAID_REQUIRE_GPU=1` is set (the GPU validation run), so a missing GPU there
/// is a failure, never a silent skip.
pub fn gpu_or_skip(test: &str) -> bool {
    let reason = match cuda_available() {
        Ok(n) if n > 0 => return true,
        Ok(_) => "the CUDA driver reports 0 devices".to_string(),
        Err(e) => e.to_string(),
    };
    skip(test, &format!("no GPU ({reason})"))
}

/// Skips `test`, which lacks `missing`: prints `SKIPPED test: missing` and
/// returns `false`, or panics under `BRAID_REQUIRE_GPU=1` (the GPU
/// validation run, where nothing may be missing).
pub(crate) fn skip(test: &str, missing: &str) -> bool {
    if std::env::var("BRAID_REQUIRE_GPU").is_ok_and(|v| v == "1") {
        panic!("{test}: BRAID_REQUIRE_GPU=1 but {missing}");
    }
    eprintln!("SKIPPED {test}: {missing}");
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuda_available_never_panics() {
        // On a machine without a driver this must be an error with a clear
        // message; with one it is a count. Either way: no panic.
        match cuda_available() {
            Ok(n) => eprintln!("cuda_available: {n} device(s)"),
            Err(e) => {
                let msg = e.to_string();
                assert!(!msg.is_empty());
                eprintln!("cuda_available: {msg}");
            }
        }
        // Twice: the cached path must behave the same.
        let _ = cuda_available();
    }

    #[test]
    fn engine_and_test_kernels_compile_without_a_gpu() {
        if !nvrtc_library_present() {
            eprintln!("SKIPPED engine_and_test_kernels_compile_without_a_gpu: libnvrtc not found");
            return;
        }
        for (src, name) in [
            (test_kernels::SPIN, "spin.cu"),
            (test_kernels::AXPB, "axpb.cu"),
            (engine_kernels::SPARSE_ROWS, "sparse_rows.cu"),
        ] {
            let opts = CompileOptions::for_arch("sm_90");
            let k = compile_with_headers(src, engine_kernels::HEADERS, name, &opts).unwrap();
            assert!(k.is_cubin && !k.image.is_empty());
        }
    }

    /// axpb kernels agree bit for bit with plain f32 arithmetic on the host.
    #[test]
    fn axpb_kernels_match_host_arithmetic() {
        if !gpu_or_skip("cuda::axpb_kernels_match_host_arithmetic") {
            return;
        }
        let dev = CudaDevice::open(0).unwrap();
        let s = CudaStream::compute(&dev).unwrap();
        let m = CudaModule::from_source(&dev, test_kernels::AXPB, "axpb.cu").unwrap();
        let n = 4099usize;
        let ins: Vec<Vec<f32>> = (0..4)
            .map(|j| {
                (0..n)
                    .map(|i| ((i * 7 + j * 13) % 101) as f32 * 0.37 - 11.0)
                    .collect()
            })
            .collect();
        let dins: Vec<DeviceBuffer> = ins
            .iter()
            .map(|v| DeviceBuffer::from_host(&s, v).unwrap())
            .collect();
        let out = DeviceBuffer::zeroed(&s, n * 4).unwrap();
        let (a, b) = (1.0009765f32, -0.3333f32);
        for k in 1..=4usize {
            let mut args = KernelArgs::new();
            args.ptr(out.device_ptr());
            for (j, d) in dins.iter().enumerate() {
                args.ptr(if j < k { d.device_ptr() } else { 0 });
            }
            args.i32(k as i32).f32(a).f32(b).i32(n as i32);
            // SAFETY: signature (float*, 4 x const float*, int, float, float, int);
            // every used input holds n floats; synced by to_host_vec.
            unsafe {
                m.function("axpb_sum")
                    .unwrap()
                    .launch(&s, LaunchConfig::linear(n, 256), &args)
                    .unwrap()
            };
            let got: Vec<f32> = out.to_host_vec(&s).unwrap();
            for i in 0..n {
                let mut acc = ins[0][i];
                for inp in ins.iter().take(k).skip(1) {
                    acc += inp[i];
                }
                let want = a * acc + b;
                assert_eq!(got[i].to_bits(), want.to_bits(), "k={k} i={i}");
            }
        }
        let mut args = KernelArgs::new();
        args.ptr(dins[0].device_ptr()).f32(a).f32(b).i32(n as i32);
        // SAFETY: (float*, float, float, int); n floats.
        unsafe {
            m.function("axpb_inplace")
                .unwrap()
                .launch(&s, LaunchConfig::linear(n, 256), &args)
                .unwrap()
        };
        let got: Vec<f32> = dins[0].to_host_vec(&s).unwrap();
        assert!(got
            .iter()
            .zip(&ins[0])
            .all(|(g, x)| g.to_bits() == (a * x + b).to_bits()));
    }

    /// Two spin kernels on two streams run at the same time (their device
    /// intervals overlap), and the same two on one stream do not.
    #[test]
    fn spin_kernels_overlap_on_two_streams() {
        if !gpu_or_skip("cuda::spin_kernels_overlap_on_two_streams") {
            return;
        }
        let dev = CudaDevice::open(0).unwrap();
        let s1 = CudaStream::compute(&dev).unwrap();
        let s2 = CudaStream::compute(&dev).unwrap();
        let m = CudaModule::from_source(&dev, test_kernels::SPIN, "spin.cu").unwrap();
        let spin = m.function("spin").unwrap();
        let out = DeviceBuffer::zeroed(&s1, 16).unwrap();
        s1.synchronize().unwrap();
        let pool = EventPool::new(&dev, EventKind::Timing);
        let tl = Timeline::start(&s1).unwrap();
        let cycles: i64 = 50_000_000;
        let run = |s: &CudaStream, slot: u64| -> (CudaEvent, CudaEvent) {
            let a = pool.record(s).unwrap();
            let mut args = KernelArgs::new();
            args.i64(cycles).ptr(out.device_ptr() + 8 * slot);
            // SAFETY: (long long, long long*); out holds 2 slots.
            unsafe {
                spin.launch(s, LaunchConfig::grid_block(1, 1), &args)
                    .unwrap()
            };
            (a, pool.record(s).unwrap())
        };
        let (a1, b1) = run(&s1, 0);
        let (a2, b2) = run(&s2, 1);
        s1.synchronize().unwrap();
        s2.synchronize().unwrap();
        let (st1, d1) = tl.span_ms(&a1, &b1).unwrap();
        let (st2, d2) = tl.span_ms(&a2, &b2).unwrap();
        eprintln!(
            "two streams: [{st1:.3}, {:.3}] and [{st2:.3}, {:.3}] ms",
            st1 + d1,
            st2 + d2
        );
        assert!(
            st2 < st1 + d1 && st1 < st2 + d2,
            "spans on two streams did not overlap"
        );
        let spent: Vec<i64> = out.to_host_vec(&s1).unwrap();
        assert!(spent.iter().all(|&c| c >= cycles), "{spent:?}");
        // Same stream: the second starts after the first ended.
        let (a1, b1) = run(&s1, 0);
        let (a2, b2) = run(&s1, 1);
        s1.synchronize().unwrap();
        let (st1, d1) = tl.span_ms(&a1, &b1).unwrap();
        let (st2, _) = tl.span_ms(&a2, &b2).unwrap();
        assert!(st2 >= st1 + d1 - 1e-3, "one stream must serialise");
    }

    #[test]
    fn missing_driver_is_a_library_error() {
        if driver_library_present() {
            eprintln!("SKIPPED missing_driver_is_a_library_error: a driver is present");
            return;
        }
        let err = cuda_available().unwrap_err();
        assert!(matches!(err, CudaError::LibraryMissing { .. }), "{err:?}");
        let err = CudaDevice::open(0).unwrap_err();
        assert!(matches!(err, CudaError::LibraryMissing { .. }), "{err:?}");
    }
}

//! cuBLAS matrix products in row-major terms.
//!
//! # One handle per stream
//!
//! A [`CublasHandle`] is bound (`cublasSetStream`) to one [`CudaStream`] and runs
//! every product on it. The engine keeps one handle per compute stream, so two
//! streams never share a handle's workspace and results do not depend on which
//! stream ran a product (cuBLAS is bit-reproducible for a given handle setup,
//! architecture and SM count). [`CublasHandle::rebind`] moves a handle to another
//! stream.
//!
//! # Row-major through column-major cuBLAS
//!
//! cuBLAS is column-major; Braid's matrices (llm.c's layout) are row-major. A
//! row-major `r × c` matrix with row stride `ld` is, byte for byte, the
//! column-major `c × r` matrix (its transpose) with leading dimension `ld`. So
//!
//! ```text
//! C = op(A) · op(B)            (row-major, C is m × n, op(A) m × k, op(B) k × n)
//! ⇔ Cᵀ = op(B)ᵀ · op(A)ᵀ       (what column-major cuBLAS sees)
//! ```
//!
//! and [`CublasHandle::sgemm`] calls `cublasSgemm(opB, opA, n, m, k, B, ldb, A,
//! lda, C, ldc)`: operands swapped, `m`/`n` swapped, the transpose flags and the
//! leading dimensions passed through unchanged (each `ld` is the row stride of
//! the matrix as stored). Example, GPT-2's `matmul_forward`:
//! `out (BT, OC) = inp (BT, C) · Wᵀ` with `W` stored `(OC, C)` is
//! `Gemm::new(N, T, BT, OC, C)`.
//!
//! # Precision
//!
//! FP32 with `CUBLAS_DEFAULT_MATH` (full FP32, no TF32) unless
//! [`CublasHandle::set_tf32`] opts in to `CUBLAS_TF32_TENSOR_OP_MATH`, which is
//! much faster on Ampere and later but rounds inputs to 10 mantissa bits.
//!
//! [`CublasHandle::gemm_bf16`] and [`CublasHandle::gemm_bf16_strided_batched`]
//! take bfloat16 `A`, `B` and `C` (`cublasGemmEx` with `CUDA_R_16BF`) and
//! accumulate in FP32 (`CUBLAS_COMPUTE_32F`, `alpha`/`beta` as `f32`): `C` is
//! read (when `beta ≠ 0`). cuBLAS picks the summation order (tensor cores),
//! and with `beta ≠ 0` it rounds the product to bf16 before adding `beta·C`
//! (seen with cuBLAS 13.0 on an H200), so a bf16 product is not
//! bit-identical with a CPU one.

use std::sync::Mutex;

use cudarc::cublas::{result, sys as cb};

use super::error::{catch_panic, CudaError, CudaResult, Named};
use super::memory::DevicePtr;
use super::stream::CudaStream;

pub use super::cublaslt::Epilogue;
pub use super::gemm::{Gemm, Transpose};

/// A cuBLAS handle bound to one stream.
pub struct CublasHandle {
    raw: Mutex<cb::cublasHandle_t>,
    stream: CudaStream,
    tf32: bool,
    /// cuBLASLt's handle and workspace, made at the first product with a
    /// fused epilogue ([`gemm_bf16_epilogue`](Self::gemm_bf16_epilogue)).
    lt: std::sync::OnceLock<super::cublaslt::Lt>,
}

// SAFETY: the handle is only used under the `Mutex`, with the stream's context
// current; cuBLAS handles may be used from any thread, one at a time.
unsafe impl Send for CublasHandle {}
// SAFETY: see `Send`; all access to the raw handle is serialised by the mutex.
unsafe impl Sync for CublasHandle {}

impl std::fmt::Debug for CublasHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CublasHandle")
            .field("stream", &self.stream)
            .field("tf32", &self.tf32)
            .finish()
    }
}

impl CublasHandle {
    /// Creates a handle bound to `stream`, FP32 default math.
    pub fn new(stream: &CudaStream) -> CudaResult<Self> {
        super::require_cublas()?;
        stream.device().bind_to_thread()?;
        // Context current. Destroyed in `Drop`.
        let raw = catch_panic("cublasCreate", || {
            result::create_handle().named("cublasCreate")
        })?;
        let handle = CublasHandle {
            raw: Mutex::new(raw),
            stream: stream.clone(),
            tf32: false,
            lt: std::sync::OnceLock::new(),
        };
        handle.bind(stream)?;
        Ok(handle)
    }

    fn bind(&self, stream: &CudaStream) -> CudaResult<()> {
        let h = self.raw.lock().expect("cublas handle poisoned");
        // SAFETY: handle valid; the stream outlives its use (we keep a clone);
        // cuBLAS's `cudaStream_t` is the same pointer type as `CUstream`.
        unsafe { result::set_stream(*h, stream.raw() as cb::cudaStream_t) }.named("cublasSetStream")
    }

    /// Binds the handle to another stream of the same device.
    pub fn rebind(&mut self, stream: &CudaStream) -> CudaResult<()> {
        self.stream
            .device()
            .check_same(stream.device(), "cuBLAS stream")?;
        stream.device().bind_to_thread()?;
        self.bind(stream)?;
        self.stream = stream.clone();
        Ok(())
    }

    /// The stream products run on.
    pub fn stream(&self) -> &CudaStream {
        &self.stream
    }

    /// Opts in to (`true`) or out of TF32 tensor-core math for FP32 products.
    pub fn set_tf32(&mut self, enabled: bool) -> CudaResult<()> {
        let mode = if enabled {
            cb::cublasMath_t::CUBLAS_TF32_TENSOR_OP_MATH
        } else {
            cb::cublasMath_t::CUBLAS_DEFAULT_MATH
        };
        self.stream.device().bind_to_thread()?;
        let h = self.raw.lock().expect("cublas handle poisoned");
        // SAFETY: handle valid. (cudarc's checked layer has no
        // `cublasSetMathMode`.)
        unsafe { cb::cublasSetMathMode(*h, mode) }
            .result()
            .named("cublasSetMathMode")?;
        drop(h);
        self.tf32 = enabled;
        Ok(())
    }

    /// Whether TF32 is enabled.
    pub fn tf32(&self) -> bool {
        self.tf32
    }

    /// What every product does before calling cuBLAS: checks the shape (and
    /// the batch count of a batched product), makes the device current on
    /// this thread and locks the handle.
    fn begin(
        &self,
        g: &Gemm,
        batch: Option<usize>,
    ) -> CudaResult<std::sync::MutexGuard<'_, cb::cublasHandle_t>> {
        g.validate()?;
        if let Some(batch) = batch.filter(|&b| b > i32::MAX as usize) {
            return Err(CudaError::InvalidArgument(format!(
                "batch {batch} too large"
            )));
        }
        self.stream.device().bind_to_thread()?;
        Ok(self.raw.lock().expect("cublas handle poisoned"))
    }

    /// `C = alpha · op(A) · op(B) + beta · C` (row-major) on the bound stream.
    ///
    /// # Safety
    /// `a`, `b`, `c` must be device pointers of this device to matrices of the
    /// sizes `g` describes (`a` at least `rows(A)·lda` floats, …), alive until the
    /// product has run, with no conflicting concurrent access.
    pub unsafe fn sgemm(
        &self,
        g: &Gemm,
        a: DevicePtr,
        b: DevicePtr,
        c: DevicePtr,
    ) -> CudaResult<()> {
        let h = self.begin(g, None)?;
        // SAFETY: the row-major → column-major mapping described in the module
        // docs; pointer validity is the caller's contract; alpha/beta are host
        // scalars (default pointer mode).
        unsafe {
            result::sgemm(
                *h,
                g.trans_b.op(),
                g.trans_a.op(),
                g.n as i32,
                g.m as i32,
                g.k as i32,
                &g.alpha,
                b as *const f32,
                g.ldb as i32,
                a as *const f32,
                g.lda as i32,
                &g.beta,
                c as *mut f32,
                g.ldc as i32,
            )
        }
        .named("cublasSgemm")
    }

    /// `batch` independent products `C[i] = alpha · op(A[i]) · op(B[i]) + beta · C[i]`
    /// with `X[i] = x + i · stride_x` (strides in elements), on the bound stream.
    /// Used for attention's `Q·Kᵀ` and `att·V` over (B·NH) heads.
    ///
    /// # Safety
    /// As [`sgemm`](Self::sgemm), for every batch entry.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn sgemm_strided_batched(
        &self,
        g: &Gemm,
        a: DevicePtr,
        stride_a: i64,
        b: DevicePtr,
        stride_b: i64,
        c: DevicePtr,
        stride_c: i64,
        batch: usize,
    ) -> CudaResult<()> {
        let h = self.begin(g, Some(batch))?;
        // SAFETY: as in `sgemm`, operands swapped for the row-major mapping.
        unsafe {
            result::sgemm_strided_batched(
                *h,
                g.trans_b.op(),
                g.trans_a.op(),
                g.n as i32,
                g.m as i32,
                g.k as i32,
                &g.alpha,
                b as *const f32,
                g.ldb as i32,
                stride_b,
                a as *const f32,
                g.lda as i32,
                stride_a,
                &g.beta,
                c as *mut f32,
                g.ldc as i32,
                stride_c,
                batch as i32,
            )
        }
        .named("cublasSgemmStridedBatched")
    }

    /// [`sgemm`](Self::sgemm) with bfloat16 `A`, `B` and `C` (16-bit
    /// elements, `ld`s in elements) and FP32 accumulation of the product. With
    /// `beta != 0` cuBLAS 13.0 (seen on an H200) rounds the product to bf16
    /// before it adds `beta · C`, so the result is rounded twice:
    /// `round(round(alpha · op(A) · op(B)) + beta · C)`. cuBLAS's default math
    /// mode also allows reduced-precision split-K reductions for bf16, as
    /// PyTorch does by default.
    ///
    /// # Safety
    /// As [`sgemm`](Self::sgemm), with 2-byte elements.
    pub unsafe fn gemm_bf16(
        &self,
        g: &Gemm,
        a: DevicePtr,
        b: DevicePtr,
        c: DevicePtr,
    ) -> CudaResult<()> {
        let h = self.begin(g, None)?;
        let bf16 = cb::cudaDataType::CUDA_R_16BF;
        // SAFETY: as in `sgemm` (operands swapped for the row-major mapping);
        // alpha and beta are host f32 scalars, as CUBLAS_COMPUTE_32F requires.
        unsafe {
            result::gemm_ex(
                *h,
                g.trans_b.op(),
                g.trans_a.op(),
                g.n as i32,
                g.m as i32,
                g.k as i32,
                (&g.alpha as *const f32).cast(),
                b as *const std::ffi::c_void,
                bf16,
                g.ldb as i32,
                a as *const std::ffi::c_void,
                bf16,
                g.lda as i32,
                (&g.beta as *const f32).cast(),
                c as *mut std::ffi::c_void,
                bf16,
                g.ldc as i32,
                cb::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cb::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .named("cublasGemmEx")
    }

    /// `C = epilogue(alpha · op(A) · op(B))` with bfloat16 operands and
    /// result, the epilogue's work ([`Epilogue`]: a bias, a bias and a GELU,
    /// a GELU's gradient) done by cuBLASLt (`cublaslt.rs`): FP32
    /// accumulation, one rounding to bf16, `C` not read (`g.beta` must be
    /// 0). The first call makes the handle's cuBLASLt state (a workspace
    /// allocation: not inside a graph capture).
    ///
    /// # Safety
    /// As [`gemm_bf16`](Self::gemm_bf16), and the epilogue's bias holds
    /// `g.n` bf16 values, its `aux` an m × n bf16 matrix of its row stride,
    /// disjoint from `c`.
    pub unsafe fn gemm_bf16_epilogue(
        &self,
        g: &Gemm,
        a: DevicePtr,
        b: DevicePtr,
        c: DevicePtr,
        epilogue: Epilogue,
    ) -> CudaResult<()> {
        let h = self.begin(g, None)?;
        let lt = self.lt()?;
        // SAFETY: the caller's contract; the handle's mutex (`h`) is held, so
        // the cuBLASLt state serves one product at a time.
        let r = unsafe { lt.gemm_bf16_epilogue(&self.stream, g, a, b, c, epilogue) };
        drop(h);
        r
    }

    /// The handle's cuBLASLt state, made (its workspace allocated on the
    /// handle's stream) if it is not yet.
    fn lt(&self) -> CudaResult<&super::cublaslt::Lt> {
        if let Some(lt) = self.lt.get() {
            return Ok(lt);
        }
        let made = super::cublaslt::Lt::new(&self.stream)?;
        let _ = self.lt.set(made);
        Ok(self.lt.get().expect("set just above"))
    }

    /// Makes the handle's cuBLASLt state now (the workspace of the fused-bias
    /// products, 32 MiB from compute capability 9): before a CUDA graph
    /// capture, in which the first such product could not allocate it.
    pub fn prepare_for_capture(&self) -> CudaResult<()> {
        self.lt().map(|_| ())
    }

    /// [`sgemm_strided_batched`](Self::sgemm_strided_batched) with bfloat16
    /// operands and FP32 accumulation, as [`gemm_bf16`](Self::gemm_bf16)
    /// (strides in elements).
    ///
    /// # Safety
    /// As [`gemm_bf16`](Self::gemm_bf16), for every batch entry.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn gemm_bf16_strided_batched(
        &self,
        g: &Gemm,
        a: DevicePtr,
        stride_a: i64,
        b: DevicePtr,
        stride_b: i64,
        c: DevicePtr,
        stride_c: i64,
        batch: usize,
    ) -> CudaResult<()> {
        let h = self.begin(g, Some(batch))?;
        let bf16 = cb::cudaDataType::CUDA_R_16BF;
        // SAFETY: as in `gemm_bf16`, for `batch` entries at the given strides.
        unsafe {
            result::gemm_strided_batched_ex(
                *h,
                g.trans_b.op(),
                g.trans_a.op(),
                g.n as i32,
                g.m as i32,
                g.k as i32,
                (&g.alpha as *const f32).cast(),
                b as *const std::ffi::c_void,
                bf16,
                g.ldb as i32,
                stride_b,
                a as *const std::ffi::c_void,
                bf16,
                g.lda as i32,
                stride_a,
                (&g.beta as *const f32).cast(),
                c as *mut std::ffi::c_void,
                bf16,
                g.ldc as i32,
                stride_c,
                batch as i32,
                cb::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cb::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .named("cublasGemmStridedBatchedEx")
    }
}

impl Drop for CublasHandle {
    fn drop(&mut self) {
        let h = *self.raw.get_mut().unwrap_or_else(|p| p.into_inner());
        let r = self.stream.device().bind_to_thread().and_then(|()| {
            // SAFETY: created in `new`, destroyed once. cublasDestroy waits for the
            // handle's pending work on its stream.
            unsafe { result::destroy_handle(h) }.named("cublasDestroy")
        });
        if let Err(e) = r {
            self.stream.device().record_deferred(e);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::device::CudaDevice;
    use super::super::memory::DeviceBuffer;
    use super::*;

    /// Row-major reference: C = op(A)·op(B).
    fn reference(g: &Gemm, a: &[f32], b: &[f32]) -> Vec<f32> {
        let mut c = vec![0f32; g.m * g.n];
        for i in 0..g.m {
            for j in 0..g.n {
                let mut s = 0f64;
                for p in 0..g.k {
                    let av = if g.trans_a == Transpose::N {
                        a[i * g.lda + p]
                    } else {
                        a[p * g.lda + i]
                    };
                    let bv = if g.trans_b == Transpose::N {
                        b[p * g.ldb + j]
                    } else {
                        b[j * g.ldb + p]
                    };
                    s += f64::from(av) * f64::from(bv);
                }
                c[i * g.ldc + j] = s as f32;
            }
        }
        c
    }

    #[test]
    fn row_major_sgemm_all_transposes() {
        if !super::super::gpu_or_skip("cublas::row_major_sgemm_all_transposes") {
            return;
        }
        let dev = CudaDevice::open(0).unwrap();
        let s = CudaStream::compute(&dev).unwrap();
        let h = CublasHandle::new(&s).unwrap();
        let (m, n, k) = (7, 5, 3);
        let a: Vec<f32> = (0..m * k).map(|i| (i as f32 * 0.37).sin()).collect();
        let b: Vec<f32> = (0..k * n).map(|i| (i as f32 * 0.11).cos()).collect();
        let da = DeviceBuffer::from_host(&s, &a).unwrap();
        let db = DeviceBuffer::from_host(&s, &b).unwrap();
        let dc = DeviceBuffer::zeroed(&s, m * n * 4).unwrap();
        for ta in [Transpose::N, Transpose::T] {
            for tb in [Transpose::N, Transpose::T] {
                let g = Gemm::new(ta, tb, m, n, k);
                // SAFETY: buffers hold m·k, k·n and m·n floats; synced below.
                unsafe {
                    h.sgemm(&g, da.device_ptr(), db.device_ptr(), dc.device_ptr())
                        .unwrap()
                };
                let got: Vec<f32> = dc.to_host_vec(&s).unwrap();
                let want = reference(&g, &a, &b);
                for (x, y) in got.iter().zip(&want) {
                    assert!((x - y).abs() < 1e-5, "{ta:?}{tb:?}: {got:?} vs {want:?}");
                }
            }
        }
        // Batched: two independent products.
        let g = Gemm::new(Transpose::N, Transpose::N, 2, 2, 2);
        let a2 = [1f32, 2., 3., 4., 5., 6., 7., 8.];
        let b2 = [1f32, 0., 0., 1., 2., 0., 0., 2.];
        let da = DeviceBuffer::from_host(&s, &a2).unwrap();
        let db = DeviceBuffer::from_host(&s, &b2).unwrap();
        let dc = DeviceBuffer::zeroed(&s, 8 * 4).unwrap();
        // SAFETY: 2 batches of 2×2 matrices, stride 4 elements.
        unsafe {
            h.sgemm_strided_batched(
                &g,
                da.device_ptr(),
                4,
                db.device_ptr(),
                4,
                dc.device_ptr(),
                4,
                2,
            )
            .unwrap()
        };
        let got: Vec<f32> = dc.to_host_vec(&s).unwrap();
        assert_eq!(got, vec![1., 2., 3., 4., 10., 12., 14., 16.]);
    }

    /// bf16 bits of `x`, which must be exactly representable in bf16.
    fn bf16_bits(x: f32) -> u16 {
        let bits = x.to_bits();
        assert_eq!(bits & 0xffff, 0, "{x} is not a bf16 value");
        (bits >> 16) as u16
    }

    #[test]
    fn row_major_gemm_bf16_all_transposes() {
        if !super::super::gpu_or_skip("cublas::row_major_gemm_bf16_all_transposes") {
            return;
        }
        let dev = CudaDevice::open(0).unwrap();
        let s = CudaStream::compute(&dev).unwrap();
        let h = CublasHandle::new(&s).unwrap();
        // Small integers: every product, sum and result is exact in f32 and
        // in bf16, whatever order cuBLAS sums in, so the result is exact.
        let (m, n, k) = (7, 5, 3);
        let a: Vec<f32> = (0..m * k).map(|i| ((i * 7) % 5) as f32 - 2.0).collect();
        let b: Vec<f32> = (0..k * n).map(|i| ((i * 3) % 5) as f32 - 2.0).collect();
        let bits = |x: &[f32]| x.iter().map(|&v| bf16_bits(v)).collect::<Vec<u16>>();
        let da = DeviceBuffer::from_host(&s, &bits(&a)).unwrap();
        let db = DeviceBuffer::from_host(&s, &bits(&b)).unwrap();
        for ta in [Transpose::N, Transpose::T] {
            for tb in [Transpose::N, Transpose::T] {
                // beta = 1 onto C = 1: accumulation reads C.
                let dc = DeviceBuffer::from_host(&s, &vec![bf16_bits(1.0); m * n]).unwrap();
                let g = Gemm::new(ta, tb, m, n, k).scaled(1.0, 1.0);
                // SAFETY: buffers hold m·k, k·n and m·n bf16; synced below.
                unsafe {
                    h.gemm_bf16(&g, da.device_ptr(), db.device_ptr(), dc.device_ptr())
                        .unwrap()
                };
                let got: Vec<u16> = dc.to_host_vec(&s).unwrap();
                let want: Vec<u16> = reference(&g, &a, &b)
                    .iter()
                    .map(|&x| bf16_bits(x + 1.0))
                    .collect();
                assert_eq!(got, want, "{ta:?}{tb:?}");
            }
        }
        // Batched: two independent products.
        let g = Gemm::new(Transpose::N, Transpose::N, 2, 2, 2);
        let a2 = [1f32, 2., 3., 4., 5., 6., 7., 8.];
        let b2 = [1f32, 0., 0., 1., 2., 0., 0., 2.];
        let da = DeviceBuffer::from_host(&s, &bits(&a2)).unwrap();
        let db = DeviceBuffer::from_host(&s, &bits(&b2)).unwrap();
        let dc = DeviceBuffer::zeroed(&s, 8 * 2).unwrap();
        // SAFETY: 2 batches of 2×2 bf16 matrices, stride 4 elements.
        unsafe {
            h.gemm_bf16_strided_batched(
                &g,
                da.device_ptr(),
                4,
                db.device_ptr(),
                4,
                dc.device_ptr(),
                4,
                2,
            )
            .unwrap()
        };
        let got: Vec<u16> = dc.to_host_vec(&s).unwrap();
        assert_eq!(got, bits(&[1., 2., 3., 4., 10., 12., 14., 16.]));
    }
}

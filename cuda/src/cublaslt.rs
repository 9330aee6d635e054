//! cuBLASLt products with work fused into the product's epilogue
//! ([`Epilogue`]: the bias, the bias and a GELU, or a GELU's gradient), in
//! the row-major terms of `cublas.rs`.
//!
//! `C = alpha · op(A) · op(B) + bias` (row-major, `bias` one value per
//! column of `C`) is, column-major, `Cᵀ = op(B)ᵀ · op(A)ᵀ` plus `bias`
//! added to each column of `Cᵀ`: cuBLASLt's bias (one value per row of the
//! column-major result). So, as in [`CublasHandle::sgemm`](super::CublasHandle::sgemm),
//! the operands are swapped and `m`/`n` exchanged. bf16 operands and result,
//! `CUBLAS_COMPUTE_32F` with `f32` scales: the product and the bias are
//! added in `f32` and rounded to bf16 once, where the broadcast-then-`beta =
//! 1` path rounds the product first. The bias is bf16 (the result's type,
//! cuBLASLt's default).
//!
//! State: one cuBLASLt handle and one workspace per [`CublasHandle`](super::CublasHandle)
//! (so per stream: two streams never share a workspace), created at the
//! first product. The workspace is allocated then (32 MiB from compute
//! capability 9, else 4 MiB, NVIDIA's recommendation): make the first product
//! outside a CUDA graph capture.

use std::ffi::c_void;
use std::mem::size_of;

use cudarc::cublaslt::{result as lt, sys};

use super::error::{catch_panic, CudaError, CudaResult, Named};
use super::gemm::{Gemm, Transpose};
use super::memory::{DeviceBuffer, DevicePtr};
use super::stream::CudaStream;

/// The alignment of a device address in bytes, up to 256.
fn alignment(ptr: DevicePtr) -> u32 {
    1u32 << ptr.trailing_zeros().min(8)
}

/// What a bf16 cuBLASLt product adds in its epilogue, in the row-major terms
/// of `cublas.rs` (`C` is m × n). Every result is rounded to bf16 once, from
/// the f32 accumulator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Epilogue {
    /// `C = product + bias` (`BIAS`; `bias`: `n` values, one per column).
    Bias(DevicePtr),
    /// `aux = product + bias`, `C = gelu(aux)` (the tanh form;
    /// `GELU_AUX_BIAS`): `aux` an m × n matrix of row stride `ld`.
    GeluAuxBias {
        bias: DevicePtr,
        aux: DevicePtr,
        ld: usize,
    },
    /// `C = product · gelu'(aux)`, elementwise (`DGELU`): `aux` the GELU's
    /// input, an m × n matrix of row stride `ld`; the backward of
    /// `GeluAuxBias` for the product's input gradient.
    DGelu { aux: DevicePtr, ld: usize },
}

impl Epilogue {
    fn kind(self) -> sys::cublasLtEpilogue_t {
        use sys::cublasLtEpilogue_t as E;
        match self {
            Epilogue::Bias(_) => E::CUBLASLT_EPILOGUE_BIAS,
            Epilogue::GeluAuxBias { .. } => E::CUBLASLT_EPILOGUE_GELU_AUX_BIAS,
            Epilogue::DGelu { .. } => E::CUBLASLT_EPILOGUE_DGELU,
        }
    }

    fn bias(self) -> Option<DevicePtr> {
        match self {
            Epilogue::Bias(bias) | Epilogue::GeluAuxBias { bias, .. } => Some(bias),
            Epilogue::DGelu { .. } => None,
        }
    }

    fn aux(self) -> Option<(DevicePtr, usize)> {
        match self {
            Epilogue::Bias(_) => None,
            Epilogue::GeluAuxBias { aux, ld, .. } | Epilogue::DGelu { aux, ld } => Some((aux, ld)),
        }
    }
}

/// A cuBLASLt handle and its workspace (one per stream).
pub(crate) struct Lt {
    handle: sys::cublasLtHandle_t,
    workspace: DeviceBuffer,
}

// SAFETY: the handle is used by one product at a time: the owning
// `CublasHandle` calls it under its mutex.
unsafe impl Send for Lt {}
// SAFETY: see `Send`.
unsafe impl Sync for Lt {}

impl Drop for Lt {
    fn drop(&mut self) {
        // SAFETY: created by `Lt::new`, destroyed once. A failure here has
        // nowhere to go.
        let _ = unsafe { lt::destroy_handle(self.handle) };
    }
}

/// RAII wrappers of the descriptors one product needs.
struct Layout(sys::cublasLtMatrixLayout_t);
impl Drop for Layout {
    fn drop(&mut self) {
        // SAFETY: created by `create_matrix_layout`, destroyed once.
        let _ = unsafe { lt::destroy_matrix_layout(self.0) };
    }
}
struct Desc(sys::cublasLtMatmulDesc_t);
impl Drop for Desc {
    fn drop(&mut self) {
        // SAFETY: created by `create_matmul_desc`, destroyed once.
        let _ = unsafe { lt::destroy_matmul_desc(self.0) };
    }
}
struct Pref(sys::cublasLtMatmulPreference_t);
impl Drop for Pref {
    fn drop(&mut self) {
        // SAFETY: created by `create_matmul_pref`, destroyed once.
        let _ = unsafe { lt::destroy_matmul_pref(self.0) };
    }
}

impl Lt {
    /// A handle and a workspace on `stream` (allocated there).
    pub(crate) fn new(stream: &CudaStream) -> CudaResult<Lt> {
        super::require_cublaslt()?;
        stream.device().bind_to_thread()?;
        let size = if stream.device().compute_capability().0 >= 9 {
            32 << 20
        } else {
            4 << 20
        };
        let workspace = DeviceBuffer::alloc(stream, size)?;
        let handle = catch_panic("cublasLtCreate", || {
            lt::create_handle().named("cublasLtCreate")
        })?;
        Ok(Lt { handle, workspace })
    }

    /// `C = epilogue(alpha · op(A) · op(B))` in bf16 (row-major; `g.beta`
    /// must be 0: `C` is not read), on `stream`.
    ///
    /// # Safety
    /// `a`, `b`, `c` are device pointers of this device to bf16 matrices of
    /// the sizes `g` describes, the epilogue's bias to `g.n` bf16 values and
    /// its `aux` to an m × n bf16 matrix of row stride `ld` (disjoint from
    /// `c`), all alive until the product has run, with no conflicting
    /// concurrent access; `stream` is this handle's stream's device's.
    pub(crate) unsafe fn gemm_bf16_epilogue(
        &self,
        stream: &CudaStream,
        g: &Gemm,
        a: DevicePtr,
        b: DevicePtr,
        c: DevicePtr,
        epilogue: Epilogue,
    ) -> CudaResult<()> {
        if g.beta != 0.0 {
            return Err(CudaError::InvalidArgument(format!(
                "a product with a fused epilogue overwrites C (beta 0), not beta {}",
                g.beta
            )));
        }
        let bf16 = sys::cudaDataType_t::CUDA_R_16BF;
        // Column-major view (module docs): D = op(B)ᵀ-stored · op(A)ᵀ-stored,
        // i.e. cuBLAS's A is our B and its B our A; D is n × m with ld ldc.
        // A stored operand is, column-major, (its row length) × (its rows).
        let stored = |t: Transpose, rows_op: usize, cols_op: usize, ld: usize| {
            // Row-major op(X) is rows_op × cols_op; X as stored is that or its
            // transpose; column-major, X is (row length) × (rows) = ld-strided.
            let (r, c) = match t {
                Transpose::N => (cols_op, rows_op),
                Transpose::T => (rows_op, cols_op),
            };
            lt::create_matrix_layout(bf16, r as u64, c as u64, ld as i64)
                .named("cublasLtMatrixLayoutCreate")
                .map(Layout)
        };
        // cuBLAS's A = our B (op(B) is k × n): column-major op = our flag.
        let la = stored(g.trans_b, g.k, g.n, g.ldb)?;
        // cuBLAS's B = our A (op(A) is m × k).
        let lb = stored(g.trans_a, g.m, g.k, g.lda)?;
        // D = C (n × m column-major): a dense result is stored untransposed.
        let ld = stored(Transpose::N, g.m, g.n, g.ldc)?;
        let desc = lt::create_matmul_desc(
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            sys::cudaDataType_t::CUDA_R_32F,
        )
        .named("cublasLtMatmulDescCreate")
        .map(Desc)?;
        // cublasOperation_t as the attribute takes it (an int32_t).
        let op = |t: Transpose| t.op() as i32;
        let set = |attr: sys::cublasLtMatmulDescAttributes_t, v: *const c_void, n: usize| {
            // SAFETY: `v` points at a live value of `n` bytes of the type
            // the attribute takes.
            unsafe { lt::set_matmul_desc_attribute(desc.0, attr, v, n) }
                .named("cublasLtMatmulDescSetAttribute")
        };
        use sys::cublasLtMatmulDescAttributes_t as A;
        let (ta, tb) = (op(g.trans_b), op(g.trans_a));
        set(
            A::CUBLASLT_MATMUL_DESC_TRANSA,
            (&ta as *const i32).cast(),
            size_of::<i32>(),
        )?;
        set(
            A::CUBLASLT_MATMUL_DESC_TRANSB,
            (&tb as *const i32).cast(),
            size_of::<i32>(),
        )?;
        let kind = epilogue.kind();
        set(
            A::CUBLASLT_MATMUL_DESC_EPILOGUE,
            (&kind as *const sys::cublasLtEpilogue_t).cast(),
            size_of::<sys::cublasLtEpilogue_t>(),
        )?;
        if let Some((aux, ld_aux)) = epilogue.aux() {
            // The auxiliary matrix (GELU_AUX_BIAS's output, DGELU's input)
            // has D's layout (n × m column-major, so its leading dimension
            // is our row stride) and D's type.
            let aux_ptr = aux as *const c_void;
            set(
                A::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER,
                (&aux_ptr as *const *const c_void).cast(),
                size_of::<*const c_void>(),
            )?;
            let ld_aux = ld_aux as i64;
            set(
                A::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD,
                (&ld_aux as *const i64).cast(),
                size_of::<i64>(),
            )?;
        }
        if let Some(bias) = epilogue.bias() {
            let bias_ptr = bias as *const c_void;
            set(
                A::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                (&bias_ptr as *const *const c_void).cast(),
                size_of::<*const c_void>(),
            )?;
        }
        let pref = lt::create_matmul_pref()
            .named("cublasLtMatmulPreferenceCreate")
            .map(Pref)?;
        let ws = self.workspace.len_bytes();
        let set_ws = || {
            // SAFETY: `ws` is a live usize, the attribute's type.
            unsafe {
                lt::set_matmul_pref_attribute(
                    pref.0,
                    sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                    (&ws as *const usize).cast(),
                    size_of::<usize>(),
                )
            }
        };
        set_ws().named("cublasLtMatmulPreferenceSetAttribute")?;
        // The heuristic assumes 256-byte aligned operands unless told
        // otherwise; views into a larger buffer may be less aligned.
        use sys::cublasLtMatmulPreferenceAttributes_t as P;
        for (attr, ptr) in [
            (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, b),
            (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, a),
            (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, c),
            (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, c),
        ] {
            let align: u32 = alignment(ptr);
            // SAFETY: `align` is a live u32, the attribute's type.
            let r = unsafe {
                lt::set_matmul_pref_attribute(
                    pref.0,
                    attr,
                    (&align as *const u32).cast(),
                    size_of::<u32>(),
                )
            };
            r.named("cublasLtMatmulPreferenceSetAttribute")?;
        }
        stream.device().bind_to_thread()?;
        let heuristic = {
            // SAFETY: every descriptor is live; D is also C (beta 0, not read).
            let r = unsafe {
                lt::get_matmul_algo_heuristic(self.handle, desc.0, la.0, lb.0, ld.0, ld.0, pref.0)
            };
            r.named("cublasLtMatmulAlgoGetHeuristic")?
        };
        let (alpha, beta) = (g.alpha, 0.0f32);
        // SAFETY: the caller's pointers (this function's contract), the
        // descriptors above, the handle's workspace of `ws` bytes, and the
        // task's stream (a `CUstream` is a `cudaStream_t`).
        let r = unsafe {
            lt::matmul(
                self.handle,
                desc.0,
                (&alpha as *const f32).cast(),
                (&beta as *const f32).cast(),
                b as *const c_void,
                la.0,
                a as *const c_void,
                lb.0,
                c as *const c_void,
                ld.0,
                c as *mut c_void,
                ld.0,
                &heuristic.algo,
                self.workspace.device_ptr() as *mut c_void,
                ws,
                stream.raw() as sys::cudaStream_t,
            )
        };
        r.named("cublasLtMatmul")
    }
}

#[cfg(test)]
mod tests {
    use super::alignment;

    /// The alignment the heuristic is told: the address's, at most 256.
    #[test]
    fn alignment_is_the_addresses_up_to_256() {
        assert_eq!(alignment(0x1000), 256);
        assert_eq!(alignment(0x1010), 16);
        assert_eq!(alignment(0x1002), 2);
        assert_eq!(alignment(0x1080), 128);
    }
}

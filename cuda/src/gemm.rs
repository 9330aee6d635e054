//! The shape of a matrix product in row-major terms (`Gemm`, `Transpose`),
//! shared by the cuBLAS (`cublas.rs`) and cuBLASLt (`cublaslt.rs`) paths.
//! How a row-major product maps onto column-major cuBLAS is told in
//! `cublas.rs`.

use cudarc::cublas::sys as cb;

use super::error::{CudaError, CudaResult};

/// Whether an operand is used as stored or transposed (row-major terms).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transpose {
    /// `op(X) = X`.
    N,
    /// `op(X) = Xᵀ`.
    T,
}

impl Transpose {
    /// cuBLAS's operation (cuBLASLt takes the same values).
    pub(crate) fn op(self) -> cb::cublasOperation_t {
        match self {
            Transpose::N => cb::cublasOperation_t::CUBLAS_OP_N,
            Transpose::T => cb::cublasOperation_t::CUBLAS_OP_T,
        }
    }
}

/// Shape of `C = alpha · op(A) · op(B) + beta · C`, all row-major.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Gemm {
    /// Transpose of A.
    pub trans_a: Transpose,
    /// Transpose of B.
    pub trans_b: Transpose,
    /// Rows of C and of op(A).
    pub m: usize,
    /// Columns of C and of op(B).
    pub n: usize,
    /// Columns of op(A) = rows of op(B).
    pub k: usize,
    /// Scale of the product.
    pub alpha: f32,
    /// Scale of the existing C (0: overwrite; 1: accumulate, as backward passes do).
    pub beta: f32,
    /// Row stride of A as stored, in elements.
    pub lda: usize,
    /// Row stride of B as stored, in elements.
    pub ldb: usize,
    /// Row stride of C, in elements.
    pub ldc: usize,
}

impl Gemm {
    /// Densely packed operands, `alpha = 1`, `beta = 0`.
    pub fn new(trans_a: Transpose, trans_b: Transpose, m: usize, n: usize, k: usize) -> Self {
        // Stored A is m×k (N) or k×m (T); stored B is k×n (N) or n×k (T).
        let lda = if trans_a == Transpose::N { k } else { m };
        let ldb = if trans_b == Transpose::N { n } else { k };
        Gemm {
            trans_a,
            trans_b,
            m,
            n,
            k,
            alpha: 1.0,
            beta: 0.0,
            lda,
            ldb,
            ldc: n,
        }
    }

    /// Sets `alpha` and `beta`.
    pub fn scaled(mut self, alpha: f32, beta: f32) -> Self {
        self.alpha = alpha;
        self.beta = beta;
        self
    }

    /// Checks the shape fits cuBLAS's `int` arguments and the strides
    /// cover the rows.
    pub(crate) fn validate(&self) -> CudaResult<()> {
        let fits = |x: usize| x <= i32::MAX as usize;
        let (ra, ca) = if self.trans_a == Transpose::N {
            (self.m, self.k)
        } else {
            (self.k, self.m)
        };
        let (_rb, cb_) = if self.trans_b == Transpose::N {
            (self.k, self.n)
        } else {
            (self.n, self.k)
        };
        let _ = ra;
        let ok = [self.m, self.n, self.k, self.lda, self.ldb, self.ldc]
            .iter()
            .all(|&x| fits(x))
            && self.lda >= ca.max(1)
            && self.ldb >= cb_.max(1)
            && self.ldc >= self.n.max(1);
        if ok {
            Ok(())
        } else {
            Err(CudaError::InvalidArgument(format!(
                "invalid gemm shape {self:?}"
            )))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gemm_shapes_validate() {
        let g = Gemm::new(Transpose::N, Transpose::T, 4, 3, 5);
        assert_eq!((g.lda, g.ldb, g.ldc), (5, 5, 3));
        assert!(g.validate().is_ok());
        let mut bad = g;
        bad.lda = 2;
        assert!(bad.validate().is_err());
    }
}

//! `models/gpt2/src/kernels/matmul.cu`: the bias kernels of the linear
//! layers (the products are cuBLAS calls, not emulated). Rows of the
//! `(N, OC)` side are `ld >= OC` elements apart; columns `OC..ld` are
//! neither read nor written.

use crate::check::{dim, product, stride};
use crate::launch::Args;
use crate::Dim3;

/// Row lanes (warps) of `bias_backward`: `BIAS_GRAD_LANES` in matmul.cu.
pub const BIAS_GRAD_LANES: u32 = 32;

/// The lengths `(N·ld, OC)` of the `(N, ld)` side and the `(OC)` side, for
/// `[N, OC, ld]` with `N, OC >= 1`, `ld >= OC` (checked).
fn bias_shape(k: &str, [n, oc, ld]: [i32; 3]) -> Result<(usize, usize), String> {
    let (n, oc) = (dim(k, "N", n)?, dim(k, "OC", oc)?);
    let ld = stride(k, "ld", ld, "OC", oc)?;
    Ok((product(k, &[n, ld])?, oc))
}

twins! {
    /// `bias_broadcast` (f32): `out[n, o] = bias[o]`, `out` `(N, ld)`, `bias`
    /// `(OC)`. The launcher (matmul.rs, `matmul_forward_cuda`): one thread per
    /// used element, grid `ceil(N·OC / 256)`, block 256.
    pub fn bias_broadcast(S = f32);
    /// [`bias_broadcast`] with bf16 storage (`u16` bit patterns).
    pub fn bias_broadcast_bf16(S = u16);
    fn(k, grid: Dim3, block: Dim3, out: &mut [S], bias: &[S], n: i32, oc: i32, ld: i32) {
        let (rows, cols) = bias_shape(k, [n, oc, ld])?;
        let args = Args::new(k)
            .output("out", out, rows)?
            .input("bias", bias, cols)?
            .i32s([n, oc, ld]);
        // SAFETY: out holds N·ld elements with ld >= OC, bias OC (checked):
        // every index the kernel forms, n·ld + o and o with n < N and o < OC,
        // is inside.
        unsafe { args.launch(grid, block) }
    }
}

twins! {
    /// `bias_backward` (f32): `dbias[o] += Σ_n dout[n, o]`, `dbias` `(OC)`,
    /// `dout` `(N, ld)`, summed by [`BIAS_GRAD_LANES`] warps in a fixed lane
    /// order. The launcher (matmul.rs, `matmul_backward_weight_cuda`): grid
    /// `ceil(OC / 32)`, block `32 · BIAS_GRAD_LANES`.
    pub fn bias_backward(S = f32);
    /// [`bias_backward`] with bf16 storage (each `dbias` loaded, the f32 sums
    /// added, rounded once).
    pub fn bias_backward_bf16(S = u16);
    fn(k, grid: Dim3, block: Dim3, dbias: &mut [S], dout: &[S], n: i32, oc: i32, ld: i32) {
        let (rows, cols) = bias_shape(k, [n, oc, ld])?;
        let args = Args::new(k)
            .output("dbias", dbias, cols)?
            .input("dout", dout, rows)?
            .i32s([n, oc, ld]);
        // SAFETY: dout holds N·ld elements with ld >= OC, dbias OC (checked):
        // every index the kernel forms, n·ld + o and o with n < N and o < OC,
        // is inside.
        unsafe { args.launch(grid, block) }
    }
}

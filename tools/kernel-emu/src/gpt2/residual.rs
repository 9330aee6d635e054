//! `models/gpt2/src/kernels/residual.cu`: the residual connection, forward
//! and backward, one thread per element.

use crate::check::count;
use crate::launch::Args;
use crate::Dim3;

twins! {
    /// `residual_forward` (f32): `out = inp1 + inp2`. The launcher
    /// (residual.rs, `residual_forward_cuda`): one thread per element, grid
    /// `ceil(N / 256)`, block 256.
    pub fn residual_forward(S = f32);
    /// [`residual_forward`] with bf16 storage.
    pub fn residual_forward_bf16(S = u16);
    fn(k, grid: Dim3, block: Dim3, out: &mut [S], inp1: &[S], inp2: &[S], n: i64) {
        let len = count(k, n)?;
        let args = Args::new(k)
            .output("out", out, len)?
            .input("inp1", inp1, len)?
            .input("inp2", inp2, len)?
            .i64(n);
        // SAFETY: residual_forward[_bf16] touches element i < N of each
        // buffer, all N long (checked).
        unsafe { args.launch(grid, block) }
    }
}

twins! {
    /// `residual_backward` (f32): `dinp1 += dout; dinp2 += dout`, or
    /// `dinp1 += dout` alone with no `dinp2` (residual.rs's `accumulate`).
    /// Launch as [`residual_forward`] (residual.rs, `residual_backward_cuda`).
    pub fn residual_backward(S = f32);
    /// [`residual_backward`] with bf16 storage.
    pub fn residual_backward_bf16(S = u16);
    fn(
        k,
        grid: Dim3,
        block: Dim3,
        dinp1: &mut [S],
        dinp2: Option<&mut [S]>,
        dout: &[S],
        n: i64,
    ) {
        let len = count(k, n)?;
        let args = Args::new(k)
            .output("dinp1", dinp1, len)?
            .output_or_null("dinp2", dinp2, len)?
            .input("dout", dout, len)?
            .i64(n);
        // SAFETY: residual_backward[_bf16] touches element i < N of each
        // buffer, all N long (checked), and no dinp2 when it is null;
        // dinp1 and dinp2 are distinct copies, so they never alias.
        unsafe { args.launch(grid, block) }
    }
}

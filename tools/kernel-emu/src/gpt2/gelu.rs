//! `models/gpt2/src/kernels/gelu.cu`: GELU (tanh approximation), forward
//! and backward, one thread per element.

use crate::check::count;
use crate::launch::Args;
use crate::Dim3;

twins! {
    /// `gelu_forward` (f32): `out = 0.5·x·(1 + tanh(sqrt(2/π)·(x +
    /// 0.044715·x³)))`. The launcher (gelu.rs, `gelu_forward_cuda`): one thread
    /// per element, grid `ceil(N / 256)`, block 256.
    pub fn gelu_forward(S = f32);
    /// [`gelu_forward`] with bf16 storage, 8 elements a thread (one 16-byte
    /// load per operand where aligned): grid `ceil(N / 2048)`, block 256.
    pub fn gelu_forward_bf16(S = u16);
    fn(k, grid: Dim3, block: Dim3, out: &mut [S], inp: &[S], n: i64) {
        let len = count(k, n)?;
        let args = Args::new(k)
            .output("out", out, len)?
            .input("inp", inp, len)?
            .i64(n);
        // SAFETY: gelu_forward[_bf16] touches out[i] and inp[i] for i < N, the
        // length of both (checked).
        unsafe { args.launch(grid, block) }
    }
}

twins! {
    /// `gelu_backward` (f32): `dinp += gelu'(inp) · dout`, or with
    /// `accumulate` 0 `dinp = 0 + gelu'(inp) · dout` (not read). Launch as
    /// [`gelu_forward`] (gelu.rs, `gelu_backward_cuda`).
    pub fn gelu_backward(S = f32);
    /// [`gelu_backward`] with bf16 storage, 8 elements a thread (one 16-byte
    /// load per operand where aligned): grid `ceil(N / 2048)`, block 256.
    pub fn gelu_backward_bf16(S = u16);
    fn(
        k,
        grid: Dim3,
        block: Dim3,
        dinp: &mut [S],
        inp: &[S],
        dout: &[S],
        n: i64,
        accumulate: i32,
    ) {
        let len = count(k, n)?;
        let args = Args::new(k)
            .output("dinp", dinp, len)?
            .input("inp", inp, len)?
            .input("dout", dout, len)?
            .i64(n)
            .i32(accumulate);
        // SAFETY: gelu_backward[_bf16] touches dinp[i], inp[i] and dout[i] for
        // i < N, the length of all three (checked).
        unsafe { args.launch(grid, block) }
    }
}

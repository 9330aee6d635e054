//! `models/gpt2/src/kernels/layernorm.cu`: layer normalisation over `C`
//! channels of `N` rows, forward (alone, or fused with the residual sum),
//! and backward (the input gradient, then the parameter gradients).

use crate::check::{dim, product};
use crate::launch::Args;
use crate::Dim3;

/// `(N, C, N·C)` for `(N, C)`, both at least 1.
fn shape(k: &str, n: i32, c: i32) -> Result<(usize, usize, usize), String> {
    let (n, c) = (dim(k, "N", n)?, dim(k, "C", c)?);
    Ok((n, c, product(k, &[n, c])?))
}

twins! {
    /// `layernorm_forward` (f32): `out = (inp - mean) · rstd · weight + bias`
    /// per row of `C`, saving `mean` and `rstd` (`N`). The launcher
    /// (layernorm.rs, `forward_cuda`): one warp per row, grid `ceil(N / 8)`,
    /// block 256 (`Launcher::warp_rows`).
    pub fn layernorm_forward(S = f32);
    /// [`layernorm_forward`] with bf16 `out`, `inp`, `weight`, `bias` (`mean`
    /// and `rstd` stay `f32`).
    pub fn layernorm_forward_bf16(S = u16);
    fn(
        k,
        grid: Dim3,
        block: Dim3,
        out: &mut [S],
        mean: &mut [f32],
        rstd: &mut [f32],
        inp: &[S],
        weight: &[S],
        bias: &[S],
        n: i32,
        c: i32,
    ) {
        let (rows, cols, nc) = shape(k, n, c)?;
        let args = Args::new(k)
            .output("out", out, nc)?
            .output("mean", mean, rows)?
            .output("rstd", rstd, rows)?
            .input("inp", inp, nc)?
            .input("weight", weight, cols)?
            .input("bias", bias, cols)?
            .i32s([n, c]);
        // SAFETY: out and inp hold (N, C), mean and rstd N, weight and bias C
        // (checked), and layernorm_forward[_bf16] touches rows < N, channels
        // < C.
        unsafe { args.launch(grid, block) }
    }
}

twins! {
    /// `layernorm_residual_forward` (f32): `residual = inp1 + inp2`, then
    /// [`layernorm_forward`] of the stored sum. Launch as
    /// [`layernorm_forward`] (layernorm.rs, `forward_cuda`).
    pub fn layernorm_residual_forward(S = f32);
    /// [`layernorm_residual_forward`] with bf16 storage (`mean`, `rstd` `f32`).
    pub fn layernorm_residual_forward_bf16(S = u16);
    fn(
        k,
        grid: Dim3,
        block: Dim3,
        residual: &mut [S],
        out: &mut [S],
        mean: &mut [f32],
        rstd: &mut [f32],
        inp1: &[S],
        inp2: &[S],
        weight: &[S],
        bias: &[S],
        n: i32,
        c: i32,
    ) {
        let (rows, cols, nc) = shape(k, n, c)?;
        let args = Args::new(k)
            .output("residual", residual, nc)?
            .output("out", out, nc)?
            .output("mean", mean, rows)?
            .output("rstd", rstd, rows)?
            .input("inp1", inp1, nc)?
            .input("inp2", inp2, nc)?
            .input("weight", weight, cols)?
            .input("bias", bias, cols)?
            .i32s([n, c]);
        // SAFETY: residual, out, inp1 and inp2 hold (N, C), mean and rstd N,
        // weight and bias C (checked), and layernorm_residual_forward[_bf16]
        // touches rows < N, channels < C.
        unsafe { args.launch(grid, block) }
    }
}

twins! {
    /// `layernorm_backward_input` (f32): `dinp = base + (dnorm - mean(dnorm) -
    /// norm · mean(dnorm · norm)) · rstd` per row, `base` = `dinp` itself
    /// (accumulate) for `dres = None` (a null pointer), else `dres` (the
    /// residual's gradient passed through). The launcher (layernorm.rs,
    /// `backward_cuda`): one warp per row, grid `ceil(N / 8)`, block 256.
    pub fn layernorm_backward_input(S = f32);
    /// [`layernorm_backward_input`] with bf16 `dinp`, `dres`, `dout`, `inp`,
    /// `weight`.
    pub fn layernorm_backward_input_bf16(S = u16);
    fn(
        k,
        grid: Dim3,
        block: Dim3,
        dinp: &mut [S],
        dres: Option<&[S]>,
        dout: &[S],
        inp: &[S],
        weight: &[S],
        mean: &[f32],
        rstd: &[f32],
        n: i32,
        c: i32,
    ) {
        let (rows, cols, nc) = shape(k, n, c)?;
        let args = Args::new(k)
            .output("dinp", dinp, nc)?
            .input_or_null("dres", dres, nc)?
            .input("dout", dout, nc)?
            .input("inp", inp, nc)?
            .input("weight", weight, cols)?
            .input("mean", mean, rows)?
            .input("rstd", rstd, rows)?
            .i32s([n, c]);
        // SAFETY: dinp, dout, inp and dres (or null) hold (N, C), weight C,
        // mean and rstd N (checked), and layernorm_backward_input[_bf16]
        // touches rows < N, channels < C.
        unsafe { args.launch(grid, block) }
    }
}

twins! {
    /// `layernorm_backward_params_partial` (f32): the sums of row chunk `r`
    /// of `R = gridDim.y` (rows `r·per .. min(N, (r+1)·per)`, `per = ceil(N /
    /// R)`) into `part` `(R, 2, C)`: `part[r][0][c] = Σ norm[n, c] · dout[n,
    /// c]`, `part[r][1][c] = Σ dout[n, c]`, summed by 8 warps
    /// (`LN_PARAMS_WARPS`) in a fixed order. The launcher (layernorm.rs,
    /// `backward_cuda`): grid `(ceil(C / 32), R)`, block `32 · 8`.
    pub fn layernorm_backward_params_partial(S = f32);
    /// [`layernorm_backward_params_partial`] with bf16 `dout` and `inp` (the
    /// sums stay `f32`).
    pub fn layernorm_backward_params_partial_bf16(S = u16);
    fn(
        k,
        grid: Dim3,
        block: Dim3,
        part: &mut [f32],
        dout: &[S],
        inp: &[S],
        mean: &[f32],
        rstd: &[f32],
        n: i32,
        c: i32,
    ) {
        let (rows, cols, nc) = shape(k, n, c)?;
        let chunks = grid.1 as usize;
        let args = Args::new(k)
            .output("part", part, product(k, &[chunks, 2, cols])?)?
            .input("dout", dout, nc)?
            .input("inp", inp, nc)?
            .input("mean", mean, rows)?
            .input("rstd", rstd, rows)?
            .i32s([n, c]);
        // SAFETY: part holds (gridDim.y, 2, C), dout and inp (N, C), mean and
        // rstd N (checked), and layernorm_backward_params_partial[_bf16]
        // touches chunks < gridDim.y, rows < N, channels < C.
        unsafe { args.launch(grid, block) }
    }
}

twins! {
    /// `layernorm_backward_params_finish` (f32): `dweight[c]` plus
    /// `part[0][0][c] + part[1][0][c] + …` in chunk order, `dbias` from
    /// `part[r][1]` likewise. The launcher (layernorm.rs, `backward_cuda`): one thread
    /// per channel, grid `ceil(C / 256)`, block 256.
    pub fn layernorm_backward_params_finish(S = f32);
    /// [`layernorm_backward_params_finish`] with bf16 `dweight` and `dbias`
    /// (each loaded, the chunks' sums added in f32, rounded once).
    pub fn layernorm_backward_params_finish_bf16(S = u16);
    fn(
        k,
        grid: Dim3,
        block: Dim3,
        dweight: &mut [S],
        dbias: &mut [S],
        part: &[f32],
        c: i32,
        chunks: i32,
    ) {
        let cols = dim(k, "C", c)?;
        let r = dim(k, "R", chunks)?;
        let args = Args::new(k)
            .output("dweight", dweight, cols)?
            .output("dbias", dbias, cols)?
            .input("part", part, product(k, &[r, 2, cols])?)?
            .i32s([c, chunks]);
        // SAFETY: dweight and dbias hold C, part (R, 2, C) (checked), and
        // layernorm_backward_params_finish[_bf16] touches channels < C,
        // chunks < R.
        unsafe { args.launch(grid, block) }
    }
}

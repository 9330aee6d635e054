//! The engine's own kernels, `cuda/kernels/sparse_rows.cu`: the gradient
//! reducer's row contributions (core/src/comm/sparse.rs, whose CUDA bodies
//! launch them: `sparse_rows_links` with grid `ceil(n / 256)`, block 256;
//! `sparse_rows_add_*` once per rank with grid `n`, block 128).

use crate::check::dim;
use crate::launch::Args;
use crate::Dim3;

/// The largest `blockDim.x` of `sparse_rows_links`: its shared tile holds
/// 256 ids, one per thread.
pub const SPARSE_LINKS_MAX_BLOCK: u32 = 256;

/// `sparse_rows_links`: `links[i]` = the next index `r > i` holding the
/// same id (`n` if none), with bit 31 set when an earlier index holds it.
/// `blockDim.x` at most [`SPARSE_LINKS_MAX_BLOCK`] (checked).
pub fn sparse_rows_links(
    grid: Dim3,
    block: Dim3,
    links: &mut [u32],
    ids: &[u32],
    n: i32,
) -> Result<(), String> {
    let k = "sparse_rows_links";
    let nu = dim(k, "n", n)?;
    let args = Args::new(k)
        .output("links", links, nu)?
        .input("ids", ids, nu)?
        .i32(n);
    if block.0 > SPARSE_LINKS_MAX_BLOCK {
        return Err(format!(
            "{k}: blockDim.x ({}) must be at most {SPARSE_LINKS_MAX_BLOCK} (the shared tile)",
            block.0
        ));
    }
    // SAFETY: the kernel touches links[i] and ids[i] for i < n (lengths
    // checked) and tile[threadIdx.x] of its 256-entry tile (blockDim.x
    // checked).
    unsafe { args.launch(grid, block) }
}

twins! {
    /// `sparse_rows_add_f32`: `grad[ids[i]] += scale · rows[i]` for one
    /// rank's `n` rows of `row_len`, each touched row loaded once and stored
    /// once, walking the chains of `links` ([`sparse_rows_links`]); ids at
    /// or past `nrows` are skipped. `grad` holds `nrows · row_len` elements.
    pub fn sparse_rows_add_f32(S = f32);
    /// [`sparse_rows_add_f32`] with bf16 gradients and rows (`u16` bits),
    /// the sum in f32, rounded once per touched element.
    pub fn sparse_rows_add_bf16(S = u16);
    fn(
        k,
        grid: Dim3,
        block: Dim3,
        grad: &mut [S],
        ids: &[u32],
        links: &[u32],
        rows: &[S],
        n: i32,
        row_len: i32,
        nrows: i64,
        scale: f32
    ) {
        let (nu, len) = (dim(k, "n", n)?, dim(k, "row_len", row_len)?);
        let grad_len = usize::try_from(nrows)
            .ok()
            .and_then(|r| r.checked_mul(len))
            .ok_or_else(|| format!("{k}: nrows {nrows} · row_len {row_len} is not a size"))?;
        let args = Args::new(k)
            .output("grad", grad, grad_len)?
            .input("ids", ids, nu)?
            .input("links", links, nu)?
            .input("rows", rows, nu * len)?
            .i32s([n, row_len])
            .i64(nrows)
            .f32(scale);
        // SAFETY: the kernel reads ids[i], links[i] for i < n and rows[r, c]
        // for r < n (a chain stops at the first link not below n), c <
        // row_len, and writes grad[id, c] only for ids below nrows: every
        // index inside the buffers, whose lengths are checked above, for any
        // links.
        unsafe { args.launch(grid, block) }
    }
}

//! `models/gpt2/src/kernels/encoder.cu`: the token + position embedding,
//! forward and backward (the position gradient, the token gradient, and
//! for bf16 the "links" kernel that chains each token's positions).

use crate::check::{dim, ids_below, product};
use crate::launch::{Args, Elem};
use crate::Dim3;

/// The rows of a `(rows, C)` table held in `len` elements, at least
/// `min_rows` (the launchers' `Check::rows`).
fn table_rows(k: &str, name: &str, len: usize, c: usize, min_rows: usize) -> Result<usize, String> {
    if len % c != 0 || len / c < min_rows.max(1) {
        return Err(format!(
            "{k}: {name} has {len} elements, expected whole rows of {c}, at least {} of them",
            min_rows.max(1)
        ));
    }
    Ok(len / c)
}

twins! {
    /// `encoder_forward` (f32): `out[b, t, :] = wte[tokens[b, t], :] + wpe[t,
    /// :]`; `wte` `(V, C)` with every token below `V` (checked), `wpe` at least
    /// `T` rows. The launcher (encoder.rs, `encoder_forward_cuda`): one thread
    /// per element, grid `ceil(B·T·C / 256)`, block 256.
    pub fn encoder_forward(S = f32);
    /// [`encoder_forward`] with bf16 storage.
    pub fn encoder_forward_bf16(S = u16);
    fn(
        k,
        grid: Dim3,
        block: Dim3,
        out: &mut [S],
        tokens: &[u32],
        wte: &[S],
        wpe: &[S],
        b: i32,
        t: i32,
        c: i32,
    ) {
        let (bu, tu, cu) = (dim(k, "B", b)?, dim(k, "T", t)?, dim(k, "C", c)?);
        let bt = product(k, &[bu, tu])?;
        let args = Args::new(k)
            .output("out", out, product(k, &[bt, cu])?)?
            .input("tokens", tokens, bt)?;
        let v = table_rows(k, "wte", wte.len(), cu, 1)?;
        table_rows(k, "wpe", wpe.len(), cu, tu)?;
        ids_below(k, "tokens", tokens, v)?;
        let args = args
            .input_prechecked("wte", wte)
            .input_prechecked("wpe", wpe)
            .i32s([b, t, c]);
        // SAFETY: out holds (B, T, C), tokens B·T ids each below V, the rows
        // of wte (V, C), and wpe at least T rows of C (checked):
        // encoder_forward[_bf16] reads wte[tok, c], wpe[t, c] and writes
        // out[bt, c] for bt < B·T, t < T, c < C.
        unsafe { args.launch(grid, block) }
    }
}

twins! {
    /// `encoder_backward_wpe` (f32): `dwpe[t, c] += Σ_b dout[b, t, c]`, `b` in
    /// order; only the first `T` rows of `dwpe` (`maxT >= T`) are touched. The
    /// launcher (encoder.rs, `encoder_backward_cuda`): grid `ceil(T·C / 256)`,
    /// block 256.
    pub fn encoder_backward_wpe(S = f32);
    /// [`encoder_backward_wpe`] with bf16 storage (loaded, summed in f32,
    /// rounded once).
    pub fn encoder_backward_wpe_bf16(S = u16);
    fn(k, grid: Dim3, block: Dim3, dwpe: &mut [S], dout: &[S], b: i32, t: i32, c: i32) {
        let (bu, tu, cu) = (dim(k, "B", b)?, dim(k, "T", t)?, dim(k, "C", c)?);
        table_rows(k, "dwpe", dwpe.len(), cu, tu)?;
        let args = Args::new(k)
            .output_prechecked("dwpe", dwpe)
            .input("dout", dout, product(k, &[bu, tu, cu])?)?
            .i32s([b, t, c]);
        // SAFETY: dwpe holds at least T rows of C and dout (B, T, C)
        // (checked); encoder_backward_wpe[_bf16] touches dwpe[t, c] and
        // dout[b, t, c] for t < T, c < C, b < B.
        unsafe { args.launch(grid, block) }
    }
}

/// The token-gradient kernels' arguments up to `tokens` (`dwte` `(V, C)`,
/// `dout` `(B·T, C)`, `tokens` `B·T` ids below `V`, checked), and `BT`.
fn wte_args<'a, S: Elem>(
    k: &'a str,
    dwte: &'a mut [S],
    dout: &'a [S],
    tokens: &'a [u32],
    bt: i32,
    c: i32,
) -> Result<(Args<'a>, usize), String> {
    let (btu, cu) = (dim(k, "BT", bt)?, dim(k, "C", c)?);
    let v = table_rows(k, "dwte", dwte.len(), cu, 1)?;
    let args = Args::new(k)
        .output_prechecked("dwte", dwte)
        .input("dout", dout, product(k, &[btu, cu])?)?
        .input("tokens", tokens, btu)?;
    ids_below(k, "tokens", tokens, v)?;
    Ok((args, btu))
}

/// `encoder_backward_wte` (f32): `dwte[tokens[bt], c] += dout[bt, c]` in
/// `bt` order, every token below `V` (checked); thread `(c, p)` owns the
/// tokens congruent to `p` modulo `gridDim.y`. The launcher (encoder.rs,
/// `encoder_backward_cuda`): grid `(ceil(C / 128), WTE_PARTS = 32, 1)`,
/// block `(128, 1, 1)`.
pub fn encoder_backward_wte(
    grid: Dim3,
    block: Dim3,
    dwte: &mut [f32],
    dout: &[f32],
    tokens: &[u32],
    bt: i32,
    c: i32,
) -> Result<(), String> {
    let k = "encoder_backward_wte";
    let (args, _) = wte_args(k, dwte, dout, tokens, bt, c)?;
    let args = args.i32s([bt, c]);
    // SAFETY: the kernel touches dwte[tok, c] for the B·T tokens (each below
    // V, the rows of dwte), dout[bt, c] and tokens[bt] for bt < BT, c < C:
    // checked above.
    unsafe { args.launch(grid, block) }
}

/// The largest `blockDim.x` of `encoder_backward_links`: its shared tile
/// holds 256 tokens, one per thread.
pub const LINKS_MAX_BLOCK: u32 = 256;

/// `encoder_backward_links`: `links[bt]` = the next position `r > bt`
/// holding the same token (`BT` if none), with bit 31 set when an earlier
/// position holds it. `blockDim.x` at most [`LINKS_MAX_BLOCK`] (the shared
/// tile: checked). The launcher (encoder.rs, `encoder_backward_cuda`):
/// grid `ceil(B·T / 256)`, block 256.
pub fn encoder_backward_links(
    grid: Dim3,
    block: Dim3,
    links: &mut [u32],
    tokens: &[u32],
    bt: i32,
) -> Result<(), String> {
    let k = "encoder_backward_links";
    let btu = dim(k, "BT", bt)?;
    let args = Args::new(k)
        .output("links", links, btu)?
        .input("tokens", tokens, btu)?
        .i32(bt);
    if block.0 > LINKS_MAX_BLOCK {
        return Err(format!(
            "{k}: blockDim.x ({}) must be at most {LINKS_MAX_BLOCK} (the shared tile)",
            block.0
        ));
    }
    // SAFETY: the kernel touches links[bt] and tokens[bt] for bt < BT
    // (lengths checked) and tile[threadIdx.x] of its 256-entry shared tile
    // (blockDim.x checked).
    unsafe { args.launch(grid, block) }
}

/// `encoder_backward_wte_bf16`: [`encoder_backward_wte`] with bf16 storage,
/// each touched row loaded once, all of its token's contributions added in
/// f32 in `bt` order by walking the chains of `links`
/// ([`encoder_backward_links`]), rounded once: block `bt` works if `bt` is
/// its token's first position. The launcher (encoder.rs,
/// `encoder_backward_cuda`): grid `B·T`, block 128. Any `links` is
/// memory-safe (a chain ends at the first position not below `BT`).
pub fn encoder_backward_wte_bf16(
    grid: Dim3,
    block: Dim3,
    dwte: &mut [u16],
    dout: &[u16],
    tokens: &[u32],
    links: &[u32],
    bt: i32,
    c: i32,
) -> Result<(), String> {
    let k = "encoder_backward_wte_bf16";
    let (args, btu) = wte_args(k, dwte, dout, tokens, bt, c)?;
    let args = args.input("links", links, btu)?.i32s([bt, c]);
    // SAFETY: the kernel touches dwte[tok, c] for the tokens (each below V,
    // the rows of dwte), dout[r, c], tokens[r] and links[r] for r < BT (a
    // chain stops at the first link not below BT), c < C: checked above.
    unsafe { args.launch(grid, block) }
}

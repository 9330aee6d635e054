//! Token + position embedding.

use super::check_len;

/// `out[b, t, :] = wte[tokens[b, t], :] + wpe[t, :]`.
///
/// Every token must be `< V` (see [`check_tokens`](super::check_tokens));
/// `wpe` may have more rows than `t` (`maxT >= T`).
pub fn encoder_forward(
    out: &mut [f32], // (B, T, C)
    tokens: &[u32],  // (B, T)
    wte: &[f32],     // (V, C)
    wpe: &[f32],     // (maxT, C), maxT >= T
    b: usize,
    t: usize,
    c: usize,
) {
    check_len("encoder_forward", "out", out.len(), b * t * c);
    check_len("encoder_forward", "tokens", tokens.len(), b * t);
    assert!(
        wpe.len() >= t * c,
        "encoder_forward: `wpe` has fewer than T rows"
    );
    for (bt, (out_bt, &tok)) in out.chunks_exact_mut(c).zip(tokens).enumerate() {
        let pos = bt % t;
        let wte_ix = &wte[tok as usize * c..][..c];
        let wpe_t = &wpe[pos * c..][..c];
        for ((o, &e), &p) in out_bt.iter_mut().zip(wte_ix).zip(wpe_t) {
            *o = e + p;
        }
    }
}

/// Accumulates the embedding gradients: `dwte[tokens[b, t], :] += dout[b, t, :]`
/// and `dwpe[t, :] += dout[b, t, :]`.
pub fn encoder_backward(
    dwte: &mut [f32], // (V, C)
    dwpe: &mut [f32], // (maxT, C), maxT >= T
    dout: &[f32],     // (B, T, C)
    tokens: &[u32],   // (B, T)
    b: usize,
    t: usize,
    c: usize,
) {
    check_len("encoder_backward", "dout", dout.len(), b * t * c);
    check_len("encoder_backward", "tokens", tokens.len(), b * t);
    assert!(
        dwpe.len() >= t * c,
        "encoder_backward: `dwpe` has fewer than T rows"
    );
    for (bt, (dout_bt, &tok)) in dout.chunks_exact(c).zip(tokens).enumerate() {
        let pos = bt % t;
        let dwte_ix = &mut dwte[tok as usize * c..][..c];
        for (d, &g) in dwte_ix.iter_mut().zip(dout_bt) {
            *d += g;
        }
        let dwpe_t = &mut dwpe[pos * c..][..c];
        for (d, &g) in dwpe_t.iter_mut().zip(dout_bt) {
            *d += g;
        }
    }
}

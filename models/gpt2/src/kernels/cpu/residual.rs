//! Residual connection: elementwise sum.

use super::check_len;

/// `out = inp1 + inp2`.
pub fn residual_forward(
    out: &mut [f32], // (N)
    inp1: &[f32],    // (N)
    inp2: &[f32],    // (N)
) {
    let n = out.len();
    check_len("residual_forward", "inp1", inp1.len(), n);
    check_len("residual_forward", "inp2", inp2.len(), n);
    for ((o, &a), &b) in out.iter_mut().zip(inp1).zip(inp2) {
        *o = a + b;
    }
}

/// `dinp1 += dout; dinp2 += dout`.
pub fn residual_backward(
    dinp1: &mut [f32], // (N)
    dinp2: &mut [f32], // (N)
    dout: &[f32],      // (N)
) {
    let n = dout.len();
    check_len("residual_backward", "dinp1", dinp1.len(), n);
    check_len("residual_backward", "dinp2", dinp2.len(), n);
    for ((d1, d2), &g) in dinp1.iter_mut().zip(dinp2.iter_mut()).zip(dout) {
        *d1 += g;
        *d2 += g;
    }
}

//! Layer normalisation over the channel dimension.

use super::check_len;

/// The epsilon GPT-2 uses inside the square root (`layer_norm_epsilon`).
pub const LAYERNORM_EPS: f32 = 1e-5;

/// `out = (inp - mean) · rstd · weight + bias` per row, with the biased
/// variance; saves each row's `mean` and `rstd = 1 / sqrt(var + 1e-5)` for the
/// backward pass.
pub fn layernorm_forward(
    out: &mut [f32],  // (B, T, C)
    mean: &mut [f32], // (B, T)
    rstd: &mut [f32], // (B, T)
    inp: &[f32],      // (B, T, C)
    weight: &[f32],   // (C)
    bias: &[f32],     // (C)
    b: usize,
    t: usize,
    c: usize,
) {
    let n = b * t;
    check_len("layernorm_forward", "out", out.len(), n * c);
    check_len("layernorm_forward", "mean", mean.len(), n);
    check_len("layernorm_forward", "rstd", rstd.len(), n);
    check_len("layernorm_forward", "inp", inp.len(), n * c);
    check_len("layernorm_forward", "weight", weight.len(), c);
    check_len("layernorm_forward", "bias", bias.len(), c);
    let rows = out.chunks_exact_mut(c).zip(inp.chunks_exact(c));
    for (row, (out_bt, inp_bt)) in rows.enumerate() {
        let m = inp_bt.iter().map(|&x| x as f64).sum::<f64>() / c as f64;
        let var = inp_bt
            .iter()
            .map(|&x| {
                let d = x as f64 - m;
                d * d
            })
            .sum::<f64>()
            / c as f64;
        let s = 1.0 / (var + LAYERNORM_EPS as f64).sqrt();
        let (m, s) = (m as f32, s as f32);
        for (((o, &x), &w), &bb) in out_bt.iter_mut().zip(inp_bt).zip(weight).zip(bias) {
            *o = (x - m) * s * w + bb;
        }
        mean[row] = m;
        rstd[row] = s;
    }
}

/// Accumulates `dinp`, `dweight` and `dbias` from `dout`, using the `mean`
/// and `rstd` saved by [`layernorm_forward`].
pub fn layernorm_backward(
    dinp: &mut [f32],    // (B, T, C)
    dweight: &mut [f32], // (C)
    dbias: &mut [f32],   // (C)
    dout: &[f32],        // (B, T, C)
    inp: &[f32],         // (B, T, C)
    weight: &[f32],      // (C)
    mean: &[f32],        // (B, T)
    rstd: &[f32],        // (B, T)
    b: usize,
    t: usize,
    c: usize,
) {
    let n = b * t;
    check_len("layernorm_backward", "dinp", dinp.len(), n * c);
    check_len("layernorm_backward", "dweight", dweight.len(), c);
    check_len("layernorm_backward", "dbias", dbias.len(), c);
    check_len("layernorm_backward", "dout", dout.len(), n * c);
    check_len("layernorm_backward", "inp", inp.len(), n * c);
    check_len("layernorm_backward", "weight", weight.len(), c);
    check_len("layernorm_backward", "mean", mean.len(), n);
    check_len("layernorm_backward", "rstd", rstd.len(), n);
    for row in 0..n {
        let dout_bt = &dout[row * c..][..c];
        let inp_bt = &inp[row * c..][..c];
        let dinp_bt = &mut dinp[row * c..][..c];
        let (m, s) = (mean[row], rstd[row]);
        // Two reductions: mean(dnorm) and mean(dnorm · norm).
        let mut dnorm_mean = 0.0f64;
        let mut dnorm_norm_mean = 0.0f64;
        for i in 0..c {
            let norm_i = (inp_bt[i] - m) * s;
            let dnorm_i = weight[i] * dout_bt[i];
            dnorm_mean += dnorm_i as f64;
            dnorm_norm_mean += (dnorm_i * norm_i) as f64;
        }
        let dnorm_mean = (dnorm_mean / c as f64) as f32;
        let dnorm_norm_mean = (dnorm_norm_mean / c as f64) as f32;
        for i in 0..c {
            let norm_i = (inp_bt[i] - m) * s;
            let dnorm_i = weight[i] * dout_bt[i];
            dbias[i] += dout_bt[i];
            dweight[i] += norm_i * dout_bt[i];
            dinp_bt[i] += (dnorm_i - dnorm_mean - norm_i * dnorm_norm_mean) * s;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testutil::{fd_check, randn};
    use super::*;

    #[test]
    fn layernorm_backward_matches_finite_differences() {
        let (b, t, c) = (2, 3, 8);
        let inp = randn(b * t * c, 1.0, 10);
        let weight: Vec<f32> = randn(c, 0.3, 11).iter().map(|w| 1.0 + w).collect();
        let bias = randn(c, 0.3, 12);
        let probe = randn(b * t * c, 1.0, 13);
        let objective = |inp: &[f32], weight: &[f32], bias: &[f32]| -> f64 {
            let (mut out, mut mean, mut rstd) =
                (vec![0.0; b * t * c], vec![0.0; b * t], vec![0.0; b * t]);
            layernorm_forward(&mut out, &mut mean, &mut rstd, inp, weight, bias, b, t, c);
            out.iter()
                .zip(&probe)
                .map(|(&o, &p)| o as f64 * p as f64)
                .sum()
        };
        let (mut out, mut mean, mut rstd) =
            (vec![0.0; b * t * c], vec![0.0; b * t], vec![0.0; b * t]);
        layernorm_forward(
            &mut out, &mut mean, &mut rstd, &inp, &weight, &bias, b, t, c,
        );
        let mut dinp = vec![0.0; b * t * c];
        let mut dweight = vec![0.0; c];
        let mut dbias = vec![0.0; c];
        layernorm_backward(
            &mut dinp,
            &mut dweight,
            &mut dbias,
            &probe,
            &inp,
            &weight,
            &mean,
            &rstd,
            b,
            t,
            c,
        );
        fd_check(
            &inp,
            &dinp,
            |x| objective(x, &weight, &bias),
            "layernorm dinp",
        );
        fd_check(
            &weight,
            &dweight,
            |w| objective(&inp, w, &bias),
            "layernorm dweight",
        );
        fd_check(
            &bias,
            &dbias,
            |bb| objective(&inp, &weight, bb),
            "layernorm dbias",
        );
    }
}

//! Causal multi-head self-attention on a packed `qkv` activation.
//!
//! `inp` is `(B, T, 3C)`: for each position, the `C` query channels, then the
//! `C` key channels, then the `C` value channels; head `h` owns channels
//! `h·hs .. (h+1)·hs` of each, with `hs = C / NH`.

use super::check_len;

/// `out[b, t, h·hs..] = Σ_{t2 <= t} att[b, h, t, t2] · v[b, t2, h]` with
/// `att = softmax(q·k / sqrt(hs))` over the causal prefix.
///
/// Saves the scaled scores in `preatt` and the probabilities in `att`; the
/// masked upper triangle (`t2 > t`) of both is written as 0.
pub fn attention_forward(
    out: &mut [f32],    // (B, T, C)
    preatt: &mut [f32], // (B, NH, T, T)
    att: &mut [f32],    // (B, NH, T, T)
    inp: &[f32],        // (B, T, 3C)
    b: usize,
    t: usize,
    c: usize,
    nh: usize,
) {
    assert!(
        nh > 0 && c % nh == 0,
        "attention_forward: C ({c}) not divisible by NH ({nh})"
    );
    check_len("attention_forward", "out", out.len(), b * t * c);
    check_len("attention_forward", "preatt", preatt.len(), b * nh * t * t);
    check_len("attention_forward", "att", att.len(), b * nh * t * t);
    check_len("attention_forward", "inp", inp.len(), b * t * 3 * c);
    let hs = c / nh;
    let c3 = 3 * c;
    let scale = 1.0 / (hs as f32).sqrt();
    for bi in 0..b {
        let inp_b = &inp[bi * t * c3..][..t * c3];
        for ti in 0..t {
            for h in 0..nh {
                let query = &inp_b[ti * c3 + h * hs..][..hs];
                let row = ((bi * nh + h) * t + ti) * t;
                let preatt_row = &mut preatt[row..][..t];
                let att_row = &mut att[row..][..t];

                // pass 1: scores and their maximum
                let mut maxval = f32::NEG_INFINITY;
                for t2 in 0..=ti {
                    let key = &inp_b[t2 * c3 + c + h * hs..][..hs];
                    let dot: f32 = query.iter().zip(key).map(|(&q, &k)| q * k).sum();
                    let val = dot * scale;
                    preatt_row[t2] = val;
                    maxval = maxval.max(val);
                }
                preatt_row[ti + 1..].fill(0.0);

                // pass 2: softmax over the causal prefix
                let mut expsum = 0.0f64;
                for t2 in 0..=ti {
                    let e = (preatt_row[t2] - maxval).exp();
                    att_row[t2] = e;
                    expsum += e as f64;
                }
                let inv = (1.0 / expsum) as f32;
                for a in &mut att_row[..=ti] {
                    *a *= inv;
                }
                att_row[ti + 1..].fill(0.0);

                // pass 3: weighted sum of the values
                let out_h = &mut out[(bi * t + ti) * c + h * hs..][..hs];
                out_h.fill(0.0);
                for (t2, &a) in att_row[..=ti].iter().enumerate() {
                    let value = &inp_b[t2 * c3 + 2 * c + h * hs..][..hs];
                    for (o, &v) in out_h.iter_mut().zip(value) {
                        *o += a * v;
                    }
                }
            }
        }
    }
}

/// Accumulates `dinp` (the query, key and value gradients, packed like `inp`)
/// from `dout`, using the probabilities `att` saved by [`attention_forward`].
///
/// Needs no `preatt` and no scratch gradient buffers (unlike llm.c, which
/// keeps `datt` and `dpreatt` activations): each row of `datt` is recomputed
/// into a local vector.
pub fn attention_backward(
    dinp: &mut [f32], // (B, T, 3C)
    dout: &[f32],     // (B, T, C)
    inp: &[f32],      // (B, T, 3C)
    att: &[f32],      // (B, NH, T, T)
    b: usize,
    t: usize,
    c: usize,
    nh: usize,
) {
    assert!(
        nh > 0 && c % nh == 0,
        "attention_backward: C ({c}) not divisible by NH ({nh})"
    );
    check_len("attention_backward", "dinp", dinp.len(), b * t * 3 * c);
    check_len("attention_backward", "dout", dout.len(), b * t * c);
    check_len("attention_backward", "inp", inp.len(), b * t * 3 * c);
    check_len("attention_backward", "att", att.len(), b * nh * t * t);
    let hs = c / nh;
    let c3 = 3 * c;
    let scale = 1.0 / (hs as f32).sqrt();
    let mut datt = vec![0.0f32; t]; // (T) one row of d(att)
    let mut dpreatt = vec![0.0f32; t]; // (T) one row of d(preatt)
    for bi in 0..b {
        let inp_b = &inp[bi * t * c3..][..t * c3];
        let dinp_b = &mut dinp[bi * t * c3..][..t * c3];
        for ti in 0..t {
            for h in 0..nh {
                let row = ((bi * nh + h) * t + ti) * t;
                let att_row = &att[row..][..=ti];
                let dout_h = &dout[(bi * t + ti) * c + h * hs..][..hs];

                // backward through out = Σ att · v
                for (t2, &a) in att_row.iter().enumerate() {
                    let value = &inp_b[t2 * c3 + 2 * c + h * hs..][..hs];
                    datt[t2] = value.iter().zip(dout_h).map(|(&v, &g)| v * g).sum();
                    let dvalue = &mut dinp_b[t2 * c3 + 2 * c + h * hs..][..hs];
                    for (dv, &g) in dvalue.iter_mut().zip(dout_h) {
                        *dv += a * g;
                    }
                }

                // backward through the softmax: dpre = att · (datt - Σ att·datt)
                let dot: f64 = att_row
                    .iter()
                    .zip(&datt)
                    .map(|(&a, &d)| a as f64 * d as f64)
                    .sum();
                let dot = dot as f32;
                for ((dp, &a), &d) in dpreatt.iter_mut().zip(att_row).zip(&datt) {
                    *dp = a * (d - dot);
                }

                // backward through preatt = q·k · scale
                for t2 in 0..=ti {
                    let g = dpreatt[t2] * scale;
                    // query (row ti) and key (row t2) may be the same row of
                    // `inp`, but they are different channel ranges.
                    for i in 0..hs {
                        let q = inp_b[ti * c3 + h * hs + i];
                        let k = inp_b[t2 * c3 + c + h * hs + i];
                        dinp_b[ti * c3 + h * hs + i] += k * g;
                        dinp_b[t2 * c3 + c + h * hs + i] += q * g;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testutil::{assert_close, fd_check, randn};
    use super::*;

    const B: usize = 2;
    const T: usize = 4;
    const C: usize = 8;
    const NH: usize = 2;

    fn forward(inp: &[f32]) -> (Vec<f32>, Vec<f32>) {
        let mut out = vec![0.0; B * T * C];
        let mut preatt = vec![f32::NAN; B * NH * T * T];
        let mut att = vec![f32::NAN; B * NH * T * T];
        attention_forward(&mut out, &mut preatt, &mut att, inp, B, T, C, NH);
        assert!(preatt.iter().all(|x| x.is_finite()));
        (out, att)
    }

    #[test]
    fn attention_is_causal_and_rows_sum_to_one() {
        let inp = randn(B * T * 3 * C, 1.0, 30);
        let (out, att) = forward(&inp);
        for row in att.chunks_exact(T).enumerate() {
            let (r, a) = row;
            let ti = r % T;
            assert!((a.iter().sum::<f32>() - 1.0).abs() < 1e-6);
            assert!(a[ti + 1..].iter().all(|&x| x == 0.0));
        }
        // Position 0 attends only to itself: its output is its own value.
        for h in 0..NH {
            let hs = C / NH;
            let v0 = &inp[2 * C + h * hs..][..hs];
            assert_close(&out[h * hs..][..hs], v0, 1e-6, 1e-6, "out[0]");
        }
        // Changing the last position must not change earlier outputs.
        let mut inp2 = inp.clone();
        for x in &mut inp2[(T - 1) * 3 * C..T * 3 * C] {
            *x += 1.0;
        }
        let (out2, _) = forward(&inp2);
        assert_eq!(out[..(T - 1) * C], out2[..(T - 1) * C]);
    }

    #[test]
    fn attention_backward_matches_finite_differences() {
        let inp = randn(B * T * 3 * C, 1.0, 31);
        let probe = randn(B * T * C, 1.0, 32);
        let (_, att) = forward(&inp);
        let mut dinp = vec![0.0; inp.len()];
        attention_backward(&mut dinp, &probe, &inp, &att, B, T, C, NH);
        fd_check(
            &inp,
            &dinp,
            |x| {
                let (out, _) = forward(x);
                out.iter()
                    .zip(&probe)
                    .map(|(&o, &p)| o as f64 * p as f64)
                    .sum()
            },
            "attention dinp",
        );
    }
}

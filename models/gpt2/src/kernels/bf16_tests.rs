//! Every CPU kernel (the fused ones included) with bf16 storage against the
//! same kernel with `f32` storage, on odd shapes.
//!
//! The inputs are bf16 values (random numbers rounded to bf16), given to the
//! `f32` kernel as their exact `f32` values. Since a bf16 kernel computes in
//! `f32` and rounds once per stored element, each bf16 output must be
//! *exactly* the bf16 rounding of the `f32` kernel's output, bit for bit;
//! statistics kept in `f32` (layer norm `mean`/`rstd`, losses, the norm, the
//! master weights) must be equal. A kernel that rounded an intermediate, or
//! rounded a gradient after each contribution instead of once, fails.
//! `chain_error_is_bf16_sized` then checks that bf16 storage through a small
//! forward and backward stays within bf16 tolerances of `f32` on unrounded
//! inputs.

use super::cpu::*;
use super::storage::{Bf16, Storage};
use super::testutil::{assert_close, max_errors, randn};
use crate::checkpoint::AdamWHyper;

// Odd shapes: nothing a multiple of anything.
const B: usize = 2;
const T: usize = 5;
const C: usize = 9;
const NH: usize = 3;
const OC: usize = 7;
const V: usize = 13;

/// `n` random values with standard deviation `std`, rounded to bf16: the
/// bf16 values and their exact `f32` values.
fn rand_bf16(n: usize, std: f32, seed: u64) -> (Vec<Bf16>, Vec<f32>) {
    let h: Vec<Bf16> = randn(n, std, seed).into_iter().map(Bf16::store).collect();
    let f = h.iter().map(|x| x.load()).collect();
    (h, f)
}

/// Asserts that `got` is the bf16 rounding of `want`, bit for bit.
#[track_caller]
fn assert_rounded(got: &[Bf16], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert_eq!(
            g,
            Bf16::store(w),
            "{what}[{i}]: got {}, the rounding of the f32 kernel's {w} is {}",
            g.load(),
            Bf16::store(w).load()
        );
    }
}

/// The exact `f32` values of `h`.
fn wide(h: &[Bf16]) -> Vec<f32> {
    h.iter().map(|x| x.load()).collect()
}

fn tokens(n: usize, seed: u64) -> Vec<u32> {
    // Few distinct ids, so that embedding rows receive several contributions.
    (0..n as u32).map(|i| (i * 7 + seed as u32) % 4).collect()
}

#[test]
fn elementwise_kernels_round_once() {
    let n = B * T * C;
    let (x, xf) = rand_bf16(n, 1.5, 1);
    let (y, yf) = rand_bf16(n, 1.0, 2);
    let (d0, d0f) = rand_bf16(n, 0.3, 3);

    let (mut out, mut outf) = (vec![Bf16::default(); n], vec![0.0f32; n]);
    gelu_forward(&mut out, &x);
    gelu_forward(&mut outf, &xf);
    assert_rounded(&out, &outf, "gelu_forward");

    let (mut d, mut df) = (d0.clone(), d0f.clone());
    gelu_backward(&mut d, &x, &y);
    gelu_backward(&mut df, &xf, &yf);
    assert_rounded(&d, &df, "gelu_backward");

    residual_forward(&mut out, &x, &y);
    residual_forward(&mut outf, &xf, &yf);
    assert_rounded(&out, &outf, "residual_forward");

    let (mut d1, mut d1f) = (d0.clone(), d0f.clone());
    let (mut d2, mut d2f) = (y.clone(), yf.clone());
    residual_backward(&mut d1, &mut d2, &x);
    residual_backward(&mut d1f, &mut d2f, &xf);
    assert_rounded(&d1, &d1f, "residual_backward dinp1");
    assert_rounded(&d2, &d2f, "residual_backward dinp2");

    let (mut s, mut sf) = (x.clone(), xf.clone());
    scale_in_place(&mut s, 0.3);
    scale_in_place(&mut sf, 0.3);
    assert_rounded(&s, &sf, "scale_in_place");
    assert_eq!(grad_norm_sq(&x), grad_norm_sq(&xf), "grad_norm_sq");
}

#[test]
fn encoder_rounds_each_gradient_row_once() {
    let toks = tokens(B * T, 1);
    let (wte, wtef) = rand_bf16(V * C, 0.5, 4);
    let (wpe, wpef) = rand_bf16((T + 2) * C, 0.5, 5);
    let (mut out, mut outf) = (vec![Bf16::default(); B * T * C], vec![0.0; B * T * C]);
    encoder_forward(&mut out, &toks, &wte, &wpe, B, T, C);
    encoder_forward(&mut outf, &toks, &wtef, &wpef, B, T, C);
    assert_rounded(&out, &outf, "encoder_forward");

    // Small gradients onto larger accumulators: rounding after each of a
    // row's several contributions would lose most of them.
    let (dout, doutf) = rand_bf16(B * T * C, 0.01, 6);
    let (mut dwte, mut dwtef) = rand_bf16(V * C, 1.0, 7);
    let (mut dwpe, mut dwpef) = rand_bf16((T + 2) * C, 1.0, 8);
    encoder_backward(&mut dwte, &mut dwpe, &dout, &toks, B, T, C);
    encoder_backward(&mut dwtef, &mut dwpef, &doutf, &toks, B, T, C);
    assert_rounded(&dwte, &dwtef, "encoder_backward dwte");
    assert_rounded(&dwpe, &dwpef, "encoder_backward dwpe");
}

#[test]
fn layernorm_matches_f32_statistics_and_rounds_outputs() {
    let n = B * T;
    let (inp, inpf) = rand_bf16(n * C, 2.0, 9);
    let (w, wf) = rand_bf16(C, 1.0, 10);
    let (bias, biasf) = rand_bf16(C, 0.5, 11);
    let mut out = vec![Bf16::default(); n * C];
    let mut outf = vec![0.0; n * C];
    let (mut mean, mut rstd) = (vec![0.0; n], vec![0.0; n]);
    let (mut meanf, mut rstdf) = (vec![0.0; n], vec![0.0; n]);
    layernorm_forward(&mut out, &mut mean, &mut rstd, &inp, &w, &bias, B, T, C);
    layernorm_forward(
        &mut outf, &mut meanf, &mut rstdf, &inpf, &wf, &biasf, B, T, C,
    );
    assert_rounded(&out, &outf, "layernorm_forward out");
    assert_eq!(mean, meanf, "layernorm_forward mean");
    assert_eq!(rstd, rstdf, "layernorm_forward rstd");

    let (dout, doutf) = rand_bf16(n * C, 0.1, 12);
    let (mut dinp, mut dinpf) = rand_bf16(n * C, 0.2, 13);
    let (mut dw, mut dwf) = rand_bf16(C, 0.2, 14);
    let (mut db, mut dbf) = rand_bf16(C, 0.2, 15);
    layernorm_backward(
        &mut dinp, &mut dw, &mut db, &dout, &inp, &w, &mean, &rstd, B, T, C,
    );
    layernorm_backward(
        &mut dinpf, &mut dwf, &mut dbf, &doutf, &inpf, &wf, &meanf, &rstdf, B, T, C,
    );
    assert_rounded(&dinp, &dinpf, "layernorm_backward dinp");
    assert_rounded(&dw, &dwf, "layernorm_backward dweight");
    assert_rounded(&db, &dbf, "layernorm_backward dbias");
}

#[test]
fn matmul_sums_in_f32_and_rounds_once() {
    let n = B * T;
    let (inp, inpf) = rand_bf16(n * C, 1.0, 16);
    let (w, wf) = rand_bf16(OC * C, 0.3, 17);
    let (bias, biasf) = rand_bf16(OC, 0.3, 18);
    for with_bias in [false, true] {
        let mut out = vec![Bf16::default(); n * OC];
        let mut outf = vec![0.0; n * OC];
        let (bh, bf) = if with_bias {
            (Some(&bias[..]), Some(&biasf[..]))
        } else {
            (None, None)
        };
        matmul_forward(&mut out, &inp, &w, bh, B, T, C, OC);
        matmul_forward(&mut outf, &inpf, &wf, bf, B, T, C, OC);
        assert_rounded(&out, &outf, "matmul_forward");
    }

    let (dout, doutf) = rand_bf16(n * OC, 0.1, 19);
    let (mut dinp, mut dinpf) = rand_bf16(n * C, 0.5, 20);
    matmul_backward_input(&mut dinp, &dout, &w, B, T, C, OC);
    matmul_backward_input(&mut dinpf, &doutf, &wf, B, T, C, OC);
    assert_rounded(&dinp, &dinpf, "matmul_backward_input");

    let (mut dw, mut dwf) = rand_bf16(OC * C, 0.5, 21);
    let (mut db, mut dbf) = rand_bf16(OC, 0.5, 22);
    matmul_backward_weight(&mut dw, Some(&mut db), &dout, &inp, B, T, C, OC);
    matmul_backward_weight(&mut dwf, Some(&mut dbf), &doutf, &inpf, B, T, C, OC);
    assert_rounded(&dw, &dwf, "matmul_backward_weight dweight");
    assert_rounded(&db, &dbf, "matmul_backward_weight dbias");
}

#[test]
fn attention_computes_in_f32_and_rounds_what_it_stores() {
    let (inp, inpf) = rand_bf16(B * T * 3 * C, 1.0, 23);
    let tt = B * NH * T * T;
    let mut out = vec![Bf16::default(); B * T * C];
    let (mut preatt, mut att) = (vec![Bf16::default(); tt], vec![Bf16::default(); tt]);
    let mut outf = vec![0.0; B * T * C];
    let (mut preattf, mut attf) = (vec![0.0; tt], vec![0.0; tt]);
    attention_forward(&mut out, &mut preatt, &mut att, &inp, B, T, C, NH);
    attention_forward(&mut outf, &mut preattf, &mut attf, &inpf, B, T, C, NH);
    assert_rounded(&out, &outf, "attention_forward out");
    assert_rounded(&preatt, &preattf, "attention_forward preatt");
    assert_rounded(&att, &attf, "attention_forward att");

    // Backward reads the stored (rounded) probabilities: give the f32
    // kernel the same ones.
    let att_wide = wide(&att);
    let (dout, doutf) = rand_bf16(B * T * C, 0.2, 24);
    let (mut dinp, mut dinpf) = rand_bf16(B * T * 3 * C, 0.5, 25);
    attention_backward(&mut dinp, &dout, &inp, &att, B, T, C, NH);
    attention_backward(&mut dinpf, &doutf, &inpf, &att_wide, B, T, C, NH);
    assert_rounded(&dinp, &dinpf, "attention_backward");
}

#[test]
fn softmax_and_loss_take_the_loss_from_f32_probabilities() {
    let n = B * T;
    let (logits, logitsf) = rand_bf16(n * V, 3.0, 26);
    let targets: Vec<u32> = (0..n as u32).map(|i| (i * 5) % V as u32).collect();
    let mut probs = vec![Bf16::default(); n * V];
    let mut probsf = vec![0.0; n * V];
    softmax_forward(&mut probs, &logits, B, T, V, V);
    softmax_forward(&mut probsf, &logitsf, B, T, V, V);
    assert_rounded(&probs, &probsf, "softmax_forward");

    let (mut losses, mut lossesf) = (vec![0.0; n], vec![0.0; n]);
    softmax_crossentropy_forward(&mut probs, &mut losses, &logits, &targets, B, T, V, V);
    softmax_crossentropy_forward(&mut probsf, &mut lossesf, &logitsf, &targets, B, T, V, V);
    assert_rounded(&probs, &probsf, "softmax_crossentropy_forward probs");
    assert_eq!(losses, lossesf, "softmax_crossentropy_forward losses");
    // With f32 storage, the fused kernel is the two kernels in turn.
    let mut two = vec![0.0; n];
    crossentropy_forward(&mut two, &probsf, &targets, B, T, V, V);
    assert_eq!(two, lossesf);
    // From the rounded probabilities instead, the loss would be off by up to
    // half a bf16 ulp relative (2^-9): the fused kernel does not do that.
    let mut from_rounded = vec![0.0; n];
    crossentropy_forward(&mut from_rounded, &probs, &targets, B, T, V, V);
    assert_close(&from_rounded, &lossesf, 0.0, 4e-3, "loss of rounded probs");
    assert_ne!(
        from_rounded, lossesf,
        "rounding the probs changes some loss"
    );

    let probs_wide = wide(&probs);
    let (mut dl, mut dlf) = rand_bf16(n * V, 0.05, 27);
    crossentropy_softmax_backward(&mut dl, &probs, &targets, 0.7, B, T, V, V);
    crossentropy_softmax_backward(&mut dlf, &probs_wide, &targets, 0.7, B, T, V, V);
    assert_rounded(&dl, &dlf, "crossentropy_softmax_backward");
}

#[test]
fn adamw_mixed_updates_f32_master_weights_and_rounds_the_copy() {
    let n = 37;
    let (g, gf) = rand_bf16(n, 0.1, 28);
    let master0 = randn(n, 0.5, 29); // not bf16 values: masters keep f32 bits
    let h = AdamWHyper {
        learning_rate: 1e-2,
        weight_decay: 0.1,
        ..AdamWHyper::default()
    };
    for scale in [None, Some(0.25f32)] {
        let mut master = master0.clone();
        let mut params = vec![Bf16::default(); n];
        let (mut m, mut v) = (vec![0.0; n], vec![0.0; n]);
        let mut masterf = master0.clone();
        let (mut mf, mut vf) = (vec![0.0; n], vec![0.0; n]);
        for step in 1..=3 {
            adamw_update_mixed(&mut params, &mut master, &g, &mut m, &mut v, scale, step, h);
            let gs: Vec<f32> = gf.iter().map(|&x| x * scale.unwrap_or(1.0)).collect();
            adamw_update(
                &mut masterf,
                &gs,
                &mut mf,
                &mut vf,
                step,
                h.learning_rate,
                h.beta1,
                h.beta2,
                h.eps,
                h.weight_decay,
            );
            assert_eq!(master, masterf, "master weights, step {step}");
            assert_eq!((&m, &v), (&mf, &vf), "moments, step {step}");
            assert_rounded(&params, &masterf, "stored weights");
        }
        assert_ne!(master, master0, "the step moved the weights");
    }
}

/// Layer norm → matrix product → GELU, forward and backward, in bf16
/// storage against `f32` on unrounded inputs: every stored tensor carries a
/// relative rounding error of at most 2^-9, and each kernel adds at most one
/// more, so after three kernels the outputs are within a few 2^-8 of `f32`
/// (here: 3e-2 relative plus 3e-3 absolute; gradients, which are sums of
/// signed products, within 5e-2 relative of their largest element).
#[test]
fn chain_error_is_bf16_sized() {
    let n = B * T;
    let inpf = randn(n * C, 1.0, 30);
    let wlnf = randn(C, 1.0, 31);
    let blnf = randn(C, 0.2, 32);
    let wf = randn(OC * C, 0.3, 33);
    let bf = randn(OC, 0.1, 34);
    let doutf = randn(n * OC, 0.1, 35);
    let h = |x: &[f32]| -> Vec<Bf16> { x.iter().map(|&v| Bf16::store(v)).collect() };

    let run_f32 = || {
        let (mut ln, mut mean, mut rstd) = (vec![0.0; n * C], vec![0.0; n], vec![0.0; n]);
        layernorm_forward(&mut ln, &mut mean, &mut rstd, &inpf, &wlnf, &blnf, B, T, C);
        let mut mm = vec![0.0; n * OC];
        matmul_forward(&mut mm, &ln, &wf, Some(&bf), B, T, C, OC);
        let mut out = vec![0.0; n * OC];
        gelu_forward(&mut out, &mm);
        let mut dmm = vec![0.0; n * OC];
        gelu_backward(&mut dmm, &mm, &doutf);
        let (mut dln, mut dw) = (vec![0.0; n * C], vec![0.0; OC * C]);
        matmul_backward_input(&mut dln, &dmm, &wf, B, T, C, OC);
        matmul_backward_weight(&mut dw, None, &dmm, &ln, B, T, C, OC);
        let (mut dinp, mut dwln, mut dbln) = (vec![0.0; n * C], vec![0.0; C], vec![0.0; C]);
        layernorm_backward(
            &mut dinp, &mut dwln, &mut dbln, &dln, &inpf, &wlnf, &mean, &rstd, B, T, C,
        );
        (out, dw, dinp, dwln)
    };
    let run_bf16 = || {
        let z = Bf16::default();
        let (mut ln, mut mean, mut rstd) = (vec![z; n * C], vec![0.0; n], vec![0.0; n]);
        let (inp, wln, bln, w) = (h(&inpf), h(&wlnf), h(&blnf), h(&wf));
        layernorm_forward(&mut ln, &mut mean, &mut rstd, &inp, &wln, &bln, B, T, C);
        let mut mm = vec![z; n * OC];
        matmul_forward(&mut mm, &ln, &w, Some(&h(&bf)), B, T, C, OC);
        let mut out = vec![z; n * OC];
        gelu_forward(&mut out, &mm);
        let mut dmm = vec![z; n * OC];
        gelu_backward(&mut dmm, &mm, &h(&doutf));
        let (mut dln, mut dw) = (vec![z; n * C], vec![z; OC * C]);
        matmul_backward_input(&mut dln, &dmm, &w, B, T, C, OC);
        matmul_backward_weight(&mut dw, None, &dmm, &ln, B, T, C, OC);
        let (mut dinp, mut dwln, mut dbln) = (vec![z; n * C], vec![z; C], vec![z; C]);
        layernorm_backward(
            &mut dinp, &mut dwln, &mut dbln, &dln, &inp, &wln, &mean, &rstd, B, T, C,
        );
        (wide(&out), wide(&dw), wide(&dinp), wide(&dwln))
    };
    let (f, hb) = (run_f32(), run_bf16());
    assert_close(&hb.0, &f.0, 3e-3, 3e-2, "gelu output");
    for (got, want, what) in [
        (&hb.1, &f.1, "dweight"),
        (&hb.2, &f.2, "dinp"),
        (&hb.3, &f.3, "dln weight"),
    ] {
        let scale = want.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        assert_close(got, want, 5e-2 * scale, 0.0, what);
    }
    // Not accidentally f32: the outputs do differ.
    let (abs, _) = max_errors(&hb.0, &f.0);
    assert!(abs > 0.0, "bf16 storage gave f32's results exactly");
}

#[test]
fn fused_attention_and_classifier_round_once() {
    let (inp, inpf) = rand_bf16(B * T * 3 * C, 1.0, 36);
    let nl = B * NH * T;
    let mut out = vec![Bf16::default(); B * T * C];
    let mut outf = vec![0.0; B * T * C];
    let (mut lse, mut lsef) = (vec![0.0; nl], vec![0.0; nl]);
    // Tiles that do not divide T.
    flash_attention_forward(&mut out, &mut lse, &inp, B, T, C, NH, 2, 3);
    flash_attention_forward(&mut outf, &mut lsef, &inpf, B, T, C, NH, 2, 3);
    assert_rounded(&out, &outf, "flash_attention_forward out");
    assert_eq!(lse, lsef, "flash_attention_forward lse");

    let out_wide = wide(&out);
    let (dout, doutf) = rand_bf16(B * T * C, 0.2, 37);
    let (mut dinp, mut dinpf) = rand_bf16(B * T * 3 * C, 0.5, 38);
    let (mut delta, mut deltaf) = (vec![0.0; nl], vec![0.0; nl]);
    flash_attention_backward(
        &mut dinp, &mut delta, &dout, &inp, &out, &lse, B, T, C, NH, 2, 3,
    );
    flash_attention_backward(
        &mut dinpf,
        &mut deltaf,
        &doutf,
        &inpf,
        &out_wide,
        &lsef,
        B,
        T,
        C,
        NH,
        2,
        3,
    );
    assert_rounded(&dinp, &dinpf, "flash_attention_backward");

    // Padded rows: Vp = V + 3.
    let (n, vp) = (B * T, V + 3);
    let targets: Vec<u32> = (0..n as u32).map(|i| (i * 3) % V as u32).collect();
    let (logits, logitsf) = rand_bf16(n * vp, 2.0, 39);
    let (mut losses, mut lossesf) = (vec![0.0; n], vec![0.0; n]);
    classifier_losses(&mut losses, &logits, &targets, n, V, vp);
    classifier_losses(&mut lossesf, &logitsf, &targets, n, V, vp);
    assert_eq!(losses, lossesf, "classifier_losses");
    let (mut grad, mut gradf) = (logits.clone(), logitsf.clone());
    fused_classifier(&mut grad, &mut losses, &targets, Some(0.5), n, V, vp);
    fused_classifier(&mut gradf, &mut lossesf, &targets, Some(0.5), n, V, vp);
    assert_rounded(&grad, &gradf, "fused_classifier dlogits");
    assert_eq!(losses, lossesf, "fused_classifier losses");
}

//! On the GPU: each kernel family's `f32` task against its CPU kernel on the
//! same inputs.

use super::*;

#[test]
fn encoder_matches_cpu() {
    let Some(g) = Dev::gpu("cuda_kernels::encoder_matches_cpu") else {
        return;
    };
    let max_t = T + 5; // wpe may have more rows than T
    let (wte, wpe) = (randn(V * C, 1.0, 1), randn(max_t * C, 1.0, 2));
    let tok = tokens(B * T, 3);
    let mut want = vec![0.0; B * T * C];
    cpu::encoder_forward(&mut want, &tok, &wte, &wpe, B, T, C);
    let (dwte, dwpe, dtok, out) = (g.up(&wte), g.up(&wpe), g.up_u32(&tok), g.zeros(B * T * C));
    let (o, tk, te, pe) = (out.whole(), dtok.whole(), dwte.whole(), dwpe.whole());
    // SAFETY: every token id is < V (checked by `tokens`).
    done(unsafe { encoder::forward(g.rt.task("encoder_forward"), &o, &tk, &te, &pe, B, T, C) });
    compare("encoder_forward", &g.down(&out), &want, 0.0, 0.0);

    let dout = randn(B * T * C, 1.0, 4);
    let (mut gwte, mut gwpe) = (randn(V * C, 0.1, 5), randn(max_t * C, 0.1, 6));
    let (bwte, bwpe, bdout) = (g.up(&gwte), g.up(&gwpe), g.up(&dout));
    cpu::encoder_backward(&mut gwte, &mut gwpe, &dout, &tok, B, T, C);
    let (te, pe, d) = (bwte.whole(), bwpe.whole(), bdout.whole());
    let links = g.zeros(B * T);
    let lk = links.whole();
    // SAFETY: every token id is < V (checked by `tokens`).
    done(unsafe {
        encoder::backward(
            g.rt.task("encoder_backward"),
            &te,
            &pe,
            &d,
            &tk,
            &lk,
            B,
            T,
            C,
        )
    });
    // Same summation order as the CPU: bitwise equal.
    compare("encoder_backward dwpe", &g.down(&bwpe), &gwpe, 0.0, 0.0);
    compare("encoder_backward dwte", &g.down(&bwte), &gwte, 0.0, 0.0);
}

#[test]
fn layernorm_matches_cpu_and_is_deterministic() {
    let Some(g) = Dev::gpu("cuda_kernels::layernorm_matches_cpu_and_is_deterministic") else {
        return;
    };
    let n = LN_ROWS;
    let inp = randn(n * C, 2.0, 10);
    let w: Vec<f32> = randn(C, 0.3, 11).iter().map(|x| 1.0 + x).collect();
    let bias = randn(C, 0.3, 12);
    let (mut out, mut mean, mut rstd) = (vec![0.0; n * C], vec![0.0; n], vec![0.0; n]);
    cpu::layernorm_forward(&mut out, &mut mean, &mut rstd, &inp, &w, &bias, 1, n, C);
    let (dinp, dw, db) = (g.up(&inp), g.up(&w), g.up(&bias));
    let (gout, gmean, grstd) = (g.zeros(n * C), g.zeros(n), g.zeros(n));
    let v = [&gout, &gmean, &grstd, &dinp, &dw, &db].map(|b| b.whole());
    done(layernorm::forward(
        g.rt.task("layernorm_forward"),
        &v[0],
        &v[1],
        &v[2],
        &v[3],
        &v[4],
        &v[5],
        n,
        C,
    ));
    compare("layernorm_forward out", &g.down(&gout), &out, 1e-5, 1e-4);
    compare("layernorm_forward mean", &g.down(&gmean), &mean, 1e-6, 1e-4);
    compare("layernorm_forward rstd", &g.down(&grstd), &rstd, 1e-6, 1e-4);

    let dout = randn(n * C, 1.0, 13);
    let (mut gi, mut gw, mut gb) = (randn(n * C, 0.1, 14), randn(C, 0.1, 15), randn(C, 0.1, 16));
    let mut results = Vec::new();
    for _ in 0..2 {
        let (bi, bw, bb, bdout) = (g.up(&gi), g.up(&gw), g.up(&gb), g.up(&dout));
        let scratch = g.zeros(layernorm::backward_scratch_bytes(n, C) / 4);
        let v = [&bi, &bw, &bb, &bdout, &dinp, &dw, &gmean, &grstd, &scratch].map(|b| b.whole());
        done(layernorm::backward(
            g.rt.task("layernorm_backward"),
            &v[0],
            &v[1],
            &v[2],
            &v[3],
            &v[4],
            &v[5],
            &v[6],
            &v[7],
            &v[8],
            n,
            C,
        ));
        results.push((g.down(&bi), g.down(&bw), g.down(&bb)));
    }
    assert!(
        results[0] == results[1],
        "layernorm_backward is not deterministic"
    );
    cpu::layernorm_backward(
        &mut gi, &mut gw, &mut gb, &dout, &inp, &w, &mean, &rstd, 1, n, C,
    );
    compare("layernorm_backward dinp", &results[0].0, &gi, 1e-5, 1e-4);
    compare("layernorm_backward dweight", &results[0].1, &gw, 1e-4, 1e-4);
    compare("layernorm_backward dbias", &results[0].2, &gb, 1e-4, 1e-4);
}

#[test]
fn matmul_matches_cpu() {
    let Some(g) = Dev::gpu("cuda_kernels::matmul_matches_cpu") else {
        return;
    };
    let (n, oc) = (B * T, 3 * C);
    let inp = randn(n * C, 1.0, 20);
    let w = randn(oc * C, 0.2, 21);
    let bias = randn(oc, 0.5, 22);
    let (binp, bw, bbias) = (g.up(&inp), g.up(&w), g.up(&bias));
    for with_bias in [true, false] {
        let mut want = vec![0.0; n * oc];
        cpu::matmul_forward(
            &mut want,
            &inp,
            &w,
            with_bias.then_some(&bias[..]),
            B,
            T,
            C,
            oc,
        );
        let out = g.zeros(n * oc);
        let v = [&out, &binp, &bw, &bbias].map(|b| b.whole());
        let b = with_bias.then_some(&v[3]);
        done(matmul::forward(
            g.rt.task("matmul_forward"),
            &v[0],
            &v[1],
            &v[2],
            b,
            n,
            C,
            oc,
        ));
        compare(
            &format!("matmul_forward (bias: {with_bias})"),
            &g.down(&out),
            &want,
            1e-4,
            1e-4,
        );
    }

    let dout = randn(n * oc, 1.0, 23);
    let bdout = g.up(&dout);
    let mut gi = randn(n * C, 0.1, 24);
    let bgi = g.up(&gi);
    cpu::matmul_backward_input(&mut gi, &dout, &w, B, T, C, oc);
    let v = [&bgi, &bdout, &bw].map(|b| b.whole());
    done(matmul::backward_input(
        g.rt.task("matmul_backward_input"),
        &v[0],
        GradWrite::Add,
        &v[1],
        &v[2],
        n,
        C,
        oc,
    ));
    compare("matmul_backward_input", &g.down(&bgi), &gi, 1e-4, 1e-4);
    // Written over (cuBLAS beta 0): the buffer's result above is not read.
    let mut fresh = vec![0.0; n * C];
    cpu::matmul_backward_input(&mut fresh, &dout, &w, B, T, C, oc);
    done(matmul::backward_input(
        g.rt.task("matmul_backward_input set"),
        &v[0],
        GradWrite::Set,
        &v[1],
        &v[2],
        n,
        C,
        oc,
    ));
    compare(
        "matmul_backward_input set",
        &g.down(&bgi),
        &fresh,
        1e-4,
        1e-4,
    );

    for with_bias in [true, false] {
        let (mut gw, mut gb) = (randn(oc * C, 0.1, 25), randn(oc, 0.1, 26));
        let (bgw, bgb) = (g.up(&gw), g.up(&gb));
        let gb_before = gb.clone();
        cpu::matmul_backward_weight(
            &mut gw,
            with_bias.then_some(&mut gb[..]),
            &dout,
            &inp,
            B,
            T,
            C,
            oc,
        );
        let v = [&bgw, &bgb, &bdout, &binp].map(|b| b.whole());
        let dbias = with_bias.then_some(&v[1]);
        done(matmul::backward_weight(
            g.rt.task("matmul_backward_weight"),
            &v[0],
            dbias,
            &v[2],
            &v[3],
            n,
            C,
            oc,
        ));
        compare(
            "matmul_backward_weight dweight",
            &g.down(&bgw),
            &gw,
            1e-4,
            1e-4,
        );
        let got_b = g.down(&bgb);
        compare("matmul_backward_weight dbias", &got_b, &gb, 1e-4, 1e-4);
        if !with_bias {
            assert_eq!(got_b, gb_before, "dbias touched without a bias");
        }
    }
}

#[test]
fn attention_matches_cpu_and_is_deterministic() {
    let Some(g) = Dev::gpu("cuda_kernels::attention_matches_cpu_and_is_deterministic") else {
        return;
    };
    let bnh = B * NH;
    let inp = randn(B * T * 3 * C, 1.0, 30);
    let (mut out, mut preatt, mut att) = (
        vec![0.0; B * T * C],
        vec![0.0; bnh * T * T],
        vec![0.0; bnh * T * T],
    );
    cpu::attention_forward(&mut out, &mut preatt, &mut att, &inp, B, T, C, NH);

    let binp = g.up(&inp);
    let (gout, gpre, gatt) = (
        g.zeros(B * T * C),
        g.zeros(bnh * T * T),
        g.zeros(bnh * T * T),
    );
    let fwd_scratch = g.zeros(attention::forward_scratch_bytes(B, T, C, NH, Dtype::F32) / 4);
    let v = [&gout, &gpre, &gatt, &binp, &fwd_scratch].map(|b| b.whole());
    done(attention::forward(
        g.rt.task("attention_forward"),
        &v[0],
        &v[1],
        &v[2],
        &v[3],
        &v[4],
        B,
        T,
        C,
        NH,
    ));
    let gatt_host = g.down(&gatt);
    compare("attention_forward att", &gatt_host, &att, 1e-6, 1e-4);
    compare("attention_forward out", &g.down(&gout), &out, 1e-5, 1e-4);
    // preatt: the causal part only (the GPU leaves the masked part as computed).
    let causal = |x: &[f32]| -> Vec<f32> {
        x.iter()
            .enumerate()
            .map(|(i, &v)| if (i % T) <= (i / T) % T { v } else { 0.0 })
            .collect()
    };
    compare(
        "attention_forward preatt (causal part)",
        &causal(&g.down(&gpre)),
        &preatt,
        1e-5,
        1e-4,
    );

    let dout = randn(B * T * C, 1.0, 31);
    let mut dinp = randn(B * T * 3 * C, 0.1, 32);
    let bdout = g.up(&dout);
    let bwd_scratch = g.zeros(attention::backward_scratch_bytes(B, T, C, NH, Dtype::F32) / 4);
    let mut results = Vec::new();
    for _ in 0..2 {
        let bdinp = g.up(&dinp);
        let v = [&bdinp, &bdout, &binp, &gatt, &bwd_scratch].map(|b| b.whole());
        done(attention::backward(
            g.rt.task("attention_backward"),
            &v[0],
            &v[1],
            &v[2],
            &v[3],
            &v[4],
            B,
            T,
            C,
            NH,
        ));
        results.push(g.down(&bdinp));
    }
    assert!(
        results[0] == results[1],
        "attention_backward is not deterministic"
    );
    cpu::attention_backward(&mut dinp, &dout, &inp, &att, B, T, C, NH);
    compare("attention_backward dinp", &results[0], &dinp, 1e-5, 1e-3);
}

#[test]
fn gelu_and_residual_match_cpu() {
    let Some(g) = Dev::gpu("cuda_kernels::gelu_and_residual_match_cpu") else {
        return;
    };
    let n = 4099;
    let x = randn(n, 2.0, 40);
    let mut want = vec![0.0; n];
    cpu::gelu_forward(&mut want, &x);
    let (bx, out) = (g.up(&x), g.zeros(n));
    done(gelu::forward(
        g.rt.task("gelu_forward"),
        &out.whole(),
        &bx.whole(),
    ));
    compare("gelu_forward", &g.down(&out), &want, 1e-6, 1e-5);

    let dout = randn(n, 1.0, 41);
    let mut dinp = randn(n, 0.1, 42);
    let (bd, bdout) = (g.up(&dinp), g.up(&dout));
    cpu::gelu_backward(&mut dinp, &x, &dout);
    let v = [&bd, &bx, &bdout].map(|b| b.whole());
    done(gelu::backward(
        g.rt.task("gelu_backward"),
        &v[0],
        GradWrite::Add,
        &v[1],
        &v[2],
    ));
    compare("gelu_backward", &g.down(&bd), &dinp, 1e-6, 1e-5);
    // Written over: what the buffer held (the result above) is not read.
    let mut fresh = vec![0.0; n];
    cpu::gelu_backward(&mut fresh, &x, &dout);
    done(gelu::backward(
        g.rt.task("gelu_backward set"),
        &v[0],
        GradWrite::Set,
        &v[1],
        &v[2],
    ));
    compare("gelu_backward set", &g.down(&bd), &fresh, 1e-6, 1e-5);

    let (a1, a2) = (randn(n, 1.0, 43), randn(n, 1.0, 44));
    let mut want = vec![0.0; n];
    cpu::residual_forward(&mut want, &a1, &a2);
    let (b1, b2) = (g.up(&a1), g.up(&a2));
    let v = [&out, &b1, &b2].map(|b| b.whole());
    done(residual::forward(
        g.rt.task("residual_forward"),
        &v[0],
        &v[1],
        &v[2],
    ));
    compare("residual_forward", &g.down(&out), &want, 0.0, 0.0);

    let (mut d1, mut d2) = (a1.clone(), a2.clone());
    cpu::residual_backward(&mut d1, &mut d2, &dout);
    let v = [&b1, &b2, &bdout].map(|b| b.whole());
    done(residual::backward(
        g.rt.task("residual_backward"),
        &v[0],
        &v[1],
        &v[2],
    ));
    compare("residual_backward dinp1", &g.down(&b1), &d1, 0.0, 0.0);
    compare("residual_backward dinp2", &g.down(&b2), &d2, 0.0, 0.0);
}

#[test]
fn softmax_and_crossentropy_match_cpu() {
    let Some(g) = Dev::gpu("cuda_kernels::softmax_and_crossentropy_match_cpu") else {
        return;
    };
    let n = B * T;
    let logits = randn(n * V, 3.0, 50);
    let targets = tokens(n, 51);
    let (mut probs, mut losses) = (vec![0.0; n * V], vec![0.0; n]);
    cpu::softmax_forward(&mut probs, &logits, B, T, V, V);
    cpu::crossentropy_forward(&mut losses, &probs, &targets, B, T, V, V);
    let (bl, bt) = (g.up(&logits), g.up_u32(&targets));

    let bp_only = g.zeros(n * V);
    done(loss::softmax(
        g.rt.task("softmax_forward"),
        &bp_only.whole(),
        &bl.whole(),
        n,
        V,
        V,
    ));
    compare("softmax_forward", &g.down(&bp_only), &probs, 1e-7, 1e-4);

    let (bp, bloss, bmean) = (g.zeros(n * V), g.zeros(n), g.zeros(1));
    let v = [&bp, &bloss, &bl, &bt].map(|b| b.whole());
    // SAFETY: every target is < V (checked by `tokens`).
    done(unsafe {
        loss::softmax_crossentropy(
            g.rt.task("softmax_crossentropy_forward"),
            &v[0],
            &v[1],
            &v[2],
            &v[3],
            n,
            V,
            V,
        )
    });
    compare(
        "softmax_crossentropy_forward probs",
        &g.down(&bp),
        &probs,
        1e-7,
        1e-4,
    );
    compare(
        "softmax_crossentropy_forward losses",
        &g.down(&bloss),
        &losses,
        1e-5,
        1e-4,
    );

    done(loss::mean(
        g.rt.task("mean_loss"),
        &bmean.whole(),
        &bloss.whole(),
    ));
    compare(
        "mean_loss",
        &g.down(&bmean),
        &[cpu::mean_loss(&losses)],
        1e-6,
        1e-5,
    );

    let dloss = 0.5f32;
    let mut dlogits = randn(n * V, 0.01, 52);
    let bd = g.up(&dlogits);
    cpu::crossentropy_softmax_backward(&mut dlogits, &probs, &targets, dloss, B, T, V, V);
    let v = [&bd, &bp, &bt].map(|b| b.whole());
    done(loss::backward(
        g.rt.task("crossentropy_softmax_backward"),
        &v[0],
        &v[1],
        &v[2],
        dloss,
        n,
        V,
        V,
    ));
    compare(
        "crossentropy_softmax_backward",
        &g.down(&bd),
        &dlogits,
        1e-7,
        1e-4,
    );
}

#[test]
fn adamw_matches_cpu() {
    let Some(g) = Dev::gpu("cuda_kernels::adamw_matches_cpu") else {
        return;
    };
    let n = 100_003;
    let h = TEST_ADAMW;
    // Plain steps, and steps whose gradients are scaled on the device.
    for grad_scale in [None, Some(0.37f32)] {
        let mut p = randn(n, 1.0, 60);
        let (mut m, mut v) = (vec![0.0f32; n], vec![0.0f32; n]);
        let (bp, bm, bv, bg) = (g.up(&p), g.zeros(n), g.zeros(n), g.zeros(n));
        let bs = g.up(&[grad_scale.unwrap_or(1.0)]);
        for step in 1..=3u64 {
            let mut grads = randn(n, 0.5, 60 + step);
            g.rt.upload(&bg, &grads).unwrap();
            if let Some(s) = grad_scale {
                cpu::scale_in_place(&mut grads, s);
            }
            let (lr, b1, b2, eps, wd) = (h.learning_rate, h.beta1, h.beta2, h.eps, h.weight_decay);
            cpu::adamw_update(&mut p, &grads, &mut m, &mut v, step, lr, b1, b2, eps, wd);
            let [vp, vg, vm, vv, vs] = [&bp, &bg, &bm, &bv, &bs].map(|b| b.whole());
            let s = grad_scale.map(|_| &vs);
            done(adamw::update(
                g.rt.task("adamw_update"),
                &vp,
                &vg,
                &vm,
                &vv,
                s,
                step,
                h,
            ));
        }
        let what = format!("adamw (grad_scale {grad_scale:?})");
        compare(&format!("{what} params"), &g.down(&bp), &p, 1e-6, 1e-5);
        compare(&format!("{what} m"), &g.down(&bm), &m, 1e-7, 1e-5);
        compare(&format!("{what} v"), &g.down(&bv), &v, 1e-9, 1e-5);
    }
}

/// An update reading its step scalars from a buffer (`StepArg::Scalars`,
/// what a recorded step runs) equals the update given the step number, bit
/// for bit, f32 and mixed bf16, on each backend (on CUDA: the kernels'
/// `scalars` pointer).
fn adamw_step_scalars_match_the_step_number(dev: Device) {
    let g = Dev::new(dev);
    let (n, h, step) = (1000, TEST_ADAMW, 3u64);
    let p0 = randn(n, 1.0, 70);
    let grads = randn(n, 0.5, 71);
    let scalars = g.up(&adamw::step_scalars(step, h));
    let vsc = scalars.whole();
    let run = |arg: adamw::StepArg<'_>| {
        let (bp, bg, bm, bv) = (g.up(&p0), g.up(&grads), g.zeros(n), g.zeros(n));
        let [vp, vg, vm, vv] = [&bp, &bg, &bm, &bv].map(|b| b.whole());
        done(adamw::update(
            g.rt.task("adamw"),
            &vp,
            &vg,
            &vm,
            &vv,
            None,
            arg,
            h,
        ));
        // Mixed: bf16 stored weights and gradients, f32 master weights.
        let (sp, sg) = (g.up_bf16(&bf16(&p0)), g.up_bf16(&bf16(&grads)));
        let (master, mm, mv) = (g.up(&p0), g.zeros(n), g.zeros(n));
        let [wp, wg, wmaster, wm, wv] = [&sp, &sg, &master, &mm, &mv].map(|b| b.whole());
        done(adamw::update_mixed(
            bf16_task(&g.rt, "adamw mixed"),
            &wp,
            &wmaster,
            &wg,
            &wm,
            &wv,
            None,
            arg,
            h,
        ));
        (
            [&bp, &bm, &bv, &master, &mm, &mv].map(|b| g.down(b)),
            g.down_bf16(&sp),
        )
    };
    let by_number = run(adamw::StepArg::Number(step));
    let by_buffer = run(adamw::StepArg::Scalars(&vsc));
    assert_eq!(by_number, by_buffer);
    // The buffer is read when the task runs: another step's scalars give
    // another update.
    g.rt.upload(&scalars, &adamw::step_scalars(1, h)).unwrap();
    assert_ne!(run(adamw::StepArg::Scalars(&vsc)).0, by_number.0);
}

test_device!(
    adamw_step_scalars_match_the_step_number,
    adamw_step_scalars_match_the_step_number_cpu,
    adamw_step_scalars_match_the_step_number_cuda
);

#[test]
fn grad_norm_clip_and_scale_match_cpu() {
    let Some(g) = Dev::gpu("cuda_kernels::grad_norm_clip_and_scale_match_cpu") else {
        return;
    };
    let n = 100_003;
    let grads = randn(n, 0.5, 70);
    let bg = g.up(&grads);
    let norm_sq = g.rt.alloc("norm_sq", 8).unwrap();
    let partials =
        g.rt.alloc("partials", norm::GRAD_NORM_PARTIALS * 8)
            .unwrap();
    done(norm::sum_squares(
        g.rt.task("grad_norm_sq"),
        &norm_sq.whole(),
        &partials.whole(),
        &bg.whole(),
    ));
    let got: Vec<f64> = g.rt.read_vec(&norm_sq).unwrap();
    let want = cpu::grad_norm_sq(&grads);
    eprintln!("    grad_norm_sq: gpu {} cpu {want}", got[0]);
    assert!(
        ((got[0] - want) / want).abs() <= 1e-12,
        "grad_norm_sq: gpu {} vs cpu {want}",
        got[0]
    );

    let scale = g.zeros(1);
    let max_norm = (want.sqrt() * 0.5) as f32;
    done(norm::clip_factor(
        g.rt.task("grad_clip_scale"),
        &scale.whole(),
        &norm_sq.whole(),
        max_norm,
    ));
    let s = g.down(&scale)[0];
    compare(
        "grad_clip_scale",
        &[s],
        &[cpu::clip_scale(want.sqrt(), max_norm)],
        0.0,
        1e-6,
    );

    done(norm::scale_by(
        g.rt.task("scale_in_place_dev"),
        &bg.whole(),
        &scale.whole(),
    ));
    let mut want_scaled = grads.clone();
    cpu::scale_in_place(&mut want_scaled, s);
    compare("scale_in_place_dev", &g.down(&bg), &want_scaled, 0.0, 0.0);

    done(norm::scale(g.rt.task("scale_in_place"), &bg.whole(), 0.25));
    cpu::scale_in_place(&mut want_scaled, 0.25);
    compare("scale_in_place", &g.down(&bg), &want_scaled, 0.0, 0.0);
}

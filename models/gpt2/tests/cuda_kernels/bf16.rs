//! bf16 storage: each family's bf16 task against its CPU kernel on the same
//! bf16 inputs, with the tolerance the CUDA kernel is held to. On CUDA
//! (`*_bf16_cuda`) that is the bf16 CUDA kernels against the CPU; the `_cpu`
//! twins run the same body through the CPU backend (the bf16 task plumbing
//! and the comparisons themselves; equal there). Also the products with the
//! bias in cuBLASLt's epilogue.

use super::*;

fn gelu_and_residual_bf16(dev: Device) {
    let g = Dev::new(dev);
    let n = 4099;
    let x = bf16(&randn(n, 2.0, 140));
    let bx = g.up_bf16(&x);
    let mut want = vec![Bf16(0); n];
    cpu::gelu_forward(&mut want, &x);
    let out = g.up_bf16(&vec![Bf16(0); n]);
    done(gelu::forward(
        bf16_task(&g.rt, "gelu_forward bf16"),
        &out.whole(),
        &bx.whole(),
    ));
    // Same operations, no FMA contraction; CUDA's tanhf may differ from the
    // CPU's in the last f32 bit, which can move the rounding by one ulp.
    compare_bf16("gelu_forward bf16", &g.down_bf16(&out), &want, 1);

    let dout = bf16(&randn(n, 1.0, 141));
    let mut dinp = bf16(&randn(n, 0.1, 142));
    let (bd, bdout) = (g.up_bf16(&dinp), g.up_bf16(&dout));
    cpu::gelu_backward(&mut dinp, &x, &dout);
    let v = [&bd, &bx, &bdout].map(|b| b.whole());
    done(gelu::backward(
        bf16_task(&g.rt, "gelu_backward bf16"),
        &v[0],
        GradWrite::Add,
        &v[1],
        &v[2],
    ));
    compare_bf16("gelu_backward bf16", &g.down_bf16(&bd), &dinp, 1);
    let mut fresh = vec![Bf16(0); n];
    cpu::gelu_backward(&mut fresh, &x, &dout);
    done(gelu::backward(
        bf16_task(&g.rt, "gelu_backward bf16 set"),
        &v[0],
        GradWrite::Set,
        &v[1],
        &v[2],
    ));
    compare_bf16("gelu_backward bf16 set", &g.down_bf16(&bd), &fresh, 1);

    let (a1, a2) = (bf16(&randn(n, 1.0, 143)), bf16(&randn(n, 1.0, 144)));
    let mut want = vec![Bf16(0); n];
    cpu::residual_forward(&mut want, &a1, &a2);
    let (b1, b2) = (g.up_bf16(&a1), g.up_bf16(&a2));
    let v = [&out, &b1, &b2].map(|b| b.whole());
    done(residual::forward(
        bf16_task(&g.rt, "residual_forward bf16"),
        &v[0],
        &v[1],
        &v[2],
    ));
    compare_bf16("residual_forward bf16", &g.down_bf16(&out), &want, 0);

    let (mut d1, mut d2) = (a1.clone(), a2.clone());
    cpu::residual_backward(&mut d1, &mut d2, &dout);
    let v = [&b1, &b2, &bdout].map(|b| b.whole());
    done(residual::backward(
        bf16_task(&g.rt, "residual_backward bf16"),
        &v[0],
        &v[1],
        &v[2],
    ));
    compare_bf16("residual_backward bf16 dinp1", &g.down_bf16(&b1), &d1, 0);
    compare_bf16("residual_backward bf16 dinp2", &g.down_bf16(&b2), &d2, 0);
}

fn encoder_bf16(dev: Device) {
    let g = Dev::new(dev);
    let max_t = T + 5;
    let (wte, wpe) = (
        bf16(&randn(V * C, 1.0, 101)),
        bf16(&randn(max_t * C, 1.0, 102)),
    );
    let tok = tokens(B * T, 103);
    let mut want = vec![Bf16(0); B * T * C];
    cpu::encoder_forward(&mut want, &tok, &wte, &wpe, B, T, C);
    let (dwte, dwpe, dtok) = (g.up_bf16(&wte), g.up_bf16(&wpe), g.up_u32(&tok));
    let out = g.up_bf16(&vec![Bf16(0); B * T * C]);
    let (o, tk, te, pe) = (out.whole(), dtok.whole(), dwte.whole(), dwpe.whole());
    // SAFETY: every token id is < V (checked by `tokens`).
    done(unsafe {
        encoder::forward(
            bf16_task(&g.rt, "encoder_forward bf16"),
            &o,
            &tk,
            &te,
            &pe,
            B,
            T,
            C,
        )
    });
    compare_bf16("encoder_forward bf16", &g.down_bf16(&out), &want, 0);

    // Small gradients and a large dout: a repeated token's row rounded after
    // each contribution instead of once would differ.
    let dout = bf16(&randn(B * T * C, 1.0, 104));
    let (mut gwte, mut gwpe) = (
        bf16(&randn(V * C, 0.01, 105)),
        bf16(&randn(max_t * C, 0.01, 106)),
    );
    let (bwte, bwpe, bdout) = (g.up_bf16(&gwte), g.up_bf16(&gwpe), g.up_bf16(&dout));
    cpu::encoder_backward(&mut gwte, &mut gwpe, &dout, &tok, B, T, C);
    let (te, pe, d) = (bwte.whole(), bwpe.whole(), bdout.whole());
    let links = g.zeros(B * T);
    // SAFETY: as above.
    done(unsafe {
        encoder::backward(
            bf16_task(&g.rt, "encoder_backward bf16"),
            &te,
            &pe,
            &d,
            &tk,
            &links.whole(),
            B,
            T,
            C,
        )
    });
    // Same summation order and one rounding per element: bit-identical.
    compare_bf16("encoder_backward bf16 dwpe", &g.down_bf16(&bwpe), &gwpe, 0);
    compare_bf16("encoder_backward bf16 dwte", &g.down_bf16(&bwte), &gwte, 0);
}

fn grad_norm_and_scale_bf16(dev: Device) {
    let g = Dev::new(dev);
    let n = 100_003;
    let grads = bf16(&randn(n, 0.5, 170));
    let bg = g.up_bf16(&grads);
    let norm_sq = g.rt.alloc("norm_sq", 8).unwrap();
    let partials =
        g.rt.alloc("partials", norm::GRAD_NORM_PARTIALS * 8)
            .unwrap();
    done(norm::sum_squares(
        bf16_task(&g.rt, "grad_norm_sq bf16"),
        &norm_sq.whole(),
        &partials.whole(),
        &bg.whole(),
    ));
    let got: Vec<f64> = g.rt.read_vec(&norm_sq).unwrap();
    let want = cpu::grad_norm_sq(&grads);
    // Exact squares summed in f64 in another order: equal to ~1e-12.
    eprintln!("    grad_norm_sq bf16: task {} cpu kernel {want}", got[0]);
    assert!(
        ((got[0] - want) / want).abs() <= 1e-12,
        "grad_norm_sq bf16: task {} vs cpu kernel {want}",
        got[0]
    );

    let scale = g.up(&[0.37]);
    done(norm::scale_by(
        bf16_task(&g.rt, "scale_in_place_dev bf16"),
        &bg.whole(),
        &scale.whole(),
    ));
    let mut want_scaled = grads.clone();
    cpu::scale_in_place(&mut want_scaled, 0.37);
    compare_bf16(
        "scale_in_place_dev bf16",
        &g.down_bf16(&bg),
        &want_scaled,
        0,
    );

    done(norm::scale(
        bf16_task(&g.rt, "scale_in_place bf16"),
        &bg.whole(),
        0.25,
    ));
    cpu::scale_in_place(&mut want_scaled, 0.25);
    compare_bf16("scale_in_place bf16", &g.down_bf16(&bg), &want_scaled, 0);
}

fn adamw_mixed_bf16(dev: Device) {
    let g = Dev::new(dev);
    let n = 100_003;
    let h = TEST_ADAMW;
    for grad_scale in [None, Some(0.37f32)] {
        let mut master = randn(n, 1.0, 160);
        let mut params = bf16(&master);
        let (mut m, mut v) = (vec![0.0f32; n], vec![0.0f32; n]);
        let (bp, bmaster) = (g.up_bf16(&params), g.up(&master));
        let (bm, bv) = (g.zeros(n), g.zeros(n));
        let bgrads = g.up_bf16(&vec![Bf16(0); n]);
        let bs = g.up(&[grad_scale.unwrap_or(1.0)]);
        for step in 1..=3u64 {
            let grads = bf16(&randn(n, 0.5, 160 + step));
            g.rt.upload(&bgrads, &grads).unwrap();
            cpu::adamw_update_mixed(
                &mut params,
                &mut master,
                &grads,
                &mut m,
                &mut v,
                grad_scale,
                step,
                h,
            );
            let vs = bs.whole();
            let s = grad_scale.map(|_| &vs);
            let [vp, vmaster, vg, vm, vv] = [&bp, &bmaster, &bgrads, &bm, &bv].map(|b| b.whole());
            done(adamw::update_mixed(
                bf16_task(&g.rt, "adamw_update_mixed bf16"),
                &vp,
                &vmaster,
                &vg,
                &vm,
                &vv,
                s,
                step,
                h,
            ));
        }
        // Same operations in the same order, no FMA, IEEE sqrt and division:
        // bit-identical.
        let what = format!("adamw mixed bf16 (grad_scale {grad_scale:?})");
        compare_bf16(&format!("{what} params"), &g.down_bf16(&bp), &params, 0);
        compare(
            &format!("{what} master"),
            &g.down(&bmaster),
            &master,
            0.0,
            0.0,
        );
        compare(&format!("{what} m"), &g.down(&bm), &m, 0.0, 0.0);
        compare(&format!("{what} v"), &g.down(&bv), &v, 0.0, 0.0);
    }
}

/// The bf16 layer norm against the CPU's: at the suite's C, at GPT-2's 768
/// and at 1,024 (three and four 16-byte vectors a lane on CUDA), and with
/// the input one element off a 16-byte boundary (the element-wise loops).
fn layernorm_bf16(dev: Device) {
    for (n, c, off) in [(LN_ROWS, C, 0), (5, 768, 0), (3, 1024, 0), (4, 768, 1)] {
        layernorm_bf16_at(dev, n, c, off);
    }
}

fn layernorm_bf16_at(dev: Device, n: usize, c: usize, off: usize) {
    let g = Dev::new(dev);
    let case = format!("N {n}, C {c}, input {off} elements off");
    let inp = bf16(&randn(n * c, 2.0, 110));
    let w = bf16(
        &randn(c, 0.3, 111)
            .iter()
            .map(|x| 1.0 + x)
            .collect::<Vec<_>>(),
    );
    let bias = bf16(&randn(c, 0.3, 112));
    let (mut out, mut mean, mut rstd) = (vec![Bf16(0); n * c], vec![0.0; n], vec![0.0; n]);
    cpu::layernorm_forward(&mut out, &mut mean, &mut rstd, &inp, &w, &bias, 1, n, c);
    let padded: Vec<Bf16> = std::iter::repeat_n(Bf16(0), off)
        .chain(inp.iter().copied())
        .collect();
    let (dinp, dw, db) = (g.up_bf16(&padded), g.up_bf16(&w), g.up_bf16(&bias));
    let inp_view = dinp.view_of::<Bf16>(off..off + n * c).unwrap();
    let (gout, gmean, grstd) = (g.up_bf16(&vec![Bf16(0); n * c]), g.zeros(n), g.zeros(n));
    let v = [&gout, &gmean, &grstd, &dinp, &dw, &db].map(|b| b.whole());
    done(layernorm::forward(
        bf16_task(&g.rt, "layernorm_forward bf16"),
        &v[0],
        &v[1],
        &v[2],
        &inp_view,
        &v[4],
        &v[5],
        n,
        c,
    ));
    // The statistics are f64 sums in another order (a warp tree), rounded to
    // f32: equal to the CPU's or one f32 ulp off, which may move an output's
    // rounding by one bf16 ulp.
    compare(
        &format!("{case}: layernorm_forward bf16 mean"),
        &g.down(&gmean),
        &mean,
        1e-7,
        1e-6,
    );
    compare(
        &format!("{case}: layernorm_forward bf16 rstd"),
        &g.down(&grstd),
        &rstd,
        0.0,
        1e-6,
    );
    compare_bf16(
        &format!("{case}: layernorm_forward bf16 out"),
        &g.down_bf16(&gout),
        &out,
        1,
    );

    // The backward pass from the CPU's statistics, so that only the
    // reductions inside the backward kernels differ.
    let (bmean, brstd) = (g.up(&mean), g.up(&rstd));
    let dout = bf16(&randn(n * c, 1.0, 113));
    let (mut gi, mut gw, mut gb) = (
        bf16(&randn(n * c, 0.1, 114)),
        bf16(&randn(c, 0.1, 115)),
        bf16(&randn(c, 0.1, 116)),
    );
    let (bi, bw, bb, bdout) = (
        g.up_bf16(&gi),
        g.up_bf16(&gw),
        g.up_bf16(&gb),
        g.up_bf16(&dout),
    );
    let scratch = g.zeros(layernorm::backward_scratch_bytes(n, c) / 4);
    let v = [&bi, &bw, &bb, &bdout, &dinp, &dw, &bmean, &brstd, &scratch].map(|b| b.whole());
    done(layernorm::backward(
        bf16_task(&g.rt, "layernorm_backward bf16"),
        &v[0],
        &v[1],
        &v[2],
        &v[3],
        &inp_view,
        &v[5],
        &v[6],
        &v[7],
        &v[8],
        n,
        c,
    ));
    cpu::layernorm_backward(
        &mut gi, &mut gw, &mut gb, &dout, &inp, &w, &mean, &rstd, 1, n, c,
    );
    // dinp: the two row means are f64 sums in another order (one bf16 ulp);
    // dweight, dbias: on CUDA the rows are summed in chunks, each by 8 warps,
    // then the chunks in order (f32, another order than the CPU's rows in
    // turn):
    // within one bf16 ulp. On the CPU the task runs the kernel: identical.
    let ulps = if dev == Device::Cpu { 0 } else { 1 };
    compare_bf16(
        &format!("{case}: layernorm_backward bf16 dinp"),
        &g.down_bf16(&bi),
        &gi,
        1,
    );
    compare_bf16(
        &format!("{case}: layernorm_backward bf16 dweight"),
        &g.down_bf16(&bw),
        &gw,
        ulps,
    );
    compare_bf16(
        &format!("{case}: layernorm_backward bf16 dbias"),
        &g.down_bf16(&bb),
        &gb,
        ulps,
    );
}

/// The bias in cuBLASLt's epilogue (`matmul_forward_cuda_with(.., true)`,
/// what `BRAID_CUBLASLT_BIAS=1` turns on): against the CPU within
/// `accumulated`'s bound, dense and into rows of `ld > OC` (whose padding
/// it must not write). GPU only: there is no CPU body to twin.
#[test]
fn matmul_bias_epilogue_bf16_cuda() {
    let Some(g) = Dev::gpu("matmul_bias_epilogue_bf16_cuda") else {
        return;
    };
    let (n, oc) = (B * T, 3 * C);
    let Bf16Linear {
        inp: binp,
        w: bw,
        bias: bbias,
        want,
        product,
    } = bf16_linear(&g, n, oc, 130);
    for ld in [oc, oc + 8] {
        let fill = Bf16::from_f32(7.0);
        let out = g.up_bf16(&vec![fill; n * ld]);
        let accesses = (
            out.write::<Bf16>(),
            binp.read::<Bf16>(),
            bw.read::<Bf16>(),
            bbias.read::<Bf16>(),
        );
        done(g.rt.task("matmul_forward bf16, bias epilogue").run_cuda(
            accesses,
            move |(o, i, w, b), cu| -> Result<(), braid::TaskError> {
                matmul::matmul_forward_cuda_with(cu, o, i, w, Some(b), n, C, oc, ld, true)?;
                Ok(())
            },
        ));
        let got = g.down_bf16(&out);
        let (mut used, mut pad) = (Vec::new(), Vec::new());
        for row in got.chunks(ld) {
            used.extend_from_slice(&row[..oc]);
            pad.extend_from_slice(&row[oc..]);
        }
        let what = format!("matmul_forward bf16, bias epilogue (ld {ld})");
        accumulated(Device::Cuda, &what, &used, &want, &product);
        assert!(
            pad.iter().all(|&x| x == fill),
            "{what}: a padding element was written"
        );
    }
}

fn matmul_bf16(dev: Device) {
    let g = Dev::new(dev);
    let (n, oc) = (B * T, 3 * C);
    let inp = bf16(&randn(n * C, 1.0, 120));
    let w = bf16(&randn(oc * C, 0.2, 121));
    let bias = bf16(&randn(oc, 0.5, 122));
    let (binp, bw, bbias) = (g.up_bf16(&inp), g.up_bf16(&w), g.up_bf16(&bias));
    // Each result against the CPU's within `accumulated`'s bound.
    for with_bias in [true, false] {
        let mut want = vec![Bf16(0); n * oc];
        let b = with_bias.then_some(&bias[..]);
        cpu::matmul_forward(&mut want, &inp, &w, b, B, T, C, oc);
        let out = g.up_bf16(&vec![Bf16(0); n * oc]);
        let v = [&out, &binp, &bw, &bbias].map(|b| b.whole());
        done(matmul::forward(
            bf16_task(&g.rt, "matmul_forward bf16"),
            &v[0],
            &v[1],
            &v[2],
            with_bias.then_some(&v[3]),
            n,
            C,
            oc,
        ));
        let what = format!("matmul_forward bf16 (bias: {with_bias})");
        let mut product = vec![Bf16(0); n * oc];
        cpu::matmul_forward(&mut product, &inp, &w, None, B, T, C, oc);
        accumulated(dev, &what, &g.down_bf16(&out), &want, &product);
    }

    let dout = bf16(&randn(n * oc, 1.0, 123));
    let bdout = g.up_bf16(&dout);
    let mut gi = bf16(&randn(n * C, 0.1, 124));
    let bgi = g.up_bf16(&gi);
    cpu::matmul_backward_input(&mut gi, &dout, &w, B, T, C, oc);
    let mut pi = vec![Bf16(0); n * C];
    cpu::matmul_backward_input(&mut pi, &dout, &w, B, T, C, oc);
    let v = [&bgi, &bdout, &bw].map(|b| b.whole());
    done(matmul::backward_input(
        bf16_task(&g.rt, "matmul_backward_input bf16"),
        &v[0],
        GradWrite::Add,
        &v[1],
        &v[2],
        n,
        C,
        oc,
    ));
    let what = "matmul_backward_input bf16";
    accumulated(dev, what, &g.down_bf16(&bgi), &gi, &pi);

    let (mut gw, mut gb) = (bf16(&randn(oc * C, 0.1, 125)), bf16(&randn(oc, 0.1, 126)));
    let (bgw, bgb) = (g.up_bf16(&gw), g.up_bf16(&gb));
    cpu::matmul_backward_weight(&mut gw, Some(&mut gb[..]), &dout, &inp, B, T, C, oc);
    let mut pw = vec![Bf16(0); oc * C];
    cpu::matmul_backward_weight(&mut pw, None, &dout, &inp, B, T, C, oc);
    let v = [&bgw, &bgb, &bdout, &binp].map(|b| b.whole());
    done(matmul::backward_weight(
        bf16_task(&g.rt, "matmul_backward_weight bf16"),
        &v[0],
        Some(&v[1]),
        &v[2],
        &v[3],
        n,
        C,
        oc,
    ));
    let what = "matmul_backward_weight bf16 dweight";
    accumulated(dev, what, &g.down_bf16(&bgw), &gw, &pw);
    // dbias: f32 sums in the lane order (BIAS_GRAD_LANES), as on the CPU:
    // bit-identical.
    compare_bf16(
        "matmul_backward_weight bf16 dbias",
        &g.down_bf16(&bgb),
        &gb,
        0,
    );
}

test_device!(
    gelu_and_residual_bf16,
    gelu_and_residual_bf16_cpu,
    gelu_and_residual_bf16_cuda
);
test_device!(encoder_bf16, encoder_bf16_cpu, encoder_bf16_cuda);
test_device!(
    grad_norm_and_scale_bf16,
    grad_norm_and_scale_bf16_cpu,
    grad_norm_and_scale_bf16_cuda
);
test_device!(
    adamw_mixed_bf16,
    adamw_mixed_bf16_cpu,
    adamw_mixed_bf16_cuda
);
test_device!(layernorm_bf16, layernorm_bf16_cpu, layernorm_bf16_cuda);
test_device!(matmul_bf16, matmul_bf16_cpu, matmul_bf16_cuda);

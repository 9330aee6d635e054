//! The classifier: softmax and cross-entropy in bf16, logits in padded rows,
//! and the fused classifier.

use super::*;

fn softmax_and_crossentropy_bf16(dev: Device) {
    let g = Dev::new(dev);
    let n = B * T;
    let logits = bf16(&randn(n * V, 3.0, 150));
    let targets = tokens(n, 151);
    let (mut probs, mut losses) = (vec![Bf16(0); n * V], vec![0.0f32; n]);
    cpu::softmax_crossentropy_forward(&mut probs, &mut losses, &logits, &targets, B, T, V, V);
    let (bl, bt) = (g.up_bf16(&logits), g.up_u32(&targets));

    let bp_only = g.up_bf16(&vec![Bf16(0); n * V]);
    done(loss::softmax(
        bf16_task(&g.rt, "softmax_forward bf16"),
        &bp_only.whole(),
        &bl.whole(),
        n,
        V,
        V,
    ));
    // CUDA's expf is not the CPU's libm and the f64 row sum is added in a
    // tree order: a probability may differ by one bf16 ulp.
    compare_bf16("softmax_forward bf16", &g.down_bf16(&bp_only), &probs, 1);

    let (bp, bloss) = (g.up_bf16(&vec![Bf16(0); n * V]), g.zeros(n));
    let v = [&bp, &bloss, &bl, &bt].map(|b| b.whole());
    // SAFETY: every target is < V (checked by `tokens`).
    done(unsafe {
        loss::softmax_crossentropy(
            bf16_task(&g.rt, "softmax_crossentropy_forward bf16"),
            &v[0],
            &v[1],
            &v[2],
            &v[3],
            n,
            V,
            V,
        )
    });
    compare_bf16(
        "softmax_crossentropy_forward bf16 probs",
        &g.down_bf16(&bp),
        &probs,
        1,
    );
    // Losses are f32, from the unrounded probability (expf, logf: a few f32
    // ulps).
    let what = "softmax_crossentropy_forward bf16 losses";
    compare(what, &g.down(&bloss), &losses, 1e-6, 1e-5);

    // The backward pass from the CPU's probabilities: bit-identical.
    let bprobs = g.up_bf16(&probs);
    let dloss = 0.5f32;
    let mut dlogits = bf16(&randn(n * V, 0.01, 152));
    let bd = g.up_bf16(&dlogits);
    cpu::crossentropy_softmax_backward(&mut dlogits, &probs, &targets, dloss, B, T, V, V);
    let v = [&bd, &bprobs, &bt].map(|b| b.whole());
    done(loss::backward(
        bf16_task(&g.rt, "crossentropy_softmax_backward bf16"),
        &v[0],
        &v[1],
        &v[2],
        dloss,
        n,
        V,
        V,
    ));
    let what = "crossentropy_softmax_backward bf16";
    compare_bf16(what, &g.down_bf16(&bd), &dlogits, 0);
}

test_device!(
    softmax_and_crossentropy_bf16,
    softmax_and_crossentropy_bf16_cpu,
    softmax_and_crossentropy_bf16_cuda
);

/// `dense` `(n, cols)` in rows of `ld`, each padded with `fill`.
fn pad_rows(dense: &[f32], cols: usize, ld: usize, fill: f32) -> Vec<f32> {
    dense
        .chunks_exact(cols)
        .flat_map(|r| {
            r.iter()
                .copied()
                .chain(std::iter::repeat_n(fill, ld - cols))
        })
        .collect()
}

/// The first `cols` of each `ld` row of `padded`, and the padding after them.
fn split_rows(padded: &[f32], cols: usize, ld: usize) -> (Vec<f32>, Vec<f32>) {
    let rows = padded.chunks_exact(ld);
    let used = rows.clone().flat_map(|r| &r[..cols]).copied().collect();
    (used, rows.flat_map(|r| &r[cols..]).copied().collect())
}

/// Asserts `padded`'s first `cols` of each `ld` row equal `dense` (the same
/// bits on the CPU; within `rtol` on CUDA, where cuBLAS may pick another
/// algorithm for another leading dimension) and that its padding is still
/// `fill` (bit for bit: nothing wrote it).
#[track_caller]
fn check_padded(dev: Device, what: &str, padded: &[f32], dense: &[f32], cols: usize, fill: f32) {
    let ld = padded.len() / (dense.len() / cols);
    let (used, pad) = split_rows(padded, cols, ld);
    match dev {
        Device::Cpu => assert!(
            used.iter()
                .zip(dense)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{what}: padded rows differ from dense ones"
        ),
        Device::Cuda => compare(what, &used, dense, 1e-6, 1e-5),
    }
    let bad = pad.iter().position(|x| x.to_bits() != fill.to_bits());
    assert_eq!(bad, None, "{what}: a padding element was written");
}

/// The classifier's padded rows (`ld > OC`, `Vp > V`; the model pads its
/// logits to `Gpt2Config::padded_vocab`): each `_ld` matmul task and each
/// loss task gives the dense task's result in the first columns, reads no
/// padding (it holds NaN in every input) and writes none.
fn padded_rows(dev: Device) {
    let g = Dev::new(dev);
    let (n, vp) = (B * T, V + 19);
    let inp = randn(n * C, 1.0, 160);
    let w = randn(V * C, 0.2, 161);
    let (binp, bw) = (g.up(&inp), g.up(&w));

    // logits = inp · wᵀ, dense and into rows of Vp (padding 7.0).
    let dense = g.zeros(n * V);
    let v = [&dense, &binp, &bw].map(|b| b.whole());
    done(matmul::forward(
        g.rt.task("dense"),
        &v[0],
        &v[1],
        &v[2],
        None,
        n,
        C,
        V,
    ));
    let logits = g.down(&dense);
    let padded = g.up(&pad_rows(&vec![0.0; n * V], V, vp, 7.0));
    let v = [&padded, &binp, &bw].map(|b| b.whole());
    let t = g.rt.task("padded");
    done(matmul::forward_ld(
        t, &v[0], &v[1], &v[2], None, n, C, V, vp,
    ));
    check_padded(dev, "forward_ld", &g.down(&padded), &logits, V, 7.0);

    // Softmax and losses from logits padded with NaN, into probs padded 0.
    let targets = tokens(n, 162);
    let bt = g.up_u32(&targets);
    let bl = g.up(&pad_rows(&logits, V, vp, f32::NAN));
    let bld = g.up(&logits);
    let run_loss = |probs: &Buffer, logits: &Buffer, vp: usize| {
        let losses = g.zeros(n);
        let v = [probs, &losses, logits, &bt].map(|b| b.whole());
        // SAFETY: every target is < V (checked by `tokens`).
        done(unsafe {
            loss::softmax_crossentropy(g.rt.task("loss"), &v[0], &v[1], &v[2], &v[3], n, V, vp)
        });
        g.down(&losses)
    };
    let (pd, pp) = (
        g.zeros(n * V),
        g.up(&pad_rows(&vec![0.0; n * V], V, vp, 0.0)),
    );
    let losses = run_loss(&pd, &bld, V);
    assert_eq!(run_loss(&pp, &bl, vp), losses, "losses from padded rows");
    let probs = g.down(&pd);
    check_padded(dev, "softmax_crossentropy", &g.down(&pp), &probs, V, 0.0);
    let sm = g.up(&pad_rows(&vec![0.0; n * V], V, vp, 0.0));
    let v = [&sm, &bl].map(|b| b.whole());
    done(loss::softmax(g.rt.task("softmax"), &v[0], &v[1], n, V, vp));
    check_padded(dev, "softmax", &g.down(&sm), &probs, V, 0.0);

    // dlogits += (probs - onehot) · d, probs padded with NaN, dlogits with 5.0.
    let start = randn(n * V, 0.01, 163);
    let (dd, dp) = (g.up(&start), g.up(&pad_rows(&start, V, vp, 5.0)));
    let bpp = g.up(&pad_rows(&probs, V, vp, f32::NAN));
    let bpd = g.up(&probs);
    for (dl, pr, vp) in [(&dd, &bpd, V), (&dp, &bpp, vp)] {
        let v = [dl, pr, &bt].map(|b| b.whole());
        done(loss::backward(
            g.rt.task("backward"),
            &v[0],
            &v[1],
            &v[2],
            0.5,
            n,
            V,
            vp,
        ));
    }
    let dlogits = g.down(&dd);
    check_padded(dev, "loss backward", &g.down(&dp), &dlogits, V, 5.0);

    // Both gradients of the product from dlogits padded with NaN.
    let dpn = g.up(&pad_rows(&dlogits, V, vp, f32::NAN));
    let gi0 = randn(n * C, 0.1, 164);
    let (gd, gp) = (g.up(&gi0), g.up(&gi0));
    for (gi, dout, ld) in [(&gd, &dd, V), (&gp, &dpn, vp)] {
        let v = [gi, dout, &bw].map(|b| b.whole());
        let t = g.rt.task("backward input");
        done(matmul::backward_input_ld(
            t,
            &v[0],
            GradWrite::Add,
            &v[1],
            &v[2],
            n,
            C,
            V,
            ld,
        ));
    }
    check_padded(dev, "backward_input_ld", &g.down(&gp), &g.down(&gd), C, 0.0);
    let (gw0, gb0) = (randn(V * C, 0.1, 165), randn(V, 0.1, 166));
    let (wd, bd) = (g.up(&gw0), g.up(&gb0));
    let (wp, bp) = (g.up(&gw0), g.up(&gb0));
    for (dw, db, dout, ld) in [(&wd, &bd, &dd, V), (&wp, &bp, &dpn, vp)] {
        let v = [dw, db, dout, &binp].map(|b| b.whole());
        let t = g.rt.task("backward weight");
        done(matmul::backward_weight_ld(
            t,
            &v[0],
            Some(&v[1]),
            &v[2],
            &v[3],
            n,
            C,
            V,
            ld,
        ));
    }
    check_padded(
        dev,
        "backward_weight_ld dweight",
        &g.down(&wp),
        &g.down(&wd),
        C,
        0.0,
    );
    check_padded(
        dev,
        "backward_weight_ld dbias",
        &g.down(&bp),
        &g.down(&bd),
        V,
        0.0,
    );

    // The same weight gradient (no bias) in row blocks, uneven and one
    // empty, each its own task writing its rows (the tied embedding's
    // classifier gradient when it is split): the whole one's, to float
    // tolerance on CUDA (other GEMM shapes).
    let whole = g.up(&gw0);
    let v = [&whole, &dpn, &binp].map(|b| b.whole());
    let t = g.rt.task("backward weight whole");
    done(matmul::backward_weight_ld(
        t, &v[0], None, &v[1], &v[2], n, C, V, vp,
    ));
    let blocks = g.up(&gw0);
    for rows in [0..3, 3..3, 3..V - 5, V - 5..V] {
        let dw = blocks.view_of::<f32>(rows.start * C..rows.end * C).unwrap();
        let (dout, inp) = (dpn.whole(), binp.whole());
        let t = g.rt.task(format!("backward weight rows {rows:?}"));
        done(matmul::backward_weight_rows(
            t, &dw, &dout, &inp, n, C, V, vp, rows,
        ));
    }
    let (got, want) = (g.down(&blocks), g.down(&whole));
    match dev {
        Device::Cpu => compare("backward_weight_rows", &got, &want, 1e-6, 1e-5),
        Device::Cuda => compare("backward_weight_rows", &got, &want, 1e-5, 1e-4),
    }
    assert_ne!(got, gw0, "backward_weight_rows changed nothing");
}

test_device!(padded_rows, padded_rows_cpu, padded_rows_cuda);

/// The fused classifier's tasks (losses alone; losses and the gradient in
/// place) on a padded vocabulary, f32 and bf16, against the CPU kernel: the
/// same bits on the CPU backend; on CUDA within float tolerance (a tree
/// order for the row sum, CUDA's expf) and one bf16 ulp.
fn fused_classifier_tasks(dev: Device) {
    let g = Dev::new(dev);
    let exact = matches!(dev, Device::Cpu);
    let (n, vp) = (B * T, 384);
    // Real columns from randn, padding holding large values that must not
    // count.
    let real = randn(n * V, 3.0, 160);
    let logits: Vec<f32> = (0..n * vp)
        .map(|i| {
            if i % vp < V {
                real[i / vp * V + i % vp]
            } else {
                50.0
            }
        })
        .collect();
    let targets = tokens(n, 161);
    let dloss = 0.5f32;
    let bt = g.up_u32(&targets);
    for dtype in [Dtype::F32, Dtype::Bf16] {
        let task = |name: &str| Task::new(g.rt.task(name.to_string()), dtype);
        // The logits as stored (rounded for bf16), widened, and their buffer.
        let (want_logits, up) = match dtype {
            Dtype::F32 => (logits.clone(), g.up(&logits)),
            Dtype::Bf16 => {
                let l = bf16(&logits);
                (widen(&l), g.up_bf16(&l))
            }
        };
        let down = |g: &Dev, b: &Buffer| match dtype {
            Dtype::F32 => g.down(b),
            Dtype::Bf16 => widen(&g.down_bf16(b)),
        };
        let mut want_losses = vec![0.0f32; n];
        cpu::classifier_losses(&mut want_losses, &want_logits, &targets, n, V, vp);
        let mut want_grad = want_logits.clone();
        let mut want_losses2 = vec![0.0f32; n];
        let grad_losses = &mut want_losses2;
        match dtype {
            Dtype::F32 => {
                cpu::fused_classifier(&mut want_grad, grad_losses, &targets, Some(dloss), n, V, vp)
            }
            Dtype::Bf16 => {
                let mut b = bf16(&want_grad);
                cpu::fused_classifier(&mut b, grad_losses, &targets, Some(dloss), n, V, vp);
                want_grad = widen(&b);
            }
        }
        let what = format!("{dtype:?}");
        let losses = g.zeros(n);
        done(fused_classifier::losses(
            task("classifier_losses"),
            &losses.whole(),
            &up.whole(),
            &bt.whole(),
            n,
            V,
            vp,
        ));
        let got = g.down(&losses);
        assert_eq!(
            down(&g, &up),
            want_logits,
            "{what}: losses alone leave the logits"
        );
        let losses2 = g.zeros(n);
        done(fused_classifier::forward_backward(
            task("fused_classifier"),
            &up.whole(),
            &losses2.whole(),
            &bt.whole(),
            dloss,
            n,
            V,
            vp,
        ));
        let (got2, grad) = (g.down(&losses2), down(&g, &up));
        assert!(
            grad.chunks_exact(vp)
                .all(|r| r[V..].iter().all(|&x| x == 0.0)),
            "{what}: padding gradient"
        );
        if exact {
            assert_eq!(got, want_losses, "{what} losses");
            assert_eq!(got2, want_losses2, "{what} losses with the gradient");
            assert_eq!(grad, want_grad, "{what} dlogits");
        } else {
            compare(&format!("{what} losses"), &got, &want_losses, 1e-6, 1e-5);
            compare(
                &format!("{what} losses 2"),
                &got2,
                &want_losses2,
                1e-6,
                1e-5,
            );
            match dtype {
                Dtype::F32 => compare(&format!("{what} dlogits"), &grad, &want_grad, 1e-9, 1e-5),
                Dtype::Bf16 => compare_bf16(
                    &format!("{what} dlogits"),
                    &bf16(&grad),
                    &bf16(&want_grad),
                    1,
                ),
            }
        }
    }
}

test_device!(
    fused_classifier_tasks,
    fused_classifier_tasks_cpu,
    fused_classifier_tasks_cuda
);

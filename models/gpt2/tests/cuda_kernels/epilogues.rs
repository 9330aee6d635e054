//! The MLP's first product and its GELU as one task, forward and backward,
//! and with the GELU in cuBLASLt's epilogues.

use super::*;

/// `matmul::forward_gelu` (the MLP's first layer and its GELU as one task)
/// is `matmul::forward` then `gelu::forward`, bit for bit, in f32 and bf16
/// (the same kernels; on CUDA in bf16 the task takes cuBLASLt's GELU
/// epilogue by default, which `matmul_gelu_epilogue_bf16_cuda` checks, so
/// there only f32 unless `BRAID_CUBLASLT_GELU=0`).
fn matmul_gelu_task(dev: Device) {
    let g = Dev::new(dev);
    let (n, oc) = (B * T, 4 * C);
    let epilogue = matmul::gelu_epilogue(matches!(dev, Device::Cuda));
    for dtype in [Dtype::F32, Dtype::Bf16] {
        if epilogue && dtype == Dtype::Bf16 {
            eprintln!("matmul_gelu_task: bf16 takes cuBLASLt's epilogue; see the _cuda test");
            continue;
        }
        let inp = randn(n * C, 1.0, 140);
        let w = randn(oc * C, 0.2, 141);
        let bias = randn(oc, 0.5, 142);
        let up = |x: &[f32]| match dtype {
            Dtype::F32 => g.up(x),
            Dtype::Bf16 => g.up_bf16(&bf16(x)),
        };
        let (binp, bw, bbias) = (up(&inp), up(&w), up(&bias));
        let size = dtype.size();
        let [pre1, out1, pre2, out2] =
            [0, 1, 2, 3].map(|i| g.rt.alloc(format!("out{i}"), n * oc * size).unwrap());
        let v = |b: &Buffer| b.whole();
        let task = |name: &'static str| Task::new(g.rt.task(name), dtype);
        done(matmul::forward(
            task("fc"),
            &v(&pre1),
            &v(&binp),
            &v(&bw),
            Some(&v(&bbias)),
            n,
            C,
            oc,
        ));
        done(gelu::forward(task("gelu"), &v(&out1), &v(&pre1)));
        done(matmul::forward_gelu(
            task("fc+gelu"),
            &v(&out2),
            &v(&pre2),
            &v(&binp),
            &v(&bw),
            &v(&bbias),
            n,
            C,
            oc,
        ));
        let bytes = |b: &Buffer| g.rt.read_vec::<u8>(b).unwrap();
        assert!(
            bytes(&pre1) == bytes(&pre2),
            "{dtype:?}: pre-activation differs"
        );
        assert!(bytes(&out1) == bytes(&out2), "{dtype:?}: GELU differs");
    }
}

test_device!(
    matmul_gelu_task,
    matmul_gelu_task_cpu,
    matmul_gelu_task_cuda
);

/// `matmul::backward_input_dgelu` (the MLP's input gradient through its
/// GELU as one task, written over a buffer that is not zero): on the CPU
/// `matmul_backward_input` then `gelu_backward`, bit for bit; on CUDA one
/// cuBLASLt product with the `DGELU` epilogue, against the CPU within the
/// GELU epilogue's bound (the product rounded once instead of twice, times
/// a slope of at most 1.13, plus one bf16 rounding). bf16: the CUDA body
/// takes nothing else.
fn matmul_dgelu_task(dev: Device) {
    let g = Dev::new(dev);
    let (n, c, oc) = (B * T, 4 * C, C);
    let dout = bf16(&randn(n * oc, 1.0, 160));
    let w = bf16(&randn(oc * c, 0.2, 161));
    let pre = bf16(&randn(n * c, 1.5, 162));
    let mut product = vec![Bf16(0); n * c];
    cpu::matmul_backward_input(&mut product, &dout, &w, 1, n, c, oc);
    let mut want = vec![Bf16(0); n * c];
    cpu::gelu_backward(&mut want, &pre, &product);
    let dinp = g.up_bf16(&bf16(&randn(n * c, 1.0, 163)));
    let v = [&dinp, &g.up_bf16(&dout), &g.up_bf16(&w), &g.up_bf16(&pre)].map(|b| b.whole());
    done(matmul::backward_input_dgelu(
        bf16_task(&g.rt, "fcproj backward input + gelu backward"),
        &v[0],
        &v[1],
        &v[2],
        &v[3],
        n,
        c,
        oc,
    ));
    let got = g.down_bf16(&dinp);
    if dev == Device::Cpu {
        assert!(got == want, "the task differs from its two kernels");
        return;
    }
    let (got, want, prod) = (widen(&got), widen(&want), widen(&product));
    within_bound(
        "matmul dgelu epilogue",
        &got,
        &want,
        &prod,
        "product",
        |i| 1.13 * (prod[i].abs() / 128.0 + 1e-5) + want[i].abs() / 128.0 + 1e-5,
    );
}

test_device!(
    matmul_dgelu_task,
    matmul_dgelu_task_cpu,
    matmul_dgelu_task_cuda
);

/// The GELU in cuBLASLt's epilogue (`matmul_forward_gelu_cuda(.., true)`,
/// the CUDA default, level 1 and up of `matmul::gelu_fusion`): the pre-activation against the
/// CPU's product plus bias within `accumulated`'s bound; the GELU against
/// the CPU's GELU of the CPU's pre-activation, within the same bound carried
/// through GELU's slope (at most 1.13) plus one bf16 rounding. GPU only.
#[test]
fn matmul_gelu_epilogue_bf16_cuda() {
    let Some(g) = Dev::gpu("matmul_gelu_epilogue_bf16_cuda") else {
        return;
    };
    let (n, oc) = (B * T, 4 * C);
    let Bf16Linear {
        inp: binp,
        w: bw,
        bias: bbias,
        want: want_pre,
        product,
    } = bf16_linear(&g, n, oc, 150);
    let mut want_out = vec![Bf16(0); n * oc];
    cpu::gelu_forward(&mut want_out, &want_pre);
    let (out, pre) = (
        g.up_bf16(&vec![Bf16(0); n * oc]),
        g.up_bf16(&vec![Bf16(0); n * oc]),
    );
    let accesses = (
        out.write::<Bf16>(),
        pre.write::<Bf16>(),
        binp.read::<Bf16>(),
        bw.read::<Bf16>(),
        bbias.read::<Bf16>(),
    );
    done(g.rt.task("matmul_forward bf16, GELU epilogue").run_cuda(
        accesses,
        move |(o, p, i, w, b), cu| -> Result<(), braid::TaskError> {
            matmul::matmul_forward_gelu_cuda(cu, o, p, i, w, b, (n, C, oc), true)?;
            Ok(())
        },
    ));
    let what = "matmul_forward bf16, GELU epilogue";
    accumulated(
        Device::Cuda,
        &format!("{what}: pre"),
        &g.down_bf16(&pre),
        &want_pre,
        &product,
    );
    let (got, want, prod) = (widen(&g.down_bf16(&out)), widen(&want_out), widen(&product));
    let pre_w = widen(&want_pre);
    within_bound(&format!("{what}: gelu"), &got, &want, &pre_w, "pre", |i| {
        1.13 * ((prod[i].abs() + pre_w[i].abs()) / 128.0 + 1e-5) + want[i].abs() / 128.0 + 1e-5
    });
}

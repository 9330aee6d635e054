//! The fused residual + layer norm against the residual and layer-norm tasks
//! in turn.

use super::*;

/// The fused residual + layer norm (`layernorm::forward_residual`,
/// `layernorm::backward_residual`) against the residual and layer-norm tasks
/// in turn on the same backend, bit for bit, `f32` and bf16: on the CPU the
/// task plumbing, on CUDA the fused kernels (the same warp code as the
/// unfused ones, reading the stored sum; the backward the same kernel with
/// `dres` as its base).
fn residual_layernorm_tasks(dev: Device) {
    // The suite's C, and GPT-2's 768 (three 16-byte vectors a lane on CUDA).
    for c in [C, 768] {
        residual_layernorm_at(dev, c);
    }
}

fn residual_layernorm_at(dev: Device, c: usize) {
    let g = Dev::new(dev);
    let n = B * T;
    let w1: Vec<f32> = randn(c, 0.3, 171).iter().map(|x| 1.0 + x).collect();
    let data = [
        randn(n * c, 1.0, 170), // inp1
        randn(n * c, 1.0, 172), // inp2
        w1,                     // weight
        randn(c, 0.3, 173),     // bias
        randn(n * c, 1.0, 174), // dres
        randn(n * c, 1.0, 175), // dout
        randn(c, 0.1, 176),     // dweight, accumulated into
        randn(c, 0.1, 177),     // dbias, accumulated into
    ];
    for dtype in [Dtype::F32, Dtype::Bf16] {
        let task = |name: &str| Task::new(g.rt.task(name.to_string()), dtype);
        let up = |x: &[f32]| match dtype {
            Dtype::F32 => g.up(x),
            Dtype::Bf16 => g.up_bf16(&bf16(x)),
        };
        let zeros = |len: usize| up(&vec![0.0; len]);
        let bits = |b: &Buffer| -> Vec<u32> {
            match dtype {
                Dtype::F32 => g.down(b).iter().map(|x| x.to_bits()).collect(),
                Dtype::Bf16 => widen(&g.down_bf16(b)).iter().map(|x| x.to_bits()).collect(),
            }
        };
        let [a, b, w, bias, dres, dout, dw0, db0] = data.each_ref().map(|x| up(x));
        let v = |x: &Buffer| x.whole();
        // Forward, unfused then fused.
        let (res, out) = (zeros(n * c), zeros(n * c));
        let (mean, rstd) = (g.zeros(n), g.zeros(n));
        done(residual::forward(
            task("residual"),
            &v(&res),
            &v(&a),
            &v(&b),
        ));
        done(layernorm::forward(
            task("layernorm"),
            &v(&out),
            &v(&mean),
            &v(&rstd),
            &v(&res),
            &v(&w),
            &v(&bias),
            n,
            c,
        ));
        let (fres, fout) = (zeros(n * c), zeros(n * c));
        let (fmean, frstd) = (g.zeros(n), g.zeros(n));
        done(layernorm::forward_residual(
            task("residual+layernorm"),
            &v(&fres),
            &v(&fout),
            &v(&fmean),
            &v(&frstd),
            &v(&a),
            &v(&b),
            &v(&w),
            &v(&bias),
            n,
            c,
        ));
        let what = format!("{dev:?} {dtype:?}");
        assert_eq!(bits(&fres), bits(&res), "{what}: residual");
        assert_eq!(bits(&fout), bits(&out), "{what}: out");
        assert_eq!(g.down(&fmean), g.down(&mean), "{what}: mean");
        assert_eq!(g.down(&frstd), g.down(&rstd), "{what}: rstd");

        // Backward: zeroed dinp += dres (residual backward) += the layer
        // norm's; fused: dinp (garbage) overwritten with dres + the same.
        // f32 scratch whatever the dtype (the sums of row chunks).
        let ln_scratch = g.zeros(layernorm::backward_scratch_bytes(n, c) / 4);
        let (dinp, dproj) = (zeros(n * c), zeros(n * c));
        // The same starting dweight and dbias as dw0 and db0.
        let (dw, db) = (up(&data[6]), up(&data[7]));
        done(residual::backward(
            task("residual backward"),
            &v(&dinp),
            &v(&dproj),
            &v(&dres),
        ));
        done(layernorm::backward(
            task("layernorm backward"),
            &v(&dinp),
            &v(&dw),
            &v(&db),
            &v(&dout),
            &v(&res),
            &v(&w),
            &v(&mean),
            &v(&rstd),
            &v(&ln_scratch),
            n,
            c,
        ));
        let fdinp = up(&randn(n * c, 5.0, 178));
        done(layernorm::backward_residual(
            task("layernorm backward residual"),
            &v(&fdinp),
            Some(&v(&dres)),
            &v(&dw0),
            &v(&db0),
            &v(&dout),
            &v(&res),
            &v(&w),
            &v(&mean),
            &v(&rstd),
            &v(&ln_scratch),
            n,
            c,
        ));
        assert_eq!(bits(&fdinp), bits(&dinp), "{what}: dinp");
        assert_eq!(bits(&dw0), bits(&dw), "{what}: dweight");
        assert_eq!(bits(&db0), bits(&db), "{what}: dbias");
        assert_ne!(bits(&fdinp), bits(&dres), "{what}: the layer norm's term");
    }
}
test_device!(
    residual_layernorm_tasks,
    residual_layernorm_tasks_cpu,
    residual_layernorm_tasks_cuda
);

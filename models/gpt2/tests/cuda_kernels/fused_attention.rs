//! The fused (flash) attention: its tasks, the tensor-core kernels, cuDNN's
//! attention, and the bf16 tasks.

use super::*;

/// One fused attention problem of shape `(b, t, c, nh)`: inputs, and the
/// CPU kernels' results on them as stored in `dtype` (out, lse, dinp).
struct FaCase {
    shape: (usize, usize, usize, usize),
    inp: Vec<f32>,
    dout: Vec<f32>,
    dinp0: Vec<f32>,
}

impl FaCase {
    fn new(shape @ (b, t, c, _): (usize, usize, usize, usize), seed: u64) -> FaCase {
        let btc = b * t * c;
        FaCase {
            shape,
            inp: randn(3 * btc, 1.0, seed),
            dout: randn(btc, 0.5, seed + 1),
            dinp0: randn(3 * btc, 0.1, seed + 2),
        }
    }

    /// The same problem with a zero starting gradient: what a task that
    /// writes the gradient over ([`GradWrite::Set`]) must give.
    fn zeroed(&self) -> FaCase {
        FaCase {
            shape: self.shape,
            inp: self.inp.clone(),
            dout: self.dout.clone(),
            dinp0: vec![0.0; self.dinp0.len()],
        }
    }

    /// `x` as stored in `dtype` (rounded for bf16), widened.
    fn stored(dtype: Dtype, x: &[f32]) -> Vec<f32> {
        match dtype {
            Dtype::F32 => x.to_vec(),
            Dtype::Bf16 => widen(&bf16(x)),
        }
    }

    /// The CPU kernels on the stored inputs, each output rounded as stored:
    /// (out, lse, dinp).
    fn cpu(&self, dtype: Dtype) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        use braid_gpt2::kernels::flash_attention::{BLOCK_K, BLOCK_Q};
        let (b, t, c, nh) = self.shape;
        let [inp, dout, dinp0] =
            [&self.inp, &self.dout, &self.dinp0].map(|x| Self::stored(dtype, x));
        let mut lse = vec![0.0f32; b * nh * t];
        let mut delta = vec![0.0f32; b * nh * t];
        match dtype {
            Dtype::F32 => {
                let (mut out, mut dinp) = (vec![0.0f32; b * t * c], dinp0);
                cpu::flash_attention_forward(
                    &mut out, &mut lse, &inp, b, t, c, nh, BLOCK_Q, BLOCK_K,
                );
                cpu::flash_attention_backward(
                    &mut dinp, &mut delta, &dout, &inp, &out, &lse, b, t, c, nh, BLOCK_Q, BLOCK_K,
                );
                (out, lse, dinp)
            }
            Dtype::Bf16 => {
                let (mut out, mut dinp, inp) = (vec![Bf16(0); b * t * c], bf16(&dinp0), bf16(&inp));
                cpu::flash_attention_forward(
                    &mut out, &mut lse, &inp, b, t, c, nh, BLOCK_Q, BLOCK_K,
                );
                cpu::flash_attention_backward(
                    &mut dinp,
                    &mut delta,
                    &bf16(&dout),
                    &inp,
                    &out,
                    &lse,
                    b,
                    t,
                    c,
                    nh,
                    BLOCK_Q,
                    BLOCK_K,
                );
                (widen(&out), lse, widen(&dinp))
            }
        }
    }

    /// The fused attention tasks on `g`'s backend in `dtype`, forward then
    /// backward (with a dS buffer for dQ as one product when `ds`): (out,
    /// lse, dinp) read back widened.
    fn tasks(
        &self,
        g: &Dev,
        dtype: Dtype,
        write: GradWrite,
        ds: bool,
    ) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        use braid_gpt2::kernels::flash_attention as fa;
        let (b, t, c, nh) = self.shape;
        let task = |name: &str| Task::new(g.rt.task(name.to_string()), dtype);
        let up = |x: &[f32]| match dtype {
            Dtype::F32 => g.up(x),
            Dtype::Bf16 => g.up_bf16(&bf16(x)),
        };
        let down = |b: &Buffer| match dtype {
            Dtype::F32 => g.down(b),
            Dtype::Bf16 => widen(&g.down_bf16(b)),
        };
        let (bi, bo, bl) = (
            up(&self.inp),
            up(&vec![0.0; b * t * c]),
            g.zeros(b * nh * t),
        );
        done(fa::forward(
            task("flash_attention_forward"),
            &bo.whole(),
            &bl.whole(),
            &bi.whole(),
            b,
            t,
            c,
            nh,
        ));
        let (bdo, bdi) = (up(&self.dout), up(&self.dinp0));
        let scratch =
            g.rt.alloc("scratch", fa::backward_scratch_bytes(b, t, nh))
                .unwrap();
        let ds = ds.then(|| g.rt.alloc("dS", fa::ds_bytes(b, t, nh)).unwrap());
        done(fa::backward(
            task("flash_attention_backward"),
            &bdi.whole(),
            write,
            &bdo.whole(),
            &bi.whole(),
            &bo.whole(),
            &bl.whole(),
            &scratch.whole(),
            ds.map(|d| d.whole()).as_ref(),
            b,
            t,
            c,
            nh,
        ));
        (down(&bo), g.down(&bl), down(&bdi))
    }
}

/// The fused (flash) attention tasks, forward and backward, f32 and bf16,
/// against the CPU kernels: the same bits on the CPU backend; on CUDA within
/// float tolerance (the same operations in the same order, but CUDA's
/// expf/logf) and one bf16 ulp. The head size here (24) is not the
/// tensor-core kernels', so CUDA runs the scalar kernels. The gradient
/// added to one that is not zero, and written over it. Given a dS buffer
/// (for dQ as one product on the tensor cores), the CPU body ignores it and
/// the scalar kernels too: the same results.
fn flash_attention_tasks(dev: Device) {
    let _attention = attention_lock();
    let g = Dev::new(dev);
    let exact = matches!(dev, Device::Cpu);
    let case = FaCase::new((B, T, C, NH), 170);
    let zeroed = case.zeroed();
    for (dtype, write) in [Dtype::F32, Dtype::Bf16]
        .into_iter()
        .flat_map(|d| [(d, GradWrite::Add), (d, GradWrite::Set)])
    {
        let want = if write == GradWrite::Set {
            &zeroed
        } else {
            &case
        };
        let (want_out, want_lse, want_dinp) = want.cpu(dtype);
        let (out, lse, dinp) = case.tasks(&g, dtype, write, false);
        let what = format!("flash attention {dtype:?} {write:?}");
        let with_ds = case.tasks(&g, dtype, write, true);
        assert_eq!(
            with_ds,
            (out.clone(), lse.clone(), dinp.clone()),
            "{what} with dS"
        );
        if exact {
            assert_eq!(out, want_out, "{what} out");
            assert_eq!(lse, want_lse, "{what} lse");
            assert_eq!(dinp, want_dinp, "{what} dinp");
            continue;
        }
        compare(&format!("{what} lse"), &lse, &want_lse, 1e-6, 1e-5);
        match dtype {
            Dtype::F32 => {
                compare(&format!("{what} out"), &out, &want_out, 1e-6, 1e-5);
                compare(&format!("{what} dinp"), &dinp, &want_dinp, 1e-6, 1e-4);
            }
            Dtype::Bf16 => {
                compare_bf16(&format!("{what} out"), &bf16(&out), &bf16(&want_out), 1);
                compare_bf16(&format!("{what} dinp"), &bf16(&dinp), &bf16(&want_dinp), 1);
            }
        }
    }
}

test_device!(
    flash_attention_tasks,
    flash_attention_tasks_cpu,
    flash_attention_tasks_cuda
);

/// In bf16 at head sizes 16, 32 and 64 the fused attention tasks run on
/// the tensor cores (`flash_attention_tc.cu`): against the CPU kernels
/// within bf16 tolerance, since the MMAs round P and dS to bf16 and sum in
/// the hardware's order. T = 150: three tiles of 64, the last partial;
/// three heads; and T = 66 with five batch rows and two heads. The same
/// kernels run on the CPU under tools/kernel-emu's tests. With a dS buffer,
/// dQ is cuBLAS's product from the dS the dK/dV kernel stores
/// (`flash_attention::dq_by_gemm`): the same bounds.
#[test]
fn flash_attention_tensor_cores_cuda() {
    use braid_gpt2::kernels::flash_attention::{tensor_cores_apply, TC_HEAD_SIZES};
    let _attention = attention_lock();
    let Some(g) = Dev::gpu("flash_attention_tensor_cores_cuda") else {
        return;
    };
    let device = g.rt.cuda_device().expect("a CUDA runtime has a device");
    // (2, 150, 3): fewer batch rows than heads; (5, 66, 2): more (the dQ
    // product batches over the other index).
    for (hs, (b, t, nh)) in TC_HEAD_SIZES
        .into_iter()
        .flat_map(|hs| [(hs, (2, 150, 3)), (hs, (5, 66, 2))])
    {
        let c = nh * hs;
        if !tensor_cores_apply::<Bf16>(device, c, nh) {
            eprintln!(
                "SKIPPED flash_attention_tensor_cores_cuda: compute capability {:?} is below 8.0",
                device.compute_capability()
            );
            return;
        }
        let case = FaCase::new((b, t, c, nh), 180 + hs as u64);
        let (want_out, want_lse, want_dinp) = case.cpu(Dtype::Bf16);
        let (_, _, want_set) = case.zeroed().cpu(Dtype::Bf16);
        for ds in [false, true] {
            let (out, lse, dinp) = case.tasks(&g, Dtype::Bf16, GradWrite::Add, ds);
            // The gradient alone, where the rounding of P and dS shows.
            let dinp0 = FaCase::stored(Dtype::Bf16, &case.dinp0);
            let grad =
                |d: &[f32]| -> Vec<f32> { d.iter().zip(&dinp0).map(|(&a, &b)| a - b).collect() };
            // Bounds relative to each tensor's largest element: twice what
            // the emulated kernels show against the CPU (tools/kernel-emu),
            // lse only its f32 sums.
            let what = |x: &str| format!("tensor-core attention hs {hs}, dS {ds}: {x}");
            compare_scaled(&what("lse"), &lse, &want_lse, 1e-5);
            compare_scaled(&what("out"), &out, &want_out, 0.0125);
            compare_scaled(&what("gradient"), &grad(&dinp), &grad(&want_dinp), 0.0125);
            // Written over the starting gradient: the gradient alone.
            let (_, _, set) = case.tasks(&g, Dtype::Bf16, GradWrite::Set, ds);
            compare_scaled(&what("gradient set"), &set, &want_set, 0.0125);
        }
    }
}

/// Held by the fused-attention tests (the only tests of this harness that
/// run the fused attention): each starts with Braid's kernels, whatever the
/// one before it (`flash_attention_cudnn_cuda` turns cuDNN's on for the
/// process while it runs) left set.
fn attention_lock() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let held = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    // Braid's kernels unless a test asks for cuDNN's (`auto`, cuDNN where it
    // has an engine, is the default on CUDA).
    braid_gpt2::kernels::flash_attention::set_attention_kernels(
        braid_gpt2::kernels::flash_attention::AttentionKernels::Braid,
    );
    held
}

/// With `BRAID_ATTENTION=cudnn` (here `set_attention_kernels`), bf16 fused
/// attention runs cuDNN's flash-attention engines: against the CPU kernels
/// within the tensor-core kernels' bounds (cuDNN also rounds P and dS to
/// bf16), at head sizes 64 and 32, with T a multiple of 128 and not (cuDNN
/// 9.15.0 and older take a backward of such a T only through Braid's
/// kernels). The backward (cuDNN's deterministic algorithm) gives the same
/// bits twice; a gradient added to one that is not zero (`GradWrite::Add`)
/// takes Braid's kernels after cuDNN's forward. `auto` gives the same bits
/// as `cudnn` wherever cuDNN has an engine. It prints which graph and
/// engine cuDNN chose. Needs libcudnn (9); skipped without it, except
/// under `BRAID_REQUIRE_GPU=1`.
#[test]
fn flash_attention_cudnn_cuda() {
    use braid_gpt2::kernels::flash_attention::{
        cudnn_report, set_attention_kernels, AttentionKernels,
    };
    let _attention = attention_lock();
    if !braid::cuda::cudnn::cudnn_or_skip("flash_attention_cudnn_cuda") {
        return;
    }
    let g = Dev::new(Device::Cuda);
    set_attention_kernels(AttentionKernels::Cudnn);
    for (hs, (b, t, nh)) in [(64, (2, 256, 3)), (64, (5, 150, 2)), (32, (3, 128, 4))] {
        let c = nh * hs;
        let case = FaCase::new((b, t, c, nh), 190 + hs as u64 + t as u64);
        let (want_out, want_lse, want_dinp) = case.cpu(Dtype::Bf16);
        let (_, _, want_set) = case.zeroed().cpu(Dtype::Bf16);
        let what = |x: &str| format!("cuDNN attention hs {hs} (B {b}, T {t}, NH {nh}): {x}");
        let (out, lse, set) = case.tasks(&g, Dtype::Bf16, GradWrite::Set, false);
        compare_scaled(&what("lse"), &lse, &want_lse, 1e-4);
        compare_scaled(&what("out"), &out, &want_out, 0.0125);
        compare_scaled(&what("gradient set"), &set, &want_set, 0.0125);
        let again = case.tasks(&g, Dtype::Bf16, GradWrite::Set, false);
        assert_eq!(again, (out, lse, set), "{}", what("a second run"));
        set_attention_kernels(AttentionKernels::Auto);
        let auto = case.tasks(&g, Dtype::Bf16, GradWrite::Set, false);
        set_attention_kernels(AttentionKernels::Cudnn);
        assert_eq!(auto, again, "{}", what("auto against cudnn"));
        let (_, _, added) = case.tasks(&g, Dtype::Bf16, GradWrite::Add, false);
        let dinp0 = FaCase::stored(Dtype::Bf16, &case.dinp0);
        let grad = |d: &[f32]| -> Vec<f32> { d.iter().zip(&dinp0).map(|(&a, &b)| a - b).collect() };
        compare_scaled(
            &what("gradient added"),
            &grad(&added),
            &grad(&want_dinp),
            0.0125,
        );
    }
    let report = cudnn_report();
    for line in &report {
        eprintln!("{line}");
    }
    for direction in ["Forward", "Backward"] {
        assert!(
            report
                .iter()
                .any(|l| l.contains(direction) && !l.contains("Braid's kernels")),
            "the {direction} ran through cuDNN (T 256 is a multiple of 128): {report:?}"
        );
    }
}

/// |got - want| at most `bound` times the largest |want| (the tensor's
/// scale), for results whose rounding differs by design.
fn compare_scaled(what: &str, got: &[f32], want: &[f32], bound: f32) {
    let scale = want.iter().fold(0.0f32, |m, &x| m.max(x.abs()));
    compare(what, got, want, bound * scale, 0.0);
}

fn attention_bf16(dev: Device) {
    let g = Dev::new(dev);
    let bnh = B * NH;
    let inp = bf16(&randn(B * T * 3 * C, 1.0, 130));
    let (mut out, mut preatt, mut att) = (
        vec![Bf16(0); B * T * C],
        vec![Bf16(0); bnh * T * T],
        vec![Bf16(0); bnh * T * T],
    );
    cpu::attention_forward(&mut out, &mut preatt, &mut att, &inp, B, T, C, NH);
    let binp = g.up_bf16(&inp);
    let (gout, gpre, gatt) = (
        g.up_bf16(&vec![Bf16(0); B * T * C]),
        g.up_bf16(&vec![Bf16(0); bnh * T * T]),
        g.up_bf16(&vec![Bf16(0); bnh * T * T]),
    );
    let fwd_scratch = g.zeros(attention::forward_scratch_bytes(B, T, C, NH, Dtype::Bf16) / 4);
    let v = [&gout, &gpre, &gatt, &binp, &fwd_scratch].map(|b| b.whole());
    done(attention::forward(
        bf16_task(&g.rt, "attention_forward bf16"),
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
    let (gpre, gatt, gout) = (g.down_bf16(&gpre), g.down_bf16(&gatt), g.down_bf16(&gout));
    if dev == Device::Cpu {
        // The task runs the kernel it is checked against: identical.
        compare_bf16("attention_forward bf16 preatt", &gpre, &preatt, 0);
        compare_bf16("attention_forward bf16 att", &gatt, &att, 0);
        compare_bf16("attention_forward bf16 out", &gout, &out, 0);
    } else {
        // CUDA: cuBLAS bf16 products (f32 sums in its order, one rounding)
        // and a softmax of the scores as stored in bf16, where the CPU keeps
        // them in f32: a score s moves the probability by up to |s|·2⁻⁸
        // relative. The masked triangle of preatt is cuBLAS's full product
        // there (nothing reads it): compared on the causal part only.
        let causal = |x: &[Bf16]| -> Vec<f32> {
            (0..bnh * T * T)
                .filter(|i| i % T <= (i / T) % T)
                .map(|i| x[i].to_f32())
                .collect()
        };
        let max_abs = |x: &[f32]| x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let (gp, cp) = (causal(&gpre), causal(&preatt));
        compare("attention_forward bf16 preatt", &gp, &cp, 1e-5, 1.0 / 128.0);
        let (ga, ca) = (widen(&gatt), widen(&att));
        compare("attention_forward bf16 att", &ga, &ca, 2e-3, 3e-2);
        let (go, co) = (widen(&gout), widen(&out));
        let atol = 1e-2 * max_abs(&co);
        compare("attention_forward bf16 out", &go, &co, atol, 3e-2);
    }

    // The backward pass from the CPU's att, so that only its own reduction
    // order differs.
    let batt = g.up_bf16(&att);
    let dout = bf16(&randn(B * T * C, 1.0, 131));
    let mut dinp = bf16(&randn(B * T * 3 * C, 0.1, 132));
    let (bdout, bdinp) = (g.up_bf16(&dout), g.up_bf16(&dinp));
    let bwd_scratch = g.zeros(attention::backward_scratch_bytes(B, T, C, NH, Dtype::Bf16) / 4);
    let v = [&bdinp, &bdout, &binp, &batt, &bwd_scratch].map(|b| b.whole());
    done(attention::backward(
        bf16_task(&g.rt, "attention_backward bf16"),
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
    cpu::attention_backward(&mut dinp, &dout, &inp, &att, B, T, C, NH);
    let what = "attention_backward bf16 dinp";
    let got = widen(&g.down_bf16(&bdinp));
    if dev == Device::Cpu {
        compare(what, &got, &widen(&dinp), 0.0, 0.0);
    } else {
        // CUDA: dvaccum, datt, dpreatt and each of dq, dk, dv are rounded
        // to bf16 between the products (the CPU keeps them in f32): a few
        // bf16 steps of the largest gradient.
        let want = widen(&dinp);
        let largest = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        compare(what, &got, &want, 2e-2 * largest, 3e-2);
    }
}

test_device!(attention_bf16, attention_bf16_cpu, attention_bf16_cuda);

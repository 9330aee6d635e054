//! The kernel families of `braid_gpt2::kernels`, each task run on the CUDA
//! backend and compared with its CPU kernel on the same inputs; and misuse,
//! one test body on every backend present.
//!
//! GPU tests skip with a message when no GPU is present and fail instead when
//! `BRAID_REQUIRE_GPU=1`. Without a GPU, the misuse tests run on the CPU and
//! an NVRTC compile of every source runs (when libnvrtc is found; required
//! with `BRAID_REQUIRE_NVRTC=1`).
//!
//! What a task may touch is checked by the compiler (a body gets exactly the
//! slices its tokens declare, read-only for a read) and at submission (no
//! written token overlaps another, every view is aligned for its type), so
//! the remaining misuse is a wrong shape: the CUDA launchers refuse it before
//! queuing anything and the CPU kernels before any work, failing the task
//! with a message that names the argument.

#[macro_use]
mod common;

use braid::{Buffer, Error, Runtime, TaskHandle};
use braid_gpt2::checkpoint::AdamWHyper;
use braid_gpt2::kernels::cpu::{Bf16, Dtype};
use braid_gpt2::kernels::task::Task;
use braid_gpt2::kernels::{
    adamw, attention, check_tokens, cpu, encoder, fused_classifier, gelu, kernel_headers,
    kernel_sources, layernorm, loss, matmul, norm, preload, residual, GradWrite,
};
use braid_gpt2::rng::randn;
use common::{Device, TEST_ADAMW};

// Small shapes, not multiples of the block sizes.
const B: usize = 2;
const T: usize = 37;
const C: usize = 96;
const NH: usize = 4;
/// Rows of the layer-norm tests: three row chunks of the CUDA parameter
/// gradients' sums (`layernorm::params_chunks`), the last one short.
const LN_ROWS: usize = 700;
const V: usize = 333;

/// Token ids below `V`, with repeats (embedding gradients accumulate).
fn tokens(n: usize, seed: u64) -> Vec<u32> {
    let ids: Vec<u32> = (0..n)
        .map(|i| ((i as u64 * 2654435761 + seed) % 29) as u32 * 11 % V as u32)
        .collect();
    check_tokens(&ids, V).expect("test tokens are in range");
    ids
}

/// Asserts max |got - want| / (atol + rtol·|want|) <= 1.
#[track_caller]
fn compare(what: &str, got: &[f32], want: &[f32], atol: f32, rtol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let mut worst = (0.0f32, 0usize);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = if g.is_nan() || w.is_nan() {
            f32::INFINITY
        } else {
            (g - w).abs() / (atol + rtol * w.abs())
        };
        if err > worst.0 {
            worst = (err, i);
        }
    }
    let (err, i) = worst;
    eprintln!("    {what}: worst scaled error {err:.3} at {i}");
    assert!(
        err <= 1.0,
        "{what}: element {i}: gpu {} vs cpu {} (scaled error {err:.2})",
        got[i],
        want[i]
    );
}

/// `x` rounded to bf16, as the CPU kernels store it.
fn bf16(x: &[f32]) -> Vec<Bf16> {
    x.iter().map(|&v| Bf16::from_f32(v)).collect()
}

/// `x`'s bits as a monotonic integer: consecutive bf16 values are 1 apart,
/// and -0 and +0 are both 0.
fn bf16_ordinal(x: Bf16) -> i32 {
    let mag = (x.0 & 0x7fff) as i32;
    if x.0 & 0x8000 != 0 {
        -mag
    } else {
        mag
    }
}

/// Asserts that every bf16 element of `got` is within `max_ulps` bf16 ulps
/// of `want` (0: bit-identical, NaN for NaN), and prints how many differ.
#[track_caller]
fn compare_bf16(what: &str, got: &[Bf16], want: &[Bf16], max_ulps: i32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let mut differ = 0usize;
    let mut worst = (0i32, 0usize);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let (gn, wn) = (g.to_f32().is_nan(), w.to_f32().is_nan());
        let ulps = match (gn, wn) {
            (true, true) => 0,
            (false, false) => (bf16_ordinal(g) - bf16_ordinal(w)).abs(),
            _ => i32::MAX,
        };
        differ += (ulps != 0) as usize;
        if ulps > worst.0 {
            worst = (ulps, i);
        }
    }
    let (ulps, i) = worst;
    eprintln!(
        "    {what}: {differ} of {} differ, worst {ulps} bf16 ulp(s) at {i}",
        got.len()
    );
    assert!(
        ulps <= max_ulps,
        "{what}: element {i}: task {} vs cpu kernel {} ({ulps} bf16 ulps, at most {max_ulps})",
        got[i].to_f32(),
        want[i].to_f32()
    );
}

/// A bf16 task named `name`.
fn bf16_task<'rt>(rt: &'rt Runtime, name: &str) -> Task<'rt> {
    Task::new(rt.task(name.to_string()), Dtype::Bf16)
}

/// A runtime of one backend and helpers to move data.
struct Dev {
    rt: Runtime,
}

impl Dev {
    fn new(dev: Device) -> Dev {
        let rt = Runtime::builder()
            .backend(dev.backend())
            .build()
            .expect("runtime");
        if let Some(d) = rt.cuda_device() {
            preload(d).expect("every GPT-2 kernel compiles and loads");
        }
        Dev { rt }
    }

    /// A CUDA runtime, or `None` (after printing why) when there is no GPU;
    /// panics instead under `BRAID_REQUIRE_GPU=1`.
    fn gpu(test: &str) -> Option<Dev> {
        Device::Cuda.present(test).then(|| Dev::new(Device::Cuda))
    }

    fn up(&self, data: &[f32]) -> Buffer {
        self.rt.alloc_from("input", data).unwrap()
    }

    fn up_u32(&self, data: &[u32]) -> Buffer {
        self.rt.alloc_from("tokens", data).unwrap()
    }

    /// `n` zeroed `f32`.
    fn zeros(&self, n: usize) -> Buffer {
        self.rt.alloc("output", n * 4).unwrap()
    }

    fn down(&self, b: &Buffer) -> Vec<f32> {
        self.rt.read_vec(b).unwrap()
    }

    fn up_bf16(&self, data: &[Bf16]) -> Buffer {
        self.rt.alloc_from("input", data).unwrap()
    }

    fn down_bf16(&self, b: &Buffer) -> Vec<Bf16> {
        self.rt.read_vec(b).unwrap()
    }
}

/// Waits for a submitted task.
#[track_caller]
fn done(h: braid::Result<TaskHandle>) {
    h.expect("submitted").wait().expect("the task ran");
}

// ---------------------------------------------------------------------------
// Without a GPU
// ---------------------------------------------------------------------------

#[test]
fn kernel_sources_compile_with_nvrtc() {
    if !braid::cuda::nvrtc_library_present() {
        if std::env::var("BRAID_REQUIRE_NVRTC").is_ok_and(|v| v == "1") {
            panic!("BRAID_REQUIRE_NVRTC=1 but libnvrtc could not be loaded");
        }
        eprintln!(
            "SKIPPED kernel_sources_compile_with_nvrtc: libnvrtc not found \
             (run scripts/install-nvrtc.sh and set LD_LIBRARY_PATH)"
        );
        return;
    }
    let sources = kernel_sources();
    assert_eq!(sources.len(), 11);
    let opts = braid::cuda::CompileOptions::for_arch("sm_90");
    for (name, source) in sources {
        let k = braid::cuda::compile_with_headers(source, kernel_headers(), name, &opts)
            .unwrap_or_else(|e| panic!("{name} does not compile: {e}"));
        assert!(k.is_cubin && !k.image.is_empty(), "{name}");
    }
}

// ---------------------------------------------------------------------------
// Misuse, on every backend
// ---------------------------------------------------------------------------

/// Overlapping outputs and misaligned views are refused at submission, with
/// nothing submitted and nothing written.
fn misuse_is_refused_at_submission(dev: Device) {
    let g = Dev::new(dev);
    let n = 1000;
    let (a, b, big) = (g.up(&randn(n, 1.0, 80)), g.zeros(n), g.zeros(2 * n + 1));
    let half = |lo: usize| big.view_of::<f32>(lo..lo + n).unwrap();
    // The output overlapping the input.
    let e = gelu::forward(g.rt.task("overlap"), &half(0), &half(n / 2)).unwrap_err();
    assert!(
        matches!(&e, Error::BorrowConflict { task, .. } if task == "overlap"),
        "{e}"
    );
    // Residual gradients into overlapping views.
    let e = residual::backward(g.rt.task("overlap 2"), &half(0), &half(1), &a.whole()).unwrap_err();
    assert!(matches!(&e, Error::BorrowConflict { .. }), "{e}");
    // A misaligned output (starts 2 bytes into the buffer).
    let odd = big.view(2..2 + 4 * n).unwrap();
    let e = gelu::forward(g.rt.task("odd"), &odd, &a.whole()).unwrap_err();
    assert!(matches!(&e, Error::Misaligned { .. }), "{e}");
    g.rt.synchronize().unwrap();
    assert!(g.down(&b).iter().all(|&x| x == 0.0));
    assert!(g.down(&big).iter().all(|&x| x == 0.0));
}

test_device!(
    misuse_is_refused_at_submission,
    misuse_is_refused_at_submission_cpu,
    misuse_is_refused_at_submission_cuda
);

/// A wrong shape fails the task, naming the kernel and the argument: a
/// launcher's typed error on CUDA (before anything is queued), the CPU
/// kernel's assertion on the CPU (before any work).
fn bad_shapes_fail_the_task(dev: Device) {
    let g = Dev::new(dev);
    let n = B * T;
    // Fresh buffers for every case: a failed task's outputs fail its readers.
    let f = |len: usize| g.zeros(len).whole();
    let fails = |h: braid::Result<TaskHandle>, task: &str, needles: &[&str]| {
        let e = h.expect("a shape error is not a submission error").wait();
        let msg = e.expect_err("a wrong shape must fail the task").to_string();
        assert!(msg.contains(task), "{dev:?}: {msg}");
        for needle in needles {
            assert!(msg.contains(needle), "{dev:?}: `{needle}` not in: {msg}");
        }
    };
    // `out` one element short.
    let h = layernorm::forward(
        g.rt.task("short out"),
        &f(n * C - 1),
        &f(n),
        &f(n),
        &f(n * C),
        &f(C),
        &f(C),
        n,
        C,
    );
    fails(h, "short out", &["layernorm_forward", "`out`"]);
    // Lengths that differ.
    let h = gelu::forward(g.rt.task("lengths"), &f(n * C), &f(n * C - 1));
    fails(h, "lengths", &["gelu_forward", "`inp`"]);
    // C not divisible by NH.
    let h = attention::forward(
        g.rt.task("heads"),
        &f(n * C),
        &f(B * 5 * T * T),
        &f(B * 5 * T * T),
        &f(n * 3 * C),
        &f(4 * n * C),
        B,
        T,
        C,
        5,
    );
    fails(h, "heads", &["not divisible"]);
    // Step 0.
    let h = adamw::update(
        g.rt.task("step 0"),
        &f(C),
        &f(C),
        &f(C),
        &f(C),
        None,
        0,
        AdamWHyper::default(),
    );
    fails(h, "step 0", &["from 1"]);
}

test_device!(
    bad_shapes_fail_the_task,
    bad_shapes_fail_the_task_cpu,
    bad_shapes_fail_the_task_cuda
);

// ---------------------------------------------------------------------------
// On the GPU: each family's task against its CPU kernel
// ---------------------------------------------------------------------------

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

// ---------------------------------------------------------------------------
// bf16 storage: each family's bf16 task against its CPU kernel on the same
// bf16 inputs, with the tolerance the CUDA kernel is held to. On CUDA
// (`*_bf16_cuda`) that is the bf16 CUDA kernels against the CPU; the `_cpu`
// twins run the same body through the CPU backend (the bf16 task plumbing
// and the comparisons themselves; equal there). The CUDA kernels compiled
// under NVRTC 13.0 but had not run on a GPU when these tests were written.
// ---------------------------------------------------------------------------

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

fn layernorm_bf16(dev: Device) {
    let g = Dev::new(dev);
    let n = LN_ROWS;
    let inp = bf16(&randn(n * C, 2.0, 110));
    let w = bf16(
        &randn(C, 0.3, 111)
            .iter()
            .map(|x| 1.0 + x)
            .collect::<Vec<_>>(),
    );
    let bias = bf16(&randn(C, 0.3, 112));
    let (mut out, mut mean, mut rstd) = (vec![Bf16(0); n * C], vec![0.0; n], vec![0.0; n]);
    cpu::layernorm_forward(&mut out, &mut mean, &mut rstd, &inp, &w, &bias, 1, n, C);
    let (dinp, dw, db) = (g.up_bf16(&inp), g.up_bf16(&w), g.up_bf16(&bias));
    let (gout, gmean, grstd) = (g.up_bf16(&vec![Bf16(0); n * C]), g.zeros(n), g.zeros(n));
    let v = [&gout, &gmean, &grstd, &dinp, &dw, &db].map(|b| b.whole());
    done(layernorm::forward(
        bf16_task(&g.rt, "layernorm_forward bf16"),
        &v[0],
        &v[1],
        &v[2],
        &v[3],
        &v[4],
        &v[5],
        n,
        C,
    ));
    // The statistics are f64 sums in another order (a warp tree), rounded to
    // f32: equal to the CPU's or one f32 ulp off, which may move an output's
    // rounding by one bf16 ulp.
    compare(
        "layernorm_forward bf16 mean",
        &g.down(&gmean),
        &mean,
        1e-7,
        1e-6,
    );
    compare(
        "layernorm_forward bf16 rstd",
        &g.down(&grstd),
        &rstd,
        0.0,
        1e-6,
    );
    compare_bf16("layernorm_forward bf16 out", &g.down_bf16(&gout), &out, 1);

    // The backward pass from the CPU's statistics, so that only the
    // reductions inside the backward kernels differ.
    let (bmean, brstd) = (g.up(&mean), g.up(&rstd));
    let dout = bf16(&randn(n * C, 1.0, 113));
    let (mut gi, mut gw, mut gb) = (
        bf16(&randn(n * C, 0.1, 114)),
        bf16(&randn(C, 0.1, 115)),
        bf16(&randn(C, 0.1, 116)),
    );
    let (bi, bw, bb, bdout) = (
        g.up_bf16(&gi),
        g.up_bf16(&gw),
        g.up_bf16(&gb),
        g.up_bf16(&dout),
    );
    let scratch = g.zeros(layernorm::backward_scratch_bytes(n, C) / 4);
    let v = [&bi, &bw, &bb, &bdout, &dinp, &dw, &bmean, &brstd, &scratch].map(|b| b.whole());
    done(layernorm::backward(
        bf16_task(&g.rt, "layernorm_backward bf16"),
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
    cpu::layernorm_backward(
        &mut gi, &mut gw, &mut gb, &dout, &inp, &w, &mean, &rstd, 1, n, C,
    );
    // dinp: the two row means are f64 sums in another order (one bf16 ulp);
    // dweight, dbias: on CUDA the rows are summed in chunks, each by 8 warps,
    // then the chunks in order (f32, another order than the CPU's rows in
    // turn):
    // within one bf16 ulp. On the CPU the task runs the kernel: identical.
    let ulps = if dev == Device::Cpu { 0 } else { 1 };
    compare_bf16("layernorm_backward bf16 dinp", &g.down_bf16(&bi), &gi, 1);
    compare_bf16(
        "layernorm_backward bf16 dweight",
        &g.down_bf16(&bw),
        &gw,
        ulps,
    );
    compare_bf16(
        "layernorm_backward bf16 dbias",
        &g.down_bf16(&bb),
        &gb,
        ulps,
    );
}

/// bf16 values as `f32`.
fn widen(x: &[Bf16]) -> Vec<f32> {
    x.iter().map(|v| v.to_f32()).collect()
}

/// A bf16 product added to what its output held (the bias, a gradient
/// accumulated so far) against the CPU's result `want`; `product` is the
/// CPU's product alone. The products are summed in f32 in cuBLAS's order,
/// not the CPU gemm's, and cuBLAS (13.0, seen on an H200) rounds the
/// product to bf16 before it adds `beta·C`, where the CPU rounds the sum
/// once (seen: bias 1.203125, product -1.20647: CPU -0.00334, cuBLAS 0). So
/// on CUDA each element is held within one bf16 step of the product plus
/// one of the result (2⁻⁷ relative each, and 1e-5 for sums that cancel to
/// near 0). On the CPU the task runs the kernel: identical.
fn accumulated(dev: Device, what: &str, got: &[Bf16], want: &[Bf16], product: &[Bf16]) {
    let (got, want, product) = (widen(got), widen(want), widen(product));
    if dev == Device::Cpu {
        compare(what, &got, &want, 0.0, 0.0);
        return;
    }
    within_bound(what, &got, &want, &product, "product", |i| {
        (product[i].abs() + want[i].abs()) / 128.0 + 1e-5
    });
}

/// Asserts `|got[i] - want[i]| <= bound(i)` for every element, naming the
/// worst (with `aside[i]`, called `aside_name`, beside it) if one is not.
fn within_bound(
    what: &str,
    got: &[f32],
    want: &[f32],
    aside: &[f32],
    aside_name: &str,
    bound: impl Fn(usize) -> f32,
) {
    let (worst, at) = (0..got.len())
        .map(|i| ((got[i] - want[i]).abs() / bound(i), i))
        .fold(
            (0.0f32, 0),
            |(m, i), (e, j)| if e > m { (e, j) } else { (m, i) },
        );
    eprintln!("    {what}: worst error {worst:.3} of its bound at {at}");
    assert!(
        worst <= 1.0,
        "{what}: element {at}: gpu {} vs cpu {} ({aside_name} {}): {worst} times the bound",
        got[at],
        want[at],
        aside[at]
    );
}

/// A bf16 linear layer `(n, C) → (n, oc)` from seeds `seed..seed + 3` on
/// the device (input, weight, bias), and the CPU's results: the product
/// plus the bias, and the product alone (`accumulated`'s inputs).
struct Bf16Linear {
    inp: Buffer,
    w: Buffer,
    bias: Buffer,
    want: Vec<Bf16>,
    product: Vec<Bf16>,
}

fn bf16_linear(g: &Dev, n: usize, oc: usize, seed: u64) -> Bf16Linear {
    let inp = bf16(&randn(n * C, 1.0, seed));
    let w = bf16(&randn(oc * C, 0.2, seed + 1));
    let bias = bf16(&randn(oc, 0.5, seed + 2));
    let mut want = vec![Bf16(0); n * oc];
    cpu::matmul_forward(&mut want, &inp, &w, Some(&bias[..]), 1, n, C, oc);
    let mut product = vec![Bf16(0); n * oc];
    cpu::matmul_forward(&mut product, &inp, &w, None, 1, n, C, oc);
    Bf16Linear {
        inp: g.up_bf16(&inp),
        w: g.up_bf16(&w),
        bias: g.up_bf16(&bias),
        want,
        product,
    }
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

/// `matmul::forward_gelu` (the MLP's first layer and its GELU as one task)
/// is `matmul::forward` then `gelu::forward`, bit for bit, in f32 and bf16
/// (on CUDA with `BRAID_CUBLASLT_GELU` unset: the same kernels).
fn matmul_gelu_task(dev: Device) {
    if matmul::gelu_epilogue() {
        eprintln!("matmul_gelu_task: BRAID_CUBLASLT_GELU=1 runs the epilogue; see the _cuda test");
        return;
    }
    let g = Dev::new(dev);
    let (n, oc) = (B * T, 4 * C);
    for dtype in [Dtype::F32, Dtype::Bf16] {
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
/// what `BRAID_CUBLASLT_GELU=1` turns on): the pre-activation against the
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

/// Held by the fused-attention tests: `flash_attention_cudnn_cuda` turns
/// cuDNN's attention on for the process while it runs, which the others
/// must not see.
fn attention_lock() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// With `BRAID_ATTENTION=cudnn` (here `set_cudnn_attention`), bf16 fused
/// attention runs cuDNN's flash-attention engines: against the CPU kernels
/// within the tensor-core kernels' bounds (cuDNN also rounds P and dS to
/// bf16), at head sizes 64 and 32, with T a multiple of 128 and not (cuDNN
/// 9.15.0 and older take a backward of such a T only through Braid's
/// kernels). The backward (cuDNN's deterministic algorithm) gives the same
/// bits twice; a gradient added to one that is not zero (`GradWrite::Add`)
/// takes Braid's kernels after cuDNN's forward. It prints which graph and
/// engine cuDNN chose. Needs libcudnn (9); skipped without it, except
/// under `BRAID_REQUIRE_GPU=1`.
#[test]
fn flash_attention_cudnn_cuda() {
    use braid_gpt2::kernels::flash_attention::{cudnn_report, set_cudnn_attention};
    let _attention = attention_lock();
    if !braid::cuda::cudnn::cudnn_or_skip("flash_attention_cudnn_cuda") {
        return;
    }
    let g = Dev::new(Device::Cuda);
    struct Off;
    impl Drop for Off {
        fn drop(&mut self) {
            set_cudnn_attention(false);
        }
    }
    let _off = Off;
    set_cudnn_attention(true);
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
            report.iter().any(|l| l.contains(direction)),
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

/// The fused residual + layer norm (`layernorm::forward_residual`,
/// `layernorm::backward_residual`) against the residual and layer-norm tasks
/// in turn on the same backend, bit for bit, `f32` and bf16: on the CPU the
/// task plumbing, on CUDA the fused kernels (the same warp code as the
/// unfused ones, reading the stored sum; the backward the same kernel with
/// `dres` as its base).
fn residual_layernorm_tasks(dev: Device) {
    let g = Dev::new(dev);
    let n = B * T;
    let w1: Vec<f32> = randn(C, 0.3, 171).iter().map(|x| 1.0 + x).collect();
    let data = [
        randn(n * C, 1.0, 170), // inp1
        randn(n * C, 1.0, 172), // inp2
        w1,                     // weight
        randn(C, 0.3, 173),     // bias
        randn(n * C, 1.0, 174), // dres
        randn(n * C, 1.0, 175), // dout
        randn(C, 0.1, 176),     // dweight, accumulated into
        randn(C, 0.1, 177),     // dbias, accumulated into
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
        let (res, out) = (zeros(n * C), zeros(n * C));
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
            C,
        ));
        let (fres, fout) = (zeros(n * C), zeros(n * C));
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
            C,
        ));
        let what = format!("{dev:?} {dtype:?}");
        assert_eq!(bits(&fres), bits(&res), "{what}: residual");
        assert_eq!(bits(&fout), bits(&out), "{what}: out");
        assert_eq!(g.down(&fmean), g.down(&mean), "{what}: mean");
        assert_eq!(g.down(&frstd), g.down(&rstd), "{what}: rstd");

        // Backward: zeroed dinp += dres (residual backward) += the layer
        // norm's; fused: dinp (garbage) overwritten with dres + the same.
        let ln_scratch = zeros(layernorm::backward_scratch_bytes(n, C) / 4);
        let (dinp, dproj) = (zeros(n * C), zeros(n * C));
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
            C,
        ));
        let fdinp = up(&randn(n * C, 5.0, 178));
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
            C,
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

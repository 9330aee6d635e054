//! The CUDA launchers of `braid_gpt2::kernels::cuda`, each run inside a Braid
//! task on the CUDA backend and compared with the CPU kernel on the same
//! inputs (tolerances as in `tools/nvrtc-check`'s `cuda-kernel-check`).
//!
//! GPU tests skip with a message when no GPU is present and fail instead when
//! `BRAID_REQUIRE_GPU=1`. Without a GPU, the argument checks (which run before
//! the backend is looked at) and an NVRTC compile of every source (when
//! libnvrtc is found; required with `BRAID_REQUIRE_NVRTC=1`) still run.

use std::sync::{Arc, Mutex};

use braid::{BackendKind, Buffer, Error, Runtime, TaskCtx};
use braid_gpt2::kernels::{check_tokens, cpu, cuda as gk};
use braid_gpt2::rng::randn;

// Small shapes, not multiples of the block sizes.
const B: usize = 2;
const T: usize = 37;
const C: usize = 96;
const NH: usize = 4;
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

/// A CUDA runtime and helpers to move data and run one launcher per task.
struct Gpu {
    rt: Runtime,
}

impl Gpu {
    /// `None` (after printing why) when there is no GPU; panics instead under
    /// `BRAID_REQUIRE_GPU=1`.
    fn new(test: &str) -> Option<Gpu> {
        if !braid::cuda::gpu_or_skip(test) {
            return None;
        }
        let rt = Runtime::builder()
            .backend(BackendKind::Cuda { device: 0 })
            .build()
            .expect("CUDA runtime");
        gk::preload(rt.cuda_device().expect("a CUDA runtime has a device"))
            .expect("every GPT-2 kernel compiles and loads");
        Some(Gpu { rt })
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

    /// Runs `body` as one task declaring `read` on `reads` and `read_write`
    /// on `writes`, and waits for it.
    fn run(
        &self,
        name: &'static str,
        reads: &[&Buffer],
        writes: &[&Buffer],
        body: impl FnOnce(&TaskCtx<'_>) -> braid::Result<()> + Send + 'static,
    ) -> braid::Result<()> {
        run_on(&self.rt, name, reads, writes, body)
    }
}

fn run_on(
    rt: &Runtime,
    name: &'static str,
    reads: &[&Buffer],
    writes: &[&Buffer],
    body: impl FnOnce(&TaskCtx<'_>) -> braid::Result<()> + Send + 'static,
) -> braid::Result<()> {
    let mut task = rt.task(name);
    for b in reads {
        task = task.read(*b);
    }
    for b in writes {
        task = task.read_write(*b);
    }
    task.run_ctx(move |ctx| Ok(body(ctx)?))?.wait()
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
    let sources = gk::kernel_sources();
    assert_eq!(sources.len(), 8);
    let opts = braid::cuda::CompileOptions::for_arch("sm_90");
    for (name, source) in sources {
        let k = braid::cuda::compile(source, name, &opts)
            .unwrap_or_else(|e| panic!("{name} does not compile: {e}"));
        assert!(k.is_cubin && !k.image.is_empty(), "{name}");
    }
}

/// Launchers check shapes before anything else, so a wrong view is a typed
/// error naming the argument even on the CPU backend; with correct shapes, a
/// CPU task gets `BackendUnavailable`, never a panic or a launch.
#[test]
fn launchers_reject_bad_shapes_and_cpu_tasks() {
    let rt = Runtime::cpu().unwrap();
    let n = B * T;
    let f = |len: usize| rt.alloc("x", len * 4).unwrap();
    let (out, short, mean, rstd, inp, w, bias) =
        (f(n * C), f(n * C - 1), f(n), f(n), f(n * C), f(C), f(C));
    let errors = Arc::new(Mutex::new(Vec::<Error>::new()));
    let sink = errors.clone();
    let (out_v, short_v, mean_v, rstd_v, inp_v, w_v, bias_v) = (
        out.whole(),
        short.whole(),
        mean.whole(),
        rstd.whole(),
        inp.whole(),
        w.whole(),
        bias.whole(),
    );
    run_on(
        &rt,
        "misuse",
        &[&inp, &w, &bias],
        &[&out, &short, &mean, &rstd],
        move |ctx| {
            let mut e = sink.lock().unwrap();
            let mut push = |r: braid::Result<()>| e.push(r.expect_err("must fail"));
            // 0: out one element short.
            push(gk::layernorm_forward(
                ctx, &short_v, &mean_v, &rstd_v, &inp_v, &w_v, &bias_v, B, T, C,
            ));
            // 1: correct shapes, but a CPU task.
            push(gk::layernorm_forward(
                ctx, &out_v, &mean_v, &rstd_v, &inp_v, &w_v, &bias_v, B, T, C,
            ));
            // 2: lengths differ.
            push(gk::gelu_forward(ctx, &out_v, &short_v));
            // 3: C not divisible by NH.
            push(gk::attention_forward(
                ctx, &out_v, &mean_v, &rstd_v, &inp_v, &w_v, B, T, C, 5,
            ));
            // 4: a zero dimension.
            push(gk::matmul_forward(
                ctx, &out_v, &inp_v, &w_v, None, B, 0, C, C,
            ));
            // 5: step 0.
            push(gk::adamw_update(
                ctx, &w_v, &bias_v, &out_v, &out_v, None, 0, 1e-3, 0.9, 0.95, 1e-8, 0.0,
            ));
            Ok(())
        },
    )
    .unwrap();
    let errors = errors.lock().unwrap();
    let device_err = |i: usize, op: &str, needle: &str| match &errors[i] {
        Error::Device { op: o, message, .. } => {
            assert_eq!(o, op, "error {i}");
            assert!(message.contains(needle), "error {i}: {message}");
        }
        other => panic!("error {i}: expected a shape error, got {other:?}"),
    };
    device_err(0, "layernorm_forward", "`out`");
    assert!(
        matches!(
            &errors[1],
            Error::BackendUnavailable {
                backend: "cuda",
                ..
            }
        ),
        "{:?}",
        errors[1]
    );
    device_err(2, "gelu_forward", "`inp`");
    device_err(3, "attention_forward", "not divisible");
    device_err(4, "matmul_forward", "T is 0");
    device_err(5, "adamw_update", "from 1");
}

// ---------------------------------------------------------------------------
// On the GPU: each launcher against its CPU kernel
// ---------------------------------------------------------------------------

#[test]
fn encoder_matches_cpu() {
    let Some(g) = Gpu::new("cuda_kernels::encoder_matches_cpu") else {
        return;
    };
    let max_t = T + 5; // wpe may have more rows than T
    let (wte, wpe) = (randn(V * C, 1.0, 1), randn(max_t * C, 1.0, 2));
    let tok = tokens(B * T, 3);
    let mut want = vec![0.0; B * T * C];
    cpu::encoder_forward(&mut want, &tok, &wte, &wpe, B, T, C);
    let (dwte, dwpe, dtok, out) = (g.up(&wte), g.up(&wpe), g.up_u32(&tok), g.zeros(B * T * C));
    g.run("encoder_forward", &[&dtok, &dwte, &dwpe], &[&out], {
        let (o, tk, te, pe) = (out.whole(), dtok.whole(), dwte.whole(), dwpe.whole());
        // SAFETY: every token id is < V (checked by `tokens`).
        move |ctx| unsafe { gk::encoder_forward(ctx, &o, &tk, &te, &pe, B, T, C) }
    })
    .unwrap();
    compare("encoder_forward", &g.down(&out), &want, 0.0, 0.0);

    let dout = randn(B * T * C, 1.0, 4);
    let (mut gwte, mut gwpe) = (randn(V * C, 0.1, 5), randn(max_t * C, 0.1, 6));
    let (bwte, bwpe, bdout) = (g.up(&gwte), g.up(&gwpe), g.up(&dout));
    cpu::encoder_backward(&mut gwte, &mut gwpe, &dout, &tok, B, T, C);
    g.run("encoder_backward", &[&bdout, &dtok], &[&bwte, &bwpe], {
        let (te, pe, d, tk) = (bwte.whole(), bwpe.whole(), bdout.whole(), dtok.whole());
        // SAFETY: every token id is < V (checked by `tokens`).
        move |ctx| unsafe { gk::encoder_backward(ctx, &te, &pe, &d, &tk, B, T, C) }
    })
    .unwrap();
    // Same summation order as the CPU: bitwise equal.
    compare("encoder_backward dwpe", &g.down(&bwpe), &gwpe, 0.0, 0.0);
    compare("encoder_backward dwte", &g.down(&bwte), &gwte, 0.0, 0.0);
}

#[test]
fn layernorm_matches_cpu_and_is_deterministic() {
    let Some(g) = Gpu::new("cuda_kernels::layernorm_matches_cpu_and_is_deterministic") else {
        return;
    };
    let n = B * T;
    let inp = randn(n * C, 2.0, 10);
    let w: Vec<f32> = randn(C, 0.3, 11).iter().map(|x| 1.0 + x).collect();
    let bias = randn(C, 0.3, 12);
    let (mut out, mut mean, mut rstd) = (vec![0.0; n * C], vec![0.0; n], vec![0.0; n]);
    cpu::layernorm_forward(&mut out, &mut mean, &mut rstd, &inp, &w, &bias, B, T, C);
    let (dinp, dw, db) = (g.up(&inp), g.up(&w), g.up(&bias));
    let (gout, gmean, grstd) = (g.zeros(n * C), g.zeros(n), g.zeros(n));
    g.run(
        "layernorm_forward",
        &[&dinp, &dw, &db],
        &[&gout, &gmean, &grstd],
        {
            let v = [&gout, &gmean, &grstd, &dinp, &dw, &db].map(|b| b.whole());
            move |ctx| gk::layernorm_forward(ctx, &v[0], &v[1], &v[2], &v[3], &v[4], &v[5], B, T, C)
        },
    )
    .unwrap();
    compare("layernorm_forward out", &g.down(&gout), &out, 1e-5, 1e-4);
    compare("layernorm_forward mean", &g.down(&gmean), &mean, 1e-6, 1e-4);
    compare("layernorm_forward rstd", &g.down(&grstd), &rstd, 1e-6, 1e-4);

    let dout = randn(n * C, 1.0, 13);
    let (mut gi, mut gw, mut gb) = (randn(n * C, 0.1, 14), randn(C, 0.1, 15), randn(C, 0.1, 16));
    let mut results = Vec::new();
    for _ in 0..2 {
        let (bi, bw, bb, bdout) = (g.up(&gi), g.up(&gw), g.up(&gb), g.up(&dout));
        g.run(
            "layernorm_backward",
            &[&bdout, &dinp, &dw, &gmean, &grstd],
            &[&bi, &bw, &bb],
            {
                let v = [&bi, &bw, &bb, &bdout, &dinp, &dw, &gmean, &grstd].map(|b| b.whole());
                move |ctx| {
                    gk::layernorm_backward(
                        ctx, &v[0], &v[1], &v[2], &v[3], &v[4], &v[5], &v[6], &v[7], B, T, C,
                    )
                }
            },
        )
        .unwrap();
        results.push((g.down(&bi), g.down(&bw), g.down(&bb)));
    }
    assert!(
        results[0] == results[1],
        "layernorm_backward is not deterministic"
    );
    cpu::layernorm_backward(
        &mut gi, &mut gw, &mut gb, &dout, &inp, &w, &mean, &rstd, B, T, C,
    );
    compare("layernorm_backward dinp", &results[0].0, &gi, 1e-5, 1e-4);
    compare("layernorm_backward dweight", &results[0].1, &gw, 1e-4, 1e-4);
    compare("layernorm_backward dbias", &results[0].2, &gb, 1e-4, 1e-4);
}

#[test]
fn matmul_matches_cpu() {
    let Some(g) = Gpu::new("cuda_kernels::matmul_matches_cpu") else {
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
        g.run("matmul_forward", &[&binp, &bw, &bbias], &[&out], {
            let v = [&out, &binp, &bw, &bbias].map(|b| b.whole());
            move |ctx| {
                let bias = with_bias.then_some(&v[3]);
                gk::matmul_forward(ctx, &v[0], &v[1], &v[2], bias, B, T, C, oc)
            }
        })
        .unwrap();
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
    g.run("matmul_backward_input", &[&bdout, &bw], &[&bgi], {
        let v = [&bgi, &bdout, &bw].map(|b| b.whole());
        move |ctx| gk::matmul_backward_input(ctx, &v[0], &v[1], &v[2], B, T, C, oc)
    })
    .unwrap();
    compare("matmul_backward_input", &g.down(&bgi), &gi, 1e-4, 1e-4);

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
        g.run("matmul_backward_weight", &[&bdout, &binp], &[&bgw, &bgb], {
            let v = [&bgw, &bgb, &bdout, &binp].map(|b| b.whole());
            move |ctx| {
                let dbias = with_bias.then_some(&v[1]);
                gk::matmul_backward_weight(ctx, &v[0], dbias, &v[2], &v[3], B, T, C, oc)
            }
        })
        .unwrap();
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
    let Some(g) = Gpu::new("cuda_kernels::attention_matches_cpu_and_is_deterministic") else {
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
    let fwd_scratch = g.zeros(gk::attention_forward_scratch_bytes(B, T, C, NH) / 4);
    g.run(
        "attention_forward",
        &[&binp],
        &[&gout, &gpre, &gatt, &fwd_scratch],
        {
            let v = [&gout, &gpre, &gatt, &binp, &fwd_scratch].map(|b| b.whole());
            move |ctx| gk::attention_forward(ctx, &v[0], &v[1], &v[2], &v[3], &v[4], B, T, C, NH)
        },
    )
    .unwrap();
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
    let bwd_scratch = g.zeros(gk::attention_backward_scratch_bytes(B, T, C, NH) / 4);
    let mut results = Vec::new();
    for _ in 0..2 {
        let bdinp = g.up(&dinp);
        g.run(
            "attention_backward",
            &[&bdout, &binp, &gatt],
            &[&bdinp, &bwd_scratch],
            {
                let v = [&bdinp, &bdout, &binp, &gatt, &bwd_scratch].map(|b| b.whole());
                move |ctx| {
                    gk::attention_backward(ctx, &v[0], &v[1], &v[2], &v[3], &v[4], B, T, C, NH)
                }
            },
        )
        .unwrap();
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
    let Some(g) = Gpu::new("cuda_kernels::gelu_and_residual_match_cpu") else {
        return;
    };
    let n = 4099;
    let x = randn(n, 2.0, 40);
    let mut want = vec![0.0; n];
    cpu::gelu_forward(&mut want, &x);
    let (bx, out) = (g.up(&x), g.zeros(n));
    g.run("gelu_forward", &[&bx], &[&out], {
        let (o, i) = (out.whole(), bx.whole());
        move |ctx| gk::gelu_forward(ctx, &o, &i)
    })
    .unwrap();
    compare("gelu_forward", &g.down(&out), &want, 1e-6, 1e-5);

    let dout = randn(n, 1.0, 41);
    let mut dinp = randn(n, 0.1, 42);
    let (bd, bdout) = (g.up(&dinp), g.up(&dout));
    cpu::gelu_backward(&mut dinp, &x, &dout);
    g.run("gelu_backward", &[&bx, &bdout], &[&bd], {
        let v = [&bd, &bx, &bdout].map(|b| b.whole());
        move |ctx| gk::gelu_backward(ctx, &v[0], &v[1], &v[2])
    })
    .unwrap();
    compare("gelu_backward", &g.down(&bd), &dinp, 1e-6, 1e-5);

    let (a1, a2) = (randn(n, 1.0, 43), randn(n, 1.0, 44));
    let mut want = vec![0.0; n];
    cpu::residual_forward(&mut want, &a1, &a2);
    let (b1, b2) = (g.up(&a1), g.up(&a2));
    g.run("residual_forward", &[&b1, &b2], &[&out], {
        let v = [&out, &b1, &b2].map(|b| b.whole());
        move |ctx| gk::residual_forward(ctx, &v[0], &v[1], &v[2])
    })
    .unwrap();
    compare("residual_forward", &g.down(&out), &want, 0.0, 0.0);

    let (mut d1, mut d2) = (a1.clone(), a2.clone());
    cpu::residual_backward(&mut d1, &mut d2, &dout);
    g.run("residual_backward", &[&bdout], &[&b1, &b2], {
        let v = [&b1, &b2, &bdout].map(|b| b.whole());
        move |ctx| gk::residual_backward(ctx, &v[0], &v[1], &v[2])
    })
    .unwrap();
    compare("residual_backward dinp1", &g.down(&b1), &d1, 0.0, 0.0);
    compare("residual_backward dinp2", &g.down(&b2), &d2, 0.0, 0.0);
}

#[test]
fn softmax_and_crossentropy_match_cpu() {
    let Some(g) = Gpu::new("cuda_kernels::softmax_and_crossentropy_match_cpu") else {
        return;
    };
    let n = B * T;
    let logits = randn(n * V, 3.0, 50);
    let targets = tokens(n, 51);
    let (mut probs, mut losses) = (vec![0.0; n * V], vec![0.0; n]);
    cpu::softmax_forward(&mut probs, &logits, B, T, V);
    cpu::crossentropy_forward(&mut losses, &probs, &targets, B, T, V);
    let (bl, bt) = (g.up(&logits), g.up_u32(&targets));

    let bp_only = g.zeros(n * V);
    g.run("softmax_forward", &[&bl], &[&bp_only], {
        let (p, l) = (bp_only.whole(), bl.whole());
        move |ctx| gk::softmax_forward(ctx, &p, &l, B, T, V)
    })
    .unwrap();
    compare("softmax_forward", &g.down(&bp_only), &probs, 1e-7, 1e-4);

    let (bp, bloss, bmean) = (g.zeros(n * V), g.zeros(n), g.zeros(1));
    g.run(
        "softmax_crossentropy_forward",
        &[&bl, &bt],
        &[&bp, &bloss],
        {
            let v = [&bp, &bloss, &bl, &bt].map(|b| b.whole());
            // SAFETY: every target is < V (checked by `tokens`).
            move |ctx| unsafe {
                gk::softmax_crossentropy_forward(ctx, &v[0], &v[1], &v[2], &v[3], B, T, V)
            }
        },
    )
    .unwrap();
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

    g.run("mean_loss", &[&bloss], &[&bmean], {
        let (m, l) = (bmean.whole(), bloss.whole());
        move |ctx| gk::mean_loss(ctx, &m, &l)
    })
    .unwrap();
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
    cpu::crossentropy_softmax_backward(&mut dlogits, &probs, &targets, dloss, B, T, V);
    g.run("crossentropy_softmax_backward", &[&bp, &bt], &[&bd], {
        let v = [&bd, &bp, &bt].map(|b| b.whole());
        move |ctx| gk::crossentropy_softmax_backward(ctx, &v[0], &v[1], &v[2], dloss, B, T, V)
    })
    .unwrap();
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
    let Some(g) = Gpu::new("cuda_kernels::adamw_matches_cpu") else {
        return;
    };
    let n = 100_003;
    let (lr, b1, b2, eps, wd) = (1e-3f32, 0.9f32, 0.95f32, 1e-8f32, 0.1f32);
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
            cpu::adamw_update(&mut p, &grads, &mut m, &mut v, step, lr, b1, b2, eps, wd);
            g.run("adamw_update", &[&bg, &bs], &[&bp, &bm, &bv], {
                let views = [&bp, &bg, &bm, &bv, &bs].map(|b| b.whole());
                move |ctx| {
                    let [p, gr, m, v, s] = &views;
                    let s = grad_scale.map(|_| s);
                    gk::adamw_update(ctx, p, gr, m, v, s, step, lr, b1, b2, eps, wd)
                }
            })
            .unwrap();
        }
        let what = format!("adamw (grad_scale {grad_scale:?})");
        compare(&format!("{what} params"), &g.down(&bp), &p, 1e-6, 1e-5);
        compare(&format!("{what} m"), &g.down(&bm), &m, 1e-7, 1e-5);
        compare(&format!("{what} v"), &g.down(&bv), &v, 1e-9, 1e-5);
    }
}

#[test]
fn grad_norm_clip_and_scale_match_cpu() {
    let Some(g) = Gpu::new("cuda_kernels::grad_norm_clip_and_scale_match_cpu") else {
        return;
    };
    let n = 100_003;
    let grads = randn(n, 0.5, 70);
    let bg = g.up(&grads);
    let norm = g.rt.alloc("norm_sq", 8).unwrap();
    let partials = g.rt.alloc("partials", gk::GRAD_NORM_PARTIALS * 8).unwrap();
    g.run("grad_norm_sq", &[&bg], &[&norm, &partials], {
        let v = [&norm, &partials, &bg].map(|b| b.whole());
        move |ctx| gk::grad_norm_sq(ctx, &v[0], &v[1], &v[2])
    })
    .unwrap();
    let got: Vec<f64> = g.rt.read_vec(&norm).unwrap();
    let want = cpu::grad_norm_sq(&grads);
    eprintln!("    grad_norm_sq: gpu {} cpu {want}", got[0]);
    assert!(
        ((got[0] - want) / want).abs() <= 1e-12,
        "grad_norm_sq: gpu {} vs cpu {want}",
        got[0]
    );

    let scale = g.zeros(1);
    let max_norm = (want.sqrt() * 0.5) as f32;
    g.run("grad_clip_scale", &[&norm], &[&scale], {
        let (s, nm) = (scale.whole(), norm.whole());
        move |ctx| gk::grad_clip_scale(ctx, &s, &nm, max_norm)
    })
    .unwrap();
    let s = g.down(&scale)[0];
    compare(
        "grad_clip_scale",
        &[s],
        &[cpu::clip_scale(want.sqrt(), max_norm)],
        0.0,
        1e-6,
    );

    g.run("scale_in_place_dev", &[&scale], &[&bg], {
        let (x, s) = (bg.whole(), scale.whole());
        move |ctx| gk::scale_in_place_dev(ctx, &x, &s)
    })
    .unwrap();
    let mut want_scaled = grads.clone();
    cpu::scale_in_place(&mut want_scaled, s);
    compare("scale_in_place_dev", &g.down(&bg), &want_scaled, 0.0, 0.0);

    g.run("scale_in_place", &[], &[&bg], {
        let x = bg.whole();
        move |ctx| gk::scale_in_place(ctx, &x, 0.25)
    })
    .unwrap();
    cpu::scale_in_place(&mut want_scaled, 0.25);
    compare("scale_in_place", &g.down(&bg), &want_scaled, 0.0, 0.0);
}

/// On the GPU, a view the task did not declare (or declared read-only for an
/// output), overlapping outputs and misaligned views are errors before any
/// launch.
#[test]
fn misuse_is_an_error_not_a_launch() {
    let Some(g) = Gpu::new("cuda_kernels::misuse_is_an_error_not_a_launch") else {
        return;
    };
    let n = 1000;
    let (a, b, big) = (g.up(&randn(n, 1.0, 80)), g.zeros(n), g.zeros(2 * n + 1));
    let errors = Arc::new(Mutex::new(Vec::<Error>::new()));
    let sink = errors.clone();
    let (av, bv, bigv) = (a.whole(), b.whole(), big.whole());
    // `b` is declared read-only.
    g.run("misuse", &[&a, &b], &[&big], move |ctx| {
        let mut e = sink.lock().unwrap();
        let mut push = |r: braid::Result<()>| e.push(r.expect_err("must fail"));
        let half = |lo: usize| bigv.view_of::<f32>(lo..lo + n).unwrap();
        // 0: output declared read-only.
        push(gk::gelu_forward(ctx, &bv, &av));
        // 1: output overlapping the input.
        push(gk::gelu_forward(ctx, &half(0), &half(n / 2)));
        // 2: misaligned output (starts 2 bytes into the buffer).
        let odd = bigv.view(2..2 + 4 * n).unwrap();
        push(gk::gelu_forward(ctx, &odd, &av));
        Ok(())
    })
    .unwrap();
    // 3: a view of a buffer the task did not declare at all.
    let undeclared = g.run("undeclared", &[&a], &[], {
        let (av, bv) = (a.whole(), b.whole());
        move |ctx| gk::gelu_forward(ctx, &bv, &av)
    });
    let errors = errors.lock().unwrap();
    assert!(
        matches!(&errors[0], Error::Undeclared { mode: "write", .. }),
        "{:?}",
        errors[0]
    );
    assert!(errors[1].to_string().contains("overlap"), "{}", errors[1]);
    assert!(errors[2].to_string().contains("aligned"), "{}", errors[2]);
    let e = undeclared.expect_err("undeclared view must fail the task");
    assert!(e.to_string().contains("without declaring"), "{e}");
    // Nothing was launched into `b`.
    assert!(g.down(&b).iter().all(|&x| x == 0.0));
}

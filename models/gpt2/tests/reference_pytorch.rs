//! GPT-2 against PyTorch: forward (logits, loss), backward (every parameter
//! gradient) and five clipped AdamW steps, compared with
//! `tests/fixtures/gpt2_tiny_reference.safetensors`, which
//! `scripts/make_reference.py` makes with Hugging Face's `GPT2LMHeadModel`.
//!
//! * The sequential [`Reference`] (plain CPU kernels, one after another).
//! * The model as Braid tasks, one test body run on every backend present
//!   (`test_device!`: `…_cpu` and `…_cuda`; the CUDA test skips with a
//!   message without a GPU and fails instead under `BRAID_REQUIRE_GPU=1`), on
//!   1 and 4 streams under every placement policy for forward and backward,
//!   and on two stream/policy pairs for the AdamW steps.
//!
//! # Tolerances
//!
//! llm.c-style, `|ours - torch| <= atol + rtol·|torch|` elementwise; on
//! failure the message names the worst tensor and element. Run with
//! `--nocapture` to see the worst errors reached. The CPU (the reference, and
//! the engine, which is bit-identical to it) is held to the first column;
//! CUDA to the second, because its kernels reduce in `f32` trees where the
//! CPU accumulates in `f64`, and cuBLAS sums its products in its own order:
//!
//! | quantity                  | CPU atol | CPU rtol | CUDA atol | CUDA rtol |
//! |---------------------------|----------|----------|-----------|-----------|
//! | loss                      | 1e-5     | —        | 1e-4      | —         |
//! | logits                    | 1e-5     | 1e-4     | 1e-4      | 1e-3      |
//! | parameter gradients       | 1e-7     | 1e-4     | 1e-6      | 1e-3      |
//! | AdamW step losses         | 1e-4     | —        | 1e-4      | —         |
//! | pre-clip gradient norms   | —        | 1e-4     | —         | 1e-3      |
//! | final parameters          | 1e-6     | 1e-4     | 1e-5      | 1e-3      |
//!
//! Gradients here are at most ~1e-2, so the absolute floors are small; they
//! cover the elements whose true gradient is ~0 (the attention key bias),
//! which both sides only get as rounding noise. For the final parameters,
//! elements whose first gradient is below 1e-6 (CPU) or 1e-5 (CUDA) in
//! magnitude are held to `2·lr` per step instead: Adam divides by the
//! gradient's own magnitude, so where the gradient is noise the step is
//! noise.

#[macro_use]
mod common;

use braid::Policy;
use braid_gpt2::kernels::cpu as k;
use braid_gpt2::model::{Dtype, Fusion, Gpt2Model, ModelOptions, Sampler};
use braid_gpt2::optim::AdamW;
use braid_gpt2::reference::Reference;
use braid_gpt2::trainer::model_runtime;
use common::{check_all, compare, reference_steps, setup, split_by_gradient, Device, Worst};

// Tolerances of the CPU (see the module docs for the form).
const LOSS_ATOL: f32 = 1e-5;
const LOGITS_ATOL: f32 = 1e-5;
const LOGITS_RTOL: f32 = 1e-4;
/// Gradients are ~1e-2 at most here, so the absolute floor is small.
const GRAD_ATOL: f32 = 1e-7;
const GRAD_RTOL: f32 = 1e-4;
const STEP_LOSS_ATOL: f32 = 1e-4;
const PARAM_ATOL: f32 = 1e-6;
const PARAM_RTOL: f32 = 1e-4;
/// Below this initial |gradient| an element's Adam steps are rounding noise.
const ILL_CONDITIONED_GRAD: f32 = 1e-6;

#[test]
fn forward_matches_pytorch() {
    let (fx, _layout, params) = setup();
    let mut model = Reference::new(&fx.cfg, fx.b, fx.t).unwrap();
    let loss = model
        .forward(&params, &fx.tokens, Some(&fx.targets))
        .unwrap()
        .unwrap();
    let torch_loss = fx.tensor("loss")[0];
    eprintln!(
        "loss: ours {loss}, torch {torch_loss}, abs err {:.3e}",
        (loss - torch_loss).abs()
    );
    assert!(
        (loss - torch_loss).abs() <= LOSS_ATOL,
        "loss: ours {loss}, torch {torch_loss}"
    );
    let logits = compare(
        "logits",
        model.logits(),
        fx.tensor("logits"),
        LOGITS_ATOL,
        LOGITS_RTOL,
    );
    check_all("logits", &[logits]);
}

#[test]
fn backward_matches_pytorch() {
    let (fx, layout, params) = setup();
    let torch_grads = fx.flat(&layout, "grad.");
    let mut model = Reference::new(&fx.cfg, fx.b, fx.t).unwrap();
    model
        .forward(&params, &fx.tokens, Some(&fx.targets))
        .unwrap();
    let mut grads = vec![0.0; layout.total];
    model.backward(&params, &mut grads, 1.0).unwrap();
    let results: Vec<Worst> = layout
        .tensors
        .iter()
        .map(|t| {
            compare(
                &format!("grad.{}", t.name),
                &grads[t.range()],
                &torch_grads[t.range()],
                GRAD_ATOL,
                GRAD_RTOL,
            )
        })
        .collect();
    check_all("gradients", &results);
    // The gradients are not trivially small: the tolerance means something.
    let norm = k::grad_norm_sq(&grads).sqrt();
    assert!(norm > 0.1, "gradient norm {norm}");
}

#[test]
fn adamw_steps_match_pytorch() {
    let (fx, layout, mut params) = setup();
    let steps = fx.steps();
    let h = fx.adamw_hyper();
    let max_norm = fx.hparam("max_grad_norm");
    assert_eq!(fx.meta["weight_decay_applies_to"], "all parameters");
    let (losses, norms) = reference_steps(
        &fx.cfg,
        fx.b,
        fx.t,
        &mut params,
        &fx.tokens,
        &fx.targets,
        h,
        max_norm,
        steps,
    );
    eprintln!(
        "step losses ours  {losses:?}\nstep losses torch {:?}",
        fx.tensor("step_losses")
    );
    let mut results = vec![
        compare(
            "step_losses",
            &losses,
            fx.tensor("step_losses"),
            STEP_LOSS_ATOL,
            0.0,
        ),
        compare(
            "step_grad_norms",
            &norms,
            fx.tensor("step_grad_norms"),
            0.0,
            1e-4,
        ),
    ];
    // The parameters after the last step, for the tensors the fixture keeps.
    let mut finals = 0;
    let (mut compared, mut ill_conditioned) = (0, 0);
    for t in &layout.tensors {
        let name = format!("final.{}", t.name);
        if fx.f32s.contains_key(&name) {
            let mut ours = vec![0.0; t.len];
            t.copy_to_hf(&params, &mut ours).unwrap();
            let theirs = fx.tensor(&name);
            // Adam divides by the gradient's own magnitude, so where the true
            // gradient is near zero, rounding noise (both sides' gradients agree
            // only to ~1e-7 absolute) becomes steps of up to ~lr. The clearest
            // case is the attention key bias, whose gradient is mathematically
            // zero: it shifts a whole row of scores, which the softmax ignores.
            // Such elements are held only to the bound that noise can reach.
            let grad0 = fx.tensor(&format!("grad.{}", t.name));
            let (strict, noisy) = split_by_gradient(&ours, theirs, grad0, ILL_CONDITIONED_GRAD);
            results.push(compare(&name, &strict.0, &strict.1, PARAM_ATOL, PARAM_RTOL));
            if !noisy.0.is_empty() {
                let noise_bound = 2.0 * h.learning_rate * steps as f32;
                results.push(compare(
                    &format!("{name} (|grad| < {ILL_CONDITIONED_GRAD:e})"),
                    &noisy.0,
                    &noisy.1,
                    noise_bound,
                    0.0,
                ));
                ill_conditioned += noisy.0.len();
            }
            compared += t.len;
            finals += 1;
        }
    }
    assert!(
        finals >= 2 * fx.cfg.num_layers,
        "fixture keeps too few final parameters"
    );
    eprintln!("final parameters: {compared} compared, {ill_conditioned} of them ill-conditioned");
    assert!(
        ill_conditioned * 10 < compared,
        "too many ill-conditioned elements to mean much"
    );
    check_all("adamw", &results);
    assert!(
        losses[steps - 1] < losses[0] - 0.1,
        "training did not lower the loss"
    );
}

/// The comparison can fail: a relative perturbation of 1e-3 in one gradient
/// element, or a Conv1D weight loaded without its transposition, is caught.
#[test]
fn comparison_detects_small_errors() {
    let (fx, layout, params) = setup();
    let torch_grads = fx.flat(&layout, "grad.");
    let t = layout.get("transformer.h.1.mlp.c_fc.weight").unwrap();
    let mut perturbed = torch_grads[t.range()].to_vec();
    let i = perturbed
        .iter()
        .enumerate()
        .max_by(|a, b| a.1.abs().total_cmp(&b.1.abs()))
        .unwrap()
        .0;
    perturbed[i] *= 1.0 + 1e-3;
    let w = compare(
        "perturbed",
        &perturbed,
        &torch_grads[t.range()],
        GRAD_ATOL,
        GRAD_RTOL,
    );
    assert!(w.excess > 0.0 && w.index == i);

    // Load one Conv1D weight untransposed: the forward pass must disagree.
    let qkv = layout.get("transformer.h.0.attn.c_attn.weight").unwrap();
    let mut wrong = params.clone();
    wrong[qkv.range()].copy_from_slice(fx.tensor(&qkv.name));
    let mut model = Reference::new(&fx.cfg, fx.b, fx.t).unwrap();
    model
        .forward(&wrong, &fx.tokens, Some(&fx.targets))
        .unwrap();
    let w = compare(
        "logits",
        model.logits(),
        fx.tensor("logits"),
        LOGITS_ATOL,
        LOGITS_RTOL,
    );
    assert!(w.excess > 0.0);
}

// ----- the model as tasks, on every backend -------------------------------------

/// The tolerances of one backend (module docs).
#[derive(Debug, Clone, Copy)]
struct Tol {
    loss: f32,
    logits: (f32, f32),
    grads: (f32, f32),
    step_loss: f32,
    norm_rtol: f32,
    params: (f32, f32),
    ill_conditioned_grad: f32,
}

impl Tol {
    fn of(dev: Device) -> Tol {
        match dev {
            Device::Cpu => Tol {
                loss: LOSS_ATOL,
                logits: (LOGITS_ATOL, LOGITS_RTOL),
                grads: (GRAD_ATOL, GRAD_RTOL),
                step_loss: STEP_LOSS_ATOL,
                norm_rtol: 1e-4,
                params: (PARAM_ATOL, PARAM_RTOL),
                ill_conditioned_grad: ILL_CONDITIONED_GRAD,
            },
            Device::Cuda => Tol {
                loss: 1e-4,
                logits: (1e-4, 1e-3),
                grads: (1e-6, 1e-3),
                step_loss: 1e-4,
                norm_rtol: 1e-3,
                params: (1e-5, 1e-3),
                ill_conditioned_grad: 1e-5,
            },
        }
    }
}

fn runtime(dev: Device, streams: usize, policy: Policy) -> braid::Runtime {
    model_runtime(dev.backend(), streams, policy, 0)
        .unwrap_or_else(|e| panic!("a {dev:?} runtime with {streams} streams, {policy}: {e}"))
}

/// Forward and backward as tasks against PyTorch, on 1 and 4 streams under
/// every placement policy.
fn engine_forward_backward_match_pytorch(dev: Device) {
    forward_backward_match_pytorch(dev, ModelOptions::default());
}

/// The same with the fused attention, classifier and residual + layer
/// norm, at the same tolerances.
fn engine_fused_forward_backward_match_pytorch(dev: Device) {
    forward_backward_match_pytorch(
        dev,
        ModelOptions {
            fusion: Fusion::ALL,
            ..ModelOptions::default()
        },
    );
}

test_device!(
    engine_fused_forward_backward_match_pytorch,
    engine_fused_forward_backward_match_pytorch_cpu,
    engine_fused_forward_backward_match_pytorch_cuda
);

fn forward_backward_match_pytorch(dev: Device, opts: ModelOptions) {
    let tol = Tol::of(dev);
    let (fx, layout, params) = setup();
    let torch_grads = fx.flat(&layout, "grad.");
    let torch_loss = fx.tensor("loss")[0];
    let mut first: Option<(String, Vec<f32>)> = None;
    for streams in [1, 4] {
        for policy in Policy::ALL {
            let what = format!("{dev:?}, {streams} stream(s), {policy}, {opts:?}");
            let rt = runtime(dev, streams, policy);
            let mut model = Gpt2Model::with_options(&rt, &fx.cfg, fx.b, fx.t, opts).unwrap();
            model.upload_params(&rt, &params).unwrap();
            model.zero_grad(&rt).unwrap();
            model.forward(&rt, &fx.tokens, Some(&fx.targets)).unwrap();
            // The fused backward pass writes the logits' gradient over them.
            let early_logits = opts
                .fusion
                .classifier
                .then(|| model.read_logits(&rt).unwrap());
            let mut ready = Vec::new();
            model
                .backward(&rt, 1.0, |p| {
                    ready.push(p);
                    Ok(())
                })
                .unwrap();
            let loss = model.read_loss(&rt).unwrap();
            let logits = early_logits.unwrap_or_else(|| model.read_logits(&rt).unwrap());
            let grads = model.read_grads(&rt).unwrap();
            rt.synchronize().unwrap();
            eprintln!(
                "{what}: loss ours {loss} torch {torch_loss} (abs err {:.3e})",
                (loss - torch_loss).abs()
            );
            assert!(
                (loss - torch_loss).abs() <= tol.loss,
                "{what}: loss: ours {loss}, torch {torch_loss}"
            );
            check_all(
                &format!("{what}: logits"),
                &[compare(
                    "logits",
                    &logits,
                    fx.tensor("logits"),
                    tol.logits.0,
                    tol.logits.1,
                )],
            );
            let results: Vec<Worst> = layout
                .tensors
                .iter()
                .map(|t| {
                    compare(
                        &format!("grad.{}", t.name),
                        &grads[t.range()],
                        &torch_grads[t.range()],
                        tol.grads.0,
                        tol.grads.1,
                    )
                })
                .collect();
            check_all(&format!("{what}: gradients"), &results);
            // Every parameter announced once.
            let mut sorted = ready.clone();
            sorted.sort_unstable();
            assert_eq!(sorted, (0..layout.tensors.len()).collect::<Vec<_>>());
            // Informational: the CPU is bit-identical everywhere (asserted
            // in tests/engine_model.rs); GPU kernels are deterministic for a
            // shape, but cuBLAS gives no bitwise promise across handles.
            match &first {
                None => first = Some((what.clone(), grads)),
                Some((w0, g0)) => {
                    let same = g0
                        .iter()
                        .zip(&grads)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    eprintln!(
                        "{what}: gradients {} those of {w0}",
                        if same {
                            "bit-identical to"
                        } else {
                            "differ in the last bits from"
                        }
                    );
                }
            }
        }
    }
}

test_device!(
    engine_forward_backward_match_pytorch,
    engine_forward_backward_match_pytorch_cpu,
    engine_forward_backward_match_pytorch_cuda
);

/// Five clipped AdamW steps as tasks (zero, forward, backward, optimizer)
/// against PyTorch.
fn engine_adamw_steps_match_pytorch(dev: Device) {
    steps_match_pytorch(dev, ModelOptions::default());
}

/// The same with the fused attention, classifier and residual + layer
/// norm, at the same tolerances.
fn engine_fused_adamw_steps_match_pytorch(dev: Device) {
    steps_match_pytorch(
        dev,
        ModelOptions {
            fusion: Fusion::ALL,
            ..ModelOptions::default()
        },
    );
}

test_device!(
    engine_fused_adamw_steps_match_pytorch,
    engine_fused_adamw_steps_match_pytorch_cpu,
    engine_fused_adamw_steps_match_pytorch_cuda
);

fn steps_match_pytorch(dev: Device, opts: ModelOptions) {
    let tol = Tol::of(dev);
    let (fx, layout, params) = setup();
    let steps = fx.steps();
    let h = fx.adamw_hyper();
    assert_eq!(fx.meta["weight_decay_applies_to"], "all parameters");
    let max_norm = fx.hparam("max_grad_norm");

    for (streams, policy) in [(2, Policy::Affinity), (4, Policy::RoundRobin)] {
        let what = format!("{dev:?}, {streams} streams, {policy}, {opts:?}");
        let rt = runtime(dev, streams, policy);
        let mut model = Gpt2Model::with_options(&rt, &fx.cfg, fx.b, fx.t, opts).unwrap();
        model.upload_params(&rt, &params).unwrap();
        let mut opt = AdamW::for_model(&rt, &model, h, Some(max_norm)).unwrap();
        let (mut losses, mut norms) = (Vec::new(), Vec::new());
        for _ in 0..steps {
            model.zero_grad(&rt).unwrap();
            model.forward(&rt, &fx.tokens, Some(&fx.targets)).unwrap();
            model.backward(&rt, 1.0, |_| Ok(())).unwrap();
            opt.step(&rt, model.params(), model.grads().unwrap())
                .unwrap();
            losses.push(model.read_loss(&rt).unwrap());
            norms.push(opt.read_grad_norm(&rt).unwrap());
        }
        let final_params = model.read_params(&rt).unwrap();
        rt.synchronize().unwrap();
        eprintln!(
            "{what}: step losses ours  {losses:?}\n{what}: step losses torch {:?}",
            fx.tensor("step_losses")
        );
        let mut results = vec![
            compare(
                "step_losses",
                &losses,
                fx.tensor("step_losses"),
                tol.step_loss,
                0.0,
            ),
            compare(
                "step_grad_norms",
                &norms,
                fx.tensor("step_grad_norms"),
                0.0,
                tol.norm_rtol,
            ),
        ];
        let mut compared = 0;
        for t in &layout.tensors {
            let name = format!("final.{}", t.name);
            let Some(theirs) = fx.try_tensor(&name) else {
                continue;
            };
            let mut ours = vec![0.0; t.len];
            t.copy_to_hf(&final_params, &mut ours).unwrap();
            let grad0 = fx.tensor(&format!("grad.{}", t.name));
            let (strict, noisy) = split_by_gradient(&ours, theirs, grad0, tol.ill_conditioned_grad);
            if !strict.0.is_empty() {
                results.push(compare(
                    &name,
                    &strict.0,
                    &strict.1,
                    tol.params.0,
                    tol.params.1,
                ));
            }
            if !noisy.0.is_empty() {
                results.push(compare(
                    &format!("{name} (|grad| < {:e})", tol.ill_conditioned_grad),
                    &noisy.0,
                    &noisy.1,
                    2.0 * h.learning_rate * steps as f32,
                    0.0,
                ));
            }
            compared += t.len;
        }
        assert!(compared > 1000, "compared {compared} final parameters");
        check_all(&format!("{what}: adamw"), &results);
        assert!(
            losses[steps - 1] < losses[0] - 0.1,
            "{what}: training did not lower the loss: {losses:?}"
        );
    }
}

test_device!(
    engine_adamw_steps_match_pytorch,
    engine_adamw_steps_match_pytorch_cpu,
    engine_adamw_steps_match_pytorch_cuda
);

/// The decode fixture (`make_reference.py`, "The decode fixture"): the
/// prompt, Hugging Face's greedy tokens, and the logits each was chosen
/// from, `(n, V)`.
fn decode_fixture() -> (Vec<u32>, Vec<u32>, Vec<f32>) {
    let bytes = std::fs::read(common::FIXTURE_DECODE).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (make_reference.py --only decode)",
            common::FIXTURE_DECODE
        )
    });
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let words = |name: &str| -> Vec<[u8; 4]> {
        let t = st.tensor(name).unwrap();
        t.data()
            .chunks_exact(4)
            .map(|w| [w[0], w[1], w[2], w[3]])
            .collect()
    };
    let ids = |name: &str| -> Vec<u32> {
        words(name)
            .into_iter()
            .map(|w| i32::from_le_bytes(w) as u32)
            .collect()
    };
    let logits = words("logits")
        .into_iter()
        .map(f32::from_le_bytes)
        .collect();
    (ids("prompt"), ids("tokens"), logits)
}

/// The sampler's greedy continuation is Hugging Face's, token for token,
/// with and without the KV cache, over the positions the cache serves and
/// then with the window sliding (the fixture's 5-token prompt and 80
/// tokens, context 64; its script checks that a window one short or one
/// that never slides draws other tokens); and a model made for inference
/// has the logits PyTorch chose from at every step, to the forward pass's
/// tolerances: each position the cache serves decoded one at a time, then
/// each sliding window's last row.
fn greedy_decoding_matches_pytorch(dev: Device) {
    let (fx, layout, mut params) = setup();
    // The decode fixture's weights: every 2-D weight times 8 (exact).
    for t in layout.tensors.iter().filter(|t| t.hf_shape().len() == 2) {
        params[t.range()].iter_mut().for_each(|x| *x *= 8.0);
    }
    let (prompt, want, logits) = decode_fixture();
    let v = fx.cfg.vocab_size;
    assert_eq!(logits.len(), want.len() * v);
    let rt = runtime(dev, 2, Policy::Affinity);
    let t = fx.cfg.max_seq_len;
    assert!(prompt.len() + want.len() > t, "the fixture's window slides");
    for kv_cache in [true, false] {
        let s = Sampler::new(&rt, &fx.cfg, &params, t, 0.0, 1, Dtype::F32).unwrap();
        let mut s = s.with_kv_cache(kv_cache);
        let got = s.generate(&rt, &prompt, want.len(), |_| Ok(())).unwrap();
        assert_eq!(got, want, "{dev:?}, KV cache {kv_cache}");
    }
    let tol = Tol::of(dev);
    let opts = ModelOptions {
        inference: true,
        ..ModelOptions::default()
    };
    let mut m = Gpt2Model::with_options(&rt, &fx.cfg, 1, t, opts).unwrap();
    m.upload_params(&rt, &params).unwrap();
    let mut padded = prompt.clone();
    padded.resize(t, 0);
    m.forward(&rt, &padded, None).unwrap();
    let mut worst = Vec::new();
    let last = prompt.len() - 1;
    let seq: Vec<u32> = prompt.iter().chain(&want).copied().collect();
    let (atol, rtol) = tol.logits;
    for (i, row) in logits.chunks_exact(v).enumerate() {
        let pos = last + i;
        let ours = if pos < t {
            if i > 0 {
                m.forward_position(&rt, pos, want[i - 1]).unwrap();
            }
            m.read_logits_row(&rt, pos).unwrap()
        } else {
            // The window of the last `t` tokens.
            m.forward(&rt, &seq[pos + 1 - t..=pos], None).unwrap();
            m.read_logits_row(&rt, t - 1).unwrap()
        };
        worst.push(compare(
            &format!("logits of step {i}"),
            &ours,
            row,
            atol,
            rtol,
        ));
    }
    assert_eq!(worst.len(), want.len());
    check_all(&format!("{dev:?} decoded logits"), &worst);
}

test_device!(
    greedy_decoding_matches_pytorch,
    greedy_decoding_matches_pytorch_cpu,
    greedy_decoding_matches_pytorch_cuda
);

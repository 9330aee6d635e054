//! The bf16 model (`ModelOptions { dtype: Dtype::Bf16 }`, CPU) against
//! PyTorch in bf16 mixed precision: forward (logits, loss), backward (every
//! parameter gradient) and five clipped AdamW steps on `f32` master weights,
//! compared with `tests/fixtures/gpt2_tiny_reference_bf16.safetensors`
//! (`scripts/make_reference.py`, "The bf16 fixture": the Hugging Face model
//! converted to bf16, `f32` master weights, the loss in `f32`).
//!
//! # Tolerances
//!
//! `|ours - torch| <= atol + rtol·|torch|` elementwise, as in
//! `reference_pytorch.rs`. Both sides store every tensor in bf16 (8
//! significant bits: one rounding moves a value by up to 2^-9 ≈ 2e-3 of
//! itself, one bf16 step is 2^-8 of it) and compute in `f32`, but they do not
//! round at exactly the same places: PyTorch rounds the attention scores
//! before scaling them, and the probabilities before the weighted sum (braid
//! after), rounds the logits' gradient once where braid rounds the
//! probabilities first, and sums products in another order. So a value near
//! a rounding boundary lands one bf16 step apart, and such differences
//! compound through the layers: the two bf16 models differ by about as much
//! as bf16 differs from `f32` (which is why the tolerances are bf16 steps,
//! against 1e-4 relative for `f32`, and why the check that the bf16 model is
//! bf16-like is a correlation, `bf16_deviates_from_f32_as_pytorch_bf16_does`).
//!
//! | quantity                  | atol                      | rtol  | observed (max abs) |
//! |---------------------------|---------------------------|-------|--------------------|
//! | loss                      | 2e-3                      | —     | 1.6e-5             |
//! | logits                    | 4e-3                      | 3e-2  | 3.9e-3 (one bf16 step at 0.5..1) |
//! | parameter gradients       | 4% of the tensor's largest | 6e-2 | 9.8e-4             |
//! | AdamW step losses         | 4e-3                      | —     | 9.8e-4             |
//! | pre-clip gradient norms   | —                         | 1e-2  |                    |
//! | final master weights      | `2·lr` per step           | —     | 6.4e-3 (bound 1e-2) |
//!
//! A gradient's absolute floor is a share of the largest magnitude in its
//! tensor: a gradient element is a sum of many products, and a sum that
//! cancels to near zero keeps the absolute error of its terms (a bf16 step of
//! the largest of them), not a relative one. The final master weights are
//! held elementwise only to what Adam can reach when the gradients disagree
//! (it divides by the gradient's own size: a noisy gradient gives a full
//! step in a noisy direction), and as a whole to an RMS difference below 15%
//! of the RMS of the update the five steps made (observed: 6%): no update,
//! or twice the update, is 100% off.

#[macro_use]
mod common;

use braid::comm::Bf16;
use braid::Policy;
use braid_gpt2::checkpoint::AdamWHyper;
use braid_gpt2::config::Gpt2Config;
use braid_gpt2::layout::ParamLayout;
use braid_gpt2::model::{Dtype, Fusion, Gpt2Model, ModelOptions};
use braid_gpt2::optim::AdamW;
use braid_gpt2::trainer::model_runtime;
use common::{check_all, compare, setup_from, Device, Fixture, Worst, FIXTURE_BF16};

const LOSS_ATOL: f32 = 2e-3;
const LOGITS_ATOL: f32 = 4e-3;
const LOGITS_RTOL: f32 = 3e-2;
/// Absolute floor of a gradient tensor, as a share of its largest element.
const GRAD_ATOL_SHARE: f32 = 4e-2;
const GRAD_RTOL: f32 = 6e-2;
const STEP_LOSS_ATOL: f32 = 4e-3;
const NORM_RTOL: f32 = 1e-2;
/// The RMS difference of the final master weights, as a share of the RMS of
/// the update the steps made (observed: 0.06).
const UPDATE_RMS: f64 = 0.15;

const BF16: ModelOptions = ModelOptions {
    fusion: Fusion::NONE,
    dtype: Dtype::Bf16,
    padded_classifier: None,
    inference: false,
};
/// The fused attention and classifier in bf16, held to the same tolerances.
const BF16_FUSED: ModelOptions = ModelOptions {
    fusion: Fusion::ALL,
    dtype: Dtype::Bf16,
    padded_classifier: None,
    inference: false,
};

fn runtime(dev: Device, streams: usize, policy: Policy) -> braid::Runtime {
    model_runtime(dev.backend(), streams, policy, 0)
        .unwrap_or_else(|e| panic!("a {dev:?} runtime with {streams} streams, {policy}: {e}"))
}

/// Forward and backward of `opts` on the fixture's batch: loss, logits,
/// gradients (as `f32`).
fn forward_backward(
    dev: Device,
    fx: &Fixture,
    params: &[f32],
    opts: ModelOptions,
    streams: usize,
    policy: Policy,
) -> (f32, Vec<f32>, Vec<f32>) {
    let rt = runtime(dev, streams, policy);
    let mut model = Gpt2Model::with_options(&rt, &fx.cfg, fx.b, fx.t, opts).unwrap();
    model.upload_params(&rt, params).unwrap();
    model.zero_grad(&rt).unwrap();
    model.forward(&rt, &fx.tokens, Some(&fx.targets)).unwrap();
    let logits = model.read_logits(&rt).unwrap();
    model.backward(&rt, 1.0, |_| Ok(())).unwrap();
    let grads = model.read_grads(&rt).unwrap();
    let loss = model.read_loss(&rt).unwrap();
    rt.synchronize().unwrap();
    (loss, logits, grads)
}

fn grad_results(layout: &ParamLayout, ours: &[f32], theirs: &[f32]) -> Vec<Worst> {
    layout
        .tensors
        .iter()
        .map(|t| {
            let theirs = &theirs[t.range()];
            let largest = theirs.iter().fold(0.0f32, |m, x| m.max(x.abs()));
            compare(
                &format!("grad.{}", t.name),
                &ours[t.range()],
                theirs,
                GRAD_ATOL_SHARE * largest,
                GRAD_RTOL,
            )
        })
        .collect()
}

/// On every device, unfused and fused, at the same tolerances: the CUDA
/// kernels round where the CPU's do, and bf16's own rounding dwarfs the
/// difference in summation order.
fn bf16_forward_backward_match_pytorch_bf16(dev: Device) {
    let (fx, layout, params) = setup_from(FIXTURE_BF16);
    assert_eq!(fx.cfg, Gpt2Config::tiny());
    let torch_grads = fx.flat(&layout, "grad.");
    for opts in [BF16, BF16_FUSED] {
        forward_backward_match(dev, &fx, &layout, &params, &torch_grads, opts);
    }
}

test_device!(
    bf16_forward_backward_match_pytorch_bf16,
    bf16_forward_backward_match_pytorch_bf16_cpu,
    bf16_forward_backward_match_pytorch_bf16_cuda
);

fn forward_backward_match(
    dev: Device,
    fx: &Fixture,
    layout: &ParamLayout,
    params: &[f32],
    torch_grads: &[f32],
    opts: ModelOptions,
) {
    let mut first: Option<(f32, Vec<f32>, Vec<f32>)> = None;
    for (streams, policy) in [(1, Policy::Single), (4, Policy::RoundRobin)] {
        let what = format!("{dev:?}, {opts:?}, {streams} streams, {policy}");
        let (loss, logits, grads) = forward_backward(dev, fx, params, opts, streams, policy);
        let torch_loss = fx.tensor("loss")[0];
        eprintln!(
            "{what}: loss ours {loss}, torch {torch_loss}, abs err {:.3e}",
            (loss - torch_loss).abs()
        );
        assert!(
            (loss - torch_loss).abs() <= LOSS_ATOL,
            "{what}: loss ours {loss}, torch {torch_loss}"
        );
        let l = compare(
            "logits",
            &logits,
            fx.tensor("logits"),
            LOGITS_ATOL,
            LOGITS_RTOL,
        );
        check_all(&format!("{what}: logits"), &[l]);
        check_all(
            &format!("{what}: gradients"),
            &grad_results(layout, &grads, torch_grads),
        );
        // Every logit and gradient is a bf16 value.
        for x in logits.iter().chain(&grads) {
            assert_eq!(x.to_bits() & 0xffff, 0, "{what}: {x} is not a bf16 value");
        }
        // Sequential consistency holds in bf16 too: the same bits on any
        // streams and policy.
        match &first {
            None => first = Some((loss, logits, grads)),
            Some((l0, lg0, g0)) => {
                assert_eq!(loss.to_bits(), l0.to_bits(), "{what}: loss");
                assert!(logits == *lg0 && grads == *g0, "{what}: not bit-identical");
            }
        }
    }
}

/// The bf16 model deviates from `f32` the way PyTorch's bf16 model does:
/// the deviations of its logits and gradients from the `f32` fixture point
/// the same way as those of the bf16 fixture (cosine similarity), because
/// both round the same weights and round activations at the same places. An
/// `f32` model, or a bf16 model that rounded elsewhere, would not.
#[test]
fn bf16_deviates_from_f32_as_pytorch_bf16_does() {
    let (fx, layout, params) = setup_from(FIXTURE_BF16);
    let (fx32, _, params32) = common::setup();
    assert_eq!(params, params32, "the fixtures start from the same weights");
    let cosine = |ours: &[f32], torch: &[f32], base: &[f32]| {
        let (mut dot, mut a2, mut b2) = (0.0f64, 0.0f64, 0.0f64);
        for ((&o, &t), &b) in ours.iter().zip(torch).zip(base) {
            let (a, b) = ((o - b) as f64, (t - b) as f64);
            (dot, a2, b2) = (dot + a * b, a2 + a * a, b2 + b * b);
        }
        dot / (a2.sqrt() * b2.sqrt())
    };
    let (_, logits, grads) = forward_backward(Device::Cpu, &fx, &params, BF16, 2, Policy::Affinity);
    let cl = cosine(&logits, fx.tensor("logits"), fx32.tensor("logits"));
    let cg = cosine(
        &grads,
        &fx.flat(&layout, "grad."),
        &fx32.flat(&layout, "grad."),
    );
    eprintln!("cosine of the deviations from f32: logits {cl:.3}, gradients {cg:.3}");
    assert!(cl > 0.5, "logits: cosine {cl}");
    assert!(cg > 0.5, "gradients: cosine {cg}");
    // The f32 model's deviations from the f32 fixture are unrelated.
    let (_, l32, g32) = forward_backward(
        Device::Cpu,
        &fx,
        &params,
        ModelOptions::default(),
        2,
        Policy::Affinity,
    );
    let c32 = cosine(&l32, fx.tensor("logits"), fx32.tensor("logits"));
    let g32c = cosine(
        &g32,
        &fx.flat(&layout, "grad."),
        &fx32.flat(&layout, "grad."),
    );
    eprintln!("the same for the f32 model: logits {c32:.3}, gradients {g32c:.3}");
    assert!(c32.abs() < 0.3 && g32c.abs() < 0.3, "f32: {c32}, {g32c}");
}

fn bf16_adamw_steps_match_pytorch_bf16(dev: Device) {
    let (fx, layout, params) = setup_from(FIXTURE_BF16);
    let steps = fx.steps();
    let h: AdamWHyper = fx.adamw_hyper();
    assert_eq!(fx.meta["weight_decay_applies_to"], "all parameters");
    let max_norm = fx.hparam("max_grad_norm");
    for (streams, policy) in [(2, Policy::Affinity), (4, Policy::RoundRobin)] {
        let what = format!("{dev:?}, bf16, {streams} streams, {policy}");
        let rt = runtime(dev, streams, policy);
        let mut model = Gpt2Model::with_options(&rt, &fx.cfg, fx.b, fx.t, BF16).unwrap();
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
        let master = model.read_params(&rt).unwrap();
        let stored = model.read_stored_params(&rt).unwrap();
        rt.synchronize().unwrap();
        eprintln!(
            "{what}: step losses ours  {losses:?}\n{what}: step losses torch {:?}",
            fx.tensor("step_losses")
        );
        // The stored weights are the master weights rounded.
        for (&s, &m) in stored.iter().zip(&master) {
            assert_eq!(s, Bf16::from_f32(m).to_f32(), "{what}: stored weight");
        }
        let bound = 2.0 * h.learning_rate * steps as f32;
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
                NORM_RTOL,
            ),
        ];
        // Final master weights: each within `2·lr` per step, and the updates
        // (final - initial) the same to UPDATE_RMS in the RMS.
        let (mut diff2, mut update2, mut compared) = (0.0f64, 0.0f64, 0);
        for t in &layout.tensors {
            let name = format!("final.{}", t.name);
            let Some(theirs) = fx.try_tensor(&name) else {
                continue;
            };
            let mut ours = vec![0.0; t.len];
            t.copy_to_hf(&master, &mut ours).unwrap();
            results.push(compare(&name, &ours, theirs, bound, 0.0));
            for ((&o, &th), &init) in ours.iter().zip(theirs).zip(fx.tensor(&t.name)) {
                diff2 += ((o - th) as f64).powi(2);
                update2 += ((th - init) as f64).powi(2);
            }
            compared += t.len;
        }
        assert!(compared > 1000, "compared {compared} final parameters");
        check_all(&format!("{what}: adamw"), &results);
        let ratio = (diff2 / update2).sqrt();
        eprintln!(
            "{what}: RMS of (ours - torch) / RMS of torch's update, final weights: {ratio:.3}"
        );
        assert!(
            ratio < UPDATE_RMS,
            "{what}: final weights: RMS ratio {ratio}"
        );
    }
}

test_device!(
    bf16_adamw_steps_match_pytorch_bf16,
    bf16_adamw_steps_match_pytorch_bf16_cpu,
    bf16_adamw_steps_match_pytorch_bf16_cuda
);

//! The sequential reference model against PyTorch: forward (logits, loss),
//! backward (every parameter gradient) and five clipped AdamW steps, compared
//! with `tests/fixtures/gpt2_tiny_reference.safetensors`, which
//! `scripts/make_reference.py` makes with Hugging Face's `GPT2LMHeadModel`.
//!
//! Tolerances are llm.c-style, `|ours - torch| <= atol + rtol·|torch|`
//! elementwise; on failure the message names the worst tensor and element.
//! Run with `--nocapture` to see the worst errors reached.

mod common;

use braid_gpt2::kernels::cpu as k;
use braid_gpt2::reference::Reference;
use common::{check_all, compare, setup, split_by_gradient, Worst};

// Tolerances (see the module docs for the form).
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
    let mut model = Reference::new(&fx.cfg, fx.b, fx.t).unwrap();
    let mut grads = vec![0.0; layout.total];
    let (mut m, mut v) = (vec![0.0; layout.total], vec![0.0; layout.total]);
    let (mut losses, mut norms) = (Vec::new(), Vec::new());
    for step in 1..=steps {
        grads.fill(0.0);
        let loss = model
            .forward(&params, &fx.tokens, Some(&fx.targets))
            .unwrap()
            .unwrap();
        model.backward(&params, &mut grads, 1.0).unwrap();
        let norm = k::grad_norm_sq(&grads).sqrt();
        k::scale_in_place(&mut grads, k::clip_scale(norm, max_norm));
        k::adamw_update(
            &mut params,
            &grads,
            &mut m,
            &mut v,
            step as u64,
            h.learning_rate,
            h.beta1,
            h.beta2,
            h.eps,
            h.weight_decay,
        );
        losses.push(loss);
        norms.push(norm as f32);
    }
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

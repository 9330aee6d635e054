//! The sequential reference model against PyTorch: forward (logits, loss),
//! backward (every parameter gradient) and five clipped AdamW steps, compared
//! with `tests/fixtures/gpt2_tiny_reference.safetensors`, which
//! `scripts/make_reference.py` makes with Hugging Face's `GPT2LMHeadModel`.
//!
//! Tolerances are llm.c-style, `|ours - torch| <= atol + rtol·|torch|`
//! elementwise; on failure the message names the worst tensor and element.
//! Run with `--nocapture` to see the worst errors reached.

use std::collections::HashMap;

use braid_gpt2::config::Gpt2Config;
use braid_gpt2::kernels::cpu as k;
use braid_gpt2::layout::ParamLayout;
use braid_gpt2::reference::Reference;
use safetensors::{Dtype, SafeTensors};

const FIXTURE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/gpt2_tiny_reference.safetensors"
);

/// The fixture, decoded.
struct Fixture {
    cfg: Gpt2Config,
    b: usize,
    t: usize,
    meta: HashMap<String, String>,
    f32s: HashMap<String, (Vec<usize>, Vec<f32>)>,
    tokens: Vec<u32>,
    targets: Vec<u32>,
}

impl Fixture {
    fn load() -> Self {
        let bytes = std::fs::read(FIXTURE).unwrap_or_else(|e| {
            panic!("{FIXTURE}: {e} (regenerate with models/gpt2/scripts/make_reference.py)")
        });
        let (_, header) = SafeTensors::read_metadata(&bytes).expect("safetensors header");
        let meta = header.metadata().clone().expect("fixture metadata");
        let st = SafeTensors::deserialize(&bytes).expect("safetensors file");
        let mut f32s = HashMap::new();
        let mut ints = HashMap::new();
        for (name, view) in st.tensors() {
            let words = view
                .data()
                .chunks_exact(4)
                .map(|w| [w[0], w[1], w[2], w[3]]);
            match view.dtype() {
                Dtype::F32 => {
                    let data = words.map(f32::from_le_bytes).collect();
                    f32s.insert(name, (view.shape().to_vec(), data));
                }
                Dtype::I32 => {
                    let data: Vec<u32> = words
                        .map(|w| u32::try_from(i32::from_le_bytes(w)).expect("negative token"))
                        .collect();
                    ints.insert(name, data);
                }
                other => panic!("{name}: unexpected dtype {other:?}"),
            }
        }
        let cfg: serde_json::Value = serde_json::from_str(&meta["config"]).expect("config json");
        let get = |k: &str| cfg[k].as_u64().unwrap_or_else(|| panic!("config.{k}")) as usize;
        let cfg = Gpt2Config {
            max_seq_len: get("max_seq_len"),
            vocab_size: get("vocab_size"),
            num_layers: get("num_layers"),
            num_heads: get("num_heads"),
            channels: get("channels"),
        };
        let b = meta["batch_size"].parse().unwrap();
        let t = meta["seq_len"].parse().unwrap();
        Self {
            cfg,
            b,
            t,
            f32s,
            tokens: ints.remove("tokens").expect("tokens"),
            targets: ints.remove("targets").expect("targets"),
            meta,
        }
    }

    fn tensor(&self, name: &str) -> &[f32] {
        &self
            .f32s
            .get(name)
            .unwrap_or_else(|| panic!("fixture lacks `{name}`"))
            .1
    }

    fn hparam(&self, name: &str) -> f32 {
        self.meta[name]
            .parse()
            .unwrap_or_else(|e| panic!("metadata {name}: {e}"))
    }

    /// Gathers `prefix + hf name` tensors into the flat layout, transposing
    /// Conv1D weights; checks every shape against the layout.
    fn flat(&self, layout: &ParamLayout, prefix: &str) -> Vec<f32> {
        let mut flat = vec![f32::NAN; layout.total];
        for t in &layout.tensors {
            let name = format!("{prefix}{}", t.name);
            let (shape, data) = self
                .f32s
                .get(&name)
                .unwrap_or_else(|| panic!("fixture lacks `{name}`"));
            assert_eq!(shape, &t.hf_shape(), "{name}: shape");
            t.copy_from_hf(data, &mut flat).unwrap();
        }
        assert!(flat.iter().all(|x| x.is_finite()));
        flat
    }
}

/// The worst element of a comparison.
#[derive(Debug, Clone)]
struct Worst {
    what: String,
    index: usize,
    ours: f32,
    theirs: f32,
    /// `|ours - theirs| - (atol + rtol·|theirs|)`: positive means a failure.
    excess: f32,
    max_abs_err: f32,
    max_rel_err: f32,
}

/// Compares elementwise; returns the worst element (by excess over the tolerance).
fn compare(what: &str, ours: &[f32], theirs: &[f32], atol: f32, rtol: f32) -> Worst {
    assert_eq!(ours.len(), theirs.len(), "{what}: lengths");
    let mut worst = Worst {
        what: what.to_owned(),
        index: 0,
        ours: ours[0],
        theirs: theirs[0],
        excess: f32::NEG_INFINITY,
        max_abs_err: 0.0,
        max_rel_err: 0.0,
    };
    for (i, (&a, &b)) in ours.iter().zip(theirs).enumerate() {
        let err = (a - b).abs();
        // NaN compares false everywhere: make it an infinite excess instead.
        let excess = if err.is_nan() {
            f32::INFINITY
        } else {
            err - (atol + rtol * b.abs())
        };
        worst.max_abs_err = worst.max_abs_err.max(err);
        if b.abs() > 1e-6 {
            worst.max_rel_err = worst.max_rel_err.max(err / b.abs());
        }
        if excess > worst.excess {
            (worst.index, worst.ours, worst.theirs, worst.excess) = (i, a, b, excess);
        }
    }
    worst
}

/// Panics with the worst tensor if any comparison failed; prints a summary.
fn check_all(kind: &str, results: &[Worst]) {
    let worst = results
        .iter()
        .max_by(|a, b| a.excess.total_cmp(&b.excess))
        .expect("nothing compared");
    let max_abs = results.iter().map(|w| w.max_abs_err).fold(0.0, f32::max);
    let max_rel_tensor = results
        .iter()
        .max_by(|a, b| a.max_rel_err.total_cmp(&b.max_rel_err))
        .unwrap();
    eprintln!(
        "{kind}: {} tensors; max abs err {max_abs:.3e}; max rel err {:.3e} (in {}); \
         closest to tolerance: {}[{}] ours {} torch {} (excess {:.3e})",
        results.len(),
        max_rel_tensor.max_rel_err,
        max_rel_tensor.what,
        worst.what,
        worst.index,
        worst.ours,
        worst.theirs,
        worst.excess
    );
    assert!(
        worst.excess <= 0.0,
        "{kind}: {}[{}] differs from PyTorch: ours {}, torch {} (beyond tolerance by {})",
        worst.what,
        worst.index,
        worst.ours,
        worst.theirs,
        worst.excess
    );
}

fn setup() -> (Fixture, ParamLayout, Vec<f32>) {
    let fx = Fixture::load();
    assert_eq!(
        fx.cfg,
        Gpt2Config::tiny(),
        "fixture config differs from Gpt2Config::tiny()"
    );
    let layout = ParamLayout::new(&fx.cfg);
    // Every parameter in the fixture maps to the layout, and the reverse.
    let n_params = fx
        .f32s
        .keys()
        .filter(|k| k.starts_with("transformer."))
        .count();
    assert_eq!(n_params, layout.tensors.len(), "parameter count");
    let params = fx.flat(&layout, "");
    (fx, layout, params)
}

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
    let steps = fx.meta["steps"].parse::<usize>().unwrap();
    let (lr, beta1, beta2, eps, wd, max_norm) = (
        fx.hparam("lr"),
        fx.hparam("beta1"),
        fx.hparam("beta2"),
        fx.hparam("eps"),
        fx.hparam("weight_decay"),
        fx.hparam("max_grad_norm"),
    );
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
            lr,
            beta1,
            beta2,
            eps,
            wd,
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
            let (mut strict, mut noisy) = ((Vec::new(), Vec::new()), (Vec::new(), Vec::new()));
            for ((&a, &b), &g) in ours.iter().zip(theirs).zip(grad0) {
                let side = if g.abs() < ILL_CONDITIONED_GRAD {
                    &mut noisy
                } else {
                    &mut strict
                };
                side.0.push(a);
                side.1.push(b);
            }
            results.push(compare(&name, &strict.0, &strict.1, PARAM_ATOL, PARAM_RTOL));
            if !noisy.0.is_empty() {
                let noise_bound = 2.0 * lr * steps as f32;
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

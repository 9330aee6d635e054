//! The model as Braid tasks against the sequential reference.
//!
//! * Bit-identical to `reference.rs` — forward activations, logits,
//!   probabilities, loss, and every parameter gradient — on 1, 2 and 4 compute
//!   streams under every placement policy: each task runs the reference's
//!   kernel on the same inputs, and the engine keeps every accumulation into a
//!   gradient in submission order (the reference's order).
//! * The engine optimizer (chunked norm, clip, AdamW tasks) against the
//!   reference loop: equal to within `f64` rounding of the norm (the partial
//!   sums are added per chunk), checked at 1e-6 relative.
//!
//! Against the PyTorch fixture, the model as tasks is checked on every
//! backend present in `tests/reference_pytorch.rs`.

mod common;

use braid::{BackendKind, Policy, Runtime};
use braid_gpt2::checkpoint::AdamWHyper;
use braid_gpt2::config::Gpt2Config;
use braid_gpt2::layout::{ParamLayout, Span};
use braid_gpt2::model::{init_params, Dtype, Fusion, Gpt2Model, ModelOptions, Rng, GRADIENT_RING};
use braid_gpt2::optim::AdamW;
use braid_gpt2::reference::{ActivationLayout, Reference, GELU_RING};
use common::{reference_steps, TEST_ADAMW};

/// Every compute stream is used whatever the core budget (`oversubscribe`),
/// however many other tests' runtimes are alive, so "any streams" holds.
fn runtime(streams: usize, policy: Policy) -> Runtime {
    Runtime::builder()
        .backend(BackendKind::Cpu)
        .compute_streams(streams)
        .comm_streams(1)
        .policy(policy)
        .oversubscribe(true)
        .build()
        .unwrap()
}

/// Parameters where every tensor matters: GPT-2 init, then noise on the
/// biases and gains (which init sets to constants).
fn params_for(cfg: &Gpt2Config, seed: u64) -> Vec<f32> {
    let mut p = init_params(cfg, seed);
    let mut rng = Rng::new(seed + 1);
    for x in &mut p {
        *x += 0.05 * rng.normal();
    }
    p
}

fn ids(n: usize, v: usize, seed: u64) -> Vec<u32> {
    let mut rng = Rng::new(seed);
    (0..n).map(|_| (rng.next_u64() % v as u64) as u32).collect()
}

fn assert_bits_eq(what: &str, ours: &[f32], theirs: &[f32]) {
    assert_eq!(ours.len(), theirs.len(), "{what}: lengths");
    if let Some(i) = ours
        .iter()
        .zip(theirs)
        .position(|(a, b)| a.to_bits() != b.to_bits())
    {
        panic!(
            "{what}[{i}]: engine {} vs reference {} (not bit-identical)",
            ours[i], theirs[i]
        );
    }
}

/// The sequential reference after a forward and a backward pass (dloss 1)
/// on `(tokens, targets)`, with its loss and gradients, and the gradients
/// after a second, accumulated backward pass (dloss 0.5) on `tokens2`.
fn reference_passes(
    cfg: &Gpt2Config,
    (b, t): (usize, usize),
    params: &[f32],
    (tokens, targets): (&[u32], &[u32]),
    tokens2: &[u32],
) -> (Reference, f32, Vec<f32>, Vec<f32>) {
    let mut reference = Reference::new(cfg, b, t).unwrap();
    let loss = reference
        .forward(params, tokens, Some(targets))
        .unwrap()
        .unwrap();
    let mut grads = vec![0.0; ParamLayout::new(cfg).total];
    reference.backward(params, &mut grads, 1.0).unwrap();
    let mut grads2 = grads.clone();
    let mut reference2 = Reference::new(cfg, b, t).unwrap();
    reference2.forward(params, tokens2, Some(targets)).unwrap();
    reference2.backward(params, &mut grads2, 0.5).unwrap();
    (reference, loss, grads, grads2)
}

/// `tiny` with five blocks: more blocks than the activation gradients' ring
/// has slots (`GRADIENT_RING`), so blocks share slots; and an odd
/// vocabulary, 301, so the model's logits rows are padded (to 384,
/// `Gpt2Config::padded_vocab`) where the reference's are not.
fn five_blocks() -> Gpt2Config {
    let cfg = Gpt2Config {
        num_layers: 5,
        vocab_size: 301,
        ..Gpt2Config::tiny()
    };
    assert_eq!(cfg.padded_vocab(), 384);
    cfg
}

/// Asserts that the model's `f32` activations (`ActivationLayout::stored`)
/// are the reference's (`ActivationLayout::new`), tensor by tensor, bit for
/// bit. The model's layout differs in two ways: logits and probabilities in
/// rows of `Vp` (compared over their first `V` columns), and one `preatt`
/// for all layers (compared with the last layer's, which it holds).
fn assert_activations_match(
    what: &str,
    cfg: &Gpt2Config,
    (b, t): (usize, usize),
    acts: &[f32],
    reference: &[f32],
) {
    let ours = ActivationLayout::stored(cfg, b, t, Fusion::NONE, false, Dtype::F32);
    let theirs = ActivationLayout::new(cfg, b, t);
    assert_eq!((ours.total, theirs.total), (acts.len(), reference.len()));
    let same = |name: &str, o: Span, r: Span| {
        assert_bits_eq(&format!("{what}: {name}"), o.of(acts), r.of(reference));
    };
    same("encoded", ours.encoded, theirs.encoded);
    let last = cfg.num_layers - 1;
    for (l, (lo, lr)) in ours.layers.iter().zip(&theirs.layers).enumerate() {
        let (mut o, mut r) = (Vec::new(), Vec::new());
        lo.map(|s| o.push(*s));
        lr.map(|s| r.push(*s));
        for (i, (o, r)) in o.into_iter().zip(r).enumerate() {
            if (o, r) == (lo.preatt, lr.preatt) && l != last {
                assert_eq!(o, ours.layers[last].preatt, "one preatt for all layers");
                continue;
            }
            same(&format!("layer {l} activation {i}"), o, r);
        }
    }
    for (name, o, r) in [
        ("lnf", ours.lnf, theirs.lnf),
        ("lnf_mean", ours.lnf_mean, theirs.lnf_mean),
        ("lnf_rstd", ours.lnf_rstd, theirs.lnf_rstd),
        ("losses", ours.losses, theirs.losses),
    ] {
        same(name, o, r);
    }
    let (v, vp) = (cfg.vocab_size, ours.vp);
    for (name, o, r) in [
        ("logits", ours.logits, theirs.logits),
        ("probs", ours.probs, theirs.probs),
    ] {
        let used: Vec<f32> = o
            .of(acts)
            .chunks_exact(vp)
            .flat_map(|x| &x[..v])
            .copied()
            .collect();
        assert_bits_eq(&format!("{what}: {name}"), &used, r.of(reference));
    }
}

/// A model run's loss, logits, gradients and accumulated gradients
/// ([`Case::run`]).
type Run = (f32, Vec<f32>, Vec<f32>, Vec<f32>);

/// A fixture: `five_blocks` at `B 2 × T t`, parameters from `param_seed`,
/// a batch, a second batch (ids from seeds `id_seed`, `+ 1`, `+ 2`), and the
/// reference's passes over them ([`reference_passes`]).
struct Case {
    cfg: Gpt2Config,
    bt: (usize, usize),
    params: Vec<f32>,
    tokens: Vec<u32>,
    targets: Vec<u32>,
    tokens2: Vec<u32>,
    reference: Reference,
    loss: f32,
    grads: Vec<f32>,
    grads2: Vec<f32>,
}

impl Case {
    fn new(t: usize, param_seed: u64, id_seed: u64) -> Case {
        let cfg = five_blocks();
        let b = 2;
        let params = params_for(&cfg, param_seed);
        let tokens = ids(b * t, cfg.vocab_size, id_seed);
        let targets = ids(b * t, cfg.vocab_size, id_seed + 1);
        let tokens2 = ids(b * t, cfg.vocab_size, id_seed + 2);
        let (reference, loss, grads, grads2) =
            reference_passes(&cfg, (b, t), &params, (&tokens, &targets), &tokens2);
        Case {
            cfg,
            bt: (b, t),
            params,
            tokens,
            targets,
            tokens2,
            reference,
            loss,
            grads,
            grads2,
        }
    }

    /// A model with `opts` on `rt` through the reference's passes: its loss,
    /// logits (read before the backward pass), gradients, and gradients
    /// after the second, accumulated pass.
    fn run(&self, rt: &Runtime, opts: ModelOptions) -> Run {
        let (b, t) = self.bt;
        let mut model = Gpt2Model::with_options(rt, &self.cfg, b, t, opts).unwrap();
        assert_eq!(model.options(), opts);
        model.upload_params(rt, &self.params).unwrap();
        model.zero_grad(rt).unwrap();
        model
            .forward(rt, &self.tokens, Some(&self.targets))
            .unwrap();
        let logits = model.read_logits(rt).unwrap();
        model.backward(rt, 1.0, |_| Ok(())).unwrap();
        let loss = model.read_loss(rt).unwrap();
        let g = model.read_grads(rt).unwrap();
        model
            .forward(rt, &self.tokens2, Some(&self.targets))
            .unwrap();
        model.backward(rt, 0.5, |_| Ok(())).unwrap();
        let g2 = model.read_grads(rt).unwrap();
        rt.synchronize().unwrap();
        (loss, logits, g, g2)
    }

    /// Asserts a run is within the fused kernels' tolerances of the
    /// reference.
    fn check(&self, what: &str, (loss, logits, g, g2): &Run) {
        assert!((loss - self.loss).abs() <= 1e-5, "{what}: loss");
        let ref_logits = self.reference.logits();
        assert_close(&format!("{what}: logits"), logits, ref_logits, 1e-5, 1e-4);
        assert_close(&format!("{what}: gradients"), g, &self.grads, 1e-7, 1e-3);
        assert_close(
            &format!("{what}: accumulated"),
            g2,
            &self.grads2,
            1e-7,
            1e-3,
        );
        // Not trivially equal: the accumulation changed something.
        assert!(g2 != g, "{what}");
    }
}

#[test]
fn forward_and_backward_are_bit_identical_to_the_reference_on_any_streams_and_policy() {
    let Case {
        cfg,
        bt: (b, t),
        params,
        tokens,
        targets,
        tokens2,
        reference,
        loss,
        grads,
        grads2,
    } = Case::new(16, 7, 1);
    let layout = ParamLayout::new(&cfg);

    for streams in [1, 2, 4] {
        for policy in Policy::ALL {
            let what = format!("{streams} streams, {policy}");
            let rt = runtime(streams, policy);
            let mut model = Gpt2Model::new(&rt, &cfg, b, t).unwrap();
            model.upload_params(&rt, &params).unwrap();
            model.zero_grad(&rt).unwrap();
            model.forward(&rt, &tokens, Some(&targets)).unwrap();
            let mut ready = Vec::new();
            model
                .backward(&rt, 1.0, |p| {
                    ready.push(p);
                    Ok(())
                })
                .unwrap();
            let engine_loss = model.read_loss(&rt).unwrap();
            assert_eq!(engine_loss.to_bits(), loss.to_bits(), "{what}: loss");
            let acts: Vec<f32> = rt.read_vec(model.activations()).unwrap();
            assert_activations_match(&what, &cfg, (b, t), &acts, reference.activations());
            assert_bits_eq(
                &format!("{what}: probabilities"),
                &model.read_probs(&rt).unwrap(),
                reference.probs(),
            );
            // One row, as the sampler reads it: row `r` of the padded
            // logits, `V` long.
            let v = cfg.vocab_size;
            for r in [0, b * t - 1] {
                assert_bits_eq(
                    &format!("{what}: logits row {r}"),
                    &model.read_logits_row(&rt, r).unwrap(),
                    &reference.logits()[r * v..(r + 1) * v],
                );
            }
            assert_bits_eq(
                &format!("{what}: logits"),
                &model.read_logits(&rt).unwrap(),
                reference.logits(),
            );
            assert_bits_eq(
                &format!("{what}: gradients"),
                &model.read_grads(&rt).unwrap(),
                &grads,
            );
            // Every parameter was announced exactly once, last layer first.
            let mut sorted = ready.clone();
            sorted.sort_unstable();
            assert_eq!(sorted, (0..layout.tensors.len()).collect::<Vec<_>>());
            assert_eq!(layout.tensors[ready[0]].name, "transformer.ln_f.bias");
            assert_eq!(
                layout.tensors[*ready.last().unwrap()].name,
                "transformer.wte.weight"
            );
            // Accumulation without zeroing, as the reference does it.
            model.forward(&rt, &tokens2, Some(&targets)).unwrap();
            model.backward(&rt, 0.5, |_| Ok(())).unwrap();
            assert_bits_eq(
                &format!("{what}: accumulated gradients"),
                &model.read_grads(&rt).unwrap(),
                &grads2,
            );
            rt.synchronize().unwrap();
        }
    }
}

/// Largest `|a - b|` and, over elements with `|b| > floor`, `|a - b| / |b|`.
fn max_errors(a: &[f32], b: &[f32], floor: f32) -> (f32, f32) {
    a.iter()
        .zip(b)
        .fold((0.0f32, 0.0f32), |(abs, rel), (&x, &y)| {
            let e = (x - y).abs();
            let r = if y.abs() > floor { e / y.abs() } else { 0.0 };
            (abs.max(e), rel.max(r))
        })
}

/// Each fused kernel on its own, and the pair a GPU default would take
/// (classifier, residual + layer norm): the reference's loss, logits and
/// gradients to the fused model's tolerances, with less activation memory
/// than the unfused model.
#[test]
fn each_fused_kernel_alone_matches_the_reference() {
    // T 40 crosses the CPU tasks' 32-row tiles.
    let case = Case::new(40, 17, 21);
    let (b, t) = case.bt;
    let rt = runtime(2, Policy::Affinity);
    let unfused = Gpt2Model::new(&rt, &case.cfg, b, t).unwrap();
    let one = |f: fn(&mut Fusion)| {
        let mut x = Fusion::NONE;
        f(&mut x);
        x
    };
    for fusion in [
        one(|f| f.attention = true),
        one(|f| f.classifier = true),
        one(|f| f.residual_layernorm = true),
        one(|f| f.gelu_recompute = true),
        Fusion::parse("classifier,residual-layernorm").unwrap(),
    ] {
        let what = format!("--fuse {fusion}");
        let opts = ModelOptions {
            fusion,
            ..ModelOptions::default()
        };
        case.check(&what, &case.run(&rt, opts));
        let mut model = Gpt2Model::with_options(&rt, &case.cfg, b, t, opts).unwrap();
        let kept = model.activations().len() + model.activation_grads().unwrap().len();
        let all = unfused.activations().len() + unfused.activation_grads().unwrap().len();
        assert!(
            kept < all,
            "{what}: {kept} bytes of activations, unfused {all}"
        );
        model.forward(&rt, &case.tokens, None).unwrap();
        assert_eq!(model.read_probs(&rt).unwrap().is_empty(), fusion.classifier);
    }
    assert_eq!(Fusion::parse("all").unwrap(), Fusion::ALL);
    assert_eq!(Fusion::ALL.to_string(), "all");
    let e = Fusion::parse("classifier,flash").unwrap_err();
    assert!(e.contains("`flash`") && e.contains("gelu-recompute"), "{e}");
    // An empty list is refused, not read as `none`.
    let e = Fusion::parse(" ").unwrap_err();
    assert!(e.contains("empty list"), "{e}");
}

/// Every fused kernel (`Fusion::ALL`) as tasks:
/// the same on every number of streams and policy (bit for bit: the fused
/// kernels are deterministic and accumulate in submission order), within
/// float tolerance of the unfused sequential reference (T = 40 crosses the
/// CPU tasks' 32-row tiles), accumulating like it, with the smaller
/// activation buffers.
#[test]
fn fused_model_matches_the_reference_and_is_the_same_on_any_streams() {
    let case = Case::new(40, 17, 21);
    let (cfg, (b, t)) = (case.cfg, case.bt);
    let fused = ModelOptions {
        fusion: Fusion::ALL,
        ..ModelOptions::default()
    };
    // (loss, logits, gradients, accumulated gradients) of the first run
    let mut first: Option<Run> = None;
    for streams in [1, 2, 4] {
        for policy in Policy::ALL {
            let what = format!("fused, {streams} streams, {policy}");
            let run = case.run(&runtime(streams, policy), fused);
            match &first {
                None => {
                    let (el, eg, eg2) = (
                        max_errors(&run.1, case.reference.logits(), 1e-3),
                        max_errors(&run.2, &case.grads, 1e-4),
                        max_errors(&run.3, &case.grads2, 1e-4),
                    );
                    eprintln!(
                        "{what} vs unfused reference: loss {} vs {}; \
                         logits max abs {:e} rel {:e}; grads max abs {:e} rel {:e}; \
                         accumulated grads max abs {:e} rel {:e}",
                        run.0, case.loss, el.0, el.1, eg.0, eg.1, eg2.0, eg2.1
                    );
                    case.check(&what, &run);
                    first = Some(run);
                }
                Some((l0, lg0, g0, g20)) => {
                    assert_eq!(run.0.to_bits(), l0.to_bits(), "{what}: loss");
                    assert_bits_eq(&format!("{what}: logits"), &run.1, lg0);
                    assert_bits_eq(&format!("{what}: gradients"), &run.2, g0);
                    assert_bits_eq(&format!("{what}: accumulated"), &run.3, g20);
                }
            }
        }
    }

    // Memory: per layer a (B, NH, T) logsumexp instead of a (B, NH, T, T)
    // `att`, and no `preatt` (the unfused layout has one for all layers);
    // no (B, T, Vp) probabilities; no (B, T, Vp) logits gradient, and
    // per ring slot no (B, T, C) gradients of the two projections (they are
    // the residual's).
    let rt = runtime(1, Policy::Affinity);
    let unfused = Gpt2Model::new(&rt, &cfg, b, t).unwrap();
    let fused = Gpt2Model::with_options(&rt, &cfg, b, t, fused).unwrap();
    let (l, nh, v) = (cfg.num_layers, cfg.num_heads, cfg.padded_vocab());
    // ... and GELU outputs in a ring of GELU_RING slots, not one per block.
    let saved_acts = l * (b * nh * t * t - b * nh * t)
        + b * nh * t * t
        + b * t * v
        + (l - GELU_RING) * 4 * b * t * cfg.channels;
    assert_eq!(
        unfused.activations().len() - fused.activations().len(),
        saved_acts * 4
    );
    assert_eq!(
        unfused.activation_grads().unwrap().len() - fused.activation_grads().unwrap().len(),
        (b * t * v + GRADIENT_RING * 2 * b * t * cfg.channels) * 4
    );
    // The ring: of the 5 blocks' gradients other than the residual stream's
    // (16·B·T·C each unfused), GRADIENT_RING blocks' worth is kept.
    let per_block = ActivationLayout::stored(&cfg, b, t, Fusion::NONE, true, Dtype::F32).total * 4;
    assert_eq!(
        per_block - unfused.activation_grads().unwrap().len(),
        (l - GRADIENT_RING) * 16 * b * t * cfg.channels * 4
    );
    assert!(fused.read_probs(&rt).unwrap().is_empty());
}

/// The fused classifier with and without the padded classifier weight
/// (kept by default on CUDA only: `ModelOptions::padded_classifier`), both
/// on the CPU: each within float tolerance of the unfused reference; the
/// padded one keeps its `(Vp, C)` copy of `wte` at this odd vocabulary.
#[test]
fn the_fused_classifier_matches_the_reference_padded_or_not() {
    let case = Case::new(40, 17, 21);
    let (b, t) = case.bt;
    let rt = runtime(2, Policy::Affinity);
    for padded in [None, Some(true), Some(false)] {
        let opts = ModelOptions {
            fusion: Fusion {
                classifier: true,
                ..Fusion::NONE
            },
            padded_classifier: padded,
            ..ModelOptions::default()
        };
        let model = Gpt2Model::with_options(&rt, &case.cfg, b, t, opts).unwrap();
        assert_eq!(model.pads_classifier(), padded == Some(true), "{padded:?}");
        let run = case.run(&rt, opts);
        case.check(&format!("fused classifier, padded {padded:?}"), &run);
    }
}

#[test]
fn bad_inputs_are_errors_and_submit_nothing() {
    let cfg = Gpt2Config::tiny();
    let rt = runtime(2, Policy::Affinity);
    assert!(Gpt2Model::new(&rt, &cfg, 1, cfg.max_seq_len + 1)
        .unwrap_err()
        .to_string()
        .contains("sequence length"));
    let mut model = Gpt2Model::new(&rt, &cfg, 1, 4).unwrap();
    let err = model.forward(&rt, &[1, 2, 512, 3], None).unwrap_err();
    assert!(err.to_string().contains("512"), "{err}");
    let err = model.forward(&rt, &[1, 2, 3], None).unwrap_err();
    assert!(err.to_string().contains("tokens"), "{err}");
    let err = model.backward(&rt, 1.0, |_| Ok(())).unwrap_err();
    assert!(err.to_string().contains("targets"), "{err}");
    assert!(model.upload_params(&rt, &[0.0; 3]).is_err());
    rt.synchronize().unwrap();
    assert_eq!(rt.stats().tasks, 0);
}

/// The engine's training loop: zero, forward, backward, optimizer tasks.
#[allow(clippy::too_many_arguments)]
fn engine_steps(
    rt: &Runtime,
    cfg: &Gpt2Config,
    b: usize,
    t: usize,
    params: &[f32],
    tokens: &[u32],
    targets: &[u32],
    h: AdamWHyper,
    max_norm: f32,
    steps: usize,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut model = Gpt2Model::new(rt, cfg, b, t).unwrap();
    model.upload_params(rt, params).unwrap();
    let mut opt = AdamW::for_model(rt, &model, h, Some(max_norm)).unwrap();
    let (mut losses, mut norms) = (Vec::new(), Vec::new());
    for _ in 0..steps {
        model.zero_grad(rt).unwrap();
        model.forward(rt, tokens, Some(targets)).unwrap();
        model.backward(rt, 1.0, |_| Ok(())).unwrap();
        opt.step(rt, model.params(), model.grads().unwrap())
            .unwrap();
        losses.push(model.read_loss(rt).unwrap());
        norms.push(opt.read_grad_norm(rt).unwrap());
    }
    (losses, norms, model.read_params(rt).unwrap())
}

fn assert_close(what: &str, ours: &[f32], theirs: &[f32], atol: f32, rtol: f32) {
    assert_eq!(ours.len(), theirs.len(), "{what}: lengths");
    for (i, (&a, &b)) in ours.iter().zip(theirs).enumerate() {
        let err = (a - b).abs();
        assert!(
            err <= atol + rtol * b.abs(),
            "{what}[{i}]: ours {a}, expected {b} (error {err})"
        );
    }
}

#[test]
fn optimizer_tasks_match_the_reference_training_loop() {
    let cfg = Gpt2Config::tiny();
    let (b, t) = (2, 8);
    let init = params_for(&cfg, 11);
    let tokens = ids(b * t, cfg.vocab_size, 4);
    let targets = ids(b * t, cfg.vocab_size, 5);
    let h = TEST_ADAMW;
    let mut ref_params = init.clone();
    let (ref_losses, ref_norms) =
        reference_steps(&cfg, b, t, &mut ref_params, &tokens, &targets, h, 1.0, 4);
    let rt = runtime(2, Policy::Affinity);
    let (losses, norms, params) =
        engine_steps(&rt, &cfg, b, t, &init, &tokens, &targets, h, 1.0, 4);
    assert_close("losses", &losses, &ref_losses, 0.0, 1e-6);
    assert_close("norms", &norms, &ref_norms, 0.0, 1e-6);
    assert_close("params", &params, &ref_params, 1e-7, 1e-6);
    assert!(ref_norms[0] > 1.0, "clipping engaged");
    assert!(losses[3] < losses[0]);
}

/// The recorded update reads the step scalars `advance` writes: before any
/// `advance`, or after `load_state` moved the step, it is refused, naming
/// why; after an `advance` it runs.
#[test]
fn the_recorded_update_needs_advance_first() {
    let cfg = Gpt2Config::tiny();
    let rt = runtime(1, Policy::Affinity);
    let model = Gpt2Model::new(&rt, &cfg, 1, 4).unwrap();
    let mut opt = AdamW::for_model(&rt, &model, TEST_ADAMW, Some(1.0)).unwrap();
    let e = opt
        .update_recorded(&rt, model.params(), model.grads().unwrap())
        .unwrap_err();
    assert!(e.to_string().contains("advance"), "{e}");
    opt.advance(&rt).unwrap();
    assert_eq!(opt.steps(), 1);
    opt.update_recorded(&rt, model.params(), model.grads().unwrap())
        .unwrap();
    rt.synchronize().unwrap();
    // A resumed step count holds no scalars until the next advance.
    let zeros = vec![0.0f32; model.layout().total];
    opt.load_state(&rt, &zeros, &zeros, 7).unwrap();
    let e = opt
        .update_recorded(&rt, model.params(), model.grads().unwrap())
        .unwrap_err();
    assert!(e.to_string().contains("step 7"), "{e}");
    opt.advance(&rt).unwrap();
    opt.update_recorded(&rt, model.params(), model.grads().unwrap())
        .unwrap();
    rt.synchronize().unwrap();
}

/// `forward_for_backward`, fused: the forward pass leaves the losses to the
/// backward pass's classifier (one pass over the logits per step instead of
/// two), which gives the same loss and gradients, bit for bit, as `forward`
/// then `backward`; until `backward` has run the loss is the last step's.
#[test]
fn fused_training_forward_leaves_the_loss_to_backward() {
    let cfg = Gpt2Config::tiny();
    let (b, t) = (2, 40);
    let params = params_for(&cfg, 31);
    let batches = [
        (
            ids(b * t, cfg.vocab_size, 32),
            ids(b * t, cfg.vocab_size, 33),
        ),
        (
            ids(b * t, cfg.vocab_size, 34),
            ids(b * t, cfg.vocab_size, 35),
        ),
    ];
    let fused = ModelOptions {
        fusion: Fusion::ALL,
        ..ModelOptions::default()
    };
    let rt = runtime(2, Policy::Affinity);
    // (loss, gradients) per batch; `split`: forward_for_backward.
    let run = |split: bool| -> Vec<(f32, Vec<f32>)> {
        let mut model = Gpt2Model::with_options(&rt, &cfg, b, t, fused).unwrap();
        model.upload_params(&rt, &params).unwrap();
        let mut out: Vec<(f32, Vec<f32>)> = Vec::new();
        for (tokens, targets) in &batches {
            model.zero_grad(&rt).unwrap();
            if split {
                model.upload_batch(&rt, tokens, Some(targets)).unwrap();
                model.forward_for_backward(&rt).unwrap();
                if let Some((last, _)) = out.last() {
                    let before = model.read_loss(&rt).unwrap();
                    assert_eq!(before.to_bits(), last.to_bits(), "loss before backward");
                }
            } else {
                model.forward(&rt, tokens, Some(targets)).unwrap();
            }
            model.backward(&rt, 1.0, |_| Ok(())).unwrap();
            out.push((
                model.read_loss(&rt).unwrap(),
                model.read_grads(&rt).unwrap(),
            ));
        }
        rt.synchronize().unwrap();
        out
    };
    let (plain, split) = (run(false), run(true));
    assert_ne!(plain[0].0, plain[1].0, "two batches, two losses");
    for (i, ((l0, g0), (l1, g1))) in plain.iter().zip(&split).enumerate() {
        assert_eq!(l0.to_bits(), l1.to_bits(), "batch {i}: loss");
        assert_bits_eq(&format!("batch {i}: gradients"), g1, g0);
    }
}

//! Shared by the tests against the PyTorch fixture
//! (`tests/fixtures/gpt2_tiny_reference.safetensors`, which
//! `scripts/make_reference.py` makes with Hugging Face's `GPT2LMHeadModel`):
//! the decoded fixture, and the llm.c-style elementwise comparison
//! `|ours - torch| <= atol + rtol·|torch|` that names the worst tensor and
//! element. Each test file keeps its own tolerances.

// Each test crate compiles this module on its own and uses only part of it.
#![allow(dead_code)]

use std::collections::HashMap;

use braid::BackendKind;
use braid_gpt2::checkpoint::AdamWHyper;
use braid_gpt2::config::Gpt2Config;
use braid_gpt2::kernels::cpu;
use braid_gpt2::layout::ParamLayout;
use braid_gpt2::reference::Reference;
use safetensors::{Dtype, SafeTensors};

pub const FIXTURE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/gpt2_tiny_reference.safetensors"
);

/// A greedy continuation by Hugging Face with the fp32 fixture's initial
/// parameters (`make_reference.py`, "The decode fixture").
pub const FIXTURE_DECODE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/gpt2_tiny_decode.safetensors"
);

/// The same model in bf16 mixed precision (`make_reference.py`, "The bf16
/// fixture").
pub const FIXTURE_BF16: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/gpt2_tiny_reference_bf16.safetensors"
);

/// The fixture, decoded.
#[derive(Debug)]
pub struct Fixture {
    pub cfg: Gpt2Config,
    pub b: usize,
    pub t: usize,
    pub meta: HashMap<String, String>,
    /// Every `f32` tensor: its shape and its data.
    pub f32s: HashMap<String, (Vec<usize>, Vec<f32>)>,
    pub tokens: Vec<u32>,
    pub targets: Vec<u32>,
}

impl Fixture {
    pub fn load() -> Self {
        Self::load_from(FIXTURE)
    }

    /// The fixture at `path` ([`FIXTURE`] or [`FIXTURE_BF16`]).
    pub fn load_from(path: &str) -> Self {
        let bytes = std::fs::read(path).unwrap_or_else(|e| {
            panic!("{path}: {e} (regenerate with models/gpt2/scripts/make_reference.py)")
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

    /// The `f32` tensor `name`, if the fixture has it.
    pub fn try_tensor(&self, name: &str) -> Option<&[f32]> {
        self.f32s.get(name).map(|(_, data)| data.as_slice())
    }

    pub fn tensor(&self, name: &str) -> &[f32] {
        self.try_tensor(name)
            .unwrap_or_else(|| panic!("fixture lacks `{name}`"))
    }

    pub fn hparam(&self, name: &str) -> f32 {
        self.meta[name]
            .parse()
            .unwrap_or_else(|e| panic!("metadata {name}: {e}"))
    }

    /// The number of AdamW steps the fixture records.
    pub fn steps(&self) -> usize {
        self.meta["steps"].parse().unwrap()
    }

    /// The AdamW hyperparameters of those steps (the clipping norm is
    /// `hparam("max_grad_norm")`).
    pub fn adamw_hyper(&self) -> AdamWHyper {
        AdamWHyper {
            learning_rate: self.hparam("lr"),
            beta1: self.hparam("beta1"),
            beta2: self.hparam("beta2"),
            eps: self.hparam("eps"),
            weight_decay: self.hparam("weight_decay"),
        }
    }

    /// Gathers `prefix + hf name` tensors into the flat layout, transposing
    /// Conv1D weights; checks every shape against the layout.
    pub fn flat(&self, layout: &ParamLayout, prefix: &str) -> Vec<f32> {
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

/// The fixture, its layout and its parameters in the flat layout; checks
/// that it is made with `Gpt2Config::tiny()` and that its parameters and the
/// layout's tensors match one to one.
pub fn setup() -> (Fixture, ParamLayout, Vec<f32>) {
    setup_from(FIXTURE)
}

/// [`setup`] for the fixture at `path`.
pub fn setup_from(path: &str) -> (Fixture, ParamLayout, Vec<f32>) {
    let fx = Fixture::load_from(path);
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

/// The worst element of a comparison.
#[derive(Debug, Clone)]
pub struct Worst {
    pub what: String,
    pub index: usize,
    pub ours: f32,
    pub theirs: f32,
    /// `|ours - theirs| - (atol + rtol·|theirs|)`: positive means a failure.
    pub excess: f32,
    pub max_abs_err: f32,
    pub max_rel_err: f32,
}

/// Compares elementwise; returns the worst element (by excess over the tolerance).
pub fn compare(what: &str, ours: &[f32], theirs: &[f32], atol: f32, rtol: f32) -> Worst {
    assert_eq!(ours.len(), theirs.len(), "{what}: lengths");
    assert!(!ours.is_empty(), "{what}: nothing to compare");
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

/// Prints the worst errors; panics with the worst element if any comparison
/// is beyond its tolerance.
pub fn check_all(kind: &str, results: &[Worst]) {
    let worst = results
        .iter()
        .max_by(|a, b| a.excess.total_cmp(&b.excess))
        .expect("nothing compared");
    let max_abs = results.iter().map(|w| w.max_abs_err).fold(0.0, f32::max);
    let max_rel = results
        .iter()
        .max_by(|a, b| a.max_rel_err.total_cmp(&b.max_rel_err))
        .unwrap();
    eprintln!(
        "{kind}: {} tensors; max abs err {max_abs:.3e}; max rel err {:.3e} (in {}); closest \
         to tolerance: {}[{}] ours {} torch {} (excess {:.3e})",
        results.len(),
        max_rel.max_rel_err,
        max_rel.what,
        worst.what,
        worst.index,
        worst.ours,
        worst.theirs,
        worst.excess
    );
    assert!(
        worst.excess <= 0.0,
        "{kind}: {}[{}] differs from PyTorch: ours {}, torch {} (beyond tolerance by {:.3e}; \
         max abs err {max_abs:.3e}, max rel err {:.3e} in {})",
        worst.what,
        worst.index,
        worst.ours,
        worst.theirs,
        worst.excess,
        max_rel.max_rel_err,
        max_rel.what
    );
}

/// Pairs of (ours, theirs) values split by the size of the element's initial
/// gradient: `(strict, noisy)`, where `noisy` holds the elements whose
/// `|grad| < threshold`. Adam divides by the gradient's own magnitude, so where
/// the true gradient is near zero rounding noise becomes steps of up to ~lr;
/// callers hold those elements only to the bound that noise can reach.
pub type Pairs = (Vec<f32>, Vec<f32>);

pub fn split_by_gradient(
    ours: &[f32],
    theirs: &[f32],
    grad0: &[f32],
    threshold: f32,
) -> (Pairs, Pairs) {
    let (mut strict, mut noisy): (Pairs, Pairs) = Default::default();
    for ((&a, &b), &g) in ours.iter().zip(theirs).zip(grad0) {
        let side = if g.abs() < threshold {
            &mut noisy
        } else {
            &mut strict
        };
        side.0.push(a);
        side.1.push(b);
    }
    (strict, noisy)
}

/// A backend a test body runs on: one body, one `#[test]` per backend
/// ([`test_device!`], after candle's macro of that name).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    Cpu,
    Cuda,
}

impl Device {
    pub fn backend(self) -> BackendKind {
        match self {
            Device::Cpu => BackendKind::Cpu,
            Device::Cuda => BackendKind::Cuda { device: 0 },
        }
    }

    /// Whether the device is present. Without a GPU the CUDA test prints why
    /// it skips and passes; under `BRAID_REQUIRE_GPU=1` it fails instead.
    pub fn present(self, test: &str) -> bool {
        match self {
            Device::Cpu => true,
            Device::Cuda => braid::cuda::gpu_or_skip(test),
        }
    }
}

/// `test_device!(body, body_cpu, body_cuda)`: `body(Device)` as one test per
/// backend; the CUDA one skips with a message when there is no GPU. (Bring
/// it in with `#[macro_use] mod common;`.)
#[allow(unused_macros)]
macro_rules! test_device {
    ($body:ident, $cpu:ident, $cuda:ident) => {
        #[test]
        fn $cpu() {
            $body($crate::common::Device::Cpu);
        }

        #[test]
        fn $cuda() {
            if $crate::common::Device::Cuda.present(stringify!($cuda)) {
                $body($crate::common::Device::Cuda);
            }
        }
    };
}

/// GPT-2's AdamW settings (betas 0.9, 0.95, weight decay 0.1) at `lr 1e-3`,
/// as the kernel and engine tests use them.
pub const TEST_ADAMW: AdamWHyper = AdamWHyper {
    learning_rate: 1e-3,
    beta1: 0.9,
    beta2: 0.95,
    eps: 1e-8,
    weight_decay: 0.1,
};

/// The reference training loop: per step, zeroed gradients, forward and
/// backward on [`Reference`], the gradients clipped to `max_norm`, one AdamW
/// update. Returns the step losses and gradient norms; `params` ends as the
/// parameters after the last step.
#[allow(clippy::too_many_arguments)]
pub fn reference_steps(
    cfg: &Gpt2Config,
    b: usize,
    t: usize,
    params: &mut [f32],
    tokens: &[u32],
    targets: &[u32],
    h: AdamWHyper,
    max_norm: f32,
    steps: usize,
) -> (Vec<f32>, Vec<f32>) {
    let n = params.len();
    let mut model = Reference::new(cfg, b, t).unwrap();
    let mut grads = vec![0.0; n];
    let (mut m, mut v) = (vec![0.0; n], vec![0.0; n]);
    let (mut losses, mut norms) = (Vec::new(), Vec::new());
    for step in 1..=steps {
        grads.fill(0.0);
        let loss = model
            .forward(params, tokens, Some(targets))
            .unwrap()
            .unwrap();
        model.backward(params, &mut grads, 1.0).unwrap();
        let norm = cpu::grad_norm_sq(&grads).sqrt();
        cpu::scale_in_place(&mut grads, cpu::clip_scale(norm, max_norm));
        cpu::adamw_update(
            params,
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
    (losses, norms)
}

/// Learnable tokens below the tiny vocabulary: `n` ids in runs of 12
/// consecutive ids from random starting points.
pub fn runs_of_ids(n: usize, seed: u64) -> Vec<u32> {
    let mut rng = braid_gpt2::model::Rng::new(seed);
    let mut ids = Vec::with_capacity(n + 12);
    while ids.len() < n {
        let start = (rng.next_u64() % 512) as u32;
        ids.extend((0..12).map(|i| (start + i) % 512));
    }
    ids.truncate(n);
    ids
}

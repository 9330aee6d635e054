//! GPT-2 training on one GPU with cuDNN's attention (`BRAID_ATTENTION=cudnn`
//! or `auto`, `flash_attention::set_attention_kernels`). A test binary of its own: the
//! switch is process-wide, and the other GPU tests must not see it. Skips
//! without a GPU or without libcudnn (fails instead under
//! `BRAID_REQUIRE_GPU=1`).

use braid::{BackendKind, Policy};
use braid_gpt2::checkpoint::AdamWHyper;
use braid_gpt2::config::Gpt2Config;
use braid_gpt2::data::TokenSource;
use braid_gpt2::kernels::cpu::Dtype;
use braid_gpt2::kernels::flash_attention::{cudnn_report, set_attention_kernels, AttentionKernels};
use braid_gpt2::model::Fusion;
use common::runs_of_ids;

mod common;
use braid_gpt2::trainer::{train, StartState, TrainOptions, TrainReport};

fn losses(r: &TrainReport) -> Vec<f32> {
    r.steps.iter().map(|s| s.loss).collect()
}

/// The tiny model (head size 16) in bf16 with every fusion, B 4 × T 128 (T
/// a multiple of 128, which every cuDNN 9 takes), trained for 6 steps with
/// cuDNN's attention and with Braid's: the same losses to bf16 tolerance
/// (the two round P and dS alike, and sum in different orders). Two runs
/// with cuDNN give the same bits (its deterministic backward; replayed
/// steps, graph captures included, run the plans the first step made),
/// both directions ran through cuDNN, and the trainer's report says so
/// (and says nothing of cuDNN for the run without it). `auto` runs what
/// `cudnn` does, bit for bit, where cuDNN has engines, and Braid's kernels
/// where it has none (forced with `BRAID_CUDNN_SDPA=unified`), saying so.
#[test]
fn a_run_with_cudnn_attention_trains_like_one_with_braids() {
    if !braid::cuda::cudnn::cudnn_or_skip("a_run_with_cudnn_attention_trains_like_one_with_braids")
    {
        return;
    }
    // The tiny model with a context of 128 (its own is 64).
    let cfg = Gpt2Config {
        max_seq_len: 128,
        ..Gpt2Config::tiny()
    };
    let data = TokenSource::from_ids(&runs_of_ids(16384, 9), "counting runs").unwrap();
    let start = StartState::fresh(&cfg, 4);
    let run = |kernels: AttentionKernels| {
        set_attention_kernels(kernels);
        let opts = TrainOptions {
            model: cfg,
            batch_size: 4,
            seq_len: 128,
            steps: 6,
            dtype: Dtype::Bf16,
            fusion: Fusion::ALL,
            optimizer: AdamWHyper {
                learning_rate: 3e-3,
                ..TrainOptions::default().optimizer
            },
            backend: BackendKind::Cuda { device: 0 },
            ranks: 1,
            streams: 2,
            policy: Policy::Affinity,
            ..TrainOptions::default()
        };
        let r = train(&opts, start.clone(), &data, &|_| {});
        set_attention_kernels(AttentionKernels::Braid);
        r.unwrap_or_else(|e| panic!("attention kernels {kernels}: {e}"))
    };
    let braids = run(AttentionKernels::Braid);
    assert!(braids.cudnn.is_empty(), "{:?}", braids.cudnn);
    let braids = losses(&braids);
    let with = run(AttentionKernels::Cudnn);
    // The report says what ran the attention.
    assert!(
        format!("{with}").contains("attention        cuDNN"),
        "the report names cuDNN:\n{with}"
    );
    let cudnn = losses(&with);
    let again = losses(&run(AttentionKernels::Cudnn));
    let auto = losses(&run(AttentionKernels::Auto));
    let report = cudnn_report();
    eprintln!(
        "Braid's attention {braids:?}\ncuDNN's {cudnn:?}\n{}",
        report.join("\n")
    );
    assert_eq!(cudnn, again, "two runs with cuDNN's attention");
    assert_eq!(auto, cudnn, "auto against cudnn");
    for (i, (x, y)) in braids.iter().zip(&cudnn).enumerate() {
        assert!(
            (x - y).abs() <= 1e-2,
            "step {i}: loss {x} with Braid's attention, {y} with cuDNN's"
        );
    }
    for direction in ["Forward", "Backward"] {
        assert!(
            report
                .iter()
                .any(|l| l.contains(direction) && !l.contains("Braid's kernels")),
            "the attention {direction} ran through cuDNN: {report:?}"
        );
    }

    // `auto` where cuDNN has no engine: with only the unified graph to try
    // there is none for a backward (and none for a forward before 9.21),
    // so those calls run Braid's kernels and the report says why. The
    // variable is read when a runtime makes its cuDNN handle; no thread of
    // the runs above is left to read it concurrently.
    std::env::set_var(braid::cuda::cudnn::SDPA_ENV, "unified");
    let fell_back = losses(&run(AttentionKernels::Auto));
    std::env::remove_var(braid::cuda::cudnn::SDPA_ENV);
    let report = cudnn_report();
    eprintln!(
        "auto with the unified graph only {fell_back:?}\n{}",
        report.join("\n")
    );
    let fallback = |direction: &str| {
        report
            .iter()
            .any(|l| l.contains(direction) && l.contains("Braid's kernels"))
    };
    assert!(fallback("Backward"), "the backward fell back: {report:?}");
    if fallback("Forward") {
        // Both directions ran Braid's kernels: Braid's bits.
        assert_eq!(fell_back, braids, "auto with no engine against Braid's");
    }
    for (i, (x, y)) in braids.iter().zip(&fell_back).enumerate() {
        assert!(
            (x - y).abs() <= 1e-2,
            "step {i}: loss {x} with Braid's attention, {y} with auto falling back"
        );
    }
}

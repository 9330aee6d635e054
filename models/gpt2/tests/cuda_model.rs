//! The GPT-2 model as Braid tasks on the CUDA backend, beyond the PyTorch
//! comparison (which `tests/reference_pytorch.rs` runs on every backend
//! present, this one included): a short training run through
//! `trainer::train` whose trace is timed on the device and shows the compute
//! streams overlapping, the command-line program on one GPU, and two GPU
//! ranks (in one process, and as two torchrun processes).
//!
//! GPU tests skip with a message when no GPU is present and fail instead when
//! `BRAID_REQUIRE_GPU=1`. The two-GPU tests (one process driving two devices;
//! two processes under torchrun's variables) skip on machines with fewer than
//! two GPUs, whatever `BRAID_REQUIRE_GPU` says.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;

use braid::trace::Profile;
use braid::{BackendKind, Policy, TaskKind};
use braid_gpt2::checkpoint::AdamWHyper;
use braid_gpt2::config::Gpt2Config;
use braid_gpt2::data::{write_token_file, TokenSource};
use braid_gpt2::kernels::cpu::Dtype;
use braid_gpt2::model::Fusion;
use common::runs_of_ids;

mod common;
use braid_gpt2::trainer::{train, StartState, TrainOptions, TrainReport};

/// The first step's loss on CUDA against the CPU's (see
/// `tests/reference_pytorch.rs` for the CUDA tolerances).
const LOSS_ATOL: f32 = 1e-4;

/// Number of CUDA devices (0 without a driver).
fn gpu_count() -> usize {
    braid::cuda::cuda_available().unwrap_or(0)
}

// ----- training through the trainer ------------------------------------------

fn options(backend: BackendKind, ranks: usize, steps: u64) -> TrainOptions {
    TrainOptions {
        model: Gpt2Config::tiny(),
        batch_size: 4,
        seq_len: 64,
        steps,
        optimizer: AdamWHyper {
            learning_rate: 3e-3,
            ..TrainOptions::default().optimizer
        },
        backend,
        ranks,
        streams: 2,
        policy: Policy::Affinity,
        bucket_cap_bytes: 96 << 10,
        first_bucket_bytes: 32 << 10,
        ..TrainOptions::default()
    }
}

fn losses(r: &TrainReport) -> Vec<f32> {
    r.steps.iter().map(|s| s.loss).collect()
}

/// Time during which two or more compute streams ran compute tasks at once.
fn compute_overlap_ns(p: &Profile) -> u64 {
    let mut edges: Vec<(u64, i32)> = Vec::new();
    for (i, info) in p.streams.iter().enumerate() {
        if info.is_comm {
            continue;
        }
        let mut v: Vec<(u64, u64)> = p
            .spans
            .iter()
            .filter(|s| s.stream == i && s.kind == TaskKind::Compute)
            .map(|s| (s.start_ns, s.end_ns))
            .collect();
        v.sort_unstable();
        // Merge within the stream first, so only cross-stream overlap counts.
        let mut merged: Vec<(u64, u64)> = Vec::new();
        for (s, e) in v {
            match merged.last_mut() {
                Some(last) if s <= last.1 => last.1 = last.1.max(e),
                _ => merged.push((s, e)),
            }
        }
        for (s, e) in merged {
            edges.push((s, 1));
            edges.push((e, -1));
        }
    }
    edges.sort_unstable();
    let (mut active, mut last, mut overlap) = (0i32, 0u64, 0u64);
    for (t, d) in edges {
        if active >= 2 {
            overlap += t - last;
        }
        active += d;
        last = t;
    }
    overlap
}

/// A short run on one GPU: the loss falls, the first step's loss is the CPU
/// run's (same parameters, same batch), and the trace is device-timed with
/// the compute streams overlapping.
///
/// What is asserted about overlap is what holds at any size: over the run,
/// some time has two compute streams busy at once (weight gradients and
/// activation-gradient zeroing go to the side stream while the main chain
/// continues, and a span is timed by CUDA events from when its stream
/// reaches it to when its last kernel ends). How much overlaps at these tiny
/// sizes depends on the host's launch rate, so it is printed, not asserted.
#[test]
fn cuda_training_run_lowers_the_loss_and_traces_overlapping_streams() {
    if !braid::cuda::gpu_or_skip("cuda_training_run_lowers_the_loss_and_traces_overlapping_streams")
    {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("trace.json");
    let data = TokenSource::from_ids(&runs_of_ids(8192, 99), "counting runs").unwrap();
    let start = StartState::fresh(&Gpt2Config::tiny(), 5);
    let steps = 8;
    let mut opts = options(BackendKind::Cuda { device: 0 }, 1, steps);
    opts.trace = Some(trace.clone());
    let r = train(&opts, start.clone(), &data, &|_| {}).unwrap();
    assert_eq!((r.backend, r.ranks, r.process_rank), ("cuda", 1, None));
    let l = losses(&r);
    eprintln!("cuda losses {l:?}");
    eprintln!("{r}");
    assert_eq!(l.len(), steps as usize);
    assert!(l.iter().all(|x| x.is_finite()), "{l:?}");
    let tail = l[l.len() - 2..].iter().sum::<f32>() / 2.0;
    assert!(
        tail < l[0] - 0.1,
        "the loss did not fall: {l:?} (mean of the last two {tail})"
    );
    assert_eq!(r.params.len(), Gpt2Config::tiny().num_parameters());
    assert!(r.params.iter().all(|x| x.is_finite()));

    // The first step's loss is a forward pass of the same parameters on the
    // same batch: the CPU's to float tolerance.
    let cpu = train(
        &TrainOptions {
            steps: 1,
            trace: None,
            ..options(BackendKind::Cpu, 1, 1)
        },
        start,
        &data,
        &|_| {},
    )
    .unwrap();
    let (g, c) = (l[0], cpu.steps[0].loss);
    eprintln!("first step loss: cuda {g}, cpu {c}");
    assert!(
        (g - c).abs() <= LOSS_ATOL,
        "first step loss: cuda {g}, cpu {c}"
    );

    // Device-timed spans: every compute task of the run is in the profile,
    // with positive durations, on the two compute streams.
    let p = &r.profiles[0];
    let compute: Vec<_> = p
        .spans
        .iter()
        .filter(|s| s.kind == TaskKind::Compute)
        .collect();
    assert!(
        compute.len() > 50 * steps as usize,
        "{} spans",
        compute.len()
    );
    assert!(compute.iter().all(|s| s.end_ns >= s.start_ns && s.ok));
    let streams_used: BTreeSet<usize> = compute.iter().map(|s| s.stream).collect();
    assert_eq!(
        streams_used
            .iter()
            .map(|&s| p.streams[s].name.as_str())
            .collect::<Vec<_>>(),
        ["compute 0", "compute 1"],
        "compute tasks ran on both compute streams"
    );
    // Weight gradients went beside the input gradients.
    let stream_of = |name: &str| {
        p.spans
            .iter()
            .filter(|s| s.name == name)
            .map(|s| s.stream)
            .collect::<BTreeSet<_>>()
    };
    eprintln!(
        "logits backward input on {:?}, logits backward weight on {:?}",
        stream_of("logits backward input"),
        stream_of("logits backward weight")
    );
    let overlap = compute_overlap_ns(p);
    let s = &r.summaries[0];
    eprintln!(
        "two compute streams busy at once: {:.3} ms of {:.3} ms ({:.1}%); summary overlap {:.3} ms",
        overlap as f64 / 1e6,
        s.wall_ns as f64 / 1e6,
        100.0 * overlap as f64 / s.wall_ns.max(1) as f64,
        s.overlap_ns as f64 / 1e6
    );
    assert!(
        overlap > 0,
        "the two compute streams never ran at the same time over {steps} steps"
    );
    // The trace file: one process, the two compute tracks named, spans on both.
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    let events = json["traceEvents"].as_array().unwrap();
    let tracks: Vec<&str> = events
        .iter()
        .filter(|e| e["name"] == "thread_name")
        .filter_map(|e| e["args"]["name"].as_str())
        .collect();
    assert!(
        tracks.contains(&"compute 0") && tracks.contains(&"compute 1"),
        "{tracks:?}"
    );
    assert!(events
        .iter()
        .any(|e| e["name"] == "logits backward weight" && e["ph"] == "X"));
}

/// Mixed precision (bf16 storage, f32 master weights) and the fused kernels
/// (flash attention, fused classifier, fused residual + layer norm) train on
/// the GPU as they do on the CPU: each step's loss within a tolerance of the
/// CPU run's (same parameters, same batches). The CUDA kernels differ from
/// the CPU's in summation order (cuBLAS, block reductions, tiles), so a bf16
/// value may round the other way; the trajectories agree to the tolerance,
/// not bit for bit. The loss must also fall on the GPU. The vocabulary is
/// odd (301, logits rows padded to 384), so the fused runs take the padded
/// classifier weight (its zero rows in the products over all 384 columns).
#[test]
fn bf16_and_fused_training_on_cuda_follows_the_cpu() {
    if !braid::cuda::gpu_or_skip("bf16_and_fused_training_on_cuda_follows_the_cpu") {
        return;
    }
    let cfg = Gpt2Config {
        vocab_size: 301,
        ..Gpt2Config::tiny()
    };
    assert_eq!(cfg.padded_vocab(), 384);
    let ids: Vec<u32> = runs_of_ids(8192, 7).iter().map(|&id| id % 301).collect();
    let data = TokenSource::from_ids(&ids, "counting runs").unwrap();
    let start = StartState::fresh(&cfg, 11);
    let steps = 6;
    for (dtype, fused, atol) in [
        (Dtype::Bf16, false, 0.05f32),
        (Dtype::F32, true, 2e-3),
        (Dtype::Bf16, true, 0.05),
    ] {
        let run = |backend| {
            let opts = TrainOptions {
                model: cfg,
                dtype,
                fusion: if fused { Fusion::ALL } else { Fusion::NONE },
                ..options(backend, 1, steps)
            };
            train(&opts, start.clone(), &data, &|_| {})
                .unwrap_or_else(|e| panic!("{dtype} fused={fused} on {backend:?}: {e}"))
        };
        let (g, c) = (
            losses(&run(BackendKind::Cuda { device: 0 })),
            losses(&run(BackendKind::Cpu)),
        );
        eprintln!("{dtype} fused={fused}: cuda {g:?}\n{:>22} cpu  {c:?}", "");
        assert_eq!(g.len(), steps as usize);
        for (i, (a, b)) in g.iter().zip(&c).enumerate() {
            assert!(
                (a - b).abs() <= atol,
                "{dtype} fused={fused}, step {i}: cuda loss {a}, cpu loss {b} (tolerance {atol})"
            );
        }
        assert!(
            g[steps as usize - 1] < g[0] - 0.1,
            "{dtype} fused={fused}: the loss did not fall on cuda: {g:?}"
        );
    }
}

/// Gradient accumulation and validation on CUDA follow the CPU: 2
/// micro-batches a step (their batches copied in on the device inside the
/// step, which is replayed as a CUDA graph from step 3), a validation
/// every 2 steps and text generated every 3, fp32 and bf16; the losses and
/// validation losses within the tolerances above.
#[test]
fn accumulation_and_validation_on_cuda_follow_the_cpu() {
    if !braid::cuda::gpu_or_skip("accumulation_and_validation_on_cuda_follow_the_cpu") {
        return;
    }
    let cfg = Gpt2Config::tiny();
    let data = TokenSource::from_ids(&runs_of_ids(8192, 7), "counting runs").unwrap();
    let held_out = TokenSource::from_ids(&runs_of_ids(2048, 8), "held out").unwrap();
    let start = StartState::fresh(&cfg, 12);
    for (dtype, atol) in [(Dtype::F32, 2e-3f32), (Dtype::Bf16, 0.05)] {
        let run = |backend| {
            let opts = TrainOptions {
                dtype,
                batch_size: 2,
                grad_accum: 2,
                graphs: matches!(backend, BackendKind::Cuda { .. }),
                validation: Some(braid_gpt2::trainer::Validation {
                    data: held_out.clone(),
                    every: 2,
                    windows: 9,
                }),
                generation: Some(braid_gpt2::trainer::Generation {
                    every: 3,
                    tokens: 8,
                    prompt: vec![1, 2],
                    how: braid_gpt2::model::Sampling::default(),
                }),
                ..options(backend, 1, 6)
            };
            train(&opts, start.clone(), &data, &|_| {})
                .unwrap_or_else(|e| panic!("{dtype} on {backend:?}: {e}"))
        };
        let (g, c) = (run(BackendKind::Cuda { device: 0 }), run(BackendKind::Cpu));
        assert!(g.graph_replays[0] > 0, "{dtype}: the step was not a graph");
        for (a, b) in g.steps.iter().zip(&c.steps) {
            assert!((a.loss - b.loss).abs() <= atol, "{dtype}: {a:?} vs {b:?}");
            match (a.val_loss, b.val_loss) {
                (Some(x), Some(y)) => assert!((x - y).abs() <= atol, "{dtype}: {a:?} vs {b:?}"),
                (None, None) => {}
                _ => panic!("{dtype}: validated at other steps: {a:?} vs {b:?}"),
            }
        }
        assert_eq!(g.steps.iter().filter(|s| s.val_loss.is_some()).count(), 3);
        // Text generated between graph launches, at steps 3 and 6.
        let samples: Vec<(u64, usize)> = g
            .steps
            .iter()
            .filter_map(|s| Some((s.step, s.sample.as_ref()?.len())))
            .collect();
        assert_eq!(samples, [(3, 8), (6, 8)], "{dtype}");
    }
}

/// Decoding positions one at a time on CUDA (`Gpt2Model::forward_position`,
/// the one-row attention kernel; the sampler's KV cache, off by default on
/// CUDA until this passes on a GPU) against the full forward pass's rows on
/// the same GPU, fp32 and bf16, and a sampler with the cache drawing its
/// tokens.
#[test]
fn decoded_positions_on_cuda_follow_the_full_forward() {
    if !braid::cuda::gpu_or_skip("decoded_positions_on_cuda_follow_the_full_forward") {
        return;
    }
    use braid_gpt2::model::{init_params, Gpt2Model, ModelOptions, Sampler};
    let cfg = Gpt2Config::tiny();
    let rt =
        braid_gpt2::trainer::model_runtime(BackendKind::Cuda { device: 0 }, 2, Policy::Affinity, 0)
            .unwrap();
    let params = init_params(&cfg, 5);
    let t = 40;
    let tokens: Vec<u32> = (0..t)
        .map(|i| ((i * 7919 + 13) % cfg.vocab_size) as u32)
        .collect();
    for (dtype, rtol) in [(Dtype::F32, 1e-4f32), (Dtype::Bf16, 3e-2)] {
        let opts = ModelOptions {
            dtype,
            ..ModelOptions::default()
        };
        let mut m = Gpt2Model::with_options(&rt, &cfg, 1, t, opts).unwrap();
        m.upload_params(&rt, &params).unwrap();
        m.forward(&rt, &tokens, None).unwrap();
        let full: Vec<Vec<f32>> = (0..t).map(|p| m.read_logits_row(&rt, p).unwrap()).collect();
        let mut padded = tokens[..3].to_vec();
        padded.resize(t, 0);
        m.forward(&rt, &padded, None).unwrap();
        for (p, &token) in tokens.iter().enumerate().skip(3) {
            m.forward_position(&rt, p, token).unwrap();
            let row = m.read_logits_row(&rt, p).unwrap();
            let scale = full[p].iter().fold(1f32, |s, x| s.max(x.abs()));
            let d = row
                .iter()
                .zip(&full[p])
                .fold(0f32, |s, (a, b)| s.max((a - b).abs()));
            assert!(d <= rtol * scale, "{dtype}: position {p} differs by {d}");
        }
        let mut s = Sampler::new(&rt, &cfg, &params, 16, 1.0, 7, dtype)
            .unwrap()
            .with_kv_cache(true);
        let drawn = s.generate(&rt, &tokens[..2], 30, |_| Ok(())).unwrap();
        assert_eq!(drawn.len(), 30);
        assert!(drawn.iter().all(|&x| (x as usize) < cfg.vocab_size));
    }
}

/// A best-effort bf16 run that leaves SMs to other programs
/// (`TrainOptions::spare_sms`: its compute streams in a green context)
/// trains like one on every SM: every kernel (NVRTC's, cuBLAS's) runs on
/// the green context's streams, with the primary context's buffers, events
/// and modules. The report says how many SMs were spared.
#[test]
fn a_run_that_spares_sms_trains_like_one_on_every_sm() {
    if !braid::cuda::gpu_or_skip("a_run_that_spares_sms_trains_like_one_on_every_sm") {
        return;
    }
    let cfg = Gpt2Config::tiny();
    let data = TokenSource::from_ids(&runs_of_ids(8192, 5), "counting runs").unwrap();
    let start = StartState::fresh(&cfg, 3);
    let steps = 4;
    let run = |spare_sms| {
        let opts = TrainOptions {
            dtype: Dtype::Bf16,
            fusion: Fusion::ALL,
            class: Some(braid::Class::BestEffort),
            spare_sms,
            ..options(BackendKind::Cuda { device: 0 }, 1, steps)
        };
        train(&opts, start.clone(), &data, &|_| {})
            .unwrap_or_else(|e| panic!("spare_sms {spare_sms}: {e}"))
    };
    let (all, spared) = (run(0), run(8));
    assert_eq!(all.spared_sms, None);
    let (n, of) = spared.spared_sms.expect("the report names the spared SMs");
    assert!(n >= 8 && n < of, "spared {n} of {of}");
    let (a, b) = (losses(&all), losses(&spared));
    eprintln!(
        "every SM {a:?}\nspared {n} of {of}: {b:?} (bit-identical: {})",
        a == b
    );
    // The kernels are deterministic and do not depend on where their blocks
    // run; cuBLAS may pick another algorithm for fewer SMs, which moves the
    // last bits only.
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        assert!(
            (x - y).abs() <= 1e-3,
            "step {i}: {x} on every SM, {y} sparing {n}"
        );
    }
}

/// The program on one GPU: trains, and says it ran on cuda.
#[test]
fn cli_trains_on_one_gpu() {
    if !braid::cuda::gpu_or_skip("cli_trains_on_one_gpu") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let ids: Vec<u16> = runs_of_ids(4096, 7).iter().map(|&x| x as u16).collect();
    write_token_file(dir.path().join("train.bin"), &ids).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_braid-gpt2"))
        .current_dir(dir.path())
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .args([
            "train",
            "--model",
            "tiny",
            "--data",
            "train.bin",
            "--device",
            "cuda",
            "--ranks",
            "1",
            "--steps",
            "3",
            "--batch-size",
            "2",
            "--seq-len",
            "32",
            "--trace",
            "t.json",
        ])
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("on cuda"), "{stdout}");
    assert!(dir.path().join("t.json").is_file());
}

/// The tied gradient split on one GPU (the reducer at world size 1, NCCL
/// with one rank): the classifier's part reduced in row blocks, the
/// encoder's token rows linked, gathered and added by the reducer's CUDA
/// kernels (`cuda/kernels/sparse_rows.cu`) — the same losses and
/// parameters, to float tolerance, as with the gradient whole; in f32, and
/// in bf16 with the fused kernels (the trainer's GPU default).
#[test]
fn the_tied_split_runs_on_one_gpu() {
    if braid::cuda::gpu_or_skip("the_tied_split_runs_on_one_gpu") {
        tied_split_at_one_rank(BackendKind::Cuda { device: 0 });
    }
}

/// The same on the CPU backend (the test's own check, everywhere).
#[test]
fn the_tied_split_runs_on_one_cpu_rank() {
    tied_split_at_one_rank(BackendKind::Cpu);
}

fn tied_split_at_one_rank(backend: BackendKind) {
    let data = TokenSource::from_ids(&runs_of_ids(8192, 99), "counting runs").unwrap();
    let start = StartState::fresh(&Gpt2Config::tiny(), 5);
    let steps = 3;
    for (dtype, fusion, rtol) in [
        (Dtype::F32, Fusion::NONE, 1e-5),
        (Dtype::Bf16, Fusion::ALL, 2e-3),
    ] {
        let run = |split: bool| {
            let mut o = options(backend, 1, steps);
            (o.reduce_single_rank, o.tied_split) = (true, split);
            (o.dtype, o.fusion) = (dtype, fusion);
            train(&o, start.clone(), &data, &|_| {}).unwrap()
        };
        let (split, whole) = (run(true), run(false));
        let label = format!("{backend:?}, {dtype:?}");
        let adds = |r: &TrainReport| {
            r.profiles[0]
                .spans
                .iter()
                .filter(|s| s.name.starts_with("add sparse rows"))
                .count()
        };
        assert_eq!(adds(&split), steps as usize, "{label}: one add per step");
        assert_eq!(adds(&whole), 0, "{label}");
        eprintln!(
            "{label}: split {:?}, whole {:?}",
            losses(&split),
            losses(&whole)
        );
        for (a, b) in losses(&split).iter().zip(&losses(&whole)) {
            assert!((a - b).abs() <= rtol * b.abs(), "{label}: loss {a} vs {b}");
        }
        let worst = split
            .params
            .iter()
            .zip(&whole.params)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        // Adam's steps are at most the learning rate (3e-3) each.
        assert!(worst <= 3e-3, "{label}: parameters {worst} apart");
    }
}

// ----- two GPUs ------------------------------------------------------------------

/// Two GPU ranks in one process (NCCL between them) against one GPU rank on
/// the combined batch: the same losses to float tolerance.
#[test]
fn two_gpu_ranks_in_one_process_reproduce_one_rank() {
    if gpu_count() < 2 {
        eprintln!("SKIPPED two_gpu_ranks_in_one_process_reproduce_one_rank: needs 2 GPUs");
        return;
    }
    let data = TokenSource::from_ids(&runs_of_ids(8192, 99), "counting runs").unwrap();
    let start = StartState::fresh(&Gpt2Config::tiny(), 5);
    let cuda = BackendKind::Cuda { device: 0 };
    let one = train(
        &TrainOptions {
            batch_size: 4,
            ..options(cuda, 1, 3)
        },
        start.clone(),
        &data,
        &|_| {},
    )
    .unwrap();
    let two = train(
        &TrainOptions {
            batch_size: 2,
            ..options(cuda, 2, 3)
        },
        start,
        &data,
        &|_| {},
    )
    .unwrap();
    assert_eq!(two.ranks, 2);
    assert_eq!(two.profiles.len(), 2);
    assert!(two.summaries.iter().all(|s| s.comm_ns > 0));
    eprintln!("1 rank {:?}\n2 ranks {:?}", losses(&one), losses(&two));
    for (a, b) in losses(&two).iter().zip(&losses(&one)) {
        assert!((a - b).abs() <= 1e-4 + 1e-4 * b.abs(), "{a} vs {b}");
    }
    eprintln!("{two}");
}

/// Two processes under torchrun's variables (one GPU each, NCCL through the
/// TCP rendezvous): both finish, with the same losses.
#[test]
fn two_torchrun_processes_train_together() {
    if gpu_count() < 2 {
        eprintln!("SKIPPED two_torchrun_processes_train_together: needs 2 GPUs");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let ids: Vec<u16> = runs_of_ids(8192, 7).iter().map(|&x| x as u16).collect();
    write_token_file(dir.path().join("train.bin"), &ids).unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let spawn = |rank: usize| {
        Command::new(env!("CARGO_BIN_EXE_braid-gpt2"))
            .current_dir(dir.path())
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", "2")
            .env("LOCAL_RANK", rank.to_string())
            .env("LOCAL_WORLD_SIZE", "2")
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .args([
                "train",
                "--model",
                "tiny",
                "--data",
                "train.bin",
                "--device",
                "cuda",
                "--steps",
                "3",
                "--batch-size",
                "2",
                "--seq-len",
                "32",
                "--trace",
                "t.json",
            ])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let children = [spawn(0), spawn(1)];
    let outs: Vec<_> = children
        .into_iter()
        .map(|c| c.wait_with_output().unwrap())
        .collect();
    let mut last_losses = Vec::new();
    for (rank, out) in outs.iter().enumerate() {
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "rank {rank}:\n{stdout}\n{stderr}");
        last_losses.push(
            stdout
                .lines()
                .find(|l| l.starts_with("loss "))
                .unwrap_or_else(|| panic!("rank {rank}: no loss line in\n{stdout}"))
                .to_string(),
        );
    }
    assert_eq!(last_losses[0], last_losses[1]);
    assert!(Path::new(&dir.path().join("t.json")).is_file());
    assert!(Path::new(&dir.path().join("t.rank1.json")).is_file());
}

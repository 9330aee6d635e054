//! The benchmark programs refuse flags that would measure nothing: a count of
//! 0, an empty or inverted size range, an absurd rank count. Each case spawns
//! the program and checks that it exits with an error naming the flag, before
//! it measures anything, and without a panic (an index out of bounds, a
//! division by zero) or an abort (a thread that could not start).
//!
//! Every refusal happens when the arguments are checked, so the programs
//! that need a GPU are tested here too: they refuse the flag before looking
//! for one.

use std::process::Command;

/// Runs `bin` with `args`; asserts it fails without panicking or aborting
/// and that its error output contains every one of `expect`.
fn refused(bin: &str, args: &[&str], expect: &[&str]) {
    let out = Command::new(bin)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("running {bin}: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let what = format!(
        "{bin} {args:?}\nstatus {}\nstdout:\n{stdout}\nstderr:\n{stderr}",
        out.status
    );
    assert!(!out.status.success(), "accepted: {what}");
    // A refusal is an error exit (clap's 2, anyhow's 1), not a signal.
    assert!(
        matches!(out.status.code(), Some(1 | 2)),
        "not an error exit: {what}"
    );
    for bad in ["panicked", "fatal runtime error", "RUST_BACKTRACE"] {
        assert!(!stderr.contains(bad), "`{bad}`: {what}");
    }
    for e in expect {
        assert!(stderr.contains(e), "no `{e}` in the error: {what}");
    }
    // Refused before measuring: not even a header.
    assert!(stdout.trim().is_empty(), "printed something: {what}");
}

const ALLREDUCE_BW: &str = env!("CARGO_BIN_EXE_allreduce_bw");
const DAG_OVERHEAD: &str = env!("CARGO_BIN_EXE_dag_overhead");
const DDP_OVERLAP: &str = env!("CARGO_BIN_EXE_ddp_overlap");
const GPT2_CPU: &str = env!("CARGO_BIN_EXE_gpt2_cpu");
const GPT2_GPU: &str = env!("CARGO_BIN_EXE_gpt2_gpu");
const GPT2_GRAPHS: &str = env!("CARGO_BIN_EXE_gpt2_graphs");
const GEMM_VOCAB: &str = env!("CARGO_BIN_EXE_gemm_vocab");
const MULTI_TENANT: &str = env!("CARGO_BIN_EXE_multi_tenant");
const SIMULATE: &str = env!("CARGO_BIN_EXE_simulate");

#[test]
fn allreduce_bw_refuses_rank_counts_it_cannot_run() {
    // 0 ranks panicked on the first rank's results.
    refused(ALLREDUCE_BW, &["--ranks", "0"], &["--ranks", "at least 1"]);
    refused(
        ALLREDUCE_BW,
        &["--ranks", "2,0"],
        &["--ranks", "at least 1"],
    );
    // 100,000 rank threads aborted the process.
    refused(
        ALLREDUCE_BW,
        &["--ranks", "100000"],
        &["--ranks", "at most 1024"],
    );
    refused(
        ALLREDUCE_BW,
        &["--ranks", "1025"],
        &["--ranks", "at most 1024"],
    );
}

#[test]
fn allreduce_bw_refuses_message_sizes_that_measure_nothing() {
    // An inverted range printed an empty table and exited 0.
    refused(
        ALLREDUCE_BW,
        &["--min-bytes", "8192", "--max-bytes", "4096"],
        &["--max-bytes", "--min-bytes"],
    );
    refused(ALLREDUCE_BW, &["--max-bytes", "0"], &["--max-bytes"]);
    // Sizes that are not whole f32 elements (3 bytes was measured as 4).
    refused(
        ALLREDUCE_BW,
        &["--min-bytes", "3"],
        &["--min-bytes", "multiple of 4"],
    );
    refused(
        ALLREDUCE_BW,
        &["--min-bytes", "4098"],
        &["--min-bytes", "multiple of 4"],
    );
    refused(ALLREDUCE_BW, &["--min-bytes", "0"], &["--min-bytes"]);
    // A factor below 2 was silently taken as 2.
    for f in ["0", "1"] {
        refused(ALLREDUCE_BW, &["--step-factor", f], &["--step-factor"]);
    }
}

#[test]
fn dag_overhead_refuses_zero_counts() {
    // --reps 0 panicked on the empty list of timings; --tasks 0 divided by 0.
    for flag in ["--reps", "--tasks", "--streams", "--window"] {
        refused(DAG_OVERHEAD, &[flag, "0"], &[flag]);
    }
    // One stream made pingpong a chain: no hand-off to measure.
    refused(
        DAG_OVERHEAD,
        &["--shape", "pingpong", "--streams", "1"],
        &["--shape pingpong", "--streams 2"],
    );
}

#[test]
fn ddp_overlap_refuses_zero_counts() {
    // --ranks 0 panicked on the first rank's results, --steps 0 and
    // --rounds 0 on an empty median.
    refused(DDP_OVERLAP, &["--ranks", "0"], &["--ranks", "at least 1"]);
    refused(
        DDP_OVERLAP,
        &["--ranks", "100000"],
        &["--ranks", "at most 1024"],
    );
    for flag in [
        "--steps",
        "--rounds",
        "--batch",
        "--compute-streams",
        "--cap-kib",
        "--first-cap-kib",
    ] {
        refused(DDP_OVERLAP, &[flag, "0"], &[flag]);
    }
    refused(DDP_OVERLAP, &["--dims", "256,0,128"], &["--dims"]);
}

#[test]
fn gpt2_cpu_refuses_zero_counts() {
    // --rounds 0 and --steps 0 printed speed-ups of 1.000x (or NaN).
    for flag in [
        "--rounds",
        "--steps",
        "--batch-size",
        "--seq-len",
        "--streams",
    ] {
        refused(GPT2_CPU, &[flag, "0"], &[flag]);
    }
    refused(GPT2_CPU, &["--ranks", "0"], &["--ranks", "at least 1"]);
    refused(
        GPT2_CPU,
        &["--ranks", "100000"],
        &["--ranks", "at most 1024"],
    );
    for flag in ["--bucket-cap-mb", "--first-bucket-mb"] {
        refused(GPT2_CPU, &[flag, "0"], &[flag, "not a positive number"]);
        refused(GPT2_CPU, &[&format!("{flag}=-1")], &[flag]);
    }
}

#[test]
fn gpu_benchmarks_refuse_zero_counts_before_looking_for_a_gpu() {
    for flag in ["--batch-size", "--seq-len", "--streams"] {
        refused(GPT2_GPU, &[flag, "0"], &[flag]);
        refused(GPT2_GRAPHS, &[flag, "0"], &[flag]);
    }
    refused(GPT2_GPU, &["--peak-tflops", "0"], &["--peak-tflops"]);
    // --multiple 0 divided by zero; --reps 0 printed NaN times.
    for flag in ["--rows", "--channels", "--vocab", "--multiple", "--reps"] {
        refused(GEMM_VOCAB, &[flag, "0"], &[flag]);
    }
}

#[test]
fn multi_tenant_refuses_values_that_measure_nothing() {
    // A negative period panicked (a negative Duration); 0 puts every
    // request due at the start, so the latencies are the queue's.
    for p in ["0", "-1", "nan"] {
        refused(
            MULTI_TENANT,
            &[&format!("--period-ms={p}")],
            &["--period-ms", "not a positive number"],
        );
    }
    for flag in [
        "--request-tokens",
        "--be-batch-size",
        "--be-seq-len",
        "--rounds",
        "--be-bundle-us",
    ] {
        refused(MULTI_TENANT, &[flag, "0"], &[flag]);
    }
    refused(
        MULTI_TENANT,
        &["--be-ranks", "0"],
        &["--be-ranks", "at least 1"],
    );
    refused(
        MULTI_TENANT,
        &["--be-ranks", "100000"],
        &["--be-ranks", "at most 1024"],
    );
}

/// Flags that only the model can judge are checked before anything runs,
/// each error naming its flag: an unknown `--be-model` (checked only after
/// the solo runs, which printed their figures first), a `--device` it does
/// not know, more tokens than a model takes.
#[test]
fn multi_tenant_checks_its_models_flags_before_it_runs() {
    refused(MULTI_TENANT, &["--be-model", "nope"], &["--be-model nope"]);
    refused(MULTI_TENANT, &["--device", "tpu"], &["--device tpu"]);
    refused(
        MULTI_TENANT,
        &["--request-tokens", "65"],
        &["--request-tokens 65", "at most 64"],
    );
    refused(
        MULTI_TENANT,
        &["--be-model", "tiny", "--be-seq-len", "65"],
        &["--be-seq-len 65", "at most 64"],
    );
    refused(
        MULTI_TENANT,
        &["--be-model", "nope", "--realtime"],
        &["--be-model nope"],
    );
}

/// `--be-model tiny` trains (its vocabulary of 512 ids is smaller than the
/// built-in data's GPT-2 ids: they are folded into it); it failed after the
/// solo runs with a token id out of range for the vocabulary.
#[test]
fn multi_tenant_trains_the_tiny_model() {
    let out = Command::new(MULTI_TENANT)
        .args([
            "--be-model",
            "tiny",
            "--be-steps",
            "3",
            "--requests",
            "3",
            "--period-ms",
            "2",
        ])
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(
        stdout.contains("training alone (normal"),
        "the solo training run is not normal: {stdout}"
    );
    let last = stdout.lines().last().unwrap_or_default();
    assert!(last.starts_with("lc_p99_ratio="), "{stdout}");
}

#[test]
fn simulate_refuses_values_that_predict_nothing() {
    // A trace the simulator reads: without the checks, every case below
    // would run and print a prediction.
    let trace = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../docs/traces/gpt2-124m-h100-affinity-step.json"
    );
    let sim = |extra: &[&str], expect: &[&str]| {
        let mut args = vec!["--trace", trace];
        args.extend_from_slice(extra);
        refused(SIMULATE, &args, expect);
    };
    // 0 streams was simulated as 1 and printed as 0.
    sim(&["--streams", "0"], &["--streams"]);
    for s in ["0", "-1", "nan"] {
        sim(&[&format!("--compute-scale={s}")], &["--compute-scale"]);
    }
    for flag in [
        "--host-gap-ms",
        "--background",
        "--traced-background",
        "--gpu-sharing",
        "--contention",
    ] {
        sim(&[&format!("{flag}=-1")], &[flag, "at or above 0"]);
    }
    // A negative number was "unexpected argument '-0'" (clap took it for a
    // flag); now the range check says what it wants.
    sim(&["--skew", "-0.5"], &["--skew -0.5", "[0, 1.9)"]);
    sim(
        &["--host-gap-ms", "-1"],
        &["--host-gap-ms", "at or above 0"],
    );
    sim(&["--rows-scale", "-1"], &["--rows-scale", "positive"]);
    // Times past 2^53 ns: the event loop never ended (10^8 ranks, a
    // compute scale of 10^300), or the step time wrapped around (a host gap
    // of 2·10^13 ms saturated to u64::MAX, then the makespan was added).
    sim(
        &["--ranks", "100000000", "--skew", "0"],
        &["--ranks", "at most"],
    );
    sim(&["--compute-scale", "1e300"], &["--compute-scale 1e300"]);
    sim(
        &["--host-gap-ms", "2e13"],
        &["--host-gap-ms 2e13", "at most"],
    );
    // A step start no task has cut no step: the whole trace was one
    // complete step.
    sim(
        &["--step-start", "nosuch"],
        &[
            "--step-start",
            "`nosuch`",
            "gpt2-124m-h100-affinity-step.json",
        ],
    );
    // A rank the trace lacks: the error names the file.
    sim(
        &["--rank", "1"],
        &["--trace", "no rank 1", "affinity-step.json"],
    );
    let dir = tempfile::tempdir().unwrap();
    let copy = dir.path().join("copy.json");
    std::fs::copy(trace, &copy).unwrap();
    let copy = copy.to_str().unwrap();
    let other = dir.path().join("other.json");
    std::fs::copy(trace, &other).unwrap();
    let other = other.to_str().unwrap();
    // --out naming an input overwrote it (and --measured was read after
    // it was written), by the same path or another spelling of it.
    for (flag, args) in [
        ("--trace", vec!["--trace", copy, "--out", copy]),
        (
            "--measured",
            vec!["--trace", copy, "--measured", other, "--out", other],
        ),
        (
            "--durations-from",
            vec!["--trace", copy, "--durations-from", other, "--out", other],
        ),
        (
            "--skew-from",
            vec!["--trace", copy, "--skew-from", other, "--out", other],
        ),
    ] {
        refused(SIMULATE, &args, &["--out", flag, "overwritten"]);
    }
    let dotted = format!("{}/../{}/copy.json", dir.path().display(), {
        dir.path().file_name().unwrap().to_str().unwrap()
    });
    refused(
        SIMULATE,
        &["--trace", copy, "--out", &dotted],
        &["--out", "--trace", "overwritten"],
    );
    let before = std::fs::metadata(copy).unwrap().len();
    assert_eq!(before, std::fs::metadata(trace).unwrap().len());
    // A directory, or one that does not exist: refused before simulating.
    let d = dir.path().to_str().unwrap();
    refused(
        SIMULATE,
        &["--trace", copy, "--out", d],
        &["--out", "directory"],
    );
    let missing = format!("{d}/no/such/dir/p.json");
    refused(
        SIMULATE,
        &["--trace", copy, "--out", &missing],
        &["--out", "no directory"],
    );
    // A machine file with a figure that means nothing.
    let m = dir.path().join("m.json");
    std::fs::write(
        &m,
        r#"{"name": "t", "backend": "gpu", "fabric": {"intra": {"gbps": 0, "latency_us": 1},
            "inter": null, "ranks_per_node": 8, "launch_us": 10, "tree_efficiency": 0.5,
            "local_gbps": 0}}"#,
    )
    .unwrap();
    sim(
        &["--machine-file", m.to_str().unwrap()],
        &["--machine-file", "m.json", "fabric.intra.gbps"],
    );
}

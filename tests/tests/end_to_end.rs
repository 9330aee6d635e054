//! The three crates together, as a user runs them: GPT-2 tasks on the engine,
//! trained data-parallel over CPU ranks whose gradient buckets travel through
//! the collectives, traced into one Chrome trace.

use braid::{BackendKind, Policy};
use braid_gpt2::checkpoint::AdamWHyper;
use braid_gpt2::config::Gpt2Config;
use braid_gpt2::data::{Split, TokenSource};
use braid_gpt2::trainer::{train, StartState, TrainOptions};
use serde_json::Value;

/// A GPT-2 small enough for a test but with the real BPE vocabulary, so it
/// trains on the built-in data as the main job does.
fn mini() -> Gpt2Config {
    Gpt2Config {
        max_seq_len: 32,
        vocab_size: 50257,
        num_layers: 1,
        num_heads: 2,
        channels: 32,
    }
}

#[test]
fn ddp_training_on_builtin_data_learns_and_traces_compute_and_comm() {
    let dir = std::env::temp_dir().join(format!("braid-e2e-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let trace = dir.join("trace.json");
    let opts = TrainOptions {
        model: mini(),
        batch_size: 2,
        seq_len: 32,
        steps: 8,
        backend: BackendKind::Cpu,
        ranks: 2,
        streams: 2,
        policy: Policy::Affinity,
        bucket_cap_bytes: 256 << 10,
        first_bucket_bytes: 64 << 10,
        trace: Some(trace.clone()),
        optimizer: AdamWHyper {
            learning_rate: 1e-2,
            ..AdamWHyper::default()
        },
        ..TrainOptions::default()
    };
    let data = TokenSource::builtin(Split::Train).unwrap();
    let report = train(&opts, StartState::fresh(&mini(), 7), &data, &|_| {}).unwrap();
    let losses: Vec<f32> = report.steps.iter().map(|s| s.loss).collect();
    assert_eq!(losses.len(), 8);
    assert!(
        losses[7] < losses[0] - 0.5,
        "the loss did not fall: {losses:?}"
    );
    assert!(
        report.param_hashes.windows(2).all(|w| w[0] == w[1]),
        "ranks diverged"
    );

    // One trace for both ranks: a process per rank, named tracks per stream,
    // all-reduces on the comm track and kernels on the compute tracks.
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    let events = doc["traceEvents"].as_array().unwrap();
    let mut tracks = std::collections::HashMap::new();
    for e in events.iter().filter(|e| e["name"] == "thread_name") {
        let key = (e["pid"].as_u64().unwrap(), e["tid"].as_u64().unwrap());
        tracks.insert(key, e["args"]["name"].as_str().unwrap().to_string());
    }
    for rank in 0..2u64 {
        let names: Vec<&String> = tracks
            .iter()
            .filter(|(k, _)| k.0 == rank)
            .map(|(_, v)| v)
            .collect();
        assert!(
            names.iter().any(|n| n.contains("compute")),
            "rank {rank}: {names:?}"
        );
        assert!(
            names.iter().any(|n| n.contains("comm")),
            "rank {rank}: {names:?}"
        );
    }
    let track_of =
        |e: &Value| tracks[&(e["pid"].as_u64().unwrap(), e["tid"].as_u64().unwrap())].clone();
    let spans: Vec<&Value> = events.iter().filter(|e| e["ph"] == "X").collect();
    let comm: Vec<&&Value> = spans.iter().filter(|e| e["cat"] == "comm").collect();
    assert!(!comm.is_empty(), "no collective in the trace");
    assert!(comm.iter().all(|e| track_of(e).contains("comm")));
    let compute = spans.iter().filter(|e| e["cat"] == "compute").count();
    assert!(compute > 100, "only {compute} compute spans");
    std::fs::remove_dir_all(&dir).unwrap();
}

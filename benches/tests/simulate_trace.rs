//! The step simulator on traces the engine wrote: the GPT-2 trainer (tiny
//! model, CPU ranks) writes a Chrome trace; the simulator reads it back, cuts
//! a step, recovers the gradient buckets' sizes and simulates it.

use braid::{BackendKind, Policy};
use braid_benches::simulate::{
    self, graph::StepChoice, machine::Machine, trace::Trace, SimConfig, SimPolicy, StepGraph,
};
use braid_gpt2::config::Gpt2Config;
use braid_gpt2::data::TokenSource;
use braid_gpt2::model::Rng;
use braid_gpt2::trainer::{train, StartState, TrainOptions};
use std::path::Path;
use std::process::Command;

fn data() -> TokenSource {
    let mut rng = Rng::new(7);
    let ids: Vec<u32> = (0..4096).map(|_| (rng.next_u64() % 512) as u32).collect();
    TokenSource::from_ids(&ids, "random ids").unwrap()
}

/// Trains the tiny model for 5 steps on `ranks` CPU ranks and returns the
/// trace and the parameter count.
fn traced_run(ranks: usize, reduce_single_rank: bool) -> (Trace, usize) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("trace.json");
    let params = train_to(&path, ranks, reduce_single_rank, 5);
    (Trace::read(&path).unwrap(), params)
}

/// Trains the tiny model for `steps` steps on `ranks` CPU ranks, writing
/// its trace to `path`; returns the parameter count.
fn train_to(path: &Path, ranks: usize, reduce_single_rank: bool, steps: u64) -> usize {
    let cfg = Gpt2Config::tiny();
    let opts = TrainOptions {
        model: cfg,
        batch_size: 2,
        seq_len: 16,
        steps,
        backend: BackendKind::Cpu,
        ranks,
        streams: 2,
        policy: Policy::Affinity,
        bucket_cap_bytes: 96 << 10,
        first_bucket_bytes: 32 << 10,
        trace: Some(path.to_path_buf()),
        reduce_single_rank,
        ..TrainOptions::default()
    };
    train(&opts, StartState::fresh(&cfg, 1), &data(), &|_| {}).unwrap();
    cfg.num_parameters()
}

/// Runs the simulator with `args`: (success, stdout, stderr).
fn simulate_cmd(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_simulate"))
        .args(args)
        .env_remove("RUST_BACKTRACE")
        .env_remove("RUST_LIB_BACKTRACE")
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// What the program cannot predict from a trace it says, before any
/// output: a rank skew the simulated ranks cannot show (under `single` every
/// collective brings them together: the factors saturated at ×1.95/×0.05
/// without a word), a rank missing from `--measured` (the error did not
/// name the file); and it warns of a trace with fewer than two complete
/// steps, whose final read-backs were taken for the step.
#[test]
fn the_program_refuses_or_notes_what_it_cannot_predict() {
    let dir = tempfile::tempdir().unwrap();
    let t1 = dir.path().join("t1.json");
    let t2 = dir.path().join("t2.json");
    let short = dir.path().join("short.json");
    train_to(&t1, 1, true, 5);
    train_to(&t2, 2, false, 5);
    train_to(&short, 1, true, 2);
    let (t1, t2, short) = (
        t1.to_str().unwrap(),
        t2.to_str().unwrap(),
        short.to_str().unwrap(),
    );
    let base = ["--trace", t1, "--ranks", "2", "--policy", "single"];
    let (ok, out, err) = simulate_cmd(&[&base[..], &["--skew", "0.5"]].concat());
    assert!(!ok && out.is_empty(), "{out}{err}");
    assert!(
        err.contains("--skew 0.5") && err.contains("cannot be reached"),
        "{err}"
    );
    // The machine's default: noted, and simulated in lock step.
    let (ok, out, err) = simulate_cmd(&base);
    assert!(ok, "{out}{err}");
    assert!(out.contains("note: the machine's rank skew"), "{out}");
    assert!(!out.contains("1.950"), "{out}");
    // A rank the measured trace lacks: the error names the file.
    let (ok, out, err) = simulate_cmd(&[
        "--trace",
        t2,
        "--rank",
        "1",
        "--ranks",
        "2",
        "--measured",
        t1,
    ]);
    assert!(!ok && out.is_empty(), "{out}{err}");
    assert!(
        err.contains("--measured") && err.contains("t1.json") && err.contains("no rank 1"),
        "{err}"
    );
    // Two steps: no segment repeats; warned, and the read-backs are not
    // the step.
    let (ok, out, err) = simulate_cmd(&["--trace", short, "--ranks", "2"]);
    assert!(ok, "{out}{err}");
    assert!(
        out.contains("warning: --trace") && out.contains("1 complete step"),
        "{out}"
    );
    let tr = Trace::read(Path::new(short)).unwrap();
    let g = StepGraph::from_trace(tr.rank(0).unwrap(), 1, StepChoice::Median, None).unwrap();
    assert!(g.nodes.iter().all(|n| n.name != "read back"));
    // Five steps: no warning.
    let (ok, out, err) = simulate_cmd(&["--trace", t1, "--ranks", "2"]);
    assert!(ok && !out.contains("warning"), "{out}{err}");
}

#[test]
fn a_two_rank_trace_gives_steps_buckets_and_a_prediction() {
    let (trace, params) = traced_run(2, false);
    assert_eq!(trace.ranks.len(), 2);
    let r = trace.rank(0).unwrap();
    assert_eq!(r.compute_streams(), 2);
    let steps = r.steps(None);
    // Steps 1 and 2 are eager (the buckets are rebuilt after the first), 3
    // to 5 replay one recording: at least three steps share one sequence.
    assert!(
        steps.iter().filter(|s| s.complete).count() >= 3,
        "{} steps, {} complete",
        steps.len(),
        steps.iter().filter(|s| s.complete).count()
    );
    let g = StepGraph::from_trace(r, trace.ranks.len(), StepChoice::Median, None).unwrap();
    for (i, n) in g.nodes.iter().enumerate() {
        assert!(
            n.preds.iter().all(|&p| p < i),
            "{} has a later predecessor",
            n.name
        );
    }
    // The buckets cover the gradient buffer exactly once: their `bytes`
    // (recorded by the engine) add up to four bytes per parameter.
    let buckets: Vec<_> = g
        .nodes
        .iter()
        .filter(|n| n.name.starts_with("all_reduce bucket"))
        .collect();
    assert!(buckets.len() > 1, "several buckets: {}", buckets.len());
    let total: u64 = buckets.iter().map(|n| n.bytes.unwrap()).sum();
    assert_eq!(total, 4 * params as u64);
    // The loss all-reduce is one f32.
    assert!(g
        .nodes
        .iter()
        .any(|n| n.name == "all_reduce" && n.bytes == Some(4)));
    // Simulated on the CPU machine at 2 and 8 ranks: more ranks, more
    // communication; the figures are the summary's.
    let mut m = Machine::builtin("cpu", 2).unwrap();
    // Lock step first (no rank skew): one simulated rank.
    m.rank_skew = 0.0;
    let cfg = |ranks| SimConfig {
        ranks,
        streams: 2,
        policy: SimPolicy::Affinity,
        compute_scale: 1.0,
        oversubscribe: false,
    };
    let (p2, run2) = simulate::predict(&g, &m, &cfg(2));
    let (p8, _) = simulate::predict(&g, &m, &cfg(8));
    assert!(p8.summary.comm_ns > p2.summary.comm_ns);
    assert_eq!(p2.makespan_ns, run2.makespan_ns);
    assert_eq!(p2.step_ns, p2.makespan_ns + g.host_gap_ns);
    let (len, path) = simulate::critical_path(&g, &run2);
    assert_eq!(len, p2.summary.critical_path_ns);
    assert_eq!(path.len(), p2.critical_path.len());
    assert!(len <= p2.makespan_ns);
    assert_eq!(p2.factors, vec![1.0]);
    // With rank skew two ranks run side by side: the fast one waits in the
    // collectives for the slow one, so its communication time is at least
    // the slow one's; the slowest rank's run is the one returned.
    m.rank_skew = 0.2;
    let (ps, runs) = simulate::predict_ranks(&g, &m, &cfg(2));
    assert_eq!((ps.factors.len(), runs.len()), (2, 2));
    assert!(ps.rank_summaries[1].comm_ns >= ps.rank_summaries[0].comm_ns);
    assert_eq!(ps.summary.comm_ns, ps.rank_summaries[0].comm_ns);
    assert!((0.0..=1.0).contains(&ps.hidden_share()));
    for (i, n) in g
        .nodes
        .iter()
        .enumerate()
        .filter(|(_, n)| n.collective.is_some())
    {
        // A collective ends on both ranks at once, and not before either
        // rank arrived.
        assert_eq!(
            runs[0].tasks[i].end_ns, runs[1].tasks[i].end_ns,
            "{}",
            n.name
        );
        let last_arrival = runs[0].tasks[i].start_ns.max(runs[1].tasks[i].start_ns);
        assert!(runs[0].tasks[i].end_ns >= last_arrival, "{}", n.name);
    }
    // The predicted ranks, written as a trace and measured like a real
    // one, show the skew asked for.
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("skewed.json");
    let profs: Vec<_> = runs
        .iter()
        .enumerate()
        .map(|(j, r)| simulate::profile_of_rank(&g, r, j))
        .collect();
    braid::trace::write_chrome_trace(&out, &profs.iter().collect::<Vec<_>>()).unwrap();
    let back = simulate::skew::measure(&Trace::read(&out).unwrap(), None).unwrap();
    assert_eq!((back.ranks, back.steps.len()), (2, 1));
    assert!(
        (back.fitted_skew() - 0.2).abs() < 0.005,
        "{}",
        back.fitted_skew()
    );
    // The measured skew: every complete step on both ranks; each
    // collective starts after its inputs are ready on each rank and ends
    // after the last rank arrived (it moves data only then).
    let sk = simulate::skew::measure(&trace, None).unwrap();
    assert_eq!(sk.ranks, 2);
    assert_eq!(sk.steps.len(), steps.iter().filter(|s| s.complete).count());
    for s in &sk.steps {
        assert!(s.collectives.len() > 1);
        for c in &s.collectives {
            for r in 0..2 {
                assert!(c.ready_ns[r] <= c.start_ns[r], "{}", c.name);
                assert!(c.end_ns[r] >= c.group_start_ns(), "{}", c.name);
            }
        }
    }
    assert!((0.0..2.0).contains(&sk.fitted_skew()));
    assert!((0.0..=1.0).contains(&sk.steps_hidden_share()));
    // The predicted trace reads back as a trace with the same tasks.
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("predicted.json");
    braid::trace::write_chrome_trace(&out, &[&simulate::profile(&g, &run2)]).unwrap();
    let back = Trace::read(&out).unwrap();
    assert_eq!(back.ranks[0].tasks.len(), g.nodes.len());
}

#[test]
fn a_one_rank_trace_keeps_its_buckets_with_reduce_single_rank() {
    let (with, params) = traced_run(1, true);
    let g = StepGraph::from_trace(with.rank(0).unwrap(), 1, StepChoice::Median, None).unwrap();
    let total: u64 = g
        .nodes
        .iter()
        .filter(|n| n.name.starts_with("all_reduce bucket"))
        .map(|n| n.bytes.unwrap())
        .sum();
    assert_eq!(total, 4 * params as u64);
    let (without, _) = traced_run(1, false);
    let g = StepGraph::from_trace(without.rank(0).unwrap(), 1, StepChoice::Median, None).unwrap();
    assert!(g.nodes.iter().all(|n| n.collective.is_none()));
}

//! Data-parallel training on CPU ranks (threads with their own runtimes and a
//! `LocalComm`): W ranks reproduce one rank on the combined batch, a resumed
//! run is bit-identical, and the trace shows gradient all-reduces running
//! under the backward pass.

use braid::comm::cap::CAP_CANDIDATES;
use braid::trace::Profile;
use braid::{BackendKind, Policy};
use braid_gpt2::checkpoint::load_checkpoint;
use braid_gpt2::config::Gpt2Config;
use braid_gpt2::data::TokenSource;
use braid_gpt2::kernels::cpu::Dtype;
use braid_gpt2::model::Rng;
use braid_gpt2::trainer::{train, CapReport, StartState, TrainOptions, TrainReport};

/// Learnable tokens below the tiny vocabulary: runs of consecutive ids from
/// random starting points.
fn data() -> TokenSource {
    let mut rng = Rng::new(99);
    let mut ids = Vec::new();
    while ids.len() < 4096 {
        let start = (rng.next_u64() % 512) as u32;
        ids.extend((0..12).map(|i| (start + i) % 512));
    }
    TokenSource::from_ids(&ids, "counting runs").unwrap()
}

fn options(ranks: usize, batch_size: usize, steps: u64) -> TrainOptions {
    TrainOptions {
        model: Gpt2Config::tiny(),
        batch_size,
        seq_len: 16,
        steps,
        backend: BackendKind::Cpu,
        ranks,
        streams: 2,
        policy: Policy::Affinity,
        // Several buckets even for the tiny model.
        bucket_cap_bytes: 96 << 10,
        first_bucket_bytes: 32 << 10,
        ..TrainOptions::default()
    }
}

fn run(opts: &TrainOptions, start: StartState) -> TrainReport {
    train(opts, start, &data(), &|_| {}).unwrap()
}

fn losses(r: &TrainReport) -> Vec<f32> {
    r.steps.iter().map(|s| s.loss).collect()
}

#[test]
fn two_and_four_ranks_reproduce_one_rank_on_the_combined_batch() {
    let steps = 3;
    let start = StartState::fresh(&Gpt2Config::tiny(), 5);
    let single = run(&options(1, 4, steps), start.clone());
    let l1 = losses(&single);
    assert!(l1.iter().all(|l| l.is_finite() && *l > 1.0), "{l1:?}");
    // With the tied gradient's writers reduced on their own (the default)
    // and as one gradient.
    for (ranks, split) in [(2, true), (4, true), (2, false), (4, false)] {
        let mut opts = options(ranks, 4 / ranks, steps);
        opts.tied_split = split;
        let r = run(&opts, start.clone());
        assert_eq!((r.ranks, r.tied_split), (ranks, split));
        assert_matches_single(&r, &single, &format!("{ranks} ranks (split {split})"));
    }
}

/// Mixed precision (bf16 storage and buckets, `f32` master weights): 2 and
/// 4 ranks follow 1 rank on the combined batch with the tied gradient split
/// (its token rows exchanged and added in bf16) as closely as without the
/// split, within bf16 tolerance; every rank ends with the same parameters.
#[test]
fn bf16_ranks_reproduce_one_rank_with_and_without_the_tied_split() {
    let steps = 3;
    let start = StartState::fresh(&Gpt2Config::tiny(), 5);
    let bf16 = |mut o: TrainOptions| {
        o.dtype = Dtype::Bf16;
        o
    };
    let single = run(&bf16(options(1, 4, steps)), start.clone());
    let l1 = losses(&single);
    for ranks in [2, 4] {
        let mut worst = [0f32; 2];
        for (i, split) in [true, false].into_iter().enumerate() {
            let mut opts = bf16(options(ranks, 4 / ranks, steps));
            opts.tied_split = split;
            let r = run(&opts, start.clone());
            let label = format!("bf16, {ranks} ranks (split {split})");
            assert!(
                r.param_hashes.iter().all(|&h| h == r.param_hashes[0]),
                "{label}: the ranks ended with different parameters"
            );
            for (step, (a, b)) in losses(&r).iter().zip(&l1).enumerate() {
                // bf16 gradients averaged in another grouping: a few
                // roundings of 2^-8 apart, damped by the small steps.
                assert!(
                    (a - b).abs() <= 2e-3 * b.abs(),
                    "{label}, step {}: loss {a} vs single rank {b}",
                    step + 1
                );
            }
            worst[i] = r
                .params
                .iter()
                .zip(&single.params)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max);
            eprintln!("{label}: largest parameter difference {}", worst[i]);
        }
        // Adam's steps are at most lr (1e-3 here) each: the split stays
        // within the unsplit run's distance from the single rank, plus a
        // step's worth.
        assert!(
            worst[0] <= worst[1] + 1e-3,
            "bf16, {ranks} ranks: split {} vs unsplit {}",
            worst[0],
            worst[1]
        );
    }
}

/// `r` (W ranks) follows `single` (1 rank on the combined batch): the same
/// parameters on every rank, losses within 1e-5 relative, parameters within
/// float tolerance.
fn assert_matches_single(r: &TrainReport, single: &TrainReport, label: &str) {
    assert!(
        r.param_hashes.iter().all(|&h| h == r.param_hashes[0]),
        "{label}: the ranks ended with different parameters"
    );
    assert_eq!(r.steps.len(), single.steps.len(), "{label}");
    for (i, (a, b)) in losses(r).iter().zip(&losses(single)).enumerate() {
        assert!(
            (a - b).abs() <= 1e-5 * b.abs(),
            "{label}, step {}: loss {a} vs single rank {b}",
            i + 1
        );
    }
    // Parameters: float tolerance. Adam divides each step by the
    // gradient's own magnitude, so where a gradient is rounding noise
    // (e.g. the attention key bias, whose true gradient is 0) the step
    // itself is noise, bounded by lr per step.
    let lr = r.steps.len() as f32 * 1e-3;
    let (mut tight, mut total) = (0usize, 0usize);
    assert_eq!(r.params.len(), single.params.len(), "{label}");
    for (i, (a, b)) in r.params.iter().zip(&single.params).enumerate() {
        let err = (a - b).abs();
        assert!(err <= 2.0 * lr, "{label}: param {i}: {a} vs {b}");
        total += 1;
        if err <= 1e-6 + 1e-4 * b.abs() {
            tight += 1;
        }
    }
    assert!(
        tight as f64 >= 0.99 * total as f64,
        "{label}: only {tight} of {total} parameters within 1e-4 relative"
    );
}

/// `TrainOptions::auto_bucket_cap` on 2 ranks: the cap rank 0 chose after
/// step 1 (reported) only regroups the buckets, so the run follows the same
/// run with a fixed cap within the tolerance above — plain, ZeRO-1, and
/// without the tied split; with 1 rank there is nothing to choose.
#[test]
fn auto_bucket_cap_follows_a_fixed_cap_and_is_reported() {
    let start = StartState::fresh(&Gpt2Config::tiny(), 13);
    for (zero, split) in [(0, true), (1, true), (0, false)] {
        let label = format!("zero {zero}, split {split}");
        let mut fixed = options(2, 2, 5);
        (fixed.zero, fixed.tied_split) = (zero, split);
        let mut auto = fixed.clone();
        auto.auto_bucket_cap = true;
        let (f, a) = (run(&fixed, start.clone()), run(&auto, start.clone()));
        assert_eq!(f.bucket_cap, None, "{label}: a fixed cap reports no choice");
        match &a.bucket_cap {
            Some(CapReport::Chosen(c)) => {
                assert!(
                    CAP_CANDIDATES.contains(&c.chosen.cap_bytes),
                    "{label}: {c:?}"
                );
                assert!(c.all.iter().all(|p| p.exposed_ns >= c.chosen.exposed_ns));
                assert!(c.samples >= 1, "{label}: {c:?}");
            }
            other => panic!("{label}: {other:?}"),
        }
        assert!(a.steps.iter().skip(3).all(|s| s.replayed), "{label}");
        assert_matches_single(&a, &f, &label);
    }
    let mut one = options(1, 4, 2);
    one.auto_bucket_cap = true;
    assert_eq!(run(&one, start).bucket_cap, None);
}

/// Steps 3 onwards replay the recorded third step (reducer buckets, the loss
/// all-reduce, the gradient norm and the AdamW update included): the run is
/// bit-identical to an eager one.
#[test]
fn replayed_steps_equal_eager_steps_bit_for_bit() {
    let start = StartState::fresh(&Gpt2Config::tiny(), 11);
    // bf16 (mixed AdamW reading its step scalars from the buffer) at 1 rank.
    for (ranks, dtype) in [(1, Dtype::F32), (2, Dtype::F32), (1, Dtype::Bf16)] {
        let mut eager = options(ranks, 4 / ranks, 6);
        (eager.replay, eager.dtype) = (false, dtype);
        let mut replayed = options(ranks, 4 / ranks, 6);
        replayed.dtype = dtype;
        assert!(replayed.replay, "replay is the default");
        let (a, b) = (run(&eager, start.clone()), run(&replayed, start.clone()));
        assert_eq!(losses(&a), losses(&b), "{ranks} ranks {dtype:?}");
        assert_eq!(a.param_hashes, b.param_hashes, "{ranks} ranks {dtype:?}");
        assert_eq!(a.params, b.params, "{ranks} ranks {dtype:?}");
        let replayed = |r: &TrainReport| r.steps.iter().map(|s| s.replayed).collect::<Vec<_>>();
        assert_eq!(replayed(&a), [false; 6]);
        assert_eq!(replayed(&b), [false, false, false, true, true, true]);
        // (Besides, with several ranks, the replaying run's agreement on
        // the schedule's placement, once.)
        let agreement = |r: &TrainReport| {
            let spans = &r.profiles[0].spans;
            spans
                .iter()
                .filter(|s| s.name == braid::comm::AGREEMENT_TASK)
                .count()
        };
        let tasks = |r: &TrainReport| r.profiles[0].spans.len() - agreement(r);
        assert_eq!(tasks(&a), tasks(&b), "the same tasks ran, {ranks} ranks");
        assert_eq!(agreement(&a), 0);
        // Two collectives, each with its upload and its read-back.
        assert_eq!(
            agreement(&b),
            if ranks > 1 { 6 } else { 0 },
            "{ranks} ranks"
        );
        // Among them, before each step, the upload of AdamW's step scalars,
        // which the update (in the schedule, when replaying) reads.
        let scalars = |r: &TrainReport| {
            let spans = &r.profiles[0].spans;
            spans
                .iter()
                .filter(|s| s.name == "adamw step scalars")
                .count()
        };
        assert_eq!((scalars(&a), scalars(&b)), (6, 6), "{ranks} ranks");
    }
}

/// Eager steps that automatic replay memoises (`--no-replay` turns it off;
/// a placement file turns it back on) are bit-identical to eager ones:
/// steps 2–4 are alike, step 5 is recorded, steps 6 and 7 are submitted from
/// its analysis, collectives and the AdamW scalars' upload included.
#[test]
fn memoised_eager_steps_equal_eager_steps_bit_for_bit() {
    let start = StartState::fresh(&Gpt2Config::tiny(), 13);
    let auto_on = braid::PlacementFile::parse("[runtime]\nauto_replay = true\n", "test").unwrap();
    for ranks in [1, 2] {
        let mut eager = options(ranks, 4 / ranks, 7);
        eager.replay = false;
        let mut memoised = eager.clone();
        memoised.placement = Some(auto_on.clone());
        let (a, b) = (run(&eager, start.clone()), run(&memoised, start.clone()));
        assert_eq!(losses(&a), losses(&b), "{ranks} ranks");
        assert_eq!(a.params, b.params, "{ranks} ranks");
        let count = |r: &TrainReport| {
            r.profiles[0]
                .spans
                .iter()
                .filter(|s| s.placement.reason == braid::PlaceReason::Memoised)
                .count()
        };
        // Two steps' tasks (the first step's count differs a little from
        // the others', so the mean is within a task per step of theirs).
        let mean = a.profiles[0].spans.len() as f64 / 7.0;
        let (n, expect) = (count(&b), 2.0 * mean);
        assert_eq!(count(&a), 0, "{ranks} ranks");
        assert!(
            n % 2 == 0 && (n as f64 - expect).abs() <= 2.0,
            "{ranks} ranks: {n} memoised, {mean} tasks a step"
        );
    }
}

/// With graphs on, the replayed steps of one rank run as one unit each (on
/// the CPU, every task in order on one stream thread): bit-identical to
/// eager steps. Two ranks' step has collectives: it is cut around them (each
/// run of other tasks one unit, the collectives ordinary tasks between them),
/// still identical; with `graph_collectives` they go into the graphs
/// instead (fewer tasks between graphs), still identical.
#[test]
fn graph_replayed_steps_equal_eager_steps_bit_for_bit() {
    let start = StartState::fresh(&Gpt2Config::tiny(), 12);
    let mut cut_shape = None;
    for (ranks, dtype, collectives, zero) in [
        (1, Dtype::F32, false, 0),
        (1, Dtype::Bf16, false, 0),
        (2, Dtype::F32, false, 0),
        (2, Dtype::F32, true, 0),
        // ZeRO-1's reduce-scatters and all-gathers inside the graphs.
        (2, Dtype::F32, true, 1),
    ] {
        let case =
            format!("{ranks} ranks {dtype:?}, collectives in graphs: {collectives}, zero {zero}");
        let mut eager = options(ranks, 4 / ranks, 5);
        (eager.replay, eager.dtype, eager.zero) = (false, dtype, zero);
        let mut graphs = options(ranks, 4 / ranks, 5);
        (graphs.graphs, graphs.dtype, graphs.zero) = (true, dtype, zero);
        graphs.graph_collectives = collectives;
        let (a, b) = (run(&eager, start.clone()), run(&graphs, start.clone()));
        assert_eq!(losses(&a), losses(&b), "{case}");
        assert_eq!(a.params, b.params, "{case}");
        // Steps 4 and 5 replay the step recorded at step 3, on every rank.
        assert_eq!(b.graph_replays, vec![2; ranks], "{case}");
        assert_eq!(b.graph_refusal, None);
        assert_eq!(b.zero, zero == 1, "{case}");
        let (graphs, between) = b.graph_shape.expect("a graph shape");
        match (ranks, collectives) {
            (2, false) => cut_shape = Some((graphs, between)),
            (2, true) if zero == 0 => {
                let (cut_graphs, cut_between) = cut_shape.expect("the cut run first");
                assert!(
                    graphs <= cut_graphs && between < cut_between,
                    "{case}: {graphs} graphs with {between} tasks between them, against \
                     {cut_graphs} with {cut_between} when cut around the collectives"
                );
            }
            _ => {}
        }
    }
}

#[test]
fn a_resumed_run_continues_bit_identically() {
    let dir = tempfile::tempdir().unwrap();
    let start = StartState::fresh(&Gpt2Config::tiny(), 8);
    let straight = run(&options(2, 2, 4), start.clone());

    let mut first = options(2, 2, 2);
    first.checkpoint_dir = Some(dir.path().join("ckpt"));
    let half = run(&first, start);
    assert_eq!(half.final_step, 2);
    let ckpt = load_checkpoint(dir.path().join("ckpt")).unwrap();
    assert_eq!(ckpt.step, 2);
    assert_eq!(ckpt.params, half.params);

    let rest = run(&options(2, 2, 4), StartState::from_checkpoint(ckpt));
    assert_eq!(
        rest.steps.iter().map(|s| s.step).collect::<Vec<_>>(),
        [3, 4]
    );
    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&losses(&rest)), bits(&losses(&straight)[2..]));
    assert_eq!(
        bits(&rest.params),
        bits(&straight.params),
        "final parameters"
    );
}

/// Spans of one rank whose name contains `pat`.
fn spans<'a>(p: &'a Profile, pat: &'a str) -> impl Iterator<Item = &'a braid::trace::Span> + 'a {
    p.spans.iter().filter(move |s| s.name.contains(pat))
}

/// Per step of a profile (steps begin at their `encoder forward` task, in
/// submission order): the earliest start of a bucket all-reduce and the
/// latest end of a backward task.
fn per_step(p: &Profile) -> Vec<(u64, u64)> {
    let mut by_id: Vec<&braid::trace::Span> = p.spans.iter().collect();
    by_id.sort_by_key(|s| s.id);
    let mut steps: Vec<(u64, u64)> = Vec::new();
    for s in by_id {
        if s.name == "encoder forward" {
            steps.push((u64::MAX, 0));
        }
        let Some(step) = steps.last_mut() else {
            continue;
        };
        if s.name.starts_with("all_reduce bucket") {
            step.0 = step.0.min(s.start_ns);
        }
        if s.name.contains("backward") {
            step.1 = step.1.max(s.end_ns);
        }
    }
    steps
}

/// Per step (steps begin at their `encoder forward` task): the start of
/// the all-reduce of the bucket holding `wte` and the end of the step's
/// last backward task. From the second step on the buckets are issued in
/// the order their gradients are ready, so `wte`'s is the first (split: its
/// classifier part is ready first) or the last (whole: ready last).
fn tied_bucket_per_step(p: &Profile, split: bool) -> Vec<(u64, u64)> {
    let mut by_id: Vec<&braid::trace::Span> = p.spans.iter().collect();
    by_id.sort_by_key(|s| s.id);
    let mut steps: Vec<(Option<u64>, u64)> = Vec::new();
    for s in by_id {
        if s.name == "encoder forward" {
            steps.push((None, 0));
        }
        let Some(step) = steps.last_mut() else {
            continue;
        };
        if s.name.starts_with("all_reduce bucket") && (!split || step.0.is_none()) {
            step.0 = Some(s.start_ns);
        }
        if s.name.contains("backward") {
            step.1 = step.1.max(s.end_ns);
        }
    }
    steps
        .into_iter()
        .map(|(a, b)| (a.unwrap_or(u64::MAX), b))
        .collect()
}

/// The point of the split: `wte`'s all-reduce runs during the backward pass
/// (it may start once the classifier's part is written, the first backward
/// task), where as one gradient it cannot start before the encoder's
/// backward, the last task.
#[test]
fn the_tied_gradient_is_reduced_during_the_backward_pass() {
    let cfg = Gpt2Config {
        num_layers: 4,
        ..Gpt2Config::tiny()
    };
    for (split, dtype) in [
        (true, Dtype::F32),
        (true, Dtype::Bf16),
        (false, Dtype::F32),
        (false, Dtype::Bf16),
    ] {
        // B4 × T64: a backward pass of several ms even in a release build,
        // longer than an oversubscribed 2-core machine takes to give the comm
        // thread a core (at B2 × T32 the whole backward pass took 1.5 ms and
        // the comm threads of both ranks often ran only after it).
        let mut opts = options(2, 4, 7);
        opts.model = cfg;
        opts.seq_len = 64;
        opts.tied_split = split;
        opts.dtype = dtype;
        let r = run(&opts, StartState::fresh(&cfg, 3));
        for p in &r.profiles {
            // After the first step the buckets follow the ready order.
            let steps = &tied_bucket_per_step(p, split)[1..];
            eprintln!(
                "split {split}, {dtype:?}, rank {}: wte all-reduce start minus last backward end: {:?} µs",
                p.rank,
                steps
                    .iter()
                    .map(|&(a, b)| (a as i64 - b as i64) / 1000)
                    .collect::<Vec<_>>()
            );
            if split {
                // One step of six is enough (the comm thread may not be
                // scheduled in time on a busy machine).
                assert!(
                    steps.iter().any(|&(start, end)| start < end),
                    "rank {}: the tied bucket never started before the backward pass ended: {steps:?}",
                    p.rank
                );
            } else {
                assert!(
                    steps.iter().all(|&(start, end)| start >= end),
                    "rank {}: without the split the tied bucket must wait for the encoder: {steps:?}",
                    p.rank
                );
            }
        }
    }
}

#[test]
fn gradient_all_reduces_start_before_the_backward_pass_ends() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("trace.json");
    // Four layers, so that much of the backward pass remains after the first
    // bucket (the final layer norm and the last layer's bias) is ready.
    let cfg = Gpt2Config {
        num_layers: 4,
        ..Gpt2Config::tiny()
    };
    let steps = 3;
    // B4 × T64, as in the test above: long enough in a release build.
    let mut opts = options(2, 4, steps);
    opts.model = cfg;
    opts.seq_len = 64;
    opts.trace = Some(trace.clone());
    let r = run(&opts, StartState::fresh(&cfg, 3));
    assert_eq!(r.profiles.len(), 2);
    for p in &r.profiles {
        let per_step = per_step(p);
        assert_eq!(per_step.len(), steps as usize);
        assert!(per_step.iter().all(|&(a, b)| a < u64::MAX && b > 0));
        eprintln!(
            "rank {}: per step, first bucket all-reduce start minus last backward end: {:?} µs",
            p.rank,
            per_step
                .iter()
                .map(|&(a, b)| (a as i64 - b as i64) / 1000)
                .collect::<Vec<_>>()
        );
        // The all-reduce may start only once its bucket's gradients are
        // written, which is long before the backward pass ends; a step where
        // the comm stream's thread was not scheduled in time does not count
        // against it (the machine may be busy), so one step of three must
        // show it.
        assert!(
            per_step
                .iter()
                .any(|&(first_bucket, last_backward)| first_bucket < last_backward),
            "rank {}: in no step did a bucket all-reduce start before the backward pass \
             ended: {per_step:?}",
            p.rank
        );
        // Collectives ran on the comm stream, kernels on compute streams.
        for s in spans(p, "all_reduce") {
            assert!(p.streams[s.stream].is_comm && p.streams[s.stream].name.contains("comm"));
        }
        for s in spans(p, "backward") {
            assert!(p.streams[s.stream].name.contains("compute"));
        }
    }
    assert!(r.summaries.iter().all(|s| s.comm_ns > 0));
    // The summaries cover the steps after the first, as the mean step time
    // does (two of the three here); `whole_run` the first step too.
    assert_eq!(r.whole_run.len(), r.summaries.len());
    for (steady, whole) in r.summaries.iter().zip(&r.whole_run) {
        assert!(
            whole.tasks > steady.tasks && 2 * steady.tasks >= whole.tasks,
            "{} tasks in steps 2-3, {} in the run",
            steady.tasks,
            whole.tasks
        );
        assert!(steady.comm_ns < whole.comm_ns);
    }
    // One trace, one process per rank, named stream tracks.
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    let events = json["traceEvents"].as_array().unwrap();
    let pids: std::collections::BTreeSet<u64> =
        events.iter().filter_map(|e| e["pid"].as_u64()).collect();
    assert_eq!(pids.into_iter().collect::<Vec<_>>(), [0, 1]);
    let tracks: Vec<&str> = events
        .iter()
        .filter(|e| e["name"] == "thread_name")
        .filter_map(|e| e["args"]["name"].as_str())
        .collect();
    assert!(tracks.contains(&"comm 0") && tracks.contains(&"compute 1"));
}

/// `on_step` comes after each step, in order, before rank 0 goes on: a
/// stop flag set in it stops the run at that step with one rank, at that
/// step or the next with two.
#[test]
fn a_stop_set_in_the_step_callback_stops_at_that_step() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};
    for ranks in [1, 2] {
        let stop = Arc::new(AtomicBool::new(false));
        let opts = TrainOptions {
            stop: Some(stop.clone()),
            ..options(ranks, 1, 200)
        };
        let seen = Mutex::new(Vec::new());
        let r = train(&opts, StartState::fresh(&opts.model, 1), &data(), &|s| {
            seen.lock().unwrap().push(s.step);
            if s.step == 3 {
                stop.store(true, Ordering::SeqCst);
            }
        })
        .unwrap();
        let last = if ranks == 1 { 3 } else { 4 };
        assert!(
            (3..=last).contains(&r.final_step),
            "{ranks} ranks: {}",
            r.final_step
        );
        let seen = seen.into_inner().unwrap();
        assert_eq!(
            seen,
            (1..=r.final_step).collect::<Vec<_>>(),
            "{ranks} ranks"
        );
    }
    // Stopped in its first step (one rank): nothing after it to measure, so
    // its summary is of the whole run, as a one-step run's (it was of an
    // empty profile: 0 tasks).
    let stop = Arc::new(AtomicBool::new(true));
    let opts = TrainOptions {
        stop: Some(stop),
        ..options(1, 1, 200)
    };
    let r = train(&opts, StartState::fresh(&opts.model, 1), &data(), &|_| {}).unwrap();
    assert_eq!(r.final_step, 1);
    assert!(r.summaries[0].tasks > 0, "{:?}", r.summaries[0]);
    assert_eq!(r.summaries[0].tasks, r.whole_run[0].tasks);
}

/// A panic in `on_step` stops the ranks at a step's end before it reaches
/// the caller: nothing trains on (or saves) after `train` has returned.
#[test]
fn a_panicking_step_callback_stops_the_ranks_before_it_returns() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    let opts = TrainOptions {
        checkpoint_dir: Some(ckpt.clone()),
        ..options(2, 1, 200)
    };
    let start = StartState::fresh(&opts.model, 1);
    let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        train(&opts, start, &data(), &|s| {
            assert!(
                s.step != 2,
                "the caller's callback fails at step {}",
                s.step
            );
        })
    }));
    let msg = out.unwrap_err();
    assert_eq!(
        msg.downcast_ref::<String>().map(String::as_str),
        Some("the caller's callback fails at step 2")
    );
    // The stopped run saved, at step 2 or 3, before the panic came out.
    let saved = std::fs::read(braid_gpt2::checkpoint::checkpoint_file(&ckpt)).unwrap();
    let step = load_checkpoint(&ckpt).unwrap().step;
    assert!((2..=3).contains(&step), "{step}");
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert_eq!(
        std::fs::read(braid_gpt2::checkpoint::checkpoint_file(&ckpt)).unwrap(),
        saved,
        "nothing saved after train returned"
    );
}

/// A start state of another model is refused even with as many parameters
/// (a checkpoint of the tiny model's 4 heads, options of 2); an unusable
/// checkpoint directory, an interval without a directory and a zero
/// timeout are refused before the first step.
#[test]
fn starts_and_outputs_that_cannot_be_used_are_refused_first() {
    let two_heads = Gpt2Config {
        num_heads: 2,
        ..Gpt2Config::tiny()
    };
    assert_eq!(
        two_heads.num_parameters(),
        Gpt2Config::tiny().num_parameters()
    );
    let opts = TrainOptions {
        model: two_heads,
        ..options(1, 1, 2)
    };
    let e = train(
        &opts,
        StartState::fresh(&Gpt2Config::tiny(), 1),
        &data(),
        &|_| {},
    )
    .unwrap_err();
    assert!(e.to_string().contains("invalid start state"), "{e}");
    assert!(e.to_string().contains("4 heads"), "{e}");
    assert!(StartState::try_fresh(
        &Gpt2Config {
            num_heads: 3,
            ..two_heads
        },
        1
    )
    .is_err());

    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("a_file");
    std::fs::write(&file, b"x").unwrap();
    let called = std::sync::atomic::AtomicBool::new(false);
    for (opts, why) in [
        (
            TrainOptions {
                checkpoint_dir: Some(file.clone()),
                ..options(1, 1, 2)
            },
            "not a directory",
        ),
        (
            TrainOptions {
                checkpoint_every: Some(1),
                ..options(1, 1, 2)
            },
            "no checkpoint directory",
        ),
        (
            TrainOptions {
                comm_timeout: std::time::Duration::ZERO,
                ..options(2, 1, 2)
            },
            "collective timeout",
        ),
    ] {
        let e = train(&opts, StartState::fresh(&opts.model, 1), &data(), &|_| {
            called.store(true, std::sync::atomic::Ordering::SeqCst)
        })
        .unwrap_err();
        assert!(e.to_string().contains(why), "{e}");
    }
    assert!(!called.into_inner(), "refused only after a step");
}

#[test]
fn a_failing_rank_reports_its_own_error() {
    // Four ranks need 4 × 2 × 16 + 1 tokens per step; these are too few.
    let short = TokenSource::from_ids(&[1; 100], "short").unwrap();
    let err = train(
        &options(4, 2, 1),
        StartState::fresh(&Gpt2Config::tiny(), 1),
        &short,
        &|_| {},
    )
    .unwrap_err();
    assert!(err.to_string().contains("too few"), "{err}");
}

/// Every rank waits for rank 0's checkpoint write in the checkpoint's
/// scope (a barrier after each save), which the summaries leave out, not
/// in the next step's first collective; the losses are those of a run
/// without checkpoints.
#[test]
fn ranks_wait_for_a_checkpoint_write_in_its_scope() {
    let dir = tempfile::tempdir().unwrap();
    let plain = options(2, 2, 4);
    let opts = TrainOptions {
        checkpoint_dir: Some(dir.path().join("ckpt")),
        checkpoint_every: Some(2),
        ..plain.clone()
    };
    let start = || StartState::fresh(&Gpt2Config::tiny(), 3);
    let saved = run(&opts, start());
    assert_eq!(losses(&saved), losses(&run(&plain, start())));
    for p in &saved.profiles {
        let barriers = p
            .spans
            .iter()
            .filter(|s| s.kind == braid::TaskKind::Comm && s.name.contains("barrier"))
            .map(|s| s.scope.as_deref())
            .collect::<Vec<_>>();
        // Saved at step 2 and at the end.
        assert_eq!(barriers, [Some("checkpoint"); 2], "rank {}", p.rank);
    }
}

/// A rank that panics in the middle of a step (a task at its start that the
/// step's gradient work depends on) stops every rank: the others' collectives fail
/// (the failed rank's skipped collectives poison the communicator, or the
/// timeout ends them), `train` returns the failing rank's own error well
/// within the timeout, and the last checkpoint saved before the failure is
/// intact (with ZeRO-1: gathered from the shards). Eager, and in a replayed
/// step; with and without ZeRO-1.
#[test]
fn a_rank_that_panics_mid_step_stops_every_rank_and_keeps_the_last_checkpoint() {
    for zero in [0, 1] {
        for (replay, fault_step) in [(false, 4), (true, 5)] {
            let case = format!("zero {zero}, replay {replay}");
            let timeout = std::time::Duration::from_secs(20);
            let (err, took, ckpt) = train_with_fault(replay, zero, fault_step, false, timeout);
            assert!(err.contains("injected fault"), "{case}: {err}");
            assert!(
                took < timeout,
                "{case}: stopping took {took:?}, more than the collective timeout"
            );
            // Checkpoints every 2 steps: the last one is the last even step
            // that completed before the fault, whole.
            assert_eq!(ckpt.step, (fault_step - 1) / 2 * 2, "{case}");
            let n = Gpt2Config::tiny().num_parameters();
            assert_eq!(
                (ckpt.params.len(), ckpt.adam_m.len(), ckpt.adam_v.len()),
                (n, n, n),
                "{case}"
            );
            assert!(ckpt
                .params
                .iter()
                .chain(&ckpt.adam_v)
                .all(|p| p.is_finite()));
            assert!(ckpt.adam_v.iter().all(|&v| v >= 0.0), "{case}");
        }
    }
}

/// Trains 2 ranks for 8 steps, checkpointing every 2, with rank 1 failing
/// (panicking, or with `hang` stuck) at `fault_step`; returns `train`'s error,
/// how long it took to return, and the last checkpoint.
fn train_with_fault(
    replay: bool,
    zero: u8,
    fault_step: u64,
    hang: bool,
    timeout: std::time::Duration,
) -> (
    String,
    std::time::Duration,
    braid_gpt2::checkpoint::Checkpoint,
) {
    let dir = tempfile::tempdir().unwrap();
    let mut opts = options(2, 2, 8);
    opts.replay = replay;
    opts.zero = zero;
    opts.checkpoint_dir = Some(dir.path().join("ckpt"));
    opts.checkpoint_every = Some(2);
    opts.comm_timeout = timeout;
    opts.fault = Some(braid_gpt2::trainer::Fault {
        rank: 1,
        step: fault_step,
        hang,
    });
    let t0 = std::time::Instant::now();
    let err = train(
        &opts,
        StartState::fresh(&Gpt2Config::tiny(), 9),
        &data(),
        &|_| {},
    )
    .unwrap_err()
    .to_string();
    let took = t0.elapsed();
    (err, took, load_checkpoint(dir.path().join("ckpt")).unwrap())
}

/// A rank whose task never returns (stuck in the middle of a step) cannot
/// be joined: the other rank's collective times out naming the collective,
/// `train` returns that error within two collective timeouts (the timeout,
/// then the grace period for the stuck rank, which is abandoned), and the
/// last checkpoint saved before the fault is intact. Eager, and in a replayed
/// step; with ZeRO-1 too.
#[test]
fn a_rank_stuck_mid_step_fails_the_job_within_the_timeout() {
    for (replay, zero, fault_step) in [(false, 0, 4), (true, 0, 5), (true, 1, 5)] {
        let timeout = std::time::Duration::from_secs(2);
        let (err, took, ckpt) = train_with_fault(replay, zero, fault_step, true, timeout);
        let case = format!("replay {replay}, zero {zero}");
        assert!(err.contains("timed out"), "{case}: {err}");
        assert!(
            ["all_reduce", "reduce_scatter", "all_gather"]
                .iter()
                .any(|op| err.contains(op)),
            "{case}: the error names the collective: {err}"
        );
        assert!(
            took < 2 * timeout + std::time::Duration::from_secs(10),
            "{case}: stopping took {took:?}"
        );
        assert_eq!(ckpt.step, (fault_step - 1) / 2 * 2, "{case}");
        assert!(ckpt.params.iter().all(|p| p.is_finite()));
    }
}

/// `TrainOptions::fused` (fused attention and classifier) trains like the
/// unfused model, 2 ranks, several steps: the same losses to float rounding.
#[test]
fn fused_training_follows_the_unfused_run() {
    let start = StartState::fresh(&Gpt2Config::tiny(), 21);
    let plain = run(&options(2, 2, 4), start.clone());
    let mut opts = options(2, 2, 4);
    opts.fusion = braid_gpt2::model::Fusion::ALL;
    let fused = run(&opts, start);
    for (i, (a, b)) in losses(&fused).iter().zip(&losses(&plain)).enumerate() {
        assert!(
            (a - b).abs() <= 1e-4 * b.abs(),
            "step {}: fused loss {a} vs {b}",
            i + 1
        );
    }
}

// ---------------------------------------------------------------------------
// ZeRO-1 (`TrainOptions::zero = 1`)
// ---------------------------------------------------------------------------

fn zero1(ranks: usize, batch_size: usize, steps: u64) -> TrainOptions {
    TrainOptions {
        zero: 1,
        ..options(ranks, batch_size, steps)
    }
}

/// ZeRO-1 at 2 and 4 ranks, with and without the tied split, and at 3 ranks
/// (bucket tails), follows one rank on the combined batch over five steps.
#[test]
fn zero1_at_two_three_and_four_ranks_reproduces_one_rank_on_the_combined_batch() {
    let steps = 5;
    let start = StartState::fresh(&Gpt2Config::tiny(), 5);
    let single = run(&options(1, 4, steps), start.clone());
    for (ranks, split) in [(2, true), (4, true), (2, false), (4, false)] {
        let mut opts = zero1(ranks, 4 / ranks, steps);
        opts.tied_split = split;
        let r = run(&opts, start.clone());
        let label = format!("ZeRO-1, {ranks} ranks (split {split})");
        check_zero1_run(&r, &single, &label);
    }
    // 3 ranks: buckets whose length is not a multiple of 3 have tails
    // (all-reduced, updated on every rank, counted once in the norm).
    let single = run(&options(1, 3, steps), start.clone());
    let r = run(&zero1(3, 1, steps), start);
    check_zero1_run(&r, &single, "ZeRO-1, 3 ranks");
    // The first step's gradients are the same bits as unsharded DDP's (the
    // same averages), so the global norm differs only by how its f64 partial
    // sums are grouped: every element counted once, tails included.
    let ddp = run(&options(3, 1, 1), StartState::fresh(&Gpt2Config::tiny(), 5));
    let (a, b) = (r.steps[0].grad_norm, ddp.steps[0].grad_norm);
    assert!(
        (a - b).abs() <= 1e-7 * b,
        "3 ranks, step 1: ZeRO-1 norm {a} vs unsharded {b}"
    );
    let full = 8 * Gpt2Config::tiny().num_parameters();
    assert!(
        r.optimizer_bytes.iter().sum::<usize>() > full,
        "3 ranks: no bucket has a tail ({:?} bytes), so the tails go untested",
        r.optimizer_bytes
    );
}

/// A ZeRO-1 run of five steps (the first all-reduces, the third is recorded,
/// the last two replayed) follows `single`, and really reduce-scattered its
/// buckets and gathered its parameters.
fn check_zero1_run(r: &TrainReport, single: &TrainReport, label: &str) {
    assert!(r.ranks > 1 && r.zero, "{label}");
    assert_eq!(
        r.steps.iter().map(|s| s.replayed).collect::<Vec<_>>(),
        [false, false, false, true, true],
        "{label}"
    );
    assert_matches_single(r, single, label);
    for p in &r.profiles {
        // Steps 2..=5 reduce-scatter and gather (step 1 all-reduces).
        let scatters = spans(p, "reduce_scatter bucket").count();
        let gathers = spans(p, "all_gather params").count();
        assert!(
            scatters >= 4 && gathers >= 4,
            "{label}: {scatters} reduce-scatters, {gathers} gathers"
        );
    }
}

/// ZeRO-1 with mixed precision (bf16 storage, `f32` master weights and
/// moments): the bf16 buckets are reduce-scattered, each rank updates its
/// shard of the master weights and rounds it into the stored parameters,
/// and the stored parameters are all-gathered. At 2 and 3 ranks (bucket
/// tails) it follows unsharded bf16 DDP bit for bit: the same averages
/// (two or three addends in the same order), the same update per element.
/// Each rank keeps only its shard of the master weights (the model's full
/// copy is released); they are gathered for the final parameters and the
/// checkpoint, which resumes bit-identically.
#[test]
fn zero1_in_bf16_follows_bf16_ddp_bit_for_bit() {
    let start = StartState::fresh(&Gpt2Config::tiny(), 13);
    for ranks in [2, 3] {
        let steps = 5;
        let mut ddp = options(ranks, 1, steps);
        ddp.dtype = Dtype::Bf16;
        let mut z = zero1(ranks, 1, steps);
        z.dtype = Dtype::Bf16;
        let (a, b) = (run(&ddp, start.clone()), run(&z, start.clone()));
        let label = format!("{ranks} ranks, bf16");
        assert_eq!(losses(&a), losses(&b), "{label}");
        let norms = |r: &TrainReport| r.steps.iter().map(|s| s.grad_norm).collect::<Vec<_>>();
        for (x, y) in norms(&a).iter().zip(&norms(&b)) {
            // The norm's f64 partial sums are grouped by shard.
            assert!((x - y).abs() <= 1e-6 * x, "{label}: norm {x} vs {y}");
        }
        assert_eq!(a.params, b.params, "{label}");
        assert!(
            b.param_hashes.iter().all(|&h| h == b.param_hashes[0]),
            "{label}"
        );
        assert!(b.zero, "{label}");
        // Moments and master weights, 12 bytes per parameter, divided by
        // the ranks (plus the bucket tails); unsharded bf16 counts only the
        // moments (the master weights are the model's, all of them).
        let n = Gpt2Config::tiny().num_parameters();
        assert_eq!(a.optimizer_bytes, vec![8 * n; ranks], "{label}");
        let per_rank = (12 * n / ranks) as f64;
        assert!(
            b.optimizer_bytes
                .iter()
                .all(|&x| x as f64 >= per_rank && (x as f64) < 1.01 * per_rank),
            "{label}: {:?} bytes of moments and master weights per rank",
            b.optimizer_bytes
        );
        for p in &b.profiles {
            assert!(spans(p, "reduce_scatter bucket").count() >= 4, "{label}");
            assert!(spans(p, "all_gather params").count() >= 4, "{label}");
        }
    }
    // Resume: two steps, a checkpoint, three more, against five straight.
    let dir = tempfile::tempdir().unwrap();
    let mut straight = zero1(2, 2, 5);
    straight.dtype = Dtype::Bf16;
    let whole = run(&straight, start.clone());
    let mut first = straight.clone();
    first.steps = 2;
    first.checkpoint_dir = Some(dir.path().join("ckpt"));
    let half = run(&first, start);
    let ckpt = load_checkpoint(dir.path().join("ckpt")).unwrap();
    // The checkpoint holds the gathered master weights: every rank's shard.
    assert_eq!(ckpt.params, half.params);
    let resumed = run(&straight, StartState::from_checkpoint(ckpt));
    assert_eq!(losses(&resumed), losses(&whole)[2..]);
    assert_eq!(resumed.params, whole.params);
}

/// Each rank keeps the moments of its shard only: about 1/W of the
/// unsharded state (plus fewer than W elements per bucket), and the ranks'
/// shards together cover every parameter.
#[test]
fn zero1_divides_the_optimizer_state_by_the_ranks() {
    let start = StartState::fresh(&Gpt2Config::tiny(), 6);
    let full = 8 * Gpt2Config::tiny().num_parameters();
    let ddp = run(&options(2, 2, 1), start.clone());
    assert_eq!(ddp.optimizer_bytes, [full, full]);
    for ranks in [2, 4] {
        let r = run(&zero1(ranks, 4 / ranks, 1), start.clone());
        eprintln!(
            "{ranks} ranks: optimizer state per rank {:?} bytes, unsharded {full}",
            r.optimizer_bytes
        );
        assert_eq!(r.optimizer_bytes.len(), ranks);
        assert!(r.optimizer_bytes.iter().sum::<usize>() >= full);
        for &b in &r.optimizer_bytes {
            assert!(b >= full / ranks, "{ranks} ranks: {b} bytes");
            assert!(
                (b as f64) <= 1.01 * (full / ranks) as f64,
                "{ranks} ranks: {b} bytes, more than 1/{ranks} of {full}"
            );
        }
    }
}

/// A ZeRO-1 checkpoint holds the full state (the shards gathered): the same
/// parameters and moments as the unsharded run's to float rounding, and a
/// run resumed from it at the same rank count continues bit-identically
/// (checkpoints every step, so the mid-run save is exercised too).
#[test]
fn zero1_checkpoints_hold_the_full_state_and_resume_bit_identically() {
    let dir = tempfile::tempdir().unwrap();
    let start = StartState::fresh(&Gpt2Config::tiny(), 8);
    // 3 ranks, so that some buckets have tails (see above).
    let straight = run(&zero1(3, 1, 5), start.clone());

    let mut first = zero1(3, 1, 2);
    first.checkpoint_dir = Some(dir.path().join("zero"));
    first.checkpoint_every = Some(1);
    let half = run(&first, start.clone());
    let ckpt = load_checkpoint(dir.path().join("zero")).unwrap();
    assert_eq!(ckpt.step, 2);
    assert_eq!(ckpt.params, half.params);

    let mut plain = options(3, 1, 2);
    plain.checkpoint_dir = Some(dir.path().join("ddp"));
    run(&plain, start);
    let reference = load_checkpoint(dir.path().join("ddp")).unwrap();
    for (what, a, b) in [
        ("params", &ckpt.params, &reference.params),
        ("adam_m", &ckpt.adam_m, &reference.adam_m),
        ("adam_v", &ckpt.adam_v, &reference.adam_v),
    ] {
        assert_eq!(a.len(), b.len(), "{what}");
        let scale = b.iter().fold(0f32, |m, x| m.max(x.abs()));
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert!(
                (x - y).abs() <= 1e-5 * scale + 1e-4 * y.abs(),
                "{what}[{i}]: ZeRO-1 {x} vs unsharded {y}"
            );
        }
    }

    let rest = run(&zero1(3, 1, 5), StartState::from_checkpoint(ckpt));
    assert_eq!(
        rest.steps.iter().map(|s| s.step).collect::<Vec<_>>(),
        [3, 4, 5]
    );
    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&losses(&rest)), bits(&losses(&straight)[2..]));
    assert_eq!(
        bits(&rest.params),
        bits(&straight.params),
        "final parameters"
    );
}

/// At another rank count a checkpoint is re-sharded: each rank takes its
/// slices of the full moments. A ZeRO-1 checkpoint of 2 ranks and an
/// unsharded one, resumed at 4 ranks with ZeRO-1 and at 1 rank on the
/// combined batch: the runs agree.
#[test]
fn zero1_checkpoints_reshard_at_another_rank_count() {
    for zero in [true, false] {
        let dir = tempfile::tempdir().unwrap();
        let mut first = if zero {
            zero1(2, 2, 2)
        } else {
            options(2, 2, 2)
        };
        first.checkpoint_dir = Some(dir.path().join("ckpt"));
        run(&first, StartState::fresh(&Gpt2Config::tiny(), 12));
        let ckpt = load_checkpoint(dir.path().join("ckpt")).unwrap();
        let single = run(&options(1, 4, 5), StartState::from_checkpoint(ckpt.clone()));
        let four = run(&zero1(4, 1, 5), StartState::from_checkpoint(ckpt));
        assert_eq!(
            four.steps.iter().map(|s| s.step).collect::<Vec<_>>(),
            [3, 4, 5]
        );
        let label = format!("checkpoint of 2 ranks (ZeRO-1 {zero}) resumed at 4 with ZeRO-1");
        assert_matches_single(&four, &single, &label);
    }
}

/// With ZeRO-1 too (the parameter all-gathers inside the recorded step),
/// replayed steps equal eager ones bit for bit.
#[test]
fn zero1_replayed_steps_equal_eager_steps_bit_for_bit() {
    let start = StartState::fresh(&Gpt2Config::tiny(), 11);
    let mut eager = zero1(2, 2, 6);
    eager.replay = false;
    let (a, b) = (run(&eager, start.clone()), run(&zero1(2, 2, 6), start));
    assert_eq!(losses(&a), losses(&b));
    assert_eq!(a.params, b.params);
    assert_eq!(b.steps.iter().filter(|s| s.replayed).count(), 3);
}

/// Gradient accumulation (`grad_accum`): micro-batches whose gradients are
/// added (each pass scaled by 1/n) and reduced once follow one rank on the
/// combined batch: 1 rank × 2 and × 4 micro-batches, 2 ranks × 2 (plain and
/// ZeRO-1), each over the same 4 sequences a step. The reported loss is
/// the mean of the micro-batches' losses; the step trains on all their
/// tokens; the buckets are all-reduced once a step, not once a micro-batch.
#[test]
fn accumulated_micro_batches_follow_one_rank_on_the_combined_batch() {
    let steps = 4;
    let start = StartState::fresh(&Gpt2Config::tiny(), 17);
    let single = run(&options(1, 4, steps), start.clone());
    let buckets = |r: &TrainReport| spans(&r.profiles[0], "all_reduce bucket").count();
    let plain = run(&options(2, 2, steps), start.clone());
    for (ranks, accum, zero) in [(1, 2, 0), (1, 4, 0), (2, 2, 0), (2, 2, 1)] {
        let mut opts = options(ranks, 4 / ranks / accum, steps);
        (opts.grad_accum, opts.zero) = (accum, zero);
        let r = run(&opts, start.clone());
        let label = format!("{ranks} rank(s) x {accum} micro-batches, ZeRO-{zero}");
        assert!(!r.tied_split, "{label}: the tied gradient is reduced whole");
        assert_matches_single(&r, &single, &label);
        // AdamW's update does not see the gradient's scale; its norm does.
        for (a, b) in r.steps.iter().zip(&single.steps) {
            let (a, b) = (a.grad_norm, b.grad_norm);
            assert!((a - b).abs() <= 1e-5 * b, "{label}: norm {a} vs {b}");
        }
        assert!(r.steps.iter().all(|s| s.tokens == 4 * 16), "{label}");
        assert_eq!(
            r.steps.iter().map(|s| s.replayed).collect::<Vec<_>>(),
            [false, false, false, true],
            "{label}"
        );
        if ranks > 1 && zero == 0 {
            // As many bucket all-reduces as the run without accumulation
            // (its tied split off too, so the same buckets).
            let mut whole = options(2, 2, steps);
            whole.tied_split = false;
            let expected = buckets(&run(&whole, start.clone()));
            assert_eq!(buckets(&r), expected, "{label}");
            assert!(buckets(&plain) > 0);
        }
    }
    // Mixed precision: the micro-batches' bf16 gradients are added in bf16
    // (as llm.c does), within bf16 tolerance of the combined batch.
    let bf16 = |o| TrainOptions {
        dtype: Dtype::Bf16,
        ..o
    };
    let single = run(&bf16(options(1, 4, steps)), start.clone());
    let mut opts = bf16(options(2, 1, steps));
    opts.grad_accum = 2;
    let r = run(&opts, start);
    for (a, b) in losses(&r).iter().zip(&losses(&single)) {
        assert!((a - b).abs() <= 2e-3 * b.abs(), "bf16: loss {a} vs {b}");
    }
    for (a, b) in r.params.iter().zip(&single.params) {
        // Adam's steps are at most lr (1e-3) each.
        assert!(
            (a - b).abs() <= 2.0 * steps as f32 * 1e-3,
            "bf16: {a} vs {b}"
        );
    }
}

/// An accumulating run replays (and is resumed) bit for bit: eager against
/// replayed steps, and 2 + 2 steps through a checkpoint against 4.
#[test]
fn accumulated_steps_replay_and_resume_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    let start = StartState::fresh(&Gpt2Config::tiny(), 19);
    let accum = |steps| TrainOptions {
        grad_accum: 3,
        ..options(2, 1, steps)
    };
    let replayed = run(&accum(4), start.clone());
    let eager = run(
        &TrainOptions {
            replay: false,
            ..accum(4)
        },
        start.clone(),
    );
    assert_eq!(losses(&eager), losses(&replayed));
    assert_eq!(eager.params, replayed.params);
    assert!(replayed.steps[3].replayed && !eager.steps[3].replayed);

    let first = TrainOptions {
        checkpoint_dir: Some(dir.path().join("ckpt")),
        ..accum(2)
    };
    run(&first, start);
    let ckpt = load_checkpoint(dir.path().join("ckpt")).unwrap();
    assert_eq!(ckpt.extra["grad_accum"], 3);
    let rest = run(&accum(4), StartState::from_checkpoint(ckpt));
    assert_eq!(losses(&rest), losses(&replayed)[2..]);
    assert_eq!(rest.params, replayed.params);
}

/// Validation during training (`TrainOptions::validation`): at every
/// `every`-th step and the last, the loss `evaluate` gives the parameters
/// just updated on the same windows (here all 7 of a short source, in
/// batches of 2 over 2 ranks: the last batch of one window filled and its
/// filler left out), with ZeRO-1 (the shards gathered first) and
/// accumulation too, and before the first step the starting parameters'
/// (step 0's); the training itself is the same bits as without it.
#[test]
fn validation_scores_what_eval_scores_and_changes_no_training_bit() {
    let t = 16;
    let held_out: Vec<u32> = (0..7 * t as u32 + 1).map(|i| (i * 7 + 3) % 512).collect();
    let val = TokenSource::from_ids(&held_out, "held out").unwrap();
    let start = StartState::fresh(&Gpt2Config::tiny(), 23);
    for (zero, accum) in [(0, 1), (1, 1), (0, 2)] {
        let label = format!("ZeRO-{zero}, {accum} micro-batch(es)");
        let plain = TrainOptions {
            zero,
            grad_accum: accum,
            ..options(2, 2 / accum, 5)
        };
        let validated = TrainOptions {
            validation: Some(braid_gpt2::trainer::Validation {
                data: val.clone(),
                every: 2,
                windows: 100,
            }),
            ..plain.clone()
        };
        let (a, b) = (run(&plain, start.clone()), run(&validated, start.clone()));
        assert_eq!(losses(&a), losses(&b), "{label}");
        assert_eq!(a.params, b.params, "{label}");
        // The summaries are of training: the validations' tasks (in the
        // trace, under `validation`) are left out of them.
        let tasks = |r: &TrainReport| r.whole_run.iter().map(|s| s.tasks).collect::<Vec<_>>();
        assert_eq!(tasks(&a), tasks(&b), "{label}");
        let in_validation = |r: &TrainReport| {
            let p = &r.profiles[1];
            p.spans
                .iter()
                .filter(|s| s.scope.as_deref() == Some("validation"))
                .count()
        };
        assert!(in_validation(&b) > 0 && in_validation(&a) == 0, "{label}");
        let at: Vec<u64> = b
            .steps
            .iter()
            .filter(|s| s.val_loss.is_some())
            .map(|s| s.step)
            .collect();
        assert_eq!(at, [2, 4, 5], "{label}");
        assert!(a.steps.iter().all(|s| s.val_loss.is_none()));
        let at_start: Vec<u64> = b
            .steps
            .iter()
            .filter(|s| s.start_val_loss.is_some())
            .map(|s| s.step)
            .collect();
        assert_eq!(at_start, [1], "{label}");
        assert!(a.steps.iter().all(|s| s.start_val_loss.is_none()));
        let rt =
            braid_gpt2::trainer::model_runtime(BackendKind::Cpu, 1, Policy::Single, 0).unwrap();
        let eval = |params: &[f32]| {
            let e = braid_gpt2::trainer::evaluate(
                &rt,
                &Gpt2Config::tiny(),
                params,
                &val,
                t,
                3,
                // `braid-gpt2 eval`'s default: every fused kernel.
                braid_gpt2::model::ModelOptions {
                    fusion: braid_gpt2::model::Fusion::ALL,
                    ..Default::default()
                },
                |_, _| {},
            )
            .unwrap();
            assert_eq!(e.windows, 7);
            e.loss
        };
        for (got, params) in [
            (b.steps[4].val_loss, &b.params[..]),
            (b.steps[0].start_val_loss, &start.params[..]),
        ] {
            let (got, want) = (got.unwrap(), eval(params));
            assert!(
                (f64::from(got) - want).abs() <= 1e-5 * want,
                "{label}: validation {got} vs evaluate {want}"
            );
        }
    }
}

/// Weight decay on the matrices only (nanoGPT's and llm.c's,
/// `DecayOn::Matrices`): after one step the matrices are those of a run
/// that decays everything and the biases and norms those of a run without
/// decay, bit for bit; replayed steps equal eager ones, and ZeRO-1 at 2
/// ranks follows 1 rank, with it.
#[test]
fn weight_decay_on_the_matrices_only() {
    use braid_gpt2::layout::ParamLayout;
    use braid_gpt2::optim::DecayOn;
    let start = StartState::fresh(&Gpt2Config::tiny(), 29);
    let with = |on, wd: f32, ranks, steps| {
        let mut o = options(ranks, 4 / ranks, steps);
        (o.weight_decay_on, o.optimizer.weight_decay) = (on, wd);
        o
    };
    let all = run(&with(DecayOn::All, 0.5, 1, 1), start.clone());
    let none = run(&with(DecayOn::All, 0.0, 1, 1), start.clone());
    let matrices = run(&with(DecayOn::Matrices, 0.5, 1, 1), start.clone());
    let ranges = ParamLayout::new(&Gpt2Config::tiny()).matrix_ranges();
    let (mut decayed, mut kept) = (0, 0);
    for (i, p) in matrices.params.iter().enumerate() {
        let want = match ranges.iter().any(|r| r.contains(&i)) {
            true => (all.params[i], &mut decayed),
            false => (none.params[i], &mut kept),
        };
        assert_eq!(p.to_bits(), want.0.to_bits(), "param {i}");
        *want.1 += usize::from(all.params[i] != none.params[i]);
    }
    assert!(decayed > 0 && kept > 0, "{decayed} decayed, {kept} kept");
    // Recorded and replayed with its second scalars buffer.
    let replayed = run(&with(DecayOn::Matrices, 0.5, 2, 5), start.clone());
    let mut eager = with(DecayOn::Matrices, 0.5, 2, 5);
    eager.replay = false;
    let eager = run(&eager, start.clone());
    assert!(replayed.steps[4].replayed);
    assert_eq!(replayed.params, eager.params);
    let mut zero = with(DecayOn::Matrices, 0.5, 2, 5);
    zero.zero = 1;
    let single = run(&with(DecayOn::Matrices, 0.5, 1, 5), start.clone());
    check_zero1_run(&run(&zero, start), &single, "ZeRO-1, matrices");
}

/// Shuffled data (`TrainOptions::shuffle`): a run crossing epochs resumes
/// bit for bit from a checkpoint in the middle of one, and trains on other
/// batches than the in-order run (its losses differ from the first step).
#[test]
fn a_shuffled_run_resumes_bit_identically_across_epochs() {
    let dir = tempfile::tempdir().unwrap();
    // 10 windows of T 16; 2 ranks x B 2: 2 steps an epoch.
    let ids: Vec<u32> = (0..16 * 10 + 1).map(|i| (i * 5 + 1) % 512).collect();
    let small = TokenSource::from_ids(&ids, "ten windows").unwrap();
    let start = StartState::fresh(&Gpt2Config::tiny(), 31);
    let shuffled = |steps| TrainOptions {
        shuffle: true,
        seed: 5,
        ..options(2, 2, steps)
    };
    let go = |o: &TrainOptions, s: StartState| train(o, s, &small, &|_| {}).unwrap();
    let straight = go(&shuffled(5), start.clone());
    let in_order = go(&options(2, 2, 5), start.clone());
    assert_ne!(losses(&straight)[0], losses(&in_order)[0]);
    let first = TrainOptions {
        checkpoint_dir: Some(dir.path().join("ckpt")),
        ..shuffled(3)
    };
    go(&first, start);
    let ckpt = load_checkpoint(dir.path().join("ckpt")).unwrap();
    assert_eq!(ckpt.extra["data_order"], "shuffled with seed 5");
    let rest = go(&shuffled(5), StartState::from_checkpoint(ckpt));
    assert_eq!(losses(&rest), losses(&straight)[3..]);
    assert_eq!(rest.params, straight.params);
}

/// Text generated during training (`TrainOptions::generation`): at every
/// `every`-th step and the last, on rank 0, the tokens a sampler of the
/// parameters just updated draws from `generation_seed(seed, step)`; with
/// ZeRO-1 (the shards gathered first) and in bf16 too; the training itself
/// is the same bits as without it, and the summaries leave it out.
#[test]
fn generation_draws_from_the_updated_parameters_and_changes_no_training_bit() {
    use braid_gpt2::model::Sampler;
    use braid_gpt2::trainer::{generation_seed, Generation};
    let cfg = Gpt2Config::tiny();
    let start = StartState::fresh(&cfg, 31);
    let prompt = vec![5, 6, 7];
    for (zero, dtype) in [(0, Dtype::F32), (1, Dtype::F32), (0, Dtype::Bf16)] {
        let label = format!("ZeRO-{zero}, {dtype}");
        let plain = TrainOptions {
            zero,
            dtype,
            ..options(2, 2, 5)
        };
        let generating = TrainOptions {
            generation: Some(Generation {
                every: 2,
                tokens: 12,
                prompt: prompt.clone(),
                how: braid_gpt2::model::Sampling::default(),
            }),
            ..plain.clone()
        };
        let (a, b) = (run(&plain, start.clone()), run(&generating, start.clone()));
        assert_eq!(losses(&a), losses(&b), "{label}");
        assert_eq!(a.params, b.params, "{label}");
        let tasks = |r: &TrainReport| r.whole_run.iter().map(|s| s.tasks).collect::<Vec<_>>();
        assert_eq!(tasks(&a), tasks(&b), "{label}");
        let at: Vec<u64> = b
            .steps
            .iter()
            .filter(|s| s.sample.is_some())
            .map(|s| s.step)
            .collect();
        assert_eq!(at, [2, 4, 5], "{label}");
        assert!(a.steps.iter().all(|s| s.sample.is_none()));
        let rt =
            braid_gpt2::trainer::model_runtime(BackendKind::Cpu, 1, Policy::Single, 0).unwrap();
        let seed = generation_seed(plain.seed, 5);
        let mut s = Sampler::new(&rt, &cfg, &b.params, 15, 1.0, seed, dtype).unwrap();
        let want = s.generate(&rt, &prompt, 12, |_| Ok(())).unwrap();
        assert_eq!(b.steps[4].sample.as_deref(), Some(&want[..]), "{label}");
        // Another step's seed draws other tokens (the check can fail).
        s.reseed(generation_seed(plain.seed, 4));
        let other = s.generate(&rt, &prompt, 12, |_| Ok(())).unwrap();
        assert_ne!(other, want, "{label}");
        // Each rank's model buffers are reported, the sampler's (a model
        // for inference: no gradients, one block's activations) with them.
        assert_eq!(a.model_bytes.len(), 2, "{label}");
        let sampler = s.model().device_bytes();
        assert!(s.model().options().inference, "{label}");
        assert!(sampler < a.model_bytes[0] / 2, "{label}");
        assert_eq!(
            b.model_bytes,
            vec![a.model_bytes[0] + sampler; 2],
            "{label}"
        );
    }
}

/// A stop asked for before a generation starts leaves that step without a
/// sample (none of its tokens drawn); the steps before have theirs whole.
#[test]
fn a_stop_skips_the_generation_it_precedes() {
    use braid_gpt2::trainer::Generation;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    for ranks in [1, 2] {
        let stop = Arc::new(AtomicBool::new(false));
        let opts = TrainOptions {
            stop: Some(stop.clone()),
            generation: Some(Generation {
                every: 1,
                tokens: 8,
                prompt: vec![3],
                how: braid_gpt2::model::Sampling::default(),
            }),
            ..options(ranks, 1, 200)
        };
        let r = train(&opts, StartState::fresh(&opts.model, 1), &data(), &|s| {
            if s.step == 3 {
                stop.store(true, Ordering::SeqCst);
            }
        })
        .unwrap();
        let drawn: Vec<(u64, Option<usize>)> = r
            .steps
            .iter()
            .map(|s| (s.step, s.sample.as_ref().map(Vec::len)))
            .collect();
        let mut want = vec![(1, Some(8)), (2, Some(8)), (3, Some(8))];
        want.extend((4..=r.final_step).map(|s| (s, None)));
        assert_eq!(drawn, want, "{ranks} rank(s)");
    }
}

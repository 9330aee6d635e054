//! Random programs on the engine give, bit for bit, the sequential result.

mod common;

use braid::Policy;
use common::*;
use proptest::prelude::*;
use proptest::strategy::ValueTree;

fn cases() -> u32 {
    std::env::var("BRAID_PROPTEST_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1500)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn random_programs_match_sequential(
        p in program(40),
        streams in 1usize..=8,
        policy in prop_oneof![Just(Policy::Single), Just(Policy::RoundRobin), Just(Policy::Affinity)],
        window in prop_oneof![Just(1usize), Just(3), Just(4096)],
        // Budgeted placement (the default: its share of the cores, which
        // changes as other tests' runtimes come and go) or every stream.
        oversubscribe in any::<bool>(),
    ) {
        let expected = sequential(&p);
        for backend in backends() {
            let rt = braid::Runtime::builder()
                .backend(backend)
                .compute_streams(streams)
                .policy(policy)
                .launch_window(window)
                .oversubscribe(oversubscribe)
                .build()
                .unwrap();
            let got = on_engine(&rt, &p);
            prop_assert_eq!(&got, &expected, "backend {:?}", backend);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: (cases() / 5).max(1), ..ProptestConfig::default() })]

    /// Random scopes and random placement files (streams, stream classes,
    /// priorities, policies, bundles, replay and automatic replay on or
    /// off): the program repeated `steps` times, eagerly with a
    /// synchronisation after each step or recorded once and replayed, gives
    /// the sequential result of the repetition (semantics 1, 9 and 10).
    #[test]
    fn random_placement_files_match_sequential(
        p in program(30),
        paths in prop::collection::vec(scope_path(), 1..12),
        file in placement_file(),
        streams in 1usize..=4,
        policy in prop_oneof![Just(Policy::Single), Just(Policy::RoundRobin), Just(Policy::Affinity)],
        steps in 1usize..=6,
        record in any::<bool>(),
    ) {
        let repeated = Program {
            sizes: p.sizes.clone(),
            tasks: p.tasks.iter().cycle().take(p.tasks.len() * steps).cloned().collect(),
        };
        let expected = sequential(&repeated);
        let text = file.toml(streams);
        for backend in backends() {
            let placement = braid::PlacementFile::parse(&text, "random.toml").unwrap();
            let rt = braid::Runtime::builder()
                .backend(backend)
                .compute_streams(streams)
                .policy(policy)
                .oversubscribe(true)
                .placement(placement)
                .build()
                .unwrap();
            let bufs = alloc_buffers(&rt, &p);
            if record {
                let step = rt
                    .record("step", |rt| {
                        submit_scoped(rt, &bufs, &p.tasks, &paths);
                        Ok(())
                    })
                    .unwrap();
                for _ in 1..steps {
                    step.replay().unwrap();
                }
            } else {
                for _ in 0..steps {
                    submit_scoped(&rt, &bufs, &p.tasks, &paths);
                    rt.synchronize().unwrap();
                }
            }
            let got = read_back(&rt, &bufs);
            prop_assert_eq!(&got, &expected, "backend {:?}, file:\n{}", backend, text);
        }
    }
}

/// Long programs on every stream count, repeated to vary timing.
#[test]
fn long_programs_on_1_to_8_streams() {
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    for streams in 1..=8 {
        for policy in Policy::ALL {
            let p = program(300).new_tree(&mut runner).unwrap().current();
            let rt = cpu_runtime(streams, policy);
            assert_eq!(
                on_engine(&rt, &p),
                sequential(&p),
                "{streams} streams, {policy}"
            );
        }
    }
}

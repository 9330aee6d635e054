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

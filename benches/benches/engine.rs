//! Criterion benches of the engine's per-task overhead (empty tasks, so the
//! figure is inference + placement + dispatch + completion; automatic
//! replay off, or the repeated iterations would be memoised).

use braid::{BackendKind, Policy, Runtime};
use braid_benches::{buffers, run, Shape};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};

fn overhead(c: &mut Criterion) {
    let n = 10_000;
    let mut g = c.benchmark_group("empty_tasks");
    g.throughput(Throughput::Elements(n as u64));
    for shape in [Shape::Chain, Shape::Fanout, Shape::Random] {
        for policy in [Policy::Single, Policy::Affinity] {
            let rt = Runtime::builder()
                .backend(BackendKind::Cpu)
                .compute_streams(2)
                .policy(policy)
                .auto_replay(false)
                .build()
                .unwrap();
            let bufs = buffers(&rt, shape, n).unwrap();
            g.bench_with_input(
                BenchmarkId::new(format!("{shape:?}"), policy.name()),
                &n,
                |b, &n| b.iter(|| run(&rt, shape, n, &bufs).unwrap()),
            );
        }
    }
    g.finish();
}

criterion_group!(benches, overhead);
criterion_main!(benches);

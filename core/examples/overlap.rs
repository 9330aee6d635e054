//! A small task graph on two compute streams and one comm stream, written to
//! `trace.json`: two independent chains of matrix-vector work overlap, and a
//! "communication" task (a sum across the halves) runs beside the tail of the
//! second chain.
//!
//! `cargo run --release -p braid --example overlap [-- trace.json]`

use braid::{Policy, Runtime, TaskKind};

fn work(x: &mut [f32], rounds: usize) {
    for r in 0..rounds {
        for (i, v) in x.iter_mut().enumerate() {
            *v = (*v * 0.999 + (i + r) as f32 * 1e-6).sin();
        }
    }
}

fn main() -> braid::Result<()> {
    let path = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "trace.json".into());
    for policy in [Policy::Single, Policy::Affinity] {
        let rt = Runtime::builder()
            .backend(braid::BackendKind::Cpu)
            .compute_streams(2)
            .comm_streams(1)
            .policy(policy)
            .profile(true)
            .build()?;
        let n = 1 << 16;
        let a = rt.alloc_from("a", &vec![0.5f32; n])?;
        let b = rt.alloc_from("b", &vec![0.25f32; n])?;
        let sum = rt.alloc("sum", 4)?;
        for (name, buf) in [("chain a", &a), ("chain b", &b)] {
            for _ in 0..6 {
                rt.task(name)
                    .run(buf.read_write::<f32>(), |x| work(x, 40))?;
            }
            if name == "chain a" {
                // "Communicate" chain a's result while chain b still computes.
                rt.task("reduce a").kind(TaskKind::Comm).run(
                    (a.read::<f32>(), sum.write::<f32>()),
                    |(a, s)| {
                        s[0] = a.iter().sum();
                    },
                )?;
            }
        }
        rt.synchronize()?;
        let s = rt.profile().summary();
        println!("policy {policy}:\n{s}\n");
        if policy == Policy::Affinity {
            rt.write_trace(&path)?;
            println!(
                "trace written to {path} (open it in https://ui.perfetto.dev or chrome://tracing)"
            );
        }
    }
    Ok(())
}

//! Stream threads pinned without the `hwloc` feature (Linux) where a
//! runtime's builder asks (`RuntimeBuilder::pin_threads`). A test binary of
//! its own: `BRAID_PIN_THREADS`, which would override the builders, must be
//! unset here (it is read once per process, at the first stream thread; its
//! reading is unit-tested in `topo.rs`).
#![cfg(all(target_os = "linux", not(feature = "hwloc")))]

use braid::{BackendKind, Runtime, TaskKind};
use std::sync::{Arc, Mutex};

/// The logical CPUs the calling thread may run on.
fn affinity() -> Vec<usize> {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; sched_getaffinity
    // fills it for the calling thread (pid 0); CPU_ISSET only reads it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        assert_eq!(
            libc::sched_getaffinity(0, size_of::<libc::cpu_set_t>(), &mut set),
            0
        );
        (0..libc::CPU_SETSIZE as usize)
            .filter(|&c| libc::CPU_ISSET(c, &set))
            .collect()
    }
}

/// Two runtimes that ask for pinning have their compute stream 0 (two
/// ranks' busy threads) each pinned to one CPU of the process's mask,
/// different CPUs when there are two, and each its comm stream on a CPU
/// other than its compute stream 0's (the other rank's, with two); a
/// runtime that does not ask, and the submitting thread, are left alone.
#[test]
fn two_runtimes_stream_zero_pinned_to_different_cpus() {
    let before = affinity();
    // SAFETY: removed before any other thread of this test binary exists
    // (the only test here), and read only by the stream threads below.
    unsafe { std::env::remove_var("BRAID_PIN_THREADS") };
    let builder = |pin| {
        Runtime::builder()
            .backend(BackendKind::Cpu)
            .compute_streams(2)
            .oversubscribe(true)
            .pin_threads(pin)
            // Every body on its stream's thread (the test asks where that is).
            .inline_short_tasks(false)
            .build()
            .unwrap()
    };
    let unpinned = builder(false);
    let runtimes: Vec<Runtime> = (0..2).map(|_| builder(true)).collect();
    // The CPUs a task of `kind` (on compute stream 0, or the comm stream)
    // may run on.
    let where_runs = |rt: &Runtime, kind: TaskKind| {
        let buf = rt.alloc("b", 4).unwrap();
        let out = Arc::new(Mutex::new(Vec::new()));
        let o = out.clone();
        let task = rt.task("where").kind(kind);
        let task = match kind {
            TaskKind::Comm => task,
            _ => task.on_stream(0),
        };
        task.run(buf.write::<u8>(), move |_| {
            *o.lock().unwrap() = affinity();
        })
        .unwrap()
        .wait()
        .unwrap();
        let cpus = out.lock().unwrap().clone();
        cpus
    };
    let where_stream_zero_runs = |rt: &Runtime| where_runs(rt, TaskKind::Compute);
    let seen: Vec<Vec<usize>> = runtimes.iter().map(where_stream_zero_runs).collect();
    let comm: Vec<Vec<usize>> = runtimes
        .iter()
        .map(|rt| where_runs(rt, TaskKind::Comm))
        .collect();
    for cpus in seen.iter().chain(&comm) {
        assert_eq!(cpus.len(), 1, "a stream thread pinned to one CPU: {cpus:?}");
        assert!(before.contains(&cpus[0]), "{cpus:?} outside {before:?}");
    }
    if before.len() >= 2 {
        assert_ne!(seen[0], seen[1], "two ranks' stream 0 on one CPU");
        for (compute, comm) in seen.iter().zip(&comm) {
            assert_ne!(
                compute, comm,
                "a rank's comm stream beside its own compute stream 0"
            );
        }
    }
    assert_eq!(
        where_stream_zero_runs(&unpinned),
        before,
        "a runtime that did not ask"
    );
    assert_eq!(affinity(), before, "the submitting thread stays unpinned");
    let d = braid::topo::describe();
    assert!(
        d.contains("stream threads pinned where a runtime asks"),
        "{d}"
    );
}

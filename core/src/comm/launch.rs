//! The launcher: N CPU ranks as threads of one process.
//!
//! [`launch`] makes a group of [`LocalComm`]s, starts one thread per rank,
//! hands each its [`Comm`], and joins them all. A rank's closure usually
//! builds its own [`Runtime`](crate::Runtime) with `.rank(rank)`, binds the
//! communicator to it ([`Comm::bind`]), submits its work and returns a
//! result; the runtime drops (and so finishes its tasks, collectives
//! included) before the closure returns.
//!
//! ```
//! use braid::comm::ReduceOp;
//! use braid::{BackendKind, Runtime};
//!
//! let sums = braid::launch(3, |rank, comm| {
//!     let rt = Runtime::builder().backend(BackendKind::Cpu).rank(rank).build()?;
//!     let comm = comm.bind(&rt)?;
//!     let x = rt.alloc_from("x", &[rank as i32])?;
//!     comm.all_reduce::<i32>(&x.whole(), ReduceOp::Sum)?;
//!     Ok(rt.read_vec::<i32>(&x)?[0])
//! });
//! assert!(sums.into_iter().all(|s| s.ok() == Some(3)));
//! ```
//!
//! Failure is whole-job, as with `torchrun`: when a rank's closure ends —
//! returning `Ok`, returning an error or panicking (caught, and turned into
//! [`Error::TaskPanicked`] for rank `r`) — the rank is marked *departed* with
//! the number of collectives it issued, so ranks waiting for a collective it
//! never issued fail at once with an error naming it, instead of waiting for
//! the timeout. If the group ends up poisoned, every rank whose closure
//! returned `Ok` gets an [`Error::Collective`] saying why the job failed.

use super::local::{LocalComm, LocalCommConfig};
use super::Comm;
use crate::error::{Error, Result};
use std::panic::{catch_unwind, AssertUnwindSafe};

/// Runs `f(rank, comm)` on `world_size` rank threads with the default
/// configuration (60 s timeout); returns each rank's result, in rank order.
pub fn launch<T, F>(world_size: usize, f: F) -> Vec<Result<T>>
where
    T: Send,
    F: Fn(usize, Comm) -> Result<T> + Sync,
{
    launch_with(world_size, LocalCommConfig::default(), f)
}

/// [`launch`] with a configuration (timeout, comm stream).
pub fn launch_with<T, F>(world_size: usize, config: LocalCommConfig, f: F) -> Vec<Result<T>>
where
    T: Send,
    F: Fn(usize, Comm) -> Result<T> + Sync,
{
    let comms = LocalComm::group(world_size, config);
    let probe = comms.first().map(LocalComm::handle);
    let mut results: Vec<(Result<T>, u64)> = std::thread::scope(|s| {
        let mut handles = Vec::with_capacity(world_size);
        for (rank, local) in comms.into_iter().enumerate() {
            let f = &f;
            let keep = local.handle();
            let spawned = std::thread::Builder::new()
                .name(format!("braid-rank{rank}"))
                .spawn_scoped(s, move || run_rank(rank, local, f));
            if let Err(e) = &spawned {
                keep.depart(0, format!("its thread could not start: {e}"));
            }
            handles.push(spawned);
        }
        handles
            .into_iter()
            .enumerate()
            .map(|(rank, spawned)| match spawned {
                // `run_rank` catches the closure's panics; a panic here would
                // be the launcher's own.
                Ok(h) => h.join().unwrap_or_else(|p| {
                    let e = Error::TaskPanicked {
                        task: format!("rank {rank}"),
                        message: crate::sched::panic_message(&*p),
                    };
                    (Err(e), 0)
                }),
                Err(e) => (
                    Err(Error::Config(format!(
                        "cannot start the thread of rank {rank}: {e}"
                    ))),
                    0,
                ),
            })
            .collect()
    });
    if let Some(reason) = probe.and_then(|p| p.poisoned()) {
        for (rank, (r, issued)) in results.iter_mut().enumerate() {
            if r.is_ok() {
                *r = Err(Error::Collective {
                    rank,
                    index: *issued,
                    op: "launch".into(),
                    message: format!("the job failed: {reason}"),
                });
            }
        }
    }
    results.into_iter().map(|(r, _)| r).collect()
}

/// One rank's thread: run the closure, catch its panic, mark the rank
/// departed. Returns its result and how many collectives it issued.
fn run_rank<T, F>(rank: usize, local: LocalComm, f: &F) -> (Result<T>, u64)
where
    F: Fn(usize, Comm) -> Result<T>,
{
    let depart = local.handle();
    let comm = Comm::new(local);
    let counter = comm.clone();
    let out = catch_unwind(AssertUnwindSafe(|| f(rank, comm)));
    let issued = counter.issued();
    let (out, why) = match out {
        Ok(Ok(v)) => (Ok(v), "its closure returned".to_string()),
        Ok(Err(e)) => {
            let why = format!("its closure failed: {e}");
            (Err(e), why)
        }
        Err(p) => {
            let message = crate::sched::panic_message(&*p);
            let why = format!("its closure panicked: {message}");
            let e = Error::TaskPanicked {
                task: format!("rank {rank}"),
                message,
            };
            (Err(e), why)
        }
    };
    depart.depart(issued, why);
    (out, issued)
}

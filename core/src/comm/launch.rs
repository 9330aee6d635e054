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
use std::time::{Duration, Instant};

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
    let results: Vec<(Result<T>, u64)> = std::thread::scope(|s| {
        let mut handles = Vec::with_capacity(world_size);
        for (rank, local) in comms.into_iter().enumerate() {
            let f = &f;
            let keep = local.handle();
            let spawned = std::thread::Builder::new()
                .name(format!("braid-rank{rank}"))
                .spawn_scoped(s, move || run_rank(rank, local, f));
            handles.push(spawned.map_err(|e| not_started(rank, &keep, &e)));
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
                Err(e) => (Err(e), 0),
            })
            .collect()
    });
    finish(probe.as_ref(), results)
}

/// A rank whose thread could not start: marks it departed (so the others
/// fail at once rather than wait for it) and returns its error.
fn not_started(rank: usize, keep: &LocalComm, e: &std::io::Error) -> Error {
    keep.depart(0, format!("its thread could not start: {e}"));
    Error::Config(format!("cannot start the thread of rank {rank}: {e}"))
}

/// Whole-job failure: if the group is poisoned, every rank whose closure
/// returned `Ok` gets an error saying why the job failed.
fn finish<T>(probe: Option<&LocalComm>, mut results: Vec<(Result<T>, u64)>) -> Vec<Result<T>> {
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

/// Rank threads that the caller watches rather than joins ([`spawn_ranks`]).
///
/// A rank whose task never returns cannot be joined. Once the job has failed
/// (a rank departed with an error: the others' collectives fail within their
/// timeout, naming the collective), [`Ranks::poll`] waits at most the grace
/// period for the remaining ranks, then gives up on them: each gets an error
/// saying it was abandoned, and its thread is left running (it holds its
/// runtime, whose stream thread is stuck in the task); the process ends it
/// when it exits. Failure stays whole-job, as with [`launch_with`].
pub struct Ranks<T> {
    done: std::sync::mpsc::Receiver<(usize, (Result<T>, u64))>,
    results: Vec<Option<(Result<T>, u64)>>,
    probe: Option<LocalComm>,
    grace: Duration,
    /// When the job was first seen failed.
    failed_at: Option<Instant>,
}

impl<T> std::fmt::Debug for Ranks<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let left = self.results.iter().filter(|r| r.is_none()).count();
        write!(f, "Ranks({} of {} running)", left, self.results.len())
    }
}

/// Starts `f(rank, comm)` on `world_size` rank threads that are not joined
/// but watched ([`Ranks::poll`]); `grace`: how long to wait for the other
/// ranks once the job has failed.
pub fn spawn_ranks<T, F>(
    world_size: usize,
    config: LocalCommConfig,
    grace: Duration,
    f: F,
) -> Ranks<T>
where
    T: Send + 'static,
    F: Fn(usize, Comm) -> Result<T> + Send + Sync + 'static,
{
    let comms = LocalComm::group(world_size, config);
    let probe = comms.first().map(LocalComm::handle);
    let (tx, done) = std::sync::mpsc::channel();
    let f = std::sync::Arc::new(f);
    for (rank, local) in comms.into_iter().enumerate() {
        let (f, to) = (f.clone(), tx.clone());
        let keep = local.handle();
        let spawned = std::thread::Builder::new()
            .name(format!("braid-rank{rank}"))
            .spawn(move || {
                let out = run_rank(rank, local, &*f);
                let _ = to.send((rank, out));
            });
        if let Err(e) = spawned {
            let _ = tx.send((rank, (Err(not_started(rank, &keep, &e)), 0)));
        }
    }
    Ranks {
        done,
        results: (0..world_size).map(|_| None).collect(),
        probe,
        grace,
        failed_at: None,
    }
}

impl<T> Ranks<T> {
    /// Waits up to `wait` for ranks to finish. Returns every rank's result,
    /// in rank order, once all have finished — or once the job has failed and
    /// the grace period has passed, the ranks still running abandoned.
    pub fn poll(&mut self, wait: Duration) -> Option<Vec<Result<T>>> {
        let deadline = Instant::now() + wait;
        while self.results.iter().any(Option::is_none) {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.done.recv_timeout(left) {
                Ok((rank, out)) => self.results[rank] = Some(out),
                Err(_) => break,
            }
        }
        let failed = self.probe.as_ref().and_then(LocalComm::poisoned);
        if failed.is_some() && self.failed_at.is_none() {
            self.failed_at = Some(Instant::now());
        }
        let running = self.results.iter().any(Option::is_none);
        let give_up = self.failed_at.is_some_and(|t| t.elapsed() >= self.grace);
        if running && !give_up {
            return None;
        }
        let grace = self.grace;
        let results = std::mem::take(&mut self.results)
            .into_iter()
            .enumerate()
            .map(|(rank, r)| {
                r.unwrap_or_else(|| {
                    let e = Error::Collective {
                        rank,
                        index: 0,
                        op: "launch".into(),
                        message: format!(
                            "rank {rank} did not finish within {grace:?} of the job failing \
                             (a task that never returns?); its thread is abandoned"
                        ),
                    };
                    (Err(e), 0)
                })
            })
            .collect();
        Some(finish(self.probe.as_ref(), results))
    }
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

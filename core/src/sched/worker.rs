//! Stream threads: each runs its stream's FIFO, issuing cross-stream waits
//! first.
//!
//! * CPU: a task is launched and completed by running its body; a wait on
//!   another stream blocks until that stream's `done` gate reaches the
//!   predecessor.
//! * CUDA: a task is launched by enqueuing its work: the thread blocks until
//!   the predecessor's stream has *launched* it (its end event exists), makes
//!   the CUDA stream wait on that event, records timing events around the
//!   body, and moves on. Completions are noticed by polling end events in FIFO
//!   order; only then does the task count as done, release its buffers and
//!   record its device-timed span.

use super::{Launch, Shared, TaskShared, IN_TASK_OF};
use crate::backend::gpu::{device_error, StreamDriver};
use crate::backend::DeviceCtx;
use crate::clock::now_ns;
use crate::ctx::{Access, Check, TaskCtx};
use crate::cuda::CudaEvent;
use crate::error::Error;
use crate::sync::{lock, Arc};
use crate::trace::Span;
use smallvec::SmallVec;
use std::collections::VecDeque;
use std::marker::PhantomData;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Duration;

/// Starts the thread that drives stream `s` (a CUDA stream when `driver` is given).
pub(crate) fn spawn(
    shared: Arc<Shared>,
    s: usize,
    driver: Option<StreamDriver>,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    let name = format!(
        "braid-r{}-{}",
        shared.rank,
        shared.streams[s].name.replace(' ', "")
    );
    std::thread::Builder::new().name(name).spawn(move || {
        crate::topo::pin_stream_thread(s);
        IN_TASK_OF.with(|c| c.set(shared.runtime_id));
        match driver {
            None => run_cpu(&shared, s),
            Some(d) => run_cuda(&shared, s, d),
        }
    })
}

fn take_launch(task: &TaskShared) -> Launch {
    match lock(&task.launch).take() {
        Some(l) => l,
        None => unreachable!("a task is queued once"),
    }
}

fn run_cpu(shared: &Shared, s: usize) {
    let mut batch = VecDeque::new();
    while shared.streams[s].queue.pop_batch(&mut batch) {
        while let Some(task) = batch.pop_front() {
            let Launch {
                waits,
                preds,
                accesses,
                body,
            } = take_launch(&task);
            for &(j, n) in &waits {
                shared.streams[j as usize].done.wait_at_least(n);
            }
            let start = if shared.profiling { now_ns() } else { 0 };
            let (outcome, checks) = run_body(&task, &preds, body, || DeviceCtx::Cpu(PhantomData));
            let outcome = outcome.and_then(|()| run_checks(checks));
            if shared.profiling {
                push_span(shared, s, &task, &preds, start, now_ns(), outcome.is_ok());
            }
            report(shared, &task, outcome);
            // Release the buffers before announcing completion, so memory is
            // free once a synchronisation point returns.
            drop(accesses);
            drop(preds);
            complete(shared, s);
        }
    }
}

/// Runs completion checks in order; the first error wins.
fn run_checks(checks: Vec<Check>) -> Result<(), Error> {
    checks.into_iter().try_for_each(|c| c())
}

/// Runs a task's body unless a predecessor failed; catches panics. Returns
/// the outcome and the checks the body registered for its completion.
fn run_body<'a>(
    task: &'a TaskShared,
    preds: &[Arc<TaskShared>],
    body: crate::ctx::Body,
    device: impl FnOnce() -> DeviceCtx<'a>,
) -> (Result<(), Error>, Vec<Check>) {
    if let Some(p) = preds.iter().find(|p| p.failed()) {
        let e = Error::DependencyFailed {
            task: task.name.to_string(),
            cause: p.name.to_string(),
        };
        return (Err(e), Vec::new());
    }
    let ctx = TaskCtx::new(&task.name, device());
    let outcome = match catch_unwind(AssertUnwindSafe(|| body(&ctx))) {
        Ok(Ok(())) => Ok(()),
        // A collective's own error (timeout, mismatch, poisoned communicator)
        // already names the collective and its rank: keep it as it is.
        Ok(Err(e)) => match e.downcast::<Error>() {
            Ok(e) if matches!(*e, Error::Collective { .. }) => Err(*e),
            Ok(e) => Err(Error::TaskFailed {
                task: task.name.to_string(),
                message: error_chain(&*e),
            }),
            Err(e) => Err(Error::TaskFailed {
                task: task.name.to_string(),
                message: error_chain(&*e),
            }),
        },
        Err(panic) => Err(Error::TaskPanicked {
            task: task.name.to_string(),
            message: panic_message(&*panic),
        }),
    };
    (outcome, ctx.take_checks())
}

/// Publishes a task's final status; root failures go to the error list.
fn report(shared: &Shared, task: &TaskShared, outcome: Result<(), Error>) {
    if let Err(e) = &outcome {
        if !matches!(e, Error::DependencyFailed { .. }) {
            lock(&shared.errors).push((task.id, e.clone()));
        }
    }
    task.finish(outcome);
}

fn complete(shared: &Shared, s: usize) {
    shared.streams[s].done.add(1);
    shared.completed.add(1);
}

fn push_span(
    shared: &Shared,
    s: usize,
    task: &TaskShared,
    preds: &[Arc<TaskShared>],
    start_ns: u64,
    end_ns: u64,
    ok: bool,
) {
    lock(&shared.streams[s].spans).push(Span {
        id: task.id,
        name: task.name.clone(),
        kind: task.kind,
        stream: s,
        placement: task.placement,
        start_ns,
        end_ns,
        preds: preds.iter().map(|p| p.id).collect(),
        ok,
    });
}

/// A launched CUDA task waiting for its end event.
struct InFlight {
    task: Arc<TaskShared>,
    preds: SmallVec<[Arc<TaskShared>; 4]>,
    /// Held, not read: keeps the task's buffers alive until its work is
    /// complete on the device (semantics 7).
    _accesses: SmallVec<[Access; 4]>,
    start: Option<CudaEvent>,
    /// `Some` when the task failed or was skipped at launch.
    outcome: Option<Error>,
    /// Run when the end event has completed (`TaskCtx::on_complete`).
    checks: Vec<Check>,
}

fn run_cuda(shared: &Shared, s: usize, d: StreamDriver) {
    if let Err(e) = d.stream.device().bind_to_thread() {
        lock(&shared.errors).push((u64::MAX, Error::from(e)));
    }
    let mut batch = VecDeque::new();
    let mut inflight: VecDeque<InFlight> = VecDeque::new();
    loop {
        let open = if inflight.is_empty() {
            shared.streams[s].queue.pop_batch(&mut batch)
        } else {
            shared.streams[s]
                .queue
                .pop_batch_timeout(&mut batch, Duration::from_micros(50))
        };
        while let Some(task) = batch.pop_front() {
            inflight.push_back(launch_cuda(shared, s, &d, task));
            poll(shared, s, &d, &mut inflight, false);
        }
        let drain = !open;
        poll(shared, s, &d, &mut inflight, drain);
        if drain && inflight.is_empty() && batch.is_empty() {
            break;
        }
    }
}

fn launch_cuda(shared: &Shared, s: usize, d: &StreamDriver, task: Arc<TaskShared>) -> InFlight {
    let Launch {
        waits,
        preds,
        accesses,
        body,
    } = take_launch(&task);
    let mut err = None;
    for &(j, n) in &waits {
        shared.streams[j as usize].launched.wait_at_least(n);
        let pred = preds.iter().find(|p| p.stream == j && p.seq == n);
        if let Some(ev) = pred.and_then(|p| p.event.get()) {
            if let Err(e) = d.stream.wait_event(ev) {
                err.get_or_insert(device_error("cuStreamWaitEvent", e));
            }
        }
    }
    let start = if shared.profiling {
        d.record().ok()
    } else {
        None
    };
    let (outcome, checks) = match err {
        Some(e) => (Err(e), Vec::new()),
        None => run_body(&task, &preds, body, || DeviceCtx::Cuda(d.ctx())),
    };
    match d.record() {
        Ok(ev) => {
            let _ = task.event.set(ev);
        }
        Err(e) => lock(&shared.errors).push((task.id, e)),
    }
    shared.streams[s].launched.add(1);
    let outcome = match outcome {
        Ok(()) => None,
        Err(e) => {
            // Failed at launch: dependents see it as soon as they are launched.
            report(shared, &task, Err(e.clone()));
            Some(e)
        }
    };
    InFlight {
        task,
        preds,
        _accesses: accesses,
        start,
        outcome,
        checks,
    }
}

/// Completes in-flight tasks whose end events have completed, in FIFO order.
/// With `block`, waits for all of them.
fn poll(
    shared: &Shared,
    s: usize,
    d: &StreamDriver,
    inflight: &mut VecDeque<InFlight>,
    block: bool,
) {
    while let Some(f) = inflight.front() {
        let ev = f.task.event.get();
        let status = match ev {
            None => Ok(true),
            Some(ev) if block => ev.synchronize().map(|()| true),
            Some(ev) => ev.query(),
        };
        let device_err = match status {
            Ok(false) => return,
            Ok(true) => None,
            Err(e) => Some(device_error("kernel execution", e)),
        };
        let mut f = inflight.pop_front().expect("front exists");
        if f.outcome.is_none() {
            let result = match device_err {
                None => run_checks(std::mem::take(&mut f.checks)),
                Some(e) => Err(Error::TaskFailed {
                    task: f.task.name.to_string(),
                    message: e.to_string(),
                }),
            };
            report(shared, &f.task, result);
        }
        if shared.profiling {
            if let (Some(start), Some(end)) = (&f.start, f.task.event.get()) {
                if let Ok((a, b)) = d.span_ns(start, end) {
                    push_span(shared, s, &f.task, &f.preds, a, b, !f.task.failed());
                }
            }
        }
        drop(f);
        complete(shared, s);
    }
}

fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut msg = e.to_string();
    let mut src = e.source();
    while let Some(s) = src {
        msg.push_str(": ");
        msg.push_str(&s.to_string());
        src = s.source();
    }
    msg
}

/// The message of a caught panic (its `&str` or `String` payload).
pub(crate) fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_string()
    }
}

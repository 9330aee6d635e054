//! The stream thread: runs its FIFO, issuing cross-stream waits first.

use super::{Launch, Shared, TaskShared, IN_TASK_OF};
use crate::backend::DeviceCtx;
use crate::error::Error;
use crate::sync::{lock, Arc};
use crate::task::TaskCtx;
use crate::trace::{now_ns, Span};
use std::collections::VecDeque;
use std::marker::PhantomData;
use std::panic::{catch_unwind, AssertUnwindSafe};

/// Starts the thread that drives stream `s`.
pub(crate) fn spawn(shared: Arc<Shared>, s: usize) -> std::io::Result<std::thread::JoinHandle<()>> {
    let name = format!(
        "braid-r{}-{}",
        shared.rank,
        shared.streams[s].name.replace(' ', "")
    );
    std::thread::Builder::new().name(name).spawn(move || {
        crate::topo::pin_stream_thread(s);
        IN_TASK_OF.with(|c| c.set(shared.runtime_id));
        let mut batch = VecDeque::new();
        while shared.streams[s].queue.pop_batch(&mut batch) {
            while let Some(l) = batch.pop_front() {
                execute(&shared, s, l);
            }
        }
    })
}

fn execute(shared: &Shared, s: usize, task: Arc<TaskShared>) {
    let Some(Launch {
        waits,
        preds,
        accesses,
        body,
    }) = lock(&task.launch).take()
    else {
        unreachable!("a task is queued once")
    };
    for &(j, n) in &waits {
        shared.streams[j as usize].done.wait_at_least(n);
    }
    let start = if shared.profiling { now_ns() } else { 0 };
    let outcome = match preds.iter().find(|p| p.failed()) {
        Some(p) => {
            drop(body);
            Err(Error::DependencyFailed {
                task: task.name.to_string(),
                cause: p.name.to_string(),
            })
        }
        None => {
            let ctx = TaskCtx::new(
                &task.name,
                &accesses,
                s,
                shared.rank,
                DeviceCtx::Cpu(PhantomData),
            );
            match catch_unwind(AssertUnwindSafe(|| body(&ctx))) {
                Ok(Ok(())) => Ok(()),
                // A collective's own error (timeout, mismatch, poisoned
                // communicator) already names the collective: keep it.
                Ok(Err(e)) => Err(match e.downcast::<Error>() {
                    Ok(e) if matches!(*e, Error::Collective { .. }) => *e,
                    Ok(e) => Error::TaskFailed {
                        task: task.name.to_string(),
                        message: error_chain(&*e),
                    },
                    Err(e) => Error::TaskFailed {
                        task: task.name.to_string(),
                        message: error_chain(&*e),
                    },
                }),
                Err(panic) => Err(Error::TaskPanicked {
                    task: task.name.to_string(),
                    message: panic_message(&*panic),
                }),
            }
        }
    };
    if shared.profiling {
        let end = now_ns();
        lock(&shared.streams[s].spans).push(Span {
            id: task.id,
            name: task.name.clone(),
            kind: task.kind,
            stream: s,
            start_ns: start,
            end_ns: end,
            preds: preds.iter().map(|p| p.id).collect(),
            ok: outcome.is_ok(),
        });
    }
    if let Err(e) = &outcome {
        if !matches!(e, Error::DependencyFailed { .. }) {
            lock(&shared.errors).push((task.id, e.clone()));
        }
    }
    task.finish(outcome);
    let seq = task.seq;
    // Release the buffers before announcing completion, so memory is free once
    // a synchronisation point returns.
    drop(accesses);
    drop(preds);
    debug_assert_eq!(shared.streams[s].done.get() + 1, seq);
    shared.streams[s].done.add(1);
    shared.completed.add(1);
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

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_string()
    }
}

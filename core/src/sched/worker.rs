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

use super::replay::{join_error, ExternalIndex, Run, JOIN};
use super::{live, tenants};
use super::{
    skip_on, status_of, Item, Launch, Shared, TaskBody, TaskShared, FAILED, IN_TASK_OF, OK,
};
use crate::backend::gpu::{device_error, StreamDriver};
use crate::backend::DeviceCtx;
use crate::clock::now_ns;
use crate::ctx::{Access, Body, Check, CommHook, SharedBody, TaskCtx};
use crate::cuda::CudaEvent;
use crate::error::Error;
use crate::kind::PlaceReason;
use crate::sync::{lock, Arc, Ordering};
use crate::trace::Span;
use smallvec::SmallVec;
use std::borrow::Cow;
use std::collections::VecDeque;
use std::marker::PhantomData;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Duration;

/// Starts the thread that drives stream `s` (a CUDA stream when `driver` is
/// given), pinned where `pin` says.
pub(crate) fn spawn(
    shared: Arc<Shared>,
    s: usize,
    driver: Option<StreamDriver>,
    pin: crate::topo::StreamPin,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    let name = format!(
        "braid-r{}-{}",
        shared.rank,
        shared.streams[s].name.replace(' ', "")
    );
    std::thread::Builder::new().name(name).spawn(move || {
        pin.bind();
        tenants::leave_inherited_policy(shared.class, shared.realtime);
        tenants::mark_program_thread(shared.class);
        if driver.is_none() {
            shared.class.enter();
            tenants::mark_stream_thread(shared.class);
        }
        if shared.realtime {
            tenants::enter_realtime();
        }
        IN_TASK_OF.with(|c| c.set(shared.runtime_id));
        match driver {
            None => run_cpu(&shared, s),
            Some(d) => run_cuda(&shared, s, d),
        }
    })
}

/// Tasks whose name's estimate is short are timed one in this many (the two
/// clock reads and the estimate's cache line cost more than such a task).
const SAMPLE_EVERY: u32 = 16;
/// From this estimate on, every task of the name is timed.
const ALWAYS_TIME_NS: u64 = 20_000;

/// Whether a CPU stream thread times this task for the cost model: always
/// when its name has no estimate yet or a long one, else one in
/// [`SAMPLE_EVERY`] (`n` counts the stream's tasks).
fn sample(shared: &Shared, task: &TaskShared, n: &mut u32) -> bool {
    if task.cost == super::cost::NO_SLOT {
        return false;
    }
    *n = n.wrapping_add(1);
    *n % SAMPLE_EVERY == 0
        || shared
            .estimates
            .get(task.cost)
            .is_none_or(|e| e >= ALWAYS_TIME_NS)
}

fn run_cpu(shared: &Shared, s: usize) {
    let mut batch = VecDeque::new();
    let mut tasks_run = 0;
    while shared.streams[s].queue.pop_batch(&mut batch) {
        while let Some(item) = batch.pop_front() {
            // A task its submitter ran inline comes first (`sched::run_inline`):
            // every later item of the stream waits for it.
            let inline = shared.streams[s].inline.load(Ordering::Acquire);
            if inline != 0 {
                shared.streams[s].done.wait_at_least(inline);
            }
            match item {
                Item::Task(task, launch) => execute(shared, s, &task, launch, &mut tasks_run),
                Item::Program(run) => run_program(shared, s, &run),
            }
        }
    }
}

/// Runs an eager task of CPU stream `s` on the calling thread: the stream's
/// own, or the submitter's for a task run inline. Issues its waits, times it
/// for the cost model (`tasks_run` counts the thread's tasks, for sampling)
/// and completes it.
pub(super) fn execute(
    shared: &Shared,
    s: usize,
    task: &TaskShared,
    launch: Launch,
    tasks_run: &mut u32,
) {
    let Launch {
        waits,
        preds,
        wait_only,
        accesses,
        body,
        comm_hook,
    } = launch;
    for &(j, n) in &waits {
        shared.streams[j as usize].done.wait_at_least(n);
    }
    let measure = sample(shared, task, tasks_run);
    let timed = shared.profiling || measure;
    tenants::admit(shared);
    let start = if timed { now_ns() } else { 0 };
    live::running(shared, s, Some((task.id, &task.name, &task.scope)));
    let (outcome, checks) = run_task(
        task,
        skip_on(&preds, wait_only),
        body,
        comm_hook,
        true,
        || DeviceCtx::Cpu(PhantomData),
    );
    live::running(shared, s, None);
    let outcome = outcome.and_then(|()| run_checks(&task.name, checks));
    let end = if timed { now_ns() } else { 0 };
    let wait = crate::trace::take_peer_wait();
    if shared.profiling {
        let ids = preds.iter().map(|p| p.id).collect();
        let span = (start, end, largest(&accesses), wait);
        push_span(shared, s, task, ids, span, outcome.is_ok());
    }
    let ok = outcome.is_ok();
    report(shared, task, outcome);
    // Release the buffers before announcing completion, so memory is
    // free once a synchronisation point returns.
    drop(accesses);
    drop(preds);
    publish(shared, s, 1);
    if measure && ok {
        // What the task occupies its stream for, the engine's own
        // per-task work included: what placement must predict.
        shared.estimates.record(task.cost, now_ns() - start);
    }
}

/// Runs stream `s`'s share of a replay: its program, step by step, with the
/// precomputed waits (positions shifted by the run's base). Each step
/// completes like an eager task (status, span), but `done[s]` and
/// `completed` advance in batches: at once only after a step another stream
/// waits for or the stream's last task (its part's end, which later tasks
/// may wait for), else at the end of the program — nothing else waits for a
/// step inside a replay, and each advance may wake a sleeping thread.
fn run_program(shared: &Shared, s: usize, run: &Run) {
    let plan = &run.plan;
    for &(j, n) in &run.entry[s] {
        shared.streams[j as usize].done.wait_at_least(n);
    }
    let external = &Failures::of(run);
    if run.sequential {
        // A graph on the CPU: every task, in the schedule's order, here;
        // the replay is one completion (its unit).
        for (i, t) in plan.tasks.iter().enumerate() {
            run_step(shared, s, run, i, (&t.body, &t.preds), external);
        }
        finish_unit(run, external);
        publish(shared, s, 1);
        return;
    }
    let mut unpublished = 0;
    // This stream's part of the replay, to the tracker (`Plan::parts`),
    // and the task it ends with (a `JOIN` matches no task).
    let end = run.ends.get(s).and_then(Option::as_ref);
    let last = end.map_or(JOIN, |e| (e.id - run.id_base) as u32);
    for step in &plan.programs[s] {
        for &(j, m) in &step.waits {
            let j = j as usize;
            shared.streams[j].done.wait_at_least(run.base[j] + m as u64);
        }
        let mut signal = step.signal;
        if step.task == JOIN {
            // Every stream's last step is complete (waited for, directly or
            // through the clocks): the replay's outcome is known.
            finish_unit(run, external);
        } else {
            let body = step.body.as_ref().expect("a task step has a body");
            let task = (body, &step.preds[..]);
            run_step(shared, s, run, step.task as usize, task, external);
            if step.task == last {
                // The part's last task: its outcome is known, and is
                // published at once (later tasks may wait for it).
                if let Some(end) = end {
                    finish_part(run, s, end, external);
                }
                signal = true;
            }
        }
        unpublished += 1;
        if signal {
            publish(shared, s, std::mem::take(&mut unpublished));
        }
    }
    publish(shared, s, unpublished);
}

/// Announces `n` completions on stream `s`. The runtime-wide count and the
/// busy period it may end come first, the stream's count last: a
/// synchronisation waits on the streams' counts, so when it returns the
/// period is recorded and the next submission sees the runtime idle.
fn publish(shared: &Shared, s: usize, n: u64) {
    if n > 0 {
        let done = shared.completed.add(n);
        live::completed(shared, done);
        shared.streams[s].done.add(n);
    }
}

/// The external predecessors of a replay run that failed, and which of its
/// tasks each one's failure skips: those whose accesses meet what the
/// schedule met of its accesses (`Run::regions`), as if the tasks were
/// submitted again; the others run. A sequential run (a graph, which runs
/// whole or not at all) is skipped whole.
struct Failures<'r> {
    run: &'r Run,
    /// The first failed one, for a sequential run.
    whole: Option<&'r Arc<TaskShared>>,
    /// The failed ones' regions by buffer, built only when one failed.
    index: Option<ExternalIndex>,
}

impl<'r> Failures<'r> {
    fn of(run: &'r Run) -> Self {
        let first = run.external.iter().find(|p| p.failed());
        let index = (first.is_some() && !run.sequential)
            .then(|| ExternalIndex::of_failed(&run.external, &run.regions));
        Failures {
            run,
            whole: first.filter(|_| run.sequential),
            index,
        }
    }

    /// The failed external predecessor task `i` depends on, if any.
    fn skips(&self, i: usize) -> Option<&'r Arc<TaskShared>> {
        if self.whole.is_some() {
            return self.whole;
        }
        let k = self.index.as_ref()?.first_met(&self.run.plan.tasks[i])?;
        Some(&self.run.external[k])
    }
}

/// Finishes a replay's unit with the first failure among its tasks, if any.
fn finish_unit(run: &Run, external: &Failures) {
    let failed = || run.failed_task(0..run.plan.len() as u32);
    finish_with(run, &run.unit, external, failed);
}

/// Finishes stream `s`'s part of a replay (`end`) with the failure of its
/// tasks, if any (`Run::part_failure`).
fn finish_part(run: &Run, s: usize, end: &TaskShared, external: &Failures) {
    finish_with(run, end, external, || run.part_failure(s));
}

/// Finishes a replay's record: failed for the failed external predecessor
/// of a sequential run, else for the task `failed` names (under the
/// external predecessor it was skipped for, else its own name, with the
/// run's first failure as the root), else done.
fn finish_with(
    run: &Run,
    record: &TaskShared,
    external: &Failures,
    failed: impl FnOnce() -> Option<u32>,
) {
    let plan = &run.plan;
    let cause = match external.whole {
        Some(p) => Some((external_cause(p), p.root_error())),
        None => failed().map(|i| match external.skips(i as usize) {
            Some(p) => (external_cause(p), p.root_error()),
            None => (
                Cow::Borrowed(plan.tasks[i as usize].name.as_ref()),
                run.root_error(),
            ),
        }),
    };
    record.finish(match cause {
        None => Ok(()),
        Some((c, root)) => Err(join_error(plan, &c, root)),
    });
}

/// The cause a replay's skip names for its failed external predecessor
/// `p`: a replay's record (its join or a stream's part) stands for the task
/// inside it that failed, which is named instead (else a replay skipped
/// behind a failed replay of the same schedule named the schedule as its
/// own cause).
fn external_cause(p: &TaskShared) -> Cow<'_, str> {
    if p.placement.reason == PlaceReason::Replayed {
        Cow::Owned(p.root_cause())
    } else {
        Cow::Borrowed(p.name.as_ref())
    }
}

/// Runs task `i` of a replay on stream `s`'s thread (its waits issued), or
/// skips it when an external predecessor or one of its own failed. `task`:
/// its body and predecessors (the program step's copies, read in sequence).
fn run_step(
    shared: &Shared,
    s: usize,
    run: &Run,
    i: usize,
    (cell, preds): (&SharedBody, &[u32]),
    external: &Failures,
) {
    let plan = &run.plan;
    let t = &plan.tasks[i];
    let id = run.id_base + i as u64;
    tenants::admit(shared);
    let start = if shared.profiling { now_ns() } else { 0 };
    live::running(shared, s, Some((id, &t.name, &t.scope)));
    let cause = match external.skips(i) {
        Some(p) => Some((external_cause(p), p.root_error())),
        None => run.failed_task(preds.iter().copied()).map(|p| {
            let name = plan.tasks[p as usize].name.as_ref();
            (Cow::Borrowed(name), run.root_error())
        }),
    };
    let outcome = match cause {
        Some((c, root)) => {
            let e = Error::DependencyFailed {
                task: t.name.to_string(),
                cause: c.to_string(),
                root,
            };
            if let Some(hook) = &t.comm_hook {
                hook.skipped(&e);
            }
            Err(e)
        }
        None => {
            // SAFETY: one thread runs a replay's task at a time: the thread
            // of its stream, or the one stream thread of a sequential run
            // (`BodyCell`'s invariant; see `sched::capture`).
            let body = unsafe { cell.get() };
            let t0 = if run.measure { now_ns() } else { 0 };
            let (r, checks) = call_body(&t.name, body, DeviceCtx::Cpu(PhantomData));
            if run.measure {
                cell.measured(now_ns() - t0);
            }
            r.and_then(|()| run_checks(&t.name, checks))
        }
    };
    live::running(shared, s, None);
    let status = note_failure(shared, id, &outcome);
    let wait_ns = crate::trace::take_peer_wait();
    if shared.profiling {
        let preds = t.preds.iter().map(|&p| run.id_base + p as u64).collect();
        lock(&shared.streams[s].spans).push(Span {
            id,
            name: t.name.clone(),
            scope: t.scope.clone(),
            kind: t.kind,
            stream: s,
            start_ns: start,
            end_ns: now_ns(),
            preds,
            ok: status == OK,
            placement: super::replay::replayed(plan),
            bytes: largest(&t.accesses),
            wait_ns,
        });
    }
    if status != OK {
        if let Err(e) = &outcome {
            run.note_root(e);
        }
        run.fail(i, status);
    }
}

/// Runs completion checks of task `name` in order; the first error wins. A
/// check is program code (`TaskCtx::on_complete`): its panic fails the task,
/// never the stream thread.
fn run_checks(name: &str, checks: Vec<Check>) -> Result<(), Error> {
    checks.into_iter().try_for_each(|c| {
        catch_unwind(AssertUnwindSafe(c)).unwrap_or_else(|panic| {
            Err(Error::TaskPanicked {
                task: name.to_string(),
                message: format!("in a completion check: {}", panic_message(&*panic)),
            })
        })
    })
}

/// Drops a task's body: the values it captured are program code too, and a
/// panic in one of their `Drop`s must not end the stream thread (its tasks
/// would never finish). Returns that panic as the task's error.
fn drop_body(name: &str, body: impl Sized) -> Result<(), Error> {
    catch_unwind(AssertUnwindSafe(move || drop(body))).map_err(|panic| Error::TaskPanicked {
        task: name.to_string(),
        message: format!("dropping its body: {}", panic_message(&*panic)),
    })
}

/// Runs a task's body unless a predecessor failed (then calls its skip
/// hook); catches panics. Returns the outcome and the checks the body
/// registered for its completion. `measure`: time a recorded body for the
/// cost model.
fn run_task<'a>(
    task: &'a TaskShared,
    preds: &[Arc<TaskShared>],
    body: TaskBody,
    comm_hook: Option<CommHook>,
    measure: bool,
    device: impl FnOnce() -> DeviceCtx<'a>,
) -> (Result<(), Error>, Vec<Check>) {
    if let Some(p) = preds.iter().find(|p| p.failed()) {
        // (The join of a replay names the task of the replay that failed,
        // through a part of a split graph replay: `sched::split`; so does a
        // task of a materialised replay, skipped behind another replay.)
        let cause = match body {
            TaskBody::Join => p.root_cause(),
            _ if task.placement.reason == PlaceReason::Replayed => external_cause(p).into_owned(),
            _ => p.name.to_string(),
        };
        let _ = drop_body(&task.name, body);
        let e = Error::DependencyFailed {
            task: task.name.to_string(),
            cause,
            root: p.root_error(),
        };
        if let Some(hook) = comm_hook {
            hook.skipped(&e);
        }
        return (Err(e), Vec::new());
    }
    match body {
        TaskBody::Once(mut b) => {
            let (r, checks) = call_body(&task.name, &mut b, device());
            let dropped = drop_body(&task.name, b);
            (r.and(dropped), checks)
        }
        TaskBody::Shared(b) => {
            let t0 = if measure { now_ns() } else { 0 };
            // SAFETY: stream threads run the tasks of their own stream only,
            // one at a time, and calls of a recorded body never overlap
            // (`BodyCell`'s invariant).
            let body = unsafe { b.get() };
            let r = call_body(&task.name, body, device());
            if measure {
                b.measured(now_ns() - t0);
            }
            r
        }
        TaskBody::Join => (Ok(()), Vec::new()),
        TaskBody::Graph(g) => {
            // A captured collective's hooks register completion checks.
            let d = device();
            let r = g.launch(&d);
            (r, d.cuda().map_or_else(Vec::new, |c| c.take_checks()))
        }
    }
}

/// Calls a body in its context; catches panics and names the task in errors.
pub(super) fn call_body<'a>(
    name: &'a str,
    body: &mut Body,
    device: DeviceCtx<'a>,
) -> (Result<(), Error>, Vec<Check>) {
    let ctx = TaskCtx::new(name, device);
    let outcome = match catch_unwind(AssertUnwindSafe(|| body(&ctx))) {
        Ok(Ok(())) => Ok(()),
        // A collective's own error (timeout, mismatch, poisoned communicator)
        // already names the collective and its rank: keep it as it is.
        Ok(Err(e)) => match e.downcast::<Error>() {
            Ok(e) if matches!(*e, Error::Collective { .. }) => Err(*e),
            Ok(e) => Err(Error::TaskFailed {
                task: name.to_string(),
                message: error_chain(&*e),
            }),
            Err(e) => Err(Error::TaskFailed {
                task: name.to_string(),
                message: error_chain(&*e),
            }),
        },
        Err(panic) => Err(Error::TaskPanicked {
            task: name.to_string(),
            message: panic_message(&*panic),
        }),
    };
    (outcome, ctx.take_checks())
}

/// Publishes a task's final status; root failures go to the error list.
fn report(shared: &Shared, task: &TaskShared, outcome: Result<(), Error>) {
    note_failure(shared, task.id, &outcome);
    task.finish(outcome);
}

/// The status `outcome` publishes; a root failure (not a skip) of task `id`
/// goes to the error list, to be reported once at a synchronisation point.
fn note_failure(shared: &Shared, id: u64, outcome: &Result<(), Error>) -> u8 {
    let status = status_of(outcome);
    if let (FAILED, Err(e)) = (status, outcome) {
        lock(&shared.errors).push((id, e.clone()));
    }
    status
}

/// The largest declared access in bytes (a span's `bytes`).
fn largest(accesses: &[Access]) -> u64 {
    accesses
        .iter()
        .map(|a| a.view.len() as u64)
        .max()
        .unwrap_or(0)
}

/// Records a span; `(start_ns, end_ns, bytes, wait_ns)` as [`Span`] has
/// them.
fn push_span(
    shared: &Shared,
    s: usize,
    task: &TaskShared,
    preds: SmallVec<[u64; 4]>,
    (start_ns, end_ns, bytes, wait_ns): (u64, u64, u64, u64),
    ok: bool,
) {
    lock(&shared.streams[s].spans).push(Span {
        id: task.id,
        name: task.name.clone(),
        scope: task.scope.clone(),
        kind: task.kind,
        stream: s,
        placement: task.placement,
        start_ns,
        end_ns,
        preds,
        ok,
        bytes,
        wait_ns,
    });
}

/// A launched CUDA task waiting for its end event.
struct InFlight {
    task: Arc<TaskShared>,
    preds: SmallVec<[Arc<TaskShared>; 4]>,
    /// Keeps the task's buffers alive until its work is complete on the
    /// device (semantics 7); read only for the span's `bytes`.
    accesses: SmallVec<[Access; 4]>,
    /// A graph launch's body (the captured step), kept until the graph has
    /// run: the step's plan holds the graph's buffers (the launch has no
    /// accesses of its own).
    _graph: Option<TaskBody>,
    start: Option<CudaEvent>,
    /// `Some` when the task failed or was skipped at launch.
    outcome: Option<Error>,
    /// Run when the end event has completed (`TaskCtx::on_complete`).
    checks: Vec<Check>,
    /// What it charged a best-effort stream's window
    /// ([`tenants::DeviceBundle`]).
    charged: u64,
}

fn run_cuda(shared: &Shared, s: usize, d: StreamDriver) {
    if let Err(e) = d.stream.device().bind_to_thread() {
        lock(&shared.errors).push((u64::MAX, Error::from(e)));
    }
    let mut batch = VecDeque::new();
    let mut inflight: VecDeque<InFlight> = VecDeque::new();
    // A best-effort stream keeps about a bundle of device work in flight.
    let mut bundle = (shared.class == crate::kind::Class::BestEffort)
        .then(|| tenants::DeviceBundle::new(shared.device_bundle_ns));
    loop {
        let open = if inflight.is_empty() {
            shared.streams[s].queue.pop_batch(&mut batch)
        } else {
            shared.streams[s]
                .queue
                .pop_batch_timeout(&mut batch, Duration::from_micros(50))
        };
        while let Some(item) = batch.pop_front() {
            let (task, launch) = match item {
                Item::Task(task, launch) => (task, launch),
                // CUDA replays are materialised as tasks (`replay::submit`).
                Item::Program(run) => {
                    let e = Error::Config("a replay program reached a CUDA stream".into());
                    lock(&shared.errors).push((run.unit.id, e));
                    continue;
                }
            };
            // Best effort launches nothing while latency-critical work is
            // unfinished, and keeps at most about a bundle in flight: the
            // device queue it leaves is what a latency-critical kernel may
            // wait behind.
            let charged = bundle.as_mut().map(|b| {
                let ns = b.charge(task.cost);
                while b.full(ns) && !inflight.is_empty() {
                    wait_oldest(shared, s, &d, &mut inflight, b);
                }
                ns
            });
            tenants::admit(shared);
            inflight.push_back(launch_cuda(shared, s, &d, task, launch, charged));
            if let (Some(b), Some(ns)) = (&mut bundle, charged) {
                b.launched(ns);
            }
            poll(shared, s, &d, &mut inflight, false, bundle.as_mut());
        }
        let drain = !open;
        poll(shared, s, &d, &mut inflight, drain, bundle.as_mut());
        if drain && inflight.is_empty() && batch.is_empty() {
            break;
        }
    }
}

/// Waits for the oldest of a best-effort stream's tasks in flight to
/// complete on the device, and completes what has.
fn wait_oldest(
    shared: &Shared,
    s: usize,
    d: &StreamDriver,
    inflight: &mut VecDeque<InFlight>,
    bundle: &mut tenants::DeviceBundle,
) {
    if let Some(ev) = inflight.front().and_then(|f| f.task.event.get()) {
        // An error shows again in `poll`, which reports it.
        let _ = ev.synchronize();
    }
    let before = inflight.len();
    poll(shared, s, d, inflight, false, Some(bundle));
    if inflight.len() == before {
        // Its event could not be waited for: let `poll` block (and report).
        poll(shared, s, d, inflight, true, Some(bundle));
    }
}

/// Launches `task` on stream `s` (its waits, its body, its end event). A
/// task `charged` to a best-effort stream's window (or any, when
/// profiling) also records a start event, for its device time.
fn launch_cuda(
    shared: &Shared,
    s: usize,
    d: &StreamDriver,
    task: Arc<TaskShared>,
    launch: Launch,
    charged: Option<u64>,
) -> InFlight {
    let Launch {
        waits,
        preds,
        wait_only,
        accesses,
        body,
        comm_hook,
    } = launch;
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
    let start = if shared.profiling || charged.is_some() {
        d.record().ok()
    } else {
        None
    };
    let graph = match &body {
        TaskBody::Graph(g) => Some(TaskBody::Graph(g.clone())),
        _ => None,
    };
    let (outcome, checks) = match err {
        Some(e) => (Err(e), Vec::new()),
        // No measurement on CUDA: a body's host time is its launch, and
        // schedules are not re-placed there.
        None => run_task(
            &task,
            skip_on(&preds, wait_only),
            body,
            comm_hook,
            false,
            || DeviceCtx::Cuda(d.ctx()),
        ),
    };
    let outcome = match d.record() {
        Ok(ev) => {
            let _ = task.event.set(ev);
            outcome
        }
        Err(e) => {
            // Without an end event nothing can wait for the task on the
            // device or tell when it has finished: it fails (so a dependent
            // on another stream is skipped, not run unordered after it), and
            // the stream drains first, so that its buffers are not released
            // under its work.
            let _ = d.stream.synchronize();
            outcome.and(Err(e))
        }
    };
    let outcome = match outcome {
        Ok(()) => None,
        Err(e) => {
            // Failed at launch: reported before the launch is published
            // (below), so a dependent on another stream that waits for
            // the launch then sees the failure and is skipped.
            report(shared, &task, Err(e.clone()));
            Some(e)
        }
    };
    shared.streams[s].launched.add(1);
    InFlight {
        task,
        preds,
        accesses,
        _graph: graph,
        start,
        outcome,
        checks,
        charged: charged.unwrap_or(0),
    }
}

/// Completes in-flight tasks whose end events have completed, in FIFO order
/// (and frees what they charged `bundle`, with their device times). With
/// `block`, waits for all of them.
fn poll(
    shared: &Shared,
    s: usize,
    d: &StreamDriver,
    inflight: &mut VecDeque<InFlight>,
    block: bool,
    mut bundle: Option<&mut tenants::DeviceBundle>,
) {
    while let Some(f) = inflight.front() {
        let ev = f.task.event.get();
        let status = match ev {
            None => Ok(true),
            Some(ev) if block => ev.synchronize().map(|()| true),
            Some(ev) => ev.query(),
        };
        let device_err = match status {
            Ok(false) => break,
            Ok(true) => None,
            Err(e) => Some(device_error("kernel execution", e)),
        };
        let mut f = inflight.pop_front().expect("front exists");
        if f.outcome.is_none() {
            let result = match device_err {
                None => run_checks(&f.task.name, std::mem::take(&mut f.checks)),
                Some(e) => Err(Error::TaskFailed {
                    task: f.task.name.to_string(),
                    message: e.to_string(),
                }),
            };
            report(shared, &f.task, result);
        }
        let span = match (&f.start, f.task.event.get()) {
            (Some(start), Some(end)) => d.span_ns(start, end).ok(),
            _ => None,
        };
        if let Some(b) = bundle.as_deref_mut() {
            b.completed(
                f.task.cost,
                f.charged,
                span.map(|(a, z)| z.saturating_sub(a)),
            );
        }
        if let (true, Some((a, b))) = (shared.profiling, span) {
            let ids = f.preds.iter().map(|p| p.id).collect();
            // NCCL waits for the other ranks on the device.
            let span = (a, b, largest(&f.accesses), 0);
            push_span(shared, s, &f.task, ids, span, !f.task.failed());
        }
        drop(f);
        publish(shared, s, 1);
    }
    if shared.live {
        publish_running(shared, s, d, inflight.front());
    }
}

/// Live view: what a CUDA stream runs is its oldest unfinished task, once
/// its start event has completed (before that the device is still on the
/// task before it, or waiting for another stream), timed from that event.
fn publish_running(shared: &Shared, s: usize, d: &StreamDriver, front: Option<&InFlight>) {
    let started = front.and_then(|f| {
        let start = f.start.as_ref()?;
        if !start.query().ok()? {
            return None;
        }
        let (at, _) = d.span_ns(start, start).ok()?;
        Some(((f.task.id, &f.task.name, &f.task.scope), at))
    });
    let shown = lock(&shared.streams[s].running).as_ref().map(|r| r.id);
    if shown != started.as_ref().map(|((id, _, _), _)| *id) {
        live::running_since(shared, s, started);
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

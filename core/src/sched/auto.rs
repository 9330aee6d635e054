//! Automatic replay: the runtime notices a program repeating a step and
//! stops re-analysing it.
//!
//! A *step* is what is submitted between two `Runtime::synchronize` calls (a
//! training loop synchronises once per step). Each submitted task is hashed
//! as it comes — name, kind, priority, pinned stream, comm stream, scope
//! path, and every access (buffer, byte range, mode) — into a running hash
//! of the step. A task whose scope the placement file gives `replay = false`
//! counts as foreign (below): its step is never memoised.
//!
//! * **Predict.** At each boundary the step's signature (hash, length)
//!   joins a history of the last 8. The next step is predicted from it: the
//!   step one period back, for the shortest period of 1 to 4 steps that the
//!   last two periods repeat with (a plain loop has period 1; one that
//!   alternates two data buffers, period 2); without a period, the plan the
//!   last step followed.
//! * **Record.** If the predicted step has no plan yet and has occurred
//!   three times in the history, the next step runs eagerly while a recorder
//!   (the explicit recorder, without bodies) keeps its analysis. At its end
//!   the plan is kept, under the step's signature, if that step is one that
//!   occurred three times (up to 4 plans, the oldest dropped first).
//! * **Replay.** Each task of a following step is checked against the plan's
//!   task at the same position (hash) and, if it matches, is submitted with
//!   the plan's stream, waits and predecessors, and its *own* new body: no
//!   inference, no placement. The step starts right after a
//!   synchronisation, so nothing earlier is unfinished (checked), and
//!   positions are shifted by each stream's sequence number at the step's
//!   first task. A step that followed its plan to the boundary hands its
//!   tasks, which may still run, to the next eager submission (`pending`).
//! * **Divergence** (a task that does not match, an explicit edge, a
//!   submission the plan did not foresee): the tasks submitted so far in the
//!   step are entered into the tracker, in order, as eager submission would
//!   have, and the step continues eagerly — nothing is lost. The plan stays
//!   (a program that evaluates every few steps, or reads a result after its
//!   loop, comes back to it: the next step is predicted to follow it again);
//!   after two steps in a row leave it, it is dropped.
//!
//! A step that ends early (fewer tasks) needs nothing: every task it did
//! submit was placed consistently.

use super::cost::{mix, mix_bytes};
use super::replay::{Plan, Recorder};
use super::{Clock, Launch, NewTask, Record, Shared, SubmitState, TaskBody, TaskShared};
use crate::graph::{Mode, TaskRef, Tracker};
use crate::kind::{PlaceReason, Placement};
use crate::sync::Arc;
use smallvec::SmallVec;
use std::ops::Range;

/// Occurrences of a step among the last [`HISTORY`] before the next one
/// expected to equal it is recorded.
const SEEN: usize = 3;

/// Steps remembered for detecting repetition.
const HISTORY: usize = 8;

/// The longest period detected: steps that repeat every 1 to 4 steps
/// (double-buffered data alternates two steps).
const MAX_PERIOD: usize = 4;

/// Memoised plans kept (the oldest is dropped for a new one).
const PLANS: usize = 4;

/// Steps in a row that leave a memoised plan before it is dropped.
const MISSES: u32 = 2;

/// A step's identity: the hash of its tasks and their count.
type Sig = (u64, u64);

/// What automatic replay keeps between submissions.
#[derive(Default)]
pub(crate) struct Auto {
    /// The running hash and length of the current step.
    hash: u64,
    len: u64,
    /// The last steps' signatures, oldest first.
    history: std::collections::VecDeque<Sig>,
    /// Memoised plans not in use, oldest first.
    plans: Vec<(Sig, Box<Memo>)>,
    /// The plan the last step followed to its end (expected again when the
    /// history shows no period: after a step that left it).
    last: Option<Sig>,
    /// The hashes of the step being recorded.
    recorded: Vec<u64>,
    /// Foreign events so far (each makes its step unique).
    foreign: u64,
    state: State,
    /// The last step's tasks submitted through its plan, when it ended
    /// (`boundary`) still on the plan: the tracker does not hold them, and
    /// they may still run. The next submission that is not the first of a
    /// memoised step with nothing unfinished before it enters them into
    /// the tracker (`diverge`), so that it is ordered after them; that first
    /// task drops them (they have all finished).
    pending: Steps,
}

/// Tasks submitted through a plan and their accesses as the tracker records
/// them, task `i`'s at `touches[at[i]..at[i + 1]]` (one flat list, its
/// capacity kept from step to step).
struct Steps {
    /// By position; `None` once a task has completed without error
    /// (`Memo::sweep`): it gives no edges to later tasks or to a divergence.
    made: Vec<Option<Arc<TaskShared>>>,
    /// `(buffer, range, mode)`: no buffer handles, so no reference counts
    /// touched per task.
    touches: Vec<Touch>,
    at: Vec<u32>,
}

impl Default for Steps {
    fn default() -> Self {
        Steps {
            made: Vec::new(),
            touches: Vec::new(),
            at: vec![0],
        }
    }
}

impl Steps {
    /// Enters the tasks still held into the tracker, in submission order,
    /// as eager submission would have.
    fn enter(&self, tracker: &mut Tracker<Arc<TaskShared>>) {
        for (i, task) in self.made.iter().enumerate() {
            let Some(task) = task else { continue };
            for (buf, range, mode) in &self.touches[self.at[i] as usize..self.at[i + 1] as usize] {
                tracker.record(*buf, range.clone(), *mode, task);
            }
        }
    }

    fn clear(&mut self) {
        self.made.clear();
        self.touches.clear();
        self.at.clear();
        self.at.push(0);
    }
}

#[derive(Default)]
enum State {
    #[default]
    Observe,
    Record,
    Replay(Sig, Box<Memo>),
}

/// One access as the tracker records it: buffer, byte range, mode.
type Touch = (u64, Range<usize>, Mode);

/// A memoised step and the progress of the current one through it.
struct Memo {
    plan: Plan,
    hashes: Vec<u64>,
    /// Tasks of the current step submitted so far through the plan (swept
    /// as it goes: the step should not hold every task record until its
    /// end).
    step: Steps,
    /// Positions before this one hold no unfinished task.
    swept: usize,
    /// Each stream's sequence number before the step.
    base: Clock,
    /// The current step left the plan.
    diverged: bool,
    /// Steps in a row, up to the last finished one, that left the plan.
    misses: u32,
}

/// A task's identity for repetition: everything its analysis depends on.
pub(crate) fn task_hash(t: &NewTask) -> u64 {
    let mut h = mix_bytes(0xcbf2_9ce4_8422_2325, t.name.as_bytes());
    h = mix(h, t.name.len() as u64);
    h = mix(h, t.kind as u64 | (t.priority as u64) << 8);
    h = mix(h, t.stream.map_or(u64::MAX, |s| s as u64));
    h = mix(h, t.comm_index as u64);
    // The scope decides placement (the placement file): part of the identity.
    h = mix(h, t.scope.as_ref().map_or(0, |s| s.hash));
    for a in &t.accesses {
        h = mix(h, a.view.buf.id());
        h = mix_range(h, a.view.range());
        h = mix(h, a.mode as u64);
    }
    h
}

/// Mixes a byte range into `h`, every bit of both ends (its start and end
/// once shared a word, the end shifted up 32 bits: views 4 GiB apart
/// hashed alike, and a step memoised on one replayed the other's waits).
fn mix_range(h: u64, r: std::ops::Range<usize>) -> u64 {
    mix(mix(h, r.start as u64), r.end as u64)
}

impl Auto {
    /// Notes a task about to be submitted; returns whether it matches the
    /// memoised step at its position (then `submit_memoised` must be called).
    /// On a mismatch during a replayed step, enters the step's tasks so far
    /// into the tracker first (see `diverge`).
    pub(crate) fn admit(st: &mut SubmitState, shared: &Shared, t: &NewTask, h: u64) -> bool {
        let Some(auto) = st.auto.as_mut() else {
            return false;
        };
        auto.hash = mix(auto.hash, h);
        auto.len += 1;
        if matches!(auto.state, State::Record) {
            auto.recorded.push(h);
        }
        let explicit = st.recorder.is_some();
        let fits = match &auto.state {
            State::Replay(_, m) => {
                let i = m.step.made.len();
                !m.diverged
                    && t.after.is_empty()
                    && !explicit
                    && i < m.hashes.len()
                    && m.hashes[i] == h
                    && fits_stream(&st.placed, m, i)
                    // The step starts with nothing unfinished (its first task
                    // follows a synchronisation, and no other thread slipped in).
                    && (i > 0 || all_done(shared, &st.placed))
            }
            _ => false,
        };
        if !fits {
            diverge(st);
        } else if !auto.pending.made.is_empty() {
            // The first task of a step, with everything before it finished.
            auto.pending.clear();
        }
        fits
    }

    /// A step boundary (`Runtime::synchronize`, under the lock): files the
    /// step that ended (a plan followed or left, a recording kept), then
    /// predicts the next step from the history and readies its plan, or a
    /// recording of it.
    pub(crate) fn boundary(st: &mut SubmitState) {
        let Some(mut auto) = st.auto.take() else {
            return;
        };
        let sig = (auto.hash, auto.len);
        (auto.hash, auto.len) = (0, 0);
        if sig.1 == 0 {
            // Nothing submitted since the last synchronisation: not a step.
            st.auto = Some(auto);
            return;
        }
        // This step's occurrences, itself included (before it joins the
        // history, which may drop the oldest entry).
        let seen = auto.occurrences(sig) + 1;
        match std::mem::take(&mut auto.state) {
            State::Observe => {}
            State::Replay(s, mut m) => {
                let followed = !m.diverged && m.step.made.len() == m.hashes.len();
                if !m.diverged {
                    // What the tracker must learn before the next eager
                    // submission (`pending`: empty here, as the step's
                    // first submission, `admit` or `foreign`, emptied it);
                    // the memo takes the emptied lists back.
                    debug_assert!(auto.pending.made.is_empty());
                    std::mem::swap(&mut auto.pending, &mut m.step);
                }
                m.misses = if followed { 0 } else { m.misses + 1 };
                if followed {
                    auto.last = Some(s);
                }
                if m.misses < MISSES {
                    m.restart();
                    auto.keep(s, m);
                } else if auto.last == Some(s) {
                    auto.last = None;
                }
            }
            State::Record => match st.recorder.take() {
                Some(rec) if rec.is_auto() => {
                    let hashes = std::mem::take(&mut auto.recorded);
                    // Keep it if the step is one that repeats.
                    if seen >= SEEN && !auto.plans.iter().any(|(s, _)| *s == sig) {
                        let plan = Plan::new("step".into(), rec.into_tasks(), st.placed.len());
                        if let Some(m) = Memo::new(plan, hashes) {
                            auto.keep(sig, m);
                        }
                    }
                }
                // An explicit recording took over.
                other => st.recorder = other.filter(|r| !r.is_auto()),
            },
        }
        auto.history.push_back(sig);
        if auto.history.len() > HISTORY {
            auto.history.pop_front();
        }
        auto.state = match auto.predict() {
            Some(next) => match auto.plans.iter().position(|(s, _)| *s == next) {
                Some(i) => {
                    let (s, m) = auto.plans.remove(i);
                    State::Replay(s, m)
                }
                None if auto.occurrences(next) >= SEEN && st.recorder.is_none() => {
                    st.recorder = Some(Recorder::with_bodies(st.next_id, false));
                    State::Record
                }
                None => State::Observe,
            },
            None => State::Observe,
        };
        auto.recorded.clear();
        st.auto = Some(auto);
    }

    /// The next step's signature as the history predicts it: the step one
    /// period back, for the shortest period (1 to [`MAX_PERIOD`]) the last
    /// two periods repeat with; else the plan last followed.
    fn predict(&self) -> Option<Sig> {
        let h = &self.history;
        let n = h.len();
        (1..=MAX_PERIOD)
            .find(|&p| n >= 2 * p && (1..=p).all(|i| h[n - i] == h[n - i - p]))
            .map(|p| h[n - p])
            .or(self.last)
    }

    /// How many of the remembered steps have signature `sig`.
    fn occurrences(&self, sig: Sig) -> usize {
        self.history.iter().filter(|&&h| h == sig).count()
    }

    /// Files a plan not in use, dropping the oldest beyond [`PLANS`].
    fn keep(&mut self, sig: Sig, m: Box<Memo>) {
        self.plans.retain(|(s, _)| *s != sig);
        if self.plans.len() == PLANS {
            self.plans.remove(0);
        }
        self.plans.push((sig, m));
    }

    /// Something the plan does not know about enters the step (a replay of
    /// an explicit schedule, an explicit recording): leave the memoised step
    /// and make this step unlike any other, so it is never memoised (its
    /// analysis would miss what the foreign work did).
    pub(crate) fn foreign(st: &mut SubmitState) {
        diverge(st);
        if let Some(auto) = st.auto.as_mut() {
            auto.foreign += 1;
            auto.hash = mix(auto.hash, 0x5eed ^ auto.foreign);
            auto.len += 1;
        }
    }
}

/// Tasks submitted through a memoised step between two sweeps of it.
const SWEEP_EVERY: usize = 1024;

impl Memo {
    /// A memoised step from its plan and its tasks' hashes (`None` if they
    /// disagree).
    fn new(plan: Plan, hashes: Vec<u64>) -> Option<Box<Memo>> {
        (hashes.len() == plan.len()).then(|| {
            Box::new(Memo {
                step: Steps {
                    made: Vec::with_capacity(plan.len()),
                    ..Steps::default()
                },
                swept: 0,
                base: Clock::new(),
                plan,
                hashes,
                diverged: false,
                misses: 0,
            })
        })
    }

    /// Readies the plan for the next step.
    fn restart(&mut self) {
        self.step.clear();
        self.swept = 0;
        self.diverged = false;
    }

    /// Forgets the step's tasks that completed without error, from the
    /// first one not yet finished on: their records are freed now (by the
    /// submitting thread) instead of at the end of the step. A failed task
    /// stays (later tasks and a divergence must see it).
    fn sweep(&mut self) {
        let mut first_unfinished = None;
        for (i, slot) in self.step.made.iter_mut().enumerate().skip(self.swept) {
            let Some(t) = slot else { continue };
            if t.retired() {
                *slot = None;
            } else if !t.is_finished() && first_unfinished.is_none() {
                first_unfinished = Some(i);
            }
        }
        self.swept = first_unfinished.unwrap_or(self.step.made.len());
    }
}

/// The task at position `i` would land where the plan says: its stream's
/// sequence number has not moved since the step began (nothing else was
/// submitted to it).
fn fits_stream(placed: &[u64], m: &Memo, i: usize) -> bool {
    let s = m.plan.tasks[i].stream as usize;
    let pos = m.plan.position[i] as u64;
    let base = if i == 0 { placed[s] } else { m.base[s] };
    placed[s] == base + pos - 1
}

fn all_done(shared: &Shared, placed: &[u64]) -> bool {
    placed
        .iter()
        .zip(&shared.streams)
        .all(|(&p, s)| s.done.get() >= p)
}

/// Leaves the memoised step: the tasks submitted through it so far (after
/// the last step's still `pending`) enter the tracker, in submission order,
/// so the rest of the step is inferred against them as if it had all been
/// eager.
fn diverge(st: &mut SubmitState) {
    let Some(auto) = st.auto.as_mut() else { return };
    if !auto.pending.made.is_empty() {
        auto.pending.enter(&mut st.tracker);
        auto.pending.clear();
    }
    let State::Replay(_, m) = &mut auto.state else {
        return;
    };
    if m.diverged {
        return;
    }
    m.diverged = true;
    m.step.enter(&mut st.tracker);
    st.stats.auto_divergences += 1;
}

/// Submits `t` as the plan's next task: the plan's stream, waits and
/// predecessors (this step's tasks), its own body. Under the lock.
pub(crate) fn submit_memoised(
    st: &mut SubmitState,
    shared: &Shared,
    t: NewTask,
) -> (Arc<TaskShared>, Option<Launch>) {
    let cost = super::cost_slot(st, shared, &t);
    let Some(State::Replay(_, m)) = st.auto.as_mut().map(|a| &mut a.state) else {
        unreachable!("admitted by Auto::admit");
    };
    let i = m.step.made.len();
    if i == 0 {
        m.base = st.placed.iter().copied().collect();
    }
    let plan = &m.plan;
    let s = plan.tasks[i].stream as usize;
    // The first task of a bundled scope's entry sets the entry's stream here
    // as eager placement would (`sched::submit`): should the step diverge
    // inside the entry, its tasks placed afresh follow this one's stream
    // rather than start a bundle of their own (docs/scopes.md).
    if let Some(b) = super::ScopePlace::of(&t, st.compute).bundle {
        b.set(s);
    }
    let pos = plan.position[i];
    let step = &plan.programs[s][pos as usize - 1];
    // The plan names every wait and predecessor, finished or not; those
    // already satisfied are left out, as eager inference leaves them out
    // (and a task left with none may run inline, `hand_off`).
    let waits: SmallVec<[(u16, u64); 4]> = step
        .waits
        .iter()
        .map(|&(j, p)| (j, m.base[j as usize] + p as u64))
        .filter(|&(j, seq)| shared.streams[j as usize].done.get() < seq)
        .collect();
    let preds: SmallVec<[Arc<TaskShared>; 4]> = plan.tasks[i]
        .preds
        .iter()
        .filter_map(|&p| {
            m.step.made[p as usize]
                .as_ref()
                .filter(|t| !t.retired())
                .cloned()
        })
        .collect();
    let clock: Clock = plan.clocks[i]
        .iter()
        .zip(m.base.iter())
        .map(|(&l, &b)| b + l as u64)
        .collect();
    // `Auto::admit` checked that the stream is where the plan expects it.
    let (id, seq) = super::next_slot(&mut st.placed, &mut st.tail, &mut st.next_id, shared, s);
    debug_assert_eq!(seq, m.base[s] + pos as u64);
    st.clocks[s].clone_from(&clock);
    st.stats.tasks += 1;
    st.stats.auto_replayed += 1;
    st.stats.edges += preds.len() as u64;
    st.stats.waits += waits.len() as u64;
    let held = &mut m.step;
    held.touches.extend(
        t.accesses
            .iter()
            .map(|a| (a.view.buf.id(), a.view.range(), a.mode)),
    );
    held.at.push(held.touches.len() as u32);
    let placement = Placement {
        reason: PlaceReason::Memoised,
        usable: m.plan.used,
        priority: t.priority,
    };
    let task = TaskShared::new(Record {
        id,
        name: t.name,
        scope: t.scope.map(|s| s.path.clone()),
        kind: t.kind,
        stream: s,
        seq,
        clock,
        placement,
        eft: 0,
        cost,
    });
    let launch = Launch {
        waits,
        preds,
        wait_only: 0,
        accesses: t.accesses,
        body: TaskBody::Once(t.body),
        comm_hook: t.comm_hook,
    };
    m.step.made.push(Some(task.clone()));
    if m.step.made.len() % SWEEP_EVERY == 0 {
        m.sweep();
    }
    super::hand_off(st, shared, task, launch)
}

#[cfg(test)]
mod tests {
    #[test]
    fn ranges_that_differ_above_32_bits_hash_apart() {
        let a = super::mix_range(1, 0..16);
        assert_ne!(a, super::mix_range(1, 0..(1 << 32) + 16));
        assert_ne!(a, super::mix_range(1, 1 << 40..(1 << 40) + 16));
        assert_eq!(a, super::mix_range(1, 0..16));
    }
}

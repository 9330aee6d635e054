//! CPU collectives: N ranks that are threads of one process, each with its own
//! [`Runtime`](crate::Runtime), sharing memory.
//!
//! # Protocol
//!
//! A collective runs inside one task body per rank, on that rank's comm
//! stream thread. The ranks of a group share a [`Group`]: one mutex-guarded
//! [`State`] and one condition variable. Per rank the state holds
//!
//! * `slots[rank][k % 2]` — what the rank published for collective `k`: its
//!   index, its signature (kind with op or root, dtype, count) and raw
//!   pointers to its input and output (derived from the host slices its task
//!   body got for its declared accesses, so they point into memory a running
//!   task holds);
//! * `arrived[rank]` — the stamp `4k + phase` of the last barrier it reached
//!   (phases 1 `arrive`, 2 `reduced`, 3 `gathered`); stamps only grow;
//! * `departed[rank]` — set by the launcher once the rank's closure is over:
//!   how many collectives it issued and why it left;
//!
//! and for the group `busy` (ranks past the arrival barrier of a collective and
//! not yet out of it: the only ranks that may touch other ranks' memory) and
//! `poison` (the first failure).
//!
//! A **barrier** `(k, phase)`: under the lock, set `arrived[rank]` to the
//! stamp and notify all; then loop: if poisoned → fail; if every rank's stamp
//! is at least ours → pass; if a missing rank has departed having issued at
//! most `k` collectives → poison (it will never come) and fail; if the
//! deadline (`timeout` after arriving) passed → poison and fail; else wait on
//! the condition variable until the deadline. Poison is checked *before*
//! "everyone arrived", so once the group is poisoned no rank passes any
//! barrier — in particular no rank starts reading others' memory. The one
//! exception is a collective's **last** barrier, after which no rank reads
//! another's memory: there "everyone arrived" is checked first, so a
//! collective that every rank finished completes on every rank, even if a
//! rank that left it first poisons the group (a later failure) before a
//! slower rank wakes up at that barrier. (Without it, a rank that failed
//! right after a checkpoint's gathers could fail the other rank's last
//! gather, and with it the checkpoint.)
//!
//! A **collective** `k` on rank `r`:
//!
//! 1. Fail fast if poisoned. Take the pointers from the task's host data,
//!    publish the slot for `k` and pass barrier `(k, arrive)`. The slots are
//!    double buffered by parity: a rank can publish `k + 1` only after passing every
//!    barrier of `k`, and can reach `k + 2` only after everyone arrived at
//!    `k + 1`, so slot `k % 2` is stable while anyone still reads it.
//!    Still under the lock, compare every rank's signature; on a mismatch every
//!    rank sees the same slots and fails (the first poisons the group).
//!    Otherwise `busy += 1`.
//! 2. Move data in phases separated by barriers. No rank writes bytes that
//!    another rank reads in the same phase:
//!
//!    | collective     | phase 1 (after `arrive`)                             | phase 2 (after `reduced`)                   |
//!    |----------------|------------------------------------------------------|---------------------------------------------|
//!    | all-reduce     | reduce chunk `r` of all inputs into own output chunk `r` | copy chunk `j` of rank `j`'s output, `j ≠ r` |
//!    | reduce-scatter | reduce chunk `r` of all inputs into own output       | —                                           |
//!    | all-gather     | copy rank `j`'s input into own output chunk `j`      | —                                           |
//!    | broadcast      | copy root's input into own output                    | —                                           |
//!
//!    Phase 1 of all-reduce reads only inputs and writes only the own output
//!    chunk `r` (in place, chunk `r` of a rank's buffer is read by that rank
//!    alone, and each block is fully read before it is written); phase 2
//!    reads only chunk `j` of rank `j`'s output, which nobody writes then.
//!    In-place all-gather skips its own chunk (others read it).
//!    A final barrier (`gathered` for all-reduce, `reduced` for the others)
//!    keeps every rank inside its task — so its buffers stay alive and
//!    untouched by its other tasks — until no rank reads them any more.
//! 3. Leave: `busy -= 1`. On failure after publishing its slot — at the
//!    arrival barrier itself, at the signature check or in step 2 — a rank
//!    first waits until `busy == 0`: the group is poisoned, so every rank
//!    inside finishes its current copy, fails at its next barrier and leaves;
//!    only then may the failing rank's task end and its buffers be reused or
//!    freed. (Failing at the arrival barrier counts: another rank may have
//!    passed it, seeing this rank's arrival, just before the poison, and be
//!    reading this rank's input now. The loom model
//!    `loom_failed_arrival_waits_for_readers` checks exactly this.)
//!
//! Each element is reduced by exactly one rank, in rank order `0, 1, …, N-1`
//! (accumulating in `f32` for bf16, `i64` for i32), and every other rank copies
//! the result: results are bit-identical on every rank and do not depend on
//! thread timing. Ranks reduce their chunks in parallel.
//!
//! **Orderings.** Everything shared goes through the one mutex (from
//! `crate::sync`, so loom checks the protocol: see the models at the end of
//! this file), whose
//! unlock/lock pairs order each rank's writes of phase `p` before every other
//! rank's reads in phase `p + 1` (a rank passes a barrier only after the lock
//! showed it every other rank's arrival, made after their phase-`p` writes).
//!
//! **Shutdown and failure.** A group needs no shutdown: it is freed with its
//! last communicator. Poison is permanent (`ncclCommAbort`): later collectives
//! fail at once. A rank whose collective task is skipped (a task it depends on
//! failed) aborts the group through [`Communicator::abort`]; a rank that
//! leaves the launcher, returning or panicking, is marked departed so ranks
//! waiting for a collective it never issued fail at once instead of at the
//! timeout.

use super::{Collective, CollectiveKind, Communicator, DType, Element, HostData, ReduceOp};
use crate::access::HostBytes;
use crate::error::{Error, Result};
use crate::sync::{lock, Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Default time a rank waits for the others at one step of a collective.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

const ARRIVE: u64 = 1;
const REDUCED: u64 = 2;
const GATHERED: u64 = 3;

fn stamp(k: u64, phase: u64) -> u64 {
    4 * k + phase
}

fn phase_name(phase: u64) -> &'static str {
    match phase {
        ARRIVE => "arrive",
        REDUCED => "reduced",
        _ => "gathered",
    }
}

/// Configures a group of [`LocalComm`]s.
#[derive(Debug, Clone)]
pub struct LocalCommConfig {
    /// How long a rank waits for the others at any step of a collective
    /// before the whole group fails (default [`DEFAULT_TIMEOUT`]).
    pub timeout: Duration,
    /// Which comm stream of each rank's runtime the collectives use.
    pub comm_stream: usize,
}

impl Default for LocalCommConfig {
    fn default() -> Self {
        LocalCommConfig {
            timeout: DEFAULT_TIMEOUT,
            comm_stream: 0,
        }
    }
}

impl LocalCommConfig {
    /// Sets the timeout.
    pub fn timeout(mut self, t: Duration) -> Self {
        self.timeout = t;
        self
    }
}

/// What a rank published for one collective.
#[derive(Clone, Copy)]
struct Slot {
    index: u64,
    sig: (CollectiveKind, DType, usize),
    send: *const u8,
    recv: *mut u8,
}

// SAFETY: the pointers are only dereferenced by the protocol above, which
// makes every access to them happen while their owner is inside the task that
// declared them, and never as a data race.
unsafe impl Send for Slot {}

struct Departure {
    issued: u64,
    why: String,
}

struct State {
    slots: Vec<[Option<Slot>; 2]>,
    arrived: Vec<u64>,
    departed: Vec<Option<Departure>>,
    busy: usize,
    poison: Option<String>,
}

/// The state the ranks of one group share.
struct Group {
    world: usize,
    timeout: Duration,
    state: Mutex<State>,
    cv: Condvar,
}

impl Group {
    fn lock(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }

    fn poison_locked(&self, st: &mut State, reason: String) {
        if st.poison.is_none() {
            st.poison = Some(reason);
        }
        self.cv.notify_all();
    }

    fn poisoned_msg(st: &State) -> Option<String> {
        st.poison
            .as_ref()
            .map(|p| format!("the communicator is poisoned: {p}"))
    }

    /// Arrives at barrier `(k, phase)` and waits for every rank; `last`: the
    /// collective's last barrier (see the module docs). The time it waited
    /// goes to the running task's span (`Span::wait_ns`).
    fn barrier<'a>(
        &'a self,
        mut st: MutexGuard<'a, State>,
        rank: usize,
        k: u64,
        phase: u64,
        last: bool,
    ) -> std::result::Result<MutexGuard<'a, State>, String> {
        let target = stamp(k, phase);
        st.arrived[rank] = st.arrived[rank].max(target);
        self.cv.notify_all();
        let arrived = Instant::now();
        let deadline = arrived + self.timeout;
        let mut waited = false;
        loop {
            let missing: Vec<usize> = (0..self.world)
                .filter(|&j| st.arrived[j] < target)
                .collect();
            let poison = Self::poisoned_msg(&st);
            if missing.is_empty() && (last || poison.is_none()) {
                if waited {
                    let ns = arrived.elapsed().as_nanos();
                    crate::trace::note_peer_wait(u64::try_from(ns).unwrap_or(u64::MAX));
                }
                return Ok(st);
            }
            if let Some(m) = poison {
                return Err(m);
            }
            waited = true;
            if let Some((j, d)) = missing.iter().find_map(|&j| {
                st.departed[j]
                    .as_ref()
                    .filter(|d| d.issued <= k)
                    .map(|d| (j, d))
            }) {
                let m = format!(
                    "rank {j} left after issuing {} collective(s) ({}) and will never reach collective #{k}",
                    d.issued, d.why
                );
                self.poison_locked(&mut st, format!("rank {rank}: {m}"));
                return Err(m);
            }
            let now = Instant::now();
            if now >= deadline {
                let who: Vec<String> = missing
                    .iter()
                    .map(|&j| match st.arrived[j] {
                        0 => format!("rank {j} (no collective reached yet)"),
                        s => format!(
                            "rank {j} (last seen at collective #{}, phase `{}`)",
                            (s - 1) / 4,
                            phase_name(s % 4)
                        ),
                    })
                    .collect();
                let m = format!(
                    "timed out after {:?} in phase `{}` waiting for {}",
                    self.timeout,
                    phase_name(phase),
                    who.join(", ")
                );
                self.poison_locked(&mut st, format!("rank {rank} at collective #{k}: {m}"));
                return Err(m);
            }
            st = match self.cv.wait_timeout(st, deadline - now) {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
        }
    }

    /// Step 1 of the protocol: publish, arrive, compare signatures.
    fn arrive(&self, rank: usize, slot: Slot) -> std::result::Result<Vec<Slot>, String> {
        let mut st = self.lock();
        if let Some(m) = Self::poisoned_msg(&st) {
            return Err(m);
        }
        st.slots[rank][(slot.index % 2) as usize] = Some(slot);
        // Published: a rank that passes the arrival barrier from now on may
        // read this rank's memory, even if this rank itself fails here (the
        // poison may land between that rank passing and this one waking). So
        // a failure from here waits until no rank is inside.
        self.pass_arrival(st, rank, slot).inspect_err(|_| {
            let st = self.lock();
            self.wait_idle(st);
        })
    }

    fn pass_arrival<'a>(
        &'a self,
        st: MutexGuard<'a, State>,
        rank: usize,
        slot: Slot,
    ) -> std::result::Result<Vec<Slot>, String> {
        let k = slot.index;
        let mut st = self.barrier(st, rank, k, ARRIVE, false)?;
        let mut slots = Vec::with_capacity(self.world);
        for j in 0..self.world {
            match st.slots[j][(k % 2) as usize] {
                Some(s) if s.index == k => slots.push(s),
                _ => {
                    // Unreachable by the parity argument; fail loudly rather
                    // than read a stale slot.
                    let m =
                        format!("internal error: rank {j}'s slot for collective #{k} is missing");
                    self.poison_locked(&mut st, m.clone());
                    return Err(m);
                }
            }
        }
        // Said the same way whichever rank finds it: every rank's message
        // (its own error, or the poison the others read) lists them all.
        if slots.iter().any(|s| s.sig != slot.sig) {
            let list: Vec<String> = slots
                .iter()
                .enumerate()
                .map(|(i, s)| format!("rank {i}: {}", super::describe(s.sig.0, s.sig.1, s.sig.2)))
                .collect();
            let m = format!(
                "mismatch: the ranks issued different collectives at this position ({})",
                list.join("; ")
            );
            self.poison_locked(&mut st, format!("collective #{k} {m}"));
            return Err(m);
        }
        st.busy += 1;
        Ok(slots)
    }

    /// Barrier `(k, phase)`, not the collective's last.
    fn wait_phase(&self, rank: usize, k: u64, phase: u64) -> std::result::Result<(), String> {
        let st = self.lock();
        self.barrier(st, rank, k, phase, false).map(drop)
    }

    /// Barrier `(k, phase)`, the collective's last: no rank reads another's
    /// memory after it.
    fn wait_last(&self, rank: usize, k: u64, phase: u64) -> std::result::Result<(), String> {
        let st = self.lock();
        self.barrier(st, rank, k, phase, true).map(drop)
    }

    /// Step 3: leave the collective. After a failure, wait until no rank is
    /// inside any more (the group is poisoned, so they all come out).
    fn leave(&self, failed: bool) {
        let mut st = self.lock();
        st.busy -= 1;
        if st.busy == 0 {
            self.cv.notify_all();
        }
        if failed {
            self.wait_idle(st);
        }
    }

    /// Waits until no rank is inside a collective. Called only once the
    /// group is poisoned (every failure poisons it), so no rank enters any
    /// more and every rank inside comes out at its next barrier.
    fn wait_idle(&self, mut st: MutexGuard<'_, State>) {
        while st.busy > 0 {
            st = match self.cv.wait(st) {
                Ok(g) => g,
                Err(p) => p.into_inner(),
            };
        }
    }
}

/// One rank of a group of CPU ranks. Make a group with [`LocalComm::group`]
/// (or let [`launch`](super::launch()) do it), give each rank's thread its
/// communicator, wrap it in a [`Comm`](super::Comm) and submit collectives.
///
/// Not `Clone`: one communicator per rank, numbered by one `Comm` (whose
/// clones share the numbering).
pub struct LocalComm {
    rank: usize,
    comm_stream: usize,
    group: Arc<Group>,
}

impl std::fmt::Debug for LocalComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalComm")
            .field("rank", &self.rank)
            .field("world_size", &self.group.world)
            .field("timeout", &self.group.timeout)
            .finish()
    }
}

impl LocalComm {
    /// The communicators of a new group of `world_size` ranks, in rank order.
    pub fn group(world_size: usize, config: LocalCommConfig) -> Vec<LocalComm> {
        let group = Arc::new(Group {
            world: world_size,
            timeout: config.timeout,
            state: Mutex::new(State {
                slots: vec![[None, None]; world_size],
                arrived: vec![0; world_size],
                departed: (0..world_size).map(|_| None).collect(),
                busy: 0,
                poison: None,
            }),
            cv: Condvar::new(),
        });
        (0..world_size)
            .map(|rank| LocalComm {
                rank,
                comm_stream: config.comm_stream,
                group: group.clone(),
            })
            .collect()
    }

    /// A second handle on the same rank, for the launcher's bookkeeping
    /// (never wrapped in a second `Comm`).
    pub(crate) fn handle(&self) -> LocalComm {
        LocalComm {
            rank: self.rank,
            comm_stream: self.comm_stream,
            group: self.group.clone(),
        }
    }

    /// The timeout of the group.
    pub fn timeout(&self) -> Duration {
        self.group.timeout
    }

    /// The failure that poisoned the group, if any.
    pub fn poisoned(&self) -> Option<String> {
        self.group.lock().poison.clone()
    }

    /// Marks this rank as gone for good after issuing `issued` collectives:
    /// ranks waiting for a later one fail at once.
    pub fn depart(&self, issued: u64, why: impl Into<String>) {
        let mut st = self.group.lock();
        st.departed[self.rank] = Some(Departure {
            issued,
            why: why.into(),
        });
        self.group.cv.notify_all();
    }

    fn run_typed<T: Reduce>(
        &self,
        op: &Collective,
        data: HostData<'_>,
    ) -> std::result::Result<(), String> {
        let (send, recv) = self.pointers::<T>(op, data).inspect_err(|m| {
            let mut st = self.group.lock();
            self.group.poison_locked(
                &mut st,
                format!("rank {} at collective #{}: {m}", self.rank, op.index),
            );
        })?;
        let slot = Slot {
            index: op.index,
            sig: op.signature(),
            send: send.cast(),
            recv: recv.cast(),
        };
        let slots = self.group.arrive(self.rank, slot)?;
        let out = self.move_data::<T>(op, &slots);
        self.group.leave(out.is_err());
        out
    }

    /// The input and output of this rank, as raw pointers derived from the
    /// host slices of the task's declared accesses. After this, the rank
    /// touches its own data only through these pointers too (other ranks read
    /// it through them).
    fn pointers<T: Reduce>(
        &self,
        op: &Collective,
        data: HostData<'_>,
    ) -> std::result::Result<(*const T, *mut T), String> {
        let chunk = op.count;
        let world = self.group.world;
        Ok(match data {
            HostData::None => (std::ptr::null(), std::ptr::null_mut()),
            HostData::InPlace(bytes) => {
                let whole = match op.kind {
                    CollectiveKind::ReduceScatter(_) | CollectiveKind::AllGather => chunk * world,
                    _ => chunk,
                };
                // The root of an in-place broadcast declared a read: it is
                // only read, by every rank (it is the input, and its own
                // output is skipped as the same memory).
                let p: *mut T = match bytes {
                    HostBytes::Read(b) => read_ptr::<T>(b, op, whole, "data")?.cast_mut(),
                    HostBytes::Write(b) => write_ptr::<T>(b, op, whole, "data")?,
                };
                match op.kind {
                    CollectiveKind::ReduceScatter(_) | CollectiveKind::AllGather => {
                        // SAFETY: the data holds `count × world` elements
                        // (checked above), so chunk `rank` is inside it.
                        let mine = unsafe { p.add(self.rank * chunk) };
                        if matches!(op.kind, CollectiveKind::AllGather) {
                            (mine.cast_const(), p)
                        } else {
                            (p.cast_const(), mine)
                        }
                    }
                    _ => (p.cast_const(), p),
                }
            }
            HostData::OutOfPlace { send, recv } => {
                let (sn, rn) = match op.kind {
                    CollectiveKind::ReduceScatter(_) => (chunk * world, chunk),
                    CollectiveKind::AllGather => (chunk, chunk * world),
                    _ => (chunk, chunk),
                };
                (
                    read_ptr::<T>(send, op, sn, "input")?,
                    write_ptr::<T>(recv, op, rn, "output")?,
                )
            }
        })
    }

    /// Step 2 of the protocol.
    fn move_data<T: Reduce>(
        &self,
        op: &Collective,
        slots: &[Slot],
    ) -> std::result::Result<(), String> {
        let (r, w, k, n) = (self.rank, self.group.world, op.index, op.count);
        let send = |j: usize| slots[j].send.cast::<T>();
        let recv = |j: usize| slots[j].recv.cast::<T>();
        match op.kind {
            CollectiveKind::Barrier => Ok(()),
            CollectiveKind::AllReduce(rop) => {
                let mine = chunk_range(n, w, r);
                let inputs: Vec<*const T> = (0..w)
                    // SAFETY: every input holds `n` elements and `mine` lies in `0..n`.
                    .map(|j| unsafe { send(j).add(mine.start) })
                    .collect();
                // SAFETY: phase 1 of all-reduce: inputs are only read, our
                // output chunk `r` is written by us alone and read by nobody
                // else in this phase (see the protocol).
                unsafe { reduce::<T>(&inputs, recv(r).add(mine.start), mine.len(), rop, w) };
                self.group.wait_phase(r, k, REDUCED)?;
                for j in (0..w).filter(|&j| j != r) {
                    let c = chunk_range(n, w, j);
                    // SAFETY: phase 2: chunk `j` of rank `j`'s output is final
                    // and nobody writes it; our chunk `j` is read by nobody.
                    unsafe { copy(recv(j).add(c.start), recv(r).add(c.start), c.len()) };
                }
                self.group.wait_last(r, k, GATHERED)
            }
            CollectiveKind::ReduceScatter(rop) => {
                let inputs: Vec<*const T> = (0..w)
                    // SAFETY: every input holds `n × w` elements.
                    .map(|j| unsafe { send(j).add(r * n) })
                    .collect();
                // SAFETY: inputs are only read except our own chunk `r`, which
                // only we read; our output is read by nobody in this phase.
                unsafe { reduce::<T>(&inputs, recv(r), n, rop, w) };
                self.group.wait_last(r, k, REDUCED)
            }
            CollectiveKind::AllGather => {
                for j in 0..w {
                    // SAFETY: inputs are only read; our output chunk `j` is
                    // written by us alone; in place our own chunk is skipped.
                    let dst = unsafe { recv(r).add(j * n) };
                    if dst.cast_const() != send(j) {
                        // SAFETY: as above.
                        unsafe { copy(send(j), dst, n) };
                    }
                }
                self.group.wait_last(r, k, REDUCED)
            }
            CollectiveKind::Broadcast { root } => {
                if recv(r).cast_const() != send(root) {
                    // SAFETY: the root's input is only read; our output is
                    // written by us alone.
                    unsafe { copy(send(root), recv(r), n) };
                }
                self.group.wait_last(r, k, REDUCED)
            }
        }
    }
}

/// Checks that `len` bytes at `p` are exactly `want` aligned `T`s.
fn check_elements<T>(
    p: *const u8,
    len: usize,
    op: &Collective,
    want: usize,
    what: &str,
) -> std::result::Result<(), String> {
    if len != want * size_of::<T>() || (p as usize) % align_of::<T>() != 0 {
        return Err(format!(
            "the {what} ({len} bytes at {p:?}) is not {want} aligned elements, as {} needs",
            op.describe()
        ));
    }
    Ok(())
}

/// `bytes` as a pointer to `want` `T`s (checked), keeping its provenance:
/// read-only.
fn read_ptr<T>(
    bytes: &[u8],
    op: &Collective,
    want: usize,
    what: &str,
) -> std::result::Result<*const T, String> {
    check_elements::<T>(bytes.as_ptr(), bytes.len(), op, want, what)?;
    Ok(bytes.as_ptr().cast())
}

/// `bytes` as a pointer to `want` `T`s (checked), keeping its provenance:
/// writable.
fn write_ptr<T>(
    bytes: &mut [u8],
    op: &Collective,
    want: usize,
    what: &str,
) -> std::result::Result<*mut T, String> {
    check_elements::<T>(bytes.as_ptr(), bytes.len(), op, want, what)?;
    Ok(bytes.as_mut_ptr().cast())
}

impl Communicator for LocalComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.group.world
    }

    fn comm_stream(&self) -> usize {
        self.comm_stream
    }

    fn backend(&self) -> &'static str {
        "local"
    }

    fn run_host(&self, op: &Collective, data: HostData<'_>) -> Result<()> {
        let out = match op.dtype {
            DType::F32 => self.run_typed::<f32>(op, data),
            DType::F64 => self.run_typed::<f64>(op, data),
            DType::I32 => self.run_typed::<i32>(op, data),
            DType::Bf16 => self.run_typed::<super::Bf16>(op, data),
        };
        out.map_err(|message| Error::Collective {
            rank: self.rank,
            index: op.index,
            op: op.describe(),
            message,
        })
    }

    fn abort(&self, reason: &str) {
        let mut st = self.group.lock();
        self.group
            .poison_locked(&mut st, format!("rank {} aborted: {reason}", self.rank));
    }

    /// Departs, unless the launcher has already said why the rank left.
    fn left(&self, issued: u64) {
        let mut st = self.group.lock();
        if st.departed[self.rank].is_none() {
            st.departed[self.rank] = Some(Departure {
                issued,
                why: "its communicator was dropped".into(),
            });
            self.group.cv.notify_all();
        }
    }
}

/// Elements of chunk `j` of `n` elements split over `w` ranks (balanced; the
/// chunks tile `0..n`).
fn chunk_range(n: usize, w: usize, j: usize) -> std::ops::Range<usize> {
    (n * j / w)..(n * (j + 1) / w)
}

/// How one element type is reduced: loaded into an accumulator type, combined
/// in rank order, stored once.
trait Reduce: Element {
    type Acc: Copy + Default;
    fn load(self) -> Self::Acc;
    fn add(a: Self::Acc, b: Self::Acc) -> Self::Acc;
    fn max(a: Self::Acc, b: Self::Acc) -> Self::Acc;
    fn min(a: Self::Acc, b: Self::Acc) -> Self::Acc;
    fn div(a: Self::Acc, n: usize) -> Self::Acc;
    fn store(a: Self::Acc) -> Self;
}

macro_rules! float_reduce {
    ($t:ty) => {
        impl Reduce for $t {
            type Acc = $t;
            fn load(self) -> $t {
                self
            }
            fn add(a: $t, b: $t) -> $t {
                a + b
            }
            fn max(a: $t, b: $t) -> $t {
                a.max(b)
            }
            fn min(a: $t, b: $t) -> $t {
                a.min(b)
            }
            fn div(a: $t, n: usize) -> $t {
                a / n as $t
            }
            fn store(a: $t) -> $t {
                a
            }
        }
    };
}
float_reduce!(f32);
float_reduce!(f64);

impl Reduce for i32 {
    type Acc = i64;
    fn load(self) -> i64 {
        self as i64
    }
    fn add(a: i64, b: i64) -> i64 {
        a + b
    }
    fn max(a: i64, b: i64) -> i64 {
        a.max(b)
    }
    fn min(a: i64, b: i64) -> i64 {
        a.min(b)
    }
    fn div(a: i64, n: usize) -> i64 {
        a / n as i64
    }
    fn store(a: i64) -> i32 {
        // Wraps like an `i32` sum would.
        a as i32
    }
}

impl Reduce for super::Bf16 {
    type Acc = f32;
    fn load(self) -> f32 {
        self.to_f32()
    }
    fn add(a: f32, b: f32) -> f32 {
        a + b
    }
    fn max(a: f32, b: f32) -> f32 {
        a.max(b)
    }
    fn min(a: f32, b: f32) -> f32 {
        a.min(b)
    }
    fn div(a: f32, n: usize) -> f32 {
        a / n as f32
    }
    fn store(a: f32) -> Self {
        super::Bf16::from_f32(a)
    }
}

const BLOCK: usize = 1024;

/// `out[i] = op(inputs[0][i], …, inputs[w-1][i])` for `i < len`, in rank
/// order, block by block (each block of every input is read before the block
/// of `out` is written, so `out` may be one of the inputs).
///
/// # Safety
///
/// Every `inputs[j]` must be valid for reading `len` elements and `out` for
/// writing `len` elements, with no concurrent writes to the inputs and no
/// other access to `out`; `out` may equal an input pointer but must not
/// otherwise overlap one.
unsafe fn reduce<T: Reduce>(inputs: &[*const T], out: *mut T, len: usize, op: ReduceOp, w: usize) {
    // SAFETY: forwarded to the caller.
    unsafe {
        match op {
            ReduceOp::Sum => reduce_with(inputs, out, len, T::add, |a| a),
            ReduceOp::Avg => reduce_with(inputs, out, len, T::add, |a| T::div(a, w)),
            ReduceOp::Max => reduce_with(inputs, out, len, T::max, |a| a),
            ReduceOp::Min => reduce_with(inputs, out, len, T::min, |a| a),
        }
    }
}

/// # Safety
///
/// As [`reduce`].
unsafe fn reduce_with<T: Reduce>(
    inputs: &[*const T],
    out: *mut T,
    len: usize,
    combine: impl Fn(T::Acc, T::Acc) -> T::Acc,
    finish: impl Fn(T::Acc) -> T::Acc,
) {
    if len == 0 {
        return;
    }
    let mut acc = [T::Acc::default(); BLOCK];
    let mut off = 0;
    while off < len {
        let m = BLOCK.min(len - off);
        let acc = &mut acc[..m];
        {
            // SAFETY: `inputs[0]` is valid for `len` reads (caller) and
            // `off + m <= len`; the slice dies before `out` is written.
            let first = unsafe { std::slice::from_raw_parts(inputs[0].add(off), m) };
            for (a, x) in acc.iter_mut().zip(first) {
                *a = x.load();
            }
        }
        for p in &inputs[1..] {
            // SAFETY: as above.
            let s = unsafe { std::slice::from_raw_parts(p.add(off), m) };
            for (a, x) in acc.iter_mut().zip(s) {
                *a = combine(*a, x.load());
            }
        }
        // SAFETY: `out` is valid for `len` writes, nobody else accesses it,
        // and no slice of an input aliasing it is alive.
        let o = unsafe { std::slice::from_raw_parts_mut(out.add(off), m) };
        for (o, a) in o.iter_mut().zip(acc.iter()) {
            *o = T::store(finish(*a));
        }
        off += m;
    }
}

/// # Safety
///
/// `src` valid for `len` reads, `dst` for `len` writes, not overlapping, no
/// concurrent writes to `src` nor other accesses to `dst`.
unsafe fn copy<T>(src: *const T, dst: *mut T, len: usize) {
    if len > 0 {
        // SAFETY: forwarded to the caller.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, len) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_tile_the_range() {
        for n in [0usize, 1, 2, 7, 8, 1001] {
            for w in 1..=8 {
                let mut next = 0;
                for j in 0..w {
                    let c = chunk_range(n, w, j);
                    assert_eq!(c.start, next);
                    next = c.end;
                }
                assert_eq!(next, n);
            }
        }
    }

    /// Every rank reached a collective's last barrier, then one poisoned the
    /// group (a later failure): a rank that wakes up there only now still
    /// passes, because the collective is complete; at any other barrier
    /// the poison wins.
    #[test]
    fn a_completed_collective_completes_on_every_rank() {
        let mut comms = LocalComm::group(2, LocalCommConfig::default());
        let (c1, c0) = (comms.pop().unwrap(), comms.pop().unwrap());
        let g = c0.group.clone();
        {
            let mut st = g.lock();
            st.arrived = vec![stamp(0, REDUCED); 2];
        }
        c1.abort("rank 1 failed after the collective");
        assert!(g.wait_last(0, 0, REDUCED).is_ok());
        let e = g.wait_phase(0, 0, REDUCED).unwrap_err();
        assert!(e.contains("rank 1 failed after the collective"), "{e}");
    }

    #[test]
    fn reduce_in_rank_order_and_in_place() {
        let a = [1.0f32, 1e8, 3.0];
        let mut b = [1e-8f32, -1e8, 4.0];
        let c = [2.0f32, 1.0, -7.0];
        let out = b.as_mut_ptr();
        let inputs = [a.as_ptr(), out.cast_const(), c.as_ptr()];
        // SAFETY: all three arrays live, `out` is one of the inputs.
        unsafe { reduce::<f32>(&inputs, out, 3, ReduceOp::Sum, 3) };
        assert_eq!(b, [(1.0 + 1e-8) + 2.0, (1e8 - 1e8) + 1.0, 0.0]);
    }
}

/// loom models of the phase barrier: two ranks, one collective each. Run with
/// `RUSTFLAGS="--cfg loom" cargo test -p braid --lib --release loom`.
#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use crate::comm::Buffers;
    use loom::thread;

    const N: usize = 2;

    /// Ranks 0 and 1 of a group. No timeout: loom's condition variable never
    /// times out, so the models check that every wait is woken.
    fn ranks() -> (LocalComm, LocalComm) {
        let config = LocalCommConfig::default().timeout(Duration::from_secs(3600));
        let mut g = LocalComm::group(2, config);
        let c1 = g.pop().expect("two ranks");
        (g.pop().expect("two ranks"), c1)
    }

    fn sum() -> Collective {
        Collective {
            index: 0,
            kind: CollectiveKind::AllReduce(ReduceOp::Sum),
            dtype: DType::F32,
            count: N,
            buffers: Buffers::None,
        }
    }

    fn all_reduce(c: &LocalComm, x: &mut [f32; N]) -> Result<()> {
        let bytes = HostBytes::Write(bytemuck::cast_slice_mut(x));
        c.run_host(&sum(), HostData::InPlace(bytes))
    }

    fn busy(c: &LocalComm) -> usize {
        c.group.lock().busy
    }

    /// Both ranks pass the three phases and hold the sum; nobody is left
    /// inside.
    #[test]
    fn loom_phase_barrier_all_reduce() {
        loom::model(|| {
            let (c0, c1) = ranks();
            let t = thread::spawn(move || {
                let mut x = [10.0f32, 20.0];
                all_reduce(&c1, &mut x).expect("rank 1");
                x
            });
            let mut x = [1.0f32, 2.0];
            all_reduce(&c0, &mut x).expect("rank 0");
            assert_eq!(x, [11.0, 22.0]);
            assert_eq!(t.join().expect("rank 1 thread"), [11.0, 22.0]);
            assert_eq!(busy(&c0), 0);
        });
    }

    /// An abort while a rank waits for the other (or before it arrives) fails
    /// that rank instead of leaving it waiting.
    #[test]
    fn loom_abort_wakes_a_waiting_rank() {
        loom::model(|| {
            let (c0, c1) = ranks();
            let t = thread::spawn(move || {
                let mut x = [1.0f32, 2.0];
                let r = all_reduce(&c1, &mut x);
                (r.is_err(), busy(&c1))
            });
            c0.abort("test");
            let (failed, inside) = t.join().expect("rank 1 thread");
            assert!(failed, "rank 1 passed a barrier rank 0 never reached");
            assert_eq!(inside, 0);
        });
    }

    /// Rank 1 waits at the arrival barrier, its input published; rank 0
    /// arrives (so the barrier is passed, and rank 0 may read rank 1's input)
    /// and is then aborted. Whenever rank 1's collective fails, no rank may be
    /// inside any more: its task is about to end and its buffers to be reused.
    #[test]
    fn loom_failed_arrival_waits_for_readers() {
        loom::model(|| {
            let (c0, c1) = ranks();
            let t = thread::spawn(move || {
                let mut x = [10.0f32, 20.0];
                let r = all_reduce(&c1, &mut x);
                assert!(r.is_err(), "rank 0 never reached the second phase");
                assert_eq!(
                    busy(&c1),
                    0,
                    "rank 1 left while rank 0 could read its input"
                );
            });
            // Rank 0 by hand: publish and arrive, then abort from inside.
            let mut x = [1.0f32, 2.0];
            let p = x.as_mut_ptr();
            let slot = Slot {
                index: 0,
                sig: sum().signature(),
                send: p.cast_const().cast(),
                recv: p.cast(),
            };
            let g = c0.group.clone();
            g.arrive(0, slot).expect("nobody else poisons");
            c0.abort("test");
            assert!(g.wait_phase(0, 0, REDUCED).is_err());
            g.leave(true);
            t.join().expect("rank 1 thread");
        });
    }
}

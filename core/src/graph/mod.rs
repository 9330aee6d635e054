//! Dependency inference: which earlier tasks must a new task wait for?
//!
//! Pure bookkeeping, no threads. For every buffer the tracker keeps the
//! accesses that a future access could still conflict with:
//!
//! * `writes`: the latest writer of every byte, as non-overlapping intervals
//!   sorted by start. A new write trims the intervals it covers, because any
//!   later access that overlaps them will overlap the new write too and so be
//!   ordered after it, and the new write is itself ordered after them.
//! * `reads`: every reader since the last write of its bytes, as possibly
//!   overlapping intervals. A new write depends on *all* of them
//!   (write-after-read against every outstanding reader, not only the last one)
//!   and then trims them. A new read scans only `writes`, so a long run of
//!   readers costs each reader nothing extra.
//!
//! Edges: read-after-write, write-after-read and write-after-write, exactly
//! when two byte ranges overlap and at least one access writes.
//!
//! Records of tasks that completed successfully are pruned lazily: an edge to
//! a finished task is a no-op, so dropping it changes nothing. Records of
//! tasks that failed are kept until the failure is reported, so a dependent
//! submitted after the failure is skipped just like one submitted before it.

#[cfg(test)]
mod tests;

use smallvec::SmallVec;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::ops::Range;

/// Buffer ids are small sequential integers: hash them by identity (a
/// multiplicative mix), not with SipHash, which shows up in the per-task cost.
#[derive(Default)]
struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0.wrapping_mul(0x9e37_79b9_7f4a_7c15)
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8) | b as u64;
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
}

type IdMap<V> = HashMap<u64, V, BuildHasherDefault<IdHasher>>;

/// HEFT's priority order over a task graph: the task indices by decreasing
/// upward rank (a task's duration plus the longest path after it, `edge_ns`
/// per edge), ties in index order. When every edge goes from a lower index to
/// a higher one (`succs[i]` holds only indices above `i`: program order is
/// topological), so does the result: a task's rank exceeds each successor's
/// by at least its duration plus `edge_ns`, and equal ranks keep index order.
///
/// A recorded schedule's re-placement tries this order beside program order
/// (docs/replay.md, "The cost model"); public so a model of that placement
/// (the step simulator in `benches/`) orders tasks the same way.
pub fn upward_rank_order(dur: &[u64], succs: &[Vec<usize>], edge_ns: u64) -> Vec<usize> {
    let n = dur.len();
    let mut rank = vec![0u64; n];
    for i in (0..n).rev() {
        let after = succs[i]
            .iter()
            .map(|&s| edge_ns.saturating_add(rank[s]))
            .max()
            .unwrap_or(0);
        // Saturating: a model may give durations near u64::MAX (the step
        // simulator's absurd scales), where the sums would wrap.
        rank[i] = dur[i].saturating_add(after);
    }
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by_key(|&i| (std::cmp::Reverse(rank[i]), i));
    order
}

/// How a task touches a byte range.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Mode {
    /// Shared access: the task only reads.
    Read,
    /// Exclusive access: the task overwrites the range without reading it.
    Write,
    /// Exclusive access: the task reads and writes the range.
    ReadWrite,
}

impl Mode {
    /// Whether this access modifies the bytes.
    pub fn writes(self) -> bool {
        !matches!(self, Mode::Read)
    }

    /// Whether this access observes the bytes' earlier contents.
    pub fn reads(self) -> bool {
        !matches!(self, Mode::Write)
    }

    /// The mode's name.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Read => "read",
            Mode::Write => "write",
            Mode::ReadWrite => "read_write",
        }
    }
}

/// A task as the tracker sees it: something cheap to clone, with an identity,
/// that can say whether it finished successfully.
pub(crate) trait TaskRef: Clone {
    fn id(&self) -> u64;
    /// True once the task has completed without error (its edges are no-ops).
    fn retired(&self) -> bool;
}

#[derive(Debug, Clone)]
struct Rec<T> {
    start: usize,
    end: usize,
    task: T,
}

/// Most buffers have one writer interval and a reader or two since it: kept
/// inline, so a buffer seen for the first time costs no allocation beyond its
/// map entry (the fan-out shape names a new buffer in every task).
type Recs<T, const N: usize> = SmallVec<[Rec<T>; N]>;

#[derive(Debug)]
struct BufState<T> {
    writes: Recs<T, 1>,
    reads: Recs<T, 2>,
    /// Prune `reads` when it grows past this length (doubles after a prune that
    /// freed little, so the amortised cost per access stays constant).
    prune_at: usize,
}

impl<T> Default for BufState<T> {
    fn default() -> Self {
        BufState {
            writes: SmallVec::new(),
            reads: SmallVec::new(),
            prune_at: 16,
        }
    }
}

/// Dependency tracker over all buffers of one runtime.
#[derive(Debug)]
pub(crate) struct Tracker<T> {
    bufs: IdMap<BufState<T>>,
    /// Tasks that stand for a whole set of accesses (a replay of a recorded
    /// schedule, or one stream's part of one), each with the union of its
    /// accesses: recorded in O(1) instead of one entry per buffer, and found
    /// by `preds` like any writer or reader. An eager write over a unit's
    /// range does not trim the unit (later readers still wait for it), and
    /// units do not trim each other (a later task waits for every unit that
    /// wrote what it reads, not only the last): conservative, never wrong.
    units: Vec<(T, std::sync::Arc<Union>)>,
    /// When `bufs` reaches this many entries, the records of retired tasks
    /// are dropped (then the bound is set to twice what is left): a program
    /// that names a new buffer in every task keeps a map about the size of
    /// what is in flight, not of everything since the last synchronisation.
    prune_at: usize,
}

/// The smallest map size at which records are pruned as the map grows.
const PRUNE_FLOOR: usize = 1024;

impl<T> Default for Tracker<T> {
    fn default() -> Self {
        Tracker {
            bufs: IdMap::default(),
            units: Vec::new(),
            prune_at: PRUNE_FLOOR,
        }
    }
}

/// The accesses of a set of tasks, merged: per buffer, byte ranges and
/// whether the set writes them.
#[derive(Debug, Default)]
pub(crate) struct Union {
    by_buf: IdMap<SmallVec<[(usize, usize, bool); 1]>>,
    writes: bool,
    /// The plan whose accesses this is, whole or a stream's part of them
    /// (0: none), and whether it conflicts with that plan's whole union: a
    /// replay checks the units of the replays of its own plan still in the
    /// tracker with this bit, not a walk over every buffer.
    family: u64,
    hits_family: bool,
}

/// The source of [`Union::family`] ids (0 is none).
static FAMILIES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

impl Union {
    /// The union of `(buffer, range, writes)` accesses.
    pub(crate) fn new(accesses: impl IntoIterator<Item = (u64, Range<usize>, bool)>) -> Self {
        let mut all: Vec<(u64, bool, Range<usize>)> = accesses
            .into_iter()
            .filter(|(_, r, _)| !r.is_empty())
            .map(|(b, r, w)| (b, w, r))
            .collect();
        all.sort_by_key(|(b, w, r)| (*b, *w, r.start));
        let mut u = Union::default();
        for (b, w, r) in all {
            u.writes |= w;
            let v = u.by_buf.entry(b).or_default();
            match v.last_mut() {
                Some((_, end, lw)) if *lw == w && r.start <= *end => *end = (*end).max(r.end),
                _ => v.push((r.start, r.end, w)),
            }
        }
        u
    }

    /// A plan's unions: the whole of its accesses and, for each part (a
    /// stream's share), the part's, all of one new family.
    pub(crate) fn family(
        mut whole: Union,
        parts: impl IntoIterator<Item = Option<Union>>,
    ) -> (Union, Vec<Option<Union>>) {
        let family = FAMILIES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let parts = parts
            .into_iter()
            .map(|p| {
                p.map(|mut p| {
                    p.family = family;
                    p.hits_family = p.conflicts_with(&whole);
                    p
                })
            })
            .collect();
        whole.family = family;
        whole.hits_family = whole.writes;
        (whole, parts)
    }

    /// Whether an access of `mode` to `range` of `buf` conflicts with it.
    fn conflicts(&self, buf: u64, range: &Range<usize>, mode: Mode) -> bool {
        self.by_buf.get(&buf).is_some_and(|v| {
            v.iter()
                .any(|&(s, e, w)| (w || mode.writes()) && overlaps(range, s, e))
        })
    }

    /// Whether any access of `other` conflicts with this union.
    fn conflicts_with(&self, other: &Union) -> bool {
        let (small, big) = if self.by_buf.len() <= other.by_buf.len() {
            (self, other)
        } else {
            (other, self)
        };
        small.by_buf.iter().any(|(&b, v)| {
            v.iter().any(|&(s, e, w)| {
                let mode = if w { Mode::Write } else { Mode::Read };
                big.conflicts(b, &(s..e), mode)
            })
        })
    }
}

/// What of an earlier task's accesses a set of accesses conflicts with
/// ([`Tracker::preds_of_union`]).
#[derive(Debug, Clone)]
pub(crate) enum Region {
    /// A byte range of a buffer the task writes, or reads.
    Range {
        buf: u64,
        start: usize,
        end: usize,
        write: bool,
    },
    /// Everything a unit (a replay's part) accesses.
    Unit(std::sync::Arc<Union>),
}

impl Region {
    /// Whether an access of `mode` to `range` of `buf` conflicts with it.
    pub(crate) fn conflicts(&self, buf: u64, range: &Range<usize>, mode: Mode) -> bool {
        match self {
            Region::Range {
                buf: b,
                start,
                end,
                write,
            } => *b == buf && (*write || mode.writes()) && overlaps(range, *start, *end),
            Region::Unit(u) => u.conflicts(buf, range, mode),
        }
    }
}

fn overlaps(a: &Range<usize>, start: usize, end: usize) -> bool {
    a.start < end && start < a.end
}

fn push_unique<T: TaskRef>(out: &mut Vec<T>, t: &T) {
    if t.retired() {
        return;
    }
    let id = t.id();
    if !out.iter().any(|p| p.id() == id) {
        out.push(t.clone());
    }
}

impl<T: TaskRef> Tracker<T> {
    /// Appends to `out` every unfinished task that an access of `mode` to
    /// `range` of `buf` must wait for. Does not record the access.
    pub(crate) fn preds(&self, buf: u64, range: Range<usize>, mode: Mode, out: &mut Vec<T>) {
        if range.is_empty() {
            return;
        }
        for (t, u) in &self.units {
            if u.conflicts(buf, &range, mode) {
                push_unique(out, t);
            }
        }
        self.buffer_preds(buf, range, mode, out);
    }

    fn buffer_preds(&self, buf: u64, range: Range<usize>, mode: Mode, out: &mut Vec<T>) {
        self.buffer_hits(buf, range, mode, |r, _| push_unique(out, &r.task));
    }

    /// Calls `hit` with every record of `buf` an access of `mode` to
    /// `range` conflicts with, and whether the record is a write.
    fn buffer_hits(
        &self,
        buf: u64,
        range: Range<usize>,
        mode: Mode,
        mut hit: impl FnMut(&Rec<T>, bool),
    ) {
        let Some(st) = self.bufs.get(&buf) else {
            return;
        };
        // Writes are sorted and disjoint: skip those that end before the range.
        let first = st.writes.partition_point(|r| r.end <= range.start);
        for r in &st.writes[first..] {
            if r.start >= range.end {
                break;
            }
            hit(r, true);
        }
        if mode.writes() {
            for r in &st.reads {
                if overlaps(&range, r.start, r.end) {
                    hit(r, false);
                }
            }
        }
    }

    /// Records that `task` accesses `range` of `buf` in `mode`. Call after
    /// [`Tracker::preds`] for all of the task's accesses.
    pub(crate) fn record(&mut self, buf: u64, range: Range<usize>, mode: Mode, task: &T) {
        if range.is_empty() {
            return;
        }
        if self.bufs.len() >= self.prune_at && !self.bufs.contains_key(&buf) {
            self.prune(|t| t.retired());
            self.prune_at = (self.bufs.len() * 2).max(PRUNE_FLOOR);
        }
        let st = self.bufs.entry(buf).or_default();
        if mode.writes() {
            trim(&mut st.writes, &range);
            st.reads
                .retain_mut(|r| !(range.start <= r.start && r.end <= range.end));
            // Partly covered readers stay whole: a later write that overlaps only
            // their uncovered part must still wait for them.
            let at = st.writes.partition_point(|r| r.start < range.start);
            st.writes.insert(
                at,
                Rec {
                    start: range.start,
                    end: range.end,
                    task: task.clone(),
                },
            );
        } else {
            st.reads.push(Rec {
                start: range.start,
                end: range.end,
                task: task.clone(),
            });
            if st.reads.len() >= st.prune_at {
                st.reads.retain(|r| !r.task.retired());
                st.prune_at = (st.reads.len() * 2).max(16);
            }
        }
    }

    /// The unfinished tasks a set of accesses conflicts with, and in
    /// `regions` what of each one's accesses it conflicts with, by task id
    /// (a task may have several): what tells, if one of them fails, which
    /// of the set's accesses depended on it.
    pub(crate) fn preds_of_union(
        &self,
        union: &std::sync::Arc<Union>,
        out: &mut Vec<T>,
        regions: &mut Vec<(u64, Region)>,
    ) {
        for (t, u) in &self.units {
            // Another replay of the same schedule, or a stream's part of one:
            // known when the plan was made.
            let hit = if std::sync::Arc::ptr_eq(u, union) {
                u.writes
            } else if u.family != 0 && u.family == union.family {
                u.hits_family
            } else {
                u.conflicts_with(union)
            };
            if hit && !t.retired() {
                push_unique(out, t);
                regions.push((t.id(), Region::Unit(u.clone())));
            }
        }
        if self.bufs.is_empty() {
            return;
        }
        for (&b, v) in &union.by_buf {
            if !self.bufs.contains_key(&b) {
                continue;
            }
            for &(s, e, w) in v {
                let mode = if w { Mode::Write } else { Mode::Read };
                // Units were handled above: the buffer's records only.
                self.buffer_hits(b, s..e, mode, |r, write| {
                    if !r.task.retired() {
                        push_unique(out, &r.task);
                        let (start, end) = (r.start, r.end);
                        regions.push((
                            r.task.id(),
                            Region::Range {
                                buf: b,
                                start,
                                end,
                                write,
                            },
                        ));
                    }
                });
            }
        }
    }

    /// Records `task` as accessing every range of `union`.
    pub(crate) fn record_unit(&mut self, task: &T, union: &std::sync::Arc<Union>) {
        self.units.retain(|(t, _)| !t.retired());
        self.units.push((task.clone(), union.clone()));
    }

    /// Forgets a buffer (it was dropped: no task can name it again).
    pub(crate) fn forget(&mut self, buf: u64) {
        self.bufs.remove(&buf);
    }

    /// Drops every record whose task satisfies `done`.
    pub(crate) fn prune(&mut self, mut done: impl FnMut(&T) -> bool) {
        self.units.retain(|(t, _)| !done(t));
        self.bufs.retain(|_, st| {
            st.writes.retain(|r| !done(&r.task));
            st.reads.retain(|r| !done(&r.task));
            !(st.writes.is_empty() && st.reads.is_empty())
        });
    }

    #[cfg(test)]
    pub(crate) fn record_count(&self) -> usize {
        self.bufs
            .values()
            .map(|s| s.writes.len() + s.reads.len())
            .sum()
    }
}

/// Removes `range` from the disjoint, sorted intervals in `v`, splitting the
/// intervals it cuts through.
fn trim<T: Clone, const N: usize>(v: &mut Recs<T, N>, range: &Range<usize>) {
    let first = v.partition_point(|r| r.end <= range.start);
    let mut i = first;
    while i < v.len() && v[i].start < range.end {
        let r = &mut v[i];
        let left = r.start < range.start;
        let right = r.end > range.end;
        match (left, right) {
            (false, false) => {
                v.remove(i);
                continue;
            }
            (true, false) => r.end = range.start,
            (false, true) => r.start = range.end,
            (true, true) => {
                let tail = Rec {
                    start: range.end,
                    end: r.end,
                    task: r.task.clone(),
                };
                r.end = range.start;
                v.insert(i + 1, tail);
                i += 1;
            }
        }
        i += 1;
    }
}

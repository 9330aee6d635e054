use super::*;
use std::cell::Cell;
use std::rc::Rc;

#[derive(Clone, Debug)]
struct T(u64, Rc<Cell<bool>>);

impl TaskRef for T {
    fn id(&self) -> u64 {
        self.0
    }
    fn retired(&self) -> bool {
        self.1.get()
    }
}

fn task(id: u64) -> T {
    T(id, Rc::new(Cell::new(false)))
}

/// Submits one access and returns the ids it depends on, sorted.
fn access(tr: &mut Tracker<T>, t: &T, buf: u64, r: Range<usize>, m: Mode) -> Vec<u64> {
    let mut out = Vec::new();
    tr.preds(buf, r.clone(), m, &mut out);
    tr.record(buf, r, m, t);
    let mut ids: Vec<u64> = out.iter().map(|t| t.0).collect();
    ids.sort();
    ids
}

#[test]
fn raw_war_waw() {
    let mut tr = Tracker::default();
    let (w, r1, r2, w2) = (task(1), task(2), task(3), task(4));
    assert!(access(&mut tr, &w, 0, 0..8, Mode::Write).is_empty());
    assert_eq!(access(&mut tr, &r1, 0, 0..8, Mode::Read), vec![1]);
    assert_eq!(access(&mut tr, &r2, 0, 0..4, Mode::Read), vec![1]);
    // A writer waits for every outstanding reader, not only the last one.
    assert_eq!(access(&mut tr, &w2, 0, 0..8, Mode::Write), vec![1, 2, 3]);
    let r3 = task(5);
    assert_eq!(access(&mut tr, &r3, 0, 2..3, Mode::Read), vec![4]);
}

#[test]
fn disjoint_views_are_independent() {
    let mut tr = Tracker::default();
    let (a, b, c) = (task(1), task(2), task(3));
    access(&mut tr, &a, 0, 0..4, Mode::Write);
    assert!(access(&mut tr, &b, 0, 4..8, Mode::Write).is_empty());
    // A whole-buffer access waits for both halves.
    assert_eq!(access(&mut tr, &c, 0, 0..8, Mode::ReadWrite), vec![1, 2]);
    // Other buffers are unrelated.
    assert!(access(&mut tr, &task(4), 1, 0..8, Mode::Write).is_empty());
}

#[test]
fn partial_overwrite_splits_the_older_writer() {
    let mut tr = Tracker::default();
    access(&mut tr, &task(1), 0, 0..12, Mode::Write);
    access(&mut tr, &task(2), 0, 4..8, Mode::Write);
    assert_eq!(access(&mut tr, &task(3), 0, 0..2, Mode::Read), vec![1]);
    assert_eq!(access(&mut tr, &task(4), 0, 5..6, Mode::Read), vec![2]);
    assert_eq!(access(&mut tr, &task(5), 0, 10..12, Mode::Read), vec![1]);
    assert_eq!(access(&mut tr, &task(6), 0, 3..9, Mode::Read), vec![1, 2]);
}

#[test]
fn partly_covered_reader_is_still_waited_for() {
    let mut tr = Tracker::default();
    access(&mut tr, &task(1), 0, 0..8, Mode::Read);
    assert_eq!(access(&mut tr, &task(2), 0, 0..4, Mode::Write), vec![1]);
    // The reader's uncovered half still orders a later writer of it.
    assert_eq!(access(&mut tr, &task(3), 0, 6..8, Mode::Write), vec![1]);
}

#[test]
fn retired_tasks_produce_no_edges_and_are_pruned() {
    let mut tr = Tracker::default();
    let w = task(1);
    access(&mut tr, &w, 0, 0..8, Mode::Write);
    w.1.set(true);
    assert!(access(&mut tr, &task(2), 0, 0..8, Mode::Read).is_empty());
    let readers: Vec<T> = (10..200).map(task).collect();
    for r in &readers {
        access(&mut tr, r, 0, 0..8, Mode::Read);
        r.1.set(true);
    }
    assert!(tr.record_count() < 40, "{}", tr.record_count());
    tr.prune(|t| t.retired());
    assert!(tr.record_count() <= 1);
}

#[test]
fn a_new_buffer_per_task_keeps_the_map_near_what_is_in_flight() {
    // The fan-out shape: every task writes a buffer never seen before. Once
    // its writer retires, a buffer's entry is dropped as the map grows, so
    // the map does not hold every buffer since the last synchronisation.
    let mut tr = Tracker::default();
    let unfinished = task(0);
    access(&mut tr, &unfinished, 1_000_000, 0..8, Mode::Write);
    for id in 1..20_000u64 {
        let t = task(id);
        assert!(access(&mut tr, &t, id, 0..8, Mode::Write).is_empty());
        t.1.set(true);
    }
    assert!(
        tr.bufs.len() <= 2 * PRUNE_FLOOR,
        "{} entries",
        tr.bufs.len()
    );
    // The unfinished writer's record survives every prune.
    let reader = task(20_000);
    assert_eq!(
        access(&mut tr, &reader, 1_000_000, 0..8, Mode::Read),
        vec![0]
    );
}

#[test]
fn empty_ranges_never_conflict() {
    let mut tr = Tracker::default();
    access(&mut tr, &task(1), 0, 4..4, Mode::Write);
    assert!(access(&mut tr, &task(2), 0, 0..8, Mode::Write).is_empty());
}

#[test]
fn a_unit_stands_for_the_union_of_its_accesses() {
    use super::Union;
    use std::sync::Arc;
    let mut t: Tracker<T> = Tracker::default();
    let u = Arc::new(Union::new([
        (1, 0..8, false),
        (1, 8..16, true),
        (2, 0..4, true),
    ]));
    t.record_unit(&T(7, Rc::new(Cell::new(false))), &u);
    let preds = |t: &Tracker<T>, b, r: std::ops::Range<usize>, m| {
        let mut out = Vec::new();
        t.preds(b, r, m, &mut out);
        out.iter().map(|p| p.0).collect::<Vec<_>>()
    };
    // Reading what the unit only reads: independent; writing it: an edge.
    assert_eq!(preds(&t, 1, 0..8, Mode::Read), Vec::<u64>::new());
    assert_eq!(preds(&t, 1, 4..6, Mode::Write), vec![7]);
    // Reading what it writes: an edge; another buffer or range: none.
    assert_eq!(preds(&t, 1, 12..20, Mode::Read), vec![7]);
    assert_eq!(preds(&t, 3, 0..4, Mode::Write), Vec::<u64>::new());
    // A second replay of the same union depends on the first (it writes).
    let mut out = Vec::new();
    let mut regions = Vec::new();
    t.preds_of_union(&u, &mut out, &mut regions);
    assert_eq!(out.iter().map(|p| p.0).collect::<Vec<_>>(), vec![7]);
    // What of the unit it met: all of it.
    assert_eq!(regions.len(), 1);
    assert_eq!(regions[0].0, 7);
    assert!(regions[0].1.conflicts(2, &(0..1), Mode::Read));
    // A read-only union meets only the unit's writes.
    let r = Arc::new(Union::new([(1, 0..8, false)]));
    out.clear();
    t.preds_of_union(&r, &mut out, &mut Vec::new());
    assert!(out.is_empty());
    t.prune(|p| p.0 == 7);
    assert_eq!(preds(&t, 2, 0..4, Mode::Read), Vec::<u64>::new());
}

#[test]
fn a_union_learns_what_of_each_predecessor_it_met() {
    use super::Union;
    use std::sync::Arc;
    let mut tr = Tracker::default();
    access(&mut tr, &task(1), 0, 0..8, Mode::Write);
    access(&mut tr, &task(2), 0, 8..16, Mode::Read);
    access(&mut tr, &task(3), 1, 0..8, Mode::Write);
    // Writes bytes 4..12 of buffer 0: after the writer and the reader.
    let u = Arc::new(Union::new([(0, 4..12, true)]));
    let (mut out, mut regions) = (Vec::new(), Vec::new());
    tr.preds_of_union(&u, &mut out, &mut regions);
    assert_eq!(out.iter().map(|p| p.0).collect::<Vec<_>>(), vec![1, 2]);
    let of = |id: u64| &regions.iter().find(|(i, _)| *i == id).unwrap().1;
    // A read of bytes 0..4 met what task 1 wrote, not what task 2 read;
    // a write of bytes 8..10, only what task 2 read.
    assert!(of(1).conflicts(0, &(0..4), Mode::Read));
    assert!(!of(2).conflicts(0, &(0..4), Mode::Read));
    assert!(!of(1).conflicts(0, &(8..10), Mode::Write));
    assert!(of(2).conflicts(0, &(8..10), Mode::Write));
    assert!(!of(1).conflicts(1, &(0..4), Mode::Read));
}

#[test]
fn a_plans_parts_know_whether_they_meet_its_whole() {
    use super::Union;
    use std::sync::Arc;
    // Part 0 reads buffer 1, which part 1 writes; part 2 reads buffer 3,
    // which nothing writes.
    let whole = Union::new([(1, 0..8, false), (1, 0..8, true), (3, 0..4, false)]);
    let parts = [
        Some(Union::new([(1, 0..8, false)])),
        Some(Union::new([(1, 0..8, true)])),
        Some(Union::new([(3, 0..4, false)])),
        None,
    ];
    let (whole, parts) = Union::family(whole, parts);
    let whole = Arc::new(whole);
    let mut t: Tracker<T> = Tracker::default();
    for (i, p) in parts.into_iter().enumerate() {
        if let Some(p) = p {
            t.record_unit(&T(i as u64, Rc::new(Cell::new(false))), &Arc::new(p));
        }
    }
    // The next replay of the plan waits for the parts that meet it.
    let mut out = Vec::new();
    t.preds_of_union(&whole, &mut out, &mut Vec::new());
    assert_eq!(out.iter().map(|p| p.0).collect::<Vec<_>>(), vec![0, 1]);
    // Another plan's union is checked buffer by buffer.
    let other = Arc::new(Union::new([(3, 0..4, true)]));
    out.clear();
    t.preds_of_union(&other, &mut out, &mut Vec::new());
    assert_eq!(out.iter().map(|p| p.0).collect::<Vec<_>>(), vec![2]);
}

#[test]
fn upward_rank_order_puts_long_paths_first_and_stays_topological() {
    use super::upward_rank_order;
    // 0 and 1 independent (10 each); 2 (1) before 3 (10).
    let succs = vec![vec![], vec![], vec![3], vec![]];
    assert_eq!(upward_rank_order(&[10, 10, 1, 10], &succs, 5), [2, 0, 1, 3]);
    // Zero durations and edge costs: every rank ties, index order stays.
    let chain = vec![vec![1], vec![2], vec![]];
    assert_eq!(upward_rank_order(&[0, 0, 0], &chain, 0), [0, 1, 2]);
    // A predecessor always precedes its successors.
    let dag = vec![vec![2, 3], vec![3], vec![4], vec![4], vec![]];
    let order = upward_rank_order(&[3, 1, 0, 7, 2], &dag, 1);
    let at = |i: usize| order.iter().position(|&o| o == i).unwrap();
    for (p, ss) in dag.iter().enumerate() {
        for &s in ss {
            assert!(at(p) < at(s), "{order:?}");
        }
    }
}

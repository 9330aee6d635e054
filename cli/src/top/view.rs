//! What one frame of `braid top` shows, computed from the spans of each rank
//! (a trace file's, or those a live program streamed) at one instant, and
//! its text form.

use braid::trace::live::{BusyPeriods, LiveStream};
use braid::trace::{Profile, Span};
use braid::Class;
use std::collections::HashMap;
use std::fmt::Write as _;

/// One rank as `braid top` knows it.
#[derive(Debug, Clone, Default)]
pub struct RankState {
    /// Its streams and the spans seen so far.
    pub profile: Profile,
    /// What a live program's latest frame said (`None` in a replay).
    pub live: Option<LiveRank>,
}

/// A live runtime's state as its latest frame gives it.
#[derive(Debug, Clone, Default)]
pub struct LiveRank {
    /// Its streams now (running task, queue).
    pub streams: Vec<LiveStream>,
    /// Its priority class.
    pub class: Option<Class>,
    /// Its busy periods so far.
    pub busy: Option<BusyPeriods>,
    /// Whether the runtime has gone (it stopped sending frames): its last
    /// figures stay on screen, nothing running or queued.
    pub ended: bool,
}

/// Which instant, and over what spans of time, a frame describes.
#[derive(Debug, Clone, Copy)]
pub struct Window {
    /// The instant, ns on the program's timeline.
    pub at_ns: u64,
    /// Busy shares are measured over `[at - busy, at]`, or over the part of
    /// it after `start_ns`.
    pub busy_ns: u64,
    /// Communication and per-scope figures cover `[at - history, at]`
    /// (`u64::MAX`: since the start).
    pub history_ns: u64,
    /// The program's start, as far as the view knows it (its first span):
    /// a program younger than `busy_ns` is measured over its life so far,
    /// not diluted by a window it had not lived.
    pub start_ns: u64,
}

impl Window {
    /// Where busy shares are measured from: `busy_ns` before `at_ns`, but
    /// not before the start.
    fn busy_from(&self) -> u64 {
        // A start after the instant: no span known yet.
        let floor = match self.start_ns <= self.at_ns {
            true => self.start_ns,
            false => 0,
        };
        self.at_ns.saturating_sub(self.busy_ns).max(floor)
    }

    /// How long busy shares are measured over: `busy_ns`, or less for a
    /// program younger than that.
    fn busy_span(&self) -> u64 {
        self.at_ns.saturating_sub(self.busy_from())
    }
}

/// A stream's row.
#[derive(Debug, Clone, PartialEq)]
pub struct StreamRow {
    /// Stream name.
    pub name: String,
    /// Share of the busy window it spent running tasks.
    pub busy: f64,
    /// Tasks it finished within the history.
    pub done: usize,
    /// Live: tasks placed on it and not finished. Replay: tasks already
    /// submitted (a later task had started somewhere) whose predecessors
    /// had all finished, waiting for it — a lower bound on its queue.
    pub queued: u64,
    /// What it runs at the instant (task name, its scope if any), with how
    /// long it has run (ns).
    pub running: Option<(String, Option<String>, u64)>,
}

/// A rank's part of a frame.
#[derive(Debug, Clone, PartialEq)]
pub struct RankRow {
    /// The rank.
    pub rank: usize,
    /// Its priority class: the live frame's, or the trace's.
    pub class: Option<Class>,
    /// Its busy periods: the live frame's summary (the latest 4,096), or,
    /// in a replay, of the periods that ended within the history.
    pub busy: Option<BusyPeriods>,
    /// Its streams.
    pub streams: Vec<StreamRow>,
    /// Communication time within the history, ns.
    pub comm_ns: u64,
    /// Share of it hidden under compute.
    pub hidden: f64,
    /// Of `comm_ns`, the time collectives waited for other ranks (skew).
    pub comm_wait_ns: u64,
    /// Time by scope within the history, largest first (at most 6); by task
    /// name when no task ran in a scope.
    pub by_scope: Vec<(String, u64)>,
    /// Whether `by_scope` groups by scope (else by task name).
    pub scoped: bool,
    /// Tasks that ran within the history by why they went to their stream
    /// (the trace's `placed`: `memoised` by automatic replay, `replayed`
    /// from a recorded schedule, else the placement rule), most first.
    pub placed: Vec<(&'static str, usize)>,
}

/// Ends a span at `at` (a span still running then counts up to `at`).
fn clipped(s: &Span, from: u64, at: u64) -> Option<Span> {
    if s.start_ns >= at || s.end_ns <= from {
        return None;
    }
    let mut c = s.clone();
    c.start_ns = c.start_ns.max(from);
    c.end_ns = c.end_ns.min(at);
    // The wait is at the span's start: what of it is inside the window.
    let wait_end = s.start_ns.saturating_add(s.wait_ns);
    c.wait_ns = wait_end.clamp(c.start_ns, c.end_ns) - c.start_ns;
    Some(c)
}

impl RankState {
    /// This rank's row at `w`.
    pub fn row(&self, w: Window) -> RankRow {
        let p = &self.profile;
        let from = w.at_ns.saturating_sub(w.history_ns);
        let busy_from = w.busy_from();
        let busy_len = w.busy_span().max(1);
        let seen = Profile {
            rank: p.rank,
            streams: p.streams.clone(),
            spans: p
                .spans
                .iter()
                .filter_map(|s| clipped(s, from, w.at_ns))
                .collect(),
            ..Profile::default()
        };
        let summary = seen.summary();
        // The latest submission index that had started by `at`: every task
        // up to it had been submitted (submission is in program order).
        let submitted = p
            .spans
            .iter()
            .filter(|s| s.start_ns <= w.at_ns)
            .map(|s| s.id)
            .max();
        let end_of: HashMap<u64, u64> = p.spans.iter().map(|s| (s.id, s.end_ns)).collect();
        let streams = p
            .streams
            .iter()
            .enumerate()
            .map(|(i, info)| {
                let on = || p.spans.iter().filter(move |s| s.stream == i);
                let busy: u64 = on()
                    .filter_map(|s| clipped(s, busy_from, w.at_ns))
                    .map(|s| s.end_ns - s.start_ns)
                    .sum();
                let live = self.live.as_ref().and_then(|l| l.streams.get(i));
                let running = match live {
                    Some(l) => l.running.as_ref().map(|r| {
                        let since = w.at_ns.saturating_sub(r.since_ns);
                        (r.name.clone(), r.scope.clone(), since)
                    }),
                    None => on()
                        .find(|s| s.start_ns <= w.at_ns && w.at_ns < s.end_ns)
                        .map(|s| {
                            let scope = s.scope.as_deref().map(str::to_string);
                            (s.name.to_string(), scope, w.at_ns - s.start_ns)
                        }),
                };
                let queued = match live {
                    Some(l) => l.queued,
                    None => on()
                        .filter(|s| {
                            s.start_ns > w.at_ns
                                && submitted.is_some_and(|m| s.id <= m)
                                && s.preds
                                    .iter()
                                    .all(|p| end_of.get(p).is_none_or(|&e| e <= w.at_ns))
                        })
                        .count() as u64,
                };
                StreamRow {
                    name: info.name.clone(),
                    busy: busy as f64 / busy_len as f64,
                    done: on()
                        .filter(|s| s.end_ns <= w.at_ns && s.end_ns > from)
                        .count(),
                    queued,
                    running,
                }
            })
            .collect();
        let scoped = seen.spans.iter().any(|s| s.scope.is_some());
        let mut by_scope: HashMap<&str, u64> = HashMap::new();
        for s in &seen.spans {
            let key = match (scoped, &s.scope) {
                (false, _) => s.name.as_ref(),
                (true, Some(scope)) => scope.as_ref(),
                (true, None) => "(no scope)",
            };
            *by_scope.entry(key).or_default() += s.end_ns - s.start_ns;
        }
        let mut by_scope: Vec<(String, u64)> = by_scope
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
        by_scope.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        by_scope.truncate(6);
        let mut placed: HashMap<&'static str, usize> = HashMap::new();
        for s in &seen.spans {
            *placed.entry(s.placement.reason.name()).or_default() += 1;
        }
        let mut placed: Vec<(&'static str, usize)> = placed.into_iter().collect();
        placed.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(b.0)));
        let live = self.live.as_ref();
        let busy = match live {
            Some(l) => l.busy,
            None => BusyPeriods::of(
                p.busy
                    .iter()
                    .filter(|&&(_, z)| z <= w.at_ns && z > from)
                    .map(|(a, z)| z - a),
            ),
        };
        RankRow {
            rank: p.rank,
            class: live.and_then(|l| l.class).or(p.class),
            busy,
            streams,
            comm_ns: summary.comm_ns,
            hidden: summary.hidden_share(),
            comm_wait_ns: summary.comm_wait_ns,
            by_scope,
            scoped,
            placed,
        }
    }
}

fn ms(ns: u64) -> f64 {
    ns as f64 / 1e6
}

/// The widest a line of figures is let run before it breaks: a terminal of
/// 120 columns cut `time by scope` mid-name.
const FIGURES_WIDTH: usize = 100;

/// `head`, `parts` joined by ` · `, then `tail` and a newline, broken
/// between parts (never inside one) so that no line passes
/// [`FIGURES_WIDTH`] columns unless one part alone does; the later lines
/// indented under the first part.
fn joined_lines(head: &str, parts: &[String], tail: &str) -> String {
    let width = |s: &str| s.chars().count();
    let indent = " ".repeat(width(head));
    let mut out = head.to_string();
    let mut line = width(head);
    for (i, part) in parts.iter().enumerate() {
        let last = i + 1 == parts.len();
        let need = width(part) + if last { width(tail) } else { 2 };
        if i > 0 {
            if line + 1 + need > FIGURES_WIDTH {
                out += "\n";
                out += &indent;
                line = width(&indent);
            } else {
                out += " ";
                line += 1;
            }
        }
        out += part;
        line += width(part);
        if !last {
            out += " ·";
            line += 2;
        }
    }
    out + tail + "\n"
}

/// The text of one frame: a header line, then per rank its streams and
/// figures. What `--once` prints and the terminal UI draws.
pub fn render(title: &str, ranks: &[RankState], w: Window) -> String {
    let mut out = String::new();
    let history = if w.history_ns == u64::MAX {
        "since the start".to_string()
    } else {
        format!("over the last {:.1} s", w.history_ns as f64 / 1e9)
    };
    let _ = writeln!(
        out,
        "braid top — {title} — t={:.3} s, busy over {}, totals {history}",
        w.at_ns as f64 / 1e9,
        match w.busy_span() {
            n if n < w.busy_ns => format!("the {:.0} ms since the start", ms(n)),
            _ => format!("{:.0} ms", ms(w.busy_ns)),
        }
    );
    for r in ranks {
        let row = r.row(w);
        let live = r.live.as_ref();
        let mut class = match row.class {
            Some(c) => format!(" [{}]", c.name()),
            None => String::new(),
        };
        if live.is_some_and(|l| l.ended) {
            class += " (ended)";
        }
        let waiting = match row.comm_wait_ns {
            0 => String::new(),
            ns => format!(" ({:.1} ms of it waiting for other ranks)", ms(ns)),
        };
        let _ = writeln!(
            out,
            "\nrank {}{class}  comm {:.1} ms, {:.0}% hidden under compute{waiting}",
            row.rank,
            ms(row.comm_ns),
            100.0 * row.hidden
        );
        if let Some(b) = row.busy {
            let _ = writeln!(
                out,
                "  busy periods (submission to idle): {}, p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
                b.n,
                ms(b.p50_ns),
                ms(b.p99_ns),
                ms(b.max_ns)
            );
        }
        let _ = writeln!(
            out,
            "  {:<12} {:>5} {:>7} {:>6}  RUNNING",
            "STREAM",
            "BUSY",
            "DONE",
            if live.is_some() { "QUEUED" } else { "READY" }
        );
        for s in &row.streams {
            let running = match &s.running {
                Some((name, Some(scope), for_ns)) => {
                    format!("{name} [{scope}] ({:.2} ms)", ms(*for_ns))
                }
                Some((name, None, for_ns)) => format!("{name} ({:.2} ms)", ms(*for_ns)),
                None => "-".into(),
            };
            let _ = writeln!(
                out,
                "  {:<12} {:>4.0}% {:>7} {:>6}  {running}",
                s.name,
                100.0 * s.busy,
                s.done,
                s.queued
            );
        }
        if !row.by_scope.is_empty() {
            let parts: Vec<String> = row
                .by_scope
                .iter()
                .map(|(n, t)| format!("{n} {:.1} ms", ms(*t)))
                .collect();
            let by = if row.scoped { "scope" } else { "task" };
            out += &joined_lines(&format!("  time by {by}: "), &parts, "");
        }
        let tasks: usize = row.placed.iter().map(|p| p.1).sum();
        if tasks > 0 {
            let parts: Vec<String> = row
                .placed
                .iter()
                .map(|(why, n)| format!("{why} {:.0}%", 100.0 * *n as f64 / tasks as f64))
                .collect();
            out += &joined_lines("  placed: ", &parts, &format!(" (of {tasks} tasks)"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use braid::trace::StreamInfo;
    use braid::{PlaceReason, Placement, Priority, TaskKind};

    fn span(id: u64, stream: usize, kind: TaskKind, (s, e): (u64, u64), preds: &[u64]) -> Span {
        Span {
            id,
            name: format!("t{id}").into(),
            kind,
            stream,
            placement: Placement {
                reason: PlaceReason::Pinned,
                usable: 1,
                priority: Priority::Main,
            },
            start_ns: s,
            end_ns: e,
            preds: preds.iter().copied().collect(),
            ok: true,
            bytes: 0,
            wait_ns: 0,
            scope: (id % 2 == 1).then(|| "odd".into()),
        }
    }

    fn stream(name: &str) -> StreamInfo {
        StreamInfo {
            name: name.into(),
            is_comm: name.starts_with("comm"),
        }
    }

    /// Busy shares, running tasks, the ready lower bound and hidden
    /// communication at one instant of a small replayed profile.
    #[test]
    fn a_replayed_instant() {
        let state = RankState {
            profile: Profile {
                rank: 2,
                streams: vec![stream("compute 0"), stream("compute 1"), stream("comm 0")],
                spans: vec![
                    span(0, 0, TaskKind::Compute, (0, 100), &[]),
                    span(1, 0, TaskKind::Compute, (100, 300), &[0]),
                    // Ready at 100 (its predecessor ended), waiting for stream 0.
                    span(2, 0, TaskKind::Compute, (300, 350), &[0]),
                    // Waits for task 1, unfinished at 200: not ready.
                    span(3, 1, TaskKind::Compute, (300, 400), &[1]),
                    // Started by 200, so tasks 2 and 3 had been submitted.
                    span(4, 2, TaskKind::Comm, (150, 250), &[0]),
                    // Not yet submitted at 200 as far as the trace can tell.
                    span(5, 1, TaskKind::Compute, (300, 310), &[]),
                ],
                class: Some(Class::BestEffort),
                // Two ended by 200 (150 and 30 ns long); the third had not.
                busy: vec![(0, 150), (160, 190), (195, 350)],
            },
            live: None,
        };
        let w = Window {
            at_ns: 200,
            busy_ns: 100,
            history_ns: u64::MAX,
            start_ns: 0,
        };
        let row = state.row(w);
        assert_eq!(row.rank, 2);
        let s0 = &row.streams[0];
        assert_eq!(s0.busy, 1.0);
        assert_eq!(s0.done, 1);
        assert_eq!(s0.running, Some(("t1".into(), Some("odd".into()), 100)));
        assert_eq!(s0.queued, 1);
        assert_eq!(row.streams[1].queued, 0);
        assert_eq!(row.streams[1].running, None);
        assert_eq!(row.streams[2].busy, 0.5);
        // A program younger than the busy window: busy over its life so far
        // (200 ns), not diluted by the 1,000 ns it had not lived.
        let young = Window {
            busy_ns: 1_000,
            ..w
        };
        let r = state.row(young);
        assert_eq!((r.streams[0].busy, r.streams[2].busy), (1.0, 0.25));
        let text = render("test", std::slice::from_ref(&state), young);
        assert!(
            text.contains("busy over the 0 ms since the start"),
            "{text}"
        );
        // Comm ran 150..200 so far, all of it under task 1.
        assert_eq!(row.comm_ns, 50);
        assert_eq!(row.hidden, 1.0);
        // By 200: tasks 0 and 4 (no scope) ran 100 + 50, task 1 (odd) 100.
        assert!(row.scoped);
        assert_eq!(
            row.by_scope,
            vec![("(no scope)".into(), 150), ("odd".into(), 100)]
        );
        // Tasks 0, 1 and 4 ran by 200, all pinned.
        assert_eq!(row.placed, vec![("pinned", 3)]);
        assert_eq!(row.class, Some(Class::BestEffort));
        assert_eq!(
            row.busy,
            Some(BusyPeriods {
                n: 2,
                p50_ns: 30,
                p99_ns: 150,
                max_ns: 150
            })
        );
        let text = render("test", &[state], w);
        for name in [
            "compute 0",
            "compute 1",
            "comm 0",
            "rank 2 [best-effort]",
            "busy periods (submission to idle): 2,",
            "READY",
            "placed: pinned 100% (of 3 tasks)",
        ] {
            assert!(text.contains(name), "{name} missing from\n{text}");
        }
    }

    /// Long figures lines break between parts, within the width, losing
    /// nothing; short ones stay on one line.
    #[test]
    fn figures_lines_break_between_parts() {
        let parts: Vec<String> = (0..9)
            .map(|i| format!("forward/block{i}/attention {i}.5 ms"))
            .collect();
        let text = joined_lines("  time by scope: ", &parts, " (of 9)");
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines.len() > 2, "{text}");
        for l in &lines {
            assert!(l.chars().count() <= FIGURES_WIDTH, "{l:?}");
        }
        for l in &lines[1..] {
            assert!(l.starts_with(&" ".repeat(17)) && !l.starts_with(&" ".repeat(18)));
        }
        let flat: Vec<&str> = text.split_whitespace().collect();
        let want = format!("time by scope: {} (of 9)", parts.join(" · "));
        assert_eq!(flat, want.split_whitespace().collect::<Vec<_>>());
        assert_eq!(
            joined_lines("  placed: ", &["a 1%".into(), "b 99%".into()], " (of 2)"),
            "  placed: a 1% · b 99% (of 2)\n"
        );
    }
}

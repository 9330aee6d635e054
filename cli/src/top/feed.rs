//! The live view's client side: the lines a running program writes on its
//! socket (`braid::trace::live`), folded into one [`RankState`] per runtime.

use super::view::{LiveRank, RankState};
use anyhow::{Context, Result};
use braid::trace::live::{Frame, Line};
use braid::trace::StreamInfo;
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, ErrorKind};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

/// What the client knows of the runtimes served on one socket.
#[derive(Debug, Default)]
pub struct Feed {
    /// By runtime id: state, and whether it sent a frame this round. A
    /// runtime that stops sending stays, marked ended, until a runtime of
    /// the same rank comes (so the last frame of a program that ends shows
    /// every rank, whichever was dropped first).
    runtimes: BTreeMap<u64, (RankState, bool)>,
    /// The latest instant a frame was taken at, ns.
    pub now_ns: u64,
    /// The earliest start of a span received (`u64::MAX` before any): the
    /// program's start as far as the client knows it.
    pub start_ns: u64,
    /// Spans that ended longer ago than this before `now_ns` are dropped.
    history_ns: u64,
}

impl Feed {
    /// A feed that keeps `history_ns` of spans.
    pub fn new(history_ns: u64) -> Feed {
        Feed {
            history_ns,
            start_ns: u64::MAX,
            ..Feed::default()
        }
    }

    /// Takes one line; returns `true` at the end of a round.
    pub fn apply(&mut self, line: Line) -> bool {
        match line {
            Line::Frame(f) => {
                self.frame(f);
                false
            }
            Line::Tick(_) => {
                // A runtime that sent nothing this round has been dropped.
                for (state, seen) in self.runtimes.values_mut() {
                    if !std::mem::take(seen) {
                        if let Some(live) = state.live.as_mut() {
                            live.ended = true;
                            for s in &mut live.streams {
                                (s.running, s.queued) = (None, 0);
                            }
                        }
                    }
                }
                true
            }
        }
    }

    fn frame(&mut self, f: Frame) {
        self.now_ns = self.now_ns.max(f.now_ns);
        if !self.runtimes.contains_key(&f.runtime) {
            // It takes the place of an ended runtime of its rank.
            self.runtimes.retain(|_, (s, _)| {
                s.profile.rank != f.rank || s.live.as_ref().is_none_or(|l| !l.ended)
            });
        }
        let (state, seen) = self.runtimes.entry(f.runtime).or_default();
        *seen = true;
        let p = &mut state.profile;
        p.rank = f.rank;
        p.streams = f
            .streams
            .iter()
            .map(|s| StreamInfo {
                name: s.name.clone(),
                is_comm: s.is_comm,
            })
            .collect();
        if let Some(first) = f.spans.iter().map(|s| s.start_ns).min() {
            self.start_ns = self.start_ns.min(first);
        }
        p.spans.extend(f.spans);
        let horizon = f.now_ns.saturating_sub(self.history_ns);
        p.spans.retain(|s| s.end_ns >= horizon);
        state.live = Some(LiveRank {
            streams: f.streams,
            class: f.class,
            busy: f.busy,
            ended: false,
        });
    }

    /// The runtimes, by rank.
    pub fn ranks(&self) -> Vec<RankState> {
        let mut v: Vec<RankState> = self.runtimes.values().map(|(s, _)| s.clone()).collect();
        v.sort_by_key(|s| s.profile.rank);
        v
    }
}

/// How long the socket may stay silent: a program serves a round every
/// [`PERIOD`](braid::trace::live::PERIOD) from a thread of its own, so
/// silence this long is a program stopped (SIGSTOP, a debugger) or a
/// socket that is not a Braid live view.
pub const SILENCE: Duration = Duration::from_secs(5);

/// The lines a program serves on the socket at `path`; a read that waits
/// longer than [`SILENCE`] yields an error saying so (and reading may go
/// on).
pub fn connect(path: &Path) -> Result<impl Iterator<Item = Result<Line>>> {
    let conn = UnixStream::connect(path).with_context(|| {
        format!(
            "cannot attach to `{}` (is a program running with BRAID_LIVE or RuntimeBuilder::live set to it?)",
            path.display()
        )
    })?;
    conn.set_read_timeout(Some(SILENCE))
        .context("setting the live view's read timeout")?;
    let path = path.to_owned();
    Ok(BufReader::new(conn).lines().map(move |l| {
        let l = l.map_err(|e| match e.kind() {
            ErrorKind::WouldBlock | ErrorKind::TimedOut => anyhow::anyhow!(
                "`{}` sent nothing for {} s (a program serves its live view every {} ms: \
                 is it stopped, or is this not a Braid live view?)",
                path.display(),
                SILENCE.as_secs(),
                braid::trace::live::PERIOD.as_millis()
            ),
            _ => anyhow::Error::new(e).context("reading the live view"),
        })?;
        Line::parse(&l).context("the live view sent an unreadable line")
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use braid::trace::live::{LiveStream, LiveTask};

    fn frame(runtime: u64, rank: usize, now_ns: u64) -> Line {
        Line::Frame(Frame {
            rank,
            runtime,
            now_ns,
            class: None,
            busy: None,
            streams: vec![LiveStream {
                name: "compute 0".into(),
                is_comm: false,
                queued: 2,
                running: Some(LiveTask {
                    id: 1,
                    name: "matmul".into(),
                    scope: None,
                    since_ns: now_ns,
                }),
            }],
            spans: Vec::new(),
        })
    }

    /// A runtime that stops sending stays, ended, with nothing running,
    /// until another of its rank comes: the last frame of a program whose
    /// rank 0 was dropped a round before rank 1 still shows both.
    #[test]
    fn ended_runtimes_stay_until_their_rank_returns() {
        let mut feed = Feed::new(u64::MAX);
        let ranks = |f: &Feed| -> Vec<(usize, bool, bool)> {
            f.ranks()
                .iter()
                .map(|r| {
                    let live = r.live.as_ref().unwrap();
                    let idle = live.streams[0].running.is_none() && live.streams[0].queued == 0;
                    (r.profile.rank, live.ended, idle)
                })
                .collect()
        };
        for line in [frame(10, 0, 1), frame(11, 1, 1), Line::Tick(1)] {
            feed.apply(line);
        }
        assert_eq!(ranks(&feed), [(0, false, false), (1, false, false)]);
        // Rank 0's runtime is dropped; rank 1 sends on.
        assert!(!feed.apply(frame(11, 1, 2)));
        assert!(feed.apply(Line::Tick(2)));
        assert_eq!(ranks(&feed), [(0, true, true), (1, false, false)]);
        // A new runtime of rank 0 (a second job in the process) replaces it.
        feed.apply(frame(12, 0, 3));
        feed.apply(frame(11, 1, 3));
        feed.apply(Line::Tick(3));
        assert_eq!(ranks(&feed), [(0, false, false), (1, false, false)]);
        assert_eq!(feed.runtimes.len(), 2);
    }
}

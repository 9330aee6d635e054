//! The live view's client side: the lines a running program writes on its
//! socket (`braid::trace::live`), folded into one [`RankState`] per runtime.

use super::view::{LiveRank, RankState};
use anyhow::{Context, Result};
use braid::trace::live::{Frame, Line};
use braid::trace::StreamInfo;
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::os::unix::net::UnixStream;
use std::path::Path;

/// What the client knows of the runtimes served on one socket.
#[derive(Debug, Default)]
pub struct Feed {
    /// By runtime id: state, and whether it sent a frame this round.
    runtimes: BTreeMap<u64, (RankState, bool)>,
    /// The latest instant a frame was taken at, ns.
    pub now_ns: u64,
    /// Spans that ended longer ago than this before `now_ns` are dropped.
    history_ns: u64,
}

impl Feed {
    /// A feed that keeps `history_ns` of spans.
    pub fn new(history_ns: u64) -> Feed {
        Feed {
            history_ns,
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
                self.runtimes.retain(|_, (_, seen)| std::mem::take(seen));
                true
            }
        }
    }

    fn frame(&mut self, f: Frame) {
        self.now_ns = self.now_ns.max(f.now_ns);
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
        p.spans.extend(f.spans);
        let horizon = f.now_ns.saturating_sub(self.history_ns);
        p.spans.retain(|s| s.end_ns >= horizon);
        state.live = Some(LiveRank {
            streams: f.streams,
            class: f.class,
            busy: f.busy,
        });
    }

    /// The runtimes, by rank.
    pub fn ranks(&self) -> Vec<RankState> {
        let mut v: Vec<RankState> = self.runtimes.values().map(|(s, _)| s.clone()).collect();
        v.sort_by_key(|s| s.profile.rank);
        v
    }
}

/// The lines a program serves on the socket at `path`.
pub fn connect(path: &Path) -> Result<impl Iterator<Item = Result<Line>>> {
    let conn = UnixStream::connect(path).with_context(|| {
        format!(
            "cannot attach to `{}` (is a program running with BRAID_LIVE or RuntimeBuilder::live set to it?)",
            path.display()
        )
    })?;
    Ok(BufReader::new(conn).lines().map(|l| {
        let l = l.context("reading the live view")?;
        Line::parse(&l).context("the live view sent an unreadable line")
    }))
}

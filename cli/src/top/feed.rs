//! The live view's client side: the lines a running program writes on its
//! socket (`braid::trace::live`), folded into one [`RankState`] per runtime.

use super::view::{LiveRank, RankState};
use anyhow::{Context, Result};
use braid::trace::live::{Frame, Line};
use braid::trace::StreamInfo;
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, ErrorKind, Read};
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

/// The longest line taken from a socket, newline excluded: 256 MiB.
///
/// A Braid program writes, per round and per runtime, one line
/// (`braid::trace::live`): its streams, a few hundred bytes each, and the
/// spans recorded since this client's previous frame as the Chrome trace's
/// events, about 250 bytes each. A round's spans are 100 ms of tasks —
/// hundreds to thousands, under a MB. A client's first frame carries what
/// ran before it attached: per stream at most 100,000 spans (the last 5
/// minutes'), about 25 MB; a runtime of more than ten busy streams can pass
/// the bound with it. The bound is no higher because
/// a line is held whole and then parsed into a JSON tree several times its
/// size: at 256 MiB the client already takes a GB or two for one line. A
/// peer that goes past it without a newline (one streaming without ever
/// ending a line, which grew the client by 4 GB in 10 s before this bound)
/// is refused, the error saying both what it likely is and what else it
/// may be.
pub const MAX_LINE: usize = 256 << 20;

/// A line longer than [`MAX_LINE`]: the connection is given up.
#[derive(Debug)]
pub struct TooLong(pub String);

impl std::fmt::Display for TooLong {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "`{}` sent a line longer than {} MiB: not a Braid live view (or the first frame \
             of a runtime with over ten streams busy for minutes with the live view on)",
            self.0,
            MAX_LINE >> 20
        )
    }
}

impl std::error::Error for TooLong {}

/// The lines of a live view, each at most [`MAX_LINE`] long.
struct Lines<R> {
    reader: BufReader<R>,
    /// What has come of the line being read (kept across a read that
    /// times out, so the line goes on where it stopped).
    line: Vec<u8>,
    /// The socket's path, for errors.
    path: std::path::PathBuf,
    /// A line was too long: nothing more is read.
    done: bool,
}

impl<R: Read> Lines<R> {
    fn new(reader: R, path: &Path) -> Lines<R> {
        Lines {
            reader: BufReader::new(reader),
            line: Vec::new(),
            path: path.to_owned(),
            done: false,
        }
    }
}

impl<R: Read> Iterator for Lines<R> {
    type Item = Result<Line>;

    fn next(&mut self) -> Option<Result<Line>> {
        if self.done {
            return None;
        }
        // At most one byte past the bound is read: enough to tell a line
        // that is too long, and what is kept stays bounded.
        let room = (MAX_LINE + 1).saturating_sub(self.line.len()) as u64;
        let read = (&mut self.reader)
            .take(room)
            .read_until(b'\n', &mut self.line);
        match read {
            Err(e) => {
                return Some(Err(match e.kind() {
                    ErrorKind::WouldBlock | ErrorKind::TimedOut => anyhow::anyhow!(
                        "`{}` sent nothing for {} s (a program serves its live view every {} ms: \
                         is it stopped, or is this not a Braid live view?)",
                        self.path.display(),
                        SILENCE.as_secs(),
                        braid::trace::live::PERIOD.as_millis()
                    ),
                    _ => anyhow::Error::new(e).context("reading the live view"),
                }))
            }
            // The end, with no line begun.
            Ok(0) if self.line.is_empty() => return None,
            Ok(_) => {}
        }
        if self.line.last() == Some(&b'\n') {
            self.line.pop();
            if self.line.last() == Some(&b'\r') {
                self.line.pop();
            }
        } else if self.line.len() > MAX_LINE {
            self.done = true;
            self.line = Vec::new();
            return Some(Err(TooLong(self.path.display().to_string()).into()));
        }
        // A line, or the last one, ended by the end of the stream.
        let line = std::mem::take(&mut self.line);
        Some(
            String::from_utf8(line)
                .map_err(anyhow::Error::new)
                .and_then(|l| Line::parse(&l).map_err(anyhow::Error::new))
                .context("the live view sent an unreadable line"),
        )
    }
}

/// The lines a program serves on the socket at `path`; a read that waits
/// longer than [`SILENCE`] yields an error saying so (and reading may go
/// on), a line longer than [`MAX_LINE`] an error ([`TooLong`]) that ends
/// them.
pub fn connect(path: &Path) -> Result<impl Iterator<Item = Result<Line>>> {
    let conn = UnixStream::connect(path).with_context(|| {
        format!(
            "cannot attach to `{}` (is a program running with BRAID_LIVE or RuntimeBuilder::live set to it?)",
            path.display()
        )
    })?;
    conn.set_read_timeout(Some(SILENCE))
        .context("setting the live view's read timeout")?;
    Ok(Lines::new(conn, path))
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

    /// A reader that gives `parts` in turn, a timeout where one is `None`.
    struct Parts(std::collections::VecDeque<Option<&'static [u8]>>);

    impl Read for Parts {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            match self.0.pop_front() {
                None => Ok(0),
                Some(None) => Err(ErrorKind::WouldBlock.into()),
                Some(Some(p)) => {
                    buf[..p.len()].copy_from_slice(p);
                    Ok(p.len())
                }
            }
        }
    }

    /// Lines end at `\n` (or `\r\n`, or the end of the stream); a silence
    /// in the middle of one is reported and the line goes on after it.
    #[test]
    fn lines_survive_a_silence_mid_line() {
        let parts = Parts(
            [
                Some(&b"{\"ti"[..]),
                None,
                Some(b"ck\": 1}\r\n{\"tick\": 2}\n{\"tick\""),
                Some(b": 3}"),
            ]
            .into(),
        );
        let got: Vec<String> = Lines::new(parts, Path::new("s.sock"))
            .map(|l| match l {
                Ok(Line::Tick(n)) => n.to_string(),
                Ok(Line::Frame(_)) => "frame".into(),
                Err(e) => format!("{e:#}"),
            })
            .collect();
        assert_eq!(got.len(), 4, "{got:?}");
        assert!(got[0].contains("sent nothing for 5 s"), "{got:?}");
        assert_eq!(got[1..], ["1", "2", "3"]);
    }

    /// A line that never ends is refused once past [`MAX_LINE`], having
    /// held no more than that, and nothing is read after it.
    #[test]
    fn an_endless_line_is_refused() {
        let mut lines = Lines::new(std::io::repeat(b'x'), Path::new("/tmp/endless.sock"));
        let e = lines.next().unwrap().unwrap_err();
        assert!(e.is::<TooLong>(), "{e:#}");
        let msg = format!("{e:#}");
        assert!(
            msg.contains("`/tmp/endless.sock` sent a line longer than 256 MiB")
                && msg.contains("not a Braid live view"),
            "{msg}"
        );
        assert!(lines.next().is_none());
        assert!(lines.line.capacity() == 0);
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

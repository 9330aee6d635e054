//! `braid top`: what every stream of a Braid program is doing — attached to
//! a running program through its live-view socket, or replaying a Chrome
//! trace it wrote. `--once` prints one frame as text and exits.

mod feed;
mod tui;
pub mod view;

use anyhow::{bail, Context, Result};
use std::path::PathBuf;
use view::{RankState, Window};

/// `braid top`'s options.
#[derive(Debug, clap::Args)]
pub struct TopArgs {
    /// Replay this Chrome trace (one Braid wrote) instead of attaching.
    #[arg(long, value_name = "TRACE", conflicts_with = "attach")]
    pub replay: Option<PathBuf>,
    /// Attach to the program serving this socket (default: `BRAID_LIVE`).
    #[arg(long, value_name = "SOCKET")]
    pub attach: Option<PathBuf>,
    /// Attaching: the rank whose socket to read where the path has `{rank}`
    /// in it (as `BRAID_LIVE=/tmp/braid-{rank}.sock` gives each rank).
    #[arg(long, default_value_t = 0, value_name = "N", conflicts_with = "replay")]
    pub rank: usize,
    /// Print one frame as text and exit.
    #[arg(long)]
    pub once: bool,
    /// Replay: the instant to show, in seconds on the trace's timeline
    /// (default: its end).
    #[arg(
        long,
        value_name = "SECONDS",
        requires = "replay",
        conflicts_with = "attach"
    )]
    pub at: Option<f64>,
    /// Busy shares are measured over this many milliseconds before the
    /// instant.
    #[arg(long, default_value_t = 500.0, value_name = "MS")]
    pub busy_ms: f64,
    /// Live: communication and per-task totals cover this many seconds (a
    /// replay covers the whole trace).
    #[arg(
        long,
        default_value_t = 30.0,
        value_name = "SECONDS",
        conflicts_with = "replay"
    )]
    pub history: f64,
}

/// Seconds as whole nanoseconds, rounded: `1.023 * 1e9` is
/// 1022999999.9999999, and truncated it put `--at 1.023` (a bound as
/// printed) a nanosecond outside the trace.
fn ns(seconds: f64) -> u64 {
    (seconds * 1e9).round().max(0.0) as u64
}

/// Runs `braid top`.
pub fn run(args: TopArgs) -> Result<()> {
    let positive = |x: f64| x.is_finite() && x > 0.0;
    if !positive(args.busy_ms) || !positive(args.history) {
        bail!("--busy-ms and --history must be positive");
    }
    let busy_ns = ns(args.busy_ms / 1e3);
    if let Some(path) = &args.replay {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading `{}`", path.display()))?;
        let profiles = braid::trace::read_chrome_trace(&text)
            .with_context(|| format!("reading `{}`", path.display()))?;
        let ranks: Vec<RankState> = profiles
            .into_iter()
            .map(|profile| RankState {
                profile,
                live: None,
            })
            .collect();
        let spans = ranks.iter().flat_map(|r| r.profile.spans.iter());
        let start = spans.clone().map(|s| s.start_ns).min().unwrap_or(0);
        // The end of the last task or busy period (a busy period ends a
        // little after its last task).
        let end = spans
            .map(|s| s.end_ns)
            .chain(
                ranks
                    .iter()
                    .flat_map(|r| r.profile.busy.iter().map(|b| b.1)),
            )
            .max()
            .unwrap_or(0);
        // The bounds as printed (to the millisecond, outwards): an instant
        // between them is taken, one printed bound is the bound itself.
        let (first_ms, last_ms) = (start / 1_000_000, end.div_ceil(1_000_000));
        let at = match args.at {
            Some(t) if ns(t) < first_ms * 1_000_000 || ns(t) > last_ms * 1_000_000 => bail!(
                "--at {t} is outside the trace ({:.3} s to {:.3} s)",
                first_ms as f64 / 1e3,
                last_ms as f64 / 1e3
            ),
            Some(t) => ns(t).clamp(start, end),
            None => end,
        };
        let w = Window {
            at_ns: at,
            busy_ns,
            history_ns: u64::MAX,
            start_ns: start,
        };
        let title = format!("replay {}", path.display());
        if args.once {
            return print_frame(&view::render(&title, &ranks, w));
        }
        return tui::replay(&title, &ranks, w, (start, end));
    }
    let Some(sock) = args.attach.clone().or_else(|| {
        std::env::var_os("BRAID_LIVE")
            .filter(|p| !p.is_empty())
            .map(PathBuf::from)
    }) else {
        bail!("name a trace to replay (--replay FILE) or a program to attach to (--attach SOCKET, or BRAID_LIVE)");
    };
    // The runtime serving it replaced `{rank}` by its rank.
    let sock = match sock.to_str() {
        Some(s) if s.contains("{rank}") => {
            PathBuf::from(s.replace("{rank}", &args.rank.to_string()))
        }
        _ => sock,
    };
    let history_ns = ns(args.history);
    let mut lines = feed::connect(&sock)?;
    let title = format!("live {}", sock.display());
    if args.once {
        let mut feed = feed::Feed::new(history_ns);
        loop {
            let Some(line) = lines.next() else {
                bail!("`{}` closed before a whole frame arrived", sock.display());
            };
            if feed.apply(line?) {
                break;
            }
        }
        let w = Window {
            at_ns: feed.now_ns,
            busy_ns,
            history_ns,
            start_ns: feed.start_ns,
        };
        return print_frame(&view::render(&title, &feed.ranks(), w));
    }
    tui::live(&title, lines, busy_ns, history_ns)
}

/// Prints one frame (`--once`); a reader that has gone (`--once | head
/// -3`) ends it quietly.
fn print_frame(frame: &str) -> Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match out.write_all(frame.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
            Err(e).context("writing the frame to standard output")
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    /// Seconds as written read as the nanoseconds they name.
    #[test]
    fn seconds_round_to_nanoseconds() {
        assert_eq!(super::ns(1.023), 1_023_000_000);
        assert_eq!(super::ns(2.755), 2_755_000_000);
        assert_eq!(super::ns(0.0), 0);
        assert_eq!(super::ns(-1.0), 0);
    }
}

//! The live view's feed: a local (Unix domain) socket on which a running
//! program streams what its streams do, for `braid top` to show.
//!
//! One event log feeds the Chrome trace and the live view: the spans each
//! stream thread records (a live runtime profiles). A client that connects
//! receives, every [`PERIOD`], one JSON line per runtime served on the
//! socket, then a `{"tick": n}` line that closes the round:
//!
//! ```json
//! {"rank": 0, "runtime": 7, "now_us": 1234.5, "class": "latency-critical",
//!  "busy": {"n": 180, "p50_us": 1210.0, "p99_us": 4100.0, "max_us": 5200.0},
//!  "streams": [{"name": "compute 0", "is_comm": false, "queued": 3,
//!               "running": {"task": 41, "name": "matmul", "scope": "forward/layer3",
//!                           "since_us": 1200.0}}],
//!  "events": [ ...the Chrome trace's X events recorded since the last round... ]}
//! ```
//!
//! `class` is the runtime's priority class; `busy` summarises its busy
//! periods — from a submission to an idle runtime until every submitted task
//! has finished, a request's latency for a program that serves one request
//! at a time (`null` before the first ends). `queued` counts the tasks placed
//! on the stream and not finished (the one running included); `running` is
//! `null` on an idle stream; on CUDA, whose stream threads launch work rather
//! than run it, it is the stream's oldest unfinished task once the device has
//! started it. Several
//! runtimes of one process (the ranks of a CPU job) may share one socket:
//! the first to name a path serves it, and it closes, its file removed, when
//! the last of them is dropped.

use std::borrow::Cow;

/// What a stream thread is running, as the live view shows it.
#[derive(Debug, Clone)]
// Read only by the live view's server, which needs Unix sockets (and is
// left out of the loom models).
#[cfg_attr(not(all(unix, not(loom))), allow(dead_code))]
pub(crate) struct Running {
    /// Submission index.
    pub(crate) id: u64,
    /// Task name.
    pub(crate) name: Cow<'static, str>,
    /// The scope it was submitted in.
    pub(crate) scope: Option<std::sync::Arc<str>>,
    /// When it started, on the process timeline.
    pub(crate) start_ns: u64,
}

/// The task a stream runs, as one frame shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LiveTask {
    /// Submission index.
    pub id: u64,
    /// Task name.
    pub name: String,
    /// The scope it was submitted in, if any.
    pub scope: Option<String>,
    /// When it started, ns on the process timeline.
    pub since_ns: u64,
}

/// A stream as one frame shows it.
#[derive(Debug, Clone)]
pub struct LiveStream {
    /// Its name (`compute 0`, `comm 0`).
    pub name: String,
    /// Whether it is a communication stream.
    pub is_comm: bool,
    /// Tasks placed on it and not finished (the running one included).
    pub queued: u64,
    /// The task it runs; `None` when idle (on CUDA: the oldest unfinished
    /// task, once the device has started it).
    pub running: Option<LiveTask>,
}

/// A runtime's busy periods, as one frame summarises them: from a
/// submission to an idle runtime until every submitted task has finished —
/// a request's latency, for a program that serves one request at a time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BusyPeriods {
    /// How many are kept (the last 4096).
    pub n: u64,
    /// Median, ns.
    pub p50_ns: u64,
    /// 99th percentile, ns.
    pub p99_ns: u64,
    /// Longest, ns.
    pub max_ns: u64,
}

impl BusyPeriods {
    /// The summary of the periods `lengths` (ns, any order): `None` for
    /// none.
    pub fn of(lengths: impl IntoIterator<Item = u64>) -> Option<BusyPeriods> {
        let mut v: Vec<u64> = lengths.into_iter().collect();
        if v.is_empty() {
            return None;
        }
        v.sort_unstable();
        let pct = |p: f64| v[((p * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1];
        Some(BusyPeriods {
            n: v.len() as u64,
            p50_ns: pct(0.5),
            p99_ns: pct(0.99),
            max_ns: pct(1.0),
        })
    }
}

/// One runtime's frame: its streams now and the spans recorded since the
/// client's previous frame of it.
#[derive(Debug, Clone)]
pub struct Frame {
    /// The runtime's rank.
    pub rank: usize,
    /// The runtime's process-unique id (ranks of one process may repeat
    /// across jobs; ids do not).
    pub runtime: u64,
    /// When the frame was taken, ns on the process timeline.
    pub now_ns: u64,
    /// The runtime's priority class.
    pub class: Option<crate::Class>,
    /// Its busy periods so far; `None` before the first ends.
    pub busy: Option<BusyPeriods>,
    /// Its streams, by index.
    pub streams: Vec<LiveStream>,
    /// Spans recorded since the previous frame.
    pub spans: Vec<super::Span>,
}

/// A line of the live view's stream.
#[derive(Debug, Clone)]
pub enum Line {
    /// A runtime's frame.
    Frame(Frame),
    /// The end of round `n`: every runtime served has sent its frame.
    Tick(u64),
}

impl Line {
    /// Parses one line a live runtime wrote.
    pub fn parse(line: &str) -> crate::Result<Line> {
        use serde_json::Value;
        let bad = |why: &str| crate::Error::BadTrace(format!("live-view line: {why}"));
        let v: Value = serde_json::from_str(line).map_err(|e| bad(&e.to_string()))?;
        if let Some(n) = v.get("tick").and_then(Value::as_u64) {
            return Ok(Line::Tick(n));
        }
        let num = |k: &str| v.get(k).and_then(Value::as_u64).ok_or_else(|| bad(k));
        let us = super::event::us_to_ns;
        let streams = v
            .get("streams")
            .and_then(Value::as_array)
            .ok_or_else(|| bad("streams"))?
            .iter()
            .map(|st| LiveStream {
                name: st.get("name").and_then(Value::as_str).unwrap_or("").into(),
                is_comm: st.get("is_comm").and_then(Value::as_bool).unwrap_or(false),
                queued: st.get("queued").and_then(Value::as_u64).unwrap_or(0),
                running: st
                    .get("running")
                    .filter(|r| !r.is_null())
                    .map(|r| LiveTask {
                        id: r.get("task").and_then(Value::as_u64).unwrap_or(0),
                        name: r.get("name").and_then(Value::as_str).unwrap_or("").into(),
                        scope: r.get("scope").and_then(Value::as_str).map(Into::into),
                        since_ns: us(r.get("since_us")),
                    }),
            })
            .collect();
        let spans = v
            .get("events")
            .and_then(Value::as_array)
            .map(|evs| {
                evs.iter()
                    .filter_map(super::event::span_of_event)
                    .map(|(_, s)| s)
                    .collect()
            })
            .unwrap_or_default();
        Ok(Line::Frame(Frame {
            rank: num("rank")? as usize,
            runtime: num("runtime")?,
            now_ns: us(v.get("now_us")),
            class: v
                .get("class")
                .and_then(Value::as_str)
                .and_then(crate::Class::from_name),
            busy: v.get("busy").filter(|b| !b.is_null()).map(|b| BusyPeriods {
                n: b.get("n").and_then(Value::as_u64).unwrap_or(0),
                p50_ns: us(b.get("p50_us")),
                p99_ns: us(b.get("p99_us")),
                max_ns: us(b.get("max_us")),
            }),
            streams,
            spans,
        }))
    }
}

/// How often a connected client gets a round of frames.
pub const PERIOD: std::time::Duration = std::time::Duration::from_millis(100);

#[cfg(all(unix, not(loom)))]
pub(crate) use serve::{register, Registration, Source};

#[cfg(all(unix, not(loom)))]
mod serve {
    use crate::error::{Error, Result};
    use serde_json::Value;
    use std::io::Write;
    use std::os::unix::net::{UnixListener, UnixStream};
    use std::path::{Path, PathBuf};
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex, Weak};

    /// A runtime as the live view sees it.
    pub(crate) trait Source: Send + Sync {
        /// One frame (the JSON object the module doc shows), with the spans
        /// recorded past `cursors` (one position per stream, advanced).
        fn frame(&self, cursors: &mut Vec<usize>) -> Value;
    }

    /// One socket and the runtimes it serves.
    struct Hub {
        path: PathBuf,
        /// The socket file's device and inode once bound: what the path
        /// must still name for the file to be this hub's to remove (another
        /// program may have replaced it).
        file: (u64, u64),
        /// A handle on the accept loop's socket, to wake the loop by shutting
        /// the socket down (Linux).
        #[cfg(target_os = "linux")]
        listener: UnixListener,
        sources: Mutex<Vec<(u64, Weak<dyn Source>)>>,
        closed: AtomicBool,
        accept: Mutex<Option<std::thread::JoinHandle<()>>>,
    }

    /// The device and inode `path` names, if it names anything.
    fn file_id(path: &Path) -> Option<(u64, u64)> {
        use std::os::unix::fs::MetadataExt;
        std::fs::symlink_metadata(path)
            .ok()
            .map(|m| (m.dev(), m.ino()))
    }

    /// The sockets this process serves.
    static HUBS: Mutex<Vec<Arc<Hub>>> = Mutex::new(Vec::new());

    fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
        m.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A runtime's place on a socket; dropping it leaves, and the last to
    /// leave closes the socket.
    pub(crate) struct Registration {
        hub: Arc<Hub>,
        id: u64,
    }

    impl std::fmt::Debug for Registration {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "Registration({})", self.hub.path.display())
        }
    }

    /// Serves runtime `id` (`source`) on the socket at `path`, opening it if
    /// no runtime of this process serves it yet. A path another process
    /// serves is an error; a stale socket file (nothing answers) is replaced.
    pub(crate) fn register(path: &Path, id: u64, source: Weak<dyn Source>) -> Result<Registration> {
        let mut hubs = lock(&HUBS);
        if let Some(hub) = hubs.iter().find(|h| h.path == path) {
            lock(&hub.sources).push((id, source));
            return Ok(Registration {
                hub: hub.clone(),
                id,
            });
        }
        let refuse = |why: String| {
            Error::Config(format!(
                "cannot serve the live view on `{}`: {why}",
                path.display()
            ))
        };
        if let Ok(meta) = std::fs::symlink_metadata(path) {
            use std::os::unix::fs::FileTypeExt;
            if !meta.file_type().is_socket() {
                return Err(refuse(
                    "it exists and is not a socket (only a stale socket is replaced)".into(),
                ));
            }
            if UnixStream::connect(path).is_ok() {
                return Err(refuse("another program serves it".into()));
            }
            std::fs::remove_file(path).map_err(|e| refuse(format!("stale socket: {e}")))?;
        }
        let listener = UnixListener::bind(path).map_err(|e| refuse(e.to_string()))?;
        let file = file_id(path).ok_or_else(|| refuse("the socket vanished once bound".into()))?;
        #[cfg(target_os = "linux")]
        let handle = listener.try_clone().map_err(|e| refuse(e.to_string()))?;
        let hub = Arc::new(Hub {
            path: path.to_path_buf(),
            file,
            #[cfg(target_os = "linux")]
            listener: handle,
            sources: Mutex::new(vec![(id, source)]),
            closed: AtomicBool::new(false),
            accept: Mutex::new(None),
        });
        let h = hub.clone();
        let thread = std::thread::Builder::new()
            .name("braid-live".into())
            .spawn(move || {
                // An observer: never at the real-time policy of the thread
                // that built the runtime (Linux threads inherit it).
                crate::sched::tenants::leave_inherited_realtime();
                accept(&h, listener)
            })
            .map_err(|e| refuse(e.to_string()))?;
        *lock(&hub.accept) = Some(thread);
        hubs.push(hub.clone());
        Ok(Registration { hub, id })
    }

    impl Drop for Registration {
        fn drop(&mut self) {
            let mut hubs = lock(&HUBS);
            let mut sources = lock(&self.hub.sources);
            sources.retain(|(id, _)| *id != self.id);
            if !sources.is_empty() {
                return;
            }
            drop(sources);
            hubs.retain(|h| !Arc::ptr_eq(h, &self.hub));
            drop(hubs);
            self.hub.closed.store(true, Ordering::Release);
            // The path may name another program's socket by now (ours
            // removed, the path bound again): connecting there would wake
            // that program's loop, not ours, and removing the file would
            // take its socket away. Only a file still ours is touched.
            let ours = file_id(&self.hub.path) == Some(self.hub.file);
            // Wake the accept loop so it sees `closed`: on Linux shutting
            // the listening socket down fails a blocked `accept`; elsewhere
            // a connection through the file, which only works while it is
            // ours (if not, the loop is left blocked rather than joined).
            #[cfg(target_os = "linux")]
            let woken = {
                use std::os::fd::AsRawFd;
                // SAFETY: `listener` is an open socket this hub owns.
                unsafe { libc::shutdown(self.hub.listener.as_raw_fd(), libc::SHUT_RDWR) == 0 }
            };
            #[cfg(not(target_os = "linux"))]
            let woken = ours && UnixStream::connect(&self.hub.path).is_ok();
            if woken {
                if let Some(t) = lock(&self.hub.accept).take() {
                    let _ = t.join();
                }
            }
            if ours {
                let _ = std::fs::remove_file(&self.hub.path);
            }
        }
    }

    fn accept(hub: &Arc<Hub>, listener: UnixListener) {
        for conn in listener.incoming() {
            if hub.closed.load(Ordering::Acquire) {
                return;
            }
            let Ok(conn) = conn else { continue };
            let h = hub.clone();
            // A client that stops reading only ends its own thread.
            let _ = std::thread::Builder::new()
                .name("braid-live-client".into())
                .spawn(move || feed(&h, conn));
        }
    }

    /// Writes rounds of frames to one client until it leaves or the socket
    /// closes.
    fn feed(hub: &Hub, conn: UnixStream) {
        let mut out = std::io::BufWriter::new(conn);
        let mut cursors: Vec<(u64, Vec<usize>)> = Vec::new();
        for tick in 0u64.. {
            if hub.closed.load(Ordering::Acquire) {
                return;
            }
            let sources: Vec<(u64, Arc<dyn Source>)> = lock(&hub.sources)
                .iter()
                .filter_map(|(id, w)| w.upgrade().map(|s| (*id, s)))
                .collect();
            for (id, source) in sources {
                let at = match cursors.iter().position(|(i, _)| *i == id) {
                    Some(at) => at,
                    None => {
                        cursors.push((id, Vec::new()));
                        cursors.len() - 1
                    }
                };
                let frame = source.frame(&mut cursors[at].1);
                if serde_json::to_writer(&mut out, &frame).is_err() || out.write_all(b"\n").is_err()
                {
                    return;
                }
            }
            let end = serde_json::json!({ "tick": tick });
            if serde_json::to_writer(&mut out, &end).is_err()
                || out.write_all(b"\n").is_err()
                || out.flush().is_err()
            {
                return;
            }
            std::thread::sleep(super::PERIOD);
        }
    }
}

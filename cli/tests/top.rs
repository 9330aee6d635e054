//! `braid top` as a user runs it: on a trace of the trainer, and attached to
//! a running program over its socket.

use braid::{BackendKind, Runtime};
use std::process::{Command, Output};
use std::sync::mpsc;
use std::time::Duration;

const BIN: &str = env!("CARGO_BIN_EXE_braid");

fn top(args: &[&str]) -> Output {
    Command::new(BIN).arg("top").args(args).output().unwrap()
}

fn stdout(o: &Output) -> String {
    assert!(
        o.status.success(),
        "braid top failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout.clone()).unwrap()
}

/// A trace of the GPT-2 trainer (two CPU ranks, as the main job runs):
/// `--once` prints a frame naming every rank and stream, with the share of
/// communication hidden and the busiest tasks; `--at` picks an instant.
#[test]
fn replay_once_names_every_stream_of_the_trainer() {
    use braid_gpt2::data::{Split, TokenSource};
    use braid_gpt2::trainer::{train, StartState, TrainOptions};
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("trace.json");
    // The main job's model and batch shape (`braid-gpt2` with no arguments).
    let opts = TrainOptions {
        model: braid_gpt2::config::Gpt2Config::small(),
        seq_len: 64,
        steps: 2,
        trace: Some(trace.clone()),
        ..TrainOptions::default()
    };
    let data = TokenSource::builtin(Split::Train).unwrap();
    train(&opts, StartState::fresh(&opts.model, 1), &data, &|_| {}).unwrap();
    let text = stdout(&top(&["--replay", trace.to_str().unwrap(), "--once"]));
    let profiles =
        braid::trace::read_chrome_trace(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    assert_eq!(profiles.len(), 2);
    for p in &profiles {
        // The trace keeps the class and the busy periods, as a live frame
        // gives them.
        assert!(
            text.contains(&format!("rank {} [normal]  comm", p.rank)),
            "{text}"
        );
        assert!(!p.busy.is_empty(), "rank {}: no busy periods", p.rank);
        for s in &p.streams {
            let row = text.lines().any(|l| l.trim_start().starts_with(&s.name));
            assert!(row, "no row for `{}` in\n{text}", s.name);
        }
    }
    assert!(text.contains("hidden under compute") && text.contains("time by scope"));
    // Its reader gone before the frame (`--once | head -0`): a quiet end.
    let mut child = Command::new(BIN)
        .args(["top", "--replay", trace.to_str().unwrap(), "--once"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && err.is_empty(),
        "{:?}: {err}",
        out.status
    );
    // Why the tasks went where they did, over all of each rank's tasks
    // (a long line goes on under its first part: joined again here).
    let joined = text.replace(&format!("\n{}", " ".repeat("  placed: ".len())), " ");
    for p in &profiles {
        let of = format!("(of {} tasks)", p.spans.len());
        let line = joined.lines().find(|l| l.contains(&of));
        assert!(
            line.is_some_and(|l| l.starts_with("  placed: ")),
            "no `{of}` in\n{text}"
        );
    }
    // Every task the trainer submits is in a scope (what a placement file
    // matches), its uploads and reads too.
    for p in &profiles {
        let bare: Vec<&str> = p
            .spans
            .iter()
            .filter(|s| s.scope.is_none())
            .map(|s| &*s.name)
            .collect();
        assert!(
            bare.is_empty(),
            "rank {}: tasks without a scope: {bare:?}",
            p.rank
        );
    }
    // An instant inside the run shows a task running on some stream.
    let first = profiles[0]
        .spans
        .iter()
        .max_by_key(|s| s.end_ns - s.start_ns)
        .unwrap();
    let mid = (first.start_ns + first.end_ns) / 2;
    let at = format!("{:.9}", mid as f64 / 1e9);
    let text = stdout(&top(&[
        "--replay",
        trace.to_str().unwrap(),
        "--once",
        "--at",
        &at,
    ]));
    // Shown with its scope: the trainer submits in scopes.
    let scope = first
        .scope
        .as_deref()
        .expect("the trainer's tasks have scopes");
    assert!(
        text.contains(&format!("{} [{scope}] (", first.name)),
        "{} not running in\n{text}",
        first.name
    );
    // At the end (the default), every busy period has ended, the last too
    // (it ends a little after its last task).
    let at_end = stdout(&top(&["--replay", trace.to_str().unwrap(), "--once"]));
    for p in &profiles {
        let n = format!("busy periods (submission to idle): {},", p.busy.len());
        assert!(at_end.contains(&n), "{n} missing from\n{at_end}");
    }
    // The start as the bounds are printed (to the millisecond) is taken.
    let start = profiles
        .iter()
        .flat_map(|p| &p.spans)
        .map(|s| s.start_ns)
        .min()
        .unwrap();
    let printed = format!("{:.3}", (start / 1_000_000) as f64 / 1e3);
    let t = trace.to_str().unwrap();
    let text = stdout(&top(&["--replay", t, "--once", "--at", &printed]));
    assert!(
        text.contains(&format!("t={:.3} s", start as f64 / 1e9)),
        "{text}"
    );
    let o = top(&["--replay", t, "--once", "--at", "1e6"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains(&format!("({printed} s to ")),
        "{err}"
    );
}

/// A socket that accepts and then says nothing (a program stopped, or not
/// a Braid live view): `--once` fails naming the silence, it does not wait
/// for ever.
#[cfg(unix)]
#[test]
fn attach_once_to_a_silent_socket_fails() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("silent.sock");
    let listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
    let held = std::thread::spawn(move || listener.accept().map(|(conn, _)| conn));
    let t0 = std::time::Instant::now();
    let o = top(&["--attach", sock.to_str().unwrap(), "--once"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    assert!(err.contains("sent nothing for 5 s"), "{err}");
    assert!(t0.elapsed() < Duration::from_secs(30));
    drop(held.join());
}

/// A socket that streams without ever ending a line (not a Braid live
/// view): `--once` fails saying the line is too long, having held at most
/// the bound (256 MiB), rather than growing until memory runs out.
#[cfg(unix)]
#[test]
fn attach_once_to_an_endless_line_fails() {
    use std::io::{Read, Write};
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("endless.sock");
    let listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
    let server = std::thread::spawn(move || {
        let (mut conn, _) = listener.accept().unwrap();
        // 1 MiB chunks, no newline: 320 MiB at most, past the client's
        // bound, then silence until the client leaves (a client without
        // the bound fails on the silence instead, saying so).
        let chunk = vec![b'x'; 1 << 20];
        for _ in 0..320 {
            if conn.write_all(&chunk).is_err() {
                return;
            }
        }
        let _ = conn.read(&mut [0]);
    });
    let t0 = std::time::Instant::now();
    let o = top(&["--attach", sock.to_str().unwrap(), "--once"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    assert!(
        err.contains(&format!(
            "`{}` sent a line longer than 256 MiB: not a Braid live view",
            sock.display()
        )),
        "{err}"
    );
    assert!(t0.elapsed() < Duration::from_secs(30));
    server.join().unwrap();
}

/// Attached to a running program, `--once` shows the task a stream runs now
/// and the tasks queued behind it.
#[cfg(unix)]
#[test]
fn attach_once_shows_the_running_task() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("live.sock");
    let rt = Runtime::builder()
        .backend(BackendKind::Cpu)
        .compute_streams(2)
        .oversubscribe(true)
        .live(&sock)
        .build()
        .unwrap();
    let x = rt.alloc("x", 4).unwrap();
    // One busy period first, for the frame's summary of them.
    rt.task("warm-up").run(x.write::<u8>(), |_| ()).unwrap();
    rt.synchronize().unwrap();
    let (release, gate) = mpsc::channel::<()>();
    let (started, running) = mpsc::channel::<()>();
    rt.task("long matmul")
        .run(x.write::<u8>(), move |_| {
            started.send(()).unwrap();
            let _ = gate.recv_timeout(Duration::from_secs(30));
        })
        .unwrap();
    rt.task("after it").run(x.read::<u8>(), |_| ()).unwrap();
    running.recv_timeout(Duration::from_secs(10)).unwrap();
    let text = stdout(&top(&["--attach", sock.to_str().unwrap(), "--once"]));
    release.send(()).unwrap();
    rt.synchronize().unwrap();
    assert!(text.contains("QUEUED"), "{text}");
    assert!(text.contains("rank 0 [normal]"), "{text}");
    assert!(
        text.contains("busy periods (submission to idle): 1,"),
        "{text}"
    );
    let row = text
        .lines()
        .find(|l| l.contains("long matmul ("))
        .unwrap_or_else(|| panic!("the running task is not shown:\n{text}"));
    let cols: Vec<&str> = row.split_whitespace().collect();
    // STREAM (two words) BUSY DONE QUEUED RUNNING…
    assert_eq!(
        cols[4], "2",
        "the running task and the one behind it: {row}"
    );
    for s in ["compute 0", "compute 1", "comm 0"] {
        assert!(text.contains(s), "{s} missing:\n{text}");
    }
}

/// Bad input: a clear error naming what was wrong, non-zero exit.
#[test]
fn errors_name_the_problem() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.json");
    std::fs::write(&bad, "{\"traceEvents\": [{\"ph\": \"M\"}]}").unwrap();
    for (args, expect) in [
        (
            vec!["--replay", bad.to_str().unwrap(), "--once"],
            "bad.json",
        ),
        (
            vec!["--replay", "/nonexistent/t.json", "--once"],
            "/nonexistent/t.json",
        ),
        (
            vec!["--attach", "/nonexistent/s.sock", "--once"],
            "cannot attach",
        ),
    ] {
        let o = Command::new(BIN)
            .arg("top")
            .args(&args)
            .env_remove("BRAID_LIVE")
            .output()
            .unwrap();
        assert!(!o.status.success(), "{args:?} succeeded");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains(expect), "{args:?}: {err}");
    }
    let o = Command::new(BIN)
        .args(["top", "--once"])
        .env_remove("BRAID_LIVE")
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&o.stderr).contains("--replay FILE"));
    // Flags of the other mode are refused, not ignored.
    let t = bad.to_str().unwrap();
    for args in [
        vec!["--replay", t, "--rank", "1"],
        vec!["--replay", t, "--history", "5"],
        vec!["--attach", "/nonexistent/s.sock", "--at", "1"],
    ] {
        let o = top(&args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            !o.status.success() && err.contains("cannot be used with"),
            "{args:?}: {err}"
        );
    }
}

/// Times Braid never writes — a task or busy period without a `dur`, with
/// a negative one, or timed absurdly late — are refused, naming the event,
/// rather than shown (`ts` 1e300 once showed `t=18446744073.710 s`, every
/// stream 0% busy). What Braid does write without them (metadata, events
/// that are not tasks) is read as before.
#[test]
fn replay_refuses_times_braid_never_writes() {
    let dir = tempfile::tempdir().unwrap();
    let meta = r#"{"ph":"M","name":"thread_name","pid":0,"tid":0,"args":{"name":"compute 0"}},
        {"ph":"M","name":"process_name","pid":0,"tid":0,"args":{"name":"rank 0","class":"normal"}},
        {"ph":"X","name":"host","pid":0,"tid":5,"ts":-3},
        {"ph":"X","name":"busy","cat":"busy","pid":0,"tid":1,"ts":10,"dur":0},"#;
    let task = |times: &str| {
        format!(
            r#"{{"ph":"X","name":"matmul","cat":"compute","pid":0,"tid":0,{times}"args":{{"task":1}}}}"#
        )
    };
    let trace = |events: &str| {
        let path = dir.path().join("t.json");
        std::fs::write(&path, format!("[{meta}{events}]")).unwrap();
        path
    };
    // A trace as Braid writes it: read, its instant the task's end.
    let good = trace(&task(r#""ts":10,"dur":5,"#));
    let text = stdout(&top(&["--replay", good.to_str().unwrap(), "--once"]));
    assert!(
        text.contains("t=0.000 s") && text.contains("compute 0"),
        "{text}"
    );
    let busy = r#"{"ph":"X","name":"busy","cat":"busy","pid":0,"tid":1,"ts":1,"dur":-2}"#;
    for (events, expect) in [
        (task(r#""ts":10,"#), "event 4 (`matmul`): it has no `dur`"),
        (
            task(r#""ts":10,"dur":-5,"#),
            "event 4 (`matmul`): its `dur` -5 is negative",
        ),
        (task(r#""dur":5,"#), "event 4 (`matmul`): it has no `ts`"),
        (task(r#""ts":-1.5,"dur":5,"#), "its `ts` -1.5 is negative"),
        (
            task(r#""ts":"soon","dur":5,"#),
            r#"its `ts` "soon" is not a number"#,
        ),
        (
            task(r#""ts":1e300,"dur":5,"#),
            "event 4 (`matmul`): it ends past 1e15 µs (its `ts` is 1e+300)",
        ),
        (task(r#""ts":1,"dur":1e300,"#), "it ends past 1e15 µs"),
        (
            format!("{},{busy}", task(r#""ts":10,"dur":5,"#)),
            "event 5 (`busy`): its `dur` -2 is negative",
        ),
    ] {
        let path = trace(&events);
        let o = top(&["--replay", path.to_str().unwrap(), "--once"]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            !o.status.success(),
            "{events}: {}",
            String::from_utf8_lossy(&o.stdout)
        );
        assert!(
            err.contains("t.json") && err.contains("not a Braid trace: ") && err.contains(expect),
            "{events}: {err}"
        );
    }
}

/// `{rank}` in the socket path is the rank's socket (`--rank`, default 0),
/// as the runtimes serving it expand it; the interactive view without a
/// terminal says to use `--once` rather than failing inside the terminal
/// library.
#[test]
fn rank_patterns_and_no_terminal() {
    let dir = tempfile::tempdir().unwrap();
    let pattern = dir.path().join("r{rank}.sock");
    let trace = dir.path().join("t.json");
    let rt = Runtime::builder()
        .backend(BackendKind::Cpu)
        .rank(1)
        .live(&pattern)
        .trace(&trace)
        .build()
        .unwrap();
    let x = rt.alloc("x", 4).unwrap();
    rt.task("one").run(x.write::<u8>(), |_| ()).unwrap();
    rt.synchronize().unwrap();
    let p = pattern.to_str().unwrap();
    let text = stdout(&top(&["--attach", p, "--rank", "1", "--once"]));
    assert!(text.contains("rank 1"), "{text}");
    let o = top(&["--attach", p, "--once"]);
    assert!(!o.status.success(), "rank 0 serves nothing here");
    assert!(String::from_utf8_lossy(&o.stderr).contains("r0.sock"));
    drop(rt);
    let o = Command::new(BIN)
        .args(["top", "--replay", trace.to_str().unwrap()])
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("needs a terminal") && err.contains("--once"),
        "{err}"
    );
}

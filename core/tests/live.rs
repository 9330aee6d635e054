//! The live view's socket (`RuntimeBuilder::live`): what a client reads
//! while a program runs.
#![cfg(unix)]

use braid::trace::live::{Frame, Line};
use braid::{BackendKind, Class, Runtime, RuntimeBuilder};
use std::io::{BufRead, BufReader};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::mpsc;
use std::time::{Duration, Instant};

fn cpu(rank: usize) -> RuntimeBuilder {
    Runtime::builder()
        .backend(BackendKind::Cpu)
        .compute_streams(2)
        .oversubscribe(true)
        .rank(rank)
}

/// Reads lines from `sock` until round `rounds` ends; returns the frames.
fn read_rounds(sock: &Path, rounds: u64) -> Vec<Frame> {
    let conn = UnixStream::connect(sock).expect("the live socket accepts");
    conn.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut frames = Vec::new();
    for line in BufReader::new(conn).lines() {
        match Line::parse(&line.expect("a line within 10 s")).unwrap() {
            Line::Frame(f) => frames.push(f),
            Line::Tick(n) if n + 1 >= rounds => break,
            Line::Tick(_) => {}
        }
    }
    frames
}

/// A client sees the task a stream is running, the tasks queued behind it,
/// and afterwards their spans; two runtimes of a process share the socket,
/// each rank its own frames; the socket file goes when the last one drops.
#[test]
fn live_socket_shows_running_and_finished_tasks() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("top.sock");
    let rt = cpu(0)
        .class(Class::LatencyCritical)
        .live(&sock)
        .build()
        .unwrap();
    let other = cpu(1).live(&sock).build().unwrap();
    let x = rt.alloc("x", 4).unwrap();
    let (release, gate) = mpsc::channel::<()>();
    {
        let _s = rt.scope("serve");
        rt.task("blocker")
            .run(x.write::<u8>(), move |_| {
                let _ = gate.recv_timeout(Duration::from_secs(20));
            })
            .unwrap();
    }
    for _ in 0..3 {
        rt.task("behind").run(x.read_write::<u8>(), |_| ()).unwrap();
    }
    // The blocker has started once the stream publishes it.
    let deadline = Instant::now() + Duration::from_secs(10);
    let frame = loop {
        let frames = read_rounds(&sock, 1);
        let mine = frames.iter().find(|f| f.rank == 0).expect("rank 0's frame");
        let busy = mine.streams.iter().find(|s| s.running.is_some());
        if let Some(s) = busy {
            let task = s.running.as_ref().unwrap();
            assert_eq!(
                (task.name.as_str(), task.scope.as_deref()),
                ("blocker", Some("serve"))
            );
            break mine.clone();
        }
        assert!(Instant::now() < deadline, "no stream showed the blocker");
    };
    assert!(frames_name_streams(&frame));
    let queued: u64 = frame.streams.iter().map(|s| s.queued).sum();
    assert_eq!(queued, 4, "the blocker and the three behind it");
    release.send(()).unwrap();
    rt.synchronize().unwrap();
    let o = other.alloc("o", 4).unwrap();
    other
        .task("elsewhere")
        .run(o.write::<u8>(), |_| ())
        .unwrap();
    other.synchronize().unwrap();
    // A new client gets every span recorded so far, rank by rank.
    let frames = read_rounds(&sock, 2);
    let names = |rank: usize| -> Vec<String> {
        frames
            .iter()
            .filter(|f| f.rank == rank)
            .flat_map(|f| f.spans.iter().map(|s| s.name.to_string()))
            .collect()
    };
    assert_eq!(names(0), vec!["blocker", "behind", "behind", "behind"]);
    let scope_of = |name: &str| {
        let s = frames
            .iter()
            .flat_map(|f| &f.spans)
            .find(|s| s.name == name);
        s.and_then(|s| s.scope.as_deref().map(str::to_string))
    };
    assert_eq!(scope_of("blocker").as_deref(), Some("serve"));
    assert_eq!(scope_of("behind"), None);
    assert_eq!(names(1), vec!["elsewhere"]);
    for f in &frames {
        assert!(f
            .streams
            .iter()
            .all(|s| s.running.is_none() && s.queued == 0));
    }
    // Each runtime's class, and its one busy period so far: from the
    // blocker's submission until the last task behind it finished.
    let last = |rank: usize| frames.iter().rev().find(|f| f.rank == rank).unwrap();
    assert_eq!(last(0).class, Some(Class::LatencyCritical));
    assert_eq!(last(1).class, Some(Class::Normal));
    for rank in [0, 1] {
        let busy = last(rank).busy.expect("a busy period ended");
        assert_eq!(busy.n, 1, "rank {rank}");
        assert!(busy.p50_ns > 0 && busy.p50_ns <= busy.max_ns, "{busy:?}");
    }
    drop(rt);
    assert!(sock.exists(), "rank 1 still serves the socket");
    drop(other);
    assert!(!sock.exists(), "the last runtime removes the socket");
}

fn frames_name_streams(f: &Frame) -> bool {
    let names: Vec<&str> = f.streams.iter().map(|s| s.name.as_str()).collect();
    names == ["compute 0", "compute 1", "comm 0"]
}

/// `{rank}` in the path gives each rank its own socket; a socket another
/// program serves is refused with the path named, a stale file replaced, an
/// empty path refused as empty.
#[test]
fn live_socket_paths() {
    let dir = tempfile::tempdir().unwrap();
    let pattern = dir.path().join("r{rank}.sock");
    let a = cpu(0).live(&pattern).build().unwrap();
    let b = cpu(1).live(&pattern).build().unwrap();
    assert!(dir.path().join("r0.sock").exists() && dir.path().join("r1.sock").exists());
    drop((a, b));
    // Served by someone else (a listener of this test stands in).
    let taken = dir.path().join("taken.sock");
    let _listener = std::os::unix::net::UnixListener::bind(&taken).unwrap();
    let err = cpu(0).live(&taken).build().unwrap_err();
    assert!(
        err.to_string().contains("taken.sock") && err.to_string().contains("another program"),
        "{err}"
    );
    // A file nobody answers on is replaced.
    let stale = dir.path().join("stale.sock");
    drop(std::os::unix::net::UnixListener::bind(&stale).unwrap());
    assert!(stale.exists());
    let rt = cpu(0).live(&stale).build().unwrap();
    assert_eq!(read_rounds(&stale, 1).len(), 1);
    drop(rt);
    // An empty path says so (`BRAID_LIVE=` set empty counts as unset).
    let err = cpu(0).live("").build().unwrap_err().to_string();
    assert!(
        err.contains("socket path") && err.contains("empty"),
        "{err}"
    );
}

/// A path that names a file of another kind is refused, and the file kept
/// (only a stale socket is replaced); a runtime whose socket file was
/// removed and bound again by another program drops without hanging (its
/// accept loop is woken through its own socket, not the path) and leaves
/// the other program's socket in place.
#[test]
fn live_socket_files_of_others_are_left_alone() {
    let dir = tempfile::tempdir().unwrap();
    let notes = dir.path().join("notes.txt");
    std::fs::write(&notes, "precious").unwrap();
    let err = cpu(0).live(&notes).build().unwrap_err();
    assert!(err.to_string().contains("not a socket"), "{err}");
    assert_eq!(std::fs::read_to_string(&notes).unwrap(), "precious");

    let sock = dir.path().join("m.sock");
    let rt = cpu(0).live(&sock).build().unwrap();
    std::fs::remove_file(&sock).unwrap();
    let other = std::os::unix::net::UnixListener::bind(&sock).unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        drop(rt);
        tx.send(()).unwrap();
    });
    rx.recv_timeout(Duration::from_secs(10))
        .expect("the runtime drops within 10 s");
    assert!(sock.exists(), "the other program's socket is still there");
    other.set_nonblocking(true).unwrap();
    assert!(
        other.accept().is_err(),
        "dropping the runtime connected to the other program's socket"
    );
}

/// A client attached across `clear_profile` gets every span recorded after
/// it, even when more were recorded since than it had read before (its
/// position counts spans ever recorded, not the cleared log's).
#[test]
fn a_client_attached_across_clear_profile_misses_no_span() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("c.sock");
    let rt = cpu(0).compute_streams(1).live(&sock).build().unwrap();
    let x = rt.alloc("x", 4).unwrap();
    let run = |name: &'static str, n: usize| {
        for _ in 0..n {
            rt.task(name).run(x.read_write::<u8>(), |_| ()).unwrap();
        }
        rt.synchronize().unwrap();
    };
    run("before", 3);
    let conn = UnixStream::connect(&sock).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut lines = BufReader::new(conn).lines();
    let mut names = Vec::new();
    let mut until = |names: &mut Vec<String>, done: &dyn Fn(&[String]) -> bool| loop {
        match Line::parse(&lines.next().unwrap().expect("a line within 10 s")).unwrap() {
            Line::Frame(f) => names.extend(f.spans.iter().map(|s| s.name.to_string())),
            Line::Tick(_) if done(names) => return,
            Line::Tick(_) => {}
        }
    };
    until(&mut names, &|n| n.len() >= 3);
    assert_eq!(names, ["before"; 3]);
    rt.clear_profile();
    run("after", 5);
    names.clear();
    until(&mut names, &|n| n.len() >= 5);
    assert_eq!(names, ["after"; 5]);
}

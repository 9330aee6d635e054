//! Named scopes and placement files: tasks are tagged with their scope (in
//! the spans and the Chrome trace), the file moves them as it says, bad
//! files fail the build naming the line, and results never change.

mod common;

use braid::{BackendKind, Error, PlacementFile, Policy, Runtime, RuntimeBuilder};
use common::*;
use std::collections::BTreeSet;

fn builder(streams: usize) -> RuntimeBuilder {
    Runtime::builder()
        .backend(BackendKind::Cpu)
        .compute_streams(streams)
        .comm_streams(1)
        .oversubscribe(true)
        .profile(true)
}

fn file(text: &str) -> PlacementFile {
    PlacementFile::parse(text, "test.toml").unwrap()
}

#[test]
fn scopes_nest_and_tag_tasks_in_the_spans_and_the_trace() {
    let rt = builder(2).build().unwrap();
    let x = rt.alloc("x", 16).unwrap();
    rt.task("outside").run(x.write::<u32>(), |_| ()).unwrap();
    {
        let fwd = rt.scope("forward");
        assert_eq!(fwd.path(), Some("forward"));
        {
            let layer = rt.scope("layer3");
            assert_eq!(layer.path(), Some("forward/layer3"));
            // A name with `/` opens a nested path at once.
            let attn = rt.scope("attn/qkv");
            assert_eq!(attn.path(), Some("forward/layer3/attn/qkv"));
            rt.task("qkv").run(x.read_write::<u32>(), |_| ()).unwrap();
        }
        assert_eq!(rt.current_scope().as_deref(), Some("forward"));
        rt.task("after layer")
            .run(x.read_write::<u32>(), |_| ())
            .unwrap();
    }
    assert_eq!(rt.current_scope(), None);
    rt.task("outside again")
        .run(x.read_write::<u32>(), |_| ())
        .unwrap();
    rt.synchronize().unwrap();
    let scope_of = |name: &str| {
        let p = rt.profile();
        let s = p.spans.iter().find(|s| s.name == name).unwrap();
        s.scope.as_deref().map(str::to_string)
    };
    assert_eq!(scope_of("outside"), None);
    assert_eq!(scope_of("qkv").as_deref(), Some("forward/layer3/attn/qkv"));
    assert_eq!(scope_of("after layer").as_deref(), Some("forward"));
    assert_eq!(scope_of("outside again"), None);

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("trace.json");
    rt.write_trace(&path).unwrap();
    let trace: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let events = trace["traceEvents"].as_array().unwrap();
    let arg = |name: &str| {
        events
            .iter()
            .find(|e| e["ph"] == "X" && e["name"] == name)
            .map(|e| e["args"]["scope"].clone())
            .unwrap()
    };
    assert_eq!(arg("qkv"), "forward/layer3/attn/qkv");
    assert_eq!(arg("after layer"), "forward");
    assert!(arg("outside").is_null());
}

#[test]
fn scopes_belong_to_their_thread_and_their_runtime() {
    let rt = builder(2).build().unwrap();
    let other = builder(1).build().unwrap();
    let _s = rt.scope("main");
    assert_eq!(other.current_scope(), None);
    std::thread::scope(|t| {
        t.spawn(|| {
            assert_eq!(rt.current_scope(), None);
            let _b = rt.scope("worker");
            assert_eq!(rt.current_scope().as_deref(), Some("worker"));
        });
    });
    assert_eq!(rt.current_scope().as_deref(), Some("main"));
    // Guards dropped out of order: dropping the outer one closes the inner
    // one too; dropping the inner one later changes nothing.
    let outer = rt.scope("outer");
    let inner = rt.scope("inner");
    assert_eq!(rt.current_scope().as_deref(), Some("main/outer/inner"));
    drop(outer);
    assert_eq!(rt.current_scope().as_deref(), Some("main"));
    drop(inner);
    assert_eq!(rt.current_scope().as_deref(), Some("main"));
    // An empty name opens nothing.
    let none = rt.scope("/");
    assert_eq!(none.path(), None);
    assert_eq!(rt.current_scope().as_deref(), Some("main"));
}

#[test]
fn the_placement_file_moves_tasks_without_touching_the_program() {
    let f = file(
        r#"
[[scope]]
pattern = "pinned"
stream = 2

[[scope]]
pattern = "comm"
stream = "comm"

[[scope]]
pattern = "single/**"
policy = "single"

[[scope]]
pattern = "pinned/free"
stream = "any"
"#,
    );
    let rt = builder(3)
        .policy(Policy::RoundRobin)
        .placement(f)
        .build()
        .unwrap();
    let x = rt.alloc("x", 64).unwrap();
    let view = |i: usize| x.view_of::<u32>(i..i + 1).unwrap();
    let mut streams = Vec::new();
    {
        let _s = rt.scope("pinned");
        for i in 0..3 {
            streams.push(
                rt.task("p")
                    .run(view(i).write::<u32>(), |_| ())
                    .unwrap()
                    .stream(),
            );
        }
        let _free = rt.scope("free");
        let h = rt.task("free").run(view(3).write::<u32>(), |_| ()).unwrap();
        assert_ne!(
            rt.placement_file().unwrap().decide("pinned/free").stream,
            None
        );
        streams.push(h.stream());
    }
    assert_eq!(&streams[..3], &[2, 2, 2]);
    {
        let _s = rt.scope("comm");
        let h = rt.task("c").run(view(4).write::<u32>(), |_| ()).unwrap();
        assert_eq!(h.stream(), 3, "the communication stream");
        // Code that pins a task wins over the file.
        let h = rt
            .task("c pinned")
            .on_stream(1)
            .run(view(5).write::<u32>(), |_| ())
            .unwrap();
        assert_eq!(h.stream(), 1);
    }
    {
        let _s = rt.scope("single/a");
        for i in 6..10 {
            let h = rt.task("s").run(view(i).write::<u32>(), |_| ()).unwrap();
            assert_eq!(h.stream(), 0, "policy single in the scope");
        }
    }
    rt.synchronize().unwrap();
    let p = rt.profile();
    let reasons: BTreeSet<(&str, &str)> = p
        .spans
        .iter()
        .map(|s| (s.name.as_ref(), s.placement.reason.name()))
        .collect();
    assert!(reasons.contains(&("p", "scope")), "{reasons:?}");
    assert!(reasons.contains(&("c", "scope")), "{reasons:?}");
    assert!(reasons.contains(&("c pinned", "pinned")), "{reasons:?}");
    assert!(reasons.contains(&("s", "single")), "{reasons:?}");
    assert!(reasons.contains(&("free", "round-robin")), "{reasons:?}");
}

#[test]
fn the_side_class_and_priorities_reach_the_placement() {
    let f = file(
        "[[scope]]\npattern = \"wgrad\"\nstream = \"side\"\n\
         [[scope]]\npattern = \"hint\"\npriority = \"side\"\n",
    );
    let rt = builder(2).placement(f).build().unwrap();
    let x = rt.alloc("x", 8).unwrap();
    rt.task("main").run(x.write::<u32>(), |_| ()).unwrap();
    {
        let _s = rt.scope("wgrad");
        rt.task("w").run(x.read::<u32>(), |_| ()).unwrap();
    }
    {
        let _s = rt.scope("hint");
        rt.task("h").run(x.read::<u32>(), |_| ()).unwrap();
    }
    rt.synchronize().unwrap();
    let p = rt.profile();
    for name in ["w", "h"] {
        let s = p.spans.iter().find(|s| s.name == name).unwrap();
        assert_eq!(s.placement.priority.name(), "side", "{name}");
    }
}

/// Independent tasks that each hold their stream for a while: without a
/// bundle the policy spreads them; in a bundled scope they share one stream.
#[test]
fn a_bundled_scope_runs_on_one_stream() {
    let run = |bundle: bool| -> (BTreeSet<usize>, Vec<String>) {
        let f = file(&format!(
            "[[scope]]\npattern = \"b\"\nbundle = {bundle}\n[[scope]]\npattern = \"b/inner\"\npriority = \"side\"\n"
        ));
        let rt = builder(3).placement(f).build().unwrap();
        let x = rt.alloc("x", 64).unwrap();
        let mut streams = BTreeSet::new();
        {
            let _s = rt.scope("b");
            for i in 0..6 {
                let v = x.view_of::<u32>(i..i + 1).unwrap();
                let _inner = (i % 2 == 1).then(|| rt.scope("inner"));
                let h = rt
                    .task("slow")
                    .run(v.write::<u32>(), |_| {
                        std::thread::sleep(std::time::Duration::from_millis(5))
                    })
                    .unwrap();
                streams.insert(h.stream());
            }
        }
        rt.synchronize().unwrap();
        let reasons = rt
            .profile()
            .spans
            .iter()
            .map(|s| s.placement.reason.name().to_string())
            .collect();
        (streams, reasons)
    };
    let (bundled, reasons) = run(true);
    assert_eq!(bundled.len(), 1, "{bundled:?}");
    assert_eq!(
        reasons.iter().filter(|r| *r == "bundle").count(),
        5,
        "{reasons:?}"
    );
    let (spread, _) = run(false);
    assert!(spread.len() > 1, "{spread:?}");
}

/// `**` matches every path whole, so it applies at the innermost depth and
/// beats every rule for an enclosing scope (docs/scopes.md); `*` matches
/// the outermost scope only, so it is a default that any named scope's rule
/// overrides.
#[test]
fn a_catch_all_is_innermost_and_a_star_is_a_default() {
    use braid::StreamChoice::Compute;
    let rules = "[[scope]]\npattern = \"forward\"\nstream = 1\n";
    let all = file(&format!("[[scope]]\npattern = \"**\"\nstream = 0\n{rules}"));
    assert_eq!(all.decide("forward/layer3").stream, Some(Compute(0)));
    assert_eq!(all.decide("forward").stream, Some(Compute(1)));
    let default = file(&format!("[[scope]]\npattern = \"*\"\nstream = 0\n{rules}"));
    assert_eq!(default.decide("forward/layer3").stream, Some(Compute(1)));
    assert_eq!(default.decide("forward").stream, Some(Compute(1)));
    assert_eq!(default.decide("backward/layer3").stream, Some(Compute(0)));
    // A trailing `/**` is innermost too: it beats a rule for a scope
    // between.
    let tail = file("[[scope]]\npattern = \"forward/**\"\nstream = 0\n[[scope]]\npattern = \"forward/layer3\"\nstream = 1\n");
    assert_eq!(tail.decide("forward/layer3").stream, Some(Compute(1)));
    assert_eq!(tail.decide("forward/layer3/attn").stream, Some(Compute(0)));
}

/// A memoised step that diverges in the middle of a bundled scope's entry:
/// the tasks placed afresh after the divergence stay on the stream the
/// entry's memoised tasks ran on (the memoised first task sets the bundle,
/// as an eager one does). They went to another stream, the diverging task
/// placed by the policy and the rest of the entry bundled after it.
#[test]
fn a_bundle_survives_a_divergence_of_automatic_replay() {
    let f = file("[[scope]]\npattern = \"b\"\nbundle = true\npolicy = \"round-robin\"\n");
    let rt = builder(4)
        .inline_short_tasks(false)
        .placement(f)
        .build()
        .unwrap();
    let bufs: Vec<_> = (0..4)
        .map(|i| rt.alloc(format!("b{i}"), 64).unwrap())
        .collect();
    rt.synchronize().unwrap();
    let steps = 10;
    for step in 0..steps {
        {
            let _s = rt.scope("b");
            for (j, b) in bufs.iter().enumerate() {
                let end = if step == 8 && j == 1 { 8 } else { 16 };
                let busy = std::time::Duration::from_micros(if j == 0 { 5000 } else { 300 });
                rt.task("t")
                    .run(
                        b.view_of::<u32>(0..end).unwrap().write::<u32>(),
                        move |_| std::thread::sleep(busy),
                    )
                    .unwrap();
            }
        }
        rt.synchronize().unwrap();
    }
    assert!(rt.stats().auto_replayed > 0, "{:?}", rt.stats());
    assert!(rt.stats().auto_divergences > 0, "{:?}", rt.stats());
    let mut spans: Vec<_> = rt
        .profile()
        .spans
        .into_iter()
        .filter(|s| s.name == "t")
        .collect();
    spans.sort_by_key(|s| s.id);
    assert_eq!(spans.len(), 4 * steps);
    for (step, entry) in spans.chunks(4).enumerate() {
        let streams: Vec<_> = entry.iter().map(|s| s.stream).collect();
        let reasons: Vec<_> = entry.iter().map(|s| s.placement.reason.name()).collect();
        assert!(
            streams.iter().all(|&s| s == streams[0]),
            "step {step}: streams {streams:?}, placed by {reasons:?}"
        );
    }
}

#[test]
fn bad_files_fail_the_build_naming_the_line() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("p.toml");
    let expect = |text: &str, line: usize, key: &str| {
        std::fs::write(&path, text).unwrap();
        match builder(2).placement_file(&path).build() {
            Err(Error::Placement {
                file,
                line: l,
                message,
            }) => {
                assert_eq!(l, line, "{message}");
                assert!(message.contains(key), "{message}");
                assert!(file.ends_with("p.toml"), "{file}");
                let shown = Error::Placement {
                    file,
                    line: l,
                    message,
                }
                .to_string();
                assert!(shown.contains(&format!("line {line}")), "{shown}");
            }
            other => panic!("{text}: expected a placement error, got {other:?}"),
        }
    };
    // A stream the runtime does not have (it has 2 compute, 1 comm).
    expect("[[scope]]\npattern = \"a\"\nstream = 2\n", 3, "stream");
    expect(
        "[[scope]]\npattern = \"a\"\n\nstream = \"comm:1\"\n",
        4,
        "stream",
    );
    expect("[[scope]]\npattern = \"a\"\nbundel = true\n", 3, "bundel");
    // One pair of brackets where a rule needs two.
    expect(
        "# rules\n[scope]\npattern = \"a\"\n",
        2,
        "each rule is a `[[scope]]` table",
    );
    expect(
        "[[scope]]\npattern = \"a\"\npolicy = \"greedy\"\n",
        3,
        "policy",
    );
    // The parser's own words, made to name the key or the value.
    expect(
        "[[scope]]\npattern = \"a\"\nstream = 1\nstream = 0\n",
        4,
        "duplicate key `stream`",
    );
    expect(
        "[[scope]]\npattern = \"a\"\nstream = 99999999999999999999\n",
        3,
        "`99999999999999999999` is out of range",
    );
    // A dotted table is not the one-bracket mistake: no such hint.
    std::fs::write(&path, "[[scope]]\npattern = \"a\"\n[scope.foo]\nx = 1\n").unwrap();
    let err = builder(2).placement_file(&path).build().unwrap_err();
    assert!(!err.to_string().contains("two brackets"), "{err}");
    let missing = builder(2)
        .placement_file(dir.path().join("missing.toml"))
        .build();
    match missing {
        Err(Error::Io { path, .. }) => assert!(path.ends_with("missing.toml")),
        other => panic!("{other:?}"),
    }
}

/// The program of [`automatic_replay_with_scopes`]: the same tasks in
/// scopes, `steps` times, a synchronisation after each.
fn scoped_steps(rt: &Runtime, p: &Program, paths: &[Vec<&str>], steps: usize) -> Vec<Vec<u32>> {
    let bufs = alloc_buffers(rt, p);
    rt.synchronize().unwrap();
    for _ in 0..steps {
        submit_scoped(rt, &bufs, &p.tasks, paths);
        rt.synchronize().unwrap();
    }
    read_back(rt, &bufs)
}

#[test]
fn automatic_replay_with_scopes_is_exact_and_the_file_can_turn_it_off() {
    use proptest::strategy::{Strategy, ValueTree};
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let p = program(40).new_tree(&mut runner).unwrap().current();
    let paths = vec![
        vec!["forward", "layer0"],
        vec!["forward", "layer1"],
        vec!["optimizer"],
    ];
    let steps = 8;
    let expected = sequential(&Program {
        sizes: p.sizes.clone(),
        tasks: p
            .tasks
            .iter()
            .cycle()
            .take(p.tasks.len() * steps)
            .cloned()
            .collect(),
    });
    let on = "[runtime]\nauto_replay = true\n[[scope]]\npattern = \"forward/*\"\nbundle = true\n";
    let rt = builder(2).placement(file(on)).build().unwrap();
    assert_eq!(scoped_steps(&rt, &p, &paths, steps), expected);
    assert!(rt.stats().auto_replayed > 0, "{:?}", rt.stats());
    // The read-back after the last step leaves the memoised step, once.
    assert!(rt.stats().auto_divergences <= 1, "{:?}", rt.stats());

    let off = format!("{on}[[scope]]\npattern = \"optimizer\"\nreplay = false\n");
    let rt = builder(2).placement(file(&off)).build().unwrap();
    assert_eq!(scoped_steps(&rt, &p, &paths, steps), expected);
    assert_eq!(rt.stats().auto_replayed, 0, "{:?}", rt.stats());
}

/// `PlacementFile::unmatched`: the rules that applied to no scope of the
/// runtimes built with the file (its clones share what matched) — a typo,
/// or a scope the program never opens — by line and pattern as written. A
/// rule for an enclosing scope counts as applied.
#[test]
fn rules_that_matched_no_scope_are_reported() {
    let f = file(
        "[[scope]]\npattern = \"forward/*\"\nstream = 1\n\n\
         [[scope]]\npattern = \"fowrard/*\"\nstream = 1\n\n\
         [[scope]]\npattern = \"backward\"\npriority = \"side\"\n",
    );
    assert_eq!(
        f.unmatched(),
        [(2, "forward/*"), (6, "fowrard/*"), (10, "backward")]
    );
    let rt = builder(2).placement(f.clone()).build().unwrap();
    let x = rt.alloc("x", 4).unwrap();
    {
        let _s = rt.scope("forward/layer0/attn");
        rt.task("t").run(x.write::<u32>(), |_| ()).unwrap();
    }
    rt.synchronize().unwrap();
    assert_eq!(f.unmatched(), [(6, "fowrard/*"), (10, "backward")]);
}

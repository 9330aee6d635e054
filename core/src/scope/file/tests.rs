use super::PlacementFile;
use crate::error::Error;
use crate::kind::{Class, Priority};
use crate::sched::placement::Policy;
use crate::sched::scoped::{ScopeDecision, StreamChoice};

/// The error `text` gives: its line and message.
fn error(text: &str) -> (usize, String) {
    match PlacementFile::parse(text, "p.toml") {
        Err(Error::Placement {
            file,
            line,
            message,
        }) => {
            assert_eq!(file, "p.toml");
            (line, message)
        }
        other => panic!("expected a placement error, got {other:?}"),
    }
}

#[test]
fn a_full_file_parses() {
    let f = PlacementFile::parse(
        r#"
# comment
[runtime]
auto_replay = true
class = "latency-critical"
realtime = true
spare_sms = 16

[[scope]]
pattern = "forward/*"
stream = 1
priority = "side"
policy = "round-robin"
bundle = true
replay = false

[[scope]]
pattern = "optimizer"
stream = "comm:0"
"#,
        "p.toml",
    )
    .unwrap();
    assert_eq!(f.len(), 2);
    assert_eq!(f.auto_replay(), Some(true));
    assert_eq!(f.class(), Some(Class::LatencyCritical));
    assert_eq!(f.realtime(), Some(true));
    assert_eq!(f.spare_sms(), Some(16));
    assert_eq!(
        f.decide("forward/layer0"),
        ScopeDecision {
            stream: Some(StreamChoice::Compute(1)),
            priority: Some(Priority::Side),
            policy: Some(Policy::RoundRobin),
            bundle: true,
            replay: false,
        }
    );
    assert_eq!(f.decide("optimizer").stream, Some(StreamChoice::Comm(0)));
    assert_eq!(f.decide("backward/layer0"), ScopeDecision::default());
}

#[test]
fn stream_values() {
    for (v, want) in [
        ("0", StreamChoice::Compute(0)),
        ("\"compute:3\"", StreamChoice::Compute(3)),
        ("\"comm\"", StreamChoice::Comm(0)),
        ("\"comm:2\"", StreamChoice::Comm(2)),
        ("\"side\"", StreamChoice::Side),
        ("\"any\"", StreamChoice::Policy),
    ] {
        let f = PlacementFile::parse(&format!("[[scope]]\npattern = \"a\"\nstream = {v}\n"), "p")
            .unwrap();
        assert_eq!(f.decide("a").stream, Some(want), "{v}");
    }
}

#[test]
fn syntax_errors_name_the_line() {
    let (line, msg) = error("[[scope]]\npattern = \"a\"\nstream = = 1\n");
    assert_eq!(line, 3, "{msg}");
}

#[test]
fn unknown_keys_name_the_line_and_the_key() {
    let (line, msg) = error("[[scope]]\npattern = \"a\"\n\nstrem = 1\n");
    assert_eq!(line, 4, "{msg}");
    assert!(msg.contains("strem"), "{msg}");
    let (line, msg) = error("[runtime]\nauto_replay = true\nwindow = 3\n");
    assert_eq!(line, 3, "{msg}");
    assert!(msg.contains("window"), "{msg}");
    let (line, msg) = error("[scopes]\n");
    assert_eq!(line, 1, "{msg}");
    assert!(msg.contains("scopes"), "{msg}");
}

#[test]
fn bad_values_name_the_line_and_the_key() {
    let cases = [
        ("bundle = \"yes\"", "bundle"),
        ("replay = 1", "replay"),
        ("priority = \"high\"", "priority"),
        ("policy = \"fastest\"", "policy"),
        ("stream = -1", "stream"),
        ("stream = \"comm:x\"", "stream"),
        ("stream = 1.5", "stream"),
        ("pattern = 3", "pattern"),
    ];
    for (bad, key) in cases {
        let text = format!("[[scope]]\npattern = \"ok\"\n\n[[scope]]\npattern = \"b\"\n{bad}\n");
        let text = if key == "pattern" {
            format!("[[scope]]\npattern = \"ok\"\n\n[[scope]]\n\n{bad}\n")
        } else {
            text
        };
        let (line, msg) = error(&text);
        assert_eq!(line, 6, "{bad}: {msg}");
        assert!(msg.contains(&format!("`{key}`")), "{bad}: {msg}");
    }
    for (bad, key) in [
        ("auto_replay = \"on\"", "runtime.auto_replay"),
        ("class = \"urgent\"", "runtime.class"),
        ("class = 1", "runtime.class"),
        ("realtime = \"yes\"", "runtime.realtime"),
        ("spare_sms = -8", "runtime.spare_sms"),
        ("spare_sms = \"8\"", "runtime.spare_sms"),
        ("spare_sms = 8.5", "runtime.spare_sms"),
    ] {
        let (line, msg) = error(&format!("[runtime]\n\n{bad}\n"));
        assert_eq!(line, 3, "{bad}: {msg}");
        assert!(msg.contains(&format!("`{key}`")), "{bad}: {msg}");
    }
    for name in ["latency-critical", "normal", "best-effort"] {
        let text = format!("[runtime]\nclass = \"{name}\"\n");
        let f = PlacementFile::parse(&text, "p.toml").unwrap();
        assert_eq!(f.class().map(Class::name), Some(name));
        assert_eq!(f.realtime(), None);
        assert_eq!(f.spare_sms(), None);
    }
}

#[test]
fn bad_patterns_and_missing_patterns_name_the_line() {
    let (line, msg) = error("[[scope]]\npattern = \"a\"\n[[scope]]\npattern = \"forward//x\"\n");
    assert_eq!(line, 4, "{msg}");
    assert!(msg.contains("`pattern`"), "{msg}");
    let (line, msg) = error("[[scope]]\npattern = \"a\"\n[[scope]]\nstream = 0\n");
    assert!((3..=4).contains(&line), "{line}: {msg}");
    assert!(msg.contains("`pattern`"), "{msg}");
}

#[test]
fn streams_are_checked_against_the_runtime() {
    let f = PlacementFile::parse(
        "[[scope]]\npattern = \"a\"\nstream = 1\n[[scope]]\npattern = \"b\"\n\nstream = \"comm:1\"\n",
        "p.toml",
    )
    .unwrap();
    f.check(2, 2).unwrap();
    match f.check(1, 2) {
        Err(Error::Placement {
            line: 3, message, ..
        }) => {
            assert!(message.contains("compute stream 1"), "{message}")
        }
        other => panic!("{other:?}"),
    }
    match f.check(2, 1) {
        Err(Error::Placement {
            line: 7, message, ..
        }) => {
            assert!(message.contains("communication stream 1"), "{message}")
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn the_innermost_scope_wins_then_the_most_literal_pattern_then_the_last_rule() {
    let f = PlacementFile::parse(
        r#"
[[scope]]
pattern = "forward/layer3"
stream = 3
[[scope]]
pattern = "forward/*"
stream = 1
[[scope]]
pattern = "forward"
stream = 0
priority = "side"
[[scope]]
pattern = "*/layer3"
stream = 2
[[scope]]
pattern = "forward/layer*"
policy = "single"
[[scope]]
pattern = "forward/*"
policy = "round-robin"
"#,
        "p",
    )
    .unwrap();
    let c = |i| Some(StreamChoice::Compute(i));
    // Depth 2 beats depth 1 whatever the order; among depth-2 patterns the
    // most literal one (`forward/layer3`, 13) beats `*/layer3` (6) and
    // `forward/*` (7) although it comes first.
    assert_eq!(f.decide("forward/layer3").stream, c(3));
    assert_eq!(f.decide("forward/layer4").stream, c(1));
    // A nested scope inherits: `forward/layer3/attn` matches only through
    // its enclosing scopes.
    assert_eq!(f.decide("forward/layer3/attn").stream, c(3));
    assert_eq!(f.decide("forward").stream, c(0));
    // Each decision is resolved separately: the priority comes from the
    // only rule that sets it (`forward`, depth 1).
    assert_eq!(f.decide("forward/layer4").priority, Some(Priority::Side));
    // `forward/layer*` (12 literals) beats the later `forward/*` (7).
    assert_eq!(f.decide("forward/layer4").policy, Some(Policy::Single));
    assert_eq!(f.decide("forward/emb").policy, Some(Policy::RoundRobin));
    // Same depth, same literal count: the later rule wins.
    let g = PlacementFile::parse(
        "[[scope]]\npattern = \"a/*\"\nstream = 0\n[[scope]]\npattern = \"*/b\"\nstream = 1\n",
        "p",
    )
    .unwrap();
    assert_eq!(g.decide("a/b").stream, c(1));
    assert_eq!(g.decide("a/c").stream, c(0));
}

#[test]
fn a_deeper_rule_can_undo_an_enclosing_one() {
    let f = PlacementFile::parse(
        "[[scope]]\npattern = \"backward\"\nstream = 1\nbundle = true\nreplay = false\n\
         [[scope]]\npattern = \"backward/layer0\"\nstream = \"any\"\nbundle = false\nreplay = true\n",
        "p",
    )
    .unwrap();
    let outer = f.decide("backward/layer1");
    assert_eq!(outer.stream, Some(StreamChoice::Compute(1)));
    assert!(outer.bundle && !outer.replay);
    let inner = f.decide("backward/layer0/attn");
    assert_eq!(inner.stream, Some(StreamChoice::Policy));
    assert!(!inner.bundle && inner.replay);
}

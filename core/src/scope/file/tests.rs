use super::{Lines, PlacementFile};
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

#[test]
fn lines_count_the_newlines_before_every_offset() {
    // Many rules, with what a file has between them: blank lines, comments,
    // CRLF endings, multi-line strings, characters of several bytes.
    let mut text = String::new();
    for i in 0..2_000 {
        text.push_str(&format!("[[scope]]\npattern = \"p{i}/é*\"\n"));
        match i % 4 {
            0 => text.push_str("stream = 1\r\n\r\n"),
            1 => text.push_str("# ünïcödé comment\n\n\n"),
            2 => text.push_str("policy = \"\"\"\nsingle\"\"\"\n"),
            _ => {}
        }
    }
    let lines = Lines::new(&text);
    let mut newlines = 0;
    for (offset, b) in text.bytes().enumerate() {
        assert_eq!(lines.line(offset), newlines + 1, "offset {offset}");
        newlines += usize::from(b == b'\n');
    }
    // Past the end: the last line.
    for offset in text.len()..text.len() + 3 {
        assert_eq!(lines.line(offset), newlines + 1, "offset {offset}");
    }
    assert_eq!(Lines::new("").line(0), 1);
    assert_eq!(Lines::new("\n").line(0), 1);
    assert_eq!(Lines::new("\n").line(1), 2);
}

#[test]
fn the_lines_of_many_rules_are_their_own() {
    // Every third rule has a blank line and a `stream` key, so the lines
    // drift from any fixed stride: each rule's line is counted for it.
    let mut text = String::new();
    let mut want = Vec::new();
    let mut line = 1;
    for i in 0..5_000 {
        text.push_str(&format!("[[scope]]\npattern = \"r{i}\"\n"));
        want.push((line + 1, format!("r{i}")));
        line += 2;
        if i % 3 == 0 {
            text.push_str(&format!("\nstream = {}\n", i % 5));
            line += 2;
        }
    }
    let f = PlacementFile::parse(&text, "p.toml").unwrap();
    let got: Vec<(usize, String)> = f
        .unmatched()
        .into_iter()
        .map(|(l, p)| (l, p.to_string()))
        .collect();
    assert_eq!(got, want);
    // The line of a rule's `stream` key (a blank line after its pattern),
    // found when the file meets a runtime with too few streams: rule 3 is
    // the first to name compute stream 3.
    match f.check(3, 1) {
        Err(Error::Placement { line, message, .. }) => {
            assert_eq!(line, want[3].0 + 2, "{message}");
        }
        other => panic!("{other:?}"),
    }
    // An error in the last rule names its line.
    let bad = format!("{text}[[scope]]\npattern = \"last\"\npriority = \"high\"\n");
    let (l, msg) = error(&bad);
    assert_eq!(l, line + 2, "{msg}");
    assert!(msg.contains("`priority`"), "{msg}");
}

#[test]
fn integers_out_of_range_name_the_line_and_the_key() {
    // Integers that a TOML value cannot hold (`i64`), however far out.
    for n in [
        "18446744073709551615",
        "9223372036854775808",
        "-9223372036854775809",
        "+18446744073709551616",
        "99999999999999999999999999999999999999999",
        "0xffffffffffffffff",
        "0o7777777777777777777777",
    ] {
        let text = format!("[[scope]]\npattern = \"ok\"\n\n[[scope]]\npattern = \"b\"\nstream = {n}\npriority = \"main\"\n");
        let (line, msg) = error(&text);
        assert_eq!(line, 6, "{n}: {msg}");
        assert!(msg.contains("`stream`"), "{n}: {msg}");
        assert!(msg.contains(n), "{n}: {msg}");
        assert!(msg.contains("out of range"), "{n}: {msg}");
        let (line, msg) = error(&format!(
            "[runtime]\nclass = \"normal\"\n\nspare_sms = {n}\n"
        ));
        assert_eq!(line, 4, "{n}: {msg}");
        assert!(msg.contains("`runtime.spare_sms`"), "{n}: {msg}");
        assert!(msg.contains(n), "{n}: {msg}");
        // In an inline table too, and where no key takes an integer.
        let (line, msg) = error(&format!("\nruntime = {{ spare_sms = {n} }}\n"));
        assert_eq!(line, 2, "{n}: {msg}");
        assert!(msg.contains("`runtime.spare_sms`"), "{n}: {msg}");
        let (line, msg) = error(&format!("[[scope]]\npattern = \"a\"\nbundle = {n}\n"));
        assert_eq!(line, 3, "{n}: {msg}");
        assert!(msg.contains("`bundle`"), "{n}: {msg}");
    }
    // The ends of the range are values like any other.
    let (line, msg) = error("[[scope]]\npattern = \"a\"\nstream = -9223372036854775808\n");
    assert_eq!(line, 3, "{msg}");
    assert!(msg.contains("`stream` must be"), "{msg}");
    let f = PlacementFile::parse(
        "[[scope]]\npattern = \"a\"\nstream = 9223372036854775807\n",
        "p.toml",
    )
    .unwrap();
    assert!(f.check(1, 1).is_err());
}

#[test]
fn tables_of_the_wrong_shape_name_the_key() {
    for (text, key, line) in [
        ("[[runtime]]\nclass = \"normal\"\n", "runtime", 1),
        ("\nruntime = 3\n", "runtime", 2),
        ("\nscope = 3\n", "scope", 2),
        ("[[scope]]\npattern = \"a\"\n[scope]\n", "scope", 3),
        ("\nscope = [1]\n", "scope", 2),
    ] {
        let (l, msg) = error(text);
        assert_eq!(l, line, "{text:?}: {msg}");
        assert!(msg.contains(&format!("`{key}`")), "{text:?}: {msg}");
        // Serde's names for the file's tables are this module's types.
        assert!(!msg.contains("Raw"), "{text:?}: {msg}");
    }
}

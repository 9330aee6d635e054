//! Bad input gets an error, never a panic: the readers of what users and
//! other programs hand the engine (placement files, Chrome traces, the live
//! view's lines), fed valid samples with random edits (bytes replaced,
//! inserted, cut, spans repeated). Each must return `Ok` or its own error
//! kind, naming what was wrong.

use braid::trace::live::Line;
use braid::{Error, PlacementFile};
use proptest::prelude::*;

/// A valid placement file using every key.
const PLACEMENT: &str = r#"# a comment
[runtime]
auto_replay = true
class = "best-effort"
spare_sms = 8

[[scope]]
pattern = "forward/*"
stream = 1
priority = "side"
policy = "round-robin"
bundle = true
replay = false

[[scope]]
pattern = "backward/**"
stream = "comm:0"
"#;

/// A small valid Chrome trace as Braid writes it: process metadata with a
/// class, a stream, a task and a busy period.
const TRACE: &str = r#"{"traceEvents":[
{"ph":"M","name":"process_labels","pid":0,"tid":0,"args":{"labels":"normal"}},
{"ph":"M","name":"process_name","pid":0,"tid":0,"args":{"name":"rank 0","class":"normal"}},
{"ph":"M","name":"thread_name","pid":0,"tid":0,"args":{"name":"compute 0"}},
{"ph":"X","name":"t","cat":"compute","pid":0,"tid":0,"ts":1.5,"dur":2.0,
 "args":{"task":0,"ok":true,"after":[],"placed":"chain","usable_streams":2,"priority":"main","bytes":4,"scope":"s"}},
{"ph":"M","name":"thread_name","pid":0,"tid":1,"args":{"name":"busy periods","track":"busy"}},
{"ph":"X","name":"busy","cat":"busy","pid":0,"tid":1,"ts":1.0,"dur":3.0}
],"displayTimeUnit":"ms"}"#;

/// A live view frame line and a tick line.
const LINES: [&str; 2] = [
    r#"{"rank":0,"runtime":7,"now_us":12.5,"class":"latency-critical","busy":{"n":1,"p50_us":1.0,"p99_us":2.0,"max_us":2.0},"streams":[{"name":"compute 0","is_comm":false,"queued":1,"running":{"task":3,"name":"m","scope":null,"since_us":10.0}}],"events":[]}"#,
    r#"{"tick":4}"#,
];

/// One edit of a text: at a position (taken modulo its length), replace
/// the byte there, insert one, cut a span, or repeat a span.
#[derive(Debug, Clone)]
enum Edit {
    Replace(usize, u8),
    Insert(usize, u8),
    Cut(usize, usize),
    Repeat(usize, usize),
}

/// Bytes an edit writes: what the formats are made of, and a few others.
const ALPHABET: &[u8] = b"{}[]\":,=.#*/\\\n -0123456789aeflnrstu\xc3\xa9\x00";

fn edit() -> impl Strategy<Value = Edit> {
    let byte = (0..ALPHABET.len()).prop_map(|i| ALPHABET[i]);
    prop_oneof![
        (any::<usize>(), byte.clone()).prop_map(|(at, b)| Edit::Replace(at, b)),
        (any::<usize>(), byte).prop_map(|(at, b)| Edit::Insert(at, b)),
        (any::<usize>(), 1..40usize).prop_map(|(at, n)| Edit::Cut(at, n)),
        (any::<usize>(), 1..40usize).prop_map(|(at, n)| Edit::Repeat(at, n)),
    ]
}

/// `text` with `edits` applied in turn, as a string (invalid UTF-8 made
/// lossy, as a reader of a file would have to).
fn edited(text: &str, edits: &[Edit]) -> String {
    let mut b = text.as_bytes().to_vec();
    for e in edits {
        let at = |i: usize, len: usize| if len == 0 { 0 } else { i % len };
        match *e {
            Edit::Replace(i, x) if !b.is_empty() => {
                let i = at(i, b.len());
                b[i] = x;
            }
            Edit::Replace(..) => {}
            Edit::Insert(i, x) => {
                let i = at(i, b.len() + 1);
                b.insert(i, x);
            }
            Edit::Cut(i, n) => {
                let i = at(i, b.len());
                let end = (i + n).min(b.len());
                b.drain(i..end);
            }
            Edit::Repeat(i, n) => {
                let i = at(i, b.len());
                let end = (i + n).min(b.len());
                let span = b[i..end].to_vec();
                b.splice(end..end, span);
            }
        }
    }
    String::from_utf8_lossy(&b).into_owned()
}

#[test]
fn the_samples_are_valid() {
    let f = PlacementFile::parse(PLACEMENT, "p.toml").unwrap();
    assert_eq!((f.len(), f.spare_sms()), (2, Some(8)));
    let p = braid::trace::read_chrome_trace(TRACE).unwrap();
    assert_eq!(p[0].spans.len(), 1);
    assert_eq!(p[0].busy, vec![(1000, 4000)]);
    assert_eq!(p[0].class, Some(braid::Class::Normal));
    for l in LINES {
        Line::parse(l).unwrap();
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 3000, ..ProptestConfig::default() })]

    /// An edited placement file parses, or fails with a placement error
    /// that names the file (and a line within it, or 0 where the TOML
    /// reader gives no position).
    #[test]
    fn edited_placement_files_parse_or_name_the_line(edits in prop::collection::vec(edit(), 1..6)) {
        let text = edited(PLACEMENT, &edits);
        match PlacementFile::parse(&text, "p.toml") {
            Ok(_) => {}
            Err(Error::Placement { file, line, message }) => {
                prop_assert_eq!(file, "p.toml");
                prop_assert!(line <= text.lines().count() + 1, "line {} of {}", line, text.lines().count());
                prop_assert!(!message.is_empty());
            }
            Err(other) => prop_assert!(false, "not a placement error: {other:?}"),
        }
    }

    /// An edited trace reads back, or fails as a bad trace.
    #[test]
    fn edited_traces_read_or_say_why(edits in prop::collection::vec(edit(), 1..6)) {
        match braid::trace::read_chrome_trace(&edited(TRACE, &edits)) {
            Ok(profiles) => {
                for p in profiles {
                    prop_assert!(!p.spans.is_empty());
                    prop_assert!(p.spans.iter().all(|s| s.stream < p.streams.len()));
                }
            }
            Err(Error::BadTrace(why)) => prop_assert!(!why.is_empty()),
            Err(other) => prop_assert!(false, "not a bad-trace error: {other:?}"),
        }
    }

    /// An edited live-view line parses, or fails as a bad line.
    #[test]
    fn edited_live_lines_parse_or_say_why(which in 0..2usize, edits in prop::collection::vec(edit(), 1..6)) {
        match Line::parse(&edited(LINES[which], &edits)) {
            Ok(_) => {}
            Err(Error::BadTrace(why)) => prop_assert!(why.starts_with("live-view line")),
            Err(other) => prop_assert!(false, "not a bad-line error: {other:?}"),
        }
    }
}

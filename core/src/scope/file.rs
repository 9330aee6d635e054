//! The placement file: TOML rules mapping scope patterns to decisions
//! (docs/scopes.md has the format). Parsed and checked when the runtime is
//! built, so a bad file fails before any task runs, with an error naming the
//! line and the key.

use super::pattern::Pattern;
use crate::error::{Error, Result};
use crate::kind::{Class, Priority};
use crate::sched::placement::Policy;
use crate::sched::scoped::{ScopeDecision, StreamChoice};
use serde::Deserialize;
use std::ops::Range;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use toml::de::{DeTable, DeValue};
use toml::{Spanned, Value};

/// A parsed placement file: rules that map scope patterns to placement
/// decisions, and runtime-wide settings.
///
/// For each decision (stream, priority, policy, bundle, replay) separately,
/// among the rules whose pattern applies to the task's scope (matches it or
/// an enclosing scope), the winner is the rule that matches the innermost
/// scope; at equal depth, the pattern with more literal (non-wildcard)
/// characters; then the later rule in the file.
#[derive(Debug, Clone)]
pub struct PlacementFile {
    origin: String,
    rules: Vec<Rule>,
    auto_replay: Option<bool>,
    class: Option<Class>,
    /// `[runtime] realtime`, and its line (for the error when the class is
    /// not latency-critical).
    realtime: Option<(bool, usize)>,
    spare_sms: Option<u32>,
    /// Per rule, whether it has applied to a scope: shared by the file's
    /// clones (every rank's runtime), for [`unmatched`](Self::unmatched).
    matched: Arc<Vec<AtomicBool>>,
}

#[derive(Debug, Clone)]
struct Rule {
    pattern: Pattern,
    /// The pattern as written, and the line of its `pattern` key.
    text: String,
    line: usize,
    /// The line of the rule's `stream` key (for errors found when the file
    /// meets a runtime).
    stream_line: usize,
    stream: Option<StreamChoice>,
    priority: Option<Priority>,
    policy: Option<Policy>,
    bundle: Option<bool>,
    replay: Option<bool>,
}

/// Where a decision came from: the winning rule's specificity and index
/// (`(depth, literals, index)`, greater wins).
pub(crate) type Source = (usize, usize, usize);

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFile {
    runtime: Option<RawRuntime>,
    #[serde(default)]
    scope: Vec<Spanned<RawRule>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRuntime {
    auto_replay: Option<Spanned<Value>>,
    class: Option<Spanned<Value>>,
    realtime: Option<Spanned<Value>>,
    spare_sms: Option<Spanned<Value>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRule {
    pattern: Option<Spanned<Value>>,
    stream: Option<Spanned<Value>>,
    priority: Option<Spanned<Value>>,
    policy: Option<Spanned<Value>>,
    bundle: Option<Spanned<Value>>,
    replay: Option<Spanned<Value>>,
}

impl PlacementFile {
    /// Parses the TOML `text`; `origin` names it in errors (a path).
    /// Errors ([`Error::Placement`]) name the line and the key: TOML
    /// syntax, unknown keys, values of the wrong type or out of their set,
    /// integers beyond TOML's 64 bits, bad patterns, a rule without a
    /// pattern.
    pub fn parse(text: &str, origin: impl Into<String>) -> Result<PlacementFile> {
        let origin = origin.into();
        let cx = Cx {
            origin: &origin,
            lines: Lines::new(text),
        };
        let at = |span: Range<usize>, message: String| cx.at(span, message);
        let raw: RawFile = toml::from_str(text).map_err(|e| cx.toml_error(text, &e))?;
        let runtime = raw.runtime.as_ref();
        let auto_replay = cx.field(
            &runtime.and_then(|r| r.auto_replay.clone()),
            "runtime.auto_replay",
            boolean,
        )?;
        let class = cx.field(
            &runtime.and_then(|r| r.class.clone()),
            "runtime.class",
            class,
        )?;
        let realtime = match runtime.and_then(|r| r.realtime.as_ref()) {
            Some(v) => Some((
                boolean("runtime.realtime", v).map_err(|m| at(v.span(), m))?,
                cx.lines.line(v.span().start),
            )),
            None => None,
        };
        let spare_sms = cx.field(
            &runtime.and_then(|r| r.spare_sms.clone()),
            "runtime.spare_sms",
            sm_count,
        )?;
        let mut rules = Vec::with_capacity(raw.scope.len());
        for spanned in &raw.scope {
            let r = spanned.get_ref();
            let Some(p) = &r.pattern else {
                return Err(at(
                    spanned.span(),
                    "a `[[scope]]` rule needs a `pattern` key".into(),
                ));
            };
            let line = cx.lines.line(p.span().start);
            let (pattern, written) = match p.get_ref() {
                Value::String(s) => (
                    Pattern::parse(s).map_err(|m| at(p.span(), format!("`pattern`: {m}")))?,
                    s.clone(),
                ),
                other => {
                    return Err(at(
                        p.span(),
                        format!("`pattern` must be a string, not {}", other.type_str()),
                    ))
                }
            };
            rules.push(Rule {
                pattern,
                text: written,
                line,
                stream_line: r
                    .stream
                    .as_ref()
                    .map_or(line, |v| cx.lines.line(v.span().start)),
                stream: cx.field(&r.stream, "stream", stream)?,
                priority: cx.field(&r.priority, "priority", priority)?,
                policy: cx.field(&r.policy, "policy", policy)?,
                bundle: cx.field(&r.bundle, "bundle", boolean)?,
                replay: cx.field(&r.replay, "replay", boolean)?,
            });
        }
        Ok(PlacementFile {
            origin,
            matched: Arc::new(rules.iter().map(|_| AtomicBool::new(false)).collect()),
            rules,
            auto_replay,
            class,
            realtime,
            spare_sms,
        })
    }

    /// Reads and parses the file at `path` (errors name it).
    pub fn load(path: impl AsRef<Path>) -> Result<PlacementFile> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::io("reading placement file", path, e))?;
        Self::parse(&text, path.display().to_string())
    }

    /// The name errors give the file (its path, or what `parse` was given).
    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// The number of `[[scope]]` rules.
    pub fn len(&self) -> usize {
        self.rules.len()
    }

    /// Whether the file has no rules.
    pub fn is_empty(&self) -> bool {
        self.rules.is_empty()
    }

    /// `[runtime] auto_replay`, when the file sets it (it overrides the
    /// builder's [`crate::RuntimeBuilder::auto_replay`]).
    pub fn auto_replay(&self) -> Option<bool> {
        self.auto_replay
    }

    /// `[runtime] class`, when the file sets it: the class of runtimes
    /// whose builder sets none ([`crate::RuntimeBuilder::class`]), so a
    /// deployment can decide which program serves and which trains beside
    /// it without a change to the code. A class set in code wins: the
    /// file (`BRAID_PLACEMENT`'s reaches every runtime of the process) may
    /// have been written for another program of the process.
    pub fn class(&self) -> Option<Class> {
        self.class
    }

    /// `[runtime] realtime`, when the file sets it (it overrides the
    /// builder's [`crate::RuntimeBuilder::realtime`], unless the builder
    /// set a class other than the file's: the setting was then meant for
    /// another program): real-time threads need privileges that the
    /// machine's operator grants, so the operator may also be the one to
    /// ask for them.
    pub fn realtime(&self) -> Option<bool> {
        self.realtime.map(|(on, _)| on)
    }

    /// `[runtime] spare_sms`, when the file sets it (it overrides the
    /// builder's [`crate::RuntimeBuilder::spare_sms`], unless the builder
    /// set a class other than the file's): how much of a GPU a
    /// best-effort program leaves to the others is the deployment's choice.
    pub fn spare_sms(&self) -> Option<u32> {
        self.spare_sms
    }

    /// The error for real-time threads asked of a runtime of `class` (not
    /// latency-critical), naming the `realtime` line when the file asked.
    pub(crate) fn realtime_refused(&self, class: Class) -> Option<Error> {
        let (on, line) = self.realtime?;
        on.then(|| Error::Placement {
            file: self.origin.clone(),
            line,
            message: format!(
                "`runtime.realtime`: real-time threads are for latency-critical runtimes; \
                 this one is {}",
                class.name()
            ),
        })
    }

    /// What the file decides for tasks in scope `path` (`forward/layer3`).
    pub fn decide(&self, path: &str) -> ScopeDecision {
        let segs: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
        self.resolve(&segs).0
    }

    /// The decision for the scope `segs`, and where its `bundle` came from.
    pub(crate) fn resolve(&self, segs: &[&str]) -> (ScopeDecision, Option<Source>) {
        let mut d = ScopeDecision::default();
        let mut won: [Option<Source>; 5] = [None; 5];
        for (index, r) in self.rules.iter().enumerate() {
            let Some(depth) = r.pattern.applies(segs) else {
                continue;
            };
            self.matched[index].store(true, Ordering::Relaxed);
            let key = (depth, r.pattern.literals(), index);
            let mut take = |slot: usize, set: bool| -> bool {
                let wins = set && won[slot].is_none_or(|w| key > w);
                if wins {
                    won[slot] = Some(key);
                }
                wins
            };
            if take(0, r.stream.is_some()) {
                d.stream = r.stream;
            }
            if take(1, r.priority.is_some()) {
                d.priority = r.priority;
            }
            if take(2, r.policy.is_some()) {
                d.policy = r.policy;
            }
            if let Some(b) = r.bundle.filter(|_| take(3, true)) {
                d.bundle = b;
            }
            if let Some(b) = r.replay.filter(|_| take(4, true)) {
                d.replay = b;
            }
        }
        (d, won[3].filter(|_| d.bundle))
    }

    /// Checks the file against a runtime's streams: every stream a rule
    /// names exists.
    pub(crate) fn check(&self, compute: usize, comm: usize) -> Result<()> {
        for r in &self.rules {
            let bad = match r.stream {
                Some(StreamChoice::Compute(i)) if i >= compute => Some(format!(
                    "`stream`: compute stream {i} does not exist (the runtime has {compute})"
                )),
                Some(StreamChoice::Comm(i)) if i >= comm => Some(format!(
                    "`stream`: communication stream {i} does not exist (the runtime has {comm})"
                )),
                _ => None,
            };
            if let Some(message) = bad {
                return Err(Error::Placement {
                    file: self.origin.clone(),
                    line: r.stream_line,
                    message,
                });
            }
        }
        Ok(())
    }

    /// The rules (their line and pattern as written) that have applied to
    /// no scope yet, by this file or any of its clones (the runtimes built
    /// with it): after a run, a pattern with a typo, or one naming a scope
    /// the program never opens, whose rule did nothing.
    pub fn unmatched(&self) -> Vec<(usize, &str)> {
        self.rules
            .iter()
            .zip(self.matched.iter())
            .filter(|(_, m)| !m.load(Ordering::Relaxed))
            .map(|(r, _)| (r.line, r.text.as_str()))
            .collect()
    }

    /// The policies the rules name.
    pub(crate) fn policies(&self) -> impl Iterator<Item = Policy> + '_ {
        self.rules.iter().filter_map(|r| r.policy)
    }
}

/// The text being parsed (its lines) and its name, for errors.
struct Cx<'a> {
    origin: &'a str,
    lines: Lines,
}

/// Reads one key's value: `Ok(None)` when absent.
type Read<T> = fn(&str, &Spanned<Value>) -> std::result::Result<T, String>;

impl Cx<'_> {
    /// An error at the line of `span`.
    fn at(&self, span: Range<usize>, message: String) -> Error {
        Error::Placement {
            file: self.origin.to_string(),
            line: self.lines.line(span.start),
            message,
        }
    }

    /// Reads the value of `key`, if present, with `read`.
    fn field<T>(&self, v: &Option<Spanned<Value>>, key: &str, read: Read<T>) -> Result<Option<T>> {
        v.as_ref()
            .map(|v| read(key, v).map_err(|m| self.at(v.span(), m)))
            .transpose()
    }

    /// The error for what the TOML parser refused in `text` (its syntax,
    /// or a value serde could not take), naming the line and, where the
    /// mistake is in a key's value, the key.
    fn toml_error(&self, text: &str, e: &toml::de::Error) -> Error {
        let span = e.span();
        let line = span.as_ref().map_or(0, |s| self.lines.line(s.start));
        let mut message = e.message().trim_end().replace('\n', "; ");
        let spanned = span
            .as_ref()
            .and_then(|s| text.get(s.clone()))
            .unwrap_or("")
            .trim();
        let written = text
            .lines()
            .nth(line.saturating_sub(1))
            .unwrap_or("")
            .trim_start();
        // The parser's words for some mistakes, made to name them. An
        // integer outside `i64` is refused by `toml::Value` in several
        // words, depending on how far out it is.
        if message == "duplicate key" && !spanned.is_empty() {
            message = format!("duplicate key `{spanned}`");
        }
        let out_of_range = message == "u64 value was too large"
            || message == "integer number overflowed"
            || message.contains("i128")
            || message.contains("u128");
        if out_of_range {
            message = format!(
                "`{spanned}` is out of range for a TOML integer \
                 (-9223372036854775808 to 9223372036854775807)"
            );
        }
        // `[scope]` for `[[scope]]`, and `[[runtime]]` for `[runtime]`:
        // serde's words for them are type errors.
        if written.starts_with("[scope]") {
            message.push_str("; each rule is a `[[scope]]` table (two brackets)");
        }
        if written.starts_with("[[runtime]]") && message.contains("RawRuntime") {
            message = "`runtime` is one table: `[runtime]` (one bracket), not `[[runtime]]`".into();
        }
        // Serde names the file's tables by this module's types.
        for raw in ["RawRuntime", "RawRule"] {
            message = message.replace(&format!("struct {raw}"), "a table");
        }
        if let Some(key) = span.and_then(|s| key_at(text, s.start)) {
            if !message.contains(&format!("`{key}`")) {
                message = format!("`{key}`: {message}");
            }
        }
        Error::Placement {
            file: self.origin.to_string(),
            line,
            message,
        }
    }
}

/// Where each line of a text starts, to find the line of an offset in
/// logarithmic time (a file's rules are many: one scan, not one per rule).
struct Lines {
    /// The byte offset of each line's first byte, the first line's (0)
    /// included.
    starts: Vec<usize>,
}

impl Lines {
    fn new(text: &str) -> Lines {
        let newlines = text.bytes().enumerate().filter(|&(_, b)| b == b'\n');
        Lines {
            starts: std::iter::once(0)
                .chain(newlines.map(|(i, _)| i + 1))
                .collect(),
        }
    }

    /// The 1-based line of byte `offset` (the last line past the end): one
    /// more than the newlines before `offset`.
    fn line(&self, offset: usize) -> usize {
        self.starts.partition_point(|&start| start <= offset)
    }
}

/// The key whose value holds byte `offset` of `text`, named as the
/// readers name it: a rule's `stream`, `runtime.spare_sms`, or a
/// top-level key. `None` when `offset` is in no value (a key, a table
/// header) or `text` is not TOML.
fn key_at(text: &str, offset: usize) -> Option<String> {
    let holds = |v: &Spanned<DeValue<'_>>| {
        let s = v.span();
        s.start <= offset && offset < s.end.max(s.start + 1)
    };
    let inner = |t: &DeTable<'_>| {
        t.iter()
            .find(|(_, v)| holds(v))
            .map(|(k, _)| k.get_ref().to_string())
    };
    let doc = DeTable::parse(text).ok()?;
    doc.get_ref().iter().find_map(|(k, v)| {
        let k = k.get_ref();
        let within = match (&**k, v.get_ref()) {
            ("scope", DeValue::Array(rules)) => rules.iter().find_map(|r| match r.get_ref() {
                DeValue::Table(t) => inner(t),
                _ => None,
            }),
            ("runtime", DeValue::Table(t)) => inner(t).map(|key| format!("runtime.{key}")),
            _ => None,
        };
        within.or_else(|| holds(v).then(|| k.to_string()))
    })
}

fn boolean(key: &str, v: &Spanned<Value>) -> std::result::Result<bool, String> {
    v.get_ref()
        .as_bool()
        .ok_or_else(|| format!("`{key}` must be true or false, not {}", shown(v.get_ref())))
}

fn sm_count(key: &str, v: &Spanned<Value>) -> std::result::Result<u32, String> {
    match v.get_ref() {
        Value::Integer(i) => u32::try_from(*i)
            .map_err(|_| format!("`{key}` must be a number of SMs (0 or more), not {i}")),
        other => Err(format!(
            "`{key}` must be a number of SMs (0 or more), not {}",
            shown(other)
        )),
    }
}

fn class(key: &str, v: &Spanned<Value>) -> std::result::Result<Class, String> {
    v.get_ref()
        .as_str()
        .and_then(Class::from_name)
        .ok_or_else(|| {
            format!(
                "`{key}` must be \"latency-critical\", \"normal\" or \"best-effort\", not {}",
                shown(v.get_ref())
            )
        })
}

fn priority(key: &str, v: &Spanned<Value>) -> std::result::Result<Priority, String> {
    match v.get_ref().as_str() {
        Some("main") => Ok(Priority::Main),
        Some("side") => Ok(Priority::Side),
        _ => Err(format!(
            "`{key}` must be \"main\" or \"side\", not {}",
            shown(v.get_ref())
        )),
    }
}

fn policy(key: &str, v: &Spanned<Value>) -> std::result::Result<Policy, String> {
    v.get_ref()
        .as_str()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| {
            format!(
                "`{key}` must be \"single\", \"round-robin\" or \"affinity\", not {}",
                shown(v.get_ref())
            )
        })
}

fn stream(key: &str, v: &Spanned<Value>) -> std::result::Result<StreamChoice, String> {
    let index = |s: &str| s.parse::<usize>().ok();
    let choice = match v.get_ref() {
        Value::Integer(i) => usize::try_from(*i).ok().map(StreamChoice::Compute),
        Value::String(s) => match s.as_str() {
            "any" => Some(StreamChoice::Policy),
            "side" => Some(StreamChoice::Side),
            "comm" => Some(StreamChoice::Comm(0)),
            s => s
                .strip_prefix("comm:")
                .and_then(index)
                .map(StreamChoice::Comm)
                .or_else(|| {
                    s.strip_prefix("compute:")
                        .and_then(index)
                        .map(StreamChoice::Compute)
                }),
        },
        _ => None,
    };
    choice.ok_or_else(|| {
        format!(
            "`{key}` must be a compute stream index (0, 1, …), \"compute:N\", \"comm\", \"comm:N\", \"side\" or \"any\", not {}",
            shown(v.get_ref())
        )
    })
}

/// A value as an error message shows it.
fn shown(v: &Value) -> String {
    match v {
        Value::String(s) => format!("\"{s}\""),
        Value::Integer(i) => i.to_string(),
        Value::Boolean(b) => b.to_string(),
        other => format!("a {}", other.type_str()),
    }
}

#[cfg(test)]
mod tests;

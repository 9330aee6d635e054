//! Scope patterns: globs over `/`-separated scope paths.
//!
//! A pattern is segments joined by `/`. In a segment, `*` matches any run of
//! characters and `?` one character (never a `/`); a segment that is exactly
//! `**` matches any number of whole segments, none included. A pattern
//! *applies* to a path when it matches the path or one of its enclosing
//! scopes (a prefix of whole segments): `forward/*` applies to
//! `forward/layer3/attn` through `forward/layer3`.

/// A parsed pattern.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Pattern {
    segments: Vec<Segment>,
    /// Characters that are neither wildcards nor `/` (specificity: more
    /// wins).
    literals: usize,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Segment {
    /// `**`.
    Any,
    /// A glob of one segment.
    Glob(Vec<char>),
}

impl Pattern {
    /// Parses `text`; the error says what is wrong with it.
    pub(crate) fn parse(text: &str) -> Result<Pattern, String> {
        if text.is_empty() {
            return Err("the pattern is empty".into());
        }
        let mut segments = Vec::new();
        let mut literals = 0;
        for seg in text.split('/') {
            if seg.is_empty() {
                return Err(format!(
                    "pattern `{text}` has an empty segment (a leading, trailing or doubled `/`)"
                ));
            }
            if seg == "**" {
                segments.push(Segment::Any);
                continue;
            }
            if seg.contains("**") {
                return Err(format!(
                    "pattern `{text}`: `**` must be a whole segment (`a/**/b`), not part of `{seg}`"
                ));
            }
            literals += seg.chars().filter(|c| !matches!(c, '*' | '?')).count();
            segments.push(Segment::Glob(seg.chars().collect()));
        }
        Ok(Pattern { segments, literals })
    }

    /// The number of non-wildcard characters.
    pub(crate) fn literals(&self) -> usize {
        self.literals
    }

    /// The depth (number of segments) of the innermost prefix of `path`
    /// (its segments) that the pattern matches, if any.
    pub(crate) fn applies(&self, path: &[&str]) -> Option<usize> {
        (1..=path.len())
            .rev()
            .find(|&d| matches(&self.segments, &path[..d]))
    }
}

/// Whether `pat` matches exactly the segments `path`.
fn matches(pat: &[Segment], path: &[&str]) -> bool {
    match pat.split_first() {
        None => path.is_empty(),
        Some((Segment::Any, rest)) => (0..=path.len()).any(|k| matches(rest, &path[k..])),
        Some((Segment::Glob(g), rest)) => match path.split_first() {
            Some((seg, more)) => glob(g, &seg.chars().collect::<Vec<_>>()) && matches(rest, more),
            None => false,
        },
    }
}

/// Whether the glob `g` (`*`, `?`, literals) matches the whole of `s`.
fn glob(g: &[char], s: &[char]) -> bool {
    // Iterative matcher with one backtrack point (the last `*`).
    let (mut gi, mut si) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while si < s.len() {
        match g.get(gi) {
            Some('*') => {
                star = Some((gi, si));
                gi += 1;
            }
            Some(&c) if c == '?' || c == s[si] => {
                gi += 1;
                si += 1;
            }
            _ => match star {
                Some((sg, ss)) => {
                    gi = sg + 1;
                    si = ss + 1;
                    star = Some((sg, ss + 1));
                }
                None => return false,
            },
        }
    }
    g[gi..].iter().all(|&c| c == '*')
}

#[cfg(test)]
mod tests {
    use super::Pattern;

    fn applies(p: &str, path: &str) -> Option<usize> {
        let segs: Vec<&str> = path.split('/').collect();
        Pattern::parse(p).unwrap().applies(&segs)
    }

    #[test]
    fn globs_match_within_a_segment() {
        assert_eq!(applies("forward/*", "forward/layer3"), Some(2));
        assert_eq!(applies("forward/layer?", "forward/layer3"), Some(2));
        assert_eq!(applies("forward/layer?", "forward/layer12"), None);
        assert_eq!(applies("*/layer*", "backward/layer12"), Some(2));
        assert_eq!(applies("forward/*3", "forward/layer3"), Some(2));
        assert_eq!(applies("forward/*3", "forward/layer4"), None);
        // `*` never crosses a `/`: `f*` matches the first segment only.
        assert_eq!(applies("f*", "forward/layer3"), Some(1));
        assert_eq!(applies("*", "backward/layer3/attn"), Some(1));
    }

    #[test]
    fn a_pattern_applies_to_nested_scopes_at_the_innermost_depth() {
        assert_eq!(applies("forward", "forward/layer3/attn"), Some(1));
        assert_eq!(applies("forward/*", "forward/layer3/attn"), Some(2));
        assert_eq!(applies("forward/layer3/attn", "forward/layer3"), None);
        assert_eq!(applies("backward", "forward/layer3"), None);
    }

    #[test]
    fn double_star_spans_whole_segments() {
        assert_eq!(applies("**/attn", "forward/layer3/attn"), Some(3));
        assert_eq!(applies("**/attn", "attn"), Some(1));
        assert_eq!(applies("forward/**", "forward/layer3/attn"), Some(3));
        assert_eq!(applies("forward/**/attn", "forward/attn"), Some(2));
        assert_eq!(applies("**/mlp", "forward/layer3/attn"), None);
    }

    #[test]
    fn bad_patterns_are_refused() {
        for bad in ["", "/forward", "forward/", "a//b", "a**", "a/x**y/b"] {
            assert!(Pattern::parse(bad).is_err(), "{bad:?} was accepted");
        }
        assert_eq!(Pattern::parse("forward/layer*").unwrap().literals(), 12);
    }
}

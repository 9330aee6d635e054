//! GPT-2's byte-level BPE encoding (`r50k_base`) in O(n log n) per piece.
//!
//! **Invariant:** [`Bpe::encode_ordinary`] gives exactly the ids that
//! `tiktoken-rs` 0.7's `CoreBPE::encode_ordinary` gives for `r50k_base`,
//! for every input `tiktoken-rs` encodes. It takes the same steps:
//!
//! 1. the text is split into pieces by GPT-2's pre-tokenization pattern
//!    ([`PATTERN`], the one `tiktoken-rs` compiles);
//! 2. a piece that is a token is that token;
//! 3. any other piece starts as its bytes, and the adjacent pair of parts
//!    whose concatenated bytes have the lowest rank (the leftmost one on a
//!    tie) is merged, again and again, until no adjacent pair is a token;
//!    the parts' ranks are the ids.
//!
//! The ranks are `tiktoken-rs`'s own: [`Bpe::new`] reads the bytes of every
//! ordinary id (0..50256) back from the `CoreBPE`, so no vocabulary is
//! copied here, and a rank is its token's id.
//!
//! Two steps are carried out differently, because `tiktoken-rs`'s way
//! breaks down on a long run of letters without spaces (base64, DNA,
//! minified text):
//!
//! - step 3 in `tiktoken-rs` rescans all the parts after each merge: O(n·m)
//!   for n bytes and m merges, so 320 000 letters take half a minute.
//!   Above [`HEAP_ABOVE`] bytes the pairs go into a heap ordered by (rank,
//!   start) over a linked list of parts instead ([`merge_heap`]); a shorter
//!   piece goes through `tiktoken-rs`'s own loop, which is faster there.
//! - step 1 in `tiktoken-rs` runs `fancy-regex`'s backtracking engine
//!   (for the look-ahead in `\s+(?!\S)`), which fails on a run of a
//!   million letters, digits or spaces (half a million pass), and
//!   `tiktoken-rs` panics.
//!   Here the `regex` crate (the same Unicode tables: both are built on
//!   `regex-syntax`) finds the pieces of the pattern without the
//!   look-ahead, and the look-ahead is applied by hand: see
//!   [`Bpe::pieces`].
//!
//! A long text is encoded on several threads ([`encode_in_parts`]): it is
//! cut only where the pieces on either side are those of the whole text,
//! before whitespace that follows a character that is not (why that is
//! exact: [`is_cut`]), so the ids are the same.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use regex::Regex;
use rustc_hash::FxHashMap;
use tiktoken_rs::{CoreBPE, Rank};

/// GPT-2's pre-tokenization pattern, as `tiktoken-rs` 0.7's `r50k_base`
/// compiles it.
pub const PATTERN: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

/// The alternative of [`PATTERN`] the `regex` crate cannot compile (it has
/// no look-around); [`Bpe::pieces`] applies it by hand.
const LOOK_AHEAD: &str = r"|\s+(?!\S)";

/// Pieces of more bytes than this are merged with a heap; shorter ones with
/// `tiktoken-rs`'s loop (faster there: see the `timings` test).
pub const HEAP_ABOVE: usize = 48;

/// Ranks of byte sequences (the map type `tiktoken-rs`'s functions take).
type Ranks = FxHashMap<Vec<u8>, Rank>;

/// The encoder: ranks of the ordinary tokens and the compiled pattern.
pub struct Bpe {
    ranks: Ranks,
    split: Regex,
}

impl std::fmt::Debug for Bpe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bpe")
            .field("ranks", &self.ranks.len())
            .finish_non_exhaustive()
    }
}

impl Bpe {
    /// The encoder of `core`'s ordinary tokens, ids `0..ordinary` (the
    /// special ones above them are never produced by ordinary encoding).
    /// Errors if two ids have the same bytes or a byte is not a token: the
    /// merge rule needs both, and `r50k_base` has both.
    pub fn new(core: &CoreBPE, ordinary: Rank) -> Result<Self, String> {
        let mut ranks = Ranks::default();
        ranks.reserve(ordinary as usize);
        let all = core._decode_native_and_split((0..ordinary).collect());
        for (id, bytes) in (0..ordinary).zip(all) {
            if let Some(other) = ranks.insert(bytes, id) {
                return Err(format!("tokens {other} and {id} have the same bytes"));
            }
        }
        if let Some(b) = (0..=255u8).find(|b| !ranks.contains_key(&[*b][..])) {
            return Err(format!("byte {b:#04x} is not a token"));
        }
        let split = Regex::new(&PATTERN.replace(LOOK_AHEAD, "")).map_err(|e| e.to_string())?;
        Ok(Bpe { ranks, split })
    }

    /// The pieces [`PATTERN`] splits `text` into, in order.
    ///
    /// `split` is [`PATTERN`] without `\s+(?!\S)`. Where that alternative
    /// is reached (at whitespace that is not a space before a letter, digit
    /// or symbol), `split` takes the whole run of whitespace with its `\s+`.
    /// `\s+(?!\S)` takes the same run when it ends the text; when a letter,
    /// digit or symbol follows, it backs off by one character (left to
    /// start the next piece, so that a space joins the word after it), and
    /// a run of one character, which it cannot back off from, falls to
    /// `\s+`. This does the same: it drops the last character of such a
    /// match and searches on from there. A match is such a run exactly when
    /// its last character is whitespace: the other alternatives end in a
    /// letter, digit or symbol. (`char::is_whitespace` and the pattern's
    /// `\s` agree on every character; a test checks all of them.)
    pub fn pieces<'t>(&'t self, text: &'t str) -> impl Iterator<Item = &'t str> + 't {
        let mut pos = 0;
        std::iter::from_fn(move || {
            let m = self.split.find_at(text, pos)?;
            let mut end = m.end();
            if end < text.len() {
                let mut chars = m.as_str().chars();
                if let Some(last) = chars.next_back() {
                    if last.is_whitespace() && !chars.as_str().is_empty() {
                        end -= last.len_utf8();
                    }
                }
            }
            pos = end;
            Some(&text[m.start()..end])
        })
    }

    /// Encodes `text` as ordinary text (no special tokens), appending the
    /// ids to `out`.
    pub fn encode_ordinary(&self, text: &str, out: &mut Vec<Rank>) {
        self.encode_with(text, HEAP_ABOVE, out);
    }

    /// [`encode_ordinary`](Self::encode_ordinary), with the heap used for
    /// pieces of more than `heap_above` bytes (tests vary it).
    fn encode_with(&self, text: &str, heap_above: usize, out: &mut Vec<Rank>) {
        for piece in self.pieces(text) {
            let piece = piece.as_bytes();
            if let Some(&id) = self.ranks.get(piece) {
                out.push(id);
            } else if piece.len() > heap_above {
                merge_heap(&self.ranks, piece, out);
            } else {
                // At least two bytes: every single byte is a token.
                let parts = tiktoken_rs::byte_pair_split(piece, &self.ranks);
                out.extend(parts.into_iter().map(|part| self.ranks[part]));
            }
        }
    }
}

/// Texts of more bytes than this are encoded on several threads by
/// [`encode_in_parts`] (see [`parts_for`]).
pub const PARALLEL_ABOVE: usize = 1 << 20;

/// How many chunks [`encode_in_parts`] should aim at for a text of `len`
/// bytes: one per available thread above [`PARALLEL_ABOVE`], else one.
pub fn parts_for(len: usize) -> usize {
    if len > PARALLEL_ABOVE {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    } else {
        1
    }
}

/// Whether a text may be cut between the characters `before` and `at`
/// without changing its ids: when `at` is whitespace and `before` is not.
///
/// Cutting `text` at byte p into `text[..p]` and `text[p..]` and encoding
/// both gives the ids of `text` when (a) a piece of `text` ends at p and
/// (b) the pieces of each half are those of `text` on its side of p; the
/// ids then agree too, since the merge works on one piece at a time.
///
/// (a) The piece holding `before` ends at p. A piece holding both
/// `before` and `at` would hold a whitespace character that is not its
/// first one. The contractions hold no whitespace; ` ?\p{L}+`,
/// ` ?\p{N}+` and ` ?[^\s\p{L}\p{N}]+` hold whitespace only as their
/// optional leading space; `\s+(?!\S)` and `\s+` cannot hold `before`.
/// So no piece crosses p, and the pieces tile the text (every character
/// starts a match of some alternative), so one starts at p.
///
/// (b) After p: [`PATTERN`] has no look-behind and no anchors, so the
/// match at a position depends only on the text from there on, which
/// `text[p..]` shares with `text`; with a piece starting at p, the pieces
/// of `text[p..]` are those of `text` after p, one by one.
///
/// Before p: take a piece of `text` at q < p; it ends at or before p, by
/// (a). Leftmost-first matching picks, among the alternatives' matches
/// at q, the first in a fixed order. Without look-ahead an alternative's
/// matches that end by p are the same in `text` and in `text[..p]` (and
/// `text[..p]` has no others). The look-ahead of `\s+(?!\S)` sees the
/// same character in both for a match ending before p, and one ending at
/// p, where `text[..p]` ends and the look-ahead always holds, would end
/// in `before`, which is not whitespace. So the matches at q in
/// `text[..p]` are those of `text` that end by p, in the same order;
/// `text`'s pick is among them, and still the first. (The same holds for
/// [`Bpe::pieces`], which applies the look-ahead only to a match that
/// ends in whitespace.)
///
/// A cut before a `'\n'` that follows a letter, digit or symbol is one of
/// these; a cut after whitespace, or inside a run of it, is not: the
/// pieces of `"a\n\n\nb"` are `"a"`, `"\n\n"`, `"\n"`, `"b"`, and cut
/// after its first `'\n'` they would be `"a"`, `"\n"` | `"\n"`, `"\n"`,
/// `"b"`. `<|endoftext|>` holds no
/// whitespace, so no cut falls inside it (see
/// [`Tokenizer::encode_with_eot`](crate::data::Tokenizer::encode_with_eot)).
fn is_cut(before: char, at: char) -> bool {
    at.is_whitespace() && !before.is_whitespace()
}

/// The first position at or after byte `from` where `text` may be cut
/// ([`is_cut`]), strictly inside it; `None` if there is none.
fn next_cut(text: &str, from: usize) -> Option<usize> {
    let mut from = from.max(1);
    while from < text.len() && !text.is_char_boundary(from) {
        from += 1;
    }
    let mut before = text.get(..from)?.chars().next_back()?;
    for (i, at) in text[from..].char_indices() {
        if is_cut(before, at) {
            return Some(from + i);
        }
        before = at;
    }
    None
}

/// The positions `text` is cut at for about `parts` chunks of about equal
/// length: the first cut at or after each of the equally spaced offsets
/// (after the previous cut). Chunks without a cut merge with the next.
fn cuts(text: &str, parts: usize) -> Vec<usize> {
    let mut cuts = Vec::new();
    let mut last = 0;
    for i in 1..parts {
        let target = (text.len() as u64 * i as u64 / parts as u64) as usize;
        match next_cut(text, target.max(last + 1)) {
            Some(p) => {
                cuts.push(p);
                last = p;
            }
            None => break,
        }
    }
    cuts
}

/// The ids `encode` gives for `text` (appended to an empty vector), found
/// by cutting `text` into about `parts` chunks where [`is_cut`] allows,
/// encoding them on as many threads and joining the ids in order: the
/// same ids, for an `encode` that is [`Bpe::encode_ordinary`] or one that
/// encodes the text between literal `<|endoftext|>`s with it.
pub fn encode_in_parts<F>(text: &str, parts: usize, encode: F) -> Vec<Rank>
where
    F: Fn(&str, &mut Vec<Rank>) + Sync,
{
    let mut bounds = vec![0];
    bounds.extend(cuts(text, parts));
    bounds.push(text.len());
    let chunks: Vec<&str> = bounds.windows(2).map(|w| &text[w[0]..w[1]]).collect();
    let encode = &encode;
    let run = move |chunk: &str| {
        let mut out = Vec::new();
        encode(chunk, &mut out);
        out
    };
    let (first, rest) = chunks.split_first().expect("at least one chunk");
    if rest.is_empty() {
        return run(first);
    }
    let (mut out, rest): (Vec<Rank>, Vec<Vec<Rank>>) = std::thread::scope(|s| {
        let threads: Vec<_> = rest.iter().map(|&c| s.spawn(move || run(c))).collect();
        let first = run(first);
        let rest = threads
            .into_iter()
            .map(|t| t.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
            .collect();
        (first, rest)
    });
    out.reserve(rest.iter().map(Vec::len).sum());
    for ids in rest {
        out.extend_from_slice(&ids);
    }
    out
}

/// Merges `piece` by the rule in the module docs and appends its parts'
/// ranks to `out`, in O(n log n) for n bytes.
///
/// A part is named by the offset it starts at. The heap holds (rank of the
/// part joined with the next one, start), smallest first; an entry is
/// stale when `pair[start]` no longer equals its rank. That test is exact:
/// a part's pair only ever grows to the right (its own part or the next
/// one absorbs a neighbour) and distinct byte sequences have distinct
/// ranks, so a pair's rank never returns to a value it had, and a part
/// merged into the one before it has `pair == Rank::MAX`, which no entry
/// holds. Popping the smallest (rank, start) is thus the lowest-ranked
/// pair, the leftmost on a tie: the merge `tiktoken-rs`'s scan picks.
fn merge_heap(ranks: &Ranks, piece: &[u8], out: &mut Vec<Rank>) {
    let n = piece.len();
    let rank = |from: usize, to: usize| ranks.get(&piece[from..to]).copied();
    // next[s]: the start of the part after part s (n after the last one);
    // prev[s]: the start of the part before (meaningless for part 0).
    let mut next: Vec<usize> = (1..=n).collect();
    let mut prev: Vec<usize> = (0..n).map(|s| s.wrapping_sub(1)).collect();
    // pair[s]: the rank of part s joined with the next one; Rank::MAX when
    // that is not a token, s is the last part, or s is no longer a part.
    let mut pair: Vec<Rank> = (0..n)
        .map(|s| {
            if s + 2 <= n {
                rank(s, s + 2).unwrap_or(Rank::MAX)
            } else {
                Rank::MAX
            }
        })
        .collect();
    let mut heap: BinaryHeap<Reverse<(Rank, usize)>> = pair
        .iter()
        .enumerate()
        .filter(|&(_, &r)| r != Rank::MAX)
        .map(|(s, &r)| Reverse((r, s)))
        .collect();
    while let Some(Reverse((r, s))) = heap.pop() {
        if pair[s] != r {
            continue;
        }
        // Part s absorbs the next one, which ends at `end`.
        let gone = next[s];
        let end = next[gone];
        pair[gone] = Rank::MAX;
        next[s] = end;
        if end < n {
            prev[end] = s;
        }
        pair[s] = Rank::MAX;
        if end < n {
            if let Some(r) = rank(s, next[end]) {
                pair[s] = r;
                heap.push(Reverse((r, s)));
            }
        }
        if s > 0 {
            let p = prev[s];
            pair[p] = Rank::MAX;
            if let Some(r) = rank(p, end) {
                pair[p] = r;
                heap.push(Reverse((r, p)));
            }
        }
    }
    let mut s = 0;
    while s < n {
        // Every part is a token: a byte, or a pair found in `ranks`.
        out.push(ranks[&piece[s..next[s]]]);
        s = next[s];
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use proptest::prelude::*;
    use proptest::test_runner::{Config, TestCaseError, TestError, TestRunner};

    fn core() -> &'static CoreBPE {
        tiktoken_rs::r50k_base_singleton()
    }

    fn bpe() -> &'static Bpe {
        static BPE: std::sync::OnceLock<Bpe> = std::sync::OnceLock::new();
        BPE.get_or_init(|| Bpe::new(core(), crate::data::EOT).unwrap())
    }

    /// The ids of `text` with the heap above `heap_above` bytes.
    fn encode(text: &str, heap_above: usize) -> Vec<Rank> {
        let mut out = Vec::new();
        bpe().encode_with(text, heap_above, &mut out);
        out
    }

    /// The pieces of `text` by [`PATTERN`] itself, with `fancy-regex` (what
    /// `tiktoken-rs` runs).
    fn fancy_pieces(text: &str) -> Vec<&str> {
        static FANCY: std::sync::OnceLock<fancy_regex::Regex> = std::sync::OnceLock::new();
        let fancy = FANCY.get_or_init(|| fancy_regex::Regex::new(PATTERN).unwrap());
        fancy.find_iter(text).map(|m| m.unwrap().as_str()).collect()
    }

    /// The pieces against `fancy-regex`'s, then both merges, and the
    /// default mix of them, against `tiktoken-rs`.
    fn check(text: &str) {
        assert_eq!(
            bpe().pieces(text).collect::<Vec<_>>(),
            fancy_pieces(text),
            "pieces of {:?}",
            text.chars().take(200).collect::<String>()
        );
        let want = core().encode_ordinary(text);
        for heap_above in [0, HEAP_ABOVE, usize::MAX] {
            let got = encode(text, heap_above);
            if got != want {
                let at = got.iter().zip(&want).take_while(|(a, b)| a == b).count();
                panic!(
                    "heap above {heap_above}: ids differ from tiktoken-rs's at {at} \
                     ({} vs {} ids) for {:?}",
                    got.len(),
                    want.len(),
                    text.chars().take(200).collect::<String>()
                );
            }
        }
    }

    /// The vocabulary read back from `tiktoken-rs`: 50 256 ordinary
    /// tokens, each its own id, `<|endoftext|>` not among them.
    #[test]
    fn ranks_are_the_ordinary_vocabulary() {
        let b = bpe();
        assert_eq!(b.ranks.len(), 50256);
        assert_eq!(b.ranks.get(&b"<|endoftext|>"[..]), None);
        assert_eq!(b.ranks[&b" the"[..]], core().encode_ordinary(" the")[0]);
        assert_eq!(b.ranks[&b"!"[..]], 0);
    }

    /// `char::is_whitespace` is the pattern's `\s`, which [`Bpe::pieces`]
    /// relies on.
    #[test]
    fn whitespace_is_the_patterns() {
        let space = Regex::new(r"\A\s\z").unwrap();
        let mut buf = [0; 4];
        for c in (0..=0x10FFFF).filter_map(char::from_u32) {
            assert_eq!(
                c.is_whitespace(),
                space.is_match(c.encode_utf8(&mut buf)),
                "U+{:04X}",
                c as u32
            );
        }
    }

    #[test]
    fn fixed_texts_match_tiktoken() {
        for text in [
            "",
            "a",
            "Hello, world! It's a test: don't you'll we've I'm they'd.",
            "  leading and trailing spaces   \n\n\ttabs\t\r\n",
            "<|endoftext|> spelled out",
            "naïve café, Ærøskøbing, 日本語のテキスト, 🦀🦀 and e\u{301}\u{302}",
            "1234567890 3.14159 0x1F 1e-9",
            "\u{a0}\u{2003}non-breaking\u{3000}spaces",
        ] {
            check(text);
        }
    }

    /// Long pieces, where `tiktoken-rs` is quadratic but 20 000 bytes are
    /// still quick.
    #[test]
    fn long_runs_match_tiktoken() {
        let n = 20_000;
        check(&"a".repeat(n));
        check(&"ab".repeat(n / 2));
        check(&"abc".repeat(n / 3));
        check(&"the".repeat(n / 3));
        check(&"ACGT".repeat(n / 4));
        check(&" ".repeat(n));
        check(&"!?".repeat(n / 2));
        check(&"1".repeat(n));
        check(&"é".repeat(n / 2));
        check(&"日本".repeat(n / 6));
        // Letters from a fixed pseudo-random sequence (base64-like).
        let alphabet = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let random: String = (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                alphabet[(x % alphabet.len() as u64) as usize] as char
            })
            .collect();
        check(&random);
        check(&format!("{random} {random}\n{random}"));
    }

    /// Runs of a million characters of one class, which `fancy-regex`'s
    /// backtracking (and so `tiktoken-rs`) fails on: the pieces are what
    /// the pattern means, and the ids decode to the text.
    #[test]
    fn runs_past_tiktoken_encode() {
        let n = 1 << 20;
        let letters = "a".repeat(n);
        let spaces = format!("{}x", " ".repeat(n));
        let digits = format!("x{}", "7".repeat(n));
        let pieces = |text| bpe().pieces(text).map(str::len).collect::<Vec<_>>();
        assert_eq!(pieces(&letters), [n]);
        assert_eq!(pieces(&spaces), [n - 1, 2]);
        assert_eq!(pieces(&digits), [1, n]);
        for text in [letters, spaces, digits] {
            let ids = encode(&text, HEAP_ABOVE);
            let bytes: Vec<u8> = core()._decode_native_and_split(ids).flatten().collect();
            assert!(bytes == text.as_bytes());
        }
    }

    /// Fragments drawn from: ASCII letters, digits, whitespace, punctuation,
    /// contractions, and non-ASCII letters, marks and symbols.
    fn fragment() -> impl Strategy<Value = String> {
        prop_oneof![
            "[a-zA-Z]{1,12}",
            "[a-z]{20,300}",
            "[0-9]{1,8}",
            "[ \t\n\r]{1,4}",
            "[ ]{1,3}",
            "[!-/:-@\\[-`{-~]{1,4}",
            prop::sample::select(vec![
                "'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'x", "n't", "''"
            ])
            .prop_map(str::to_string),
            "[àáâãäåæçèéêëìíîïñòóôõöøùúûüýÿßœ]{1,6}",
            "[\u{4e00}-\u{4fff}\u{3040}-\u{30ff}]{1,6}",
            "[\u{1f300}-\u{1f6ff}\u{1f900}-\u{1f9ff}]{1,3}",
            "[\u{300}-\u{36f}]{1,3}",
            "[\u{a0}\u{2000}-\u{200b}\u{3000}\u{85}]{1,2}",
            "[\u{0400}-\u{04ff}\u{0600}-\u{06ff}\u{0900}-\u{097f}]{1,6}",
            any::<char>().prop_map(String::from),
        ]
    }

    /// Texts made of few characters, dense in what a cut could go wrong
    /// at: runs of `'\n'`, spaces and other whitespace, apostrophes and
    /// contractions, letters, digits, symbols, non-ASCII letters, marks
    /// and spaces, `<|endoftext|>` and pieces of it. A wrong cut rule
    /// fails on some of them quickly (`the_texts_catch_wrong_cuts`).
    pub(crate) fn dense_text() -> impl Strategy<Value = String> {
        let alphabet = vec![
            "a",
            "b",
            "s",
            "t",
            "ll",
            "re",
            "1",
            "2",
            ".",
            "!",
            "'",
            "'",
            "'s",
            "'S",
            "'ll",
            "'re",
            " ",
            " ",
            " ",
            "  ",
            "\n",
            "\n",
            "\n",
            "\n\n",
            "\t",
            "\r\n",
            "\r",
            " \n",
            "\n ",
            "\u{a0}",
            "\u{3000}",
            "\u{85}",
            "\u{200b}",
            "é",
            "e\u{301}",
            "\u{301}",
            "日本",
            "語",
            "🦀",
            "<|endoftext|>",
            "<|",
            "|>",
        ];
        prop::collection::vec(prop::sample::select(alphabet), 0..48).prop_map(|v| v.concat())
    }

    /// The ids of `text` cut wherever `rule(before, at)` holds between two
    /// characters, each chunk encoded alone.
    fn encode_cut_by(text: &str, rule: impl Fn(char, char) -> bool) -> Vec<Rank> {
        let mut out = Vec::new();
        let mut start = 0;
        let mut chars = text.char_indices().peekable();
        while let Some((_, before)) = chars.next() {
            if let Some(&(i, at)) = chars.peek() {
                if rule(before, at) {
                    bpe().encode_ordinary(&text[start..i], &mut out);
                    start = i;
                }
            }
        }
        bpe().encode_ordinary(&text[start..], &mut out);
        out
    }

    /// `text` cut at every position [`is_cut`] allows at once, at those
    /// of them before a `'\n'` only, and into
    /// 2, 3, 7 and as many chunks as bytes on threads: the ids of the
    /// whole text, which are `tiktoken-rs`'s.
    fn check_cuts(text: &str) -> Result<(), TestCaseError> {
        let want = encode(text, HEAP_ABOVE);
        prop_assert_eq!(&want, &core().encode_ordinary(text));
        prop_assert_eq!(&encode_cut_by(text, is_cut), &want, "cut everywhere");
        let newline = |b: char, at: char| at == '\n' && !b.is_whitespace();
        prop_assert_eq!(&encode_cut_by(text, newline), &want, "cut before newlines");
        for parts in [2, 3, 7, text.len()] {
            let got = encode_in_parts(text, parts, |c, out| bpe().encode_ordinary(c, out));
            prop_assert_eq!(&got, &want, "{} parts", parts);
        }
        Ok(())
    }

    /// Texts around cut candidates, cut exactly.
    #[test]
    fn fixed_texts_cut_exactly() {
        for text in [
            "",
            "\n",
            "\n\n",
            "a\n\n\nb",
            "x.\n's",
            "'\ns",
            " \n",
            "word\n",
            "\nword",
            "\n\nword\n\n",
            "it's\n's\n'll 're\n\n'S",
            "a \n b\t\n\tc\r\n\r\nd  \n  e",
            "<|endoftext|>\n<|endoftext|> <|endoftext|>x\n",
            "日本\n語 🦀\n🦀 e\u{301}\ne\u{301} x\u{a0}\u{a0}y\u{3000}z\u{85}",
            "1\n2 3\t4!\n?",
        ] {
            check_cuts(text).unwrap();
        }
    }

    /// [`cuts`] for as many parts as bytes is every position [`is_cut`]
    /// allows; for fewer, some of them, in order.
    #[test]
    fn cuts_are_the_allowed_positions() {
        let text = "a\n\n b's  c\t日本\n\u{a0}é x \n";
        let allowed: Vec<usize> = text
            .char_indices()
            .zip(text.chars().skip(1))
            .filter(|&((_, b), at)| is_cut(b, at))
            .map(|((i, b), _)| i + b.len_utf8())
            .collect();
        assert_eq!(allowed, [1, 7, 10, 17, 22, 24]);
        assert_eq!(cuts(text, text.len()), allowed);
        for parts in 0..text.len() {
            let c = cuts(text, parts);
            assert!(c.len() < parts.max(1));
            assert!(c.windows(2).all(|w| w[0] < w[1]));
            assert!(
                c.iter().all(|p| allowed.contains(p)),
                "{parts} parts: {c:?}"
            );
        }
        assert!(cuts("abc", 3).is_empty());
        assert!(cuts("   ", 3).is_empty());
        assert!(cuts("", 3).is_empty());
    }

    /// Wrong rules are caught by [`dense_text`] in a few hundred texts:
    /// cutting before any `'\n'` or any whitespace, after whitespace,
    /// between two non-whitespace characters, before an apostrophe.
    #[test]
    fn the_texts_catch_wrong_cuts() {
        type Rule = fn(char, char) -> bool;
        let wrong: [(&str, Rule); 6] = [
            ("before '\\n'", |_, at| at == '\n'),
            ("after '\\n'", |b, _| b == '\n'),
            ("before whitespace", |_, at| at.is_whitespace()),
            ("after whitespace", |b, at| {
                b.is_whitespace() && !at.is_whitespace()
            }),
            ("inside non-whitespace", |b, at| {
                !b.is_whitespace() && !at.is_whitespace()
            }),
            ("before an apostrophe", |_, at| at == '\''),
        ];
        for (name, rule) in wrong {
            let mut runner = TestRunner::new_with_rng(
                Config {
                    cases: 500,
                    failure_persistence: None,
                    ..Config::default()
                },
                proptest::test_runner::TestRng::deterministic_rng(
                    proptest::test_runner::RngAlgorithm::ChaCha,
                ),
            );
            let result = runner.run(&dense_text(), |text| {
                prop_assert_eq!(encode_cut_by(&text, rule), encode(&text, HEAP_ABOVE));
                Ok(())
            });
            match result {
                Err(TestError::Fail(_, text)) => println!("cut {name}: fails on {text:?}"),
                other => panic!("cut {name}: not caught ({other:?})"),
            }
        }
    }

    /// Best of three, in seconds, and the last result.
    fn best_of_3<T>(mut f: impl FnMut() -> T) -> (f64, T) {
        let mut best = f64::INFINITY;
        let mut last = None;
        for _ in 0..3 {
            let t = std::time::Instant::now();
            last = Some(std::hint::black_box(f()));
            best = best.min(t.elapsed().as_secs_f64());
        }
        (best, last.unwrap())
    }

    /// Timings, `tiktoken-rs` against this module (a minute or two: the
    /// 320 000-letter run takes `tiktoken-rs` half a minute, three
    /// times). The normal text is the file `BPE_BENCH_TEXT` names, else
    /// the built-in corpus repeated to 1 MB. Prints; asserts only that
    /// the ids agree.
    ///
    /// `cargo test --release -p braid-gpt2 --lib bpe::tests::timings -- --ignored --nocapture`
    #[test]
    #[ignore]
    fn timings() {
        let b = bpe();
        let new = |text: &str| {
            let mut out = Vec::new();
            b.encode_ordinary(text, &mut out);
            out
        };
        // Merge alone by piece length (letters that are no token whole).
        let alphabet = b"qxzjkvwy";
        for len in [8, 16, 32, 64, 128, 256, 512, 1024] {
            let piece: Vec<u8> = (0..len).map(|i| alphabet[(i * 5 + i / 3) % 8]).collect();
            let reps = (1 << 20) / len;
            let (split, _) = best_of_3(|| {
                (0..reps)
                    .map(|_| tiktoken_rs::byte_pair_split(&piece, &b.ranks).len())
                    .sum::<usize>()
            });
            let (heap, _) = best_of_3(|| {
                let mut out = Vec::new();
                for _ in 0..reps {
                    out.clear();
                    merge_heap(&b.ranks, &piece, &mut out);
                }
                out.len()
            });
            println!(
                "piece of {len:5} bytes: tiktoken-rs loop {:7.1} ns/byte, heap {:7.1} ns/byte",
                split * 1e9 / (reps * len) as f64,
                heap * 1e9 / (reps * len) as f64
            );
        }
        let text = match std::env::var_os("BPE_BENCH_TEXT") {
            Some(path) => std::fs::read_to_string(path).unwrap(),
            None => {
                let one = crate::data::builtin_text(crate::data::Split::Train);
                one.repeat((1 << 20) / one.len() + 1)
            }
        };
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let random: String = (0..1 << 20)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (b'a' + (x % 26) as u8) as char
            })
            .collect();
        for (name, text, old) in [
            ("normal text", text.as_str(), true),
            ("320 000 random letters", &random[..320_000], true),
            ("1 MiB of random letters", random.as_str(), false),
            ("1 MiB of 'a'", &"a".repeat(1 << 20), false),
        ] {
            let (t_new, ids) = best_of_3(|| new(text));
            let mut line = format!(
                "{name} ({} bytes, {} ids): new {t_new:.3} s",
                text.len(),
                ids.len()
            );
            if old {
                let (t_old, want) = best_of_3(|| core().encode_ordinary(text));
                assert!(ids == want, "{name}: the ids differ");
                line += &format!(", tiktoken-rs {t_old:.3} s");
            }
            println!("{line}");
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1024))]

        #[test]
        fn dense_texts_cut_exactly(text in dense_text()) {
            check_cuts(&text)?;
        }

        #[test]
        fn random_texts_cut_exactly(parts in prop::collection::vec(fragment(), 0..40)) {
            check_cuts(&parts.concat())?;
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn random_texts_match_tiktoken(parts in prop::collection::vec(fragment(), 0..40)) {
            let text = parts.concat();
            prop_assert_eq!(bpe().pieces(&text).collect::<Vec<_>>(), fancy_pieces(&text));
            let want = core().encode_ordinary(&text);
            for heap_above in [0, HEAP_ABOVE, usize::MAX] {
                prop_assert_eq!(&encode(&text, heap_above), &want, "heap above {}", heap_above);
            }
        }
    }
}

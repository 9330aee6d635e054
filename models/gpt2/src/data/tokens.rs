//! [`Tokens`]: a token stream in one or more segments, each held in memory
//! or memory-mapped from an llm.c token file.
//!
//! A mapped file costs no memory of the process's own: its pages are the
//! operating system's page cache, read when first touched (by the
//! trainer's vocabulary check at the start where the data is small enough
//! for one, else as the loader reaches them) and shared by every process
//! that maps the file (torchrun's ranks on one node). A mapped file must
//! not be truncated while in use (`tokenfile::map_token_file`). A stream
//! of several files (llm.c's shards, `fineweb_train_*.bin`) is their
//! concatenation, in order; a window may span two of them.

use std::borrow::Cow;
use std::ops::Range;
use std::sync::Arc;

use memmap2::Mmap;

/// Where a segment's tokens live.
#[derive(Debug)]
enum Store {
    Owned(Box<[u16]>),
    /// A mapped token file, whose `u16` are little-endian (mapped only on
    /// little-endian hosts), read as `u16`s from its start.
    Mapped(Mmap),
}

impl Store {
    fn as_slice(&self) -> &[u16] {
        match self {
            Store::Owned(t) => t,
            // The map starts page-aligned; an odd last byte is left out.
            Store::Mapped(map) => bytemuck::cast_slice(&map[..map.len() & !1]),
        }
    }
}

/// One contiguous run of tokens: `range` of a shared store.
#[derive(Debug, Clone)]
struct Segment {
    store: Arc<Store>,
    range: Range<usize>,
}

impl Segment {
    fn as_slice(&self) -> &[u16] {
        &self.store.as_slice()[self.range.clone()]
    }
}

/// A token stream: the concatenation of its segments. Cheap to clone, and
/// so are its slices and concatenations (the stores are shared, never
/// copied); rank threads share one.
#[derive(Debug, Clone)]
pub struct Tokens {
    segments: Arc<[Segment]>,
    /// `starts[i]`: the stream position of segment `i`'s first token.
    starts: Arc<[usize]>,
    len: usize,
}

impl Tokens {
    /// Tokens held in memory.
    pub fn owned(tokens: impl Into<Box<[u16]>>) -> Self {
        let tokens = tokens.into();
        let range = 0..tokens.len();
        Self::from_segments(vec![Segment {
            store: Arc::new(Store::Owned(tokens)),
            range,
        }])
    }

    /// Tokens `tokens` (as `u16` indices into the file) of a mapped llm.c
    /// token file, checked by the caller: whole `u16`s inside the map, a
    /// little-endian host.
    pub(super) fn mapped(map: Mmap, tokens: Range<usize>) -> Self {
        debug_assert!(cfg!(target_endian = "little") && tokens.end * 2 <= map.len());
        Self::from_segments(vec![Segment {
            store: Arc::new(Store::Mapped(map)),
            range: tokens,
        }])
    }

    /// The streams `parts`, one after another.
    pub fn concat(parts: impl IntoIterator<Item = Tokens>) -> Self {
        Self::from_segments(
            parts
                .into_iter()
                .flat_map(|p| p.segments.to_vec())
                .collect(),
        )
    }

    fn from_segments(segments: Vec<Segment>) -> Self {
        let segments: Vec<Segment> = segments
            .into_iter()
            .filter(|s| !s.range.is_empty())
            .collect();
        let mut starts = Vec::with_capacity(segments.len());
        let mut len = 0;
        for s in &segments {
            starts.push(len);
            len += s.range.len();
        }
        Tokens {
            segments: segments.into(),
            starts: starts.into(),
            len,
        }
    }

    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// How many segments (files, or their parts) the stream is made of.
    pub fn segment_count(&self) -> usize {
        self.segments.len()
    }

    /// The segments in order, each contiguous.
    pub fn segments(&self) -> impl Iterator<Item = &[u16]> {
        self.segments.iter().map(Segment::as_slice)
    }

    /// The tokens as one slice: borrowed where the stream is one segment,
    /// else copied.
    pub fn contiguous(&self) -> Cow<'_, [u16]> {
        match &*self.segments {
            [] => Cow::Borrowed(&[]),
            [one] => Cow::Borrowed(one.as_slice()),
            _ => Cow::Owned(self.segments().flatten().copied().collect()),
        }
    }

    /// Copies tokens `start .. start + out.len()` into `out`.
    ///
    /// # Panics
    ///
    /// If the range ends past [`len`](Self::len) (callers check first).
    pub fn read(&self, start: usize, out: &mut [u16]) {
        let end = start + out.len();
        assert!(end <= self.len, "tokens {start}..{end} of {}", self.len);
        // The segment holding `start`, then on across the boundaries.
        let mut i = self.starts.partition_point(|&s| s <= start).max(1) - 1;
        let (mut at, mut done) = (start, 0);
        while done < out.len() {
            let seg = self.segments[i].as_slice();
            let from = at - self.starts[i];
            let n = (seg.len() - from).min(out.len() - done);
            out[done..done + n].copy_from_slice(&seg[from..from + n]);
            (at, done, i) = (at + n, done + n, i + 1);
        }
    }

    /// Tokens `range` as a stream of their own, sharing the stores.
    ///
    /// # Panics
    ///
    /// If `range` is not within `0..len`.
    pub fn slice(&self, range: Range<usize>) -> Tokens {
        assert!(range.start <= range.end && range.end <= self.len);
        let segments = self
            .segments
            .iter()
            .zip(self.starts.iter())
            .filter_map(|(seg, &s)| {
                let (from, to) = (range.start.max(s), range.end.min(s + seg.range.len()));
                (from < to).then(|| Segment {
                    store: Arc::clone(&seg.store),
                    range: seg.range.start + from - s..seg.range.start + to - s,
                })
            })
            .collect();
        Self::from_segments(segments)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(lens: &[usize]) -> (Tokens, Vec<u16>) {
        let mut all = Vec::new();
        let streams: Vec<Tokens> = lens
            .iter()
            .map(|&n| {
                let part: Vec<u16> = (all.len()..all.len() + n).map(|x| x as u16).collect();
                all.extend_from_slice(&part);
                Tokens::owned(part)
            })
            .collect();
        (Tokens::concat(streams), all)
    }

    /// Every range of a stream of several segments (empty ones among them)
    /// reads what the concatenated tokens hold there.
    #[test]
    fn reads_across_segments_are_the_concatenation() {
        let (t, all) = parts(&[5, 0, 1, 7, 3]);
        assert_eq!((t.len(), t.segment_count()), (16, 4));
        assert_eq!(&*t.contiguous(), &all[..]);
        for start in 0..all.len() {
            for end in start..=all.len() {
                let mut out = vec![0; end - start];
                t.read(start, &mut out);
                assert_eq!(out, &all[start..end], "{start}..{end}");
                let s = t.slice(start..end);
                assert_eq!(&*s.contiguous(), &all[start..end], "{start}..{end}");
            }
        }
        let one = Tokens::owned(all.clone());
        assert!(matches!(one.contiguous(), Cow::Borrowed(_)));
        assert!(Tokens::concat([]).is_empty());
    }

    #[test]
    #[should_panic(expected = "tokens 10..17 of 16")]
    fn a_read_past_the_end_panics() {
        let (t, _) = parts(&[8, 8]);
        t.read(10, &mut [0; 7]);
    }
}

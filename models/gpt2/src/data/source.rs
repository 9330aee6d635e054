//! [`TokenSource`]: a token stream loaded from llm.c `.bin` files (one, or
//! shards named by a pattern), a text file, or the built-in corpus.

use std::borrow::Cow;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use crate::config::Gpt2Config;
use crate::data::builtin::{builtin_tokens, Split};
use crate::data::tokenfile::{
    has_token_magic, map_token_file, tokens_to_u16, write_token_file, TOKEN_FILE_HEADER_BYTES,
};
use crate::data::tokenizer::Tokenizer;
use crate::data::tokens::Tokens;
use crate::error::{Gpt2Error, Result};

/// A sequence of token ids with a name for error messages.
///
/// Tokens are stored as `u16` (the width of llm.c token files; every GPT-2 id
/// fits) in a shared [`Tokens`] stream, so rank threads of a data-parallel
/// run share one copy; token files are memory-mapped, not read in.
#[derive(Debug, Clone)]
pub struct TokenSource {
    tokens: Tokens,
    origin: String,
    /// The file [`open`](Self::open) read them from; `None` for tokens
    /// made in memory and the built-in corpus.
    path: Option<PathBuf>,
    /// Shards by a pattern (more than one file).
    shards: Option<Arc<Shards>>,
    /// The largest id, found by the first [`check_vocab`](Self::check_vocab)
    /// and shared by the clones (the ranks of a run), so that the
    /// trainer's check and every rank's loader scan the data once.
    largest: Arc<OnceLock<u16>>,
}

/// The files of shards by a pattern, as a [`TokenSource`] knows them.
#[derive(Debug)]
struct Shards {
    /// Their first and last files' canonical paths and their count
    /// ([`TokenSource::canonical_origin`]).
    canonical: String,
    /// Each file's first token in the stream, and the file (errors name a
    /// position in its file, not in the joined stream).
    files: Box<[(usize, PathBuf)]>,
}

impl TokenSource {
    /// Wraps tokens; `origin` names them in errors.
    pub fn from_tokens(tokens: impl Into<Box<[u16]>>, origin: impl Into<String>) -> Self {
        TokenSource {
            tokens: Tokens::owned(tokens),
            origin: origin.into(),
            path: None,
            shards: None,
            largest: Default::default(),
        }
    }

    /// Wraps `u32` ids; errors if one does not fit in 16 bits.
    pub fn from_ids(ids: &[u32], origin: impl Into<String>) -> Result<Self> {
        Ok(Self::from_tokens(tokens_to_u16(ids)?, origin))
    }

    /// Tokenizes text with GPT-2's BPE; each literal `<|endoftext|>` becomes the
    /// EOT token.
    pub fn from_text(text: &str, origin: impl Into<String>) -> Result<Self> {
        let ids = Tokenizer::gpt2()?.encode_with_eot(text);
        Self::from_ids(&ids, origin)
    }

    /// [`from_text`](Self::from_text) of bytes read from `path`, which must
    /// be UTF-8 (the error names the offset of the first byte that is not).
    pub fn from_text_bytes(bytes: &[u8], path: &Path, origin: impl Into<String>) -> Result<Self> {
        let text = std::str::from_utf8(bytes).map_err(|e| Gpt2Error::NotUtf8 {
            path: path.to_path_buf(),
            offset: e.valid_up_to(),
        })?;
        Self::from_text(text, origin)
    }

    /// One split of the built-in corpus (see [`crate::data::builtin`]).
    pub fn builtin(split: Split) -> Result<Self> {
        Ok(Self::from_tokens(builtin_tokens(split)?, split.origin()))
    }

    /// Loads a file: an llm.c token file when it starts with the token file magic
    /// number or its extension is `.bin` (so a `.bin` with a bad header is an
    /// error, not text), memory-mapped after its header is checked;
    /// otherwise UTF-8 text tokenized with GPT-2's BPE.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let origin = path.display().to_string();
        let mut src = match TokenFile::open(path)? {
            TokenFile::Tokens(tokens) => TokenSource {
                tokens,
                origin,
                path: None,
                shards: None,
                largest: Default::default(),
            },
            TokenFile::Text(bytes) => Self::from_text_bytes(&bytes, path, origin)?,
        };
        src.path = Some(path.to_path_buf());
        Ok(src)
    }

    /// The token files `pattern` names (a shell pattern: `*`, `?`, `[…]`),
    /// in the order of their names, as one stream: llm.c's shards
    /// (`fineweb_train_*.bin`), each mapped. An error names the pattern if
    /// it matches no file, and a file that is not a token file.
    pub fn open_shards(pattern: &str) -> Result<Self> {
        let bad = |reason: String| Gpt2Error::InvalidSetting {
            what: "token file pattern",
            reason,
        };
        // As a shell (and llm.c's Python `glob`) matches: `*` does not
        // take a leading dot.
        let options = glob::MatchOptions {
            require_literal_leading_dot: true,
            ..glob::MatchOptions::new()
        };
        let paths =
            glob::glob_with(pattern, options).map_err(|e| bad(format!("{pattern}: {e}")))?;
        let mut paths: Vec<PathBuf> =
            paths.collect::<std::result::Result<_, _>>().map_err(|e| {
                let path = e.path().to_path_buf();
                Gpt2Error::io("listing", &path, e.into())
            })?;
        paths.sort();
        if paths.is_empty() {
            return Err(bad(format!("{pattern} matches no file")));
        }
        let mut parts = Vec::with_capacity(paths.len());
        for p in &paths {
            match TokenFile::open(p)? {
                TokenFile::Tokens(t) => parts.push(t),
                TokenFile::Text(_) => {
                    return Err(bad(format!(
                        "{pattern} matches {}, which is not an llm.c token file (shards are \
                         .bin token files; tokenize a text with `braid-gpt2 tokenize`)",
                        p.display()
                    )))
                }
            }
        }
        let canonical = |p: &Path| {
            std::fs::canonicalize(p)
                .unwrap_or_else(|_| p.to_path_buf())
                .display()
                .to_string()
        };
        let n = paths.len();
        let mut start = 0;
        let files: Box<[(usize, PathBuf)]> = parts
            .iter()
            .zip(&paths)
            .map(|(t, p)| {
                let first = start;
                start += t.len();
                (first, p.clone())
            })
            .collect();
        Ok(TokenSource {
            tokens: Tokens::concat(parts),
            origin: match n {
                1 => paths[0].display().to_string(),
                n => format!("{pattern} ({n} files)"),
            },
            path: (n == 1).then(|| paths[0].clone()),
            shards: (n > 1).then(|| {
                Arc::new(Shards {
                    canonical: format!(
                        "{} ... {} ({n} files)",
                        canonical(&paths[0]),
                        canonical(&paths[n - 1])
                    ),
                    files,
                })
            }),
            largest: Default::default(),
        })
    }

    /// [`open`](Self::open), then [`check_vocab`](Self::check_vocab) against `cfg`.
    pub fn open_for(path: impl AsRef<Path>, cfg: &Gpt2Config) -> Result<Self> {
        let src = Self::open(path)?;
        src.check_vocab(cfg.vocab_size)?;
        Ok(src)
    }

    /// Resolves a command-line data argument: `builtin` or `builtin:train` for the
    /// built-in training split, `builtin:val` for its validation split, otherwise
    /// a path for [`open`](Self::open).
    /// A path with a pattern's characters (`*`, `?`, `[`) that names no
    /// file is a pattern ([`open_shards`](Self::open_shards)).
    pub fn resolve(spec: &str) -> Result<Self> {
        match spec {
            "builtin" | "builtin:train" => Self::builtin(Split::Train),
            "builtin:val" => Self::builtin(Split::Val),
            path if spec.contains(['*', '?', '[']) && !Path::new(path).exists() => {
                Self::open_shards(path)
            }
            path => Self::open(path),
        }
    }

    /// Checks every id is `< vocab_size`; the error names the first id that is
    /// not, its position and where the tokens came from.
    pub fn check_vocab(&self, vocab_size: usize) -> Result<()> {
        let largest = *self.largest.get_or_init(|| {
            let most = |seg: &[u16]| seg.iter().copied().max();
            self.tokens.segments().filter_map(most).max().unwrap_or(0)
        });
        if usize::from(largest) < vocab_size {
            return Ok(());
        }
        // Only to name the first id that does not fit: by its place in its
        // file, for shards.
        let mut at = 0;
        for seg in self.tokens.segments() {
            check_run(&self.origin, seg, at, vocab_size).map_err(|e| self.in_file(e))?;
            at += seg.len();
        }
        Ok(())
    }

    /// `e` with a position in the joined stream of shards as the file and
    /// the position in it.
    fn in_file(&self, e: Gpt2Error) -> Gpt2Error {
        match (e, &self.shards) {
            (
                Gpt2Error::TokenOutOfRange {
                    origin,
                    position,
                    id,
                    vocab_size,
                },
                Some(shards),
            ) => {
                let files = &shards.files;
                let i = files.partition_point(|(first, _)| *first <= position);
                let (first, path) = &files[i.saturating_sub(1)];
                Gpt2Error::TokenOutOfRange {
                    origin: format!("{} ({origin})", path.display()),
                    position: position - first,
                    id,
                    vocab_size,
                }
            }
            (e, _) => e,
        }
    }

    /// The tokens.
    pub fn tokens(&self) -> Cow<'_, [u16]> {
        self.tokens.contiguous()
    }

    /// The shared token stream (no copy).
    pub fn stream(&self) -> Tokens {
        self.tokens.clone()
    }

    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Whether there are no tokens.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Where the tokens came from (a path, `builtin:train`, ...).
    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// [`origin`](Self::origin) as one name however the file was named: a
    /// file [`open`](Self::open) read is known by its canonical path while
    /// it exists (`t.bin`, `./t.bin` and `/abs/t.bin` alike, links
    /// followed); shards by a pattern by their first and last files'
    /// canonical paths and their count; other tokens (the built-in corpus,
    /// tokens made in memory), or a file gone since, by the origin as
    /// given.
    pub fn canonical_origin(&self) -> String {
        if let Some(shards) = &self.shards {
            return shards.canonical.clone();
        }
        self.path
            .as_deref()
            .and_then(|p| std::fs::canonicalize(p).ok())
            .map_or_else(|| self.origin.clone(), |p| p.display().to_string())
    }

    /// Splits off the last `fraction` of the tokens (at least one token on each
    /// side when there are two or more) as a validation set: `(train, val)`.
    pub fn split_tail(&self, fraction: f64) -> (TokenSource, TokenSource) {
        let n = self.tokens.len();
        let mut k = ((n as f64) * fraction.clamp(0.0, 1.0)).round() as usize;
        if n >= 2 {
            k = k.clamp(1, n - 1);
        }
        let cut = n - k;
        (
            self.sliced(0..cut, format!("{}[train]", self.origin)),
            self.sliced(cut..n, format!("{}[val]", self.origin)),
        )
    }

    /// Writes the tokens as an llm.c token file (atomically).
    pub fn save_bin(&self, path: impl AsRef<Path>) -> Result<()> {
        write_token_file(path, &self.tokens.contiguous())
    }

    /// Tokens `range`, named `origin` (sharing the storage); an error if
    /// the range is not within the tokens. (`part(0..n·T + 1)` is what
    /// `eval --windows n` scores.)
    pub fn part(
        &self,
        range: std::ops::Range<usize>,
        origin: impl Into<String>,
    ) -> Result<TokenSource> {
        if range.start > range.end || range.end > self.len() {
            return Err(Gpt2Error::InvalidSetting {
                what: "token range",
                reason: format!(
                    "{range:?} is not within the {} tokens of {}",
                    self.len(),
                    self.origin
                ),
            });
        }
        Ok(self.sliced(range, origin))
    }

    /// [`part`](Self::part) of a range known to be within the tokens.
    fn sliced(&self, range: std::ops::Range<usize>, origin: impl Into<String>) -> TokenSource {
        TokenSource {
            tokens: self.tokens.slice(range),
            origin: origin.into(),
            path: None,
            shards: None,
            largest: Default::default(),
        }
    }
}

/// Checks that every id of `run`, tokens `at..` of the data `origin`
/// names, is `< vocab_size`; the error names the first that is not and
/// its position in the data.
pub(super) fn check_run(origin: &str, run: &[u16], at: usize, vocab_size: usize) -> Result<()> {
    match run.iter().position(|&t| usize::from(t) >= vocab_size) {
        None => Ok(()),
        Some(i) => Err(Gpt2Error::TokenOutOfRange {
            origin: origin.to_string(),
            position: at + i,
            id: u32::from(run[i]),
            vocab_size,
        }),
    }
}

/// What a file holds: the (mapped) tokens of an llm.c token file, or the
/// bytes of anything else, a text.
enum TokenFile {
    Tokens(Tokens),
    Text(Vec<u8>),
}

impl TokenFile {
    /// A token file when it starts with the magic number or is named
    /// `.bin` (so a `.bin` with a bad header is an error, not text).
    fn open(path: &Path) -> Result<Self> {
        let io = |e| Gpt2Error::io("reading", path, e);
        let file = std::fs::File::open(path).map_err(io)?;
        let file_len = file.metadata().map_err(io)?.len();
        let mut head = Vec::with_capacity(TOKEN_FILE_HEADER_BYTES);
        (&file)
            .take(TOKEN_FILE_HEADER_BYTES as u64)
            .read_to_end(&mut head)
            .map_err(io)?;
        let is_bin = path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("bin"));
        if has_token_magic(&head) || is_bin {
            let len = usize::try_from(file_len).unwrap_or(usize::MAX);
            Ok(TokenFile::Tokens(map_token_file(path, &file, &head, len)?))
        } else {
            let mut bytes = head;
            (&file).read_to_end(&mut bytes).map_err(io)?;
            Ok(TokenFile::Text(bytes))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The first check finds the largest id for every clone (the ranks);
    /// a later check that fails still names the first id that does not
    /// fit; a part of the tokens finds its own.
    #[test]
    fn the_vocabulary_is_checked_in_one_scan() {
        let src = TokenSource::from_tokens(vec![3u16, 9, 4, 9, 1], "t.bin");
        let rank = src.clone();
        src.check_vocab(10).unwrap();
        assert_eq!(rank.largest.get(), Some(&9));
        rank.check_vocab(10).unwrap();
        match rank.check_vocab(9) {
            Err(Gpt2Error::TokenOutOfRange {
                position: 1, id: 9, ..
            }) => {}
            other => panic!("{other:?}"),
        }
        let part = src.part(2..3, "t.bin[2..3]").unwrap();
        assert_eq!(part.largest.get(), None);
        part.check_vocab(5).unwrap();
        assert_eq!(part.largest.get(), Some(&4));
        let empty = TokenSource::from_tokens(Vec::<u16>::new(), "none");
        empty.check_vocab(1).unwrap();
    }
}

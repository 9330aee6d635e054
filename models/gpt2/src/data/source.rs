//! [`TokenSource`]: a token stream loaded from an llm.c `.bin` file, a text
//! file, or the built-in corpus.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::config::Gpt2Config;
use crate::data::builtin::{builtin_tokens, Split};
use crate::data::tokenfile::{has_token_magic, parse_token_file, tokens_to_u16, write_token_file};
use crate::data::tokenizer::Tokenizer;
use crate::error::{Gpt2Error, Result};

/// A sequence of token ids with a name for error messages.
///
/// Tokens are stored as `u16` (the width of llm.c token files; every GPT-2 id
/// fits) behind an `Arc`, so rank threads of a data-parallel run share one copy.
#[derive(Debug, Clone)]
pub struct TokenSource {
    tokens: Arc<[u16]>,
    origin: String,
    /// The file [`open`](Self::open) read them from; `None` for tokens
    /// made in memory and the built-in corpus.
    path: Option<PathBuf>,
}

impl TokenSource {
    /// Wraps tokens; `origin` names them in errors.
    pub fn from_tokens(tokens: impl Into<Arc<[u16]>>, origin: impl Into<String>) -> Self {
        TokenSource {
            tokens: tokens.into(),
            origin: origin.into(),
            path: None,
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
    /// error, not text), otherwise UTF-8 text tokenized with GPT-2's BPE.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|e| Gpt2Error::io("reading", path, e))?;
        let origin = path.display().to_string();
        let is_bin = path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("bin"));
        let mut src = if has_token_magic(&bytes) || is_bin {
            // Into the shared storage at once: a `Vec` first would be one
            // more copy of the tokens at the peak (`Arc<[u16]>` from an
            // iterator of known length allocates once).
            let tokens: Arc<[u16]> = parse_token_file(path, &bytes)?;
            drop(bytes);
            Self::from_tokens(tokens, origin)
        } else {
            Self::from_text_bytes(&bytes, path, origin)?
        };
        src.path = Some(path.to_path_buf());
        Ok(src)
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
    pub fn resolve(spec: &str) -> Result<Self> {
        match spec {
            "builtin" | "builtin:train" => Self::builtin(Split::Train),
            "builtin:val" => Self::builtin(Split::Val),
            path => Self::open(path),
        }
    }

    /// Checks every id is `< vocab_size`; the error names the first id that is
    /// not, its position and where the tokens came from.
    pub fn check_vocab(&self, vocab_size: usize) -> Result<()> {
        match self
            .tokens
            .iter()
            .position(|&t| usize::from(t) >= vocab_size)
        {
            None => Ok(()),
            Some(position) => Err(Gpt2Error::TokenOutOfRange {
                origin: self.origin.clone(),
                position,
                id: u32::from(self.tokens[position]),
                vocab_size,
            }),
        }
    }

    /// The tokens.
    pub fn tokens(&self) -> &[u16] {
        &self.tokens
    }

    /// The shared token storage (no copy).
    pub fn shared(&self) -> Arc<[u16]> {
        Arc::clone(&self.tokens)
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
    /// followed); other tokens (the built-in corpus, tokens made in
    /// memory), or a file gone since, by the origin as given.
    pub fn canonical_origin(&self) -> String {
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
            Self::from_tokens(&self.tokens[..cut], format!("{}[train]", self.origin)),
            Self::from_tokens(&self.tokens[cut..], format!("{}[val]", self.origin)),
        )
    }

    /// Writes the tokens as an llm.c token file (atomically).
    pub fn save_bin(&self, path: impl AsRef<Path>) -> Result<()> {
        write_token_file(path, &self.tokens)
    }
}

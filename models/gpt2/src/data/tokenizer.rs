//! GPT-2's byte-level BPE tokenizer (`r50k_base`), through `tiktoken-rs`.
//!
//! The vocabulary and merges are compiled into `tiktoken-rs` (`include_str!` of
//! its `assets/r50k_base.tiktoken`), so building the tokenizer never touches the
//! network or the filesystem. It is built once per process and shared.

use std::sync::OnceLock;

use tiktoken_rs::CoreBPE;

use crate::error::{Gpt2Error, Result};

/// GPT-2's `<|endoftext|>` token id.
pub const EOT: u32 = 50256;

/// The literal text of the end-of-text token.
pub const EOT_TEXT: &str = "<|endoftext|>";

/// Number of tokens in GPT-2's vocabulary (50 000 merges + 256 bytes + EOT).
pub const GPT2_VOCAB_SIZE: usize = 50257;

/// A handle on the shared GPT-2 tokenizer. Cheap to copy.
#[derive(Clone, Copy)]
pub struct Tokenizer {
    bpe: &'static CoreBPE,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("encoding", &"r50k_base")
            .field("vocab_size", &GPT2_VOCAB_SIZE)
            .finish()
    }
}

static BPE: OnceLock<std::result::Result<CoreBPE, String>> = OnceLock::new();

impl Tokenizer {
    /// The GPT-2 tokenizer. The first call builds it (a fraction of a second);
    /// later calls return the same instance.
    pub fn gpt2() -> Result<Self> {
        let built = BPE.get_or_init(|| tiktoken_rs::r50k_base().map_err(|e| e.to_string()));
        match built {
            Ok(bpe) => Ok(Tokenizer { bpe }),
            Err(message) => Err(Gpt2Error::Tokenizer {
                message: format!("building r50k_base: {message}"),
            }),
        }
    }

    /// Vocabulary size (50257).
    pub fn vocab_size(&self) -> usize {
        GPT2_VOCAB_SIZE
    }

    /// The end-of-text token id (50256).
    pub fn eot(&self) -> u32 {
        EOT
    }

    /// Encodes text as ordinary text: `<|endoftext|>` in the input is spelled out
    /// as the characters it consists of, never turned into [`EOT`].
    pub fn encode(&self, text: &str) -> Vec<u32> {
        self.bpe.encode_ordinary(text)
    }

    /// Encodes text, turning each literal `<|endoftext|>` into the [`EOT`] token
    /// (the usual document separator in GPT-2 training text).
    pub fn encode_with_eot(&self, text: &str) -> Vec<u32> {
        let mut out = Vec::new();
        for (i, piece) in text.split(EOT_TEXT).enumerate() {
            if i > 0 {
                out.push(EOT);
            }
            out.extend(self.bpe.encode_ordinary(piece));
        }
        out
    }

    /// Decodes tokens to bytes. Errors name the first id outside the vocabulary
    /// and its position.
    pub fn decode_bytes(&self, ids: &[u32]) -> Result<Vec<u8>> {
        check_ids(ids, GPT2_VOCAB_SIZE, "decode")?;
        let mut out = Vec::with_capacity(ids.len() * 4);
        for piece in self.bpe._decode_native_and_split(ids.to_vec()) {
            out.extend_from_slice(&piece);
        }
        Ok(out)
    }

    /// Decodes tokens to text. A sequence cut in the middle of a multi-byte
    /// character (easy with sampled tokens) yields U+FFFD for the broken part
    /// rather than an error.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        let bytes = self.decode_bytes(ids)?;
        Ok(match String::from_utf8(bytes) {
            Ok(s) => s,
            Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
        })
    }

    /// Decodes one token (for streaming sampled text).
    pub fn decode_one(&self, id: u32) -> Result<String> {
        self.decode(&[id])
    }
}

/// Checks that every id is below `vocab_size`; the error names the first id
/// that is not, its position, and `origin`.
pub fn check_ids(ids: &[u32], vocab_size: usize, origin: &str) -> Result<()> {
    match ids.iter().position(|&id| id as usize >= vocab_size) {
        None => Ok(()),
        Some(position) => Err(Gpt2Error::TokenOutOfRange {
            origin: origin.to_string(),
            position,
            id: ids[position],
            vocab_size,
        }),
    }
}

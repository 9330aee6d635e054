//! GPT-2's byte-level BPE tokenizer (`r50k_base`), through `tiktoken-rs`.
//!
//! The vocabulary and merges are compiled into `tiktoken-rs` (`include_str!` of
//! its `assets/r50k_base.tiktoken`), so building the tokenizer never touches the
//! network or the filesystem. It is built once per process and shared.
//!
//! Decoding goes through `tiktoken-rs`; encoding through `data/bpe.rs`, which
//! gives the same ids in O(n log n) where `tiktoken-rs` is quadratic (a long
//! run of letters without spaces), and also encodes the runs of about a
//! million letters, digits or spaces `tiktoken-rs` panics on. A text of more
//! than a MiB is cut into chunks encoded on all available threads, only where
//! that leaves the ids as they are.

use std::sync::OnceLock;

use tiktoken_rs::CoreBPE;

use crate::data::bpe::{encode_in_parts, parts_for, Bpe};
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
    /// Decoding (and the vocabulary `enc` was read from).
    bpe: &'static CoreBPE,
    /// Encoding.
    enc: &'static Bpe,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("encoding", &"r50k_base")
            .field("vocab_size", &GPT2_VOCAB_SIZE)
            .finish()
    }
}

type Built = std::result::Result<(CoreBPE, Bpe), String>;

static BPE: OnceLock<Built> = OnceLock::new();

impl Tokenizer {
    /// The GPT-2 tokenizer. The first call builds it (a fraction of a second);
    /// later calls return the same instance.
    pub fn gpt2() -> Result<Self> {
        let built = BPE.get_or_init(|| {
            let core = tiktoken_rs::r50k_base().map_err(|e| e.to_string())?;
            let enc = Bpe::new(&core, EOT)?;
            Ok((core, enc))
        });
        match built {
            Ok((bpe, enc)) => Ok(Tokenizer { bpe, enc }),
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
    ///
    /// A text of more than a MiB is encoded on all available threads, with
    /// the same ids (see `data/bpe.rs`).
    pub fn encode(&self, text: &str) -> Vec<u32> {
        self.encode_in_parts(text, parts_for(text.len()), false)
    }

    /// Encodes text, turning each literal `<|endoftext|>` into the [`EOT`] token
    /// (the usual document separator in GPT-2 training text).
    ///
    /// A text of more than a MiB is encoded on all available threads, with
    /// the same ids: it is cut only before whitespace, which
    /// `<|endoftext|>` holds none of, so each literal lies whole in one
    /// chunk, and the text between two of them is cut only where its
    /// ordinary encoding may be.
    pub fn encode_with_eot(&self, text: &str) -> Vec<u32> {
        self.encode_in_parts(text, parts_for(text.len()), true)
    }

    /// [`encode`](Self::encode) (or [`encode_with_eot`](Self::encode_with_eot)
    /// when `eot`), in about `parts` chunks on as many threads.
    fn encode_in_parts(&self, text: &str, parts: usize, eot: bool) -> Vec<u32> {
        let enc = self.enc;
        if !eot {
            return encode_in_parts(text, parts, |chunk, out| enc.encode_ordinary(chunk, out));
        }
        encode_in_parts(text, parts, |chunk, out| {
            for (i, piece) in chunk.split(EOT_TEXT).enumerate() {
                if i > 0 {
                    out.push(EOT);
                }
                enc.encode_ordinary(piece, out);
            }
        })
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

    /// Decodes one token alone. A character spread over several tokens
    /// (most emoji, many CJK characters) comes out as U+FFFD this way: text
    /// streamed token by token goes through a [`TextStream`] instead.
    pub fn decode_one(&self, id: u32) -> Result<String> {
        self.decode(&[id])
    }

    /// A decoder of tokens that arrive one at a time (sampled text).
    pub fn stream(&self) -> TextStream {
        TextStream {
            tok: *self,
            pending: Vec::new(),
        }
    }
}

/// Decodes tokens as they arrive, into text that can be written at once.
///
/// GPT-2's tokens are byte sequences, and one character may be spread over
/// several of them: a token's bytes that end in the middle of a character
/// are kept until the tokens after them complete it. Bytes that can never
/// form a character (an invalid sequence) come out as U+FFFD as soon as
/// that is known, and whatever is still pending at the end comes out, as
/// U+FFFD, from [`finish`](Self::finish): nothing is held back for good.
#[derive(Debug)]
pub struct TextStream {
    tok: Tokenizer,
    /// Bytes of an incomplete character (at most 3).
    pending: Vec<u8>,
}

impl TextStream {
    /// The text `id` completes: the characters whose last byte it holds,
    /// after any pending ones. An id outside GPT-2's vocabulary (a model
    /// with a bigger one) has no text: it comes out as `<id>`, after the
    /// pending bytes (which it cannot complete).
    pub fn push(&mut self, id: u32) -> String {
        match self.tok.decode_bytes(&[id]) {
            Ok(bytes) => self.push_bytes(&bytes),
            Err(_) => {
                let mut s = self.finish();
                s.push_str(&format!("<{id}>"));
                s
            }
        }
    }

    /// The text `bytes` complete (see [`push`](Self::push)).
    pub fn push_bytes(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    return out;
                }
                Err(e) => {
                    let good = e.valid_up_to();
                    // The prefix is valid UTF-8 (`valid_up_to`).
                    out.push_str(&String::from_utf8_lossy(&self.pending[..good]));
                    match e.error_len() {
                        // An incomplete character at the end: wait for
                        // the bytes that complete it.
                        None => {
                            self.pending.drain(..good);
                            return out;
                        }
                        // Bytes no later ones can complete.
                        Some(bad) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            self.pending.drain(..good + bad);
                        }
                    }
                }
            }
        }
    }

    /// What is still pending, as U+FFFD (the text ended in the middle of a
    /// character); empty when nothing is.
    pub fn finish(&mut self) -> String {
        let s = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        s
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::bpe::tests::dense_text;
    use proptest::prelude::*;

    /// Encoding gives `tiktoken-rs`'s ids (data::bpe checks this at
    /// length), with a literal `<|endoftext|>` as EOT when asked.
    #[test]
    fn encoding_matches_tiktoken() {
        let tok = Tokenizer::gpt2().unwrap();
        let text = "First.<|endoftext|>Second, it's <|endoftext|><|endoftext|> 日本 \n\n";
        assert_eq!(tok.encode(text), tok.bpe.encode_ordinary(text));
        let with_eot = tok.encode_with_eot(text);
        assert_eq!(with_eot, tok.bpe.encode_with_special_tokens(text));
        assert_eq!(with_eot.iter().filter(|&&t| t == EOT).count(), 3);
        assert_eq!(tok.decode(&with_eot).unwrap(), text);
    }

    /// A character spread over several tokens comes out whole, once its
    /// last token is in, and not before.
    #[test]
    fn a_character_split_over_tokens_streams_whole() {
        let tok = Tokenizer::gpt2().unwrap();
        let text = "a🦀b 日本語";
        let ids = tok.encode(text);
        let crab = tok.encode("🦀");
        assert!(crab.len() > 1, "🦀 is {crab:?}: one token");
        // Token by token alone, the crab is broken (what `sample` printed).
        assert!(crab
            .iter()
            .any(|&t| tok.decode_one(t).unwrap().contains('\u{fffd}')));
        let mut s = tok.stream();
        let pieces: Vec<String> = ids.iter().map(|&t| s.push(t)).collect();
        assert_eq!(s.finish(), "");
        assert_eq!(pieces.concat(), text);
        // The crab's first tokens give nothing; its last gives it whole.
        let mut s = tok.stream();
        let (last, first) = crab.split_last().unwrap();
        for &t in first {
            assert_eq!(s.push(t), "");
        }
        assert_eq!(s.push(*last), "🦀");
    }

    /// Bytes that never form a character come out as U+FFFD: at once when
    /// a later byte shows they cannot, at the end otherwise; an id outside
    /// the vocabulary comes out as `<id>`, after what was pending.
    #[test]
    fn invalid_sequences_still_come_out() {
        let tok = Tokenizer::gpt2().unwrap();
        let mut s = tok.stream();
        // The first two bytes of a four-byte character, then `a`.
        assert_eq!(s.push_bytes(&[0xF0, 0x9F]), "");
        assert_eq!(s.push_bytes(b"a"), "\u{fffd}a");
        // A byte that starts nothing.
        assert_eq!(s.push_bytes(&[b'x', 0xFF, b'y']), "x\u{fffd}y");
        // Cut at the end.
        assert_eq!(s.push_bytes(&[b'z', 0xE6, 0x97]), "z");
        assert_eq!(s.finish(), "\u{fffd}");
        assert_eq!(s.finish(), "");
        assert_eq!(s.push_bytes(&[0xE6]), "");
        assert_eq!(s.push(GPT2_VOCAB_SIZE as u32), "\u{fffd}<50257>");
        assert_eq!(s.push(tok.encode(" the")[0]), " the");
    }

    /// Both encodings of `text` in 2, 3, 7 and as many chunks as bytes are
    /// those on one thread, which are `tiktoken-rs`'s.
    fn check_parts(tok: &Tokenizer, text: &str) -> std::result::Result<(), TestCaseError> {
        let plain = tok.encode_in_parts(text, 1, false);
        let eot = tok.encode_in_parts(text, 1, true);
        prop_assert_eq!(&plain, &tok.bpe.encode_ordinary(text));
        prop_assert_eq!(&eot, &tok.bpe.encode_with_special_tokens(text));
        for parts in [2, 3, 7, text.len()] {
            prop_assert_eq!(
                &tok.encode_in_parts(text, parts, false),
                &plain,
                "{} parts",
                parts
            );
            prop_assert_eq!(
                &tok.encode_in_parts(text, parts, true),
                &eot,
                "{} parts, EOT",
                parts
            );
        }
        Ok(())
    }

    /// `<|endoftext|>` next to whitespace, where chunks may start or end.
    #[test]
    fn end_of_text_around_cuts() {
        let tok = Tokenizer::gpt2().unwrap();
        for text in [
            "<|endoftext|>",
            "a<|endoftext|>\nb",
            "a\n<|endoftext|>b",
            "a <|endoftext|> b\n\n<|endoftext|><|endoftext|>\n",
            "x\n<|endoftext|>\n's\n<|endoftext|",
        ] {
            check_parts(&tok, text).unwrap();
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn texts_encode_alike_in_parts(text in dense_text()) {
            check_parts(&Tokenizer::gpt2().unwrap(), &text)?;
        }
    }

    /// Encoding speed on one thread and on all of them (the ids must
    /// agree), of the file `BPE_BENCH_TEXT` names (else the built-in
    /// corpus) repeated to at least 20 MB. Prints; a measurement, not a
    /// test.
    ///
    /// `BPE_BENCH_TEXT=corpus.txt cargo test --release -p braid-gpt2 --lib parallel_timings -- --ignored --nocapture`
    #[test]
    #[ignore]
    fn parallel_timings() {
        // CPU time of the whole process, all threads, in seconds.
        fn cpu_seconds() -> f64 {
            let mut t = libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            };
            // SAFETY: `t` is a valid timespec to write to.
            let rc = unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut t) };
            assert_eq!(rc, 0);
            t.tv_sec as f64 + t.tv_nsec as f64 * 1e-9
        }
        let tok = Tokenizer::gpt2().unwrap();
        let one = match std::env::var_os("BPE_BENCH_TEXT") {
            Some(path) => std::fs::read_to_string(path).unwrap(),
            None => crate::data::builtin_text(crate::data::Split::Train),
        };
        let text = one.repeat((20 << 20) / one.len().max(1) + 1);
        let mb = text.len() as f64 / 1e6;
        let time = |parts: usize| {
            let (mut wall, mut cpu) = (f64::INFINITY, f64::INFINITY);
            let mut ids = Vec::new();
            for _ in 0..3 {
                let (t, c) = (std::time::Instant::now(), cpu_seconds());
                ids = std::hint::black_box(tok.encode_in_parts(&text, parts, true));
                wall = wall.min(t.elapsed().as_secs_f64());
                cpu = cpu.min(cpu_seconds() - c);
            }
            println!(
                "{parts:3} chunks: {:6.1} MB/s ({wall:.2} s), CPU time {cpu:.2} s",
                mb / wall
            );
            ids
        };
        let threads = parts_for(text.len());
        println!("{mb:.1} MB, {threads} threads available");
        let want = time(1);
        for parts in std::iter::once(2).chain((threads > 2).then_some(threads)) {
            assert!(time(parts) == want, "{parts} chunks: the ids differ");
        }
        println!("{} ids", want.len());
    }
}

//! Training data: GPT-2's tokenizer, llm.c token files, text files, a built-in
//! corpus, and the sharded data-parallel loader.
//!
//! ```text
//! tokenizer  r50k_base BPE (vocabulary compiled in, no download), EOT = 50256
//! bpe        its encoding: tiktoken-rs's ids, O(n log n) in a long piece
//! tokenfile  llm.c .bin: 256 x int32 header (magic, version, count) + uint16 tokens
//! builtin    a generated English corpus, train and val splits, no file needed
//! tokens     Tokens: a stream of segments, in memory or memory-mapped files
//! source     TokenSource: .bin (one, or shards by pattern) | text | builtin, vocabulary check
//! loader     DataLoader (B x T batches, rank/world sharding, resumable), eval windows
//! ```

mod bpe;
pub mod builtin;
pub mod loader;
pub mod source;
pub mod tokenfile;
pub mod tokenizer;
pub mod tokens;

pub use builtin::{builtin_text, builtin_tokens, Split};
pub use loader::{eval_windows, Batch, DataLoader, EvalWindow, EvalWindows, LoaderState};
pub use source::TokenSource;
pub use tokenfile::{
    read_token_file, tokens_to_u16, write_token_file, TOKEN_FILE_HEADER_BYTES,
    TOKEN_FILE_HEADER_INTS, TOKEN_FILE_MAGIC, TOKEN_FILE_VERSION,
};
pub use tokenizer::{check_ids, TextStream, Tokenizer, EOT, EOT_TEXT, GPT2_VOCAB_SIZE};
pub use tokens::Tokens;

//! llm.c token files (`.bin`).
//!
//! Layout (all little-endian): a header of 256 `int32` — `[0]` the magic number
//! 20240520, `[1]` the version 1, `[2]` the token count, the rest zero — followed
//! by exactly that many `uint16` tokens. These are the files llm.c's
//! `dev/data/*.py` scripts write (tinyshakespeare, fineweb, ...).

use std::path::Path;

use braid::fs::write_atomic;

use crate::error::{Gpt2Error, Result};

/// First `int32` of every llm.c token file.
pub const TOKEN_FILE_MAGIC: i32 = 20240520;
/// The token file version this crate reads and writes.
pub const TOKEN_FILE_VERSION: i32 = 1;
/// Number of `int32` in the header.
pub const TOKEN_FILE_HEADER_INTS: usize = 256;
/// Size of the header in bytes.
pub const TOKEN_FILE_HEADER_BYTES: usize = TOKEN_FILE_HEADER_INTS * 4;

fn header_int(bytes: &[u8], i: usize) -> i32 {
    i32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().expect("4 bytes"))
}

/// Whether `bytes` (the start of a file) begin with the token file magic number.
pub fn has_token_magic(bytes: &[u8]) -> bool {
    bytes.len() >= 4 && header_int(bytes, 0) == TOKEN_FILE_MAGIC
}

/// Parses the bytes of a token file; `path` only names the file in errors.
pub fn parse_token_file<C: FromIterator<u16>>(path: &Path, bytes: &[u8]) -> Result<C> {
    token_count(path, bytes, bytes.len())?;
    Ok(bytes[TOKEN_FILE_HEADER_BYTES..]
        .chunks_exact(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]))
        .collect())
}

/// The token count of a token file of `file_len` bytes whose first bytes
/// (the header's, or all of a shorter file's) are `head`, checked: magic,
/// version, and exactly that many tokens after the header.
fn token_count(path: &Path, bytes: &[u8], file_len: usize) -> Result<usize> {
    if bytes.len() >= 4 && !has_token_magic(bytes) {
        return Err(Gpt2Error::BadMagic {
            path: path.to_path_buf(),
            found: header_int(bytes, 0),
            expected: TOKEN_FILE_MAGIC,
        });
    }
    // `bytes` falls short of a header the length promised only if the
    // file shrank in between: then it is short.
    let len = file_len.min(bytes.len());
    if len < TOKEN_FILE_HEADER_BYTES {
        return Err(Gpt2Error::BadTokenHeader {
            path: path.to_path_buf(),
            reason: format!(
                "the file is {len} bytes, shorter than the {TOKEN_FILE_HEADER_BYTES}-byte header"
            ),
        });
    }
    let version = header_int(bytes, 1);
    if version != TOKEN_FILE_VERSION {
        return Err(Gpt2Error::BadVersion {
            path: path.to_path_buf(),
            found: version,
            expected: TOKEN_FILE_VERSION,
        });
    }
    let count = header_int(bytes, 2);
    if count < 0 {
        return Err(Gpt2Error::BadTokenHeader {
            path: path.to_path_buf(),
            reason: format!("negative token count {count}"),
        });
    }
    let declared = count as usize;
    let body = file_len - TOKEN_FILE_HEADER_BYTES;
    let found = body / 2;
    if found < declared {
        return Err(Gpt2Error::TruncatedTokenFile {
            path: path.to_path_buf(),
            declared,
            found,
        });
    }
    if body > declared * 2 {
        return Err(Gpt2Error::TrailingTokenData {
            path: path.to_path_buf(),
            declared,
            extra_bytes: body - declared * 2,
        });
    }
    Ok(declared)
}

/// The tokens of the token file `file` (at `path`, named in errors), whose
/// first bytes are `head` and length `file_len`, checked as
/// [`parse_token_file`] checks them, and memory-mapped
/// ([`Tokens`](super::tokens::Tokens)); read into memory on a big-endian
/// host.
///
/// The file must not be truncated or rewritten in place while the tokens
/// are in use: a read of a truncated map raises SIGBUS, which ends the
/// process (`braid-gpt2` says why first). Braid's own writes replace files
/// whole (a new file renamed over the old, which the map does not see);
/// llm.c's scripts rewrite theirs in place (`open(name, "wb")`).
pub(super) fn map_token_file(
    path: &Path,
    file: &std::fs::File,
    head: &[u8],
    file_len: usize,
) -> Result<super::tokens::Tokens> {
    let count = token_count(path, head, file_len)?;
    if count == 0 || cfg!(target_endian = "big") {
        let bytes = std::fs::read(path).map_err(|e| Gpt2Error::io("reading", path, e))?;
        let tokens: Vec<u16> = parse_token_file(path, &bytes)?;
        return Ok(super::tokens::Tokens::owned(tokens));
    }
    // SAFETY: the map is read only as `u16`s, which any bytes are; what the
    // mapping requires of the file (not truncated while mapped) is the
    // contract documented above.
    let map = unsafe { memmap2::Mmap::map(file) }.map_err(|e| Gpt2Error::io("mapping", path, e))?;
    if map.len() != file_len {
        return Err(Gpt2Error::io(
            "mapping",
            path,
            std::io::Error::other("the file changed size while it was opened"),
        ));
    }
    let first = TOKEN_FILE_HEADER_BYTES / 2;
    Ok(super::tokens::Tokens::mapped(map, first..first + count))
}

/// Reads an llm.c token file, checking magic, version and that the file holds
/// exactly the declared number of tokens.
pub fn read_token_file(path: impl AsRef<Path>) -> Result<Vec<u16>> {
    let path = path.as_ref();
    let bytes = std::fs::read(path).map_err(|e| Gpt2Error::io("reading", path, e))?;
    parse_token_file(path, &bytes)
}

/// Serialises tokens in the token file format.
pub fn encode_token_file(path: &Path, tokens: &[u16]) -> Result<Vec<u8>> {
    let count = i32::try_from(tokens.len()).map_err(|_| Gpt2Error::BadTokenHeader {
        path: path.to_path_buf(),
        reason: format!(
            "{} tokens do not fit the int32 count of the header",
            tokens.len()
        ),
    })?;
    let mut out = Vec::with_capacity(TOKEN_FILE_HEADER_BYTES + 2 * tokens.len());
    let mut header = [0i32; TOKEN_FILE_HEADER_INTS];
    header[0] = TOKEN_FILE_MAGIC;
    header[1] = TOKEN_FILE_VERSION;
    header[2] = count;
    for h in header {
        out.extend_from_slice(&h.to_le_bytes());
    }
    for t in tokens {
        out.extend_from_slice(&t.to_le_bytes());
    }
    Ok(out)
}

/// Writes an llm.c token file atomically (temporary file in the same directory,
/// `fsync`, rename): readers never see a partial file, and a failed write leaves
/// an existing file untouched.
pub fn write_token_file(path: impl AsRef<Path>, tokens: &[u16]) -> Result<()> {
    let path = path.as_ref();
    let bytes = encode_token_file(path, tokens)?;
    write_atomic(path, |w| std::io::Write::write_all(w, &bytes))
}

/// Narrows token ids to the `uint16` of token files; the error names the first
/// id that does not fit and its position.
pub fn tokens_to_u16(ids: &[u32]) -> Result<Vec<u16>> {
    ids.iter()
        .enumerate()
        .map(|(position, &id)| {
            u16::try_from(id).map_err(|_| Gpt2Error::TokenTooWide { position, id })
        })
        .collect()
}

//! Crash-safe file writes shared by token files, weights and checkpoints.
//!
//! Protocol: the bytes go to a fresh temporary file in the destination's own
//! directory (so the final `rename` never crosses a filesystem), the file is
//! flushed and `fsync`ed, renamed over the destination (atomic on POSIX), and the
//! directory is `fsync`ed so the rename itself is durable. A reader therefore sees
//! either the old complete file or the new complete file, never a prefix. On any
//! error the temporary file is removed and the destination is left untouched.

use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{Gpt2Error, Result};

/// Prefix of temporary files, so stale ones left by a crash are recognisable.
pub(crate) const TMP_MARKER: &str = ".braid-tmp-";

static COUNTER: AtomicU64 = AtomicU64::new(0);

/// A unique sibling path of `path` for a temporary file or directory.
pub(crate) fn temp_sibling(path: &Path) -> Result<PathBuf> {
    let name = path.file_name().ok_or_else(|| {
        Gpt2Error::io(
            "writing",
            path,
            std::io::Error::new(std::io::ErrorKind::InvalidInput, "path has no file name"),
        )
    })?;
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let tmp_name = format!(
        "{}{}{}-{}",
        name.to_string_lossy(),
        TMP_MARKER,
        std::process::id(),
        n
    );
    Ok(parent_dir(path).join(tmp_name))
}

/// The directory holding `path` (`.` for a bare file name).
pub(crate) fn parent_dir(path: &Path) -> PathBuf {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// `fsync` a directory so a rename inside it is durable. Best effort where the
/// platform cannot open directories.
pub(crate) fn sync_dir(dir: &Path) -> Result<()> {
    #[cfg(unix)]
    {
        let d = File::open(dir).map_err(|e| Gpt2Error::io("opening directory", dir, e))?;
        d.sync_all()
            .map_err(|e| Gpt2Error::io("syncing directory", dir, e))?;
    }
    #[cfg(not(unix))]
    let _ = dir;
    Ok(())
}

/// Writes `path` atomically: `fill` creates and fills the temporary file at the
/// path it is given (by any means); that file is then `fsync`ed and renamed over
/// `path`. If `fill` or anything after it fails, the temporary file is removed and
/// `path` is untouched.
pub(crate) fn write_atomic_with(path: &Path, fill: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let tmp = temp_sibling(path)?;
    let result = (|| -> Result<()> {
        fill(&tmp)?;
        let file = File::open(&tmp).map_err(|e| Gpt2Error::io("opening", &tmp, e))?;
        file.sync_all()
            .map_err(|e| Gpt2Error::io("syncing", &tmp, e))?;
        drop(file);
        std::fs::rename(&tmp, path).map_err(|e| Gpt2Error::io("replacing", path, e))
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
        return result;
    }
    sync_dir(&parent_dir(path))
}

/// Writes `path` atomically: `write` fills a temporary file that replaces `path`
/// only once it is complete and on disk.
pub(crate) fn write_atomic(
    path: &Path,
    write: impl FnOnce(&mut BufWriter<File>) -> std::io::Result<()>,
) -> Result<()> {
    write_atomic_with(path, |tmp| {
        let file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(tmp)
            .map_err(|e| Gpt2Error::io("creating temporary file", tmp, e))?;
        let mut w = BufWriter::new(file);
        write(&mut w).map_err(|e| Gpt2Error::io("writing", tmp, e))?;
        w.flush().map_err(|e| Gpt2Error::io("writing", tmp, e))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_write_leaves_the_old_file_and_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f.bin");
        write_atomic(&path, |w| w.write_all(b"old contents")).unwrap();
        let err = write_atomic(&path, |w| {
            w.write_all(b"new contents, half")?;
            w.flush()?;
            Err(std::io::Error::other("disk full (simulated)"))
        })
        .unwrap_err();
        assert!(err.to_string().contains("disk full (simulated)"), "{err}");
        assert_eq!(std::fs::read(&path).unwrap(), b"old contents");
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("f.bin")]);
        write_atomic(&path, |w| w.write_all(b"new")).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"new");
    }
}

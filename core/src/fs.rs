//! Crash-safe file writes, shared by traces, token files, weights and
//! checkpoints.
//!
//! Protocol: the bytes go to a fresh temporary file in the destination's own
//! directory (so the final `rename` never crosses a filesystem), the file is
//! flushed and `fsync`ed, renamed over the destination (atomic on POSIX), and
//! the directory is `fsync`ed so the rename itself is durable. A reader
//! therefore sees either the old complete file or the new complete file, never
//! a prefix. On any error the temporary file is removed and the destination is
//! left untouched.

use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Marks temporary files, so stale ones left by a crash are recognisable.
pub const TMP_MARKER: &str = ".braid-tmp-";

/// An operating-system error while writing a file: what was being done, and
/// the path. Callers convert it into their own error type (`From`).
///
/// Its message ends with the OS error's, so the OS error is not also its
/// `source()` (a report that walks the chain would say it twice).
#[derive(Debug, thiserror::Error)]
#[error("{op} {}: {error}", path.display())]
pub struct FileError {
    /// What was being done ("writing", "syncing", "replacing", ...).
    pub op: &'static str,
    /// The file or directory concerned.
    pub path: PathBuf,
    /// The OS error.
    pub error: std::io::Error,
}

impl FileError {
    /// Wraps `error` with the operation and the path.
    pub fn new(op: &'static str, path: impl Into<PathBuf>, error: std::io::Error) -> Self {
        FileError {
            op,
            path: path.into(),
            error,
        }
    }
}

/// Writes `path` atomically: `write` fills a temporary file that replaces
/// `path` only once it is complete and on disk.
pub fn write_atomic<E: From<FileError>>(
    path: &Path,
    write: impl FnOnce(&mut BufWriter<File>) -> std::io::Result<()>,
) -> Result<(), E> {
    write_atomic_with(path, |tmp| {
        let file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(tmp)
            .map_err(|e| FileError::new("creating temporary file", tmp, e))?;
        let mut w = BufWriter::new(file);
        write(&mut w)
            .and_then(|()| w.flush())
            .map_err(|e| FileError::new("writing", tmp, e).into())
    })
}

/// Writes `path` atomically: `fill` creates and fills the temporary file at
/// the path it is given (by any means); that file is then `fsync`ed and
/// renamed over `path`. If `fill` or anything after it fails, the temporary
/// file is removed and `path` is untouched.
pub fn write_atomic_with<E: From<FileError>>(
    path: &Path,
    fill: impl FnOnce(&Path) -> Result<(), E>,
) -> Result<(), E> {
    let tmp = temp_sibling(path)?;
    let result = fill(&tmp).and_then(|()| {
        let sync = File::open(&tmp).and_then(|f| f.sync_all());
        sync.map_err(|e| FileError::new("syncing", &tmp, e))?;
        std::fs::rename(&tmp, path).map_err(|e| FileError::new("replacing", path, e).into())
    });
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
        return result;
    }
    sync_dir(&parent_dir(path)).map_err(E::from)
}

/// A unique sibling path of `path` for a temporary file.
fn temp_sibling(path: &Path) -> Result<PathBuf, FileError> {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let name = path.file_name().ok_or_else(|| {
        let e = std::io::Error::new(std::io::ErrorKind::InvalidInput, "path has no file name");
        FileError::new("writing", path, e)
    })?;
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let tmp_name = format!(
        "{}{TMP_MARKER}{}-{n}",
        name.to_string_lossy(),
        std::process::id()
    );
    Ok(parent_dir(path).join(tmp_name))
}

/// Why a file could not be written at `path` later, if that is already
/// known: its directory does not exist, or `path` is a directory. For
/// output paths checked before a long run that writes them at its end.
pub fn unwritable(path: &Path) -> Option<String> {
    let dir = parent_dir(path);
    if !dir.is_dir() {
        Some(format!("the directory {} does not exist", dir.display()))
    } else if path.is_dir() {
        Some("is a directory; name a file".into())
    } else {
        None
    }
}

/// The directory holding `path` (`.` for a bare file name).
fn parent_dir(path: &Path) -> PathBuf {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// `fsync` a directory so a rename inside it is durable. Best effort where
/// the platform cannot open directories.
fn sync_dir(dir: &Path) -> Result<(), FileError> {
    #[cfg(unix)]
    {
        let d = File::open(dir).map_err(|e| FileError::new("opening directory", dir, e))?;
        d.sync_all()
            .map_err(|e| FileError::new("syncing directory", dir, e))?;
    }
    #[cfg(not(unix))]
    let _ = dir;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_write_leaves_the_old_file_and_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f.bin");
        write_atomic::<FileError>(&path, |w| w.write_all(b"old contents")).unwrap();
        let err = write_atomic::<FileError>(&path, |w| {
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
        write_atomic::<FileError>(&path, |w| w.write_all(b"new")).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"new");
    }
}

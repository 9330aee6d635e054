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
//!
//! A destination that is a symbolic link is written where the link points
//! (the link stays a link). A destination that exists and is neither a
//! regular file nor a directory (`/dev/null`, a FIFO, a socket) cannot be
//! replaced by a rename: the bytes are prepared in a temporary file in the
//! system's temporary directory and then written straight into it.
//!
//! A path that reaches a process's descriptor table (`/dev/stdout`,
//! `/dev/fd/<n>`, `/proc/<pid>/fd/<n>`, `/proc/self/fd/<n>`, as a shell's
//! process substitution `>(gzip > t.gz)` hands out) names an *open file*, not
//! a place in a directory: its link's text is `pipe:[123]` or the path of a
//! file the shell redirected. Such a path is never followed as a symbolic
//! link nor replaced by a rename; it is written into, like a FIFO. A
//! descriptor of this process is written through a duplicate of it, at its
//! current offset, so `--trace /dev/stdout > out.txt` puts the trace into
//! `out.txt` between what the program printed before and after it.
//!
//! A regular file that is replaced keeps its permission bits (a `0600`
//! checkpoint stays `0600`); a new file gets the default mode under the
//! umask.
//!
//! Temporary files of an earlier write to the same destination, left by a
//! process that was killed mid-write (`*.braid-tmp-<pid>-<n>`), are removed
//! by the next write when that process no longer runs (Linux) and the file
//! has not changed for [`STALE_AFTER`].

use std::ffi::OsStr;
use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Marks temporary files, so stale ones left by a crash are recognisable.
pub const TMP_MARKER: &str = ".braid-tmp-";

/// A temporary file of a process that no longer runs is removed once it has
/// not been modified for this long (a guard against a writer whose process
/// this one cannot see, e.g. in another PID namespace sharing the directory).
pub const STALE_AFTER: Duration = Duration::from_secs(300);

/// Symbolic links followed before a path is declared a loop (Linux's limit).
const MAX_LINKS: usize = 40;

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
///
/// A symbolic link is followed (the file it names is replaced, the link
/// kept); a destination that is neither a regular file nor a directory
/// (a device such as `/dev/null`, a FIFO), or that is reached through a
/// descriptor link (`/dev/stdout`, `/dev/fd/<n>`), is written into once
/// `fill` has completed, without a rename; a replaced regular file keeps its
/// permission bits (module docs).
pub fn write_atomic_with<E: From<FileError>>(
    path: &Path,
    fill: impl FnOnce(&Path) -> Result<(), E>,
) -> Result<(), E> {
    let target = match resolve_links(path)? {
        Target::Descriptor(link) => {
            return write_through(&link, fill, || open_descriptor(&link));
        }
        Target::Path(target) => target,
    };
    if is_special(&target) {
        let open = || OpenOptions::new().write(true).open(&target);
        return write_through(&target, fill, open);
    }
    if let Some(name) = target.file_name() {
        remove_stale_temporaries(&parent_dir(&target), name);
    }
    // A file that is replaced keeps its permission bits (the temporary one
    // was created under the umask).
    let keep = std::fs::metadata(&target)
        .ok()
        .filter(|m| m.is_file())
        .map(|m| m.permissions());
    let tmp = temp_sibling(&target)?;
    let result = fill(&tmp).and_then(|()| {
        if let Some(perm) = keep {
            std::fs::set_permissions(&tmp, perm)
                .map_err(|e| FileError::new("setting the permissions of", &tmp, e))?;
        }
        let sync = File::open(&tmp).and_then(|f| f.sync_all());
        sync.map_err(|e| FileError::new("syncing", &tmp, e))?;
        std::fs::rename(&tmp, &target).map_err(|e| FileError::new("replacing", &target, e).into())
    });
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
        return result;
    }
    sync_dir(&parent_dir(&target)).map_err(E::from)
}

/// Writes into `target`, an existing file that is not a regular one (a
/// device, a FIFO) or a descriptor link: `fill` fills a temporary file in the
/// system's temporary directory (it may need to seek, and to create its
/// file), which is then copied into the file `open` opens (once `fill` has
/// succeeded, so a FIFO's reader sees nothing of a failed write) and removed.
fn write_through<E: From<FileError>>(
    target: &Path,
    fill: impl FnOnce(&Path) -> Result<(), E>,
    open: impl FnOnce() -> std::io::Result<File>,
) -> Result<(), E> {
    let tmp_dir = std::env::temp_dir();
    let name = target.file_name().unwrap_or(OsStr::new("output"));
    remove_stale_temporaries(&tmp_dir, name);
    let tmp = temp_sibling(&tmp_dir.join(name))?;
    let result = fill(&tmp).and_then(|()| {
        let mut from = File::open(&tmp).map_err(|e| FileError::new("reading", &tmp, e))?;
        let mut to = open().map_err(|e| FileError::new("opening", target, e))?;
        std::io::copy(&mut from, &mut to)
            .and_then(|_| to.flush())
            .map_err(|e| FileError::new("writing", target, e).into())
            .map(drop)
    });
    let _ = std::fs::remove_file(&tmp);
    result
}

/// Where a write goes once symbolic links are followed.
#[derive(Debug)]
enum Target {
    /// A path in a directory (which need not exist yet): replaced by a
    /// rename, or written into when it is a device, FIFO or socket.
    Path(PathBuf),
    /// An entry of a process's descriptor table (`/proc/<pid>/fd/<n>`,
    /// `/dev/fd/<n>`): the open file it stands for is written into.
    Descriptor(PathBuf),
}

/// `path` with its symbolic links followed to the path they finally name
/// (which need not exist: a dangling link is written through, as a shell's
/// `>` does). Relative link targets are taken from the link's directory.
/// Following stops at an entry of a descriptor directory: its link's text
/// (`pipe:[123]`, a redirected file's path) is not a path to write to.
fn resolve_links(path: &Path) -> Result<Target, FileError> {
    let mut p = path.to_path_buf();
    for _ in 0..MAX_LINKS {
        if is_descriptor_dir(&parent_dir(&p)) {
            return Ok(Target::Descriptor(p));
        }
        match std::fs::symlink_metadata(&p) {
            Ok(m) if m.file_type().is_symlink() => {
                let to = std::fs::read_link(&p)
                    .map_err(|e| FileError::new("reading the symbolic link", &p, e))?;
                p = if to.is_absolute() {
                    to
                } else {
                    parent_dir(&p).join(to)
                };
            }
            _ => return Ok(Target::Path(p)),
        }
    }
    let e = std::io::Error::other(format!(
        "more than {MAX_LINKS} symbolic links to follow (a loop?)"
    ));
    Err(FileError::new("resolving", path, e))
}

/// Whether `dir` is a process's descriptor directory: `/proc/<pid>/fd` or
/// `/proc/<pid>/task/<tid>/fd` (what `/dev/fd`, `/proc/self/fd` and
/// `/proc/thread-self/fd` resolve to on Linux), or `/dev/fd` itself where it
/// is a directory of its own (the BSDs, macOS).
fn is_descriptor_dir(dir: &Path) -> bool {
    use std::path::Component::{Normal, RootDir};
    let Ok(dir) = std::fs::canonicalize(dir) else {
        return false;
    };
    let parts: Vec<_> = dir.components().collect();
    let is = |c: &std::path::Component<'_>, name: &str| *c == Normal(OsStr::new(name));
    match parts.as_slice() {
        [RootDir, dev, fd] => is(dev, "dev") && is(fd, "fd"),
        [RootDir, proc, _, fd] => is(proc, "proc") && is(fd, "fd"),
        [RootDir, proc, _, task, _, fd] => is(proc, "proc") && is(task, "task") && is(fd, "fd"),
        _ => false,
    }
}

/// The descriptor number of `link` when it is an entry of this process's
/// own descriptor table (`/proc/<this pid>/fd/<n>`, and so `/dev/fd/<n>`,
/// `/proc/self/fd/<n>`, `/dev/stdout`); `None` for another process's.
#[cfg(target_os = "linux")]
fn own_descriptor(link: &Path) -> Option<std::os::fd::RawFd> {
    let dir = std::fs::canonicalize(parent_dir(link)).ok()?;
    let mut parts = dir.components().skip(2);
    let pid = parts.next()?.as_os_str().to_str()?.parse::<u32>().ok()?;
    if pid != std::process::id() {
        return None;
    }
    link.file_name()?.to_str()?.parse().ok()
}

/// Opens the file a descriptor link stands for, for writing. This process's
/// own descriptor is duplicated (same file, same offset, and it works for
/// sockets, which cannot be opened by path); another's is opened by its
/// path, as a shell's `>` would (a regular file is truncated).
fn open_descriptor(link: &Path) -> std::io::Result<File> {
    #[cfg(target_os = "linux")]
    if let Some(fd) = own_descriptor(link) {
        use std::os::fd::FromRawFd;
        writable_descriptor(fd)?;
        if fd == 1 {
            // What the program printed before comes before the bytes.
            let _ = std::io::stdout().flush();
        }
        // SAFETY: `fcntl` with `F_DUPFD_CLOEXEC` reads no memory of ours; a
        // descriptor that is not open gives `EBADF`.
        let dup = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
        if dup < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `dup` is a new descriptor that nothing else owns.
        return Ok(unsafe { File::from_raw_fd(dup) });
    }
    let regular = std::fs::metadata(link).is_ok_and(|m| m.is_file());
    OpenOptions::new().write(true).truncate(regular).open(link)
}

/// `Ok` when this process's descriptor `fd` is open for writing; otherwise
/// the error says it is not open, or open for reading only.
#[cfg(target_os = "linux")]
fn writable_descriptor(fd: std::os::fd::RawFd) -> std::io::Result<()> {
    // SAFETY: `fcntl` with `F_GETFL` reads no memory of ours.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        let e = std::io::Error::last_os_error();
        return Err(std::io::Error::new(
            e.kind(),
            format!("descriptor {fd} is not open ({e})"),
        ));
    }
    if flags & libc::O_ACCMODE == libc::O_RDONLY {
        return Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            format!("descriptor {fd} is open for reading only"),
        ));
    }
    Ok(())
}

/// Whether `path` (links followed) exists and is neither a regular file nor
/// a directory: a character or block device, a FIFO, a socket.
fn is_special(path: &Path) -> bool {
    std::fs::metadata(path).is_ok_and(|m| !m.is_file() && !m.is_dir())
}

/// Removes the temporary files `<name>.braid-tmp-<pid>-<n>` in `dir` that a
/// process killed mid-write left behind: those whose process no longer runs
/// and that have not been modified for [`STALE_AFTER`]. Linux only (where
/// `/proc` says which processes run); best effort, errors are ignored.
fn remove_stale_temporaries(dir: &Path, name: &OsStr) {
    #[cfg(target_os = "linux")]
    {
        // Without a mounted /proc every process would look gone.
        if !Path::new("/proc/self").exists() {
            return;
        }
        let Some(name) = name.to_str() else { return };
        let prefix = format!("{name}{TMP_MARKER}");
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for entry in entries.flatten() {
            let file_name = entry.file_name();
            let Some(rest) = file_name.to_str().and_then(|f| f.strip_prefix(&prefix)) else {
                continue;
            };
            let Some((pid, n)) = rest.split_once('-') else {
                continue;
            };
            let (Ok(pid), Ok(_)) = (pid.parse::<u32>(), n.parse::<u64>()) else {
                continue;
            };
            if pid == std::process::id() || Path::new("/proc").join(pid.to_string()).exists() {
                continue;
            }
            // `DirEntry::metadata` does not follow a link: only regular
            // files are removed.
            let Ok(meta) = entry.metadata() else { continue };
            let age = meta.modified().ok().and_then(|m| m.elapsed().ok());
            if meta.is_file() && age.is_some_and(|a| a >= STALE_AFTER) {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (dir, name);
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

/// A log that is written as it goes (a line at a time), opened as
/// [`open_log`] found it.
#[derive(Debug)]
pub struct LogFile {
    /// The open file, written at its end (or, for a descriptor of this
    /// process, at the descriptor's offset).
    pub file: File,
    /// Whether it is a regular file at a path of its own (not a device, a
    /// FIFO or a descriptor): only such a file can be read back and
    /// rewritten.
    pub regular: bool,
}

/// Opens `path` for a log written line by line while a program runs (not
/// atomically: a reader sees the lines written so far). Outputs are taken
/// as [`write_atomic_with`] takes them: symbolic links are followed; a
/// descriptor link of this process (`/dev/stdout`, `/dev/fd/<n>`) is
/// written through a duplicate of the descriptor, at its offset, so the
/// lines fall among what the program prints there; a device, FIFO or socket
/// is written into. A regular file (made if need be) is emptied first, or
/// with `append` appended to.
pub fn open_log(path: &Path, append: bool) -> Result<LogFile, FileError> {
    let opening = |e| FileError::new("opening", path, e);
    let target = match resolve_links(path)? {
        Target::Descriptor(link) => {
            let file = open_descriptor(&link).map_err(opening)?;
            return Ok(LogFile {
                file,
                regular: false,
            });
        }
        Target::Path(p) => p,
    };
    if is_special(&target) {
        let file = OpenOptions::new()
            .write(true)
            .open(&target)
            .map_err(opening)?;
        return Ok(LogFile {
            file,
            regular: false,
        });
    }
    let file = OpenOptions::new()
        .create(true)
        .write(true)
        .append(append)
        .truncate(!append)
        .open(&target)
        .map_err(opening)?;
    Ok(LogFile {
        file,
        regular: true,
    })
}

/// Why a file could not be written at `path` later, if that is already
/// known: its directory does not exist, `path` is a directory, or a file
/// cannot be created in its directory (tried: a temporary file is created
/// there and removed, as [`write_atomic_with`] would). A symbolic link is
/// followed; a device or FIFO is taken as writable. For output paths checked
/// before a long run that writes them at its end. A descriptor link
/// (`/dev/stdout`, `/dev/fd/<n>`) is writable when it is open (this
/// process's own: open for writing).
pub fn unwritable(path: &Path) -> Option<String> {
    let target = match resolve_links(path) {
        Ok(Target::Path(t)) => t,
        Ok(Target::Descriptor(link)) => return unwritable_descriptor(&link),
        Err(e) => return Some(e.error.to_string()),
    };
    let dir = parent_dir(&target);
    if target.is_dir() {
        Some("is a directory; name a file".into())
    } else if !dir.is_dir() {
        // The nearest existing ancestor says which: a file where a
        // directory should be, or a directory yet to be made.
        let file = dir.ancestors().find(|a| a.exists()).filter(|a| !a.is_dir());
        Some(match file {
            Some(f) if !f.as_os_str().is_empty() => {
                format!("{} is a file, not a directory", f.display())
            }
            _ => format!("the directory {} does not exist", dir.display()),
        })
    } else if is_special(&target) {
        None
    } else {
        let probe = temp_sibling(&target).ok()?;
        match OpenOptions::new().write(true).create_new(true).open(&probe) {
            Ok(f) => {
                drop(f);
                let _ = std::fs::remove_file(&probe);
                None
            }
            Err(e) => Some(format!("cannot create a file in {}: {e}", dir.display())),
        }
    }
}

/// Why the descriptor link `link` cannot be written, if that is known now.
/// It is not opened (a FIFO's open would wait for a reader).
fn unwritable_descriptor(link: &Path) -> Option<String> {
    #[cfg(target_os = "linux")]
    if let Some(fd) = own_descriptor(link) {
        return writable_descriptor(fd).err().map(|e| e.to_string());
    }
    match std::fs::metadata(link) {
        Ok(_) => None,
        Err(e) => Some(format!("the descriptor is not open ({e})")),
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

    /// A log: a regular file emptied or appended to (through a link too), a
    /// device written into and said not to be regular.
    #[test]
    fn a_log_is_emptied_or_appended_and_knows_what_it_writes_to() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("log");
        std::fs::write(&path, "old\n").unwrap();
        let link = dir.path().join("link");
        #[cfg(unix)]
        std::os::unix::fs::symlink(&path, &link).unwrap();
        #[cfg(not(unix))]
        let link = path.clone();
        let mut log = open_log(&link, true).unwrap();
        assert!(log.regular);
        log.file.write_all(b"more\n").unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "old\nmore\n");
        let mut log = open_log(&link, false).unwrap();
        log.file.write_all(b"new\n").unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "new\n");
        assert!(link.is_symlink() || cfg!(not(unix)));
        if Path::new("/dev/null").exists() {
            assert!(!open_log(Path::new("/dev/null"), true).unwrap().regular);
        }
        let missing = dir.path().join("no/such/dir/log");
        let e = open_log(&missing, false).unwrap_err().to_string();
        assert!(e.contains("opening") && e.contains("no/such/dir"), "{e}");
    }

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

    /// A symbolic link is written through: the file it names gets the new
    /// bytes, and the link stays a link (relative, absolute and dangling).
    #[cfg(unix)]
    #[test]
    fn a_symbolic_link_is_written_through_and_kept() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        std::fs::create_dir(d.join("real")).unwrap();
        std::fs::write(d.join("real/f.json"), b"old").unwrap();
        std::os::unix::fs::symlink("real/f.json", d.join("rel")).unwrap();
        std::os::unix::fs::symlink(d.join("rel"), d.join("abs")).unwrap();
        std::os::unix::fs::symlink("real/new.json", d.join("dangling")).unwrap();
        for (link, bytes) in [
            ("rel", &b"one"[..]),
            ("abs", b"two"),
            ("dangling", b"three"),
        ] {
            let path = d.join(link);
            assert_eq!(unwritable(&path), None);
            write_atomic::<FileError>(&path, |w| w.write_all(bytes)).unwrap();
            assert!(
                std::fs::symlink_metadata(&path)
                    .unwrap()
                    .file_type()
                    .is_symlink(),
                "{link} was replaced by a file"
            );
            assert_eq!(std::fs::read(&path).unwrap(), bytes);
        }
        assert_eq!(std::fs::read(d.join("real/f.json")).unwrap(), b"two");
        assert_eq!(std::fs::read(d.join("real/new.json")).unwrap(), b"three");
        // A loop is an error, not a hang.
        std::os::unix::fs::symlink("loop_b", d.join("loop_a")).unwrap();
        std::os::unix::fs::symlink("loop_a", d.join("loop_b")).unwrap();
        let err = write_atomic::<FileError>(&d.join("loop_a"), |w| w.write_all(b"x")).unwrap_err();
        assert!(err.to_string().contains("symbolic links"), "{err}");
        assert!(unwritable(&d.join("loop_a")).is_some());
    }

    /// A FIFO (like `/dev/null`, not a regular file) is written into, not
    /// replaced by a regular file.
    #[cfg(target_os = "linux")]
    #[test]
    fn a_fifo_is_written_into_not_replaced() {
        use std::os::unix::fs::FileTypeExt;
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("pipe");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: `c` is a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let reader = {
            let fifo = fifo.clone();
            std::thread::spawn(move || std::fs::read(fifo).unwrap())
        };
        assert_eq!(unwritable(&fifo), None);
        write_atomic_with::<FileError>(&fifo, |tmp| {
            // Fill by creating the file, as the safetensors writer does.
            std::fs::write(tmp, b"through the pipe").map_err(|e| FileError::new("w", tmp, e))
        })
        .unwrap();
        assert_eq!(reader.join().unwrap(), b"through the pipe");
        assert!(std::fs::metadata(&fifo).unwrap().file_type().is_fifo());
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("pipe")]);
    }

    /// A file that is replaced keeps its permission bits, whatever the umask
    /// gives a new one.
    #[cfg(unix)]
    #[test]
    fn a_replaced_file_keeps_its_permissions() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ck.st");
        for mode in [0o600, 0o640, 0o755] {
            std::fs::write(&path, b"old").unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
            write_atomic::<FileError>(&path, |w| w.write_all(b"new")).unwrap();
            assert_eq!(std::fs::read(&path).unwrap(), b"new");
            let got = std::fs::metadata(&path).unwrap().permissions().mode() & 0o7777;
            assert_eq!(got, mode, "{got:o} instead of {mode:o}");
        }
    }

    /// A pipe of this process named by its descriptor (`/proc/self/fd/<n>`,
    /// `/dev/fd/<n>`, as process substitution hands out) is written into:
    /// the link's text `pipe:[...]` is not taken for a path.
    #[cfg(target_os = "linux")]
    #[test]
    fn a_pipe_named_by_its_descriptor_is_written_into() {
        use std::io::Read;
        use std::os::fd::FromRawFd;
        let mut fds = [0; 2];
        // SAFETY: `fds` has room for the two descriptors.
        assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
        // SAFETY: both descriptors are new and owned here only.
        let (mut read, write) = unsafe { (File::from_raw_fd(fds[0]), File::from_raw_fd(fds[1])) };
        let reader = std::thread::spawn(move || {
            let mut got = Vec::new();
            read.read_to_end(&mut got).unwrap();
            got
        });
        let w = fds[1];
        for (path, bytes) in [
            (format!("/proc/self/fd/{w}"), &b"one,"[..]),
            (format!("/dev/fd/{w}"), b"two,"),
            (format!("/proc/{}/fd/{w}", std::process::id()), b"three"),
        ] {
            let path = Path::new(&path);
            assert_eq!(unwritable(path), None, "{}", path.display());
            write_atomic_with::<FileError>(path, |tmp| {
                std::fs::write(tmp, bytes).map_err(|e| FileError::new("w", tmp, e))
            })
            .unwrap();
        }
        drop(write);
        assert_eq!(reader.join().unwrap(), b"one,two,three");
    }

    /// A regular file named by a descriptor of this process (the shell's
    /// `--trace /dev/stdout > out.txt`) is written at the descriptor's offset,
    /// between what was written through it before and after; it is not
    /// replaced by another file.
    #[cfg(target_os = "linux")]
    #[test]
    fn a_file_named_by_its_descriptor_is_written_at_its_offset() {
        use std::os::fd::AsRawFd;
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("out.txt");
        let mut f = File::create(&out).unwrap();
        f.write_all(b"before|").unwrap();
        let path = PathBuf::from(format!("/dev/fd/{}", f.as_raw_fd()));
        assert_eq!(unwritable(&path), None);
        write_atomic::<FileError>(&path, |w| w.write_all(b"trace")).unwrap();
        f.write_all(b"|after").unwrap();
        drop(f);
        assert_eq!(std::fs::read(&out).unwrap(), b"before|trace|after");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);

        // One open for reading only, or not open at all, is refused by the
        // check before the run and by the writer alike.
        let r = File::open(&out).unwrap();
        let path = PathBuf::from(format!("/proc/self/fd/{}", r.as_raw_fd()));
        let why = unwritable(&path).unwrap();
        assert!(why.contains("reading only"), "{why}");
        let err = write_atomic::<FileError>(&path, |w| w.write_all(b"x")).unwrap_err();
        assert!(err.to_string().contains("reading only"), "{err}");
        let closed = Path::new("/dev/fd/1000000");
        let why = unwritable(closed).unwrap();
        assert!(why.contains("not open"), "{why}");
        assert!(write_atomic::<FileError>(closed, |w| w.write_all(b"x")).is_err());
        assert_eq!(std::fs::read(&out).unwrap(), b"before|trace|after");
    }

    /// Set in the child [`dev_stdout_is_written_into`] starts.
    #[cfg(target_os = "linux")]
    const STDOUT_CHILD: &str = "BRAID_FS_TEST_STDOUT_CHILD";

    /// In a child of [`dev_stdout_is_written_into`] only: writes to
    /// `/dev/stdout`, whatever the parent made of it.
    #[cfg(target_os = "linux")]
    #[test]
    fn dev_stdout_child() {
        if std::env::var_os(STDOUT_CHILD).is_none() {
            return;
        }
        let path = Path::new("/dev/stdout");
        assert_eq!(unwritable(path), None);
        write_atomic::<FileError>(path, |w| w.write_all(b"<braid payload>\n")).unwrap();
        println!("<printed after>");
    }

    /// `/dev/stdout` is written into when the standard output is a pipe (it
    /// was "cannot create a file in /proc/self/fd") and when it is a
    /// redirected file (which was replaced by a rename, so what the program
    /// printed afterwards went to a deleted file).
    #[cfg(target_os = "linux")]
    #[test]
    fn dev_stdout_is_written_into() {
        let child = || {
            let mut c = std::process::Command::new(std::env::current_exe().unwrap());
            c.args(["fs::tests::dev_stdout_child", "--exact", "--nocapture"])
                .args(["--test-threads", "1"])
                .env(STDOUT_CHILD, "1");
            c
        };
        let piped = child().output().unwrap();
        assert!(piped.status.success(), "{piped:?}");
        let text = String::from_utf8(piped.stdout).unwrap();
        let (payload, after) = (
            text.find("<braid payload>").unwrap(),
            text.find("<printed after>").unwrap(),
        );
        assert!(payload < after, "{text}");

        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("out.txt");
        let status = child()
            .stdout(File::create(&out).unwrap())
            .status()
            .unwrap();
        assert!(status.success());
        let text = std::fs::read_to_string(&out).unwrap();
        let (payload, after) = (
            text.find("<braid payload>").unwrap(),
            text.find("<printed after>").unwrap(),
        );
        assert!(payload < after, "{text}");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    /// Temporary files of a write whose process is gone are removed by the
    /// next write to the same file once they are old; a live process's, a
    /// fresh one and another file's are kept.
    #[cfg(target_os = "linux")]
    #[test]
    fn stale_temporaries_of_dead_processes_are_removed() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        // A process that has exited: its pid is free (until reused, which
        // only keeps its file).
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        let live = std::process::id();
        let old = std::time::SystemTime::now() - STALE_AFTER - Duration::from_secs(60);
        let make = |name: &str, aged: bool| {
            let f = File::create(d.join(name)).unwrap();
            if aged {
                f.set_modified(old).unwrap();
            }
        };
        let stale = format!("ck.st{TMP_MARKER}{dead}-0");
        let fresh = format!("ck.st{TMP_MARKER}{dead}-1");
        let running = format!("ck.st{TMP_MARKER}{live}-7");
        let other = format!("other.st{TMP_MARKER}{dead}-0");
        make(&stale, true);
        make(&fresh, false);
        make(&running, true);
        make(&other, true);
        write_atomic::<FileError>(&d.join("ck.st"), |w| w.write_all(b"x")).unwrap();
        // Kept only if the pid was taken again meanwhile.
        let alive = Path::new("/proc").join(dead.to_string()).exists();
        assert_eq!(d.join(&stale).exists(), alive, "pid {dead} reused?");
        for keep in [&fresh, &running, &other] {
            assert!(d.join(keep).exists(), "{keep} was removed");
        }
    }

    /// A directory in which no file can be created (even by root: /proc) is
    /// found before anything is written.
    #[cfg(target_os = "linux")]
    #[test]
    fn unwritable_tries_to_create_a_file() {
        let why = unwritable(Path::new("/proc/braid-probe.json")).unwrap();
        assert!(why.contains("cannot create a file in /proc"), "{why}");
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(unwritable(&dir.path().join("t.json")), None);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
        std::fs::write(dir.path().join("file"), b"").unwrap();
        let why = unwritable(&dir.path().join("file/sub/t.json")).unwrap();
        assert!(why.ends_with("file is a file, not a directory"), "{why}");
        let why = unwritable(&dir.path().join("none/sub/t.json")).unwrap();
        assert!(why.contains("none/sub does not exist"), "{why}");
    }
}

//! The engine's one error type.

use std::ops::Range;

/// `": <root>"` where a skip's root failure is known, else nothing: how a
/// skip's message ends (`Error::DependencyFailed`, a skipped collective's).
pub(crate) fn root_suffix(root: &Option<Box<Error>>) -> String {
    root.as_ref().map_or(String::new(), |r| format!(": {r}"))
}

/// `"task `name`: "` where the task is known, else nothing.
fn task_prefix(task: &Option<String>) -> String {
    task.as_ref()
        .map_or(String::new(), |t| format!("task `{t}`: "))
}

/// Everything that can go wrong in Braid.
///
/// Errors are cheap to clone (they carry strings, not sources) because one
/// failure may be reported at several synchronisation points of several threads.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A view's byte range does not fit in its buffer.
    #[error("view {start}..{end} is out of bounds for buffer `{buffer}` of {len} bytes")]
    ViewOutOfBounds {
        buffer: String,
        start: usize,
        end: usize,
        len: usize,
    },
    /// A buffer created by one runtime was used with another (`task`: the
    /// task that declared it, where one did).
    #[error(
        "{}buffer `{buffer}` belongs to another runtime (#{owner}; this one is #{runtime})",
        task_prefix(.task)
    )]
    ForeignBuffer {
        task: Option<String>,
        buffer: String,
        owner: u64,
        runtime: u64,
    },
    /// Two accesses of one task overlap where one writes (so its body would
    /// get aliasing slices); refused at submission.
    #[error(
        "task `{task}` borrowed bytes {range:?} of buffer `{buffer}` twice while one borrow writes"
    )]
    BorrowConflict {
        task: String,
        buffer: String,
        range: Range<usize>,
    },
    /// A typed view does not fit the element type's size or alignment
    /// (`task`: the task that declared it, where one did).
    #[error(
        "{}bytes {range:?} of buffer `{buffer}` are not a whole, aligned slice of `{ty}`",
        task_prefix(.task)
    )]
    Misaligned {
        task: Option<String>,
        buffer: String,
        range: Range<usize>,
        ty: &'static str,
    },
    /// The data lives on another device than the accessor asked for.
    #[error("buffer `{buffer}` lives on {actual}; the task asked for it on {wanted}")]
    WrongDevice {
        buffer: String,
        actual: &'static str,
        wanted: &'static str,
    },
    /// A task body returned an error.
    #[error("task `{task}` failed: {message}")]
    TaskFailed { task: String, message: String },
    /// A task body panicked.
    #[error("task `{task}` panicked: {message}")]
    TaskPanicked { task: String, message: String },
    /// A task was not run because a task it depends on failed. `cause` is
    /// the task it waited for; `root`, where known, the error the chain of
    /// failures started with (the task that failed first, not one skipped
    /// in turn), so a wait on a skipped task still says why.
    #[error(
        "task `{task}` was skipped because `{cause}`, which it depends on, failed{}",
        root_suffix(root)
    )]
    DependencyFailed {
        task: String,
        cause: String,
        root: Option<Box<Error>>,
    },
    /// Several tasks failed before the same synchronisation point.
    #[error("{} tasks failed; the first: {}", .0.len(), .0[0])]
    Many(Vec<Error>),
    /// A synchronisation point was called from inside a task of the same runtime,
    /// where it could only deadlock.
    #[error(
        "`{what}` called from inside a task of the same runtime: a task may not wait on its \
         own runtime (it could wait for itself, or for tasks queued behind it on its stream); \
         wait outside the task, or make the waiting code a task that reads what it waits for"
    )]
    WaitInsideTask { what: &'static str },
    /// A synchronisation point of a best-effort runtime was called from
    /// inside a task of a latency-critical runtime, where it could only
    /// deadlock: best-effort tasks do not start while that task is
    /// unfinished.
    #[error(
        "`{what}` on a best-effort runtime called from inside a task of a latency-critical \
         runtime: best-effort tasks do not start while a latency-critical task is unfinished \
         (the waiting one included), so the wait would never end; wait outside the \
         latency-critical task, or run the work it needs on a latency-critical or normal \
         runtime (docs/tenants.md)"
    )]
    WaitOnBestEffort { what: &'static str },
    /// A task was submitted to a runtime whose backend it has no body for.
    #[error("task `{task}` has no body for the {backend} backend (submit it with `run_any`, or with `run_cuda` on CUDA)")]
    NoBody { task: String, backend: &'static str },
    /// The runtime configuration is unusable.
    #[error("invalid runtime configuration: {0}")]
    Config(String),
    /// A call the runtime cannot honour as made (an upload of the wrong
    /// size, a stream it does not have, a replay during a recording, a
    /// collective's buffers of the wrong shape); the message names it.
    #[error("{0}")]
    Usage(String),
    /// A placement file is malformed, or names a stream the runtime does not
    /// have (found when the runtime is built, before any task runs).
    #[error("placement file `{file}`, line {line}: {message}")]
    Placement {
        file: String,
        line: usize,
        message: String,
    },
    /// The requested backend is not available on this machine.
    #[error("backend `{backend}` is unavailable: {reason}")]
    BackendUnavailable {
        backend: &'static str,
        reason: String,
    },
    /// An error reported by the device, its driver or one of its libraries.
    #[error("{backend} error in {op}: {message}")]
    Device {
        backend: &'static str,
        op: String,
        message: String,
    },
    /// A collective could not complete.
    #[error("collective #{index} `{op}` on rank {rank} failed: {message}")]
    Collective {
        rank: usize,
        index: u64,
        op: String,
        message: String,
    },
    /// A trace (a file, or the live view's stream) is not what Braid writes;
    /// the message says which.
    #[error("not a Braid {0}")]
    BadTrace(String),
    /// Reading or writing a file failed.
    #[error("{op} `{path}`: {message}")]
    Io {
        op: &'static str,
        path: String,
        message: String,
    },
}

impl From<crate::fs::FileError> for Error {
    fn from(e: crate::fs::FileError) -> Self {
        Error::io(e.op, &e.path, e.error)
    }
}

impl Error {
    pub(crate) fn io(op: &'static str, path: &std::path::Path, e: std::io::Error) -> Self {
        Error::Io {
            op,
            path: path.display().to_string(),
            message: e.to_string(),
        }
    }

    /// This error naming `task`, the task whose declared accesses it is
    /// about, if it is such an error and names none yet.
    pub fn for_task(mut self, name: &str) -> Self {
        if let Error::Misaligned { task, .. } | Error::ForeignBuffer { task, .. } = &mut self {
            task.get_or_insert_with(|| name.to_string());
        }
        self
    }

    /// Joins the errors found at one synchronisation point into one.
    pub(crate) fn join(mut errors: Vec<Error>) -> Option<Error> {
        match errors.len() {
            0 => None,
            1 => errors.pop(),
            _ => Some(Error::Many(errors)),
        }
    }
}

/// The result type of Braid's API.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What a task body returns on failure: any error, boxed.
pub type TaskError = Box<dyn std::error::Error + Send + Sync + 'static>;

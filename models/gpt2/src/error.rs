//! The crate's one error type.
//!
//! Every variant is structured and its message names what was wrong: the file,
//! the tensor, the expected and the found shape, the token id and its position.
//! Callers can match on variants; people reading a log get the whole story from
//! the `Display` text alone.

use std::path::PathBuf;

/// Everything that can go wrong in `braid-gpt2`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Gpt2Error {
    // ----- configuration -------------------------------------------------
    /// A model configuration is invalid or unknown.
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),

    /// A tensor handed to a layout conversion has the wrong length.
    #[error(transparent)]
    Layout(#[from] crate::layout::LayoutError),

    /// A parameter layout was made for another configuration than the one given.
    #[error("the parameter layout is for {layout}, but the configuration given is {config}")]
    LayoutMismatch {
        /// The layout's configuration (`Debug` form).
        layout: String,
        /// The configuration given (`Debug` form).
        config: String,
    },

    /// A setting of the model, optimizer or trainer is unusable (zero steps,
    /// a sequence longer than the model's context, ...).
    #[error("invalid {what}: {reason}")]
    InvalidSetting {
        /// The setting.
        what: &'static str,
        /// What is wrong with it.
        reason: String,
    },

    // ----- engine --------------------------------------------------------
    /// The Braid engine reported an error (a failed task, an unavailable
    /// backend, a failed collective).
    #[error(transparent)]
    Engine(#[from] braid::Error),
    /// Training failed; the trace of the run up to the failure was written
    /// (where the finished run's would have gone). [`root`](Self::root)
    /// gives the error inside, as it gives an error that came without a
    /// trace.
    #[error("{error} (the trace of the run up to the failure: {})", trace.display())]
    Failed {
        /// Why the run failed.
        error: Box<Gpt2Error>,
        /// The trace written.
        trace: PathBuf,
    },

    /// A step's loss or gradient norm was not finite: training diverged.
    /// Every rank stops at that step (both figures are the same on every
    /// rank), before that step's state is saved.
    #[error(
        "training diverged at step {step}: loss {loss}, gradient norm {grad_norm}; stopped \
         before saving this step's state (a checkpoint saved earlier is kept, though the \
         last may already hold the start of the divergence). A lower learning rate or a \
         longer warm-up usually helps"
    )]
    Diverged {
        /// The step whose figures were not finite.
        step: u64,
        /// Its mean loss across ranks.
        loss: f32,
        /// Its global gradient norm before clipping.
        grad_norm: f32,
    },

    /// The parameters after a step's update are not finite: its
    /// checkpoint is not saved (over the last one).
    #[error(
        "training diverged in the update of step {step}: its parameters are not finite; \
         its checkpoint was not saved (one saved earlier is kept)"
    )]
    StateNotFinite {
        /// The step whose update it was.
        step: u64,
    },

    // ----- files ---------------------------------------------------------
    /// An operating-system error while touching a file. The message ends
    /// with the OS error's, so that error is not also the `source()` (a
    /// report that walks the chain would say it twice).
    #[error("{op} {}: {error}", path.display())]
    Io {
        /// What was being done ("reading", "writing", "renaming to", ...).
        op: &'static str,
        /// The file or directory concerned.
        path: PathBuf,
        /// The OS error.
        error: std::io::Error,
    },

    // ----- tokenizer and token data --------------------------------------
    /// The BPE tokenizer could not be built or could not decode.
    #[error("GPT-2 tokenizer: {message}")]
    Tokenizer {
        /// What went wrong.
        message: String,
    },

    /// A token file does not start with llm.c's magic number.
    #[error(
        "{}: not an llm.c token file (magic number {found}, expected {expected})",
        path.display()
    )]
    BadMagic {
        /// The file.
        path: PathBuf,
        /// The first int32 of the file.
        found: i32,
        /// [`crate::data::TOKEN_FILE_MAGIC`].
        expected: i32,
    },

    /// A token file has a version this reader does not understand.
    #[error(
        "{}: unsupported llm.c token file version {found} (expected {expected})",
        path.display()
    )]
    BadVersion {
        /// The file.
        path: PathBuf,
        /// The version in the header.
        found: i32,
        /// The version this reader supports.
        expected: i32,
    },

    /// A token file's header is malformed (too short, negative count).
    #[error("{}: malformed llm.c token file header: {reason}", path.display())]
    BadTokenHeader {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },

    /// A token file holds fewer tokens than its header declares.
    #[error(
        "{}: truncated token file: header declares {declared} tokens but the file holds {found}",
        path.display()
    )]
    TruncatedTokenFile {
        /// The file.
        path: PathBuf,
        /// Token count in the header.
        declared: usize,
        /// Whole tokens actually present after the header.
        found: usize,
    },

    /// A token file holds bytes past the tokens its header declares.
    #[error(
        "{}: token file has {extra_bytes} bytes after the {declared} tokens its header declares",
        path.display()
    )]
    TrailingTokenData {
        /// The file.
        path: PathBuf,
        /// Token count in the header.
        declared: usize,
        /// Bytes past the declared tokens.
        extra_bytes: usize,
    },

    /// A text file is not valid UTF-8.
    #[error("{}: not valid UTF-8 text (first bad byte at offset {offset})", path.display())]
    NotUtf8 {
        /// The file.
        path: PathBuf,
        /// Byte offset of the first invalid sequence.
        offset: usize,
    },

    /// A token id is not below the vocabulary size.
    #[error(
        "{origin}: token id {id} at position {position} is out of range for vocabulary size {vocab_size}"
    )]
    TokenOutOfRange {
        /// Where the tokens came from (a path, "built-in corpus", ...).
        origin: String,
        /// Index of the token in the sequence.
        position: usize,
        /// The offending id.
        id: u32,
        /// The vocabulary size it must be below.
        vocab_size: usize,
    },

    /// A token id does not fit the 16-bit storage of llm.c token files.
    #[error("token id {id} at position {position} does not fit in 16 bits (llm.c token files store uint16)")]
    TokenTooWide {
        /// Index of the token in the sequence.
        position: usize,
        /// The offending id.
        id: u32,
    },

    // ----- data loader ---------------------------------------------------
    /// A data loader was asked for something impossible (zero batch, rank >= world size, ...).
    #[error("invalid data loader settings: {reason}")]
    InvalidLoader {
        /// What is wrong.
        reason: String,
    },

    /// The token stream is too short for even one global batch.
    #[error(
        "{origin}: too few tokens ({tokens}) for one step of {}{world_size} rank(s) x batch {batch_size} x sequence {seq_len} (needs at least {needed})",
        if *micro_batches > 1 { format!("{micro_batches} micro-batches x ") } else { String::new() }
    )]
    DatasetTooSmall {
        /// Where the tokens came from.
        origin: String,
        /// Tokens available.
        tokens: usize,
        /// Tokens one global step needs (`N*B*W*T + 1`).
        needed: usize,
        /// Micro-batches per step `N` (gradient accumulation).
        micro_batches: usize,
        /// Per-rank batch size.
        batch_size: usize,
        /// Sequence length.
        seq_len: usize,
        /// Number of ranks.
        world_size: usize,
    },

    /// A saved loader position does not fit the data it is restored onto.
    #[error(
        "cannot resume the data loader at token {position}: the data holds only {tokens} \
         tokens (the run being resumed read other, longer data, or its checkpoint is corrupt)"
    )]
    BadLoaderPosition {
        /// The saved position.
        position: usize,
        /// Tokens in the data.
        tokens: usize,
    },

    // ----- safetensors / weights -----------------------------------------
    /// A safetensors file could not be parsed.
    #[error("{}: unreadable or corrupt safetensors file: {message}", path.display())]
    Safetensors {
        /// The file.
        path: PathBuf,
        /// The parser's complaint.
        message: String,
    },

    /// A tensor the model needs is not in the file.
    #[error("{}: missing tensor {name:?}", path.display())]
    MissingTensor {
        /// The file.
        path: PathBuf,
        /// The name that was looked for.
        name: String,
    },

    /// A tensor has the wrong shape.
    #[error("{}: tensor {name:?} has shape {found:?}, expected {expected:?}", path.display())]
    ShapeMismatch {
        /// The file.
        path: PathBuf,
        /// The tensor.
        name: String,
        /// The shape the configuration implies (as stored in the file's convention).
        expected: Vec<usize>,
        /// The shape in the file.
        found: Vec<usize>,
    },

    /// A tensor has a dtype that cannot be converted to f32.
    #[error(
        "{}: tensor {name:?} has unsupported dtype {dtype} (supported: F32, F16, BF16)",
        path.display()
    )]
    UnsupportedDtype {
        /// The file.
        path: PathBuf,
        /// The tensor.
        name: String,
        /// The dtype found.
        dtype: String,
    },

    /// The file holds a tensor the model does not have (e.g. more layers than the config).
    #[error(
        "{}: unexpected tensor {name:?} (not part of the model for this configuration)",
        path.display()
    )]
    UnexpectedTensor {
        /// The file.
        path: PathBuf,
        /// The tensor.
        name: String,
    },

    /// The model configuration cannot be inferred from a weights file.
    #[error("{}: cannot infer the GPT-2 configuration: {reason}", path.display())]
    ConfigInference {
        /// The file.
        path: PathBuf,
        /// Why not.
        reason: String,
    },

    /// A flat buffer (parameters, moments, token ids) has the wrong length
    /// for the model's layout or batch shape.
    #[error("{what} has {found} elements, expected {expected} for this configuration")]
    LengthMismatch {
        /// Which buffer ("params", "adam_m", ...).
        what: String,
        /// Length the layout implies.
        expected: usize,
        /// Length given.
        found: usize,
    },

    // ----- checkpoints ---------------------------------------------------
    /// A checkpoint could not be written (a full disk, a file size limit, a
    /// directory made read-only). Says what the directory holds now.
    #[error("saving the checkpoint of step {step} in {}: {error}; {}", dir.display(), kept_note(*kept, *step))]
    CheckpointNotSaved {
        /// The step whose state was being saved.
        step: u64,
        /// The checkpoint directory.
        dir: PathBuf,
        /// The step of the checkpoint the directory holds after the failure
        /// (`None`: none, or none that can be read).
        kept: Option<u64>,
        /// Why it could not be written.
        error: Box<Gpt2Error>,
    },

    /// A checkpoint is missing, malformed or inconsistent.
    #[error("checkpoint {}: {reason}", path.display())]
    Checkpoint {
        /// The checkpoint directory or file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
}

/// What a checkpoint directory holds after the save of `step` failed.
fn kept_note(kept: Option<u64>, step: u64) -> String {
    match kept {
        None => "no checkpoint is there".into(),
        // The file was replaced; what failed came after (syncing the
        // directory).
        Some(s) if s == step => "the new checkpoint is in place, but may not be on disk".into(),
        Some(s) => format!("the checkpoint already there (step {s}) was kept as it was"),
    }
}

impl Gpt2Error {
    /// The error that made a run fail: the one inside [`Failed`](Self::Failed)
    /// (which only adds where the trace of the failed run was written), else
    /// `self`. Whether training fails with `Failed` or with the error itself
    /// depends on whether a trace was asked for, so match on
    /// `e.root()` to tell what went wrong (`matches!(e.root(),
    /// Gpt2Error::Diverged { .. })`), and on `e` for the trace.
    pub fn root(&self) -> &Gpt2Error {
        let mut e = self;
        while let Gpt2Error::Failed { error, .. } = e {
            e = error;
        }
        e
    }

    /// Wraps an I/O error with the operation and the path it concerns.
    pub fn io(op: &'static str, path: impl Into<PathBuf>, error: std::io::Error) -> Self {
        Gpt2Error::Io {
            op,
            path: path.into(),
            error,
        }
    }
}

impl From<braid::fs::FileError> for Gpt2Error {
    fn from(e: braid::fs::FileError) -> Self {
        Gpt2Error::io(e.op, e.path, e.error)
    }
}

impl From<braid::comm::EnvError> for Gpt2Error {
    fn from(e: braid::comm::EnvError) -> Self {
        Gpt2Error::InvalidSetting {
            what: "distributed environment",
            reason: e.to_string(),
        }
    }
}

/// `Result` with [`Gpt2Error`].
pub type Result<T, E = Gpt2Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn root_is_the_error_inside_failed() {
        let diverged = || Gpt2Error::Diverged {
            step: 3,
            loss: f32::NAN,
            grad_norm: f32::INFINITY,
        };
        let plain = diverged();
        assert!(matches!(plain.root(), Gpt2Error::Diverged { step: 3, .. }));
        let traced = Gpt2Error::Failed {
            error: Box::new(diverged()),
            trace: PathBuf::from("trace.json"),
        };
        assert!(!matches!(traced, Gpt2Error::Diverged { .. }));
        assert!(matches!(traced.root(), Gpt2Error::Diverged { step: 3, .. }));
        let other = Gpt2Error::StateNotFinite { step: 4 };
        assert!(std::ptr::eq(other.root(), &other));
    }

    #[test]
    fn errors_cross_threads() {
        fn assert_send_sync<T: Send + Sync + 'static>() {}
        assert_send_sync::<Gpt2Error>();
    }
}

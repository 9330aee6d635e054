//! Training checkpoints: parameters, AdamW moments, and everything needed to
//! resume a run exactly (step, data loader position, RNG state, optimizer
//! hyper-parameters).
//!
//! # On disk
//!
//! A checkpoint is a directory holding one file, [`CHECKPOINT_FILE`]: a
//! safetensors file with three 1-D F32 tensors `params`, `adam_m`, `adam_v`
//! (flat, in [`ParamLayout`](crate::layout::ParamLayout) order) and, under the
//! metadata key [`METADATA_KEY`], a JSON object with the format version, the
//! model configuration, the step, the loader state, the RNG state, the optimizer
//! hyper-parameters (with the last step's scheduled learning rate; the peak is
//! the extra `peak_lr`) and free-form extras. Any safetensors reader can open it;
//! `head -c 4096 checkpoint.safetensors` shows the metadata.
//!
//! # Atomicity
//!
//! Everything lives in one file, written to a temporary file beside it, `fsync`ed
//! and renamed over the old one (see `braid::fs`). A reader sees the old
//! checkpoint or the new one, never a mix or a prefix; a failed save (full disk,
//! bad path, invalid contents) leaves an existing checkpoint as it was, and a
//! crash mid-save leaves at worst a stray `checkpoint.safetensors.braid-tmp-*`
//! file that loading ignores.

use std::collections::{BTreeMap, HashMap};
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use braid::fs::write_atomic_with;
use serde::{Deserialize, Serialize};

use crate::config::Gpt2Config;
use crate::data::loader::LoaderState;
use crate::error::{Gpt2Error, Result};
use crate::weights::{read_header, F32View, Header};

/// Name of the file inside a checkpoint directory.
pub use crate::weights::CHECKPOINT_FILE_NAME as CHECKPOINT_FILE;
/// Safetensors metadata key holding the checkpoint's JSON metadata (defined
/// beside the safetensors reader, which refuses a checkpoint given as
/// weights by it).
pub use crate::weights::CHECKPOINT_METADATA_KEY as METADATA_KEY;
/// Version of the metadata format written by this crate.
pub const CHECKPOINT_VERSION: u32 = 1;

const TENSOR_NAMES: [&str; 3] = ["params", "adam_m", "adam_v"];

/// AdamW hyper-parameters. In a [`Checkpoint`] they are the values in force
/// at its last step: `learning_rate` is that step's scheduled rate, not the
/// peak rate of [`TrainOptions::optimizer`](crate::trainer::TrainOptions::optimizer).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct AdamWHyper {
    /// Learning rate: the peak in [`TrainOptions::optimizer`](crate::trainer::TrainOptions::optimizer),
    /// the last step's scheduled rate in a checkpoint.
    pub learning_rate: f32,
    /// First-moment decay.
    pub beta1: f32,
    /// Second-moment decay.
    pub beta2: f32,
    /// Denominator epsilon.
    pub eps: f32,
    /// Decoupled weight decay.
    pub weight_decay: f32,
}

impl Default for AdamWHyper {
    /// llm.c's `train_gpt2.c` values: `lr 3e-4, betas (0.9, 0.999), eps 1e-8, wd 0`.
    /// Not the trainer's: `TrainOptions::default().optimizer` is `lr 1e-3,
    /// betas (0.9, 0.95), eps 1e-8, wd 0.1`.
    fn default() -> Self {
        AdamWHyper {
            learning_rate: 3e-4,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        }
    }
}

/// Everything a training run needs to resume. Plain data: the trainer fills it.
#[derive(Debug, Clone, PartialEq)]
pub struct Checkpoint {
    /// The model configuration (fixes the lengths of the three vectors).
    pub config: Gpt2Config,
    /// Optimizer steps completed (AdamW's `t`; bias correction uses it).
    pub step: u64,
    /// Parameters, flat in layout order, `config.num_parameters()` long.
    pub params: Vec<f32>,
    /// AdamW first moments, same layout and length.
    pub adam_m: Vec<f32>,
    /// AdamW second moments, same layout and length.
    pub adam_v: Vec<f32>,
    /// Optimizer hyper-parameters as of the last step. Its `learning_rate`
    /// is that step's *scheduled* rate (after warm-up and decay), not the
    /// peak rate that [`TrainOptions::optimizer`](crate::trainer::TrainOptions::optimizer)
    /// holds: passing this value as `TrainOptions::optimizer` to resume
    /// silently lowers the peak, and the whole schedule with it. The
    /// trainer keeps the peak in [`extra`](Self::extra) under `peak_lr`
    /// (with the betas, epsilon and weight decay under `beta1`, `beta2`,
    /// `eps`, `weight_decay`; [`TrainOptions::checkpoint_extras`](crate::trainer::TrainOptions::checkpoint_extras)).
    pub optimizer: AdamWHyper,
    /// Data loader position (the same on every rank).
    pub loader: LoaderState,
    /// RNG state, if the run uses one (e.g. for sampling or dropout).
    pub rng_state: Option<Vec<u64>>,
    /// Anything else worth keeping: the trainer writes
    /// [`TrainOptions::checkpoint_extras`](crate::trainer::TrainOptions::checkpoint_extras)
    /// (batch size, world size, the peak learning rate and its schedule, the
    /// seed, ...).
    pub extra: BTreeMap<String, serde_json::Value>,
}

/// A checkpoint's metadata without its tensors (read from the header only).
#[derive(Debug, Clone, PartialEq)]
pub struct CheckpointInfo {
    /// The checkpoint file.
    pub path: PathBuf,
    /// The model configuration.
    pub config: Gpt2Config,
    /// Optimizer steps completed.
    pub step: u64,
    /// Optimizer hyper-parameters as of the last step: the scheduled
    /// learning rate, not the peak (see [`Checkpoint::optimizer`]).
    pub optimizer: AdamWHyper,
    /// Data loader position.
    pub loader: LoaderState,
    /// RNG state, if any.
    pub rng_state: Option<Vec<u64>>,
    /// Free-form extras.
    pub extra: BTreeMap<String, serde_json::Value>,
}

/// [`Gpt2Config`] as stored in the JSON metadata.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
struct ConfigRecord {
    max_seq_len: usize,
    vocab_size: usize,
    num_layers: usize,
    num_heads: usize,
    channels: usize,
}

impl From<Gpt2Config> for ConfigRecord {
    fn from(c: Gpt2Config) -> Self {
        ConfigRecord {
            max_seq_len: c.max_seq_len,
            vocab_size: c.vocab_size,
            num_layers: c.num_layers,
            num_heads: c.num_heads,
            channels: c.channels,
        }
    }
}

impl From<ConfigRecord> for Gpt2Config {
    fn from(c: ConfigRecord) -> Self {
        Gpt2Config {
            max_seq_len: c.max_seq_len,
            vocab_size: c.vocab_size,
            num_layers: c.num_layers,
            num_heads: c.num_heads,
            channels: c.channels,
        }
    }
}

/// The JSON metadata.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct MetaRecord {
    version: u32,
    config: ConfigRecord,
    step: u64,
    optimizer: AdamWHyper,
    loader: LoaderState,
    #[serde(default)]
    rng_state: Option<Vec<u64>>,
    #[serde(default)]
    extra: BTreeMap<String, serde_json::Value>,
}

fn ckpt_err(path: &Path, reason: impl Into<String>) -> Gpt2Error {
    Gpt2Error::Checkpoint {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

/// Refuses a checkpoint directory that [`save_checkpoint`] could not use: a
/// path that exists and is not a directory (a caller may check before a
/// run that saves at its end).
pub fn check_checkpoint_dir(dir: &Path) -> Result<()> {
    if dir.exists() && !dir.is_dir() {
        return Err(ckpt_err(
            dir,
            "the path exists and is not a directory; a checkpoint is a directory",
        ));
    }
    Ok(())
}

/// Makes the checkpoint directory, as a run saving into it would, and
/// tries a file in it: a directory [`save_checkpoint`] could not write is
/// found before the run, not after its last step.
pub fn prepare_checkpoint_dir(dir: &Path) -> Result<()> {
    check_checkpoint_dir(dir)?;
    std::fs::create_dir_all(dir).map_err(|e| Gpt2Error::io("creating", dir, e))?;
    match braid::fs::unwritable(&checkpoint_file(dir)) {
        Some(why) => Err(ckpt_err(dir, why)),
        None => Ok(()),
    }
}

/// A run's hold on its checkpoint directory ([`lock_checkpoint_dir`]),
/// released when dropped or when the process ends, however it ends.
#[derive(Debug)]
pub struct CheckpointLock {
    _file: std::fs::File,
}

/// The lock file inside a checkpoint directory.
pub const LOCK_FILE: &str = ".lock";

/// Takes the checkpoint directory `dir` for one run, after
/// [`prepare_checkpoint_dir`] (made if missing, and found writable): an
/// exclusive `flock` on `dir/.lock`, holding this process's id. A second
/// run naming the directory while the first holds it — started beside it,
/// or resuming it — is refused, naming the holder, where it would
/// otherwise overwrite the first run's checkpoints without a word. The OS
/// drops the lock with the process (a crash or a kill leaves nothing
/// stale). Advisory, and local: two machines sharing the directory over
/// NFS may not see each other's lock.
pub fn lock_checkpoint_dir(dir: &Path) -> Result<CheckpointLock> {
    use std::io::Write;
    prepare_checkpoint_dir(dir)?;
    let path = dir.join(LOCK_FILE);
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(|e| Gpt2Error::io("opening", &path, e))?;
    #[cfg(unix)]
    {
        use std::os::fd::AsRawFd;
        // SAFETY: a valid descriptor owned by `file`; no pointers.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::WouldBlock {
                return Err(Gpt2Error::io("locking", &path, e));
            }
            let mut holder = String::new();
            let _ = file.read_to_string(&mut holder);
            let holder = match holder.trim() {
                "" => String::new(),
                pid => format!(" (process {pid})"),
            };
            return Err(ckpt_err(
                dir,
                format!(
                    "another run{holder} is using this checkpoint directory (it holds {}); \
                     choose another --checkpoint-dir, or wait for it to end",
                    path.display()
                ),
            ));
        }
    }
    // Who holds it, for the message of a run refused meanwhile.
    file.set_len(0)
        .and_then(|()| file.seek(SeekFrom::Start(0)).map(|_| ()))
        .and_then(|()| writeln!(file, "{}", std::process::id()))
        .map_err(|e| Gpt2Error::io("writing", &path, e))?;
    Ok(CheckpointLock { _file: file })
}

/// The checkpoint file inside a checkpoint directory.
pub fn checkpoint_file(dir: impl AsRef<Path>) -> PathBuf {
    dir.as_ref().join(CHECKPOINT_FILE)
}

fn validate(dir: &Path, ckpt: &Checkpoint) -> Result<()> {
    ckpt.config
        .validate()
        .map_err(|e| ckpt_err(dir, format!("invalid configuration: {e}")))?;
    let n = ckpt.config.num_parameters();
    for (what, v) in TENSOR_NAMES
        .iter()
        .zip([&ckpt.params, &ckpt.adam_m, &ckpt.adam_v])
    {
        if v.len() != n {
            return Err(Gpt2Error::LengthMismatch {
                what: what.to_string(),
                expected: n,
                found: v.len(),
            });
        }
    }
    let o = &ckpt.optimizer;
    for (name, x) in [
        ("learning_rate", o.learning_rate),
        ("beta1", o.beta1),
        ("beta2", o.beta2),
        ("eps", o.eps),
        ("weight_decay", o.weight_decay),
    ] {
        if !x.is_finite() {
            return Err(ckpt_err(
                dir,
                format!("optimizer {name} is {x}, which JSON cannot store"),
            ));
        }
    }
    Ok(())
}

/// Saves `ckpt` into directory `dir` (created if missing), atomically: on any
/// failure an existing checkpoint in `dir` is left untouched.
pub fn save_checkpoint(dir: impl AsRef<Path>, ckpt: &Checkpoint) -> Result<()> {
    save_checkpoint_with(dir.as_ref(), ckpt, |_| Ok(()))
}

/// [`save_checkpoint`] with a hook run after the temporary file is complete and
/// before it replaces the checkpoint (tests use it to fail a save half-way).
fn save_checkpoint_with(
    dir: &Path,
    ckpt: &Checkpoint,
    before_rename: impl FnOnce(&Path) -> Result<()>,
) -> Result<()> {
    validate(dir, ckpt)?;
    check_checkpoint_dir(dir)?;
    std::fs::create_dir_all(dir).map_err(|e| Gpt2Error::io("creating directory", dir, e))?;
    let meta = MetaRecord {
        version: CHECKPOINT_VERSION,
        config: ckpt.config.into(),
        step: ckpt.step,
        optimizer: ckpt.optimizer,
        loader: ckpt.loader,
        rng_state: ckpt.rng_state.clone(),
        extra: ckpt.extra.clone(),
    };
    let json = serde_json::to_string(&meta)
        .map_err(|e| ckpt_err(dir, format!("encoding metadata: {e}")))?;
    let metadata = HashMap::from([
        (METADATA_KEY.to_string(), json),
        ("format".to_string(), "braid".to_string()),
    ]);
    let shape = [ckpt.params.len()];
    let views = TENSOR_NAMES
        .iter()
        .zip([&ckpt.params, &ckpt.adam_m, &ckpt.adam_v])
        .map(|(name, v)| {
            (
                *name,
                F32View {
                    shape: &shape,
                    data: v,
                },
            )
        });
    let file = checkpoint_file(dir);
    write_atomic_with(&file, |tmp| {
        crate::weights::serialize_sorted(views, metadata, tmp).map_err(|e| match e {
            safetensors::SafeTensorError::IoError(source) => Gpt2Error::io("writing", tmp, source),
            other => ckpt_err(tmp, other.to_string()),
        })?;
        before_rename(tmp)
    })
    .map_err(|error| Gpt2Error::CheckpointNotSaved {
        step: ckpt.step,
        dir: dir.to_path_buf(),
        kept: read_checkpoint_info(dir).ok().map(|i| i.step),
        error: Box::new(error),
    })
}

fn open_checkpoint(dir: &Path) -> Result<(PathBuf, std::fs::File, Header, MetaRecord)> {
    if !dir.is_dir() {
        return Err(ckpt_err(
            dir,
            if dir.exists() {
                "not a directory"
            } else {
                "no such directory"
            },
        ));
    }
    let file = checkpoint_file(dir);
    if !file.is_file() {
        let why = match file.exists() {
            true => format!("{CHECKPOINT_FILE} in the directory is not a file"),
            false => format!("no {CHECKPOINT_FILE} in the directory"),
        };
        return Err(ckpt_err(dir, why));
    }
    let mut f = std::fs::File::open(&file).map_err(|e| Gpt2Error::io("opening", &file, e))?;
    let header = read_header(&file, &mut f)?;
    let json = header.metadata.get(METADATA_KEY).ok_or_else(|| {
        ckpt_err(
            &file,
            format!("missing metadata key {METADATA_KEY:?}: not a Braid checkpoint"),
        )
    })?;
    let meta: MetaRecord =
        serde_json::from_str(json).map_err(|e| ckpt_err(&file, format!("bad metadata: {e}")))?;
    if meta.version != CHECKPOINT_VERSION {
        return Err(ckpt_err(
            &file,
            format!(
                "checkpoint format version {} is not supported (this build reads {CHECKPOINT_VERSION})",
                meta.version
            ),
        ));
    }
    let cfg: Gpt2Config = meta.config.into();
    cfg.validate()
        .map_err(|e| ckpt_err(&file, format!("invalid configuration {cfg:?}: {e}")))?;
    Ok((file, f, header, meta))
}

fn info_from(path: PathBuf, meta: MetaRecord) -> CheckpointInfo {
    CheckpointInfo {
        path,
        config: meta.config.into(),
        step: meta.step,
        optimizer: meta.optimizer,
        loader: meta.loader,
        rng_state: meta.rng_state,
        extra: meta.extra,
    }
}

/// Reads a checkpoint's metadata (config, step, loader, ...) without its tensors.
pub fn read_checkpoint_info(dir: impl AsRef<Path>) -> Result<CheckpointInfo> {
    let (file, _, _, meta) = open_checkpoint(dir.as_ref())?;
    Ok(info_from(file, meta))
}

/// Loads and validates the checkpoint in `dir`: metadata present and complete,
/// configuration valid, each tensor present, F32, 1-D and
/// `config.num_parameters()` long. Errors name the file and what is wrong.
pub fn load_checkpoint(dir: impl AsRef<Path>) -> Result<Checkpoint> {
    let (_, meta, mut tensors) = read_tensors(dir.as_ref(), &TENSOR_NAMES)?;
    let adam_v = tensors.pop().expect("three tensors");
    let adam_m = tensors.pop().expect("three tensors");
    let params = tensors.pop().expect("three tensors");
    Ok(Checkpoint {
        config: meta.config.into(),
        step: meta.step,
        params,
        adam_m,
        adam_v,
        optimizer: meta.optimizer,
        loader: meta.loader,
        rng_state: meta.rng_state,
        extra: meta.extra,
    })
}

/// The parameters of the checkpoint in `dir` with its metadata, the
/// `params` tensor checked as [`load_checkpoint`] checks it, without
/// reading or checking the optimizer's moments (two thirds of the file):
/// what evaluation, sampling and export need.
pub fn load_checkpoint_params(dir: impl AsRef<Path>) -> Result<(CheckpointInfo, Vec<f32>)> {
    let (file, meta, mut tensors) = read_tensors(dir.as_ref(), &TENSOR_NAMES[..1])?;
    let params = tensors.pop().expect("one tensor");
    Ok((info_from(file, meta), params))
}

/// The file and metadata of the checkpoint in `dir` and its tensors
/// `names`, each checked: present, F32, 1-D and `config.num_parameters()`
/// long.
fn read_tensors(dir: &Path, names: &[&str]) -> Result<(PathBuf, MetaRecord, Vec<Vec<f32>>)> {
    let (file, mut f, header, meta) = open_checkpoint(dir)?;
    let cfg: Gpt2Config = meta.config.into();
    let n = cfg.num_parameters();
    // The header first (no data is read for a file it refuses): each
    // tensor asked for, present, F32 and of the model's size; then no
    // tensor beside the three.
    let mut entries = Vec::with_capacity(names.len());
    for &name in names {
        let entry = header
            .tensors
            .get(name)
            .ok_or_else(|| ckpt_err(&file, format!("missing tensor {name:?}")))?;
        if entry.dtype != "F32" {
            return Err(ckpt_err(
                &file,
                format!("tensor {name:?} has dtype {}, expected F32", entry.dtype),
            ));
        }
        if entry.shape != [n] || entry.end - entry.begin != 4 * n as u64 {
            return Err(ckpt_err(
                &file,
                format!(
                    "tensor {name:?} has shape {:?}, expected [{n}] for {cfg}",
                    entry.shape
                ),
            ));
        }
        entries.push((name, entry));
    }
    // A checkpoint holds these three and nothing else: another tensor is
    // from something else (a resume would drop it unsaid).
    if let Some(other) = header
        .tensors
        .keys()
        .find(|k| !TENSOR_NAMES.contains(&k.as_str()))
    {
        return Err(ckpt_err(
            &file,
            format!(
                "holds a tensor {other:?}, which is not a Braid checkpoint's (those are {})",
                TENSOR_NAMES.map(|t| format!("{t:?}")).join(", ")
            ),
        ));
    }
    let mut tensors = Vec::with_capacity(names.len());
    for (name, entry) in entries {
        let mut v = vec![0.0f32; n];
        f.seek(SeekFrom::Start(header.data_start + entry.begin))
            .map_err(|e| Gpt2Error::io("seeking in", &file, e))?;
        f.read_exact(bytemuck::cast_slice_mut(&mut v))
            .map_err(|e| Gpt2Error::io("reading", &file, e))?;
        if cfg!(target_endian = "big") {
            for x in &mut v {
                *x = f32::from_bits(u32::from_le(x.to_bits()));
            }
        }
        // A run saves only finite parameters: anything else is corruption,
        // found here rather than as a "diverged" first step.
        if let Some(i) = v.iter().position(|x| !x.is_finite()) {
            return Err(ckpt_err(
                &file,
                format!(
                    "tensor {name:?} holds {} at index {i}: the file is corrupt (a run saves \
                     finite values only)",
                    v[i]
                ),
            ));
        }
        // AdamW's second moment is a mean of squares.
        let negative = (name == "adam_v").then(|| v.iter().position(|&x| x < 0.0));
        if let Some(Some(i)) = negative {
            return Err(ckpt_err(
                &file,
                format!(
                    "tensor \"adam_v\" holds {} at index {i}: the file is corrupt (AdamW's \
                     second moment is never negative)",
                    v[i]
                ),
            ));
        }
        tensors.push(v);
    }
    debug_assert!(header.file_len >= header.data_start);
    Ok((file, meta, tensors))
}

/// The checkpoint with the highest step among the sub-directories of `root`
/// that hold a [`CHECKPOINT_FILE`]; `None` if there is none (or no `root`).
pub fn latest_checkpoint(root: impl AsRef<Path>) -> Result<Option<PathBuf>> {
    let root = root.as_ref();
    if !root.is_dir() {
        return Ok(None);
    }
    let mut best: Option<(u64, PathBuf)> = None;
    let entries = std::fs::read_dir(root).map_err(|e| Gpt2Error::io("listing", root, e))?;
    for entry in entries {
        let dir = entry.map_err(|e| Gpt2Error::io("listing", root, e))?.path();
        if !checkpoint_file(&dir).is_file() {
            continue;
        }
        let info = read_checkpoint_info(&dir)?;
        let better = match &best {
            None => true,
            Some((step, _)) => info.step > *step,
        };
        if better {
            best = Some((info.step, dir));
        }
    }
    Ok(best.map(|(_, dir)| dir))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny_checkpoint(seed: f32) -> Checkpoint {
        let config = Gpt2Config::tiny();
        let n = config.num_parameters();
        Checkpoint {
            config,
            step: 7,
            params: (0..n).map(|i| seed + i as f32).collect(),
            adam_m: vec![seed; n],
            adam_v: vec![seed * 2.0; n],
            optimizer: AdamWHyper::default(),
            loader: LoaderState {
                position: 3,
                epoch: 1,
            },
            rng_state: None,
            extra: BTreeMap::new(),
        }
    }

    #[test]
    fn a_save_failing_after_the_data_is_written_keeps_the_old_checkpoint() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("ckpt");
        let old = tiny_checkpoint(1.0);
        save_checkpoint(&dir, &old).unwrap();
        let new = Checkpoint {
            step: 8,
            ..tiny_checkpoint(2.0)
        };
        let err = save_checkpoint_with(&dir, &new, |tmp| {
            // The new checkpoint is complete in the temporary file...
            let len = std::fs::metadata(tmp).unwrap().len();
            assert!(len > 3 * 4 * new.params.len() as u64);
            // ...and then the machine "fails".
            Err(ckpt_err(tmp, "simulated failure"))
        })
        .unwrap_err();
        // The message names the step, the directory and what is kept.
        let msg = err.to_string();
        for needle in [
            "simulated failure",
            "saving the checkpoint of step 8 in",
            "ckpt",
            "the checkpoint already there (step 7) was kept",
        ] {
            assert!(msg.contains(needle), "no {needle:?} in: {msg}");
        }
        assert_eq!(load_checkpoint(&dir).unwrap(), old);
        let names: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(names, vec![CHECKPOINT_FILE.to_string()]);
    }

    /// A checkpoint holding a non-finite value (a corrupt file: runs save
    /// finite states only) is refused on load, naming the tensor and the
    /// index, rather than trained on until it "diverges".
    #[test]
    fn non_finite_values_are_refused_on_load() {
        let root = tempfile::tempdir().unwrap();
        for (i, name) in TENSOR_NAMES.iter().enumerate() {
            let dir = root.path().join(name);
            let mut c = tiny_checkpoint(1.0);
            [&mut c.params, &mut c.adam_m, &mut c.adam_v][i][5] = f32::NAN;
            save_checkpoint(&dir, &c).unwrap();
            let e = load_checkpoint(&dir).unwrap_err().to_string();
            assert!(
                e.contains(&format!("tensor {name:?} holds NaN at index 5")),
                "{e}"
            );
            // Evaluation reads the parameters only.
            let params = load_checkpoint_params(&dir);
            assert_eq!(params.is_err(), i == 0, "{name}");
        }
    }
}

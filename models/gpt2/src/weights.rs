//! Hugging Face `GPT2LMHeadModel` weights in safetensors format.
//!
//! Loading accepts tensor names with or without the `transformer.` prefix (the
//! published `gpt2` checkpoints have none, `save_pretrained` of a
//! `GPT2LMHeadModel` writes it), takes `lm_head.weight` only if it is `wte`
//! bit for bit (tied, as GPT-2's is; an untied one is an error), ignores the
//! attention buffers `h.N.attn.bias` / `h.N.attn.masked_bias`, converts F32, F16
//! and BF16 to f32, and transposes the `Conv1D` weights, stored `(in, out)` by
//! Hugging Face, into Braid's `(out, in)` layout. Anything else in the file is an
//! error, as is a missing tensor or a wrong shape: a checkpoint for another
//! configuration is never loaded half-way.
//!
//! Saving writes the `transformer.`-prefixed names and Hugging Face's storage
//! order, without `lm_head.weight` (as `save_pretrained` does for tied weights),
//! with the model sizes in the safetensors metadata so that
//! [`infer_config_from_safetensors`] can read them back, heads included.

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io::Read;
use std::path::{Path, PathBuf};

use braid::fs::write_atomic_with;
use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;

use crate::config::Gpt2Config;
use crate::error::{Gpt2Error, Result};
use crate::layout::ParamLayout;

/// Prefix of the transformer's tensors in `GPT2LMHeadModel`.
pub const HF_PREFIX: &str = "transformer.";

/// The safetensors metadata key of a Braid training checkpoint
/// (`checkpoint::METADATA_KEY`): a file with it is a checkpoint, not weights.
pub const CHECKPOINT_METADATA_KEY: &str = "braid.checkpoint";
/// The file of a checkpoint's directory (`checkpoint::CHECKPOINT_FILE`):
/// a directory given as weights that holds it is a checkpoint's. Defined
/// here, beside the reader that tells the two apart, as the metadata key is
/// (the checkpoint module reads through this one).
pub const CHECKPOINT_FILE_NAME: &str = "checkpoint.safetensors";

/// Strips the optional `transformer.` prefix.
fn short_name(name: &str) -> &str {
    name.strip_prefix(HF_PREFIX).unwrap_or(name)
}

/// Whether a (short) name is a tensor the loader skips: the attention
/// mask buffers. (The tied classifier is not loaded either, but checked
/// against the embedding, `check_tied`.)
fn is_ignored(short: &str) -> bool {
    let parts: Vec<&str> = short.split('.').collect();
    matches!(
        parts.as_slice(),
        ["h", n, "attn", "bias" | "masked_bias"] if n.parse::<usize>().is_ok()
    )
}

/// IEEE 754 half precision to single precision (exact).
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = u32::from(h >> 15) << 31;
    let exp = u32::from((h >> 10) & 0x1f);
    let man = u32::from(h & 0x3ff);
    let bits = match (exp, man) {
        (0, 0) => sign,
        (0, _) => {
            // Subnormal: value = man * 2^-24; normalise it.
            let shift = man.leading_zeros() - 21; // bring the top bit to bit 10
            let man = (man << shift) & 0x3ff;
            let exp = 127 - 15 + 1 - shift;
            sign | (exp << 23) | (man << 13)
        }
        (0x1f, 0) => sign | 0x7f80_0000,
        (0x1f, _) => sign | 0x7fc0_0000 | (man << 13),
        _ => sign | ((exp + 127 - 15) << 23) | (man << 13),
    };
    f32::from_bits(bits)
}

/// bfloat16 to single precision (exact).
pub fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits(u32::from(b) << 16)
}

fn to_f32(path: &Path, name: &str, view: &TensorView<'_>) -> Result<Vec<f32>> {
    let data = view.data();
    Ok(match view.dtype() {
        Dtype::F32 => data
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        Dtype::F16 => data
            .chunks_exact(2)
            .map(|c| f16_to_f32(u16::from_le_bytes([c[0], c[1]])))
            .collect(),
        Dtype::BF16 => data
            .chunks_exact(2)
            .map(|c| bf16_to_f32(u16::from_le_bytes([c[0], c[1]])))
            .collect(),
        other => {
            return Err(Gpt2Error::UnsupportedDtype {
                path: path.to_path_buf(),
                name: name.to_string(),
                dtype: other.to_string(),
            })
        }
    })
}

/// Refuses `params` of another length than `layout`'s parameters.
fn check_params_len(params: &[f32], layout: &ParamLayout) -> Result<()> {
    if params.len() != layout.total {
        return Err(Gpt2Error::LengthMismatch {
            what: "params".into(),
            expected: layout.total,
            found: params.len(),
        });
    }
    Ok(())
}

fn check_layout(cfg: &Gpt2Config, layout: &ParamLayout) -> Result<()> {
    if layout.config() != cfg {
        return Err(Gpt2Error::LayoutMismatch {
            layout: format!("{:?}", layout.config()),
            config: format!("{cfg:?}"),
        });
    }
    Ok(())
}

/// Loads a Hugging Face `GPT2LMHeadModel` `model.safetensors` into one flat f32
/// buffer in `layout`'s order (see the module docs for what is accepted).
pub fn load_hf_safetensors(
    path: impl AsRef<Path>,
    cfg: &Gpt2Config,
    layout: &ParamLayout,
) -> Result<Vec<f32>> {
    let path = path.as_ref();
    check_layout(cfg, layout)?;
    let bytes = std::fs::read(path).map_err(|e| Gpt2Error::io("reading", path, e))?;
    let st = SafeTensors::deserialize(&bytes).map_err(|e| Gpt2Error::Safetensors {
        path: path.to_path_buf(),
        message: e.to_string(),
    })?;

    // short name -> (name in the file, view)
    let mut by_short: HashMap<&str, (&str, TensorView<'_>)> = HashMap::new();
    let known: BTreeSet<&str> = layout.tensors.iter().map(|t| short_name(&t.name)).collect();
    let mut lm_head = None;
    for (name, view) in st.iter() {
        let short = short_name(name);
        if short == "lm_head.weight" {
            lm_head = Some((name, view));
            continue;
        }
        if is_ignored(short) {
            continue;
        }
        if !known.contains(short) {
            return Err(Gpt2Error::UnexpectedTensor {
                path: path.to_path_buf(),
                name: name.to_string(),
            });
        }
        if let Some((other, _)) = by_short.insert(short, (name, view)) {
            return Err(Gpt2Error::Safetensors {
                path: path.to_path_buf(),
                message: format!("tensor {short:?} appears twice (as {other:?} and {name:?})"),
            });
        }
    }

    let mut flat = vec![0.0f32; layout.total];
    for t in &layout.tensors {
        let short = short_name(&t.name);
        let Some((name, view)) = by_short.get(short) else {
            return Err(Gpt2Error::MissingTensor {
                path: path.to_path_buf(),
                name: t.name.clone(),
            });
        };
        let expected = t.hf_shape();
        if view.shape() != expected.as_slice() {
            return Err(Gpt2Error::ShapeMismatch {
                path: path.to_path_buf(),
                name: name.to_string(),
                expected,
                found: view.shape().to_vec(),
            });
        }
        let data = to_f32(path, name, view)?;
        // A weight that is not finite makes every loss NaN: corruption,
        // named here rather than scored.
        if let Some(i) = data.iter().position(|x| !x.is_finite()) {
            return Err(Gpt2Error::Safetensors {
                path: path.to_path_buf(),
                message: format!("tensor {name:?} holds {} at index {i}", data[i]),
            });
        }
        t.copy_from_hf(&data, &mut flat)?;
    }
    if let Some((name, view)) = lm_head {
        check_tied(path, name, &view, &flat[layout.wte()])?;
    }
    Ok(flat)
}

/// A classifier `lm_head.weight` in the file must be the token embedding
/// it is tied to (as `transformers` writes a tied model that keeps it),
/// bit for bit: Braid's GPT-2 has no classifier of its own, so an untied
/// one (a fine-tune that untied it) would be dropped and the model scored
/// as another.
fn check_tied(path: &Path, name: &str, view: &TensorView<'_>, wte: &[f32]) -> Result<()> {
    let fail = |message: String| Gpt2Error::Safetensors {
        path: path.to_path_buf(),
        message,
    };
    let head = to_f32(path, name, view)?;
    if head.len() != wte.len() {
        return Err(fail(format!(
            "{name} has shape {:?}, not the token embedding's it is tied to",
            view.shape()
        )));
    }
    match head
        .iter()
        .zip(wte)
        .position(|(a, b)| a.to_bits() != b.to_bits())
    {
        None => Ok(()),
        Some(i) => Err(fail(format!(
            "{name} differs from the token embedding (first at element {i}: {} against {}): \
             an untied classifier, which GPT-2 and Braid tie to the embedding",
            head[i], wte[i]
        ))),
    }
}

/// One tensor's entry in a safetensors header.
#[derive(Debug, Clone)]
pub(crate) struct HeaderEntry {
    pub dtype: String,
    pub shape: Vec<usize>,
    /// Byte range within the data section.
    pub begin: u64,
    pub end: u64,
}

/// The JSON header of a safetensors file, read without loading the tensors.
#[derive(Debug)]
pub(crate) struct Header {
    pub tensors: HashMap<String, HeaderEntry>,
    pub metadata: HashMap<String, String>,
    /// File offset of the data section.
    pub data_start: u64,
    /// Size of the file.
    pub file_len: u64,
}

/// Reads and checks the header of a safetensors file: every tensor's byte range
/// lies inside the file and the data section ends where the file ends.
pub(crate) fn read_header(path: &Path, f: &mut std::fs::File) -> Result<Header> {
    let corrupt = |message: String| Gpt2Error::Safetensors {
        path: path.to_path_buf(),
        message,
    };
    let meta = f
        .metadata()
        .map_err(|e| Gpt2Error::io("reading", path, e))?;
    if meta.is_dir() {
        let e = std::io::Error::new(
            std::io::ErrorKind::IsADirectory,
            "is a directory; name the .safetensors file in it",
        );
        return Err(Gpt2Error::io("reading", path, e));
    }
    let file_len = meta.len();
    let mut n = [0u8; 8];
    f.read_exact(&mut n).map_err(|e| match e.kind() {
        std::io::ErrorKind::UnexpectedEof => {
            corrupt(format!("file is {file_len} bytes, too short for a header"))
        }
        _ => Gpt2Error::io("reading", path, e),
    })?;
    let n = u64::from_le_bytes(n);
    if n > 100_000_000 || n + 8 > file_len {
        return Err(corrupt(format!(
            "header length {n} does not fit a {file_len}-byte file"
        )));
    }
    let mut buf = vec![0u8; n as usize];
    f.read_exact(&mut buf)
        .map_err(|e| Gpt2Error::io("reading", path, e))?;
    let json: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&buf).map_err(|e| corrupt(format!("header is not JSON: {e}")))?;
    let data_start = 8 + n;
    let data_len = file_len - data_start;
    let mut tensors = HashMap::new();
    let mut metadata = HashMap::new();
    let mut data_end = 0;
    for (name, value) in json {
        if name == "__metadata__" {
            if let Some(m) = value.as_object() {
                for (k, v) in m {
                    if let Some(s) = v.as_str() {
                        metadata.insert(k.clone(), s.to_string());
                    }
                }
            }
            continue;
        }
        #[derive(serde::Deserialize)]
        struct Raw {
            dtype: String,
            shape: Vec<usize>,
            data_offsets: (u64, u64),
        }
        let raw: Raw = serde_json::from_value(value)
            .map_err(|e| corrupt(format!("bad header entry for tensor {name:?}: {e}")))?;
        let (begin, end) = raw.data_offsets;
        if begin > end || end > data_len {
            return Err(corrupt(format!(
                "tensor {name:?} claims bytes {begin}..{end} of a {data_len}-byte data section"
            )));
        }
        data_end = data_end.max(end);
        tensors.insert(
            name,
            HeaderEntry {
                dtype: raw.dtype,
                shape: raw.shape,
                begin,
                end,
            },
        );
    }
    if data_end != data_len {
        return Err(corrupt(format!(
            "the tensors cover {data_end} bytes but the data section has {data_len}"
        )));
    }
    Ok(Header {
        tensors,
        metadata,
        data_start,
        file_len,
    })
}

/// The error for a directory given where a weights file is expected: what
/// to name instead, by what the directory holds (a training checkpoint is
/// passed as one; a Hugging Face model directory's weights file is named).
fn directory_given(dir: &Path) -> Gpt2Error {
    let d = dir.display();
    let why = if dir.join(CHECKPOINT_FILE_NAME).is_file() {
        format!(
            "is a directory holding a Braid training checkpoint: pass it as `--checkpoint {d}` \
             (eval, sample), continue it with `train --resume --checkpoint-dir {d}`, or write \
             its weights with `export --checkpoint {d} --save-weights <file or directory/>`"
        )
    } else if dir.join(HF_WEIGHTS_FILE).is_file() {
        format!(
            "is a directory; name the weights file in it, {}",
            dir.join(HF_WEIGHTS_FILE).display()
        )
    } else {
        "is a directory; name the .safetensors file in it".into()
    };
    Gpt2Error::io(
        "reading",
        dir,
        std::io::Error::new(std::io::ErrorKind::IsADirectory, why),
    )
}

/// Heads of the published GPT-2 sizes, by channels.
pub fn standard_num_heads(channels: usize) -> Option<usize> {
    match channels {
        768 => Some(12),
        1024 => Some(16),
        1280 => Some(20),
        1600 => Some(25),
        _ => None,
    }
}

/// Metadata keys (and `config.json` keys) that may hold the number of heads.
const HEAD_KEYS: [&str; 3] = ["n_head", "num_heads", "num_attention_heads"];

/// The heads `config.json` beside the weights at `path` gives: `None`
/// when there is no such file, or it names no head count. A file that is
/// there but cannot be read, is not JSON, or gives a head count that is not
/// a positive integer is an error (`Err` with the reason): the heads would
/// otherwise be guessed from the published sizes, and a model of another
/// head count scored wrongly without a word.
fn heads_from_config_json(path: &Path) -> std::result::Result<Option<usize>, String> {
    let Some(dir) = path.parent() else {
        return Ok(None);
    };
    let cfg_path = dir.join(HF_CONFIG_FILE);
    let shown = cfg_path.display();
    let text = match std::fs::read_to_string(&cfg_path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("{shown} beside it cannot be read: {e}")),
        Ok(text) => text,
    };
    let json: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| format!("{shown} beside it is not JSON: {e}"))?;
    let Some((key, v)) = HEAD_KEYS.iter().find_map(|k| Some((k, json.get(*k)?))) else {
        return Ok(None);
    };
    match v.as_u64() {
        Some(h) if h > 0 => Ok(Some(h as usize)),
        _ => Err(format!(
            "{shown} beside it gives `{key}` {v}, not a positive integer"
        )),
    }
}

/// Infers the model configuration from a `GPT2LMHeadModel` safetensors file by
/// reading only its header: `vocab_size` and `channels` from `wte`,
/// `max_seq_len` from `wpe`, `num_layers` from the `h.N.` blocks. The number of
/// heads is not visible in any shape: it comes from the file's metadata
/// (`n_head`, as [`save_hf_safetensors`] writes it), else from `config.json`
/// beside the file (a Hugging Face model directory; one that is there but
/// cannot be read, is not JSON or gives no usable count is an error), else
/// from the published sizes (768→12, 1024→16, 1280→20, 1600→25).
pub fn infer_config_from_safetensors(path: impl AsRef<Path>) -> Result<Gpt2Config> {
    let path = path.as_ref();
    if path.is_dir() {
        return Err(directory_given(path));
    }
    let mut f = std::fs::File::open(path).map_err(|e| Gpt2Error::io("opening", path, e))?;
    let header = read_header(path, &mut f)?;
    let fail = |reason: String| Gpt2Error::ConfigInference {
        path: path.to_path_buf(),
        reason,
    };
    let shape_of = |short: &str| -> Option<&Vec<usize>> {
        header
            .tensors
            .get(short)
            .or_else(|| header.tensors.get(&format!("{HF_PREFIX}{short}")))
            .map(|e| &e.shape)
    };
    if header.metadata.contains_key(CHECKPOINT_METADATA_KEY) {
        return Err(fail(
            "it is a Braid training checkpoint, not Hugging Face weights: continue it with \
             `train --resume --checkpoint-dir <its directory>`, score or sample it with \
             `eval --checkpoint` or `sample --checkpoint <its directory>`, or write its \
             weights with `export --checkpoint <its directory> --save-weights <file or \
             directory/>`"
                .into(),
        ));
    }
    let wte = shape_of("wte.weight").ok_or_else(|| fail("no wte.weight tensor".into()))?;
    let wpe = shape_of("wpe.weight").ok_or_else(|| fail("no wpe.weight tensor".into()))?;
    let (&[vocab_size, channels], &[max_seq_len, wpe_c]) = (wte.as_slice(), wpe.as_slice()) else {
        return Err(fail(format!(
            "wte.weight has shape {wte:?} and wpe.weight {wpe:?}; both must be 2-D"
        )));
    };
    if wpe_c != channels {
        return Err(fail(format!(
            "wte.weight has {channels} columns but wpe.weight has {wpe_c}"
        )));
    }
    let layers: BTreeSet<usize> = header
        .tensors
        .keys()
        .filter_map(|name| {
            let rest = short_name(name).strip_prefix("h.")?;
            rest.split('.').next()?.parse().ok()
        })
        .collect();
    let num_layers = layers.len();
    if num_layers == 0 {
        return Err(fail("no transformer blocks (h.N.*) in the file".into()));
    }
    if layers.iter().next_back() != Some(&(num_layers - 1)) {
        return Err(fail(format!(
            "transformer blocks are not numbered 0..{num_layers}: found {layers:?}"
        )));
    }
    let from_meta = HEAD_KEYS.iter().find_map(|k| header.metadata.get(*k));
    let num_heads = match from_meta {
        Some(v) => v
            .trim()
            .parse()
            .map_err(|_| fail(format!("metadata n_head {v:?} is not a number")))?,
        None => heads_from_config_json(path)
            .map_err(fail)?
            .or_else(|| standard_num_heads(channels))
            .ok_or_else(|| {
                fail(format!(
                    "the number of heads is not in the metadata and {channels} channels is not \
                     a published GPT-2 size (768, 1024, 1280, 1600)"
                ))
            })?,
    };
    let cfg = Gpt2Config {
        max_seq_len,
        vocab_size,
        num_layers,
        num_heads,
        channels,
    };
    cfg.validate()?;
    Ok(cfg)
}

/// Infers the configuration of a `GPT2LMHeadModel` safetensors file and loads
/// it: what a user with a published checkpoint on disk needs, no config named.
pub fn load_hf_model(path: impl AsRef<Path>) -> Result<(Gpt2Config, Vec<f32>)> {
    let path = path.as_ref();
    let cfg = infer_config_from_safetensors(path)?;
    let layout = ParamLayout::new(&cfg);
    let params = load_hf_safetensors(path, &cfg, &layout)?;
    Ok((cfg, params))
}

/// Hugging Face `config.json` field names and values for `cfg`, written into
/// the safetensors metadata (with `format: pt`, which `transformers` requires).
fn hf_metadata(cfg: &Gpt2Config) -> HashMap<String, String> {
    [
        ("format", "pt".to_string()),
        ("model_type", "gpt2".to_string()),
        ("n_layer", cfg.num_layers.to_string()),
        ("n_head", cfg.num_heads.to_string()),
        ("n_embd", cfg.channels.to_string()),
        ("n_positions", cfg.max_seq_len.to_string()),
        ("n_ctx", cfg.max_seq_len.to_string()),
        ("vocab_size", cfg.vocab_size.to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

/// Writes `params` (flat, in `layout`) as a `GPT2LMHeadModel` safetensors file:
/// `transformer.`-prefixed names, `Conv1D` weights transposed back to
/// `(in, out)`, F32, the sizes in the metadata. Atomic: a reader sees the old
/// file or the new one, never a partial one.
pub fn save_hf_safetensors(
    path: impl AsRef<Path>,
    params: &[f32],
    cfg: &Gpt2Config,
    layout: &ParamLayout,
) -> Result<()> {
    let path = path.as_ref();
    check_layout(cfg, layout)?;
    check_params_len(params, layout)?;
    let mut hf_tensors: Vec<(String, Vec<usize>, Vec<f32>)> =
        Vec::with_capacity(layout.tensors.len());
    for t in &layout.tensors {
        let mut hf = vec![0.0f32; t.len];
        t.copy_to_hf(params, &mut hf)?;
        hf_tensors.push((t.name.clone(), t.hf_shape(), hf));
    }
    let views = hf_tensors
        .iter()
        .map(|(name, shape, data)| (name.as_str(), F32View { shape, data }));
    write_safetensors(path, views, hf_metadata(cfg))
}

/// The file name of the weights in a Hugging Face model directory.
pub const HF_WEIGHTS_FILE: &str = "model.safetensors";

/// The file name of the configuration in a Hugging Face model directory.
pub const HF_CONFIG_FILE: &str = "config.json";

/// The files [`save_hf_model`] writes for an output path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HfOutput {
    /// The weights (safetensors).
    pub weights: PathBuf,
    /// The directory and its `config.json`, when the path names a directory.
    pub dir: Option<(PathBuf, PathBuf)>,
}

impl HfOutput {
    /// Where the weights for `path` go: a path that names a directory (one
    /// that exists, or one ending in `/`) gets [`HF_WEIGHTS_FILE`] and
    /// [`HF_CONFIG_FILE`] in it, the directory `transformers`'
    /// `from_pretrained` loads; any other path is the weights file alone.
    pub fn for_path(path: &Path) -> Self {
        let slash = path
            .as_os_str()
            .to_string_lossy()
            .ends_with(['/', std::path::MAIN_SEPARATOR]);
        if slash || path.is_dir() {
            // Without the trailing `/`: `a_file/` is then the file `a_file`
            // (which exists, and is no directory) to every check.
            let dir: PathBuf = path.components().collect();
            HfOutput {
                weights: dir.join(HF_WEIGHTS_FILE),
                dir: Some((dir.clone(), dir.join(HF_CONFIG_FILE))),
            }
        } else {
            HfOutput {
                weights: path.to_path_buf(),
                dir: None,
            }
        }
    }

    /// Why the files could not be written later, if that is already known
    /// (as [`braid::fs::unwritable`]; a directory that does not exist yet
    /// must be one that can be made). For outputs checked before a long run.
    pub fn unwritable(&self) -> Option<String> {
        if let Some((dir, config)) = &self.dir {
            if !dir.exists() {
                return braid::fs::unwritable(dir)
                    .map(|why| format!("cannot make the directory {}: {why}", dir.display()));
            }
            if !dir.is_dir() {
                return Some(format!("{} is not a directory", dir.display()));
            }
            if let Some(why) = braid::fs::unwritable(config) {
                return Some(format!("{}: {why}", config.display()));
            }
            return braid::fs::unwritable(&self.weights)
                .map(|why| format!("{}: {why}", self.weights.display()));
        }
        braid::fs::unwritable(&self.weights)
    }
}

/// The `config.json` of a Hugging Face `GPT2LMHeadModel` for `cfg`: the
/// sizes, and the rest of GPT-2's settings as Braid's model has them (the
/// tanh GELU, layer-norm epsilon 1e-5, the classifier tied to `wte`). The
/// end-of-text token (50256) is the first and last token where the
/// vocabulary holds it.
pub fn hf_config_json(cfg: &Gpt2Config) -> serde_json::Value {
    let eot = crate::data::EOT;
    let eot = (cfg.vocab_size > eot as usize).then_some(eot);
    serde_json::json!({
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.max_seq_len,
        "n_ctx": cfg.max_seq_len,
        "n_embd": cfg.channels,
        "n_layer": cfg.num_layers,
        "n_head": cfg.num_heads,
        "n_inner": null,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
        "initializer_range": 0.02,
        "resid_pdrop": 0.1,
        "embd_pdrop": 0.1,
        "attn_pdrop": 0.1,
        "scale_attn_weights": true,
        "tie_word_embeddings": true,
        "bos_token_id": eot,
        "eos_token_id": eot,
        "torch_dtype": "float32",
        "use_cache": true,
    })
}

/// Writes `params` as Hugging Face weights at `path` ([`HfOutput::for_path`]):
/// a file path gets the safetensors file ([`save_hf_safetensors`]); a
/// directory (made if it does not exist) gets `model.safetensors` and
/// `config.json` ([`hf_config_json`]). Each file is written atomically.
/// Returns what was written. An invalid `cfg` ([`Gpt2Config::validate`])
/// or `params` of another length than its parameters are refused before
/// anything is made.
pub fn save_hf_model(path: impl AsRef<Path>, params: &[f32], cfg: &Gpt2Config) -> Result<HfOutput> {
    cfg.validate()?;
    let layout = ParamLayout::new(cfg);
    check_params_len(params, &layout)?;
    let out = HfOutput::for_path(path.as_ref());
    if let Some((dir, _)) = &out.dir {
        std::fs::create_dir_all(dir).map_err(|e| Gpt2Error::io("creating directory", dir, e))?;
    }
    save_hf_safetensors(&out.weights, params, cfg, &layout)?;
    if let Some((_, config)) = &out.dir {
        let mut json = serde_json::to_vec_pretty(&hf_config_json(cfg))
            .map_err(|e| Gpt2Error::io("encoding", config, std::io::Error::other(e.to_string())))?;
        json.push(b'\n');
        braid::fs::write_atomic::<Gpt2Error>(config, |w| std::io::Write::write_all(w, &json))?;
    }
    Ok(out)
}

/// A borrowed f32 tensor for the safetensors serialiser (no copy on
/// little-endian machines).
#[derive(Debug, Clone, Copy)]
pub(crate) struct F32View<'a> {
    pub shape: &'a [usize],
    pub data: &'a [f32],
}

impl safetensors::View for F32View<'_> {
    fn dtype(&self) -> Dtype {
        Dtype::F32
    }
    fn shape(&self) -> &[usize] {
        self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        if cfg!(target_endian = "little") {
            Cow::Borrowed(bytemuck::cast_slice(self.data))
        } else {
            Cow::Owned(self.data.iter().flat_map(|x| x.to_le_bytes()).collect())
        }
    }
    fn data_len(&self) -> usize {
        self.data.len() * 4
    }
}

/// Writes F32 tensors and metadata as a safetensors file, atomically, streaming
/// the tensor data (no second copy of the whole file in memory).
pub(crate) fn write_safetensors<'a>(
    path: &Path,
    tensors: impl IntoIterator<Item = (&'a str, F32View<'a>)>,
    metadata: HashMap<String, String>,
) -> Result<()> {
    write_atomic_with(path, |tmp| {
        serialize_sorted(tensors, metadata, tmp).map_err(|e| match e {
            safetensors::SafeTensorError::IoError(source) => Gpt2Error::io("writing", tmp, source),
            other => Gpt2Error::Safetensors {
                path: path.to_path_buf(),
                message: other.to_string(),
            },
        })
    })
}

/// `safetensors::serialize_to_file`, then the header sorted
/// ([`sort_safetensors_header`]): what every safetensors file of the crate
/// (weights, checkpoints) is written with.
pub(crate) fn serialize_sorted<'a>(
    tensors: impl IntoIterator<Item = (&'a str, F32View<'a>)>,
    metadata: HashMap<String, String>,
    path: &Path,
) -> std::result::Result<(), safetensors::SafeTensorError> {
    safetensors::serialize_to_file(tensors, Some(metadata), path)?;
    sort_safetensors_header(path).map_err(safetensors::SafeTensorError::IoError)
}

/// Rewrites the header of the safetensors file at `path`, just written by
/// `safetensors::serialize_to_file`, with its keys in sorted order. The crate
/// takes the metadata as a `HashMap` and writes it in that map's order, so
/// the same tensors made files that differed from run to run in the order
/// of the metadata's keys; sorted, the same weights give the same bytes. The
/// keys and values are the same, so the header keeps its length (padded
/// with spaces as before) and the data offsets hold.
fn sort_safetensors_header(path: &Path) -> std::io::Result<()> {
    use std::io::{Seek, SeekFrom, Write};
    let bad = |what: String| std::io::Error::new(std::io::ErrorKind::InvalidData, what);
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)?;
    let mut len = [0u8; 8];
    f.read_exact(&mut len)?;
    let len = usize::try_from(u64::from_le_bytes(len))
        .map_err(|_| bad("safetensors header length does not fit in memory".into()))?;
    let mut header = vec![0u8; len];
    f.read_exact(&mut header)?;
    let json = |e: serde_json::Error| bad(format!("safetensors header: {e}"));
    let mut map: BTreeMap<String, serde_json::Value> =
        serde_json::from_slice(&header).map_err(json)?;
    if let Some(meta) = map.get_mut("__metadata__") {
        // Sorted whatever `serde_json`'s map keeps (its `preserve_order`
        // feature keeps insertion order: the sorted order, here).
        let sorted: BTreeMap<String, String> = serde_json::from_value(meta.take()).map_err(json)?;
        *meta = serde_json::to_value(sorted).map_err(json)?;
    }
    let mut sorted = serde_json::to_vec(&map).map_err(json)?;
    if sorted.len() > len {
        return Err(bad(format!(
            "safetensors header grew from {len} to {} bytes when sorted",
            sorted.len()
        )));
    }
    sorted.resize(len, b' ');
    f.seek(SeekFrom::Start(8))?;
    f.write_all(&sorted)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ConfigError;

    /// A bad configuration or a buffer of the wrong length is refused
    /// before the output directory is made.
    #[test]
    fn save_hf_model_refuses_before_making_anything() {
        let tmp = tempfile::tempdir().unwrap();
        let cfg = Gpt2Config::tiny();
        let params = vec![0.0f32; cfg.num_parameters()];

        let dir = tmp.path().join("short/");
        let err = save_hf_model(&dir, &params[..10], &cfg).unwrap_err();
        assert!(
            matches!(
                err,
                Gpt2Error::LengthMismatch { expected, found: 10, .. }
                    if expected == cfg.num_parameters()
            ),
            "{err:?}"
        );
        assert!(!tmp.path().join("short").exists());

        let bad = Gpt2Config {
            num_heads: 3,
            ..cfg
        };
        let dir = tmp.path().join("bad/");
        let err = save_hf_model(&dir, &params, &bad).unwrap_err();
        assert!(
            matches!(err, Gpt2Error::Config(ConfigError::HeadsDoNotDivide { .. })),
            "{err:?}"
        );
        assert!(!tmp.path().join("bad").exists());

        let dir = tmp.path().join("good/");
        let out = save_hf_model(&dir, &params, &cfg).unwrap();
        assert!(out.weights.is_file());
        assert_eq!(load_hf_model(&out.weights).unwrap().0, cfg);
    }
}

//! Hugging Face safetensors weights: loading (prefix or not, lm_head or not,
//! F32/F16/BF16), errors, config inference, and save/load round trips.
//!
//! The fixtures are built here the way Hugging Face lays out a
//! `GPT2LMHeadModel` — Conv1D weights stored `(in, out)` — with a transpose
//! written independently of the crate's, from a known flat vector.

use std::collections::HashMap;
use std::path::Path;

mod damage;

use braid_gpt2::config::Gpt2Config;
use braid_gpt2::error::Gpt2Error;
use braid_gpt2::layout::ParamLayout;
use braid_gpt2::weights::{
    bf16_to_f32, f16_to_f32, infer_config_from_safetensors, load_hf_model, load_hf_safetensors,
    save_hf_safetensors,
};
use safetensors::tensor::{Dtype, TensorView};

/// A known flat parameter vector: distinct values, exact in f16 and bf16 for
/// the first 256 (`i / 8` up to 32) and exact in f32 for all.
fn known_params(n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i % 256) as f32) / 8.0 - 16.0 + (i / 256) as f32 * 1e-3)
        .collect()
}

/// Values exact in 16-bit floats: `(i % 256) / 8 - 16`.
fn half_exact_params(n: usize) -> Vec<f32> {
    (0..n).map(|i| ((i % 256) as f32) / 8.0 - 16.0).collect()
}

#[derive(Clone)]
struct HfTensor {
    name: String,
    shape: Vec<usize>,
    values: Vec<f32>,
}

/// The tensors of a GPT2LMHeadModel state dict for `flat`, HF-style.
fn hf_state_dict(
    cfg: &Gpt2Config,
    flat: &[f32],
    prefix: bool,
    lm_head: bool,
    buffers: bool,
) -> Vec<HfTensor> {
    let c = cfg.channels;
    let v = cfg.vocab_size;
    let t = cfg.max_seq_len;
    let mut offset = 0;
    let mut take = |n: usize| {
        let s = flat[offset..offset + n].to_vec();
        offset += n;
        s
    };
    // Braid stores (out, in); HF Conv1D stores (in, out).
    let conv1d = |ours: Vec<f32>, out_dim: usize, in_dim: usize| {
        let mut hf = vec![0.0; ours.len()];
        for o in 0..out_dim {
            for i in 0..in_dim {
                hf[i * out_dim + o] = ours[o * in_dim + i];
            }
        }
        (vec![in_dim, out_dim], hf)
    };
    let p = if prefix { "transformer." } else { "" };
    let mut out = Vec::new();
    let mut push = |name: String, shape: Vec<usize>, values: Vec<f32>| {
        out.push(HfTensor {
            name,
            shape,
            values,
        })
    };
    let wte = take(v * c);
    push(format!("{p}wte.weight"), vec![v, c], wte.clone());
    push(format!("{p}wpe.weight"), vec![t, c], take(t * c));
    for l in 0..cfg.num_layers {
        let h = format!("{p}h.{l}.");
        push(format!("{h}ln_1.weight"), vec![c], take(c));
        push(format!("{h}ln_1.bias"), vec![c], take(c));
        let (s, w) = conv1d(take(3 * c * c), 3 * c, c);
        push(format!("{h}attn.c_attn.weight"), s, w);
        push(format!("{h}attn.c_attn.bias"), vec![3 * c], take(3 * c));
        let (s, w) = conv1d(take(c * c), c, c);
        push(format!("{h}attn.c_proj.weight"), s, w);
        push(format!("{h}attn.c_proj.bias"), vec![c], take(c));
        push(format!("{h}ln_2.weight"), vec![c], take(c));
        push(format!("{h}ln_2.bias"), vec![c], take(c));
        let (s, w) = conv1d(take(4 * c * c), 4 * c, c);
        push(format!("{h}mlp.c_fc.weight"), s, w);
        push(format!("{h}mlp.c_fc.bias"), vec![4 * c], take(4 * c));
        let (s, w) = conv1d(take(4 * c * c), c, 4 * c);
        push(format!("{h}mlp.c_proj.weight"), s, w);
        push(format!("{h}mlp.c_proj.bias"), vec![c], take(c));
        if buffers {
            let mut mask = vec![0.0; t * t];
            for r in 0..t {
                for k in 0..=r {
                    mask[r * t + k] = 1.0;
                }
            }
            push(format!("{h}attn.bias"), vec![1, 1, t, t], mask);
            push(format!("{h}attn.masked_bias"), vec![], vec![-1e4]);
        }
    }
    push(format!("{p}ln_f.weight"), vec![c], take(c));
    push(format!("{p}ln_f.bias"), vec![c], take(c));
    assert_eq!(offset, flat.len(), "fixture covers the whole flat vector");
    if lm_head {
        push("lm_head.weight".into(), vec![v, c], wte);
    }
    out
}

fn encode(values: &[f32], dtype: Dtype) -> Vec<u8> {
    let mut b = Vec::new();
    for &x in values {
        match dtype {
            Dtype::F32 => b.extend_from_slice(&x.to_le_bytes()),
            // Exact for the fixture's values: truncation of the low bits.
            Dtype::BF16 => b.extend_from_slice(&((x.to_bits() >> 16) as u16).to_le_bytes()),
            Dtype::F16 => b.extend_from_slice(&f32_to_f16_exact(x).to_le_bytes()),
            Dtype::I32 => b.extend_from_slice(&(x as i32).to_le_bytes()),
            _ => unreachable!(),
        }
    }
    b
}

/// f32 -> f16 for normal values that are exactly representable.
fn f32_to_f16_exact(x: f32) -> u16 {
    if x == 0.0 {
        return if x.is_sign_negative() { 0x8000 } else { 0 };
    }
    let bits = x.to_bits();
    let sign = ((bits >> 31) as u16) << 15;
    let exp = ((bits >> 23) & 0xff) as i32 - 127 + 15;
    assert!((1..31).contains(&exp), "{x} is not a normal f16");
    let man = bits & 0x7f_ffff;
    assert_eq!(man & 0x1fff, 0, "{x} is not exact in f16");
    sign | ((exp as u16) << 10) | (man >> 13) as u16
}

fn write_safetensors(
    path: &Path,
    tensors: &[HfTensor],
    dtype: impl Fn(&str) -> Dtype,
    metadata: Option<HashMap<String, String>>,
) {
    let blobs: Vec<(String, Vec<usize>, Dtype, Vec<u8>)> = tensors
        .iter()
        .map(|t| {
            let d = dtype(&t.name);
            (t.name.clone(), t.shape.clone(), d, encode(&t.values, d))
        })
        .collect();
    let views: Vec<(&str, TensorView<'_>)> = blobs
        .iter()
        .map(|(n, s, d, b)| (n.as_str(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    let bytes = safetensors::serialize(views, metadata).unwrap();
    std::fs::write(path, bytes).unwrap();
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// The tiny configuration, its layout, a flat parameter vector made by
/// `params`, and a temporary directory for the test's files.
fn tiny(params: fn(usize) -> Vec<f32>) -> (Gpt2Config, ParamLayout, Vec<f32>, tempfile::TempDir) {
    let cfg = Gpt2Config::tiny();
    let layout = ParamLayout::new(&cfg);
    let flat = params(layout.total);
    (cfg, layout, flat, tempfile::tempdir().unwrap())
}

#[test]
fn loads_hf_layout_with_and_without_prefix_and_lm_head() {
    let (cfg, layout, flat, dir) = tiny(known_params);
    for prefix in [false, true] {
        for lm_head in [false, true] {
            for buffers in [false, true] {
                let path = dir
                    .path()
                    .join(format!("m-{prefix}-{lm_head}-{buffers}.safetensors"));
                let tensors = hf_state_dict(&cfg, &flat, prefix, lm_head, buffers);
                write_safetensors(&path, &tensors, |_| Dtype::F32, None);
                let loaded = load_hf_safetensors(&path, &cfg, &layout).unwrap();
                assert!(
                    same_bits(&loaded, &flat),
                    "prefix {prefix} lm_head {lm_head} buffers {buffers}"
                );
            }
        }
    }
    // A weight that is not finite is refused, named, not scored as NaN.
    for bad in [f32::NAN, f32::INFINITY] {
        let mut tensors = hf_state_dict(&cfg, &flat, true, false, false);
        let ln = tensors
            .iter_mut()
            .find(|t| t.name == "transformer.h.0.ln_1.weight")
            .unwrap();
        ln.values[3] = bad;
        let path = dir.path().join("not-finite.safetensors");
        write_safetensors(&path, &tensors, |_| Dtype::F32, None);
        let e = load_hf_safetensors(&path, &cfg, &layout)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("\"transformer.h.0.ln_1.weight\" holds") && e.contains("at index 3"),
            "{e}"
        );
    }
    // A classifier that is not the embedding (an untied fine-tune) is
    // refused, not dropped; so is one of another shape.
    for (i, bad) in [(7usize, "differs"), (usize::MAX, "shape")] {
        let mut tensors = hf_state_dict(&cfg, &flat, true, true, false);
        let head = tensors
            .iter_mut()
            .find(|t| t.name == "lm_head.weight")
            .unwrap();
        match i {
            usize::MAX => {
                head.values.truncate(cfg.channels);
                head.shape = vec![1, cfg.channels];
            }
            i => head.values[i] += 1.0,
        }
        let path = dir.path().join(format!("untied-{bad}.safetensors"));
        write_safetensors(&path, &tensors, |_| Dtype::F32, None);
        let e = load_hf_safetensors(&path, &cfg, &layout)
            .unwrap_err()
            .to_string();
        assert!(e.contains("lm_head.weight") && e.contains(bad), "{e}");
        if bad == "differs" {
            assert!(e.contains("first at element 7"), "{e}");
        }
    }
}

#[test]
fn conv1d_weights_are_transposed_into_out_in() {
    // A direct spot check independent of the fixture: element (in=i, out=o) of
    // HF's c_fc weight must land at (o, i) of Braid's (4C, C) matrix.
    let (cfg, layout, flat, dir) = tiny(known_params);
    let path = dir.path().join("m.safetensors");
    let tensors = hf_state_dict(&cfg, &flat, true, false, false);
    write_safetensors(&path, &tensors, |_| Dtype::F32, None);
    let loaded = load_hf_safetensors(&path, &cfg, &layout).unwrap();
    let hf = tensors
        .iter()
        .find(|t| t.name == "transformer.h.1.mlp.c_fc.weight")
        .unwrap();
    let c = cfg.channels;
    assert_eq!(hf.shape, vec![c, 4 * c]);
    let ours = layout.get("transformer.h.1.mlp.c_fc.weight").unwrap();
    let (i, o) = (5, 200);
    assert_eq!(loaded[ours.offset + o * c + i], hf.values[i * 4 * c + o]);
}

#[test]
fn loads_f16_and_bf16() {
    let (cfg, layout, flat, dir) = tiny(half_exact_params);
    for dtype in [Dtype::F16, Dtype::BF16] {
        let path = dir.path().join(format!("{dtype}.safetensors"));
        let tensors = hf_state_dict(&cfg, &flat, false, true, true);
        // Mixed precisions in one file are fine too.
        write_safetensors(
            &path,
            &tensors,
            |name| {
                if name.contains("ln_") {
                    Dtype::F32
                } else {
                    dtype
                }
            },
            None,
        );
        let loaded = load_hf_safetensors(&path, &cfg, &layout).unwrap();
        assert!(same_bits(&loaded, &flat), "{dtype}");
    }
}

#[test]
fn half_conversions_are_exact() {
    assert_eq!(f16_to_f32(0x3c00), 1.0);
    assert_eq!(f16_to_f32(0xc000), -2.0);
    assert_eq!(f16_to_f32(0x7bff), 65504.0);
    assert_eq!(f16_to_f32(0x0001), 2f32.powi(-24));
    assert_eq!(f16_to_f32(0x03ff), 1023.0 * 2f32.powi(-24));
    assert_eq!(f16_to_f32(0x0400), 2f32.powi(-14));
    assert_eq!(f16_to_f32(0x8000).to_bits(), (-0.0f32).to_bits());
    assert_eq!(f16_to_f32(0x7c00), f32::INFINITY);
    assert_eq!(f16_to_f32(0xfc00), f32::NEG_INFINITY);
    assert!(f16_to_f32(0x7e00).is_nan());
    assert_eq!(f16_to_f32(0x3555), 0.333_251_95);
    assert_eq!(bf16_to_f32(0x3f80), 1.0);
    assert_eq!(bf16_to_f32(0xc040), -3.0);
    // Every finite f16 converts to the value its fields describe.
    for h in 0u16..0x7c00 {
        let (e, m) = (i32::from(h >> 10), f64::from(h & 0x3ff));
        let want = if e == 0 {
            m * 2f64.powi(-24)
        } else {
            (1.0 + m / 1024.0) * 2f64.powi(e - 15)
        };
        assert_eq!(f64::from(f16_to_f32(h)), want, "{h:#06x}");
    }
}

#[test]
fn missing_tensor_is_named() {
    let (cfg, layout, flat, dir) = tiny(known_params);
    let path = dir.path().join("m.safetensors");
    let mut tensors = hf_state_dict(&cfg, &flat, false, false, false);
    tensors.retain(|t| t.name != "h.1.mlp.c_fc.bias");
    write_safetensors(&path, &tensors, |_| Dtype::F32, None);
    let err = load_hf_safetensors(&path, &cfg, &layout).unwrap_err();
    assert!(
        matches!(&err, Gpt2Error::MissingTensor { name, .. } if name.ends_with("h.1.mlp.c_fc.bias")),
        "{err:?}"
    );
    let msg = err.to_string();
    assert!(
        msg.contains("h.1.mlp.c_fc.bias") && msg.contains("m.safetensors"),
        "{msg}"
    );
}

#[test]
fn wrong_shape_names_tensor_and_both_shapes() {
    let (cfg, layout, flat, dir) = tiny(known_params);
    let path = dir.path().join("m.safetensors");
    let mut tensors = hf_state_dict(&cfg, &flat, true, false, false);
    // Stored the Braid way (out, in) instead of Conv1D's (in, out).
    let t = tensors
        .iter_mut()
        .find(|t| t.name == "transformer.h.0.attn.c_attn.weight")
        .unwrap();
    t.shape = vec![3 * 64, 64];
    write_safetensors(&path, &tensors, |_| Dtype::F32, None);
    let err = load_hf_safetensors(&path, &cfg, &layout).unwrap_err();
    match &err {
        Gpt2Error::ShapeMismatch {
            name,
            expected,
            found,
            ..
        } => {
            assert_eq!(name, "transformer.h.0.attn.c_attn.weight");
            assert_eq!(expected, &vec![64, 192]);
            assert_eq!(found, &vec![192, 64]);
        }
        other => panic!("unexpected error {other:?}"),
    }
    let msg = err.to_string();
    assert!(
        msg.contains("h.0.attn.c_attn.weight")
            && msg.contains("[64, 192]")
            && msg.contains("[192, 64]"),
        "{msg}"
    );
    // A checkpoint for another config: wrong wte rows.
    let other = Gpt2Config {
        vocab_size: 500,
        ..cfg
    };
    let other_layout = ParamLayout::new(&other);
    let tensors = hf_state_dict(
        &other,
        &known_params(other_layout.total),
        false,
        false,
        false,
    );
    write_safetensors(&path, &tensors, |_| Dtype::F32, None);
    let err = load_hf_safetensors(&path, &cfg, &layout).unwrap_err();
    assert!(
        matches!(&err, Gpt2Error::ShapeMismatch { name, .. } if name == "wte.weight"),
        "{err:?}"
    );
}

#[test]
fn unexpected_dtype_extra_layers_and_corrupt_files_are_errors() {
    let (cfg, layout, flat, dir) = tiny(known_params);
    let path = dir.path().join("m.safetensors");

    let tensors = hf_state_dict(&cfg, &flat, false, false, false);
    write_safetensors(
        &path,
        &tensors,
        |n| {
            if n == "wpe.weight" {
                Dtype::I32
            } else {
                Dtype::F32
            }
        },
        None,
    );
    let err = load_hf_safetensors(&path, &cfg, &layout).unwrap_err();
    assert!(
        matches!(&err, Gpt2Error::UnsupportedDtype { name, dtype, .. } if name == "wpe.weight" && dtype == "I32"),
        "{err:?}"
    );

    // A model with 3 layers does not load into a 2-layer config.
    let deeper = Gpt2Config {
        num_layers: 3,
        ..cfg
    };
    let deeper_flat = known_params(ParamLayout::new(&deeper).total);
    write_safetensors(
        &path,
        &hf_state_dict(&deeper, &deeper_flat, false, false, false),
        |_| Dtype::F32,
        None,
    );
    let err = load_hf_safetensors(&path, &cfg, &layout).unwrap_err();
    assert!(
        matches!(&err, Gpt2Error::UnexpectedTensor { name, .. } if name.starts_with("h.2.")),
        "{err:?}"
    );

    // Garbage and truncation.
    std::fs::write(&path, b"definitely not safetensors").unwrap();
    let err = load_hf_safetensors(&path, &cfg, &layout).unwrap_err();
    assert!(matches!(err, Gpt2Error::Safetensors { .. }), "{err:?}");
    assert!(err.to_string().contains("m.safetensors"));
    write_safetensors(&path, &tensors, |_| Dtype::F32, None);
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() - 10]).unwrap();
    assert!(matches!(
        load_hf_safetensors(&path, &cfg, &layout).unwrap_err(),
        Gpt2Error::Safetensors { .. }
    ));
    assert!(matches!(
        infer_config_from_safetensors(&path).unwrap_err(),
        Gpt2Error::Safetensors { .. }
    ));
    let err =
        load_hf_safetensors(dir.path().join("absent.safetensors"), &cfg, &layout).unwrap_err();
    assert!(matches!(err, Gpt2Error::Io { .. }) && err.to_string().contains("absent.safetensors"));

    // A layout for another config is refused.
    let err = load_hf_safetensors(&path, &Gpt2Config::small(), &layout).unwrap_err();
    assert!(matches!(err, Gpt2Error::LayoutMismatch { .. }), "{err:?}");
}

#[test]
fn infers_config_from_shapes_and_heads_from_metadata_or_config_json() {
    let (cfg, _, flat, dir) = tiny(known_params);
    let path = dir.path().join("model.safetensors");
    let tensors = hf_state_dict(&cfg, &flat, false, true, true);

    // 64 channels is no published size and there is no metadata: heads unknown.
    write_safetensors(&path, &tensors, |_| Dtype::F32, None);
    let err = infer_config_from_safetensors(&path).unwrap_err();
    assert!(
        matches!(err, Gpt2Error::ConfigInference { .. }) && err.to_string().contains("heads"),
        "{err}"
    );

    // A Hugging Face config.json beside the file supplies them.
    std::fs::write(
        dir.path().join("config.json"),
        r#"{"model_type": "gpt2", "n_head": 4, "n_embd": 64}"#,
    )
    .unwrap();
    assert_eq!(infer_config_from_safetensors(&path).unwrap(), cfg);
    std::fs::remove_file(dir.path().join("config.json")).unwrap();

    // So does the metadata.
    let meta = HashMap::from([
        ("format".to_string(), "pt".to_string()),
        ("n_head".to_string(), "4".to_string()),
    ]);
    write_safetensors(&path, &tensors, |_| Dtype::F32, Some(meta));
    assert_eq!(infer_config_from_safetensors(&path).unwrap(), cfg);
    let (got_cfg, params) = load_hf_model(&path).unwrap();
    assert_eq!(got_cfg, cfg);
    assert!(same_bits(&params, &flat));
}

#[test]
fn infers_heads_of_published_sizes() {
    // A one-layer model 768 wide, like GPT-2 small's blocks, with a small
    // vocabulary: 12 heads come from the channel count alone.
    let cfg = Gpt2Config {
        max_seq_len: 8,
        vocab_size: 16,
        num_layers: 1,
        num_heads: 12,
        channels: 768,
    };
    let layout = ParamLayout::new(&cfg);
    let flat = half_exact_params(layout.total);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    let tensors = hf_state_dict(&cfg, &flat, false, false, false);
    write_safetensors(&path, &tensors, |_| Dtype::BF16, None);
    assert_eq!(infer_config_from_safetensors(&path).unwrap(), cfg);
    // A config.json beside it that says nothing of heads: the same.
    let config = dir.path().join("config.json");
    std::fs::write(&config, r#"{"model_type": "gpt2"}"#).unwrap();
    assert_eq!(infer_config_from_safetensors(&path).unwrap(), cfg);
    // One that cannot be read, or whose head count is unusable, is an
    // error naming it, not a guess of 12 heads.
    for (text, needle) in [
        ("garbage", "is not JSON"),
        (
            r#"{"n_head": "8"}"#,
            r#"gives `n_head` "8", not a positive integer"#,
        ),
        (r#"{"n_head": 0}"#, "gives `n_head` 0"),
    ] {
        std::fs::write(&config, text).unwrap();
        let e = infer_config_from_safetensors(&path)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("config.json beside it") && e.contains(needle),
            "{e}"
        );
    }
    std::fs::remove_file(&config).unwrap();
    std::fs::create_dir(&config).unwrap();
    let e = infer_config_from_safetensors(&path)
        .unwrap_err()
        .to_string();
    assert!(e.contains("config.json beside it cannot be read"), "{e}");
}

/// The same weights saved twice give the same bytes (the safetensors crate
/// writes its metadata in a `HashMap`'s order, which changes from map to
/// map; the header is rewritten sorted).
#[test]
fn saving_the_same_weights_twice_gives_the_same_bytes() {
    let (cfg, layout, flat, dir) = tiny(known_params);
    let files: Vec<Vec<u8>> = (0..3)
        .map(|i| {
            let path = dir.path().join(format!("export{i}.safetensors"));
            save_hf_safetensors(&path, &flat, &cfg, &layout).unwrap();
            std::fs::read(&path).unwrap()
        })
        .collect();
    assert!(files.windows(2).all(|w| w[0] == w[1]));
    let st = safetensors::SafeTensors::deserialize(&files[0]).unwrap();
    assert_eq!(
        st.len(),
        hf_state_dict(&cfg, &flat, true, false, false).len()
    );
}

#[test]
fn save_then_load_round_trips_and_writes_hf_layout() {
    let (cfg, layout, flat, dir) = tiny(known_params);
    let path = dir.path().join("export.safetensors");
    save_hf_safetensors(&path, &flat, &cfg, &layout).unwrap();

    // Read with the safetensors crate: HF names, HF shapes, HF order.
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let expected = hf_state_dict(&cfg, &flat, true, false, false);
    assert_eq!(st.len(), expected.len());
    for t in &expected {
        let view = st.tensor(&t.name).unwrap();
        assert_eq!(view.dtype(), Dtype::F32, "{}", t.name);
        assert_eq!(view.shape(), t.shape.as_slice(), "{}", t.name);
        assert_eq!(
            view.data(),
            encode(&t.values, Dtype::F32).as_slice(),
            "{}",
            t.name
        );
    }
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let meta = meta.metadata().clone().unwrap();
    assert_eq!(meta["format"], "pt");
    assert_eq!(meta["n_head"], "4");

    // Back into Braid, and the configuration is inferred exactly.
    assert!(same_bits(
        &load_hf_safetensors(&path, &cfg, &layout).unwrap(),
        &flat
    ));
    assert_eq!(infer_config_from_safetensors(&path).unwrap(), cfg);

    // Wrong length is refused before anything is written.
    let err = save_hf_safetensors(&path, &flat[1..], &cfg, &layout).unwrap_err();
    assert!(matches!(err, Gpt2Error::LengthMismatch { .. }), "{err:?}");
    assert_eq!(std::fs::read(&path).unwrap(), bytes);
    // Only the export is in the directory: no temporary left behind.
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
}

/// A Hugging Face file whose header (tensor names, dtypes, shapes,
/// offsets, metadata) has random bytes replaced, inserted or cut, or that
/// is cut short, loads or fails with an error, never a panic: through
/// `load_hf_model` (which infers the config from the shapes, with
/// `config.json` beside it giving the heads) and `load_hf_safetensors`
/// with a config. 400 edits from a fixed seed.
#[test]
fn randomly_damaged_hf_files_load_or_fail_cleanly() {
    let (cfg, layout, flat, dir) = tiny(known_params);
    let path = dir.path().join("model.safetensors");
    let tensors = hf_state_dict(&cfg, &flat, false, true, true);
    write_safetensors(&path, &tensors, |_| Dtype::F32, None);
    std::fs::write(
        dir.path().join("config.json"),
        format!("{{\"n_head\": {}}}", cfg.num_heads),
    )
    .unwrap();
    let bytes = std::fs::read(&path).unwrap();
    let mut damage = damage::Damage::new(0x9e37_79b9_7f4a_7c15);
    let mut failed = 0;
    for case in 0..400 {
        let b = damage.apply(&bytes, case % 2 == 1);
        std::fs::write(&path, &b).unwrap();
        let r = std::panic::catch_unwind(|| {
            (
                load_hf_model(&path).is_ok(),
                load_hf_safetensors(&path, &cfg, &layout).is_ok(),
            )
        });
        match r {
            Ok((a, b)) => failed += usize::from(!a) + usize::from(!b),
            Err(_) => panic!("case {case}: loading a damaged file panicked"),
        }
    }
    assert!(
        failed > 400,
        "only {failed} of 800 loads of damaged files failed"
    );
}

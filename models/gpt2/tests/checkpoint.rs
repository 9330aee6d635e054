//! Training checkpoints: bit-exact round trips, atomic saves that never destroy
//! a good checkpoint, and clear errors for damaged ones.

use std::collections::{BTreeMap, HashMap};

mod damage;

use braid_gpt2::checkpoint::{
    checkpoint_file, latest_checkpoint, load_checkpoint, load_checkpoint_params,
    read_checkpoint_info, save_checkpoint, AdamWHyper, Checkpoint, CHECKPOINT_FILE, METADATA_KEY,
};
use braid_gpt2::config::Gpt2Config;
use braid_gpt2::data::LoaderState;
use braid_gpt2::error::Gpt2Error;
use safetensors::tensor::{Dtype, TensorView};

/// Finite values with awkward bit patterns: -0.0, subnormals, the extremes.
/// (A NaN or an infinity is refused on load, as a corrupt file:
/// `non_finite_values_are_refused_on_load` in `checkpoint.rs`.)
fn awkward(n: usize, salt: u32) -> Vec<f32> {
    let special = [
        f32::from_bits(0x8000_0001),
        f32::MIN,
        -0.0,
        f32::from_bits(1),
        f32::MIN_POSITIVE,
        f32::MAX,
    ];
    (0..n)
        .map(|i| {
            if i % 97 == 0 {
                special[(i / 97) % special.len()]
            } else {
                // Bit 30 clear: an exponent below all-ones, so finite.
                f32::from_bits(((i as u32).wrapping_mul(2_654_435_761) ^ salt) & 0xbfff_ffff) % 1e3
            }
        })
        .collect()
}

fn checkpoint(step: u64, salt: u32) -> Checkpoint {
    let config = Gpt2Config::tiny();
    let n = config.num_parameters();
    let mut extra = BTreeMap::new();
    extra.insert("batch_size".to_string(), serde_json::json!(4));
    extra.insert("note".to_string(), serde_json::json!("tiny run"));
    Checkpoint {
        config,
        step,
        params: awkward(n, salt),
        adam_m: awkward(n, salt ^ 0x5555),
        // Non-negative, as a second moment is (a negative one is refused
        // as corruption).
        adam_v: awkward(n, salt ^ 0xaaaa)
            .into_iter()
            .map(f32::abs)
            .collect(),
        optimizer: AdamWHyper {
            learning_rate: 6e-4,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        },
        loader: LoaderState {
            position: 12_345,
            epoch: 3,
        },
        rng_state: Some(vec![u64::MAX, 0x0123_4567_89ab_cdef, 42, 7]),
        extra,
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn assert_bit_identical(a: &Checkpoint, b: &Checkpoint) {
    assert_eq!(bits(&a.params), bits(&b.params));
    assert_eq!(bits(&a.adam_m), bits(&b.adam_m));
    assert_eq!(bits(&a.adam_v), bits(&b.adam_v));
    assert_eq!(a.config, b.config);
    assert_eq!(a.step, b.step);
    assert_eq!(a.optimizer, b.optimizer);
    assert_eq!(a.loader, b.loader);
    assert_eq!(a.rng_state, b.rng_state);
    assert_eq!(a.extra, b.extra);
}

#[test]
fn round_trip_is_bit_exact() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("run/step_000100");
    let ckpt = checkpoint(100, 1);
    save_checkpoint(&dir, &ckpt).unwrap();
    let back = load_checkpoint(&dir).unwrap();
    assert_bit_identical(&ckpt, &back);
    let info = read_checkpoint_info(&dir).unwrap();
    assert_eq!(info.step, 100);
    assert_eq!(info.config, ckpt.config);
    assert_eq!(info.loader, ckpt.loader);
    assert_eq!(info.path, checkpoint_file(&dir));
    // The parameters alone, for evaluation and sampling: the same bits and
    // the same metadata.
    let (only, params) = load_checkpoint_params(&dir).unwrap();
    assert_eq!(
        params.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        ckpt.params.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
    );
    assert_eq!(
        (only.step, only.config, only.loader, only.path),
        (info.step, info.config, info.loader, info.path)
    );
    // No RNG state and no extras round-trip too.
    let mut plain = checkpoint(5, 2);
    plain.rng_state = None;
    plain.extra.clear();
    save_checkpoint(&dir, &plain).unwrap();
    assert_bit_identical(&plain, &load_checkpoint(&dir).unwrap());
}

#[test]
fn saving_again_replaces_the_checkpoint_whole() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("ckpt");
    save_checkpoint(&dir, &checkpoint(1, 1)).unwrap();
    let second = checkpoint(2, 2);
    save_checkpoint(&dir, &second).unwrap();
    assert_bit_identical(&second, &load_checkpoint(&dir).unwrap());
    let names: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(names, vec![CHECKPOINT_FILE.to_string()]);
}

#[test]
fn a_failed_save_leaves_the_previous_checkpoint_intact() {
    let root = tempfile::tempdir().unwrap();
    let good_dir = root.path().join("good");
    let good = checkpoint(10, 1);
    save_checkpoint(&good_dir, &good).unwrap();
    let good_bytes = std::fs::read(checkpoint_file(&good_dir)).unwrap();

    // 1. The target directory path is a file.
    let file = root.path().join("not_a_dir");
    std::fs::write(&file, b"precious").unwrap();
    let err = save_checkpoint(&file, &checkpoint(11, 2)).unwrap_err();
    assert!(matches!(err, Gpt2Error::Checkpoint { .. }), "{err:?}");
    assert!(err.to_string().contains("not_a_dir"), "{err}");
    assert_eq!(std::fs::read(&file).unwrap(), b"precious");

    // 2. A path under a file cannot be created.
    let err = save_checkpoint(file.join("sub"), &checkpoint(11, 2)).unwrap_err();
    assert!(err.to_string().contains("not_a_dir"), "{err}");

    // 3. An invalid checkpoint saved over the good one.
    let mut bad = checkpoint(11, 2);
    bad.adam_v.pop();
    let err = save_checkpoint(&good_dir, &bad).unwrap_err();
    assert!(
        matches!(&err, Gpt2Error::LengthMismatch { what, .. } if what == "adam_v"),
        "{err:?}"
    );
    let mut bad = checkpoint(11, 2);
    bad.optimizer.learning_rate = f32::NAN;
    assert!(save_checkpoint(&good_dir, &bad).is_err());

    // 4. The checkpoint file's place is taken by a directory: the rename fails.
    let blocked_dir = root.path().join("blocked");
    std::fs::create_dir_all(checkpoint_file(&blocked_dir).join("x")).unwrap();
    assert!(save_checkpoint(&blocked_dir, &checkpoint(12, 3)).is_err());
    assert_eq!(
        std::fs::read_dir(&blocked_dir).unwrap().count(),
        1,
        "temp file removed"
    );

    // The good checkpoint is untouched, byte for byte.
    assert_eq!(
        std::fs::read(checkpoint_file(&good_dir)).unwrap(),
        good_bytes
    );
    assert_bit_identical(&good, &load_checkpoint(&good_dir).unwrap());
}

#[test]
fn a_crash_mid_save_leaves_a_stray_temporary_that_loading_ignores() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("ckpt");
    let good = checkpoint(3, 1);
    save_checkpoint(&dir, &good).unwrap();
    // What a crash during the next save would leave: a partial temporary file.
    let full = std::fs::read(checkpoint_file(&dir)).unwrap();
    std::fs::write(
        dir.join(format!("{CHECKPOINT_FILE}.braid-tmp-999-0")),
        &full[..full.len() / 2],
    )
    .unwrap();
    assert_bit_identical(&good, &load_checkpoint(&dir).unwrap());
}

fn write_raw(
    path: &std::path::Path,
    tensors: &[(&str, Vec<usize>, Dtype, Vec<u8>)],
    meta: Option<HashMap<String, String>>,
) {
    let views: Vec<_> = tensors
        .iter()
        .map(|(n, s, d, b)| (*n, TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    std::fs::write(path, safetensors::serialize(views, meta).unwrap()).unwrap();
}

#[test]
fn damaged_checkpoints_give_clear_errors() {
    let root = tempfile::tempdir().unwrap();

    let err = load_checkpoint(root.path().join("absent")).unwrap_err();
    assert!(err.to_string().contains("no such directory"), "{err}");

    let empty = root.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let err = load_checkpoint(&empty).unwrap_err();
    assert!(
        err.to_string()
            .contains(&format!("no {CHECKPOINT_FILE} in the directory")),
        "{err}"
    );
    std::fs::create_dir(empty.join(CHECKPOINT_FILE)).unwrap();
    let err = load_checkpoint(&empty).unwrap_err();
    assert!(
        err.to_string()
            .contains(&format!("{CHECKPOINT_FILE} in the directory is not a file")),
        "{err}"
    );
    std::fs::remove_dir(empty.join(CHECKPOINT_FILE)).unwrap();

    // Take a good checkpoint apart and reassemble it wrongly.
    let good_dir = root.path().join("good");
    let good = checkpoint(9, 1);
    save_checkpoint(&good_dir, &good).unwrap();
    let bytes = std::fs::read(checkpoint_file(&good_dir)).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let meta = header.metadata().clone().unwrap();
    let json: serde_json::Value = serde_json::from_str(&meta[METADATA_KEY]).unwrap();
    let tensor = |name: &str| {
        let v = st.tensor(name).unwrap();
        (v.shape().to_vec(), v.data().to_vec())
    };
    let (shape, params) = tensor("params");
    let (_, m) = tensor("adam_m");
    let (_, v) = tensor("adam_v");
    let n = shape[0];
    let dir = root.path().join("broken");
    std::fs::create_dir(&dir).unwrap();
    let path = checkpoint_file(&dir);
    let all = |v_name: &'static str| {
        vec![
            ("params", vec![n], Dtype::F32, params.clone()),
            ("adam_m", vec![n], Dtype::F32, m.clone()),
            (v_name, vec![n], Dtype::F32, v.clone()),
        ]
    };

    // The reassembled original loads.
    write_raw(&path, &all("adam_v"), Some(meta.clone()));
    assert_bit_identical(&good, &load_checkpoint(&dir).unwrap());

    // Missing tensor.
    write_raw(&path, &all("adam_w"), Some(meta.clone()));
    let err = load_checkpoint(&dir).unwrap_err();
    assert!(
        err.to_string().contains("missing tensor \"adam_v\""),
        "{err}"
    );

    // A tensor no checkpoint holds.
    let mut extra = all("adam_v");
    extra.push(("lm_head", vec![n], Dtype::F32, v.clone()));
    write_raw(&path, &extra, Some(meta.clone()));
    let err = load_checkpoint(&dir).unwrap_err();
    assert!(
        err.to_string().contains("holds a tensor \"lm_head\""),
        "{err}"
    );

    // A negative second moment.
    let mut negative = all("adam_v");
    let mut bad_v = v.clone();
    bad_v[4..8].copy_from_slice(&(-2.0f32).to_le_bytes());
    negative[2].3 = bad_v;
    write_raw(&path, &negative, Some(meta.clone()));
    let err = load_checkpoint(&dir).unwrap_err();
    assert!(
        err.to_string().contains("\"adam_v\" holds -2 at index 1"),
        "{err}"
    );

    // Wrong length for the configuration.
    let mut short = all("adam_v");
    short[1] = ("adam_m", vec![n - 1], Dtype::F32, m[4..].to_vec());
    write_raw(&path, &short, Some(meta.clone()));
    let err = load_checkpoint(&dir).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("adam_m")
            && msg.contains(&format!("[{}]", n - 1))
            && msg.contains(&format!("[{n}]")),
        "{msg}"
    );

    // Wrong dtype.
    let mut half = all("adam_v");
    half[0] = ("params", vec![2 * n], Dtype::F16, params.clone());
    write_raw(&path, &half, Some(meta.clone()));
    let err = load_checkpoint(&dir).unwrap_err();
    assert!(err.to_string().contains("F16"), "{err}");

    // Metadata without the step.
    let mut no_step = json.clone();
    no_step.as_object_mut().unwrap().remove("step");
    let mut meta2 = meta.clone();
    meta2.insert(METADATA_KEY.to_string(), no_step.to_string());
    write_raw(&path, &all("adam_v"), Some(meta2));
    let err = load_checkpoint(&dir).unwrap_err();
    assert!(err.to_string().contains("step"), "{err}");

    // A configuration whose shapes differ from the tensors.
    let mut wider = json.clone();
    wider["config"]["channels"] = serde_json::json!(128);
    let mut meta3 = meta.clone();
    meta3.insert(METADATA_KEY.to_string(), wider.to_string());
    write_raw(&path, &all("adam_v"), Some(meta3));
    let err = load_checkpoint(&dir).unwrap_err();
    assert!(err.to_string().contains("params"), "{err}");

    // An invalid configuration.
    let mut invalid = json.clone();
    invalid["config"]["num_heads"] = serde_json::json!(3);
    let mut meta4 = meta.clone();
    meta4.insert(METADATA_KEY.to_string(), invalid.to_string());
    write_raw(&path, &all("adam_v"), Some(meta4));
    let err = load_checkpoint(&dir).unwrap_err();
    assert!(err.to_string().contains("divisible"), "{err}");

    // Not a Braid checkpoint at all (e.g. an exported HF model).
    write_raw(&path, &all("adam_v"), None);
    let err = load_checkpoint(&dir).unwrap_err();
    assert!(err.to_string().contains(METADATA_KEY), "{err}");

    // Truncated file.
    std::fs::write(&path, &bytes[..bytes.len() - 1]).unwrap();
    let err = load_checkpoint(&dir).unwrap_err();
    assert!(matches!(err, Gpt2Error::Safetensors { .. }), "{err:?}");
}

#[test]
fn latest_checkpoint_picks_the_highest_step() {
    let root = tempfile::tempdir().unwrap();
    assert_eq!(latest_checkpoint(root.path().join("none")).unwrap(), None);
    for (name, step) in [("a", 200), ("b", 1000), ("c", 30)] {
        save_checkpoint(root.path().join(name), &checkpoint(step, step as u32)).unwrap();
    }
    std::fs::create_dir(root.path().join("unrelated")).unwrap();
    assert_eq!(
        latest_checkpoint(root.path()).unwrap(),
        Some(root.path().join("b"))
    );
}

/// A checkpoint whose header (the safetensors JSON: tensor names, dtypes,
/// shapes, offsets, and the metadata with the config, step, optimizer and
/// loader state) has random bytes replaced, inserted or removed (half of
/// them also cut short) loads, or fails with an error, never a panic. 400
/// cases from a fixed seed (`tests/damage`).
#[test]
fn randomly_damaged_headers_load_or_fail_cleanly() {
    let root = tempfile::tempdir().unwrap();
    let good_dir = root.path().join("good");
    save_checkpoint(&good_dir, &checkpoint(3, 2)).unwrap();
    let bytes = std::fs::read(checkpoint_file(&good_dir)).unwrap();
    let dir = root.path().join("edited");
    std::fs::create_dir(&dir).unwrap();
    let mut damage = damage::Damage::new(0x2545_f491_4f6c_dd1d);
    let (mut loaded, mut failed) = (0, 0);
    for case in 0..400 {
        // Half of the cases also cut the file somewhere.
        let b = damage.apply(&bytes, case % 2 == 1);
        std::fs::write(checkpoint_file(&dir), &b).unwrap();
        let r = std::panic::catch_unwind(|| load_checkpoint(&dir));
        match r {
            Ok(Ok(_)) => loaded += 1,
            Ok(Err(e)) => {
                assert!(!e.to_string().is_empty());
                failed += 1;
            }
            Err(_) => panic!("case {case}: loading a damaged checkpoint panicked"),
        }
    }
    assert!(
        failed > 200,
        "only {failed} of 400 damaged checkpoints failed to load"
    );
    eprintln!("{loaded} loaded, {failed} failed with an error");
}

//! Data: tokenizer, llm.c token files, token sources, the sharded loader, eval
//! windows and the built-in corpus.

use std::collections::{HashMap, HashSet};

use braid_gpt2::config::Gpt2Config;
use braid_gpt2::data::{
    builtin_text, builtin_tokens, eval_windows, read_token_file, write_token_file, DataLoader,
    LoaderState, Split, TokenSource, Tokenizer, EOT, GPT2_VOCAB_SIZE, TOKEN_FILE_HEADER_BYTES,
    TOKEN_FILE_MAGIC,
};
use braid_gpt2::error::Gpt2Error;

// ----- tokenizer ---------------------------------------------------------

#[test]
fn tokenizer_gives_gpt2_ids() {
    let tok = Tokenizer::gpt2().unwrap();
    assert_eq!(tok.encode("Hello world"), vec![15496, 995]);
    // Known GPT-2 ids (from OpenAI's encoder.json).
    assert_eq!(tok.encode(" the"), vec![262]);
    assert_eq!(tok.encode("!"), vec![0]);
    assert_eq!(tok.decode(&[EOT]).unwrap(), "<|endoftext|>");
    assert_eq!(tok.vocab_size(), 50257);
}

#[test]
fn tokenizer_round_trips_text() {
    let tok = Tokenizer::gpt2().unwrap();
    for text in [
        "",
        "Hello world",
        "  leading spaces, tabs\tand\nnewlines\n\n",
        "Ünïcödé, 日本語, emoji 🦀 and numbers 1234567890.",
        "It's a dog's life; they'll've done it.",
    ] {
        let ids = tok.encode(text);
        assert!(ids.iter().all(|&id| (id as usize) < GPT2_VOCAB_SIZE));
        assert_eq!(tok.decode(&ids).unwrap(), text);
    }
}

#[test]
fn endoftext_is_a_token_only_when_asked() {
    let tok = Tokenizer::gpt2().unwrap();
    let text = "one<|endoftext|>two";
    let with = tok.encode_with_eot(text);
    assert_eq!(with.iter().filter(|&&t| t == EOT).count(), 1);
    assert_eq!(tok.decode(&with).unwrap(), text);
    let plain = tok.encode(text);
    assert!(!plain.contains(&EOT));
    assert_eq!(tok.decode(&plain).unwrap(), text);
}

#[test]
fn decoding_an_unknown_id_names_it_and_its_position() {
    let tok = Tokenizer::gpt2().unwrap();
    let err = tok.decode(&[15496, 995, 50257]).unwrap_err();
    match &err {
        Gpt2Error::TokenOutOfRange { position, id, .. } => {
            assert_eq!((*position, *id), (2, 50257));
        }
        other => panic!("unexpected error {other:?}"),
    }
    let msg = err.to_string();
    assert!(msg.contains("50257") && msg.contains("position 2"), "{msg}");
}

#[test]
fn a_token_split_utf8_character_decodes_lossily() {
    let tok = Tokenizer::gpt2().unwrap();
    let ids = tok.encode("🦀");
    assert!(ids.len() > 1, "the crab emoji takes several byte tokens");
    let partial = tok.decode(&ids[..1]).unwrap();
    assert!(partial.contains('\u{FFFD}'));
}

// ----- token files -------------------------------------------------------

#[test]
fn token_file_round_trips_and_has_llmc_header() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("toks.bin");
    let tokens: Vec<u16> = (0..1000u32).map(|i| (i * 37 % 65536) as u16).collect();
    write_token_file(&path, &tokens).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    assert_eq!(bytes.len(), TOKEN_FILE_HEADER_BYTES + 2 * tokens.len());
    let int = |i: usize| i32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().unwrap());
    assert_eq!(int(0), 20240520);
    assert_eq!(int(1), 1);
    assert_eq!(int(2), 1000);
    assert!((3..256).all(|i| int(i) == 0));
    assert_eq!(u16::from_le_bytes([bytes[1024 + 2], bytes[1024 + 3]]), 37);
    assert_eq!(read_token_file(&path).unwrap(), tokens);
    // Overwriting leaves no temporary file behind.
    write_token_file(&path, &tokens[..10]).unwrap();
    assert_eq!(read_token_file(&path).unwrap(), &tokens[..10]);
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
}

#[test]
fn token_file_with_bad_magic_is_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.bin");
    let mut bytes = vec![0u8; TOKEN_FILE_HEADER_BYTES + 4];
    bytes[..4].copy_from_slice(&20240521i32.to_le_bytes());
    std::fs::write(&path, &bytes).unwrap();
    let err = read_token_file(&path).unwrap_err();
    assert!(
        matches!(
            err,
            Gpt2Error::BadMagic {
                found: 20240521,
                ..
            }
        ),
        "{err:?}"
    );
    let msg = err.to_string();
    assert!(msg.contains("bad.bin") && msg.contains("20240521"), "{msg}");
}

#[test]
fn token_file_with_bad_version_is_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("v2.bin");
    write_token_file(&path, &[1, 2, 3]).unwrap();
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[4..8].copy_from_slice(&2i32.to_le_bytes());
    std::fs::write(&path, &bytes).unwrap();
    let err = read_token_file(&path).unwrap_err();
    assert!(
        matches!(err, Gpt2Error::BadVersion { found: 2, .. }),
        "{err:?}"
    );
}

#[test]
fn truncated_token_file_names_path_and_counts() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("short.bin");
    let tokens: Vec<u16> = (0..100).collect();
    write_token_file(&path, &tokens).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    // Cut 41 tokens and a half.
    std::fs::write(&path, &bytes[..bytes.len() - 83]).unwrap();
    let err = read_token_file(&path).unwrap_err();
    match &err {
        Gpt2Error::TruncatedTokenFile {
            path: p,
            declared,
            found,
        } => {
            assert_eq!(p, &path);
            assert_eq!((*declared, *found), (100, 58));
        }
        other => panic!("unexpected error {other:?}"),
    }
    let msg = err.to_string();
    assert!(
        msg.contains("short.bin") && msg.contains("100") && msg.contains("58"),
        "{msg}"
    );
    // A file cut inside the header is an error too, not a panic.
    std::fs::write(&path, &bytes[..100]).unwrap();
    assert!(matches!(
        read_token_file(&path).unwrap_err(),
        Gpt2Error::BadTokenHeader { .. }
    ));
    // Bytes past the declared tokens are reported.
    let mut long = bytes.clone();
    long.extend_from_slice(&[0, 0, 0]);
    std::fs::write(&path, &long).unwrap();
    assert!(matches!(
        read_token_file(&path).unwrap_err(),
        Gpt2Error::TrailingTokenData { extra_bytes: 3, .. }
    ));
}

#[test]
fn missing_file_error_names_the_path() {
    let err = read_token_file("/nonexistent/dir/tokens.bin").unwrap_err();
    assert!(
        err.to_string().contains("/nonexistent/dir/tokens.bin"),
        "{err}"
    );
}

// ----- token sources -----------------------------------------------------

#[test]
fn token_source_detects_bin_by_magic_and_tokenizes_text() {
    let dir = tempfile::tempdir().unwrap();
    // A token file with a text-like extension is still read as tokens.
    let bin = dir.path().join("tokens.txt");
    write_token_file(&bin, &[15496, 995, 50256]).unwrap();
    let src = TokenSource::open(&bin).unwrap();
    assert_eq!(&*src.tokens(), &[15496, 995, 50256]);
    // Text is tokenized, <|endoftext|> becoming EOT.
    let txt = dir.path().join("corpus.txt");
    std::fs::write(&txt, "Hello world<|endoftext|>Hello world").unwrap();
    let src = TokenSource::open(&txt).unwrap();
    assert_eq!(&*src.tokens(), &[15496, 995, 50256, 15496, 995]);
    assert!(src.origin().contains("corpus.txt"));
    // save_bin + open gives the same tokens.
    let out = dir.path().join("out.bin");
    src.save_bin(&out).unwrap();
    assert_eq!(TokenSource::open(&out).unwrap().tokens(), src.tokens());
    // A .bin with a bad header is an error, not text.
    let fake = dir.path().join("fake.bin");
    std::fs::write(&fake, "this is text, not tokens").unwrap();
    assert!(matches!(
        TokenSource::open(&fake).unwrap_err(),
        Gpt2Error::BadMagic { .. }
    ));
    // Text that is not UTF-8 is reported with the offset.
    let bad = dir.path().join("bad.txt");
    std::fs::write(&bad, b"abc\xffdef").unwrap();
    assert!(matches!(
        TokenSource::open(&bad).unwrap_err(),
        Gpt2Error::NotUtf8 { offset: 3, .. }
    ));
}

#[test]
fn tokens_outside_the_vocabulary_are_reported_with_id_and_position() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ids.bin");
    let mut tokens: Vec<u16> = (0..20).collect();
    tokens[13] = 600;
    tokens[17] = 700;
    write_token_file(&path, &tokens).unwrap();
    let cfg = Gpt2Config::tiny(); // vocab 512
    let err = TokenSource::open_for(&path, &cfg).unwrap_err();
    match &err {
        Gpt2Error::TokenOutOfRange {
            position,
            id,
            vocab_size,
            ..
        } => assert_eq!((*position, *id, *vocab_size), (13, 600, 512)),
        other => panic!("unexpected error {other:?}"),
    }
    let msg = err.to_string();
    assert!(
        msg.contains("600") && msg.contains("position 13") && msg.contains("ids.bin"),
        "{msg}"
    );
    // The same tokens are fine for GPT-2's vocabulary.
    TokenSource::open_for(&path, &Gpt2Config::gpt2_124m()).unwrap();
}

#[test]
fn resolve_knows_builtin_names() {
    let train = TokenSource::resolve("builtin").unwrap();
    assert_eq!(train.origin(), "builtin:train");
    let val = TokenSource::resolve("builtin:val").unwrap();
    assert_eq!(val.origin(), "builtin:val");
    assert!(TokenSource::resolve("/no/such/file.txt").is_err());
}

/// llm.c's shards by a pattern (`fineweb_train_*.bin`): the files it
/// matches, in name order, as one stream; batches, shuffled batches and
/// evaluation windows over it are those over the same tokens in one file,
/// windows spanning two shards included. A pattern matching nothing, or a
/// text among the matches, is refused naming it.
#[test]
fn shards_named_by_a_pattern_are_one_stream() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let all: Vec<u16> = (0..203u16).map(|i| i * 7 % 500).collect();
    // Written out of name order, of uneven lengths, one of them empty.
    let cuts = [(2, 130..203), (0, 0..45), (3, 203..203), (1, 45..130)];
    for (i, r) in cuts {
        write_token_file(d.join(format!("data_train_{i:06}.bin")), &all[r]).unwrap();
    }
    write_token_file(d.join("data_val_000000.bin"), &[1, 2, 3]).unwrap();
    write_token_file(d.join("one.bin"), &all).unwrap();
    let pattern = d.join("data_train_*.bin").display().to_string();
    let shards = TokenSource::resolve(&pattern).unwrap();
    let one = TokenSource::resolve(&d.join("one.bin").display().to_string()).unwrap();
    assert_eq!(&*shards.tokens(), &all[..]);
    assert_eq!(shards.stream().segment_count(), 3);
    assert!(shards.origin().contains("(4 files)"), "{}", shards.origin());
    // An id out of the vocabulary is placed in its file: token 58 of the
    // stream (406) is token 13 of the second file.
    assert_eq!(all.iter().position(|&t| t >= 400), Some(58));
    let e = shards.check_vocab(400).unwrap_err().to_string();
    assert!(
        e.contains("data_train_000001.bin (") && e.contains("token id 406 at position 13"),
        "{e}"
    );
    one.check_vocab(500).unwrap();
    for shuffle in [None, Some(5)] {
        for (b, t, rank, world) in [(2, 8, 0, 1), (3, 5, 1, 2)] {
            let loader = |src: &TokenSource| {
                let l = DataLoader::new(src, b, t, rank, world).unwrap();
                match shuffle {
                    Some(seed) => l.shuffled(seed),
                    None => l,
                }
            };
            let (mut a, mut c) = (loader(&shards), loader(&one));
            // Past an epoch, so the wrap is met too.
            for _ in 0..30 {
                let (x, y) = (a.next_batch().unwrap(), c.next_batch().unwrap());
                assert_eq!((x.inputs, x.targets), (y.inputs, y.targets));
            }
        }
    }
    let windows = |src: &TokenSource| eval_windows(src, 13).unwrap().collect::<Vec<_>>();
    assert_eq!(windows(&shards), windows(&one));
    let (train, val) = shards.split_tail(0.3);
    assert_eq!(
        [&*train.tokens(), &*val.tokens()].concat(),
        all,
        "a split across shards"
    );
    // Known by the files it matches, however the pattern was written (a
    // resumed run compares this).
    let dotted = d.join(".").join("data_train_*.bin").display().to_string();
    let again = TokenSource::resolve(&dotted).unwrap();
    assert_ne!(again.origin(), shards.origin());
    assert_eq!(again.canonical_origin(), shards.canonical_origin());
    assert!(
        shards
            .canonical_origin()
            .ends_with("data_train_000003.bin (4 files)"),
        "{}",
        shards.canonical_origin()
    );
    // `*` takes no leading dot, as in a shell.
    std::fs::create_dir(d.join("h")).unwrap();
    write_token_file(d.join("h/a.bin"), &[7]).unwrap();
    write_token_file(d.join("h/.hidden.bin"), &[8]).unwrap();
    let h = TokenSource::resolve(&d.join("h/*.bin").display().to_string()).unwrap();
    assert_eq!(&*h.tokens(), &[7]);
    // What is refused.
    let none = d.join("nothing_*.bin").display().to_string();
    let err = TokenSource::resolve(&none).unwrap_err().to_string();
    assert!(
        err.contains("matches no file") && err.contains("nothing_*"),
        "{err}"
    );
    std::fs::write(d.join("data_train_notes.txt"), "some text").unwrap();
    let loose = d.join("data_train_*").display().to_string();
    let err = TokenSource::resolve(&loose).unwrap_err().to_string();
    assert!(
        err.contains("data_train_notes.txt") && err.contains("not an llm.c token file"),
        "{err}"
    );
    // A file whose name has a pattern's characters is that file.
    write_token_file(d.join("odd[1].bin"), &[4, 5]).unwrap();
    let odd = TokenSource::resolve(&d.join("odd[1].bin").display().to_string()).unwrap();
    assert_eq!(&*odd.tokens(), &[4, 5]);
}

#[test]
fn split_tail_keeps_every_token_once() {
    let src = TokenSource::from_tokens((0..100u16).collect::<Vec<_>>(), "t");
    let (train, val) = src.split_tail(0.1);
    assert_eq!(train.len(), 90);
    assert_eq!(val.tokens(), &(90..100u16).collect::<Vec<_>>()[..]);
    // A part: tokens of a range within them, or an error (it once panicked).
    assert_eq!(src.part(5..8, "p").unwrap().tokens(), &[5u16, 6, 7][..]);
    let e = src.part(0..101, "p").unwrap_err().to_string();
    assert!(
        e.contains("0..101 is not within the 100 tokens of t"),
        "{e}"
    );
}

// ----- loader --------------------------------------------------------------

fn counting_source(n: usize) -> TokenSource {
    TokenSource::from_tokens((0..n).map(|i| i as u16).collect::<Vec<_>>(), "counting")
}

/// The sharding invariant: for every step, the concatenation over ranks of the
/// per-rank batches (batch B) equals the batch of a single rank with batch B*W,
/// and ranks read disjoint tokens. Checked across several wrap-arounds, in
/// order and shuffled.
#[test]
fn sharded_batches_concatenate_to_the_single_rank_batch() {
    let src = counting_source(1000);
    let order = |l: DataLoader, shuffle: Option<u64>| match shuffle {
        Some(seed) => l.shuffled(seed),
        None => l,
    };
    for (world, shuffle) in (1..=4).flat_map(|w| [(w, None), (w, Some(7))]) {
        for (b, t) in [(1, 7), (2, 5), (3, 16)] {
            let mut single = order(DataLoader::new(&src, b * world, t, 0, 1).unwrap(), shuffle);
            let mut ranks: Vec<DataLoader> = (0..world)
                .map(|r| order(DataLoader::new(&src, b, t, r, world).unwrap(), shuffle))
                .collect();
            let steps = 3 * single.steps_per_epoch() + 2;
            for step in 0..steps {
                let global = single.next_batch().unwrap();
                let mut inputs = Vec::new();
                let mut targets = Vec::new();
                let mut seen = HashSet::new();
                for loader in &mut ranks {
                    let batch = loader.next_batch().unwrap();
                    assert_eq!(batch.inputs.len(), b * t);
                    for &x in &batch.inputs {
                        assert!(seen.insert(x), "token {x} read by two ranks at step {step}");
                    }
                    inputs.extend(batch.inputs);
                    targets.extend(batch.targets);
                }
                assert_eq!(inputs, global.inputs, "W={world} B={b} T={t} step {step}");
                assert_eq!(targets, global.targets, "W={world} B={b} T={t} step {step}");
                for loader in &ranks {
                    assert_eq!(loader.state(), single.state());
                }
            }
        }
    }
}

/// Shuffled, an epoch takes every whole window of the data once (those
/// left over at its end none), in an order that is not the in-order one
/// and changes each epoch; a loader restored mid-epoch continues it.
#[test]
fn a_shuffled_epoch_takes_every_window_once_in_a_new_order() {
    // 2 ranks x B 2 x T 4: 25 windows of 101 tokens, 6 steps an epoch.
    let src = counting_source(101);
    let mut loader = DataLoader::new(&src, 2, 4, 1, 2).unwrap().shuffled(3);
    let mut rank0 = DataLoader::new(&src, 2, 4, 0, 2).unwrap().shuffled(3);
    assert_eq!(loader.steps_per_epoch(), 6);
    let mut epochs: Vec<Vec<u32>> = Vec::new();
    for step in 0..18 {
        if step % 6 == 0 {
            epochs.push(Vec::new());
        }
        for l in [&mut rank0, &mut loader] {
            let batch = l.next_batch().unwrap();
            for (x, y) in batch.inputs.iter().zip(&batch.targets) {
                assert_eq!(*y, x + 1);
            }
            // Each row is one window: its first token, a multiple of T.
            for row in batch.inputs.chunks(4) {
                assert_eq!(row[0] % 4, 0);
                assert_eq!(row, &(row[0]..row[0] + 4).collect::<Vec<_>>()[..]);
                epochs.last_mut().unwrap().push(row[0] / 4);
            }
        }
    }
    for (e, windows) in epochs.iter().enumerate() {
        let mut seen = windows.clone();
        seen.sort_unstable();
        seen.dedup();
        assert_eq!(
            seen.len(),
            24,
            "epoch {e}: a window taken twice: {windows:?}"
        );
        assert!(windows.iter().all(|&w| w < 25));
        assert!(!windows.is_sorted(), "epoch {e} is in order");
    }
    assert_ne!(epochs[0], epochs[1]);
    assert_ne!(epochs[1], epochs[2]);
    // Restored mid-epoch (step 3 of epoch 1), it continues as the original.
    let mut a = DataLoader::new(&src, 2, 4, 1, 2).unwrap().shuffled(3);
    for _ in 0..9 {
        a.next_batch().unwrap();
    }
    let mut b = DataLoader::new(&src, 2, 4, 1, 2).unwrap().shuffled(3);
    b.set_state(a.state()).unwrap();
    for _ in 0..8 {
        assert_eq!(a.next_batch().unwrap(), b.next_batch().unwrap());
    }
    // Another seed, another order.
    let mut c = DataLoader::new(&src, 2, 4, 1, 2).unwrap().shuffled(4);
    let mut d = DataLoader::new(&src, 2, 4, 1, 2).unwrap().shuffled(3);
    let (c, d): (Vec<_>, Vec<_>) = (0..6)
        .map(|_| (c.next_batch().unwrap(), d.next_batch().unwrap()))
        .unzip();
    assert_ne!(c, d);
}

#[test]
fn targets_are_inputs_shifted_by_one() {
    let src = counting_source(500);
    let mut loader = DataLoader::new(&src, 4, 8, 1, 2).unwrap();
    for _ in 0..20 {
        let batch = loader.next_batch().unwrap();
        for (x, y) in batch.inputs.iter().zip(&batch.targets) {
            assert_eq!(*y, x + 1);
        }
    }
}

#[test]
fn loader_wraps_around_and_counts_epochs() {
    let src = counting_source(100);
    // 2 ranks x B 2 x T 8 = 32 tokens a step: 3 steps per epoch (96 + 1 <= 100).
    let mut loader = DataLoader::new(&src, 2, 8, 0, 2).unwrap();
    assert_eq!(loader.steps_per_epoch(), 3);
    let firsts: Vec<u32> = (0..7)
        .map(|_| loader.next_batch().unwrap().inputs[0])
        .collect();
    assert_eq!(firsts, vec![0, 32, 64, 0, 32, 64, 0]);
    assert_eq!(
        loader.state(),
        LoaderState {
            position: 32,
            epoch: 2
        }
    );
}

#[test]
fn restored_loader_continues_identically() {
    let src = counting_source(777);
    let mut a = DataLoader::new(&src, 3, 10, 1, 3).unwrap();
    for _ in 0..11 {
        a.next_batch().unwrap();
    }
    let saved = a.state();
    // The state survives a JSON round trip (it goes into checkpoints).
    let json = serde_json::to_string(&saved).unwrap();
    let restored: LoaderState = serde_json::from_str(&json).unwrap();
    assert_eq!(restored, saved);
    let expected: Vec<_> = (0..25).map(|_| a.next_batch().unwrap()).collect();
    let mut b = DataLoader::new(&src, 3, 10, 1, 3).unwrap();
    b.next_batch().unwrap(); // wherever it was, set_state moves it
    b.set_state(restored).unwrap();
    let got: Vec<_> = (0..25).map(|_| b.next_batch().unwrap()).collect();
    assert_eq!(got, expected);
    assert_eq!(a.state(), b.state());
    // A fresh loader does not reproduce the batches without the state.
    let mut c = DataLoader::new(&src, 3, 10, 1, 3).unwrap();
    assert_ne!(c.next_batch().unwrap(), expected[0]);
    assert!(matches!(
        c.set_state(LoaderState {
            position: 778,
            epoch: 0
        }),
        Err(Gpt2Error::BadLoaderPosition { .. })
    ));
}

/// With N micro-batches a step of W ranks reads, micro-batch by micro-batch
/// and rank by rank, the batch one rank with batch N*B*W reads, across
/// wraps (decided once a step, so a step never mixes two epochs) and
/// shuffled; the state after each step is the single rank's.
#[test]
fn micro_batches_of_a_step_are_the_combined_batch() {
    let src = counting_source(1000);
    let order = |l: DataLoader, shuffle: Option<u64>| match shuffle {
        Some(seed) => l.shuffled(seed),
        None => l,
    };
    for (n, world, shuffle) in [(2, 1, None), (3, 2, None), (2, 3, Some(7)), (4, 1, Some(3))] {
        let (b, t) = (2, 9);
        let mut single = order(
            DataLoader::new(&src, n * b * world, t, 0, 1).unwrap(),
            shuffle,
        );
        let mut ranks: Vec<DataLoader> = (0..world)
            .map(|r| {
                let l = DataLoader::new(&src, b, t, r, world).unwrap();
                order(l.micro_batches(n).unwrap(), shuffle)
            })
            .collect();
        assert_eq!(ranks[0].steps_per_epoch(), single.steps_per_epoch());
        // 999 tokens of windows: the step does not divide them.
        assert_ne!(999 % (n * b * world * t), 0);
        for step in 0..3 * single.steps_per_epoch() + 2 {
            let global = single.next_batch().unwrap();
            let (mut inputs, mut targets) = (Vec::new(), Vec::new());
            for _ in 0..n {
                for loader in &mut ranks {
                    let batch = loader.next_batch().unwrap();
                    inputs.extend(batch.inputs);
                    targets.extend(batch.targets);
                }
            }
            let what = format!("N={n} W={world} shuffle {shuffle:?} step {step}");
            assert_eq!(inputs, global.inputs, "{what}");
            assert_eq!(targets, global.targets, "{what}");
            for loader in &ranks {
                assert_eq!(loader.state(), single.state(), "{what}");
            }
        }
    }
    // The data must hold a whole step.
    let l = DataLoader::new(&counting_source(100), 2, 8, 0, 2).unwrap();
    let err = l.micro_batches(4).unwrap_err();
    assert!(
        matches!(
            err,
            Gpt2Error::DatasetTooSmall {
                needed: 129,
                micro_batches: 4,
                ..
            }
        ),
        "{err:?}"
    );
    assert!(
        err.to_string()
            .contains("one step of 4 micro-batches x 2 rank(s) x batch 2"),
        "{err}"
    );
}

#[test]
fn loader_rejects_bad_settings() {
    let src = counting_source(100);
    let err = DataLoader::new(&src, 4, 8, 0, 4).unwrap_err();
    assert!(
        matches!(
            err,
            Gpt2Error::DatasetTooSmall {
                needed: 129,
                tokens: 100,
                ..
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("counting"));
    assert!(matches!(
        DataLoader::new(&src, 1, 8, 2, 2),
        Err(Gpt2Error::InvalidLoader { .. })
    ));
    assert!(DataLoader::new(&src, 0, 8, 0, 1).is_err());
    assert!(DataLoader::new(&src, 1, 0, 0, 1).is_err());
    let cfg = Gpt2Config::tiny();
    let err = DataLoader::for_config(&src, &cfg, 1, 65, 0, 1).unwrap_err();
    assert!(err.to_string().contains("max_seq_len 64"), "{err}");
    let mut wide: Vec<u16> = (0..100).collect();
    wide[42] = 512;
    let wide = TokenSource::from_tokens(wide, "wide");
    // The error of id 512 at position 42.
    let names_42 = |e: &Gpt2Error| {
        matches!(
            e,
            Gpt2Error::TokenOutOfRange {
                position: 42,
                id: 512,
                ..
            }
        )
    };
    let err = DataLoader::for_config(&wide, &cfg, 1, 8, 0, 1).unwrap_err();
    assert!(names_42(&err), "{err:?}");
    DataLoader::for_config(&src, &cfg, 1, 64, 0, 1).unwrap();
    // Checked window by window (a source too large to scan first): the
    // batches before the bad id come, the one that reads it is refused
    // naming it, and the loader stays where it was.
    let mut l = DataLoader::new(&wide, 2, 8, 0, 1)
        .unwrap()
        .checking_ids(512);
    l.next_batch().unwrap();
    l.next_batch().unwrap();
    let at = l.state();
    let (mut x, mut y) = (vec![0; 16], vec![0; 16]);
    let err = l.next_batch_into(&mut x, &mut y).unwrap_err();
    assert!(names_42(&err), "{err:?}");
    assert!(err.to_string().contains("wide"), "{err}");
    assert_eq!(l.state(), at);
    // `next_batch` says so too (it once panicked).
    let err = l.next_batch().unwrap_err();
    assert!(names_42(&err), "{err:?}");
    assert_eq!(l.state(), at);
    let mut l = DataLoader::new(&src, 2, 4, 0, 1).unwrap();
    let (mut x, mut y) = (vec![0; 7], vec![0; 8]);
    assert!(l.next_batch_into(&mut x, &mut y).is_err());
}

// ----- eval windows --------------------------------------------------------

#[test]
fn eval_windows_predict_each_token_once() {
    let src = counting_source(23);
    let windows: Vec<_> = eval_windows(&src, 5).unwrap().collect();
    assert_eq!(windows.len(), 4); // (23 - 1) / 5
    for (i, w) in windows.iter().enumerate() {
        assert_eq!(w.index, i);
        let i = i as u32;
        assert_eq!(w.inputs, (5 * i..5 * i + 5).collect::<Vec<_>>());
        assert_eq!(w.targets, (5 * i + 1..5 * i + 6).collect::<Vec<_>>());
    }
    assert_eq!(eval_windows(&src, 22).unwrap().count(), 1);
    assert_eq!(eval_windows(&src, 23).unwrap().count(), 0);
    assert_eq!(eval_windows(&src, 5).unwrap().len(), 4);
    assert!(eval_windows(&src, 0).is_err());
}

// ----- built-in corpus -----------------------------------------------------

#[test]
fn builtin_corpus_is_deterministic_english_and_in_vocabulary() {
    let text = builtin_text(Split::Train);
    assert_eq!(text, builtin_text(Split::Train));
    assert!(text.len() >= Split::Train.target_bytes());
    assert!(text.len() < Split::Train.target_bytes() + 2048);
    assert!(text.starts_with(char::is_uppercase));
    assert!(text.contains("Once upon a time"));
    let tokens = builtin_tokens(Split::Train).unwrap();
    assert!(tokens.len() > 15_000, "{} tokens", tokens.len());
    assert!(tokens.iter().all(|&t| (t as usize) < GPT2_VOCAB_SIZE));
    assert!(tokens.contains(&(EOT as u16)));
    let ids: Vec<u32> = tokens.iter().map(|&t| t.into()).collect();
    assert_eq!(Tokenizer::gpt2().unwrap().decode(&ids).unwrap(), text);
    let val = builtin_text(Split::Val);
    assert_ne!(val, text[..val.len()]);
    // Pin the corpus: a change to the generator must be deliberate.
    let hash = text.bytes().fold(0xcbf29ce484222325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100000001b3)
    });
    assert_eq!(hash, builtin_hash_pin(), "the built-in corpus changed");
}

/// FNV-1a of the train split's text.
fn builtin_hash_pin() -> u64 {
    16881006898083536623
}

/// Learnability proxy: a smoothed bigram model fitted on the train split
/// predicts the unseen validation split far better than a unigram model, so
/// there is structure that generalises for a network to learn.
#[test]
fn builtin_corpus_has_structure_that_generalises() {
    let train = builtin_tokens(Split::Train).unwrap();
    let val = builtin_tokens(Split::Val).unwrap();
    let vocab: HashSet<u16> = train.iter().copied().collect();
    let v = vocab.len() as f64 + 1.0;
    let mut uni: HashMap<u16, f64> = HashMap::new();
    let mut bi: HashMap<(u16, u16), f64> = HashMap::new();
    for w in train.windows(2) {
        *uni.entry(w[0]).or_default() += 1.0;
        *bi.entry((w[0], w[1])).or_default() += 1.0;
    }
    let n = (train.len() - 1) as f64;
    let (mut uni_nll, mut bi_nll) = (0.0, 0.0);
    for w in val.windows(2) {
        let cu = uni.get(&w[1]).copied().unwrap_or(0.0);
        let p_uni = (cu + 0.1) / (n + 0.1 * v);
        let ctx = uni.get(&w[0]).copied().unwrap_or(0.0);
        let cb = bi.get(&(w[0], w[1])).copied().unwrap_or(0.0);
        let p_bi = 0.9 * (cb / ctx.max(1.0)) + 0.1 * p_uni;
        uni_nll -= p_uni.ln();
        bi_nll -= p_bi.ln();
    }
    let m = (val.len() - 1) as f64;
    let (uni_nll, bi_nll) = (uni_nll / m, bi_nll / m);
    eprintln!(
        "builtin: {} train / {} val tokens, {} distinct; val NLL unigram {uni_nll:.3}, bigram {bi_nll:.3} nats (uniform {:.3})",
        train.len(),
        val.len(),
        vocab.len(),
        (GPT2_VOCAB_SIZE as f64).ln()
    );
    assert!(uni_nll < 6.0, "unigram {uni_nll}");
    assert!(
        bi_nll < 0.5 * uni_nll,
        "bigram {bi_nll} vs unigram {uni_nll}"
    );
}

#[test]
fn token_file_magic_constant_matches_llmc() {
    assert_eq!(TOKEN_FILE_MAGIC, 20240520);
}

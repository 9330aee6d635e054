//! The `braid-gpt2` program: a short training run, evaluation and sampling of
//! what it saved, and bad inputs that must stop it with a clear message, a
//! non-zero exit status and no file touched.

use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use braid_gpt2::data::{write_token_file, Tokenizer};

const BIN: &str = env!("CARGO_BIN_EXE_braid-gpt2");

fn run(dir: &Path, args: &[&str]) -> Output {
    run_env(dir, args, &[])
}

/// [`run`] with environment variables set.
fn run_env(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    Command::new(BIN)
        .args(args)
        .envs(env.iter().copied())
        .current_dir(dir)
        .output()
        .expect("the program runs")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn ok(dir: &Path, args: &[&str]) -> String {
    let out = run(dir, args);
    assert!(
        out.status.success(),
        "{args:?} failed:\n{}\n{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    text(&out.stdout)
}

/// Runs `args`, expects failure with a message containing every `needles`;
/// returns the message (standard error).
fn fails(dir: &Path, args: &[&str], needles: &[&str]) -> String {
    fails_env(dir, args, &[], needles)
}

/// [`fails`] with environment variables set.
fn fails_env(dir: &Path, args: &[&str], env: &[(&str, &str)], needles: &[&str]) -> String {
    let out = run_env(dir, args, env);
    let err = text(&out.stderr);
    assert!(!out.status.success(), "{args:?} succeeded:\n{err}");
    for n in needles {
        assert!(
            err.contains(n),
            "{args:?}: the message does not mention {n:?}:\n{err}"
        );
    }
    err
}

/// The loss `eval` prints (`loss=<mean cross-entropy>`).
fn eval_loss(out: &str) -> f64 {
    out.lines()
        .find_map(|l| l.strip_prefix("loss="))
        .unwrap_or_else(|| panic!("no loss= line in:\n{out}"))
        .parse()
        .unwrap()
}

/// Tokens below the tiny model's vocabulary (runs of consecutive ids).
fn tokens(n: usize) -> Vec<u16> {
    (0..n)
        .map(|i| ((i / 7 * 13 + i % 7) % 512) as u16)
        .collect()
}

/// A scratch directory holding `train.bin`, 3,000 tokens for the tiny
/// model.
fn dir_with_train_bin() -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    write_token_file(tmp.path().join("train.bin"), &tokens(3000)).unwrap();
    tmp
}

/// The names in a checkpoint directory, sorted: the checkpoint, and the
/// lock of the run that used it (`checkpoint::LOCK_FILE`).
fn checkpoint_dir_names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert!(names.iter().any(|n| n == braid_gpt2::checkpoint::LOCK_FILE));
    names
}

/// Every file under `dir` with its contents.
fn snapshot(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(snapshot(&p));
        } else {
            out.push((p.clone(), std::fs::read(&p).unwrap()));
        }
    }
    out.sort();
    out
}

/// A rank that stops in the middle of a step: the program exits non-zero
/// naming the failure, and the last checkpoint before it is whole.
#[test]
fn a_rank_failing_mid_step_exits_non_zero_and_keeps_the_last_checkpoint() {
    let tmp = dir_with_train_bin();
    let d = tmp.path();
    #[rustfmt::skip]
    let args = [
        "train", "--model", "tiny", "--data", "train.bin", "--ranks", "2", "--steps", "6",
        "--batch-size", "2", "--seq-len", "16", "--no-trace",
        "--checkpoint-dir", "ckpt", "--checkpoint-every", "2", "--inject-fault", "1:4",
    ];
    fails(d, &args, &["injected fault"]);
    let ckpt = braid_gpt2::checkpoint::load_checkpoint(d.join("ckpt")).unwrap();
    assert_eq!(ckpt.step, 2);
    // The same with ZeRO-1 (the checkpoint gathered from the shards).
    std::fs::remove_dir_all(d.join("ckpt")).unwrap();
    let zero: Vec<&str> = args.iter().copied().chain(["--zero", "1"]).collect();
    fails(d, &zero, &["injected fault"]);
    let ckpt = braid_gpt2::checkpoint::load_checkpoint(d.join("ckpt")).unwrap();
    assert_eq!(ckpt.step, 2);
    assert_eq!(ckpt.extra.get("zero"), Some(&serde_json::json!(1)));
    // A task that never returns: the process still exits, non-zero, naming
    // the collective that timed out, and the checkpoint is whole.
    std::fs::remove_dir_all(d.join("ckpt")).unwrap();
    let hang: Vec<&str> = args[..args.len() - 1]
        .iter()
        .copied()
        .chain(["1:4:hang", "--comm-timeout", "2"])
        .collect();
    fails(d, &hang, &["timed out", "all_reduce"]);
    let ckpt = braid_gpt2::checkpoint::load_checkpoint(d.join("ckpt")).unwrap();
    assert_eq!(ckpt.step, 2);
    // A failed run writes the trace of what ran, and says where.
    std::fs::remove_dir_all(d.join("ckpt")).unwrap();
    let traced: Vec<&str> = args
        .iter()
        .copied()
        .filter(|a| *a != "--no-trace")
        .chain(["--trace", "failed.json"])
        .collect();
    fails(d, &traced, &["injected fault", "failed.json"]);
    let trace: serde_json::Value =
        serde_json::from_slice(&std::fs::read(d.join("failed.json")).unwrap()).unwrap();
    let events = trace["traceEvents"].as_array().unwrap();
    assert!(
        events
            .iter()
            .any(|e| e["ph"] == "X" && e["name"] == "injected fault"),
        "the failing task is in the trace"
    );
    // In the first step too, where the reducer reads back what the ranks
    // agreed on (its bucket order and timings): the error ends with what
    // failed first, not only the read-back a failure skipped.
    std::fs::remove_dir_all(d.join("ckpt")).unwrap();
    let first: Vec<&str> = args[..args.len() - 1]
        .iter()
        .copied()
        .chain(["0:1"])
        .collect();
    let err = fails(d, &first, &["injected fault"]);
    assert!(err.contains("panicked"), "{err}");
    fails(d, &["train", "--comm-timeout", "0"], &["--comm-timeout"]);
    // Other ZeRO stages are refused by name.
    fails(d, &["train", "--zero", "2"], &["ZeRO stage", "2"]);
    // A malformed fault is refused like any bad flag.
    fails(d, &["train", "--inject-fault", "1"], &["RANK:STEP"]);
}

/// A run whose loss goes NaN stops at that step on every rank, keeps the
/// checkpoint saved before it and writes its trace; a resumed run says
/// which of its settings differ from the saved run's, and only then.
#[test]
fn a_diverging_run_stops_and_a_changed_resume_says_so() {
    let tmp = dir_with_train_bin();
    let d = tmp.path();
    #[rustfmt::skip]
    let base = [
        "train", "--model", "tiny", "--data", "train.bin", "--ranks", "2",
        "--batch-size", "2", "--seq-len", "16", "--lr-schedule", "constant",
        "--checkpoint-dir", "ckpt", "--checkpoint-every", "1",
    ];
    let with = |extra: &[&'static str]| -> Vec<&str> {
        base.iter().copied().chain(extra.iter().copied()).collect()
    };
    ok(d, &with(&["--steps", "2", "--no-trace"]));
    // Resumed with the same settings: nothing to say.
    let again = run(d, &with(&["--steps", "3", "--resume", "--no-trace"]));
    let quiet = text(&again.stderr);
    assert!(again.status.success(), "{quiet}");
    assert!(!quiet.contains("settings differ"), "{quiet}");
    // Resumed on other data (the same tokens in another file): named.
    std::fs::copy(d.join("train.bin"), d.join("other.bin")).unwrap();
    #[rustfmt::skip]
    let other: Vec<&str> = with(&["--steps", "4", "--resume", "--no-trace"])
        .into_iter()
        .map(|a| if a == "train.bin" { "other.bin" } else { a })
        .collect();
    let out = run(d, &other);
    let note = text(&out.stderr);
    assert!(out.status.success(), "{note}");
    let canonical = |name: &str| d.join(name).canonicalize().unwrap().display().to_string();
    let named = format!(
        "training data {} (the checkpoint's: {})",
        canonical("other.bin"),
        canonical("train.bin")
    );
    assert!(
        note.contains("settings differ") && note.contains(&named),
        "{note}"
    );
    // Resumed with a rate of 1e30, which sends every weight to about 1e30
    // in one step: the change is said once, then the run diverges and
    // stops at the first step whose loss is not finite.
    let err = fails(
        d,
        &with(&[
            "--steps", "9", "--resume", "--lr", "1e30", "--trace", "t.json",
        ]),
        &["training diverged at step", "t.json"],
    );
    assert_eq!(err.matches("settings differ").count(), 1, "{err}");
    assert!(
        err.contains("peak learning rate 1e30 (the checkpoint's: 0.002)"),
        "{err}"
    );
    let step: u64 = err
        .split("training diverged at step ")
        .nth(1)
        .and_then(|r| r.split(':').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no step in: {err}"));
    assert!((4..=9).contains(&step), "{err}");
    assert!(d.join("t.json").exists());
    // The checkpoints before it were saved, the diverged state was not.
    let ckpt = braid_gpt2::checkpoint::load_checkpoint(d.join("ckpt")).unwrap();
    assert_eq!(ckpt.step, step - 1, "{err}");

    // A rate of 1e38 sends weights past `f32::MAX` in the update itself,
    // before any loss shows it: that state is not saved either.
    std::fs::remove_dir_all(d.join("ckpt")).unwrap();
    ok(d, &with(&["--steps", "2", "--no-trace"]));
    let err = fails(
        d,
        &with(&["--steps", "9", "--resume", "--lr", "1e38", "--no-trace"]),
        &["training diverged"],
    );
    let ckpt = braid_gpt2::checkpoint::load_checkpoint(d.join("ckpt")).unwrap();
    assert!(
        ckpt.params.iter().all(|x| x.is_finite()),
        "step {} saved non-finite weights: {err}",
        ckpt.step
    );

    // Weights named as the checkpoint's own file would replace it: refused,
    // by train and by export, before anything is written.
    let file = "ckpt/checkpoint.safetensors";
    let before = std::fs::read(d.join(file)).unwrap();
    #[rustfmt::skip]
    fails(d, &["export", "--checkpoint", "ckpt", "--save-weights", file],
          &["checkpoint's own file"]);
    fails(
        d,
        &with(&[
            "--steps",
            "12",
            "--resume",
            "--no-trace",
            "--save-weights",
            file,
        ]),
        &["checkpoint's own file"],
    );
    assert_eq!(std::fs::read(d.join(file)).unwrap(), before);
}

/// A resumed run knows its data file by any of its names, and names the
/// fused kernels, the tied split and the kind of schedule as the command
/// line does.
#[test]
fn a_resume_names_files_kernels_and_schedules_as_the_command_line_does() {
    let tmp = dir_with_train_bin();
    let d = tmp.path();
    #[rustfmt::skip]
    let base = [
        "train", "--model", "tiny", "--data", "train.bin", "--ranks", "2",
        "--batch-size", "2", "--seq-len", "16", "--lr-schedule", "constant",
        "--fuse", "classifier", "--checkpoint-dir", "ckpt", "--no-trace",
    ];
    // `base` with some values swapped, then `extra`; what it printed.
    let train = |swap: &[(&str, &str)], extra: &[&str]| -> String {
        let args: Vec<&str> = (base.iter())
            .map(|a| {
                swap.iter()
                    .find(|(from, _)| from == a)
                    .map_or(*a, |(_, to)| *to)
            })
            .chain(extra.iter().copied())
            .collect();
        let out = run(d, &args);
        let err = text(&out.stderr);
        assert!(out.status.success(), "{args:?}: {err}");
        err
    };
    train(&[], &["--steps", "2"]);
    // The same file by other names: nothing to say.
    let absolute = d.join("train.bin").display().to_string();
    for (name, steps) in [("./train.bin", "3"), (absolute.as_str(), "4")] {
        let err = train(&[("train.bin", name)], &["--steps", steps, "--resume"]);
        assert!(!err.contains("settings differ"), "{name}: {err}");
    }
    let err = train(
        &[("classifier", "all"), ("constant", "cosine")],
        &["--steps", "5", "--resume", "--no-tied-split"],
    );
    for said in [
        "fused kernels: all (the checkpoint's: classifier)",
        "tied gradient split off (the checkpoint's: on)",
        "learning-rate schedule cosine (the checkpoint's: constant)",
    ] {
        assert!(err.contains(said), "{said:?} not in: {err}");
    }
    assert!(
        !err.contains("decay to step") && !err.contains("training data"),
        "{err}"
    );
    // Shuffled with a seed of its own: a resume keeps the checkpoint's
    // seed unless another is given, and then says so.
    std::fs::remove_dir_all(d.join("ckpt")).unwrap();
    train(&[], &["--steps", "2", "--shuffle", "--seed", "9"]);
    let err = train(&[], &["--steps", "3", "--resume", "--shuffle"]);
    assert!(!err.contains("settings differ"), "{err}");
    let err = train(
        &[],
        &["--steps", "4", "--resume", "--shuffle", "--seed", "10"],
    );
    let said = "data order shuffled with seed 10 (the checkpoint's: shuffled with seed 9)";
    assert!(err.contains(said), "{said:?} not in: {err}");
}

/// Weights written to standard output (`--save-weights /dev/stdout >
/// w.safetensors`) are the file alone: the summary goes to standard error.
#[cfg(target_os = "linux")]
#[test]
fn weights_to_standard_output_are_the_file_alone() {
    let tmp = dir_with_train_bin();
    let d = tmp.path();
    #[rustfmt::skip]
    let args = [
        "train", "--model", "tiny", "--data", "train.bin", "--steps", "2", "--ranks", "1",
        "--batch-size", "2", "--seq-len", "16", "--no-trace", "--save-weights",
    ];
    let with = |out: &'static str| -> Vec<&str> { args.iter().copied().chain([out]).collect() };
    ok(d, &with("ref.safetensors"));
    let file = std::fs::File::create(d.join("w.safetensors")).unwrap();
    let out = Command::new(BIN)
        .args(with("/dev/stdout"))
        .current_dir(d)
        .stdout(file)
        .output()
        .unwrap();
    let err = text(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("loss "), "the summary is on stderr: {err}");
    assert_eq!(
        std::fs::read(d.join("w.safetensors")).unwrap(),
        std::fs::read(d.join("ref.safetensors")).unwrap()
    );
}

/// Starts `args`, returning the child and its standard error's lines as
/// they come.
fn spawn_lines(
    dir: &Path,
    args: &[&str],
) -> (std::process::Child, std::sync::mpsc::Receiver<String>) {
    let mut cmd = Command::new(BIN);
    cmd.args(args);
    spawn_command_lines(dir, cmd)
}

/// [`spawn_lines`] of a command made by the caller.
///
/// The child starts with the signals the tests send at their default
/// action: a test run in the background of a script (as CI may run it)
/// inherits SIGINT ignored, and the program keeps a signal ignored at its
/// start ignored.
fn spawn_command_lines(
    dir: &Path,
    mut cmd: Command,
) -> (std::process::Child, std::sync::mpsc::Receiver<String>) {
    use std::os::unix::process::CommandExt;
    // SAFETY: signal() is async-signal-safe, as the code between fork and
    // exec must be.
    unsafe {
        cmd.pre_exec(|| {
            for s in [SIGHUP, SIGINT, SIGTERM] {
                libc::signal(s, libc::SIG_DFL);
            }
            Ok(())
        });
    }
    let mut child = cmd
        .current_dir(dir)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let err = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufRead::lines(std::io::BufReader::new(err)) {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    (child, rx)
}

/// Waits for a line containing `needle`, returning every line so far.
fn wait_for_line(rx: &std::sync::mpsc::Receiver<String>, needle: &str) -> Vec<String> {
    let mut seen = Vec::new();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    while !seen.last().is_some_and(|l: &String| l.contains(needle)) {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) => seen.push(line),
            Err(e) => panic!("no line with {needle:?} ({e}) in:\n{}", seen.join("\n")),
        }
    }
    seen
}

/// Sends SIGINT, as Ctrl-C does.
fn interrupt(child: &std::process::Child) {
    send(child, "-INT");
}

/// Sends a signal (`-INT`, `-TERM`).
fn send(child: &std::process::Child, signal: &str) {
    let ok = Command::new("kill")
        .args([signal, &child.id().to_string()])
        .status()
        .unwrap();
    assert!(ok.success());
}

const SIGHUP: i32 = 1;
const SIGINT: i32 = 2;
const SIGTERM: i32 = 15;

/// Waits for the child to exit (at most `secs`, else it is killed and the
/// test fails), returning its status.
fn exit_within(child: &mut std::process::Child, secs: u64) -> std::process::ExitStatus {
    let start = std::time::Instant::now();
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s;
        }
        if start.elapsed() > std::time::Duration::from_secs(secs) {
            child.kill().unwrap();
            panic!("still running {secs} s after it should have stopped");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// Ctrl-C stops a run at the end of a step, every rank at the same one,
/// which saves its checkpoint and writes its trace as a finished run does,
/// and ends by the signal (a shell's status 130); a second Ctrl-C ends a
/// run that cannot finish its step.
#[test]
fn ctrl_c_stops_at_a_step_that_saves_and_a_second_one_at_once() {
    let tmp = dir_with_train_bin();
    let d = tmp.path();
    #[rustfmt::skip]
    let base = [
        "train", "--model", "tiny", "--data", "train.bin", "--ranks", "2",
        "--batch-size", "2", "--seq-len", "16", "--lr-schedule", "constant",
        "--steps", "1000000",
    ];
    let with = |extra: &[&'static str]| -> Vec<&str> {
        base.iter().copied().chain(extra.iter().copied()).collect()
    };
    let (mut child, rx) = spawn_lines(d, &with(&["--checkpoint-dir", "ckpt", "--trace", "t.json"]));
    wait_for_line(&rx, "step     3 ");
    interrupt(&child);
    let status = exit_within(&mut child, 60);
    let err: Vec<String> = rx.iter().collect();
    let err = err.join("\n");
    assert_eq!(status.signal(), Some(SIGINT), "{err}");
    let step: u64 = err
        .split("stopped by a signal after step ")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no step in: {err}"));
    assert!((3..1_000_000).contains(&step), "{err}");
    assert!(err.contains("--resume continues it"), "{err}");
    let ckpt = braid_gpt2::checkpoint::load_checkpoint(d.join("ckpt")).unwrap();
    assert_eq!(ckpt.step, step, "the checkpoint is of the last step");
    let trace: serde_json::Value =
        serde_json::from_slice(&std::fs::read(d.join("t.json")).unwrap()).unwrap();
    assert!(!trace["traceEvents"].as_array().unwrap().is_empty());
    // It resumes from there, with nothing to say about its settings.
    let next = (step + 2).to_string();
    #[rustfmt::skip]
    let resumed: Vec<&str> = base[..base.len() - 1].iter().copied().chain([
        next.as_str(), "--checkpoint-dir", "ckpt", "--resume", "--no-trace",
    ]).collect();
    let out = run(d, &resumed);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(!text(&out.stderr).contains("settings differ"));

    // A rank that never finishes step 2: the first Ctrl-C cannot stop the
    // run at a step's end, the second ends it at once.
    #[rustfmt::skip]
    let (mut child, rx) = spawn_lines(d, &with(&[
        "--no-trace", "--inject-fault", "1:2:hang", "--comm-timeout", "600",
    ]));
    wait_for_line(&rx, "step     1 ");
    interrupt(&child);
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert!(child.try_wait().unwrap().is_none(), "the step cannot end");
    interrupt(&child);
    assert_eq!(exit_within(&mut child, 30).signal(), Some(SIGINT));
    let err: Vec<String> = rx.iter().collect();
    let err = err.join("\n");
    assert!(
        err.contains("braid-gpt2: a second signal: stopping at once"),
        "{err}"
    );
}

/// A run started with SIGINT ignored (`cmd &` in a script) keeps it
/// ignored; SIGTERM, or SIGHUP (its terminal closed), still stops it at a
/// step, and it ends by that signal.
#[test]
fn an_ignored_sigint_stays_ignored_and_sigterm_or_sighup_stop_the_run() {
    for (signal, number) in [("-TERM", SIGTERM), ("-HUP", SIGHUP)] {
        let tmp = dir_with_train_bin();
        let d = tmp.path();
        let mut cmd = Command::new("sh");
        #[rustfmt::skip]
        cmd.args(["-c", "trap '' INT; exec \"$0\" \"$@\"", BIN,
            "train", "--model", "tiny", "--data", "train.bin", "--ranks", "1",
            "--batch-size", "2", "--seq-len", "16", "--lr-schedule", "constant",
            "--steps", "1000000", "--checkpoint-dir", "ckpt", "--no-trace",
        ]);
        let (mut child, rx) = spawn_command_lines(d, cmd);
        wait_for_line(&rx, "step     2 ");
        interrupt(&child);
        // Later steps still come.
        wait_for_line(&rx, "step    40 ");
        assert!(child.try_wait().unwrap().is_none());
        send(&child, signal);
        let status = exit_within(&mut child, 60);
        let err: Vec<String> = rx.iter().collect();
        let err = err.join("\n");
        assert_eq!(status.signal(), Some(number), "{signal}: {err}");
        assert!(err.contains("stopped by a signal after step "), "{err}");
        let step = braid_gpt2::checkpoint::load_checkpoint(d.join("ckpt"))
            .unwrap()
            .step;
        assert!(step >= 40, "{err}");
    }
}

/// A signal in the last step: the step finishes, the run is complete and
/// says so, and the process still ends by the signal (a loop of runs in a
/// script stops).
#[test]
fn a_signal_in_the_last_step_says_the_run_is_complete() {
    let tmp = dir_with_train_bin();
    let d = tmp.path();
    // The small model's steps last long enough for the signal to land in
    // the second one, or while its outputs are written.
    #[rustfmt::skip]
    let (mut child, rx) = spawn_lines(d, &[
        "train", "--model", "small", "--data", "train.bin", "--ranks", "1",
        "--batch-size", "4", "--seq-len", "64", "--steps", "2",
        "--checkpoint-dir", "ckpt", "--trace", "t.json",
    ]);
    wait_for_line(&rx, "step     1 ");
    interrupt(&child);
    let status = exit_within(&mut child, 60);
    let err: Vec<String> = rx.iter().collect();
    let err = err.join("\n");
    assert_eq!(status.signal(), Some(SIGINT), "{err}");
    assert!(
        err.contains(
            "interrupted by a signal in the last step, which finished: the run is \
             complete (its checkpoint is in ckpt)"
        ),
        "{err}"
    );
    let ckpt = braid_gpt2::checkpoint::load_checkpoint(d.join("ckpt")).unwrap();
    assert_eq!(ckpt.step, 2);
    assert!(d.join("t.json").is_file());
}

/// `tokenize` writes the tokens `train --data TEXT` trains on: training on
/// the token file gives the text's losses. Bad inputs are refused by name.
#[test]
fn tokenize_writes_what_training_on_the_text_reads() {
    use braid_gpt2::data::{builtin_text, read_token_file, Split};
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let corpus: String = builtin_text(Split::Train).chars().take(20_000).collect();
    let corpus = format!("{corpus}<|endoftext|>Ünïcödé ✓ 東京\n");
    std::fs::write(d.join("t.txt"), &corpus).unwrap();
    let out = run(d, &["tokenize", "t.txt", "t.bin"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let ids = Tokenizer::gpt2().unwrap().encode_with_eot(&corpus);
    let written = read_token_file(d.join("t.bin")).unwrap();
    assert_eq!(written.iter().map(|&t| t as u32).collect::<Vec<_>>(), ids);
    assert!(written.contains(&50256), "the separator is the EOT token");
    assert!(text(&out.stderr).contains(&format!("are {} tokens: t.bin", ids.len())));
    #[rustfmt::skip]
    let train = |data: &str| ok(d, &[
        "train", "--data", data, "--steps", "2", "--ranks", "1", "--batch-size", "1",
        "--seq-len", "16", "--no-trace",
    ]);
    let loss_line = |out: String| out.lines().next().unwrap().to_owned();
    assert_eq!(loss_line(train("t.txt")), loss_line(train("t.bin")));

    std::fs::write(d.join("bad.txt"), b"ok \xff\xfe").unwrap();
    for (args, why) in [
        (
            ["tokenize", "t.bin", "u.bin"],
            "t.bin is already a token file",
        ),
        (
            ["tokenize", "t.txt", "./t.txt"],
            "is both the text and the output",
        ),
        (
            ["tokenize", "bad.txt", "u.bin"],
            "bad.txt: not valid UTF-8 text (first bad byte at offset 3)",
        ),
        (
            ["tokenize", "t.txt", "no/u.bin"],
            "the directory no does not exist",
        ),
        (["tokenize", "none.txt", "u.bin"], "reading none.txt"),
        (
            ["tokenize", "t.txt", "-"],
            "the output `-` would be a file named `-`",
        ),
    ] {
        fails(d, &args, &[why]);
    }
    assert!(!d.join("u.bin").exists() && !d.join("-").exists());
}

/// `train` of the tiny model on `train.bin` in `dir`, two ranks of batch 2
/// × 16 tokens, with `extra` arguments and standard error piped.
fn train_two_tiny_ranks(dir: &Path, extra: &[&str]) -> Command {
    let mut cmd = Command::new(BIN);
    #[rustfmt::skip]
    cmd.args([
        "train", "--model", "tiny", "--data", "train.bin", "--ranks", "2",
        "--batch-size", "2", "--seq-len", "16",
    ])
    .args(extra)
    .current_dir(dir)
    .stderr(std::process::Stdio::piped());
    cmd
}

/// A log whose reader has gone (`train … 2>&1 | head -3`, a closed
/// terminal): the run goes on and saves its checkpoint and weights.
#[test]
fn a_log_without_a_reader_stops_nothing() {
    use std::io::BufRead;
    let tmp = dir_with_train_bin();
    let d = tmp.path();
    #[rustfmt::skip]
    let mut child = train_two_tiny_ranks(d, &[
        "--steps", "30", "--checkpoint-dir", "ckpt", "--save-weights", "w.safetensors",
        "--no-trace",
    ])
    .stdout(std::process::Stdio::null())
    .spawn()
    .unwrap();
    let mut first = String::new();
    std::io::BufReader::new(child.stderr.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    assert!(first.starts_with("training tiny"), "{first}");
    let status = exit_within(&mut child, 120);
    assert!(status.success(), "{status:?}");
    let ckpt = braid_gpt2::checkpoint::load_checkpoint(d.join("ckpt")).unwrap();
    assert_eq!(ckpt.step, 30);
    assert!(d.join("w.safetensors").is_file());
}

/// A trace on standard output whose reader has gone (`--trace /dev/stdout
/// | head -c 100`): the run still writes its weights, then fails naming
/// the trace.
#[test]
fn a_trace_that_cannot_be_written_loses_no_weights() {
    use std::io::Read;
    let tmp = dir_with_train_bin();
    let d = tmp.path();
    // Three steps of two ranks: a trace larger than the pipe holds.
    #[rustfmt::skip]
    let mut child = train_two_tiny_ranks(d, &[
        "--steps", "3", "--trace", "/dev/stdout", "--save-weights", "w.safetensors",
    ])
    .stdout(std::process::Stdio::piped())
    .spawn()
    .unwrap();
    let mut head = [0u8; 100];
    child.stdout.take().unwrap().read_exact(&mut head).unwrap();
    let out = child.wait_with_output().unwrap();
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("--trace /dev/stdout: the run finished, but its trace was not written"),
        "{err}"
    );
    assert!(err.contains("loss "), "the summary is on stderr: {err}");
    let (cfg, params) = braid_gpt2::weights::load_hf_model(d.join("w.safetensors")).unwrap();
    assert_eq!(params.len(), cfg.num_parameters());
}

/// `--metrics`: a JSON line per step with the figures the step line
/// shows; a resumed run drops the lines after its checkpoint and appends;
/// a log that cannot be written stops nothing, and the run then fails
/// naming it.
#[test]
fn metrics_lines_follow_the_steps_and_a_resume() {
    let tmp = dir_with_train_bin();
    let d = tmp.path();
    let metrics = |d: &Path| -> Vec<serde_json::Value> {
        let text = std::fs::read_to_string(d.join("m.jsonl")).unwrap();
        text.lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    };
    let args = [
        "--no-trace",
        "--metrics",
        "m.jsonl",
        "--checkpoint-dir",
        "ck",
    ];
    #[rustfmt::skip]
    let out = train_two_tiny_ranks(d, &[&args[..], &["--steps", "4", "--val-every", "2", "--val-data", "train.bin", "--save-weights", "w.safetensors"]].concat()).output().unwrap();
    let err = text(&out.stderr);
    assert!(out.status.success(), "{err}");
    let lines = metrics(d);
    let steps: Vec<u64> = lines.iter().map(|l| l["step"].as_u64().unwrap()).collect();
    // Step 0: the validation of the parameters the run started from.
    assert_eq!(steps, [0, 1, 2, 3, 4]);
    let at_start = format!(
        "step     0  val loss {:.4}",
        lines[0]["val_loss"].as_f64().unwrap()
    );
    assert!(err.contains(&at_start), "{at_start} in {err}");
    let summary = text(&out.stdout);
    let first_val = summary.lines().find(|l| l.starts_with("validation loss  "));
    assert!(
        first_val.is_some_and(|l| l.contains(" (step 0) -> ")),
        "{summary}"
    );
    let lines = &lines[1..];
    // The step lines' figures, to the digits they show.
    for l in lines {
        let shown = format!(
            "step {:>5}  loss {:.4}  norm {:.3}",
            l["step"].as_u64().unwrap(),
            l["loss"].as_f64().unwrap(),
            l["grad_norm"].as_f64().unwrap()
        );
        assert!(err.contains(&shown), "{shown} in {err}");
        assert_eq!(l["tokens"], 2 * 2 * 16);
    }
    let validated: Vec<bool> = lines.iter().map(|l| l.get("val_loss").is_some()).collect();
    assert_eq!(validated, [false, true, false, true]);
    // `eval` scores the last validation's windows as it says.
    let say = "(`eval --windows 80 --seq-len 16` scores the same)";
    assert!(err.contains(say), "{err}");
    #[rustfmt::skip]
    let eval = ok(d, &[
        "eval", "--weights", "w.safetensors", "--tokens", "train.bin", "--windows", "80",
        "--seq-len", "16",
    ]);
    let (val, scored) = (lines[3]["val_loss"].as_f64().unwrap(), eval_loss(&eval));
    assert!(
        (val - scored).abs() <= 1e-5 * scored,
        "validation {val}, eval {scored}"
    );
    // Resumed from step 4 with a step line of a run that went further (a
    // crash after the checkpoint): that line goes, the run's own follow.
    let mut log = std::fs::read_to_string(d.join("m.jsonl")).unwrap();
    log.push_str("{\"step\":5,\"loss\":1.0}\n");
    std::fs::write(d.join("m.jsonl"), log).unwrap();
    let out = train_two_tiny_ranks(d, &[&args[..], &["--steps", "6", "--resume"]].concat())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let lines = metrics(d);
    let steps: Vec<u64> = lines.iter().map(|l| l["step"].as_u64().unwrap()).collect();
    assert_eq!(steps, [0, 1, 2, 3, 4, 5, 6]);
    assert_ne!(lines[5]["loss"], 1.0);
    // Through standard output: the lines, then the summary, in order; a
    // resumed run does not read a pipe back (it would wait for ever).
    let out = train_two_tiny_ranks(
        d,
        &["--steps", "2", "--no-trace", "--metrics", "/dev/stdout"],
    )
    .stdout(std::process::Stdio::piped())
    .output()
    .unwrap();
    let printed = text(&out.stdout);
    let mut lines = printed.lines();
    for step in 1..=2 {
        let l: serde_json::Value = serde_json::from_str(lines.next().unwrap()).unwrap();
        assert_eq!(l["step"], step, "{printed}");
    }
    assert!(lines.next().unwrap().starts_with("loss "), "{printed}");
    #[rustfmt::skip]
    let mut child = train_two_tiny_ranks(d, &[
        "--steps", "7", "--resume", "--checkpoint-dir", "ck", "--no-trace",
        "--metrics", "/dev/stdout",
    ])
    .stdout(std::process::Stdio::piped())
    .spawn()
    .unwrap();
    assert!(exit_within(&mut child, 60).success());
    // A full disk: trained, then failed naming the log.
    if Path::new("/dev/full").exists() {
        let out =
            train_two_tiny_ranks(d, &["--steps", "2", "--no-trace", "--metrics", "/dev/full"])
                .output()
                .unwrap();
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert!(err.contains("step     2"), "{err}");
        assert!(
            err.contains("--metrics /dev/full: the run went on without its log"),
            "{err}"
        );
    }
}

/// RUST_BACKTRACE=1, which many set for good, leaves an ordinary error
/// its message and causes; RUST_LIB_BACKTRACE=1 still asks for the
/// backtrace.
#[test]
fn errors_show_a_backtrace_only_when_asked() {
    let tmp = tempfile::tempdir().unwrap();
    let stderr = |lib: Option<&str>| {
        let mut c = Command::new(BIN);
        c.args(["train", "--data", "missing.bin"])
            .current_dir(tmp.path())
            .env("RUST_BACKTRACE", "1")
            .env_remove("RUST_LIB_BACKTRACE");
        if let Some(v) = lib {
            c.env("RUST_LIB_BACKTRACE", v);
        }
        let out = c.output().unwrap();
        assert!(!out.status.success());
        text(&out.stderr)
    };
    let plain = stderr(None);
    assert!(
        plain.contains("--data missing.bin") && plain.contains("No such file"),
        "{plain}"
    );
    assert!(!plain.contains("backtrace"), "{plain}");
    let asked = stderr(Some("1"));
    assert!(asked.contains("Stack backtrace"), "{asked}");
}

#[test]
fn train_eval_sample_and_bad_inputs() {
    let tmp = dir_with_train_bin();
    let d = tmp.path();
    write_token_file(d.join("val.bin"), &tokens(700)).unwrap();

    // A short training run: exits 0, prints the losses and the summary,
    // writes the trace, the weights and the checkpoint.
    let out = ok(
        d,
        &[
            "train",
            "--model",
            "tiny",
            "--data",
            "train.bin",
            "--steps",
            "3",
            "--batch-size",
            "2",
            "--seq-len",
            "16",
            "--ranks",
            "2",
            "--bucket-cap-mb",
            "0.1",
            "--first-bucket-mb",
            "0.05",
            "--trace",
            "t.json",
            "--save-weights",
            "w.safetensors",
            "--checkpoint-dir",
            "ckpt",
            // Braid's kernels on the CPU: cuDNN's where it has an engine.
            "--attention",
            "auto",
        ],
    );
    for needle in ["tokens/s", "hidden", "t.json"] {
        assert!(out.contains(needle), "no {needle:?} in:\n{out}");
    }
    // The first and the last loss, once (the summary's first line).
    let losses: Vec<&str> = out.lines().filter(|l| l.contains("loss")).collect();
    assert!(
        losses.len() == 1 && losses[0].contains("(step 1) ->") && losses[0].contains("(step 3)"),
        "{out}"
    );
    let trace: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(d.join("t.json")).unwrap()).unwrap();
    let names: Vec<&str> = trace["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| e["name"].as_str())
        .collect();
    assert!(names.iter().any(|n| n.starts_with("all_reduce bucket")));
    assert!(d.join("ckpt/checkpoint.safetensors").is_file());

    // Eval prints a parseable loss on its own line.
    let out = ok(
        d,
        &[
            "eval",
            "--weights",
            "w.safetensors",
            "--tokens",
            "val.bin",
            "--seq-len",
            "16",
            "--batch-size",
            "3",
        ],
    );
    let loss = eval_loss(&out);
    assert!(loss.is_finite() && loss > 0.0 && loss < 7.0, "loss {loss}");

    // Sampling from the checkpoint and from the weights, deterministic in the seed.
    assert!(Tokenizer::gpt2()
        .unwrap()
        .encode("a")
        .iter()
        .all(|&t| t < 512));
    let args = ["--prompt", "a", "--tokens", "5", "--seed", "3"];
    let from_ckpt = ok(
        d,
        &[&["sample", "--checkpoint", "ckpt"][..], &args].concat(),
    );
    let from_weights = ok(
        d,
        &[&["sample", "--weights", "w.safetensors"][..], &args].concat(),
    );
    assert!(from_ckpt.starts_with('a') && from_ckpt.len() > 1);
    assert_eq!(from_ckpt, from_weights);
    // Top-k 1 is the greedy choice at any temperature, and so is a tiny
    // nucleus; top-k over the whole vocabulary and p 1 change nothing.
    let sample = |extra: &[&str]| {
        ok(
            d,
            &[&["sample", "--checkpoint", "ckpt"][..], &args, extra].concat(),
        )
    };
    let greedy = sample(&["--temperature", "0"]);
    assert_ne!(
        greedy, from_ckpt,
        "the draws must differ from the greedy choice"
    );
    assert_eq!(sample(&["--top-k", "1"]), greedy);
    assert_eq!(sample(&["--top-p", "0.000001"]), greedy);
    assert_eq!(sample(&["--top-k", "512", "--top-p", "1"]), from_ckpt);

    // Bad inputs: each fails, names the problem, and touches nothing.
    let before = snapshot(d);
    let train_tiny = |extra: &[&str]| -> Vec<String> {
        let mut v: Vec<String> = [
            "train",
            "--model",
            "tiny",
            "--steps",
            "2",
            "--batch-size",
            "2",
            "--seq-len",
            "16",
            "--trace",
            "t.json",
            "--save-weights",
            "w.safetensors",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        v.extend(extra.iter().map(|s| s.to_string()));
        v
    };
    let check_env = |args: Vec<String>, env: &[(&str, &str)], needles: &[&str]| {
        let a: Vec<&str> = args.iter().map(String::as_str).collect();
        fails_env(d, &a, env, needles)
    };
    let check = |args: Vec<String>, needles: &[&str]| check_env(args, &[], needles);

    // Out-of-vocabulary ids: the built-in corpus is GPT-2 BPE (ids up to 50256).
    check(
        train_tiny(&["--data", "builtin"]),
        &["vocabulary", "512", "builtin:train"],
    );
    let mut wide = tokens(600);
    wide[123] = 600;
    write_token_file(d.join("wide.bin"), &wide).unwrap();
    fails(
        d,
        &[
            "eval",
            "--weights",
            "w.safetensors",
            "--tokens",
            "wide.bin",
            "--seq-len",
            "16",
        ],
        &["600", "position 123"],
    );
    // A truncated token file.
    let mut bytes = std::fs::read(d.join("val.bin")).unwrap();
    bytes.truncate(bytes.len() - 11);
    std::fs::write(d.join("cut.bin"), &bytes).unwrap();
    check(
        train_tiny(&["--data", "cut.bin"]),
        &["truncated", "cut.bin"],
    );
    fails(
        d,
        &[
            "eval",
            "--weights",
            "w.safetensors",
            "--tokens",
            "cut.bin",
            "--seq-len",
            "16",
        ],
        &["truncated"],
    );
    // A file that is not there: named, and the OS's reason said once (the
    // error's message holds it, so it is not also its source).
    let err = check(
        train_tiny(&["--data", "absent.bin"]),
        &["reading absent.bin"],
    );
    assert_eq!(err.matches("(os error 2)").count(), 1, "{err}");
    // Outputs that cannot be written: refused before training, not after
    // it (a trace that is a directory, weights in a "directory" that is a
    // file).
    std::fs::create_dir_all(d.join("a_dir")).unwrap();
    for (flag, path, why) in [
        ("--trace", "a_dir", "is a directory"),
        ("--save-weights", "train.bin/", "not a directory"),
    ] {
        let err = check(
            train_tiny(&["--data", "train.bin", flag, path]),
            &[flag, path, why],
        );
        assert!(!err.contains("loss"), "refused only after training:\n{err}");
    }
    check(
        train_tiny(&["--data", "train.bin", "--checkpoint-dir", "train.bin"]),
        &["--checkpoint-dir train.bin", "not a directory"],
    );
    // Options are checked before the start line announces the run.
    let err = check(
        train_tiny(&["--data", "train.bin", "--batch-size", "0"]),
        &["batch size"],
    );
    assert!(!err.contains("training tiny"), "announced first:\n{err}");
    // A sampling temperature that is neither 0 nor positive.
    for t in ["nan", "-1"] {
        let flag = format!("--temperature={t}");
        fails(
            d,
            &[
                "sample",
                "--weights",
                "w.safetensors",
                "--prompt",
                "a",
                &flag,
            ],
            &["temperature", "0 (greedy)"],
        );
    }
    for (flag, why) in [
        ("--top-k=0", "invalid top-k: 0 keeps no token"),
        ("--top-p=0", "invalid top-p: 0 is not in (0, 1]"),
        ("--top-p=1.5", "invalid top-p: 1.5 is not in (0, 1]"),
    ] {
        #[rustfmt::skip]
        fails(d, &["sample", "--weights", "w.safetensors", "--prompt", "a", flag], &[why]);
    }
    // Optimizer settings PyTorch's AdamW refuses too.
    for (flag, value, what) in [
        ("--weight-decay", "nan", "weight decay"),
        ("--weight-decay=-0.5", "", "weight decay"),
        ("--grad-clip=-1", "", "gradient clipping norm"),
    ] {
        let extra: Vec<&str> = [flag, value]
            .into_iter()
            .filter(|s| !s.is_empty())
            .collect();
        check(
            train_tiny(&[&["--data", "train.bin"][..], &extra].concat()),
            &[what],
        );
    }
    // One of several torchrun processes on the CPU, where ranks are threads.
    check_env(
        train_tiny(&["--data", "train.bin", "--device", "cpu"]),
        &[("RANK", "1"), ("WORLD_SIZE", "2")],
        &["WORLD_SIZE=2", "--ranks 2"],
    );
    // A kernel switch with a value it does not take.
    check_env(
        train_tiny(&["--data", "train.bin"]),
        &[("BRAID_CUBLASLT_GELU", "on")],
        &["BRAID_CUBLASLT_GELU", "0, 1, 2"],
    );
    // A pinning switch that says neither yes nor no.
    check_env(
        train_tiny(&["--data", "train.bin"]),
        &[("BRAID_PIN_THREADS", "maybe")],
        &["BRAID_PIN_THREADS=`maybe`"],
    );
    // Missing and mismatched tensors.
    let st = std::fs::read(d.join("w.safetensors")).unwrap();
    let (missing, misshaped) = broken_weights(&st);
    std::fs::write(d.join("missing.safetensors"), missing).unwrap();
    std::fs::write(d.join("misshaped.safetensors"), misshaped).unwrap();
    fails(
        d,
        &[
            "eval",
            "--weights",
            "missing.safetensors",
            "--tokens",
            "val.bin",
            "--seq-len",
            "16",
        ],
        &["missing tensor", "ln_f.bias"],
    );
    fails(
        d,
        &[
            "eval",
            "--weights",
            "misshaped.safetensors",
            "--tokens",
            "val.bin",
            "--seq-len",
            "16",
        ],
        &["h.1.mlp.c_fc.bias", "shape"],
    );
    check(
        train_tiny(&["--data", "train.bin", "--init-from", "missing.safetensors"]),
        &["missing tensor"],
    );
    // A configuration that does not match the weights.
    fails(
        d,
        &[
            "train",
            "--model",
            "small",
            "--init-from",
            "w.safetensors",
            "--data",
            "train.bin",
            "--steps",
            "2",
            "--batch-size",
            "2",
            "--seq-len",
            "16",
            "--trace",
            "t.json",
        ],
        &["--model small", "w.safetensors"],
    );
    // A sequence longer than the model's context.
    check(
        train_tiny(&["--data", "train.bin", "--seq-len", "65"]),
        &["sequence length", "65"],
    );
    // An existing checkpoint is not overwritten without --resume...
    check(
        train_tiny(&["--data", "train.bin", "--checkpoint-dir", "ckpt"]),
        &["already holds a checkpoint", "--resume"],
    );
    // ...and an unreadable one is reported, not replaced.
    std::fs::create_dir(d.join("bad")).unwrap();
    std::fs::write(d.join("bad/checkpoint.safetensors"), b"not a checkpoint").unwrap();
    let before_bad = snapshot(d);
    check(
        train_tiny(&["--data", "train.bin", "--checkpoint-dir", "bad", "--resume"]),
        &["bad", "checkpoint"],
    );
    fails(
        d,
        &["sample", "--checkpoint", "bad", "--prompt", "a"],
        &["bad"],
    );
    fails(
        d,
        &["sample", "--checkpoint", "nowhere", "--prompt", "a"],
        &["nowhere", "no such directory"],
    );
    // No device.
    check(
        train_tiny(&["--data", "train.bin", "--device", "cuda"]),
        &["cuda"],
    );
    // cuDNN's attention asked for where no fused bf16 attention runs, and
    // attention kernels that do not exist, by flag or by variable.
    check(
        train_tiny(&["--data", "train.bin", "--attention", "cudnn"]),
        &[
            "--attention cudnn",
            "--device cuda",
            "--dtype bf16",
            "the CPU",
        ],
    );
    check(
        train_tiny(&["--data", "train.bin", "--attention", "fast"]),
        &["--attention", "fast", "braid, cudnn or auto"],
    );
    check_env(
        train_tiny(&["--data", "train.bin"]),
        &[("BRAID_ATTENTION", "cuDNN")],
        &["BRAID_ATTENTION", "cuDNN", "braid, cudnn or auto"],
    );
    assert!(snapshot(d) == before_bad, "a failed command changed files");
    let after: Vec<_> = snapshot(d)
        .into_iter()
        .filter(|(p, _)| before.iter().any(|(q, _)| q == p))
        .collect();
    assert!(after == before, "a failed command changed existing files");
}

/// Two damaged copies of a safetensors file: one without
/// `transformer.ln_f.bias`, one whose `transformer.h.1.mlp.c_fc.bias` has the
/// wrong shape.
fn broken_weights(bytes: &[u8]) -> (Vec<u8>, Vec<u8>) {
    use safetensors::tensor::{Dtype, TensorView};
    let st = safetensors::SafeTensors::deserialize(bytes).unwrap();
    let (_, meta) = safetensors::SafeTensors::read_metadata(bytes).unwrap();
    let meta = meta.metadata().clone();
    let tensors: Vec<(String, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.shape().to_vec(), v.data().to_vec()))
        .collect();
    let write = |skip: &str, reshape: &str| {
        let views: Vec<(String, TensorView<'_>)> = tensors
            .iter()
            .filter(|(n, _, _)| n != skip)
            .map(|(n, shape, data)| {
                let (shape, data) = if n == reshape {
                    (vec![shape[0] - 1], &data[..data.len() - 4])
                } else {
                    (shape.clone(), &data[..])
                };
                (n.clone(), TensorView::new(Dtype::F32, shape, data).unwrap())
            })
            .collect();
        safetensors::serialize(views, meta.clone()).unwrap()
    };
    (
        write("transformer.ln_f.bias", ""),
        write("", "transformer.h.1.mlp.c_fc.bias"),
    )
}

/// `--dtype bf16` on two CPU ranks: training, its checkpoint (`f32` master
/// weights), evaluation and sampling in bf16; a setting that makes no sense
/// with it is a clear error.
#[test]
fn bf16_train_eval_sample() {
    let tmp = dir_with_train_bin();
    let d = tmp.path();
    write_token_file(d.join("val.bin"), &tokens(700)).unwrap();
    #[rustfmt::skip]
    let out = ok(d, &[
        "train", "--model", "tiny", "--data", "train.bin", "--steps", "3", "--batch-size", "2",
        "--seq-len", "16", "--ranks", "2", "--dtype", "bf16", "--no-trace",
        "--save-weights", "w.safetensors", "--checkpoint-dir", "ckpt",
    ]);
    assert!(out.contains("(step 3)"), "{out}");
    // The checkpoint keeps the f32 master weights, not their bf16 copy.
    let ckpt = braid_gpt2::checkpoint::load_checkpoint(d.join("ckpt")).unwrap();
    let off_grid = ckpt
        .params
        .iter()
        .filter(|x| x.to_bits() & 0xffff != 0)
        .count();
    assert!(
        off_grid > ckpt.params.len() / 2,
        "{off_grid} f32 master weights"
    );

    let eval = |dtype: &str| -> f64 {
        #[rustfmt::skip]
        let out = ok(d, &[
            "eval", "--weights", "w.safetensors", "--tokens", "val.bin", "--seq-len", "16",
            "--device", "cpu", "--dtype", dtype,
        ]);
        eval_loss(&out)
    };
    let (l16, l32) = (eval("bf16"), eval("fp32"));
    assert!(l16.is_finite() && l16 > 0.0, "bf16 loss {l16}");
    // Close to the f32 loss, but computed in bf16: not the same number.
    assert!(
        (l16 - l32).abs() < 0.05 && l16 != l32,
        "bf16 {l16}, fp32 {l32}"
    );

    #[rustfmt::skip]
    let sample = ok(d, &[
        "sample", "--checkpoint", "ckpt", "--prompt", "a", "--tokens", "5", "--device", "cpu",
        "--dtype", "bf16",
    ]);
    assert!(sample.starts_with('a') && sample.len() > 1, "{sample}");

    #[rustfmt::skip]
    fails(d, &[
        "train", "--model", "tiny", "--data", "train.bin", "--steps", "1", "--ranks", "2",
        "--dtype", "bf16", "--compression", "bf16", "--no-trace",
    ], &["compression", "bf16"]);
    fails(
        d,
        &["train", "--model", "tiny", "--dtype", "fp16", "--no-trace"],
        &["fp16", "bf16"],
    );
}

/// The example placement file in docs/ drives the main job: it trains, the
/// trace shows the model's scopes and the file's decisions, and the weights
/// are bit for bit those of the same run without the file. A bad file, given
/// by flag or by `BRAID_PLACEMENT`, stops the run naming its line.
#[test]
fn the_example_placement_file_drives_training_without_changing_the_weights() {
    let tmp = dir_with_train_bin();
    let d = tmp.path();
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/placement.example.toml");
    let example = example.to_str().unwrap();
    #[rustfmt::skip]
    let base = [
        "train", "--model", "tiny", "--data", "train.bin", "--steps", "4",
        "--batch-size", "2", "--seq-len", "16", "--ranks", "2",
    ];
    let with = |extra: &[&str]| -> Vec<String> {
        base.iter().chain(extra).map(|s| s.to_string()).collect()
    };
    // With SMs to spare too, which the CPU ignores.
    let args = with(&[
        "--placement",
        example,
        "--spare-sms",
        "8",
        "--trace",
        "p.json",
        "--save-weights",
        "p.safetensors",
    ]);
    let out = ok(d, &args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(!out.contains("left to other programs"), "{out}");
    let args = with(&["--trace", "n.json", "--save-weights", "n.safetensors"]);
    ok(d, &args.iter().map(String::as_str).collect::<Vec<_>>());
    // The tensors, bit for bit (the files' JSON headers may order their
    // keys differently).
    let weights = |f: &str| -> Vec<u32> {
        let (_, params) = braid_gpt2::weights::load_hf_model(d.join(f)).unwrap();
        params.iter().map(|x| x.to_bits()).collect()
    };
    assert!(
        weights("p.safetensors") == weights("n.safetensors"),
        "a placement file changed the weights"
    );

    let trace: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(d.join("p.json")).unwrap()).unwrap();
    let tasks: Vec<&serde_json::Value> = trace["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["ph"] == "X")
        .collect();
    let scopes: std::collections::BTreeSet<&str> = tasks
        .iter()
        .filter_map(|e| e["args"]["scope"].as_str())
        .collect();
    for s in [
        "zero_grad",
        "forward/layer0",
        "forward/head",
        "backward/layer1",
        "backward/encoder",
        "optimizer",
    ] {
        assert!(scopes.contains(s), "no task in scope {s}: {scopes:?}");
    }
    let placed = |scope: &str, how: &str| {
        tasks
            .iter()
            .any(|e| e["args"]["scope"] == scope && e["args"]["placed"] == how)
    };
    assert!(
        placed("forward/head", "scope"),
        "forward/head not pinned by the file"
    );
    assert!(
        placed("optimizer", "bundle"),
        "the optimizer is not bundled"
    );

    // A stream the runtime lacks, by flag and through the environment.
    std::fs::write(
        d.join("bad.toml"),
        "[[scope]]\npattern = \"optimizer\"\n\nstream = 7\n",
    )
    .unwrap();
    let args = with(&["--placement", "bad.toml", "--no-trace"]);
    fails(
        d,
        &args.iter().map(String::as_str).collect::<Vec<_>>(),
        &["bad.toml", "line 4", "stream 7"],
    );
    let out = Command::new(BIN)
        .args(with(&["--no-trace"]))
        .env(braid::PLACEMENT_ENV, "bad.toml")
        .current_dir(d)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(err.contains("bad.toml") && err.contains("line 4"), "{err}");
    // `eval`, which names no placement file, reads it through the engine:
    // the error says the variable named it.
    let out = run_env(
        d,
        &[
            "eval",
            "--weights",
            "n.safetensors",
            "--tokens",
            "train.bin",
            "--windows",
            "1",
        ],
        &[(braid::PLACEMENT_ENV, "bad.toml")],
    );
    let err = text(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("bad.toml (from BRAID_PLACEMENT)") && err.contains("line 4"),
        "{err}"
    );
    // `--placement` wins over the variable; and a file naming the trainer's
    // second compute stream and its comm stream, given by the variable, is
    // checked against the trainer's runtimes only (a probe runtime of one
    // stream once refused it).
    std::fs::write(
        d.join("two.toml"),
        "[[scope]]\npattern = \"optimizer\"\nstream = 1\n\n[[scope]]\npattern = \"reduce\"\nstream = \"comm\"\n",
    )
    .unwrap();
    let args = with(&["--placement", "two.toml", "--no-trace"]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = run_env(d, &args, &[(braid::PLACEMENT_ENV, "bad.toml")]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    // The run says which file it uses.
    let said = "placement file two.toml: 2 rule(s)\n";
    assert!(text(&out.stderr).contains(said), "{}", text(&out.stderr));
    let args = with(&["--no-trace"]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = run_env(d, &args, &[(braid::PLACEMENT_ENV, "two.toml")]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains(said), "{}", text(&out.stderr));
    // And the class a file sets, without --class; with it, --class wins.
    std::fs::write(d.join("be.toml"), "[runtime]\nclass = \"best-effort\"\n").unwrap();
    let args = with(&["--placement", "be.toml", "--no-trace"]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = run_env(d, &args, &[]);
    let err = text(&out.stderr);
    assert!(out.status.success(), "{err}");
    let said = "placement file be.toml: 0 rule(s), class best-effort\n";
    assert!(err.contains(said), "{err}");
    let args = with(&["--placement", "be.toml", "--class", "normal", "--no-trace"]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = run_env(d, &args, &[]);
    let err = text(&out.stderr);
    assert!(out.status.success(), "{err}");
    let said =
        "placement file be.toml: 0 rule(s), class normal (--class, not the file's best-effort)";
    assert!(err.contains(said), "{err}");
    // A rule whose pattern matched no scope did nothing: said after the
    // run; every rule of the example applies to some scope of the trainer.
    std::fs::write(
        d.join("miss.toml"),
        "[[scope]]\npattern = \"forward/lyaer*\"\nstream = 1\n",
    )
    .unwrap();
    let said = "note: the placement rule `forward/lyaer*` (miss.toml line 2) matched no scope";
    for (file, note) in [("miss.toml", true), (example, false)] {
        let args = with(&["--placement", file, "--no-trace"]);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = run_env(d, &args, &[]);
        let err = text(&out.stderr);
        assert!(out.status.success(), "{err}");
        assert_eq!(err.contains("matched no scope"), note, "{file}: {err}");
        assert_eq!(err.contains(said), note, "{file}: {err}");
    }
    // A key the format does not know.
    std::fs::write(
        d.join("typo.toml"),
        "[[scope]]\npattern = \"forward/*\"\nstraem = 0\n",
    )
    .unwrap();
    let args = with(&["--placement", "typo.toml", "--no-trace"]);
    fails(
        d,
        &args.iter().map(String::as_str).collect::<Vec<_>>(),
        &["typo.toml", "line 3", "straem"],
    );
}

/// `--bucket-cap-mb auto` trains and prints the cap it chose, and is the
/// default; a value that is neither a size nor `auto` is refused, naming
/// both; with a compression an explicit auto is refused (it models plain
/// buckets), and the default is then the fixed 25 MiB.
#[test]
fn bucket_cap_auto_reports_its_choice() {
    let tmp = dir_with_train_bin();
    let d = tmp.path();
    #[rustfmt::skip]
    let args = [
        "train", "--model", "tiny", "--data", "train.bin", "--ranks", "2", "--steps", "2",
        "--batch-size", "2", "--seq-len", "16", "--no-trace", "--bucket-cap-mb",
    ];
    let with = |cap: &'static str| -> Vec<&str> { args.iter().copied().chain([cap]).collect() };
    let chose = |out: &str| {
        let line = out
            .lines()
            .find(|l| l.starts_with("bucket cap"))
            .unwrap_or_else(|| panic!("no bucket cap line in:\n{out}"));
        assert!(
            line.contains("auto") && line.contains("predicted exposed"),
            "{line}"
        );
    };
    chose(&ok(d, &with("auto")));
    // The default, without the flag.
    chose(&ok(d, &args[..args.len() - 1]));
    // A numeric cap prints no such line.
    assert!(!ok(d, &with("1")).contains("bucket cap"));
    fails(d, &with("fast"), &["fast", "MiB", "auto"]);
    let bf16: Vec<&str> = with("auto")
        .into_iter()
        .chain(["--compression", "bf16"])
        .collect();
    fails(d, &bf16, &["auto", "compression"]);
    let bf16_default: Vec<&str> = args[..args.len() - 1]
        .iter()
        .copied()
        .chain(["--compression", "bf16"])
        .collect();
    assert!(!ok(d, &bf16_default).contains("bucket cap"));
}

/// `eval` on Hugging Face weights (a `model.safetensors` with its
/// `config.json`, as a checkpoint comes) scores tokens as `transformers`
/// does: the PyTorch fixture's initial weights and its fp32 logits
/// (`scripts/make_reference.py`), which give `transformers`' loss for any
/// targets. In fp32 the printed loss is that loss; in bf16 it is close to it
/// and not the same number.
#[test]
fn eval_on_hf_weights_matches_transformers() {
    use safetensors::SafeTensors;
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/gpt2_tiny_reference.safetensors");
    let bytes = std::fs::read(&fixture).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    // The initial weights only (the fixture also keeps gradients, final
    // weights, logits and the batch), under their Hugging Face names.
    let weights: Vec<_> = st
        .tensors()
        .into_iter()
        .filter(|(name, _)| name.starts_with("transformer."))
        .collect();
    assert!(weights.len() > 20, "{} weight tensors", weights.len());
    safetensors::serialize_to_file(weights, None, &d.join("model.safetensors")).unwrap();
    std::fs::write(
        d.join("config.json"),
        r#"{"model_type": "gpt2", "n_head": 4}"#,
    )
    .unwrap();

    let i32s =
        |name: &str| -> Vec<i32> { bytemuck::pod_collect_to_vec(st.tensor(name).unwrap().data()) };
    let logits: Vec<f32> = bytemuck::pod_collect_to_vec(st.tensor("logits").unwrap().data());
    let tokens = i32s("tokens");
    let (b, t) = (2, 16);
    let v = logits.len() / (b * t);
    assert_eq!(tokens.len(), b * t);
    // The two rows one after the other and one more token: `eval`'s windows
    // (stride T) are then exactly the fixture's rows, each predicting the
    // token after each position.
    let mut file: Vec<u16> = tokens.iter().map(|&x| x as u16).collect();
    file.push(tokens[0] as u16);
    write_token_file(d.join("val.bin"), &file).unwrap();
    let mut expected = 0.0f64;
    for (p, row) in logits.chunks(v).enumerate() {
        let target = file[p + 1] as usize;
        let max = row.iter().fold(f64::MIN, |m, &x| m.max(x as f64));
        let lse = max
            + row
                .iter()
                .map(|&x| (x as f64 - max).exp())
                .sum::<f64>()
                .ln();
        expected += lse - row[target] as f64;
    }
    expected /= (b * t) as f64;

    let eval = |dtype: &str| -> f64 {
        #[rustfmt::skip]
        let out = ok(d, &[
            "eval", "--weights", "model.safetensors", "--tokens", "val.bin", "--seq-len", "16",
            "--batch-size", "2", "--device", "cpu", "--dtype", dtype,
        ]);
        eval_loss(&out)
    };
    let (l32, l16) = (eval("fp32"), eval("bf16"));
    assert!(
        (l32 - expected).abs() < 1e-5,
        "fp32 {l32}, transformers {expected}"
    );
    assert!(
        (l16 - expected).abs() < 5e-3 && l16 != l32,
        "bf16 {l16}, fp32 {l32}, transformers {expected}"
    );
}

/// The learning rate each step line of `train` prints.
fn step_rates(stderr: &str) -> Vec<f64> {
    stderr
        .lines()
        .filter(|l| l.starts_with("step "))
        .map(|l| {
            let at = l.find(" lr ").unwrap_or_else(|| panic!("no lr in {l:?}"));
            l[at + 4..]
                .split_whitespace()
                .next()
                .unwrap()
                .parse()
                .unwrap()
        })
        .collect()
}

/// `--lr-schedule`: by default a linear warm-up over a tenth of the steps,
/// then a cosine down to `--min-lr-frac` of `--lr` at the last step;
/// `constant` keeps `--lr`. Each step line prints its rate. A fraction
/// outside 0..=1 is refused by name.
#[test]
fn the_learning_rate_warms_up_then_decays() {
    let tmp = dir_with_train_bin();
    let d = tmp.path();
    let train = |extra: &[&str]| -> Vec<f64> {
        let base = [
            "train",
            "--model",
            "tiny",
            "--data",
            "train.bin",
            "--batch-size",
            "2",
            "--seq-len",
            "16",
            "--ranks",
            "1",
            "--lr",
            "1e-3",
            "--no-trace",
        ];
        let args = [&base[..], extra].concat();
        let out = run(d, &args);
        assert!(out.status.success(), "{args:?}:\n{}", text(&out.stderr));
        step_rates(&text(&out.stderr))
    };
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-3 * b;

    let r = train(&[
        "--steps",
        "10",
        "--warmup-steps",
        "4",
        "--min-lr-frac",
        "0.5",
    ]);
    assert_eq!(r.len(), 10, "{r:?}");
    assert!(close(r[0], 2.5e-4) && close(r[3], 1e-3), "{r:?}");
    assert!(r.windows(2).take(3).all(|w| w[1] > w[0]), "{r:?}");
    assert!(r.windows(2).skip(3).all(|w| w[1] < w[0]), "{r:?}");
    assert!(close(r[9], 5e-4), "{r:?}");

    // The default warm-up: a tenth of 20 steps.
    let r = train(&["--steps", "20"]);
    assert!(
        close(r[0], 5e-4) && close(r[1], 1e-3) && r[2] < r[1],
        "{r:?}"
    );
    assert!(close(r[19], 1e-4), "{r:?}");

    let r = train(&["--steps", "3", "--lr-schedule", "constant"]);
    assert!(r.len() == 3 && r.iter().all(|&x| close(x, 1e-3)), "{r:?}");

    // A run extended on resume keeps its warm-up (1 step, a tenth of 10),
    // not the default of its new --steps (4, which would drop the rate at
    // step 11 and warm up again): its steps are those of a run of 40 with
    // a warm-up of 1.
    train(&["--steps", "10", "--checkpoint-dir", "ck"]);
    let resumed = train(&["--steps", "40", "--checkpoint-dir", "ck", "--resume"]);
    let whole = train(&["--steps", "40", "--warmup-steps", "1"]);
    assert_eq!(resumed.len(), 30);
    assert!(
        resumed.iter().zip(&whole[10..]).all(|(&a, &b)| close(a, b)),
        "{resumed:?} vs {whole:?}"
    );

    fails(
        d,
        &[
            "train",
            "--model",
            "tiny",
            "--data",
            "train.bin",
            "--min-lr-frac",
            "1.5",
        ],
        &["--min-lr-frac", "1.5"],
    );
    // A fraction the schedule would ignore is refused; a warm-up longer
    // than the run is said.
    #[rustfmt::skip]
    let tiny = ["train", "--model", "tiny", "--data", "train.bin", "--batch-size", "2",
        "--seq-len", "16", "--ranks", "1", "--no-trace", "--steps", "2"];
    let with =
        |extra: &[&'static str]| -> Vec<&str> { tiny.iter().chain(extra).copied().collect() };
    fails(
        d,
        &with(&["--lr-schedule", "constant", "--min-lr-frac", "0.5"]),
        &["--min-lr-frac 0.5", "--lr-schedule constant"],
    );
    let out = run(d, &with(&["--warmup-steps", "5"]));
    let err = text(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("note: the warm-up of 5 steps is longer than the run (2 steps)"),
        "{err}"
    );
}

/// Runs `args` with the virtual memory limited to `kib` KiB (`ulimit -v`).
fn run_limited(dir: &Path, kib: u64, args: &[&str]) -> Output {
    Command::new("sh")
        .arg("-c")
        .arg(format!("ulimit -v {kib} && exec \"$0\" \"$@\""))
        .arg(BIN)
        .args(args)
        .current_dir(dir)
        .output()
        .expect("sh runs")
}

/// A process id no process has now (one that has just exited).
fn dead_pid() -> u32 {
    let mut child = Command::new("true").spawn().unwrap();
    let pid = child.id();
    child.wait().unwrap();
    pid
}

/// Outputs behind symbolic links are written where the links point (the
/// links stay links), and a checkpoint's temporaries left by a killed
/// writer go at the next save.
#[cfg(target_os = "linux")]
#[test]
fn outputs_follow_links_and_stale_temporaries_are_removed() {
    let tmp = dir_with_train_bin();
    let d = tmp.path();
    std::fs::create_dir(d.join("real")).unwrap();
    std::fs::write(d.join("real/t.json"), b"old trace").unwrap();
    std::os::unix::fs::symlink("real/t.json", d.join("t.json")).unwrap();
    // Dangling: the file it names is created.
    std::os::unix::fs::symlink("real/w.safetensors", d.join("w.safetensors")).unwrap();
    std::fs::create_dir(d.join("ckpt")).unwrap();
    let stale = d.join(format!(
        "ckpt/checkpoint.safetensors.braid-tmp-{}-0",
        dead_pid()
    ));
    let f = std::fs::File::create(&stale).unwrap();
    f.set_modified(std::time::SystemTime::now() - std::time::Duration::from_secs(3600))
        .unwrap();
    drop(f);
    #[rustfmt::skip]
    ok(d, &[
        "train", "--model", "tiny", "--data", "train.bin", "--steps", "1", "--ranks", "1",
        "--batch-size", "2", "--seq-len", "16", "--trace", "t.json",
        "--save-weights", "w.safetensors", "--checkpoint-dir", "ckpt",
    ]);
    for link in ["t.json", "w.safetensors"] {
        let meta = std::fs::symlink_metadata(d.join(link)).unwrap();
        assert!(meta.file_type().is_symlink(), "{link} was replaced");
    }
    let trace: serde_json::Value =
        serde_json::from_slice(&std::fs::read(d.join("real/t.json")).unwrap()).unwrap();
    assert!(trace["traceEvents"].is_array());
    braid_gpt2::weights::load_hf_model(d.join("real/w.safetensors")).unwrap();
    assert!(!stale.exists(), "the stale temporary is still there");
    assert_eq!(
        checkpoint_dir_names(&d.join("ckpt")),
        [".lock", "checkpoint.safetensors"]
    );
}

/// Output locations no one can write to (even root: under a regular file,
/// in /proc) stop the run before its first step, naming the flag and the
/// path.
#[cfg(target_os = "linux")]
/// Outputs that name one file twice, or name an input, are refused before
/// anything is written, and every file stays as it was: a trace over the
/// checkpoint, metrics over the trace or over the training text, weights
/// over the trace, a trace over the data.
#[test]
fn outputs_naming_one_file_or_an_input_are_refused() {
    let tmp = dir_with_train_bin();
    let d = tmp.path();
    std::fs::write(
        d.join("text.txt"),
        "some text to train on, again and again. ".repeat(20),
    )
    .unwrap();
    #[rustfmt::skip]
    let base = [
        "train", "--model", "tiny", "--ranks", "1", "--batch-size", "2", "--seq-len", "16",
    ];
    let with = |extra: &[&'static str]| -> Vec<&'static str> {
        base.iter().chain(extra).copied().collect()
    };
    ok(
        d,
        &with(&[
            "--data",
            "train.bin",
            "--steps",
            "2",
            "--checkpoint-dir",
            "ck",
            "--trace",
            "t.json",
        ]),
    );
    let before = snapshot(d);
    #[rustfmt::skip]
    let cases: [(&[&'static str], &str); 5] = [
        (
            &["--data", "train.bin", "--steps", "3", "--resume", "--checkpoint-dir", "ck",
              "--trace", "ck/checkpoint.safetensors"],
            "--trace ck/checkpoint.safetensors is also the checkpoint of --checkpoint-dir ck",
        ),
        (
            &["--data", "train.bin", "--steps", "2", "--trace", "x.json", "--metrics", "x.json"],
            "--metrics x.json is also --trace",
        ),
        (
            &["--data", "text.txt", "--steps", "2", "--trace", "y.json", "--metrics", "text.txt"],
            "--metrics text.txt is the file of --data",
        ),
        (
            &["--data", "train.bin", "--steps", "2", "--trace", "t.json",
              "--save-weights", "t.json"],
            "--save-weights t.json is also --trace",
        ),
        (
            &["--data", "train.bin", "--steps", "2", "--trace", "train.bin"],
            "--trace train.bin is the file of --data",
        ),
    ];
    for (extra, needle) in cases {
        fails(d, &with(extra), &[needle, "nothing was written"]);
        assert!(snapshot(d) == before, "{extra:?} changed a file");
    }
}

#[test]
fn unwritable_outputs_are_refused_before_the_first_step() {
    let tmp = dir_with_train_bin();
    let d = tmp.path();
    std::fs::write(d.join("file.txt"), b"a file").unwrap();
    #[rustfmt::skip]
    let base = [
        "train", "--model", "tiny", "--data", "train.bin", "--steps", "2", "--ranks", "1",
        "--batch-size", "2", "--seq-len", "16", "--no-trace",
    ];
    for (flag, path, why) in [
        ("--checkpoint-dir", "file.txt/ck", "Not a directory"),
        (
            "--trace",
            "/proc/braid-t.json",
            "cannot create a file in /proc",
        ),
        (
            "--save-weights",
            "/proc/braid-w.st",
            "cannot create a file in /proc",
        ),
        (
            "--save-weights",
            "file.txt/sub/w.st",
            "file.txt is a file, not a directory",
        ),
    ] {
        let args: Vec<&str> = base.iter().copied().chain([flag, path]).collect();
        let args: Vec<&str> = match flag {
            "--trace" => args.into_iter().filter(|a| *a != "--no-trace").collect(),
            _ => args,
        };
        let err = fails(d, &args, &[&format!("{flag} {path}"), why]);
        assert!(
            !err.contains("step "),
            "refused only after training:\n{err}"
        );
    }
    // A checkpoint directory the run makes: made before the first step.
    let args: Vec<&str> = base
        .iter()
        .copied()
        .chain(["--checkpoint-dir", "new/ck"])
        .collect();
    ok(d, &args);
    assert!(d.join("new/ck/checkpoint.safetensors").is_file());
    // Weights in the checkpoint directory the run makes are accepted; in a
    // directory below it, which nothing makes, refused before anything is
    // made.
    #[rustfmt::skip]
    let args: Vec<&str> = base.iter().copied().chain([
        "--checkpoint-dir", "new2", "--save-weights", "new2/w.safetensors",
    ]).collect();
    ok(d, &args);
    assert!(d.join("new2/w.safetensors").is_file());
    #[rustfmt::skip]
    let args: Vec<&str> = base.iter().copied().chain([
        "--checkpoint-dir", "new3", "--save-weights", "new3/sub/w.safetensors",
    ]).collect();
    fails(
        d,
        &args,
        &["--save-weights new3/sub/w.safetensors", "does not exist"],
    );
    assert!(!d.join("new3").exists());
}

/// A checkpoint directory another run is using (it holds the directory's
/// lock) is refused before the first step, naming that run's process,
/// whether this run starts fresh or resumes: two runs once saved into one
/// directory, the second silently overwriting the first. Once the lock is
/// released the run goes ahead.
#[test]
fn a_checkpoint_directory_in_use_is_refused() {
    let tmp = dir_with_train_bin();
    let d = tmp.path();
    let run = |steps: &str, resume: bool| -> Vec<String> {
        #[rustfmt::skip]
        let mut a: Vec<String> = [
            "train", "--model", "tiny", "--data", "train.bin", "--ranks", "1", "--batch-size",
            "2", "--seq-len", "16", "--no-trace", "--checkpoint-dir", "ck", "--steps", steps,
        ].map(String::from).to_vec();
        if resume {
            a.push("--resume".into());
        }
        a
    };
    fn strs(a: &[String]) -> Vec<&str> {
        a.iter().map(String::as_str).collect()
    }
    let this_process = format!("another run (process {})", std::process::id());
    let held = braid_gpt2::checkpoint::lock_checkpoint_dir(&d.join("ck")).unwrap();
    let err = fails(d, &strs(&run("2", false)), &[&this_process, "ck/.lock"]);
    assert!(
        !err.contains("step "),
        "refused only after training:
{err}"
    );
    assert!(!d.join("ck/checkpoint.safetensors").exists());
    drop(held);
    ok(d, &strs(&run("2", false)));
    let held = braid_gpt2::checkpoint::lock_checkpoint_dir(&d.join("ck")).unwrap();
    fails(d, &strs(&run("3", true)), &[&this_process]);
    drop(held);
    ok(d, &strs(&run("3", true)));
}

/// Numbers and settings out of range, refused up front with a message,
/// never a panic or an abort, and torchrun variables that make no sense on
/// the CPU.
#[test]
fn out_of_range_settings_are_refused_clearly() {
    let tmp = dir_with_train_bin();
    let d = tmp.path();
    #[rustfmt::skip]
    let base = [
        "train", "--model", "tiny", "--data", "train.bin", "--steps", "1", "--ranks", "1",
        "--batch-size", "2", "--seq-len", "16", "--no-trace",
    ];
    let with =
        |extra: &[&'static str]| -> Vec<&str> { base.iter().chain(extra).copied().collect() };
    let no_panic = |err: &str| {
        assert!(
            !err.contains("panicked") && !err.contains("memory allocation"),
            "{err}"
        );
    };
    for (extra, needles) in [
        (&["--checkpoint-every", "1"][..], &["--checkpoint-dir"][..]),
        (
            &["--comm-timeout", "1e20"],
            &["--comm-timeout", "more than a year"],
        ),
        (&["--bucket-cap-mb", "1e300"], &["--bucket-cap-mb", "1 TiB"]),
        (
            &["--first-bucket-mb", "1e300"],
            &["--first-bucket-mb", "1 TiB"],
        ),
        (&["--steps", "0"], &["--steps 0"]),
        // A negative number is a value, not a flag clap does not know.
        (
            &["--lr", "-1"],
            &["learning rate", "-1 is not a number of 0 or more"],
        ),
        (&["--grad-accum", "0"], &["--grad-accum", "0"]),
        (
            &["--total-batch-size", "100"],
            &[
                "--total-batch-size 100",
                "the 32 tokens of one micro-batch",
                "--batch-size 2",
            ],
        ),
        (
            &["--total-batch-size", "64", "--grad-accum", "2"],
            &["--total-batch-size", "--grad-accum"],
        ),
        (&["--val-every", "1"], &["--val-every needs --val-data"]),
        (&["--val-data", "train.bin"], &["--val-every"]),
        (
            &["--val-every", "1", "--val-data", "nothing.bin"],
            &["--val-data nothing.bin"],
        ),
        (
            &["--val-every", "1", "--val-data", "builtin:val"],
            &["--val-data builtin:val", "out of range"],
        ),
        (&["--sample-tokens", "8"], &["--sample-every"]),
        (
            &["--sample-every", "1"],
            &[
                "--sample-every",
                "<|endoftext|>",
                "vocabulary of 512",
                "give a --sample-prompt",
            ],
        ),
        (&["--sample-every", "0"], &["--sample-every", "0"]),
    ] {
        no_panic(&fails(d, &with(extra), needles));
    }
    // A total batch of 3 micro-batches of the rank.
    let out = run(d, &with(&["--total-batch-size", "96"]));
    let err = text(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("batch 2 x 16 tokens per rank x 3 micro-batches per step"),
        "{err}"
    );
    // Validation on held-out tokens, printed with the step.
    let out = run(d, &with(&["--val-every", "1", "--val-data", "train.bin"]));
    let err = text(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("tokens/s  val loss "), "{err}");
    assert!(
        err.contains("validation after every 1 step(s) and the last: "),
        "{err}"
    );
    // A bad training setting is named as such with validation on too, not
    // blamed on the validation data it would also read.
    #[rustfmt::skip]
    let err = fails(d, &[
        "train", "--model", "tiny", "--data", "train.bin", "--steps", "1", "--seq-len", "300",
        "--val-every", "1", "--val-data", "train.bin",
    ], &["invalid sequence length: 300"]);
    assert!(!err.contains("--val-data"), "{err}");
    // Text generated during training, printed after the step (a model with
    // GPT-2's vocabulary).
    #[rustfmt::skip]
    let out = run(d, &[
        "train", "--model", "small", "--steps", "3", "--ranks", "1", "--batch-size", "1",
        "--seq-len", "16", "--no-trace", "--sample-every", "2", "--sample-tokens", "5",
        "--sample-prompt", "The king",
    ]);
    let err = text(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains(
            "generation after every 2 step(s) and the last: 5 tokens continuing \"The king\""
        ),
        "{err}"
    );
    let blocks: Vec<&str> = err.split("  generated:\n---\n").skip(1).collect();
    assert_eq!(blocks.len(), 2, "{err}");
    assert!(err.contains("step     2  generated:") && err.contains("step     3  generated:"));
    assert!(
        blocks
            .iter()
            .all(|b| b.starts_with("The king") && b.contains("\n---")),
        "{err}"
    );
    // torchrun's variables on the CPU: nonsense is refused, a launch of
    // one process trains.
    for (env, needle) in [
        (
            &[("RANK", "5"), ("WORLD_SIZE", "2")][..],
            "must be less than WORLD_SIZE=2",
        ),
        (&[("RANK", "abc"), ("WORLD_SIZE", "2")], "RANK"),
        (&[("RANK", "0")], "WORLD_SIZE"),
    ] {
        let args = with(&["--device", "cpu"]);
        no_panic(&fails_env(d, &args, env, &["torchrun", needle]));
    }
    let out = run_env(
        d,
        &with(&["--device", "cpu"]),
        &[("RANK", "0"), ("WORLD_SIZE", "1")],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    // Model sizes: one that cannot be counted, one the host cannot hold.
    std::fs::write(
        d.join("huge.json"),
        r#"{"max_seq_len": 64, "vocab_size": 512, "num_layers": 2, "num_heads": 1,
            "channels": 4611686018427387904}"#,
    )
    .unwrap();
    no_panic(&fails(
        d,
        &["train", "--model", "huge.json", "--no-trace"],
        &["huge.json", "too many parameters"],
    ));
    let out = run_limited(d, 4_000_000, &["train", "--model", "gpt2-xl", "--no-trace"]);
    let err = text(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("out of host memory") && err.contains("6230444800 bytes for the 1557611200"),
        "{err}"
    );
    no_panic(&err);
    // Absurdly many layers: refused as too large for the host, not an
    // abort in the layout's allocations.
    std::fs::write(
        d.join("deep.json"),
        r#"{"max_seq_len": 32, "vocab_size": 50257, "num_layers": 100000000,
            "num_heads": 2, "channels": 32}"#,
    )
    .unwrap();
    let out = run_limited(
        d,
        4_000_000,
        &["train", "--model", "deep.json", "--no-trace"],
    );
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("out of host memory") && err.contains("100000000 layers"),
        "{err}"
    );
    no_panic(&err);
}

/// `eval` and `sample` inputs and outputs: built-in tokens, a directory or
/// a checkpoint given as weights, too few tokens, absurd token counts, and
/// a reader that goes away.
#[test]
fn eval_and_sample_edges() {
    let tmp = dir_with_train_bin();
    let d = tmp.path();
    write_token_file(d.join("short.bin"), &tokens(10)).unwrap();
    // A file named as a model: `--model tiny` is still the tiny model.
    std::fs::write(d.join("tiny"), b"not a model configuration").unwrap();
    #[rustfmt::skip]
    ok(d, &[
        "train", "--model", "tiny", "--data", "train.bin", "--steps", "1", "--ranks", "1",
        "--batch-size", "2", "--seq-len", "16", "--no-trace", "--save-weights",
        "w.safetensors", "--checkpoint-dir", "ckpt",
    ]);
    let eval = |weights: &str, tokens: &str, needles: &[&str]| {
        #[rustfmt::skip]
        let args = ["eval", "--weights", weights, "--tokens", tokens, "--seq-len", "16"];
        fails(d, &args, needles)
    };
    // The built-in corpus is read (its GPT-2 ids do not fit the tiny
    // model's vocabulary), not looked for as a file.
    let err = eval(
        "w.safetensors",
        "builtin:val",
        &["builtin:val", "vocabulary"],
    );
    assert!(!err.contains("No such file"), "{err}");
    // A checkpoint's directory given as weights: the flag that takes it.
    eval(
        "ckpt",
        "train.bin",
        &["ckpt", "is a directory", "--checkpoint ckpt"],
    );
    // A model directory given as weights: the file in it is named.
    std::fs::create_dir(d.join("hf")).unwrap();
    std::fs::copy(d.join("w.safetensors"), d.join("hf/model.safetensors")).unwrap();
    eval(
        "hf",
        "train.bin",
        &["is a directory", "hf/model.safetensors"],
    );
    // A checkpoint is scored as its weights are: the same parameters.
    #[rustfmt::skip]
    let by_weights = ok(d, &[
        "eval", "--weights", "w.safetensors", "--tokens", "train.bin", "--seq-len", "16",
    ]);
    #[rustfmt::skip]
    let by_checkpoint = ok(d, &[
        "eval", "--checkpoint", "ckpt", "--tokens", "train.bin", "--seq-len", "16",
    ]);
    assert_eq!(eval_loss(&by_weights), eval_loss(&by_checkpoint));
    // The same tokens as shards by a pattern (llm.c's `*_000001.bin`),
    // cut inside a window: the same loss.
    let all = tokens(3000);
    write_token_file(d.join("part_000000.bin"), &all[..1234]).unwrap();
    write_token_file(d.join("part_000001.bin"), &all[1234..]).unwrap();
    #[rustfmt::skip]
    let by_shards = ok(d, &[
        "eval", "--checkpoint", "ckpt", "--tokens", "part_*.bin", "--seq-len", "16",
    ]);
    assert_eq!(eval_loss(&by_shards), eval_loss(&by_checkpoint));
    // Without --seq-len, windows of the model's context (the tiny model's
    // 64), or of all the tokens but the last where they are fewer; a shape
    // the model refuses is refused before the header.
    write_token_file(d.join("twenty.bin"), &tokens(20)).unwrap();
    for (file, windows) in [
        ("train.bin", "windows of 64 tokens"),
        ("twenty.bin", "windows of 19 tokens"),
    ] {
        let out = run(d, &["eval", "--checkpoint", "ckpt", "--tokens", file]);
        let err = text(&out.stderr);
        assert!(out.status.success() && err.contains(windows), "{err}");
        assert!(
            err.contains("2 layers, 4 heads, 64 channels, vocabulary 512, context 64 (tiny)"),
            "{err}"
        );
    }
    #[rustfmt::skip]
    let err = fails(d, &[
        "eval", "--checkpoint", "ckpt", "--tokens", "train.bin", "--seq-len", "65",
    ], &["65 is not in 1..=64"]);
    assert!(!err.contains("evaluating the checkpoint"), "{err}");
    #[rustfmt::skip]
    fails(d, &["eval", "--tokens", "train.bin", "--seq-len", "16"], &["--weights", "--checkpoint"]);
    eval(
        "ckpt/checkpoint.safetensors",
        "train.bin",
        &[
            "Braid training checkpoint",
            "--resume",
            "sample --checkpoint",
        ],
    );
    #[rustfmt::skip]
    fails(d, &[
        "train", "--init-from", "ckpt/checkpoint.safetensors", "--data", "train.bin",
        "--no-trace",
    ], &["--init-from", "Braid training checkpoint"]);
    let err = eval(
        "w.safetensors",
        "short.bin",
        &["too few tokens (10)", "one window of 16"],
    );
    assert!(!err.contains("rank"), "{err}");

    let sample = [
        "sample",
        "--weights",
        "w.safetensors",
        "--prompt",
        "a",
        "--tokens",
    ];
    let huge: Vec<&str> = sample
        .iter()
        .copied()
        .chain(["18446744073709551615"])
        .collect();
    let err = fails(d, &huge, &["--tokens 18446744073709551615"]);
    assert!(!err.contains("panicked"), "{err}");
    // A prompt longer than the context (64): its first tokens are dropped,
    // and a note says how many.
    let prompt = format!("a{}", " a".repeat(99));
    assert_eq!(Tokenizer::gpt2().unwrap().encode(&prompt).len(), 100);
    let long: Vec<&str> = sample[..4]
        .iter()
        .copied()
        .chain([prompt.as_str(), "--tokens", "2"])
        .collect();
    let out = run(d, &long);
    let err = text(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert_eq!(
        err.matches("first 36 tokens are dropped").count(),
        1,
        "{err}"
    );
    let short: Vec<&str> = sample.iter().copied().chain(["2"]).collect();
    assert!(!text(&run(d, &short).stderr).contains("dropped"));
    // Several samples: each continues the prompt, drawn one after the
    // other from the seeded sampler (the first is the one a single sample
    // draws), with `---` between them.
    let samples = |n: &str| -> Vec<String> {
        let args: Vec<&str> = sample
            .iter()
            .copied()
            .chain(["12", "--seed", "5", "--num-samples", n])
            .collect();
        let out = ok(d, &args);
        out.split("\n---\n")
            .map(|s| s.trim_end().to_string())
            .collect()
    };
    let (one, three) = (samples("1"), samples("3"));
    assert_eq!(one.len(), 1, "{one:?}");
    assert_eq!(three.len(), 3, "{three:?}");
    assert!(three.iter().all(|s| s.starts_with('a')), "{three:?}");
    assert_eq!(three[0], one[0]);
    assert!(three[1] != three[0] && three[2] != three[1], "{three:?}");
    let zero: Vec<&str> = sample
        .iter()
        .copied()
        .chain(["2", "--num-samples", "0"])
        .collect();
    fails(d, &zero, &["--num-samples"]);
    // A reader that stops (`| head -c 8`): the program stops at once, with
    // success, though it was asked for a trillion tokens.
    let many: Vec<&str> = sample.iter().copied().chain(["1000000000000"]).collect();
    let mut child = Command::new(BIN)
        .args(&many)
        .current_dir(d)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut head = [0u8; 8];
    std::io::Read::read_exact(child.stdout.as_mut().unwrap(), &mut head).unwrap();
    drop(child.stdout.take());
    // Sample stops generating once its reader has gone.
    let status = exit_within(&mut child, 60);
    let mut err = String::new();
    std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err).unwrap();
    assert!(status.success(), "{status}: {err}");
}

/// `--warmup-steps`' help says what step 1 gets.
#[test]
fn the_warmup_help_matches_the_schedule() {
    let tmp = tempfile::tempdir().unwrap();
    let help = ok(tmp.path(), &["train", "--help"]);
    assert!(help.contains("step 1 at --lr/N"), "{help}");
    assert!(!help.contains("from 0 to --lr"), "{help}");
}

/// `export` writes a checkpoint's parameters as Hugging Face weights: a
/// file, or a directory with `config.json` (as `--save-weights` does);
/// both load back as the checkpoint scores.
#[test]
fn export_and_model_directories() {
    let tmp = dir_with_train_bin();
    let d = tmp.path();
    #[rustfmt::skip]
    let out = ok(d, &[
        "train", "--model", "tiny", "--data", "train.bin", "--steps", "1", "--ranks", "1",
        "--batch-size", "2", "--seq-len", "16", "--no-trace", "--save-weights", "hf/",
        "--checkpoint-dir", "ckpt",
    ]);
    assert!(
        out.contains("hf/model.safetensors") && out.contains("hf/config.json"),
        "{out}"
    );
    // The configuration transformers' GPT2Config reads.
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(d.join("hf/config.json")).unwrap()).unwrap();
    let tiny = braid_gpt2::config::Gpt2Config::tiny();
    for (key, want) in [
        ("model_type", serde_json::json!("gpt2")),
        ("architectures", serde_json::json!(["GPT2LMHeadModel"])),
        ("vocab_size", tiny.vocab_size.into()),
        ("n_positions", tiny.max_seq_len.into()),
        ("n_ctx", tiny.max_seq_len.into()),
        ("n_embd", tiny.channels.into()),
        ("n_layer", tiny.num_layers.into()),
        ("n_head", tiny.num_heads.into()),
        ("activation_function", "gelu_new".into()),
        ("layer_norm_epsilon", 1e-5.into()),
        ("tie_word_embeddings", true.into()),
        // The tiny vocabulary has no <|endoftext|>.
        ("eos_token_id", serde_json::Value::Null),
    ] {
        assert_eq!(config[key], want, "{key} in {config}");
    }
    // A file, an existing directory and a new one from the checkpoint: the
    // same bytes as the run's own weights.
    std::fs::create_dir(d.join("existing")).unwrap();
    for (path, weights) in [
        ("w.safetensors", "w.safetensors"),
        ("existing", "existing/model.safetensors"),
        ("new/", "new/model.safetensors"),
    ] {
        #[rustfmt::skip]
        let out = ok(d, &["export", "--checkpoint", "ckpt", "--save-weights", path]);
        assert!(out.contains(weights), "{out}");
        assert_eq!(
            std::fs::read(d.join(weights)).unwrap(),
            std::fs::read(d.join("hf/model.safetensors")).unwrap(),
            "{weights}"
        );
    }
    assert!(!d.join("config.json").exists());
    assert_eq!(
        std::fs::read(d.join("new/config.json")).unwrap(),
        std::fs::read(d.join("hf/config.json")).unwrap()
    );
    // They score as the checkpoint does.
    let score = |source: &[&str]| {
        let args = [source, &["--tokens", "train.bin", "--seq-len", "16"]].concat();
        eval_loss(&ok(d, &[&["eval"][..], &args].concat()))
    };
    let by_checkpoint = score(&["--checkpoint", "ckpt"]);
    assert_eq!(score(&["--weights", "hf/model.safetensors"]), by_checkpoint);
    assert_eq!(score(&["--weights", "w.safetensors"]), by_checkpoint);
    // What cannot be exported, before anything is written.
    let before = snapshot(d);
    #[rustfmt::skip]
    fails(d, &["export", "--checkpoint", "ckpt", "--save-weights", "absent/dir/w.safetensors"],
          &["--save-weights", "absent/dir", "does not exist"]);
    #[rustfmt::skip]
    fails(d, &["export", "--checkpoint", "nowhere", "--save-weights", "x.safetensors"],
          &["--checkpoint", "nowhere"]);
    assert!(!d.join("x.safetensors").exists());
    assert!(snapshot(d) == before, "a failed export changed files");
}

/// A checkpoint save that fails in the middle of a run (here the file size
/// limit, `ulimit -f`, with SIGXFSZ ignored so the write fails instead of
/// the process) names the step and the directory, and keeps the
/// checkpoint already there whole.
#[cfg(unix)]
#[test]
fn a_failed_checkpoint_save_names_its_step_and_keeps_the_last_one() {
    let tmp = dir_with_train_bin();
    let d = tmp.path();
    #[rustfmt::skip]
    let args = [
        "train", "--model", "tiny", "--data", "train.bin", "--ranks", "1",
        "--batch-size", "2", "--seq-len", "16", "--no-trace", "--checkpoint-dir", "ckpt",
        "--checkpoint-every", "1",
    ];
    let with = |extra: &[&'static str]| -> Vec<&str> {
        args.iter().copied().chain(extra.iter().copied()).collect()
    };
    ok(d, &with(&["--steps", "2"]));
    let saved = std::fs::read(d.join("ckpt/checkpoint.safetensors")).unwrap();
    // 64 blocks (at most 64 KiB): far less than a checkpoint of the tiny
    // model (its parameters and two moments, over a MiB).
    assert!(saved.len() > 1 << 20);
    let out = Command::new("sh")
        .arg("-c")
        .arg("trap '' XFSZ && ulimit -f 64 && exec \"$0\" \"$@\"")
        .arg(BIN)
        .args(with(&["--steps", "4", "--resume"]))
        .current_dir(d)
        .output()
        .expect("sh runs");
    let err = text(&out.stderr);
    assert!(!out.status.success(), "{err}");
    for needle in [
        "saving the checkpoint of step 3 in ckpt",
        "the checkpoint already there (step 2) was kept",
    ] {
        assert!(err.contains(needle), "no {needle:?} in:\n{err}");
    }
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(
        std::fs::read(d.join("ckpt/checkpoint.safetensors")).unwrap(),
        saved
    );
    assert_eq!(
        checkpoint_dir_names(&d.join("ckpt")),
        [".lock", "checkpoint.safetensors"],
        "temporaries left"
    );
}

/// `--zero 1` with one rank and no reducer changes nothing, and says so;
/// the help says what `--zero` takes, and what `--ranks` does under a
/// one-process torchrun launch on the CPU (trains them).
#[test]
fn zero_with_one_rank_says_it_does_nothing() {
    let tmp = dir_with_train_bin();
    let d = tmp.path();
    #[rustfmt::skip]
    let args = [
        "train", "--model", "tiny", "--data", "train.bin", "--steps", "1",
        "--batch-size", "2", "--seq-len", "16", "--no-trace", "--zero", "1",
    ];
    let stderr = |extra: &[&str], env: &[(&str, &str)]| {
        let all: Vec<&str> = args.iter().chain(extra).copied().collect();
        let out = run_env(d, &all, env);
        let err = text(&out.stderr);
        assert!(out.status.success(), "{err}");
        err
    };
    let note = "--zero 1 shards the optimizer over the ranks, and this run has one";
    assert_eq!(stderr(&["--ranks", "1"], &[]).matches(note).count(), 1);
    assert!(!stderr(&["--ranks", "1", "--reduce-single-rank"], &[]).contains(note));
    assert!(!stderr(&["--ranks", "2"], &[]).contains(note));
    // So is --spare-sms on the CPU, where there are no SMs.
    let sms = "note: --spare-sms 4 leaves SMs of a GPU to other programs";
    assert!(stderr(&["--ranks", "2", "--spare-sms", "4"], &[]).contains(sms));
    // A one-process torchrun launch on the CPU trains --ranks ranks.
    let err = stderr(&["--ranks", "3"], &[("RANK", "0"), ("WORLD_SIZE", "1")]);
    assert!(err.contains("3 rank(s) on cpu"), "{err}");
    let help = ok(d, &["train", "--help"]);
    assert!(!help.contains("Plain f32 buckets only"), "{help}");
    assert!(help.contains("WORLD_SIZE=1"), "{help}");
}

/// A token file truncated while a run maps it (llm.c's scripts rewrite
/// their files in place) ends the run by SIGBUS, explained on stderr
/// first, not silently.
#[test]
fn a_token_file_truncated_under_a_run_is_explained() {
    use std::io::BufRead;
    use std::os::unix::process::ExitStatusExt;
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    write_token_file(d.join("shard_000000.bin"), &tokens(3000)).unwrap();
    write_token_file(d.join("shard_000001.bin"), &tokens(3000)).unwrap();
    #[rustfmt::skip]
    let mut child = Command::new(BIN)
        .args([
            "train", "--model", "tiny", "--data", "shard_*.bin", "--steps", "1000000",
            "--ranks", "1", "--batch-size", "2", "--seq-len", "16", "--no-trace",
            "--lr-schedule", "constant",
        ])
        .current_dir(d)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = std::io::BufReader::new(child.stderr.take().unwrap());
    let mut seen = String::new();
    // Training has started: the header is out, a step reported.
    while !seen.contains("step ") {
        let mut line = String::new();
        if err.read_line(&mut line).unwrap() == 0 {
            panic!("the run ended before training: {seen}");
        }
        seen += &line;
    }
    // Truncated in place, not replaced: the mapped pages go.
    std::fs::OpenOptions::new()
        .write(true)
        .open(d.join("shard_000001.bin"))
        .unwrap()
        .set_len(0)
        .unwrap();
    // The run does not go on after its data was truncated.
    let status = exit_within(&mut child, 60);
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut err, &mut rest).unwrap();
    assert_eq!(status.signal(), Some(libc::SIGBUS), "{status:?}: {rest}");
    assert!(
        rest.contains("bus error (SIGBUS)") && rest.contains("truncated"),
        "{rest}"
    );
}

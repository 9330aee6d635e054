//! Each step's figures as JSON lines ([`MetricsLog`]), for plots and
//! scripts: one [`StepReport`] per line, as it completes.

use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};

use super::StepReport;
use crate::error::{Gpt2Error, Result};

/// A file of JSON lines, one per step: `{"step":1,"loss":10.87,
/// "grad_norm":4.18,"lr":0.0019,"seconds":0.14,"tokens":512,
/// "replayed":false}`, with `"val_loss"` where the step was validated
/// (`pandas.read_json(path, lines=True)` reads it). Each line is written
/// and flushed as its step completes, so the file follows a run that is
/// still going, and holds every finished step of one that stopped.
///
/// A run that starts fresh replaces the file; one resumed after step `s`
/// keeps the file's lines of steps up to `s` (dropping those of steps the
/// checkpoint does not hold, which the resumed run takes again) and
/// appends after them. A write that fails (a full disk) does not stop
/// training: the log stops and [`error`](Self::error) keeps the failure.
///
/// [`train`](super::train)'s step callback is a shared `Fn`, and `write`
/// takes `&mut self`: hold the log in a `Mutex`, as `braid-gpt2` does
/// (`let log = Mutex::new(MetricsLog::create(path, 0)?);` and, in the
/// callback, `log.lock().unwrap().write(report)`).
#[derive(Debug)]
pub struct MetricsLog {
    path: PathBuf,
    file: Option<File>,
    error: Option<Gpt2Error>,
}

impl MetricsLog {
    /// Opens `path` for a run whose first step is `start_step + 1` (fresh:
    /// 0): replaced, or cut after `start_step` and appended to.
    ///
    /// Outputs are taken as the other outputs are ([`braid::fs::open_log`]):
    /// `/dev/stdout` writes through the process's standard output (among
    /// what it prints), a pipe or a device is written into and never read
    /// back, so a resume cuts regular files only.
    pub fn create(path: &Path, start_step: u64) -> Result<Self> {
        let append = start_step > 0;
        let log = braid::fs::open_log(path, append)?;
        let file = match append && log.regular {
            false => log.file,
            true => {
                // Cut, then opened again: the cut replaces the file.
                drop(log);
                let kept = Self::lines_up_to(path, start_step)?;
                braid::fs::write_atomic::<Gpt2Error>(path, |w| {
                    kept.iter().try_for_each(|l| writeln!(w, "{l}"))
                })?;
                braid::fs::open_log(path, true)?.file
            }
        };
        Ok(MetricsLog {
            path: path.to_owned(),
            file: Some(file),
            error: None,
        })
    }

    /// The lines of the regular file `path` that are steps up to `step`:
    /// those of later steps go, and so does any line that is not a step's
    /// (a line torn by a kill or a full disk), which would leave the file
    /// unreadable as JSON lines.
    fn lines_up_to(path: &Path, step: u64) -> Result<Vec<String>> {
        let file = File::open(path).map_err(|error| Gpt2Error::Io {
            op: "reading",
            path: path.to_owned(),
            error,
        })?;
        let mut kept = Vec::new();
        for line in BufReader::new(file).lines() {
            let line = line.map_err(|error| Gpt2Error::Io {
                op: "reading",
                path: path.to_owned(),
                error,
            })?;
            let of = serde_json::from_str::<serde_json::Value>(&line)
                .ok()
                .and_then(|v| v.get("step")?.as_u64());
            if of.is_some_and(|s| s <= step) {
                kept.push(line);
            }
        }
        Ok(kept)
    }

    /// Appends `report` as a line, after a line `{"step":0,"val_loss":…}`
    /// of the validation before it where it has one
    /// ([`StepReport::start_val_loss`]). After a failed write it does
    /// nothing more.
    pub fn write(&mut self, report: &StepReport) {
        let Some(file) = self.file.as_mut() else {
            return;
        };
        // Step 0's figure as the steps' are: an `f32`'s shortest digits.
        #[derive(serde::Serialize)]
        struct Start {
            step: u64,
            val_loss: f32,
        }
        let mut line = match report.start_val_loss {
            Some(val_loss) => {
                serde_json::to_string(&Start { step: 0, val_loss }).expect("plain data") + "\n"
            }
            None => String::new(),
        };
        line += &serde_json::to_string(report).expect("a step report is plain data");
        line.push('\n');
        if let Err(error) = file.write_all(line.as_bytes()) {
            self.file = None;
            self.error = Some(Gpt2Error::Io {
                op: "writing",
                path: self.path.clone(),
                error,
            });
        }
    }

    /// The write that failed, if one did.
    pub fn error(&self) -> Option<&Gpt2Error> {
        self.error.as_ref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::OpenOptions;

    fn report(step: u64, val_loss: Option<f32>) -> StepReport {
        StepReport {
            step,
            loss: 10.5,
            grad_norm: 2.25,
            lr: 1e-3,
            seconds: 0.125,
            tokens: 512,
            replayed: step > 2,
            val_loss,
            start_val_loss: None,
            // Not in the log.
            sample: Some(vec![1, 2]),
        }
    }

    fn steps(path: &Path) -> Vec<u64> {
        std::fs::read_to_string(path)
            .unwrap()
            .lines()
            .map(|l| {
                serde_json::from_str::<serde_json::Value>(l).unwrap()["step"]
                    .as_u64()
                    .unwrap()
            })
            .collect()
    }

    #[test]
    fn lines_are_reports_and_a_resume_takes_up_after_its_step() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.jsonl");
        std::fs::write(&path, "stale\n").unwrap();
        let mut log = MetricsLog::create(&path, 0).unwrap();
        for s in 1..=5 {
            log.write(&StepReport {
                // The validation before the first step: a line of its own.
                start_val_loss: (s == 1).then_some(10.875),
                ..report(s, (s == 4).then_some(9.5))
            });
        }
        assert!(log.error().is_none());
        let text = std::fs::read_to_string(&path).unwrap();
        let mut lines = text.lines();
        assert_eq!(lines.next().unwrap(), r#"{"step":0,"val_loss":10.875}"#);
        assert_eq!(
            lines.next().unwrap(),
            r#"{"step":1,"loss":10.5,"grad_norm":2.25,"lr":0.001,"seconds":0.125,"tokens":512,"replayed":false}"#
        );
        assert!(text
            .lines()
            .nth(4)
            .unwrap()
            .ends_with(r#","val_loss":9.5}"#));
        assert_eq!(steps(&path), [0, 1, 2, 3, 4, 5]);
        // Resumed from a checkpoint of step 3: steps 4 and 5 are taken
        // again; a torn line (a kill mid-write) goes too.
        let mut torn = std::fs::read_to_string(&path).unwrap();
        torn.insert_str(0, "{\"step\":1,\"lo\n");
        torn.push_str("{\"step\":6,\"loss\":1");
        std::fs::write(&path, torn).unwrap();
        let mut log = MetricsLog::create(&path, 3).unwrap();
        log.write(&report(4, None));
        assert_eq!(steps(&path), [0, 1, 2, 3, 4]);
        // A fresh run replaces it.
        MetricsLog::create(&path, 0)
            .unwrap()
            .write(&report(1, None));
        assert_eq!(steps(&path), [1]);
    }

    #[test]
    fn a_failed_write_is_kept_and_training_goes_on() {
        let Ok(full) = OpenOptions::new().write(true).open("/dev/full") else {
            return;
        };
        let mut log = MetricsLog {
            path: "/dev/full".into(),
            file: Some(full),
            error: None,
        };
        log.write(&report(1, None));
        log.write(&report(2, None));
        let e = log.error().expect("/dev/full refuses writes").to_string();
        assert!(e.contains("writing /dev/full"), "{e}");
    }
}

//! Shared pieces of Braid's benchmarks: the task-graph shapes used to measure
//! the engine's per-task overhead, and the toy MLP trained data-parallel by
//! `ddp_overlap` (and checked by the workspace tests).

use braid::{Accesses, Buffer, Result, Runtime};
use braid_gpt2::rng::Rng;

pub mod simulate;
pub mod toy_mlp;

/// The median of `v` (the mean of the two middle values when their number is
/// even); NaN when `v` is empty.
pub fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    match s.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => s[n / 2],
        n => (s[n / 2 - 1] + s[n / 2]) / 2.0,
    }
}

/// The most CPU ranks a benchmark starts. CPU ranks are threads of this
/// process (`braid::launch`), each with its runtime's stream threads beside
/// it (a compute and a communication stream at least: three threads a
/// rank). Tens of thousands of ranks ask for more threads than Linux gives
/// one process by default (its memory mappings, `vm.max_map_count` 65,530,
/// every thread taking several for its stack, guard page and signal stack;
/// its thread limit), and the Rust runtime then aborts the whole process
/// while starting a thread ("failed to set up alternative stack guard
/// page") instead of returning an error. 1,024 stays far inside that (1,024
/// ranks of `allreduce_bw` run on a 2-core VM), is far more ranks than cores
/// on any machine these figures mean something on, and is the runtime's own
/// cap on streams (`braid::MAX_STREAMS`).
pub const MAX_CPU_RANKS: usize = 1024;

/// Command-line value parsers shared by the benchmark programs: a value that
/// would measure nothing (a count of 0, a non-positive factor) is refused
/// when the arguments are parsed, clap naming the flag and saying why.
pub mod cli {
    use clap::builder::RangedU64ValueParser;

    /// A count of at least `min` (`--reps`, `--steps`, a width, ...).
    pub fn at_least(min: u64) -> RangedU64ValueParser<usize> {
        RangedU64ValueParser::new().range(min..)
    }

    /// A number of CPU ranks: 1 to [`MAX_CPU_RANKS`](crate::MAX_CPU_RANKS).
    pub fn cpu_ranks(s: &str) -> Result<usize, String> {
        let max = crate::MAX_CPU_RANKS;
        match s.trim().parse::<usize>() {
            Ok(0) => Err("0 ranks: at least 1 is needed".into()),
            Ok(n) if n > max => Err(format!(
                "{n} ranks: at most {max} (each rank is a thread of this process, with its \
                 runtime's stream threads beside it)"
            )),
            Ok(n) => Ok(n),
            Err(e) => Err(format!("`{s}` is not a rank count: {e}")),
        }
    }

    /// A finite number above 0 (a factor, a period, a cap).
    pub fn positive_f64(s: &str) -> Result<f64, String> {
        match s.trim().parse::<f64>() {
            Ok(x) if x.is_finite() && x > 0.0 => Ok(x),
            Ok(x) => Err(format!("{x} is not a positive number")),
            Err(e) => Err(format!("`{s}` is not a number: {e}")),
        }
    }

    /// A finite number at or above 0.
    pub fn non_negative_f64(s: &str) -> Result<f64, String> {
        match s.trim().parse::<f64>() {
            Ok(x) if x.is_finite() && x >= 0.0 => Ok(x),
            Ok(x) => Err(format!("{x} is not a number at or above 0")),
            Err(e) => Err(format!("`{s}` is not a number: {e}")),
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn the_parsers_refuse_what_measures_nothing() {
            assert_eq!(cpu_ranks("1"), Ok(1));
            assert_eq!(cpu_ranks("1024"), Ok(1024));
            assert!(cpu_ranks("0").unwrap_err().contains("at least 1"));
            assert!(cpu_ranks("1025").unwrap_err().contains("at most 1024"));
            assert!(cpu_ranks("x").is_err());
            assert_eq!(positive_f64("0.5"), Ok(0.5));
            for bad in ["0", "-1", "nan", "inf", "x"] {
                assert!(positive_f64(bad).is_err(), "{bad}");
            }
            assert_eq!(non_negative_f64("0"), Ok(0.0));
            for bad in ["-0.1", "nan", "inf", "x"] {
                assert!(non_negative_f64(bad).is_err(), "{bad}");
            }
        }
    }
}

/// The GPT-2 benchmarks' storage flags (`--dtype`, `--fused`, `--fuse`),
/// flattened into each program's arguments.
#[derive(clap::Args, Debug, Clone, Copy)]
pub struct StorageArgs {
    /// Storage type: fp32, or bf16 (mixed precision: f32 master weights,
    /// moments and accumulation).
    #[arg(long, default_value = "fp32")]
    pub dtype: braid_gpt2::model::Dtype,
    /// Every fused kernel (`--fuse all`): flash attention (no (B, NH, T, T)
    /// matrices), the fused classifier (no (B, T, V) probabilities), fused
    /// residual + layer norm, GELU recomputation.
    #[arg(long, conflicts_with = "fuse")]
    pub fused: bool,
    /// Some fused kernels: a comma-separated list of attention, classifier,
    /// residual-layernorm, gelu-recompute (or all, none).
    #[arg(long, value_parser = braid_gpt2::model::Fusion::parse)]
    pub fuse: Option<braid_gpt2::model::Fusion>,
}

impl StorageArgs {
    /// The model options these flags ask for.
    pub fn options(&self) -> braid_gpt2::model::ModelOptions {
        braid_gpt2::model::ModelOptions {
            fusion: self.fusion(),
            dtype: self.dtype,
            ..Default::default()
        }
    }

    /// The fused kernels these flags ask for.
    pub fn fusion(&self) -> braid_gpt2::model::Fusion {
        match (self.fused, self.fuse) {
            (true, _) => braid_gpt2::model::Fusion::ALL,
            (false, f) => f.unwrap_or_default(),
        }
    }
}

/// The shape of a generated task graph.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// Every task reads and writes the same buffer: one long dependency chain.
    Chain,
    /// One writer, then every task reads it and writes a buffer of its own.
    Fanout,
    /// Each task reads two random buffers of a pool and writes a third.
    Random,
    /// A chain pinned alternately to compute streams 0 and 1: every
    /// dependency crosses streams. Against `Chain` (one stream), the
    /// difference per task is what a cross-stream hand-off costs.
    PingPong,
}

impl std::str::FromStr for Shape {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "chain" => Ok(Shape::Chain),
            "fanout" => Ok(Shape::Fanout),
            "random" => Ok(Shape::Random),
            "pingpong" => Ok(Shape::PingPong),
            _ => Err(format!(
                "unknown shape `{s}` (expected chain, fanout, random or pingpong)"
            )),
        }
    }
}

/// Buffers a shape needs, allocated up front (allocation is not per-task cost).
pub fn buffers(rt: &Runtime, shape: Shape, tasks: usize) -> Result<Vec<Buffer>> {
    let n = match shape {
        Shape::Chain | Shape::PingPong => 1,
        Shape::Fanout => tasks + 1,
        Shape::Random => 64,
    };
    (0..n).map(|i| rt.alloc(format!("b{i}"), 64)).collect()
}

/// Submits `tasks` empty tasks of the given shape and waits for all of them.
pub fn run(rt: &Runtime, shape: Shape, tasks: usize, bufs: &[Buffer]) -> Result<()> {
    submit(rt, shape, tasks, bufs)?;
    rt.synchronize()
}

/// Submits `tasks` empty tasks of the given shape (returns at once).
pub fn submit(rt: &Runtime, shape: Shape, tasks: usize, bufs: &[Buffer]) -> Result<()> {
    let mut rng = Rng::new(0);
    let mut next = move || rng.next_u64();
    for i in 0..tasks {
        match shape {
            Shape::Chain => empty(rt, bufs[0].read_write::<u8>())?,
            Shape::PingPong => {
                rt.task("empty")
                    .on_stream(i % 2)
                    .run(bufs[0].read_write::<u8>(), |_| ())?;
            }
            Shape::Fanout if i == 0 => empty(rt, bufs[0].write::<u8>())?,
            Shape::Fanout => empty(rt, (bufs[0].read::<u8>(), bufs[i].write::<u8>()))?,
            Shape::Random => {
                let n = bufs.len() as u64;
                let (x, y, z) = (next() % n, next() % n, next() % n);
                let read = |k: u64, ok: bool| ok.then(|| bufs[k as usize].read::<u8>());
                empty(
                    rt,
                    (
                        bufs[z as usize].write::<u8>(),
                        read(x, x != z),
                        read(y, y != z && y != x),
                    ),
                )?
            }
        }
    }
    Ok(())
}

/// Submits one task with `accesses` and a body that does nothing.
fn empty<A: Accesses>(rt: &Runtime, accesses: A) -> Result<()> {
    rt.task("empty").run(accesses, |_| ())?;
    Ok(())
}

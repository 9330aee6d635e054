//! Shared pieces of Braid's benchmarks: the task-graph shapes used to measure
//! the engine's per-task overhead.

use braid::{Buffer, Result, Runtime};
use braid_gpt2::rng::Rng;

/// The shape of a generated task graph.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// Every task reads and writes the same buffer: one long dependency chain.
    Chain,
    /// One writer, then every task reads it and writes a buffer of its own.
    Fanout,
    /// Each task reads two random buffers of a pool and writes a third.
    Random,
}

impl std::str::FromStr for Shape {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "chain" => Ok(Shape::Chain),
            "fanout" => Ok(Shape::Fanout),
            "random" => Ok(Shape::Random),
            _ => Err(format!(
                "unknown shape `{s}` (expected chain, fanout or random)"
            )),
        }
    }
}

/// Buffers a shape needs, allocated up front (allocation is not per-task cost).
pub fn buffers(rt: &Runtime, shape: Shape, tasks: usize) -> Result<Vec<Buffer>> {
    let n = match shape {
        Shape::Chain => 1,
        Shape::Fanout => tasks + 1,
        Shape::Random => 64,
    };
    (0..n).map(|i| rt.alloc(format!("b{i}"), 64)).collect()
}

/// Submits `tasks` empty tasks of the given shape and waits for all of them.
pub fn run(rt: &Runtime, shape: Shape, tasks: usize, bufs: &[Buffer]) -> Result<()> {
    let mut rng = Rng::new(0);
    let mut next = move || rng.next_u64();
    for i in 0..tasks {
        let b = rt.task("empty");
        let b = match shape {
            Shape::Chain => b.read_write(&bufs[0]),
            Shape::Fanout if i == 0 => b.write(&bufs[0]),
            Shape::Fanout => b.read(&bufs[0]).write(&bufs[i]),
            Shape::Random => {
                let n = bufs.len() as u64;
                let (x, y, z) = (next() % n, next() % n, next() % n);
                let b = b.write(&bufs[z as usize]);
                let b = if x != z { b.read(&bufs[x as usize]) } else { b };
                if y != z && y != x {
                    b.read(&bufs[y as usize])
                } else {
                    b
                }
            }
        };
        b.run(|_| Ok(()))?;
    }
    rt.synchronize()
}

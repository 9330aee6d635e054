//! Ranks that place a recorded schedule alike.
//!
//! A recorded schedule is re-placed once from measured durations (CPU,
//! `Schedule::replay`). Each rank measures its own, so two ranks of one
//! data-parallel program can choose different placements: different task
//! orders, so each rank reaches each collective at a different time and one
//! waits for the other (on the GPT-2 trainer, 2 CPU ranks: one rank ran the
//! classifier's input gradient first, the other its weight pieces first, and
//! the first bucket's all-reduce waited 28 ms for the other rank). Agreeing
//! on the inputs first — the largest duration of each task over the ranks
//! (a collective step waits for the slowest rank) and the fewest usable
//! compute streams — gives every rank the same inputs to a deterministic
//! placement, so the same plan.
//!
//! Two collectives, both decided from results every rank shares, so every
//! rank takes the same branch: first the schedule's shape (its task count
//! and a hash of its task names, with their negations, reduced by maximum:
//! equal on every rank exactly when the maximum of each is minus the
//! maximum of its negation); then, only if the shapes match, the durations.
//! Schedules that differ between ranks (ZeRO-1's sharded optimizer records
//! each rank's own shard) keep their recorded placement.

use super::{BoundComm, Buffers, CollectiveKind, DType, ReduceOp};
use crate::error::{Error, Result};
use crate::schedule::Agreement;
use crate::Schedule;
use std::hash::{Hash, Hasher};

/// The name of the agreement's tasks (what the trace shows; a one-off
/// before the first replay, which tools that cut steps out of a trace leave
/// out).
pub const AGREEMENT_TASK: &str = "placement agreement";

impl BoundComm<'_> {
    /// Makes every rank of the group re-place `schedule` the same way:
    /// all-reduces (the maximum over the ranks) of each task's measured
    /// duration and of the usable compute streams, after which the
    /// schedule's next replay re-places from the agreed figures. Call it on
    /// every rank at the same point of the program (it is collective),
    /// after the recording has run (a synchronisation point) and before the
    /// first replay. If the ranks' schedules differ (task count or names),
    /// or some rank has not measured every task or already placed its
    /// schedule again, every rank keeps the recording's placement. Results
    /// never depend on placement; only the ranks' timing does.
    ///
    /// Errors: `schedule` records tasks of another runtime, or a
    /// collective's own failure.
    pub fn agree_placement(&self, schedule: &Schedule<'_>) -> Result<()> {
        if !std::ptr::eq(self.rt, schedule.runtime()) {
            return Err(Error::Usage(format!(
                "agree_placement: the schedule `{}` records tasks of another runtime than the communicator's",
                schedule.name()
            )));
        }
        let order = schedule.task_order();
        let n = order.len();
        let mut h = std::collections::hash_map::DefaultHasher::new();
        for (name, _) in &order {
            name.hash(&mut h);
        }
        // 52 bits: exact in an f64.
        let hash = (h.finish() >> 12) as f64;
        let shape = self.max_of(&[n as f64, -(n as f64), hash, -hash])?;
        if shape[0] != -shape[1] || shape[2] != -shape[3] {
            schedule.set_agreement(Agreement::Keep);
            return Ok(());
        }
        // Durations (f64 holds nanoseconds exactly up to 2^53), then minus
        // the usable compute streams (the maximum is minus the minimum),
        // then 1 where this rank cannot re-place.
        let mut v = vec![0f64; n + 2];
        match schedule.placement_inputs() {
            Some((dur, compute)) => {
                for (x, d) in v.iter_mut().zip(dur) {
                    *x = d as f64;
                }
                v[n] = -(compute as f64);
            }
            None => v[n + 1] = 1.0,
        }
        let out = self.max_of(&v)?;
        schedule.set_agreement(if out[n + 1] > 0.0 {
            Agreement::Keep
        } else {
            Agreement::Place {
                dur: out[..n].iter().map(|&d| d as u64).collect(),
                compute: (-out[n]) as usize,
            }
        });
        Ok(())
    }

    /// The element-wise maximum of `v` over the ranks (a synchronisation
    /// point for this rank).
    fn max_of(&self, v: &[f64]) -> Result<Vec<f64>> {
        let buf = self.rt.alloc(AGREEMENT_TASK, std::mem::size_of_val(v))?;
        self.rt.upload_named(AGREEMENT_TASK, &buf, v)?;
        self.submit_named(
            AGREEMENT_TASK,
            CollectiveKind::AllReduce(ReduceOp::Max),
            DType::F64,
            Buffers::InPlace(buf.whole()),
        )?;
        self.rt.read_vec_named(AGREEMENT_TASK, &buf)
    }
}

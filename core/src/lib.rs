//! Braid: submit GPU (or CPU) tasks in program order; Braid infers their data
//! dependencies and runs independent ones side by side on several streams.
//!
//! ```
//! use braid::{BackendKind, Runtime};
//!
//! let rt = Runtime::builder().backend(BackendKind::Cpu).compute_streams(2).build()?;
//! let x = rt.alloc_from("x", &[1.0f32, 2.0, 3.0, 4.0])?;
//! let y = rt.alloc("y", 16)?;
//! // Two independent halves: they may run on two streams at once.
//! for half in 0..2 {
//!     let (xs, ys) = (x.view_of::<f32>(half * 2..half * 2 + 2)?, y.view_of::<f32>(half * 2..half * 2 + 2)?);
//!     rt.task("double").run((xs.read::<f32>(), ys.write::<f32>()), |(xs, ys)| {
//!         for (o, i) in ys.iter_mut().zip(xs) {
//!             *o = 2.0 * i;
//!         }
//!     })?;
//! }
//! assert_eq!(rt.read_vec::<f32>(&y)?, vec![2.0, 4.0, 6.0, 8.0]);
//! # Ok::<(), braid::Error>(())
//! ```
//!
//! The contract (docs/engine.md, "Semantics"): the result is bit for bit that of running the
//! tasks one at a time in submission order; a failing task never hangs the
//! engine and its error surfaces at the next synchronisation point.

#![deny(unsafe_op_in_unsafe_fn)]

/// The README's Rust example runs as a doctest, so it stays in step with the API.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
struct ReadmeDoctests;

mod access;
mod backend;
mod buffer;
mod clock;
pub mod comm;
mod ctx;
mod error;
pub mod fs;
mod graph;
mod kind;
mod runtime;
mod sched;
mod schedule;
mod scope;
mod sync;
mod task;
pub mod topo;
pub mod trace;

pub use access::{
    Accesses, DevBytes, DevSlice, DevSliceMut, DynAccess, HostBytes, Read, ReadWrite, Write,
};
pub use backend::gpu::CudaTaskCtx;
pub use backend::BackendKind;
/// The CUDA layer: the `braid-cuda` crate (devices, streams, events, memory,
/// NVRTC kernels, cuBLAS, NCCL), re-exported.
pub use braid_cuda as cuda;
pub use buffer::{AsView, Buffer, View};
pub use comm::{
    launch, launch_with, BoundComm, Comm, Communicator, LocalComm, LocalCommConfig, Reducer,
};
pub use error::{Error, Result, TaskError};
pub use graph::{upward_rank_order, Mode};
pub use kind::{Class, PlaceReason, Placement, Priority, TaskKind};
pub use runtime::{Runtime, RuntimeBuilder, MAX_STREAMS, PLACEMENT_ENV};
pub use sched::placement::Policy;
pub use sched::scoped::{ScopeDecision, StreamChoice};
pub use sched::tenants::preemption_point;
pub use sched::trial::{TrialOutcome, TrialPlacement};
pub use sched::Stats;
pub use sched::TaskHandle;
pub use sched::INLINE_MAX_NS;
pub use schedule::Schedule;
pub use scope::{PlacementFile, Scope};
pub use task::{TaskBuilder, TaskResult};

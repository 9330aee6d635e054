//! What a scope's placement decides for the tasks submitted inside it
//! (docs/scopes.md). `crate::scope` resolves a [`ScopeDecision`] from the
//! placement file once per scope path and hands each task its [`ScopeTag`];
//! `submit` applies it under the runtime's lock. Placement only: whatever a
//! decision says, the task's edges are the inferred ones (semantics 10).

use super::placement::Policy;
use crate::kind::Priority;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Where a scope's tasks go (the placement file's `stream` key).
/// Communication tasks always keep their communication stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StreamChoice {
    /// The placement policy decides (`"any"`: undoes an enclosing scope's
    /// choice).
    Policy,
    /// Compute stream `i` (an integer).
    Compute(usize),
    /// Communication stream `i` (`"comm"` is `"comm:0"`).
    Comm(usize),
    /// The side class (`"side"`): placed as [`Priority::Side`] work, off the
    /// stream of the main chain.
    Side,
}

/// What the placement file decides for one scope path: each field is the
/// winning rule's value, `None` where no matching rule sets it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScopeDecision {
    /// The stream or stream class.
    pub stream: Option<StreamChoice>,
    /// The priority hint, replacing the task's own (not for communication).
    pub priority: Option<Priority>,
    /// The placement policy for the scope's tasks.
    pub policy: Option<Policy>,
    /// Every compute task of one entry of the scope runs on one stream: the
    /// stream its first task was placed on.
    pub bundle: bool,
    /// Whether automatic replay may memoise a step with tasks of the scope
    /// (default true; `false` leaves such steps eager).
    pub replay: bool,
}

impl Default for ScopeDecision {
    fn default() -> Self {
        ScopeDecision {
            stream: None,
            priority: None,
            policy: None,
            bundle: false,
            replay: true,
        }
    }
}

/// The scope a task was submitted in: its path, the path's hash (automatic
/// replay's step hash includes it), the decision and, for a bundled scope,
/// the bundle of this entry of it.
#[derive(Debug)]
pub(crate) struct ScopeTag {
    pub(crate) path: Arc<str>,
    pub(crate) hash: u64,
    pub(crate) decision: ScopeDecision,
    pub(crate) bundle: Option<Arc<Bundle>>,
    /// The rule the bundle decision came from (`(depth, literals, index)`):
    /// a nested scope whose bundle comes from the same rule shares the
    /// enclosing entry's bundle.
    pub(crate) bundle_from: Option<(usize, usize, usize)>,
}

/// One entry of a bundled scope: the stream its compute tasks share.
#[derive(Debug)]
pub(crate) struct Bundle {
    /// `usize::MAX` until the first task is placed. Read and written under
    /// the runtime's lock only (relaxed: the lock orders the accesses).
    stream: AtomicUsize,
}

impl Default for Bundle {
    fn default() -> Self {
        Bundle {
            stream: AtomicUsize::new(usize::MAX),
        }
    }
}

impl Bundle {
    /// The bundle's stream, once its first task is placed.
    pub(crate) fn stream(&self) -> Option<usize> {
        let s = self.stream.load(Ordering::Relaxed);
        (s != usize::MAX).then_some(s)
    }

    /// Sets the bundle's stream (its first task's).
    pub(crate) fn set(&self, s: usize) {
        self.stream.store(s, Ordering::Relaxed);
    }
}

//! Named scopes: `let _s = rt.scope("forward/layer3");` tags every task the
//! thread submits to `rt` while the guard lives; scopes nest (the path is
//! the enclosing scopes' joined by `/`). A placement file
//! ([`PlacementFile`]) maps scope patterns to placement decisions, so the
//! schedule changes without touching the program (docs/scopes.md).
//!
//! Each thread keeps its own stack of open scopes (one per thread: tasks
//! are tagged with the scope of the thread that submits them). A scope's
//! decision is resolved from the file once per path and cached by the
//! runtime; a task carries its scope as one reference-counted tag.

mod file;
mod pattern;

pub use file::PlacementFile;

use crate::sched::cost::mix_bytes;
use crate::sched::scoped::{Bundle, ScopeDecision, ScopeTag};
use crate::sync::{lock, Mutex};
use file::Source;
use std::cell::RefCell;
use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::Arc;

thread_local! {
    /// The scopes open on this thread, innermost last, with their runtime.
    static OPEN: RefCell<Vec<(u64, Arc<ScopeTag>)>> = const { RefCell::new(Vec::new()) };
}

/// A runtime's scopes: its placement file and the decisions resolved so far.
#[derive(Debug)]
pub(crate) struct Scopes {
    runtime: u64,
    file: Option<Arc<PlacementFile>>,
    resolved: Mutex<HashMap<Arc<str>, Resolved>>,
}

/// What one scope path resolves to.
#[derive(Debug, Clone)]
struct Resolved {
    path: Arc<str>,
    hash: u64,
    decision: ScopeDecision,
    bundle: Option<Source>,
}

impl Scopes {
    pub(crate) fn new(runtime: u64, file: Option<Arc<PlacementFile>>) -> Self {
        Scopes {
            runtime,
            file,
            resolved: Mutex::new(HashMap::new()),
        }
    }

    pub(crate) fn file(&self) -> Option<&PlacementFile> {
        self.file.as_deref()
    }

    /// The innermost scope this thread has open on this runtime.
    pub(crate) fn current(&self) -> Option<Arc<ScopeTag>> {
        OPEN.try_with(|open| {
            open.borrow()
                .iter()
                .rev()
                .find(|(rt, _)| *rt == self.runtime)
                .map(|(_, t)| t.clone())
        })
        .ok()
        .flatten()
    }

    /// Opens scope `name` inside the current one.
    pub(crate) fn enter(&self, name: &str) -> Scope {
        let segs: Vec<&str> = name.split('/').filter(|s| !s.is_empty()).collect();
        let mut guard = Scope {
            runtime: self.runtime,
            tag: None,
            _not_send: PhantomData,
        };
        if segs.is_empty() {
            return guard;
        }
        let parent = self.current();
        let path: Arc<str> = match &parent {
            Some(p) => format!("{}/{}", p.path, segs.join("/")).into(),
            None => segs.join("/").into(),
        };
        let r = self.resolve(&path);
        // A bundled scope's entry is one bundle, shared with the scopes
        // nested in it whose bundle comes from the same rule.
        let bundle = r.bundle.map(|src| {
            parent
                .as_ref()
                .filter(|p| p.bundle_from == Some(src))
                .and_then(|p| p.bundle.clone())
                .unwrap_or_else(|| Arc::new(Bundle::default()))
        });
        let tag = Arc::new(ScopeTag {
            path: r.path,
            hash: r.hash,
            decision: r.decision,
            bundle,
            bundle_from: r.bundle,
        });
        let _ = OPEN.try_with(|open| open.borrow_mut().push((self.runtime, tag.clone())));
        guard.tag = Some(tag);
        guard
    }

    fn resolve(&self, path: &Arc<str>) -> Resolved {
        let mut cache = lock(&self.resolved);
        if let Some(r) = cache.get(path) {
            return r.clone();
        }
        let segs: Vec<&str> = path.split('/').collect();
        let (decision, bundle) = match &self.file {
            Some(f) => f.resolve(&segs),
            None => (ScopeDecision::default(), None),
        };
        let r = Resolved {
            path: path.clone(),
            hash: mix_bytes(0x5c09_e5c0_9e5c_09e5, path.as_bytes()),
            decision,
            bundle,
        };
        cache.insert(path.clone(), r.clone());
        r
    }
}

/// An open scope ([`crate::Runtime::scope`]): while it lives, every task
/// this thread submits to the runtime is tagged with its path. Dropping it
/// closes the scope (and any scope of the same runtime opened inside it
/// that is still open). It belongs to the thread that opened it (`!Send`).
#[must_use = "a scope lasts as long as its guard: `let _s = rt.scope(..)`"]
pub struct Scope {
    runtime: u64,
    tag: Option<Arc<ScopeTag>>,
    _not_send: PhantomData<*const ()>,
}

impl std::fmt::Debug for Scope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scope").field("path", &self.path()).finish()
    }
}

impl Scope {
    /// The scope's full path (`forward/layer3`); `None` for a scope opened
    /// with an empty name, which tags nothing.
    pub fn path(&self) -> Option<&str> {
        self.tag.as_ref().map(|t| &*t.path)
    }

    /// What the runtime's placement file decided for this scope.
    pub fn decision(&self) -> ScopeDecision {
        self.tag.as_ref().map(|t| t.decision).unwrap_or_default()
    }
}

impl Drop for Scope {
    fn drop(&mut self) {
        let Some(tag) = self.tag.take() else { return };
        let rt = self.runtime;
        let _ = OPEN.try_with(|open| {
            let mut open = open.borrow_mut();
            if let Some(i) = open
                .iter()
                .rposition(|(r, t)| *r == rt && Arc::ptr_eq(t, &tag))
            {
                let mut k = 0;
                open.retain(|(r, _)| {
                    k += 1;
                    k <= i || *r != rt
                });
            }
        });
    }
}

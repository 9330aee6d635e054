//! Chrome trace JSON (`chrome://tracing`, Perfetto): one process per rank,
//! one thread track per stream, each task a complete (`X`) event whose args
//! are its submission index, outcome, predecessors and placement decision
//! (`placed`: the rule, `usable_streams`: the compute streams the policy
//! could choose from, `priority`: the task's hint) and `bytes`, its largest
//! declared access (a collective's buffer size), and `scope`, the scope the
//! task was submitted in (absent outside any scope); the runtime's class and
//! busy periods ride along, and each dependency across streams is a flow
//! event, an arrow in the viewer (`event.rs`).

use super::Profile;
use crate::error::{Error, Result};
use serde_json::{json, Value};
use std::io::Write;
use std::path::Path;

/// Writes the profiles of one or more ranks as one Chrome trace, atomically
/// ([`crate::fs::write_atomic_with`]).
pub fn write_chrome_trace(path: impl AsRef<Path>, profiles: &[&Profile]) -> Result<()> {
    let path = path.as_ref();
    let mut events: Vec<Value> = Vec::new();
    let mut flows = 0;
    for p in profiles {
        super::event::metadata_events(p, &mut events);
        events.extend(p.spans.iter().map(|s| super::event::span_event(p.rank, s)));
        super::event::busy_events(p, &mut events);
        super::event::flow_events(p, &mut flows, &mut events);
    }
    let doc = json!({"traceEvents": events, "displayTimeUnit": "ms"});
    crate::fs::write_atomic_with(path, |tmp| {
        let write = || -> std::io::Result<()> {
            let mut f = std::io::BufWriter::new(std::fs::File::create_new(tmp)?);
            serde_json::to_writer(&mut f, &doc)?;
            f.flush()
        };
        write().map_err(|e| Error::io("writing trace", path, e))
    })
}

/// Keeps host-side spans (`tracing` spans of submission and synchronisation)
/// flowing into a Chrome trace file of their own until dropped.
pub struct HostTraceGuard {
    _guard: tracing_chrome::FlushGuard,
    _default: tracing::subscriber::DefaultGuard,
}

impl std::fmt::Debug for HostTraceGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("HostTraceGuard")
    }
}

impl HostTraceGuard {
    /// Records this thread's host spans (submission, synchronisation) into a
    /// Chrome trace at `path`, written when the guard drops.
    pub fn start(path: impl AsRef<Path>) -> Self {
        use tracing_subscriber::prelude::*;
        let (layer, guard) = tracing_chrome::ChromeLayerBuilder::new()
            .file(path.as_ref())
            .include_args(true)
            .build();
        let sub = tracing_subscriber::registry().with(layer);
        let default = tracing::subscriber::set_default(sub);
        HostTraceGuard {
            _guard: guard,
            _default: default,
        }
    }
}

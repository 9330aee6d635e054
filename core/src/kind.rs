//! What a task is: its kind and its scheduling hint. A leaf module: placement,
//! the scheduler and the trace all read these, and they depend on nothing.

/// What a task does; decides which streams it may run on and how the trace
/// summary accounts for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum TaskKind {
    /// A kernel or other computation (compute streams).
    #[default]
    Compute,
    /// A collective or other communication (communication streams).
    Comm,
    /// A memory copy.
    Copy,
    /// Work done by the host on a stream's behalf (uploads, read-backs).
    Host,
}

impl TaskKind {
    /// The kind's name in traces.
    pub fn name(self) -> &'static str {
        match self {
            TaskKind::Compute => "compute",
            TaskKind::Comm => "comm",
            TaskKind::Copy => "copy",
            TaskKind::Host => "host",
        }
    }
}

/// A scheduling hint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Priority {
    /// On the critical path (the default).
    #[default]
    Main,
    /// Off the critical path: placement keeps it away from the main chain's
    /// stream so it runs beside it (e.g. weight gradients in backward).
    Side,
    /// Communication (comm streams run at the highest device priority).
    Comm,
}

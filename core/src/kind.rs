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
    /// Every kind.
    pub const ALL: [TaskKind; 4] = [
        TaskKind::Compute,
        TaskKind::Comm,
        TaskKind::Copy,
        TaskKind::Host,
    ];

    /// The kind a trace names (the inverse of [`TaskKind::name`]).
    pub fn from_name(name: &str) -> Option<TaskKind> {
        Self::ALL.into_iter().find(|k| k.name() == name)
    }

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

impl Priority {
    /// Every hint.
    pub const ALL: [Priority; 3] = [Priority::Main, Priority::Side, Priority::Comm];

    /// The hint a trace names (the inverse of [`Priority::name`]).
    pub fn from_name(name: &str) -> Option<Priority> {
        Self::ALL.into_iter().find(|p| p.name() == name)
    }

    /// The hint's name in traces.
    pub fn name(self) -> &'static str {
        match self {
            Priority::Main => "main",
            Priority::Side => "side",
            Priority::Comm => "comm",
        }
    }
}

/// A program's priority class, for programs sharing one node (several
/// runtimes of a process; see `RuntimeBuilder::class` and docs/tenants.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Class {
    /// Serving with a latency objective: while it has unfinished tasks,
    /// best-effort stream threads start no new task.
    LatencyCritical,
    /// The default: what every runtime was before classes existed.
    #[default]
    Normal,
    /// Throughput work that yields: its tasks start only while no
    /// latency-critical task is unfinished, and on the CPU its stream
    /// threads run at the operating system's idle priority.
    BestEffort,
}

impl Class {
    /// Every class.
    pub const ALL: [Class; 3] = [Class::LatencyCritical, Class::Normal, Class::BestEffort];

    /// The class's name (`latency-critical`, `normal`, `best-effort`).
    pub fn name(self) -> &'static str {
        match self {
            Class::LatencyCritical => "latency-critical",
            Class::Normal => "normal",
            Class::BestEffort => "best-effort",
        }
    }

    /// The class a name gives (the inverse of [`Class::name`]).
    pub fn from_name(name: &str) -> Option<Class> {
        Self::ALL.into_iter().find(|c| c.name() == name)
    }
}

/// Why a task went to its stream: the rule the placement policy applied.
/// Recorded with each task ([`crate::trace::Span::placement`]) and written as
/// the `placed` argument of its Chrome-trace event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PlaceReason {
    /// The task named its stream (`TaskBuilder::on_stream`); no policy ran.
    Pinned,
    /// `Affinity`: it continues the stream of its latest unfinished
    /// predecessor, still that stream's last task (no cross-stream wait).
    Chain,
    /// `Affinity`: the least-loaded usable compute stream.
    LeastLoaded,
    /// `Affinity`, once the task's name has a measured duration: the usable
    /// compute stream where it would finish first, counting a hand-off for
    /// each predecessor on another stream and a wake-up for an idle stream.
    EarliestFinish,
    /// `Affinity`, `Priority::Side`: the least-loaded usable compute stream
    /// other than its predecessor's (the only one when one is usable).
    Side,
    /// A communication task: the communication stream its index picks.
    Comm,
    /// `Single`: everything on stream 0.
    Single,
    /// `RoundRobin`: the next compute stream in turn.
    RoundRobin,
    /// A task of a recorded schedule's replay: the stream its plan gives it
    /// (the recording's placement, or the cost model's re-placement).
    Replayed,
    /// A task of an automatically memoised step: the stream the recorded
    /// step's analysis gave it.
    Memoised,
    /// The placement file's `stream` for the task's scope (docs/scopes.md).
    Scoped,
    /// A bundled scope: the stream its entry's first task went to.
    Bundled,
}

impl PlaceReason {
    /// Every rule.
    pub const ALL: [PlaceReason; 10] = [
        PlaceReason::Pinned,
        PlaceReason::Chain,
        PlaceReason::LeastLoaded,
        PlaceReason::EarliestFinish,
        PlaceReason::Side,
        PlaceReason::Comm,
        PlaceReason::Single,
        PlaceReason::RoundRobin,
        PlaceReason::Replayed,
        PlaceReason::Memoised,
    ];

    /// The rule a trace names (the inverse of [`PlaceReason::name`]).
    pub fn from_name(name: &str) -> Option<PlaceReason> {
        Self::ALL.into_iter().find(|r| r.name() == name)
    }

    /// The reason's name in traces.
    pub fn name(self) -> &'static str {
        match self {
            PlaceReason::Pinned => "pinned",
            PlaceReason::Chain => "chain",
            PlaceReason::LeastLoaded => "least-loaded",
            PlaceReason::EarliestFinish => "earliest-finish",
            PlaceReason::Side => "side",
            PlaceReason::Comm => "comm",
            PlaceReason::Single => "single",
            PlaceReason::RoundRobin => "round-robin",
            PlaceReason::Replayed => "replayed",
            PlaceReason::Memoised => "memoised",
            PlaceReason::Scoped => "scope",
            PlaceReason::Bundled => "bundle",
        }
    }
}

/// A placement decision: why the task went where it went, how many compute
/// streams the policy could use at that moment, and the task's priority hint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Placement {
    /// The rule applied.
    pub reason: PlaceReason,
    /// Compute streams the policy could choose from when it placed the task:
    /// under `Affinity` on the CPU, this runtime's share of the process's core
    /// budget (see `RuntimeBuilder::cpu_cores`); otherwise every compute
    /// stream (1 under `Single`).
    pub usable: u16,
    /// The task's scheduling hint.
    pub priority: Priority,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for k in TaskKind::ALL {
            assert_eq!(TaskKind::from_name(k.name()), Some(k));
        }
        for p in Priority::ALL {
            assert_eq!(Priority::from_name(p.name()), Some(p));
        }
        for r in PlaceReason::ALL {
            assert_eq!(PlaceReason::from_name(r.name()), Some(r));
        }
        for c in Class::ALL {
            assert_eq!(Class::from_name(c.name()), Some(c));
        }
        assert_eq!(TaskKind::from_name("kernel"), None);
    }
}

//! What a task is: its kind and its scheduling hint. A leaf module: placement,
//! the scheduler and the trace all read these, and they depend on nothing.

/// `ALL`, `name` and `from_name` of a field-less enum, from one list of its
/// variants and their names in traces. `name` matches every listed variant,
/// so a variant left out of the list fails to compile instead of going
/// missing from `ALL` (as `scope` and `bundle` once did from
/// `PlaceReason::ALL`, and `braid top` counted such tasks as pinned).
macro_rules! named {
    ($t:ident, $what:literal, $($v:ident => $n:literal),+ $(,)?) => {
        impl $t {
            #[doc = concat!("Every ", $what, ".")]
            pub const ALL: [$t; [$(stringify!($v)),+].len()] = [$($t::$v),+];

            #[doc = concat!("The ", $what, " a trace names (the inverse of [`", stringify!($t), "::name`]).")]
            pub fn from_name(name: &str) -> Option<$t> {
                Self::ALL.into_iter().find(|x| x.name() == name)
            }

            #[doc = concat!("The ", $what, "'s name in traces.")]
            pub fn name(self) -> &'static str {
                match self {
                    $($t::$v => $n),+
                }
            }
        }
    };
}

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

named!(TaskKind, "kind", Compute => "compute", Comm => "comm", Copy => "copy", Host => "host");

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

named!(Priority, "hint", Main => "main", Side => "side", Comm => "comm");

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

named!(
    Class,
    "class",
    LatencyCritical => "latency-critical",
    Normal => "normal",
    BestEffort => "best-effort",
);

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

named!(
    PlaceReason,
    "rule",
    Pinned => "pinned",
    Chain => "chain",
    LeastLoaded => "least-loaded",
    EarliestFinish => "earliest-finish",
    Side => "side",
    Comm => "comm",
    Single => "single",
    RoundRobin => "round-robin",
    Replayed => "replayed",
    Memoised => "memoised",
    Scoped => "scope",
    Bundled => "bundle",
);

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

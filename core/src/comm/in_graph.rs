//! Collectives captured into CUDA graphs
//! ([`crate::RuntimeBuilder::graph_collectives`]).
//!
//! A collective's body does host work each time it runs: it takes the
//! communicator's next index, fails fast on a poisoned communicator, and
//! (NCCL) hands its end event to the watchdog and registers a completion
//! check. Inside a graph the body runs once, at the capture, and the graph
//! then runs many times without it. So the captured body enqueues the
//! collective and registers a launch hook instead ([`InGraph`]), and the
//! graph's launch does that host work for every collective in it
//! (`sched::capture::CudaStep::launch`), in capture order, on the stream the
//! graph launches on: the collectives' own stream (`sched::split`), so
//! indices are still taken in program order on every rank.

use super::{Collective, Communicator, DeviceData, Job};
use crate::access::DevBytes;
use crate::backend::gpu::{CudaTaskCtx, GraphLaunch};
use crate::error::{Result, TaskError};
use crate::sync::{Arc, Ordering};

/// A collective captured into a CUDA graph
/// ([`Communicator::capture_cuda`]): what its communicator does on the host
/// at each launch of the graph.
pub trait CapturedCollective: Send + Sync {
    /// Before each launch of the graph, the collective numbered `index`
    /// this time: an error refuses the launch (and poisons the
    /// communicator), as [`Communicator::run_cuda`] would refuse to
    /// enqueue (a communicator the backend has aborted). Default: `Ok`.
    fn check(&self, index: u64) -> Result<()> {
        let _ = index;
        Ok(())
    }

    /// The graph holding the collective has been launched on `cu`'s stream,
    /// the collective numbered `index` this time: watch it as
    /// [`Communicator::run_cuda`] would, reporting a failure found once the
    /// work has completed through [`CudaTaskCtx::on_complete`].
    fn launched(&self, index: u64, cu: &CudaTaskCtx<'_>) -> Result<()>;
}

/// A captured collective, as its graph's launch hook.
struct InGraph {
    job: Arc<Job>,
    captured: Box<dyn CapturedCollective>,
}

impl GraphLaunch for InGraph {
    /// Takes the collective's index for this launch, as its body would,
    /// and asks the backend whether it may run.
    fn before(&self) -> Result<u64> {
        let index = self.job.take_index()?;
        self.captured
            .check(index)
            .map_err(|e| self.job.fail(index, e))?;
        Ok(index)
    }

    fn after(&self, index: u64, cu: &CudaTaskCtx<'_>) -> Result<()> {
        self.captured
            .launched(index, cu)
            .map_err(|e| self.job.fail(index, e))
    }

    fn skipped(&self, why: &crate::Error) {
        self.job.skipped(why);
    }

    /// The launch failed: the collective fails with the index it took.
    fn not_launched(&self, index: u64, e: &crate::Error) {
        self.job.fail(index, e.clone());
    }
}

impl Job {
    /// The CUDA body while its stream is captured into a graph: enqueues the
    /// collective into the graph and registers its launch hook. No index is
    /// taken (nothing runs now; each launch takes one), and a communicator
    /// that refuses the capture is not poisoned: the schedule's graphs are
    /// then cut around its collectives, which run as ordinary tasks.
    /// (An associated function: under loom `Arc` is loom's, which cannot
    /// be a method's receiver.)
    pub(super) fn capture(
        job: &Arc<Self>,
        data: Vec<DevBytes<'_>>,
        cu: &CudaTaskCtx<'_>,
    ) -> std::result::Result<(), TaskError> {
        let index = job.inner.ran.load(Ordering::Acquire);
        job.check_poison(index)?;
        let op = Collective {
            index,
            ..job.op.clone()
        };
        let imp: &dyn Communicator = &*job.inner.imp;
        let captured = imp.capture_cuda(&op, DeviceData::from_parts(data)?, cu)?;
        let hook = InGraph {
            job: job.clone(),
            captured,
        };
        cu.on_graph_launch(std::sync::Arc::new(hook))?;
        Ok(())
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::comm::{Buffers, CollectiveKind, Comm, DType};
    use crate::sync::AtomicBool;

    /// A communicator of one rank that notes whether it was aborted.
    #[derive(Debug, Default)]
    struct Noting {
        aborted: std::sync::Arc<std::sync::Mutex<Option<String>>>,
    }

    impl Communicator for Noting {
        fn rank(&self) -> usize {
            0
        }
        fn world_size(&self) -> usize {
            1
        }
        fn backend(&self) -> &'static str {
            "noting"
        }
        fn abort(&self, reason: &str) {
            *self.aborted.lock().unwrap() = Some(reason.to_string());
        }
    }

    /// A captured collective whose backend refuses launches once `refuses`.
    #[derive(Default)]
    struct Nothing {
        refuses: std::sync::Arc<std::sync::atomic::AtomicBool>,
    }
    impl CapturedCollective for Nothing {
        fn check(&self, index: u64) -> Result<()> {
            match self.refuses.load(std::sync::atomic::Ordering::Relaxed) {
                true => Err(crate::Error::Config(format!("#{index} refused"))),
                false => Ok(()),
            }
        }
        fn launched(&self, _: u64, _: &CudaTaskCtx<'_>) -> Result<()> {
            Ok(())
        }
    }

    /// A barrier of `comm` as a captured collective's launch hook.
    fn hook(comm: &Comm) -> InGraph {
        hook_of(comm, Nothing::default())
    }

    fn hook_of(comm: &Comm, captured: Nothing) -> InGraph {
        let op = Collective {
            index: 0,
            kind: CollectiveKind::Barrier,
            dtype: DType::F32,
            count: 0,
            buffers: Buffers::None,
        };
        let job = Job {
            inner: comm.inner.clone(),
            what: op.describe(),
            op,
            settled: AtomicBool::new(true),
        };
        InGraph {
            job: Arc::new(job),
            captured: Box::new(captured),
        }
    }

    /// Each launch takes the next index, as an eager collective would; a
    /// poisoned communicator fails the launch naming the poison; a skipped
    /// launch takes its index and poisons the communicator (aborting it, so
    /// the other ranks fail instead of waiting).
    #[test]
    fn launches_take_indices_and_skips_poison() {
        let imp = Noting::default();
        let aborted = imp.aborted.clone();
        let comm = Comm::new(imp);
        let (a, b) = (hook(&comm), hook(&comm));
        assert_eq!([a.before().unwrap(), b.before().unwrap()], [0, 1]);
        assert_eq!(a.before().unwrap(), 2);
        assert!(comm.poisoned().is_none() && aborted.lock().unwrap().is_none());
        b.skipped(&crate::Error::DependencyFailed {
            task: "graph".into(),
            cause: "bad".into(),
            root: Some(Box::new(crate::Error::TaskFailed {
                task: "bad".into(),
                message: "disk on fire".into(),
            })),
        });
        let why = aborted.lock().unwrap().clone().expect("aborted");
        assert!(
            why.contains("skipped on this rank because `bad`") && why.contains("disk on fire"),
            "{why}"
        );
        let e = a.before().unwrap_err().to_string();
        assert!(e.contains("poisoned") && e.contains("skipped"), "{e}");
        // The skip took index 3, the refused launch index 4.
        assert_eq!(comm.inner.ran.load(Ordering::Acquire), 5);
    }

    /// A launch the backend refuses (`CapturedCollective::check`: an NCCL
    /// communicator its watchdog aborted) fails with its index and poisons
    /// the communicator; a launch that fails after `before` fails the
    /// collective with the index it took, and takes no other.
    #[test]
    fn refused_and_failed_launches_poison_with_their_own_index() {
        let comm = Comm::new(Noting::default());
        let refusing = Nothing::default();
        let refuses = refusing.refuses.clone();
        let h = hook_of(&comm, refusing);
        assert_eq!(h.before().unwrap(), 0);
        refuses.store(true, std::sync::atomic::Ordering::Relaxed);
        let e = h.before().unwrap_err().to_string();
        assert!(e.contains("#1 refused"), "{e}");
        assert!(comm.poisoned().is_some());
        assert_eq!(comm.inner.ran.load(Ordering::Acquire), 2);

        let comm = Comm::new(Noting::default());
        let h = hook(&comm);
        let index = h.before().unwrap();
        h.not_launched(index, &crate::Error::Config("the launch fails".into()));
        let poison = comm.poisoned().expect("poisoned").to_string();
        assert!(poison.contains("the launch fails"), "{poison}");
        assert_eq!(comm.inner.ran.load(Ordering::Acquire), 1, "no second index");
    }
}

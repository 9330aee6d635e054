//! How the ranks are launched: the device a run uses, each rank's runtime,
//! and the three ways of starting ranks — CPU ranks as threads of this
//! process ([`train_cpu`]), one thread per GPU in one process with NCCL
//! communicators made together ([`train_gpus`]), and one process per GPU
//! under torchrun joining braid's rendezvous ([`train_torchrun`]) — with the
//! root cause picked out of the ranks' errors.

use std::fmt;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use braid::comm::NcclCommunicator;
use braid::{BackendKind, Class, Comm, LocalCommConfig, Policy, Runtime};

use super::rank::{run_rank, RankOutcome, RunShared};
use super::{DistEnv, StartState, StepReport, TrainOptions};
use crate::data::TokenSource;
use crate::error::{Gpt2Error, Result};
use crate::model::runs_on;

/// What `auto` means for the model: the device the engine picks (the first
/// GPU when the driver reports one, as `BackendKind::Auto` does) when the
/// model's kernels run there ([`runs_on`]), the CPU otherwise. Other kinds
/// are returned as they are. Decided without building a runtime: a probe
/// runtime read `BRAID_PLACEMENT` and `BRAID_LIVE` like any other, so it
/// refused placement files naming the trainer's second stream and served
/// the live view's socket before the trainer did.
pub fn resolve_backend(kind: BackendKind) -> Result<BackendKind> {
    Ok(match kind {
        BackendKind::Auto => match braid::cuda::cuda_available() {
            Ok(n) if n > 0 && runs_on("cuda") => BackendKind::Cuda { device: 0 },
            _ => BackendKind::Cpu,
        },
        other => other,
    })
}

/// The device a training run with `opts` uses. `auto` means the GPUs when the
/// job fits them — under torchrun (one GPU per process), or when this machine
/// has at least `opts.ranks` devices — and CPU ranks otherwise (so `auto`
/// with 2 ranks on a one-GPU machine trains on 2 CPU ranks). Other kinds are
/// returned as they are.
pub fn resolve_train_backend(opts: &TrainOptions) -> Result<BackendKind> {
    let kind = resolve_backend(opts.backend)?;
    if opts.backend != BackendKind::Auto || kind == BackendKind::Cpu {
        return Ok(kind);
    }
    if DistEnv::launched()?.is_some() || opts.ranks <= 1 {
        return Ok(kind);
    }
    Ok(match braid::cuda::cuda_available() {
        Ok(n) if n >= opts.ranks => kind,
        _ => BackendKind::Cpu,
    })
}

/// Builds a runtime for the model on `backend`, failing with a clear error
/// when the device is missing or the model's kernels do not run on it. On a
/// GPU the model's CUDA kernels are compiled (NVRTC, cached on disk) and
/// loaded now, so that a missing NVRTC or a compile error is reported here
/// and no step pays for it.
pub fn model_runtime(
    backend: BackendKind,
    streams: usize,
    policy: Policy,
    rank: usize,
) -> Result<Runtime> {
    model_runtime_with(
        backend,
        streams,
        policy,
        rank,
        &RuntimeExtras::default(),
        None,
    )
}

/// A trainer rank's runtime settings beyond streams and policy.
#[derive(Debug, Clone, Copy, Default)]
struct RuntimeExtras {
    /// CPU: every compute stream whatever the process's core budget.
    oversubscribe: bool,
    /// Pin the stream threads (`RuntimeBuilder::pin_threads`).
    pin_threads: bool,
    /// `None`: the placement file's, else normal.
    class: Option<Class>,
    /// SMs left to other programs (`RuntimeBuilder::spare_sms`).
    spare_sms: u32,
    /// A best-effort CUDA stream's launch window
    /// (`RuntimeBuilder::device_bundle`; `None`: the builder's).
    device_bundle: Option<std::time::Duration>,
    graphs: bool,
    graph_collectives: bool,
    /// Automatic replay on or off (`None`: the builder's default, on).
    auto_replay: Option<bool>,
}

/// [`model_runtime`], with `extras` and a placement file (`None`: the one
/// `BRAID_PLACEMENT` names, if any).
fn model_runtime_with(
    backend: BackendKind,
    streams: usize,
    policy: Policy,
    rank: usize,
    extras: &RuntimeExtras,
    placement: Option<&braid::PlacementFile>,
) -> Result<Runtime> {
    let mut builder = Runtime::builder()
        .backend(resolve_backend(backend)?)
        .compute_streams(streams)
        .comm_streams(1)
        .policy(policy)
        .oversubscribe(extras.oversubscribe)
        .pin_threads(extras.pin_threads)
        .spare_sms(extras.spare_sms)
        .graphs(extras.graphs)
        .graph_collectives(extras.graph_collectives)
        .rank(rank)
        .profile(true);
    // Set only when asked for: a class set in code wins over the placement
    // file's.
    if let Some(class) = extras.class {
        builder = builder.class(class);
    }
    if let Some(on) = extras.auto_replay {
        builder = builder.auto_replay(on);
    }
    if let Some(window) = extras.device_bundle {
        builder = builder.device_bundle(window);
    }
    if let Some(f) = placement {
        builder = builder.placement(f.clone());
    }
    let rt = builder.build()?;
    if !runs_on(rt.backend_name()) {
        return Err(Gpt2Error::InvalidSetting {
            what: "device",
            reason: format!(
                "the GPT-2 kernels are wired into the model's tasks for {:?}, not for `{}`",
                crate::model::KERNEL_BACKENDS,
                rt.backend_name()
            ),
        });
    }
    if let Some(dev) = rt.cuda_device() {
        crate::kernels::preload(dev)?;
    }
    Ok(rt)
}

/// Builds a rank's runtime.
fn build_runtime(opts: &TrainOptions, backend: BackendKind, rank: usize) -> Result<Runtime> {
    let extras = RuntimeExtras {
        oversubscribe: opts.oversubscribe,
        // Several CPU ranks are threads of this process sharing its cores.
        pin_threads: opts
            .pin_threads
            .unwrap_or(backend == BackendKind::Cpu && opts.ranks > 1),
        class: opts.class,
        spare_sms: opts.spare_sms,
        device_bundle: opts.device_bundle,
        graphs: opts.graphs,
        graph_collectives: opts.graph_collectives,
        // `replay` off means every step eager: not memoised either.
        auto_replay: (!opts.replay).then_some(false),
    };
    model_runtime_with(
        backend,
        opts.streams,
        opts.policy,
        rank,
        &extras,
        opts.placement.as_ref(),
    )
}

/// Where rank `rank` of a torchrun job writes its trace when rank 0 writes
/// `path`: `path` itself for rank 0, `trace.rank3.json` for rank 3 of
/// `trace.json`.
pub fn rank_trace_path(path: &std::path::Path, rank: usize) -> PathBuf {
    if rank == 0 {
        return path.to_path_buf();
    }
    let stem = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "trace".into());
    let name = match path.extension() {
        Some(ext) => format!("{stem}.rank{rank}.{}", ext.to_string_lossy()),
        None => format!("{stem}.rank{rank}"),
    };
    path.with_file_name(name)
}

/// Whether an error is only a consequence of another rank's failure: a
/// collective that failed, a task skipped because of one, or several such
/// failures reported together.
fn is_secondary(e: &Gpt2Error) -> bool {
    fn secondary(e: &braid::Error) -> bool {
        match e {
            braid::Error::Collective { .. } => true,
            // Skipped: as secondary as the failure it was skipped for.
            braid::Error::DependencyFailed { root, .. } => root.as_deref().is_none_or(secondary),
            braid::Error::Many(all) => all.iter().all(secondary),
            _ => false,
        }
    }
    matches!(e, Gpt2Error::Engine(e) if secondary(e))
}

/// The ranks' own errors, kept apart from what the launcher makes of them.
#[derive(Default)]
struct Failures(Mutex<Vec<(usize, Gpt2Error)>>);

impl Failures {
    /// Records the error of rank `rank`.
    fn push(&self, rank: usize, e: Gpt2Error) {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((rank, e));
    }

    /// The root cause among the recorded errors, if any: the first that is
    /// not a consequence of another rank's failure.
    fn take_root_cause(&self) -> Option<Gpt2Error> {
        let mut failures = std::mem::take(&mut *self.0.lock().unwrap_or_else(|p| p.into_inner()));
        if failures.is_empty() {
            return None;
        }
        let i = failures
            .iter()
            .position(|(_, e)| !is_secondary(e))
            .unwrap_or(0);
        Some(failures.swap_remove(i).1)
    }
}

/// The engine's error for a rank that failed with `message`.
fn rank_failed(rank: usize, message: String) -> braid::Error {
    braid::Error::TaskFailed {
        task: format!("rank {rank}"),
        message,
    }
}

/// Aborts every communicator of this process's ranks, so that no rank waits
/// for the collectives of one that `why` stopped.
fn abort_all(comms: &[Comm], why: &str) {
    for c in comms {
        c.abort(why);
    }
}

/// CPU ranks: threads of this process, watched rather than joined
/// ([`braid::comm::spawn_ranks`]): a rank stuck in a task that never returns
/// is abandoned once the job has failed (the others' collectives time out,
/// naming the collective) and a collective timeout has passed, instead of
/// hanging the trainer. Rank 0's step reports reach `on_step` on the calling
/// thread.
pub(super) fn train_cpu(
    opts: &TrainOptions,
    start: &StartState,
    data: &TokenSource,
    on_step: &(dyn Fn(&StepReport) + Sync),
    shared: &Arc<RunShared>,
) -> Result<Vec<RankOutcome>> {
    let world = opts.ranks;
    let failures = Arc::new(Failures::default());
    // Rank 0 hands each step's report to this thread, which calls
    // `on_step`, and waits until the call has returned: the calls come in
    // order, each before rank 0 goes on (a stop flag set in one stops that
    // step).
    type Handed = (StepReport, std::sync::mpsc::SyncSender<()>);
    let (steps, reports) = std::sync::mpsc::channel::<Handed>();
    let mut ranks = {
        let (opts, start, data) = (opts.clone(), start.clone(), data.clone());
        let (failures, shared) = (failures.clone(), shared.clone());
        braid::comm::spawn_ranks(
            world,
            LocalCommConfig::default().timeout(opts.comm_timeout),
            opts.comm_timeout,
            move |rank, comm| {
                let report = |r: &StepReport| {
                    let (done, called) = std::sync::mpsc::sync_channel(1);
                    if steps.send((r.clone(), done)).is_ok() {
                        // An error: the caller no longer listens.
                        let _ = called.recv();
                    }
                };
                build_runtime(&opts, BackendKind::Cpu, rank)
                    .and_then(|rt| {
                        // The rank's own thread submits and waits: it yields
                        // like the stream threads of its runtime's class (the
                        // options', or the placement file's).
                        rt.class().enter();
                        run_rank(
                            &opts,
                            rt,
                            rank,
                            world,
                            Some(comm),
                            &start,
                            &data,
                            &report,
                            &shared,
                        )
                    })
                    .map_err(|e| {
                        let message = e.to_string();
                        failures.push(rank, e);
                        rank_failed(rank, message)
                    })
            },
        )
    };
    let mut panicked = None;
    let results = loop {
        use std::sync::mpsc::RecvTimeoutError;
        match reports.recv_timeout(Duration::from_millis(20)) {
            Ok((r, done)) => {
                if panicked.is_none() {
                    let call = std::panic::AssertUnwindSafe(|| on_step(&r));
                    if let Err(p) = std::panic::catch_unwind(call) {
                        // The ranks stop at a step's end (and save what a
                        // stopped run saves) before the panic goes on: none
                        // trains on behind the caller's back.
                        shared.halt();
                        panicked = Some(p);
                    }
                }
                let _ = done.send(());
            }
            Err(RecvTimeoutError::Timeout) => {}
            // Every rank has finished: nothing more will come.
            Err(RecvTimeoutError::Disconnected) => {
                if let Some(results) = ranks.poll(Duration::from_millis(20)) {
                    break results;
                }
                continue;
            }
        }
        if let Some(results) = ranks.poll(Duration::ZERO) {
            break results;
        }
    };
    if let Some(p) = panicked {
        std::panic::resume_unwind(p);
    }
    if let Some(e) = failures.take_root_cause() {
        return Err(e);
    }
    results
        .into_iter()
        .map(|r| r.map_err(Gpt2Error::from))
        .collect()
}

/// An NCCL failure while setting up GPU ranks, as the engine's collective
/// error.
fn nccl_setup_error(rank: usize, e: impl fmt::Display) -> Gpt2Error {
    Gpt2Error::Engine(braid::Error::Collective {
        rank,
        index: 0,
        op: "init".into(),
        message: e.to_string(),
    })
}

/// NCCL communicators made together (`ncclCommInitAll`) over the devices
/// of `rts`, one rank each in order: several GPU ranks of this process, or
/// one for the reducer at world size 1 (`TrainOptions::reduce_single_rank`).
fn local_comms(rts: &[&Runtime], timeout: Duration) -> Result<Vec<Comm>> {
    let devices: Vec<braid::cuda::CudaDevice> = rts
        .iter()
        .map(|rt| {
            rt.cuda_device()
                .cloned()
                .expect("a CUDA runtime has a device")
        })
        .collect();
    let comms =
        braid::comm::nccl::NcclComm::init_all(&devices).map_err(|e| nccl_setup_error(0, e))?;
    let comms = comms
        .into_iter()
        .map(|c| NcclCommunicator::new(c, timeout).map(Comm::new));
    Ok(comms.collect::<braid::Result<Vec<Comm>>>()?)
}

/// The one-rank communicator of [`local_comms`] on `rt`'s device.
fn one_rank_comm(rt: &Runtime, timeout: Duration) -> Result<Comm> {
    let mut comms = local_comms(&[rt], timeout)?;
    Ok(comms.pop().expect("one communicator per device"))
}

/// GPU ranks of this process: `opts.ranks` devices from `first`, one thread
/// and one runtime per device, NCCL communicators between them.
pub(super) fn train_gpus(
    opts: &TrainOptions,
    first: usize,
    start: &StartState,
    data: &TokenSource,
    on_step: &(dyn Fn(&StepReport) + Sync),
    shared: &RunShared,
) -> Result<Vec<RankOutcome>> {
    let world = opts.ranks;
    // Rank 0's runtime first: a missing driver or device is reported as the
    // engine finds it.
    let rt0 = build_runtime(opts, BackendKind::Cuda { device: first }, 0)?;
    // One GPU needs no communicator, unless the reducer runs at one rank
    // (`reduce_single_rank`): then NCCL with one rank.
    if world == 1 {
        let comm = match opts.reduce_single_rank {
            true => Some(one_rank_comm(&rt0, opts.comm_timeout)?),
            false => None,
        };
        return Ok(vec![run_rank(
            opts, rt0, 0, 1, comm, start, data, on_step, shared,
        )?]);
    }
    let count = braid::cuda::cuda_available().map_err(braid::Error::from)?;
    if first + world > count {
        return Err(Gpt2Error::InvalidSetting {
            what: "number of ranks",
            reason: format!(
                "{world} GPU ranks from cuda:{first} need devices {first}..={}, but this \
                 machine has {count} CUDA device(s); pass --ranks {} or fewer, or train on \
                 CPU ranks (--device cpu)",
                first + world - 1,
                count.saturating_sub(first).max(1)
            ),
        });
    }
    let mut rts = vec![rt0];
    for rank in 1..world {
        rts.push(build_runtime(
            opts,
            BackendKind::Cuda {
                device: first + rank,
            },
            rank,
        )?);
    }
    let comms = local_comms(&rts.iter().collect::<Vec<_>>(), opts.comm_timeout)?;
    let failures = Failures::default();
    let outcomes: Vec<Option<RankOutcome>> = std::thread::scope(|s| {
        let handles: Vec<_> = rts
            .into_iter()
            .zip(comms.iter().cloned())
            .enumerate()
            .map(|(rank, (rt, comm))| {
                let (comms, failures) = (&comms, &failures);
                let spawned = std::thread::Builder::new()
                    .name(format!("braid-gpt2 rank {rank}"))
                    .spawn_scoped(s, move || {
                        let run = std::panic::AssertUnwindSafe(|| {
                            run_rank(
                                opts,
                                rt,
                                rank,
                                world,
                                Some(comm),
                                start,
                                data,
                                on_step,
                                shared,
                            )
                        });
                        let result = std::panic::catch_unwind(run).unwrap_or_else(|p| {
                            let what = p
                                .downcast_ref::<&str>()
                                .map(|s| s.to_string())
                                .or_else(|| p.downcast_ref::<String>().cloned())
                                .unwrap_or_else(|| "a panic".into());
                            Err(Gpt2Error::Engine(rank_failed(
                                rank,
                                format!("panicked: {what}"),
                            )))
                        });
                        match result {
                            Ok(o) => Some(o),
                            Err(e) => {
                                // The other ranks would wait for this one's
                                // collectives: abort them all now.
                                abort_all(comms, &format!("rank {rank} failed: {e}"));
                                failures.push(rank, e);
                                None
                            }
                        }
                    });
                if let Err(e) = &spawned {
                    abort_all(
                        comms,
                        &format!("the thread of rank {rank} could not be started: {e}"),
                    );
                }
                spawned
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.ok().and_then(|h| h.join().ok().flatten()))
            .collect()
    });
    if let Some(e) = failures.take_root_cause() {
        return Err(e);
    }
    outcomes
        .into_iter()
        .enumerate()
        .map(|(rank, o)| {
            o.ok_or_else(|| {
                Gpt2Error::Engine(rank_failed(rank, "its thread could not be started".into()))
            })
        })
        .collect()
}

/// Overrides the port of braid's own TCP rendezvous in a torchrun job.
pub const RENDEZVOUS_PORT_VAR: &str = "BRAID_MASTER_PORT";

/// The port of braid's TCP rendezvous (which hands the NCCL unique id from
/// rank 0 to the others) in a torchrun job whose `MASTER_PORT` is
/// `master_port`, reading variables through `get`:
///
/// * `BRAID_MASTER_PORT` when it is set;
/// * `MASTER_PORT + 1` when `TORCHELASTIC_USE_AGENT_STORE=True`: torchrun's
///   agent then serves its own store on `MASTER_PORT` (PyTorch's default
///   since the rendezvous store is shared; `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`
///   turns that off), so rank 0 could not listen there;
/// * `MASTER_PORT` otherwise.
///
/// Every rank sees the same variables, so every rank picks the same port.
pub fn rendezvous_port(master_port: u16, get: impl Fn(&str) -> Option<String>) -> Result<u16> {
    if let Some(v) = get(RENDEZVOUS_PORT_VAR).filter(|v| !v.trim().is_empty()) {
        return match v.trim().parse::<u16>() {
            Ok(p) if p != 0 => Ok(p),
            _ => Err(Gpt2Error::InvalidSetting {
                what: "distributed environment",
                reason: format!("{RENDEZVOUS_PORT_VAR}={v:?} is not a port"),
            }),
        };
    }
    let agent_store = get("TORCHELASTIC_USE_AGENT_STORE")
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("true") || v.trim() == "1");
    if agent_store {
        return master_port.checked_add(1).ok_or(Gpt2Error::InvalidSetting {
            what: "distributed environment",
            reason: format!(
                "MASTER_PORT={master_port} is torchrun's store; set {RENDEZVOUS_PORT_VAR} to a \
                 free port for braid's rendezvous"
            ),
        });
    }
    Ok(master_port)
}

/// This process's rank of a torchrun job: device `LOCAL_RANK`, NCCL through
/// the rendezvous at `MASTER_ADDR:MASTER_PORT`.
pub(super) fn train_torchrun(
    opts: &TrainOptions,
    env: &DistEnv,
    start: &StartState,
    data: &TokenSource,
    on_step: &(dyn Fn(&StepReport) + Sync),
    shared: &RunShared,
) -> Result<RankOutcome> {
    let rt = build_runtime(
        opts,
        BackendKind::Cuda {
            device: env.local_rank,
        },
        env.rank,
    )?;
    let comm = if env.world_size > 1 {
        let rdv_env = DistEnv {
            master_port: rendezvous_port(env.master_port, |k| std::env::var(k).ok())?,
            ..env.clone()
        };
        let endpoint = rdv_env.master_endpoint();
        let joined = NcclCommunicator::join_with_timeout(&rt, &rdv_env, opts.comm_timeout);
        Some(joined.map_err(|e| {
            let hint = format!(
                " (braid's rendezvous used {endpoint}; set {RENDEZVOUS_PORT_VAR} to a port \
                 free on rank 0's host to choose another)"
            );
            match e {
                braid::Error::Collective {
                    rank,
                    index,
                    op,
                    message,
                } => braid::Error::Collective {
                    rank,
                    index,
                    op,
                    message: message + &hint,
                },
                other => other,
            }
        })?)
    } else if opts.reduce_single_rank {
        Some(one_rank_comm(&rt, opts.comm_timeout)?)
    } else {
        None
    };
    run_rank(
        opts,
        rt,
        env.rank,
        env.world_size,
        comm,
        start,
        data,
        on_step,
        shared,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::path::Path;

    fn env(vars: &[(&str, &str)]) -> Result<Option<DistEnv>> {
        let m: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Ok(DistEnv::launched_from_vars(|k| m.get(k).cloned())?)
    }

    #[test]
    fn torchrun_variables() {
        assert_eq!(env(&[]).unwrap(), None);
        let e = env(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "1234"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(
            e,
            DistEnv {
                rank: 3,
                world_size: 4,
                local_rank: 1,
                local_world_size: 4,
                master_addr: "node0".into(),
                master_port: 1234
            }
        );
        let e = env(&[("RANK", "0"), ("WORLD_SIZE", "2")]).unwrap().unwrap();
        assert_eq!((e.local_rank, e.master_port), (0, 29500));
        for bad in [
            &[("RANK", "2"), ("WORLD_SIZE", "2")][..],
            &[("RANK", "0")][..],
            &[("RANK", "x"), ("WORLD_SIZE", "2")][..],
            &[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "99999")][..],
        ] {
            let err = env(bad).unwrap_err().to_string();
            assert!(err.contains("distributed environment"), "{err}");
        }
    }

    #[test]
    fn rendezvous_port_avoids_torchruns_store() {
        let port = |vars: &[(&str, &str)]| {
            let m: HashMap<String, String> = vars
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            rendezvous_port(29500, |k| m.get(k).cloned())
        };
        assert_eq!(port(&[]).unwrap(), 29500);
        assert_eq!(
            port(&[("TORCHELASTIC_USE_AGENT_STORE", "True")]).unwrap(),
            29501
        );
        assert_eq!(
            port(&[("TORCHELASTIC_USE_AGENT_STORE", "False")]).unwrap(),
            29500
        );
        assert_eq!(
            port(&[
                ("TORCHELASTIC_USE_AGENT_STORE", "True"),
                ("BRAID_MASTER_PORT", "40000")
            ])
            .unwrap(),
            40000
        );
        let err = port(&[("BRAID_MASTER_PORT", "0")]).unwrap_err().to_string();
        assert!(err.contains("BRAID_MASTER_PORT"), "{err}");
        assert_eq!(
            rank_trace_path(Path::new("out/t.json"), 0),
            Path::new("out/t.json")
        );
        assert_eq!(
            rank_trace_path(Path::new("out/t.json"), 3),
            Path::new("out/t.rank3.json")
        );
        assert_eq!(
            rank_trace_path(Path::new("trace"), 1),
            Path::new("trace.rank1")
        );
    }
}

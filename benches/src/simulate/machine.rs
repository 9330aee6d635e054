//! Machine descriptions: what executes the step (CPU cores or GPUs), how fast
//! relative to the traced run, and the links the collectives cross.
//!
//! Built in (`--machine NAME`); every figure is an assumption stated here and
//! in `docs/simulator.md`, not a measurement, except `cpu`'s, which were
//! fitted to this repository's own CPU traces:
//!
//! | name | ranks per node | intra-node link | inter-node link |
//! |---|---|---|---|
//! | `cpu` | all (threads of one process) | shared memory, fitted | — |
//! | `h100-nvlink` | 8 | NVLink 4: 370 GB/s effective per GPU per direction (450 peak), 1 µs per hop | — |
//! | `h100-ib` | 8 | as `h100-nvlink` | InfiniBand NDR 400 Gb/s per GPU: 45 GB/s effective (50 peak), 5 µs per hop |
//! | `pcie` | 8 | PCIe 4.0 x16 through the host: 20 GB/s effective (32 peak), 5 µs per hop | — |
//!
//! A JSON file (`--machine-file`) gives the same fields as [`Machine`].

use super::cost::{Fabric, Link};
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

/// What runs the tasks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// CPU ranks: threads of one process sharing `cores`.
    Cpu,
    /// One GPU per rank; streams run side by side.
    Gpu,
}

/// A machine the step is simulated on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Machine {
    /// Its name.
    pub name: String,
    /// CPU ranks or GPUs.
    pub backend: Backend,
    /// CPU: cores every rank's busy threads share (0: as many as this
    /// process may use). Ignored on GPUs.
    #[serde(default)]
    pub cores: usize,
    /// The collectives' links and constants.
    pub fabric: Fabric,
    /// Compute durations are multiplied by this (the traced device against
    /// this one: 0.01 says this one is 100 times faster).
    #[serde(default = "one")]
    pub compute_scale: f64,
    /// Cost of a cross-stream dependency (waking a CPU stream thread, a GPU
    /// event wait), µs.
    #[serde(default)]
    pub handoff_us: f64,
    /// CPU: a collective's thread uses a core while it runs (it copies and
    /// reduces in memory).
    #[serde(default)]
    pub comm_uses_cores: bool,
    /// CPU: cores' worth of other work running beside the ranks (a shared
    /// machine); every busy thread shares the cores with it.
    #[serde(default)]
    pub background: f64,
    /// CPU: slowdown from sharing memory bandwidth and caches: a task runs
    /// `1 + contention·(c − 1)` times slower while `c` cores are busy (on
    /// top of the cores' time sharing).
    #[serde(default)]
    pub contention: f64,
    /// GPU: how much a rank's concurrent kernels slow each other down: a
    /// compute task runs `1 + gpu_sharing·(k − 1)` times slower while `k`
    /// compute tasks of its rank run (on its streams, sharing the SMs). 0:
    /// streams as independent devices; 1: one device's throughput shared,
    /// so overlap gains nothing (a step whose kernels each fill the GPU).
    #[serde(default)]
    pub gpu_sharing: f64,
    /// CPU: cores' worth of other work beside the traced run (to undo the
    /// sharing its durations went through).
    #[serde(default)]
    pub traced_background: f64,
    /// Rank skew, in the terms of a trace's fitted skew
    /// (`skew::MeasuredSkew::fitted_skew`): how far apart the slowest and
    /// fastest ranks end their backward, as `s = 2e/(2 − e)` of `e`, the gap
    /// over the slowest's time (0.1: about a tenth). The ranks' compute
    /// factors are spread around the modelled speed until the simulated
    /// ranks are that far apart (`skew::solve_factor_spread`); 0 runs every
    /// rank in lock step (docs/simulator.md, "Rank skew").
    #[serde(default)]
    pub rank_skew: f64,
}

fn one() -> f64 {
    1.0
}

/// The cores this process may use.
pub fn this_host_cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

impl Machine {
    /// GPU: the speed of a compute task while `kernels` compute tasks of its
    /// rank run (itself included; a traced task's mean, `1 + overlap`, to
    /// undo the sharing its duration went through).
    pub fn gpu_rate(&self, kernels: f64) -> f64 {
        if self.backend != Backend::Gpu {
            return 1.0;
        }
        1.0 / (1.0 + self.gpu_sharing.max(0.0) * (kernels - 1.0).max(0.0))
    }

    /// CPU: the speed of a core-using task while `threads` threads (every
    /// rank's busy ones plus `background`) share the cores.
    pub fn cpu_rate(&self, threads: f64) -> f64 {
        if self.backend != Backend::Cpu || threads <= 0.0 {
            return 1.0;
        }
        let cores = self.cores.max(1) as f64;
        let busy = threads.min(cores);
        (cores / threads).min(1.0) / (1.0 + self.contention.max(0.0) * (busy - 1.0).max(0.0))
    }

    /// The built-in machine `name`; `cpu` gets `cores` (0: this host's).
    pub fn builtin(name: &str, cores: usize) -> Result<Machine> {
        let nvlink = Link {
            gbps: 370.0,
            latency_us: 1.0,
        };
        let gpu = |name: &str, intra: Link, inter: Option<Link>| Machine {
            name: name.into(),
            backend: Backend::Gpu,
            cores: 0,
            fabric: Fabric {
                intra,
                inter,
                ranks_per_node: 8,
                launch_us: 10.0,
                tree_efficiency: 0.5,
                local_gbps: 0.0,
            },
            compute_scale: 1.0,
            handoff_us: 2.0,
            comm_uses_cores: false,
            background: 0.0,
            contention: 0.0,
            gpu_sharing: GPU_SHARING,
            traced_background: 0.0,
            // Not measured: no machine here has two GPUs.
            rank_skew: 0.0,
        };
        Ok(match name {
            "cpu" => Machine {
                name: "cpu".into(),
                backend: Backend::Cpu,
                cores: if cores == 0 { this_host_cores() } else { cores },
                fabric: Fabric {
                    // Fitted to the traces of `braid-gpt2 train --model
                    // small` on the 2-core development VM (docs/simulator.md):
                    // the CPU collectives reduce and copy in shared memory.
                    intra: Link {
                        gbps: CPU_LINK_GBPS,
                        latency_us: CPU_HOP_US,
                    },
                    inter: None,
                    ranks_per_node: usize::MAX,
                    launch_us: CPU_LAUNCH_US,
                    tree_efficiency: 0.5,
                    local_gbps: CPU_LOCAL_GBPS,
                },
                compute_scale: 1.0,
                handoff_us: CPU_HANDOFF_US,
                // Fitted: 4 ranks on 2 cores all-reduce the 25.7 MB bucket
                // in 14-18 ms, close to the unshared 12.8 ms and far from
                // the 25.6 ms of four comm threads sharing two cores.
                comm_uses_cores: false,
                background: 0.0,
                contention: CPU_CONTENTION,
                gpu_sharing: 0.0,
                traced_background: 0.0,
                rank_skew: CPU_RANK_SKEW,
            },
            "h100-nvlink" => gpu(name, nvlink, None),
            "h100-ib" => gpu(
                name,
                nvlink,
                Some(Link {
                    gbps: 45.0,
                    latency_us: 5.0,
                }),
            ),
            "pcie" => gpu(
                name,
                Link {
                    gbps: 20.0,
                    latency_us: 5.0,
                },
                None,
            ),
            other => bail!(
                "unknown machine `{other}` (built in: {}; or --machine-file FILE.json)",
                BUILTIN.join(", ")
            ),
        })
    }

    /// A machine from a JSON file with [`Machine`]'s fields.
    pub fn from_file(path: &std::path::Path) -> Result<Machine> {
        let s =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let mut m: Machine =
            serde_json::from_str(&s).with_context(|| format!("parsing {}", path.display()))?;
        if let Err(e) = m.check() {
            bail!("{}: {e}", path.display());
        }
        if m.backend == Backend::Cpu && m.cores == 0 {
            m.cores = this_host_cores();
        }
        Ok(m)
    }

    /// Whether every figure means something: a link's bandwidth above 0, no
    /// negative latency, cost or share, a compute scale above 0, at least one
    /// rank per node, a rank skew in `[0, 1.9)`. The error names the field
    /// (as in the JSON file) and the value.
    pub fn check(&self) -> std::result::Result<(), String> {
        let f = &self.fabric;
        let positive = |field: &str, v: f64, unit: &str| {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                Err(format!("`{field}` must be a positive {unit}, not {v}"))
            }
        };
        let non_negative = |field: &str, v: f64, unit: &str| {
            if v.is_finite() && v >= 0.0 {
                Ok(())
            } else {
                Err(format!("`{field}` must be a {unit} at or above 0, not {v}"))
            }
        };
        positive("fabric.intra.gbps", f.intra.gbps, "bandwidth (GB/s)")?;
        non_negative(
            "fabric.intra.latency_us",
            f.intra.latency_us,
            "latency (µs)",
        )?;
        if let Some(net) = f.inter {
            positive("fabric.inter.gbps", net.gbps, "bandwidth (GB/s)")?;
            non_negative("fabric.inter.latency_us", net.latency_us, "latency (µs)")?;
        }
        if f.ranks_per_node == 0 {
            return Err("`fabric.ranks_per_node` must be at least 1, not 0".into());
        }
        non_negative("fabric.launch_us", f.launch_us, "cost (µs)")?;
        positive("fabric.tree_efficiency", f.tree_efficiency, "share")?;
        non_negative(
            "fabric.local_gbps",
            f.local_gbps,
            "bandwidth (GB/s; 0: none)",
        )?;
        positive("compute_scale", self.compute_scale, "factor")?;
        non_negative("handoff_us", self.handoff_us, "cost (µs)")?;
        non_negative("background", self.background, "number of cores")?;
        non_negative("contention", self.contention, "factor")?;
        non_negative("gpu_sharing", self.gpu_sharing, "factor")?;
        non_negative(
            "traced_background",
            self.traced_background,
            "number of cores",
        )?;
        if !(0.0..1.9).contains(&self.rank_skew) {
            return Err(format!(
                "`rank_skew` must be in [0, 1.9), not {}",
                self.rank_skew
            ));
        }
        Ok(())
    }

    /// One line: what the simulator assumes.
    pub fn describe(&self) -> String {
        let f = &self.fabric;
        let mut s = format!(
            "{} ({}{}): intra {} GB/s, {} µs/hop",
            self.name,
            match self.backend {
                Backend::Cpu => "CPU ranks",
                Backend::Gpu => "GPU ranks",
            },
            match self.backend {
                Backend::Cpu => format!(
                    ", {} cores, {} busy with other work ({} when traced)",
                    self.cores, self.background, self.traced_background
                ),
                Backend::Gpu => format!(", {} per node", f.ranks_per_node),
            },
            f.intra.gbps,
            f.intra.latency_us
        );
        if let Some(n) = f.inter {
            s += &format!(", inter-node {} GB/s, {} µs/hop", n.gbps, n.latency_us);
        }
        s += &format!(
            ", launch {} µs, tree η {}, compute ×{}",
            f.launch_us, f.tree_efficiency, self.compute_scale
        );
        if self.backend == Backend::Gpu {
            s += &format!(", kernel sharing {}", self.gpu_sharing);
        }
        if self.backend == Backend::Cpu {
            s += &format!(", memory contention {}", self.contention);
        }
        s += &format!(", rank skew {:.3}", self.rank_skew);
        if f.local_gbps > 0.0 {
            s += &format!(", local pass {} GB/s", f.local_gbps);
        }
        s
    }
}

/// Names of the built-in machines.
pub const BUILTIN: [&str; 4] = ["cpu", "h100-nvlink", "h100-ib", "pcie"];

// The `cpu` machine's constants (docs/simulator.md, "Calibration").
const CPU_LINK_GBPS: f64 = 4.0;
const CPU_HOP_US: f64 = 5.0;
const CPU_LAUNCH_US: f64 = 10.0;
const CPU_LOCAL_GBPS: f64 = 8.0;
const CPU_HANDOFF_US: f64 = 10.0;
const CPU_CONTENTION: f64 = 0.2;
/// Fitted on run 6's H100 steps (docs/simulator.md, "GPU sharing").
const GPU_SHARING: f64 = 0.7;
/// Fitted on six 2-rank runs of the main job: the skew at which the
/// predicted hidden share is their mean measured one (docs/simulator.md,
/// "Rank skew").
const CPU_RANK_SKEW: f64 = 0.03;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtins_and_a_file() {
        for n in BUILTIN {
            let m = Machine::builtin(n, 4).unwrap();
            assert_eq!(m.name, n);
        }
        assert_eq!(Machine::builtin("cpu", 4).unwrap().cores, 4);
        assert!(Machine::builtin("tpu", 0).is_err());
        let m = Machine::builtin("h100-ib", 0).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("m.json");
        std::fs::write(&p, serde_json::to_string(&m).unwrap()).unwrap();
        assert_eq!(Machine::from_file(&p).unwrap(), m);
        std::fs::write(
            &p,
            r#"{"name": "two-node", "backend": "gpu",
                "fabric": {"intra": {"gbps": 100, "latency_us": 2},
                           "inter": null, "ranks_per_node": 4, "launch_us": 5,
                           "tree_efficiency": 0.5, "local_gbps": 0}}"#,
        )
        .unwrap();
        let m = Machine::from_file(&p).unwrap();
        assert_eq!((m.compute_scale, m.fabric.ranks_per_node), (1.0, 4));
        // A skew taken from a trace prints rounded, as the fitted skew does.
        let m = Machine {
            rank_skew: 0.012345678,
            ..m
        };
        assert!(
            m.describe().ends_with("rank skew 0.012"),
            "{}",
            m.describe()
        );
    }

    /// A machine file with a figure that means nothing (a link of 0 GB/s, a
    /// negative latency, a compute scale of 0, no rank per node) is refused,
    /// the error naming the file and the field; until 2026-11-29 it was
    /// simulated (a 0 GB/s link priced every collective at 0 s).
    #[test]
    fn a_machine_file_with_figures_that_mean_nothing_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("bad.json");
        for n in BUILTIN {
            assert_eq!(Machine::builtin(n, 2).unwrap().check(), Ok(()), "{n}");
        }
        let base = serde_json::to_value(Machine::builtin("h100-ib", 0).unwrap()).unwrap();
        let cases: [(&str, &str, serde_json::Value); 10] = [
            ("/fabric/intra/gbps", "fabric.intra.gbps", 0.0.into()),
            ("/fabric/intra/gbps", "fabric.intra.gbps", (-1.0).into()),
            (
                "/fabric/intra/latency_us",
                "fabric.intra.latency_us",
                (-1.0).into(),
            ),
            ("/fabric/inter/gbps", "fabric.inter.gbps", 0.0.into()),
            (
                "/fabric/inter/latency_us",
                "fabric.inter.latency_us",
                (-5.0).into(),
            ),
            ("/fabric/ranks_per_node", "fabric.ranks_per_node", 0.into()),
            ("/compute_scale", "compute_scale", 0.0.into()),
            ("/compute_scale", "compute_scale", (-2.0).into()),
            (
                "/fabric/tree_efficiency",
                "fabric.tree_efficiency",
                0.0.into(),
            ),
            ("/handoff_us", "handoff_us", (-1.0).into()),
        ];
        for (pointer, field, v) in cases {
            let mut m = base.clone();
            *m.pointer_mut(pointer).unwrap() = v.clone();
            std::fs::write(&p, m.to_string()).unwrap();
            let e = Machine::from_file(&p).unwrap_err().to_string();
            assert!(
                e.contains(field) && e.contains("bad.json"),
                "{field} = {v}: {e}"
            );
        }
    }
}

//! What a collective costs: NCCL's ring and tree algorithms in the
//! latency–bandwidth (α–β) model, the cheaper of the two per size (NCCL's
//! tuner does the same with its own model), on one link or on a hierarchy of
//! NVLink inside a node and a network between nodes.
//!
//! With `n` ranks, `B` bytes, per-hop latency `α`, per-rank link bandwidth `β`
//! (one direction) and a fixed launch cost `t0`:
//!
//! | collective | ring | tree |
//! |---|---|---|
//! | all-reduce | `t0 + 2(n−1)/n · B/β + 2(n−1)·α` | `t0 + B/(η·β) + 2·⌈log2 n⌉·α` |
//! | reduce-scatter, all-gather (`B`: the whole buffer) | `t0 + (n−1)/n · B/β + (n−1)·α` | — |
//! | broadcast | `t0 + B/β + (n−1)·α` | — |
//!
//! The ring's bandwidth term is the classic `2(n−1)/n` (each rank sends and
//! receives every chunk but its own twice: reduce-scatter then all-gather);
//! its latency term is one hop per step, `2(n−1)` steps. A (double binary)
//! tree pipelines the reduction up and the broadcast down, `2⌈log2 n⌉` hops
//! deep; its bandwidth is taken as `η·β` with `η` = 0.5 (NCCL's tree reaches
//! about half the ring's algorithm bandwidth on large messages in nccl-tests
//! results, which is why NCCL picks the ring for large messages and the tree
//! for small ones and many ranks; an assumption, stated).
//!
//! Across nodes (`g` ranks per node, `m = ⌈n/g⌉` nodes): the ring runs over
//! all `n` ranks at the slower of the two bandwidths, every step paying the
//! network latency; the tree is NCCL's: a chain inside each node
//! (`2(g−1)` NVLink hops) and a tree between nodes (`2⌈log2 m⌉` network
//! hops), at `η` times the network bandwidth.
//!
//! `local_gbps` adds a pass over the data on the rank itself (`B/local`),
//! what the CPU collectives pay for averaging and copying in memory even at
//! one rank; GPUs fuse it into the transfer (0: none).

use serde::{Deserialize, Serialize};

/// A collective operation, as far as its cost goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Collective {
    /// All-reduce (sum or average).
    AllReduce,
    /// Reduce-scatter (bytes: the whole input).
    ReduceScatter,
    /// All-gather (bytes: the whole output).
    AllGather,
    /// Broadcast.
    Broadcast,
    /// Barrier (no data).
    Barrier,
}

impl Collective {
    /// The collective a Braid task name stands for (`all_reduce bucket 3`,
    /// `broadcast bucket order`, `reduce_scatter`, ...), if any.
    pub fn from_task_name(name: &str) -> Option<Collective> {
        let n = name.trim_start();
        [
            ("all_reduce", Collective::AllReduce),
            ("reduce_scatter", Collective::ReduceScatter),
            ("all_gather", Collective::AllGather),
            ("broadcast", Collective::Broadcast),
            ("barrier", Collective::Barrier),
        ]
        .into_iter()
        .find(|(p, _)| n.starts_with(p))
        .map(|(_, c)| c)
    }

    /// Whether the collective task `name` gathers one contribution per rank,
    /// so that its output grows with the ranks: the reducer's row exchange
    /// (`all_gather rows: ids of wte`, core/src/comm/sparse.rs). Other
    /// gathers (ZeRO-1's parameters) gather a fixed whole in more pieces.
    pub fn grows_with_ranks(name: &str) -> bool {
        name.trim_start().starts_with("all_gather rows")
    }
}

/// A link: per-rank bandwidth in one direction and per-hop latency.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Link {
    /// Bandwidth per rank, one direction, GB/s (1e9 bytes per second).
    pub gbps: f64,
    /// Latency per hop, µs.
    pub latency_us: f64,
}

/// The links a collective crosses and the constants of its cost.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Fabric {
    /// Inside a node (NVLink, PCIe, shared memory).
    pub intra: Link,
    /// Between nodes (InfiniBand, Ethernet); `None`: one node holds every rank.
    pub inter: Option<Link>,
    /// Ranks per node (`inter` is crossed beyond this many).
    pub ranks_per_node: usize,
    /// Fixed cost of one collective (kernel launch, barrier), µs.
    pub launch_us: f64,
    /// Tree bandwidth as a share of the link's (η).
    pub tree_efficiency: f64,
    /// A pass over the data on the rank, GB/s (0: none).
    pub local_gbps: f64,
}

/// Which algorithm a cost came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Algo {
    /// Nothing to do (one rank, or no data).
    None,
    /// Ring.
    Ring,
    /// Tree.
    Tree,
}

fn log2_ceil(n: usize) -> f64 {
    (n.max(1) as f64).log2().ceil()
}

fn secs(bytes: f64, gbps: f64) -> f64 {
    if gbps <= 0.0 {
        0.0
    } else {
        bytes / (gbps * 1e9)
    }
}

impl Fabric {
    fn nodes(&self, n: usize) -> usize {
        n.div_ceil(self.ranks_per_node.max(1))
    }

    /// The link the ring runs at and its per-step latency, for `n` ranks.
    fn ring_link(&self, n: usize) -> Link {
        match self.inter {
            Some(net) if self.nodes(n) > 1 => Link {
                gbps: self.intra.gbps.min(net.gbps),
                latency_us: self.intra.latency_us.max(net.latency_us),
            },
            _ => self.intra,
        }
    }

    /// Ring all-reduce time in seconds.
    pub fn ring_all_reduce(&self, bytes: u64, n: usize) -> f64 {
        if n <= 1 {
            return 0.0;
        }
        let l = self.ring_link(n);
        let nf = n as f64;
        2.0 * (nf - 1.0) / nf * secs(bytes as f64, l.gbps) + 2.0 * (nf - 1.0) * l.latency_us * 1e-6
    }

    /// Tree all-reduce time in seconds.
    pub fn tree_all_reduce(&self, bytes: u64, n: usize) -> f64 {
        if n <= 1 {
            return 0.0;
        }
        let eta = self.tree_efficiency.clamp(1e-3, 1.0);
        match self.inter {
            Some(net) if self.nodes(n) > 1 => {
                let g = self.ranks_per_node.max(1) as f64;
                let hops = 2.0 * (g - 1.0) * self.intra.latency_us
                    + 2.0 * log2_ceil(self.nodes(n)) * net.latency_us;
                let bw = eta * self.intra.gbps.min(net.gbps);
                secs(bytes as f64, bw) + hops * 1e-6
            }
            _ => {
                secs(bytes as f64, eta * self.intra.gbps)
                    + 2.0 * log2_ceil(n) * self.intra.latency_us * 1e-6
            }
        }
    }

    /// The time of one collective of `bytes` on `n` ranks, in seconds, and
    /// the algorithm chosen.
    pub fn time(&self, c: Collective, bytes: u64, n: usize) -> (f64, Algo) {
        let t0 = self.launch_us * 1e-6;
        let local = secs(bytes as f64, self.local_gbps);
        if n <= 1 || (bytes == 0 && c != Collective::Barrier) {
            return (t0 + local, Algo::None);
        }
        let nf = n as f64;
        let l = self.ring_link(n);
        let lat = l.latency_us * 1e-6;
        match c {
            Collective::AllReduce => {
                let ring = self.ring_all_reduce(bytes, n);
                let tree = self.tree_all_reduce(bytes, n);
                if tree < ring {
                    (t0 + local + tree, Algo::Tree)
                } else {
                    (t0 + local + ring, Algo::Ring)
                }
            }
            Collective::ReduceScatter | Collective::AllGather => (
                t0 + local + (nf - 1.0) / nf * secs(bytes as f64, l.gbps) + (nf - 1.0) * lat,
                Algo::Ring,
            ),
            Collective::Broadcast => (
                t0 + local + secs(bytes as f64, l.gbps) + (nf - 1.0) * lat,
                Algo::Ring,
            ),
            Collective::Barrier => (t0 + 2.0 * log2_ceil(n) * lat, Algo::Tree),
        }
    }

    /// The bytes a collective of measured duration `secs` moved on `n`
    /// ranks (the inverse of [`Fabric::time`]'s ring): what a trace without
    /// `bytes` leaves to infer. `None` at one rank (nothing crossed a link).
    pub fn infer_bytes(&self, c: Collective, secs_measured: f64, n: usize) -> Option<u64> {
        if n <= 1 {
            return None;
        }
        let nf = n as f64;
        let l = self.ring_link(n);
        let lat = l.latency_us * 1e-6;
        let (factor, hops) = match c {
            Collective::AllReduce => (2.0 * (nf - 1.0) / nf, 2.0 * (nf - 1.0)),
            Collective::ReduceScatter | Collective::AllGather => ((nf - 1.0) / nf, nf - 1.0),
            Collective::Broadcast => (1.0, nf - 1.0),
            Collective::Barrier => return Some(0),
        };
        let per_byte = factor / (l.gbps * 1e9)
            + if self.local_gbps > 0.0 {
                1.0 / (self.local_gbps * 1e9)
            } else {
                0.0
            };
        let t = (secs_measured - self.launch_us * 1e-6 - hops * lat).max(0.0);
        Some((t / per_byte).round() as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one_node(gbps: f64, lat: f64) -> Fabric {
        Fabric {
            intra: Link {
                gbps,
                latency_us: lat,
            },
            inter: None,
            ranks_per_node: 8,
            launch_us: 0.0,
            tree_efficiency: 0.5,
            local_gbps: 0.0,
        }
    }

    fn close(a: f64, b: f64) {
        assert!((a - b).abs() <= 1e-12 + 1e-9 * b.abs(), "{a} != {b}");
    }

    #[test]
    fn ring_all_reduce_is_2_n_minus_1_over_n_bytes_over_bw_plus_latency() {
        let f = one_node(100.0, 2.0);
        // 8 ranks, 1 GB at 100 GB/s: 2·7/8·10 ms = 17.5 ms, plus 14 hops of 2 µs.
        close(f.ring_all_reduce(1_000_000_000, 8), 0.0175 + 14.0 * 2e-6);
        // 2 ranks: B/β + 2α.
        close(f.ring_all_reduce(1_000_000, 2), 1e-5 + 4e-6);
        assert_eq!(f.ring_all_reduce(1_000_000, 1), 0.0);
    }

    #[test]
    fn tree_pays_log_latency_and_half_bandwidth() {
        let f = one_node(100.0, 2.0);
        // 8 ranks: 2·3 hops; 1 MB at 50 GB/s = 20 µs.
        close(f.tree_all_reduce(1_000_000, 8), 2e-5 + 6.0 * 2e-6);
        // 5 ranks: ⌈log2 5⌉ = 3.
        close(f.tree_all_reduce(0, 5), 6.0 * 2e-6);
    }

    #[test]
    fn small_messages_take_the_tree_large_ones_the_ring() {
        let f = one_node(100.0, 5.0);
        let (small, a) = f.time(Collective::AllReduce, 1024, 64);
        assert_eq!(a, Algo::Tree);
        close(small, f.tree_all_reduce(1024, 64));
        let (large, b) = f.time(Collective::AllReduce, 1 << 30, 8);
        assert_eq!(b, Algo::Ring);
        close(large, f.ring_all_reduce(1 << 30, 8));
        assert_eq!(f.time(Collective::AllReduce, 1 << 30, 1), (0.0, Algo::None));
    }

    #[test]
    fn across_nodes_the_ring_runs_at_the_network_and_the_tree_chains_the_node() {
        let f = Fabric {
            inter: Some(Link {
                gbps: 50.0,
                latency_us: 5.0,
            }),
            ..one_node(450.0, 1.0)
        };
        // 16 ranks on 2 nodes: ring at 50 GB/s, 5 µs per step.
        close(
            f.ring_all_reduce(1_000_000_000, 16),
            2.0 * 15.0 / 16.0 * 0.02 + 30.0 * 5e-6,
        );
        // Tree: 2·7 NVLink hops, 2·1 network hops, at 25 GB/s.
        close(
            f.tree_all_reduce(1_000_000_000, 16),
            0.04 + (14.0 * 1.0 + 2.0 * 5.0) * 1e-6,
        );
        // 8 ranks stay on NVLink.
        close(
            f.ring_all_reduce(1_000_000_000, 8),
            2.0 * 7.0 / 8.0 / 450.0 + 14.0 * 1e-6,
        );
    }

    #[test]
    fn other_collectives_and_the_local_pass() {
        let f = Fabric {
            launch_us: 10.0,
            local_gbps: 10.0,
            ..one_node(100.0, 1.0)
        };
        let b = 1_000_000u64;
        let local = 1e-4; // 1 MB at 10 GB/s
        close(
            f.time(Collective::AllGather, b, 4).0,
            1e-5 + local + 0.75 * 1e-5 + 3e-6,
        );
        close(
            f.time(Collective::Broadcast, b, 4).0,
            1e-5 + local + 1e-5 + 3e-6,
        );
        // One rank: the launch and the local pass only.
        close(f.time(Collective::AllReduce, b, 1).0, 1e-5 + local);
    }

    #[test]
    fn inferred_bytes_invert_the_ring() {
        let f = Fabric {
            launch_us: 3.0,
            local_gbps: 20.0,
            ..one_node(10.0, 2.0)
        };
        let b = 12_345_678u64;
        let t = 3e-6 + secs(b as f64, 20.0) + f.ring_all_reduce(b, 4);
        let got = f.infer_bytes(Collective::AllReduce, t, 4).unwrap();
        assert!((got as i64 - b as i64).abs() <= 1, "{got}");
        assert_eq!(f.infer_bytes(Collective::AllReduce, t, 1), None);
    }

    #[test]
    fn names_of_braid_collectives() {
        assert_eq!(
            Collective::from_task_name("all_reduce bucket 3"),
            Some(Collective::AllReduce)
        );
        assert_eq!(
            Collective::from_task_name("broadcast bucket order"),
            Some(Collective::Broadcast)
        );
        assert_eq!(Collective::from_task_name("L0 fc forward"), None);
    }
}

//! The cost model's measurements: a duration estimate per task name, learned
//! from the bodies the CPU stream threads run, and the two hand-off costs
//! placement weighs them against (`placement.rs`, earliest finish time).
//!
//! Names map to slots on the submitting side, under the runtime's lock
//! ([`Names`]). Stream threads update a slot with one relaxed load and one
//! relaxed store ([`Estimates::record`]): two streams running tasks of one name
//! at once may lose one sample, which only delays the estimate; no reader
//! needs more than "a recent value". The CUDA stream threads record nothing
//! (a body's host time there is its launch, not its work; device times exist
//! only when profiling, and profiling must not change where tasks go), so a
//! CUDA runtime never has an estimate and keeps the `Affinity` rule.

// Plain std atomics even under loom: estimates are hints, part of no model.
use std::borrow::Cow;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};

/// What a cross-stream hand-off costs on the CPU backend: the predecessor's
/// stream advances its gate, the waiting thread sees it (or is woken). Also
/// the price of waking an idle stream thread (a futex wake-up and a context
/// switch). Measured on the 2-core development VM (`dag_overhead --shape
/// pingpong` against `--shape chain`): a hand-off to a stream thread that is
/// still spinning costs 0.3–1 µs, waking one that went to sleep ~30 µs. One
/// constant between the two; it only has to separate "tasks of a few µs or
/// less, which should stay together" from "tasks worth spreading".
pub(crate) const HANDOFF_NS: u64 = 5_000;

/// A name without a slot (the table is full): never estimated.
pub(crate) const NO_SLOT: u32 = u32::MAX;

/// Distinct task names with an estimate; later names go unestimated (their
/// tasks are placed by the `Affinity` rule, as before measurements exist).
const SLOTS: usize = 4096;

const UNKNOWN: u64 = u64::MAX;

/// Duration estimates, one per slot: an exponentially weighted mean of the
/// measured times a task of the name occupied its stream (body and the
/// engine's per-task work; weight 1/4 on the newest), `UNKNOWN` until the
/// first.
pub(crate) struct Estimates {
    ns: Box<[AtomicU64]>,
}

impl Default for Estimates {
    fn default() -> Self {
        Estimates {
            ns: (0..SLOTS).map(|_| AtomicU64::new(UNKNOWN)).collect(),
        }
    }
}

impl Estimates {
    /// The estimate of `slot`, if one was measured.
    pub(crate) fn get(&self, slot: u32) -> Option<u64> {
        let v = self.ns.get(slot as usize)?.load(Ordering::Relaxed);
        (v != UNKNOWN).then_some(v)
    }

    /// Folds one measured duration into `slot`'s estimate.
    pub(crate) fn record(&self, slot: u32, ns: u64) {
        let Some(cell) = self.ns.get(slot as usize) else {
            return;
        };
        let ns = ns.min(UNKNOWN - 1);
        let old = cell.load(Ordering::Relaxed);
        let new = if old == UNKNOWN {
            ns
        } else {
            old - old / 4 + ns / 4
        };
        cell.store(new, Ordering::Relaxed);
    }
}

/// Task names to estimate slots, in order of first submission.
pub(crate) struct Names {
    slots: HashMap<Cow<'static, str>, u32, BuildHasherDefault<NameHasher>>,
    /// Recently seen `&'static str` names by address and length: static
    /// memory never changes, so the same address means the same name, found
    /// without hashing its bytes.
    recent: [(usize, usize, u32); RECENT],
}

const RECENT: usize = 64;

impl Default for Names {
    fn default() -> Self {
        Names {
            slots: HashMap::default(),
            recent: [(0, 0, NO_SLOT); RECENT],
        }
    }
}

impl Names {
    /// The slot of a name the program wrote as a literal (or otherwise
    /// `&'static`): found by its address when seen recently.
    pub(crate) fn slot_static(&mut self, name: &'static str) -> u32 {
        let key = (name.as_ptr() as usize, name.len());
        let i = ((key.0 >> 3) ^ key.1) % RECENT;
        let (p, l, s) = self.recent[i];
        if (p, l) == key && s != NO_SLOT {
            return s;
        }
        let s = self.lookup(name, || Cow::Borrowed(name));
        self.recent[i] = (key.0, key.1, s);
        s
    }

    /// The slot of a name built at run time.
    pub(crate) fn slot(&mut self, name: &str) -> u32 {
        self.lookup(name, || Cow::Owned(name.to_string()))
    }

    /// `name`'s slot, given one on first sight ([`NO_SLOT`] once full).
    fn lookup(&mut self, name: &str, key: impl FnOnce() -> Cow<'static, str>) -> u32 {
        if let Some(&s) = self.slots.get(name) {
            return s;
        }
        let n = self.slots.len();
        if n >= SLOTS {
            return NO_SLOT;
        }
        self.slots.insert(key(), n as u32);
        n as u32
    }
}

/// Mixes one word into a hash.
pub(crate) fn mix(h: u64, x: u64) -> u64 {
    (h ^ x).wrapping_mul(0x9e37_79b9_7f4a_7c15).rotate_left(29)
}

/// Mixes `bytes` into a hash eight at a time (the last word zero-padded):
/// task names, for the name table here and automatic replay's step hash.
pub(crate) fn mix_bytes(mut h: u64, bytes: &[u8]) -> u64 {
    for chunk in bytes.chunks(8) {
        let mut w = [0u8; 8];
        w[..chunk.len()].copy_from_slice(chunk);
        h = mix(h, u64::from_le_bytes(w));
    }
    h
}

/// A word-at-a-time hash for task names (SipHash shows up in the per-task
/// cost; names come from the program, not from an adversary).
#[derive(Default)]
struct NameHasher(u64);

impl Hasher for NameHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        self.0 = mix_bytes(self.0, bytes);
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn a_name_keeps_its_slot_and_others_get_new_ones() {
        let mut n = Names::default();
        let a = n.slot_static("h.0.attn.qkv");
        let b = n.slot_static("h.1.attn.qkv");
        assert_ne!(a, b);
        assert_eq!(n.slot("h.0.attn.qkv"), a);
        assert_eq!(n.slot_static("h.1.attn.qkv"), b);
    }

    #[test]
    fn the_table_is_bounded() {
        let mut n = Names::default();
        for i in 0..SLOTS {
            assert_eq!(n.slot(&format!("t{i}")), i as u32);
        }
        assert_eq!(n.slot_static("one too many"), NO_SLOT);
        assert_eq!(n.slot_static("t7"), 7);
    }

    #[test]
    fn estimates_start_unknown_then_follow_the_measurements() {
        let e = Estimates::default();
        assert_eq!(e.get(3), None);
        e.record(3, 1_000);
        assert_eq!(e.get(3), Some(1_000));
        e.record(3, 2_000);
        assert_eq!(e.get(3), Some(1_250));
        e.record(NO_SLOT, 5);
        assert_eq!(e.get(NO_SLOT), None);
    }
}

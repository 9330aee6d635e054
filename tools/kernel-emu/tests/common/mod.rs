//! What the kernel families' tests share: deterministic inputs, bf16
//! conversions, the comparisons of `models/gpt2/tests/cuda_kernels.rs` (the
//! bar each kernel is held to on a GPU), and the launch configurations of
//! `models/gpt2/src/kernels/cuda_common.rs`'s `Launcher`.

// Each test binary uses some of these.
#![allow(dead_code)]

use braid_gpt2::kernels::cpu::Bf16;
use braid_kernel_emu::Dim3;

/// Deterministic values in [-scale, scale).
pub fn values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0) * scale
        })
        .collect()
}

/// `n` ids below `v`, with repeats (as cuda_kernels.rs's `tokens`), the
/// first and the last id among them.
pub fn ids(n: usize, v: usize, seed: u64) -> Vec<u32> {
    let mut t: Vec<u32> = (0..n)
        .map(|i| ((i as u64 * 2_654_435_761 + seed) % 29) as u32 * 11 % v as u32)
        .collect();
    if n >= 2 {
        t[0] = 0;
        t[n - 1] = v as u32 - 1;
    }
    t
}

pub fn to_bf16(x: &[f32]) -> Vec<Bf16> {
    x.iter().map(|&v| Bf16::from_f32(v)).collect()
}

pub fn bits(x: &[Bf16]) -> Vec<u16> {
    x.iter().map(|h| h.0).collect()
}

pub fn from_bits(x: &[u16]) -> Vec<Bf16> {
    x.iter().map(|&h| Bf16(h)).collect()
}

pub fn widen(x: &[u16]) -> Vec<f32> {
    x.iter().map(|&h| Bf16(h).to_f32()).collect()
}

/// Bit-identical `f32` results (NaN for NaN with the same bits), or a panic
/// naming the first differing element and both values.
#[track_caller]
pub fn assert_bits(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let differ = got
        .iter()
        .zip(want)
        .filter(|(g, w)| g.to_bits() != w.to_bits())
        .count();
    println!("{what}: {differ} of {} differ (bit for bit)", got.len());
    if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
        panic!(
            "{what}: element {i}: emulated {:e} ({:#010x}) vs cpu {:e} ({:#010x}); {differ} differ",
            got[i],
            got[i].to_bits(),
            want[i],
            want[i].to_bits()
        );
    }
}

/// cuda_kernels.rs's `compare`: max |got - want| / (atol + rtol·|want|) at
/// most 1 (NaN never agrees). Returns the worst scaled error.
#[track_caller]
pub fn compare(what: &str, got: &[f32], want: &[f32], atol: f32, rtol: f32) -> f32 {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let (mut worst, mut at, mut differ) = (0.0f32, 0usize, 0usize);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        differ += (g.to_bits() != w.to_bits()) as usize;
        let err = if g.is_nan() || w.is_nan() {
            f32::INFINITY
        } else {
            (g - w).abs() / (atol + rtol * w.abs())
        };
        if err > worst {
            (worst, at) = (err, i);
        }
    }
    println!(
        "{what}: {differ} of {} differ, worst scaled error {worst:.3} at {at} \
         (atol {atol:e}, rtol {rtol:e})",
        got.len()
    );
    assert!(
        worst <= 1.0,
        "{what}: element {at}: emulated {:e} vs cpu {:e} (scaled error {worst:.2})",
        got[at],
        want[at]
    );
    worst
}

/// `x`'s bits as a monotonic integer: consecutive bf16 values are 1 apart,
/// -0 and +0 both 0 (cuda_kernels.rs's `bf16_ordinal`).
fn bf16_ordinal(x: u16) -> i32 {
    let mag = (x & 0x7fff) as i32;
    if x & 0x8000 != 0 {
        -mag
    } else {
        mag
    }
}

/// cuda_kernels.rs's `compare_bf16`: every element within `max_ulps` bf16
/// ulps (0: bit-identical, NaN for NaN). Returns the worst distance.
#[track_caller]
pub fn compare_bf16(what: &str, got: &[u16], want: &[Bf16], max_ulps: i32) -> i32 {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let (mut worst, mut at, mut differ) = (0i32, 0usize, 0usize);
    for (i, (&g, w)) in got.iter().zip(want).enumerate() {
        let (gn, wn) = (Bf16(g).to_f32().is_nan(), w.to_f32().is_nan());
        let ulps = match (gn, wn) {
            (true, true) => 0,
            (false, false) => (bf16_ordinal(g) - bf16_ordinal(w.0)).abs(),
            _ => i32::MAX,
        };
        differ += (ulps != 0) as usize;
        if ulps > worst {
            (worst, at) = (ulps, i);
        }
    }
    println!(
        "{what}: {differ} of {} differ, worst {worst} bf16 ulp(s) at {at}",
        got.len()
    );
    assert!(
        worst <= max_ulps,
        "{what}: element {at}: emulated {} ({:#06x}) vs cpu {} ({:#06x}): {worst} bf16 ulps, \
         at most {max_ulps}",
        Bf16(got[at]).to_f32(),
        got[at],
        want[at].to_f32(),
        want[at].0
    );
    worst
}

/// `Launcher::grid`: `blocks` as a grid dimension, at least 1.
pub fn grid(blocks: usize) -> u32 {
    u32::try_from(blocks.max(1)).expect("a test grid fits u32")
}

/// `Launcher::linear`: one thread per element, `ceil(n / block)` blocks of
/// `block` threads.
pub fn linear(n: usize, block: u32) -> (Dim3, Dim3) {
    ((grid(n.div_ceil(block as usize)), 1, 1), (block, 1, 1))
}

/// `Launcher::warp_rows`: one warp per row, blocks of 256 threads (8 rows).
pub fn warp_rows(rows: usize) -> (Dim3, Dim3) {
    ((grid(rows.div_ceil(8)), 1, 1), (256, 1, 1))
}

/// `dense` `(rows, cols)` in rows of `ld`, each padded with `fill`
/// (cuda_kernels.rs's `pad_rows`).
pub fn pad_rows<T: Copy>(dense: &[T], cols: usize, ld: usize, fill: T) -> Vec<T> {
    dense
        .chunks_exact(cols)
        .flat_map(|r| {
            r.iter()
                .copied()
                .chain(std::iter::repeat_n(fill, ld - cols))
        })
        .collect()
}

/// The first `cols` of each `ld` row of `padded`, and the padding after them.
pub fn split_rows<T: Copy>(padded: &[T], cols: usize, ld: usize) -> (Vec<T>, Vec<T>) {
    let rows = padded.chunks_exact(ld);
    let used = rows.clone().flat_map(|r| &r[..cols]).copied().collect();
    (used, rows.flat_map(|r| &r[cols..]).copied().collect())
}

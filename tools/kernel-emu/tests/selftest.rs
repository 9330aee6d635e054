//! The emulator against plain Rust: csrc/selftest.cu's block reduction, warp
//! shuffles and votes, and bf16 MMA; and the rule-breaking kernels, which must
//! return an error rather than hang.

use braid_gpt2::kernels::cpu::Bf16;
use braid_kernel_emu as emu;

/// Deterministic values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// selftest_block_sum's tree, in the same order.
fn block_sum_ref(inp: &[f32], n: usize, blocks: usize, threads: usize) -> Vec<f32> {
    (0..blocks)
        .map(|blk| {
            let mut sh: Vec<f32> = (0..threads)
                .map(|t| {
                    let i = blk * threads + t;
                    if i < n {
                        inp[i]
                    } else {
                        0.0
                    }
                })
                .collect();
            let mut s = threads.next_power_of_two() / 2;
            while s > 0 {
                for t in 0..s.min(threads.saturating_sub(s)) {
                    sh[t] += sh[t + s];
                }
                s /= 2;
            }
            sh[0]
        })
        .collect()
}

#[test]
fn block_sum_matches_the_same_tree_in_rust() {
    for (n, threads) in [(300usize, 128usize), (150, 48), (1000, 1024), (5, 1)] {
        let blocks = n.div_ceil(threads);
        let inp = values(n, 1);
        let mut out = vec![f32::NAN; blocks];
        emu::selftest_block_sum(
            (blocks as u32, 1, 1),
            (threads as u32, 1, 1),
            &mut out,
            &inp,
            n as i32,
        )
        .unwrap();
        assert_eq!(
            out,
            block_sum_ref(&inp, n, blocks, threads),
            "n {n}, block {threads}"
        );
    }
}

#[test]
fn warp_sum_butterfly_gives_every_lane_the_warps_sum() {
    let (n, blocks, threads) = (200usize, 2usize, 128usize);
    let inp = values(n, 2);
    let mut out = vec![f32::NAN; blocks * threads];
    emu::selftest_warp_sum((2, 1, 1), (128, 1, 1), &mut out, &inp, n as i32).unwrap();
    for w in 0..blocks * threads / 32 {
        let mut v: Vec<f32> = (0..32)
            .map(|l| inp.get(w * 32 + l).copied().unwrap_or(0.0))
            .collect();
        for off in [16, 8, 4, 2, 1] {
            v = (0..32).map(|l| v[l] + v[l ^ off]).collect();
        }
        assert_eq!(&out[w * 32..][..32], &v[..], "warp {w}");
    }
}

/// CUDA's documented shuffle semantics (Programming Guide, "Warp Shuffle
/// Functions"), written independently of the emulator's PTX formulation:
/// the source lane, or None for the caller's own value.
fn shfl_idx(lane: usize, src: usize, width: usize) -> usize {
    lane / width * width + src % width
}
fn shfl_xor(lane: usize, mask: usize, width: usize) -> Option<usize> {
    let j = lane ^ mask;
    (j / width <= lane / width).then_some(j)
}
fn shfl_down(lane: usize, delta: usize, width: usize) -> Option<usize> {
    (lane % width + delta < width).then_some(lane + delta)
}
fn shfl_up(lane: usize, delta: usize, width: usize) -> Option<usize> {
    (lane % width >= delta).then(|| lane - delta)
}

#[test]
fn shuffles_and_votes_follow_cudas_definitions() {
    let threads = 2 * 64;
    let mut out = vec![-1i32; threads * 12];
    emu::selftest_shuffles((2, 1, 1), (64, 1, 1), &mut out).unwrap();
    for i in 0..threads {
        let (warp, lane) = (i / 32, i % 32);
        let v = |l: usize| (100 * warp + l) as i32;
        let own = |j: Option<usize>| v(j.unwrap_or(lane));
        let ballot = (0..32).filter(|l| l % 3 == 0).fold(0u32, |m, l| m | 1 << l);
        let want = [
            v(shfl_idx(lane, 7, 32)),
            v(shfl_idx(lane, lane + 5, 16)),
            own(shfl_xor(lane, 5, 32)),
            own(shfl_xor(lane, 12, 8)),
            own(shfl_down(lane, 3, 32)),
            own(shfl_down(lane, 3, 8)),
            own(shfl_up(lane, 2, 16)),
            3 * v(31 - lane),
            (0.5 * own(shfl_down(lane, 1, 32)) as f32) as i32,
            ballot as i32,
            1,
            0,
        ];
        assert_eq!(&out[i * 12..][..12], &want[..], "thread {i} (lane {lane})");
    }
}

fn bf16(x: f32) -> u16 {
    Bf16::from_f32(x).0
}

fn from_bf16(h: u16) -> f32 {
    Bf16(h).to_f32()
}

#[test]
fn mma_is_the_f32_matmul_of_the_bf16_values() {
    // 4 warps: two blocks of 64 threads.
    let warps = 4;
    // Mixed magnitudes so that a misplaced element cannot cancel out.
    let a: Vec<u16> = values(warps * 256, 3)
        .iter()
        .enumerate()
        .map(|(i, &x)| bf16(x * (1 + i % 7) as f32))
        .collect();
    let b: Vec<u16> = values(warps * 128, 4)
        .iter()
        .enumerate()
        .map(|(i, &x)| bf16(x * (1 + i % 5) as f32))
        .collect();
    let c = values(warps * 128, 5);
    let mut d = c.clone();
    emu::selftest_mma((2, 1, 1), (64, 1, 1), &mut d, &a, &b).unwrap();
    for w in 0..warps {
        for r in 0..16 {
            for n in 0..8 {
                let mut acc = c[w * 128 + r * 8 + n];
                for k in 0..16 {
                    acc += from_bf16(a[w * 256 + r * 16 + k]) * from_bf16(b[w * 128 + k * 8 + n]);
                }
                assert_eq!(d[w * 128 + r * 8 + n], acc, "warp {w}, D[{r}][{n}]");
            }
        }
    }
}

/// B fragments from `ldmatrix .x4 .trans` over B, and from `ldmatrix .x4`
/// over Bᵀ (as the tensor-core attention loads them), feed the MMA the B it
/// multiplies by: D is the f32 product of the bf16 values.
#[test]
fn ldmatrix_gives_the_mma_its_b_fragments() {
    let a: Vec<u16> = values(256, 6).iter().map(|&x| bf16(3.0 * x)).collect();
    let b: Vec<u16> = values(256, 7)
        .iter()
        .enumerate()
        .map(|(i, &x)| bf16(x * (1 + i % 5) as f32))
        .collect();
    for trans in [true, false] {
        let mut d = vec![f32::NAN; 256];
        emu::selftest_ldmatrix_mma(&mut d, &a, &b, trans).unwrap();
        for r in 0..16 {
            for n in 0..16 {
                let mut acc = 0.0f32;
                for k in 0..16 {
                    acc += from_bf16(a[r * 16 + k]) * from_bf16(b[k * 16 + n]);
                }
                assert_eq!(d[r * 16 + n], acc, "trans {trans}: D[{r}][{n}]");
            }
        }
    }
}

#[test]
fn broken_kernels_are_errors_not_hangs() {
    let cases: [(i32, u32, &str); 10] = [
        (0, 64, "1 have returned"),
        (1, 64, "32 wait at __syncthreads, 32 at a warp barrier"),
        (2, 64, "warp 0: 31 of 32 lanes"),
        (3, 64, "mask 0x0000ffff"),
        (4, 64, "thread (3,0,0): __trap()"),
        (5, 48, "which does not exist (a warp of 16 threads)"),
        (6, 64, "wrote out[128], past the end of its 128 elements"),
        (7, 64, "wrote out[-1], before the start of its 128 elements"),
        (
            8,
            64,
            "lanes of warp 0 at different warp-collective operations",
        ),
        (
            9,
            64,
            "differs between a run with the blocks and threads in order",
        ),
    ];
    for (mode, threads, want) in cases {
        let mut out = vec![0.0f32; 2 * threads as usize];
        let err = emu::selftest_fault((2, 1, 1), (threads, 1, 1), &mut out, mode)
            .expect_err(&format!("mode {mode} must fail"));
        assert!(err.contains(want), "mode {mode}: {err}");
        assert!(
            out.iter().all(|&x| x == 0.0),
            "mode {mode}: a failed launch must leave the outputs alone"
        );
    }
    // The emulator is usable after a failed launch.
    let mut out = vec![0.0f32; 64];
    emu::selftest_warp_sum((1, 1, 1), (64, 1, 1), &mut out, &[1.0; 64], 64).unwrap();
    assert!(out.iter().all(|&x| x == 32.0));
}

#[test]
fn invalid_launch_configurations_are_errors() {
    let mut out = vec![0.0f32; 2048];
    let inp = vec![0.0f32; 2048];
    for block in [(0u32, 1u32, 1u32), (1025, 1, 1)] {
        let n = block.0 as usize;
        let err = emu::selftest_warp_sum((1, 1, 1), block, &mut out[..n], &inp, 0).unwrap_err();
        assert!(err.contains("invalid block"), "{err}");
    }
    let err = emu::selftest_block_sum((0, 1, 1), (32, 1, 1), &mut [], &inp, 0).unwrap_err();
    assert!(err.contains("invalid grid"), "{err}");
    let err = emu::selftest_shuffles((1, 1, 1), (32, 2, 1), &mut [0; 768]).unwrap_err();
    assert!(err.contains("one-dimensional"), "{err}");
}

//! models/gpt2/src/kernels/flash_attention.cu, emulated, against the CPU
//! kernels of braid-gpt2 (flash_attention.rs). The CUDA kernels follow the
//! CPU operation by operation except for the exponential and logarithm (the
//! C library's expf/logf here, the CPU's fastmath::exp and f32::ln there), so
//! they agree to a few ulp in f32 and to one bf16 ulp in bf16.

mod common;

use braid_gpt2::kernels::cpu::{flash_attention_backward, flash_attention_forward, Bf16};
use braid_gpt2::kernels::flash_attention::{BLOCK_K, BLOCK_Q};
use braid_kernel_emu::{self as emu, Dim3, TcBuild};
use common::{bits, to_bf16, values, widen};

#[derive(Clone, Copy, Debug)]
struct Shape {
    b: usize,
    t: usize,
    c: usize,
    nh: usize,
}

/// (B, T, C, NH): hs = 16 with T crossing a key tile and B, NH > 1; hs = 64
/// with two blocks of rows.
const SHAPES: [Shape; 2] = [
    Shape {
        b: 2,
        t: 37,
        c: 48,
        nh: 3,
    },
    Shape {
        b: 1,
        t: 150,
        c: 128,
        nh: 2,
    },
];

impl Shape {
    fn args(self) -> [i32; 4] {
        [self.b, self.t, self.c, self.nh].map(|x| x as i32)
    }

    /// The CUDA launcher's configuration, or rows_per_block other than 128.
    fn launch(self, rows_per_block: u32) -> (Dim3, Dim3) {
        let blocks = (self.t as u32).div_ceil(rows_per_block);
        (
            (blocks, (self.b * self.nh) as u32, 1),
            (rows_per_block, 1, 1),
        )
    }
}

/// The tensors of one test case, in f32.
struct Inputs {
    inp: Vec<f32>,   // (B, T, 3C)
    dout: Vec<f32>,  // (B, T, C)
    dinp0: Vec<f32>, // (B, T, 3C), accumulated into
}

impl Inputs {
    /// (inp, dout, dinp0) rounded to bf16, as bit patterns.
    fn bf16_bits(&self) -> (Vec<u16>, Vec<u16>, Vec<u16>) {
        let b = |x: &[f32]| bits(&to_bf16(x));
        (b(&self.inp), b(&self.dout), b(&self.dinp0))
    }
}

fn inputs(s: Shape, seed: u64) -> Inputs {
    let btc = s.b * s.t * s.c;
    Inputs {
        inp: values(3 * btc, seed, 1.5),
        dout: values(btc, seed + 1, 1.0),
        dinp0: values(3 * btc, seed + 2, 0.5),
    }
}

/// Distance in units in the last place between two f32 (0 for equal
/// values, +0 and -0 included).
fn ulps(a: f32, b: f32) -> u64 {
    let ord = |x: f32| {
        let i = x.to_bits();
        if i >> 31 == 1 {
            -i64::from(i & 0x7fff_ffff)
        } else {
            i64::from(i)
        }
    };
    ord(a).abs_diff(ord(b))
}

/// Agreement of `got` with `want`: the largest ulp distance (large where an
/// element is near zero by cancellation), and the largest absolute
/// difference relative to the largest |want|, the tensor's scale (what the
/// tests bound).
#[derive(Debug)]
struct Agreement {
    max_ulps: u64,
    max_scaled: f64,
}

fn agreement(what: &str, got: &[f32], want: &[f32]) -> Agreement {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let scale = want.iter().fold(0.0f64, |m, &x| m.max(f64::from(x).abs()));
    let mut a = Agreement {
        max_ulps: 0,
        max_scaled: 0.0,
    };
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(g.is_finite(), "{what}[{i}] = {g}");
        a.max_ulps = a.max_ulps.max(ulps(g, w));
        a.max_scaled = a
            .max_scaled
            .max((f64::from(g) - f64::from(w)).abs() / scale);
    }
    println!("{what}: {a:?}");
    a
}

/// The largest distance in bf16 ulps (as `ulps` on the widened values,
/// counted in bf16 steps).
fn bf16_ulps(what: &str, got: &[u16], want: &[Bf16]) -> u64 {
    let m = got
        .iter()
        .zip(want)
        .map(|(&g, w)| ulps(Bf16(g).to_f32(), w.to_f32()) >> 16)
        .max()
        .unwrap_or(0);
    println!("{what}: max {m} bf16 ulp");
    m
}

#[test]
fn f32_kernels_match_the_cpu() {
    for (n, &s) in SHAPES.iter().enumerate() {
        let [b, t, c, nh] = s.args();
        let x = inputs(s, 10 * n as u64);
        let (btc, bht) = (s.b * s.t * s.c, s.b * s.nh * s.t);
        let (grid, block) = s.launch(128);
        println!("shape {s:?}, grid {grid:?}, block {block:?}");

        // Forward, at the CPU tasks' tiles and at an odd key tile.
        let mut out = vec![0.0; btc];
        let mut lse = vec![0.0; bht];
        for block_k in [BLOCK_K, 7] {
            flash_attention_forward(
                &mut out, &mut lse, &x.inp, s.b, s.t, s.c, s.nh, BLOCK_Q, block_k,
            );
            let mut e_out = vec![f32::NAN; btc];
            let mut e_lse = vec![f32::NAN; bht];
            let bk = block_k as i32;
            emu::flash_attention_forward(
                grid, block, &mut e_out, &mut e_lse, &x.inp, b, t, c, nh, bk,
            )
            .unwrap();
            assert!(
                agreement(&format!("out (block_k {block_k})"), &e_out, &out).max_scaled <= 1e-6
            );
            assert!(
                agreement(&format!("lse (block_k {block_k})"), &e_lse, &lse).max_scaled <= 1e-6
            );
        }
        // `out` and `lse` are now at block_k 7; recompute at BLOCK_K, the
        // tasks' tile, for the backward pass.
        flash_attention_forward(
            &mut out, &mut lse, &x.inp, s.b, s.t, s.c, s.nh, BLOCK_Q, BLOCK_K,
        );

        // Backward: both from the CPU's out and lse.
        let mut dinp = x.dinp0.clone();
        let mut delta = vec![0.0; bht];
        flash_attention_backward(
            &mut dinp, &mut delta, &x.dout, &x.inp, &out, &lse, s.b, s.t, s.c, s.nh, BLOCK_Q,
            BLOCK_K,
        );
        let mut e_delta = vec![f32::NAN; bht];
        emu::flash_attention_delta(grid, block, &mut e_delta, &x.dout, &out, b, t, c, nh).unwrap();
        assert_eq!(e_delta, delta, "delta: the same f32 dot products");
        let mut e_dinp = x.dinp0.clone();
        emu::flash_attention_backward_dq(
            grid,
            block,
            &mut e_dinp,
            &delta,
            &x.dout,
            &x.inp,
            &lse,
            b,
            t,
            c,
            nh,
            1,
        )
        .unwrap();
        emu::flash_attention_backward_dkv(
            grid,
            block,
            &mut e_dinp,
            &delta,
            &x.dout,
            &x.inp,
            &lse,
            b,
            t,
            c,
            nh,
            1,
        )
        .unwrap();
        let a = agreement("dinp", &e_dinp, &dinp);
        assert!(a.max_scaled <= 1e-6, "dinp: {a:?}");
    }
}

#[test]
fn bf16_kernels_match_the_cpu() {
    for (n, &s) in SHAPES.iter().enumerate() {
        let [b, t, c, nh] = s.args();
        let x = inputs(s, 100 + 10 * n as u64);
        let (inp, dout, dinp0) = (to_bf16(&x.inp), to_bf16(&x.dout), to_bf16(&x.dinp0));
        let (btc, bht) = (s.b * s.t * s.c, s.b * s.nh * s.t);
        let (grid, block) = s.launch(128);
        println!("shape {s:?}, grid {grid:?}, block {block:?}");

        let mut out = vec![Bf16::default(); btc];
        let mut lse = vec![0.0; bht];
        flash_attention_forward(
            &mut out, &mut lse, &inp, s.b, s.t, s.c, s.nh, BLOCK_Q, BLOCK_K,
        );
        let mut e_out = vec![0xffffu16; btc];
        let mut e_lse = vec![f32::NAN; bht];
        let bk = BLOCK_K as i32;
        emu::flash_attention_forward_bf16(
            grid,
            block,
            &mut e_out,
            &mut e_lse,
            &bits(&inp),
            b,
            t,
            c,
            nh,
            bk,
        )
        .unwrap();
        assert!(bf16_ulps("out", &e_out, &out) <= 1);
        assert!(agreement("lse", &e_lse, &lse).max_scaled <= 1e-6);

        let mut dinp = dinp0.clone();
        let mut delta = vec![0.0; bht];
        flash_attention_backward(
            &mut dinp, &mut delta, &dout, &inp, &out, &lse, s.b, s.t, s.c, s.nh, BLOCK_Q, BLOCK_K,
        );
        let mut e_delta = vec![f32::NAN; bht];
        emu::flash_attention_delta_bf16(
            grid,
            block,
            &mut e_delta,
            &bits(&dout),
            &bits(&out),
            b,
            t,
            c,
            nh,
        )
        .unwrap();
        assert_eq!(e_delta, delta, "delta: the same f32 dot products");
        let mut e_dinp = bits(&dinp0);
        let (d_out, d_inp) = (bits(&dout), bits(&inp));
        emu::flash_attention_backward_dq_bf16(
            grid,
            block,
            &mut e_dinp,
            &delta,
            &d_out,
            &d_inp,
            &lse,
            b,
            t,
            c,
            nh,
            1,
        )
        .unwrap();
        emu::flash_attention_backward_dkv_bf16(
            grid,
            block,
            &mut e_dinp,
            &delta,
            &d_out,
            &d_inp,
            &lse,
            b,
            t,
            c,
            nh,
            1,
        )
        .unwrap();
        assert!(bf16_ulps("dinp", &e_dinp, &dinp) <= 1);
        agreement("dinp (widened)", &widen(&e_dinp), &widen(&bits(&dinp)));
    }
}

/// With `accumulate` 0 the backward kernels write the gradient over what
/// `dinp` held (NaN here: never read), with the bits that adding into
/// zeros gives: the scalar kernels in f32 and bf16, and the tensor-core
/// kernels of both builds.
#[test]
fn backward_written_over_is_added_to_zero() {
    let s = SHAPES[1];
    let [b, t, c, nh] = s.args();
    let x = inputs(s, 9);
    let (btc, bht) = (s.b * s.t * s.c, s.b * s.nh * s.t);
    let (grid, block) = s.launch(128);
    let mut out = vec![0.0; btc];
    let mut lse = vec![0.0; bht];
    emu::flash_attention_forward(grid, block, &mut out, &mut lse, &x.inp, b, t, c, nh, 32).unwrap();
    let mut delta = vec![0.0; bht];
    emu::flash_attention_delta(grid, block, &mut delta, &x.dout, &out, b, t, c, nh).unwrap();
    let f32_run = |dinp: &mut [f32], acc: i32| {
        let (d, o, i) = (&delta, &x.dout, &x.inp);
        emu::flash_attention_backward_dq(grid, block, dinp, d, o, i, &lse, b, t, c, nh, acc)
            .unwrap();
        emu::flash_attention_backward_dkv(grid, block, dinp, d, o, i, &lse, b, t, c, nh, acc)
            .unwrap();
    };
    let mut added = vec![0.0f32; 3 * btc];
    f32_run(&mut added, 1);
    let mut set = vec![f32::NAN; 3 * btc];
    f32_run(&mut set, 0);
    common::assert_bits("f32 backward set", &set, &added);

    let (o16, i16) = (bits(&to_bf16(&x.dout)), bits(&to_bf16(&x.inp)));
    let bf16_run = |dinp: &mut [u16], acc: i32| {
        let (d, l) = (&delta, &lse);
        emu::flash_attention_backward_dq_bf16(
            grid, block, dinp, d, &o16, &i16, l, b, t, c, nh, acc,
        )
        .unwrap();
        emu::flash_attention_backward_dkv_bf16(
            grid, block, dinp, d, &o16, &i16, l, b, t, c, nh, acc,
        )
        .unwrap();
    };
    let mut added = vec![0u16; 3 * btc];
    bf16_run(&mut added, 1);
    let mut set = vec![0x7fc0u16; 3 * btc];
    bf16_run(&mut set, 0);
    assert_eq!(set, added, "bf16 backward set");

    for build in [TcBuild::Default, TcBuild::Chunk16] {
        let s = TC_SHAPES[3];
        let [b, t, c, nh] = s.args();
        let x = inputs(s, 11);
        let (inp, dout) = (bits(&to_bf16(&x.inp)), bits(&to_bf16(&x.dout)));
        let zeros = vec![0u16; 3 * s.b * s.t * s.c];
        let (_, lse, delta, added) = tc_run(s, &inp, &dout, &zeros);
        let (grid, block) = tc_launch(s);
        let mut set = vec![0x7fc0u16; zeros.len()];
        let (d, l) = (&delta, &lse);
        emu::flash_attention_tc_backward_dq_bf16(
            build, grid, block, &mut set, d, &dout, &inp, l, b, t, c, nh, 0,
        )
        .unwrap();
        emu::flash_attention_tc_backward_dkv_bf16(
            build, grid, block, &mut set, d, &dout, &inp, l, b, t, c, nh, 0,
        )
        .unwrap();
        assert_eq!(set, added, "tensor-core backward set ({build:?})");
    }
}

/// The kernels index by blockIdx.x too: a launch with 32 rows per block
/// (several blocks along x) gives the launcher's results bit for bit.
#[test]
fn results_do_not_depend_on_rows_per_block() {
    let s = SHAPES[0];
    let [b, t, c, nh] = s.args();
    let x = inputs(s, 7);
    let (btc, bht) = (s.b * s.t * s.c, s.b * s.nh * s.t);
    let run = |rows: u32| {
        let (grid, block) = s.launch(rows);
        let mut out = vec![0.0; btc];
        let mut lse = vec![0.0; bht];
        emu::flash_attention_forward(grid, block, &mut out, &mut lse, &x.inp, b, t, c, nh, 32)
            .unwrap();
        let mut delta = vec![0.0; bht];
        emu::flash_attention_delta(grid, block, &mut delta, &x.dout, &out, b, t, c, nh).unwrap();
        let mut dinp = x.dinp0.clone();
        emu::flash_attention_backward_dq(
            grid, block, &mut dinp, &delta, &x.dout, &x.inp, &lse, b, t, c, nh, 1,
        )
        .unwrap();
        emu::flash_attention_backward_dkv(
            grid, block, &mut dinp, &delta, &x.dout, &x.inp, &lse, b, t, c, nh, 1,
        )
        .unwrap();
        (out, lse, delta, dinp)
    };
    assert!(run(128) == run(32), "128 and 32 rows per block differ");
}

#[test]
fn shapes_the_kernels_do_not_take_are_errors() {
    // B = 1, T = 2, C = 256.
    let (mut out, mut lse, inp) = ([0.0; 512], [0.0; 4], [0.0; 1536]);
    let launch = ((1, 2, 1), (128, 1, 1));
    // NH = 1: hs = 256 > 128 would overflow the kernels' per-thread arrays.
    let err = emu::flash_attention_forward(
        launch.0,
        launch.1,
        &mut out,
        &mut lse[..2],
        &inp,
        1,
        2,
        256,
        1,
        32,
    )
    .unwrap_err();
    assert!(err.contains("at most 128 channels"), "{err}");
    // NH = 2: a short `out`.
    let err = emu::flash_attention_forward(
        launch.0,
        launch.1,
        &mut out[..10],
        &mut lse,
        &inp,
        1,
        2,
        256,
        2,
        32,
    )
    .unwrap_err();
    assert!(err.contains("out has 10 elements, expected 512"), "{err}");
}

// ---------------------------------------------------------------------------
// flash_attention_tc.cu: the tensor-core kernels
// ---------------------------------------------------------------------------

/// The tensor-core kernels' head sizes. At 64: T of one partial tile, of
/// exactly one tile, just past one tile, and of three tiles with the last
/// partial; B and NH above 1. At 16 and 32: two tiles, the last partial.
const TC_SHAPES: [Shape; 6] = [
    Shape {
        b: 1,
        t: 5,
        c: 64,
        nh: 1,
    },
    Shape {
        b: 1,
        t: 64,
        c: 128,
        nh: 2,
    },
    Shape {
        b: 2,
        t: 65,
        c: 64,
        nh: 1,
    },
    Shape {
        b: 2,
        t: 150,
        c: 192,
        nh: 3,
    },
    Shape {
        b: 2,
        t: 100,
        c: 64,
        nh: 4,
    },
    Shape {
        b: 1,
        t: 120,
        c: 96,
        nh: 3,
    },
];

/// The launcher's configuration for the tensor-core kernels.
fn tc_launch(s: Shape) -> (Dim3, Dim3) {
    (
        ((s.t as u32).div_ceil(64), (s.b * s.nh) as u32, 1),
        (128, 1, 1),
    )
}

/// The tensor-core kernels against the CPU kernels on the same bf16 inputs.
/// They compute the same quantities, but the MMAs take P and dS rounded to
/// bf16 where the CPU keeps them in f32, and sum in another order, so the
/// results agree to bf16 tolerance, not bit for bit: bounded here relative
/// to each tensor's largest element (lse: its own f32 rounding only).
#[test]
fn tensor_core_kernels_match_the_cpu_within_bf16_tolerance() {
    for (n, &s) in TC_SHAPES.iter().enumerate() {
        let [b, t, c, nh] = s.args();
        let x = inputs(s, 300 + 10 * n as u64);
        let (inp, dout, dinp0) = (to_bf16(&x.inp), to_bf16(&x.dout), to_bf16(&x.dinp0));
        let (btc, bht) = (s.b * s.t * s.c, s.b * s.nh * s.t);
        let (grid, block) = tc_launch(s);
        println!("shape {s:?}, grid {grid:?}, block {block:?}");

        let mut out = vec![Bf16::default(); btc];
        let mut lse = vec![0.0; bht];
        flash_attention_forward(
            &mut out, &mut lse, &inp, s.b, s.t, s.c, s.nh, BLOCK_Q, BLOCK_K,
        );
        let mut e_out = vec![0xffffu16; btc];
        let mut e_lse = vec![f32::NAN; bht];
        emu::flash_attention_tc_forward_bf16(
            grid,
            block,
            &mut e_out,
            &mut e_lse,
            &bits(&inp),
            b,
            t,
            c,
            nh,
        )
        .unwrap();
        bf16_ulps("tc out", &e_out, &out);
        let a_out = agreement("tc out (widened)", &widen(&e_out), &widen(&bits(&out)));
        let a_lse = agreement("tc lse", &e_lse, &lse);

        // Backward from the CPU's out and lse, delta from the scalar kernel.
        let mut dinp = dinp0.clone();
        let mut delta = vec![0.0; bht];
        flash_attention_backward(
            &mut dinp, &mut delta, &dout, &inp, &out, &lse, s.b, s.t, s.c, s.nh, BLOCK_Q, BLOCK_K,
        );
        let mut e_dinp = bits(&dinp0);
        tc_backward(s, &mut e_dinp, &delta, &bits(&dout), &bits(&inp), &lse);
        bf16_ulps("tc dinp", &e_dinp, &dinp);
        assert!(a_out.max_scaled <= TC_OUT, "tc out: {a_out:?}");
        assert!(a_lse.max_scaled <= 1e-6, "tc lse: {a_lse:?}");
        // The gradient alone (dinp minus its starting value), where the
        // rounding of P and dS shows.
        let grad = |d: &[f32]| -> Vec<f32> {
            d.iter()
                .zip(widen(&bits(&dinp0)))
                .map(|(&a, b)| a - b)
                .collect()
        };
        let a_grad = agreement(
            "tc dinp gradient",
            &grad(&widen(&e_dinp)),
            &grad(&widen(&bits(&dinp))),
        );
        assert!(a_grad.max_scaled <= TC_GRAD, "tc dinp gradient: {a_grad:?}");
    }
}

/// Bounds of the tensor-core kernels' difference from the CPU's, relative
/// to the tensor's largest element: twice the largest seen over
/// `TC_SHAPES` (out 0.0053, the gradient 0.0063: about one bf16 ulp at the
/// tensor's scale, the rounding of P and dS to bf16 for the MMAs).
const TC_OUT: f64 = 0.0125;
const TC_GRAD: f64 = 0.0125;

/// The tensor-core backward kernels, `dQ` then `dK`/`dV`, adding into
/// `dinp`, at the launcher's configuration.
fn tc_backward(s: Shape, dinp: &mut [u16], delta: &[f32], dout: &[u16], inp: &[u16], lse: &[f32]) {
    tc_backward_of(TcBuild::Default, s, dinp, delta, dout, inp, lse);
}

/// [`tc_backward`] with the kernels of `build`.
fn tc_backward_of(
    build: TcBuild,
    s: Shape,
    dinp: &mut [u16],
    delta: &[f32],
    dout: &[u16],
    inp: &[u16],
    lse: &[f32],
) {
    let [b, t, c, nh] = s.args();
    let (grid, block) = tc_launch(s);
    let (g, bl) = (grid, block);
    emu::flash_attention_tc_backward_dq_bf16(
        build, g, bl, dinp, delta, dout, inp, lse, b, t, c, nh, 1,
    )
    .unwrap();
    emu::flash_attention_tc_backward_dkv_bf16(
        build, g, bl, dinp, delta, dout, inp, lse, b, t, c, nh, 1,
    )
    .unwrap();
}

/// The backward kernels built to walk their tiles 16 rows at a time
/// (`-DTC_BWD_CHUNK=16`, fewer registers) give the default build's
/// gradients bit for bit: every accumulator gets the same MMAs in the same
/// order, and the chunks they skip on the diagonal are all masked. Every
/// shape of `TC_SHAPES` (each head size, partial and whole tiles).
#[test]
fn chunked_backward_kernels_are_bit_identical_to_the_default_build() {
    for (n, &s) in TC_SHAPES.iter().enumerate() {
        let (inp, dout, dinp0) = inputs(s, 500 + 10 * n as u64).bf16_bits();
        let (_, lse, delta, default) = tc_run(s, &inp, &dout, &dinp0);
        let mut chunked = dinp0.clone();
        tc_backward_of(TcBuild::Chunk16, s, &mut chunked, &delta, &dout, &inp, &lse);
        assert_ne!(default, dinp0, "shape {s:?}: the backward changed nothing");
        let differ = default.iter().zip(&chunked).filter(|(a, b)| a != b).count();
        assert_eq!(differ, 0, "shape {s:?}: {differ} gradients differ");
    }
}

/// The dK/dV kernel that also stores dSᵀ (`_dkv_ds`, for dQ as one
/// product, `flash_attention::dq_by_gemm`): its dK and dV are the default
/// kernel's bit for bit and it leaves dQ's channels alone; the dSᵀ it
/// stores is the model's dS rounded to bf16 (what its own dK product and the
/// dQ kernel take) at every query at or after the key, and the rest of the
/// buffer holds zeros (of either sign); and dQ summed in key order from the stored values
/// is the dQ kernel's, bit for bit. Every shape of `TC_SHAPES` with an even
/// T (the stores are pairs).
#[test]
fn the_ds_kernel_stores_what_one_dq_product_needs() {
    for (n, &s) in TC_SHAPES.iter().enumerate().filter(|(_, s)| s.t % 2 == 0) {
        let [b, t, c, nh] = s.args();
        let (inp, dout, dinp0) = inputs(s, 700 + 10 * n as u64).bf16_bits();
        let (_, lse, delta, want) = tc_run(s, &inp, &dout, &dinp0);
        let (grid, block) = tc_launch(s);
        let mut got = dinp0.clone();
        let mut ds = vec![0u16; s.b * s.nh * s.t * s.t];
        let ins = (&delta[..], &dout[..], &inp[..], &lse[..]);
        emu::flash_attention_tc_backward_dkv_ds_bf16(
            grid,
            block,
            &mut got,
            ins,
            [b, t, c, nh],
            1,
            &mut ds,
        )
        .unwrap();
        let hs = s.c / s.nh;
        let scale = 1.0 / (hs as f32).sqrt();
        let ld = |x: u16| Bf16(x).to_f32();
        for bi in 0..s.b {
            for h in 0..s.nh {
                let head = tc_head(s, &inp, &dout, bi, h);
                let r0 = (bi * s.nh + h) * s.t;
                let (lse_h, delta_h) = (&lse[r0..r0 + s.t], &delta[r0..r0 + s.t]);
                let ds_h = &ds[r0 * s.t..(r0 + s.t) * s.t];
                for key in 0..s.t {
                    for query in 0..s.t {
                        let (got_ds, at) = (ds_h[key * s.t + query], (n, bi, h, query, key));
                        if query >= key {
                            let want_ds = head.p_ds(query, key, lse_h, delta_h).1;
                            assert_eq!(got_ds, Bf16::from_f32(want_ds).0, "dS at {at:?}");
                        } else {
                            // Masked: 0, or -0 where the kernel stored
                            // 0 · (dP - delta) with a negative difference.
                            assert_eq!(got_ds & 0x7fff, 0, "masked dS at {at:?}");
                        }
                    }
                }
                for i in 0..s.t {
                    let row = (bi * s.t + i) * 3 * s.c + h * hs;
                    // dQ's channels: untouched by the kernel; the product
                    // from the stored dS gives the dQ kernel's.
                    assert_eq!(got[row..row + hs], dinp0[row..row + hs], "dQ row {i}");
                    let kj =
                        |j: usize| inp[(bi * s.t + j) * 3 * s.c + s.c + h * hs..][..hs].to_vec();
                    let mut dq = vec![0.0f32; hs];
                    for j in 0..s.t {
                        let (d, k) = (ld(ds_h[j * s.t + i]), kj(j));
                        for (a, &kk) in dq.iter_mut().zip(&k) {
                            *a += d * ld(kk);
                        }
                    }
                    let from_ds: Vec<u16> = (0..hs)
                        .map(|d| Bf16::from_f32(ld(dinp0[row + d]) + dq[d] * scale).0)
                        .collect();
                    assert_eq!(from_ds[..], want[row..row + hs], "dQ from dS, row {i}");
                    for part in [1, 2] {
                        let at = row + part * s.c;
                        assert_eq!(got[at..at + hs], want[at..at + hs], "part {part}, row {i}");
                    }
                }
            }
        }
    }
}

/// Runs the tensor-core forward, then backward from its own out and lse
/// (delta from the scalar kernel), adding into `dinp0`: (out, lse, delta,
/// dinp) as the kernels leave them.
fn tc_run(
    s: Shape,
    inp: &[u16],
    dout: &[u16],
    dinp0: &[u16],
) -> (Vec<u16>, Vec<f32>, Vec<f32>, Vec<u16>) {
    let [b, t, c, nh] = s.args();
    let (btc, bht) = (s.b * s.t * s.c, s.b * s.nh * s.t);
    let (grid, block) = tc_launch(s);
    let mut out = vec![0u16; btc];
    let mut lse = vec![0.0; bht];
    emu::flash_attention_tc_forward_bf16(grid, block, &mut out, &mut lse, inp, b, t, c, nh)
        .unwrap();
    let mut delta = vec![0.0; bht];
    let (g, bl) = s.launch(128);
    emu::flash_attention_delta_bf16(g, bl, &mut delta, dout, &out, b, t, c, nh).unwrap();
    let mut dinp = dinp0.to_vec();
    tc_backward(s, &mut dinp, &delta, dout, inp, &lse);
    (out, lse, delta, dinp)
}

/// The causal mask, exactly, at every tile edge: changing the key and value
/// of position j leaves the output and logsumexp of every earlier row
/// bit-identical and changes row j's; changing dout at row i leaves the
/// key and value gradients of every later position bit-identical (they see
/// only queries at or after them) and the query gradients of every other
/// row (dQ of row r reads only dout of row r). Positions at tile edges and
/// in the partial last tile.
#[test]
fn tensor_core_kernels_are_exactly_causal() {
    let s = TC_SHAPES[3];
    let x = inputs(s, 400);
    let (inp, dout) = (bits(&to_bf16(&x.inp)), bits(&to_bf16(&x.dout)));
    let (c3, c, hs) = (3 * s.c, s.c, s.c / s.nh);
    let zeros = vec![0u16; 3 * s.b * s.t * s.c];
    let (base_out, base_lse, _, base_dinp) = tc_run(s, &inp, &dout, &zeros);
    for j in [0, 1, 63, 64, 65, 127, 128, 149] {
        // Key and value channels of position j, batch row 1, every head.
        let mut inp2 = inp.clone();
        for x in &mut inp2[(s.t + j) * c3 + c..][..2 * c] {
            *x = Bf16(*x)
                .to_f32()
                .mul_add(-1.5, 0.25)
                .to_bits()
                .wrapping_shr(16) as u16;
        }
        let (out2, lse2, _, _) = tc_run(s, &inp2, &dout, &zeros);
        for h in 0..s.nh {
            let lse_row = |l: &[f32], r: usize| l[(s.nh + h) * s.t + r];
            let out_row = |o: &[u16], r: usize| o[(s.t + r) * c + h * hs..][..hs].to_vec();
            for r in 0..j {
                assert_eq!(
                    lse_row(&lse2, r),
                    lse_row(&base_lse, r),
                    "lse row {r}, key {j}"
                );
                assert_eq!(
                    out_row(&out2, r),
                    out_row(&base_out, r),
                    "out row {r}, key {j}"
                );
            }
            assert_ne!(
                lse_row(&lse2, j),
                lse_row(&base_lse, j),
                "lse row {j}, key {j}"
            );
        }
        // dout of row j, batch row 1.
        let mut dout2 = dout.clone();
        for x in &mut dout2[(s.t + j) * c..][..c] {
            *x ^= 0x8000; // negated
        }
        let (_, _, _, dinp2) = tc_run(s, &inp, &dout2, &zeros);
        for r in 0..s.t {
            let row = |d: &[u16], part: usize| d[(s.t + r) * c3 + part * c..][..c].to_vec();
            if r != j {
                assert_eq!(
                    row(&dinp2, 0),
                    row(&base_dinp, 0),
                    "dq row {r}, dout row {j}"
                );
            }
            if r > j {
                assert_eq!(
                    row(&dinp2, 1),
                    row(&base_dinp, 1),
                    "dk row {r}, dout row {j}"
                );
                assert_eq!(
                    row(&dinp2, 2),
                    row(&base_dinp, 2),
                    "dv row {r}, dout row {j}"
                );
            }
        }
        assert_ne!(
            dinp2[(s.t + j) * c3 + 2 * c..][..c],
            base_dinp[(s.t + j) * c3 + 2 * c..][..c]
        );
        // Batch row 0 saw none of it.
        assert_eq!(dinp2[..s.t * c3], base_dinp[..s.t * c3]);
    }
}

/// The tensor-core kernels' arithmetic, element by element, as the
/// emulator runs it: every score and `dout · v` an f32 sum over the
/// channels in order (an MMA here sums its k terms in order onto the
/// accumulator, and bf16 × bf16 products are exact in f32); P and dS
/// rounded to bf16 before their products; each 64-key tile's terms summed
/// in key order, masked and past-the-end keys included (as zeros); the
/// softmax sum kept per lane (columns `2t, 2t + 1` of each 8-column group)
/// and combined `(l0 + l1) + (l2 + l3)` at the end; exponentials by
/// CUDA's `__expf`. A bit-for-bit model of
/// the kernels' indexing: any element read from the wrong place, or
/// masked wrongly, changes a result.
mod tc_model {
    use braid_gpt2::kernels::cpu::Bf16;

    pub const TILE: usize = 64;

    fn ld(x: u16) -> f32 {
        Bf16(x).to_f32()
    }

    fn round(x: f32) -> f32 {
        Bf16::from_f32(x).to_f32()
    }

    /// CUDA's `__expf` as the emulator (and the hardware) computes it:
    /// `2^(x · log2 e)`.
    fn exp(x: f32) -> f32 {
        (x * std::f32::consts::LOG2_E).exp2()
    }

    /// Σ a[d]·b[d] over the head's channels, in order, from 0 (f32).
    fn dot(a: &[u16], b: &[u16]) -> f32 {
        a.iter()
            .zip(b)
            .fold(0.0f32, |s, (&x, &y)| s + ld(x) * ld(y))
    }

    pub struct Head<'a> {
        pub t: usize,
        pub hs: usize,
        /// Row `r` of the head's query, key or value channels (zeros past T).
        pub q: Box<dyn Fn(usize) -> Vec<u16> + 'a>,
        pub k: Box<dyn Fn(usize) -> Vec<u16> + 'a>,
        pub v: Box<dyn Fn(usize) -> Vec<u16> + 'a>,
        pub dout: Box<dyn Fn(usize) -> Vec<u16> + 'a>,
    }

    impl Head<'_> {
        /// 1 / sqrt(hs), as the kernels compute it.
        fn scale(&self) -> f32 {
            1.0 / (self.hs as f32).sqrt()
        }

        /// The forward kernel's row i: (out row in f32 before rounding, lse).
        pub fn forward_row(&self, i: usize) -> (Vec<f32>, f32) {
            let qi = (self.q)(i);
            let (mut m, mut lane_l) = (f32::NEG_INFINITY, [0.0f32; 4]);
            let mut o = vec![0.0f32; self.hs];
            for kt in 0..=i / TILE {
                let keys = kt * TILE..(kt + 1) * TILE;
                let x: Vec<f32> = keys
                    .clone()
                    .map(|j| {
                        if j > i {
                            f32::NEG_INFINITY
                        } else {
                            dot(&qi, &(self.k)(j)) * self.scale()
                        }
                    })
                    .collect();
                let m_new = x.iter().fold(m, |a, &b| a.max(b));
                let corr = exp(m - m_new);
                m = m_new;
                for l in &mut lane_l {
                    *l *= corr;
                }
                for a in &mut o {
                    *a *= corr;
                }
                let p: Vec<f32> = x.iter().map(|&x| exp(x - m)).collect();
                // Lane t's columns: (nt, e) -> nt * 8 + 2t + e, nt then e.
                for (lane, l) in lane_l.iter_mut().enumerate() {
                    for nt in 0..TILE / 8 {
                        for e in 0..2 {
                            *l += p[nt * 8 + 2 * lane + e];
                        }
                    }
                }
                for (jj, j) in keys.enumerate() {
                    let (pb, vj) = (round(p[jj]), (self.v)(j));
                    for (a, &vv) in o.iter_mut().zip(&vj) {
                        *a += pb * ld(vv);
                    }
                }
            }
            let sum = (lane_l[0] + lane_l[1]) + (lane_l[2] + lane_l[3]);
            let inv = 1.0 / sum;
            (o.iter().map(|&a| a * inv).collect(), m + sum.ln())
        }

        /// P and dS of (query i, key j), as the backward kernels compute them.
        /// Rows past T read lse and delta as 0 and are masked.
        pub fn p_ds(&self, i: usize, j: usize, lse: &[f32], delta: &[f32]) -> (f32, f32) {
            let dp = dot(&(self.dout)(i), &(self.v)(j));
            let delta_i = if i < self.t { delta[i] } else { 0.0 };
            let p = if j > i || i >= self.t {
                0.0
            } else {
                exp(dot(&(self.q)(i), &(self.k)(j)) * self.scale() - lse[i])
            };
            (p, p * (dp - delta_i))
        }

        /// dQ of row i (before the scale and the add into dinp).
        pub fn dq_row(&self, i: usize, lse: &[f32], delta: &[f32]) -> Vec<f32> {
            let mut dq = vec![0.0f32; self.hs];
            for j in 0..(i / TILE + 1) * TILE {
                let (_, ds) = self.p_ds(i, j, lse, delta);
                let (dsb, kj) = (round(ds), (self.k)(j));
                for (a, &kk) in dq.iter_mut().zip(&kj) {
                    *a += dsb * ld(kk);
                }
            }
            dq
        }

        /// (dK, dV) of key j (dK before the scale).
        pub fn dkv_row(&self, j: usize, lse: &[f32], delta: &[f32]) -> (Vec<f32>, Vec<f32>) {
            let (mut dk, mut dv) = (vec![0.0f32; self.hs], vec![0.0f32; self.hs]);
            let end = self.t.div_ceil(TILE) * TILE;
            for i in (j / TILE) * TILE..end {
                let (p, ds) = self.p_ds(i, j, lse, delta);
                let (pb, dsb) = (round(p), round(ds));
                let (qi, di) = ((self.q)(i), (self.dout)(i));
                for d in 0..self.hs {
                    dv[d] += pb * ld(di[d]);
                    dk[d] += dsb * ld(qi[d]);
                }
            }
            (dk, dv)
        }
    }
}

/// A head of batch row `bi`, head `h` of `inp` (B, T, 3C) and `dout`
/// (B, T, C) as bf16 bits, rows past T zero.
fn tc_head<'a>(
    s: Shape,
    inp: &'a [u16],
    dout: &'a [u16],
    bi: usize,
    h: usize,
) -> tc_model::Head<'a> {
    let (t, c, hs) = (s.t, s.c, s.c / s.nh);
    let part = move |m: &'a [u16], ld: usize, off: usize| {
        Box::new(move |r: usize| {
            if r < t {
                m[(bi * t + r) * ld + off + h * hs..][..hs].to_vec()
            } else {
                vec![0u16; hs]
            }
        }) as Box<dyn Fn(usize) -> Vec<u16> + 'a>
    };
    tc_model::Head {
        t,
        hs,
        q: part(inp, 3 * c, 0),
        k: part(inp, 3 * c, c),
        v: part(inp, 3 * c, 2 * c),
        dout: part(dout, c, 0),
    }
}

/// The emulated tensor-core kernels equal the element-by-element model of
/// their arithmetic (`tc_model`) bit for bit: out, lse, and dinp (added
/// into nonzero starting gradients), on every shape of `TC_SHAPES`.
#[test]
fn tensor_core_kernels_equal_their_model_bit_for_bit() {
    for (n, &s) in TC_SHAPES.iter().enumerate() {
        let (inp, dout, dinp0) = inputs(s, 500 + 10 * n as u64).bf16_bits();
        let (out, lse, delta, dinp) = tc_run(s, &inp, &dout, &dinp0);
        let add = |start: u16, x: f32| Bf16::from_f32(Bf16(start).to_f32() + x).0;
        let hs = s.c / s.nh;
        let scale = 1.0 / (hs as f32).sqrt();
        for bi in 0..s.b {
            for h in 0..s.nh {
                let head = tc_head(s, &inp, &dout, bi, h);
                let r0 = (bi * s.nh + h) * s.t;
                let (lse_h, delta_h) = (&lse[r0..r0 + s.t], &delta[r0..r0 + s.t]);
                for i in 0..s.t {
                    let what = format!("shape {n}, b {bi}, h {h}, row {i}");
                    let (o, l) = head.forward_row(i);
                    assert_eq!(lse_h[i], l, "lse {what}");
                    let o: Vec<u16> = o.iter().map(|&x| Bf16::from_f32(x).0).collect();
                    assert_eq!(
                        out[(bi * s.t + i) * s.c + h * hs..][..hs],
                        o[..],
                        "out {what}"
                    );
                    let row = (bi * s.t + i) * 3 * s.c + h * hs;
                    let dq = head.dq_row(i, lse_h, delta_h);
                    let (dk, dv) = head.dkv_row(i, lse_h, delta_h);
                    for (part, vals, scale) in [(0, &dq, scale), (1, &dk, scale), (2, &dv, 1.0)] {
                        let at = row + part * s.c;
                        let want: Vec<u16> = (0..hs)
                            .map(|d| add(dinp0[at + d], vals[d] * scale))
                            .collect();
                        assert_eq!(dinp[at..at + hs], want[..], "dinp part {part} {what}");
                    }
                }
            }
        }
    }
}

//! models/gpt2/src/kernels/matmul.cu's bias kernels, emulated, against the
//! CPU kernels of braid-gpt2 (matmul.rs). The bias gradient sums in the
//! fixed lane order the CPU's `bias_gradient` reproduces
//! (`BIAS_GRAD_LANES`), so the two are bit-identical in f32 and bf16 (the
//! GPU test, cuda_kernels, demands that in bf16 and a 1e-4 tolerance in
//! f32: here both are bit for bit). The broadcast is a copy: bit-identical.

mod common;

use braid_gpt2::kernels::cpu::Bf16;
use braid_gpt2::kernels::matmul::{matmul_backward_weight_ld, matmul_forward_ld, BIAS_GRAD_LANES};
use braid_kernel_emu::{self as emu, Dim3};
use common::{assert_bits, bits, compare_bf16, from_bits, linear, pad_rows, split_rows, to_bf16};

/// (N, OC, ld): fewer rows than lanes; rows and channels not multiples of
/// 32 (a partial last block of channels), padded rows; exactly the lanes,
/// dense; a row count past two rounds of lanes, three blocks of channels.
const SHAPES: [(usize, usize, usize); 4] = [(5, 7, 7), (77, 45, 50), (32, 33, 33), (70, 70, 81)];

/// The launcher's configuration (matmul.rs, `matmul_backward_weight_cuda`):
/// one block of BIAS_GRAD_LANES warps per 32 channels.
fn bias_backward_launch(oc: usize) -> (Dim3, Dim3) {
    (
        (common::grid(oc.div_ceil(32)), 1, 1),
        (32 * BIAS_GRAD_LANES as u32, 1, 1),
    )
}

/// What the padding of an `(N, ld)` input holds: never read.
const NAN_PAD: f32 = f32::NAN;

/// The CPU's bias gradient: `matmul_backward_weight_ld` with a two-column
/// input (its weight gradient is not looked at).
fn cpu_dbias<S: braid_gpt2::kernels::cpu::Storage>(
    dbias: &mut [S],
    dout: &[S],
    n: usize,
    oc: usize,
    ld: usize,
) {
    let c = 2;
    let inp = vec![S::store(0.5); n * c];
    let mut dweight = vec![S::store(0.0); oc * c];
    matmul_backward_weight_ld(&mut dweight, Some(dbias), dout, &inp, n, c, oc, ld);
}

#[test]
fn lanes_are_the_cpu_kernels() {
    assert_eq!(BIAS_GRAD_LANES as u32, emu::BIAS_GRAD_LANES);
}

#[test]
fn bias_backward_is_bit_identical_to_the_cpu() {
    for (s, &(n, oc, ld)) in SHAPES.iter().enumerate() {
        let dout = pad_rows(&common::values(n * oc, 10 + s as u64, 1.0), oc, ld, NAN_PAD);
        let start = common::values(oc, 20 + s as u64, 0.5);
        let (grid, block) = bias_backward_launch(oc);
        let args = [n, oc, ld].map(|x| x as i32);
        let what = format!("N {n}, OC {oc}, ld {ld}");

        // f32.
        let mut want = start.clone();
        cpu_dbias(&mut want, &dout, n, oc, ld);
        let mut got = start.clone();
        emu::bias_backward(grid, block, &mut got, &dout, args[0], args[1], args[2]).unwrap();
        assert_bits(&format!("bias_backward {what}"), &got, &want);
        if n > BIAS_GRAD_LANES {
            // Not vacuous: a plain sum over the rows in order rounds
            // differently somewhere, so only the lane order agrees.
            let rows: Vec<f32> = (0..oc)
                .map(|o| (0..n).fold(start[o], |a, r| a + dout[r * ld + o]))
                .collect();
            assert!(rows != want, "{what}: row order and lane order agree");
        }

        // bf16: dbias loaded, the f32 sums added, rounded once.
        let (dout16, start16) = (to_bf16(&dout), to_bf16(&start));
        let mut want16 = start16.clone();
        cpu_dbias(&mut want16, &dout16, n, oc, ld);
        let mut got16 = bits(&start16);
        emu::bias_backward_bf16(
            grid,
            block,
            &mut got16,
            &bits(&dout16),
            args[0],
            args[1],
            args[2],
        )
        .unwrap();
        compare_bf16(&format!("bias_backward_bf16 {what}"), &got16, &want16, 0);
    }
}

/// The broadcast is the CPU forward's first step: with a zero input the CPU
/// kernel's `out = bias + inp · Wᵀ` is the bias in every row, and the
/// kernel's output equals it bit for bit; the padding keeps its sentinel.
#[test]
fn bias_broadcast_is_the_cpu_forwards_bias() {
    for &(n, oc, ld) in &SHAPES {
        let bias = common::values(oc, 30, 1.0);
        let (c, sentinel) = (3, 7.0f32);
        let (inp, weight) = (vec![0.0f32; n * c], common::values(oc * c, 31, 1.0));
        // The launcher's configuration (matmul.rs, `matmul_forward_cuda`).
        let (grid, block) = linear(n * oc, 256);
        let args = [n, oc, ld].map(|x| x as i32);
        let what = format!("N {n}, OC {oc}, ld {ld}");

        let mut want = pad_rows(&vec![f32::NAN; n * oc], oc, ld, sentinel);
        matmul_forward_ld(&mut want, &inp, &weight, Some(&bias), n, c, oc, ld);
        let mut got = pad_rows(&vec![f32::NAN; n * oc], oc, ld, sentinel);
        emu::bias_broadcast(grid, block, &mut got, &bias, args[0], args[1], args[2]).unwrap();
        assert_bits(&format!("bias_broadcast {what}"), &got, &want);
        let (_, pad) = split_rows(&got, oc, ld);
        assert!(
            pad.iter().all(|&x| x == sentinel),
            "{what}: padding written"
        );

        let (bias16, w16) = (to_bf16(&bias), to_bf16(&weight));
        let inp16 = vec![Bf16::from_f32(0.0); n * c];
        let fill = |x: f32| {
            pad_rows(
                &vec![Bf16::from_f32(x); n * oc],
                oc,
                ld,
                Bf16::from_f32(sentinel),
            )
        };
        let mut want16 = fill(-1.0);
        matmul_forward_ld(&mut want16, &inp16, &w16, Some(&bias16), n, c, oc, ld);
        let mut got16 = bits(&fill(-1.0));
        emu::bias_broadcast_bf16(
            grid,
            block,
            &mut got16,
            &bits(&bias16),
            args[0],
            args[1],
            args[2],
        )
        .unwrap();
        compare_bf16(&format!("bias_broadcast_bf16 {what}"), &got16, &want16, 0);
        let (_, pad) = split_rows(&from_bits(&got16), oc, ld);
        assert!(
            pad.iter().all(|x| x.to_f32() == sentinel),
            "{what}: bf16 padding written"
        );
    }
}

#[test]
fn shapes_the_bias_kernels_do_not_take_are_errors() {
    let (grid, block) = bias_backward_launch(7);
    let mut dbias = [0.0f32; 7];
    let err = emu::bias_backward(grid, block, &mut dbias, &[0.0; 30], 5, 7, 6).unwrap_err();
    assert!(err.contains("row stride ld (6) is below OC (7)"), "{err}");
    let err = emu::bias_backward(grid, block, &mut dbias, &[0.0; 34], 5, 7, 7).unwrap_err();
    assert!(err.contains("dout has 34 elements, expected 35"), "{err}");
    let err = emu::bias_backward(grid, block, &mut dbias[..6], &[0.0; 35], 5, 7, 7).unwrap_err();
    assert!(err.contains("dbias has 6 elements, expected 7"), "{err}");
}

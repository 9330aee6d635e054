//! models/gpt2/src/kernels/loss.cu, emulated, against the CPU kernels of
//! braid-gpt2 (loss.rs, fused_classifier.rs), with the agreement the GPU
//! tests demand (cuda_kernels: `softmax_and_crossentropy_match_cpu`,
//! `softmax_and_crossentropy_bf16`, `padded_rows`,
//! `fused_classifier_tasks`), on padded rows as the model stores them:
//! every input's padding columns hold NaN (a read of one would show), every
//! output's a sentinel that must survive bit for bit.
//!
//! The softmax sums in a block tree (f32, or double for bf16) with the C
//! library's expf where the CPU sums in f64 lanes with fastmath::exp, so
//! probabilities and losses agree to float tolerance and one bf16 ulp; the
//! backward kernels do the CPU's operations in its order, and agree bit for
//! bit (the GPU test asks that of bf16 only: NVRTC may fuse f32's `p·d + g`
//! into an FMA).

mod common;

use braid_gpt2::kernels::cpu::{
    classifier_losses, crossentropy_softmax_backward, fused_classifier, mean_loss,
    softmax_crossentropy_forward, softmax_forward, Bf16,
};
use braid_kernel_emu::{self as emu, Dim3};
use common::{
    assert_bits, bits, compare, compare_bf16, ids, linear, pad_rows, split_rows, to_bf16, values,
    widen,
};

/// (N, V, Vp): the GPU tests' vocabulary (333) padded as in `padded_rows`
/// (+19), rows not a multiple of anything; a vocabulary wider than the
/// block (1024), so threads take several columns, padded to a multiple of
/// 64; the first again, dense.
const SHAPES: [(usize, usize, usize); 3] = [(13, 333, 352), (3, 1500, 1536), (5, 333, 333)];

/// What the padding of an output holds before a kernel runs.
const SENTINEL: f32 = 7.0;

/// The fused classifier's: [`SHAPES`], then GPT-2's vocabulary as the model
/// pads it (each thread of a block several 16-byte vectors, one tail
/// column), and a dense row of whole vectors (no tail).
const CLASSIFIER_SHAPES: [(usize, usize, usize); 5] = [
    SHAPES[0],
    SHAPES[1],
    SHAPES[2],
    (2, 50257, 50304),
    (4, 1024, 1024),
];

/// The softmax launcher's configuration (loss.rs,
/// `launch_softmax_crossentropy`): one block of `SOFTMAX_BLOCK` (1024,
/// `pub(crate)` in loss.rs) threads per row.
fn row_blocks(n: usize) -> (Dim3, Dim3) {
    ((common::grid(n), 1, 1), (1024, 1, 1))
}

/// The fused classifier launcher's (fused_classifier.rs, `launch`): one
/// block of `CLASSIFIER_BLOCK` (256) threads per row.
fn classifier_blocks(n: usize) -> (Dim3, Dim3) {
    ((common::grid(n), 1, 1), (256, 1, 1))
}

/// `dense` (N, V) in rows of Vp padded with NaN: an input.
fn input(dense: &[f32], v: usize, vp: usize) -> Vec<f32> {
    pad_rows(dense, v, vp, f32::NAN)
}

/// The padding of `padded` still holds the sentinel, bit for bit.
#[track_caller]
fn padding_untouched(what: &str, padded: &[f32], v: usize, vp: usize) {
    let (_, pad) = split_rows(padded, v, vp);
    let bad = pad.iter().position(|x| x.to_bits() != SENTINEL.to_bits());
    assert_eq!(bad, None, "{what}: a padding element was written");
}

#[test]
fn f32_softmax_crossentropy_and_backward_match_the_cpu() {
    for (s, &(n, v, vp)) in SHAPES.iter().enumerate() {
        let what = format!("N {n}, V {v}, Vp {vp}");
        let logits = input(&values(n * v, 50 + s as u64, 9.0), v, vp);
        let targets = ids(n, v, 51 + s as u64);
        let [ni, vi, vpi] = [n, v, vp].map(|x| x as i32);
        let (grid, block) = row_blocks(n);

        let mut probs = pad_rows(&vec![0.0; n * v], v, vp, SENTINEL);
        let mut losses = vec![0.0f32; n];
        softmax_crossentropy_forward(&mut probs, &mut losses, &logits, &targets, 1, n, v, vp);

        // Softmax alone (null losses and targets).
        let mut e_probs = pad_rows(&vec![f32::NAN; n * v], v, vp, SENTINEL);
        emu::softmax_crossentropy_forward(grid, block, &mut e_probs, None, &logits, ni, vi, vpi)
            .unwrap();
        padding_untouched(&format!("softmax {what}"), &e_probs, v, vp);
        let mut cpu_sm = pad_rows(&vec![0.0; n * v], v, vp, SENTINEL);
        softmax_forward(&mut cpu_sm, &logits, 1, n, v, vp);
        assert_bits(
            &format!("cpu softmax = fused softmax {what}"),
            &cpu_sm,
            &probs,
        );
        compare(&format!("softmax {what}"), &e_probs, &probs, 1e-7, 1e-4);

        // Softmax and losses.
        let mut e_probs2 = pad_rows(&vec![f32::NAN; n * v], v, vp, SENTINEL);
        let mut e_losses = vec![f32::NAN; n];
        emu::softmax_crossentropy_forward(
            grid,
            block,
            &mut e_probs2,
            Some((&mut e_losses, &targets)),
            &logits,
            ni,
            vi,
            vpi,
        )
        .unwrap();
        assert_bits(
            &format!("softmax with and without the loss {what}"),
            &e_probs2,
            &e_probs,
        );
        compare(
            &format!("crossentropy losses {what}"),
            &e_losses,
            &losses,
            1e-5,
            1e-4,
        );

        // Backward from the CPU's probabilities, probs padded with NaN,
        // dlogits with the sentinel.
        let dloss = 0.5f32;
        let d = dloss / n as f32; // the launcher's scalar
        let start = values(n * v, 52 + s as u64, 0.01);
        let mut dlogits = pad_rows(&start, v, vp, SENTINEL);
        crossentropy_softmax_backward(&mut dlogits, &probs, &targets, dloss, 1, n, v, vp);
        let probs_in = input(&split_rows(&probs, v, vp).0, v, vp);
        let mut e_dlogits = pad_rows(&start, v, vp, SENTINEL);
        let (g, b) = linear(n * v, 256); // crossentropy_softmax_backward_cuda
        emu::crossentropy_softmax_backward(
            g,
            b,
            &mut e_dlogits,
            &probs_in,
            &targets,
            d,
            ni,
            vi,
            vpi,
        )
        .unwrap();
        padding_untouched(&format!("backward {what}"), &e_dlogits, v, vp);
        compare(
            &format!("backward {what}"),
            &e_dlogits,
            &dlogits,
            1e-7,
            1e-4,
        );
        // Bit for bit: the CPU's two roundings per element, in its order.
        assert_bits(&format!("backward {what}"), &e_dlogits, &dlogits);
    }
}

#[test]
fn bf16_softmax_crossentropy_and_backward_match_the_cpu() {
    for (s, &(n, v, vp)) in SHAPES.iter().enumerate() {
        let what = format!("N {n}, V {v}, Vp {vp}");
        let nan16 = Bf16::from_f32(f32::NAN);
        let (sent16, zero16) = (Bf16::from_f32(SENTINEL), Bf16::from_f32(0.0));
        let logits = pad_rows(&to_bf16(&values(n * v, 150 + s as u64, 9.0)), v, vp, nan16);
        let targets = ids(n, v, 151 + s as u64);
        let [ni, vi, vpi] = [n, v, vp].map(|x| x as i32);
        let (grid, block) = row_blocks(n);

        let mut probs = pad_rows(&vec![zero16; n * v], v, vp, sent16);
        let mut losses = vec![0.0f32; n];
        softmax_crossentropy_forward(&mut probs, &mut losses, &logits, &targets, 1, n, v, vp);

        let mut e_probs = bits(&pad_rows(&vec![nan16; n * v], v, vp, sent16));
        emu::softmax_crossentropy_forward_bf16(
            grid,
            block,
            &mut e_probs,
            None,
            &bits(&logits),
            ni,
            vi,
            vpi,
        )
        .unwrap();
        padding_untouched(&format!("softmax bf16 {what}"), &widen(&e_probs), v, vp);
        compare_bf16(&format!("softmax bf16 {what}"), &e_probs, &probs, 1);

        let mut e_probs2 = bits(&pad_rows(&vec![nan16; n * v], v, vp, sent16));
        let mut e_losses = vec![f32::NAN; n];
        emu::softmax_crossentropy_forward_bf16(
            grid,
            block,
            &mut e_probs2,
            Some((&mut e_losses, &targets)),
            &bits(&logits),
            ni,
            vi,
            vpi,
        )
        .unwrap();
        assert_eq!(e_probs2, e_probs, "{what}: probs with and without the loss");
        compare(
            &format!("losses bf16 {what}"),
            &e_losses,
            &losses,
            1e-6,
            1e-5,
        );

        // Backward from the CPU's probabilities: bit-identical (the GPU
        // test's bar).
        let dloss = 0.5f32;
        let d = dloss / n as f32;
        let start = to_bf16(&values(n * v, 152 + s as u64, 0.01));
        let mut dlogits = pad_rows(&start, v, vp, sent16);
        crossentropy_softmax_backward(&mut dlogits, &probs, &targets, dloss, 1, n, v, vp);
        let probs_in = pad_rows(&split_rows(&probs, v, vp).0, v, vp, nan16);
        let mut e_dlogits = bits(&pad_rows(&start, v, vp, sent16));
        let (g, b) = linear(n * v, 256);
        emu::crossentropy_softmax_backward_bf16(
            g,
            b,
            &mut e_dlogits,
            &bits(&probs_in),
            &targets,
            d,
            ni,
            vi,
            vpi,
        )
        .unwrap();
        compare_bf16(&format!("backward bf16 {what}"), &e_dlogits, &dlogits, 0);
    }
}

#[test]
fn loss_mean_matches_the_cpu() {
    // Fewer losses than the block, and more (a thread sums several).
    for (i, n) in [74usize, 1500].into_iter().enumerate() {
        let losses: Vec<f32> = values(n, 60 + i as u64, 2.0)
            .iter()
            .map(|x| x + 4.0)
            .collect();
        let mut out = [f32::NAN];
        // mean_loss_cuda: grid 1, block 1024.
        emu::loss_mean((1, 1, 1), (1024, 1, 1), &mut out, &losses, n as i32).unwrap();
        compare(
            &format!("loss_mean N {n}"),
            &out,
            &[mean_loss(&losses)],
            1e-6,
            1e-5,
        );
    }
}

/// The fused classifier on padded rows (input padding NaN), f32 and bf16:
/// the losses alone leave the logits (and their NaN padding) as they are;
/// with the gradient, the padding gets exactly 0. Against the CPU kernel
/// with fused_classifier_tasks's bars: losses 1e-6 + 1e-5 relative,
/// f32 gradient 1e-9 + 1e-5 relative, bf16 gradient one ulp.
#[test]
fn fused_classifier_matches_the_cpu() {
    for (s, &(n, v, vp)) in CLASSIFIER_SHAPES.iter().enumerate() {
        let what = format!("N {n}, V {v}, Vp {vp}");
        let real = values(n * v, 160 + s as u64, 9.0);
        let targets = ids(n, v, 161 + s as u64);
        let dloss = 0.5f32;
        let d = dloss / n as f32; // the launcher's scalar
        let [ni, vi, vpi] = [n, v, vp].map(|x| x as i32);
        let (grid, block) = classifier_blocks(n);

        // f32.
        let logits = input(&real, v, vp);
        let mut want_losses = vec![0.0f32; n];
        classifier_losses(&mut want_losses, &logits, &targets, n, v, vp);
        let mut want_grad = logits.clone();
        let mut want_losses2 = vec![0.0f32; n];
        fused_classifier(
            &mut want_grad,
            &mut want_losses2,
            &targets,
            Some(dloss),
            n,
            v,
            vp,
        );
        assert_bits(&format!("cpu losses {what}"), &want_losses2, &want_losses);

        let mut x = logits.clone();
        let mut got = vec![f32::NAN; n];
        emu::fused_classifier(
            grid, block, &mut x, &mut got, &targets, 0.0, false, ni, vi, vpi,
        )
        .unwrap();
        assert_bits(
            &format!("losses alone leave the logits {what}"),
            &x,
            &logits,
        );
        compare(
            &format!("fused losses {what}"),
            &got,
            &want_losses,
            1e-6,
            1e-5,
        );
        let mut got2 = vec![f32::NAN; n];
        emu::fused_classifier(
            grid, block, &mut x, &mut got2, &targets, d, true, ni, vi, vpi,
        )
        .unwrap();
        assert_bits(
            &format!("fused losses with the gradient {what}"),
            &got2,
            &got,
        );
        let (grad, pad) = split_rows(&x, v, vp);
        assert!(
            pad.iter().all(|&g| g.to_bits() == 0),
            "{what}: padding gradient"
        );
        compare(
            &format!("fused dlogits {what}"),
            &grad,
            &split_rows(&want_grad, v, vp).0,
            1e-9,
            1e-5,
        );

        // bf16.
        let logits16 = pad_rows(&to_bf16(&real), v, vp, Bf16::from_f32(f32::NAN));
        let mut want_losses = vec![0.0f32; n];
        classifier_losses(&mut want_losses, &logits16, &targets, n, v, vp);
        let mut want_grad16 = logits16.clone();
        let mut want_losses2 = vec![0.0f32; n];
        fused_classifier(
            &mut want_grad16,
            &mut want_losses2,
            &targets,
            Some(dloss),
            n,
            v,
            vp,
        );
        let mut x16 = bits(&logits16);
        let mut got = vec![f32::NAN; n];
        emu::fused_classifier_bf16(
            grid, block, &mut x16, &mut got, &targets, 0.0, false, ni, vi, vpi,
        )
        .unwrap();
        assert_eq!(
            x16,
            bits(&logits16),
            "{what}: bf16 losses alone leave the logits"
        );
        compare(
            &format!("fused losses bf16 {what}"),
            &got,
            &want_losses,
            1e-6,
            1e-5,
        );
        let mut got2 = vec![f32::NAN; n];
        emu::fused_classifier_bf16(
            grid, block, &mut x16, &mut got2, &targets, d, true, ni, vi, vpi,
        )
        .unwrap();
        compare(
            &format!("fused losses bf16 with the gradient {what}"),
            &got2,
            &want_losses2,
            1e-6,
            1e-5,
        );
        let (grad16, pad16) = split_rows(&x16, v, vp);
        assert!(
            pad16.iter().all(|&g| g == 0),
            "{what}: bf16 padding gradient"
        );
        compare_bf16(
            &format!("fused dlogits bf16 {what}"),
            &grad16,
            &split_rows(&want_grad16, v, vp).0,
            1,
        );
    }
}

/// A target in the padding (not below V; the CPU kernel refuses it): the
/// kernel's documented answer is a NaN loss and no one-hot term, and nothing
/// outside the real columns is read (the padding holds NaN). The other rows
/// are unchanged, and the row's gradient is the one of a real target `t`
/// with `d` added back at `t`.
#[test]
fn fused_classifier_target_in_the_padding_gives_a_nan_loss() {
    let (n, v, vp) = (4usize, 37usize, 48usize);
    let logits = input(&values(n * v, 170, 3.0), v, vp);
    let mut targets = ids(n, v, 171);
    let (grid, block) = classifier_blocks(n);
    let d = 0.25f32;
    let run = |targets: &[u32]| {
        let (mut x, mut l) = (logits.clone(), vec![0.0f32; n]);
        emu::fused_classifier(grid, block, &mut x, &mut l, targets, d, true, 4, 37, 48).unwrap();
        (x, l)
    };
    let (x0, l0) = run(&targets);
    let t = targets[2] as usize;
    targets[2] = v as u32 + 3;
    let (x1, l1) = run(&targets);
    assert!(l1[2].is_nan(), "loss {}", l1[2]);
    for r in [0, 1, 3] {
        assert_eq!(l1[r].to_bits(), l0[r].to_bits(), "row {r}");
    }
    for (i, (&a, &b)) in x1.iter().zip(&x0).enumerate() {
        if i == 2 * vp + t {
            assert_eq!((a - d).to_bits(), b.to_bits(), "the one-hot element");
        } else {
            assert_eq!(a.to_bits(), b.to_bits(), "element {i}");
        }
    }
}

/// The 16-byte path (rows 16-byte aligned: Vp 352) and the element-by-element
/// one (Vp 333, bf16 rows 666 bytes apart; Vp 337 for f32) do the same
/// arithmetic: the same losses and gradients, bit for bit, f32 and bf16.
#[test]
fn fused_classifier_vector_and_scalar_paths_agree() {
    let (n, v) = (13usize, 333usize);
    let real = values(n * v, 180, 9.0);
    let targets = ids(n, v, 181);
    let (grid, block) = classifier_blocks(n);
    let d = 0.5 / n as f32;
    let run32 = |vp: usize| {
        let mut x = input(&real, v, vp);
        let mut l = vec![f32::NAN; n];
        emu::fused_classifier(
            grid, block, &mut x, &mut l, &targets, d, true, n as i32, v as i32, vp as i32,
        )
        .unwrap();
        (split_rows(&x, v, vp).0, l)
    };
    let (g_vec, l_vec) = run32(352);
    let (g_sc, l_sc) = run32(337);
    assert_bits("f32 losses, 16-byte = scalar", &l_vec, &l_sc);
    assert_bits("f32 dlogits, 16-byte = scalar", &g_vec, &g_sc);
    let run16 = |vp: usize| {
        let mut x = bits(&pad_rows(&to_bf16(&real), v, vp, Bf16::from_f32(f32::NAN)));
        let mut l = vec![f32::NAN; n];
        emu::fused_classifier_bf16(
            grid, block, &mut x, &mut l, &targets, d, true, n as i32, v as i32, vp as i32,
        )
        .unwrap();
        (split_rows(&x, v, vp).0, l)
    };
    let (g_vec, l_vec) = run16(352);
    let (g_sc, l_sc) = run16(333);
    assert_bits("bf16 losses, 16-byte = scalar", &l_vec, &l_sc);
    assert_eq!(g_vec, g_sc, "bf16 dlogits, 16-byte = scalar");
}

#[test]
fn shapes_the_loss_kernels_do_not_take_are_errors() {
    let (grid, block) = row_blocks(2);
    let (mut probs, logits) = (vec![0.0f32; 10], vec![0.0f32; 10]);
    let mut losses = [0.0f32; 2];
    // A target not below V: the kernel would read past the row.
    let err = emu::softmax_crossentropy_forward(
        grid,
        block,
        &mut probs,
        Some((&mut losses, &[1, 4])),
        &logits,
        2,
        4,
        5,
    )
    .unwrap_err();
    assert!(err.contains("targets[1] = 4 is not below 4"), "{err}");
    let err = emu::softmax_crossentropy_forward(grid, block, &mut probs, None, &logits, 2, 6, 5)
        .unwrap_err();
    assert!(err.contains("row stride Vp (5) is below V (6)"), "{err}");
}

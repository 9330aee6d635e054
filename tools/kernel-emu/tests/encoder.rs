//! models/gpt2/src/kernels/encoder.cu, emulated, against the CPU kernels
//! of braid-gpt2 (encoder.rs). Every output element is summed in the CPU's
//! order and rounded once, so the emulated kernels are bit-identical to the
//! CPU in f32 and bf16, the bar of the GPU tests (cuda_kernels:
//! `encoder_matches_cpu`, `encoder_bf16`).

mod common;

use braid_gpt2::kernels::cpu::{encoder_backward, encoder_forward, Bf16};
use braid_kernel_emu::{self as emu, Dim3};
use common::{assert_bits, bits, compare_bf16, linear, to_bf16, values};

/// (B, T, C, V): the GPU tests' B, T and V with channels past one block of
/// the token kernel (128) and not a multiple of 32; more positions than
/// one tile of the links kernel (B·T = 300 > 256), a small vocabulary (many
/// repeats per token).
const SHAPES: [(usize, usize, usize, usize); 2] = [(2, 37, 150, 333), (3, 100, 20, 50)];

/// `encoder_backward_wte`'s parts (`WTE_PARTS` in encoder.rs, private):
/// the grid's y.
const WTE_PARTS: u32 = 32;

/// The token-gradient launch (encoder.rs, `encoder_backward_cuda`): grid
/// `(ceil(C / 128), WTE_PARTS)`, block 128.
fn wte_launch(c: usize) -> (Dim3, Dim3) {
    ((common::grid(c.div_ceil(128)), WTE_PARTS, 1), (128, 1, 1))
}

/// The bf16 token-gradient launch: one block of 128 per position.
fn wte_bf16_launch(bt: usize) -> (Dim3, Dim3) {
    ((common::grid(bt), 1, 1), (128, 1, 1))
}

/// Token ids below `v` with repeats (cuda_kernels's `tokens`).
fn tokens(n: usize, v: usize, seed: u64) -> Vec<u32> {
    (0..n)
        .map(|i| ((i as u64 * 2_654_435_761 + seed) % 29) as u32 * 11 % v as u32)
        .collect()
}

/// `encoder_backward_links`'s contract, position by position.
fn links_by_definition(tokens: &[u32]) -> Vec<u32> {
    let bt = tokens.len();
    (0..bt)
        .map(|i| {
            let next = (i + 1..bt).find(|&r| tokens[r] == tokens[i]).unwrap_or(bt);
            let repeat = tokens[..i].contains(&tokens[i]);
            next as u32 | (u32::from(repeat) << 31)
        })
        .collect()
}

#[test]
fn f32_kernels_are_bit_identical_to_the_cpu() {
    for (s, &(b, t, c, v)) in SHAPES.iter().enumerate() {
        let what = format!("B {b}, T {t}, C {c}, V {v}");
        let (bt, max_t) = (b * t, t + 5); // wpe may have more rows than T
        let (wte, wpe) = (values(v * c, 1 + s as u64, 1.0), values(max_t * c, 2, 1.0));
        let tok = tokens(bt, v, 3 + s as u64);
        let [bi, ti, ci] = [b, t, c].map(|x| x as i32);

        let mut want = vec![0.0; bt * c];
        encoder_forward(&mut want, &tok, &wte, &wpe, b, t, c);
        let mut got = vec![f32::NAN; bt * c];
        let (g, bl) = linear(bt * c, 256); // encoder_forward_cuda
        emu::encoder_forward(g, bl, &mut got, &tok, &wte, &wpe, bi, ti, ci).unwrap();
        assert_bits(&format!("encoder_forward {what}"), &got, &want);

        let dout = values(bt * c, 4 + s as u64, 1.0);
        let (dwte0, dwpe0) = (values(v * c, 5, 0.1), values(max_t * c, 6, 0.1));
        let (mut dwte, mut dwpe) = (dwte0.clone(), dwpe0.clone());
        encoder_backward(&mut dwte, &mut dwpe, &dout, &tok, b, t, c);
        let mut e_dwpe = dwpe0.clone();
        let (g, bl) = linear(t * c, 256); // encoder_backward_cuda
        emu::encoder_backward_wpe(g, bl, &mut e_dwpe, &dout, bi, ti, ci).unwrap();
        assert_bits(&format!("encoder_backward dwpe {what}"), &e_dwpe, &dwpe);
        let mut e_dwte = dwte0.clone();
        let (g, bl) = wte_launch(c);
        emu::encoder_backward_wte(g, bl, &mut e_dwte, &dout, &tok, bt as i32, ci).unwrap();
        assert_bits(&format!("encoder_backward dwte {what}"), &e_dwte, &dwte);
    }
}

#[test]
fn bf16_kernels_are_bit_identical_to_the_cpu() {
    for (s, &(b, t, c, v)) in SHAPES.iter().enumerate() {
        let what = format!("B {b}, T {t}, C {c}, V {v}");
        let (bt, max_t) = (b * t, t + 5);
        let (wte, wpe) = (
            to_bf16(&values(v * c, 101 + s as u64, 1.0)),
            to_bf16(&values(max_t * c, 102, 1.0)),
        );
        let tok = tokens(bt, v, 103 + s as u64);
        let [bi, ti, ci] = [b, t, c].map(|x| x as i32);

        let mut want = vec![Bf16(0); bt * c];
        encoder_forward(&mut want, &tok, &wte, &wpe, b, t, c);
        let mut got = vec![0xffffu16; bt * c];
        let (g, bl) = linear(bt * c, 256);
        emu::encoder_forward_bf16(g, bl, &mut got, &tok, &bits(&wte), &bits(&wpe), bi, ti, ci)
            .unwrap();
        compare_bf16(&format!("encoder_forward bf16 {what}"), &got, &want, 0);

        // Small gradients and a large dout: a repeated token's row rounded
        // after each contribution instead of once would differ.
        let dout = to_bf16(&values(bt * c, 104 + s as u64, 1.0));
        let (dwte0, dwpe0) = (
            to_bf16(&values(v * c, 105, 0.01)),
            to_bf16(&values(max_t * c, 106, 0.01)),
        );
        let (mut dwte, mut dwpe) = (dwte0.clone(), dwpe0.clone());
        encoder_backward(&mut dwte, &mut dwpe, &dout, &tok, b, t, c);

        let mut e_dwpe = bits(&dwpe0);
        let (g, bl) = linear(t * c, 256);
        emu::encoder_backward_wpe_bf16(g, bl, &mut e_dwpe, &bits(&dout), bi, ti, ci).unwrap();
        compare_bf16(
            &format!("encoder_backward bf16 dwpe {what}"),
            &e_dwpe,
            &dwpe,
            0,
        );

        // The launcher's two kernels: the chains, then the token gradient.
        let mut links = vec![u32::MAX; bt];
        let (g, bl) = linear(bt, 256);
        emu::encoder_backward_links(g, bl, &mut links, &tok, bt as i32).unwrap();
        assert_eq!(links, links_by_definition(&tok), "links {what}");
        let mut e_dwte = bits(&dwte0);
        let (g, bl) = wte_bf16_launch(bt);
        emu::encoder_backward_wte_bf16(
            g,
            bl,
            &mut e_dwte,
            &bits(&dout),
            &tok,
            &links,
            bt as i32,
            ci,
        )
        .unwrap();
        compare_bf16(
            &format!("encoder_backward bf16 dwte {what}"),
            &e_dwte,
            &dwte,
            0,
        );
    }
}

/// The bf16 token kernel on more channels than one pass of its block takes
/// (8 per thread: 1,100 channels are 5 passes of a 32-thread block, the
/// last one partial), bit-identical with the CPU.
#[test]
fn bf16_token_gradient_takes_several_passes_over_the_channels() {
    let (b, t, c, v) = (2, 21, 1100, 17);
    let bt = b * t;
    let tok = tokens(bt, v, 41);
    let dout = to_bf16(&values(bt * c, 42, 1.0));
    let dwte0 = to_bf16(&values(v * c, 43, 0.01));
    let (mut dwte, mut dwpe) = (dwte0.clone(), to_bf16(&values(t * c, 44, 0.01)));
    encoder_backward(&mut dwte, &mut dwpe, &dout, &tok, b, t, c);
    let links = links_by_definition(&tok);
    let mut e_dwte = bits(&dwte0);
    emu::encoder_backward_wte_bf16(
        (common::grid(bt), 1, 1),
        (32, 1, 1),
        &mut e_dwte,
        &bits(&dout),
        &tok,
        &links,
        bt as i32,
        c as i32,
    )
    .unwrap();
    compare_bf16("encoder_backward bf16 dwte, C 1100", &e_dwte, &dwte, 0);
}

/// The token kernels give the same bits for any number of parts (the
/// grid's y), as their comments promise.
#[test]
fn token_gradient_does_not_depend_on_the_parts() {
    let (b, t, c, v) = SHAPES[1];
    let bt = b * t;
    let tok = tokens(bt, v, 7);
    let dout = values(bt * c, 8, 1.0);
    let run = |parts: u32| {
        let mut dwte = values(v * c, 9, 0.1);
        let block = (128, 1, 1);
        emu::encoder_backward_wte((1, parts, 1), block, &mut dwte, &dout, &tok, bt as i32, 20)
            .unwrap();
        dwte
    };
    let base = run(WTE_PARTS);
    for parts in [1, 7, 64] {
        assert_bits(&format!("{parts} parts"), &run(parts), &base);
    }
}

#[test]
fn shapes_the_encoder_kernels_do_not_take_are_errors() {
    let (mut out, wte, wpe) = (vec![0.0f32; 8], vec![0.0f32; 6], vec![0.0f32; 4]);
    // A token not below V = 3.
    let err = emu::encoder_forward(
        (1, 1, 1),
        (256, 1, 1),
        &mut out,
        &[0, 3, 1, 2],
        &wte,
        &wpe,
        2,
        2,
        2,
    )
    .unwrap_err();
    assert!(err.contains("tokens[1] = 3 is not below 3"), "{err}");
    // wpe with fewer than T rows.
    let err = emu::encoder_forward(
        (1, 1, 1),
        (256, 1, 1),
        &mut out,
        &[0, 1, 1, 2],
        &wte,
        &wpe[..2],
        2,
        2,
        2,
    )
    .unwrap_err();
    assert!(err.contains("wpe has 2 elements"), "{err}");
    // A links block wider than its shared tile.
    let mut links = [0u32; 4];
    let err = emu::encoder_backward_links((1, 1, 1), (512, 1, 1), &mut links, &[0, 1, 1, 2], 4)
        .unwrap_err();
    assert!(err.contains("at most 256"), "{err}");
}

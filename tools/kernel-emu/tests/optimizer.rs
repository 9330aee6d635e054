//! models/gpt2/src/kernels/adamw.cu and norm.cu, emulated, against the CPU
//! kernels of braid-gpt2 (adamw.rs, norm.rs), with the agreement the GPU
//! tests demand (cuda_kernels: `adamw_matches_cpu`, `adamw_mixed_bf16`,
//! `adamw_step_scalars_match_the_step_number`,
//! `grad_norm_clip_and_scale_match_cpu`, `grad_norm_and_scale_bf16`).
//! AdamW does the CPU's operations in its order: bit for bit in every
//! variant (the GPU test asks that of the mixed kernels; the f32 kernel is
//! held to float tolerance there, as NVRTC may contract it into FMAs). The
//! norm's double sums are in a tree order: 1e-12 relative.

mod common;

use braid_gpt2::checkpoint::AdamWHyper;
use braid_gpt2::kernels::adamw::step_scalars;
use braid_gpt2::kernels::cpu::{
    adamw_update, adamw_update_mixed, clip_scale, global_norm, grad_norm_sq, scale_in_place,
};
use braid_gpt2::kernels::norm::GRAD_NORM_PARTIALS;
use braid_kernel_emu::{self as emu, AdamwScalars};
use common::{assert_bits, bits, compare, compare_bf16, linear, to_bf16, values};

/// Elements: 16 blocks of 256 and a partial one.
const N: usize = 4099;

/// cuda_kernels's TEST_ADAMW (models/gpt2/tests/common): weight decay
/// and a second moment that moves.
const H: AdamWHyper = AdamWHyper {
    learning_rate: 1e-3,
    beta1: 0.9,
    beta2: 0.95,
    eps: 1e-8,
    weight_decay: 0.1,
};

/// The launchers' scalars for `step` (adamw.rs, `DevStep::args`:
/// `StepScalars::for_step`, which `step_scalars` returns).
fn scalars(step: u64) -> AdamwScalars {
    let [step_size, bc2_sqrt, decay] = step_scalars(step, H);
    AdamwScalars {
        step_size,
        bc2_sqrt,
        beta1: H.beta1,
        beta2: H.beta2,
        eps: H.eps,
        decay,
    }
}

#[test]
fn adamw_is_bit_identical_to_the_cpu() {
    // adamw_update_cuda: grid ceil(N / 256), block 256.
    let (grid, block) = linear(N, 256);
    let n = N as i64;
    for grad_scale in [None, Some(0.37f32)] {
        let what = format!("grad_scale {grad_scale:?}");
        let mut p = values(N, 60, 1.0);
        let (mut m, mut v) = (vec![0.0f32; N], vec![0.0f32; N]);
        let (mut ep, mut em, mut ev) = (p.clone(), m.clone(), v.clone());
        let gs = grad_scale.map(|s| [s]);
        for step in 1..=3u64 {
            let grads = values(N, 60 + step, 0.5);
            let mut scaled = grads.clone();
            if let Some(s) = grad_scale {
                scale_in_place(&mut scaled, s);
            }
            let (lr, b1, b2, eps, wd) = (H.learning_rate, H.beta1, H.beta2, H.eps, H.weight_decay);
            adamw_update(&mut p, &scaled, &mut m, &mut v, step, lr, b1, b2, eps, wd);
            emu::adamw_update(
                grid,
                block,
                &mut ep,
                &grads,
                &mut em,
                &mut ev,
                gs.as_ref().map(|s| &s[..]),
                n,
                scalars(step),
                None,
            )
            .unwrap();
        }
        // The GPU test's bars, then bit for bit.
        compare(&format!("adamw params {what}"), &ep, &p, 1e-6, 1e-5);
        compare(&format!("adamw m {what}"), &em, &m, 1e-7, 1e-5);
        compare(&format!("adamw v {what}"), &ev, &v, 1e-9, 1e-5);
        assert_bits(&format!("adamw params {what}"), &ep, &p);
        assert_bits(&format!("adamw m {what}"), &em, &m);
        assert_bits(&format!("adamw v {what}"), &ev, &v);
    }
}

#[test]
fn adamw_mixed_is_bit_identical_to_the_cpu() {
    let (grid, block) = linear(N.div_ceil(4), 256); // adamw_update_mixed_cuda
    let n = N as i64;
    for grad_scale in [None, Some(0.37f32)] {
        let what = format!("grad_scale {grad_scale:?}");
        let gs = grad_scale.map(|s| [s]);
        let gs = gs.as_ref().map(|s| &s[..]);

        // bf16 stored weights and gradients.
        let mut master = values(N, 160, 1.0);
        let mut params = to_bf16(&master);
        let (mut m, mut v) = (vec![0.0f32; N], vec![0.0f32; N]);
        let (mut e_params, mut e_master) = (bits(&params), master.clone());
        let (mut em, mut ev) = (m.clone(), v.clone());
        // f32 stored weights.
        let mut master32 = master.clone();
        let mut params32 = master.clone();
        let (mut m32, mut v32) = (m.clone(), v.clone());
        let (mut e_params32, mut e_master32) = (params32.clone(), master32.clone());
        let (mut em32, mut ev32) = (m.clone(), v.clone());
        for step in 1..=3u64 {
            let grads = to_bf16(&values(N, 160 + step, 0.5));
            adamw_update_mixed(
                &mut params,
                &mut master,
                &grads,
                &mut m,
                &mut v,
                grad_scale,
                step,
                H,
            );
            emu::adamw_update_mixed_bf16(
                grid,
                block,
                &mut e_params,
                &mut e_master,
                &bits(&grads),
                &mut em,
                &mut ev,
                gs,
                n,
                scalars(step),
                None,
            )
            .unwrap();

            let grads32 = values(N, 170 + step, 0.5);
            adamw_update_mixed(
                &mut params32,
                &mut master32,
                &grads32,
                &mut m32,
                &mut v32,
                grad_scale,
                step,
                H,
            );
            emu::adamw_update_mixed_f32(
                grid,
                block,
                &mut e_params32,
                &mut e_master32,
                &grads32,
                &mut em32,
                &mut ev32,
                gs,
                n,
                scalars(step),
                None,
            )
            .unwrap();
        }
        compare_bf16(&format!("mixed bf16 params {what}"), &e_params, &params, 0);
        assert_bits(&format!("mixed bf16 master {what}"), &e_master, &master);
        assert_bits(&format!("mixed bf16 m {what}"), &em, &m);
        assert_bits(&format!("mixed bf16 v {what}"), &ev, &v);
        assert_bits(&format!("mixed f32 params {what}"), &e_params32, &params32);
        assert_bits(&format!("mixed f32 master {what}"), &e_master32, &master32);
        assert_bits(&format!("mixed f32 m {what}"), &em32, &m32);
        assert_bits(&format!("mixed f32 v {what}"), &ev32, &v32);
    }
}

/// The step's scalars read from a buffer (what a recorded step replays)
/// give the same bits as the host's; another step's scalars another update.
#[test]
fn adamw_step_scalars_from_a_buffer_equal_the_hosts() {
    let (grid, block) = linear(N, 256);
    let (n, step) = (N as i64, 3u64);
    let (p0, grads) = (values(N, 70, 1.0), values(N, 71, 0.5));
    let unused = AdamwScalars {
        step_size: 0.0,
        bc2_sqrt: 1.0,
        decay: 1.0,
        ..scalars(1)
    };
    let run = |s: AdamwScalars, buf: Option<&[f32]>| {
        let (mut p, mut m, mut v) = (p0.clone(), vec![0.0; N], vec![0.0; N]);
        emu::adamw_update(grid, block, &mut p, &grads, &mut m, &mut v, None, n, s, buf).unwrap();
        let (mut sp, mut master) = (bits(&to_bf16(&p0)), p0.clone());
        let (mut mm, mut mv) = (vec![0.0; N], vec![0.0; N]);
        let g16 = bits(&to_bf16(&grads));
        emu::adamw_update_mixed_bf16(
            grid,
            block,
            &mut sp,
            &mut master,
            &g16,
            &mut mm,
            &mut mv,
            None,
            n,
            s,
            buf,
        )
        .unwrap();
        (p, m, v, sp, master, mm, mv)
    };
    let by_number = run(scalars(step), None);
    let by_buffer = run(unused, Some(&step_scalars(step, H)));
    assert!(by_number == by_buffer, "scalars from a buffer differ");
    assert!(run(unused, Some(&step_scalars(1, H))).0 != by_number.0);
}

/// The launchers' two stages (norm.rs, `grad_norm_sq_cuda`): a grid of
/// `GRAD_NORM_PARTIALS` blocks of 512, then one block of 1024.
fn norm_sq(grads_f32: Option<&[f32]>, grads_bf16: Option<&[u16]>, n: usize) -> f64 {
    let p = GRAD_NORM_PARTIALS;
    let mut partials = vec![f64::NAN; p];
    let (grid, block) = ((p as u32, 1, 1), (512, 1, 1));
    match (grads_f32, grads_bf16) {
        (Some(g), _) => emu::grad_norm_sq_partial(grid, block, &mut partials, g, n as i64),
        (_, Some(g)) => emu::grad_norm_sq_partial_bf16(grid, block, &mut partials, g, n as i64),
        _ => unreachable!(),
    }
    .unwrap();
    let mut out = [f64::NAN];
    emu::grad_norm_sq_finalize((1, 1, 1), (1024, 1, 1), &mut out, &partials, p as i32).unwrap();
    out[0]
}

#[test]
fn grad_norm_clip_and_scale_match_the_cpu() {
    // The GPU test's length: more elements than the grid's threads.
    let n = 300_007;
    let grads = values(n, 70, 0.5);
    let got = norm_sq(Some(&grads), None, n);
    let want = grad_norm_sq(&grads);
    let rel = ((got - want) / want).abs();
    println!("grad_norm_sq: emulated {got} cpu {want}, relative {rel:e}");
    assert!(rel <= 1e-12, "grad_norm_sq: {got} vs {want}");

    // grad_clip_scale_cuda: grid 1, block 1; K partial norms summed in order.
    let max_norm = (want.sqrt() * 0.5) as f32;
    for norm_sq_parts in [vec![got], vec![got * 0.25, got * 0.5, got * 0.25]] {
        let mut s = [f32::NAN];
        let k = norm_sq_parts.len() as i32;
        emu::grad_clip_scale((1, 1, 1), (1, 1, 1), &mut s, &norm_sq_parts, k, max_norm).unwrap();
        let cpu = clip_scale(global_norm(&norm_sq_parts), max_norm);
        compare(&format!("grad_clip_scale K {k}"), &s, &[cpu], 0.0, 1e-6);
        assert_bits(&format!("grad_clip_scale K {k}"), &s, &[cpu]);
    }
    // A norm that is not finite: a factor of 1.
    let mut s = [f32::NAN];
    emu::grad_clip_scale((1, 1, 1), (1, 1, 1), &mut s, &[1.0, f64::INFINITY], 2, 1.0).unwrap();
    assert_eq!(s[0], clip_scale(f64::INFINITY, 1.0));
    assert_eq!(s[0], 1.0);

    // Scaling: by a device factor, then by a host one (norm.rs,
    // `scale_in_place_by_cuda`, `scale_in_place_cuda`: grid ceil(N / 256),
    // block 256). Bit-exact.
    let (grid, block) = linear(n, 256);
    let factor = [0.3f32];
    let mut want = grads.clone();
    scale_in_place(&mut want, factor[0]);
    let mut got = grads.clone();
    emu::scale_inplace_dev(grid, block, &mut got, n as i64, &factor).unwrap();
    assert_bits("scale_inplace_dev", &got, &want);
    scale_in_place(&mut want, 0.25);
    emu::scale_inplace(grid, block, &mut got, n as i64, 0.25).unwrap();
    assert_bits("scale_inplace", &got, &want);
}

#[test]
fn bf16_grad_norm_and_scale_match_the_cpu() {
    let n = 300_007;
    let grads = to_bf16(&values(n, 170, 0.5));
    let got = norm_sq(None, Some(&bits(&grads)), n);
    let want = grad_norm_sq(&grads);
    let rel = ((got - want) / want).abs();
    println!("grad_norm_sq bf16: emulated {got} cpu {want}, relative {rel:e}");
    assert!(rel <= 1e-12, "grad_norm_sq bf16: {got} vs {want}");

    let (grid, block) = linear(n, 256);
    let mut want_scaled = grads.clone();
    scale_in_place(&mut want_scaled, 0.37);
    let mut e = bits(&grads);
    emu::scale_inplace_dev_bf16(grid, block, &mut e, n as i64, &[0.37]).unwrap();
    compare_bf16("scale_inplace_dev bf16", &e, &want_scaled, 0);
    scale_in_place(&mut want_scaled, 0.25);
    emu::scale_inplace_bf16(grid, block, &mut e, n as i64, 0.25).unwrap();
    compare_bf16("scale_inplace bf16", &e, &want_scaled, 0);
}

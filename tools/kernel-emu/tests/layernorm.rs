//! models/gpt2/src/kernels/layernorm.cu, emulated, against the CPU kernels
//! of braid-gpt2 (layernorm.rs), with the agreement the GPU tests demand
//! (cuda_kernels: `layernorm_matches_cpu_and_is_deterministic`,
//! `layernorm_bf16`, `residual_layernorm_tasks`). The statistics are warp
//! trees (f32, or double for bf16) where the CPU sums rows in f64, and the
//! parameter gradients are summed in row chunks, each by 8 warps, where the
//! CPU adds rows in turn: float tolerance and one bf16 ulp, not bit for bit. The fused
//! residual kernels equal the unfused ones bit for bit.

mod common;

use braid_gpt2::kernels::cpu::{layernorm_backward, layernorm_forward, residual_forward, Bf16};
use braid_gpt2::kernels::layernorm::{
    layernorm_backward_residual, layernorm_residual_forward, params_chunks,
};
use braid_kernel_emu::{self as emu, Dim3};
use common::{assert_bits, bits, compare, compare_bf16, to_bf16, values, warp_rows};

/// (N, C): rows not a multiple of the 8 a block takes, channels not a
/// multiple of 32 (the parameter kernels' last block partial); fewer rows
/// than a parameter block's 8 warps; a row of one channel past a warp; rows
/// in three chunks of the parameter sums, the last one short.
const SHAPES: [(usize, usize); 4] = [(37, 83), (5, 40), (9, 33), (700, 35)];

/// The parameter gradients as the launcher (layernorm.rs, `backward_cuda`)
/// runs them: the row chunks' sums (`params_chunks(N)` chunks, a block of 8
/// warps per 32 channels and chunk) into a scratch of NaNs, then one thread
/// per channel adds them to `dweight` and `dbias`.
fn params<S: Copy>(
    partial: impl Fn(Dim3, Dim3, &mut [f32], &[S], &[S], &[f32], &[f32], i32, i32) -> Result<(), String>,
    finish: impl Fn(Dim3, Dim3, &mut [S], &mut [S], &[f32], i32, i32) -> Result<(), String>,
    (dw, db): (&mut [S], &mut [S]),
    (dout, inp, mean, rstd): (&[S], &[S], &[f32], &[f32]),
    n: usize,
    c: usize,
) {
    let chunks = params_chunks(n);
    let mut part = vec![f32::NAN; chunks * 2 * c];
    let grid = (c.div_ceil(32) as u32, chunks as u32, 1);
    partial(
        grid,
        (32 * 8, 1, 1),
        &mut part,
        dout,
        inp,
        mean,
        rstd,
        n as i32,
        c as i32,
    )
    .unwrap();
    assert!(
        part.iter().all(|x| x.is_finite()),
        "every chunk sum written"
    );
    let (g, b) = common::linear(c, 256);
    finish(g, b, dw, db, &part, c as i32, chunks as i32).unwrap();
}

/// The inputs of one case: `inp` (and `inp2`, its residual partner),
/// `weight` near 1, `bias`, `dout`, starting gradients.
struct Case {
    inp: Vec<f32>,
    inp2: Vec<f32>,
    weight: Vec<f32>,
    bias: Vec<f32>,
    dout: Vec<f32>,
    dinp0: Vec<f32>,
    dw0: Vec<f32>,
    db0: Vec<f32>,
}

fn case(n: usize, c: usize, seed: u64) -> Case {
    Case {
        inp: values(n * c, seed, 2.0).iter().map(|x| x + 0.3).collect(),
        inp2: values(n * c, seed + 1, 1.0),
        weight: values(c, seed + 2, 0.3).iter().map(|x| 1.0 + x).collect(),
        bias: values(c, seed + 3, 0.3),
        dout: values(n * c, seed + 4, 1.0),
        dinp0: values(n * c, seed + 5, 0.1),
        dw0: values(c, seed + 6, 0.1),
        db0: values(c, seed + 7, 0.1),
    }
}

#[test]
fn f32_kernels_match_the_cpu() {
    for (s, &(n, c)) in SHAPES.iter().enumerate() {
        let what = format!("N {n}, C {c}");
        let x = case(n, c, 10 * s as u64);
        let [ni, ci] = [n, c].map(|v| v as i32);
        let (grid, block) = warp_rows(n);

        let (mut out, mut mean, mut rstd) = (vec![0.0; n * c], vec![0.0; n], vec![0.0; n]);
        layernorm_forward(
            &mut out, &mut mean, &mut rstd, &x.inp, &x.weight, &x.bias, 1, n, c,
        );
        let (mut e_out, mut e_mean, mut e_rstd) =
            (vec![f32::NAN; n * c], vec![f32::NAN; n], vec![f32::NAN; n]);
        emu::layernorm_forward(
            grid,
            block,
            &mut e_out,
            &mut e_mean,
            &mut e_rstd,
            &x.inp,
            &x.weight,
            &x.bias,
            ni,
            ci,
        )
        .unwrap();
        compare(&format!("forward out {what}"), &e_out, &out, 1e-5, 1e-4);
        compare(&format!("forward mean {what}"), &e_mean, &mean, 1e-6, 1e-4);
        compare(&format!("forward rstd {what}"), &e_rstd, &rstd, 1e-6, 1e-4);

        // Backward from the CPU's statistics.
        let (mut dinp, mut dw, mut db) = (x.dinp0.clone(), x.dw0.clone(), x.db0.clone());
        layernorm_backward(
            &mut dinp, &mut dw, &mut db, &x.dout, &x.inp, &x.weight, &mean, &rstd, 1, n, c,
        );
        let mut e_dinp = x.dinp0.clone();
        emu::layernorm_backward_input(
            grid,
            block,
            &mut e_dinp,
            None,
            &x.dout,
            &x.inp,
            &x.weight,
            &mean,
            &rstd,
            ni,
            ci,
        )
        .unwrap();
        compare(&format!("backward dinp {what}"), &e_dinp, &dinp, 1e-5, 1e-4);
        let (mut e_dw, mut e_db) = (x.dw0.clone(), x.db0.clone());
        params(
            emu::layernorm_backward_params_partial,
            emu::layernorm_backward_params_finish,
            (&mut e_dw, &mut e_db),
            (&x.dout, &x.inp, &mean, &rstd),
            n,
            c,
        );
        compare(&format!("backward dweight {what}"), &e_dw, &dw, 1e-4, 1e-4);
        compare(&format!("backward dbias {what}"), &e_db, &db, 1e-4, 1e-4);
    }
}

#[test]
fn bf16_kernels_match_the_cpu() {
    for (s, &(n, c)) in SHAPES.iter().enumerate() {
        let what = format!("N {n}, C {c}");
        let x = case(n, c, 100 + 10 * s as u64);
        let [inp, weight, bias, dout, dinp0, dw0, db0] = [
            &x.inp, &x.weight, &x.bias, &x.dout, &x.dinp0, &x.dw0, &x.db0,
        ]
        .map(|v| to_bf16(v));
        let [ni, ci] = [n, c].map(|v| v as i32);
        let (grid, block) = warp_rows(n);

        let (mut out, mut mean, mut rstd) = (vec![Bf16(0); n * c], vec![0.0; n], vec![0.0; n]);
        layernorm_forward(
            &mut out, &mut mean, &mut rstd, &inp, &weight, &bias, 1, n, c,
        );
        let (mut e_out, mut e_mean, mut e_rstd) =
            (vec![0xffffu16; n * c], vec![f32::NAN; n], vec![f32::NAN; n]);
        emu::layernorm_forward_bf16(
            grid,
            block,
            &mut e_out,
            &mut e_mean,
            &mut e_rstd,
            &bits(&inp),
            &bits(&weight),
            &bits(&bias),
            ni,
            ci,
        )
        .unwrap();
        compare(
            &format!("forward bf16 mean {what}"),
            &e_mean,
            &mean,
            1e-7,
            1e-6,
        );
        compare(
            &format!("forward bf16 rstd {what}"),
            &e_rstd,
            &rstd,
            0.0,
            1e-6,
        );
        compare_bf16(&format!("forward bf16 out {what}"), &e_out, &out, 1);

        // Backward from the CPU's statistics (as the GPU test does).
        let (mut dinp, mut dw, mut db) = (dinp0.clone(), dw0.clone(), db0.clone());
        layernorm_backward(
            &mut dinp, &mut dw, &mut db, &dout, &inp, &weight, &mean, &rstd, 1, n, c,
        );
        let mut e_dinp = bits(&dinp0);
        emu::layernorm_backward_input_bf16(
            grid,
            block,
            &mut e_dinp,
            None,
            &bits(&dout),
            &bits(&inp),
            &bits(&weight),
            &mean,
            &rstd,
            ni,
            ci,
        )
        .unwrap();
        compare_bf16(&format!("backward bf16 dinp {what}"), &e_dinp, &dinp, 1);
        let (mut e_dw, mut e_db) = (bits(&dw0), bits(&db0));
        params(
            emu::layernorm_backward_params_partial_bf16,
            emu::layernorm_backward_params_finish_bf16,
            (&mut e_dw, &mut e_db),
            (&bits(&dout), &bits(&inp), &mean, &rstd),
            n,
            c,
        );
        compare_bf16(&format!("backward bf16 dweight {what}"), &e_dw, &dw, 1);
        compare_bf16(&format!("backward bf16 dbias {what}"), &e_db, &db, 1);
    }
}

/// The fused residual kernels (f32): the forward's residual is the CPU's
/// sum bit for bit and its outputs are the unfused kernel's on that sum bit
/// for bit (and within the forward's bars of the CPU's fused kernel); the
/// backward with `dres` is the accumulating kernel started from `dres`, bit
/// for bit, within the backward's bar of the CPU's
/// `layernorm_backward_residual`.
#[test]
fn f32_fused_residual_kernels_are_the_unfused_ones() {
    for (s, &(n, c)) in SHAPES.iter().enumerate() {
        let what = format!("N {n}, C {c}");
        let x = case(n, c, 200 + 10 * s as u64);
        let [ni, ci] = [n, c].map(|v| v as i32);
        let (grid, block) = warp_rows(n);
        let run = |inp: &[f32]| {
            let mut o = (vec![f32::NAN; n * c], vec![f32::NAN; n], vec![f32::NAN; n]);
            emu::layernorm_forward(
                grid, block, &mut o.0, &mut o.1, &mut o.2, inp, &x.weight, &x.bias, ni, ci,
            )
            .unwrap();
            o
        };

        let mut sum = vec![0.0; n * c];
        residual_forward(&mut sum, &x.inp, &x.inp2);
        let (mut res, mut out, mut mean, mut rstd) = (
            vec![0.0; n * c],
            vec![0.0; n * c],
            vec![0.0; n],
            vec![0.0; n],
        );
        layernorm_residual_forward(
            &mut res, &mut out, &mut mean, &mut rstd, &x.inp, &x.inp2, &x.weight, &x.bias, n, c,
        );
        let mut e = (
            vec![f32::NAN; n * c],
            vec![f32::NAN; n * c],
            vec![f32::NAN; n],
            vec![f32::NAN; n],
        );
        emu::layernorm_residual_forward(
            grid, block, &mut e.0, &mut e.1, &mut e.2, &mut e.3, &x.inp, &x.inp2, &x.weight,
            &x.bias, ni, ci,
        )
        .unwrap();
        assert_bits(&format!("fused residual {what}"), &e.0, &sum);
        let unfused = run(&sum);
        assert_bits(&format!("fused out = unfused {what}"), &e.1, &unfused.0);
        assert_bits(&format!("fused mean = unfused {what}"), &e.2, &unfused.1);
        assert_bits(&format!("fused rstd = unfused {what}"), &e.3, &unfused.2);
        compare(&format!("fused out {what}"), &e.1, &out, 1e-5, 1e-4);
        compare(&format!("fused mean {what}"), &e.2, &mean, 1e-6, 1e-4);
        compare(&format!("fused rstd {what}"), &e.3, &rstd, 1e-6, 1e-4);

        // Backward with dres: dinp starts as garbage and is overwritten.
        let dres = values(n * c, 300 + s as u64, 1.0);
        let (mut dinp, mut dw, mut db) = (values(n * c, 9, 5.0), x.dw0.clone(), x.db0.clone());
        layernorm_backward_residual(
            &mut dinp, &mut dw, &mut db, &dres, &x.dout, &sum, &x.weight, &mean, &rstd, n, c,
        );
        let mut e_fused = values(n * c, 9, 5.0);
        emu::layernorm_backward_input(
            grid,
            block,
            &mut e_fused,
            Some(&dres),
            &x.dout,
            &sum,
            &x.weight,
            &mean,
            &rstd,
            ni,
            ci,
        )
        .unwrap();
        let mut e_acc = dres.clone();
        emu::layernorm_backward_input(
            grid, block, &mut e_acc, None, &x.dout, &sum, &x.weight, &mean, &rstd, ni, ci,
        )
        .unwrap();
        assert_bits(
            &format!("dres as the base = accumulating {what}"),
            &e_fused,
            &e_acc,
        );
        compare(
            &format!("backward residual dinp {what}"),
            &e_fused,
            &dinp,
            1e-5,
            1e-4,
        );
    }
}

/// The CPU's fused residual + layer norm forward of `[inp, inp2, weight,
/// bias]` (bf16): `(residual, out, mean, rstd)`.
fn cpu_residual_forward(
    [inp, inp2, weight, bias]: [&[Bf16]; 4],
    n: usize,
    c: usize,
) -> (Vec<Bf16>, Vec<Bf16>, Vec<f32>, Vec<f32>) {
    let (mut res, mut out) = (vec![Bf16(0); n * c], vec![Bf16(0); n * c]);
    let (mut mean, mut rstd) = (vec![0.0; n], vec![0.0; n]);
    layernorm_residual_forward(
        &mut res, &mut out, &mut mean, &mut rstd, inp, inp2, weight, bias, n, c,
    );
    (res, out, mean, rstd)
}

/// The bf16 fused residual kernels: as the f32 ones (the residual the CPU's
/// rounded sum, bit for bit; the outputs the unfused kernel's on it).
#[test]
fn bf16_fused_residual_kernels_are_the_unfused_ones() {
    let (n, c) = SHAPES[0];
    let x = case(n, c, 400);
    let [inp, inp2, weight, bias, dout] =
        [&x.inp, &x.inp2, &x.weight, &x.bias, &x.dout].map(|v| to_bf16(v));
    let [ni, ci] = [n, c].map(|v| v as i32);
    let (grid, block) = warp_rows(n);
    let mut sum = vec![Bf16(0); n * c];
    residual_forward(&mut sum, &inp, &inp2);
    let mut e = (
        vec![0xffffu16; n * c],
        vec![0xffffu16; n * c],
        vec![f32::NAN; n],
        vec![f32::NAN; n],
    );
    emu::layernorm_residual_forward_bf16(
        grid,
        block,
        &mut e.0,
        &mut e.1,
        &mut e.2,
        &mut e.3,
        &bits(&inp),
        &bits(&inp2),
        &bits(&weight),
        &bits(&bias),
        ni,
        ci,
    )
    .unwrap();
    compare_bf16("fused residual bf16", &e.0, &sum, 0);
    let mut u = (vec![0xffffu16; n * c], vec![f32::NAN; n], vec![f32::NAN; n]);
    emu::layernorm_forward_bf16(
        grid,
        block,
        &mut u.0,
        &mut u.1,
        &mut u.2,
        &bits(&sum),
        &bits(&weight),
        &bits(&bias),
        ni,
        ci,
    )
    .unwrap();
    assert_eq!(e.1, u.0, "fused out = unfused");
    assert_bits("fused mean = unfused", &e.2, &u.1);
    assert_bits("fused rstd = unfused", &e.3, &u.2);

    // The CPU's fused kernel, within the forward's bars.
    let (_, out, mean, rstd) = cpu_residual_forward([&inp, &inp2, &weight, &bias], n, c);
    compare_bf16("fused out bf16 vs cpu", &e.1, &out, 1);
    compare("fused mean bf16 vs cpu", &e.2, &mean, 1e-7, 1e-6);

    // Backward with dres, from the CPU's statistics.
    let dres = to_bf16(&values(n * c, 401, 1.0));
    let (mut dinp, mut dw, mut db) = (
        to_bf16(&values(n * c, 9, 5.0)),
        vec![Bf16(0); c],
        vec![Bf16(0); c],
    );
    layernorm_backward_residual(
        &mut dinp, &mut dw, &mut db, &dres, &dout, &sum, &weight, &mean, &rstd, n, c,
    );
    let mut e_dinp = bits(&to_bf16(&values(n * c, 9, 5.0)));
    emu::layernorm_backward_input_bf16(
        grid,
        block,
        &mut e_dinp,
        Some(&bits(&dres)),
        &bits(&dout),
        &bits(&sum),
        &bits(&weight),
        &mean,
        &rstd,
        ni,
        ci,
    )
    .unwrap();
    compare_bf16("backward residual bf16 dinp", &e_dinp, &dinp, 1);
}

/// bf16 elements at a chosen 16-byte alignment: `off` elements past a
/// 16-byte boundary (0: aligned, as the kernels' vector path needs; 1: not,
/// so they take the element-wise loops).
struct At16 {
    buf: Vec<u128>,
    off: usize,
    len: usize,
}

impl At16 {
    fn new(v: &[u16], off: usize) -> Self {
        let mut a = At16 {
            buf: vec![0u128; (v.len() + off).div_ceil(8)],
            off,
            len: v.len(),
        };
        a.get_mut().copy_from_slice(v);
        a
    }

    fn get(&self) -> &[u16] {
        // SAFETY: `buf` holds at least `off + len` u16 (8 per u128), any bit
        // pattern is a u16, and u16's alignment divides u128's.
        unsafe {
            std::slice::from_raw_parts((self.buf.as_ptr() as *const u16).add(self.off), self.len)
        }
    }

    fn get_mut(&mut self) -> &mut [u16] {
        // SAFETY: as `get`, borrowed mutably.
        unsafe {
            std::slice::from_raw_parts_mut(
                (self.buf.as_mut_ptr() as *mut u16).add(self.off),
                self.len,
            )
        }
    }
}

/// The bf16 kernels' vector path (16-byte loads, each row in registers;
/// C a multiple of 8 up to 1024, every row 16-byte aligned) gives the
/// element-wise loops' bits: each kernel runs once with every buffer
/// aligned and once with `weight` one element off (which sends the whole
/// launch down the loops), at channel counts of 1 to 4 vectors a lane and
/// at 1,032 and 1,600 (past the vector path's 1,024: the loops both times).
/// Against the CPU at the usual bars too. (The emulator keeps each slice's
/// address modulo 16 in its copy: before it did, both runs took the vector
/// path and this comparison compared nothing.)
#[test]
fn bf16_vector_rows_are_the_element_wise_rows() {
    let shapes = [
        (5, 40),
        (37, 64),
        (9, 768),
        (3, 1024),
        (1, 8),
        (11, 256),
        (7, 264),
        (3, 1016),
        (4, 1032),
        (2, 1600),
    ];
    for (s, &(n, c)) in shapes.iter().enumerate() {
        let what = format!("N {n}, C {c}");
        let x = case(n, c, 500 + 10 * s as u64);
        let [inp, inp2, weight, bias, dout, dinp0] =
            [&x.inp, &x.inp2, &x.weight, &x.bias, &x.dout, &x.dinp0].map(|v| bits(&to_bf16(v)));
        let dres = bits(&to_bf16(&values(n * c, 600 + s as u64, 1.0)));
        let [ni, ci] = [n, c].map(|v| v as i32);
        let (grid, block) = warp_rows(n);
        // (residual, out, mean, rstd, dinp from dinp0, dinp from dres).
        let run = |w_off: usize| {
            let a = |v: &[u16]| At16::new(v, 0);
            let (i1, i2, w, b, g) = (
                a(&inp),
                a(&inp2),
                At16::new(&weight, w_off),
                a(&bias),
                a(&dout),
            );
            let mut res = a(&vec![0xffff; n * c]);
            let mut out = a(&vec![0xffff; n * c]);
            let (mut mean, mut rstd) = (vec![f32::NAN; n], vec![f32::NAN; n]);
            emu::layernorm_residual_forward_bf16(
                grid,
                block,
                res.get_mut(),
                out.get_mut(),
                &mut mean,
                &mut rstd,
                i1.get(),
                i2.get(),
                w.get(),
                b.get(),
                ni,
                ci,
            )
            .unwrap();
            let mut plain = a(&vec![0xffff; n * c]);
            let (mut pm, mut pr) = (vec![f32::NAN; n], vec![f32::NAN; n]);
            emu::layernorm_forward_bf16(
                grid,
                block,
                plain.get_mut(),
                &mut pm,
                &mut pr,
                res.get(),
                w.get(),
                b.get(),
                ni,
                ci,
            )
            .unwrap();
            assert_eq!(plain.get(), out.get(), "{what}: fused out = unfused");
            let mut d = a(&dinp0);
            let mut dr = a(&vec![0xffff; n * c]);
            let dres = a(&dres);
            for (dinp, dres) in [(&mut d, None), (&mut dr, Some(dres.get()))] {
                emu::layernorm_backward_input_bf16(
                    grid,
                    block,
                    dinp.get_mut(),
                    dres,
                    g.get(),
                    res.get(),
                    w.get(),
                    &mean,
                    &rstd,
                    ni,
                    ci,
                )
                .unwrap();
            }
            let v = |x: &At16| x.get().to_vec();
            (v(&res), v(&out), mean, rstd, v(&d), v(&dr))
        };
        let (vector, loops) = (run(0), run(1));
        assert_eq!(vector.0, loops.0, "{what}: residual");
        assert_eq!(vector.1, loops.1, "{what}: out");
        assert_bits(&format!("{what}: mean"), &vector.2, &loops.2);
        assert_bits(&format!("{what}: rstd"), &vector.3, &loops.3);
        assert_eq!(vector.4, loops.4, "{what}: dinp");
        assert_eq!(vector.5, loops.5, "{what}: dinp from dres");

        // And the CPU's kernels, at the bars of `bf16_kernels_match_the_cpu`.
        let f = |v: &[u16]| common::from_bits(v);
        let (res, out, mean, rstd) =
            cpu_residual_forward([&f(&inp), &f(&inp2), &f(&weight), &f(&bias)], n, c);
        compare_bf16(&format!("{what}: residual vs cpu"), &vector.0, &res, 0);
        compare_bf16(&format!("{what}: out vs cpu"), &vector.1, &out, 1);
        compare(
            &format!("{what}: mean vs cpu"),
            &vector.2,
            &mean,
            1e-7,
            1e-6,
        );
        compare(&format!("{what}: rstd vs cpu"), &vector.3, &rstd, 0.0, 1e-6);
        let (mut dinp, mut dw, mut db) = (f(&dinp0), vec![Bf16(0); c], vec![Bf16(0); c]);
        layernorm_backward(
            &mut dinp,
            &mut dw,
            &mut db,
            &f(&dout),
            &res,
            &f(&weight),
            &vector.2,
            &vector.3,
            1,
            n,
            c,
        );
        compare_bf16(&format!("{what}: dinp vs cpu"), &vector.4, &dinp, 1);
    }
}

//! models/gpt2/src/kernels/gelu.cu and residual.cu, emulated, against the
//! CPU kernels of braid-gpt2 (gelu.rs, residual.rs), with the agreement the
//! GPU tests demand (cuda_kernels: `gelu_and_residual_match_cpu`,
//! `gelu_and_residual_bf16`): GELU to float tolerance and one bf16 ulp (the
//! C library's tanhf here, the CPU's fastmath::tanh there), the residual
//! kernels bit for bit.

mod common;

use braid_gpt2::kernels::cpu::{
    gelu_backward, gelu_forward, residual_accumulate, residual_backward, residual_forward, Bf16,
};
use braid_kernel_emu as emu;
use common::{assert_bits, bits, compare, compare_bf16, linear, to_bf16, values};

/// The GPU tests' length: 16 blocks of 256 and a partial one.
const N: usize = 4099;

#[test]
fn gelu_matches_the_cpu() {
    // The launchers (gelu.rs, `gelu_forward_cuda`, `gelu_backward_cuda`).
    let (grid, block) = linear(N, 256);
    let n = N as i64;
    let x = values(N, 40, 4.0);
    let mut want = vec![0.0; N];
    gelu_forward(&mut want, &x);
    let mut got = vec![f32::NAN; N];
    emu::gelu_forward(grid, block, &mut got, &x, n).unwrap();
    compare("gelu_forward", &got, &want, 1e-6, 1e-5);

    let dout = values(N, 41, 1.0);
    let dinp0 = values(N, 42, 0.1);
    let mut want = dinp0.clone();
    gelu_backward(&mut want, &x, &dout);
    let mut got = dinp0.clone();
    emu::gelu_backward(grid, block, &mut got, &x, &dout, n, 1).unwrap();
    compare("gelu_backward", &got, &want, 1e-6, 1e-5);

    // The bf16 kernels: 8 elements a thread (16-byte loads; the last
    // thread's 3 one by one).
    let (grid, block) = linear(N.div_ceil(8), 256);
    let x16 = to_bf16(&x);
    let mut want = vec![Bf16(0); N];
    gelu_forward(&mut want, &x16);
    let mut got = vec![0xffffu16; N];
    emu::gelu_forward_bf16(grid, block, &mut got, &bits(&x16), n).unwrap();
    compare_bf16("gelu_forward bf16", &got, &want, 1);

    let (dout16, dinp16) = (to_bf16(&dout), to_bf16(&dinp0));
    let mut want = dinp16.clone();
    gelu_backward(&mut want, &x16, &dout16);
    let mut got = bits(&dinp16);
    emu::gelu_backward_bf16(grid, block, &mut got, &bits(&x16), &bits(&dout16), n, 1).unwrap();
    compare_bf16("gelu_backward bf16", &got, &want, 1);
}

/// With `accumulate` 0 the GELU backward writes the gradient over what the
/// buffer held (NaN here: never read), with the bits that adding into zeros
/// gives, in f32 and bf16.
#[test]
fn gelu_backward_written_over_is_added_to_zero() {
    let n = N as i64;
    let (x, dout) = (values(N, 43, 4.0), values(N, 44, 1.0));
    let (grid, block) = linear(N, 256);
    let mut added = vec![0.0f32; N];
    emu::gelu_backward(grid, block, &mut added, &x, &dout, n, 1).unwrap();
    let mut set = vec![f32::NAN; N];
    emu::gelu_backward(grid, block, &mut set, &x, &dout, n, 0).unwrap();
    assert_bits("gelu_backward set", &set, &added);

    let (grid, block) = linear(N.div_ceil(8), 256);
    let (x16, dout16) = (bits(&to_bf16(&x)), bits(&to_bf16(&dout)));
    let mut added = vec![0u16; N];
    emu::gelu_backward_bf16(grid, block, &mut added, &x16, &dout16, n, 1).unwrap();
    let mut set = vec![0x7fc0u16; N]; // bf16 NaN
    emu::gelu_backward_bf16(grid, block, &mut set, &x16, &dout16, n, 0).unwrap();
    assert_eq!(set, added, "gelu_backward bf16 set");
}

#[test]
fn residual_is_bit_identical_to_the_cpu() {
    // The launchers (residual.rs, `residual_forward_cuda`,
    // `residual_backward_cuda`).
    let (grid, block) = linear(N, 256);
    let n = N as i64;
    let (a, b, dout) = (values(N, 43, 1.0), values(N, 44, 1.0), values(N, 45, 1.0));
    let mut want = vec![0.0; N];
    residual_forward(&mut want, &a, &b);
    let mut got = vec![f32::NAN; N];
    emu::residual_forward(grid, block, &mut got, &a, &b, n).unwrap();
    assert_bits("residual_forward", &got, &want);

    let (mut d1, mut d2) = (a.clone(), b.clone());
    residual_backward(&mut d1, &mut d2, &dout);
    let (mut e1, mut e2) = (a.clone(), b.clone());
    emu::residual_backward(grid, block, &mut e1, Some(&mut e2), &dout, n).unwrap();
    assert_bits("residual_backward dinp1", &e1, &d1);
    assert_bits("residual_backward dinp2", &e2, &d2);
    // `accumulate`: no second gradient.
    let mut want = a.clone();
    residual_accumulate(&mut want, &dout);
    let mut got = a.clone();
    emu::residual_backward(grid, block, &mut got, None, &dout, n).unwrap();
    assert_bits("residual accumulate", &got, &want);

    let [a16, b16, dout16] = [&a, &b, &dout].map(|x| to_bf16(x));
    let mut want = vec![Bf16(0); N];
    residual_forward(&mut want, &a16, &b16);
    let mut got = vec![0xffffu16; N];
    emu::residual_forward_bf16(grid, block, &mut got, &bits(&a16), &bits(&b16), n).unwrap();
    compare_bf16("residual_forward bf16", &got, &want, 0);

    let (mut d1, mut d2) = (a16.clone(), b16.clone());
    residual_backward(&mut d1, &mut d2, &dout16);
    let (mut e1, mut e2) = (bits(&a16), bits(&b16));
    emu::residual_backward_bf16(grid, block, &mut e1, Some(&mut e2), &bits(&dout16), n).unwrap();
    compare_bf16("residual_backward bf16 dinp1", &e1, &d1, 0);
    compare_bf16("residual_backward bf16 dinp2", &e2, &d2, 0);
    let mut want = a16.clone();
    residual_accumulate(&mut want, &dout16);
    let mut got = bits(&a16);
    emu::residual_backward_bf16(grid, block, &mut got, None, &bits(&dout16), n).unwrap();
    compare_bf16("residual accumulate bf16", &got, &want, 0);
}

//! models/gpt2/src/kernels/attention.cu (the permutes and the causal
//! softmax), emulated, against the CPU kernels of braid-gpt2
//! (attention.rs). On a GPU the launchers put cuBLAS batched products
//! between these kernels; here plain f32 loops stand in for them (sums in
//! order, one rounding to bf16 for bf16 storage, as `gemm_bf16` with
//! beta = 0), the launchers' sequence and configurations otherwise exactly.
//! The whole forward and backward pass is then held to the GPU tests' bars
//! against the CPU kernels (cuda_kernels:
//! `attention_matches_cpu_and_is_deterministic`, `attention_bf16`); the
//! permutes are copies and sums, checked bit for bit on their own.

mod common;

use braid_gpt2::kernels::cpu::{attention_backward, attention_decode, attention_forward, Bf16};
use braid_kernel_emu as emu;
use common::{assert_bits, bits, compare, compare_bf16, linear, to_bf16, values, warp_rows, widen};

/// The GPU tests' shape: (B, T, C, NH), hs = 24, T past a warp.
const B: usize = 2;
const T: usize = 37;
const C: usize = 96;
const NH: usize = 4;
const HS: usize = C / NH;
const BNH: usize = B * NH;
const BTC: usize = B * T * C;
const ARGS: [i32; 4] = [B as i32, T as i32, NH as i32, HS as i32];

/// Storage for one pipeline: f32, or bf16 bits (as `u16`, the wrappers'
/// type), with the product stand-ins' rounding.
trait Store: Copy + bytemuck::Pod {
    fn load(self) -> f32;
    fn store(x: f32) -> Self;
}

impl Store for f32 {
    fn load(self) -> f32 {
        self
    }
    fn store(x: f32) -> f32 {
        x
    }
}

impl Store for u16 {
    fn load(self) -> f32 {
        Bf16(self).to_f32()
    }
    fn store(x: f32) -> u16 {
        Bf16::from_f32(x).0
    }
}

/// A cuBLAS strided-batched product's stand-in: per head `h`, `out[h, r, c]
/// = alpha · Σ_k a(h, r, k) · b(h, k, c)` for an `(m, n)` result, the f32
/// sum over `k` in order, stored once.
fn gemm<S: Store>(
    (m, n, kdim): (usize, usize, usize),
    a: impl Fn(usize, usize, usize) -> f32,
    b: impl Fn(usize, usize, usize) -> f32,
    alpha: f32,
) -> Vec<S> {
    let mut out = Vec::with_capacity(BNH * m * n);
    for h in 0..BNH {
        for r in 0..m {
            for c in 0..n {
                let s = (0..kdim).fold(0.0f32, |s, k| s + a(h, r, k) * b(h, k, c));
                out.push(S::store(alpha * s));
            }
        }
    }
    out
}

/// Element `(h, r, c)` of a `(B·NH, rows, cols)` tensor, loaded.
fn at<S: Store>(x: &[S], cols: usize, rows: usize) -> impl Fn(usize, usize, usize) -> f32 + '_ {
    move |h, r, c| x[(h * rows + r) * cols + c].load()
}

type D = emu::Dim3;
type Launch = Result<(), String>;
type Permute<S> = fn(D, D, &mut [S], &mut [S], &mut [S], &[S], i32, i32, i32, i32) -> Launch;
type PermuteBackward<S> = fn(D, D, &mut [S], &[S], &[S], &[S], i32, i32, i32, i32) -> Launch;
type Unpermute<S> = fn(D, D, &mut [S], &[S], i32, i32, i32, i32) -> Launch;
type SoftmaxForward<S> = fn(D, D, &mut [S], &[S], i32, i32, f32) -> Launch;
type SoftmaxBackward<S> = fn(D, D, &mut [S], &[S], &[S], i32, i32, f32) -> Launch;

/// The wrappers each pipeline needs for its storage type.
struct Kernels<S> {
    permute: Permute<S>,
    permute_backward: PermuteBackward<S>,
    unpermute: Unpermute<S>,
    unpermute_backward: Unpermute<S>,
    softmax_forward: SoftmaxForward<S>,
    softmax_backward: SoftmaxBackward<S>,
}

const F32: Kernels<f32> = Kernels {
    permute: emu::attention_permute,
    permute_backward: emu::attention_permute_backward,
    unpermute: emu::attention_unpermute,
    unpermute_backward: emu::attention_unpermute_backward,
    softmax_forward: emu::attention_softmax_forward,
    softmax_backward: emu::attention_softmax_backward,
};

const BF16: Kernels<u16> = Kernels {
    permute: emu::attention_permute_bf16,
    permute_backward: emu::attention_permute_backward_bf16,
    unpermute: emu::attention_unpermute_bf16,
    unpermute_backward: emu::attention_unpermute_backward_bf16,
    softmax_forward: emu::attention_softmax_forward_bf16,
    softmax_backward: emu::attention_softmax_backward_bf16,
};

/// `attention_forward_cuda`'s sequence: (out, preatt, att).
fn forward<S: Store>(kn: &Kernels<S>, inp: &[S]) -> (Vec<S>, Vec<S>, Vec<S>) {
    let [b, t, nh, hs] = ARGS;
    let lin = linear(BTC, 256);
    let zero = S::store(0.0);
    let (mut q, mut k, mut v) = (vec![zero; BTC], vec![zero; BTC], vec![zero; BTC]);
    (kn.permute)(lin.0, lin.1, &mut q, &mut k, &mut v, inp, b, t, nh, hs).unwrap();
    let scale = 1.0 / (HS as f32).sqrt();
    // preatt = scale · q · kᵀ: Gemm(N, T, T, T, hs).scaled(scale, 0).
    let (qa, ka) = (at(&q, HS, T), at(&k, HS, T));
    let preatt: Vec<S> = gemm((T, T, HS), &qa, |h, kk, c| ka(h, c, kk), scale);
    let mut att = vec![S::store(f32::NAN); BNH * T * T];
    let (g, bl) = warp_rows(BNH * T);
    (kn.softmax_forward)(g, bl, &mut att, &preatt, BNH as i32, t, 1.0).unwrap();
    // vaccum = att · v: Gemm(N, N, T, hs, T).
    let vaccum: Vec<S> = gemm((T, HS, T), at(&att, T, T), at(&v, HS, T), 1.0);
    let mut out = vec![S::store(f32::NAN); BTC];
    (kn.unpermute)(lin.0, lin.1, &mut out, &vaccum, b, t, nh, hs).unwrap();
    (out, preatt, att)
}

/// `attention_backward_cuda`'s sequence: `dinp` accumulated.
fn backward<S: Store>(kn: &Kernels<S>, dinp: &mut [S], dout: &[S], inp: &[S], att: &[S]) {
    let [b, t, nh, hs] = ARGS;
    let lin = linear(BTC, 256);
    let zero = S::store(0.0);
    let (mut q, mut k, mut v) = (vec![zero; BTC], vec![zero; BTC], vec![zero; BTC]);
    (kn.permute)(lin.0, lin.1, &mut q, &mut k, &mut v, inp, b, t, nh, hs).unwrap();
    let mut dvaccum = vec![S::store(f32::NAN); BTC];
    (kn.unpermute_backward)(lin.0, lin.1, &mut dvaccum, dout, b, t, nh, hs).unwrap();
    let (dva, va, atta) = (at(&dvaccum, HS, T), at(&v, HS, T), at(att, T, T));
    // datt = dvaccum · vᵀ: Gemm(N, T, T, T, hs).
    let datt: Vec<S> = gemm((T, T, HS), &dva, |h, kk, c| va(h, c, kk), 1.0);
    // dv = attᵀ · dvaccum: Gemm(T, N, T, hs, T).
    let dv: Vec<S> = gemm((T, HS, T), |h, r, kk| atta(h, kk, r), &dva, 1.0);
    let mut dpreatt = vec![S::store(f32::NAN); BNH * T * T];
    let (g, bl) = warp_rows(BNH * T);
    let scale = 1.0 / (HS as f32).sqrt();
    (kn.softmax_backward)(g, bl, &mut dpreatt, &datt, att, BNH as i32, t, scale).unwrap();
    let (dpa, ka, qa) = (at(&dpreatt, T, T), at(&k, HS, T), at(&q, HS, T));
    // dq = dpreatt · k: Gemm(N, N, T, hs, T); dk = dpreattᵀ · q: Gemm(T, N, T, hs, T).
    let dq: Vec<S> = gemm((T, HS, T), &dpa, &ka, 1.0);
    let dk: Vec<S> = gemm((T, HS, T), |h, r, kk| dpa(h, kk, r), &qa, 1.0);
    (kn.permute_backward)(lin.0, lin.1, dinp, &dq, &dk, &dv, b, t, nh, hs).unwrap();
}

/// The causal part (`t2 <= t`) of a `(B·NH, T, T)` tensor.
fn causal(x: &[f32]) -> Vec<f32> {
    (0..x.len())
        .filter(|i| i % T <= (i / T) % T)
        .map(|i| x[i])
        .collect()
}

fn largest(x: &[f32]) -> f32 {
    x.iter().fold(0.0f32, |m, v| m.max(v.abs()))
}

#[test]
fn permutes_are_the_index_maps() {
    let inp = values(3 * BTC, 29, 1.0);
    let [b, t, nh, hs] = ARGS;
    let lin = linear(BTC, 256);
    let (mut q, mut k, mut v) = (
        vec![f32::NAN; BTC],
        vec![f32::NAN; BTC],
        vec![f32::NAN; BTC],
    );
    emu::attention_permute(lin.0, lin.1, &mut q, &mut k, &mut v, &inp, b, t, nh, hs).unwrap();
    // (b, h, t, i) of a head tensor is channel h·hs + i of row (b, t).
    let packed = |part: usize, x: usize| {
        let (i, r) = (x % HS, x / HS);
        let (ti, h, bi) = (r % T, r / T % NH, r / T / NH);
        (bi * T + ti) * 3 * C + part * C + h * HS + i
    };
    for (part, head) in [&q, &k, &v].into_iter().enumerate() {
        let want: Vec<f32> = (0..BTC).map(|x| inp[packed(part, x)]).collect();
        assert_bits(&format!("permute part {part}"), head, &want);
    }
    // Unpermute is the query part's inverse; its backward, the forward's.
    let mut out = vec![f32::NAN; BTC];
    emu::attention_unpermute(lin.0, lin.1, &mut out, &q, b, t, nh, hs).unwrap();
    let query: Vec<f32> = inp.chunks(C).step_by(3).flatten().copied().collect();
    assert_bits("unpermute", &out, &query);
    let mut back = vec![f32::NAN; BTC];
    emu::attention_unpermute_backward(lin.0, lin.1, &mut back, &out, b, t, nh, hs).unwrap();
    assert_bits("unpermute_backward", &back, &q);
    // The backward permute adds, one rounding each (bf16: in f32, once).
    let dinp0 = values(3 * BTC, 30, 1.0);
    let mut dinp = dinp0.clone();
    emu::attention_permute_backward(lin.0, lin.1, &mut dinp, &q, &k, &v, b, t, nh, hs).unwrap();
    let want: Vec<f32> = dinp0.iter().zip(&inp).map(|(&a, &b)| a + b).collect();
    assert_bits("permute_backward", &dinp, &want);
    let (d16, i16) = (bits(&to_bf16(&dinp0)), bits(&to_bf16(&inp)));
    let (mut q16, mut k16, mut v16) = (vec![0u16; BTC], vec![0u16; BTC], vec![0u16; BTC]);
    emu::attention_permute_bf16(
        lin.0, lin.1, &mut q16, &mut k16, &mut v16, &i16, b, t, nh, hs,
    )
    .unwrap();
    let mut dinp16 = d16.clone();
    emu::attention_permute_backward_bf16(lin.0, lin.1, &mut dinp16, &q16, &k16, &v16, b, t, nh, hs)
        .unwrap();
    let want: Vec<u16> = d16
        .iter()
        .zip(&i16)
        .map(|(&a, &b)| Bf16::from_f32(Bf16(a).to_f32() + Bf16(b).to_f32()).0)
        .collect();
    assert_eq!(dinp16, want, "permute_backward bf16");
}

#[test]
fn f32_pipeline_matches_the_cpu() {
    let inp = values(3 * BTC, 30, 2.0);
    let (mut out, mut preatt, mut att) = (
        vec![0.0; BTC],
        vec![0.0; BNH * T * T],
        vec![0.0; BNH * T * T],
    );
    attention_forward(&mut out, &mut preatt, &mut att, &inp, B, T, C, NH);
    let (e_out, e_pre, e_att) = forward(&F32, &inp);
    compare("attention_forward att", &e_att, &att, 1e-6, 1e-4);
    compare("attention_forward out", &e_out, &out, 1e-5, 1e-4);
    compare(
        "attention_forward preatt (causal part)",
        &causal(&e_pre),
        &causal(&preatt),
        1e-5,
        1e-4,
    );
    // att's masked triangle (t2 > t) is exactly 0, as on the CPU.
    let mut masked = (0..e_att.len()).filter(|i| i % T > (i / T) % T);
    assert!(
        masked.all(|i| e_att[i].to_bits() == 0),
        "att's masked triangle"
    );

    // Backward from the emulated att, as the GPU test does from its own.
    let dout = values(BTC, 31, 1.0);
    let dinp0 = values(3 * BTC, 32, 0.1);
    let mut dinp = dinp0.clone();
    attention_backward(&mut dinp, &dout, &inp, &att, B, T, C, NH);
    let mut e_dinp = dinp0.clone();
    backward(&F32, &mut e_dinp, &dout, &inp, &e_att);
    compare("attention_backward dinp", &e_dinp, &dinp, 1e-5, 1e-3);
}

#[test]
fn bf16_pipeline_matches_the_cpu() {
    let inp = to_bf16(&values(3 * BTC, 130, 1.0));
    let zero = Bf16(0);
    let (mut out, mut preatt, mut att) = (
        vec![zero; BTC],
        vec![zero; BNH * T * T],
        vec![zero; BNH * T * T],
    );
    attention_forward(&mut out, &mut preatt, &mut att, &inp, B, T, C, NH);
    let (e_out, e_pre, e_att) = forward(&BF16, &bits(&inp));
    // The GPU test's bounds (cuda_kernels, attention_bf16): scores as
    // stored in bf16 feed the softmax, where the CPU keeps them in f32.
    let (gp, cp) = (causal(&widen(&e_pre)), causal(&widen(&bits(&preatt))));
    compare("attention_forward bf16 preatt", &gp, &cp, 1e-5, 1.0 / 128.0);
    let (ga, ca) = (widen(&e_att), widen(&bits(&att)));
    compare("attention_forward bf16 att", &ga, &ca, 2e-3, 3e-2);
    let (go, co) = (widen(&e_out), widen(&bits(&out)));
    compare(
        "attention_forward bf16 out",
        &go,
        &co,
        1e-2 * largest(&co),
        3e-2,
    );

    // Backward from the CPU's att, as the GPU test does.
    let dout = to_bf16(&values(BTC, 131, 1.0));
    let dinp0 = to_bf16(&values(3 * BTC, 132, 0.1));
    let mut dinp = dinp0.clone();
    attention_backward(&mut dinp, &dout, &inp, &att, B, T, C, NH);
    let mut e_dinp = bits(&dinp0);
    backward(&BF16, &mut e_dinp, &bits(&dout), &bits(&inp), &bits(&att));
    let want = widen(&bits(&dinp));
    compare(
        "attention_backward bf16 dinp",
        &widen(&e_dinp),
        &want,
        2e-2 * largest(&want),
        3e-2,
    );
}

/// Decoding one position (`attention_decode_cuda`: grid NH, block 128)
/// against the CPU's one-row attention, which is the whole pass's last row:
/// at 1, 37 (past a warp) and 300 positions (past the block, so threads
/// take several scores each), f32 and bf16.
#[test]
fn decoding_one_position_matches_the_cpu() {
    let (grid, block): (D, D) = ((NH as u32, 1, 1), (128, 1, 1));
    for t in [1, T, 300] {
        let inp = values(3 * C * t, 40 + t as u64, 2.0);
        let mut want = vec![0.0f32; C];
        attention_decode(&mut want, &inp, t, C, NH);
        let mut got = vec![f32::NAN; C];
        emu::attention_decode(grid, block, &mut got, &inp, t as i32, C as i32, NH as i32).unwrap();
        compare(&format!("attention_decode, T {t}"), &got, &want, 1e-5, 1e-4);

        let inp = to_bf16(&inp);
        let mut want = vec![Bf16(0); C];
        attention_decode(&mut want, &inp, t, C, NH);
        let mut got = vec![0u16; C];
        let (c, nh) = (C as i32, NH as i32);
        emu::attention_decode_bf16(grid, block, &mut got, &bits(&inp), t as i32, c, nh).unwrap();
        compare_bf16(&format!("attention_decode bf16, T {t}"), &got, &want, 1);
    }
}

//! The kernel families of `braid_gpt2::kernels`, each task run on the CUDA
//! backend and compared with its CPU kernel on the same inputs; and misuse,
//! one test body on every backend present.
//!
//! GPU tests skip with a message when no GPU is present and fail instead when
//! `BRAID_REQUIRE_GPU=1`. Without a GPU, the misuse tests run on the CPU and
//! an NVRTC compile of every source runs (when libnvrtc is found; required
//! with `BRAID_REQUIRE_NVRTC=1`).
//!
//! What a task may touch is checked by the compiler (a body gets exactly the
//! slices its tokens declare, read-only for a read) and at submission (no
//! written token overlaps another, every view is aligned for its type), so
//! the remaining misuse is a wrong shape: the CUDA launchers refuse it before
//! queuing anything and the CPU kernels before any work, failing the task
//! with a message that names the argument.
//!
//! This file holds the shapes and helpers every module shares; the tests
//! are by family: `families` (f32), `bf16`, `epilogues` (the MLP's product
//! and GELU as one task), `classifier`, `fused_attention`,
//! `residual_layernorm`, and `misuse`.

#[macro_use]
#[path = "../common/mod.rs"]
mod common;

mod bf16;
mod classifier;
mod epilogues;
mod families;
mod fused_attention;
mod misuse;
mod residual_layernorm;

use braid::{Buffer, Error, Runtime, TaskHandle};
use braid_gpt2::checkpoint::AdamWHyper;
use braid_gpt2::kernels::cpu::{Bf16, Dtype};
use braid_gpt2::kernels::task::Task;
use braid_gpt2::kernels::{
    adamw, attention, check_tokens, cpu, encoder, fused_classifier, gelu, kernel_headers,
    kernel_sources, layernorm, loss, matmul, norm, preload, residual, GradWrite,
};
use braid_gpt2::rng::randn;
use common::{Device, TEST_ADAMW};

// Small shapes, not multiples of the block sizes.
const B: usize = 2;
const T: usize = 37;
const C: usize = 96;
const NH: usize = 4;
/// Rows of the layer-norm tests: three row chunks of the CUDA parameter
/// gradients' sums (`layernorm::params_chunks`), the last one short.
const LN_ROWS: usize = 700;
const V: usize = 333;

/// Token ids below `V`, with repeats (embedding gradients accumulate).
fn tokens(n: usize, seed: u64) -> Vec<u32> {
    let ids: Vec<u32> = (0..n)
        .map(|i| ((i as u64 * 2654435761 + seed) % 29) as u32 * 11 % V as u32)
        .collect();
    check_tokens(&ids, V).expect("test tokens are in range");
    ids
}

/// Asserts max |got - want| / (atol + rtol·|want|) <= 1.
#[track_caller]
fn compare(what: &str, got: &[f32], want: &[f32], atol: f32, rtol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let mut worst = (0.0f32, 0usize);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = if g.is_nan() || w.is_nan() {
            f32::INFINITY
        } else {
            (g - w).abs() / (atol + rtol * w.abs())
        };
        if err > worst.0 {
            worst = (err, i);
        }
    }
    let (err, i) = worst;
    eprintln!("    {what}: worst scaled error {err:.3} at {i}");
    assert!(
        err <= 1.0,
        "{what}: element {i}: gpu {} vs cpu {} (scaled error {err:.2})",
        got[i],
        want[i]
    );
}

/// `x` rounded to bf16, as the CPU kernels store it.
fn bf16(x: &[f32]) -> Vec<Bf16> {
    x.iter().map(|&v| Bf16::from_f32(v)).collect()
}

/// `x`'s bits as a monotonic integer: consecutive bf16 values are 1 apart,
/// and -0 and +0 are both 0.
fn bf16_ordinal(x: Bf16) -> i32 {
    let mag = (x.0 & 0x7fff) as i32;
    if x.0 & 0x8000 != 0 {
        -mag
    } else {
        mag
    }
}

/// Asserts that every bf16 element of `got` is within `max_ulps` bf16 ulps
/// of `want` (0: bit-identical, NaN for NaN), and prints how many differ.
#[track_caller]
fn compare_bf16(what: &str, got: &[Bf16], want: &[Bf16], max_ulps: i32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let mut differ = 0usize;
    let mut worst = (0i32, 0usize);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let (gn, wn) = (g.to_f32().is_nan(), w.to_f32().is_nan());
        let ulps = match (gn, wn) {
            (true, true) => 0,
            (false, false) => (bf16_ordinal(g) - bf16_ordinal(w)).abs(),
            _ => i32::MAX,
        };
        differ += (ulps != 0) as usize;
        if ulps > worst.0 {
            worst = (ulps, i);
        }
    }
    let (ulps, i) = worst;
    eprintln!(
        "    {what}: {differ} of {} differ, worst {ulps} bf16 ulp(s) at {i}",
        got.len()
    );
    assert!(
        ulps <= max_ulps,
        "{what}: element {i}: task {} vs cpu kernel {} ({ulps} bf16 ulps, at most {max_ulps})",
        got[i].to_f32(),
        want[i].to_f32()
    );
}

/// A bf16 task named `name`.
fn bf16_task<'rt>(rt: &'rt Runtime, name: &str) -> Task<'rt> {
    Task::new(rt.task(name.to_string()), Dtype::Bf16)
}

/// A runtime of one backend and helpers to move data.
struct Dev {
    rt: Runtime,
}

impl Dev {
    fn new(dev: Device) -> Dev {
        let rt = Runtime::builder()
            .backend(dev.backend())
            .build()
            .expect("runtime");
        if let Some(d) = rt.cuda_device() {
            preload(d).expect("every GPT-2 kernel compiles and loads");
        }
        Dev { rt }
    }

    /// A CUDA runtime, or `None` (after printing why) when there is no GPU;
    /// panics instead under `BRAID_REQUIRE_GPU=1`.
    fn gpu(test: &str) -> Option<Dev> {
        Device::Cuda.present(test).then(|| Dev::new(Device::Cuda))
    }

    fn up(&self, data: &[f32]) -> Buffer {
        self.rt.alloc_from("input", data).unwrap()
    }

    fn up_u32(&self, data: &[u32]) -> Buffer {
        self.rt.alloc_from("tokens", data).unwrap()
    }

    /// `n` zeroed `f32`.
    fn zeros(&self, n: usize) -> Buffer {
        self.rt.alloc("output", n * 4).unwrap()
    }

    fn down(&self, b: &Buffer) -> Vec<f32> {
        self.rt.read_vec(b).unwrap()
    }

    fn up_bf16(&self, data: &[Bf16]) -> Buffer {
        self.rt.alloc_from("input", data).unwrap()
    }

    fn down_bf16(&self, b: &Buffer) -> Vec<Bf16> {
        self.rt.read_vec(b).unwrap()
    }
}

/// Waits for a submitted task.
#[track_caller]
fn done(h: braid::Result<TaskHandle>) {
    h.expect("submitted").wait().expect("the task ran");
}

// ---------------------------------------------------------------------------
// Without a GPU
// ---------------------------------------------------------------------------

#[test]
fn kernel_sources_compile_with_nvrtc() {
    if !braid::cuda::nvrtc_library_present() {
        if std::env::var("BRAID_REQUIRE_NVRTC").is_ok_and(|v| v == "1") {
            panic!("BRAID_REQUIRE_NVRTC=1 but libnvrtc could not be loaded");
        }
        eprintln!(
            "SKIPPED kernel_sources_compile_with_nvrtc: libnvrtc not found \
             (run scripts/install-nvrtc.sh and set LD_LIBRARY_PATH)"
        );
        return;
    }
    let sources = kernel_sources();
    assert_eq!(sources.len(), 11);
    let opts = braid::cuda::CompileOptions::for_arch("sm_90");
    for (name, source) in sources {
        let k = braid::cuda::compile_with_headers(source, kernel_headers(), name, &opts)
            .unwrap_or_else(|e| panic!("{name} does not compile: {e}"));
        assert!(k.is_cubin && !k.image.is_empty(), "{name}");
    }
}

/// bf16 values as `f32`.
fn widen(x: &[Bf16]) -> Vec<f32> {
    x.iter().map(|v| v.to_f32()).collect()
}

/// A bf16 product added to what its output held (the bias, a gradient
/// accumulated so far) against the CPU's result `want`; `product` is the
/// CPU's product alone. The products are summed in f32 in cuBLAS's order,
/// not the CPU gemm's, and cuBLAS (13.0, seen on an H200) rounds the
/// product to bf16 before it adds `beta·C`, where the CPU rounds the sum
/// once (seen: bias 1.203125, product -1.20647: CPU -0.00334, cuBLAS 0). So
/// on CUDA each element is held within one bf16 step of the product plus
/// one of the result (2⁻⁷ relative each, and 1e-5 for sums that cancel to
/// near 0). On the CPU the task runs the kernel: identical.
fn accumulated(dev: Device, what: &str, got: &[Bf16], want: &[Bf16], product: &[Bf16]) {
    let (got, want, product) = (widen(got), widen(want), widen(product));
    if dev == Device::Cpu {
        compare(what, &got, &want, 0.0, 0.0);
        return;
    }
    within_bound(what, &got, &want, &product, "product", |i| {
        (product[i].abs() + want[i].abs()) / 128.0 + 1e-5
    });
}

/// Asserts `|got[i] - want[i]| <= bound(i)` for every element, naming the
/// worst (with `aside[i]`, called `aside_name`, beside it) if one is not.
fn within_bound(
    what: &str,
    got: &[f32],
    want: &[f32],
    aside: &[f32],
    aside_name: &str,
    bound: impl Fn(usize) -> f32,
) {
    let (worst, at) = (0..got.len())
        .map(|i| ((got[i] - want[i]).abs() / bound(i), i))
        .fold(
            (0.0f32, 0),
            |(m, i), (e, j)| if e > m { (e, j) } else { (m, i) },
        );
    eprintln!("    {what}: worst error {worst:.3} of its bound at {at}");
    assert!(
        worst <= 1.0,
        "{what}: element {at}: gpu {} vs cpu {} ({aside_name} {}): {worst} times the bound",
        got[at],
        want[at],
        aside[at]
    );
}

/// A bf16 linear layer `(n, C) → (n, oc)` from seeds `seed..seed + 3` on
/// the device (input, weight, bias), and the CPU's results: the product
/// plus the bias, and the product alone (`accumulated`'s inputs).
struct Bf16Linear {
    inp: Buffer,
    w: Buffer,
    bias: Buffer,
    want: Vec<Bf16>,
    product: Vec<Bf16>,
}

fn bf16_linear(g: &Dev, n: usize, oc: usize, seed: u64) -> Bf16Linear {
    let inp = bf16(&randn(n * C, 1.0, seed));
    let w = bf16(&randn(oc * C, 0.2, seed + 1));
    let bias = bf16(&randn(oc, 0.5, seed + 2));
    let mut want = vec![Bf16(0); n * oc];
    cpu::matmul_forward(&mut want, &inp, &w, Some(&bias[..]), 1, n, C, oc);
    let mut product = vec![Bf16(0); n * oc];
    cpu::matmul_forward(&mut product, &inp, &w, None, 1, n, C, oc);
    Bf16Linear {
        inp: g.up_bf16(&inp),
        w: g.up_bf16(&w),
        bias: g.up_bf16(&bias),
        want,
        product,
    }
}

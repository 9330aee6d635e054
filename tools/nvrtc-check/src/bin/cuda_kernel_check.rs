//! `cuda-kernel-check`: runs every GPT-2 CUDA kernel (and the cuBLAS products
//! GPT-2 uses) on GPU 0 and compares the results with the CPU kernels in
//! `models/gpt2/src/kernels/cpu`, the reference semantics. Also checks that the
//! backward kernels are deterministic (two runs, identical bits).
//!
//! Build here (no GPU needed), run on the GPU machine:
//!
//! ```text
//! cargo build --release --manifest-path tools/nvrtc-check/Cargo.toml --features gpu-check
//! cuda-kernel-check            # exit 0: all match; 1: a mismatch; 2: no GPU
//! ```
//!
//! It uses the CUDA layer (the `braid-cuda` crate, `cuda/`) and includes the
//! CPU kernels and braid-gpt2's seeded generator (`models/gpt2/src/rng.rs`)
//! by path, so it builds without the engine crate.

#![allow(clippy::too_many_arguments)]

use braid_cuda as cuda;

#[allow(dead_code, unused_imports, clippy::all)]
#[path = "../../../../models/gpt2/src/kernels/cpu/mod.rs"]
mod cpu;

/// braid-gpt2's seeded generator (`randn`: the test data).
#[allow(dead_code)]
#[path = "../../../../models/gpt2/src/rng.rs"]
mod rng;

use std::process::ExitCode;

use rng::randn;

use cuda::cublas::{CublasHandle, Gemm, Transpose};
use cuda::{CudaDevice, CudaFunction, CudaModule, CudaStream, DeviceBuffer, KernelArgs, LaunchConfig};

const ENCODER: &str = include_str!("../../../../models/gpt2/src/kernels/cuda/encoder.cu");
const LAYERNORM: &str = include_str!("../../../../models/gpt2/src/kernels/cuda/layernorm.cu");
const MATMUL: &str = include_str!("../../../../models/gpt2/src/kernels/cuda/matmul.cu");
const ATTENTION: &str = include_str!("../../../../models/gpt2/src/kernels/cuda/attention.cu");
const GELU: &str = include_str!("../../../../models/gpt2/src/kernels/cuda/gelu.cu");
const RESIDUAL: &str = include_str!("../../../../models/gpt2/src/kernels/cuda/residual.cu");
const LOSS: &str = include_str!("../../../../models/gpt2/src/kernels/cuda/loss.cu");
const ADAMW: &str = include_str!("../../../../models/gpt2/src/kernels/cuda/adamw.cu");

type R<T> = Result<T, String>;
type Check = fn(&Gpu) -> R<()>;

fn e<E: std::fmt::Display>(x: E) -> String {
    x.to_string()
}

struct Gpu {
    s: CudaStream,
    blas: CublasHandle,
    dev: CudaDevice,
}

impl Gpu {
    fn up(&self, v: &[f32]) -> R<DeviceBuffer> {
        DeviceBuffer::from_host(&self.s, v).map_err(e)
    }
    fn up_u32(&self, v: &[u32]) -> R<DeviceBuffer> {
        DeviceBuffer::from_host(&self.s, v).map_err(e)
    }
    fn zeros(&self, n: usize) -> R<DeviceBuffer> {
        DeviceBuffer::zeroed(&self.s, n * 4).map_err(e)
    }
    fn down(&self, b: &DeviceBuffer) -> R<Vec<f32>> {
        b.to_host_vec(&self.s).map_err(e)
    }
    fn module(&self, src: &str, name: &str) -> R<CudaModule> {
        CudaModule::from_source(&self.dev, src, name).map_err(e)
    }
    fn launch(&self, f: &CudaFunction, cfg: LaunchConfig, args: &KernelArgs) -> R<()> {
        // SAFETY: every call site below passes arguments in the order and types
        // of the kernel's signature, with buffers sized per its shape comment.
        unsafe { f.launch(&self.s, cfg, args) }.map_err(e)
    }
    fn gemm(&self, g: Gemm, a: &DeviceBuffer, b: &DeviceBuffer, c: &DeviceBuffer) -> R<()> {
        // SAFETY: call sites size a, b, c for the shape g describes.
        unsafe { self.blas.sgemm(&g, a.device_ptr(), b.device_ptr(), c.device_ptr()) }.map_err(e)
    }
    fn gemm_batched(
        &self,
        g: Gemm,
        a: &DeviceBuffer,
        sa: i64,
        b: &DeviceBuffer,
        sb: i64,
        c: &DeviceBuffer,
        sc: i64,
        batch: usize,
    ) -> R<()> {
        // SAFETY: call sites size each batch entry for g and the strides.
        unsafe {
            self.blas.sgemm_strided_batched(&g, a.device_ptr(), sa, b.device_ptr(), sb, c.device_ptr(), sc, batch)
        }
        .map_err(e)
    }
}

fn f(m: &CudaModule, name: &str) -> R<CudaFunction> {
    m.function(name).map_err(e)
}

/// Max |got - want| / (atol + rtol·|want|); passes when <= 1.
fn compare(what: &str, got: &[f32], want: &[f32], atol: f32, rtol: f32) -> R<()> {
    if got.len() != want.len() {
        return Err(format!("{what}: length {} vs {}", got.len(), want.len()));
    }
    let mut worst = (0.0f32, 0usize);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = if g.is_nan() || w.is_nan() { f32::INFINITY } else { (g - w).abs() / (atol + rtol * w.abs()) };
        if err > worst.0 {
            worst = (err, i);
        }
    }
    let (err, i) = worst;
    println!("    {what}: worst scaled error {err:.3} at {i}");
    if err <= 1.0 {
        Ok(())
    } else {
        Err(format!("{what}: element {i}: gpu {} vs cpu {} (scaled error {err:.2})", got[i], want[i]))
    }
}

fn lin(n: usize) -> LaunchConfig {
    LaunchConfig::linear(n, 256)
}

fn warp_rows(rows: usize) -> LaunchConfig {
    LaunchConfig::grid_block(rows.div_ceil(8) as u32, 256)
}

// Shapes: small but not multiples of the block sizes.
const B: usize = 2;
const T: usize = 37;
const C: usize = 96;
const NH: usize = 4;
const V: usize = 333;

fn tokens(n: usize, seed: u64) -> Vec<u32> {
    // Repeats on purpose (embedding gradient accumulation).
    (0..n).map(|i| ((i as u64 * 2654435761 + seed) % 29) as u32 * 11 % V as u32).collect()
}

fn check_encoder(g: &Gpu) -> R<()> {
    let m = g.module(ENCODER, "encoder.cu")?;
    let (wte, wpe) = (randn(V * C, 1.0, 1), randn(T * C, 1.0, 2));
    let tok = tokens(B * T, 3);
    let mut want = vec![0.0; B * T * C];
    cpu::encoder_forward(&mut want, &tok, &wte, &wpe, B, T, C);
    let (dwte, dwpe, dtok) = (g.up(&wte)?, g.up(&wpe)?, g.up_u32(&tok)?);
    let out = g.zeros(B * T * C)?;
    let mut a = KernelArgs::new();
    a.ptr(out.device_ptr()).ptr(dtok.device_ptr()).ptr(dwte.device_ptr()).ptr(dwpe.device_ptr());
    a.i32(B as i32).i32(T as i32).i32(C as i32);
    g.launch(&f(&m, "encoder_forward")?, lin(B * T * C), &a)?;
    compare("encoder_forward", &g.down(&out)?, &want, 0.0, 0.0)?;

    let dout = randn(B * T * C, 1.0, 4);
    let (mut gwte, mut gwpe) = (randn(V * C, 0.1, 5), randn(T * C, 0.1, 6));
    let (bwte, bwpe, bdout) = (g.up(&gwte)?, g.up(&gwpe)?, g.up(&dout)?);
    cpu::encoder_backward(&mut gwte, &mut gwpe, &dout, &tok, B, T, C);
    let mut a = KernelArgs::new();
    a.ptr(bwpe.device_ptr()).ptr(bdout.device_ptr()).i32(B as i32).i32(T as i32).i32(C as i32);
    g.launch(&f(&m, "encoder_backward_wpe")?, lin(T * C), &a)?;
    let mut a = KernelArgs::new();
    a.ptr(bwte.device_ptr()).ptr(bdout.device_ptr()).ptr(dtok.device_ptr()).i32((B * T) as i32).i32(C as i32);
    let cfg = LaunchConfig { grid: (C.div_ceil(128) as u32, 32, 1), block: (128, 1, 1), shared_mem_bytes: 0 };
    g.launch(&f(&m, "encoder_backward_wte")?, cfg, &a)?;
    // Same summation order as the CPU: bitwise equal.
    compare("encoder_backward dwpe", &g.down(&bwpe)?, &gwpe, 0.0, 0.0)?;
    compare("encoder_backward dwte", &g.down(&bwte)?, &gwte, 0.0, 0.0)
}

fn check_layernorm(g: &Gpu) -> R<()> {
    let m = g.module(LAYERNORM, "layernorm.cu")?;
    let n = B * T;
    let inp = randn(n * C, 2.0, 10);
    let w: Vec<f32> = randn(C, 0.3, 11).iter().map(|x| 1.0 + x).collect();
    let bias = randn(C, 0.3, 12);
    let (mut out, mut mean, mut rstd) = (vec![0.0; n * C], vec![0.0; n], vec![0.0; n]);
    cpu::layernorm_forward(&mut out, &mut mean, &mut rstd, &inp, &w, &bias, B, T, C);
    let (dinp, dw, db) = (g.up(&inp)?, g.up(&w)?, g.up(&bias)?);
    let (gout, gmean, grstd) = (g.zeros(n * C)?, g.zeros(n)?, g.zeros(n)?);
    let mut a = KernelArgs::new();
    a.ptr(gout.device_ptr()).ptr(gmean.device_ptr()).ptr(grstd.device_ptr()).ptr(dinp.device_ptr());
    a.ptr(dw.device_ptr()).ptr(db.device_ptr()).i32(n as i32).i32(C as i32);
    g.launch(&f(&m, "layernorm_forward")?, warp_rows(n), &a)?;
    compare("layernorm_forward out", &g.down(&gout)?, &out, 1e-5, 1e-4)?;
    compare("layernorm_forward mean", &g.down(&gmean)?, &mean, 1e-6, 1e-4)?;
    compare("layernorm_forward rstd", &g.down(&grstd)?, &rstd, 1e-6, 1e-4)?;

    let dout = randn(n * C, 1.0, 13);
    let (mut gi, mut gw, mut gb) = (randn(n * C, 0.1, 14), randn(C, 0.1, 15), randn(C, 0.1, 16));
    let mut results = Vec::new();
    for _ in 0..2 {
        let (bi, bw, bb, bdout) = (g.up(&gi)?, g.up(&gw)?, g.up(&gb)?, g.up(&dout)?);
        let mut a = KernelArgs::new();
        a.ptr(bi.device_ptr()).ptr(bdout.device_ptr()).ptr(dinp.device_ptr()).ptr(dw.device_ptr());
        a.ptr(gmean.device_ptr()).ptr(grstd.device_ptr()).i32(n as i32).i32(C as i32);
        g.launch(&f(&m, "layernorm_backward_input")?, warp_rows(n), &a)?;
        let mut a = KernelArgs::new();
        a.ptr(bw.device_ptr()).ptr(bb.device_ptr()).ptr(bdout.device_ptr()).ptr(dinp.device_ptr());
        a.ptr(gmean.device_ptr()).ptr(grstd.device_ptr()).i32(n as i32).i32(C as i32);
        g.launch(&f(&m, "layernorm_backward_params")?, LaunchConfig::linear(C, 128), &a)?;
        results.push((g.down(&bi)?, g.down(&bw)?, g.down(&bb)?));
    }
    if results[0] != results[1] {
        return Err("layernorm backward is not deterministic".into());
    }
    cpu::layernorm_backward(&mut gi, &mut gw, &mut gb, &dout, &inp, &w, &mean, &rstd, B, T, C);
    compare("layernorm_backward dinp", &results[0].0, &gi, 1e-5, 1e-4)?;
    compare("layernorm_backward dweight", &results[0].1, &gw, 1e-4, 1e-4)?;
    compare("layernorm_backward dbias", &results[0].2, &gb, 1e-4, 1e-4)
}

fn check_matmul(g: &Gpu) -> R<()> {
    let m = g.module(MATMUL, "matmul.cu")?;
    let (n, oc) = (B * T, 3 * C);
    let inp = randn(n * C, 1.0, 20);
    let w = randn(oc * C, 0.2, 21);
    let bias = randn(oc, 0.5, 22);
    let mut want = vec![0.0; n * oc];
    cpu::matmul_forward(&mut want, &inp, &w, Some(&bias), B, T, C, oc);
    let (binp, bw, bbias, out) = (g.up(&inp)?, g.up(&w)?, g.up(&bias)?, g.zeros(n * oc)?);
    // out = inp · Wᵀ, then += bias.
    g.gemm(Gemm::new(Transpose::N, Transpose::T, n, oc, C), &binp, &bw, &out)?;
    let mut a = KernelArgs::new();
    a.ptr(out.device_ptr()).ptr(bbias.device_ptr()).i32(n as i32).i32(oc as i32);
    g.launch(&f(&m, "bias_forward")?, lin(n * oc), &a)?;
    compare("matmul_forward (cuBLAS + bias_forward)", &g.down(&out)?, &want, 1e-4, 1e-4)?;
    // bias_broadcast then beta = 1: the CPU's order.
    g.launch(&f(&m, "bias_broadcast")?, lin(n * oc), &a)?;
    g.gemm(Gemm::new(Transpose::N, Transpose::T, n, oc, C).scaled(1.0, 1.0), &binp, &bw, &out)?;
    compare("matmul_forward (bias_broadcast + cuBLAS beta=1)", &g.down(&out)?, &want, 1e-4, 1e-4)?;

    let dout = randn(n * oc, 1.0, 23);
    let (mut gi, mut gw, mut gb) = (randn(n * C, 0.1, 24), randn(oc * C, 0.1, 25), randn(oc, 0.1, 26));
    let (bgi, bgw, bgb, bdout) = (g.up(&gi)?, g.up(&gw)?, g.up(&gb)?, g.up(&dout)?);
    cpu::matmul_backward_input(&mut gi, &dout, &w, B, T, C, oc);
    cpu::matmul_backward_weight(&mut gw, Some(&mut gb), &dout, &inp, B, T, C, oc);
    // dinp (n, C) += dout (n, oc) · W (oc, C)
    g.gemm(Gemm::new(Transpose::N, Transpose::N, n, C, oc).scaled(1.0, 1.0), &bdout, &bw, &bgi)?;
    // dW (oc, C) += doutᵀ (oc, n) · inp (n, C)
    g.gemm(Gemm::new(Transpose::T, Transpose::N, oc, C, n).scaled(1.0, 1.0), &bdout, &binp, &bgw)?;
    let mut a = KernelArgs::new();
    a.ptr(bgb.device_ptr()).ptr(bdout.device_ptr()).i32(n as i32).i32(oc as i32);
    g.launch(&f(&m, "bias_backward")?, LaunchConfig::linear(oc, 128), &a)?;
    compare("matmul_backward dinp", &g.down(&bgi)?, &gi, 1e-4, 1e-4)?;
    compare("matmul_backward dweight", &g.down(&bgw)?, &gw, 1e-4, 1e-4)?;
    compare("matmul_backward dbias", &g.down(&bgb)?, &gb, 1e-4, 1e-4)
}

fn check_attention(g: &Gpu) -> R<()> {
    let m = g.module(ATTENTION, "attention.cu")?;
    let hs = C / NH;
    let bnh = B * NH;
    let scale = 1.0 / (hs as f32).sqrt();
    let inp = randn(B * T * 3 * C, 1.0, 30);
    let (mut out, mut preatt, mut att) = (vec![0.0; B * T * C], vec![0.0; bnh * T * T], vec![0.0; bnh * T * T]);
    cpu::attention_forward(&mut out, &mut preatt, &mut att, &inp, B, T, C, NH);

    let binp = g.up(&inp)?;
    let head = B * NH * T * hs;
    let (q, k, v) = (g.zeros(head)?, g.zeros(head)?, g.zeros(head)?);
    let (gpre, gatt, vacc, gout) = (g.zeros(bnh * T * T)?, g.zeros(bnh * T * T)?, g.zeros(head)?, g.zeros(B * T * C)?);
    let dims = |a: &mut KernelArgs| {
        a.i32(B as i32).i32(T as i32).i32(NH as i32).i32(hs as i32);
    };
    let mut a = KernelArgs::new();
    a.ptr(q.device_ptr()).ptr(k.device_ptr()).ptr(v.device_ptr()).ptr(binp.device_ptr());
    dims(&mut a);
    g.launch(&f(&m, "attention_permute")?, lin(head), &a)?;
    let (tt, ths) = ((T * T) as i64, (T * hs) as i64);
    g.gemm_batched(Gemm::new(Transpose::N, Transpose::T, T, T, hs).scaled(scale, 0.0), &q, ths, &k, ths, &gpre, tt, bnh)?;
    let mut a = KernelArgs::new();
    a.ptr(gatt.device_ptr()).ptr(gpre.device_ptr()).i32(bnh as i32).i32(T as i32).f32(1.0);
    g.launch(&f(&m, "attention_softmax_forward")?, warp_rows(bnh * T), &a)?;
    g.gemm_batched(Gemm::new(Transpose::N, Transpose::N, T, hs, T), &gatt, tt, &v, ths, &vacc, ths, bnh)?;
    let mut a = KernelArgs::new();
    a.ptr(gout.device_ptr()).ptr(vacc.device_ptr());
    dims(&mut a);
    g.launch(&f(&m, "attention_unpermute")?, lin(head), &a)?;
    compare("attention_forward att", &g.down(&gatt)?, &att, 1e-6, 1e-4)?;
    compare("attention_forward out", &g.down(&gout)?, &out, 1e-5, 1e-4)?;
    // preatt: compare the causal part only (the GPU leaves the masked part as computed).
    let gp = g.down(&gpre)?;
    let mask = |x: &[f32]| -> Vec<f32> {
        x.iter().enumerate().map(|(i, &v)| if (i % T) <= (i / T) % T { v } else { 0.0 }).collect()
    };
    compare("attention_forward preatt (causal part)", &mask(&gp), &preatt, 1e-5, 1e-4)?;

    // Backward.
    let dout = randn(B * T * C, 1.0, 31);
    let mut dinp = randn(B * T * 3 * C, 0.1, 32);
    let bdinp = g.up(&dinp)?;
    cpu::attention_backward(&mut dinp, &dout, &inp, &att, B, T, C, NH);
    let bdout = g.up(&dout)?;
    let (dvacc, datt, dpre, dq, dk, dv) =
        (g.zeros(head)?, g.zeros(bnh * T * T)?, g.zeros(bnh * T * T)?, g.zeros(head)?, g.zeros(head)?, g.zeros(head)?);
    let mut a = KernelArgs::new();
    a.ptr(dvacc.device_ptr()).ptr(bdout.device_ptr());
    dims(&mut a);
    g.launch(&f(&m, "attention_unpermute_backward")?, lin(head), &a)?;
    g.gemm_batched(Gemm::new(Transpose::N, Transpose::T, T, T, hs), &dvacc, ths, &v, ths, &datt, tt, bnh)?;
    g.gemm_batched(Gemm::new(Transpose::T, Transpose::N, T, hs, T), &gatt, tt, &dvacc, ths, &dv, ths, bnh)?;
    let mut a = KernelArgs::new();
    a.ptr(dpre.device_ptr()).ptr(datt.device_ptr()).ptr(gatt.device_ptr()).i32(bnh as i32).i32(T as i32).f32(scale);
    g.launch(&f(&m, "attention_softmax_backward")?, warp_rows(bnh * T), &a)?;
    g.gemm_batched(Gemm::new(Transpose::N, Transpose::N, T, hs, T), &dpre, tt, &k, ths, &dq, ths, bnh)?;
    g.gemm_batched(Gemm::new(Transpose::T, Transpose::N, T, hs, T), &dpre, tt, &q, ths, &dk, ths, bnh)?;
    let mut a = KernelArgs::new();
    a.ptr(bdinp.device_ptr()).ptr(dq.device_ptr()).ptr(dk.device_ptr()).ptr(dv.device_ptr());
    dims(&mut a);
    g.launch(&f(&m, "attention_permute_backward")?, lin(head), &a)?;
    compare("attention_backward dinp", &g.down(&bdinp)?, &dinp, 1e-5, 1e-3)
}

fn check_gelu_residual(g: &Gpu) -> R<()> {
    let m = g.module(GELU, "gelu.cu")?;
    let n = 4099;
    let x = randn(n, 2.0, 40);
    let mut want = vec![0.0; n];
    cpu::gelu_forward(&mut want, &x);
    let (bx, out) = (g.up(&x)?, g.zeros(n)?);
    let mut a = KernelArgs::new();
    a.ptr(out.device_ptr()).ptr(bx.device_ptr()).i64(n as i64);
    g.launch(&f(&m, "gelu_forward")?, lin(n), &a)?;
    compare("gelu_forward", &g.down(&out)?, &want, 1e-6, 1e-5)?;
    let dout = randn(n, 1.0, 41);
    let mut dinp = randn(n, 0.1, 42);
    let (bd, bdout) = (g.up(&dinp)?, g.up(&dout)?);
    cpu::gelu_backward(&mut dinp, &x, &dout);
    let mut a = KernelArgs::new();
    a.ptr(bd.device_ptr()).ptr(bx.device_ptr()).ptr(bdout.device_ptr()).i64(n as i64);
    g.launch(&f(&m, "gelu_backward")?, lin(n), &a)?;
    compare("gelu_backward", &g.down(&bd)?, &dinp, 1e-6, 1e-5)?;

    let m = g.module(RESIDUAL, "residual.cu")?;
    let (a1, a2) = (randn(n, 1.0, 43), randn(n, 1.0, 44));
    let mut want = vec![0.0; n];
    cpu::residual_forward(&mut want, &a1, &a2);
    let (b1, b2) = (g.up(&a1)?, g.up(&a2)?);
    let mut a = KernelArgs::new();
    a.ptr(out.device_ptr()).ptr(b1.device_ptr()).ptr(b2.device_ptr()).i64(n as i64);
    g.launch(&f(&m, "residual_forward")?, lin(n), &a)?;
    compare("residual_forward", &g.down(&out)?, &want, 0.0, 0.0)?;
    let (mut d1, mut d2) = (a1.clone(), a2.clone());
    cpu::residual_backward(&mut d1, &mut d2, &dout);
    let mut a = KernelArgs::new();
    a.ptr(b1.device_ptr()).ptr(b2.device_ptr()).ptr(bdout.device_ptr()).i64(n as i64);
    g.launch(&f(&m, "residual_backward")?, lin(n), &a)?;
    compare("residual_backward dinp1", &g.down(&b1)?, &d1, 0.0, 0.0)?;
    compare("residual_backward dinp2", &g.down(&b2)?, &d2, 0.0, 0.0)
}

fn check_loss(g: &Gpu) -> R<()> {
    let m = g.module(LOSS, "loss.cu")?;
    let n = B * T;
    let logits = randn(n * V, 3.0, 50);
    let targets = tokens(n, 51);
    let (mut probs, mut losses) = (vec![0.0; n * V], vec![0.0; n]);
    cpu::softmax_forward(&mut probs, &logits, B, T, V);
    cpu::crossentropy_forward(&mut losses, &probs, &targets, B, T, V);
    let (bl, bt) = (g.up(&logits)?, g.up_u32(&targets)?);
    let (bp, bloss, bmean) = (g.zeros(n * V)?, g.zeros(n)?, g.zeros(1)?);
    let mut a = KernelArgs::new();
    a.ptr(bp.device_ptr()).ptr(bloss.device_ptr()).ptr(bl.device_ptr()).ptr(bt.device_ptr());
    a.i32(n as i32).i32(V as i32);
    g.launch(&f(&m, "softmax_crossentropy_forward")?, LaunchConfig::grid_block(n as u32, 1024), &a)?;
    compare("softmax probs", &g.down(&bp)?, &probs, 1e-7, 1e-4)?;
    compare("crossentropy losses", &g.down(&bloss)?, &losses, 1e-5, 1e-4)?;
    let mut a = KernelArgs::new();
    a.ptr(bmean.device_ptr()).ptr(bloss.device_ptr()).i32(n as i32);
    g.launch(&f(&m, "loss_mean")?, LaunchConfig::grid_block(1, 1024), &a)?;
    compare("loss_mean", &g.down(&bmean)?, &[cpu::mean_loss(&losses)], 1e-6, 1e-5)?;

    let dloss = 0.5f32;
    let mut dlogits = randn(n * V, 0.01, 52);
    let bd = g.up(&dlogits)?;
    cpu::crossentropy_softmax_backward(&mut dlogits, &probs, &targets, dloss, B, T, V);
    let mut a = KernelArgs::new();
    a.ptr(bd.device_ptr()).ptr(bp.device_ptr()).ptr(bt.device_ptr()).f32(dloss / n as f32);
    a.i32(n as i32).i32(V as i32);
    g.launch(&f(&m, "crossentropy_softmax_backward")?, lin(n * V), &a)?;
    compare("crossentropy_softmax_backward", &g.down(&bd)?, &dlogits, 1e-7, 1e-4)
}

fn check_adamw(g: &Gpu) -> R<()> {
    let m = g.module(ADAMW, "adamw.cu")?;
    let n = 100_003;
    let mut p = randn(n, 1.0, 60);
    let (mut mm, mut vv) = (vec![0.0f32; n], vec![0.0f32; n]);
    let (bp, bm, bv) = (g.up(&p)?, g.up(&mm)?, g.up(&vv)?);
    let (lr, b1, b2, eps, wd) = (1e-3f32, 0.9f32, 0.95f32, 1e-8f32, 0.1f32);
    for step in 1..=3u64 {
        let grads = randn(n, 0.5, 60 + step);
        cpu::adamw_update(&mut p, &grads, &mut mm, &mut vv, step, lr, b1, b2, eps, wd);
        let bc1 = 1.0 - (b1 as f64).powi(step as i32);
        let bc2 = (1.0 - (b2 as f64).powi(step as i32)).sqrt();
        let bg = g.up(&grads)?;
        let mut a = KernelArgs::new();
        a.ptr(bp.device_ptr()).ptr(bg.device_ptr()).ptr(bm.device_ptr()).ptr(bv.device_ptr()).ptr(0);
        a.i64(n as i64).f32((lr as f64 / bc1) as f32).f32(bc2 as f32).f32(b1).f32(b2).f32(eps).f32(1.0 - lr * wd);
        g.launch(&f(&m, "adamw_update")?, lin(n), &a)?;
    }
    compare("adamw params", &g.down(&bp)?, &p, 1e-6, 1e-5)?;
    compare("adamw m", &g.down(&bm)?, &mm, 1e-7, 1e-5)?;
    compare("adamw v", &g.down(&bv)?, &vv, 1e-9, 1e-5)?;

    // Norm, clip scale, scale.
    let grads = randn(n, 0.5, 70);
    let bg = g.up(&grads)?;
    let parts = 64usize;
    let (bparts, bnorm) = (g.zeros(parts * 2)?, g.zeros(2)?);
    let mut a = KernelArgs::new();
    a.ptr(bparts.device_ptr()).ptr(bg.device_ptr()).i64(n as i64);
    g.launch(&f(&m, "grad_norm_sq_partial")?, LaunchConfig::grid_block(parts as u32, 512), &a)?;
    let mut a = KernelArgs::new();
    a.ptr(bnorm.device_ptr()).ptr(bparts.device_ptr()).i32(parts as i32);
    g.launch(&f(&m, "grad_norm_sq_finalize")?, LaunchConfig::grid_block(1, 1024), &a)?;
    let got: Vec<f64> = bnorm.to_host_vec(&g.s).map_err(e)?;
    let want = cpu::grad_norm_sq(&grads);
    println!("    grad_norm_sq: gpu {} cpu {want}", got[0]);
    if ((got[0] - want) / want).abs() > 1e-12 {
        return Err(format!("grad_norm_sq: gpu {} vs cpu {want}", got[0]));
    }
    let bscale = g.zeros(1)?;
    let max_norm = (want.sqrt() * 0.5) as f32;
    let mut a = KernelArgs::new();
    a.ptr(bscale.device_ptr()).ptr(bnorm.device_ptr()).i32(1).f32(max_norm);
    g.launch(&f(&m, "grad_clip_scale")?, LaunchConfig::grid_block(1, 1), &a)?;
    let s = g.down(&bscale)?[0];
    compare("grad_clip_scale", &[s], &[cpu::clip_scale(want.sqrt(), max_norm)], 0.0, 1e-6)?;
    let mut a = KernelArgs::new();
    a.ptr(bg.device_ptr()).i64(n as i64).ptr(bscale.device_ptr());
    g.launch(&f(&m, "scale_inplace_dev")?, lin(n), &a)?;
    let mut want_scaled = grads.clone();
    cpu::scale_in_place(&mut want_scaled, s);
    compare("scale_inplace_dev", &g.down(&bg)?, &want_scaled, 0.0, 0.0)
}

fn main() -> ExitCode {
    let require = std::env::var("BRAID_REQUIRE_GPU").map(|v| v == "1").unwrap_or(false);
    match cuda::cuda_available() {
        Ok(n) if n > 0 => {}
        other => {
            let why = match other {
                Ok(_) => "0 devices".to_string(),
                Err(err) => err.to_string(),
            };
            eprintln!("cuda-kernel-check: no GPU ({why}){}", if require { "" } else { "; skipped" });
            return ExitCode::from(if require { 1 } else { 2 });
        }
    }
    let setup = || -> R<Gpu> {
        let dev = CudaDevice::open(0).map_err(e)?;
        let s = CudaStream::compute(&dev).map_err(e)?;
        let blas = CublasHandle::new(&s).map_err(e)?;
        Ok(Gpu { s, blas, dev })
    };
    let g = match setup() {
        Ok(g) => g,
        Err(err) => {
            eprintln!("cuda-kernel-check: setup failed: {err}");
            return ExitCode::from(1);
        }
    };
    println!("cuda-kernel-check on {:?}", g.dev);
    let checks: [(&str, Check); 7] = [
        ("encoder", check_encoder),
        ("layernorm", check_layernorm),
        ("matmul (cuBLAS row-major + bias)", check_matmul),
        ("attention", check_attention),
        ("gelu + residual", check_gelu_residual),
        ("softmax + cross-entropy", check_loss),
        ("adamw + grad norm", check_adamw),
    ];
    let (mut passed, mut failed) = (0, 0);
    for (name, check) in checks {
        println!("{name}:");
        match check(&g) {
            Ok(()) => {
                passed += 1;
                println!("  PASS {name}");
            }
            Err(err) => {
                failed += 1;
                println!("  FAIL {name}: {err}");
            }
        }
    }
    let deferred = g.dev.take_deferred_errors();
    if !deferred.is_empty() {
        failed += 1;
        println!("  FAIL deferred CUDA errors: {deferred:?}");
    }
    let stats = cuda::KernelCache::global().stats();
    println!("kernel cache: {stats:?}");
    println!("{passed} passed, {failed} failed");
    if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

//! The classifier's three cuBLAS products alone, at the GPT-2 vocabulary
//! (50,257: odd, so no row of the logits starts 16-byte aligned), at the
//! vocabulary padded to a multiple of 128 (50,304, llm.c's), and at the real
//! vocabulary with only the logits' row stride padded (`ld = 50,304`, `V`
//! columns used). The model pads only the logits' row stride
//! (docs/gpt2.md, "The padded logits rows"); this says whether padding `wte`
//! too would be worth its cost. Prints each product's time and TFLOP/s;
//! figures only.
//!
//! The products, as GPT-2's `matmul` tasks issue them (row-major, `n = B·T`):
//! `logits forward` `(n, V) = lnf (n, C) · wteᵀ`, `logits backward input`
//! `dlnf (n, C) += dlogits (n, V) · wte (V, C)`, `logits backward weight`
//! `dwte (V, C) += dlogitsᵀ · lnf`.
//!
//! `cargo run --release -p braid-benches --bin gemm_vocab -- --dtype bf16`

use std::time::Instant;

use anyhow::{bail, Context, Result};
use braid::cuda::{CublasHandle, CudaDevice, CudaStream, DeviceBuffer, Gemm, Transpose};
use braid_benches::{cli, median};
use clap::Parser;

#[derive(Parser, Debug)]
#[command(about = "The classifier's cuBLAS products at an odd and a padded vocabulary")]
struct Args {
    /// Rows `n = B·T`.
    #[arg(long, default_value_t = 8192, value_parser = cli::at_least(1))]
    rows: usize,
    /// Channels `C`.
    #[arg(long, default_value_t = 768, value_parser = cli::at_least(1))]
    channels: usize,
    /// The vocabulary.
    #[arg(long, default_value_t = 50257, value_parser = cli::at_least(1))]
    vocab: usize,
    /// Pad the vocabulary to a multiple of this.
    #[arg(long, default_value_t = 128, value_parser = cli::at_least(1))]
    multiple: usize,
    /// bf16 or fp32.
    #[arg(long, default_value = "bf16")]
    dtype: String,
    /// Timed repetitions of each product.
    #[arg(long, default_value_t = 20, value_parser = cli::at_least(1))]
    reps: usize,
}

/// Median seconds of `reps` runs of `f` (after three warm-ups), each
/// synchronised.
fn time(stream: &CudaStream, reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    for _ in 0..3 {
        f()?;
    }
    stream.synchronize()?;
    let mut v = Vec::with_capacity(reps);
    for _ in 0..reps {
        let t0 = Instant::now();
        f()?;
        stream.synchronize()?;
        v.push(t0.elapsed().as_secs_f64());
    }
    Ok(median(&v))
}

fn main() -> Result<()> {
    let a = Args::parse();
    let bf16 = match a.dtype.as_str() {
        "bf16" => true,
        "fp32" => false,
        other => bail!("--dtype {other}: expected bf16 or fp32"),
    };
    let dev = CudaDevice::open(0).context("gemm_vocab needs a CUDA GPU")?;
    let stream = CudaStream::compute(&dev)?;
    let blas = CublasHandle::new(&stream)?;
    let es = if bf16 { 2 } else { 4 };
    let (n, c, v) = (a.rows, a.channels, a.vocab);
    let vp = v.div_ceil(a.multiple) * a.multiple;
    // Buffers for the largest shape, zeroed: tensor cores run somewhat faster
    // on zeros than on random data, the same way for every shape here, so
    // the comparison between shapes holds; the absolute rates flatter.
    let lnf = DeviceBuffer::zeroed(&stream, n * c * es)?;
    let dlnf = DeviceBuffer::zeroed(&stream, n * c * es)?;
    let wte = DeviceBuffer::zeroed(&stream, vp * c * es)?;
    let dwte = DeviceBuffer::zeroed(&stream, vp * c * es)?;
    let logits = DeviceBuffer::zeroed(&stream, n * vp * es)?;
    let gemm = |g: &Gemm, x: &DeviceBuffer, y: &DeviceBuffer, z: &DeviceBuffer| -> Result<()> {
        let (x, y, z) = (x.device_ptr(), y.device_ptr(), z.device_ptr());
        // SAFETY: every buffer holds the largest shape any product here
        // reads or writes (`vp` rows of the vocabulary, `ld ≤ vp`).
        unsafe {
            if bf16 {
                blas.gemm_bf16(g, x, y, z)?
            } else {
                blas.sgemm(g, x, y, z)?
            }
        }
        Ok(())
    };
    println!(
        "gemm_vocab: n {n}, C {c}, {} on {} ({}), median of {} runs",
        a.dtype,
        dev.name(),
        dev.arch(),
        a.reps
    );
    let flops = 2.0 * (n * c) as f64;
    for (label, cols, ld) in [
        ("odd vocabulary", v, v),
        ("padded vocabulary", vp, vp),
        ("odd vocabulary, padded row stride", v, vp),
    ] {
        let mut fwd = Gemm::new(Transpose::N, Transpose::T, n, cols, c);
        fwd.ldc = ld;
        let mut bwd_in = Gemm::new(Transpose::N, Transpose::N, n, c, cols).scaled(1.0, 1.0);
        bwd_in.lda = ld;
        let mut bwd_w = Gemm::new(Transpose::T, Transpose::N, cols, c, n).scaled(1.0, 1.0);
        bwd_w.lda = ld;
        let t_fwd = time(&stream, a.reps, || gemm(&fwd, &lnf, &wte, &logits))?;
        let t_in = time(&stream, a.reps, || gemm(&bwd_in, &logits, &wte, &dlnf))?;
        let t_w = time(&stream, a.reps, || gemm(&bwd_w, &logits, &lnf, &dwte))?;
        let tf = |t: f64| flops * cols as f64 / t / 1e12;
        println!(
            "{label:<34} V {cols:>6} ld {ld:>6}: forward {:.3} ms ({:.0} TFLOP/s), backward \
             input {:.3} ms ({:.0}), backward weight {:.3} ms ({:.0}); total {:.3} ms",
            t_fwd * 1e3,
            tf(t_fwd),
            t_in * 1e3,
            tf(t_in),
            t_w * 1e3,
            tf(t_w),
            (t_fwd + t_in + t_w) * 1e3
        );
    }
    Ok(())
}

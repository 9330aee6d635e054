//! Fused (FlashAttention-2 style) causal self-attention: the CPU kernels
//! (the reference algorithm, checked against the unfused
//! [`attention`](super::attention) kernels) and the CUDA launchers of its
//! scalar and tensor-core kernels.
//!
//! Same packed input as [`attention`](super::attention): `inp` is
//! `(B, T, 3C)`, the `C` query, `C` key and `C` value channels of each
//! position, head `h` owning channels `h·hs .. (h+1)·hs` of each.
//!
//! # Algorithm
//!
//! **Forward** ([`flash_attention_forward`]): for each batch row and head, the
//! queries are cut into tiles of `block_q` rows and the keys into tiles of
//! `block_k` columns. A query tile walks the key tiles of its causal prefix
//! (key tiles entirely above the diagonal are skipped) and keeps, per row,
//! the running maximum `m`, the running sum `l = Σ exp(s - m)` and the
//! unnormalised output `acc = Σ exp(s - m) · v` (the online softmax): a new
//! tile's scores `S = q·kᵀ / sqrt(hs)` (masked where key > query) raise the
//! maximum to `m'`, and `l` and `acc` are rescaled by `exp(m - m')` before the
//! tile's terms are added. At the end `out = acc / l` and only the per-row
//! logsumexp `lse = m + ln l` is saved, `(B, NH, T)`: no `(B, NH, T, T)`
//! score or probability buffer exists at any time, only one
//! `block_q × block_k` tile.
//!
//! **Backward** ([`flash_attention_backward`], FlashAttention-2's): first
//! `D = rowsum(dout ∘ out)`, `(B, NH, T)`, which equals the unfused
//! `Σ_j att_ij · datt_ij`. Then, for each key tile (outer loop, so its `dK`
//! and `dV` accumulate in a `block_k × hs` tile and are written once), the
//! query tiles at or below the diagonal recompute the probabilities
//! `P = exp(S - lse)` from `q`, `k` and the saved logsumexp, and
//! `dV += Pᵀ · dout`, `dP = dout · vᵀ`, `dS = P ∘ (dP - D)`,
//! `dQ += dS · k / sqrt(hs)` (straight into `dinp`, as a GPU kernel would
//! with atomics or a second pass), `dK += dSᵀ · q / sqrt(hs)`.
//!
//! # Numerics
//!
//! `f32` throughout (maxima, sums, products), as a GPU kernel does it; the
//! unfused CPU kernels sum the softmax denominator in `f64`. They agree to
//! float tolerance, not bit for bit (the order of the sums differs): in the
//! tests, outputs within 1.5e-6 absolute (1e-6 relative), input gradients
//! within 3e-6 absolute (6e-5 relative on the smallest elements).
//!
//! # Memory
//!
//! Saved between forward and backward: `lse`, `B·NH·T` `f32`
//! ([`saved_len`]), against `2·B·NH·T·T` for the unfused `preatt` and `att`.
//! Backward scratch: `D`, `B·NH·T` `f32` ([`backward_scratch_bytes`]); the
//! CPU kernel takes it as an argument so its size is the one a GPU kernel
//! needs. Per-tile working memory (`block_q × block_k` scores and
//! probabilities, `block_q × hs` or `block_k × hs` accumulators, kept in
//! registers and shared memory on a GPU) is local to the kernel:
//! [`tile_bytes`].
//!
//! # CUDA
//!
//! Two sets of kernels; the launchers take the tensor-core ones wherever
//! they apply.
//!
//! - **Tensor cores** (`flash_attention_tc.cu`, bf16, head sizes
//!   [`TC_HEAD_SIZES`], compute capability 8.0 or newer, `C` a multiple of 8 and `inp`, `dout`
//!   16-byte aligned: [`tensor_cores_apply`]). FlashAttention-2 with every
//!   product a warp-level `mma.sync` m16n8k16 (bf16 operands, `f32`
//!   accumulation): blocks of 4 warps over 64 query rows (forward, `dQ`) or
//!   64 keys (`dK`, `dV`), tiles of 64 keys (queries) staged in shared
//!   memory, each warp's own 16 rows held in registers as MMA fragments, the
//!   online softmax in registers. The backward pass is two kernels, `dQ`
//!   and then `dK`/`dV`, each recomputing `P` (no atomics, deterministic).
//!   `P` and `dS` are rounded to bf16 for their products, as in every
//!   tensor-core flash attention, so results agree with the CPU kernels to
//!   bf16 tolerance: under emulation (tools/kernel-emu) within 0.53% of the
//!   largest output and 0.63% of the largest gradient element, and bit for
//!   bit with a scalar model of their arithmetic. Not yet run on a GPU
//!   (docs/gpu-validation.md).
//! - **Scalar** (`flash_attention.cu`, f32 and `_bf16`, the checked
//!   reference and the fallback) follows the CPU kernels operation by
//!   operation: the same `f32` dot products in channel order, the same
//!   online-softmax update per key tile of [`BLOCK_K`] columns, the same
//!   accumulation orders, no FMA contraction; only `expf`/`logf` are CUDA's
//!   (the CPU's exponential is [`fastmath::exp`]), so the two agree to float
//!   tolerance. One thread per query row (forward, `dQ`) or key row (`dK`,
//!   `dV`, summed over the queries instead of atomics, so deterministic), no
//!   tensor cores, no shared-memory tiles; `hs` at most 128. Correct on an
//!   H200, and slow: its backward pass took 2.0 s of a 2.3 s GPT-2 124M step
//!   at B8 × T1024 (docs/gpu-validation.md, run 5), against 11 ms for the
//!   unfused cuBLAS attention.
//! - **cuDNN** (`auto`, the default, or `BRAID_ATTENTION=cudnn`:
//!   [`attention_kernels`]): cuDNN's flash-attention engines through its
//!   graph API (`braid::cuda::cudnn`), bf16 with a head size that is a
//!   multiple of 8 up to 128; the forward writes the same log-sum-exp, so
//!   either backward follows either forward. Its backward writes the
//!   gradient over (a [`GradWrite::Add`] call takes the kernels above) and
//!   is cuDNN's deterministic algorithm. With `auto`, a call whose cuDNN
//!   cannot be loaded, or has no engine for its shape and direction, runs
//!   the kernels above instead (and the report says so); with `cudnn` it
//!   fails. On an H200 with cuDNN 9.19 (docs/gpu-validation.md, run 8) it
//!   took GPT-2 124M's B 8 step from 23.4 to 19.9 ms; `BRAID_ATTENTION=braid`
//!   keeps Braid's kernels, which stay the reference.

use braid::cuda::cudnn::{CudnnAttention, Direction, SdpaShape};
use braid::cuda::{Gemm, KernelArgs, LaunchConfig, Transpose};
use braid::{CudaTaskCtx, DevSlice, DevSliceMut, Result, TaskHandle, View};

use super::cuda_common::{by_dtype, task_result, Check, Kernel, Launcher, Program};
use super::fastmath;
use super::storage::{Dtype, Storage};
use super::task::{submit, Task};
use super::{check_len, GradWrite};

pub(crate) static CUDA: Program = Program::new(
    "flash_attention.cu",
    include_str!("flash_attention.cu"),
    &[
        "flash_attention_forward",
        "flash_attention_forward_bf16",
        "flash_attention_delta",
        "flash_attention_delta_bf16",
        "flash_attention_backward_dq",
        "flash_attention_backward_dq_bf16",
        "flash_attention_backward_dkv",
        "flash_attention_backward_dkv_bf16",
    ],
);
static FORWARD: Kernel = Kernel::new(&CUDA, 0);
static FORWARD_BF16: Kernel = Kernel::new(&CUDA, 1);
static DELTA: Kernel = Kernel::new(&CUDA, 2);
static DELTA_BF16: Kernel = Kernel::new(&CUDA, 3);
static BACKWARD_DQ: Kernel = Kernel::new(&CUDA, 4);
static BACKWARD_DQ_BF16: Kernel = Kernel::new(&CUDA, 5);
static BACKWARD_DKV: Kernel = Kernel::new(&CUDA, 6);
static BACKWARD_DKV_BF16: Kernel = Kernel::new(&CUDA, 7);

/// The tensor-core kernels (`flash_attention_tc.cu`, bf16 only, the head
/// sizes of [`TC_HEAD_SIZES`], compute capability 8.0 or newer): forward,
/// `dQ` and `dK`/`dV` per head size.
pub(crate) static CUDA_TC: Program = Program::for_arch(
    "flash_attention_tc.cu",
    include_str!("flash_attention_tc.cu"),
    &[
        "flash_attention_tc_forward_hs16_bf16",
        "flash_attention_tc_backward_dq_hs16_bf16",
        "flash_attention_tc_backward_dkv_hs16_bf16",
        "flash_attention_tc_forward_hs32_bf16",
        "flash_attention_tc_backward_dq_hs32_bf16",
        "flash_attention_tc_backward_dkv_hs32_bf16",
        "flash_attention_tc_forward_hs64_bf16",
        "flash_attention_tc_backward_dq_hs64_bf16",
        "flash_attention_tc_backward_dkv_hs64_bf16",
        "flash_attention_tc_backward_dkv_ds_hs16_bf16",
        "flash_attention_tc_backward_dkv_ds_hs32_bf16",
        "flash_attention_tc_backward_dkv_ds_hs64_bf16",
    ],
    (8, 0),
);
/// `[forward, dQ, dK/dV, dK/dV storing dSᵀ]` of the tensor-core kernels,
/// per entry of [`TC_HEAD_SIZES`] (the last for [`dq_by_gemm`]).
static TC_KERNELS: [[Kernel; 4]; 3] = [
    [
        Kernel::new(&CUDA_TC, 0),
        Kernel::new(&CUDA_TC, 1),
        Kernel::new(&CUDA_TC, 2),
        Kernel::new(&CUDA_TC, 9),
    ],
    [
        Kernel::new(&CUDA_TC, 3),
        Kernel::new(&CUDA_TC, 4),
        Kernel::new(&CUDA_TC, 5),
        Kernel::new(&CUDA_TC, 10),
    ],
    [
        Kernel::new(&CUDA_TC, 6),
        Kernel::new(&CUDA_TC, 7),
        Kernel::new(&CUDA_TC, 8),
        Kernel::new(&CUDA_TC, 11),
    ],
];

/// The environment variable of [`attention_kernels`]: `braid`, `cudnn` or
/// `auto` ([`AttentionKernels`]).
pub const ATTENTION_ENV: &str = "BRAID_ATTENTION";

/// Which kernels run the fused bf16 attention on CUDA (`braid-gpt2 train
/// --attention`, [`ATTENTION_ENV`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AttentionKernels {
    /// Braid's kernels (the reference).
    Braid,
    /// cuDNN's fused attention where it takes the shape (module docs); a
    /// call fails when cuDNN cannot be loaded or has no engine for it.
    Cudnn,
    /// cuDNN's where it loads and has an engine for the shape and
    /// direction, Braid's otherwise (the default since run 8).
    #[default]
    Auto,
}

impl std::str::FromStr for AttentionKernels {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "braid" => Ok(Self::Braid),
            "cudnn" => Ok(Self::Cudnn),
            "auto" => Ok(Self::Auto),
            _ => Err(format!(
                "`{s}` names no attention kernels: braid, cudnn or auto"
            )),
        }
    }
}

impl std::fmt::Display for AttentionKernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Braid => "braid",
            Self::Cudnn => "cudnn",
            Self::Auto => "auto",
        })
    }
}

/// What [`ATTENTION_ENV`] asks for: `None` when it is unset or empty, an error
/// naming the variable when it names no [`AttentionKernels`].
pub fn attention_from_env() -> std::result::Result<Option<AttentionKernels>, String> {
    match std::env::var_os(ATTENTION_ENV) {
        Some(v) if !v.is_empty() => v
            .to_string_lossy()
            .parse()
            .map(Some)
            .map_err(|e| format!("{ATTENTION_ENV}: {e}")),
        _ => Ok(None),
    }
}

/// 0: not yet read from [`ATTENTION_ENV`]; else 1 + the [`AttentionKernels`]
/// index.
static KERNELS: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

const KERNEL_CHOICES: [AttentionKernels; 3] = [
    AttentionKernels::Braid,
    AttentionKernels::Cudnn,
    AttentionKernels::Auto,
];

/// Which kernels run the bf16 fused attention on CUDA (module docs):
/// [`ATTENTION_ENV`], read at the first call (a value that names no
/// [`AttentionKernels`] means `auto`, which `braid-gpt2` refuses before it
/// starts), or [`set_attention_kernels`]. `auto` by default since run 8
/// (docs/gpu-validation.md): cuDNN's attention where libcudnn loads and has
/// an engine for the shape, Braid's kernels otherwise. GPT-2 124M's fused
/// bf16 step ran 0.85× the time at B 8 and 0.84× at B 64 with it.
pub fn attention_kernels() -> AttentionKernels {
    use std::sync::atomic::Ordering;
    match KERNELS.load(Ordering::Relaxed) {
        0 => {
            let k = attention_from_env().ok().flatten().unwrap_or_default();
            set_attention_kernels(k);
            k
        }
        v => KERNEL_CHOICES[usize::from(v) - 1],
    }
}

/// Sets [`attention_kernels`] for the process (tests and benchmarks that
/// compare them in one run; tasks already submitted keep what they read).
pub fn set_attention_kernels(k: AttentionKernels) {
    let i = KERNEL_CHOICES.iter().position(|&c| c == k).unwrap_or(0);
    KERNELS.store(i as u8 + 1, std::sync::atomic::Ordering::Relaxed);
}

/// What ran each shape and direction through cuDNN so far, one line each
/// (cuDNN's version, the graph, the engine, the workspace), for reports;
/// under `auto` also what fell back to Braid's kernels, and why.
pub fn cudnn_report() -> Vec<String> {
    CUDNN_SEEN.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

static CUDNN_SEEN: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

/// A call of cuDNN's attention: the handle, the shape to hand it and
/// whether a failure to find an engine falls back to Braid's kernels
/// (`auto`).
struct CudnnCall<'a> {
    a: &'a CudnnAttention,
    shape: SdpaShape,
    auto: bool,
}

impl CudnnCall<'_> {
    /// Whether cuDNN ran `direction` (`result` is its call's): `true` when
    /// it did (and the report notes a plan it built), `false` when the
    /// task falls back to Braid's kernels (under `auto`, cuDNN found no
    /// engine for the shape and direction; noted in the report), and any
    /// other failure as the task's error.
    fn ran(&self, direction: Direction, result: braid::cuda::CudaResult<bool>) -> Result<bool> {
        let (a, shape) = (self.a, self.shape);
        match result {
            Ok(built) => {
                if built {
                    note_cudnn(a, shape, direction);
                }
                Ok(true)
            }
            Err(e) if self.auto && a.no_engine(shape, direction).is_some() => {
                note(format!(
                    "{}: Braid's kernels ({e})",
                    about(a, shape, direction)
                ));
                Ok(false)
            }
            Err(e) => Err(e.into()),
        }
    }
}

/// cuDNN's attention for this call (a [`CudnnCall`]), if its `direction`
/// takes cuDNN: it is asked for, the storage bf16, a head size
/// cuDNN takes (a multiple of 8 up to 128; otherwise cuDNN is not even
/// loaded), every tensor 16-byte aligned, and cuDNN takes the shape here
/// ([`CudnnAttention::takes`]); under `auto`, also cuDNN loaded and not
/// known to lack an engine for it. An error when `cudnn` asks for cuDNN and
/// it cannot be loaded.
#[allow(clippy::too_many_arguments)]
fn cudnn_for<'a, S: Storage>(
    cu: &CudaTaskCtx<'a>,
    direction: Direction,
    b: usize,
    t: usize,
    c: usize,
    nh: usize,
    aligned: &[u64],
) -> Result<Option<CudnnCall<'a>>> {
    let auto = match attention_kernels() {
        AttentionKernels::Braid => return Ok(None),
        AttentionKernels::Cudnn => false,
        AttentionKernels::Auto => true,
    };
    let hs = c / nh.max(1);
    let wanted = matches!(S::DTYPE, Dtype::Bf16)
        && nh > 0
        && c % nh == 0
        && braid::cuda::cudnn::takes_head_size(hs)
        && aligned.iter().all(|p| p % 16 == 0);
    if !wanted {
        return Ok(None);
    }
    let shape = SdpaShape { b, t, nh, hs };
    let a = match cu.cudnn_attention() {
        Ok(a) => a,
        Err(e) if auto => {
            note(format!(
                "cuDNN not loaded ({e}): Braid's kernels run the attention"
            ));
            return Ok(None);
        }
        Err(e) => return Err(e),
    };
    let takes = a.takes(shape, direction) && !(auto && a.no_engine(shape, direction).is_some());
    Ok(takes.then_some(CudnnCall { a, shape, auto }))
}

/// Adds `line` to [`cudnn_report`] unless it is there.
fn note(line: String) {
    let mut seen = CUDNN_SEEN.lock().unwrap_or_else(|e| e.into_inner());
    if !seen.contains(&line) {
        seen.push(line);
    }
}

/// Records what ran `shape`'s `direction`, once its plan was built.
fn note_cudnn(a: &CudnnAttention, shape: SdpaShape, direction: Direction) {
    if let Some(how) = a.describe(shape, direction) {
        note(format!("{}: {how}", about(a, shape, direction)));
    }
}

/// `cuDNN 9.19.0 attention Forward B 8 T 1024 NH 12 HS 64`: the head of a
/// report line.
fn about(a: &CudnnAttention, shape: SdpaShape, direction: Direction) -> String {
    format!(
        "cuDNN {} attention {direction:?} B {} T {} NH {} HS {}",
        a.version(),
        shape.b,
        shape.t,
        shape.nh,
        shape.hs
    )
}

/// The environment variable of [`dq_by_gemm`].
pub const DQ_GEMM_ENV: &str = "BRAID_ATTENTION_DQ";

/// Whether the tensor-core backward takes dQ as one cuBLAS product,
/// `scale · dS · K`, from a dS the dK/dV kernel stores (bf16, `(B, NH, T,
/// T)`: [`ds_bytes`], kept by the model), instead of the dQ kernel, which
/// computes S and dP a second time (FlashAttention-2's backward is 5
/// products; the two kernels are 7): `BRAID_ATTENTION_DQ=gemm`, read once
/// (`kernel`, the default, keeps the dQ kernel; other values are refused by
/// [`check_environment`](super::switches::check_environment)).
/// Off by default until it has run on a GPU (docs/gpu-validation.md): it
/// trades the dQ kernel (part of run 7's 5.16 ms of attention backward at
/// B 8) for writing and reading dS, 2 MiB per (batch row, head) at T 1024
/// (192 MiB at B 8, each of the 12 layers), and a product.
pub fn dq_by_gemm() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os(DQ_GEMM_ENV).is_some_and(|v| v == "gemm"))
}

/// Bytes of the dS buffer [`dq_by_gemm`] needs: `(B, NH, T, T)` bf16.
pub fn ds_bytes(b: usize, t: usize, nh: usize) -> usize {
    b * nh * t * t * 2
}

/// The largest head size the CUDA kernels take (their per-thread arrays).
pub const CUDA_MAX_HS: usize = 128;

/// The head sizes the tensor-core kernels are built for: GPT-2's 64 at
/// every published size, and the 16 and 32 of the `tiny` and `small`
/// configurations.
pub const TC_HEAD_SIZES: [usize; 3] = [16, 32, 64];
/// Query rows (forward, dQ) or key rows (dK, dV) per block of the
/// tensor-core kernels.
const TC_ROWS: usize = 64;

/// Whether the launchers run an attention of `c` channels in `nh`
/// heads, stored as `S`, on `device`'s tensor cores: bf16 storage, a head
/// size of [`TC_HEAD_SIZES`], `c` a multiple of 8 (16-byte rows), compute
/// capability 8.0 or newer. The launchers also need `inp` and `dout`
/// 16-byte aligned.
pub fn tensor_cores_apply<S: Storage>(
    device: &braid::cuda::CudaDevice,
    c: usize,
    nh: usize,
) -> bool {
    matches!(S::DTYPE, Dtype::Bf16)
        && nh > 0
        && c % nh == 0
        && tc_kernels(c / nh).is_some()
        && c % 8 == 0
        && CUDA_TC.supports(device)
}

/// `[forward, dQ, dK/dV, dK/dV storing dSᵀ]` for head size `hs`, if the
/// tensor-core kernels are built for it.
fn tc_kernels(hs: usize) -> Option<&'static [Kernel; 4]> {
    let i = TC_HEAD_SIZES.iter().position(|&h| h == hs)?;
    Some(&TC_KERNELS[i])
}

/// Query tile rows of the CPU tasks.
pub const BLOCK_Q: usize = 32;
/// Key tile columns of the CPU tasks.
pub const BLOCK_K: usize = 32;

// ---------------------------------------------------------------------------
// Sizes
// ---------------------------------------------------------------------------

/// Elements saved by the forward pass for the backward pass besides `out`:
/// the per-row logsumexp, `(B, NH, T)`.
pub fn saved_len(b: usize, t: usize, nh: usize) -> usize {
    b * nh * t
}

/// Bytes of scratch the backward pass takes: `D = rowsum(dout ∘ out)`,
/// `(B, NH, T)` `f32`. The forward pass needs none beyond its tiles.
pub fn backward_scratch_bytes(b: usize, t: usize, nh: usize) -> usize {
    b * nh * t * 4
}

/// Bytes of per-tile working memory one kernel invocation uses (what a GPU
/// block keeps in registers and shared memory): forward `S` tile, `acc`,
/// `m`, `l`; backward `P` and `dS` tiles, `dK` and `dV` accumulators. The
/// larger of the two; independent of `B`, `NH` and `T`.
pub fn tile_bytes(c: usize, nh: usize, block_q: usize, block_k: usize) -> usize {
    let hs = c / nh;
    let fwd = block_q * block_k + block_q * hs + 2 * block_q;
    let bwd = 2 * block_q * block_k + 2 * block_k * hs;
    fwd.max(bwd) * 4
}

// ---------------------------------------------------------------------------
// Tasks
// ---------------------------------------------------------------------------

/// Submits [`flash_attention_forward`] as a task (CPU and CUDA bodies):
/// writes `out` and the per-row logsumexp `lse`.
pub fn forward<'rt>(
    task: impl Into<Task<'rt>>,
    out: &View, // (B, T, C)
    lse: &View, // (B, NH, T)
    inp: &View, // (B, T, 3C)
    b: usize,
    t: usize,
    c: usize,
    nh: usize,
) -> Result<TaskHandle> {
    submit!(
        task,
        |S| (out.write::<S>(), lse.write::<f32>(), inp.read::<S>()),
        move |(out, lse, inp)| {
            flash_attention_forward(out, lse, inp, b, t, c, nh, BLOCK_Q, BLOCK_K)
        },
        move |(out, lse, inp), cu| {
            task_result(flash_attention_forward_cuda(cu, out, lse, inp, b, t, c, nh))
        },
    )
}

/// Submits [`flash_attention_backward`] as a task (CPU and CUDA bodies):
/// accumulates into `dinp`; `scratch` is [`backward_scratch_bytes`] bytes
/// (declared `write`, dead after the task). With `ds` ([`ds_bytes`], zeroed
/// when allocated and used for nothing else: its masked elements must stay
/// zero), a CUDA task on the tensor cores takes dQ as one product
/// ([`dq_by_gemm`]); the CPU body does not touch it.
#[allow(clippy::too_many_arguments)]
pub fn backward<'rt>(
    task: impl Into<Task<'rt>>,
    dinp: &View, // (B, T, 3C) accumulated or overwritten
    write: GradWrite,
    dout: &View,    // (B, T, C)
    inp: &View,     // (B, T, 3C)
    out: &View,     // (B, T, C)
    lse: &View,     // (B, NH, T)
    scratch: &View, // backward_scratch_bytes
    ds: Option<&View>,
    b: usize,
    t: usize,
    c: usize,
    nh: usize,
) -> Result<TaskHandle> {
    submit!(
        task,
        |S| (
            dinp.read_write::<S>(),
            dout.read::<S>(),
            inp.read::<S>(),
            out.read::<S>(),
            lse.read::<f32>(),
            scratch.write::<f32>(),
            ds.map(|d| d.read_write::<S>()),
        ),
        move |(dinp, dout, inp, out, lse, delta, _ds)| {
            write.prepare(dinp);
            flash_attention_backward(
                dinp, delta, dout, inp, out, lse, b, t, c, nh, BLOCK_Q, BLOCK_K,
            )
        },
        move |(dinp, dout, inp, out, lse, delta, ds), cu| {
            let bw = Backward {
                dinp,
                write,
                delta,
                dout,
                inp,
                out,
                lse,
                ds,
            };
            task_result(flash_attention_backward_cuda(cu, bw, b, t, c, nh))
        },
    )
}

// ---------------------------------------------------------------------------
// CPU kernels
// ---------------------------------------------------------------------------

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(&x, &y)| x * y).sum()
}

/// Causal self-attention, tile by tile with the online softmax (module
/// docs): overwrites `out` and the per-row logsumexp of the scaled scores
/// `lse[b, h, t] = ln Σ_{t2 <= t} exp(q_t·k_t2 / sqrt(hs))`.
pub fn flash_attention_forward<S: Storage>(
    out: &mut [S],   // (B, T, C)
    lse: &mut [f32], // (B, NH, T)
    inp: &[S],       // (B, T, 3C)
    b: usize,
    t: usize,
    c: usize,
    nh: usize,
    block_q: usize,
    block_k: usize,
) {
    let inp = S::load_slice(inp);
    S::update_f32(out, |out| {
        flash_attention_forward_f32(out, lse, &inp, b, t, c, nh, block_q, block_k)
    })
}

/// [`flash_attention_forward`] in `f32`.
fn flash_attention_forward_f32(
    out: &mut [f32], // (B, T, C)
    lse: &mut [f32], // (B, NH, T)
    inp: &[f32],     // (B, T, 3C)
    b: usize,
    t: usize,
    c: usize,
    nh: usize,
    block_q: usize,
    block_k: usize,
) {
    assert!(
        nh > 0 && c % nh == 0,
        "flash_attention_forward: C ({c}) not divisible by NH ({nh})"
    );
    assert!(
        block_q > 0 && block_k > 0,
        "flash_attention_forward: tile sizes must be positive"
    );
    check_len("flash_attention_forward", "out", out.len(), b * t * c);
    check_len("flash_attention_forward", "lse", lse.len(), b * nh * t);
    check_len("flash_attention_forward", "inp", inp.len(), b * t * 3 * c);
    let hs = c / nh;
    let c3 = 3 * c;
    let scale = 1.0 / (hs as f32).sqrt();
    // One tile of working memory, reused.
    let mut s = vec![0.0f32; block_q * block_k]; // scores, then probabilities
    let mut acc = vec![0.0f32; block_q * hs];
    let mut m = vec![0.0f32; block_q];
    let mut l = vec![0.0f32; block_q];
    for bi in 0..b {
        let inp_b = &inp[bi * t * c3..][..t * c3];
        let q = |i: usize, h: usize| &inp_b[i * c3 + h * hs..][..hs];
        let k = |j: usize, h: usize| &inp_b[j * c3 + c + h * hs..][..hs];
        let v = |j: usize, h: usize| &inp_b[j * c3 + 2 * c + h * hs..][..hs];
        for h in 0..nh {
            for q0 in (0..t).step_by(block_q) {
                let q1 = (q0 + block_q).min(t);
                let nq = q1 - q0;
                m[..nq].fill(f32::NEG_INFINITY);
                l[..nq].fill(0.0);
                acc[..nq * hs].fill(0.0);
                // Key tiles of the causal prefix: keys up to q1 - 1.
                for k0 in (0..q1).step_by(block_k) {
                    let k1 = (k0 + block_k).min(q1);
                    let nk = k1 - k0;
                    for r in 0..nq {
                        let i = q0 + r;
                        if k0 > i {
                            continue; // the whole row of this tile is masked
                        }
                        let kend = k1.min(i + 1); // keys k0..kend are unmasked
                        let s_row = &mut s[r * block_k..][..nk];
                        let mut rowmax = f32::NEG_INFINITY;
                        for j in k0..kend {
                            let x = dot(q(i, h), k(j, h)) * scale;
                            s_row[j - k0] = x;
                            rowmax = rowmax.max(x);
                        }
                        // Online softmax: rescale what is there to the new max.
                        let m_new = m[r].max(rowmax);
                        let corr = fastmath::exp(m[r] - m_new); // 0 on the first tile
                        let acc_r = &mut acc[r * hs..][..hs];
                        let mut sum = l[r] * corr;
                        for a in acc_r.iter_mut() {
                            *a *= corr;
                        }
                        for j in k0..kend {
                            let p = fastmath::exp(s_row[j - k0] - m_new);
                            sum += p;
                            for (a, &vv) in acc_r.iter_mut().zip(v(j, h)) {
                                *a += p * vv;
                            }
                        }
                        m[r] = m_new;
                        l[r] = sum;
                    }
                }
                for r in 0..nq {
                    let i = q0 + r;
                    let inv = 1.0 / l[r];
                    let out_h = &mut out[(bi * t + i) * c + h * hs..][..hs];
                    for (o, &a) in out_h.iter_mut().zip(&acc[r * hs..][..hs]) {
                        *o = a * inv;
                    }
                    lse[(bi * nh + h) * t + i] = m[r] + l[r].ln();
                }
            }
        }
    }
}

/// Backward of [`flash_attention_forward`] (FlashAttention-2, module docs):
/// accumulates the query, key and value gradients into `dinp` (packed like
/// `inp`) from `dout`, recomputing the probabilities tile by tile from `inp`
/// and the saved `lse`. `delta` is scratch, overwritten with
/// `D = rowsum(dout ∘ out)`.
pub fn flash_attention_backward<S: Storage>(
    dinp: &mut [S],    // (B, T, 3C) accumulated
    delta: &mut [f32], // (B, NH, T) scratch
    dout: &[S],        // (B, T, C)
    inp: &[S],         // (B, T, 3C)
    out: &[S],         // (B, T, C)
    lse: &[f32],       // (B, NH, T)
    b: usize,
    t: usize,
    c: usize,
    nh: usize,
    block_q: usize,
    block_k: usize,
) {
    let (dout, inp, out) = (S::load_slice(dout), S::load_slice(inp), S::load_slice(out));
    S::update_f32(dinp, |dinp| {
        flash_attention_backward_f32(
            dinp, delta, &dout, &inp, &out, lse, b, t, c, nh, block_q, block_k,
        )
    })
}

/// [`flash_attention_backward`] in `f32`.
fn flash_attention_backward_f32(
    dinp: &mut [f32],  // (B, T, 3C) accumulated
    delta: &mut [f32], // (B, NH, T) scratch
    dout: &[f32],      // (B, T, C)
    inp: &[f32],       // (B, T, 3C)
    out: &[f32],       // (B, T, C)
    lse: &[f32],       // (B, NH, T)
    b: usize,
    t: usize,
    c: usize,
    nh: usize,
    block_q: usize,
    block_k: usize,
) {
    let name = "flash_attention_backward";
    assert!(
        nh > 0 && c % nh == 0,
        "{name}: C ({c}) not divisible by NH ({nh})"
    );
    assert!(
        block_q > 0 && block_k > 0,
        "{name}: tile sizes must be positive"
    );
    check_len(name, "dinp", dinp.len(), b * t * 3 * c);
    check_len(name, "delta", delta.len(), b * nh * t);
    check_len(name, "dout", dout.len(), b * t * c);
    check_len(name, "inp", inp.len(), b * t * 3 * c);
    check_len(name, "out", out.len(), b * t * c);
    check_len(name, "lse", lse.len(), b * nh * t);
    let hs = c / nh;
    let c3 = 3 * c;
    let scale = 1.0 / (hs as f32).sqrt();
    let mut p = vec![0.0f32; block_q * block_k];
    let mut ds = vec![0.0f32; block_q * block_k];
    let mut dk = vec![0.0f32; block_k * hs];
    let mut dv = vec![0.0f32; block_k * hs];

    // D = rowsum(dout ∘ out), per head.
    for bi in 0..b {
        for h in 0..nh {
            for i in 0..t {
                let row = (bi * t + i) * c + h * hs;
                delta[(bi * nh + h) * t + i] = dot(&dout[row..][..hs], &out[row..][..hs]);
            }
        }
    }

    for bi in 0..b {
        let inp_b = &inp[bi * t * c3..][..t * c3];
        let dinp_b = &mut dinp[bi * t * c3..][..t * c3];
        let q = |i: usize, h: usize| &inp_b[i * c3 + h * hs..][..hs];
        let k = |j: usize, h: usize| &inp_b[j * c3 + c + h * hs..][..hs];
        let v = |j: usize, h: usize| &inp_b[j * c3 + 2 * c + h * hs..][..hs];
        let d_o = |i: usize, h: usize| &dout[(bi * t + i) * c + h * hs..][..hs];
        for h in 0..nh {
            let lse_h = &lse[(bi * nh + h) * t..][..t];
            let delta_h = &delta[(bi * nh + h) * t..][..t];
            for k0 in (0..t).step_by(block_k) {
                let k1 = (k0 + block_k).min(t);
                let nk = k1 - k0;
                dk[..nk * hs].fill(0.0);
                dv[..nk * hs].fill(0.0);
                // Query tiles with a row at or below the diagonal: rows >= k0.
                for q0 in ((k0 / block_q) * block_q..t).step_by(block_q) {
                    let q1 = (q0 + block_q).min(t);
                    let nq = q1 - q0;
                    // P and dS for this tile; masked entries are 0.
                    for r in 0..nq {
                        let i = q0 + r;
                        let p_row = &mut p[r * block_k..][..nk];
                        let ds_row = &mut ds[r * block_k..][..nk];
                        for jj in 0..nk {
                            let j = k0 + jj;
                            if j > i {
                                p_row[jj] = 0.0;
                                ds_row[jj] = 0.0;
                                continue;
                            }
                            let pij = fastmath::exp(dot(q(i, h), k(j, h)) * scale - lse_h[i]);
                            let dpij = dot(d_o(i, h), v(j, h));
                            p_row[jj] = pij;
                            ds_row[jj] = pij * (dpij - delta_h[i]);
                        }
                    }
                    // dV += Pᵀ · dout, dK += dSᵀ · q · scale
                    for jj in 0..nk {
                        let dv_j = &mut dv[jj * hs..][..hs];
                        let dk_j = &mut dk[jj * hs..][..hs];
                        for r in 0..nq {
                            let i = q0 + r;
                            let (pij, dsij) = (p[r * block_k + jj], ds[r * block_k + jj] * scale);
                            if pij == 0.0 && dsij == 0.0 {
                                continue;
                            }
                            for (d, &g) in dv_j.iter_mut().zip(d_o(i, h)) {
                                *d += pij * g;
                            }
                            for (d, &qq) in dk_j.iter_mut().zip(q(i, h)) {
                                *d += dsij * qq;
                            }
                        }
                    }
                    // dQ += dS · k · scale, straight into dinp.
                    for r in 0..nq {
                        let i = q0 + r;
                        let dq = &mut dinp_b[i * c3 + h * hs..][..hs];
                        for jj in 0..nk {
                            let g = ds[r * block_k + jj] * scale;
                            if g == 0.0 {
                                continue;
                            }
                            for (d, &kk) in dq.iter_mut().zip(k(k0 + jj, h)) {
                                *d += g * kk;
                            }
                        }
                    }
                }
                for jj in 0..nk {
                    let j = k0 + jj;
                    let dk_dst = &mut dinp_b[j * c3 + c + h * hs..][..hs];
                    for (d, &x) in dk_dst.iter_mut().zip(&dk[jj * hs..][..hs]) {
                        *d += x;
                    }
                    let dv_dst = &mut dinp_b[j * c3 + 2 * c + h * hs..][..hs];
                    for (d, &x) in dv_dst.iter_mut().zip(&dv[jj * hs..][..hs]) {
                        *d += x;
                    }
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------
// CUDA launchers
// ---------------------------------------------------------------------------

/// Threads per block of the CUDA kernels (a thread per row).
const ROWS_PER_BLOCK: u32 = 128;

/// Checks `(B, T, C, NH)` for the CUDA kernels (`C` a multiple of `NH`, the
/// head size at most [`CUDA_MAX_HS`], `B·NH` within a grid's y dimension)
/// and returns them as `int`s.
fn shape(k: &Check, b: usize, t: usize, c: usize, nh: usize) -> Result<[i32; 4]> {
    let dims = [
        k.dim("B", b)?,
        k.dim("T", t)?,
        k.dim("C", c)?,
        k.dim("NH", nh)?,
    ];
    if c % nh != 0 || c / nh > CUDA_MAX_HS {
        return Err(k.err(format!(
            "C ({c}) must be NH ({nh}) heads of at most {CUDA_MAX_HS} channels"
        )));
    }
    if k.mul(b, nh)? > 65_535 {
        return Err(k.err(format!("B·NH = {} exceeds the grid's 65,535", b * nh)));
    }
    Ok(dims)
}

/// A thread per row: `(ceil(T / 128), B·NH)` blocks of 128 (`shape`
/// checked `B·NH`).
fn rows(l: &Launcher<'_>, [b, t, _, nh]: [i32; 4]) -> Result<LaunchConfig> {
    Ok(LaunchConfig {
        grid: (
            l.grid((t as usize).div_ceil(ROWS_PER_BLOCK as usize))?,
            (b * nh) as u32,
            1,
        ),
        block: (ROWS_PER_BLOCK, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// Blocks of the tensor-core kernels: `(ceil(T / 64), B·NH)` blocks of 4
/// warps (`shape` checked `B·NH`).
fn tc_tiles(l: &Launcher<'_>, [b, t, _, nh]: [i32; 4]) -> Result<LaunchConfig> {
    Ok(LaunchConfig {
        grid: (l.grid((t as usize).div_ceil(TC_ROWS))?, (b * nh) as u32, 1),
        block: (128, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// The tensor-core kernels `[forward, dQ, dK/dV]` if a call takes them:
/// the shape and device allow it ([`tensor_cores_apply`]) and every tensor
/// the kernels stage 16 bytes at a time starts 16-byte aligned.
fn takes_tensor_cores<S: Storage>(
    cu: &CudaTaskCtx<'_>,
    c: usize,
    nh: usize,
    staged: &[u64],
) -> Option<&'static [Kernel; 4]> {
    let takes = tensor_cores_apply::<S>(cu.device(), c, nh) && staged.iter().all(|p| p % 16 == 0);
    takes.then(|| tc_kernels(c / nh)).flatten()
}

/// [`flash_attention_forward`] on the task's stream (module docs, CUDA),
/// on the tensor cores where they apply.
#[allow(clippy::too_many_arguments)]
pub fn flash_attention_forward_cuda<S: Storage>(
    cu: &CudaTaskCtx<'_>,
    out: DevSliceMut<S>,   // (B, T, C)
    lse: DevSliceMut<f32>, // (B, NH, T)
    inp: DevSlice<S>,      // (B, T, 3C)
    b: usize,
    t: usize,
    c: usize,
    nh: usize,
) -> Result<()> {
    let k = Check::new("flash_attention_forward");
    let dims @ [bi, ti, ci, nhi] = shape(&k, b, t, c, nh)?;
    let btc = k.mul(k.mul(b, t)?, c)?;
    k.exact("out", &out, "(B, T, C)", btc)?;
    k.exact("lse", &lse, "(B, NH, T)", k.mul(k.mul(b, nh)?, t)?)?;
    k.exact("inp", &inp, "(B, T, 3C)", k.mul(btc, 3)?)?;
    let aligned = [inp.ptr(), out.ptr(), lse.ptr()];
    if let Some(call) = cudnn_for::<S>(cu, Direction::Forward, b, t, c, nh, &aligned)? {
        // SAFETY: sizes checked above: inp (B, T, 3C), out (B, T, C) and
        // lse (B, NH, T) f32, bf16 (S is bf16), 16-byte aligned; the task
        // holds them on this stream (out and lse written).
        let r = unsafe {
            call.a
                .forward(cu.stream(), call.shape, inp.ptr(), out.ptr(), lse.ptr())
        };
        if call.ran(Direction::Forward, r)? {
            return Ok(());
        }
    }
    let tensor_cores = takes_tensor_cores::<S>(cu, c, nh, &[inp.ptr()]);
    let l = Launcher::new(k, cu);
    let mut a = KernelArgs::new();
    a.ptr(out.ptr())
        .ptr(lse.ptr())
        .ptr(inp.ptr())
        .i32(bi)
        .i32(ti)
        .i32(ci)
        .i32(nhi);
    if let Some([forward, ..]) = tensor_cores {
        // SAFETY: flash_attention_tc_forward_hs<hs>_bf16(bf16_t* out, float*
        // lse, const bf16_t* inp, int B, int T, int C, int NH); sizes
        // checked, S is bf16, the kernel's head size is C / NH, C % 8 == 0
        // and inp 16-byte aligned (takes_tensor_cores); a block per 64 query
        // rows of one (b, h).
        return unsafe { l.launch(forward, tc_tiles(&l, dims)?, &a) };
    }
    a.i32(BLOCK_K as i32);
    let kernel = by_dtype::<S>(&FORWARD, &FORWARD_BF16);
    // SAFETY: flash_attention_forward[_bf16](S* out, float* lse, const S*
    // inp, int B, int T, int C, int NH, int block_k); sizes checked, one
    // thread per (b, h, row) within the grid `rows` made.
    unsafe { l.launch(kernel, rows(&l, dims)?, &a) }
}

/// The tensors of one [`flash_attention_backward_cuda`] call.
#[derive(Debug)]
pub struct Backward<'a, S> {
    /// (B, T, 3C) accumulated, or overwritten with [`GradWrite::Set`].
    pub dinp: DevSliceMut<'a, S>,
    /// Whether `dinp` is added to or written over.
    pub write: GradWrite,
    /// (B, NH, T) scratch, overwritten with `rowsum(dout ∘ out)`.
    pub delta: DevSliceMut<'a, f32>,
    /// (B, T, C).
    pub dout: DevSlice<'a, S>,
    /// (B, T, 3C).
    pub inp: DevSlice<'a, S>,
    /// (B, T, C): the forward pass's output.
    pub out: DevSlice<'a, S>,
    /// (B, NH, T): the forward pass's logsumexp.
    pub lse: DevSlice<'a, f32>,
    /// (B, NH, T, T): dSᵀ for dQ as one product ([`dq_by_gemm`]); its
    /// masked elements zero. `None`: the dQ kernel.
    pub ds: Option<DevSliceMut<'a, S>>,
}

/// [`flash_attention_backward`] on the task's stream (module docs, CUDA):
/// three kernels in turn, `delta`, then `dQ`, then `dK` and `dV`; the last
/// two on the tensor cores where they apply. With `bw.ds` on the tensor
/// cores and `T` even, `dK` and `dV` first, storing dSᵀ, then dQ as
/// batched cuBLAS products, one per batch row or per head, whichever are
/// fewer ([`dq_by_gemm`]).
pub fn flash_attention_backward_cuda<S: Storage>(
    cu: &CudaTaskCtx<'_>,
    bw: Backward<'_, S>,
    b: usize,
    t: usize,
    c: usize,
    nh: usize,
) -> Result<()> {
    let k = Check::new("flash_attention_backward");
    let dims @ [bi, ti, ci, nhi] = shape(&k, b, t, c, nh)?;
    let btc = k.mul(k.mul(b, t)?, c)?;
    let bht = k.mul(k.mul(b, nh)?, t)?;
    k.exact("dinp", &bw.dinp, "(B, T, 3C)", k.mul(btc, 3)?)?;
    k.exact("delta", &bw.delta, "(B, NH, T)", bht)?;
    k.exact("dout", &bw.dout, "(B, T, C)", btc)?;
    k.exact("inp", &bw.inp, "(B, T, 3C)", k.mul(btc, 3)?)?;
    k.exact("out", &bw.out, "(B, T, C)", btc)?;
    k.exact("lse", &bw.lse, "(B, NH, T)", bht)?;
    let aligned = [
        bw.inp.ptr(),
        bw.out.ptr(),
        bw.dout.ptr(),
        bw.lse.ptr(),
        bw.dinp.ptr(),
    ];
    let cudnn = match bw.write {
        GradWrite::Set => cudnn_for::<S>(cu, Direction::Backward, b, t, c, nh, &aligned)?,
        GradWrite::Add => None,
    };
    if let Some(call) = cudnn {
        // SAFETY: sizes checked above, bf16, 16-byte aligned; dinp (B, T,
        // 3C) is written over and is disjoint from the inputs the task
        // reads; `delta` (scratch) is not used.
        let r = unsafe {
            call.a.backward(
                cu.stream(),
                call.shape,
                bw.inp.ptr(),
                bw.out.ptr(),
                bw.dout.ptr(),
                bw.lse.ptr(),
                bw.dinp.ptr(),
            )
        };
        if call.ran(Direction::Backward, r)? {
            return Ok(());
        }
    }
    let tensor_cores = takes_tensor_cores::<S>(cu, c, nh, &[bw.inp.ptr(), bw.dout.ptr()]);
    // dQ as one product: on the tensor cores, with T even.
    let ds = match (tensor_cores, bw.ds, t % 2 == 0) {
        (Some([.., dkv_ds]), Some(ds), true) => {
            k.exact("ds", &ds, "(B, NH, T, T)", k.mul(bht, t)?)?;
            Some((dkv_ds, ds))
        }
        _ => None,
    };
    let l = Launcher::new(k, cu);
    let cfg = rows(&l, dims)?;
    let mut a = KernelArgs::new();
    a.ptr(bw.delta.ptr())
        .ptr(bw.dout.ptr())
        .ptr(bw.out.ptr())
        .i32(bi)
        .i32(ti)
        .i32(ci)
        .i32(nhi);
    // SAFETY: flash_attention_delta[_bf16](float* delta, const S* dout,
    // const S* out, int B, int T, int C, int NH); sizes checked.
    unsafe { l.launch(by_dtype::<S>(&DELTA, &DELTA_BF16), cfg, &a)? };
    let mut a = KernelArgs::new();
    a.ptr(bw.dinp.ptr())
        .ptr(bw.delta.ptr())
        .ptr(bw.dout.ptr())
        .ptr(bw.inp.ptr())
        .ptr(bw.lse.ptr())
        .i32(bi)
        .i32(ti)
        .i32(ci)
        .i32(nhi)
        .i32(bw.write.accumulate());
    if let Some((dkv_ds, ds)) = ds {
        let hs = c / nh;
        a.ptr(ds.ptr());
        // SAFETY: flash_attention_tc_backward_dkv_ds_hs<hs>_bf16(bf16_t*
        // dinp, const float* delta, const bf16_t* dout, const bf16_t* inp,
        // const float* lse, int B, int T, int C, int NH, int accumulate,
        // bf16_t* ds); sizes checked as for the dQ/dK/dV kernels below, ds
        // (B, NH, T, T) and T even (its stores are pairs). It writes dinp's
        // key and value channels and ds.
        unsafe { l.launch(dkv_ds, tc_tiles(&l, dims)?, &a)? };
        let g = Gemm {
            alpha: 1.0 / (hs as f32).sqrt(),
            beta: bw.write.accumulate() as f32,
            lda: t,
            ldb: 3 * c,
            ldc: 3 * c,
            ..Gemm::new(Transpose::T, Transpose::N, t, hs, t)
        };
        // Block (bi, h) of ds starts at (bi·NH + h)·T·T, its keys in inp
        // and its queries' channels in dinp at bi·T·3C + h·hs (keys past C):
        // strided along either index, so one batched product per value of
        // the smaller one, over the other.
        let es = std::mem::size_of::<S>() as u64;
        let (ds_b, ds_h) = ((nh * t * t) as u64, (t * t) as u64);
        let (row_b, row_h) = ((t * 3 * c) as u64, hs as u64);
        let (outer, inner) = if b <= nh {
            ((b, ds_b, row_b), (nh, ds_h, row_h))
        } else {
            ((nh, ds_h, row_h), (b, ds_b, row_b))
        };
        for i in 0..outer.0 as u64 {
            let (ds_at, row_at) = (i * outer.1, i * outer.2);
            // SAFETY: entry j of the batch is block (bi, h) of `outer` index
            // i and `inner` index j: op(A) = dS, the transpose of ds's block
            // (T × T, row stride T); B = its keys, T × hs at row stride 3C in
            // inp; C = its queries' channels of dinp, T × hs at row stride
            // 3C. All inside the checked sizes; bf16 (S is bf16 on the
            // tensor cores).
            unsafe {
                l.gemm_batched_as::<S>(
                    &g,
                    ds.ptr() + ds_at * es,
                    inner.1 as i64,
                    bw.inp.ptr() + (row_at + c as u64) * es,
                    inner.2 as i64,
                    bw.dinp.ptr() + row_at * es,
                    inner.2 as i64,
                    inner.0,
                )?
            };
        }
        return Ok(());
    }
    let (dq, dkv, cfg) = if let Some([_, dq, dkv, _]) = tensor_cores {
        (dq, dkv, tc_tiles(&l, dims)?)
    } else {
        (
            by_dtype::<S>(&BACKWARD_DQ, &BACKWARD_DQ_BF16),
            by_dtype::<S>(&BACKWARD_DKV, &BACKWARD_DKV_BF16),
            cfg,
        )
    };
    // SAFETY: flash_attention[_tc]_backward_{dq,dkv}[_bf16](S* dinp, const
    // float* delta, const S* dout, const S* inp, const float* lse, int B,
    // int T, int C, int NH, int accumulate); sizes checked (and for the tensor-core kernels
    // S is bf16, the kernels' head size is C / NH, C % 8 == 0, inp and dout
    // 16-byte aligned); the dq
    // kernel writes dinp's query channels, the dkv kernel (after it on the
    // stream) its key and value channels.
    unsafe {
        l.launch(dq, cfg, &a)?;
        l.launch(dkv, cfg, &a)
    }
}

#[cfg(test)]
mod tests {
    use super::super::attention::{attention_backward, attention_forward};
    use super::super::testutil::{assert_close, fd_check, max_errors, randn};
    use super::*;

    /// Each attention-kernel choice reads back from its name (what
    /// `--attention` and `BRAID_ATTENTION` take), and a name that is none
    /// lists the choices.
    #[test]
    fn attention_kernels_read_back_from_their_names() {
        for k in KERNEL_CHOICES {
            assert_eq!(k.to_string().parse::<AttentionKernels>(), Ok(k));
        }
        let e = "cuDNN".parse::<AttentionKernels>().unwrap_err();
        assert!(
            e.contains("`cuDNN`") && e.contains("braid, cudnn or auto"),
            "{e}"
        );
    }

    /// Odd shapes: T not a multiple of any tile, NH > 1, B > 1, hs = 5.
    const SHAPES: [(usize, usize, usize, usize); 3] = [(2, 13, 15, 3), (1, 7, 8, 2), (3, 5, 6, 1)];
    /// (block_q, block_k): 1×1, unequal, non-dividing, and larger than T.
    const TILES: [(usize, usize); 6] = [(1, 1), (4, 3), (3, 4), (5, 7), (16, 2), (64, 64)];

    struct Unfused {
        out: Vec<f32>,
        preatt: Vec<f32>,
        att: Vec<f32>,
    }

    fn unfused(inp: &[f32], b: usize, t: usize, c: usize, nh: usize) -> Unfused {
        let mut out = vec![f32::NAN; b * t * c];
        let mut preatt = vec![f32::NAN; b * nh * t * t];
        let mut att = vec![f32::NAN; b * nh * t * t];
        attention_forward(&mut out, &mut preatt, &mut att, inp, b, t, c, nh);
        Unfused { out, preatt, att }
    }

    fn fused(
        inp: &[f32],
        b: usize,
        t: usize,
        c: usize,
        nh: usize,
        (bq, bk): (usize, usize),
    ) -> (Vec<f32>, Vec<f32>) {
        let mut out = vec![f32::NAN; b * t * c];
        let mut lse = vec![f32::NAN; b * nh * t];
        flash_attention_forward(&mut out, &mut lse, inp, b, t, c, nh, bq, bk);
        (out, lse)
    }

    /// `ln Σ_{t2 <= t} exp(preatt)` per row, in f64 from the unfused scores.
    fn lse_of(preatt: &[f32], t: usize) -> Vec<f32> {
        preatt
            .chunks_exact(t)
            .enumerate()
            .map(|(r, row)| {
                let row = &row[..=r % t];
                let m = row.iter().fold(f32::NEG_INFINITY, |a, &x| a.max(x)) as f64;
                (m + row.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln()) as f32
            })
            .collect()
    }

    #[test]
    fn forward_matches_unfused_on_odd_shapes_and_tiles() {
        let mut worst = (0.0f32, 0.0f32);
        for (si, &(b, t, c, nh)) in SHAPES.iter().enumerate() {
            // std 3: scores of a few units, so the running max changes
            // between tiles and the rescaling is exercised.
            let inp = randn(b * t * 3 * c, 3.0, 100 + si as u64);
            let u = unfused(&inp, b, t, c, nh);
            let want_lse = lse_of(&u.preatt, t);
            for &tiles in &TILES {
                let (out, lse) = fused(&inp, b, t, c, nh, tiles);
                let what = format!("B{b} T{t} C{c} NH{nh} tiles {tiles:?}");
                assert_close(&out, &u.out, 1e-5, 1e-5, &format!("out {what}"));
                assert_close(&lse, &want_lse, 1e-5, 1e-6, &format!("lse {what}"));
                let e = max_errors(&out, &u.out);
                worst = (worst.0.max(e.0), worst.1.max(e.1));
            }
        }
        eprintln!(
            "fused attention forward vs unfused: max abs {:e}, max rel {:e}",
            worst.0, worst.1
        );
    }

    #[test]
    fn forward_is_causal() {
        let (b, t, c, nh) = (2, 9, 12, 3);
        let inp = randn(b * t * 3 * c, 1.0, 110);
        let (out, lse) = fused(&inp, b, t, c, nh, (4, 3));
        let mut inp2 = inp.clone();
        for bi in 0..b {
            for x in &mut inp2[(bi * t + t - 1) * 3 * c..][..3 * c] {
                *x += 1.0;
            }
        }
        let (out2, lse2) = fused(&inp2, b, t, c, nh, (4, 3));
        for bi in 0..b {
            let rows = bi * t * c..(bi * t + t - 1) * c;
            assert_eq!(out[rows.clone()], out2[rows]);
            for h in 0..nh {
                let r = (bi * nh + h) * t;
                assert_eq!(lse[r..r + t - 1], lse2[r..r + t - 1]);
                assert_ne!(lse[r + t - 1], lse2[r + t - 1]);
            }
        }
    }

    #[test]
    fn backward_matches_unfused_on_odd_shapes_and_tiles() {
        let mut worst = (0.0f32, 0.0f32);
        for (si, &(b, t, c, nh)) in SHAPES.iter().enumerate() {
            let inp = randn(b * t * 3 * c, 2.0, 120 + si as u64);
            let dout = randn(b * t * c, 1.0, 130 + si as u64);
            // Nonzero starting gradients: both kernels accumulate.
            let dinp0 = randn(b * t * 3 * c, 0.5, 140 + si as u64);
            let u = unfused(&inp, b, t, c, nh);
            let mut want = dinp0.clone();
            attention_backward(&mut want, &dout, &inp, &u.att, b, t, c, nh);
            assert!(want != dinp0);
            for &tiles in &TILES {
                let (out, lse) = fused(&inp, b, t, c, nh, tiles);
                let mut got = dinp0.clone();
                let mut delta = vec![f32::NAN; b * nh * t];
                let (bq, bk) = tiles;
                flash_attention_backward(
                    &mut got, &mut delta, &dout, &inp, &out, &lse, b, t, c, nh, bq, bk,
                );
                let what = format!("dinp B{b} T{t} C{c} NH{nh} tiles {tiles:?}");
                assert_close(&got, &want, 2e-5, 1e-4, &what);
                let e = max_errors(&got, &want);
                worst = (worst.0.max(e.0), worst.1.max(e.1));
                // D = rowsum(dout ∘ out) = Σ att ∘ datt of the unfused path.
                assert!(delta.iter().all(|d| d.is_finite()));
            }
        }
        eprintln!(
            "fused attention backward vs unfused: max abs {:e}, max rel {:e}",
            worst.0, worst.1
        );
    }

    #[test]
    fn backward_matches_finite_differences() {
        let (b, t, c, nh) = (2, 6, 8, 2);
        let inp = randn(b * t * 3 * c, 1.0, 150);
        let probe = randn(b * t * c, 1.0, 151);
        let tiles = (4, 3);
        let (out, lse) = fused(&inp, b, t, c, nh, tiles);
        let mut dinp = vec![0.0; inp.len()];
        let mut delta = vec![0.0; b * nh * t];
        flash_attention_backward(
            &mut dinp, &mut delta, &probe, &inp, &out, &lse, b, t, c, nh, 4, 3,
        );
        fd_check(
            &inp,
            &dinp,
            |x| {
                let (out, _) = fused(x, b, t, c, nh, tiles);
                out.iter()
                    .zip(&probe)
                    .map(|(&o, &p)| o as f64 * p as f64)
                    .sum()
            },
            "flash attention dinp",
        );
    }

    /// What the fused path keeps is O(B·NH·T): the saved logsumexp and the
    /// backward scratch grow linearly in T where the unfused path's
    /// `preatt`, `att` and CUDA scratch grow as T².
    #[test]
    fn memory_is_linear_in_t() {
        let (b, c, nh) = (2, 12, 3);
        for t in [5, 64, 1024] {
            assert_eq!(saved_len(b, t, nh), b * nh * t);
            assert_eq!(backward_scratch_bytes(b, t, nh), b * nh * t * 4);
            let unfused_saved = 2 * b * nh * t * t;
            assert!(saved_len(b, t, nh) * t <= unfused_saved);
        }
        assert_eq!(saved_len(b, 2048, nh), 2 * saved_len(b, 1024, nh));
        assert_eq!(
            backward_scratch_bytes(b, 2048, nh),
            2 * backward_scratch_bytes(b, 1024, nh)
        );
        // Tiles do not depend on T, B or NH's count beyond hs.
        let hs = c / nh;
        assert_eq!(
            tile_bytes(c, nh, 4, 3),
            (2 * 4 * 3 + 2 * 3 * hs).max(4 * 3 + 4 * hs + 2 * 4) * 4
        );
    }
}

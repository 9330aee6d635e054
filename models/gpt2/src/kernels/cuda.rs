//! GPT-2 kernels on a CUDA device: one launcher per kernel of [`super::cpu`],
//! same names, same argument order, same semantics, for task bodies that run
//! on the CUDA backend.
//!
//! The kernels are the CUDA C sources in `src/kernels/cuda/*.cu` (listed by
//! [`kernel_sources`]), compiled by NVRTC at run time and loaded once per
//! device; the matrix products go through cuBLAS on the task's stream.
//!
//! # Conventions
//!
//! - **Arguments.** Every launcher takes the task's [`TaskCtx`] first, then the
//!   [`View`]s the CPU kernel takes as slices, in the same order, then the same
//!   sizes. Element types: `f32` unless noted, token ids `u32`, norm partials
//!   `f64`. Shapes are written next to each argument (`(B, T, C)`), row-major.
//! - **Checked before launch.** Each view's byte length is checked against the
//!   shape (exactly, or "whole rows, at least N" where the CPU kernel accepts a
//!   longer slice); every dimension handed to a kernel must be at least 1 and
//!   fit its 32-bit `int`; every view must be a declared access of the task in
//!   the mode the kernel uses (inputs: any mode; outputs: `write` or
//!   `read_write`, enforced by [`TaskCtx::device_ptr`]), live on the GPU, and be
//!   aligned for its element type; and a view the kernel writes must not
//!   overlap any other view of the call. A violation is an [`Error`] returned
//!   before anything is queued, never memory corruption. Shape and overlap
//!   errors are [`Error::Device`] with `op` = the launcher's name and a message
//!   naming the argument; a task on the CPU backend gets
//!   [`Error::BackendUnavailable`] (shape checks come first, so they can be
//!   tested without a GPU).
//! - **Asynchronous.** A launcher queues its kernels (and cuBLAS products) on
//!   the task's stream and returns. Device faults surface at the engine's next
//!   synchronisation point, as with any CUDA task.
//! - **Forward kernels overwrite; backward kernels accumulate (`+=`)** into
//!   every gradient, exactly as on the CPU, so the caller zeroes gradients
//!   first.
//! - **Deterministic.** No atomics; every reduction has a fixed order for a
//!   given shape (and, for the gradient norm, a fixed partial count), and
//!   cuBLAS runs with its default FP32 math on the stream's own handle.
//! - **Tokens.** [`encoder_forward`], [`encoder_backward`] and
//!   [`softmax_crossentropy_forward`] index rows with token ids read on the
//!   device, where they cannot be checked without a host sync; they are
//!   `unsafe` with the contract "every id is below the vocabulary size"
//!   (validate on the host with [`super::check_tokens`] before upload).
//!   [`crossentropy_softmax_backward`] only compares ids and is safe.
//!
//! # Differences from the CPU kernels
//!
//! - Reductions run in `f32` trees (layer norm statistics, softmax sums) where
//!   the CPU accumulates in `f64`, and cuBLAS sums products in its own order:
//!   results agree to about 1e-4 relative (the tolerances of
//!   `tests/cuda_kernels.rs`), not bit for bit. Encoder, residual and the
//!   gradient scaling are bit-exact.
//! - [`attention_forward`] leaves the masked (upper) triangle of `preatt` as
//!   the full `q·kᵀ` product wrote it, where the CPU writes 0; `att` is 0 there
//!   on both. Nothing reads that triangle.
//! - Attention needs scratch memory the CPU kernel keeps on its stack:
//!   [`attention_forward_scratch_bytes`] and [`attention_backward_scratch_bytes`].
//! - The loss is fused on the device: [`softmax_crossentropy_forward`] is
//!   `softmax_forward` + `crossentropy_forward` in one kernel; there is no
//!   stand-alone `crossentropy_forward`. [`softmax_forward`] alone exists.
//! - The gradient norm is two kernels into device memory
//!   ([`grad_norm_sq_partial`], [`grad_norm_sq_finalize`], or both through
//!   [`grad_norm_sq`]) instead of a returned `f64`; [`grad_clip_scale`] turns
//!   norms into the clip factor on the device and [`scale_in_place_dev`]
//!   applies it, so clipping needs no host synchronisation.

// llm.c-style kernels take every dimension as its own argument.
#![allow(clippy::too_many_arguments)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use braid::cuda::{
    CudaDevice, CudaError, CudaFunction, Gemm, KernelArgs, KernelCache, LaunchConfig, Transpose,
};
use braid::{CudaTaskCtx, Error, Result, TaskCtx, View};

// ---------------------------------------------------------------------------
// Sources and the per-device kernel table
// ---------------------------------------------------------------------------

const ENCODER: usize = 0;
const LAYERNORM: usize = 1;
const MATMUL: usize = 2;
const ATTENTION: usize = 3;
const GELU: usize = 4;
const RESIDUAL: usize = 5;
const LOSS: usize = 6;
const ADAMW: usize = 7;

/// `(program name, CUDA C source)`, indexed by the constants above.
static PROGRAMS: [(&str, &str); 8] = [
    ("encoder.cu", include_str!("cuda/encoder.cu")),
    ("layernorm.cu", include_str!("cuda/layernorm.cu")),
    ("matmul.cu", include_str!("cuda/matmul.cu")),
    ("attention.cu", include_str!("cuda/attention.cu")),
    ("gelu.cu", include_str!("cuda/gelu.cu")),
    ("residual.cu", include_str!("cuda/residual.cu")),
    ("loss.cu", include_str!("cuda/loss.cu")),
    ("adamw.cu", include_str!("cuda/adamw.cu")),
];

/// Every GPT-2 CUDA program as `(file name, source)`, e.g. for an NVRTC
/// compile check. The launchers compile them through
/// [`KernelCache::global`] on first use, once per device.
pub fn kernel_sources() -> &'static [(&'static str, &'static str)] {
    &PROGRAMS
}

macro_rules! kernels {
    ($($variant:ident => ($program:expr, $name:literal),)*) => {
        /// A kernel of one of the [`PROGRAMS`]; its discriminant indexes
        /// [`KERNELS`] and the per-device function table.
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        enum K {
            $($variant,)*
        }

        impl K {
            /// Every kernel, in discriminant order.
            const ALL: &[K] = &[$(K::$variant,)*];
        }

        /// `(program index, extern "C" name)` of each [`K`], in order.
        const KERNELS: &[(usize, &str)] = &[$(($program, $name),)*];
    };
}

kernels! {
    EncoderForward => (ENCODER, "encoder_forward"),
    EncoderBackwardWpe => (ENCODER, "encoder_backward_wpe"),
    EncoderBackwardWte => (ENCODER, "encoder_backward_wte"),
    LayernormForward => (LAYERNORM, "layernorm_forward"),
    LayernormBackwardInput => (LAYERNORM, "layernorm_backward_input"),
    LayernormBackwardParams => (LAYERNORM, "layernorm_backward_params"),
    BiasBroadcast => (MATMUL, "bias_broadcast"),
    BiasBackward => (MATMUL, "bias_backward"),
    AttentionPermute => (ATTENTION, "attention_permute"),
    AttentionPermuteBackward => (ATTENTION, "attention_permute_backward"),
    AttentionUnpermute => (ATTENTION, "attention_unpermute"),
    AttentionUnpermuteBackward => (ATTENTION, "attention_unpermute_backward"),
    AttentionSoftmaxForward => (ATTENTION, "attention_softmax_forward"),
    AttentionSoftmaxBackward => (ATTENTION, "attention_softmax_backward"),
    GeluForward => (GELU, "gelu_forward"),
    GeluBackward => (GELU, "gelu_backward"),
    ResidualForward => (RESIDUAL, "residual_forward"),
    ResidualBackward => (RESIDUAL, "residual_backward"),
    SoftmaxCrossentropyForward => (LOSS, "softmax_crossentropy_forward"),
    CrossentropySoftmaxBackward => (LOSS, "crossentropy_softmax_backward"),
    LossMean => (LOSS, "loss_mean"),
    AdamwUpdate => (ADAMW, "adamw_update"),
    GradNormSqPartial => (ADAMW, "grad_norm_sq_partial"),
    GradNormSqFinalize => (ADAMW, "grad_norm_sq_finalize"),
    GradClipScale => (ADAMW, "grad_clip_scale"),
    ScaleInplace => (ADAMW, "scale_inplace"),
    ScaleInplaceDev => (ADAMW, "scale_inplace_dev"),
}

/// The loaded functions of one device (one CUDA context), looked up by name
/// once each. Holding a [`CudaFunction`] keeps its module loaded.
struct DeviceKernels {
    device: CudaDevice,
    funcs: Vec<OnceLock<CudaFunction>>,
}

impl DeviceKernels {
    fn get(&self, k: K) -> Result<&CudaFunction, CudaError> {
        let cell = &self.funcs[k as usize];
        if let Some(f) = cell.get() {
            return Ok(f);
        }
        let (program, name) = KERNELS[k as usize];
        let (file, source) = PROGRAMS[program];
        // Compiled once per process (and cached on disk), loaded once per
        // context: the cache hands back the live module while any of its
        // functions is held here.
        let module = KernelCache::global().module(&self.device, source, file)?;
        let f = module.function(name)?;
        // A racing thread may have set it first; either value is the same kernel.
        let _ = cell.set(f);
        Ok(cell.get().expect("set just above"))
    }
}

/// The kernel table of `device`, created on first use. Keyed by the primary
/// context, as [`KernelCache`] keys its modules.
fn device_kernels(device: &CudaDevice) -> Arc<DeviceKernels> {
    static TABLES: OnceLock<Mutex<HashMap<usize, Arc<DeviceKernels>>>> = OnceLock::new();
    let key = device.raw_context() as usize;
    let mut tables = TABLES
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    tables
        .entry(key)
        .or_insert_with(|| {
            Arc::new(DeviceKernels {
                device: device.clone(),
                funcs: KERNELS.iter().map(|_| OnceLock::new()).collect(),
            })
        })
        .clone()
}

/// Compiles (or loads from NVRTC's disk cache) and looks up every GPT-2
/// kernel on `device` now, so a compile error surfaces here rather than in
/// the first task, and no task pays for NVRTC. Optional: launchers load what
/// they need on first use. Use [`braid::Runtime::cuda_device`] for `device`.
pub fn preload(device: &CudaDevice) -> Result<()> {
    let table = device_kernels(device);
    for (&k, &(program, name)) in K::ALL.iter().zip(KERNELS) {
        if let Err(e) = table.get(k) {
            return Err(match Error::from(e) {
                Error::Device {
                    backend, message, ..
                } => Error::Device {
                    backend,
                    op: format!("loading {name} from {}", PROGRAMS[program].0),
                    message,
                },
                other => other,
            });
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Argument checking and binding
// ---------------------------------------------------------------------------

#[derive(Debug, Clone, Copy)]
enum Elem {
    F32,
    U32,
    F64,
}

impl Elem {
    fn size(self) -> usize {
        match self {
            Elem::F32 | Elem::U32 => 4,
            Elem::F64 => 8,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Elem::F32 => "f32",
            Elem::U32 => "u32",
            Elem::F64 => "f64",
        }
    }
}

const R: bool = false;
const W: bool = true;

struct Arg<'v> {
    name: &'static str,
    /// `None`: an absent optional argument (a null pointer).
    view: Option<&'v View>,
    elem: Elem,
    write: bool,
}

/// One launcher call being checked: its views, validated against the shapes
/// as they are added, then bound to device addresses by [`Call::bind`].
struct Call<'v> {
    kernel: &'static str,
    args: Vec<Arg<'v>>,
}

fn device_error(kernel: &'static str, message: String) -> Error {
    Error::Device {
        backend: "cuda",
        op: kernel.to_string(),
        message,
    }
}

impl<'v> Call<'v> {
    fn new(kernel: &'static str) -> Self {
        Call {
            kernel,
            args: Vec::with_capacity(9),
        }
    }

    fn err(&self, message: String) -> Error {
        device_error(self.kernel, message)
    }

    /// A dimension handed to a kernel as `int`: at least 1, below 2³¹.
    fn dim(&self, name: &str, value: usize) -> Result<i32> {
        if value == 0 {
            return Err(self.err(format!("{name} is 0; every dimension must be at least 1")));
        }
        i32::try_from(value).map_err(|_| {
            self.err(format!(
                "{name} = {value} does not fit the kernel's 32-bit int"
            ))
        })
    }

    /// `a · b`, an error on overflow.
    fn mul(&self, a: usize, b: usize) -> Result<usize> {
        a.checked_mul(b)
            .ok_or_else(|| self.err(format!("size {a} × {b} overflows")))
    }

    fn push(&mut self, name: &'static str, view: Option<&'v View>, elem: Elem, write: bool) {
        self.args.push(Arg {
            name,
            view,
            elem,
            write,
        });
    }

    /// A view of exactly `count` elements of shape `shape`.
    fn exact(
        &mut self,
        name: &'static str,
        view: &'v View,
        elem: Elem,
        write: bool,
        shape: &str,
        count: usize,
    ) -> Result<()> {
        let want = self.mul(count, elem.size())?;
        if view.len() != want {
            return Err(self.err(format!(
                "`{name}` ({view:?}) holds {} bytes; expected {shape} = {count} {} = {want} bytes",
                view.len(),
                elem.name()
            )));
        }
        self.push(name, Some(view), elem, write);
        Ok(())
    }

    /// An optional view of exactly `count` elements (absent: a null pointer).
    fn optional(
        &mut self,
        name: &'static str,
        view: Option<&'v View>,
        elem: Elem,
        write: bool,
        shape: &str,
        count: usize,
    ) -> Result<()> {
        match view {
            Some(v) => self.exact(name, v, elem, write, shape, count),
            None => {
                self.push(name, None, elem, write);
                Ok(())
            }
        }
    }

    /// A matrix of whole rows of `row` elements, at least `min_rows` of them;
    /// returns the number of rows.
    fn rows(
        &mut self,
        name: &'static str,
        view: &'v View,
        elem: Elem,
        write: bool,
        shape: &str,
        row: usize,
        min_rows: usize,
    ) -> Result<usize> {
        let row_bytes = self.mul(row, elem.size())?;
        let rows = view.len() / row_bytes.max(1);
        if row_bytes == 0 || view.len() % row_bytes != 0 || rows < min_rows {
            return Err(self.err(format!(
                "`{name}` ({view:?}) holds {} bytes; expected {shape}: whole rows of {row} {} \
                 ({row_bytes} bytes), at least {min_rows} of them",
                view.len(),
                elem.name()
            )));
        }
        self.push(name, Some(view), elem, write);
        Ok(rows)
    }

    /// A flat view of whole elements; returns how many.
    fn flat(
        &mut self,
        name: &'static str,
        view: &'v View,
        elem: Elem,
        write: bool,
    ) -> Result<usize> {
        if view.len() % elem.size() != 0 {
            return Err(self.err(format!(
                "`{name}` ({view:?}) holds {} bytes, not a whole number of {}",
                view.len(),
                elem.name()
            )));
        }
        self.push(name, Some(view), elem, write);
        Ok(view.len() / elem.size())
    }

    /// Resolves every view to its device address through the task's declared
    /// accesses, checks alignment and that no written view overlaps another,
    /// and returns the launcher with the addresses in the order they were
    /// added (0 for an absent optional view).
    fn bind<'c, const N: usize>(self, ctx: &'c TaskCtx<'_>) -> Result<(Launcher<'c>, [u64; N])> {
        assert_eq!(
            self.args.len(),
            N,
            "{}: bound {} of {} arguments",
            self.kernel,
            N,
            self.args.len()
        );
        let cu = ctx
            .device()
            .cuda()
            .ok_or_else(|| Error::BackendUnavailable {
                backend: "cuda",
                reason: format!(
                    "task `{}` runs on the CPU backend; kernels::cuda::{} launches CUDA kernels \
                 (use kernels::cpu there)",
                    ctx.name(),
                    self.kernel
                ),
            })?;
        let mut ptrs = [0u64; N];
        for (p, a) in ptrs.iter_mut().zip(&self.args) {
            let Some(v) = a.view else { continue };
            let ptr = ctx.device_ptr(v, a.write)?;
            if ptr % a.elem.size() as u64 != 0 {
                return Err(self.err(format!(
                    "`{}` ({v:?}) is not aligned for {}",
                    a.name,
                    a.elem.name()
                )));
            }
            *p = ptr;
        }
        // Device addresses are unique across buffers, so address ranges tell
        // overlap across and within buffers alike.
        for (i, a) in self.args.iter().enumerate() {
            for (j, b) in self.args.iter().enumerate().skip(i + 1) {
                let (Some(va), Some(vb)) = (a.view, b.view) else {
                    continue;
                };
                if !(a.write || b.write) || va.is_empty() || vb.is_empty() {
                    continue;
                }
                let (sa, sb) = (ptrs[i], ptrs[j]);
                if sa < sb + vb.len() as u64 && sb < sa + va.len() as u64 {
                    return Err(self.err(format!(
                        "`{}` ({va:?}) and `{}` ({vb:?}) overlap, and the kernel writes one of them",
                        a.name, b.name
                    )));
                }
            }
        }
        Ok((
            Launcher {
                kernel: self.kernel,
                cu,
                table: device_kernels(cu.device()),
            },
            ptrs,
        ))
    }
}

/// Launches on the task's stream, after [`Call::bind`] checked the views.
struct Launcher<'c> {
    kernel: &'static str,
    cu: &'c CudaTaskCtx<'c>,
    table: Arc<DeviceKernels>,
}

impl Launcher<'_> {
    fn err(&self, e: CudaError) -> Error {
        match Error::from(e) {
            Error::Device {
                backend, message, ..
            } => Error::Device {
                backend,
                op: self.kernel.to_string(),
                message,
            },
            other => other,
        }
    }

    /// `blocks` as a grid dimension.
    fn grid(&self, blocks: usize) -> Result<u32> {
        match u32::try_from(blocks.max(1)) {
            Ok(g) if g <= i32::MAX as u32 => Ok(g),
            _ => Err(device_error(
                self.kernel,
                format!("grid of {blocks} blocks is too large"),
            )),
        }
    }

    /// One thread per element: `ceil(n / block)` blocks of `block` threads.
    fn linear(&self, n: usize, block: u32) -> Result<LaunchConfig> {
        Ok(LaunchConfig::grid_block(
            self.grid(n.div_ceil(block as usize))?,
            block,
        ))
    }

    /// One warp per row: blocks of 256 threads (8 rows).
    fn warp_rows(&self, rows: usize) -> Result<LaunchConfig> {
        Ok(LaunchConfig::grid_block(self.grid(rows.div_ceil(8))?, 256))
    }

    /// # Safety
    /// `args` match `k`'s parameter list (count, order, types), and every
    /// pointer in it addresses device memory the kernel may access as it does
    /// under `cfg` (bound by [`Call::bind`] and sized for the shapes passed).
    unsafe fn launch(&self, k: K, cfg: LaunchConfig, args: &KernelArgs) -> Result<()> {
        let f = self.table.get(k).map_err(|e| self.err(e))?;
        // SAFETY: the caller's contract is `CudaFunction::launch`'s; the
        // stream is the task's, of the device the table was loaded on.
        unsafe { f.launch(self.cu.stream(), cfg, args) }.map_err(|e| self.err(e))
    }

    /// # Safety
    /// `a`, `b`, `c` address matrices of the sizes `g` describes.
    unsafe fn gemm(&self, g: &Gemm, a: u64, b: u64, c: u64) -> Result<()> {
        let blas = self.cu.cublas()?;
        // SAFETY: the caller's contract is `sgemm`'s; the handle is bound to
        // the task's stream.
        unsafe { blas.sgemm(g, a, b, c) }.map_err(|e| self.err(e))
    }

    /// # Safety
    /// Each of the `batch` entries `x + i·stride_x` addresses a matrix of the
    /// size `g` describes.
    unsafe fn gemm_batched(
        &self,
        g: &Gemm,
        a: u64,
        stride_a: i64,
        b: u64,
        stride_b: i64,
        c: u64,
        stride_c: i64,
        batch: usize,
    ) -> Result<()> {
        let blas = self.cu.cublas()?;
        // SAFETY: the caller's contract is `sgemm_strided_batched`'s.
        unsafe { blas.sgemm_strided_batched(g, a, stride_a, b, stride_b, c, stride_c, batch) }
            .map_err(|e| self.err(e))
    }
}

// ---------------------------------------------------------------------------
// Encoder
// ---------------------------------------------------------------------------

/// `out[b, t, :] = wte[tokens[b, t], :] + wpe[t, :]`. Bit-exact with the CPU.
///
/// # Safety
/// Every id in `tokens` must be below `V` (the rows of `wte`): the kernel
/// reads `wte` at the ids it finds on the device. Validate ids with
/// [`super::check_tokens`] before uploading them. Everything else is checked.
pub unsafe fn encoder_forward(
    ctx: &TaskCtx<'_>,
    out: &View,    // (B, T, C)
    tokens: &View, // (B, T) u32, each < V
    wte: &View,    // (V, C)
    wpe: &View,    // (maxT, C), maxT >= T
    b: usize,
    t: usize,
    c: usize,
) -> Result<()> {
    let mut call = Call::new("encoder_forward");
    let (bi, ti, ci) = (call.dim("B", b)?, call.dim("T", t)?, call.dim("C", c)?);
    let bt = call.mul(b, t)?;
    let btc = call.mul(bt, c)?;
    call.exact("out", out, Elem::F32, W, "(B, T, C)", btc)?;
    call.exact("tokens", tokens, Elem::U32, R, "(B, T)", bt)?;
    call.rows("wte", wte, Elem::F32, R, "(V, C)", c, 1)?;
    call.rows("wpe", wpe, Elem::F32, R, "(maxT, C)", c, t)?;
    let (l, [out, tokens, wte, wpe]) = call.bind(ctx)?;
    let mut a = KernelArgs::new();
    a.ptr(out)
        .ptr(tokens)
        .ptr(wte)
        .ptr(wpe)
        .i32(bi)
        .i32(ti)
        .i32(ci);
    // SAFETY: encoder_forward(float*, const uint*, const float*, const float*,
    // int B, int T, int C); out and tokens hold B·T·C and B·T elements, wpe at
    // least T rows; wte rows are indexed by ids < V (the caller's contract).
    unsafe { l.launch(K::EncoderForward, l.linear(btc, 256)?, &a) }
}

/// Number of token-residue classes `encoder_backward_wte` splits `dwte` into
/// (`gridDim.y`); any value gives the same result.
const WTE_PARTS: u32 = 32;

/// `dwte[tokens[b, t], :] += dout[b, t, :]; dwpe[t, :] += Σ_b dout[b, t, :]`,
/// summed in `(b, t)` order: bit-exact with the CPU. Only the first `T` rows
/// of `dwpe` are touched.
///
/// # Safety
/// Every id in `tokens` must be below `V` (the rows of `dwte`): the kernel
/// writes `dwte` at the ids it finds on the device. See [`encoder_forward`].
pub unsafe fn encoder_backward(
    ctx: &TaskCtx<'_>,
    dwte: &View,   // (V, C) accumulated
    dwpe: &View,   // (maxT, C), maxT >= T, accumulated
    dout: &View,   // (B, T, C)
    tokens: &View, // (B, T) u32, each < V
    b: usize,
    t: usize,
    c: usize,
) -> Result<()> {
    let mut call = Call::new("encoder_backward");
    let (bi, ti, ci) = (call.dim("B", b)?, call.dim("T", t)?, call.dim("C", c)?);
    let bt = call.mul(b, t)?;
    let bti = call.dim("B·T", bt)?;
    let btc = call.mul(bt, c)?;
    call.rows("dwte", dwte, Elem::F32, W, "(V, C)", c, 1)?;
    call.rows("dwpe", dwpe, Elem::F32, W, "(maxT, C)", c, t)?;
    call.exact("dout", dout, Elem::F32, R, "(B, T, C)", btc)?;
    call.exact("tokens", tokens, Elem::U32, R, "(B, T)", bt)?;
    let (l, [dwte, dwpe, dout, tokens]) = call.bind(ctx)?;
    let mut a = KernelArgs::new();
    a.ptr(dwpe).ptr(dout).i32(bi).i32(ti).i32(ci);
    // SAFETY: encoder_backward_wpe(float* dwpe, const float* dout, int B, int
    // T, int C) touches the first T rows of dwpe and all of dout (checked).
    unsafe { l.launch(K::EncoderBackwardWpe, l.linear(t * c, 256)?, &a)? };
    let mut a = KernelArgs::new();
    a.ptr(dwte).ptr(dout).ptr(tokens).i32(bti).i32(ci);
    let cfg = LaunchConfig {
        grid: (l.grid(c.div_ceil(128))?, WTE_PARTS, 1),
        block: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: encoder_backward_wte(float* dwte, const float* dout, const uint*
    // tokens, int BT, int C); dout and tokens hold B·T rows (checked); dwte
    // rows are indexed by ids < V (the caller's contract).
    unsafe { l.launch(K::EncoderBackwardWte, cfg, &a) }
}

// ---------------------------------------------------------------------------
// Layer norm
// ---------------------------------------------------------------------------

/// Layer norm over channels (biased variance, eps 1e-5); saves `mean` and
/// `rstd` for the backward pass.
pub fn layernorm_forward(
    ctx: &TaskCtx<'_>,
    out: &View,    // (B, T, C)
    mean: &View,   // (B, T)
    rstd: &View,   // (B, T)
    inp: &View,    // (B, T, C)
    weight: &View, // (C)
    bias: &View,   // (C)
    b: usize,
    t: usize,
    c: usize,
) -> Result<()> {
    let mut call = Call::new("layernorm_forward");
    call.dim("B", b)?;
    call.dim("T", t)?;
    let n = call.mul(b, t)?;
    let (ni, ci) = (call.dim("B·T", n)?, call.dim("C", c)?);
    let nc = call.mul(n, c)?;
    call.exact("out", out, Elem::F32, W, "(B, T, C)", nc)?;
    call.exact("mean", mean, Elem::F32, W, "(B, T)", n)?;
    call.exact("rstd", rstd, Elem::F32, W, "(B, T)", n)?;
    call.exact("inp", inp, Elem::F32, R, "(B, T, C)", nc)?;
    call.exact("weight", weight, Elem::F32, R, "(C)", c)?;
    call.exact("bias", bias, Elem::F32, R, "(C)", c)?;
    let (l, [out, mean, rstd, inp, weight, bias]) = call.bind(ctx)?;
    let mut a = KernelArgs::new();
    a.ptr(out)
        .ptr(mean)
        .ptr(rstd)
        .ptr(inp)
        .ptr(weight)
        .ptr(bias)
        .i32(ni)
        .i32(ci);
    // SAFETY: layernorm_forward(float* out, float* mean, float* rstd, const
    // float* inp, const float* weight, const float* bias, int N, int C) with
    // every buffer sized for N = B·T rows of C (checked).
    unsafe { l.launch(K::LayernormForward, l.warp_rows(n)?, &a) }
}

/// Backward of [`layernorm_forward`]: accumulates `dinp`, `dweight`, `dbias`.
pub fn layernorm_backward(
    ctx: &TaskCtx<'_>,
    dinp: &View,    // (B, T, C) accumulated
    dweight: &View, // (C) accumulated
    dbias: &View,   // (C) accumulated
    dout: &View,    // (B, T, C)
    inp: &View,     // (B, T, C)
    weight: &View,  // (C)
    mean: &View,    // (B, T)
    rstd: &View,    // (B, T)
    b: usize,
    t: usize,
    c: usize,
) -> Result<()> {
    let mut call = Call::new("layernorm_backward");
    call.dim("B", b)?;
    call.dim("T", t)?;
    let n = call.mul(b, t)?;
    let (ni, ci) = (call.dim("B·T", n)?, call.dim("C", c)?);
    let nc = call.mul(n, c)?;
    call.exact("dinp", dinp, Elem::F32, W, "(B, T, C)", nc)?;
    call.exact("dweight", dweight, Elem::F32, W, "(C)", c)?;
    call.exact("dbias", dbias, Elem::F32, W, "(C)", c)?;
    call.exact("dout", dout, Elem::F32, R, "(B, T, C)", nc)?;
    call.exact("inp", inp, Elem::F32, R, "(B, T, C)", nc)?;
    call.exact("weight", weight, Elem::F32, R, "(C)", c)?;
    call.exact("mean", mean, Elem::F32, R, "(B, T)", n)?;
    call.exact("rstd", rstd, Elem::F32, R, "(B, T)", n)?;
    let (l, [dinp, dweight, dbias, dout, inp, weight, mean, rstd]) = call.bind(ctx)?;
    let mut a = KernelArgs::new();
    a.ptr(dinp)
        .ptr(dout)
        .ptr(inp)
        .ptr(weight)
        .ptr(mean)
        .ptr(rstd)
        .i32(ni)
        .i32(ci);
    // SAFETY: layernorm_backward_input(float* dinp, const float* dout, const
    // float* inp, const float* weight, const float* mean, const float* rstd,
    // int N, int C), buffers sized for N rows of C (checked).
    unsafe { l.launch(K::LayernormBackwardInput, l.warp_rows(n)?, &a)? };
    let mut a = KernelArgs::new();
    a.ptr(dweight)
        .ptr(dbias)
        .ptr(dout)
        .ptr(inp)
        .ptr(mean)
        .ptr(rstd)
        .i32(ni)
        .i32(ci);
    // SAFETY: layernorm_backward_params(float* dweight, float* dbias, const
    // float* dout, const float* inp, const float* mean, const float* rstd, int
    // N, int C), same sizes.
    unsafe { l.launch(K::LayernormBackwardParams, l.linear(c, 128)?, &a) }
}

// ---------------------------------------------------------------------------
// Matrix products
// ---------------------------------------------------------------------------

/// `out = inp · weightᵀ + bias` (cuBLAS; the bias is broadcast into `out`
/// first and the product added with `beta = 1`, the CPU kernel's order).
pub fn matmul_forward(
    ctx: &TaskCtx<'_>,
    out: &View,          // (B, T, OC)
    inp: &View,          // (B, T, C)
    weight: &View,       // (OC, C)
    bias: Option<&View>, // (OC)
    b: usize,
    t: usize,
    c: usize,
    oc: usize,
) -> Result<()> {
    let mut call = Call::new("matmul_forward");
    call.dim("B", b)?;
    call.dim("T", t)?;
    let n = call.mul(b, t)?;
    let (ni, oci) = (call.dim("B·T", n)?, call.dim("OC", oc)?);
    call.dim("C", c)?;
    call.exact("out", out, Elem::F32, W, "(B, T, OC)", call.mul(n, oc)?)?;
    call.exact("inp", inp, Elem::F32, R, "(B, T, C)", call.mul(n, c)?)?;
    call.exact("weight", weight, Elem::F32, R, "(OC, C)", call.mul(oc, c)?)?;
    call.optional("bias", bias, Elem::F32, R, "(OC)", oc)?;
    let (l, [out, inp, weight, bias]) = call.bind(ctx)?;
    let beta = if bias != 0 {
        let mut a = KernelArgs::new();
        a.ptr(out).ptr(bias).i32(ni).i32(oci);
        // SAFETY: bias_broadcast(float* out, const float* bias, int N, int
        // OC); out is (N, OC), bias (OC) (checked).
        unsafe { l.launch(K::BiasBroadcast, l.linear(n * oc, 256)?, &a)? };
        1.0
    } else {
        0.0
    };
    let g = Gemm::new(Transpose::N, Transpose::T, n, oc, c).scaled(1.0, beta);
    // SAFETY: inp (N, C) · weight (OC, C)ᵀ into out (N, OC), sizes checked.
    unsafe { l.gemm(&g, inp, weight, out) }
}

/// `dinp += dout · weight` (cuBLAS, `beta = 1`).
pub fn matmul_backward_input(
    ctx: &TaskCtx<'_>,
    dinp: &View,   // (B, T, C) accumulated
    dout: &View,   // (B, T, OC)
    weight: &View, // (OC, C)
    b: usize,
    t: usize,
    c: usize,
    oc: usize,
) -> Result<()> {
    let mut call = Call::new("matmul_backward_input");
    call.dim("B", b)?;
    call.dim("T", t)?;
    let n = call.mul(b, t)?;
    call.dim("B·T", n)?;
    call.dim("C", c)?;
    call.dim("OC", oc)?;
    call.exact("dinp", dinp, Elem::F32, W, "(B, T, C)", call.mul(n, c)?)?;
    call.exact("dout", dout, Elem::F32, R, "(B, T, OC)", call.mul(n, oc)?)?;
    call.exact("weight", weight, Elem::F32, R, "(OC, C)", call.mul(oc, c)?)?;
    let (l, [dinp, dout, weight]) = call.bind(ctx)?;
    let g = Gemm::new(Transpose::N, Transpose::N, n, c, oc).scaled(1.0, 1.0);
    // SAFETY: dout (N, OC) · weight (OC, C) added to dinp (N, C), sizes checked.
    unsafe { l.gemm(&g, dout, weight, dinp) }
}

/// `dweight += doutᵀ · inp` (cuBLAS, `beta = 1`) and, with `dbias`,
/// `dbias += Σ_rows dout` (one thread per channel, rows in order).
pub fn matmul_backward_weight(
    ctx: &TaskCtx<'_>,
    dweight: &View,       // (OC, C) accumulated
    dbias: Option<&View>, // (OC) accumulated
    dout: &View,          // (B, T, OC)
    inp: &View,           // (B, T, C)
    b: usize,
    t: usize,
    c: usize,
    oc: usize,
) -> Result<()> {
    let mut call = Call::new("matmul_backward_weight");
    call.dim("B", b)?;
    call.dim("T", t)?;
    let n = call.mul(b, t)?;
    let (ni, oci) = (call.dim("B·T", n)?, call.dim("OC", oc)?);
    call.dim("C", c)?;
    call.exact(
        "dweight",
        dweight,
        Elem::F32,
        W,
        "(OC, C)",
        call.mul(oc, c)?,
    )?;
    call.optional("dbias", dbias, Elem::F32, W, "(OC)", oc)?;
    call.exact("dout", dout, Elem::F32, R, "(B, T, OC)", call.mul(n, oc)?)?;
    call.exact("inp", inp, Elem::F32, R, "(B, T, C)", call.mul(n, c)?)?;
    let (l, [dweight, dbias, dout, inp]) = call.bind(ctx)?;
    let g = Gemm::new(Transpose::T, Transpose::N, oc, c, n).scaled(1.0, 1.0);
    // SAFETY: dout (N, OC)ᵀ · inp (N, C) added to dweight (OC, C), sizes checked.
    unsafe { l.gemm(&g, dout, inp, dweight)? };
    if dbias != 0 {
        let mut a = KernelArgs::new();
        a.ptr(dbias).ptr(dout).i32(ni).i32(oci);
        // SAFETY: bias_backward(float* dbias, const float* dout, int N, int
        // OC); dbias (OC), dout (N, OC) (checked).
        unsafe { l.launch(K::BiasBackward, l.linear(oc, 128)?, &a)? };
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Attention
// ---------------------------------------------------------------------------

/// Bytes of scratch [`attention_forward`] needs: `4·B·T·C` `f32`, used as
/// `q | k | v | vaccum`, each `(B, NH, T, hs)` with `hs = C / NH`: the heads
/// of `inp` permuted for the batched products, and `att · v` before it is
/// permuted back into `out`. Its contents are dead once the call's kernels
/// have run (nothing reads them later), so one scratch view may serve every
/// layer; declare it `write`.
pub fn attention_forward_scratch_bytes(b: usize, t: usize, c: usize, _nh: usize) -> usize {
    4 * b * t * c * 4
}

/// Bytes of scratch [`attention_backward`] needs: `6·B·T·C + 2·B·NH·T·T` `f32`,
/// used as `q | k | v | dvaccum | dk | dv` (each `(B, NH, T, hs)`; `dq` is
/// written over `dvaccum` once that is consumed) then `datt | dpreatt` (each
/// `(B, NH, T, T)`). `q, k, v` are re-permuted from `inp`, so nothing from the
/// forward scratch needs to survive. Dead after the call; declare it `write`.
pub fn attention_backward_scratch_bytes(b: usize, t: usize, c: usize, nh: usize) -> usize {
    (6 * b * t * c + 2 * b * nh * t * t) * 4
}

/// Shape checks shared by the attention launchers; returns `(hs, B·NH)` and
/// the `int` dimensions `[B, T, NH, hs]`.
fn attention_dims(
    call: &Call<'_>,
    b: usize,
    t: usize,
    c: usize,
    nh: usize,
) -> Result<(usize, usize, [i32; 4])> {
    let (bi, ti, nhi) = (call.dim("B", b)?, call.dim("T", t)?, call.dim("NH", nh)?);
    call.dim("C", c)?;
    if c % nh != 0 {
        return Err(call.err(format!("C ({c}) is not divisible by NH ({nh})")));
    }
    let hs = c / nh;
    let bnh = call.mul(b, nh)?;
    call.dim("B·NH", bnh)?;
    call.dim("T·T", call.mul(t, t)?)?;
    call.dim("B·NH·T", call.mul(bnh, t)?)?;
    Ok((hs, bnh, [bi, ti, nhi, call.dim("hs", hs)?]))
}

/// Causal multi-head self-attention, llm.c's cuBLAS formulation: `inp` holds
/// `q | k | v` per position; writes the pre-softmax scores `preatt` (scaled
/// by `1/sqrt(hs)`; see the module docs for its masked triangle), the
/// probabilities `att` and `out`.
///
/// `scratch`: [`attention_forward_scratch_bytes`] bytes.
pub fn attention_forward(
    ctx: &TaskCtx<'_>,
    out: &View,     // (B, T, C)
    preatt: &View,  // (B, NH, T, T)
    att: &View,     // (B, NH, T, T)
    inp: &View,     // (B, T, 3C)
    scratch: &View, // 4 × (B, NH, T, hs): q | k | v | vaccum
    b: usize,
    t: usize,
    c: usize,
    nh: usize,
) -> Result<()> {
    let mut call = Call::new("attention_forward");
    let (hs, bnh, dims) = attention_dims(&call, b, t, c, nh)?;
    let btc = call.mul(call.mul(b, t)?, c)?;
    let tt = call.mul(t, t)?;
    let att_len = call.mul(bnh, tt)?;
    call.exact("out", out, Elem::F32, W, "(B, T, C)", btc)?;
    call.exact("preatt", preatt, Elem::F32, W, "(B, NH, T, T)", att_len)?;
    call.exact("att", att, Elem::F32, W, "(B, NH, T, T)", att_len)?;
    call.exact("inp", inp, Elem::F32, R, "(B, T, 3C)", call.mul(btc, 3)?)?;
    call.exact(
        "scratch",
        scratch,
        Elem::F32,
        W,
        "4 × (B, NH, T, hs)",
        call.mul(btc, 4)?,
    )?;
    let (l, [out, preatt, att, inp, scratch]) = call.bind(ctx)?;
    let head = btc; // elements of one (B, NH, T, hs) tensor
    let (q, k, v, vaccum) = (
        scratch,
        scratch + 4 * head as u64,
        scratch + 8 * head as u64,
        scratch + 12 * head as u64,
    );
    let [bi, ti, nhi, hsi] = dims;
    let (s_tt, s_ths) = (tt as i64, (t * hs) as i64);
    let scale = 1.0 / (hs as f32).sqrt();

    let mut a = KernelArgs::new();
    a.ptr(q)
        .ptr(k)
        .ptr(v)
        .ptr(inp)
        .i32(bi)
        .i32(ti)
        .i32(nhi)
        .i32(hsi);
    // SAFETY: attention_permute(float* q, float* k, float* v, const float*
    // inp, int B, int T, int NH, int hs); q, k, v are disjoint head-sized
    // parts of the scratch, inp is (B, T, 3C) (checked).
    unsafe { l.launch(K::AttentionPermute, l.linear(head, 256)?, &a)? };
    // preatt = scale · q · kᵀ, per head.
    let g = Gemm::new(Transpose::N, Transpose::T, t, t, hs).scaled(scale, 0.0);
    // SAFETY: B·NH entries: q, k (T, hs) at stride T·hs, preatt (T, T) at
    // stride T·T, all inside their checked views.
    unsafe { l.gemm_batched(&g, q, s_ths, k, s_ths, preatt, s_tt, bnh)? };
    let mut a = KernelArgs::new();
    a.ptr(att).ptr(preatt).i32(bnh as i32).i32(ti).f32(1.0);
    // SAFETY: attention_softmax_forward(float* att, const float* preatt, int
    // BNH, int T, float scale); both (B·NH·T, T) (checked).
    unsafe { l.launch(K::AttentionSoftmaxForward, l.warp_rows(bnh * t)?, &a)? };
    // vaccum = att · v, per head.
    let g = Gemm::new(Transpose::N, Transpose::N, t, hs, t);
    // SAFETY: att (T, T) at stride T·T, v and vaccum (T, hs) at stride T·hs.
    unsafe { l.gemm_batched(&g, att, s_tt, v, s_ths, vaccum, s_ths, bnh)? };
    let mut a = KernelArgs::new();
    a.ptr(out).ptr(vaccum).i32(bi).i32(ti).i32(nhi).i32(hsi);
    // SAFETY: attention_unpermute(float* out, const float* vaccum, int B, int
    // T, int NH, int hs); out (B, T, C), vaccum head-sized (checked).
    unsafe { l.launch(K::AttentionUnpermute, l.linear(head, 256)?, &a) }
}

/// Backward of [`attention_forward`]: accumulates the query, key and value
/// gradients into `dinp` (packed like `inp`), from `inp` and the saved `att`
/// (as the CPU kernel; `preatt` is not needed).
///
/// `scratch`: [`attention_backward_scratch_bytes`] bytes.
pub fn attention_backward(
    ctx: &TaskCtx<'_>,
    dinp: &View,    // (B, T, 3C) accumulated
    dout: &View,    // (B, T, C)
    inp: &View,     // (B, T, 3C)
    att: &View,     // (B, NH, T, T)
    scratch: &View, // 6 × (B, NH, T, hs) + 2 × (B, NH, T, T)
    b: usize,
    t: usize,
    c: usize,
    nh: usize,
) -> Result<()> {
    let mut call = Call::new("attention_backward");
    let (hs, bnh, dims) = attention_dims(&call, b, t, c, nh)?;
    let btc = call.mul(call.mul(b, t)?, c)?;
    let tt = call.mul(t, t)?;
    let att_len = call.mul(bnh, tt)?;
    let scratch_len = call
        .mul(btc, 6)?
        .checked_add(call.mul(att_len, 2)?)
        .ok_or_else(|| call.err("scratch size overflows".into()))?;
    call.exact("dinp", dinp, Elem::F32, W, "(B, T, 3C)", call.mul(btc, 3)?)?;
    call.exact("dout", dout, Elem::F32, R, "(B, T, C)", btc)?;
    call.exact("inp", inp, Elem::F32, R, "(B, T, 3C)", call.mul(btc, 3)?)?;
    call.exact("att", att, Elem::F32, R, "(B, NH, T, T)", att_len)?;
    call.exact(
        "scratch",
        scratch,
        Elem::F32,
        W,
        "6 × (B, NH, T, hs) + 2 × (B, NH, T, T)",
        scratch_len,
    )?;
    let (l, [dinp, dout, inp, att, scratch]) = call.bind(ctx)?;
    let head = 4 * btc as u64; // bytes of one (B, NH, T, hs) tensor
    let (q, k, v, dvaccum, dk, dv) = (
        scratch,
        scratch + head,
        scratch + 2 * head,
        scratch + 3 * head,
        scratch + 4 * head,
        scratch + 5 * head,
    );
    let dq = dvaccum; // dvaccum is consumed before dq is written
    let datt = scratch + 6 * head;
    let dpreatt = datt + 4 * att_len as u64;
    let [bi, ti, nhi, hsi] = dims;
    let (s_tt, s_ths) = (tt as i64, (t * hs) as i64);
    let scale = 1.0 / (hs as f32).sqrt();
    let lin = l.linear(btc, 256)?;

    let mut a = KernelArgs::new();
    a.ptr(q)
        .ptr(k)
        .ptr(v)
        .ptr(inp)
        .i32(bi)
        .i32(ti)
        .i32(nhi)
        .i32(hsi);
    // SAFETY: attention_permute as in the forward pass; q, k, v are disjoint
    // head-sized parts of the checked scratch.
    unsafe { l.launch(K::AttentionPermute, lin, &a)? };
    let mut a = KernelArgs::new();
    a.ptr(dvaccum).ptr(dout).i32(bi).i32(ti).i32(nhi).i32(hsi);
    // SAFETY: attention_unpermute_backward(float* dvaccum, const float* dout,
    // int B, int T, int NH, int hs); dout (B, T, C), dvaccum head-sized.
    unsafe { l.launch(K::AttentionUnpermuteBackward, lin, &a)? };
    // datt = dvaccum · vᵀ
    let g = Gemm::new(Transpose::N, Transpose::T, t, t, hs);
    // SAFETY: B·NH entries of (T, hs), (T, hs) -> (T, T) inside the scratch.
    unsafe { l.gemm_batched(&g, dvaccum, s_ths, v, s_ths, datt, s_tt, bnh)? };
    // dv = attᵀ · dvaccum
    let g = Gemm::new(Transpose::T, Transpose::N, t, hs, t);
    // SAFETY: B·NH entries of (T, T)ᵀ, (T, hs) -> (T, hs); att is checked.
    unsafe { l.gemm_batched(&g, att, s_tt, dvaccum, s_ths, dv, s_ths, bnh)? };
    let mut a = KernelArgs::new();
    a.ptr(dpreatt)
        .ptr(datt)
        .ptr(att)
        .i32(bnh as i32)
        .i32(ti)
        .f32(scale);
    // SAFETY: attention_softmax_backward(float* dpreatt, const float* datt,
    // const float* att, int BNH, int T, float scale); all (B·NH·T, T), the
    // first two disjoint parts of the scratch.
    unsafe { l.launch(K::AttentionSoftmaxBackward, l.warp_rows(bnh * t)?, &a)? };
    // dq = dpreatt · k (over dvaccum, which dv above was its last reader)
    let g = Gemm::new(Transpose::N, Transpose::N, t, hs, t);
    // SAFETY: B·NH entries of (T, T), (T, hs) -> (T, hs) inside the scratch.
    unsafe { l.gemm_batched(&g, dpreatt, s_tt, k, s_ths, dq, s_ths, bnh)? };
    // dk = dpreattᵀ · q
    let g = Gemm::new(Transpose::T, Transpose::N, t, hs, t);
    // SAFETY: as above.
    unsafe { l.gemm_batched(&g, dpreatt, s_tt, q, s_ths, dk, s_ths, bnh)? };
    let mut a = KernelArgs::new();
    a.ptr(dinp)
        .ptr(dq)
        .ptr(dk)
        .ptr(dv)
        .i32(bi)
        .i32(ti)
        .i32(nhi)
        .i32(hsi);
    // SAFETY: attention_permute_backward(float* dinp, const float* dq, const
    // float* dk, const float* dv, int B, int T, int NH, int hs); dinp is
    // (B, T, 3C) (checked), dq, dk, dv head-sized parts of the scratch.
    unsafe { l.launch(K::AttentionPermuteBackward, lin, &a) }
}

// ---------------------------------------------------------------------------
// Elementwise: GELU and the residual connection
// ---------------------------------------------------------------------------

/// `out = gelu(inp)` (tanh approximation), elementwise over equal-length views.
pub fn gelu_forward(
    ctx: &TaskCtx<'_>,
    out: &View, // (N)
    inp: &View, // (N)
) -> Result<()> {
    let mut call = Call::new("gelu_forward");
    let n = call.flat("out", out, Elem::F32, W)?;
    call.exact("inp", inp, Elem::F32, R, "(N)", n)?;
    let (l, [out, inp]) = call.bind(ctx)?;
    if n == 0 {
        return Ok(());
    }
    let mut a = KernelArgs::new();
    a.ptr(out).ptr(inp).i64(n as i64);
    // SAFETY: gelu_forward(float* out, const float* inp, long long N); both N.
    unsafe { l.launch(K::GeluForward, l.linear(n, 256)?, &a) }
}

/// `dinp += gelu'(inp) · dout`, elementwise.
pub fn gelu_backward(
    ctx: &TaskCtx<'_>,
    dinp: &View, // (N) accumulated
    inp: &View,  // (N)
    dout: &View, // (N)
) -> Result<()> {
    let mut call = Call::new("gelu_backward");
    let n = call.flat("dinp", dinp, Elem::F32, W)?;
    call.exact("inp", inp, Elem::F32, R, "(N)", n)?;
    call.exact("dout", dout, Elem::F32, R, "(N)", n)?;
    let (l, [dinp, inp, dout]) = call.bind(ctx)?;
    if n == 0 {
        return Ok(());
    }
    let mut a = KernelArgs::new();
    a.ptr(dinp).ptr(inp).ptr(dout).i64(n as i64);
    // SAFETY: gelu_backward(float* dinp, const float* inp, const float* dout,
    // long long N); all N.
    unsafe { l.launch(K::GeluBackward, l.linear(n, 256)?, &a) }
}

/// `out = inp1 + inp2`, elementwise. Bit-exact with the CPU.
pub fn residual_forward(
    ctx: &TaskCtx<'_>,
    out: &View,  // (N)
    inp1: &View, // (N)
    inp2: &View, // (N)
) -> Result<()> {
    let mut call = Call::new("residual_forward");
    let n = call.flat("out", out, Elem::F32, W)?;
    call.exact("inp1", inp1, Elem::F32, R, "(N)", n)?;
    call.exact("inp2", inp2, Elem::F32, R, "(N)", n)?;
    let (l, [out, inp1, inp2]) = call.bind(ctx)?;
    if n == 0 {
        return Ok(());
    }
    let mut a = KernelArgs::new();
    a.ptr(out).ptr(inp1).ptr(inp2).i64(n as i64);
    // SAFETY: residual_forward(float* out, const float* inp1, const float*
    // inp2, long long N); all N.
    unsafe { l.launch(K::ResidualForward, l.linear(n, 256)?, &a) }
}

/// `dinp1 += dout; dinp2 += dout`, elementwise. Bit-exact with the CPU.
pub fn residual_backward(
    ctx: &TaskCtx<'_>,
    dinp1: &View, // (N) accumulated
    dinp2: &View, // (N) accumulated
    dout: &View,  // (N)
) -> Result<()> {
    let mut call = Call::new("residual_backward");
    let n = call.flat("dinp1", dinp1, Elem::F32, W)?;
    call.exact("dinp2", dinp2, Elem::F32, W, "(N)", n)?;
    call.exact("dout", dout, Elem::F32, R, "(N)", n)?;
    let (l, [dinp1, dinp2, dout]) = call.bind(ctx)?;
    if n == 0 {
        return Ok(());
    }
    let mut a = KernelArgs::new();
    a.ptr(dinp1).ptr(dinp2).ptr(dout).i64(n as i64);
    // SAFETY: residual_backward(float* dinp1, float* dinp2, const float* dout,
    // long long N); all N, dinp1 and dinp2 disjoint (checked).
    unsafe { l.launch(K::ResidualBackward, l.linear(n, 256)?, &a) }
}

// ---------------------------------------------------------------------------
// Softmax and cross-entropy
// ---------------------------------------------------------------------------

/// Threads per row of the softmax kernel (one block per row).
const SOFTMAX_BLOCK: u32 = 1024;

/// `probs = softmax(logits)` over the last dimension (row max subtracted).
pub fn softmax_forward(
    ctx: &TaskCtx<'_>,
    probs: &View,  // (B, T, V)
    logits: &View, // (B, T, V)
    b: usize,
    t: usize,
    v: usize,
) -> Result<()> {
    let mut call = Call::new("softmax_forward");
    call.dim("B", b)?;
    call.dim("T", t)?;
    let n = call.mul(b, t)?;
    let (ni, vi) = (call.dim("B·T", n)?, call.dim("V", v)?);
    let nv = call.mul(n, v)?;
    call.exact("probs", probs, Elem::F32, W, "(B, T, V)", nv)?;
    call.exact("logits", logits, Elem::F32, R, "(B, T, V)", nv)?;
    let (l, [probs, logits]) = call.bind(ctx)?;
    let mut a = KernelArgs::new();
    a.ptr(probs).ptr(0).ptr(logits).ptr(0).i32(ni).i32(vi);
    // SAFETY: softmax_crossentropy_forward(float* probs, float* losses, const
    // float* logits, const uint* targets, int N, int V) with null losses and
    // targets (the kernel then skips the loss); probs, logits (N, V) (checked).
    unsafe {
        l.launch(
            K::SoftmaxCrossentropyForward,
            LaunchConfig::grid_block(l.grid(n)?, SOFTMAX_BLOCK),
            &a,
        )
    }
}

/// `probs = softmax(logits)` and `losses[bt] = -ln probs[bt, targets[bt]]`,
/// in one kernel: the CPU's `softmax_forward` then `crossentropy_forward`.
///
/// # Safety
/// Every id in `targets` must be below `V`: the kernel reads `probs` at the
/// ids it finds on the device. Validate with [`super::check_tokens`] before
/// uploading them.
pub unsafe fn softmax_crossentropy_forward(
    ctx: &TaskCtx<'_>,
    probs: &View,   // (B, T, V)
    losses: &View,  // (B, T)
    logits: &View,  // (B, T, V)
    targets: &View, // (B, T) u32, each < V
    b: usize,
    t: usize,
    v: usize,
) -> Result<()> {
    let mut call = Call::new("softmax_crossentropy_forward");
    call.dim("B", b)?;
    call.dim("T", t)?;
    let n = call.mul(b, t)?;
    let (ni, vi) = (call.dim("B·T", n)?, call.dim("V", v)?);
    let nv = call.mul(n, v)?;
    call.exact("probs", probs, Elem::F32, W, "(B, T, V)", nv)?;
    call.exact("losses", losses, Elem::F32, W, "(B, T)", n)?;
    call.exact("logits", logits, Elem::F32, R, "(B, T, V)", nv)?;
    call.exact("targets", targets, Elem::U32, R, "(B, T)", n)?;
    let (l, [probs, losses, logits, targets]) = call.bind(ctx)?;
    let mut a = KernelArgs::new();
    a.ptr(probs)
        .ptr(losses)
        .ptr(logits)
        .ptr(targets)
        .i32(ni)
        .i32(vi);
    // SAFETY: softmax_crossentropy_forward(float* probs, float* losses, const
    // float* logits, const uint* targets, int N, int V), buffers checked; the
    // row of probs is indexed by targets < V (the caller's contract).
    unsafe {
        l.launch(
            K::SoftmaxCrossentropyForward,
            LaunchConfig::grid_block(l.grid(n)?, SOFTMAX_BLOCK),
            &a,
        )
    }
}

/// `loss[0] = mean(losses)`, accumulated in `f64` (the CPU's `mean_loss`,
/// written to the device).
pub fn mean_loss(
    ctx: &TaskCtx<'_>,
    loss: &View,   // (1)
    losses: &View, // (N)
) -> Result<()> {
    let mut call = Call::new("mean_loss");
    call.exact("loss", loss, Elem::F32, W, "(1)", 1)?;
    let n = call.flat("losses", losses, Elem::F32, R)?;
    let ni = call.dim("N", n)?;
    let (l, [loss, losses]) = call.bind(ctx)?;
    let mut a = KernelArgs::new();
    a.ptr(loss).ptr(losses).i32(ni);
    // SAFETY: loss_mean(float* out, const float* losses, int N); out (1),
    // losses (N) (checked).
    unsafe { l.launch(K::LossMean, LaunchConfig::grid_block(1, 1024), &a) }
}

/// `dlogits[bt, i] += (probs[bt, i] - [i == targets[bt]]) · dloss / (B·T)`.
/// Safe for any target id: ids are only compared, never used as addresses.
pub fn crossentropy_softmax_backward(
    ctx: &TaskCtx<'_>,
    dlogits: &View, // (B, T, V) accumulated
    probs: &View,   // (B, T, V)
    targets: &View, // (B, T) u32
    dloss: f32,
    b: usize,
    t: usize,
    v: usize,
) -> Result<()> {
    let mut call = Call::new("crossentropy_softmax_backward");
    call.dim("B", b)?;
    call.dim("T", t)?;
    let n = call.mul(b, t)?;
    let (ni, vi) = (call.dim("B·T", n)?, call.dim("V", v)?);
    let nv = call.mul(n, v)?;
    call.exact("dlogits", dlogits, Elem::F32, W, "(B, T, V)", nv)?;
    call.exact("probs", probs, Elem::F32, R, "(B, T, V)", nv)?;
    call.exact("targets", targets, Elem::U32, R, "(B, T)", n)?;
    let (l, [dlogits, probs, targets]) = call.bind(ctx)?;
    // The CPU kernel's scalar, computed the same way.
    let d = dloss / n as f32;
    let mut a = KernelArgs::new();
    a.ptr(dlogits)
        .ptr(probs)
        .ptr(targets)
        .f32(d)
        .i32(ni)
        .i32(vi);
    // SAFETY: crossentropy_softmax_backward(float* dlogits, const float*
    // probs, const uint* targets, float d, int N, int V); buffers checked;
    // targets are compared with column indices only.
    unsafe { l.launch(K::CrossentropySoftmaxBackward, l.linear(nv, 256)?, &a) }
}

// ---------------------------------------------------------------------------
// Optimizer: AdamW, gradient norm, clipping
// ---------------------------------------------------------------------------

/// One AdamW step (step number `step`, from 1), `torch.optim.AdamW`
/// semantics as [`super::cpu::adamw_update`]; the bias corrections are
/// computed on the host in `f64` exactly as there. With `grad_scale`, each
/// gradient is multiplied by `grad_scale[0]` (e.g. the clip factor from
/// [`grad_clip_scale`]) as it is read; `grads` itself is not modified.
pub fn adamw_update(
    ctx: &TaskCtx<'_>,
    params: &View,             // (N)
    grads: &View,              // (N)
    m: &View,                  // (N) first moment, zero before step 1
    v: &View,                  // (N) second moment, zero before step 1
    grad_scale: Option<&View>, // (1)
    step: u64,
    lr: f32,
    beta1: f32,
    beta2: f32,
    eps: f32,
    weight_decay: f32,
) -> Result<()> {
    let mut call = Call::new("adamw_update");
    if step == 0 {
        return Err(call.err("steps are numbered from 1".into()));
    }
    let n = call.flat("params", params, Elem::F32, W)?;
    call.exact("grads", grads, Elem::F32, R, "(N)", n)?;
    call.exact("m", m, Elem::F32, W, "(N)", n)?;
    call.exact("v", v, Elem::F32, W, "(N)", n)?;
    call.optional("grad_scale", grad_scale, Elem::F32, R, "(1)", 1)?;
    let (l, [params, grads, m, v, grad_scale]) = call.bind(ctx)?;
    if n == 0 {
        return Ok(());
    }
    let step = i32::try_from(step).unwrap_or(i32::MAX);
    let bias_correction1 = 1.0 - (beta1 as f64).powi(step);
    let bias_correction2_sqrt = (1.0 - (beta2 as f64).powi(step)).sqrt();
    let step_size = (lr as f64 / bias_correction1) as f32;
    let decay = 1.0 - lr * weight_decay;
    let mut a = KernelArgs::new();
    a.ptr(params)
        .ptr(grads)
        .ptr(m)
        .ptr(v)
        .ptr(grad_scale)
        .i64(n as i64);
    a.f32(step_size)
        .f32(bias_correction2_sqrt as f32)
        .f32(beta1)
        .f32(beta2)
        .f32(eps)
        .f32(decay);
    // SAFETY: adamw_update(float* params, const float* grads, float* m, float*
    // v, const float* grad_scale, long long N, float step_size, float
    // bc2_sqrt, float beta1, float beta2, float eps, float decay); the four
    // arrays hold N, grad_scale 1 or null (checked).
    unsafe { l.launch(K::AdamwUpdate, l.linear(n, 256)?, &a) }
}

/// A good number of gradient-norm partials ([`grad_norm_sq_partial`]'s grid):
/// enough blocks of 512 threads to fill a large GPU. Keep the count fixed from
/// step to step: the norm's summation order depends on it.
pub const GRAD_NORM_PARTIALS: usize = 512;

/// Stage 1 of the squared L2 norm: `partials[p]` = the sum of `g²` (in `f64`)
/// over the elements block `p` visits, for `P = partials.len()` blocks.
pub fn grad_norm_sq_partial(
    ctx: &TaskCtx<'_>,
    partials: &View, // (P) f64
    grads: &View,    // (N)
) -> Result<()> {
    let mut call = Call::new("grad_norm_sq_partial");
    let p = call.flat("partials", partials, Elem::F64, W)?;
    call.dim("P", p)?;
    let n = call.flat("grads", grads, Elem::F32, R)?;
    let (l, [partials, grads]) = call.bind(ctx)?;
    let mut a = KernelArgs::new();
    a.ptr(partials).ptr(grads).i64(n as i64);
    // SAFETY: grad_norm_sq_partial(double* partials, const float* grads, long
    // long N) writes partials[blockIdx.x] for P blocks; grads holds N.
    unsafe {
        l.launch(
            K::GradNormSqPartial,
            LaunchConfig::grid_block(l.grid(p)?, 512),
            &a,
        )
    }
}

/// Stage 2: `out[0] = Σ partials` (fixed order).
pub fn grad_norm_sq_finalize(
    ctx: &TaskCtx<'_>,
    out: &View,      // (1) f64
    partials: &View, // (P) f64
) -> Result<()> {
    let mut call = Call::new("grad_norm_sq_finalize");
    call.exact("out", out, Elem::F64, W, "(1)", 1)?;
    let p = call.flat("partials", partials, Elem::F64, R)?;
    let pi = call.dim("P", p)?;
    let (l, [out, partials]) = call.bind(ctx)?;
    let mut a = KernelArgs::new();
    a.ptr(out).ptr(partials).i32(pi);
    // SAFETY: grad_norm_sq_finalize(double* out, const double* partials, int
    // P); out (1), partials (P) (checked).
    unsafe { l.launch(K::GradNormSqFinalize, LaunchConfig::grid_block(1, 1024), &a) }
}

/// `out[0] = Σ grads²` in `f64`: [`grad_norm_sq_partial`] into `partials`
/// (scratch, e.g. [`GRAD_NORM_PARTIALS`] long) then [`grad_norm_sq_finalize`].
/// The device counterpart of the CPU's `grad_norm_sq`.
pub fn grad_norm_sq(
    ctx: &TaskCtx<'_>,
    out: &View,      // (1) f64
    partials: &View, // (P) f64 scratch
    grads: &View,    // (N)
) -> Result<()> {
    grad_norm_sq_partial(ctx, partials, grads)?;
    grad_norm_sq_finalize(ctx, out, partials)
}

/// `scale[0] = min(1, max_norm / (sqrt(Σ_k norm_sq[k]) + 1e-6))`, 1 when the
/// norm is not finite: the CPU's `clip_scale` of the global norm, whose
/// squared parts (per bucket or per rank) are summed in order on the device.
pub fn grad_clip_scale(
    ctx: &TaskCtx<'_>,
    scale: &View,   // (1)
    norm_sq: &View, // (K) f64
    max_norm: f32,
) -> Result<()> {
    let mut call = Call::new("grad_clip_scale");
    call.exact("scale", scale, Elem::F32, W, "(1)", 1)?;
    let k = call.flat("norm_sq", norm_sq, Elem::F64, R)?;
    let ki = call.dim("K", k)?;
    let (l, [scale, norm_sq]) = call.bind(ctx)?;
    let mut a = KernelArgs::new();
    a.ptr(scale).ptr(norm_sq).i32(ki).f32(max_norm);
    // SAFETY: grad_clip_scale(float* scale, const double* norm_sq, int K,
    // float max_norm); scale (1), norm_sq (K) (checked).
    unsafe { l.launch(K::GradClipScale, LaunchConfig::grid_block(1, 1), &a) }
}

/// `x *= scale` elementwise, with a host scalar; nothing is launched when
/// `scale == 1` (as on the CPU). Bit-exact with the CPU.
pub fn scale_in_place(
    ctx: &TaskCtx<'_>,
    x: &View, // (N)
    scale: f32,
) -> Result<()> {
    let mut call = Call::new("scale_in_place");
    let n = call.flat("x", x, Elem::F32, W)?;
    let (l, [x]) = call.bind(ctx)?;
    if n == 0 || scale == 1.0 {
        return Ok(());
    }
    let mut a = KernelArgs::new();
    a.ptr(x).i64(n as i64).f32(scale);
    // SAFETY: scale_inplace(float* x, long long N, float s); x holds N.
    unsafe { l.launch(K::ScaleInplace, l.linear(n, 256)?, &a) }
}

/// `x *= scale[0]` elementwise, with the factor read on the device (e.g.
/// from [`grad_clip_scale`]): clipping without a host synchronisation.
pub fn scale_in_place_dev(
    ctx: &TaskCtx<'_>,
    x: &View,     // (N)
    scale: &View, // (1)
) -> Result<()> {
    let mut call = Call::new("scale_in_place_dev");
    let n = call.flat("x", x, Elem::F32, W)?;
    call.exact("scale", scale, Elem::F32, R, "(1)", 1)?;
    let (l, [x, scale]) = call.bind(ctx)?;
    if n == 0 {
        return Ok(());
    }
    let mut a = KernelArgs::new();
    a.ptr(x).i64(n as i64).ptr(scale);
    // SAFETY: scale_inplace_dev(float* x, long long N, const float* s); x
    // holds N, s one float, disjoint (checked).
    unsafe { l.launch(K::ScaleInplaceDev, l.linear(n, 256)?, &a) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every kernel the launchers use is an `extern "C" __global__` of the
    /// program the table names, so a lookup by name cannot miss.
    #[test]
    fn every_kernel_is_declared_in_its_program() {
        assert_eq!(KERNELS.len(), K::ScaleInplaceDev as usize + 1);
        assert_eq!(K::ALL.len(), KERNELS.len());
        assert!(K::ALL.iter().enumerate().all(|(i, &k)| k as usize == i));
        for &(program, name) in KERNELS {
            let (file, source) = PROGRAMS[program];
            let decl = format!("extern \"C\" __global__ void {name}(");
            assert!(source.contains(&decl), "{file} does not declare `{name}`");
        }
        let names: Vec<&str> = kernel_sources().iter().map(|(n, _)| *n).collect();
        assert_eq!(names.len(), 8);
        assert!(names.iter().all(|n| n.ends_with(".cu")));
    }

    #[test]
    fn scratch_sizes() {
        let (b, t, c, nh) = (2, 5, 12, 3);
        assert_eq!(
            attention_forward_scratch_bytes(b, t, c, nh),
            4 * b * t * c * 4
        );
        assert_eq!(
            attention_backward_scratch_bytes(b, t, c, nh),
            (6 * b * t * c + 2 * b * nh * t * t) * 4
        );
    }
}

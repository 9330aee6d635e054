//! What every CUDA launcher of the kernel families shares: the per-device
//! cache of compiled programs, the shape checks, and launching on the task's
//! stream.
//!
//! # Programs and kernels
//!
//! Each family owns one `.cu` program, declared beside its launchers as a
//! [`Program`] (file name, source, the `extern "C"` kernels it defines) with
//! one [`Kernel`] per entry point. A program is compiled by NVRTC through
//! [`KernelCache::global`] on first use (once per process, cached on disk)
//! and loaded once per device; each kernel is looked up by name once per
//! device and kept, so a launch costs one uncontended lock and an array
//! index. [`super::preload`] does all of it up front.
//!
//! # What a launcher checks
//!
//! A launcher gets typed device slices from the task's tokens, so the engine
//! has already checked, at submission, that every slice is a declared access
//! in the right mode, aligned for its element type, and that no written slice
//! overlaps another of the task. What is left is the shape: each launcher
//! checks every slice's length against the sizes it is given ([`Check`]),
//! and that every dimension handed to a kernel is at least 1 and fits its
//! 32-bit `int`, before it queues anything. A violation is
//! [`Error::Device`] with `op` = the launcher's kernel name and a message
//! naming the argument, never an out-of-bounds access.

use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use braid::cuda::{
    CompileOptions, CudaDevice, CudaError, CudaFunction, Epilogue, Gemm, Header, KernelArgs,
    KernelCache, LaunchConfig,
};
use braid::{CudaTaskCtx, DevSlice, DevSliceMut, Error, Result};

use super::storage::{Dtype, Storage};

/// The headers a program may `#include "…"`, given to NVRTC with every
/// program (it reads no files; tools/nvrtc-check passes the same `.cuh`
/// files): this directory's, and the engine's shared ones
/// ([`braid::cuda::engine_kernels::HEADERS`]: `row_links.cuh`, the chains
/// of repeated ids that `encoder.cu`'s token gradient walks; `mma.cuh`, the
/// tensor-core instructions of `flash_attention_tc.cu`).
pub(crate) const HEADERS: &[Header<'static>] = &[
    ("bf16.cuh", include_str!("bf16.cuh")),
    braid::cuda::engine_kernels::ROW_LINKS_CUH,
    braid::cuda::engine_kernels::MMA_CUH,
];

/// One CUDA C program (a `.cu` file of a kernel family) and its kernels.
pub(crate) struct Program {
    /// File name, e.g. `layernorm.cu` (NVRTC's program name).
    pub(crate) file: &'static str,
    /// The CUDA C source.
    pub(crate) source: &'static str,
    /// The `extern "C" __global__` functions the launchers use, in [`Kernel`]
    /// index order.
    pub(crate) kernels: &'static [&'static str],
    /// The oldest compute capability the program compiles for, `(major,
    /// minor)`: `(0, 0)` for any; `(8, 0)` for bf16 tensor-core MMA.
    pub(crate) min_arch: (u32, u32),
    /// The program loaded on each device it ran on.
    loaded: Mutex<Vec<Arc<Loaded>>>,
}

impl std::fmt::Debug for Program {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Program")
            .field("file", &self.file)
            .field("kernels", &self.kernels)
            .finish()
    }
}

/// A program's functions on one device (one CUDA context), each looked up
/// once. Holding a [`CudaFunction`] keeps its module loaded.
struct Loaded {
    /// The primary context, as [`KernelCache`] keys its modules.
    key: usize,
    device: CudaDevice,
    funcs: Box<[OnceLock<CudaFunction>]>,
}

impl Program {
    pub(crate) const fn new(
        file: &'static str,
        source: &'static str,
        kernels: &'static [&'static str],
    ) -> Program {
        Program::for_arch(file, source, kernels, (0, 0))
    }

    /// A program that needs compute capability `min_arch` or newer: its
    /// launchers check [`supports`](Self::supports) and take another path
    /// on older devices, and [`super::preload`] skips it there.
    pub(crate) const fn for_arch(
        file: &'static str,
        source: &'static str,
        kernels: &'static [&'static str],
        min_arch: (u32, u32),
    ) -> Program {
        Program {
            file,
            source,
            kernels,
            min_arch,
            loaded: Mutex::new(Vec::new()),
        }
    }

    /// Whether `device` is new enough for the program.
    pub(crate) fn supports(&self, device: &CudaDevice) -> bool {
        device.compute_capability() >= self.min_arch
    }

    /// The program's table on `device`, created on first use.
    fn on(&self, device: &CudaDevice) -> Arc<Loaded> {
        let key = device.raw_context() as usize;
        let mut loaded = self.loaded.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(l) = loaded.iter().find(|l| l.key == key) {
            return l.clone();
        }
        let l = Arc::new(Loaded {
            key,
            device: device.clone(),
            funcs: self.kernels.iter().map(|_| OnceLock::new()).collect(),
        });
        loaded.push(l.clone());
        l
    }

    /// Compiles (or loads from the cache) and looks up every kernel of the
    /// program on `device`.
    pub(crate) fn preload(&self, device: &CudaDevice) -> Result<()> {
        let table = self.on(device);
        for (index, name) in self.kernels.iter().enumerate() {
            if let Err(e) = table.get(self, index) {
                return Err(match Error::from(e) {
                    Error::Device {
                        backend, message, ..
                    } => Error::Device {
                        backend,
                        op: format!("loading {name} from {}", self.file),
                        message,
                    },
                    other => other,
                });
            }
        }
        Ok(())
    }
}

impl Loaded {
    fn get(
        &self,
        program: &Program,
        index: usize,
    ) -> std::result::Result<&CudaFunction, CudaError> {
        let cell = &self.funcs[index];
        if let Some(f) = cell.get() {
            return Ok(f);
        }
        // Compiled once per process (and cached on disk), loaded once per
        // context: the cache hands back the live module while any of its
        // functions is held here.
        let mut opts = CompileOptions::for_device(&self.device);
        opts.extra = extra_nvrtc_options().to_vec();
        let module = KernelCache::global().module_with_headers(
            &self.device,
            program.source,
            HEADERS,
            program.file,
            &opts,
        )?;
        let f = module.function(program.kernels[index])?;
        // A racing thread may have set it first; either value is the same kernel.
        let _ = cell.set(f);
        Ok(cell.get().expect("set just above"))
    }
}

/// The environment variable of [`extra_nvrtc_options`].
pub(crate) const NVRTC_OPTIONS_ENV: &str = "BRAID_NVRTC_OPTIONS";

/// Extra NVRTC options for every GPT-2 kernel, from `BRAID_NVRTC_OPTIONS`
/// (split at whitespace; read once), for tuning experiments: e.g.
/// `-DTC_MIN_BLOCKS_DKV=3` (`flash_attention_tc.cu`). They are part of the
/// kernel cache's key, so a run with other options compiles anew.
pub(crate) fn extra_nvrtc_options() -> &'static [String] {
    static OPTS: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
    OPTS.get_or_init(|| {
        std::env::var(NVRTC_OPTIONS_ENV)
            .map(|v| v.split_whitespace().map(str::to_string).collect())
            .unwrap_or_default()
    })
}

/// One kernel of a [`Program`]: `program.kernels[index]`.
#[derive(Debug)]
pub(crate) struct Kernel {
    program: &'static Program,
    index: usize,
}

impl Kernel {
    pub(crate) const fn new(program: &'static Program, index: usize) -> Kernel {
        Kernel { program, index }
    }
}

/// The kernel for storage type `S`: `f32` for `f32`, `bf16` for
/// [`Bf16`](super::storage::Bf16) (a family's `*_bf16` entry point).
pub(crate) fn by_dtype<S: Storage>(f32: &'static Kernel, bf16: &'static Kernel) -> &'static Kernel {
    match S::DTYPE {
        Dtype::F32 => f32,
        Dtype::Bf16 => bf16,
    }
}

/// The error of launcher `kernel`.
pub(crate) fn device_error(kernel: &'static str, message: String) -> Error {
    Error::Device {
        backend: "cuda",
        op: kernel.to_string(),
        message,
    }
}

/// A device slice as the shape checks see it: its length and element type.
pub(crate) trait Elems {
    /// Number of elements.
    fn elems(&self) -> usize;
    /// The element type's name.
    fn elem_name(&self) -> &'static str;
}

impl<T> Elems for DevSlice<'_, T> {
    fn elems(&self) -> usize {
        self.len()
    }
    fn elem_name(&self) -> &'static str {
        short_type_name::<T>()
    }
}

impl<T> Elems for DevSliceMut<'_, T> {
    fn elems(&self) -> usize {
        self.len()
    }
    fn elem_name(&self) -> &'static str {
        short_type_name::<T>()
    }
}

fn short_type_name<T>() -> &'static str {
    let n = std::any::type_name::<T>();
    n.rsplit("::").next().unwrap_or(n)
}

/// The shape checks of one launcher call, named after its kernel.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Check {
    kernel: &'static str,
}

impl Check {
    pub(crate) fn new(kernel: &'static str) -> Check {
        Check { kernel }
    }

    pub(crate) fn err(&self, message: String) -> Error {
        device_error(self.kernel, message)
    }

    /// A dimension handed to a kernel as `int`: at least 1, below 2³¹.
    pub(crate) fn dim(&self, name: &str, value: usize) -> Result<i32> {
        if value == 0 {
            return Err(self.err(format!("{name} is 0; every dimension must be at least 1")));
        }
        i32::try_from(value).map_err(|_| {
            self.err(format!(
                "{name} = {value} does not fit the kernel's 32-bit int"
            ))
        })
    }

    /// A row stride handed to a kernel as `int`: a [`dim`](Self::dim), and
    /// at least the used row width `width` (named `width_name`).
    pub(crate) fn stride(
        &self,
        name: &str,
        stride: usize,
        width_name: &str,
        width: usize,
    ) -> Result<i32> {
        let s = self.dim(name, stride)?;
        if stride < width {
            return Err(self.err(format!(
                "row stride {name} ({stride}) is below {width_name} ({width})"
            )));
        }
        Ok(s)
    }

    /// `a · b`, an error on overflow.
    pub(crate) fn mul(&self, a: usize, b: usize) -> Result<usize> {
        a.checked_mul(b)
            .ok_or_else(|| self.err(format!("size {a} × {b} overflows")))
    }

    /// `s` holds exactly `count` elements of shape `shape`.
    pub(crate) fn exact(
        &self,
        name: &str,
        s: &impl Elems,
        shape: &str,
        count: usize,
    ) -> Result<()> {
        if s.elems() != count {
            return Err(self.err(format!(
                "`{name}` holds {} {}; expected {shape} = {count}",
                s.elems(),
                s.elem_name()
            )));
        }
        Ok(())
    }

    /// `s` is a matrix of whole rows of `row` elements, at least `min_rows`
    /// of them; returns the number of rows.
    pub(crate) fn rows(
        &self,
        name: &str,
        s: &impl Elems,
        shape: &str,
        row: usize,
        min_rows: usize,
    ) -> Result<usize> {
        let rows = s.elems() / row.max(1);
        if row == 0 || s.elems() % row != 0 || rows < min_rows {
            return Err(self.err(format!(
                "`{name}` holds {} {}; expected {shape}: whole rows of {row}, at least \
                 {min_rows} of them",
                s.elems(),
                s.elem_name()
            )));
        }
        Ok(rows)
    }
}

/// Launches on the task's stream, after the launcher checked its slices.
pub(crate) struct Launcher<'c> {
    kernel: &'static str,
    cu: &'c CudaTaskCtx<'c>,
}

impl<'c> Launcher<'c> {
    pub(crate) fn new(check: Check, cu: &'c CudaTaskCtx<'c>) -> Self {
        Launcher {
            kernel: check.kernel,
            cu,
        }
    }

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
    pub(crate) fn grid(&self, blocks: usize) -> Result<u32> {
        match u32::try_from(blocks.max(1)) {
            Ok(g) if g <= i32::MAX as u32 => Ok(g),
            _ => Err(device_error(
                self.kernel,
                format!("grid of {blocks} blocks is too large"),
            )),
        }
    }

    /// One thread per element: `ceil(n / block)` blocks of `block` threads.
    pub(crate) fn linear(&self, n: usize, block: u32) -> Result<LaunchConfig> {
        Ok(LaunchConfig::grid_block(
            self.grid(n.div_ceil(block as usize))?,
            block,
        ))
    }

    /// One warp per row: blocks of 256 threads (8 rows).
    pub(crate) fn warp_rows(&self, rows: usize) -> Result<LaunchConfig> {
        Ok(LaunchConfig::grid_block(self.grid(rows.div_ceil(8))?, 256))
    }

    /// # Safety
    /// `args` match `k`'s parameter list (count, order, types), and every
    /// pointer in it addresses device memory the kernel may access as it does
    /// under `cfg` (slices of the task's tokens, checked against the shapes
    /// passed).
    pub(crate) unsafe fn launch(
        &self,
        k: &'static Kernel,
        cfg: LaunchConfig,
        args: &KernelArgs,
    ) -> Result<()> {
        let table = k.program.on(self.cu.device());
        let f = table.get(k.program, k.index).map_err(|e| self.err(e))?;
        // SAFETY: the caller's contract is `CudaFunction::launch`'s; the
        // stream is the task's, of the device the table was loaded on.
        unsafe { f.launch(self.cu.stream(), cfg, args) }.map_err(|e| self.err(e))
    }

    /// A cuBLAS product on matrices stored as `S`: `sgemm` for `f32`,
    /// `gemm_bf16` (bf16 operands, FP32 accumulation, one rounding; never yet
    /// run on a GPU) for bf16.
    ///
    /// # Safety
    /// `a`, `b`, `c` address matrices of `S` of the sizes `g` describes.
    pub(crate) unsafe fn gemm_as<S: Storage>(
        &self,
        g: &Gemm,
        a: u64,
        b: u64,
        c: u64,
    ) -> Result<()> {
        let blas = self.cu.cublas()?;
        let r = match S::DTYPE {
            // SAFETY: the caller's contract is `sgemm`'s, on f32 matrices;
            // the handle is bound to the task's stream.
            Dtype::F32 => unsafe { blas.sgemm(g, a, b, c) },
            // SAFETY: the caller's contract is `gemm_bf16`'s, on bf16
            // matrices; the handle is bound to the task's stream.
            Dtype::Bf16 => unsafe { blas.gemm_bf16(g, a, b, c) },
        };
        r.map_err(|e| self.err(e))
    }

    /// A bf16 cuBLASLt product with work in its epilogue
    /// (`CublasHandle::gemm_bf16_epilogue`: the bias, the bias and a GELU,
    /// or a GELU's gradient; one rounding, `C` not read).
    ///
    /// # Safety
    /// `a`, `b`, `c` address bf16 matrices of the sizes `g` describes, the
    /// epilogue's bias `g.n` bf16 values, its `aux` an m × n bf16 matrix of
    /// its row stride, disjoint from `c`.
    pub(crate) unsafe fn gemm_bf16_epilogue(
        &self,
        g: &Gemm,
        a: u64,
        b: u64,
        c: u64,
        epilogue: Epilogue,
    ) -> Result<()> {
        let blas = self.cu.cublas()?;
        // SAFETY: the caller's contract is `gemm_bf16_epilogue`'s; the
        // handle is bound to the task's stream.
        unsafe { blas.gemm_bf16_epilogue(g, a, b, c, epilogue) }.map_err(|e| self.err(e))
    }

    /// # Safety
    /// Each of the `batch` entries `x + i·stride_x` addresses a matrix of the
    /// size `g` describes.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn gemm_batched_as<S: Storage>(
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
        let r = match S::DTYPE {
            // SAFETY: the caller's contract is `sgemm_strided_batched`'s, on
            // f32 matrices.
            Dtype::F32 => unsafe {
                blas.sgemm_strided_batched(g, a, stride_a, b, stride_b, c, stride_c, batch)
            },
            // SAFETY: the caller's contract is
            // `gemm_bf16_strided_batched`'s, on bf16 matrices.
            Dtype::Bf16 => unsafe {
                blas.gemm_bf16_strided_batched(g, a, stride_a, b, stride_b, c, stride_c, batch)
            },
        };
        r.map_err(|e| self.err(e))
    }
}

/// A launcher's `Result` as a task body returns it.
pub(crate) fn task_result(r: Result<()>) -> std::result::Result<(), braid::TaskError> {
    r.map_err(braid::TaskError::from)
}

//! Kernels as CUDA C sources compiled at run time by NVRTC, cached, loaded as
//! modules and launched on raw streams.
//!
//! # Compilation
//!
//! [`compile`] runs NVRTC with
//! `--gpu-architecture=sm_XY -default-device --std=c++17 -lineinfo`
//! (plus `--use_fast_math` only when [`CompileOptions::fast_math`] is set: it is
//! off by default because it changes `expf`/`tanhf`/division results, and the
//! GPT-2 kernels are compared against a CPU reference). With a real architecture
//! (`sm_XY`) NVRTC emits a CUBIN, which the driver loads without a JIT step and
//! independently of the driver's PTX version; with a virtual one (`compute_XY`)
//! it emits PTX. A failed compile returns [`CudaError::Compile`] with NVRTC's
//! full log.
//!
//! # Caching
//!
//! [`KernelCache`] keys a compiled image by (FNV-1a-128 of the source, program
//! name, options including the architecture, NVRTC version):
//!
//! * in memory, for the process;
//! * on disk under `$BRAID_KERNEL_CACHE_DIR`, else `$XDG_CACHE_HOME/braid/kernels`,
//!   else `~/.cache/braid/kernels` — one file per key, written to a temporary
//!   name and renamed into place (atomic on POSIX), with the full key in a header
//!   that is checked on load, so a hash collision or a torn file is a miss, never
//!   a wrong kernel. `BRAID_KERNEL_CACHE=0` disables the disk layer.
//!
//! The disk layer pays: NVRTC with `sm_90` CUBIN output takes tens to hundreds
//! of milliseconds per program (see docs/cuda.md for the figures measured with
//! `tools/nvrtc-check`), a cache hit a fraction of a millisecond.
//!
//! # Launching
//!
//! [`CudaFunction::launch`] is `unsafe`: a kernel can read and write any device
//! memory its pointer arguments reach, and the argument list must match the
//! kernel's signature exactly. Arguments are collected in [`KernelArgs`], which
//! stores each scalar in an 8-byte slot and hands the driver an array of
//! pointers to the slots.

use std::collections::HashMap;
use std::ffi::CString;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Instant;

use cudarc::driver::{result as drv_result, sys as drv};
use cudarc::nvrtc::{result as nvrtc_result, sys as nv};

use super::device::CudaDevice;
use super::error::{catch_panic, nvrtc_message, CudaError, CudaResult, Named};
use super::memory::DevicePtr;
use super::stream::AsRawStream;

/// Options for one NVRTC compile.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct CompileOptions {
    /// `sm_XY` (CUBIN output) or `compute_XY` (PTX output).
    pub arch: String,
    /// Adds `--use_fast_math` (approximate transcendental functions, flush
    /// denormals, fast division). Off by default.
    pub fast_math: bool,
    /// Adds `-lineinfo` (source lines in profiles; no speed cost). On by default.
    pub line_info: bool,
    /// Extra NVRTC options, verbatim (e.g. `-DBLOCK=256`).
    pub extra: Vec<String>,
}

impl CompileOptions {
    /// Defaults for an explicit architecture, e.g. `"sm_90"`.
    pub fn for_arch(arch: impl Into<String>) -> Self {
        CompileOptions {
            arch: arch.into(),
            fast_math: false,
            line_info: true,
            extra: Vec::new(),
        }
    }

    /// Defaults for a device's compute capability (`sm_XY`).
    pub fn for_device(device: &CudaDevice) -> Self {
        Self::for_arch(device.arch())
    }

    /// The NVRTC command line these options stand for.
    pub fn to_args(&self) -> Vec<String> {
        let mut a = vec![
            format!("--gpu-architecture={}", self.arch),
            "-default-device".to_string(),
            "--std=c++17".to_string(),
        ];
        if self.line_info {
            a.push("-lineinfo".to_string());
        }
        if self.fast_math {
            a.push("--use_fast_math".to_string());
        }
        a.extend(self.extra.iter().cloned());
        a
    }

    fn produces_cubin(&self) -> bool {
        self.arch.starts_with("sm_")
    }
}

/// The output of one NVRTC compile.
#[derive(Debug, Clone)]
pub struct CompiledKernel {
    /// Program name given to NVRTC.
    pub program: String,
    /// Architecture compiled for.
    pub arch: String,
    /// The image: CUBIN bytes, or PTX text with a trailing NUL.
    pub image: Vec<u8>,
    /// True for CUBIN, false for PTX.
    pub is_cubin: bool,
    /// NVRTC's log (warnings), possibly empty.
    pub log: String,
    /// Wall time of the NVRTC compile (0 for a cache hit loaded from disk).
    pub compile_ms: f64,
}

/// NVRTC's `(major, minor)` version.
pub fn nvrtc_version() -> CudaResult<(i32, i32)> {
    super::require_nvrtc()?;
    catch_panic("nvrtcVersion", || {
        let (mut ma, mut mi) = (0, 0);
        // SAFETY: out-pointers valid. (cudarc's checked layer has no
        // `nvrtcVersion`.)
        unsafe { nv::nvrtcVersion(&mut ma, &mut mi) }
            .result()
            .named("nvrtcVersion")?;
        Ok((ma, mi))
    })
}

/// Destroys an NVRTC program on every exit path.
struct Program(nv::nvrtcProgram);
impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: created by nvrtcCreateProgram, destroyed once here.
        let _ = unsafe { nvrtc_result::destroy_program(self.0) };
    }
}

/// NVRTC's text output (log, PTX), `c_char`s as bytes.
fn c_chars_to_bytes(chars: Vec<std::ffi::c_char>) -> Vec<u8> {
    chars.into_iter().map(|c| c as u8).collect()
}

/// The program log, trimmed; empty when NVRTC cannot report it.
fn program_log(prog: &Program) -> String {
    // SAFETY: valid program (not yet destroyed).
    let buf = match unsafe { nvrtc_result::get_program_log(prog.0) } {
        Ok(buf) => c_chars_to_bytes(buf),
        Err(_) => return String::new(),
    };
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).trim_end().to_string()
}

/// A header a program may `#include "name"`: `(name, text)`. NVRTC resolves
/// a quoted include from the headers given with the program (it reads no
/// files), so a kernel family shares helpers without copying them into each
/// `.cu`.
pub type Header<'a> = (&'a str, &'a str);

/// Compiles `source` (named `program` in messages) with NVRTC. No caching; see
/// [`KernelCache`]. Needs only the NVRTC library, not a GPU.
pub fn compile(source: &str, program: &str, opts: &CompileOptions) -> CudaResult<CompiledKernel> {
    compile_with_headers(source, &[], program, opts)
}

/// As [`compile`], with the headers `source` may include.
pub fn compile_with_headers(
    source: &str,
    headers: &[Header<'_>],
    program: &str,
    opts: &CompileOptions,
) -> CudaResult<CompiledKernel> {
    super::require_nvrtc()?;
    catch_panic("NVRTC compile", || {
        compile_inner(source, headers, program, opts)
    })
}

/// A C string of `text`, or an error naming `what` of `program`.
fn c_string(text: &str, program: &str, what: &str) -> CudaResult<CString> {
    CString::new(text)
        .map_err(|_| CudaError::InvalidArgument(format!("{program}: {what} contains a NUL byte")))
}

fn compile_inner(
    source: &str,
    headers: &[Header<'_>],
    program: &str,
    opts: &CompileOptions,
) -> CudaResult<CompiledKernel> {
    let src = c_string(source, program, "the source")?;
    let name = c_string(program, program, "the program name")?;
    let mut header_names = Vec::with_capacity(headers.len());
    let mut header_texts = Vec::with_capacity(headers.len());
    for (n, text) in headers {
        header_names.push(c_string(n, program, "a header name")?);
        header_texts.push(c_string(text, program, &format!("header {n}"))?);
    }
    let args = opts.to_args();
    // `compile_program` makes C strings of the options and panics on a NUL:
    // reject those here.
    if args.iter().any(|a| a.contains('\0')) {
        return Err(CudaError::InvalidArgument(
            "option contains a NUL byte".into(),
        ));
    }

    let start = Instant::now();
    let name_ptrs: Vec<_> = header_names.iter().map(|c| c.as_ptr()).collect();
    let text_ptrs: Vec<_> = header_texts.iter().map(|c| c.as_ptr()).collect();
    let mut raw: nv::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: the source, name and header strings (and the arrays of pointers
    // to them, of `headers.len()` entries each) outlive the call; NVRTC copies
    // them. (cudarc's checked `create_program` takes no headers.)
    unsafe {
        nv::nvrtcCreateProgram(
            &mut raw,
            src.as_ptr(),
            name.as_ptr(),
            headers.len() as i32,
            text_ptrs.as_ptr(),
            name_ptrs.as_ptr(),
        )
    }
    .result()
    .named("nvrtcCreateProgram")?;
    // Destroyed when `prog` drops, on every path below.
    let prog = Program(raw);
    // SAFETY: valid program.
    let compiled = unsafe { nvrtc_result::compile_program(prog.0, &args) };
    let log = program_log(&prog);
    if let Err(e) = compiled {
        let log = if log.is_empty() {
            nvrtc_message(e.0)
        } else {
            log
        };
        return Err(CudaError::Compile {
            program: program.to_string(),
            arch: opts.arch.clone(),
            log,
        });
    }
    let is_cubin = opts.produces_cubin();
    let image = if is_cubin {
        // cudarc's checked layer has no CUBIN getters: raw calls.
        let mut size = 0usize;
        // SAFETY: compiled program; out-pointer valid.
        unsafe { nv::nvrtcGetCUBINSize(prog.0, &mut size) }
            .result()
            .named("nvrtcGetCUBINSize")?;
        let mut buf = vec![0u8; size];
        // SAFETY: buffer of the size NVRTC reported.
        unsafe { nv::nvrtcGetCUBIN(prog.0, buf.as_mut_ptr().cast()) }
            .result()
            .named("nvrtcGetCUBIN")?;
        buf
    } else {
        // SAFETY: compiled program. The size NVRTC reports includes the NUL.
        let ptx = unsafe { nvrtc_result::get_ptx(prog.0) }.named("nvrtcGetPTX")?;
        let mut buf = c_chars_to_bytes(ptx);
        if buf.last() != Some(&0) {
            buf.push(0);
        }
        buf
    };
    Ok(CompiledKernel {
        program: program.to_string(),
        arch: opts.arch.clone(),
        image,
        is_cubin,
        log,
        compile_ms: start.elapsed().as_secs_f64() * 1e3,
    })
}

/// 128-bit FNV-1a (two 64-bit lanes with different offset bases): stable
/// across Rust versions and platforms, unlike `DefaultHasher`.
fn fnv128(parts: &[&[u8]]) -> u128 {
    const P: u64 = 0x0000_0100_0000_01b3;
    let (mut a, mut b) = (0xcbf2_9ce4_8422_2325u64, 0x6c62_272e_07bb_0142u64);
    for part in parts {
        for &byte in part.iter().chain((part.len() as u64).to_le_bytes().iter()) {
            a = (a ^ u64::from(byte)).wrapping_mul(P);
            b = (b ^ u64::from(byte.rotate_left(3))).wrapping_mul(P);
        }
    }
    (u128::from(a) << 64) | u128::from(b)
}

/// Hit/miss counters of a [`KernelCache`].
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CacheStats {
    /// Served from memory.
    pub memory_hits: u64,
    /// Served from the disk cache.
    pub disk_hits: u64,
    /// Compiled by NVRTC.
    pub compiles: u64,
    /// Total NVRTC wall time, milliseconds.
    pub compile_ms: f64,
}

/// Process-wide compile cache (memory + disk) and loaded-module cache.
pub struct KernelCache {
    disk_dir: Option<PathBuf>,
    images: Mutex<HashMap<u128, Arc<CompiledKernel>>>,
    /// (context address, image key) → module; `Weak` so modules unload when unused.
    modules: Mutex<HashMap<(usize, u128), Weak<ModuleInner>>>,
    stats: Mutex<CacheStats>,
}

impl std::fmt::Debug for KernelCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KernelCache")
            .field("disk_dir", &self.disk_dir)
            .field("stats", &self.stats())
            .finish()
    }
}

const DISK_MAGIC: &[u8; 8] = b"BRDKRN01";

impl KernelCache {
    /// The process-wide cache, configured from the environment on first use.
    pub fn global() -> &'static KernelCache {
        static GLOBAL: OnceLock<KernelCache> = OnceLock::new();
        GLOBAL.get_or_init(|| KernelCache::new(Self::default_disk_dir()))
    }

    /// A cache with an explicit disk directory (`None`: memory only).
    pub fn new(disk_dir: Option<PathBuf>) -> Self {
        KernelCache {
            disk_dir,
            images: Mutex::new(HashMap::new()),
            modules: Mutex::new(HashMap::new()),
            stats: Mutex::new(CacheStats::default()),
        }
    }

    /// `$BRAID_KERNEL_CACHE_DIR`, else `$XDG_CACHE_HOME/braid/kernels`, else
    /// `$HOME/.cache/braid/kernels`; `None` when `BRAID_KERNEL_CACHE=0`.
    pub fn default_disk_dir() -> Option<PathBuf> {
        if std::env::var("BRAID_KERNEL_CACHE")
            .map(|v| v == "0")
            .unwrap_or(false)
        {
            return None;
        }
        if let Some(d) = std::env::var_os("BRAID_KERNEL_CACHE_DIR") {
            return Some(PathBuf::from(d));
        }
        if let Some(x) = std::env::var_os("XDG_CACHE_HOME").filter(|x| !x.is_empty()) {
            return Some(PathBuf::from(x).join("braid").join("kernels"));
        }
        std::env::var_os("HOME").map(|h| {
            PathBuf::from(h)
                .join(".cache")
                .join("braid")
                .join("kernels")
        })
    }

    /// Where compiled images are stored, if anywhere.
    pub fn disk_dir(&self) -> Option<&PathBuf> {
        self.disk_dir.as_ref()
    }

    /// Counters so far.
    pub fn stats(&self) -> CacheStats {
        self.stats.lock().map(|s| *s).unwrap_or_default()
    }

    fn key_text(
        source: &str,
        headers: &[Header<'_>],
        program: &str,
        opts: &CompileOptions,
    ) -> (u128, String) {
        static VERSION: OnceLock<String> = OnceLock::new();
        let ver = VERSION.get_or_init(|| {
            nvrtc_version()
                .map(|(a, b)| format!("{a}.{b}"))
                .unwrap_or_else(|_| "?".into())
        });
        let args = opts.to_args().join(" ");
        let src_hash = fnv128(&[source.as_bytes()]);
        let mut text = format!(
            "nvrtc {ver}\nprogram {program}\nargs {args}\nsource {src_hash:032x} {}",
            source.len()
        );
        for (name, h) in headers {
            let h_hash = fnv128(&[h.as_bytes()]);
            text.push_str(&format!("\nheader {name} {h_hash:032x} {}", h.len()));
        }
        (fnv128(&[text.as_bytes()]), text)
    }

    /// Returns the compiled image for `source`, from memory, disk, or NVRTC.
    pub fn get_or_compile(
        &self,
        source: &str,
        program: &str,
        opts: &CompileOptions,
    ) -> CudaResult<Arc<CompiledKernel>> {
        self.get_or_compile_with_headers(source, &[], program, opts)
    }

    /// As [`get_or_compile`](Self::get_or_compile), with the headers `source`
    /// may include (part of the key: a changed header is a miss).
    pub fn get_or_compile_with_headers(
        &self,
        source: &str,
        headers: &[Header<'_>],
        program: &str,
        opts: &CompileOptions,
    ) -> CudaResult<Arc<CompiledKernel>> {
        let keyed = Self::key_text(source, headers, program, opts);
        self.image(keyed, source, headers, program, opts)
    }

    /// The image of the program whose key (and key text) `key_text` made.
    fn image(
        &self,
        (key, text): (u128, String),
        source: &str,
        headers: &[Header<'_>],
        program: &str,
        opts: &CompileOptions,
    ) -> CudaResult<Arc<CompiledKernel>> {
        if let Some(k) = self.images.lock().expect("kernel cache poisoned").get(&key) {
            self.bump(|s| s.memory_hits += 1);
            return Ok(k.clone());
        }
        if let Some(k) = self.load_disk(key, &text, program, opts) {
            self.bump(|s| s.disk_hits += 1);
            let k = Arc::new(k);
            self.images
                .lock()
                .expect("kernel cache poisoned")
                .insert(key, k.clone());
            return Ok(k);
        }
        let k = compile_with_headers(source, headers, program, opts)?;
        self.bump(|s| {
            s.compiles += 1;
            s.compile_ms += k.compile_ms;
        });
        // A failed disk write only costs a recompile next time.
        let _ = self.store_disk(key, &text, &k);
        let k = Arc::new(k);
        self.images
            .lock()
            .expect("kernel cache poisoned")
            .insert(key, k.clone());
        Ok(k)
    }

    /// Compiles (through the cache) for `device` and loads the module, reusing a
    /// module already loaded in this context for the same image.
    pub fn module(
        &self,
        device: &CudaDevice,
        source: &str,
        program: &str,
    ) -> CudaResult<CudaModule> {
        self.module_with(device, source, program, &CompileOptions::for_device(device))
    }

    /// As [`module`](Self::module) with explicit options.
    pub fn module_with(
        &self,
        device: &CudaDevice,
        source: &str,
        program: &str,
        opts: &CompileOptions,
    ) -> CudaResult<CudaModule> {
        self.module_with_headers(device, source, &[], program, opts)
    }

    /// As [`module_with`](Self::module_with), with the headers `source` may
    /// include.
    pub fn module_with_headers(
        &self,
        device: &CudaDevice,
        source: &str,
        headers: &[Header<'_>],
        program: &str,
        opts: &CompileOptions,
    ) -> CudaResult<CudaModule> {
        let keyed = Self::key_text(source, headers, program, opts);
        let mkey = (device.raw_context() as usize, keyed.0);
        if let Some(inner) = self
            .modules
            .lock()
            .expect("kernel cache poisoned")
            .get(&mkey)
            .and_then(Weak::upgrade)
        {
            return Ok(CudaModule { inner });
        }
        let image = self.image(keyed, source, headers, program, opts)?;
        let m = CudaModule::load(device, &image)?;
        self.modules
            .lock()
            .expect("kernel cache poisoned")
            .insert(mkey, Arc::downgrade(&m.inner));
        Ok(m)
    }

    fn bump(&self, f: impl FnOnce(&mut CacheStats)) {
        if let Ok(mut s) = self.stats.lock() {
            f(&mut s);
        }
    }

    fn path_for(&self, key: u128) -> Option<PathBuf> {
        self.disk_dir
            .as_ref()
            .map(|d| d.join(format!("{key:032x}.bin")))
    }

    fn load_disk(
        &self,
        key: u128,
        text: &str,
        program: &str,
        opts: &CompileOptions,
    ) -> Option<CompiledKernel> {
        let bytes = std::fs::read(self.path_for(key)?).ok()?;
        // Layout: magic(8) | key_len u32 LE | key text | is_cubin u8 | image.
        let rest = bytes.strip_prefix(DISK_MAGIC.as_slice())?;
        let (len, rest) = rest.split_at_checked(4)?;
        let len = u32::from_le_bytes(len.try_into().ok()?) as usize;
        let (stored, rest) = rest.split_at_checked(len)?;
        if stored != text.as_bytes() {
            return None;
        }
        let (&flag, image) = rest.split_first()?;
        if image.is_empty() {
            return None;
        }
        Some(CompiledKernel {
            program: program.to_string(),
            arch: opts.arch.clone(),
            image: image.to_vec(),
            is_cubin: flag == 1,
            log: String::new(),
            compile_ms: 0.0,
        })
    }

    fn store_disk(&self, key: u128, text: &str, k: &CompiledKernel) -> CudaResult<()> {
        let Some(path) = self.path_for(key) else {
            return Ok(());
        };
        let io = |e: std::io::Error, p: &std::path::Path| CudaError::CacheIo {
            path: p.display().to_string(),
            message: e.to_string(),
        };
        let dir = path.parent().expect("cache file has a parent");
        std::fs::create_dir_all(dir).map_err(|e| io(e, dir))?;
        let mut buf = Vec::with_capacity(k.image.len() + text.len() + 16);
        buf.extend_from_slice(DISK_MAGIC);
        buf.extend_from_slice(&(text.len() as u32).to_le_bytes());
        buf.extend_from_slice(text.as_bytes());
        buf.push(u8::from(k.is_cubin));
        buf.extend_from_slice(&k.image);
        // Unique temporary name, then rename: readers see the old file, no file,
        // or the complete new one.
        static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let seq = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tmp = dir.join(format!(".{key:032x}.{}.{seq}.tmp", std::process::id()));
        std::fs::write(&tmp, &buf).map_err(|e| io(e, &tmp))?;
        std::fs::rename(&tmp, &path).map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            io(e, &path)
        })
    }
}

/// A loaded module (`cuModuleLoadData`). Clones share it; unloaded with the last.
#[derive(Clone)]
pub struct CudaModule {
    inner: Arc<ModuleInner>,
}

struct ModuleInner {
    raw: drv::CUmodule,
    device: CudaDevice,
    program: String,
}

// SAFETY: a `CUmodule` is a driver handle usable from any thread with its context
// current; we only read it and unload it once in `Drop`.
unsafe impl Send for ModuleInner {}
// SAFETY: see `Send`.
unsafe impl Sync for ModuleInner {}

impl std::fmt::Debug for CudaModule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaModule")
            .field("program", &self.inner.program)
            .field("device", &self.inner.device.ordinal())
            .finish()
    }
}

impl CudaModule {
    /// Loads a compiled image into `device`'s context.
    pub fn load(device: &CudaDevice, kernel: &CompiledKernel) -> CudaResult<Self> {
        device.bind_to_thread()?;
        if !kernel.is_cubin && kernel.image.last() != Some(&0) {
            return Err(CudaError::InvalidArgument(
                "PTX image must be NUL-terminated".into(),
            ));
        }
        // SAFETY: context current; the image is a complete CUBIN, or NUL-terminated
        // PTX, that outlives the call (the driver copies it).
        let raw = unsafe { drv_result::module::load_data(kernel.image.as_ptr().cast()) }
            .named("cuModuleLoadData")?;
        Ok(CudaModule {
            inner: Arc::new(ModuleInner {
                raw,
                device: device.clone(),
                program: kernel.program.clone(),
            }),
        })
    }

    /// Compiles (through [`KernelCache::global`]) and loads.
    pub fn from_source(device: &CudaDevice, source: &str, program: &str) -> CudaResult<Self> {
        KernelCache::global().module(device, source, program)
    }

    /// Looks up an `extern "C" __global__` kernel by name.
    pub fn function(&self, name: &str) -> CudaResult<CudaFunction> {
        let cname = CString::new(name)
            .map_err(|_| CudaError::InvalidArgument("kernel name has a NUL".into()))?;
        self.inner.device.bind_to_thread()?;
        // SAFETY: module loaded (held by `self.inner`).
        let raw = match unsafe { drv_result::module::get_function(self.inner.raw, cname) } {
            Err(e) if e.0 == drv::CUresult::CUDA_ERROR_NOT_FOUND => {
                return Err(CudaError::KernelNotFound {
                    module: self.inner.program.clone(),
                    kernel: name.to_string(),
                })
            }
            r => r.named("cuModuleGetFunction")?,
        };
        Ok(CudaFunction {
            raw,
            module: self.inner.clone(),
            name: name.to_string(),
        })
    }

    /// Program name.
    pub fn program(&self) -> &str {
        &self.inner.program
    }
}

impl Drop for ModuleInner {
    fn drop(&mut self) {
        let r = self.device.bind_to_thread().and_then(|()| {
            // SAFETY: loaded once, unloaded once; every `CudaFunction` holds an
            // `Arc<ModuleInner>`, so no function handle outlives the module.
            unsafe { drv_result::module::unload(self.raw) }.named("cuModuleUnload")
        });
        if let Err(e) = r {
            self.device.record_deferred(e);
        }
    }
}

/// Grid, block and dynamic shared memory of a launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchConfig {
    /// Blocks per grid (x, y, z).
    pub grid: (u32, u32, u32),
    /// Threads per block (x, y, z).
    pub block: (u32, u32, u32),
    /// Dynamic shared memory per block, bytes.
    pub shared_mem_bytes: u32,
}

impl LaunchConfig {
    /// 1-D launch covering `n` elements with `block` threads per block.
    pub fn linear(n: usize, block: u32) -> Self {
        let blocks = n.div_ceil(block as usize).max(1);
        LaunchConfig {
            grid: (blocks as u32, 1, 1),
            block: (block, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// Explicit 1-D grid and block.
    pub fn grid_block(grid: u32, block: u32) -> Self {
        LaunchConfig {
            grid: (grid, 1, 1),
            block: (block, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// Sets the dynamic shared memory.
    pub fn with_shared(mut self, bytes: u32) -> Self {
        self.shared_mem_bytes = bytes;
        self
    }
}

#[derive(Clone, Copy)]
#[repr(C, align(8))]
struct Slot([u8; 8]);

/// A kernel's argument list: scalars by value, device pointers as `u64`.
/// Push in the order of the kernel's parameters.
#[derive(Clone, Default)]
pub struct KernelArgs {
    slots: Vec<Slot>,
}

impl std::fmt::Debug for KernelArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KernelArgs")
            .field("len", &self.slots.len())
            .finish()
    }
}

impl KernelArgs {
    /// An empty list.
    pub fn new() -> Self {
        Self::default()
    }

    fn push_bytes(&mut self, b: &[u8]) -> &mut Self {
        let mut s = [0u8; 8];
        s[..b.len()].copy_from_slice(b);
        self.slots.push(Slot(s));
        self
    }

    /// A device pointer (`T*` / `const T*` parameter).
    pub fn ptr(&mut self, p: DevicePtr) -> &mut Self {
        self.push_bytes(&p.to_ne_bytes())
    }
    /// A `float` parameter.
    pub fn f32(&mut self, v: f32) -> &mut Self {
        self.push_bytes(&v.to_ne_bytes())
    }
    /// A `double` parameter.
    pub fn f64(&mut self, v: f64) -> &mut Self {
        self.push_bytes(&v.to_ne_bytes())
    }
    /// An `int` parameter.
    pub fn i32(&mut self, v: i32) -> &mut Self {
        self.push_bytes(&v.to_ne_bytes())
    }
    /// An `unsigned int` parameter.
    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.push_bytes(&v.to_ne_bytes())
    }
    /// A `long long` parameter.
    pub fn i64(&mut self, v: i64) -> &mut Self {
        self.push_bytes(&v.to_ne_bytes())
    }
    /// An `unsigned long long` / `size_t` parameter.
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.push_bytes(&v.to_ne_bytes())
    }

    /// Number of arguments pushed.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// True when no argument was pushed.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }
}

/// A kernel in a loaded module. Keeps the module loaded.
#[derive(Clone)]
pub struct CudaFunction {
    raw: drv::CUfunction,
    module: Arc<ModuleInner>,
    name: String,
}

// SAFETY: a `CUfunction` is an immutable driver handle valid while its module is
// loaded (held by `module`); launches from several threads are allowed.
unsafe impl Send for CudaFunction {}
// SAFETY: see `Send`.
unsafe impl Sync for CudaFunction {}

impl std::fmt::Debug for CudaFunction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaFunction")
            .field("name", &self.name)
            .field("program", &self.module.program)
            .finish()
    }
}

impl CudaFunction {
    /// Kernel name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Allows up to `bytes` of dynamic shared memory (needed above 48 KiB).
    pub fn set_max_dynamic_shared_mem(&self, bytes: u32) -> CudaResult<()> {
        self.module.device.bind_to_thread()?;
        // SAFETY: function handle valid while the module is loaded.
        unsafe {
            drv_result::function::set_function_attribute(
                self.raw,
                drv::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes as i32,
            )
        }
        .named("cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)")
    }

    /// Queues the kernel on `stream` (a [`CudaStream`](super::CudaStream) or a [`super::RawStream`]).
    ///
    /// # Safety
    /// `args` must match the kernel's parameter list exactly (count, order, and
    /// size of each); every pointer argument must address device memory of this
    /// device that stays allocated until the kernel has run and that the kernel
    /// may access as it does without racing other streams (the engine's
    /// declared-access rules guarantee this). A raw stream must be a live stream
    /// of this function's device.
    pub unsafe fn launch<S: AsRawStream + ?Sized>(
        &self,
        stream: &S,
        cfg: LaunchConfig,
        args: &KernelArgs,
    ) -> CudaResult<()> {
        if let Some(d) = stream.stream_device() {
            self.module.device.check_same(d, "launch stream")?;
        }
        self.module.device.bind_to_thread()?;
        // The driver copies the argument values during the call, so pointers into
        // this local copy suffice.
        let mut slots = args.slots.clone();
        let mut params: Vec<*mut std::ffi::c_void> = slots
            .iter_mut()
            .map(|s| (s as *mut Slot).cast::<std::ffi::c_void>())
            .collect();
        // SAFETY: the function is loaded in the current context; `params` holds one
        // pointer per kernel parameter (caller's contract), each to 8 readable
        // bytes whose prefix is the parameter's value; the stream is alive.
        unsafe {
            drv_result::launch_kernel(
                self.raw,
                cfg.grid,
                cfg.block,
                cfg.shared_mem_bytes,
                stream.raw_stream(),
                &mut params,
            )
        }
        .named("cuLaunchKernel")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
extern "C" __global__ void scale(float* out, const float* in, float a, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = a * in[i];
}
"#;

    fn nvrtc_or_skip(test: &str) -> bool {
        if super::super::nvrtc_library_present() {
            return true;
        }
        if std::env::var("BRAID_REQUIRE_NVRTC")
            .map(|v| v == "1")
            .unwrap_or(false)
        {
            panic!("{test}: BRAID_REQUIRE_NVRTC=1 but libnvrtc could not be loaded");
        }
        eprintln!("SKIPPED {test}: libnvrtc not found (run scripts/install-nvrtc.sh and set LD_LIBRARY_PATH)");
        false
    }

    #[test]
    fn compiles_to_cubin_and_ptx() {
        if !nvrtc_or_skip("nvrtc::compiles_to_cubin_and_ptx") {
            return;
        }
        let k = compile(GOOD, "scale.cu", &CompileOptions::for_arch("sm_90")).unwrap();
        assert!(k.is_cubin);
        assert_eq!(&k.image[..4], b"\x7fELF");
        let p = compile(GOOD, "scale.cu", &CompileOptions::for_arch("compute_90")).unwrap();
        assert!(!p.is_cubin);
        let text = String::from_utf8_lossy(&p.image);
        assert!(text.contains(".entry scale"), "{text}");
    }

    #[test]
    fn compile_error_carries_the_log() {
        if !nvrtc_or_skip("nvrtc::compile_error_carries_the_log") {
            return;
        }
        let bad = "extern \"C\" __global__ void broken(float* x) { x[0] = undefined_name; }";
        let err = compile(bad, "broken.cu", &CompileOptions::for_arch("sm_90")).unwrap_err();
        match &err {
            CudaError::Compile { program, log, .. } => {
                assert_eq!(program, "broken.cu");
                assert!(log.contains("undefined_name"), "{log}");
            }
            other => panic!("expected a compile error, got {other:?}"),
        }
        assert!(err.to_string().contains("broken.cu"));
    }

    #[test]
    fn disk_cache_roundtrip() {
        if !nvrtc_or_skip("nvrtc::disk_cache_roundtrip") {
            return;
        }
        let dir = std::env::temp_dir().join(format!("braid-kcache-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let opts = CompileOptions::for_arch("sm_90");
        let c1 = KernelCache::new(Some(dir.clone()));
        let a = c1.get_or_compile(GOOD, "scale.cu", &opts).unwrap();
        let a2 = c1.get_or_compile(GOOD, "scale.cu", &opts).unwrap();
        assert!(Arc::ptr_eq(&a, &a2));
        assert_eq!(c1.stats().compiles, 1);
        assert_eq!(c1.stats().memory_hits, 1);
        // A fresh cache on the same directory hits the disk.
        let c2 = KernelCache::new(Some(dir.clone()));
        let b = c2.get_or_compile(GOOD, "scale.cu", &opts).unwrap();
        assert_eq!(c2.stats().disk_hits, 1);
        assert_eq!(a.image, b.image);
        // Different options: a different entry.
        let mut fast = opts.clone();
        fast.fast_math = true;
        c2.get_or_compile(GOOD, "scale.cu", &fast).unwrap();
        assert_eq!(c2.stats().compiles, 1);
        // A corrupted file is a miss, not an error.
        for e in std::fs::read_dir(&dir).unwrap() {
            std::fs::write(e.unwrap().path(), b"garbage").unwrap();
        }
        let c3 = KernelCache::new(Some(dir.clone()));
        c3.get_or_compile(GOOD, "scale.cu", &opts).unwrap();
        assert_eq!(c3.stats().compiles, 1);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A quoted include resolves to a header given with the program, and only
    /// to one; a header's text is part of the cache key.
    #[test]
    fn headers_resolve_quoted_includes() {
        let src = "#include \"twice.cuh\"\n\
                   extern \"C\" __global__ void k(float* x) { x[0] = twice(x[0]); }";
        let header = (
            "twice.cuh",
            "__device__ float twice(float v) { return 2.0f * v; }",
        );
        let opts = CompileOptions::for_arch("sm_90");
        let (a, _) = KernelCache::key_text(src, &[header], "k.cu", &opts);
        let (b, _) = KernelCache::key_text(src, &[("twice.cuh", "// changed")], "k.cu", &opts);
        let (c, _) = KernelCache::key_text(src, &[], "k.cu", &opts);
        assert!(a != b && a != c && b != c);
        if !nvrtc_or_skip("nvrtc::headers_resolve_quoted_includes") {
            return;
        }
        let k = compile_with_headers(src, &[header], "k.cu", &opts).unwrap();
        assert!(k.is_cubin && !k.image.is_empty());
        match compile(src, "k.cu", &opts).unwrap_err() {
            CudaError::Compile { log, .. } => assert!(log.contains("twice.cuh"), "{log}"),
            other => panic!("expected a compile error, got {other:?}"),
        }
        let e = compile_with_headers(src, &[("bad.cuh", "a\0b")], "k.cu", &opts).unwrap_err();
        assert!(e.to_string().contains("bad.cuh"), "{e}");
    }

    #[test]
    fn fnv_is_stable() {
        assert_eq!(fnv128(&[b"abc"]), fnv128(&[b"abc"]));
        assert_ne!(fnv128(&[b"ab", b"c"]), fnv128(&[b"abc"]));
    }

    #[test]
    fn launch_scale_kernel() {
        if !super::super::gpu_or_skip("nvrtc::launch_scale_kernel") {
            return;
        }
        use super::super::memory::DeviceBuffer;
        use super::super::stream::CudaStream;
        let dev = CudaDevice::open(0).unwrap();
        let s = CudaStream::compute(&dev).unwrap();
        let m = CudaModule::from_source(&dev, GOOD, "scale.cu").unwrap();
        let f = m.function("scale").unwrap();
        assert!(matches!(
            m.function("nope"),
            Err(CudaError::KernelNotFound { .. })
        ));
        let n = 1000usize;
        let x: Vec<f32> = (0..n).map(|i| i as f32).collect();
        let inp = DeviceBuffer::from_host(&s, &x).unwrap();
        let out = DeviceBuffer::alloc(&s, n * 4).unwrap();
        let mut args = KernelArgs::new();
        args.ptr(out.device_ptr())
            .ptr(inp.device_ptr())
            .f32(3.0)
            .i32(n as i32);
        // SAFETY: signature (float*, const float*, float, int) matches; buffers
        // hold n floats and live past the sync in `to_host_vec`.
        unsafe { f.launch(&s, LaunchConfig::linear(n, 256), &args).unwrap() };
        let y: Vec<f32> = out.to_host_vec(&s).unwrap();
        assert!(y.iter().zip(&x).all(|(y, x)| *y == 3.0 * x));
        // Same source again: the module cache returns the loaded module.
        let m2 = CudaModule::from_source(&dev, GOOD, "scale.cu").unwrap();
        assert_eq!(m2.program(), "scale.cu");
    }
}

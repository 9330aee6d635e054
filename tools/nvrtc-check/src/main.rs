//! `nvrtc-check`: compiles every `.cu` file under a directory with NVRTC, the
//! way the CUDA backend compiles kernels at run time, and exits non-zero listing
//! every failure. Needs `libnvrtc.so.13` (scripts/install-nvrtc.sh), no GPU.
//!
//! ```text
//! nvrtc-check [--root DIR] [--arch sm_90[,sm_80,...]] [--fast-math]
//!             [--deny-warnings] [--repeat N] [FILE.cu ...]
//! ```
//!
//! Each `.cu` is given the `.cuh` files of its own directory, and the
//! engine's shared headers (`cuda/kernels/*.cuh` under the root), as NVRTC
//! headers, by file name, as the runtime gives its programs their headers
//! (NVRTC reads no files: `#include "bf16.cuh"` resolves only to a header
//! passed with the program).
//!
//! Besides NVRTC errors it checks that every `__global__` function is declared
//! `extern "C"` (the runtime looks kernels up by their unmangled name).
//! It prints the compile time of each file, the figure that decides whether the
//! runtime's on-disk kernel cache pays (docs/cuda.md), and for a real
//! architecture (`sm_*`) each kernel's registers per thread and stack frame
//! from the cubin (`cubin.rs`): occupancy and spills, known without a GPU.

#![deny(unsafe_op_in_unsafe_fn)]

mod cubin;

use std::ffi::{CStr, CString};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use cudarc::nvrtc::sys as nv;

/// NVRTC options; keep in sync with `CompileOptions::to_args` in
/// cuda/src/nvrtc.rs (not a dependency: this binary builds with NVRTC bindings
/// only).
fn nvrtc_args(arch: &str, fast_math: bool) -> Vec<String> {
    let mut a = vec![
        format!("--gpu-architecture={arch}"),
        "-default-device".to_string(),
        "--std=c++17".to_string(),
        "-lineinfo".to_string(),
    ];
    if fast_math {
        a.push("--use_fast_math".to_string());
    }
    a
}

struct Outcome {
    ok: bool,
    log: String,
    image_bytes: usize,
    ms: f64,
    /// Per kernel, from a cubin (empty for PTX).
    resources: std::collections::BTreeMap<String, cubin::Resources>,
}

fn nv_message(status: nv::nvrtcResult) -> String {
    // SAFETY: returns a static NUL-terminated string for any status.
    let p = unsafe { nv::nvrtcGetErrorString(status) };
    if p.is_null() {
        format!("{status:?}")
    } else {
        // SAFETY: non-null static string.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }
}

struct Program(nv::nvrtcProgram);
impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: created by nvrtcCreateProgram, destroyed once.
        unsafe { nv::nvrtcDestroyProgram(&mut self.0) };
    }
}

fn compile(
    source: &str,
    name: &str,
    headers: &[(String, String)],
    args: &[String],
) -> Result<Outcome, String> {
    let src = CString::new(source).map_err(|_| "source contains a NUL byte".to_string())?;
    let cname = CString::new(name).map_err(|_| "name contains a NUL byte".to_string())?;
    let c =
        |n: &str, s: &str| CString::new(s).map_err(|_| format!("header {n} contains a NUL byte"));
    let h_names = headers
        .iter()
        .map(|(n, _)| c(n, n))
        .collect::<Result<Vec<_>, _>>()?;
    let h_texts = headers
        .iter()
        .map(|(n, t)| c(n, t))
        .collect::<Result<Vec<_>, _>>()?;
    let h_name_ptrs: Vec<*const std::ffi::c_char> = h_names.iter().map(|h| h.as_ptr()).collect();
    let h_text_ptrs: Vec<*const std::ffi::c_char> = h_texts.iter().map(|h| h.as_ptr()).collect();
    let cargs: Vec<CString> = args
        .iter()
        .map(|a| CString::new(a.as_str()).expect("no NUL"))
        .collect();
    let ptrs: Vec<*const std::ffi::c_char> = cargs.iter().map(|a| a.as_ptr()).collect();
    let start = Instant::now();
    let mut raw: nv::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: NUL-terminated strings and the header pointer arrays (of
    // `headers.len()` entries) outlive the call.
    let r = unsafe {
        nv::nvrtcCreateProgram(
            &mut raw,
            src.as_ptr(),
            cname.as_ptr(),
            headers.len() as i32,
            h_text_ptrs.as_ptr(),
            h_name_ptrs.as_ptr(),
        )
    };
    if r != nv::nvrtcResult::NVRTC_SUCCESS {
        return Err(format!("nvrtcCreateProgram: {}", nv_message(r)));
    }
    let prog = Program(raw);
    // SAFETY: valid program; `ptrs` has `len` live C strings.
    let status = unsafe { nv::nvrtcCompileProgram(prog.0, ptrs.len() as i32, ptrs.as_ptr()) };
    let ms = start.elapsed().as_secs_f64() * 1e3;
    let mut size = 0usize;
    let mut log = String::new();
    // SAFETY: valid program; out-pointer valid.
    if unsafe { nv::nvrtcGetProgramLogSize(prog.0, &mut size) } == nv::nvrtcResult::NVRTC_SUCCESS {
        let mut buf = vec![0u8; size.max(1)];
        // SAFETY: buffer of the reported size.
        if unsafe { nv::nvrtcGetProgramLog(prog.0, buf.as_mut_ptr().cast()) }
            == nv::nvrtcResult::NVRTC_SUCCESS
        {
            let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
            log = String::from_utf8_lossy(&buf[..end]).trim_end().to_string();
        }
    }
    if status != nv::nvrtcResult::NVRTC_SUCCESS {
        if log.is_empty() {
            log = nv_message(status);
        }
        return Ok(Outcome {
            ok: false,
            log,
            image_bytes: 0,
            ms,
            resources: Default::default(),
        });
    }
    let mut image = 0usize;
    // SAFETY: compiled program; out-pointer valid.
    let r = if args[0].contains("=sm_") {
        unsafe { nv::nvrtcGetCUBINSize(prog.0, &mut image) }
    } else {
        // SAFETY: as above.
        unsafe { nv::nvrtcGetPTXSize(prog.0, &mut image) }
    };
    if r != nv::nvrtcResult::NVRTC_SUCCESS {
        return Err(format!("getting the image size: {}", nv_message(r)));
    }
    let mut resources = Default::default();
    if args[0].contains("=sm_") {
        let mut bytes = vec![0u8; image];
        // SAFETY: compiled program; `bytes` holds the size NVRTC reported.
        let r = unsafe { nv::nvrtcGetCUBIN(prog.0, bytes.as_mut_ptr().cast()) };
        if r != nv::nvrtcResult::NVRTC_SUCCESS {
            return Err(format!("getting the cubin: {}", nv_message(r)));
        }
        resources = cubin::resources(&bytes).unwrap_or_default();
    }
    Ok(Outcome {
        ok: true,
        log,
        image_bytes: image,
        ms,
        resources,
    })
}

/// `__global__` functions not declared `extern "C"` (1-based line numbers).
fn mangled_kernels(source: &str) -> Vec<usize> {
    let lines: Vec<&str> = source.lines().collect();
    let mut bad = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let code = line.split("//").next().unwrap_or("");
        if code.contains("__global__") {
            let prev = if i > 0 { lines[i - 1] } else { "" };
            if !code.contains("extern \"C\"") && !prev.trim_end().ends_with("extern \"C\"") {
                bad.push(i + 1);
            }
        }
    }
    bad
}

fn find_cu(dir: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let path = entry.path();
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if entry.file_type()?.is_dir() {
            if name.starts_with('.')
                || name == "target"
                || name == "build"
                || name.starts_with("cmake-build")
            {
                continue;
            }
            find_cu(&path, out)?;
        } else if name.ends_with(".cu") {
            out.push(path);
        }
    }
    Ok(())
}

/// The `.cuh` files beside `file` and in `shared` (the engine's headers,
/// which every program may include; when it exists), as `(file name, text)`
/// NVRTC headers, one per name (the file's own directory first).
fn headers_for(file: &Path, shared: &Path) -> std::io::Result<Vec<(String, String)>> {
    let dir = file.parent().unwrap_or(Path::new("."));
    let mut out: Vec<(String, String)> = Vec::new();
    for d in [dir, shared] {
        if d != dir && !d.is_dir() {
            continue;
        }
        for entry in std::fs::read_dir(d)? {
            let entry = entry?;
            let name = entry.file_name().to_string_lossy().into_owned();
            let seen = out.iter().any(|(n, _)| *n == name);
            if name.ends_with(".cuh") && entry.file_type()?.is_file() && !seen {
                out.push((name, std::fs::read_to_string(entry.path())?));
            }
        }
    }
    out.sort();
    Ok(out)
}

fn library_present() -> bool {
    // SAFETY: only tries dlopen on cudarc's candidate names.
    std::panic::catch_unwind(|| unsafe { nv::is_culib_present() }).unwrap_or(false)
}

fn usage() -> ExitCode {
    eprintln!(
        "usage: nvrtc-check [--root DIR] [--arch sm_90[,sm_80,...]] [--fast-math] [--deny-warnings] \
         [--repeat N] [--define NAME[=VALUE] ...] [FILE.cu ...]"
    );
    ExitCode::from(2)
}

fn main() -> ExitCode {
    let mut root = PathBuf::from(".");
    let mut archs = vec!["sm_90".to_string()];
    let mut fast_math = false;
    let mut deny_warnings = false;
    let mut repeat = 1usize;
    let mut defines = Vec::new();
    let mut files = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--root" => match args.next() {
                Some(v) => root = PathBuf::from(v),
                None => return usage(),
            },
            "--arch" => match args.next() {
                Some(v) => {
                    archs = v
                        .split(',')
                        .map(|s| s.trim().to_string())
                        .filter(|s| !s.is_empty())
                        .collect()
                }
                None => return usage(),
            },
            "--repeat" => match args.next().and_then(|v| v.parse().ok()) {
                Some(n) if n >= 1 => repeat = n,
                _ => return usage(),
            },
            // A macro for every file (`-DNAME=VALUE`), as a tuning build's
            // BRAID_NVRTC_OPTIONS sets it: registers per variant.
            "--define" => match args.next() {
                Some(v) if !v.is_empty() => defines.push(format!("-D{v}")),
                _ => return usage(),
            },
            "--fast-math" => fast_math = true,
            "--deny-warnings" => deny_warnings = true,
            "-h" | "--help" => {
                usage();
                return ExitCode::SUCCESS;
            }
            f if f.starts_with("--") => {
                eprintln!("unknown option {f}");
                return usage();
            }
            f => files.push(PathBuf::from(f)),
        }
    }

    if !library_present() {
        eprintln!(
            "nvrtc-check: libnvrtc could not be loaded. Run scripts/install-nvrtc.sh and add the \
             directory it prints to LD_LIBRARY_PATH."
        );
        return ExitCode::from(2);
    }
    let (mut ma, mut mi) = (0, 0);
    // SAFETY: out-pointers valid.
    unsafe { nv::nvrtcVersion(&mut ma, &mut mi) };

    if files.is_empty() {
        if let Err(e) = find_cu(&root, &mut files) {
            eprintln!("nvrtc-check: cannot walk {}: {e}", root.display());
            return ExitCode::from(2);
        }
    }
    files.sort();
    if files.is_empty() {
        eprintln!("nvrtc-check: no .cu files under {}", root.display());
        return ExitCode::from(1);
    }
    println!(
        "nvrtc-check: NVRTC {ma}.{mi}, {} file(s), arch {}",
        files.len(),
        archs.join(",")
    );

    let mut failures: Vec<String> = Vec::new();
    let mut total_ms = 0.0;
    let mut compiles = 0usize;
    for file in &files {
        let shown = file
            .strip_prefix(&root)
            .unwrap_or(file)
            .display()
            .to_string();
        let source = match std::fs::read_to_string(file) {
            Ok(s) => s,
            Err(e) => {
                failures.push(format!("{shown}: cannot read: {e}"));
                continue;
            }
        };
        for line in mangled_kernels(&source) {
            failures.push(format!(
                "{shown}:{line}: __global__ function is not extern \"C\""
            ));
        }
        let name = file
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let headers = match headers_for(file, &root.join("cuda/kernels")) {
            Ok(h) => h,
            Err(e) => {
                failures.push(format!("{shown}: cannot read the headers beside it: {e}"));
                continue;
            }
        };
        for arch in &archs {
            let mut args = nvrtc_args(arch, fast_math);
            args.extend(defines.iter().cloned());
            let mut times = Vec::with_capacity(repeat);
            let mut last = None;
            for _ in 0..repeat {
                match compile(&source, &name, &headers, &args) {
                    Ok(o) => {
                        times.push(o.ms);
                        last = Some(o);
                    }
                    Err(e) => {
                        failures.push(format!("{shown} [{arch}]: {e}"));
                        last = None;
                        break;
                    }
                }
            }
            let Some(o) = last else { continue };
            times.sort_by(|a, b| a.total_cmp(b));
            let median = times[times.len() / 2];
            total_ms += times.iter().sum::<f64>();
            compiles += times.len();
            if o.ok {
                println!(
                    "  ok   {shown} [{arch}] {median:.1} ms, {} bytes",
                    o.image_bytes
                );
                for (kernel, r) in &o.resources {
                    let show = |v: Option<u32>| v.map_or("?".to_string(), |v| v.to_string());
                    println!(
                        "         {kernel}: {} registers, {} bytes of stack",
                        show(r.registers),
                        show(r.frame_bytes)
                    );
                }
                if !o.log.is_empty() {
                    println!("       warnings:\n{}", indent(&o.log));
                    if deny_warnings {
                        failures.push(format!(
                            "{shown} [{arch}]: warnings (--deny-warnings):\n{}",
                            indent(&o.log)
                        ));
                    }
                }
            } else {
                println!("  FAIL {shown} [{arch}] {median:.1} ms");
                failures.push(format!(
                    "{shown} [{arch}]: compile error:\n{}",
                    indent(&o.log)
                ));
            }
        }
    }
    println!(
        "nvrtc-check: {compiles} compile(s), {total_ms:.0} ms total, {:.1} ms mean",
        total_ms / compiles.max(1) as f64
    );
    if failures.is_empty() {
        println!("nvrtc-check: all {} file(s) compile", files.len());
        ExitCode::SUCCESS
    } else {
        eprintln!("nvrtc-check: {} failure(s):", failures.len());
        for f in &failures {
            eprintln!("- {f}");
        }
        ExitCode::from(1)
    }
}

fn indent(s: &str) -> String {
    s.lines()
        .map(|l| format!("         {l}"))
        .collect::<Vec<_>>()
        .join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_kernels_without_extern_c() {
        let src = "extern \"C\" __global__ void a() {}\n__global__ void b() {}\nextern \"C\"\n__global__ void c() {}\n// __global__ in a comment\n";
        assert_eq!(mangled_kernels(src), vec![2]);
    }
}

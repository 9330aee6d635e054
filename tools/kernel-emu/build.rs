//! Compiles the emulator runtime (csrc/emu.cpp) and every kernel wrapper
//! (csrc/kernels_*.cpp, each of which `#include`s one `.cu` file) into one
//! static library, with the kernels' directory on the include path. The
//! library is linked whole: a kernels_*.cpp file exports its kernels from
//! static initialisers (BRAID_EMU_EXPORT) and defines no symbol that anything
//! refers to, so the linker would otherwise leave it out.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};

fn main() {
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("set by cargo"));
    let csrc = root.join("csrc");
    let repo = root
        .ancestors()
        .nth(2)
        .expect("tools/kernel-emu is two levels down");
    let kernels = repo.join("models/gpt2/src/kernels");
    let engine_kernels = repo.join("cuda/kernels");
    let include_dirs = [csrc.clone(), kernels, engine_kernels];

    let mut sources: Vec<PathBuf> = fs::read_dir(&csrc)
        .expect("csrc/ is readable")
        .map(|e| e.expect("csrc/ entry").path())
        .filter(|p| {
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
            name == "emu.cpp" || (name.starts_with("kernels_") && name.ends_with(".cpp"))
        })
        .collect();
    sources.sort();

    // Rebuild when a source, or any file it includes from the include
    // directories, changes; the directory itself for a new kernels_*.cpp.
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed={}", csrc.display());
    let mut seen = BTreeSet::new();
    for s in &sources {
        track(s, &include_dirs, &mut seen);
    }
    for f in &seen {
        println!("cargo:rerun-if-changed={}", f.display());
    }

    let mut build = cc::Build::new();
    build
        .cpp(true)
        .std("c++17")
        .opt_level(2)
        .flag("-ffp-contract=off")
        .flag("-Wall")
        .flag("-Wextra")
        // Kernels share parameter lists and carry CUDA's `#pragma unroll`.
        .flag("-Wno-unused-parameter")
        .flag("-Wno-unknown-pragmas")
        .define("BRAID_KERNEL_EMU", None)
        .files(&sources);
    for d in &include_dirs {
        build.include(d);
    }
    build.link_lib_modifier("+whole-archive");
    build.compile("braid_kernel_emu");
}

/// Adds `file` and, recursively, every `#include "..."` it makes that
/// resolves in `dirs` (or beside it) to `seen`.
fn track(file: &Path, dirs: &[PathBuf], seen: &mut BTreeSet<PathBuf>) {
    if !seen.insert(file.to_path_buf()) {
        return;
    }
    let Ok(text) = fs::read_to_string(file) else {
        return;
    };
    let here = file.parent().map(Path::to_path_buf);
    for line in text.lines() {
        let Some(rest) = line.trim_start().strip_prefix("#include") else {
            continue;
        };
        let Some(name) = rest
            .trim()
            .strip_prefix('"')
            .and_then(|r| r.split('"').next())
        else {
            continue;
        };
        if let Some(found) = here
            .iter()
            .chain(dirs)
            .map(|d| d.join(name))
            .find(|p| p.is_file())
        {
            track(&found, dirs, seen);
        }
    }
}

//! Generates the C++ side of the bridge (`braid-ffi/src/lib.rs.h`) and compiles
//! it, with the task trampoline (`src/glue.cc`), into the static library.
//!
//! The generated headers land in `$CARGO_TARGET_DIR/cxxbridge/` (cxx-build's
//! convention); the top-level CMakeLists.txt copies them, `rust/cxx.h` and
//! `src/glue.h` into one include directory next to `braid/braid.hpp`.

fn main() {
    cxx_build::bridge("src/lib.rs")
        .file("src/glue.cc")
        .std("c++17")
        .flag_if_supported("-Wall")
        .flag_if_supported("-Wextra")
        .compile("braid-cxx-bridge");
    println!("cargo:rerun-if-changed=src/lib.rs");
    println!("cargo:rerun-if-changed=src/glue.h");
    println!("cargo:rerun-if-changed=src/glue.cc");
    println!("cargo:rerun-if-env-changed=CXX");
    println!("cargo:rerun-if-env-changed=CXXFLAGS");
}

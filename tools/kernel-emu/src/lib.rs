//! Runs CUDA kernel sources on the CPU, so that `cargo test` can check their
//! indexing and arithmetic against the Rust CPU kernels on a machine with no
//! GPU (README.md).
//!
//! g++ compiles each `.cu` file with `csrc/cuda_emu.h`, a shim for the subset
//! of CUDA C++ the kernels use; `csrc/emu.cpp` runs a launch block after
//! block, a fiber per thread, with real `__syncthreads`, warp shuffles and the
//! bf16 tensor-core MMA. Every function here runs one kernel:
//! `(grid, block, the kernel's arguments)`, buffers as slices (bf16 as `u16`
//! bit patterns), `int`s as `i32`. It returns an error instead of hanging or
//! aborting when a kernel breaks a rule the emulator checks: a barrier that can
//! never complete (say, `__syncthreads` after some threads returned), an
//! unsupported shuffle mask, `__trap()`, an invalid launch configuration.
//!
//! # Buffers
//!
//! The kernel never sees the caller's slices: each is copied into a buffer
//! with 64 KiB of canary bytes (`0xff`, a NaN in f32 and bf16) on each side,
//! and outputs are copied back only after a successful launch whose canaries
//! are intact. A kernel that writes slightly out of bounds therefore gets an
//! error naming the buffer and element; one that reads out of bounds reads
//! NaN. The wrappers also check every slice's length against the kernel's
//! documented shape. A kernel whose indexing is wrong by more than the
//! canaries can still write anywhere, as on a GPU: these functions are for
//! tests of kernels under development, not for production use.

// The wrappers take the kernels' parameter lists.
#![allow(clippy::too_many_arguments)]

use std::ffi::{c_int, CStr};

use bytemuck::Pod;

/// A CUDA `dim3`: `(x, y, z)`.
pub type Dim3 = (u32, u32, u32);

// The other kernel families (matmul.cu's bias kernels, loss.cu, ...), a
// module per `.cu` file under src/gpt2/.
mod gpt2;
pub use gpt2::*;

#[rustfmt::skip]
mod ffi {
    use std::ffi::{c_char, c_int};

    extern "C" {
        pub fn emu_last_error() -> *const c_char;

        pub fn emu_selftest_block_sum(
            gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32,
            out: *mut f32, inp: *const f32, n: c_int,
        ) -> c_int;
        pub fn emu_selftest_warp_sum(
            gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32,
            out: *mut f32, inp: *const f32, n: c_int,
        ) -> c_int;
        pub fn emu_selftest_shuffles(
            gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32,
            out: *mut i32,
        ) -> c_int;
        pub fn emu_selftest_mma(
            gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32,
            d: *mut f32, a: *const u16, b: *const u16,
        ) -> c_int;
        pub fn emu_selftest_fault(
            gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32,
            out: *mut f32, mode: c_int,
        ) -> c_int;
    }

    /// `flash_attention_forward[_bf16](S* out, float* lse, const S* inp, int B,
    /// int T, int C, int NH, int block_k)`.
    pub type Forward<S> = unsafe extern "C" fn(
        u32, u32, u32, u32, u32, u32,
        *mut S, *mut f32, *const S, c_int, c_int, c_int, c_int, c_int,
    ) -> c_int;
    /// `flash_attention_delta[_bf16](float* delta, const S* dout, const S* out,
    /// int B, int T, int C, int NH)`.
    pub type Delta<S> = unsafe extern "C" fn(
        u32, u32, u32, u32, u32, u32,
        *mut f32, *const S, *const S, c_int, c_int, c_int, c_int,
    ) -> c_int;
    /// `flash_attention_backward_{dq,dkv}[_bf16](S* dinp, const float* delta,
    /// const S* dout, const S* inp, const float* lse, int B, int T, int C, int NH)`.
    pub type Backward<S> = unsafe extern "C" fn(
        u32, u32, u32, u32, u32, u32,
        *mut S, *const f32, *const S, *const S, *const f32, c_int, c_int, c_int, c_int,
    ) -> c_int;

    extern "C" {
        pub fn emu_flash_attention_forward(
            gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32,
            out: *mut f32, lse: *mut f32, inp: *const f32,
            b: c_int, t: c_int, c: c_int, nh: c_int, block_k: c_int,
        ) -> c_int;
        pub fn emu_flash_attention_forward_bf16(
            gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32,
            out: *mut u16, lse: *mut f32, inp: *const u16,
            b: c_int, t: c_int, c: c_int, nh: c_int, block_k: c_int,
        ) -> c_int;
        pub fn emu_flash_attention_tc_forward_bf16(
            gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32,
            out: *mut u16, lse: *mut f32, inp: *const u16,
            b: c_int, t: c_int, c: c_int, nh: c_int, block_k: c_int,
        ) -> c_int;
        pub fn emu_flash_attention_tc_backward_dq_bf16(
            gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32,
            dinp: *mut u16, delta: *const f32, dout: *const u16, inp: *const u16,
            lse: *const f32, b: c_int, t: c_int, c: c_int, nh: c_int,
        ) -> c_int;
        pub fn emu_flash_attention_tc_backward_dkv_bf16(
            gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32,
            dinp: *mut u16, delta: *const f32, dout: *const u16, inp: *const u16,
            lse: *const f32, b: c_int, t: c_int, c: c_int, nh: c_int,
        ) -> c_int;
        pub fn emu_flash_attention_delta(
            gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32,
            delta: *mut f32, dout: *const f32, out: *const f32,
            b: c_int, t: c_int, c: c_int, nh: c_int,
        ) -> c_int;
        pub fn emu_flash_attention_delta_bf16(
            gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32,
            delta: *mut f32, dout: *const u16, out: *const u16,
            b: c_int, t: c_int, c: c_int, nh: c_int,
        ) -> c_int;
        pub fn emu_flash_attention_backward_dq(
            gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32,
            dinp: *mut f32, delta: *const f32, dout: *const f32, inp: *const f32,
            lse: *const f32, b: c_int, t: c_int, c: c_int, nh: c_int,
        ) -> c_int;
        pub fn emu_flash_attention_backward_dq_bf16(
            gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32,
            dinp: *mut u16, delta: *const f32, dout: *const u16, inp: *const u16,
            lse: *const f32, b: c_int, t: c_int, c: c_int, nh: c_int,
        ) -> c_int;
        pub fn emu_flash_attention_backward_dkv(
            gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32,
            dinp: *mut f32, delta: *const f32, dout: *const f32, inp: *const f32,
            lse: *const f32, b: c_int, t: c_int, c: c_int, nh: c_int,
        ) -> c_int;
        pub fn emu_flash_attention_backward_dkv_bf16(
            gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32,
            dinp: *mut u16, delta: *const f32, dout: *const u16, inp: *const u16,
            lse: *const f32, b: c_int, t: c_int, c: c_int, nh: c_int,
        ) -> c_int;
    }
}

// ---------------------------------------------------------------------------
// Guarded buffers and launch results
// ---------------------------------------------------------------------------

/// Canary bytes on each side of every buffer a kernel gets.
const GUARD_BYTES: usize = 64 * 1024;
const CANARY: u8 = 0xff;

/// A kernel's copy of one argument slice, between two canary regions.
struct Guarded<'a> {
    name: &'static str,
    words: Vec<u64>, // u64 so the data (at GUARD_BYTES) is 8-byte aligned
    len: usize,      // bytes of data
    elem: usize,     // bytes of an element
    back: Option<&'a mut [u8]>,
}

impl<'a> Guarded<'a> {
    fn new(name: &'static str, data: &[u8], elem: usize) -> Self {
        let mut words = vec![u64::MAX; (2 * GUARD_BYTES + data.len()).div_ceil(8)];
        bytemuck::cast_slice_mut::<u64, u8>(&mut words)[GUARD_BYTES..][..data.len()]
            .copy_from_slice(data);
        Guarded {
            name,
            words,
            len: data.len(),
            elem,
            back: None,
        }
    }

    /// A copy of an input.
    fn input<T: Pod>(name: &'static str, s: &[T]) -> Self {
        Self::new(name, bytemuck::cast_slice(s), size_of::<T>())
    }

    /// A copy of an output (or input and output), copied back by [`finish`].
    fn output<T: Pod>(name: &'static str, s: &'a mut [T]) -> Self {
        let mut g = Self::new(name, bytemuck::cast_slice(s), size_of::<T>());
        g.back = Some(bytemuck::cast_slice_mut(s));
        g
    }

    /// The data's address, for the kernel. The pointer carries the whole
    /// allocation's provenance, so a kernel that strays into the canaries
    /// stays within memory it may touch.
    fn ptr<T>(&mut self) -> *mut T {
        self.words
            .as_mut_ptr()
            .cast::<u8>()
            .wrapping_add(GUARD_BYTES)
            .cast()
    }

    /// The first out-of-bounds write the canaries show, if any.
    fn check(&self, kernel: &str) -> Result<(), String> {
        let bytes: &[u8] = bytemuck::cast_slice(&self.words);
        let (before, rest) = bytes.split_at(GUARD_BYTES);
        let after = &rest[self.len..][..GUARD_BYTES];
        let (n, name) = (self.len / self.elem, self.name);
        if let Some(i) = before.iter().rposition(|&b| b != CANARY) {
            let e = (GUARD_BYTES - i).div_ceil(self.elem);
            return Err(format!(
                "{kernel}: wrote {name}[-{e}], before the start of its {n} elements"
            ));
        }
        if let Some(i) = after.iter().position(|&b| b != CANARY) {
            let e = n + i / self.elem;
            return Err(format!(
                "{kernel}: wrote {name}[{e}], past the end of its {n} elements"
            ));
        }
        Ok(())
    }
}

/// The calling thread's last launch error.
fn last_error() -> String {
    // SAFETY: emu_last_error returns a NUL-terminated string owned by the
    // calling thread's emulator state, unchanged until this thread's next
    // launch; it is copied here at once.
    unsafe { CStr::from_ptr(ffi::emu_last_error()) }
        .to_string_lossy()
        .into_owned()
}

/// A launch's result: the emulator's error if `rc` is non-zero, else the
/// first out-of-bounds write; outputs copied back only if there is neither.
fn finish(kernel: &str, rc: c_int, bufs: Vec<Guarded<'_>>) -> Result<(), String> {
    if rc != 0 {
        return Err(format!("{kernel}: {}", last_error()));
    }
    for b in &bufs {
        b.check(kernel)?;
    }
    for b in bufs {
        if let Some(dst) = b.back {
            dst.copy_from_slice(&bytemuck::cast_slice(&b.words)[GUARD_BYTES..][..b.len]);
        }
    }
    Ok(())
}

fn need(kernel: &str, name: &str, len: usize, want: usize) -> Result<(), String> {
    if len == want {
        Ok(())
    } else {
        Err(format!(
            "{kernel}: {name} has {len} elements, expected {want}"
        ))
    }
}

fn need_at_least(kernel: &str, name: &str, len: usize, want: usize) -> Result<(), String> {
    if len >= want {
        Ok(())
    } else {
        Err(format!(
            "{kernel}: {name} has {len} elements, expected at least {want}"
        ))
    }
}

fn product(kernel: &str, dims: &[usize]) -> Result<usize, String> {
    dims.iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .ok_or_else(|| format!("{kernel}: sizes overflow"))
}

fn nonneg(kernel: &str, x: i32) -> Result<usize, String> {
    usize::try_from(x).map_err(|_| format!("{kernel}: negative size {x}"))
}

/// Threads of a one-dimensional launch (the self-test kernels index by `.x`
/// only).
fn threads_1d(kernel: &str, grid: Dim3, block: Dim3) -> Result<usize, String> {
    if (grid.1, grid.2, block.1, block.2) != (1, 1, 1, 1) {
        return Err(format!(
            "{kernel}: expects a one-dimensional grid and block"
        ));
    }
    product(kernel, &[grid.0 as usize, block.0 as usize])
}

// ---------------------------------------------------------------------------
// selftest.cu
// ---------------------------------------------------------------------------

/// `selftest_block_sum`: `out[block]` = the sum of the block's elements of
/// `inp` (zero past `n`), by a shared-memory tree (selftest.cu). 1-D launch;
/// `out` has `grid.0` elements, `inp` at least `n`.
pub fn selftest_block_sum(
    grid: Dim3,
    block: Dim3,
    out: &mut [f32],
    inp: &[f32],
    n: i32,
) -> Result<(), String> {
    let k = "selftest_block_sum";
    threads_1d(k, grid, block)?;
    need(k, "out", out.len(), grid.0 as usize)?;
    need_at_least(k, "inp", inp.len(), nonneg(k, n)?)?;
    let (mut o, mut i) = (Guarded::output("out", out), Guarded::input("inp", inp));
    // SAFETY: selftest_block_sum(float* out, const float* in, int n) writes
    // out[blockIdx.x] and reads in[i] for i < n: lengths checked above.
    let rc = unsafe {
        ffi::emu_selftest_block_sum(
            grid.0,
            grid.1,
            grid.2,
            block.0,
            block.1,
            block.2,
            o.ptr(),
            i.ptr(),
            n,
        )
    };
    finish(k, rc, vec![o, i])
}

/// `selftest_warp_sum`: every thread's `out` element = its warp's sum of
/// `inp` (zero past `n`), by a `__shfl_xor_sync` butterfly. 1-D launch; `out`
/// has an element per thread, `inp` at least `n`.
pub fn selftest_warp_sum(
    grid: Dim3,
    block: Dim3,
    out: &mut [f32],
    inp: &[f32],
    n: i32,
) -> Result<(), String> {
    let k = "selftest_warp_sum";
    let threads = threads_1d(k, grid, block)?;
    need(k, "out", out.len(), threads)?;
    need_at_least(k, "inp", inp.len(), nonneg(k, n)?)?;
    let (mut o, mut i) = (Guarded::output("out", out), Guarded::input("inp", inp));
    // SAFETY: selftest_warp_sum(float* out, const float* in, int n) writes
    // out[thread] and reads in[i] for i < n: lengths checked above.
    let rc = unsafe {
        ffi::emu_selftest_warp_sum(
            grid.0,
            grid.1,
            grid.2,
            block.0,
            block.1,
            block.2,
            o.ptr(),
            i.ptr(),
            n,
        )
    };
    finish(k, rc, vec![o, i])
}

/// `selftest_shuffles`: twelve `i32` per thread, each shuffle and vote mode
/// on `v = 100 * warp + lane` (selftest.cu lists them). 1-D launch.
pub fn selftest_shuffles(grid: Dim3, block: Dim3, out: &mut [i32]) -> Result<(), String> {
    let k = "selftest_shuffles";
    let threads = threads_1d(k, grid, block)?;
    need(k, "out", out.len(), product(k, &[threads, 12])?)?;
    let mut o = Guarded::output("out", out);
    // SAFETY: selftest_shuffles(int* out) writes out[12 * thread ..][..12]:
    // length checked above.
    let rc = unsafe {
        ffi::emu_selftest_shuffles(grid.0, grid.1, grid.2, block.0, block.1, block.2, o.ptr())
    };
    finish(k, rc, vec![o])
}

/// `selftest_mma`: one `mma_bf16_16816` per warp `w`: `d[128 w..][..128]`
/// (16 × 8 f32, row-major) += `a[256 w..][..256]` (16 × 16 bf16, row-major)
/// times `b[128 w..][..128]` (16 × 8 bf16, k × n row-major). 1-D launch of
/// whole warps.
pub fn selftest_mma(
    grid: Dim3,
    block: Dim3,
    d: &mut [f32],
    a: &[u16],
    b: &[u16],
) -> Result<(), String> {
    let k = "selftest_mma";
    let threads = threads_1d(k, grid, block)?;
    if block.0 % 32 != 0 {
        return Err(format!("{k}: blockDim.x must be a multiple of 32"));
    }
    let warps = threads / 32;
    need(k, "d", d.len(), product(k, &[warps, 128])?)?;
    need(k, "a", a.len(), product(k, &[warps, 256])?)?;
    need(k, "b", b.len(), product(k, &[warps, 128])?)?;
    let (mut gd, mut ga, mut gb) = (
        Guarded::output("d", d),
        Guarded::input("a", a),
        Guarded::input("b", b),
    );
    // SAFETY: selftest_mma(float* d, const unsigned short* a, const unsigned
    // short* b) touches the 128, 256 and 128 elements of each warp: lengths
    // checked above.
    let rc = unsafe {
        ffi::emu_selftest_mma(
            grid.0,
            grid.1,
            grid.2,
            block.0,
            block.1,
            block.2,
            gd.ptr(),
            ga.ptr(),
            gb.ptr(),
        )
    };
    finish(k, rc, vec![gd, ga, gb])
}

/// `selftest_fault`: a kernel that breaks a barrier rule, by `mode`
/// (selftest.cu: 0 `__syncthreads` after an early return, 1 different
/// barriers in one warp, 2 a shuffle after a lane returned, 3 a partial
/// shuffle mask, 4 `__trap()`, 5 a shuffle past the end of a partial warp,
/// 6 and 7 a write one element past either end of `out`, 8 lanes of a warp
/// at different shuffles). Expected to fail;
/// `out` (an element per thread) is written if it does not.
pub fn selftest_fault(grid: Dim3, block: Dim3, out: &mut [f32], mode: i32) -> Result<(), String> {
    let k = "selftest_fault";
    let threads = threads_1d(k, grid, block)?;
    need(k, "out", out.len(), threads)?;
    let mut o = Guarded::output("out", out);
    // SAFETY: selftest_fault(float* out, int mode) writes out[thread], or
    // out[thread ± 1] (modes 6 and 7), one element into the canaries: length
    // checked above.
    let rc = unsafe {
        ffi::emu_selftest_fault(
            grid.0,
            grid.1,
            grid.2,
            block.0,
            block.1,
            block.2,
            o.ptr(),
            mode,
        )
    };
    finish(k, rc, vec![o])
}

// ---------------------------------------------------------------------------
// models/gpt2/src/kernels/flash_attention.cu
// ---------------------------------------------------------------------------

/// flash_attention.cu's largest head size (its per-thread arrays).
pub const FA_MAX_HS: usize = 128;

/// `(B·T·C, B·NH·T)` for flash_attention.cu's kernels, or why `(B, T, C, NH)`
/// is not a shape they take.
fn fa_shape(k: &str, b: i32, t: i32, c: i32, nh: i32) -> Result<(usize, usize), String> {
    let [b, t, c, nh] = [b, t, c, nh].map(|x| nonneg(k, x));
    let (b, t, c, nh) = (b?, t?, c?, nh?);
    if nh == 0 || c % nh != 0 || c / nh > FA_MAX_HS {
        return Err(format!(
            "{k}: C ({c}) must be NH ({nh}) heads of at most {FA_MAX_HS} channels"
        ));
    }
    Ok((product(k, &[b, t, c])?, product(k, &[b, nh, t])?))
}

fn fa_forward<S: Pod>(
    k: &str,
    f: ffi::Forward<S>,
    grid: Dim3,
    block: Dim3,
    out: &mut [S],
    lse: &mut [f32],
    inp: &[S],
    b: i32,
    t: i32,
    c: i32,
    nh: i32,
    block_k: i32,
) -> Result<(), String> {
    let (btc, bht) = fa_shape(k, b, t, c, nh)?;
    need(k, "out", out.len(), btc)?;
    need(k, "lse", lse.len(), bht)?;
    need(k, "inp", inp.len(), product(k, &[btc, 3])?)?;
    if block_k <= 0 {
        return Err(format!("{k}: block_k ({block_k}) must be positive"));
    }
    let (mut o, mut l, mut i) = (
        Guarded::output("out", out),
        Guarded::output("lse", lse),
        Guarded::input("inp", inp),
    );
    // SAFETY: `f` is flash_attention_forward[_bf16] (ffi::Forward); the
    // buffers have the (B, T, C), (B, NH, T) and (B, T, 3C) elements the
    // kernel indexes, with hs <= FA_MAX_HS (checked above).
    let rc = unsafe {
        f(
            grid.0,
            grid.1,
            grid.2,
            block.0,
            block.1,
            block.2,
            o.ptr(),
            l.ptr(),
            i.ptr(),
            b,
            t,
            c,
            nh,
            block_k,
        )
    };
    finish(k, rc, vec![o, l, i])
}

fn fa_delta<S: Pod>(
    k: &str,
    f: ffi::Delta<S>,
    grid: Dim3,
    block: Dim3,
    delta: &mut [f32],
    dout: &[S],
    out: &[S],
    b: i32,
    t: i32,
    c: i32,
    nh: i32,
) -> Result<(), String> {
    let (btc, bht) = fa_shape(k, b, t, c, nh)?;
    need(k, "delta", delta.len(), bht)?;
    need(k, "dout", dout.len(), btc)?;
    need(k, "out", out.len(), btc)?;
    let (mut d, mut go, mut o) = (
        Guarded::output("delta", delta),
        Guarded::input("dout", dout),
        Guarded::input("out", out),
    );
    // SAFETY: `f` is flash_attention_delta[_bf16] (ffi::Delta); the buffers
    // have the (B, NH, T), (B, T, C) and (B, T, C) elements the kernel
    // indexes (checked above).
    let rc = unsafe {
        f(
            grid.0,
            grid.1,
            grid.2,
            block.0,
            block.1,
            block.2,
            d.ptr(),
            go.ptr(),
            o.ptr(),
            b,
            t,
            c,
            nh,
        )
    };
    finish(k, rc, vec![d, go, o])
}

fn fa_backward<S: Pod>(
    k: &str,
    f: ffi::Backward<S>,
    grid: Dim3,
    block: Dim3,
    dinp: &mut [S],
    delta: &[f32],
    dout: &[S],
    inp: &[S],
    lse: &[f32],
    b: i32,
    t: i32,
    c: i32,
    nh: i32,
) -> Result<(), String> {
    let (btc, bht) = fa_shape(k, b, t, c, nh)?;
    let btc3 = product(k, &[btc, 3])?;
    need(k, "dinp", dinp.len(), btc3)?;
    need(k, "delta", delta.len(), bht)?;
    need(k, "dout", dout.len(), btc)?;
    need(k, "inp", inp.len(), btc3)?;
    need(k, "lse", lse.len(), bht)?;
    let (mut di, mut de, mut go, mut i, mut l) = (
        Guarded::output("dinp", dinp),
        Guarded::input("delta", delta),
        Guarded::input("dout", dout),
        Guarded::input("inp", inp),
        Guarded::input("lse", lse),
    );
    // SAFETY: `f` is flash_attention_backward_{dq,dkv}[_bf16]
    // (ffi::Backward); the buffers have the (B, T, 3C), (B, NH, T), (B, T, C),
    // (B, T, 3C) and (B, NH, T) elements the kernel indexes, with
    // hs <= FA_MAX_HS (checked above).
    let rc = unsafe {
        f(
            grid.0,
            grid.1,
            grid.2,
            block.0,
            block.1,
            block.2,
            di.ptr(),
            de.ptr(),
            go.ptr(),
            i.ptr(),
            l.ptr(),
            b,
            t,
            c,
            nh,
        )
    };
    finish(k, rc, vec![di, de, go, i, l])
}

/// `flash_attention_forward` (f32): `out` (B, T, C) and `lse` (B, NH, T) from
/// `inp` (B, T, 3C), online softmax over key tiles of `block_k`. The
/// launcher's configuration is grid `(ceil(T / 128), B·NH, 1)`, block
/// `(128, 1, 1)`.
pub fn flash_attention_forward(
    grid: Dim3,
    block: Dim3,
    out: &mut [f32],
    lse: &mut [f32],
    inp: &[f32],
    b: i32,
    t: i32,
    c: i32,
    nh: i32,
    block_k: i32,
) -> Result<(), String> {
    let f: ffi::Forward<f32> = ffi::emu_flash_attention_forward;
    fa_forward(
        "flash_attention_forward",
        f,
        grid,
        block,
        out,
        lse,
        inp,
        b,
        t,
        c,
        nh,
        block_k,
    )
}

/// [`flash_attention_forward`] with bf16 storage (`u16` bit patterns).
pub fn flash_attention_forward_bf16(
    grid: Dim3,
    block: Dim3,
    out: &mut [u16],
    lse: &mut [f32],
    inp: &[u16],
    b: i32,
    t: i32,
    c: i32,
    nh: i32,
    block_k: i32,
) -> Result<(), String> {
    let f: ffi::Forward<u16> = ffi::emu_flash_attention_forward_bf16;
    let k = "flash_attention_forward_bf16";
    fa_forward(k, f, grid, block, out, lse, inp, b, t, c, nh, block_k)
}

/// `flash_attention_delta` (f32): `delta` (B, NH, T) = per head
/// `rowsum(dout ∘ out)`. Launch as [`flash_attention_forward`].
pub fn flash_attention_delta(
    grid: Dim3,
    block: Dim3,
    delta: &mut [f32],
    dout: &[f32],
    out: &[f32],
    b: i32,
    t: i32,
    c: i32,
    nh: i32,
) -> Result<(), String> {
    let f: ffi::Delta<f32> = ffi::emu_flash_attention_delta;
    fa_delta(
        "flash_attention_delta",
        f,
        grid,
        block,
        delta,
        dout,
        out,
        b,
        t,
        c,
        nh,
    )
}

/// [`flash_attention_delta`] with bf16 storage.
pub fn flash_attention_delta_bf16(
    grid: Dim3,
    block: Dim3,
    delta: &mut [f32],
    dout: &[u16],
    out: &[u16],
    b: i32,
    t: i32,
    c: i32,
    nh: i32,
) -> Result<(), String> {
    let f: ffi::Delta<u16> = ffi::emu_flash_attention_delta_bf16;
    fa_delta(
        "flash_attention_delta_bf16",
        f,
        grid,
        block,
        delta,
        dout,
        out,
        b,
        t,
        c,
        nh,
    )
}

/// `flash_attention_backward_dq` (f32): adds dQ into the query channels of
/// `dinp` (B, T, 3C). Launch as [`flash_attention_forward`].
pub fn flash_attention_backward_dq(
    grid: Dim3,
    block: Dim3,
    dinp: &mut [f32],
    delta: &[f32],
    dout: &[f32],
    inp: &[f32],
    lse: &[f32],
    b: i32,
    t: i32,
    c: i32,
    nh: i32,
) -> Result<(), String> {
    let f: ffi::Backward<f32> = ffi::emu_flash_attention_backward_dq;
    let k = "flash_attention_backward_dq";
    fa_backward(k, f, grid, block, dinp, delta, dout, inp, lse, b, t, c, nh)
}

/// [`flash_attention_backward_dq`] with bf16 storage.
pub fn flash_attention_backward_dq_bf16(
    grid: Dim3,
    block: Dim3,
    dinp: &mut [u16],
    delta: &[f32],
    dout: &[u16],
    inp: &[u16],
    lse: &[f32],
    b: i32,
    t: i32,
    c: i32,
    nh: i32,
) -> Result<(), String> {
    let f: ffi::Backward<u16> = ffi::emu_flash_attention_backward_dq_bf16;
    let k = "flash_attention_backward_dq_bf16";
    fa_backward(k, f, grid, block, dinp, delta, dout, inp, lse, b, t, c, nh)
}

/// `flash_attention_backward_dkv` (f32): adds dK and dV into the key and
/// value channels of `dinp` (B, T, 3C). Launch as [`flash_attention_forward`].
pub fn flash_attention_backward_dkv(
    grid: Dim3,
    block: Dim3,
    dinp: &mut [f32],
    delta: &[f32],
    dout: &[f32],
    inp: &[f32],
    lse: &[f32],
    b: i32,
    t: i32,
    c: i32,
    nh: i32,
) -> Result<(), String> {
    let f: ffi::Backward<f32> = ffi::emu_flash_attention_backward_dkv;
    let k = "flash_attention_backward_dkv";
    fa_backward(k, f, grid, block, dinp, delta, dout, inp, lse, b, t, c, nh)
}

/// [`flash_attention_backward_dkv`] with bf16 storage.
pub fn flash_attention_backward_dkv_bf16(
    grid: Dim3,
    block: Dim3,
    dinp: &mut [u16],
    delta: &[f32],
    dout: &[u16],
    inp: &[u16],
    lse: &[f32],
    b: i32,
    t: i32,
    c: i32,
    nh: i32,
) -> Result<(), String> {
    let f: ffi::Backward<u16> = ffi::emu_flash_attention_backward_dkv_bf16;
    let k = "flash_attention_backward_dkv_bf16";
    fa_backward(k, f, grid, block, dinp, delta, dout, inp, lse, b, t, c, nh)
}

// ---------------------------------------------------------------------------
// flash_attention_tc.cu: the tensor-core kernels (bf16, head sizes 16, 32, 64)
// ---------------------------------------------------------------------------

/// The head sizes `flash_attention_tc.cu` has kernels for.
pub const TC_HEAD_SIZES: [i32; 3] = [16, 32, 64];

/// Refuses a head size without kernels (each indexes exactly its head
/// size's channels per head).
fn tc_shape(k: &str, c: i32, nh: i32) -> Result<(), String> {
    if nh <= 0 || c % nh != 0 || !TC_HEAD_SIZES.contains(&(c / nh)) {
        return Err(format!(
            "{k}: C ({c}) must be NH ({nh}) heads of 16, 32 or 64 channels"
        ));
    }
    Ok(())
}

/// `flash_attention_tc_forward_bf16`: as [`flash_attention_forward_bf16`]
/// on tensor cores. Launch: grid `(ceil(T / 64), B·NH, 1)`, block
/// `(128, 1, 1)`.
pub fn flash_attention_tc_forward_bf16(
    grid: Dim3,
    block: Dim3,
    out: &mut [u16],
    lse: &mut [f32],
    inp: &[u16],
    b: i32,
    t: i32,
    c: i32,
    nh: i32,
) -> Result<(), String> {
    let k = "flash_attention_tc_forward_bf16";
    tc_shape(k, c, nh)?;
    let f: ffi::Forward<u16> = ffi::emu_flash_attention_tc_forward_bf16;
    fa_forward(k, f, grid, block, out, lse, inp, b, t, c, nh, 64)
}

/// `flash_attention_tc_backward_dq_bf16`: as
/// [`flash_attention_backward_dq_bf16`] on tensor cores. Launch as
/// [`flash_attention_tc_forward_bf16`].
pub fn flash_attention_tc_backward_dq_bf16(
    grid: Dim3,
    block: Dim3,
    dinp: &mut [u16],
    delta: &[f32],
    dout: &[u16],
    inp: &[u16],
    lse: &[f32],
    b: i32,
    t: i32,
    c: i32,
    nh: i32,
) -> Result<(), String> {
    let k = "flash_attention_tc_backward_dq_bf16";
    tc_shape(k, c, nh)?;
    let f: ffi::Backward<u16> = ffi::emu_flash_attention_tc_backward_dq_bf16;
    fa_backward(k, f, grid, block, dinp, delta, dout, inp, lse, b, t, c, nh)
}

/// `flash_attention_tc_backward_dkv_bf16`: as
/// [`flash_attention_backward_dkv_bf16`] on tensor cores. Launch as
/// [`flash_attention_tc_forward_bf16`].
pub fn flash_attention_tc_backward_dkv_bf16(
    grid: Dim3,
    block: Dim3,
    dinp: &mut [u16],
    delta: &[f32],
    dout: &[u16],
    inp: &[u16],
    lse: &[f32],
    b: i32,
    t: i32,
    c: i32,
    nh: i32,
) -> Result<(), String> {
    let k = "flash_attention_tc_backward_dkv_bf16";
    tc_shape(k, c, nh)?;
    let f: ffi::Backward<u16> = ffi::emu_flash_attention_tc_backward_dkv_bf16;
    fa_backward(k, f, grid, block, dinp, delta, dout, inp, lse, b, t, c, nh)
}

// cuda_emu.h: the CUDA C++ subset that lets g++ (C++17) compile and run a
// kernel source on the CPU. Only for builds that define BRAID_KERNEL_EMU
// (tools/kernel-emu/build.rs); NVRTC never sees this file.
//
// Execution model (emu.cpp): braid_emu::launch runs the blocks of a grid one
// after another (x fastest, then y, then z). Within a block every thread is a
// fiber with its own stack; a cooperative round-robin scheduler resumes each
// runnable fiber, in thread order, until it waits at a barrier or returns.
// Nothing is preemptive, so the order is deterministic and a read-modify-write
// with no barrier inside it is atomic.
//
// Include this header first, then the .cu file; include no system header
// after it (it defines macros such as __expf that glibc's headers declare).
#pragma once

#ifndef BRAID_KERNEL_EMU
#error "cuda_emu.h is the kernel emulator's CUDA shim: compile with -DBRAID_KERNEL_EMU"
#endif

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>

// ---------------------------------------------------------------------------
// Qualifiers
// ---------------------------------------------------------------------------

#define __global__
#define __device__
#define __host__
#define __constant__
#define __forceinline__ inline
#define __launch_bounds__(...)
// Shared memory: a function-local (or file) static. Blocks run one after
// another, so one static is exactly one block's shared memory, seen by all of
// its threads. Its contents at block start are whatever the previous block
// left (zero for the first block of the process): like CUDA, a kernel must
// not rely on them. `extern __shared__` (dynamic shared memory) is not
// supported.
#define __shared__ static

// ---------------------------------------------------------------------------
// Built-in types and variables
// ---------------------------------------------------------------------------

struct uint3 {
    unsigned x, y, z;
};

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
    constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
    constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
};

constexpr int warpSize = 32;

namespace braid_emu {

// What a kernel sees of the thread running now.
struct Thread {
    uint3 thread_idx;
    unsigned linear;  // x + y * blockDim.x + z * blockDim.x * blockDim.y
    unsigned warp;    // linear / 32
    unsigned lane;    // linear % 32
};

// What a kernel sees of the launch and the block running now.
struct Grid {
    uint3 block_idx;
    dim3 block_dim;
    dim3 grid_dim;
};

namespace detail {
extern const Thread* current;  // the running fiber's thread (null outside a launch)
extern Grid grid;
}  // namespace detail

inline const Thread& cur() { return *detail::current; }
inline const Grid& grid() { return detail::grid; }

// ---------------------------------------------------------------------------
// Runtime (emu.cpp)
// ---------------------------------------------------------------------------

// Runs fn(arg) as every thread of every block of the grid. Returns 0, or 1
// with the reason in last_error(): an invalid configuration, a barrier that
// can never complete (deadlock), a warp-collective operation used outside
// what is supported, or __trap(). Launches from several OS threads are
// serialised; a launch from inside a kernel is an error.
int launch_raw(dim3 grid, dim3 block, void (*fn)(void*), void* arg);

// The calling OS thread's last launch error ("" if none).
const char* last_error();

// Runs `kernel_call()` (typically a lambda calling the kernel with its
// arguments) as every thread of the grid; 0 on success, as launch_raw.
template <class F>
int launch(dim3 grid, dim3 block, F&& kernel_call) {
    using Fn = std::remove_reference_t<F>;
    return launch_raw(
        grid, block, [](void* p) { (*static_cast<Fn*>(p))(); },
        const_cast<void*>(static_cast<const void*>(&kernel_call)));
}

// Ends the launch with an error naming the calling thread (never returns).
[[noreturn]] void fail(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

void sync_block();                          // __syncthreads
void sync_warp(unsigned mask, const char* who);  // __syncwarp
enum class Shfl { Idx, Up, Down, Bfly };
unsigned shfl_word(unsigned mask, unsigned v, Shfl mode, unsigned b, int width, const char* who);
unsigned ballot(unsigned mask, int pred, const char* who);
void mma_bf16_16816(float d[4], const unsigned a[4], const unsigned b[2]);
void ldmatrix_x4_trans(unsigned r[4], const void* row);
void ldmatrix_x4(unsigned r[4], const void* row);

template <class T>
T shfl(unsigned mask, T v, Shfl mode, unsigned b, int width, const char* who) {
    static_assert(std::is_arithmetic_v<T> && (sizeof(T) == 4 || sizeof(T) == 8),
                  "warp shuffles take 32- or 64-bit arithmetic values");
    unsigned w[sizeof(T) / 4];
    std::memcpy(w, &v, sizeof v);
    for (unsigned& x : w) x = shfl_word(mask, x, mode, b, width, who);
    std::memcpy(&v, w, sizeof v);
    return v;
}

}  // namespace braid_emu

#define threadIdx (::braid_emu::cur().thread_idx)
#define blockIdx (::braid_emu::grid().block_idx)
#define blockDim (::braid_emu::grid().block_dim)
#define gridDim (::braid_emu::grid().grid_dim)

// ---------------------------------------------------------------------------
// Barriers, warp collectives, tensor cores
// ---------------------------------------------------------------------------

// Every thread of the block must reach a __syncthreads (any one: call sites
// are not told apart); one that has returned never will, and that is
// reported as a deadlock.
inline void __syncthreads() { ::braid_emu::sync_block(); }
// Full mask only: every thread of the warp (warp = 32 consecutive linear
// thread ids; a partial last warp is its existing threads).
inline void __syncwarp(unsigned mask = 0xffffffffu) { ::braid_emu::sync_warp(mask, "__syncwarp"); }

// Shuffles, as PTX shfl.sync defines them (width a power of two <= 32).
// Warp-collective, full mask only; reading a lane that does not exist (a
// partial warp) is an error.
template <class T>
inline T __shfl_sync(unsigned mask, T var, int srcLane, int width = warpSize) {
    return ::braid_emu::shfl(mask, var, ::braid_emu::Shfl::Idx, (unsigned)srcLane, width,
                             "__shfl_sync");
}
template <class T>
inline T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = warpSize) {
    return ::braid_emu::shfl(mask, var, ::braid_emu::Shfl::Up, delta, width, "__shfl_up_sync");
}
template <class T>
inline T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = warpSize) {
    return ::braid_emu::shfl(mask, var, ::braid_emu::Shfl::Down, delta, width,
                             "__shfl_down_sync");
}
template <class T>
inline T __shfl_xor_sync(unsigned mask, T var, int laneMask, int width = warpSize) {
    return ::braid_emu::shfl(mask, var, ::braid_emu::Shfl::Bfly, (unsigned)laneMask, width,
                             "__shfl_xor_sync");
}
inline unsigned __ballot_sync(unsigned mask, int pred) {
    return ::braid_emu::ballot(mask, pred, "__ballot_sync");
}
inline int __any_sync(unsigned mask, int pred) {
    return ::braid_emu::ballot(mask, pred, "__any_sync") != 0;
}
inline int __all_sync(unsigned mask, int pred) {
    return ::braid_emu::ballot(mask, !pred, "__all_sync") == 0;
}

// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32: D += A * B for the
// calling warp, fragments in the PTX ISA's layout (g = lane >> 2, t = lane % 4;
// two bf16 per register, the lower-indexed in the low half):
//   a[0] = A[g][2t..2t+1]   a[1] = A[g+8][2t..2t+1]
//   a[2] = A[g][2t+8..2t+9] a[3] = A[g+8][2t+8..2t+9]
//   b[0] = B[2t..2t+1][g]   b[1] = B[2t+8..2t+9][g]
//   d = {D[g][2t], D[g][2t+1], D[g+8][2t], D[g+8][2t+1]}
// Emulated as d = (..((d + A[r][0] B[0][c]) + A[r][1] B[1][c]) + ..) in f32,
// k ascending (bf16 products are exact in f32); the hardware's summation
// order and internal precision differ.
inline void mma_bf16_16816(float d[4], const unsigned a[4], const unsigned b[2]) {
    ::braid_emu::mma_bf16_16816(d, a, b);
}

// ldmatrix_x4_trans(r, row): PTX `ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16`,
// warp-collective: lane l gives the address of row l % 8 of 8 x 8 matrix
// l / 8 (16-byte aligned, 8 consecutive b16 elements), and receives in r[i]
// matrix i read column-major: with g = lane / 4, t = lane % 4,
//   r[i] = {M_i[2t][g], M_i[2t+1][g]}   (the lower row in the low half)
// which is an mma B fragment register when M_i's rows are k and columns n.
inline void ldmatrix_x4_trans(unsigned r[4], const void* row) {
    ::braid_emu::ldmatrix_x4_trans(r, row);
}

// ldmatrix_x4(r, row): the same without .trans, each matrix read row-major:
//   r[i] = {M_i[g][2t], M_i[g][2t+1]}
// an mma B register when M_i's rows are n and columns k.
inline void ldmatrix_x4(unsigned r[4], const void* row) { ::braid_emu::ldmatrix_x4(r, row); }

// ---------------------------------------------------------------------------
// Memory, atomics, fences, __trap
// ---------------------------------------------------------------------------

template <class T>
inline T __ldg(const T* p) { return *p; }

inline void __threadfence() {}
inline void __threadfence_block() {}
[[noreturn]] inline void __trap() { ::braid_emu::fail("__trap()"); }

// Atomic because fibers are never preempted.
#define BRAID_EMU_ATOMIC(name, T, expr) \
    inline T name(T* p, T v) {           \
        const T old = *p;                \
        *p = (expr);                     \
        return old;                      \
    }
BRAID_EMU_ATOMIC(atomicAdd, int, old + v)
BRAID_EMU_ATOMIC(atomicAdd, unsigned, old + v)
BRAID_EMU_ATOMIC(atomicAdd, unsigned long long, old + v)
BRAID_EMU_ATOMIC(atomicAdd, float, old + v)
BRAID_EMU_ATOMIC(atomicAdd, double, old + v)
BRAID_EMU_ATOMIC(atomicMax, int, old > v ? old : v)
BRAID_EMU_ATOMIC(atomicMax, unsigned, old > v ? old : v)
BRAID_EMU_ATOMIC(atomicMin, int, old < v ? old : v)
BRAID_EMU_ATOMIC(atomicMin, unsigned, old < v ? old : v)
BRAID_EMU_ATOMIC(atomicExch, int, v)
BRAID_EMU_ATOMIC(atomicExch, unsigned, v)
BRAID_EMU_ATOMIC(atomicExch, float, v)
#undef BRAID_EMU_ATOMIC

template <class T>
inline T atomicCAS(T* p, T compare, T v) {
    const T old = *p;
    if (old == compare) *p = v;
    return old;
}

// ---------------------------------------------------------------------------
// Math. expf, exp2f, logf, log2f, sqrtf, fmaxf, fminf, fabsf, fmaf, ... are
// the C library's (<cmath>), correctly rounded or within an ulp, where
// CUDA's are within 1-2 ulp: results may differ in the last bit or two.
// ---------------------------------------------------------------------------

// CUDA declares the classification functions in the global namespace (for
// float and double); <cmath> puts them in std only.
using std::isfinite;
using std::isinf;
using std::isnan;

inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
// The _rn forms: one IEEE operation, round to nearest, never contracted (the
// emulator is built with -ffp-contract=off, so a * b + c is never fused either).
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __frcp_rn(float a) { return 1.0f / a; }
inline float __fsqrt_rn(float a) { return sqrtf(a); }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }

// The approximate (fast-math) intrinsics, computed as the hardware does
// (ex2/lg2 of a scaled argument) but with exact exp2f/log2f rather than the
// approximate units, so their error is smaller than on a GPU. glibc declares
// __expf and friends itself, hence the macros.
namespace braid_emu {
inline float fast_expf(float x) { return exp2f(x * 1.44269504f); }
inline float fast_logf(float x) { return log2f(x) * 0.693147181f; }
inline float fast_log2f(float x) { return log2f(x); }
inline float fast_powf(float x, float y) { return exp2f(y * log2f(x)); }
// CUDA: x * (1 / y); 0 (NaN for an infinite x) for 2^126 < |y| < 2^128.
inline float fast_fdividef(float x, float y) {
    const float ay = fabsf(y);
    return ay > 0x1p126f && ay <= 0x1.fffffep127f ? x * 0.0f : x * (1.0f / y);
}
}  // namespace braid_emu
#define __expf ::braid_emu::fast_expf
#define __logf ::braid_emu::fast_logf
#define __log2f ::braid_emu::fast_log2f
#define __powf ::braid_emu::fast_powf
#define __fdividef ::braid_emu::fast_fdividef
inline float __saturatef(float x) { return x > 1.0f ? 1.0f : (x > 0.0f ? x : 0.0f); }

inline float __int_as_float(int x) {
    float f;
    std::memcpy(&f, &x, 4);
    return f;
}
inline int __float_as_int(float f) {
    int x;
    std::memcpy(&x, &f, 4);
    return x;
}
inline float __uint_as_float(unsigned x) {
    float f;
    std::memcpy(&f, &x, 4);
    return f;
}
inline unsigned __float_as_uint(float f) {
    unsigned x;
    std::memcpy(&x, &f, 4);
    return x;
}

// CUDA's integer (and float) min/max overloads; a signed-unsigned mix
// compares as unsigned, as in CUDA.
#define BRAID_EMU_MINMAX(T, A, B)                                \
    inline T min(A a, B b) { return (T)a < (T)b ? (T)a : (T)b; } \
    inline T max(A a, B b) { return (T)a > (T)b ? (T)a : (T)b; }
BRAID_EMU_MINMAX(int, int, int)
BRAID_EMU_MINMAX(unsigned, unsigned, unsigned)
BRAID_EMU_MINMAX(long, long, long)
BRAID_EMU_MINMAX(unsigned long, unsigned long, unsigned long)
BRAID_EMU_MINMAX(long long, long long, long long)
BRAID_EMU_MINMAX(unsigned long long, unsigned long long, unsigned long long)
BRAID_EMU_MINMAX(unsigned, int, unsigned)
BRAID_EMU_MINMAX(unsigned, unsigned, int)
BRAID_EMU_MINMAX(unsigned long long, long long, unsigned long long)
BRAID_EMU_MINMAX(unsigned long long, unsigned long long, long long)
#undef BRAID_EMU_MINMAX
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }
inline double min(double a, double b) { return fmin(a, b); }
inline double max(double a, double b) { return fmax(a, b); }

// ---------------------------------------------------------------------------
// Kernels for Rust. A kernels_*.cpp file exports each kernel with one line,
//   BRAID_EMU_EXPORT(NAME)
// which registers NAME, under its own name, with a launcher generated from
// its signature. Rust launches it with emu_launch (emu.cpp): the name, the
// parameter types it passes (spelled as ParamType spells them), the grid and
// block, and one pointer per argument at a value of that type (as
// cuLaunchKernel's kernelParams). emu_launch refuses a name that is not
// registered, or parameter types other than the kernel's, before reading any
// argument; 0 on success, else the message is emu_last_error()'s.
// ---------------------------------------------------------------------------

namespace braid_emu {

// The spelling of each type a kernel parameter may have: the Rust side
// (src/launch.rs, Arg::c_type) spells its arguments' types the same way. A
// kernel with a parameter of any other type does not compile here.
template <class T>
struct ParamType;
#define BRAID_EMU_PARAM_TYPE(T)                   \
    template <>                                   \
    struct ParamType<T> {                         \
        static std::string name() { return #T; } \
    };
BRAID_EMU_PARAM_TYPE(int)
BRAID_EMU_PARAM_TYPE(long long)
BRAID_EMU_PARAM_TYPE(unsigned)
BRAID_EMU_PARAM_TYPE(unsigned short)  // also bf16_t (bf16.cuh)
BRAID_EMU_PARAM_TYPE(float)
BRAID_EMU_PARAM_TYPE(double)
#undef BRAID_EMU_PARAM_TYPE
template <class T>
struct ParamType<T*> {
    static std::string name() { return ParamType<T>::name() + "*"; }
};
template <class T>
struct ParamType<const T*> {
    static std::string name() { return "const " + ParamType<T>::name() + "*"; }
};

// A kernel's parameter types, ", "-separated.
template <class... A>
std::string param_types(void (*)(A...)) {
    std::string s;
    ((s += (s.empty() ? "" : ", ") + ParamType<A>::name()), ...);
    return s;
}

// Launches kernel(*(const A0*)args[0], *(const A1*)args[1], ...).
template <class... A, size_t... I>
int launch_packed(void (*kernel)(A...), dim3 grid, dim3 block, const void* const* args,
                  std::index_sequence<I...>) {
    return launch(grid, block, [&] { kernel(*static_cast<const A*>(args[I])...); });
}
template <class... A>
int launch_packed(void (*kernel)(A...), dim3 grid, dim3 block, const void* const* args) {
    return launch_packed(kernel, grid, block, args, std::index_sequence_for<A...>{});
}

using PackedLaunch = int (*)(dim3 grid, dim3 block, const void* const* args);

// Adds a kernel to emu_launch's registry (emu.cpp): its parameters' types
// and number, and `launch`, which runs it with arguments as launch_packed
// reads them. Returns true.
bool register_kernel(const char* name, std::string param_types, int arity, PackedLaunch launch);
template <class... A>
bool register_kernel(const char* name, void (*kernel)(A...), PackedLaunch launch) {
    return register_kernel(name, param_types(kernel), int(sizeof...(A)), launch);
}

}  // namespace braid_emu

#define BRAID_EMU_EXPORT(kernel)                                                    \
    [[maybe_unused]] static const bool braid_emu_exported_##kernel =                  \
        ::braid_emu::register_kernel(#kernel, kernel,                                 \
                                     [](dim3 grid, dim3 block, const void* const* a) { \
                                         return ::braid_emu::launch_packed(kernel,      \
                                                                           grid, block, \
                                                                           a);          \
                                     });

extern "C" int emu_launch(const char* kernel, const char* param_types, int nargs,
                          const void* const* args, unsigned gx, unsigned gy, unsigned gz,
                          unsigned bx, unsigned by, unsigned bz, int reverse);
extern "C" const char* emu_last_error();

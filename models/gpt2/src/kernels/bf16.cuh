// bf16.cuh: the bf16 load/store helpers every `_bf16` kernel includes
// (`#include "bf16.cuh"`). NVRTC reads no files: the runtime
// (kernels/cuda_common.rs, HEADERS) and tools/nvrtc-check hand it this header
// with each program.
#pragma once

// bfloat16 storage without cuda_bf16.h: an element is the upper 16 bits of an
// IEEE f32, held as unsigned short. Loading is exact; storing rounds to
// nearest, ties to even, and keeps a NaN a quiet NaN, bit for bit as
// Bf16::from_f32 in core/src/comm/mod.rs (the CPU kernels' Storage::store).
typedef unsigned short bf16_t;

__device__ __forceinline__ float bf16_load(bf16_t h) {
    return __uint_as_float(((unsigned int)h) << 16);
}

__device__ __forceinline__ bf16_t bf16_store(float x) {
    const unsigned int bits = __float_as_uint(x);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((bits >> 16) | 0x0040u);
    const unsigned int round = 0x7fffu + ((bits >> 16) & 1u);
    return (bf16_t)((bits + round) >> 16);
}

// Load and store for code written once over the storage type S (f32 or
// bf16): arithmetic in f32, one rounding as a bf16 element is stored; the
// f32 overloads are plain loads and stores.
__device__ __forceinline__ float ld_f32(float x) { return x; }
__device__ __forceinline__ float ld_f32(bf16_t x) { return bf16_load(x); }
__device__ __forceinline__ void st_f32(float* p, float x) { *p = x; }
__device__ __forceinline__ void st_f32(bf16_t* p, float x) { *p = bf16_store(x); }

// Eight bf16 elements, one 16-byte load or store (`p` 16-byte aligned: the
// callers check, with aligned16; under emulation a misaligned one traps).
// Held as four 32-bit words, element e the low half of word e / 2 for even
// e, the high half for odd e (as memory holds them, little-endian): NVRTC
// keeps a row of these in fewer registers than eight 16-bit elements (64
// against 96 for the layer norm's backward).
struct alignas(16) bf16x8 {
    unsigned int w[4];
};

// Element e, widened to f32 (exact).
__device__ __forceinline__ float bf16x8_get(const bf16x8& x, int e) {
    const unsigned int w = x.w[e >> 1];
    return __uint_as_float((e & 1) ? (w & 0xffff0000u) : (w << 16));
}

// Element e set to h.
__device__ __forceinline__ void bf16x8_set(bf16x8& x, int e, bf16_t h) {
    unsigned int& w = x.w[e >> 1];
    w = (e & 1) ? ((w & 0x0000ffffu) | ((unsigned int)h << 16)) : ((w & 0xffff0000u) | h);
}

// Whether p is 16-byte aligned.
__device__ __forceinline__ bool aligned16(const void* p) {
    return ((unsigned long long)p & 15ull) == 0;
}

__device__ __forceinline__ bf16x8 bf16x8_load(const bf16_t* p) {
    bf16x8 x;
#ifdef BRAID_KERNEL_EMU
    if (!aligned16(p)) __trap();
    memcpy(&x, p, sizeof x);
#else
    x = *reinterpret_cast<const bf16x8*>(p);
#endif
    return x;
}

__device__ __forceinline__ void bf16x8_store(bf16_t* p, const bf16x8& x) {
#ifdef BRAID_KERNEL_EMU
    if (!aligned16(p)) __trap();
    memcpy(p, &x, sizeof x);
#else
    *reinterpret_cast<bf16x8*>(p) = x;
#endif
}

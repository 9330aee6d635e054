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

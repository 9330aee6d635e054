// selftest.cu: kernels that exercise the emulator (tests/selftest.rs): a
// block reduction through shared memory and __syncthreads, warp shuffles and
// votes, the bf16 tensor-core MMA, and kernels that break the barrier rules.
// Genuine CUDA (NVRTC, sm_80 or later for the MMA); under the emulator
// (BRAID_KERNEL_EMU) cuda_emu.h supplies the MMA and ldmatrix functions of
// mma.cuh.
//
// All launches are one-dimensional: grid (n, 1, 1), block (m, 1, 1).

#define ST_MAX_THREADS 1024
#define ST_FULL 0xffffffffu

#include "mma.cuh"  // mma_bf16_16816, ldmatrix_x4[_trans] (cuda/kernels)

// out[block] = the sum of the block's elements of in (0 past n), by a tree
// over the next power of two of blockDim.x: at stride s (halving from half
// that power), thread i < s adds element i + s if it exists.
extern "C" __global__ void selftest_block_sum(float* out, const float* in, int n) {
    __shared__ float sh[ST_MAX_THREADS];
    const unsigned tid = threadIdx.x;
    const unsigned i = blockIdx.x * blockDim.x + tid;
    sh[tid] = i < (unsigned)n ? in[i] : 0.0f;
    __syncthreads();
    unsigned n2 = 1;
    while (n2 < blockDim.x) n2 <<= 1;
    for (unsigned s = n2 / 2; s > 0; s >>= 1) {
        if (tid < s && tid + s < blockDim.x) sh[tid] = sh[tid] + sh[tid + s];
        __syncthreads();
    }
    if (tid == 0) out[blockIdx.x] = sh[0];
}

// out[i] = the warp's sum of in (0 past n), by a butterfly: at offsets 16, 8,
// .., 1 each lane adds its partner's value (v = v + v[lane ^ offset]).
extern "C" __global__ void selftest_warp_sum(float* out, const float* in, int n) {
    const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    float v = i < (unsigned)n ? in[i] : 0.0f;
    for (int off = 16; off > 0; off >>= 1) v = v + __shfl_xor_sync(ST_FULL, v, off);
    out[i] = v;
}

// Twelve results per thread of the shuffles and votes in every mode, on
// v = 100 * (global warp) + lane.
extern "C" __global__ void selftest_shuffles(int* out) {
    const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    const int lane = (int)(threadIdx.x % 32);
    const int v = 100 * (int)(i / 32) + lane;
    int* o = out + 12 * i;
    o[0] = __shfl_sync(ST_FULL, v, 7);
    o[1] = __shfl_sync(ST_FULL, v, lane + 5, 16);
    o[2] = __shfl_xor_sync(ST_FULL, v, 5);
    o[3] = __shfl_xor_sync(ST_FULL, v, 12, 8);
    o[4] = __shfl_down_sync(ST_FULL, v, 3);
    o[5] = __shfl_down_sync(ST_FULL, v, 3, 8);
    o[6] = __shfl_up_sync(ST_FULL, v, 2, 16);
    o[7] = (int)__shfl_sync(ST_FULL, 3u * (unsigned)v, 31 - lane);
    o[8] = (int)__shfl_down_sync(ST_FULL, 0.5f * (float)v, 1);
    __syncwarp();
    o[9] = (int)__ballot_sync(ST_FULL, lane % 3 == 0);
    o[10] = __any_sync(ST_FULL, lane == 17);
    o[11] = __all_sync(ST_FULL, lane < 31);
}

static __device__ __forceinline__ unsigned st_pack(unsigned short lo, unsigned short hi) {
    return (unsigned)lo | ((unsigned)hi << 16);
}

// One m16n8k16 MMA per warp: warp w adds A_w (16 x 16 bf16, row-major, at
// a + 256 w) times B_w (16 x 8 bf16, k x n row-major, at b + 128 w) to D_w
// (16 x 8 f32, row-major, at d + 128 w), in place. blockDim.x % 32 == 0.
extern "C" __global__ void selftest_mma(float* d, const unsigned short* a,
                                        const unsigned short* b) {
    const unsigned w = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
    const unsigned lane = threadIdx.x % 32, g = lane >> 2, t = lane % 4;
    const unsigned short* A = a + 256 * w;
    const unsigned short* B = b + 128 * w;
    float* D = d + 128 * w;
    const unsigned af[4] = {
        st_pack(A[g * 16 + 2 * t], A[g * 16 + 2 * t + 1]),
        st_pack(A[(g + 8) * 16 + 2 * t], A[(g + 8) * 16 + 2 * t + 1]),
        st_pack(A[g * 16 + 2 * t + 8], A[g * 16 + 2 * t + 9]),
        st_pack(A[(g + 8) * 16 + 2 * t + 8], A[(g + 8) * 16 + 2 * t + 9]),
    };
    const unsigned bf[2] = {
        st_pack(B[(2 * t) * 8 + g], B[(2 * t + 1) * 8 + g]),
        st_pack(B[(2 * t + 8) * 8 + g], B[(2 * t + 9) * 8 + g]),
    };
    float df[4] = {D[g * 8 + 2 * t], D[g * 8 + 2 * t + 1], D[(g + 8) * 8 + 2 * t],
                   D[(g + 8) * 8 + 2 * t + 1]};
    mma_bf16_16816(df, af, bf);
    D[g * 8 + 2 * t] = df[0];
    D[g * 8 + 2 * t + 1] = df[1];
    D[(g + 8) * 8 + 2 * t] = df[2];
    D[(g + 8) * 8 + 2 * t + 1] = df[3];
}

// D = A B for one warp, B's fragments from ldmatrix .x4: A 16 x 16 bf16 and
// B 16 x 16 bf16 (k x n), row-major, at a and b; D 16 x 16 f32, row-major,
// at d, from zero. One block of 32 threads. With trans, B is staged as it
// is and lane l gives the address of B row l % 16, columns (l / 16) * 8 on:
// matrices 0, 1 are k rows 0-7, 8-15 of column tile 0, matrices 2, 3 those
// of tile 1 (flash_attention_tc.cu's P V pattern). Without, Bᵀ (n x k) is
// staged and lane l gives Bᵀ row (l / 16) * 8 + l % 8, columns
// ((l / 8) % 2) * 8 on: matrices 0, 1 are k 0-7, 8-15 of tile 0, 2, 3 of
// tile 1 (its Q Kᵀ pattern, with one k step).
extern "C" __global__ void selftest_ldmatrix_mma(float* d, const unsigned short* a,
                                                 const unsigned short* b, int trans) {
    alignas(16) __shared__ unsigned short sh[16 * 16];
    const unsigned lane = threadIdx.x, g = lane >> 2, t = lane % 4;
    for (unsigned i = lane; i < 256; i += 32) sh[trans ? i : (i % 16) * 16 + i / 16] = b[i];
    __syncwarp();
    const unsigned af[4] = {
        st_pack(a[g * 16 + 2 * t], a[g * 16 + 2 * t + 1]),
        st_pack(a[(g + 8) * 16 + 2 * t], a[(g + 8) * 16 + 2 * t + 1]),
        st_pack(a[g * 16 + 2 * t + 8], a[g * 16 + 2 * t + 9]),
        st_pack(a[(g + 8) * 16 + 2 * t + 8], a[(g + 8) * 16 + 2 * t + 9]),
    };
    unsigned bf[4];
    if (trans)
        ldmatrix_x4_trans(bf, sh + (lane % 16) * 16 + (lane / 16) * 8);
    else
        ldmatrix_x4(bf, sh + ((lane / 16) * 8 + lane % 8) * 16 + ((lane / 8) % 2) * 8);
    for (unsigned n0 = 0; n0 < 2; n0++) {
        float df[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        mma_bf16_16816(df, af, bf + 2 * n0);
        const unsigned c = n0 * 8 + 2 * t;
        d[g * 16 + c] = df[0];
        d[g * 16 + c + 1] = df[1];
        d[(g + 8) * 16 + c] = df[2];
        d[(g + 8) * 16 + c + 1] = df[3];
    }
}

// Kernels that break a rule, by mode; the emulator reports each (a GPU may
// hang or do anything): 0, __syncthreads after thread 0 returned; 1, lanes of
// one warp at different barriers; 2, a shuffle after lane 5 returned; 3, a
// shuffle with a partial mask; 4, __trap in thread 3; 5, a shuffle reading
// past the end of a partial warp (launch with blockDim.x % 32 == 16); 8,
// lanes of one warp at different shuffles. And two that break no rule but
// write out of bounds, which the Rust wrappers' canaries catch: 6, every
// thread writes one element too far; 7, one too early. And a race, which the
// Rust launcher's second run (blocks and threads in the opposite order)
// catches: 9, each thread reads the shared slot another thread writes,
// without a __syncthreads between.
extern "C" __global__ void selftest_fault(float* out, int mode) {
    __shared__ float sh[ST_MAX_THREADS];
    const unsigned lane = threadIdx.x % 32;
    float v = (float)threadIdx.x;
    switch (mode) {
        case 0:
            if (threadIdx.x == 0) return;
            __syncthreads();
            break;
        case 1:
            if (lane & 1)
                __syncwarp();
            else
                __syncthreads();
            break;
        case 2:
            if (lane == 5) return;
            v = __shfl_xor_sync(ST_FULL, v, 1);
            break;
        case 3:
            v = __shfl_xor_sync(0x0000ffffu, v, 1);
            break;
        case 4:
            if (threadIdx.x == 3) __trap();
            break;
        case 5:
            v = __shfl_xor_sync(ST_FULL, v, 16);
            break;
        case 8:
            if (lane & 1)
                v = __shfl_down_sync(ST_FULL, v, 1);
            else
                v = __shfl_xor_sync(ST_FULL, v, 1);
            break;
        case 9:
            sh[threadIdx.x] = (float)(blockIdx.x * blockDim.x + threadIdx.x);
            v = sh[blockDim.x - 1 - threadIdx.x];
            break;
    }
    const int shift = mode == 6 ? 1 : (mode == 7 ? -1 : 0);
    out[(int)(blockIdx.x * blockDim.x + threadIdx.x) + shift] = v;
}

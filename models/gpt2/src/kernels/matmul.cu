// Bias parts of GPT-2's linear layers (the products themselves go through
// cuBLAS: out = inp · Wᵀ, see cuda/src/cublas.rs).
// Semantics: models/gpt2/src/kernels/matmul.rs. Deterministic, no atomics.

// Rows of the (N, OC) side are ld >= OC elements apart (ld = OC: dense);
// columns OC..ld are neither read nor written.

#include "bf16.cuh"  // bf16_t, bf16_load, bf16_store, ld_f32, st_f32

// Row lanes of the bias gradient: BIAS_GRAD_LANES in matmul.rs (the CPU
// kernel sums in the same order).
#define BIAS_GRAD_LANES 32

// dbias[o] += sum_n dout[n, o], f32 or bf16 storage. A block owns 32
// channels, one per lane; warp w sums rows w, w + W, w + 2W, ... in order
// (W = BIAS_GRAD_LANES; coalesced across the lanes' channels), from 0, in
// f32; then dbias[o] (loaded) plus the W partial sums in warp order, rounded
// once. The CPU kernel (matmul_backward_weight_ld) adds in exactly this
// order, so the two agree bit for bit. (One thread per channel walking all N
// rows, the kernel before: 768 threads busy for about 0.4 ms per call at
// N = 8192, 20 ms of task time in a GPT-2 124M bf16 step on the H200, run 5.)
template <typename S>
static __device__ __forceinline__ void bias_grad(S* __restrict__ dbias, const S* __restrict__ dout,
                                                 int N, int OC, int ld) {
    __shared__ float part[BIAS_GRAD_LANES][32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int o = blockIdx.x * 32 + lane;
    float acc = 0.0f;
    if (o < OC) {
        for (int n = warp; n < N; n += BIAS_GRAD_LANES) acc += ld_f32(dout[(long long)n * ld + o]);
    }
    part[warp][lane] = acc;
    __syncthreads();
    if (warp == 0 && o < OC) {
        float sum = ld_f32(dbias[o]);
        for (int w = 0; w < BIAS_GRAD_LANES; w++) sum += part[w][lane];
        st_f32(&dbias[o], sum);
    }
}

// out[n, o] = bias[o]  (broadcast, so a following cuBLAS product with beta = 1
// computes bias + inp · Wᵀ in the CPU kernel's order)
//   out (N, ld), bias (OC); N = B*T
// Launch: grid ceil(N*OC / block), block 256.
extern "C" __global__ void bias_broadcast(float* __restrict__ out, const float* __restrict__ bias,
                                          int N, int OC, int ld) {
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)N * OC) return;
    const long long o = idx % OC;
    out[(idx / OC) * ld + o] = bias[o];
}

// dbias[o] += sum_n dout[n, o] (bias_grad, above).
//   dbias (OC), dout (N, ld)
// Launch: grid ceil(OC / 32), block 32 * BIAS_GRAD_LANES.
extern "C" __global__ void bias_backward(float* __restrict__ dbias, const float* __restrict__ dout,
                                         int N, int OC, int ld) {
    bias_grad(dbias, dout, N, OC, ld);
}

// out[n, o] = bias[o], bf16 (a copy: exact), so that the following cuBLAS bf16
// product with beta = 1 loads it, adds inp · W^T in f32 and rounds once, as
// matmul_forward::<Bf16> does.
// Launch: grid ceil(N*OC / block), block 256.
extern "C" __global__ void bias_broadcast_bf16(bf16_t* __restrict__ out,
                                               const bf16_t* __restrict__ bias, int N, int OC,
                                               int ld) {
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)N * OC) return;
    const long long o = idx % OC;
    out[(idx / OC) * ld + o] = bias[o];
}

// bias_backward on bf16 storage: each dout widened, the same f32 sums,
// dbias loaded and rounded once (matmul_backward_weight::<Bf16>'s dbias;
// bit-exact). Launch: as bias_backward.
extern "C" __global__ void bias_backward_bf16(bf16_t* __restrict__ dbias,
                                              const bf16_t* __restrict__ dout, int N, int OC,
                                              int ld) {
    bias_grad(dbias, dout, N, OC, ld);
}

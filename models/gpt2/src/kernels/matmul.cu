// Bias parts of GPT-2's linear layers (the products themselves go through
// cuBLAS: out = inp · Wᵀ, see cuda/src/cublas.rs).
// Semantics: models/gpt2/src/kernels/matmul.rs. Deterministic, no atomics.

// Rows of the (N, OC) side are ld >= OC elements apart (ld = OC: dense);
// columns OC..ld are neither read nor written.

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

// dbias[o] += sum_n dout[n, o], rows in order.
//   dbias (OC), dout (N, ld)
// Launch: one thread per output channel: grid ceil(OC / 128), block 128.
extern "C" __global__ void bias_backward(float* __restrict__ dbias, const float* __restrict__ dout,
                                         int N, int OC, int ld) {
    const int o = blockIdx.x * blockDim.x + threadIdx.x;
    if (o >= OC) return;
    float acc = dbias[o];
#pragma unroll 4
    for (int n = 0; n < N; n++) {
        acc += dout[(long long)n * ld + o];
    }
    dbias[o] = acc;
}

#include "bf16.cuh"  // bf16_t, bf16_load, bf16_store

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

// dbias[o] += sum_n dout[n, o], bf16: dbias loaded, the rows added in f32 in
// order, rounded once (matmul_backward_weight::<Bf16>'s dbias; bit-exact).
// Launch: one thread per output channel: grid ceil(OC / 128), block 128.
extern "C" __global__ void bias_backward_bf16(bf16_t* __restrict__ dbias,
                                              const bf16_t* __restrict__ dout, int N, int OC,
                                              int ld) {
    const int o = blockIdx.x * blockDim.x + threadIdx.x;
    if (o >= OC) return;
    float acc = bf16_load(dbias[o]);
    for (int n = 0; n < N; n++) {
        acc += bf16_load(dout[(long long)n * ld + o]);
    }
    dbias[o] = bf16_store(acc);
}

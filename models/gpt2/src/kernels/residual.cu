// Residual connection (fp32). Semantics: models/gpt2/src/kernels/residual.rs.

// out[i] = inp1[i] + inp2[i]
// Launch: grid ceil(N / block), block 256.
extern "C" __global__ void residual_forward(float* __restrict__ out, const float* __restrict__ inp1,
                                            const float* __restrict__ inp2, long long N) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < N) out[i] = inp1[i] + inp2[i];
}

// dinp1[i] += dout[i]; dinp2[i] += dout[i]   (dinp1 and dinp2 must not alias;
// dinp2 may be null: dinp1 += dout alone, residual.rs's `accumulate`)
// Launch: grid ceil(N / block), block 256.
extern "C" __global__ void residual_backward(float* __restrict__ dinp1, float* __restrict__ dinp2,
                                             const float* __restrict__ dout, long long N) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < N) {
        const float g = dout[i];
        dinp1[i] += g;
        if (dinp2 != nullptr) dinp2[i] += g;
    }
}

#include "bf16.cuh"  // bf16_t, bf16_load, bf16_store

// out[i] = inp1[i] + inp2[i], bf16 storage: the f32 sum rounded once
// (residual_forward::<Bf16>; bit-exact with it).
// Launch: grid ceil(N / block), block 256.
extern "C" __global__ void residual_forward_bf16(bf16_t* __restrict__ out,
                                                 const bf16_t* __restrict__ inp1,
                                                 const bf16_t* __restrict__ inp2, long long N) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < N) out[i] = bf16_store(bf16_load(inp1[i]) + bf16_load(inp2[i]));
}

// dinp1[i] += dout[i]; dinp2[i] += dout[i], bf16 storage: each gradient
// loaded, added in f32, rounded once (residual_backward::<Bf16>; bit-exact).
// dinp2 may be null, as in residual_backward.
// Launch: grid ceil(N / block), block 256.
extern "C" __global__ void residual_backward_bf16(bf16_t* __restrict__ dinp1,
                                                  bf16_t* __restrict__ dinp2,
                                                  const bf16_t* __restrict__ dout, long long N) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < N) {
        const float g = bf16_load(dout[i]);
        dinp1[i] = bf16_store(bf16_load(dinp1[i]) + g);
        if (dinp2 != nullptr) dinp2[i] = bf16_store(bf16_load(dinp2[i]) + g);
    }
}

// Residual connection (fp32). Semantics: models/gpt2/src/kernels/residual.rs.

// out[i] = inp1[i] + inp2[i]
// Launch: grid ceil(N / block), block 256.
extern "C" __global__ void residual_forward(float* __restrict__ out, const float* __restrict__ inp1,
                                            const float* __restrict__ inp2, long long N) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < N) out[i] = inp1[i] + inp2[i];
}

// dinp1[i] += dout[i]; dinp2[i] += dout[i]   (dinp1 and dinp2 must not alias)
// Launch: grid ceil(N / block), block 256.
extern "C" __global__ void residual_backward(float* __restrict__ dinp1, float* __restrict__ dinp2,
                                             const float* __restrict__ dout, long long N) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < N) {
        const float g = dout[i];
        dinp1[i] += g;
        dinp2[i] += g;
    }
}

// BEGIN bf16 helpers (verbatim copy of models/gpt2/src/kernels/bf16.cuh)
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
// END bf16 helpers

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
// Launch: grid ceil(N / block), block 256.
extern "C" __global__ void residual_backward_bf16(bf16_t* __restrict__ dinp1,
                                                  bf16_t* __restrict__ dinp2,
                                                  const bf16_t* __restrict__ dout, long long N) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < N) {
        const float g = bf16_load(dout[i]);
        dinp1[i] = bf16_store(bf16_load(dinp1[i]) + g);
        dinp2[i] = bf16_store(bf16_load(dinp2[i]) + g);
    }
}

// GELU, tanh approximation, forward and backward (fp32).
// Semantics: models/gpt2/src/kernels/gelu.rs (same constants, same order).

#define GELU_SCALING_FACTOR 0.7978846f  // sqrt(2 / pi)
#define GELU_CUBIC 0.044715f

// out[i] = 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))
//   out (N), inp (N)
// Launch: grid ceil(N / block), block 256.
extern "C" __global__ void gelu_forward(float* __restrict__ out, const float* __restrict__ inp,
                                        long long N) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= N) return;
    const float x = inp[i];
    const float cube = GELU_CUBIC * x * x * x;
    out[i] = 0.5f * x * (1.0f + tanhf(GELU_SCALING_FACTOR * (x + cube)));
}

// dinp[i] += gelu'(inp[i]) * dout[i]; with accumulate 0, dinp is not read
// and the product is added to 0 (the bits a zeroed dinp would give).
//   dinp (N), inp (N), dout (N)
// Launch: grid ceil(N / block), block 256.
extern "C" __global__ void gelu_backward(float* __restrict__ dinp, const float* __restrict__ inp,
                                         const float* __restrict__ dout, long long N,
                                         int accumulate) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= N) return;
    const float x = inp[i];
    const float cube = GELU_CUBIC * x * x * x;
    const float tanh_out = tanhf(GELU_SCALING_FACTOR * (x + cube));
    const float sech2 = 1.0f - tanh_out * tanh_out;
    const float local_grad = 0.5f * (1.0f + tanh_out) +
                             x * 0.5f * sech2 * GELU_SCALING_FACTOR * (1.0f + 3.0f * GELU_CUBIC * x * x);
    dinp[i] = (accumulate ? dinp[i] : 0.0f) + local_grad * dout[i];
}

#include "bf16.cuh"  // bf16_t, bf16_load, bf16_store, bf16x8, aligned16

// bf16 storage, f32 arithmetic, one rounding on store; the same operations in
// the same order as gelu_forward::<Bf16> in gelu.rs. __fmul_rn/__fadd_rn keep
// NVRTC from contracting a multiply and an add into one FMA (the CPU rounds
// each). tanhf is CUDA's, not the CPU's libm: the f32 result may differ in its
// last bit, so the stored bf16 may differ by one bf16 ulp where that bit
// decides the rounding.
static __device__ __forceinline__ float gelu_bf16_value(float x) {
    const float cube = __fmul_rn(__fmul_rn(__fmul_rn(GELU_CUBIC, x), x), x);
    const float t = tanhf(__fmul_rn(GELU_SCALING_FACTOR, __fadd_rn(x, cube)));
    return __fmul_rn(__fmul_rn(0.5f, x), __fadd_rn(1.0f, t));
}

// gelu'(x), in gelu_backward::<Bf16>'s order.
static __device__ __forceinline__ float gelu_bf16_grad(float x) {
    const float cube = __fmul_rn(__fmul_rn(__fmul_rn(GELU_CUBIC, x), x), x);
    const float tanh_out = tanhf(__fmul_rn(GELU_SCALING_FACTOR, __fadd_rn(x, cube)));
    const float sech2 = __fadd_rn(1.0f, -__fmul_rn(tanh_out, tanh_out));
    // 0.5 * (1 + tanh_out)
    const float left = __fmul_rn(0.5f, __fadd_rn(1.0f, tanh_out));
    // x * 0.5 * sech2 * S * (1 + 3 * C * x * x), left to right
    const float poly =
        __fadd_rn(1.0f, __fmul_rn(__fmul_rn(__fmul_rn(3.0f, GELU_CUBIC), x), x));
    const float right = __fmul_rn(
        __fmul_rn(__fmul_rn(__fmul_rn(x, 0.5f), sech2), GELU_SCALING_FACTOR), poly);
    return __fadd_rn(left, right);
}

// The bf16 kernels give each thread GELU_PER consecutive elements: one
// 16-byte load per operand where every pointer is 16-byte aligned and the
// eight are in range, element by element otherwise (the same arithmetic, so
// the same bits either way).
#define GELU_PER 8

//   out (N), inp (N)
// Launch: grid ceil(N / (8 * block)), block 256.
extern "C" __global__ void gelu_forward_bf16(bf16_t* __restrict__ out,
                                             const bf16_t* __restrict__ inp, long long N) {
    const long long i0 = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * GELU_PER;
    if (i0 >= N) return;
    if (i0 + GELU_PER <= N && aligned16(out) && aligned16(inp)) {
        const bf16x8 x = bf16x8_load(inp + i0);
        bf16x8 y = {};
#pragma unroll
        for (int e = 0; e < GELU_PER; e++) {
            bf16x8_set(y, e, bf16_store(gelu_bf16_value(bf16x8_get(x, e))));
        }
        bf16x8_store(out + i0, y);
    } else {
        for (long long i = i0; i < N && i < i0 + GELU_PER; i++)
            out[i] = bf16_store(gelu_bf16_value(bf16_load(inp[i])));
    }
}

// dinp[i] += gelu'(inp[i]) * dout[i], bf16 storage: dinp loaded (0 with
// accumulate 0, not read), the product added in f32, rounded once
// (gelu_backward::<Bf16>). Same caveats as gelu_forward_bf16.
//   dinp (N), inp (N), dout (N)
// Launch: grid ceil(N / (8 * block)), block 256.
extern "C" __global__ void gelu_backward_bf16(bf16_t* __restrict__ dinp,
                                              const bf16_t* __restrict__ inp,
                                              const bf16_t* __restrict__ dout, long long N,
                                              int accumulate) {
    const long long i0 = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * GELU_PER;
    if (i0 >= N) return;
    if (i0 + GELU_PER <= N && aligned16(dinp) && aligned16(inp) && aligned16(dout)) {
        const bf16x8 x = bf16x8_load(inp + i0);
        const bf16x8 g = bf16x8_load(dout + i0);
        bf16x8 d = {};  // bf16 zeros
        if (accumulate) d = bf16x8_load(dinp + i0);
#pragma unroll
        for (int e = 0; e < GELU_PER; e++) {
            const float grad = __fmul_rn(gelu_bf16_grad(bf16x8_get(x, e)), bf16x8_get(g, e));
            bf16x8_set(d, e, bf16_store(__fadd_rn(bf16x8_get(d, e), grad)));
        }
        bf16x8_store(dinp + i0, d);
    } else {
        for (long long i = i0; i < N && i < i0 + GELU_PER; i++) {
            const float grad = __fmul_rn(gelu_bf16_grad(bf16_load(inp[i])), bf16_load(dout[i]));
            const float base = accumulate ? bf16_load(dinp[i]) : 0.0f;
            dinp[i] = bf16_store(__fadd_rn(base, grad));
        }
    }
}

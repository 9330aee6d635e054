// Gradient-norm clipping: the squared L2 norm (double accumulation), the clip
// factor, and scaling. Semantics: models/gpt2/src/kernels/norm.rs.
// Deterministic: the norm is reduced in a fixed tree over a fixed grid (use
// the same grid size every step).

static __device__ __forceinline__ double warp_sum_d(double v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Sum of each thread's s over the block (blockDim.x a multiple of 32), in a
// fixed tree: warp butterflies, then warp 0 over the per-warp partials. The
// result is valid in thread 0 only. Every thread of the block must call it.
static __device__ __forceinline__ double block_sum_d(double s) {
    __shared__ double scratch[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    s = warp_sum_d(s);
    if (lane == 0) scratch[warp] = s;
    __syncthreads();
    if (warp == 0) {
        s = (lane < warps) ? scratch[lane] : 0.0;
        s = warp_sum_d(s);
    }
    return s;
}

// Stage 1 of the squared L2 norm: partials[blockIdx.x] = sum of g^2 over the
// elements this block visits (grid-stride), in double.
//   partials (gridDim.x), grads (N)
// Launch: a FIXED grid (e.g. 2 * number of SMs, at most 1024), block 512.
extern "C" __global__ void grad_norm_sq_partial(double* __restrict__ partials,
                                                const float* __restrict__ grads, long long N) {
    double s = 0.0;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < N; i += stride) {
        const double g = (double)grads[i];
        s += g * g;
    }
    s = block_sum_d(s);
    if (threadIdx.x == 0) partials[blockIdx.x] = s;
}

// Stage 2: out[0] = sum of partials[0..P] (fixed order per thread, fixed tree).
//   out (1), partials (P)
// Launch: grid 1, block 1024.
extern "C" __global__ void grad_norm_sq_finalize(double* __restrict__ out,
                                                 const double* __restrict__ partials, int P) {
    double s = 0.0;
    for (int i = threadIdx.x; i < P; i += blockDim.x) s += partials[i];
    s = block_sum_d(s);
    if (threadIdx.x == 0) out[0] = s;
}

// scale[0] = min(1, max_norm / (sqrt(sum_k norm_sq[k]) + 1e-6)); 1 when the norm
// is not finite (as torch.nn.utils.clip_grad_norm_ computes the coefficient).
// norm_sq holds K partial squared norms (per bucket, or per rank after an
// all-reduce), summed in order. Keeps clipping on the device: no host sync.
// Launch: grid 1, block 1.
extern "C" __global__ void grad_clip_scale(float* __restrict__ scale,
                                           const double* __restrict__ norm_sq, int K,
                                           float max_norm) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    double total = 0.0;
    for (int k = 0; k < K; k++) total += norm_sq[k];
    const double norm = sqrt(total);
    float s = 1.0f;
    if (isfinite(norm)) {
        const double coef = (double)max_norm / (norm + 1e-6);
        s = (float)(coef < 1.0 ? coef : 1.0);
    }
    scale[0] = s;
}

// x[i] *= s (host scalar)
// Launch: grid ceil(N / block), block 256.
extern "C" __global__ void scale_inplace(float* __restrict__ x, long long N, float s) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < N) x[i] *= s;
}

// x[i] *= s[0] (device scalar, e.g. from grad_clip_scale)
// Launch: grid ceil(N / block), block 256.
extern "C" __global__ void scale_inplace_dev(float* __restrict__ x, long long N,
                                             const float* __restrict__ s) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < N) x[i] *= s[0];
}

#include "bf16.cuh"  // bf16_t, bf16_load, bf16_store

// grad_norm_sq_partial with bf16 gradients: each loaded exactly, squared and
// summed in double in the same fixed order as grad_norm_sq_partial.
//   partials (gridDim.x), grads (N)
// Launch: a FIXED grid (e.g. 2 * number of SMs, at most 1024), block 512.
extern "C" __global__ void grad_norm_sq_partial_bf16(double* __restrict__ partials,
                                                     const bf16_t* __restrict__ grads,
                                                     long long N) {
    double s = 0.0;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < N; i += stride) {
        const double g = (double)bf16_load(grads[i]);
        s += g * g;
    }
    s = block_sum_d(s);
    if (threadIdx.x == 0) partials[blockIdx.x] = s;
}

// x[i] = round(x[i] * s), bf16 storage, f32 product rounded once
// (scale_in_place::<Bf16>; bit-exact with it).
// Launch: grid ceil(N / block), block 256.
extern "C" __global__ void scale_inplace_bf16(bf16_t* __restrict__ x, long long N, float s) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < N) x[i] = bf16_store(bf16_load(x[i]) * s);
}

// x[i] = round(x[i] * s[0]), bf16 storage (device scalar).
// Launch: grid ceil(N / block), block 256.
extern "C" __global__ void scale_inplace_dev_bf16(bf16_t* __restrict__ x, long long N,
                                                  const float* __restrict__ s) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < N) x[i] = bf16_store(bf16_load(x[i]) * s[0]);
}

// AdamW with torch.optim.AdamW semantics (fp32 parameters and moments).
// Semantics: models/gpt2/src/kernels/adamw.rs.

// One AdamW step for step number t (1-based). The host computes, in double as
// the CPU kernel does, then rounds to float:
//   step_size      = lr / (1 - beta1^t)
//   bc2_sqrt       = sqrt(1 - beta2^t)
//   decay          = 1 - lr * weight_decay
// and per element:
//   g  = grads[i] * (*grad_scale)        (grad_scale may be null: 1)
//   p  = p * decay
//   m  = beta1 * m + (1 - beta1) * g
//   v  = beta2 * v + (1 - beta2) * g * g
//   p -= step_size * m / (sqrt(v) / bc2_sqrt + eps)
// When `scalars` is not null, step_size, bc2_sqrt and decay are read from
// scalars[0..3] instead (written there by an earlier task: a recorded step
// replayed with each step's values, adamw.rs "Step scalars").
//   params, grads, m, v (N), scalars (3) or null
// Launch: grid ceil(N / block), block 256.
extern "C" __global__ void adamw_update(float* __restrict__ params, const float* __restrict__ grads,
                                        float* __restrict__ m, float* __restrict__ v,
                                        const float* __restrict__ grad_scale, long long N,
                                        float step_size, float bc2_sqrt, float beta1, float beta2,
                                        float eps, float decay,
                                        const float* __restrict__ scalars) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= N) return;
    if (scalars != nullptr) {
        step_size = scalars[0];
        bc2_sqrt = scalars[1];
        decay = scalars[2];
    }
    float g = grads[i];
    if (grad_scale != nullptr) g *= grad_scale[0];
    float p = params[i] * decay;
    const float mi = beta1 * m[i] + (1.0f - beta1) * g;
    const float vi = beta2 * v[i] + (1.0f - beta2) * g * g;
    const float denom = sqrtf(vi) / bc2_sqrt + eps;
    p -= step_size * mi / denom;
    m[i] = mi;
    v[i] = vi;
    params[i] = p;
}

#include "bf16.cuh"  // bf16_t, bf16_load, bf16_store

// Mixed-precision AdamW (adamw_update_mixed in adamw.rs, llm.c's
// adamw_kernel3): one adamw_update step of the f32 master weights from the
// stored gradients (times *grad_scale when given), then params = master
// rounded to the storage type. The arithmetic is the CPU's, operation by
// operation: __fmul_rn/__fadd_rn/__fdiv_rn keep NVRTC from contracting into
// FMAs, sqrtf is correctly rounded (no --use_fast_math), so every result is
// the CPU's bit for bit. `scalars` as for adamw_update.
//   params (N) stored weights, overwritten; master, m, v (N) f32; grads (N),
//   scalars (3) or null
// Launch: grid ceil(N / (4 * block)), block 256 (four elements a thread).
static __device__ __forceinline__ float mixed_load(float x) { return x; }
static __device__ __forceinline__ float mixed_load(bf16_t x) { return bf16_load(x); }
static __device__ __forceinline__ void mixed_store(float* d, float x) { *d = x; }
static __device__ __forceinline__ void mixed_store(bf16_t* d, float x) { *d = bf16_store(x); }

// Four elements of T, one vector load or store (16 bytes of f32, 8 of bf16).
template <typename T>
struct alignas(4 * sizeof(T)) adamw_vec4 {
    T v[4];
};

template <typename T>
static __device__ __forceinline__ bool adamw_aligned(const T* p) {
    return ((unsigned long long)p & (4ull * sizeof(T) - 1ull)) == 0ull;
}

// One element's update: master, m and v in place; returns the new master.
static __device__ __forceinline__ float adamw_mixed_one(float g, float& master, float& m, float& v,
                                                        const float* __restrict__ grad_scale,
                                                        float step_size, float bc2_sqrt,
                                                        float beta1, float beta2, float eps,
                                                        float decay) {
    if (grad_scale != nullptr) g = __fmul_rn(g, grad_scale[0]);
    float p = __fmul_rn(master, decay);
    const float mi = __fadd_rn(__fmul_rn(beta1, m), __fmul_rn(__fadd_rn(1.0f, -beta1), g));
    const float vi =
        __fadd_rn(__fmul_rn(beta2, v), __fmul_rn(__fmul_rn(__fadd_rn(1.0f, -beta2), g), g));
    const float denom = __fadd_rn(__fdiv_rn(sqrtf(vi), bc2_sqrt), eps);
    p = __fadd_rn(p, -__fdiv_rn(__fmul_rn(step_size, mi), denom));
    m = mi;
    v = vi;
    master = p;
    return p;
}

// Each thread updates ADAMW_PER consecutive elements: one vector load and
// store per array where every pointer is aligned for it and the four are in
// range, element by element otherwise (the same arithmetic, the same bits).
#define ADAMW_PER 4

template <typename S>
static __device__ __forceinline__ void adamw_mixed(S* __restrict__ params,
                                                   float* __restrict__ master,
                                                   const S* __restrict__ grads,
                                                   float* __restrict__ m, float* __restrict__ v,
                                                   const float* __restrict__ grad_scale,
                                                   long long N, float step_size, float bc2_sqrt,
                                                   float beta1, float beta2, float eps,
                                                   float decay,
                                                   const float* __restrict__ scalars) {
    const long long i0 = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * ADAMW_PER;
    if (i0 >= N) return;
    if (scalars != nullptr) {
        step_size = scalars[0];
        bc2_sqrt = scalars[1];
        decay = scalars[2];
    }
    if (i0 + ADAMW_PER <= N && adamw_aligned(params) && adamw_aligned(master) &&
        adamw_aligned(grads) && adamw_aligned(m) && adamw_aligned(v)) {
        const adamw_vec4<S> g = *reinterpret_cast<const adamw_vec4<S>*>(grads + i0);
        adamw_vec4<float> w = *reinterpret_cast<const adamw_vec4<float>*>(master + i0);
        adamw_vec4<float> mv = *reinterpret_cast<const adamw_vec4<float>*>(m + i0);
        adamw_vec4<float> vv = *reinterpret_cast<const adamw_vec4<float>*>(v + i0);
        adamw_vec4<S> out;
#pragma unroll
        for (int e = 0; e < ADAMW_PER; e++) {
            const float p = adamw_mixed_one(mixed_load(g.v[e]), w.v[e], mv.v[e], vv.v[e],
                                            grad_scale, step_size, bc2_sqrt, beta1, beta2, eps,
                                            decay);
            mixed_store(&out.v[e], p);
        }
        *reinterpret_cast<adamw_vec4<float>*>(master + i0) = w;
        *reinterpret_cast<adamw_vec4<float>*>(m + i0) = mv;
        *reinterpret_cast<adamw_vec4<float>*>(v + i0) = vv;
        *reinterpret_cast<adamw_vec4<S>*>(params + i0) = out;
    } else {
        for (long long i = i0; i < N && i < i0 + ADAMW_PER; i++) {
            const float p = adamw_mixed_one(mixed_load(grads[i]), master[i], m[i], v[i],
                                            grad_scale, step_size, bc2_sqrt, beta1, beta2, eps,
                                            decay);
            mixed_store(&params[i], p);
        }
    }
}

extern "C" __global__ void adamw_update_mixed_f32(float* __restrict__ params,
                                                  float* __restrict__ master,
                                                  const float* __restrict__ grads,
                                                  float* __restrict__ m, float* __restrict__ v,
                                                  const float* __restrict__ grad_scale,
                                                  long long N, float step_size, float bc2_sqrt,
                                                  float beta1, float beta2, float eps,
                                                  float decay,
                                                  const float* __restrict__ scalars) {
    adamw_mixed(params, master, grads, m, v, grad_scale, N, step_size, bc2_sqrt, beta1, beta2,
                eps, decay, scalars);
}

extern "C" __global__ void adamw_update_mixed_bf16(bf16_t* __restrict__ params,
                                                   float* __restrict__ master,
                                                   const bf16_t* __restrict__ grads,
                                                   float* __restrict__ m, float* __restrict__ v,
                                                   const float* __restrict__ grad_scale,
                                                   long long N, float step_size, float bc2_sqrt,
                                                   float beta1, float beta2, float eps,
                                                   float decay,
                                                   const float* __restrict__ scalars) {
    adamw_mixed(params, master, grads, m, v, grad_scale, N, step_size, bc2_sqrt, beta1, beta2,
                eps, decay, scalars);
}

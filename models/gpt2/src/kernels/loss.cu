// Softmax over the vocabulary fused with the cross-entropy loss, its backward,
// and the mean loss (fp32). Semantics: models/gpt2/src/kernels/loss.rs.
// Block reductions use a fixed tree (warp butterflies, then one warp over the
// per-warp partials): deterministic.

#define NEG_INF __int_as_float(0xff800000)

static __device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

static __device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

static __device__ __forceinline__ double warp_sum_d(double v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Block-wide reductions; blockDim.x must be a multiple of 32 (<= 1024).
// Every thread gets the result. `scratch` holds 32 floats of shared memory.
static __device__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();  // scratch may still be read by a previous reduction
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = (lane < warps) ? scratch[lane] : 0.0f;
    return warp_sum(v);
}

static __device__ float block_max(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = (lane < warps) ? scratch[lane] : NEG_INF;
    return warp_max(v);
}

// probs[n, :] = softmax(logits[n, :]) (row max subtracted first) and, when
// `losses` and `targets` are not null, losses[n] = -log(probs[n, targets[n]]).
//   probs (N, V), losses (N) or null, logits (N, V), targets (N) ids < V or null
// Launch: one block per row: grid N, block 1024 (any multiple of 32).
extern "C" __global__ void softmax_crossentropy_forward(float* __restrict__ probs,
                                                        float* __restrict__ losses,
                                                        const float* __restrict__ logits,
                                                        const unsigned int* __restrict__ targets,
                                                        int N, int V) {
    __shared__ float scratch[32];
    const int row = blockIdx.x;
    if (row >= N) return;  // uniform for the whole block
    const float* x = logits + (long long)row * V;
    float* p = probs + (long long)row * V;
    float mx = NEG_INF;
    for (int i = threadIdx.x; i < V; i += blockDim.x) mx = fmaxf(mx, x[i]);
    mx = block_max(mx, scratch);
    float s = 0.0f;
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
        const float e = expf(x[i] - mx);
        p[i] = e;
        s += e;
    }
    const float inv = 1.0f / block_sum(s, scratch);
    for (int i = threadIdx.x; i < V; i += blockDim.x) p[i] *= inv;
    if (losses != nullptr && targets != nullptr) {
        __syncthreads();  // makes every thread's probs writes visible to thread 0
        if (threadIdx.x == 0) losses[row] = -logf(p[targets[row]]);
    }
}

// dlogits[n, i] += probs[n, i] * d, then dlogits[n, targets[n]] -= d, with
// d = dloss / (B*T) computed by the caller (dloss = 1, or 1/accumulation steps).
//   dlogits (N, V), probs (N, V), targets (N)
// Launch: grid ceil(N*V / block), block 256.
extern "C" __global__ void crossentropy_softmax_backward(float* __restrict__ dlogits,
                                                         const float* __restrict__ probs,
                                                         const unsigned int* __restrict__ targets,
                                                         float d, int N, int V) {
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)N * V) return;
    const long long row = idx / V;
    const unsigned int i = (unsigned int)(idx % V);
    float g = dlogits[idx] + probs[idx] * d;
    if (i == targets[row]) g -= d;
    dlogits[idx] = g;
}

// out[0] = mean(losses[0..N]), accumulated in double.
//   out (1), losses (N)
// Launch: grid 1, block 1024 (any multiple of 32).
extern "C" __global__ void loss_mean(float* __restrict__ out, const float* __restrict__ losses,
                                     int N) {
    __shared__ double scratch[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    double s = 0.0;
    for (int i = threadIdx.x; i < N; i += blockDim.x) s += (double)losses[i];
    s = warp_sum_d(s);
    if (lane == 0) scratch[warp] = s;
    __syncthreads();
    if (warp == 0) {
        s = (lane < warps) ? scratch[lane] : 0.0;
        s = warp_sum_d(s);
        if (lane == 0) out[0] = (float)(s / (double)N);
    }
}

#include "bf16.cuh"  // bf16_t, bf16_load, bf16_store

// Block-wide double sum in a fixed tree, as block_sum; every thread gets it.
static __device__ double block_sum_d(double v, double* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_sum_d(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = (lane < warps) ? scratch[lane] : 0.0;
    return warp_sum_d(v);
}

// softmax_crossentropy_forward with bf16 probs and logits (softmax_row and
// softmax_crossentropy_forward::<Bf16> in loss.rs): the row max in f32, each
// exp in f32 summed in double (the CPU's f64 sum, in a tree order), inv =
// (float)(1 / sum), p = e * inv in f32 and rounded once on store; the loss
// (f32) is -log of the target's f32 probability before rounding, as on the
// CPU. The exp is recomputed in the last pass instead of being kept in probs
// (a bf16 slot cannot hold it). expf and logf are CUDA's, not the CPU's
// libm: a probability may differ by one bf16 ulp, a loss in its last bits.
//   probs (N, V), losses (N) or null, logits (N, V), targets (N) ids < V or null
// Launch: one block per row: grid N, block 1024 (any multiple of 32).
extern "C" __global__ void softmax_crossentropy_forward_bf16(
    bf16_t* __restrict__ probs, float* __restrict__ losses, const bf16_t* __restrict__ logits,
    const unsigned int* __restrict__ targets, int N, int V) {
    __shared__ float scratch[32];
    __shared__ double scratch_d[32];
    const int row = blockIdx.x;
    if (row >= N) return;  // uniform for the whole block
    const bf16_t* x = logits + (long long)row * V;
    bf16_t* p = probs + (long long)row * V;
    float mx = NEG_INF;
    for (int i = threadIdx.x; i < V; i += blockDim.x) mx = fmaxf(mx, bf16_load(x[i]));
    mx = block_max(mx, scratch);
    double s = 0.0;
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
        s += (double)expf(__fadd_rn(bf16_load(x[i]), -mx));
    }
    const float inv = (float)(1.0 / block_sum_d(s, scratch_d));
    const bool loss = losses != nullptr && targets != nullptr;
    const unsigned int tgt = loss ? targets[row] : 0u;
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
        const float pi = __fmul_rn(expf(__fadd_rn(bf16_load(x[i]), -mx)), inv);
        p[i] = bf16_store(pi);
        if (loss && (unsigned int)i == tgt) losses[row] = -logf(pi);
    }
}

// crossentropy_softmax_backward with bf16 dlogits and probs: each element
// loaded, p * d added in f32, the target's - d after it, rounded once
// (crossentropy_softmax_backward::<Bf16>; bit-exact with it).
//   dlogits (N, V), probs (N, V), targets (N)
// Launch: grid ceil(N*V / block), block 256.
extern "C" __global__ void crossentropy_softmax_backward_bf16(
    bf16_t* __restrict__ dlogits, const bf16_t* __restrict__ probs,
    const unsigned int* __restrict__ targets, float d, int N, int V) {
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)N * V) return;
    const long long row = idx / V;
    const unsigned int i = (unsigned int)(idx % V);
    float g = __fadd_rn(bf16_load(dlogits[idx]), __fmul_rn(bf16_load(probs[idx]), d));
    if (i == targets[row]) g = __fadd_rn(g, -d);
    dlogits[idx] = bf16_store(g);
}

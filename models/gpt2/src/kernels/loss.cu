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

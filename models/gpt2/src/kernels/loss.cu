// Softmax over the vocabulary fused with the cross-entropy loss, its backward,
// and the mean loss (fp32). Semantics: models/gpt2/src/kernels/loss.rs.
// Block reductions use a fixed tree (warp butterflies, then one warp over the
// per-warp partials): deterministic.
// Rows of logits, probs and dlogits are Vp >= V elements apart (the model pads
// them to Gpt2Config::padded_vocab); columns V..Vp are read by no sum.

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
//   probs (N, Vp), losses (N) or null, logits (N, Vp), targets (N) ids < V or null
// Launch: one block per row: grid N, block 1024 (any multiple of 32).
extern "C" __global__ void softmax_crossentropy_forward(float* __restrict__ probs,
                                                        float* __restrict__ losses,
                                                        const float* __restrict__ logits,
                                                        const unsigned int* __restrict__ targets,
                                                        int N, int V, int Vp) {
    __shared__ float scratch[32];
    const int row = blockIdx.x;
    if (row >= N) return;  // uniform for the whole block
    const float* x = logits + (long long)row * Vp;
    float* p = probs + (long long)row * Vp;
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
//   dlogits (N, Vp), probs (N, Vp), targets (N)
// Launch: grid ceil(N*V / block), block 256 (one thread per used element).
extern "C" __global__ void crossentropy_softmax_backward(float* __restrict__ dlogits,
                                                         const float* __restrict__ probs,
                                                         const unsigned int* __restrict__ targets,
                                                         float d, int N, int V, int Vp) {
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)N * V) return;
    const long long row = idx / V;
    const unsigned int i = (unsigned int)(idx % V);
    const long long at = row * Vp + i;
    float g = dlogits[at] + probs[at] * d;
    if (i == targets[row]) g -= d;
    dlogits[at] = g;
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
//   probs (N, Vp), losses (N) or null, logits (N, Vp), targets (N) ids < V or null
// Launch: one block per row: grid N, block 1024 (any multiple of 32).
extern "C" __global__ void softmax_crossentropy_forward_bf16(
    bf16_t* __restrict__ probs, float* __restrict__ losses, const bf16_t* __restrict__ logits,
    const unsigned int* __restrict__ targets, int N, int V, int Vp) {
    __shared__ float scratch[32];
    __shared__ double scratch_d[32];
    const int row = blockIdx.x;
    if (row >= N) return;  // uniform for the whole block
    const bf16_t* x = logits + (long long)row * Vp;
    bf16_t* p = probs + (long long)row * Vp;
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
//   dlogits (N, Vp), probs (N, Vp), targets (N)
// Launch: grid ceil(N*V / block), block 256 (one thread per used element).
extern "C" __global__ void crossentropy_softmax_backward_bf16(
    bf16_t* __restrict__ dlogits, const bf16_t* __restrict__ probs,
    const unsigned int* __restrict__ targets, float d, int N, int V, int Vp) {
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)N * V) return;
    const long long row = idx / V;
    const unsigned int i = (unsigned int)(idx % V);
    const long long at = row * Vp + i;
    float g = __fadd_rn(bf16_load(dlogits[at]), __fmul_rn(bf16_load(probs[at]), d));
    if (i == targets[row]) g = __fadd_rn(g, -d);
    dlogits[at] = bf16_store(g);
}

// ---------------------------------------------------------------------------
// The fused classifier (fused_classifier.rs; llm.c's fused_classifier): per
// row of logits, the online softmax statistics and the loss in one read, and
// the gradient of the mean loss written over the logits in a second pass. No
// (N, V) probabilities. Rows are Vp >= V wide: columns V..Vp are padding,
// read by no sum, given a zero gradient.
// ---------------------------------------------------------------------------

// Storage-generic element access: f32 as is, bf16 widened exactly and
// rounded once on store.
static __device__ __forceinline__ float ld(float x) { return x; }
static __device__ __forceinline__ float ld(bf16_t x) { return bf16_load(x); }
static __device__ __forceinline__ void st(float* p, float x) { *p = x; }
static __device__ __forceinline__ void st(bf16_t* p, float x) { *p = bf16_store(x); }

// Folds x into a running (max m, sum s of exp(. - m)): the one-pass (online)
// form of fused_classifier.rs's max pass and sum pass, the sum rescaled when
// the max grows, each exp in f32 summed in double.
static __device__ __forceinline__ void online_add(float& m, double& s, float x) {
    if (x > m) {
        s = s * (double)expf(m - x) + 1.0;
        m = x;
    } else {
        s += (double)expf(x - m);
    }
}

// Merges the running pair (m2, s2) into (m, s). Symmetric, bit for bit
// (the same products, summed in either order), so both lanes of a butterfly
// get the same pair; an empty pair (m2 = -inf: a thread with no column)
// leaves (m, s) as it is.
static __device__ __forceinline__ void online_merge(float& m, double& s, float m2, double s2) {
    if (m2 == NEG_INF) return;
    if (m2 > m) {
        s = s * (double)expf(m - m2) + s2;
        m = m2;
    } else {
        s = s + s2 * (double)expf(m2 - m);
    }
}

// The block's (max, sum) in a fixed tree (warp butterflies, then one warp
// over the per-warp pairs); every thread gets it. blockDim.x a multiple of 32.
static __device__ void block_online(float& m, double& s, float* ms, double* ss) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    for (int o = 16; o > 0; o >>= 1) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m, o);
        const double s2 = __shfl_xor_sync(0xffffffffu, s, o);
        online_merge(m, s, m2, s2);
    }
    __syncthreads();
    if (lane == 0) {
        ms[warp] = m;
        ss[warp] = s;
    }
    __syncthreads();
    m = (lane < warps) ? ms[lane] : NEG_INF;
    s = (lane < warps) ? ss[lane] : 0.0;
    for (int o = 16; o > 0; o >>= 1) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m, o);
        const double s2 = __shfl_xor_sync(0xffffffffu, s, o);
        online_merge(m, s, m2, s2);
    }
}

// 16-byte vectors of the logits: 8 bf16 or 4 f32 (VEC = 16 / sizeof(T)),
// taken where the rows are 16-byte aligned (the model's: Vp = 50304 is a
// multiple of 128 elements); otherwise the same arithmetic element by element.
struct alignas(16) fc_vec16 {
    unsigned int w[4];
};

static __device__ __forceinline__ bool fc_aligned16(const void* p) {
    return (reinterpret_cast<unsigned long long>(p) & 15ull) == 0ull;
}

static __device__ __forceinline__ fc_vec16 fc_load16(const void* p) {
#ifdef BRAID_KERNEL_EMU
    if (!fc_aligned16(p)) __trap();  // the GPU would fault
    fc_vec16 v;
    memcpy(&v, p, sizeof v);
    return v;
#else
    return *reinterpret_cast<const fc_vec16*>(p);
#endif
}

static __device__ __forceinline__ void fc_store16(void* p, const fc_vec16& v) {
#ifdef BRAID_KERNEL_EMU
    if (!fc_aligned16(p)) __trap();
    memcpy(p, &v, sizeof v);
#else
    *reinterpret_cast<fc_vec16*>(p) = v;
#endif
}

// The VEC elements of a vector, widened (bf16: the low half of a word first).
static __device__ __forceinline__ void fc_unpack(const fc_vec16& v, float (&x)[4]) {
#pragma unroll
    for (int e = 0; e < 4; e++) x[e] = __uint_as_float(v.w[e]);
}
static __device__ __forceinline__ void fc_unpack(const fc_vec16& v, float (&x)[8]) {
#pragma unroll
    for (int h = 0; h < 4; h++) {
        x[2 * h] = __uint_as_float(v.w[h] << 16);
        x[2 * h + 1] = __uint_as_float(v.w[h] & 0xffff0000u);
    }
}
static __device__ __forceinline__ fc_vec16 fc_pack(const float (&g)[4]) {
    fc_vec16 v;
#pragma unroll
    for (int e = 0; e < 4; e++) v.w[e] = __float_as_uint(g[e]);
    return v;
}
static __device__ __forceinline__ fc_vec16 fc_pack(const float (&g)[8]) {
    fc_vec16 v;
#pragma unroll
    for (int h = 0; h < 4; h++) {
        v.w[h] = (unsigned int)bf16_store(g[2 * h]) |
                 ((unsigned int)bf16_store(g[2 * h + 1]) << 16);
    }
    return v;
}

// The VEC elements of vector j of row x (all below V), by one 16-byte load or
// element by element.
template <typename T, int VEC>
static __device__ __forceinline__ void fc_read(const T* x, int j, bool vec, float (&v)[VEC]) {
    if (vec) {
        fc_unpack(fc_load16(x + (long long)j * VEC), v);
    } else {
#pragma unroll
        for (int e = 0; e < VEC; e++) v[e] = ld(x[j * VEC + e]);
    }
}

// Folds a whole vector into the running (m, s): its maximum first (one
// comparison with m per vector), then its VEC exponentials, each f32, summed
// pairwise in f32 and added to s in double.
template <int VEC>
static __device__ __forceinline__ void fc_fold(float& m, double& s, const float (&v)[VEC]) {
    float vm = v[0];
#pragma unroll
    for (int e = 1; e < VEC; e++) vm = fmaxf(vm, v[e]);
    if (vm > m) {
        s = s * (double)expf(m - vm);
        m = vm;
    }
    float t[VEC];
#pragma unroll
    for (int e = 0; e < VEC; e++) t[e] = expf(__fadd_rn(v[e], -m));
#pragma unroll
    for (int w = 1; w < VEC; w <<= 1) {
#pragma unroll
        for (int e = 0; e < VEC; e += 2 * w) t[e] = __fadd_rn(t[e], t[e + w]);
    }
    s += (double)t[0];
}

// The gradient pass's read of vector k: its real columns (none for a vector
// of padding; element by element for the one holding V), 0 elsewhere.
template <typename T, int VEC>
static __device__ __forceinline__ void fc_grad_read(const T* x, int k, int whole, int V, bool vec,
                                                    float (&v)[VEC]) {
    const int i0 = k * VEC;
    if (k < whole) {
        fc_read(x, k, vec, v);
    } else {
#pragma unroll
        for (int e = 0; e < VEC; e++) v[e] = i0 + e < V ? ld(x[i0 + e]) : 0.0f;
    }
}

// Writes vector k of the gradient from its logits v: (exp(v - m) * inv) * d,
// minus d at the target, over the real columns; 0 over the padding.
template <typename T, int VEC>
static __device__ __forceinline__ void fc_grad_write(T* x, int k, int V, int Vp, bool vec, float m,
                                                     float inv, float d, unsigned int tgt,
                                                     const float (&v)[VEC]) {
    const int i0 = k * VEC;
    float g[VEC];
#pragma unroll
    for (int e = 0; e < VEC; e++) {
        g[e] = 0.0f;
        if (i0 + e < V) {
            g[e] = __fmul_rn(__fmul_rn(expf(__fadd_rn(v[e], -m)), inv), d);
            if ((unsigned int)(i0 + e) == tgt) g[e] = __fadd_rn(g[e], -d);
        }
    }
    if (vec) {  // Vp a multiple of VEC: the vector lies inside the row
        fc_store16(x + i0, fc_pack(g));
    } else {
#pragma unroll
        for (int e = 0; e < VEC; e++) {
            if (i0 + e < Vp) st(&x[i0 + e], g[e]);
        }
    }
}

// losses[n] = m + ln s - x[n, targets[n]] (logsumexp over the V real
// columns, in double, rounded to f32) and, when write_grad, row n of the
// logits overwritten with (exp(x - m) * (float)(1 / s) * d) - [i == target]
// * d over 0..V (f32, in that order, as fused_classifier_f32) and 0 over
// V..Vp; d = dloss / N from the caller. A target not below V gives a NaN
// loss and no one-hot term (the CPU kernel refuses it; here nothing is read
// out of the row).
//   logits (N, Vp) in place, losses (N), targets (N)
// Launch: one block per row: grid N, block CLASSIFIER_BLOCK (256; any
// multiple of 32 up to 1024).
// Two passes over the row, 16-byte accesses where the rows are aligned: the
// statistics (one read; thread t takes vectors t, t + blockDim.x, ... of the
// V / VEC whole ones, and the thread after the last whole vector's owner
// the V % VEC tail columns one by one), the block's fixed merge tree, then
// the gradient (a second read, of the row the block has just read, each
// thread's vectors in reverse so the last read come first while still in
// L2, and one write; the padding is written without a read).
template <typename T>
static __device__ void fused_classifier_rows(T* __restrict__ logits, float* __restrict__ losses,
                                             const unsigned int* __restrict__ targets, float d,
                                             int write_grad, int N, int V, int Vp) {
    constexpr int VEC = 16 / (int)sizeof(T);
    __shared__ float ms[32];
    __shared__ double ss[32];
    const int row = blockIdx.x;
    if (row >= N) return;  // uniform for the whole block
    T* x = logits + (long long)row * Vp;
    const bool vec = fc_aligned16(logits) && ((long long)Vp * (long long)sizeof(T)) % 16 == 0;
    const int whole = V / VEC;  // vectors entirely below V
    float m = NEG_INF;
    double s = 0.0;
    int j = threadIdx.x;
#pragma unroll 1
    for (; j + (int)blockDim.x < whole; j += 2 * blockDim.x) {  // two loads in flight
        float a[VEC], b[VEC];
        fc_read(x, j, vec, a);
        fc_read(x, j + (int)blockDim.x, vec, b);
        fc_fold(m, s, a);
        fc_fold(m, s, b);
    }
    if (j < whole) {
        float a[VEC];
        fc_read(x, j, vec, a);
        fc_fold(m, s, a);
        j += blockDim.x;
    }
    if (j == whole) {  // the tail columns, after this thread's whole vectors
        for (int i = whole * VEC; i < V; i++) online_add(m, s, ld(x[i]));
    }
    block_online(m, s, ms, ss);
    const unsigned int tgt = targets[row];
    if (threadIdx.x == 0) {
        losses[row] = tgt < (unsigned int)V ? (float)((double)m + log(s) - (double)ld(x[tgt]))
                                            : __int_as_float(0x7fc00000);
    }
    if (!write_grad) return;
    __syncthreads();  // thread 0 has read x[tgt] before it is overwritten
    const float inv = (float)(1.0 / s);
    // This thread's vectors from its last one back: the block reads the row
    // in the reverse of the order it just read it, the most recently read
    // (likeliest still in L2) first. Two loads in flight.
    const int vecs = (Vp + VEC - 1) / VEC;  // vectors of the row, padding included
    const int first = threadIdx.x, step = blockDim.x;
    if (first >= vecs) return;
    int k = first + (vecs - 1 - first) / step * step;
    for (; k - step >= first; k -= 2 * step) {
        float a[VEC], b[VEC];
        fc_grad_read(x, k, whole, V, vec, a);
        fc_grad_read(x, k - step, whole, V, vec, b);
        fc_grad_write(x, k, V, Vp, vec, m, inv, d, tgt, a);
        fc_grad_write(x, k - step, V, Vp, vec, m, inv, d, tgt, b);
    }
    if (k == first) {
        float a[VEC];
        fc_grad_read(x, k, whole, V, vec, a);
        fc_grad_write(x, k, V, Vp, vec, m, inv, d, tgt, a);
    }
}

extern "C" __global__ void fused_classifier(float* __restrict__ logits,
                                            float* __restrict__ losses,
                                            const unsigned int* __restrict__ targets, float d,
                                            int write_grad, int N, int V, int Vp) {
    fused_classifier_rows(logits, losses, targets, d, write_grad, N, V, Vp);
}

// fused_classifier with bf16 logits (losses f32): each logit widened, the
// same f32/double arithmetic, each gradient rounded once.
extern "C" __global__ void fused_classifier_bf16(bf16_t* __restrict__ logits,
                                                 float* __restrict__ losses,
                                                 const unsigned int* __restrict__ targets,
                                                 float d, int write_grad, int N, int V, int Vp) {
    fused_classifier_rows(logits, losses, targets, d, write_grad, N, V, Vp);
}

// GPT-2 layer normalisation over channels, forward and backward (fp32).
// Semantics: models/gpt2/src/kernels/layernorm.rs (biased variance,
// eps = 1e-5, saves mean and rstd). Row statistics are reduced with a fixed
// butterfly of warp shuffles and parameter gradients by one thread per channel
// in row order: deterministic, no atomics.

#define LN_EPS 1e-5f

static __device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// One warp normalises row `row` of x (lane = threadIdx.x & 31).
static __device__ __forceinline__ void layernorm_row(float* __restrict__ out,
                                                     float* __restrict__ mean,
                                                     float* __restrict__ rstd, const float* x,
                                                     const float* __restrict__ weight,
                                                     const float* __restrict__ bias, int row,
                                                     int C) {
    const int lane = threadIdx.x & 31;
    float s = 0.0f;
    for (int i = lane; i < C; i += 32) s += x[i];
    const float m = warp_sum(s) / (float)C;
    float v = 0.0f;
    for (int i = lane; i < C; i += 32) {
        const float d = x[i] - m;
        v += d * d;
    }
    v = warp_sum(v) / (float)C;
    const float r = 1.0f / sqrtf(v + LN_EPS);
    float* o = out + (long long)row * C;
    for (int i = lane; i < C; i += 32) {
        o[i] = (x[i] - m) * r * weight[i] + bias[i];
    }
    if (lane == 0) {
        mean[row] = m;
        rstd[row] = r;
    }
}

// out = (inp - mean) * rstd * weight + bias, per row of C channels.
//   out (N, C), mean (N), rstd (N), inp (N, C), weight (C), bias (C); N = B*T
// Launch: one warp per row: block 256 (8 rows), grid ceil(N / 8).
extern "C" __global__ void layernorm_forward(float* __restrict__ out, float* __restrict__ mean,
                                             float* __restrict__ rstd,
                                             const float* __restrict__ inp,
                                             const float* __restrict__ weight,
                                             const float* __restrict__ bias, int N, int C) {
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= N) return;
    layernorm_row(out, mean, rstd, inp + (long long)row * C, weight, bias, row, C);
}

// residual = inp1 + inp2, then layernorm_forward of the stored residual
// (layernorm.rs: forward_residual; bit for bit residual_forward then
// layernorm_forward: each lane stores its sums, the warp synchronises, and
// the same row code reads them back).
//   residual, out (N, C), mean, rstd (N), inp1, inp2 (N, C), weight, bias (C)
// Launch: one warp per row: block 256 (8 rows), grid ceil(N / 8).
extern "C" __global__ void layernorm_residual_forward(
    float* __restrict__ residual, float* __restrict__ out, float* __restrict__ mean,
    float* __restrict__ rstd, const float* __restrict__ inp1, const float* __restrict__ inp2,
    const float* __restrict__ weight, const float* __restrict__ bias, int N, int C) {
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= N) return;
    const long long base = (long long)row * C;
    float* x = residual + base;
    for (int i = lane; i < C; i += 32) x[i] = inp1[base + i] + inp2[base + i];
    __syncwarp();
    layernorm_row(out, mean, rstd, x, weight, bias, row, C);
}

// dinp = base + (dnorm - mean(dnorm) - norm * mean(dnorm * norm)) * rstd,
// with norm = (inp - mean) * rstd and dnorm = weight * dout; base = dinp
// (accumulate) when dres is null, else dres (layernorm.rs:
// backward_residual: the residual's gradient passed through).
//   dinp (N, C), dres (N, C) or null, dout (N, C), inp (N, C), weight (C),
//   mean (N), rstd (N)
// Launch: one warp per row: block 256, grid ceil(N / 8).
extern "C" __global__ void layernorm_backward_input(float* __restrict__ dinp,
                                                    const float* __restrict__ dres,
                                                    const float* __restrict__ dout,
                                                    const float* __restrict__ inp,
                                                    const float* __restrict__ weight,
                                                    const float* __restrict__ mean,
                                                    const float* __restrict__ rstd, int N, int C) {
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= N) return;
    const long long base = (long long)row * C;
    const float m = mean[row];
    const float s = rstd[row];
    float a = 0.0f, b = 0.0f;
    for (int i = lane; i < C; i += 32) {
        const float norm = (inp[base + i] - m) * s;
        const float dnorm = weight[i] * dout[base + i];
        a += dnorm;
        b += dnorm * norm;
    }
    a = warp_sum(a) / (float)C;
    b = warp_sum(b) / (float)C;
    for (int i = lane; i < C; i += 32) {
        const float norm = (inp[base + i] - m) * s;
        const float dnorm = weight[i] * dout[base + i];
        const float prev = dres ? dres[base + i] : dinp[base + i];
        dinp[base + i] = prev + (dnorm - a - norm * b) * s;
    }
}

#include "bf16.cuh"  // bf16_t, bf16_load, bf16_store, ld_f32, st_f32

// 16-byte vectors: one load or store moves 8 bf16 (or 4 f32) elements. The
// vectorised paths below are taken only where every address they form is
// 16-byte aligned (checked at run time, uniformly for the whole launch);
// otherwise the scalar paths do the same arithmetic element by element.
struct alignas(16) ln_vec16 {
    unsigned int w[4];
};

static __device__ __forceinline__ bool ln_aligned16(const void* p) {
    return (reinterpret_cast<unsigned long long>(p) & 15ull) == 0ull;
}

static __device__ __forceinline__ ln_vec16 ln_load16(const void* p) {
#ifdef BRAID_KERNEL_EMU
    if (!ln_aligned16(p)) __trap();  // the GPU would fault
    ln_vec16 v;
    memcpy(&v, p, sizeof v);
    return v;
#else
    return *reinterpret_cast<const ln_vec16*>(p);
#endif
}

static __device__ __forceinline__ void ln_store16(void* p, const ln_vec16& v) {
#ifdef BRAID_KERNEL_EMU
    if (!ln_aligned16(p)) __trap();
    memcpy(p, &v, sizeof v);
#else
    *reinterpret_cast<ln_vec16*>(p) = v;
#endif
}

// Element e of a vector of S (bf16: the low half of word e / 2 comes first in
// memory), widened to f32.
static __device__ __forceinline__ float ln_elem(const ln_vec16& v, int e, const float*) {
    return __uint_as_float(v.w[e]);
}
static __device__ __forceinline__ float ln_elem(const ln_vec16& v, int e, const bf16_t*) {
    const unsigned int w = v.w[e >> 1];
    return __uint_as_float((e & 1) ? (w & 0xffff0000u) : (w << 16));
}

// dweight[c] += sum_n norm[n, c] * dout[n, c];  dbias[c] += sum_n dout[n, c]
//   dweight (C), dbias (C), dout (N, C), inp (N, C), mean (N), rstd (N)
// Launch: block LN_PARAMS_THREADS (1024), grid ceil(C / LN_PARAMS_CH).
// A block owns LN_PARAMS_CH = 16 channels: 32 bytes of each bf16 row, one
// sector (64 bytes of f32). A thread takes VEC = 16 / sizeof(S) channels of
// one row per 16-byte load (LPR = 16 / VEC threads per row, so one warp
// reads RPW = 32 / LPR rows at once), and row slot q = threadIdx.x / LPR
// sums rows q, q + SLOTS, q + 2 SLOTS, ... in order (SLOTS = 1024 / LPR); a
// warp's RPW slots are then combined by a fixed butterfly of shuffles (xor
// LPR, 2 LPR, ..., 16), and the block's 32 warp sums are added to the
// loaded gradient in warp order. Deterministic: a fixed assignment and a
// fixed combining order for any N and C. Where the channels and rows are
// 16-byte aligned (C a multiple of VEC), a thread's VEC channels come in one
// load; otherwise element by element, the same sums. (History: one thread per
// channel walking all N rows left 768 threads busy for 1.5 ms per call at
// N = 8192, 2026-11-26; then 32 warps per 32 channels with 2-byte loads,
// 24 blocks on the whole GPU with few bytes in flight each.)
#define LN_PARAMS_THREADS 1024
#define LN_PARAMS_WARPS (LN_PARAMS_THREADS / 32)
#define LN_PARAMS_CH 16

template <typename S>
static __device__ __forceinline__ void ln_params(S* __restrict__ dweight, S* __restrict__ dbias,
                                                 const S* __restrict__ dout,
                                                 const S* __restrict__ inp,
                                                 const float* __restrict__ mean,
                                                 const float* __restrict__ rstd, int N, int C) {
    constexpr int VEC = 16 / (int)sizeof(S);
    constexpr int LPR = LN_PARAMS_CH / VEC;
    constexpr int SLOTS = LN_PARAMS_THREADS / LPR;
    alignas(16) __shared__ float part[LN_PARAMS_WARPS][2][LN_PARAMS_CH];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int sub = lane % LPR;  // which VEC channels of the block's 16
    const int c0 = blockIdx.x * LN_PARAMS_CH + sub * VEC;
    const bool vec = (C % VEC) == 0 && ln_aligned16(dout) && ln_aligned16(inp);
    float dw[VEC], db[VEC];
#pragma unroll
    for (int e = 0; e < VEC; e++) dw[e] = db[e] = 0.0f;
    if (blockDim.x != LN_PARAMS_THREADS) __trap();  // the slots and part[] assume it
    if (c0 < C) {
#pragma unroll 2
        for (int n = threadIdx.x / LPR; n < N; n += SLOTS) {
            const long long k = (long long)n * C + c0;
            float g[VEC], x[VEC];
            if (vec) {  // C % VEC == 0: c0 < C means all VEC channels are
                const ln_vec16 gv = ln_load16(dout + k), xv = ln_load16(inp + k);
#pragma unroll
                for (int e = 0; e < VEC; e++) {
                    g[e] = ln_elem(gv, e, dout);
                    x[e] = ln_elem(xv, e, inp);
                }
            } else {
#pragma unroll
                for (int e = 0; e < VEC; e++) {
                    const bool in = c0 + e < C;
                    g[e] = in ? ld_f32(dout[k + e]) : 0.0f;
                    x[e] = in ? ld_f32(inp[k + e]) : 0.0f;
                }
            }
            const float m = mean[n], r = rstd[n];
#pragma unroll
            for (int e = 0; e < VEC; e++) {
                const float norm = (x[e] - m) * r;
                db[e] += g[e];
                dw[e] += norm * g[e];
            }
        }
    }
    // The warp's row slots (lanes sub, sub + LPR, ...), in a fixed butterfly.
#pragma unroll
    for (int o = LPR; o < 32; o <<= 1) {
#pragma unroll
        for (int e = 0; e < VEC; e++) {
            dw[e] += __shfl_xor_sync(0xffffffffu, dw[e], o);
            db[e] += __shfl_xor_sync(0xffffffffu, db[e], o);
        }
    }
    if (lane < LPR) {
#pragma unroll
        for (int e = 0; e < VEC; e++) {
            part[warp][0][sub * VEC + e] = dw[e];
            part[warp][1][sub * VEC + e] = db[e];
        }
    }
    __syncthreads();
    // Threads 0..15 finish dweight's 16 channels, 16..31 dbias's.
    if (threadIdx.x < 2 * LN_PARAMS_CH) {
        const int which = threadIdx.x / LN_PARAMS_CH, ch = threadIdx.x % LN_PARAMS_CH;
        const int c = blockIdx.x * LN_PARAMS_CH + ch;
        if (c < C) {
            S* p = which ? dbias : dweight;
            float acc = ld_f32(p[c]);
            for (int w = 0; w < LN_PARAMS_WARPS; w++) acc += part[w][which][ch];
            st_f32(&p[c], acc);
        }
    }
}

// The bf16 kernels follow layernorm_forward::<Bf16> / layernorm_backward::<Bf16>
// in layernorm.rs: row reductions in double (as the CPU's f64 sums; the warp
// tree adds in another order, so a statistic may differ from the CPU's in its
// last f32 bit), every elementwise step in f32 in the CPU's order with
// __fmul_rn/__fadd_rn (no FMA contraction), one rounding per stored element.

static __device__ __forceinline__ double warp_sum_d(double v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// One warp normalises row `row` of x, bf16 (layernorm_row's bf16 twin).
static __device__ __forceinline__ void layernorm_row_bf16(bf16_t* __restrict__ out,
                                                          float* __restrict__ mean,
                                                          float* __restrict__ rstd,
                                                          const bf16_t* x,
                                                          const bf16_t* __restrict__ weight,
                                                          const bf16_t* __restrict__ bias,
                                                          int row, int C) {
    const int lane = threadIdx.x & 31;
    double s = 0.0;
    for (int i = lane; i < C; i += 32) s += (double)bf16_load(x[i]);
    const double md = warp_sum_d(s) / (double)C;
    double v = 0.0;
    for (int i = lane; i < C; i += 32) {
        const double d = (double)bf16_load(x[i]) - md;
        v += d * d;
    }
    v = warp_sum_d(v) / (double)C;
    const float m = (float)md;
    const float r = (float)(1.0 / sqrt(v + (double)LN_EPS));
    bf16_t* o = out + (long long)row * C;
    for (int i = lane; i < C; i += 32) {
        const float xn = __fmul_rn(__fadd_rn(bf16_load(x[i]), -m), r);
        o[i] = bf16_store(__fadd_rn(__fmul_rn(xn, bf16_load(weight[i])), bf16_load(bias[i])));
    }
    if (lane == 0) {
        mean[row] = m;
        rstd[row] = r;
    }
}

// layernorm_forward with bf16 out/inp/weight/bias; mean and rstd stay f32.
// Launch: one warp per row: block 256 (8 rows), grid ceil(N / 8).
extern "C" __global__ void layernorm_forward_bf16(bf16_t* __restrict__ out,
                                                  float* __restrict__ mean,
                                                  float* __restrict__ rstd,
                                                  const bf16_t* __restrict__ inp,
                                                  const bf16_t* __restrict__ weight,
                                                  const bf16_t* __restrict__ bias, int N, int C) {
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= N) return;
    layernorm_row_bf16(out, mean, rstd, inp + (long long)row * C, weight, bias, row, C);
}

// layernorm_residual_forward with bf16 storage: the f32 sum rounded once and
// stored (residual_forward_bf16), then normalised from the stored value.
// Launch: one warp per row: block 256 (8 rows), grid ceil(N / 8).
extern "C" __global__ void layernorm_residual_forward_bf16(
    bf16_t* __restrict__ residual, bf16_t* __restrict__ out, float* __restrict__ mean,
    float* __restrict__ rstd, const bf16_t* __restrict__ inp1, const bf16_t* __restrict__ inp2,
    const bf16_t* __restrict__ weight, const bf16_t* __restrict__ bias, int N, int C) {
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= N) return;
    const long long base = (long long)row * C;
    bf16_t* x = residual + base;
    for (int i = lane; i < C; i += 32) {
        x[i] = bf16_store(bf16_load(inp1[base + i]) + bf16_load(inp2[base + i]));
    }
    __syncwarp();
    layernorm_row_bf16(out, mean, rstd, x, weight, bias, row, C);
}

// The 16-byte path of layernorm_backward_input_bf16: C a multiple of 8, every
// row pointer 16-byte aligned. Lane l takes chunks j = l, l + 32, ... of 8
// channels; the first LN_BWD_CACHED chunks per lane (C <= 768 entirely) keep
// dout, inp and the base in registers between the two passes (one read of
// each), later ones are read again. The same f32 operations per element as
// the scalar path; each lane sums its elements in chunk order, then the warp
// tree (double).
#define LN_BWD_CACHED 3

struct ln_bwd_ctx {
    float m, s;    // the row's mean and rstd
    double a, b;   // sums of dnorm and dnorm * norm
    float am, bm;  // their means
};

static __device__ __forceinline__ void ln_bwd_stats8(ln_bwd_ctx& t, const ln_vec16& g,
                                                     const ln_vec16& x, const ln_vec16& w) {
#pragma unroll
    for (int e = 0; e < 8; e++) {
        const float norm = __fmul_rn(__fadd_rn(ln_elem(x, e, (const bf16_t*)0), -t.m), t.s);
        const float dnorm =
            __fmul_rn(ln_elem(w, e, (const bf16_t*)0), ln_elem(g, e, (const bf16_t*)0));
        t.a += (double)dnorm;
        t.b += (double)__fmul_rn(dnorm, norm);
    }
}

static __device__ __forceinline__ ln_vec16 ln_bwd_out8(const ln_bwd_ctx& t, const ln_vec16& g,
                                                       const ln_vec16& x, const ln_vec16& w,
                                                       const ln_vec16& prev) {
    ln_vec16 o;
#pragma unroll
    for (int h = 0; h < 4; h++) {
        unsigned int packed = 0u;
#pragma unroll
        for (int q = 0; q < 2; q++) {
            const int e = 2 * h + q;
            const float norm = __fmul_rn(__fadd_rn(ln_elem(x, e, (const bf16_t*)0), -t.m), t.s);
            const float dnorm =
                __fmul_rn(ln_elem(w, e, (const bf16_t*)0), ln_elem(g, e, (const bf16_t*)0));
            const float d =
                __fmul_rn(__fadd_rn(__fadd_rn(dnorm, -t.am), -__fmul_rn(norm, t.bm)), t.s);
            const unsigned int r =
                bf16_store(__fadd_rn(ln_elem(prev, e, (const bf16_t*)0), d));
            packed |= r << (16 * q);
        }
        o.w[h] = packed;
    }
    return o;
}

static __device__ __forceinline__ void ln_bwd_row_vec(bf16_t* __restrict__ dinp,
                                                      const bf16_t* __restrict__ dres,
                                                      const bf16_t* __restrict__ dout,
                                                      const bf16_t* __restrict__ inp,
                                                      const bf16_t* __restrict__ weight,
                                                      ln_bwd_ctx& t, long long base, int C) {
    const int lane = threadIdx.x & 31;
    const int chunks = C >> 3;
    const bf16_t* src = dres ? dres : dinp;  // the base of each output element
    ln_vec16 g[LN_BWD_CACHED], x[LN_BWD_CACHED], p[LN_BWD_CACHED];
    // Every cached load first: LN_BWD_CACHED * 3 16-byte loads in flight.
#pragma unroll
    for (int k = 0; k < LN_BWD_CACHED; k++) {
        const int j = lane + 32 * k;
        if (j < chunks) {
            const long long at = base + 8ll * j;
            g[k] = ln_load16(dout + at);
            x[k] = ln_load16(inp + at);
            p[k] = ln_load16(src + at);
        }
    }
    t.a = 0.0;
    t.b = 0.0;
#pragma unroll
    for (int k = 0; k < LN_BWD_CACHED; k++) {
        const int j = lane + 32 * k;
        if (j < chunks) ln_bwd_stats8(t, g[k], x[k], ln_load16(weight + 8 * j));
    }
    for (int j = lane + 32 * LN_BWD_CACHED; j < chunks; j += 32) {
        const long long at = base + 8ll * j;
        ln_bwd_stats8(t, ln_load16(dout + at), ln_load16(inp + at), ln_load16(weight + 8 * j));
    }
    t.am = (float)(warp_sum_d(t.a) / (double)C);
    t.bm = (float)(warp_sum_d(t.b) / (double)C);
#pragma unroll
    for (int k = 0; k < LN_BWD_CACHED; k++) {
        const int j = lane + 32 * k;
        if (j < chunks) {
            ln_store16(dinp + base + 8ll * j,
                       ln_bwd_out8(t, g[k], x[k], ln_load16(weight + 8 * j), p[k]));
        }
    }
    for (int j = lane + 32 * LN_BWD_CACHED; j < chunks; j += 32) {
        const long long at = base + 8ll * j;
        ln_store16(dinp + at, ln_bwd_out8(t, ln_load16(dout + at), ln_load16(inp + at),
                                          ln_load16(weight + 8 * j), ln_load16(src + at)));
    }
}

// layernorm_backward_input with bf16 dinp/dres/dout/inp/weight: each base
// element (dinp's own, or dres's) loaded, the f32 term added, rounded once.
// C a multiple of 8 with 16-byte aligned buffers: 16-byte loads and stores,
// each row read once where C <= 768 (ln_bwd_row_vec); otherwise element by
// element, two reads of the row.
// Launch: one warp per row: block 256, grid ceil(N / 8).
extern "C" __global__ void layernorm_backward_input_bf16(bf16_t* __restrict__ dinp,
                                                         const bf16_t* __restrict__ dres,
                                                         const bf16_t* __restrict__ dout,
                                                         const bf16_t* __restrict__ inp,
                                                         const bf16_t* __restrict__ weight,
                                                         const float* __restrict__ mean,
                                                         const float* __restrict__ rstd, int N,
                                                         int C) {
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= N) return;
    const long long base = (long long)row * C;
    const float m = mean[row];
    const float s = rstd[row];
    const bool vec = (C & 7) == 0 && ln_aligned16(dinp) && ln_aligned16(dout) &&
                     ln_aligned16(inp) && ln_aligned16(weight) &&
                     (dres == nullptr || ln_aligned16(dres));
    if (vec) {
        ln_bwd_ctx t;
        t.m = m;
        t.s = s;
        ln_bwd_row_vec(dinp, dres, dout, inp, weight, t, base, C);
        return;
    }
    double a = 0.0, b = 0.0;
    for (int i = lane; i < C; i += 32) {
        const float norm = __fmul_rn(__fadd_rn(bf16_load(inp[base + i]), -m), s);
        const float dnorm = __fmul_rn(bf16_load(weight[i]), bf16_load(dout[base + i]));
        a += (double)dnorm;
        b += (double)__fmul_rn(dnorm, norm);
    }
    const float am = (float)(warp_sum_d(a) / (double)C);
    const float bm = (float)(warp_sum_d(b) / (double)C);
    for (int i = lane; i < C; i += 32) {
        const float norm = __fmul_rn(__fadd_rn(bf16_load(inp[base + i]), -m), s);
        const float dnorm = __fmul_rn(bf16_load(weight[i]), bf16_load(dout[base + i]));
        const float d = __fmul_rn(__fadd_rn(__fadd_rn(dnorm, -am), -__fmul_rn(norm, bm)), s);
        const float prev = bf16_load(dres ? dres[base + i] : dinp[base + i]);
        dinp[base + i] = bf16_store(__fadd_rn(prev, d));
    }
}

// layernorm_backward_params and its bf16 twin: ln_params (above) on f32 or
// bf16 storage; bf16 dweight and dbias are loaded, the f32 partial sums
// added, and rounded once.
// Launch: grid ceil(C / LN_PARAMS_CH), block LN_PARAMS_THREADS (1024).
extern "C" __global__ void layernorm_backward_params(float* __restrict__ dweight,
                                                     float* __restrict__ dbias,
                                                     const float* __restrict__ dout,
                                                     const float* __restrict__ inp,
                                                     const float* __restrict__ mean,
                                                     const float* __restrict__ rstd, int N,
                                                     int C) {
    ln_params(dweight, dbias, dout, inp, mean, rstd, N, C);
}

extern "C" __global__ void layernorm_backward_params_bf16(bf16_t* __restrict__ dweight,
                                                          bf16_t* __restrict__ dbias,
                                                          const bf16_t* __restrict__ dout,
                                                          const bf16_t* __restrict__ inp,
                                                          const float* __restrict__ mean,
                                                          const float* __restrict__ rstd, int N,
                                                          int C) {
    ln_params(dweight, dbias, dout, inp, mean, rstd, N, C);
}

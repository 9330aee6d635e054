// GPT-2 layer normalisation over channels, forward and backward (fp32).
// Semantics: models/gpt2/src/kernels/layernorm.rs (biased variance,
// eps = 1e-5, saves mean and rstd). Row statistics are reduced with a fixed
// butterfly of warp shuffles and parameter gradients in fixed row chunks,
// then the chunks in order: deterministic, no atomics.

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

#include "bf16.cuh"  // bf16_t, bf16_load, bf16_store, ld_f32, st_f32, bf16x8

// dweight[c] += sum_n norm[n, c] * dout[n, c];  dbias[c] += sum_n dout[n, c],
// in two kernels, deterministic (a fixed assignment and a fixed combining
// order for any N and C, no atomics):
//
// ln_params_partial: row chunk r of R (rows r * per .. min(N, (r+1) * per),
// per = ceil(N / R)) summed into part (R, 2, C) f32: part[r][0][c] the
// dweight sum, part[r][1][c] the dbias sum.
//   Launch: grid (ceil(C / 32), R), block 32 * LN_PARAMS_WARPS. A block owns
//   32 channels, one per lane, of one chunk; warp w sums the chunk's rows w,
//   w + W, w + 2W, ... in order (coalesced across the lanes' channels), then
//   the W partial sums are added in warp order.
// ln_params_finish: dweight[c] += part[0][0][c] + part[1][0][c] + ... in
// chunk order (one rounding with bf16 storage), dbias likewise.
//   Launch: one thread per channel, block 256, grid ceil(C / 256).
//
// (One thread per channel walking all N rows left 768 threads busy for 1.5
// ms per call at N = 8192, 2026-11-26; one block per 32 channels and all N
// rows ran 67 us on an H200 with 24 blocks on 132 SMs at 8% of its memory
// bandwidth, 2026-11-27. The launcher picks R so that a chunk is about
// PARAMS_CHUNK_ROWS (layernorm.rs) rows: 768 blocks at N = 8192, C = 768.)
#define LN_PARAMS_WARPS 8

template <typename S>
static __device__ __forceinline__ void ln_params_partial(float* __restrict__ part,
                                                         const S* __restrict__ dout,
                                                         const S* __restrict__ inp,
                                                         const float* __restrict__ mean,
                                                         const float* __restrict__ rstd,
                                                         int N, int C) {
    __shared__ float part_w[LN_PARAMS_WARPS][32];
    __shared__ float part_b[LN_PARAMS_WARPS][32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int c = blockIdx.x * 32 + lane;
    const int r = blockIdx.y, chunks = gridDim.y;
    const int per = (N + chunks - 1) / chunks;
    const int start = r * per;
    const int end = min(N, start + per);
    float dw = 0.0f, db = 0.0f;
    if (c < C) {
        for (int n = start + warp; n < end; n += LN_PARAMS_WARPS) {
            const long long k = (long long)n * C + c;
            const float g = ld_f32(dout[k]);
            const float norm = (ld_f32(inp[k]) - mean[n]) * rstd[n];
            db += g;
            dw += norm * g;
        }
    }
    part_w[warp][lane] = dw;
    part_b[warp][lane] = db;
    __syncthreads();
    if (warp == 0 && c < C) {
        float w = 0.0f, bsum = 0.0f;
        for (int i = 0; i < LN_PARAMS_WARPS; i++) {
            w += part_w[i][lane];
            bsum += part_b[i][lane];
        }
        part[(long long)(2 * r) * C + c] = w;
        part[(long long)(2 * r + 1) * C + c] = bsum;
    }
}

template <typename S>
static __device__ __forceinline__ void ln_params_finish(S* __restrict__ dweight,
                                                        S* __restrict__ dbias,
                                                        const float* __restrict__ part,
                                                        int C, int R) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    float w = ld_f32(dweight[c]), bsum = ld_f32(dbias[c]);
    for (int r = 0; r < R; r++) {
        w += part[(long long)(2 * r) * C + c];
        bsum += part[(long long)(2 * r + 1) * C + c];
    }
    st_f32(&dweight[c], w);
    st_f32(&dbias[c], bsum);
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

// The bf16 rows 16 bytes at a time (bf16x8, bf16.cuh), each lane holding
// its vectors in registers: lane l has vectors l, l + 32, ... (elements
// 8 v .. 8 v + 7 of vector v). One pass over global memory where the
// element-wise loops above read a row two or three times, 2 bytes a load
// (run 8: 25% of an H200's DRAM bandwidth for the backward). Taken where C
// is a multiple of 8 up to 32 * 8 * LN_VEC_MAX (GPT-2 124M's 768, medium's
// 1024) and every row pointer is 16-byte aligned, else the loops above. The
// same arithmetic per element; the row sums are the same double sums in
// another order, so the same bits wherever they are exact: rows of bf16
// values spanning under about 35 binades, backward terms (f32) under about
// 19. Past that a sum may differ in its last double bit, which its f32
// rounding almost never shows.
#define LN_VEC_MAX 4

// Whether the vector path applies: `addrs` is the OR of the base pointers.
static __device__ __forceinline__ bool ln_vec(int C, unsigned long long addrs) {
    return C % 8 == 0 && C <= 32 * 8 * LN_VEC_MAX && (addrs & 15ull) == 0;
}

// layernorm_row_bf16 on a row held in registers (`xv`, as above), writing
// row `row` of out.
static __device__ __forceinline__ void layernorm_row_bf16_vec(
    bf16_t* __restrict__ out, float* __restrict__ mean, float* __restrict__ rstd,
    const bf16x8 (&xv)[LN_VEC_MAX], const bf16_t* __restrict__ weight,
    const bf16_t* __restrict__ bias, int row, int C) {
    const int lane = threadIdx.x & 31;
    double s = 0.0;
#pragma unroll
    for (int k = 0; k < LN_VEC_MAX; k++) {
        if (8 * (lane + 32 * k) >= C) continue;
#pragma unroll
        for (int e = 0; e < 8; e++) s += (double)bf16x8_get(xv[k], e);
    }
    const double md = warp_sum_d(s) / (double)C;
    double v = 0.0;
#pragma unroll
    for (int k = 0; k < LN_VEC_MAX; k++) {
        if (8 * (lane + 32 * k) >= C) continue;
#pragma unroll
        for (int e = 0; e < 8; e++) {
            const double d = (double)bf16x8_get(xv[k], e) - md;
            v += d * d;
        }
    }
    v = warp_sum_d(v) / (double)C;
    const float m = (float)md;
    const float r = (float)(1.0 / sqrt(v + (double)LN_EPS));
    bf16_t* o = out + (long long)row * C;
#pragma unroll
    for (int k = 0; k < LN_VEC_MAX; k++) {
        const int at = 8 * (lane + 32 * k);
        if (at >= C) continue;
        const bf16x8 w = bf16x8_load(weight + at), b = bf16x8_load(bias + at);
        bf16x8 y = {};
#pragma unroll
        for (int e = 0; e < 8; e++) {
            const float xn = __fmul_rn(__fadd_rn(bf16x8_get(xv[k], e), -m), r);
            const float yn = __fadd_rn(__fmul_rn(xn, bf16x8_get(w, e)), bf16x8_get(b, e));
            bf16x8_set(y, e, bf16_store(yn));
        }
        bf16x8_store(o + at, y);
    }
    if (lane == 0) {
        mean[row] = m;
        rstd[row] = r;
    }
}

// Row `row` of x (bf16) into registers, as layernorm_row_bf16_vec takes it.
static __device__ __forceinline__ void ln_load_row(bf16x8 (&xv)[LN_VEC_MAX],
                                                   const bf16_t* __restrict__ x, int C) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int k = 0; k < LN_VEC_MAX; k++) {
        const int at = 8 * (lane + 32 * k);
        if (at >= C) continue;
        xv[k] = bf16x8_load(x + at);
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
    const bf16_t* x = inp + (long long)row * C;
    if (ln_vec(C, (unsigned long long)out | (unsigned long long)inp | (unsigned long long)weight |
                      (unsigned long long)bias)) {
        bf16x8 xv[LN_VEC_MAX] = {};
        ln_load_row(xv, x, C);
        layernorm_row_bf16_vec(out, mean, rstd, xv, weight, bias, row, C);
        return;
    }
    layernorm_row_bf16(out, mean, rstd, x, weight, bias, row, C);
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
    if (ln_vec(C, (unsigned long long)residual | (unsigned long long)out |
                      (unsigned long long)inp1 | (unsigned long long)inp2 |
                      (unsigned long long)weight | (unsigned long long)bias)) {
        // The rounded sums stored and kept: the row the loop below reads back.
        bf16x8 xv[LN_VEC_MAX] = {};
#pragma unroll
        for (int k = 0; k < LN_VEC_MAX; k++) {
            const int at = 8 * (lane + 32 * k);
            if (at >= C) continue;
            const bf16x8 p = bf16x8_load(inp1 + base + at), q = bf16x8_load(inp2 + base + at);
#pragma unroll
            for (int e = 0; e < 8; e++) {
                bf16x8_set(xv[k], e, bf16_store(bf16x8_get(p, e) + bf16x8_get(q, e)));
            }
            bf16x8_store(x + at, xv[k]);
        }
        layernorm_row_bf16_vec(out, mean, rstd, xv, weight, bias, row, C);
        return;
    }
    for (int i = lane; i < C; i += 32) {
        x[i] = bf16_store(bf16_load(inp1[base + i]) + bf16_load(inp2[base + i]));
    }
    __syncwarp();
    layernorm_row_bf16(out, mean, rstd, x, weight, bias, row, C);
}

// layernorm_backward_input with bf16 dinp/dres/dout/inp/weight: each base
// element (dinp's own, or dres's) loaded, the f32 term added, rounded once.
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
    double a = 0.0, b = 0.0;
    if (ln_vec(C, (unsigned long long)dinp | (unsigned long long)dres | (unsigned long long)dout |
                      (unsigned long long)inp | (unsigned long long)weight)) {
        // The row of inp and dout held in registers between the two passes.
        bf16x8 xv[LN_VEC_MAX] = {}, gv[LN_VEC_MAX] = {};
        ln_load_row(xv, inp + base, C);
        ln_load_row(gv, dout + base, C);
#pragma unroll
        for (int k = 0; k < LN_VEC_MAX; k++) {
            const int at = 8 * (lane + 32 * k);
            if (at >= C) continue;
            const bf16x8 w = bf16x8_load(weight + at);
#pragma unroll
            for (int e = 0; e < 8; e++) {
                const float norm = __fmul_rn(__fadd_rn(bf16x8_get(xv[k], e), -m), s);
                const float dnorm = __fmul_rn(bf16x8_get(w, e), bf16x8_get(gv[k], e));
                a += (double)dnorm;
                b += (double)__fmul_rn(dnorm, norm);
            }
        }
        const float am = (float)(warp_sum_d(a) / (double)C);
        const float bm = (float)(warp_sum_d(b) / (double)C);
        const bf16_t* prev = (dres ? dres : dinp) + base;
#pragma unroll
        for (int k = 0; k < LN_VEC_MAX; k++) {
            const int at = 8 * (lane + 32 * k);
            if (at >= C) continue;
            const bf16x8 w = bf16x8_load(weight + at), p = bf16x8_load(prev + at);
            bf16x8 y = {};
#pragma unroll
            for (int e = 0; e < 8; e++) {
                const float norm = __fmul_rn(__fadd_rn(bf16x8_get(xv[k], e), -m), s);
                const float dnorm = __fmul_rn(bf16x8_get(w, e), bf16x8_get(gv[k], e));
                const float d =
                    __fmul_rn(__fadd_rn(__fadd_rn(dnorm, -am), -__fmul_rn(norm, bm)), s);
                bf16x8_set(y, e, bf16_store(__fadd_rn(bf16x8_get(p, e), d)));
            }
            bf16x8_store(dinp + base + at, y);
        }
        return;
    }
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

// layernorm_backward_params_partial / _finish and their bf16 twins:
// ln_params_partial and ln_params_finish (above) on f32 or bf16 storage;
// bf16 dweight and dbias are loaded, the chunks' f32 sums added, and rounded
// once.
extern "C" __global__ void layernorm_backward_params_partial(float* __restrict__ part,
                                                             const float* __restrict__ dout,
                                                             const float* __restrict__ inp,
                                                             const float* __restrict__ mean,
                                                             const float* __restrict__ rstd,
                                                             int N, int C) {
    ln_params_partial(part, dout, inp, mean, rstd, N, C);
}

extern "C" __global__ void layernorm_backward_params_partial_bf16(
    float* __restrict__ part, const bf16_t* __restrict__ dout, const bf16_t* __restrict__ inp,
    const float* __restrict__ mean, const float* __restrict__ rstd, int N, int C) {
    ln_params_partial(part, dout, inp, mean, rstd, N, C);
}

extern "C" __global__ void layernorm_backward_params_finish(float* __restrict__ dweight,
                                                            float* __restrict__ dbias,
                                                            const float* __restrict__ part,
                                                            int C, int R) {
    ln_params_finish(dweight, dbias, part, C, R);
}

extern "C" __global__ void layernorm_backward_params_finish_bf16(bf16_t* __restrict__ dweight,
                                                                 bf16_t* __restrict__ dbias,
                                                                 const float* __restrict__ part,
                                                                 int C, int R) {
    ln_params_finish(dweight, dbias, part, C, R);
}

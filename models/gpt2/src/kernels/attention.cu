// GPT-2 causal self-attention helpers (fp32), llm.c's cuBLAS formulation.
// Semantics: models/gpt2/src/kernels/attention.rs; the products run as
// strided-batched cuBLAS sgemms over the B*NH heads (row-major terms, see
// cuda/src/cublas.rs):
//
// forward, with hs = C / NH and scale = 1 / sqrt(hs):
//   attention_permute          inp (B, T, 3C)      -> q, k, v (B, NH, T, hs)
//   preatt = scale · q · kᵀ    Gemm(N, T, T, T, hs).scaled(scale, 0), batch B*NH,
//                              strides T*hs, T*hs, T*T        -> preatt (B, NH, T, T)
//   attention_softmax_forward  preatt -> att (B, NH, T, T), causal; att[t2 > t] = 0
//   vaccum = att · v           Gemm(N, N, T, hs, T), strides T*T, T*hs, T*hs
//   attention_unpermute        vaccum (B, NH, T, hs) -> out (B, T, C)
//
// backward (dinp accumulates, like every backward kernel):
//   attention_unpermute_backward  dout (B, T, C) -> dvaccum (B, NH, T, hs)
//   datt = dvaccum · vᵀ           Gemm(N, T, T, T, hs)
//   dv   = attᵀ · dvaccum         Gemm(T, N, T, hs, T)
//   attention_softmax_backward    att, datt -> dpreatt (B, NH, T, T), already
//                                 multiplied by `scale`, i.e. the gradient of the
//                                 unscaled scores q · kᵀ
//   dq   = dpreatt · k            Gemm(N, N, T, hs, T)
//   dk   = dpreattᵀ · q           Gemm(T, N, T, hs, T)
//   attention_permute_backward    dinp (B, T, 3C) += dq | dk | dv
//
// Unlike the CPU kernel, the upper (masked) triangle of preatt is left as cuBLAS
// wrote it (the full product); att's upper triangle is 0 as on the CPU.
// All reductions use a fixed warp-shuffle butterfly: deterministic.

#define NEG_INF __int_as_float(0xff800000)

static __device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

static __device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Index helpers: element (b, h, t, i) of a (B, NH, T, hs) tensor and its place in
// the packed (B, T, 3C) qkv activation (query part; + C for key, + 2C for value).
struct HeadIndex {
    long long packed;  // offset of the query element in (B, T, 3C)
    long long unpacked;  // offset in (B, T, C) (for out / dout)
};

static __device__ __forceinline__ HeadIndex head_index(long long idx, int T, int NH, int hs) {
    const int i = (int)(idx % hs);
    long long r = idx / hs;
    const int t = (int)(r % T);
    r /= T;
    const int h = (int)(r % NH);
    const long long b = r / NH;
    const long long C = (long long)NH * hs;
    HeadIndex out;
    out.packed = (b * T + t) * 3 * C + (long long)h * hs + i;
    out.unpacked = (b * T + t) * C + (long long)h * hs + i;
    return out;
}

// q, k, v (B, NH, T, hs) <- inp (B, T, 3C)
// Launch: grid ceil(B*NH*T*hs / block), block 256.
extern "C" __global__ void attention_permute(float* __restrict__ q, float* __restrict__ k,
                                             float* __restrict__ v,
                                             const float* __restrict__ inp, int B, int T,
                                             int NH, int hs) {
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)B * NH * T * hs) return;
    const long long C = (long long)NH * hs;
    const HeadIndex h = head_index(idx, T, NH, hs);
    q[idx] = inp[h.packed];
    k[idx] = inp[h.packed + C];
    v[idx] = inp[h.packed + 2 * C];
}

// dinp (B, T, 3C) += dq | dk | dv, each (B, NH, T, hs)
// Launch: grid ceil(B*NH*T*hs / block), block 256.
extern "C" __global__ void attention_permute_backward(float* __restrict__ dinp,
                                                      const float* __restrict__ dq,
                                                      const float* __restrict__ dk,
                                                      const float* __restrict__ dv, int B,
                                                      int T, int NH, int hs) {
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)B * NH * T * hs) return;
    const long long C = (long long)NH * hs;
    const HeadIndex h = head_index(idx, T, NH, hs);
    dinp[h.packed] += dq[idx];
    dinp[h.packed + C] += dk[idx];
    dinp[h.packed + 2 * C] += dv[idx];
}

// out (B, T, C) <- vaccum (B, NH, T, hs)
// Launch: grid ceil(B*NH*T*hs / block), block 256.
extern "C" __global__ void attention_unpermute(float* __restrict__ out,
                                               const float* __restrict__ vaccum, int B, int T,
                                               int NH, int hs) {
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)B * NH * T * hs) return;
    out[head_index(idx, T, NH, hs).unpacked] = vaccum[idx];
}

// dvaccum (B, NH, T, hs) <- dout (B, T, C)   (overwrites: dvaccum is scratch)
// Launch: grid ceil(B*NH*T*hs / block), block 256.
extern "C" __global__ void attention_unpermute_backward(float* __restrict__ dvaccum,
                                                        const float* __restrict__ dout, int B,
                                                        int T, int NH, int hs) {
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)B * NH * T * hs) return;
    dvaccum[idx] = dout[head_index(idx, T, NH, hs).unpacked];
}

// att[r, t2] = exp(scale*preatt[r, t2] - max) / sum  for t2 <= t, 0 for t2 > t,
// where row r = (b*NH + h)*T + t. Pass scale = 1 when the q·kᵀ product already
// applied 1/sqrt(hs) (as above), to match the CPU kernel's scaled preatt.
//   att, preatt (B*NH, T, T)
// Launch: one warp per row: block 256 (8 rows), grid ceil(B*NH*T / 8).
extern "C" __global__ void attention_softmax_forward(float* __restrict__ att,
                                                     const float* __restrict__ preatt, int BNH,
                                                     int T, float scale) {
    const int lane = threadIdx.x & 31;
    const long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= (long long)BNH * T) return;
    const int t = (int)(row % T);
    const float* x = preatt + row * T;
    float* y = att + row * T;
    float mx = NEG_INF;
    for (int t2 = lane; t2 <= t; t2 += 32) mx = fmaxf(mx, scale * x[t2]);
    mx = warp_max(mx);
    float s = 0.0f;
    for (int t2 = lane; t2 <= t; t2 += 32) {
        const float e = expf(scale * x[t2] - mx);
        y[t2] = e;
        s += e;
    }
    const float inv = 1.0f / warp_sum(s);
    // Each lane rescales exactly the elements it wrote above: no sync needed.
    for (int t2 = lane; t2 < T; t2 += 32) y[t2] = (t2 <= t) ? y[t2] * inv : 0.0f;
}

// dpreatt[r, t2] = scale * att[r, t2] * (datt[r, t2] - sum_{t3<=t} att[r, t3]*datt[r, t3])
// for t2 <= t, 0 above the diagonal (overwrites: dpreatt is scratch).
//   dpreatt, datt, att (B*NH, T, T)
// Launch: one warp per row: block 256, grid ceil(B*NH*T / 8).
extern "C" __global__ void attention_softmax_backward(float* __restrict__ dpreatt,
                                                      const float* __restrict__ datt,
                                                      const float* __restrict__ att, int BNH,
                                                      int T, float scale) {
    const int lane = threadIdx.x & 31;
    const long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= (long long)BNH * T) return;
    const int t = (int)(row % T);
    const float* a = att + row * T;
    const float* d = datt + row * T;
    float* o = dpreatt + row * T;
    float dot = 0.0f;
    for (int t2 = lane; t2 <= t; t2 += 32) dot += a[t2] * d[t2];
    dot = warp_sum(dot);
    for (int t2 = lane; t2 < T; t2 += 32) {
        o[t2] = (t2 <= t) ? scale * (a[t2] * (d[t2] - dot)) : 0.0f;
    }
}

#include "bf16.cuh"  // bf16_t, bf16_load, bf16_store

// ---------------------------------------------------------------------------
// bf16 storage (attention_forward::<Bf16> / attention_backward::<Bf16> in
// attention.rs). The CPU computes a whole task in f32 and rounds each output
// once, so these kernels keep every intermediate in f32 (shared memory, or
// the f32 scratch) and follow the CPU's loops: dot products summed
// sequentially over the head's channels, products and sums unfused
// (__fmul_rn/__fadd_rn). They are direct loops, not cuBLAS products: slow,
// written to be checked against the CPU first. Differences left: the f64
// softmax sums are added in a warp-tree order and expf is CUDA's, so att,
// out and dinp may differ from the CPU by a bf16 ulp.
// ---------------------------------------------------------------------------

static __device__ __forceinline__ double warp_sum_d(double v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// sum_i a[i] * b[i] for i in 0..n, in order, from -0.0 (Rust's f32 Sum).
static __device__ __forceinline__ float dot_seq(const bf16_t* a, const bf16_t* b, int n) {
    float s = -0.0f;
    for (int i = 0; i < n; i++) s = __fadd_rn(s, __fmul_rn(bf16_load(a[i]), bf16_load(b[i])));
    return s;
}

// One warp per query row (b, h, ti): preatt and att rows (the causal prefix
// computed, the rest 0) and out[b, ti, h*hs..]. Shared memory: T floats.
//   out (B, T, C), preatt (B, NH, T, T), att (B, NH, T, T), inp (B, T, 3C)
// Launch: grid B*NH*T, block 32, dynamic shared memory T * 4 bytes.
extern "C" __global__ void attention_forward_bf16(bf16_t* __restrict__ out,
                                                  bf16_t* __restrict__ preatt,
                                                  bf16_t* __restrict__ att,
                                                  const bf16_t* __restrict__ inp, int B, int T,
                                                  int C, int NH) {
    extern __shared__ float row_s[];  // (T): scores, then probabilities
    const int lane = threadIdx.x;
    const long long r = blockIdx.x;  // ((b * NH + h) * T + ti)
    const int ti = (int)(r % T);
    const int h = (int)((r / T) % NH);
    const int b = (int)(r / ((long long)T * NH));
    const int hs = C / NH, C3 = 3 * C;
    const float scale = 1.0f / sqrtf((float)hs);
    const bf16_t* inp_b = inp + (long long)b * T * C3;
    const bf16_t* query = inp_b + (long long)ti * C3 + h * hs;
    bf16_t* pre_row = preatt + r * T;
    bf16_t* att_row = att + r * T;
    // pass 1: scores and their maximum
    float mx = NEG_INF;
    for (int t2 = lane; t2 < T; t2 += 32) {
        float val = 0.0f;
        if (t2 <= ti) {
            val = __fmul_rn(dot_seq(query, inp_b + (long long)t2 * C3 + C + h * hs, hs), scale);
            mx = fmaxf(mx, val);
        }
        row_s[t2] = val;
        pre_row[t2] = bf16_store(val);
    }
    mx = warp_max(mx);
    // pass 2: softmax over the causal prefix (sum in double)
    double s = 0.0;
    for (int t2 = lane; t2 <= ti; t2 += 32) {
        const float e = expf(__fadd_rn(row_s[t2], -mx));
        row_s[t2] = e;
        s += (double)e;
    }
    const float inv = (float)(1.0 / warp_sum_d(s));
    for (int t2 = lane; t2 < T; t2 += 32) {
        const float a = t2 <= ti ? __fmul_rn(row_s[t2], inv) : 0.0f;
        row_s[t2] = a;
        att_row[t2] = bf16_store(a);
    }
    __syncwarp();
    // pass 3: out = sum over t2 of att * value, in t2 order, per channel
    bf16_t* out_h = out + ((long long)b * T + ti) * C + h * hs;
    for (int i = lane; i < hs; i += 32) {
        float o = 0.0f;
        for (int t2 = 0; t2 <= ti; t2++) {
            const float v = bf16_load(inp_b[(long long)t2 * C3 + 2 * C + h * hs + i]);
            o = __fadd_rn(o, __fmul_rn(row_s[t2], v));
        }
        out_h[i] = bf16_store(o);
    }
}

// acc[i] = (float)x[i]: the f32 copy of dinp the backward accumulates into.
// Launch: grid ceil(N / block), block 256.
extern "C" __global__ void attention_widen_bf16(float* __restrict__ acc,
                                                const bf16_t* __restrict__ x, long long N) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < N) acc[i] = bf16_load(x[i]);
}

// x[i] = round(acc[i]): dinp rounded once, after every contribution.
// Launch: grid ceil(N / block), block 256.
extern "C" __global__ void attention_narrow_bf16(bf16_t* __restrict__ x,
                                                 const float* __restrict__ acc, long long N) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < N) x[i] = bf16_store(acc[i]);
}

// One block per (b, h): the head's rows ti in order, as the CPU loops, adding
// into the f32 copy `acc` of dinp (B, T, 3C). Thread i owns channel i of the
// head's q, k and v slices, so every element gets its contributions in the
// CPU's order with no other writer. Shared memory: 2 * T floats + 32 doubles.
//   acc (B, T, 3C) f32, dout (B, T, C), inp (B, T, 3C), att (B, NH, T, T)
// Launch: grid B*NH, block 64 (a multiple of 32; threads beyond hs only
// help with the t2 loops), dynamic shared memory 2 * T * 4 bytes.
extern "C" __global__ void attention_backward_bf16(float* __restrict__ acc,
                                                   const bf16_t* __restrict__ dout,
                                                   const bf16_t* __restrict__ inp,
                                                   const bf16_t* __restrict__ att, int B,
                                                   int T, int C, int NH) {
    extern __shared__ float sh[];
    float* datt = sh;      // (T)
    float* gpre = sh + T;  // (T): dpreatt * scale
    __shared__ double red[32];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, warps = blockDim.x >> 5;
    const int b = blockIdx.x / NH, h = blockIdx.x % NH;
    const int hs = C / NH, C3 = 3 * C;
    const float scale = 1.0f / sqrtf((float)hs);
    const bf16_t* inp_b = inp + (long long)b * T * C3;
    float* acc_b = acc + (long long)b * T * C3;
    for (int ti = 0; ti < T; ti++) {
        const bf16_t* att_row = att + (((long long)b * NH + h) * T + ti) * T;
        const bf16_t* dout_h = dout + ((long long)b * T + ti) * C + h * hs;
        // datt[t2] = value(t2) . dout_h, channels in order
        for (int t2 = tid; t2 <= ti; t2 += blockDim.x) {
            datt[t2] = dot_seq(inp_b + (long long)t2 * C3 + 2 * C + h * hs, dout_h, hs);
        }
        __syncthreads();
        // dot = sum over t2 of att * datt, in double (a block tree)
        double d = 0.0;
        for (int t2 = tid; t2 <= ti; t2 += blockDim.x) {
            d += (double)bf16_load(att_row[t2]) * (double)datt[t2];
        }
        d = warp_sum_d(d);
        if (lane == 0) red[warp] = d;
        __syncthreads();
        d = 0.0;
        for (int w = 0; w < warps; w++) d += red[w];
        const float dot = (float)d;
        for (int t2 = tid; t2 <= ti; t2 += blockDim.x) {
            const float dp = __fmul_rn(bf16_load(att_row[t2]), __fadd_rn(datt[t2], -dot));
            gpre[t2] = __fmul_rn(dp, scale);
        }
        __syncthreads();
        for (int i = tid; i < hs; i += blockDim.x) {
            const float g = bf16_load(dout_h[i]);
            // dv[t2] += att * g
            for (int t2 = 0; t2 <= ti; t2++) {
                float* dv = acc_b + (long long)t2 * C3 + 2 * C + h * hs + i;
                *dv = __fadd_rn(*dv, __fmul_rn(bf16_load(att_row[t2]), g));
            }
            // dq[ti] += k[t2] * g'; dk[t2] += q[ti] * g'
            const float q = bf16_load(inp_b[(long long)ti * C3 + h * hs + i]);
            float* dq = acc_b + (long long)ti * C3 + h * hs + i;
            for (int t2 = 0; t2 <= ti; t2++) {
                const float k = bf16_load(inp_b[(long long)t2 * C3 + C + h * hs + i]);
                float* dk = acc_b + (long long)t2 * C3 + C + h * hs + i;
                *dq = __fadd_rn(*dq, __fmul_rn(k, gpre[t2]));
                *dk = __fadd_rn(*dk, __fmul_rn(q, gpre[t2]));
            }
        }
        __syncthreads();  // datt, gpre and red are rewritten by the next row
    }
}

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
    long long packed;    // offset of the query element in (B, T, 3C)
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

#include "bf16.cuh"  // bf16_t, bf16_load, bf16_store, ld_f32, st_f32

// The permutes below serve f32 and bf16 storage alike (the `_bf16` wrappers
// further down): a copy is a copy, and a sum is formed in f32 and stored
// once with ld_f32/st_f32 (for f32 storage the operations of a plain `+=`).

// q, k, v (B, NH, T, hs) <- inp (B, T, 3C)
template <typename S>
static __device__ __forceinline__ void permute(S* __restrict__ q, S* __restrict__ k,
                                               S* __restrict__ v, const S* __restrict__ inp, int B,
                                               int T, int NH, int hs) {
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)B * NH * T * hs) return;
    const long long C = (long long)NH * hs;
    const HeadIndex h = head_index(idx, T, NH, hs);
    q[idx] = inp[h.packed];
    k[idx] = inp[h.packed + C];
    v[idx] = inp[h.packed + 2 * C];
}

// dinp (B, T, 3C) += dq | dk | dv, each (B, NH, T, hs)
template <typename S>
static __device__ __forceinline__ void permute_backward(S* __restrict__ dinp,
                                                        const S* __restrict__ dq,
                                                        const S* __restrict__ dk,
                                                        const S* __restrict__ dv, int B, int T,
                                                        int NH, int hs) {
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)B * NH * T * hs) return;
    const long long C = (long long)NH * hs;
    S* d = dinp + head_index(idx, T, NH, hs).packed;
    st_f32(&d[0], ld_f32(d[0]) + ld_f32(dq[idx]));
    st_f32(&d[C], ld_f32(d[C]) + ld_f32(dk[idx]));
    st_f32(&d[2 * C], ld_f32(d[2 * C]) + ld_f32(dv[idx]));
}

// out (B, T, C) <- vaccum (B, NH, T, hs)
template <typename S>
static __device__ __forceinline__ void unpermute(S* __restrict__ out, const S* __restrict__ vaccum,
                                                 int B, int T, int NH, int hs) {
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)B * NH * T * hs) return;
    out[head_index(idx, T, NH, hs).unpacked] = vaccum[idx];
}

// dvaccum (B, NH, T, hs) <- dout (B, T, C)   (overwrites: dvaccum is scratch)
template <typename S>
static __device__ __forceinline__ void unpermute_backward(S* __restrict__ dvaccum,
                                                          const S* __restrict__ dout, int B, int T,
                                                          int NH, int hs) {
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)B * NH * T * hs) return;
    dvaccum[idx] = dout[head_index(idx, T, NH, hs).unpacked];
}

// The permute kernels, f32 and bf16 storage.
// Launch: grid ceil(B*NH*T*hs / block), block 256.
extern "C" __global__ void attention_permute(float* q, float* k, float* v, const float* inp, int B,
                                             int T, int NH, int hs) {
    permute(q, k, v, inp, B, T, NH, hs);
}

extern "C" __global__ void attention_permute_backward(float* dinp, const float* dq, const float* dk,
                                                      const float* dv, int B, int T, int NH,
                                                      int hs) {
    permute_backward(dinp, dq, dk, dv, B, T, NH, hs);
}

extern "C" __global__ void attention_unpermute(float* out, const float* vaccum, int B, int T,
                                               int NH, int hs) {
    unpermute(out, vaccum, B, T, NH, hs);
}

extern "C" __global__ void attention_unpermute_backward(float* dvaccum, const float* dout, int B,
                                                        int T, int NH, int hs) {
    unpermute_backward(dvaccum, dout, B, T, NH, hs);
}

extern "C" __global__ void attention_permute_bf16(bf16_t* q, bf16_t* k, bf16_t* v,
                                                  const bf16_t* inp, int B, int T, int NH, int hs) {
    permute(q, k, v, inp, B, T, NH, hs);
}

extern "C" __global__ void attention_permute_backward_bf16(bf16_t* dinp, const bf16_t* dq,
                                                           const bf16_t* dk, const bf16_t* dv,
                                                           int B, int T, int NH, int hs) {
    permute_backward(dinp, dq, dk, dv, B, T, NH, hs);
}

extern "C" __global__ void attention_unpermute_bf16(bf16_t* out, const bf16_t* vaccum, int B, int T,
                                                    int NH, int hs) {
    unpermute(out, vaccum, B, T, NH, hs);
}

extern "C" __global__ void attention_unpermute_backward_bf16(bf16_t* dvaccum, const bf16_t* dout,
                                                             int B, int T, int NH, int hs) {
    unpermute_backward(dvaccum, dout, B, T, NH, hs);
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
                                                      const float* __restrict__ att, int BNH, int T,
                                                      float scale) {
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

// ---------------------------------------------------------------------------
// bf16 storage (attention_forward::<Bf16> / attention_backward::<Bf16>): the
// same cuBLAS formulation with bf16 operands (cublasGemmEx, f32 accumulation,
// each product rounded to bf16 once) and these bf16 twins of the kernels
// above, which compute in f32 and round what they store. Unlike the CPU bf16
// kernel, the softmax reads the scores as stored (rounded to bf16), as
// PyTorch's eager bf16 attention does; q, k, v, vaccum, datt and dpreatt are
// bf16 in the scratch. The results agree with the CPU's to bf16 tolerances,
// not bit for bit.
// ---------------------------------------------------------------------------

// attention_softmax_forward on bf16 rows: f32 maximum, exponentials and sum,
// each probability rounded once. The exponentials are recomputed in the last
// pass instead of being kept in a bf16 row (one rounding, not two).
// Launch: one warp per row: block 256 (8 rows), grid ceil(B*NH*T / 8).
extern "C" __global__ void attention_softmax_forward_bf16(bf16_t* __restrict__ att,
                                                          const bf16_t* __restrict__ preatt,
                                                          int BNH, int T, float scale) {
    const int lane = threadIdx.x & 31;
    const long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= (long long)BNH * T) return;
    const int t = (int)(row % T);
    const bf16_t* x = preatt + row * T;
    bf16_t* y = att + row * T;
    float mx = NEG_INF;
    for (int t2 = lane; t2 <= t; t2 += 32) mx = fmaxf(mx, scale * bf16_load(x[t2]));
    mx = warp_max(mx);
    float s = 0.0f;
    for (int t2 = lane; t2 <= t; t2 += 32) s += expf(scale * bf16_load(x[t2]) - mx);
    const float inv = 1.0f / warp_sum(s);
    for (int t2 = lane; t2 < T; t2 += 32) {
        y[t2] = bf16_store((t2 <= t) ? expf(scale * bf16_load(x[t2]) - mx) * inv : 0.0f);
    }
}

// attention_softmax_backward on bf16 rows (f32 arithmetic, one rounding).
// Launch: one warp per row: block 256, grid ceil(B*NH*T / 8).
extern "C" __global__ void attention_softmax_backward_bf16(bf16_t* __restrict__ dpreatt,
                                                           const bf16_t* __restrict__ datt,
                                                           const bf16_t* __restrict__ att, int BNH,
                                                           int T, float scale) {
    const int lane = threadIdx.x & 31;
    const long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= (long long)BNH * T) return;
    const int t = (int)(row % T);
    const bf16_t* a = att + row * T;
    const bf16_t* d = datt + row * T;
    bf16_t* o = dpreatt + row * T;
    float dot = 0.0f;
    for (int t2 = lane; t2 <= t; t2 += 32) dot += bf16_load(a[t2]) * bf16_load(d[t2]);
    dot = warp_sum(dot);
    for (int t2 = lane; t2 < T; t2 += 32) {
        const float g = (t2 <= t) ? scale * (bf16_load(a[t2]) * (bf16_load(d[t2]) - dot)) : 0.0f;
        o[t2] = bf16_store(g);
    }
}

// Decoding one position with a KV cache (attention_decode in attention.rs):
// out (C) = the last row's attention over the packed rows inp (T, 3C), from
// the last row's query and every row's key and value. One block per head;
// the scores sit in shared memory (T <= DECODE_MAX_T floats), the maximum
// and the sum are block reductions, and each thread forms some of the
// head's hs outputs as the CPU does: p = exp(s - max) / sum, out = Σ p · v.
// f32 arithmetic; the CPU's sum of exponentials is f64, so the two agree to
// float tolerance, not bit for bit.
// Launch: grid NH, block DECODE_BLOCK (any multiple of 32 works).
#define DECODE_BLOCK 128
#define DECODE_MAX_T 4096

// The block's maximum (max) or sum of v, on every thread; `red` holds 32.
static __device__ __forceinline__ float decode_block_reduce(float v, float* red, bool max) {
    v = max ? warp_max(v) : warp_sum(v);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();  // `red` may still be read from the last reduction
    if (lane == 0) red[warp] = v;
    __syncthreads();
    if (warp == 0) {
        const int warps = (blockDim.x + 31) >> 5;
        v = lane < warps ? red[lane] : (max ? NEG_INF : 0.0f);
        v = max ? warp_max(v) : warp_sum(v);
        if (lane == 0) red[0] = v;
    }
    __syncthreads();
    return red[0];
}

template <typename S>
static __device__ __forceinline__ void decode(S* __restrict__ out, const S* __restrict__ inp,
                                              int T, int C, int NH) {
    __shared__ float scores[DECODE_MAX_T];  // (T)
    __shared__ float red[32];
    if ((int)blockIdx.x >= NH) return;  // (the whole block)
    const int h = blockIdx.x, hs = C / NH;
    const long long C3 = 3LL * C;
    const float scale = 1.0f / sqrtf((float)hs);
    const S* q = inp + (long long)(T - 1) * C3 + (long long)h * hs;
    float mx = NEG_INF;
    for (int j = threadIdx.x; j < T; j += blockDim.x) {
        const S* k = inp + (long long)j * C3 + C + (long long)h * hs;
        float dot = 0.0f;
        for (int i = 0; i < hs; i++) dot += ld_f32(q[i]) * ld_f32(k[i]);
        const float s = dot * scale;
        scores[j] = s;
        mx = fmaxf(mx, s);
    }
    mx = decode_block_reduce(mx, red, true);
    float sum = 0.0f;
    for (int j = threadIdx.x; j < T; j += blockDim.x) {
        const float e = expf(scores[j] - mx);
        scores[j] = e;
        sum += e;
    }
    // (The reduction's barriers also make every score visible to all.)
    const float inv = 1.0f / decode_block_reduce(sum, red, false);
    for (int d = threadIdx.x; d < hs; d += blockDim.x) {
        float acc = 0.0f;
        for (int j = 0; j < T; j++) {
            acc += (scores[j] * inv) * ld_f32(inp[(long long)j * C3 + 2 * C + (long long)h * hs + d]);
        }
        st_f32(&out[(long long)h * hs + d], acc);
    }
}

extern "C" __global__ void attention_decode(float* __restrict__ out, const float* __restrict__ inp,
                                            int T, int C, int NH) {
    decode(out, inp, T, C, NH);
}

extern "C" __global__ void attention_decode_bf16(bf16_t* __restrict__ out,
                                                 const bf16_t* __restrict__ inp, int T, int C,
                                                 int NH) {
    decode(out, inp, T, C, NH);
}

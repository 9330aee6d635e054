// Fused causal self-attention (FlashAttention-2's algorithm), fp32 and bf16
// storage. Semantics: models/gpt2/src/kernels/flash_attention.rs, whose CPU
// kernels these follow operation by operation: the same dot products (f32,
// in channel order, no FMA contraction), the same online-softmax updates per
// key tile of block_k columns, the same accumulation orders. Only expf/logf
// are CUDA's rather than the CPU's libm, so results agree to float tolerance.
//
// A first version to check against the CPU: one thread per query row (or key
// row), plain loads, no tensor cores, no shared-memory tiles. Deterministic:
// every output element is written by one thread, no atomics.
//
//   inp (B, T, 3C): per position the C query, C key, C value channels; head h
//   owns channels h*hs .. (h+1)*hs of each. out, dout (B, T, C); lse, delta
//   (B, NH, T) f32; hs = C / NH <= FA_MAX_HS.

#include "bf16.cuh"  // bf16_t, bf16_load, bf16_store, ld_f32, st_f32

#define FA_MAX_HS 128
#define NEG_INF __int_as_float(0xff800000)

// a . b over hs channels, summed in channel order (the CPU's `dot`).
template <typename S>
static __device__ __forceinline__ float fa_dot(const float* a, const S* b, int hs) {
    float s = 0.0f;
    for (int d = 0; d < hs; d++) s = __fadd_rn(s, __fmul_rn(a[d], ld_f32(b[d])));
    return s;
}

template <typename S>
static __device__ __forceinline__ float fa_dot2(const S* a, const S* b, int hs) {
    float s = 0.0f;
    for (int d = 0; d < hs; d++) s = __fadd_rn(s, __fmul_rn(ld_f32(a[d]), ld_f32(b[d])));
    return s;
}

// The row (query or key position) a thread owns, its batch row and head,
// and the head's shape; false for a thread past the end. Every kernel here
// launches a thread per row: grid (ceil(T / blockDim.x), B * NH).
struct FaThread {
    int row, b, h, hs, C3;
    float scale;  // 1 / sqrt(hs), as the CPU computes it
};

static __device__ __forceinline__ bool fa_thread(int B, int T, int C, int NH, FaThread* t) {
    t->row = blockIdx.x * blockDim.x + threadIdx.x;
    t->b = blockIdx.y / NH;
    t->h = blockIdx.y % NH;
    t->hs = C / NH;
    t->C3 = 3 * C;
    t->scale = 1.0f / sqrtf((float)t->hs);
    return t->row < T && t->b < B;
}

// Forward: thread (b, h, i) walks the key tiles k0 = 0, block_k, ... of its
// causal prefix; per tile, the scores of keys k0 .. min(k0 + block_k, i + 1),
// their max, the running max m and sum l rescaled by expf(m - m_new), acc
// rescaled the same way, then each key's p = expf(s - m_new) added to l and
// p * v to acc (flash_attention_forward_f32's loop). out = acc * (1 / l),
// lse = m + logf(l).
// Launch: grid (ceil(T / 128), B * NH), block 128.
template <typename S>
static __device__ void fa_forward(S* __restrict__ out, float* __restrict__ lse,
                                  const S* __restrict__ inp, int B, int T, int C, int NH,
                                  int block_k) {
    FaThread th;
    if (!fa_thread(B, T, C, NH, &th)) return;
    const int i = th.row, b = th.b, h = th.h, hs = th.hs, C3 = th.C3;
    const float scale = th.scale;
    const S* base = inp + (long long)b * T * C3;
    float q[FA_MAX_HS], acc[FA_MAX_HS];
    for (int d = 0; d < hs; d++) {
        q[d] = ld_f32(base[(long long)i * C3 + h * hs + d]);
        acc[d] = 0.0f;
    }
    float m = NEG_INF, l = 0.0f;
    for (int k0 = 0; k0 <= i; k0 += block_k) {
        const int kend = min(k0 + block_k, i + 1);
        float rowmax = NEG_INF;
        for (int j = k0; j < kend; j++) {
            const float x = __fmul_rn(fa_dot(q, base + (long long)j * C3 + C + h * hs, hs), scale);
            rowmax = fmaxf(rowmax, x);
        }
        const float m_new = fmaxf(m, rowmax);
        const float corr = expf(__fadd_rn(m, -m_new));  // 0 on the first tile
        float sum = __fmul_rn(l, corr);
        for (int d = 0; d < hs; d++) acc[d] = __fmul_rn(acc[d], corr);
        for (int j = k0; j < kend; j++) {
            const S* kj = base + (long long)j * C3 + C + h * hs;
            const S* vj = base + (long long)j * C3 + 2 * C + h * hs;
            const float x = __fmul_rn(fa_dot(q, kj, hs), scale);
            const float p = expf(__fadd_rn(x, -m_new));
            sum = __fadd_rn(sum, p);
            for (int d = 0; d < hs; d++) acc[d] = __fadd_rn(acc[d], __fmul_rn(p, ld_f32(vj[d])));
        }
        m = m_new;
        l = sum;
    }
    const float inv = 1.0f / l;
    S* o = out + ((long long)b * T + i) * C + h * hs;
    for (int d = 0; d < hs; d++) st_f32(&o[d], __fmul_rn(acc[d], inv));
    lse[((long long)b * NH + h) * T + i] = __fadd_rn(m, logf(l));
}

// 16 bytes of S: 8 bf16 or 4 f32.
struct alignas(16) fa_vec16 {
    unsigned int w[4];
};

// fa_dot2 of two 16-byte aligned rows of hs (a multiple of 16 / sizeof(S))
// elements, read 16 bytes at a time: the same products summed in the same
// (channel) order, so the same bits.
template <typename S>
static __device__ __forceinline__ float fa_dot2_vec(const S* a, const S* b, int hs) {
    constexpr int VEC = 16 / (int)sizeof(S);
    float s = 0.0f;
    for (int d0 = 0; d0 < hs; d0 += VEC) {
        fa_vec16 va, vb;
#ifdef BRAID_KERNEL_EMU
        if ((((unsigned long long)(a + d0)) | ((unsigned long long)(b + d0))) & 15ull) __trap();
        memcpy(&va, a + d0, sizeof va);
        memcpy(&vb, b + d0, sizeof vb);
#else
        va = *reinterpret_cast<const fa_vec16*>(a + d0);
        vb = *reinterpret_cast<const fa_vec16*>(b + d0);
#endif
        const S* xa = reinterpret_cast<const S*>(&va);
        const S* xb = reinterpret_cast<const S*>(&vb);
#pragma unroll
        for (int e = 0; e < VEC; e++) s = __fadd_rn(s, __fmul_rn(ld_f32(xa[e]), ld_f32(xb[e])));
    }
    return s;
}

// delta[b, h, i] = dout_i . out_i over the head's channels; 16-byte loads
// where both rows are 16-byte aligned and hs a multiple of the vector (the
// model's: C and hs multiples of 8), element by element otherwise, the same
// bits either way.
// Launch: grid (ceil(T / 128), B * NH), block 128.
template <typename S>
static __device__ void fa_delta(float* __restrict__ delta, const S* __restrict__ dout,
                                const S* __restrict__ out, int B, int T, int C, int NH) {
    FaThread th;
    if (!fa_thread(B, T, C, NH, &th)) return;
    const int i = th.row, b = th.b, h = th.h, hs = th.hs;
    const long long row = ((long long)b * T + i) * C + h * hs;
    const S *a = dout + row, *o = out + row;
    const bool vec = hs % (16 / (int)sizeof(S)) == 0 &&
                     ((((unsigned long long)a) | ((unsigned long long)o)) & 15ull) == 0;
    delta[((long long)b * NH + h) * T + i] = vec ? fa_dot2_vec(a, o, hs) : fa_dot2(a, o, hs);
}

// P and dS of one (query i, key j <= i) pair, as the CPU's backward tile:
// p = expf(q_i . k_j * scale - lse_i), ds = p * (dout_i . v_j - delta_i).
template <typename S>
static __device__ __forceinline__ void fa_p_ds(const S* base, const S* dout_i, int i, int j,
                                               int h, int hs, int C, float scale, float lse_i,
                                               float delta_i, float* p, float* ds) {
    const int C3 = 3 * C;
    const S* qi = base + (long long)i * C3 + h * hs;
    const S* kj = base + (long long)j * C3 + C + h * hs;
    const S* vj = base + (long long)j * C3 + 2 * C + h * hs;
    *p = expf(__fadd_rn(__fmul_rn(fa_dot2(qi, kj, hs), scale), -lse_i));
    *ds = __fmul_rn(*p, __fadd_rn(fa_dot2(dout_i, vj, hs), -delta_i));
}

// dQ: thread (b, h, i) adds sum over j <= i (ascending) of ds_ij * scale * k_j
// into dinp's query channels (loaded once, rounded once on store; with
// accumulate 0 not read: the sum starts from 0, as over a zeroed dinp).
// Launch: grid (ceil(T / 128), B * NH), block 128.
template <typename S>
static __device__ void fa_backward_dq(S* __restrict__ dinp, const float* __restrict__ delta,
                                      const S* __restrict__ dout, const S* __restrict__ inp,
                                      const float* __restrict__ lse, int B, int T, int C,
                                      int NH, int accumulate) {
    FaThread th;
    if (!fa_thread(B, T, C, NH, &th)) return;
    const int i = th.row, b = th.b, h = th.h, hs = th.hs, C3 = th.C3;
    const float scale = th.scale;
    const S* base = inp + (long long)b * T * C3;
    const S* dout_i = dout + ((long long)b * T + i) * C + h * hs;
    const long long r = ((long long)b * NH + h) * T + i;
    S* dq = dinp + ((long long)b * T + i) * C3 + h * hs;
    float acc[FA_MAX_HS];
    for (int d = 0; d < hs; d++) acc[d] = accumulate ? ld_f32(dq[d]) : 0.0f;
    for (int j = 0; j <= i; j++) {
        float p, ds;
        fa_p_ds(base, dout_i, i, j, h, hs, C, scale, lse[r], delta[r], &p, &ds);
        const float g = __fmul_rn(ds, scale);
        if (g == 0.0f) continue;
        const S* kj = base + (long long)j * C3 + C + h * hs;
        for (int d = 0; d < hs; d++) acc[d] = __fadd_rn(acc[d], __fmul_rn(g, ld_f32(kj[d])));
    }
    for (int d = 0; d < hs; d++) st_f32(&dq[d], acc[d]);
}

// dK, dV: thread (b, h, j) sums over i >= j (ascending) p_ij * dout_i into dv
// and ds_ij * scale * q_i into dk, from zero, then adds them into dinp's key
// and value channels (the CPU's per-tile accumulators, added once; to 0 with
// accumulate 0, dinp not read).
// Launch: grid (ceil(T / 128), B * NH), block 128.
template <typename S>
static __device__ void fa_backward_dkv(S* __restrict__ dinp, const float* __restrict__ delta,
                                       const S* __restrict__ dout, const S* __restrict__ inp,
                                       const float* __restrict__ lse, int B, int T, int C,
                                       int NH, int accumulate) {
    FaThread th;
    if (!fa_thread(B, T, C, NH, &th)) return;
    const int j = th.row, b = th.b, h = th.h, hs = th.hs, C3 = th.C3;
    const float scale = th.scale;
    const S* base = inp + (long long)b * T * C3;
    float dk[FA_MAX_HS], dv[FA_MAX_HS];
    for (int d = 0; d < hs; d++) {
        dk[d] = 0.0f;
        dv[d] = 0.0f;
    }
    for (int i = j; i < T; i++) {
        const S* dout_i = dout + ((long long)b * T + i) * C + h * hs;
        const long long r = ((long long)b * NH + h) * T + i;
        float p, ds;
        fa_p_ds(base, dout_i, i, j, h, hs, C, scale, lse[r], delta[r], &p, &ds);
        const float g = __fmul_rn(ds, scale);
        if (p == 0.0f && g == 0.0f) continue;
        const S* qi = base + (long long)i * C3 + h * hs;
        for (int d = 0; d < hs; d++) {
            dv[d] = __fadd_rn(dv[d], __fmul_rn(p, ld_f32(dout_i[d])));
            dk[d] = __fadd_rn(dk[d], __fmul_rn(g, ld_f32(qi[d])));
        }
    }
    S* dkj = dinp + ((long long)b * T + j) * C3 + C + h * hs;
    S* dvj = dinp + ((long long)b * T + j) * C3 + 2 * C + h * hs;
    for (int d = 0; d < hs; d++) {
        st_f32(&dkj[d], __fadd_rn(accumulate ? ld_f32(dkj[d]) : 0.0f, dk[d]));
        st_f32(&dvj[d], __fadd_rn(accumulate ? ld_f32(dvj[d]) : 0.0f, dv[d]));
    }
}

extern "C" __global__ void flash_attention_forward(float* out, float* lse, const float* inp, int B,
                                                   int T, int C, int NH, int block_k) {
    fa_forward(out, lse, inp, B, T, C, NH, block_k);
}

extern "C" __global__ void flash_attention_forward_bf16(bf16_t* out, float* lse,
                                                        const bf16_t* inp, int B, int T, int C,
                                                        int NH, int block_k) {
    fa_forward(out, lse, inp, B, T, C, NH, block_k);
}

extern "C" __global__ void flash_attention_delta(float* delta, const float* dout,
                                                 const float* out, int B, int T, int C, int NH) {
    fa_delta(delta, dout, out, B, T, C, NH);
}

extern "C" __global__ void flash_attention_delta_bf16(float* delta, const bf16_t* dout,
                                                      const bf16_t* out, int B, int T, int C,
                                                      int NH) {
    fa_delta(delta, dout, out, B, T, C, NH);
}

extern "C" __global__ void flash_attention_backward_dq(float* dinp, const float* delta,
                                                       const float* dout, const float* inp,
                                                       const float* lse, int B, int T, int C,
                                                       int NH, int accumulate) {
    fa_backward_dq(dinp, delta, dout, inp, lse, B, T, C, NH, accumulate);
}

extern "C" __global__ void flash_attention_backward_dq_bf16(bf16_t* dinp, const float* delta,
                                                            const bf16_t* dout,
                                                            const bf16_t* inp, const float* lse,
                                                            int B, int T, int C, int NH,
                                                            int accumulate) {
    fa_backward_dq(dinp, delta, dout, inp, lse, B, T, C, NH, accumulate);
}

extern "C" __global__ void flash_attention_backward_dkv(float* dinp, const float* delta,
                                                        const float* dout, const float* inp,
                                                        const float* lse, int B, int T, int C,
                                                        int NH, int accumulate) {
    fa_backward_dkv(dinp, delta, dout, inp, lse, B, T, C, NH, accumulate);
}

extern "C" __global__ void flash_attention_backward_dkv_bf16(bf16_t* dinp, const float* delta,
                                                             const bf16_t* dout,
                                                             const bf16_t* inp,
                                                             const float* lse, int B, int T,
                                                             int C, int NH, int accumulate) {
    fa_backward_dkv(dinp, delta, dout, inp, lse, B, T, C, NH, accumulate);
}

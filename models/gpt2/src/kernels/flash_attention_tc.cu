// Fused causal self-attention on tensor cores (FlashAttention-2), bf16
// storage, head size HS of 16, 32 or 64 (a template; one set of kernels
// each, `_hs<HS>` in their names). The same algorithm as flash_attention.cu and the CPU
// kernels of flash_attention.rs (online softmax over key tiles, probabilities
// recomputed from the saved logsumexp in the backward pass), with every
// product of the algorithm a warp-level mma.sync m16n8k16 (bf16 operands, f32
// accumulation). The order of the sums inside an MMA is the hardware's, so
// results agree with the CPU to bf16 tolerance, not bit for bit.
//
//   inp (B, T, 3C) bf16: per position the C query, C key, C value channels;
//   head h owns channels h*HS .. h*HS+HS-1 of each. out, dout (B, T, C) bf16;
//   lse, delta (B, NH, T) f32. dinp (B, T, 3C) bf16 is accumulated: each
//   element is loaded, its gradient added in f32, and stored once (with the
//   backward kernels' `accumulate` 0, added to 0 and stored: not read).
//
// Blocks of 4 warps. The forward and dQ kernels give a block 64 query rows
// (16 per warp) and walk the 64-key tiles of their causal prefix; the dK/dV
// kernel gives a block 64 keys (16 per warp) and walks the query tiles at
// and below the diagonal. Each tile of K and V (or Q and dout) is staged in
// shared memory by the whole block; each warp keeps its own 16 rows of Q (or
// K, V, dout) in registers as MMA A fragments. Every output element is
// written by one thread, no atomics: deterministic.
//
// Needs sm_80 or newer (bf16 mma.sync), C a multiple of 8 and every pointer
// 16-byte aligned (tiles are copied 16 bytes at a time): the launcher checks
// and otherwise runs flash_attention.cu's kernels.
//
// The MMA fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16 with
// floating point type"), with g = lane / 4 and t = lane % 4, two bf16 per
// 32-bit register, the lower-indexed element in the low half:
//   A (16 x 16): a[0] = A[g][2t..2t+1],   a[1] = A[g+8][2t..2t+1],
//                a[2] = A[g][2t+8..2t+9], a[3] = A[g+8][2t+8..2t+9]
//   B (16 x 8):  b[0] = B[2t..2t+1][g],   b[1] = B[2t+8..2t+9][g]
//   C (16 x 8):  c[0..1] = C[g][2t..2t+1], c[2..3] = C[g+8][2t..2t+1]
// so the accumulators of two adjacent 8-column tiles of a product are,
// rounded to bf16, the A fragment of the next product's 16-wide k step.

#include "bf16.cuh"  // bf16_t, bf16_load, bf16_store

#define TC_ROWS 64         // query (or key) rows of a block
#define TC_TILE 64         // keys (or queries) of a shared-memory tile
#define TC_THREADS 128     // 4 warps of 16 rows
#define TC_NT (TC_TILE / 8)  // 8-wide column tiles over a tile's keys
#define TC_NEG_INF __int_as_float(0xff800000)

// Per head size HS: the shared-memory row stride in bf16 (padded by 16
// bytes to spread the banks), the 16-wide k steps and the 8-wide column
// tiles over the head's channels.
#define TC_LD (HS + 8)
#define TC_KSTEPS (HS / 16)
#define TC_NCH (HS / 8)

#include "mma.cuh"  // mma_bf16_16816, ldmatrix_x4[_trans] (the engine's header)

// The backward kernels walk a staged 64-row tile in chunks of TC_BWD_CHUNK
// keys (dQ) or queries (dK, dV), 16, 32 or 64: per chunk the slices of S
// and dP, then their products into the accumulators. A chunk of 64 is the
// whole tile at once, as the forward kernel does; a smaller one keeps fewer
// of S's and dP's accumulators live (16 registers a thread at 16, against
// 64), for more blocks an SM. Every accumulator gets the same MMAs in the
// same order for any chunk, so the results are bit-identical; only
// all-masked chunks on the diagonal are skipped (their products are zero).
// A tuning experiment sets it through BRAID_NVRTC_OPTIONS (docs/cuda.md).
#ifndef TC_BWD_CHUNK
#define TC_BWD_CHUNK 64
#endif
#if TC_BWD_CHUNK != 16 && TC_BWD_CHUNK != 32 && TC_BWD_CHUNK != 64
#error "TC_BWD_CHUNK is 16, 32 or 64"
#endif
#define TC_CNT (TC_BWD_CHUNK / 8)  // 8-wide column tiles of a chunk

// The chunks of a diagonal tile that hold a key at or before tile row
// `last` (a warp's last query row): the rest are masked for the warp.
static __device__ __forceinline__ int tc_chunks_to(int last) { return last / TC_BWD_CHUNK + 1; }

#ifndef BRAID_KERNEL_EMU
// 16 bytes from global src to shared dst (both 16-byte aligned), without
// going through registers: issued now, landed after tc_async_wait*.
static __device__ __forceinline__ void tc_copy16_async(void* dst, const void* src) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(a), "l"(src));
}

// The same for one 4-byte-aligned float.
static __device__ __forceinline__ void tc_copy4_async(float* dst, const float* src) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(a), "l"(src));
}

// Closes the group of this thread's copies issued since the last commit.
static __device__ __forceinline__ void tc_async_commit() {
    asm volatile("cp.async.commit_group;");
}

// Waits for every group of this thread's copies but the newest: the copies
// of the tile before the one just prefetched. The tile is visible to the
// block after a __syncthreads.
static __device__ __forceinline__ void tc_async_wait_prev() {
    asm volatile("cp.async.wait_group 1;" ::: "memory");
}

// Two adjacent bf16 elements (4-byte aligned) as one register, the first in
// the low half: one 32-bit load.
static __device__ __forceinline__ unsigned tc_ld2(const bf16_t* p) {
    return *reinterpret_cast<const unsigned*>(p);
}

#else
// The emulator copies at once: a buffer overwritten while another thread
// still reads it (a missing barrier) changes the results of one of the
// two orders every launch runs in.
static inline void tc_copy16_async(void* dst, const void* src) { memcpy(dst, src, 16); }

static inline void tc_copy4_async(float* dst, const float* src) { *dst = *src; }

static inline void tc_async_commit() {}

static inline void tc_async_wait_prev() {}

static inline unsigned tc_ld2(const bf16_t* p) { return (unsigned)p[0] | ((unsigned)p[1] << 16); }
#endif

// Two bf16 elements as one register: lo in the low half.
static __device__ __forceinline__ unsigned tc_pack(bf16_t lo, bf16_t hi) {
    return (unsigned)lo | ((unsigned)hi << 16);
}

static __device__ __forceinline__ unsigned tc_pack_f32(float lo, float hi) {
    return tc_pack(bf16_store(lo), bf16_store(hi));
}

// The pair (row, col), (row, col + 1) of a row-major bf16 matrix with row
// stride ld, as a register; 0 for a row at or past `rows` (padding rows).
// col and ld are even and m 4-byte aligned, so the pair is one load.
static __device__ __forceinline__ unsigned tc_pair(const bf16_t* m, long long ld, int row,
                                                   int rows, int col) {
    if (row >= rows) return 0u;
    return tc_ld2(m + (long long)row * ld + col);
}

// The A fragments of a 16 x HS row block of a (T, ld) bf16 matrix starting
// at row r0 (rows at or past T read as zero): one 16-wide k step per entry.
template <int HS>
static __device__ __forceinline__ void tc_load_a(unsigned a[TC_KSTEPS][4], const bf16_t* m,
                                                 long long ld, int r0, int rows, int lane) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int ks = 0; ks < TC_KSTEPS; ks++) {
        const int col = ks * 16 + 2 * t;
        a[ks][0] = tc_pair(m, ld, r0 + g, rows, col);
        a[ks][1] = tc_pair(m, ld, r0 + g + 8, rows, col);
        a[ks][2] = tc_pair(m, ld, r0 + g, rows, col + 8);
        a[ks][3] = tc_pair(m, ld, r0 + g + 8, rows, col + 8);
    }
}

// Starts staging rows row0 .. row0 + 63 of a head's HS channels (global
// rows of stride ld, the head's first channel at src) into a shared tile of
// stride TC_LD, as asynchronous copies of this thread's group; rows at or
// past T are zeroed at once. The whole block takes part. The tiles are
// double-buffered: a block copies the next tile while it computes on this
// one (tc_async_commit, tc_async_wait_prev, __syncthreads; FlashAttention-2's
// pipeline).
template <int HS>
static __device__ __forceinline__ void tc_stage(bf16_t* tile, const bf16_t* src, long long ld,
                                                int row0, int T) {
    // HS / 8 chunks of 16 bytes per row, 64 rows.
    constexpr int chunks = HS / 8;
    for (int i = threadIdx.x; i < TC_TILE * chunks; i += TC_THREADS) {
        const int r = i / chunks, chunk = i % chunks;
        bf16_t* dst = tile + r * TC_LD + chunk * 8;
        if (row0 + r < T) {
            tc_copy16_async(dst, src + (long long)(row0 + r) * ld + chunk * 8);
        } else {
            for (int e = 0; e < 8; e++) dst[e] = 0;
        }
    }
}

// acc = A · Xᵀ over a 16 x HS A (fragments a) and NT * 8 rows of a shared
// x HS tile X (from row x on) read as B[k][n] = X[n][k]: NT * 8 columns n in
// 8-wide tiles. For Q Kᵀ (X = K tile), dout Vᵀ (X = V tile), and their
// transposes in the dK/dV kernel.
template <int HS, int NT>
static __device__ __forceinline__ void tc_mma_xt(float acc[NT][4],
                                                 const unsigned a[TC_KSTEPS][4],
                                                 const bf16_t* x, int lane) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
#pragma unroll
        for (int e = 0; e < 4; e++) acc[nt][e] = 0.0f;
        if constexpr (TC_KSTEPS % 2 == 0) {
            // Two k steps' B registers in one ldmatrix: lane l gives row
            // nt * 8 + l % 8, columns (l / 8) * 8 on (then + 32 per pair).
            const bf16_t* row = x + (nt * 8 + (lane & 7)) * TC_LD + (lane >> 3) * 8;
#pragma unroll
            for (int ks = 0; ks < TC_KSTEPS; ks += 2) {
                unsigned b[4];
                ldmatrix_x4(b, row + ks * 16);
                mma_bf16_16816(acc[nt], a[ks], b);
                mma_bf16_16816(acc[nt], a[ks + 1], b + 2);
            }
        } else {
            const bf16_t* row = x + (nt * 8 + g) * TC_LD + 2 * t;
#pragma unroll
            for (int ks = 0; ks < TC_KSTEPS; ks++) {
                unsigned b[2];
                b[0] = tc_ld2(row + ks * 16);
                b[1] = tc_ld2(row + ks * 16 + 8);
                mma_bf16_16816(acc[nt], a[ks], b);
            }
        }
    }
}

// out += P · X over a 16 x (NT * 8) P held as accumulators p (rounded to
// bf16 here) and NT * 8 rows of a shared x HS tile X (from row x on) read as
// B[k][n] = X[k][n], in 16-wide k steps in ascending order. For P V, dS K,
// Pᵀ dout and dSᵀ Q.
template <int HS, int NT>
static __device__ __forceinline__ void tc_mma_px(float out[TC_NCH][4], const float p[NT][4],
                                                 const bf16_t* x, int lane) {
    static_assert(NT % 2 == 0, "whole 16-wide k steps");
#pragma unroll
    for (int j = 0; j < NT / 2; j++) {
        unsigned a[4];
        a[0] = tc_pack_f32(p[2 * j][0], p[2 * j][1]);
        a[1] = tc_pack_f32(p[2 * j][2], p[2 * j][3]);
        a[2] = tc_pack_f32(p[2 * j + 1][0], p[2 * j + 1][1]);
        a[3] = tc_pack_f32(p[2 * j + 1][2], p[2 * j + 1][3]);
        // The B registers of two column tiles in one ldmatrix: lane l gives
        // row j * 16 + l % 16, columns (l / 16) * 8 on, so matrices 0 and 1
        // are k rows 0-7 and 8-15 of column tile nc, 2 and 3 those of nc + 1.
        const bf16_t* row = x + (j * 16 + (lane & 15)) * TC_LD + (lane >> 4) * 8;
#pragma unroll
        for (int nc = 0; nc < TC_NCH; nc += 2) {
            unsigned b[4];
            ldmatrix_x4_trans(b, row + nc * 8);
            mma_bf16_16816(out[nc], a, b);
            mma_bf16_16816(out[nc + 1], a, b + 2);
        }
    }
}

// Sum over the four lanes of a quad (the lanes that hold one row).
static __device__ __forceinline__ float tc_quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

static __device__ __forceinline__ float tc_quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

// The block's tile index: reversed for the kernels whose last tiles carry
// the most work (the causal prefix grows with the query tile), so the
// longest blocks start first.
static __device__ __forceinline__ int tc_tile_desc() { return gridDim.x - 1 - blockIdx.x; }

// Adds acc (scaled) into a head's HS channels of rows r (c[0..1]) and r + 8
// (c[2..3]) of a bf16 matrix with row stride ld: load, add in f32, store;
// with accumulate 0, added to 0 (the bits over a zeroed matrix), no load.
template <int HS>
static __device__ __forceinline__ void tc_accumulate(bf16_t* m, long long ld, int r, int T,
                                                     const float acc[TC_NCH][4], float scale,
                                                     int lane, int accumulate) {
    const int t = lane & 3;
#pragma unroll
    for (int half = 0; half < 2; half++) {
        const int row = r + 8 * half;
        if (row >= T) continue;
        bf16_t* p = m + (long long)row * ld + 2 * t;
#pragma unroll
        for (int nc = 0; nc < TC_NCH; nc++) {
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const float x = acc[nc][2 * half + e] * scale;
                const float base = accumulate ? bf16_load(p[nc * 8 + e]) : 0.0f;
                p[nc * 8 + e] = bf16_store(base + x);
            }
        }
    }
}

// Forward. Block (query tile qt, b * NH + h); warp w owns query rows
// qt * 64 + 16w .. +15; the thread's rows are r0 = that + g and r0 + 8.
// Per key tile: S = Q Kᵀ * scale (masked where key > query), the running
// max m and sum l per row updated and the accumulator o rescaled by
// exp(m - m_new), then o += P V with P = exp(S - m_new) in bf16. At the end
// out = o / l and lse = m + ln l.
template <int HS>
static __device__ void tc_forward(bf16_t* __restrict__ out, float* __restrict__ lse,
                                  const bf16_t* __restrict__ inp, int T, int C, int NH) {
    alignas(16) __shared__ bf16_t ks_tile[2][TC_TILE * TC_LD];
    alignas(16) __shared__ bf16_t vs_tile[2][TC_TILE * TC_LD];
    const int qt = tc_tile_desc();
    const int b = blockIdx.y / NH, h = blockIdx.y % NH;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const long long C3 = 3LL * C;
    const bf16_t* q = inp + (long long)b * T * C3 + h * HS;
    const bf16_t* k = q + C;
    const bf16_t* v = q + 2 * C;
    const int r0 = qt * TC_ROWS + warp * 16 + g;  // this thread's rows: r0, r0 + 8
    const float scale = 1.0f / sqrtf((float)HS);

    tc_stage<HS>(ks_tile[0], k, C3, 0, T);
    tc_stage<HS>(vs_tile[0], v, C3, 0, T);
    tc_async_commit();
    unsigned qa[TC_KSTEPS][4];
    tc_load_a<HS>(qa, q, C3, r0 - g, T, lane);
    float o[TC_NCH][4];
#pragma unroll
    for (int nc = 0; nc < TC_NCH; nc++)
        for (int e = 0; e < 4; e++) o[nc][e] = 0.0f;
    float m[2] = {TC_NEG_INF, TC_NEG_INF}, l[2] = {0.0f, 0.0f};

    for (int kt = 0; kt <= qt; kt++) {
        const int buf = kt & 1;
        if (kt < qt) {  // prefetch the next tile into the other buffer
            tc_stage<HS>(ks_tile[buf ^ 1], k, C3, (kt + 1) * TC_TILE, T);
            tc_stage<HS>(vs_tile[buf ^ 1], v, C3, (kt + 1) * TC_TILE, T);
        }
        tc_async_commit();
        tc_async_wait_prev();
        __syncthreads();  // tile kt has landed, every thread's part of it
        float s[TC_NT][4];
        tc_mma_xt<HS, TC_NT>(s, qa, ks_tile[buf], lane);
        float mx[2] = {TC_NEG_INF, TC_NEG_INF};
        // Only the diagonal tile has keys past a row (and past T: a tile
        // below the diagonal ends before the block's first row).
        const bool diagonal = kt == qt;
#pragma unroll
        for (int nt = 0; nt < TC_NT; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int key = kt * TC_TILE + nt * 8 + 2 * t + (e & 1);
                const int row = r0 + 8 * (e >> 1);
                const float x = diagonal && key > row ? TC_NEG_INF : s[nt][e] * scale;
                s[nt][e] = x;
                mx[e >> 1] = fmaxf(mx[e >> 1], x);
            }
        float corr[2];
#pragma unroll
        for (int i = 0; i < 2; i++) {
            // Key kt * 64 <= every row of this block: each row has a finite max.
            const float m_new = fmaxf(m[i], tc_quad_max(mx[i]));
            corr[i] = __expf(m[i] - m_new);  // 0 on the first tile
            m[i] = m_new;
            l[i] *= corr[i];
        }
#pragma unroll
        for (int nc = 0; nc < TC_NCH; nc++)
#pragma unroll
            for (int e = 0; e < 4; e++) o[nc][e] *= corr[e >> 1];
#pragma unroll
        for (int nt = 0; nt < TC_NT; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const float p = __expf(s[nt][e] - m[e >> 1]);
                s[nt][e] = p;
                l[e >> 1] += p;  // this lane's columns; the quad's summed at the end
            }
        tc_mma_px<HS, TC_NT>(o, s, vs_tile[buf], lane);
        __syncthreads();  // buffer buf is free for tile kt + 2
    }

    // tc_quad_sum is collective: every lane runs it before any skips a row.
    const float sum[2] = {tc_quad_sum(l[0]), tc_quad_sum(l[1])};
#pragma unroll
    for (int half = 0; half < 2; half++) {
        const int row = r0 + 8 * half;
        if (row >= T) continue;
        const float inv = 1.0f / sum[half];
        bf16_t* dst = out + ((long long)b * T + row) * C + h * HS + 2 * t;
#pragma unroll
        for (int nc = 0; nc < TC_NCH; nc++) {
            dst[nc * 8] = bf16_store(o[nc][2 * half] * inv);
            dst[nc * 8 + 1] = bf16_store(o[nc][2 * half + 1] * inv);
        }
        if (t == 0) lse[((long long)b * NH + h) * T + row] = m[half] + logf(sum[half]);
    }
}

// dQ. Block (query tile qt, b * NH + h), rows as in the forward kernel. Per
// key tile: P = exp(Q Kᵀ * scale - lse) (0 where key > query or the row is
// past T), dP = dout Vᵀ, dS = P ∘ (dP - delta), dQ += dS K. At the end the
// query channels of dinp get dQ * scale added.
template <int HS>
static __device__ void tc_backward_dq(bf16_t* __restrict__ dinp, const float* __restrict__ delta,
                                      const bf16_t* __restrict__ dout,
                                      const bf16_t* __restrict__ inp,
                                      const float* __restrict__ lse, int T, int C, int NH,
                                      int accumulate) {
    alignas(16) __shared__ bf16_t ks_tile[2][TC_TILE * TC_LD];
    alignas(16) __shared__ bf16_t vs_tile[2][TC_TILE * TC_LD];
    const int qt = tc_tile_desc();
    const int b = blockIdx.y / NH, h = blockIdx.y % NH;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const long long C3 = 3LL * C;
    const bf16_t* q = inp + (long long)b * T * C3 + h * HS;
    const bf16_t* k = q + C;
    const bf16_t* v = q + 2 * C;
    const bf16_t* d_o = dout + (long long)b * T * C + h * HS;
    const float* lse_h = lse + ((long long)b * NH + h) * T;
    const float* delta_h = delta + ((long long)b * NH + h) * T;
    const int r0 = qt * TC_ROWS + warp * 16 + g;
    const float scale = 1.0f / sqrtf((float)HS);

    tc_stage<HS>(ks_tile[0], k, C3, 0, T);
    tc_stage<HS>(vs_tile[0], v, C3, 0, T);
    tc_async_commit();

    unsigned qa[TC_KSTEPS][4], da[TC_KSTEPS][4];
    tc_load_a<HS>(qa, q, C3, r0 - g, T, lane);
    tc_load_a<HS>(da, d_o, C, r0 - g, T, lane);
    float lse_r[2], delta_r[2];
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const int row = r0 + 8 * i;
        lse_r[i] = row < T ? lse_h[row] : 0.0f;
        delta_r[i] = row < T ? delta_h[row] : 0.0f;
    }
    float dq[TC_NCH][4];
#pragma unroll
    for (int nc = 0; nc < TC_NCH; nc++)
        for (int e = 0; e < 4; e++) dq[nc][e] = 0.0f;

    for (int kt = 0; kt <= qt; kt++) {
        const int buf = kt & 1;
        if (kt < qt) {
            tc_stage<HS>(ks_tile[buf ^ 1], k, C3, (kt + 1) * TC_TILE, T);
            tc_stage<HS>(vs_tile[buf ^ 1], v, C3, (kt + 1) * TC_TILE, T);
        }
        tc_async_commit();
        tc_async_wait_prev();
        __syncthreads();
        // Keys past a row only on the diagonal tile. Rows past T (of the
        // last query tile only) give dS only to their own dQ rows, which
        // are not stored: masked on the diagonal, ignored below it.
        const bool diagonal = kt == qt;
        // The tile's keys in chunks of TC_BWD_CHUNK (see its definition).
        // On the diagonal a chunk that starts past the warp's last row is
        // all masked (dS = 0) and skipped: its products would add zeros.
        const int chunks = diagonal ? tc_chunks_to(warp * 16 + 15) : TC_TILE / TC_BWD_CHUNK;
#pragma unroll
        for (int ch = 0; ch < TC_TILE / TC_BWD_CHUNK; ch++) {
            if (ch >= chunks) break;
            const int c0 = ch * TC_BWD_CHUNK;
            float s[TC_CNT][4], dp[TC_CNT][4];
            tc_mma_xt<HS, TC_CNT>(s, qa, ks_tile[buf] + c0 * TC_LD, lane);
            tc_mma_xt<HS, TC_CNT>(dp, da, vs_tile[buf] + c0 * TC_LD, lane);
#pragma unroll
            for (int nt = 0; nt < TC_CNT; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int key = kt * TC_TILE + c0 + nt * 8 + 2 * t + (e & 1);
                    const int i = e >> 1, row = r0 + 8 * i;
                    const float p = diagonal && (key > row || row >= T)
                                        ? 0.0f
                                        : __expf(s[nt][e] * scale - lse_r[i]);
                    s[nt][e] = p * (dp[nt][e] - delta_r[i]);  // dS
                }
            tc_mma_px<HS, TC_CNT>(dq, s, ks_tile[buf] + c0 * TC_LD, lane);
        }
        __syncthreads();
    }
    tc_accumulate<HS>(dinp + (long long)b * T * C3 + h * HS, C3, r0, T, dq, scale, lane,
                      accumulate);
}

// dK and dV. Block (key tile kt, b * NH + h); warp w owns keys
// kt * 64 + 16w .. +15, the thread's keys j0 = that + g and j0 + 8. Per query
// tile at or below the diagonal (staged with its dout rows, lse and delta):
// Pᵀ = exp(K Qᵀ * scale - lse) (0 where query < key or the query is past T),
// dV += Pᵀ dout, dPᵀ = V doutᵀ, dSᵀ = Pᵀ ∘ (dPᵀ - delta), dK += dSᵀ Q. At the
// end the key and value channels of dinp get dK * scale and dV added.
//
// With DS, the kernel also stores dSᵀ, rounded to bf16 as its dK product
// takes it, into ds: per (b, h) a T × T row-major matrix, row key, column
// query (T even). It stores the unmasked elements of the tiles it walks
// (masked ones as the zeros they are) and nothing else: the chunks it
// skips and the tiles above the diagonal are left as they were, zeros in
// a buffer kept for this. dQ is then one product, scale · dS · K
// (flash_attention.rs: `dq_by_gemm`), instead of the dQ kernel, which
// computes S and dP a second time.
template <int HS, bool DS>
static __device__ void tc_backward_dkv(bf16_t* __restrict__ dinp, const float* __restrict__ delta,
                                       const bf16_t* __restrict__ dout,
                                       const bf16_t* __restrict__ inp,
                                       const float* __restrict__ lse, int T, int C, int NH,
                                       int accumulate, bf16_t* __restrict__ ds) {
    alignas(16) __shared__ bf16_t qs_tile[2][TC_TILE * TC_LD];
    alignas(16) __shared__ bf16_t dos_tile[2][TC_TILE * TC_LD];
    __shared__ float lse_tile[2][TC_TILE];
    __shared__ float delta_tile[2][TC_TILE];
    const int kt = blockIdx.x;  // the first key tiles have the most query tiles
    const int b = blockIdx.y / NH, h = blockIdx.y % NH;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const long long C3 = 3LL * C;
    const bf16_t* q = inp + (long long)b * T * C3 + h * HS;
    const bf16_t* k = q + C;
    const bf16_t* v = q + 2 * C;
    const bf16_t* d_o = dout + (long long)b * T * C + h * HS;
    const float* lse_h = lse + ((long long)b * NH + h) * T;
    const float* delta_h = delta + ((long long)b * NH + h) * T;
    const int j0 = kt * TC_ROWS + warp * 16 + g;  // this thread's keys: j0, j0 + 8
    const float scale = 1.0f / sqrtf((float)HS);
    bf16_t* ds_h = DS ? ds + ((long long)b * NH + h) * T * T : nullptr;

    unsigned ka[TC_KSTEPS][4], va[TC_KSTEPS][4];
    tc_load_a<HS>(ka, k, C3, j0 - g, T, lane);
    tc_load_a<HS>(va, v, C3, j0 - g, T, lane);
    float dk[TC_NCH][4], dv[TC_NCH][4];
#pragma unroll
    for (int nc = 0; nc < TC_NCH; nc++)
        for (int e = 0; e < 4; e++) {
            dk[nc][e] = 0.0f;
            dv[nc][e] = 0.0f;
        }

    const int tiles = (T + TC_TILE - 1) / TC_TILE;
    // Starts copying query tile qt (with its dout rows, lse and delta) into
    // buffer buf.
    auto stage = [&](int buf, int qt) {
        tc_stage<HS>(qs_tile[buf], q, C3, qt * TC_TILE, T);
        tc_stage<HS>(dos_tile[buf], d_o, C, qt * TC_TILE, T);
        for (int i = threadIdx.x; i < TC_TILE; i += TC_THREADS) {
            const int row = qt * TC_TILE + i;
            if (row < T) {
                tc_copy4_async(&lse_tile[buf][i], lse_h + row);
                tc_copy4_async(&delta_tile[buf][i], delta_h + row);
            } else {
                lse_tile[buf][i] = 0.0f;
                delta_tile[buf][i] = 0.0f;
            }
        }
    };
    stage(0, kt);
    tc_async_commit();
    for (int qt = kt; qt < tiles; qt++) {
        const int buf = (qt - kt) & 1;
        if (qt + 1 < tiles) stage(buf ^ 1, qt + 1);
        tc_async_commit();
        tc_async_wait_prev();
        __syncthreads();
        const bf16_t* qs = qs_tile[buf];
        const bf16_t* dos = dos_tile[buf];
        const float* lse_t = lse_tile[buf];
        const float* delta_t = delta_tile[buf];
        // The tile's queries in chunks of TC_BWD_CHUNK. On the diagonal a
        // chunk that ends before the warp's first key is all masked and
        // skipped.
        const int first = qt == kt ? warp * 16 / TC_BWD_CHUNK : 0;
#pragma unroll
        for (int ch = 0; ch < TC_TILE / TC_BWD_CHUNK; ch++) {
            if (ch < first) continue;
            const int c0 = ch * TC_BWD_CHUNK;
            float s[TC_CNT][4], dp[TC_CNT][4];
            tc_mma_xt<HS, TC_CNT>(s, ka, qs + c0 * TC_LD, lane);    // K Qᵀ: rows keys
            tc_mma_xt<HS, TC_CNT>(dp, va, dos + c0 * TC_LD, lane);  // V doutᵀ
            // Masked on every tile: a mask on the edge tiles only (the
            // diagonal and the last) costs this kernel spills at head size
            // 64.
#pragma unroll
            for (int nt = 0; nt < TC_CNT; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int col = c0 + nt * 8 + 2 * t + (e & 1);
                    const int query = qt * TC_TILE + col;
                    const int key = j0 + 8 * (e >> 1);
                    const float p = (query < key || query >= T)
                                        ? 0.0f
                                        : __expf(s[nt][e] * scale - lse_t[col]);
                    s[nt][e] = p;                                // Pᵀ
                    dp[nt][e] = p * (dp[nt][e] - delta_t[col]);  // dSᵀ
                }
            if (DS) {
                // Rows j0 and j0 + 8, columns (query) 2t and 2t + 1 of each
                // 8-column tile: one 4-byte store a pair (T even).
#pragma unroll
                for (int nt = 0; nt < TC_CNT; nt++)
#pragma unroll
                    for (int i = 0; i < 2; i++) {
                        const int key = j0 + 8 * i;
                        const int query = qt * TC_TILE + c0 + nt * 8 + 2 * t;
                        if (key < T && query < T)
                            *(unsigned*)(ds_h + (long long)key * T + query) =
                                tc_pack_f32(dp[nt][2 * i], dp[nt][2 * i + 1]);
                    }
            }
            tc_mma_px<HS, TC_CNT>(dv, s, dos + c0 * TC_LD, lane);
            tc_mma_px<HS, TC_CNT>(dk, dp, qs + c0 * TC_LD, lane);
        }
        __syncthreads();
    }
    bf16_t* dk_dst = dinp + (long long)b * T * C3 + C + h * HS;
    tc_accumulate<HS>(dk_dst, C3, j0, T, dk, scale, lane, accumulate);
    tc_accumulate<HS>(dk_dst + C, C3, j0, T, dv, 1.0f, lane, accumulate);
}

// The entry points, one per kernel and head size (B is implied by the grid).
// Launch: grid (ceil(T / 64), B * NH), block 128. The `_dkv_ds` kernels are
// the dK/dV kernels that also store dSᵀ (ds, last; T even).
//
// TC_MIN_BLOCKS_FWD / _DQ / _DKV, when defined: the blocks per SM a kernel
// is compiled for (`__launch_bounds__(128, n)`). Undefined, the compiler
// chooses freely (and uses fewer registers than with any bound: run 7's
// kernels, 145 / 174 / 251 registers at head size 64 against 171 / 250 /
// 251 with a bound of 1). Run 7's profile on an H200: at head size 64 both
// backward kernels fit 2 blocks of 4 warps an SM and were latency-bound at
// 12% occupancy. A tuning experiment sets them through
// BRAID_NVRTC_OPTIONS (docs/cuda.md), e.g. -DTC_MIN_BLOCKS_DQ=3 (168
// registers, 24 bytes of stack).
#ifdef TC_MIN_BLOCKS_FWD
#define TC_BOUNDS_FWD __launch_bounds__(TC_THREADS, TC_MIN_BLOCKS_FWD)
#else
#define TC_BOUNDS_FWD
#endif
#ifdef TC_MIN_BLOCKS_DQ
#define TC_BOUNDS_DQ __launch_bounds__(TC_THREADS, TC_MIN_BLOCKS_DQ)
#else
#define TC_BOUNDS_DQ
#endif
#ifdef TC_MIN_BLOCKS_DKV
#define TC_BOUNDS_DKV __launch_bounds__(TC_THREADS, TC_MIN_BLOCKS_DKV)
#else
#define TC_BOUNDS_DKV
#endif

extern "C" __global__ void TC_BOUNDS_FWD flash_attention_tc_forward_hs16_bf16(
    bf16_t* out, float* lse, const bf16_t* inp, int B, int T, int C, int NH) {
    tc_forward<16>(out, lse, inp, T, C, NH);
}

extern "C" __global__ void TC_BOUNDS_DQ flash_attention_tc_backward_dq_hs16_bf16(
    bf16_t* dinp, const float* delta, const bf16_t* dout, const bf16_t* inp, const float* lse,
    int B, int T, int C, int NH, int accumulate) {
    tc_backward_dq<16>(dinp, delta, dout, inp, lse, T, C, NH, accumulate);
}

extern "C" __global__ void TC_BOUNDS_DKV flash_attention_tc_backward_dkv_hs16_bf16(
    bf16_t* dinp, const float* delta, const bf16_t* dout, const bf16_t* inp, const float* lse,
    int B, int T, int C, int NH, int accumulate) {
    tc_backward_dkv<16, false>(dinp, delta, dout, inp, lse, T, C, NH, accumulate, nullptr);
}

extern "C" __global__ void TC_BOUNDS_DKV flash_attention_tc_backward_dkv_ds_hs16_bf16(
    bf16_t* dinp, const float* delta, const bf16_t* dout, const bf16_t* inp, const float* lse,
    int B, int T, int C, int NH, int accumulate, bf16_t* ds) {
    tc_backward_dkv<16, true>(dinp, delta, dout, inp, lse, T, C, NH, accumulate, ds);
}

extern "C" __global__ void TC_BOUNDS_FWD flash_attention_tc_forward_hs32_bf16(
    bf16_t* out, float* lse, const bf16_t* inp, int B, int T, int C, int NH) {
    tc_forward<32>(out, lse, inp, T, C, NH);
}

extern "C" __global__ void TC_BOUNDS_DQ flash_attention_tc_backward_dq_hs32_bf16(
    bf16_t* dinp, const float* delta, const bf16_t* dout, const bf16_t* inp, const float* lse,
    int B, int T, int C, int NH, int accumulate) {
    tc_backward_dq<32>(dinp, delta, dout, inp, lse, T, C, NH, accumulate);
}

extern "C" __global__ void TC_BOUNDS_DKV flash_attention_tc_backward_dkv_hs32_bf16(
    bf16_t* dinp, const float* delta, const bf16_t* dout, const bf16_t* inp, const float* lse,
    int B, int T, int C, int NH, int accumulate) {
    tc_backward_dkv<32, false>(dinp, delta, dout, inp, lse, T, C, NH, accumulate, nullptr);
}

extern "C" __global__ void TC_BOUNDS_DKV flash_attention_tc_backward_dkv_ds_hs32_bf16(
    bf16_t* dinp, const float* delta, const bf16_t* dout, const bf16_t* inp, const float* lse,
    int B, int T, int C, int NH, int accumulate, bf16_t* ds) {
    tc_backward_dkv<32, true>(dinp, delta, dout, inp, lse, T, C, NH, accumulate, ds);
}

extern "C" __global__ void TC_BOUNDS_FWD flash_attention_tc_forward_hs64_bf16(
    bf16_t* out, float* lse, const bf16_t* inp, int B, int T, int C, int NH) {
    tc_forward<64>(out, lse, inp, T, C, NH);
}

extern "C" __global__ void TC_BOUNDS_DQ flash_attention_tc_backward_dq_hs64_bf16(
    bf16_t* dinp, const float* delta, const bf16_t* dout, const bf16_t* inp, const float* lse,
    int B, int T, int C, int NH, int accumulate) {
    tc_backward_dq<64>(dinp, delta, dout, inp, lse, T, C, NH, accumulate);
}

extern "C" __global__ void TC_BOUNDS_DKV flash_attention_tc_backward_dkv_hs64_bf16(
    bf16_t* dinp, const float* delta, const bf16_t* dout, const bf16_t* inp, const float* lse,
    int B, int T, int C, int NH, int accumulate) {
    tc_backward_dkv<64, false>(dinp, delta, dout, inp, lse, T, C, NH, accumulate, nullptr);
}

extern "C" __global__ void TC_BOUNDS_DKV flash_attention_tc_backward_dkv_ds_hs64_bf16(
    bf16_t* dinp, const float* delta, const bf16_t* dout, const bf16_t* inp, const float* lse,
    int B, int T, int C, int NH, int accumulate, bf16_t* ds) {
    tc_backward_dkv<64, true>(dinp, delta, dout, inp, lse, T, C, NH, accumulate, ds);
}

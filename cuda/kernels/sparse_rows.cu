// The gradient reducer's row contributions (core/src/comm/sparse.rs): a
// gradient with several writers, one of which touches only some rows (the
// tied embedding's encoder rows). Semantics and the CPU reference:
// braid::comm::sparse_links and braid::comm::sparse_add_chunk. Deterministic:
// no atomics; every touched gradient element has one writer, which adds its
// contributions in row order.

#include "row_links.cuh"  // row_links

// row_links over one rank's ids: the chains sparse_rows_add_* walk.
//   links (n) out, ids (n)
// Launch: grid ceil(n / 256), block 256.
extern "C" __global__ void sparse_rows_links(unsigned int* __restrict__ links,
                                             const unsigned int* __restrict__ ids, int n) {
    row_links(links, ids, n);
}

// bf16 elements as the upper 16 bits of an f32: loads exact, stores rounded
// to nearest, ties to even, a NaN kept a quiet NaN (Bf16::from_f32).
__device__ __forceinline__ float row_load(float x) { return x; }
__device__ __forceinline__ float row_load(unsigned short h) {
    return __uint_as_float(((unsigned int)h) << 16);
}
__device__ __forceinline__ void row_store(float* p, float x) { *p = x; }
__device__ __forceinline__ void row_store(unsigned short* p, float x) {
    const unsigned int bits = __float_as_uint(x);
    if ((bits & 0x7fffffffu) > 0x7f800000u) {
        *p = (unsigned short)((bits >> 16) | 0x0040u);
        return;
    }
    *p = (unsigned short)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

// grad[ids[i]] += scale * rows[i] for one rank's contribution (n rows of
// row_len), in f32: block i owns id ids[i] if i is its first entry (no bit
// 31 in links[i]) and walks the id's chain, each thread over channels
// c = threadIdx.x + k * blockDim.x; the element is loaded once, gets
// __fmul_rn(scale, row) added in chain order with __fadd_rn (no
// contraction: the CPU rounds the product and the sum apart), and is stored
// once. The other blocks return at once. An id at or past `nrows` is
// skipped: the kernel never writes outside the gradient (the CPU body fails
// the task instead; the CUDA body cannot report without a host wait).
//   grad (nrows, row_len), ids (n), links (n, sparse_rows_links), rows (n, row_len)
// Launch: grid n, block 128 (any).
template <typename S>
__device__ void sparse_rows_add(S* __restrict__ grad, const unsigned int* __restrict__ ids,
                                const unsigned int* __restrict__ links,
                                const S* __restrict__ rows, int n, int row_len,
                                long long nrows, float scale) {
    const int head = blockIdx.x;
    if (head >= n || (links[head] >> 31)) return;
    const unsigned int id = ids[head];
    if ((long long)id >= nrows) return;
    S* g = grad + (long long)id * row_len;
    for (int c = threadIdx.x; c < row_len; c += blockDim.x) {
        float acc = row_load(g[c]);
        for (int r = head; r < n; r = (int)(links[r] & 0x7fffffffu)) {
            acc = __fadd_rn(acc, __fmul_rn(scale, row_load(rows[(long long)r * row_len + c])));
        }
        row_store(&g[c], acc);
    }
}

extern "C" __global__ void sparse_rows_add_f32(float* __restrict__ grad,
                                               const unsigned int* __restrict__ ids,
                                               const unsigned int* __restrict__ links,
                                               const float* __restrict__ rows, int n,
                                               int row_len, long long nrows, float scale) {
    sparse_rows_add(grad, ids, links, rows, n, row_len, nrows, scale);
}

extern "C" __global__ void sparse_rows_add_bf16(unsigned short* __restrict__ grad,
                                                const unsigned int* __restrict__ ids,
                                                const unsigned int* __restrict__ links,
                                                const unsigned short* __restrict__ rows, int n,
                                                int row_len, long long nrows, float scale) {
    sparse_rows_add(grad, ids, links, rows, n, row_len, nrows, scale);
}

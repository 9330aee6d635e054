// row_links.cuh: the chains of repeated ids that the deterministic
// scatter-adds walk (the reducer's sparse rows, cuda/kernels/sparse_rows.cu;
// GPT-2's token-embedding gradient, models/gpt2/src/kernels/encoder.cu).
// NVRTC reads no files: the engine (braid::cuda::engine_kernels::HEADERS),
// GPT-2's programs (kernels/cuda_common.rs, HEADERS) and tools/nvrtc-check
// hand it this header with each program. CPU reference:
// braid::comm::sparse_links.
#pragma once

// links[i] = the next index r > i with ids[r] == ids[i] (n if none), with
// bit 31 set when an earlier index holds the same id. Each block compares its
// entries with every tile of 256 ids staged in shared memory (work O(n^2 /
// 256) per block). Every thread of the block must call it.
// Launch: grid ceil(n / 256), block 256.
__device__ __forceinline__ void row_links(unsigned int* __restrict__ links,
                                          const unsigned int* __restrict__ ids, int n) {
    __shared__ unsigned int tile[256];
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    const unsigned int id = i < n ? ids[i] : 0u;
    unsigned int next = (unsigned int)n, repeat = 0u;
    for (int base = 0; base < n; base += 256) {
        const int j = base + (int)threadIdx.x;
        tile[threadIdx.x] = j < n ? ids[j] : 0u;
        __syncthreads();
        const int m = min(256, n - base);
        if (i < n) {
            for (int k = 0; k < m; k++) {
                const int r = base + k;
                if (tile[k] != id || r == i) continue;
                if (r < i) repeat = 1u;
                else if (next == (unsigned int)n) next = (unsigned int)r;
            }
        }
        __syncthreads();
    }
    if (i < n) links[i] = next | (repeat << 31);
}

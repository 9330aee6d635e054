// GPT-2 token + position embedding, forward and backward (fp32).
// Semantics: models/gpt2/src/kernels/encoder.rs. Deterministic: no atomics;
// every gradient element is accumulated by one thread in (b, t) order, as the
// CPU kernel does.

// out[b, t, :] = wte[tokens[b, t], :] + wpe[t, :]
//   out    (B, T, C)
//   tokens (B, T)      token ids < V (checked by the caller)
//   wte    (V, C)
//   wpe    (maxT, C)   maxT >= T
// Launch: grid ceil(B*T*C / block), block 256.
extern "C" __global__ void encoder_forward(float* __restrict__ out,
                                           const unsigned int* __restrict__ tokens,
                                           const float* __restrict__ wte,
                                           const float* __restrict__ wpe, int B, int T, int C) {
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long n = (long long)B * T * C;
    if (idx >= n) return;
    const int c = (int)(idx % C);
    const long long bt = idx / C;
    const int t = (int)(bt % T);
    const unsigned int tok = tokens[bt];
    out[idx] = wte[(long long)tok * C + c] + wpe[(long long)t * C + c];
}

// dwpe[t, c] += sum_b dout[b, t, c]
//   dwpe (maxT, C), dout (B, T, C)
// Launch: grid ceil(T*C / block), block 256 (one thread per (t, c)).
extern "C" __global__ void encoder_backward_wpe(float* __restrict__ dwpe,
                                                const float* __restrict__ dout, int B, int T,
                                                int C) {
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)T * C) return;
    const int t = (int)(idx / C);
    const int c = (int)(idx % C);
    float acc = dwpe[idx];
    for (int b = 0; b < B; b++) {
        acc += dout[((long long)b * T + t) * C + c];
    }
    dwpe[idx] = acc;
}

// dwte[tokens[bt], c] += dout[bt, c] for every bt in 0..B*T, in bt order.
//   dwte (V, C), dout (B*T, C), tokens (B*T)
// Launch: grid (ceil(C / block.x), P), block (128 or 256). Thread (c, p) owns the
// rows of dwte whose token id is congruent to p modulo P (= gridDim.y) in
// channel c, so each destination element has exactly one writer and is summed in
// bt order. P = 32..128 gives enough parallelism; any P gives the same result.
extern "C" __global__ void encoder_backward_wte(float* __restrict__ dwte,
                                                const float* __restrict__ dout,
                                                const unsigned int* __restrict__ tokens, int BT,
                                                int C) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    const unsigned int parts = gridDim.y;
    const unsigned int part = blockIdx.y;
    if (c >= C) return;
    for (int bt = 0; bt < BT; bt++) {
        const unsigned int tok = tokens[bt];
        if (tok % parts == part) {
            float* d = dwte + (long long)tok * C + c;
            *d = *d + dout[(long long)bt * C + c];
        }
    }
}

#include "bf16.cuh"  // bf16_t, bf16_load, bf16_store

// encoder_forward with bf16 storage: the f32 sum of the two bf16 embeddings,
// rounded once (encoder_forward::<Bf16>; bit-exact with it).
// Launch: grid ceil(B*T*C / block), block 256.
extern "C" __global__ void encoder_forward_bf16(bf16_t* __restrict__ out,
                                                const unsigned int* __restrict__ tokens,
                                                const bf16_t* __restrict__ wte,
                                                const bf16_t* __restrict__ wpe, int B, int T,
                                                int C) {
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long n = (long long)B * T * C;
    if (idx >= n) return;
    const int c = (int)(idx % C);
    const long long bt = idx / C;
    const int t = (int)(bt % T);
    const unsigned int tok = tokens[bt];
    out[idx] = bf16_store(bf16_load(wte[(long long)tok * C + c]) +
                          bf16_load(wpe[(long long)t * C + c]));
}

// encoder_backward_wpe with bf16 storage: dwpe[t, c] loaded, the B
// contributions added in f32 in b order, rounded once
// (encoder_backward_positions::<Bf16>; bit-exact with it).
// Launch: grid ceil(T*C / block), block 256.
extern "C" __global__ void encoder_backward_wpe_bf16(bf16_t* __restrict__ dwpe,
                                                     const bf16_t* __restrict__ dout, int B,
                                                     int T, int C) {
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)T * C) return;
    const int t = (int)(idx / C);
    const int c = (int)(idx % C);
    float acc = bf16_load(dwpe[idx]);
    for (int b = 0; b < B; b++) {
        acc += bf16_load(dout[((long long)b * T + t) * C + c]);
    }
    dwpe[idx] = bf16_store(acc);
}

#include "row_links.cuh"  // row_links (the engine's header)

// links[bt] = the next position r > bt holding the same token (BT if none),
// with bit 31 set when an earlier position holds it: the chains
// encoder_backward_wte_bf16 walks (row_links over the tokens).
//   links (B*T) scratch, tokens (B*T)
// Launch: grid ceil(B*T / 256), block 256.
extern "C" __global__ void encoder_backward_links(unsigned int* __restrict__ links,
                                                  const unsigned int* __restrict__ tokens,
                                                  int BT) {
    row_links(links, tokens, BT);
}

// encoder_backward_wte with bf16 storage: each row of a token is loaded once,
// every contribution of that token added in f32 in bt order, and rounded once
// (encoder_backward::<Bf16>; bit-exact with it). Block bt owns the token at
// position bt if bt is its first position (no repeat bit in links[bt]) and
// walks the token's chain of positions in `links` (encoder_backward_links),
// its threads over the channels, ENC_WTE_PER channels each per pass (one
// pass for C <= 8 * blockDim.x); the other blocks return at once. Work
// O(B*T*C) in all, reads of dout coalesced. (Earlier versions had every
// thread scan all B*T tokens for the ones of its part of the vocabulary:
// O((B*T)^2 / P) per thread, 69 ms of a 168 ms GPT-2 124M step on an H200,
// then, with the chains, still 1.4 ms of a 37 ms step on an H100.)
//   dwte (V, C), dout (B*T, C), tokens (B*T), links (B*T)
// Launch: grid B*T, block 128 (any).
#define ENC_WTE_PER 8
extern "C" __global__ void encoder_backward_wte_bf16(bf16_t* __restrict__ dwte,
                                                     const bf16_t* __restrict__ dout,
                                                     const unsigned int* __restrict__ tokens,
                                                     const unsigned int* __restrict__ links,
                                                     int BT, int C) {
    const int head = blockIdx.x;
    if (head >= BT || (links[head] >> 31)) return;
    bf16_t* d = dwte + (long long)tokens[head] * C;
    const int step = (int)blockDim.x;
    for (int c0 = 0; c0 < C; c0 += ENC_WTE_PER * step) {
        float acc[ENC_WTE_PER];
#pragma unroll
        for (int i = 0; i < ENC_WTE_PER; i++) {
            const int c = c0 + i * step + (int)threadIdx.x;
            acc[i] = c < C ? bf16_load(d[c]) : 0.0f;
        }
        for (int r = head; r < BT; r = (int)(links[r] & 0x7fffffffu)) {
            const bf16_t* src = dout + (long long)r * C;
#pragma unroll
            for (int i = 0; i < ENC_WTE_PER; i++) {
                const int c = c0 + i * step + (int)threadIdx.x;
                if (c < C) acc[i] += bf16_load(src[c]);
            }
        }
#pragma unroll
        for (int i = 0; i < ENC_WTE_PER; i++) {
            const int c = c0 + i * step + (int)threadIdx.x;
            if (c < C) d[c] = bf16_store(acc[i]);
        }
    }
}

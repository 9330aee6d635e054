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

// Bias parts of GPT-2's linear layers (the products themselves go through
// cuBLAS: out = inp · Wᵀ, see cuda/src/cublas.rs).
// Semantics: models/gpt2/src/kernels/matmul.rs. Deterministic, no atomics.

// out[n, o] += bias[o]
//   out (N, OC), bias (OC); N = B*T
// Launch: grid ceil(N*OC / block), block 256.
extern "C" __global__ void bias_forward(float* __restrict__ out, const float* __restrict__ bias,
                                        int N, int OC) {
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)N * OC) return;
    out[idx] += bias[idx % OC];
}

// out[n, o] = bias[o]  (broadcast, so a following cuBLAS product with beta = 1
// computes bias + inp · Wᵀ in the CPU kernel's order)
// Launch: grid ceil(N*OC / block), block 256.
extern "C" __global__ void bias_broadcast(float* __restrict__ out, const float* __restrict__ bias,
                                          int N, int OC) {
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)N * OC) return;
    out[idx] = bias[idx % OC];
}

// dbias[o] += sum_n dout[n, o], rows in order.
//   dbias (OC), dout (N, OC)
// Launch: one thread per output channel: grid ceil(OC / 128), block 128.
extern "C" __global__ void bias_backward(float* __restrict__ dbias, const float* __restrict__ dout,
                                         int N, int OC) {
    const int o = blockIdx.x * blockDim.x + threadIdx.x;
    if (o >= OC) return;
    float acc = dbias[o];
#pragma unroll 4
    for (int n = 0; n < N; n++) {
        acc += dout[(long long)n * OC + o];
    }
    dbias[o] = acc;
}

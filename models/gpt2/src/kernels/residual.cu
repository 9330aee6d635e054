// Residual connection (fp32). Semantics: models/gpt2/src/kernels/residual.rs.

// out[i] = inp1[i] + inp2[i]
// Launch: grid ceil(N / block), block 256.
extern "C" __global__ void residual_forward(float* __restrict__ out, const float* __restrict__ inp1,
                                            const float* __restrict__ inp2, long long N) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < N) out[i] = inp1[i] + inp2[i];
}

// dinp1[i] += dout[i]; dinp2[i] += dout[i]   (dinp1 and dinp2 must not alias)
// Launch: grid ceil(N / block), block 256.
extern "C" __global__ void residual_backward(float* __restrict__ dinp1, float* __restrict__ dinp2,
                                             const float* __restrict__ dout, long long N) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < N) {
        const float g = dout[i];
        dinp1[i] += g;
        dinp2[i] += g;
    }
}

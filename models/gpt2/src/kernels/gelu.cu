// GELU, tanh approximation, forward and backward (fp32).
// Semantics: models/gpt2/src/kernels/gelu.rs (same constants, same order).

#define GELU_SCALING_FACTOR 0.7978846f  // sqrt(2 / pi)
#define GELU_CUBIC 0.044715f

// out[i] = 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))
//   out (N), inp (N)
// Launch: grid ceil(N / block), block 256.
extern "C" __global__ void gelu_forward(float* __restrict__ out, const float* __restrict__ inp,
                                        long long N) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= N) return;
    const float x = inp[i];
    const float cube = GELU_CUBIC * x * x * x;
    out[i] = 0.5f * x * (1.0f + tanhf(GELU_SCALING_FACTOR * (x + cube)));
}

// dinp[i] += gelu'(inp[i]) * dout[i]
//   dinp (N), inp (N), dout (N)
// Launch: grid ceil(N / block), block 256.
extern "C" __global__ void gelu_backward(float* __restrict__ dinp, const float* __restrict__ inp,
                                         const float* __restrict__ dout, long long N) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= N) return;
    const float x = inp[i];
    const float cube = GELU_CUBIC * x * x * x;
    const float tanh_out = tanhf(GELU_SCALING_FACTOR * (x + cube));
    const float sech2 = 1.0f - tanh_out * tanh_out;
    const float local_grad = 0.5f * (1.0f + tanh_out) +
                             x * 0.5f * sech2 * GELU_SCALING_FACTOR * (1.0f + 3.0f * GELU_CUBIC * x * x);
    dinp[i] += local_grad * dout[i];
}

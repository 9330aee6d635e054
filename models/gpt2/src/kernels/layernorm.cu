// GPT-2 layer normalisation over channels, forward and backward (fp32).
// Semantics: models/gpt2/src/kernels/layernorm.rs (biased variance,
// eps = 1e-5, saves mean and rstd). Row statistics are reduced with a fixed
// butterfly of warp shuffles and parameter gradients by one thread per channel
// in row order: deterministic, no atomics.

#define LN_EPS 1e-5f

static __device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// out = (inp - mean) * rstd * weight + bias, per row of C channels.
//   out (N, C), mean (N), rstd (N), inp (N, C), weight (C), bias (C); N = B*T
// Launch: one warp per row: block 256 (8 rows), grid ceil(N / 8).
extern "C" __global__ void layernorm_forward(float* __restrict__ out, float* __restrict__ mean,
                                             float* __restrict__ rstd,
                                             const float* __restrict__ inp,
                                             const float* __restrict__ weight,
                                             const float* __restrict__ bias, int N, int C) {
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= N) return;
    const float* x = inp + (long long)row * C;
    float s = 0.0f;
    for (int i = lane; i < C; i += 32) s += x[i];
    const float m = warp_sum(s) / (float)C;
    float v = 0.0f;
    for (int i = lane; i < C; i += 32) {
        const float d = x[i] - m;
        v += d * d;
    }
    v = warp_sum(v) / (float)C;
    const float r = 1.0f / sqrtf(v + LN_EPS);
    float* o = out + (long long)row * C;
    for (int i = lane; i < C; i += 32) {
        o[i] = (x[i] - m) * r * weight[i] + bias[i];
    }
    if (lane == 0) {
        mean[row] = m;
        rstd[row] = r;
    }
}

// dinp += (dnorm - mean(dnorm) - norm * mean(dnorm * norm)) * rstd,
// with norm = (inp - mean) * rstd and dnorm = weight * dout.
//   dinp (N, C), dout (N, C), inp (N, C), weight (C), mean (N), rstd (N)
// Launch: one warp per row: block 256, grid ceil(N / 8).
extern "C" __global__ void layernorm_backward_input(float* __restrict__ dinp,
                                                    const float* __restrict__ dout,
                                                    const float* __restrict__ inp,
                                                    const float* __restrict__ weight,
                                                    const float* __restrict__ mean,
                                                    const float* __restrict__ rstd, int N, int C) {
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= N) return;
    const long long base = (long long)row * C;
    const float m = mean[row];
    const float s = rstd[row];
    float a = 0.0f, b = 0.0f;
    for (int i = lane; i < C; i += 32) {
        const float norm = (inp[base + i] - m) * s;
        const float dnorm = weight[i] * dout[base + i];
        a += dnorm;
        b += dnorm * norm;
    }
    a = warp_sum(a) / (float)C;
    b = warp_sum(b) / (float)C;
    for (int i = lane; i < C; i += 32) {
        const float norm = (inp[base + i] - m) * s;
        const float dnorm = weight[i] * dout[base + i];
        dinp[base + i] += (dnorm - a - norm * b) * s;
    }
}

// dweight[c] += sum_n norm[n, c] * dout[n, c];  dbias[c] += sum_n dout[n, c]
//   dweight (C), dbias (C), dout (N, C), inp (N, C), mean (N), rstd (N)
// Launch: one thread per channel: grid ceil(C / 128), block 128. Each thread
// walks the rows in order (coalesced across the warp's channels).
extern "C" __global__ void layernorm_backward_params(float* __restrict__ dweight,
                                                     float* __restrict__ dbias,
                                                     const float* __restrict__ dout,
                                                     const float* __restrict__ inp,
                                                     const float* __restrict__ mean,
                                                     const float* __restrict__ rstd, int N,
                                                     int C) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    float dw = dweight[c];
    float db = dbias[c];
#pragma unroll 4
    for (int n = 0; n < N; n++) {
        const long long k = (long long)n * C + c;
        const float g = dout[k];
        const float norm = (inp[k] - mean[n]) * rstd[n];
        db += g;
        dw += norm * g;
    }
    dweight[c] = dw;
    dbias[c] = db;
}

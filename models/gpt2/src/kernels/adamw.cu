// AdamW with torch.optim.AdamW semantics (fp32 parameters and moments).
// Semantics: models/gpt2/src/kernels/adamw.rs.

// One AdamW step for step number t (1-based). The host computes, in double as
// the CPU kernel does, then rounds to float:
//   step_size      = lr / (1 - beta1^t)
//   bc2_sqrt       = sqrt(1 - beta2^t)
//   decay          = 1 - lr * weight_decay
// and per element:
//   g  = grads[i] * (*grad_scale)        (grad_scale may be null: 1)
//   p  = p * decay
//   m  = beta1 * m + (1 - beta1) * g
//   v  = beta2 * v + (1 - beta2) * g * g
//   p -= step_size * m / (sqrt(v) / bc2_sqrt + eps)
//   params, grads, m, v (N)
// Launch: grid ceil(N / block), block 256.
extern "C" __global__ void adamw_update(float* __restrict__ params, const float* __restrict__ grads,
                                        float* __restrict__ m, float* __restrict__ v,
                                        const float* __restrict__ grad_scale, long long N,
                                        float step_size, float bc2_sqrt, float beta1, float beta2,
                                        float eps, float decay) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= N) return;
    float g = grads[i];
    if (grad_scale != nullptr) g *= grad_scale[0];
    float p = params[i] * decay;
    const float mi = beta1 * m[i] + (1.0f - beta1) * g;
    const float vi = beta2 * v[i] + (1.0f - beta2) * g * g;
    const float denom = sqrtf(vi) / bc2_sqrt + eps;
    p -= step_size * mi / denom;
    m[i] = mi;
    v[i] = vi;
    params[i] = p;
}

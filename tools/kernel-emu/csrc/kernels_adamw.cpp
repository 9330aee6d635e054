// C entry points of models/gpt2/src/kernels/adamw.cu (src/lib.rs).
#include "cuda_emu.h"

#include "adamw.cu"

extern "C" int emu_adamw_update(BRAID_EMU_DIMS, float* params, const float* grads, float* m,
                                float* v, const float* grad_scale, long long N, float step_size,
                                float bc2_sqrt, float beta1, float beta2, float eps, float decay,
                                const float* scalars) {
    return BRAID_EMU_LAUNCH(adamw_update(params, grads, m, v, grad_scale, N, step_size, bc2_sqrt,
                                         beta1, beta2, eps, decay, scalars));
}

extern "C" int emu_adamw_update_mixed_f32(BRAID_EMU_DIMS, float* params, float* master,
                                          const float* grads, float* m, float* v,
                                          const float* grad_scale, long long N, float step_size,
                                          float bc2_sqrt, float beta1, float beta2, float eps,
                                          float decay, const float* scalars) {
    return BRAID_EMU_LAUNCH(adamw_update_mixed_f32(params, master, grads, m, v, grad_scale, N,
                                                   step_size, bc2_sqrt, beta1, beta2, eps, decay,
                                                   scalars));
}

extern "C" int emu_adamw_update_mixed_bf16(BRAID_EMU_DIMS, bf16_t* params, float* master,
                                           const bf16_t* grads, float* m, float* v,
                                           const float* grad_scale, long long N,
                                           float step_size, float bc2_sqrt, float beta1,
                                           float beta2, float eps, float decay,
                                           const float* scalars) {
    return BRAID_EMU_LAUNCH(adamw_update_mixed_bf16(params, master, grads, m, v, grad_scale, N,
                                                    step_size, bc2_sqrt, beta1, beta2, eps,
                                                    decay, scalars));
}

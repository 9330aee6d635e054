// C entry points of models/gpt2/src/kernels/norm.cu (src/lib.rs).
#include "cuda_emu.h"

#include "norm.cu"

extern "C" int emu_grad_norm_sq_partial(BRAID_EMU_DIMS, double* partials, const float* grads,
                                        long long N) {
    return BRAID_EMU_LAUNCH(grad_norm_sq_partial(partials, grads, N));
}

extern "C" int emu_grad_norm_sq_partial_bf16(BRAID_EMU_DIMS, double* partials,
                                             const bf16_t* grads, long long N) {
    return BRAID_EMU_LAUNCH(grad_norm_sq_partial_bf16(partials, grads, N));
}

extern "C" int emu_grad_norm_sq_finalize(BRAID_EMU_DIMS, double* out, const double* partials,
                                         int P) {
    return BRAID_EMU_LAUNCH(grad_norm_sq_finalize(out, partials, P));
}

extern "C" int emu_grad_clip_scale(BRAID_EMU_DIMS, float* scale, const double* norm_sq, int K,
                                   float max_norm) {
    return BRAID_EMU_LAUNCH(grad_clip_scale(scale, norm_sq, K, max_norm));
}

extern "C" int emu_scale_inplace(BRAID_EMU_DIMS, float* x, long long N, float s) {
    return BRAID_EMU_LAUNCH(scale_inplace(x, N, s));
}

extern "C" int emu_scale_inplace_bf16(BRAID_EMU_DIMS, bf16_t* x, long long N, float s) {
    return BRAID_EMU_LAUNCH(scale_inplace_bf16(x, N, s));
}

extern "C" int emu_scale_inplace_dev(BRAID_EMU_DIMS, float* x, long long N, const float* s) {
    return BRAID_EMU_LAUNCH(scale_inplace_dev(x, N, s));
}

extern "C" int emu_scale_inplace_dev_bf16(BRAID_EMU_DIMS, bf16_t* x, long long N,
                                          const float* s) {
    return BRAID_EMU_LAUNCH(scale_inplace_dev_bf16(x, N, s));
}

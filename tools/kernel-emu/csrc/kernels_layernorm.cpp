// C entry points of models/gpt2/src/kernels/layernorm.cu (src/lib.rs).
#include "cuda_emu.h"

#include "layernorm.cu"

extern "C" int emu_layernorm_forward(BRAID_EMU_DIMS, float* out, float* mean, float* rstd,
                                     const float* inp, const float* weight, const float* bias,
                                     int N, int C) {
    return BRAID_EMU_LAUNCH(layernorm_forward(out, mean, rstd, inp, weight, bias, N, C));
}

extern "C" int emu_layernorm_forward_bf16(BRAID_EMU_DIMS, bf16_t* out, float* mean, float* rstd,
                                          const bf16_t* inp, const bf16_t* weight,
                                          const bf16_t* bias, int N, int C) {
    return BRAID_EMU_LAUNCH(layernorm_forward_bf16(out, mean, rstd, inp, weight, bias, N, C));
}

extern "C" int emu_layernorm_residual_forward(BRAID_EMU_DIMS, float* residual, float* out,
                                              float* mean, float* rstd, const float* inp1,
                                              const float* inp2, const float* weight,
                                              const float* bias, int N, int C) {
    return BRAID_EMU_LAUNCH(
        layernorm_residual_forward(residual, out, mean, rstd, inp1, inp2, weight, bias, N, C));
}

extern "C" int emu_layernorm_residual_forward_bf16(BRAID_EMU_DIMS, bf16_t* residual,
                                                   bf16_t* out, float* mean, float* rstd,
                                                   const bf16_t* inp1, const bf16_t* inp2,
                                                   const bf16_t* weight, const bf16_t* bias,
                                                   int N, int C) {
    return BRAID_EMU_LAUNCH(layernorm_residual_forward_bf16(residual, out, mean, rstd, inp1,
                                                            inp2, weight, bias, N, C));
}

extern "C" int emu_layernorm_backward_input(BRAID_EMU_DIMS, float* dinp, const float* dres,
                                            const float* dout, const float* inp,
                                            const float* weight, const float* mean,
                                            const float* rstd, int N, int C) {
    return BRAID_EMU_LAUNCH(
        layernorm_backward_input(dinp, dres, dout, inp, weight, mean, rstd, N, C));
}

extern "C" int emu_layernorm_backward_input_bf16(BRAID_EMU_DIMS, bf16_t* dinp,
                                                 const bf16_t* dres, const bf16_t* dout,
                                                 const bf16_t* inp, const bf16_t* weight,
                                                 const float* mean, const float* rstd, int N,
                                                 int C) {
    return BRAID_EMU_LAUNCH(
        layernorm_backward_input_bf16(dinp, dres, dout, inp, weight, mean, rstd, N, C));
}

extern "C" int emu_layernorm_backward_params(BRAID_EMU_DIMS, float* dweight, float* dbias,
                                             const float* dout, const float* inp,
                                             const float* mean, const float* rstd, int N,
                                             int C) {
    return BRAID_EMU_LAUNCH(
        layernorm_backward_params(dweight, dbias, dout, inp, mean, rstd, N, C));
}

extern "C" int emu_layernorm_backward_params_bf16(BRAID_EMU_DIMS, bf16_t* dweight,
                                                  bf16_t* dbias, const bf16_t* dout,
                                                  const bf16_t* inp, const float* mean,
                                                  const float* rstd, int N, int C) {
    return BRAID_EMU_LAUNCH(
        layernorm_backward_params_bf16(dweight, dbias, dout, inp, mean, rstd, N, C));
}

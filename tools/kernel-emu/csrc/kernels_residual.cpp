// C entry points of models/gpt2/src/kernels/residual.cu (src/lib.rs).
#include "cuda_emu.h"

#include "residual.cu"

extern "C" int emu_residual_forward(BRAID_EMU_DIMS, float* out, const float* inp1,
                                    const float* inp2, long long N) {
    return BRAID_EMU_LAUNCH(residual_forward(out, inp1, inp2, N));
}

extern "C" int emu_residual_forward_bf16(BRAID_EMU_DIMS, bf16_t* out, const bf16_t* inp1,
                                         const bf16_t* inp2, long long N) {
    return BRAID_EMU_LAUNCH(residual_forward_bf16(out, inp1, inp2, N));
}

extern "C" int emu_residual_backward(BRAID_EMU_DIMS, float* dinp1, float* dinp2,
                                     const float* dout, long long N) {
    return BRAID_EMU_LAUNCH(residual_backward(dinp1, dinp2, dout, N));
}

extern "C" int emu_residual_backward_bf16(BRAID_EMU_DIMS, bf16_t* dinp1, bf16_t* dinp2,
                                          const bf16_t* dout, long long N) {
    return BRAID_EMU_LAUNCH(residual_backward_bf16(dinp1, dinp2, dout, N));
}

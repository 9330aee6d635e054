// C entry points of models/gpt2/src/kernels/gelu.cu (src/lib.rs).
#include "cuda_emu.h"

#include "gelu.cu"

extern "C" int emu_gelu_forward(BRAID_EMU_DIMS, float* out, const float* inp, long long N) {
    return BRAID_EMU_LAUNCH(gelu_forward(out, inp, N));
}

extern "C" int emu_gelu_forward_bf16(BRAID_EMU_DIMS, bf16_t* out, const bf16_t* inp,
                                     long long N) {
    return BRAID_EMU_LAUNCH(gelu_forward_bf16(out, inp, N));
}

extern "C" int emu_gelu_backward(BRAID_EMU_DIMS, float* dinp, const float* inp,
                                 const float* dout, long long N) {
    return BRAID_EMU_LAUNCH(gelu_backward(dinp, inp, dout, N));
}

extern "C" int emu_gelu_backward_bf16(BRAID_EMU_DIMS, bf16_t* dinp, const bf16_t* inp,
                                      const bf16_t* dout, long long N) {
    return BRAID_EMU_LAUNCH(gelu_backward_bf16(dinp, inp, dout, N));
}

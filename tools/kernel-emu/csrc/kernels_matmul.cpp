// C entry points of models/gpt2/src/kernels/matmul.cu (src/lib.rs): the bias
// kernels (the products themselves are cuBLAS calls, not emulated).
#include "cuda_emu.h"

#include "matmul.cu"

extern "C" int emu_bias_broadcast(BRAID_EMU_DIMS, float* out, const float* bias, int N, int OC,
                                  int ld) {
    return BRAID_EMU_LAUNCH(bias_broadcast(out, bias, N, OC, ld));
}

extern "C" int emu_bias_broadcast_bf16(BRAID_EMU_DIMS, bf16_t* out, const bf16_t* bias, int N,
                                       int OC, int ld) {
    return BRAID_EMU_LAUNCH(bias_broadcast_bf16(out, bias, N, OC, ld));
}

extern "C" int emu_bias_backward(BRAID_EMU_DIMS, float* dbias, const float* dout, int N, int OC,
                                 int ld) {
    return BRAID_EMU_LAUNCH(bias_backward(dbias, dout, N, OC, ld));
}

extern "C" int emu_bias_backward_bf16(BRAID_EMU_DIMS, bf16_t* dbias, const bf16_t* dout, int N,
                                      int OC, int ld) {
    return BRAID_EMU_LAUNCH(bias_backward_bf16(dbias, dout, N, OC, ld));
}

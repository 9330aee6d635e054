// C entry points of models/gpt2/src/kernels/flash_attention.cu (src/lib.rs).
#include "cuda_emu.h"

#include "flash_attention.cu"

extern "C" int emu_flash_attention_forward(BRAID_EMU_DIMS, float* out, float* lse,
                                           const float* inp, int B, int T, int C, int NH,
                                           int block_k) {
    return BRAID_EMU_LAUNCH(flash_attention_forward(out, lse, inp, B, T, C, NH, block_k));
}

extern "C" int emu_flash_attention_forward_bf16(BRAID_EMU_DIMS, bf16_t* out, float* lse,
                                                const bf16_t* inp, int B, int T, int C, int NH,
                                                int block_k) {
    return BRAID_EMU_LAUNCH(flash_attention_forward_bf16(out, lse, inp, B, T, C, NH, block_k));
}

extern "C" int emu_flash_attention_delta(BRAID_EMU_DIMS, float* delta, const float* dout,
                                         const float* out, int B, int T, int C, int NH) {
    return BRAID_EMU_LAUNCH(flash_attention_delta(delta, dout, out, B, T, C, NH));
}

extern "C" int emu_flash_attention_delta_bf16(BRAID_EMU_DIMS, float* delta, const bf16_t* dout,
                                              const bf16_t* out, int B, int T, int C, int NH) {
    return BRAID_EMU_LAUNCH(flash_attention_delta_bf16(delta, dout, out, B, T, C, NH));
}

extern "C" int emu_flash_attention_backward_dq(BRAID_EMU_DIMS, float* dinp, const float* delta,
                                               const float* dout, const float* inp,
                                               const float* lse, int B, int T, int C, int NH) {
    return BRAID_EMU_LAUNCH(
        flash_attention_backward_dq(dinp, delta, dout, inp, lse, B, T, C, NH));
}

extern "C" int emu_flash_attention_backward_dq_bf16(BRAID_EMU_DIMS, bf16_t* dinp,
                                                    const float* delta, const bf16_t* dout,
                                                    const bf16_t* inp, const float* lse, int B,
                                                    int T, int C, int NH) {
    return BRAID_EMU_LAUNCH(
        flash_attention_backward_dq_bf16(dinp, delta, dout, inp, lse, B, T, C, NH));
}

extern "C" int emu_flash_attention_backward_dkv(BRAID_EMU_DIMS, float* dinp, const float* delta,
                                                const float* dout, const float* inp,
                                                const float* lse, int B, int T, int C, int NH) {
    return BRAID_EMU_LAUNCH(
        flash_attention_backward_dkv(dinp, delta, dout, inp, lse, B, T, C, NH));
}

extern "C" int emu_flash_attention_backward_dkv_bf16(BRAID_EMU_DIMS, bf16_t* dinp,
                                                     const float* delta, const bf16_t* dout,
                                                     const bf16_t* inp, const float* lse, int B,
                                                     int T, int C, int NH) {
    return BRAID_EMU_LAUNCH(
        flash_attention_backward_dkv_bf16(dinp, delta, dout, inp, lse, B, T, C, NH));
}

// C entry points of models/gpt2/src/kernels/flash_attention_tc.cu (src/lib.rs).
#include <cstring>

#include "cuda_emu.h"

#include "flash_attention_tc.cu"

// The forward entry takes the scalar forward's block_k and ignores it (the
// tensor-core kernel's key tiles are 64), so both share one Rust signature.
extern "C" int emu_flash_attention_tc_forward_bf16(BRAID_EMU_DIMS, bf16_t* out, float* lse,
                                                   const bf16_t* inp, int B, int T, int C,
                                                   int NH, int /* block_k */) {
    return BRAID_EMU_LAUNCH(flash_attention_tc_forward_bf16(out, lse, inp, B, T, C, NH));
}

extern "C" int emu_flash_attention_tc_backward_dq_bf16(BRAID_EMU_DIMS, bf16_t* dinp,
                                                       const float* delta, const bf16_t* dout,
                                                       const bf16_t* inp, const float* lse,
                                                       int B, int T, int C, int NH) {
    return BRAID_EMU_LAUNCH(
        flash_attention_tc_backward_dq_bf16(dinp, delta, dout, inp, lse, B, T, C, NH));
}

extern "C" int emu_flash_attention_tc_backward_dkv_bf16(BRAID_EMU_DIMS, bf16_t* dinp,
                                                        const float* delta, const bf16_t* dout,
                                                        const bf16_t* inp, const float* lse,
                                                        int B, int T, int C, int NH) {
    return BRAID_EMU_LAUNCH(
        flash_attention_tc_backward_dkv_bf16(dinp, delta, dout, inp, lse, B, T, C, NH));
}

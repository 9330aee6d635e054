// C entry points of models/gpt2/src/kernels/flash_attention_tc.cu (src/lib.rs):
// one per kernel, dispatching on the head size C / NH to the kernel built for
// it (the Rust wrappers accept only 16, 32 and 64; anything else returns -1).
#include <cstring>

#include "cuda_emu.h"

#include "flash_attention_tc.cu"

#define TC_DISPATCH(KERNEL, ...)                                                     \
    switch (C / NH) {                                                                \
        case 16: return BRAID_EMU_LAUNCH(flash_attention_tc_##KERNEL##_hs16_bf16(__VA_ARGS__)); \
        case 32: return BRAID_EMU_LAUNCH(flash_attention_tc_##KERNEL##_hs32_bf16(__VA_ARGS__)); \
        case 64: return BRAID_EMU_LAUNCH(flash_attention_tc_##KERNEL##_hs64_bf16(__VA_ARGS__)); \
        default: return -1;                                                          \
    }

// The forward entry takes the scalar forward's block_k and ignores it (the
// tensor-core kernels' key tiles are 64), so both share one Rust signature.
extern "C" int emu_flash_attention_tc_forward_bf16(BRAID_EMU_DIMS, bf16_t* out, float* lse,
                                                   const bf16_t* inp, int B, int T, int C,
                                                   int NH, int /* block_k */) {
    TC_DISPATCH(forward, out, lse, inp, B, T, C, NH)
}

extern "C" int emu_flash_attention_tc_backward_dq_bf16(BRAID_EMU_DIMS, bf16_t* dinp,
                                                       const float* delta, const bf16_t* dout,
                                                       const bf16_t* inp, const float* lse,
                                                       int B, int T, int C, int NH) {
    TC_DISPATCH(backward_dq, dinp, delta, dout, inp, lse, B, T, C, NH)
}

extern "C" int emu_flash_attention_tc_backward_dkv_bf16(BRAID_EMU_DIMS, bf16_t* dinp,
                                                        const float* delta, const bf16_t* dout,
                                                        const bf16_t* inp, const float* lse,
                                                        int B, int T, int C, int NH) {
    TC_DISPATCH(backward_dkv, dinp, delta, dout, inp, lse, B, T, C, NH)
}

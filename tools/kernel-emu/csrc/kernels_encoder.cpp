// C entry points of models/gpt2/src/kernels/encoder.cu (src/lib.rs).
#include "cuda_emu.h"

#include "encoder.cu"

extern "C" int emu_encoder_forward(BRAID_EMU_DIMS, float* out, const unsigned* tokens,
                                   const float* wte, const float* wpe, int B, int T, int C) {
    return BRAID_EMU_LAUNCH(encoder_forward(out, tokens, wte, wpe, B, T, C));
}

extern "C" int emu_encoder_forward_bf16(BRAID_EMU_DIMS, bf16_t* out, const unsigned* tokens,
                                        const bf16_t* wte, const bf16_t* wpe, int B, int T,
                                        int C) {
    return BRAID_EMU_LAUNCH(encoder_forward_bf16(out, tokens, wte, wpe, B, T, C));
}

extern "C" int emu_encoder_backward_wpe(BRAID_EMU_DIMS, float* dwpe, const float* dout, int B,
                                        int T, int C) {
    return BRAID_EMU_LAUNCH(encoder_backward_wpe(dwpe, dout, B, T, C));
}

extern "C" int emu_encoder_backward_wpe_bf16(BRAID_EMU_DIMS, bf16_t* dwpe, const bf16_t* dout,
                                             int B, int T, int C) {
    return BRAID_EMU_LAUNCH(encoder_backward_wpe_bf16(dwpe, dout, B, T, C));
}

extern "C" int emu_encoder_backward_wte(BRAID_EMU_DIMS, float* dwte, const float* dout,
                                        const unsigned* tokens, int BT, int C) {
    return BRAID_EMU_LAUNCH(encoder_backward_wte(dwte, dout, tokens, BT, C));
}

extern "C" int emu_encoder_backward_links(BRAID_EMU_DIMS, unsigned* links,
                                          const unsigned* tokens, int BT) {
    return BRAID_EMU_LAUNCH(encoder_backward_links(links, tokens, BT));
}

extern "C" int emu_encoder_backward_wte_bf16(BRAID_EMU_DIMS, bf16_t* dwte, const bf16_t* dout,
                                             const unsigned* tokens, const unsigned* links,
                                             int BT, int C) {
    return BRAID_EMU_LAUNCH(encoder_backward_wte_bf16(dwte, dout, tokens, links, BT, C));
}

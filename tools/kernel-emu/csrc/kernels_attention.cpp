// C entry points of models/gpt2/src/kernels/attention.cu (src/lib.rs): the
// permutes and the causal softmax (the batched products between them are
// cuBLAS calls, not emulated).
#include "cuda_emu.h"

#include "attention.cu"

extern "C" int emu_attention_permute(BRAID_EMU_DIMS, float* q, float* k, float* v, const float* inp,
                                     int B, int T, int NH, int hs) {
    return BRAID_EMU_LAUNCH(attention_permute(q, k, v, inp, B, T, NH, hs));
}

extern "C" int emu_attention_permute_backward(BRAID_EMU_DIMS, float* dinp, const float* dq,
                                              const float* dk, const float* dv, int B, int T,
                                              int NH, int hs) {
    return BRAID_EMU_LAUNCH(attention_permute_backward(dinp, dq, dk, dv, B, T, NH, hs));
}

extern "C" int emu_attention_unpermute(BRAID_EMU_DIMS, float* out, const float* vaccum, int B,
                                       int T, int NH, int hs) {
    return BRAID_EMU_LAUNCH(attention_unpermute(out, vaccum, B, T, NH, hs));
}

extern "C" int emu_attention_unpermute_backward(BRAID_EMU_DIMS, float* dvaccum,
                                                const float* dout, int B, int T, int NH,
                                                int hs) {
    return BRAID_EMU_LAUNCH(attention_unpermute_backward(dvaccum, dout, B, T, NH, hs));
}

extern "C" int emu_attention_softmax_forward(BRAID_EMU_DIMS, float* att, const float* preatt,
                                             int BNH, int T, float scale) {
    return BRAID_EMU_LAUNCH(attention_softmax_forward(att, preatt, BNH, T, scale));
}

extern "C" int emu_attention_softmax_backward(BRAID_EMU_DIMS, float* dpreatt, const float* datt,
                                              const float* att, int BNH, int T, float scale) {
    return BRAID_EMU_LAUNCH(attention_softmax_backward(dpreatt, datt, att, BNH, T, scale));
}

extern "C" int emu_attention_permute_bf16(BRAID_EMU_DIMS, bf16_t* q, bf16_t* k, bf16_t* v,
                                          const bf16_t* inp, int B, int T, int NH, int hs) {
    return BRAID_EMU_LAUNCH(attention_permute_bf16(q, k, v, inp, B, T, NH, hs));
}

extern "C" int emu_attention_permute_backward_bf16(BRAID_EMU_DIMS, bf16_t* dinp, const bf16_t* dq,
                                                   const bf16_t* dk, const bf16_t* dv, int B, int T,
                                                   int NH, int hs) {
    return BRAID_EMU_LAUNCH(attention_permute_backward_bf16(dinp, dq, dk, dv, B, T, NH, hs));
}

extern "C" int emu_attention_unpermute_bf16(BRAID_EMU_DIMS, bf16_t* out, const bf16_t* vaccum,
                                            int B, int T, int NH, int hs) {
    return BRAID_EMU_LAUNCH(attention_unpermute_bf16(out, vaccum, B, T, NH, hs));
}

extern "C" int emu_attention_unpermute_backward_bf16(BRAID_EMU_DIMS, bf16_t* dvaccum,
                                                     const bf16_t* dout, int B, int T, int NH,
                                                     int hs) {
    return BRAID_EMU_LAUNCH(attention_unpermute_backward_bf16(dvaccum, dout, B, T, NH, hs));
}

extern "C" int emu_attention_softmax_forward_bf16(BRAID_EMU_DIMS, bf16_t* att, const bf16_t* preatt,
                                                  int BNH, int T, float scale) {
    return BRAID_EMU_LAUNCH(attention_softmax_forward_bf16(att, preatt, BNH, T, scale));
}

extern "C" int emu_attention_softmax_backward_bf16(BRAID_EMU_DIMS, bf16_t* dpreatt,
                                                   const bf16_t* datt, const bf16_t* att, int BNH,
                                                   int T, float scale) {
    return BRAID_EMU_LAUNCH(attention_softmax_backward_bf16(dpreatt, datt, att, BNH, T, scale));
}

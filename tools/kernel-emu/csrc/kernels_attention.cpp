// The kernels of models/gpt2/src/kernels/attention.cu (src/gpt2/attention.rs):
// the permutes and the causal softmax (the batched products between them are
// cuBLAS calls, not emulated).
#include "cuda_emu.h"

#include "attention.cu"

BRAID_EMU_EXPORT(attention_permute)
BRAID_EMU_EXPORT(attention_permute_bf16)
BRAID_EMU_EXPORT(attention_permute_backward)
BRAID_EMU_EXPORT(attention_permute_backward_bf16)
BRAID_EMU_EXPORT(attention_unpermute)
BRAID_EMU_EXPORT(attention_unpermute_bf16)
BRAID_EMU_EXPORT(attention_unpermute_backward)
BRAID_EMU_EXPORT(attention_unpermute_backward_bf16)
BRAID_EMU_EXPORT(attention_softmax_forward)
BRAID_EMU_EXPORT(attention_softmax_forward_bf16)
BRAID_EMU_EXPORT(attention_softmax_backward)
BRAID_EMU_EXPORT(attention_softmax_backward_bf16)
BRAID_EMU_EXPORT(attention_decode)
BRAID_EMU_EXPORT(attention_decode_bf16)

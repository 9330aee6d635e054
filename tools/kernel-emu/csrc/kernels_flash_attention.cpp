// The kernels of models/gpt2/src/kernels/flash_attention.cu
// (src/gpt2/flash_attention.rs).
#include "cuda_emu.h"

#include "flash_attention.cu"

BRAID_EMU_EXPORT(flash_attention_forward)
BRAID_EMU_EXPORT(flash_attention_forward_bf16)
BRAID_EMU_EXPORT(flash_attention_delta)
BRAID_EMU_EXPORT(flash_attention_delta_bf16)
BRAID_EMU_EXPORT(flash_attention_backward_dq)
BRAID_EMU_EXPORT(flash_attention_backward_dq_bf16)
BRAID_EMU_EXPORT(flash_attention_backward_dkv)
BRAID_EMU_EXPORT(flash_attention_backward_dkv_bf16)

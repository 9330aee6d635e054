// The kernels of models/gpt2/src/kernels/flash_attention_tc.cu
// (src/gpt2/flash_attention.rs): one set per head size (the Rust wrappers pick
// the kernel for C / NH).
#include "cuda_emu.h"

#include "flash_attention_tc.cu"

BRAID_EMU_EXPORT(flash_attention_tc_forward_hs16_bf16)
BRAID_EMU_EXPORT(flash_attention_tc_backward_dq_hs16_bf16)
BRAID_EMU_EXPORT(flash_attention_tc_backward_dkv_hs16_bf16)
BRAID_EMU_EXPORT(flash_attention_tc_forward_hs32_bf16)
BRAID_EMU_EXPORT(flash_attention_tc_backward_dq_hs32_bf16)
BRAID_EMU_EXPORT(flash_attention_tc_backward_dkv_hs32_bf16)
BRAID_EMU_EXPORT(flash_attention_tc_forward_hs64_bf16)
BRAID_EMU_EXPORT(flash_attention_tc_backward_dq_hs64_bf16)
BRAID_EMU_EXPORT(flash_attention_tc_backward_dkv_hs64_bf16)

// The kernels of models/gpt2/src/kernels/encoder.cu (src/gpt2/encoder.rs).
#include "cuda_emu.h"

#include "encoder.cu"

BRAID_EMU_EXPORT(encoder_forward)
BRAID_EMU_EXPORT(encoder_forward_bf16)
BRAID_EMU_EXPORT(encoder_backward_wpe)
BRAID_EMU_EXPORT(encoder_backward_wpe_bf16)
BRAID_EMU_EXPORT(encoder_backward_wte)
BRAID_EMU_EXPORT(encoder_backward_links)
BRAID_EMU_EXPORT(encoder_backward_wte_bf16)

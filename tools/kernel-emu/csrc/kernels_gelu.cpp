// The kernels of models/gpt2/src/kernels/gelu.cu (src/gpt2/gelu.rs).
#include "cuda_emu.h"

#include "gelu.cu"

BRAID_EMU_EXPORT(gelu_forward)
BRAID_EMU_EXPORT(gelu_forward_bf16)
BRAID_EMU_EXPORT(gelu_backward)
BRAID_EMU_EXPORT(gelu_backward_bf16)

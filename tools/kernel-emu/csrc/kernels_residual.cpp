// The kernels of models/gpt2/src/kernels/residual.cu (src/gpt2/residual.rs).
#include "cuda_emu.h"

#include "residual.cu"

BRAID_EMU_EXPORT(residual_forward)
BRAID_EMU_EXPORT(residual_forward_bf16)
BRAID_EMU_EXPORT(residual_backward)
BRAID_EMU_EXPORT(residual_backward_bf16)

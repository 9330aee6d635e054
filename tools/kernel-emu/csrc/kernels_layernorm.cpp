// The kernels of models/gpt2/src/kernels/layernorm.cu (src/gpt2/layernorm.rs).
#include "cuda_emu.h"

#include "layernorm.cu"

BRAID_EMU_EXPORT(layernorm_forward)
BRAID_EMU_EXPORT(layernorm_forward_bf16)
BRAID_EMU_EXPORT(layernorm_residual_forward)
BRAID_EMU_EXPORT(layernorm_residual_forward_bf16)
BRAID_EMU_EXPORT(layernorm_backward_input)
BRAID_EMU_EXPORT(layernorm_backward_input_bf16)
BRAID_EMU_EXPORT(layernorm_backward_params_partial)
BRAID_EMU_EXPORT(layernorm_backward_params_partial_bf16)
BRAID_EMU_EXPORT(layernorm_backward_params_finish)
BRAID_EMU_EXPORT(layernorm_backward_params_finish_bf16)

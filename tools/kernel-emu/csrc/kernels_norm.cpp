// The kernels of models/gpt2/src/kernels/norm.cu (src/gpt2/norm.rs).
#include "cuda_emu.h"

#include "norm.cu"

BRAID_EMU_EXPORT(grad_norm_sq_partial)
BRAID_EMU_EXPORT(grad_norm_sq_partial_bf16)
BRAID_EMU_EXPORT(grad_norm_sq_finalize)
BRAID_EMU_EXPORT(grad_clip_scale)
BRAID_EMU_EXPORT(scale_inplace)
BRAID_EMU_EXPORT(scale_inplace_bf16)
BRAID_EMU_EXPORT(scale_inplace_dev)
BRAID_EMU_EXPORT(scale_inplace_dev_bf16)

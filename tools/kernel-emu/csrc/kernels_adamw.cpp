// The kernels of models/gpt2/src/kernels/adamw.cu (src/gpt2/adamw.rs).
#include "cuda_emu.h"

#include "adamw.cu"

BRAID_EMU_EXPORT(adamw_update)
BRAID_EMU_EXPORT(adamw_update_mixed_f32)
BRAID_EMU_EXPORT(adamw_update_mixed_bf16)

// The kernels of models/gpt2/src/kernels/matmul.cu (src/gpt2/matmul.rs): the
// bias kernels (the products themselves are cuBLAS calls, not emulated).
#include "cuda_emu.h"

#include "matmul.cu"

BRAID_EMU_EXPORT(bias_broadcast)
BRAID_EMU_EXPORT(bias_broadcast_bf16)
BRAID_EMU_EXPORT(bias_backward)
BRAID_EMU_EXPORT(bias_backward_bf16)

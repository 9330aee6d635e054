// The kernels of cuda/kernels/sparse_rows.cu (src/engine.rs): the gradient
// reducer's row contributions.
#include "cuda_emu.h"

#include "sparse_rows.cu"

BRAID_EMU_EXPORT(sparse_rows_links)
BRAID_EMU_EXPORT(sparse_rows_add_f32)
BRAID_EMU_EXPORT(sparse_rows_add_bf16)

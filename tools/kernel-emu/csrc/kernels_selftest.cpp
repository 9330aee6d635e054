// The kernels of selftest.cu (src/lib.rs).
#include "cuda_emu.h"

#include "selftest.cu"

BRAID_EMU_EXPORT(selftest_block_sum)
BRAID_EMU_EXPORT(selftest_warp_sum)
BRAID_EMU_EXPORT(selftest_shuffles)
BRAID_EMU_EXPORT(selftest_mma)
BRAID_EMU_EXPORT(selftest_ldmatrix_mma)
BRAID_EMU_EXPORT(selftest_fault)

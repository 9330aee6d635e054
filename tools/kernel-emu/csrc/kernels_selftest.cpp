// C entry points of selftest.cu's kernels (src/lib.rs).
#include "cuda_emu.h"

#include "selftest.cu"

extern "C" int emu_selftest_block_sum(BRAID_EMU_DIMS, float* out, const float* in, int n) {
    return BRAID_EMU_LAUNCH(selftest_block_sum(out, in, n));
}

extern "C" int emu_selftest_warp_sum(BRAID_EMU_DIMS, float* out, const float* in, int n) {
    return BRAID_EMU_LAUNCH(selftest_warp_sum(out, in, n));
}

extern "C" int emu_selftest_shuffles(BRAID_EMU_DIMS, int* out) {
    return BRAID_EMU_LAUNCH(selftest_shuffles(out));
}

extern "C" int emu_selftest_mma(BRAID_EMU_DIMS, float* d, const unsigned short* a,
                                const unsigned short* b) {
    return BRAID_EMU_LAUNCH(selftest_mma(d, a, b));
}

extern "C" int emu_selftest_fault(BRAID_EMU_DIMS, float* out, int mode) {
    return BRAID_EMU_LAUNCH(selftest_fault(out, mode));
}

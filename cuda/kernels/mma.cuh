// mma.cuh: the bf16 tensor-core instructions as device functions, for
// kernels that tile with mma.sync (GPT-2's flash_attention_tc.cu; the
// emulator's selftest.cu). Needs sm_80 or later. Under the kernel emulator
// (BRAID_KERNEL_EMU) tools/kernel-emu/csrc/cuda_emu.h supplies the same
// functions, with the fragment layouts spelled out. NVRTC reads no files:
// the engine (braid::cuda::engine_kernels::HEADERS), GPT-2's programs and
// tools/nvrtc-check hand it this header with each program.
#pragma once

#ifndef BRAID_KERNEL_EMU
// d += a * b, one warp: mma.sync m16n8k16, A 16 x 16 bf16 (row), B 16 x 8
// bf16 (col), D f32, fragments as the PTX ISA lays them out.
static __device__ __forceinline__ void mma_bf16_16816(float d[4], const unsigned a[4],
                                                      const unsigned b[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Four 8 x 8 bf16 matrices of shared memory, each read column-major: lane l
// gives the address of row l % 8 of matrix l / 8 (16-byte aligned), and
// r[i] = {M_i[2t][g], M_i[2t+1][g]}, an mma B register when M_i's rows are k.
static __device__ __forceinline__ void ldmatrix_x4_trans(unsigned r[4], const void* row) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

// The same, each matrix read row-major: r[i] = {M_i[g][2t], M_i[g][2t+1]},
// an mma B register when M_i's rows are n and its columns k.
static __device__ __forceinline__ void ldmatrix_x4(unsigned r[4], const void* row) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}
#endif

// Engine test kernel: busy-waits for a given number of GPU clock cycles.
//
// Used by the overlap tests: two spin kernels on two streams that are free of
// dependencies must overlap in time (the trace shows both streams busy at once),
// while the same kernels on one stream take twice as long.
//
// Launch: grid (1), block (1). A single thread is enough: the kernel occupies
// one SM slot and leaves the rest of the GPU free for the other stream.

// spin(cycles, out): waits until clock64() has advanced by `cycles`, then, if
// `out` is not null, writes the cycles actually spent to out[0] (so the compiler
// cannot drop the loop and the test can check the kernel really ran).
extern "C" __global__ void spin(long long cycles, long long* out) {
    const long long start = clock64();
    long long now = start;
    while (now - start < cycles) {
        now = clock64();
    }
    if (out != nullptr && threadIdx.x == 0 && blockIdx.x == 0) {
        out[0] = now - start;
    }
}

// spin_then_add(cycles, x, n, v): spins like `spin`, then x[i] += v for i < n
// (one thread per element after the wait; launch grid ceil(n / block)). Lets a
// test make a slow writer whose result a fast reader on another stream must
// wait for (a read-after-write edge that is only correct if the wait was issued).
extern "C" __global__ void spin_then_add(long long cycles, float* x, int n, float v) {
    const long long start = clock64();
    while (clock64() - start < cycles) {
    }
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        x[i] = __fadd_rn(x[i], v);
    }
}

// where_blocks_ran(smid, cycles): each block's first thread writes the SM it
// runs on to smid[blockIdx.x], then spins for `cycles`, so that the blocks of
// a launch several times the SM count spread over every SM they may use.
// Lets a test count the SMs a stream's kernels reach (a green context's
// stream must stay on its partition).
extern "C" __global__ void where_blocks_ran(unsigned* smid, long long cycles) {
    if (threadIdx.x == 0) {
        unsigned id;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
        smid[blockIdx.x] = id;
        const long long start = clock64();
        while (clock64() - start < cycles) {
        }
    }
}

// Engine test kernels: simple, deterministic elementwise f32 arithmetic for the
// random-program property test (every program must give, bit for bit, the result
// of running its tasks one at a time in submission order).
//
// All arithmetic uses the explicitly rounded intrinsics __fmul_rn/__fadd_rn, which
// the compiler never contracts into a fused multiply-add, so a CPU model written
// as plain f32 `a * x + b` (Rust does not contract either) gives identical bits.
//
// Launch: 1-D, grid ceil(n / block), any block size (256 is a good default).

// out[i] = a * in[i] + b
extern "C" __global__ void axpb(float* out, const float* in, float a, float b, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        out[i] = __fadd_rn(__fmul_rn(a, in[i]), b);
    }
}

// x[i] = a * x[i] + b   (read_write access on one buffer)
extern "C" __global__ void axpb_inplace(float* x, float a, float b, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        x[i] = __fadd_rn(__fmul_rn(a, x[i]), b);
    }
}

// out[i] = a * (((in0[i] + in1[i]) + in2[i]) + in3[i]) + b, summing only the
// first `k` inputs (1 <= k <= 4, left to right; the unused pointers may be null).
// `out` may alias none of the inputs.
extern "C" __global__ void axpb_sum(float* out, const float* in0, const float* in1,
                                    const float* in2, const float* in3, int k, float a,
                                    float b, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) {
        return;
    }
    float s = in0[i];
    if (k > 1) s = __fadd_rn(s, in1[i]);
    if (k > 2) s = __fadd_rn(s, in2[i]);
    if (k > 3) s = __fadd_rn(s, in3[i]);
    out[i] = __fadd_rn(__fmul_rn(a, s), b);
}

// out[i] = value
extern "C" __global__ void fill(float* out, float value, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        out[i] = value;
    }
}

// Your own kernel on Braid's stream.
//
// A task submitted with run_cuda (or run_any, one body per backend) names its
// accesses as tokens, and its CUDA body gets their typed device addresses
// (braid::DeviceSpan<const float> for a read, braid::DeviceSpan<float> for a
// write; they convert to const float* / float*) and the stream it runs on
// (braid::CudaStream, which converts to cudaStream_t / CUstream). Launch your
// kernel there and Braid orders it with every other task: no extra
// synchronisation.
//
// This file is plain C++ (no nvcc needed): the kernel is PTX text, loaded and
// launched through the CUDA driver API, whose entry points are looked up at
// run time with dlopen("libcuda.so.1"). With nvcc the CUDA body would be
//   [](const float* x, float* y, cudaStream_t s) { scale<<<grid, block, 0, s>>>(y, x, a, n); }
//
// Without a GPU — or with a Braid build whose runtime falls back to the CPU —
// it says so, prints "SKIPPED (GPU part)", and run_any runs the task's CPU
// body (a loop over the host spans) instead, so the rest of the program
// (declared accesses, ordering, read-back) still runs and is checked. It exits
// 0 in both cases and non-zero only when a result is wrong or the driver
// reports an error.
#include <braid/braid.hpp>

#include <dlfcn.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

// y[i] = a * x[i] for i < n. Hand-written PTX (ISA 7.0, sm_52 and later: the
// driver JIT-compiles it for the actual device).
const char* const kScalePtx = R"PTX(
.version 7.0
.target sm_52
.address_size 64

.visible .entry braid_scale(
    .param .u64 param_y,
    .param .u64 param_x,
    .param .f32 param_a,
    .param .u32 param_n
)
{
    .reg .pred  %p<2>;
    .reg .b32   %r<6>;
    .reg .f32   %f<4>;
    .reg .b64   %rd<8>;

    ld.param.u64    %rd1, [param_y];
    ld.param.u64    %rd2, [param_x];
    ld.param.f32    %f1, [param_a];
    ld.param.u32    %r1, [param_n];
    mov.u32         %r2, %ctaid.x;
    mov.u32         %r3, %ntid.x;
    mov.u32         %r4, %tid.x;
    mad.lo.s32      %r5, %r2, %r3, %r4;
    setp.ge.u32     %p1, %r5, %r1;
    @%p1 bra        DONE;
    cvta.to.global.u64  %rd3, %rd2;
    cvta.to.global.u64  %rd4, %rd1;
    mul.wide.u32    %rd5, %r5, 4;
    add.s64         %rd6, %rd3, %rd5;
    ld.global.f32   %f2, [%rd6];
    mul.f32         %f3, %f2, %f1;
    add.s64         %rd7, %rd4, %rd5;
    st.global.f32   [%rd7], %f3;
DONE:
    ret;
}
)PTX";

// The few driver entry points the launch needs, resolved at run time.
struct Driver {
  using CUresult = int;
  using CUmodule = void*;
  using CUfunction = void*;
  CUresult (*cuModuleLoadData)(CUmodule*, const void*) = nullptr;
  CUresult (*cuModuleGetFunction)(CUfunction*, CUmodule, const char*) = nullptr;
  CUresult (*cuLaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void*,
                             void**, void**) = nullptr;
  CUresult (*cuGetErrorString)(CUresult, const char**) = nullptr;

  static const Driver* load() {
    static const Driver* driver = [] () -> const Driver* {
      void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
      if (lib == nullptr) return nullptr;
      static Driver d;
      d.cuModuleLoadData = reinterpret_cast<decltype(d.cuModuleLoadData)>(dlsym(lib, "cuModuleLoadData"));
      d.cuModuleGetFunction = reinterpret_cast<decltype(d.cuModuleGetFunction)>(dlsym(lib, "cuModuleGetFunction"));
      d.cuLaunchKernel = reinterpret_cast<decltype(d.cuLaunchKernel)>(dlsym(lib, "cuLaunchKernel"));
      d.cuGetErrorString = reinterpret_cast<decltype(d.cuGetErrorString)>(dlsym(lib, "cuGetErrorString"));
      if (!d.cuModuleLoadData || !d.cuModuleGetFunction || !d.cuLaunchKernel || !d.cuGetErrorString) return nullptr;
      return &d;
    }();
    return driver;
  }

  void check(CUresult r, const char* what) const {
    if (r == 0) return;
    const char* msg = nullptr;
    cuGetErrorString(r, &msg);
    throw std::runtime_error(std::string(what) + " failed: " + (msg ? msg : "unknown CUDA error"));
  }
};

// Launches y = a * x (n elements, device addresses) on `stream`.
void launch_scale(const float* x, float* y, float a, unsigned n, void* stream) {
  const Driver* drv = Driver::load();
  if (drv == nullptr) throw std::runtime_error("libcuda.so.1 could not be loaded");
  if (stream == nullptr) throw std::runtime_error("no CUDA stream");
  // The context is current on Braid's stream threads. (Load the module once
  // per program in real code; this example launches once.)
  Driver::CUmodule module = nullptr;
  Driver::CUfunction fn = nullptr;
  drv->check(drv->cuModuleLoadData(&module, kScalePtx), "cuModuleLoadData");
  drv->check(drv->cuModuleGetFunction(&fn, module, "braid_scale"), "cuModuleGetFunction");
  void* args[] = {&y, &x, &a, &n};
  const unsigned block = 256, grid = (n + block - 1) / block;
  drv->check(drv->cuLaunchKernel(fn, grid, 1, 1, block, 1, 1, 0, stream, args, nullptr), "cuLaunchKernel");
}

}  // namespace

int main() {
  try {
    braid::Runtime rt = braid::Runtime::builder().backend(braid::BackendKind::Auto).compute_streams(2).build();
    const bool gpu = rt.backend_name() == "cuda";
    constexpr unsigned n = 1000;
    constexpr float a = 3.0f;
    std::vector<float> host(n);
    for (unsigned i = 0; i < n; ++i) host[i] = static_cast<float>(i) * 0.5f;
    braid::Buffer x = rt.alloc_from("x", host);
    braid::Buffer y = rt.alloc("y", x.size());
    braid::Buffer z = rt.alloc("z", x.size());

    if (!gpu) {
      std::printf("custom_kernel: backend is `%s`, not cuda: no GPU to launch a kernel on.\n",
                  rt.backend_name().c_str());
      std::printf("SKIPPED (GPU part): the PTX launch on the task's CUDA stream needs a CUDA device.\n");
      std::printf("Running the same task graph with its CPU body instead.\n");
    }
    // scale: y = a * x (the custom kernel), then a dependent task: z = y + 1.
    rt.task("scale").run_any(
        braid::read<float>(x), braid::write<float>(y),
        [](braid::Span<const float> in, braid::Span<float> out) {
          for (std::size_t i = 0; i < in.size(); ++i) out[i] = a * in[i];
        },
        [](braid::DeviceSpan<const float> in, braid::DeviceSpan<float> out, braid::CudaStream stream) {
          launch_scale(in, out, a, static_cast<unsigned>(out.size()), stream);
        });
    if (!gpu) {
      rt.task("plus one").run(braid::read<float>(y), braid::write<float>(z), [](auto in, auto out) {
        for (std::size_t i = 0; i < in.size(); ++i) out[i] = in[i] + 1.0f;
      });
    }
    std::vector<float> got = rt.read_vec<float>(y);
    for (unsigned i = 0; i < n; ++i) {
      if (got[i] != a * host[i]) {
        std::fprintf(stderr, "custom_kernel: y[%u] = %g, expected %g\n", i, got[i], a * host[i]);
        return 1;
      }
    }
    if (!gpu) {
      std::vector<float> zz = rt.read_vec<float>(z);
      for (unsigned i = 0; i < n; ++i) {
        if (zz[i] != a * host[i] + 1.0f) {
          std::fprintf(stderr, "custom_kernel: z[%u] = %g, expected %g\n", i, zz[i], a * host[i] + 1.0f);
          return 1;
        }
      }
    }
    rt.synchronize();
    std::printf("custom_kernel: %s: y = %g * x checked for %u elements\n", gpu ? "GPU kernel" : "CPU fallback",
                static_cast<double>(a), n);
    return 0;
  } catch (const braid::Error& e) {
    std::fprintf(stderr, "custom_kernel: %s\n", e.what());
    return 1;
  }
}

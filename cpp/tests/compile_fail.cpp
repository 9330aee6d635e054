// What must not compile: a body cannot write through a read token, nor take
// a read as a writable device pointer, nor take other parameters than its
// tokens give (the CUDA stream included); an element type cannot be aligned
// beyond the buffers; a temporary builder cannot be bound to a reference; a
// scope cannot be assigned. CMakeLists.txt builds this file once as is (it must compile:
// the cases below are then the only reason for a failure) and once per
// BRAID_COMPILE_FAIL case, each a ctest that passes when the compiler refuses
// it with the expected message.
#include <braid/braid.hpp>

#ifndef BRAID_COMPILE_FAIL
#define BRAID_COMPILE_FAIL 0
#endif

int main() {
  braid::Runtime rt = braid::Runtime::cpu();
  braid::Buffer x = rt.alloc("x", 16), y = rt.alloc("y", 16);
  rt.task("ok").run(braid::read<float>(x), braid::write<float>(y), [](auto in, auto out) { out[0] = in[0]; });
  rt.task("ok").run_any(
      braid::read<float>(x), braid::read_write<float>(y), [](braid::Span<const float>, braid::Span<float>) {},
      [](const float*, float*, braid::CudaStream) {});
#if BRAID_COMPILE_FAIL == 1
  // Writing through a read: its span is Span<const float>.
  rt.task("bad").run(braid::read<float>(x), [](auto in) { in[0] = 1.0f; });
#elif BRAID_COMPILE_FAIL == 2
  // A read as a writable device pointer.
  rt.task("bad").run_cuda(braid::read<float>(x), [](float*, braid::CudaStream) {});
#elif BRAID_COMPILE_FAIL == 3
  // A body that does not take one span per token.
  rt.task("bad").run(braid::read<float>(x), braid::write<float>(y), [](braid::Span<const float>) {});
#elif BRAID_COMPILE_FAIL == 4
  // A view is not a token: name the access.
  rt.task("bad").run(x, [](auto) {});
#elif BRAID_COMPILE_FAIL == 5
  // A CUDA body that forgot a token: the stream is no data pointer.
  rt.task("bad").run_cuda(braid::read<float>(x), [](const float*, float*) {});
#elif BRAID_COMPILE_FAIL == 6
  // An element type aligned beyond the buffers' 64 bytes.
  struct alignas(128) Tile {
    float v[32];
  };
  rt.task("bad").run(braid::write<Tile>(x), [](auto) {});
#elif BRAID_COMPILE_FAIL == 7
  // A reference to a temporary builder would dangle.
  auto& tb = rt.task("bad").priority(braid::Priority::Side);
  tb.run(braid::write<float>(y), [](auto) {});
#elif BRAID_COMPILE_FAIL == 8
  // Assigning a scope would close both scopes.
  braid::Scope s = rt.scope("a");
  s = rt.scope("b");
#endif
  rt.synchronize();
  return 0;
}

// The smallest Braid program: two independent halves, then a dependent sum.
#include <braid/braid.hpp>

#include <cstdio>

int main() {
  try {
    braid::Runtime rt = braid::Runtime::builder().backend(braid::BackendKind::Cpu).compute_streams(2).build();
    braid::Buffer x = rt.alloc_from<float>("x", {1, 2, 3, 4});
    braid::Buffer y = rt.alloc("y", x.size());
    for (std::size_t half = 0; half < 2; ++half) {
      braid::View xs = x.view_of<float>(2 * half, 2 * half + 2), ys = y.view_of<float>(2 * half, 2 * half + 2);
      rt.task("double").run(braid::read<float>(xs), braid::write<float>(ys), [](auto in, auto out) {
        for (std::size_t i = 0; i < in.size(); ++i) out[i] = 2 * in[i];
      });
    }
    std::vector<float> v = rt.read_vec<float>(y);
    const bool ok = v == std::vector<float>({2, 4, 6, 8});
    std::printf("braid %s: y = {%g, %g, %g, %g}: %s\n", braid::version().c_str(), v[0], v[1], v[2], v[3],
                ok ? "ok" : "WRONG");
    return ok ? 0 : 1;
  } catch (const braid::Error& e) {
    std::fprintf(stderr, "braid_consumer: %s\n", e.what());
    return 1;
  }
}

// Overlap of computation and communication, from C++.
//
// Two CPU ranks (threads of this process, braid::launch) each run a small
// "data-parallel training step" on their own Braid runtime: a forward chain,
// then a backward pass that writes one gradient bucket per layer, last layer
// first. Each bucket is all-reduced (average) as soon as its layer's backward
// task has written it — the all-reduce is just a task declaring read_write on
// the bucket's view — so it runs on the comm stream while the backward pass of
// the earlier layers goes on. The optimizer step of a layer waits for its
// bucket's all-reduce, and nothing else.
//
// Writes one Chrome trace holding both ranks (argv[1], default
// overlap-trace.json; open it in chrome://tracing or ui.perfetto.dev), prints
// rank 0's summary, and exits non-zero if the ranks' parameters differ.
#include <braid/braid.hpp>

#include <cmath>
#include <cstdio>
#include <mutex>
#include <string>
#include <vector>

namespace {

constexpr std::size_t kLayers = 6;
constexpr std::size_t kWidth = 1 << 15;  // floats per layer
constexpr int kWork = 24;                // inner iterations per element: makes tasks take a few ms

// y <- tanh-ish(x * w), elementwise (a stand-in for a layer's kernel).
void layer_forward(braid::Span<const float> x, braid::Span<const float> w, braid::Span<float> y) {
  for (std::size_t i = 0; i < y.size(); ++i) {
    float v = x[i] * w[i];
    for (int k = 0; k < kWork; ++k) v = v / (1.0f + std::fabs(v)) + 0.01f * w[i];
    y[i] = v;
  }
}

// dw <- x * dy (+ work), dx <- w * dy: the layer's backward.
void layer_backward(braid::Span<const float> x, braid::Span<const float> w, braid::Span<const float> dy,
                    braid::Span<float> dw, braid::Span<float> dx) {
  for (std::size_t i = 0; i < dw.size(); ++i) {
    float g = x[i] * dy[i];
    for (int k = 0; k < kWork; ++k) g = g * 0.999f + 1e-4f * dy[i];
    dw[i] = g;
    dx[i] = w[i] * dy[i];
  }
}

struct RankResult {
  braid::Profile profile;
  std::vector<float> params;
};

}  // namespace

int main(int argc, char** argv) {
  const std::string trace_path = argc > 1 ? argv[1] : "overlap-trace.json";
  constexpr std::size_t world = 2;
  std::mutex mu;
  std::vector<RankResult> results;
  std::vector<std::size_t> result_rank;

  try {
    braid::launch(world, [&](std::size_t rank, braid::Communicator& comm) {
      braid::Runtime rt = braid::Runtime::builder()
                              .backend(braid::BackendKind::Cpu)
                              .compute_streams(2)
                              .comm_streams(1)
                              .policy(braid::Policy::Affinity)
                              .profile(true)
                              .rank(rank)
                              .build();
      // One allocation for all parameters, one for all gradients (llm.c's
      // layout): a layer's parameters, and a gradient bucket, are views.
      std::vector<float> init(kLayers * kWidth);
      for (std::size_t i = 0; i < init.size(); ++i) init[i] = 0.5f + 0.001f * static_cast<float>(i % 101);
      braid::Buffer params = rt.alloc_from("params", init);              // (L, W)
      braid::Buffer grads = rt.alloc("grads", params.size());           // (L, W)
      braid::Buffer acts = rt.alloc("acts", (kLayers + 1) * kWidth * 4);  // (L+1, W)
      braid::Buffer dacts = rt.alloc("dacts", (kLayers + 1) * kWidth * 4);
      auto layer = [](const braid::Buffer& b, std::size_t l) { return b.view_of<float>(l * kWidth, (l + 1) * kWidth); };

      // This rank's input batch.
      std::vector<float> batch(kWidth);
      for (std::size_t i = 0; i < kWidth; ++i) batch[i] = 0.1f * static_cast<float>(rank + 1) + 1e-5f * static_cast<float>(i);
      rt.upload(layer(acts, 0), batch);

      for (std::size_t l = 0; l < kLayers; ++l) {
        braid::View x = layer(acts, l), w = layer(params, l), y = layer(acts, l + 1);
        rt.task("forward " + std::to_string(l))
            .run(braid::read<float>(x), braid::read<float>(w), braid::write<float>(y), layer_forward);
      }
      // The loss gradient: dy = y (a stand-in).
      {
        braid::View y = layer(acts, kLayers), dy = layer(dacts, kLayers);
        rt.task("loss").run(braid::read<float>(y), braid::write<float>(dy), [](auto in, auto out) {
          for (std::size_t i = 0; i < in.size(); ++i) out[i] = in[i];
        });
      }
      std::vector<braid::TaskHandle> reduces;
      for (std::size_t l = kLayers; l-- > 0;) {
        braid::View x = layer(acts, l), w = layer(params, l), dy = layer(dacts, l + 1);
        braid::View dw = layer(grads, l), dx = layer(dacts, l);
        rt.task("backward " + std::to_string(l))
            .run(braid::read<float>(x), braid::read<float>(w), braid::read<float>(dy), braid::write<float>(dw),
                 braid::write<float>(dx), layer_backward);
        // The bucket is ready: average it over the ranks, under the rest of backward.
        reduces.push_back(comm.all_reduce<float>(rt, dw, braid::ReduceOp::Avg, "all_reduce grads " + std::to_string(l)));
      }
      for (std::size_t l = 0; l < kLayers; ++l) {
        braid::View w = layer(params, l), dw = layer(grads, l);
        rt.task("sgd " + std::to_string(l))
            .priority(braid::Priority::Side)
            .run(braid::read<float>(dw), braid::read_write<float>(w), [](auto g, auto p) {
              for (std::size_t i = 0; i < p.size(); ++i) p[i] -= 0.01f * g[i];
            });
      }
      rt.synchronize();
      RankResult r{rt.profile(), rt.read_vec<float>(params)};
      std::lock_guard<std::mutex> lock(mu);
      results.push_back(std::move(r));
      result_rank.push_back(rank);
    });
  } catch (const braid::Error& e) {
    std::fprintf(stderr, "overlap: %s\n", e.what());
    return 1;
  }

  std::vector<braid::Profile> profiles;
  const RankResult* rank0 = nullptr;
  for (std::size_t i = 0; i < results.size(); ++i) {
    profiles.push_back(results[i].profile);
    if (result_rank[i] == 0) rank0 = &results[i];
  }
  braid::write_trace(trace_path, profiles);

  bool same = results.size() == world;
  for (const auto& r : results) same = same && r.params == results[0].params;
  if (rank0 != nullptr) {
    const braid::Summary s = rank0->profile.summary();
    std::printf("rank 0 of %zu:\n%s\n", world, s.text.c_str());
    std::printf("all-reduce time hidden under backward: %.0f%%\n", 100.0 * s.hidden_share());
  }
  std::printf("trace: %s\n", trace_path.c_str());
  if (!same) {
    std::fprintf(stderr, "overlap: the ranks' parameters differ after the all-reduce\n");
    return 1;
  }
  std::printf("parameters identical on all %zu ranks\n", world);
  return 0;
}

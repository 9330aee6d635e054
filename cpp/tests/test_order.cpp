// Dependency order through the C++ API: a chain and a diamond over views give
// exactly (bit for bit) the sequential result on 1..4 streams under every
// placement policy; disjoint views of one buffer are independent (they run at
// the same time); overlapping views are ordered.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "check.hpp"

namespace {

constexpr braid::Policy kPolicies[] = {braid::Policy::Single, braid::Policy::RoundRobin,
                                       braid::Policy::Affinity};

braid::Runtime runtime(std::size_t streams, braid::Policy policy, bool profile = false) {
  return braid::Runtime::builder()
      .backend(braid::BackendKind::Cpu)
      .compute_streams(streams)
      .policy(policy)
      .profile(profile)
      .build();
}

bool bit_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// x <- x * a + b, elementwise: not commutative across steps, so any reordering
// of the chain shows in the bits.
void affine(braid::Span<float> x, float a, float b) {
  for (float& v : x) v = v * a + b;
}

void chain() {
  constexpr std::size_t n = 1024, steps = 40;
  std::vector<float> init(n);
  for (std::size_t i = 0; i < n; ++i) init[i] = 0.001f * static_cast<float>(i);
  std::vector<float> expected = init;
  for (std::size_t s = 0; s < steps; ++s) {
    affine(braid::Span<float>(expected.data(), n), 1.0f + 0.01f * static_cast<float>(s), static_cast<float>(s) * 0.5f);
  }
  for (std::size_t streams = 1; streams <= 4; ++streams) {
    for (braid::Policy policy : kPolicies) {
      braid::Runtime rt = runtime(streams, policy);
      braid::Buffer x = rt.alloc_from("x", init);
      for (std::size_t s = 0; s < steps; ++s) {
        const float a = 1.0f + 0.01f * static_cast<float>(s), b = static_cast<float>(s) * 0.5f;
        rt.task("step").run(braid::read_write<float>(x), [a, b](braid::Span<float> v) { affine(v, a, b); });
      }
      CHECK(bit_equal(rt.read_vec<float>(x), expected));
      rt.synchronize();
    }
  }
}

// One round of the diamond over four views of one buffer:
//   top:   v0 <- v0 + k
//   left:  v1 <- 2 * v0 + v1          (reads v0)
//   right: v2 <- v0 * v0 - v2         (reads v0)
//   join:  v3 <- v1 - v2 + v3 / 3     (reads v1, v2)
struct Diamond {
  static void top(braid::Span<float> v0, float k) {
    for (float& v : v0) v += k;
  }
  static void left(braid::Span<const float> v0, braid::Span<float> v1) {
    for (std::size_t i = 0; i < v1.size(); ++i) v1[i] = 2.0f * v0[i] + v1[i];
  }
  static void right(braid::Span<const float> v0, braid::Span<float> v2) {
    for (std::size_t i = 0; i < v2.size(); ++i) v2[i] = v0[i] * v0[i] - v2[i];
  }
  static void join(braid::Span<const float> v1, braid::Span<const float> v2, braid::Span<float> v3) {
    for (std::size_t i = 0; i < v3.size(); ++i) v3[i] = v1[i] - v2[i] + v3[i] / 3.0f;
  }
};

void diamond() {
  constexpr std::size_t n = 256, rounds = 12;
  std::vector<float> init(4 * n);
  for (std::size_t i = 0; i < init.size(); ++i) init[i] = 0.01f * static_cast<float>(i % 97);
  std::vector<float> expected = init;
  auto part = [&](std::size_t k) { return braid::Span<float>(expected.data() + k * n, n); };
  for (std::size_t r = 0; r < rounds; ++r) {
    Diamond::top(part(0), 0.25f * static_cast<float>(r));
    Diamond::left(part(0), part(1));
    Diamond::right(part(0), part(2));
    Diamond::join(part(1), part(2), part(3));
  }
  for (std::size_t streams = 1; streams <= 4; ++streams) {
    for (braid::Policy policy : kPolicies) {
      braid::Runtime rt = runtime(streams, policy);
      braid::Buffer buf = rt.alloc_from("diamond", init);
      std::vector<braid::View> v;
      for (std::size_t k = 0; k < 4; ++k) v.push_back(buf.view_of<float>(k * n, (k + 1) * n));
      for (std::size_t r = 0; r < rounds; ++r) {
        const float k = 0.25f * static_cast<float>(r);
        rt.task("top").run(braid::read_write<float>(v[0]), [k](braid::Span<float> v0) { Diamond::top(v0, k); });
        rt.task("left").run(braid::read<float>(v[0]), braid::read_write<float>(v[1]), Diamond::left);
        rt.task("right").run(braid::read<float>(v[0]), braid::read_write<float>(v[2]), Diamond::right);
        rt.task("join").run(braid::read<float>(v[1]), braid::read<float>(v[2]), braid::read_write<float>(v[3]),
                            Diamond::join);
      }
      CHECK(bit_equal(rt.read_vec<float>(buf), expected));
      rt.synchronize();
    }
  }
}

// Two tasks writing disjoint halves of one buffer must be able to run at the
// same time: each waits (bounded) until both have started. Were they ordered,
// the first would time out instead of seeing the second start.
void disjoint_views_are_independent() {
  braid::Runtime rt = runtime(2, braid::Policy::Affinity, true);
  braid::Buffer buf = rt.alloc("halves", 2 * 64 * sizeof(std::uint32_t));
  const braid::View lo = buf.view_of<std::uint32_t>(0, 64), hi = buf.view_of<std::uint32_t>(64, 128);
  std::atomic<int> started{0};
  std::atomic<int> met{0};
  auto body = [&started, &met](std::uint32_t value) {
    return [&started, &met, value](braid::Span<std::uint32_t> out) {
      started.fetch_add(1);
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
      while (started.load() < 2 && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
      if (started.load() == 2) met.fetch_add(1);
      for (auto& x : out) x = value;
    };
  };
  braid::TaskHandle a = rt.task("lo").run(braid::write<std::uint32_t>(lo), body(1));
  braid::TaskHandle b = rt.task("hi").run(braid::write<std::uint32_t>(hi), body(2));
  rt.synchronize();
  CHECK_EQ(met.load(), 2);
  CHECK(a.stream() != b.stream());
  std::vector<std::uint32_t> out = rt.read_vec<std::uint32_t>(buf);
  for (std::size_t i = 0; i < 128; ++i) CHECK_EQ(out[i], i < 64 ? 1u : 2u);
  CHECK(rt.summary().overlap_ns > 0);
}

// Overlapping views conflict: the second writer runs after the first and sees
// its result, whatever the stream count.
void overlapping_views_are_ordered() {
  for (std::size_t streams = 1; streams <= 4; ++streams) {
    braid::Runtime rt = runtime(streams, braid::Policy::RoundRobin, true);
    braid::Buffer buf = rt.alloc("b", 16 * sizeof(int));
    const braid::View first = buf.view_of<int>(0, 10), second = buf.view_of<int>(6, 16);
    rt.task("first").run(braid::write<int>(first), [](braid::Span<int> out) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      for (int& x : out) x = 1;
    });
    rt.task("second").run(braid::read_write<int>(second), [](braid::Span<int> out) {
      for (int& x : out) x = x * 10 + 2;
    });
    std::vector<int> out = rt.read_vec<int>(buf);
    for (std::size_t i = 0; i < 16; ++i) CHECK_EQ(out[i], i < 6 ? 1 : (i < 10 ? 12 : 2));
    std::vector<braid::TaskSpan> spans = rt.spans();
    const braid::TaskSpan* f = nullptr;
    const braid::TaskSpan* s = nullptr;
    for (const auto& sp : spans) {
      if (sp.name == "first") f = &sp;
      if (sp.name == "second") s = &sp;
    }
    CHECK(f != nullptr && s != nullptr);
    CHECK(f->end_ns <= s->start_ns);
  }
}

// Readers of one view run side by side; a later writer waits for all of them
// (write-after-read on every outstanding reader, not only the last).
void writer_waits_for_every_reader() {
  for (std::size_t streams = 1; streams <= 4; ++streams) {
    braid::Runtime rt = runtime(streams, braid::Policy::RoundRobin);
    braid::Buffer src = rt.alloc_from<int>("src", {5, 6, 7, 8});
    std::vector<braid::Buffer> dst;
    for (int r = 0; r < 3; ++r) {
      dst.push_back(rt.alloc("dst", 4 * sizeof(int)));
      braid::Buffer d = dst.back();
      rt.task("reader").run(braid::read<int>(src), braid::write<int>(d), [r](braid::Span<const int> in, braid::Span<int> out) {
        std::this_thread::sleep_for(std::chrono::milliseconds(5 * (3 - r)));
        for (std::size_t i = 0; i < in.size(); ++i) out[i] = in[i];
      });
    }
    rt.task("writer").run(braid::write<int>(src), [](braid::Span<int> out) {
      for (int& x : out) x = -1;
    });
    for (const auto& d : dst) CHECK(rt.read_vec<int>(d) == std::vector<int>({5, 6, 7, 8}));
    CHECK(rt.read_vec<int>(src) == std::vector<int>({-1, -1, -1, -1}));
  }
}

}  // namespace

// Short tasks may run on the submitting thread (inline_short_tasks, on by
// default) with the sequential result; switched off, every body runs on a
// stream thread.
void inline_short_tasks_switch() {
  for (bool inline_on : {true, false}) {
    braid::Runtime rt = braid::Runtime::builder()
                            .backend(braid::BackendKind::Cpu)
                            .compute_streams(2)
                            .inline_short_tasks(inline_on)
                            .build();
    braid::Buffer x = rt.alloc_from("x", std::vector<std::uint32_t>{0});
    std::atomic<int> here{0};
    const std::thread::id me = std::this_thread::get_id();
    for (std::uint32_t i = 0; i < 500; ++i) {
      if (i % 100 == 0) rt.synchronize();
      rt.task("tick").run(braid::read_write<std::uint32_t>(x), [i, me, &here](braid::Span<std::uint32_t> v) {
        if (v[0] == i) v[0] += 1;
        if (std::this_thread::get_id() == me) here.fetch_add(1);
      });
    }
    CHECK(rt.read_vec<std::uint32_t>(x) == std::vector<std::uint32_t>{500});
    if (!inline_on) CHECK(here.load() == 0);
  }
}

int main() {
  check::Runner t;
  t.run("chain_matches_sequential", chain);
  t.run("diamond_matches_sequential", diamond);
  t.run("disjoint_views_are_independent", disjoint_views_are_independent);
  t.run("overlapping_views_are_ordered", overlapping_views_are_ordered);
  t.run("writer_waits_for_every_reader", writer_waits_for_every_reader);
  t.run("inline_short_tasks_switch", inline_short_tasks_switch);
  return t.finish();
}

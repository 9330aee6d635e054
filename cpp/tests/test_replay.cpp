// Record once, replay, through the C++ API: replays interleaved with eager
// tasks give exactly (bit for bit) the sequential result on 1..3 streams under
// every policy, with and without graphs (cut around a host task); a task
// failing inside a replay names itself and leaves the
// runtime usable; a throwing recording program is an error; a schedule may
// outlive the Runtime object it was recorded on.
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "check.hpp"

namespace {

constexpr braid::Policy kPolicies[] = {braid::Policy::Single, braid::Policy::RoundRobin,
                                       braid::Policy::Affinity};

braid::Runtime runtime(std::size_t streams, braid::Policy policy, bool graphs = false) {
  return braid::Runtime::builder()
      .backend(braid::BackendKind::Cpu)
      .compute_streams(streams)
      .policy(policy)
      .graphs(graphs)
      .build();
}

bool bit_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// One step over x, y, z: y <- 2x + y; z <- z * y - x; x <- x + 0.5 * z (a
// diamond whose order shows in the bits). `k` comes from a buffer, as values
// that change between replays must.
void scale(braid::Span<const float> k, braid::Span<const float> x, braid::Span<float> y) {
  for (std::size_t i = 0; i < y.size(); ++i) y[i] = 2.0f * x[i] + y[i] * k[0];
}
void mix(braid::Span<const float> x, braid::Span<const float> y, braid::Span<float> z) {
  for (std::size_t i = 0; i < z.size(); ++i) z[i] = z[i] * y[i] - x[i];
}
void close(braid::Span<const float> z, braid::Span<float> x) {
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = x[i] + 0.5f * z[i];
}
// An eager task between steps: x <- x / 2.
void halve(braid::Span<float> x) {
  for (float& v : x) v *= 0.5f;
}

void replays_match_sequential() {
  constexpr std::size_t n = 257, steps = 6;
  std::vector<float> x0(n), y0(n), z0(n);
  for (std::size_t i = 0; i < n; ++i) {
    x0[i] = 0.01f * static_cast<float>(i);
    y0[i] = 1.0f - 0.002f * static_cast<float>(i);
    z0[i] = 0.5f;
  }
  std::vector<float> x = x0, y = y0, z = z0;
  for (std::size_t s = 0; s < steps; ++s) {
    const float k = 1.0f / static_cast<float>(s + 2);
    const braid::Span<const float> cx(x.data(), n), cy(y.data(), n), cz(z.data(), n);
    scale(braid::Span<const float>(&k, 1), cx, braid::Span<float>(y.data(), n));
    mix(cx, cy, braid::Span<float>(z.data(), n));
    close(cz, braid::Span<float>(x.data(), n));
    halve(braid::Span<float>(x.data(), n));
  }
  for (std::size_t streams = 1; streams <= 3; ++streams) {
    for (braid::Policy policy : kPolicies) {
      for (bool graphs : {false, true}) {
        braid::Runtime rt = runtime(streams, policy, graphs);
        braid::Buffer bx = rt.alloc_from("x", x0), by = rt.alloc_from("y", y0), bz = rt.alloc_from("z", z0);
        braid::Buffer bk = rt.alloc("k", sizeof(float));
        auto step = [&](const braid::Runtime& r) {
          r.task("scale").run(braid::read<float>(bk), braid::read<float>(bx), braid::read_write<float>(by), scale);
          // A host task: with graphs, the step is cut around it.
          r.task("mix").kind(braid::TaskKind::Host).run(braid::read<float>(bx), braid::read<float>(by),
                                                        braid::read_write<float>(bz), mix);
          r.task("close").run(braid::read<float>(bz), braid::read_write<float>(bx), close);
        };
        // Step 0 is the recording; the others replay it, each after an eager
        // task and with its own k.
        const float k0 = 0.5f;
        rt.upload(bk, &k0, 1);
        braid::Schedule sched = rt.record("step", step);
        CHECK(sched.size() == 3);
        CHECK(sched.name() == "step");
        rt.task("halve").run(braid::read_write<float>(bx), halve);
        for (std::size_t s = 1; s < steps; ++s) {
          const float k = 1.0f / static_cast<float>(s + 2);
          rt.upload(bk, &k, 1);
          sched.replay();
          rt.task("halve").run(braid::read_write<float>(bx), halve);
        }
        CHECK(bit_equal(rt.read_vec<float>(bx), x));
        CHECK(bit_equal(rt.read_vec<float>(by), y));
        CHECK(bit_equal(rt.read_vec<float>(bz), z));
        CHECK(sched.graph_refusal().empty());
        CHECK(sched.graphs_per_replay() == (graphs ? 2u : 0u));
        CHECK(sched.tasks_between_graphs() == (graphs ? 1u : 0u));
        // The CPU's replays are per-stream programs: no placement trial.
        CHECK(!sched.placement_trial().decided);
        rt.synchronize();
      }
    }
  }
}

void failure_inside_a_replay_names_the_task() {
  braid::Runtime rt = runtime(2, braid::Policy::Affinity);
  braid::Buffer flag = rt.alloc("flag", sizeof(int));
  braid::Buffer out = rt.alloc("out", sizeof(int));
  auto sched = rt.record("step", [&](const braid::Runtime& r) {
    r.task("maybe fail").run(braid::read<int>(flag), braid::write<int>(out), [](braid::Span<const int> f, braid::Span<int> o) {
      if (f[0] != 0) throw std::runtime_error("flag was set");
      o[0] = 7;
    });
  });
  const int one = 1, zero = 0;
  rt.upload(flag, &one, 1);
  bool threw = false;
  try {
    sched.replay().wait();
  } catch (const braid::Error& e) {
    threw = std::string(e.what()).find("maybe fail") != std::string::npos;
  }
  CHECK(threw);
  // The join's wait named the task; the task's own error is reported once,
  // at the next synchronisation point, like any task's.
  bool reported = false;
  try {
    rt.synchronize();
  } catch (const braid::Error& e) {
    reported = std::string(e.what()).find("flag was set") != std::string::npos;
  }
  CHECK(reported);
  rt.synchronize();  // and only once
  rt.upload(flag, &zero, 1);
  sched.replay().wait();
  CHECK(rt.read_vec<int>(out) == std::vector<int>{7});
}

void a_throwing_program_is_an_error() {
  braid::Runtime rt = runtime(2, braid::Policy::Affinity);
  bool threw = false;
  try {
    rt.record("broken", [](const braid::Runtime&) { throw std::runtime_error("no tasks today"); });
  } catch (const braid::Error& e) {
    threw = std::string(e.what()).find("no tasks today") != std::string::npos;
  }
  CHECK(threw);
  // The runtime records again afterwards.
  braid::Buffer b = rt.alloc("b", sizeof(int));
  auto sched = rt.record("ok", [&](const braid::Runtime& r) {
    r.task("inc").run(braid::read_write<int>(b), [](braid::Span<int> v) { v[0] += 1; });
  });
  sched.replay();
  sched.replay();
  CHECK(rt.read_vec<int>(b) == std::vector<int>{3});
}

void a_schedule_outlives_its_runtime_object() {
  std::optional<braid::Schedule> sched;
  std::vector<int> seen;
  {
    braid::Runtime rt = runtime(2, braid::Policy::Affinity);
    braid::Buffer b = rt.alloc("b", sizeof(int));
    sched.emplace(rt.record("count", [&](const braid::Runtime& r) {
      r.task("inc").run(braid::read_write<int>(b), [&seen](braid::Span<int> v) {
        v[0] += 1;
        seen.push_back(v[0]);
      });
    }));
  }
  sched->replay().wait();
  sched->replay().wait();
  sched.reset();
  CHECK(seen == (std::vector<int>{1, 2, 3}));
}

}  // namespace

int main() {
  check::Runner t;
  t.run("replays_match_sequential", replays_match_sequential);
  t.run("failure_inside_a_replay_names_the_task", failure_inside_a_replay_names_the_task);
  t.run("a_throwing_program_is_an_error", a_throwing_program_is_an_error);
  t.run("a_schedule_outlives_its_runtime_object", a_schedule_outlives_its_runtime_object);
  return t.finish();
}

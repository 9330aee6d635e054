// Named scopes and placement files through the C++ API: scopes nest and tag
// every task (spans and the Chrome trace); a placement file given to the
// builder moves a scope's tasks without changing the results (bit for bit
// the sequential ones on 1..3 streams under every policy); a bad file makes
// build() throw naming its line.
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "check.hpp"

namespace {

constexpr braid::Policy kPolicies[] = {braid::Policy::Single, braid::Policy::RoundRobin,
                                       braid::Policy::Affinity};

void write_file(const std::string& path, const std::string& text) {
  std::ofstream f(path);
  f << text;
  CHECK(f.good());
}

std::string read_file(const std::string& path) {
  std::ifstream f(path);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

const braid::TaskSpan& span_named(const std::vector<braid::TaskSpan>& spans, const std::string& name) {
  for (const auto& s : spans)
    if (s.name == name) return s;
  ::check::fail(__FILE__, __LINE__, "no span named " + name);
}

void scopes_nest_and_tag_tasks() {
  auto rt = braid::Runtime::builder().backend(braid::BackendKind::Cpu).profile(true).build();
  braid::Buffer x = rt.alloc("x", 16);
  rt.task("outside").run(braid::write<int>(x), [](braid::Span<int>) {});
  {
    braid::Scope fwd = rt.scope("forward");
    CHECK_EQ(fwd.path(), std::string("forward"));
    {
      braid::Scope layer = rt.scope("layer0");
      CHECK_EQ(layer.path(), std::string("forward/layer0"));
      CHECK_EQ(rt.current_scope(), std::string("forward/layer0"));
      rt.task("inner").run(braid::read_write<int>(x), [](braid::Span<int>) {});
    }
    rt.task("after").run(braid::read_write<int>(x), [](braid::Span<int>) {});
  }
  CHECK_EQ(rt.current_scope(), std::string());
  rt.synchronize();
  auto spans = rt.spans();
  CHECK_EQ(span_named(spans, "outside").scope, std::string());
  CHECK_EQ(span_named(spans, "inner").scope, std::string("forward/layer0"));
  CHECK_EQ(span_named(spans, "after").scope, std::string("forward"));
  rt.write_trace("scope-trace.json");
  std::string trace = read_file("scope-trace.json");
  CHECK_CONTAINS(trace, "\"scope\":\"forward/layer0\"");
  CHECK_CONTAINS(trace, "\"scope\":\"forward\"");
}

// x <- f(x, y) and y <- g(y, x), alternating in two scopes the file pins
// to different streams: an order that shows in the bits.
std::vector<float> run_steps(const braid::Runtime& rt) {
  constexpr std::size_t n = 129;
  std::vector<float> x0(n), y0(n);
  for (std::size_t i = 0; i < n; ++i) {
    x0[i] = 0.25f * static_cast<float>(i);
    y0[i] = 1.0f / static_cast<float>(i + 1);
  }
  braid::Buffer x = rt.alloc_from<float>("x", x0);
  braid::Buffer y = rt.alloc_from<float>("y", y0);
  for (int s = 0; s < 6; ++s) {
    {
      braid::Scope a = rt.scope("a");
      rt.task("fx").run(braid::read_write<float>(x), braid::read<float>(y),
                        [](braid::Span<float> x, braid::Span<const float> y) {
                          for (std::size_t i = 0; i < x.size(); ++i) x[i] = x[i] * 0.5f + y[i];
                        });
    }
    braid::Scope b = rt.scope("b");
    braid::Scope inner = rt.scope("inner");
    rt.task("gy").run(braid::read_write<float>(y), braid::read<float>(x),
                      [](braid::Span<float> y, braid::Span<const float> x) {
                        for (std::size_t i = 0; i < y.size(); ++i) y[i] = y[i] - x[i] * 0.125f;
                      });
  }
  std::vector<float> out = rt.read_vec<float>(x);
  std::vector<float> yv = rt.read_vec<float>(y);
  out.insert(out.end(), yv.begin(), yv.end());
  rt.synchronize();
  return out;
}

void a_placement_file_moves_tasks_not_results() {
  write_file("scope-placement.toml",
             "[[scope]]\npattern = \"a\"\nstream = \"comm\"\n"
             "[[scope]]\npattern = \"b/**\"\nbundle = true\npriority = \"side\"\n");
  auto plain = braid::Runtime::builder().backend(braid::BackendKind::Cpu).compute_streams(1).policy(braid::Policy::Single).build();
  const std::vector<float> expected = run_steps(plain);
  for (std::size_t streams = 1; streams <= 3; ++streams) {
    for (braid::Policy policy : kPolicies) {
      auto rt = braid::Runtime::builder()
                    .backend(braid::BackendKind::Cpu)
                    .compute_streams(streams)
                    .policy(policy)
                    .profile(true)
                    .placement_file("scope-placement.toml")
                    .build();
      const std::vector<float> got = run_steps(rt);
      CHECK(got.size() == expected.size() &&
            std::memcmp(got.data(), expected.data(), got.size() * sizeof(float)) == 0);
      // Scope `a` runs on the communication stream (index `streams`).
      for (const auto& s : rt.spans())
        if (s.name == "fx") CHECK_EQ(s.stream, streams);
    }
  }
}

void a_bad_file_fails_the_build_naming_the_line() {
  write_file("scope-bad.toml", "[[scope]]\npattern = \"a\"\nstream = 5\n");
  std::string msg = ERROR_OF(braid::Runtime::builder()
                                 .backend(braid::BackendKind::Cpu)
                                 .placement_file("scope-bad.toml")
                                 .build());
  CHECK_CONTAINS(msg, "scope-bad.toml");
  CHECK_CONTAINS(msg, "line 3");
  CHECK_CONTAINS(msg, "stream 5");
  write_file("scope-typo.toml", "[[scope]]\npattern = \"a\"\nbundel = true\n");
  msg = ERROR_OF(braid::Runtime::builder()
                     .backend(braid::BackendKind::Cpu)
                     .placement_file("scope-typo.toml")
                     .build());
  CHECK_CONTAINS(msg, "line 3");
  CHECK_CONTAINS(msg, "bundel");
}

void the_file_sets_the_priority_class() {
  write_file("scope-class.toml", "[runtime]\nclass = \"best-effort\"\n");
  auto rt = braid::Runtime::builder()
                .backend(braid::BackendKind::Cpu)
                .placement_file("scope-class.toml")
                .build();
  CHECK(rt.priority_class() == braid::Class::BestEffort);
  // A class set in code wins over the file's.
  auto serving = braid::Runtime::builder()
                     .backend(braid::BackendKind::Cpu)
                     .priority_class(braid::Class::LatencyCritical)
                     .placement_file("scope-class.toml")
                     .build();
  CHECK(serving.priority_class() == braid::Class::LatencyCritical);
  auto plain = braid::Runtime::builder().backend(braid::BackendKind::Cpu).build();
  CHECK(plain.priority_class() == braid::Class::Normal);
  write_file("scope-realtime.toml", "[runtime]\n\nrealtime = true\n");
  std::string msg = ERROR_OF(braid::Runtime::builder()
                                 .backend(braid::BackendKind::Cpu)
                                 .placement_file("scope-realtime.toml")
                                 .build());
  CHECK_CONTAINS(msg, "scope-realtime.toml");
  CHECK_CONTAINS(msg, "line 3");
  CHECK_CONTAINS(msg, "latency-critical");
  // Sparing SMs is a CUDA setting: the CPU accepts it and spares none.
  write_file("scope-spare.toml", "[runtime]\nclass = \"best-effort\"\nspare_sms = 8\n");
  auto spare = braid::Runtime::builder()
                   .backend(braid::BackendKind::Cpu)
                   .spare_sms(16)
                   .placement_file("scope-spare.toml")
                   .build();
  CHECK(spare.spared_sms() == 0);
  write_file("scope-spare-bad.toml", "[runtime]\nspare_sms = -8\n");
  msg = ERROR_OF(braid::Runtime::builder()
                     .backend(braid::BackendKind::Cpu)
                     .placement_file("scope-spare-bad.toml")
                     .build());
  CHECK_CONTAINS(msg, "line 2");
  CHECK_CONTAINS(msg, "runtime.spare_sms");
}

}  // namespace

int main() {
  check::Runner t;
  t.run("scopes_nest_and_tag_tasks", scopes_nest_and_tag_tasks);
  t.run("a_placement_file_moves_tasks_not_results", a_placement_file_moves_tasks_not_results);
  t.run("a_bad_file_fails_the_build_naming_the_line", a_bad_file_fails_the_build_naming_the_line);
  t.run("the_file_sets_the_priority_class", the_file_sets_the_priority_class);
  return t.finish();
}

// Overlap as the profile and the trace show it: two independent long tasks on
// two streams are busy at the same time (asserted from the recorded spans and
// the summary, never from timings of the test itself); the single policy never
// overlaps; the Chrome trace names the streams and the tasks.
#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

#include "check.hpp"

namespace {

void sleep_ms(int ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); }

void independent_tasks_overlap() {
  braid::Runtime rt = braid::Runtime::builder()
                          .backend(braid::BackendKind::Cpu)
                          .compute_streams(2)
                          .policy(braid::Policy::Affinity)
                          .profile(true)
                          .build();
  braid::Buffer a = rt.alloc("a", 4), b = rt.alloc("b", 4);
  for (const braid::Buffer& buf : {a, b}) {
    rt.task("long").run(braid::write(buf), [](auto) { sleep_ms(150); });
  }
  rt.synchronize();
  std::vector<braid::TaskSpan> spans = rt.spans();
  std::vector<braid::TaskSpan> longs;
  for (const auto& s : spans)
    if (s.name == "long") longs.push_back(s);
  CHECK_EQ(longs.size(), static_cast<std::size_t>(2));
  CHECK(longs[0].stream != longs[1].stream);
  CHECK(longs[0].start_ns < longs[1].end_ns && longs[1].start_ns < longs[0].end_ns);
  braid::Summary s = rt.summary();
  CHECK(s.overlap_ns > 0);
  CHECK_EQ(s.busy_streams(), static_cast<std::size_t>(2));
  const std::uint64_t sum = (longs[0].end_ns - longs[0].start_ns) + (longs[1].end_ns - longs[1].start_ns);
  CHECK(s.wall_ns < sum);
  CHECK_CONTAINS(s.text, "2+ streams busy");
  std::ostringstream os;
  os << s;
  CHECK_EQ(os.str().size(), s.text.size());
}

void single_policy_never_overlaps() {
  braid::Runtime rt = braid::Runtime::builder()
                          .backend(braid::BackendKind::Cpu)
                          .compute_streams(4)
                          .policy(braid::Policy::Single)
                          .profile(true)
                          .build();
  std::vector<braid::Buffer> bufs;
  for (int i = 0; i < 4; ++i) {
    bufs.push_back(rt.alloc("b" + std::to_string(i), 4));
    rt.task("t").run(braid::write(bufs.back()), [](auto) { sleep_ms(5); });
  }
  rt.synchronize();
  braid::Summary s = rt.summary();
  CHECK_EQ(s.overlap_ns, static_cast<std::uint64_t>(0));
  CHECK_EQ(s.streams[0].tasks, static_cast<std::size_t>(4));
  CHECK_EQ(s.tasks, static_cast<std::size_t>(4));
}

// Communication under computation: a comm task runs on the comm stream while a
// compute task runs; the summary counts the comm time as hidden.
void comm_hidden_under_compute() {
  braid::Runtime rt = braid::Runtime::builder()
                          .backend(braid::BackendKind::Cpu)
                          .compute_streams(1)
                          .comm_streams(1)
                          .profile(true)
                          .build();
  braid::Buffer grads = rt.alloc("grads", 64), acts = rt.alloc("acts", 64);
  braid::TaskHandle c = rt.task("allreduce").kind(braid::TaskKind::Comm).run(braid::read_write(grads), [](auto) {
    sleep_ms(80);
  });
  rt.task("backward").run(braid::read_write(acts), [](auto) { sleep_ms(120); });
  rt.synchronize();
  CHECK_EQ(c.stream(), static_cast<std::size_t>(1));
  braid::Summary s = rt.summary();
  CHECK(s.comm_ns > 0);
  CHECK(s.comm_hidden_ns > 0);
  CHECK(s.hidden_share() > 0.0 && s.hidden_share() <= 1.0);
  // A comm task that is not a collective waits for no rank: all of it is
  // transfer.
  CHECK_EQ(s.comm_wait_ns, static_cast<std::uint64_t>(0));
  CHECK_EQ(s.transfer_ns, s.comm_ns);
  CHECK_EQ(s.transfer_hidden_ns, s.comm_hidden_ns);
  CHECK_EQ(s.streams.size(), static_cast<std::size_t>(2));
  CHECK_EQ(s.streams[1].name, std::string("comm 0"));
}

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void trace_files_name_streams_and_tasks() {
  const std::string explicit_path = "braid-cpp-test-trace.json";
  const std::string on_drop_path = "braid-cpp-test-trace-drop.json";
  std::remove(explicit_path.c_str());
  std::remove(on_drop_path.c_str());
  {
    braid::Runtime rt = braid::Runtime::builder()
                            .backend(braid::BackendKind::Cpu)
                            .compute_streams(2)
                            .trace(on_drop_path)
                            .rank(3)
                            .build();
    braid::Buffer a = rt.alloc("a", 4);
    rt.task("traced-task").run(braid::write(a), [](auto) { sleep_ms(1); });
    rt.synchronize();
    rt.write_trace(explicit_path);
  }  // the runtime writes on_drop_path here
  for (const std::string& path : {explicit_path, on_drop_path}) {
    const std::string json = slurp(path);
    CHECK_MSG(!json.empty(), path);
    CHECK_CONTAINS(json, "traced-task");
    CHECK_CONTAINS(json, "compute 0");
    CHECK_CONTAINS(json, "comm 0");
  }
  // An unwritable path is an error, not a crash.
  braid::Runtime rt = braid::Runtime::builder().backend(braid::BackendKind::Cpu).profile(true).build();
  const std::string msg = ERROR_OF(rt.write_trace("/nonexistent-dir/for/sure/trace.json"));
  CHECK_CONTAINS(msg, "trace.json");
}

}  // namespace

// Automatic replay (on by default): repeated steps are placed from the
// memoised analysis (the trace says "memoised", stats() counts them), with
// the same result as with it switched off, where no task is.
void automatic_replay_switch() {
  for (bool on : {true, false}) {
    const std::string path = on ? "braid-cpp-test-auto-on.json" : "braid-cpp-test-auto-off.json";
    std::remove(path.c_str());
    braid::RuntimeBuilder b = braid::Runtime::builder().backend(braid::BackendKind::Cpu).compute_streams(2);
    if (!on) b.auto_replay(false);
    braid::Runtime rt = b.profile().build();
    braid::Buffer x = rt.alloc_from("x", std::vector<std::uint64_t>{1});
    braid::Buffer y = rt.alloc_from("y", std::vector<std::uint64_t>{0});
    for (std::uint64_t step = 0; step < 8; ++step) {
      rt.task("scale").run(braid::read_write<std::uint64_t>(x), [step](braid::Span<std::uint64_t> v) { v[0] = v[0] * 3 + step; });
      rt.task("sum").run(braid::read<std::uint64_t>(x), braid::read_write<std::uint64_t>(y),
                         [](braid::Span<const std::uint64_t> a, braid::Span<std::uint64_t> b) { b[0] += a[0]; });
      rt.synchronize();
    }
    std::uint64_t xs = 1, ys = 0;
    for (std::uint64_t step = 0; step < 8; ++step) {
      xs = xs * 3 + step;
      ys += xs;
    }
    CHECK(rt.read_vec<std::uint64_t>(x) == std::vector<std::uint64_t>{xs});
    CHECK(rt.read_vec<std::uint64_t>(y) == std::vector<std::uint64_t>{ys});
    rt.write_trace(path);
    const bool memoised = slurp(path).find("\"memoised\"") != std::string::npos;
    CHECK_MSG(memoised == on, path);
    // Steps 3 and 4 equal the one before them, step 5 is recorded, steps 6
    // to 8 are memoised: two tasks each.
    const braid::Stats s = rt.stats();
    // Sixteen, the two uploads and the two reads.
    CHECK_EQ(s.tasks, static_cast<std::uint64_t>(16 + 2 + 2));
    CHECK_EQ(s.auto_replayed, static_cast<std::uint64_t>(on ? 6 : 0));
    // The reads after the loop leave the memoised step: one divergence.
    CHECK_EQ(s.auto_divergences, static_cast<std::uint64_t>(on ? 1 : 0));
  }
}

int main() {
  check::Runner t;
  t.run("independent_tasks_overlap", independent_tasks_overlap);
  t.run("single_policy_never_overlaps", single_policy_never_overlaps);
  t.run("comm_hidden_under_compute", comm_hidden_under_compute);
  t.run("trace_files_name_streams_and_tasks", trace_files_name_streams_and_tasks);
  t.run("automatic_replay_switch", automatic_replay_switch);
  return t.finish();
}

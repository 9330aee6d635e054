// Lifetimes and threads through the C++ API: a task builder outliving its
// runtime, a failure nobody reported when the runtime is destroyed, handles
// used after a move, a runtime destroyed while a schedule still holds its
// engine, builders chained into variables, which thread runs a body (short
// tasks run inside run()), the CPU core budget. Nothing here may crash, hang
// or leak (the sanitizer build runs it); the use-after-free cases are what
// ASan would catch if a handle stopped owning what it uses.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <unistd.h>

#include "check.hpp"

namespace {

braid::Runtime cpu(std::size_t streams = 2) {
  return braid::Runtime::builder().backend(braid::BackendKind::Cpu).compute_streams(streams).build();
}

bool exists(const std::string& path) { return std::ifstream(path).good(); }

// What `f` writes to stderr (file descriptor 2, where the bridge prints).
template <class F>
std::string stderr_of(F&& f) {
  char path[] = "/tmp/braid-stderr-XXXXXX";
  const int fd = mkstemp(path);
  CHECK(fd >= 0);
  std::fflush(stderr);
  const int saved = dup(2);
  dup2(fd, 2);
  f();
  std::fflush(stderr);
  dup2(saved, 2);
  close(saved);
  close(fd);
  std::ifstream in(path);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::remove(path);
  return text;
}

// The builder holds the engine: run() after the Runtime is gone submits and
// (as the engine's last holder) waits for the task, instead of using a freed
// runtime.
void builder_outlives_its_runtime() {
  std::optional<braid::Runtime> rt = cpu();
  braid::Buffer b = rt->alloc("b", 16);
  braid::TaskBuilder tb = rt->task("late");
  rt.reset();
  std::atomic<bool> ran{false};
  braid::TaskHandle h = tb.run(braid::write<float>(b), [&ran](braid::Span<float> s) {
    s[0] = 1;
    ran = true;
  });
  CHECK(ran.load());
  CHECK(h.done());
  h.wait();
  // An unsubmitted builder that goes last takes the engine with it.
  {
    std::optional<braid::Runtime> rt2 = cpu();
    braid::TaskBuilder idle = rt2->task("never");
    rt2.reset();
  }
}

// A failure no synchronize() or wait() reported is printed when the runtime
// is destroyed (C++ programs have no tracing subscriber to see the engine's
// warning); a reported one is not printed again.
void unreported_failure_is_printed_at_destruction() {
  std::string text = stderr_of([] {
    braid::Runtime rt = cpu();
    braid::Buffer b = rt.alloc("b", 16);
    rt.task("fails").run(braid::write<float>(b), [](auto) { throw std::runtime_error("disk full"); });
  });
  CHECK_CONTAINS(text, "unreported task error");
  CHECK_CONTAINS(text, "task `fails` failed: disk full");
  CHECK_EQ(std::count(text.begin(), text.end(), '\n'), 1);

  text = stderr_of([] {
    braid::Runtime rt = cpu();
    braid::Buffer b = rt.alloc("b", 16);
    rt.task("fails").run(braid::write<float>(b), [](auto) { throw std::runtime_error("disk full"); });
    CHECK_CONTAINS(ERROR_OF(rt.synchronize()), "disk full");
  });
  CHECK_EQ(text, std::string());

  // Also when a schedule still holds the engine.
  std::optional<braid::Schedule> step;
  text = stderr_of([&step] {
    braid::Runtime rt = cpu();
    braid::Buffer b = rt.alloc("b", 16);
    step.emplace(rt.record("step", [&b](const braid::Runtime& r) {
      r.task("inc").run(braid::read_write<float>(b), [](braid::Span<float> s) { s[0] += 1; });
    }));
    rt.task("fails").run(braid::write<float>(b), [](auto) { throw std::runtime_error("disk full"); });
  });
  CHECK_CONTAINS(text, "task `fails` failed: disk full");
  step.reset();
}

// ~Runtime waits for its tasks even while a schedule holds the engine; the
// engine's threads (and the trace) stay until the schedule goes.
void runtime_destroyed_while_a_schedule_lives() {
  const std::string trace = "lifetimes-schedule-trace.json";
  std::remove(trace.c_str());
  std::optional<braid::Schedule> step;
  std::atomic<bool> slow_done{false};
  {
    braid::Runtime rt = braid::Runtime::builder().backend(braid::BackendKind::Cpu).trace(trace).build();
    braid::Buffer b = rt.alloc("b", 16);
    step.emplace(rt.record("step", [&b](const braid::Runtime& r) {
      r.task("inc").run(braid::read_write<float>(b), [](braid::Span<float> s) { s[0] += 1; });
    }));
    rt.task("slow").run(braid::read_write<float>(b), [&slow_done](auto) {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      slow_done = true;
    });
  }
  CHECK(slow_done.load());
  CHECK(!exists(trace));
  step->replay().wait();
  step.reset();
  CHECK(exists(trace));
  std::remove(trace.c_str());
}

// Moving a handle copies it; a moved-from Runtime, Schedule, Scope or
// TaskBuilder throws instead of crashing.
void moved_from_handles() {
  braid::Runtime rt = cpu();
  braid::Buffer a = rt.alloc("a", 16);
  braid::Buffer b = std::move(a);
  CHECK_EQ(a.size(), static_cast<std::size_t>(16));  // NOLINT(bugprone-use-after-move)
  braid::Buffer c = a;                                 // NOLINT(bugprone-use-after-move)
  CHECK_EQ(c.name(), std::string("a"));
  braid::View v = b.view(0, 8);
  braid::View w = std::move(v);
  CHECK_EQ(v.size(), static_cast<std::size_t>(8));  // NOLINT(bugprone-use-after-move)
  braid::TaskHandle h = rt.task("t").run(braid::read_write<float>(w), [](auto) {});
  braid::TaskHandle h2 = std::move(h);
  h.wait();  // NOLINT(bugprone-use-after-move)
  h2.wait();
  braid::Profile p = rt.profile();
  braid::Profile p2 = std::move(p);
  (void)p.rank();  // NOLINT(bugprone-use-after-move)

  braid::TaskBuilder tb = rt.task("moved");
  braid::TaskBuilder tb2 = std::move(tb);
  CHECK_CONTAINS(ERROR_OF(tb.run(braid::write<float>(b), [](auto) {})), "moved from");  // NOLINT
  tb2.run(braid::read_write<float>(b), [](auto) {});

  {
    braid::Scope s = rt.scope("outer");
    braid::Scope s2 = std::move(s);
    CHECK_CONTAINS(ERROR_OF(s.path()), "moved-from Scope");  // NOLINT(bugprone-use-after-move)
    CHECK_EQ(s2.path(), std::string("outer"));
    CHECK_EQ(rt.current_scope(), std::string("outer"));
  }
  CHECK_EQ(rt.current_scope(), std::string());

  braid::Schedule sched = rt.record("step", [&b](const braid::Runtime& r) {
    r.task("inc").run(braid::read_write<float>(b), [](braid::Span<float> s) { s[0] += 1; });
  });
  braid::Schedule sched2 = std::move(sched);
  CHECK_CONTAINS(ERROR_OF(sched.replay()), "moved-from Schedule");  // NOLINT(bugprone-use-after-move)
  CHECK_CONTAINS(ERROR_OF(sched.size()), "moved-from Schedule");
  sched2.replay().wait();

  braid::Runtime rt2 = std::move(rt);
  CHECK_CONTAINS(ERROR_OF(rt.synchronize()), "moved-from Runtime");  // NOLINT(bugprone-use-after-move)
  CHECK_CONTAINS(ERROR_OF(rt.task("t")), "moved-from Runtime");
  CHECK_CONTAINS(ERROR_OF(rt.streams()), "moved-from Runtime");
  CHECK_CONTAINS(ERROR_OF(rt.alloc("x", 4)), "moved-from Runtime");
  CHECK_CONTAINS(ERROR_OF(rt.stats()), "moved-from Runtime");
  const std::vector<float> got = rt2.read_vec<float>(b);
  CHECK_EQ(got[0], 2.0f);  // the recording and the replay
  rt2.synchronize();
}

// The setters keep a temporary builder a temporary: it can be moved into a
// variable (or bound to auto&&, which extends its life) and run later.
void builders_chained_into_variables() {
  braid::Runtime rt = cpu();
  braid::Buffer b = rt.alloc("b", 16);
  auto tb = rt.task("first").priority(braid::Priority::Side).kind(braid::TaskKind::Compute);
  tb.on_stream(1).priority(braid::Priority::Main);
  braid::TaskHandle h = tb.run(braid::write<float>(b), [](braid::Span<float> s) { s[0] = 1; });
  CHECK_EQ(h.stream(), static_cast<std::size_t>(1));
  auto&& tb2 = rt.task("second").on_stream(0);
  h = tb2.run(braid::read_write<float>(b), [](braid::Span<float> s) { s[0] += 1; });
  CHECK_EQ(h.stream(), static_cast<std::size_t>(0));
  const std::vector<float> got = rt.read_vec<float>(b);
  CHECK_EQ(got[0], 2.0f);
  rt.synchronize();
}

// Which thread runs a body: with inline_short_tasks (the default) exactly the
// tasks stats() counts as inline run on the submitting thread, inside run();
// without it none does.
void short_tasks_may_run_inside_run() {
  for (bool inline_on : {true, false}) {
    braid::Runtime rt =
        braid::Runtime::builder().backend(braid::BackendKind::Cpu).inline_short_tasks(inline_on).build();
    braid::Buffer b = rt.alloc("counter", 8);
    const std::thread::id me = std::this_thread::get_id();
    std::atomic<int> on_submitter{0};
    for (int i = 0; i < 200; ++i) {
      int before = on_submitter.load();
      rt.task("tick").run(braid::read_write<std::uint64_t>(b), [&](braid::Span<std::uint64_t> c) {
        if (std::this_thread::get_id() == me) on_submitter.fetch_add(1);
        ++c[0];
      });
      // Inline means before run() returned.
      CHECK(on_submitter.load() == before || on_submitter.load() == before + 1);
      rt.synchronize();
    }
    const std::vector<std::uint64_t> count = rt.read_vec<std::uint64_t>(b);
    CHECK_EQ(count[0], static_cast<std::uint64_t>(200));
    CHECK_EQ(static_cast<std::uint64_t>(on_submitter.load()), rt.stats().inline_tasks);
    if (!inline_on) CHECK_EQ(on_submitter.load(), 0);
    std::printf("(%d of 200 ran inline with inline_short_tasks(%s)) ", on_submitter.load(),
                inline_on ? "true" : "false");
  }
}

// The core budget caps the compute streams affinity placement uses.
std::size_t streams_used(braid::RuntimeBuilder builder) {
  braid::Runtime rt = builder.backend(braid::BackendKind::Cpu).compute_streams(2).profile(true).build();
  std::vector<braid::Buffer> bufs;
  for (int i = 0; i < 4; ++i) bufs.push_back(rt.alloc("b" + std::to_string(i), 16));
  for (const braid::Buffer& b : bufs) {
    rt.task("sleep").run(braid::write<float>(b), [](auto) { std::this_thread::sleep_for(std::chrono::milliseconds(20)); });
  }
  rt.synchronize();
  std::set<std::size_t> used;
  for (const braid::TaskSpan& s : rt.spans()) used.insert(s.stream);
  return used.size();
}

void cpu_core_budget() {
  CHECK_EQ(streams_used(braid::Runtime::builder().cpu_cores(1)), static_cast<std::size_t>(1));
  CHECK_EQ(streams_used(braid::Runtime::builder().cpu_cores(1).oversubscribe(true)), static_cast<std::size_t>(2));
  CHECK_EQ(streams_used(braid::Runtime::builder().cpu_cores(2)), static_cast<std::size_t>(2));
}

// An abort must not fail on its message: invalid UTF-8 is replaced.
void abort_with_invalid_utf8() {
  std::vector<braid::Communicator> comms = braid::local_group(1);
  comms[0].abort("bad \xff reason");
  CHECK_CONTAINS(comms[0].poisoned(), "bad ");
}

}  // namespace

int main() {
  check::Runner t;
  t.run("builder_outlives_its_runtime", builder_outlives_its_runtime);
  t.run("unreported_failure_is_printed_at_destruction", unreported_failure_is_printed_at_destruction);
  t.run("runtime_destroyed_while_a_schedule_lives", runtime_destroyed_while_a_schedule_lives);
  t.run("moved_from_handles", moved_from_handles);
  t.run("builders_chained_into_variables", builders_chained_into_variables);
  t.run("short_tasks_may_run_inside_run", short_tasks_may_run_inside_run);
  t.run("cpu_core_budget", cpu_core_budget);
  t.run("abort_with_invalid_utf8", abort_with_invalid_utf8);
  return t.finish();
}

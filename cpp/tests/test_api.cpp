// The C++ surface itself: handles, views, spans, upload / read-back, task
// handles, several submitting threads, the launch window, comm placement.
#include <atomic>
#include <chrono>
#include <stdexcept>
#include <string>
#include <cstdint>
#include <thread>
#include <vector>

#include "check.hpp"

namespace {

braid::Runtime cpu(std::size_t streams = 2) {
  return braid::Runtime::builder().backend(braid::BackendKind::Cpu).compute_streams(streams).build();
}

void runtime_properties() {
  braid::Runtime rt = braid::Runtime::builder()
                          .backend(braid::BackendKind::Cpu)
                          .compute_streams(3)
                          .comm_streams(2)
                          .rank(5)
                          .build();
  CHECK(rt.backend_name() == "cpu");
  CHECK_EQ(rt.streams(), static_cast<std::size_t>(5));
  CHECK_EQ(rt.compute_streams(), static_cast<std::size_t>(3));
  CHECK_EQ(rt.rank(), static_cast<std::size_t>(5));
  CHECK(!braid::version().empty());
  braid::Runtime moved = std::move(rt);
  CHECK_EQ(moved.streams(), static_cast<std::size_t>(5));
  braid::Runtime def = braid::Runtime::cpu();
  CHECK_EQ(def.streams(), static_cast<std::size_t>(3));
}

void buffers_and_views() {
  braid::Runtime rt = cpu();
  braid::Buffer b = rt.alloc("weights", 64);
  CHECK_EQ(b.size(), static_cast<std::size_t>(64));
  CHECK_EQ(b.count<float>(), static_cast<std::size_t>(16));
  CHECK(b.name() == "weights");
  braid::Buffer copy = b;  // shares the memory
  braid::View v = copy.view_of<float>(4, 12);
  CHECK_EQ(v.offset(), static_cast<std::size_t>(16));
  CHECK_EQ(v.size(), static_cast<std::size_t>(32));
  CHECK_EQ(v.count<float>(), static_cast<std::size_t>(8));
  braid::View sub = v.view_of<float>(2, 4);
  CHECK_EQ(sub.offset(), static_cast<std::size_t>(24));
  CHECK(sub.buffer().name() == "weights");
  braid::View whole = b;
  CHECK_EQ(whole.size(), b.size());
  braid::View assigned = sub;
  assigned = whole;
  CHECK_EQ(assigned.size(), static_cast<std::size_t>(64));
  CHECK(b.view(8, 8).empty());

  rt.upload(v, std::vector<float>{1, 2, 3, 4, 5, 6, 7, 8});
  std::vector<float> all = rt.read_vec<float>(b);
  CHECK_EQ(all.size(), static_cast<std::size_t>(16));
  for (std::size_t i = 0; i < 16; ++i) CHECK(all[i] == (i >= 4 && i < 12 ? static_cast<float>(i - 3) : 0.0f));
  CHECK(rt.read_vec<float>(sub) == std::vector<float>({3, 4}));
  braid::Buffer ints = rt.alloc_from<std::int64_t>("ints", {-1, 2, -3});
  CHECK(rt.read_vec<std::int64_t>(ints) == std::vector<std::int64_t>({-1, 2, -3}));
  braid::Buffer empty = rt.alloc("empty", 0);
  CHECK(rt.read_vec<float>(empty).empty());
  // Names need not be UTF-8 (replaced); paths must be (an error, not a crash).
  CHECK(rt.alloc("bad\xff name", 4).name() == "bad\xef\xbf\xbd name");
  rt.task("task \xfe").run([](braid::TaskContext&) {}).wait();
  const std::string msg = ERROR_OF(rt.write_trace("trace-\xff.json"));
  CHECK_CONTAINS(msg, "utf-8");
  CHECK_CONTAINS(ERROR_OF(braid::Runtime::builder().trace("t\xff.json")), "utf-8");
}

void spans_in_a_task() {
  braid::Runtime rt = cpu();
  braid::Buffer in = rt.alloc_from<float>("in", {1, 2, 3, 4});
  braid::Buffer out = rt.alloc("out", in.size());
  braid::TaskHandle h = rt.task("spans").read(in).write(out).run([in, out](braid::TaskContext& ctx) {
    braid::Span<const float> x = ctx.read<float>(in);
    braid::Span<float> y = ctx.write<float>(out);
    if (x.size() != 4 || y.size() != 4 || x.size_bytes() != 16) throw std::logic_error("sizes");
    braid::Span<const float> cy = y;  // Span<T> -> Span<const T>
    (void)cy;
    float acc = 0;
    for (float v : x) acc += v;
    for (std::size_t i = 0; i < y.size(); ++i) y[i] = x[i] * acc;
    y.subspan(1, 2)[0] += 1;
    bool threw = false;
    try {
      (void)x.at(4);
    } catch (const std::out_of_range&) {
      threw = true;
    }
    if (!threw) throw std::logic_error("Span::at did not check");
    if (ctx.name() != "spans") throw std::logic_error("name");
  });
  h.wait();
  CHECK(h.done());
  CHECK(h.name() == "spans");
  braid::TaskHandle h2 = h;
  h2.wait();
  CHECK(rt.read_vec<float>(out) == std::vector<float>({10, 21, 30, 40}));
}

void explicit_edges_and_pinning() {
  braid::Runtime rt = cpu(3);
  braid::Buffer a = rt.alloc("a", 4), b = rt.alloc("b", 4);
  std::atomic<int> order{0};
  std::atomic<int> second_saw{-1};
  braid::TaskHandle first = rt.task("first").write(a).on_stream(2).run([&order](braid::TaskContext& ctx) {
    if (ctx.stream_index() != 2) throw std::logic_error("not pinned");
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    order = 1;
  });
  // No data dependency on `first`: only the explicit edge orders them.
  rt.task("second").write(b).after(first).on_stream(0).run([&order, &second_saw](braid::TaskContext&) {
    second_saw = order.load();
  });
  rt.synchronize();
  CHECK_EQ(first.stream(), static_cast<std::size_t>(2));
  CHECK_EQ(second_saw.load(), 1);
}

void comm_tasks_go_to_comm_streams() {
  braid::Runtime rt = braid::Runtime::builder()
                          .backend(braid::BackendKind::Cpu)
                          .compute_streams(2)
                          .comm_streams(2)
                          .build();
  braid::Buffer g = rt.alloc("g", 8);
  braid::TaskHandle c0 = rt.task("c0").kind(braid::TaskKind::Comm).read_write(g.view(0, 4)).run([](braid::TaskContext&) {});
  braid::TaskHandle c1 =
      rt.task("c1").kind(braid::TaskKind::Comm).comm_stream(1).read_write(g.view(4, 8)).run([](braid::TaskContext&) {});
  braid::TaskHandle side = rt.task("side").priority(braid::Priority::Side).read(g).run([](braid::TaskContext&) {});
  rt.synchronize();
  CHECK_EQ(c0.stream(), static_cast<std::size_t>(2));
  CHECK_EQ(c1.stream(), static_cast<std::size_t>(3));
  CHECK(side.stream() < 2);
}

void many_submitting_threads() {
  braid::Runtime rt = cpu(4);
  braid::Buffer counters = rt.alloc("counters", 8 * sizeof(std::uint64_t));
  std::vector<std::thread> threads;
  for (std::size_t t = 0; t < 8; ++t) {
    threads.emplace_back([&rt, counters, t] {
      braid::View mine = counters.view_of<std::uint64_t>(t, t + 1);
      for (int i = 0; i < 200; ++i) {
        rt.task("inc").read_write(mine).run([mine](braid::TaskContext& ctx) { ctx.write<std::uint64_t>(mine)[0] += 1; });
      }
    });
  }
  for (auto& th : threads) th.join();
  rt.synchronize();
  for (std::uint64_t c : rt.read_vec<std::uint64_t>(counters)) CHECK_EQ(c, static_cast<std::uint64_t>(200));
}

void launch_window_bounds_unfinished_tasks() {
  braid::Runtime rt = braid::Runtime::builder()
                          .backend(braid::BackendKind::Cpu)
                          .compute_streams(2)
                          .launch_window(4)
                          .build();
  std::atomic<int> finished{0};
  std::vector<braid::Buffer> bufs;
  for (int i = 0; i < 32; ++i) {
    bufs.push_back(rt.alloc("w", 4));
    rt.task("w").write(bufs.back()).run([&finished](braid::TaskContext&) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      finished.fetch_add(1);
    });
    // Submission blocks while 4 tasks are unfinished, so once run() returns
    // at most 4 of the i + 1 submitted tasks have not finished.
    CHECK(i + 1 - finished.load() <= 4);
  }
  rt.synchronize();
  CHECK_EQ(finished.load(), 32);
}

}  // namespace

int main() {
  check::Runner t;
  t.run("runtime_properties", runtime_properties);
  t.run("buffers_and_views", buffers_and_views);
  t.run("spans_in_a_task", spans_in_a_task);
  t.run("explicit_edges_and_pinning", explicit_edges_and_pinning);
  t.run("comm_tasks_go_to_comm_streams", comm_tasks_go_to_comm_streams);
  t.run("many_submitting_threads", many_submitting_threads);
  t.run("launch_window_bounds_unfinished_tasks", launch_window_bounds_unfinished_tasks);
  return t.finish();
}

// The C++ surface itself: handles, views, tokens and spans, upload /
// read-back, task handles, several submitting threads, the launch window,
// comm placement.
#include <atomic>
#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <cstdint>
#include <thread>
#include <vector>

#include <sys/stat.h>

#include "check.hpp"

struct CUstream_st;  // what cudaStream_t and CUstream point to (CUDA's headers are not needed)

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
  rt.task("task \xfe").run([] {}).wait();
  const std::string msg = ERROR_OF(rt.write_trace("trace-\xff.json"));
  CHECK_CONTAINS(msg, "utf-8");
  CHECK_CONTAINS(ERROR_OF(braid::Runtime::builder().trace("t\xff.json")), "utf-8");
  // The trace is written when the runtime is destroyed: build() refuses a
  // path it could not write then.
  CHECK_CONTAINS(ERROR_OF(braid::Runtime::builder()
                              .backend(braid::BackendKind::Cpu)
                              .trace("no-such-dir/t.json")
                              .build()),
                 "does not exist");
}

void spans_in_a_task() {
  braid::Runtime rt = cpu();
  braid::Buffer in = rt.alloc_from<float>("in", {1, 2, 3, 4});
  braid::Buffer out = rt.alloc("out", in.size());
  braid::TaskHandle h =
      rt.task("spans").run(braid::read<float>(in), braid::write<float>(out), [](braid::Span<const float> x, braid::Span<float> y) {
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
  braid::TaskHandle first = rt.task("first").on_stream(2).run(braid::write(a), [&order](braid::Span<std::byte>) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    order = 1;
  });
  // No data dependency on `first`: only the explicit edge orders them.
  rt.task("second").after(first).on_stream(0).run(braid::write(b), [&order, &second_saw](auto) {
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
  braid::TaskHandle c0 = rt.task("c0").kind(braid::TaskKind::Comm).run(braid::read_write(g.view(0, 4)), [](auto) {});
  braid::TaskHandle c1 =
      rt.task("c1").kind(braid::TaskKind::Comm).comm_stream(1).run(braid::read_write(g.view(4, 8)), [](auto) {});
  braid::TaskHandle side = rt.task("side").priority(braid::Priority::Side).run(braid::read(g), [](auto) {});
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
        rt.task("inc").run(braid::read_write<std::uint64_t>(mine), [](braid::Span<std::uint64_t> c) { c[0] += 1; });
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
    rt.task("w").run(braid::write(bufs.back()), [&finished](auto) {
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

// What each token form gives a body: typed spans in token order (bytes without
// a type), a std::vector of spans for a std::vector of tokens.
void token_forms() {
  braid::Runtime rt = cpu(3);
  braid::Buffer b = rt.alloc_from<std::int32_t>("b", {1, 2, 3, 4, 5, 6, 7, 8});
  std::vector<braid::Read<std::int32_t>> parts;
  for (std::size_t i = 0; i < 4; ++i) parts.push_back(braid::read<std::int32_t>(b.view_of<std::int32_t>(2 * i, 2 * i + 2)));
  CHECK_EQ(parts[1].view().offset(), static_cast<std::size_t>(8));
  braid::Buffer sums = rt.alloc("sums", 4 * sizeof(std::int64_t));
  braid::Buffer bytes = rt.alloc("bytes", 3);
  rt.task("gather").run(parts, braid::write<std::int64_t>(sums), braid::write(bytes),
                        [](std::vector<braid::Span<const std::int32_t>> in, braid::Span<std::int64_t> out,
                           braid::Span<std::byte> raw) {
                          if (in.size() != 4 || raw.size() != 3) throw std::logic_error("shape");
                          for (std::size_t i = 0; i < in.size(); ++i) out[i] = in[i][0] + in[i][1];
                          raw[0] = std::byte{7};
                        });
  CHECK(rt.read_vec<std::int64_t>(sums) == std::vector<std::int64_t>({3, 7, 11, 15}));
  CHECK(rt.read_vec<std::uint8_t>(bytes) == std::vector<std::uint8_t>({7, 0, 0}));
  // An empty vector of tokens declares nothing and gives an empty vector.
  rt.task("none").run(std::vector<braid::Write<float>>(), [](std::vector<braid::Span<float>> v) {
    if (!v.empty()) throw std::logic_error("not empty");
  }).wait();
  // Every writer of a view of a vector is ordered before a reader of it.
  std::vector<braid::ReadWrite<std::int32_t>> all;
  for (const auto& p : parts) all.push_back(braid::read_write<std::int32_t>(p.view()));
  rt.task("negate").run(all, [](std::vector<braid::Span<std::int32_t>> v) {
    for (auto s : v)
      for (auto& x : s) x = -x;
  });
  CHECK(rt.read_vec<std::int32_t>(b) == std::vector<std::int32_t>({-1, -2, -3, -4, -5, -6, -7, -8}));
}

// run_any runs the CPU body on the CPU backend; bodies may be move-only and
// mutable; the CUDA body's parameters convert to plain device pointers and
// the stream to cudaStream_t (checked here at compile time).
void bodies() {
  braid::Runtime rt = cpu();
  braid::Buffer x = rt.alloc_from<float>("x", {1, 2}), y = rt.alloc("y", 8);
  std::atomic<int> cuda_ran{0};
  auto owned = std::make_unique<float>(10.0f);
  rt.task("any").run_any(
      braid::read<float>(x), braid::write<float>(y),
      [k = std::move(owned)](braid::Span<const float> in, braid::Span<float> out) mutable {
        for (std::size_t i = 0; i < in.size(); ++i) out[i] = in[i] * *k;
      },
      [&cuda_ran](const float*, float*, braid::CudaStream) { cuda_ran = 1; });
  CHECK(rt.read_vec<float>(y) == std::vector<float>({10, 20}));
  CHECK_EQ(cuda_ran.load(), 0);
  using Kernel = void (*)(const float*, float*, CUstream_st*);
  static_assert(std::is_invocable<Kernel, braid::DeviceSpan<const float>, braid::DeviceSpan<float>, braid::CudaStream>::value,
                "device spans convert to pointers, the stream to cudaStream_t");
  static_assert(!std::is_invocable<void (*)(float*), braid::DeviceSpan<const float>>::value,
                "a read gives no writable device pointer");
  static_assert(std::is_convertible<braid::Span<float>, braid::Span<const float>>::value, "write spans read too");
  static_assert(!std::is_convertible<braid::Span<const float>, braid::Span<float>>::value, "read spans do not write");
  braid::DeviceSpan<float> d(nullptr, 3);
  braid::DeviceSpan<const float> cd = d;
  CHECK_EQ(cd.size_bytes(), static_cast<std::size_t>(12));
  int dummy = 0;
  CHECK(static_cast<void*>(braid::CudaStream(&dummy)) == &dummy);
}

bool socket_exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISSOCK(st.st_mode);
}

// Priority classes and the live view through the builder: a best-effort and
// a latency-critical runtime side by side compute their programs' results;
// a live runtime serves its socket while it lives and removes it after.
void classes_and_live() {
  const std::string sock = "braid-cpp-live.sock";
  {
    braid::Runtime lc = braid::Runtime::builder()
                            .backend(braid::BackendKind::Cpu)
                            .priority_class(braid::Class::LatencyCritical)
                            .live(sock)
                            .build();
    braid::Runtime be = braid::Runtime::builder()
                            .backend(braid::BackendKind::Cpu)
                            .priority_class(braid::Class::BestEffort)
                            .build();
    braid::Buffer a = lc.alloc_from<int>("a", {1, 2, 3});
    braid::Buffer b = be.alloc_from<int>("b", {4, 5, 6});
    for (int i = 0; i < 10; ++i) {
      lc.task("serve").run(braid::read_write<int>(a), [](braid::Span<int> x) {
        for (int& v : x) v += 1;
      });
      be.task("train").run(braid::read_write<int>(b), [](braid::Span<int> x) {
        for (int& v : x) v *= 2;
      });
    }
    CHECK(lc.read_vec<int>(a) == std::vector<int>({11, 12, 13}));
    CHECK(be.read_vec<int>(b) == std::vector<int>({4096, 5120, 6144}));
    CHECK(socket_exists(sock));
  }
  CHECK(!socket_exists(sock));
}

// A best-effort runtime's device bundle (RuntimeBuilder::device_bundle):
// a positive window builds (on the CPU it is ignored), zero throws naming
// the setting.
void device_bundle_setting() {
  braid::Runtime be = braid::Runtime::builder()
                          .backend(braid::BackendKind::Cpu)
                          .priority_class(braid::Class::BestEffort)
                          .device_bundle(std::chrono::microseconds(250))
                          .build();
  braid::Buffer a = be.alloc_from<int>("a", {1, 2});
  be.task("double").run(braid::read_write<int>(a), [](braid::Span<int> x) {
    for (int& v : x) v *= 2;
  });
  CHECK(be.read_vec<int>(a) == std::vector<int>({2, 4}));
  bool threw = false;
  try {
    braid::Runtime::builder()
        .backend(braid::BackendKind::Cpu)
        .device_bundle(std::chrono::microseconds(0))
        .build();
  } catch (const braid::Error& e) {
    threw = std::string(e.what()).find("device_bundle") != std::string::npos;
  }
  CHECK(threw);
}

// Real-time threads through the builder: a latency-critical runtime with
// them computes its program's result (on a thread of its own: the threads
// that submit to it switch too, where the OS allows); other classes throw.
void realtime_threads() {
  std::thread serving([] {
    braid::Runtime lc = braid::Runtime::builder()
                            .backend(braid::BackendKind::Cpu)
                            .priority_class(braid::Class::LatencyCritical)
                            .realtime()
                            .build();
    braid::Buffer a = lc.alloc_from<int>("a", {1, 2, 3});
    lc.task("serve").run(braid::read_write<int>(a), [](braid::Span<int> x) {
      for (int& v : x) v *= 10;
    });
    CHECK(lc.read_vec<int>(a) == std::vector<int>({10, 20, 30}));
  });
  serving.join();
  bool threw = false;
  try {
    braid::Runtime::builder().backend(braid::BackendKind::Cpu).realtime().build();
  } catch (const braid::Error& e) {
    threw = std::string(e.what()).find("latency-critical") != std::string::npos;
  }
  CHECK(threw);
}

}  // namespace

int main() {
  check::Runner t;
  t.run("runtime_properties", runtime_properties);
  t.run("buffers_and_views", buffers_and_views);
  t.run("spans_in_a_task", spans_in_a_task);
  t.run("token_forms", token_forms);
  t.run("bodies", bodies);
  t.run("explicit_edges_and_pinning", explicit_edges_and_pinning);
  t.run("comm_tasks_go_to_comm_streams", comm_tasks_go_to_comm_streams);
  t.run("many_submitting_threads", many_submitting_threads);
  t.run("launch_window_bounds_unfinished_tasks", launch_window_bounds_unfinished_tasks);
  t.run("classes_and_live", classes_and_live);
  t.run("realtime_threads", realtime_threads);
  t.run("device_bundle_setting", device_bundle_setting);
  return t.finish();
}

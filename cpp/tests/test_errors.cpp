// Errors through the C++ API: misuse throws braid::Error at once; a task that
// reaches undeclared data, or whose lambda throws, fails like a Rust task that
// returns Err — the error names the task and surfaces at the next
// synchronisation point, its dependents are skipped, and the runtime stays
// usable. Nothing here may crash, hang or leak (the sanitizer build runs it).
#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "check.hpp"

namespace {

braid::Runtime rt_with(std::size_t streams) {
  return braid::Runtime::builder().backend(braid::BackendKind::Cpu).compute_streams(streams).build();
}

void views_out_of_bounds_throw() {
  braid::Runtime rt = rt_with(1);
  braid::Buffer x = rt.alloc("x", 8);
  std::string msg = ERROR_OF(x.view(4, 12));
  CHECK_CONTAINS(msg, "out of bounds");
  CHECK_CONTAINS(msg, "`x`");
  msg = ERROR_OF(x.view_of<float>(1, 3));
  CHECK_CONTAINS(msg, "out of bounds");
  msg = ERROR_OF(x.view(6, 2));
  CHECK_CONTAINS(msg, "out of bounds");
  braid::View v = x.view(2, 6);
  msg = ERROR_OF(v.view(0, 5));
  CHECK_CONTAINS(msg, "out of bounds");
  // Overflowing element ranges saturate and are reported, not wrapped.
  msg = ERROR_OF(x.view_of<double>(0, static_cast<std::size_t>(-1) / 4));
  CHECK_CONTAINS(msg, "out of bounds");
  CHECK_EQ(v.view(1, 3).offset(), static_cast<std::size_t>(3));
}

void undeclared_access_fails_the_task() {
  braid::Runtime rt = rt_with(2);
  braid::Buffer x = rt.alloc("x", 16), y = rt.alloc("y", 16);
  std::atomic<bool> reached_after{false};
  rt.task("sneaky").read(x).run([y, &reached_after](braid::TaskContext& ctx) {
    ctx.read<float>(y);  // throws: y was not declared
    reached_after = true;
  });
  std::string msg = ERROR_OF(rt.synchronize());
  CHECK_CONTAINS(msg, "sneaky");
  CHECK_CONTAINS(msg, "without declaring");
  CHECK_CONTAINS(msg, "`y`");
  CHECK(!reached_after.load());

  // Write access to a view declared read.
  rt.task("reader-writes").read(x).run([x](braid::TaskContext& ctx) { ctx.write<float>(x); });
  msg = ERROR_OF(rt.synchronize());
  CHECK_CONTAINS(msg, "reader-writes");
  CHECK_CONTAINS(msg, "for write");

  // A view beyond the declared one is undeclared too.
  braid::View part = x.view(0, 8);
  rt.task("too-far").read(part).run([x](braid::TaskContext& ctx) { ctx.read<std::uint8_t>(x); });
  msg = ERROR_OF(rt.synchronize());
  CHECK_CONTAINS(msg, "too-far");

  // The body may catch the error itself and carry on: then the task succeeds.
  braid::TaskHandle h = rt.task("careful").read(x).run([y](braid::TaskContext& ctx) {
    try {
      ctx.read<float>(y);
    } catch (const braid::Error&) {
      return;
    }
    throw std::logic_error("undeclared read did not throw");
  });
  h.wait();
  rt.synchronize();
}

void aliasing_and_misaligned_spans_are_refused() {
  braid::Runtime rt = rt_with(1);
  braid::Buffer x = rt.alloc("x", 16);
  braid::TaskHandle h = rt.task("alias").read_write(x).run([x](braid::TaskContext& ctx) {
    auto a = ctx.write<std::uint32_t>(x);
    auto b = ctx.read<std::uint32_t>(x);  // would alias `a`: throws
    (void)a;
    (void)b;
  });
  std::string msg = ERROR_OF(h.wait());
  CHECK_CONTAINS(msg, "alias");
  CHECK_CONTAINS(msg, "twice");

  braid::Buffer other = rt.alloc("other", 16);  // `x` is the failed task's: its readers are skipped
  braid::View odd = other.view(2, 10);
  h = rt.task("misaligned").read(odd).run([odd](braid::TaskContext& ctx) { ctx.read<std::uint32_t>(odd); });
  msg = ERROR_OF(h.wait());
  CHECK_CONTAINS(msg, "misaligned");
  CHECK_CONTAINS(msg, "aligned slice");

  braid::Buffer six = rt.alloc("six", 6);
  msg = ERROR_OF(rt.read_vec<float>(six));
  CHECK_CONTAINS(msg, "aligned slice");
  msg = ERROR_OF(rt.upload(six, std::vector<float>{1.0f, 2.0f}));
  CHECK_CONTAINS(msg, "upload of 8 bytes");
  rt.synchronize();
}

void throwing_lambda_is_a_task_error() {
  for (std::size_t streams = 1; streams <= 3; ++streams) {
    braid::Runtime rt = rt_with(streams);
    braid::Buffer x = rt.alloc("x", 16), y = rt.alloc("y", 16), z = rt.alloc("z", 4);
    std::atomic<int> ran{0};
    rt.task("bad").write(x).run([](braid::TaskContext&) { throw std::runtime_error("disk on fire"); });
    braid::TaskHandle dep = rt.task("dependent").read(x).write(y).run([&ran](braid::TaskContext&) { ran.fetch_add(1); });
    braid::TaskHandle dep2 = rt.task("dependent-of-dependent").read(y).run([&ran](braid::TaskContext&) { ran.fetch_add(1); });
    braid::TaskHandle ok = rt.task("independent").write(z).run([](braid::TaskContext&) {});
    std::string msg = ERROR_OF(rt.synchronize());
    CHECK_CONTAINS(msg, "task `bad` failed: disk on fire");
    CHECK_EQ(ran.load(), 0);
    msg = ERROR_OF(dep.wait());
    CHECK_CONTAINS(msg, "`dependent` was skipped because `bad`");
    msg = ERROR_OF(dep2.wait());
    CHECK_CONTAINS(msg, "dependent-of-dependent");
    CHECK(dep.done() && dep2.done());
    ok.wait();
    // Reported once; afterwards the runtime works, the buffer included.
    rt.synchronize();
    rt.upload(x, std::vector<std::uint32_t>{1, 2, 3, 4});
    CHECK(rt.read_vec<std::uint32_t>(x) == std::vector<std::uint32_t>({1, 2, 3, 4}));
  }
}

void non_std_exceptions_are_task_errors() {
  braid::Runtime rt = rt_with(2);
  braid::Buffer x = rt.alloc("x", 4);
  braid::TaskHandle h = rt.task("throws-int").write(x).run([](braid::TaskContext&) { throw 42; });
  std::string msg = ERROR_OF(h.wait());
  CHECK_CONTAINS(msg, "throws-int");
  CHECK_CONTAINS(msg, "not a std::exception");
  // Reported by the handle: not again at synchronize.
  rt.synchronize();
  // Invalid UTF-8 in a message is replaced, not an error of its own.
  h = rt.task("bytes").write(x).run([](braid::TaskContext&) { throw std::runtime_error("bad \xff byte"); });
  msg = ERROR_OF(h.wait());
  CHECK_CONTAINS(msg, "bad ");
  // Until the next synchronisation point, later writers of `x` depend on the
  // failed task and are skipped; after it, `x` is usable again.
  msg = ERROR_OF(rt.task("too-soon").write(x).run([](braid::TaskContext&) {}).wait());
  CHECK_CONTAINS(msg, "`too-soon` was skipped because `bytes`");
  rt.synchronize();
  rt.task("after").write(x).run([](braid::TaskContext&) {}).wait();
}

void several_failures_are_all_reported() {
  braid::Runtime rt = rt_with(2);
  std::vector<braid::Buffer> bufs;
  for (int i = 0; i < 3; ++i) {
    bufs.push_back(rt.alloc("b" + std::to_string(i), 4));
    rt.task("f" + std::to_string(i)).write(bufs.back()).run([](braid::TaskContext&) { throw std::runtime_error("no"); });
  }
  const std::string msg = ERROR_OF(rt.synchronize());
  CHECK_CONTAINS(msg, "3 tasks failed");
  rt.synchronize();
}

void misuse_is_an_error_at_submission() {
  braid::Runtime a = rt_with(1), b = rt_with(1);
  braid::Buffer x = a.alloc("x", 8);
  std::string msg = ERROR_OF(b.task("foreign").read(x).run([](braid::TaskContext&) {}));
  CHECK_CONTAINS(msg, "belongs to runtime");
  msg = ERROR_OF(a.task("pinned").on_stream(9).run([](braid::TaskContext&) {}));
  CHECK_CONTAINS(msg, "stream 9");
  msg = ERROR_OF(a.task("empty").run(braid::TaskBody()));
  CHECK_CONTAINS(msg, "empty body");
  braid::TaskBuilder builder = a.task("twice");
  builder.run([](braid::TaskContext&) {});
  msg = ERROR_OF(builder.run([](braid::TaskContext&) {}));
  CHECK_CONTAINS(msg, "already submitted");
  msg = ERROR_OF(builder.read(x));
  CHECK_CONTAINS(msg, "already submitted");
  msg = ERROR_OF(braid::Runtime::builder().backend(braid::BackendKind::Cpu).compute_streams(0).build());
  CHECK_CONTAINS(msg, "compute stream");
  a.synchronize();
}

void waiting_inside_a_task_is_an_error_not_a_deadlock() {
  braid::Runtime rt = rt_with(1);
  const braid::Runtime* self = &rt;
  braid::TaskHandle h = rt.task("waits").run([self](braid::TaskContext&) { self->synchronize(); });
  const std::string msg = ERROR_OF(h.wait());
  CHECK_CONTAINS(msg, "synchronize");
  CHECK_CONTAINS(msg, "waits");
  rt.synchronize();
}

void gpu_accessors_on_the_cpu() {
  braid::Runtime rt = rt_with(1);
  braid::Buffer x = rt.alloc("x", 16);
  rt.task("cpu-only").read(x).run([x](braid::TaskContext& ctx) {
    if (ctx.cuda_stream() != nullptr) throw std::logic_error("a CUDA stream on the CPU backend");
    if (!ctx.is_cpu()) throw std::logic_error("not on the CPU");
    ctx.device_ptr(x);  // throws: host memory has no device address
  });
  const std::string msg = ERROR_OF(rt.synchronize());
  CHECK_CONTAINS(msg, "cpu-only");
  CHECK_CONTAINS(msg, "a GPU");
}

}  // namespace

int main() {
  check::Runner t;
  t.run("views_out_of_bounds_throw", views_out_of_bounds_throw);
  t.run("undeclared_access_fails_the_task", undeclared_access_fails_the_task);
  t.run("aliasing_and_misaligned_spans_are_refused", aliasing_and_misaligned_spans_are_refused);
  t.run("throwing_lambda_is_a_task_error", throwing_lambda_is_a_task_error);
  t.run("non_std_exceptions_are_task_errors", non_std_exceptions_are_task_errors);
  t.run("several_failures_are_all_reported", several_failures_are_all_reported);
  t.run("misuse_is_an_error_at_submission", misuse_is_an_error_at_submission);
  t.run("waiting_inside_a_task_is_an_error_not_a_deadlock", waiting_inside_a_task_is_an_error_not_a_deadlock);
  t.run("gpu_accessors_on_the_cpu", gpu_accessors_on_the_cpu);
  return t.finish();
}

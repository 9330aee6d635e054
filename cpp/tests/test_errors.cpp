// Errors through the C++ API: misuse throws braid::Error at once — tokens that
// alias or do not fit their element type are refused at submission (a body
// cannot reach undeclared data, nor write through a read: that does not
// compile, see compile_fail.cpp); a task whose lambda throws fails like a Rust
// task that returns Err — the error names the task and surfaces at the next
// synchronisation point, its dependents are skipped, and the runtime stays
// usable. Nothing here may crash, hang or leak (the sanitizer build runs it).
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
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

// A body gets only its tokens' data, so what used to be an undeclared access
// at run time is now either impossible or a pair of tokens that would alias:
// refused at submission, naming the task, before anything runs.
void aliasing_tokens_are_refused_at_submission() {
  braid::Runtime rt = rt_with(2);
  braid::Buffer x = rt.alloc("x", 16), y = rt.alloc("y", 16);
  std::atomic<bool> ran{false};
  // A read and a write of overlapping bytes: the body would get aliasing spans.
  std::string msg = ERROR_OF(rt.task("sneaky").run(braid::read<float>(x), braid::write<float>(x.view(8, 16)),
                                                   [&ran](auto, auto) { ran = true; }));
  CHECK_CONTAINS(msg, "sneaky");
  CHECK_CONTAINS(msg, "twice");
  CHECK_CONTAINS(msg, "`x`");
  // Two writes of the same view.
  msg = ERROR_OF(rt.task("reader-writes").run(braid::read_write<float>(y), braid::write<float>(y),
                                              [&ran](auto, auto) { ran = true; }));
  CHECK_CONTAINS(msg, "reader-writes");
  CHECK_CONTAINS(msg, "`y`");
  // A vector of tokens is checked like separate tokens.
  std::vector<braid::ReadWrite<float>> parts{braid::read_write<float>(x.view(0, 8)), braid::read_write<float>(x.view(4, 12))};
  msg = ERROR_OF(rt.task("too-far").run(parts, [&ran](auto) { ran = true; }));
  CHECK_CONTAINS(msg, "too-far");
  // A refused builder stays unsubmitted: nothing ran, nothing is pending.
  rt.synchronize();
  CHECK(!ran.load());

  // Reads of the same bytes, and disjoint writes, are fine.
  braid::TaskHandle h = rt.task("careful").run(
      braid::read<float>(x), braid::read<float>(x.view(0, 8)), braid::write<float>(y.view(0, 8)),
      braid::write<float>(y.view(8, 16)), [](auto a, auto b, auto lo, auto hi) {
        if (a.size() != 4 || b.size() != 2 || lo.size() != 2 || hi.size() != 2) throw std::logic_error("sizes");
      });
  h.wait();
  rt.synchronize();
}

void aliasing_and_misaligned_spans_are_refused() {
  braid::Runtime rt = rt_with(1);
  braid::Buffer x = rt.alloc("x", 16);
  std::string msg = ERROR_OF(rt.task("alias").run(braid::read_write<std::uint32_t>(x), braid::read<std::uint32_t>(x),
                                                  [](auto a, auto b) {
                                                    (void)a;
                                                    (void)b;
                                                  }));
  CHECK_CONTAINS(msg, "alias");
  CHECK_CONTAINS(msg, "twice");

  braid::Buffer other = rt.alloc("other", 16);
  braid::View odd = other.view(2, 10);  // 8 bytes, but not at a 4-byte offset
  msg = ERROR_OF(rt.task("misaligned").run(braid::read<std::uint32_t>(odd), [](auto) {}));
  CHECK_CONTAINS(msg, "misaligned");
  CHECK_CONTAINS(msg, "aligned slice");
  msg = ERROR_OF(rt.task("ragged").run(braid::write<double>(other.view(0, 12)), [](auto) {}));
  CHECK_CONTAINS(msg, "ragged");
  CHECK_CONTAINS(msg, "aligned slice");
  // The same bytes as bytes are fine.
  rt.task("bytes").run(braid::read(odd), [](braid::Span<const std::byte> b) {
    if (b.size() != 8) throw std::logic_error("size");
  }).wait();

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
    rt.task("bad").run(braid::write(x), [](auto) { throw std::runtime_error("disk on fire"); });
    braid::TaskHandle dep =
        rt.task("dependent").run(braid::read(x), braid::write(y), [&ran](auto, auto) { ran.fetch_add(1); });
    braid::TaskHandle dep2 = rt.task("dependent-of-dependent").run(braid::read(y), [&ran](auto) { ran.fetch_add(1); });
    braid::TaskHandle ok = rt.task("independent").run(braid::write(z), [](auto) {});
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
  braid::TaskHandle h = rt.task("throws-int").run(braid::write(x), [](auto) { throw 42; });
  std::string msg = ERROR_OF(h.wait());
  CHECK_CONTAINS(msg, "throws-int");
  CHECK_CONTAINS(msg, "not a std::exception");
  // Reported by the handle: not again at synchronize.
  rt.synchronize();
  // Invalid UTF-8 in a message is replaced, not an error of its own.
  h = rt.task("bytes").run(braid::write(x), [](auto) { throw std::runtime_error("bad \xff byte"); });
  msg = ERROR_OF(h.wait());
  CHECK_CONTAINS(msg, "bad ");
  // Until the next synchronisation point, later writers of `x` depend on the
  // failed task and are skipped; after it, `x` is usable again.
  msg = ERROR_OF(rt.task("too-soon").run(braid::write(x), [](auto) {}).wait());
  CHECK_CONTAINS(msg, "`too-soon` was skipped because `bytes`");
  rt.synchronize();
  rt.task("after").run(braid::write(x), [](auto) {}).wait();
}

void several_failures_are_all_reported() {
  braid::Runtime rt = rt_with(2);
  std::vector<braid::Buffer> bufs;
  for (int i = 0; i < 3; ++i) {
    bufs.push_back(rt.alloc("b" + std::to_string(i), 4));
    rt.task("f" + std::to_string(i)).run(braid::write(bufs.back()), [](auto) { throw std::runtime_error("no"); });
  }
  const std::string msg = ERROR_OF(rt.synchronize());
  CHECK_CONTAINS(msg, "3 tasks failed");
  rt.synchronize();
}

void misuse_is_an_error_at_submission() {
  braid::Runtime a = rt_with(1), b = rt_with(1);
  braid::Buffer x = a.alloc("x", 8);
  std::string msg = ERROR_OF(b.task("foreign").run(braid::read(x), [](auto) {}));
  CHECK_CONTAINS(msg, "task `foreign`: buffer `x` belongs to another runtime");
  msg = ERROR_OF(a.task("pinned").on_stream(9).run([] {}));
  CHECK_CONTAINS(msg, "stream 9");
  msg = ERROR_OF(a.task("empty").run(std::function<void()>()));
  CHECK_CONTAINS(msg, "empty body");
  void (*null_body)(braid::Span<const std::byte>) = nullptr;
  msg = ERROR_OF(a.task("empty").run(braid::read(x), null_body));
  CHECK_CONTAINS(msg, "empty body");
  braid::TaskBuilder builder = a.task("twice");
  builder.run([] {});
  msg = ERROR_OF(builder.run([] {}));
  CHECK_CONTAINS(msg, "already submitted");
  msg = ERROR_OF(builder.on_stream(0));
  CHECK_CONTAINS(msg, "already submitted");
  msg = ERROR_OF(braid::Runtime::builder().backend(braid::BackendKind::Cpu).compute_streams(0).build());
  CHECK_CONTAINS(msg, "compute stream");
  a.synchronize();
}

void waiting_inside_a_task_is_an_error_not_a_deadlock() {
  braid::Runtime rt = rt_with(1);
  const braid::Runtime* self = &rt;
  braid::TaskHandle h = rt.task("waits").run([self] { self->synchronize(); });
  const std::string msg = ERROR_OF(h.wait());
  CHECK_CONTAINS(msg, "synchronize");
  CHECK_CONTAINS(msg, "waits");
  rt.synchronize();
  // Waiting on a finished task is refused too (whether it has finished is
  // timing), naming the call; read_vec is refused naming itself.
  braid::Buffer x = rt.alloc("x", 4);
  braid::TaskHandle first = rt.task("first").run(braid::write<int>(x), [](braid::Span<int> v) { v[0] = 1; });
  first.wait();
  const std::string wait_msg = ERROR_OF(rt.task("waits").run([first] { first.wait(); }).wait());
  CHECK_CONTAINS(wait_msg, "TaskHandle::wait");
  const std::string read_msg = ERROR_OF(rt.task("reads").run([self, x] { (void)self->read_vec<int>(x); }).wait());
  CHECK_CONTAINS(read_msg, "Runtime::read_vec");
  rt.synchronize();
}

// A CUDA body on the CPU backend: run_cuda is refused at submission (naming
// the task); run_any runs the CPU body.
void cuda_bodies_on_the_cpu() {
  braid::Runtime rt = rt_with(1);
  braid::Buffer x = rt.alloc("x", 16);
  std::atomic<int> cuda_ran{0};
  const std::string msg =
      ERROR_OF(rt.task("cpu-only").run_cuda(braid::read<float>(x), [&cuda_ran](const float*, braid::CudaStream) {
        cuda_ran = 1;
      }));
  CHECK_CONTAINS(msg, "cpu-only");
  CHECK_CONTAINS(msg, "no body for the cpu backend");
  std::atomic<int> cpu_ran{0};
  rt.task("either").run_any(
      braid::read<float>(x), [&cpu_ran](braid::Span<const float> v) { cpu_ran = static_cast<int>(v.size()); },
      [&cuda_ran](braid::DeviceSpan<const float>, braid::CudaStream) { cuda_ran = 1; });
  rt.synchronize();
  CHECK_EQ(cpu_ran.load(), 4);
  CHECK_EQ(cuda_ran.load(), 0);
}

}  // namespace

int main() {
  check::Runner t;
  t.run("views_out_of_bounds_throw", views_out_of_bounds_throw);
  t.run("aliasing_tokens_are_refused_at_submission", aliasing_tokens_are_refused_at_submission);
  t.run("aliasing_and_misaligned_spans_are_refused", aliasing_and_misaligned_spans_are_refused);
  t.run("throwing_lambda_is_a_task_error", throwing_lambda_is_a_task_error);
  t.run("non_std_exceptions_are_task_errors", non_std_exceptions_are_task_errors);
  t.run("several_failures_are_all_reported", several_failures_are_all_reported);
  t.run("misuse_is_an_error_at_submission", misuse_is_an_error_at_submission);
  t.run("waiting_inside_a_task_is_an_error_not_a_deadlock", waiting_inside_a_task_is_an_error_not_a_deadlock);
  t.run("cuda_bodies_on_the_cpu", cuda_bodies_on_the_cpu);
  return t.finish();
}

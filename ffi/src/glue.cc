// The task trampoline: see glue.h for the protocol.
#include "braid-ffi/src/glue.h"

#include <exception>

#include "braid-ffi/src/lib.rs.h"

namespace braid {
namespace ffi {

namespace {
void set_error(rust::String& error, const char* message) noexcept {
  try {
    // `lossy`: an exception message need not be UTF-8.
    error = rust::String::lossy(message != nullptr ? message : "(null message)");
  } catch (...) {
    // Allocation failed: the call still fails, with an empty message.
  }
}

// Calls `f()`; true when it returned, false with the message when it threw.
template <class F>
bool guarded(F&& f, rust::String& error, const char* non_std) noexcept {
  try {
    f();
    return true;
  } catch (const std::exception& e) {
    set_error(error, e.what());
  } catch (...) {
    set_error(error, non_std);
  }
  return false;
}

constexpr const char* kTaskThrew = "the task body threw a C++ exception that is not a std::exception";
}  // namespace

bool call_host(const TaskFn& f, rust::Slice<const RawAccess> data, rust::String& error) noexcept {
  return guarded([&] { f.host(data); }, error, kTaskThrew);
}

bool call_cuda(const TaskFn& f, rust::Slice<const RawAccess> data, std::size_t stream,
               rust::String& error) noexcept {
  return guarded([&] { f.cuda(data, reinterpret_cast<void*>(stream)); }, error, kTaskThrew);
}

bool call_rank(const RankFn& f, std::size_t rank, const Comm& comm, rust::String& error) noexcept {
  return guarded([&] { f.body(rank, comm); }, error,
                 "the rank function threw a C++ exception that is not a std::exception");
}

bool call_record(const RecordFn& f, rust::String& error) noexcept {
  return guarded([&] { f.body(); }, error,
                 "the recording program threw a C++ exception that is not a std::exception");
}

}  // namespace ffi
}  // namespace braid

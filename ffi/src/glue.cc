// The task trampoline: see glue.h for the protocol.
#include "braid-ffi/src/glue.h"

#include <exception>

namespace braid {
namespace ffi {

namespace {
void set_error(rust::String& error, const char* message) noexcept {
  try {
    // `lossy`: an exception message need not be UTF-8.
    error = rust::String::lossy(message != nullptr ? message : "(null message)");
  } catch (...) {
    // Allocation failed: the task still fails, with an empty message.
  }
}
}  // namespace

bool call_task(TaskFn& f, const Ctx& ctx, rust::String& error) noexcept {
  try {
    f.body(ctx);
    return true;
  } catch (const std::exception& e) {
    set_error(error, e.what());
  } catch (...) {
    set_error(error, "the task body threw a C++ exception that is not a std::exception");
  }
  return false;
}

bool call_rank(const RankFn& f, std::size_t rank, const Comm& comm, rust::String& error) noexcept {
  try {
    f.body(rank, comm);
    return true;
  } catch (const std::exception& e) {
    set_error(error, e.what());
  } catch (...) {
    set_error(error, "the rank function threw a C++ exception that is not a std::exception");
  }
  return false;
}

}  // namespace ffi
}  // namespace braid

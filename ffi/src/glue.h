// The C++ half of the task trampoline, included by the cxx-generated bridge
// header (braid-ffi/src/lib.rs.h). Users include braid/braid.hpp instead.
//
// Protocol: a C++ task body is a `TaskFn` owned by Rust (`UniquePtr<TaskFn>`)
// from submission until its task runs — on a Braid stream thread — or is
// skipped because a dependency failed (then it is destroyed without being
// called). Rust calls it through `call_task`, which never lets an exception
// escape: a throwing body becomes `false` plus the exception's message, which
// Rust turns into the task's error. No C++ exception ever unwinds through a
// Rust frame, and no Rust panic reaches C++ (the bridge functions catch them).
#pragma once

#include <cstddef>
#include <functional>

#include "rust/cxx.h"

namespace braid {
namespace ffi {

struct Ctx;   // an extern "Rust" type of the bridge: the running task's context
struct Comm;  // an extern "Rust" type of the bridge: a communicator

// A C++ task body.
struct TaskFn {
  std::function<void(const Ctx&)> body;
};

// Runs `f.body(ctx)`. Returns true when it returned normally; false when it
// threw, with the exception's message (what() for std::exception) in `error`.
bool call_task(TaskFn& f, const Ctx& ctx, rust::String& error) noexcept;

// A C++ rank function for braid::launch: called once per rank, concurrently,
// each on its rank's thread, with that rank's communicator.
struct RankFn {
  std::function<void(std::size_t, const Comm&)> body;
};

// Runs `f.body(rank, comm)`; like call_task, never lets an exception escape.
bool call_rank(const RankFn& f, std::size_t rank, const Comm& comm, rust::String& error) noexcept;

}  // namespace ffi
}  // namespace braid

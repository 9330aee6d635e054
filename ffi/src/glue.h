// The C++ half of the task trampoline, included by the cxx-generated bridge
// header (braid-ffi/src/lib.rs.h). Users include braid/braid.hpp instead.
//
// Protocol: a C++ task is a `TaskFn` owned by Rust (`UniquePtr<TaskFn>`) from
// submission until its task runs — on a Braid stream thread, or for a short
// CPU task on the submitting thread inside the submission — or is skipped
// because a dependency failed (then it is destroyed without being called). It
// holds a CPU body, a CUDA body or both; the runtime's backend picks one and
// Rust calls it through `call_host` or `call_cuda` — once, or once per replay
// when the task was recorded (`RecordFn`), never concurrently — with the bytes of
// the task's declared accesses in declaration order (`RawAccess`: host
// addresses on the CPU, device addresses on CUDA). The bodies are the
// trampolines braid.hpp builds: they turn the bytes into the lambda's typed
// spans. Neither call lets an exception escape: a throwing body becomes
// `false` plus the exception's message, which Rust turns into the task's
// error. No C++ exception ever unwinds through a Rust frame, and no Rust panic
// reaches C++ (the bridge functions catch them).
#pragma once

#include <cstddef>
#include <functional>

#include "rust/cxx.h"

namespace braid {
namespace ffi {

struct Comm;       // an extern "Rust" type of the bridge: a communicator
struct RawAccess;  // a shared struct of the bridge: the bytes of one access

// A C++ task: either body may be empty, not both.
struct TaskFn {
  // The CPU body: host bytes of the accesses.
  std::function<void(rust::Slice<const RawAccess>)> host;
  // The CUDA body: device bytes of the accesses and the raw CUstream.
  std::function<void(rust::Slice<const RawAccess>, void*)> cuda;
};

inline bool has_host_body(const TaskFn& f) noexcept { return static_cast<bool>(f.host); }
inline bool has_cuda_body(const TaskFn& f) noexcept { return static_cast<bool>(f.cuda); }

// Runs `f.host(data)`. Returns true when it returned normally; false when it
// threw, with the exception's message (what() for std::exception) in `error`.
bool call_host(const TaskFn& f, rust::Slice<const RawAccess> data, rust::String& error) noexcept;

// Runs `f.cuda(data, stream)`; like call_host, never lets an exception escape.
bool call_cuda(const TaskFn& f, rust::Slice<const RawAccess> data, std::size_t stream,
               rust::String& error) noexcept;

// A C++ rank function for braid::launch: called once per rank, concurrently,
// each on its rank's thread, with that rank's communicator.
struct RankFn {
  std::function<void(std::size_t, const Comm&)> body;
};

// Runs `f.body(rank, comm)`; like call_task, never lets an exception escape.
bool call_rank(const RankFn& f, std::size_t rank, const Comm& comm, rust::String& error) noexcept;

// A C++ recording program for Runtime::record: called once, on the thread that
// records, to submit the tasks the schedule will hold.
struct RecordFn {
  std::function<void()> body;
};

// Runs `f.body()`; like call_host, never lets an exception escape.
bool call_record(const RecordFn& f, rust::String& error) noexcept;

}  // namespace ffi
}  // namespace braid

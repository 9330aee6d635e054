// Braid's C++ API: an idiomatic C++17 layer over the cxx bridge (crate
// `braid-ffi`, header `braid-ffi/src/lib.rs.h`).
//
//   auto rt = braid::Runtime::builder().backend(braid::BackendKind::Cpu)
//                 .compute_streams(2).profile(true).build();
//   braid::Buffer x = rt.alloc_from<float>("x", {1, 2, 3, 4});
//   braid::Buffer y = rt.alloc("y", x.size());
//   rt.task("double").run(braid::read<float>(x), braid::write<float>(y),
//                         [](braid::Span<const float> in, braid::Span<float> out) {
//                           for (std::size_t i = 0; i < in.size(); ++i) out[i] = 2 * in[i];
//                         });
//   std::vector<float> v = rt.read_vec<float>(y);  // {2, 4, 6, 8}
//
// Semantics are those of the Rust engine (docs/engine.md, "Semantics"): the result is that of
// running the tasks one at a time in submission order; a failing task's
// error, naming it, surfaces at the next synchronisation point and its
// dependents are skipped.
//
// Declared means enforced, and declared once: a task names each access once,
// as a typed token (braid::read<T>(view), braid::write<T>(view),
// braid::read_write<T>(view)), and its body gets exactly those data, in that
// order: Span<const T> for a read, Span<T> for a write on the CPU; typed
// device addresses and the stream on CUDA. Buffers and views hold no data
// accessors, so a body cannot reach data it did not declare, and a read gives
// const data, so writing through it does not compile.
//
// Errors: every call that can fail throws braid::Error (a std::runtime_error)
// with Braid's message; misuse of tokens (a view that is not a whole, aligned
// run of its T; two tokens that overlap where one writes) throws at
// submission. A task body that throws fails its task (the message is the
// exception's what()); the exception never leaves the stream thread.
//
// Threads: a task body runs once, usually later on one of Braid's stream
// threads — but on the CPU a short task (RuntimeBuilder::inline_short_tasks,
// on by default) may run on the submitting thread, inside run(), before run()
// returns. So a body must not take a lock that its submitter holds while
// submitting (it would deadlock), and what the lambda captures must still be
// alive when it runs and be safe to use from either thread; capture by value,
// and capture by reference only what outlives the task (wait on it, or
// synchronize, before it goes).
//
// Handles (Buffer, View, TaskHandle, Profile, Communicator) are reference
// counts: copying is cheap, and moving copies, so a moved-from handle still
// names the same thing. A moved-from Runtime or Schedule throws braid::Error
// from every method.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <memory>
#include <ostream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "braid-ffi/src/lib.rs.h"
#include "rust/cxx.h"

// CUDA's stream object: cudaStream_t and CUstream are both CUstream_st*, so
// braid::CudaStream converts to them without braid.hpp including a CUDA header.
struct CUstream_st;

namespace braid {

using BackendKind = ffi::BackendKind;  // Auto, Cpu, Cuda
using Policy = ffi::Policy;            // Single, RoundRobin, Affinity
using Class = ffi::Class;              // LatencyCritical, Normal, BestEffort
using TaskKind = ffi::TaskKind;        // Compute, Comm, Copy, Host
using Priority = ffi::Priority;        // Main, Side, Comm
using Mode = ffi::Mode;                // Read, Write, ReadWrite

// Everything that goes wrong in Braid, with Braid's message.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

// The version of the Braid library linked in.
inline std::string version() { return std::string(ffi::version()); }

namespace detail {
// Calls into the bridge, turning cxx's rust::Error into braid::Error.
template <class F>
decltype(auto) call(F&& f) {
  try {
    return std::forward<F>(f)();
  } catch (const rust::Error& e) {
    throw Error(e.what());
  } catch (const std::invalid_argument& e) {
    // cxx's check that a string crossing to Rust is UTF-8 (paths, names).
    throw Error(std::string("braid: ") + e.what());
  }
}

inline std::string str(rust::Str s) { return std::string(s.data(), s.size()); }

// A name for Rust (buffer, task, collective): invalid UTF-8 becomes U+FFFD.
inline rust::String name(const std::string& s) { return rust::String::lossy(s); }

// size_t multiply that saturates, so an overflowing element range is reported
// by Braid as out of bounds instead of wrapping around.
inline std::size_t mul(std::size_t a, std::size_t b) noexcept {
  if (b != 0 && a > static_cast<std::size_t>(-1) / b) return static_cast<std::size_t>(-1);
  return a * b;
}

// What a move-only handle owns; a rust::Box is null once moved from, and a
// call through it would crash instead of saying what went wrong.
template <class T>
const T& live(const rust::Box<T>& b, const char* what) {
  const T* p = b.operator->();
  if (p == nullptr) throw Error(std::string("braid: use of a moved-from ") + what);
  return *p;
}
}  // namespace detail

// A contiguous run of T: std::span's C++17 stand-in (pointer and length).
template <class T>
class Span {
 public:
  using element_type = T;
  using value_type = std::remove_cv_t<T>;
  using size_type = std::size_t;
  using iterator = T*;

  constexpr Span() noexcept = default;
  constexpr Span(T* data, std::size_t size) noexcept : data_(data), size_(size) {}
  // Span<T> converts to Span<const T>.
  template <class U, class = std::enable_if_t<std::is_convertible<U (*)[], T (*)[]>::value>>
  constexpr Span(const Span<U>& other) noexcept : data_(other.data()), size_(other.size()) {}

  constexpr T* data() const noexcept { return data_; }
  constexpr std::size_t size() const noexcept { return size_; }
  constexpr std::size_t size_bytes() const noexcept { return size_ * sizeof(T); }
  constexpr bool empty() const noexcept { return size_ == 0; }
  constexpr T* begin() const noexcept { return data_; }
  constexpr T* end() const noexcept { return data_ + size_; }
  constexpr T& operator[](std::size_t i) const noexcept { return data_[i]; }
  // Bounds-checked access: throws std::out_of_range.
  T& at(std::size_t i) const {
    if (i >= size_) throw std::out_of_range("braid::Span::at: index out of range");
    return data_[i];
  }
  constexpr Span subspan(std::size_t offset, std::size_t count) const noexcept {
    return Span(data_ + offset, count);
  }

 private:
  T* data_ = nullptr;
  std::size_t size_ = 0;
};

class Buffer;
class Communicator;
class Runtime;
class TaskBuilder;

// A byte range of a Buffer. Tasks declare accesses on views; two accesses
// conflict when their ranges overlap and at least one writes. Copies are cheap
// (a reference count) and name the same bytes.
class View {
 public:
  // The whole buffer (implicit, so a Buffer goes wherever a View does).
  View(const Buffer& b);  // NOLINT(google-explicit-constructor)
  // No move operations: moving copies, so a moved-from view stays usable.
  View(const View& other) : inner_(ffi::clone_view(*other.inner_)) {}
  View& operator=(const View& other) {
    if (this != &other) inner_ = ffi::clone_view(*other.inner_);
    return *this;
  }
  ~View() = default;

  // Byte offset of the view in its buffer.
  std::size_t offset() const noexcept { return inner_->start(); }
  // Length in bytes.
  std::size_t size() const noexcept { return inner_->len(); }
  bool empty() const noexcept { return size() == 0; }
  // Number of whole T elements.
  template <class T>
  std::size_t count() const noexcept {
    return size() / sizeof(T);
  }

  // A sub-view of the bytes [start, end) relative to this view. Throws when it
  // does not fit.
  View view(std::size_t start, std::size_t end) const {
    return View(detail::call([&] { return inner_->sub_view(start, end); }));
  }
  // A sub-view of the elements [first, last), counted in Ts from this view's start.
  template <class T>
  View view_of(std::size_t first, std::size_t last) const {
    return view(detail::mul(first, sizeof(T)), detail::mul(last, sizeof(T)));
  }

  // The buffer this view belongs to.
  Buffer buffer() const;

  const ffi::View& raw() const noexcept { return *inner_; }

 private:
  friend class Buffer;
  explicit View(rust::Box<ffi::View> inner) : inner_(std::move(inner)) {}
  rust::Box<ffi::View> inner_;
};

// A block of memory owned by a Runtime. Copies are cheap and share it; it is
// released once the last handle is gone and every task that touched it has
// completed. Its contents are reachable only in the body of a task that names
// it (or a view of it) in an access token, and through Runtime::upload /
// Runtime::read_vec.
class Buffer {
 public:
  // No move operations: moving copies, so a moved-from buffer stays usable
  // (and keeps the memory until it goes too).
  Buffer(const Buffer& other) : inner_(ffi::clone_buffer(*other.inner_)) {}
  Buffer& operator=(const Buffer& other) {
    if (this != &other) inner_ = ffi::clone_buffer(*other.inner_);
    return *this;
  }
  ~Buffer() = default;

  // Size in bytes.
  std::size_t size() const noexcept { return inner_->len(); }
  bool empty() const noexcept { return size() == 0; }
  template <class T>
  std::size_t count() const noexcept {
    return size() / sizeof(T);
  }
  // The name given at allocation (used in errors and traces).
  std::string name() const { return detail::str(inner_->name()); }

  // The view of the bytes [start, end). Throws when it does not fit.
  View view(std::size_t start, std::size_t end) const {
    return View(detail::call([&] { return inner_->view(start, end); }));
  }
  // The view of the elements [first, last), counted in Ts.
  template <class T>
  View view_of(std::size_t first, std::size_t last) const {
    return view(detail::mul(first, sizeof(T)), detail::mul(last, sizeof(T)));
  }
  // The view of the whole buffer.
  View whole() const { return View(inner_->whole()); }

  const ffi::Buffer& raw() const noexcept { return *inner_; }

 private:
  friend class Runtime;
  friend class View;
  explicit Buffer(rust::Box<ffi::Buffer> inner) : inner_(std::move(inner)) {}
  rust::Box<ffi::Buffer> inner_;
};

inline View::View(const Buffer& b) : inner_(b.raw().whole()) {}
inline Buffer View::buffer() const { return Buffer(inner_->buffer()); }

// A submitted task. Waiting on it is a synchronisation point for it alone.
class TaskHandle {
 public:
  // No move operations: moving copies, so a moved-from handle stays usable.
  TaskHandle(const TaskHandle& other) : inner_(ffi::clone_handle(*other.inner_)) {}
  TaskHandle& operator=(const TaskHandle& other) {
    if (this != &other) inner_ = ffi::clone_handle(*other.inner_);
    return *this;
  }
  ~TaskHandle() = default;

  // Blocks until the task has completed; throws braid::Error if it failed or
  // was skipped because a task it depends on failed. (An error reported here
  // is not reported again by Runtime::synchronize.)
  void wait() const {
    detail::call([&] { inner_->wait(); });
  }
  // Whether the task has finished, successfully or not.
  bool done() const noexcept { return inner_->is_done(); }
  std::string name() const { return detail::str(inner_->name()); }
  // The stream the task was placed on.
  std::size_t stream() const noexcept { return inner_->stream(); }

  const ffi::TaskHandle& raw() const noexcept { return *inner_; }

 private:
  friend class TaskBuilder;
  friend class Runtime;
  friend class Schedule;
  friend class Communicator;
  explicit TaskHandle(rust::Box<ffi::TaskHandle> inner) : inner_(std::move(inner)) {}
  rust::Box<ffi::TaskHandle> inner_;
};

// ---- access tokens ----------------------------------------------------------------

// A typed access token: task `t` reads (or writes, or reads and updates) view
// `v` as a run of Ts. Made by braid::read<T>(v), braid::write<T>(v) and
// braid::read_write<T>(v); a task names each of its accesses once, as a token,
// and its body gets exactly the data of its tokens, in their order.
template <class T, Mode M>
class Access {
  static_assert(std::is_trivially_copyable<T>::value, "braid: element types must be trivially copyable");
  static_assert(!std::is_const<T>::value && !std::is_volatile<T>::value,
                "braid: name the element type without const (a read token already gives const data)");
  // Braid checks a view's offset against alignof(T) and relies on the
  // buffer's base for the rest: CPU buffers are 64-byte aligned.
  static_assert(alignof(T) <= 64,
                "braid: the element type is over-aligned: buffers are 64-byte aligned, so alignof(T) may be at most "
                "64");

 public:
  using element_type = T;
  static constexpr Mode mode = M;
  static constexpr bool writes = M != Mode::Read;
  // The element as the body sees it: const for a read.
  using value_type = std::conditional_t<writes, T, const T>;

  explicit Access(View v) : view_(std::move(v)) {}
  const View& view() const noexcept { return view_; }

 private:
  View view_;
};

template <class T>
using Read = Access<T, Mode::Read>;
template <class T>
using Write = Access<T, Mode::Write>;
template <class T>
using ReadWrite = Access<T, Mode::ReadWrite>;

// Reads v as Ts: a CPU body gets Span<const T>, a CUDA body DeviceSpan<const T>.
// Without T, the bytes (std::byte).
template <class T = std::byte>
Read<T> read(const View& v) {
  return Read<T>(v);
}
// Overwrites v as Ts without reading it first: Span<T> / DeviceSpan<T>.
template <class T = std::byte>
Write<T> write(const View& v) {
  return Write<T>(v);
}
// Reads and updates v as Ts: Span<T> / DeviceSpan<T>.
template <class T = std::byte>
ReadWrite<T> read_write(const View& v) {
  return ReadWrite<T>(v);
}

// A declared access on a GPU: `size()` Ts at device address `data()`. It
// converts to T* for a kernel argument (const T* for a read); never
// dereference it on the host.
template <class T>
class DeviceSpan {
 public:
  using element_type = T;

  constexpr DeviceSpan() noexcept = default;
  constexpr DeviceSpan(T* data, std::size_t size) noexcept : data_(data), size_(size) {}
  // DeviceSpan<T> converts to DeviceSpan<const T>.
  template <class U, class = std::enable_if_t<std::is_convertible<U (*)[], T (*)[]>::value>>
  constexpr DeviceSpan(const DeviceSpan<U>& other) noexcept : data_(other.data()), size_(other.size()) {}

  constexpr T* data() const noexcept { return data_; }
  constexpr std::size_t size() const noexcept { return size_; }
  constexpr std::size_t size_bytes() const noexcept { return size_ * sizeof(T); }
  constexpr bool empty() const noexcept { return size_ == 0; }
  constexpr operator T*() const noexcept { return data_; }  // NOLINT(google-explicit-constructor)

 private:
  T* data_ = nullptr;
  std::size_t size_ = 0;
};

// The CUDA stream a task runs on. It converts to cudaStream_t and CUstream
// (both `CUstream_st*`, hence to void* too) without braid.hpp including a
// CUDA header; launch the task's kernels on it and Braid orders them with
// every other task. It converts to no other pointer, so a CUDA body whose
// parameters do not match its tokens does not compile.
class CudaStream {
 public:
  explicit CudaStream(void* raw) noexcept : raw_(raw) {}
  void* raw() const noexcept { return raw_; }
  operator ::CUstream_st*() const noexcept {  // NOLINT(google-explicit-constructor)
    return static_cast<::CUstream_st*>(raw_);
  }

 private:
  void* raw_;
};

namespace detail {

// What a token (or a std::vector of tokens) declares and what a body gets
// for it. `valid` is false for anything else.
template <class Tok>
struct token {
  static constexpr bool valid = false;
  using host = void;
  using device = void;
};

template <class T, Mode M>
struct token<Access<T, M>> {
  static constexpr bool valid = true;
  using host = Span<typename Access<T, M>::value_type>;
  using device = DeviceSpan<typename Access<T, M>::value_type>;

  static void declare(const Access<T, M>& a, ffi::TaskSpec& spec) {
    spec.access(a.view().raw(), M, sizeof(T), alignof(T));
  }
  static std::size_t count(const Access<T, M>&) noexcept { return 1; }
  // The span (host or device) of the next access; Braid checked at
  // submission that its bytes are a whole, aligned run of Ts.
  template <class S>
  static S make(const Access<T, M>&, const ffi::RawAccess*& next) {
    const ffi::RawAccess& raw = *next++;
    return S(reinterpret_cast<typename Access<T, M>::value_type*>(raw.addr), raw.len / sizeof(T));
  }
};

template <class Tok>
struct token<std::vector<Tok>> {
  static constexpr bool valid = token<Tok>::valid;
  using host = std::vector<typename token<Tok>::host>;
  using device = std::vector<typename token<Tok>::device>;

  static void declare(const std::vector<Tok>& v, ffi::TaskSpec& spec) {
    for (const Tok& t : v) token<Tok>::declare(t, spec);
  }
  static std::size_t count(const std::vector<Tok>& v) noexcept {
    std::size_t n = 0;
    for (const Tok& t : v) n += token<Tok>::count(t);
    return n;
  }
  template <class S>
  static S make(const std::vector<Tok>& v, const ffi::RawAccess*& next) {
    S out;
    out.reserve(v.size());
    for (const Tok& t : v) out.push_back(token<Tok>::template make<typename S::value_type>(t, next));
    return out;
  }
};

template <class Tok>
using host_t = typename token<Tok>::host;
template <class Tok>
using device_t = typename token<Tok>::device;

// A task's tokens, and the trampolines that turn the bytes Rust hands over
// into the typed spans of the body's parameters.
template <class... Toks>
class Tokens {
  static_assert(std::conjunction<std::bool_constant<token<Toks>::valid>...>::value,
                "braid: every argument of run() before the body must be an access token: braid::read<T>(view), "
                "braid::write<T>(view), braid::read_write<T>(view), or a std::vector of them");

 public:
  explicit Tokens(const Toks&... toks) : toks_(toks...) {}

  // Whether a Body takes the spans of kind Kind (then Extra...).
  template <class Body, template <class> class Kind, class... Extra>
  static constexpr bool accepts() {
    return std::is_invocable<Body&, Kind<Toks>..., Extra...>::value;
  }

  void declare(ffi::TaskSpec& spec) const {
    std::apply([&](const Toks&... t) { (token<Toks>::declare(t, spec), ...); }, toks_);
  }

  // Calls body(spans..., extra...), the spans of kind `host_t` or `device_t`
  // made from `data` in declaration order.
  template <template <class> class Kind, class Body, class... Extra>
  void call(Body& body, rust::Slice<const ffi::RawAccess> data, Extra... extra) const {
    std::apply(
        [&](const Toks&... t) {
          std::size_t n = 0;
          ((n += token<Toks>::count(t)), ...);
          if (n != data.size()) throw Error("braid: a task body got " + std::to_string(data.size()) +
                                            " accesses for its " + std::to_string(n) + " tokens");
          const ffi::RawAccess* next = data.data();
          // Braced: the spans are made left to right.
          std::tuple<Kind<Toks>...> spans{token<Toks>::template make<Kind<Toks>>(t, next)...};
          (void)next;  // unused without tokens
          std::apply([&](auto&... s) { body(std::move(s)..., extra...); }, spans);
        },
        toks_);
  }

 private:
  std::tuple<Toks...> toks_;
};

// Whether a body is an empty std::function or a null function pointer.
template <class B>
bool empty_body(const B&) noexcept {
  return false;
}
template <class R, class... A>
bool empty_body(const std::function<R(A...)>& f) noexcept {
  return !f;
}
template <class R, class... A>
bool empty_body(R (*f)(A...)) noexcept {
  return f == nullptr;
}

}  // namespace detail

// Builds one task: name, kind, priority, then run() with its access tokens
// and body. It holds its runtime's engine, so it stays safe to use after the
// Runtime is destroyed (run() then submits to the engine and, being its last
// holder, waits for the task).
//
// The setters return the builder as it was called: a reference on a named
// builder, a new builder (moved from this one) on a temporary, so
// `auto tb = rt.task("t").priority(p);` moves the builder into `tb` and
// `auto& tb = rt.task("t").priority(p);` does not compile (it would dangle).
class TaskBuilder {
 public:
  TaskBuilder(TaskBuilder&&) noexcept = default;
  TaskBuilder& operator=(TaskBuilder&&) noexcept = default;
  TaskBuilder(const TaskBuilder&) = delete;
  TaskBuilder& operator=(const TaskBuilder&) = delete;
  ~TaskBuilder() = default;

  // The task's kind (default compute; comm tasks go to communication streams).
  TaskBuilder& kind(TaskKind k) & {
    spec().set_kind(k);
    return *this;
  }
  TaskBuilder kind(TaskKind k) && { return std::move(kind(k)); }
  // A scheduling hint (default main).
  TaskBuilder& priority(Priority p) & {
    spec().set_priority(p);
    return *this;
  }
  TaskBuilder priority(Priority p) && { return std::move(priority(p)); }
  // An explicit edge: run after h (rarely needed; data dependencies are inferred).
  TaskBuilder& after(const TaskHandle& h) & {
    spec().after(h.raw());
    return *this;
  }
  TaskBuilder after(const TaskHandle& h) && { return std::move(after(h)); }
  // Pins the task to stream `index`, overriding the placement policy.
  TaskBuilder& on_stream(std::size_t index) & {
    spec().on_stream(index);
    return *this;
  }
  TaskBuilder on_stream(std::size_t index) && { return std::move(on_stream(index)); }
  // Which communication stream a comm task uses (modulo their number).
  TaskBuilder& comm_stream(std::size_t index) & {
    spec().comm_stream(index);
    return *this;
  }
  TaskBuilder comm_stream(std::size_t index) && { return std::move(comm_stream(index)); }

  // run(tokens..., body): submits the task with a CPU body, which gets one
  // span per token (Span<const T> for read<T>, Span<T> for write<T> and
  // read_write<T>; a std::vector of those for a std::vector of tokens):
  //
  //   rt.task("scale").run(braid::read<float>(x), braid::write<float>(y),
  //                        [](braid::Span<const float> x, braid::Span<float> y) { ... });
  //
  // Usually returns at once and the body runs later on the stream the task is
  // placed on; but a task the runtime has measured shorter than a hand-off
  // to a stream thread (RuntimeBuilder::inline_short_tasks, on by default on
  // the CPU) runs on this thread, inside run(), when nothing is ahead of it.
  // So the body must not take a lock held here while submitting. Throws
  // braid::Error for misuse found at submission: a view that is
  // not a whole, aligned run of its T, two tokens that overlap where one
  // writes, a buffer of another runtime, a stream out of range, an empty
  // body, a second run of the same builder, or a runtime whose backend is not
  // the CPU (use run_any there).
  template <class... Args>
  TaskHandle run(Args&&... args) {
    static_assert(sizeof...(Args) >= 1, "braid: run(tokens..., body)");
    return submit<1>(std::forward_as_tuple(std::forward<Args>(args)...));
  }

  // run_cuda(tokens..., body): submits the task with a CUDA body, which gets
  // one DeviceSpan per token (DeviceSpan<const T> for a read; they convert to
  // const T* / T*) and the task's CudaStream; it enqueues work on the stream
  // and returns, and the task completes when that work has:
  //
  //   rt.task("scale").run_cuda(braid::read<float>(x), braid::write<float>(y),
  //                             [](const float* x, float* y, cudaStream_t s) { kernel<<<g, b, 0, s>>>(x, y); });
  //
  // Throws like run, and on a runtime whose backend is not CUDA.
  template <class... Args>
  TaskHandle run_cuda(Args&&... args) {
    static_assert(sizeof...(Args) >= 1, "braid: run_cuda(tokens..., body)");
    return submit<-1>(std::forward_as_tuple(std::forward<Args>(args)...));
  }

  // run_any(tokens..., cpu_body, cuda_body): one body per backend, as in run
  // and run_cuda; the runtime's backend picks one.
  template <class... Args>
  TaskHandle run_any(Args&&... args) {
    static_assert(sizeof...(Args) >= 2, "braid: run_any(tokens..., cpu_body, cuda_body)");
    return submit<2>(std::forward_as_tuple(std::forward<Args>(args)...));
  }

 private:
  friend class Runtime;
  TaskBuilder(const ffi::Runtime& rt, std::string name)
      : name_(std::move(name)),
        spec_(std::make_unique<rust::Box<ffi::TaskSpec>>(rt.new_task(detail::name(name_)))) {}

  ffi::TaskSpec& spec() {
    if (!spec_) throw Error("braid: task `" + name_ + "` was already submitted (or its builder moved from)");
    return **spec_;
  }

  // The last arguments are the bodies: 1 (a CPU body), -1 (a CUDA body) or 2
  // (both); the ones before them are the tokens.
  template <int Bodies, class All>
  TaskHandle submit(All all) {
    constexpr std::size_t n = std::tuple_size<All>::value - (Bodies == 2 ? 2 : 1);
    return submit<Bodies>(all, std::make_index_sequence<n>());
  }

  template <int Bodies, class All, std::size_t... I>
  TaskHandle submit(All& all, std::index_sequence<I...>) {
    using Toks = detail::Tokens<std::decay_t<std::tuple_element_t<I, All>>...>;
    constexpr std::size_t cpu = sizeof...(I), cuda = cpu + (Bodies == 2 ? 1 : 0);
    ffi::TaskSpec& s = spec();
    auto toks = std::make_shared<const Toks>(std::get<I>(all)...);
    auto fn = std::make_unique<ffi::TaskFn>();
    if constexpr (Bodies != -1) {
      auto f = body(std::forward<std::tuple_element_t<cpu, All>>(std::get<cpu>(all)));
      static_assert(Toks::template accepts<decltype(*f), detail::host_t>(),
                    "braid: the CPU body must take one argument per token, in order: braid::Span<const T> for "
                    "read<T>, braid::Span<T> for write<T> / read_write<T> (or auto)");
      fn->host = [toks, f](rust::Slice<const ffi::RawAccess> data) { toks->template call<detail::host_t>(*f, data); };
    }
    if constexpr (Bodies != 1) {
      auto f = body(std::forward<std::tuple_element_t<cuda, All>>(std::get<cuda>(all)));
      static_assert(Toks::template accepts<decltype(*f), detail::device_t, CudaStream>(),
                    "braid: the CUDA body must take one argument per token, in order, then the stream: "
                    "braid::DeviceSpan<const T> (or const T*) for read<T>, braid::DeviceSpan<T> (or T*) for "
                    "write<T> / read_write<T>, then braid::CudaStream (or cudaStream_t)");
      fn->cuda = [toks, f](rust::Slice<const ffi::RawAccess> data, void* stream) {
        toks->template call<detail::device_t>(*f, data, CudaStream(stream));
      };
    }
    toks->declare(s);
    rust::Box<ffi::TaskSpec> owned = std::move(*spec_);
    spec_.reset();
    return TaskHandle(detail::call([&] { return ffi::submit_task(std::move(owned), std::move(fn)); }));
  }

  // The body, shared by the copies std::function makes (so it may be move-only).
  template <class Body>
  std::shared_ptr<std::decay_t<Body>> body(Body&& b) const {
    if (detail::empty_body(b)) throw Error("braid: task `" + name_ + "` was given an empty body");
    return std::make_shared<std::decay_t<Body>>(std::forward<Body>(b));
  }

  std::string name_;
  // Empty once submitted (rust::Box has no empty state of its own). The spec
  // holds the engine.
  std::unique_ptr<rust::Box<ffi::TaskSpec>> spec_;
};

// Busy time of one stream.
struct StreamBusy {
  std::string name;
  std::uint64_t busy_ns = 0;
  std::size_t tasks = 0;
};

// What a profile says about overlap (all times in nanoseconds).
struct Summary {
  std::size_t tasks = 0;
  // From the first task's start to the last task's end.
  std::uint64_t wall_ns = 0;
  std::vector<StreamBusy> streams;
  // Time during which two or more streams were busy at once.
  std::uint64_t overlap_ns = 0;
  // Time during which communication tasks ran, and the part of it during
  // which a non-communication task also ran.
  std::uint64_t comm_ns = 0;
  std::uint64_t comm_hidden_ns = 0;
  // Of comm_ns, the time collectives of CPU ranks waited for the other
  // ranks to reach them (skew between the ranks); the rest (the data
  // moving), and the part of that during which a non-communication task
  // also ran.
  std::uint64_t comm_wait_ns = 0;
  std::uint64_t transfer_ns = 0;
  std::uint64_t transfer_hidden_ns = 0;
  // Longest chain of dependent tasks, weighted by their durations.
  std::uint64_t critical_path_ns = 0;
  // The summary as Braid prints it.
  std::string text;

  // Share of communication time hidden under computation (0 without any).
  double hidden_share() const noexcept {
    return comm_ns == 0 ? 0.0 : static_cast<double>(comm_hidden_ns) / static_cast<double>(comm_ns);
  }
  // Share of the communication after the waits hidden under computation.
  double transfer_hidden_share() const noexcept {
    return transfer_ns == 0 ? 0.0
                            : static_cast<double>(transfer_hidden_ns) / static_cast<double>(transfer_ns);
  }
  // Number of streams that ran at least one task.
  std::size_t busy_streams() const noexcept {
    std::size_t n = 0;
    for (const auto& s : streams) n += s.tasks > 0 ? 1 : 0;
    return n;
  }
};

inline std::ostream& operator<<(std::ostream& os, const Summary& s) { return os << s.text; }

// Counters of what the scheduler did since the runtime was built
// (Runtime::stats(); braid::Stats in Rust).
struct Stats {
  std::uint64_t tasks = 0;             // tasks submitted (inferred and placed, or memoised)
  std::uint64_t edges = 0;             // dependency edges to unfinished tasks
  std::uint64_t waits = 0;             // cross-stream waits issued
  std::uint64_t elided_waits = 0;      // cross-stream waits implied by an earlier one
  std::uint64_t replays = 0;           // replays of recorded schedules
  std::uint64_t replayed_tasks = 0;    // tasks those replays ran (not in `tasks`)
  std::uint64_t auto_replayed = 0;     // tasks of steps memoised by automatic replay (in `tasks`)
  std::uint64_t auto_divergences = 0;  // memoised steps the program left part-way
  std::uint64_t graph_replays = 0;     // replays run as one unit (CUDA graph launches)
  std::uint64_t inline_tasks = 0;      // tasks run on the submitting thread (in `tasks`)
};

// One task's execution as the profile recorded it.
struct TaskSpan {
  std::uint64_t id = 0;  // submission index
  std::string name;
  TaskKind kind = TaskKind::Compute;
  std::size_t stream = 0;
  std::uint64_t start_ns = 0;  // on a process-wide timeline
  std::uint64_t end_ns = 0;
  bool ok = true;
  std::string scope;  // the scope it was submitted in; empty outside any
};

namespace detail {
inline Summary to_summary(const ffi::SummaryRecord& r) {
  Summary s;
  s.tasks = r.tasks;
  s.wall_ns = r.wall_ns;
  for (const auto& b : r.streams) s.streams.push_back(StreamBusy{std::string(b.name), b.busy_ns, b.tasks});
  s.overlap_ns = r.overlap_ns;
  s.comm_ns = r.comm_ns;
  s.comm_hidden_ns = r.comm_hidden_ns;
  s.comm_wait_ns = r.comm_wait_ns;
  s.transfer_ns = r.transfer_ns;
  s.transfer_hidden_ns = r.transfer_hidden_ns;
  s.critical_path_ns = r.critical_path_ns;
  s.text = std::string(r.text);
  return s;
}

inline std::vector<TaskSpan> to_spans(const rust::Vec<ffi::SpanRecord>& records) {
  std::vector<TaskSpan> out;
  out.reserve(records.size());
  for (const auto& r : records) {
    out.push_back(TaskSpan{r.id, std::string(r.name), r.kind, r.stream, r.start_ns, r.end_ns, r.ok,
                           std::string(r.scope)});
  }
  return out;
}
}  // namespace detail

// A snapshot of the spans a runtime recorded (it outlives the runtime): for
// summaries, and for one trace holding several ranks (braid::write_trace).
class Profile {
 public:
  // No move operations: moving copies, so a moved-from profile stays usable.
  Profile(const Profile& other) : inner_(ffi::clone_profile(*other.inner_)) {}
  Profile& operator=(const Profile& other) {
    if (this != &other) inner_ = ffi::clone_profile(*other.inner_);
    return *this;
  }
  ~Profile() = default;

  // The rank of the runtime it came from (the trace's process).
  std::size_t rank() const noexcept { return inner_->rank(); }
  Summary summary() const { return detail::to_summary(inner_->summary()); }
  std::vector<TaskSpan> spans() const { return detail::to_spans(inner_->spans()); }
  // The spans that started at or after t_ns (braid::now_ns()'s timeline):
  // for example the steps after a warm-up, marked after a synchronize.
  Profile since(std::uint64_t t_ns) const { return Profile(inner_->since(t_ns)); }

  const ffi::Profile& raw() const noexcept { return *inner_; }

 private:
  friend class Runtime;
  explicit Profile(rust::Box<ffi::Profile> inner) : inner_(std::move(inner)) {}
  rust::Box<ffi::Profile> inner_;
};

// Now, in nanoseconds on the process-wide timeline every span is timed on
// (TaskSpan's start and end): a mark to cut a profile with (Profile::since).
inline std::uint64_t now_ns() { return ffi::timeline_now_ns(); }

// Writes the profiles (typically one per rank) as one Chrome trace: one
// process per rank, one track per stream.
inline void write_trace(const std::string& path, const std::vector<Profile>& profiles) {
  rust::Box<ffi::TraceSet> set = ffi::new_trace_set();
  for (const auto& p : profiles) set->add(p.raw());
  detail::call([&] { set->write(path); });
}

class RuntimeBuilder;

// What a schedule's placement trial measured and kept (Schedule::placement_trial).
struct PlacementTrial {
  // False before the trial has decided, and for a schedule without a trial;
  // the rest is 0 then.
  bool decided = false;
  // The median interval between replays on the recorded streams, and on one
  // stream (ns).
  std::uint64_t recorded_ns = 0;
  std::uint64_t one_stream_ns = 0;
  // Whether one stream was kept.
  bool kept_one_stream = false;
};

// A recorded program step (Runtime::record): the tasks it submitted, their
// streams and the cross-stream waits between them, resolved once. replay()
// runs the same tasks again — the same bodies on the same data — with no
// dependency inference and no placement, equivalent bit for bit to submitting
// them again, and composing with tasks submitted before and after it. Values
// that change from step to step live in buffers the tasks read (upload them
// before replaying). A Schedule keeps its runtime's engine alive: it may
// outlive the Runtime object. Destroying the Runtime still waits for every
// task and reports an unreported failure, but while a Schedule lives the
// engine keeps its stream threads (replay() still works), and the trace asked
// for by RuntimeBuilder::trace is written when the last Schedule goes.
class Schedule {
 public:
  Schedule(Schedule&&) noexcept = default;
  Schedule& operator=(Schedule&&) noexcept = default;
  Schedule(const Schedule&) = delete;
  Schedule& operator=(const Schedule&) = delete;
  ~Schedule() = default;

  // Runs the schedule again; returns at once with the handle of the replay's
  // end: waiting on it waits for every task of the replay, and throws
  // braid::Error naming the first task that failed.
  TaskHandle replay() const { return TaskHandle(detail::call([&] { return raw().replay(); })); }
  std::string name() const { return std::string(raw().name()); }
  // Number of recorded tasks.
  std::size_t size() const { return raw().len(); }
  // Streams the current placement uses, and its cross-stream waits per replay.
  std::size_t streams_used() const { return raw().placement_streams(); }
  std::size_t waits_per_replay() const { return raw().placement_waits(); }
  // With RuntimeBuilder::graphs: why this schedule is not replayed as
  // graphs (nothing in it can be captured, or a capture failed); empty when
  // it is, and before its first replay.
  std::string graph_refusal() const { return std::string(raw().graph_refusal()); }
  // With RuntimeBuilder::graph_collectives: why the collectives are not
  // inside the graphs after all (their capture failed, so the graphs are cut
  // around them); empty when they are, or were not asked in.
  std::string graph_collectives_left_out() const {
    return std::string(raw().graph_collectives_left_out());
  }
  // With RuntimeBuilder::graphs, once replayed as graphs: the graphs each
  // replay launches, and the collectives and host tasks it runs between
  // them (a schedule is cut around those: docs/replay.md). Both 0 otherwise.
  std::size_t graphs_per_replay() const { return raw().graph_parts(); }
  std::size_t tasks_between_graphs() const { return raw().graph_tasks_between(); }
  // What the placement trial measured and kept, once decided: the median
  // interval between replays on the recorded streams and on one stream (ns),
  // and whether one stream was kept. `decided` is false before, and for a
  // schedule without a trial (RuntimeBuilder::placement_trial).
  PlacementTrial placement_trial() const {
    const ffi::TrialRecord r = raw().placement_trial();
    return PlacementTrial{r.decided, r.recorded_ns, r.one_stream_ns, r.kept_one_stream};
  }

  // Throws braid::Error for a moved-from Schedule.
  const ffi::Schedule& raw() const { return detail::live(inner_, "Schedule"); }

 private:
  friend class Runtime;
  explicit Schedule(rust::Box<ffi::Schedule> inner) : inner_(std::move(inner)) {}
  rust::Box<ffi::Schedule> inner_;
};

// An open named scope (Runtime::scope; docs/scopes.md): while it lives, every
// task this thread submits to the runtime is tagged with its path (the
// trace's `scope` argument) and placed as the runtime's placement file says
// for it. Scopes nest: the path is the enclosing scopes' joined by '/'.
// Destroying it closes it (and any scope of the same runtime still open
// inside it). It belongs to the thread that opened it: destroy it there (a
// local in a block does); destroyed on another thread it closes nothing.
// It can be moved into a new object (a std::optional, say; the moved-from one
// closes nothing and its path() throws) but not assigned: `s = rt.scope("b")`
// would open "b" inside the scope `s` still holds and then close both.
class Scope {
 public:
  Scope(Scope&&) noexcept = default;
  Scope& operator=(Scope&&) = delete;
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;
  ~Scope() = default;

  // The full path ("forward/layer3"); empty for a scope opened with an empty name.
  std::string path() const { return std::string(detail::live(inner_, "Scope").path()); }

 private:
  friend class Runtime;
  explicit Scope(rust::Box<ffi::Scope> inner) : inner_(std::move(inner)) {}
  rust::Box<ffi::Scope> inner_;
};

// The engine: owns the streams; buffers are allocated from it and tasks
// submitted to it. Several threads may submit at once. Destroying it waits for
// every task and prints a task failure nobody was told of (no synchronize()
// or wait() reported it) to stderr, one line naming the task; then, unless a
// Schedule (or an unsubmitted TaskBuilder) still holds the engine, it stops
// the stream threads and writes the trace, if one was asked for — otherwise
// that happens when the last of those goes. A moved-from Runtime throws
// braid::Error from every method.
class Runtime {
 public:
  // Defaults: auto backend, 2 compute streams, 1 comm stream, affinity placement.
  static RuntimeBuilder builder();
  // The CPU backend with the default settings.
  static Runtime cpu();

  Runtime(Runtime&&) noexcept = default;
  Runtime& operator=(Runtime&&) noexcept = default;
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;
  ~Runtime() = default;

  // "cpu" or "cuda".
  std::string backend_name() const { return detail::str(raw().backend_name()); }
  // Total number of streams (compute, then comm).
  std::size_t streams() const { return raw().streams(); }
  std::size_t compute_streams() const { return raw().compute_streams(); }
  std::size_t rank() const { return raw().rank(); }
  // The priority class: the builder's, or where the builder set none the
  // placement file's `[runtime] class` (docs/tenants.md).
  Class priority_class() const { return raw().priority_class(); }
  // On CUDA with RuntimeBuilder::spare_sms: the SMs its compute kernels
  // never run on, as the driver rounded the request; 0 on the CPU or when
  // none are spared.
  std::uint32_t spared_sms() const { return raw().spared_sms(); }

  // Allocates `bytes` zeroed bytes on the runtime's device.
  Buffer alloc(const std::string& name, std::size_t bytes) const {
    return Buffer(detail::call([&] { return raw().alloc(detail::name(name), bytes); }));
  }
  // Allocates a buffer holding a copy of `data` (the upload is a task).
  template <class T>
  Buffer alloc_from(const std::string& name, const T* data, std::size_t count) const {
    Buffer b = alloc(name, detail::mul(count, sizeof(T)));
    upload(b, data, count);
    return b;
  }
  template <class T>
  Buffer alloc_from(const std::string& name, const std::vector<T>& data) const {
    return alloc_from(name, data.data(), data.size());
  }
  template <class T>
  Buffer alloc_from(const std::string& name, std::initializer_list<T> data) const {
    return alloc_from(name, data.begin(), data.size());
  }

  // Copies `count` Ts into v, whose size must be exactly count * sizeof(T) (a
  // write task: returns at once; the data is copied before it returns).
  template <class T>
  TaskHandle upload(const View& v, const T* data, std::size_t count) const {
    static_assert(std::is_trivially_copyable<T>::value, "braid: element types must be trivially copyable");
    const auto* bytes = reinterpret_cast<const std::uint8_t*>(data);
    rust::Slice<const std::uint8_t> slice(count == 0 ? nullptr : bytes, detail::mul(count, sizeof(T)));
    return TaskHandle(detail::call([&] { return raw().upload(v.raw(), slice); }));
  }
  template <class T>
  TaskHandle upload(const View& v, const std::vector<T>& data) const {
    return upload(v, data.data(), data.size());
  }

  // Reads v back as Ts after every earlier write to it (a synchronisation
  // point for this view only).
  template <class T>
  std::vector<T> read_vec(const View& v) const {
    static_assert(std::is_trivially_copyable<T>::value, "braid: element types must be trivially copyable");
    rust::Vec<std::uint8_t> bytes = detail::call([&] { return raw().read_bytes(v.raw(), sizeof(T)); });
    std::vector<T> out(bytes.size() / sizeof(T));
    if (!out.empty()) std::memcpy(out.data(), bytes.data(), bytes.size());
    return out;
  }

  // Starts a task named `name`.
  TaskBuilder task(std::string name) const { return TaskBuilder(raw(), std::move(name)); }

  // Opens scope `name` ("forward/layer3") inside the scope this thread has
  // open on this runtime, until the returned object is destroyed:
  //   { auto s = rt.scope("forward"); /* tasks tagged forward */ }
  [[nodiscard]] Scope scope(const std::string& name) const {
    return Scope(detail::call([&] { return raw().enter_scope(detail::name(name)); }));
  }
  // The path of the innermost scope this thread has open; empty for none.
  std::string current_scope() const { return std::string(raw().current_scope()); }

  // Waits for every task submitted so far; throws braid::Error naming the
  // failed task(s) if any failed since the last synchronisation point
  // (dependents of a failed task are skipped and not reported separately).
  // The runtime stays usable either way.
  void synchronize() const {
    detail::call([&] { raw().synchronize(); });
  }

  // Runs `program` — which submits tasks to this runtime as usual, and may
  // synchronize — and records every task submitted while it runs. The tasks
  // run now (the recording is the schedule's first run); their bodies are
  // kept and called again by each replay, so they must stay valid and
  // callable as long as the Schedule lives. Throws braid::Error if a
  // recording is already in progress, or with the exception's message if
  // `program` throws (the tasks it submitted still run).
  template <class F>
  Schedule record(const std::string& name, F&& program) const {
    auto fn = std::make_unique<ffi::RecordFn>();
    fn->body = [this, &program] { program(*this); };
    return Schedule(detail::call([&] { return raw().record(detail::name(name), std::move(fn)); }));
  }

  // The summary of the spans recorded so far. Without profiling
  // (RuntimeBuilder::profile or trace) there are none: an empty summary.
  Summary summary() const { return detail::to_summary(raw().summary()); }
  // What the scheduler did so far (counters; profiling need not be on).
  Stats stats() const {
    const ffi::StatsRecord r = raw().stats();
    return Stats{r.tasks,   r.edges,          r.waits,         r.elided_waits,     r.replays,
                 r.replayed_tasks, r.auto_replayed, r.auto_divergences, r.graph_replays, r.inline_tasks};
  }
  // The spans recorded so far, sorted by start time.
  std::vector<TaskSpan> spans() const { return detail::to_spans(raw().spans()); }
  // A snapshot of the spans recorded so far.
  Profile profile() const { return Profile(raw().profile()); }
  // Forgets the spans recorded so far (e.g. after warm-up).
  void clear_profile() const { raw().clear_profile(); }
  // Writes the profile as a Chrome trace (chrome://tracing, Perfetto).
  // Without profiling it holds the streams and no task.
  void write_trace(const std::string& path) const {
    detail::call([&] { raw().write_trace(path); });
  }

  // Throws braid::Error for a moved-from Runtime.
  const ffi::Runtime& raw() const { return detail::live(inner_, "Runtime"); }

 private:
  friend class RuntimeBuilder;
  explicit Runtime(rust::Box<ffi::Runtime> inner) : inner_(std::move(inner)) {}
  rust::Box<ffi::Runtime> inner_;
};

// Configures a Runtime.
class RuntimeBuilder {
 public:
  RuntimeBuilder() : cfg_(ffi::default_config()) {}

  // Which device to drive (default auto); `device` is the CUDA ordinal.
  RuntimeBuilder& backend(BackendKind b, std::size_t device = 0) {
    cfg_.backend = b;
    cfg_.device = device;
    return *this;
  }
  RuntimeBuilder& compute_streams(std::size_t n) {
    cfg_.compute_streams = n;
    return *this;
  }
  RuntimeBuilder& comm_streams(std::size_t n) {
    cfg_.comm_streams = n;
    return *this;
  }
  RuntimeBuilder& policy(Policy p) {
    cfg_.policy = p;
    return *this;
  }
  // How many submitted tasks may be unfinished before submission blocks.
  RuntimeBuilder& launch_window(std::size_t n) {
    cfg_.launch_window = n;
    return *this;
  }
  // Record a span per task (for summary(), spans(), write_trace()).
  RuntimeBuilder& profile(bool on = true) {
    cfg_.profile = on;
    return *this;
  }
  // Record spans and write a Chrome trace to `path` when the runtime is destroyed.
  RuntimeBuilder& trace(const std::string& path) {
    detail::call([&] { cfg_.trace = rust::String(path); });
    cfg_.profile = cfg_.profile || !path.empty();
    return *this;
  }
  // Replays run as one unit: on CUDA a recorded schedule is captured into a
  // CUDA graph at its first replay and launched whole; on the CPU a replay
  // runs its tasks in order on one stream thread (docs/replay.md). Default:
  // on with a CUDA backend (not for a best-effort runtime), off on the CPU.
  RuntimeBuilder& graphs(bool on = true) {
    cfg_.graphs = on ? ffi::Switch::On : ffi::Switch::Off;
    return *this;
  }
  // With graphs, capture the collectives of a recorded schedule into its
  // graphs too (those of its first collective's communication stream),
  // instead of cutting the graphs around them: a data-parallel step is one
  // launch (docs/replay.md, "Collectives inside graphs"). Default: off.
  RuntimeBuilder& graph_collectives(bool on = true) {
    cfg_.graph_collectives = on;
    return *this;
  }
  // The first replays of a recorded schedule whose tasks use several compute
  // streams time its placement against one stream and keep the faster
  // (default: on with a CUDA backend; on the CPU only for replays made
  // tasks; docs/replay.md, "The placement trial").
  RuntimeBuilder& placement_trial(bool on = true) {
    cfg_.placement_trial = on ? ffi::Switch::On : ffi::Switch::Off;
    return *this;
  }
  // Automatic replay (default: on): after a few identical steps (what is
  // submitted between two synchronize() calls; in a row, or repeating with a
  // period of up to 4 steps, as double-buffered data does), the next ones are
  // submitted from the memoised analysis, and a step that diverges goes on
  // eagerly with nothing lost (docs/replay.md). Off: every task is inferred
  // and placed as it comes.
  RuntimeBuilder& auto_replay(bool on = true) {
    cfg_.auto_replay = on;
    return *this;
  }
  // CPU: a short task (measured under braid's INLINE_MAX_NS, its
  // predecessors done, its stream idle) runs on the submitting thread inside
  // the call that submits it (default: on; docs/engine.md). Off: every body
  // runs on its stream's thread, for bodies that care which thread runs them.
  RuntimeBuilder& inline_short_tasks(bool on = true) {
    cfg_.inline_short_tasks = on;
    return *this;
  }
  // The CPU cores the process may use, as this runtime counts them (default:
  // BRAID_CPU_CORES when set, else the cores detected; 0 restores that). The
  // CPU runtimes alive in the process share them: under Policy::Affinity a
  // runtime places compute tasks on its share of its compute streams only,
  // so compute_streams(4) on a 2-core machine runs at most 2 at once.
  // Communication streams are not counted; CUDA runtimes ignore it.
  RuntimeBuilder& cpu_cores(std::size_t n) {
    cfg_.cpu_cores = n;
    return *this;
  }
  // Let Policy::Affinity use every compute stream whatever the core budget
  // (default off). The runtime still counts against the budget.
  RuntimeBuilder& oversubscribe(bool on = true) {
    cfg_.oversubscribe = on;
    return *this;
  }
  // The rank this runtime plays in a data-parallel job (the trace's process).
  RuntimeBuilder& rank(std::size_t r) {
    cfg_.rank = r;
    return *this;
  }
  // A placement file (TOML, docs/scopes.md) mapping scope patterns to
  // streams, priorities, policies, bundles and replay; read when the runtime
  // is built, and build() throws naming its line if it is malformed. Without
  // it the file named by BRAID_PLACEMENT, if set, is used.
  RuntimeBuilder& placement_file(const std::string& path) {
    detail::call([&] { cfg_.placement = rust::String(path); });
    return *this;
  }
  // The program's priority class among the runtimes of the process
  // (docs/tenants.md): while a LatencyCritical runtime has unfinished tasks,
  // BestEffort runtimes start none; BestEffort CPU threads run at the OS's
  // idle priority. Default: a placement file's [runtime] class, else Normal;
  // a class set here wins over the file's.
  RuntimeBuilder& priority_class(Class c) {
    cfg_.tenant_class = c;
    cfg_.tenant_class_set = true;
    return *this;
  }
  // A LatencyCritical runtime's threads (its stream threads, and every
  // thread that submits to it or waits on it) ask the OS for a real-time
  // policy (Linux SCHED_FIFO, priority 1); where it refuses (no
  // CAP_SYS_NICE, RLIMIT_RTPRIO 0) they keep the default and a warning says
  // so once. build() throws for other classes. Default off; docs/tenants.md.
  RuntimeBuilder& realtime(bool on = true) {
    cfg_.realtime = on;
    return *this;
  }
  // On CUDA, leave `n` of the device's SMs to the other programs on it: the
  // compute streams are made in a green context over the rest (the driver
  // rounds `n` up to its partition size; Runtime::spared_sms() says how many
  // were left). For a BestEffort runtime beside a LatencyCritical one.
  // Ignored on the CPU; build() throws where the driver has no green
  // contexts. Default 0; docs/tenants.md.
  RuntimeBuilder& spare_sms(std::uint32_t n) {
    cfg_.spare_sms = n;
    return *this;
  }
  // On CUDA, for a BestEffort runtime: how much device time of launched,
  // unfinished kernels each stream keeps at most (its launch window; a
  // LatencyCritical kernel can find that much best-effort work ahead of it).
  // Smaller leaves it less and the best-effort runtime more gaps between
  // launches. Ignored by other classes and on the CPU; build() throws for
  // zero. Default 1 ms; docs/tenants.md.
  RuntimeBuilder& device_bundle(std::chrono::microseconds window) {
    cfg_.device_bundle_us = static_cast<std::int64_t>(window.count());
    return *this;
  }
  // Serves the live view (`braid top --attach SOCKET`) on this local socket;
  // `{rank}` is replaced by the rank. Turns profiling on. Without it,
  // BRAID_LIVE, if set.
  RuntimeBuilder& live(const std::string& socket) {
    detail::call([&] { cfg_.live = rust::String(socket); });
    return *this;
  }

  // Starts the runtime's stream threads. Throws braid::Error for an unusable
  // configuration or an unavailable backend.
  Runtime build() const {
    return Runtime(detail::call([&] { return ffi::new_runtime(cfg_); }));
  }

 private:
  ffi::RuntimeConfig cfg_;
};

inline RuntimeBuilder Runtime::builder() { return RuntimeBuilder(); }
inline Runtime Runtime::cpu() { return builder().backend(BackendKind::Cpu).build(); }

// ---- communication ---------------------------------------------------------------

using ReduceOp = ffi::ReduceOp;  // Sum, Avg, Max, Min
using DType = ffi::DType;        // F32, F64, I32, Bf16

// A bfloat16 value as its bit pattern (the upper half of a float).
struct Bf16 {
  std::uint16_t bits = 0;
};

// The collective element type of T: float, double, std::int32_t or braid::Bf16.
template <class T>
struct dtype_of;
template <>
struct dtype_of<float> {
  static constexpr DType value = DType::F32;
};
template <>
struct dtype_of<double> {
  static constexpr DType value = DType::F64;
};
template <>
struct dtype_of<std::int32_t> {
  static constexpr DType value = DType::I32;
};
template <>
struct dtype_of<Bf16> {
  static constexpr DType value = DType::Bf16;
};

// A communicator: submits collectives as tasks of a runtime. A collective
// declares its accesses like any task (so it runs after the tasks that write
// its input and before those that read its output) and runs on the
// communicator's comm stream. Every rank must submit the same collectives in
// the same order. A failed collective poisons the communicator: later ones
// fail fast, on every rank. Copies share the collective numbering.
class Communicator {
 public:
  // No move operations: moving copies, so a moved-from communicator stays usable.
  Communicator(const Communicator& other) : inner_(ffi::clone_comm(*other.inner_)) {}
  Communicator& operator=(const Communicator& other) {
    if (this != &other) inner_ = ffi::clone_comm(*other.inner_);
    return *this;
  }
  ~Communicator() = default;

  std::size_t rank() const noexcept { return inner_->rank(); }
  std::size_t world_size() const noexcept { return inner_->world_size(); }
  // The comm stream (of each rank's runtime) its collectives run on.
  std::size_t comm_stream() const noexcept { return inner_->comm_stream(); }
  // "local" (CPU ranks) or "nccl".
  std::string backend() const { return std::string(inner_->backend()); }
  // Collectives submitted so far.
  std::uint64_t issued() const noexcept { return inner_->issued(); }
  // Why the communicator is poisoned; empty when it is not.
  std::string poisoned() const { return std::string(inner_->poisoned()); }
  // Gives up: pending and later collectives fail on every rank. Invalid
  // UTF-8 in `reason` is replaced (an abort must not fail on its message).
  void abort(const std::string& reason) const {
    detail::call([&] { inner_->abort(detail::name(reason)); });
  }

  // In-place all-reduce of the Ts of v.
  template <class T>
  TaskHandle all_reduce(const Runtime& rt, const View& v, ReduceOp op = ReduceOp::Sum,
                        const std::string& name = "") const {
    return in_place(rt, spec<T>(ffi::CollectiveKind::AllReduce, op, 0, name), v);
  }
  // All-reduce of send into recv (same element count, not overlapping).
  template <class T>
  TaskHandle all_reduce_into(const Runtime& rt, const View& send, const View& recv, ReduceOp op = ReduceOp::Sum,
                             const std::string& name = "") const {
    return out_of_place(rt, spec<T>(ffi::CollectiveKind::AllReduce, op, 0, name), send, recv);
  }
  // In-place reduce-scatter: v holds count * world Ts; rank r's reduced chunk
  // lands in chunk r of v.
  template <class T>
  TaskHandle reduce_scatter(const Runtime& rt, const View& v, ReduceOp op = ReduceOp::Sum,
                            const std::string& name = "") const {
    return in_place(rt, spec<T>(ffi::CollectiveKind::ReduceScatter, op, 0, name), v);
  }
  // Reduce-scatter of send (count * world Ts) into recv (count Ts).
  template <class T>
  TaskHandle reduce_scatter_into(const Runtime& rt, const View& send, const View& recv, ReduceOp op = ReduceOp::Sum,
                                 const std::string& name = "") const {
    return out_of_place(rt, spec<T>(ffi::CollectiveKind::ReduceScatter, op, 0, name), send, recv);
  }
  // In-place all-gather: v holds count * world Ts; rank r contributes chunk r.
  template <class T>
  TaskHandle all_gather(const Runtime& rt, const View& v, const std::string& name = "") const {
    return in_place(rt, spec<T>(ffi::CollectiveKind::AllGather, ReduceOp::Sum, 0, name), v);
  }
  // All-gather of send (count Ts) into recv (count * world Ts, in rank order).
  template <class T>
  TaskHandle all_gather_into(const Runtime& rt, const View& send, const View& recv, const std::string& name = "") const {
    return out_of_place(rt, spec<T>(ffi::CollectiveKind::AllGather, ReduceOp::Sum, 0, name), send, recv);
  }
  // In-place broadcast of root's v to every rank's v.
  template <class T>
  TaskHandle broadcast(const Runtime& rt, const View& v, std::size_t root, const std::string& name = "") const {
    return in_place(rt, spec<T>(ffi::CollectiveKind::Broadcast, ReduceOp::Sum, root, name), v);
  }
  // Broadcast of root's send into every rank's recv.
  template <class T>
  TaskHandle broadcast_into(const Runtime& rt, const View& send, const View& recv, std::size_t root,
                            const std::string& name = "") const {
    return out_of_place(rt, spec<T>(ffi::CollectiveKind::Broadcast, ReduceOp::Sum, root, name), send, recv);
  }
  // Completes on each rank once every rank has reached it.
  TaskHandle barrier(const Runtime& rt, const std::string& name = "") const {
    return TaskHandle(detail::call([&] { return inner_->barrier(rt.raw(), detail::name(name)); }));
  }
  // Makes every rank re-place the recorded schedule `s` (recorded on `rt`)
  // alike: the ranks agree on each task's measured duration (the maximum)
  // and the usable compute streams (the minimum), and the next replay
  // re-places from those. Collective: call it on every rank at the same
  // point, after the recording ran and before the first replay. Ranks whose
  // schedules differ keep the recorded placement. Waits for the agreement.
  void agree_placement(const Runtime& rt, const Schedule& s) const {
    detail::call([&] { inner_->agree_placement(rt.raw(), s.raw()); });
  }

  const ffi::Comm& raw() const noexcept { return *inner_; }

 private:
  friend std::vector<Communicator> local_group(std::size_t, std::chrono::milliseconds, std::size_t);
  friend std::vector<std::string> try_launch(std::size_t, std::function<void(std::size_t, Communicator&)>,
                                             std::chrono::milliseconds, std::size_t);
  explicit Communicator(rust::Box<ffi::Comm> inner) : inner_(std::move(inner)) {}

  template <class T>
  static ffi::CollectiveSpec spec(ffi::CollectiveKind kind, ReduceOp op, std::size_t root, const std::string& name) {
    ffi::CollectiveSpec s;
    s.kind = kind;
    s.op = op;
    s.root = root;
    s.dtype = dtype_of<T>::value;
    s.name = detail::name(name);
    return s;
  }
  TaskHandle in_place(const Runtime& rt, const ffi::CollectiveSpec& s, const View& v) const {
    return TaskHandle(detail::call([&] { return inner_->submit_in_place(rt.raw(), s, v.raw()); }));
  }
  TaskHandle out_of_place(const Runtime& rt, const ffi::CollectiveSpec& s, const View& send, const View& recv) const {
    return TaskHandle(detail::call([&] { return inner_->submit_out_of_place(rt.raw(), s, send.raw(), recv.raw()); }));
  }

  rust::Box<ffi::Comm> inner_;
};

// A rank's function for braid::launch.
using RankBody = std::function<void(std::size_t rank, Communicator& comm)>;

// Default time a rank waits for the others at one step of a collective.
constexpr std::chrono::milliseconds kDefaultCommTimeout{60000};

// Runs `body(rank, comm)` on `world_size` CPU rank threads of this process, one
// communicator each (ranks share memory; collectives use a chunked ring), and
// joins them. Returns each rank's error message, empty for a rank that
// succeeded. `body` is called concurrently from every rank thread. A rank
// usually builds its own Runtime with .rank(rank); the runtime must be
// destroyed (or synchronized) before `body` returns. Failure is whole-job, as
// with torchrun: when one rank fails, ranks waiting for it fail too.
inline std::vector<std::string> try_launch(std::size_t world_size, RankBody body,
                                           std::chrono::milliseconds timeout = kDefaultCommTimeout,
                                           std::size_t comm_stream = 0) {
  if (!body) throw Error("braid::launch was given an empty rank function");
  auto fn = std::make_unique<ffi::RankFn>();
  fn->body = [f = std::move(body)](std::size_t rank, const ffi::Comm& c) {
    Communicator comm(ffi::clone_comm(c));
    f(rank, comm);
  };
  rust::Vec<ffi::RankOutcome> outcomes = detail::call([&] {
    return ffi::launch_local(world_size, static_cast<std::uint64_t>(timeout.count() < 0 ? 0 : timeout.count()),
                             comm_stream, std::move(fn));
  });
  std::vector<std::string> errors;
  for (const auto& o : outcomes) errors.push_back(o.ok ? std::string() : std::string(o.error));
  return errors;
}

// try_launch that throws braid::Error naming every failed rank.
inline void launch(std::size_t world_size, RankBody body, std::chrono::milliseconds timeout = kDefaultCommTimeout,
                   std::size_t comm_stream = 0) {
  std::vector<std::string> errors = try_launch(world_size, std::move(body), timeout, comm_stream);
  std::string message;
  std::size_t failed = 0;
  for (std::size_t r = 0; r < errors.size(); ++r) {
    if (errors[r].empty()) continue;
    message += (failed++ == 0 ? "" : "; ") + ("rank " + std::to_string(r) + ": " + errors[r]);
  }
  if (failed > 0) throw Error(std::to_string(failed) + " of " + std::to_string(world_size) + " ranks failed: " + message);
}

// The communicators of a group of CPU ranks, in rank order, for programs that
// start their rank threads themselves (braid::launch does it for you, and also
// makes the others fail at once when one rank's function ends early; here they
// wait for the timeout).
inline std::vector<Communicator> local_group(std::size_t world_size,
                                             std::chrono::milliseconds timeout = kDefaultCommTimeout,
                                             std::size_t comm_stream = 0) {
  rust::Box<ffi::CommGroup> group = detail::call([&] {
    return ffi::local_group(world_size, static_cast<std::uint64_t>(timeout.count() < 0 ? 0 : timeout.count()),
                            comm_stream);
  });
  std::vector<Communicator> out;
  for (std::size_t r = 0; r < world_size; ++r) out.push_back(Communicator(detail::call([&] { return group->take(r); })));
  return out;
}

}  // namespace braid

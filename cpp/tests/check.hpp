// A tiny check macro set for Braid's C++ tests: no framework to download.
// A failed check prints where and why, then exits with status 1, so ctest
// sees the failure; a test binary prints "N passed, 0 failed" at the end.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <sstream>
#include <string>

#include "braid/braid.hpp"

namespace check {

[[noreturn]] inline void fail(const char* file, int line, const std::string& what) {
  std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", file, line, what.c_str());
  std::fflush(stderr);
  std::exit(1);
}

// A value as text, for failure messages.
template <class T>
std::string show(const T& v) {
  std::ostringstream os;
  os << v;
  return os.str();
}

inline bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

// Runs `f`, which must throw braid::Error; returns its message.
template <class F>
std::string error_of(F&& f, const char* file, int line, const char* expr) {
  try {
    f();
  } catch (const braid::Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    fail(file, line, std::string(expr) + " threw a non-braid exception: " + e.what());
  }
  fail(file, line, std::string(expr) + " did not throw");
}

struct Runner {
  int passed = 0;
  template <class F>
  void run(const char* name, F&& f) {
    std::printf("test %s ... ", name);
    std::fflush(stdout);
    try {
      f();
    } catch (const std::exception& e) {
      std::printf("FAILED\n");
      std::fprintf(stderr, "test %s threw: %s\n", name, e.what());
      std::exit(1);
    }
    std::printf("ok\n");
    ++passed;
  }
  int finish() const {
    std::printf("%d passed, 0 failed\n", passed);
    return 0;
  }
};

}  // namespace check

#define CHECK(cond)                                                  \
  do {                                                               \
    if (!(cond)) ::check::fail(__FILE__, __LINE__, #cond);           \
  } while (0)

#define CHECK_MSG(cond, msg)                                                          \
  do {                                                                                \
    if (!(cond)) ::check::fail(__FILE__, __LINE__, std::string(#cond) + ": " + (msg)); \
  } while (0)

#define CHECK_EQ(a, b)                                                                         \
  do {                                                                                         \
    const auto& check_a_ = (a);                                                                \
    const auto& check_b_ = (b);                                                                \
    if (!(check_a_ == check_b_))                                                               \
      ::check::fail(__FILE__, __LINE__,                                                        \
                    std::string(#a " == " #b ": ") + ::check::show(check_a_) + " != " +        \
                        ::check::show(check_b_));                                              \
  } while (0)

// The braid::Error message thrown by `expr` (fails the test if none is thrown).
#define ERROR_OF(expr) ::check::error_of([&] { (void)(expr); }, __FILE__, __LINE__, #expr)

#define CHECK_CONTAINS(text, needle)                                                       \
  do {                                                                                     \
    const std::string check_t_ = (text);                                                   \
    const std::string check_n_ = (needle);                                                 \
    if (!::check::contains(check_t_, check_n_))                                            \
      ::check::fail(__FILE__, __LINE__, "`" + check_t_ + "` does not contain `" + check_n_ + "`"); \
  } while (0)

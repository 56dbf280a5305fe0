#pragma once
// Errors are part of glmtune's interface: every failure a user can cause says what went wrong,
// where (file, key, line, flag) and how to fix it.

#include <stdexcept>
#include <string>

namespace glmtune {

class Error : public std::runtime_error {
 public:
  // `where`: the file / key / line / flag at fault; `fix`: what the user should do. Either may be
  // empty when there is nothing useful to say.
  Error(std::string what, std::string where = {}, std::string fix = {});

  const std::string& problem() const { return what_; }
  const std::string& where() const { return where_; }
  const std::string& fix() const { return fix_; }

 private:
  std::string what_, where_, fix_;
};

// A broken internal invariant: a bug in glmtune, not in the user's input.
class InternalError : public std::logic_error {
 public:
  using std::logic_error::logic_error;
};

[[noreturn]] void throw_internal(const char* file, int line, const std::string& message);

}  // namespace glmtune

// Internal invariant check; failures point at glmtune's source, not at user input. Not available
// in CUDA translation units: nvcc cannot compile the fmt headers.
#if !defined(__CUDACC__)
#include <fmt/format.h>
#define GLMTUNE_ASSERT(cond, ...)                                                               \
  do {                                                                                          \
    if (!(cond))                                                                                \
      ::glmtune::throw_internal(__FILE__, __LINE__,                                             \
                                "assertion `" #cond "` failed: " + ::fmt::format(__VA_ARGS__)); \
  } while (0)
#endif

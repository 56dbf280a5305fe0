#pragma once
// Shared by the fuzz targets: how a broken invariant is reported, where the bundled inputs live,
// and a file that holds the current input for parsers that read from a path.

#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#ifndef GLMTUNE_SOURCE_DIR
#error "GLMTUNE_SOURCE_DIR must name the repository root (tests/fuzz/CMakeLists.txt sets it)"
#endif

namespace glmtune::fuzz {

// A broken invariant: says which and aborts, so that libFuzzer (or the replay test) reports the
// input as a crash.
[[noreturn]] inline void bug(const char* what) {
  std::fprintf(stderr, "fuzz invariant broken: %s\n", what);
  std::fflush(stderr);
  std::abort();
}

inline std::string source_path(const std::string& relative) {
  return std::string(GLMTUNE_SOURCE_DIR) + "/" + relative;
}

// An in-memory file (memfd) rewritten with every input; path() opens it afresh like any file, so
// the parser under test reads it through its ordinary open / read / mmap path.
class InputFile {
 public:
  InputFile() : fd_(memfd_create("glmtune-fuzz-input", 0)) {
    if (fd_ < 0) bug("memfd_create failed");
    path_ = "/proc/self/fd/" + std::to_string(fd_);
  }
  ~InputFile() { close(fd_); }
  InputFile(const InputFile&) = delete;
  InputFile& operator=(const InputFile&) = delete;

  void write(const uint8_t* data, size_t size) {
    if (ftruncate(fd_, 0) != 0) bug("ftruncate failed");
    size_t done = 0;
    while (done < size) {
      ssize_t n = pwrite(fd_, data + done, size - done, off_t(done));
      if (n <= 0) bug("pwrite failed");
      done += size_t(n);
    }
  }
  const std::string& path() const { return path_; }

 private:
  int fd_;
  std::string path_;
};

}  // namespace glmtune::fuzz

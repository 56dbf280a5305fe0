#pragma once
// The glmtune binary run as a user runs it, for the CLI tests (GLMTUNE_BINARY is defined per test
// target in tests/CMakeLists.txt).

#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <string>

#include "temp_dir.h"

namespace glmtune::test {

struct CliResult {
  int code;         // exit status, -1 when killed by a signal
  std::string out;  // stdout (stdout and stderr together when no error file is given)
  std::string err;  // stderr
};

// Runs `glmtune <args>` through the shell (so `< file` works). stderr goes to `err_file` and is
// read back, or, with no file, into `out`.
inline CliResult run_glmtune(const std::string& args, const std::filesystem::path& err_file = {}) {
  const std::string cmd = std::string(GLMTUNE_BINARY) + " " + args +
                          (err_file.empty() ? " 2>&1" : " 2>" + err_file.string());
  FILE* pipe = popen(cmd.c_str(), "r");
  std::string out;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), pipe)) > 0) out.append(buf.data(), n);
  const int status = pclose(pipe);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out,
          err_file.empty() ? std::string() : read_text(err_file)};
}

}  // namespace glmtune::test

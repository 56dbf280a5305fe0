// glmtune under an address-space limit (`ulimit -v`, common on clusters). OpenBLAS maps a GEMM
// buffer per thread and retries a refused mapping forever, so a limit too small for the buffers
// must end the run at once with an error saying how far to raise it (or how many BLAS threads
// fit), and a limit large enough must let the run through. Every run is killed after 300 s, so
// that a regression (a spinning process) fails the test instead of outliving it.

#include <gtest/gtest.h>
#include <sys/prctl.h>
#include <sys/wait.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <regex>
#include <string>

#include "support/temp_dir.h"

namespace {

namespace fs = std::filesystem;
using glmtune::test::TempDir;

const fs::path kTokenizer = fs::path(GLMTUNE_SOURCE_DIR) / "examples" / "tiny" / "tokenizer";

struct Result {
  int code = -1;
  std::string output;  // stdout and stderr
};

// `glmtune args` with `env` (VAR=value ...) under `ulimit -v kib` (0: no limit).
Result run(const TempDir& dir, uint64_t kib, const std::string& env, const std::string& args) {
  const fs::path out = dir / "output.txt";
  const std::string limit = kib > 0 ? "ulimit -v " + std::to_string(kib) + " && " : "";
  const std::string cmd = "timeout -s KILL 300 env " + env + " bash -c '" + limit + "exec " +
                          GLMTUNE_BINARY + " " + args + "' > " + out.string() + " 2>&1";
  const int status = std::system(cmd.c_str());
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, glmtune::test::read_text(out)};
}

#define EXPECT_CONTAINS(text, part) EXPECT_NE((text).find(part), std::string::npos) << (text)

TEST(BlasAddressSpace, TooSmallALimitIsAnErrorNotASpin) {
#if !defined(__x86_64__) && !defined(__aarch64__)
  GTEST_SKIP() << "the buffer probe needs seccomp on x86-64 or AArch64";
#endif
  if (prctl(PR_GET_SECCOMP, 0, 0, 0, 0) < 0) GTEST_SKIP() << "seccomp is not available";
  TempDir dir("blas-limit");
  const std::string model = (dir / "model").string();
  ASSERT_EQ(
      run(dir, 0, "",
          "init --preset tiny --seed 1 --out " + model + " --tokenizer " + kTokenizer.string())
          .code,
      0);
  const std::string eval = "eval --model " + model + " --text \"A line of text to score.\"";

  // A limit far above the need: the run goes through and says what the buffers take.
  const Result roomy = run(dir, uint64_t(1) << 30, "", "-v " + eval);
  ASSERT_EQ(roomy.code, 0) << roomy.output;
  std::smatch m;
  const std::regex sizes(R"((\d+) KiB at start, (\d+) BLAS thread\(s\) of (\d+) KiB buffers)");
  ASSERT_TRUE(std::regex_search(roomy.output, m, sizes)) << roomy.output;
  const uint64_t base = std::stoull(m[1]), threads = std::stoull(m[2]), buffer = std::stoull(m[3]);
  ASSERT_GT(buffer, 0u);

  // Half a buffer short of every thread's: an error naming the limit, OpenBLAS and the fix.
  const uint64_t short_limit = base + threads * buffer - buffer / 2;
  const Result refused = run(dir, short_limit, "", eval);
  EXPECT_EQ(refused.code, 2) << refused.output;
  EXPECT_CONTAINS(refused.output, "address-space limit of " + std::to_string(short_limit) + " KiB");
  EXPECT_CONTAINS(refused.output, "OpenBLAS");
  std::smatch at_least;
  ASSERT_TRUE(std::regex_search(refused.output, at_least, std::regex(R"(ulimit -v (\d+))")))
      << refused.output;
  EXPECT_GT(std::stoull(at_least[1]), short_limit);

  // Fewer BLAS threads fit under the same limit: the error says how many, and with them the
  // buffers are no longer what stops the run.
  if (threads >= 2) {
    std::smatch fewer;
    ASSERT_TRUE(
        std::regex_search(refused.output, fewer, std::regex(R"(OPENBLAS_NUM_THREADS=(\d+))")))
        << refused.output;
    const Result with_fewer = run(dir, short_limit, "OPENBLAS_NUM_THREADS=" + fewer[1].str(), eval);
    EXPECT_EQ(with_fewer.output.find("OpenBLAS"), std::string::npos) << with_fewer.output;
    EXPECT_NE(with_fewer.code, -1) << "killed: " << with_fewer.output;
  }
}

}  // namespace

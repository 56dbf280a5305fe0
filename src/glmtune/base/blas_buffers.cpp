#include "glmtune/base/blas_buffers.h"

#include <cblas.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <signal.h>
#include <spawn.h>
#include <spdlog/spdlog.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "glmtune/base/error.h"

extern char** environ;

namespace glmtune {
namespace {

constexpr uint64_t kMiB = uint64_t(1) << 20;

#if defined(__x86_64__)
constexpr uint32_t kAuditArch = AUDIT_ARCH_X86_64;
#elif defined(__aarch64__)
constexpr uint32_t kAuditArch = AUDIT_ARCH_AARCH64;
#else
constexpr uint32_t kAuditArch = 0;  // no probe: the check is skipped
#endif

// What RLIMIT_AS counts: the process's total mapped size (VmSize).
uint64_t mapped_bytes() {
  std::FILE* f = std::fopen("/proc/self/statm", "r");
  unsigned long pages = 0;
  if (f != nullptr) {
    if (std::fscanf(f, "%lu", &pages) != 1) pages = 0;
    std::fclose(f);
  }
  return uint64_t(pages) * uint64_t(sysconf(_SC_PAGESIZE));
}

uint64_t kib(uint64_t bytes) { return (bytes + 1023) / 1024; }

// One SGEMM on OpenBLAS's buffered path (not its small-matrix kernels), which maps the calling
// thread's buffer on first use.
void warm_gemm() {
  constexpr int n = 256;
  std::vector<float> a(n * n, 0.0f), b(n * n, 0.0f), c(n * n, 0.0f);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, a.data(), n, b.data(), n,
              0.0f, c.data(), n);
}

// Async-signal-safe: writes "trap <MiB>\n" to stdout and ends the helper.
void on_sigsys(int, siginfo_t* info, void*) {
  char text[32] = "trap ";
  char digits[16];
  unsigned value = unsigned(info->si_errno), len = 0;
  do {
    digits[len++] = char('0' + value % 10);
    value /= 10;
  } while (value != 0 && len < sizeof(digits));
  size_t at = 5;
  while (len > 0) text[at++] = digits[--len];
  text[at++] = '\n';
  const ssize_t ignored = write(STDOUT_FILENO, text, at);
  (void)ignored;
  _exit(0);
}

// Turns an mmap of more than `room` bytes (one that RLIMIT_AS refuses, and that OpenBLAS would
// retry forever) into SIGSYS carrying the length in MiB, rounded up (0xffff: 4 GiB or more).
bool trap_large_mmaps(uint64_t room) {
  if (kAuditArch == 0) return false;
  const uint32_t room_low = uint32_t(std::min<uint64_t>(room, 0xffffffffu));
  sock_filter filter[] = {
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, arch)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, kAuditArch, 1, 0),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, nr)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_mmap, 1, 0),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
      // The length's high word (little-endian): any bit set is 4 GiB or more.
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, args[1]) + 4),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, 0, 1, 0),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_TRAP | 0xffff),
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, args[1])),
      BPF_JUMP(BPF_JMP | BPF_JGT | BPF_K, room_low, 1, 0),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
      BPF_STMT(BPF_ALU | BPF_RSH | BPF_K, 20),
      BPF_STMT(BPF_ALU | BPF_ADD | BPF_K, 1),
      BPF_STMT(BPF_ALU | BPF_OR | BPF_K, SECCOMP_RET_TRAP),
      BPF_STMT(BPF_RET | BPF_A, 0),
  };
  sock_fprog program{static_cast<unsigned short>(sizeof(filter) / sizeof(filter[0])), filter};
  struct sigaction action {};
  action.sa_sigaction = on_sigsys;
  action.sa_flags = SA_SIGINFO;
  if (sigaction(SIGSYS, &action, nullptr) != 0) return false;
  if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) return false;
  return syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, 0, &program) == 0;
}

struct Probe {
  enum class Result { kFits, kTooLarge, kUnknown } result = Result::kUnknown;
  uint64_t base_bytes = 0;    // mapped at the helper's start: the program without BLAS buffers
  uint64_t buffer_bytes = 0;  // one OpenBLAS buffer as mapped (kFits) or asked for (kTooLarge)
};

// Runs this program as the helper. posix_spawn, not fork: fork's handlers would stop OpenBLAS's
// workers and wait for any stuck retrying its mapping.
Probe run_probe() {
  Probe probe;
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) return probe;
  std::vector<std::string> env = {std::string(kBlasProbeVariable) + "=1", "OPENBLAS_NUM_THREADS=1"};
  for (char** e = environ; *e != nullptr; ++e)
    if (!std::string_view(*e).starts_with("OPENBLAS_NUM_THREADS=") &&
        !std::string_view(*e).starts_with(std::string(kBlasProbeVariable) + "="))
      env.emplace_back(*e);
  std::vector<char*> envp;
  for (std::string& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);
  char self[] = "/proc/self/exe";
  char* argv[] = {self, nullptr};
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, fds[1], STDOUT_FILENO);
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, self, &actions, nullptr, argv, envp.data());
  posix_spawn_file_actions_destroy(&actions);
  close(fds[1]);
  std::string text;
  if (rc == 0) {
    char buf[128];
    for (ssize_t n; (n = read(fds[0], buf, sizeof(buf))) != 0;) {
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) break;
      text.append(buf, size_t(n));
    }
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
  }
  close(fds[0]);
  unsigned long long base = 0, value = 0;
  if (std::sscanf(text.c_str(), "base %llu fits %llu", &base, &value) == 2 && value > 0) {
    probe.result = Probe::Result::kFits;
    probe.buffer_bytes = value;
  } else if (std::sscanf(text.c_str(), "base %llu\ntrap %llu", &base, &value) == 2) {
    probe.result = Probe::Result::kTooLarge;
    probe.buffer_bytes = value * kMiB;
  }
  probe.base_bytes = base;
  return probe;
}

uint64_t thread_stack_bytes() {
  rlimit stack{};
  // glibc's default thread stack is RLIMIT_STACK (2 MiB when that is unlimited), plus a guard.
  if (getrlimit(RLIMIT_STACK, &stack) != 0 || stack.rlim_cur == RLIM_INFINITY)
    return 2 * kMiB + 4096;
  return uint64_t(stack.rlim_cur) + 4096;
}

}  // namespace

int blas_probe_main() {
  rlimit as{};
  if (getrlimit(RLIMIT_AS, &as) != 0 || as.rlim_cur == RLIM_INFINITY) return 1;
  const uint64_t base = mapped_bytes();
  std::printf("base %llu\n", (unsigned long long)base);
  std::fflush(stdout);
  // The GEMM's operands first; then a MiB below the exact room, so that small mappings made on the
  // way (malloc) cannot turn a refused buffer into an untrapped failure.
  constexpr int n = 256;
  std::vector<float> a(n * n, 0.0f), b(n * n, 0.0f), c(n * n, 0.0f);
  const uint64_t before = mapped_bytes();
  const uint64_t room = as.rlim_cur > before + kMiB ? as.rlim_cur - before - kMiB : 0;
  if (!trap_large_mmaps(room)) return 1;
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, a.data(), n, b.data(), n,
              0.0f, c.data(), n);
  std::printf("fits %llu\n", (unsigned long long)(mapped_bytes() - before));
  std::fflush(stdout);
  return 0;
}

void prepare_blas_buffers() {
  rlimit as{};
  if (getrlimit(RLIMIT_AS, &as) != 0 || as.rlim_cur == RLIM_INFINITY) return;
  const uint64_t limit = as.rlim_cur;
  const int threads = std::max(1, openblas_get_num_threads());
  const Probe probe = run_probe();
  if (probe.result == Probe::Result::kUnknown) {
    spdlog::debug("address-space limit of {} KiB: OpenBLAS's buffers could not be measured",
                  kib(limit));
    return;
  }
  // The program, every thread's buffer, the workers' stacks and a few MiB of small mappings.
  const uint64_t per_thread = probe.buffer_bytes;
  const uint64_t extra = 4 * kMiB;
  const uint64_t need = probe.base_bytes + uint64_t(threads) * per_thread +
                        uint64_t(threads - 1) * thread_stack_bytes() + extra;
  if (probe.result == Probe::Result::kFits && need <= limit) {
    warm_gemm();
    spdlog::debug(
        "address-space limit of {} KiB: {} KiB at start, {} BLAS thread(s) of {} KiB buffers, "
        "{} KiB mapped now",
        kib(limit), kib(probe.base_bytes), threads, kib(per_thread), kib(mapped_bytes()));
    return;
  }
  const uint64_t room = limit > probe.base_bytes + extra ? limit - probe.base_bytes - extra : 0;
  const uint64_t fit = (room + thread_stack_bytes()) / (per_thread + thread_stack_bytes());
  std::string fix = fmt::format(
      "raise the limit to at least {0} KiB (ulimit -v {0}; the model and the data need more on "
      "top)",
      kib(need));
  if (fit >= 1) fix += fmt::format(", or run fewer BLAS threads: OPENBLAS_NUM_THREADS={}", fit);
  throw Error(fmt::format("the address-space limit of {} KiB is too small for OpenBLAS's GEMM "
                          "buffers: the program maps {} KiB and each of its {} BLAS thread(s) "
                          "a {} KiB buffer, which OpenBLAS would retry forever instead of failing",
                          kib(limit), kib(probe.base_bytes), threads, kib(per_thread)),
              "ulimit -v (RLIMIT_AS)", fix);
}

}  // namespace glmtune

// A distributed job with one faulty rank, for the fault tests (CMakeLists.txt): rank 1 either
// dies (`kill`: SIGKILL) or hangs (`hang`: never reaches the collective) while the others enter
// an all-reduce bounded by `timeout_s`. The job must end non-zero on every rank with a message.
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

#include "glmtune/dist/parallel.h"

int main(int argc, char** argv) {
  using namespace glmtune;
  if (argc != 3) {
    std::fprintf(stderr, "usage: dist_fault kill|hang TIMEOUT_S\n");
    return 64;
  }
  const std::string mode = argv[1];
  dist::ParallelOptions options;
  options.timeout_s = std::atof(argv[2]);
  const auto par = dist::ParallelContext::create(options);
  par->world().barrier();
  if (par->rank() == 1) {
    if (mode == "kill") std::raise(SIGKILL);
    for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
  }
  Tensor t = Tensor::full({4}, 1.0, DType::f32);
  par->world().all_reduce(t);
  std::printf("rank %d: the all-reduce completed without rank 1\n", par->rank());
  return 0;
}

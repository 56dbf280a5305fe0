#include <cstdio>

#include "command.h"
#include "glmtune/tensor/device.h"

// `glmtune env`: what this build can do, for bug reports.
GLMTUNE_COMMAND(env, "env", "Show build features and visible devices", [](CLI::App&) {
  return [] {
#ifdef GLMTUNE_WITH_CUDA
    std::printf("cuda backend: yes\nvisible GPUs: %d\n", glmtune::cuda_device_count());
#else
    std::printf("cuda backend: no (CPU-only build)\n");
#endif
    return 0;
  };
});

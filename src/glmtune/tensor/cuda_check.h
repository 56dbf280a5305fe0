#pragma once
#include <cuda_runtime.h>

#include "glmtune/base/error.h"

namespace glmtune {
[[noreturn]] void throw_cuda_error(cudaError_t status, const char* expr, const char* file,
                                   int line);
// A failed call into a CUDA library (`library`: "CUDA", "cuBLAS"): names the call and the status
// (its description and name), at the source line of the call; `fix` may be empty.
[[noreturn]] void throw_call_error(const char* library, const char* expr, const char* status,
                                   const char* status_name, const char* file, int line,
                                   const char* fix);
}  // namespace glmtune

// Every CUDA runtime call goes through this: a failure names the call and the source line.
#define GLMTUNE_CUDA_CHECK(expr)                                               \
  do {                                                                         \
    cudaError_t glmtune_status_ = (expr);                                      \
    if (glmtune_status_ != cudaSuccess)                                        \
      ::glmtune::throw_cuda_error(glmtune_status_, #expr, __FILE__, __LINE__); \
  } while (0)

// After a kernel launch: catches bad launch configurations at the launch site.
#define GLMTUNE_CUDA_CHECK_LAUNCH() GLMTUNE_CUDA_CHECK(cudaGetLastError())

namespace glmtune::cuda::detail {

// Makes `device` current for the launches of one op and restores the caller's device after.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    GLMTUNE_CUDA_CHECK(cudaGetDevice(&previous_));
    restore_ = previous_ != device;
    if (restore_) GLMTUNE_CUDA_CHECK(cudaSetDevice(device));
  }
  ~DeviceGuard() {
    if (restore_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
  bool restore_ = false;
};

}  // namespace glmtune::cuda::detail

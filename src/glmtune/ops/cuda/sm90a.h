#pragma once
// Whether the Hopper-only kernels (warpgroup MMA, TMA) can run on a device: this build has sm_90a
// code (GLMTUNE_CUDA_SM90A, set for the engine's sources) and the device is of compute
// capability 9.x.

#include <cuda_runtime.h>

#include "glmtune/tensor/cuda_check.h"

namespace glmtune::cuda::detail {

inline bool sm90a_kernels_available(int device) {
#ifdef GLMTUNE_CUDA_SM90A
  int major = 0;
  GLMTUNE_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  return major == 9;
#else
  (void)device;
  return false;
#endif
}

}  // namespace glmtune::cuda::detail

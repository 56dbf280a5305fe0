#pragma once
// Helpers shared by the CUDA benchmarks (bench/bench_cuda_*.cpp): seeded random device inputs and
// the median of event-timed runs. Header-only: each benchmark is a binary of its own.

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <vector>

#include "glmtune/tensor/cuda_check.h"
#include "glmtune/tensor/rng.h"
#include "glmtune/tensor/tensor.h"

namespace glmtune::cudabench {

inline const Device kGpu = Device::cuda(0);

// N(mean, std²) draws on `device` at `stream` of a fixed seed: every run times the same data
// (never zeros, which can run faster than real data).
inline Tensor random_gpu(const Shape& shape, DType dtype, uint64_t stream, double std = 1.0,
                         double mean = 0.0, Device device = kGpu) {
  Tensor t = Tensor::empty(shape, dtype, device);
  fill_normal(t, 20261129, stream << 40, mean, std);
  return t;
}

// Median of `iters` event-timed runs after `warmup` untimed ones, in milliseconds.
inline double median_ms(const std::function<void()>& fn, int warmup, int iters) {
  for (int i = 0; i < warmup; ++i) fn();
  GLMTUNE_CUDA_CHECK(cudaDeviceSynchronize());
  cudaEvent_t start, stop;
  GLMTUNE_CUDA_CHECK(cudaEventCreate(&start));
  GLMTUNE_CUDA_CHECK(cudaEventCreate(&stop));
  std::vector<float> ms(static_cast<size_t>(iters));
  for (int i = 0; i < iters; ++i) {
    GLMTUNE_CUDA_CHECK(cudaEventRecord(start));
    fn();
    GLMTUNE_CUDA_CHECK(cudaEventRecord(stop));
    GLMTUNE_CUDA_CHECK(cudaEventSynchronize(stop));
    GLMTUNE_CUDA_CHECK(cudaEventElapsedTime(&ms[size_t(i)], start, stop));
  }
  GLMTUNE_CUDA_CHECK(cudaGetLastError());
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(ms.begin(), ms.end());
  return double(ms[ms.size() / 2]);
}

}  // namespace glmtune::cudabench

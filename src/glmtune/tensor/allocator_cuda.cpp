#include <cuda_runtime.h>

#include <algorithm>
#include <memory>
#include <mutex>
#include <vector>

#include "glmtune/tensor/caching_allocator.h"
#include "glmtune/tensor/cuda_check.h"

namespace glmtune {

void throw_call_error(const char* library, const char* expr, const char* status,
                      const char* status_name, const char* file, int line, const char* fix) {
  throw Error(fmt::format("{} call `{}` failed: {} ({})", library, expr, status, status_name),
              fmt::format("{}:{}", file, line), fix);
}

void throw_cuda_error(cudaError_t status, const char* expr, const char* file, int line) {
  const bool no_gpu = status == cudaErrorNoDevice || status == cudaErrorInsufficientDriver;
  throw_call_error(
      "CUDA", expr, cudaGetErrorString(status), cudaGetErrorName(status), file, line,
      no_gpu ? "check that a GPU is visible (nvidia-smi) and the driver supports CUDA 13" : "");
}

bool cuda_available() { return cuda_device_count() > 0; }

void use_cuda_device(int index) {
  const int count = cuda_device_count();
  if (index < 0 || index >= count)
    throw Error(fmt::format("CUDA device {} does not exist ({} visible)", index, count), "device",
                "pick a device index below the number of visible GPUs (CUDA_VISIBLE_DEVICES)");
  GLMTUNE_CUDA_CHECK(cudaSetDevice(index));
}

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky error of a machine without a driver
    return 0;
  }
  return n;
}

namespace {

// Requests are rounded to 512 bytes (the alignment every kernel may assume); the cache
// (CachingAllocator) gives its blocks back to the driver when a cudaMalloc fails or in
// release_cached().
constexpr size_t kRound = 512;

class CudaCachingAllocator final : public CachingAllocator {
 public:
  explicit CudaCachingAllocator(int device) : CachingAllocator(kRound), device_(device) {}

 private:
  void* system_alloc(size_t size) override {
    int previous = 0;
    GLMTUNE_CUDA_CHECK(cudaGetDevice(&previous));
    GLMTUNE_CUDA_CHECK(cudaSetDevice(device_));
    void* ptr = nullptr;
    cudaError_t status = cudaMalloc(&ptr, size);
    if (status == cudaErrorMemoryAllocation && has_cached()) {
      cudaGetLastError();
      release_cached_locked();
      status = cudaMalloc(&ptr, size);
    }
    cudaSetDevice(previous);
    if (status != cudaSuccess) {
      cudaGetLastError();
      const MemoryStats& st = stats_locked();
      throw Error(fmt::format("cannot allocate {:.2f} GiB on cuda:{} ({} GiB in use by glmtune, "
                              "{} GiB reserved): {}",
                              size / 1073741824.0, device_, st.allocated / 1073741824.0,
                              st.reserved / 1073741824.0, cudaGetErrorString(status)),
                  "cuda:" + std::to_string(device_),
                  "lower pack_max_length or enable activation recompute/offload in the recipe");
    }
    return ptr;
  }

  void system_free(void* ptr) override { cudaFree(ptr); }

  int device_;
};

}  // namespace

Allocator& cuda_allocator(int index) {
  static std::mutex mu;
  static auto* allocators = new std::vector<std::unique_ptr<CudaCachingAllocator>>();
  std::lock_guard lock(mu);
  int count = cuda_device_count();
  if (index < 0 || index >= count)
    throw Error(fmt::format("CUDA device {} does not exist ({} visible)", index, count), "device",
                "pick a device index below the number of visible GPUs (CUDA_VISIBLE_DEVICES)");
  if (allocators->size() < size_t(count)) allocators->resize(count);
  auto& slot = (*allocators)[index];
  if (!slot) slot = std::make_unique<CudaCachingAllocator>(index);
  return *slot;
}

}  // namespace glmtune

#include <cuda_runtime.h>

#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "glmtune/tensor/allocator.h"
#include "glmtune/tensor/cuda_check.h"

namespace glmtune {

void throw_cuda_error(cudaError_t status, const char* expr, const char* file, int line) {
  throw Error(fmt::format("CUDA call `{}` failed: {} ({})", expr, cudaGetErrorString(status),
                          cudaGetErrorName(status)),
              fmt::format("{}:{}", file, line),
              status == cudaErrorNoDevice || status == cudaErrorInsufficientDriver
                  ? "check that a GPU is visible (nvidia-smi) and the driver supports CUDA 13"
                  : "");
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

// Requests are rounded to 512 bytes (the alignment every kernel may assume). Freed blocks are kept
// and reused for requests they fit without wasting more than half of the block; cached blocks go
// back to the driver only when a cudaMalloc fails or release_cached() is called.
constexpr size_t kRound = 512;

class CudaCachingAllocator final : public Allocator {
 public:
  explicit CudaCachingAllocator(int device) : device_(device) {}

  void* allocate(size_t bytes) override {
    size_t size = std::max(kRound, (bytes + kRound - 1) / kRound * kRound);
    std::lock_guard lock(mu_);
    stats_.num_allocs++;
    void* ptr = nullptr;
    auto it = free_.lower_bound(size);
    if (it != free_.end() && it->first <= 2 * size) {
      size = it->first;
      ptr = it->second;
      free_.erase(it);
    } else {
      ptr = system_alloc(size);
    }
    in_use_[ptr] = size;
    stats_.allocated += size;
    stats_.peak_allocated = std::max(stats_.peak_allocated, stats_.allocated);
    return ptr;
  }

  void deallocate(void* ptr, size_t) override {
    std::lock_guard lock(mu_);
    auto it = in_use_.find(ptr);
    GLMTUNE_ASSERT(it != in_use_.end(), "free of a pointer this allocator did not hand out");
    stats_.allocated -= it->second;
    free_.emplace(it->second, ptr);
    in_use_.erase(it);
  }

  MemoryStats stats() const override {
    std::lock_guard lock(mu_);
    return stats_;
  }
  void reset_peak() override {
    std::lock_guard lock(mu_);
    stats_.peak_allocated = stats_.allocated;
    stats_.peak_reserved = stats_.reserved;
  }
  void release_cached() override {
    std::lock_guard lock(mu_);
    release_locked();
  }

 private:
  void* system_alloc(size_t size) {
    int previous = 0;
    GLMTUNE_CUDA_CHECK(cudaGetDevice(&previous));
    GLMTUNE_CUDA_CHECK(cudaSetDevice(device_));
    void* ptr = nullptr;
    cudaError_t status = cudaMalloc(&ptr, size);
    if (status == cudaErrorMemoryAllocation && !free_.empty()) {
      cudaGetLastError();
      release_locked();
      status = cudaMalloc(&ptr, size);
    }
    cudaSetDevice(previous);
    if (status != cudaSuccess) {
      cudaGetLastError();
      throw Error(fmt::format("cannot allocate {:.2f} GiB on cuda:{} ({} GiB in use by glmtune, "
                              "{} GiB reserved): {}",
                              size / 1073741824.0, device_, stats_.allocated / 1073741824.0,
                              stats_.reserved / 1073741824.0, cudaGetErrorString(status)),
                  "cuda:" + std::to_string(device_),
                  "lower pack_max_length or enable activation recompute/offload in the recipe");
    }
    stats_.reserved += size;
    stats_.num_system_allocs++;
    stats_.peak_reserved = std::max(stats_.peak_reserved, stats_.reserved);
    return ptr;
  }

  void release_locked() {
    for (auto& [size, ptr] : free_) {
      cudaFree(ptr);
      stats_.reserved -= size;
    }
    free_.clear();
  }

  int device_;
  mutable std::mutex mu_;
  std::multimap<size_t, void*> free_;
  std::unordered_map<void*, size_t> in_use_;
  MemoryStats stats_;
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

#include "glmtune/tensor/allocator.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <mutex>

#include "glmtune/base/error.h"

namespace glmtune {
namespace {

// 64-byte alignment keeps every row start usable by AVX-512 loads and avoids false sharing.
constexpr size_t kHostAlignment = 64;

class HostAllocator final : public Allocator {
 public:
  void* allocate(size_t bytes) override {
    size_t rounded = std::max<size_t>(
        kHostAlignment, (bytes + kHostAlignment - 1) / kHostAlignment * kHostAlignment);
    void* p = std::aligned_alloc(kHostAlignment, rounded);
    if (!p)
      throw Error("host allocation of " + std::to_string(bytes) + " bytes failed", "memory",
                  "reduce the pack length or model size, or free host memory");
    std::lock_guard lock(mu_);
    stats_.allocated += bytes;
    stats_.reserved += bytes;
    stats_.num_allocs++;
    stats_.num_system_allocs++;
    stats_.peak_allocated = std::max(stats_.peak_allocated, stats_.allocated);
    stats_.peak_reserved = std::max(stats_.peak_reserved, stats_.reserved);
    return p;
  }
  void deallocate(void* ptr, size_t bytes) override {
    std::free(ptr);
    std::lock_guard lock(mu_);
    stats_.allocated -= bytes;
    stats_.reserved -= bytes;
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

 private:
  mutable std::mutex mu_;
  MemoryStats stats_;
};

}  // namespace

Allocator& host_allocator() {
  static HostAllocator* allocator =
      new HostAllocator();  // never destroyed: tensors may outlive main
  return *allocator;
}

#ifndef GLMTUNE_WITH_CUDA
Allocator& cuda_allocator(int) {
  throw Error(
      "this glmtune was built without CUDA", "device",
      "rebuild with -DGLMTUNE_CUDA=ON on a machine with the CUDA toolkit, or use --device cpu");
}
#endif

Allocator& allocator_for(Device device) {
  return device.is_cpu() ? host_allocator() : cuda_allocator(device.index);
}

}  // namespace glmtune

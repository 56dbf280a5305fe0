#include "glmtune/tensor/allocator.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <mutex>

#include "glmtune/base/error.h"
#include "glmtune/tensor/caching_allocator.h"

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

void* CachingAllocator::allocate(size_t bytes) {
  size_t size = std::max(round_, (bytes + round_ - 1) / round_ * round_);
  std::lock_guard lock(mu_);
  stats_.num_allocs++;
  void* ptr = nullptr;
  if (auto it = free_.lower_bound(size); it != free_.end() && it->first <= 2 * size) {
    size = it->first;
    ptr = it->second;
    free_.erase(it);
  } else {
    ptr = system_alloc(size);
    stats_.reserved += size;
    stats_.peak_reserved = std::max(stats_.peak_reserved, stats_.reserved);
    stats_.num_system_allocs++;
  }
  in_use_[ptr] = size;
  stats_.allocated += size;
  stats_.peak_allocated = std::max(stats_.peak_allocated, stats_.allocated);
  return ptr;
}

void CachingAllocator::deallocate(void* ptr, size_t) {
  std::lock_guard lock(mu_);
  const auto it = in_use_.find(ptr);
  GLMTUNE_ASSERT(it != in_use_.end(), "free of a block this allocator did not hand out");
  stats_.allocated -= it->second;
  free_.emplace(it->second, ptr);
  in_use_.erase(it);
}

MemoryStats CachingAllocator::stats() const {
  std::lock_guard lock(mu_);
  return stats_;
}

void CachingAllocator::reset_peak() {
  std::lock_guard lock(mu_);
  stats_.peak_allocated = stats_.allocated;
  stats_.peak_reserved = stats_.reserved;
}

void CachingAllocator::release_cached() {
  std::lock_guard lock(mu_);
  release_cached_locked();
}

void CachingAllocator::release_cached_locked() {
  if (free_.empty()) return;
  before_release();
  for (const auto& [size, ptr] : free_) {
    system_free(ptr);
    stats_.reserved -= size;
  }
  free_.clear();
}

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

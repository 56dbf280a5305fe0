#pragma once
// The cache shared by glmtune's allocators that sit on a slow system allocation (cudaMalloc for
// device memory, cudaHostAlloc for the pinned host memory of activation offload).

#include <cstddef>
#include <map>
#include <mutex>
#include <unordered_map>

#include "glmtune/tensor/allocator.h"

namespace glmtune {

// A cache of freed blocks over a system allocation (cudaMalloc, pinned host memory), so that a
// steady state does no system calls: requests are rounded up to `round` bytes and served by the
// smallest cached block that fits them without wasting more than half of it; cached blocks go
// back to the system only in release_cached() (or release_cached_locked() from system_alloc, to
// retry after running out).
class CachingAllocator : public Allocator {
 public:
  void* allocate(size_t bytes) final;
  void deallocate(void* ptr, size_t bytes) final;
  MemoryStats stats() const final;
  void reset_peak() final;
  void release_cached() final;

 protected:
  explicit CachingAllocator(size_t round) : round_(round) {}
  // A new block of `size` bytes; called with the cache's lock held.
  virtual void* system_alloc(size_t size) = 0;
  virtual void system_free(void* ptr) = 0;
  // Runs before cached blocks go back to the system (lock held): where queued work may still use
  // a cached block, wait for it here.
  virtual void before_release() {}
  // For system_alloc (lock held).
  void release_cached_locked();
  bool has_cached() const { return !free_.empty(); }
  const MemoryStats& stats_locked() const { return stats_; }

 private:
  size_t round_;
  mutable std::mutex mu_;
  std::multimap<size_t, void*> free_;
  std::unordered_map<void*, size_t> in_use_;
  MemoryStats stats_;
};

}  // namespace glmtune

#pragma once
// The cache shared by glmtune's allocators that sit on a slow system allocation (cudaMalloc for
// device memory, cudaHostAlloc for the pinned host memory of activation offload).

#include <cstddef>
#include <mutex>
#include <set>
#include <unordered_map>
#include <utility>

#include "glmtune/tensor/allocator.h"

namespace glmtune {

// A cache over a system allocation (cudaMalloc, pinned host memory), so that a steady state does
// no system calls, and a block handed out is the request, not a larger cached block: requests are
// rounded up to `round` bytes and served best fit (the smallest free block that holds them, the
// lowest address among equals) from segments obtained from the system, and a block larger than
// the request is split, its rest staying free; a freed block merges with its free neighbours in
// its segment. Requests under kSmallRequest come from segments of kSmallSegment bytes kept apart
// from the large ones, so small, short-lived tensors do not cut the large blocks into pieces; a
// large block is split only when the rest is itself large, otherwise handed out whole (the
// rounding is then counted in `allocated`). Whole free segments go back to the system only in
// release_cached() (or release_cached_locked() from system_alloc, to retry after running out).
class CachingAllocator : public Allocator {
 public:
  static constexpr size_t kSmallRequest = size_t(1) << 20;
  static constexpr size_t kSmallSegment = size_t(2) << 20;

  void* allocate(size_t bytes) final;
  void deallocate(void* ptr, size_t bytes) final;
  MemoryStats stats() const final;
  void reset_peak() final;
  void release_cached() final;
  // The bookkeeping only: the memory itself goes back in release_cached(), which needs the
  // subclass's system_free.
  ~CachingAllocator() override;

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
  // Whether release_cached_locked would give memory back (a whole segment is free).
  bool has_cached() const;
  const MemoryStats& stats_locked() const { return stats_; }

 private:
  // A piece of a segment; neighbours are the pieces before and after it in the same segment.
  struct Block {
    char* ptr;
    size_t size;
    bool small;  // from a small segment
    bool free;
    Block* prev;
    Block* next;
  };
  using FreeSet = std::set<std::pair<size_t, char*>>;
  FreeSet& pool(bool small) { return small ? free_small_ : free_large_; }
  void insert_free(Block* b);
  void erase_free(Block* b);

  size_t round_;
  mutable std::mutex mu_;
  FreeSet free_small_, free_large_;           // free blocks by (size, address)
  std::unordered_map<char*, Block*> blocks_;  // every block, free or in use, by address
  MemoryStats stats_;
};

}  // namespace glmtune

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

CachingAllocator::~CachingAllocator() {
  for (const auto& [ptr, block] : blocks_) delete block;
}

void CachingAllocator::insert_free(Block* b) {
  b->free = true;
  pool(b->small).emplace(b->size, b->ptr);
}

void CachingAllocator::erase_free(Block* b) {
  pool(b->small).erase({b->size, b->ptr});
  b->free = false;
}

void* CachingAllocator::allocate(size_t bytes) {
  const size_t size = std::max(round_, (bytes + round_ - 1) / round_ * round_);
  const bool small = size < kSmallRequest;
  std::lock_guard lock(mu_);
  stats_.num_allocs++;
  FreeSet& free = pool(small);
  Block* block = nullptr;
  if (auto it = free.lower_bound({size, nullptr}); it != free.end()) {
    block = blocks_.at(it->second);
    erase_free(block);
  } else {
    const size_t segment = small ? kSmallSegment : size;
    char* ptr = static_cast<char*>(system_alloc(segment));
    stats_.reserved += segment;
    stats_.peak_reserved = std::max(stats_.peak_reserved, stats_.reserved);
    stats_.num_system_allocs++;
    block = new Block{ptr, segment, small, false, nullptr, nullptr};
    blocks_.emplace(ptr, block);
  }
  // Split off the rest where it can serve a request of the block's own pool.
  const size_t rest = block->size - size;
  if (rest >= (small ? round_ : kSmallRequest)) {
    Block* tail = new Block{block->ptr + size, rest, small, false, block, block->next};
    if (block->next) block->next->prev = tail;
    block->next = tail;
    block->size = size;
    blocks_.emplace(tail->ptr, tail);
    insert_free(tail);
  }
  stats_.allocated += block->size;
  stats_.peak_allocated = std::max(stats_.peak_allocated, stats_.allocated);
  return block->ptr;
}

void CachingAllocator::deallocate(void* ptr, size_t) {
  std::lock_guard lock(mu_);
  const auto it = blocks_.find(static_cast<char*>(ptr));
  GLMTUNE_ASSERT(it != blocks_.end() && !it->second->free,
                 "free of a block this allocator did not hand out");
  Block* block = it->second;
  stats_.allocated -= block->size;
  // Merge with free neighbours, so that the segment's free space stays in one piece.
  if (Block* next = block->next; next && next->free) {
    erase_free(next);
    block->size += next->size;
    block->next = next->next;
    if (next->next) next->next->prev = block;
    blocks_.erase(next->ptr);
    delete next;
  }
  if (Block* prev = block->prev; prev && prev->free) {
    erase_free(prev);
    prev->size += block->size;
    prev->next = block->next;
    if (block->next) block->next->prev = prev;
    blocks_.erase(block->ptr);
    delete block;
    block = prev;
  }
  insert_free(block);
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

bool CachingAllocator::has_cached() const {
  for (const FreeSet* set : {&free_small_, &free_large_})
    for (const auto& [size, ptr] : *set) {
      const Block* b = blocks_.at(ptr);
      if (!b->prev && !b->next) return true;
    }
  return false;
}

void CachingAllocator::release_cached_locked() {
  if (!has_cached()) return;
  before_release();
  for (FreeSet* set : {&free_small_, &free_large_})
    for (auto it = set->begin(); it != set->end();) {
      Block* b = blocks_.at(it->second);
      if (b->prev || b->next) {
        ++it;
        continue;
      }
      system_free(b->ptr);
      stats_.reserved -= b->size;
      blocks_.erase(b->ptr);
      delete b;
      it = set->erase(it);
    }
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

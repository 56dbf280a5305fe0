// The caching allocator behind the CUDA and pinned-host allocators (tensor/caching_allocator.h),
// on plain host memory: best fit, splitting to the request, merging of freed neighbours, the
// small-request segments, and what goes back to the system.

#include <gtest/gtest.h>

#include <cstdlib>
#include <vector>

#include "glmtune/base/error.h"
#include "glmtune/tensor/caching_allocator.h"

using namespace glmtune;

namespace {

constexpr size_t kMiB = size_t(1) << 20;

class HostCache final : public CachingAllocator {
 public:
  HostCache() : CachingAllocator(512) {}
  ~HostCache() override { release_cached(); }
  int segments = 0;

 private:
  void* system_alloc(size_t size) override {
    ++segments;
    return std::aligned_alloc(4096, (size + 4095) / 4096 * 4096);
  }
  void system_free(void* ptr) override {
    --segments;
    std::free(ptr);
  }
};

char* at(void* p) { return static_cast<char*>(p); }

TEST(CachingAllocator, ALargerFreeBlockIsSplitToTheRequest) {
  HostCache c;
  void* a = c.allocate(3 * kMiB);
  c.deallocate(a, 3 * kMiB);
  void* b = c.allocate(kMiB);
  void* d = c.allocate(2 * kMiB);
  EXPECT_EQ(c.stats().num_system_allocs, 1u);
  EXPECT_EQ(at(b), at(a));
  EXPECT_EQ(at(d), at(a) + kMiB);
  EXPECT_EQ(c.stats().allocated, 3 * kMiB);
  EXPECT_EQ(c.stats().reserved, 3 * kMiB);
  c.deallocate(b, kMiB);
  c.deallocate(d, 2 * kMiB);
}

TEST(CachingAllocator, FreedNeighboursMergeAndAWholeSegmentGoesBack) {
  HostCache c;
  c.deallocate(c.allocate(3 * kMiB), 3 * kMiB);
  void* x = c.allocate(kMiB);
  void* y = c.allocate(kMiB);
  void* z = c.allocate(kMiB);
  c.deallocate(x, kMiB);
  c.deallocate(z, kMiB);
  // y still holds the middle: the segment stays.
  c.release_cached();
  EXPECT_EQ(c.segments, 1);
  EXPECT_EQ(c.stats().reserved, 3 * kMiB);
  c.deallocate(y, kMiB);
  // One free block of the whole segment again: a 3 MiB request fits without the system.
  void* whole = c.allocate(3 * kMiB);
  EXPECT_EQ(at(whole), at(x));
  EXPECT_EQ(c.stats().num_system_allocs, 1u);
  c.deallocate(whole, 3 * kMiB);
  c.release_cached();
  EXPECT_EQ(c.segments, 0);
  EXPECT_EQ(c.stats().reserved, 0u);
  EXPECT_EQ(c.stats().allocated, 0u);
}

TEST(CachingAllocator, BestFitTakesTheSmallestBlockThatHolds) {
  HostCache c;
  void* big = c.allocate(4 * kMiB);
  void* mid = c.allocate(2 * kMiB);
  c.deallocate(big, 4 * kMiB);
  c.deallocate(mid, 2 * kMiB);
  void* p = c.allocate(2 * kMiB);
  EXPECT_EQ(p, mid);
  EXPECT_EQ(c.stats().num_system_allocs, 2u);
  c.deallocate(p, 2 * kMiB);
}

TEST(CachingAllocator, SmallRequestsShareSegmentsApartFromLargeBlocks) {
  HostCache c;
  void* large = c.allocate(4 * kMiB);
  c.deallocate(large, 4 * kMiB);
  std::vector<void*> small;
  for (int i = 0; i < 100; ++i) small.push_back(c.allocate(10000));  // 10240 bytes each
  // The free large block is left whole; one small segment holds all hundred.
  EXPECT_EQ(c.stats().num_system_allocs, 2u);
  EXPECT_EQ(c.stats().reserved, 4 * kMiB + CachingAllocator::kSmallSegment);
  EXPECT_EQ(c.stats().allocated, 100u * 10240);
  for (void* p : small) c.deallocate(p, 10000);
  void* again = c.allocate(4 * kMiB);
  EXPECT_EQ(again, large);
  c.deallocate(again, 4 * kMiB);
}

TEST(CachingAllocator, ALargeRestTooSmallToServeALargeRequestIsNotSplit) {
  HostCache c;
  void* a = c.allocate(kMiB + kMiB / 2);
  c.deallocate(a, kMiB + kMiB / 2);
  void* b = c.allocate(kMiB);
  EXPECT_EQ(b, a);
  EXPECT_EQ(c.stats().allocated, kMiB + kMiB / 2);  // handed out whole
  c.deallocate(b, kMiB);
  EXPECT_EQ(c.stats().allocated, 0u);
}

TEST(CachingAllocator, PeakTracksTheRequestsNotTheCachedBlocks) {
  HostCache c;
  c.deallocate(c.allocate(8 * kMiB), 8 * kMiB);
  c.reset_peak();
  void* p = c.allocate(5 * kMiB);
  EXPECT_EQ(c.stats().peak_allocated, 5 * kMiB);
  EXPECT_EQ(c.stats().peak_reserved, 8 * kMiB);
  c.deallocate(p, 5 * kMiB);
}

TEST(CachingAllocator, FreeingAForeignPointerIsAnInternalError) {
  HostCache c;
  int local = 0;
  EXPECT_THROW(c.deallocate(&local, sizeof local), InternalError);
  void* p = c.allocate(1000);
  c.deallocate(p, 1000);
  EXPECT_THROW(c.deallocate(p, 1000), InternalError);  // twice
}

}  // namespace

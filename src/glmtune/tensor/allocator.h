#pragma once
// Memory for tensors. The host allocator hands out 64-byte aligned blocks; the CUDA allocator
// caches freed device blocks by size so that steady-state training does no cudaMalloc/cudaFree.

#include <cstddef>
#include <cstdint>

#include "glmtune/tensor/device.h"

namespace glmtune {

struct MemoryStats {
  size_t allocated = 0;       // bytes handed out and not yet returned
  size_t peak_allocated = 0;  // high-water mark of `allocated` since the last reset
  size_t reserved = 0;        // bytes held from the system (handed out + cached)
  size_t peak_reserved = 0;
  uint64_t num_allocs = 0;         // calls to allocate
  uint64_t num_system_allocs = 0;  // allocations that reached malloc / cudaMalloc
};

class Allocator {
 public:
  virtual ~Allocator() = default;
  virtual void* allocate(size_t bytes) = 0;
  virtual void deallocate(void* ptr, size_t bytes) = 0;
  virtual MemoryStats stats() const = 0;
  virtual void reset_peak() = 0;
  // Returns cached, unused blocks to the system.
  virtual void release_cached() {}
};

Allocator& host_allocator();
// The caching allocator of CUDA device `index`; throws glmtune::Error in a CPU-only build.
Allocator& cuda_allocator(int index);
Allocator& allocator_for(Device device);

}  // namespace glmtune

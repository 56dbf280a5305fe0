#pragma once
// Device-side tensor primitives (copy/convert, fill, RNG). Implemented in tensor_cuda.cu; only
// called from tensor.cpp and rng.cpp when the CUDA backend is built.

#include <cstddef>
#include <cstdint>

#include "glmtune/tensor/dtype.h"

namespace glmtune::cuda_impl {

inline constexpr int kMaxDims = 8;

struct Layout {
  int ndim = 0;
  int64_t shape[kMaxDims] = {};
  int64_t strides[kMaxDims] = {};  // in elements
};

void copy_strided(int device, void* dst, DType dst_type, const Layout& dst_layout, const void* src,
                  DType src_type, const Layout& src_layout, int64_t numel);
void fill(int device, void* dst, DType type, const Layout& layout, int64_t numel, double value);
// Byte copy between any two of host / device memory (synchronous).
void memcpy_bytes(void* dst, bool dst_device, const void* src, bool src_device, size_t bytes);
void rng_uniform(int device, void* dst, DType type, int64_t numel, uint64_t seed, uint64_t offset,
                 double low, double high);
void rng_normal(int device, void* dst, DType type, int64_t numel, uint64_t seed, uint64_t offset,
                double mean, double std);

}  // namespace glmtune::cuda_impl

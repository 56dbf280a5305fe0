#include <cuda_runtime.h>

#include "glmtune/tensor/convert.h"
#include "glmtune/tensor/cuda_check.h"
#include "glmtune/tensor/cuda_ops.h"
#include "glmtune/tensor/rng.h"

namespace glmtune::cuda_impl {
namespace {

constexpr int kThreads = 256;

int blocks_for(int64_t n) {
  int64_t b = (n + kThreads - 1) / kThreads;
  return int(b < 65535 * 16 ? b : 65535 * 16);
}

__device__ int64_t offset_of(const Layout& l, int64_t linear) {
  int64_t off = 0;
  for (int d = l.ndim - 1; d >= 0; --d) {
    int64_t i = linear % l.shape[d];
    linear /= l.shape[d];
    off += i * l.strides[d];
  }
  return off;
}

__global__ void copy_kernel(char* dst, DType dt, Layout dl, const char* src, DType st, Layout sl,
                            int64_t n) {
  const int64_t de = dt == DType::f64 || dt == DType::i64    ? 8
                     : dt == DType::f32 || dt == DType::i32  ? 4
                     : dt == DType::bf16 || dt == DType::f16 ? 2
                                                             : 1;
  const int64_t se = st == DType::f64 || st == DType::i64    ? 8
                     : st == DType::f32 || st == DType::i32  ? 4
                     : st == DType::bf16 || st == DType::f16 ? 2
                                                             : 1;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const char* s = src + offset_of(sl, i) * se;
    char* d = dst + offset_of(dl, i) * de;
    if (dt == st) {
      for (int64_t b = 0; b < de; ++b) d[b] = s[b];
    } else {
      convert::convert_element(s, st, d, dt);
    }
  }
}

__global__ void fill_kernel(char* dst, DType dt, Layout dl, int64_t n, unsigned long long pattern,
                            int es) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    char* d = dst + offset_of(dl, i) * es;
    for (int b = 0; b < es; ++b) d[b] = char((pattern >> (8 * b)) & 0xff);
  }
}

__global__ void uniform_kernel(char* dst, DType dt, int es, int64_t n, uint64_t seed,
                               uint64_t offset, double low, double span) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    convert::store(dst + i * es, dt, rng_affine(low, span, rng_uniform_at(seed, offset + i)));
}

__global__ void normal_kernel(char* dst, DType dt, int es, int64_t n, uint64_t seed,
                              uint64_t offset, double mean, double std) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    convert::store(dst + i * es, dt, rng_affine(mean, std, rng_normal_at(seed, offset + i)));
}

struct DeviceGuard {
  int previous = 0;
  explicit DeviceGuard(int device) {
    GLMTUNE_CUDA_CHECK(cudaGetDevice(&previous));
    GLMTUNE_CUDA_CHECK(cudaSetDevice(device));
  }
  ~DeviceGuard() { cudaSetDevice(previous); }
};

}  // namespace

// The kernels below run on the legacy default stream, in order with every op's kernels, and
// return without waiting: a host read goes through cudaMemcpy, which waits for that stream, and
// the side streams (NCCL, activation offload) order themselves after it with events. A
// device-wide wait here would also wait for those side streams' copies and stall the host.
void copy_strided(int device, void* dst, DType dst_type, const Layout& dst_layout, const void* src,
                  DType src_type, const Layout& src_layout, int64_t numel) {
  DeviceGuard guard(device);
  copy_kernel<<<blocks_for(numel), kThreads>>>(static_cast<char*>(dst), dst_type, dst_layout,
                                               static_cast<const char*>(src), src_type, src_layout,
                                               numel);
  GLMTUNE_CUDA_CHECK_LAUNCH();
}

void fill(int device, void* dst, DType type, const Layout& layout, int64_t numel, double value) {
  DeviceGuard guard(device);
  unsigned long long pattern = 0;
  convert::store(&pattern, type, value);
  fill_kernel<<<blocks_for(numel), kThreads>>>(static_cast<char*>(dst), type, layout, numel,
                                               pattern, int(dtype_size(type)));
  GLMTUNE_CUDA_CHECK_LAUNCH();
}

void memcpy_bytes(void* dst, bool dst_device, const void* src, bool src_device, size_t bytes) {
  cudaMemcpyKind kind = dst_device
                            ? (src_device ? cudaMemcpyDeviceToDevice : cudaMemcpyHostToDevice)
                            : (src_device ? cudaMemcpyDeviceToHost : cudaMemcpyHostToHost);
  GLMTUNE_CUDA_CHECK(cudaMemcpy(dst, src, bytes, kind));
}

void rng_uniform(int device, void* dst, DType type, int64_t numel, uint64_t seed, uint64_t offset,
                 double low, double high) {
  DeviceGuard guard(device);
  uniform_kernel<<<blocks_for(numel), kThreads>>>(
      static_cast<char*>(dst), type, int(dtype_size(type)), numel, seed, offset, low, high - low);
  GLMTUNE_CUDA_CHECK_LAUNCH();
}

void rng_normal(int device, void* dst, DType type, int64_t numel, uint64_t seed, uint64_t offset,
                double mean, double std) {
  DeviceGuard guard(device);
  normal_kernel<<<blocks_for(numel), kThreads>>>(
      static_cast<char*>(dst), type, int(dtype_size(type)), numel, seed, offset, mean, std);
  GLMTUNE_CUDA_CHECK_LAUNCH();
}

}  // namespace glmtune::cuda_impl

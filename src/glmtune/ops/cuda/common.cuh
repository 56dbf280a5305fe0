#pragma once
// Shared pieces of the CUDA op kernels (included by ops/cuda/*.cu only): bf16 vector loads and
// stores, deterministic warp and block reductions, and the host-side checks and device guard the
// launch wrappers use. Nothing here includes fmt (nvcc cannot compile it), so host-side messages
// are built with std::string.

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "glmtune/base/error.h"
#include "glmtune/tensor/cuda_check.h"
#include "glmtune/tensor/tensor.h"

// An internal invariant of a CUDA op's arguments (a bug in the caller, not user input): throws
// glmtune::InternalError naming the source line and `message` (a std::string expression).
#define GLMTUNE_CUDA_OP_REQUIRE(cond, message)                                          \
  do {                                                                                  \
    if (!(cond))                                                                        \
      ::glmtune::throw_internal(__FILE__, __LINE__,                                     \
                                std::string("check `" #cond "` failed: ") + (message)); \
  } while (0)

namespace glmtune::cuda::detail {

using bf16 = __nv_bfloat16;

// ---- host side -------------------------------------------------------------------------------

inline std::string describe(const Tensor& t) {
  return t.defined() ? t.str() : std::string("undefined");
}

// Copies host int32 values into a new device tensor (synchronously). Tensor::from_vector is not
// usable here: its size check needs fmt, which nvcc cannot compile.
inline Tensor device_i32(const std::vector<int32_t>& values, Device device) {
  Tensor t = Tensor::empty({int64_t(values.size())}, DType::i32, device);
  if (!values.empty())
    GLMTUNE_CUDA_CHECK(cudaMemcpy(t.data_ptr(), values.data(), values.size() * sizeof(int32_t),
                                  cudaMemcpyHostToDevice));
  return t;
}

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Rows of a matrix in device memory: the last dimension with unit stride, every leading dimension
// flattened (contiguous tensors) or one row dimension with its own stride (2-D views such as the
// halves of a fused [N, 2I] product).
struct RowsView {
  void* data = nullptr;
  int64_t rows = 0, cols = 0, ld = 0;
};

inline bool has_row_layout(const Tensor& t) {
  if (!t.defined() || t.dim() < 1) return false;
  if (t.is_contiguous()) return true;
  return t.dim() == 2 && t.stride(1) == 1 && t.stride(0) >= t.size(1);
}

inline RowsView rows_view(const Tensor& t) {
  RowsView v;
  v.data = t.data_ptr();
  v.cols = t.size(-1);
  v.rows = v.cols > 0 ? t.numel() / v.cols : 0;
  v.ld = t.is_contiguous() ? v.cols : t.stride(0);
  return v;
}

// ---- device side -----------------------------------------------------------------------------

// Eight bf16 values moved as one 16-byte access.
__device__ __forceinline__ void load_bf16x8(const bf16* p, float (&out)[8]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

__device__ __forceinline__ void store_bf16x8(bf16* p, const float (&in)[8]) {
  uint4 raw;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(in[2 * i], in[2 * i + 1]);
  *reinterpret_cast<uint4*>(p) = raw;
}

// Element loads and stores of the kernels templated on their storage (bf16, or f32 in the
// tight-tolerance test mode): arithmetic is always fp32, a bf16 store rounds to nearest even.
__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(bf16 v) { return __bfloat162float(v); }
template <typename T>
__device__ __forceinline__ T from_f(float v) {
  if constexpr (std::is_same_v<T, float>)
    return v;
  else
    return __float2bfloat16_rn(v);
}

// Loads / stores of VEC consecutive elements of T storage as fp32: the 16-byte forms (16-byte
// aligned; VEC = 8 for bf16, VEC = 4 for f32), or one element at a time (VEC = 1).
template <int VEC, typename T>
__device__ __forceinline__ void load_vec(const T* p, float (&out)[VEC]) {
  static_assert(VEC == 1 || VEC * sizeof(T) == 16, "VEC is 1 or 16 bytes of T");
  if constexpr (VEC == 1) {
    out[0] = to_f(p[0]);
  } else if constexpr (std::is_same_v<T, bf16>) {
    load_bf16x8(p, out);
  } else {
    const float4 raw = *reinterpret_cast<const float4*>(p);
    out[0] = raw.x;
    out[1] = raw.y;
    out[2] = raw.z;
    out[3] = raw.w;
  }
}

template <int VEC, typename T>
__device__ __forceinline__ void store_vec(T* p, const float (&in)[VEC]) {
  static_assert(VEC == 1 || VEC * sizeof(T) == 16, "VEC is 1 or 16 bytes of T");
  if constexpr (VEC == 1) {
    p[0] = from_f<T>(in[0]);
  } else if constexpr (std::is_same_v<T, bf16>) {
    store_bf16x8(p, in);
  } else {
    *reinterpret_cast<float4*>(p) = make_float4(in[0], in[1], in[2], in[3]);
  }
}

// The widest access (16, 8, 4 or 2 bytes) that divides `bytes`, and its register type.
constexpr int access_width(int bytes) {
  return bytes % 16 == 0 ? 16 : bytes % 8 == 0 ? 8 : bytes % 4 == 0 ? 4 : 2;
}
template <int W>
struct RawAccess;
template <>
struct RawAccess<16> {
  using type = uint4;
};
template <>
struct RawAccess<8> {
  using type = uint2;
};
template <>
struct RawAccess<4> {
  using type = unsigned;
};
template <>
struct RawAccess<2> {
  using type = unsigned short;
};

// N consecutive elements of T storage as fp32, moved in the widest accesses N·sizeof(T) allows
// (`p` must be aligned to that width: 16 bytes for 8 bf16, 8 for 4, ...).
template <int N, typename T>
__device__ __forceinline__ void load_elems(const T* p, float (&out)[N]) {
  constexpr int kWidth = access_width(int(N * sizeof(T))), kPer = kWidth / int(sizeof(T));
  using Raw = typename RawAccess<kWidth>::type;
#pragma unroll
  for (int a = 0; a < N / kPer; ++a) {
    const Raw raw = reinterpret_cast<const Raw*>(p)[a];
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < kPer; ++i) out[a * kPer + i] = to_f(e[i]);
  }
}

template <int N, typename T>
__device__ __forceinline__ void store_elems(T* p, const float (&in)[N]) {
  constexpr int kWidth = access_width(int(N * sizeof(T))), kPer = kWidth / int(sizeof(T));
  using Raw = typename RawAccess<kWidth>::type;
#pragma unroll
  for (int a = 0; a < N / kPer; ++a) {
    Raw raw;
    T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
    for (int i = 0; i < kPer; ++i) e[i] = from_f<T>(in[a * kPer + i]);
    reinterpret_cast<Raw*>(p)[a] = raw;
  }
}

__device__ __forceinline__ float round_bf16(float v) {
  return __bfloat162float(__float2bfloat16_rn(v));
}

// Butterfly sum over the 32 lanes: every lane ends with the same value, and the order of the
// additions is fixed by the lane pattern, so the result never depends on timing.
template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1)
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// Sum over the whole block (blockDim.x a multiple of 32, at most 1024), returned to every thread.
// `scratch` holds 32 values of T in shared memory; it may be reused right after the call returns
// (the trailing barrier protects it). Fixed order: warps in lane order, then warp results in warp
// order, so reruns are bit-identical.
template <typename T>
__device__ __forceinline__ T block_sum(T v, T* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  v = warp_sum(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  T total = lane < warps ? scratch[lane] : T(0);
  total = warp_sum(total);
  __syncthreads();
  return total;
}

// A tensor's storage as T, for a launch whose wrapper has checked the dtype (data_ptr() throws
// on an undefined tensor).
template <typename T>
const T* cptr(const Tensor& t) {
  return reinterpret_cast<const T*>(t.data_ptr());
}
template <typename T>
T* mptr(const Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

// std::lower_bound in one thread: the first position in sorted[0, n) whose value is not below
// `value` (n when none is). V is the caller's own index type, so its comparisons stay as they were.
template <typename V>
__device__ __forceinline__ int64_t lower_bound(const int32_t* sorted, int64_t n, V value) {
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (sorted[mid] < value)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

// out[j] += Σ_b partial[b][j], blocks in order: the deterministic second stage of a per-block
// column reduction. A template, so that only the files that launch it compile a kernel.
template <typename T>
__global__ void sum_blocks_kernel(const T* __restrict__ partial, int64_t blocks, int64_t n,
                                  T* __restrict__ out) {
  const int64_t j = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (j >= n) return;
  T acc = 0.0f;
  for (int64_t b = 0; b < blocks; ++b) acc += partial[b * n + j];
  out[j] += acc;
}

}  // namespace glmtune::cuda::detail

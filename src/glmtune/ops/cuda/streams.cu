// Residual-stream reshapes and the in-place add (ops/cuda/streams.h).

#include "glmtune/ops/cuda/common.cuh"
#include "glmtune/ops/cuda/streams.h"
#include "glmtune/tensor/rng.h"

namespace glmtune::cuda {
namespace {

using detail::bf16;

__device__ __forceinline__ float load(const float* p, int64_t i) { return p[i]; }
__device__ __forceinline__ float load(const bf16* p, int64_t i) { return __bfloat162float(p[i]); }
__device__ __forceinline__ void store(float* p, int64_t i, float v) { p[i] = v; }
__device__ __forceinline__ void store(bf16* p, int64_t i, float v) {
  p[i] = __float2bfloat16_rn(v);
}

constexpr int kThreads = 256;

template <typename T>
__global__ void broadcast_kernel(const T* __restrict__ x, T* __restrict__ out, int64_t rows,
                                 int64_t d, int h, float scale) {
  const int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= rows * d) return;
  const int64_t r = i / d, c = i % d;
  const float v = load(x, i) * scale;
  for (int s = 0; s < h; ++s) store(out, (r * h + s) * d + c, v);
}

template <typename T>
__global__ void reduce_kernel(const T* __restrict__ x, T* __restrict__ out, int64_t rows, int64_t d,
                              int h, float scale) {
  const int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= rows * d) return;
  const int64_t r = i / d, c = i % d;
  float acc = 0.0f;
  for (int s = 0; s < h; ++s) acc += load(x, (r * h + s) * d + c);
  store(out, i, acc * scale);
}

template <typename A, typename B>
__global__ void add_kernel(A* __restrict__ a, const B* __restrict__ b, int64_t n) {
  const int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (i < n) store(a, i, load(a, i) + load(b, i));
}

// The product in double, rounded once into a's dtype: the CPU body's rule for an f32 tensor.
template <typename T>
__global__ void scale_kernel(T* __restrict__ a, double s, int64_t n) {
  const int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (i < n) store(a, i, float(double(load(a, i)) * s));
}

template <typename T>
__global__ void dropout_kernel(T* __restrict__ a, double p, double inv, uint64_t key, int64_t n) {
  const int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (i < n)
    store(a, i, rng_uniform_at(key, uint64_t(i)) >= p ? float(double(load(a, i)) * inv) : 0.0f);
}

template <typename T>
__global__ void gather_kernel(const T* __restrict__ x, const int64_t* __restrict__ rows,
                              T* __restrict__ out, int64_t n, int64_t d) {
  const int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= n * d) return;
  const int64_t r = rows[i / d];
  out[i] = r < 0 ? T(0.0f) : x[r * d + i % d];
}

template <typename T>
__global__ void scatter_kernel(const T* __restrict__ src, const int64_t* __restrict__ rows,
                               T* __restrict__ dst, int64_t n, int64_t d) {
  const int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= n * d) return;
  dst[rows[i / d] * d + i % d] = src[i];
}

unsigned blocks_for(int64_t n) { return unsigned((n + kThreads - 1) / kThreads); }

void check_float(const Tensor& t, const char* what, const char* op) {
  GLMTUNE_CUDA_OP_REQUIRE(t.defined() && t.device().is_cuda() && t.is_contiguous() &&
                              (t.dtype() == DType::bf16 || t.dtype() == DType::f32),
                          std::string(op) + ": " + what + " " + detail::describe(t) +
                              " must be a contiguous bf16 or f32 CUDA tensor");
}

}  // namespace

Tensor broadcast_streams(const Tensor& x, int64_t hc_mult, float scale, cudaStream_t stream) {
  check_float(x, "x", "cuda::broadcast_streams");
  GLMTUNE_CUDA_OP_REQUIRE(x.dim() >= 1 && hc_mult >= 1,
                          "cuda::broadcast_streams: x needs a last dimension and H >= 1");
  Shape shape = x.shape();
  const int64_t d = shape.back();
  shape.insert(shape.end() - 1, hc_mult);
  Tensor out = Tensor::empty(shape, x.dtype(), x.device());
  const int64_t rows = d > 0 ? x.numel() / d : 0;
  if (x.numel() == 0) return out;
  detail::DeviceGuard guard(x.device().index);
  if (x.dtype() == DType::bf16)
    broadcast_kernel<<<blocks_for(x.numel()), kThreads, 0, stream>>>(
        static_cast<const bf16*>(x.data_ptr()), static_cast<bf16*>(out.data_ptr()), rows, d,
        int(hc_mult), scale);
  else
    broadcast_kernel<<<blocks_for(x.numel()), kThreads, 0, stream>>>(
        x.data<float>(), out.data<float>(), rows, d, int(hc_mult), scale);
  GLMTUNE_CUDA_CHECK_LAUNCH();
  return out;
}

Tensor reduce_streams(const Tensor& streams, float scale, cudaStream_t stream) {
  check_float(streams, "streams", "cuda::reduce_streams");
  GLMTUNE_CUDA_OP_REQUIRE(
      streams.dim() >= 2,
      "cuda::reduce_streams: streams must be [..., H, D], got " + streams.str());
  Shape shape = streams.shape();
  const int64_t d = shape.back(), h = shape[shape.size() - 2];
  shape.erase(shape.end() - 2);
  Tensor out = Tensor::empty(shape, streams.dtype(), streams.device());
  const int64_t n = out.numel();
  if (n == 0) return out;
  detail::DeviceGuard guard(streams.device().index);
  if (streams.dtype() == DType::bf16)
    reduce_kernel<<<blocks_for(n), kThreads, 0, stream>>>(
        static_cast<const bf16*>(streams.data_ptr()), static_cast<bf16*>(out.data_ptr()), n / d, d,
        int(h), scale);
  else
    reduce_kernel<<<blocks_for(n), kThreads, 0, stream>>>(streams.data<float>(), out.data<float>(),
                                                          n / d, d, int(h), scale);
  GLMTUNE_CUDA_CHECK_LAUNCH();
  return out;
}

Tensor gather_rows(const Tensor& x, const std::vector<int64_t>& rows, cudaStream_t stream) {
  check_float(x, "x", "cuda::gather_rows");
  GLMTUNE_CUDA_OP_REQUIRE(x.dim() == 2, "cuda::gather_rows: x must be [N, D], got " + x.str());
  const int64_t n = int64_t(rows.size()), d = x.size(1);
  for (int64_t r : rows)
    GLMTUNE_CUDA_OP_REQUIRE(r < x.size(0),
                            "cuda::gather_rows: row " + std::to_string(r) + " of " + x.str());
  Tensor out = Tensor::empty({n, d}, x.dtype(), x.device());
  if (n * d == 0) return out;
  detail::DeviceGuard guard(x.device().index);
  Tensor idx = Tensor::empty({n}, DType::i64, x.device());
  GLMTUNE_CUDA_CHECK(cudaMemcpyAsync(idx.data<int64_t>(), rows.data(), size_t(n) * sizeof(int64_t),
                                     cudaMemcpyHostToDevice, stream));
  // `rows` may be freed when this returns: the copy must be done first.
  GLMTUNE_CUDA_CHECK(cudaStreamSynchronize(stream));
  if (x.dtype() == DType::bf16)
    gather_kernel<<<blocks_for(n * d), kThreads, 0, stream>>>(
        static_cast<const bf16*>(x.data_ptr()), idx.data<int64_t>(),
        static_cast<bf16*>(out.data_ptr()), n, d);
  else
    gather_kernel<<<blocks_for(n * d), kThreads, 0, stream>>>(x.data<float>(), idx.data<int64_t>(),
                                                              out.data<float>(), n, d);
  GLMTUNE_CUDA_CHECK_LAUNCH();
  return out;
}

void scatter_rows(Tensor& dst, const std::vector<int64_t>& rows, const Tensor& src,
                  cudaStream_t stream) {
  check_float(dst, "dst", "cuda::scatter_rows");
  check_float(src, "src", "cuda::scatter_rows");
  const int64_t n = int64_t(rows.size());
  GLMTUNE_CUDA_OP_REQUIRE(dst.dim() == 2 && src.dim() == 2 && src.size(0) == n &&
                              src.size(1) == dst.size(1) && src.dtype() == dst.dtype() &&
                              src.device() == dst.device(),
                          "cuda::scatter_rows: src " + src.str() + " must hold one row of dst " +
                              dst.str() + " per index");
  for (int64_t r : rows)
    GLMTUNE_CUDA_OP_REQUIRE(r >= 0 && r < dst.size(0),
                            "cuda::scatter_rows: row " + std::to_string(r) + " of " + dst.str());
  const int64_t d = dst.size(1);
  if (n * d == 0) return;
  detail::DeviceGuard guard(dst.device().index);
  Tensor idx = Tensor::empty({n}, DType::i64, dst.device());
  GLMTUNE_CUDA_CHECK(cudaMemcpyAsync(idx.data<int64_t>(), rows.data(), size_t(n) * sizeof(int64_t),
                                     cudaMemcpyHostToDevice, stream));
  // `rows` may be freed when this returns: the copy must be done first.
  GLMTUNE_CUDA_CHECK(cudaStreamSynchronize(stream));
  if (dst.dtype() == DType::bf16)
    scatter_kernel<<<blocks_for(n * d), kThreads, 0, stream>>>(
        static_cast<const bf16*>(src.data_ptr()), idx.data<int64_t>(),
        static_cast<bf16*>(dst.data_ptr()), n, d);
  else
    scatter_kernel<<<blocks_for(n * d), kThreads, 0, stream>>>(
        src.data<float>(), idx.data<int64_t>(), dst.data<float>(), n, d);
  GLMTUNE_CUDA_CHECK_LAUNCH();
}

void add_inplace(Tensor& a, const Tensor& b, cudaStream_t stream) {
  check_float(a, "a", "cuda::add_inplace");
  check_float(b, "b", "cuda::add_inplace");
  GLMTUNE_CUDA_OP_REQUIRE(a.shape() == b.shape() && a.device() == b.device(),
                          "cuda::add_inplace: " + a.str() + " and " + b.str() + " differ");
  const int64_t n = a.numel();
  if (n == 0) return;
  detail::DeviceGuard guard(a.device().index);
  const bool a16 = a.dtype() == DType::bf16, b16 = b.dtype() == DType::bf16;
  void* ap = a.data_ptr();
  const void* bp = b.data_ptr();
  if (a16 && b16)
    add_kernel<<<blocks_for(n), kThreads, 0, stream>>>(static_cast<bf16*>(ap),
                                                       static_cast<const bf16*>(bp), n);
  else if (a16)
    add_kernel<<<blocks_for(n), kThreads, 0, stream>>>(static_cast<bf16*>(ap),
                                                       static_cast<const float*>(bp), n);
  else if (b16)
    add_kernel<<<blocks_for(n), kThreads, 0, stream>>>(static_cast<float*>(ap),
                                                       static_cast<const bf16*>(bp), n);
  else
    add_kernel<<<blocks_for(n), kThreads, 0, stream>>>(static_cast<float*>(ap),
                                                       static_cast<const float*>(bp), n);
  GLMTUNE_CUDA_CHECK_LAUNCH();
}

void scale_inplace(Tensor& a, double s, cudaStream_t stream) {
  check_float(a, "a", "cuda::scale_inplace");
  GLMTUNE_CUDA_OP_REQUIRE(a.is_contiguous(),
                          "cuda::scale_inplace: " + a.str() + " must be contiguous");
  const int64_t n = a.numel();
  if (n == 0) return;
  detail::DeviceGuard guard(a.device().index);
  if (a.dtype() == DType::bf16)
    scale_kernel<<<blocks_for(n), kThreads, 0, stream>>>(static_cast<bf16*>(a.data_ptr()), s, n);
  else
    scale_kernel<<<blocks_for(n), kThreads, 0, stream>>>(a.data<float>(), s, n);
  GLMTUNE_CUDA_CHECK_LAUNCH();
}

void dropout_inplace(Tensor& a, double p, uint64_t key, cudaStream_t stream) {
  check_float(a, "a", "cuda::dropout_inplace");
  GLMTUNE_CUDA_OP_REQUIRE(a.is_contiguous() && p >= 0 && p < 1,
                          "cuda::dropout_inplace: " + a.str() + " must be contiguous, p in [0, 1)");
  const int64_t n = a.numel();
  if (n == 0) return;
  detail::DeviceGuard guard(a.device().index);
  const double inv = 1.0 / (1.0 - p);
  if (a.dtype() == DType::bf16)
    dropout_kernel<<<blocks_for(n), kThreads, 0, stream>>>(static_cast<bf16*>(a.data_ptr()), p, inv,
                                                           key, n);
  else
    dropout_kernel<<<blocks_for(n), kThreads, 0, stream>>>(a.data<float>(), p, inv, key, n);
  GLMTUNE_CUDA_CHECK_LAUNCH();
}

}  // namespace glmtune::cuda

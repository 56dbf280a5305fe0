// RMSNorm forward and backward kernels (ops/cuda/norm.h).

#include <type_traits>

#include "glmtune/ops/cuda/common.cuh"
#include "glmtune/ops/cuda/norm.h"

namespace glmtune::cuda {
namespace {

using detail::bf16;

constexpr int kThreads = 256;
// Blocks of the backward when it also sums the weight gradient: each block owns a contiguous
// range of ceil(rows / kGradBlocks) rows, so the grouping depends on the row count only.
constexpr int64_t kGradBlocks = 512;

// The weighted value w ⊙ (x · r): bf16 storage rounds x · r to bf16 first, as the reference's cast
// does; f32 storage has nothing to round.
template <typename T>
__device__ __forceinline__ float weighted(float normalised, float w) {
  if constexpr (std::is_same_v<T, bf16>)
    return detail::round_bf16(normalised) * w;
  else
    return normalised * w;
}

// Σ x² over one row, the block's threads striding by VEC elements.
template <int VEC, typename T>
__device__ __forceinline__ float row_sum_squares(const T* __restrict__ xr, int n, float* scratch) {
  float ss = 0.0f;
  for (int j = threadIdx.x * VEC; j < n; j += blockDim.x * VEC) {
    float v[VEC];
    detail::load_vec<VEC>(xr + j, v);
#pragma unroll
    for (int k = 0; k < VEC; ++k) ss += v[k] * v[k];
  }
  return detail::block_sum(ss, scratch);
}

__device__ __forceinline__ float rstd_of(float sum_squares, int n, float eps) {
  // IEEE division and square root (no fast-math), as the CPU computes 1 / sqrt(mean + eps).
  return 1.0f / sqrtf(sum_squares / float(n) + eps);
}

template <int VEC, typename T>
__global__ void __launch_bounds__(kThreads)
    rms_norm_fwd_kernel(const T* __restrict__ x, int64_t ldx, const T* __restrict__ w,
                        T* __restrict__ y, int64_t ldy, float* __restrict__ rstd, int n,
                        float eps) {
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  const T* xr = x + row * ldx;
  T* yr = y + row * ldy;
  const float r = rstd_of(row_sum_squares<VEC>(xr, n, scratch), n, eps);
  if (rstd && threadIdx.x == 0) rstd[row] = r;
  // The second read of the row hits L1/L2: the block just streamed it.
  for (int j = threadIdx.x * VEC; j < n; j += blockDim.x * VEC) {
    float v[VEC];
    detail::load_vec<VEC>(xr + j, v);
    if (w) {
      float wv[VEC];
      detail::load_vec<VEC>(w + j, wv);
#pragma unroll
      for (int k = 0; k < VEC; ++k) v[k] = weighted<T>(v[k] * r, wv[k]);
    } else {
#pragma unroll
      for (int k = 0; k < VEC; ++k) v[k] *= r;
    }
    detail::store_vec<VEC>(yr + j, v);
  }
}

// g[k] *= w[j + k] when the norm has a weight (w null: g unchanged). Both passes of the backward
// scale the upstream gradient so, and must do it identically.
template <int VEC, typename T>
__device__ __forceinline__ void scale_by_weight(const T* __restrict__ w, int j, float (&g)[VEC]) {
  if (!w) return;
  float wv[VEC];
  detail::load_vec<VEC>(w + j, wv);
#pragma unroll
  for (int k = 0; k < VEC; ++k) g[k] *= wv[k];
}

// dx for rows [blockIdx.x · rows_per_block, ...) and, with kWeightGrad, this block's share of the
// weight gradient written to dw_partial[blockIdx.x, :]. The block's dw accumulators live in
// shared memory laid out as [VEC][n / VEC] so that a warp's accesses hit 32 different banks;
// each thread only ever touches its own columns, so they need no barrier.
template <int VEC, bool kWeightGrad, typename T>
__global__ void __launch_bounds__(kThreads)
    rms_norm_bwd_kernel(const T* __restrict__ dy, int64_t lddy, const T* __restrict__ x,
                        int64_t ldx, const T* __restrict__ w, const float* __restrict__ rstd,
                        T* __restrict__ dx, int64_t lddx, int64_t rows, int n,
                        int64_t rows_per_block, float eps, float* __restrict__ dw_partial) {
  extern __shared__ float dw_acc[];
  __shared__ float scratch[32];
  const int nvec = n / VEC;
  if constexpr (kWeightGrad) {
    for (int j = threadIdx.x * VEC; j < n; j += blockDim.x * VEC)
#pragma unroll
      for (int k = 0; k < VEC; ++k) dw_acc[k * nvec + j / VEC] = 0.0f;
  }
  const int64_t r0 = int64_t(blockIdx.x) * rows_per_block;
  const int64_t r1 = r0 + rows_per_block < rows ? r0 + rows_per_block : rows;
  for (int64_t row = r0; row < r1; ++row) {
    const T* xr = x + row * ldx;
    const T* gr = dy + row * lddy;
    const float r = rstd ? rstd[row] : rstd_of(row_sum_squares<VEC>(xr, n, scratch), n, eps);
    float dot = 0.0f;
    for (int j = threadIdx.x * VEC; j < n; j += blockDim.x * VEC) {
      float xv[VEC], gv[VEC];
      detail::load_vec<VEC>(xr + j, xv);
      detail::load_vec<VEC>(gr + j, gv);
      scale_by_weight<VEC>(w, j, gv);
#pragma unroll
      for (int k = 0; k < VEC; ++k) dot += gv[k] * xv[k];
    }
    dot = detail::block_sum(dot, scratch);
    // d(x·r)/dx = r·I − (r³/n)·x xᵀ
    const float c = dot * r * r * r / float(n);
    T* dxr = dx + row * lddx;
    for (int j = threadIdx.x * VEC; j < n; j += blockDim.x * VEC) {
      float xv[VEC], gv[VEC], out[VEC];
      detail::load_vec<VEC>(xr + j, xv);
      detail::load_vec<VEC>(gr + j, gv);
      if constexpr (kWeightGrad) {
#pragma unroll
        for (int k = 0; k < VEC; ++k) dw_acc[k * nvec + j / VEC] += gv[k] * (xv[k] * r);
      }
      scale_by_weight<VEC>(w, j, gv);
#pragma unroll
      for (int k = 0; k < VEC; ++k) out[k] = r * gv[k] - c * xv[k];
      detail::store_vec<VEC>(dxr + j, out);
    }
  }
  if constexpr (kWeightGrad) {
    float* part = dw_partial + int64_t(blockIdx.x) * n;
    for (int j = threadIdx.x * VEC; j < n; j += blockDim.x * VEC)
#pragma unroll
      for (int k = 0; k < VEC; ++k) part[j + k] = dw_acc[k * nvec + j / VEC];
  }
}

// dw[j] += Σ_b partial[b, j], blocks in order.
template <typename T>
__global__ void sum_partials_kernel(const float* __restrict__ partial, int64_t blocks, int n,
                                    T* __restrict__ dw) {
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= n) return;
  float acc = 0.0f;
  for (int64_t b = 0; b < blocks; ++b) acc += partial[b * n + j];
  if constexpr (std::is_same_v<T, float>) {
    dw[j] += acc;
  } else {
    dw[j] = __float2bfloat16_rn(__bfloat162float(dw[j]) + acc);
  }
}

void check_x(const Tensor& x, const char* op) {
  GLMTUNE_CUDA_OP_REQUIRE(x.defined() && x.device().is_cuda() &&
                              (x.dtype() == DType::bf16 || x.dtype() == DType::f32) &&
                              detail::has_row_layout(x),
                          std::string(op) + ": x " + detail::describe(x) +
                              " must be a bf16 or f32 CUDA tensor with unit inner stride");
}

void check_rows_tensor(const Tensor& t, const Tensor& x, const char* what, const char* op) {
  GLMTUNE_CUDA_OP_REQUIRE(t.defined() && t.dtype() == x.dtype() && t.shape() == x.shape() &&
                              t.device() == x.device() && detail::has_row_layout(t),
                          std::string(op) + ": " + what + " " + detail::describe(t) +
                              " must be a tensor of x's dtype and shape " + x.str() +
                              " (contiguous or rows with unit inner stride)");
}

void check_weight(const Tensor& w, const Tensor& x, const char* op) {
  if (!w.defined()) return;
  GLMTUNE_CUDA_OP_REQUIRE(w.dtype() == x.dtype() && w.dim() == 1 && w.size(0) == x.size(-1) &&
                              w.is_contiguous() && w.device() == x.device(),
                          std::string(op) + ": weight " + w.str() +
                              " must be a contiguous vector of x's dtype matching x " + x.str());
}

void check_stat(const Tensor& s, const Tensor& x, const char* op) {
  Shape lead = x.shape();
  lead.pop_back();
  GLMTUNE_CUDA_OP_REQUIRE(s.defined() && s.dtype() == DType::f32 && s.shape() == lead &&
                              s.is_contiguous() && s.device() == x.device(),
                          std::string(op) + ": rstd " + detail::describe(s) + " must be f32 " +
                              shape_str(lead) + " on " + x.device().str());
}

// 16-byte accesses need bf16 rows of whole 8-element groups on 16-byte boundaries.
bool vector_ok(DType dtype, int n, std::initializer_list<detail::RowsView> views, const Tensor& w) {
  if (dtype != DType::bf16 || n % 8 != 0) return false;
  for (const auto& v : views)
    if (!detail::aligned16(v.data) || v.ld % 8 != 0) return false;
  return !w.defined() || detail::aligned16(w.data_ptr());
}

}  // namespace

void rms_norm_out(Tensor& y, Tensor* rstd, const Tensor& x, const Tensor& weight, double eps,
                  cudaStream_t stream) {
  const char* op = "cuda::rms_norm";
  check_x(x, op);
  check_rows_tensor(y, x, "y", op);
  check_weight(weight, x, op);
  if (rstd) check_stat(*rstd, x, op);
  const detail::RowsView xv = detail::rows_view(x), yv = detail::rows_view(y);
  if (xv.rows == 0 || xv.cols == 0) return;
  GLMTUNE_CUDA_OP_REQUIRE(xv.cols <= INT32_MAX, std::string(op) + ": rows too long");
  const int n = int(xv.cols);
  detail::DeviceGuard guard(x.device().index);
  float* rp = rstd ? rstd->data<float>() : nullptr;
  auto launch = [&]<typename T>(auto kernel, T*) {
    const T* wp = weight.defined() ? static_cast<const T*>(weight.data_ptr()) : nullptr;
    kernel<<<unsigned(xv.rows), kThreads, 0, stream>>>(static_cast<const T*>(xv.data), xv.ld, wp,
                                                       static_cast<T*>(yv.data), yv.ld, rp, n,
                                                       float(eps));
  };
  if (x.dtype() == DType::f32)
    launch(rms_norm_fwd_kernel<1, float>, static_cast<float*>(nullptr));
  else if (vector_ok(x.dtype(), n, {xv, yv}, weight))
    launch(rms_norm_fwd_kernel<8, bf16>, static_cast<bf16*>(nullptr));
  else
    launch(rms_norm_fwd_kernel<1, bf16>, static_cast<bf16*>(nullptr));
  GLMTUNE_CUDA_CHECK_LAUNCH();
}

Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps, Tensor* rstd,
                cudaStream_t stream) {
  GLMTUNE_CUDA_OP_REQUIRE(x.defined() && x.dim() >= 1,
                          "cuda::rms_norm: x must have at least one dimension");
  Tensor y = Tensor::empty(x.shape(), x.dtype(), x.device());
  if (rstd) {
    Shape lead = x.shape();
    lead.pop_back();
    *rstd = Tensor::empty(lead, DType::f32, x.device());
  }
  rms_norm_out(y, rstd, x, weight, eps, stream);
  return y;
}

void rms_norm_backward_out(Tensor& dx, const Tensor& dy, const Tensor& x, const Tensor& weight,
                           double eps, const Tensor& rstd, Tensor* grad_weight,
                           cudaStream_t stream) {
  const char* op = "cuda::rms_norm_backward";
  check_x(x, op);
  check_rows_tensor(dy, x, "dy", op);
  check_rows_tensor(dx, x, "dx", op);
  check_weight(weight, x, op);
  GLMTUNE_CUDA_OP_REQUIRE(weight.defined() || !grad_weight,
                          std::string(op) + ": an un-weighted norm has no weight gradient");
  if (rstd.defined()) check_stat(rstd, x, op);
  const int64_t n64 = x.size(-1);
  if (grad_weight) {
    if (!grad_weight->defined()) *grad_weight = Tensor::zeros({n64}, DType::f32, x.device());
    GLMTUNE_CUDA_OP_REQUIRE(
        grad_weight->dim() == 1 && grad_weight->size(0) == n64 && grad_weight->is_contiguous() &&
            grad_weight->device() == x.device() &&
            (grad_weight->dtype() == DType::f32 || grad_weight->dtype() == DType::bf16),
        std::string(op) + ": weight gradient " + grad_weight->str() +
            " must be a contiguous f32/bf16 vector of " + std::to_string(n64));
  }
  const detail::RowsView xv = detail::rows_view(x), gv = detail::rows_view(dy),
                         dv = detail::rows_view(dx);
  if (xv.rows == 0 || xv.cols == 0) return;
  GLMTUNE_CUDA_OP_REQUIRE(xv.cols <= INT32_MAX, std::string(op) + ": rows too long");
  const int n = int(xv.cols);
  detail::DeviceGuard guard(x.device().index);
  const float* rp = rstd.defined() ? rstd.data<float>() : nullptr;
  const bool f32 = x.dtype() == DType::f32;
  const bool vec = vector_ok(x.dtype(), n, {xv, gv, dv}, weight);
  // One launch of `kernel` (storage T) over `blocks` blocks of `rows_per_block` rows each.
  auto launch = [&]<typename T>(auto kernel, T*, int64_t blocks, int64_t rows_per_block,
                                size_t smem, float* partial) {
    // Rows longer than 12288 need more than the default 48 KB of dynamic shared memory.
    if (smem > 48 * 1024)
      GLMTUNE_CUDA_CHECK(
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    const T* wp = weight.defined() ? static_cast<const T*>(weight.data_ptr()) : nullptr;
    kernel<<<unsigned(blocks), kThreads, smem, stream>>>(
        static_cast<const T*>(gv.data), gv.ld, static_cast<const T*>(xv.data), xv.ld, wp, rp,
        static_cast<T*>(dv.data), dv.ld, xv.rows, n, rows_per_block, float(eps), partial);
    GLMTUNE_CUDA_CHECK_LAUNCH();
  };
  if (!grad_weight) {
    // One block per row.
    if (f32)
      launch(rms_norm_bwd_kernel<1, false, float>, static_cast<float*>(nullptr), xv.rows, 1, 0,
             nullptr);
    else if (vec)
      launch(rms_norm_bwd_kernel<8, false, bf16>, static_cast<bf16*>(nullptr), xv.rows, 1, 0,
             nullptr);
    else
      launch(rms_norm_bwd_kernel<1, false, bf16>, static_cast<bf16*>(nullptr), xv.rows, 1, 0,
             nullptr);
    return;
  }
  const int64_t rows_per_block = (xv.rows + kGradBlocks - 1) / kGradBlocks;
  const int64_t blocks = (xv.rows + rows_per_block - 1) / rows_per_block;
  const size_t smem = size_t(n) * sizeof(float);
  Tensor partial = Tensor::empty({blocks, n64}, DType::f32, x.device());
  if (f32)
    launch(rms_norm_bwd_kernel<1, true, float>, static_cast<float*>(nullptr), blocks,
           rows_per_block, smem, partial.data<float>());
  else if (vec)
    launch(rms_norm_bwd_kernel<8, true, bf16>, static_cast<bf16*>(nullptr), blocks, rows_per_block,
           smem, partial.data<float>());
  else
    launch(rms_norm_bwd_kernel<1, true, bf16>, static_cast<bf16*>(nullptr), blocks, rows_per_block,
           smem, partial.data<float>());
  const unsigned col_blocks = unsigned((n + kThreads - 1) / kThreads);
  if (grad_weight->dtype() == DType::f32)
    sum_partials_kernel<float><<<col_blocks, kThreads, 0, stream>>>(partial.data<float>(), blocks,
                                                                    n, grad_weight->data<float>());
  else
    sum_partials_kernel<bf16><<<col_blocks, kThreads, 0, stream>>>(
        partial.data<float>(), blocks, n, reinterpret_cast<bf16*>(grad_weight->data_ptr()));
  GLMTUNE_CUDA_CHECK_LAUNCH();
}

Tensor rms_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& weight, double eps,
                         const Tensor& rstd, Tensor* grad_weight, cudaStream_t stream) {
  GLMTUNE_CUDA_OP_REQUIRE(x.defined() && x.dim() >= 1,
                          "cuda::rms_norm_backward: x must have at least one dimension");
  Tensor dx = Tensor::empty(x.shape(), x.dtype(), x.device());
  rms_norm_backward_out(dx, dy, x, weight, eps, rstd, grad_weight, stream);
  return dx;
}

}  // namespace glmtune::cuda

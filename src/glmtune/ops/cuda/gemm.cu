// The bias gradient of cuda::linear (ops/cuda/gemm.h): column sums of dy, deterministic.
// The GEMMs themselves are cuBLASLt calls in gemm_cuda.cpp.

#include "glmtune/ops/cuda/common.cuh"
#include "glmtune/ops/cuda/gemm.h"

namespace glmtune::cuda {
namespace {

using detail::bf16;

// Rows per partial sum. The grouping depends only on the problem size (never on the device or on
// timing), so the sums are bit-identical on every run.
constexpr int64_t kRowsPerGroup = 128;
constexpr int kThreads = 256;

// partial[g, c] = Σ_{r in group g} dy[r, c], rows in order. Each thread owns one column; a warp
// reads 32 neighbouring columns of a row (coalesced).
template <typename T>
__global__ void bias_grad_partial(const T* __restrict__ dy, int64_t ld, int64_t rows, int64_t cols,
                                  float* __restrict__ partial) {
  const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  const int64_t r0 = int64_t(blockIdx.y) * kRowsPerGroup;
  const int64_t r1 = r0 + kRowsPerGroup < rows ? r0 + kRowsPerGroup : rows;
  float acc = 0.0f;
  for (int64_t r = r0; r < r1; ++r) acc += detail::to_f(dy[r * ld + c]);
  partial[int64_t(blockIdx.y) * cols + c] = acc;
}

// db[c] += Σ_g partial[g, c], groups in order, then one rounding into db's type.
template <typename T>
__global__ void bias_grad_finish(const float* __restrict__ partial, int64_t groups, int64_t cols,
                                 T* __restrict__ db) {
  const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  float acc = 0.0f;
  for (int64_t g = 0; g < groups; ++g) acc += partial[g * cols + c];
  if constexpr (std::is_same_v<T, float>) {
    db[c] += acc;
  } else {
    db[c] = __float2bfloat16_rn(__bfloat162float(db[c]) + acc);
  }
}

}  // namespace

void linear_backward_bias(Tensor& db, const Tensor& dy, cudaStream_t stream) {
  GLMTUNE_CUDA_OP_REQUIRE(detail::has_row_layout(dy) && dy.device().is_cuda() &&
                              (dy.dtype() == DType::bf16 || dy.dtype() == DType::f32),
                          "cuda::linear_backward_bias: dy " + detail::describe(dy) +
                              " must be a bf16 or f32 CUDA tensor with unit inner stride");
  const detail::RowsView v = detail::rows_view(dy);
  GLMTUNE_CUDA_OP_REQUIRE(db.defined() && db.dim() == 1 && db.size(0) == v.cols &&
                              db.is_contiguous() && db.device() == dy.device() &&
                              (db.dtype() == DType::f32 || db.dtype() == DType::bf16),
                          "cuda::linear_backward_bias: db " + detail::describe(db) +
                              " must be a contiguous f32/bf16 vector of " + std::to_string(v.cols) +
                              " on " + dy.device().str());
  if (v.rows == 0 || v.cols == 0) return;
  detail::DeviceGuard guard(dy.device().index);
  const int64_t groups = (v.rows + kRowsPerGroup - 1) / kRowsPerGroup;
  GLMTUNE_CUDA_OP_REQUIRE(groups <= 65535, "cuda::linear_backward_bias: " + std::to_string(v.rows) +
                                               " rows is too many");
  Tensor partial = Tensor::empty({groups, v.cols}, DType::f32, dy.device());
  const unsigned col_blocks = unsigned((v.cols + kThreads - 1) / kThreads);
  const dim3 grid(col_blocks, unsigned(groups));
  if (dy.dtype() == DType::bf16)
    bias_grad_partial<<<grid, kThreads, 0, stream>>>(static_cast<const bf16*>(v.data), v.ld, v.rows,
                                                     v.cols, partial.data<float>());
  else
    bias_grad_partial<<<grid, kThreads, 0, stream>>>(static_cast<const float*>(v.data), v.ld,
                                                     v.rows, v.cols, partial.data<float>());
  GLMTUNE_CUDA_CHECK_LAUNCH();
  if (db.dtype() == DType::f32) {
    bias_grad_finish<float><<<col_blocks, kThreads, 0, stream>>>(partial.data<float>(), groups,
                                                                 v.cols, db.data<float>());
  } else {
    bias_grad_finish<bf16><<<col_blocks, kThreads, 0, stream>>>(
        partial.data<float>(), groups, v.cols, reinterpret_cast<bf16*>(db.data_ptr()));
  }
  GLMTUNE_CUDA_CHECK_LAUNCH();
}

}  // namespace glmtune::cuda

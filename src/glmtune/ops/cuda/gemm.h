#pragma once
// Dense GEMMs on the GPU through cuBLASLt: bf16 operands (or f32 ones in the fp32 mode, computed in
// full fp32 without TF32), fp32 accumulation, bf16 or fp32 results.
// This is the CUDA side of ops/linear.h (y = x W^T + b with W stored [out, in], row-major) and the
// raw GEMM that the fused ops (cross-entropy head, MLP) build on.
//
// Handles: one cuBLASLt handle per device, created on first use and kept for the process. Each
// (device, stream) pair gets its own workspace, taken once from the caching allocator, so ops
// issued on different streams never share scratch memory. Algorithms come from the cuBLASLt
// heuristic and are cached per problem (shape, layouts, types, alignments): the same problem
// always runs the same algorithm, which makes reruns bit-identical (cuBLAS guarantees that for a
// fixed algorithm, architecture and SM count on one stream).
//
// Every function runs asynchronously on `stream` (the legacy default stream when null). Tensors
// must live on one CUDA device. Like the caching allocator, the ops assume that memory a caller
// frees is reused on the same stream; callers that mix streams synchronise them first.

#include <cuda_runtime.h>

#include <cstdint>
#include <optional>

#include "glmtune/tensor/tensor.h"

namespace glmtune::cuda {

// Row-major C[m, n] = alpha · op(A)[m, k] · op(B)[k, n] + beta · C (+ bias[n] on every row), the
// same convention as ops::gemm: op(X) is X or X^T, and lda/ldb/ldc are the row strides (in
// elements) of the matrices as stored. A and B share `ab_dtype`, bf16 or f32; C is bf16 or f32
// and, when beta is 0, is not read (it may hold garbage, NaN included). `bias` has C's dtype.
// With `batch` > 1, one launch computes `batch` such products, product i on the matrices that
// start i·stride_a, i·stride_b and i·stride_c elements after a, b and c (the strides may be
// smaller than a matrix: the per-head slices of one [T, H·D] tensor are a batch of stride D).
struct GemmArgs {
  int device = 0;
  bool trans_a = false, trans_b = false;
  int64_t m = 0, n = 0, k = 0;
  const void* a = nullptr;
  int64_t lda = 0;
  const void* b = nullptr;
  int64_t ldb = 0;
  void* c = nullptr;
  int64_t ldc = 0;
  DType c_dtype = DType::bf16;
  float alpha = 1.0f, beta = 0.0f;
  const void* bias = nullptr;
  DType ab_dtype = DType::bf16;  // after the fields above, so their positional initialisers hold
  int64_t batch = 1, stride_a = 0, stride_b = 0, stride_c = 0;
};
void gemm(const GemmArgs& args, cudaStream_t stream = nullptr);

// y[..., N] = x[..., K] · w[N, K]^T (+ bias[N]). x and w share one dtype, bf16 or f32; y is bf16
// or f32 (its dtype picks the output type; the allocating form defaults to x's dtype); bias is
// bf16 or f32 (converted to y's dtype when they differ). x and y are contiguous or 2-D with unit
// inner stride (row-strided views work in place). With `accumulate`, the product (and the bias)
// is added to what y holds.
void linear_out(Tensor& y, const Tensor& x, const Tensor& w, const Tensor& bias = Tensor(),
                bool accumulate = false, cudaStream_t stream = nullptr);
Tensor linear(const Tensor& x, const Tensor& w, const Tensor& bias = Tensor(),
              std::optional<DType> out_dtype = std::nullopt, cudaStream_t stream = nullptr);

// dx[..., K] = dy[..., N] · w[N, K], written into dx (bf16 or f32; added to it with `accumulate`).
// dy and w share one dtype; the allocating form's dx defaults to it.
void linear_backward_input_out(Tensor& dx, const Tensor& dy, const Tensor& w,
                               bool accumulate = false, cudaStream_t stream = nullptr);
Tensor linear_backward_input(const Tensor& dy, const Tensor& w,
                             std::optional<DType> out_dtype = std::nullopt,
                             cudaStream_t stream = nullptr);

// dw[N, K] += dy[..., N]^T · x[..., K] (dy and x sharing one dtype), summed over all rows with
// fp32 accumulation inside the GEMM and one rounding into dw, which is f32 or bf16 (contiguous).
void linear_backward_weight(Tensor& dw, const Tensor& dy, const Tensor& x,
                            cudaStream_t stream = nullptr);

// db[N] += Σ_rows dy[..., N] (dy bf16 or f32; db f32 or bf16, contiguous). Deterministic: fixed
// groups of rows are summed in order into fp32 partials, which are then added in group order.
void linear_backward_bias(Tensor& db, const Tensor& dy, cudaStream_t stream = nullptr);

// Number of cuBLASLt heuristic queries so far (cache misses), for tests and benchmarks.
int64_t gemm_heuristic_queries();

}  // namespace glmtune::cuda

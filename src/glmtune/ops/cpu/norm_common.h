#pragma once
// Private helpers shared by the normalisation forward (norm.cpp) and backward (norm_backward.cpp)
// kernels.

#include <cmath>
#include <cstdint>

#include "glmtune/ops/cpu/common.h"

namespace glmtune::ops::cpu_detail {

// The CPU kernels read a weight or bias in x's dtype (its shape is checked before dispatch).
inline void check_vector_dtype(const Tensor& v, const Tensor& x, const char* what, const char* op) {
  GLMTUNE_ASSERT(!v.defined() || v.dtype() == x.dtype(), "{}: {} {} must be in the dtype of x {}",
                 op, what, v.str(), x.str());
}

// Mean and 1/sqrt(var + eps) of one row of n values, accumulated in double. Two-pass variance: the
// shifted sum does not cancel catastrophically for large means. The backward recomputes missing
// statistics with this same arithmetic, so both routes give bit-identical gradients.
template <typename T>
void layer_norm_row_stats(const T* xi, int64_t n, double eps, T& mean, T& rstd) {
  double s = 0;
  for (int64_t j = 0; j < n; ++j) s += double(xi[j]);
  const double mu = s / double(n);
  double ss = 0;
  for (int64_t j = 0; j < n; ++j) ss += (double(xi[j]) - mu) * (double(xi[j]) - mu);
  mean = T(mu);
  rstd = T(1) / std::sqrt(T(ss / double(n)) + T(eps));
}

// The row loop of the normalisation kernels: body(i, x_row) for each of `rows` rows of n values,
// on threads once the work pays off (the rows are independent).
template <typename T, typename Body>
void for_each_norm_row(const T* x, int64_t rows, int64_t n, Body body) {
#pragma omp parallel for schedule(static) if (rows * n > 65536)
  for (int64_t i = 0; i < rows; ++i) body(i, x + i * n);
}

// Σ x² of one row, accumulated in double.
template <typename T>
double row_sum_squares(const T* xi, int64_t n) {
  double ss = 0;
  for (int64_t j = 0; j < n; ++j) ss += double(xi[j]) * double(xi[j]);
  return ss;
}

// RMSNorm's 1/sqrt(mean(x²) + eps): the reference takes the rsqrt of (mean + eps) in the compute
// dtype. The forward and the backward's recomputation share it, so a recomputed value equals the
// saved one.
template <typename T>
T rms_rstd(const T* xi, int64_t n, double eps) {
  return T(1) / std::sqrt(T(row_sum_squares(xi, n) / double(n)) + T(eps));
}

// l2_norm's sqrt(‖x‖² + eps): eps inside the sqrt, as the reference (and FLA) do; not
// F.normalize's max(‖x‖, eps). Shared by the forward and the backward's recomputation.
template <typename T>
T l2_row_norm(const T* xi, int64_t n, double eps) {
  return std::sqrt(T(row_sum_squares(xi, n)) + T(eps));
}

}  // namespace glmtune::ops::cpu_detail

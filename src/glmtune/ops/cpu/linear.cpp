#include "glmtune/ops/linear.h"

#include <cblas.h>

#include <limits>

#include "glmtune/ops/checks.h"
#include "glmtune/ops/dispatch.h"

namespace glmtune::ops {
namespace {

blasint blas_dim(int64_t v) {
  // OpenBLAS may be built with 32-bit indices; a silent wrap would corrupt memory.
  GLMTUNE_ASSERT(v >= 0 && v <= int64_t(std::numeric_limits<blasint>::max()),
                 "GEMM dimension {} does not fit the BLAS index type", v);
  return blasint(v);
}

// What the CPU body takes beyond the checks before dispatch: one float dtype, an output of x's
// dimensions.
void check_operands(const Tensor& out, const Tensor& x, const Tensor& weight, const Tensor& bias) {
  GLMTUNE_ASSERT(x.dtype() == DType::f32 || x.dtype() == DType::f64,
                 "CPU linear computes in f32 or f64, got {}", x.str());
  GLMTUNE_ASSERT(weight.dtype() == x.dtype() && (!bias.defined() || bias.dtype() == x.dtype()),
                 "linear: weight {} and bias {} must have the dtype of input {}", weight.str(),
                 bias.defined() ? bias.str() : "(none)", x.str());
  GLMTUNE_ASSERT(out.dtype() == x.dtype() && out.is_contiguous() && out.dim() == x.dim(),
                 "linear: output {} must be contiguous, of x's rank and dtype", out.str());
  for (int64_t d = 0; d + 1 < x.dim(); ++d)
    GLMTUNE_ASSERT(out.size(d) == x.size(d), "linear: output {} does not match input {}", out.str(),
                   x.str());
}

template <typename T>
void linear_impl(Tensor& out, const Tensor& x_in, const Tensor& w_in, const Tensor& b_in,
                 bool accumulate) {
  const int64_t in = w_in.size(1), n_out = w_in.size(0);
  int64_t rows = 1;
  for (int64_t d = 0; d + 1 < x_in.dim(); ++d) rows *= x_in.size(d);
  T* y = out.data<T>();
  if (rows == 0 || n_out == 0) return;
  if (!accumulate) {
    for (int64_t i = 0; i < rows * n_out; ++i) y[i] = T(0);
  }
  if (b_in.defined()) {
    Tensor b = b_in.contiguous();
    const T* bp = b.data<T>();
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t o = 0; o < n_out; ++o) y[r * n_out + o] += bp[o];
  }
  if (in == 0) return;
  Tensor x = x_in.contiguous();
  // A weight stored as the transpose of a contiguous matrix (a `.transpose(0, 1)` view) is used in
  // place; any other layout is copied once.
  bool w_transposed_view = w_in.stride(0) == 1 && w_in.stride(1) >= n_out && n_out > 1;
  Tensor w =
      (w_in.stride(1) == 1 && w_in.stride(0) >= in) || w_transposed_view ? w_in : w_in.contiguous();
  const T* wp = w.data<T>();
  if (w_transposed_view) {
    // w^T stored as [in, out] with row stride w.stride(1).
    gemm<T>(false, false, rows, n_out, in, T(1), x.data<T>(), in, wp, w.stride(1), T(1), y, n_out);
  } else {
    gemm<T>(false, true, rows, n_out, in, T(1), x.data<T>(), in, wp, w.stride(0), T(1), y, n_out);
  }
}

}  // namespace

template <>
void gemm<float>(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                 const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
                 int64_t ldc) {
  if (m == 0 || n == 0) return;
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, blas_dim(m), blas_dim(n), blas_dim(k), alpha, a,
              blas_dim(std::max<int64_t>(lda, 1)), b, blas_dim(std::max<int64_t>(ldb, 1)), beta, c,
              blas_dim(std::max<int64_t>(ldc, 1)));
}

template <>
void gemm<double>(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, double alpha,
                  const double* a, int64_t lda, const double* b, int64_t ldb, double beta,
                  double* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  cblas_dgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, blas_dim(m), blas_dim(n), blas_dim(k), alpha, a,
              blas_dim(std::max<int64_t>(lda, 1)), b, blas_dim(std::max<int64_t>(ldb, 1)), beta, c,
              blas_dim(std::max<int64_t>(ldc, 1)));
}

void linear_out(Tensor& out, const Tensor& x, const Tensor& weight, const Tensor& bias,
                bool accumulate) {
  checks::linear_args(x, weight, bias, "linear_out");
  checks::linear_result(out, x, weight, "output", "linear_out");
  GLMTUNE_DISPATCH_CUDA(x, cuda_path::linear_out(out, x, weight, bias, accumulate));
  check_operands(out, x, weight, bias);
  if (x.dtype() == DType::f32)
    linear_impl<float>(out, x, weight, bias, accumulate);
  else
    linear_impl<double>(out, x, weight, bias, accumulate);
}

Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias) {
  checks::linear_args(x, weight, bias, "linear");
  GLMTUNE_DISPATCH_CUDA(x, cuda_path::linear(x, weight, bias));
  Shape shape = x.shape();
  shape.back() = weight.size(0);
  Tensor out = Tensor::empty(shape, x.dtype());
  linear_out(out, x, weight, bias, false);
  return out;
}

}  // namespace glmtune::ops

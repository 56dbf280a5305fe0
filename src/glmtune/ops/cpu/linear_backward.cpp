// Backward of the dense projection y = x W^T + b (ops/linear.h). Two GEMMs and a column sum:
// dx = dy W, dW += dy^T x, db += Σ_rows dy.

#include <vector>

#include "glmtune/ops/checks.h"
#include "glmtune/ops/dispatch.h"
#include "glmtune/ops/elementwise.h"
#include "glmtune/ops/grad.h"
#include "glmtune/ops/linear.h"

namespace glmtune::ops {
namespace {

// The caller's gradient buffer for `param`: zeros on first use, else checked so that a stale or
// mismatched buffer is an error rather than silent corruption.
Tensor& grad_slot(Tensor* slot, const Shape& shape, DType dtype, const char* what) {
  if (!slot->defined()) *slot = Tensor::zeros(shape, dtype);
  GLMTUNE_ASSERT(slot->shape() == shape && slot->dtype() == dtype && slot->is_contiguous() &&
                     slot->device().is_cpu(),
                 "linear_backward: {} gradient {} must be a contiguous CPU {}{}", what, slot->str(),
                 dtype_name(dtype), shape_str(shape));
  return *slot;
}

template <typename T>
Tensor backward_impl(const Tensor& dy_in, const Tensor& x_in, const Tensor& w_in,
                     Tensor* grad_weight, Tensor* grad_bias, bool need_input_grad) {
  const int64_t in = w_in.size(1), n_out = w_in.size(0);
  const int64_t rows = n_out > 0 ? dy_in.numel() / n_out : 0;
  Tensor dy = dy_in.contiguous();
  Tensor dx;
  if (need_input_grad) {
    dx = Tensor::zeros(x_in.shape(), x_in.dtype());
    if (rows > 0 && in > 0 && n_out > 0) {
      Tensor w = w_in.contiguous();
      // dx[r, i] = Σ_o dy[r, o] W[o, i]
      gemm<T>(false, false, rows, in, n_out, T(1), dy.data<T>(), n_out, w.data<T>(), in, T(0),
              dx.data<T>(), in);
    }
  }
  if (grad_weight) {
    Tensor& gw = grad_slot(grad_weight, w_in.shape(), w_in.dtype(), "weight");
    if (rows > 0 && in > 0 && n_out > 0) {
      Tensor x = x_in.contiguous();
      // dW[o, i] += Σ_r dy[r, o] x[r, i]; beta = 1 accumulates into the caller's buffer.
      gemm<T>(true, false, n_out, in, rows, T(1), dy.data<T>(), n_out, x.data<T>(), in, T(1),
              gw.data<T>(), in);
    }
  }
  if (grad_bias) {
    Tensor& gb = grad_slot(grad_bias, {n_out}, w_in.dtype(), "bias");
    T* b = gb.data<T>();
    const T* g = dy.data<T>();
    // Column sums in row order (fixed order: the result does not depend on threads), in double,
    // then added once to the caller's buffer.
    std::vector<double> acc(size_t(n_out), 0.0);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t o = 0; o < n_out; ++o) acc[size_t(o)] += double(g[r * n_out + o]);
    for (int64_t o = 0; o < n_out; ++o) b[o] += T(acc[size_t(o)]);
  }
  return dx;
}

}  // namespace

Tensor linear_backward(const Tensor& dy, const Tensor& x, const Tensor& weight, Tensor* grad_weight,
                       Tensor* grad_bias, bool need_input_grad) {
  const char* op = "linear_backward";
  checks::linear_args(x, weight, Tensor(), op);
  checks::linear_result(dy, x, weight, "dy", op);
  grad_weight = grad_if_trained(grad_weight, weight);
  GLMTUNE_DISPATCH_CUDA(
      x, cuda_path::linear_backward(dy, x, weight, grad_weight, grad_bias, need_input_grad));
  GLMTUNE_ASSERT(x.dtype() == DType::f32 || x.dtype() == DType::f64,
                 "CPU linear_backward computes in f32 or f64, got {}", x.str());
  GLMTUNE_ASSERT(dy.dtype() == x.dtype() && weight.dtype() == x.dtype(),
                 "linear_backward: dy {}, x {} and weight {} must share one dtype", dy.str(),
                 x.str(), weight.str());
  GLMTUNE_ASSERT(dy.dim() == x.dim(), "linear_backward: dy {} must have the rank of x {}", dy.str(),
                 x.str());
  for (int64_t d = 0; d + 1 < x.dim(); ++d)
    GLMTUNE_ASSERT(dy.size(d) == x.size(d), "linear_backward: dy {} does not match x {}", dy.str(),
                   x.str());
  if (x.dtype() == DType::f32)
    return backward_impl<float>(dy, x, weight, grad_weight, grad_bias, need_input_grad);
  return backward_impl<double>(dy, x, weight, grad_weight, grad_bias, need_input_grad);
}

void linear_backward_add(Tensor& dx_sum, const Tensor& dy, const Tensor& x, const Tensor& weight,
                         Tensor* grad_weight, Tensor* grad_bias) {
  const char* op = "linear_backward_add";
  checks::linear_args(x, weight, Tensor(), op);
  checks::linear_result(dy, x, weight, "dy", op);
  if (dx_sum.defined()) checks::same_shape(dx_sum, x, "the running input gradient", "x", op);
  grad_weight = grad_if_trained(grad_weight, weight);
  GLMTUNE_DISPATCH_CUDA(
      x, cuda_path::linear_backward_add(dx_sum, dy, x, weight, grad_weight, grad_bias));
  Tensor dx = linear_backward(dy, x, weight, grad_weight, grad_bias);
  if (!dx_sum.defined()) {
    dx_sum = std::move(dx);
    return;
  }
  GLMTUNE_ASSERT(dx_sum.shape() == dx.shape() && dx_sum.dtype() == dx.dtype() &&
                     dx_sum.device().is_cpu() && dx_sum.is_contiguous(),
                 "linear_backward_add: the running input gradient {} must be a contiguous {}",
                 dx_sum.str(), dx.str());
  add_into(dx_sum, dx);
}

}  // namespace glmtune::ops

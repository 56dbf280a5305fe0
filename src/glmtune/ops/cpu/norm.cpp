#include "glmtune/ops/norm.h"

#include <cmath>

#include "glmtune/ops/checks.h"
#include "glmtune/ops/cpu/common.h"
#include "glmtune/ops/cpu/norm_common.h"
#include "glmtune/ops/dispatch.h"

namespace glmtune::ops {
using namespace cpu_detail;
namespace {

// Rows of the last dimension of a contiguous copy of x.
struct Rows {
  Tensor x;
  int64_t rows = 0, n = 0;
};

// After the checks of ops/checks.h: what the CPU kernels take.
Rows as_rows(const Tensor& x, const char* op) {
  GLMTUNE_ASSERT(x.device().is_cpu(), "{}: CPU kernel got {}", op, x.str());
  GLMTUNE_ASSERT(x.dtype() == DType::f32 || x.dtype() == DType::f64,
                 "{}: CPU kernels compute in f32 or f64, got {}", op, x.str());
  Rows r;
  r.x = x.contiguous();
  r.n = x.size(-1);
  r.rows = r.n > 0 ? x.numel() / r.n : 0;
  return r;
}

// Statistic output shaped like x without its last dimension.
Tensor make_stat(Tensor* slot, const Tensor& x) {
  if (!slot) return Tensor();
  Shape s = x.shape();
  s.pop_back();
  *slot = Tensor::empty(s, x.dtype());
  return *slot;
}

// The forward kernels' row loop: body(i, x_row, y_row) for every row of r, y_row in `out`.
template <typename T, typename Body>
void for_each_row(const Rows& r, Tensor& out, Body body) {
  T* y = out.data<T>();
  for_each_norm_row(r.x.data<T>(), r.rows, r.n,
                    [&](int64_t i, const T* xi) { body(i, xi, y + i * r.n); });
}

template <typename T>
void rms_norm_kernel(const Rows& r, const Tensor& weight, const Tensor& gate,
                     GateActivation activation, double eps, Tensor& out, Tensor& rstd_out) {
  const T* w = ptr_or_null<T>(weight);
  Tensor gc = gate.defined() ? gate.contiguous() : Tensor();
  const T* z = ptr_or_null<T>(gc);
  T* rs = rstd_out.defined() ? rstd_out.data<T>() : nullptr;
  const int64_t n = r.n;
  for_each_row<T>(r, out, [&](int64_t i, const T* xi, T* yi) {
    const T rstd = rms_rstd(xi, n, eps);
    if (rs) rs[i] = rstd;
    for (int64_t j = 0; j < n; ++j) {
      T v = xi[j] * rstd;
      if (w) v = w[j] * v;
      if (z) {
        const T zj = z[i * n + j];
        v = v * (activation == GateActivation::sigmoid ? sigmoid(zj) : zj * sigmoid(zj));
      }
      yi[j] = v;
    }
  });
}

template <typename T>
void layer_norm_kernel(const Rows& r, const Tensor& weight, const Tensor& bias, double eps,
                       Tensor& out, Tensor& mean_out, Tensor& rstd_out) {
  const T* w = ptr_or_null<T>(weight);
  const T* b = ptr_or_null<T>(bias);
  T* ms = mean_out.defined() ? mean_out.data<T>() : nullptr;
  T* rs = rstd_out.defined() ? rstd_out.data<T>() : nullptr;
  const int64_t n = r.n;
  for_each_row<T>(r, out, [&](int64_t i, const T* xi, T* yi) {
    T mean, rstd;
    layer_norm_row_stats(xi, n, eps, mean, rstd);
    if (ms) ms[i] = mean;
    if (rs) rs[i] = rstd;
    for (int64_t j = 0; j < n; ++j) {
      T v = (xi[j] - mean) * rstd;
      if (w) v = v * w[j];
      if (b) v = v + b[j];
      yi[j] = v;
    }
  });
}

template <typename T>
void l2_norm_kernel(const Rows& r, double eps, Tensor& out, Tensor& norm_out) {
  T* ns = norm_out.defined() ? norm_out.data<T>() : nullptr;
  const int64_t n = r.n;
  for_each_row<T>(r, out, [&](int64_t i, const T* xi, T* yi) {
    const T norm = l2_row_norm(xi, n, eps);
    // A true division by the norm, as the reference.
    if (ns) ns[i] = norm;
    for (int64_t j = 0; j < n; ++j) yi[j] = xi[j] / norm;
  });
}

// The CPU body of rms_norm and rms_norm_gated (an undefined gate: no gating), after the op's
// checks and GPU dispatch.
Tensor rms_norm_cpu(const Tensor& x, const Tensor& weight, const Tensor& gate,
                    GateActivation activation, double eps, Tensor* rstd, const char* op) {
  Rows r = as_rows(x, op);
  check_vector_dtype(weight, x, "weight", op);
  Tensor out = Tensor::empty(x.shape(), x.dtype());
  Tensor rs = make_stat(rstd, x);
  Tensor weight_c = weight.defined() ? weight.contiguous() : Tensor();
  if (x.dtype() == DType::f32)
    rms_norm_kernel<float>(r, weight_c, gate, activation, eps, out, rs);
  else
    rms_norm_kernel<double>(r, weight_c, gate, activation, eps, out, rs);
  return out;
}

}  // namespace

Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps, Tensor* rstd) {
  checks::rows_input(x, "x", "rms_norm");
  checks::channel_vector(weight, x, "weight", "rms_norm");
  GLMTUNE_DISPATCH_CUDA(x, cuda_path::rms_norm(x, weight, eps, rstd));
  return rms_norm_cpu(x, weight, Tensor(), GateActivation::sigmoid, eps, rstd, "rms_norm");
}

Tensor rms_norm_gated(const Tensor& x, const Tensor& weight, const Tensor& gate, double eps,
                      GateActivation activation, Tensor* rstd) {
  checks::rows_input(x, "x", "rms_norm_gated");
  checks::channel_vector(weight, x, "weight", "rms_norm_gated");
  checks::same_as(gate, x, "gate", "x", "rms_norm_gated");
  GLMTUNE_DISPATCH_CUDA(x, cuda_path::rms_norm_gated(x, weight, gate, eps, activation, rstd));
  return rms_norm_cpu(x, weight, gate, activation, eps, rstd, "rms_norm_gated");
}

Tensor layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps,
                  Tensor* mean, Tensor* rstd) {
  checks::rows_input(x, "x", "layer_norm");
  checks::channel_vector(weight, x, "weight", "layer_norm");
  checks::channel_vector(bias, x, "bias", "layer_norm");
  GLMTUNE_DISPATCH_CUDA(x, cuda_path::layer_norm(x, weight, bias, eps, mean, rstd));
  Rows r = as_rows(x, "layer_norm");
  check_vector_dtype(weight, x, "weight", "layer_norm");
  check_vector_dtype(bias, x, "bias", "layer_norm");
  Tensor out = Tensor::empty(x.shape(), x.dtype());
  Tensor ms = make_stat(mean, x);
  Tensor rs = make_stat(rstd, x);
  Tensor weight_c = weight.defined() ? weight.contiguous() : Tensor();
  Tensor bias_c = bias.defined() ? bias.contiguous() : Tensor();
  if (x.dtype() == DType::f32)
    layer_norm_kernel<float>(r, weight_c, bias_c, eps, out, ms, rs);
  else
    layer_norm_kernel<double>(r, weight_c, bias_c, eps, out, ms, rs);
  return out;
}

Tensor l2_norm(const Tensor& x, double eps, Tensor* norm) {
  checks::rows_input(x, "x", "l2_norm");
  GLMTUNE_DISPATCH_CUDA(x, cuda_path::l2_norm(x, eps, norm));
  Rows r = as_rows(x, "l2_norm");
  Tensor out = Tensor::empty(x.shape(), x.dtype());
  Tensor ns = make_stat(norm, x);
  if (x.dtype() == DType::f32)
    l2_norm_kernel<float>(r, eps, out, ns);
  else
    l2_norm_kernel<double>(r, eps, out, ns);
  return out;
}

}  // namespace glmtune::ops

// Backward passes of the normalisations in ops/norm.h. Every op is per row of the last dimension;
// the per-row statistic either comes from the forward or is recomputed here with the forward's
// exact arithmetic, so both routes give bit-identical gradients.

#include <cmath>
#include <vector>

#include "glmtune/ops/checks.h"
#include "glmtune/ops/cpu/common.h"
#include "glmtune/ops/cpu/norm_common.h"
#include "glmtune/ops/dispatch.h"
#include "glmtune/ops/norm.h"

namespace glmtune::ops {
using namespace cpu_detail;
namespace {

struct RowsOf {
  int64_t rows = 0, n = 0;
};

// The checks every norm backward makes before it dispatches (ops/checks.h): x has rows, dy is
// like x, the weight (if any) is x's channel vector and a weight gradient needs a weight.
void check_backward_args(const Tensor& dy, const Tensor& x, const Tensor& weight,
                         const Tensor* grad_weight, const char* op) {
  checks::rows_input(x, "x", op);
  checks::same_as(dy, x, "dy", "x", op);
  checks::channel_vector(weight, x, "weight", op);
  GLMTUNE_ASSERT(weight.defined() || !grad_weight, "{}: an un-weighted norm has no weight gradient",
                 op);
}

// x's row geometry; the CPU kernels take CPU f32/f64 (the rest is checked before dispatch).
RowsOf check_rows(const Tensor& dy, const Tensor& x, const char* op) {
  GLMTUNE_ASSERT(x.device().is_cpu() && dy.device().is_cpu(), "{}: CPU kernel got {} and {}", op,
                 x.str(), dy.str());
  GLMTUNE_ASSERT(x.dtype() == DType::f32 || x.dtype() == DType::f64,
                 "{}: CPU kernels compute in f32 or f64, got {}", op, x.str());
  RowsOf r;
  r.n = x.size(-1);
  r.rows = r.n > 0 ? x.numel() / r.n : 0;
  return r;
}

// A supplied statistic must have x's leading shape; it is read as a flat contiguous vector.
Tensor check_stat(const Tensor& s, const Tensor& x, const char* what, const char* op) {
  if (!s.defined()) return s;
  Shape lead = x.shape();
  lead.pop_back();
  GLMTUNE_ASSERT(s.dtype() == x.dtype() && s.shape() == lead, "{}: {} {} must be {} for x {}", op,
                 what, s.str(), shape_str(lead), x.str());
  return s.contiguous();
}

Tensor& grad_slot(Tensor* slot, int64_t n, DType dtype, const char* what, const char* op) {
  if (!slot->defined()) *slot = Tensor::zeros({n}, dtype);
  GLMTUNE_ASSERT(slot->shape() == Shape{n} && slot->dtype() == dtype && slot->is_contiguous() &&
                     slot->device().is_cpu(),
                 "{}: {} gradient {} must be a contiguous CPU {}[{}]", op, what, slot->str(),
                 dtype_name(dtype), n);
  return *slot;
}

// Shared by the plain and the gated RMSNorm. `z` null: plain. `dz` receives the gate gradient.
template <typename T>
void rms_backward_kernel(const T* dy, const T* x, const T* w, const T* z, GateActivation act,
                         const T* rstd_in, double eps, int64_t rows, int64_t n, T* dx, T* dz,
                         T* dw) {
  for_each_norm_row(x, rows, n, [&](int64_t i, const T* xi) {
    const T* gi = dy + i * n;
    const T r = rstd_in ? rstd_in[i] : rms_rstd(xi, n, eps);
    // u = upstream gradient of the normalised value x·r: dy ⊙ w ⊙ act(z).
    double dot = 0;
    for (int64_t j = 0; j < n; ++j) {
      T u = gi[j];
      if (w) u *= w[j];
      if (z) {
        const T zj = z[i * n + j], s = sigmoid(zj);
        const T a = act == GateActivation::sigmoid ? s : zj * s;
        const T da = act == GateActivation::sigmoid ? s * (T(1) - s) : s * (T(1) + zj * (T(1) - s));
        // dz = dy ⊙ (w ⊙ x·r) ⊙ act'(z), the product rule's other factor.
        dz[i * n + j] = gi[j] * (w ? w[j] : T(1)) * (xi[j] * r) * da;
        u *= a;
      }
      dot += double(u) * double(xi[j]);
    }
    // d(x·r)/dx = r·I − (r³/n)·x x^T.
    const T c = T(dot) * r * r * r / T(n);
    for (int64_t j = 0; j < n; ++j) {
      T u = gi[j];
      if (w) u *= w[j];
      if (z) {
        const T zj = z[i * n + j], s = sigmoid(zj);
        u *= act == GateActivation::sigmoid ? s : zj * s;
      }
      dx[i * n + j] = r * u - c * xi[j];
    }
  });
  if (!dw) return;
  // dw: column sums over rows, in row order, in double.
  std::vector<double> acc(size_t(n), 0.0);
  for (int64_t i = 0; i < rows; ++i) {
    const T* xi = x + i * n;
    const T r = rstd_in ? rstd_in[i] : rms_rstd(xi, n, eps);
    for (int64_t j = 0; j < n; ++j) {
      T v = dy[i * n + j] * (xi[j] * r);
      if (z) {
        const T zj = z[i * n + j], s = sigmoid(zj);
        v *= act == GateActivation::sigmoid ? s : zj * s;
      }
      acc[size_t(j)] += double(v);
    }
  }
  for (int64_t j = 0; j < n; ++j) dw[j] += T(acc[size_t(j)]);
}

template <typename T>
void layer_norm_backward_kernel(const T* dy, const T* x, const T* w, const T* mean_in,
                                const T* rstd_in, double eps, int64_t rows, int64_t n, T* dx, T* dw,
                                T* db) {
  // Mean and rstd exactly as layer_norm_kernel computes them (two-pass variance).
  auto stats = [&](int64_t i, T& mean, T& rstd) {
    if (mean_in && rstd_in) {
      mean = mean_in[i];
      rstd = rstd_in[i];
      return;
    }
    T fresh_mean, fresh_rstd;
    layer_norm_row_stats(x + i * n, n, eps, fresh_mean, fresh_rstd);
    mean = mean_in ? mean_in[i] : fresh_mean;
    rstd = rstd_in ? rstd_in[i] : fresh_rstd;
  };
  for_each_norm_row(x, rows, n, [&](int64_t i, const T* xi) {
    const T* gi = dy + i * n;
    T mean, rstd;
    stats(i, mean, rstd);
    double su = 0, sux = 0;
    for (int64_t j = 0; j < n; ++j) {
      const T u = w ? gi[j] * w[j] : gi[j];
      su += double(u);
      sux += double(u) * double((xi[j] - mean) * rstd);
    }
    const T mu_u = T(su / double(n)), mu_ux = T(sux / double(n));
    for (int64_t j = 0; j < n; ++j) {
      const T u = w ? gi[j] * w[j] : gi[j];
      const T xhat = (xi[j] - mean) * rstd;
      dx[i * n + j] = rstd * (u - mu_u - xhat * mu_ux);
    }
  });
  if (!dw && !db) return;
  std::vector<double> aw(size_t(n), 0.0), ab(size_t(n), 0.0);
  for (int64_t i = 0; i < rows; ++i) {
    const T* xi = x + i * n;
    T mean, rstd;
    stats(i, mean, rstd);
    for (int64_t j = 0; j < n; ++j) {
      aw[size_t(j)] += double(dy[i * n + j] * ((xi[j] - mean) * rstd));
      ab[size_t(j)] += double(dy[i * n + j]);
    }
  }
  for (int64_t j = 0; j < n; ++j) {
    if (dw) dw[j] += T(aw[size_t(j)]);
    if (db) db[j] += T(ab[size_t(j)]);
  }
}

template <typename T>
void l2_backward_kernel(const T* dy, const T* x, const T* norm_in, double eps, int64_t rows,
                        int64_t n, T* dx) {
  for_each_norm_row(x, rows, n, [&](int64_t i, const T* xi) {
    const T* gi = dy + i * n;
    const T nu = norm_in ? norm_in[i] : l2_row_norm(xi, n, eps);
    // y = x/ν is what the forward returned (same division), so ⟨y, dy⟩ uses the forward's values.
    double dot = 0;
    for (int64_t j = 0; j < n; ++j) dot += double(xi[j] / nu) * double(gi[j]);
    const T d = T(dot);
    for (int64_t j = 0; j < n; ++j) dx[i * n + j] = (gi[j] - (xi[j] / nu) * d) / nu;
  });
}

}  // namespace

Tensor rms_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& weight, double eps,
                         const Tensor& rstd, Tensor* grad_weight) {
  const char* op = "rms_norm_backward";
  grad_weight = grad_if_trained(grad_weight, weight);
  check_backward_args(dy, x, weight, grad_weight, op);
  GLMTUNE_DISPATCH_CUDA(x, cuda_path::rms_norm_backward(dy, x, weight, eps, rstd, grad_weight));
  const RowsOf r = check_rows(dy, x, op);
  check_vector_dtype(weight, x, "weight", op);
  const Tensor rs = check_stat(rstd, x, "rstd", op);
  Tensor xc = x.contiguous(), gc = dy.contiguous();
  Tensor wc = weight.defined() ? weight.contiguous() : Tensor();
  Tensor dx = Tensor::empty(x.shape(), x.dtype());
  Tensor* gw = grad_weight ? &grad_slot(grad_weight, r.n, x.dtype(), "weight", op) : nullptr;
  if (x.dtype() == DType::f32)
    rms_backward_kernel<float>(gc.data<float>(), xc.data<float>(), ptr_or_null<float>(wc), nullptr,
                               GateActivation::sigmoid, ptr_or_null<float>(rs), eps, r.rows, r.n,
                               dx.data<float>(), nullptr, gw ? gw->data<float>() : nullptr);
  else
    rms_backward_kernel<double>(gc.data<double>(), xc.data<double>(), ptr_or_null<double>(wc),
                                nullptr, GateActivation::sigmoid, ptr_or_null<double>(rs), eps,
                                r.rows, r.n, dx.data<double>(), nullptr,
                                gw ? gw->data<double>() : nullptr);
  return dx;
}

RmsNormGatedGrads rms_norm_gated_backward(const Tensor& dy, const Tensor& x, const Tensor& weight,
                                          const Tensor& gate, double eps, GateActivation activation,
                                          const Tensor& rstd, Tensor* grad_weight) {
  const char* op = "rms_norm_gated_backward";
  grad_weight = grad_if_trained(grad_weight, weight);
  check_backward_args(dy, x, weight, grad_weight, op);
  checks::same_as(gate, x, "gate", "x", op);
  GLMTUNE_DISPATCH_CUDA(x, cuda_path::rms_norm_gated_backward(dy, x, weight, gate, eps, activation,
                                                              rstd, grad_weight));
  const RowsOf r = check_rows(dy, x, op);
  check_vector_dtype(weight, x, "weight", op);
  const Tensor rs = check_stat(rstd, x, "rstd", op);
  Tensor xc = x.contiguous(), gc = dy.contiguous(), zc = gate.contiguous();
  Tensor wc = weight.defined() ? weight.contiguous() : Tensor();
  RmsNormGatedGrads out{Tensor::empty(x.shape(), x.dtype()), Tensor::empty(x.shape(), x.dtype())};
  Tensor* gw = grad_weight ? &grad_slot(grad_weight, r.n, x.dtype(), "weight", op) : nullptr;
  if (x.dtype() == DType::f32)
    rms_backward_kernel<float>(gc.data<float>(), xc.data<float>(), ptr_or_null<float>(wc),
                               zc.data<float>(), activation, ptr_or_null<float>(rs), eps, r.rows,
                               r.n, out.dx.data<float>(), out.dgate.data<float>(),
                               gw ? gw->data<float>() : nullptr);
  else
    rms_backward_kernel<double>(gc.data<double>(), xc.data<double>(), ptr_or_null<double>(wc),
                                zc.data<double>(), activation, ptr_or_null<double>(rs), eps, r.rows,
                                r.n, out.dx.data<double>(), out.dgate.data<double>(),
                                gw ? gw->data<double>() : nullptr);
  return out;
}

Tensor layer_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& weight, double eps,
                           const Tensor& mean, const Tensor& rstd, Tensor* grad_weight,
                           Tensor* grad_bias) {
  const char* op = "layer_norm_backward";
  grad_weight = grad_if_trained(grad_weight, weight);
  check_backward_args(dy, x, weight, grad_weight, op);
  GLMTUNE_DISPATCH_CUDA(
      x, cuda_path::layer_norm_backward(dy, x, weight, eps, mean, rstd, grad_weight, grad_bias));
  const RowsOf r = check_rows(dy, x, op);
  check_vector_dtype(weight, x, "weight", op);
  const Tensor ms = check_stat(mean, x, "mean", op), rs = check_stat(rstd, x, "rstd", op);
  Tensor xc = x.contiguous(), gc = dy.contiguous();
  Tensor wc = weight.defined() ? weight.contiguous() : Tensor();
  Tensor dx = Tensor::empty(x.shape(), x.dtype());
  Tensor* gw = grad_weight ? &grad_slot(grad_weight, r.n, x.dtype(), "weight", op) : nullptr;
  Tensor* gb = grad_bias ? &grad_slot(grad_bias, r.n, x.dtype(), "bias", op) : nullptr;
  if (x.dtype() == DType::f32)
    layer_norm_backward_kernel<float>(gc.data<float>(), xc.data<float>(), ptr_or_null<float>(wc),
                                      ptr_or_null<float>(ms), ptr_or_null<float>(rs), eps, r.rows,
                                      r.n, dx.data<float>(), gw ? gw->data<float>() : nullptr,
                                      gb ? gb->data<float>() : nullptr);
  else
    layer_norm_backward_kernel<double>(
        gc.data<double>(), xc.data<double>(), ptr_or_null<double>(wc), ptr_or_null<double>(ms),
        ptr_or_null<double>(rs), eps, r.rows, r.n, dx.data<double>(),
        gw ? gw->data<double>() : nullptr, gb ? gb->data<double>() : nullptr);
  return dx;
}

Tensor l2_norm_backward(const Tensor& dy, const Tensor& x, double eps, const Tensor& norm) {
  const char* op = "l2_norm_backward";
  check_backward_args(dy, x, Tensor(), nullptr, op);
  GLMTUNE_DISPATCH_CUDA(x, cuda_path::l2_norm_backward(dy, x, eps, norm));
  const RowsOf r = check_rows(dy, x, op);
  const Tensor ns = check_stat(norm, x, "norm", op);
  Tensor xc = x.contiguous(), gc = dy.contiguous();
  Tensor dx = Tensor::empty(x.shape(), x.dtype());
  if (x.dtype() == DType::f32)
    l2_backward_kernel<float>(gc.data<float>(), xc.data<float>(), ptr_or_null<float>(ns), eps,
                              r.rows, r.n, dx.data<float>());
  else
    l2_backward_kernel<double>(gc.data<double>(), xc.data<double>(), ptr_or_null<double>(ns), eps,
                               r.rows, r.n, dx.data<double>());
  return dx;
}

}  // namespace glmtune::ops

// Backward of the clamped SwiGLU MLP (ops/mlp.h). The projections' gradients are plain GEMMs; the
// only non-linear step is the clamped SwiGLU, differentiated exactly as torch's autograd does it.

#include <algorithm>
#include <cmath>

#include "glmtune/ops/checks.h"
#include "glmtune/ops/cpu/common.h"
#include "glmtune/ops/cpu/mlp_common.h"
#include "glmtune/ops/dispatch.h"
#include "glmtune/ops/linear.h"
#include "glmtune/ops/mlp.h"

namespace glmtune::ops {
using namespace cpu_detail;
namespace {

// A writable output of gate's shape: allocated when undefined, else used in place when its layout
// is rows with unit inner stride.
int64_t output_rows(Tensor& out, const Tensor& like, const char* name) {
  if (!out.defined()) out = Tensor::empty(like.shape(), like.dtype());
  GLMTUNE_ASSERT(out.shape() == like.shape() && out.dtype() == like.dtype() &&
                     out.device().is_cpu() &&
                     (out.is_contiguous() || (out.dim() == 2 && out.stride(1) == 1)),
                 "swiglu_clamped_backward: {} {} must match {} and have unit inner stride", name,
                 out.str(), like.str());
  return out.is_contiguous() ? like.size(-1) : out.stride(0);
}

template <typename T>
void swiglu_backward_kernel(const RowView& g, const RowView& u, const T* dout, T limit, T* dg,
                            int64_t dg_stride, T* du, int64_t du_stride) {
  const int64_t cols = g.cols;
  for_each_gate_up_row<T>(g, u, [&](int64_t r, const T* gr, const T* ur) {
    const T* dr = dout + r * cols;
    for (int64_t c = 0; c < cols; ++c) {
      // torch's clamp with scalar bounds lets the gradient through only strictly inside the
      // bounds (measured on torch 2.15: a value equal to the limit gets 0).
      const bool gate_free = gr[c] < limit;
      const bool up_free = ur[c] > -limit && ur[c] < limit;
      const T a = gate_free ? gr[c] : limit;
      const T b = up_free ? ur[c] : std::clamp(ur[c], -limit, limit);
      const T s = T(1) / (T(1) + std::exp(-a));
      const T silu = a * s;
      dg[r * dg_stride + c] = gate_free ? dr[c] * b * s * (T(1) + a * (T(1) - s)) : T(0);
      du[r * du_stride + c] = up_free ? dr[c] * silu : T(0);
    }
  });
}

}  // namespace

void swiglu_clamped_backward(const Tensor& gate, const Tensor& up, const Tensor& dout, double limit,
                             Tensor& dgate, Tensor& dup) {
  const char* op = "swiglu_clamped_backward";
  checks::rows_input(gate, "gate", op);
  checks::same_as(up, gate, "up", "gate", op);
  checks::same_as(dout, gate, "dout", "gate", op);
  GLMTUNE_ASSERT(limit > 0, "{}: the limit must be positive, got {}", op, limit);
  GLMTUNE_DISPATCH_CUDA(gate,
                        cuda_path::swiglu_clamped_backward(gate, up, dout, limit, dgate, dup));
  GLMTUNE_ASSERT(gate.device().is_cpu() && is_compute_dtype(gate.dtype()),
                 "{}: computes on the CPU in f32 or f64, got {}", op, gate.str());
  const int64_t dg_stride = output_rows(dgate, gate, "dgate");
  const int64_t du_stride = output_rows(dup, gate, "dup");
  if (gate.numel() == 0) return;
  const RowView g = row_view(gate), u = row_view(up);
  const Tensor d = dout.contiguous();
  if (gate.dtype() == DType::f32)
    swiglu_backward_kernel<float>(g, u, d.data<float>(), float(limit), dgate.data<float>(),
                                  dg_stride, dup.data<float>(), du_stride);
  else
    swiglu_backward_kernel<double>(g, u, d.data<double>(), limit, dgate.data<double>(), dg_stride,
                                   dup.data<double>(), du_stride);
}

}  // namespace glmtune::ops

#include "glmtune/ops/mlp.h"

#include <algorithm>
#include <cmath>

#include "glmtune/ops/checks.h"
#include "glmtune/ops/cpu/mlp_common.h"
#include "glmtune/ops/dispatch.h"
#include "glmtune/ops/linear.h"

namespace glmtune::ops {
using namespace cpu_detail;
namespace {

template <typename T>
void swiglu_kernel(const RowView& g, const RowView& u, T limit, T* out) {
  const int64_t cols = g.cols;
  for_each_gate_up_row<T>(g, u, [&](int64_t r, const T* gr, const T* ur) {
    T* o = out + r * cols;
    for (int64_t c = 0; c < cols; ++c) {
      // The reference clamps the gate from above only: a very negative gate already drives silu
      // to zero, while a large one would grow without bound.
      const T a = std::min(gr[c], limit);
      const T b = std::clamp(ur[c], -limit, limit);
      o[c] = a / (T(1) + std::exp(-a)) * b;
    }
  });
}

}  // namespace

Tensor swiglu_clamped(const Tensor& gate, const Tensor& up, double limit) {
  checks::rows_input(gate, "gate", "swiglu_clamped");
  checks::same_as(up, gate, "up", "gate", "swiglu_clamped");
  GLMTUNE_ASSERT(limit > 0, "swiglu_clamped: the limit must be positive, got {}", limit);
  GLMTUNE_DISPATCH_CUDA(gate, cuda_path::swiglu_clamped(gate, up, limit));
  GLMTUNE_ASSERT(
      gate.device().is_cpu() && (gate.dtype() == DType::f32 || gate.dtype() == DType::f64),
      "swiglu_clamped computes on the CPU in f32 or f64, got {}", gate.str());
  Tensor out = Tensor::empty(gate.shape(), gate.dtype());
  if (out.numel() == 0) return out;
  const RowView g = row_view(gate), u = row_view(up);
  if (gate.dtype() == DType::f32)
    swiglu_kernel<float>(g, u, float(limit), out.data<float>());
  else
    swiglu_kernel<double>(g, u, limit, out.data<double>());
  return out;
}

}  // namespace glmtune::ops

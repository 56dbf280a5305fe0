// Backward of the clamped SwiGLU MLP (ops/mlp.h). The projections' gradients are plain GEMMs; the
// only non-linear step is the clamped SwiGLU, differentiated exactly as torch's autograd does it.

#include <algorithm>
#include <cmath>

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
  const T* gp = g.t.data<T>();
  const T* up = u.t.data<T>();
  const int64_t cols = g.cols;
#pragma omp parallel for schedule(static) if (g.rows * cols > 65536)
  for (int64_t r = 0; r < g.rows; ++r) {
    const T* gr = gp + r * g.row_stride;
    const T* ur = up + r * u.row_stride;
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
  }
}

}  // namespace

Tensor mlp_forward(const MlpParams& params, const Tensor& x, double swiglu_limit, MlpContext& ctx) {
  GLMTUNE_DISPATCH_CUDA(x, cuda_path::mlp_forward(params, x, swiglu_limit, &ctx));
  check_mlp_params(params);
  ctx.x = x;
  ctx.gate = linear(x, params.gate_proj);
  ctx.up = linear(x, params.up_proj);
  return linear(swiglu_clamped(ctx.gate, ctx.up, swiglu_limit), params.down_proj);
}

void swiglu_clamped_backward(const Tensor& gate, const Tensor& up, const Tensor& dout, double limit,
                             Tensor& dgate, Tensor& dup) {
  GLMTUNE_DISPATCH_CUDA(gate,
                        cuda_path::swiglu_clamped_backward(gate, up, dout, limit, dgate, dup));
  GLMTUNE_ASSERT(gate.defined() && up.defined() && dout.defined() && gate.dim() >= 1,
                 "swiglu_clamped_backward needs gate, up and dout");
  GLMTUNE_ASSERT(gate.shape() == up.shape() && dout.shape() == gate.shape(),
                 "swiglu_clamped_backward: gate {}, up {} and dout {} differ in shape", gate.str(),
                 up.str(), dout.str());
  GLMTUNE_ASSERT(gate.device().is_cpu() && up.device().is_cpu() && dout.device().is_cpu() &&
                     is_compute_dtype(gate.dtype()) && up.dtype() == gate.dtype() &&
                     dout.dtype() == gate.dtype(),
                 "swiglu_clamped_backward computes on CPU in f32 or f64, got {}, {} and {}",
                 gate.str(), up.str(), dout.str());
  GLMTUNE_ASSERT(limit > 0, "swiglu limit must be positive, got {}", limit);
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

Tensor mlp_backward(const MlpParams& params, const MlpContext& ctx, const Tensor& dy,
                    double swiglu_limit, MlpParams& grads) {
  GLMTUNE_DISPATCH_CUDA(dy, cuda_path::mlp_backward(params, ctx, dy, swiglu_limit, grads));
  check_mlp_params(params);
  GLMTUNE_ASSERT(ctx.x.defined() && ctx.gate.defined() && ctx.up.defined(),
                 "mlp_backward needs the context filled by mlp_forward");
  const DType dt = ctx.x.dtype();
  GLMTUNE_ASSERT(is_compute_dtype(dt) && ctx.x.device().is_cpu() && ctx.x.dim() >= 1 &&
                     ctx.x.size(-1) == params.gate_proj.size(1) && params.gate_proj.dtype() == dt &&
                     params.up_proj.dtype() == dt && params.down_proj.dtype() == dt,
                 "mlp_backward: input {} does not match the parameters {}", ctx.x.str(),
                 params.gate_proj.str());
  GLMTUNE_ASSERT(dy.defined() && dy.shape() == ctx.x.shape() && dy.dtype() == dt,
                 "mlp_backward: dy {} must match the input {}",
                 dy.defined() ? dy.str() : std::string("undefined"), ctx.x.str());
  // down_proj: y = act · Wd^T, with act recomputed from the saved projections.
  const Tensor act = swiglu_clamped(ctx.gate, ctx.up, swiglu_limit);
  const Tensor d_act = linear_backward(dy, act, params.down_proj, &grads.down_proj);
  Tensor d_gate, d_up;
  swiglu_clamped_backward(ctx.gate, ctx.up, d_act, swiglu_limit, d_gate, d_up);
  Tensor dx = linear_backward(d_gate, ctx.x, params.gate_proj, &grads.gate_proj);
  add_into(dx, linear_backward(d_up, ctx.x, params.up_proj, &grads.up_proj));
  return dx;
}

}  // namespace glmtune::ops

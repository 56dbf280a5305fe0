// The clamped SwiGLU MLP (ops/mlp.h), composed from the leaf ops once for every device.

#include "glmtune/ops/mlp.h"

#include "glmtune/ops/dispatch.h"
#include "glmtune/ops/fp8.h"
#include "glmtune/ops/linear.h"

namespace glmtune::ops {
namespace {

// The three projections are present, on x's device, and agree on I and D: gate, up [I, D],
// down [D, I].
void check_mlp_params(const MlpParams& params, const Tensor& x, const char* op) {
  GLMTUNE_ASSERT(params.gate_proj.weight.defined() && params.up_proj.weight.defined() &&
                     params.down_proj.weight.defined(),
                 "{}: MLP parameters are incomplete", op);
  GLMTUNE_ASSERT(params.gate_proj.weight.shape() == params.up_proj.weight.shape() &&
                     params.gate_proj.weight.dim() == 2 && params.down_proj.weight.dim() == 2 &&
                     params.down_proj.weight.size(1) == params.gate_proj.weight.size(0) &&
                     params.down_proj.weight.size(0) == params.gate_proj.weight.size(1),
                 "{}: MLP shapes disagree: gate {} up {} down {}", op,
                 params.gate_proj.weight.str(), params.up_proj.weight.str(),
                 params.down_proj.weight.str());
  GLMTUNE_ASSERT(x.defined() && x.dim() >= 1 && x.size(-1) == params.gate_proj.weight.size(1) &&
                     x.device() == params.gate_proj.weight.device(),
                 "{}: input {} does not match the parameters {}", op,
                 x.defined() ? x.str() : "undefined", params.gate_proj.weight.str());
}

}  // namespace

namespace {

void projections(const MlpParams& params, const Tensor& x, MlpContext& ctx) {
  ctx.x = x;
  const Fp8InputShare share(x);
  ctx.gate = linear(x, params.gate_proj);
  ctx.up = linear(x, params.up_proj);
}

}  // namespace

Tensor mlp_forward(const MlpParams& params, const Tensor& x, double swiglu_limit, MlpContext& ctx) {
  GLMTUNE_TIME_OP("mlp_forward", x);
  check_mlp_params(params, x, "mlp_forward");
  projections(params, x, ctx);
  return linear(swiglu_clamped(ctx.gate, ctx.up, swiglu_limit), params.down_proj);
}

void mlp_projections(const MlpParams& params, const Tensor& x, MlpContext& ctx) {
  GLMTUNE_TIME_OP("mlp_projections", x);
  check_mlp_params(params, x, "mlp_projections");
  projections(params, x, ctx);
}

Tensor mlp_forward(const MlpParams& params, const Tensor& x, double swiglu_limit) {
  MlpContext ctx;
  return mlp_forward(params, x, swiglu_limit, ctx);
}

Tensor mlp_backward(const MlpParams& params, const MlpContext& ctx, const Tensor& dy,
                    double swiglu_limit, MlpParams& grads) {
  GLMTUNE_TIME_OP("mlp_backward", dy);
  check_mlp_params(params, ctx.x, "mlp_backward");
  GLMTUNE_ASSERT(ctx.gate.defined() && ctx.up.defined(),
                 "mlp_backward needs the context filled by mlp_forward");
  GLMTUNE_ASSERT(dy.defined() && dy.shape() == ctx.x.shape() && dy.dtype() == ctx.x.dtype() &&
                     dy.device() == ctx.x.device(),
                 "mlp_backward: dy {} must match the input {}",
                 dy.defined() ? dy.str() : std::string("undefined"), ctx.x.str());
  // The activation is recomputed from the saved projections rather than kept.
  const Tensor act = swiglu_clamped(ctx.gate, ctx.up, swiglu_limit);
  const Tensor d_act = linear_backward(dy, act, params.down_proj, &grads.down_proj);
  Tensor d_gate, d_up;
  swiglu_clamped_backward(ctx.gate, ctx.up, d_act, swiglu_limit, d_gate, d_up);
  // dx = d_gate Wg + d_up Wu, summed in gradient_sum_dtype and rounded once.
  Tensor dx;
  const Fp8InputShare share(ctx.x);
  linear_backward_add(dx, d_gate, ctx.x, params.gate_proj, &grads.gate_proj);
  linear_backward_add(dx, d_up, ctx.x, params.up_proj, &grads.up_proj);
  return dx.to(ctx.x.dtype());
}

}  // namespace glmtune::ops

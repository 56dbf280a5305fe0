#pragma once
// Clamped SwiGLU MLP (docs/model/dsa_moe.md, "Clamped SwiGLU MLP"): the dense FFN of the first
// layers and the MoE's shared expert (width moe_intermediate_size · n_shared_experts).
//
//   gate = x Wg^T,  up = x Wu^T
//   y    = ( silu(min(gate, lim)) ⊙ clamp(up, −lim, lim) ) Wd^T
//
// The gate is clamped from above only, the up projection on both sides, and both clamps sit on
// the projection outputs before the activation (reference Glm5NextTextMLP and
// Glm5NextTextExperts._apply_gate). CPU tensors in f32 (reference path) or f64 (finite-difference
// tests); every operand shares the dtype.

#include "glmtune/ops/linear.h"
#include "glmtune/tensor/tensor.h"

namespace glmtune::ops {

// Released names under `mlp.` (dense) or `mlp.shared_experts.` (shared expert).
struct MlpParams {
  Linear gate_proj;  // gate_proj [I, D]
  Linear up_proj;    // up_proj   [I, D]
  Linear down_proj;  // down_proj [D, I]
};

// The list of MlpParams' fields (ops/linear.h), named as under `mlp.` (or `mlp.shared_experts.`).
template <typename A, typename B, typename F>
void zip_mlp_params(A& a, B& b, F&& f) {
  zip_linear("gate_proj", a.gate_proj, b.gate_proj, f);
  zip_linear("up_proj", a.up_proj, b.up_proj, f);
  zip_linear("down_proj", a.down_proj, b.down_proj, f);
}

// silu(min(gate, limit)) ⊙ clamp(up, −limit, limit), elementwise. gate and up have one shape
// [..., I] and may be strided views (e.g. the two halves of a fused gate_up product); the result
// is contiguous.
Tensor swiglu_clamped(const Tensor& gate, const Tensor& up, double limit);

// x [..., D] -> [..., D].
Tensor mlp_forward(const MlpParams& params, const Tensor& x, double swiglu_limit);

// ---- Backward (ops/cpu/mlp_backward.cpp) ----
//
// Gradients follow the reference's autograd (torch 2.15 `clamp` with scalar bounds): the clamp
// passes the gradient only strictly inside its bounds, i.e. where gate < lim and where
// −lim < up < lim; at a bound or beyond it the gradient is 0. silu'(a) = σ(a)(1 + a(1 − σ(a))).

// What mlp_backward needs from the forward: the input and both projections before the clamps.
// The activation is recomputed from them (elementwise, cheaper than keeping a third [N, I] tensor).
struct MlpContext {
  Tensor x;     // [..., D] the input, as given
  Tensor gate;  // [..., I] x Wg^T before the clamp
  Tensor up;    // [..., I] x Wu^T before the clamp
};

// mlp_forward that also fills `ctx` for mlp_backward.
Tensor mlp_forward(const MlpParams& params, const Tensor& x, double swiglu_limit, MlpContext& ctx);

// The context alone (x, gate, up), without the activation and the down projection: what a
// backward needs where the forward's output is not (a layer's MLP rerun for its gradient).
void mlp_projections(const MlpParams& params, const Tensor& x, MlpContext& ctx);

// Gradient of swiglu_clamped with respect to its (unclamped) inputs, given the output gradient
// `dout` (shape of gate). `dgate` / `dup` receive the results: undefined ones are allocated
// (contiguous); defined ones must have gate's shape and unit inner stride (2-D views with a uniform
// row stride qualify, e.g. the two halves of a fused [N, 2I] gradient) and are overwritten.
void swiglu_clamped_backward(const Tensor& gate, const Tensor& up, const Tensor& dout, double limit,
                             Tensor& dgate, Tensor& dup);

// dy [..., D] -> dx [..., D] (the shape of ctx.x). Adds the parameter gradients into `grads`,
// which mirrors MlpParams (same names and shapes); an undefined entry is created as zeros first.
Tensor mlp_backward(const MlpParams& params, const MlpContext& ctx, const Tensor& dy,
                    double swiglu_limit, MlpParams& grads);

}  // namespace glmtune::ops

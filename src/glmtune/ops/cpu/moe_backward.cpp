// Backward of the MoE block (ops/moe.h): routed experts per expert bucket (recomputed forward,
// then the GEMM gradients), the combine weights back through normalisation, scaling and sigmoid to
// the router weight, and the shared expert through mlp_backward.

#include <algorithm>
#include <cmath>
#include <vector>

#include "glmtune/ops/checks.h"
#include "glmtune/ops/cpu/common.h"
#include "glmtune/ops/cpu/moe_common.h"
#include "glmtune/ops/dispatch.h"
#include "glmtune/ops/linear.h"
#include "glmtune/ops/moe.h"

namespace glmtune::ops {
using namespace cpu_detail;
namespace {

void check_routing(const MoeConfig& cfg, const Routing& routing, int64_t rows, DType dt) {
  GLMTUNE_ASSERT(routing.indices.defined() && routing.indices.dtype() == DType::i32 &&
                     routing.indices.dim() == 2 && routing.indices.size(0) == rows &&
                     routing.indices.size(1) == cfg.top_k,
                 "MoE routing indices {} do not match {} rows and top_k {}",
                 describe(routing.indices), rows, cfg.top_k);
  GLMTUNE_ASSERT(routing.logits.defined() && routing.logits.dtype() == dt &&
                     routing.logits.dim() == 2 && routing.logits.size(0) == rows &&
                     routing.logits.size(1) == cfg.n_experts,
                 "MoE router logits {} do not match {} rows and {} experts",
                 describe(routing.logits), rows, cfg.n_experts);
  GLMTUNE_ASSERT(routing.weights.defined() && routing.weights.dtype() == dt &&
                     routing.weights.shape() == routing.indices.shape(),
                 "MoE combine weights {} do not match the indices {}", describe(routing.weights),
                 routing.indices.str());
  const Tensor idx_t = routing.indices.contiguous();
  const int32_t* idx = idx_t.data<int32_t>();
  for (int64_t i = 0; i < idx_t.numel(); ++i)
    GLMTUNE_ASSERT(idx[i] >= 0 && idx[i] < cfg.n_experts, "routed expert id {} out of [0, {})",
                   idx[i], cfg.n_experts);
}

template <typename T>
void route_backward_kernel(const MoeConfig& cfg, const T* logits, const int32_t* idx,
                           const T* d_weights, int64_t rows, T* d_logits) {
  const int64_t n_exp = cfg.n_experts, k = cfg.top_k;
  const T rsf = T(cfg.routed_scaling_factor);
#pragma omp parallel for schedule(static) if (rows * k > 16384)
  for (int64_t r = 0; r < rows; ++r) {
    const int32_t* ir = idx + r * k;
    const T* dw = d_weights + r * k;
    T* dl = d_logits + r * n_exp;
    T sum = T(0), dot = T(0);
    for (int64_t i = 0; i < k; ++i) {
      const T p = T(1) / (T(1) + std::exp(-logits[r * n_exp + ir[i]]));
      sum += p;
      dot += dw[i] * p;
    }
    // With w_k = rsf·p_k/den, den = Σ_j p_j + 1e-20 (the forward's order: sum, then the 1e-20):
    //   ∂L/∂p_j = rsf·(dw_j/den − Σ_k dw_k p_k / den²).
    const T den = sum + T(1e-20);
    for (int64_t i = 0; i < k; ++i) {
      const T p = T(1) / (T(1) + std::exp(-logits[r * n_exp + ir[i]]));
      const T dp = cfg.norm_topk_prob ? rsf * (dw[i] / den - dot / (den * den)) : rsf * dw[i];
      // dσ/dlogit = p(1 − p). += so that a routing listing an expert twice stays correct.
      dl[ir[i]] += dp * p * (T(1) - p);
    }
  }
}

template <typename T>
Tensor route_backward(const MoeConfig& cfg, const Routing& routing, const Tensor& d_weights_in) {
  const int64_t rows = routing.indices.size(0);
  const Tensor logits = routing.logits.contiguous();
  const Tensor idx = routing.indices.contiguous();
  const Tensor dw = d_weights_in.contiguous();
  Tensor d_logits = Tensor::zeros({rows, cfg.n_experts}, logits.dtype());
  route_backward_kernel<T>(cfg, logits.data<T>(), idx.data<int32_t>(), dw.data<T>(), rows,
                           d_logits.data<T>());
  return d_logits;
}

template <typename T>
Tensor moe_backward_impl(const MoeConfig& cfg, const MoeParams& params, const MoeContext& ctx,
                         const Tensor& dy_in, MoeParams& grads, const Tensor& d_router_logits) {
  const Tensor x = ctx.x.contiguous();
  const Tensor dy = dy_in.contiguous();
  const int64_t rows = x.size(0), dim = x.size(1), k = cfg.top_k;
  const Tensor router = params.router_weight.contiguous();
  Linear gate_up = params.gate_up_proj, down = params.down_proj;
  const Linear d_gate_up = fused_expert_grads(gate_up, grads.gate_up_proj, "experts.gate_up_proj");
  const Linear d_down = fused_expert_grads(down, grads.down_proj, "experts.down_proj");
  const int64_t inter = down.weight.size(2);

  const Tensor idx_t = ctx.routing.indices.contiguous();
  const Tensor w_t = ctx.routing.weights.contiguous();
  const int32_t* idx = idx_t.data<int32_t>();
  const T* w = w_t.data<T>();
  const T* xp = x.data<T>();
  const T* dyp = dy.data<T>();

  // The same bucketing as the forward: (row, k) slots grouped by expert, rows ascending.
  const ExpertBuckets buckets = bucket_by_expert(idx, rows * k, cfg.n_experts);
  const std::vector<int64_t>& start = buckets.start;
  const std::vector<int64_t>& slot = buckets.slot;

  Tensor dx = Tensor::zeros({rows, dim}, x.dtype());
  Tensor d_weights = Tensor::zeros({rows, k}, x.dtype());
  T* dxp = dx.data<T>();
  T* dwp = d_weights.data<T>();
  for (int64_t e = 0; e < cfg.n_experts; ++e) {
    const int64_t n = start[size_t(e) + 1] - start[size_t(e)];
    if (n == 0) continue;  // an expert without tokens gets no gradient (the reference skips it)
    const int64_t* sel = slot.data() + start[size_t(e)];
    Tensor xe = Tensor::empty({n, dim}, x.dtype());
    T* xep = xe.data<T>();
    for (int64_t r = 0; r < n; ++r) std::copy_n(xp + (sel[r] / k) * dim, dim, xep + r * dim);
    // Recompute the expert's forward for these rows.
    const Linear wgu = expert_projection(gate_up, e), wd = expert_projection(down, e);
    const Tensor h = linear(xe, wgu);  // [n, 2Im]
    const Tensor hg = h.narrow(1, 0, inter), hu = h.narrow(1, inter, inter);
    const Tensor act = swiglu_clamped(hg, hu, cfg.swiglu_limit);  // [n, Im]
    const Tensor ye = linear(act, wd);                            // [n, D]
    const T* yep = ye.data<T>();
    // y[row] += w · ye: dw = ⟨dy[row], ye⟩, dye = w · dy[row].
    Tensor dye = Tensor::empty({n, dim}, x.dtype());
    T* dyep = dye.data<T>();
    for (int64_t r = 0; r < n; ++r) {
      const T* dyr = dyp + (sel[r] / k) * dim;
      const T wk = w[sel[r]];
      T dot = T(0);
      for (int64_t d = 0; d < dim; ++d) {
        dot += dyr[d] * yep[r * dim + d];
        dyep[r * dim + d] = wk * dyr[d];
      }
      dwp[sel[r]] = dot;
    }
    // ye = act · Wd^T; the expert's slice of the gradient buffer accumulates in place.
    Linear d_down_e = expert_grads(d_down, e);
    const Tensor d_act = linear_backward(dye, act, wd, &d_down_e);
    // Through the clamped SwiGLU into the fused [n, 2Im] gradient (gate half first).
    Tensor dh = Tensor::empty({n, 2 * inter}, x.dtype());
    Tensor dhg = dh.narrow(1, 0, inter), dhu = dh.narrow(1, inter, inter);
    swiglu_clamped_backward(hg, hu, d_act, cfg.swiglu_limit, dhg, dhu);
    // h = xe · Wgu^T.
    Linear d_gate_up_e = expert_grads(d_gate_up, e);
    const Tensor dxe = linear_backward(dh, xe, wgu, &d_gate_up_e);
    const T* dxep = dxe.data<T>();
    // A row picks an expert at most once, so the rows of one bucket never collide.
#pragma omp parallel for schedule(static) if (n * dim > 65536)
    for (int64_t r = 0; r < n; ++r) {
      T* dxr = dxp + (sel[r] / k) * dim;
      for (int64_t d = 0; d < dim; ++d) dxr[d] += dxep[r * dim + d];
    }
  }

  // Router: logits = x · Wr^T; only the selected experts' logits carry a gradient.
  Tensor d_logits = route_backward<T>(cfg, ctx.routing, d_weights);
  if (d_router_logits.defined()) {
    const Tensor extra = d_router_logits.contiguous();
    T* dl = d_logits.data<T>();
    const T* ex = extra.data<T>();
    for (int64_t i = 0; i < d_logits.numel(); ++i) dl[i] += ex[i];
  }
  const Tensor d_router_x = linear_backward(d_logits, x, router, &grads.router_weight);

  // The shared expert sees the same input.
  const Tensor d_shared =
      mlp_backward(params.shared, ctx.shared, dy, cfg.swiglu_limit, grads.shared);
  const T* dr = d_router_x.data<T>();
  const T* ds = d_shared.data<T>();
  for (int64_t i = 0; i < rows * dim; ++i) dxp[i] += dr[i] + ds[i];
  return dx;
}

}  // namespace

MoeRoutedActivations gate_up_only(MoeRoutedActivations a) {
  return {Tensor(), std::move(a.gate_up), Tensor(), Tensor(), std::move(a.u_gate_up), Tensor()};
}

MoeOutput moe_forward(const MoeConfig& cfg, const MoeParams& params, const Tensor& x,
                      int64_t counted_rows, MoeContext& ctx, bool keep_routed) {
  check_moe_args(cfg, params, x, "moe_forward");
  GLMTUNE_DISPATCH_CUDA(x, cuda_path::moe_forward(cfg, params, x, counted_rows, &ctx, keep_routed));
  // The CPU backward runs the experts again from x and the routing (nothing to keep).
  MoeOutput out;
  out.routing = moe_route(cfg, params.router_weight, params.e_score_correction_bias, x);
  out.y = moe_experts(cfg, params.gate_up_proj, params.down_proj, x, out.routing);
  // Shared expert last, as in the reference (and as moe_forward without a context).
  const Tensor shared = mlp_forward(params.shared, x, cfg.swiglu_limit, ctx.shared);
  add_into(out.y, shared);
  out.expert_counts = moe_expert_counts(out.routing, cfg.n_experts, counted_rows);
  ctx.x = x;
  ctx.routing = out.routing;
  return out;
}

Tensor moe_route_backward(const MoeConfig& cfg, const Routing& routing, const Tensor& d_weights) {
  const char* op = "moe_route_backward";
  check_config(cfg);
  const int64_t rows = routing.indices.defined() ? routing.indices.size(0) : 0;
  GLMTUNE_ASSERT(d_weights.defined() && d_weights.shape() == routing.indices.shape(),
                 "{}: the combine-weight gradient {} must be shaped like the routing {}", op,
                 describe(d_weights), describe(routing.indices));
  check_routing_args(cfg, routing, rows, d_weights.device(), /*any_k=*/false, op);
  GLMTUNE_DISPATCH_CUDA(d_weights, cuda_path::moe_route_backward(cfg, routing, d_weights));
  const DType dt = routing.logits.defined() ? routing.logits.dtype() : DType::f32;
  GLMTUNE_ASSERT(is_compute_dtype(dt), "MoE router backward computes in f32 or f64, got {}",
                 describe(routing.logits));
  check_routing(cfg, routing, rows, dt);
  GLMTUNE_ASSERT(d_weights.defined() && d_weights.shape() == routing.indices.shape() &&
                     d_weights.dtype() == dt,
                 "MoE combine-weight gradient {} must match the routing {}", describe(d_weights),
                 routing.indices.str());
  if (dt == DType::f32) return route_backward<float>(cfg, routing, d_weights);
  return route_backward<double>(cfg, routing, d_weights);
}

Tensor moe_backward(const MoeConfig& cfg, const MoeParams& params, const MoeContext& ctx,
                    const Tensor& dy, MoeParams& grads, const Tensor& d_router_logits) {
  const char* op = "moe_backward";
  GLMTUNE_ASSERT(ctx.x.defined(), "{}: needs the context filled by moe_forward", op);
  check_moe_args(cfg, params, ctx.x, op);
  check_routing_args(cfg, ctx.routing, ctx.x.size(0), ctx.x.device(), /*any_k=*/false, op);
  checks::same_shape(dy, ctx.x, "dy", "the input", op);
  if (d_router_logits.defined())
    checks::same_shape(d_router_logits, ctx.routing.logits, "the router-logit gradient",
                       "the logits", op);
  GLMTUNE_DISPATCH_CUDA(dy, cuda_path::moe_backward(cfg, params, ctx, dy, grads, d_router_logits));
  const DType dt = ctx.x.dtype();
  GLMTUNE_ASSERT(is_compute_dtype(dt), "CPU moe_backward computes in f32 or f64, got input {}",
                 ctx.x.str());
  check_routing(cfg, ctx.routing, ctx.x.size(0), dt);
  GLMTUNE_ASSERT(dy.dtype() == dt && params.router_weight.dtype() == dt &&
                     params.gate_up_proj.weight.dtype() == dt &&
                     params.down_proj.weight.dtype() == dt &&
                     (!d_router_logits.defined() || d_router_logits.dtype() == dt),
                 "CPU moe_backward: dy {}, the router weight {}, the experts {} / {} and the "
                 "router-logit gradient must have the input's dtype {}",
                 dy.str(), params.router_weight.str(), params.gate_up_proj.weight.str(),
                 params.down_proj.weight.str(), dtype_name(dt));
  check_expert_adapter(params.gate_up_proj, "gate_up_proj");
  check_expert_adapter(params.down_proj, "down_proj");
  if (dt == DType::f32)
    return moe_backward_impl<float>(cfg, params, ctx, dy, grads, d_router_logits);
  return moe_backward_impl<double>(cfg, params, ctx, dy, grads, d_router_logits);
}

namespace {}  // namespace

Tensor moe_backward_routed_elsewhere(const MoeConfig& cfg, const MoeParams& params, const Tensor& x,
                                     const Routing& routing, const Tensor& dy,
                                     const Tensor& routed_dx, const Tensor& routed_d_weights,
                                     MoeParams& grads, const Tensor& d_router_logits) {
  const char* op = "moe_backward_routed_elsewhere";
  check_config(cfg);
  check_moe_rows(x, "input", op);
  check_router_args(cfg, params.router_weight, params.e_score_correction_bias, x, op);
  check_routing_args(cfg, routing, x.size(0), x.device(), /*any_k=*/false, op);
  checks::same_shape(dy, x, "dy", "the input", op);
  checks::same_shape(routed_dx, x, "the routed input gradient", "the input", op);
  checks::same_shape(routed_d_weights, routing.indices, "the combine-weight gradient",
                     "the routing indices", op);
  GLMTUNE_DISPATCH_CUDA(
      dy, cuda_path::moe_backward_routed_elsewhere(cfg, params, x, routing, dy, routed_dx,
                                                   routed_d_weights, grads, d_router_logits));
  GLMTUNE_ASSERT(is_compute_dtype(x.dtype()), "{}: the CPU computes in f32 or f64, got input {}",
                 op, x.str());
  Tensor d_route = moe_route_backward(cfg, routing, routed_d_weights);
  if (d_router_logits.defined()) d_route = ops::add(d_route, d_router_logits);
  const Tensor d_router_x = linear_backward(d_route, x, params.router_weight, &grads.router_weight);
  MlpContext shared;
  mlp_projections(params.shared, x, shared);  // the backward reads gate and up only
  const Tensor d_shared = mlp_backward(params.shared, shared, dy, cfg.swiglu_limit, grads.shared);
  return ops::add(routed_dx, ops::add(d_router_x, d_shared));
}

}  // namespace glmtune::ops

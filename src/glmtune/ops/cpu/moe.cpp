#include "glmtune/ops/moe.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "glmtune/ops/cpu/common.h"
#include "glmtune/ops/cpu/moe_common.h"
#include "glmtune/ops/dispatch.h"
#include "glmtune/ops/linear.h"

namespace glmtune::ops {
using namespace cpu_detail;
namespace {

template <typename T>
void route_kernel(const MoeConfig& cfg, const T* logits, const T* bias, int64_t rows, T* weights,
                  int32_t* indices) {
  const int64_t n_exp = cfg.n_experts, n_group = cfg.n_group, per_group = n_exp / n_group;
  const int64_t k = cfg.top_k;
#pragma omp parallel if (rows * n_exp > 16384)
  {
    std::vector<T> p(n_exp), c(n_exp), group_score(n_group);
    std::vector<int64_t> order(n_exp), groups(n_group);
    std::vector<char> allowed(n_exp);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const T* lr = logits + r * n_exp;
      for (int64_t e = 0; e < n_exp; ++e) {
        p[e] = T(1) / (T(1) + std::exp(-lr[e]));
        // The correction bias steers which experts are chosen; the combine weights below read
        // the un-biased p.
        c[e] = p[e] + bias[e];
      }
      std::fill(allowed.begin(), allowed.end(), char(1));
      if (cfg.topk_group < n_group) {
        for (int64_t g = 0; g < n_group; ++g)
          group_score[g] = top2_sum(c.data() + g * per_group, per_group);
        std::iota(groups.begin(), groups.end(), int64_t(0));
        std::partial_sort(groups.begin(), groups.begin() + cfg.topk_group, groups.end(),
                          [&](int64_t a, int64_t b) {
                            return ranks_before(group_score[a], a, group_score[b], b);
                          });
        std::fill(allowed.begin(), allowed.end(), char(0));
        for (int64_t i = 0; i < cfg.topk_group; ++i)
          std::fill_n(allowed.begin() + groups[i] * per_group, per_group, char(1));
      }
      int64_t n_allowed = 0;
      for (int64_t e = 0; e < n_exp; ++e)
        if (allowed[e]) order[n_allowed++] = e;
      std::partial_sort(order.begin(), order.begin() + k, order.begin() + n_allowed,
                        [&](int64_t a, int64_t b) { return ranks_before(c[a], a, c[b], b); });
      T* wr = weights + r * k;
      int32_t* ir = indices + r * k;
      T sum = T(0);
      for (int64_t i = 0; i < k; ++i) {
        ir[i] = int32_t(order[i]);
        wr[i] = p[order[i]];
        sum += wr[i];
      }
      if (cfg.norm_topk_prob) {
        // The reference adds 1e-20 to the denominator (a no-op unless every weight underflows).
        const T denom = sum + T(1e-20);
        for (int64_t i = 0; i < k; ++i) wr[i] /= denom;
      }
      for (int64_t i = 0; i < k; ++i) wr[i] *= T(cfg.routed_scaling_factor);
    }
  }
}

template <typename T>
Tensor experts_kernel(const MoeConfig& cfg, const Linear& gate_up_proj, const Linear& down_proj,
                      const Tensor& x_in, const Routing& routing) {
  const Tensor x = x_in.contiguous();
  const Tensor idx_t = routing.indices.contiguous();
  const Tensor w_t = routing.weights.contiguous();
  const int64_t rows = x.size(0), dim = x.size(1), k = idx_t.size(1);
  const int64_t inter = down_proj.weight.size(2);
  const int32_t* idx = idx_t.data<int32_t>();
  const T* w = w_t.data<T>();

  const ExpertBuckets buckets = bucket_by_expert(idx, rows * k, cfg.n_experts);
  const std::vector<int64_t>& start = buckets.start;
  const std::vector<int64_t>& slot = buckets.slot;

  Tensor out = Tensor::zeros({rows, dim}, x.dtype());
  T* y = out.data<T>();
  const T* xp = x.data<T>();
  for (int64_t e = 0; e < cfg.n_experts; ++e) {
    const int64_t n = start[e + 1] - start[e];
    if (n == 0) continue;
    const int64_t* sel = slot.data() + start[e];
    Tensor xe = Tensor::empty({n, dim}, x.dtype());
    T* xep = xe.data<T>();
#pragma omp parallel for schedule(static) if (n * dim > 65536)
    for (int64_t r = 0; r < n; ++r) std::copy_n(xp + (sel[r] / k) * dim, dim, xep + r * dim);
    const Tensor h = linear(xe, expert_projection(gate_up_proj, e));
    const Tensor a =
        swiglu_clamped(h.narrow(1, 0, inter), h.narrow(1, inter, inter), cfg.swiglu_limit);
    const Tensor ye = linear(a, expert_projection(down_proj, e));
    const T* yep = ye.data<T>();
    // A row picks an expert at most once, so the rows of one expert never collide.
#pragma omp parallel for schedule(static) if (n * dim > 65536)
    for (int64_t r = 0; r < n; ++r) {
      const T wk = w[sel[r]];
      T* yr = y + (sel[r] / k) * dim;
      for (int64_t d = 0; d < dim; ++d) yr[d] += yep[r * dim + d] * wk;
    }
  }
  return out;
}

}  // namespace

Routing moe_route(const MoeConfig& cfg, const Tensor& router_weight,
                  const Tensor& e_score_correction_bias, const Tensor& x) {
  const char* op = "moe_route";
  check_config(cfg);
  check_moe_rows(x, "input", op);
  check_router_args(cfg, router_weight, e_score_correction_bias, x, op);
  GLMTUNE_DISPATCH_CUDA(x, cuda_path::moe_route(cfg, router_weight, e_score_correction_bias, x));
  GLMTUNE_ASSERT(is_compute_dtype(x.dtype()) && router_weight.dtype() == x.dtype() &&
                     e_score_correction_bias.dtype() == x.dtype(),
                 "CPU MoE routes in f32 or f64: input {}, router weight {} and bias {} in one",
                 x.str(), router_weight.str(), e_score_correction_bias.str());
  Routing out;
  out.logits = linear(x, router_weight);
  const int64_t rows = x.size(0);
  out.weights = Tensor::empty({rows, cfg.top_k}, x.dtype());
  out.indices = Tensor::empty({rows, cfg.top_k}, DType::i32);
  const Tensor bias = e_score_correction_bias.contiguous();
  if (x.dtype() == DType::f32)
    route_kernel<float>(cfg, out.logits.data<float>(), bias.data<float>(), rows,
                        out.weights.data<float>(), out.indices.data<int32_t>());
  else
    route_kernel<double>(cfg, out.logits.data<double>(), bias.data<double>(), rows,
                         out.weights.data<double>(), out.indices.data<int32_t>());
  return out;
}

void check_expert_adapter(const Linear& fused, const char* name) {
  if (!fused.lora.defined()) return;
  const Tensor &w = fused.weight, &a = fused.lora.A, &b = fused.lora.B;
  GLMTUNE_ASSERT(w.defined() && w.dim() == 3,
                 "experts.{}: the fused weight {} must be [E, out, in]", name,
                 w.defined() ? w.str() : std::string("undefined"));
  check_expert_adapter_shapes(fused, name, "check_expert_adapter");
  GLMTUNE_ASSERT(a.dtype() == w.dtype() && b.dtype() == w.dtype(),
                 "experts.{} adapter A {} and B {} must have the weight's dtype {}", name, a.str(),
                 b.str(), w.str());
}

Tensor moe_experts(const MoeConfig& cfg, const Tensor& gate_up_proj, const Tensor& down_proj,
                   const Tensor& x, const Routing& routing) {
  return moe_experts(cfg, Linear(gate_up_proj), Linear(down_proj), x, routing);
}

Tensor moe_experts(const MoeConfig& cfg, const Linear& gate_up, const Linear& down, const Tensor& x,
                   const Routing& routing) {
  const char* op = "moe_experts";
  check_config(cfg);
  check_moe_rows(x, "input", op);
  check_experts_args(cfg, gate_up, down, x, op);
  check_routing_args(cfg, routing, x.size(0), x.device(), /*any_k=*/true, op);
  GLMTUNE_DISPATCH_CUDA(x, cuda_path::moe_experts(cfg, gate_up, down, x, routing));
  const Tensor& gate_up_proj = gate_up.weight;
  const Tensor& down_proj = down.weight;
  GLMTUNE_ASSERT(is_compute_dtype(x.dtype()) && gate_up_proj.dtype() == x.dtype() &&
                     down_proj.dtype() == x.dtype(),
                 "CPU experts compute in f32 or f64: input {}, gate_up_proj {} and down_proj {} "
                 "in one",
                 x.str(), gate_up_proj.str(), down_proj.str());
  check_expert_adapter(gate_up, "gate_up_proj");
  check_expert_adapter(down, "down_proj");
  check_experts_routing(routing, x);
  if (x.dtype() == DType::f32) return experts_kernel<float>(cfg, gate_up, down, x, routing);
  return experts_kernel<double>(cfg, gate_up, down, x, routing);
}

Tensor moe_expert_counts(const Routing& routing, int64_t n_experts, int64_t rows) {
  GLMTUNE_ASSERT(routing.indices.defined() && routing.indices.dtype() == DType::i32 &&
                     routing.indices.dim() == 2 && n_experts > 0,
                 "moe_expert_counts: needs int32 [T, K] routing indices and experts, got {} and {}",
                 routing.indices.defined() ? routing.indices.str() : "undefined", n_experts);
  GLMTUNE_ASSERT(rows <= routing.indices.size(0), "moe_expert_counts: {} rows of a routing over {}",
                 rows, routing.indices.size(0));
  GLMTUNE_DISPATCH_CUDA(routing.indices, cuda_path::moe_expert_counts(routing, n_experts, rows));
  const int64_t total = routing.indices.size(0), k = routing.indices.size(1);
  if (rows < 0) rows = total;
  const Tensor idx_t = routing.indices.contiguous();
  const int32_t* idx = idx_t.data<int32_t>();
  Tensor counts = Tensor::zeros({n_experts}, DType::i64);
  int64_t* c = counts.data<int64_t>();
  for (int64_t i = 0; i < rows * k; ++i) {
    GLMTUNE_ASSERT(idx[i] >= 0 && idx[i] < n_experts, "routed expert id {} out of [0, {})", idx[i],
                   n_experts);
    ++c[idx[i]];
  }
  return counts;
}

MoeOutput moe_forward(const MoeConfig& cfg, const MoeParams& params, const Tensor& x,
                      int64_t counted_rows) {
  check_moe_args(cfg, params, x, "moe_forward");
  GLMTUNE_DISPATCH_CUDA(x, cuda_path::moe_forward(cfg, params, x, counted_rows, nullptr, false));
  MoeOutput out;
  out.routing = moe_route(cfg, params.router_weight, params.e_score_correction_bias, x);
  out.y = moe_experts(cfg, params.gate_up_proj, params.down_proj, x, out.routing);
  // The shared expert sees the same input and is added after the routed sum, as the reference.
  const Tensor shared = mlp_forward(params.shared, x, cfg.swiglu_limit);
  add_into(out.y, shared);
  out.expert_counts = moe_expert_counts(out.routing, cfg.n_experts, counted_rows);
  return out;
}

}  // namespace glmtune::ops

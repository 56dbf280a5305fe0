#pragma once
// Private helpers shared by the MoE forward (moe.cpp) and backward (moe_backward.cpp) kernels.

#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

#include "glmtune/ops/cpu/common.h"
#include "glmtune/ops/moe.h"

namespace glmtune::ops::cpu_detail {

// The routing's (row, k) slots grouped by expert, rows ascending within an expert (a counting
// sort): expert e's slots are slot[start[e]] .. slot[start[e + 1] − 1], each the flat index
// row·K + k. The backward regroups exactly as the forward did, so each expert sees its rows in
// the same order and its GEMMs sum in the same order.
struct ExpertBuckets {
  std::vector<int64_t> start;  // [n_experts + 1]
  std::vector<int64_t> slot;   // [n_slots]
};

inline ExpertBuckets bucket_by_expert(const int32_t* idx, int64_t n_slots, int64_t n_experts) {
  ExpertBuckets b;
  b.start.assign(size_t(n_experts) + 1, 0);
  for (int64_t i = 0; i < n_slots; ++i) {
    GLMTUNE_ASSERT(idx[i] >= 0 && idx[i] < n_experts, "routed expert id {} out of [0, {})", idx[i],
                   n_experts);
    ++b.start[size_t(idx[i]) + 1];
  }
  std::partial_sum(b.start.begin(), b.start.end(), b.start.begin());
  b.slot.resize(size_t(n_slots));
  std::vector<int64_t> fill(b.start.begin(), b.start.end() - 1);
  for (int64_t i = 0; i < n_slots; ++i) b.slot[size_t(fill[size_t(idx[i])]++)] = i;
  return b;
}

// The gradient buffer of a fused expert tensor: created as zeros when undefined, otherwise it must
// match the parameter. It must exist up front because each expert's slice of it is handed to
// linear_backward as a view that accumulates in place.
inline Tensor& expert_grad_slot(Tensor& grad, const Tensor& param, const std::string& name) {
  if (!grad.defined()) grad = Tensor::zeros(param.shape(), param.dtype());
  GLMTUNE_ASSERT(grad.shape() == param.shape() && grad.dtype() == param.dtype() &&
                     grad.is_contiguous() && grad.device().is_cpu(),
                 "MoE gradient {} must be a contiguous CPU tensor like its parameter {}, got {}",
                 name, param.str(), grad.str());
  return grad;
}

// Makes the fused projection `fused` (weight and adapter) contiguous for per-expert views and
// returns its gradient buffers, those of `slot` (the MoeParams gradients), created where undefined:
// the weight's unless it is frozen (each expert's backward then skips it), the adapter's A and B
// when it has one. The single-process and the expert-parallel backward share it.
inline Linear fused_expert_grads(Linear& fused, Linear& slot, const std::string& name) {
  Linear grad;
  fused.weight = fused.weight.contiguous();
  if (!fused.weight.frozen()) grad.weight = expert_grad_slot(slot.weight, fused.weight, name);
  if (!fused.lora.defined()) return grad;
  fused.lora.A = fused.lora.A.contiguous();
  fused.lora.B = fused.lora.B.contiguous();
  grad.lora.A = expert_grad_slot(slot.lora.A, fused.lora.A, name + ".lora_A");
  grad.lora.B = expert_grad_slot(slot.lora.B, fused.lora.B, name + ".lora_B");
  return grad;
}

// Expert e's slices of fused gradient buffers (views that accumulate in place); undefined where
// the buffer is (a frozen weight, no adapter).
inline Linear expert_grads(const Linear& fused, int64_t e) {
  Linear g;
  if (fused.weight.defined()) g.weight = fused.weight.select(0, e);
  if (fused.lora.A.defined()) g.lora.A = fused.lora.A.select(0, e);
  if (fused.lora.B.defined()) g.lora.B = fused.lora.B.select(0, e);
  return g;
}

inline void check_config(const MoeConfig& cfg) {
  GLMTUNE_ASSERT(cfg.n_experts > 0 && cfg.top_k > 0 && cfg.top_k <= cfg.n_experts,
                 "MoE top_k {} must lie in [1, n_experts {}]", cfg.top_k, cfg.n_experts);
  GLMTUNE_ASSERT(cfg.n_group >= 1 && cfg.n_experts % cfg.n_group == 0,
                 "MoE n_group {} must divide n_experts {}", cfg.n_group, cfg.n_experts);
  GLMTUNE_ASSERT(cfg.topk_group >= 1 && cfg.topk_group <= cfg.n_group,
                 "MoE topk_group {} must lie in [1, n_group {}]", cfg.topk_group, cfg.n_group);
  // The group score sums the two best experts of a group, so groups need two members; the kept
  // groups must also hold enough experts for the top-k.
  GLMTUNE_ASSERT(cfg.n_group == 1 || cfg.n_experts / cfg.n_group >= 2,
                 "MoE groups of {} experts cannot give a top-2 group score",
                 cfg.n_experts / cfg.n_group);
  GLMTUNE_ASSERT(cfg.topk_group * (cfg.n_experts / cfg.n_group) >= cfg.top_k,
                 "MoE keeps {} groups of {} experts, fewer than top_k {}", cfg.topk_group,
                 cfg.n_experts / cfg.n_group, cfg.top_k);
}

// The checks the MoE ops make before dispatch (ops/checks.h). Shapes and devices only: the
// dtypes are the bodies' (the GPU routes in f32 beside bf16 activations), and so are the expert
// ids, which live on the routing's device.

// x [T, D]: the rows an MoE op takes (checked before dispatch; `what` names them).
inline void check_moe_rows(const Tensor& x, const char* what, const char* op) {
  GLMTUNE_ASSERT(x.defined() && x.dim() == 2, "{}: {} {} must be [T, D]", op, what,
                 x.defined() ? x.str() : "undefined");
}

// The router: weight [E, D] and correction bias [E] for x [T, D], on x's device.
inline void check_router_args(const MoeConfig& cfg, const Tensor& router_weight, const Tensor& bias,
                              const Tensor& x, const char* op) {
  GLMTUNE_ASSERT(router_weight.defined() && router_weight.dim() == 2 &&
                     router_weight.size(0) == cfg.n_experts && router_weight.size(1) == x.size(1) &&
                     router_weight.device() == x.device(),
                 "{}: router weight {} does not match {} experts and input {}", op,
                 router_weight.defined() ? router_weight.str() : "undefined", cfg.n_experts,
                 x.str());
  GLMTUNE_ASSERT(bias.defined() && bias.dim() == 1 && bias.size(0) == cfg.n_experts &&
                     bias.device() == x.device(),
                 "{}: e_score_correction_bias {} must be [{}] on the device of input {}", op,
                 bias.defined() ? bias.str() : "undefined", cfg.n_experts, x.str());
}

// A fused experts' adapter: A [E, r, in] and B [E, out, r] against weight [E, out, in].
inline void check_expert_adapter_shapes(const Linear& fused, const char* name, const char* op) {
  if (!fused.lora.defined()) return;
  const Tensor &w = fused.weight, &a = fused.lora.A, &b = fused.lora.B;
  GLMTUNE_ASSERT(b.defined() && a.dim() == 3 && b.dim() == 3 && a.size(0) == w.size(0) &&
                     b.size(0) == w.size(0) && a.size(1) == b.size(2) && a.size(2) == w.size(2) &&
                     b.size(1) == w.size(1) && a.device() == w.device() && b.device() == w.device(),
                 "{}: experts.{} adapter A {} and B {} do not fit the fused weight {} (A must be "
                 "[E, r, in], B [E, out, r], on its device)",
                 op, name, a.str(), b.defined() ? b.str() : "undefined", w.str());
}

// The experts: gate_up_proj [E, 2·Im, D] and down_proj [E, D, Im] for x [T, D], on x's device.
inline void check_experts_args(const MoeConfig& cfg, const Linear& gate_up, const Linear& down,
                               const Tensor& x, const char* op) {
  const Tensor &gu = gate_up.weight, &dn = down.weight;
  GLMTUNE_ASSERT(gu.defined() && dn.defined() && gu.dim() == 3 && dn.dim() == 3,
                 "{}: experts need gate_up_proj [E, 2Im, D] and down_proj [E, D, Im]", op);
  const int64_t inter = dn.size(2);
  GLMTUNE_ASSERT(gu.size(0) == cfg.n_experts && dn.size(0) == cfg.n_experts &&
                     gu.size(1) == 2 * inter && gu.size(2) == x.size(1) &&
                     dn.size(1) == x.size(1) && gu.device() == x.device() &&
                     dn.device() == x.device(),
                 "{}: experts gate_up_proj {} / down_proj {} do not match {} experts and input {}",
                 op, gu.str(), dn.str(), cfg.n_experts, x.str());
  check_expert_adapter_shapes(gate_up, "gate_up_proj", op);
  check_expert_adapter_shapes(down, "down_proj", op);
}

// The whole MoE block's operands (router and experts) for x [T, D].
inline void check_moe_args(const MoeConfig& cfg, const MoeParams& params, const Tensor& x,
                           const char* op) {
  check_config(cfg);
  check_moe_rows(x, "input", op);
  check_router_args(cfg, params.router_weight, params.e_score_correction_bias, x, op);
  check_experts_args(cfg, params.gate_up_proj, params.down_proj, x, op);
}

// A routing of `rows` rows: indices int32 [rows, K] (K = cfg.top_k, or any with `any_k`: the
// expert-parallel experts receive routings of their own), weights of that shape, and logits
// [rows, E] where present, on `device`.
inline void check_routing_args(const MoeConfig& cfg, const Routing& r, int64_t rows,
                               const Device& device, bool any_k, const char* op) {
  GLMTUNE_ASSERT(r.indices.defined() && r.indices.dtype() == DType::i32 && r.indices.dim() == 2 &&
                     r.indices.size(0) == rows && (any_k || r.indices.size(1) == cfg.top_k) &&
                     r.indices.device() == device,
                 "{}: routing indices {} must be int32 [{}, {}] on {}", op,
                 r.indices.defined() ? r.indices.str() : "undefined", rows,
                 any_k ? std::string("K") : std::to_string(cfg.top_k), device.str());
  GLMTUNE_ASSERT(
      r.weights.defined() && r.weights.shape() == r.indices.shape() && r.weights.device() == device,
      "{}: combine weights {} must be shaped like the indices {}", op,
      r.weights.defined() ? r.weights.str() : "undefined", r.indices.str());
  GLMTUNE_ASSERT(
      !r.logits.defined() || (r.logits.dim() == 2 && r.logits.size(0) == rows &&
                              r.logits.size(1) == cfg.n_experts && r.logits.device() == device),
      "{}: router logits {} must be [{}, {}] on {}", op, r.logits.defined() ? r.logits.str() : "",
      rows, cfg.n_experts, device.str());
}

// The routing of the expert MLPs over x [T, D]: int32 [T, K] indices and weights of that shape
// in x's dtype. The local and the expert-parallel experts accept the same routings.
inline void check_experts_routing(const Routing& routing, const Tensor& x) {
  GLMTUNE_ASSERT(routing.indices.defined() && routing.indices.dtype() == DType::i32 &&
                     routing.indices.dim() == 2 && routing.indices.size(0) == x.size(0) &&
                     routing.weights.defined() &&
                     routing.weights.shape() == routing.indices.shape() &&
                     routing.weights.dtype() == x.dtype(),
                 "routing does not match input {}", x.str());
}

}  // namespace glmtune::ops::cpu_detail

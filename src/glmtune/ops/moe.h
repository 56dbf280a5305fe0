#pragma once
// Mixture of experts of the sparse layers (docs/model/dsa_moe.md, "MoE"): sigmoid router with a
// selection-only correction bias and group-limited top-k, routed experts in the fused internal
// layout, clamped SwiGLU, weighted combine, plus the shared expert.
//
// Router, per token row x (T is the compute dtype: the reference runs the router in fp32 whatever
// the model dtype, which in the f32 CPU path is the compute dtype anyway):
//   logits = x Wr^T,  p = σ(logits),  c = p + bias
//   groups: view c as [G, E/G]; group score = sum of its two largest c; keep the topk_group best
//           groups, drop the experts of the others
//   sel    = the top_k experts by c among the kept ones
//   w_k    = p[sel_k] (the bias never enters the weights); if norm_topk_prob
//            w_k /= (Σ_k w_k + 1e-20); then w_k *= routed_scaling_factor
// Experts, for each (token, k): [g | u] = x gate_up_proj[e]^T (gate rows first), a = swiglu(g, u)
// with the MLP's clamps, y += w_k · (a down_proj[e]^T). Output = routed + shared_expert(x).
//
// The routed sum is accumulated expert by expert in ascending expert index (the reference's eager
// order); in f32 it differs from the grouped-GEMM order only by rounding.

#include <cstdint>

#include "glmtune/ops/mlp.h"
#include "glmtune/tensor/tensor.h"

namespace glmtune::ops {

struct MoeConfig {
  int64_t n_experts = 288;  // n_routed_experts (E)
  int64_t top_k = 8;        // num_experts_per_tok
  int64_t n_group = 1;      // G; E must be divisible by it
  int64_t topk_group = 1;   // groups kept per token
  bool norm_topk_prob = true;
  double routed_scaling_factor = 2.5;
  double swiglu_limit = 10.0;
};

// Released names under `mlp.`; the experts are in the internal fused layout (the checkpoint's
// per-expert gate/up/down are stacked at load).
struct MoeParams {
  Tensor router_weight;            // gate.weight [E, D]
  Tensor e_score_correction_bias;  // gate.e_score_correction_bias [E] (buffer)
  Linear gate_up_proj;  // experts.gate_up_proj [E, 2·Im, D]: rows [0, Im) gate, [Im, 2Im) up
  Linear down_proj;     // experts.down_proj [E, D, Im]
  MlpParams shared;     // shared_experts.{gate,up,down}_proj.weight, width Im·Ns
};

// The list of MoeParams' fields (ops/linear.h), named as under `mlp.`. The fused experts keep the
// internal names of model/param_store.h (no ".weight"); their adapters, in glmtune's per-expert
// layout (A [E, r, in], B [E, out, r]), follow as "<name>.lora_A.weight" / ".lora_B.weight"
// (model/lora.cpp converts to PEFT's layout at save and load). The experts are not handed whole
// (WholeProjection): they are parameters of one module rather than nn.Linear projections.
template <typename A, typename B, typename F>
void zip_moe_params(A& a, B& b, F&& f) {
  f("gate.weight", a.router_weight, b.router_weight);
  f("gate.e_score_correction_bias", a.e_score_correction_bias, b.e_score_correction_bias);
  f("experts.gate_up_proj", a.gate_up_proj.weight, b.gate_up_proj.weight);
  f("experts.down_proj", a.down_proj.weight, b.down_proj.weight);
  f("experts.gate_up_proj.lora_A.weight", a.gate_up_proj.lora.A, b.gate_up_proj.lora.A);
  f("experts.gate_up_proj.lora_B.weight", a.gate_up_proj.lora.B, b.gate_up_proj.lora.B);
  f("experts.down_proj.lora_A.weight", a.down_proj.lora.A, b.down_proj.lora.A);
  f("experts.down_proj.lora_B.weight", a.down_proj.lora.B, b.down_proj.lora.B);
  zip_mlp_params(a.shared, b.shared, Prefixed<F>{f, "shared_experts."});
}

struct Routing {
  Tensor logits;   // [T, E] router logits (what the balancing losses read)
  Tensor weights;  // [T, K] combine weights (normalised and scaled, bias-free)
  Tensor indices;  // int32 [T, K] expert ids, per row by descending biased score
};

// x [T, D] (2-D) -> routing of every row.
Routing moe_route(const MoeConfig& cfg, const Tensor& router_weight,
                  const Tensor& e_score_correction_bias, const Tensor& x);

// Routed experts only: Σ_k w_k · expert_{idx_k}(x) per row, [T, D].
Tensor moe_experts(const MoeConfig& cfg, const Tensor& gate_up_proj, const Tensor& down_proj,
                   const Tensor& x, const Routing& routing);

// The same with the fused experts' adapters (MoeParams' Linears): expert e computes
// x W_e^T + scale · (x A_e^T) B_e^T on each projection (on the GPU as grouped GEMMs beside the
// expert GEMMs, ops/cuda/moe.h).
Tensor moe_experts(const MoeConfig& cfg, const Linear& gate_up_proj, const Linear& down_proj,
                   const Tensor& x, const Routing& routing);

// Expert e's projection of a fused [E, out, in] Linear: views of its weight slice and, with an
// adapter, of its A [r, in] and B [out, r] slices (frozen like the fused tensors).
inline Linear expert_projection(const Linear& fused, int64_t e) {
  Linear l(fused.weight.select(0, e));
  l.fp8 = fused.fp8;
  if (fused.lora.defined()) {
    l.lora.A = fused.lora.A.select(0, e);
    l.lora.B = fused.lora.B.select(0, e);
    l.lora.scale = fused.lora.scale;
  }
  return l;
}

// Checks a fused experts' adapter: A [E, r, in] and B [E, out, r] against weight [E, out, in], in
// the weight's dtype. `name` names the parameter in the message.
void check_expert_adapter(const Linear& fused, const char* name);

// Number of selections of each expert over rows [0, rows) (rows < 0: all rows), int64 [E] on the
// routing's device (on a GPU, read by nobody inside the step: the trainer takes the counts to the
// host after the backward). Each row picks distinct experts, so this is the number of tokens each
// expert received: the load that drives the correction-bias update.
Tensor moe_expert_counts(const Routing& routing, int64_t n_experts, int64_t rows = -1);

struct MoeOutput {
  Tensor y;  // [T, D] routed + shared
  Routing routing;
  Tensor expert_counts;  // int64 [E], over the first `counted_rows` rows, on x's device
};

// The whole MoE block. `counted_rows` limits the expert counts to the leading rows, so that a
// trailing padding document (the packer puts padding last, data/packing.h) can be left out of the
// load statistics; < 0 counts every row.
MoeOutput moe_forward(const MoeConfig& cfg, const MoeParams& params, const Tensor& x,
                      int64_t counted_rows = -1);

// ---- Backward (ops/cpu/moe_backward.cpp) ----
//
// The selection (group limit, top-k, the correction bias) is piecewise constant: no gradient
// flows through it, and the bias never gets one. Gradients reach the router weight only through
// the combine weights of the selected experts,
//   w_k = rsf · p_k / (Σ_j p_j + 1e-20)  (norm_topk_prob)   or   w_k = rsf · p_k,  p = σ(logits),
// and every routed expert receives only the rows routed to it. The expert activations are
// recomputed in the backward from the saved input and routing (one extra pair of expert GEMMs),
// instead of keeping [T·K, 2·Im] and [T·K, D] buffers alive between forward and backward, unless
// the context holds them (MoeRoutedActivations: a forward run just before the backward).

// The routed experts' activations over the rows sorted by expert: the sorted input, the gate | up
// product, its activation, the experts' outputs before the combine, and the adapters' low-rank
// inputs (ops/linear.h). A GPU forward keeps them when asked, for a backward that follows at once
// (a recomputed layer's), which then does not run the experts again; undefined otherwise. The GPU
// backward takes the combine weights' gradient from the down projection's input gradient, so it
// needs act and out only for an adapted or FP8 down projection: otherwise the forward keeps
// neither.
struct MoeRoutedActivations {
  Tensor x_sorted, gate_up, act, out, u_gate_up, u_down;
};

// What a context held across the step keeps of them (a kept layer's): gate_up and its adapter's
// u_gate_up, 2·Im of a routed row's 2·D + 3·Im values. moe_backward then gathers x_sorted again
// (and, for an adapted or FP8 down projection, recomputes act and out from gate_up, the forward's
// values); without any, it reruns the gate/up projection (and the down one for those).
MoeRoutedActivations gate_up_only(MoeRoutedActivations a);

struct MoeContext {
  Tensor x;                     // [T, D] input
  Routing routing;              // the forward's routing (logits, combine weights, experts)
  MlpContext shared;            // the shared expert's context
  MoeRoutedActivations routed;  // see above
};

// moe_forward that also fills `ctx` for moe_backward; with `keep_routed`, on a GPU, the routed
// experts' activations too (x_sorted and gate_up, the size of two hidden states per routed row at
// the released sizes, and act and out with an adapted or FP8 down projection: for a backward that
// follows at once, not for a context kept across the step).
MoeOutput moe_forward(const MoeConfig& cfg, const MoeParams& params, const Tensor& x,
                      int64_t counted_rows, MoeContext& ctx, bool keep_routed = false);

// Gradient of the combine weights [T, K] back to the router logits [T, E] (zero for the experts a
// row did not select), through the normalisation and scaling above and the sigmoid.
Tensor moe_route_backward(const MoeConfig& cfg, const Routing& routing, const Tensor& d_weights);

// dy [T, D] -> dx [T, D]. Adds the gradients of router_weight, gate_up_proj, down_proj and the
// shared expert into `grads` (mirrors MoeParams; an undefined entry is created as zeros first).
// grads.e_score_correction_bias is never touched: the bias is a buffer that only steers the
// choice. `d_router_logits` (optional, [T, E]) is a gradient arriving at the router logits from
// elsewhere (a balancing loss); it joins the combine weights' gradient before the router GEMM.
Tensor moe_backward(const MoeConfig& cfg, const MoeParams& params, const MoeContext& ctx,
                    const Tensor& dy, MoeParams& grads, const Tensor& d_router_logits = Tensor());

// moe_backward when the routed experts were differentiated elsewhere (expert parallelism:
// dist/expert_parallel.h): `routed_dx` [T, D] and `routed_d_weights` [T, K] are their input and
// combine-weight gradients; the router and the shared expert are differentiated here from x, as
// moe_backward does, and only their gradients accumulate into `grads`. Returns dx [T, D]. On the
// GPU both routed gradients are f32 (dx then rounds once to x's dtype); on the CPU they are in x's
// dtype.
Tensor moe_backward_routed_elsewhere(const MoeConfig& cfg, const MoeParams& params, const Tensor& x,
                                     const Routing& routing, const Tensor& dy,
                                     const Tensor& routed_dx, const Tensor& routed_d_weights,
                                     MoeParams& grads, const Tensor& d_router_logits = Tensor());

}  // namespace glmtune::ops

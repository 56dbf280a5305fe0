#pragma once
// Load balancing of the MoE routers (SPEC.md §4, seed system §2.2–2.3).
//
// Two mechanisms, both fed by each router's expert selections:
//
// 1. The correction-bias update ("aux-loss-free" balancing). After all micro-packs of an optimizer
//    step, per MoE layer (the MTP layer included) with global expert loads n_e (selections summed
//    over micro-packs and ranks) and mean n̄ = Σ n_e / E:
//        bias_e -= u   if n_e > n̄
//        bias_e += u   if n_e < n̄        (unchanged if equal; u = router_bias_update_rate)
//    The comparison is exact (n_e · E against Σ n), and the f32 bias adds the f32 value of ±u.
//    The bias only steers which experts are chosen; it is a buffer, saved with the model.
//
// 2. The balancing (aux) loss, per layer, over the T non-padding tokens with top-K routing:
//        loss = α · E / (T·K) · Σ_e n_e · mean_t(w̃_{t,e})
//        w̃_{t,e} = (σ(l_{t,e}) + b_e) / Σ_e' (σ(l_{t,e'}) + b_e')
//    summed over layers (and averaged over micro-packs, see BalancingLossOptions). n_e are the
//    selection counts (no gradient flows through them); the gradient flows through w̃ into the
//    router logits l.
//
// The logged statistic is maxvio = mean over layers of (max_e n_e − n̄) / n̄.

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "glmtune/tensor/tensor.h"

namespace glmtune::train {

// Selections per expert: `selected` is [T, K] (i32 or i64) expert ids; rows whose `valid` entry is
// 0 (padding) are not counted. `valid` may be empty (every row counts). Throws InternalError for
// an id outside [0, num_experts).
std::vector<int64_t> count_expert_loads(const Tensor& selected, int64_t num_experts,
                                        std::span<const uint8_t> valid = {});

// (max_e n_e − n̄) / n̄ for one layer; 0 when the layer routed no token.
double max_violation(std::span<const int64_t> loads);

// Applies the sign update to `bias` (f32 [E], written in place) from one layer's step loads.
void update_router_bias(Tensor& bias, std::span<const int64_t> loads, double rate);

// Expert loads of one optimizer step, per router, summed over micro-packs. Routers are keyed by
// the name of their correction-bias parameter (e.g.
// "model.language_model.layers.3.mlp.gate.e_score_correction_bias"), and kept in the order they
// were first added (main layers first, then MTP, as the model reports them).
class ExpertLoads {
 public:
  // Adds one micro-pack's (already globally reduced, or local) loads of one router.
  void add(const std::string& bias_name, std::span<const int64_t> loads);
  bool empty() const { return order_.empty(); }
  const std::vector<std::string>& routers() const { return order_; }
  const std::vector<int64_t>& loads(const std::string& bias_name) const;
  // All loads, routers in order, concatenated: the buffer a distributed run all-reduces (SUM) ...
  std::vector<int64_t> flat() const;
  // ... and writes back.
  void set_flat(std::span<const int64_t> values);
  // Mean over routers of max_violation.
  double maxvio() const;
  void clear();

 private:
  std::vector<std::string> order_;
  std::map<std::string, std::vector<int64_t>> loads_;
};

// Updates every router's bias from the step's loads. `bias_of(name)` returns the bias tensor.
// Returns maxvio of the loads (before the update).
template <typename BiasLookup>
double update_router_biases(const ExpertLoads& loads, double rate, BiasLookup&& bias_of) {
  for (const auto& name : loads.routers()) {
    Tensor& bias = bias_of(name);
    update_router_bias(bias, loads.loads(name), rate);
  }
  return loads.maxvio();
}

struct BalancingLossOptions {
  // α of the recipe (loss.balancing_alpha).
  double alpha = 0.001;
  // The seed system averages the per-micro-pack losses over the step's micro-packs.
  int64_t num_micro_packs = 1;
  // Global averaging across ranks: this micro-pack's expert loads summed over all ranks. Empty:
  // this pack's own loads (single process). The token count is Σ_e n_e / K, so with global loads
  // the function returns this rank's share of the global loss (the shares sum to the loss over
  // ranks) and the gradient of that share, which is what the ranks' summed gradients need.
  std::vector<int64_t> global_loads;
  // Rows of the pack that are real tokens (1) or padding (0); empty: all rows are tokens.
  std::span<const uint8_t> valid;
};

struct BalancingLossResult {
  double loss = 0.0;
  Tensor grad_logits;  // d loss / d logits, [T, E], the logits' dtype (zero on padding rows)
};

// One router layer's balancing loss for one micro-pack. `logits` is [T, E] (f32 or f64),
// `bias` [E] (f32 or f64), `selected` [T, K] (i32 or i64) the experts chosen per token. Computes
// in f64; the gradient is returned only when `with_grad`.
BalancingLossResult balancing_loss(const Tensor& logits, const Tensor& bias, const Tensor& selected,
                                   const BalancingLossOptions& options, bool with_grad = true);

}  // namespace glmtune::train

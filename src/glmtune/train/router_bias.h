#pragma once
// Load balancing of the MoE routers, as the reference trainer balances them (docs/training.md,
// "Load balancing").
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
// 2. The balancing (aux) loss, part of the model's objective: model/balancing_loss.h, which also
//    counts the loads (count_expert_loads) that both mechanisms use.
//
// The logged statistic is maxvio = mean over layers of (max_e n_e − n̄) / n̄.

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "glmtune/model/balancing_loss.h"
#include "glmtune/tensor/tensor.h"

namespace glmtune::train {

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

}  // namespace glmtune::train

#pragma once
// The MoE balancing (aux) loss of the reference trainer (docs/training.md, "Balancing loss"), part
// of the model's objective.
//
// Per router layer, over the T non-padding tokens with top-K routing:
//     loss = α · E / (T·K) · Σ_e n_e · mean_t(w̃_{t,e})
//     w̃_{t,e} = (σ(l_{t,e}) + b_e) / Σ_e' (σ(l_{t,e'}) + b_e')
// summed over layers (and averaged over micro-packs, see BalancingLossOptions). n_e are the
// selection counts (no gradient flows through them); the gradient flows through w̃ into the
// router logits l. The training loop's use of the same counts, the correction-bias update, is in
// train/router_bias.h.

#include <cstdint>
#include <span>
#include <vector>

#include "glmtune/tensor/tensor.h"

namespace glmtune::model {

// Selections per expert: `selected` is [T, K] (i32 or i64) expert ids; rows whose `valid` entry is
// 0 (padding) are not counted. `valid` may be empty (every row counts). Throws InternalError for
// an id outside [0, num_experts).
std::vector<int64_t> count_expert_loads(const Tensor& selected, int64_t num_experts,
                                        std::span<const uint8_t> valid = {});

struct BalancingLossOptions {
  // α of the recipe (loss.balancing_alpha).
  double alpha = 0.001;
  // The reference trainer averages the per-micro-pack losses over the step's micro-packs.
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

// The same loss and gradient where the router ran, for the trainer: everything on the logits'
// device, the padding rows a suffix. `loads` int64 [E] are the counts the loss weighs by (the
// pack's first `counted_rows` rows, or a sequence-parallel group's); options.valid and
// options.global_loads are not read. The loss is added to `loss_sum` (f64 [1] on that device) and
// d loss / d logits returned in the logits' dtype. On a GPU this is ops/cuda/moe.h's kernel,
// which keeps the host out of the step (the host form would copy [T, E] both ways and wait for
// every MoE layer); on the CPU it is balancing_loss above.
Tensor balancing_loss_on_device(const Tensor& logits, const Tensor& bias, const Tensor& selected,
                                const Tensor& loads, int64_t counted_rows,
                                const BalancingLossOptions& options, Tensor& loss_sum);

}  // namespace glmtune::model

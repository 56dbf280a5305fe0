#pragma once
// Token cross-entropy of the LM head (docs/model/backward_dsa_moe.md, "Cross-entropy and the fused
// lm_head"): logits in the compute dtype (fp32 on the reference path, as the reference upcasts
// them), labels aligned per row (the caller shifts per document), ignore index −100, summed over
// label tokens and divided by a denominator: the number of label tokens of the call (the
// reference's mean) or one supplied by the caller (the reference's num_items_in_batch; the
// training loop passes the global number of label tokens of the optimizer step, so micro-packs
// and ranks add up to the global mean).
//
//   loss = Σ_{t: label_t ≠ −100} (logsumexp(z_t) − z_t[label_t]) / denominator
//   dz_t = grad_scale · (softmax(z_t) − onehot(label_t)) / denominator   (0 on ignored rows)
//
// lm_head_cross_entropy fuses the head projection z = h · W^T with the loss and its backward over
// chunks of label rows: at most `chunk_rows` × V logits exist at a time, and each chunk's logit
// gradient is consumed (into dh and dW) before the next chunk is computed. Rows whose label is
// ignored are skipped entirely (their dh is 0).
//
// With no label token and no supplied denominator the loss and all gradients are 0 (the
// reference's mean over nothing would be NaN, which would poison the step's other micro-packs).
// CPU tensors in f32 or f64; labels int32 or int64. A label outside [0, V) other than −100 is an
// error naming the row.

#include <cstdint>

#include "glmtune/tensor/tensor.h"

namespace glmtune::ops {

inline constexpr int64_t kIgnoreIndex = -100;

struct CrossEntropyOptions {
  // Divisor of the summed loss; ≤ 0 means "the number of label tokens of this call".
  double denominator = 0;
  // Gradient of the total objective with respect to this loss (e.g. the MTP loss factor); the
  // gradients are scaled by it, the reported loss is not.
  double grad_scale = 1;
  // Label rows whose logits are materialised at once by lm_head_cross_entropy.
  int64_t chunk_rows = 256;
  // lm_head_cross_entropy's weight gradient covers the weight's columns [weight_grad_col0, D)
  // only: `dweight` is then [V, D − weight_grad_col0]. A head with an adapter folds it into
  // trailing columns of a concatenated weight and wants just those (0: the whole weight).
  int64_t weight_grad_col0 = 0;
};

struct CrossEntropyResult {
  double loss = 0;         // loss_sum / denominator (0 when both are 0)
  double loss_sum = 0;     // Σ over label tokens of −log softmax(z)[label]
  int64_t n_tokens = 0;    // rows whose label is not −100
  double denominator = 0;  // the divisor used
};

// logits [T, V], labels [T].
CrossEntropyResult cross_entropy_forward(const Tensor& logits, const Tensor& labels,
                                         const CrossEntropyOptions& opts = {});

// The gradient of cross_entropy_forward's loss with respect to the logits, times
// opts.grad_scale: [T, V].
Tensor cross_entropy_backward(const Tensor& logits, const Tensor& labels,
                              const CrossEntropyOptions& opts = {});

// hidden [T, D], weight [V, D] (lm_head.weight), labels [T]. Forward only when both gradient
// pointers are null. `dhidden` (optional) receives d loss / d hidden · grad_scale, [T, D]
// (overwritten; allocated when undefined). `dweight` (optional) has the head's gradient
// (· grad_scale) added into it, [V, D] (created as zeros when undefined), or [V, D − c0] for the
// columns from c0 = opts.weight_grad_col0 on. A frozen weight gets no gradient.
CrossEntropyResult lm_head_cross_entropy(const Tensor& hidden, const Tensor& weight,
                                         const Tensor& labels, const CrossEntropyOptions& opts,
                                         Tensor* dhidden = nullptr, Tensor* dweight = nullptr);

struct Linear;

// The same loss for the head as a projection (ops/linear.h) with its low-rank adapter
// (ops/composite/lm_head.cpp): logits h Wᵀ + scale · (drop(h) Aᵀ) Bᵀ, computed as
// [h | u] · [W | B]ᵀ with u = scale · drop(h) Aᵀ [T, r], one call of the fused op above on the
// concatenated [V, D + r] weight. Its gradients land in `grads` (null: none): A and B, and the
// weight unless it is frozen. Without an adapter this is exactly the call on head.weight.
CrossEntropyResult lm_head_cross_entropy(const Tensor& hidden, const Linear& head,
                                         const Tensor& labels, const CrossEntropyOptions& opts,
                                         Tensor* dhidden = nullptr, Linear* grads = nullptr);

}  // namespace glmtune::ops

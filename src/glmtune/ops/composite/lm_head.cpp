// The LM head's fused cross-entropy with the head's low-rank adapter (ops/cross_entropy.h),
// composed from the leaf ops so that it runs wherever they do.
//
// The adapter's logits scale · (drop(h) Aᵀ) Bᵀ are the product of u = scale · drop(h) Aᵀ [T, r]
// with B [V, r], so the adapted logits are one product of [h | u] with [W | B]: the fused op keeps
// its chunking (no [T, V] logits) and the adapter adds r columns to both operands. Its backward
// then gives dB as the weight gradient of the last r columns, and du as the last r columns of
// the input gradient, from which dA and the adapter's share of dh follow as in
// ops/composite/linear.cpp.

#include "glmtune/ops/cross_entropy.h"
#include "glmtune/ops/dispatch.h"
#include "glmtune/ops/elementwise.h"
#include "glmtune/ops/grad.h"
#include "glmtune/ops/linear.h"

namespace glmtune::ops {
namespace {

void check_head(const Tensor& hidden, const Linear& head) {
  GLMTUNE_ASSERT(
      head.weight.defined() && head.weight.dim() == 2 && !head.bias.defined() && !head.fp8,
      "lm_head_cross_entropy: the head must be a [V, D] weight without a bias or FP8 "
      "GEMMs, got {}",
      head.weight.defined() ? head.weight.str() : "undefined");
  if (!head.lora.defined()) return;
  const LoraAdapter& a = head.lora;
  GLMTUNE_ASSERT(a.B.defined() && a.A.dim() == 2 && a.B.dim() == 2 && a.A.size(0) == a.B.size(1) &&
                     a.A.size(1) == head.weight.size(1) && a.B.size(0) == head.weight.size(0),
                 "lm_head_cross_entropy: adapter A {} and B {} do not fit the head {} (A must be "
                 "[r, D], B [V, r])",
                 a.A.str(), a.B.defined() ? a.B.str() : "undefined", head.weight.str());
  GLMTUNE_ASSERT(a.A.dtype() == hidden.dtype() && a.B.dtype() == head.weight.dtype(),
                 "lm_head_cross_entropy: adapter A {} must have hidden {}'s dtype and B {} the "
                 "head {}'s",
                 a.A.str(), hidden.str(), a.B.str(), head.weight.str());
}

}  // namespace

CrossEntropyResult lm_head_cross_entropy(const Tensor& hidden, const Linear& head,
                                         const Tensor& labels, const CrossEntropyOptions& opts,
                                         Tensor* dhidden, Linear* grads) {
  check_head(hidden, head);
  GLMTUNE_ASSERT(opts.weight_grad_col0 == 0,
                 "lm_head_cross_entropy: the head's gradients are whole, got weight_grad_col0 {}",
                 opts.weight_grad_col0);
  if (!head.lora.defined())
    return lm_head_cross_entropy(hidden, head.weight, labels, opts, dhidden,
                                 grads ? &grads->weight : nullptr);
  const LoraAdapter& lora = head.lora;
  const int64_t dim = hidden.size(1), rank = lora.A.size(0);

  // What the adapter reads: h, or h with its dropout mask (redrawn from the key in the backward).
  Tensor xa = hidden;
  if (lora.dropout_active()) {
    xa = hidden.contiguous().clone();
    dropout_into(xa, lora.dropout, lora.dropout_key, lora.dropout_block);
  }
  Tensor u = linear(xa, lora.A);
  scale_into(u, lora.scale);
  const Tensor hu = concat_columns(hidden, u);
  const Tensor wb = concat_columns(head.weight, lora.B);

  if (!dhidden && !grads) return lm_head_cross_entropy(hu, wb, labels, opts);

  // The head's own weight gradient, when it is trained, needs every column; otherwise only B's.
  Tensor* dw = grads ? grad_if_trained(&grads->weight, head.weight) : nullptr;
  CrossEntropyOptions o = opts;
  o.weight_grad_col0 = dw ? 0 : dim;
  Tensor dwb;
  Tensor dhu =
      Tensor::empty({hidden.size(0), dim + rank}, gradient_sum_dtype(hidden), hidden.device());
  const CrossEntropyResult r = lm_head_cross_entropy(hu, wb, labels, o, &dhu,
                                                     !grads ? nullptr
                                                     : dw   ? &dwb
                                                            : &grads->lora.B);
  if (dw) {
    add_into(grad_buffer(*dw, head.weight, "lm_head_cross_entropy", "head weight"),
             dwb.narrow(1, 0, dim).contiguous());
    add_into(grad_buffer(grads->lora.B, lora.B, "lm_head_cross_entropy", "adapter B"),
             dwb.narrow(1, dim, rank).contiguous());
  }

  // du = d loss / d u; through u = scale · xa Aᵀ into A and into h (through the same mask).
  Tensor du = dhu.narrow(1, dim, rank).contiguous().to(hidden.dtype());
  scale_into(du, lora.scale);
  Tensor dsum = dhu.narrow(1, 0, dim).contiguous();
  Tensor* da = grads ? &grads->lora.A : nullptr;
  if (!lora.dropout_active()) {
    linear_backward_add(dsum, du, hidden, lora.A, da);
  } else {
    Tensor dxa = linear_backward(du, xa, lora.A, da);
    dropout_into(dxa, lora.dropout, lora.dropout_key, lora.dropout_block);
    add_into(dsum, dxa);
  }
  if (dhidden) {
    if (dhidden->defined())
      dhidden->copy_(dsum);
    else
      *dhidden = dsum.dtype() == hidden.dtype() ? std::move(dsum) : dsum.to(hidden.dtype());
  }
  return r;
}

}  // namespace glmtune::ops

// Projections with their bias and low-rank adapter (ops/linear.h), composed from the leaf ops.

#include "glmtune/ops/linear.h"

#include "glmtune/ops/dispatch.h"
#include "glmtune/ops/elementwise.h"
#include "glmtune/ops/fp8.h"
#include "glmtune/ops/grad.h"

namespace glmtune::ops {
namespace {

void check_adapter(const Linear& l, const Tensor& x) {
  const LoraAdapter& a = l.lora;
  GLMTUNE_ASSERT(a.A.defined() && a.B.defined() && a.A.dim() == 2 && a.B.dim() == 2 &&
                     l.weight.dim() == 2 && a.A.size(0) == a.B.size(1) &&
                     a.A.size(1) == l.weight.size(1) && a.B.size(0) == l.weight.size(0),
                 "adapter A {} and B {} do not fit weight {} (A must be [r, in], B [out, r])",
                 a.A.defined() ? a.A.str() : "undefined", a.B.defined() ? a.B.str() : "undefined",
                 l.weight.str());
  GLMTUNE_ASSERT(a.A.dtype() == x.dtype() && a.B.dtype() == x.dtype(),
                 "adapter A {} and B {} must have the input's dtype {}", a.A.str(), a.B.str(),
                 x.str());
}

// What the adapter reads: x, or x with its dropout mask applied.
Tensor adapter_x(const Linear& l, const Tensor& x) {
  if (!l.lora.dropout_active()) return x;
  Tensor xd = x.contiguous().clone();
  dropout_into(xd, l.lora.dropout, l.lora.dropout_key, l.lora.dropout_block);
  return xd;
}

// scale · x A^T, [..., r], from the adapter's input.
Tensor adapter_input(const Linear& l, const Tensor& xa) {
  Tensor u = linear(xa, l.lora.A);
  scale_into(u, l.lora.scale);
  return u;
}

Tensor* bias_slot(const Linear& l, Linear* grads) {
  return grads && l.bias.defined() ? grad_if_trained(grads->bias, l.bias) : nullptr;
}

// The adapter's part of the backward: dB += dy^T u, dA += (scale · dy B)^T x_a, and
// scale · dy B A (through the dropout mask, with the forward's key) added to dx_sum.
void adapter_backward_add(Tensor& dx_sum, const Tensor& dy, const Tensor& x, const Linear& l,
                          Linear* grads) {
  const Tensor xa = adapter_x(l, x);
  const Tensor u = adapter_input(l, xa);
  Tensor du = linear_backward(dy, u, l.lora.B, grads ? &grads->lora.B : nullptr);
  scale_into(du, l.lora.scale);
  if (!l.lora.dropout_active()) {
    linear_backward_add(dx_sum, du, x, l.lora.A, grads ? &grads->lora.A : nullptr);
    return;
  }
  Tensor dxa = linear_backward(du, xa, l.lora.A, grads ? &grads->lora.A : nullptr);
  dropout_into(dxa, l.lora.dropout, l.lora.dropout_key, l.lora.dropout_block);
  if (dx_sum.defined())
    add_into(dx_sum, dxa);
  else
    dx_sum = std::move(dxa);
}

void check_fp8(const Linear& l) {
  GLMTUNE_ASSERT(!l.bias.defined(), "FP8 GEMMs are for projections without a bias, got bias {}",
                 l.bias.str());
}

// The weight's part of the backward: dW (and db) accumulate, dy W is added to dx_sum.
void base_backward_add(Tensor& dx_sum, const Tensor& dy, const Tensor& x, const Linear& l,
                       Linear* grads) {
  if (!l.fp8) {
    linear_backward_add(dx_sum, dy, x, l.weight, grads ? &grads->weight : nullptr,
                        bias_slot(l, grads));
    return;
  }
  check_fp8(l);
  linear_fp8_backward_add(&dx_sum, dy, x, l.weight, grads ? &grads->weight : nullptr);
}

}  // namespace

Tensor linear(const Tensor& x, const Linear& l) {
  Tensor y;
  if (l.fp8) {
    check_fp8(l);
    y = linear_fp8(x, l.weight);
  } else {
    y = linear(x, l.weight, l.bias);
  }
  if (!l.lora.defined()) return y;
  check_adapter(l, x);
  linear_out(y, adapter_input(l, adapter_x(l, x)), l.lora.B, Tensor(), /*accumulate=*/true);
  return y;
}

Tensor linear_backward(const Tensor& dy, const Tensor& x, const Linear& l, Linear* grads,
                       bool need_input_grad) {
  if (!l.lora.defined() && !l.fp8)
    return linear_backward(dy, x, l.weight, grads ? &grads->weight : nullptr, bias_slot(l, grads),
                           need_input_grad);
  if (!l.lora.defined()) {
    check_fp8(l);
    if (need_input_grad)
      return linear_fp8_backward(dy, x, l.weight, grads ? &grads->weight : nullptr);
    linear_fp8_backward_add(nullptr, dy, x, l.weight, grads ? &grads->weight : nullptr);
    return Tensor();
  }
  Tensor dx;
  base_backward_add(dx, dy, x, l, grads);
  if (l.lora.defined()) {
    check_adapter(l, x);
    adapter_backward_add(dx, dy, x, l, grads);
  }
  return need_input_grad ? dx.to(x.dtype()) : Tensor();
}

void linear_backward_add(Tensor& dx_sum, const Tensor& dy, const Tensor& x, const Linear& l,
                         Linear* grads) {
  base_backward_add(dx_sum, dy, x, l, grads);
  if (!l.lora.defined()) return;
  check_adapter(l, x);
  adapter_backward_add(dx_sum, dy, x, l, grads);
}

}  // namespace glmtune::ops

#pragma once
// Dense projections: y = x W^T (+ b), the layout of every nn.Linear in the reference (W is
// [out, in], row-major). CPU tensors in f32 (the reference path) or f64 (finite-difference tests);
// the GEMM itself is OpenBLAS.

#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

#include "glmtune/ops/elementwise.h"
#include "glmtune/tensor/tensor.h"

namespace glmtune::ops {

// A low-rank adapter on a projection: y += scale · (x A^T) B^T, with A [r, in] and B [out, r].
// `scale` is alpha / r, or alpha / sqrt(r) with rank-stabilised scaling (model/lora.h). On the
// fused experts (weight [E, out, in]) each expert has its own: A [E, r, in] and B [E, out, r]
// (ops/moe.h), which model/lora.cpp converts to and from PEFT's [r·E, in] / [out, r·E] layout.
struct LoraAdapter {
  Tensor A;
  Tensor B;
  double scale = 0;
  // PEFT's lora_dropout, while training: the adapter reads dropout_into(x, dropout, dropout_key)
  // (ops/elementwise.h) instead of x, so a recompute and the backward redraw the same mask. The
  // trainer sets a fresh key per pack and module; key 0 (evaluation, the default): no dropout.
  double dropout = 0;
  uint64_t dropout_key = 0;
  // Where the input sits in the whole pack's when a parallel layout hands a block of it (ops/
  // elementwise.h): the masks one process would draw for those elements.
  DropoutBlock dropout_block;

  bool defined() const { return A.defined(); }
  bool dropout_active() const { return dropout > 0 && dropout_key != 0; }
};

// One projection of the model: weight [out, in] (the fused experts: [E, out, in]), an optional
// bias [out] and an optional adapter. A parameter struct's projections are Linears; the gradients
// of a projection are a Linear too (weight, bias and adapter gradients in the matching fields).
struct Linear {
  Tensor weight;
  Tensor bias;
  LoraAdapter lora;
  // train.fp8 = "tilewise": the weight's GEMMs (forward, input and weight gradient) run on
  // block-scaled FP8 operands (ops/fp8.h, linear_fp8); the bias-free projections only. An
  // adapter beside it stays in the compute dtype.
  bool fp8 = false;

  Linear() = default;
  explicit Linear(Tensor w, Tensor b = Tensor()) : weight(std::move(w)), bias(std::move(b)) {}

  bool defined() const { return weight.defined(); }
};

// ---- Parameter lists ----
// Each parameter struct of ops/ has a zip_*_params(a, b, f) visitor that calls
// f(name, a_field, b_field) for every tensor field of two structs of its shape (the parameters and
// their gradients, or two copies) in one fixed order, `name` being the released name relative to
// the module ("q_proj.weight"). Undefined fields (absent biases, an unused shared expert) are
// visited too. The released layout (model/layout.cpp), the model's loader, gradient buffers,
// fsdp's flat layout, sequence parallel's head slicing and the tests all read these lists rather
// than naming fields themselves.
//
// A visitor that also accepts f(name, a_linear, b_linear, WholeProjection{}) is handed each
// projection whole, before its tensors (the loader sets an adapter's scale there).
struct WholeProjection {};

// One projection: its weight, its bias when the released layout has one, and its adapter's A and
// B under PEFT's names ("<name>.lora_A.weight", "<name>.lora_B.weight").
template <typename A, typename B, typename F>
void zip_linear(const std::string& name, A& a, B& b, F&& f, bool with_bias = false) {
  if constexpr (std::is_invocable_v<F&, const std::string&, A&, B&, WholeProjection>)
    f(name, a, b, WholeProjection{});
  f(name + ".weight", a.weight, b.weight);
  if (with_bias) f(name + ".bias", a.bias, b.bias);
  f(name + ".lora_A.weight", a.lora.A, b.lora.A);
  f(name + ".lora_B.weight", a.lora.B, b.lora.B);
}

// A visitor of a list under a prefix: f(prefix + name, ...), for tensors and whole projections.
template <typename F>
struct Prefixed {
  F& f;
  std::string prefix;

  template <typename A, typename B>
  void operator()(const std::string& name, A& a, B& b) const {
    f(prefix + name, a, b);
  }
  template <typename A, typename B>
  requires std::is_invocable_v<F&, const std::string&, A&, B&, WholeProjection>
  void operator()(const std::string& name, A& a, B& b, WholeProjection w) const {
    f(prefix + name, a, b, w);
  }
};

// Row-major GEMM on raw buffers: C = alpha·op(A)·op(B) + beta·C with op(X) = X or X^T.
// op(A) is [m, k], op(B) is [k, n], C is [m, n]; lda/ldb/ldc are the row strides of the stored
// (untransposed) matrices. Instantiated for float and double. Exposed so that backward passes
// (dx = dy W, dW = dy^T x) reuse the same call without building tensors.
template <typename T>
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, T alpha, const T* a,
          int64_t lda, const T* b, int64_t ldb, T beta, T* c, int64_t ldc);

// y[..., out] = x[..., in] · weight[out, in]^T + bias[out]. `bias` may be undefined. x, weight and
// bias share one dtype (f32 or f64); the result is contiguous with x's leading shape.
Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias = Tensor());

// Same as `linear`, written into `out` (contiguous, shape [..., out]); with `accumulate` the
// product is added to what `out` already holds (the bias, if any, is added too).
void linear_out(Tensor& out, const Tensor& x, const Tensor& weight, const Tensor& bias = Tensor(),
                bool accumulate = false);

// Backward of y = x W^T (+ b) for an upstream gradient dy [..., out] (dtype of x):
//   dx = dy W           returned, shaped like x (undefined when `need_input_grad` is false)
//   dW += dy^T x        into *grad_weight [out, in], summed over all leading dims
//   db += Σ dy          into *grad_bias [out]
// Parameter gradients accumulate, as every backward in glmtune does: a null pointer skips that
// gradient, an undefined tensor is first allocated as zeros of the parameter's shape, a defined
// one must be contiguous with the parameter's shape and dtype.
Tensor linear_backward(const Tensor& dy, const Tensor& x, const Tensor& weight, Tensor* grad_weight,
                       Tensor* grad_bias = nullptr, bool need_input_grad = true);

// ---- Projections with their bias and adapter (ops/composite/linear.cpp) ----
// The same three calls on a Linear: the bias is the Linear's, the weight's GEMMs are the FP8 ones
// of ops/fp8.h when Linear::fp8 is set, and an adapter adds
// scale · (x A^T) B^T to the output (computed from the leaf ops: one narrow GEMM into [..., r],
// one accumulated into y). Its backward recomputes x A^T (r columns) rather than keeping it.
// Gradients land in the matching fields of `grads` (null: none); the weight's is skipped when the
// weight is frozen (ops/grad.h), the bias's when the Linear has none, the adapter's when it has
// none. Without an adapter these are exactly the calls on (weight, bias).
Tensor linear(const Tensor& x, const Linear& l);
Tensor linear_backward(const Tensor& dy, const Tensor& x, const Linear& l, Linear* grads,
                       bool need_input_grad = true);
void linear_backward_add(Tensor& dx_sum, const Tensor& dy, const Tensor& x, const Linear& l,
                         Linear* grads);

// Backward of a projection whose input gradient is one term of a sum (the input feeds several
// projections): dW (and db) accumulate as in linear_backward, and dy W is added to `dx_sum`.
// `dx_sum` undefined: it becomes dy W, in gradient_sum_dtype (ops/dispatch.h: x's dtype on the
// CPU, f32 on a GPU, where the GEMM accumulates into it so that the sum is rounded to bf16 once,
// by the caller). The terms are added in call order.
void linear_backward_add(Tensor& dx_sum, const Tensor& dy, const Tensor& x, const Tensor& weight,
                         Tensor* grad_weight, Tensor* grad_bias = nullptr);

}  // namespace glmtune::ops

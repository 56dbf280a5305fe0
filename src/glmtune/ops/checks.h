#pragma once
// Argument checks that hold on every device, made by a leaf op before it dispatches
// (ops/dispatch.h): a call with mismatched arguments fails here, with the same message whichever
// body would have run. Each body then checks only what is its own: the dtypes it computes in and
// the layouts its kernels take. A failed check is an InternalError (a glmtune bug: the model
// calls these ops, users do not).

#include <string>

#include "glmtune/base/error.h"
#include "glmtune/tensor/tensor.h"

namespace glmtune::ops::checks {

inline std::string describe(const Tensor& t) { return t.defined() ? t.str() : "undefined"; }

// `x` is defined and has at least one dimension (rows of its last one).
inline void rows_input(const Tensor& x, const char* what, const char* op) {
  GLMTUNE_ASSERT(x.defined() && x.dim() >= 1, "{}: {} must be a tensor of at least one dimension",
                 op, what);
}

// `t` is defined with `like`'s shape, dtype and device.
inline void same_as(const Tensor& t, const Tensor& like, const char* what, const char* like_what,
                    const char* op) {
  GLMTUNE_ASSERT(t.defined() && t.shape() == like.shape() && t.dtype() == like.dtype() &&
                     t.device() == like.device(),
                 "{}: {} {} must have the shape, dtype and device of {} {}", op, what, describe(t),
                 like_what, like.str());
}

// `t` is defined with `like`'s shape, on its device (its dtype is the bodies' to check).
inline void same_shape(const Tensor& t, const Tensor& like, const char* what, const char* like_what,
                       const char* op) {
  GLMTUNE_ASSERT(t.defined() && t.shape() == like.shape() && t.device() == like.device(),
                 "{}: {} {} must have the shape and device of {} {}", op, what, describe(t),
                 like_what, like.str());
}

// An optional per-channel vector (a norm's weight or bias): [n] for x [..., n], on x's device.
// Its dtype is the body's to check: the CPU computes in x's, the GPU bodies take an f32 weight
// beside bf16 activations.
inline void channel_vector(const Tensor& v, const Tensor& x, const char* what, const char* op) {
  if (!v.defined()) return;
  GLMTUNE_ASSERT(v.dim() == 1 && v.size(0) == x.size(-1) && v.device() == x.device(),
                 "{}: {} {} does not match input {} (a vector of {} on its device)", op, what,
                 v.str(), x.str(), x.size(-1));
}

// A projection's operands: x [..., in], weight [out, in] and an optional bias [out], on x's
// device (the dtypes are the bodies': the GPU keeps some weights in f32 beside bf16 inputs).
inline void linear_args(const Tensor& x, const Tensor& weight, const Tensor& bias, const char* op) {
  rows_input(x, "x", op);
  GLMTUNE_ASSERT(weight.defined() && weight.dim() == 2 && weight.size(1) == x.size(-1) &&
                     weight.device() == x.device(),
                 "{}: weight {} must be [out, {}] on the device of x {}", op, describe(weight),
                 x.size(-1), x.str());
  GLMTUNE_ASSERT(!bias.defined() || (bias.dim() == 1 && bias.size(0) == weight.size(0) &&
                                     bias.device() == x.device()),
                 "{}: bias {} must be [{}] on the device of x {}", op, describe(bias),
                 weight.size(0), x.str());
}

// A projection's output (or its gradient dy) `y`: as many rows as x and weight's out features,
// on x's device. (How the rows are laid out in dimensions is the bodies' to check.)
inline void linear_result(const Tensor& y, const Tensor& x, const Tensor& weight, const char* what,
                          const char* op) {
  const auto rows = [](const Tensor& t) { return t.size(-1) > 0 ? t.numel() / t.size(-1) : 0; };
  GLMTUNE_ASSERT(y.defined() && y.dim() >= 1 && y.size(-1) == weight.size(0) &&
                     rows(y) == rows(x) && y.device() == x.device(),
                 "{}: {} {} must hold x {}'s rows of {} output features, on its device", op, what,
                 describe(y), x.str(), weight.size(0));
}

}  // namespace glmtune::ops::checks

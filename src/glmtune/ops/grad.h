#pragma once
// Which parameter gradients a backward pass computes. Every backward takes its parameter gradients
// as slots (a pointer, or a field of a gradient struct mirroring the parameters); a slot is
// filled only when the caller asks for it and the parameter is not frozen (Tensor::frozen, set
// by `train.freeze`): a frozen parameter's gradient is neither computed nor allocated.

#include "glmtune/tensor/tensor.h"

namespace glmtune::ops {

// `slot`, or nullptr when it is null or `param` is frozen.
inline Tensor* grad_if_trained(Tensor* slot, const Tensor& param) {
  return slot && !param.frozen() ? slot : nullptr;
}

// The slot of a gradient-struct field for `param`, or nullptr when `param` is frozen.
inline Tensor* grad_if_trained(Tensor& slot, const Tensor& param) {
  return param.frozen() ? nullptr : &slot;
}

}  // namespace glmtune::ops

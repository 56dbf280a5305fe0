#pragma once
// Which parameter gradients a backward pass computes. Every backward takes its parameter gradients
// as slots (a pointer, or a field of a gradient struct mirroring the parameters); a slot is
// filled only when the caller asks for it and the parameter is not frozen (Tensor::frozen, set
// by `train.freeze`): a frozen parameter's gradient is neither computed nor allocated.

#include "glmtune/base/error.h"
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

// The gradient buffer of `param` behind a slot: on first use zeros shaped like it on its device,
// in the parameter's dtype on the CPU and in f32 on a GPU (where parameters may be bf16); a
// defined buffer must match the parameter's shape and device, so that a stale or mismatched one is
// an error rather than silent corruption.
inline Tensor& grad_buffer(Tensor& slot, const Tensor& param, const char* op, const char* what) {
  const DType dtype = param.device().is_cpu() ? param.dtype() : DType::f32;
  if (!slot.defined()) slot = Tensor::zeros(param.shape(), dtype, param.device());
  GLMTUNE_ASSERT(slot.shape() == param.shape() && slot.device() == param.device() &&
                     slot.is_contiguous() && (slot.dtype() == dtype || !param.device().is_cpu()),
                 "{}: the {} gradient {} must be contiguous and shaped like {} on {}", op, what,
                 slot.str(), param.str(), param.device().str());
  return slot;
}

}  // namespace glmtune::ops

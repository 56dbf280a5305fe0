#include "glmtune/ops/dispatch.h"

namespace glmtune::ops {

Tensor cu_seqlens_for(const Tensor& cu_seqlens, const Tensor& like) {
  GLMTUNE_ASSERT(cu_seqlens.defined() && cu_seqlens.dim() == 1 && cu_seqlens.size(0) >= 2,
                 "cu_seqlens must be [ndoc + 1], got {}",
                 cu_seqlens.defined() ? cu_seqlens.str() : "undefined");
  if (like.device().is_cpu()) return cu_seqlens;
  if (cu_seqlens.dtype() == DType::i32 && cu_seqlens.device() == like.device()) return cu_seqlens;
  return cu_seqlens.to(Device::cpu()).to(DType::i32).to(like.device());
}

DType gradient_sum_dtype(const Tensor& like) {
  return like.device().is_cpu() ? like.dtype() : DType::f32;
}

}  // namespace glmtune::ops

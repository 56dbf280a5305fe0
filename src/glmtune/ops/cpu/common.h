#pragma once
// Private helpers of the CPU op kernels (src/glmtune/ops/cpu/*.cpp), shared by the forward and
// backward files of every op. Not part of the public ops API: the op files bring them in with
// `using namespace cpu_detail;`. (Document offsets are validated by read_cu_seqlens, which is
// public and declared in ops/indexer.h.)

#include <cmath>
#include <cstdint>
#include <string>

#include "glmtune/base/error.h"
#include "glmtune/ops/elementwise.h"
#include "glmtune/ops/grad.h"
#include "glmtune/ops/topk_order.h"
#include "glmtune/tensor/tensor.h"

namespace glmtune::ops::cpu_detail {

// The CPU kernels compute in f32 (the reference path) or f64 (finite-difference tests).
inline bool is_compute_dtype(DType t) { return t == DType::f32 || t == DType::f64; }

// A tensor for an error message, including the case of a missing one.
inline std::string describe(const Tensor& t) {
  return t.defined() ? t.str() : std::string("undefined");
}

// `t` (named `what` in messages of `op`) is a defined CPU tensor in a compute dtype.
inline void check_float(const Tensor& t, const char* what, const char* op) {
  GLMTUNE_ASSERT(t.defined(), "{}: {} is undefined", op, what);
  GLMTUNE_ASSERT(t.device().is_cpu(), "{}: CPU kernel got {} {}", op, what, t.str());
  GLMTUNE_ASSERT(t.dtype() == DType::f32 || t.dtype() == DType::f64,
                 "{}: CPU kernels compute in f32 or f64, got {} {}", op, what, t.str());
}

// One formula for the forward and the backward, so that a backward recomputing a forward value
// gets it bit for bit.
template <typename T>
T sigmoid(T v) {
  return T(1) / (T(1) + std::exp(-v));
}

template <typename T>
const T* ptr_or_null(const Tensor& t) {
  return t.defined() ? t.data<T>() : nullptr;
}

}  // namespace glmtune::ops::cpu_detail

#pragma once
// Private helpers shared by the clamped SwiGLU MLP forward (mlp.cpp) and backward
// (mlp_backward.cpp) kernels.

#include <cstdint>

#include "glmtune/ops/cpu/common.h"
#include "glmtune/ops/mlp.h"

namespace glmtune::ops::cpu_detail {

// Rows of the last dimension with a unit inner stride and a uniform row stride, viewed in place
// when the layout allows (the halves of a fused [N, 2I] product qualify), else copied.
struct RowView {
  Tensor t;
  int64_t rows = 0, cols = 0, row_stride = 0;
};

inline RowView row_view(const Tensor& x) {
  RowView r;
  r.cols = x.size(-1);
  r.rows = r.cols > 0 ? x.numel() / r.cols : 0;
  if (x.dim() == 2 && x.stride(1) == 1) {
    r.t = x;
    r.row_stride = x.stride(0);
  } else {
    r.t = x.contiguous();
    r.row_stride = r.cols;
  }
  return r;
}

}  // namespace glmtune::ops::cpu_detail

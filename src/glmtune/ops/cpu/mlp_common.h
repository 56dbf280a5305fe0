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

// The three projections are present and agree on I and D: gate, up [I, D], down [D, I].
inline void check_mlp_params(const MlpParams& params) {
  GLMTUNE_ASSERT(
      params.gate_proj.defined() && params.up_proj.defined() && params.down_proj.defined(),
      "MLP parameters are incomplete");
  GLMTUNE_ASSERT(params.gate_proj.shape() == params.up_proj.shape() &&
                     params.down_proj.dim() == 2 &&
                     params.down_proj.size(1) == params.gate_proj.size(0) &&
                     params.down_proj.size(0) == params.gate_proj.size(1),
                 "MLP shapes disagree: gate {} up {} down {}", params.gate_proj.str(),
                 params.up_proj.str(), params.down_proj.str());
}

}  // namespace glmtune::ops::cpu_detail

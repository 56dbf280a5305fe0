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

// Calls body(r, gate_row, up_row) for every row of a gate/up pair, on threads once the work pays
// off; the forward and the backward walk the rows alike.
template <typename T, typename Body>
void for_each_gate_up_row(const RowView& g, const RowView& u, Body body) {
  const T* gp = g.t.data<T>();
  const T* up = u.t.data<T>();
#pragma omp parallel for schedule(static) if (g.rows * g.cols > 65536)
  for (int64_t r = 0; r < g.rows; ++r) body(r, gp + r * g.row_stride, up + r * u.row_stride);
}

}  // namespace glmtune::ops::cpu_detail

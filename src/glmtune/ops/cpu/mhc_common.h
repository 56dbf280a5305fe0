#pragma once
// Private helpers shared by the mHC forward (mhc.cpp) and backward (mhc_backward.cpp) kernels.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>

#include "glmtune/ops/cpu/common.h"

namespace glmtune::ops::cpu_detail {

// Number of tokens in the leading dims of a tensor whose trailing `tail` dims are fixed.
inline int64_t leading(const Tensor& t, int64_t tail) {
  int64_t n = 1;
  for (int64_t d = 0; d + tail < t.dim(); ++d) n *= t.size(d);
  return n;
}

// The leading dims of `t` (all but the trailing `tail`) followed by `append`.
inline Shape leading_shape(const Tensor& t, int64_t tail, std::initializer_list<int64_t> append) {
  Shape s(t.shape().begin(), t.shape().end() - tail);
  s.insert(s.end(), append);
  return s;
}

// The start of one token's Sinkhorn projection: row softmax of the H×H logits (max-shifted, as
// torch), then eps on every entry. The backward replays the projection from here, so both
// directions run this one loop. `out` may be `logits` itself.
template <typename T>
void sinkhorn_start(const T* logits, int64_t h, T eps, T* out) {
  for (int64_t i = 0; i < h; ++i) {
    const T* l = logits + i * h;
    T mx = l[0];
    for (int64_t j = 1; j < h; ++j) mx = std::max(mx, l[j]);
    T sum = 0;
    for (int64_t j = 0; j < h; ++j) {
      out[i * h + j] = std::exp(l[j] - mx);
      sum += out[i * h + j];
    }
    for (int64_t j = 0; j < h; ++j) out[i * h + j] = out[i * h + j] / sum + eps;
  }
}

}  // namespace glmtune::ops::cpu_detail

#pragma once
// Private helpers shared by the CPU sparse attention's forward (mla.cpp) and backward
// (mla_backward.cpp): the operand checks, the visible key sets and the softmax numerators, which
// both files must compute the same way, bit for bit, so that the backward differentiates exactly
// the function the forward ran.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "glmtune/ops/cpu/common.h"
#include "glmtune/ops/indexer.h"
#include "glmtune/ops/linear.h"
#include "glmtune/ops/mla.h"

namespace glmtune::ops::cpu_detail {

// The checks the sparse attention (forward and backward) makes before dispatch (ops/checks.h):
// q, k [T, NH, Dqk] and v [T, NH, Dv] on one device, indices [T, W], and the output gradient
// (when given) shaped like v. The dtypes, the entries of the indices (read where they live) and
// the document offsets (malformed ones are the caller's error, with a fix) are the bodies'.
inline void check_attention_args(const Tensor& q, const Tensor& k, const Tensor& v,
                                 const Tensor& indices, const Tensor* dout, const char* op) {
  GLMTUNE_ASSERT(q.defined() && q.dim() == 3, "{}: q {} must be [T, NH, Dqk]", op, describe(q));
  GLMTUNE_ASSERT(k.defined() && k.shape() == q.shape() && k.device() == q.device(),
                 "{}: k {} must be shaped like q {}, on its device", op, describe(k), q.str());
  GLMTUNE_ASSERT(v.defined() && v.dim() == 3 && v.size(0) == q.size(0) && v.size(1) == q.size(1) &&
                     v.device() == q.device(),
                 "{}: v {} must be [T, NH, Dv] like q {}, on its device", op, describe(v), q.str());
  GLMTUNE_ASSERT(indices.defined() && indices.dim() == 2 && indices.size(0) == q.size(0),
                 "{}: indices {} must be [{}, W]", op, describe(indices), q.size(0));
  if (dout)
    GLMTUNE_ASSERT(dout->defined() && dout->shape() == v.shape() && dout->device() == v.device(),
                   "{}: the output gradient {} must be shaped like v {}, on its device", op,
                   describe(*dout), v.str());
}

// What the CPU body takes beyond check_attention_args: q, k and v of one compute dtype.
inline void check_attention_qkv(const Tensor& q, const Tensor& k, const Tensor& v) {
  GLMTUNE_ASSERT(is_compute_dtype(q.dtype()) && k.dtype() == q.dtype() && v.dtype() == q.dtype(),
                 "attention on the CPU takes q {}, k {} and v {} in one of f32 and f64", q.str(),
                 k.str(), v.str());
}

// The softmax numerators exp(scale·q·k_j − max) of one query row `qh` and head h over its n
// visible keys (token ids `keys`, q and k [T, heads, dqk] contiguous) into prob[0, n); returns
// their sum. The backward replays exactly this arithmetic to recover the forward's probabilities.
template <typename T>
T softmax_numerators(const T* qh, const T* k, const int64_t* keys, size_t n, int64_t heads,
                     int64_t h, int64_t dqk, T scale, T* prob) {
  T mx = -std::numeric_limits<T>::infinity();
  for (size_t j = 0; j < n; ++j) {
    const T* kj = k + (keys[j] * heads + h) * dqk;
    T dot = T(0);
    for (int64_t c = 0; c < dqk; ++c) dot += qh[c] * kj[c];
    prob[j] = dot * scale;
    mx = std::max(mx, prob[j]);
  }
  T sum = T(0);
  for (size_t j = 0; j < n; ++j) {
    prob[j] = std::exp(prob[j] - mx);
    sum += prob[j];
  }
  return sum;
}

// The keys query row `row` (its W entries of the indices) sees: the entries as a sorted set,
// −1 ("no key") left out. The reference's mask is the union of the entries, so a repeated index
// must not weigh twice; the forward and the backward take the same set.
inline void visible_keys(const int32_t* row, int64_t width, std::vector<int64_t>& keys) {
  keys.clear();
  for (int64_t w = 0; w < width; ++w)
    if (row[w] >= 0) keys.push_back(row[w]);
  std::sort(keys.begin(), keys.end());
  keys.erase(std::unique(keys.begin(), keys.end()), keys.end());
}

// The per-query attention indices int32 [T, W] against the packing: returns the document bounds
// after checking, outside any parallel region (an exception must not escape an OpenMP loop), that
// every entry lies in its query's document. −1 is "no key"; anything else outside the document is
// a caller bug (indices from another pack, or document-local ones), never something to skip
// silently. The forward and the backward accept exactly the same indices.
inline std::vector<int64_t> checked_document_bounds(const Tensor& indices, const Tensor& cu_seqlens,
                                                    int64_t tokens, const char* where) {
  GLMTUNE_ASSERT(indices.defined() && indices.dtype() == DType::i32 && indices.dim() == 2 &&
                     indices.size(0) == tokens && indices.device().is_cpu(),
                 "attention indices must be int32 [{}, W], got {}", tokens, describe(indices));
  std::vector<int64_t> bounds = read_cu_seqlens(cu_seqlens, tokens, where);
  const Tensor idx_t = indices.contiguous();
  const int32_t* idx = idx_t.data<int32_t>();
  const int64_t width = indices.size(1);
  for (size_t d = 0; d + 1 < bounds.size(); ++d) {
    const int64_t lo = bounds[d], hi = bounds[d + 1];
    for (int64_t i = lo; i < hi; ++i)
      for (int64_t w = 0; w < width; ++w) {
        const int64_t j = idx[i * width + w];
        GLMTUNE_ASSERT(j == -1 || (j >= lo && j < hi),
                       "attention index {} of token {} lies outside its document [{}, {})", j, i,
                       lo, hi);
      }
  }
  return bounds;
}

}  // namespace glmtune::ops::cpu_detail

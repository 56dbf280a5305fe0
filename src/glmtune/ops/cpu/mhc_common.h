#pragma once
// Private helpers shared by the mHC forward (mhc.cpp) and backward (mhc_backward.cpp) kernels.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "glmtune/ops/cpu/common.h"
#include "glmtune/ops/mhc.h"

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

// The checks mhc_pre and its backward make before dispatch (ops/checks.h): streams [..., H, D]
// for H = hc_mult, fn [(2+H)·H, H·D], base [(2+H)·H], scale [3] on the streams' device, at least
// one Sinkhorn iteration (the dtypes are the bodies': the GPU mixes bf16 streams with f32
// parameters).
inline void check_pre_args(const Tensor& streams, const Tensor& fn, const Tensor& base,
                           const Tensor& scale, const MhcOptions& options, const char* op) {
  const int64_t h = options.hc_mult;
  GLMTUNE_ASSERT(streams.defined() && fn.defined() && base.defined() && scale.defined(),
                 "{}: needs streams, fn, base and scale", op);
  GLMTUNE_ASSERT(h >= 1 && options.sinkhorn_iters >= 1, "{}: hc_mult {} and iters {}", op, h,
                 options.sinkhorn_iters);
  GLMTUNE_ASSERT(streams.dim() >= 2 && streams.size(-2) == h,
                 "{}: streams {} must be [..., H={}, D]", op, streams.str(), h);
  const int64_t m = (2 + h) * h, hd = h * streams.size(-1);
  GLMTUNE_ASSERT(fn.dim() == 2 && fn.size(0) == m && fn.size(1) == hd, "{}: fn {} must be [{}, {}]",
                 op, fn.str(), m, hd);
  GLMTUNE_ASSERT(base.dim() == 1 && base.size(0) == m, "{}: base {} must be [{}]", op, base.str(),
                 m);
  GLMTUNE_ASSERT(scale.dim() == 1 && scale.size(0) == 3, "{}: scale {} must be [3]", op,
                 scale.str());
  for (const Tensor* p : {&fn, &base, &scale})
    GLMTUNE_ASSERT(p->device() == streams.device(), "{}: {} must be on the device of {}", op,
                   p->str(), streams.str());
}

// An optional upstream gradient of mhc_pre or mhc_post: undefined (zero), or `shape` on the
// streams' device.
inline void check_optional_grad(const Tensor& g, const Shape& shape, const Tensor& streams,
                                const char* what, const char* op) {
  GLMTUNE_ASSERT(!g.defined() || (g.shape() == shape && g.device() == streams.device()),
                 "{}: {} {} must be {} on the device of streams {}", op, what,
                 g.defined() ? g.str() : "", shape_str(shape), streams.str());
}

// The checks mhc_post and its backward make before dispatch (ops/checks.h): streams [..., H, D],
// y [..., D], post [..., H] and comb [..., H, H] over the same tokens, on one device (the dtypes
// are the bodies': the GPU mixes bf16 streams with f32 weights).
inline void check_post_args(const Tensor& streams, const Tensor& y, const Tensor& post,
                            const Tensor& comb, const char* op) {
  GLMTUNE_ASSERT(
      streams.defined() && y.defined() && post.defined() && comb.defined() && streams.dim() >= 2,
      "{}: needs streams [..., H, D], y, post and comb", op);
  const int64_t h = streams.size(-2), d = streams.size(-1);
  GLMTUNE_ASSERT(y.shape() == leading_shape(streams, 2, {d}),
                 "{}: y {} must be [..., D] for streams {}", op, y.str(), streams.str());
  GLMTUNE_ASSERT(post.shape() == leading_shape(streams, 2, {h}),
                 "{}: post {} must be [..., H] for streams {}", op, post.str(), streams.str());
  GLMTUNE_ASSERT(comb.shape() == leading_shape(streams, 2, {h, h}),
                 "{}: comb {} must be [..., H, H] for streams {}", op, comb.str(), streams.str());
  for (const Tensor* t : {&y, &post, &comb})
    GLMTUNE_ASSERT(t->device() == streams.device(), "{}: {} must be on the device of streams {}",
                   op, t->str(), streams.str());
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

// One Sinkhorn step on an H×H matrix: every column (or row) of `in` divided by its sum + eps,
// written to `out` (which may be `in`). The forward and the backward's replay run this one loop,
// so the replayed states equal the forward's bit for bit.
template <typename T>
void sinkhorn_step(const T* in, T* out, int64_t h, T eps, bool column) {
  // Line a's element b sits at a·line + b·step.
  const int64_t line = column ? 1 : h, step = column ? h : 1;
  for (int64_t a = 0; a < h; ++a) {
    T s = 0;
    for (int64_t b = 0; b < h; ++b) s += in[a * line + b * step];
    const T d = s + eps;
    for (int64_t b = 0; b < h; ++b) out[a * line + b * step] = in[a * line + b * step] / d;
  }
}

// A tensor of streams [..., H, D] (checked before dispatch).
inline void check_streams(const Tensor& streams, const char* what, const char* op) {
  GLMTUNE_ASSERT(streams.defined() && streams.dim() >= 2, "{}: {} {} must be [..., H, D]", op, what,
                 streams.defined() ? streams.str() : "undefined");
}

// [..., H, D] summed over the streams H (in stream order) into [..., D]; with `mean`, the sum is
// then divided once by H, as torch's mean. mhc_head is that mean, mhc_expand's backward the sum.
inline Tensor sum_streams(const Tensor& streams, bool mean, const char* what, const char* op) {
  check_float(streams, what, op);
  const int64_t h = streams.size(-2), d = streams.size(-1), n = leading(streams, 2);
  Tensor xs = streams.contiguous();
  Tensor out = Tensor::empty(leading_shape(streams, 2, {d}), streams.dtype());
  auto run = [&](auto* x, auto* o) {
    using T = std::remove_pointer_t<decltype(o)>;
    for (int64_t t = 0; t < n; ++t)
      for (int64_t k = 0; k < d; ++k) {
        T s = 0;
        for (int64_t i = 0; i < h; ++i) s += x[(t * h + i) * d + k];
        o[t * d + k] = mean ? s / T(h) : s;
      }
  };
  if (streams.dtype() == DType::f32)
    run(xs.data<float>(), out.data<float>());
  else
    run(xs.data<double>(), out.data<double>());
  return out;
}

}  // namespace glmtune::ops::cpu_detail

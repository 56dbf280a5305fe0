#pragma once
// Private helpers shared by the KDA forward (kda.cpp) and backward (kda_backward.cpp) kernels:
// operand checks that both directions must apply identically.

#include <cmath>
#include <cstdint>

#include "glmtune/ops/cpu/common.h"

namespace glmtune::ops::cpu_detail {

struct CoreShapes {
  int64_t tokens, heads, kd, vd;
};

// The checks the delta-rule core (forward and backward) makes before dispatch (ops/checks.h): q,
// k, g [T, NL, K], v [T, NL, V], beta [T, NL] on one device, a positive chunk size. Their dtypes
// are the bodies' (the GPU takes f32 g and beta beside bf16 q, k, v), and so are the document
// offsets (malformed ones are the caller's error, with a fix, where they are read).
inline void check_core_args(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                            const Tensor& beta, int64_t chunk_size, const char* op) {
  GLMTUNE_ASSERT(q.defined() && k.defined() && v.defined() && g.defined() && beta.defined(),
                 "{}: needs q, k, v, g and beta", op);
  GLMTUNE_ASSERT(q.dim() == 3 && k.shape() == q.shape() && g.shape() == q.shape(),
                 "{}: q {}, k {}, g {} must all be [T, NL, K]", op, q.str(), k.str(), g.str());
  GLMTUNE_ASSERT(v.dim() == 3 && v.size(0) == q.size(0) && v.size(1) == q.size(1),
                 "{}: v {} must be [T, NL, V] for q {}", op, v.str(), q.str());
  GLMTUNE_ASSERT(beta.dim() == 2 && beta.size(0) == q.size(0) && beta.size(1) == q.size(1),
                 "{}: beta {} must be [T, NL] for q {}", op, beta.str(), q.str());
  for (const Tensor* t : {&k, &v, &g, &beta})
    GLMTUNE_ASSERT(t->device() == q.device(), "{}: operand {} must be on the device of q {}", op,
                   t->str(), q.str());
  GLMTUNE_ASSERT(chunk_size >= 1, "{}: chunk size {} must be positive", op, chunk_size);
}

// What the CPU body of the core takes beyond check_core_args: every operand in q's compute dtype.
inline CoreShapes check_core(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                             const Tensor& beta, const char* op) {
  for (const Tensor* t : {&q, &k, &v, &g, &beta}) check_float(*t, "operand", op);
  for (const Tensor* t : {&k, &v, &g, &beta})
    GLMTUNE_ASSERT(t->dtype() == q.dtype(), "{}: operand {} must have the dtype of q {}", op,
                   t->str(), q.str());
  return {q.size(0), q.size(1), q.size(2), v.size(2)};
}

// The kernel width Kc of a depthwise conv weight for `channels` channels: [C, Kc] or [C, 1, Kc].
// The checks kda_gate and its backward make before dispatch (ops/checks.h): graw [T, NL·HL],
// dt_bias [NL·HL] and A_log [NL] on one device (their dtypes are the bodies').
inline void check_gate_args(const Tensor& graw, const Tensor& dt_bias, const Tensor& A_log,
                            const char* op) {
  GLMTUNE_ASSERT(graw.defined() && dt_bias.defined() && A_log.defined(),
                 "{}: needs graw, dt_bias and A_log", op);
  GLMTUNE_ASSERT(graw.dim() == 2 && A_log.dim() == 1 && A_log.size(0) >= 1 &&
                     graw.size(1) % A_log.size(0) == 0 && dt_bias.dim() == 1 &&
                     dt_bias.size(0) == graw.size(1),
                 "{}: graw {}, dt_bias {}, A_log {} do not fit [T, NL·HL], [NL·HL], [NL]", op,
                 graw.str(), dt_bias.str(), A_log.str());
  GLMTUNE_ASSERT(dt_bias.device() == graw.device() && A_log.device() == graw.device(),
                 "{}: graw {}, dt_bias {} and A_log {} must be on one device", op, graw.str(),
                 dt_bias.str(), A_log.str());
}

// The conv's x [T, C] and its weight [C, Kc] or [C, 1, Kc] on x's device, checked before
// dispatch; the taps Kc.
inline int64_t conv_taps(const Tensor& weight, int64_t channels, const char* op);
inline int64_t check_conv_args(const Tensor& x, const Tensor& weight, const char* op) {
  GLMTUNE_ASSERT(x.defined() && weight.defined() && x.dim() == 2,
                 "{}: x {} must be [T, C], with a weight", op, x.defined() ? x.str() : "undefined");
  GLMTUNE_ASSERT(weight.device() == x.device(), "{}: weight {} must be on the device of x {}", op,
                 weight.str(), x.str());
  return conv_taps(weight, x.size(1), op);
}

// kda_qk_conv's heads, C / head_dim, checked before dispatch (the conv's own checks follow).
inline int64_t qk_conv_heads(const Tensor& x, int64_t head_dim, const char* op) {
  GLMTUNE_ASSERT(x.defined() && x.dim() == 2, "{}: x {} must be [T, C]", op,
                 x.defined() ? x.str() : "undefined");
  GLMTUNE_ASSERT(head_dim >= 1 && x.size(1) % head_dim == 0,
                 "{}: x {} has {} channels, not a multiple of head_dim {}", op, x.str(), x.size(1),
                 head_dim);
  return x.size(1) / head_dim;
}

inline int64_t conv_taps(const Tensor& weight, int64_t channels, const char* op) {
  const int64_t c = channels;
  const bool shape_ok = (weight.dim() == 2 && weight.size(0) == c) ||
                        (weight.dim() == 3 && weight.size(0) == c && weight.size(1) == 1);
  GLMTUNE_ASSERT(shape_ok, "{}: weight {} must be [C={}, Kc] or [C, 1, Kc]", op, weight.str(), c);
  return weight.size(-1);
}

// The reference's thresholded softplus, written log(1 + exp(z)) (not log1p) to round as it does;
// above 20 the branch avoids exp overflow.
template <typename T>
T softplus_thresholded(T z) {
  return z > T(20) ? z : std::log(T(1) + std::exp(z));
}

// Calls f(i, h, ch, rate, z) for every entry i = t·QL + ch (ch = h·HL + a) of the forget gate's
// input graw [n, QL = NL·HL], with the head's rate = exp(A_log[h]) and z = graw + dt_bias: the
// part of the gate the forward and both backward passes share. Entries run in token, head,
// channel order; `parallel` splits the tokens across threads (only for per-entry work: a pass
// that sums over tokens must stay serial to keep its order).
template <typename T, typename F>
void for_each_gate_entry(const T* graw, const T* dt_bias, const T* a_log, int64_t n, int64_t nl,
                         int64_t hl, bool parallel, F&& f) {
  const int64_t ql = nl * hl;
#pragma omp parallel for schedule(static) if (parallel && n * ql > 65536)
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t h = 0; h < nl; ++h) {
      const T rate = std::exp(a_log[h]);
      for (int64_t a = 0; a < hl; ++a) {
        const int64_t ch = h * hl + a, i = t * ql + ch;
        f(i, h, ch, rate, T(graw[i] + dt_bias[ch]));
      }
    }
  }
}

}  // namespace glmtune::ops::cpu_detail

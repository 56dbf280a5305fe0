// The vision tower's leaf ops on the CPU (ops/vision.h).

#include "glmtune/ops/vision.h"

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <utility>

#include "glmtune/base/error.h"
#include "glmtune/ops/checks.h"
#include "glmtune/ops/dispatch.h"
#include "glmtune/ops/linear.h"

namespace glmtune::ops {
namespace {

// Rows of a query block scored at once: bounds the score buffer to kQueryBlock × segment length,
// so that a full-resolution image (tens of thousands of rows) never needs a square matrix.
constexpr int64_t kQueryBlock = 256;

// In place: row = softmax(row), max-shifted, the normaliser summed in double; returns the row's
// log-sum-exp. The backward recomputes the forward's probabilities with this same arithmetic.
template <typename T>
double softmax_row(T* row, int64_t len) {
  const T mx = *std::max_element(row, row + len);
  double sum = 0.0;
  for (int64_t j = 0; j < len; ++j) {
    row[j] = std::exp(row[j] - mx);
    sum += double(row[j]);
  }
  const T inv = T(1.0 / sum);
  for (int64_t j = 0; j < len; ++j) row[j] *= inv;
  return double(mx) + std::log(sum);
}

void check_float(const Tensor& t, const char* op, const char* what) {
  GLMTUNE_ASSERT(t.defined() && (t.dtype() == DType::f32 || t.dtype() == DType::f64),
                 "{}: {} must be f32 or f64, got {}", op, what,
                 t.defined() ? t.str() : std::string("undefined"));
}

template <typename T>
RopeTables tables_impl(const Tensor& positions, int64_t hd, double theta, DType dtype) {
  const int64_t n = positions.size(0);
  const int64_t quarter = hd / 4, half = hd / 2;
  std::vector<T> inv_freq(static_cast<size_t>(quarter));
  for (int64_t k = 0; k < quarter; ++k) {
    const T exponent = T(2 * k) / T(half);
    inv_freq[size_t(k)] = T(1) / std::pow(T(theta), exponent);
  }
  RopeTables t{Tensor::empty({n, hd}, dtype), Tensor::empty({n, hd}, dtype)};
  const Tensor pos_c = positions.contiguous();
  const int64_t* pos = pos_c.data<int64_t>();
  for (int64_t r = 0; r < n; ++r) {
    T* c = t.cos.data<T>() + r * hd;
    T* s = t.sin.data<T>() + r * hd;
    for (int axis = 0; axis < 2; ++axis) {
      const T p = T(pos[r * 2 + axis]);
      for (int64_t k = 0; k < quarter; ++k) {
        const T angle = p * inv_freq[size_t(k)];
        const int64_t m = axis * quarter + k;
        c[m] = c[m + half] = std::cos(angle);
        s[m] = s[m + half] = std::sin(angle);
      }
    }
  }
  return t;
}

// Visits every rotated pair of x [N·H, hd] in place: rotate(lo, hi, cos, sin, half) with
// lo = x[m], hi = x[m+hd/2] and cos / sin pointing at the row's tables at m (their m+hd/2 entry
// is [half]). The forward rotation and its transpose differ only in `rotate` (RotatePair).
template <typename T, typename Rotate>
void for_each_rope_pair(Tensor& x, const RopeTables& t, Rotate rotate) {
  const int64_t n = t.cos.size(0), hd = t.cos.size(1), half = hd / 2;
  const int64_t heads = x.size(0) / n;
  T* xp = x.data<T>();
  for (int64_t r = 0; r < n; ++r) {
    const T* c = t.cos.data<T>() + r * hd;
    const T* s = t.sin.data<T>() + r * hd;
    for (int64_t h = 0; h < heads; ++h) {
      T* v = xp + (r * heads + h) * hd;
      for (int64_t m = 0; m < half; ++m) rotate(v[m], v[m + half], c + m, s + m, half);
    }
  }
}

// Before dispatch (ops/checks.h): tables cos / sin [N, hd] for x [N·H, hd], hd a multiple of 4.
void check_rope_args(const Tensor& x, const RopeTables& t, const char* op) {
  GLMTUNE_ASSERT(
      t.cos.defined() && t.sin.defined() && t.cos.dim() == 2 && t.sin.shape() == t.cos.shape(),
      "{}: tables {} / {} must both be [N, hd]", op, t.cos.defined() ? t.cos.str() : "undefined",
      t.sin.defined() ? t.sin.str() : "undefined");
  const int64_t n = t.cos.size(0), hd = t.cos.size(1);
  GLMTUNE_ASSERT(x.defined() && x.dim() == 2 && x.size(1) == hd && hd % 4 == 0 &&
                     (n == 0 ? x.size(0) == 0 : x.size(0) % n == 0),
                 "{}: x {} must be [N·H, {}] for tables of {} positions", op,
                 x.defined() ? x.str() : "undefined", hd, n);
}

// What the CPU body takes beyond check_rope_args: x contiguous, the tables in its dtype.
void check_rope(const Tensor& x, const RopeTables& t, const char* op) {
  check_float(x, op, "x");
  GLMTUNE_ASSERT(x.is_contiguous() && t.cos.dtype() == x.dtype() && t.sin.dtype() == x.dtype(),
                 "{}: x {} must be contiguous, the tables {} / {} in its dtype", op, x.str(),
                 t.cos.str(), t.sin.str());
}

// One pair's rotation, rotate(lo, hi, cos, sin, half) as for_each_rope_pair calls it:
//   forward    x'[m] = x[m]·cos − x[m+hd/2]·sin,  x'[m+hd/2] = x[m+hd/2]·cos + x[m]·sin;
//   transpose  with d' the gradient of the rotated pair, da = d'[m]·cos + d'[m+hd/2]·sin,
//              db = d'[m+hd/2]·cos − d'[m]·sin.
template <bool kTranspose>
struct RotatePair {
  template <typename T>
  void operator()(T& lo, T& hi, const T* c, const T* s, int64_t half) const {
    const T a = lo, b = hi;
    if constexpr (kTranspose) {
      lo = a * c[0] + b * s[half];
      hi = b * c[half] - a * s[0];
    } else {
      lo = a * c[0] - b * s[0];
      hi = b * c[half] + a * s[half];
    }
  }
};

// rope_2d_ and (kTranspose) rope_2d_backward_, named `op` in messages.
template <bool kTranspose>
void rope_2d_op(Tensor& x, const RopeTables& t, const char* op) {
  check_rope_args(x, t, op);
  GLMTUNE_DISPATCH_CUDA(x, cuda_path::rope_2d_(x, t, kTranspose));
  check_rope(x, t, op);
  if (x.dtype() == DType::f32)
    for_each_rope_pair<float>(x, t, RotatePair<kTranspose>{});
  else
    for_each_rope_pair<double>(x, t, RotatePair<kTranspose>{});
}

// Calls fn(start, len, h, q0, rows) for every block of at most kQueryBlock query rows
// [q0, q0 + rows) of the query rows [q_begin, q_begin + q_rows), per segment [start, start + len)
// that holds any of them and per head h.
template <typename Fn>
void for_each_query_block(const std::vector<int64_t>& cu_seqlens, int64_t q_begin, int64_t q_rows,
                          int64_t heads, Fn&& fn) {
  for (size_t s = 0; s + 1 < cu_seqlens.size(); ++s) {
    const int64_t start = cu_seqlens[s], len = cu_seqlens[s + 1] - start;
    const int64_t first = std::max(start, q_begin), last = std::min(start + len, q_begin + q_rows);
    for (int64_t h = 0; first < last && h < heads; ++h)
      for (int64_t q0 = first; q0 < last; q0 += kQueryBlock)
        fn(start, len, h, q0, std::min(kQueryBlock, last - q0));
  }
}

template <typename T>
void segment_attention(const T* q, int64_t q_stride, int64_t q_begin, int64_t q_rows, const T* k,
                       int64_t k_stride, const T* v, int64_t v_stride, T* out, int64_t heads,
                       int64_t hd, const std::vector<int64_t>& cu_seqlens, double scale,
                       float* lse) {
  const int64_t d = heads * hd;
  std::vector<T> scores;
  for_each_query_block(cu_seqlens, q_begin, q_rows, heads,
                       [&](int64_t start, int64_t len, int64_t h, int64_t q0, int64_t rows) {
                         scores.resize(size_t(rows * len));
                         gemm<T>(false, true, rows, len, hd, T(scale),
                                 q + (q0 - q_begin) * q_stride + h * hd, q_stride,
                                 k + start * k_stride + h * hd, k_stride, T(0), scores.data(), len);
                         for (int64_t i = 0; i < rows; ++i) {
                           const double row_lse = softmax_row(&scores[size_t(i * len)], len);
                           if (lse) lse[(q0 - q_begin + i) * heads + h] = float(row_lse);
                         }
                         gemm<T>(false, false, rows, hd, len, T(1), scores.data(), len,
                                 v + start * v_stride + h * hd, v_stride, T(0),
                                 out + (q0 - q_begin) * d + h * hd, d);
                       });
}

// With O = P·V and dO its gradient: dV += Pᵀ·dO, dP = dO·Vᵀ, dS = P ⊙ (dP − rowsum(dO ⊙ O)),
// dQ = scale·dS·K, dK += scale·dSᵀ·Q. dk and dv start at zero.
template <typename T>
void segment_attention_backward(const T* q, int64_t q_stride, int64_t q_begin, int64_t q_rows,
                                const T* k, int64_t k_stride, const T* v, int64_t v_stride,
                                const T* out, const T* dout, T* dq, T* dk, T* dv, int64_t heads,
                                int64_t hd, const std::vector<int64_t>& cu_seqlens, double scale) {
  const int64_t d = heads * hd;
  std::vector<T> probs, dprobs;
  std::vector<double> delta;
  for_each_query_block(
      cu_seqlens, q_begin, q_rows, heads,
      [&](int64_t start, int64_t len, int64_t h, int64_t q0, int64_t rows) {
        const T* kh = k + start * k_stride + h * hd;
        const T* vh = v + start * v_stride + h * hd;
        T* dkh = dk + start * d + h * hd;
        T* dvh = dv + start * d + h * hd;
        const int64_t local = (q0 - q_begin) * d + h * hd;
        const T* qb = q + (q0 - q_begin) * q_stride + h * hd;
        const T* ob = out + local;
        const T* dob = dout + local;
        probs.resize(size_t(rows * len));
        dprobs.resize(size_t(rows * len));
        delta.assign(size_t(rows), 0.0);
        gemm<T>(false, true, rows, len, hd, T(scale), qb, q_stride, kh, k_stride, T(0),
                probs.data(), len);
        for (int64_t i = 0; i < rows; ++i) {
          softmax_row(&probs[size_t(i * len)], len);
          const T* o_row = ob + i * d;
          const T* do_row = dob + i * d;
          for (int64_t e = 0; e < hd; ++e) delta[size_t(i)] += double(o_row[e]) * double(do_row[e]);
        }
        gemm<T>(true, false, len, hd, rows, T(1), probs.data(), len, dob, d, T(1), dvh, d);
        gemm<T>(false, true, rows, len, hd, T(1), dob, d, vh, v_stride, T(0), dprobs.data(), len);
        for (int64_t i = 0; i < rows; ++i) {
          T* dp = &dprobs[size_t(i * len)];
          const T* p = &probs[size_t(i * len)];
          const T dl = T(delta[size_t(i)]);
          for (int64_t j = 0; j < len; ++j) dp[j] = p[j] * (dp[j] - dl);
        }
        gemm<T>(false, false, rows, hd, len, T(scale), dprobs.data(), len, kh, k_stride, T(0),
                dq + local, d);
        gemm<T>(true, false, len, hd, rows, T(scale), dprobs.data(), len, qb, q_stride, T(1), dkh,
                d);
      });
}

// Before dispatch (ops/checks.h): q [rows, H·hd] and k, v [n, H·hd] split alike into `heads`,
// segment bounds rising from 0 to n, the query rows [q_begin, q_begin + rows) inside them.
void check_attention_args(const Tensor& q, const Tensor& k, const Tensor& v,
                          const std::vector<int64_t>& cu, int64_t heads, int64_t q_begin,
                          const char* op) {
  for (const auto& [t, what] : {std::pair{&q, "q"}, std::pair{&k, "k"}, std::pair{&v, "v"}})
    GLMTUNE_ASSERT(t->defined() && t->dim() == 2 && t->device() == q.device(),
                   "{}: {} {} must be [rows, H·hd] on the device of q", op, what,
                   t->defined() ? t->str() : "undefined");
  const int64_t d = q.size(1), n = k.size(0);
  GLMTUNE_ASSERT(heads >= 1 && d % heads == 0 && k.size(1) == d && v.size(1) == d && v.size(0) == n,
                 "{}: q {}, k {}, v {} do not split into {} heads alike", op, q.str(), k.str(),
                 v.str(), heads);
  GLMTUNE_ASSERT(
      !cu.empty() && cu.front() == 0 && cu.back() == n && std::is_sorted(cu.begin(), cu.end()),
      "{}: segment bounds must rise from 0 to the pack's {} rows", op, n);
  GLMTUNE_ASSERT(q_begin >= 0 && q_begin + q.size(0) <= n,
                 "{}: query rows [{}, {}) outside the pack's {} rows", op, q_begin,
                 q_begin + q.size(0), n);
}

// What the CPU body takes beyond check_attention_args: one float dtype, unit column strides.
void check_attention(const Tensor& q, const Tensor& k, const Tensor& v, const char* op) {
  for (const auto& [t, what] : {std::pair{&q, "q"}, std::pair{&k, "k"}, std::pair{&v, "v"}}) {
    check_float(*t, op, what);
    GLMTUNE_ASSERT(t->stride(1) == 1 && t->dtype() == q.dtype(),
                   "{}: {} {} must have unit column stride, in q's dtype", op, what, t->str());
  }
}

}  // namespace

RopeTables rope_2d_tables(const Tensor& positions, int64_t head_dim, double theta, DType dtype) {
  GLMTUNE_ASSERT(positions.defined() && positions.dtype() == DType::i64 && positions.dim() == 2 &&
                     positions.size(1) == 2 && positions.device().is_cpu(),
                 "rope_2d_tables: positions {} must be CPU int64 [N, 2]",
                 positions.defined() ? positions.str() : std::string("undefined"));
  GLMTUNE_ASSERT(head_dim > 0 && head_dim % 4 == 0,
                 "rope_2d_tables: head dim {} not a multiple "
                 "of 4",
                 head_dim);
  if (dtype == DType::f32) return tables_impl<float>(positions, head_dim, theta, dtype);
  GLMTUNE_ASSERT(dtype == DType::f64, "rope_2d_tables: dtype {} is not f32 or f64",
                 dtype_name(dtype));
  return tables_impl<double>(positions, head_dim, theta, dtype);
}

void rope_2d_(Tensor& x, const RopeTables& tables) {
  rope_2d_op</*kTranspose=*/false>(x, tables, "rope_2d_");
}

void rope_2d_backward_(Tensor& dx, const RopeTables& tables) {
  rope_2d_op</*kTranspose=*/true>(dx, tables, "rope_2d_backward_");
}

void gelu_erf_(Tensor& x) {
  GLMTUNE_ASSERT(x.defined(), "gelu_erf_: no input");
  GLMTUNE_DISPATCH_CUDA(x, cuda_path::gelu_erf_(x));
  check_float(x, "gelu_erf_", "x");
  GLMTUNE_ASSERT(x.is_contiguous(), "gelu_erf_: x {} must be contiguous", x.str());
  constexpr double inv_sqrt2 = 0.70710678118654752440;
  auto run = [&](auto* p) {
    using T = std::remove_pointer_t<decltype(p)>;
    for (int64_t i = 0; i < x.numel(); ++i)
      p[i] = T(0.5) * p[i] * (T(1) + std::erf(p[i] * T(inv_sqrt2)));
  };
  if (x.dtype() == DType::f32)
    run(x.data<float>());
  else
    run(x.data<double>());
}

void gelu_erf_backward_(const Tensor& x, Tensor& dy) {
  GLMTUNE_ASSERT(x.defined(), "gelu_erf_backward_: no input");
  checks::same_shape(dy, x, "dy", "x", "gelu_erf_backward_");
  GLMTUNE_DISPATCH_CUDA(x, cuda_path::gelu_erf_backward_(x, dy));
  check_float(x, "gelu_erf_backward_", "x");
  GLMTUNE_ASSERT(
      x.is_contiguous() && dy.is_contiguous() && dy.shape() == x.shape() && dy.dtype() == x.dtype(),
      "gelu_erf_backward_: x {} and dy {} must be contiguous and alike", x.str(), dy.str());
  constexpr double inv_sqrt2 = 0.70710678118654752440;
  constexpr double inv_sqrt_2pi = 0.39894228040143267794;
  auto run = [&](const auto* p, auto* g) {
    using T = std::remove_pointer_t<decltype(g)>;
    for (int64_t i = 0; i < x.numel(); ++i) {
      const double v = double(p[i]);
      const double cdf = 0.5 * (1.0 + std::erf(v * inv_sqrt2));
      const double pdf = inv_sqrt_2pi * std::exp(-0.5 * v * v);
      g[i] = T(double(g[i]) * (cdf + v * pdf));
    }
  };
  if (x.dtype() == DType::f32)
    run(x.data<float>(), dy.data<float>());
  else
    run(x.data<double>(), dy.data<double>());
}

Tensor varlen_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                        const std::vector<int64_t>& cu_seqlens, int64_t heads, double scale,
                        int64_t q_begin, Tensor* lse) {
  check_attention_args(q, k, v, cu_seqlens, heads, q_begin, "varlen_attention");
  GLMTUNE_DISPATCH_CUDA(
      q, cuda_path::varlen_attention(q, k, v, cu_seqlens, heads, scale, q_begin, lse));
  check_attention(q, k, v, "varlen_attention");
  const int64_t d = q.size(1), hd = d / heads;
  Tensor out = Tensor::empty({q.size(0), d}, q.dtype());
  if (lse) *lse = Tensor::empty({q.size(0), heads}, DType::f32);
  auto run = [&](auto tag) {
    using T = decltype(tag);
    segment_attention<T>(q.data<T>(), q.stride(0), q_begin, q.size(0), k.data<T>(), k.stride(0),
                         v.data<T>(), v.stride(0), out.data<T>(), heads, hd, cu_seqlens, scale,
                         lse ? lse->data<float>() : nullptr);
  };
  if (q.dtype() == DType::f32)
    run(float());
  else
    run(double());
  return out;
}

VarlenAttentionGrads varlen_attention_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                                               const Tensor& out_in, const Tensor& dout_in,
                                               const std::vector<int64_t>& cu_seqlens,
                                               int64_t heads, double scale, int64_t q_begin,
                                               const Tensor& lse) {
  const char* op = "varlen_attention_backward";
  check_attention_args(q, k, v, cu_seqlens, heads, q_begin, op);
  checks::same_shape(out_in, q, "out", "q", op);
  checks::same_shape(dout_in, q, "dout", "q", op);
  GLMTUNE_DISPATCH_CUDA(q, cuda_path::varlen_attention_backward(
                               q, k, v, out_in, dout_in, cu_seqlens, heads, scale, q_begin, lse));
  check_attention(q, k, v, op);
  const Tensor out = out_in.contiguous(), dout = dout_in.contiguous();
  GLMTUNE_ASSERT(out.shape() == q.shape() && dout.shape() == q.shape() &&
                     out.dtype() == q.dtype() && dout.dtype() == q.dtype(),
                 "varlen_attention_backward: out {} and dout {} must be shaped like q {}",
                 out.str(), dout.str(), q.str());
  const int64_t d = q.size(1), hd = d / heads, n = k.size(0);
  VarlenAttentionGrads g{Tensor::empty({q.size(0), d}, q.dtype()), Tensor::zeros({n, d}, q.dtype()),
                         Tensor::zeros({n, d}, q.dtype())};
  auto run = [&](auto tag) {
    using T = decltype(tag);
    segment_attention_backward<T>(q.data<T>(), q.stride(0), q_begin, q.size(0), k.data<T>(),
                                  k.stride(0), v.data<T>(), v.stride(0), out.data<T>(),
                                  dout.data<T>(), g.dq.data<T>(), g.dk.data<T>(), g.dv.data<T>(),
                                  heads, hd, cu_seqlens, scale);
  };
  if (q.dtype() == DType::f32)
    run(float());
  else
    run(double());
  return g;
}

}  // namespace glmtune::ops

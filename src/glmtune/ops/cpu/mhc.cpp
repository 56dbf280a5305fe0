#include "glmtune/ops/mhc.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "glmtune/ops/cpu/common.h"
#include "glmtune/ops/cpu/mhc_common.h"
#include "glmtune/ops/dispatch.h"
#include "glmtune/ops/linear.h"

namespace glmtune::ops {
using namespace cpu_detail;
namespace {

void check_same_dtype(const Tensor& a, const Tensor& b, const char* what, const char* op) {
  GLMTUNE_ASSERT(a.dtype() == b.dtype(), "{}: {} {} must have the dtype of {}", op, what, b.str(),
                 a.str());
}

bool same_leading(const Tensor& a, int64_t tail_a, const Tensor& b, int64_t tail_b) {
  if (a.dim() - tail_a != b.dim() - tail_b) return false;
  for (int64_t d = 0; d + tail_a < a.dim(); ++d)
    if (a.size(d) != b.size(d)) return false;
  return true;
}

// One token's H×H Sinkhorn projection, in place on c (row-major, c[i*h + j]). On entry c holds
// the logits; on exit the projected matrix. `init`, if given, receives softmax + eps.
template <typename T>
void sinkhorn_token(T* c, int64_t h, int64_t iters, T eps, T* init) {
  sinkhorn_start(c, h, eps, c);
  if (init) std::copy(c, c + h * h, init);
  auto column_step = [&] { sinkhorn_step(c, c, h, eps, /*column=*/true); };
  auto row_step = [&] { sinkhorn_step(c, c, h, eps, /*column=*/false); };
  // The reference's order: one column step, then (iters − 1) × (row, column); it ends on a
  // column step, so columns sum to ≈ 1 and rows only approximately.
  column_step();
  for (int64_t it = 1; it < iters; ++it) {
    row_step();
    column_step();
  }
}

template <typename T>
void collapse_kernel(const T* x, const T* pre, int64_t n, int64_t h, int64_t d, T* out) {
#pragma omp parallel for schedule(static) if (n * h * d > 65536)
  for (int64_t t = 0; t < n; ++t) {
    const T* xt = x + t * h * d;
    const T* pt = pre + t * h;
    T* ot = out + t * d;
    for (int64_t k = 0; k < d; ++k) ot[k] = T(0);
    // Sum over streams in stream order, one product per term (the reference's
    // (pre[..., None] * X).sum(dim=stream)).
    for (int64_t i = 0; i < h; ++i)
      for (int64_t k = 0; k < d; ++k) ot[k] += pt[i] * xt[i * d + k];
  }
}

template <typename T>
void mhc_pre_kernel(const Tensor& streams, const Tensor& fn_in, const Tensor& base_in,
                    const Tensor& scale_in, const MhcOptions& o, MhcPreResult& res,
                    MhcPreSaved* saved) {
  const int64_t h = o.hc_mult, d = streams.size(-1), hd = h * d, m = (2 + h) * h;
  const int64_t n = leading(streams, 2);
  Tensor xs = streams.contiguous();
  Tensor fn = fn_in.contiguous(), base = base_in.contiguous(), scale = scale_in.contiguous();
  const T* x = xs.data<T>();

  // Un-weighted RMSNorm of the flattened streams (stream-major: element (i, k) at i·D + k).
  Tensor normed = Tensor::empty({n, hd}, streams.dtype());
  Tensor rstd = Tensor::empty({n}, streams.dtype());
  T* r = normed.data<T>();
  T* rs = rstd.data<T>();
#pragma omp parallel for schedule(static) if (n * hd > 65536)
  for (int64_t t = 0; t < n; ++t) {
    const T* xt = x + t * hd;
    double ss = 0;
    for (int64_t k = 0; k < hd; ++k) ss += double(xt[k]) * double(xt[k]);
    const T inv = T(1) / std::sqrt(T(ss / double(hd)) + T(o.rms_eps));
    rs[t] = inv;
    for (int64_t k = 0; k < hd; ++k) r[t * hd + k] = xt[k] * inv;
  }

  // mix = normed · fn^T, one GEMM for all three groups of logits.
  Tensor mix = Tensor::empty({n, m}, streams.dtype());
  gemm<T>(false, true, n, m, hd, T(1), r, hd, fn.data<T>(), hd, T(0), mix.data<T>(), m);

  res.post = Tensor::empty(leading_shape(streams, 2, {h}), streams.dtype());
  res.comb = Tensor::empty(leading_shape(streams, 2, {h, h}), streams.dtype());
  Tensor pre = Tensor::empty({n, h}, streams.dtype());
  Tensor comb_init = saved ? Tensor::empty({n, h, h}, streams.dtype()) : Tensor();
  const T* mx = mix.data<T>();
  const T* b = base.data<T>();
  const T* s = scale.data<T>();
  T* post = res.post.data<T>();
  T* comb = res.comb.data<T>();
  T* pr = pre.data<T>();
  T* ci = comb_init.defined() ? comb_init.data<T>() : nullptr;
  const T eps = T(o.hc_eps);
#pragma omp parallel for schedule(static) if (n > 256)
  for (int64_t t = 0; t < n; ++t) {
    const T* mt = mx + t * m;
    // Each logit is mix · scale + base (multiply, then add), as the reference writes it.
    for (int64_t i = 0; i < h; ++i) {
      pr[t * h + i] = sigmoid(mt[i] * s[0] + b[i]) + eps;
      post[t * h + i] = T(2) * sigmoid(mt[h + i] * s[1] + b[h + i]);
    }
    T* c = comb + t * h * h;
    for (int64_t k = 0; k < h * h; ++k) c[k] = mt[2 * h + k] * s[2] + b[2 * h + k];
    sinkhorn_token<T>(c, h, o.sinkhorn_iters, eps, ci ? ci + t * h * h : nullptr);
  }

  res.collapsed = Tensor::empty(leading_shape(streams, 2, {d}), streams.dtype());
  collapse_kernel<T>(x, pr, n, h, d, res.collapsed.data<T>());

  if (saved) {
    saved->rstd = rstd.view(leading_shape(streams, 2, {}));
    saved->mix = mix.view(leading_shape(streams, 2, {m}));
    saved->pre = pre.view(leading_shape(streams, 2, {h}));
    saved->comb_init = comb_init.view(leading_shape(streams, 2, {h, h}));
  }
}

template <typename T>
void post_kernel(const T* x, const T* y, const T* post, const T* comb, int64_t n, int64_t h,
                 int64_t d, T* out) {
#pragma omp parallel for schedule(static) if (n * h * d > 65536)
  for (int64_t t = 0; t < n; ++t) {
    const T* xt = x + t * h * d;
    const T* yt = y + t * d;
    const T* ct = comb + t * h * h;
    for (int64_t i = 0; i < h; ++i) {
      T* ot = out + (t * h + i) * d;
      const T p = post[t * h + i];
      // Residual mix first (comb^T · X, summed over the source stream j), then the sub-layer
      // output placed with weight post_i.
      for (int64_t k = 0; k < d; ++k) {
        T acc = 0;
        for (int64_t j = 0; j < h; ++j) acc += ct[j * h + i] * xt[j * d + k];
        ot[k] = p * yt[k] + acc;
      }
    }
  }
}

}  // namespace

MhcPreResult mhc_pre(const Tensor& streams, const Tensor& fn, const Tensor& base,
                     const Tensor& scale, const MhcOptions& options, MhcPreSaved* saved) {
  const char* op = "mhc_pre";
  check_pre_args(streams, fn, base, scale, options, op);
  GLMTUNE_DISPATCH_CUDA(streams, cuda_path::mhc_pre(streams, fn, base, scale, options, saved));
  check_float(streams, "streams", op);
  check_float(fn, "fn", op);
  check_float(base, "base", op);
  check_float(scale, "scale", op);
  for (const Tensor* p : {&fn, &base, &scale}) check_same_dtype(streams, *p, "parameter", op);
  MhcPreResult res;
  if (streams.dtype() == DType::f32)
    mhc_pre_kernel<float>(streams, fn, base, scale, options, res, saved);
  else
    mhc_pre_kernel<double>(streams, fn, base, scale, options, res, saved);
  return res;
}

Tensor mhc_sinkhorn(const Tensor& logits, int64_t iters, double eps) {
  check_float(logits, "logits", "mhc_sinkhorn");
  GLMTUNE_ASSERT(logits.dim() >= 2 && logits.size(-1) == logits.size(-2) && iters >= 1,
                 "mhc_sinkhorn: logits {} must be [..., H, H], iters {} >= 1", logits.str(), iters);
  Tensor c = logits.clone();
  const int64_t h = logits.size(-1), n = leading(logits, 2);
  if (c.dtype() == DType::f32) {
    float* p = c.data<float>();
    for (int64_t t = 0; t < n; ++t)
      sinkhorn_token<float>(p + t * h * h, h, iters, float(eps), nullptr);
  } else {
    double* p = c.data<double>();
    for (int64_t t = 0; t < n; ++t) sinkhorn_token<double>(p + t * h * h, h, iters, eps, nullptr);
  }
  return c;
}

Tensor mhc_collapse(const Tensor& streams, const Tensor& pre) {
  const char* op = "mhc_collapse";
  check_float(streams, "streams", op);
  check_float(pre, "pre", op);
  check_same_dtype(streams, pre, "pre", op);
  GLMTUNE_ASSERT(streams.dim() >= 2 && pre.dim() >= 1 && pre.size(-1) == streams.size(-2) &&
                     same_leading(streams, 2, pre, 1),
                 "mhc_collapse: pre {} must be [..., H] for streams {}", pre.str(), streams.str());
  const int64_t h = streams.size(-2), d = streams.size(-1), n = leading(streams, 2);
  Tensor xs = streams.contiguous(), pc = pre.contiguous();
  Tensor out = Tensor::empty(leading_shape(streams, 2, {d}), streams.dtype());
  if (streams.dtype() == DType::f32)
    collapse_kernel<float>(xs.data<float>(), pc.data<float>(), n, h, d, out.data<float>());
  else
    collapse_kernel<double>(xs.data<double>(), pc.data<double>(), n, h, d, out.data<double>());
  return out;
}

Tensor mhc_post(const Tensor& streams, const Tensor& y, const Tensor& post, const Tensor& comb) {
  const char* op = "mhc_post";
  check_post_args(streams, y, post, comb, op);
  GLMTUNE_DISPATCH_CUDA(streams, cuda_path::mhc_post(streams, y, post, comb));
  check_float(streams, "streams", op);
  check_float(y, "y", op);
  check_float(post, "post", op);
  check_float(comb, "comb", op);
  for (const Tensor* p : {&y, &post, &comb}) check_same_dtype(streams, *p, "operand", op);
  const int64_t h = streams.size(-2), d = streams.size(-1), n = leading(streams, 2);
  Tensor xs = streams.contiguous(), yc = y.contiguous(), pc = post.contiguous(),
         cc = comb.contiguous();
  Tensor out = Tensor::empty(streams.shape(), streams.dtype());
  if (streams.dtype() == DType::f32)
    post_kernel<float>(xs.data<float>(), yc.data<float>(), pc.data<float>(), cc.data<float>(), n, h,
                       d, out.data<float>());
  else
    post_kernel<double>(xs.data<double>(), yc.data<double>(), pc.data<double>(), cc.data<double>(),
                        n, h, d, out.data<double>());
  return out;
}

Tensor mhc_expand(const Tensor& x, int64_t hc_mult) {
  GLMTUNE_ASSERT(x.defined() && x.dim() >= 1 && hc_mult >= 1, "mhc_expand: x {} and H {}",
                 x.defined() ? x.str() : "-", hc_mult);
  GLMTUNE_DISPATCH_CUDA(x, cuda_path::mhc_expand(x, hc_mult));
  Shape s(x.shape().begin(), x.shape().end() - 1);
  s.push_back(hc_mult);
  s.push_back(x.size(-1));
  Tensor out = Tensor::empty(s, x.dtype(), x.device());
  // Each stream is a strided view of the output; copy_ handles dtype and device.
  for (int64_t i = 0; i < hc_mult; ++i) out.select(-2, i).copy_(x);
  return out;
}

Tensor mhc_head(const Tensor& streams) {
  check_streams(streams, "streams", "mhc_head");
  GLMTUNE_DISPATCH_CUDA(streams, cuda_path::mhc_head(streams));
  return sum_streams(streams, /*mean=*/true, "streams", "mhc_head");
}

}  // namespace glmtune::ops

// Backward passes of the mHC ops (ops/mhc.h); the maths is written out in
// docs/model/backward_kda_mhc.md. Everything is per token except the parameter gradients, which
// are sums over tokens: the mixing weight's through one GEMM, base and scale in token order.

#include <algorithm>
#include <cmath>
#include <vector>

#include "glmtune/ops/cpu/common.h"
#include "glmtune/ops/cpu/mhc_common.h"
#include "glmtune/ops/dispatch.h"
#include "glmtune/ops/linear.h"
#include "glmtune/ops/mhc.h"

namespace glmtune::ops {
using namespace cpu_detail;
namespace {

// `g`, when defined, must have exactly the shape of the forward output it is the gradient of.
Tensor check_grad(const Tensor& g, const Shape& shape, DType dtype, const char* what,
                  const char* op) {
  if (!g.defined()) return g;
  check_float(g, what, op);
  GLMTUNE_ASSERT(g.dtype() == dtype && g.shape() == shape, "{}: {} {} must be {}{}", op, what,
                 g.str(), dtype_name(dtype), shape_str(shape));
  return g.contiguous();
}

// Backward of one token's Sinkhorn projection. `start` is softmax + eps (the forward's state
// before the first column step), `logits` the softmax input, `g` the upstream gradient (h×h,
// overwritten), `dlogits` the result. `states` is scratch for the 2·iters − 1 step inputs.
//
// Every step divides a line (column or row) x by s + eps with s = Σ x; for y = x / (s + eps),
// dx = (dy − ⟨dy, y⟩) / (s + eps). The softmax then gives dl = p ⊙ (dp − ⟨dp, p⟩) per row; the
// + eps after it passes the gradient unchanged.
template <typename T>
void sinkhorn_backward_token(const T* start, const T* logits, int64_t h, int64_t iters, T eps, T* g,
                             T* dlogits, std::vector<T>& states) {
  const int64_t hh = h * h, steps = 2 * iters - 1;
  states.resize(size_t(steps * hh));
  // Replay: step 0 is a column step, then rows (odd) and columns (even) alternate; the forward
  // performs exactly these divisions in this order, so the replayed states equal its states.
  std::copy(start, start + hh, states.begin());
  auto is_column = [](int64_t s) { return s % 2 == 0; };
  for (int64_t s = 0; s + 1 < steps; ++s)
    sinkhorn_step(&states[size_t(s * hh)], &states[size_t((s + 1) * hh)], h, eps, is_column(s));
  for (int64_t s = steps - 1; s >= 0; --s) {
    const T* in = &states[size_t(s * hh)];
    const bool column = is_column(s);
    for (int64_t a = 0; a < h; ++a) {
      T sum = 0;
      for (int64_t b = 0; b < h; ++b) sum += column ? in[b * h + a] : in[a * h + b];
      const T d = sum + eps;
      T dot = 0;
      for (int64_t b = 0; b < h; ++b) {
        const int64_t idx = column ? b * h + a : a * h + b;
        dot += g[idx] * (in[idx] / d);
      }
      for (int64_t b = 0; b < h; ++b) {
        const int64_t idx = column ? b * h + a : a * h + b;
        g[idx] = (g[idx] - dot) / d;
      }
    }
  }
  // Row softmax, recomputed from the logits with the forward's max shift.
  for (int64_t i = 0; i < h; ++i) {
    const T* l = logits + i * h;
    T mx = l[0];
    for (int64_t j = 1; j < h; ++j) mx = std::max(mx, l[j]);
    T sum = 0;
    for (int64_t j = 0; j < h; ++j) sum += std::exp(l[j] - mx);
    T dot = 0;
    for (int64_t j = 0; j < h; ++j) dot += g[i * h + j] * (std::exp(l[j] - mx) / sum);
    for (int64_t j = 0; j < h; ++j)
      dlogits[i * h + j] = (std::exp(l[j] - mx) / sum) * (g[i * h + j] - dot);
  }
}

// The softmax + eps start of the projection, as sinkhorn_token computes it.
template <typename T>
Tensor pre_backward_kernel(const Tensor& streams, const Tensor& fn_in, const Tensor& base_in,
                           const Tensor& scale_in, const MhcOptions& o, const MhcPreSaved& sv,
                           const Tensor& d_post, const Tensor& d_comb, const Tensor& d_coll,
                           const Tensor& residual, MhcGrads& grads) {
  const char* op = "mhc_pre_backward";
  const int64_t h = o.hc_mult, d = streams.size(-1), hd = h * d, m = (2 + h) * h;
  const int64_t n = leading(streams, 2);
  Tensor xs = streams.contiguous();
  Tensor fn = fn_in.contiguous(), base = base_in.contiguous(), scale = scale_in.contiguous();
  Tensor rstd = sv.rstd.contiguous(), mix = sv.mix.contiguous(), pre = sv.pre.contiguous(),
         cinit = sv.comb_init.contiguous();
  const T* x = xs.data<T>();
  const T* b = base.data<T>();
  const T* s = scale.data<T>();
  const T* rs = rstd.data<T>();
  const T* mx = mix.data<T>();
  const T* pr = pre.data<T>();
  const T* ci = cinit.data<T>();
  const T* gp = ptr_or_null<T>(d_post);
  const T* gc = ptr_or_null<T>(d_comb);
  const T* gl = ptr_or_null<T>(d_coll);
  const T eps = T(o.hc_eps);

  Tensor dx = Tensor::zeros(streams.shape(), streams.dtype());
  // Gradient of every affine logit mix·scale + base, per token.
  Tensor dlogit = Tensor::zeros({n, m}, streams.dtype());
  T* dxp = dx.data<T>();
  T* dl = dlogit.data<T>();
#pragma omp parallel if (n > 256)
  {
    std::vector<T> states, g(size_t(h * h)), logits(size_t(h * h));
#pragma omp for schedule(static)
    for (int64_t t = 0; t < n; ++t) {
      const T* xt = x + t * hd;
      const T* mt = mx + t * m;
      T* dlt = dl + t * m;
      // Collapse c = Σ_i pre_i X_i: dX_i = pre_i dc, dpre_i = ⟨dc, X_i⟩; then through
      // pre = σ(logit) + eps.
      if (gl) {
        const T* gt = gl + t * d;
        for (int64_t i = 0; i < h; ++i) {
          double dot = 0;
          for (int64_t k = 0; k < d; ++k) {
            dxp[t * hd + i * d + k] = pr[t * h + i] * gt[k];
            dot += double(gt[k]) * double(xt[i * d + k]);
          }
          const T sg = sigmoid(mt[i] * s[0] + b[i]);
          dlt[i] = T(dot) * sg * (T(1) - sg);
        }
      }
      if (gp) {
        for (int64_t i = 0; i < h; ++i) {
          const T sg = sigmoid(mt[h + i] * s[1] + b[h + i]);
          dlt[h + i] = gp[t * h + i] * T(2) * sg * (T(1) - sg);
        }
      }
      if (gc) {
        for (int64_t k = 0; k < h * h; ++k) {
          logits[size_t(k)] = mt[2 * h + k] * s[2] + b[2 * h + k];
          g[size_t(k)] = gc[t * h * h + k];
        }
        sinkhorn_backward_token<T>(ci + t * h * h, logits.data(), h, o.sinkhorn_iters, eps,
                                   g.data(), dlt + 2 * h, states);
      }
    }
  }

  // base and scale: sums over tokens in order (double accumulators).
  Tensor* gbase = grad_if_trained(grads.base, base_in);
  Tensor* gscale = grad_if_trained(grads.scale, scale_in);
  if (gbase) grad_buffer(*gbase, base_in, op, "base");
  if (gscale) grad_buffer(*gscale, scale_in, op, "scale");
  if (gbase || gscale) {
    std::vector<double> ab(size_t(m), 0.0), as(3, 0.0);
    for (int64_t t = 0; t < n; ++t)
      for (int64_t k = 0; k < m; ++k) {
        const double v = double(dl[t * m + k]);
        ab[size_t(k)] += v;
        as[size_t(k < h ? 0 : k < 2 * h ? 1 : 2)] += v * double(mx[t * m + k]);
      }
    if (gbase) {
      T* gb = gbase->data<T>();
      for (int64_t k = 0; k < m; ++k) gb[k] += T(ab[size_t(k)]);
    }
    if (gscale) {
      T* gs = gscale->data<T>();
      for (int64_t k = 0; k < 3; ++k) gs[k] += T(as[size_t(k)]);
    }
  }
  // dmix = dlogit · scale of the logit's group, in place.
  for (int64_t t = 0; t < n; ++t)
    for (int64_t k = 0; k < m; ++k) dl[t * m + k] *= s[k < h ? 0 : k < 2 * h ? 1 : 2];

  // mix = normed · fn^T: dfn += dmix^T normed, dnormed = dmix fn. normed = X·rstd is recomputed
  // with the forward's product.
  Tensor normed = Tensor::empty({n, hd}, streams.dtype());
  T* nr = normed.data<T>();
  for (int64_t t = 0; t < n; ++t)
    for (int64_t k = 0; k < hd; ++k) nr[t * hd + k] = x[t * hd + k] * rs[t];
  if (!fn_in.frozen())
    gemm<T>(true, false, m, hd, n, T(1), dl, m, nr, hd, T(1),
            grad_buffer(grads.fn, fn_in, op, "fn").data<T>(), hd);
  Tensor dn = Tensor::empty({n, hd}, streams.dtype());
  T* dnp = dn.data<T>();
  gemm<T>(false, false, n, hd, m, T(1), dl, m, fn.data<T>(), hd, T(0), dnp, hd);
  // Un-weighted RMSNorm over all H·D values: dX += r·dn − (r³/HD)·X·⟨dn, X⟩.
#pragma omp parallel for schedule(static) if (n * hd > 65536)
  for (int64_t t = 0; t < n; ++t) {
    const T* xt = x + t * hd;
    const T* g = dnp + t * hd;
    double dot = 0;
    for (int64_t k = 0; k < hd; ++k) dot += double(g[k]) * double(xt[k]);
    const T r = rs[t], c = T(dot) * r * r * r / T(hd);
    for (int64_t k = 0; k < hd; ++k) dxp[t * hd + k] += r * g[k] - c * xt[k];
  }
  if (residual.defined()) {
    const T* rp = residual.data<T>();
    for (int64_t k = 0; k < n * hd; ++k) dxp[k] += rp[k];
  }
  return dx;
}

}  // namespace

Tensor mhc_pre_backward(const Tensor& streams, const Tensor& fn, const Tensor& base,
                        const Tensor& scale, const MhcOptions& options, const MhcPreSaved* saved,
                        const Tensor& d_post, const Tensor& d_comb, const Tensor& d_collapsed,
                        MhcGrads& grads, const Tensor& residual) {
  const char* op = "mhc_pre_backward";
  check_pre_args(streams, fn, base, scale, options, op);
  const int64_t h = options.hc_mult;
  check_optional_grad(d_post, leading_shape(streams, 2, {h}), streams, "d_post", op);
  check_optional_grad(d_comb, leading_shape(streams, 2, {h, h}), streams, "d_comb", op);
  check_optional_grad(d_collapsed, leading_shape(streams, 2, {streams.size(-1)}), streams,
                      "d_collapsed", op);
  check_optional_grad(residual, streams.shape(), streams, "residual", op);
  GLMTUNE_DISPATCH_CUDA(
      streams, cuda_path::mhc_pre_backward(streams, fn, base, scale, options, saved, d_post, d_comb,
                                           d_collapsed, grads, residual));
  check_float(streams, "streams", op);
  const DType dt = streams.dtype();
  const int64_t d = streams.size(-1), n = leading(streams, 2), m = (2 + h) * h;
  const Tensor gp = check_grad(d_post, leading_shape(streams, 2, {h}), dt, "d_post", op);
  const Tensor gc = check_grad(d_comb, leading_shape(streams, 2, {h, h}), dt, "d_comb", op);
  const Tensor gl = check_grad(d_collapsed, leading_shape(streams, 2, {d}), dt, "d_collapsed", op);
  const Tensor gr = check_grad(residual, streams.shape(), dt, "residual", op);
  // Without saved tensors the forward is rerun (it validates the parameters too).
  MhcPreSaved fresh;
  if (!saved) {
    mhc_pre(streams, fn, base, scale, options, &fresh);
    saved = &fresh;
  } else {
    for (const Tensor* p : {&fn, &base, &scale}) {
      check_float(*p, "parameter", op);
      GLMTUNE_ASSERT(p->dtype() == dt, "{}: parameter {} must have the dtype of streams {}", op,
                     p->str(), streams.str());
    }
    const bool ok = saved->rstd.defined() && saved->rstd.numel() == n && saved->mix.defined() &&
                    saved->mix.numel() == n * m && saved->pre.defined() &&
                    saved->pre.numel() == n * h && saved->comb_init.defined() &&
                    saved->comb_init.numel() == n * h * h && saved->rstd.dtype() == dt &&
                    saved->mix.dtype() == dt && saved->pre.dtype() == dt &&
                    saved->comb_init.dtype() == dt;
    GLMTUNE_ASSERT(ok, "{}: saved tensors do not belong to streams {} (run mhc_pre with `saved`)",
                   op, streams.str());
  }
  if (dt == DType::f32)
    return pre_backward_kernel<float>(streams, fn, base, scale, options, *saved, gp, gc, gl, gr,
                                      grads);
  return pre_backward_kernel<double>(streams, fn, base, scale, options, *saved, gp, gc, gl, gr,
                                     grads);
}

Tensor mhc_sinkhorn_backward(const Tensor& logits, int64_t iters, double eps, const Tensor& d_out) {
  const char* op = "mhc_sinkhorn_backward";
  check_float(logits, "logits", op);
  GLMTUNE_ASSERT(logits.dim() >= 2 && logits.size(-1) == logits.size(-2) && iters >= 1,
                 "{}: logits {} must be [..., H, H], iters {} >= 1", op, logits.str(), iters);
  const Tensor g = check_grad(d_out, logits.shape(), logits.dtype(), "d_out", op);
  GLMTUNE_ASSERT(g.defined(), "{}: d_out is undefined", op);
  const int64_t h = logits.size(-1), n = leading(logits, 2);
  Tensor lc = logits.contiguous();
  Tensor out = Tensor::empty(logits.shape(), logits.dtype());
  auto run = [&](auto* l, auto* gi, auto* o) {
    using T = std::remove_pointer_t<decltype(o)>;
    std::vector<T> states, start(size_t(h * h)), gt(size_t(h * h));
    for (int64_t t = 0; t < n; ++t) {
      sinkhorn_start<T>(l + t * h * h, h, T(eps), start.data());
      std::copy(gi + t * h * h, gi + (t + 1) * h * h, gt.begin());
      sinkhorn_backward_token<T>(start.data(), l + t * h * h, h, iters, T(eps), gt.data(),
                                 o + t * h * h, states);
    }
  };
  if (logits.dtype() == DType::f32)
    run(lc.data<float>(), g.data<float>(), out.data<float>());
  else
    run(lc.data<double>(), g.data<double>(), out.data<double>());
  return out;
}

MhcCollapseGrads mhc_collapse_backward(const Tensor& streams, const Tensor& pre,
                                       const Tensor& d_out) {
  const char* op = "mhc_collapse_backward";
  check_float(streams, "streams", op);
  check_float(pre, "pre", op);
  GLMTUNE_ASSERT(streams.dim() >= 2, "{}: streams {} must be [..., H, D]", op, streams.str());
  const int64_t h = streams.size(-2), d = streams.size(-1), n = leading(streams, 2);
  const DType dt = streams.dtype();
  GLMTUNE_ASSERT(pre.dtype() == dt && pre.shape() == leading_shape(streams, 2, {h}),
                 "{}: pre {} must be [..., H] for streams {}", op, pre.str(), streams.str());
  const Tensor g = check_grad(d_out, leading_shape(streams, 2, {d}), dt, "d_out", op);
  GLMTUNE_ASSERT(g.defined(), "{}: d_out is undefined", op);
  Tensor xs = streams.contiguous(), pc = pre.contiguous();
  MhcCollapseGrads r{Tensor::empty(streams.shape(), dt), Tensor::empty(pre.shape(), dt)};
  auto run = [&](auto* x, auto* p, auto* gi, auto* dxs, auto* dp) {
    using T = std::remove_pointer_t<decltype(dp)>;
#pragma omp parallel for schedule(static) if (n * h * d > 65536)
    for (int64_t t = 0; t < n; ++t)
      for (int64_t i = 0; i < h; ++i) {
        double dot = 0;
        for (int64_t k = 0; k < d; ++k) {
          dxs[(t * h + i) * d + k] = p[t * h + i] * gi[t * d + k];
          dot += double(gi[t * d + k]) * double(x[(t * h + i) * d + k]);
        }
        dp[t * h + i] = T(dot);
      }
  };
  if (dt == DType::f32)
    run(xs.data<float>(), pc.data<float>(), g.data<float>(), r.d_streams.data<float>(),
        r.d_pre.data<float>());
  else
    run(xs.data<double>(), pc.data<double>(), g.data<double>(), r.d_streams.data<double>(),
        r.d_pre.data<double>());
  return r;
}

MhcPostGrads mhc_post_backward(const Tensor& streams, const Tensor& y, const Tensor& post,
                               const Tensor& comb, const Tensor& d_out) {
  const char* op = "mhc_post_backward";
  check_post_args(streams, y, post, comb, op);
  GLMTUNE_ASSERT(
      d_out.defined() && d_out.shape() == streams.shape() && d_out.device() == streams.device(),
      "{}: d_out {} must have the shape and device of streams {}", op,
      d_out.defined() ? d_out.str() : "undefined", streams.str());
  GLMTUNE_DISPATCH_CUDA(streams, cuda_path::mhc_post_backward(streams, y, post, comb, d_out));
  check_float(streams, "streams", op);
  check_float(y, "y", op);
  check_float(post, "post", op);
  check_float(comb, "comb", op);
  const int64_t h = streams.size(-2), d = streams.size(-1), n = leading(streams, 2);
  const DType dt = streams.dtype();
  GLMTUNE_ASSERT(y.dtype() == dt && post.dtype() == dt && comb.dtype() == dt,
                 "{}: y {}, post {} and comb {} must have the dtype of streams {}", op, y.str(),
                 post.str(), comb.str(), streams.str());
  const Tensor g = check_grad(d_out, streams.shape(), dt, "d_out", op);
  GLMTUNE_ASSERT(g.defined(), "{}: d_out is undefined", op);
  Tensor xs = streams.contiguous(), yc = y.contiguous(), pc = post.contiguous(),
         cc = comb.contiguous();
  MhcPostGrads r{Tensor::empty(streams.shape(), dt), Tensor::empty(y.shape(), dt),
                 Tensor::empty(post.shape(), dt), Tensor::empty(comb.shape(), dt)};
  auto run = [&](auto* x, auto* yp, auto* p, auto* c, auto* gi, auto* dxs, auto* dy, auto* dp,
                 auto* dc) {
    using T = std::remove_pointer_t<decltype(dp)>;
#pragma omp parallel for schedule(static) if (n * h * d > 65536)
    for (int64_t t = 0; t < n; ++t) {
      const T* xt = x + t * h * d;
      const T* gt = gi + t * h * d;
      const T* ct = c + t * h * h;
      for (int64_t k = 0; k < d; ++k) {
        T acc = 0;
        for (int64_t i = 0; i < h; ++i) acc += p[t * h + i] * gt[i * d + k];
        dy[t * d + k] = acc;
      }
      for (int64_t i = 0; i < h; ++i) {
        double dot = 0;
        for (int64_t k = 0; k < d; ++k) dot += double(gt[i * d + k]) * double(yp[t * d + k]);
        dp[t * h + i] = T(dot);
      }
      // Source j, destination i: X'_i gets comb[j][i]·X_j.
      for (int64_t j = 0; j < h; ++j) {
        for (int64_t i = 0; i < h; ++i) {
          double dot = 0;
          for (int64_t k = 0; k < d; ++k) dot += double(gt[i * d + k]) * double(xt[j * d + k]);
          dc[t * h * h + j * h + i] = T(dot);
        }
        for (int64_t k = 0; k < d; ++k) {
          T acc = 0;
          for (int64_t i = 0; i < h; ++i) acc += ct[j * h + i] * gt[i * d + k];
          dxs[(t * h + j) * d + k] = acc;
        }
      }
    }
  };
  if (dt == DType::f32)
    run(xs.data<float>(), yc.data<float>(), pc.data<float>(), cc.data<float>(), g.data<float>(),
        r.d_streams.data<float>(), r.d_y.data<float>(), r.d_post.data<float>(),
        r.d_comb.data<float>());
  else
    run(xs.data<double>(), yc.data<double>(), pc.data<double>(), cc.data<double>(),
        g.data<double>(), r.d_streams.data<double>(), r.d_y.data<double>(), r.d_post.data<double>(),
        r.d_comb.data<double>());
  return r;
}

Tensor mhc_expand_backward(const Tensor& d_streams) {
  check_streams(d_streams, "d_streams", "mhc_expand_backward");
  GLMTUNE_DISPATCH_CUDA(d_streams, cuda_path::mhc_expand_backward(d_streams));
  return sum_streams(d_streams, /*mean=*/false, "d_streams", "mhc_expand_backward");
}

Tensor mhc_head_backward(const Tensor& d_out, int64_t hc_mult) {
  const char* op = "mhc_head_backward";
  GLMTUNE_ASSERT(d_out.defined() && d_out.dim() >= 1 && hc_mult >= 1, "{}: d_out {} and H {}", op,
                 d_out.defined() ? d_out.str() : "-", hc_mult);
  GLMTUNE_DISPATCH_CUDA(d_out, cuda_path::mhc_head_backward(d_out, hc_mult));
  check_float(d_out, "d_out", op);
  const int64_t d = d_out.size(-1), n = leading(d_out, 1);
  Tensor gc = d_out.contiguous();
  Tensor out = Tensor::empty(leading_shape(d_out, 1, {hc_mult, d}), d_out.dtype());
  auto run = [&](auto* g, auto* o) {
    using T = std::remove_pointer_t<decltype(o)>;
    // The forward divides the sum by H, so each stream's gradient is d out / H (same division).
    for (int64_t t = 0; t < n; ++t)
      for (int64_t i = 0; i < hc_mult; ++i)
        for (int64_t k = 0; k < d; ++k) o[(t * hc_mult + i) * d + k] = g[t * d + k] / T(hc_mult);
  };
  if (d_out.dtype() == DType::f32)
    run(gc.data<float>(), out.data<float>());
  else
    run(gc.data<double>(), out.data<double>());
  return out;
}

}  // namespace glmtune::ops

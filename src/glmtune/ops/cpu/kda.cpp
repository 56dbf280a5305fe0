#include "glmtune/ops/kda.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "glmtune/ops/checks.h"
#include "glmtune/ops/cpu/common.h"
#include "glmtune/ops/cpu/kda_common.h"
#include "glmtune/ops/dispatch.h"
#include "glmtune/ops/indexer.h"
#include "glmtune/ops/linear.h"
#include "glmtune/ops/norm.h"

namespace glmtune::ops {
using namespace cpu_detail;
namespace {

template <typename T>
void conv_kernel(const T* x, const T* w, const std::vector<int64_t>& cu, int64_t c, int64_t kc,
                 bool silu, T* y, T* pre) {
  const int64_t ndoc = int64_t(cu.size()) - 1;
  for (int64_t doc = 0; doc < ndoc; ++doc) {
    const int64_t start = cu[doc], end = cu[doc + 1];
#pragma omp parallel for schedule(static) if ((end - start) * c > 65536)
    for (int64_t t = start; t < end; ++t) {
      // Taps that would reach before the document start read the causal zero padding.
      const int64_t first_tap = std::max<int64_t>(0, (kc - 1) - (t - start));
      for (int64_t ch = 0; ch < c; ++ch) {
        T acc = 0;
        for (int64_t tau = first_tap; tau < kc; ++tau)
          acc += w[ch * kc + tau] * x[(t - (kc - 1) + tau) * c + ch];
        if (pre) pre[t * c + ch] = acc;
        y[t * c + ch] = silu ? acc * sigmoid(acc) : acc;
      }
    }
  }
}

template <typename T>
void gate_kernel(const T* graw, const T* dt_bias, const T* a_log, int64_t n, int64_t nl, int64_t hl,
                 std::optional<double> lb, T* g) {
  for_each_gate_entry(graw, dt_bias, a_log, n, nl, hl, /*parallel=*/true,
                      [&](int64_t i, int64_t, int64_t, T rate, T z) {
                        if (lb)
                          g[i] = T(*lb) * sigmoid(rate * z);
                        else
                          g[i] = -rate * softplus_thresholded(z);
                      });
}

// Strided per-(token, head) access into [T, NL, X] tensors.
template <typename T>
struct HeadView {
  const T* base;
  int64_t token_stride, width;
  const T* row(int64_t t) const { return base + t * token_stride; }
};

template <typename T>
void recurrent_head(const HeadView<T>& q, const HeadView<T>& k, const HeadView<T>& v,
                    const HeadView<T>& g, const T* beta, int64_t beta_stride, int64_t start,
                    int64_t end, T scale, T* o, int64_t o_stride, T* state) {
  const int64_t kd = k.width, vd = v.width;
  std::vector<T> s(size_t(kd * vd), T(0)), kv(static_cast<size_t>(vd)), qs(static_cast<size_t>(kd));
  for (int64_t t = start; t < end; ++t) {
    const T* qt = q.row(t);
    const T* kt = k.row(t);
    const T* vt = v.row(t);
    const T* gt = g.row(t);
    const T b = beta[t * beta_stride];
    for (int64_t a = 0; a < kd; ++a) {
      const T decay = std::exp(gt[a]);
      for (int64_t e = 0; e < vd; ++e) s[a * vd + e] *= decay;
    }
    // Delta rule: predict v from the decayed state, write back β times the error.
    for (int64_t e = 0; e < vd; ++e) kv[e] = T(0);
    for (int64_t a = 0; a < kd; ++a)
      for (int64_t e = 0; e < vd; ++e) kv[e] += s[a * vd + e] * kt[a];
    for (int64_t e = 0; e < vd; ++e) kv[e] = (vt[e] - kv[e]) * b;
    for (int64_t a = 0; a < kd; ++a)
      for (int64_t e = 0; e < vd; ++e) s[a * vd + e] += kt[a] * kv[e];
    for (int64_t a = 0; a < kd; ++a) qs[a] = qt[a] * scale;
    T* ot = o + t * o_stride;
    for (int64_t e = 0; e < vd; ++e) ot[e] = T(0);
    for (int64_t a = 0; a < kd; ++a)
      for (int64_t e = 0; e < vd; ++e) ot[e] += s[a * vd + e] * qs[a];
  }
  if (state) std::copy(s.begin(), s.end(), state);
}

// One (document, head) of the chunked form. Within a chunk of n ≤ C steps, with Γ the in-chunk
// cumulative log decay, the state after step i is
//   S_i = diag(e^{Γ_i}) S_0 + Σ_{j≤i} diag(e^{Γ_i − Γ_j}) k_j u_j^T
// and the pseudo-values u solve (I + L) u = β⊙V − (β⊙K⊙e^{Γ}) S_0 with L strictly lower
// triangular, L[i][j] = β_i Σ_a k_i[a] k_j[a] e^{Γ_i[a] − Γ_j[a]}. The reference inverts (I + L)
// by forward substitution on −L; this kernel does the same, in the same order. Zero padding to a
// multiple of C (as the reference pads) contributes exact zeros, so the last chunk simply stops
// at the document end.
template <typename T>
void chunked_head(const HeadView<T>& q, const HeadView<T>& k, const HeadView<T>& v,
                  const HeadView<T>& g, const T* beta, int64_t beta_stride, int64_t start,
                  int64_t end, T scale, int64_t cs, T* o, int64_t o_stride, T* state) {
  const int64_t kd = k.width, vd = v.width;
  std::vector<T> s(size_t(kd * vd), T(0));
  std::vector<T> qc(static_cast<size_t>(cs * kd)), kc(static_cast<size_t>(cs * kd)),
      gam(static_cast<size_t>(cs * kd)), kb(static_cast<size_t>(cs * kd)),
      vb(static_cast<size_t>(cs * vd)), kbe(static_cast<size_t>(cs * kd));
  std::vector<T> tri(static_cast<size_t>(cs * cs)), row(static_cast<size_t>(cs)),
      u(static_cast<size_t>(cs * vd)), w(static_cast<size_t>(cs * kd)),
      vnew(static_cast<size_t>(cs * vd)), ain(static_cast<size_t>(cs * cs)),
      kdec(static_cast<size_t>(kd)), qdec(static_cast<size_t>(kd));
  for (int64_t c0 = start; c0 < end; c0 += cs) {
    const int64_t n = std::min(cs, end - c0);
    // Gather the chunk; q scaled once as the reference does before chunking.
    for (int64_t i = 0; i < n; ++i) {
      const T* qt = q.row(c0 + i);
      const T* kt = k.row(c0 + i);
      const T* vt = v.row(c0 + i);
      const T* gt = g.row(c0 + i);
      const T b = beta[(c0 + i) * beta_stride];
      for (int64_t a = 0; a < kd; ++a) {
        qc[i * kd + a] = qt[a] * scale;
        kc[i * kd + a] = kt[a];
        kb[i * kd + a] = kt[a] * b;
        // In-chunk cumulative sum, sequential like torch.cumsum.
        gam[i * kd + a] = (i ? gam[(i - 1) * kd + a] : T(0)) + gt[a];
        kbe[i * kd + a] = kb[i * kd + a] * std::exp(gam[i * kd + a]);
      }
      for (int64_t e = 0; e < vd; ++e) vb[i * vd + e] = vt[e] * b;
    }
    // Both in-chunk score matrices share the decay exp(Γ_i − Γ_j) (j ≤ i, exponent ≤ 0, so it
    // cannot overflow; the entries above the diagonal are never formed, as the reference masks
    // them to −∞ before exp). tri = −L is strictly lower, ain keeps the diagonal.
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = 0; j < n; ++j) tri[i * cs + j] = T(0);
      for (int64_t j = 0; j <= i; ++j) {
        T l = 0, a_in = 0;
        for (int64_t a = 0; a < kd; ++a) {
          const T decay = std::exp(gam[i * kd + a] - gam[j * kd + a]);
          l += kb[i * kd + a] * kc[j * kd + a] * decay;
          a_in += qc[i * kd + a] * kc[j * kd + a] * decay;
        }
        if (j < i) tri[i * cs + j] = -l;
        ain[i * cs + j] = a_in;
      }
    }
    // Forward substitution row by row: row i uses its original values and the already-finished
    // rows above it.
    for (int64_t i = 1; i < n; ++i) {
      for (int64_t j = 0; j < i; ++j) row[j] = tri[i * cs + j];
      for (int64_t j = 0; j < i; ++j) {
        T acc = 0;
        // tri[m][j] is zero for m ≤ j, so only m in (j, i) contribute.
        for (int64_t m = j + 1; m < i; ++m) acc += row[m] * tri[m * cs + j];
        tri[i * cs + j] = row[j] + acc;
      }
    }
    for (int64_t i = 0; i < n; ++i) tri[i * cs + i] = T(1);
    // U = (I + L)^{-1} (β⊙V), W = (I + L)^{-1} (β⊙K⊙e^{Γ}).
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t e = 0; e < vd; ++e) u[i * vd + e] = T(0);
      for (int64_t a = 0; a < kd; ++a) w[i * kd + a] = T(0);
      for (int64_t j = 0; j <= i; ++j) {
        const T t_ij = tri[i * cs + j];
        for (int64_t e = 0; e < vd; ++e) u[i * vd + e] += t_ij * vb[j * vd + e];
        for (int64_t a = 0; a < kd; ++a) w[i * kd + a] += t_ij * kbe[j * kd + a];
      }
    }
    // Pseudo-values against the incoming state, and the inter-chunk part of the output.
    for (int64_t i = 0; i < n; ++i) {
      T* oi = o + (c0 + i) * o_stride;
      for (int64_t a = 0; a < kd; ++a) qdec[a] = qc[i * kd + a] * std::exp(gam[i * kd + a]);
      for (int64_t e = 0; e < vd; ++e) {
        T inter = 0, pred = 0;
        for (int64_t a = 0; a < kd; ++a) {
          inter += qdec[a] * s[a * vd + e];
          pred += w[i * kd + a] * s[a * vd + e];
        }
        oi[e] = inter;
        vnew[i * vd + e] = u[i * vd + e] - pred;
      }
    }
    // Intra-chunk attention (diagonal included) applied to the pseudo-values.
    for (int64_t i = 0; i < n; ++i) {
      T* oi = o + (c0 + i) * o_stride;
      for (int64_t e = 0; e < vd; ++e) {
        T acc = 0;
        for (int64_t j = 0; j <= i; ++j) acc += ain[i * cs + j] * vnew[j * vd + e];
        oi[e] += acc;
      }
    }
    // State carried to the next chunk: decayed by the whole chunk, plus each step's write decayed
    // from its own time to the chunk end.
    const T* glast = &gam[(n - 1) * kd];
    for (int64_t a = 0; a < kd; ++a) {
      const T total = std::exp(glast[a]);
      for (int64_t e = 0; e < vd; ++e) s[a * vd + e] *= total;
    }
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t a = 0; a < kd; ++a)
        kdec[a] = kc[i * kd + a] * std::exp(glast[a] - gam[i * kd + a]);
      for (int64_t a = 0; a < kd; ++a)
        for (int64_t e = 0; e < vd; ++e) s[a * vd + e] += kdec[a] * vnew[i * vd + e];
    }
  }
  if (state) std::copy(s.begin(), s.end(), state);
}

template <typename T>
Tensor run_core(bool chunked, const Tensor& q_in, const Tensor& k_in, const Tensor& v_in,
                const Tensor& g_in, const Tensor& beta_in, const std::vector<int64_t>& cu,
                const CoreShapes& sh, T scale, int64_t chunk_size, Tensor* final_state) {
  Tensor q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous(), g = g_in.contiguous(),
         beta = beta_in.contiguous();
  const int64_t nh = sh.heads, kd = sh.kd, vd = sh.vd;
  const int64_t ndoc = int64_t(cu.size()) - 1;
  Tensor out = Tensor::zeros({sh.tokens, nh, vd}, q.dtype());
  Tensor st;
  if (final_state) {
    st = Tensor::zeros({ndoc, nh, kd, vd}, q.dtype());
    *final_state = st;
  }
  T* op = out.data<T>();
  T* sp = st.defined() ? st.data<T>() : nullptr;
  const T* bp = beta.data<T>();
  // Documents and heads are independent; each (doc, head) pair runs serially in time.
#pragma omp parallel for schedule(dynamic)
  for (int64_t job = 0; job < ndoc * nh; ++job) {
    const int64_t doc = job / nh, h = job % nh;
    HeadView<T> qv{q.data<T>() + h * kd, nh * kd, kd};
    HeadView<T> kv{k.data<T>() + h * kd, nh * kd, kd};
    HeadView<T> vv{v.data<T>() + h * vd, nh * vd, vd};
    HeadView<T> gv{g.data<T>() + h * kd, nh * kd, kd};
    T* state = sp ? sp + (doc * nh + h) * kd * vd : nullptr;
    if (chunked)
      chunked_head<T>(qv, kv, vv, gv, bp + h, nh, cu[doc], cu[doc + 1], scale, chunk_size,
                      op + h * vd, nh * vd, state);
    else
      recurrent_head<T>(qv, kv, vv, gv, bp + h, nh, cu[doc], cu[doc + 1], scale, op + h * vd,
                        nh * vd, state);
  }
  return out;
}

Tensor core_dispatch(bool chunked, const Tensor& q, const Tensor& k, const Tensor& v,
                     const Tensor& g, const Tensor& beta, const Tensor& cu_seqlens, double scale,
                     int64_t chunk_size, Tensor* final_state, const char* op) {
  CoreShapes sh = check_core(q, k, v, g, beta, op);
  std::vector<int64_t> cu = read_cu_seqlens(cu_seqlens, sh.tokens, op);
  if (q.dtype() == DType::f32)
    return run_core<float>(chunked, q, k, v, g, beta, cu, sh, float(scale), chunk_size,
                           final_state);
  return run_core<double>(chunked, q, k, v, g, beta, cu, sh, scale, chunk_size, final_state);
}

Tensor sigmoid_tensor(const Tensor& x) {
  Tensor y = Tensor::empty(x.shape(), x.dtype());
  Tensor xc = x.contiguous();
  const int64_t n = x.numel();
  if (x.dtype() == DType::f32) {
    const float* a = xc.data<float>();
    float* b = y.data<float>();
    for (int64_t i = 0; i < n; ++i) b[i] = sigmoid(a[i]);
  } else {
    const double* a = xc.data<double>();
    double* b = y.data<double>();
    for (int64_t i = 0; i < n; ++i) b[i] = sigmoid(a[i]);
  }
  return y;
}

}  // namespace

Tensor causal_conv1d(const Tensor& x, const Tensor& weight, const Tensor& cu_seqlens, bool silu,
                     Tensor* pre_activation) {
  const char* op = "causal_conv1d";
  const int64_t kc = check_conv_args(x, weight, op);
  GLMTUNE_DISPATCH_CUDA(x, cuda_path::causal_conv1d(x, weight, cu_seqlens, silu, pre_activation));
  check_float(x, "x", op);
  check_float(weight, "weight", op);
  GLMTUNE_ASSERT(weight.dtype() == x.dtype(), "{}: weight {} must have the dtype of x {}", op,
                 weight.str(), x.str());
  const int64_t c = x.size(1);
  std::vector<int64_t> cu = read_cu_seqlens(cu_seqlens, x.size(0), op);
  Tensor xc = x.contiguous(), wc = weight.contiguous();
  Tensor y = Tensor::empty(x.shape(), x.dtype());
  Tensor pre;
  if (pre_activation) {
    pre = Tensor::empty(x.shape(), x.dtype());
    *pre_activation = pre;
  }
  if (x.dtype() == DType::f32)
    conv_kernel<float>(xc.data<float>(), wc.data<float>(), cu, c, kc, silu, y.data<float>(),
                       pre.defined() ? pre.data<float>() : nullptr);
  else
    conv_kernel<double>(xc.data<double>(), wc.data<double>(), cu, c, kc, silu, y.data<double>(),
                        pre.defined() ? pre.data<double>() : nullptr);
  return y;
}

Tensor kda_qk_conv(const Tensor& x, const Tensor& weight, const Tensor& cu_seqlens,
                   int64_t head_dim, double eps, Tensor* norm) {
  const char* op = "kda_qk_conv";
  const int64_t heads = qk_conv_heads(x, head_dim, op);
  check_conv_args(x, weight, op);
  GLMTUNE_DISPATCH_CUDA(x, cuda_path::kda_qk_conv(x, weight, cu_seqlens, head_dim, eps, norm));
  const Tensor c = causal_conv1d(x, weight, cu_seqlens, true);
  return l2_norm(c.view({x.size(0), heads, head_dim}), eps, norm);
}

Tensor kda_gate(const Tensor& graw, const Tensor& dt_bias, const Tensor& A_log,
                std::optional<double> lower_bound) {
  const char* op = "kda_gate";
  check_gate_args(graw, dt_bias, A_log, op);
  GLMTUNE_DISPATCH_CUDA(graw, cuda_path::kda_gate(graw, dt_bias, A_log, lower_bound));
  check_float(graw, "graw", op);
  check_float(dt_bias, "dt_bias", op);
  check_float(A_log, "A_log", op);
  GLMTUNE_ASSERT(dt_bias.dtype() == graw.dtype() && A_log.dtype() == graw.dtype(),
                 "{}: dt_bias {} and A_log {} must have the dtype of graw {}", op, dt_bias.str(),
                 A_log.str(), graw.str());
  const int64_t n = graw.size(0), nl = A_log.size(0), hl = graw.size(1) / nl;
  Tensor gc = graw.contiguous(), dc = dt_bias.contiguous(), ac = A_log.contiguous();
  Tensor g = Tensor::empty({n, nl, hl}, graw.dtype());
  if (graw.dtype() == DType::f32)
    gate_kernel<float>(gc.data<float>(), dc.data<float>(), ac.data<float>(), n, nl, hl, lower_bound,
                       g.data<float>());
  else
    gate_kernel<double>(gc.data<double>(), dc.data<double>(), ac.data<double>(), n, nl, hl,
                        lower_bound, g.data<double>());
  return g;
}

Tensor kda_chunked(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                   const Tensor& beta, const Tensor& cu_seqlens, double scale, int64_t chunk_size,
                   Tensor* final_state) {
  check_core_args(q, k, v, g, beta, chunk_size, "kda_chunked");
  GLMTUNE_DISPATCH_CUDA(
      q, cuda_path::kda_chunked(q, k, v, g, beta, cu_seqlens, scale, chunk_size, final_state));
  return core_dispatch(true, q, k, v, g, beta, cu_seqlens, scale, chunk_size, final_state,
                       "kda_chunked");
}

Tensor kda_recurrent(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                     const Tensor& beta, const Tensor& cu_seqlens, double scale,
                     Tensor* final_state) {
  GLMTUNE_CPU_ONLY("kda_recurrent", q);
  check_core_args(q, k, v, g, beta, 1, "kda_recurrent");
  return core_dispatch(false, q, k, v, g, beta, cu_seqlens, scale, 1, final_state, "kda_recurrent");
}

Tensor kda_beta(const Tensor& logits) {
  GLMTUNE_ASSERT(logits.defined(), "kda_beta: no logits");
  GLMTUNE_DISPATCH_CUDA(logits, cuda_path::kda_beta(logits));
  check_float(logits, "logits", "kda_beta");
  return sigmoid_tensor(logits);
}

}  // namespace glmtune::ops

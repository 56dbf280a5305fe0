// Backward passes of the KDA mixer (ops/kda.h): the depthwise conv + SiLU, the forget gate, the
// chunked delta rule and the whole mixer. The derivation is in docs/model/backward_kda_mhc.md;
// the comments here name the forward line each block differentiates.

#include <algorithm>
#include <cmath>
#include <vector>

#include "glmtune/ops/checks.h"
#include "glmtune/ops/cpu/common.h"
#include "glmtune/ops/cpu/kda_common.h"
#include "glmtune/ops/dispatch.h"
#include "glmtune/ops/indexer.h"
#include "glmtune/ops/kda.h"
#include "glmtune/ops/linear.h"
#include "glmtune/ops/norm.h"

namespace glmtune::ops {
using namespace cpu_detail;
namespace {

// ---- conv + SiLU ------------------------------------------------------------------------------

template <typename T>
void conv_backward_kernel(const T* x, const T* w, const std::vector<int64_t>& cu, int64_t c,
                          int64_t kc, bool silu, const T* pre, const T* dy, T* dx, T* dw) {
  const int64_t ndoc = int64_t(cu.size()) - 1;
  // One channel per iteration: channels are independent (depthwise), and each channel's weight
  // gradient sums all its tokens, every document in order, in double and is rounded once: an f32
  // running sum over thousands of tokens would lose ~sqrt(T) ulps, more than the reference's
  // float32 reduction does. One thread owns a channel, so the order never depends on threads.
#pragma omp parallel if (cu.back() * c > 65536)
  {
    std::vector<T> dp;
    std::vector<double> acc_w(static_cast<size_t>(kc));
#pragma omp for schedule(static)
    for (int64_t ch = 0; ch < c; ++ch) {
      std::fill(acc_w.begin(), acc_w.end(), 0.0);
      for (int64_t doc = 0; doc < ndoc; ++doc) {
        const int64_t start = cu[doc], end = cu[doc + 1];
        // d pre-activation of this channel over the document: SiLU' = σ(1 + p(1 − σ)).
        dp.assign(size_t(end - start), T(0));
        for (int64_t t = start; t < end; ++t) {
          const T g = dy[t * c + ch];
          if (silu) {
            const T p = pre[t * c + ch], s = sigmoid(p);
            dp[size_t(t - start)] = g * s * (T(1) + p * (T(1) - s));
          } else {
            dp[size_t(t - start)] = g;
          }
        }
        // y[t] = Σ_τ w[τ] x[t − (Kc−1) + τ]: x[t'] feeds y[t' + (Kc−1) − τ] for the taps that stay
        // inside the document; taps before its start read the zero padding (no gradient).
        for (int64_t t = start; t < end; ++t) {
          T acc = 0;
          for (int64_t tau = 0; tau < kc; ++tau) {
            const int64_t out_t = t + (kc - 1) - tau;
            if (out_t < end) acc += w[ch * kc + tau] * dp[size_t(out_t - start)];
          }
          dx[t * c + ch] = acc;
        }
        if (dw)
          for (int64_t tau = 0; tau < kc; ++tau)
            for (int64_t t = start; t < end; ++t) {
              const int64_t src = t - (kc - 1) + tau;
              if (src >= start)
                acc_w[size_t(tau)] += double(dp[size_t(t - start)] * x[src * c + ch]);
            }
      }
      if (dw)
        for (int64_t tau = 0; tau < kc; ++tau) dw[ch * kc + tau] += T(acc_w[size_t(tau)]);
    }
  }
}

// ---- forget gate ------------------------------------------------------------------------------

template <typename T>
void gate_backward_kernel(const T* graw, const T* dt_bias, const T* a_log, int64_t n, int64_t nl,
                          int64_t hl, std::optional<double> lb, const T* dg, T* dz, T* ddt,
                          T* dalog) {
  const int64_t ql = nl * hl;
  // dz per element (parallel over tokens), then the parameter sums in token order.
  for_each_gate_entry(graw, dt_bias, a_log, n, nl, hl, /*parallel=*/true,
                      [&](int64_t i, int64_t, int64_t, T rate, T z) {
                        if (lb) {
                          // g = LB·σ(rate·z): dg/dz = LB·σ(1−σ)·rate.
                          const T s = sigmoid(rate * z);
                          dz[i] = dg[i] * T(*lb) * s * (T(1) - s) * rate;
                        } else {
                          // g = −rate·softplus(z); the forward's branch z > 20 is the identity
                          // (slope 1), else d/dz log(1 + e^z) = σ(z).
                          dz[i] = -rate * dg[i] * (z > T(20) ? T(1) : sigmoid(z));
                        }
                      });
  std::vector<double> acc_dt(size_t(ql), 0.0), acc_a(size_t(nl), 0.0);
  for_each_gate_entry(graw, dt_bias, a_log, n, nl, hl, /*parallel=*/false,
                      [&](int64_t i, int64_t h, int64_t ch, T rate, T z) {
                        acc_dt[size_t(ch)] += double(dz[i]);
                        if (lb) {
                          // rate = e^{A_log}, so d rate / d A_log = rate and
                          // d/dA_log LB·σ(rate·z) = LB·σ(1−σ)·rate·z = (dg/dz)·z: the sum of dz·z.
                          acc_a[size_t(h)] += double(dz[i] * z);
                        } else {
                          // d/dA_log of −rate·softplus(z) is the value itself.
                          acc_a[size_t(h)] += double(dg[i] * (-rate * softplus_thresholded(z)));
                        }
                      });
  if (ddt)
    for (int64_t ch = 0; ch < ql; ++ch) ddt[ch] += T(acc_dt[size_t(ch)]);
  if (dalog)
    for (int64_t h = 0; h < nl; ++h) dalog[h] += T(acc_a[size_t(h)]);
}

// ---- chunked delta rule -----------------------------------------------------------------------

// Strided per-(token, head) rows of a [T, NL, X] tensor.
template <typename T>
struct Rows {
  T* base;
  int64_t stride;
  T* row(int64_t t) const { return base + t * stride; }
};

// Everything the forward computes inside one chunk of n ≤ C steps, given the entry state S0.
// Notation (docs/model/backward_kda_mhc.md): qc = scale·q, Γ the in-chunk cumulative log decay,
// kb = β⊙k, kbe = kb⊙e^Γ, vb = β⊙v, L[i][j] = Σ_a kb_i k_j e^{Γ_i−Γ_j} (j < i, stored as −L in
// `tri` before the substitution), A[i][j] = Σ_a qc_i k_j e^{Γ_i−Γ_j} (j ≤ i),
// Tm = (I + L)^{-1} (in `tri` after it), U = Tm vb, W = Tm kbe, Vn = U − W S0.
template <typename T>
struct ChunkWork {
  int64_t n = 0, kd = 0, vd = 0, cs = 0;
  std::vector<T> qc, kc, gam, kb, kbe, vb, beta, tri, ain, u, w, vnew;
  void resize(int64_t chunk, int64_t k, int64_t v) {
    cs = chunk;
    kd = k;
    vd = v;
    for (auto* b : {&qc, &kc, &gam, &kb, &kbe, &w}) b->assign(size_t(cs * kd), T(0));
    for (auto* b : {&vb, &u, &vnew}) b->assign(size_t(cs * vd), T(0));
    beta.assign(size_t(cs), T(0));
    tri.assign(size_t(cs * cs), T(0));
    ain.assign(size_t(cs * cs), T(0));
  }
};

template <typename T>
struct CoreHead {
  Rows<const T> q, k, v, g;
  const T* beta;
  int64_t beta_stride;
  T scale;
};

// Forward of chunk [c0, c0 + n) from state s0; with `s1` also the state leaving it. Written in the
// same order as chunked_head in kda.cpp.
template <typename T>
void chunk_forward(const CoreHead<T>& in, int64_t c0, int64_t n, const T* s0, ChunkWork<T>& wk,
                   T* s1) {
  const int64_t kd = wk.kd, vd = wk.vd, cs = wk.cs;
  wk.n = n;
  for (int64_t i = 0; i < n; ++i) {
    const T* qt = in.q.row(c0 + i);
    const T* kt = in.k.row(c0 + i);
    const T* vt = in.v.row(c0 + i);
    const T* gt = in.g.row(c0 + i);
    const T b = in.beta[(c0 + i) * in.beta_stride];
    wk.beta[size_t(i)] = b;
    for (int64_t a = 0; a < kd; ++a) {
      const size_t ia = size_t(i * kd + a);
      wk.qc[ia] = qt[a] * in.scale;
      wk.kc[ia] = kt[a];
      wk.kb[ia] = kt[a] * b;
      wk.gam[ia] = (i ? wk.gam[size_t((i - 1) * kd + a)] : T(0)) + gt[a];
      wk.kbe[ia] = wk.kb[ia] * std::exp(wk.gam[ia]);
    }
    for (int64_t e = 0; e < vd; ++e) wk.vb[size_t(i * vd + e)] = vt[e] * b;
  }
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < cs; ++j) {
      wk.tri[size_t(i * cs + j)] = T(0);
      wk.ain[size_t(i * cs + j)] = T(0);
    }
    for (int64_t j = 0; j <= i; ++j) {
      T l = 0, a_in = 0;
      for (int64_t a = 0; a < kd; ++a) {
        const T decay = std::exp(wk.gam[size_t(i * kd + a)] - wk.gam[size_t(j * kd + a)]);
        l += wk.kb[size_t(i * kd + a)] * wk.kc[size_t(j * kd + a)] * decay;
        a_in += wk.qc[size_t(i * kd + a)] * wk.kc[size_t(j * kd + a)] * decay;
      }
      if (j < i) wk.tri[size_t(i * cs + j)] = -l;
      wk.ain[size_t(i * cs + j)] = a_in;
    }
  }
  std::vector<T> row(static_cast<size_t>(cs));
  for (int64_t i = 1; i < n; ++i) {
    for (int64_t j = 0; j < i; ++j) row[size_t(j)] = wk.tri[size_t(i * cs + j)];
    for (int64_t j = 0; j < i; ++j) {
      T acc = 0;
      for (int64_t m = j + 1; m < i; ++m) acc += row[size_t(m)] * wk.tri[size_t(m * cs + j)];
      wk.tri[size_t(i * cs + j)] = row[size_t(j)] + acc;
    }
  }
  for (int64_t i = 0; i < n; ++i) wk.tri[size_t(i * cs + i)] = T(1);
  for (int64_t i = 0; i < n; ++i) {
    T* ui = &wk.u[size_t(i * vd)];
    T* wi = &wk.w[size_t(i * kd)];
    std::fill(ui, ui + vd, T(0));
    std::fill(wi, wi + kd, T(0));
    for (int64_t j = 0; j <= i; ++j) {
      const T t_ij = wk.tri[size_t(i * cs + j)];
      for (int64_t e = 0; e < vd; ++e) ui[e] += t_ij * wk.vb[size_t(j * vd + e)];
      for (int64_t a = 0; a < kd; ++a) wi[a] += t_ij * wk.kbe[size_t(j * kd + a)];
    }
    for (int64_t e = 0; e < vd; ++e) {
      T pred = 0;
      for (int64_t a = 0; a < kd; ++a) pred += wi[a] * s0[a * vd + e];
      wk.vnew[size_t(i * vd + e)] = ui[e] - pred;
    }
  }
  if (!s1) return;
  const T* glast = &wk.gam[size_t((n - 1) * kd)];
  for (int64_t a = 0; a < kd; ++a) {
    const T total = std::exp(glast[a]);
    for (int64_t e = 0; e < vd; ++e) s1[a * vd + e] = s0[a * vd + e] * total;
  }
  for (int64_t i = 0; i < n; ++i)
    for (int64_t a = 0; a < kd; ++a) {
      const T kdec = wk.kc[size_t(i * kd + a)] * std::exp(glast[a] - wk.gam[size_t(i * kd + a)]);
      for (int64_t e = 0; e < vd; ++e) s1[a * vd + e] += kdec * wk.vnew[size_t(i * vd + e)];
    }
}

// Scratch of one chunk's backward.
template <typename T>
struct ChunkGrads {
  std::vector<T> dqc, dk, dgam, dkb, dkbe, dw, dvn, dvb, dS0, dA, dL, dglast;
  void resize(int64_t cs, int64_t kd, int64_t vd) {
    for (auto* b : {&dqc, &dk, &dgam, &dkb, &dkbe, &dw}) b->assign(size_t(cs * kd), T(0));
    for (auto* b : {&dvn, &dvb}) b->assign(size_t(cs * vd), T(0));
    dS0.assign(size_t(kd * vd), T(0));
    dA.assign(size_t(cs * cs), T(0));
    dL.assign(size_t(cs * cs), T(0));
    dglast.assign(size_t(kd), T(0));
  }
};

// Differentiates one chunk. `ds` holds d S1 (the gradient of the state leaving the chunk) on entry
// and d S0 on exit; d o rows come from `dout`; results go to the chunk's rows of the outputs.
template <typename T>
void chunk_backward(const CoreHead<T>& in, int64_t c0, const T* s0, const ChunkWork<T>& wk,
                    Rows<const T> dout, T* ds, ChunkGrads<T>& gr, Rows<T> dq, Rows<T> dk,
                    Rows<T> dv, Rows<T> dg, T* dbeta, int64_t dbeta_stride) {
  const int64_t n = wk.n, kd = wk.kd, vd = wk.vd, cs = wk.cs;
  for (auto* b : {&gr.dqc, &gr.dk, &gr.dgam, &gr.dkb, &gr.dkbe, &gr.dw, &gr.dvn, &gr.dvb})
    std::fill(b->begin(), b->end(), T(0));
  auto at = [](const std::vector<T>& b, int64_t i, int64_t w, int64_t a) {
    return b[size_t(i * w + a)];
  };
  auto ref = [](std::vector<T>& b, int64_t i, int64_t w, int64_t a) -> T& {
    return b[size_t(i * w + a)];
  };
  const T* glast = &wk.gam[size_t((n - 1) * kd)];

  // (1) S1 = diag(e^{Γ_last}) S0 + Σ_i kd_i Vn_i^T with kd_i = k_i ⊙ e^{Γ_last − Γ_i}.
  T* dgl = gr.dglast.data();  // d Γ_last, added to the last row's dΓ at the end
  for (int64_t a = 0; a < kd; ++a) {
    const T eg = std::exp(glast[a]);
    T acc = 0;
    for (int64_t e = 0; e < vd; ++e) {
      gr.dS0[size_t(a * vd + e)] = eg * ds[a * vd + e];
      acc += ds[a * vd + e] * s0[a * vd + e];
    }
    dgl[a] = eg * acc;
  }
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t a = 0; a < kd; ++a) {
      const T dec = std::exp(glast[a] - at(wk.gam, i, kd, a));
      const T kdv = at(wk.kc, i, kd, a) * dec;
      T dkd = 0;
      for (int64_t e = 0; e < vd; ++e) {
        ref(gr.dvn, i, vd, e) += kdv * ds[a * vd + e];
        dkd += ds[a * vd + e] * at(wk.vnew, i, vd, e);
      }
      ref(gr.dk, i, kd, a) += dkd * dec;
      ref(gr.dgam, i, kd, a) -= dkd * kdv;
      dgl[a] += dkd * kdv;
    }
  }
  for (int64_t a = 0; a < kd; ++a) ref(gr.dgam, n - 1, kd, a) += dgl[a];

  // (2) O = (Qc ⊙ e^Γ) S0 + A Vn.
  for (int64_t i = 0; i < n; ++i) {
    const T* doi = dout.row(c0 + i);
    for (int64_t a = 0; a < kd; ++a) {
      const T eg = std::exp(at(wk.gam, i, kd, a)), qd = at(wk.qc, i, kd, a) * eg;
      T dqd = 0;
      for (int64_t e = 0; e < vd; ++e) {
        dqd += doi[e] * s0[a * vd + e];
        gr.dS0[size_t(a * vd + e)] += qd * doi[e];
      }
      ref(gr.dqc, i, kd, a) += dqd * eg;
      ref(gr.dgam, i, kd, a) += dqd * qd;
    }
    for (int64_t j = 0; j <= i; ++j) {
      T acc = 0;
      const T aij = wk.ain[size_t(i * cs + j)];
      for (int64_t e = 0; e < vd; ++e) {
        acc += doi[e] * at(wk.vnew, j, vd, e);
        ref(gr.dvn, j, vd, e) += aij * doi[e];
      }
      gr.dA[size_t(i * cs + j)] = acc;
    }
  }

  // (3) Vn = U − W S0: dU = dVn, dW = −dVn S0^T, dS0 −= W^T dVn.
  for (int64_t i = 0; i < n; ++i)
    for (int64_t a = 0; a < kd; ++a) {
      T acc = 0;
      const T wia = at(wk.w, i, kd, a);
      for (int64_t e = 0; e < vd; ++e) {
        acc += at(gr.dvn, i, vd, e) * s0[a * vd + e];
        gr.dS0[size_t(a * vd + e)] -= wia * at(gr.dvn, i, vd, e);
      }
      ref(gr.dw, i, kd, a) = -acc;
    }

  // (4) U = Tm vb, W = Tm kbe: dvb = Tm^T dU, dkbe = Tm^T dW; and, with Tm = (I + L)^{-1},
  // dL = −Tm^T (dU vb^T + dW kbe^T) Tm^T = −dvb U^T − dkbe W^T (strictly lower part).
  for (int64_t j = 0; j < n; ++j)
    for (int64_t i = j; i < n; ++i) {
      const T t_ij = wk.tri[size_t(i * cs + j)];
      for (int64_t e = 0; e < vd; ++e) ref(gr.dvb, j, vd, e) += t_ij * at(gr.dvn, i, vd, e);
      for (int64_t a = 0; a < kd; ++a) ref(gr.dkbe, j, kd, a) += t_ij * at(gr.dw, i, kd, a);
    }
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < i; ++j) {
      T acc = 0;
      for (int64_t e = 0; e < vd; ++e) acc += at(gr.dvb, i, vd, e) * at(wk.u, j, vd, e);
      for (int64_t a = 0; a < kd; ++a) acc += at(gr.dkbe, i, kd, a) * at(wk.w, j, kd, a);
      gr.dL[size_t(i * cs + j)] = -acc;
    }

  // (5) L and A to kb, qc, k and Γ through the shared decay e^{Γ_i − Γ_j}.
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j <= i; ++j) {
      const T dl = j < i ? gr.dL[size_t(i * cs + j)] : T(0), da = gr.dA[size_t(i * cs + j)];
      for (int64_t a = 0; a < kd; ++a) {
        const T decay = std::exp(at(wk.gam, i, kd, a) - at(wk.gam, j, kd, a));
        const T kj = at(wk.kc, j, kd, a), kbi = at(wk.kb, i, kd, a), qi = at(wk.qc, i, kd, a);
        const T tl = dl * decay, ta = da * decay;
        ref(gr.dkb, i, kd, a) += tl * kj;
        ref(gr.dqc, i, kd, a) += ta * kj;
        ref(gr.dk, j, kd, a) += tl * kbi + ta * qi;
        const T e = (tl * kbi + ta * qi) * kj;
        ref(gr.dgam, i, kd, a) += e;
        ref(gr.dgam, j, kd, a) -= e;
      }
    }

  // (6) Back to the inputs: kbe = kb ⊙ e^Γ, kb = β k, vb = β v, qc = scale·q, Γ = cumsum(g).
  for (int64_t i = 0; i < n; ++i) {
    const T b = wk.beta[size_t(i)];
    const T* vt = in.v.row(c0 + i);
    double db = 0;
    for (int64_t a = 0; a < kd; ++a) {
      const T eg = std::exp(at(wk.gam, i, kd, a));
      ref(gr.dkb, i, kd, a) += at(gr.dkbe, i, kd, a) * eg;
      ref(gr.dgam, i, kd, a) += at(gr.dkbe, i, kd, a) * at(wk.kbe, i, kd, a);
      ref(gr.dk, i, kd, a) += at(gr.dkb, i, kd, a) * b;
      db += double(at(gr.dkb, i, kd, a)) * double(at(wk.kc, i, kd, a));
    }
    T* dvi = dv.row(c0 + i);
    for (int64_t e = 0; e < vd; ++e) {
      dvi[e] = at(gr.dvb, i, vd, e) * b;
      db += double(at(gr.dvb, i, vd, e)) * double(vt[e]);
    }
    dbeta[(c0 + i) * dbeta_stride] = T(db);
    T* dqi = dq.row(c0 + i);
    T* dki = dk.row(c0 + i);
    for (int64_t a = 0; a < kd; ++a) {
      dqi[a] = at(gr.dqc, i, kd, a) * in.scale;
      dki[a] = at(gr.dk, i, kd, a);
    }
  }
  // dg_i = Σ_{i' ≥ i} dΓ_{i'} (reverse cumulative sum within the chunk).
  for (int64_t a = 0; a < kd; ++a) {
    T acc = 0;
    for (int64_t i = n - 1; i >= 0; --i) {
      acc += at(gr.dgam, i, kd, a);
      dg.row(c0 + i)[a] = acc;
    }
  }
  std::copy(gr.dS0.begin(), gr.dS0.end(), ds);
}

template <typename T>
KdaCoreGrads core_backward_impl(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in,
                                const Tensor& g_in, const Tensor& beta_in, const Tensor& dout_in,
                                const std::vector<int64_t>& cu, T scale, int64_t cs) {
  Tensor q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous(), g = g_in.contiguous(),
         beta = beta_in.contiguous(), dout = dout_in.contiguous();
  const int64_t t = q.size(0), nh = q.size(1), kd = q.size(2), vd = v.size(2);
  const int64_t ndoc = int64_t(cu.size()) - 1;
  KdaCoreGrads r{Tensor::zeros(q.shape(), q.dtype()), Tensor::zeros(k.shape(), q.dtype()),
                 Tensor::zeros(v.shape(), q.dtype()), Tensor::zeros(g.shape(), q.dtype()),
                 Tensor::zeros({t, nh}, q.dtype())};
  // Documents and heads are independent; each job writes only its own rows of one head.
#pragma omp parallel
  {
    ChunkWork<T> wk;
    ChunkGrads<T> gr;
    wk.resize(cs, kd, vd);
    gr.resize(cs, kd, vd);
    std::vector<T> states, ds(size_t(kd * vd));
#pragma omp for schedule(dynamic)
    for (int64_t job = 0; job < ndoc * nh; ++job) {
      const int64_t doc = job / nh, h = job % nh;
      const int64_t start = cu[doc], end = cu[doc + 1];
      if (end == start) continue;
      CoreHead<T> in{{q.data<T>() + h * kd, nh * kd},
                     {k.data<T>() + h * kd, nh * kd},
                     {v.data<T>() + h * vd, nh * vd},
                     {g.data<T>() + h * kd, nh * kd},
                     beta.data<T>() + h,
                     nh,
                     scale};
      const int64_t nchunks = (end - start + cs - 1) / cs;
      // Replay: the state entering each chunk (the only thing carried between chunks).
      states.assign(size_t(nchunks * kd * vd), T(0));
      for (int64_t c = 0; c + 1 < nchunks; ++c) {
        const int64_t c0 = start + c * cs;
        chunk_forward<T>(in, c0, std::min(cs, end - c0), &states[size_t(c * kd * vd)], wk,
                         &states[size_t((c + 1) * kd * vd)]);
      }
      // Reverse sweep; nothing reads the state after the document's last token, so d S starts
      // at 0.
      std::fill(ds.begin(), ds.end(), T(0));
      for (int64_t c = nchunks - 1; c >= 0; --c) {
        const int64_t c0 = start + c * cs;
        const T* s0 = &states[size_t(c * kd * vd)];
        chunk_forward<T>(in, c0, std::min(cs, end - c0), s0, wk, nullptr);
        chunk_backward<T>(in, c0, s0, wk, {dout.data<T>() + h * vd, nh * vd}, ds.data(), gr,
                          {r.dq.data<T>() + h * kd, nh * kd}, {r.dk.data<T>() + h * kd, nh * kd},
                          {r.dv.data<T>() + h * vd, nh * vd}, {r.dg.data<T>() + h * kd, nh * kd},
                          r.dbeta.data<T>() + h, nh);
      }
    }
  }
  return r;
}

}  // namespace

Tensor causal_conv1d_backward(const Tensor& x, const Tensor& weight, const Tensor& cu_seqlens,
                              bool silu, const Tensor& dy, Tensor* grad_weight,
                              const Tensor& pre_activation) {
  const char* op = "causal_conv1d_backward";
  const int64_t kc = check_conv_args(x, weight, op);
  checks::same_shape(dy, x, "dy", "x", op);
  GLMTUNE_DISPATCH_CUDA(x, cuda_path::causal_conv1d_backward(x, weight, cu_seqlens, silu, dy,
                                                             grad_weight, pre_activation));
  check_float(x, "x", op);
  check_float(weight, "weight", op);
  check_float(dy, "dy", op);
  GLMTUNE_ASSERT(dy.dtype() == x.dtype() && weight.dtype() == x.dtype(),
                 "{}: x {} and dy {} must be of one dtype with weight {}", op, x.str(), dy.str(),
                 weight.str());
  const int64_t c = x.size(1);
  std::vector<int64_t> cu = read_cu_seqlens(cu_seqlens, x.size(0), op);
  Tensor pre;
  if (silu) {
    if (pre_activation.defined()) {
      GLMTUNE_ASSERT(pre_activation.shape() == x.shape() && pre_activation.dtype() == x.dtype(),
                     "{}: pre_activation {} must match x {}", op, pre_activation.str(), x.str());
      pre = pre_activation.contiguous();
    } else {
      causal_conv1d(x, weight, cu_seqlens, true, &pre);
    }
  }
  Tensor xc = x.contiguous(), wc = weight.contiguous(), gc = dy.contiguous();
  Tensor dx = Tensor::empty(x.shape(), x.dtype());
  Tensor* gw = nullptr;
  if (grad_if_trained(grad_weight, weight)) gw = &grad_buffer(*grad_weight, weight, op, "weight");
  if (x.dtype() == DType::f32)
    conv_backward_kernel<float>(xc.data<float>(), wc.data<float>(), cu, c, kc, silu,
                                silu ? pre.data<float>() : nullptr, gc.data<float>(),
                                dx.data<float>(), gw ? gw->data<float>() : nullptr);
  else
    conv_backward_kernel<double>(xc.data<double>(), wc.data<double>(), cu, c, kc, silu,
                                 silu ? pre.data<double>() : nullptr, gc.data<double>(),
                                 dx.data<double>(), gw ? gw->data<double>() : nullptr);
  return dx;
}

Tensor kda_qk_conv_backward(const Tensor& x, const Tensor& weight, const Tensor& cu_seqlens,
                            int64_t head_dim, double eps, const Tensor& norm, const Tensor& dy,
                            Tensor* grad_weight) {
  const char* op = "kda_qk_conv_backward";
  const int64_t heads = qk_conv_heads(x, head_dim, op);
  check_conv_args(x, weight, op);
  const Shape rows{x.size(0), heads, head_dim};
  GLMTUNE_ASSERT(dy.defined() && dy.numel() == x.numel(), "{}: dy {} must be shaped {}", op,
                 dy.defined() ? dy.str() : "undefined", shape_str(rows));
  GLMTUNE_DISPATCH_CUDA(x, cuda_path::kda_qk_conv_backward(x, weight, cu_seqlens, head_dim, eps,
                                                           norm, dy, grad_weight));
  Tensor pre;
  const Tensor c = causal_conv1d(x, weight, cu_seqlens, true, &pre);
  const Tensor dc = l2_norm_backward(dy.reshape(rows), c.view(rows), eps, norm);
  return causal_conv1d_backward(x, weight, cu_seqlens, true, dc.view(x.shape()), grad_weight, pre);
}

Tensor kda_gate_backward(const Tensor& graw, const Tensor& dt_bias, const Tensor& A_log,
                         std::optional<double> lower_bound, const Tensor& dg, Tensor* grad_dt_bias,
                         Tensor* grad_A_log) {
  const char* op = "kda_gate_backward";
  check_gate_args(graw, dt_bias, A_log, op);
  GLMTUNE_ASSERT(dg.defined() && dg.numel() == graw.numel() && dg.dim() >= 1 &&
                     dg.size(0) == graw.size(0) && dg.device() == graw.device(),
                 "{}: dg {} must be graw's {} elements (as [T, NL, HL] or [T, NL·HL])", op,
                 dg.defined() ? dg.str() : "undefined", graw.str());
  GLMTUNE_DISPATCH_CUDA(graw, cuda_path::kda_gate_backward(graw, dt_bias, A_log, lower_bound, dg,
                                                           grad_dt_bias, grad_A_log));
  check_float(graw, "graw", op);
  check_float(dt_bias, "dt_bias", op);
  check_float(A_log, "A_log", op);
  check_float(dg, "dg", op);
  GLMTUNE_ASSERT(dt_bias.dtype() == graw.dtype() && A_log.dtype() == graw.dtype() &&
                     dg.dtype() == graw.dtype(),
                 "{}: dt_bias {}, A_log {} and dg {} must have the dtype of graw {}", op,
                 dt_bias.str(), A_log.str(), dg.str(), graw.str());
  const int64_t n = graw.size(0), nl = A_log.size(0), hl = graw.size(1) / nl;
  Tensor gc = graw.contiguous(), dc = dt_bias.contiguous(), ac = A_log.contiguous(),
         dgc = dg.contiguous();
  Tensor dz = Tensor::empty(graw.shape(), graw.dtype());
  Tensor* gdt = grad_if_trained(grad_dt_bias, dt_bias)
                    ? &grad_buffer(*grad_dt_bias, dt_bias, op, "dt_bias")
                    : nullptr;
  Tensor* gal =
      grad_if_trained(grad_A_log, A_log) ? &grad_buffer(*grad_A_log, A_log, op, "A_log") : nullptr;
  if (graw.dtype() == DType::f32)
    gate_backward_kernel<float>(gc.data<float>(), dc.data<float>(), ac.data<float>(), n, nl, hl,
                                lower_bound, dgc.data<float>(), dz.data<float>(),
                                gdt ? gdt->data<float>() : nullptr,
                                gal ? gal->data<float>() : nullptr);
  else
    gate_backward_kernel<double>(gc.data<double>(), dc.data<double>(), ac.data<double>(), n, nl, hl,
                                 lower_bound, dgc.data<double>(), dz.data<double>(),
                                 gdt ? gdt->data<double>() : nullptr,
                                 gal ? gal->data<double>() : nullptr);
  return dz;
}

KdaCoreGrads kda_chunked_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                                  const Tensor& g, const Tensor& beta, const Tensor& cu_seqlens,
                                  double scale, const Tensor& d_out, int64_t chunk_size) {
  const char* op = "kda_chunked_backward";
  check_core_args(q, k, v, g, beta, chunk_size, op);
  checks::same_shape(d_out, v, "d_out", "v", op);
  GLMTUNE_DISPATCH_CUDA(
      q, cuda_path::kda_chunked_backward(q, k, v, g, beta, cu_seqlens, scale, d_out, chunk_size));
  check_core(q, k, v, g, beta, op);
  check_float(d_out, "operand", op);
  GLMTUNE_ASSERT(d_out.dtype() == q.dtype(), "{}: operand {} must have the dtype of q {}", op,
                 d_out.str(), q.str());
  std::vector<int64_t> cu = read_cu_seqlens(cu_seqlens, q.size(0), op);
  if (q.dtype() == DType::f32)
    return core_backward_impl<float>(q, k, v, g, beta, d_out, cu, float(scale), chunk_size);
  return core_backward_impl<double>(q, k, v, g, beta, d_out, cu, scale, chunk_size);
}

Tensor kda_beta_backward(const Tensor& beta, const Tensor& d_beta) {
  const char* op = "kda_beta_backward";
  GLMTUNE_ASSERT(beta.defined(), "{}: no beta", op);
  checks::same_shape(d_beta, beta, "d_beta", "beta", op);
  GLMTUNE_DISPATCH_CUDA(beta, cuda_path::kda_beta_backward(beta, d_beta));
  check_float(beta, "beta", op);
  check_float(d_beta, "d_beta", op);
  GLMTUNE_ASSERT(d_beta.dtype() == beta.dtype(), "{}: d_beta {} must have the dtype of beta {}", op,
                 d_beta.str(), beta.str());
  Tensor d_logits = Tensor::empty(beta.shape(), beta.dtype());
  const int64_t n = beta.numel();
  const Tensor b_c = beta.contiguous(), g_c = d_beta.contiguous();
  if (beta.dtype() == DType::f32) {
    const float* b = b_c.data<float>();
    const float* g = g_c.data<float>();
    float* o = d_logits.data<float>();
    for (int64_t i = 0; i < n; ++i) o[i] = g[i] * b[i] * (1.0f - b[i]);
  } else {
    const double* b = b_c.data<double>();
    const double* g = g_c.data<double>();
    double* o = d_logits.data<double>();
    for (int64_t i = 0; i < n; ++i) o[i] = g[i] * b[i] * (1.0 - b[i]);
  }
  return d_logits;
}

}  // namespace glmtune::ops

// Backward of the sparse NoPE MLA (ops/mla.h): o_proj, the sparse attention over each query's
// selected keys (gather for the forward quantities, scatter-add into the keys' and values'
// gradients), kv_b_proj, both RMSNorms and the a/b projections. The indexer is not differentiated.

#include <algorithm>
#include <vector>

#include "glmtune/ops/cpu/common.h"
#include "glmtune/ops/cpu/mla_common.h"
#include "glmtune/ops/dispatch.h"
#include "glmtune/ops/linear.h"
#include "glmtune/ops/mla.h"
#include "glmtune/ops/norm.h"

namespace glmtune::ops {
using namespace cpu_detail;
namespace {

// Per query, its visible keys as a sorted set (CSR): the forward's union semantics, so a repeated
// entry contributes once. Validates every entry against the query's document, outside any
// parallel region.
struct KeySets {
  std::vector<int64_t> start;
  std::vector<int64_t> keys;
};

KeySets key_sets(const Tensor& indices, const Tensor& cu_seqlens, int64_t tokens) {
  GLMTUNE_ASSERT(indices.defined() && indices.dtype() == DType::i32 && indices.dim() == 2 &&
                     indices.size(0) == tokens && indices.device().is_cpu(),
                 "attention indices must be int32 [{}, W], got {}", tokens, describe(indices));
  const std::vector<int64_t> bounds = read_cu_seqlens(cu_seqlens, tokens, "mla attention backward");
  const Tensor idx_t = indices.contiguous();
  const int32_t* idx = idx_t.data<int32_t>();
  const int64_t width = indices.size(1);
  KeySets s;
  s.start.assign(size_t(tokens) + 1, 0);
  s.keys.reserve(size_t(tokens * std::min<int64_t>(width, 64)));
  std::vector<int64_t> row;
  for (size_t d = 0; d + 1 < bounds.size(); ++d) {
    const int64_t lo = bounds[d], hi = bounds[d + 1];
    for (int64_t i = lo; i < hi; ++i) {
      row.clear();
      for (int64_t w = 0; w < width; ++w) {
        const int64_t j = idx[i * width + w];
        // −1 means "no key"; anything outside the document is a caller bug (see sparse_attention).
        GLMTUNE_ASSERT(j == -1 || (j >= lo && j < hi),
                       "attention index {} of token {} lies outside its document [{}, {})", j, i,
                       lo, hi);
        if (j >= 0) row.push_back(j);
      }
      std::sort(row.begin(), row.end());
      row.erase(std::unique(row.begin(), row.end()), row.end());
      s.keys.insert(s.keys.end(), row.begin(), row.end());
      s.start[size_t(i) + 1] = int64_t(s.keys.size());
    }
  }
  return s;
}

// For one head the backward of o_i = Σ_j p_ij v_j, p_i = softmax_j(scale · q_i·k_j):
//   dp_ij = dO_i·v_j,  ds_ij = p_ij (dp_ij − Σ_l p_il dp_il),
//   dq_i = scale Σ_j ds_ij k_j,  dk_j += scale ds_ij q_i,  dv_j += p_ij dO_i.
// Heads run in parallel: the rows a head writes in dk and dv belong to it alone, so the
// scatter-add over queries needs no synchronisation.
template <typename T>
void attention_backward_kernel(const Tensor& q_t, const Tensor& k_t, const Tensor& v_t,
                               const Tensor& do_t, const KeySets& sets, T scale,
                               AttentionGrads& g) {
  const int64_t tokens = q_t.size(0), heads = q_t.size(1), dqk = q_t.size(2), dv = v_t.size(2);
  const T* q = q_t.data<T>();
  const T* k = k_t.data<T>();
  const T* v = v_t.data<T>();
  const T* dout = do_t.data<T>();
  T* dq = g.q.data<T>();
  T* dk = g.k.data<T>();
  T* dvp = g.v.data<T>();
  const bool parallel =
      heads > 1 && int64_t(sets.keys.size()) * heads * (dqk + dv) > (int64_t(1) << 18);
#pragma omp parallel if (parallel)
  {
    std::vector<T> prob, dprob;
#pragma omp for schedule(static)
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t i = 0; i < tokens; ++i) {
        const int64_t* keys = sets.keys.data() + sets.start[size_t(i)];
        const size_t n = size_t(sets.start[size_t(i) + 1] - sets.start[size_t(i)]);
        if (n == 0) continue;  // the forward wrote 0 here: no dependence on anything
        const T* qh = q + (i * heads + h) * dqk;
        const T* doh = dout + (i * heads + h) * dv;
        prob.resize(n);
        dprob.resize(n);
        const T sum = softmax_numerators(qh, k, keys, n, heads, h, dqk, scale, prob.data());
        T row_dot = T(0);
        for (size_t j = 0; j < n; ++j) {
          prob[j] /= sum;
          const T* vj = v + (keys[j] * heads + h) * dv;
          T dot = T(0);
          for (int64_t c = 0; c < dv; ++c) dot += doh[c] * vj[c];
          dprob[j] = dot;
          row_dot += prob[j] * dot;
        }
        T* dqh = dq + (i * heads + h) * dqk;
        for (size_t j = 0; j < n; ++j) {
          const T ds = prob[j] * (dprob[j] - row_dot) * scale;
          const T* kj = k + (keys[j] * heads + h) * dqk;
          T* dkj = dk + (keys[j] * heads + h) * dqk;
          for (int64_t c = 0; c < dqk; ++c) {
            dqh[c] += ds * kj[c];
            dkj[c] += ds * qh[c];
          }
          T* dvj = dvp + (keys[j] * heads + h) * dv;
          for (int64_t c = 0; c < dv; ++c) dvj[c] += prob[j] * doh[c];
        }
      }
    }
  }
}

// The bias gradient slot when the parameter has a bias, else nothing to differentiate.
Tensor* bias_grad(const Tensor& bias, Tensor& grad) {
  return bias.defined() ? grad_if_trained(grad, bias) : nullptr;
}

Tensor mla_backward_impl(const MlaConfig& cfg, const MlaParams& params, const MlaContext& ctx,
                         const Tensor& dy, MlaParams& grads) {
  const int64_t tokens = ctx.x.size(0), nh = cfg.n_heads;
  const int64_t dn = cfg.qk_nope_head_dim, dv = cfg.v_head_dim;

  // o_proj.
  const Tensor d_attn = linear_backward(dy, ctx.attn, params.o_proj, &grads.o_proj,
                                        bias_grad(params.o_proj_bias, grads.o_proj_bias));

  // Sparse attention, then [dk | dv] per head, reassembled in kv_b_proj's output layout.
  const AttentionGrads ga =
      sparse_attention_backward(ctx.proj.q, ctx.proj.k, ctx.proj.v, ctx.indices, ctx.cu_seqlens,
                                cfg.softmax_scale(), d_attn.view({tokens, nh, dv}));
  Tensor d_kv = Tensor::empty({tokens, nh, dn + dv}, ctx.x.dtype());
  d_kv.narrow(2, 0, dn).copy_(ga.k);
  d_kv.narrow(2, dn, dv).copy_(ga.v);

  // kv_b_proj, kv_a_layernorm (with the forward's saved statistic), kv_a_proj_with_mqa.
  const Tensor d_latent = linear_backward(d_kv.view({tokens, nh * (dn + dv)}), ctx.latent,
                                          params.kv_b_proj, &grads.kv_b_proj);
  const Tensor d_kv_a = rms_norm_backward(d_latent, ctx.kv_a, params.kv_a_layernorm,
                                          cfg.rms_norm_eps, ctx.kv_rstd, &grads.kv_a_layernorm);
  Tensor dx =
      linear_backward(d_kv_a, ctx.x, params.kv_a_proj_with_mqa, &grads.kv_a_proj_with_mqa,
                      bias_grad(params.kv_a_proj_with_mqa_bias, grads.kv_a_proj_with_mqa_bias));

  // q_b_proj, q_a_layernorm, q_a_proj. The indexer also reads q_resid (and x) but, running
  // without gradient, adds nothing to either.
  const Tensor d_qresid = linear_backward(ga.q.view({tokens, nh * dn}), ctx.proj.q_resid,
                                          params.q_b_proj, &grads.q_b_proj);
  const Tensor d_q_a = rms_norm_backward(d_qresid, ctx.q_a, params.q_a_layernorm, cfg.rms_norm_eps,
                                         ctx.q_rstd, &grads.q_a_layernorm);
  const Tensor dx_q = linear_backward(d_q_a, ctx.x, params.q_a_proj, &grads.q_a_proj,
                                      bias_grad(params.q_a_proj_bias, grads.q_a_proj_bias));
  add_into(dx, dx_q);
  return dx;
}

// The projections of mla_project, keeping the norms' inputs and statistics for the backward.
// Same calls in the same order, so the values equal mla_project's bit for bit.
MlaProjections project_with_context(const MlaConfig& cfg, const MlaParams& params, const Tensor& x,
                                    MlaContext& ctx) {
  GLMTUNE_ASSERT(x.defined() && x.dim() == 2 && x.device().is_cpu() && is_compute_dtype(x.dtype()),
                 "MLA input must be a CPU [T, D] tensor in f32 or f64, got {}", describe(x));
  check_mla_params(cfg, params, x.size(1), x.dtype());
  const int64_t tokens = x.size(0), nh = cfg.n_heads;
  const int64_t dn = cfg.qk_nope_head_dim, dv = cfg.v_head_dim;
  ctx.x = x;
  MlaProjections p;
  ctx.q_a = linear(x, params.q_a_proj, params.q_a_proj_bias);
  p.q_resid = rms_norm(ctx.q_a, params.q_a_layernorm, cfg.rms_norm_eps, &ctx.q_rstd);
  p.q = linear(p.q_resid, params.q_b_proj).view({tokens, nh, dn});
  ctx.kv_a = linear(x, params.kv_a_proj_with_mqa, params.kv_a_proj_with_mqa_bias);
  ctx.latent = rms_norm(ctx.kv_a, params.kv_a_layernorm, cfg.rms_norm_eps, &ctx.kv_rstd);
  const Tensor kv = linear(ctx.latent, params.kv_b_proj).view({tokens, nh, dn + dv});
  p.k = kv.narrow(2, 0, dn).contiguous();
  p.v = kv.narrow(2, dn, dv).contiguous();
  return p;
}

MlaOutput attend_with_context(const MlaConfig& cfg, const MlaParams& params, MlaProjections proj,
                              const Tensor& indices, const Tensor& cu_seqlens, MlaContext& ctx) {
  MlaOutput out = attend(cfg, params, std::move(proj), indices, cu_seqlens);
  ctx.indices = indices;
  ctx.cu_seqlens = cu_seqlens;
  ctx.proj = out.proj;
  ctx.attn = out.attn;
  return out;
}

}  // namespace

MlaOutput mla_forward(const MlaConfig& cfg, const MlaParams& params, const Tensor& x,
                      const Tensor& indices, const Tensor& cu_seqlens, MlaContext& ctx) {
  GLMTUNE_DISPATCH_CUDA(x, cuda_path::mla_forward(cfg, params, x, indices, cu_seqlens, &ctx));
  return attend_with_context(cfg, params, project_with_context(cfg, params, x, ctx), indices,
                             cu_seqlens, ctx);
}

DsaOutput dsa_forward(const MlaConfig& mla_cfg, const IndexerConfig& indexer_cfg,
                      const DsaParams& params, const Tensor& x, const Tensor& cu_seqlens,
                      const Tensor& prev_indices, MlaContext& ctx) {
  MlaProjections proj = project_with_context(mla_cfg, params.mla, x, ctx);
  DsaOutput out;
  out.indices = dsa_indices(indexer_cfg, params.indexer, x, proj.q_resid, cu_seqlens, prev_indices);
  out.y = attend_with_context(mla_cfg, params.mla, std::move(proj), out.indices, cu_seqlens, ctx).y;
  return out;
}

AttentionGrads sparse_attention_backward(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in,
                                         const Tensor& indices, const Tensor& cu_seqlens,
                                         double scale, const Tensor& dout) {
  GLMTUNE_DISPATCH_CUDA(q_in, cuda_path::sparse_attention_backward(q_in, k_in, v_in, indices,
                                                                   cu_seqlens, scale, dout));
  check_attention_qkv(q_in, k_in, v_in);
  GLMTUNE_ASSERT(dout.defined() && dout.shape() == v_in.shape() && dout.dtype() == v_in.dtype(),
                 "attention output gradient {} must match v {}", describe(dout), v_in.str());
  const KeySets sets = key_sets(indices, cu_seqlens, q_in.size(0));
  const Tensor q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous();
  const Tensor d = dout.contiguous();
  AttentionGrads g{Tensor::zeros(q.shape(), q.dtype()), Tensor::zeros(k.shape(), k.dtype()),
                   Tensor::zeros(v.shape(), v.dtype())};
  if (q.size(0) == 0) return g;
  if (q.dtype() == DType::f32)
    attention_backward_kernel<float>(q, k, v, d, sets, float(scale), g);
  else
    attention_backward_kernel<double>(q, k, v, d, sets, scale, g);
  return g;
}

Tensor mla_backward(const MlaConfig& cfg, const MlaParams& params, const MlaContext& ctx,
                    const Tensor& dy, MlaParams& grads) {
  GLMTUNE_DISPATCH_CUDA(dy, cuda_path::mla_backward(cfg, params, ctx, dy, grads));
  GLMTUNE_ASSERT(ctx.x.defined() && ctx.x.dim() == 2 && is_compute_dtype(ctx.x.dtype()) &&
                     ctx.x.device().is_cpu() && ctx.q_a.defined() && ctx.q_rstd.defined() &&
                     ctx.kv_a.defined() && ctx.kv_rstd.defined() && ctx.latent.defined() &&
                     ctx.proj.q.defined() && ctx.attn.defined() && ctx.indices.defined(),
                 "mla_backward needs the context filled by mla_forward or dsa_forward");
  check_mla_params(cfg, params, ctx.x.size(1), ctx.x.dtype());
  GLMTUNE_ASSERT(dy.defined() && dy.shape() == ctx.x.shape() && dy.dtype() == ctx.x.dtype(),
                 "mla_backward: dy {} must match the input {}", describe(dy), ctx.x.str());
  return mla_backward_impl(cfg, params, ctx, dy, grads);
}

Tensor dsa_backward(const MlaConfig& mla_cfg, const DsaParams& params, const MlaContext& ctx,
                    const Tensor& dy, DsaParams& grads) {
  // The indexer ran without gradient: only the MLA parameters and x are differentiated.
  return mla_backward(mla_cfg, params.mla, ctx, dy, grads.mla);
}

}  // namespace glmtune::ops

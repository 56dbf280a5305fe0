// The MLA / DSA block (ops/mla.h), composed from the leaf ops once for every device. The attention
// itself is the leaf op mla_attention, which picks the per-head or the absorbed-latent form.

#include "glmtune/ops/mla.h"

#include "glmtune/ops/dispatch.h"
#include "glmtune/ops/elementwise.h"
#include "glmtune/ops/fp8.h"
#include "glmtune/ops/grad.h"
#include "glmtune/ops/indexer.h"
#include "glmtune/ops/linear.h"
#include "glmtune/ops/norm.h"

namespace glmtune::ops {
namespace {

std::string describe(const Tensor& t) { return t.defined() ? t.str() : std::string("undefined"); }

// A parameter of shape `shape` on x's device, in x's dtype on the CPU (one compute dtype for all
// operands) and in bf16 or f32 on a GPU (the fp32-kept parameters, model::is_fp32_kept).
void check_param(const Tensor& t, const Shape& shape, const Tensor& x, const char* name) {
  const bool dtype_ok = x.device().is_cpu() ? t.dtype() == x.dtype()
                                            : (t.dtype() == DType::bf16 || t.dtype() == DType::f32);
  GLMTUNE_ASSERT(t.defined() && t.shape() == shape && t.device() == x.device() && dtype_ok,
                 "MLA parameter {} must be {} on {} for the input {}, got {}", name,
                 shape_str(shape), x.device().str(), x.str(), describe(t));
}

void check_optional_param(const Tensor& t, const Shape& shape, const Tensor& x, const char* name) {
  if (t.defined()) check_param(t, shape, x, name);
}

// The configuration's dimensions and every parameter, for the input x [T, D].
void check_mla(const MlaConfig& cfg, const MlaParams& params, const Tensor& x) {
  GLMTUNE_ASSERT(x.defined() && x.dim() == 2, "MLA input must be [T, D], got {}", describe(x));
  GLMTUNE_ASSERT(cfg.n_heads > 0 && cfg.q_lora_rank > 0 && cfg.kv_lora_rank > 0 &&
                     cfg.qk_nope_head_dim > 0 && cfg.v_head_dim > 0,
                 "MLA config dimensions must be positive");
  const int64_t dim = x.size(1), nh = cfg.n_heads, rq = cfg.q_lora_rank, rkv = cfg.kv_lora_rank;
  const int64_t dn = cfg.qk_nope_head_dim, dv = cfg.v_head_dim;
  check_param(params.q_a_proj.weight, {rq, dim}, x, "q_a_proj.weight");
  check_optional_param(params.q_a_proj.bias, {rq}, x, "q_a_proj.bias");
  check_param(params.q_a_layernorm, {rq}, x, "q_a_layernorm.weight");
  check_param(params.q_b_proj.weight, {nh * dn, rq}, x, "q_b_proj.weight");
  check_param(params.kv_a_proj_with_mqa.weight, {rkv, dim}, x, "kv_a_proj_with_mqa.weight");
  check_optional_param(params.kv_a_proj_with_mqa.bias, {rkv}, x, "kv_a_proj_with_mqa.bias");
  check_param(params.kv_a_layernorm, {rkv}, x, "kv_a_layernorm.weight");
  check_param(params.kv_b_proj.weight, {nh * (dn + dv), rkv}, x, "kv_b_proj.weight");
  check_param(params.o_proj.weight, {dim, nh * dv}, x, "o_proj.weight");
  check_optional_param(params.o_proj.bias, {dim}, x, "o_proj.bias");
}

// The query side: q_a, its norm (q_resid, the indexer's input) and q, into ctx.
void query(const MlaConfig& cfg, const MlaParams& params, const Tensor& x, MlaContext& ctx) {
  check_mla(cfg, params, x);
  ctx = MlaContext{};
  ctx.x = x;
  ctx.q_a = linear(x, params.q_a_proj);
  ctx.proj.q_resid = rms_norm(ctx.q_a, params.q_a_layernorm, cfg.rms_norm_eps, &ctx.q_rstd);
  ctx.proj.q = linear(ctx.proj.q_resid, params.q_b_proj)
                   .view({x.size(0), cfg.n_heads, cfg.qk_nope_head_dim});
}

// The key side and the attention over `indices`, after `query`.
MlaOutput attend(const MlaConfig& cfg, const MlaParams& params, const Tensor& indices,
                 const Tensor& cu_seqlens, MlaContext& ctx) {
  ctx.kv_a = linear(ctx.x, params.kv_a_proj_with_mqa);
  ctx.latent = rms_norm(ctx.kv_a, params.kv_a_layernorm, cfg.rms_norm_eps, &ctx.kv_rstd);
  ctx.indices = indices;
  ctx.cu_seqlens = cu_seqlens;
  ctx.attn = mla_attention(cfg, params.kv_b_proj, indices, cu_seqlens, ctx);
  MlaOutput out;
  out.y = linear(ctx.attn, params.o_proj);
  out.proj = ctx.proj;
  out.attn = ctx.attn;
  return out;
}

// The keys a DSA layer attends to: its own indexer's selection, or, for a layer without an
// indexer, the selection of the layer before it.
Tensor dsa_indices(const IndexerConfig& indexer_cfg, const IndexerParams& indexer, const Tensor& x,
                   const Tensor& q_resid, const Tensor& cu_seqlens, const Tensor& prev_indices) {
  if (indexer.defined()) return indexer_forward(indexer_cfg, indexer, x, q_resid, cu_seqlens);
  if (!prev_indices.defined())
    throw Error("a DSA layer without its own indexer got no indices from the layer before it",
                "indexer_types",
                "mark the layer \"full\", or place it right after a \"full\" DSA layer");
  return prev_indices;
}

}  // namespace

double MlaConfig::softmax_scale() const { return 1.0 / std::sqrt(double(qk_nope_head_dim)); }

MlaProjections mla_project(const MlaConfig& cfg, const MlaParams& params, const Tensor& x) {
  GLMTUNE_TIME_OP("mla_project", x);
  MlaContext ctx;
  query(cfg, params, x, ctx);
  // With qk_rope_head_dim = 0 the latent is all of kv_a's output and no shared rotary key is
  // appended: every head's key is just its k_nope slice.
  const Tensor latent =
      rms_norm(linear(x, params.kv_a_proj_with_mqa), params.kv_a_layernorm, cfg.rms_norm_eps);
  const int64_t dn = cfg.qk_nope_head_dim, dv = cfg.v_head_dim;
  const Tensor kv = linear(latent, params.kv_b_proj).view({x.size(0), cfg.n_heads, dn + dv});
  MlaProjections p = std::move(ctx.proj);
  p.k = kv.narrow(2, 0, dn).contiguous();
  p.v = kv.narrow(2, dn, dv).contiguous();
  return p;
}

#ifdef GLMTUNE_WITH_CUDA
// kv_b_proj's weight as the absorbed form reads it. With an adapter, the merged weight
// W + scale · B A (the product and the sum in f32, rounded once to W's dtype): the absorbed form
// folds the weight into the queries and outputs, so the adapter enters it merged, which computes
// the same function as the adapter's own term of the per-head form. It is rebuilt for the
// backward rather than kept (out × Rkv, a few MB a layer).
Tensor absorbed_weight(const Linear& kv_b_proj) {
  if (!kv_b_proj.lora.defined()) return kv_b_proj.weight;
  const LoraAdapter& a = kv_b_proj.lora;
  Tensor merged = linear(a.B.to(DType::f32), a.A.to(DType::f32).transpose(0, 1).contiguous());
  scale_into(merged, a.scale);
  add_into(merged, kv_b_proj.weight);
  return merged.to(kv_b_proj.weight.dtype());
}

// The gradient of the merged weight (f32) passed on: to W when it trains, and to the adapter as
// dB += scale · dW' Aᵀ, dA += scale · Bᵀ dW'.
void merged_weight_backward(const Linear& kv_b_proj, const Tensor& d_merged, Linear& grads) {
  if (Tensor* gw = grad_if_trained(grads.weight, kv_b_proj.weight))
    add_into(grad_buffer(*gw, kv_b_proj.weight, "mla_attention", "kv_b_proj"), d_merged);
  const LoraAdapter& a = kv_b_proj.lora;
  if (Tensor* gb = grad_if_trained(grads.lora.B, a.B)) {
    Tensor d_b = linear(d_merged, a.A.to(DType::f32));
    scale_into(d_b, a.scale);
    add_into(grad_buffer(*gb, a.B, "mla_attention", "kv_b_proj.lora_B"), d_b);
  }
  if (Tensor* ga = grad_if_trained(grads.lora.A, a.A)) {
    Tensor d_a = linear(a.B.to(DType::f32).transpose(0, 1).contiguous(),
                        d_merged.transpose(0, 1).contiguous());
    scale_into(d_a, a.scale);
    add_into(grad_buffer(*ga, a.A, "mla_attention", "kv_b_proj.lora_A"), d_a);
  }
}
#endif

Tensor mla_attention(const MlaConfig& cfg, const Linear& kv_b_proj, const Tensor& indices,
                     const Tensor& cu_seqlens, MlaContext& ctx) {
  ctx.attn_latent = Tensor();
  ctx.attn_lse2 = Tensor();
#ifdef GLMTUNE_WITH_CUDA
  // An adapter with dropout reads the masked latent: it does not merge into the weight.
  if (ctx.latent.device().is_cuda() &&
      cuda_path::absorbed_attention_fits(cfg, ctx.latent.dtype()) &&
      !kv_b_proj.lora.dropout_active())
    return cuda_path::mla_attention_absorbed(cfg, absorbed_weight(kv_b_proj), indices, cu_seqlens,
                                             ctx);
#endif
  const int64_t tokens = ctx.latent.size(0), dn = cfg.qk_nope_head_dim, dv = cfg.v_head_dim;
  const Tensor kv = linear(ctx.latent, kv_b_proj).view({tokens, cfg.n_heads, dn + dv});
  ctx.proj.k = kv.narrow(2, 0, dn).contiguous();
  ctx.proj.v = kv.narrow(2, dn, dv).contiguous();
  return sparse_attention(ctx.proj.q, ctx.proj.k, ctx.proj.v, indices, cu_seqlens,
                          cfg.softmax_scale())
      .view({tokens, cfg.n_heads * dv});
}

MlaAttentionGrads mla_attention_backward(const MlaConfig& cfg, const Linear& kv_b_proj,
                                         const MlaContext& ctx, const Tensor& d_attn,
                                         Linear* grad_kv_b_proj) {
#ifdef GLMTUNE_WITH_CUDA
  if (ctx.attn_latent.defined()) {
    if (!kv_b_proj.lora.defined())
      return cuda_path::mla_attention_absorbed_backward(
          cfg, kv_b_proj.weight, ctx, d_attn,
          grad_kv_b_proj ? grad_if_trained(grad_kv_b_proj->weight, kv_b_proj.weight) : nullptr);
    const Tensor merged = absorbed_weight(kv_b_proj);
    Tensor d_merged;
    MlaAttentionGrads g = cuda_path::mla_attention_absorbed_backward(
        cfg, merged, ctx, d_attn, grad_kv_b_proj ? &d_merged : nullptr);
    if (grad_kv_b_proj) merged_weight_backward(kv_b_proj, d_merged, *grad_kv_b_proj);
    return g;
  }
#endif
  const int64_t tokens = ctx.latent.size(0), nh = cfg.n_heads;
  const int64_t dn = cfg.qk_nope_head_dim, dv = cfg.v_head_dim;
  const AttentionGrads ga =
      sparse_attention_backward(ctx.proj.q, ctx.proj.k, ctx.proj.v, ctx.indices, ctx.cu_seqlens,
                                cfg.softmax_scale(), d_attn.view({tokens, nh, dv}));
  // [dk | dv] per head, in kv_b_proj's output layout.
  Tensor d_kv = Tensor::empty({tokens, nh, dn + dv}, ga.k.dtype(), ga.k.device());
  d_kv.narrow(2, 0, dn).copy_(ga.k);
  d_kv.narrow(2, dn, dv).copy_(ga.v);
  MlaAttentionGrads g;
  g.latent =
      linear_backward(d_kv.view({tokens, nh * (dn + dv)}), ctx.latent, kv_b_proj, grad_kv_b_proj);
  g.q = ga.q.view({tokens, nh * dn});
  return g;
}

MlaOutput mla_forward(const MlaConfig& cfg, const MlaParams& params, const Tensor& x,
                      const Tensor& indices, const Tensor& cu_seqlens, MlaContext& ctx) {
  GLMTUNE_TIME_OP("mla_forward", x);
  const Fp8InputShare share(x);  // q_a and kv_a read x
  query(cfg, params, x, ctx);
  return attend(cfg, params, indices, cu_seqlens, ctx);
}

MlaOutput mla_forward(const MlaConfig& cfg, const MlaParams& params, const Tensor& x,
                      const Tensor& indices, const Tensor& cu_seqlens) {
  MlaContext ctx;
  return mla_forward(cfg, params, x, indices, cu_seqlens, ctx);
}

DsaOutput dsa_forward(const MlaConfig& mla_cfg, const IndexerConfig& indexer_cfg,
                      const DsaParams& params, const Tensor& x, const Tensor& cu_seqlens,
                      const Tensor& prev_indices, MlaContext& ctx) {
  const Fp8InputShare share(x);  // q_a and kv_a read x
  // Timed in two parts around the indexer, so that the step's breakdown keeps the indexer apart.
  {
    GLMTUNE_TIME_OP("mla_forward", x);
    query(mla_cfg, params.mla, x, ctx);
  }
  DsaOutput out;
  out.indices =
      dsa_indices(indexer_cfg, params.indexer, x, ctx.proj.q_resid, cu_seqlens, prev_indices);
  GLMTUNE_TIME_OP("mla_forward", x);
  out.y = attend(mla_cfg, params.mla, out.indices, cu_seqlens, ctx).y;
  return out;
}

DsaOutput dsa_forward(const MlaConfig& mla_cfg, const IndexerConfig& indexer_cfg,
                      const DsaParams& params, const Tensor& x, const Tensor& cu_seqlens,
                      const Tensor& prev_indices) {
  MlaContext ctx;
  return dsa_forward(mla_cfg, indexer_cfg, params, x, cu_seqlens, prev_indices, ctx);
}

Tensor mla_backward(const MlaConfig& cfg, const MlaParams& params, const MlaContext& ctx,
                    const Tensor& dy, MlaParams& grads) {
  GLMTUNE_TIME_OP("mla_backward", dy);
  GLMTUNE_ASSERT(ctx.x.defined() && ctx.q_a.defined() && ctx.q_rstd.defined() &&
                     ctx.kv_a.defined() && ctx.kv_rstd.defined() && ctx.latent.defined() &&
                     ctx.proj.q.defined() && ctx.attn.defined() && ctx.indices.defined(),
                 "mla_backward needs the context filled by mla_forward or dsa_forward");
  check_mla(cfg, params, ctx.x);
  GLMTUNE_ASSERT(dy.defined() && dy.shape() == ctx.x.shape() && dy.dtype() == ctx.x.dtype() &&
                     dy.device() == ctx.x.device(),
                 "mla_backward: dy {} must match the input {}", describe(dy), ctx.x.str());
  const Tensor d_attn = linear_backward(dy, ctx.attn, params.o_proj, &grads.o_proj);
  const MlaAttentionGrads ga =
      mla_attention_backward(cfg, params.kv_b_proj, ctx, d_attn, &grads.kv_b_proj);
  // kv_a_layernorm and q_b_proj, q_a_layernorm with the forward's saved statistics. The indexer
  // also reads q_resid (and x) but, running without gradient, adds nothing to either.
  const Tensor d_kv_a = rms_norm_backward(ga.latent, ctx.kv_a, params.kv_a_layernorm,
                                          cfg.rms_norm_eps, ctx.kv_rstd, &grads.kv_a_layernorm);
  const Tensor d_qresid = linear_backward(ga.q, ctx.proj.q_resid, params.q_b_proj, &grads.q_b_proj);
  const Tensor d_q_a = rms_norm_backward(d_qresid, ctx.q_a, params.q_a_layernorm, cfg.rms_norm_eps,
                                         ctx.q_rstd, &grads.q_a_layernorm);
  // dx from both projections of x, summed in gradient_sum_dtype and rounded once.
  Tensor dx;
  const Fp8InputShare share(ctx.x);
  linear_backward_add(dx, d_kv_a, ctx.x, params.kv_a_proj_with_mqa, &grads.kv_a_proj_with_mqa);
  linear_backward_add(dx, d_q_a, ctx.x, params.q_a_proj, &grads.q_a_proj);
  return dx.to(ctx.x.dtype());
}

Tensor dsa_backward(const MlaConfig& mla_cfg, const DsaParams& params, const MlaContext& ctx,
                    const Tensor& dy, DsaParams& grads) {
  // The indexer ran without gradient: only the MLA parameters and x are differentiated.
  return mla_backward(mla_cfg, params.mla, ctx, dy, grads.mla);
}

}  // namespace glmtune::ops

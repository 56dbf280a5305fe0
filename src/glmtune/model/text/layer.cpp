#include "glmtune/model/text/layer.h"

#include <algorithm>

#include "glmtune/ops/elementwise.h"
#include "glmtune/ops/linear.h"
#include "glmtune/ops/mlp.h"
#include "glmtune/ops/norm.h"

namespace glmtune::model::text {

OpConfigs OpConfigs::from(const TextConfig& c) {
  OpConfigs o;
  o.mhc.hc_mult = c.hc_mult;
  o.mhc.sinkhorn_iters = c.hc_sinkhorn_iters;
  o.mhc.hc_eps = c.hc_eps;
  o.mhc.rms_eps = c.rms_norm_eps;
  o.kda.num_heads = c.linear_num_heads;
  o.kda.head_dim = c.linear_head_dim;
  o.kda.lower_bound = c.linear_lower_bound;
  o.kda.rms_eps = c.rms_norm_eps;
  o.mla.n_heads = c.num_attention_heads;
  o.mla.q_lora_rank = c.q_lora_rank;
  o.mla.kv_lora_rank = c.kv_lora_rank;
  o.mla.qk_nope_head_dim = c.qk_nope_head_dim;
  o.mla.v_head_dim = c.v_head_dim;
  o.mla.rms_norm_eps = c.rms_norm_eps;
  o.indexer.n_heads = c.index_n_heads;
  o.indexer.head_dim = c.index_head_dim;
  o.indexer.kpool = c.index_kpool;
  o.indexer.topk = c.index_topk;
  o.indexer.always_select_tail = c.index_kpool_always_select_tail;
  o.moe.n_experts = c.n_routed_experts;
  o.moe.top_k = c.num_experts_per_tok;
  o.moe.n_group = c.n_group;
  o.moe.topk_group = c.topk_group;
  o.moe.norm_topk_prob = c.norm_topk_prob;
  o.moe.routed_scaling_factor = c.routed_scaling_factor;
  o.moe.swiglu_limit = c.swiglu_limit;
  o.rms_eps = c.rms_norm_eps;
  o.swiglu_limit = c.swiglu_limit;
  return o;
}

std::vector<Tensor*> context_tensors(LayerContext& c) {
  // A field added to LayerContext (or to the op structs it holds) must join this list. The MLA
  // context's x, indices and cu_seqlens are left out: a layer context never holds them.
  static_assert(sizeof(LayerContext) == 64 * sizeof(Tensor));
  return {&c.streams_in,
          &c.attn_hc.post,
          &c.attn_hc.comb,
          &c.attn_hc.collapsed,
          &c.attn_hc_saved.rstd,
          &c.attn_hc_saved.mix,
          &c.attn_hc_saved.pre,
          &c.attn_hc_saved.comb_init,
          &c.attn_in,
          &c.attn_in_rstd,
          &c.kda.q_conv_in,
          &c.kda.k_conv_in,
          &c.kda.v_conv_in,
          &c.kda.q,
          &c.kda.k,
          &c.kda.v,
          &c.kda.q_norm,
          &c.kda.k_norm,
          &c.kda.g,
          &c.kda.beta,
          &c.kda.core,
          &c.kda.gate,
          &c.kda.normed,
          &c.kda.o_rstd,
          &c.mla.q_a,
          &c.mla.q_rstd,
          &c.mla.kv_a,
          &c.mla.kv_rstd,
          &c.mla.latent,
          &c.mla.proj.q_resid,
          &c.mla.proj.q,
          &c.mla.proj.k,
          &c.mla.proj.v,
          &c.mla.attn,
          &c.mla.attn_latent,
          &c.mla.attn_lse2,
          &c.indices,
          &c.attn_out,
          &c.streams_mid,
          &c.ffn_hc.post,
          &c.ffn_hc.comb,
          &c.ffn_hc.collapsed,
          &c.ffn_hc_saved.rstd,
          &c.ffn_hc_saved.mix,
          &c.ffn_hc_saved.pre,
          &c.ffn_hc_saved.comb_init,
          &c.ffn_in,
          &c.ffn_in_rstd,
          &c.routing.logits,
          &c.routing.weights,
          &c.routing.indices,
          &c.ffn_out,
          &c.ffn_mlp.x,
          &c.ffn_mlp.gate,
          &c.ffn_mlp.up,
          &c.ffn_routed.x_sorted,
          &c.ffn_routed.gate_up,
          &c.ffn_routed.act,
          &c.ffn_routed.out,
          &c.ffn_routed.u_gate_up,
          &c.ffn_routed.u_down};
}

MoeResult moe_block(const OpConfigs& cfg, const ops::MoeParams& params, const Tensor& x,
                    int64_t counted_rows, ops::MoeContext* keep) {
  MoeResult r;
  if (cfg.expert_dispatch != nullptr) {
    // Expert parallel: routing and the shared expert here, the routed experts where they live;
    // the shared expert joins after the routed sum, as in ops::moe_forward.
    r.routing = ops::moe_route(cfg.moe, params.router_weight, params.e_score_correction_bias, x);
    r.y = cfg.expert_dispatch->forward(cfg.moe, params, x, r.routing);
    if (params.shared.gate_proj.weight.defined())
      r.y = ops::add(r.y,
                     keep ? ops::mlp_forward(params.shared, x, cfg.moe.swiglu_limit, keep->shared)
                          : ops::mlp_forward(params.shared, x, cfg.moe.swiglu_limit));
    r.expert_counts = ops::moe_expert_counts(r.routing, cfg.moe.n_experts, counted_rows);
    return r;
  }
  if (params.shared.gate_proj.weight.defined()) {
    ops::MoeOutput o =
        keep ? ops::moe_forward(cfg.moe, params, x, counted_rows, *keep, /*keep_routed=*/true)
             : ops::moe_forward(cfg.moe, params, x, counted_rows);
    r.y = std::move(o.y);
    r.routing = std::move(o.routing);
    r.expert_counts = std::move(o.expert_counts);
    return r;
  }
  // n_shared_experts = 0: the routed sum alone.
  r.routing = ops::moe_route(cfg.moe, params.router_weight, params.e_score_correction_bias, x);
  r.y = ops::moe_experts(cfg.moe, params.gate_up_proj, params.down_proj, x, r.routing);
  r.expert_counts = ops::moe_expert_counts(r.routing, cfg.moe.n_experts, counted_rows);
  return r;
}

Tensor dsa_block(const OpConfigs& cfg, const ops::DsaParams& params, const Tensor& u,
                 const Tensor& cu_seqlens, const Tensor& carried_indices, Tensor* indices_out,
                 LayerContext* ctx) {
  if (const SequenceParallel* sp = cfg.sequence_parallel) {
    // The pack is split over ranks: the keys of other shards come from them. The projections and
    // the attention output stay inside the exchange (ctx->mla remains empty; the backward reruns
    // the mixer from its input and the selection).
    GLMTUNE_ASSERT(params.indexer.defined() || carried_indices.defined(),
                   "a DSA layer without its own indexer needs the previous layer's selection");
    Tensor indices;
    Tensor y =
        sp->dsa_forward(cfg.mla, cfg.indexer, params, u, cu_seqlens, carried_indices, &indices);
    if (indices_out) *indices_out = indices;
    if (ctx) ctx->indices = std::move(indices);
    return y;
  }
  ops::MlaContext mla;
  ops::DsaOutput out =
      ops::dsa_forward(cfg.mla, cfg.indexer, params, u, cu_seqlens, carried_indices, mla);
  if (indices_out) *indices_out = out.indices;
  if (ctx) {
    // The tensors the context holds elsewhere are dropped here (not kept, nor moved, twice).
    ctx->mla = std::move(mla);
    ctx->mla.x = Tensor();
    ctx->mla.indices = Tensor();
    ctx->mla.cu_seqlens = Tensor();
    ctx->indices = std::move(out.indices);
  }
  return out.y;
}

Tensor decoder_layer_forward(const OpConfigs& cfg, const TextConfig& config, const LayerWeights& w,
                             const Tensor& streams, const Tensor& cu_seqlens, int64_t counted_rows,
                             IndexerCarry& carry, Tensor* expert_counts, LayerContext* ctx,
                             bool ffn_projections) {
  // Attention site.
  ops::MhcPreSaved attn_saved;
  ops::MhcPreResult attn_hc = ops::mhc_pre(streams, w.attn_hc.fn, w.attn_hc.base, w.attn_hc.scale,
                                           cfg.mhc, ctx ? &attn_saved : nullptr);
  Tensor attn_rstd;
  Tensor u =
      ops::rms_norm(attn_hc.collapsed, w.input_layernorm, cfg.rms_eps, ctx ? &attn_rstd : nullptr);
  Tensor y;
  if (w.attn == AttnKind::kda) {
    y = cfg.sequence_parallel
            ? cfg.sequence_parallel->kda_forward(w.kda, u, cu_seqlens, cfg.kda,
                                                 ctx ? &ctx->kda : nullptr)
            : ops::kda_forward(w.kda, u, cu_seqlens, cfg.kda, ctx ? &ctx->kda : nullptr);
    carry.indices = Tensor();
  } else {
    Tensor indices;
    y = dsa_block(cfg, w.dsa, u, cu_seqlens, carry.indices, &indices, ctx);
    // The reference hands the selection on only from a layer with its own indexer to a "shared"
    // next layer (next_skip_topk); every other layer passes nothing on.
    const int64_t last = config.num_hidden_layers - 1;
    const bool next_shares =
        w.dsa.indexer.defined() &&
        config.indexer_types[std::min(w.index + 1, last)] == IndexerKind::shared;
    carry.indices = next_shares ? indices : Tensor();
  }
  Tensor mid = ops::mhc_post(streams, y, attn_hc.post, attn_hc.comb);

  // Feed-forward site.
  ops::MhcPreSaved ffn_saved;
  ops::MhcPreResult ffn_hc = ops::mhc_pre(mid, w.ffn_hc.fn, w.ffn_hc.base, w.ffn_hc.scale, cfg.mhc,
                                          ctx ? &ffn_saved : nullptr);
  Tensor ffn_rstd;
  Tensor v = ops::rms_norm(ffn_hc.collapsed, w.post_attention_layernorm, cfg.rms_eps,
                           ctx ? &ffn_rstd : nullptr);
  Tensor z;
  ops::Routing routing;
  const bool keep_ffn = ctx && ffn_projections;
  ops::MlpContext ffn_mlp;
  ops::MoeContext ffn_moe;
  if (w.mlp == MlpKind::dense) {
    z = keep_ffn ? ops::mlp_forward(w.dense, v, cfg.swiglu_limit, ffn_mlp)
                 : ops::mlp_forward(w.dense, v, cfg.swiglu_limit);
  } else {
    MoeResult m = moe_block(cfg, w.moe, v, counted_rows, keep_ffn ? &ffn_moe : nullptr);
    ffn_mlp = std::move(ffn_moe.shared);
    z = std::move(m.y);
    routing = std::move(m.routing);
    if (expert_counts) *expert_counts = std::move(m.expert_counts);
  }
  Tensor out = ops::mhc_post(mid, z, ffn_hc.post, ffn_hc.comb);

  if (ctx) {
    ctx->streams_in = streams;
    ctx->attn_hc = std::move(attn_hc);
    ctx->attn_hc_saved = std::move(attn_saved);
    ctx->attn_in = std::move(u);
    ctx->attn_in_rstd = std::move(attn_rstd);
    ctx->attn_out = std::move(y);
    ctx->streams_mid = std::move(mid);
    ctx->ffn_hc = std::move(ffn_hc);
    ctx->ffn_hc_saved = std::move(ffn_saved);
    ctx->ffn_in = std::move(v);
    ctx->ffn_in_rstd = std::move(ffn_rstd);
    ctx->routing = std::move(routing);
    ctx->ffn_out = std::move(z);
    ctx->ffn_mlp = std::move(ffn_mlp);
    ctx->ffn_routed = std::move(ffn_moe.routed);
  }
  return out;
}

MtpLayerResult mtp_layer_forward(const OpConfigs& cfg, const MtpWeights& w, const Tensor& future,
                                 const Tensor& hidden, const Tensor& cu_seqlens,
                                 int64_t counted_rows, MtpContext* ctx, bool ffn_projections) {
  Tensor e_rstd, h_rstd;
  Tensor e = ops::rms_norm(future, w.enorm, cfg.rms_eps, ctx ? &e_rstd : nullptr);
  Tensor h = ops::rms_norm(hidden, w.hnorm, cfg.rms_eps, ctx ? &h_rstd : nullptr);
  // Embedding first, hidden second (the reference trainer's eh_proj input order).
  Tensor x = ops::linear(ops::concat_columns(e, h), w.eh_proj);

  LayerContext* lc = ctx ? &ctx->layer : nullptr;
  Tensor attn_rstd;
  Tensor u = ops::rms_norm(x, w.input_layernorm, cfg.rms_eps, ctx ? &attn_rstd : nullptr);
  Tensor y = dsa_block(cfg, w.dsa, u, cu_seqlens, Tensor(), nullptr, lc);
  Tensor a = ops::add(x, y);
  Tensor ffn_rstd;
  Tensor v = ops::rms_norm(a, w.post_attention_layernorm, cfg.rms_eps, ctx ? &ffn_rstd : nullptr);
  ops::MoeContext ffn_moe;
  MoeResult m = moe_block(cfg, w.moe, v, counted_rows, lc && ffn_projections ? &ffn_moe : nullptr);
  Tensor b = ops::add(a, m.y);
  Tensor out_rstd;
  MtpLayerResult r;
  r.hidden = ops::rms_norm(b, w.shared_head_norm, cfg.rms_eps, ctx ? &out_rstd : nullptr);
  r.expert_counts = std::move(m.expert_counts);
  if (ctx) {
    ctx->future = future;
    ctx->future_normed = std::move(e);
    ctx->future_rstd = std::move(e_rstd);
    ctx->hidden_in = hidden;
    ctx->hidden_normed = std::move(h);
    ctx->hidden_rstd = std::move(h_rstd);
    ctx->mixed = x;
    lc->streams_in = std::move(x);
    lc->attn_in = std::move(u);
    lc->attn_in_rstd = std::move(attn_rstd);
    lc->attn_out = std::move(y);
    lc->streams_mid = std::move(a);
    lc->ffn_in = std::move(v);
    lc->ffn_in_rstd = std::move(ffn_rstd);
    lc->routing = std::move(m.routing);
    lc->ffn_out = std::move(m.y);
    lc->ffn_mlp = std::move(ffn_moe.shared);
    lc->ffn_routed = std::move(ffn_moe.routed);
    ctx->out = std::move(b);
    ctx->out_normed = r.hidden;
    ctx->out_rstd = std::move(out_rstd);
  }
  return r;
}

}  // namespace glmtune::model::text

#include "glmtune/model/text/backward.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <utility>

#include "glmtune/base/error.h"
#include "glmtune/model/balancing_loss.h"
#include "glmtune/model/loss.h"
#include "glmtune/ops/cross_entropy.h"
#include "glmtune/ops/elementwise.h"
#include "glmtune/ops/embedding.h"
#include "glmtune/ops/linear.h"
#include "glmtune/ops/mhc.h"
#include "glmtune/ops/mla.h"
#include "glmtune/ops/mlp.h"
#include "glmtune/ops/moe.h"
#include "glmtune/ops/norm.h"
#include "glmtune/tensor/host_offload.h"

namespace glmtune::model::text {
namespace {

std::string bias_name(int64_t layer) {
  return layer_prefix(layer) + "mlp.gate.e_score_correction_bias";
}

// ---- TextGrads construction: walk weights and gradients side by side ---------------------------

class GradBuilder {
 public:
  GradBuilder(const TextWeights& w, TextGrads& g) : g_(g) {
    for (size_t i = 0; i < w.named.size(); ++i) {
      by_ptr_[w.named[i].second.data_ptr()] = w.named[i].first;
      order_[w.named[i].first] = i;
    }
  }

  void add(const Tensor& w, Tensor& g) {
    if (!w.defined()) return;
    const auto it = by_ptr_.find(w.data_ptr());
    GLMTUNE_ASSERT(it != by_ptr_.end(), "a text weight of shape {} is missing from the name table",
                   shape_str(w.shape()));
    if (w.frozen() || !is_trainable_param(it->second)) return;
    // Gradients accumulate in the compute dtype on the CPU and in f32 on the GPU (bf16 weights).
    g = Tensor::zeros(w.shape(), w.device().is_cuda() ? DType::f32 : w.dtype(), w.device());
    g_.named.emplace_back(it->second, g);
  }
  void finish() {
    std::sort(g_.named.begin(), g_.named.end(),
              [&](const auto& a, const auto& b) { return order_[a.first] < order_[b.first]; });
  }

 private:
  TextGrads& g_;
  std::map<const void*, std::string> by_ptr_;
  std::map<std::string, size_t> order_;
};

// ---- Pieces of the backward --------------------------------------------------------------------

// What every piece of one pack's backward shares.
struct Ctx {
  const OpConfigs& ops;
  const TrainOptions& opt;
  Tensor cu;                   // int64 [ndoc + 1]
  int64_t counted = 0;         // non-padding rows
  std::vector<uint8_t> valid;  // 1 for non-padding rows (sequence-parallel loads)
  BackwardResult& result;
  Tensor balancing_sum;  // f64 [1] on the model's device: the routers' balancing losses
};

// Gradient of the balancing loss of one router into its logits (undefined when α = 0); the loss
// value joins c.balancing_sum, on the router's device (on a GPU nothing waits for it here).
Tensor balancing_grad(Ctx& c, const ops::Routing& routing, const Tensor& bias) {
  if (c.opt.balancing_alpha <= 0) return Tensor();
  BalancingLossOptions bo;
  bo.alpha = c.opt.balancing_alpha;
  bo.num_micro_packs = c.opt.num_micro_packs;
  const Device device = routing.logits.device();
  Tensor loads;
  if (const SequenceParallel* sp = c.ops.sequence_parallel) {
    // The pack's rows are spread over the group: the loss takes the loads of the whole pack, and
    // each rank returns its share of it (balancing_loss.h, global_loads).
    std::vector<int64_t> global =
        count_expert_loads(routing.indices.to(Device::cpu()), c.ops.moe.n_experts, c.valid);
    sp->sum(global);
    loads = Tensor::from_vector(global, {int64_t(global.size())}).to(device);
  } else {
    loads = ops::moe_expert_counts(routing, c.ops.moe.n_experts, c.counted);
  }
  if (!c.balancing_sum.defined()) c.balancing_sum = Tensor::zeros({1}, DType::f64, device);
  return balancing_loss_on_device(routing.logits, bias.to(device).to(routing.logits.dtype()),
                                  routing.indices, loads, c.counted, bo, c.balancing_sum);
}

// The context mlp_backward needs: the one a recomputed layer's forward made (its ffn_mlp, taken
// over), or the two projections computed again from the layer's input, exactly as its forward
// computed them.
ops::MlpContext mlp_context(const ops::MlpParams& p, const Tensor& x, ops::MlpContext made) {
  if (made.gate.defined()) {
    made.x = x;
    return made;
  }
  ops::MlpContext mc;
  ops::mlp_projections(p, x, mc);
  return mc;
}

// MoE backward from the layer's saved input and routing; `shared` and `routed`: a recomputed
// layer's shared expert context and routed activations (its ffn_mlp and ffn_routed), if any,
// released with the MoE context when this returns.
Tensor moe_grad(Ctx& c, const ops::MoeParams& p, const Tensor& x, const ops::Routing& routing,
                ops::MlpContext shared, ops::MoeRoutedActivations routed, const Tensor& dy,
                ops::MoeParams& g) {
  Tensor d_logits = balancing_grad(c, routing, p.e_score_correction_bias);
  if (const ExpertDispatch* dispatch = c.ops.expert_dispatch) {
    // Expert parallel: the routed experts' part comes back from their ranks; the router and the
    // shared expert are differentiated here.
    const ExpertDispatch::Backward routed = dispatch->backward(c.ops.moe, p, x, routing, dy, g);
    return ops::moe_backward_routed_elsewhere(c.ops.moe, p, x, routing, dy, routed.dx,
                                              routed.d_weights, g, d_logits);
  }
  ops::MoeContext mc;
  mc.x = x;
  mc.routing = routing;
  if (p.shared.gate_proj.weight.defined()) mc.shared = mlp_context(p.shared, x, std::move(shared));
  mc.routed = std::move(routed);
  return ops::moe_backward(c.ops.moe, p, mc, dy, g, d_logits);
}

// DSA backward from the MLA context the layer's forward kept (`kept`, without its input, selection
// and offsets), or, where none was kept (sequence parallel), from MLA run again on the same input
// with the saved selection, which reproduces the forward's values exactly; the indexer itself is
// not rerun (no gradient flows through it).
Tensor dsa_grad(Ctx& c, const ops::DsaParams& p, const Tensor& u, const Tensor& indices,
                const ops::MlaContext& kept, const Tensor& dy, ops::DsaParams& g) {
  if (const SequenceParallel* sp = c.ops.sequence_parallel)
    return sp->dsa_backward(c.ops.mla, p, u, indices, c.cu, dy, g);
  ops::MlaContext mc;
  if (kept.attn.defined()) {
    mc = kept;
    mc.x = u;
    mc.indices = indices;
    mc.cu_seqlens = c.cu;
  } else {
    ops::mla_forward(c.ops.mla, p.mla, u, indices, c.cu, mc);
  }
  return ops::dsa_backward(c.ops.mla, p, mc, dy, g);
}

// What a recomputed layer's context holds for its feed-forward backward (moved out of it, so that
// the backward can release it).
struct FfnKept {
  ops::MlpContext mlp;
  ops::MoeRoutedActivations routed;
};

FfnKept take_ffn(LayerContext& lc) {
  return FfnKept{std::exchange(lc.ffn_mlp, {}), std::exchange(lc.ffn_routed, {})};
}

// The same from a kept layer's context, which the step holds until its end.
FfnKept kept_ffn(const LayerContext& lc) { return FfnKept{lc.ffn_mlp, lc.ffn_routed}; }

// One decoder layer, d out [T, H, D] -> d in [T, H, D], from a full layer context. `ffn`: the
// feed-forward activations of a recomputed layer (take_ffn: released once the MLP's backward is
// done, before the attention's, where the layer's memory peaks) or of a kept one (kept_ffn).
Tensor layer_grad(Ctx& c, const LayerWeights& w, const LayerContext& lc, const Tensor& d_out,
                  LayerGrads& g, FfnKept ffn = {}) {
  const double eps = c.ops.rms_eps;
  // X' = post ⊗ y + combᵀ X, rebuilt where a kept or offloaded context dropped it.
  Tensor mid = lc.streams_mid.defined()
                   ? lc.streams_mid
                   : ops::mhc_post(lc.streams_in, lc.attn_out, lc.attn_hc.post, lc.attn_hc.comb);
  // Feed-forward site: X'' = post' ⊗ z + comb'ᵀ X'.
  ops::MhcPostGrads pf =
      ops::mhc_post_backward(mid, lc.ffn_out, lc.ffn_hc.post, lc.ffn_hc.comb, d_out);
  Tensor d_v;
  if (w.mlp == MlpKind::dense) {
    const ops::MlpContext mc = mlp_context(w.dense, lc.ffn_in, std::move(ffn.mlp));
    d_v = ops::mlp_backward(w.dense, mc, pf.d_y, c.ops.swiglu_limit, g.dense);
  } else {
    d_v = moe_grad(c, w.moe, lc.ffn_in, lc.routing, std::move(ffn.mlp), std::move(ffn.routed),
                   pf.d_y, g.moe);
  }
  const Tensor d_cf = ops::rms_norm_backward(d_v, lc.ffn_hc.collapsed, w.post_attention_layernorm,
                                             eps, lc.ffn_in_rstd, &g.post_attention_layernorm);
  // X' reaches X'' both through mhc_pre and through the residual path (pf.d_streams).
  const Tensor d_mid =
      ops::mhc_pre_backward(mid, w.ffn_hc.fn, w.ffn_hc.base, w.ffn_hc.scale, c.ops.mhc,
                            &lc.ffn_hc_saved, pf.d_post, pf.d_comb, d_cf, g.ffn_hc, pf.d_streams);
  mid = Tensor();

  // Attention site: X' = post ⊗ y + combᵀ X.
  ops::MhcPostGrads pa =
      ops::mhc_post_backward(lc.streams_in, lc.attn_out, lc.attn_hc.post, lc.attn_hc.comb, d_mid);
  Tensor d_u;
  if (w.attn == AttnKind::kda && c.ops.sequence_parallel)
    d_u = c.ops.sequence_parallel->kda_backward(w.kda, lc.attn_in, c.cu, c.ops.kda, &lc.kda, pa.d_y,
                                                g.kda);
  else if (w.attn == AttnKind::kda)
    d_u = ops::kda_backward(w.kda, lc.attn_in, c.cu, c.ops.kda, &lc.kda, pa.d_y, g.kda);
  else
    d_u = dsa_grad(c, w.dsa, lc.attn_in, lc.indices, lc.mla, pa.d_y, g.dsa);
  const Tensor d_ca = ops::rms_norm_backward(d_u, lc.attn_hc.collapsed, w.input_layernorm, eps,
                                             lc.attn_in_rstd, &g.input_layernorm);
  return ops::mhc_pre_backward(lc.streams_in, w.attn_hc.fn, w.attn_hc.base, w.attn_hc.scale,
                               c.ops.mhc, &lc.attn_hc_saved, pa.d_post, pa.d_comb, d_ca, g.attn_hc,
                               pa.d_streams);
}

struct MtpInputGrads {
  Tensor d_future;  // [T, D] w.r.t. the future-token embeddings
  Tensor d_hidden;  // [T, D] w.r.t. the hidden state the depth read
};

// One MTP depth from a full context, d (shared_head.norm output) -> input gradients.
MtpInputGrads mtp_grad(Ctx& c, const MtpWeights& w, const MtpContext& m, FfnKept ffn,
                       const Tensor& d_out, MtpGrads& g) {
  const double eps = c.ops.rms_eps;
  const LayerContext& lc = m.layer;
  // b = a + moe(post_attention_layernorm(a)), then shared_head.norm.
  Tensor d_b = ops::rms_norm_backward(d_out, m.out, w.shared_head_norm, eps, m.out_rstd,
                                      &g.shared_head_norm);
  const Tensor d_v = moe_grad(c, w.moe, lc.ffn_in, lc.routing, std::move(ffn.mlp),
                              std::move(ffn.routed), d_b, g.moe);
  Tensor d_a = ops::rms_norm_backward(d_v, lc.streams_mid, w.post_attention_layernorm, eps,
                                      lc.ffn_in_rstd, &g.post_attention_layernorm);
  ops::add_into(d_a, d_b);
  // a = x + dsa(input_layernorm(x)).
  const Tensor d_u = dsa_grad(c, w.dsa, lc.attn_in, lc.indices, lc.mla, d_a, g.dsa);
  Tensor d_x = ops::rms_norm_backward(d_u, lc.streams_in, w.input_layernorm, eps, lc.attn_in_rstd,
                                      &g.input_layernorm);
  ops::add_into(d_x, d_a);
  // x = eh_proj([enorm(future) ; hnorm(hidden)]).
  const int64_t dim = d_x.size(1);
  const Tensor cat = ops::concat_columns(m.future_normed, m.hidden_normed);
  const Tensor d_cat = ops::linear_backward(d_x, cat, w.eh_proj, &g.eh_proj);
  MtpInputGrads r;
  r.d_future = ops::rms_norm_backward(d_cat.narrow(1, 0, dim).contiguous(), m.future, w.enorm, eps,
                                      m.future_rstd, &g.enorm);
  r.d_hidden = ops::rms_norm_backward(d_cat.narrow(1, dim, dim).contiguous(), m.hidden_in, w.hnorm,
                                      eps, m.hidden_rstd, &g.hnorm);
  return r;
}

// dst[i + shift] += src[i] for every row i whose row i + shift lies in the same document: the
// gradient of the per-document roll that builds MTP's future rows from supplied embeddings.
void add_shifted_rows(Tensor& dst, const Tensor& src, const std::vector<int64_t>& cu,
                      int64_t shift) {
  std::vector<int64_t> rows(size_t(dst.size(0)), -1);
  for (size_t d = 0; d + 1 < cu.size(); ++d)
    for (int64_t i = cu[d]; i + shift < cu[d + 1]; ++i) rows[size_t(i + shift)] = i;
  ops::add_into(dst, ops::gather_rows(src, rows));
}

// Rows [begin, begin + rows) of a packed per-token tensor (the whole tensor when it is exactly
// that): what a sequence-parallel rank keeps of the pack-wide ids, labels and MTP rows.
Tensor shard(const Tensor& t, int64_t begin, int64_t rows) {
  if (begin == 0 && rows == t.size(0)) return t;
  return t.narrow(0, begin, rows).contiguous();
}

// The whole pack's [pack_rows, ...] tensor holding `t` at rows [begin, begin + t.size(0)) and
// zeros elsewhere (`t` itself when it is the whole pack): a shard's partial gradient of pack-wide
// rows.
Tensor unshard(const Tensor& t, int64_t begin, int64_t pack_rows) {
  if (begin == 0 && t.size(0) == pack_rows) return t;
  Shape shape = t.shape();
  shape[0] = pack_rows;
  Tensor out = Tensor::zeros(shape, t.dtype(), t.device());
  out.narrow(0, begin, t.size(0)).copy_(t);
  return out;
}

// Targets (labels other than the ignore label) of the whole pack, summed over the sequence
// parallel group from each rank's shard: the default denominator of a split pack.
double pack_targets(const SequenceParallel& sp, const Tensor& labels) {
  const Tensor l = labels.contiguous();
  std::vector<int64_t> n = {int64_t(std::count_if(l.data<int32_t>(), l.data<int32_t>() + l.numel(),
                                                  [](int32_t v) { return v != kIgnoreLabel; }))};
  sp.sum(n);
  return double(n[0]);
}

std::vector<int64_t> ids_of(const Tensor& input_ids) {
  const Tensor c = input_ids.contiguous();
  std::vector<int64_t> ids(size_t(c.numel()));
  for (size_t i = 0; i < ids.size(); ++i)
    ids[i] = c.dtype() == DType::i32 ? int64_t(c.data<int32_t>()[i]) : c.data<int64_t>()[i];
  return ids;
}

}  // namespace

bool is_trainable_param(const std::string& name) {
  return name.find(".indexer.") == std::string::npos &&
         !name.ends_with("e_score_correction_bias") && !name.starts_with("model.visual.");
}

TextGrads TextGrads::zeros_like(const TextWeights& w) {
  TextGrads g;
  GradBuilder b(w, g);
  b.add(w.embed_tokens, g.embed_tokens);
  b.add(w.final_norm, g.final_norm);
  // A tied head is the embedding's own storage: one buffer, one name.
  if (w.lm_head.defined() && w.lm_head.weight.data_ptr() == w.embed_tokens.data_ptr())
    g.lm_head.weight = g.embed_tokens;
  else
    b.add(w.lm_head.weight, g.lm_head.weight);
  b.add(w.lm_head.lora.A, g.lm_head.lora.A);
  b.add(w.lm_head.lora.B, g.lm_head.lora.B);
  g.layers.resize(w.layers.size());
  for (size_t l = 0; l < w.layers.size(); ++l) {
    const LayerWeights& lw = w.layers[l];
    LayerGrads& lg = g.layers[l];
    zip_layer_params(
        lw, lg, [&](const std::string&, ParamGroup, const Tensor& a, Tensor& o) { b.add(a, o); });
  }
  if (w.mtp) {
    const MtpWeights& m = *w.mtp;
    MtpGrads& mg = g.mtp.emplace();
    zip_mtp_params(
        m, mg, [&](const std::string&, ParamGroup, const Tensor& a, Tensor& o) { b.add(a, o); });
  }
  b.finish();
  return g;
}

void TextGrads::zero() {
  for (auto& [name, t] : named) t.zero_();
}

const Tensor* TextGrads::find(const std::string& name) const {
  for (const auto& [n, t] : named)
    if (n == name) return &t;
  return nullptr;
}

std::vector<ActivationPolicy> activation_policy(int64_t layers, double recompute, double offload) {
  GLMTUNE_ASSERT(recompute >= 0 && recompute <= 1 && offload >= 0 && offload <= 1,
                 "recompute fraction {} or offload fraction {} outside [0, 1]", recompute, offload);
  if (recompute + offload > 1 + 1e-9)
    throw Error(fmt::format("recompute {} and offload {} add up to more than every layer",
                            recompute, offload),
                "activation policy", "give fractions whose sum is at most 1");
  // As the reference trainer's recompute_ratio: the leading int(ratio · layers) layers are
  // checkpointed.
  const auto leading = [&](double fraction) {
    return std::min<int64_t>(layers, int64_t(std::floor(fraction * double(layers) + 1e-9)));
  };
  const int64_t recomputed = leading(recompute);
  const int64_t offloaded = std::min(layers - recomputed, leading(offload));
  std::vector<ActivationPolicy> p(size_t(layers), ActivationPolicy::keep);
  std::fill_n(p.begin(), recomputed, ActivationPolicy::recompute);
  std::fill_n(p.begin() + recomputed, offloaded, ActivationPolicy::offload);
  return p;
}

TrainForward training_forward(const TextModel& model, const PackInput& in,
                              const TrainOptions& opt) {
  const TextConfig& c = model.text();
  OpConfigs ops = model.op_configs();
  ops.expert_dispatch = opt.expert_dispatch;
  ops.sequence_parallel = opt.sequence_parallel;
  const SequenceParallel* sp = opt.sequence_parallel;
  const TextWeights& w = model.weights();
  Tensor emb;
  int64_t tokens = 0;
  if (sp && in.inputs_embeds.defined()) {
    // Every rank of the group holds the whole pack's embeddings (the vision splice, built on the
    // whole pack); only its shard enters the layers (below), while MTP reads the whole pack.
    GLMTUNE_ASSERT(in.inputs_embeds.dim() == 2 && in.inputs_embeds.size(1) == c.hidden_size,
                   "inputs_embeds must be [T, {}], got {}", c.hidden_size, in.inputs_embeds.str());
    tokens = in.inputs_embeds.size(0);
  } else if (sp) {
    // Every rank of the group holds the whole pack's ids; only its shard is embedded (below).
    GLMTUNE_ASSERT(in.input_ids.defined() && in.input_ids.dim() == 1,
                   "input_ids must be a [T] vector, got {}",
                   in.input_ids.defined() ? in.input_ids.str() : "nothing");
    tokens = in.input_ids.size(0);
  } else if (in.inputs_embeds.defined()) {
    GLMTUNE_ASSERT(in.inputs_embeds.dim() == 2 && in.inputs_embeds.size(1) == c.hidden_size,
                   "inputs_embeds must be [T, {}], got {}", c.hidden_size, in.inputs_embeds.str());
    emb = in.inputs_embeds.to(model.dtype()).contiguous();
  } else {
    emb = model.embed(in.input_ids);
  }
  if (!sp) tokens = emb.size(0);
  if (tokens == 0) throw Error("the pack is empty", "input_ids", "pass at least one token");
  const std::vector<int64_t> cu = ops::read_cu_seqlens(in.cu_seqlens, tokens, "training forward");
  if (in.padding_tokens < 0 || in.padding_tokens > tokens)
    throw Error(fmt::format("{} padding tokens in a pack of {}", in.padding_tokens, tokens),
                "padding_tokens", "count only the trailing padding document");
  if (!in.labels.defined() || in.labels.dim() != 1 || in.labels.size(0) != tokens ||
      in.labels.dtype() != DType::i32)
    throw Error(fmt::format("training needs int32 labels [{}]", tokens), "labels",
                "pass one aligned label per token (next_token_labels)");
  if (!opt.activations.empty() && int64_t(opt.activations.size()) != c.num_hidden_layers)
    throw InternalError(fmt::format("activation policy for {} layers, the model has {}",
                                    opt.activations.size(), c.num_hidden_layers));
  LayerParamProvider* const sharded = opt.layer_params;
  for (const LayerWeights& lw : w.layers)
    // Sharded layers are checked when gathered, in the loop below.
    if (!sharded && lw.mlp == MlpKind::sparse && !lw.moe.shared.gate_proj.weight.defined())
      throw Error("training a MoE layer without a shared expert is not supported",
                  fmt::format("layer {}", lw.index),
                  "train a checkpoint with n_shared_experts >= 1 (GLM-5.3 has one)");
  // This process's rows: the whole pack, or its shard under sequence parallelism (the padding
  // document is the pack's tail, so the counted rows are a prefix of every shard too).
  const int64_t row_begin = sp ? sp->shard_begin(tokens) : 0;
  const int64_t rows = sp ? sp->shard_rows(tokens) : tokens;
  if (sp)
    emb = in.inputs_embeds.defined()
              ? shard(in.inputs_embeds.to(model.dtype()).contiguous(), row_begin, rows)
              : model.embed(shard(in.input_ids, row_begin, rows));
  const int64_t counted = std::clamp<int64_t>(tokens - in.padding_tokens - row_begin, 0, rows);
  const Tensor cu_t = Tensor::from_vector(cu, {int64_t(cu.size())});

  TrainForward out;
  auto ctx = std::make_shared<ForwardContext>();
  ctx->cu_seqlens = cu;
  ctx->counted_rows = counted;
  ctx->row_begin = row_begin;
  ctx->embeddings = emb;
  ctx->layers.resize(size_t(c.num_hidden_layers));
  ctx->policies.assign(size_t(c.num_hidden_layers), ActivationPolicy::keep);
  ctx->labels = shard(in.labels, row_begin, rows);

  Tensor streams = ops::mhc_expand(emb, c.hc_mult);
  IndexerCarry carry;
  // The last offloaded layer's copy to the host, running while the next layer computes.
  Transfer copying;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    if (sharded) {
      sharded->gather(l);
      if (l + 1 < c.num_hidden_layers) sharded->prefetch(l + 1);
    }
    const LayerWeights& lw = w.layers[size_t(l)];
    if (sharded && lw.mlp == MlpKind::sparse && !lw.moe.shared.gate_proj.weight.defined())
      throw Error("training a MoE layer without a shared expert is not supported",
                  fmt::format("layer {}", lw.index),
                  "train a checkpoint with n_shared_experts >= 1 (GLM-5.3 has one)");
    ActivationPolicy policy =
        opt.activations.empty() ? ActivationPolicy::keep : opt.activations[size_t(l)];
    // On the CPU the context is in host memory already.
    if (policy == ActivationPolicy::offload && !model.device().is_cuda())
      policy = ActivationPolicy::keep;
    ctx->policies[size_t(l)] = policy;
    const Tensor carried = carry.indices;
    LayerContext full;
    Tensor counts;
    // The full context is filled either way (decoder_layer_forward computes the same values with
    // or without it); a recomputed layer keeps only its input and the selection it was handed.
    // A kept layer also keeps its feed-forward projections (ffn_projections).
    const bool keep = policy == ActivationPolicy::keep;
    Tensor next =
        decoder_layer_forward(ops, c, lw, streams, cu_t, counted, carry, &counts, &full, keep);
    // The previous layer's copy overlapped this layer's kernels, now queued: compute queued from
    // here on waits for it, and the device memory it read goes back to the allocator.
    copying.finish();
    LayerContext& slot = ctx->layers[size_t(l)];
    if (policy == ActivationPolicy::recompute) {
      slot.streams_in = streams;
      slot.indices = carried;
    } else {
      slot = std::move(full);
      // X' is rebuilt from X and the attention's output in the backward (one mhc_post): the
      // size of X, for a pass over it.
      slot.streams_mid = Tensor();
      if (keep) slot.ffn_routed = ops::gate_up_only(std::move(slot.ffn_routed));
    }
    if (policy == ActivationPolicy::offload)
      copying = HostOffload::of(model.device()).to_host(context_tensors(slot));
    if (lw.mlp == MlpKind::sparse) out.loads.push_back({bias_name(l), std::move(counts)});
    streams = std::move(next);
    if (sharded) sharded->release(l);
  }
  copying.finish();
  const Tensor hidden = ops::mhc_head(streams);
  ctx->final_normed = ops::rms_norm(hidden, w.final_norm, c.rms_norm_eps, &ctx->final_rstd);
  ctx->final_streams = streams;

  if (model.has_mtp() && opt.mtp && opt.mtp_depths > 0) {
    if (opt.mtp_params) opt.mtp_params->gather(c.num_hidden_layers);
    ctx->mtp.resize(size_t(opt.mtp_depths));
    Tensor h = hidden;
    for (int64_t k = 1; k <= opt.mtp_depths; ++k) {
      // Built on the whole pack: a shard's last rows look ahead into the next shard.
      const Tensor future =
          shard(model.future_embeddings(in.input_ids, in.inputs_embeds, cu, k), row_begin, rows);
      MtpContext full;
      MtpLayerResult r =
          mtp_layer_forward(ops, *w.mtp, future, h, cu_t, counted, &full, !opt.recompute_mtp);
      MtpContext& slot = ctx->mtp[size_t(k - 1)];
      if (opt.recompute_mtp) {
        slot.future = future;
        slot.hidden_in = h;
      } else {
        slot = std::move(full);
        slot.layer.ffn_routed = ops::gate_up_only(std::move(slot.layer.ffn_routed));
      }
      out.loads.push_back({bias_name(c.num_hidden_layers), std::move(r.expert_counts)});
      ctx->mtp_labels.push_back(shard(shift_labels(in.labels, cu_t, k), row_begin, rows));
      h = std::move(r.hidden);
    }
    if (opt.mtp_params) opt.mtp_params->release(c.num_hidden_layers);
  }
  out.context = std::move(ctx);
  return out;
}

BackwardResult backward(const TextModel& model, const PackInput& in, const ForwardContext& fc,
                        const TrainOptions& opt, TextGrads& grads) {
  const TextConfig& tc = model.text();
  const TextWeights& w = model.weights();
  GLMTUNE_ASSERT(fc.labels.defined(), "the backward needs a forward run with labels");
  GLMTUNE_ASSERT(int64_t(fc.layers.size()) == tc.num_hidden_layers && fc.final_normed.defined() &&
                     fc.embeddings.defined(),
                 "the backward needs a training context (training_forward, or TextModel::forward "
                 "with SavePolicy::all)");
  // (A frozen final norm, as under LoRA, has no buffer: the check is on the layers.)
  GLMTUNE_ASSERT(grads.layers.size() == w.layers.size(),
                 "gradient buffers were not built for this model (TextGrads::zeros_like)");
  const int64_t tokens = fc.embeddings.size(0);
  BackwardResult result;
  OpConfigs ops = model.op_configs();
  ops.expert_dispatch = opt.expert_dispatch;
  ops.sequence_parallel = opt.sequence_parallel;
  const SequenceParallel* sp = opt.sequence_parallel;
  const int64_t row_begin = fc.row_begin;
  GLMTUNE_ASSERT(sp != nullptr || row_begin == 0,
                 "a sequence-parallel forward context needs the same options in the backward");
  Ctx c{ops,
        opt,
        Tensor::from_vector(fc.cu_seqlens, {int64_t(fc.cu_seqlens.size())}),
        fc.counted_rows,
        std::vector<uint8_t>(size_t(tokens), 0),
        result,
        Tensor()};
  std::fill(c.valid.begin(), c.valid.begin() + fc.counted_rows, uint8_t(1));
  const double eps = c.ops.rms_eps;
  const int64_t vocab = w.embed_tokens.size(0);
  const std::optional<int64_t> pad = tc.pad_token_id >= 0 && tc.pad_token_id < vocab
                                         ? std::optional<int64_t>(tc.pad_token_id)
                                         : std::nullopt;
  const bool supplied = in.inputs_embeds.defined();
  const int64_t pack_rows = fc.cu_seqlens.back();

  // Offloaded layers come back one at a time, each copy running while the backward before it does
  // (the first one's behind the losses and the kept layers).
  const auto policy_of = [&](int64_t l) {
    return fc.policies.empty() ? ActivationPolicy::keep : fc.policies[size_t(l)];
  };
  struct Fetch {
    int64_t layer = -1;
    LayerContext context;
    Transfer copy;
  };
  const auto fetch_below = [&](int64_t above) {
    Fetch f;
    for (int64_t l = above - 1; l >= 0 && f.layer < 0; --l)
      if (policy_of(l) == ActivationPolicy::offload) {
        f.layer = l;
        f.context = fc.layers[size_t(l)];
        f.copy = HostOffload::of(model.device()).to_device(context_tensors(f.context));
      }
    return f;
  };
  Fetch fetched = fetch_below(tc.num_hidden_layers);

  // LM head and cross-entropy, fused.
  ops::CrossEntropyOptions ce;
  ce.denominator = opt.lm_denominator > 0 ? opt.lm_denominator
                   : sp                   ? pack_targets(*sp, fc.labels)
                                          : 0;
  ce.chunk_rows = opt.loss_chunk_rows;
  Tensor d_normed;
  const ops::CrossEntropyResult lm = ops::lm_head_cross_entropy(
      fc.final_normed, w.lm_head, fc.labels, ce, &d_normed, &grads.lm_head);
  result.lm_loss_sum = lm.loss_sum;
  result.lm_tokens = lm.n_tokens;
  result.lm_loss = lm.loss;
  const Tensor hidden = ops::mhc_head(fc.final_streams);
  Tensor d_hidden =
      ops::rms_norm_backward(d_normed, hidden, w.final_norm, eps, fc.final_rstd, &grads.final_norm);

  // MTP depths, last first: depth k's output is also depth k + 1's hidden input.
  Tensor d_emb_future;  // supplied-embedding path: MTP's gradient into the input rows
  if (!fc.mtp.empty()) {
    GLMTUNE_ASSERT(w.mtp.has_value() && grads.mtp.has_value(), "MTP context without MTP weights");
    const int64_t depths = int64_t(fc.mtp.size());
    GLMTUNE_ASSERT(int64_t(fc.mtp_labels.size()) == depths, "MTP context without its labels");
    result.mtp_loss_sum.assign(size_t(depths), 0.0);
    result.mtp_tokens.assign(size_t(depths), 0);
    const std::vector<int64_t> ids = supplied ? std::vector<int64_t>() : ids_of(in.input_ids);
    if (opt.mtp_params) opt.mtp_params->gather(tc.num_hidden_layers);
    Tensor d_next;
    for (int64_t k = depths; k >= 1; --k) {
      const MtpContext& saved = fc.mtp[size_t(k - 1)];
      MtpContext full;
      const MtpContext* m = &saved;
      if (!saved.out_normed.defined()) {
        // Recompute policy: rerun the depth from its inputs.
        mtp_layer_forward(c.ops, *w.mtp, saved.future, saved.hidden_in, c.cu, c.counted, &full,
                          /*ffn_projections=*/true);
        m = &full;
      }
      ops::CrossEntropyOptions mce;
      const double denom =
          size_t(k - 1) < opt.mtp_denominators.size() ? opt.mtp_denominators[size_t(k - 1)] : 0.0;
      mce.denominator = denom > 0 ? denom
                        : sp      ? pack_targets(*sp, fc.mtp_labels[size_t(k - 1)])
                                  : 0;
      mce.grad_scale = opt.mtp_loss_scale / double(depths);
      mce.chunk_rows = opt.loss_chunk_rows;
      Tensor d_out;
      const ops::CrossEntropyResult r = ops::lm_head_cross_entropy(
          m->out_normed, w.lm_head, fc.mtp_labels[size_t(k - 1)], mce, &d_out, &grads.lm_head);
      result.mtp_loss_sum[size_t(k - 1)] = r.loss_sum;
      result.mtp_tokens[size_t(k - 1)] = r.n_tokens;
      result.mtp_loss += mce.grad_scale * r.loss;
      if (d_next.defined()) ops::add_into(d_out, d_next);
      const MtpInputGrads g =
          mtp_grad(c, *w.mtp, *m, m == &saved ? kept_ffn(saved.layer) : take_ffn(full.layer), d_out,
                   *grads.mtp);
      if (k == 1)
        ops::add_into(d_hidden, g.d_hidden);
      else
        d_next = g.d_hidden;
      // The future rows: token i + k of the same document (id 0, or a zero row, past its end).
      const std::vector<int64_t>& cu = fc.cu_seqlens;
      if (supplied) {
        // Over the whole pack: under sequence parallelism a shard's future rows may lie in the
        // next shard.
        if (!d_emb_future.defined())
          d_emb_future = Tensor::zeros({pack_rows, g.d_future.size(1)}, g.d_future.dtype(),
                                       g.d_future.device());
        add_shifted_rows(d_emb_future, unshard(g.d_future, row_begin, pack_rows), cu, k);
      } else {
        std::vector<int64_t> future(ids.size(), 0);
        for (size_t d = 0; d + 1 < cu.size(); ++d)
          for (int64_t i = cu[d]; i + k < cu[d + 1]; ++i) future[size_t(i)] = ids[size_t(i + k)];
        ops::embedding_backward(
            w.embed_tokens,
            shard(Tensor::from_vector(future, {int64_t(future.size())}), row_begin, tokens),
            g.d_future, pad, grads.embed_tokens);
      }
    }
    if (opt.mtp_params) opt.mtp_params->release(tc.num_hidden_layers);
  }

  // Decoder layers, last first.
  Tensor d_streams = ops::mhc_head_backward(d_hidden, tc.hc_mult);
  for (int64_t l = tc.num_hidden_layers - 1; l >= 0; --l) {
    if (opt.layer_params) {
      // The layer below is differentiated next: its transfer overlaps this layer's backward.
      opt.layer_params->gather(l);
      if (l > 0) opt.layer_params->prefetch(l - 1);
      opt.layer_params->allocate_gradients(l);
    }
    const LayerWeights& lw = w.layers[size_t(l)];
    const LayerContext& saved = fc.layers[size_t(l)];
    const ActivationPolicy policy = policy_of(l);
    if (policy == ActivationPolicy::keep) {
      d_streams = layer_grad(c, lw, saved, d_streams, grads.layers[size_t(l)], kept_ffn(saved));
    } else if (policy == ActivationPolicy::offload) {
      GLMTUNE_ASSERT(fetched.layer == l, "offloaded layer {} was not fetched (next: {})", l,
                     fetched.layer);
      Fetch current = std::move(fetched);
      current.copy.finish();
      fetched = fetch_below(l);
      d_streams = layer_grad(c, lw, current.context, d_streams, grads.layers[size_t(l)]);
    } else {
      // Recompute policy: rerun the layer from its input (with the selection it was handed, for
      // a layer that reuses its predecessor's), then differentiate the fresh context.
      GLMTUNE_ASSERT(saved.streams_in.defined(), "layer {} kept neither its context nor its input",
                     l);
      IndexerCarry carry{saved.indices};
      LayerContext full;
      decoder_layer_forward(c.ops, tc, lw, saved.streams_in, c.cu, c.counted, carry, nullptr, &full,
                            /*ffn_projections=*/true);
      d_streams = layer_grad(c, lw, full, d_streams, grads.layers[size_t(l)], take_ffn(full));
    }
    if (opt.layer_params) {
      // The layer's gradient is complete for this pack: reduce it into the slice now and drop
      // the full-size buffers, per layer as fully sharded data parallel does.
      opt.layer_params->release(l);
      opt.layer_params->reduce_gradients(l);
    }
  }

  // Embedding.
  Tensor d_emb = ops::mhc_expand_backward(d_streams);
  if (supplied) {
    d_emb = unshard(d_emb, row_begin, pack_rows);
    if (d_emb_future.defined()) ops::add_into(d_emb, d_emb_future);
  } else {
    ops::embedding_backward(w.embed_tokens, shard(in.input_ids, row_begin, tokens), d_emb, pad,
                            grads.embed_tokens);
  }
  result.d_embeddings = std::move(d_emb);
  // The one wait of the backward for the balancing losses, after its last kernel is queued.
  if (c.balancing_sum.defined())
    result.balancing_loss = c.balancing_sum.to(Device::cpu()).data<double>()[0];
  return result;
}

StepPackResult forward_backward(const TextModel& model, const PackInput& input,
                                const TrainOptions& options, TextGrads& grads) {
  TrainForward f = training_forward(model, input, options);
  StepPackResult r;
  r.backward = backward(model, input, *f.context, options, grads);
  r.loads = std::move(f.loads);
  return r;
}

}  // namespace glmtune::model::text

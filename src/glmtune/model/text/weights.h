#pragma once
// The text model's parameters in the compute dtype, grouped the way the forward uses them.
//
// Built once per load from a ParamStore (whose tensors are bf16 / f32 as stored, many of them
// views of the memory-mapped checkpoint): every tensor is copied into memory the model owns and
// converted to the compute dtype (f32 for the reference path, f64 for finite-difference and
// composition tests) here, never in the layer loop. `named` lists every such tensor under its
// internal ParamStore name, sharing storage with the structs, so code that updates weights in
// place (an optimizer step, the router-bias update) writes through one table and the forward sees
// the change.

#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "glmtune/model/config.h"
#include "glmtune/model/param_store.h"
#include "glmtune/ops/kda.h"
#include "glmtune/ops/mla.h"
#include "glmtune/ops/mlp.h"
#include "glmtune/ops/moe.h"

namespace glmtune::model::text {

// One mHC site: released `hc_{attn,ffn}_{fn,base,scale}`.
struct HcParams {
  Tensor fn;     // [(2+H)·H, H·D]
  Tensor base;   // [(2+H)·H]
  Tensor scale;  // [3]
};

struct LayerWeights {
  int64_t index = 0;
  AttnKind attn = AttnKind::kda;
  MlpKind mlp = MlpKind::dense;
  Tensor input_layernorm;           // [D]
  Tensor post_attention_layernorm;  // [D]
  HcParams attn_hc, ffn_hc;
  ops::KdaParams kda;    // attn == kda
  ops::DsaParams dsa;    // attn == dsa; dsa.indexer undefined for a "shared" indexer layer
  ops::MlpParams dense;  // mlp == dense
  ops::MoeParams moe;    // mlp == sparse
};

// The MTP layer (`layers.<num_hidden_layers>`): a pre-norm DSA + MoE layer without mHC, with its
// own indexer, between the eh_proj input mixer and the shared-head norm.
struct MtpWeights {
  ops::Linear eh_proj;  // [D, 2D], input [enorm(embedding) ; hnorm(hidden)]
  Tensor enorm;         // [D]
  Tensor hnorm;         // [D]
  Tensor input_layernorm;
  Tensor post_attention_layernorm;
  Tensor shared_head_norm;  // [D] shared_head.norm
  ops::DsaParams dsa;
  ops::MoeParams moe;
};

struct TextWeights {
  DType dtype = DType::f32;  // the compute dtype: f32 / f64 on the CPU, bf16 (or f32) on a GPU
  Device device = Device::cpu();
  Tensor embed_tokens;  // [V, D]
  Tensor final_norm;    // [D]
  ops::Linear lm_head;  // weight [V, D] (the embedding itself when tie_word_embeddings)
  std::vector<LayerWeights> layers;
  std::optional<MtpWeights> mtp;
  std::vector<std::pair<std::string, Tensor>> named;
};

// ---- The parameter list ------------------------------------------------------------------------
// Which part of a layer a parameter belongs to: the loader takes only the mixer and MLP kinds a
// layer has (the KDA and MLA output projections share the name self_attn.o_proj.weight).
enum class ParamGroup { layer, kda, dsa, dense_mlp, moe };

// The ops' lists (ops/linear.h) under a prefix and a group: f(prefix + name, group, a, b), and
// f(prefix + name, group, a, b, WholeProjection) for a visitor that takes whole projections.
template <typename F>
struct InGroup {
  F& f;
  std::string prefix;
  ParamGroup group;

  template <typename A, typename B>
  void operator()(const std::string& name, A& a, B& b) const {
    f(prefix + name, group, a, b);
  }
  template <typename A, typename B>
  requires std::is_invocable_v<F&, const std::string&, ParamGroup, A&, B&, ops::WholeProjection>
  void operator()(const std::string& name, A& a, B& b, ops::WholeProjection w) const {
    f(prefix + name, group, a, b, w);
  }
};
template <typename F>
InGroup<F> in_group(const std::string& prefix, ParamGroup group, F& f) {
  return {f, prefix, group};
}

// A DSA layer's MLA projections and indexer.
template <typename A, typename B, typename F>
void zip_dsa_params(A& a, B& b, F&& f) {
  ops::zip_mla_params(a.mla, b.mla, in_group("self_attn.", ParamGroup::dsa, f));
  ops::zip_indexer_params(a.indexer, b.indexer, in_group("self_attn.indexer.", ParamGroup::dsa, f));
}

// Every parameter tensor of a decoder layer, written once: `f(name, group, a_field, b_field)` for
// each field of two structs with LayerWeights' fields (LayerWeights, or the gradients' LayerGrads)
// in a fixed order, `name` being the internal name under the layer's prefix. Fields a layer does
// not use (the other mixer or MLP kind, a shared indexer, absent biases or shared expert) are
// visited too, undefined. The released layout (model/layout.cpp), the loader, the gradient
// buffers, fsdp's flat layout and sequence parallel's head slicing all read this list.

template <typename A, typename B, typename F>
void zip_layer_params(A& a, B& b, F&& f) {
  const ParamGroup g = ParamGroup::layer;
  f("input_layernorm.weight", g, a.input_layernorm, b.input_layernorm);
  f("post_attention_layernorm.weight", g, a.post_attention_layernorm, b.post_attention_layernorm);
  f("hc_attn_fn", g, a.attn_hc.fn, b.attn_hc.fn);
  f("hc_attn_base", g, a.attn_hc.base, b.attn_hc.base);
  f("hc_attn_scale", g, a.attn_hc.scale, b.attn_hc.scale);
  f("hc_ffn_fn", g, a.ffn_hc.fn, b.ffn_hc.fn);
  f("hc_ffn_base", g, a.ffn_hc.base, b.ffn_hc.base);
  f("hc_ffn_scale", g, a.ffn_hc.scale, b.ffn_hc.scale);
  ops::zip_kda_params(a.kda, b.kda, in_group("self_attn.", ParamGroup::kda, f));
  zip_dsa_params(a.dsa, b.dsa, f);
  ops::zip_mlp_params(a.dense, b.dense, in_group("mlp.", ParamGroup::dense_mlp, f));
  ops::zip_moe_params(a.moe, b.moe, in_group("mlp.", ParamGroup::moe, f));
}

// The MTP layer's parameters (MtpWeights' fields, or MtpGrads'), names under its layer prefix.
template <typename A, typename B, typename F>
void zip_mtp_params(A& a, B& b, F&& f) {
  const ParamGroup g = ParamGroup::layer;
  ops::zip_linear("eh_proj", a.eh_proj, b.eh_proj, in_group("", g, f));
  f("enorm.weight", g, a.enorm, b.enorm);
  f("hnorm.weight", g, a.hnorm, b.hnorm);
  f("input_layernorm.weight", g, a.input_layernorm, b.input_layernorm);
  f("post_attention_layernorm.weight", g, a.post_attention_layernorm, b.post_attention_layernorm);
  zip_dsa_params(a.dsa, b.dsa, f);
  ops::zip_moe_params(a.moe, b.moe, in_group("mlp.", ParamGroup::moe, f));
  f("shared_head.norm.weight", g, a.shared_head_norm, b.shared_head_norm);
}

// One struct's fields: f(name, field).
template <typename L, typename F>
void for_each_layer_param(L& layer, F&& f) {
  zip_layer_params(layer, layer, [&](const std::string& name, ParamGroup, auto& field, auto&) {
    f(name, field);
  });
}
template <typename M, typename F>
void for_each_mtp_param(M& mtp, F&& f) {
  zip_mtp_params(mtp, mtp,
                 [&](const std::string& name, ParamGroup, auto& field, auto&) { f(name, field); });
}

// Copies and converts the text parameters of `store` (vision tensors are left alone). On the CPU
// dtype is f32 or f64 and every parameter is converted to it. On a CUDA device dtype is bf16: the
// parameters are stored in bf16 there, except those kept in f32 (model::is_fp32_kept's list and
// the mHC mixing matrices, which the GPU kernels read in f32); or f32, the fp32 mode (parity
// tests), where every parameter is f32.
TextWeights load_text_weights(const ParamStore& store, DType dtype, Device device = Device::cpu());

// Prefix of decoder layer `layer`'s parameters: "model.language_model.layers.<layer>.".
std::string layer_prefix(int64_t layer);

// PEFT's lora_dropout for one pack: every adapter of the decoder layers' projections (ops/linear.h)
// takes probability p and a key drawn from `pack_key` and its module's name, so each module masks
// independently and every pack anew; pack_key 0 turns dropout off (evaluation). Under sequence
// parallelism the MLPs run on this rank's shard of the pack's rows, from `shard_row0` on: their
// masks are drawn at those rows of the pack (the mixers see every row). An adapter on the LM head
// takes its own key the same way, its rows also from `shard_row0`.
void set_adapter_dropout(TextWeights& w, double p, uint64_t pack_key, int64_t shard_row0 = 0);

// train.fp8 = "tilewise": marks the projections whose GEMMs then run in block-scaled FP8
// (ops::Linear::fp8, ops/fp8.h) in every decoder layer and the MTP layer, the reference trainer's
// choice: the routed and shared experts, the dense MLPs, the MLA's q_a, q_b, kv_a and o
// projections and the KDA's q, k, v, o and gate (f_a, f_b, g_a, g_b) projections. kv_b_proj (the
// absorbed attention reads it whole), the KDA's beta projection, the indexer, the router, the
// embedding, the LM head, the MTP's eh_proj and the vision tower stay in the compute dtype.
// Returns the number of projections marked (each fused expert tensor counted once). With
// `alignment` > 0 (a GPU's FP8 GEMMs take 16) a marked weight whose dimensions are not multiples
// of it is refused, naming it.
int64_t use_fp8_gemms(TextWeights& w, int64_t alignment = 0);

// Whether the released tensor `name` ("model.language_model.layers.3.self_attn.q_a_proj.weight",
// "...mlp.experts.7.down_proj.weight") is the weight of a projection use_fp8_gemms marks.
bool released_weight_runs_in_fp8(const std::string& name);

}  // namespace glmtune::model::text

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
  Tensor eh_proj;  // [D, 2D], input [enorm(embedding) ; hnorm(hidden)]
  Tensor enorm;    // [D]
  Tensor hnorm;    // [D]
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
  Tensor lm_head;       // [V, D] (the embedding itself when tie_word_embeddings)
  std::vector<LayerWeights> layers;
  std::optional<MtpWeights> mtp;
  std::vector<std::pair<std::string, Tensor>> named;
};

// ---- The parameter list ------------------------------------------------------------------------
// Which part of a layer a parameter belongs to: the loader takes only the mixer and MLP kinds a
// layer has (the KDA and MLA output projections share the name self_attn.o_proj.weight).
enum class ParamGroup { layer, kda, dsa, dense_mlp, moe };

// Every parameter tensor of a decoder layer, written once: `f(name, group, a_field, b_field)` for
// each field of two structs with LayerWeights' fields (LayerWeights, or the gradients' LayerGrads)
// in a fixed order, `name` being the internal name under the layer's prefix. Fields a layer does
// not use (the other mixer or MLP kind, a shared indexer, absent biases or shared expert) are
// visited too, undefined. The loader, the gradient buffers, fsdp's flat layout and sequence
// parallel's head slicing all read this list.

// The MLA projections of a DSA layer (or of the MTP layer).
template <typename A, typename B, typename F>
void zip_mla_params(A& a, B& b, F&& f) {
  const ParamGroup g = ParamGroup::dsa;
  f("self_attn.q_a_proj.weight", g, a.q_a_proj, b.q_a_proj);
  f("self_attn.q_a_proj.bias", g, a.q_a_proj_bias, b.q_a_proj_bias);
  f("self_attn.q_a_layernorm.weight", g, a.q_a_layernorm, b.q_a_layernorm);
  f("self_attn.q_b_proj.weight", g, a.q_b_proj, b.q_b_proj);
  f("self_attn.kv_a_proj_with_mqa.weight", g, a.kv_a_proj_with_mqa, b.kv_a_proj_with_mqa);
  f("self_attn.kv_a_proj_with_mqa.bias", g, a.kv_a_proj_with_mqa_bias, b.kv_a_proj_with_mqa_bias);
  f("self_attn.kv_a_layernorm.weight", g, a.kv_a_layernorm, b.kv_a_layernorm);
  f("self_attn.kv_b_proj.weight", g, a.kv_b_proj, b.kv_b_proj);
  f("self_attn.o_proj.weight", g, a.o_proj, b.o_proj);
  f("self_attn.o_proj.bias", g, a.o_proj_bias, b.o_proj_bias);
}

// A DSA layer's MLA projections and indexer.
template <typename A, typename B, typename F>
void zip_dsa_params(A& a, B& b, F&& f) {
  const ParamGroup g = ParamGroup::dsa;
  zip_mla_params(a.mla, b.mla, f);
  auto &xa = a.indexer, &xb = b.indexer;
  f("self_attn.indexer.wq_b.weight", g, xa.wq_b, xb.wq_b);
  f("self_attn.indexer.wk.weight", g, xa.wk, xb.wk);
  f("self_attn.indexer.k_norm.weight", g, xa.k_norm_weight, xb.k_norm_weight);
  f("self_attn.indexer.k_norm.bias", g, xa.k_norm_bias, xb.k_norm_bias);
  f("self_attn.indexer.weights_proj.weight", g, xa.weights_proj, xb.weights_proj);
  f("self_attn.indexer.index_kpool_compress_ape", g, xa.kpool_ape, xb.kpool_ape);
  f("self_attn.indexer.index_kpool_compress_gate", g, xa.kpool_gate, xb.kpool_gate);
}

// A KDA mixer's parameters (KdaParams' fields; the q/k/v convs as the fused conv1d).
template <typename A, typename B, typename F>
void zip_kda_params(A& a, B& b, F&& f) {
  const ParamGroup g = ParamGroup::kda;
  f("self_attn.q_proj.weight", g, a.q_proj, b.q_proj);
  f("self_attn.k_proj.weight", g, a.k_proj, b.k_proj);
  f("self_attn.v_proj.weight", g, a.v_proj, b.v_proj);
  f("self_attn.conv1d.weight", g, a.conv1d, b.conv1d);
  f("self_attn.f_a_proj.weight", g, a.f_a_proj, b.f_a_proj);
  f("self_attn.f_b_proj.weight", g, a.f_b_proj, b.f_b_proj);
  f("self_attn.dt_bias", g, a.dt_bias, b.dt_bias);
  f("self_attn.A_log", g, a.A_log, b.A_log);
  f("self_attn.b_proj.weight", g, a.b_proj, b.b_proj);
  f("self_attn.g_a_proj.weight", g, a.g_a_proj, b.g_a_proj);
  f("self_attn.g_b_proj.weight", g, a.g_b_proj, b.g_b_proj);
  f("self_attn.o_norm.weight", g, a.o_norm, b.o_norm);
  f("self_attn.o_proj.weight", g, a.o_proj, b.o_proj);
}

// A clamped SwiGLU MLP under `prefix` ("mlp." dense, "mlp.shared_experts." the shared expert).
template <typename A, typename B, typename F>
void zip_mlp_params(const std::string& prefix, ParamGroup g, A& a, B& b, F&& f) {
  f(prefix + "gate_proj.weight", g, a.gate_proj, b.gate_proj);
  f(prefix + "up_proj.weight", g, a.up_proj, b.up_proj);
  f(prefix + "down_proj.weight", g, a.down_proj, b.down_proj);
}

template <typename A, typename B, typename F>
void zip_moe_params(A& a, B& b, F&& f) {
  const ParamGroup g = ParamGroup::moe;
  f("mlp.gate.weight", g, a.router_weight, b.router_weight);
  f("mlp.gate.e_score_correction_bias", g, a.e_score_correction_bias, b.e_score_correction_bias);
  f("mlp.experts.gate_up_proj", g, a.gate_up_proj, b.gate_up_proj);
  f("mlp.experts.down_proj", g, a.down_proj, b.down_proj);
  zip_mlp_params("mlp.shared_experts.", g, a.shared, b.shared, f);
}

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
  zip_kda_params(a.kda, b.kda, f);
  zip_dsa_params(a.dsa, b.dsa, f);
  zip_mlp_params("mlp.", ParamGroup::dense_mlp, a.dense, b.dense, f);
  zip_moe_params(a.moe, b.moe, f);
}

// The MTP layer's parameters (MtpWeights' fields, or MtpGrads'), names under its layer prefix.
template <typename A, typename B, typename F>
void zip_mtp_params(A& a, B& b, F&& f) {
  const ParamGroup g = ParamGroup::layer;
  f("eh_proj.weight", g, a.eh_proj, b.eh_proj);
  f("enorm.weight", g, a.enorm, b.enorm);
  f("hnorm.weight", g, a.hnorm, b.hnorm);
  f("input_layernorm.weight", g, a.input_layernorm, b.input_layernorm);
  f("post_attention_layernorm.weight", g, a.post_attention_layernorm, b.post_attention_layernorm);
  f("shared_head.norm.weight", g, a.shared_head_norm, b.shared_head_norm);
  zip_dsa_params(a.dsa, b.dsa, f);
  zip_moe_params(a.moe, b.moe, f);
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

}  // namespace glmtune::model::text

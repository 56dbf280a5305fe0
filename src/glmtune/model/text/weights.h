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

// Copies and converts the text parameters of `store` (vision tensors are left alone). On the CPU
// dtype is f32 or f64 and every parameter is converted to it. On a CUDA device dtype is bf16: the
// parameters are stored in bf16 there, except those kept in f32 (SPEC.md's fp32-kept list and the
// mHC mixing matrices, which the GPU kernels read in f32); or f32, the fp32 mode (parity tests),
// where every parameter is f32.
TextWeights load_text_weights(const ParamStore& store, DType dtype, Device device = Device::cpu());

// Prefix of decoder layer `layer`'s parameters: "model.language_model.layers.<layer>.".
std::string layer_prefix(int64_t layer);

}  // namespace glmtune::model::text

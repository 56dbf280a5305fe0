#pragma once
// Low-rank adapters (LoRA) on the text model's projections: y = W x + scale · B A x with A [r, in],
// B [out, r] and scale = alpha / r (alpha / sqrt(r) with rank-stabilised scaling), as PEFT defines
// them. The adapters live in the ParamStore beside the frozen base (InternalParam::adapter), under
// PEFT's names without its "base_model.model." prefix:
//   model.language_model.layers.3.self_attn.q_proj.lora_A.weight   [r, in]
//   model.language_model.layers.3.self_attn.q_proj.lora_B.weight   [out, r]
// and are saved apart from the released layout as a PEFT adapter directory
// (adapter_config.json, adapter_model.safetensors) that `PeftModel.from_pretrained` loads.
//
// Projections that take an adapter: every projection of the decoder layers' KDA and MLA mixers,
// dense MLPs and shared experts (target_modules), the LM head ("lm_head": named, not part of
// "all-linear", as in PEFT; with tied embeddings it adapts the head's product only, never the
// embedding lookup, and cannot be merged), and the routed experts' fused parameters
// (target_parameters, PEFT's ParamWrapper): internally
//   model.language_model.layers.3.mlp.experts.gate_up_proj.lora_A.weight   [E, r, in]
//   model.language_model.layers.3.mlp.experts.gate_up_proj.lora_B.weight   [E, out, r]
// converted at save and load to PEFT's [r·E, in] (expert e's A in rows e·r .. e·r+r) and
// [out, r·E] (expert e's B column k at k·E + e), under PEFT's nested-wrapper keys: with both
// parameters of a layer adapted, gate_up_proj's are "mlp.experts.base_layer.lora_A.weight" and
// down_proj's "mlp.experts.lora_A.weight"; one alone is "mlp.experts.lora_A.weight".
// Refused, each with a message: the indexer's (it runs without gradient, so its adapter would
// never train), the MTP layer (outside the reference model's modules) and the vision tower.
// docs/lora.md lists them.

#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "glmtune/model/param_store.h"

namespace glmtune::model {

struct LoraConfig {
  int64_t rank = 8;
  double alpha = 8;
  double dropout = 0;
  bool use_rslora = false;
  // PEFT's target_modules: module-name suffixes ("q_proj", "mlp.down_proj", "lm_head"), or the
  // entry "all-linear" (every projection that takes an adapter but the LM head, PEFT's rule).
  // Ignored when target_regex is set.
  std::vector<std::string> target_modules;
  // Or an ECMAScript regular expression matched against whole module names
  // ("model.language_model.layers.3.self_attn.q_proj"), as PEFT matches a string target_modules.
  std::string target_regex;
  // PEFT's target_parameters: the routed experts' fused parameters, matched like PEFT (a full
  // parameter name equal to the entry or ending in "." + it), e.g. "mlp.experts.gate_up_proj".
  // PEFT's "all-linear" does not include them.
  std::vector<std::string> target_parameters;
  // The frozen base's decoder-layer weights that the checkpoint stores in FP8 stay in FP8 on the
  // device, dequantised per layer around each use (model/text/fp8_layers.h); false: dequantised
  // to bf16 at load. The same values either way.
  bool fp8_base = false;

  double scale() const;
  // Throws glmtune::Error naming `where` for a rank below 1, a negative alpha, a dropout outside
  // [0, 1) (or not 0 beside target_parameters, as PEFT refuses it) or no target at all.
  void validate(const std::string& where) const;
};

// Module names of every projection of the store's text model that can take an adapter, in store
// order (the weight's internal name without ".weight"), the LM head ("lm_head") last.
std::vector<std::string> adaptable_modules(const ParamStore& store);

// The modules `config` targets, in store order, then the routed experts' parameters it targets
// (their internal names, "model.language_model.layers.N.mlp.experts.gate_up_proj"), layer by
// layer. glmtune::Error naming `where` when a target
// matches no module, or matches only projections glmtune cannot adapt (saying which and why).
std::vector<std::string> resolve_lora_targets(const ParamStore& store, const LoraConfig& config,
                                              const std::string& where);

// PEFT's target_parameters rule: the full parameter name equals an entry or ends with "." + it.
bool parameter_targeted(const std::string& name, const std::vector<std::string>& targets);

// Adds fresh adapters on `modules` to the store, with PEFT's default initialisation: A
// Kaiming-uniform (a = sqrt(5), i.e. uniform in ±1/sqrt(in)) drawn from `seed`, B zero. f32,
// trainable. Sets the store's adapter scale. A store loaded with an expert range gets the routed
// experts' adapters of that range only, with the values one process draws for those experts.
void add_lora_adapters(ParamStore& store, const LoraConfig& config,
                       const std::vector<std::string>& modules, uint64_t seed);

// Reads a PEFT adapter directory into the store and returns its configuration. glmtune::Error
// naming the file for a missing or malformed file, a key that names no adaptable projection of
// this model, a mis-shaped tensor, or an adapter type other than LoRA. A store loaded with an
// expert range keeps that range of the routed experts' adapters.
LoraConfig load_lora_adapter(ParamStore& store, const std::filesystem::path& dir);

// Writes the store's adapters as a PEFT adapter directory: adapter_config.json (the modules
// written out as a regular expression of exactly the adapted ones, so that PEFT adapts the same
// projections) and adapter_model.safetensors (f32), each file atomically. With `whole`, each
// adapter's value is asked of it in store order (ParamStore::save's contract: fsdp gathers the
// shards and expert parallelism the routed experts' adapters, collectives every rank runs; the
// other ranks call visit_lora_adapters).
// `base` (the base model's directory) goes into adapter_config.json's base_model_name_or_path.
void save_lora_adapter(const ParamStore& store, const LoraConfig& config,
                       const std::filesystem::path& dir, const ParamStore::WholeValue& whole = {},
                       const std::string& base = "");
// The modules (internal names, without ".weight") the store holds adapters on, in store order.
std::vector<std::string> adapted_modules(const ParamStore& store);

// The reference model's module path (PEFT's name) of an internal module name: the KDA forget
// gate's two projections sit in a `forget_gate` submodule there (the checkpoint names them
// self_attn.f_a_proj / f_b_proj).
std::string peft_module(const std::string& module);

// Calls `whole` for every adapter as save_lora_adapter does, writing nothing.
void visit_lora_adapters(const ParamStore& store, const ParamStore::WholeValue& whole);

// The adapter_config.json glmtune writes for these modules.
nlohmann::json peft_adapter_config(const LoraConfig& config,
                                   const std::vector<std::string>& modules,
                                   const std::string& base = "");

// W += scale · B A for every adapter of the store (in f32, then stored in the base weight's
// dtype), and the adapters removed: the store then holds a plain model in the released layout.
// Returns how many projections were merged. glmtune::Error, before any change, for an adapter on
// a head tied to the embedding (merging it would change the embedding lookup too).
int64_t merge_lora_adapters(ParamStore& store);

}  // namespace glmtune::model

#pragma once
// The released on-disk layout of a GLM-5.3-Flash checkpoint, derived from a config alone: every
// tensor's name, shape, stored dtype, initialisation rule and the component it belongs to. Counting
// parameters, `glmtune init`, checkpoint validation and the parameter store all read this one
// table.

#include <map>
#include <string>
#include <vector>

#include "glmtune/model/config.h"
#include "glmtune/tensor/tensor.h"

namespace glmtune::model {

enum class Component { embeddings_and_head, final_norm, layer, mtp, vision };

enum class InitRule {
  normal,  // N(0, std)
  zeros,
  ones,
  embedding,  // N(0, std) with the padding row zeroed
  dt_bias,    // inverse softplus of dt ~ exp(U(log 1e-3, log 1e-1)), floored at 1e-4
  a_log,      // 0 with a lower-bounded gate, else log(U(1, 16))
};

struct ParamSpec {
  std::string name;  // released on-disk name
  Shape shape;
  DType dtype;  // as stored by glmtune: f32 for fp32-kept parameters, else bf16
  InitRule init = InitRule::normal;
  double init_std = 0.0;
  Component component = Component::layer;
  int64_t layer = -1;  // decoder layer (the MTP layer is num_hidden_layers); -1 outside layers
  // Parameters the optimizer updates. The indexer is frozen (it runs without gradient) and the
  // router correction bias is a buffer moved by the load-balancing rule, not by gradients.
  bool trainable = true;

  int64_t numel() const { return shape_numel(shape); }
};

// The parameters the release stores in f32 and glmtune keeps in f32 on every device (everything
// else is bf16; docs/checkpoints.md, "The released layout"): A_log, dt_bias, the KDA conv weights,
// the router correction bias, mHC base and scale.
bool is_fp32_kept(const std::string& name);

// Every tensor of the released layout, in the release's order. The names and the order are the
// parameter structs' own lists (the zip_*_params visitors of model/text/weights.h and
// model/vision/tower.h), walked over structs of shape_only tensors.
std::vector<ParamSpec> released_layout(const ModelConfig& config);

// A tensor that carries a shape and no memory: a parameter struct filled with these states the
// shapes of its fields (VisionParams::shapes, and the text layers' in layout.cpp). Nothing may
// read or write its elements.
Tensor shape_only(const Shape& shape);

struct ParamCounts {
  int64_t total = 0;
  int64_t text = 0;  // decoder layers + embeddings + head + final norm (no MTP, no vision)
  int64_t embeddings_and_head = 0;
  int64_t mtp = 0;
  int64_t vision = 0;
  int64_t trainable = 0;
  int64_t bytes = 0;  // as stored by glmtune
  int64_t tensors = 0;
  struct Kind {
    int64_t layers = 0;
    int64_t params = 0;
  };
  // Keyed "<attention>+<mlp>", e.g. "kda+moe", "dsa+moe", "kda+dense".
  std::map<std::string, Kind> per_layer_kind;
  // Per-part totals across decoder layers: "kda_attention", "dsa_attention", "dsa_indexer",
  // "dense_mlp", "moe_experts", "moe_router", "moe_shared_expert", "hyper_connections", "norms".
  std::map<std::string, int64_t> per_part;
};

ParamCounts count_params(const ModelConfig& config, const std::vector<ParamSpec>& layout);

std::string layer_kind_name(const TextConfig& text, int64_t layer);

}  // namespace glmtune::model

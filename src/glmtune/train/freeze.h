#pragma once
// `train.freeze`: parameters a run keeps fixed, chosen by regular expressions over the released
// parameter names (what a checkpoint's safetensors hold, e.g.
// model.language_model.layers.3.mlp.experts.17.gate_proj.weight). A frozen parameter gets no
// gradient buffer, no optimizer state and no gradient reduction, on either device and in every
// parallel layout; checkpoints still hold it, byte for byte as loaded.
//
// glmtune trains a few released tensors as one fused tensor (ParamStore): a MoE layer's routed
// experts, and a KDA layer's q/k/v conv weights. A pattern must therefore match all of a fused
// tensor's released names or none of them; the vision tower (patch embedding, blocks, final norm)
// and the projector (downsample, merger) likewise freeze as a whole.

#include <cstdint>
#include <string>
#include <vector>

#include "glmtune/model/param_store.h"

namespace glmtune::train {

struct FreezePlan {
  std::vector<std::string> frozen;  // internal names of the parameters frozen by the patterns
  int64_t frozen_elements = 0;      // their elements (of the whole tensors)
  bool vision_tower = false;        // every tensor of the vision tower is frozen
  bool projector = false;           // every tensor of the projector is frozen
};

// The patterns that `model.freeze_vision` / `model.freeze_projector` stand for.
std::string vision_tower_pattern();
std::string projector_pattern();

// Marks every parameter of `store` whose released names the patterns match (std::regex_search,
// ECMAScript) as not trainable. glmtune::Error, naming `where` (the recipe key), for a pattern
// that matches no parameter, and for one that matches part of a fused tensor or of the vision
// tower or projector.
FreezePlan apply_freeze(model::ParamStore& store, const std::vector<std::string>& patterns,
                        const std::string& where);

}  // namespace glmtune::train

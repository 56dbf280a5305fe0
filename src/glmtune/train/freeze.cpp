#include "glmtune/train/freeze.h"

#include <fmt/format.h>

#include <regex>

#include "glmtune/base/error.h"
#include "glmtune/model/vision/tower.h"

namespace glmtune::train {
namespace {

bool is_vision(const std::string& name) { return name.starts_with("model.visual."); }

// A short list of names for a message: the first few, then how many more.
std::string some_of(const std::vector<std::string>& names, size_t limit = 3) {
  std::string out;
  for (size_t i = 0; i < names.size() && i < limit; ++i) out += (i ? ", " : "") + names[i];
  if (names.size() > limit) out += fmt::format(" and {} more", names.size() - limit);
  return out;
}

}  // namespace

std::string vision_tower_pattern() {
  return "^model\\.visual\\.(patch_embed|blocks|post_layernorm)\\.";
}
std::string projector_pattern() { return "^model\\.visual\\.(downsample|merger)\\."; }

FreezePlan apply_freeze(model::ParamStore& store, const std::vector<std::string>& patterns,
                        const std::string& where) {
  FreezePlan plan;
  if (patterns.empty()) return plan;
  std::vector<std::regex> res;
  for (const std::string& p : patterns) {
    try {
      res.emplace_back(p, std::regex::ECMAScript);
    } catch (const std::regex_error& e) {
      throw Error(fmt::format("'{}' is not a regular expression ({})", p, e.what()), where,
                  "write an ECMAScript regular expression, e.g. \"mlp\\\\.experts\\\\.\"");
    }
  }
  std::vector<int64_t> hits(patterns.size(), 0);
  const auto matched = [&](const std::string& name) {
    bool any = false;
    for (size_t i = 0; i < res.size(); ++i)
      if (std::regex_search(name, res[i])) {
        ++hits[i];
        any = true;
      }
    return any;
  };
  // Whole vision parts: how many of their tensors exist and how many the patterns froze.
  int64_t tower = 0, tower_frozen = 0, projector = 0, projector_frozen = 0;
  std::vector<std::string> to_freeze;
  for (const model::InternalParam& p : store.params()) {
    std::vector<std::string> in, out;
    for (const std::string& source : p.sources) (matched(source) ? in : out).push_back(source);
    const bool frozen = !in.empty();
    if (is_vision(p.name)) {
      const bool proj = model::vision::is_projector_param(p.name);
      (proj ? projector : tower) += 1;
      (proj ? projector_frozen : tower_frozen) += frozen ? 1 : 0;
    }
    if (!frozen) continue;
    if (!out.empty())
      throw Error(
          fmt::format("the freeze patterns match {} but not {}: glmtune trains them as one fused "
                      "tensor ({}), which is frozen whole or not at all",
                      some_of(in), some_of(out), p.name),
          where,
          p.name.ends_with("conv1d.weight")
              ? "freeze the q_conv1d, k_conv1d and v_conv1d weights of that layer together, or none"
              : "freeze every routed expert of that layer (e.g. "
                "\"layers\\\\.3\\\\.mlp\\\\.experts\\\\.\") "
                "or none of them");
    to_freeze.push_back(p.name);
  }
  for (size_t i = 0; i < patterns.size(); ++i)
    if (hits[i] == 0)
      throw Error(
          fmt::format("the freeze pattern '{}' matches no parameter of this model", patterns[i]),
          where,
          "patterns are searched in the released names, such as "
          "model.language_model.layers.0.mlp.down_proj.weight or "
          "model.language_model.embed_tokens.weight (the weight_map of the checkpoint's "
          "model.safetensors.index.json lists them all); a literal dot is \\\\. in a "
          "TOML string");
  const auto partial = [&](int64_t all, int64_t frozen) { return frozen > 0 && frozen < all; };
  if (partial(tower, tower_frozen) || partial(projector, projector_frozen))
    throw Error(
        fmt::format("the freeze patterns match {} of the vision tower's {} tensors and {} of the "
                    "projector's {}: each of the two freezes as a whole",
                    tower_frozen, tower, projector_frozen, projector),
        where,
        "freeze all of the vision tower (model.freeze_vision = true) and/or all of the projector "
        "(model.freeze_projector = true), or none of it");
  plan.vision_tower = tower > 0 && tower_frozen == tower;
  plan.projector = projector > 0 && projector_frozen == projector;
  for (const std::string& name : to_freeze) {
    const model::InternalParam& p = store.param(name);
    plan.frozen_elements += shape_numel(p.shape);
    store.set_trainable(name, false);
  }
  plan.frozen = std::move(to_freeze);
  return plan;
}

}  // namespace glmtune::train

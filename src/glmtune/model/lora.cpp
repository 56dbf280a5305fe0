#include "glmtune/model/lora.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <optional>
#include <regex>
#include <set>

#include "glmtune/base/error.h"
#include "glmtune/base/fs.h"
#include "glmtune/base/overloaded.h"
#include "glmtune/io/safetensors.h"
#include "glmtune/model/text/weights.h"
#include "glmtune/ops/linear.h"
#include "glmtune/tensor/rng.h"

namespace glmtune::model {
namespace {

namespace fs = std::filesystem;

constexpr const char* kConfigFile = "adapter_config.json";
constexpr const char* kWeightsFile = "adapter_model.safetensors";
constexpr const char* kPeftPrefix = "base_model.model.";
constexpr const char* kAllLinear = "all-linear";
constexpr const char* kHead = "lm_head";
constexpr const char* kEmbedding = "model.language_model.embed_tokens.weight";

// The tensor the LM head multiplies by: its own weight, or the embedding matrix when the model
// ties them (no lm_head.weight in the store then).
std::string head_weight(const ParamStore& store) {
  return store.contains(std::string(kHead) + ".weight") ? std::string(kHead) + ".weight"
                                                        : std::string(kEmbedding);
}
bool has_head(const ParamStore& store) {
  return store.contains(std::string(kHead) + ".weight") ||
         (store.config().text().tie_word_embeddings && store.contains(kEmbedding));
}

// A projection of the text model and whether an adapter can go on it.
struct Projection {
  std::string module;   // e.g. model.language_model.layers.3.self_attn.q_proj
  std::string refusal;  // empty when adaptable
};

// The projections of one decoder layer from the parameter list (model/text/weights.h), named
// relative to the layer.
std::vector<std::string> layer_projection_names() {
  text::LayerWeights lw;
  std::vector<std::string> out;
  text::zip_layer_params(
      lw, lw,
      Overloaded{[](const std::string&, text::ParamGroup, Tensor&, Tensor&) {},
                 [&](const std::string& name, text::ParamGroup, ops::Linear&, ops::Linear&,
                     ops::WholeProjection) { out.push_back(name); }});
  return out;
}

// Every projection the store's text model has, adaptable or not.
std::vector<Projection> projections(const ParamStore& store) {
  const int64_t layers = store.config().text().num_hidden_layers;
  const auto names = layer_projection_names();
  std::vector<Projection> out;
  std::set<std::string> seen;
  auto add = [&](int64_t layer, const std::string& why_not) {
    const std::string prefix = text::layer_prefix(layer);
    for (const std::string& name : names) {
      const std::string module = prefix + name;
      // The KDA and MLA output projections share the name self_attn.o_proj (a layer has one).
      if (!store.contains(module + ".weight") || !seen.insert(module).second) continue;
      std::string refusal = why_not;
      if (refusal.empty() && name.find(".indexer.") != std::string::npos)
        refusal =
            "the indexer runs without gradient (as in the reference), so an adapter on it would "
            "never train";
      out.push_back({module, refusal});
    }
  };
  for (int64_t l = 0; l < layers; ++l) add(l, "");
  if (store.config().text().num_nextn_predict_layers > 0)
    add(layers,
        "the MTP layer is not a module of the reference model (transformers drops its weights "
        "at load), so PEFT could not load an adapter on it");
  if (has_head(store)) out.push_back({kHead, ""});
  return out;
}

std::string internal_module(const std::string& peft) {
  const std::string gate = ".self_attn.forget_gate.";
  const size_t at = peft.find(gate);
  return at == std::string::npos
             ? peft
             : peft.substr(0, at) + ".self_attn." + peft.substr(at + gate.size());
}

// PEFT's rule: a string target is a regular expression over whole module names; a list entry
// matches a name equal to it or ending in "." + it. The expression is compiled once.
class TargetMatcher {
 public:
  explicit TargetMatcher(const LoraConfig& c) : keys_(c.target_modules) {
    if (!c.target_regex.empty()) regex_.emplace(c.target_regex);
  }
  bool operator()(const std::string& internal) const {
    const std::string module = peft_module(internal);
    if (regex_) return std::regex_match(module, *regex_);
    for (const std::string& key : keys_) {
      // PEFT's all-linear leaves out the output layer; naming lm_head adapts it.
      if (key == kAllLinear) {
        if (module != kHead) return true;
        continue;
      }
      if (module == key || module.ends_with("." + key)) return true;
    }
    return false;
  }

 private:
  std::vector<std::string> keys_;
  std::optional<std::regex> regex_;
};

std::string regex_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (std::string_view(".^$|()[]{}*+?\\").find(c) != std::string_view::npos) out += '\\';
    out += c;
  }
  return out;
}

// The base weight of adapter tensor `name` (<module>.lora_A.weight / lora_B.weight).
std::string module_of_adapter(const std::string& name) {
  for (const char* suffix : {".lora_A.weight", ".lora_B.weight"})
    if (name.ends_with(suffix)) return name.substr(0, name.size() - std::strlen(suffix));
  return "";
}

// The routed experts' fused parameters (internal names) of the decoder layers, in store order:
// gate_up_proj before down_proj, the order in which PEFT nests their wrappers.
constexpr const char* kExpertParams[] = {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"};

bool is_expert_param(const std::string& module) {
  return module.ends_with(".mlp.experts.gate_up_proj") ||
         module.ends_with(".mlp.experts.down_proj");
}

std::vector<std::string> expert_params(const ParamStore& store) {
  std::vector<std::string> out;
  for (int64_t l = 0; l < store.config().text().num_hidden_layers; ++l)
    for (const char* p : kExpertParams)
      if (store.contains(text::layer_prefix(l) + p)) out.push_back(text::layer_prefix(l) + p);
  return out;
}

}  // namespace

bool parameter_targeted(const std::string& name, const std::vector<std::string>& targets) {
  for (const std::string& t : targets)
    if (name == t || name.ends_with("." + t)) return true;
  return false;
}

namespace {

// The base weight an adapter's module adapts: "<module>.weight", the fused expert parameter
// itself (its internal name has no ".weight"), or for the LM head the tensor it multiplies by.
std::string base_weight(const ParamStore& store, const std::string& module) {
  if (module == kHead) return head_weight(store);
  return is_expert_param(module) ? module : module + ".weight";
}

// PEFT's key prefix of an expert parameter's adapter: "<layer>.mlp.experts." plus one
// "base_layer." per wrapper nested outside it. PEFT wraps a module's parameters in registration
// order (gate_up_proj, then down_proj), each wrapping the previous one, so the first of n adapted
// parameters sits under n - 1 "base_layer."s.
std::string peft_expert_prefix(const std::string& param, const std::set<std::string>& adapted) {
  const std::string experts = param.substr(0, param.rfind('.') + 1);  // "<layer>.mlp.experts."
  std::vector<std::string> mine;
  for (const char* p : {"gate_up_proj", "down_proj"})
    if (adapted.count(experts + p)) mine.push_back(experts + p);
  std::string prefix = experts;
  const auto at = std::find(mine.begin(), mine.end(), param);
  for (size_t i = size_t(at - mine.begin()) + 1; i < mine.size(); ++i) prefix += "base_layer.";
  return prefix;
}

// glmtune's per-expert layout to PEFT's and back. A [E, r, in] <-> [r·E, in] is the same memory
// (expert e's rows e·r .. e·r+r); B [E, out, r] <-> [out, r·E] interleaves: PEFT's column k·E + e
// is expert e's column k.
Tensor expert_a_to_peft(const Tensor& a) {
  return a.contiguous().reshape({a.size(0) * a.size(1), a.size(2)});
}
Tensor expert_b_to_peft(const Tensor& b) {
  return b.permute({1, 2, 0}).contiguous().reshape({b.size(1), b.size(2) * b.size(0)});
}
Tensor expert_a_from_peft(const Tensor& a, int64_t experts) {
  return a.contiguous().reshape({experts, a.size(0) / experts, a.size(1)}).contiguous().clone();
}
Tensor expert_b_from_peft(const Tensor& b, int64_t experts) {
  return b.contiguous()
      .reshape({b.size(0), b.size(1) / experts, experts})
      .permute({2, 0, 1})
      .contiguous()
      .clone();
}

// PEFT's save_pretrained, with lm_head among the targets, also writes the head's base weight
// beside its adapter (save_embedding_layers), and its from_pretrained loads that copy over the
// base's. A copy of the base's own head (to the rounding of the dtype PEFT held it in) changes
// nothing; another head would be a fully trained weight, which glmtune does not read.
void check_saved_head(const ParamStore& store, const Tensor& saved, const std::string& key,
                      const std::string& file) {
  const std::string name = head_weight(store);
  const Tensor& base = store.get(name);
  if (saved.shape() != store.param(name).shape)
    throw Error(fmt::format("tensor '{}' is {}, the base's LM head {} is {}", key,
                            shape_str(saved.shape()), name, shape_str(store.param(name).shape)),
                file, "use an adapter trained on this model");
  const Tensor a = saved.to(DType::f32).contiguous(), b = base.to(DType::f32).contiguous();
  const float* x = a.data<float>();
  const float* y = b.data<float>();
  double diff = 0, largest = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    diff = std::max(diff, double(std::fabs(x[i] - y[i])));
    largest = std::max(largest, double(std::fabs(y[i])));
  }
  // bf16 keeps 8 significant bits: a copy held in bf16 is within half a unit of the largest
  // entry's last place.
  if (diff > std::ldexp(largest, -8))
    throw Error(fmt::format("tensor '{}' (PEFT's copy of the LM head's weight) differs from the "
                            "base's {} by up to {:.3g}: the adapter was saved with another head, "
                            "and glmtune reads adapters, not trained base weights",
                            key, name, diff),
                file,
                "evaluate the adapter on the base it was trained on, or save it with "
                "save_pretrained(..., save_embedding_layers=False)");
}

}  // namespace

std::string peft_module(const std::string& module) {
  for (const char* gate : {"f_a_proj", "f_b_proj"}) {
    const std::string tail = std::string(".self_attn.") + gate;
    if (module.ends_with(tail))
      return module.substr(0, module.size() - tail.size()) + ".self_attn.forget_gate." + gate;
  }
  return module;
}

double LoraConfig::scale() const {
  return use_rslora ? alpha / std::sqrt(double(rank)) : alpha / double(rank);
}

void LoraConfig::validate(const std::string& where) const {
  if (rank < 1)
    throw Error(fmt::format("rank {} must be at least 1", rank), where + ".rank",
                "write e.g. rank = 16");
  if (!(alpha >= 0) || !std::isfinite(alpha))
    throw Error(fmt::format("alpha {} must be a finite number >= 0", alpha), where + ".alpha",
                "write e.g. alpha = 32 (PEFT's lora_alpha)");
  if (!(dropout >= 0 && dropout < 1))
    throw Error(fmt::format("dropout {} must be in [0, 1)", dropout), where + ".dropout",
                "write e.g. dropout = 0.05 (PEFT's lora_dropout), or 0 for none");
  // PEFT's adapters on fused expert parameters (ParamWrapper) take no dropout either.
  if (dropout != 0 && !target_parameters.empty())
    throw Error(fmt::format("dropout {} with target_parameters: adapters on the routed experts "
                            "take no dropout (as in PEFT)",
                            dropout),
                where + ".dropout", "write dropout = 0, or leave target_parameters out");
  if (target_modules.empty() && target_regex.empty() && target_parameters.empty())
    throw Error("no target modules or parameters", where + ".target_modules",
                "write e.g. target_modules = [\"q_proj\", \"o_proj\"], or \"all-linear\" (and "
                "target_parameters = [\"mlp.experts.gate_up_proj\", \"mlp.experts.down_proj\"] "
                "for the routed experts)");
  if (!target_regex.empty()) try {
      (void)std::regex(target_regex);
    } catch (const std::regex_error& e) {
      throw Error(fmt::format("'{}' is not a regular expression: {}", target_regex, e.what()),
                  where + ".target_modules", "write a valid ECMAScript regular expression");
    }
}

std::vector<std::string> adaptable_modules(const ParamStore& store) {
  std::vector<std::string> out;
  for (const Projection& p : projections(store))
    if (p.refusal.empty()) out.push_back(p.module);
  return out;
}

std::vector<std::string> resolve_lora_targets(const ParamStore& store, const LoraConfig& config,
                                              const std::string& where) {
  config.validate(where);
  const std::vector<Projection> all = projections(store);
  const TargetMatcher matches(config);
  std::vector<std::string> chosen;
  for (const Projection& p : all)
    if (p.refusal.empty() && matches(p.module)) chosen.push_back(p.module);
  // Each target must reach at least one adaptable projection; say why one that reaches only
  // refused projections (or none) cannot.
  std::vector<std::string> keys = config.target_modules;
  if (!config.target_regex.empty()) keys = {config.target_regex};
  for (const std::string& key : keys) {
    LoraConfig one = config;
    if (config.target_regex.empty()) one.target_modules = {key};
    const TargetMatcher matches_key(one);
    bool reached = false;
    const Projection* refused = nullptr;
    for (const Projection& p : all)
      if (matches_key(p.module)) {
        if (p.refusal.empty())
          reached = true;
        else if (!refused)
          refused = &p;
      }
    if (reached) continue;
    if (refused)
      throw Error(fmt::format("target '{}' matches only projections that cannot take an adapter, "
                              "e.g. {}: {}",
                              key, refused->module, refused->refusal),
                  where + ".target_modules", "remove the target, or narrow it");
    throw Error(
        fmt::format("target '{}' matches no projection of the text model (the modules are named "
                    "like model.language_model.layers.0.self_attn.q_proj and match by suffix)",
                    key),
        where + ".target_modules",
        "use the projections' names: q_proj, k_proj, v_proj, o_proj, f_a_proj, f_b_proj, b_proj, "
        "g_a_proj, g_b_proj (KDA); q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj "
        "(MLA); gate_proj, up_proj, down_proj (dense MLP and shared expert); lm_head; or "
        "\"all-linear\" (every projection but lm_head; the routed experts go in "
        "target_parameters)");
  }
  const std::vector<std::string> experts = expert_params(store);
  for (const std::string& key : config.target_parameters) {
    if (std::none_of(experts.begin(), experts.end(),
                     [&](const std::string& e) { return parameter_targeted(e, {key}); }))
      throw Error(fmt::format("target parameter '{}' matches none of the routed experts' fused "
                              "parameters (named like "
                              "model.language_model.layers.1.mlp.experts.gate_up_proj; the MTP "
                              "layer's are not adaptable)",
                              key),
                  where + ".target_parameters",
                  "write target_parameters = [\"mlp.experts.gate_up_proj\", "
                  "\"mlp.experts.down_proj\"] (or one of them), on a model with routed experts");
  }
  for (const std::string& e : experts)
    if (parameter_targeted(e, config.target_parameters)) chosen.push_back(e);
  return chosen;
}

void add_lora_adapters(ParamStore& store, const LoraConfig& config,
                       const std::vector<std::string>& modules, uint64_t seed) {
  uint64_t offset = 0;
  for (const std::string& module : modules) {
    if (is_expert_param(module)) {
      // PEFT's ParamWrapper initialises its [r·E, in] lora_A as one nn.Linear: Kaiming-uniform
      // with fan_in = in, the bound of a single projection.
      const Shape w = store.param(module).shape;
      GLMTUNE_ASSERT(w.size() == 3, "expert adapter target {} is not [E, out, in]", module);
      // Under an expert range the store holds experts [first, first + count): their A is drawn at
      // its place in the whole A, and every later draw starts where one process's does.
      const ExpertRange range = store.expert_range().value_or(ExpertRange{0, w[0]});
      Tensor a = Tensor::empty({range.count, config.rank, w[2]}, DType::f32);
      const double bound = 1.0 / std::sqrt(double(w[2]));
      fill_uniform(a, seed, offset + uint64_t(range.first * config.rank * w[2]), -bound, bound);
      offset += uint64_t(w[0] * config.rank * w[2]);
      store.add_adapter(module + ".lora_A.weight", std::move(a));
      store.add_adapter(module + ".lora_B.weight",
                        Tensor::zeros({range.count, w[1], config.rank}, DType::f32));
      continue;
    }
    const Shape w = store.param(base_weight(store, module)).shape;
    GLMTUNE_ASSERT(w.size() == 2, "adapter target {} is not a matrix", module);
    const int64_t out = w[0], in = w[1];
    Tensor a = Tensor::empty({config.rank, in}, DType::f32);
    // kaiming_uniform_(a = sqrt(5)): gain sqrt(2 / (1 + 5)), bound gain · sqrt(3 / fan_in).
    const double bound = 1.0 / std::sqrt(double(in));
    fill_uniform(a, seed, offset, -bound, bound);
    offset += uint64_t(a.numel());
    Tensor b = Tensor::zeros({out, config.rank}, DType::f32);
    store.add_adapter(module + ".lora_A.weight", std::move(a));
    store.add_adapter(module + ".lora_B.weight", std::move(b));
  }
  store.set_adapter_scale(config.scale());
}

nlohmann::json peft_adapter_config(const LoraConfig& config,
                                   const std::vector<std::string>& modules,
                                   const std::string& base) {
  std::string regex;
  std::vector<std::string> parameters;
  for (const std::string& m : modules)
    if (is_expert_param(m))
      parameters.push_back(m);
    else
      regex += (regex.empty() ? "" : "|") + regex_escape(peft_module(m));
  nlohmann::json j;
  j["peft_type"] = "LORA";
  j["task_type"] = nullptr;
  j["base_model_name_or_path"] = base.empty() ? nlohmann::json() : nlohmann::json(base);
  j["r"] = config.rank;
  j["lora_alpha"] = config.alpha;
  j["lora_dropout"] = config.dropout;
  j["use_rslora"] = config.use_rslora;
  j["use_dora"] = false;
  j["bias"] = "none";
  j["fan_in_fan_out"] = false;
  j["init_lora_weights"] = true;
  j["inference_mode"] = true;
  j["modules_to_save"] = nullptr;
  j["rank_pattern"] = nlohmann::json::object();
  j["alpha_pattern"] = nlohmann::json::object();
  // Exactly the adapted parameters, by full name: PEFT matches a name equal to an entry.
  if (regex.empty())
    j["target_modules"] = nlohmann::json::array();
  else
    j["target_modules"] = "(" + regex + ")";
  if (!parameters.empty()) j["target_parameters"] = parameters;
  return j;
}

std::vector<std::string> adapted_modules(const ParamStore& store) {
  std::vector<std::string> out;
  for (const InternalParam& p : store.params())
    if (p.adapter && p.name.ends_with(".lora_A.weight")) out.push_back(module_of_adapter(p.name));
  return out;
}

void visit_lora_adapters(const ParamStore& store, const ParamStore::WholeValue& whole) {
  for (const InternalParam& p : store.params())
    if (p.adapter) whole(p);
}

void save_lora_adapter(const ParamStore& store, const LoraConfig& config, const fs::path& dir,
                       const ParamStore::WholeValue& whole, const std::string& base) {
  io::NamedTensors tensors;
  const std::vector<std::string> modules = adapted_modules(store);
  const std::set<std::string> adapted(modules.begin(), modules.end());
  for (const InternalParam& p : store.params()) {
    if (!p.adapter) continue;
    const std::string module = module_of_adapter(p.name);
    const Tensor value = whole ? whole(p) : p.value;
    GLMTUNE_ASSERT(value.defined() && value.shape() == p.shape,
                   "adapter '{}' has no whole value to save", p.name);
    Tensor t = value.to(Device::cpu()).to(DType::f32);
    if (is_expert_param(module)) {
      const bool is_a = p.name.ends_with(".lora_A.weight");
      tensors.emplace_back(kPeftPrefix + peft_expert_prefix(module, adapted) +
                               (is_a ? "lora_A.weight" : "lora_B.weight"),
                           is_a ? expert_a_to_peft(t) : expert_b_to_peft(t));
      continue;
    }
    tensors.emplace_back(kPeftPrefix + peft_module(module) + p.name.substr(module.size()),
                         std::move(t));
  }
  GLMTUNE_ASSERT(!tensors.empty(), "saving an adapter from a store without adapters");
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec)
    throw Error(fmt::format("cannot create the adapter directory: {}", ec.message()), dir.string(),
                "check that the parent directory is writable");
  io::save_safetensors(dir / kWeightsFile, tensors, {{"format", "pt"}});
  write_file_atomic((dir / kConfigFile).string(),
                    peft_adapter_config(config, modules, base).dump(2) + "\n");
}

LoraConfig load_lora_adapter(ParamStore& store, const fs::path& dir) {
  const fs::path config_file = dir / kConfigFile, weights_file = dir / kWeightsFile;
  for (const fs::path& f : {config_file, weights_file})
    if (!fs::exists(f))
      throw Error(fmt::format("no {} in the adapter directory", f.filename().string()),
                  dir.string(),
                  "point at a directory PEFT saved (save_pretrained) or glmtune wrote "
                  "(<checkpoint>/adapter)");
  const nlohmann::json j =
      io::parse_json_strict(read_text_file(config_file.string(), "adapter configuration"),
                            config_file.string(), "write the file with PEFT's save_pretrained");
  const std::string where = config_file.string();
  auto fail = [&](const std::string& what, const std::string& fix) -> void {
    throw Error(what, where, fix);
  };
  if (j.value("peft_type", "") != "LORA")
    fail(fmt::format("peft_type is {}, glmtune reads LoRA adapters only",
                     j.contains("peft_type") ? j["peft_type"].dump() : "missing"),
         "use a LoRA adapter");
  if (j.value("use_dora", false)) fail("DoRA adapters are not supported", "use a plain LoRA");
  if (j.value("bias", std::string("none")) != "none")
    fail("adapters with trained biases (bias != \"none\") are not supported",
         "train the adapter with bias = \"none\"");
  for (const char* pattern : {"rank_pattern", "alpha_pattern"})
    if (j.contains(pattern) && !j[pattern].is_null() && !j[pattern].empty())
      fail(fmt::format("{} is set: glmtune reads adapters of one rank and alpha", pattern),
           "train the adapter with one r and lora_alpha for every module");
  if (j.contains("modules_to_save") && !j["modules_to_save"].is_null() &&
      !j["modules_to_save"].empty())
    fail("modules_to_save is set: glmtune reads adapters only, not fully trained modules",
         "save the adapter without modules_to_save");
  LoraConfig c;
  try {
    c.rank = j.at("r").get<int64_t>();
    c.alpha = j.at("lora_alpha").get<double>();
    c.dropout = j.value("lora_dropout", 0.0);
    c.use_rslora = j.value("use_rslora", false);
    if (j.contains("target_modules") && j["target_modules"].is_string())
      c.target_regex = j["target_modules"].get<std::string>();
    else if (j.contains("target_modules") && j["target_modules"].is_array())
      c.target_modules = j["target_modules"].get<std::vector<std::string>>();
    if (j.contains("target_parameters") && !j["target_parameters"].is_null())
      c.target_parameters = j["target_parameters"].get<std::vector<std::string>>();
  } catch (const nlohmann::json::exception& e) {
    fail(fmt::format("r and lora_alpha must be numbers: {}", e.what()),
         "write the file with PEFT's save_pretrained");
  }
  if (c.rank < 1) fail(fmt::format("r = {} must be at least 1", c.rank), "use r >= 1");

  const io::SafetensorsFile file = io::SafetensorsFile::open(weights_file);
  std::vector<std::string> adaptable = adaptable_modules(store);
  const std::set<std::string> ok(adaptable.begin(), adaptable.end());
  // The expert parameters the configuration's target_parameters adapt, and the PEFT key prefix of
  // each (which depends on which of a layer's two are adapted).
  std::map<std::string, std::string> expert_of_prefix;
  {
    std::vector<std::string> targeted;
    for (const std::string& e : expert_params(store))
      if (parameter_targeted(e, c.target_parameters)) targeted.push_back(e);
    const std::set<std::string> adapted(targeted.begin(), targeted.end());
    for (const std::string& e : targeted) {
      expert_of_prefix[peft_expert_prefix(e, adapted)] = e;
      adaptable.push_back(e);
    }
  }
  std::set<std::string> seen;
  std::vector<std::pair<std::string, Tensor>> loaded;
  for (const std::string& key : file.names()) {
    const std::string peft_name =
        key.starts_with(kPeftPrefix) ? key.substr(std::strlen(kPeftPrefix)) : std::string();
    if (peft_name == std::string(kHead) + ".base_layer.weight" && has_head(store)) {
      check_saved_head(store, file.tensor(key), key, weights_file.string());
      continue;
    }
    const std::string peft = module_of_adapter(peft_name);
    if (!peft.empty() && (peft.ends_with(".mlp.experts") || peft.ends_with(".base_layer"))) {
      const auto it = expert_of_prefix.find(peft + ".");
      if (it == expert_of_prefix.end())
        throw Error(fmt::format("tensor '{}' adapts the routed experts' fused parameters, and "
                                "target_parameters {} names none at this place",
                                key, nlohmann::json(c.target_parameters).dump()),
                    weights_file.string(),
                    "use an adapter PEFT saved with target_parameters (e.g. "
                    "[\"mlp.experts.gate_up_proj\", \"mlp.experts.down_proj\"]) on this model");
      const std::string param = it->second;
      const bool is_a = peft_name.ends_with(".lora_A.weight");
      const Shape w = store.param(param).shape;  // [E, out, in]
      const int64_t experts = w[0];
      const Shape want = is_a ? Shape{c.rank * experts, w[2]} : Shape{w[1], c.rank * experts};
      Tensor t = file.tensor(key);
      if (t.shape() != want)
        throw Error(fmt::format("tensor '{}' ({}) is {}, expected {} (r = {} times {} experts, "
                                "fused weight {})",
                                key, param.substr(param.rfind('.') + 1), shape_str(t.shape()),
                                shape_str(want), c.rank, experts, shape_str(w)),
                    weights_file.string(), "use an adapter trained on this model");
      const std::string name = param + (is_a ? ".lora_A.weight" : ".lora_B.weight");
      seen.insert(name);
      t = t.to(DType::f32);
      Tensor per_expert = is_a ? expert_a_from_peft(t, experts) : expert_b_from_peft(t, experts);
      // A store loaded with an expert range keeps that range's adapters, as its fused tensors.
      if (const auto& range = store.expert_range())
        per_expert = per_expert.narrow(0, range->first, range->count).contiguous().clone();
      loaded.emplace_back(name, std::move(per_expert));
      continue;
    }
    const std::string module = internal_module(peft);
    const std::string name = module + peft_name.substr(peft.size());
    if (module.empty() || !ok.count(module))
      throw Error(fmt::format("tensor '{}' is not the A or B of a projection this model can "
                              "adapt",
                              key),
                  weights_file.string(),
                  "use an adapter trained on this model (glmtune inspect lists the model's "
                  "tensors); adapters on the indexer, MTP layer or vision tower are not "
                  "supported");
    const Shape w = store.param(base_weight(store, module)).shape;
    const bool is_a = name.ends_with(".lora_A.weight");
    const Shape want = is_a ? Shape{c.rank, w[1]} : Shape{w[0], c.rank};
    Tensor t = file.tensor(key);
    if (t.shape() != want)
      throw Error(fmt::format("tensor '{}' is {}, expected {} (r = {}, weight {})", key,
                              shape_str(t.shape()), shape_str(want), c.rank, shape_str(w)),
                  weights_file.string(), "use an adapter trained on this model");
    seen.insert(name);
    loaded.emplace_back(name, t.to(DType::f32).contiguous().clone());
  }
  for (const auto& [name, t] : loaded) {
    const std::string module = module_of_adapter(name);
    const std::string other =
        module + (name.ends_with(".lora_A.weight") ? ".lora_B.weight" : ".lora_A.weight");
    if (!seen.count(other))
      throw Error(fmt::format("{} has {} without its {}", peft_module(module),
                              name.substr(module.size() + 1), other.substr(module.size() + 1)),
                  weights_file.string(), "use a complete adapter file");
  }
  if (loaded.empty())
    throw Error("the adapter holds no tensors", weights_file.string(),
                "use a LoRA adapter saved with save_pretrained");
  // Store order: by module as the model lists them, A before B.
  std::map<std::string, size_t> order;
  for (size_t i = 0; i < adaptable.size(); ++i) order[adaptable[i]] = i;
  std::sort(loaded.begin(), loaded.end(), [&](const auto& x, const auto& y) {
    const size_t ox = order.at(module_of_adapter(x.first)),
                 oy = order.at(module_of_adapter(y.first));
    return ox != oy ? ox < oy : x.first < y.first;
  });
  for (auto& [name, t] : loaded) store.add_adapter(name, std::move(t));
  store.set_adapter_scale(c.scale());
  return c;
}

int64_t merge_lora_adapters(ParamStore& store) {
  if (!store.has_adapters()) return 0;
  // A tied head is the embedding matrix: the merged head would change the embedding lookup too,
  // which the adapter never did, and the released layout has no separate head to hold it.
  if (store.contains(std::string(kHead) + ".lora_A.weight") && head_weight(store) == kEmbedding)
    throw Error(
        "the adapter is on the LM head of a model with tie_word_embeddings = true: its "
        "head is the embedding matrix, and merging would change the embeddings as well",
        "lm_head.lora_A.weight",
        "evaluate with the adapter (glmtune eval --adapter) instead of merging, or train "
        "without lm_head in target_modules");
  const double scale = store.adapter_scale();
  int64_t merged = 0;
  for (const InternalParam& p : store.params()) {
    if (!p.adapter || !p.name.ends_with(".lora_A.weight")) continue;
    const std::string module = module_of_adapter(p.name);
    const Tensor a = p.value.to(DType::f32).contiguous();
    const Tensor b = store.get(module + ".lora_B.weight").to(DType::f32).contiguous();
    Tensor& w = store.get(base_weight(store, module));
    Tensor sum = w.to(DType::f32).contiguous().clone();
    // A plain projection is one expert: W_e += scale · B_e A_e for each of the fused experts.
    const int64_t experts = a.dim() == 3 ? a.size(0) : 1;
    const int64_t out = b.size(b.dim() - 2), in = a.size(a.dim() - 1), r = a.size(a.dim() - 2);
    for (int64_t e = 0; e < experts; ++e)
      ops::gemm<float>(false, false, out, in, r, float(scale), b.data<float>() + e * out * r, r,
                       a.data<float>() + e * r * in, in, 1.0f, sum.data<float>() + e * out * in,
                       in);
    w = sum.to(w.dtype());
    ++merged;
  }
  store.remove_adapters();
  return merged;
}

}  // namespace glmtune::model

#include "glmtune/model/config.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>

#include "glmtune/base/error.h"
#include "glmtune/base/fs.h"

namespace glmtune::model {
namespace {

// Upper bounds on the sizes glmtune allocates per item (docs/checkpoints.md). Each is far above
// the released model, so no real config meets them; they exist so that a damaged or hostile file
// (2e9 layers) is refused with an error instead of allocating gigabytes of schedules and weights,
// and so that the parameter counts derived from them stay inside int64.
constexpr int64_t kMaxLayers = 1024;    // released: 45 text layers, 24 vision blocks
constexpr int64_t kMaxHeads = 1024;     // released: 64 attention / KDA heads, 32 indexer heads
constexpr int64_t kMaxExperts = 16384;  // released: 288 routed experts, 1 shared
constexpr int64_t kMaxVocab = 1 << 24;  // released: 154,880 tokens
constexpr int64_t kMaxWidth = 1 << 18;  // widths, ranks, head dims; released: at most 12,288
constexpr int64_t kMaxPatch = 1024;     // vision channels, patch and merge sizes; released: <= 14
constexpr int64_t kMaxStreams = 64;     // hc_mult residual streams; released: 4

// Reads typed fields from one JSON object, naming `<source>: <section>.<field>` in every error, and
// remembers which keys it knows so that --set can reject typos.
class FieldReader {
 public:
  FieldReader(const Json& object, std::string source, std::string section)
      : object_(object), source_(std::move(source)), section_(std::move(section)) {}

  std::string path(const std::string& key) const {
    return section_.empty() ? key : section_ + "." + key;
  }
  [[noreturn]] void fail(const std::string& key, const std::string& what,
                         const std::string& fix) const {
    throw Error(what, source_ + ": " + path(key), fix);
  }
  bool has(const std::string& key) const {
    return object_.contains(key) && !object_.at(key).is_null();
  }
  const Json* get(const std::string& key) const {
    return object_.contains(key) ? &object_.at(key) : nullptr;
  }

  void integer(const std::string& key, int64_t& out, int64_t min_value = 0,
               int64_t max_value = std::numeric_limits<int64_t>::max()) const {
    const Json* v = get(key);
    if (!v || v->is_null()) return;
    if (v->is_number_float()) {
      double d = v->get<double>();
      if (std::floor(d) != d)
        fail(key, fmt::format("expected an integer, got {}", v->dump()), "write a whole number");
      // Converting a double outside int64 is undefined behaviour: refuse it before the cast.
      if (!(d >= -0x1p63 && d < 0x1p63))
        fail(key, fmt::format("{} is beyond the 64-bit integer range", v->dump()),
             fmt::format("write a whole number between {} and {}", min_value, max_value));
      out = int64_t(d);
    } else if (v->is_number_unsigned()) {
      // nlohmann keeps 2^63..2^64-1 as unsigned; get<int64_t> would wrap them to negatives.
      const uint64_t u = v->get<uint64_t>();
      if (u > uint64_t(std::numeric_limits<int64_t>::max()))
        fail(key, fmt::format("{} is beyond the 64-bit integer range", u),
             fmt::format("write a whole number between {} and {}", min_value, max_value));
      out = int64_t(u);
    } else if (v->is_number_integer()) {
      out = v->get<int64_t>();
    } else {
      fail(key, fmt::format("expected an integer, got {}", v->dump()), "write a whole number");
    }
    if (out < min_value)
      fail(key, fmt::format("must be at least {}, got {}", min_value, out),
           fmt::format("set it to a value >= {}", min_value));
    if (out > max_value)
      fail(key, fmt::format("must be at most {}, got {}", max_value, out),
           fmt::format("set it to a value <= {} (glmtune caps the sizes it allocates per layer, "
                       "head, expert or token far above the released model, so that a damaged "
                       "config is refused instead of exhausting memory)",
                       max_value));
  }
  void number(const std::string& key, double& out) const {
    const Json* v = get(key);
    if (!v || v->is_null()) return;
    if (!v->is_number())
      fail(key, fmt::format("expected a number, got {}", v->dump()), "write a number");
    out = v->get<double>();
    if (!std::isfinite(out)) fail(key, "must be finite", "write a finite number");
  }
  void boolean(const std::string& key, bool& out) const {
    const Json* v = get(key);
    if (!v || v->is_null()) return;
    if (!v->is_boolean())
      fail(key, fmt::format("expected true or false, got {}", v->dump()), "write true or false");
    out = v->get<bool>();
  }
  void string(const std::string& key, std::string& out) const {
    const Json* v = get(key);
    if (!v || v->is_null()) return;
    if (!v->is_string())
      fail(key, fmt::format("expected a string, got {}", v->dump()), "write a quoted string");
    out = v->get<std::string>();
  }
  std::vector<std::string> strings(const std::string& key) const {
    const Json& v = object_.at(key);
    if (!v.is_array())
      fail(key, fmt::format("expected a list of strings, got {}", v.dump()),
           "write a JSON list of strings");
    std::vector<std::string> out;
    for (const auto& e : v) {
      if (!e.is_string())
        fail(key, fmt::format("expected a list of strings, found {}", e.dump()),
             "write a JSON list of strings");
      out.push_back(e.get<std::string>());
    }
    return out;
  }

 private:
  const Json& object_;
  std::string source_, section_;
};

const std::set<std::string>& known_text_fields() {
  static const std::set<std::string> fields = {"vocab_size",
                                               "hidden_size",
                                               "intermediate_size",
                                               "moe_intermediate_size",
                                               "num_hidden_layers",
                                               "num_attention_heads",
                                               "num_key_value_heads",
                                               "n_shared_experts",
                                               "n_routed_experts",
                                               "num_local_experts",
                                               "routed_scaling_factor",
                                               "kv_lora_rank",
                                               "q_lora_rank",
                                               "qk_rope_head_dim",
                                               "v_head_dim",
                                               "qk_nope_head_dim",
                                               "qk_head_dim",
                                               "n_group",
                                               "topk_group",
                                               "num_experts_per_tok",
                                               "norm_topk_prob",
                                               "hidden_act",
                                               "max_position_embeddings",
                                               "initializer_range",
                                               "rms_norm_eps",
                                               "use_cache",
                                               "pad_token_id",
                                               "bos_token_id",
                                               "eos_token_id",
                                               "tie_word_embeddings",
                                               "mlp_layer_types",
                                               "attention_bias",
                                               "attention_dropout",
                                               "index_topk",
                                               "index_head_dim",
                                               "index_n_heads",
                                               "head_dim",
                                               "layer_types",
                                               "indexer_types",
                                               "swiglu_limit",
                                               "linear_head_dim",
                                               "linear_num_heads",
                                               "linear_conv_kernel_dim",
                                               "linear_lower_bound",
                                               "hc_mult",
                                               "hc_eps",
                                               "hc_sinkhorn_iters",
                                               "output_router_logits",
                                               "router_aux_loss_coef",
                                               "index_kpool",
                                               "index_kpool_always_select_tail",
                                               "linear_attn_config",
                                               "index_topk_pattern",
                                               "index_topk_freq",
                                               "index_skip_topk_offset",
                                               "num_nextn_predict_layers",
                                               "first_k_dense_replace",
                                               "dtype",
                                               "model_type",
                                               "mhc",
                                               "mla_use_nope",
                                               "moe_router_dtype",
                                               "scoring_func",
                                               "topk_method",
                                               "index_kpool_compress",
                                               "index_share_for_mtp_iteration",
                                               "indexer_rope_interleave",
                                               "kv_source_layer_ids",
                                               "index_source_layer_ids"};
  return fields;
}

const std::set<std::string>& known_vision_fields() {
  static const std::set<std::string> fields = {"depth",
                                               "hidden_size",
                                               "num_heads",
                                               "num_attention_heads",
                                               "intermediate_size",
                                               "hidden_act",
                                               "attention_bias",
                                               "attention_dropout",
                                               "in_channels",
                                               "patch_size",
                                               "temporal_patch_size",
                                               "spatial_merge_size",
                                               "out_hidden_size",
                                               "projection_intermediate_size",
                                               "rms_norm_eps",
                                               "swiglu_limit",
                                               "rope_parameters",
                                               "image_size",
                                               "initializer_range",
                                               "model_type",
                                               "dtype"};
  return fields;
}

std::vector<AttnKind> default_layer_types(int64_t layers) {
  std::vector<AttnKind> out;
  for (int64_t i = 0; i < layers; ++i) out.push_back(i % 4 == 3 ? AttnKind::dsa : AttnKind::kda);
  return out;
}
std::vector<MlpKind> default_mlp_types(int64_t layers) {
  std::vector<MlpKind> out;
  for (int64_t i = 0; i < layers; ++i) out.push_back(i < 3 ? MlpKind::dense : MlpKind::sparse);
  return out;
}

Json schedule_json(const std::vector<AttnKind>& v) {
  Json out = Json::array();
  for (auto k : v) out.push_back(std::string(to_string(k)));
  return out;
}
Json schedule_json(const std::vector<MlpKind>& v) {
  Json out = Json::array();
  for (auto k : v) out.push_back(std::string(to_string(k)));
  return out;
}
Json schedule_json(const std::vector<IndexerKind>& v) {
  Json out = Json::array();
  for (auto k : v) out.push_back(std::string(to_string(k)));
  return out;
}

TextConfig parse_text(const Json& t, const std::string& source, const std::string& section) {
  if (!t.is_object())
    throw Error("expected a JSON object", source + ": " + (section.empty() ? "<root>" : section),
                "text_config must be an object of model fields");
  FieldReader r(t, source, section);
  TextConfig c;
  r.integer("vocab_size", c.vocab_size, 1, kMaxVocab);
  r.integer("hidden_size", c.hidden_size, 1, kMaxWidth);
  r.integer("intermediate_size", c.intermediate_size, 1, kMaxWidth);
  r.integer("moe_intermediate_size", c.moe_intermediate_size, 1, kMaxWidth);
  r.integer("num_hidden_layers", c.num_hidden_layers, 1, kMaxLayers);
  r.integer("num_attention_heads", c.num_attention_heads, 1, kMaxHeads);
  c.num_key_value_heads = c.num_attention_heads;
  r.integer("num_key_value_heads", c.num_key_value_heads, 1, kMaxHeads);
  r.integer("n_shared_experts", c.n_shared_experts, 0, kMaxExperts);
  r.integer("num_local_experts", c.n_routed_experts, 1, kMaxExperts);
  r.integer("n_routed_experts", c.n_routed_experts, 1, kMaxExperts);
  r.number("routed_scaling_factor", c.routed_scaling_factor);
  r.integer("kv_lora_rank", c.kv_lora_rank, 1, kMaxWidth);
  if (r.get("q_lora_rank") && r.get("q_lora_rank")->is_null())
    r.fail("q_lora_rank", "must not be null: GLM-5.3 always uses the low-rank query path",
           "set q_lora_rank to an integer (1536 in the release)");
  r.integer("q_lora_rank", c.q_lora_rank, 1, kMaxWidth);
  r.integer("qk_rope_head_dim", c.qk_rope_head_dim, std::numeric_limits<int64_t>::min());
  r.integer("v_head_dim", c.v_head_dim, 1, kMaxWidth);
  r.integer("qk_nope_head_dim", c.qk_nope_head_dim, 1, kMaxWidth);
  r.integer("n_group", c.n_group, 1);
  r.integer("topk_group", c.topk_group, 1);
  r.integer("num_experts_per_tok", c.num_experts_per_tok, 1);
  r.boolean("norm_topk_prob", c.norm_topk_prob);
  r.string("hidden_act", c.hidden_act);
  r.number("initializer_range", c.initializer_range);
  r.number("rms_norm_eps", c.rms_norm_eps);
  r.integer("pad_token_id", c.pad_token_id, 0);
  r.boolean("tie_word_embeddings", c.tie_word_embeddings);
  r.boolean("attention_bias", c.attention_bias);
  r.number("attention_dropout", c.attention_dropout);
  r.integer("index_topk", c.index_topk, 1);
  r.integer("index_head_dim", c.index_head_dim, 1, kMaxWidth);
  r.integer("index_n_heads", c.index_n_heads, 1, kMaxHeads);
  r.integer("index_kpool", c.index_kpool, std::numeric_limits<int64_t>::min());
  r.boolean("index_kpool_always_select_tail", c.index_kpool_always_select_tail);
  r.number("swiglu_limit", c.swiglu_limit);
  r.integer("linear_head_dim", c.linear_head_dim, 1, kMaxWidth);
  r.integer("linear_num_heads", c.linear_num_heads, 1, kMaxHeads);
  r.integer("linear_conv_kernel_dim", c.linear_conv_kernel_dim, 1, kMaxWidth);
  if (r.get("linear_lower_bound")) {
    if (r.get("linear_lower_bound")->is_null()) {
      c.linear_lower_bound.reset();
    } else {
      double lb = 0;
      r.number("linear_lower_bound", lb);
      c.linear_lower_bound = lb;
    }
  }
  r.integer("hc_mult", c.hc_mult, 1, kMaxStreams);
  r.number("hc_eps", c.hc_eps);
  r.integer("hc_sinkhorn_iters", c.hc_sinkhorn_iters, 1);
  r.boolean("output_router_logits", c.output_router_logits);
  r.number("router_aux_loss_coef", c.router_aux_loss_coef);
  r.integer("num_nextn_predict_layers", c.num_nextn_predict_layers, 0);

  const int64_t L = c.num_hidden_layers;
  // mlp_layer_types (first_k_dense_replace is deliberately not read: the reference ignores it).
  if (r.has("mlp_layer_types")) {
    for (const auto& s : r.strings("mlp_layer_types")) {
      if (s == "dense")
        c.mlp_layer_types.push_back(MlpKind::dense);
      else if (s == "sparse")
        c.mlp_layer_types.push_back(MlpKind::sparse);
      else
        r.fail("mlp_layer_types", fmt::format("unknown entry '{}'", s),
               "use \"dense\" or \"sparse\"");
    }
  } else {
    c.mlp_layer_types = default_mlp_types(L);
  }
  if (r.has("layer_types")) {
    for (const auto& s : r.strings("layer_types")) {
      if (s == "linear_attention")
        c.layer_types.push_back(AttnKind::kda);
      else if (s == "deepseek_sparse_attention" || s == "full_attention")
        c.layer_types.push_back(AttnKind::dsa);
      else
        r.fail("layer_types", fmt::format("unknown entry '{}'", s),
               "use \"linear_attention\" (KDA) or \"deepseek_sparse_attention\" (MLA + DSA)");
    }
  } else {
    c.layer_types = default_layer_types(L);
  }
  if (r.has("indexer_types")) {
    for (const auto& s : r.strings("indexer_types")) {
      if (s == "full")
        c.indexer_types.push_back(IndexerKind::full);
      else if (s == "shared")
        c.indexer_types.push_back(IndexerKind::shared);
      else
        r.fail("indexer_types", fmt::format("unknown entry '{}'", s), "use \"full\" or \"shared\"");
    }
  } else if (r.has("index_topk_pattern")) {
    const Json& p = t.at("index_topk_pattern");
    auto add = [&](const std::string& s) {
      if (s == "F" || s == "full")
        c.indexer_types.push_back(IndexerKind::full);
      else if (s == "S" || s == "shared")
        c.indexer_types.push_back(IndexerKind::shared);
      else
        r.fail("index_topk_pattern", fmt::format("unknown entry '{}'", s),
               "use 'F' (full) or 'S' (shared)");
    };
    if (p.is_string()) {
      for (char ch : p.get<std::string>()) add(std::string(1, ch));
    } else if (p.is_array()) {
      for (const auto& e : p) {
        if (!e.is_string())
          r.fail("index_topk_pattern", "entries must be strings",
                 "write \"FSF...\" or a list of \"full\"/\"shared\"");
        add(e.get<std::string>());
      }
    } else {
      r.fail("index_topk_pattern", "expected a string or a list", "write e.g. \"FFFF\"");
    }
  } else {
    int64_t freq = 1, offset = 2;
    r.integer("index_topk_freq", freq, std::numeric_limits<int64_t>::min());
    // Bounded so that `i - offset + 1` cannot overflow; every schedule of at most kMaxLayers
    // layers has an offset inside the int32 range.
    r.integer("index_skip_topk_offset", offset, std::numeric_limits<int32_t>::min(),
              std::numeric_limits<int32_t>::max());
    freq = std::max<int64_t>(freq, 1);
    for (int64_t i = 0; i < L; ++i)
      c.indexer_types.push_back(std::max<int64_t>(i - offset + 1, 0) % freq == 0
                                    ? IndexerKind::full
                                    : IndexerKind::shared);
  }
  if (r.has("linear_attn_config")) {
    const Json& la = t.at("linear_attn_config");
    if (!la.is_object()) r.fail("linear_attn_config", "expected an object", "write a JSON object");
    FieldReader lr(la, source, r.path("linear_attn_config"));
    lr.integer("head_dim", c.linear_head_dim, 1, kMaxWidth);
    lr.integer("num_heads", c.linear_num_heads, 1, kMaxHeads);
    lr.integer("short_conv_kernel_size", c.linear_conv_kernel_dim, 1, kMaxWidth);
    if (lr.get("gate_lower_bound")) {
      if (lr.get("gate_lower_bound")->is_null()) {
        c.linear_lower_bound.reset();
      } else {
        double lb = 0;
        lr.number("gate_lower_bound", lb);
        c.linear_lower_bound = lb;
      }
    }
    bool safe_gate = true;
    lr.boolean("safe_gate", safe_gate);
    if (safe_gate && !c.linear_lower_bound) c.linear_lower_bound = -5.0;
  }

  // Validation: the reference's rules first, then what glmtune needs to run the model.
  auto need_length = [&](const char* key, size_t n, bool at_least) {
    if (at_least ? n < size_t(L) : n != size_t(L))
      r.fail(key, fmt::format("has {} entries but num_hidden_layers is {}", n, L),
             fmt::format("give {} one entry per decoder layer, or remove it to derive the default",
                         key));
  };
  need_length("layer_types", c.layer_types.size(), false);
  need_length("mlp_layer_types", c.mlp_layer_types.size(), false);
  need_length("indexer_types", c.indexer_types.size(), true);
  c.indexer_types.resize(size_t(L));
  if (c.num_key_value_heads != c.num_attention_heads)
    r.fail("num_key_value_heads",
           fmt::format("must equal num_attention_heads ({}), got {}", c.num_attention_heads,
                       c.num_key_value_heads),
           "GLM-5.3 MLA has no grouped KV heads: set num_key_value_heads to num_attention_heads");
  if (c.index_kpool < 1)
    r.fail("index_kpool", fmt::format("must be at least 1, got {}", c.index_kpool),
           "set index_kpool >= 1 (4 in the release)");
  if (c.index_topk % c.index_kpool != 0)
    r.fail("index_topk",
           fmt::format("index_topk ({}) is not divisible by index_kpool ({})", c.index_topk,
                       c.index_kpool),
           "choose index_topk as a multiple of index_kpool");
  if (c.qk_rope_head_dim != 0)
    r.fail("qk_rope_head_dim",
           fmt::format("must be 0 (GLM-5.3 attention uses no RoPE), got {}", c.qk_rope_head_dim),
           "set qk_rope_head_dim to 0");
  if (c.hidden_act != "silu")
    r.fail("hidden_act", fmt::format("unsupported activation '{}'", c.hidden_act),
           "GLM-5.3 uses \"silu\"");
  if (c.n_routed_experts % c.n_group != 0)
    r.fail("n_group",
           fmt::format("n_routed_experts ({}) is not divisible by n_group ({})", c.n_routed_experts,
                       c.n_group),
           "choose n_group dividing n_routed_experts");
  if (c.topk_group > c.n_group)
    r.fail("topk_group",
           fmt::format("topk_group ({}) exceeds n_group ({})", c.topk_group, c.n_group),
           "set topk_group <= n_group");
  if (c.num_experts_per_tok > c.topk_group * (c.n_routed_experts / c.n_group))
    r.fail("num_experts_per_tok",
           fmt::format("{} experts per token cannot be chosen from {} groups of {} experts",
                       c.num_experts_per_tok, c.topk_group, c.n_routed_experts / c.n_group),
           "lower num_experts_per_tok or raise topk_group / n_routed_experts");
  if (c.pad_token_id >= c.vocab_size)
    r.fail("pad_token_id",
           fmt::format("{} is outside the vocabulary of {}", c.pad_token_id, c.vocab_size),
           "set pad_token_id below vocab_size");
  if (c.num_nextn_predict_layers > 1)
    r.fail("num_nextn_predict_layers",
           fmt::format("glmtune supports one MTP layer, got {}", c.num_nextn_predict_layers),
           "set num_nextn_predict_layers to 0 or 1");
  if (c.rms_norm_eps <= 0)
    r.fail("rms_norm_eps", "must be positive", "set rms_norm_eps (1e-5 in the release)");
  if (c.hc_eps <= 0) r.fail("hc_eps", "must be positive", "set hc_eps (1e-6 in the release)");
  // A "shared" DSA layer reuses the indices of the layer right before it, which therefore must be
  // a DSA layer with its own indexer (the reference raises otherwise, mid-forward).
  for (int64_t i = 0; i < L; ++i) {
    if (c.layer_types[i] != AttnKind::dsa || c.indexer_types[i] != IndexerKind::shared) continue;
    if (i == 0 || c.layer_types[i - 1] != AttnKind::dsa ||
        c.indexer_types[i - 1] != IndexerKind::full)
      r.fail("indexer_types",
             fmt::format("layer {} is a \"shared\" DSA layer but layer {} is not a DSA layer with "
                         "a \"full\" indexer",
                         i, i - 1),
             "a shared indexer reuses the previous layer's selection: make the previous layer a "
             "full DSA layer, or mark this one \"full\"");
  }
  return c;
}

VisionConfig parse_vision(const Json& v, const std::string& source, int64_t text_hidden) {
  if (!v.is_object())
    throw Error("expected a JSON object", source + ": vision_config",
                "vision_config must be an object");
  FieldReader r(v, source, "vision_config");
  VisionConfig c;
  r.integer("depth", c.depth, 0, kMaxLayers);
  r.integer("hidden_size", c.hidden_size, 1, kMaxWidth);
  r.integer("num_attention_heads", c.num_heads, 1, kMaxHeads);
  r.integer("num_heads", c.num_heads, 1, kMaxHeads);
  r.integer("intermediate_size", c.intermediate_size, 1, kMaxWidth);
  r.string("hidden_act", c.hidden_act);
  r.boolean("attention_bias", c.attention_bias);
  r.number("attention_dropout", c.attention_dropout);
  r.integer("in_channels", c.in_channels, 1, kMaxPatch);
  r.integer("patch_size", c.patch_size, 1, kMaxPatch);
  r.integer("temporal_patch_size", c.temporal_patch_size, 1, kMaxPatch);
  r.integer("spatial_merge_size", c.spatial_merge_size, 1, kMaxPatch);
  r.integer("out_hidden_size", c.out_hidden_size, 1, kMaxWidth);
  r.integer("projection_intermediate_size", c.projection_intermediate_size, 1, kMaxWidth);
  r.number("rms_norm_eps", c.rms_norm_eps);
  r.number("swiglu_limit", c.swiglu_limit);
  r.integer("image_size", c.image_size, 1, kMaxWidth);
  r.number("initializer_range", c.initializer_range);
  if (r.has("rope_parameters")) {
    const Json& rp = v.at("rope_parameters");
    if (!rp.is_object())
      r.fail("rope_parameters", "expected an object",
             "write {\"rope_type\": \"axial\", \"rope_theta\": 10000.0}");
    FieldReader rr(rp, source, "vision_config.rope_parameters");
    std::string type = "axial";
    rr.string("rope_type", type);
    if (type != "axial")
      rr.fail("rope_type", fmt::format("unsupported rope type '{}'", type),
              "the GLM-5.3 vision tower uses \"axial\"");
    rr.number("rope_theta", c.rope_theta);
  }
  if (c.hidden_size % c.num_heads != 0)
    r.fail("hidden_size",
           fmt::format("{} is not divisible by num_heads ({})", c.hidden_size, c.num_heads),
           "choose hidden_size as a multiple of num_heads");
  if (c.head_dim() % 4 != 0)
    r.fail("num_heads",
           fmt::format("head dim {} must be a multiple of 4 for the 2-D rotary embedding",
                       c.head_dim()),
           "change hidden_size or num_heads");
  if (c.out_hidden_size != text_hidden)
    r.fail("out_hidden_size",
           fmt::format("must equal text_config.hidden_size ({}), got {}", text_hidden,
                       c.out_hidden_size),
           "the projector writes visual features into text embedding rows: set out_hidden_size to "
           "the text width");
  if (c.hidden_act != "silu")
    r.fail("hidden_act", fmt::format("unsupported activation '{}'", c.hidden_act),
           "GLM-5.3 uses \"silu\"");
  return c;
}

std::vector<std::string> split_dotted(const std::string& key) {
  std::vector<std::string> parts;
  std::stringstream ss(key);
  std::string part;
  while (std::getline(ss, part, '.')) parts.push_back(part);
  return parts;
}

}  // namespace

std::string_view to_string(AttnKind kind) {
  return kind == AttnKind::kda ? "linear_attention" : "deepseek_sparse_attention";
}
std::string_view to_string(MlpKind kind) { return kind == MlpKind::dense ? "dense" : "sparse"; }
std::string_view to_string(IndexerKind kind) {
  return kind == IndexerKind::full ? "full" : "shared";
}

int64_t TextConfig::count(AttnKind kind) const {
  return std::count(layer_types.begin(), layer_types.end(), kind);
}
int64_t TextConfig::count(MlpKind kind) const {
  return std::count(mlp_layer_types.begin(), mlp_layer_types.end(), kind);
}

ModelConfig ModelConfig::from_file(const std::string& path) {
  std::string text = read_text_file(path, "config");
  Json doc;
  try {
    doc = Json::parse(text);
  } catch (const Json::parse_error& e) {
    throw Error(fmt::format("not valid JSON: {}", e.what()), path,
                "fix the JSON syntax (a trailing comma or missing quote?)");
  } catch (const Json::exception& e) {
    // out_of_range: a number no double holds (1e999); nothing else of nlohmann may escape either.
    throw Error(fmt::format("unreadable JSON: {}", e.what()), path,
                "write every number within the range of a double (about 1.8e308)");
  }
  return from_json(doc, path);
}

ModelConfig ModelConfig::from_json(const Json& document, const std::string& source) {
  ModelConfig c;
  c.document_ = document;
  c.source_ = source;
  c.parse();
  return c;
}

void ModelConfig::parse() {
  if (!document_.is_object())
    throw Error("the config must be a JSON object", source_, "write a config.json object");
  if (document_.contains("model_type") && document_["model_type"].is_string()) {
    std::string mt = document_["model_type"];
    if (mt != "glm5_next" && mt != "glm5_next_text")
      throw Error(fmt::format("model_type is '{}', not a GLM-5.3-Flash model (glm5_next)", mt),
                  source_ + ": model_type",
                  "point glmtune at a GLM-5.3-Flash (glm5_next) checkpoint");
  }
  flat_ = !document_.contains("text_config");
  text_ =
      parse_text(flat_ ? document_ : document_["text_config"], source_, flat_ ? "" : "text_config");
  vision_.reset();
  if (!flat_ && document_.contains("vision_config") && !document_["vision_config"].is_null())
    vision_ = parse_vision(document_["vision_config"], source_, text_.hidden_size);
  FieldReader top(document_, source_, "");
  top.integer("image_token_id", media_.image_token_id);
  top.integer("video_token_id", media_.video_token_id);
  top.integer("image_start_token_id", media_.image_start_token_id);
  top.integer("image_end_token_id", media_.image_end_token_id);
  top.integer("video_start_token_id", media_.video_start_token_id);
  top.integer("video_end_token_id", media_.video_end_token_id);
  // Media ids outside the vocabulary are accepted here: transformers writes its released media ids
  // into configs of any vocabulary size and runs them on text. They only matter once an image or a
  // video is spliced in (require_media_tokens).
}

void ModelConfig::require_media_tokens(const std::string& where) const {
  for (auto [key, id] : {std::pair{"image_token_id", media_.image_token_id},
                         {"video_token_id", media_.video_token_id},
                         {"image_start_token_id", media_.image_start_token_id},
                         {"image_end_token_id", media_.image_end_token_id},
                         {"video_start_token_id", media_.video_start_token_id},
                         {"video_end_token_id", media_.video_end_token_id}})
    if (id >= text_.vocab_size)
      throw Error(fmt::format("{}: {} {} is outside the vocabulary of {} tokens (vocab_size), so "
                              "images and videos cannot be placed in the text; text alone runs "
                              "with this config",
                              where, key, id, text_.vocab_size),
                  source_ + ": " + key,
                  fmt::format("set \"{}\" in config.json to the tokenizer's id of that token "
                              "(the ids of the processor's tokenizer.json), below {}",
                              key, text_.vocab_size));
}

Json ModelConfig::to_json_with_schedules() const {
  Json doc = document_;
  Json& t = flat_ ? doc : doc["text_config"];
  t["layer_types"] = schedule_json(text_.layer_types);
  t["mlp_layer_types"] = schedule_json(text_.mlp_layer_types);
  t["indexer_types"] = schedule_json(text_.indexer_types);
  return doc;
}

void ModelConfig::set(const std::string& dotted_key, const std::string& value) {
  set_all({{dotted_key, value}});
}

void ModelConfig::set_all(const std::vector<std::pair<std::string, std::string>>& overrides) {
  // Edits a copy and validates once at the end, so that overrides which only make sense together
  // (e.g. text hidden_size and vision out_hidden_size) are accepted, and a failure leaves this
  // config unchanged.
  ModelConfig next = *this;
  bool layers_change = false;
  for (const auto& [dotted_key, value] : overrides) layers_change |= next.edit(dotted_key, value);
  next.parse();
  if (layers_change) next.sync_schedule_copies();
  *this = std::move(next);
}

bool ModelConfig::edit(const std::string& dotted_key, const std::string& value) {
  auto parts = split_dotted(dotted_key);
  const std::string where = "--set " + dotted_key;
  if (parts.empty() || std::any_of(parts.begin(), parts.end(), [](auto& p) { return p.empty(); }))
    throw Error("empty key", where,
                "write --set section.field=value, e.g. text_config.n_routed_experts=36");
  Json parsed;
  try {
    parsed = Json::parse(value);
  } catch (const Json::parse_error&) {
    parsed = value;
  } catch (const Json::exception& e) {
    // Valid JSON syntax that nlohmann cannot hold, e.g. 1e999: taking it as a string would hide it.
    throw Error(fmt::format("the value '{}' cannot be read: {}", value, e.what()), where,
                "write a number within the range of a double (about 1.8e308)");
  }
  // Flat text-only configs have no text_config section: accept the nested spelling for them too.
  if (flat_ && parts.size() > 1 && parts[0] == "text_config") parts.erase(parts.begin());
  // Validate the field name against the schema so that a typo is not silently written.
  const std::string section = parts.size() > 1 ? parts[0] : "";
  const std::string& field = parts.size() > 1 ? parts[1] : parts[0];
  bool known = true;
  if (section == "text_config" || (flat_ && parts.size() == 1))
    known = known_text_fields().count(field) > 0;
  else if (section == "vision_config")
    known = known_vision_fields().count(field) > 0;
  Json* node = &document_;
  for (size_t i = 0; i + 1 < parts.size(); ++i) {
    if (!node->is_object())
      throw Error(fmt::format("'{}' is not an object", parts[i]), where, "check the key path");
    if (!node->contains(parts[i])) {
      if (parts[i] == "text_config" || parts[i] == "vision_config")
        throw Error(fmt::format("this config has no {}", parts[i]), where,
                    parts[i] == "text_config"
                        ? "this is a flat text-only config: drop the 'text_config.' prefix"
                        : "this config has no vision tower");
      (*node)[parts[i]] = Json::object();
    }
    node = &(*node)[parts[i]];
  }
  if (parts.size() > 1 && !node->is_object() && !node->is_null())
    throw Error(fmt::format("'{}' is not an object", parts[parts.size() - 2]), where,
                "check the key path");
  if (!known && !node->contains(parts.back()))
    throw Error(
        fmt::format("unknown field '{}'", parts.back()), where,
        "check the spelling against the released config.json (e.g. text_config.n_routed_experts)");
  // Changing the layer count re-derives schedules that were the default derivation of the old
  // count.
  Json& text = flat_ ? document_ : document_["text_config"];
  const bool layers_change = parts.back() == "num_hidden_layers" && &text == node;
  std::optional<int64_t> old_layers;
  if (layers_change) old_layers = text_.num_hidden_layers;
  (*node)[parts.back()] = parsed;
  if (layers_change && parsed.is_number_integer()) {
    const int64_t L = *old_layers;
    if (text.contains("layer_types") &&
        text["layer_types"] == schedule_json(default_layer_types(L)))
      text.erase("layer_types");
    if (text.contains("mlp_layer_types") &&
        text["mlp_layer_types"] == schedule_json(default_mlp_types(L)))
      text.erase("mlp_layer_types");
    if (text.contains("indexer_types") &&
        text["indexer_types"] == schedule_json(std::vector<IndexerKind>(L, IndexerKind::full)))
      text.erase("indexer_types");
  }
  return layers_change;
}

void ModelConfig::sync_schedule_copies() {
  // Keep the informational copies of the schedule consistent with the new layer count.
  Json& text = flat_ ? document_ : document_["text_config"];
  if (text.contains("first_k_dense_replace"))
    text["first_k_dense_replace"] = text_.count(MlpKind::dense);
  if (text.contains("linear_attn_config") && text["linear_attn_config"].is_object()) {
    Json kda = Json::array(), full = Json::array();
    for (int64_t i = 0; i < text_.num_hidden_layers; ++i)
      (text_.layer_types[i] == AttnKind::kda ? kda : full).push_back(i);
    auto& la = text["linear_attn_config"];
    if (la.contains("kda_layers")) la["kda_layers"] = kda;
    if (la.contains("full_attn_layers")) la["full_attn_layers"] = full;
  }
}

void ModelConfig::save(const std::string& path, bool with_schedules) const {
  const Json doc = with_schedules ? to_json_with_schedules() : document_;
  write_file_atomic(path, doc.dump(2) + "\n");
}

}  // namespace glmtune::model

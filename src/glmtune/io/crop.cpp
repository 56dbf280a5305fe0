#include "glmtune/io/crop.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <set>

#include "glmtune/base/error.h"
#include "glmtune/base/progress.h"
#include "glmtune/io/fp8.h"

namespace glmtune::io {
namespace fs = std::filesystem;
using ojson = nlohmann::ordered_json;

namespace {

constexpr std::string_view kScaleSuffix = "_scale_inv";
constexpr std::string_view kLayerPrefixes[] = {"model.language_model.layers.", "model.layers."};

bool is_vision(std::string_view name) {
  return name.starts_with("model.visual.") || name.starts_with("visual.");
}

std::string quote(std::string_view s) { return "\"" + std::string(s) + "\""; }

std::string trim(std::string_view s) {
  size_t b = 0, e = s.size();
  while (b < e && (s[b] == ' ' || s[b] == '\t')) ++b;
  while (e > b && (s[e - 1] == ' ' || s[e - 1] == '\t')) --e;
  return std::string(s.substr(b, e - b));
}

// A non-negative decimal without sign or leading zeros, or nullopt.
std::optional<int64_t> parse_index(std::string_view s) {
  if (s.empty() || s.size() > 12) return std::nullopt;
  if (s.size() > 1 && s[0] == '0') return std::nullopt;
  int64_t v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return std::nullopt;
    v = v * 10 + (c - '0');
  }
  return v;
}

std::string layer_ranges(const std::vector<int64_t>& layers) {
  std::string out;
  for (size_t i = 0; i < layers.size();) {
    size_t j = i;
    while (j + 1 < layers.size() && layers[j + 1] == layers[j] + 1) ++j;
    if (!out.empty()) out += ",";
    out += j == i ? std::to_string(layers[i])
                  : std::to_string(layers[i]) + "-" + std::to_string(layers[j]);
    i = j + 1;
  }
  return out;
}

int64_t require_int(const ojson& obj, const std::string& key, const std::string& where,
                    std::optional<int64_t> fallback = std::nullopt) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) {
    if (fallback) return *fallback;
    throw Error("config has no " + quote(key), where, "point at the checkpoint's own config.json");
  }
  if (!it->is_number_integer() || it->get<int64_t>() < 0)
    throw Error(quote(key) + " is not a non-negative integer: " + it->dump(), where);
  return it->get<int64_t>();
}

// The text part of a config: `text_config` of the multimodal config, or the config itself.
const ojson& text_part(const ojson& config) {
  auto it = config.find("text_config");
  return it != config.end() && it->is_object() ? *it : config;
}
ojson& text_part(ojson& config) {
  auto it = config.find("text_config");
  return it != config.end() && it->is_object() ? *it : config;
}

// Per-layer defaults of transformers' Glm5NextTextConfig, used when a schedule is absent from the
// config and the crop is not a prefix (then the defaults of the smaller model would be wrong).
std::string derived_layer_type(int64_t i) {
  return i % 4 == 3 ? "deepseek_sparse_attention" : "linear_attention";
}
std::string derived_mlp_type(int64_t i, int64_t num_layers) {
  return i < std::min<int64_t>(3, num_layers) ? "dense" : "sparse";
}
// indexer_types: from `index_topk_pattern` ('F' full, 'S' shared, or a list), else every
// `index_topk_freq`-th layer from `index_skip_topk_offset` is "full".
std::string derived_indexer_type(const ojson& text, int64_t i, const std::string& where) {
  if (auto p = text.find("index_topk_pattern"); p != text.end() && !p->is_null()) {
    if (p->is_string()) {
      const std::string& s = p->get_ref<const std::string&>();
      if (i >= int64_t(s.size()) || (s[size_t(i)] != 'F' && s[size_t(i)] != 'S'))
        throw Error("index_topk_pattern has no 'F'/'S' entry for layer " + std::to_string(i),
                    where);
      return s[size_t(i)] == 'F' ? "full" : "shared";
    }
    if (p->is_array() && i < int64_t(p->size()) && (*p)[size_t(i)].is_string())
      return (*p)[size_t(i)].get<std::string>();
    throw Error("index_topk_pattern has no entry for layer " + std::to_string(i), where);
  }
  int64_t freq = std::max<int64_t>(text.value("index_topk_freq", int64_t(1)), 1);
  int64_t offset = text.value("index_skip_topk_offset", int64_t(2));
  return std::max<int64_t>(i - offset + 1, 0) % freq == 0 ? "full" : "shared";
}

}  // namespace

std::optional<LayerName> parse_layer_name(std::string_view name) {
  for (std::string_view prefix : kLayerPrefixes) {
    if (!name.starts_with(prefix)) continue;
    std::string_view rest = name.substr(prefix.size());
    size_t dot = rest.find('.');
    if (dot == std::string_view::npos || dot + 1 >= rest.size()) return std::nullopt;
    auto index = parse_index(rest.substr(0, dot));
    if (!index) return std::nullopt;
    return LayerName{std::string(prefix), *index, std::string(rest.substr(dot + 1))};
  }
  return std::nullopt;
}

std::vector<int64_t> parse_layer_list(std::string_view text) {
  const std::string where = "--layers " + std::string(text);
  const std::string fix = "write layers as indices and ranges, e.g. 0-4 or 0,1,2,7-9";
  std::vector<int64_t> out;
  std::set<int64_t> seen;
  size_t start = 0;
  if (trim(text).empty()) throw Error("no layers given", where, fix);
  while (start <= text.size()) {
    size_t comma = text.find(',', start);
    std::string item = trim(text.substr(
        start, comma == std::string_view::npos ? std::string_view::npos : comma - start));
    if (item.empty()) throw Error("empty item in the layer list", where, fix);
    int64_t lo, hi;
    size_t dash = item.find('-', 1);
    if (dash == std::string::npos) {
      auto v = parse_index(item);
      if (!v) throw Error(quote(item) + " is not a layer index", where, fix);
      lo = hi = *v;
    } else {
      auto a = parse_index(trim(item.substr(0, dash)));
      auto b = parse_index(trim(item.substr(dash + 1)));
      if (!a || !b) throw Error(quote(item) + " is not a layer range", where, fix);
      if (*a > *b)
        throw Error("range " + quote(item) + " runs backwards", where,
                    "write it as " + std::to_string(*b) + "-" + std::to_string(*a));
      lo = *a;
      hi = *b;
    }
    for (int64_t l = lo; l <= hi; ++l) {
      if (!seen.insert(l).second)
        throw Error("layer " + std::to_string(l) + " is listed twice", where, fix);
      out.push_back(l);
    }
    if (comma == std::string_view::npos) break;
    start = comma + 1;
  }
  std::sort(out.begin(), out.end());
  return out;
}

ojson rewrite_crop_config(const ojson& config, const std::vector<int64_t>& kept_layers,
                          int64_t mtp_layers, bool dequantized) {
  ojson out = config;
  ojson& text = text_part(out);
  const std::string scope = &text == &out ? "" : "text_config.";
  const std::string where = "config.json";
  const int64_t L = require_int(text, "num_hidden_layers", where);
  const int64_t n = int64_t(kept_layers.size());

  // Old layer id -> new layer id, for kept decoder layers and kept MTP layers.
  std::map<int64_t, int64_t> renumber;
  bool prefix = true;
  for (int64_t i = 0; i < n; ++i) {
    GLMTUNE_ASSERT(kept_layers[size_t(i)] < L, "layer {} of {}", kept_layers[size_t(i)], L);
    renumber[kept_layers[size_t(i)]] = i;
    prefix = prefix && kept_layers[size_t(i)] == i;
  }
  for (int64_t j = 0; j < mtp_layers; ++j) renumber[L + j] = n + j;

  // Per-layer schedules (one entry per decoder layer): keep the kept layers' entries, in order.
  auto cut = [&](const std::string& key, auto derive) {
    auto it = text.find(key);
    if (it != text.end() && !it->is_null()) {
      if (!it->is_array() || int64_t(it->size()) != L)
        throw Error(scope + key + " has " + (it->is_array() ? std::to_string(it->size()) : "no") +
                        " entries but num_hidden_layers is " + std::to_string(L),
                    where, "fix the source config: one entry per decoder layer");
      ojson kept = ojson::array();
      for (int64_t l : kept_layers) kept.push_back((*it)[size_t(l)]);
      *it = std::move(kept);
    } else if (!prefix) {
      // Absent: the model derives it from layer indices, which renumbering changes; write the
      // original layers' values explicitly.
      ojson kept = ojson::array();
      for (int64_t l : kept_layers) kept.push_back(derive(l));
      text[key] = std::move(kept);
    }
  };
  const ojson original_text = text;
  cut("layer_types", [](int64_t l) { return derived_layer_type(l); });
  const bool explicit_mlp = text.contains("mlp_layer_types") && !text["mlp_layer_types"].is_null();
  cut("mlp_layer_types", [&](int64_t l) { return derived_mlp_type(l, L); });
  cut("indexer_types", [&](int64_t l) { return derived_indexer_type(original_text, l, where); });

  // Lists of layer ids: keep the kept layers' ids, renumbered.
  auto remap_ids = [&](ojson& parent, const std::string& key, const std::string& path) {
    auto it = parent.find(key);
    if (it == parent.end() || it->is_null()) return;
    if (!it->is_array()) throw Error(path + " is not a list of layer ids", where);
    ojson kept = ojson::array();
    for (const auto& v : *it) {
      if (!v.is_number_integer()) throw Error(path + " holds a non-integer: " + v.dump(), where);
      auto r = renumber.find(v.get<int64_t>());
      if (r != renumber.end()) kept.push_back(r->second);
    }
    *it = std::move(kept);
  };
  if (auto la = text.find("linear_attn_config"); la != text.end() && la->is_object()) {
    remap_ids(*la, "kda_layers", scope + "linear_attn_config.kda_layers");
    remap_ids(*la, "full_attn_layers", scope + "linear_attn_config.full_attn_layers");
  }
  remap_ids(text, "kv_source_layer_ids", scope + "kv_source_layer_ids");
  remap_ids(text, "index_source_layer_ids", scope + "index_source_layer_ids");

  if (auto fk = text.find("first_k_dense_replace"); fk != text.end() && fk->is_number_integer()) {
    int64_t dense = 0;
    if (explicit_mlp || !prefix) {
      for (const auto& t : text["mlp_layer_types"]) {
        if (t != "dense") break;
        ++dense;
      }
    } else {
      const int64_t old = fk->get<int64_t>();
      for (int64_t l : kept_layers) dense += l < old ? 1 : 0;
    }
    *fk = dense;
  }

  if (auto types = text.find("indexer_types"); types != text.end() && types->is_array() && !prefix)
    for (size_t i = 0; i < types->size(); ++i)
      if ((*types)[i] == "shared" && (i == 0 || kept_layers[i] != kept_layers[i - 1] + 1))
        spdlog::warn(
            "kept layer {} (now {}) shares the indexer of the layer before it, which is "
            "no longer its neighbour",
            kept_layers[i], i);

  text["num_hidden_layers"] = n;
  text["num_nextn_predict_layers"] = mtp_layers;

  for (ojson* obj : {&out, &text}) {
    auto q = obj->find("quantization_config");
    if (q == obj->end()) continue;
    if (dequantized) {
      obj->erase(q);
      continue;
    }
    // Kept FP8: the list of unquantised modules names layers, which move with the renumbering.
    auto m = q->find("modules_to_not_convert");
    if (m == q->end() || !m->is_array()) continue;
    std::vector<std::string> names;
    for (const auto& v : *m) {
      if (!v.is_string()) continue;
      std::string s = v.get<std::string>();
      if (auto ln = parse_layer_name(s)) {
        auto r = renumber.find(ln->layer);
        if (r == renumber.end()) continue;
        s = ln->prefix + std::to_string(r->second) + "." + ln->rest;
      }
      names.push_back(std::move(s));
    }
    // The release writes this list sorted (Python string order, i.e. code point order).
    std::sort(names.begin(), names.end());
    names.erase(std::unique(names.begin(), names.end()), names.end());
    *m = names;
  }
  return out;
}

CropPlan plan_crop(const fs::path& source, const fs::path& output, const CropOptions& options) {
  CropPlan plan;
  plan.source = source;
  plan.output = output;
  plan.vision = options.vision;
  plan.dtype = options.dtype;

  std::error_code ec;
  if (!fs::is_directory(source, ec))
    throw Error(fs::exists(source, ec) ? "is not a checkpoint directory" : "checkpoint not found",
                source.string(), "point at the directory holding config.json and the shards");
  if (fs::exists(output, ec)) {
    if (fs::equivalent(source, output, ec))
      throw Error("the output is the source checkpoint", output.string(), "choose another --out");
    if (!fs::is_directory(output, ec))
      throw Error("output exists and is not a directory", output.string(), "choose another --out");
    if (!fs::is_empty(output, ec) && !options.overwrite)
      throw Error(
          "output directory is not empty", output.string(),
          "choose a new --out, or pass --overwrite to replace it (atomically, when the crop "
          "is complete)");
  }
  if (options.max_shard_bytes == 0) throw Error("shard size must be positive", "--max-shard-size");
  if (options.layers.empty()) throw Error("no layers to keep", "--layers");

  // The whole source is checked before any work: index, shards, headers.
  auto reader = std::make_shared<CheckpointReader>(CheckpointReader::open(source));
  reader->validate();
  plan.reader = reader;

  const fs::path config_path = source / "config.json";
  if (!fs::exists(config_path))
    throw Error("config.json not found", source.string(),
                "the crop needs the model config; copy it from the released checkpoint");
  const ojson config = parse_ordered_json_strict(read_text_file(config_path), config_path.string(),
                                                 "fix the JSON syntax of config.json");
  const ojson& text = text_part(config);
  plan.source_layers = require_int(text, "num_hidden_layers", config_path.string());
  plan.source_mtp_layers = require_int(text, "num_nextn_predict_layers", config_path.string(), 0);
  const int64_t L = plan.source_layers;

  std::vector<int64_t> layers = options.layers;
  std::sort(layers.begin(), layers.end());
  if (std::adjacent_find(layers.begin(), layers.end()) != layers.end())
    throw Error("a layer is listed twice", "--layers");
  for (int64_t l : layers)
    if (l < 0 || l >= L)
      throw Error("layer " + std::to_string(l) + " is out of range: the source has layers 0-" +
                      std::to_string(L - 1) + " (num_hidden_layers " + std::to_string(L) + ")",
                  "--layers", "choose layers between 0 and " + std::to_string(L - 1));
  plan.kept_layers = layers;
  if (options.mtp.value_or(false) && plan.source_mtp_layers == 0)
    throw Error("the source has no MTP layer (num_nextn_predict_layers is 0)", "--mtp",
                "drop --mtp, or crop a checkpoint that has the MTP layer");
  plan.mtp_layers = options.mtp.value_or(plan.source_mtp_layers > 0) ? plan.source_mtp_layers : 0;

  if (auto q = config.find("quantization_config"); q != config.end() && q->is_object()) {
    if (auto bs = q->find("weight_block_size"); bs != q->end()) {
      if (!bs->is_array() || bs->size() != 2 || !(*bs)[0].is_number_integer() ||
          !(*bs)[1].is_number_integer() || (*bs)[0].get<int64_t>() <= 0 ||
          (*bs)[1].get<int64_t>() <= 0)
        throw Error("quantization_config.weight_block_size must be [rows, cols]: " + bs->dump(),
                    config_path.string());
      plan.block_rows = (*bs)[0].get<int64_t>();
      plan.block_cols = (*bs)[1].get<int64_t>();
    }
  }

  // Old layer -> new layer for everything kept.
  std::map<int64_t, int64_t> renumber;
  for (size_t i = 0; i < layers.size(); ++i) renumber[layers[i]] = int64_t(i);
  for (int64_t j = 0; j < plan.mtp_layers; ++j) renumber[L + j] = int64_t(layers.size()) + j;

  const std::string index_where = (source / kIndexFileName).string();
  std::map<int64_t, size_t> tensors_per_layer;
  std::set<std::string> scales;
  for (const auto& name : reader->names()) {
    if (name.ends_with(kScaleSuffix)) {
      std::string base = name.substr(0, name.size() - kScaleSuffix.size());
      if (!reader->contains(base))
        throw Error("scale " + quote(name) + " has no weight " + quote(base) + " to go with",
                    index_where, "the checkpoint is incomplete; re-download it");
      scales.insert(name);
    }
    if (auto ln = parse_layer_name(name)) {
      if (ln->layer >= L + plan.source_mtp_layers)
        throw Error("tensor " + quote(name) + " belongs to layer " + std::to_string(ln->layer) +
                        ", but the config has " + std::to_string(L) + " layers and " +
                        std::to_string(plan.source_mtp_layers) + " MTP layers",
                    config_path.string(), "the config does not belong to these weights");
      ++tensors_per_layer[ln->layer];
    }
  }
  for (int64_t l : layers)
    if (!tensors_per_layer.count(l))
      throw Error("the source checkpoint has no tensors for layer " + std::to_string(l) +
                      " (its config says num_hidden_layers " + std::to_string(L) + ")",
                  source.string(), "crop layers the checkpoint has");
  for (int64_t j = 0; j < plan.mtp_layers; ++j)
    if (!tensors_per_layer.count(L + j))
      throw Error("the source checkpoint has no tensors for the MTP layer " + std::to_string(L + j),
                  source.string(), "pass --no-mtp to crop without it");

  // Decide every tensor.
  struct Ordered {
    size_t shard;
    uint64_t begin;
    CropTensor t;
  };
  std::map<std::string, size_t> shard_index;
  for (size_t i = 0; i < reader->shard_files().size(); ++i)
    shard_index[reader->shard_files()[i]] = i;
  std::vector<Ordered> kept;
  std::set<std::string> consumed;
  std::set<size_t> shards_read;
  for (const auto& name : reader->names()) {
    const TensorInfo& info = reader->info(name);
    const bool is_scale = scales.count(name) > 0;
    std::string target = name;
    bool keep = true;
    if (auto ln = parse_layer_name(name)) {
      auto r = renumber.find(ln->layer);
      keep = r != renumber.end();
      if (keep) target = ln->prefix + std::to_string(r->second) + "." + ln->rest;
    } else if (is_vision(name)) {
      keep = options.vision;
    }
    if (!keep) {
      ++plan.dropped_tensors;
      plan.dropped_bytes += info.nbytes();
      continue;
    }
    if (is_scale && options.dtype == CropDType::bf16) continue;  // consumed with its weight

    CropTensor t;
    t.source = name;
    t.target = target;
    t.source_dtype = t.target_dtype = info.dtype;
    t.shape = info.shape;
    t.read_bytes = info.nbytes();
    const std::string scale = name + std::string(kScaleSuffix);
    if (options.dtype == CropDType::bf16 && scales.count(scale)) {
      const TensorInfo& s = reader->info(scale);
      if (info.dtype != DType::fp8e4m3)
        throw Error("has a weight_scale_inv companion but is " +
                        std::string(dtype_name(info.dtype)) + ", not FP8 e4m3",
                    name, "the checkpoint is not a block-FP8 release");
      if (info.shape.size() != 2)
        throw Error("FP8 weight has shape " + shape_str(info.shape) +
                        "; block dequantisation needs [out, in]",
                    name);
      const Shape expected = fp8_scale_shape(info.shape, plan.block_rows, plan.block_cols);
      if (s.shape != expected)
        throw Error("scale " + quote(scale) + " has shape " + shape_str(s.shape) + " but a " +
                        shape_str(info.shape) + " weight in " + std::to_string(plan.block_rows) +
                        "x" + std::to_string(plan.block_cols) + " blocks needs " +
                        shape_str(expected),
                    name, "the weight and its scale do not belong together");
      if (s.dtype != DType::f32 && s.dtype != DType::bf16)
        throw Error(
            "scale " + quote(scale) + " is " + std::string(dtype_name(s.dtype)) + ", expected F32",
            name);
      t.scale = scale;
      t.target_dtype = DType::bf16;
      t.read_bytes += s.nbytes();
      consumed.insert(scale);
      shards_read.insert(shard_index.at(reader->shard_of(scale)));
    } else if (options.dtype == CropDType::bf16 && info.dtype == DType::fp8e4m3) {
      throw Error("FP8 tensor has no " + quote(scale) + " companion, so it cannot be dequantised",
                  name, "use --dtype keep to copy FP8 tensors as they are");
    }
    t.write_bytes = uint64_t(shape_numel(t.shape)) * dtype_size(t.target_dtype);
    shards_read.insert(shard_index.at(reader->shard_of(name)));
    kept.push_back({shard_index.at(reader->shard_of(name)), info.begin, std::move(t)});
  }
  // Scales of dropped weights were counted as dropped above; scales consumed by dequantisation
  // are reported on their own.
  plan.consumed_scales = consumed.size();
  plan.source_shards_read = shards_read.size();

  // Read order: shard by shard, file order within a shard, so the source is read sequentially.
  std::sort(kept.begin(), kept.end(), [](const Ordered& a, const Ordered& b) {
    return a.shard != b.shard ? a.shard < b.shard : a.begin < b.begin;
  });
  uint64_t shard_bytes = 0;
  for (auto& k : kept) {
    const uint64_t bytes = k.t.write_bytes;
    if (plan.shard_starts.empty() ||
        (shard_bytes > 0 && shard_bytes + bytes > options.max_shard_bytes)) {
      plan.shard_starts.push_back(plan.tensors.size());
      shard_bytes = 0;
    }
    shard_bytes += bytes;
    plan.output_bytes += bytes;
    plan.output_parameters += uint64_t(shape_numel(k.t.shape));
    plan.max_tensor_bytes = std::max(plan.max_tensor_bytes, bytes);
    plan.tensors.push_back(std::move(k.t));
  }
  if (plan.tensors.empty()) throw Error("the crop would keep no tensors", source.string());

  plan.config =
      rewrite_crop_config(config, layers, plan.mtp_layers, options.dtype == CropDType::bf16);

  // Everything else in the directory that is not weights travels along: tokenizer, chat
  // template, processor and generation configs, license, README.
  for (const auto& entry : fs::directory_iterator(source)) {
    if (!entry.is_regular_file()) continue;
    const std::string name = entry.path().filename().string();
    // The source's checksums describe its shards; the crop's writer records its own.
    if (name.starts_with(".") || name == "config.json" || name == kChecksumsFileName ||
        name.ends_with(".safetensors") || name.ends_with(".index.json") || name.ends_with(".bin") ||
        name.ends_with(".pt") || name.ends_with(".pth") || name.ends_with(".gguf"))
      continue;
    plan.extra_files.push_back(name);
  }
  std::sort(plan.extra_files.begin(), plan.extra_files.end());
  return plan;
}

void print_crop_plan(const CropPlan& plan, std::FILE* out) {
  const int64_t n = int64_t(plan.kept_layers.size());
  fmt::print(out, "crop {} -> {} (dry run: nothing is written)\n", plan.source.string(),
             plan.output.string());
  fmt::print(out, "source: {} layers + {} MTP, {} tensors in {} shards\n", plan.source_layers,
             plan.source_mtp_layers, plan.reader->names().size(),
             plan.reader->shard_files().size());
  std::string mtp = "none";
  if (plan.mtp_layers > 0)
    mtp = fmt::format("layers {}-{} -> {}-{}", plan.source_layers,
                      plan.source_layers + plan.mtp_layers - 1, n, n + plan.mtp_layers - 1);
  fmt::print(out, "keep: layers {} -> 0-{}; MTP {}; vision {}; dtype {}\n",
             layer_ranges(plan.kept_layers), n - 1, mtp, plan.vision ? "kept" : "dropped",
             plan.dtype == CropDType::bf16 ? "bf16 (FP8 dequantised)" : "as stored");
  fmt::print(out, "\n{:<16} {:<9} {:<22} {:>10}  {}\n", "action", "dtype", "shape", "size",
             "tensor");
  size_t dequantized = 0, renamed = 0;
  for (const auto& t : plan.tensors) {
    std::string action = t.dequantize() ? (t.renamed() ? "dequant+rename" : "dequant")
                                        : (t.renamed() ? "rename" : "keep");
    dequantized += t.dequantize();
    renamed += t.renamed();
    std::string dtype = t.source_dtype == t.target_dtype
                            ? std::string(dtype_name(t.target_dtype))
                            : fmt::format("{}->{}",
                                          t.source_dtype == DType::fp8e4m3
                                              ? "fp8"
                                              : std::string(dtype_name(t.source_dtype)),
                                          dtype_name(t.target_dtype));
    std::string names = t.renamed() ? t.source + " -> " + t.target : t.target;
    fmt::print(out, "{:<16} {:<9} {:<22} {:>10}  {}\n", action, dtype, shape_str(t.shape),
               format_bytes(double(t.write_bytes)), names);
  }
  fmt::print(out,
             "\nkeep {} tensors ({} dequantised, {} renamed), {} parameters, {} in {} shards\n",
             plan.tensors.size(), dequantized, renamed, plan.output_parameters,
             format_bytes(double(plan.output_bytes)), plan.shard_starts.size());
  fmt::print(out, "drop {} tensors ({}){}\n", plan.dropped_tensors,
             format_bytes(double(plan.dropped_bytes)),
             plan.consumed_scales
                 ? fmt::format("; {} FP8 scales consumed by dequantisation", plan.consumed_scales)
                 : "");
  fmt::print(out, "reads {} of {} source shards; largest output tensor {}\n",
             plan.source_shards_read, plan.reader->shard_files().size(),
             format_bytes(double(plan.max_tensor_bytes)));
  const ojson& text = text_part(plan.config);
  fmt::print(out, "config: num_hidden_layers {} -> {}, num_nextn_predict_layers {}{}\n",
             plan.source_layers, text.value("num_hidden_layers", int64_t(0)),
             text.value("num_nextn_predict_layers", int64_t(0)),
             plan.dtype == CropDType::bf16 ? ", quantization_config removed" : "");
  if (!plan.extra_files.empty()) {
    std::string files;
    for (const auto& f : plan.extra_files) files += (files.empty() ? "" : ", ") + f;
    fmt::print(out, "copied alongside: {}\n", files);
  }
}

CropResult run_crop(const CropPlan& plan, const CropOptions& options, bool show_progress) {
  const auto start = std::chrono::steady_clock::now();
  const CheckpointReader& reader = *plan.reader;
  const uint64_t chunk_bytes = std::max<uint64_t>(options.chunk_bytes, 1);

  // The last output tensor that reads each source shard: the shard is unmapped after it.
  std::map<std::string, size_t> last_use;
  for (size_t i = 0; i < plan.tensors.size(); ++i) {
    last_use[reader.shard_of(plan.tensors[i].source)] = i;
    if (plan.tensors[i].dequantize()) last_use[reader.shard_of(plan.tensors[i].scale)] = i;
  }
  std::map<size_t, std::vector<std::string>> close_after;
  for (const auto& [file, i] : last_use) close_after[i].push_back(file);

  CheckpointWriterOptions writer_options;
  writer_options.max_shard_bytes = options.max_shard_bytes;
  CheckpointWriter writer(plan.output, writer_options);
  std::unique_ptr<Progress> progress;
  if (show_progress) progress = std::make_unique<Progress>("crop", plan.output_bytes);

  std::vector<float> scale;
  std::unique_ptr<uint16_t[]> converted;
  size_t converted_capacity = 0;
  for (size_t s = 0; s < plan.shard_starts.size(); ++s) {
    const size_t begin = plan.shard_starts[s];
    const size_t end =
        s + 1 < plan.shard_starts.size() ? plan.shard_starts[s + 1] : plan.tensors.size();
    std::vector<TensorSpec> specs;
    for (size_t i = begin; i < end; ++i)
      specs.push_back(
          {plan.tensors[i].target, plan.tensors[i].target_dtype, plan.tensors[i].shape});
    writer.begin_shard(std::move(specs));
    for (size_t i = begin; i < end; ++i) {
      const CropTensor& t = plan.tensors[i];
      auto src = reader.bytes(t.source);
      if (!t.dequantize()) {
        // Straight from the mapping to the output file, a chunk at a time: no copy in memory, and
        // each chunk's pages are let go once written, so even a 1.3 GB embedding stays out of the
        // resident set.
        for (uint64_t off = 0; off < src.size(); off += chunk_bytes) {
          const uint64_t len = std::min<uint64_t>(chunk_bytes, src.size() - off);
          writer.write_part(t.target, off, src.subspan(size_t(off), size_t(len)));
          reader.release(t.source, off, len);
          if (progress) progress->advance(len);
        }
      } else {
        const TensorInfo& si = reader.info(t.scale);
        auto sb = reader.bytes(t.scale);
        // The scale may sit at any byte offset in its file; copy it (it is small) to get aligned
        // floats.
        scale.resize(size_t(shape_numel(si.shape)));
        if (si.dtype == DType::f32) {
          std::memcpy(scale.data(), sb.data(), sb.size());
        } else {
          for (size_t k = 0; k < scale.size(); ++k) {
            uint16_t h;
            std::memcpy(&h, sb.data() + 2 * k, 2);
            scale[k] = bf16_to_f32(h);
          }
        }
        reader.release(t.scale);
        // Whole block rows at a time (about chunk_bytes of output), so that each chunk starts on
        // a scale row and memory holds one chunk, not the tensor.
        const int64_t rows = t.shape[0], cols = t.shape[1];
        const int64_t scale_cols = si.shape[1];
        const int64_t chunk_rows = std::max<int64_t>(
            plan.block_rows, int64_t(chunk_bytes / 2) / std::max<int64_t>(cols, 1) /
                                 plan.block_rows * plan.block_rows);
        const size_t capacity = size_t(std::min(rows, chunk_rows) * cols);
        // Reused across tensors and grown only when needed (uninitialised: every element is
        // written before it is read).
        if (capacity > converted_capacity) {
          converted.reset();
          converted = std::make_unique_for_overwrite<uint16_t[]>(capacity);
          converted_capacity = capacity;
        }
        for (int64_t r0 = 0; r0 < rows; r0 += chunk_rows) {
          const int64_t n = std::min(chunk_rows, rows - r0);
          dequantize_fp8_block_bf16(src.data() + r0 * cols,
                                    scale.data() + (r0 / plan.block_rows) * scale_cols, n, cols,
                                    plan.block_rows, plan.block_cols, converted.get());
          writer.write_part(
              t.target, uint64_t(r0 * cols) * 2,
              {reinterpret_cast<const uint8_t*>(converted.get()), size_t(n * cols) * 2});
          reader.release(t.source, uint64_t(r0 * cols), uint64_t(n * cols));
          if (progress) progress->advance(uint64_t(n * cols) * 2);
        }
      }
      if (auto c = close_after.find(i); c != close_after.end())
        for (const auto& file : c->second) reader.close_shard(file);
    }
    writer.end_shard();
  }
  converted.reset();

  writer.add_file("config.json", plan.config.dump(2, ' ', true) + "\n");
  for (const auto& name : plan.extra_files) writer.copy_file(plan.source / name, name);
  writer.finish();
  if (progress) progress->finish();

  CropResult result;
  result.bytes_written = writer.total_bytes();
  result.parameters = writer.total_parameters();
  result.tensors = plan.tensors.size();
  result.shards = writer.num_shards();
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

}  // namespace glmtune::io

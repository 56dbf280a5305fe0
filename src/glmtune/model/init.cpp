#include "glmtune/model/init.h"

#include <algorithm>
#include <cmath>
#include <regex>
#include <set>

#include "glmtune/io/checkpoint.h"
#include "glmtune/io/fp8.h"
#include "glmtune/ops/fp8.h"
#include "glmtune/tensor/rng.h"

namespace glmtune::model {

uint64_t param_stream_key(uint64_t seed, const std::string& name) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char ch : name) h = (h ^ ch) * 0x100000001b3ull;
  // splitmix64 finaliser over (hash, seed) so that nearby seeds give unrelated streams.
  uint64_t z = h ^ (seed + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2));
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

Tensor initial_value(const ModelConfig& config, const ParamSpec& spec, uint64_t seed, Device draw) {
  const uint64_t key = param_stream_key(seed, spec.name);
  const TextConfig& text = config.text();
  switch (spec.init) {
    case InitRule::zeros:
      return Tensor::zeros(spec.shape, spec.dtype);
    case InitRule::ones:
      return Tensor::full(spec.shape, 1.0, spec.dtype);
    case InitRule::normal: {
      // Draw in float32 and round once to the stored dtype, as torch's normal_ on a bf16 tensor.
      Tensor t = Tensor::empty(spec.shape, DType::f32, draw);
      fill_normal(t, key, 0, 0.0, spec.init_std);
      return t.to(spec.dtype).to(Device::cpu());
    }
    case InitRule::embedding: {
      Tensor t = Tensor::empty(spec.shape, DType::f32);
      fill_normal(t, key, 0, 0.0, spec.init_std);
      if (text.pad_token_id >= 0 && text.pad_token_id < spec.shape[0])
        t.select(0, text.pad_token_id).zero_();
      return t.to(spec.dtype);
    }
    case InitRule::dt_bias: {
      // dt ~ exp(U(log 1e-3, log 1e-1)) floored at 1e-4, stored as its inverse softplus.
      Tensor u = Tensor::empty(spec.shape, DType::f64);
      fill_uniform(u, key, 0, std::log(1e-3), std::log(1e-1));
      Tensor out = Tensor::empty(spec.shape, spec.dtype);
      for (int64_t i = 0; i < u.numel(); ++i) {
        double dt = std::max(std::exp(u.item({i})), 1e-4);
        out.set_item({i}, dt + std::log(-std::expm1(-dt)));
      }
      return out;
    }
    case InitRule::a_log: {
      if (text.linear_lower_bound) return Tensor::zeros(spec.shape, spec.dtype);
      Tensor u = Tensor::empty(spec.shape, DType::f64);
      fill_uniform(u, key, 0, 1.0, 16.0);
      Tensor out = Tensor::empty(spec.shape, spec.dtype);
      for (int64_t i = 0; i < u.numel(); ++i) out.set_item({i}, std::log(u.item({i})));
      return out;
    }
  }
  GLMTUNE_ASSERT(false, "unhandled init rule for {}", spec.name);
}

bool released_in_fp8(const ModelConfig& config, const ParamSpec& spec) {
  static const std::regex mlp(
      R"(\.mlp\.(experts\.\d+\.|shared_experts\.)?(gate|up|down)_proj\.weight$)");
  static const std::regex mla(
      R"(\.self_attn\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|o_proj)\.weight$)");
  if ((spec.component != Component::layer && spec.component != Component::mtp) ||
      spec.shape.size() != 2)
    return false;
  if (std::regex_search(spec.name, mlp)) return true;
  // The MTP layer's attention is MLA; a decoder layer's by its type.
  const TextConfig& c = config.text();
  const bool dsa = spec.layer >= c.num_hidden_layers ||
                   (spec.layer >= 0 && c.layer_types[size_t(spec.layer)] == AttnKind::dsa);
  return dsa && std::regex_search(spec.name, mla);
}

namespace {

// The release's quantization_config: its fixed entries and every decoder-layer module it keeps in
// bf16, named as the release names them (model.layers.*), sorted as Python sorts them.
Json fp8_quantization_config(const ModelConfig& config, const std::vector<ParamSpec>& layout) {
  std::set<std::string> kept = {
      "attn_mha",     "attn_mqa",           "dt_bias",    "hyper_connection", "lm_head",
      "mapping_proj", "model.embed_tokens", "model.norm", "model.visual",     "router",
      "visual",       "weights_proj"};
  const std::string text = "model.language_model.";
  for (const ParamSpec& p : layout)
    if ((p.component == Component::layer || p.component == Component::mtp) &&
        !released_in_fp8(config, p) && p.name.compare(0, text.size(), text) == 0) {
      std::string module = "model." + p.name.substr(text.size());
      if (module.ends_with(".weight")) module.resize(module.size() - std::string(".weight").size());
      kept.insert(module);
    }
  return Json{{"activation_scheme", "dynamic"},
              {"fmt", "e4m3"},
              {"quant_method", "fp8"},
              {"weight_block_size", {128, 128}},
              {"modules_to_not_convert", std::vector<std::string>(kept.begin(), kept.end())}};
}

}  // namespace

void write_random_checkpoint(const ModelConfig& config, const std::filesystem::path& dir,
                             const InitOptions& options) {
  const std::vector<ParamSpec> layout = released_layout(config);
  // What goes on disk: each tensor as glmtune stores it, or in FP8 with its block scales.
  struct Entry {
    const ParamSpec* spec;
    bool fp8;
    uint64_t bytes() const {
      if (!fp8) return uint64_t(spec->numel()) * dtype_size(spec->dtype);
      return uint64_t(spec->numel()) +
             uint64_t(shape_numel(io::fp8_scale_shape(spec->shape))) * sizeof(float);
    }
  };
  std::vector<Entry> entries;
  uint64_t total = 0;
  for (const auto& p : layout) {
    entries.push_back({&p, options.fp8 && released_in_fp8(config, p)});
    total += entries.back().bytes();
  }

  io::CheckpointWriterOptions writer_options;
  writer_options.max_shard_bytes = options.max_shard_bytes;
  io::CheckpointWriter writer(dir, writer_options);
  uint64_t done = 0;
  size_t next = 0;
  while (next < entries.size()) {
    // Plan one shard: as many tensors as fit under the limit (at least one).
    std::vector<io::TensorSpec> specs;
    uint64_t bytes = 0;
    size_t end = next;
    while (end < entries.size()) {
      const Entry& e = entries[end];
      if (!specs.empty() && bytes + e.bytes() > options.max_shard_bytes) break;
      if (e.fp8) {
        specs.push_back({e.spec->name, DType::fp8e4m3, e.spec->shape});
        specs.push_back(
            {io::fp8_scale_name(e.spec->name), DType::f32, io::fp8_scale_shape(e.spec->shape)});
      } else {
        specs.push_back({e.spec->name, e.spec->dtype, e.spec->shape});
      }
      bytes += e.bytes();
      ++end;
    }
    writer.begin_shard(specs);
    for (size_t i = next; i < end; ++i) {
      const Entry& e = entries[i];
      Tensor value = initial_value(config, *e.spec, options.seed, options.draw);
      if (e.fp8) {
        const ops::Fp8Blocks q = ops::quantize_fp8_weight(value);
        writer.write(e.spec->name, q.values);
        writer.write(io::fp8_scale_name(e.spec->name), q.scales);
      } else {
        writer.write(e.spec->name, value);
      }
      done += e.bytes();
      if (options.progress) options.progress(done, total);
    }
    writer.end_shard();
    next = end;
  }
  Json document = config.to_json_with_schedules();
  if (options.fp8) document["quantization_config"] = fp8_quantization_config(config, layout);
  writer.add_file("config.json", document.dump(2) + "\n");
  const TextConfig& t = config.text();
  Json generation = {
      {"_from_model_config", true},
      {"eos_token_id", config.document().contains("text_config") &&
                               config.document()["text_config"].contains("eos_token_id")
                           ? config.document()["text_config"]["eos_token_id"]
                           : Json(t.pad_token_id)},
      {"pad_token_id", t.pad_token_id},
      {"transformers_version", "5.17.0"}};
  writer.add_file("generation_config.json", generation.dump(2) + "\n");
  for (const auto& [source, name] : options.extra_files) writer.copy_file(source, name);
  writer.finish();
}

}  // namespace glmtune::model

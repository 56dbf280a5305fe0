#include "glmtune/model/init.h"

#include <cmath>

#include "glmtune/io/checkpoint.h"
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

Tensor initial_value(const ModelConfig& config, const ParamSpec& spec, uint64_t seed) {
  const uint64_t key = param_stream_key(seed, spec.name);
  const TextConfig& text = config.text();
  switch (spec.init) {
    case InitRule::zeros:
      return Tensor::zeros(spec.shape, spec.dtype);
    case InitRule::ones:
      return Tensor::full(spec.shape, 1.0, spec.dtype);
    case InitRule::normal: {
      // Draw in float32 and round once to the stored dtype, as torch's normal_ on a bf16 tensor.
      Tensor t = Tensor::empty(spec.shape, DType::f32);
      fill_normal(t, key, 0, 0.0, spec.init_std);
      return t.to(spec.dtype);
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

void write_random_checkpoint(const ModelConfig& config, const std::filesystem::path& dir,
                             const InitOptions& options) {
  const std::vector<ParamSpec> layout = released_layout(config);
  uint64_t total = 0;
  for (const auto& p : layout) total += uint64_t(p.numel()) * dtype_size(p.dtype);

  io::CheckpointWriterOptions writer_options;
  writer_options.max_shard_bytes = options.max_shard_bytes;
  io::CheckpointWriter writer(dir, writer_options);
  uint64_t done = 0;
  size_t next = 0;
  while (next < layout.size()) {
    // Plan one shard: as many tensors as fit under the limit (at least one).
    std::vector<io::TensorSpec> specs;
    uint64_t bytes = 0;
    size_t end = next;
    while (end < layout.size()) {
      uint64_t b = uint64_t(layout[end].numel()) * dtype_size(layout[end].dtype);
      if (!specs.empty() && bytes + b > options.max_shard_bytes) break;
      specs.push_back({layout[end].name, layout[end].dtype, layout[end].shape});
      bytes += b;
      ++end;
    }
    writer.begin_shard(specs);
    for (size_t i = next; i < end; ++i) {
      writer.write(layout[i].name, initial_value(config, layout[i], options.seed));
      done += uint64_t(layout[i].numel()) * dtype_size(layout[i].dtype);
      if (options.progress) options.progress(done, total);
    }
    writer.end_shard();
    next = end;
  }
  writer.add_file("config.json", config.to_json_with_schedules().dump(2) + "\n");
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

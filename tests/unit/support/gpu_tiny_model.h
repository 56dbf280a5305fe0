#pragma once
// The tiny preset with the geometry the GPU kernels take (KDA head dim 128, MLA head dims 32), and
// with its selections made unambiguous: every token uses every expert and the indexer keeps every
// key. A near-tie broken differently by the CPU and the GPU would otherwise route a token
// elsewhere and say nothing about the arithmetic; the selection kernels have their own exact tests.

#include <cstdint>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "glmtune/io/checkpoint.h"
#include "glmtune/model/config.h"
#include "glmtune/model/init.h"
#include "glmtune/model/param_store.h"

namespace glmtune::test {

inline model::ModelConfig gpu_tiny_config() {
  model::ModelConfig config = model::ModelConfig::preset("tiny");
  for (const auto& [key, value] : std::vector<std::pair<std::string, std::string>>{
           {"text_config.linear_attn_config.head_dim", "128"},
           {"text_config.qk_nope_head_dim", "32"},
           {"text_config.qk_head_dim", "32"},
           {"text_config.v_head_dim", "32"},
           {"text_config.index_topk", "512"},
           {"text_config.topk_group", "2"},
           {"text_config.num_experts_per_tok", "8"}})
    config.set(key, value);
  return config;
}

// A random checkpoint of gpu_tiny_config() written to `dir` (weights drawn from `seed`), loaded.
inline model::ParamStore random_gpu_tiny_store(const std::filesystem::path& dir, uint64_t seed) {
  const model::ModelConfig config = gpu_tiny_config();
  model::InitOptions init;
  init.seed = seed;
  model::write_random_checkpoint(config, dir, init);
  return model::ParamStore::load(io::CheckpointReader::open(dir), config);
}

}  // namespace glmtune::test

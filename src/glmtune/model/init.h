#pragma once
// Random initialisation by the reference's rules (InitRule in layout.h; docs/checkpoints.md,
// "glmtune init"). Every tensor draws from its own counter-based stream, keyed by the seed and the
// tensor's name, so a tensor's values do not depend on which other tensors exist, on the order
// they are made in, or on sharding.

#include <cstdint>
#include <filesystem>
#include <functional>

#include "glmtune/model/config.h"
#include "glmtune/model/layout.h"

namespace glmtune::model {

// A fresh CPU tensor of spec.shape / spec.dtype holding the initial values.
Tensor initial_value(const ModelConfig& config, const ParamSpec& spec, uint64_t seed);

struct InitOptions {
  uint64_t seed = 0;
  uint64_t max_shard_bytes = 5'000'000'000;
  // Called after each tensor with (bytes written so far, total bytes).
  std::function<void(uint64_t, uint64_t)> progress;
  // Files copied into the checkpoint directory (source path, name inside the directory), written
  // atomically together with the weights.
  std::vector<std::pair<std::filesystem::path, std::string>> extra_files;
};

// Writes a complete random checkpoint (shards, index, config.json, generation_config.json) into
// `dir`, atomically. Memory holds one tensor at a time.
void write_random_checkpoint(const ModelConfig& config, const std::filesystem::path& dir,
                             const InitOptions& options);

// The per-tensor stream key: a 64-bit FNV-1a of the name mixed with the seed.
uint64_t param_stream_key(uint64_t seed, const std::string& name);

}  // namespace glmtune::model

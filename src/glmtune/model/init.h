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

// A fresh CPU tensor of spec.shape / spec.dtype holding the initial values. `draw` is where the
// normal draws are made: a GPU draws the same counter-based values (tensor/rng.h) far faster.
Tensor initial_value(const ModelConfig& config, const ParamSpec& spec, uint64_t seed,
                     Device draw = Device::cpu());

struct InitOptions {
  uint64_t seed = 0;
  uint64_t max_shard_bytes = 5'000'000'000;
  // Called after each tensor with (bytes written so far, total bytes).
  std::function<void(uint64_t, uint64_t)> progress;
  // Files copied into the checkpoint directory (source path, name inside the directory), written
  // atomically together with the weights.
  std::vector<std::pair<std::filesystem::path, std::string>> extra_files;
  // The FP8 release's layout: the weights it stores in FP8 (released_in_fp8) quantised from their
  // random values into e4m3 with a float32 `weight_scale_inv` per 128 × 128 block (ops/fp8.h's
  // rule), and config.json with the release's quantization_config.
  bool fp8 = false;
  Device draw = Device::cpu();  // initial_value's `draw`
};

// Whether the FP8 release stores `spec` in FP8 (e4m3 + weight_scale_inv): the routed and shared
// experts, the dense MLPs and the MLA projections q_a, q_b, kv_a and o of the DSA layers (MTP
// included); everything else (KDA layers, kv_b_proj, the indexer, router, norms, embeddings, head,
// vision) stays as stored.
bool released_in_fp8(const ModelConfig& config, const ParamSpec& spec);

// Writes a complete random checkpoint (shards, index, config.json, generation_config.json) into
// `dir`, atomically. Memory holds one tensor at a time.
void write_random_checkpoint(const ModelConfig& config, const std::filesystem::path& dir,
                             const InitOptions& options);

// The per-tensor stream key: a 64-bit FNV-1a of the name mixed with the seed.
uint64_t param_stream_key(uint64_t seed, const std::string& name);

}  // namespace glmtune::model

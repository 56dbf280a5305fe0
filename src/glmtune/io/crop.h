#pragma once
// Reduced-layer crops of a released GLM-5.3-Flash checkpoint (FP8 or BF16): the first N decoder
// layers (or any list of them, renumbered 0..n-1 in order), the MTP layer moved to sit right after
// them, and the vision tower, embeddings, final norm and head unchanged. FP8 weights are
// dequantised to BF16 with their 128x128 block scales; the config's per-layer schedules are cut to
// the kept layers.
//
// Planning reads only headers and config.json and catches every problem it can (layers the source
// lacks, missing shards, an index that does not match its shards, FP8 weights without scales)
// before anything is written. Running streams each tensor in chunks (memory holds one chunk of
// about 64 MB, not a tensor) into a temporary directory that replaces the output only when
// complete.

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "glmtune/io/checkpoint.h"

namespace glmtune::io {

enum class CropDType {
  bf16,  // dequantise FP8 weights to BF16 and drop their scales; other tensors unchanged
  keep,  // copy every tensor as stored (FP8 stays FP8 with its scales)
};

struct CropOptions {
  // Source decoder layers to keep, any order; kept layers are renumbered 0..n-1 ascending.
  std::vector<int64_t> layers;
  // Keep the MTP layers (source `layers.<num_hidden_layers + j>`) as `layers.<n + j>`. Unset:
  // keep them when the source has them.
  std::optional<bool> mtp;
  bool vision = true;
  CropDType dtype = CropDType::bf16;
  uint64_t max_shard_bytes = 5'000'000'000;
  // Replace a non-empty output directory (atomically, on completion).
  bool overwrite = false;
  // Output bytes handled per step: large enough for full-speed sequential I/O, small enough that
  // memory stays far below one large tensor. Dequantisation rounds it to whole block rows.
  uint64_t chunk_bytes = uint64_t(64) << 20;
};

// "0-4", "0,2,7-9": sorted, without repeats. Throws glmtune::Error naming the text for anything
// else (empty items, reversed ranges, negative numbers, a layer listed twice).
std::vector<int64_t> parse_layer_list(std::string_view text);

// One output tensor and where it comes from.
struct CropTensor {
  std::string source;  // name in the source checkpoint
  std::string target;  // name in the output (differs when the layer is renumbered)
  std::string scale;   // the `_scale_inv` companion consumed by dequantisation, or empty
  DType source_dtype = DType::bf16;
  DType target_dtype = DType::bf16;
  Shape shape;
  uint64_t read_bytes = 0;   // bytes read from the source (scale included)
  uint64_t write_bytes = 0;  // bytes written to the output

  bool dequantize() const { return !scale.empty(); }
  bool renamed() const { return source != target; }
};

struct CropPlan {
  std::filesystem::path source;
  std::filesystem::path output;
  std::shared_ptr<const CheckpointReader> reader;
  int64_t source_layers = 0;      // num_hidden_layers of the source
  int64_t source_mtp_layers = 0;  // num_nextn_predict_layers of the source
  std::vector<int64_t> kept_layers;
  int64_t mtp_layers = 0;  // MTP layers kept
  bool vision = true;
  CropDType dtype = CropDType::bf16;
  int64_t block_rows = 128, block_cols = 128;
  // Output tensors in write order (source shard by source shard, file order within a shard).
  std::vector<CropTensor> tensors;
  // Output shards as ranges of `tensors`: shard k holds tensors [shard_starts[k], next start).
  std::vector<size_t> shard_starts;
  size_t dropped_tensors =
      0;  // source tensors left out (scales consumed by dequantisation excluded)
  uint64_t dropped_bytes = 0;
  size_t consumed_scales = 0;
  size_t source_shards_read = 0;
  uint64_t output_bytes = 0;
  uint64_t output_parameters = 0;
  uint64_t max_tensor_bytes = 0;         // largest single output tensor
  nlohmann::ordered_json config;         // the rewritten config.json
  std::vector<std::string> extra_files;  // copied alongside (tokenizer, templates, processor, ...)
};

// Checks everything and decides everything; reads headers and config.json only.
CropPlan plan_crop(const std::filesystem::path& source, const std::filesystem::path& output,
                   const CropOptions& options);

// The --dry-run listing: every kept tensor with its action and size, then a summary.
void print_crop_plan(const CropPlan& plan, std::FILE* out);

struct CropResult {
  uint64_t bytes_written = 0;
  uint64_t parameters = 0;
  size_t tensors = 0, shards = 0;
  double seconds = 0;
};

// Writes the crop. `show_progress` draws a progress bar (bytes, rate, ETA) on stderr.
CropResult run_crop(const CropPlan& plan, const CropOptions& options, bool show_progress = true);

// The config.json rewrite on the raw JSON (key order and unknown fields kept): num_hidden_layers,
// the per-layer schedules of text_config (layer_types, mlp_layer_types, indexer_types, and the
// layer-id lists linear_attn_config.kda_layers / full_attn_layers, kv_source_layer_ids,
// index_source_layer_ids) cut and renumbered, first_k_dense_replace made consistent,
// num_nextn_predict_layers set, and quantization_config removed when `dequantized` (otherwise its
// modules_to_not_convert list is renumbered).
nlohmann::ordered_json rewrite_crop_config(const nlohmann::ordered_json& config,
                                           const std::vector<int64_t>& kept_layers,
                                           int64_t mtp_layers, bool dequantized);

// Splits "model.language_model.layers.12.mlp.gate.weight" into its prefix
// ("model.language_model.layers."), layer index (12) and rest ("mlp.gate.weight"); nullopt for
// names outside the decoder layers. "model.layers.N." (no language_model) is recognised too.
struct LayerName {
  std::string prefix;
  int64_t layer = 0;
  std::string rest;
};
std::optional<LayerName> parse_layer_name(std::string_view name);

}  // namespace glmtune::io

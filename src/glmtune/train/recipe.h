#pragma once
// The training recipe: a TOML file that says what to train, on what, and how.
//
//   [model]     path, tokenizer, freeze_vision, freeze_projector
//   [data]      files | cache, format, on_bad_line, on_overlong, max_length, pack_max_length,
//               pack_lookahead, shuffle, media_root
//   [train]     total_steps | epochs, micro_packs, seed, device, recompute, offload, on_nonfinite,
//               ep_size, sp_size, fsdp, dist_timeout, freeze, fp8, frozen_weights
//   [optimizer] lr, lr_min, warmup_steps | warmup_ratio, betas, eps, weight_decay, clip_grad_norm
//   [loss]      mtp_scale, balancing_alpha, router_bias_update_rate
//   [output]    dir, save_every, keep_last, log_every
//   [lora]      rank, alpha, dropout, use_rslora, target_modules, base (docs/lora.md)
//
// docs/training.md has the full table (type, default, meaning). The defaults of the optimizer,
// the losses and the lengths are the reference trainer's. Every unknown section or key, wrong
// type, out-of-range value or contradiction is a glmtune::Error whose where() names the file, the
// line and the key (or the --set flag that supplied it) and whose fix() says what to write
// instead. Relative paths are kept as written: they are relative to the directory glmtune runs in.

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "glmtune/data/dataset.h"
#include "glmtune/data/packing.h"
#include "glmtune/model/lora.h"
#include "glmtune/tensor/device.h"
#include "glmtune/train/optimizer.h"
#include "glmtune/train/schedule.h"

namespace glmtune::train {

enum class NonFinitePolicy { kSkip, kStop };

struct Recipe {
  // [model]
  std::string model_path;      // checkpoint directory (config.json + safetensors)
  std::string tokenizer_path;  // directory with tokenizer.json; defaults to model_path
  // Vision-language training (docs/vision.md): no gradient for the tower (patch embed, blocks,
  // post norm) / the projector (downsample, merger).
  bool freeze_vision = false;
  bool freeze_projector = false;

  // [data] — exactly one of files and cache.
  std::vector<std::string> data_files;
  // A token cache written by `glmtune data prepare`, read instead of JSONL files. It must have been
  // prepared with the recipe's tokenizer, format, max_length and on_overlong.
  std::string data_cache;
  data::SampleFormat data_format = data::SampleFormat::kAuto;
  data::BadLinePolicy on_bad_line = data::BadLinePolicy::kFail;
  data::OverlongPolicy on_overlong = data::OverlongPolicy::kTruncate;
  int64_t max_length = 4096;  // longest sample in tokens (default: min(4096, pack_max_length))
  int64_t pack_max_length = 16384;
  int64_t pack_lookahead = 100;
  bool shuffle = true;
  // Folder that relative image / video paths of the conversations resolve against. Set: the data
  // is vision-language (model/compose.h); empty: text only.
  std::string media_root;

  // [train] — exactly one of total_steps and epochs.
  std::optional<int64_t> total_steps;
  std::optional<double> epochs;
  int64_t micro_packs = 1;  // packs per rank per optimizer step (gradient accumulation)
  uint64_t seed = 0;
  Device device = Device::cpu();
  double recompute = 1.0;  // fraction of decoder layers, from the first, recomputed in backward
  // Fraction of decoder layers, right after the recomputed ones, whose activations wait in pinned
  // host memory between forward and backward (GPU; kept on the CPU). recompute + offload ≤ 1.
  double offload = 0.0;
  // Vision-language packs: the tower's blocks keep their inputs only and rerun in the backward
  // (the same values; about a third more tower FLOPs for most of its activation memory).
  bool recompute_vision = false;
  // A step whose loss or gradient is not finite: skip its update and go on, or stop the run.
  NonFinitePolicy on_nonfinite = NonFinitePolicy::kSkip;
  // Distributed runs (docs/distributed.md): routed experts split over groups of ep_size ranks,
  // sequences over groups of sp_size ranks; a collective that waits longer than dist_timeout_s
  // seconds ends every rank with an error.
  int64_t ep_size = 1;
  int64_t sp_size = 1;
  // Decoder-layer compute weights sharded over the data-parallel ranks and gathered per layer
  // (dist/fsdp.h). The arithmetic is unchanged, so the fingerprint leaves it out.
  bool fsdp = false;
  double dist_timeout_s = 600;
  // Parameters kept fixed (train/freeze.h): ECMAScript regular expressions searched in the
  // released parameter names. Frozen tensors get no gradient and no optimizer state; checkpoints
  // still hold them, unchanged.
  std::vector<std::string> freeze;
  // train.fp8 = "tilewise": the projections of model::text::use_fp8_gemms run their GEMMs in
  // block-scaled FP8 (ops/fp8.h); master weights, optimizer and checkpoints are unchanged.
  bool fp8_tilewise = false;
  // train.frozen_weights = "fp8": the frozen decoder-layer tensors (train.freeze) that the
  // checkpoint stores in FP8 stay in FP8 on the device and are dequantised per layer around each
  // use, as lora.base = "fp8" holds a LoRA base (model/text/fp8_layers.h); "bf16": dequantised at
  // load. The values are the same, so the fingerprint leaves it out.
  bool frozen_fp8 = false;

  // [optimizer]
  double lr = 1e-6;
  double lr_min = 1e-6;
  std::optional<int64_t> warmup_steps;  // exclusive with warmup_ratio
  double warmup_ratio = 0.0;
  double beta1 = 0.9, beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.01;
  double clip_grad_norm = 1.0;  // 0: no clipping

  // [loss]
  double mtp_scale = 0.1;
  double balancing_alpha = 0.001;
  double router_bias_update_rate = 0.001;

  // [lora]: low-rank adapters on a frozen base (model/lora.h); absent: full fine-tuning.
  std::optional<model::LoraConfig> lora;

  // [output]
  std::string output_dir;
  int64_t save_every = 200;  // 0: only the final step
  int64_t keep_last = 3;     // 0: keep every checkpoint
  int64_t log_every = 1;

  // Reads and validates a recipe file.
  static Recipe load(const std::string& path);
  // Validates recipe text; `source` names it in errors.
  static Recipe parse(std::string_view text, const std::string& source);

  // Overrides one key ("section.key") with `value`, parsed as a TOML value when it is one (1e-5,
  // true, ["a.jsonl"], "text") and taken as a string otherwise (runs/x, cuda:0); then
  // re-validates the whole recipe. Errors name "--set section.key".
  void set(const std::string& dotted_key, const std::string& value);
  // Applies "section.key=value" overrides in order (the CLI's repeatable --set; a key given twice
  // takes the last value), then validates the whole recipe once, so that keys checked against
  // each other may be given in any order. Nothing changes when any of them is refused.
  void apply_sets(const std::vector<std::string>& key_values);

  // Where the values came from (a file path, or the `source` given to parse()).
  const std::string& source() const { return source_; }

  data::DatasetConfig dataset_config() const;
  // The tokenizer supplies the padding id (`<|endoftext|>`).
  data::PackingConfig packing_config(int32_t pad_id) const;
  AdamWConfig adamw_config() const;

  // Optimizer steps of the run: total_steps, or ceil(epochs · packs_per_epoch / (micro_packs ·
  // data_parallel_ranks)) where packs_per_epoch is the sampler's plan for the first epoch.
  // Throws glmtune::Error naming train.epochs when that many steps do not fit an int64.
  int64_t resolve_total_steps(int64_t packs_per_epoch, int64_t data_parallel_ranks = 1) const;
  // warmup_steps, or floor(warmup_ratio · total_steps).
  int64_t resolve_warmup_steps(int64_t total_steps) const;
  Schedule schedule(int64_t total_steps) const;

  // The effective recipe (every key, defaults included) as TOML, for the run's output directory.
  std::string to_toml() const;
  // A 16-hex-digit hash of the settings that shape the training trajectory (data handling,
  // packing, steps, seed, optimizer, losses); paths, device, recompute, offload, output and logging
  // are left out, so moving files or changing the log interval does not count as a different run.
  // The batch enters as the packs of a whole step (micro_packs × data_parallel_ranks): the same
  // global batch at another rank count is the same run.
  std::string fingerprint(int64_t data_parallel_ranks = 1) const;

 private:
  struct Doc;
  void parse_doc();
  // Writes one --set value into the document, unvalidated (set and apply_sets validate).
  void insert_override(const std::string& dotted_key, const std::string& value);
  std::shared_ptr<const Doc> doc_;
  std::string source_;
};

}  // namespace glmtune::train

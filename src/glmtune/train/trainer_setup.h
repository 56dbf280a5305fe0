#pragma once
// The start of `glmtune train` (train/trainer.h), piece by piece: the output directory and the
// resume point, the data, the weights, the model and the step options. The trainer's own header,
// not an API.

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>

#include "glmtune/data/dataset.h"
#include "glmtune/data/packing.h"
#include "glmtune/data/token_cache.h"
#include "glmtune/data/tokenizer.h"
#include "glmtune/io/checkpoint.h"
#include "glmtune/model/param_store.h"
#include "glmtune/model/text/backward.h"
#include "glmtune/model/text/model.h"
#include "glmtune/train/freeze.h"
#include "glmtune/train/parallelize.h"
#include "glmtune/train/recipe.h"
#include "glmtune/train/state.h"
#include "glmtune/train/trainer.h"
#include "glmtune/train/trainer_optimizer.h"
#include "glmtune/train/vl_batch.h"

namespace glmtune::train {

// glmtune::Error for a GPU recipe in a build without CUDA.
void check_cuda_build(const Recipe& recipe);

// Creates the output directory and clears what an interrupted save left behind; returns the
// newest complete checkpoint that verifies when resuming (nullopt: a fresh start). Refuses an
// output directory holding checkpoints without `resume`, and ranks that found different ones.
std::optional<ResumePoint> prepare_output(const Recipe& recipe, const ParallelLayout& layout,
                                          bool resume);

// The tokenizer, the samples (JSONL files, a token cache, or vision-language conversations) and
// the sampler packing them. Built in place and never moved (the sampler reads the samples).
class TrainingData {
 public:
  TrainingData(const Recipe& recipe, const std::filesystem::path& tokenizer_dir);
  TrainingData(const TrainingData&) = delete;
  TrainingData& operator=(const TrainingData&) = delete;

  const std::filesystem::path& tokenizer_file() const { return tokenizer_file_; }
  const data::Tokenizer& tokenizer() const { return tokenizer_; }
  data::PackSampler& sampler() { return *sampler_; }
  // The vision-language data and model (data.media_root set); null for text.
  VlTraining* vl() const { return vl_.get(); }

 private:
  std::filesystem::path tokenizer_file_;
  data::Tokenizer tokenizer_;
  std::optional<data::JsonlDataset> dataset_;
  std::optional<data::TokenCache> cache_;
  std::unique_ptr<VlTraining> vl_;
  std::optional<data::PackSampler> sampler_;
};

// The parameter store of this rank: from the checkpoint when resuming (its weights are the
// rounded masters and its router biases the updated ones), else from [model] path; this rank's
// routed experts only (ep), the decoder layers as placeholders (fsdp, read later piece by piece
// through read_piece), frozen as the recipe says.
struct TrainingWeights {
  // Elements of a trained tensor for this rank's fsdp slices: the deferred ones from the mapped
  // checkpoint, the others from the store. Refers to this object: call it where it stays.
  PieceReader read_piece() const;

  model::ModelConfig config;
  std::optional<io::CheckpointReader> reader;  // kept until the fsdp slices or FP8 base are read
  model::ParamStore store;
};
// Plans the ep layout (ParallelLayout::plan_experts) and loads the weights; glmtune::Error when
// the tokenizer holds more tokens than the model.
TrainingWeights load_weights(const Recipe& recipe, ParallelLayout& layout,
                             const ResumePoint* resume, const TrainingData& data);

// lora.base = "fp8" or train.frozen_weights = "fp8": the store's deferred (frozen) FP8 tensors go
// to the model's device as codes and scales (layout.fp8_base), which the layer loops dequantise
// around each use (train.layer_params), and with train.fp8 = "tilewise" the FP8 GEMMs read their
// codes. Nothing when the store holds none deferred.
void hold_fp8_base(const Recipe& recipe, ParallelLayout& layout, TrainingWeights& weights,
                   model::text::TextModel& model, model::text::TrainOptions& train);

// The text model the steps run (the VL model's text part for vision-language data), built from
// the store once the optimizer state is restored; `text_model` holds it when there is no VL model.
model::text::TextModel& build_model(const Recipe& recipe, const ParallelLayout& layout,
                                    const model::ParamStore& store, VlTraining* vl,
                                    std::optional<model::text::TextModel>& text_model);

// The step options of the recipe for `model` (before parallelize adds its parts).
model::text::TrainOptions train_options(const Recipe& recipe, const model::text::TextModel& model,
                                        int64_t dp);

// The trainer state a run starts from: the checkpoint's when resuming (the sampler restored from
// it, `summary.resumed` set), else step 0.
TrainerState start_state(const Recipe& recipe, int64_t dp, const ResumePoint* resume,
                         data::PackSampler& sampler, TrainSummary& summary);

// The start-up's last log lines: the distributed layout and what the run will do.
void log_start(const Recipe& recipe, const ParallelLayout& layout,
               const model::text::TrainOptions& train, const model::TextConfig& tc,
               int64_t total_steps, int64_t start_step);

}  // namespace glmtune::train

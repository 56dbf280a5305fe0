#pragma once
// Writing the checkpoints of `glmtune train` (the format: train/state.h): the weights from their
// owner (train/trainer_optimizer.h), the optimizer state, the trainer state. Rank 0 writes; in a
// distributed run the other ranks take part in the gathers of the sharded tensors and wait for it.

#include <filesystem>
#include <optional>

#include "glmtune/data/packing.h"
#include "glmtune/model/param_store.h"
#include "glmtune/train/metrics.h"
#include "glmtune/train/parallelize.h"
#include "glmtune/train/recipe.h"
#include "glmtune/train/state.h"
#include "glmtune/train/trainer_optimizer.h"

namespace glmtune::train {

class Checkpointer {
 public:
  // `tokenizer_dir`: the tokenizer files copied next to the weights. `deferred_source`: the
  // checkpoint the store was loaded from, where the values of its deferred tensors (frozen FP8
  // tensors held on the device, train.frozen_weights) are read when a model is saved; null when
  // the store holds none.
  Checkpointer(const Recipe& recipe, const ParallelLayout& layout, model::ParamStore& store,
               Optimizer& optimizer, std::filesystem::path tokenizer_dir,
               const io::CheckpointReader* deferred_source = nullptr);

  // Collective. Saves step `state.step`, `state` first taking the sampler's position and the
  // throughput totals. Returns the checkpoint written (rank 0) or, on the other ranks of a
  // distributed run, the newest one found once rank 0 is done. glmtune::Error, saving nothing,
  // when a weight is not finite.
  std::optional<std::filesystem::path> save(TrainerState& state, const data::PackSampler& sampler,
                                            const ThroughputTotals& totals);

 private:
  const Recipe& recipe_;
  const ParallelLayout& layout_;
  model::ParamStore& store_;
  Optimizer& optimizer_;
  std::filesystem::path tokenizer_dir_;
  const io::CheckpointReader* deferred_source_;
};

}  // namespace glmtune::train

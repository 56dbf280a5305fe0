#pragma once
// The step loop of `glmtune train` (the steps: train/trainer.h): one optimizer step after the
// other until the run's last, a stop request or a non-finite step under on_nonfinite = "stop",
// with the metrics of each and the checkpoints the recipe asks for.

#include <optional>

#include "glmtune/data/packing.h"
#include "glmtune/model/param_store.h"
#include "glmtune/model/text/backward.h"
#include "glmtune/model/text/model.h"
#include "glmtune/train/checkpointer.h"
#include "glmtune/train/metrics.h"
#include "glmtune/train/parallelize.h"
#include "glmtune/train/recipe.h"
#include "glmtune/train/schedule.h"
#include "glmtune/train/state.h"
#include "glmtune/train/trainer.h"
#include "glmtune/train/trainer_optimizer.h"
#include "glmtune/train/vl_batch.h"

namespace glmtune::train {

// Everything the steps use, set up by run_training.
struct TrainingRun {
  const Recipe& recipe;
  const TrainerOptions& options;
  ParallelLayout& layout;
  model::ParamStore& store;
  model::text::TextModel& model;
  model::text::TextGrads& grads;
  model::text::TrainOptions& train;
  Optimizer& optimizer;
  VlTraining* vl;  // vision-language data; null for text
  data::PackSampler& sampler;
  const Schedule& schedule;
  ThroughputMeter& meter;
  MetricsLog* log;  // rank 0's
  Checkpointer& checkpointer;
  TrainerState& state;
  TrainSummary& summary;
};

// Runs the steps from run.state.step to run.state.total_steps, filling run.summary's steps,
// tokens, checkpoint and interruption.
void run_steps(TrainingRun& run);

}  // namespace glmtune::train

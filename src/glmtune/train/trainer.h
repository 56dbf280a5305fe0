#pragma once
// Supervised fine-tuning of the text model on the CPU reference path: `glmtune train`.
//
// One optimizer step (docs/training.md, "Running"):
//   1. take `micro_packs` packs from the sampler;
//   2. count the step's label tokens (the LM denominator) and, per MTP depth, its MTP targets;
//   3. per pack: forward (activations kept or recomputed per layer, recipe `recompute`) and
//      backward of  LM CE / N_lm + mtp_scale · mean_k (MTP CE_k / N_k) + α · balancing loss,
//      gradients adding up over the packs; expert loads collected per router;
//   4. a non-finite loss or gradient skips the update or stops the run (recipe `on_nonfinite`),
//      naming the step and the offending tensors; otherwise global-norm clip and AdamW;
//   5. router correction-bias update from the step's loads (also on a skipped step);
//   6. metrics line + OUT/metrics.jsonl; a checkpoint every `save_every` steps, at the end, and
//      when a stop was requested (SIGINT / SIGTERM in the CLI).
//
// A resumed run continues bit for bit: the model is rebuilt from the checkpoint's weights, the
// optimizer from its masters and moments, the sampler from its position, and the schedule is a
// pure function of the step.
//
// The pieces (trainer.cpp puts them in order): trainer_setup.h (output, resume point, data,
// weights, model), parallelize.h (ep, sp, fsdp), trainer_optimizer.h (the optimizer, and who owns
// the weights), step_loop.h (the steps), step_metrics.h, checkpointer.h.

#include <atomic>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "glmtune/tensor/tensor.h"
#include "glmtune/train/metrics.h"
#include "glmtune/train/recipe.h"

namespace glmtune::dist {
class ParallelContext;
}

namespace glmtune::train {

struct TrainerOptions {
  // The ranks of a distributed run (dist/parallel.h); null runs single-process. Every rank calls
  // run_training with the same recipe: each step's packs are split over the data-parallel ranks,
  // the optimizer state is sharded over them (dist/sharded_optimizer.h), rank 0 logs metrics and
  // writes checkpoints (docs/distributed.md).
  dist::ParallelContext* parallel = nullptr;
  // Continue from the newest complete checkpoint under the output directory (a fresh start when
  // there is none). Without it, an output directory that already holds checkpoints is refused.
  bool resume = false;
  // Checked after every step; when it becomes true the run saves a checkpoint and returns.
  const std::atomic<bool>* stop = nullptr;
  // Print the per-step log lines (metrics.jsonl is written either way).
  bool print_steps = true;
  // Called after every step's metrics are logged, before its checkpoint decision (tests use it to
  // request a stop at a chosen step).
  std::function<void(const StepMetrics&)> on_step;
  // Called after every step's backward with the step number (1-based) and a setter of gradient
  // buffers by internal parameter name (tests use it to inject a non-finite gradient).
  std::function<void(int64_t step, const std::function<Tensor&(const std::string&)>& grad)>
      on_gradients;
  // Vision-language data: decode the next step's media on a host thread while a step computes
  // (train/vl_batch.h, VlTraining::prefetch). Off, each pack's media decode when it is trained.
  bool prefetch_media = true;
};

struct TrainSummary {
  int64_t start_step = 0;  // steps already done when this invocation began (resume)
  int64_t end_step = 0;    // steps done when it returned
  int64_t total_steps = 0;
  bool resumed = false;
  bool interrupted = false;  // stopped early on request
  int64_t skipped_steps = 0;
  std::vector<StepMetrics> steps;    // the steps this invocation ran, in order
  int64_t text_tokens = 0;           // non-padding tokens this invocation trained on
  double seconds = 0;                // wall time of this invocation's steps
  std::filesystem::path checkpoint;  // the last checkpoint written (empty if none)
  std::filesystem::path metrics;     // OUT/metrics.jsonl
};

// Runs (or resumes) the training described by `recipe`. Throws glmtune::Error for bad input
// (missing model or data, a device other than the CPU, an output directory holding another run, a
// token cache prepared differently), for a non-finite step under `on_nonfinite = "stop"` (after
// logging it, saving nothing), and rather than save weights that are not finite.
TrainSummary run_training(const Recipe& recipe, const TrainerOptions& options = {});

// The test hook of the kill-during-save tests: when the environment variable
// GLMTUNE_TEST_SAVE_DELAY_MS is set, every checkpoint save sleeps that long after writing the
// model and before the optimizer state, so that a test can kill the process mid-save.
inline constexpr const char* kSaveDelayEnv = "GLMTUNE_TEST_SAVE_DELAY_MS";

}  // namespace glmtune::train

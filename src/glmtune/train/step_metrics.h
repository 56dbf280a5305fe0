#pragma once
// The metrics of one training step (train/metrics.h) from what the step computed.

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "glmtune/model/text/backward.h"
#include "glmtune/train/metrics.h"
#include "glmtune/train/parallelize.h"

namespace glmtune::train {

// What one step computed, summed over its packs and ranks.
struct StepResult {
  int64_t step = 0;  // steps done, this one included
  int64_t total_steps = 0;
  int64_t epoch = 0;
  double lm_loss = 0, balancing_loss = 0, grad_norm = 0, lr = 0, maxvio = 0;
  std::vector<double> mtp_loss_sums;     // per depth
  std::vector<double> mtp_denominators;  // per depth
  bool skipped = false;
  std::vector<std::string> nonfinite;
};

// The step's metrics: the losses, its throughput on this rank (`text_tokens` and `slots` of the
// whole step, every rank's; the time since `start`), the model FLOPs of its packs, the device's
// memory peaks (reset here) and, on several GPUs, the time spent in NCCL (reset too).
StepMetrics step_metrics(const StepResult& result, double mtp_scale,
                         const std::vector<model::text::PackInput>& packs, int64_t text_tokens,
                         int64_t slots, std::chrono::steady_clock::time_point start,
                         const model::TextConfig& tc, bool mtp, const ParallelLayout& layout,
                         ThroughputMeter& meter);

}  // namespace glmtune::train

#pragma once
// Per-step training metrics, under the names users of the reference trainer know:
//
//   loss            LM cross-entropy of the step (token mean over all micro-packs and ranks)
//   mtp_loss        scaled MTP loss (mtp_scale × mean CE of the next-next token)
//   balancing_loss  α × Σ_layers balancing loss
//   grad_norm       global gradient L2 norm before clipping
//   lr              learning rate the step used
//   tgs             non-padding tokens per GPU-second (this rank's tokens / step time)
//   seqlen_tgs      all token slots, padding included, per GPU-second
//   exp_tgs         cumulative non-padding tokens / cumulative training time (survives resume)
//   max_memory      peak bytes allocated during the step, GB (2^30 bytes, as the reference
//                   trainer counts)
//   reserved_memory peak bytes reserved by the allocator during the step, GB
//   maxvio          mean over MoE routers of (max expert load − mean load) / mean load
//   eta             seconds left at the mean step time so far
//   model_tflops    model FLOPs of the step's packs (train/flops.h: the text model, non-padding
//                   documents, backward = 2 × forward) per rank and second, in TFLOP/s
//   mfu             model_tflops / the H200's dense bf16 peak (989.4 TFLOP/s); GPU runs only
//   comm_time       seconds this rank's GPU spent in NCCL collectives during the step (each from
//                   when it could start to its end; overlapped with compute or not); runs of
//                   several GPUs only
//
// Each step is one JSON object appended to OUT/metrics.jsonl (flushed at once, so a killed run
// loses nothing already logged) and, every log_every steps, one human-readable log line.

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "glmtune/tensor/device.h"

namespace glmtune::train {

struct StepMetrics {
  int64_t step = 0;  // optimizer steps completed, this one included
  int64_t total_steps = 0;
  int64_t epoch = 0;
  double loss = 0, mtp_loss = 0, balancing_loss = 0;
  double grad_norm = 0, lr = 0;
  double tgs = 0, seqlen_tgs = 0, exp_tgs = 0;
  double max_memory = 0, reserved_memory = 0;
  double maxvio = 0;
  double eta = 0;
  double model_tflops = 0;
  double mfu = std::numeric_limits<double>::quiet_NaN();        // null in JSON: a CPU run
  double comm_time = std::numeric_limits<double>::quiet_NaN();  // null: not several GPUs
  double step_time = 0;                                         // seconds
  int64_t text_tokens = 0;      // non-padding tokens of this rank in the step
  int64_t seqlen_tokens = 0;    // all token slots of this rank in the step
  int64_t consumed_tokens = 0;  // cumulative non-padding tokens of this rank
  bool skipped = false;         // the update was skipped (non-finite loss or gradient)
  // What was not finite on a skipped step: "loss" (the LM, MTP or balancing loss) and / or the
  // released names of the first parameters whose gradient holds a non-finite value.
  std::vector<std::string> nonfinite;

  // Non-finite values (a skipped step's grad_norm) are written as null.
  nlohmann::json to_json() const;
  // "step 3/20 loss 2.3456 mtp_loss ... eta 1m02s".
  std::string log_line() const;
};

// Cumulative counters behind exp_tgs and eta; part of the trainer state, so they continue
// across a resume.
struct ThroughputTotals {
  int64_t steps = 0;
  int64_t text_tokens = 0;
  int64_t seqlen_tokens = 0;
  double seconds = 0.0;

  nlohmann::json to_json() const;
  // Throws glmtune::Error naming `source` for a malformed object.
  static ThroughputTotals from_json(const nlohmann::json& j, const std::string& source);
};

class ThroughputMeter {
 public:
  explicit ThroughputMeter(ThroughputTotals start = {}) : totals_(start) {}
  // Accounts one step of this rank and fills m.tgs, seqlen_tgs, exp_tgs, eta, step_time,
  // text_tokens, seqlen_tokens and consumed_tokens (m.step and m.total_steps must be set).
  void record(StepMetrics& m, int64_t text_tokens, int64_t seqlen_tokens, double seconds);
  const ThroughputTotals& totals() const { return totals_; }

 private:
  ThroughputTotals totals_;
};

struct MemoryPeaks {
  double max_memory = 0;       // GB
  double reserved_memory = 0;  // GB
};
// Peak allocated / reserved memory of `device`'s allocator since the last call, then resets the
// peaks (the reference trainer resets them at each step).
MemoryPeaks take_memory_peaks(Device device);

class MetricsLog {
 public:
  // Opens OUT/metrics.jsonl for appending. Records of steps after `resume_step` (written by a run
  // that was stopped after its last checkpoint, and about to be redone) and a torn last line are
  // dropped first, so the file holds each step once. A fresh run passes 0.
  MetricsLog(const std::filesystem::path& output_dir, int64_t resume_step, int64_t log_every = 1);

  // Appends and flushes the JSON line; prints the log line on every log_every-th step, the last
  // step and any skipped step.
  void write(const StepMetrics& m);
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
  std::ofstream out_;
  int64_t log_every_;
};

// "0:01:02" style duration for eta in log lines (hours may exceed 24).
std::string format_eta(double seconds);

}  // namespace glmtune::train

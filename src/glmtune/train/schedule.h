#pragma once
// The learning-rate schedule: linear warmup from 0, then cosine decay to `lr_min`.
//
// `step` is the 0-based index of the optimizer step about to be taken (the first update uses
// lr(0)). With W warmup steps and N total steps:
//
//   lr(s) = lr · s / W                                              for 0 <= s < W
//   lr(s) = lr_min + (lr − lr_min) · (1 + cos(π · (s − W) / (N − W))) / 2   for W <= s < N
//   lr(s) = lr_min                                                  for s >= N
//
// This is the reference trainer's schedule (a LambdaLR warmup `s / W` chained with
// CosineAnnealingLR(T_max = N − W, eta_min = lr_min)) written as a closed form, so the value at
// any step is a pure function of the step: a resumed run needs no scheduler state. Note that with
// warmup the very first update has lr 0 (it only seeds AdamW's moments), exactly as in the
// reference trainer; the last update (s = N − 1) is one cosine step above lr_min.

#include <cstdint>

namespace glmtune::train {

class Schedule {
 public:
  // Throws glmtune::Error (naming the recipe keys) when lr < 0, lr_min < 0, lr_min > lr,
  // total_steps < 1, or warmup_steps is negative or not shorter than total_steps.
  Schedule(double lr, double lr_min, int64_t warmup_steps, int64_t total_steps);

  double lr(int64_t step) const;

  double peak_lr() const { return lr_; }
  double lr_min() const { return lr_min_; }
  int64_t warmup_steps() const { return warmup_; }
  int64_t total_steps() const { return total_; }

 private:
  double lr_, lr_min_;
  int64_t warmup_, total_;
};

// Warmup steps from a fraction of the run: floor(ratio · total_steps), as the reference trainer
// computes int(warmup_ratio · total_steps). `ratio` must be in [0, 1).
int64_t warmup_steps_from_ratio(double ratio, int64_t total_steps);

}  // namespace glmtune::train

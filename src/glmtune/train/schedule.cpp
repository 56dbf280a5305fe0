#include "glmtune/train/schedule.h"

#include <fmt/format.h>

#include <cmath>
#include <numbers>

#include "glmtune/base/error.h"

namespace glmtune::train {

Schedule::Schedule(double lr, double lr_min, int64_t warmup_steps, int64_t total_steps)
    : lr_(lr), lr_min_(lr_min), warmup_(warmup_steps), total_(total_steps) {
  const std::string where = "learning-rate schedule";
  if (!std::isfinite(lr) || lr < 0)
    throw Error(fmt::format("lr must be a finite number >= 0, got {}", lr), where,
                "set optimizer.lr in the recipe, e.g. 1e-5");
  if (!std::isfinite(lr_min) || lr_min < 0 || lr_min > lr)
    throw Error(fmt::format("lr_min must be in [0, lr = {}], got {}", lr, lr_min), where,
                "set optimizer.lr_min to at most optimizer.lr");
  if (total_steps < 1)
    throw Error(fmt::format("the run has {} optimizer steps; it needs at least 1", total_steps),
                where, "set train.total_steps (or train.epochs) so that the run has steps");
  if (warmup_steps < 0 || warmup_steps >= total_steps)
    throw Error(fmt::format("warmup of {} steps in a run of {} steps: warmup must be shorter "
                            "than the run",
                            warmup_steps, total_steps),
                where, "lower optimizer.warmup_steps / optimizer.warmup_ratio or train longer");
}

double Schedule::lr(int64_t step) const {
  if (step < 0) step = 0;
  if (step < warmup_) return lr_ * double(step) / double(warmup_);
  if (step >= total_) return lr_min_;
  // The cosine starts at the peak itself: lr_min + (lr - lr_min) need not round back to lr.
  if (step == warmup_) return lr_;
  const double progress = double(step - warmup_) / double(total_ - warmup_);
  return lr_min_ + (lr_ - lr_min_) * 0.5 * (1.0 + std::cos(std::numbers::pi * progress));
}

int64_t warmup_steps_from_ratio(double ratio, int64_t total_steps) {
  GLMTUNE_ASSERT(ratio >= 0 && ratio < 1, "warmup ratio {} outside [0, 1)", ratio);
  return int64_t(std::floor(ratio * double(total_steps)));
}

}  // namespace glmtune::train

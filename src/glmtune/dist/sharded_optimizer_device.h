#pragma once
// The GPU arithmetic of ShardedAdamW's device-resident shard (sharded_optimizer.h), in
// sharded_optimizer_cuda.cpp: CUDA builds only.
#include <array>
#include <vector>

#include "glmtune/tensor/tensor.h"
#include "glmtune/train/optimizer.h"

namespace glmtune::dist::detail {

#ifdef GLMTUNE_WITH_CUDA
// Σ g² over `grads` (f32 on one GPU), in f64, deterministic.
double device_sq_norm(const std::vector<Tensor>& grads);
// One AdamW update of every piece ({master, exp_avg, exp_avg_sq}, f32 on the GPU) from `grads`
// (aligned) scaled by `clip`, as update number `step` (train::AdamW's formula and bias correction).
void device_adamw(std::vector<std::array<Tensor, 3>>& state, const std::vector<Tensor>& grads,
                  const train::AdamWConfig& config, double lr, double clip, int64_t step);
#endif

}  // namespace glmtune::dist::detail

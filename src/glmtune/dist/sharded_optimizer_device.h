#pragma once
// The GPU arithmetic of the device-resident optimizer states (ShardedAdamW's shard,
// sharded_optimizer.h; ShardedLayerAdamW's pieces, fsdp.h): the kernels' wrappers in
// sharded_optimizer_cuda.cpp (CUDA builds only), device_update in sharded_optimizer.cpp.
#include <array>
#include <vector>

#include "glmtune/tensor/tensor.h"
#include "glmtune/train/optimizer.h"

namespace glmtune::dist::detail {

// One update of a device-resident state with the global norm: a non-finite norm skips (nothing
// changes, `step` included), as in train::AdamW; otherwise device_adamw with the clip coefficient
// as update number ++step. Throws in a build without CUDA (no device state can exist there).
train::StepReport device_update(std::vector<std::array<Tensor, 3>>& state,
                                const std::vector<Tensor>& grads, const train::AdamWConfig& config,
                                double lr, double global_grad_norm, int64_t& step);

#ifdef GLMTUNE_WITH_CUDA
// Σ g² over `grads` (f32 on one GPU), in f64, deterministic.
double device_sq_norm(const std::vector<Tensor>& grads);
// One AdamW update of every piece ({master, exp_avg, exp_avg_sq}, f32 on the GPU) from `grads`
// (aligned) scaled by `clip`, as update number `step` (train::AdamW's formula and bias correction).
void device_adamw(std::vector<std::array<Tensor, 3>>& state, const std::vector<Tensor>& grads,
                  const train::AdamWConfig& config, double lr, double clip, int64_t step);
#endif

}  // namespace glmtune::dist::detail

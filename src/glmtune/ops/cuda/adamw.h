#pragma once
// The optimizer step on the GPU (docs/training.md, "Optimizer"): global gradient norm with
// clipping, and a multi-tensor AdamW with fp32 master weights and moments whose bf16 parameter
// storage is refreshed from the master in the same pass.
//
// Multi-tensor: all tensors of a call are cut into fixed chunks of 65536 elements, described in
// one table uploaded per call, and one launch covers every chunk (thousands of parameters, one
// kernel). Chunk boundaries depend only on the tensor sizes.
//
// Gradient norm, deterministic two-pass reduction: pass 1 gives every chunk one partial sum of
// squares (fp64, fixed thread order and tree inside the chunk); pass 2, a single block, adds the
// partials in chunk order with a fixed tree. Reruns are bit-identical and the result does not
// depend on the GPU's SM count. The same pass computes the clipping coefficient
// min(1, max_norm / (norm + 1e-6)), left on the device so the step needs no host round trip; a
// non-finite norm makes it NaN, and the AdamW kernel then leaves every tensor untouched (the step
// is skipped, as the reference trainer does).
//
// AdamW (torch.optim.AdamW semantics, decoupled weight decay), per element in fp32 with
// g = grad · clip and t = step (1-based):
//   p ← p · (1 − lr·wd)
//   m ← β1·m + (1 − β1)·g          v ← β2·v + (1 − β2)·g²
//   p ← p − (lr / (1 − β1^t)) · m / (sqrt(v) / sqrt(1 − β2^t) + eps)
//   param ← bf16(p)                (when a bf16 storage tensor is given)

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "glmtune/tensor/tensor.h"

namespace glmtune::cuda {

struct GradNorm {
  Tensor norm;  // f64 [1] on the device: sqrt(Σ g²) over every gradient
  Tensor clip;  // f32 [1] on the device: min(1, max_norm / (norm + 1e-6)); NaN if norm is not
                // finite; 1 when max_norm <= 0 (no clipping) and the norm is finite
};

// grads: contiguous f32 or bf16 tensors on one CUDA device (any mix; empty ones are skipped).
GradNorm grad_norm(const std::vector<Tensor>& grads, double max_norm,
                   cudaStream_t stream = nullptr);

struct AdamWConfig {
  double lr = 1e-6;
  double beta1 = 0.9, beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.01;
  int64_t step = 1;  // 1-based count of the update being applied (bias correction)
};

// One parameter: all tensors contiguous, same numel, on one device.
struct AdamWParam {
  Tensor master;      // f32, updated in place
  Tensor exp_avg;     // f32, updated in place
  Tensor exp_avg_sq;  // f32, updated in place
  Tensor grad;        // f32 or bf16, read only
  Tensor param;       // bf16 storage refreshed from the master; undefined when there is none
};

// Applies one AdamW step to every parameter. `clip` (optional): the f32 [1] device scalar of
// grad_norm; gradients are multiplied by it, and a NaN skips the whole step. Asynchronous.
void adamw_step(const std::vector<AdamWParam>& params, const AdamWConfig& config,
                const Tensor& clip = Tensor(), cudaStream_t stream = nullptr);

}  // namespace glmtune::cuda

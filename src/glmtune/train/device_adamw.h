#pragma once
// AdamW on the GPU for a one-GPU run: train/optimizer.h's update, clipping and skipping rules with
// the multi-tensor kernels of ops/cuda/adamw.h, the fp32 masters and moments kept on the device
// beside the model, and AdamW::save's files on disk, so a checkpoint does not depend on where its
// optimizer ran (one saved on the GPU resumes on the CPU and the other way round).
//
// Without it a GPU step would copy every gradient to the host (4 bytes a parameter), update there
// and copy every weight back: at the crop25b geometry (5.35B trained parameters) several seconds
// against the step's one. On the device the update reads and writes about 18 bytes a parameter
// at the memory bandwidth (0.046 s for crop25b on an H200, docs/PERF.md).
//
// CUDA builds only (the trainer's GPU path).

#include <array>
#include <map>
#include <string>
#include <vector>

#include "glmtune/model/text/backward.h"
#include "glmtune/model/text/weights.h"
#include "glmtune/ops/cuda/adamw.h"
#include "glmtune/train/optimizer.h"

namespace glmtune::train {

// The kernel's settings (ops/cuda/adamw.h) for one update at `lr` as update number `step`
// (1-based).
cuda::AdamWConfig kernel_config(const AdamWConfig& config, double lr, int64_t step);

class DeviceAdamW {
 public:
  // `params`: the optimizer's parameters in its order (the store's values on the host; the
  // masters start from them). Each trainable one is matched by name with the model's compute
  // tensor in `weights` (on one GPU) and its gradient buffer in `grads`. The forward sees the
  // stored value, as on the host: an f32-stored tensor is its own master; a bf16-stored one gets
  // an f32 master and every update sets the compute tensor to the master rounded to bf16 (widened
  // again where the compute tensor is f32). InternalError when a trainable parameter has no
  // compute tensor or gradient buffer of its shape on the device. `weights` and `grads` are
  // (name, tensor) lists, e.g. TextWeights::named and TextGrads::named, plus the vision tower's
  // released views in a vision-language run; the tensors share storage with the model's.
  using Named = std::vector<std::pair<std::string, Tensor>>;
  DeviceAdamW(const std::vector<NamedParam>& params, Named weights, Named grads,
              AdamWConfig config);

  // Updates applied so far (skipped steps do not count): the t of the bias correction.
  int64_t step_count() const { return step_; }
  // The global L2 norm of the gradients (f64, deterministic; read back to the host) and, kept on
  // the device for step(), the clip coefficient min(1, max_norm / (norm + 1e-6)).
  double grad_norm();
  // One update at `lr` with the clip of the last grad_norm(), which `grad_norm` repeats for the
  // report; with `skip` (or a non-finite norm) nothing changes, the step count included.
  StepReport step(double lr, double grad_norm, bool skip);

  // Masters, moments and step count from a saved state (which the caller has checked against the
  // trained tensors); each bf16 compute tensor becomes its master rounded, as AdamW::load does.
  void load(const SavedAdamWState& saved);
  // Host copies, flattened, of one trained parameter's {master, exp_avg, exp_avg_sq}: what
  // save_optimizer_state writes for it.
  std::array<Tensor, 3> state(const std::string& name) const;
  // The master of every trained parameter (f32, on the device), by name.
  std::vector<std::pair<std::string, Tensor>> masters() const;
  // Bytes of device memory held by the optimizer: the separate masters and the moments.
  int64_t state_bytes() const;

 private:
  size_t index_of(const std::string& name) const;

  std::vector<std::string> names_;
  std::vector<cuda::AdamWParam> params_;  // aligned with names_
  std::vector<Tensor> grads_;             // the gradient buffers, for the norm
  // bf16-stored parameters whose compute tensor is f32: the rounded master (the kernel's bf16
  // output) and the compute tensor it is widened into after each update.
  std::vector<std::pair<Tensor, Tensor>> widened_;
  std::map<std::string, size_t> index_;
  AdamWConfig config_;
  int64_t step_ = 0;
  Tensor clip_;  // f32 [1] on the device, from the last grad_norm()
};

}  // namespace glmtune::train

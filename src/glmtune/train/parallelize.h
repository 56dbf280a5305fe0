#pragma once
// Where a training run computes and how its model is divided over the ranks (docs/distributed.md):
// the device, the data-parallel group, and the three ways to split the model itself, which
// parallelize() applies in this order:
//
//   ep    expert parallelism: each rank keeps the routed experts of its ep slice (loaded so from
//         the checkpoint: expert_range()), and the MoE layers send tokens to the ranks holding
//         their experts (dist/expert_parallel.h, dist/expert_shards.h);
//   sp    sequence parallelism: the ranks of an sp group share each pack, one contiguous shard of
//         rows each, and the mixers exchange what crosses the shards (dist/sequence_parallel.h);
//   fsdp  fully sharded decoder layers: each rank keeps a slice of every decoder layer's weights
//         and gradient, gathered around each use (dist/fsdp.h).
//
// The optimizer (train/trainer_optimizer.h) then trains what each rank holds.

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "glmtune/dist/comm.h"
#include "glmtune/dist/expert_parallel.h"
#include "glmtune/dist/expert_shards.h"
#include "glmtune/dist/fsdp.h"
#include "glmtune/dist/parallel.h"
#include "glmtune/dist/sequence_parallel.h"
#include "glmtune/model/param_store.h"
#include "glmtune/model/text/backward.h"
#include "glmtune/model/text/fp8_layers.h"
#include "glmtune/model/text/model.h"
#include "glmtune/tensor/device.h"
#include "glmtune/train/recipe.h"
#include "glmtune/train/trainer_optimizer.h"

namespace glmtune::train {

// Built once per run and never moved (the parts refer to each other).
struct ParallelLayout {
  // Picks the device (each rank of a node its node-local GPU) and makes it current. glmtune::Error
  // naming train.device when it cannot be had.
  ParallelLayout(const Recipe& recipe, dist::ParallelContext* parallel);
  ParallelLayout(const ParallelLayout&) = delete;
  ParallelLayout& operator=(const ParallelLayout&) = delete;

  // ep: the expert layout of a model with `n_routed_experts` (before the weights are read).
  void plan_experts(const Recipe& recipe, int64_t n_routed_experts);
  // The routed experts this rank loads; nullopt loads all of them.
  std::optional<model::ExpertRange> expert_range() const;
  // ep: takes this rank's expert slices of the loaded `store` (trained in place).
  void hold_experts(model::ParamStore& store);
  // Every rank of the job (1 without a launcher).
  int64_t ranks() const { return distributed ? par->sizes().world : 1; }

  dist::ParallelContext* par = nullptr;  // null single-process
  bool on_gpu = false;
  bool distributed = false;
  bool root = true;  // logs and saves
  Device device;
  int64_t dp = 1, dp_rank = 0;
  bool sequence_parallel = false;
  bool expert_sharded = false;
  bool fsdp = false;
  // fsdp without a launcher shards over a group of one.
  std::unique_ptr<dist::Communicator> self_group;
  // The optimizer is sharded over dp_group when there is one; on GPUs device_dp_group moves the
  // device tensors (NCCL; a group of one moves them locally).
  dist::Communicator* dp_group = nullptr;
  dist::Communicator* device_dp_group = nullptr;

  std::optional<dist::ExpertParallel> experts;      // ep
  std::optional<dist::LocalExperts> local_experts;  // ep: this rank's slices in the store
  std::optional<dist::UlyssesParallel> ulysses;     // sp
  std::optional<dist::ShardedLayers> layers;        // fsdp
  std::optional<model::text::Fp8Layers> fp8_base;   // lora.base or train.frozen_weights "fp8"
  // fsdp: decoder-layer router biases the store keeps (the bias rule updates them there) and the
  // slices copy after every step.
  std::vector<std::string> biases_in_store;
};

// Applies ep, sp and fsdp, as the layout asks, to `model` (its gradient buffers `grads`, its step
// options `train`): `read` gives the elements of this rank's decoder-layer slices (the store
// holds placeholders for the deferred ones). `num_layers`: the decoder layers.
void parallelize(ParallelLayout& layout, const Recipe& recipe, model::text::TextModel& model,
                 model::text::TextGrads& grads, model::text::TrainOptions& train,
                 const model::ParamStore& store, const PieceReader& read, int64_t num_layers);

}  // namespace glmtune::train

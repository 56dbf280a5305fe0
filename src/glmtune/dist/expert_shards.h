#pragma once
// The routed experts' memory divided by the expert-parallel size (docs/distributed.md, "How
// expert parallelism works"): weights, gradients and optimizer state of this rank's slice only.
//
// Every MoE layer (decoder layers and the MTP layer) fuses its routed experts into
// `<layer>.mlp.experts.gate_up_proj` [n, 2I, D] and `<layer>.mlp.experts.down_proj` [n, D, I]
// (param_store.h). With ep_size = E, each rank loads its parameter store with its slice only,
// experts [first, first + n/E) as tensors [n/E, ...] (local_range; local expert j is expert
// first + j, ExpertParallel's layout): the other experts are never read. LocalExperts trains these
// slices in place. The model built from that store holds the slice as its compute tensors,
// TextGrads::zeros_like sizes the gradient buffers the same way, and ExpertParallel computes
// exactly these experts. The tensors keep their internal names, so a name means the same parameter
// on every rank and in a checkpoint; only the shape differs. LoRA adapters on the fused tensors
// (lora.target_parameters: A [n, r, in], B [n, out, r], model/lora.h) are held, trained and saved
// the same way: the store holds this rank's [n/E, ...] of them, and the exchange applies each
// local expert's adapter with its weights.
//
// ExpertAdamW trains the slice: a ShardedAdamW over the edp group, the ranks holding the same
// slice (same ep index, one per ep group): it sums their gradients (each is complete for the
// tokens of its ep group) and shards the fp32 masters and moments over them (ZeRO), so a rank
// keeps 1/dp of the experts' optimizer state, as for the replicated tensors. Its squared shard
// norm joins the replicated optimizer's norm sum over dp, where every (ep index, edp rank) pair
// appears once: each expert element is counted exactly once in the global norm.
//
// Checkpoints keep the released layout: the slices are gathered one tensor at a time (over the ep
// group) and written before the next, and so is their optimizer state (over edp, then ep), in the
// unsharded format; a resume reads this rank's range of each saved tensor straight from the mapped
// files, so the expert layout may change between runs and no rank holds a whole expert tensor's
// state.
#include <array>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "glmtune/dist/comm.h"
#include "glmtune/dist/expert_parallel.h"
#include "glmtune/dist/sharded_optimizer.h"
#include "glmtune/model/param_store.h"
#include "glmtune/train/optimizer.h"

namespace glmtune::dist {

// The routed experts this rank holds, [first_expert(), first_expert() + local_experts()): the range
// to load its parameter store with (model::ParamStore::load).
model::ExpertRange local_range(const ExpertParallel& experts);

class LocalExperts {
 public:
  // Takes the routed-expert tensors of `store` and their adapters (model::is_expert_sliced),
  // loaded with local_range(experts) so that they are this rank's slices [n/E, ...]; they stay
  // the store's tensors and are updated in place.
  LocalExperts(model::ParamStore& store, const ExpertParallel& experts);

  const ExpertParallel& experts() const { return experts_; }
  // The slices in store order, sharing storage with the store's tensors; frozen ones are marked
  // not trainable.
  std::vector<train::NamedParam> params() const;
  bool holds(const std::string& name) const;

  // Bytes of the routed-expert tensors: whole (what a rank holds without expert parallelism) and
  // this rank's slices (measured).
  int64_t full_bytes() const { return full_bytes_; }
  int64_t local_bytes() const;

  // Collective over the ep group: the full value of the expert tensor `name` (storage dtype).
  Tensor gather_one(const std::string& name) const;
  // Collective over `everyone` (a group that holds every slice, e.g. the world): the released
  // per-expert names (`...experts.<e>.gate_proj.weight`, at most `limit`) whose part of
  // `local(name)`, a slice-shaped tensor or nullptr, holds a non-finite element on any rank; an
  // adapter is named whole, as one process names it.
  std::vector<std::string> nonfinite(const std::function<const Tensor*(const std::string&)>& local,
                                     Communicator& everyone, size_t limit) const;

 private:
  struct Entry {
    std::string name;
    Tensor local;                      // [n/E, ...], the store's tensor
    std::vector<std::string> sources;  // released names, as in model::InternalParam
    bool trainable = true;             // false when train.freeze froze it
  };
  const ExpertParallel& experts_;
  std::vector<Entry> entries_;
  int64_t full_bytes_ = 0;
};

class ExpertAdamW {
 public:
  // Trains the slices of `experts` (the store's tensors: updates are written into them) with
  // AdamW sharded over `edp`, the ranks holding the same slice. `edp_device`: the same ranks for
  // GPU gradients (NCCL), as ShardedAdamW's device group.
  ExpertAdamW(const LocalExperts& experts, train::AdamWConfig config, Communicator& edp,
              Communicator* edp_device = nullptr);

  // The slice parameters (names of the full tensors, slice shapes); gradients are given aligned
  // with them.
  const std::vector<train::NamedParam>& params() const { return shards_.params(); }
  // Collective over edp. Reduce-scatters this rank's slice gradients and returns the squared norm
  // of the reduced shard here (local part only: summed over dp with the replicated tensors' norm,
  // ShardedAdamW::reduce_gradients(grads, other_sq_norm), it gives the global norm).
  double reduce_gradients(const std::vector<Tensor>& grads);
  // Local update of the shard, then an all-gather over edp into the slices.
  train::StepReport step(double lr, double global_grad_norm);
  // Bytes of optimizer state on this rank, measured.
  int64_t state_bytes() const { return shards_.state_bytes(); }
  // GPU runs: ShardedAdamW::keep_on_device / write_params for the slices (`compute` aligned with
  // params(): the model's slice tensors).
  void keep_on_device(std::vector<Tensor> compute) { shards_.keep_on_device(std::move(compute)); }
  void write_params() { shards_.write_params(); }

  // Collective over edp, then over ep among the edp groups' first ranks: the whole state
  // {master, exp_avg, exp_avg_sq} ([numel] f32 each) of the expert tensor `name` on the rank that
  // is first in both groups, undefined elsewhere. Called by every rank of one sp index at least;
  // every rank asks for the same names in order.
  std::array<Tensor, 3> gather_state(const std::string& name) const;
  // Collective over edp. Restores this rank's part of the slices' state from a saved state
  // directly: each rank reads only its range of its slice of each saved expert tensor. The slices
  // keep the values they were loaded with: a checkpoint's model holds the masters rounded to the
  // storage dtype, as the saving run held them.
  void load(const train::SavedAdamWState& saved);

 private:
  const LocalExperts& experts_;
  Communicator& edp_;
  ShardedAdamW shards_;
};

}  // namespace glmtune::dist

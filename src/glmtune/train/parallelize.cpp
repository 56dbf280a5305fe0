#include "glmtune/train/parallelize.h"

#include <fmt/format.h>

#include "glmtune/base/error.h"
#include "glmtune/tensor/allocator.h"
#include "glmtune/train/optimizer_variants.h"

namespace glmtune::train {
namespace {

// The GPU this process trains on. Ranks sharing a node take one GPU each, the node-local
// rank's, so a distributed recipe names the kind of device only.
Device training_device(const Recipe& recipe, const dist::ParallelContext* par) {
  const int visible = cuda_device_count();
  if (par == nullptr || !par->distributed() || par->local_size() == 1) {
    if (recipe.device.index >= visible)
      throw Error(
          fmt::format("{} asked for, but {} GPU(s) are visible", recipe.device.str(), visible),
          recipe.source() + ": train.device",
          "pick a device below the number of visible GPUs (CUDA_VISIBLE_DEVICES)");
    return recipe.device;
  }
  if (recipe.device.index != 0)
    throw Error(fmt::format("device {} in a run of {} ranks on this node", recipe.device.str(),
                            par->local_size()),
                recipe.source() + ": train.device",
                "set device = \"cuda\": each rank of a node takes the GPU of its node-local rank");
  if (par->local_size() > visible)
    throw Error(
        fmt::format("{} ranks on this node but {} GPU(s) visible", par->local_size(), visible),
        recipe.source() + ": train.device",
        "launch one rank per GPU (mpirun -np N with N GPUs per node, or srun "
        "--ntasks-per-node=N --gpus-per-node=N)");
  return Device::cuda(par->local_rank());
}

}  // namespace

ParallelLayout::ParallelLayout(const Recipe& recipe, dist::ParallelContext* parallel)
    : par(parallel),
      on_gpu(recipe.device.is_cuda()),
      distributed(parallel != nullptr && parallel->distributed()) {
  device = on_gpu ? training_device(recipe, par) : Device::cpu();
  root = par == nullptr || par->is_root();
  if (on_gpu && distributed) {
    // Every layout over NCCL, one rank per GPU.
    par->use_gpu(device.index);
  } else if (on_gpu) {
    use_cuda_device(device.index);
  }
  // Distributed: each step's packs are split over the data-parallel ranks, whose gradients,
  // losses and expert loads are summed; rank 0 logs and saves.
  dp = distributed ? par->sizes().dp : 1;
  dp_rank = distributed ? par->dp().rank() : 0;
  sequence_parallel = distributed && par->sizes().sp > 1;
  expert_sharded = distributed && par->sizes().ep > 1;
  fsdp = recipe.fsdp;
  if (fsdp && !distributed) self_group = dist::make_self_communicator("dp");
  dp_group = distributed ? &par->dp() : self_group.get();
  device_dp_group = !on_gpu ? nullptr : distributed ? par->dp_gpu() : self_group.get();
}

void ParallelLayout::plan_experts(const Recipe& recipe, int64_t n_routed_experts) {
  // Each rank loads and keeps the routed experts of its ep slice only (weights, gradients,
  // optimizer state: dist/expert_shards.h); the other tensors stay replicated as without it.
  if (expert_sharded)
    experts.emplace(par->ep(), n_routed_experts, recipe.source() + ": train.ep_size",
                    on_gpu ? par->ep_gpu() : nullptr);
}

std::optional<model::ExpertRange> ParallelLayout::expert_range() const {
  return experts ? std::optional(dist::local_range(*experts)) : std::nullopt;
}

void ParallelLayout::hold_experts(model::ParamStore& store) {
  // The store holds this rank's expert slices, so the model built from it holds them as its
  // compute tensors and its gradient buffers are slice-sized too.
  if (expert_sharded) local_experts.emplace(store, *experts);
}

void parallelize(ParallelLayout& layout, const Recipe& recipe, model::text::TextModel& model,
                 model::text::TextGrads& grads, model::text::TrainOptions& train,
                 const model::ParamStore& store, const PieceReader& read, int64_t num_layers) {
  const model::TextConfig& tc = model.text();
  // ep: tokens travel to the ranks holding their experts.
  if (layout.experts) train.expert_dispatch = &*layout.experts;
  // sp: the ranks of an sp group share each pack, one contiguous shard of rows each; the mixers
  // exchange what crosses the shards.
  if (layout.sequence_parallel) {
    dist::ParallelContext* par = layout.par;
    layout.ulysses.emplace(par->sp(), tc.linear_num_heads, tc.num_attention_heads,
                           recipe.source() + ": train.sp_size",
                           layout.on_gpu ? par->sp_gpu() : nullptr);
    train.sequence_parallel = &*layout.ulysses;
  }
  // fsdp: weights gathered over dp around each use (the next layer's transfer overlapping the
  // current one), gradients reduce-scattered into slices right after each layer's backward; the
  // model holds placeholders for the deferred tensors, and each rank reads its slices' elements.
  // The routed-expert slices of ep differ per ep rank, so they stay out of the dp layout.
  if (!layout.fsdp) return;
  const dist::LocalExperts* experts = layout.local_experts ? &*layout.local_experts : nullptr;
  layout.layers.emplace(
      model.weights(), grads, *layout.dp_group,
      dist::LayerSource{
          [s = &store](const std::string& name) -> std::optional<Shape> {
            const model::InternalParam& p = s->param(name);
            return p.deferred ? std::optional(p.shape) : std::nullopt;
          },
          read, [experts](const std::string& name) { return experts && experts->holds(name); }},
      layout.device_dp_group);
  for (const model::InternalParam& p : store.params())
    if (in_decoder_layer(p.name, num_layers) && p.name.ends_with("e_score_correction_bias") &&
        !(experts && experts->holds(p.name)))
      layout.biases_in_store.push_back(p.name);
  train.layer_params = &*layout.layers;
}

}  // namespace glmtune::train

#include "glmtune/train/step_loop.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <optional>
#include <span>

#include "glmtune/base/error.h"
#include "glmtune/model/loss.h"
#include "glmtune/ops/fp8.h"
#include "glmtune/train/router_bias.h"
#include "glmtune/train/step_metrics.h"

namespace glmtune::train {
namespace {

using Clock = std::chrono::steady_clock;
using model::text::PackInput;

Tensor i32(const std::vector<int32_t>& v) { return Tensor::from_vector(v, {int64_t(v.size())}); }

// Copies the store's (updated) parameters into the model's compute-dtype tensors. The forward
// therefore always sees the stored values (bf16 weights rounded from the f32 masters), exactly
// what a run resumed from a saved checkpoint sees.
void refresh_model(model::text::TextModel& model, const model::ParamStore& store) {
  // Sharded decoder layers are undefined between uses: their slices are updated by their own
  // optimizer and, for the router biases the store keeps, from the store after each step.
  for (auto& [name, t] : model.weights().named)
    if (t.defined()) t.copy_(store.get(name).to(t.dtype()));
}

// With the weights in the model's tensors on the GPU, of the store's values only the router
// correction biases change on the host (the bias rule) and are copied.
void refresh_router_biases(model::text::TextModel& model, const model::ParamStore& store) {
  for (auto& [name, t] : model.weights().named)
    if (t.defined() && name.ends_with("e_score_correction_bias"))
      t.copy_(store.get(name).to(t.dtype()));
}

// The packs of one step, every rank's, with the counts that make its denominators.
struct PackBatch {
  std::vector<data::Pack> packs;
  std::vector<PackInput> inputs;
  int64_t lm_targets = 0;
  std::vector<int64_t> mtp_targets;  // per depth
  int64_t text_tokens = 0;
  int64_t slots = 0;
};

PackBatch next_batch(data::PackSampler& sampler, int64_t micro_packs, int64_t mtp_depths) {
  PackBatch b;
  b.mtp_targets.assign(size_t(mtp_depths), 0);
  for (int64_t i = 0; i < micro_packs; ++i) {
    data::Pack pack = sampler.next();
    PackInput in;
    in.input_ids = i32(pack.input_ids);
    in.cu_seqlens = i32(pack.cu_seqlens);
    in.labels = i32(pack.labels);
    in.padding_tokens = pack.num_padding;
    b.lm_targets += pack.num_targets;
    for (int64_t k = 1; k <= mtp_depths; ++k) {
      const Tensor shifted = model::shift_labels(in.labels, in.cu_seqlens, k);
      const int32_t* l = shifted.data<int32_t>();
      for (int64_t r = 0; r < shifted.numel(); ++r)
        b.mtp_targets[size_t(k - 1)] += l[r] != model::kIgnoreLabel ? 1 : 0;
    }
    b.slots += int64_t(pack.input_ids.size());
    b.text_tokens += int64_t(pack.input_ids.size()) - pack.num_padding;
    b.packs.push_back(std::move(pack));
    b.inputs.push_back(std::move(in));
  }
  return b;
}

// The step's loss sums and expert loads: this rank's packs, then (reduce_over_ranks) every rank's.
struct StepSums {
  double lm = 0, balancing = 0;
  std::vector<double> mtp;  // per depth
  ExpertLoads loads;
};

// Forward and backward of this rank's packs of `batch`, gradients adding up.
StepSums forward_backward(TrainingRun& run, const PackBatch& batch) {
  const model::text::TrainOptions& topt = run.train;
  // Sharded decoder layers have no buffers between steps: their slices are zeroed instead.
  for (auto& [name, g] : run.grads.named)
    if (g.defined()) g.zero_();
  if (run.layout.layers) run.layout.layers->zero_gradients();
  if (run.vl) {
    run.vl->step().zero();
    // The next step's packs of this rank decode on a host thread while this step computes.
    std::vector<std::vector<int64_t>> next =
        run.sampler.peek(run.recipe.micro_packs * run.layout.dp);
    const size_t mine = size_t(run.layout.dp_rank * run.recipe.micro_packs);
    next.erase(next.begin(), next.begin() + std::min(mine, next.size()));
    if (next.size() > size_t(run.recipe.micro_packs)) next.resize(size_t(run.recipe.micro_packs));
    run.vl->prefetch(next);
  }
  StepSums sums;
  sums.mtp.assign(size_t(topt.mtp_depths), 0.0);
  const size_t first = size_t(run.layout.dp_rank * run.recipe.micro_packs);
  const std::span<const PackInput> my_packs =
      std::span<const PackInput>(batch.inputs).subspan(first, size_t(run.recipe.micro_packs));
  const double dropout = run.recipe.lora ? run.recipe.lora->dropout : 0.0;
  // train.fp8: each weight is quantised once per step, not again in the recompute and the
  // backward (ops/fp8.h). Not under fsdp: the blocks of every layer would stay on the device.
  std::optional<ops::Fp8WeightReuse> fp8_reuse;
  if (run.recipe.fp8_tilewise && !run.layout.layers) fp8_reuse.emplace();
  for (size_t k = 0; k < my_packs.size(); ++k) {
    const PackInput& in = my_packs[k];
    // lora.dropout: masks keyed by the seed, the step and the pack's index in the whole step (all
    // ranks), and drawn at each element's place in the pack, so data and sequence parallelism and
    // a resume draw what one uninterrupted process draws.
    if (dropout > 0)
      model::text::set_adapter_dropout(
          run.model.weights(), dropout,
          (uint64_t(run.recipe.seed) << 40) ^ (uint64_t(run.state.step) << 12) ^ (first + k + 1),
          run.layout.ulysses ? run.layout.ulysses->shard_begin(in.input_ids.numel()) : 0);
    const model::text::StepPackResult r =
        run.vl ? run.vl->run(batch.packs[first + k], in, topt, run.grads)
               : model::text::forward_backward(run.model, in, topt, run.grads);
    sums.lm += r.backward.lm_loss_sum;
    for (size_t d = 0; d < r.backward.mtp_loss_sum.size(); ++d)
      sums.mtp[d] += r.backward.mtp_loss_sum[d];
    sums.balancing += r.backward.balancing_loss;
    for (const auto& l : r.loads) {
      // On a GPU the counts stayed there through the pack (ops::moe_expert_counts); the loss
      // values above were read after the backward, so this copy waits for nothing.
      const Tensor counts = l.counts.to(Device::cpu());
      const int64_t* c = counts.data<int64_t>();
      sums.loads.add(l.bias_name, std::span<const int64_t>(c, size_t(counts.numel())));
    }
  }
  if (dropout > 0) model::text::set_adapter_dropout(run.model.weights(), dropout, 0);
  if (run.vl) run.vl->step().export_grads();
  return sums;
}

void reduce_over_ranks(TrainingRun& run, StepSums& sums) {
  ParallelLayout& layout = run.layout;
  dist::ParallelContext* par = layout.par;
  // Each rank of an sp group holds its shard's (and its heads') part of every gradient, the
  // vision tower's (its patches) included: their sum is the pack's gradient, which the dp
  // reduction below then treats as one rank's. With fsdp the decoder layers' parts were
  // reduce-scattered over dp in the backward already: the sp group's ranks hold the same slices,
  // and adding them gives each the whole step's slice.
  if (layout.sequence_parallel) {
    dist::Communicator& sp_sum = layout.on_gpu ? *par->sp_gpu() : par->sp();
    for (auto& [name, g] : run.grads.named)
      if (g.defined()) sp_sum.all_reduce(g);
    if (layout.layers) layout.layers->all_reduce_gradients(sp_sum);
    for (Tensor g : run.optimizer.outside_gradients())
      if (g.defined()) par->sp().all_reduce(g);
  }
  if (layout.distributed) {
    // The step's losses and expert loads are sums over every rank's packs, like the
    // denominators.
    std::vector<double> flat_sums = {sums.lm, sums.balancing};
    flat_sums.insert(flat_sums.end(), sums.mtp.begin(), sums.mtp.end());
    par->world().all_reduce_sum(flat_sums);
    sums.lm = flat_sums[0];
    sums.balancing = flat_sums[1];
    std::copy(flat_sums.begin() + 2, flat_sums.end(), sums.mtp.begin());
    std::vector<int64_t> flat = sums.loads.flat();
    par->world().all_reduce_sum(flat);
    sums.loads.set_flat(flat);
  }
}

// The norm, the update (or a skip) and the router-bias rule; the model then sees the new weights.
StepResult update(TrainingRun& run, const StepSums& sums) {
  StepResult r;
  r.lr = run.schedule.lr(run.state.step);
  r.lm_loss = sums.lm / run.train.lm_denominator;
  r.balancing_loss = sums.balancing;
  r.grad_norm = run.optimizer.grad_norm();
  if (!std::isfinite(r.lm_loss) || !std::isfinite(sums.balancing) ||
      !std::all_of(sums.mtp.begin(), sums.mtp.end(), [](double v) { return std::isfinite(v); }))
    r.nonfinite.push_back("loss");
  if (!std::isfinite(r.grad_norm)) {
    const std::vector<std::string> names =
        run.optimizer.nonfinite_gradients(run.store, run.grads, kNonFiniteNamed);
    r.nonfinite.insert(r.nonfinite.end(), names.begin(), names.end());
  }
  // A non-finite loss with finite gradients is skipped too: its update would rest on nothing.
  const StepReport rep = run.optimizer.step(r.lr, r.grad_norm, !r.nonfinite.empty());
  // The bias moves from the step's loads even when the update was skipped (docs/training.md);
  // under LoRA the base, router biases included, stays as loaded, so that the adapter alone
  // carries what the run learned.
  r.maxvio =
      update_router_biases(sums.loads, run.recipe.lora ? 0.0 : run.recipe.router_bias_update_rate,
                           [&](const std::string& name) -> Tensor& { return run.store.get(name); });
  // The model's compute tensors follow the weights' owner (trainer_optimizer.h): on one GPU the
  // optimizer updated them in place (the tower's too), only the router biases come from the store.
  if (run.optimizer.weights_home() == WeightsHome::model)
    refresh_router_biases(run.model, run.store);
  else if (run.vl)
    run.vl->model().refresh(run.store);
  else
    refresh_model(run.model, run.store);
  for (const std::string& name : run.layout.biases_in_store)
    run.layout.layers->set_parameter(name, run.store.get(name));
  ++run.state.step;
  if (rep.skipped) ++run.state.skipped_steps;
  r.step = run.state.step;
  r.total_steps = run.state.total_steps;
  r.epoch = run.sampler.epoch();
  r.mtp_loss_sums = sums.mtp;
  r.mtp_denominators = run.train.mtp_denominators;
  r.skipped = rep.skipped;
  return r;
}

// One step, its metrics logged; false when the run is to stop.
bool run_step(TrainingRun& run) {
  const Recipe& recipe = run.recipe;
  const auto step_start = Clock::now();
  PackBatch batch =
      next_batch(run.sampler, recipe.micro_packs * run.layout.dp, run.train.mtp_depths);
  // Denominators of the whole step: the targets of every rank's packs, so that the ranks'
  // gradients sum to the gradient of one batch (docs/distributed.md, "How a data-parallel step
  // works"); a step without any target gets 1 so that every term is 0 rather than NaN.
  run.train.lm_denominator = double(std::max<int64_t>(batch.lm_targets, 1));
  run.train.mtp_denominators.clear();
  for (int64_t n : batch.mtp_targets)
    run.train.mtp_denominators.push_back(double(std::max<int64_t>(n, 1)));
  StepSums sums = forward_backward(run, batch);
  reduce_over_ranks(run, sums);
  if (run.options.on_gradients)
    run.options.on_gradients(run.state.step + 1, [&](const std::string& name) -> Tensor& {
      for (auto& [n, g] : run.grads.named)
        if (n == name && g.defined()) return g;
      throw_internal(__FILE__, __LINE__, fmt::format("no gradient buffer for '{}'", name));
    });
  const StepResult result = update(run, sums);
  const StepMetrics m =
      step_metrics(result, recipe.mtp_scale, batch.inputs, batch.text_tokens, batch.slots,
                   step_start, run.model.text(), run.train.mtp, run.layout, run.meter);
  if (run.log) run.log->write(m);
  run.summary.steps.push_back(m);
  run.summary.text_tokens += batch.text_tokens;
  if (run.options.on_step) run.options.on_step(m);
  if (!result.nonfinite.empty() && recipe.on_nonfinite == NonFinitePolicy::kStop)
    throw Error(fmt::format("step {}: not finite: {}; the run stops without saving this step",
                            run.state.step, fmt::join(result.nonfinite, ", ")),
                recipe.source() + ": train.on_nonfinite",
                "resume from the last checkpoint (--resume) with a lower optimizer.lr, or set "
                "train.on_nonfinite = \"skip\" to skip such steps");

  bool stop = run.options.stop && run.options.stop->load();
  // A signal may reach the ranks at different steps: stop together.
  if (run.layout.distributed) stop = run.layout.par->world().all_reduce_max(int64_t(stop)) > 0;
  const int64_t step = run.state.step, total = run.state.total_steps;
  const bool periodic = recipe.save_every > 0 && step % recipe.save_every == 0;
  if (periodic || step == total || stop)
    if (auto written = run.checkpointer.save(run.state, run.sampler, run.meter.totals()))
      run.summary.checkpoint = *written;
  if (stop && step < total) {
    run.summary.interrupted = true;
    spdlog::warn("stopped at step {} of {} on request", step, total);
    return false;
  }
  return true;
}

}  // namespace

void run_steps(TrainingRun& run) {
  // The start-up's collectives are not the first step's.
  if (run.layout.on_gpu && run.layout.distributed) run.layout.par->take_gpu_busy_seconds();
  while (run.state.step < run.state.total_steps)
    if (!run_step(run)) break;
}

}  // namespace glmtune::train

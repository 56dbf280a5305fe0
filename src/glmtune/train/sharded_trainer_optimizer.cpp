// The sharded optimizer of trainer_optimizer.h: dist::ShardedAdamW for the replicated tensors,
// with the fully sharded decoder layers' and the routed-expert slices' AdamW beside it.
#include <spdlog/spdlog.h>

#include <array>
#include <limits>
#include <map>
#include <optional>

#include "glmtune/base/error.h"
#include "glmtune/dist/expert_shards.h"
#include "glmtune/dist/fsdp.h"
#include "glmtune/dist/parallel.h"
#include "glmtune/dist/sharded_optimizer.h"
#include "glmtune/model/text/backward.h"
#include "glmtune/model/text/model.h"
#include "glmtune/tensor/allocator.h"
#include "glmtune/train/optimizer_variants.h"
#include "glmtune/train/recipe.h"
#include "glmtune/train/vl_batch.h"

namespace glmtune::train {
namespace {

using model::text::TextGrads;
using model::text::TextModel;

// The model's compute tensors aligned with `params` (undefined for the frozen ones).
std::vector<Tensor> compute_tensors(TextModel& model, const std::vector<NamedParam>& params) {
  std::vector<Tensor> compute;
  for (const NamedParam& p : params) {
    compute.emplace_back();
    if (!p.trainable) continue;
    for (const auto& [name, t] : model.weights().named)
      if (name == p.name) compute.back() = t;
  }
  return compute;
}

void append(std::vector<std::string>& to, const std::vector<std::string>& names) {
  to.insert(to.end(), names.begin(), names.end());
}

class ShardedOptimizer final : public Optimizer {
 public:
  explicit ShardedOptimizer(const OptimizerSetup& setup);

  void attach(TextModel& model, TextGrads& grads) override;
  void shard_layers(dist::ShardedLayers& layers, const PieceReader& read) override;
  void log_memory(const TextModel& model, const TextGrads& grads) const override;

  const std::vector<Tensor>& outside_gradients() const override { return vision_grads_; }
  double grad_norm() override {
    // The decoder-layer slices' and the expert shards' parts of the global norm join the
    // replicated shards' in one sum over dp, where each of them appears once.
    const double other_sq_norm =
        (layer_adamw_ ? layer_adamw_->grad_sq_norm() : 0.0) +
        (expert_adamw_ ? expert_adamw_->reduce_gradients(expert_grad_list_) : 0.0);
    return replicated_->reduce_gradients(grad_list_, other_sq_norm);
  }
  StepReport step(double lr, double grad_norm, bool skip) override {
    const double applied = skip ? std::numeric_limits<double>::quiet_NaN() : grad_norm;
    const StepReport rep = replicated_->step(lr, applied);
    // The same norm skips or applies every update together.
    if (layer_adamw_) layer_adamw_->step(lr, applied);
    if (expert_adamw_) expert_adamw_->step(lr, applied);
    return rep;
  }
  int64_t step_count() const override { return replicated_->step_count(); }
  std::vector<std::string> nonfinite_gradients(const model::ParamStore& store,
                                               const TextGrads& grads, size_t limit) override;

  WeightsHome weights_home() const override {
    return on_gpu_ ? WeightsHome::model : WeightsHome::store;
  }
  void write_weights(model::ParamStore&) override {
    if (!on_gpu_) return;
    replicated_->write_params();
    if (expert_adamw_) expert_adamw_->write_params();
  }
  std::vector<std::string> nonfinite_weights(const model::ParamStore& store, size_t limit) override;
  model::ParamStore::WholeValue weights_for_save() override;
  void write_state(const std::filesystem::path& dir) override {
    save_optimizer_state(dir, trained_, replicated_->step_count(), whole_state());
  }
  void visit_state() override { visit_optimizer_state(trained_, whole_state()); }

 private:
  // Expert slices are named per expert by LocalExperts::nonfinite, not by released_views (which
  // splits whole tensors).
  std::function<bool(const std::string&)> held_by_experts() const {
    if (!experts_) return nullptr;
    return [this](const std::string& name) { return experts_->holds(name); };
  }
  // The ranks of one sp index hold every expert slice; the other sp indices hold copies.
  bool first_sp() const { return !distributed_ || par_->sp().rank() == 0; }
  WholeOptimizerState whole_state() const;

  const Recipe& recipe_;
  model::ParamStore& store_;
  dist::ParallelContext* par_;
  const bool distributed_, root_, on_gpu_;
  const Device device_;
  const int64_t num_layers_;
  dist::LocalExperts* experts_;
  std::vector<Tensor> vision_grads_;  // aligned with replicated_->params(), or empty
  std::optional<dist::ShardedAdamW> replicated_;
  TrainedShapes trained_;
  // A resumed run reads its pieces of the saved state straight from the mapped files (the
  // replicated and expert shards here, the decoder-layer pieces in shard_layers): no rank reads
  // or holds the whole state.
  std::optional<SavedAdamWState> saved_;
  std::optional<dist::ExpertAdamW> expert_adamw_;
  dist::ShardedLayers* layers_ = nullptr;
  std::optional<dist::ShardedLayerAdamW> layer_adamw_;
  std::map<std::string, DType> dropped_from_store_;  // name -> storage dtype
  std::vector<Tensor> grad_list_;                    // aligned with replicated_->params()
  std::vector<Tensor> expert_grad_list_;             // aligned with expert_adamw_->params()
  std::map<std::string, Tensor*> optimizer_grad_;
};

ShardedOptimizer::ShardedOptimizer(const OptimizerSetup& setup)
    : recipe_(*setup.recipe),
      store_(*setup.store),
      par_(setup.parallel),
      distributed_(setup.parallel != nullptr && setup.parallel->distributed()),
      root_(setup.parallel == nullptr || setup.parallel->is_root()),
      on_gpu_(setup.device.is_cuda()),
      device_(setup.device),
      num_layers_(setup.num_layers),
      experts_(setup.local_experts) {
  std::vector<NamedParam> replicated = trainable_params(store_);
  if (setup.fsdp)
    std::erase_if(replicated,
                  [&](const NamedParam& p) { return in_decoder_layer(p.name, num_layers_); });
  if (experts_)
    std::erase_if(replicated, [](const NamedParam& p) { return model::is_expert_sliced(p.name); });
  if (setup.vl) vision_grads_ = setup.vl->attach(replicated, store_);
  replicated_.emplace(std::move(replicated), recipe_.adamw_config(), *setup.dp_group,
                      setup.device_dp_group);
  // Every trained tensor, the sharded ones included, with the vision tower and projector marked
  // as the VL step trains them (the text rule alone would leave their state out of a checkpoint).
  const auto all_trained_params = [&] {
    std::vector<NamedParam> params = trainable_params(store_);
    if (setup.vl) setup.vl->step().attach(params);
    return params;
  };
  trained_ =
      whole_trained(setup.fsdp || experts_ ? all_trained_params() : replicated_->params(), store_);
  if (setup.resume) {
    saved_.emplace(SavedAdamWState::open(setup.resume->checkpoint.optimizer_dir()));
    saved_->check(trained_);
    replicated_->load(*saved_);
  }
  if (experts_) {
    expert_adamw_.emplace(*experts_, recipe_.adamw_config(), par_->edp(),
                          on_gpu_ ? par_->edp_gpu() : nullptr);
    if (saved_) expert_adamw_->load(*saved_);
  }
}

void ShardedOptimizer::attach(TextModel& model, TextGrads& grads) {
  // Several GPUs: the sharded optimizers keep their state on the device too and write the
  // gathered weights straight into the model (dist/sharded_optimizer.h), so the store's values
  // are brought up to date only for a checkpoint.
  if (on_gpu_) {
    replicated_->keep_on_device(compute_tensors(model, replicated_->params()));
    if (expert_adamw_)
      expert_adamw_->keep_on_device(compute_tensors(model, expert_adamw_->params()));
    spdlog::info("optimizer on {}: {} bytes of this rank's fp32 masters and moments there",
                 device_.str(),
                 replicated_->state_bytes() + (expert_adamw_ ? expert_adamw_->state_bytes() : 0));
  }
  grad_list_ = gradient_list(replicated_->params(), vision_grads_, grads);
  // This rank's expert-slice gradients, in the expert optimizer's order.
  if (expert_adamw_)
    for (const NamedParam& p : expert_adamw_->params()) {
      if (!p.trainable) {  // frozen experts: no buffer
        expert_grad_list_.emplace_back();
        continue;
      }
      const Tensor* g = grads.find(p.name);
      GLMTUNE_ASSERT(g != nullptr && g->shape() == p.value.shape(),
                     "routed-expert tensor '{}' has no slice-sized gradient buffer", p.name);
      expert_grad_list_.push_back(*g);
    }
  // The gradient the optimizer sees for a parameter (the vision tower's live outside `grads`).
  for (size_t i = 0; i < grad_list_.size(); ++i)
    if (grad_list_[i].defined()) optimizer_grad_[replicated_->params()[i].name] = &grad_list_[i];
}

void ShardedOptimizer::shard_layers(dist::ShardedLayers& layers, const PieceReader& read) {
  layers_ = &layers;
  std::vector<NamedParam> layer_params = named_params(store_);
  std::erase_if(layer_params,
                [&](const NamedParam& p) { return !in_decoder_layer(p.name, num_layers_); });
  layer_adamw_.emplace(layers, read, recipe_.adamw_config());
  if (saved_) layer_adamw_->load(*saved_);
  if (on_gpu_) layer_adamw_->keep_on_device();
  // The slices own the decoder layers' weights from here on: the store drops their tensors but
  // the router correction biases, which the bias rule updates in place every step (the others
  // were placeholders: the slices were read from the checkpoint piece by piece); a checkpoint
  // gathers them back one tensor at a time (weights_for_save).
  for (const NamedParam& p : layer_params) {
    if (experts_ && experts_->holds(p.name)) continue;
    if (!layers.holds(p.name))
      throw InternalError(fmt::format("decoder-layer tensor '{}' has no slice", p.name));
    if (p.name.ends_with("e_score_correction_bias")) continue;
    dropped_from_store_.emplace(p.name, p.value.dtype());
    store_.get(p.name) = Tensor();
  }
  spdlog::info("fsdp: {} bytes of tensor memory allocated on this rank after start-up ({})",
               allocator_for(device_).stats().allocated, on_gpu_ ? device_.str() : "host");
  spdlog::info(
      "fsdp: this rank holds {} of {} bytes of decoder-layer weights{}, {} of {} bytes of their "
      "gradients and {} bytes of their optimizer state ({} for the replicated tensors)",
      layers.resident_bytes(), layers.full_bytes(),
      experts_ ? " (the routed experts apart: see ep)" : "", layers.gradient_bytes(),
      layers.full_gradient_bytes(), layer_adamw_->state_bytes(), replicated_->state_bytes());
}

void ShardedOptimizer::log_memory(const TextModel& model, const TextGrads& grads) const {
  if (!experts_) return;
  const auto expert_bytes = [](const std::vector<std::pair<std::string, Tensor>>& named) {
    int64_t bytes = 0;
    for (const auto& [name, t] : named)
      if (t.defined() && model::is_expert_sliced(name)) bytes += int64_t(t.nbytes());
    return bytes;
  };
  const dist::ExpertParallel& ep = experts_->experts();
  spdlog::info(
      "ep: this rank holds experts {}..{} of {}: {} of {} bytes of routed-expert weights (and "
      "adapters) in the parameter store, {} bytes of them in the model, {} bytes of their "
      "gradients and {} bytes of their optimizer state",
      ep.first_expert(), ep.first_expert() + ep.local_experts() - 1, ep.experts(),
      experts_->local_bytes(), experts_->full_bytes(), expert_bytes(model.weights().named),
      expert_bytes(grads.named), expert_adamw_->state_bytes());
}

std::vector<std::string> ShardedOptimizer::nonfinite_gradients(const model::ParamStore& store,
                                                               const TextGrads& grads,
                                                               size_t limit) {
  std::vector<std::string> names =
      nonfinite_gradient_names(store, optimizer_grad_, grads, held_by_experts(), limit);
  // Collective: every rank sees the same non-finite global norm.
  if (layers_) append(names, layers_->nonfinite(true, limit));
  if (experts_) {
    std::map<std::string, Tensor> host_copies;
    append(names, experts_->nonfinite(
                      [&](const std::string& name) -> const Tensor* {
                        const Tensor* g = grads.find(name);
                        if (!g || !g->defined() || g->device().is_cpu()) return g;
                        return &(host_copies[name] = g->to(Device::cpu()));
                      },
                      par_->world(), limit));
  }
  return names;
}

std::vector<std::string> ShardedOptimizer::nonfinite_weights(const model::ParamStore& store,
                                                             size_t limit) {
  std::vector<std::string> bad = nonfinite_stored_weights(store, held_by_experts(), limit);
  if (experts_)
    append(bad, experts_->nonfinite([&](const std::string& name) { return &store.get(name); },
                                    par_->world(), limit));
  if (layers_) append(bad, layers_->nonfinite(false, limit));
  return bad;
}

// The released layout whatever the sharding, streamed: every tensor that is sharded (decoder
// layers with fsdp, expert slices) is gathered whole, with its optimizer state, right before rank
// 0 writes it, one tensor at a time in the order a single process writes them, so rank 0 never
// holds the whole model or optimizer state beyond what it keeps for training. The other ranks run
// the same sequence of gathers without writing.
model::ParamStore::WholeValue ShardedOptimizer::weights_for_save() {
  return [this, first_sp = first_sp()](const model::InternalParam& p) -> Tensor {
    if (layers_ && !p.value.defined() && layers_->holds(p.name)) {
      const Tensor whole = layers_->gather_tensor(p.name, 0);
      if (!root_) return Tensor();
      // Exact: the compute slices hold the stored values.
      Tensor stored = Tensor::empty(whole.shape(), dropped_from_store_.at(p.name));
      stored.copy_(whole);
      return stored;
    }
    if (experts_ && experts_->holds(p.name)) {
      if (!first_sp || par_->edp().rank() != 0) return Tensor();
      return experts_->gather_one(p.name);
    }
    return p.value;
  };
}

WholeOptimizerState ShardedOptimizer::whole_state() const {
  return [this, first_sp = first_sp()](const std::string& name) -> std::array<Tensor, 3> {
    if (layer_adamw_ && layers_->holds(name)) return layer_adamw_->gather_state(name, 0);
    if (expert_adamw_ && experts_->holds(name)) {
      if (!first_sp) return {};
      return expert_adamw_->gather_state(name);
    }
    return replicated_->gather_state(name, 0);
  };
}

}  // namespace

std::unique_ptr<Optimizer> make_sharded_optimizer(const OptimizerSetup& setup) {
  return std::make_unique<ShardedOptimizer>(setup);
}

}  // namespace glmtune::train

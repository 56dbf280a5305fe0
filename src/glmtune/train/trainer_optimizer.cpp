// The host optimizer, what the variants share, and the choice among them (trainer_optimizer.h).
#include "glmtune/train/trainer_optimizer.h"

#include <cmath>
#include <limits>

#include "glmtune/base/error.h"
#include "glmtune/model/text/backward.h"
#include "glmtune/model/text/weights.h"
#include "glmtune/train/optimizer_variants.h"
#include "glmtune/train/recipe.h"
#include "glmtune/train/released.h"
#include "glmtune/train/vl_batch.h"

namespace glmtune::train {

void Optimizer::shard_layers(dist::ShardedLayers&, const PieceReader&) {
  throw_internal(__FILE__, __LINE__, "fully sharded layers without the sharded optimizer");
}

void Optimizer::log_memory(const model::text::TextModel&, const model::text::TextGrads&) const {}

std::vector<NamedParam> trainable_params(const model::ParamStore& store) {
  std::vector<NamedParam> params = named_params(store);
  for (NamedParam& p : params)
    if (!model::text::is_trainable_param(p.name)) p.trainable = false;
  return params;
}

bool in_decoder_layer(const std::string& name, int64_t layers) {
  for (int64_t l = 0; l < layers; ++l) {
    const std::string prefix = model::text::layer_prefix(l);
    if (name.compare(0, prefix.size(), prefix) == 0) return true;
  }
  return false;
}

TrainedShapes whole_trained(const std::vector<NamedParam>& params, const model::ParamStore& store) {
  TrainedShapes out;
  for (const NamedParam& p : params)
    if (p.trainable)
      out.emplace_back(p.name,
                       store.contains(p.name) ? store.param(p.name).shape : p.value.shape());
  return out;
}

std::vector<Tensor> gradient_list(const std::vector<NamedParam>& params,
                                  const std::vector<Tensor>& vision_grads,
                                  model::text::TextGrads& grads) {
  std::vector<Tensor> list(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    const NamedParam& p = params[i];
    if (!p.trainable) continue;
    if (!vision_grads.empty() && vision_grads[i].defined()) {
      list[i] = vision_grads[i];
      continue;
    }
    const Tensor* g = grads.find(p.name);
    GLMTUNE_ASSERT(g != nullptr, "trainable parameter '{}' has no gradient buffer", p.name);
    // A distributed GPU run reduces them on the device and moves only this rank's shard
    // (sharded_optimizer.h); one GPU's optimizer reads them where they are.
    list[i] = *g;
  }
  return list;
}

std::vector<std::string> nonfinite_gradient_names(
    const model::ParamStore& store, const std::map<std::string, Tensor*>& optimizer_grad,
    const model::text::TextGrads& grads, const std::function<bool(const std::string&)>& skip,
    size_t limit) {
  // Gradients on a GPU are scanned from host copies, made only here.
  std::map<std::string, Tensor> host_copies;
  return first_nonfinite(released_views(store,
                                        [&](const model::InternalParam& p) -> const Tensor* {
                                          if (skip && skip(p.name)) return nullptr;
                                          const auto it = optimizer_grad.find(p.name);
                                          const Tensor* g = it != optimizer_grad.end()
                                                                ? it->second
                                                                : grads.find(p.name);
                                          if (!g || !g->defined()) return nullptr;
                                          if (g->device().is_cpu()) return g;
                                          return &(host_copies[p.name] = g->to(Device::cpu()));
                                        }),
                         limit);
}

std::vector<std::string> nonfinite_stored_weights(
    const model::ParamStore& store, const std::function<bool(const std::string&)>& skip,
    size_t limit) {
  // The store's tensor when it holds one (sharded decoder layers are dropped from it; an FP8
  // base's deferred tensors are placeholders of frozen values).
  return first_nonfinite(released_views(store,
                                        [&](const model::InternalParam& p) -> const Tensor* {
                                          if (p.deferred || (skip && skip(p.name))) return nullptr;
                                          return p.value.defined() ? &p.value : nullptr;
                                        }),
                         limit);
}

namespace {

// train::AdamW on the ParamStore's tensors: the store owns the weights.
class HostOptimizer final : public Optimizer {
 public:
  HostOptimizer(std::vector<NamedParam> params, std::vector<Tensor> vision_grads,
                const AdamWConfig& config)
      : adamw_(std::move(params), config), vision_grads_(std::move(vision_grads)) {}

  void restore(const std::filesystem::path& dir) { adamw_.load(dir); }

  void attach(model::text::TextModel&, model::text::TextGrads& grads) override {
    grad_list_ = gradient_list(adamw_.params(), vision_grads_, grads);
    // The gradient the optimizer sees for a parameter (the vision tower's live outside `grads`).
    for (size_t i = 0; i < grad_list_.size(); ++i)
      if (grad_list_[i].defined()) optimizer_grad_[adamw_.params()[i].name] = &grad_list_[i];
  }
  const std::vector<Tensor>& outside_gradients() const override { return vision_grads_; }
  double grad_norm() override { return std::sqrt(adamw_.grad_sq_norm(grad_list_)); }
  StepReport step(double lr, double grad_norm, bool skip) override {
    return adamw_.step(grad_list_, lr, skip ? std::numeric_limits<double>::quiet_NaN() : grad_norm);
  }
  int64_t step_count() const override { return adamw_.step_count(); }
  std::vector<std::string> nonfinite_gradients(const model::ParamStore& store,
                                               const model::text::TextGrads& grads,
                                               size_t limit) override {
    return nonfinite_gradient_names(store, optimizer_grad_, grads, nullptr, limit);
  }

  WeightsHome weights_home() const override { return WeightsHome::store; }
  void write_weights(model::ParamStore&) override {}
  std::vector<std::string> nonfinite_weights(const model::ParamStore& store,
                                             size_t limit) override {
    return nonfinite_stored_weights(store, nullptr, limit);
  }
  model::ParamStore::WholeValue weights_for_save() override { return {}; }
  void write_state(const std::filesystem::path& dir) override { adamw_.save(dir); }
  void visit_state() override {}

 private:
  AdamW adamw_;
  std::vector<Tensor> vision_grads_;  // aligned with adamw_.params(), or empty
  std::vector<Tensor> grad_list_;     // aligned with adamw_.params()
  std::map<std::string, Tensor*> optimizer_grad_;
};

}  // namespace

std::unique_ptr<Optimizer> make_optimizer(const OptimizerSetup& setup) {
  if (setup.dp_group) return make_sharded_optimizer(setup);
  model::ParamStore& store = *setup.store;
  std::vector<NamedParam> params = trainable_params(store);
  // The vision tower and projector train in VL runs (unless frozen): their gradient buffers,
  // aligned with the optimizer's parameters.
  // On a GPU the device optimizer reads the tower's gradient buffers where they are: no host copy.
  std::vector<Tensor> vision_grads =
      setup.vl ? setup.vl->attach(params, store, !setup.device.is_cuda()) : std::vector<Tensor>{};
  if (setup.device.is_cuda()) {
    // On one GPU the optimizer runs on the device beside the model (train/device_adamw.h): no
    // gradient or weight crosses the host link in a step.
    TrainedShapes trained = whole_trained(params, store);
    std::optional<SavedAdamWState> saved;
    if (setup.resume) {
      saved.emplace(SavedAdamWState::open(setup.resume->checkpoint.optimizer_dir()));
      saved->check(trained);
    }
#ifdef GLMTUNE_WITH_CUDA
    return make_device_optimizer(std::move(params), std::move(trained), std::move(saved),
                                 setup.recipe->adamw_config(), setup.device, setup.vl);
#else
    throw_internal(__FILE__, __LINE__, "a GPU optimizer in a build without CUDA");
#endif
  }
  auto host = std::make_unique<HostOptimizer>(std::move(params), std::move(vision_grads),
                                              setup.recipe->adamw_config());
  if (setup.resume) host->restore(setup.resume->checkpoint.optimizer_dir());
  return host;
}

}  // namespace glmtune::train

// The device optimizer of trainer_optimizer.h: train::DeviceAdamW beside the model on one GPU.
#include <spdlog/spdlog.h>

#include <optional>

#include "glmtune/model/text/model.h"
#include "glmtune/train/device_adamw.h"
#include "glmtune/train/optimizer_variants.h"
#include "glmtune/train/state.h"
#include "glmtune/train/vl_batch.h"

namespace glmtune::train {
namespace {

// The model's compute tensors on the GPU own the weights; the store is written for a checkpoint.
class DeviceOptimizer final : public Optimizer {
 public:
  DeviceOptimizer(std::vector<NamedParam> params, TrainedShapes trained,
                  std::optional<SavedAdamWState> saved, const AdamWConfig& config, Device device,
                  VlTraining* vl)
      : params_(std::move(params)),
        trained_(std::move(trained)),
        saved_(std::move(saved)),
        config_(config),
        device_(device),
        vl_(vl) {}

  void attach(model::text::TextModel& model, model::text::TextGrads& grads) override {
    DeviceAdamW::Named weights = model.weights().named, grad_list = grads.named;
    if (vl_) {
      // The tower and projector: their device tensors and gradient buffers, viewed in the
      // released shapes the store (and so the masters) has.
      const auto [vision_weights, vision_grads] = vl_->device_tensors();
      weights.insert(weights.end(), vision_weights.begin(), vision_weights.end());
      grad_list.insert(grad_list.end(), vision_grads.begin(), vision_grads.end());
    }
    adamw_.emplace(params_, std::move(weights), std::move(grad_list), config_);
    if (saved_) adamw_->load(*saved_);
    spdlog::info("optimizer on {}: {} bytes of fp32 masters and moments there", device_.str(),
                 adamw_->state_bytes());
  }
  const std::vector<Tensor>& outside_gradients() const override { return none_; }
  double grad_norm() override { return adamw_->grad_norm(); }
  StepReport step(double lr, double grad_norm, bool skip) override {
    return adamw_->step(lr, grad_norm, skip);
  }
  int64_t step_count() const override { return adamw_->step_count(); }
  std::vector<std::string> nonfinite_gradients(const model::ParamStore& store,
                                               const model::text::TextGrads& grads,
                                               size_t limit) override {
    return nonfinite_gradient_names(store, {}, grads, nullptr, limit);
  }

  WeightsHome weights_home() const override { return WeightsHome::model; }
  // Every master into the store's value, rounded to its storage dtype, one tensor at a time.
  void write_weights(model::ParamStore& store) override {
    for (const auto& [name, master] : adamw_->masters()) store.get(name).copy_(master);
  }
  std::vector<std::string> nonfinite_weights(const model::ParamStore& store,
                                             size_t limit) override {
    return nonfinite_stored_weights(store, nullptr, limit);
  }
  model::ParamStore::WholeValue weights_for_save() override { return {}; }
  void write_state(const std::filesystem::path& dir) override {
    save_optimizer_state(dir, trained_, adamw_->step_count(), whole_state());
  }
  void visit_state() override { visit_optimizer_state(trained_, whole_state()); }

 private:
  // {master, exp_avg, exp_avg_sq} of one trained parameter, on the host.
  WholeOptimizerState whole_state() const {
    return [this](const std::string& name) { return adamw_->state(name); };
  }

  std::vector<NamedParam> params_;  // the store's values on the host: the masters start there
  TrainedShapes trained_;
  std::optional<SavedAdamWState> saved_;
  AdamWConfig config_;
  Device device_;
  VlTraining* vl_;
  std::optional<DeviceAdamW> adamw_;
  std::vector<Tensor> none_;
};

}  // namespace

std::unique_ptr<Optimizer> make_device_optimizer(std::vector<NamedParam> params,
                                                 TrainedShapes trained,
                                                 std::optional<SavedAdamWState> saved,
                                                 const AdamWConfig& config, Device device,
                                                 VlTraining* vl) {
  return std::make_unique<DeviceOptimizer>(std::move(params), std::move(trained), std::move(saved),
                                           config, device, vl);
}

}  // namespace glmtune::train

#include <fmt/format.h>

#include <cmath>
#include <limits>

#include "glmtune/base/error.h"
#include "glmtune/train/device_adamw.h"

namespace glmtune::train {
namespace {

Tensor* find_named(std::vector<std::pair<std::string, Tensor>>& named, const std::string& name) {
  for (auto& [n, t] : named)
    if (n == name) return &t;
  return nullptr;
}

}  // namespace

cuda::AdamWConfig kernel_config(const AdamWConfig& config, double lr, int64_t step) {
  cuda::AdamWConfig c;
  c.lr = lr;
  c.beta1 = config.beta1;
  c.beta2 = config.beta2;
  c.eps = config.eps;
  c.weight_decay = config.weight_decay;
  c.step = step;
  return c;
}

DeviceAdamW::DeviceAdamW(const std::vector<NamedParam>& params, Named weights, Named grads,
                         AdamWConfig config)
    : config_(config) {
  for (const NamedParam& p : params) {
    if (!p.trainable) continue;
    Tensor* w = find_named(weights, p.name);
    Tensor* g = find_named(grads, p.name);
    GLMTUNE_ASSERT(w != nullptr && w->defined() && w->device().is_cuda() &&
                       w->shape() == p.value.shape() && w->is_contiguous(),
                   "trained parameter '{}' has no contiguous compute tensor of shape {} on a GPU",
                   p.name, p.value.str());
    GLMTUNE_ASSERT(g != nullptr && g->defined() && g->device() == w->device() &&
                       g->numel() == w->numel() && g->is_contiguous(),
                   "trained parameter '{}' has no gradient buffer beside its compute tensor",
                   p.name);
    GLMTUNE_ASSERT(w->dtype() == DType::f32 || w->dtype() == DType::bf16,
                   "trained parameter '{}' is {} on the GPU (f32 or bf16 expected)", p.name,
                   dtype_name(w->dtype()));
    GLMTUNE_ASSERT(p.value.dtype() == DType::f32 || p.value.dtype() == DType::bf16,
                   "trained parameter '{}' is stored as {} (f32 or bf16 expected)", p.name,
                   dtype_name(p.value.dtype()));
    cuda::AdamWParam a;
    // The master starts from the stored value, as the host optimizer's does. The forward sees the
    // stored value, the master rounded to the storage dtype, as on the host: an f32-stored tensor
    // computed in f32 is its own master, a bf16 one is refreshed from its master by every update,
    // directly or, where a kernel reads the bf16-stored tensor in f32 (the mHC mixing matrices),
    // through a bf16 copy that is then widened into it. LoRA adapters are stored in f32 (PEFT's
    // file holds f32) but computed in bf16 beside the bf16 base: their f32 master is the stored
    // value and every update rounds it into the compute tensor, as for a bf16-stored weight.
    if (p.value.dtype() == DType::f32 && w->dtype() == DType::f32) {
      a.master = *w;
    } else {
      a.master = p.value.to(DType::f32).to(w->device()).contiguous();
      if (w->dtype() == DType::bf16) {
        a.param = *w;
      } else {
        a.param = a.master.to(DType::bf16);
        widened_.emplace_back(a.param, *w);
      }
    }
    a.exp_avg = Tensor::zeros(w->shape(), DType::f32, w->device());
    a.exp_avg_sq = Tensor::zeros(w->shape(), DType::f32, w->device());
    a.grad = *g;
    index_[p.name] = names_.size();
    names_.push_back(p.name);
    grads_.push_back(*g);
    params_.push_back(std::move(a));
  }
}

double DeviceAdamW::grad_norm() {
  const cuda::GradNorm n = cuda::grad_norm(grads_, config_.max_grad_norm);
  clip_ = n.clip;
  return n.norm.to(Device::cpu()).data<double>()[0];
}

StepReport DeviceAdamW::step(double lr, double grad_norm, bool skip) {
  StepReport r;
  r.grad_norm = grad_norm;
  if (skip || !std::isfinite(grad_norm)) {
    r.skipped = true;
    r.clip_coef = std::numeric_limits<double>::quiet_NaN();
    r.step = step_;
    return r;
  }
  GLMTUNE_ASSERT(clip_.defined(), "DeviceAdamW::step before grad_norm");
  cuda::adamw_step(params_, kernel_config(config_, lr, step_ + 1), clip_);
  for (auto& [rounded, compute] : widened_) compute.copy_(rounded);
  ++step_;
  r.clip_coef = clip_coefficient(grad_norm, config_.max_grad_norm);
  r.step = step_;
  return r;
}

size_t DeviceAdamW::index_of(const std::string& name) const {
  const auto it = index_.find(name);
  GLMTUNE_ASSERT(it != index_.end(), "the GPU optimizer does not train '{}'", name);
  return it->second;
}

void DeviceAdamW::load(const SavedAdamWState& saved) {
  for (size_t i = 0; i < names_.size(); ++i) {
    cuda::AdamWParam& a = params_[i];
    const int64_t n = a.master.numel();
    const Device dev = a.master.device();
    Tensor flat_master = a.master.view({n});
    Tensor flat_avg = a.exp_avg.view({n});
    Tensor flat_avg_sq = a.exp_avg_sq.view({n});
    flat_master.copy_(saved.range(0, names_[i], 0, n).to(dev));
    flat_avg.copy_(saved.range(1, names_[i], 0, n).to(dev));
    flat_avg_sq.copy_(saved.range(2, names_[i], 0, n).to(dev));
    if (a.param.defined()) a.param.copy_(a.master.to(a.param.dtype()));
  }
  for (auto& [rounded, compute] : widened_) compute.copy_(rounded);
  step_ = saved.step_count();
}

std::array<Tensor, 3> DeviceAdamW::state(const std::string& name) const {
  const cuda::AdamWParam& a = params_[index_of(name)];
  const int64_t n = a.master.numel();
  return {a.master.view({n}).to(Device::cpu()), a.exp_avg.view({n}).to(Device::cpu()),
          a.exp_avg_sq.view({n}).to(Device::cpu())};
}

std::vector<std::pair<std::string, Tensor>> DeviceAdamW::masters() const {
  std::vector<std::pair<std::string, Tensor>> out;
  for (size_t i = 0; i < names_.size(); ++i) out.emplace_back(names_[i], params_[i].master);
  return out;
}

int64_t DeviceAdamW::state_bytes() const {
  int64_t bytes = 0;
  for (const cuda::AdamWParam& a : params_) {
    if (a.param.defined()) bytes += int64_t(a.master.nbytes());
    bytes += int64_t(a.exp_avg.nbytes() + a.exp_avg_sq.nbytes());
  }
  for (const auto& [rounded, compute] : widened_) bytes += int64_t(rounded.nbytes());
  return bytes;
}

}  // namespace glmtune::train

#include "glmtune/dist/sharded_optimizer_device.h"
#include "glmtune/ops/cuda/adamw.h"
#include "glmtune/train/device_adamw.h"

namespace glmtune::dist::detail {

double device_sq_norm(const std::vector<Tensor>& grads) {
  if (grads.empty()) return 0;
  const double norm = cuda::grad_norm(grads, 0).norm.to(Device::cpu()).data<double>()[0];
  return norm * norm;
}

void device_adamw(std::vector<std::array<Tensor, 3>>& state, const std::vector<Tensor>& grads,
                  const train::AdamWConfig& config, double lr, double clip, int64_t step) {
  if (state.empty()) return;
  std::vector<cuda::AdamWParam> params;
  for (size_t k = 0; k < state.size(); ++k) {
    cuda::AdamWParam p;
    p.master = state[k][0];
    p.exp_avg = state[k][1];
    p.exp_avg_sq = state[k][2];
    p.grad = grads[k];
    params.push_back(std::move(p));
  }
  const Device device = state.front()[0].device();
  cuda::adamw_step(params, train::kernel_config(config, lr, step),
                   Tensor::full({1}, clip, DType::f32, device));
}

}  // namespace glmtune::dist::detail

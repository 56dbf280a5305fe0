#include "glmtune/model/balancing_loss.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "glmtune/base/error.h"
#include "glmtune/ops/dispatch.h"

namespace glmtune::model {
namespace {

// Expert id of row t, slot k, for i32 or i64 selections.
int64_t selection_at(const Tensor& selected, int64_t t, int64_t k) {
  const int64_t idx = t * selected.size(1) + k;
  return selected.dtype() == DType::i32 ? int64_t(selected.data<int32_t>()[idx])
                                        : selected.data<int64_t>()[idx];
}

void check_selected(const Tensor& selected) {
  GLMTUNE_ASSERT(selected.defined() && selected.dim() == 2 && selected.is_contiguous() &&
                     selected.device().is_cpu() &&
                     (selected.dtype() == DType::i32 || selected.dtype() == DType::i64),
                 "expert selections must be a contiguous CPU i32/i64 [T, K] tensor, got {}",
                 selected.defined() ? selected.str() : std::string("undefined"));
}

template <typename T>
void balancing_kernel(const Tensor& logits, const Tensor& bias, const std::vector<double>& coef,
                      std::span<const uint8_t> valid, bool with_grad, BalancingLossResult& out) {
  const int64_t rows = logits.size(0), E = logits.size(1);
  const T* l = logits.data<T>();
  std::vector<double> b(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e)
    b[size_t(e)] = bias.dtype() == DType::f64 ? bias.data<double>()[e] : bias.data<float>()[e];
  T* g = with_grad ? out.grad_logits.data<T>() : nullptr;
  // Row losses are summed in row order afterwards, so the value does not depend on threading.
  std::vector<double> row_losses(size_t(rows), 0.0);
#pragma omp parallel for schedule(static) if (rows * E >= 65536)
  for (int64_t t = 0; t < rows; ++t) {
    if (!valid.empty() && !valid[size_t(t)]) continue;
    // u_e = σ(l_e) + b_e, Z = Σ u, w̃ = u / Z; the row's loss is Σ c_e w̃_e.
    std::vector<double> s(static_cast<size_t>(E));
    double z = 0.0, weighted = 0.0;
    for (int64_t e = 0; e < E; ++e) {
      s[size_t(e)] = 1.0 / (1.0 + std::exp(-double(l[t * E + e])));
      const double u = s[size_t(e)] + b[size_t(e)];
      z += u;
      weighted += coef[size_t(e)] * u;
    }
    const double row_loss = weighted / z;
    row_losses[size_t(t)] = row_loss;
    if (g) {
      // d row / d u_j = (c_j − row) / Z, and d u_j / d l_j = σ(l_j)(1 − σ(l_j)).
      for (int64_t e = 0; e < E; ++e) {
        const double se = s[size_t(e)];
        g[t * E + e] = T((coef[size_t(e)] - row_loss) / z * se * (1.0 - se));
      }
    }
  }
  double total = 0.0;
  for (double r : row_losses) total += r;
  out.loss = total;
}

}  // namespace

std::vector<int64_t> count_expert_loads(const Tensor& selected, int64_t num_experts,
                                        std::span<const uint8_t> valid) {
  check_selected(selected);
  const int64_t rows = selected.size(0), K = selected.size(1);
  GLMTUNE_ASSERT(valid.empty() || int64_t(valid.size()) == rows, "{} validity flags for {} rows",
                 valid.size(), rows);
  std::vector<int64_t> loads(size_t(num_experts), 0);
  for (int64_t t = 0; t < rows; ++t) {
    if (!valid.empty() && !valid[size_t(t)]) continue;
    for (int64_t k = 0; k < K; ++k) {
      const int64_t e = selection_at(selected, t, k);
      GLMTUNE_ASSERT(e >= 0 && e < num_experts, "expert id {} outside [0, {}) at row {}", e,
                     num_experts, t);
      ++loads[size_t(e)];
    }
  }
  return loads;
}

BalancingLossResult balancing_loss(const Tensor& logits, const Tensor& bias, const Tensor& selected,
                                   const BalancingLossOptions& options, bool with_grad) {
  GLMTUNE_ASSERT(logits.defined() && logits.dim() == 2 && logits.is_contiguous() &&
                     logits.device().is_cpu() &&
                     (logits.dtype() == DType::f32 || logits.dtype() == DType::f64),
                 "router logits must be a contiguous CPU f32/f64 [T, E] tensor, got {}",
                 logits.defined() ? logits.str() : std::string("undefined"));
  check_selected(selected);
  const int64_t rows = logits.size(0), E = logits.size(1), K = selected.size(1);
  GLMTUNE_ASSERT(selected.size(0) == rows, "{} selection rows for {} logit rows", selected.size(0),
                 rows);
  GLMTUNE_ASSERT(bias.defined() && bias.dim() == 1 && bias.size(0) == E && bias.is_contiguous() &&
                     (bias.dtype() == DType::f32 || bias.dtype() == DType::f64),
                 "router bias must be a contiguous f32/f64 [{}] tensor", E);
  GLMTUNE_ASSERT(options.num_micro_packs >= 1, "num_micro_packs {} < 1", options.num_micro_packs);
  GLMTUNE_ASSERT(options.valid.empty() || int64_t(options.valid.size()) == rows,
                 "{} validity flags for {} rows", options.valid.size(), rows);

  std::vector<int64_t> loads = options.global_loads.empty()
                                   ? count_expert_loads(selected, E, options.valid)
                                   : options.global_loads;
  GLMTUNE_ASSERT(int64_t(loads.size()) == E, "{} global loads for {} experts", loads.size(), E);
  const double assignments = double(std::accumulate(loads.begin(), loads.end(), int64_t(0)));

  BalancingLossResult out;
  if (with_grad) out.grad_logits = Tensor::zeros({rows, E}, logits.dtype());
  if (assignments == 0.0) return out;  // no routed token anywhere: nothing to balance
  // loss = α/M · E/(T·K) · Σ_e n_e · (Σ_t w̃_{t,e}) / T with T·K = Σ n (so T = Σ n / K):
  // every row contributes Σ_e c_e w̃_{t,e} with c_e = α/M · E·K · n_e / (Σ n)².
  const double scale = options.alpha / double(options.num_micro_packs) * double(E) * double(K) /
                       (assignments * assignments);
  std::vector<double> coef(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) coef[size_t(e)] = scale * double(loads[size_t(e)]);
  if (logits.dtype() == DType::f64)
    balancing_kernel<double>(logits, bias, coef, options.valid, with_grad, out);
  else
    balancing_kernel<float>(logits, bias, coef, options.valid, with_grad, out);
  return out;
}

Tensor balancing_loss_on_device(const Tensor& logits, const Tensor& bias, const Tensor& selected,
                                const Tensor& loads, int64_t counted_rows,
                                const BalancingLossOptions& options, Tensor& loss_sum) {
  GLMTUNE_ASSERT(logits.defined() && logits.dim() == 2 && selected.defined() &&
                     selected.dim() == 2 && loss_sum.defined() && loss_sum.numel() == 1 &&
                     loss_sum.dtype() == DType::f64,
                 "balancing_loss_on_device needs [T, E] logits, [T, K] selections and an f64 [1] "
                 "loss sum");
  GLMTUNE_ASSERT(options.num_micro_packs >= 1, "num_micro_packs {} < 1", options.num_micro_packs);
  GLMTUNE_DISPATCH_CUDA(logits, ops::cuda_path::moe_balancing_loss(
                                    logits, bias, loads, counted_rows, selected.size(1),
                                    options.alpha / double(options.num_micro_packs), loss_sum));
  GLMTUNE_ASSERT(counted_rows >= 0 && counted_rows <= logits.size(0),
                 "{} counted rows of {} logit rows", counted_rows, logits.size(0));
  BalancingLossOptions host = options;
  std::vector<uint8_t> valid(size_t(logits.size(0)), 0);
  std::fill(valid.begin(), valid.begin() + counted_rows, uint8_t(1));
  host.valid = valid;
  const Tensor counts = loads.to(Device::cpu()).contiguous();
  GLMTUNE_ASSERT(counts.dtype() == DType::i64 && counts.numel() == logits.size(1),
                 "balancing_loss_on_device: loads {} are not int64 [{}]", counts.str(),
                 logits.size(1));
  host.global_loads.assign(counts.data<int64_t>(), counts.data<int64_t>() + counts.numel());
  BalancingLossResult r = balancing_loss(logits, bias, selected, host);
  loss_sum.data<double>()[0] += r.loss;
  return std::move(r.grad_logits);
}

}  // namespace glmtune::model

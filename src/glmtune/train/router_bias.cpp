#include "glmtune/train/router_bias.h"

#include <algorithm>
#include <numeric>

#include "glmtune/base/error.h"

namespace glmtune::train {

double max_violation(std::span<const int64_t> loads) {
  if (loads.empty()) return 0.0;
  const int64_t total = std::accumulate(loads.begin(), loads.end(), int64_t(0));
  if (total == 0) return 0.0;
  const double mean = double(total) / double(loads.size());
  const int64_t max = *std::max_element(loads.begin(), loads.end());
  return (double(max) - mean) / mean;
}

void update_router_bias(Tensor& bias, std::span<const int64_t> loads, double rate) {
  GLMTUNE_ASSERT(bias.defined() && bias.dtype() == DType::f32 && bias.dim() == 1 &&
                     bias.is_contiguous() && bias.device().is_cpu(),
                 "the router correction bias must be a contiguous f32 CPU vector, got {}",
                 bias.defined() ? bias.str() : std::string("undefined"));
  const int64_t E = bias.size(0);
  GLMTUNE_ASSERT(int64_t(loads.size()) == E, "{} loads for {} experts", loads.size(), E);
  const int64_t total = std::accumulate(loads.begin(), loads.end(), int64_t(0));
  const float step = float(rate);
  float* b = bias.data<float>();
  for (int64_t e = 0; e < E; ++e) {
    // n_e > mean  <=>  n_e · E > Σ n, in exact integer arithmetic.
    const int64_t scaled = loads[size_t(e)] * E;
    if (scaled > total)
      b[e] -= step;
    else if (scaled < total)
      b[e] += step;
  }
}

void ExpertLoads::add(const std::string& bias_name, std::span<const int64_t> loads) {
  auto it = loads_.find(bias_name);
  if (it == loads_.end()) {
    order_.push_back(bias_name);
    loads_.emplace(bias_name, std::vector<int64_t>(loads.begin(), loads.end()));
    return;
  }
  GLMTUNE_ASSERT(it->second.size() == loads.size(), "router '{}': {} loads, earlier {}", bias_name,
                 loads.size(), it->second.size());
  for (size_t e = 0; e < loads.size(); ++e) it->second[e] += loads[e];
}

const std::vector<int64_t>& ExpertLoads::loads(const std::string& bias_name) const {
  auto it = loads_.find(bias_name);
  GLMTUNE_ASSERT(it != loads_.end(), "no loads recorded for router '{}'", bias_name);
  return it->second;
}

std::vector<int64_t> ExpertLoads::flat() const {
  std::vector<int64_t> out;
  for (const auto& name : order_) {
    const auto& v = loads_.at(name);
    out.insert(out.end(), v.begin(), v.end());
  }
  return out;
}

void ExpertLoads::set_flat(std::span<const int64_t> values) {
  size_t offset = 0;
  for (const auto& name : order_) {
    auto& v = loads_.at(name);
    GLMTUNE_ASSERT(offset + v.size() <= values.size(), "{} values for more loads", values.size());
    std::copy(values.begin() + offset, values.begin() + offset + v.size(), v.begin());
    offset += v.size();
  }
  GLMTUNE_ASSERT(offset == values.size(), "{} values for {} loads", values.size(), offset);
}

double ExpertLoads::maxvio() const {
  if (order_.empty()) return 0.0;
  double sum = 0.0;
  for (const auto& name : order_) sum += max_violation(loads_.at(name));
  return sum / double(order_.size());
}

void ExpertLoads::clear() {
  order_.clear();
  loads_.clear();
}

}  // namespace glmtune::train

// The MoE balancing loss against a direct float64 evaluation of its formula (docs/training.md,
// "Balancing loss"), its gradient against central finite differences, and the expert load counts
// it takes.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "glmtune/base/error.h"
#include "glmtune/model/balancing_loss.h"
#include "glmtune/tensor/rng.h"

using namespace glmtune;
using namespace glmtune::model;

namespace {

uint64_t fresh_seed() { return std::random_device{}(); }

// Top-K experts by σ(logit) + bias per row, distinct and tie-free for random inputs.
Tensor top_k(const Tensor& logits, const Tensor& bias, int64_t K) {
  const int64_t T = logits.size(0), E = logits.size(1);
  const auto l = logits.to_doubles(), b = bias.to_doubles();
  std::vector<int32_t> out;
  for (int64_t t = 0; t < T; ++t) {
    std::vector<int32_t> idx(static_cast<size_t>(E));
    std::iota(idx.begin(), idx.end(), 0);
    auto score = [&](int32_t e) {
      return 1.0 / (1.0 + std::exp(-l[size_t(t * E + e)])) + b[size_t(e)];
    };
    std::partial_sort(idx.begin(), idx.begin() + K, idx.end(),
                      [&](int32_t x, int32_t y) { return score(x) > score(y); });
    out.insert(out.end(), idx.begin(), idx.begin() + K);
  }
  return Tensor::from_vector<int32_t>(out, {T, K});
}

// The formula literally: α · E/(T·K) · Σ_e n_e · mean_t(w̃_{t,e}) over the valid tokens.
double spec_balancing_loss(const std::vector<double>& logits, const std::vector<double>& bias,
                           const std::vector<int64_t>& n, int64_t T_all, int64_t E, int64_t K,
                           double alpha, const std::vector<uint8_t>& valid) {
  int64_t T = 0;
  std::vector<double> mean_w(size_t(E), 0.0);
  for (int64_t t = 0; t < T_all; ++t) {
    if (!valid.empty() && !valid[size_t(t)]) continue;
    ++T;
    std::vector<double> w(static_cast<size_t>(E));
    double z = 0;
    for (int64_t e = 0; e < E; ++e) {
      w[size_t(e)] = 1.0 / (1.0 + std::exp(-logits[size_t(t * E + e)])) + bias[size_t(e)];
      z += w[size_t(e)];
    }
    for (int64_t e = 0; e < E; ++e) mean_w[size_t(e)] += w[size_t(e)] / z;
  }
  double sum = 0;
  for (int64_t e = 0; e < E; ++e) sum += double(n[size_t(e)]) * mean_w[size_t(e)] / double(T);
  return alpha * double(E) / double(T * K) * sum;
}

}  // namespace

TEST(ExpertLoads, CountsSkipPadding) {
  Tensor sel = Tensor::from_vector<int32_t>({0, 2, 1, 2, 3, 0}, {3, 2});
  EXPECT_EQ(count_expert_loads(sel, 4), (std::vector<int64_t>{2, 1, 2, 1}));
  const std::vector<uint8_t> valid = {1, 0, 1};
  EXPECT_EQ(count_expert_loads(sel, 4, valid), (std::vector<int64_t>{2, 0, 1, 1}));
  Tensor sel64 = Tensor::from_vector<int64_t>({3, 3}, {1, 2});
  EXPECT_EQ(count_expert_loads(sel64, 4), (std::vector<int64_t>{0, 0, 0, 2}));
}

TEST(BalancingLoss, ValueMatchesTheSpecFormula) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const int64_t T = 29, E = 12, K = 3;
  Tensor logits = Tensor::empty({T, E}, DType::f64);
  fill_normal(logits, seed, 0, 0.0, 1.5);
  Tensor bias = Tensor::empty({E}, DType::f64);
  fill_normal(bias, seed, 1000, 0.0, 0.05);
  Tensor sel = top_k(logits, bias, K);
  std::vector<uint8_t> valid(size_t(T), 1);
  for (int64_t t = T - 5; t < T; ++t) valid[size_t(t)] = 0;  // a padding tail
  BalancingLossOptions opt;
  opt.alpha = 0.001;
  opt.valid = valid;
  const auto r = balancing_loss(logits, bias, sel, opt);
  const auto n = count_expert_loads(sel, E, valid);
  const double want =
      spec_balancing_loss(logits.to_doubles(), bias.to_doubles(), n, T, E, K, 0.001, valid);
  EXPECT_NEAR(r.loss, want, 1e-15);
  EXPECT_GT(want, 0.0);
  // Padding rows get no gradient.
  for (int64_t t = T - 5; t < T; ++t)
    for (int64_t e = 0; e < E; ++e) EXPECT_EQ(r.grad_logits.item({t, e}), 0.0);
  // Micro-pack averaging divides by the number of micro-packs.
  opt.num_micro_packs = 4;
  EXPECT_NEAR(balancing_loss(logits, bias, sel, opt, false).loss, want / 4, 1e-16);
  // f32 logits and bias give the same value to f32 precision.
  const auto r32 = balancing_loss(logits.to(DType::f32), bias.to(DType::f32), sel,
                                  BalancingLossOptions{0.001, 1, {}, valid});
  EXPECT_NEAR(r32.loss, want, 1e-6 * want);
}

TEST(BalancingLoss, GradientMatchesFiniteDifferences) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const int64_t T = 11, E = 8, K = 2;
  Tensor logits = Tensor::empty({T, E}, DType::f64);
  fill_normal(logits, seed, 0, 0.0, 1.0);
  Tensor bias = Tensor::empty({E}, DType::f64);
  fill_normal(bias, seed, 500, 0.0, 0.1);
  Tensor sel = top_k(logits, bias, K);
  std::vector<uint8_t> valid(size_t(T), 1);
  valid[3] = 0;
  BalancingLossOptions opt;
  opt.alpha = 1.0;  // unit α keeps the gradient far above f64 rounding
  opt.valid = valid;
  const auto r = balancing_loss(logits, bias, sel, opt);
  const double h = 1e-5;
  double max_grad = 0, max_err = 0;
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t e = 0; e < E; ++e) {
      // The selections (and so n_e) stay fixed: the loss is smooth in the logits.
      Tensor plus = logits.clone(), minus = logits.clone();
      plus.set_item({t, e}, logits.item({t, e}) + h);
      minus.set_item({t, e}, logits.item({t, e}) - h);
      const double fd = (balancing_loss(plus, bias, sel, opt, false).loss -
                         balancing_loss(minus, bias, sel, opt, false).loss) /
                        (2 * h);
      const double g = r.grad_logits.item({t, e});
      max_grad = std::max(max_grad, std::abs(g));
      max_err = std::max(max_err, std::abs(g - fd));
    }
  }
  EXPECT_GT(max_grad, 1e-3);
  EXPECT_LT(max_err, 1e-8 * max_grad + 1e-12) << "max grad " << max_grad;
}

TEST(BalancingLoss, GlobalLoadsSplitTheLossAcrossRanks) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const int64_t T = 24, E = 6, K = 2;
  Tensor logits = Tensor::empty({T, E}, DType::f64);
  fill_normal(logits, seed, 0, 0.0, 1.0);
  Tensor bias = Tensor::empty({E}, DType::f64);
  fill_normal(bias, seed, 99, 0.0, 0.02);
  Tensor sel = top_k(logits, bias, K);
  const auto whole = balancing_loss(logits, bias, sel, {});
  // Two "ranks" holding rows [0, 10) and [10, 24), each given the summed loads.
  BalancingLossOptions opt;
  opt.global_loads = count_expert_loads(sel, E);
  double total = 0;
  for (auto [begin, end] : {std::pair<int64_t, int64_t>{0, 10}, {10, 24}}) {
    Tensor l = logits.slice(0, begin, end).contiguous();
    Tensor s = sel.slice(0, begin, end).contiguous();
    const auto share = balancing_loss(l, bias, s, opt);
    total += share.loss;
    for (int64_t t = begin; t < end; ++t)
      for (int64_t e = 0; e < E; ++e)
        ASSERT_NEAR(share.grad_logits.item({t - begin, e}), whole.grad_logits.item({t, e}), 1e-15);
  }
  EXPECT_NEAR(total, whole.loss, 1e-15);
}

// The trainer's form on the CPU: the same loss (added to the running sum) and gradient as the host
// form with the pack's own loads and a padding suffix, bit for bit.
TEST(BalancingLoss, TrainerFormOnTheCpuIsTheHostForm) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const int64_t T = 23, E = 10, K = 3, counted = 19;
  Tensor logits = Tensor::empty({T, E}, DType::f32);
  fill_normal(logits, seed, 0, 0.0, 1.0);
  Tensor bias = Tensor::empty({E}, DType::f32);
  fill_normal(bias, seed, 7, 0.0, 0.05);
  Tensor sel = top_k(logits.to(DType::f64), bias.to(DType::f64), K);
  std::vector<uint8_t> valid(size_t(T), 0);
  std::fill(valid.begin(), valid.begin() + counted, uint8_t(1));
  BalancingLossOptions opt;
  opt.alpha = 0.01;
  opt.num_micro_packs = 2;
  BalancingLossOptions host = opt;
  host.valid = valid;
  const BalancingLossResult want = balancing_loss(logits, bias, sel, host);
  const std::vector<int64_t> n = count_expert_loads(sel, E, valid);
  const Tensor loads = Tensor::from_vector(n, {E});
  Tensor sum = Tensor::from_vector<double>({0.25}, {1});
  const Tensor grad = balancing_loss_on_device(logits, bias, sel, loads, counted, opt, sum);
  EXPECT_EQ(sum.data<double>()[0], 0.25 + want.loss);
  ASSERT_EQ(grad.shape(), want.grad_logits.shape());
  EXPECT_EQ(grad.to_doubles(), want.grad_logits.to_doubles());
  EXPECT_THROW(balancing_loss_on_device(logits, bias, sel, loads, T + 1, opt, sum), InternalError);
}

// Router correction-bias update and maxvio on hand cases (the balancing loss is tested in
// test_model_balancing_loss.cpp).

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "glmtune/tensor/rng.h"
#include "glmtune/train/router_bias.h"

using namespace glmtune;
using namespace glmtune::train;

namespace {

uint64_t fresh_seed() { return std::random_device{}(); }

Tensor f32(const std::vector<float>& v) {
  return Tensor::from_vector<float>(v, {int64_t(v.size())});
}

}  // namespace

TEST(RouterBias, SignUpdateOnHandCases) {
  const float u = 0.001f;
  // Loads 5, 1, 3, 3: mean 3. Over-loaded expert 0 goes down, under-loaded expert 1 goes up, the
  // two at the mean stay.
  Tensor bias = f32({0.25f, -0.5f, 0.125f, 1.0f});
  update_router_bias(bias, std::vector<int64_t>{5, 1, 3, 3}, 0.001);
  EXPECT_EQ(bias.item({0}), double(0.25f - u));
  EXPECT_EQ(bias.item({1}), double(-0.5f + u));
  EXPECT_EQ(bias.item({2}), double(0.125f));
  EXPECT_EQ(bias.item({3}), double(1.0f));
  // A mean that is not an integer (4/3): 2 is above, 1 below.
  Tensor b3 = f32({0.f, 0.f, 0.f});
  update_router_bias(b3, std::vector<int64_t>{2, 1, 1}, 0.01);
  EXPECT_EQ(b3.item({0}), double(-0.01f));
  EXPECT_EQ(b3.item({1}), double(0.01f));
  EXPECT_EQ(b3.item({2}), double(0.01f));
  // Perfect balance and an idle step change nothing.
  Tensor b4 = f32({0.3f, 0.7f});
  update_router_bias(b4, std::vector<int64_t>{6, 6}, 0.001);
  update_router_bias(b4, std::vector<int64_t>{0, 0}, 0.001);
  EXPECT_EQ(b4.item({0}), double(0.3f));
  EXPECT_EQ(b4.item({1}), double(0.7f));
}

TEST(RouterBias, SignUpdateOnRandomLoads) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 gen(seed);
  const int64_t E = 37;
  std::vector<int64_t> loads(E);
  for (auto& n : loads) n = std::uniform_int_distribution<int64_t>(0, 1000)(gen);
  Tensor bias = Tensor::empty({E}, DType::f32);
  fill_normal(bias, seed, 0, 0.0, 0.01);
  const auto before = bias.to_doubles();
  const double rate = std::uniform_real_distribution<double>(1e-4, 1e-2)(gen);
  update_router_bias(bias, loads, rate);
  const double mean = double(std::accumulate(loads.begin(), loads.end(), int64_t(0))) / double(E);
  for (int64_t e = 0; e < E; ++e) {
    // f32 arithmetic: the bias adds the f32 value of ±rate.
    const float b = float(before[size_t(e)]);
    const float expect = double(loads[size_t(e)]) > mean   ? b - float(rate)
                         : double(loads[size_t(e)]) < mean ? b + float(rate)
                                                           : b;
    EXPECT_EQ(float(bias.item({e})), expect) << e;
  }
}

TEST(RouterBias, MaxViolation) {
  EXPECT_DOUBLE_EQ(max_violation(std::vector<int64_t>{5, 1, 3, 3}), 2.0 / 3.0);
  EXPECT_EQ(max_violation(std::vector<int64_t>{4, 4, 4}), 0.0);
  EXPECT_EQ(max_violation(std::vector<int64_t>{0, 0}), 0.0);
  // Everything on one of 8 experts: (8n − n)/n = 7.
  EXPECT_DOUBLE_EQ(max_violation(std::vector<int64_t>{0, 0, 0, 16, 0, 0, 0, 0}), 7.0);
}

TEST(RouterBias, ExpertLoadsAccumulateOverMicroPacks) {
  ExpertLoads loads;
  loads.add("layers.1.mlp.gate.e_score_correction_bias", std::vector<int64_t>{1, 2, 3});
  loads.add("layers.5.mlp.gate.e_score_correction_bias", std::vector<int64_t>{4, 0, 2});
  loads.add("layers.1.mlp.gate.e_score_correction_bias", std::vector<int64_t>{3, 2, 1});
  ASSERT_EQ(loads.routers().size(), 2u);
  EXPECT_EQ(loads.routers()[0], "layers.1.mlp.gate.e_score_correction_bias");
  EXPECT_EQ(loads.loads("layers.1.mlp.gate.e_score_correction_bias"),
            (std::vector<int64_t>{4, 4, 4}));
  // maxvio: layer 1 is balanced (0), layer 5 has loads 4, 0, 2 (mean 2, max 4 → 1); mean 0.5.
  EXPECT_DOUBLE_EQ(loads.maxvio(), 0.5);
  // The flat buffer a distributed run all-reduces, and back.
  EXPECT_EQ(loads.flat(), (std::vector<int64_t>{4, 4, 4, 4, 0, 2}));
  loads.set_flat(std::vector<int64_t>{8, 8, 8, 8, 0, 4});
  EXPECT_EQ(loads.loads("layers.5.mlp.gate.e_score_correction_bias"),
            (std::vector<int64_t>{8, 0, 4}));
  std::map<std::string, Tensor> biases = {
      {"layers.1.mlp.gate.e_score_correction_bias", f32({0.f, 0.f, 0.f})},
      {"layers.5.mlp.gate.e_score_correction_bias", f32({0.f, 0.f, 0.f})}};
  const double maxvio =
      update_router_biases(loads, 0.5, [&](const std::string& n) -> Tensor& { return biases[n]; });
  EXPECT_DOUBLE_EQ(maxvio, 0.5);
  EXPECT_EQ(biases["layers.1.mlp.gate.e_score_correction_bias"].to_doubles(),
            (std::vector<double>{0, 0, 0}));
  EXPECT_EQ(biases["layers.5.mlp.gate.e_score_correction_bias"].to_doubles(),
            (std::vector<double>{-0.5, 0.5, 0}));
  loads.clear();
  EXPECT_TRUE(loads.empty());
  EXPECT_EQ(loads.maxvio(), 0.0);
}

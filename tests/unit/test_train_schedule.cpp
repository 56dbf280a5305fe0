// The learning-rate schedule: values at the boundaries, agreement with the reference trainer's
// chained PyTorch schedulers, and validation.

#include <gtest/gtest.h>

#include <cmath>
#include <numbers>
#include <random>

#include "glmtune/base/error.h"
#include "glmtune/train/schedule.h"

using namespace glmtune;
using namespace glmtune::train;

namespace {

uint64_t fresh_seed() { return std::random_device{}(); }

// PyTorch's CosineAnnealingLR in its recursive (chainable) form, as the reference trainer steps it
// after LambdaLR(s / W) warmup: lr_t from lr_{t-1}. Our closed form must agree with it.
std::vector<double> chained_reference(double lr, double lr_min, int64_t warmup, int64_t total) {
  std::vector<double> out;
  for (int64_t s = 0; s < warmup; ++s) out.push_back(lr * double(s) / double(warmup));
  const int64_t T = total - warmup;
  double cur = lr;
  for (int64_t t = 0; t < T; ++t) {
    if (t > 0) {
      if ((t - 1 - T) % (2 * T) == 0)
        cur = cur + (lr - lr_min) * (1 - std::cos(std::numbers::pi / double(T))) / 2;
      else
        cur = (1 + std::cos(std::numbers::pi * double(t) / double(T))) /
                  (1 + std::cos(std::numbers::pi * double(t - 1) / double(T))) * (cur - lr_min) +
              lr_min;
    }
    out.push_back(cur);
  }
  return out;
}

}  // namespace

TEST(Schedule, BoundaryValues) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 gen(seed);
  const double lr = std::uniform_real_distribution<double>(1e-5, 1e-2)(gen);
  const double lr_min = lr * std::uniform_real_distribution<double>(0.01, 0.5)(gen);
  const int64_t W = 4, N = 20;
  Schedule s(lr, lr_min, W, N);
  EXPECT_EQ(s.lr(0), 0.0);  // warmup starts from 0, as in the reference trainer
  EXPECT_DOUBLE_EQ(s.lr(1), lr / 4);
  EXPECT_DOUBLE_EQ(s.lr(3), 3 * lr / 4);
  EXPECT_EQ(s.lr(W), lr);  // the peak, exactly
  // Midpoint of the cosine: (lr + lr_min) / 2.
  Schedule even(lr, lr_min, 4, 24);
  EXPECT_NEAR(even.lr(14), (lr + lr_min) / 2, 1e-15 * lr);
  // The last update is one cosine step above lr_min; from N on the schedule rests at lr_min.
  const double last = lr_min + (lr - lr_min) * 0.5 * (1 + std::cos(std::numbers::pi * 15 / 16));
  EXPECT_NEAR(s.lr(N - 1), last, 1e-15 * lr);
  EXPECT_GT(s.lr(N - 1), lr_min);
  EXPECT_EQ(s.lr(N), lr_min);
  EXPECT_EQ(s.lr(N + 1000), lr_min);
  // Non-increasing after warmup, increasing during it.
  for (int64_t k = 1; k < W; ++k) EXPECT_GT(s.lr(k), s.lr(k - 1));
  for (int64_t k = W + 1; k <= N; ++k) EXPECT_LE(s.lr(k), s.lr(k - 1));
}

TEST(Schedule, WithoutWarmupStartsAtThePeak) {
  Schedule s(3e-4, 3e-5, 0, 10);
  EXPECT_EQ(s.lr(0), 3e-4);
  EXPECT_LT(s.lr(1), 3e-4);
  // lr == lr_min (the seed defaults 1e-6 / 1e-6) is a flat schedule.
  Schedule flat(1e-6, 1e-6, 0, 10);
  for (int64_t k = 0; k < 12; ++k) EXPECT_EQ(flat.lr(k), 1e-6);
}

TEST(Schedule, MatchesTheSeedSystemsChainedSchedulers) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 gen(seed);
  for (int trial = 0; trial < 20; ++trial) {
    const int64_t N = std::uniform_int_distribution<int64_t>(1, 300)(gen);
    const int64_t W = std::uniform_int_distribution<int64_t>(0, N - 1)(gen);
    const double lr = std::uniform_real_distribution<double>(1e-6, 1e-2)(gen);
    const double lr_min = lr * std::uniform_real_distribution<double>(0.0, 1.0)(gen);
    Schedule s(lr, lr_min, W, N);
    const auto ref = chained_reference(lr, lr_min, W, N);
    ASSERT_EQ(int64_t(ref.size()), N);
    for (int64_t k = 0; k < N; ++k)
      ASSERT_NEAR(s.lr(k), ref[size_t(k)], 1e-12 * lr) << "N " << N << " W " << W << " step " << k;
  }
}

TEST(Schedule, IsAPureFunctionOfTheStep) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 gen(seed);
  Schedule s(2e-4, 1e-5, 7, 50);
  std::vector<double> in_order;
  for (int64_t k = 0; k < 50; ++k) in_order.push_back(s.lr(k));
  // A second schedule queried in random order (a resumed run) gives bit-identical values.
  Schedule resumed(2e-4, 1e-5, 7, 50);
  std::vector<int64_t> order(50);
  for (int64_t k = 0; k < 50; ++k) order[size_t(k)] = k;
  std::shuffle(order.begin(), order.end(), gen);
  for (int64_t k : order) EXPECT_EQ(resumed.lr(k), in_order[size_t(k)]) << k;
}

TEST(Schedule, WarmupFromRatioTruncatesLikeTheSeedSystem) {
  EXPECT_EQ(warmup_steps_from_ratio(0.0, 100), 0);
  EXPECT_EQ(warmup_steps_from_ratio(0.1, 25), 2);
  EXPECT_EQ(warmup_steps_from_ratio(0.03, 1000), 30);
  // Python's int(0.29 * 100) is 28 (0.29 · 100 = 28.999999999999996): same here.
  EXPECT_EQ(warmup_steps_from_ratio(0.29, 100), 28);
  EXPECT_EQ(warmup_steps_from_ratio(0.999, 10), 9);
}

TEST(Schedule, RejectsInconsistentSettings) {
  auto message = [](auto&& make) -> std::string {
    try {
      make();
    } catch (const Error& e) {
      return e.what();
    }
    ADD_FAILURE() << "expected an error";
    return "";
  };
  EXPECT_NE(message([] { Schedule(1e-4, 2e-4, 0, 10); }).find("lr_min"), std::string::npos);
  EXPECT_NE(message([] { Schedule(1e-4, 1e-5, 10, 10); }).find("warmup"), std::string::npos);
  EXPECT_NE(message([] { Schedule(1e-4, 1e-5, -1, 10); }).find("warmup"), std::string::npos);
  EXPECT_NE(message([] { Schedule(1e-4, 1e-5, 0, 0); }).find("total_steps"), std::string::npos);
  EXPECT_NE(message([] { Schedule(std::nan(""), 0, 0, 10); }).find("lr"), std::string::npos);
}

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "glmtune/tensor/allocator.h"
#include "glmtune/tensor/convert.h"
#include "glmtune/tensor/rng.h"
#include "glmtune/tensor/tensor.h"

using namespace glmtune;

namespace {

uint64_t test_seed() {
  static const uint64_t seed = std::random_device{}();
  return seed;
}

// Reference conversions in float64, written independently of dtype.h: enumerate the target's
// finite non-negative values, pick the nearest to |x| with ties to the even encoding, then set the
// sign bit.
template <typename Decode>
uint32_t nearest_encoding(double x, int bits, Decode decode) {
  const uint32_t sign_bit = 1u << (bits - 1);
  const double mag = std::fabs(x);
  uint32_t best = 0;
  double best_err = INFINITY;
  for (uint32_t e = 0; e < sign_bit; ++e) {
    double v = decode(e);
    if (!std::isfinite(v)) continue;
    double err = std::fabs(v - mag);
    if (err < best_err || (err == best_err && (e & 1u) == 0)) {
      best = e;
      best_err = err;
    }
  }
  return std::signbit(x) ? best | sign_bit : best;
}

}  // namespace

TEST(DType, Bf16RoundTripsEveryEncoding) {
  for (uint32_t h = 0; h < 65536; ++h) {
    float f = bf16_to_f32(uint16_t(h));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(f))));
      continue;
    }
    ASSERT_EQ(f32_to_bf16(f), h) << "bf16 0x" << std::hex << h;
  }
}

TEST(DType, Bf16RoundsToNearestEven) {
  // 1 + 2^-8 is exactly halfway between bf16 1.0 and 1.0078125: ties go to the even mantissa (1.0).
  EXPECT_EQ(f32_to_bf16(1.0f + 0.00390625f), 0x3f80);
  // 1.0078125 + 2^-8 is halfway between mantissa 1 and 2: ties go to 2.
  EXPECT_EQ(f32_to_bf16(1.0078125f + 0.00390625f), 0x3f82);
  EXPECT_EQ(f32_to_bf16(1.0f + 0.0039065f), 0x3f81);  // just above the tie
  EXPECT_EQ(f32_to_bf16(INFINITY), 0x7f80);
  EXPECT_EQ(f32_to_bf16(3.4028235e38f), 0x7f80);  // FLT_MAX rounds up to infinity
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(NAN))));
}

TEST(DType, F16MatchesNearestEvenReference) {
  std::mt19937_64 gen(test_seed());
  auto decode = [](uint32_t e) { return double(f16_to_f32(uint16_t(e))); };
  for (uint32_t h = 0; h < 65536; ++h) {
    float f = f16_to_f32(uint16_t(h));
    if (std::isnan(f)) continue;
    ASSERT_EQ(f32_to_f16(f), h) << "round trip of f16 0x" << std::hex << h;
  }
  std::uniform_int_distribution<int> exp_dist(-27, 16);
  std::uniform_real_distribution<double> mant(1.0, 2.0);
  for (int i = 0; i < 300; ++i) {
    double x = std::ldexp(mant(gen), exp_dist(gen)) * (i % 2 ? -1 : 1);
    if (std::fabs(x) >= 65520.0) continue;
    float xf = float(x);
    ASSERT_EQ(f32_to_f16(xf), nearest_encoding(double(xf), 16, decode))
        << "x=" << xf << " seed " << test_seed();
  }
}

TEST(DType, Fp8E4m3MatchesNearestEvenReference) {
  auto decode = [](uint32_t e) { return double(fp8e4m3_to_f32(uint8_t(e))); };
  EXPECT_EQ(fp8e4m3_to_f32(0x7e), 448.0f);
  EXPECT_EQ(fp8e4m3_to_f32(0x01), std::ldexp(1.0f, -9));
  EXPECT_TRUE(std::isnan(fp8e4m3_to_f32(0x7f)));
  EXPECT_TRUE(std::isnan(fp8e4m3_to_f32(0xff)));
  for (uint32_t v = 0; v < 256; ++v) {
    float f = fp8e4m3_to_f32(uint8_t(v));
    if (std::isnan(f)) continue;
    ASSERT_EQ(f32_to_fp8e4m3(f), v) << "round trip of fp8 0x" << std::hex << v;
  }
  std::mt19937_64 gen(test_seed());
  std::uniform_real_distribution<double> mag(-12.0, 8.7);
  for (int i = 0; i < 2000; ++i) {
    float x = float(std::exp2(mag(gen))) * (i % 2 ? -1.f : 1.f);
    ASSERT_EQ(f32_to_fp8e4m3(x), nearest_encoding(x, 8, decode))
        << "x=" << x << " seed " << test_seed();
  }
  EXPECT_EQ(f32_to_fp8e4m3(464.0f), 0x7e);  // the tie between 448 and 480 goes to the even 448
  EXPECT_TRUE(std::isnan(fp8e4m3_to_f32(f32_to_fp8e4m3(470.0f))));  // beyond 448: NaN, as torch
  EXPECT_TRUE(std::isnan(fp8e4m3_to_f32(f32_to_fp8e4m3(1e6f))));
}

TEST(DType, DoubleSourcesRoundOnce) {
  // 1 + 2^-8 + 2^-40 is just above the bf16 tie: a double->float->bf16 path that rounds twice
  // would land on the tie and go to even (1.0); correct rounding gives 1.0078125.
  double x = 1.0 + std::ldexp(1.0, -8) + std::ldexp(1.0, -40);
  Tensor t = Tensor::from_doubles({x}, {1}, DType::bf16);
  EXPECT_EQ(t.item({0}), 1.0078125);
}

TEST(DType, Names) {
  for (DType t : kAllDTypes) {
    EXPECT_EQ(dtype_from_safetensors(dtype_safetensors_name(t)), t);
    EXPECT_EQ(dtype_from_name(dtype_name(t)), t);
  }
  EXPECT_FALSE(dtype_from_safetensors("F8_E5M2").has_value());
  EXPECT_EQ(dtype_size(DType::bf16), 2u);
  EXPECT_EQ(dtype_size(DType::fp8e4m3), 1u);
}

TEST(Tensor, ViewsShareStorage) {
  Tensor t = Tensor::empty({2, 3, 4}, DType::f32);
  fill_normal(t, test_seed(), 0);
  Tensor tr = t.transpose(0, 2);
  EXPECT_EQ(tr.shape(), (Shape{4, 3, 2}));
  EXPECT_FALSE(tr.is_contiguous());
  EXPECT_EQ(tr.item({3, 1, 0}), t.item({0, 1, 3}));
  Tensor s = t.slice(1, 1, 3).select(2, 2);
  EXPECT_EQ(s.shape(), (Shape{2, 2}));
  EXPECT_EQ(s.item({1, 0}), t.item({1, 1, 2}));
  s.set_item({1, 0}, 7.5);
  EXPECT_EQ(t.item({1, 1, 2}), 7.5);
  Tensor c = tr.contiguous();
  EXPECT_TRUE(c.is_contiguous());
  EXPECT_EQ(c.to_doubles(), tr.to_doubles());
  Tensor v = t.view({6, -1});
  EXPECT_EQ(v.shape(), (Shape{6, 4}));
  EXPECT_EQ(t.permute({2, 0, 1}).item({3, 1, 2}), t.item({1, 2, 3}));
  EXPECT_EQ(t.unsqueeze(1).shape(), (Shape{2, 1, 3, 4}));
  EXPECT_EQ(t.unsqueeze(-1).squeeze(-1).shape(), t.shape());
}

TEST(Tensor, ReshapeOfStridedCopies) {
  Tensor t = Tensor::empty({3, 5}, DType::f64);
  fill_uniform(t, test_seed(), 11, -1, 1);
  Tensor r = t.transpose(0, 1).reshape({15});
  for (int i = 0; i < 15; ++i) EXPECT_EQ(r.item({i}), t.item({i % 3, i / 3}));
}

TEST(Tensor, ConvertsBetweenAllDTypes) {
  std::mt19937_64 gen(test_seed());
  std::uniform_int_distribution<int> small(-100, 100);
  std::vector<double> values;
  for (int i = 0; i < 64; ++i) values.push_back(small(gen) == 0 ? 3.0 : small(gen));
  Tensor src = Tensor::from_doubles(values, {8, 8}, DType::f64);
  for (DType a : kAllDTypes) {
    if (a == DType::boolean) continue;
    Tensor ta = src.to(a);
    for (DType b : kAllDTypes) {
      if (b == DType::boolean) continue;
      // Small integers are exact in every type except fp8, which holds integers up to 16 exactly.
      Tensor tb = ta.transpose(0, 1).to(b).transpose(0, 1);
      auto got = tb.to_doubles();
      for (size_t i = 0; i < values.size(); ++i) {
        double expect = values[i];
        if (a == DType::fp8e4m3 || b == DType::fp8e4m3)
          expect = fp8e4m3_to_f32(f32_to_fp8e4m3(float(expect)));
        ASSERT_EQ(got[i], expect) << dtype_name(a) << "->" << dtype_name(b) << " seed "
                                  << test_seed();
      }
    }
  }
  Tensor flags = Tensor::from_doubles({0.0, 2.5, -1.0}, {3}, DType::boolean);
  EXPECT_EQ(flags.to_doubles(), (std::vector<double>{0, 1, 1}));
}

TEST(Tensor, FillAndZeros) {
  Tensor t = Tensor::full({4, 4}, 1.5, DType::bf16);
  for (double v : t.to_doubles()) EXPECT_EQ(v, 1.5);
  Tensor z = Tensor::zeros({3}, DType::i64);
  for (double v : z.to_doubles()) EXPECT_EQ(v, 0.0);
  Tensor col = Tensor::full({3, 3}, 2.0, DType::f32);
  col.select(1, 1).fill_(-4.0);
  EXPECT_EQ(col.item({2, 1}), -4.0);
  EXPECT_EQ(col.item({2, 2}), 2.0);
}

TEST(Allocator, HostStatisticsTrackPeak) {
  auto& a = host_allocator();
  a.reset_peak();
  const auto before = a.stats();
  {
    Tensor big = Tensor::empty({1 << 20}, DType::f32);
    EXPECT_GE(a.stats().allocated, before.allocated + (4u << 20));
  }
  const auto after = a.stats();
  EXPECT_EQ(after.allocated, before.allocated);
  EXPECT_GE(after.peak_allocated, before.allocated + (4u << 20));
}

TEST(Rng, CounterBasedAndSplittable) {
  const uint64_t seed = test_seed();
  Tensor whole = Tensor::empty({1000}, DType::f64);
  fill_normal(whole, seed, 500);
  Tensor tail = Tensor::empty({400}, DType::f64);
  fill_normal(tail, seed, 1100);  // elements 600.. of the first draw
  for (int i = 0; i < 400; ++i) ASSERT_EQ(tail.item({i}), whole.item({600 + i})) << "seed " << seed;
  Tensor other = Tensor::empty({1000}, DType::f64);
  fill_normal(other, seed + 1, 500);
  EXPECT_NE(other.to_doubles(), whole.to_doubles());
}

TEST(Rng, NormalAndUniformMoments) {
  Tensor n = Tensor::empty({200000}, DType::f64);
  fill_normal(n, test_seed(), 0, 1.0, 2.0);
  double sum = 0, sq = 0;
  for (double v : n.to_doubles()) {
    sum += v;
    sq += v * v;
  }
  const double mean = sum / 2e5, var = sq / 2e5 - mean * mean;
  EXPECT_NEAR(mean, 1.0, 0.02) << "seed " << test_seed();
  EXPECT_NEAR(var, 4.0, 0.06) << "seed " << test_seed();
  Tensor u = Tensor::empty({100000}, DType::f32);
  fill_uniform(u, test_seed(), 0, -3.0, 5.0);
  double lo = 1e9, hi = -1e9, usum = 0;
  for (double v : u.to_doubles()) {
    lo = std::min(lo, v);
    hi = std::max(hi, v);
    usum += v;
  }
  EXPECT_GE(lo, -3.0);
  EXPECT_LE(hi, 5.0);  // [low, high) in float64; rounding to f32 may reach `high` itself
  EXPECT_NEAR(usum / 1e5, 1.0, 0.05);
}

TEST(Rng, PortableMathIsAccurate) {
  for (double x : {1e-300, 1e-10, 0.001, 0.3, 0.5, 0.7071, 0.99999, 1.0})
    EXPECT_NEAR(rng_detail::log_unit(x), std::log(x), 1e-13 * std::max(1.0, std::fabs(std::log(x))))
        << x;
  for (int i = 0; i < 1000; ++i) {
    double t = i / 1000.0;
    EXPECT_NEAR(rng_detail::cos_2pi(t), std::cos(2 * M_PI * t), 1e-14) << t;
  }
}

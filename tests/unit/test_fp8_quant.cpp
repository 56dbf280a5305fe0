// The CPU reference of block-scaled FP8 quantisation (ops/fp8.h): the scale rule, the rounding of
// every e4m3 code, saturation, edge blocks, the tile shapes, non-finite inputs, and the
// dequantisation against the checkpoint loader's.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "glmtune/base/error.h"
#include "glmtune/io/fp8.h"
#include "glmtune/ops/fp8.h"
#include "glmtune/ops/fp8_quotient.h"
#include "glmtune/ops/linear.h"
#include "glmtune/tensor/dtype.h"
#include "glmtune/tensor/tensor.h"

using namespace glmtune;

namespace {

uint8_t code(const Tensor& values, int64_t i) {
  return static_cast<const uint8_t*>(values.data_ptr())[i];
}

// e4m3fn from its definition: bias 7, subnormals at exponent 0, S.1111.111 NaN.
double e4m3_value(uint8_t v) {
  const int sign = v & 0x80 ? -1 : 1, exp = (v >> 3) & 0xf, man = v & 7;
  if (exp == 0xf && man == 7) return NAN;
  if (exp == 0) return sign * man * std::ldexp(1.0, -9);
  return sign * (1.0 + man / 8.0) * std::ldexp(1.0, exp - 7);
}

Tensor row(const std::vector<float>& v) { return Tensor::from_vector(v, {1, int64_t(v.size())}); }

TEST(Fp8Quant, TheScaleIsTheBlockAmaxOver448RoundedOnceToF32) {
  std::mt19937 eng(7);
  std::normal_distribution<float> dist(0.0f, 3.0f);
  std::vector<float> v(3 * 128);
  for (float& x : v) x = dist(eng);
  const ops::Fp8Blocks q = ops::quantize_fp8_tiles(row(v));
  ASSERT_EQ(q.scales.shape(), (Shape{1, 3}));
  for (int t = 0; t < 3; ++t) {
    double amax = 0;
    for (int i = 0; i < 128; ++i) amax = std::max(amax, std::fabs(double(v[size_t(t * 128 + i)])));
    EXPECT_EQ(q.scales.data<float>()[t], float(amax / 448.0)) << "tile " << t;
  }
}

TEST(Fp8Quant, EveryFiniteCodeRoundTripsAtScaleOne) {
  // 448 in each tile makes the scale exactly 1, so every value is its own code.
  std::vector<float> v;
  std::vector<uint8_t> codes;
  for (int c = 0; c < 256; ++c)
    if ((c & 0x7f) != 0x7f) codes.push_back(uint8_t(c));
  for (size_t i = 0; i < codes.size(); ++i) {
    if (i % 127 == 0) v.push_back(448.0f);
    v.push_back(float(e4m3_value(codes[i])));
  }
  const ops::Fp8Blocks q = ops::quantize_fp8_blocks(row(v), 1, 128);
  for (int64_t t = 0; t < q.scales.numel(); ++t) ASSERT_EQ(q.scales.data<float>()[t], 1.0f);
  const Tensor back = ops::dequantize_fp8_blocks(q);
  for (size_t i = 0; i < v.size(); ++i) {
    EXPECT_EQ(back.data<float>()[i], v[i]) << "element " << i;
    if (v[i] == 0.0f) continue;  // −0 and +0 are both exact
    EXPECT_EQ(e4m3_value(code(q.values, int64_t(i))), double(v[i])) << "element " << i;
  }
}

TEST(Fp8Quant, HalfwayValuesRoundToTheEvenCode) {
  // At scale 1: 1.0625 lies halfway between 1 (mantissa 0) and 1.125 (mantissa 1): even is 1.
  // 1.1875 halfway between 1.125 and 1.25: even is 1.25. Subnormals: 2.5 · 2^-9 → 2 · 2^-9.
  const std::vector<float> v = {448.0f, 1.0625f, 1.1875f, float(2.5 * std::ldexp(1.0, -9)),
                                -1.0625f};
  const Tensor back = ops::dequantize_fp8_blocks(ops::quantize_fp8_tiles(row(v)));
  EXPECT_EQ(back.data<float>()[1], 1.0f);
  EXPECT_EQ(back.data<float>()[2], 1.25f);
  EXPECT_EQ(back.data<float>()[3], float(2 * std::ldexp(1.0, -9)));
  EXPECT_EQ(back.data<float>()[4], -1.0f);
}

TEST(Fp8Quant, TheBlockAmaxGivesTheLargestFiniteCode) {
  // amax / 448 rounds to f32, so amax / scale can land just above 448; it must still give the
  // largest finite code, never the NaN pattern above it.
  std::mt19937 eng(11);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<float> v(128);
    for (float& x : v) x = dist(eng) * 1000.0f;
    const ops::Fp8Blocks q = ops::quantize_fp8_tiles(row(v));
    size_t at = 0;
    for (size_t i = 1; i < v.size(); ++i)
      if (std::fabs(v[i]) > std::fabs(v[at])) at = i;
    EXPECT_EQ(code(q.values, int64_t(at)) & 0x7f, 0x7e) << "trial " << trial;  // ±448
  }
}

TEST(Fp8Quant, DequantisedValuesAreWithinE4m3Precision) {
  std::mt19937 eng(3);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  const int64_t rows = 130, cols = 200;  // partial blocks on both edges
  std::vector<float> v(size_t(rows * cols));
  for (float& x : v) x = dist(eng) * std::exp(dist(eng));
  const Tensor x = Tensor::from_vector(v, {rows, cols});
  const ops::Fp8Blocks q = ops::quantize_fp8_weight(x);
  ASSERT_EQ(q.scales.shape(), (Shape{2, 2}));
  const Tensor back = ops::dequantize_fp8_blocks(q);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const float s = q.scales.data<float>()[(r / 128) * 2 + c / 128];
      const double want = v[size_t(r * cols + c)], got = back.data<float>()[r * cols + c];
      // 3 mantissa bits: half an ulp is 2^-4 of the value; below 2^-6 · s, the subnormal step
      // 2^-9 · s (half of it), plus the f32 roundings of x / s and of the product.
      EXPECT_LE(std::fabs(got - want),
                std::ldexp(std::fabs(want), -4) * (1 + 1e-6) + std::ldexp(double(s), -10) + 1e-30)
          << r << "," << c;
    }
}

TEST(Fp8Quant, WeightGradientTilesAreTheTransposedActivationTiles) {
  std::mt19937 eng(5);
  std::normal_distribution<float> dist(0.0f, 2.0f);
  const int64_t rows = 300, cols = 7;
  std::vector<float> v(size_t(rows * cols)), t(size_t(rows * cols));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      t[size_t(c * rows + r)] = v[size_t(r * cols + c)] = dist(eng);
  const ops::Fp8Blocks by_column =
      ops::quantize_fp8_blocks(Tensor::from_vector(v, {rows, cols}), 128, 1);
  const ops::Fp8Blocks by_row = ops::quantize_fp8_tiles(Tensor::from_vector(t, {cols, rows}));
  ASSERT_EQ(by_column.scales.shape(), (Shape{3, cols}));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      EXPECT_EQ(code(by_column.values, r * cols + c), code(by_row.values, c * rows + r));
  for (int64_t b = 0; b < 3; ++b)
    for (int64_t c = 0; c < cols; ++c)
      EXPECT_EQ(by_column.scales.data<float>()[b * cols + c],
                by_row.scales.data<float>()[c * 3 + b]);
}

TEST(Fp8Quant, BlocksOfZerosAndNonFiniteValues) {
  std::vector<float> v(3 * 128, 0.5f);
  for (int i = 0; i < 128; ++i) v[size_t(i)] = 0.0f;
  v[128 + 5] = NAN;
  v[256 + 9] = INFINITY;
  const ops::Fp8Blocks q = ops::quantize_fp8_tiles(row(v));
  EXPECT_EQ(q.scales.data<float>()[0], float(1e-12 / 448.0));
  for (int i = 0; i < 128; ++i) EXPECT_EQ(code(q.values, i) & 0x7f, 0) << i;
  EXPECT_TRUE(std::isnan(q.scales.data<float>()[1]));
  for (int i = 128; i < 256; ++i) EXPECT_EQ(code(q.values, i) & 0x7f, 0x7f) << i;  // NaN
  EXPECT_TRUE(std::isinf(q.scales.data<float>()[2]));
  EXPECT_EQ(code(q.values, 256 + 9) & 0x7f, 0x7f);
  EXPECT_EQ(code(q.values, 256 + 10) & 0x7f, 0);
}

// The GPU quantisers divide by a tile's scale through its reciprocal (ops/fp8_quotient.h). Against
// the rule's correctly rounded division: every bf16 x under a sweep of bf16 amaxes (what a bf16
// tensor's tiles can have), and random f32 x under random f32 amaxes. The quotients must be the
// same f32 wherever they are above 2^-40 (far below e4m3's smallest code, 2^-9), and the codes the
// same everywhere.
TEST(Fp8Quant, QuotientByReciprocalGivesTheDivisionsCodes) {
  const auto code_of = [](float v) {
    return f32_to_fp8e4m3(std::isnan(v) ? v : std::clamp(v, -448.0f, 448.0f));
  };
  const auto scale_of = [](double amax) { return float(std::max(amax, 1e-12) / 448.0); };
  int64_t checked = 0, quotient_mismatches = 0, code_mismatches = 0;
  const auto check = [&](float x, float scale) {
    const float exact = x / scale, fast = ops::fp8_quotient(x, scale, 1.0f / scale);
    ++checked;
    if (std::fabs(exact) >= 0x1p-40f && float_bits(exact) != float_bits(fast)) {
      if (++quotient_mismatches <= 5)
        ADD_FAILURE() << std::hexfloat << x << " / " << scale << ": " << exact << " vs " << fast;
    }
    if (code_of(exact) != code_of(fast) && ++code_mismatches <= 5)
      ADD_FAILURE() << std::hexfloat << x << " / " << scale << ": codes differ";
  };
  // bf16: every 13th positive finite amax (all exponents, varied mantissas), every x within it.
  for (uint32_t amax_bits = 1; amax_bits < 0x7f80; amax_bits += 13) {
    const float amax = bf16_to_f32(uint16_t(amax_bits));
    const float scale = scale_of(amax);
    for (uint32_t x_bits = 0; x_bits < 0x7f80; ++x_bits) {
      const float x = bf16_to_f32(uint16_t(x_bits));
      if (x > amax) break;
      check(x, scale);
      check(-x, scale);
    }
  }
  // f32: amaxes over every exponent (subnormal ones included), x uniform below them, at them, and
  // spread over the exponents below them.
  std::mt19937_64 eng(11);
  for (int i = 0; i < 3'000'000; ++i) {
    const uint32_t amax_bits = uint32_t(eng() % 0x7f800000u);
    const float amax = bits_float(amax_bits), scale = scale_of(amax);
    float x;
    switch (i % 3) {
      case 0:
        x = bits_float(uint32_t(eng() % (uint64_t(amax_bits) + 1)));
        break;
      case 1:
        x = amax * float(double(eng() >> 11) * 0x1p-53);
        break;
      default:
        x = bits_float(amax_bits - std::min<uint32_t>(amax_bits, uint32_t(eng() % 64)));
    }
    check(i % 2 ? -x : x, scale);
  }
  EXPECT_EQ(quotient_mismatches, 0);
  EXPECT_EQ(code_mismatches, 0);
  EXPECT_GT(checked, 50'000'000);
  // The scale in f32 (ops::fp8_scale): every 61st f32 amax, the non-finite ones, the floor.
  int64_t scale_mismatches = 0;
  for (uint64_t amax_bits = 0; amax_bits <= 0x7fc00000u; amax_bits += 61) {
    const float amax = bits_float(uint32_t(amax_bits));
    const float want = scale_of(amax), got = ops::fp8_scale(amax);
    if (float_bits(want) != float_bits(got) && !(std::isnan(want) && std::isnan(got)) &&
        ++scale_mismatches <= 5)
      ADD_FAILURE() << std::hexfloat << "scale of " << amax << ": " << want << " vs " << got;
  }
  for (float amax : {0.0f, 1e-12f, 1.0000001e-12f, 3.4028235e38f, INFINITY, NAN})
    EXPECT_TRUE(float_bits(scale_of(amax)) == float_bits(ops::fp8_scale(amax)) ||
                (std::isnan(amax) && std::isnan(ops::fp8_scale(amax))))
        << amax;
  EXPECT_EQ(scale_mismatches, 0);
}

TEST(Fp8Quant, Bf16DequantisationIsTheCheckpointLoaders) {
  std::mt19937 eng(9);
  std::normal_distribution<float> dist(0.0f, 0.05f);
  std::vector<float> v(size_t(256 * 300));
  for (float& x : v) x = dist(eng);
  const ops::Fp8Blocks q = ops::quantize_fp8_weight(Tensor::from_vector(v, {256, 300}));
  const Tensor ours = ops::dequantize_fp8_blocks(q, DType::bf16);
  const Tensor loader = io::dequantize_fp8_block(q.values, q.scales);
  ASSERT_EQ(ours.dtype(), DType::bf16);
  EXPECT_EQ(std::memcmp(ours.data_ptr(), loader.data_ptr(), ours.nbytes()), 0);
  // And f32 then bf16 agrees except where the double rounding meets a tie.
  const Tensor f32 = ops::dequantize_fp8_blocks(q);
  int64_t differ = 0;
  for (int64_t i = 0; i < f32.numel(); ++i)
    differ += f32_to_bf16(f32.data<float>()[i]) != static_cast<const uint16_t*>(ours.data_ptr())[i];
  EXPECT_LE(differ, f32.numel() / 100);
}

TEST(Fp8Quant, BadInputsAreRefused) {
  EXPECT_THROW(ops::quantize_fp8_blocks(Tensor::zeros({4}, DType::f32), 1, 128), InternalError);
  EXPECT_THROW(ops::quantize_fp8_blocks(Tensor::zeros({4, 4}, DType::i32), 1, 128), InternalError);
  EXPECT_THROW(ops::quantize_fp8_blocks(Tensor::zeros({4, 4}, DType::f32), 0, 128), InternalError);
  ops::Fp8Blocks q = ops::quantize_fp8_tiles(Tensor::zeros({4, 256}, DType::f32));
  q.scales = Tensor::zeros({4, 3}, DType::f32);
  EXPECT_THROW(ops::dequantize_fp8_blocks(q), InternalError);
}

// ---- The FP8 GEMMs of tile-wise training (ops/fp8.h, linear_fp8) ----

Tensor random_tensor(const Shape& shape, unsigned seed) {
  std::mt19937 eng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(size_t(shape_numel(shape)));
  for (float& x : v) x = dist(eng) * std::exp(0.5f * dist(eng));
  return Tensor::from_vector(v, shape);
}

// Q(a; br × bc): quantised and dequantised, [rows, cols] f32 of a viewed as [numel / n, n].
Tensor q(const Tensor& a, int64_t br, int64_t bc) {
  const Tensor a2 = a.contiguous().view({a.numel() / a.size(-1), a.size(-1)});
  return ops::dequantize_fp8_blocks(ops::quantize_fp8_blocks(a2, br, bc));
}

struct Products {
  std::vector<double> value, magnitude;  // Σ_k a[i, k] b[j, k] and Σ_k |a[i, k] b[j, k]|
};

// a [m, k] and b [n, k], or with `transposed` a [k, m] and b [k, n] (the sum over the rows).
Products products(const Tensor& a_in, const Tensor& b_in, bool transposed = false) {
  const Tensor a = a_in.contiguous(), b = b_in.contiguous();
  const int64_t m = a.size(transposed ? 1 : 0), n = b.size(transposed ? 1 : 0);
  const int64_t k = a.size(transposed ? 0 : 1);
  const float *ap = a.data<float>(), *bp = b.data<float>();
  Products p{std::vector<double>(size_t(m * n)), std::vector<double>(size_t(m * n))};
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j)
      for (int64_t t = 0; t < k; ++t) {
        const double prod = transposed ? double(ap[t * m + i]) * bp[t * n + j]
                                       : double(ap[i * k + t]) * bp[j * k + t];
        p.value[size_t(i * n + j)] += prod;
        p.magnitude[size_t(i * n + j)] += std::fabs(prod);
      }
  return p;
}

// `got` (f32, any shape of the products' count) against f32-accumulated sums of k terms: each
// within k · 2^-24 of the sum of the terms' magnitudes (the rounding of a recursive or blocked f32
// sum), plus the f32 rounding of the result.
void expect_f32_sums(const Tensor& got_in, const Products& want, int64_t k, const char* what) {
  const Tensor got = got_in.contiguous();
  ASSERT_EQ(size_t(got.numel()), want.value.size()) << what;
  double worst = 0;
  for (size_t i = 0; i < want.value.size(); ++i) {
    const double err = std::fabs(got.data<float>()[i] - want.value[i]);
    const double bound = double(k + 1) * std::ldexp(want.magnitude[i], -24) + 1e-30;
    worst = std::max(worst, err / bound);
    EXPECT_LE(err, bound) << what << " element " << i;
  }
  std::printf("[ measure  ] %s: worst error %.2f of the f32-accumulation bound\n", what, worst);
}

// The forward is the GEMM of x in 1 × 128 tiles and W in 128 × 128 blocks, each dequantised, for
// a [B, T, in] input (the tiles run per token) and dimensions with partial tiles; and it is FP8:
// off the unquantised product, within e4m3's precision of both operands.
TEST(Fp8Linear, TheForwardIsTheGemmOfTheActivationTilesAndWeightBlocks) {
  const Tensor x = random_tensor({3, 23, 200}, 1), w = random_tensor({48, 200}, 2);
  const Tensor y = ops::linear_fp8(x, w);
  ASSERT_EQ(y.shape(), (Shape{3, 23, 48}));
  expect_f32_sums(y, products(q(x, 1, 128), q(w, 128, 128)), 200, "linear_fp8");

  const Products exact = products(x.view({69, 200}), w);
  double moved = 0;
  for (size_t i = 0; i < exact.value.size(); ++i) {
    const double err = std::fabs(y.data<float>()[i] - exact.value[i]);
    moved = std::max(moved, err);
    // Each operand within 2^-4 of itself (3 mantissa bits) plus the subnormal step: the product
    // within about 2 · 2^-4 of the terms' magnitudes.
    EXPECT_LE(err, 0.14 * exact.magnitude[i] + 1e-3) << i;
  }
  EXPECT_GT(moved, 0.0);
}

// The backward: dx from dy in 1 × 128 tiles and the same weight blocks; dW from dy and x in
// 128 × 1 tiles (per column, 128 tokens each, from the first token of the flattened batch), into
// the gradient buffer, accumulating; a frozen weight gets none.
TEST(Fp8Linear, TheBackwardTakesDyTilesForDxAndTokenTilesForDw) {
  const Tensor x = random_tensor({2, 83, 144}, 3), w = random_tensor({40, 144}, 4);
  const Tensor dy = random_tensor({2, 83, 40}, 5);
  Tensor dx, dw;
  ops::linear_fp8_backward_add(&dx, dy, x, w, &dw);
  ASSERT_EQ(dx.shape(), x.shape());
  ASSERT_EQ(dw.shape(), w.shape());
  // dx[t, i] = Σ_o dy[t, o] W[o, i]: the products of dy's tiles and Wᵀ.
  Products dx_want = products(q(dy, 1, 128), q(w, 128, 128).transpose(0, 1).contiguous());
  Products dw_want = products(q(dy, 128, 1), q(x, 128, 1), /*transposed=*/true);
  expect_f32_sums(dx, dx_want, 40, "linear_fp8 dx");
  expect_f32_sums(dw, dw_want, 166, "linear_fp8 dW");

  // A second call adds the same products again: twice the sums, of twice the terms (how the GEMM
  // folds them into the buffer is the BLAS kernel's choice, so only the f32 bound holds).
  ops::linear_fp8_backward_add(&dx, dy, x, w, &dw);
  for (Products* p : {&dx_want, &dw_want})
    for (size_t i = 0; i < p->value.size(); ++i) p->value[i] *= 2, p->magnitude[i] *= 2;
  expect_f32_sums(dx, dx_want, 2 * 40, "linear_fp8 dx accumulated");
  expect_f32_sums(dw, dw_want, 2 * 166, "linear_fp8 dW accumulated");

  Tensor frozen = w.clone();
  frozen.set_frozen(true);
  Tensor none;
  ops::linear_fp8_backward_add(nullptr, dy, x, frozen, &none);
  EXPECT_FALSE(none.defined());
}

// A projection marked Linear::fp8 runs these GEMMs (bit for bit the leaf ops), with or without
// an adapter beside it; a bias is refused.
TEST(Fp8Linear, AMarkedProjectionRunsTheFp8Gemms) {
  const Tensor x = random_tensor({37, 64}, 6), w = random_tensor({32, 64}, 7);
  const Tensor dy = random_tensor({37, 32}, 8);
  ops::Linear l(w);
  l.fp8 = true;
  const Tensor y = ops::linear(x, l), want = ops::linear_fp8(x, w);
  for (int64_t i = 0; i < y.numel(); ++i) EXPECT_EQ(y.data<float>()[i], want.data<float>()[i]);

  ops::Linear grads;
  const Tensor dx = ops::linear_backward(dy, x, l, &grads);
  Tensor dx_want, dw_want;
  ops::linear_fp8_backward_add(&dx_want, dy, x, w, &dw_want);
  for (int64_t i = 0; i < dx.numel(); ++i) EXPECT_EQ(dx.data<float>()[i], dx_want.data<float>()[i]);
  for (int64_t i = 0; i < dw_want.numel(); ++i)
    EXPECT_EQ(grads.weight.data<float>()[i], dw_want.data<float>()[i]);

  // An adapter adds scale · (x Aᵀ) Bᵀ to the FP8 product, in f32.
  ops::Linear adapted = l;
  adapted.lora.A = random_tensor({4, 64}, 9);
  adapted.lora.B = random_tensor({32, 4}, 10);
  adapted.lora.scale = 0.5;
  const Tensor ya = ops::linear(x, adapted);
  const Tensor delta = ops::linear(ops::linear(x, adapted.lora.A), adapted.lora.B);
  for (int64_t i = 0; i < ya.numel(); ++i)
    EXPECT_NEAR(ya.data<float>()[i], want.data<float>()[i] + 0.5 * delta.data<float>()[i],
                1e-5 * (1 + std::fabs(ya.data<float>()[i])))
        << i;

  ops::Linear biased(w, random_tensor({32}, 11));
  biased.fp8 = true;
  EXPECT_THROW(ops::linear(x, biased), InternalError);
}

// ---- Where the weight blocks come from (ops/fp8.h: pins and the reuse scope) ----

// A released weight: random codes (no block reaching ±448, so quantising their values again
// would pick another scale) and scales that are no rule's, with its f32 values.
struct Released {
  ops::Fp8Blocks blocks;
  Tensor values;  // f32 [rows, cols], the dequantised codes
};

Released released_weight(int64_t rows, int64_t cols, unsigned seed) {
  std::mt19937 eng(seed);
  std::uniform_int_distribution<int> magnitude(0, 0x6f);  // up to 240, below 448 (0x7e)
  Tensor codes = Tensor::empty({rows, cols}, DType::fp8e4m3);
  auto* c = static_cast<uint8_t*>(codes.data_ptr());
  for (int64_t i = 0; i < codes.numel(); ++i)
    c[i] = uint8_t(magnitude(eng) | (eng() & 1 ? 0x80 : 0));
  std::vector<float> scales(size_t(((rows + 127) / 128) * ((cols + 127) / 128)));
  std::uniform_real_distribution<float> scale(1e-3f, 3e-3f);
  for (float& x : scales) x = scale(eng);
  const Tensor s =
      Tensor::from_vector(scales, {int64_t((rows + 127) / 128), int64_t((cols + 127) / 128)});
  Released r{ops::fp8_weight_from_codes(codes, s), Tensor()};
  r.values = ops::dequantize_fp8_blocks(r.blocks);
  return r;
}

bool same_values(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() &&
         std::memcmp(a.contiguous().data_ptr(), b.contiguous().data_ptr(), a.nbytes()) == 0;
}

// A pinned weight's FP8 GEMMs read its codes and scales: the forward and the input gradient are
// the GEMMs of the dequantised codes, bit for bit, where quantising the same values again gives
// other blocks (and other products); the pin lasts as long as the weight's storage.
TEST(Fp8Weights, APinnedWeightsGemmsReadItsCodes) {
  const Released r = released_weight(160, 256, 21);
  const Tensor x = random_tensor({9, 256}, 22), dy = random_tensor({9, 160}, 23);
  const Tensor unpinned = r.values.clone();
  const Tensor y_requantised = ops::linear_fp8(x, unpinned);
  Tensor dx_requantised;
  ops::linear_fp8_backward_add(&dx_requantised, dy, x, unpinned, nullptr);

  const int64_t pins_before = ops::fp8_weight_counts().pinned;
  {
    Tensor w = r.values.clone();
    ops::pin_fp8_weight(w, r.blocks);
    EXPECT_EQ(ops::fp8_weight_counts().pinned, pins_before + 1);
    const ops::Fp8Blocks got = ops::fp8_weight_blocks(w);
    EXPECT_EQ(got.values.storage(), r.blocks.values.storage());  // shared, not copied
    EXPECT_TRUE(same_values(ops::linear_fp8(x, w), ops::linear(q(x, 1, 128), r.values)));
    Tensor dx;
    ops::linear_fp8_backward_add(&dx, dy, x, w, nullptr);
    Tensor dx_want;
    ops::linear_backward_add(dx_want, q(dy, 1, 128), x, r.values, nullptr);
    EXPECT_TRUE(same_values(dx, dx_want));
    EXPECT_FALSE(same_values(ops::linear_fp8(x, w), y_requantised));
    EXPECT_FALSE(same_values(dx, dx_requantised));
    // Another view of the same storage is another weight: not pinned.
    EXPECT_NE(ops::fp8_weight_blocks(w.narrow(0, 0, 128)).values.storage(),
              r.blocks.values.storage());
  }
  EXPECT_EQ(ops::fp8_weight_counts().pinned, pins_before);  // the weight is gone
  EXPECT_TRUE(same_values(ops::linear_fp8(x, unpinned), y_requantised));

  Tensor w = r.values.clone();
  EXPECT_THROW(ops::pin_fp8_weight(w.narrow(0, 0, 128), r.blocks), InternalError);
  EXPECT_THROW(ops::fp8_weight_from_codes(r.blocks.values, r.blocks.scales.narrow(0, 0, 1)),
               InternalError);
}

// Inside a reuse scope a weight view is quantised at its first FP8 GEMM only: a change to the
// weight in the scope goes unseen (which is why nothing may write one there), and after the scope
// closes the next call quantises the weight as it is. Each expert's slice is its own entry.
TEST(Fp8Weights, AScopeQuantisesEachWeightOnce) {
  const Tensor x = random_tensor({5, 128}, 31);
  Tensor experts = random_tensor({3, 64, 128}, 32);
  const Tensor first = ops::linear_fp8(x, experts.select(0, 1));
  {
    ops::Fp8WeightReuse scope;
    EXPECT_EQ(ops::fp8_weight_counts().reused, 0);
    const Tensor in_scope = ops::linear_fp8(x, experts.select(0, 1));
    EXPECT_TRUE(same_values(in_scope, first));
    (void)ops::linear_fp8(x, experts.select(0, 2));
    EXPECT_EQ(ops::fp8_weight_counts().reused, 2);
    experts.select(0, 1).copy_(random_tensor({64, 128}, 33));
    EXPECT_TRUE(same_values(ops::linear_fp8(x, experts.select(0, 1)), first));
    {
      ops::Fp8WeightReuse nested;  // an inner scope keeps what the outer one made
    }
    EXPECT_TRUE(same_values(ops::linear_fp8(x, experts.select(0, 1)), first));
  }
  EXPECT_EQ(ops::fp8_weight_counts().reused, 0);
  const Tensor after = ops::linear_fp8(x, experts.select(0, 1));
  EXPECT_FALSE(same_values(after, first));
  EXPECT_TRUE(same_values(after, ops::linear(q(x, 1, 128), q(experts.select(0, 1), 128, 128))));
}

// An input named by an Fp8InputShare is quantised once per tile shape, and the GEMMs that read it
// give what they give alone; another view of the same storage is another input.
TEST(Fp8Weights, AnInputShareQuantisesItOncePerTileShape) {
  const Tensor x = random_tensor({2, 5, 128}, 41);
  const Tensor w1 = random_tensor({64, 128}, 42), w2 = random_tensor({32, 128}, 43);
  const Tensor dy = random_tensor({2, 5, 64}, 44);
  const Tensor y1 = ops::linear_fp8(x, w1), y2 = ops::linear_fp8(x, w2);
  Tensor g_alone;
  const Tensor dx_alone = ops::linear_fp8_backward(dy, x, w1, &g_alone);
  const ops::Fp8Blocks rows_alone = ops::fp8_input_tiles(x, 1, 128);
  {
    const ops::Fp8InputShare share(x);
    const ops::Fp8Blocks rows = ops::fp8_input_tiles(x, 1, 128);
    const ops::Fp8Blocks columns = ops::fp8_input_tiles(x, 128, 1);
    EXPECT_EQ(ops::fp8_input_tiles(x, 1, 128).values.storage(), rows.values.storage());
    EXPECT_EQ(ops::fp8_input_tiles(x, 128, 1).values.storage(), columns.values.storage());
    EXPECT_NE(rows.values.storage(), columns.values.storage());
    EXPECT_TRUE(same_values(rows.values, rows_alone.values));
    EXPECT_TRUE(same_values(rows.scales, rows_alone.scales));
    EXPECT_TRUE(same_values(ops::linear_fp8(x, w1), y1));
    EXPECT_TRUE(same_values(ops::linear_fp8(x, w2), y2));
    Tensor g_shared;
    EXPECT_TRUE(same_values(ops::linear_fp8_backward(dy, x, w1, &g_shared), dx_alone));
    EXPECT_TRUE(same_values(g_shared, g_alone));
    const Tensor flat = x.view({10, 128});
    EXPECT_NE(ops::fp8_input_tiles(flat, 1, 128).values.storage(), rows.values.storage());
    {
      const ops::Fp8InputShare inner(flat);  // scopes nest, each with its own input
      EXPECT_EQ(ops::fp8_input_tiles(x, 1, 128).values.storage(), rows.values.storage());
    }
  }
  EXPECT_NE(ops::fp8_input_tiles(x, 1, 128).values.storage(), rows_alone.values.storage());
  EXPECT_THROW(ops::fp8_input_tiles(x, 128, 128), InternalError);  // a caller's bug
}

}  // namespace

// Backward of the dense projection: float64 central finite differences on fresh random inputs,
// gradient accumulation into caller buffers, transposed-view weights and the f32 instantiation.

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "glmtune/base/error.h"
#include "glmtune/ops/linear.h"
#include "support/test_support.h"

using namespace glmtune;
using namespace glmtune::test;

namespace {

constexpr RelErr rel_err{.zero_reference_fails = true};

}  // namespace

TEST(GradLinear, FiniteDifferences) {
  SCOPED_TRACE(seed_note());
  // Two leading dims: the weight gradient sums over all of them.
  Tensor x = random_normal({2, 3, 5}, 1, DType::f64, 0.2, 1.1);
  Tensor w = random_normal({4, 5}, 2, DType::f64, 0, 0.7);
  Tensor b = random_normal({4}, 3, DType::f64, 0.1, 0.5);
  const Tensor dy = random_normal({2, 3, 4}, 4, DType::f64);
  auto loss = [&] { return dot(dy, ops::linear(x, w, b)); };
  Tensor gw, gb;
  const Tensor dx = ops::linear_backward(dy, x, w, &gw, &gb);
  ASSERT_EQ(dx.shape(), x.shape());
  // The function is linear in each operand: differences are exact up to rounding.
  EXPECT_LE(fd_check(x, dx, loss), 1e-8);
  EXPECT_LE(fd_check(w, gw, loss), 1e-8);
  EXPECT_LE(fd_check(b, gb, loss), 1e-8);
}

TEST(GradLinear, ParameterGradientsAccumulate) {
  SCOPED_TRACE(seed_note());
  const Tensor x = random_normal({7, 6}, 1, DType::f64);
  const Tensor w = random_normal({3, 6}, 2, DType::f64);
  const Tensor dy = random_normal({7, 3}, 3, DType::f64);
  Tensor gw, gb;
  ops::linear_backward(dy, x, w, &gw, &gb);
  const std::vector<double> once_w = gw.to_doubles(), once_b = gb.to_doubles();
  // A second call adds the same values (BLAS may fold the old contents in per block of rows,
  // so the weight's sum is equal up to rounding; the bias sum is added once: exactly 2g).
  ops::linear_backward(dy, x, w, &gw, &gb);
  const std::vector<double> twice_w = gw.to_doubles(), twice_b = gb.to_doubles();
  for (size_t i = 0; i < once_w.size(); ++i)
    EXPECT_NEAR(twice_w[i], 2 * once_w[i], 1e-13 * (1 + std::abs(once_w[i])));
  for (size_t i = 0; i < once_b.size(); ++i) EXPECT_EQ(twice_b[i], 2 * once_b[i]);
  // A pre-filled buffer keeps its contents.
  Tensor start = random_normal({3, 6}, 4, DType::f64);
  Tensor acc = start.clone();
  ops::linear_backward(dy, x, w, &acc, nullptr, false);
  const std::vector<double> s = start.to_doubles(), a = acc.to_doubles();
  for (size_t i = 0; i < s.size(); ++i) EXPECT_NEAR(a[i], s[i] + once_w[i], 1e-13);
  // No input gradient when not asked for; a null slot is skipped.
  EXPECT_FALSE(ops::linear_backward(dy, x, w, nullptr, nullptr, false).defined());
  // A buffer of the wrong shape is refused rather than written.
  Tensor wrong = Tensor::zeros({6, 3}, DType::f64);
  EXPECT_THROW(ops::linear_backward(dy, x, w, &wrong), InternalError);
}

TEST(GradLinear, TransposedWeightViewAndF32) {
  SCOPED_TRACE(seed_note());
  const Tensor x = random_normal({9, 8}, 1, DType::f64);
  const Tensor wt = random_normal({8, 5}, 2, DType::f64);  // stored [in, out]
  const Tensor w = wt.transpose(0, 1);                     // a [out, in] view
  const Tensor dy = random_normal({9, 5}, 3, DType::f64);
  Tensor gw_view, gw_copy;
  const Tensor dx_view = ops::linear_backward(dy, x, w, &gw_view);
  const Tensor dx_copy = ops::linear_backward(dy, x, w.contiguous(), &gw_copy);
  EXPECT_LE(rel_err(dx_view, dx_copy), 1e-15);
  EXPECT_LE(rel_err(gw_view, gw_copy), 1e-15);
  // f32 runs the same code through sgemm.
  Tensor gw32, gb32, gb;
  const Tensor dx32 = ops::linear_backward(dy.to(DType::f32), x.to(DType::f32),
                                           w.contiguous().to(DType::f32), &gw32, &gb32);
  ops::linear_backward(dy, x, w, nullptr, &gb);
  EXPECT_EQ(gw32.dtype(), DType::f32);
  EXPECT_LE(rel_err(dx32, dx_copy), 1e-6);
  EXPECT_LE(rel_err(gw32, gw_copy), 1e-6);
  EXPECT_LE(rel_err(gb32, gb), 1e-6);
}

// Dense projection y = x W^T (+ b) and the raw GEMM helper, against plain loops.

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "glmtune/ops/linear.h"
#include "support/test_support.h"

using namespace glmtune;
using namespace glmtune::test;

namespace {

// x [rows, in] · w [out, in]^T + b, in double.
std::vector<double> naive(const Tensor& x, const Tensor& w, const Tensor& b) {
  const int64_t rows = x.size(0), in = x.size(1), out = w.size(0);
  std::vector<double> y(size_t(rows * out));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t o = 0; o < out; ++o) {
      double acc = b.defined() ? b.item({o}) : 0.0;
      for (int64_t i = 0; i < in; ++i) acc += x.item({r, i}) * w.item({o, i});
      y[size_t(r * out + o)] = acc;
    }
  return y;
}

void expect_close(const std::vector<double>& got, const std::vector<double>& want, double tol) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i)
    EXPECT_NEAR(got[i], want[i], tol * (1 + std::abs(want[i]))) << "element " << i;
}

}  // namespace

TEST(OpsLinear, MatchesLoopsWithAndWithoutBias) {
  SCOPED_TRACE(seed_note());
  for (DType dt : {DType::f64, DType::f32}) {
    SCOPED_TRACE(std::string(dtype_name(dt)));
    const double tol = dt == DType::f64 ? 1e-13 : 1e-5;
    const Tensor x = random_normal({13, 37}, 1, dt), w = random_normal({11, 37}, 2, dt),
                 b = random_normal({11}, 3, dt);
    expect_close(ops::linear(x, w).to_doubles(), naive(x, w, Tensor()), tol);
    expect_close(ops::linear(x, w, b).to_doubles(), naive(x, w, b), tol);
  }
}

TEST(OpsLinear, LeadingDimsAndStridedOperands) {
  SCOPED_TRACE(seed_note());
  const Tensor x3 = random_normal({2, 3, 8}, 1, DType::f64);
  const Tensor w = random_normal({5, 8}, 2, DType::f64);
  const Tensor y3 = ops::linear(x3, w);
  ASSERT_EQ(y3.shape(), (Shape{2, 3, 5}));
  expect_close(y3.to_doubles(), naive(x3.reshape({6, 8}), w, Tensor()), 1e-13);
  // A weight given as the transpose of a stored [in, out] matrix, and a strided input.
  const Tensor wt = random_normal({8, 5}, 3, DType::f64).transpose(0, 1);
  const Tensor xs = random_normal({8, 6}, 4, DType::f64).transpose(0, 1);
  ASSERT_FALSE(wt.is_contiguous());
  ASSERT_FALSE(xs.is_contiguous());
  expect_close(ops::linear(xs, wt).to_doubles(), naive(xs, wt, Tensor()), 1e-13);
  // A row slice of a larger weight (as experts and fused conv weights are taken).
  const Tensor big = random_normal({12, 8}, 5, DType::f64);
  expect_close(ops::linear(xs, big.narrow(0, 4, 5)).to_doubles(),
               naive(xs, big.narrow(0, 4, 5), Tensor()), 1e-13);
}

TEST(OpsLinear, OutAccumulatesAndEmptyInputsWork) {
  SCOPED_TRACE(seed_note());
  const Tensor x = random_normal({4, 6}, 1, DType::f64), w = random_normal({3, 6}, 2, DType::f64);
  Tensor out = random_normal({4, 3}, 3, DType::f64);
  const std::vector<double> before = out.to_doubles(), prod = naive(x, w, Tensor());
  ops::linear_out(out, x, w, Tensor(), true);
  std::vector<double> want(before.size());
  for (size_t i = 0; i < want.size(); ++i) want[i] = before[i] + prod[i];
  expect_close(out.to_doubles(), want, 1e-13);
  ops::linear_out(out, x, w);
  expect_close(out.to_doubles(), prod, 1e-13);
  // Zero tokens (an empty micro-pack) give an empty result rather than an error.
  const Tensor none = ops::linear(Tensor::empty({0, 6}, DType::f64), w);
  EXPECT_EQ(none.shape(), (Shape{0, 3}));
}

TEST(OpsLinear, GemmTransposes) {
  SCOPED_TRACE(seed_note());
  const int64_t m = 5, n = 4, k = 7;
  const Tensor a = random_normal({k, m}, 1, DType::f64);  // stored transposed
  const Tensor b = random_normal({k, n}, 2, DType::f64);
  Tensor c = random_normal({m, n}, 3, DType::f64);
  const std::vector<double> c0 = c.to_doubles();
  ops::gemm<double>(true, false, m, n, k, 2.0, a.data<double>(), m, b.data<double>(), n, 0.5,
                    c.data<double>(), n);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double acc = 0;
      for (int64_t p = 0; p < k; ++p) acc += a.item({p, i}) * b.item({p, j});
      EXPECT_NEAR(c.item({i, j}), 2.0 * acc + 0.5 * c0[size_t(i * n + j)], 1e-12);
    }
}

TEST(OpsLinear, RejectsMismatchedShapes) {
  const Tensor x = Tensor::zeros({2, 3}, DType::f32), w = Tensor::zeros({4, 5}, DType::f32);
  EXPECT_THROW(ops::linear(x, w), InternalError);
  EXPECT_THROW(ops::linear(x, Tensor::zeros({4, 3}, DType::f64)), InternalError);
}

// Normalisations: parity with the transformers reference modules (fixtures from
// tools/golden/ops_kda_mhc.py) and the formulas of ops/norm.h on random inputs.

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "glmtune/ops/norm.h"
#include "support/test_support.h"

using namespace glmtune;
using namespace glmtune::test;

namespace {

constexpr const char* kGolden = "kda_mhc";
constexpr RelErr rel_err{.zero_reference_fails = true};

}  // namespace

TEST(OpsNorm, MatchReference) {
  const io::SafetensorsFile f = open_golden(kGolden);
  const Tensor x = f.tensor("norm.x");
  for (DType dt : {DType::f32, DType::f64}) {
    SCOPED_TRACE(std::string(dtype_name(dt)));
    const Tensor xd = x.to(dt);
    EXPECT_LE(rel_err(ops::rms_norm(xd, f.tensor("norm.rms_weight").to(dt), 1e-5),
                      f.tensor("norm.rms_out")),
              1e-5);
    EXPECT_LE(rel_err(ops::rms_norm(xd, Tensor(), 1e-5), f.tensor("norm.unweighted_out")), 1e-5);
    EXPECT_LE(rel_err(ops::rms_norm_gated(f.tensor("norm.gated_x").to(dt),
                                          f.tensor("norm.gated_weight").to(dt),
                                          f.tensor("norm.gated_gate").to(dt), 1e-5),
                      f.tensor("norm.gated_out")),
              1e-5);
    EXPECT_LE(rel_err(ops::layer_norm(xd, f.tensor("norm.ln_weight").to(dt),
                                      f.tensor("norm.ln_bias").to(dt), 1e-6),
                      f.tensor("norm.ln_out")),
              1e-5);
    EXPECT_LE(rel_err(ops::l2_norm(xd, 1e-6), f.tensor("norm.l2_out")), 1e-5);
  }
}

TEST(OpsNorm, FormulasAndStatistics) {
  SCOPED_TRACE(seed_note());
  const int64_t rows = 7, n = 10;
  // A non-contiguous input (a transposed view) exercises the strided path as well.
  const Tensor xt = random_normal({n, rows}, 1, DType::f64, 0.4, 2.0);
  const Tensor x = xt.transpose(0, 1);
  ASSERT_FALSE(x.is_contiguous());
  const Tensor w = random_normal({n}, 2, DType::f64, 1, 0.5);
  const Tensor b = random_normal({n}, 3, DType::f64, 0, 0.5);
  const Tensor z = random_normal({rows, n}, 4, DType::f64, 0, 2);
  const double eps = 1e-5;
  Tensor rstd, grstd, mean, lrstd, norm;
  const Tensor rms = ops::rms_norm(x, w, eps, &rstd);
  const Tensor gs = ops::rms_norm_gated(x, w, z, eps, ops::GateActivation::sigmoid, &grstd);
  const Tensor gl = ops::rms_norm_gated(x, w, z, eps, ops::GateActivation::silu);
  const Tensor ln = ops::layer_norm(x, w, b, eps, &mean, &lrstd);
  const Tensor ln_plain = ops::layer_norm(x, Tensor(), Tensor(), eps);
  const Tensor l2 = ops::l2_norm(x, 1e-6, &norm);
  ASSERT_EQ(rstd.shape(), (Shape{rows}));
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0, s = 0;
    for (int64_t j = 0; j < n; ++j) {
      ss += x.item({r, j}) * x.item({r, j});
      s += x.item({r, j});
    }
    const double inv = 1 / std::sqrt(ss / n + eps), mu = s / n;
    double var = 0;
    for (int64_t j = 0; j < n; ++j) var += (x.item({r, j}) - mu) * (x.item({r, j}) - mu) / n;
    const double linv = 1 / std::sqrt(var + eps), l2n = std::sqrt(ss + 1e-6);
    EXPECT_NEAR(rstd.item({r}), inv, 1e-14);
    EXPECT_NEAR(grstd.item({r}), inv, 1e-14);
    EXPECT_NEAR(mean.item({r}), mu, 1e-14);
    EXPECT_NEAR(lrstd.item({r}), linv, 1e-13);
    EXPECT_NEAR(norm.item({r}), l2n, 1e-13);
    for (int64_t j = 0; j < n; ++j) {
      const double xv = x.item({r, j}), zv = z.item({r, j}), wv = w.item({j});
      EXPECT_NEAR(rms.item({r, j}), wv * xv * inv, 1e-13);
      EXPECT_NEAR(gs.item({r, j}), wv * xv * inv * sigmoid(zv), 1e-13);
      EXPECT_NEAR(gl.item({r, j}), wv * xv * inv * zv * sigmoid(zv), 1e-13);
      EXPECT_NEAR(ln.item({r, j}), (xv - mu) * linv * wv + b.item({j}), 1e-13);
      EXPECT_NEAR(ln_plain.item({r, j}), (xv - mu) * linv, 1e-13);
      EXPECT_NEAR(l2.item({r, j}), xv / l2n, 1e-14);
    }
  }
}

TEST(OpsNorm, L2NormKeepsEpsInsideTheSqrt) {
  // For a tiny vector F.normalize's max(‖x‖, eps) and the reference's sqrt(‖x‖² + eps) differ by
  // orders of magnitude; the reference's form must win.
  const Tensor x = Tensor::from_vector(std::vector<double>{3e-4, 4e-4}, {2});
  const Tensor y = ops::l2_norm(x, 1e-6);
  const double n = std::sqrt(25e-8 + 1e-6);
  EXPECT_NEAR(y.item({0}), 3e-4 / n, 1e-15);
  EXPECT_NEAR(y.item({1}), 4e-4 / n, 1e-15);
}

// Backward of the normalisations: float64 central finite differences on fresh random inputs,
// saved statistics against recomputed ones, and parity with the reference's autograd (fixtures
// from tools/golden/grads_kda_mhc.py).

#include <gtest/gtest.h>

#include <string>

#include "glmtune/ops/norm.h"
#include "support/test_support.h"

using namespace glmtune;
using namespace glmtune::test;

namespace {

constexpr const char* kGolden = "grads_kda_mhc";
constexpr RelErr rel_err{.zero_reference_fails = true};

constexpr double kFdTol = 1e-6;

}  // namespace

TEST(GradNorm, RmsNormFiniteDifferences) {
  SCOPED_TRACE(seed_note());
  Tensor x = random_normal({3, 4, 9}, 1, DType::f64, 0.3, 1.2);
  Tensor w = random_normal({9}, 2, DType::f64, 1.0, 0.4);
  const Tensor dy = random_normal({3, 4, 9}, 3, DType::f64);
  const double eps = 1e-5;
  {
    SCOPED_TRACE("weighted");
    auto loss = [&] { return dot(dy, ops::rms_norm(x, w, eps)); };
    Tensor gw;
    const Tensor dx = ops::rms_norm_backward(dy, x, w, eps, Tensor(), &gw);
    EXPECT_LE(fd_check(x, dx, loss), kFdTol);
    EXPECT_LE(fd_check(w, gw, loss), kFdTol);
  }
  {
    SCOPED_TRACE("un-weighted (mHC)");
    auto loss = [&] { return dot(dy, ops::rms_norm(x, Tensor(), eps)); };
    const Tensor dx = ops::rms_norm_backward(dy, x, Tensor(), eps);
    EXPECT_LE(fd_check(x, dx, loss), kFdTol);
  }
}

TEST(GradNorm, GatedRmsNormFiniteDifferences) {
  SCOPED_TRACE(seed_note());
  // [T, heads, HL] with the weight shared by heads, as KDA's o_norm.
  Tensor x = random_normal({5, 2, 8}, 1, DType::f64, 0.1, 1.0);
  Tensor z = random_normal({5, 2, 8}, 2, DType::f64, 0.2, 2.0);
  Tensor w = random_normal({8}, 3, DType::f64, 1.0, 0.4);
  const Tensor dy = random_normal({5, 2, 8}, 4, DType::f64);
  for (ops::GateActivation act : {ops::GateActivation::sigmoid, ops::GateActivation::silu}) {
    SCOPED_TRACE(act == ops::GateActivation::sigmoid ? "sigmoid" : "silu");
    auto loss = [&] { return dot(dy, ops::rms_norm_gated(x, w, z, 1e-5, act)); };
    Tensor gw;
    const ops::RmsNormGatedGrads g =
        ops::rms_norm_gated_backward(dy, x, w, z, 1e-5, act, Tensor(), &gw);
    EXPECT_LE(fd_check(x, g.dx, loss), kFdTol);
    EXPECT_LE(fd_check(z, g.dgate, loss), kFdTol);
    EXPECT_LE(fd_check(w, gw, loss), kFdTol);
  }
}

TEST(GradNorm, LayerNormFiniteDifferences) {
  SCOPED_TRACE(seed_note());
  Tensor x = random_normal({6, 10}, 1, DType::f64, 2.0, 1.5);  // a large mean: the shift matters
  Tensor w = random_normal({10}, 2, DType::f64, 1.0, 0.5);
  Tensor b = random_normal({10}, 3, DType::f64, 0.0, 0.5);
  const Tensor dy = random_normal({6, 10}, 4, DType::f64);
  {
    SCOPED_TRACE("affine");
    auto loss = [&] { return dot(dy, ops::layer_norm(x, w, b, 1e-6)); };
    Tensor gw, gb;
    const Tensor dx = ops::layer_norm_backward(dy, x, w, 1e-6, Tensor(), Tensor(), &gw, &gb);
    EXPECT_LE(fd_check(x, dx, loss), kFdTol);
    EXPECT_LE(fd_check(w, gw, loss), kFdTol);
    EXPECT_LE(fd_check(b, gb, loss), kFdTol);
  }
  {
    SCOPED_TRACE("no affine");
    auto loss = [&] { return dot(dy, ops::layer_norm(x, Tensor(), Tensor(), 1e-6)); };
    const Tensor dx = ops::layer_norm_backward(dy, x, Tensor(), 1e-6);
    EXPECT_LE(fd_check(x, dx, loss), kFdTol);
  }
}

TEST(GradNorm, L2NormFiniteDifferences) {
  SCOPED_TRACE(seed_note());
  Tensor x = random_normal({7, 2, 6}, 1, DType::f64, 0.0, 0.8);
  // One row close to zero: there the eps inside the sqrt shapes the gradient.
  for (int64_t j = 0; j < 6; ++j) x.set_item({3, 1, j}, 1e-4 * double(j + 1));
  const Tensor dy = random_normal({7, 2, 6}, 2, DType::f64);
  auto loss = [&] { return dot(dy, ops::l2_norm(x, 1e-6)); };
  const Tensor dx = ops::l2_norm_backward(dy, x, 1e-6);
  EXPECT_LE(fd_check(x, dx, loss, 1e-8), kFdTol);
}

TEST(GradNorm, SavedStatisticsGiveTheSameGradients) {
  SCOPED_TRACE(seed_note());
  for (DType dt : {DType::f64, DType::f32}) {
    SCOPED_TRACE(std::string(dtype_name(dt)));
    const Tensor x = random_normal({4, 3, 12}, 1, dt, 0.5, 1.3);
    const Tensor z = random_normal({4, 3, 12}, 2, dt);
    const Tensor w = random_normal({12}, 3, dt, 1.0, 0.3);
    const Tensor b = random_normal({12}, 4, dt, 0.0, 0.3);
    const Tensor dy = random_normal({4, 3, 12}, 5, dt);
    Tensor rstd, mean, norm, gw1, gw2, gb1, gb2;
    ops::rms_norm(x, w, 1e-5, &rstd);
    EXPECT_EQ(ops::rms_norm_backward(dy, x, w, 1e-5, rstd, &gw1).to_doubles(),
              ops::rms_norm_backward(dy, x, w, 1e-5, Tensor(), &gw2).to_doubles());
    EXPECT_EQ(gw1.to_doubles(), gw2.to_doubles());
    ops::rms_norm_gated(x, w, z, 1e-5, ops::GateActivation::sigmoid, &rstd);
    const ops::RmsNormGatedGrads a =
        ops::rms_norm_gated_backward(dy, x, w, z, 1e-5, ops::GateActivation::sigmoid, rstd);
    const ops::RmsNormGatedGrads c =
        ops::rms_norm_gated_backward(dy, x, w, z, 1e-5, ops::GateActivation::sigmoid);
    EXPECT_EQ(a.dx.to_doubles(), c.dx.to_doubles());
    EXPECT_EQ(a.dgate.to_doubles(), c.dgate.to_doubles());
    ops::layer_norm(x, w, b, 1e-6, &mean, &rstd);
    gw1 = Tensor();
    gw2 = Tensor();
    EXPECT_EQ(
        ops::layer_norm_backward(dy, x, w, 1e-6, mean, rstd, &gw1, &gb1).to_doubles(),
        ops::layer_norm_backward(dy, x, w, 1e-6, Tensor(), Tensor(), &gw2, &gb2).to_doubles());
    EXPECT_EQ(gw1.to_doubles(), gw2.to_doubles());
    EXPECT_EQ(gb1.to_doubles(), gb2.to_doubles());
    ops::l2_norm(x, 1e-6, &norm);
    EXPECT_EQ(ops::l2_norm_backward(dy, x, 1e-6, norm).to_doubles(),
              ops::l2_norm_backward(dy, x, 1e-6).to_doubles());
  }
}

TEST(GradNorm, MatchesReferenceAutograd) {
  const io::SafetensorsFile f = open_golden(kGolden);
  for (DType dt : {DType::f32, DType::f64}) {
    SCOPED_TRACE(std::string(dtype_name(dt)));
    auto in = [&](const char* name) { return f.tensor(name).to(dt); };
    const Tensor x = in("norm.x"), dy = in("norm.dy");
    const double eps = 1e-5;  // rms_norm_eps of the fixture's config
    Tensor gw;
    EXPECT_LE(rel_err(ops::rms_norm_backward(dy, x, in("norm.rms_weight"), eps, Tensor(), &gw),
                      f.tensor("norm.rms_dx")),
              1e-4);
    EXPECT_LE(rel_err(gw, f.tensor("norm.rms_dw")), 1e-4);
    EXPECT_LE(rel_err(ops::rms_norm_backward(dy, x, Tensor(), eps), f.tensor("norm.unweighted_dx")),
              1e-4);
    gw = Tensor();
    const ops::RmsNormGatedGrads g = ops::rms_norm_gated_backward(
        in("norm.gated_dy"), in("norm.gated_x"), in("norm.gated_weight"), in("norm.gated_gate"),
        eps, ops::GateActivation::sigmoid, Tensor(), &gw);
    EXPECT_LE(rel_err(g.dx, f.tensor("norm.gated_dx")), 1e-4);
    EXPECT_LE(rel_err(g.dgate, f.tensor("norm.gated_dgate")), 1e-4);
    EXPECT_LE(rel_err(gw, f.tensor("norm.gated_dw")), 1e-4);
    gw = Tensor();
    Tensor gb;
    EXPECT_LE(rel_err(ops::layer_norm_backward(dy, x, in("norm.ln_weight"), 1e-6, Tensor(),
                                               Tensor(), &gw, &gb),
                      f.tensor("norm.ln_dx")),
              1e-4);
    EXPECT_LE(rel_err(gw, f.tensor("norm.ln_dw")), 1e-4);
    EXPECT_LE(rel_err(gb, f.tensor("norm.ln_db")), 1e-4);
    EXPECT_LE(rel_err(ops::l2_norm_backward(dy, x, 1e-6), f.tensor("norm.l2_dx")), 1e-4);
  }
}

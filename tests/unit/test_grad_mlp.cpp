// Backward of the clamped SwiGLU MLP: float64 central finite differences on fresh random inputs,
// the clamp's exact zero-gradient region, accumulation into existing gradients, and the
// reference's autograd gradients (fixtures from tools/golden/grads_dsa_moe.py).

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "glmtune/ops/mlp.h"
#include "support/dsa_moe.h"
#include "support/test_support.h"

using namespace glmtune;
using namespace glmtune::test;

namespace {

constexpr const char* kGolden = "grads_dsa_moe";
constexpr RelErr rel_err{};

// Smallest distance of any gate entry to the limit, and of any up entry to ±limit.
double clamp_margin(const Tensor& gate, const Tensor& up, double lim) {
  double m = INFINITY;
  for (double g : gate.to_doubles()) m = std::min(m, std::abs(g - lim));
  for (double u : up.to_doubles()) m = std::min({m, std::abs(u - lim), std::abs(u + lim)});
  return m;
}

ops::MlpParams random_params(int64_t dim, int64_t inter, uint64_t offset) {
  return {ops::Linear(random_normal({inter, dim}, offset, 1 / std::sqrt(double(dim)))),
          ops::Linear(random_normal({inter, dim}, offset + 10000, 1 / std::sqrt(double(dim)))),
          ops::Linear(random_normal({dim, inter}, offset + 20000, 1 / std::sqrt(double(inter))))};
}

}  // namespace

TEST(GradMlp, FiniteDifferencesFloat64) {
  SCOPED_TRACE(seed_note());
  const int64_t dim = 7, inter = 6;
  const double lim = 0.7;  // low enough that both clamps fire on O(1) projections
  ops::MlpParams p = random_params(dim, inter, 1);
  // A 3-D input: the op works on any leading shape. Redraw until no projection sits within the
  // finite-difference step of a clamp bound (the function has a kink there).
  Tensor x;
  ops::MlpContext ctx;
  for (uint64_t draw = 0;; ++draw) {
    ASSERT_LT(draw, 1000u) << "no draw keeps clear of the clamp bounds";
    x = random_normal({2, 3, dim}, 100000 + draw * 1000);
    ops::mlp_forward(p, x, lim, ctx);
    if (clamp_margin(ctx.gate, ctx.up, lim) > 1e-3) break;
  }
  // The clamps must be active, else this test would not cover them.
  const std::vector<double> g = ctx.gate.to_doubles(), u = ctx.up.to_doubles();
  ASSERT_TRUE(std::any_of(g.begin(), g.end(), [&](double v) { return v > lim; }));
  ASSERT_TRUE(std::any_of(u.begin(), u.end(), [&](double v) { return std::abs(v) > lim; }));

  const Tensor dy = random_normal({2, 3, dim}, 900000);
  ops::MlpParams grads;
  const Tensor y = ops::mlp_forward(p, x, lim, ctx);
  EXPECT_EQ(rel_err(y, ops::mlp_forward(p, x, lim)), 0.0);  // the context changes nothing
  const Tensor dx = ops::mlp_backward(p, ctx, dy, lim, grads);
  ASSERT_EQ(dx.shape(), x.shape());
  const auto loss = [&] { return dot(dy, ops::mlp_forward(p, x, lim)); };
  EXPECT_LE(fd_rel_err(x, dx, loss), 1e-6);
  EXPECT_LE(fd_rel_err(p.gate_proj.weight, grads.gate_proj.weight, loss), 1e-6);
  EXPECT_LE(fd_rel_err(p.up_proj.weight, grads.up_proj.weight, loss), 1e-6);
  EXPECT_LE(fd_rel_err(p.down_proj.weight, grads.down_proj.weight, loss), 1e-6);
}

TEST(GradMlp, ClampedPositionsGetZeroGradient) {
  const double lim = 1.5;
  // Gate: above, at and below the upper bound, and very negative (never clamped: silu keeps a
  // tiny gradient there). Up: beyond both bounds, at both bounds, inside.
  const std::vector<double> gate = {2.0, 1.5, 1.2, -30.0, 0.3, 0.7};
  const std::vector<double> up = {0.4, 0.9, 3.0, -1.5, 1.5, -2.5};
  const std::vector<double> dout = {1.1, -0.7, 0.9, 1.3, -2.0, 0.6};
  for (DType dt : {DType::f64, DType::f32}) {
    SCOPED_TRACE(std::string(dtype_name(dt)));
    const Tensor g = Tensor::from_doubles(gate, {2, 3}, dt);
    const Tensor u = Tensor::from_doubles(up, {2, 3}, dt);
    const Tensor d = Tensor::from_doubles(dout, {2, 3}, dt);
    Tensor dg, du;
    ops::swiglu_clamped_backward(g, u, d, lim, dg, du);
    const std::vector<double> dgv = dg.to_doubles(), duv = du.to_doubles();
    const double tol = dt == DType::f64 ? 1e-14 : 1e-6;
    for (size_t i = 0; i < gate.size(); ++i) {
      SCOPED_TRACE("entry " + std::to_string(i));
      const double a = std::min(gate[i], lim), b = std::clamp(up[i], -lim, lim);
      const double s = 1 / (1 + std::exp(-a));
      // The reference (torch clamp with scalar bounds) passes the gradient strictly inside.
      const bool gate_free = gate[i] < lim, up_free = std::abs(up[i]) < lim;
      const double want_g = gate_free ? dout[i] * b * s * (1 + a * (1 - s)) : 0.0;
      const double want_u = up_free ? dout[i] * silu(a) : 0.0;
      if (!gate_free) EXPECT_EQ(dgv[i], 0.0);
      if (!up_free) EXPECT_EQ(duv[i], 0.0);
      EXPECT_NEAR(dgv[i], want_g, tol * std::max(1.0, std::abs(want_g)));
      EXPECT_NEAR(duv[i], want_u, tol * std::max(1.0, std::abs(want_u)));
    }
    EXPECT_NE(dgv[3], 0.0);  // a very negative gate is not clamped
    EXPECT_NE(dgv[2], 0.0);  // a free gate next to a clamped up still has a gradient

    // Fused layout: gate and up as the halves of one [N, 2I] product, gradients written into
    // the halves of one [N, 2I] buffer.
    Tensor fused = Tensor::empty({2, 6}, dt);
    fused.narrow(1, 0, 3).copy_(g);
    fused.narrow(1, 3, 3).copy_(u);
    Tensor dfused = Tensor::zeros({2, 6}, dt);
    Tensor dfg = dfused.narrow(1, 0, 3), dfu = dfused.narrow(1, 3, 3);
    ops::swiglu_clamped_backward(fused.narrow(1, 0, 3), fused.narrow(1, 3, 3), d, lim, dfg, dfu);
    EXPECT_EQ(dfused.narrow(1, 0, 3).to_doubles(), dgv);
    EXPECT_EQ(dfused.narrow(1, 3, 3).to_doubles(), duv);
  }
}

TEST(GradMlp, GradientsAccumulate) {
  SCOPED_TRACE(seed_note());
  const int64_t dim = 5, inter = 4;
  const ops::MlpParams p = random_params(dim, inter, 7);
  const Tensor x = random_normal({6, dim}, 50000), dy = random_normal({6, dim}, 60000);
  ops::MlpContext ctx;
  ops::mlp_forward(p, x, 1.0, ctx);
  ops::MlpParams once, twice;
  ops::mlp_backward(p, ctx, dy, 1.0, once);
  ops::mlp_backward(p, ctx, dy, 1.0, twice);
  ops::mlp_backward(p, ctx, dy, 1.0, twice);
  for (auto [a, b] : {std::pair{&once.gate_proj.weight, &twice.gate_proj.weight},
                      std::pair{&once.up_proj.weight, &twice.up_proj.weight},
                      std::pair{&once.down_proj.weight, &twice.down_proj.weight}}) {
    const std::vector<double> va = a->to_doubles(), vb = b->to_doubles();
    ASSERT_EQ(va.size(), vb.size());
    for (size_t i = 0; i < va.size(); ++i) EXPECT_NEAR(vb[i], 2 * va[i], 1e-13);
  }
}

TEST(GradMlp, MatchesReferenceGradients) {
  const io::SafetensorsFile f = open_golden(kGolden);
  const nlohmann::json meta = golden_metadata(f);
  for (const auto& [cfg, limit] : {std::pair{"a", 1.0}, std::pair{"b", 1.5}}) {
    SCOPED_TRACE(cfg);
    const std::string p = std::string(cfg) + ".";
    EXPECT_EQ(meta["configs"][cfg]["swiglu_limit"].get<double>(), limit);
    const ops::MlpParams params = golden_mlp_params(f, cfg);
    const Tensor x = f.tensor(p + "ffn_x");
    ops::MlpContext ctx;
    EXPECT_LE(rel_err(ops::mlp_forward(params, x, limit, ctx), f.tensor(p + "mlp_out")), 1e-4);
    ops::MlpParams grads;
    const Tensor dx = ops::mlp_backward(params, ctx, f.tensor(p + "mlp_dy"), limit, grads);
    EXPECT_LE(rel_err(dx, f.tensor(p + "mlp_dx")), 1e-4);
    EXPECT_LE(rel_err(grads.gate_proj.weight, f.tensor(p + "mlp_grad.gate_proj.weight")), 1e-4);
    EXPECT_LE(rel_err(grads.up_proj.weight, f.tensor(p + "mlp_grad.up_proj.weight")), 1e-4);
    EXPECT_LE(rel_err(grads.down_proj.weight, f.tensor(p + "mlp_grad.down_proj.weight")), 1e-4);
    const std::set<std::string> names = meta[p + "mlp_grads"].get<std::set<std::string>>();
    EXPECT_EQ(names,
              (std::set<std::string>{"down_proj.weight", "gate_proj.weight", "up_proj.weight"}));
    // Both clamps fire in the fixture: the reference's zeros there are part of what matched.
    const std::vector<double> g = ctx.gate.to_doubles(), u = ctx.up.to_doubles();
    EXPECT_TRUE(std::any_of(g.begin(), g.end(), [&](double v) { return v > limit; }));
    EXPECT_TRUE(std::any_of(u.begin(), u.end(), [&](double v) { return std::abs(v) > limit; }));
  }
}

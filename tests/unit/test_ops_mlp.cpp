// Clamped SwiGLU MLP: parity with the transformers reference (fixtures from
// tools/golden/ops_dsa_moe.py) and the exact clamp semantics.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "glmtune/ops/mlp.h"
#include "support/dsa_moe.h"
#include "support/test_support.h"

using namespace glmtune;
using namespace glmtune::test;

namespace {

constexpr const char* kGolden = "dsa_moe";
constexpr RelErr rel_err{};

}  // namespace

TEST(OpsMlp, MatchesReference) {
  const io::SafetensorsFile f = open_golden(kGolden);
  for (const auto& [cfg, limit] : {std::pair{"a", 1.0}, std::pair{"b", 1.5}}) {
    SCOPED_TRACE(cfg);
    const std::string p = std::string(cfg) + ".";
    const ops::MlpParams params = golden_mlp_params(f, cfg);
    const Tensor x = f.tensor(p + "moe_x");
    const Tensor ref = f.tensor(p + "mlp_out");
    EXPECT_LE(rel_err(ops::mlp_forward(params, x, limit), ref), 1e-4);
    // The f64 instantiation computes the same function (finite-difference checks run there).
    EXPECT_LE(rel_err(ops::mlp_forward(to_f64(params), x.to(DType::f64), limit), ref), 1e-4);
  }
}

TEST(OpsMlp, ClampsGateFromAboveAndUpOnBothSides) {
  SCOPED_TRACE(seed_note());
  const double limit = 2.0;
  // Values spread over [−3·limit, 3·limit] so that every clamp branch is taken many times.
  Tensor gate = random_normal({64, 33}, 0, 2.5 * limit);
  Tensor up = random_normal({64, 33}, 100000, 2.5 * limit);
  // Pin the branches that matter most: a gate far below −limit must NOT be clamped (silu of a
  // very negative gate is ~0, of −limit it is not), and exact boundary values pass unchanged.
  gate.set_item({0, 0}, -8.0 * limit);
  up.set_item({0, 0}, 1.0);
  gate.set_item({0, 1}, 5.0 * limit);
  up.set_item({0, 1}, -7.0 * limit);
  gate.set_item({0, 2}, limit);
  up.set_item({0, 2}, -limit);
  const Tensor out = ops::swiglu_clamped(gate, up, limit);
  const std::vector<double> g = gate.to_doubles(), u = up.to_doubles(), o = out.to_doubles();
  int gate_clamped = 0, up_low = 0, up_high = 0, gate_low = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    const double expect = silu(std::min(g[i], limit)) * std::clamp(u[i], -limit, limit);
    ASSERT_NEAR(o[i], expect, 1e-12 * (1 + std::abs(expect))) << "gate " << g[i] << " up " << u[i];
    gate_clamped += g[i] > limit;
    gate_low += g[i] < -limit;
    up_low += u[i] < -limit;
    up_high += u[i] > limit;
  }
  EXPECT_GT(gate_clamped, 0);
  EXPECT_GT(gate_low, 0);
  EXPECT_GT(up_low, 0);
  EXPECT_GT(up_high, 0);
  EXPECT_NEAR(o[0], silu(-8.0 * limit), 1e-15);
  EXPECT_NEAR(o[1], silu(limit) * -limit, 1e-12);
  EXPECT_NEAR(o[2], silu(limit) * -limit, 1e-12);
}

TEST(OpsMlp, StridedHalvesOfAFusedProductMatchContiguousInputs) {
  SCOPED_TRACE(seed_note());
  const Tensor fused = random_normal({17, 2 * 24}, 7, 3.0, DType::f32);
  const Tensor gate = fused.narrow(1, 0, 24), up = fused.narrow(1, 24, 24);
  ASSERT_FALSE(gate.is_contiguous());
  const Tensor a = ops::swiglu_clamped(gate, up, 1.5);
  const Tensor b = ops::swiglu_clamped(gate.contiguous(), up.contiguous(), 1.5);
  EXPECT_EQ(a.to_doubles(), b.to_doubles());
}

TEST(OpsMlp, OutputFollowsTheClampedFormula) {
  SCOPED_TRACE(seed_note());
  // A small MLP in f64 against a per-element evaluation of the formula in ops/mlp.h.
  const int64_t d = 6, inter = 5, t = 4;
  const double limit = 0.7;
  ops::MlpParams p{ops::Linear(random_normal({inter, d}, 1, DType::f64)),
                   ops::Linear(random_normal({inter, d}, 2, DType::f64)),
                   ops::Linear(random_normal({d, inter}, 3, DType::f64))};
  const Tensor x = random_normal({t, d}, 4, DType::f64);
  const Tensor y = ops::mlp_forward(p, x, limit);
  for (int64_t r = 0; r < t; ++r) {
    std::vector<double> act(inter);
    for (int64_t i = 0; i < inter; ++i) {
      double g = 0, u = 0;
      for (int64_t c = 0; c < d; ++c) {
        g += x.item({r, c}) * p.gate_proj.weight.item({i, c});
        u += x.item({r, c}) * p.up_proj.weight.item({i, c});
      }
      act[i] = silu(std::min(g, limit)) * std::clamp(u, -limit, limit);
    }
    for (int64_t c = 0; c < d; ++c) {
      double expect = 0;
      for (int64_t i = 0; i < inter; ++i) expect += act[i] * p.down_proj.weight.item({c, i});
      EXPECT_NEAR(y.item({r, c}), expect, 1e-12);
    }
  }
}

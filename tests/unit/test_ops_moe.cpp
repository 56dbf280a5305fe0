// MoE: parity with the transformers reference (fixtures from tools/golden/ops_dsa_moe.py), router
// semantics (selection-only bias, group limit, normalisation, scaling), expert dispatch and the
// expert load counts.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "glmtune/ops/moe.h"
#include "support/dsa_moe.h"
#include "support/test_support.h"

using namespace glmtune;
using namespace glmtune::test;

namespace {

constexpr const char* kGolden = "dsa_moe";
constexpr RelErr rel_err{};

// Random MoE parameters in f64 with fan-in scaled weights.
ops::MoeParams random_params(int64_t experts, int64_t dim, int64_t inter, int64_t shared_inter,
                             uint64_t offset) {
  ops::MoeParams p;
  p.router_weight = random_normal({experts, dim}, offset, 1 / std::sqrt(double(dim)));
  p.e_score_correction_bias = random_normal({experts}, offset + 10000, 0.1);
  p.gate_up_proj.weight =
      random_normal({experts, 2 * inter, dim}, offset + 20000, 1 / std::sqrt(double(dim)));
  p.down_proj.weight =
      random_normal({experts, dim, inter}, offset + 40000, 1 / std::sqrt(double(inter)));
  p.shared = {ops::Linear(random_normal({shared_inter, dim}, offset + 60000)),
              ops::Linear(random_normal({shared_inter, dim}, offset + 70000)),
              ops::Linear(random_normal({dim, shared_inter}, offset + 80000))};
  return p;
}

// The experts row r of a routing chose, as a set (the reference's top-k is unsorted). Unlike
// row_set it keeps every entry: a routing fills every slot, so even a −1 must show as a mismatch.
std::set<int64_t> chosen_experts(const Tensor& idx, int64_t r) {
  std::set<int64_t> s;
  for (int64_t k = 0; k < idx.size(1); ++k) s.insert(int64_t(idx.item({r, k})));
  return s;
}

}  // namespace

TEST(OpsMoe, MatchesReference) {
  const io::SafetensorsFile f = open_golden(kGolden);
  for (const GoldenDsaMoeConfig& c : kGoldenDsaMoeConfigs) {
    const std::string& name = c.name;
    const ops::MoeConfig& cfg = c.moe;
    SCOPED_TRACE("config " + name);
    const ops::MoeParams params = golden_moe_params(f, name);
    const Tensor x = f.tensor(name + ".moe_x");
    const ops::MoeOutput out = ops::moe_forward(cfg, params, x);
    EXPECT_LE(rel_err(out.y, f.tensor(name + ".moe_out")), 1e-4);
    EXPECT_LE(rel_err(out.routing.logits, f.tensor(name + ".router_logits")), 1e-4);
    EXPECT_EQ(out.expert_counts.to_doubles(), f.tensor(name + ".expert_counts").to_doubles());

    // Selections as sets (the reference's top-k is unsorted), weights matched by expert id.
    const Tensor ref_idx = f.tensor(name + ".router_indices");
    const Tensor ref_w = f.tensor(name + ".router_weights");
    for (int64_t r = 0; r < x.size(0); ++r) {
      ASSERT_EQ(chosen_experts(out.routing.indices, r), chosen_experts(ref_idx, r)) << "row " << r;
      std::map<int64_t, double> ref_weight;
      for (int64_t k = 0; k < cfg.top_k; ++k)
        ref_weight[int64_t(ref_idx.item({r, k}))] = ref_w.item({r, k});
      for (int64_t k = 0; k < cfg.top_k; ++k) {
        const int64_t e = int64_t(out.routing.indices.item({r, k}));
        EXPECT_NEAR(out.routing.weights.item({r, k}), ref_weight[e],
                    1e-5 * std::abs(ref_weight[e]) + 1e-7)
            << "row " << r << " expert " << e;
      }
    }

    // The f64 path gives the same function.
    EXPECT_LE(rel_err(ops::moe_forward(cfg, to_f64(params), x.to(DType::f64)).y,
                      f.tensor(name + ".moe_out")),
              1e-4);
  }
}

TEST(OpsMoe, CorrectionBiasSteersChoiceButNeverTheWeights) {
  SCOPED_TRACE(seed_note());
  const int64_t experts = 16, dim = 12, rows = 40;
  ops::MoeConfig cfg{experts, 4, 1, 1, /*norm_topk_prob=*/false, /*rsf=*/1.0, 10.0};
  const Tensor w = random_normal({experts, dim}, 1, 0.5);
  const Tensor x = random_normal({rows, dim}, 2);
  Tensor bias = random_normal({experts}, 3, 0.05);
  const int64_t forced = 5, banned = 9;
  bias.set_item({forced}, 10.0);
  bias.set_item({banned}, -10.0);
  const ops::Routing r = ops::moe_route(cfg, w, bias, x);
  for (int64_t t = 0; t < rows; ++t) {
    const std::set<int64_t> sel = chosen_experts(r.indices, t);
    EXPECT_TRUE(sel.count(forced)) << "row " << t;
    EXPECT_FALSE(sel.count(banned)) << "row " << t;
    for (int64_t k = 0; k < cfg.top_k; ++k) {
      const int64_t e = int64_t(r.indices.item({t, k}));
      // Without normalisation and scaling the weight is exactly σ(logit): no trace of the bias.
      EXPECT_NEAR(r.weights.item({t, k}), sigmoid(r.logits.item({t, e})), 1e-14);
    }
  }

  // Normalised and scaled: the weights keep σ's ratios and sum to the scaling factor.
  cfg.norm_topk_prob = true;
  cfg.routed_scaling_factor = 2.5;
  const ops::Routing n = ops::moe_route(cfg, w, bias, x);
  for (int64_t t = 0; t < rows; ++t) {
    double sum_p = 0, sum_w = 0;
    for (int64_t k = 0; k < cfg.top_k; ++k) {
      sum_p += sigmoid(n.logits.item({t, int64_t(n.indices.item({t, k}))}));
      sum_w += n.weights.item({t, k});
    }
    EXPECT_NEAR(sum_w, 2.5, 1e-12);
    for (int64_t k = 0; k < cfg.top_k; ++k) {
      const double p = sigmoid(n.logits.item({t, int64_t(n.indices.item({t, k}))}));
      EXPECT_NEAR(n.weights.item({t, k}), 2.5 * p / sum_p, 1e-12);
    }
  }
}

TEST(OpsMoe, GroupLimitedChoiceMatchesABruteForceOracle) {
  SCOPED_TRACE(seed_note());
  const int64_t experts = 16, groups = 4, keep = 2, top_k = 3, dim = 10, rows = 64;
  const ops::MoeConfig cfg{experts, top_k, groups, keep, true, 1.0, 10.0};
  const Tensor w = random_normal({experts, dim}, 11);
  const Tensor x = random_normal({rows, dim}, 12);
  const Tensor bias = random_normal({experts}, 13, 0.2);
  const ops::Routing r = ops::moe_route(cfg, w, bias, x);
  const int64_t per = experts / groups;
  for (int64_t t = 0; t < rows; ++t) {
    std::vector<double> c(experts);
    for (int64_t e = 0; e < experts; ++e) c[e] = sigmoid(r.logits.item({t, e})) + bias.item({e});
    // Group score: sum of the two largest biased scores of the group; keep the two best groups.
    std::vector<std::pair<double, int64_t>> gs;
    for (int64_t g = 0; g < groups; ++g) {
      std::vector<double> m(c.begin() + g * per, c.begin() + (g + 1) * per);
      std::sort(m.rbegin(), m.rend());
      gs.push_back({m[0] + m[1], g});
    }
    std::sort(gs.rbegin(), gs.rend());
    std::vector<std::pair<double, int64_t>> cand;
    for (int64_t i = 0; i < keep; ++i)
      for (int64_t j = 0; j < per; ++j) {
        const int64_t e = gs[i].second * per + j;
        cand.push_back({c[e], e});
      }
    std::sort(cand.rbegin(), cand.rend());
    std::set<int64_t> expect;
    for (int64_t k = 0; k < top_k; ++k) expect.insert(cand[k].second);
    EXPECT_EQ(chosen_experts(r.indices, t), expect) << "row " << t;
  }
}

TEST(OpsMoe, ExpertsEqualAPerTokenEvaluation) {
  SCOPED_TRACE(seed_note());
  const int64_t experts = 6, dim = 8, inter = 5, rows = 23;
  const ops::MoeConfig cfg{experts, 2, 1, 1, true, 2.5, 0.8};
  const ops::MoeParams p = random_params(experts, dim, inter, 7, 100);
  const Tensor x = random_normal({rows, dim}, 99);
  const ops::Routing r = ops::moe_route(cfg, p.router_weight, p.e_score_correction_bias, x);
  const Tensor y = ops::moe_experts(cfg, p.gate_up_proj.weight, p.down_proj.weight, x, r);
  for (int64_t t = 0; t < rows; ++t) {
    std::vector<double> expect(dim, 0.0);
    for (int64_t k = 0; k < cfg.top_k; ++k) {
      const int64_t e = int64_t(r.indices.item({t, k}));
      const double wk = r.weights.item({t, k});
      std::vector<double> act(inter);
      for (int64_t i = 0; i < inter; ++i) {
        double g = 0, u = 0;
        for (int64_t c = 0; c < dim; ++c) {
          g += x.item({t, c}) * p.gate_up_proj.weight.item({e, i, c});          // gate rows first
          u += x.item({t, c}) * p.gate_up_proj.weight.item({e, inter + i, c});  // then up rows
        }
        act[i] = silu(std::min(g, cfg.swiglu_limit)) *
                 std::clamp(u, -cfg.swiglu_limit, cfg.swiglu_limit);
      }
      for (int64_t c = 0; c < dim; ++c) {
        double s = 0;
        for (int64_t i = 0; i < inter; ++i) s += act[i] * p.down_proj.weight.item({e, c, i});
        expect[c] += wk * s;
      }
    }
    for (int64_t c = 0; c < dim; ++c) EXPECT_NEAR(y.item({t, c}), expect[c], 1e-12) << t;
  }
  // The whole block adds the shared expert on top.
  const ops::MoeOutput full = ops::moe_forward(cfg, p, x);
  const Tensor shared = ops::mlp_forward(p.shared, x, cfg.swiglu_limit);
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t c = 0; c < dim; ++c)
      EXPECT_NEAR(full.y.item({t, c}), y.item({t, c}) + shared.item({t, c}), 1e-13);
}

TEST(OpsMoe, ExpertCountsCoverTheCountedRowsOnly) {
  SCOPED_TRACE(seed_note());
  const int64_t experts = 8, dim = 6, rows = 30, counted = 21;
  const ops::MoeConfig cfg{experts, 3, 2, 2, true, 1.0, 10.0};
  const ops::MoeParams p = random_params(experts, dim, 4, 4, 500);
  const Tensor x = random_normal({rows, dim}, 501);
  const ops::MoeOutput all = ops::moe_forward(cfg, p, x);
  const ops::MoeOutput part = ops::moe_forward(cfg, p, x, counted);
  std::vector<double> expect_all(experts, 0), expect_part(experts, 0);
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t k = 0; k < cfg.top_k; ++k) {
      const int64_t e = int64_t(all.routing.indices.item({t, k}));
      expect_all[e] += 1;
      if (t < counted) expect_part[e] += 1;
    }
  EXPECT_EQ(all.expert_counts.to_doubles(), expect_all);
  EXPECT_EQ(part.expert_counts.to_doubles(), expect_part);
  EXPECT_EQ(std::accumulate(expect_all.begin(), expect_all.end(), 0.0), double(rows * cfg.top_k));
  // Counting fewer rows changes nothing else.
  EXPECT_EQ(all.y.to_doubles(), part.y.to_doubles());
}

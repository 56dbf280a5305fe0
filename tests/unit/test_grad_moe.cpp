// Backward of the MoE block: float64 central finite differences on fresh random inputs (grouped
// routing, with and without top-k normalisation, an extra router-logit gradient), no gradient for
// the correction bias, nothing for experts that received no token, and the reference's autograd
// gradients (fixtures from tools/golden/grads_dsa_moe.py).

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "glmtune/ops/moe.h"
#include "support/dsa_moe.h"
#include "support/test_support.h"

using namespace glmtune;
using namespace glmtune::test;

namespace {

constexpr const char* kGolden = "grads_dsa_moe";
constexpr RelErr rel_err{};

ops::MoeParams random_params(const ops::MoeConfig& cfg, int64_t dim, int64_t inter,
                             int64_t shared_inter, uint64_t offset) {
  const double sd = 1 / std::sqrt(double(dim));
  ops::MoeParams p;
  p.router_weight = random_normal({cfg.n_experts, dim}, offset, sd);
  p.e_score_correction_bias = random_normal({cfg.n_experts}, offset + 1000, 0.1);
  p.gate_up_proj.weight = random_normal({cfg.n_experts, 2 * inter, dim}, offset + 2000, sd);
  p.down_proj.weight =
      random_normal({cfg.n_experts, dim, inter}, offset + 90000, 1 / std::sqrt(inter));
  p.shared = {ops::Linear(random_normal({shared_inter, dim}, offset + 200000, sd)),
              ops::Linear(random_normal({shared_inter, dim}, offset + 210000, sd)),
              ops::Linear(random_normal({dim, shared_inter}, offset + 220000,
                                        1 / std::sqrt(shared_inter)))};
  return p;
}

// The smallest margin, over all rows, at the routing's decisions (group choice and expert choice
// on the biased scores) and at the clamp bounds of every expert pre-activation: finite differences
// are only valid away from these kinks.
double decision_margin(const ops::MoeConfig& cfg, const ops::MoeParams& p, const Tensor& x) {
  const int64_t rows = x.size(0), dim = x.size(1), n_exp = cfg.n_experts;
  const int64_t per = n_exp / cfg.n_group;
  const std::vector<double> xv = x.to_doubles(), wr = p.router_weight.to_doubles();
  const std::vector<double> bias = p.e_score_correction_bias.to_doubles();
  double margin = INFINITY;
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<double> c(static_cast<size_t>(n_exp));
    for (int64_t e = 0; e < n_exp; ++e) {
      double l = 0;
      for (int64_t d = 0; d < dim; ++d) l += xv[size_t(r * dim + d)] * wr[size_t(e * dim + d)];
      c[size_t(e)] = 1 / (1 + std::exp(-l)) + bias[size_t(e)];
    }
    std::vector<double> gs;
    for (int64_t g = 0; g < cfg.n_group; ++g) {
      std::vector<double> m(c.begin() + g * per, c.begin() + (g + 1) * per);
      std::sort(m.rbegin(), m.rend());
      gs.push_back(m[0] + m[1]);
    }
    std::vector<int64_t> order(size_t(cfg.n_group));
    for (int64_t g = 0; g < cfg.n_group; ++g) order[size_t(g)] = g;
    std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return gs[a] > gs[b]; });
    if (cfg.topk_group < cfg.n_group)
      margin = std::min(margin, gs[order[cfg.topk_group - 1]] - gs[order[cfg.topk_group]]);
    std::vector<double> allowed;
    for (int64_t i = 0; i < cfg.topk_group; ++i)
      for (int64_t e = order[i] * per; e < (order[i] + 1) * per; ++e) allowed.push_back(c[e]);
    std::sort(allowed.rbegin(), allowed.rend());
    if (int64_t(allowed.size()) > cfg.top_k)
      margin = std::min(margin, allowed[cfg.top_k - 1] - allowed[cfg.top_k]);
  }
  const double lim = cfg.swiglu_limit;
  const std::vector<double> gu = p.gate_up_proj.weight.to_doubles();
  const int64_t two_i = p.gate_up_proj.weight.size(1);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t e = 0; e < n_exp; ++e)
      for (int64_t j = 0; j < two_i; ++j) {
        double h = 0;
        for (int64_t d = 0; d < dim; ++d)
          h += xv[size_t(r * dim + d)] * gu[size_t((e * two_i + j) * dim + d)];
        margin = std::min({margin, std::abs(h - lim), std::abs(h + lim)});
      }
  return margin;
}

}  // namespace

TEST(GradMoe, FiniteDifferencesFloat64) {
  SCOPED_TRACE(seed_note());
  const int64_t dim = 6, inter = 4, shared_inter = 5, rows = 9;
  for (bool norm : {true, false}) {
    SCOPED_TRACE(norm ? "norm_topk_prob" : "no normalisation");
    ops::MoeConfig cfg;
    cfg.n_experts = 6;
    cfg.top_k = 2;
    cfg.n_group = 2;
    cfg.topk_group = 1;
    cfg.norm_topk_prob = norm;
    cfg.routed_scaling_factor = 2.5;
    cfg.swiglu_limit = 0.8;
    ops::MoeParams p = random_params(cfg, dim, inter, shared_inter, norm ? 1 : 500000);
    Tensor x;
    for (uint64_t draw = 0;; ++draw) {
      ASSERT_LT(draw, 1000u) << "no input keeps clear of the routing and clamp kinks";
      x = random_normal({rows, dim}, 1000000 + draw * 1000);
      if (decision_margin(cfg, p, x) > 1e-3) break;
    }
    // The loss also reads the router logits (as a balancing loss would), so the extra
    // router-logit gradient path is checked too.
    const Tensor dy = random_normal({rows, dim}, 3000000);
    const Tensor dlogits = random_normal({rows, cfg.n_experts}, 3100000);
    const auto loss = [&] {
      const ops::MoeOutput o = ops::moe_forward(cfg, p, x);
      return dot(dy, o.y) + dot(dlogits, o.routing.logits);
    };
    ops::MoeContext ctx;
    const ops::MoeOutput out = ops::moe_forward(cfg, p, x, -1, ctx);
    EXPECT_EQ(rel_err(out.y, ops::moe_forward(cfg, p, x).y), 0.0);
    ops::MoeParams grads;
    const Tensor dx = ops::moe_backward(cfg, p, ctx, dy, grads, dlogits);
    EXPECT_LE(fd_rel_err(x, dx, loss), 1e-6);
    EXPECT_LE(fd_rel_err(p.router_weight, grads.router_weight, loss), 1e-6);
    EXPECT_LE(fd_rel_err(p.gate_up_proj.weight, grads.gate_up_proj.weight, loss), 1e-6);
    EXPECT_LE(fd_rel_err(p.down_proj.weight, grads.down_proj.weight, loss), 1e-6);
    EXPECT_LE(fd_rel_err(p.shared.gate_proj.weight, grads.shared.gate_proj.weight, loss), 1e-6);
    EXPECT_LE(fd_rel_err(p.shared.up_proj.weight, grads.shared.up_proj.weight, loss), 1e-6);
    EXPECT_LE(fd_rel_err(p.shared.down_proj.weight, grads.shared.down_proj.weight, loss), 1e-6);
    // The correction bias only chooses: the loss is flat in it away from a choice flip, and the
    // backward leaves its gradient alone.
    EXPECT_FALSE(grads.e_score_correction_bias.defined());
    const std::vector<double> fd_bias =
        finite_differences(p.e_score_correction_bias, loss).to_doubles();
    for (double v : fd_bias) EXPECT_EQ(v, 0.0);
  }
}

TEST(GradMoe, RouterBackwardMatchesFiniteDifferences) {
  SCOPED_TRACE(seed_note());
  ops::MoeConfig cfg;
  cfg.n_experts = 7;
  cfg.top_k = 3;
  cfg.routed_scaling_factor = 1.7;
  const int64_t rows = 5, dim = 4;
  ops::MoeParams p = random_params(cfg, dim, 2, 2, 11);
  const Tensor x = random_normal({rows, dim}, 4000000);
  const Tensor dw = random_normal({rows, cfg.top_k}, 4100000);
  for (bool norm : {true, false}) {
    cfg.norm_topk_prob = norm;
    const ops::Routing r = ops::moe_route(cfg, p.router_weight, p.e_score_correction_bias, x);
    const Tensor dlogits = ops::moe_route_backward(cfg, r, dw);
    // Perturb the logits directly, keeping the selection: the weights as functions of them.
    Tensor logits = r.logits.clone();
    const auto loss = [&] {
      double s = 0;
      for (int64_t t = 0; t < rows; ++t) {
        double sum = 0;
        std::vector<double> pk;
        for (int64_t k = 0; k < cfg.top_k; ++k) {
          const int64_t e = int64_t(r.indices.item({t, k}));
          pk.push_back(1 / (1 + std::exp(-logits.item({t, e}))));
          sum += pk.back();
        }
        for (int64_t k = 0; k < cfg.top_k; ++k) {
          const double w = (norm ? pk[k] / (sum + 1e-20) : pk[k]) * cfg.routed_scaling_factor;
          s += w * dw.item({t, k});
        }
      }
      return s;
    };
    // The weights this loss rebuilds are the router's own.
    EXPECT_LE(
        rel_err(
            r.weights,
            [&] {
              Tensor w = r.weights.clone();
              for (int64_t t = 0; t < rows; ++t) {
                double sum = 0;
                for (int64_t k = 0; k < cfg.top_k; ++k)
                  sum += 1 / (1 + std::exp(-logits.item({t, int64_t(r.indices.item({t, k}))})));
                for (int64_t k = 0; k < cfg.top_k; ++k) {
                  const double pk =
                      1 / (1 + std::exp(-logits.item({t, int64_t(r.indices.item({t, k}))})));
                  w.set_item({t, k}, (norm ? pk / (sum + 1e-20) : pk) * cfg.routed_scaling_factor);
                }
              }
              return w;
            }()),
        1e-14);
    const Tensor fd = finite_differences(logits, loss);
    EXPECT_LE(rel_err(dlogits, fd), 1e-6) << (norm ? "normalised" : "plain");
    for (int64_t t = 0; t < rows; ++t)
      for (int64_t e = 0; e < cfg.n_experts; ++e) {
        bool chosen = false;
        for (int64_t k = 0; k < cfg.top_k; ++k) chosen |= int64_t(r.indices.item({t, k})) == e;
        if (!chosen) EXPECT_EQ(dlogits.item({t, e}), 0.0);
      }
  }
}

TEST(GradMoe, ExpertsWithoutTokensGetNoGradient) {
  SCOPED_TRACE(seed_note());
  ops::MoeConfig cfg;
  cfg.n_experts = 8;
  cfg.top_k = 2;
  cfg.swiglu_limit = 10;
  const int64_t dim = 5, inter = 3;
  const ops::MoeParams p = random_params(cfg, dim, inter, 4, 21);
  const Tensor x = random_normal({2, dim}, 5000000);  // two rows reach at most four experts
  ops::MoeContext ctx;
  const ops::MoeOutput out = ops::moe_forward(cfg, p, x, -1, ctx);
  ops::MoeParams grads;
  ops::moe_backward(cfg, p, ctx, random_normal({2, dim}, 5100000), grads);
  const std::vector<double> counts = out.expert_counts.to_doubles();
  int64_t idle = 0;
  for (int64_t e = 0; e < cfg.n_experts; ++e) {
    const std::vector<double> gu = grads.gate_up_proj.weight.select(0, e).contiguous().to_doubles();
    const std::vector<double> dn = grads.down_proj.weight.select(0, e).contiguous().to_doubles();
    const double mag = std::abs(*std::max_element(
        gu.begin(), gu.end(), [](double a, double b) { return std::abs(a) < std::abs(b); }));
    if (counts[size_t(e)] == 0) {
      ++idle;
      for (double v : gu) EXPECT_EQ(v, 0.0) << "expert " << e;
      for (double v : dn) EXPECT_EQ(v, 0.0) << "expert " << e;
    } else {
      EXPECT_GT(mag, 0.0) << "expert " << e;
    }
  }
  EXPECT_GE(idle, 4);
}

TEST(GradMoe, MatchesReferenceGradients) {
  const io::SafetensorsFile f = open_golden(kGolden);
  const nlohmann::json meta = golden_metadata(f);
  for (const std::string c : {"a", "b"}) {
    SCOPED_TRACE("config " + c);
    const nlohmann::json& jc = meta["configs"][c];
    ops::MoeConfig cfg;
    cfg.n_experts = jc["n_routed_experts"];
    cfg.top_k = jc["num_experts_per_tok"];
    cfg.n_group = jc["n_group"];
    cfg.topk_group = jc["topk_group"];
    cfg.norm_topk_prob = jc["norm_topk_prob"];
    cfg.routed_scaling_factor = jc["routed_scaling_factor"];
    cfg.swiglu_limit = jc["swiglu_limit"];
    const ops::MoeParams params = golden_moe_params(f, c);
    const Tensor x = f.tensor(c + ".ffn_x");
    ops::MoeContext ctx;
    const ops::MoeOutput out = ops::moe_forward(cfg, params, x, -1, ctx);
    EXPECT_LE(rel_err(out.y, f.tensor(c + ".moe_out")), 1e-4);
    ops::MoeParams grads;
    const Tensor dx = ops::moe_backward(cfg, params, ctx, f.tensor(c + ".moe_dy"), grads);
    const std::string g = c + ".moe_grad.";
    EXPECT_LE(rel_err(dx, f.tensor(c + ".moe_dx")), 1e-4);
    EXPECT_LE(rel_err(grads.router_weight, f.tensor(g + "gate.weight")), 1e-4);
    EXPECT_LE(rel_err(grads.gate_up_proj.weight, f.tensor(g + "experts.gate_up_proj")), 1e-4);
    EXPECT_LE(rel_err(grads.down_proj.weight, f.tensor(g + "experts.down_proj")), 1e-4);
    EXPECT_LE(
        rel_err(grads.shared.gate_proj.weight, f.tensor(g + "shared_experts.gate_proj.weight")),
        1e-4);
    EXPECT_LE(rel_err(grads.shared.up_proj.weight, f.tensor(g + "shared_experts.up_proj.weight")),
              1e-4);
    EXPECT_LE(
        rel_err(grads.shared.down_proj.weight, f.tensor(g + "shared_experts.down_proj.weight")),
        1e-4);
    // The reference gives gradients to exactly these parameters: not to the correction bias.
    EXPECT_FALSE(grads.e_score_correction_bias.defined());
    const std::set<std::string> names = meta[c + ".moe_grads"].get<std::set<std::string>>();
    EXPECT_EQ(names, (std::set<std::string>{"experts.down_proj", "experts.gate_up_proj",
                                            "gate.weight", "shared_experts.down_proj.weight",
                                            "shared_experts.gate_proj.weight",
                                            "shared_experts.up_proj.weight"}));
    // The f64 instantiation agrees (the finite-difference checks run there).
    const ops::MoeParams p64 = to_f64(params);
    ops::MoeContext ctx64;
    ops::moe_forward(cfg, p64, x.to(DType::f64), -1, ctx64);
    ops::MoeParams grads64;
    const Tensor dx64 =
        ops::moe_backward(cfg, p64, ctx64, f.tensor(c + ".moe_dy").to(DType::f64), grads64);
    EXPECT_LE(rel_err(dx64, f.tensor(c + ".moe_dx")), 1e-4);
    EXPECT_LE(rel_err(grads64.router_weight, f.tensor(g + "gate.weight")), 1e-4);
  }
}

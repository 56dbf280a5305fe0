// mHC hyper-connections: parity with the transformers reference (fixtures from
// tools/golden/ops_kda_mhc.py), a whole decoder layer's stream bookkeeping around the KDA mixer,
// and the Sinkhorn / stream-update formulas on fresh random inputs.

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "glmtune/ops/kda.h"
#include "glmtune/ops/mhc.h"
#include "glmtune/ops/norm.h"
#include "support/kda_mhc.h"
#include "support/test_support.h"

using namespace glmtune;
using namespace glmtune::test;

namespace {

constexpr const char* kGolden = "kda_mhc";
constexpr RelErr rel_err{.zero_reference_fails = true};

// The reference's Sinkhorn (docs/model/kda_mhc.md, "mHC", step 4) on one H×H matrix of logits, in
// double; iters = 0 stops after softmax + eps (the projection's starting point).
std::vector<double> sinkhorn_spec(std::vector<double> c, int64_t h, int64_t iters, double eps) {
  for (int64_t i = 0; i < h; ++i) {
    double mx = -INFINITY, s = 0;
    for (int64_t j = 0; j < h; ++j) mx = std::max(mx, c[i * h + j]);
    for (int64_t j = 0; j < h; ++j) s += std::exp(c[i * h + j] - mx);
    for (int64_t j = 0; j < h; ++j) c[i * h + j] = std::exp(c[i * h + j] - mx) / s + eps;
  }
  auto cols = [&] {
    for (int64_t j = 0; j < h; ++j) {
      double s = 0;
      for (int64_t i = 0; i < h; ++i) s += c[i * h + j];
      for (int64_t i = 0; i < h; ++i) c[i * h + j] /= s + eps;
    }
  };
  auto rows = [&] {
    for (int64_t i = 0; i < h; ++i) {
      double s = 0;
      for (int64_t j = 0; j < h; ++j) s += c[i * h + j];
      for (int64_t j = 0; j < h; ++j) c[i * h + j] /= s + eps;
    }
  };
  if (iters > 0) cols();
  for (int64_t it = 1; it < iters; ++it) {
    rows();
    cols();
  }
  return c;
}

}  // namespace

TEST(OpsMhc, PreMatchesReference) {
  const io::SafetensorsFile f = open_golden(kGolden);
  const HcParams hc = golden_hc_params(f, "mhc.");
  const Tensor x = f.tensor("mhc.streams");
  ops::MhcOptions opt;
  opt.hc_mult = x.size(1);
  for (DType dt : {DType::f32, DType::f64}) {
    SCOPED_TRACE(std::string(dtype_name(dt)));
    const ops::MhcPreResult r =
        ops::mhc_pre(x.to(dt), hc.fn.to(dt), hc.base.to(dt), hc.scale.to(dt), opt);
    EXPECT_LE(rel_err(r.post, f.tensor("mhc.post")), 1e-5);
    EXPECT_LE(rel_err(r.comb, f.tensor("mhc.comb")), 1e-5);
    EXPECT_LE(rel_err(r.collapsed, f.tensor("mhc.collapsed")), 1e-5);
  }
}

TEST(OpsMhc, PostAndHeadMatchReference) {
  const io::SafetensorsFile f = open_golden(kGolden);
  const Tensor x = f.tensor("mhc.streams");
  const Tensor updated =
      ops::mhc_post(x, f.tensor("mhc.sub_out"), f.tensor("mhc.post"), f.tensor("mhc.comb"));
  EXPECT_LE(rel_err(updated, f.tensor("mhc.updated")), 1e-5);
  EXPECT_LE(rel_err(ops::mhc_head(x), f.tensor("mhc.head")), 1e-6);
}

TEST(OpsMhc, DecoderLayerAroundKdaMatchesReference) {
  // The reference decoder layer 0 (KDA) with its FFN replaced by the identity:
  // hc_pre → input_layernorm → KDA → hc_post → hc_pre → post_attention_layernorm → hc_post.
  const io::SafetensorsFile f = open_golden(kGolden);
  const Tensor x = f.tensor("layer.streams"), cu = f.tensor("layer.cu_seqlens");
  const ops::KdaParams kda = golden_kda_params(f, "kda.");
  ops::KdaOptions kopt;
  kopt.num_heads = kda.A_log.size(0);
  kopt.head_dim = kda.o_norm.size(0);
  ops::MhcOptions hopt;
  hopt.hc_mult = x.size(1);
  const double eps = 1e-5;
  const HcParams a = golden_hc_params(f, "layer.attn_hc."),
                 m = golden_hc_params(f, "layer.ffn_hc.");

  const ops::MhcPreResult pa = ops::mhc_pre(x, a.fn, a.base, a.scale, hopt);
  const Tensor u = ops::rms_norm(pa.collapsed, f.tensor("layer.input_layernorm"), eps);
  const Tensor y = ops::kda_forward(kda, u, cu, kopt);
  const Tensor x1 = ops::mhc_post(x, y, pa.post, pa.comb);
  const ops::MhcPreResult pf = ops::mhc_pre(x1, m.fn, m.base, m.scale, hopt);
  const Tensor z = ops::rms_norm(pf.collapsed, f.tensor("layer.post_attention_layernorm"), eps);
  const Tensor x2 = ops::mhc_post(x1, z, pf.post, pf.comb);
  EXPECT_LE(rel_err(x2, f.tensor("layer.out")), 1e-4);
}

TEST(OpsMhc, SavedTensorsReproduceTheForward) {
  SCOPED_TRACE(seed_note());
  const int64_t h = 3, d = 7, m = (2 + h) * h;
  const Tensor x = random_normal({2, 5, h, d}, 1, DType::f64, 0.2, 1.3);
  const Tensor fn = random_normal({m, h * d}, 2, DType::f64, 0, 0.4);
  const Tensor base = random_normal({m}, 3, DType::f64, 0, 0.5);
  const Tensor scale = random_normal({3}, 4, DType::f64, 1.0, 0.3);
  ops::MhcOptions opt;
  opt.hc_mult = h;
  opt.sinkhorn_iters = 7;
  ops::MhcPreSaved s;
  const ops::MhcPreResult r = ops::mhc_pre(x, fn, base, scale, opt, &s);
  ASSERT_EQ(r.comb.shape(), (Shape{2, 5, h, h}));
  ASSERT_EQ(r.collapsed.shape(), (Shape{2, 5, d}));
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t t = 0; t < 5; ++t) {
      // Un-weighted RMS of the flattened streams and the mixing logits, in plain loops.
      double ss = 0;
      for (int64_t i = 0; i < h; ++i)
        for (int64_t k = 0; k < d; ++k) ss += std::pow(x.item({b, t, i, k}), 2);
      const double rstd = 1 / std::sqrt(ss / double(h * d) + opt.rms_eps);
      EXPECT_NEAR(s.rstd.item({b, t}), rstd, 1e-12);
      std::vector<double> mix(m);
      for (int64_t o = 0; o < m; ++o) {
        for (int64_t i = 0; i < h; ++i)
          for (int64_t k = 0; k < d; ++k)
            mix[o] += x.item({b, t, i, k}) * rstd * fn.item({o, i * d + k});
        EXPECT_NEAR(s.mix.item({b, t, o}), mix[o], 1e-12);
      }
      std::vector<double> logits(h * h);
      for (int64_t i = 0; i < h; ++i) {
        const double pre = sigmoid(mix[i] * scale.item({0}) + base.item({i})) + opt.hc_eps;
        EXPECT_NEAR(s.pre.item({b, t, i}), pre, 1e-14);
        EXPECT_NEAR(r.post.item({b, t, i}),
                    2 * sigmoid(mix[h + i] * scale.item({1}) + base.item({h + i})), 1e-14);
        for (int64_t j = 0; j < h; ++j)
          logits[i * h + j] =
              mix[2 * h + i * h + j] * scale.item({2}) + base.item({2 * h + i * h + j});
      }
      const std::vector<double> c = sinkhorn_spec(logits, h, opt.sinkhorn_iters, opt.hc_eps);
      const std::vector<double> c0 = sinkhorn_spec(logits, h, 0, opt.hc_eps);
      for (int64_t i = 0; i < h; ++i)
        for (int64_t j = 0; j < h; ++j) {
          EXPECT_NEAR(r.comb.item({b, t, i, j}), c[i * h + j], 1e-13);
          EXPECT_NEAR(s.comb_init.item({b, t, i, j}), c0[i * h + j], 1e-14);
        }
      for (int64_t k = 0; k < d; ++k) {
        double acc = 0;
        for (int64_t i = 0; i < h; ++i) acc += s.pre.item({b, t, i}) * x.item({b, t, i, k});
        EXPECT_NEAR(r.collapsed.item({b, t, k}), acc, 1e-13);
      }
    }
  EXPECT_LE(rel_err(ops::mhc_collapse(x, s.pre), r.collapsed), 1e-15);
}

TEST(OpsMhc, SinkhornEndsOnAColumnStep) {
  SCOPED_TRACE(seed_note());
  // Wide logits (std 4) make the softmax nearly one-hot, the hardest case for the projection.
  const int64_t h = 4, n = 50;
  const Tensor logits = random_normal({n, h, h}, 7, DType::f64, 0, 4);
  for (int64_t iters : {1, 2, 20}) {
    SCOPED_TRACE("iters " + std::to_string(iters));
    const Tensor c = ops::mhc_sinkhorn(logits, iters, 1e-6);
    const Tensor c32 = ops::mhc_sinkhorn(logits.to(DType::f32), iters, 1e-6);
    EXPECT_LE(rel_err(c32, c), 1e-5);
    for (int64_t t = 0; t < n; ++t) {
      std::vector<double> l(h * h);
      for (int64_t k = 0; k < h * h; ++k) l[k] = logits.item({t, k / h, k % h});
      const std::vector<double> expect = sinkhorn_spec(l, h, iters, 1e-6);
      for (int64_t j = 0; j < h; ++j) {
        double col = 0;
        for (int64_t i = 0; i < h; ++i) {
          EXPECT_NEAR(c.item({t, i, j}), expect[i * h + j], 1e-13);
          EXPECT_GT(c.item({t, i, j}), 0.0);
          col += c.item({t, i, j});
        }
        // Every column was divided by its sum s + eps last, so it sums to s / (s + eps) < 1. After
        // one step s can be as small as a few eps (a column the softmax nearly emptied); after
        // the full 20 the columns entering the last step already sum to ≈ 1.
        EXPECT_LT(col, 1.0);
        if (iters == 20) EXPECT_NEAR(col, 1.0, 1e-5);
      }
    }
  }
}

TEST(OpsMhc, PostMixesSourceStreamsThroughTheTransposedComb) {
  SCOPED_TRACE(seed_note());
  const int64_t n = 6, h = 3, d = 5;
  const Tensor x = random_normal({n, h, d}, 1, DType::f64);
  const Tensor y = random_normal({n, d}, 2, DType::f64);
  const Tensor post = random_normal({n, h}, 3, DType::f64, 1, 0.5);
  const Tensor comb = random_normal({n, h, h}, 4, DType::f64, 0.3, 0.2);
  const Tensor out = ops::mhc_post(x, y, post, comb);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t i = 0; i < h; ++i)
      for (int64_t k = 0; k < d; ++k) {
        double expect = post.item({t, i}) * y.item({t, k});
        for (int64_t j = 0; j < h; ++j) expect += comb.item({t, j, i}) * x.item({t, j, k});
        EXPECT_NEAR(out.item({t, i, k}), expect, 1e-13);
      }
  // f32 runs the same template.
  const Tensor out32 =
      ops::mhc_post(x.to(DType::f32), y.to(DType::f32), post.to(DType::f32), comb.to(DType::f32));
  EXPECT_LE(rel_err(out32, out), 1e-6);
}

TEST(OpsMhc, ExpandThenHeadIsTheIdentity) {
  SCOPED_TRACE(seed_note());
  const Tensor e = random_normal({9, 11}, 1, DType::f32);
  const Tensor streams = ops::mhc_expand(e, 4);
  ASSERT_EQ(streams.shape(), (Shape{9, 4, 11}));
  for (int64_t i = 0; i < 4; ++i)
    EXPECT_EQ(streams.select(1, i).contiguous().to_doubles(), e.to_doubles());
  // With four identical copies the mean is exact: (4x)/4 = x in binary floating point.
  EXPECT_EQ(ops::mhc_head(streams).to_doubles(), e.to_doubles());
  const Tensor mixed = random_normal({3, 2, 5}, 2, DType::f64);
  const Tensor mean = ops::mhc_head(mixed);
  for (int64_t t = 0; t < 3; ++t)
    for (int64_t k = 0; k < 5; ++k)
      EXPECT_NEAR(mean.item({t, k}), (mixed.item({t, 0, k}) + mixed.item({t, 1, k})) / 2, 1e-15);
}

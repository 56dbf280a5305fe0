// Backward of the mHC ops: float64 central finite differences on fresh random inputs (mhc_pre
// through all Sinkhorn iterations, the projection alone, collapse, stream update, expand, head),
// saved against recomputed intermediates, and parity with the reference's autograd (fixtures
// from tools/golden/grads_kda_mhc.py), including a whole decoder layer around the KDA mixer.

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

constexpr const char* kGolden = "grads_kda_mhc";
constexpr RelErr rel_err{.zero_reference_fails = true};

constexpr double kFdTol = 1e-6;

// Parameters far from init: logits of order one, so no sigmoid or softmax saturates and the
// Sinkhorn start is far from doubly stochastic.
HcParams random_hc(int64_t h, int64_t d, uint64_t off) {
  const int64_t m = (2 + h) * h;
  return {random_normal({m, h * d}, off + 1'000'000, DType::f64, 0, 0.4),
          random_normal({m}, off + 2'000'000, DType::f64, 0, 0.6),
          random_uniform({3}, off + 3'000'000, DType::f64, 0.5, 1.5)};
}

// a += b elementwise (same shape and dtype, a contiguous).
void add_into(Tensor& a, const Tensor& b) {
  ASSERT_EQ(a.shape(), b.shape());
  const Tensor bc = b.contiguous();
  if (a.dtype() == DType::f32) {
    for (int64_t i = 0; i < a.numel(); ++i) a.data<float>()[i] += bc.data<float>()[i];
  } else {
    for (int64_t i = 0; i < a.numel(); ++i) a.data<double>()[i] += bc.data<double>()[i];
  }
}

// One decoder layer with the FFN replaced by the identity, as the reference layer 0 of the
// fixture: hc_pre → input_layernorm → KDA → hc_post → hc_pre → post_attention_layernorm → hc_post.
struct Layer {
  HcParams attn, ffn;
  Tensor w_in, w_post;
  ops::KdaParams kda;
  ops::KdaOptions kopt;
  ops::MhcOptions hopt;
  double eps = 1e-5;
};

struct LayerGrads {
  ops::MhcGrads attn, ffn;
  Tensor w_in, w_post;
  ops::KdaGrads kda;
  Tensor d_streams;
};

Tensor layer_forward(const Layer& l, const Tensor& x, const Tensor& cu) {
  const ops::MhcPreResult pa = ops::mhc_pre(x, l.attn.fn, l.attn.base, l.attn.scale, l.hopt);
  const Tensor u = ops::rms_norm(pa.collapsed, l.w_in, l.eps);
  const Tensor x1 = ops::mhc_post(x, ops::kda_forward(l.kda, u, cu, l.kopt), pa.post, pa.comb);
  const ops::MhcPreResult pf = ops::mhc_pre(x1, l.ffn.fn, l.ffn.base, l.ffn.scale, l.hopt);
  return ops::mhc_post(x1, ops::rms_norm(pf.collapsed, l.w_post, l.eps), pf.post, pf.comb);
}

// The layer's backward composed from the op backwards, in reverse order of the forward.
LayerGrads layer_backward(const Layer& l, const Tensor& x, const Tensor& cu, const Tensor& dy) {
  LayerGrads g;
  ops::MhcPreSaved sa, sf;
  ops::KdaSaved ks;
  Tensor r1, r2;
  const ops::MhcPreResult pa = ops::mhc_pre(x, l.attn.fn, l.attn.base, l.attn.scale, l.hopt, &sa);
  const Tensor u = ops::rms_norm(pa.collapsed, l.w_in, l.eps, &r1);
  const Tensor y = ops::kda_forward(l.kda, u, cu, l.kopt, &ks);
  const Tensor x1 = ops::mhc_post(x, y, pa.post, pa.comb);
  const ops::MhcPreResult pf = ops::mhc_pre(x1, l.ffn.fn, l.ffn.base, l.ffn.scale, l.hopt, &sf);
  const Tensor z = ops::rms_norm(pf.collapsed, l.w_post, l.eps, &r2);

  const ops::MhcPostGrads g2 = ops::mhc_post_backward(x1, z, pf.post, pf.comb, dy);
  const Tensor dcf = ops::rms_norm_backward(g2.d_y, pf.collapsed, l.w_post, l.eps, r2, &g.w_post);
  // The residual path of the stream update (g2.d_streams) added by the backward itself.
  const Tensor dx1 = ops::mhc_pre_backward(x1, l.ffn.fn, l.ffn.base, l.ffn.scale, l.hopt, &sf,
                                           g2.d_post, g2.d_comb, dcf, g.ffn, g2.d_streams);
  const ops::MhcPostGrads g1 = ops::mhc_post_backward(x, y, pa.post, pa.comb, dx1);
  const Tensor du = ops::kda_backward(l.kda, u, cu, l.kopt, &ks, g1.d_y, g.kda);
  const Tensor dca = ops::rms_norm_backward(du, pa.collapsed, l.w_in, l.eps, r1, &g.w_in);
  g.d_streams = ops::mhc_pre_backward(x, l.attn.fn, l.attn.base, l.attn.scale, l.hopt, &sa,
                                      g1.d_post, g1.d_comb, dca, g.attn, g1.d_streams);
  return g;
}

}  // namespace

TEST(GradMhc, PreFiniteDifferences) {
  SCOPED_TRACE(seed_note());
  // Two leading dims; H = 4 as released, a small D.
  const int64_t h = 4, d = 5;
  ops::MhcOptions opt;
  opt.hc_mult = h;
  Tensor x = random_normal({2, 3, h, d}, 1, DType::f64, 0.2, 1.1);
  HcParams p = random_hc(h, d, 10'000'000);
  const Tensor d_post = random_normal({2, 3, h}, 2, DType::f64);
  const Tensor d_comb = random_normal({2, 3, h, h}, 3, DType::f64);
  const Tensor d_coll = random_normal({2, 3, d}, 4, DType::f64);
  auto loss = [&] {
    const ops::MhcPreResult r = ops::mhc_pre(x, p.fn, p.base, p.scale, opt);
    return dot(d_post, r.post) + dot(d_comb, r.comb) + dot(d_coll, r.collapsed);
  };
  ops::MhcGrads g;
  const Tensor dx =
      ops::mhc_pre_backward(x, p.fn, p.base, p.scale, opt, nullptr, d_post, d_comb, d_coll, g);
  EXPECT_LE(fd_check(x, dx, loss), kFdTol);
  EXPECT_LE(fd_check(p.fn, g.fn, loss), kFdTol);
  EXPECT_LE(fd_check(p.base, g.base, loss), kFdTol);
  EXPECT_LE(fd_check(p.scale, g.scale, loss), kFdTol);
}

TEST(GradMhc, PreBackwardIsLinearInEachUpstreamGradient) {
  SCOPED_TRACE(seed_note());
  // Undefined upstream gradients count as zero: the three single-output backwards add up to the
  // full one.
  const int64_t h = 4, d = 6, n = 7;
  ops::MhcOptions opt;
  const Tensor x = random_normal({n, h, d}, 1, DType::f64);
  const HcParams p = random_hc(h, d, 10'000'000);
  const Tensor dp = random_normal({n, h}, 2, DType::f64),
               dc = random_normal({n, h, h}, 3, DType::f64),
               dl = random_normal({n, d}, 4, DType::f64);
  ops::MhcGrads all, parts;
  const Tensor dx = ops::mhc_pre_backward(x, p.fn, p.base, p.scale, opt, nullptr, dp, dc, dl, all);
  std::vector<double> sum(size_t(dx.numel()), 0.0);
  for (int which = 0; which < 3; ++which) {
    const Tensor part =
        ops::mhc_pre_backward(x, p.fn, p.base, p.scale, opt, nullptr, which == 0 ? dp : Tensor(),
                              which == 1 ? dc : Tensor(), which == 2 ? dl : Tensor(), parts);
    const std::vector<double> v = part.to_doubles();
    for (size_t i = 0; i < v.size(); ++i) sum[i] += v[i];
  }
  EXPECT_LE(rel_err(Tensor::from_vector(sum, dx.shape()), dx), 1e-12);
  EXPECT_LE(rel_err(parts.fn, all.fn), 1e-12);
  EXPECT_LE(rel_err(parts.base, all.base), 1e-12);
  EXPECT_LE(rel_err(parts.scale, all.scale), 1e-12);
}

TEST(GradMhc, PreBackwardAddsTheResidualGradientExactly) {
  SCOPED_TRACE(seed_note());
  // The residual is added after the rest of d streams is complete: the same bits as adding it
  // afterwards, in f32 (the CPU training dtype) and f64; parameter gradients do not see it.
  const int64_t h = 4, d = 6, n = 5;
  ops::MhcOptions opt;
  for (const DType dt : {DType::f32, DType::f64}) {
    const Tensor x = random_normal({n, h, d}, 1, dt);
    const HcParams p64 = random_hc(h, d, 10'000'000);
    const HcParams p{p64.fn.to(dt), p64.base.to(dt), p64.scale.to(dt)};
    const Tensor dp = random_normal({n, h}, 2, dt), dc = random_normal({n, h, h}, 3, dt),
                 dl = random_normal({n, d}, 4, dt), res = random_normal({n, h, d}, 5, dt);
    ops::MhcGrads plain, with;
    Tensor expected =
        ops::mhc_pre_backward(x, p.fn, p.base, p.scale, opt, nullptr, dp, dc, dl, plain);
    add_into(expected, res);
    const Tensor got =
        ops::mhc_pre_backward(x, p.fn, p.base, p.scale, opt, nullptr, dp, dc, dl, with, res);
    EXPECT_EQ(got.to_doubles(), expected.to_doubles()) << dtype_name(dt);
    EXPECT_EQ(with.fn.to_doubles(), plain.fn.to_doubles()) << dtype_name(dt);
    EXPECT_EQ(with.base.to_doubles(), plain.base.to_doubles()) << dtype_name(dt);
  }
  ops::MhcGrads g;
  const Tensor x = random_normal({n, h, d}, 1, DType::f64);
  const HcParams p = random_hc(h, d, 10'000'000);
  EXPECT_THROW(ops::mhc_pre_backward(x, p.fn, p.base, p.scale, opt, nullptr, Tensor(), Tensor(),
                                     Tensor(), g, random_normal({n, h, d + 1}, 6, DType::f64)),
               InternalError);
}

TEST(GradMhc, SinkhornFiniteDifferences) {
  SCOPED_TRACE(seed_note());
  for (int64_t h : {4, 3}) {
    for (int64_t iters : {1, 2, 20}) {
      SCOPED_TRACE(fmt::format("H={} iters={}", h, iters));
      // Logits of std 2: rows far from uniform, so every step changes the matrix.
      Tensor logits = random_normal({5, h, h}, uint64_t(100 * h + iters), DType::f64, 0, 2);
      const Tensor dout = random_normal({5, h, h}, uint64_t(100 * h + iters + 50), DType::f64);
      auto loss = [&] { return dot(dout, ops::mhc_sinkhorn(logits, iters, 1e-6)); };
      const Tensor dl = ops::mhc_sinkhorn_backward(logits, iters, 1e-6, dout);
      EXPECT_LE(fd_check(logits, dl, loss), kFdTol);
    }
  }
}

TEST(GradMhc, CollapsePostExpandHeadFiniteDifferences) {
  SCOPED_TRACE(seed_note());
  const int64_t n = 4, h = 3, d = 5;
  Tensor x = random_normal({n, h, d}, 1, DType::f64);
  Tensor pre = random_uniform({n, h}, 2, DType::f64, 0.1, 1.0);
  Tensor y = random_normal({n, d}, 3, DType::f64);
  Tensor post = random_uniform({n, h}, 4, DType::f64, 0.1, 1.9);
  Tensor comb = random_uniform({n, h, h}, 5, DType::f64, 0.0, 0.7);
  {
    SCOPED_TRACE("collapse");
    const Tensor dout = random_normal({n, d}, 6, DType::f64);
    auto loss = [&] { return dot(dout, ops::mhc_collapse(x, pre)); };
    const ops::MhcCollapseGrads g = ops::mhc_collapse_backward(x, pre, dout);
    EXPECT_LE(fd_check(x, g.d_streams, loss), kFdTol);
    EXPECT_LE(fd_check(pre, g.d_pre, loss), kFdTol);
  }
  {
    SCOPED_TRACE("post");
    const Tensor dout = random_normal({n, h, d}, 7, DType::f64);
    auto loss = [&] { return dot(dout, ops::mhc_post(x, y, post, comb)); };
    const ops::MhcPostGrads g = ops::mhc_post_backward(x, y, post, comb, dout);
    EXPECT_LE(fd_check(x, g.d_streams, loss), kFdTol);
    EXPECT_LE(fd_check(y, g.d_y, loss), kFdTol);
    EXPECT_LE(fd_check(post, g.d_post, loss), kFdTol);
    EXPECT_LE(fd_check(comb, g.d_comb, loss), kFdTol);
  }
  {
    SCOPED_TRACE("expand");
    const Tensor dout = random_normal({n, h, d}, 8, DType::f64);
    auto loss = [&] { return dot(dout, ops::mhc_expand(y, h)); };
    EXPECT_LE(fd_check(y, ops::mhc_expand_backward(dout), loss), kFdTol);
  }
  {
    SCOPED_TRACE("head");
    const Tensor dout = random_normal({n, d}, 9, DType::f64);
    auto loss = [&] { return dot(dout, ops::mhc_head(x)); };
    EXPECT_LE(fd_check(x, ops::mhc_head_backward(dout, h), loss), kFdTol);
  }
}

TEST(GradMhc, SavedIntermediatesGiveBitIdenticalGradients) {
  SCOPED_TRACE(seed_note());
  for (DType dt : {DType::f64, DType::f32}) {
    SCOPED_TRACE(std::string(dtype_name(dt)));
    const int64_t h = 4, d = 16, n = 300;  // enough tokens for the threaded paths
    ops::MhcOptions opt;
    const Tensor x = random_normal({n, h, d}, 1, dt);
    const HcParams p64 = random_hc(h, d, 10'000'000);
    const HcParams p{p64.fn.to(dt), p64.base.to(dt), p64.scale.to(dt)};
    const Tensor dp = random_normal({n, h}, 2, dt), dc = random_normal({n, h, h}, 3, dt),
                 dl = random_normal({n, d}, 4, dt);
    ops::MhcPreSaved s;
    ops::mhc_pre(x, p.fn, p.base, p.scale, opt, &s);
    ops::MhcGrads a, b;
    const Tensor dx_saved = ops::mhc_pre_backward(x, p.fn, p.base, p.scale, opt, &s, dp, dc, dl, a);
    const Tensor dx_fresh =
        ops::mhc_pre_backward(x, p.fn, p.base, p.scale, opt, nullptr, dp, dc, dl, b);
    EXPECT_EQ(dx_saved.to_doubles(), dx_fresh.to_doubles());
    EXPECT_EQ(a.fn.to_doubles(), b.fn.to_doubles());
    EXPECT_EQ(a.base.to_doubles(), b.base.to_doubles());
    EXPECT_EQ(a.scale.to_doubles(), b.scale.to_doubles());
  }
}

TEST(GradMhc, PrePostAndHeadMatchReferenceAutograd) {
  const io::SafetensorsFile f = open_golden(kGolden);
  for (DType dt : {DType::f32, DType::f64}) {
    SCOPED_TRACE(std::string(dtype_name(dt)));
    auto in = [&](const char* name) { return f.tensor(name).to(dt); };
    const Tensor x = in("mhc.streams");
    ops::MhcOptions opt;
    opt.hc_mult = x.size(1);
    // The fixture ran each document alone; mHC is per token, so the pack runs at once.
    ops::MhcGrads g;
    const Tensor dx =
        ops::mhc_pre_backward(x, in("mhc.fn"), in("mhc.base"), in("mhc.scale"), opt, nullptr,
                              in("mhc.d_post"), in("mhc.d_comb"), in("mhc.d_collapsed"), g);
    EXPECT_LE(rel_err(dx, f.tensor("mhc.d_streams")), 1e-4);
    EXPECT_LE(rel_err(g.fn, f.tensor("mhc.d_fn")), 1e-4);
    EXPECT_LE(rel_err(g.base, f.tensor("mhc.d_base")), 1e-4);
    EXPECT_LE(rel_err(g.scale, f.tensor("mhc.d_scale")), 1e-4);

    const ops::MhcPostGrads pg = ops::mhc_post_backward(x, in("post_in.y"), in("post_in.post"),
                                                        in("post_in.comb"), in("post_in.dy_out"));
    EXPECT_LE(rel_err(pg.d_streams, f.tensor("post_in.d_streams")), 1e-4);
    EXPECT_LE(rel_err(pg.d_y, f.tensor("post_in.d_y")), 1e-4);
    EXPECT_LE(rel_err(pg.d_post, f.tensor("post_in.d_post")), 1e-4);
    EXPECT_LE(rel_err(pg.d_comb, f.tensor("post_in.d_comb")), 1e-4);
    EXPECT_LE(
        rel_err(ops::mhc_head_backward(in("head.dy"), opt.hc_mult), f.tensor("head.d_streams")),
        1e-6);
  }
}

TEST(GradMhc, DecoderLayerAroundKdaMatchesReferenceAutograd) {
  const io::SafetensorsFile f = open_golden(kGolden);
  for (DType dt : {DType::f32, DType::f64}) {
    SCOPED_TRACE(std::string(dtype_name(dt)));
    auto in = [&](const std::string& name) { return f.tensor(name).to(dt); };
    Layer l;
    l.attn = {in("layer.attn_hc.fn"), in("layer.attn_hc.base"), in("layer.attn_hc.scale")};
    l.ffn = {in("layer.ffn_hc.fn"), in("layer.ffn_hc.base"), in("layer.ffn_hc.scale")};
    l.w_in = in("layer.input_layernorm");
    l.w_post = in("layer.post_attention_layernorm");
    l.kda = to_dtype(golden_kda_params(f, "kda.param."), dt);
    l.kopt.num_heads = l.kda.A_log.size(0);
    l.kopt.head_dim = l.kda.o_norm.size(0);
    const Tensor x = in("layer.streams");
    l.hopt.hc_mult = x.size(1);
    LayerGrads g = layer_backward(l, x, f.tensor("layer.cu_seqlens"), in("layer.dy"));
    EXPECT_LE(rel_err(g.d_streams, f.tensor("layer.d_streams")), 1e-4);
    for (const char* site : {"attn_hc", "ffn_hc"}) {
      SCOPED_TRACE(site);
      const ops::MhcGrads& mg = std::string(site) == "attn_hc" ? g.attn : g.ffn;
      EXPECT_LE(rel_err(mg.fn, f.tensor(fmt::format("layer.grad.{}.fn", site))), 1e-4);
      EXPECT_LE(rel_err(mg.base, f.tensor(fmt::format("layer.grad.{}.base", site))), 1e-4);
      EXPECT_LE(rel_err(mg.scale, f.tensor(fmt::format("layer.grad.{}.scale", site))), 1e-4);
    }
    EXPECT_LE(rel_err(g.w_in, f.tensor("layer.grad.input_layernorm")), 1e-4);
    EXPECT_LE(rel_err(g.w_post, f.tensor("layer.grad.post_attention_layernorm")), 1e-4);
    for (const KdaField& k : kda_fields(g.kda)) {
      SCOPED_TRACE(k.name);
      EXPECT_LE(rel_err(*k.a, f.tensor("layer.grad.self_attn." + k.name)), 1e-4);
    }
  }
}

TEST(GradMhc, DecoderLayerFiniteDifferences) {
  SCOPED_TRACE(seed_note());
  // The composed layer on a pack whose documents cross chunk boundaries: one directional check
  // per parameter and per selected token row of the input streams.
  const std::vector<int64_t> docs{1, 63, 64, 65, 130};
  const Tensor cu = cu_seqlens(docs);
  const int64_t h = 4, d = 8, nl = 2, hl = 4, t = 323, ql = nl * hl;
  Layer l;
  l.attn = random_hc(h, d, 10'000'000);
  l.ffn = random_hc(h, d, 20'000'000);
  l.w_in = random_normal({d}, 30'000'000, DType::f64, 1.0, 0.3);
  l.w_post = random_normal({d}, 30'000'100, DType::f64, 1.0, 0.3);
  const double sd = 1.0 / std::sqrt(double(d)), sh = 1.0 / std::sqrt(double(hl));
  uint64_t off = 40'000'000;
  auto next = [&](const Shape& s, double mean, double std) {
    return random_normal(s, off += 1'000'000, DType::f64, mean, std);
  };
  using ops::Linear;
  l.kda = {Linear(next({ql, d}, 0, sd)),
           Linear(next({ql, d}, 0, sd)),
           Linear(next({ql, d}, 0, sd)),
           next({3 * ql, 1, 4}, 0, 0.6),
           Linear(next({hl, d}, 0, sd)),
           Linear(next({ql, hl}, 0, sh)),
           next({ql}, -2.5, 1.0),
           random_uniform({nl}, off += 1'000'000, DType::f64, -1.5, 1.0),
           Linear(next({nl, d}, 0, sd)),
           Linear(next({hl, d}, 0, sd)),
           Linear(next({ql, hl}, 0, sh)),
           next({hl}, 1.0, 0.4),
           Linear(next({d, ql}, 0, 1.0 / std::sqrt(double(ql))))};
  l.kopt.num_heads = nl;
  l.kopt.head_dim = hl;
  l.hopt.hc_mult = h;
  Tensor x = random_normal({t, h, d}, 1, DType::f64);
  const Tensor dy = random_normal({t, h, d}, 2, DType::f64);
  auto loss = [&] { return dot(dy, layer_forward(l, x, cu)); };
  LayerGrads g = layer_backward(l, x, cu, dy);

  uint64_t dir_off = 90'000'000;
  // Small steps: the fourth-order difference's own truncation error falls 16x per halving of the
  // step, and some draws need it. At 1e-4 it reached 1.9e-6 on the projections and 3.0e-6 on a
  // single token row; at 2.5e-5, 5.6e-6 on conv1d (whose q/k channels feed an L2 norm). Measured
  // roundoff stays below 3e-9 down to 3.1e-6 (whole tensors) and 1e-9 at 1.25e-5 (one row).
  auto check = [&](const char* name, Tensor& param, const Tensor& grad) {
    SCOPED_TRACE(name);
    EXPECT_LE(
        fd_direction(param, grad, random_normal(param.shape(), dir_off += 1'000'000, DType::f64),
                     loss, 6.25e-6),
        kFdTol);
  };
  check("attn.fn", l.attn.fn, g.attn.fn);
  check("attn.base", l.attn.base, g.attn.base);
  check("attn.scale", l.attn.scale, g.attn.scale);
  check("ffn.fn", l.ffn.fn, g.ffn.fn);
  check("ffn.base", l.ffn.base, g.ffn.base);
  check("ffn.scale", l.ffn.scale, g.ffn.scale);
  check("input_layernorm", l.w_in, g.w_in);
  check("post_attention_layernorm", l.w_post, g.w_post);
  check("q_proj", l.kda.q_proj.weight, g.kda.q_proj.weight);
  check("conv1d", l.kda.conv1d, g.kda.conv1d);
  check("A_log", l.kda.A_log, g.kda.A_log);
  check("dt_bias", l.kda.dt_bias, g.kda.dt_bias);
  check("o_proj", l.kda.o_proj.weight, g.kda.o_proj.weight);
  check("streams", x, g.d_streams);
  // Single token rows around the document and chunk boundaries (the state and the conv cross
  // tokens only inside a document).
  for (int64_t row : {0, 1, 63, 64, 65, 127, 128, 129, 193, 322}) {
    SCOPED_TRACE("streams row " + std::to_string(row));
    EXPECT_LE(fd_direction(x, g.d_streams, row_direction({t, h, d}, row, dir_off += 1'000), loss,
                           1.25e-5),
              kFdTol);
  }
}

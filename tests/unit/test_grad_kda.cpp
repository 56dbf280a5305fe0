// Backward of the KDA mixer: float64 central finite differences on fresh random packed inputs
// whose documents (1, 63, 64, 65, 130 tokens) cross chunk and document boundaries — the conv +
// SiLU, the forget gate in both forms, the chunked delta rule and the whole mixer — plus saved
// against recomputed intermediates (bit-identical), chunk-size independence, accumulation, and
// parity with the reference's autograd (fixtures from tools/golden/grads_kda_mhc.py).

#include <gtest/gtest.h>

#include <cmath>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "glmtune/ops/kda.h"
#include "glmtune/ops/norm.h"
#include "support/kda_mhc.h"
#include "support/test_support.h"

using namespace glmtune;
using namespace glmtune::test;

namespace {

constexpr const char* kGolden = "grads_kda_mhc";
constexpr RelErr rel_err{.zero_reference_fails = true};

constexpr double kFdTol = 1e-6;

// Odd lengths around the chunk size: a single token, one short of a chunk, exactly one, one
// over, and two chunks plus two.
const std::vector<int64_t> kDocs{1, 63, 64, 65, 130};
// Rows next to every document and chunk boundary of kDocs (documents start at 0, 1, 64, 128,
// 193; chunks inside the last document start at 193 and 257).
const std::vector<int64_t> kBoundaryRows{0,   1,   2,   63,  64,  65,  127, 128,
                                         129, 192, 193, 194, 256, 257, 322};

bool is_doc_start(int64_t row) {
  int64_t start = 0;
  for (int64_t n : kDocs) {
    if (row == start) return true;
    start += n;
  }
  return false;
}

}  // namespace

TEST(GradKda, ConvFiniteDifferences) {
  SCOPED_TRACE(seed_note());
  // Documents shorter than, equal to and longer than the kernel: every tap meets the boundary.
  const std::vector<int64_t> docs{1, 2, 5, 3, 4};
  const Tensor cu = cu_seqlens(docs);
  const int64_t t = total_tokens(docs), c = 5, kc = 4;
  Tensor x = random_normal({t, c}, 1, DType::f64);
  Tensor w = random_normal({c, 1, kc}, 2, DType::f64, 0, 0.6);
  const Tensor dy = random_normal({t, c}, 3, DType::f64);
  for (bool silu : {true, false}) {
    SCOPED_TRACE(silu ? "silu" : "linear");
    auto loss = [&] { return dot(dy, ops::causal_conv1d(x, w, cu, silu)); };
    Tensor gw;
    const Tensor dx = ops::causal_conv1d_backward(x, w, cu, silu, dy, &gw);
    ASSERT_EQ(gw.shape(), w.shape());
    EXPECT_LE(fd_check(x, dx, loss), kFdTol);
    EXPECT_LE(fd_check(w, gw, loss), kFdTol);
  }
  // The forward's saved pre-activation gives the same gradients as recomputing it.
  Tensor pre, gw1, gw2;
  ops::causal_conv1d(x, w, cu, true, &pre);
  EXPECT_EQ(ops::causal_conv1d_backward(x, w, cu, true, dy, &gw1, pre).to_doubles(),
            ops::causal_conv1d_backward(x, w, cu, true, dy, &gw2).to_doubles());
  EXPECT_EQ(gw1.to_doubles(), gw2.to_doubles());
}

// The q/k conv (conv, SiLU, per-head L2 norm) against finite differences of its own forward,
// over documents shorter and longer than the taps and heads of 3 channels; its backward from the
// forward's ν equals the conv's backward of the norm's backward, bit for bit.
TEST(GradKda, QkConvFiniteDifferences) {
  SCOPED_TRACE(seed_note());
  const std::vector<int64_t> docs{1, 2, 5, 3, 4};
  const Tensor cu = cu_seqlens(docs);
  const int64_t t = total_tokens(docs), heads = 2, hd = 3, c = heads * hd, kc = 4;
  Tensor x = random_normal({t, c}, 11, DType::f64);
  Tensor w = random_normal({c, 1, kc}, 12, DType::f64, 0, 0.6);
  const Tensor dy = random_normal({t, heads, hd}, 13, DType::f64);
  Tensor norm, gw;
  const Tensor y = ops::kda_qk_conv(x, w, cu, hd, 1e-6, &norm);
  ASSERT_EQ(y.shape(), (Shape{t, heads, hd}));
  ASSERT_EQ(norm.shape(), (Shape{t, heads}));
  auto loss = [&] { return dot(dy, ops::kda_qk_conv(x, w, cu, hd, 1e-6)); };
  const Tensor dx = ops::kda_qk_conv_backward(x, w, cu, hd, 1e-6, norm, dy, &gw);
  ASSERT_EQ(gw.shape(), w.shape());
  EXPECT_LE(fd_check(x, dx, loss), kFdTol);
  EXPECT_LE(fd_check(w, gw, loss), kFdTol);

  const Tensor conv = ops::causal_conv1d(x, w, cu, true).view({t, heads, hd});
  Tensor gw2;
  const Tensor dc = ops::l2_norm_backward(dy, conv, 1e-6, norm);
  EXPECT_EQ(dx.to_doubles(),
            ops::causal_conv1d_backward(x, w, cu, true, dc.view({t, c}), &gw2).to_doubles());
  EXPECT_EQ(gw.to_doubles(), gw2.to_doubles());
}

// Each conv weight's gradient sums over every token of every document. With positive terms an
// f32 running sum over 2^20 tokens is off by ~sqrt(n) ulps (~300 here); summed in double, the
// only errors are the f32 product of each term (<= u each) and the final rounding (<= u), so
// |error| <= 2u · Σ terms (+ n·2^-53, negligible), whatever the threads.
TEST(GradKda, ConvWeightGradientOfLongSequencesIsRoundedOnce) {
  SCOPED_TRACE(seed_note());
  const std::vector<int64_t> docs{(int64_t(1) << 19) + 3, (int64_t(1) << 19) - 3};
  const Tensor cu = cu_seqlens(docs);
  const int64_t t = total_tokens(docs), c = 2, kc = 4;
  const Tensor x = random_uniform({t, c}, 1, DType::f32, 0.5, 1.5);
  const Tensor w = random_normal({c, 1, kc}, 2, DType::f32);
  const Tensor dy = random_uniform({t, c}, 3, DType::f32, 0.5, 1.5);
  Tensor gw;
  ops::causal_conv1d_backward(x, w, cu, false, dy, &gw);
  const float* xp = x.data<float>();
  const float* gp = dy.data<float>();
  const double u = std::ldexp(1.0, -24);
  for (int64_t ch = 0; ch < c; ++ch)
    for (int64_t tau = 0; tau < kc; ++tau) {
      double want = 0;
      int64_t start = 0;
      for (int64_t n : docs) {
        for (int64_t s = start; s < start + n; ++s) {
          const int64_t src = s - (kc - 1) + tau;
          if (src >= start) want += double(gp[s * c + ch]) * double(xp[src * c + ch]);
        }
        start += n;
      }
      EXPECT_LE(std::abs(gw.item({ch, 0, tau}) - want), 2.01 * u * want)
          << "channel " << ch << " tap " << tau;
    }
}

TEST(GradKda, GateFiniteDifferences) {
  SCOPED_TRACE(seed_note());
  const int64_t t = 6, nl = 3, hl = 4, ql = nl * hl;
  Tensor graw = random_normal({t, ql}, 1, DType::f64, 0, 1.5);
  Tensor a_log = random_uniform({nl}, 2, DType::f64, -1.5, 1.0);
  const Tensor dg = random_normal({t, nl, hl}, 3, DType::f64);
  for (std::optional<double> lb : {std::optional<double>(-5.0), std::optional<double>()}) {
    SCOPED_TRACE(lb ? "lower bound" : "softplus");
    Tensor dt_bias = random_normal({ql}, 4, DType::f64, lb ? -2.5 : -1.0, 1.0);
    if (!lb) {
      // Channels far past softplus' threshold (z > 20 takes the identity branch).
      for (int64_t ch = 0; ch < ql; ch += 5) dt_bias.set_item({ch}, 24.0);
    }
    auto loss = [&] { return dot(dg, ops::kda_gate(graw, dt_bias, a_log, lb)); };
    Tensor gdt, ga;
    const Tensor dz = ops::kda_gate_backward(graw, dt_bias, a_log, lb, dg, &gdt, &ga);
    EXPECT_LE(fd_check(graw, dz, loss), kFdTol);
    EXPECT_LE(fd_check(dt_bias, gdt, loss), kFdTol);
    EXPECT_LE(fd_check(a_log, ga, loss), kFdTol);
  }
}

TEST(GradKda, CoreFiniteDifferences) {
  SCOPED_TRACE(seed_note());
  const Tensor cu = cu_seqlens(kDocs);
  const int64_t t = total_tokens(kDocs), nh = 2, kd = 8, vd = 6;  // K ≠ V
  KdaCoreInputs c = random_kda_core(t, nh, kd, vd, DType::f64, 0);
  const double scale = 1.0 / std::sqrt(double(kd));
  const Tensor dout = random_normal({t, nh, vd}, 50'000'000, DType::f64);
  auto loss = [&] { return dot(dout, ops::kda_chunked(c.q, c.k, c.v, c.g, c.beta, cu, scale)); };
  const ops::KdaCoreGrads g =
      ops::kda_chunked_backward(c.q, c.k, c.v, c.g, c.beta, cu, scale, dout);
  uint64_t off = 60'000'000;
  const std::vector<std::tuple<const char*, Tensor*, const Tensor*>> inputs = {
      {"q", &c.q, &g.dq},
      {"k", &c.k, &g.dk},
      {"v", &c.v, &g.dv},
      {"g", &c.g, &g.dg},
      {"beta", &c.beta, &g.dbeta}};
  for (const auto& [name, in, grad] : inputs) {
    SCOPED_TRACE(name);
    EXPECT_LE(
        fd_direction(*in, *grad, random_normal(in->shape(), off += 1'000'000, DType::f64), loss),
        kFdTol);
    for (int64_t row : kBoundaryRows) {
      SCOPED_TRACE("row " + std::to_string(row));
      const Tensor dir = row_direction(in->shape(), row, off += 1'000);
      if (std::string(name) == "g" && is_doc_start(row)) {
        // The decay of a document's first step multiplies the zero initial state and cancels in
        // every in-chunk difference Γ_i − Γ_j: its gradient is exactly zero. The analytic value
        // must be rounding noise and the difference quotient agree on the tensor's scale.
        EXPECT_LE(max_abs(grad->select(0, row).contiguous()), 1e-12 * max_abs(*grad));
        EXPECT_LE(fd_direction(*in, *grad, dir, loss, 1e-4, max_abs(*grad)), kFdTol);
      } else {
        EXPECT_LE(fd_direction(*in, *grad, dir, loss), kFdTol);
      }
    }
  }
}

TEST(GradKda, CoreBackwardDoesNotDependOnTheChunkSize) {
  SCOPED_TRACE(seed_note());
  // Chunked forms of every size compute one function, so their gradients agree to rounding; this
  // pins the cross-chunk state gradient with many more chunk boundaries than 64 gives.
  const Tensor cu = cu_seqlens(kDocs);
  const int64_t t = total_tokens(kDocs), nh = 2, kd = 6, vd = 7;
  const KdaCoreInputs c = random_kda_core(t, nh, kd, vd, DType::f64, 0);
  const double scale = 1.0 / std::sqrt(double(kd));
  const Tensor dout = random_normal({t, nh, vd}, 50'000'000, DType::f64);
  const ops::KdaCoreGrads ref =
      ops::kda_chunked_backward(c.q, c.k, c.v, c.g, c.beta, cu, scale, dout, 64);
  for (int64_t chunk : {1, 7, 16, 200}) {
    SCOPED_TRACE("chunk " + std::to_string(chunk));
    const ops::KdaCoreGrads g =
        ops::kda_chunked_backward(c.q, c.k, c.v, c.g, c.beta, cu, scale, dout, chunk);
    EXPECT_LE(rel_err(g.dq, ref.dq), 1e-11);
    EXPECT_LE(rel_err(g.dk, ref.dk), 1e-11);
    EXPECT_LE(rel_err(g.dv, ref.dv), 1e-11);
    EXPECT_LE(rel_err(g.dg, ref.dg), 1e-11);
    EXPECT_LE(rel_err(g.dbeta, ref.dbeta), 1e-11);
  }
}

TEST(GradKda, MixerFiniteDifferences) {
  SCOPED_TRACE(seed_note());
  const Tensor cu = cu_seqlens(kDocs);
  const int64_t t = total_tokens(kDocs), d = 12, nl = 2, hl = 8;
  for (bool softplus : {false, true}) {
    SCOPED_TRACE(softplus ? "softplus gate" : "lower-bound gate");
    ops::KdaParams p = random_kda_params(d, nl, hl, 4, DType::f64, softplus ? 100'000'000 : 0);
    ops::KdaOptions opt;
    opt.num_heads = nl;
    opt.head_dim = hl;
    if (softplus) {
      opt.lower_bound = std::nullopt;
      // Rates around 1 and a few channels on softplus' identity branch (z > 20).
      p.A_log = random_uniform({nl}, 200'000'000, DType::f64, -2.0, 0.5);
      for (int64_t ch = 0; ch < nl * hl; ch += 7) p.dt_bias.set_item({ch}, 24.0);
    }
    Tensor x = random_normal({t, d}, 300'000'000, DType::f64);
    const Tensor dy = random_normal({t, d}, 400'000'000, DType::f64);
    auto loss = [&] { return dot(dy, ops::kda_forward(p, x, cu, opt)); };
    ops::KdaGrads g;
    const Tensor dx = ops::kda_backward(p, x, cu, opt, nullptr, dy, g);
    uint64_t off = 500'000'000;
    for (const KdaField& k : kda_fields(p, g)) {
      SCOPED_TRACE(k.name);
      Tensor& param = *k.a;
      const Tensor& grad = *k.b;
      ASSERT_EQ(grad.shape(), param.shape());
      // A step of 6.25e-6: q and k pass through an L2 norm whose curvature grows near a small
      // row, and at the default 1e-4 the difference's truncation error reached 1.8e-5 for some
      // draws (falling 16x per halving: 2.7e-10 at this step; roundoff stays near 2e-9).
      EXPECT_LE(
          fd_direction(param, grad, random_normal(param.shape(), off += 1'000'000, DType::f64),
                       loss, 6.25e-6),
          kFdTol);
    }
    // The per-head and per-channel parameters element by element.
    EXPECT_LE(fd_check(p.A_log, g.A_log, loss), kFdTol);
    EXPECT_LE(fd_check(p.o_norm, g.o_norm, loss), kFdTol);
    EXPECT_LE(fd_direction(x, dx, random_normal(x.shape(), off += 1'000'000, DType::f64), loss),
              kFdTol);
    for (int64_t row : kBoundaryRows) {
      SCOPED_TRACE("x row " + std::to_string(row));
      EXPECT_LE(fd_direction(x, dx, row_direction(x.shape(), row, off += 1'000), loss), kFdTol);
    }
  }
}

TEST(GradKda, RecomputedIntermediatesGiveBitIdenticalGradients) {
  SCOPED_TRACE(seed_note());
  const Tensor cu = cu_seqlens(kDocs);
  const int64_t t = total_tokens(kDocs), d = 16, nl = 2, hl = 8;
  for (DType dt : {DType::f32, DType::f64}) {
    SCOPED_TRACE(std::string(dtype_name(dt)));
    ops::KdaParams p = random_kda_params(d, nl, hl, 4, dt, 0);
    ops::KdaOptions opt;
    opt.num_heads = nl;
    opt.head_dim = hl;
    const Tensor x = random_normal({t, d}, 300'000'000, dt);
    const Tensor dy = random_normal({t, d}, 400'000'000, dt);
    ops::KdaSaved s;
    ops::kda_forward(p, x, cu, opt, &s);
    ops::KdaGrads saved_g, fresh_g;
    const Tensor dx_saved = ops::kda_backward(p, x, cu, opt, &s, dy, saved_g);
    const Tensor dx_fresh = ops::kda_backward(p, x, cu, opt, nullptr, dy, fresh_g);
    EXPECT_EQ(dx_saved.to_doubles(), dx_fresh.to_doubles());
    for (const KdaField& k : kda_fields(saved_g, fresh_g)) {
      SCOPED_TRACE(k.name);
      EXPECT_EQ(k.a->to_doubles(), k.b->to_doubles());
    }
  }
}

TEST(GradKda, ParameterGradientsAccumulateAcrossCalls) {
  SCOPED_TRACE(seed_note());
  // Two micro-batches into one gradient struct give the sum of their separate gradients.
  const std::vector<int64_t> docs_a{5, 70}, docs_b{64, 3};
  const int64_t d = 8, nl = 2, hl = 4;
  ops::KdaParams p = random_kda_params(d, nl, hl, 4, DType::f64, 0);
  ops::KdaOptions opt;
  opt.num_heads = nl;
  opt.head_dim = hl;
  const Tensor xa = random_normal({total_tokens(docs_a), d}, 1, DType::f64);
  const Tensor xb = random_normal({total_tokens(docs_b), d}, 2, DType::f64);
  const Tensor dya = random_normal({total_tokens(docs_a), d}, 3, DType::f64);
  const Tensor dyb = random_normal({total_tokens(docs_b), d}, 4, DType::f64);
  ops::KdaGrads both, only_a, only_b;
  ops::kda_backward(p, xa, cu_seqlens(docs_a), opt, nullptr, dya, both);
  ops::kda_backward(p, xb, cu_seqlens(docs_b), opt, nullptr, dyb, both);
  ops::kda_backward(p, xa, cu_seqlens(docs_a), opt, nullptr, dya, only_a);
  ops::kda_backward(p, xb, cu_seqlens(docs_b), opt, nullptr, dyb, only_b);
  const std::vector<KdaField> sums = kda_fields(both);
  size_t i = 0;
  for (const KdaField& k : kda_fields(only_a, only_b)) {
    SCOPED_TRACE(k.name);
    const std::vector<double> va = k.a->to_doubles(), vb = k.b->to_doubles();
    std::vector<double> sum(va.size());
    for (size_t j = 0; j < va.size(); ++j) sum[j] = va[j] + vb[j];
    const Tensor& total = *sums[i++].a;
    EXPECT_LE(rel_err(total, Tensor::from_vector(sum, total.shape())), 1e-13);
  }
}

TEST(GradKda, MixerMatchesReferenceAutograd) {
  const io::SafetensorsFile f = open_golden(kGolden);
  for (bool softplus : {false, true}) {
    for (DType dt : {DType::f32, DType::f64}) {
      SCOPED_TRACE(fmt::format("{} {}", softplus ? "softplus" : "lower bound", dtype_name(dt)));
      const std::string pre = softplus ? "kda_softplus." : "kda.";
      ops::KdaParams p;
      for (const KdaField& k : kda_fields(p)) {
        const std::string own = pre + "param." + k.name;
        // The softplus variant stores only the gate parameters it changes.
        *k.a = f.tensor(f.contains(own) ? own : std::string("kda.param.") + k.name).to(dt);
      }
      ops::KdaOptions opt;
      opt.num_heads = p.A_log.size(0);
      opt.head_dim = p.o_norm.size(0);
      if (softplus) opt.lower_bound = std::nullopt;
      const Tensor x = f.tensor("kda.x").to(dt);
      ops::KdaGrads g;
      const Tensor dx = ops::kda_backward(p, x, f.tensor("kda.cu_seqlens"), opt, nullptr,
                                          f.tensor(pre + "dy").to(dt), g);
      EXPECT_LE(rel_err(dx, f.tensor(pre + "dx")), 1e-4);
      for (const KdaField& k : kda_fields(g)) {
        SCOPED_TRACE(k.name);
        EXPECT_LE(rel_err(*k.a, f.tensor(pre + "grad." + k.name)), 1e-4);
      }
    }
  }
}

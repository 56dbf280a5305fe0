// KDA mixer: parity with the transformers reference (fixtures from tools/golden/ops_kda_mhc.py),
// the chunked delta rule against the token-by-token recurrence, and packed-document independence.

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "glmtune/base/error.h"
#include "glmtune/ops/kda.h"
#include "glmtune/ops/norm.h"
#include "support/kda_mhc.h"
#include "support/test_support.h"

using namespace glmtune;
using namespace glmtune::test;

namespace {

constexpr const char* kGolden = "kda_mhc";
constexpr RelErr rel_err{.zero_reference_fails = true};

// Sub-range [start, end) of the token axis as its own tensor.
Tensor rows(const Tensor& t, int64_t start, int64_t end) {
  return t.slice(0, start, end).contiguous();
}

}  // namespace

TEST(OpsKda, MixerMatchesReference) {
  const io::SafetensorsFile f = open_golden(kGolden);
  const ops::KdaParams params = golden_kda_params(f, "kda.");
  const Tensor x = f.tensor("kda.x"), cu = f.tensor("kda.cu_seqlens");
  const int64_t t = x.size(0);
  ops::KdaOptions opt;
  opt.num_heads = params.A_log.size(0);
  opt.head_dim = params.o_norm.size(0);
  const int64_t ql = opt.num_heads * opt.head_dim;
  for (ops::KdaCore core : {ops::KdaCore::chunked, ops::KdaCore::recurrent}) {
    SCOPED_TRACE(core == ops::KdaCore::chunked ? "chunked" : "recurrent");
    opt.core = core;
    ops::KdaSaved s;
    const Tensor y = ops::kda_forward(params, x, cu, opt, &s);
    EXPECT_LE(rel_err(y, f.tensor("kda.y")), 1e-4);
    // Intermediates, so a regression points at its step.
    // q and k are kept normalised: the reference's conv output through the L2 norm.
    const Tensor conv = f.tensor("kda.conv_out");
    const auto conv_heads = [&](int64_t i) {
      return conv.narrow(1, i * ql, ql).contiguous().view({t, opt.num_heads, opt.head_dim});
    };
    EXPECT_LE(rel_err(s.q, ops::l2_norm(conv_heads(0), opt.l2_eps)), 1e-5);
    EXPECT_LE(rel_err(s.k, ops::l2_norm(conv_heads(1), opt.l2_eps)), 1e-5);
    EXPECT_LE(rel_err(s.v, conv_heads(2)), 1e-5);
    EXPECT_LE(rel_err(s.g, f.tensor("kda.g")), 1e-5);
    EXPECT_LE(rel_err(s.beta, f.tensor("kda.beta")), 1e-5);
    EXPECT_LE(rel_err(s.core, f.tensor("kda.core")), 1e-4);
    EXPECT_LE(rel_err(s.normed, f.tensor("kda.normed")), 1e-4);
  }
  // The f64 instantiation computes the same function (finite-difference checks run there).
  const Tensor y64 = ops::kda_forward(to_dtype(params, DType::f64), x.to(DType::f64), cu, opt);
  EXPECT_LE(rel_err(y64, f.tensor("kda.y")), 1e-4);
}

TEST(OpsKda, SoftplusGateMatchesReference) {
  const io::SafetensorsFile f = open_golden(kGolden);
  ops::KdaParams params = golden_kda_params(f, "kda.");
  params.A_log = f.tensor("kda_softplus.A_log");
  params.dt_bias = f.tensor("kda_softplus.dt_bias");
  ops::KdaOptions opt;
  opt.num_heads = params.A_log.size(0);
  opt.head_dim = params.o_norm.size(0);
  opt.lower_bound = std::nullopt;
  ops::KdaSaved s;
  const Tensor y = ops::kda_forward(params, f.tensor("kda.x"), f.tensor("kda.cu_seqlens"), opt, &s);
  EXPECT_LE(rel_err(s.g, f.tensor("kda_softplus.g")), 1e-5);
  EXPECT_LE(rel_err(y, f.tensor("kda_softplus.y")), 1e-4);
}

TEST(OpsKda, CoreMatchesReferenceRecurrence) {
  // The reference's own token-by-token recurrence on the reference's inputs, against both cores.
  const io::SafetensorsFile f = open_golden(kGolden);
  const ops::KdaParams params = golden_kda_params(f, "kda.");
  ops::KdaOptions opt;
  opt.num_heads = params.A_log.size(0);
  opt.head_dim = params.o_norm.size(0);
  ops::KdaSaved s;
  const Tensor cu = f.tensor("kda.cu_seqlens");
  ops::kda_forward(params, f.tensor("kda.x"), cu, opt, &s);
  const double scale = 1.0 / std::sqrt(double(opt.head_dim));
  const Tensor ref = f.tensor("kda.recurrent");
  EXPECT_LE(rel_err(ops::kda_recurrent(s.q, s.k, s.v, s.g, s.beta, cu, scale), ref), 1e-4);
  EXPECT_LE(rel_err(ops::kda_chunked(s.q, s.k, s.v, s.g, s.beta, cu, scale), ref), 1e-4);
}

TEST(OpsKda, ChunkedEqualsRecurrentOnRandomInputs) {
  SCOPED_TRACE(seed_note());
  // Odd lengths around the chunk size, a single token, and two full chunks plus change.
  const std::vector<int64_t> docs{1, 63, 64, 65, 130};
  const Tensor cu = cu_seqlens(docs);
  const int64_t t = total_tokens(docs), nh = 3;
  uint64_t off = 0;
  for (DType dt : {DType::f64, DType::f32}) {
    // f64 shows the two algorithms are the same function; f32 that rounding stays in bounds.
    const double tol = dt == DType::f64 ? 1e-11 : 1e-4;
    for (auto [kd, vd] : {std::pair<int64_t, int64_t>{16, 16}, {8, 12}}) {
      SCOPED_TRACE(fmt::format("{} K={} V={}", dtype_name(dt), kd, vd));
      const KdaCoreInputs c = random_kda_core(t, nh, kd, vd, dt, off += 100'000'000);
      const double scale = 1.0 / std::sqrt(double(kd));
      Tensor s_rec, s_chunk;
      const Tensor rec = ops::kda_recurrent(c.q, c.k, c.v, c.g, c.beta, cu, scale, &s_rec);
      for (int64_t chunk : {64, 1, 7, 16, 200}) {
        SCOPED_TRACE("chunk " + std::to_string(chunk));
        const Tensor out = ops::kda_chunked(c.q, c.k, c.v, c.g, c.beta, cu, scale, chunk, &s_chunk);
        EXPECT_LE(rel_err(out, rec), tol);
        EXPECT_LE(rel_err(s_chunk, s_rec), tol);
      }
    }
  }
}

TEST(OpsKda, DocumentsInAPackEqualEachDocumentAlone) {
  SCOPED_TRACE(seed_note());
  const std::vector<int64_t> docs{65, 1, 130, 63, 64, 2};
  const int64_t d = 24, nl = 2, hl = 8, t = total_tokens(docs);
  for (DType dt : {DType::f64, DType::f32}) {
    SCOPED_TRACE(std::string(dtype_name(dt)));
    // Per document the kernels do the same arithmetic; only the BLAS projections may block rows
    // differently for a different row count, which moves f32 results by a few ulps.
    const double tol = dt == DType::f64 ? 1e-12 : 1e-5;
    const ops::KdaParams p = random_kda_params(d, nl, hl, 4, dt, 0);
    const Tensor x = random_normal({t, d}, 50'000'000, dt);
    ops::KdaOptions opt;
    opt.num_heads = nl;
    opt.head_dim = hl;
    for (ops::KdaCore core : {ops::KdaCore::chunked, ops::KdaCore::recurrent}) {
      opt.core = core;
      const Tensor packed = ops::kda_forward(p, x, cu_seqlens(docs), opt);
      int64_t start = 0;
      for (int64_t n : docs) {
        SCOPED_TRACE(fmt::format("doc [{}, {}) core {}", start, start + n, int(core)));
        const Tensor alone = ops::kda_forward(p, rows(x, start, start + n), cu_seqlens({n}), opt);
        EXPECT_LE(rel_err(rows(packed, start, start + n), alone), tol);
        start += n;
      }
    }
    // The converse: one pack with no boundaries differs (state and conv do flow across), so the
    // boundaries above are what made the documents independent.
    const Tensor one_doc = ops::kda_forward(p, x, cu_seqlens({t}), opt);
    const Tensor packed = ops::kda_forward(p, x, cu_seqlens(docs), opt);
    EXPECT_GT(rel_err(rows(one_doc, 65, 66), rows(packed, 65, 66)), 1e-3);
  }
}

TEST(OpsKda, CausalConvRestartsAtDocumentsAndMatchesTheFormula) {
  SCOPED_TRACE(seed_note());
  const std::vector<int64_t> docs{1, 2, 3, 9, 4};
  const int64_t t = total_tokens(docs), c = 5, kc = 4;
  const Tensor x = random_normal({t, c}, 1, DType::f64);
  const Tensor w = random_normal({c, 1, kc}, 2, DType::f64);
  Tensor pre;
  const Tensor y = ops::causal_conv1d(x, w, cu_seqlens(docs), true, &pre);
  const Tensor lin = ops::causal_conv1d(x, w.view({c, kc}), cu_seqlens(docs), false);
  int64_t start = 0;
  for (int64_t n : docs) {
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t ch = 0; ch < c; ++ch) {
        double acc = 0;
        // weight[c, Kc−1] multiplies the current token; earlier taps reach back, never past the
        // document start.
        for (int64_t back = 0; back < kc && back <= i; ++back)
          acc += w.item({ch, 0, kc - 1 - back}) * x.item({start + i - back, ch});
        EXPECT_NEAR(pre.item({start + i, ch}), acc, 1e-13);
        EXPECT_NEAR(lin.item({start + i, ch}), acc, 1e-13);
        EXPECT_NEAR(y.item({start + i, ch}), acc / (1 + std::exp(-acc)), 1e-13);
      }
    }
    start += n;
  }
}

TEST(OpsKda, GateFollowsBothBranches) {
  SCOPED_TRACE(seed_note());
  const int64_t t = 5, nl = 2, hl = 3;
  Tensor graw = random_normal({t, nl * hl}, 1, DType::f64, 0, 2);
  // One entry on each side of softplus' threshold (z = graw + dt_bias = 20 ± 0.5).
  graw.set_item({0, 0}, 20.5);
  graw.set_item({0, 1}, 19.5);
  Tensor dtb = random_normal({nl * hl}, 2, DType::f64, 0, 0.1);
  dtb.set_item({0}, 0.0);
  dtb.set_item({1}, 0.0);
  const Tensor a_log = random_uniform({nl}, 3, DType::f64, -1, 1);
  const Tensor g_lb = ops::kda_gate(graw, dtb, a_log, -5.0);
  const Tensor g_sp = ops::kda_gate(graw, dtb, a_log, std::nullopt);
  for (int64_t i = 0; i < t; ++i)
    for (int64_t h = 0; h < nl; ++h)
      for (int64_t a = 0; a < hl; ++a) {
        const double z = graw.item({i, h * hl + a}) + dtb.item({h * hl + a});
        const double rate = std::exp(a_log.item({h}));
        EXPECT_NEAR(g_lb.item({i, h, a}), -5.0 / (1 + std::exp(-rate * z)), 1e-14);
        const double sp = z > 20 ? z : std::log1p(std::exp(z));
        EXPECT_NEAR(g_sp.item({i, h, a}), -rate * sp, 1e-12 * (1 + rate * std::abs(sp)));
      }
}

TEST(OpsKda, RejectsMalformedDocumentOffsets) {
  const KdaCoreInputs c = random_kda_core(6, 1, 4, 4, DType::f32, 0);
  auto run = [&](std::vector<int32_t> cu) {
    ops::kda_chunked(c.q, c.k, c.v, c.g, c.beta, Tensor::from_vector(cu, {int64_t(cu.size())}),
                     0.5);
  };
  EXPECT_THROW(run({0, 5}), Error);        // does not cover the pack
  EXPECT_THROW(run({1, 6}), Error);        // does not start at 0
  EXPECT_THROW(run({0, 4, 3, 6}), Error);  // decreasing
  EXPECT_THROW(run({0}), Error);           // no document
  EXPECT_NO_THROW(run({0, 2, 2, 6}));      // an empty document is allowed
}

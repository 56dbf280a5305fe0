// CUDA parity for KDA (ops/cuda/kda.h) against the CPU ops (ops/kda.h, ops/norm.h): the chunked
// delta rule forward and backward (o, dq, dk, dv, dg, dβ) over packed documents of odd lengths,
// with few and with many heads (the backward's two ways of keeping chunk states) and every value
// slicing of the walks, the short causal conv with SiLU (dx and the weight gradient), the q/k conv
// with its L2 norm fused, both forget-gate forms, β, the q/k L2 norm and the sigmoid-gated o_norm,
// in bf16 storage and in the f32 mode, with bit-identical reruns. Fresh random inputs every run
// (seed printed; GLMTUNE_TEST_SEED reproduces one); the CPU reference runs in f32 on the same
// (bf16-rounded) values. Skipped where no GPU is visible.

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "glmtune/ops/kda.h"
#include "glmtune/ops/norm.h"
#include "glmtune/tensor/tensor.h"
#include "support/cuda_test_support.h"
#ifdef GLMTUNE_WITH_CUDA
#include "glmtune/ops/cuda/kda.h"
#endif

using namespace glmtune;
using namespace glmtune::test;

namespace {

#ifdef GLMTUNE_WITH_CUDA
// Documents of 1, 63, 64, 65, 200 and 17 tokens (chunk tails of every kind).
const std::vector<int32_t> kCu = {0, 1, 64, 128, 193, 393, 410};

Tensor cu_cpu() { return Tensor::from_vector<int32_t>(kCu, {int64_t(kCu.size())}); }

// Elementwise map of a CPU f32 tensor.
template <typename F>
Tensor map_f32(const Tensor& t, F&& f) {
  Tensor out = f32(t).clone();
  float* p = out.data<float>();
  for (int64_t i = 0; i < out.numel(); ++i) p[i] = f(p[i]);
  return out;
}

struct CoreCase {
  DType dtype;
  double act_bar, f32_bar;
  const char* what;
  // Per-token log decay down to `floor` (0: a mild gate). At −5 (the gate's lower bound) e^Γ falls
  // to e^−80 within a chunk, so the exact per-element decays, the hi/lo operand split and the
  // backward's factorised decay (e^{±40} around the chunk's middle) meet their range's edge; at
  // −12 chunks can span more than that and take the exact fp32 fallback (prep and backward): with
  // slope 4 a chunk's widest channel sits near the limit, so both paths occur in one call; with
  // slope 12 nearly every full chunk falls back.
  float floor = 0.0f;
  float slope = 2.0f;
  // The backward keeps one chunk state per pair of chunks where the walks (head, document, value
  // slice) reach 90% of the GPU's SMs, else one per chunk: 3 heads × 6 documents take the second
  // path, 48 heads (288 walks, more than any current GPU has SMs) the first.
  int64_t heads = 3;
  // Value slices per walk (cuda::kda_chunked's value_slices; 0: automatic, which gives 4 for 3
  // heads × 6 documents and 1 for 48 heads on an H200).
  int slices = 0;
};

void run_core(const CoreCase& c, uint64_t& stream) {
  const int64_t t = kCu.back(), nh = c.heads, kd = 128;
  const std::string tag = std::string(", ") + c.what;
  // Normalised q, k (rounded to the storage dtype after normalising), v, a log decay mixing slow
  // and fast channels, β in (0, 1).
  const Tensor q = ops::l2_norm(random_cpu({t, nh, kd}, DType::f32, stream++), 1e-6).to(c.dtype);
  const Tensor k = ops::l2_norm(random_cpu({t, nh, kd}, DType::f32, stream++), 1e-6).to(c.dtype);
  const Tensor v = random_cpu({t, nh, kd}, c.dtype, stream++);
  const Tensor g = map_f32(random_cpu({t, nh, kd}, DType::f32, stream++), [&c](float z) {
    return c.floor < 0.0f ? -std::fmin(-c.floor, 0.5f + c.slope * std::fabs(z))
                          : -(0.01f + 0.25f * std::fabs(z));
  });
  const Tensor beta = map_f32(random_cpu({t, nh}, DType::f32, stream++),
                              [](float z) { return 1.0f / (1.0f + std::exp(-z)); });
  const double scale = 1.0 / std::sqrt(double(kd));
  const Tensor cu = cu_cpu(), cug = cu.to(kGpu);

  const Tensor o_ref = ops::kda_chunked(f32(q), f32(k), f32(v), g, beta, cu, scale);
  const Tensor qg = q.to(kGpu), kg = k.to(kGpu), vg = v.to(kGpu), gg = g.to(kGpu),
               bg = beta.to(kGpu);
  const Tensor o = cuda::kda_chunked(qg, kg, vg, gg, bg, cug, scale, nullptr, c.slices);
  EXPECT_CLOSE(o, o_ref, c.act_bar, "core o" + tag);
  // Each value row of the output comes from one warp whatever the slicing: the same bits.
  for (int slices : {1, 2, 4})
    EXPECT_TRUE(
        bit_identical(o, cuda::kda_chunked(qg, kg, vg, gg, bg, cug, scale, nullptr, slices)))
        << ctx("core forward at " + std::to_string(slices) + " value slices" + tag);

  const Tensor dout = random_cpu({t, nh, kd}, c.dtype, stream++);
  const ops::KdaCoreGrads ref =
      ops::kda_chunked_backward(f32(q), f32(k), f32(v), g, beta, cu, scale, f32(dout));
  const ops::KdaCoreGrads gr =
      cuda::kda_chunked_backward(qg, kg, vg, gg, bg, cug, scale, dout.to(kGpu), nullptr, c.slices);
  EXPECT_CLOSE(gr.dq, ref.dq, c.act_bar, "core dq" + tag);
  EXPECT_CLOSE(gr.dk, ref.dk, c.act_bar, "core dk" + tag);
  EXPECT_CLOSE(gr.dv, ref.dv, c.act_bar, "core dv" + tag);
  EXPECT_CLOSE(gr.dg, ref.dg, c.f32_bar, "core dg" + tag);
  EXPECT_CLOSE(gr.dbeta, ref.dbeta, c.f32_bar, "core dbeta" + tag);

  // The backward from the forward's kept chunk tiles: the same tiles, so the same bits.
  cuda::KdaChunkCache cache;
  cuda::kda_chunked(qg, kg, vg, gg, bg, cug, scale, nullptr, c.slices, &cache);
  const ops::KdaCoreGrads gk = cuda::kda_chunked_backward(qg, kg, vg, gg, bg, cug, scale,
                                                          dout.to(kGpu), nullptr, c.slices, &cache);
  EXPECT_TRUE(bit_identical(gr.dq, gk.dq) && bit_identical(gr.dk, gk.dk) &&
              bit_identical(gr.dv, gk.dv) && bit_identical(gr.dg, gk.dg) &&
              bit_identical(gr.dbeta, gk.dbeta))
      << ctx("core backward from the kept chunk tiles" + tag);
  // A cache filled by another forward is refused, not silently used.
  const Tensor k_other = k.to(kGpu);
  EXPECT_ANY_THROW(cuda::kda_chunked_backward(qg, k_other, vg, gg, bg, cug, scale, dout.to(kGpu),
                                              nullptr, c.slices, &cache))
      << ctx("a cache of other inputs" + tag);

  const Tensor o2 = cuda::kda_chunked(qg, kg, vg, gg, bg, cug, scale, nullptr, c.slices);
  EXPECT_TRUE(bit_identical(o, o2)) << ctx("core forward rerun" + tag);
  const ops::KdaCoreGrads gr2 =
      cuda::kda_chunked_backward(qg, kg, vg, gg, bg, cug, scale, dout.to(kGpu), nullptr, c.slices);
  EXPECT_TRUE(bit_identical(gr.dq, gr2.dq) && bit_identical(gr.dk, gr2.dk) &&
              bit_identical(gr.dv, gr2.dv) && bit_identical(gr.dg, gr2.dg) &&
              bit_identical(gr.dbeta, gr2.dbeta))
      << ctx("core backward rerun" + tag);
}
// The sigmoid-gated o_norm over `heads` rows of n per token, forward and backward, against the
// CPU op in f32 on the same (rounded) values.
void expect_gated_norm_matches_cpu(int64_t t, int64_t heads, int64_t n, DType dt, uint64_t& stream,
                                   double bar, double pbar, const std::string& tag) {
  const Tensor core = random_cpu({t, heads, n}, dt, stream++);
  const Tensor gate = random_cpu({t, heads, n}, dt, stream++, 2.0);
  const Tensor onw = random_cpu({n}, DType::f32, stream++, 1.0, 0.2);
  EXPECT_CLOSE(cuda::rms_norm_gated(core.to(kGpu), onw.to(kGpu), gate.to(kGpu), 1e-5),
               ops::rms_norm_gated(f32(core), onw, f32(gate), 1e-5), bar, "o_norm forward" + tag);
  const Tensor dn = random_cpu({t, heads, n}, dt, stream++);
  Tensor gw_ref, gw;
  const ops::RmsNormGatedGrads ref = ops::rms_norm_gated_backward(
      f32(dn), f32(core), onw, f32(gate), 1e-5, ops::GateActivation::sigmoid, Tensor(), &gw_ref);
  const ops::RmsNormGatedGrads got = cuda::rms_norm_gated_backward(
      dn.to(kGpu), core.to(kGpu), onw.to(kGpu), gate.to(kGpu), 1e-5, &gw);
  EXPECT_CLOSE(got.dx, ref.dx, bar, "o_norm dx" + tag);
  EXPECT_CLOSE(got.dgate, ref.dgate, bar, "o_norm d gate" + tag);
  EXPECT_CLOSE(gw, gw_ref, pbar, "o_norm d weight" + tag);
}

// The conv of x with weight w over the documents cu (cug on the GPU), forward and backward; returns
// the GPU weight gradient.
Tensor expect_conv_matches_cpu(const Tensor& x, const Tensor& w, const Tensor& cu,
                               const Tensor& cug, bool silu, const Tensor& dy, double bar,
                               double pbar, const std::string& tag) {
  EXPECT_CLOSE(cuda::causal_conv1d(x.to(kGpu), w.to(kGpu), cug, silu),
               ops::causal_conv1d(f32(x), f32(w), cu, silu), bar, "conv forward" + tag);
  Tensor gw_ref, gw;
  const Tensor dx_ref = ops::causal_conv1d_backward(f32(x), f32(w), cu, silu, f32(dy), &gw_ref);
  const Tensor dx =
      cuda::causal_conv1d_backward(x.to(kGpu), w.to(kGpu), cug, silu, dy.to(kGpu), &gw);
  EXPECT_CLOSE(dx, dx_ref, bar, "conv dx" + tag);
  EXPECT_CLOSE(gw, gw_ref, pbar, "conv d weight" + tag);
  return gw;
}
#endif

}  // namespace

TEST(CudaOpsKda, ChunkedDeltaRuleMatchesCpu) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  uint64_t stream = 1;
  // In bf16 storage the kernels' products take bf16 operands (fp32 accumulation), so the f32
  // outputs dg and dβ carry that rounding too: about 2e-3 rel L2 on an H200, inside the 1e-3 to
  // 1e-2 that bf16 operands give. The f32 mode splits each operand into three bf16 parts (about
  // fp32's 24 bits): measured 1e-6 .. 7.7e-6 (dg past the factorised range), bar 3e-5.
  run_core({DType::bf16, 1e-2, 5e-3, "bf16"}, stream);
  run_core({DType::f32, 3e-5, 3e-5, "f32 mode"}, stream);
  run_core({DType::bf16, 1e-2, 5e-3, "bf16, steep gate", -5.0f}, stream);
  run_core({DType::bf16, 1e-2, 5e-3, "bf16, gate at the factorised range's edge", -12.0f, 4.0f},
           stream);
  run_core({DType::f32, 3e-5, 3e-5, "f32 mode, gate past the factorised range", -12.0f, 12.0f},
           stream);
  run_core({DType::bf16, 1e-2, 5e-3, "bf16, 48 heads", 0.0f, 2.0f, 48}, stream);
  run_core({DType::f32, 3e-5, 3e-5, "f32 mode, 48 heads, steep gate", -5.0f, 2.0f, 48}, stream);
  // Every value slicing on both state layouts (one per chunk at 3 heads, per pair at 48).
  run_core({DType::bf16, 1e-2, 5e-3, "bf16, 1 value slice", 0.0f, 2.0f, 3, 1}, stream);
  run_core({DType::f32, 3e-5, 3e-5, "f32 mode, 2 value slices, steep gate", -5.0f, 2.0f, 3, 2},
           stream);
  run_core({DType::bf16, 1e-2, 5e-3, "bf16, 48 heads, 2 value slices", 0.0f, 2.0f, 48, 2}, stream);
  run_core({DType::f32, 3e-5, 3e-5, "f32 mode, 48 heads, 4 value slices", -5.0f, 2.0f, 48, 4},
           stream);
#endif
}

// The conv and the gated norm on shapes off their fast paths: empty documents and documents
// shorter than the taps, channel counts that are not a multiple of the kernels' channel groups
// (8 bf16 forward, 4 backward: per-element accesses), 2, 3 and 8 taps, and norm rows of 48 and
// 200 elements (not 32 per lane). Runs of 16 tokens start inside documents and end at their
// boundaries alike.
TEST(CudaOpsKda, ConvAndGatedNormOffTheFastPathsMatchCpu) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  uint64_t stream = 500;
  const std::vector<int32_t> cu_values = {0, 0, 2, 3, 3, 20, 21, 90, 91, 93};
  const Tensor cu = Tensor::from_vector<int32_t>(cu_values, {int64_t(cu_values.size())});
  const Tensor cug = cu.to(kGpu);
  const int64_t t = cu_values.back();
  struct Shape3 {
    int64_t c, kc;
  };
  for (DType dt : {DType::bf16, DType::f32}) {
    const double bar = dt == DType::bf16 ? 1e-2 : 1e-4, pbar = dt == DType::bf16 ? 1e-3 : 1e-4;
    for (const Shape3 sh : {Shape3{12, 3}, Shape3{10, 2}, Shape3{40, 8}, Shape3{64, 4}}) {
      const std::string tag = fmt::format(", C {} Kc {}, {}", sh.c, sh.kc, dtype_name(dt));
      const Tensor x = random_cpu({t, sh.c}, dt, stream++);
      const Tensor w = random_cpu({sh.c, 1, sh.kc}, dt, stream++, 0.5);
      for (bool silu : {true, false})
        expect_conv_matches_cpu(x, w, cu, cug, silu, random_cpu({t, sh.c}, dt, stream++), bar, pbar,
                                tag + (silu ? ", SiLU" : ", linear"));
    }
    for (const int64_t n : {int64_t(48), int64_t(200), int64_t(64)})
      expect_gated_norm_matches_cpu(t, 3, n, dt, stream, bar, pbar,
                                    fmt::format(", rows of {}, {}", n, dtype_name(dt)));
  }
#endif
}

// The q/k conv (conv, SiLU, per-head L2 norm) forward and backward against the CPU op, at head
// widths the fused forward takes (128 and 64: a row on 16 or 8 lanes of a warp, or 32 and 16 in
// f32) and one it leaves to the separate ops (48); the forward has the bits of the conv followed
// by the norm on the GPU, every width.
TEST(CudaOpsKda, QkConvMatchesCpuAndTheSeparateOps) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  uint64_t stream = 700;
  const int64_t t = kCu.back(), nl = 4, kc = 4;
  const Tensor cu = cu_cpu(), cug = cu.to(kGpu);
  for (DType dt : {DType::bf16, DType::f32}) {
    // In bf16 storage the norm is taken of the conv output rounded to bf16 (2^-9 relative an
    // element) where the CPU keeps it in f32: measured 5e-4 .. 7e-4 on ν and 2e-3 on the weight
    // gradient, whose every term carries that rounding through the norm's derivative.
    const double bar = dt == DType::bf16 ? 1e-2 : 1e-4, pbar = dt == DType::bf16 ? 5e-3 : 1e-4;
    for (const int64_t hd : {int64_t(128), int64_t(64), int64_t(48)}) {
      const std::string tag = fmt::format(", heads of {}, {}", hd, dtype_name(dt));
      const int64_t c = nl * hd;
      const Tensor x = random_cpu({t, c}, dt, stream++);
      const Tensor w = random_cpu({c, 1, kc}, dt, stream++, 0.5);
      const Tensor dy = random_cpu({t, nl, hd}, dt, stream++);
      const Tensor xg = x.to(kGpu), wg = w.to(kGpu);
      Tensor nu, nu_ref, nu_sep;
      const Tensor y = cuda::kda_qk_conv(xg, wg, cug, hd, 1e-6, &nu);
      EXPECT_CLOSE(y, ops::kda_qk_conv(f32(x), f32(w), cu, hd, 1e-6, &nu_ref), bar,
                   "q/k conv forward" + tag);
      EXPECT_CLOSE(nu, nu_ref, bar, "q/k conv norm" + tag);
      const Tensor y_sep =
          cuda::l2_norm(cuda::causal_conv1d(xg, wg, cug, true).view({t, nl, hd}), 1e-6, &nu_sep);
      EXPECT_TRUE(bit_identical(y, y_sep))
          << ctx("q/k conv forward against the separate ops" + tag);
      EXPECT_TRUE(bit_identical(nu, nu_sep)) << ctx("q/k conv norm against l2_norm's" + tag);

      Tensor gw_ref, gw, gw2;
      const Tensor dx_ref =
          ops::kda_qk_conv_backward(f32(x), f32(w), cu, hd, 1e-6, nu_ref, f32(dy), &gw_ref);
      const Tensor dx = cuda::kda_qk_conv_backward(xg, wg, cug, hd, 1e-6, nu, dy.to(kGpu), &gw);
      EXPECT_CLOSE(dx, dx_ref, bar, "q/k conv dx" + tag);
      EXPECT_CLOSE(gw, gw_ref, pbar, "q/k conv d weight" + tag);
      cuda::kda_qk_conv_backward(xg, wg, cug, hd, 1e-6, nu, dy.to(kGpu), &gw2);
      EXPECT_TRUE(bit_identical(gw, gw2)) << ctx("q/k conv d weight rerun" + tag);
    }
  }
#endif
}

TEST(CudaOpsKda, ConvGateBetaNormsMatchCpu) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  uint64_t stream = 100;
  const int64_t t = kCu.back(), nl = 4, hl = 32, ql = nl * hl, kc = 4;
  const Tensor cu = cu_cpu(), cug = cu.to(kGpu);
  for (DType dt : {DType::bf16, DType::f32}) {
    const double bar = dt == DType::bf16 ? 1e-2 : 1e-4, pbar = dt == DType::bf16 ? 1e-3 : 1e-4;
    const std::string tag = dt == DType::bf16 ? ", bf16" : ", f32 mode";

    // Short conv + SiLU.
    const Tensor x = random_cpu({t, ql}, dt, stream++);
    const Tensor w = random_cpu({ql, 1, kc}, dt, stream++, 0.5);
    const Tensor dy = random_cpu({t, ql}, dt, stream++);
    const Tensor gw = expect_conv_matches_cpu(x, w, cu, cug, true, dy, bar, pbar, tag);
    Tensor gw2;
    cuda::causal_conv1d_backward(x.to(kGpu), w.to(kGpu), cug, true, dy.to(kGpu), &gw2);
    EXPECT_TRUE(bit_identical(gw, gw2)) << ctx("conv d weight rerun" + tag);

    // Forget gate, both forms.
    const Tensor graw = random_cpu({t, ql}, dt, stream++, 2.0);
    const Tensor dt_bias = random_cpu({ql}, DType::f32, stream++, 0.5);
    const Tensor a_log = random_cpu({nl}, DType::f32, stream++, 0.5);
    for (std::optional<double> lb : {std::optional<double>(-5.0), std::optional<double>()}) {
      const std::string gtag = tag + (lb ? ", lower bound -5" : ", softplus");
      const Tensor g_ref = ops::kda_gate(f32(graw), dt_bias, a_log, lb);
      const Tensor g = cuda::kda_gate(graw.to(kGpu), dt_bias.to(kGpu), a_log.to(kGpu), lb);
      EXPECT_CLOSE(g, g_ref, 1e-5, "gate forward" + gtag);
      const Tensor dg = random_cpu({t, nl, hl}, DType::f32, stream++);
      Tensor gdt_ref, ga_ref, gdt, ga;
      const Tensor dz_ref =
          ops::kda_gate_backward(f32(graw), dt_bias, a_log, lb, dg, &gdt_ref, &ga_ref);
      const Tensor dz = cuda::kda_gate_backward(graw.to(kGpu), dt_bias.to(kGpu), a_log.to(kGpu), lb,
                                                dg.to(kGpu), &gdt, &ga);
      EXPECT_CLOSE(dz, dz_ref, bar, "gate d graw" + gtag);
      EXPECT_CLOSE(gdt, gdt_ref, 1e-4, "gate d dt_bias" + gtag);
      EXPECT_CLOSE(ga, ga_ref, 1e-4, "gate d A_log" + gtag);
    }

    // beta.
    const Tensor logits = random_cpu({t, nl}, dt, stream++, 2.0);
    const Tensor beta_ref = map_f32(logits, [](float z) { return 1.0f / (1.0f + std::exp(-z)); });
    const Tensor beta = cuda::kda_beta(logits.to(kGpu));
    EXPECT_CLOSE(beta, beta_ref, 1e-6, "beta forward" + tag);
    const Tensor dbeta = random_cpu({t, nl}, DType::f32, stream++);
    Tensor dl_ref = f32(dbeta).clone();
    for (int64_t i = 0; i < dl_ref.numel(); ++i) {
      const float b = beta_ref.data<float>()[i];
      dl_ref.data<float>()[i] *= b * (1.0f - b);
    }
    EXPECT_CLOSE(cuda::kda_beta_backward(beta, dbeta.to(kGpu)), dl_ref, 1e-5,
                 "beta backward" + tag);

    // Forget gate over a channel count that is no multiple of 4 (the one-channel-a-thread kernel;
    // above, 128 channels take the four-a-thread one).
    {
      const Tensor graw3 = random_cpu({t, 99}, dt, stream++, 2.0);
      const Tensor bias3 = random_cpu({99}, DType::f32, stream++, 0.5);
      const Tensor alog3 = random_cpu({3}, DType::f32, stream++, 0.5);
      EXPECT_CLOSE(cuda::kda_gate(graw3.to(kGpu), bias3.to(kGpu), alog3.to(kGpu), -5.0),
                   ops::kda_gate(f32(graw3), bias3, alog3, -5.0), 1e-5,
                   "gate forward, 3 heads of 33" + tag);
    }

    // q/k L2 norm: 128-wide heads, and rows the 16-byte-piece kernel takes with 8 or 16 lanes (64)
    // or not at all (96).
    for (int64_t width : {128, 64, 96}) {
      const std::string wtag = tag + ", rows of " + std::to_string(width);
      const Tensor qx = random_cpu({t, nl, width}, dt, stream++, 0.2, 1.0);
      Tensor nrm_ref, nrm;
      EXPECT_CLOSE(cuda::l2_norm(qx.to(kGpu), 1e-6, &nrm), ops::l2_norm(f32(qx), 1e-6, &nrm_ref),
                   bar, "l2 norm forward" + wtag);
      EXPECT_CLOSE(nrm, nrm_ref, 1e-5, "l2 norm divisor" + wtag);
      const Tensor dq = random_cpu({t, nl, width}, dt, stream++);
      EXPECT_CLOSE(cuda::l2_norm_backward(dq.to(kGpu), qx.to(kGpu), 1e-6),
                   ops::l2_norm_backward(f32(dq), f32(qx), 1e-6), bar, "l2 norm backward" + wtag);
    }

    // Sigmoid-gated o_norm.
    expect_gated_norm_matches_cpu(t, nl, 128, dt, stream, bar, pbar, tag);
  }
#endif
}

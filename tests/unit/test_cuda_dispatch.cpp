// The ops of ops/*.h called with CUDA tensors (ops/dispatch.h) against the same ops on the CPU:
// the model code calls only these entry points, so the GPU step is the CPU step with the device
// changed. Inputs are fresh random bf16 values (seed printed; GLMTUNE_TEST_SEED reproduces a run)
// and the CPU reference runs in f32 on the same values. Parameter gradients accumulate into
// pre-filled buffers on both sides, so a path that overwrites instead of adding fails. Skipped
// (not failed) where no GPU is visible or CUDA is not built.

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "glmtune/ops/cross_entropy.h"
#include "glmtune/ops/embedding.h"
#include "glmtune/ops/kda.h"
#include "glmtune/ops/linear.h"
#include "glmtune/ops/mhc.h"
#include "glmtune/ops/mlp.h"
#include "glmtune/ops/norm.h"
#include "glmtune/tensor/tensor.h"
#include "support/cuda_test_support.h"

using namespace glmtune;
using namespace glmtune::test;

namespace {

#ifdef GLMTUNE_WITH_CUDA
// bf16 draws on the GPU and the same values in f32 on the CPU.
struct Pair {
  Tensor gpu, cpu;
};
Pair draw(const Shape& shape, uint64_t stream, double std = 1.0) {
  const Tensor b = random_cpu(shape, DType::bf16, stream, std);
  return {b.to(kGpu), b.to(DType::f32)};
}
// A gradient buffer already holding a value on both sides (f32).
Pair prefilled(const Shape& shape, uint64_t stream) {
  const Tensor f = random_cpu(shape, DType::f32, stream, 0.5);
  return {f.to(kGpu), f.clone()};
}
#endif

TEST(CudaDispatch, LinearForwardAndBackward) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  const int64_t T = 37, D = 96, N = 80;
  const Pair x = draw({T, D}, 1), w = draw({N, D}, 2, 0.1), b = draw({N}, 3), dy = draw({T, N}, 4);
  EXPECT_CLOSE(ops::linear(x.gpu, w.gpu, b.gpu), ops::linear(x.cpu, w.cpu, b.cpu), 1e-2, "y");
  Pair gw = prefilled({N, D}, 5), gb = prefilled({N}, 6);
  const Tensor dx_g = ops::linear_backward(dy.gpu, x.gpu, w.gpu, &gw.gpu, &gb.gpu);
  const Tensor dx_c = ops::linear_backward(dy.cpu, x.cpu, w.cpu, &gw.cpu, &gb.cpu);
  EXPECT_EQ(dx_g.device(), kGpu);
  EXPECT_CLOSE(dx_g, dx_c, 1e-2, "dx");
  EXPECT_CLOSE(gw.gpu, gw.cpu, 1e-4, "dW (accumulated)");
  EXPECT_CLOSE(gb.gpu, gb.cpu, 1e-5, "db (accumulated)");
  // An undefined slot is created as f32 zeros on the device.
  Tensor fresh;
  ops::linear_backward(dy.gpu, x.gpu, w.gpu, &fresh, nullptr, /*need_input_grad=*/false);
  EXPECT_EQ(fresh.dtype(), DType::f32);
  EXPECT_EQ(fresh.device(), kGpu);
#endif
}

TEST(CudaDispatch, RmsNormForwardAndBackward) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  const int64_t T = 29, D = 128;
  const Pair x = draw({T, D}, 10), w = draw({D}, 11), dy = draw({T, D}, 12);
  Tensor rstd_g, rstd_c;
  EXPECT_CLOSE(ops::rms_norm(x.gpu, w.gpu, 1e-5, &rstd_g),
               ops::rms_norm(x.cpu, w.cpu, 1e-5, &rstd_c), 1e-2, "y");
  EXPECT_CLOSE(rstd_g, rstd_c, 1e-5, "rstd");
  Pair gw = prefilled({D}, 13);
  EXPECT_CLOSE(ops::rms_norm_backward(dy.gpu, x.gpu, w.gpu, 1e-5, rstd_g, &gw.gpu),
               ops::rms_norm_backward(dy.cpu, x.cpu, w.cpu, 1e-5, rstd_c, &gw.cpu), 1e-2, "dx");
  EXPECT_CLOSE(gw.gpu, gw.cpu, 1e-4, "dw (accumulated)");
#endif
}

TEST(CudaDispatch, MlpForwardAndBackward) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  const int64_t T = 41, D = 64, I = 96;
  // Projections of std about 1.2, far below the clamp limit of 10: next to it, the GPU's bf16
  // product and the CPU's f32 product can fall on opposite sides and zero different gradients.
  // The clamps themselves are tested on identical values in test_cuda_ops_swiglu.
  const Pair x = draw({T, D}, 20), g = draw({I, D}, 21, 0.15), u = draw({I, D}, 22, 0.15),
             d = draw({D, I}, 23, 0.1), dy = draw({T, D}, 24);
  const ops::MlpParams pg{g.gpu, u.gpu, d.gpu}, pc{g.cpu, u.cpu, d.cpu};
  ops::MlpContext cg, cc;
  const Tensor yg = ops::mlp_forward(pg, x.gpu, 10.0, cg);
  EXPECT_CLOSE(yg, ops::mlp_forward(pc, x.cpu, 10.0, cc), 2e-2, "y");
  EXPECT_CLOSE(ops::mlp_forward(pg, x.gpu, 10.0), yg, 0.0, "y without context");
  Pair gg = prefilled({I, D}, 25), gu = prefilled({I, D}, 26), gd = prefilled({D, I}, 27);
  ops::MlpParams grads_g{gg.gpu, gu.gpu, gd.gpu}, grads_c{gg.cpu, gu.cpu, gd.cpu};
  EXPECT_CLOSE(ops::mlp_backward(pg, cg, dy.gpu, 10.0, grads_g),
               ops::mlp_backward(pc, cc, dy.cpu, 10.0, grads_c), 2e-2, "dx");
  EXPECT_CLOSE(grads_g.gate_proj, grads_c.gate_proj, 2e-2, "d gate_proj");
  EXPECT_CLOSE(grads_g.up_proj, grads_c.up_proj, 2e-2, "d up_proj");
  EXPECT_CLOSE(grads_g.down_proj, grads_c.down_proj, 1e-2, "d down_proj");
#endif
}

TEST(CudaDispatch, EmbeddingForwardAndBackward) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  const int64_t V = 50, D = 32, T = 70;
  const Pair table = draw({V, D}, 30), dout = draw({T, D}, 31);
  std::vector<int32_t> id_values(T);
  for (int64_t t = 0; t < T; ++t) id_values[size_t(t)] = int32_t((t * 7 + t / 5) % V);
  const Tensor ids = Tensor::from_vector(id_values, {T});
  EXPECT_CLOSE(ops::embedding_forward(table.gpu, ids), ops::embedding_forward(table.cpu, ids), 0.0,
               "gather");
  Pair grad = prefilled({V, D}, 32);
  ops::embedding_backward(table.gpu, ids, dout.gpu, 3, grad.gpu);
  ops::embedding_backward(table.cpu, ids, dout.cpu, 3, grad.cpu);
  EXPECT_CLOSE(grad.gpu, grad.cpu, 1e-5, "d table (accumulated, padding row 3 untouched)");
#endif
}

TEST(CudaDispatch, LmHeadCrossEntropy) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  const int64_t T = 45, D = 64, V = 300;
  const Pair h = draw({T, D}, 40), w = draw({V, D}, 41, 0.2);
  std::vector<int32_t> label_values(T);
  for (int64_t t = 0; t < T; ++t)
    label_values[size_t(t)] = t % 6 == 0 ? int32_t(ops::kIgnoreIndex) : int32_t((t * 13) % V);
  const Tensor labels = Tensor::from_vector(label_values, {T});
  ops::CrossEntropyOptions opts;
  opts.denominator = 50;
  opts.grad_scale = 0.5;
  opts.chunk_rows = 16;
  Tensor dh_g, dh_c;
  Pair dw = prefilled({V, D}, 42);
  const ops::CrossEntropyResult rg =
      ops::lm_head_cross_entropy(h.gpu, w.gpu, labels, opts, &dh_g, &dw.gpu);
  const ops::CrossEntropyResult rc =
      ops::lm_head_cross_entropy(h.cpu, w.cpu, labels, opts, &dh_c, &dw.cpu);
  EXPECT_EQ(rg.n_tokens, rc.n_tokens);
  EXPECT_NEAR(rg.loss, rc.loss, 1e-3 * std::abs(rc.loss));
  EXPECT_CLOSE(dh_g, dh_c, 1e-2, "d hidden");
  EXPECT_CLOSE(dw.gpu, dw.cpu, 1e-3, "d head (accumulated)");
#endif
}

TEST(CudaDispatch, MhcStreamReshapes) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  const int64_t T = 23, H = 4, D = 48;
  const Pair x = draw({T, D}, 50), streams = draw({T, H, D}, 51);
  EXPECT_CLOSE(ops::mhc_expand(x.gpu, H), ops::mhc_expand(x.cpu, H), 0.0, "expand");
  EXPECT_CLOSE(ops::mhc_head(streams.gpu), ops::mhc_head(streams.cpu), 1e-2, "head");
  EXPECT_CLOSE(ops::mhc_expand_backward(streams.gpu), ops::mhc_expand_backward(streams.cpu), 1e-2,
               "expand backward");
  EXPECT_CLOSE(ops::mhc_head_backward(x.gpu, H), ops::mhc_head_backward(x.cpu, H), 1e-2,
               "head backward");
#endif
}

// The whole KDA mixer on the GPU (projections + kernels) against the CPU mixer, forward and every
// gradient, over three packed documents.
TEST(CudaDispatch, KdaMixerForwardAndBackward) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  const int64_t D = 64, NL = 2, HL = 128, QL = NL * HL, Kc = 4;
  const std::vector<int32_t> cu_values = {0, 1, 64, 129};
  const int64_t T = cu_values.back();
  const Tensor cu = Tensor::from_vector(cu_values, {int64_t(cu_values.size())});
  ops::KdaOptions o;
  o.num_heads = NL;
  o.head_dim = HL;
  uint64_t stream = 60;
  auto param = [&](const Shape& shape, double std) { return draw(shape, stream++, std); };
  const double w = 1.0 / std::sqrt(double(D));
  const Pair q = param({QL, D}, w), k = param({QL, D}, w), v = param({QL, D}, w),
             conv = param({3 * QL, 1, Kc}, 0.5), fa = param({HL, D}, w), fb = param({QL, HL}, 0.1),
             dt = param({QL}, 0.5), alog = param({NL}, 0.5), b = param({NL, D}, w),
             ga = param({HL, D}, w), gb = param({QL, HL}, 0.1), on = param({HL}, 1.0),
             op = param({D, QL}, 1.0 / std::sqrt(double(QL)));
  const ops::KdaParams pg{q.gpu,    k.gpu, v.gpu,  conv.gpu, fa.gpu, fb.gpu, dt.gpu,
                          alog.gpu, b.gpu, ga.gpu, gb.gpu,   on.gpu, op.gpu};
  const ops::KdaParams pc{q.cpu,    k.cpu, v.cpu,  conv.cpu, fa.cpu, fb.cpu, dt.cpu,
                          alog.cpu, b.cpu, ga.cpu, gb.cpu,   on.cpu, op.cpu};
  const Pair x = param({T, D}, 1.0), dy = param({T, D}, 1.0);
  ops::KdaSaved sg, sc;
  EXPECT_CLOSE(ops::kda_forward(pg, x.gpu, cu, o, &sg), ops::kda_forward(pc, x.cpu, cu, o, &sc),
               2e-2, "y");
  ops::KdaGrads gg, gc;
  EXPECT_CLOSE(ops::kda_backward(pg, x.gpu, cu, o, &sg, dy.gpu, gg),
               ops::kda_backward(pc, x.cpu, cu, o, &sc, dy.cpu, gc), 3e-2, "dx");
  const std::pair<const char*, std::pair<Tensor*, Tensor*>> grads[] = {
      {"q_proj", {&gg.q_proj, &gc.q_proj}},       {"k_proj", {&gg.k_proj, &gc.k_proj}},
      {"v_proj", {&gg.v_proj, &gc.v_proj}},       {"conv1d", {&gg.conv1d, &gc.conv1d}},
      {"f_a_proj", {&gg.f_a_proj, &gc.f_a_proj}}, {"f_b_proj", {&gg.f_b_proj, &gc.f_b_proj}},
      {"dt_bias", {&gg.dt_bias, &gc.dt_bias}},    {"A_log", {&gg.A_log, &gc.A_log}},
      {"b_proj", {&gg.b_proj, &gc.b_proj}},       {"g_a_proj", {&gg.g_a_proj, &gc.g_a_proj}},
      {"g_b_proj", {&gg.g_b_proj, &gc.g_b_proj}}, {"o_norm", {&gg.o_norm, &gc.o_norm}},
      {"o_proj", {&gg.o_proj, &gc.o_proj}}};
  for (const auto& [name, pair] : grads) {
    ASSERT_TRUE(pair.first->defined()) << name;
    EXPECT_EQ(pair.first->dtype(), DType::f32) << name;
    EXPECT_CLOSE(*pair.first, *pair.second, 3e-2, std::string("d ") + name);
  }
  // Without saved intermediates the GPU reruns the forward: the same bits.
  ops::KdaGrads again;
  const Tensor dx_saved = ops::kda_backward(pg, x.gpu, cu, o, &sg, dy.gpu, again);
  ops::KdaGrads recomputed;
  EXPECT_TRUE(
      bit_identical(ops::kda_backward(pg, x.gpu, cu, o, nullptr, dy.gpu, recomputed), dx_saved));
  EXPECT_TRUE(bit_identical(recomputed.q_proj, again.q_proj));
#endif
}

}  // namespace

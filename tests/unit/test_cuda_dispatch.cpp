// The composite ops (ops/composite/: written once on the leaf ops) called with CUDA tensors
// against the same composites on the CPU: the model code calls only these entry points, so the
// GPU step is the CPU step with the device changed. The leaf ops have their own table
// (test_cuda_leaf_ops.cpp); the MLA block's composite is checked in test_cuda_ops_mla.cpp. Inputs
// are fresh random bf16 values (seed printed; GLMTUNE_TEST_SEED reproduces a run) and the CPU
// reference runs in f32 on the same values. Parameter gradients accumulate into pre-filled buffers
// on both sides, so a path that overwrites instead of adding fails. Skipped (not failed) where no
// GPU is visible or CUDA is not built.

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "glmtune/ops/kda.h"
#include "glmtune/ops/mlp.h"
#include "glmtune/tensor/tensor.h"
#include "support/cuda_test_support.h"
#include "support/leaf_op_checks.h"

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

TEST(CudaDispatch, MlpForwardAndBackward) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  const int64_t T = 41, D = 64, I = 96;
  // Projections of std about 1.2, far below the clamp limit of 10: next to it, the GPU's bf16
  // product and the CPU's f32 product can fall on opposite sides and zero different gradients.
  // The clamps themselves are tested on identical values in test_cuda_ops_swiglu.
  const Pair x = draw({T, D}, 20), g = draw({I, D}, 21, 0.15), u = draw({I, D}, 22, 0.15),
             d = draw({D, I}, 23, 0.1), dy = draw({T, D}, 24);
  using ops::Linear;
  const ops::MlpParams pg{Linear(g.gpu), Linear(u.gpu), Linear(d.gpu)},
      pc{Linear(g.cpu), Linear(u.cpu), Linear(d.cpu)};
  ops::MlpContext cg, cc;
  const Tensor yg = ops::mlp_forward(pg, x.gpu, 10.0, cg);
  EXPECT_CLOSE(yg, ops::mlp_forward(pc, x.cpu, 10.0, cc), 2e-2, "y");
  EXPECT_CLOSE(ops::mlp_forward(pg, x.gpu, 10.0), yg, 0.0, "y without context");
  Pair gg = prefilled({I, D}, 25), gu = prefilled({I, D}, 26), gd = prefilled({D, I}, 27);
  ops::MlpParams grads_g{Linear(gg.gpu), Linear(gu.gpu), Linear(gd.gpu)},
      grads_c{Linear(gg.cpu), Linear(gu.cpu), Linear(gd.cpu)};
  EXPECT_CLOSE(ops::mlp_backward(pg, cg, dy.gpu, 10.0, grads_g),
               ops::mlp_backward(pc, cc, dy.cpu, 10.0, grads_c), 2e-2, "dx");
  EXPECT_CLOSE(grads_g.gate_proj.weight, grads_c.gate_proj.weight, 2e-2, "d gate_proj");
  EXPECT_CLOSE(grads_g.up_proj.weight, grads_c.up_proj.weight, 2e-2, "d up_proj");
  EXPECT_CLOSE(grads_g.down_proj.weight, grads_c.down_proj.weight, 1e-2, "d down_proj");
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
  using ops::Linear;
  const ops::KdaParams pg{Linear(q.gpu),  Linear(k.gpu),  Linear(v.gpu),  conv.gpu,
                          Linear(fa.gpu), Linear(fb.gpu), dt.gpu,         alog.gpu,
                          Linear(b.gpu),  Linear(ga.gpu), Linear(gb.gpu), on.gpu,
                          Linear(op.gpu)};
  const ops::KdaParams pc{Linear(q.cpu),  Linear(k.cpu),  Linear(v.cpu),  conv.cpu,
                          Linear(fa.cpu), Linear(fb.cpu), dt.cpu,         alog.cpu,
                          Linear(b.cpu),  Linear(ga.cpu), Linear(gb.cpu), on.cpu,
                          Linear(op.cpu)};
  const Pair x = param({T, D}, 1.0), dy = param({T, D}, 1.0);
  ops::KdaSaved sg, sc;
  EXPECT_CLOSE(ops::kda_forward(pg, x.gpu, cu, o, &sg), ops::kda_forward(pc, x.cpu, cu, o, &sc),
               2e-2, "y");
  ops::KdaGrads gg, gc;
  EXPECT_CLOSE(ops::kda_backward(pg, x.gpu, cu, o, &sg, dy.gpu, gg),
               ops::kda_backward(pc, x.cpu, cu, o, &sc, dy.cpu, gc), 3e-2, "dx");
  const std::pair<const char*, std::pair<Tensor*, Tensor*>> grads[] = {
      {"q_proj", {&gg.q_proj.weight, &gc.q_proj.weight}},
      {"k_proj", {&gg.k_proj.weight, &gc.k_proj.weight}},
      {"v_proj", {&gg.v_proj.weight, &gc.v_proj.weight}},
      {"conv1d", {&gg.conv1d, &gc.conv1d}},
      {"f_a_proj", {&gg.f_a_proj.weight, &gc.f_a_proj.weight}},
      {"f_b_proj", {&gg.f_b_proj.weight, &gc.f_b_proj.weight}},
      {"dt_bias", {&gg.dt_bias, &gc.dt_bias}},
      {"A_log", {&gg.A_log, &gc.A_log}},
      {"b_proj", {&gg.b_proj.weight, &gc.b_proj.weight}},
      {"g_a_proj", {&gg.g_a_proj.weight, &gc.g_a_proj.weight}},
      {"g_b_proj", {&gg.g_b_proj.weight, &gc.g_b_proj.weight}},
      {"o_norm", {&gg.o_norm, &gc.o_norm}},
      {"o_proj", {&gg.o_proj.weight, &gc.o_proj.weight}}};
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
  EXPECT_TRUE(bit_identical(recomputed.q_proj.weight, again.q_proj.weight));
#endif
}

// The leaf ops' checks made before dispatch (ops/checks.h) refuse the CPU test's bad calls on the
// GPU too, naming the op, before any kernel runs.
TEST(CudaDispatch, BadArgumentsAreRefusedBeforeDispatch) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  expect_refused(bad_leaf_calls(kGpu, DType::bf16, DType::f32));
#endif
}

}  // namespace

// CUDA parity for the clamped SwiGLU (ops/cuda/swiglu.h) against the CPU op (ops/mlp.h): forward
// and backward on values that cross the clamp limit (and sit exactly on it), the halves of a
// fused [N, 2I] buffer as row-strided views, the scalar path for odd widths, the exact gradient
// masks, and bit-identical reruns. Fresh random bf16 inputs (seed printed; GLMTUNE_TEST_SEED
// reproduces a run); the CPU reference runs in f32 on the same bf16 values; outputs are poisoned
// with NaN before every GPU call. Skipped (not failed) where no GPU is visible or CUDA is not
// built.

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "glmtune/ops/mlp.h"
#include "glmtune/tensor/tensor.h"
#include "support/cuda_test_support.h"
#ifdef GLMTUNE_WITH_CUDA
#include "glmtune/ops/cuda/swiglu.h"
#endif

using namespace glmtune;
using namespace glmtune::test;

namespace {

#ifdef GLMTUNE_WITH_CUDA
constexpr double kLimit = 10.0;  // swiglu_limit of GLM-5.3

// gate/up draws with std 6, so that a good share of them lies beyond ±10; every 17th value is
// set exactly to ±limit (the clamps' gradient is zero there, as in torch).
Tensor clamp_probe(const Shape& shape, uint64_t stream) {
  Tensor t = random_cpu(shape, DType::f32, stream, 6.0);
  float* p = t.data<float>();
  for (int64_t i = 0; i < t.numel(); i += 17) p[i] = (i / 17) % 2 ? float(kLimit) : -float(kLimit);
  return t.to(DType::bf16);
}

// Every position where the CPU gradient is exactly zero (a clamp blocked it) must be exactly zero
// on the GPU too, and the other way round: the masks are decided on identical bf16 values.
int64_t mask_mismatches(const Tensor& gpu, const Tensor& cpu) {
  const std::vector<double> g = gpu.to(Device::cpu()).to_doubles(), c = cpu.to_doubles();
  int64_t bad = 0;
  for (size_t i = 0; i < g.size(); ++i) bad += (g[i] == 0.0) != (c[i] == 0.0);
  return bad;
}

void check_case(int64_t rows, int64_t width, bool fused, uint64_t stream) {
  const std::string what = "rows=" + std::to_string(rows) + " I=" + std::to_string(width) +
                           (fused ? " fused halves" : " separate");
  Tensor gate_g, up_g, gate_c, up_c;
  if (fused) {
    // One [rows, 2I] buffer holding gate | up, as a fused gate_up projection writes it.
    const Tensor g = clamp_probe({rows, width}, stream), u = clamp_probe({rows, width}, stream + 1);
    Tensor both = Tensor::empty({rows, 2 * width}, DType::bf16);
    both.slice(1, 0, width).copy_(g);
    both.slice(1, width, 2 * width).copy_(u);
    const Tensor both_g = both.to(kGpu);
    gate_g = both_g.slice(1, 0, width);
    up_g = both_g.slice(1, width, 2 * width);
    gate_c = f32(g);
    up_c = f32(u);
  } else {
    const Tensor g = clamp_probe({rows, width}, stream), u = clamp_probe({rows, width}, stream + 1);
    gate_g = g.to(kGpu);
    up_g = u.to(kGpu);
    gate_c = f32(g);
    up_c = f32(u);
  }
  const Tensor ref = ops::swiglu_clamped(gate_c, up_c, kLimit);
  Tensor out = Tensor::empty({rows, width}, DType::bf16, kGpu);
  out.fill_(NAN);
  cuda::swiglu_clamped_out(out, gate_g, up_g, kLimit);
  EXPECT_CLOSE(out, ref, 1e-2, "forward " + what);
  Tensor out2 = Tensor::empty({rows, width}, DType::bf16, kGpu);
  out2.fill_(NAN);
  cuda::swiglu_clamped_out(out2, gate_g, up_g, kLimit);
  EXPECT_TRUE(bit_identical(out, out2)) << ctx("forward rerun " + what);

  const Tensor dout = random_cpu({rows, width}, DType::bf16, stream + 2);
  Tensor dg_ref, du_ref;
  ops::swiglu_clamped_backward(gate_c, up_c, f32(dout), kLimit, dg_ref, du_ref);
  Tensor dg, du, dboth;
  if (fused) {
    dboth = Tensor::empty({rows, 2 * width}, DType::bf16, kGpu);
    dboth.fill_(NAN);
    dg = dboth.slice(1, 0, width);
    du = dboth.slice(1, width, 2 * width);
  } else {
    dg = Tensor::empty({rows, width}, DType::bf16, kGpu);
    du = Tensor::empty({rows, width}, DType::bf16, kGpu);
    dg.fill_(NAN);
    du.fill_(NAN);
  }
  cuda::swiglu_clamped_backward(gate_g, up_g, dout.to(kGpu), kLimit, dg, du);
  EXPECT_CLOSE(dg, dg_ref, 1e-2, "dgate " + what);
  EXPECT_CLOSE(du, du_ref, 1e-2, "dup " + what);
  EXPECT_EQ(mask_mismatches(dg, dg_ref), 0) << ctx("dgate zero mask " + what);
  EXPECT_EQ(mask_mismatches(du, du_ref), 0) << ctx("dup zero mask " + what);
  // The probe really exercises the clamps: some gradients are blocked, most are not.
  int64_t blocked = 0;
  for (double v : dg_ref.to_doubles()) blocked += v == 0.0;
  EXPECT_GT(blocked, rows * width / 20) << "test inputs do not reach the clamp";
  EXPECT_LT(blocked, rows * width / 2);

  Tensor dg2 = Tensor::empty({rows, width}, DType::bf16, kGpu);
  Tensor du2 = Tensor::empty({rows, width}, DType::bf16, kGpu);
  dg2.fill_(NAN);
  du2.fill_(NAN);
  cuda::swiglu_clamped_backward(gate_g, up_g, dout.to(kGpu), kLimit, dg2, du2);
  EXPECT_TRUE(bit_identical(dg, dg2) && bit_identical(du, du2)) << ctx("backward rerun " + what);
}
#endif

}  // namespace

TEST(CudaOpsSwiglu, ContiguousMatchesCpu) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  check_case(300, 2048, false, 1);  // MoE expert width, 16-byte path
  check_case(37, 100, false, 11);   // odd width: scalar path
#endif
}

TEST(CudaOpsSwiglu, FusedHalvesMatchCpu) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  check_case(129, 1536, true, 21);  // row stride 3072: 16-byte path on strided views
  check_case(40, 36, true, 31);     // row stride 72 with width 36: scalar path
#endif
}

TEST(CudaOpsSwiglu, MismatchedShapesAreRejected) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  const Tensor g = Tensor::zeros({4, 16}, DType::bf16, kGpu);
  const Tensor u = Tensor::zeros({4, 8}, DType::bf16, kGpu);
  Tensor out = Tensor::empty({4, 16}, DType::bf16, kGpu);
  EXPECT_THROW(cuda::swiglu_clamped_out(out, g, u, kLimit), InternalError);
#endif
}

// CUDA parity for RMSNorm (ops/cuda/norm.h) against the CPU op (ops/norm.h): forward output and
// rstd, backward dx and the accumulated weight gradient (f32 and bf16), weighted and un-weighted,
// vectorised and scalar row lengths, row-strided views, recomputed vs saved rstd, and
// bit-identical reruns. Fresh random bf16 inputs (seed printed; GLMTUNE_TEST_SEED reproduces a
// run); the CPU reference runs in f32 on the same bf16 values; outputs are poisoned with NaN
// before every GPU call. Skipped (not failed) where no GPU is visible or CUDA is not built.

#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "glmtune/ops/norm.h"
#include "glmtune/tensor/tensor.h"
#include "support/cuda_test_support.h"
#ifdef GLMTUNE_WITH_CUDA
#include "glmtune/ops/cuda/norm.h"
#endif

using namespace glmtune;
using namespace glmtune::test;

namespace {

#ifdef GLMTUNE_WITH_CUDA
constexpr double kEps = 1e-5;

struct Case {
  int64_t rows, n;
  bool weighted;
  const char* what;
};
#endif

}  // namespace

TEST(CudaOpsNorm, RmsNormForwardAndBackwardMatchCpu) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  const Case cases[] = {{300, 4096, true, "hidden 4096, 16-byte path"},
                        {257, 1000, true, "n=1000, 16-byte path"},
                        {64, 100, true, "n=100, scalar path"},
                        {100, 512, false, "un-weighted"},
                        {48, 16384, true, "n=16384, dw accumulators over 48 KB of smem"}};
  uint64_t stream = 1;
  for (const Case& c : cases) {
    // Inputs with a non-zero mean and spread, so rows differ in scale.
    const Tensor x = random_cpu({c.rows, c.n}, DType::bf16, stream++, 0.3, 2.0);
    const Tensor w = c.weighted ? random_cpu({c.n}, DType::bf16, stream++, 1.0, 0.2) : Tensor();
    const Tensor dy = random_cpu({c.rows, c.n}, DType::bf16, stream++);
    const Tensor xg = x.to(kGpu), dyg = dy.to(kGpu);
    const Tensor wg = c.weighted ? w.to(kGpu) : Tensor();
    const Tensor wf = c.weighted ? f32(w) : Tensor();

    Tensor rstd_ref;
    const Tensor y_ref = ops::rms_norm(f32(x), wf, kEps, &rstd_ref);
    Tensor y = Tensor::empty(x.shape(), DType::bf16, kGpu);
    Tensor rstd = Tensor::empty({c.rows}, DType::f32, kGpu);
    y.fill_(NAN);
    rstd.fill_(NAN);
    cuda::rms_norm_out(y, &rstd, xg, wg, kEps);
    EXPECT_CLOSE(y, y_ref, 1e-2, std::string("y, ") + c.what);
    EXPECT_CLOSE(rstd, rstd_ref, 1e-5, std::string("rstd, ") + c.what);

    Tensor gw_ref;
    const Tensor dx_ref =
        ops::rms_norm_backward(f32(dy), f32(x), wf, kEps, Tensor(), c.weighted ? &gw_ref : nullptr);
    Tensor dx = Tensor::empty(x.shape(), DType::bf16, kGpu);
    dx.fill_(NAN);
    const Tensor gw0 = random_cpu({c.n}, DType::f32, stream++, 0.0, 5.0);
    Tensor gw = gw0.to(kGpu);
    cuda::rms_norm_backward_out(dx, dyg, xg, wg, kEps, rstd, c.weighted ? &gw : nullptr);
    EXPECT_CLOSE(dx, dx_ref, 1e-2, std::string("dx, ") + c.what);
    if (c.weighted) {
      EXPECT_CLOSE(minus(gw, gw0), gw_ref, 1e-4, std::string("dw f32, ") + c.what);
    }

    // Without the saved rstd the backward recomputes it with the forward's exact arithmetic.
    Tensor dx2 = Tensor::empty(x.shape(), DType::bf16, kGpu);
    dx2.fill_(NAN);
    Tensor gw2 = gw0.to(kGpu);
    cuda::rms_norm_backward_out(dx2, dyg, xg, wg, kEps, Tensor(), c.weighted ? &gw2 : nullptr);
    EXPECT_TRUE(bit_identical(dx, dx2)) << ctx(std::string("recomputed rstd, ") + c.what);
    if (c.weighted) {
      EXPECT_TRUE(bit_identical(gw, gw2)) << ctx(std::string("dw rerun, ") + c.what);
      // bf16 weight gradient.
      const Tensor gb0 = random_cpu({c.n}, DType::bf16, stream++, 0.0, 5.0);
      Tensor gb = gb0.to(kGpu);
      cuda::rms_norm_backward_out(dx2, dyg, xg, wg, kEps, rstd, &gb);
      Tensor want = f32(gb0);
      for (int64_t i = 0; i < c.n; ++i) want.data<float>()[i] += gw_ref.data<float>()[i];
      EXPECT_CLOSE(gb, want, 1e-2, std::string("dw bf16, ") + c.what);
    }

    // Forward rerun: same bits.
    Tensor y2 = Tensor::empty(x.shape(), DType::bf16, kGpu);
    y2.fill_(NAN);
    cuda::rms_norm_out(y2, nullptr, xg, wg, kEps);
    EXPECT_TRUE(bit_identical(y, y2)) << ctx(std::string("forward rerun, ") + c.what);
  }
#endif
}

TEST(CudaOpsNorm, RowStridedViews) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  // x, dy and the outputs are column windows of wider matrices (as the halves of a fused buffer).
  const int64_t rows = 96, n = 256, pad = 64;
  const Tensor xw = random_cpu({rows, n + pad}, DType::bf16, 51, 0.0, 1.5);
  const Tensor dyw = random_cpu({rows, n + pad}, DType::bf16, 52);
  const Tensor w = random_cpu({n}, DType::bf16, 53, 1.0, 0.1);
  const Tensor xg = xw.to(kGpu).slice(1, pad, pad + n), dyg = dyw.to(kGpu).slice(1, pad, pad + n);
  Tensor yw = Tensor::empty({rows, n + pad}, DType::bf16, kGpu);
  yw.fill_(NAN);
  Tensor y = yw.slice(1, 0, n);
  cuda::rms_norm_out(y, nullptr, xg, w.to(kGpu), kEps);
  const Tensor xc = f32(xw.slice(1, pad, pad + n).contiguous());
  EXPECT_CLOSE(y, ops::rms_norm(xc, f32(w), kEps), 1e-2, "strided forward");
  for (double v : yw.slice(1, n, n + pad).to(Device::cpu()).to_doubles())
    ASSERT_TRUE(std::isnan(v)) << "RMSNorm wrote outside its output view";
  Tensor dxw = Tensor::empty({rows, n + pad}, DType::bf16, kGpu);
  dxw.fill_(NAN);
  Tensor dx = dxw.slice(1, pad, pad + n);
  Tensor gw;
  cuda::rms_norm_backward_out(dx, dyg, xg, w.to(kGpu), kEps, Tensor(), &gw);
  Tensor gw_ref;
  const Tensor dx_ref = ops::rms_norm_backward(f32(dyw.slice(1, pad, pad + n).contiguous()), xc,
                                               f32(w), kEps, Tensor(), &gw_ref);
  EXPECT_CLOSE(dx, dx_ref, 1e-2, "strided dx");
  EXPECT_EQ(gw.dtype(), DType::f32);
  EXPECT_CLOSE(gw, gw_ref, 1e-4, "strided dw (created as f32 zeros)");
#endif
}

TEST(CudaOpsNorm, BadArgumentsAreRejected) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  const Tensor x = Tensor::zeros({4, 64}, DType::bf16, kGpu);
  const Tensor w = Tensor::zeros({32}, DType::bf16, kGpu);
  Tensor y = Tensor::empty({4, 64}, DType::bf16, kGpu);
  EXPECT_THROW(cuda::rms_norm_out(y, nullptr, x, w, kEps), InternalError);
  const Tensor xf = Tensor::zeros({4, 64}, DType::f32, kGpu);
  EXPECT_THROW(cuda::rms_norm_out(y, nullptr, xf, Tensor(), kEps), InternalError);
#endif
}

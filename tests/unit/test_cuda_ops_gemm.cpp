// CUDA parity for the dense GEMMs (ops/cuda/gemm.h) against the CPU linear op (ops/linear.h):
// forward with and without bias into bf16 and f32 outputs, accumulation, row-strided views,
// unaligned rows, both backward GEMMs and the bias gradient, strided batches, and bit-identical
// reruns. Inputs are fresh random bf16 values (seed printed; GLMTUNE_TEST_SEED reproduces a run);
// the CPU reference runs in f32 on the same bf16 values. Outputs are poisoned with NaN before every
// GPU call, so an unwritten element fails. Skipped (not failed) where no GPU is visible or CUDA is
// not built.

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "glmtune/ops/linear.h"
#include "glmtune/tensor/tensor.h"
#include "support/cuda_test_support.h"
#ifdef GLMTUNE_WITH_CUDA
#include "glmtune/ops/cuda/gemm.h"
#endif

using namespace glmtune;
using namespace glmtune::test;

namespace {

#ifdef GLMTUNE_WITH_CUDA
struct Case {
  int64_t m, n, k;
};

double tolerance(DType out) { return out == DType::f32 ? 1e-4 : 1e-2; }
#endif

}  // namespace

TEST(CudaOpsGemm, ForwardMatchesCpu) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  // Shapes: model-like, odd row counts, and K = 100 (200-byte rows: 8-byte aligned only).
  const Case cases[] = {{1000, 768, 512}, {257, 136, 264}, {33, 96, 100}};
  uint64_t stream = 1;
  for (const Case& c : cases) {
    const Tensor x = random_cpu({c.m, c.k}, DType::bf16, stream++);
    const Tensor w = random_cpu({c.n, c.k}, DType::bf16, stream++, 1.0 / std::sqrt(double(c.k)));
    const Tensor b = random_cpu({c.n}, DType::bf16, stream++);
    const Tensor xg = x.to(kGpu), wg = w.to(kGpu), bg = b.to(kGpu);
    for (bool with_bias : {false, true}) {
      const Tensor ref = ops::linear(f32(x), f32(w), with_bias ? f32(b) : Tensor());
      for (DType out : {DType::bf16, DType::f32}) {
        Tensor y = Tensor::empty({c.m, c.n}, out, kGpu);
        y.fill_(NAN);
        cuda::linear_out(y, xg, wg, with_bias ? bg : Tensor());
        const std::string what =
            "m=" + std::to_string(c.m) + " n=" + std::to_string(c.n) + " k=" + std::to_string(c.k) +
            " bias=" + std::to_string(with_bias) + " out=" + std::string(dtype_name(out));
        EXPECT_CLOSE(y, ref, tolerance(out), what);
        // Rerun into a freshly poisoned buffer: the same bits.
        Tensor y2 = Tensor::empty({c.m, c.n}, out, kGpu);
        y2.fill_(NAN);
        cuda::linear_out(y2, xg, wg, with_bias ? bg : Tensor());
        EXPECT_TRUE(bit_identical(y, y2)) << ctx("rerun differs: " + what);
      }
    }
  }
#endif
}

TEST(CudaOpsGemm, ForwardAccumulatesAndBiasIsConverted) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  const int64_t m = 300, n = 200, k = 256;
  const Tensor x = random_cpu({m, k}, DType::bf16, 11);
  const Tensor w = random_cpu({n, k}, DType::bf16, 12, 0.0625);
  const Tensor b = random_cpu({n}, DType::bf16, 13);
  const Tensor y0 = random_cpu({m, n}, DType::f32, 14);
  // f32 output with a bf16 bias (converted inside), accumulated onto y0.
  Tensor y = y0.to(kGpu);
  cuda::linear_out(y, x.to(kGpu), w.to(kGpu), b.to(kGpu), /*accumulate=*/true);
  const Tensor ref = ops::linear(f32(x), f32(w));
  // want = y0 + x w^T + b
  Tensor want = y0.clone();
  {
    float* wp = want.data<float>();
    const float* rp = ref.data<float>();
    const Tensor bf = f32(b);
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) wp[i * n + j] += rp[i * n + j] + bf.data<float>()[j];
  }
  EXPECT_CLOSE(y, want, 1e-4, "accumulate with converted bias");
  // The allocating form picks the output dtype.
  const Tensor yb = cuda::linear(x.to(kGpu), w.to(kGpu), Tensor(), DType::bf16);
  EXPECT_EQ(yb.dtype(), DType::bf16);
  EXPECT_CLOSE(yb, ref, 1e-2, "cuda::linear");
#endif
}

TEST(CudaOpsGemm, RowStridedViewsWorkInPlace) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  // x is the left part of a wider matrix, y the right part of another: both are row-strided.
  const int64_t m = 129, n = 64, k = 128;
  const Tensor xw = random_cpu({m, k + 40}, DType::bf16, 21);
  const Tensor w = random_cpu({n, k}, DType::bf16, 22, 0.1);
  const Tensor xg_wide = xw.to(kGpu);
  const Tensor xg = xg_wide.slice(1, 0, k);
  Tensor yw = Tensor::empty({m, n + 24}, DType::bf16, kGpu);
  yw.fill_(NAN);
  Tensor y = yw.slice(1, 24, 24 + n);
  cuda::linear_out(y, xg, w.to(kGpu));
  const Tensor ref = ops::linear(f32(xw.slice(1, 0, k).contiguous()), f32(w));
  EXPECT_CLOSE(y, ref, 1e-2, "strided views");
  // The columns outside the view are untouched (still NaN).
  const std::vector<double> left = yw.slice(1, 0, 24).to(Device::cpu()).to_doubles();
  for (double v : left) ASSERT_TRUE(std::isnan(v)) << "GEMM wrote outside its output view";
#endif
}

TEST(CudaOpsGemm, BackwardMatchesCpu) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  const Case cases[] = {{1000, 768, 512}, {77, 136, 200}, {40, 24, 100}};
  uint64_t stream = 31;
  for (const Case& c : cases) {
    const std::string shape =
        "m=" + std::to_string(c.m) + " n=" + std::to_string(c.n) + " k=" + std::to_string(c.k);
    const Tensor x = random_cpu({c.m, c.k}, DType::bf16, stream++);
    const Tensor w = random_cpu({c.n, c.k}, DType::bf16, stream++, 0.05);
    const Tensor dy = random_cpu({c.m, c.n}, DType::bf16, stream++);
    Tensor gw_ref, gb_ref;
    const Tensor dx_ref = ops::linear_backward(f32(dy), f32(x), f32(w), &gw_ref, &gb_ref);
    const Tensor xg = x.to(kGpu), wg = w.to(kGpu), dyg = dy.to(kGpu);

    for (DType out : {DType::bf16, DType::f32}) {
      Tensor dx = Tensor::empty({c.m, c.k}, out, kGpu);
      dx.fill_(NAN);
      cuda::linear_backward_input_out(dx, dyg, wg);
      EXPECT_CLOSE(dx, dx_ref, tolerance(out),
                   "dx " + shape + " out=" + std::string(dtype_name(out)));
    }

    // dW accumulates onto a random start of the gradient's own scale; compare the increment.
    const double gw_scale = std::sqrt(double(c.m));
    const Tensor dw0 = random_cpu({c.n, c.k}, DType::f32, stream++, gw_scale);
    Tensor dw = dw0.to(kGpu);
    cuda::linear_backward_weight(dw, dyg, xg);
    Tensor delta = f32(dw);
    {
      float* d = delta.data<float>();
      const float* z = dw0.data<float>();
      for (int64_t i = 0; i < delta.numel(); ++i) d[i] -= z[i];
    }
    EXPECT_CLOSE(delta, gw_ref, 1e-4, "dW f32 " + shape);
    Tensor dw_again = dw0.to(kGpu);
    cuda::linear_backward_weight(dw_again, dyg, xg);
    EXPECT_TRUE(bit_identical(dw, dw_again)) << ctx("dW rerun differs " + shape);

    // bf16 gradient: fp32 accumulation inside, one rounding of start + product.
    const Tensor dwb0 = random_cpu({c.n, c.k}, DType::bf16, stream++, gw_scale);
    Tensor dwb = dwb0.to(kGpu);
    cuda::linear_backward_weight(dwb, dyg, xg);
    Tensor want = f32(dwb0);
    {
      float* d = want.data<float>();
      const float* g = gw_ref.data<float>();
      for (int64_t i = 0; i < want.numel(); ++i) d[i] += g[i];
    }
    EXPECT_CLOSE(dwb, want, 1e-2, "dW bf16 " + shape);

    // Bias gradient: column sums, accumulated, deterministic.
    const Tensor db0 = random_cpu({c.n}, DType::f32, stream++, gw_scale);
    Tensor db = db0.to(kGpu);
    cuda::linear_backward_bias(db, dyg);
    Tensor dbd = f32(db);
    for (int64_t i = 0; i < c.n; ++i) dbd.data<float>()[i] -= db0.data<float>()[i];
    EXPECT_CLOSE(dbd, gb_ref, 1e-5, "db " + shape);
    Tensor db_again = db0.to(kGpu);
    cuda::linear_backward_bias(db_again, dyg);
    EXPECT_TRUE(bit_identical(db, db_again)) << ctx("db rerun differs " + shape);
  }
#endif
}

// The fp32 mode: f32 operands with full 24-bit mantissas. TF32 (10-bit mantissas) would land near
// 1e-3 from the f32 reference; plain fp32 stays within about 1e-6, so the 1e-5 bar tells them
// apart.
TEST(CudaOpsGemm, Fp32OperandsMatchCpuWithoutTf32) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  const Case cases[] = {{1000, 768, 512}, {77, 136, 200}, {33, 96, 100}};
  uint64_t stream = 71;
  for (const Case& c : cases) {
    const std::string shape =
        "m=" + std::to_string(c.m) + " n=" + std::to_string(c.n) + " k=" + std::to_string(c.k);
    const Tensor x = random_cpu({c.m, c.k}, DType::f32, stream++);
    const Tensor w = random_cpu({c.n, c.k}, DType::f32, stream++, 1.0 / std::sqrt(double(c.k)));
    const Tensor b = random_cpu({c.n}, DType::f32, stream++);
    const Tensor dy = random_cpu({c.m, c.n}, DType::f32, stream++);
    const Tensor xg = x.to(kGpu), wg = w.to(kGpu), dyg = dy.to(kGpu);

    const Tensor y = cuda::linear(xg, wg, b.to(kGpu));
    EXPECT_EQ(y.dtype(), DType::f32) << shape;
    EXPECT_CLOSE(y, ops::linear(x, w, b), 1e-5, "f32 forward " + shape);

    Tensor gw_ref, gb_ref;
    const Tensor dx_ref = ops::linear_backward(dy, x, w, &gw_ref, &gb_ref);
    const Tensor dx = cuda::linear_backward_input(dyg, wg);
    EXPECT_EQ(dx.dtype(), DType::f32) << shape;
    EXPECT_CLOSE(dx, dx_ref, 1e-5, "f32 dx " + shape);
    Tensor dw = Tensor::zeros({c.n, c.k}, DType::f32, kGpu);
    cuda::linear_backward_weight(dw, dyg, xg);
    EXPECT_CLOSE(dw, gw_ref, 1e-5, "f32 dW " + shape);
    Tensor db = Tensor::zeros({c.n}, DType::f32, kGpu);
    cuda::linear_backward_bias(db, dyg);
    EXPECT_CLOSE(db, gb_ref, 1e-5, "f32 db " + shape);
  }
#endif
}

// A strided batch as the absorbed MLA uses it: head h's operands are the h-th column slices of
// head-interleaved [T, H·D] tensors and the h-th row block of a stacked weight, in one launch.
// Each product is checked against a float64 product of the same bf16 values; the C elements
// outside every product (the stacked gradient's rows between the heads' blocks) stay untouched.
TEST(CudaOpsGemm, StridedBatchesMatchOneProductEach) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  const int64_t t = 301, heads = 5, d = 48, r = 64, block = 2 * d;  // block: a head's weight rows
  const Tensor a = random_cpu({t, heads * d}, DType::bf16, 91);
  const Tensor w = random_cpu({heads * block, r}, DType::bf16, 92, 0.125);
  const Tensor lat = random_cpu({t, heads * r}, DType::bf16, 93);
  const std::vector<double> av = a.to_doubles(), wv = w.to_doubles(), lv = lat.to_doubles();
  const Tensor ag = a.to(kGpu), wg = w.to(kGpu), lg = lat.to(kGpu);

  // absorb: c[:, h] = a[:, h] · W[h] ([T, D] · [D, R]), W[h] = rows h·block .. + D of w.
  Tensor c = Tensor::empty({t, heads * r}, DType::bf16, kGpu);
  c.fill_(NAN);
  cuda::gemm({.m = t,
              .n = r,
              .k = d,
              .a = ag.data_ptr(),
              .lda = heads * d,
              .b = wg.data_ptr(),
              .ldb = r,
              .c = c.data_ptr(),
              .ldc = heads * r,
              .batch = heads,
              .stride_a = d,
              .stride_b = block * r,
              .stride_c = r});
  std::vector<double> want(size_t(t * heads * r));
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t i = 0; i < t; ++i)
      for (int64_t j = 0; j < r; ++j) {
        double acc = 0;
        for (int64_t q = 0; q < d; ++q)
          acc += av[size_t(i * heads * d + h * d + q)] * wv[size_t((h * block + q) * r + j)];
        want[size_t(i * heads * r + h * r + j)] = acc;
      }
  EXPECT_CLOSE(c.to(Device::cpu()).to_doubles(), want, 1e-2, "batched absorb (bf16 out)");

  // expand: e[:, h] = lat[:, h] · W[h]ᵀ ([T, R] · [R, D]), into f32.
  Tensor e = Tensor::empty({t, heads * d}, DType::f32, kGpu);
  e.fill_(NAN);
  cuda::gemm({.trans_b = true,
              .m = t,
              .n = d,
              .k = r,
              .a = lg.data_ptr(),
              .lda = heads * r,
              .b = wg.data_ptr(),
              .ldb = r,
              .c = e.data_ptr(),
              .ldc = heads * d,
              .c_dtype = DType::f32,
              .batch = heads,
              .stride_a = r,
              .stride_b = block * r,
              .stride_c = d});
  want.assign(size_t(t * heads * d), 0.0);
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t i = 0; i < t; ++i)
      for (int64_t j = 0; j < d; ++j) {
        double acc = 0;
        for (int64_t q = 0; q < r; ++q)
          acc += lv[size_t(i * heads * r + h * r + q)] * wv[size_t((h * block + j) * r + q)];
        want[size_t(i * heads * d + h * d + j)] = acc;
      }
  EXPECT_CLOSE(e.to(Device::cpu()).to_doubles(), want, 1e-5, "batched expand (f32 out)");

  // grad: g[h] += a[:, h]ᵀ · lat[:, h] ([D, T] · [T, R]) into rows h·block .. + D of an f32
  // buffer that starts from a pattern; the other D rows of each block keep it.
  const Tensor g0 = random_cpu({heads * block, r}, DType::f32, 94);
  Tensor g = g0.to(kGpu);
  cuda::gemm({.trans_a = true,
              .m = d,
              .n = r,
              .k = t,
              .a = ag.data_ptr(),
              .lda = heads * d,
              .b = lg.data_ptr(),
              .ldb = heads * r,
              .c = g.data_ptr(),
              .ldc = r,
              .c_dtype = DType::f32,
              .beta = 1.0f,
              .batch = heads,
              .stride_a = d,
              .stride_b = r,
              .stride_c = block * r});
  want = g0.to_doubles();
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t q = 0; q < d; ++q)
      for (int64_t j = 0; j < r; ++j) {
        double acc = 0;
        for (int64_t i = 0; i < t; ++i)
          acc += av[size_t(i * heads * d + h * d + q)] * lv[size_t(i * heads * r + h * r + j)];
        want[size_t((h * block + q) * r + j)] += acc;
      }
  const std::vector<double> got = g.to(Device::cpu()).to_doubles(), start = g0.to_doubles();
  EXPECT_CLOSE(got, want, 1e-5, "batched weight gradient (f32 +=)");
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t q = d; q < block; ++q)
      for (int64_t j = 0; j < r; ++j) {
        const size_t idx = size_t((h * block + q) * r + j);
        ASSERT_EQ(got[idx], start[idx])
            << "the batch wrote outside its products (head " << h << ", row " << q << ")";
      }
#endif
}

TEST(CudaOpsGemm, AlgorithmsAreCachedPerProblem) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  const Tensor x = random_cpu({64, 128}, DType::bf16, 41).to(kGpu);
  const Tensor w = random_cpu({96, 128}, DType::bf16, 42).to(kGpu);
  Tensor y = Tensor::empty({64, 96}, DType::f32, kGpu);
  cuda::linear_out(y, x, w);
  const int64_t queries = cuda::gemm_heuristic_queries();
  for (int i = 0; i < 5; ++i) cuda::linear_out(y, x, w);
  EXPECT_EQ(cuda::gemm_heuristic_queries(), queries) << "the same problem queried the heuristic";
#endif
}

TEST(CudaOpsGemm, MismatchedShapesAreRejected) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  const Tensor x = Tensor::zeros({4, 16}, DType::bf16, kGpu);
  const Tensor w = Tensor::zeros({8, 24}, DType::bf16, kGpu);
  Tensor y = Tensor::empty({4, 8}, DType::bf16, kGpu);
  EXPECT_THROW(cuda::linear_out(y, x, w), InternalError);
  const Tensor xf = Tensor::zeros({4, 24}, DType::f32, kGpu);
  EXPECT_THROW(cuda::linear_out(y, xf, w), InternalError);
#endif
}

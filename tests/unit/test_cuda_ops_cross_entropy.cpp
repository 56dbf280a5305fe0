// CUDA parity for the fused, chunked LM head + cross-entropy (ops/cuda/cross_entropy.h) against
// the CPU op (ops/cross_entropy.h): loss, dhidden and the accumulated dweight with ignored rows,
// an external denominator and a gradient scale, chunks that split the rows unevenly, vocabularies
// on each of the row kernels' paths (a row read once by a cluster of blocks on Hopper, up to
// 163,840 with the released 154,880; two passes in 16-byte loads past that; the scalar path),
// contiguous and scattered label rows, the all-ignored case, forward-only calls, label errors and
// bit-identical reruns. Fresh random bf16 inputs (seed printed; GLMTUNE_TEST_SEED reproduces a
// run); the CPU reference runs in f32 on the same bf16 values; dhidden is poisoned with NaN before
// every GPU call. Skipped (not failed) where no GPU is visible or CUDA is not built.

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "glmtune/ops/cross_entropy.h"
#include "glmtune/ops/linear.h"
#include "glmtune/tensor/tensor.h"
#include "support/cuda_test_support.h"
#ifdef GLMTUNE_WITH_CUDA
#include "glmtune/ops/cuda/cross_entropy.h"
#endif

using namespace glmtune;
using namespace glmtune::test;

namespace {

// Labels: a share of −100 rows (in runs, as prompts are in SFT packs), the rest uniform ids.
Tensor make_labels(int64_t rows, int64_t vocab, double ignored_share, uint64_t stream) {
  std::mt19937_64 gen = seeded_engine(stream);
  std::vector<int64_t> lab(static_cast<size_t>(rows));
  bool ignoring = false;
  for (auto& v : lab) {
    // Switch between ignored and trained runs with probability 1/8 per row.
    if (gen() % 8 == 0) ignoring = double(gen() % 1000) / 1000.0 < ignored_share;
    v = ignoring ? ops::kIgnoreIndex : int64_t(gen() % uint64_t(vocab));
  }
  return Tensor::from_vector(lab, {rows});
}

#ifdef GLMTUNE_WITH_CUDA
struct Case {
  int64_t rows, dim, vocab;
  double ignored_share;
  ops::CrossEntropyOptions opts;
  DType dhidden_dtype, dweight_dtype;
  const char* what;
};

void check_case(const Case& c, uint64_t stream) {
  const std::string what = std::string(c.what) + " T=" + std::to_string(c.rows) +
                           " D=" + std::to_string(c.dim) + " V=" + std::to_string(c.vocab);
  // Logits of order one: hidden ~ N(0, 1), weight ~ N(0, 1/D) scaled up a little.
  const Tensor hidden = random_cpu({c.rows, c.dim}, DType::bf16, stream, 1.0);
  const Tensor weight =
      random_cpu({c.vocab, c.dim}, DType::bf16, stream + 1, 2.0 / std::sqrt(double(c.dim)));
  const Tensor labels = make_labels(c.rows, c.vocab, c.ignored_share, stream + 2);

  Tensor dh_ref, dw_ref;
  const ops::CrossEntropyResult ref =
      ops::lm_head_cross_entropy(f32(hidden), f32(weight), labels, c.opts, &dh_ref, &dw_ref);

  const Tensor hg = hidden.to(kGpu), wg = weight.to(kGpu);
  // dweight accumulates onto a random start of the increment's own scale (a much larger start
  // would swamp a bf16 gradient's increment in rounding).
  double sq = 0;
  for (double v : dw_ref.to_doubles()) sq += v * v;
  const double rms = std::sqrt(sq / double(dw_ref.numel()));
  const Tensor dw0 = random_cpu({c.vocab, c.dim}, c.dweight_dtype, stream + 3, rms);
  Tensor dh = Tensor::empty({c.rows, c.dim}, c.dhidden_dtype, kGpu);
  dh.fill_(NAN);
  Tensor dw = dw0.to(kGpu);
  const ops::CrossEntropyResult got = cuda::lm_head_cross_entropy(hg, wg, labels, c.opts, &dh, &dw);

  EXPECT_EQ(got.n_tokens, ref.n_tokens) << ctx(what);
  EXPECT_EQ(got.denominator, ref.denominator) << ctx(what);
  std::printf("[ measure  ] loss %s: %.9g, CPU %.9g\n", what.c_str(), got.loss, ref.loss);
  EXPECT_NEAR(got.loss, ref.loss, 1e-4 * std::abs(ref.loss)) << ctx("loss " + what);
  EXPECT_NEAR(got.loss_sum, ref.loss_sum, 1e-4 * std::abs(ref.loss_sum)) << ctx("loss sum " + what);
  EXPECT_CLOSE(dh, dh_ref, 1e-2, "dhidden " + what);
  if (c.dweight_dtype == DType::f32) {
    EXPECT_CLOSE(minus(dw, dw0), dw_ref, 1e-2, "dweight increment " + what);
  } else {
    Tensor want = f32(dw0);
    for (int64_t i = 0; i < want.numel(); ++i) want.data<float>()[i] += dw_ref.data<float>()[i];
    EXPECT_CLOSE(dw, want, 1e-2, "bf16 dweight " + what);
  }
  // Ignored rows get exactly zero.
  const Tensor lab = labels.to(DType::i64);
  const Tensor dhc = f32(dh);
  for (int64_t r = 0; r < c.rows; ++r) {
    if (lab.data<int64_t>()[r] != ops::kIgnoreIndex) continue;
    for (int64_t j = 0; j < c.dim; ++j)
      ASSERT_EQ(dhc.data<float>()[r * c.dim + j], 0.0f) << ctx("ignored row " + std::to_string(r));
  }

  // Rerun from the same start: the same loss bits and gradient bits.
  Tensor dh2 = Tensor::empty({c.rows, c.dim}, c.dhidden_dtype, kGpu);
  dh2.fill_(NAN);
  Tensor dw2 = dw0.to(kGpu);
  const ops::CrossEntropyResult again =
      cuda::lm_head_cross_entropy(hg, wg, labels.to(kGpu), c.opts, &dh2, &dw2);
  EXPECT_EQ(again.loss_sum, got.loss_sum) << ctx("loss rerun " + what);
  EXPECT_TRUE(bit_identical(dh, dh2)) << ctx("dhidden rerun " + what);
  EXPECT_TRUE(bit_identical(dw, dw2)) << ctx("dweight rerun " + what);

  // Forward only: the same loss as the fused call.
  const ops::CrossEntropyResult fwd = cuda::lm_head_cross_entropy(hg, wg, labels, c.opts);
  EXPECT_EQ(fwd.loss_sum, got.loss_sum) << ctx("forward-only loss " + what);
}
#endif

}  // namespace

TEST(CudaOpsCrossEntropy, MatchesCpuWithIgnoredRows) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  ops::CrossEntropyOptions opts;
  opts.chunk_rows = 64;  // several chunks, the last one partial
  check_case({300, 256, 4096, 0.4, opts, DType::bf16, DType::f32, "scattered rows"}, 1);
#endif
}

TEST(CudaOpsCrossEntropy, ExternalDenominatorScaleAndOddVocab) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  ops::CrossEntropyOptions opts;
  opts.chunk_rows = 80;
  opts.denominator = 1234.5;
  opts.grad_scale = 0.1;
  // No ignored rows: every chunk is one contiguous run (the in-place GEMM path); V odd: the
  // scalar path and 4-byte aligned gradient rows.
  check_case({200, 136, 5003, 0.0, opts, DType::f32, DType::bf16, "scalar path, contiguous rows"},
             11);
  opts.chunk_rows = 1000;  // one chunk larger than the rows
  check_case({150, 64, 1000, 0.3, opts, DType::f32, DType::f32, "single chunk, f32 dhidden"}, 21);
#endif
}

TEST(CudaOpsCrossEntropy, ReleasedVocabularyAndOnePastTheClusterRows) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  ops::CrossEntropyOptions opts;
  opts.chunk_rows = 24;
  // At the released vocabulary the cluster kernel's threads hold nine or ten float4s each; four
  // logits more than its 163,840 take the two-pass 16-byte kernel.
  check_case({40, 64, 154880, 0.2, opts, DType::bf16, DType::f32, "released vocabulary"}, 31);
  check_case({30, 64, 163844, 0.2, opts, DType::bf16, DType::f32, "past the cluster's rows"}, 41);
#endif
}

TEST(CudaOpsCrossEntropy, AllIgnoredGivesZeros) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  const int64_t rows = 40, dim = 32, vocab = 100;
  const Tensor hidden = random_cpu({rows, dim}, DType::bf16, 31).to(kGpu);
  const Tensor weight = random_cpu({vocab, dim}, DType::bf16, 32).to(kGpu);
  const Tensor labels = Tensor::full({rows}, double(ops::kIgnoreIndex), DType::i32);
  Tensor dh = Tensor::empty({rows, dim}, DType::bf16, kGpu);
  dh.fill_(NAN);
  const Tensor dw0 = random_cpu({vocab, dim}, DType::f32, 33);
  Tensor dw = dw0.to(kGpu);
  const ops::CrossEntropyResult r =
      cuda::lm_head_cross_entropy(hidden, weight, labels, ops::CrossEntropyOptions{}, &dh, &dw);
  EXPECT_EQ(r.loss, 0.0);
  EXPECT_EQ(r.n_tokens, 0);
  for (double v : dh.to_doubles()) ASSERT_EQ(v, 0.0);
  EXPECT_TRUE(bit_identical(dw, dw0));
#endif
}

TEST(CudaOpsCrossEntropy, BadLabelIsAnError) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  const Tensor hidden = random_cpu({4, 16}, DType::bf16, 41).to(kGpu);
  const Tensor weight = random_cpu({10, 16}, DType::bf16, 42).to(kGpu);
  const Tensor labels = Tensor::from_vector(std::vector<int32_t>{1, -100, 10, 2}, {4});
  try {
    cuda::lm_head_cross_entropy(hidden, weight, labels, ops::CrossEntropyOptions{});
    FAIL() << "label 10 of a 10-token vocabulary was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("label 10 of row 2"), std::string::npos) << e.what();
  }
#endif
}

// The weight gradient of the trailing columns only (CrossEntropyOptions::weight_grad_col0, what
// the head's adapter asks for): [V, D − c0], added to the buffer, against the CPU op's, with the
// loss and dhidden of the whole call; then the head with an adapter through the dispatching
// composite (ops/composite/lm_head.cpp) against the CPU on the same bf16 values.
TEST(CudaOpsCrossEntropy, TrailingColumnsOfTheWeightGradientMatchCpu) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  const int64_t rows = 260, dim = 272, vocab = 3000, c0 = 256;
  const Tensor hidden = random_cpu({rows, dim}, DType::bf16, 51, 1.0);
  const Tensor weight = random_cpu({vocab, dim}, DType::bf16, 52, 2.0 / std::sqrt(double(dim)));
  const Tensor labels = make_labels(rows, vocab, 0.3, 53);
  ops::CrossEntropyOptions opts;
  opts.chunk_rows = 96;
  opts.weight_grad_col0 = c0;
  Tensor dh_ref, dw_ref;
  const ops::CrossEntropyResult ref =
      ops::lm_head_cross_entropy(f32(hidden), f32(weight), labels, opts, &dh_ref, &dw_ref);
  ASSERT_EQ(dw_ref.shape(), (Shape{vocab, dim - c0}));
  double sq = 0;
  for (double v : dw_ref.to_doubles()) sq += v * v;
  const Tensor dw0 =
      random_cpu({vocab, dim - c0}, DType::f32, 54, std::sqrt(sq / double(dw_ref.numel())));
  const Tensor hg = hidden.to(kGpu), wg = weight.to(kGpu);
  Tensor dh = Tensor::empty({rows, dim}, DType::f32, kGpu);
  dh.fill_(NAN);
  Tensor dw = dw0.to(kGpu);
  const ops::CrossEntropyResult got = cuda::lm_head_cross_entropy(hg, wg, labels, opts, &dh, &dw);
  EXPECT_NEAR(got.loss, ref.loss, 1e-4 * std::abs(ref.loss));
  EXPECT_CLOSE(dh, dh_ref, 1e-2, "dhidden");
  EXPECT_CLOSE(minus(dw, dw0), dw_ref, 1e-2, "trailing dweight increment");
  // A buffer of the whole weight's shape is refused.
  Tensor whole = Tensor::zeros({vocab, dim}, DType::f32, kGpu);
  EXPECT_ANY_THROW(cuda::lm_head_cross_entropy(hg, wg, labels, opts, nullptr, &whole));
  // Through the dispatcher: an undefined buffer becomes [V, D − c0].
  Tensor fresh;
  ops::lm_head_cross_entropy(hg, wg, labels, opts, nullptr, &fresh);
  EXPECT_EQ(fresh.shape(), (Shape{vocab, dim - c0}));
  EXPECT_CLOSE(fresh, dw_ref, 1e-2, "dispatched trailing dweight");

  // The head with an adapter of rank 16 (weight frozen, as under LoRA).
  const int64_t r = 16;
  ops::Linear head_cpu(f32(weight).set_frozen(true));
  head_cpu.lora.A = f32(random_cpu({r, dim}, DType::bf16, 55, 1.0 / std::sqrt(double(dim))));
  head_cpu.lora.B = f32(random_cpu({vocab, r}, DType::bf16, 56, 0.05));
  head_cpu.lora.scale = 2.0;
  ops::Linear head_gpu(weight.to(kGpu).set_frozen(true));
  head_gpu.lora.A = head_cpu.lora.A.to(DType::bf16).to(kGpu);
  head_gpu.lora.B = head_cpu.lora.B.to(DType::bf16).to(kGpu);
  head_gpu.lora.scale = 2.0;
  ops::CrossEntropyOptions plain;
  plain.chunk_rows = 96;
  ops::Linear g_cpu, g_gpu;
  Tensor dhc, dhg;
  const ops::CrossEntropyResult lc =
      ops::lm_head_cross_entropy(f32(hidden), head_cpu, labels, plain, &dhc, &g_cpu);
  const ops::CrossEntropyResult lg =
      ops::lm_head_cross_entropy(hg, head_gpu, labels, plain, &dhg, &g_gpu);
  EXPECT_NEAR(lg.loss, lc.loss, 1e-3 * std::abs(lc.loss));
  EXPECT_FALSE(g_gpu.weight.defined());
  EXPECT_CLOSE(dhg, dhc, 2e-2, "adapted head dhidden");
  EXPECT_CLOSE(g_gpu.lora.A, g_cpu.lora.A, 2e-2, "adapted head dA");
  EXPECT_CLOSE(g_gpu.lora.B, g_cpu.lora.B, 2e-2, "adapted head dB");
#endif
}

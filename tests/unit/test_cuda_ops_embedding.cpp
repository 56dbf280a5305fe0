// CUDA parity for the token embedding (ops/cuda/embedding.h) against the CPU op
// (ops/embedding.h): the gather is exact; the deterministic scatter-add matches the CPU sums,
// skips the padding row, leaves untouched rows alone and reruns bit-identically, also with hot
// rows that hold hundreds of tokens. Bad ids are errors. Fresh random inputs (seed printed;
// GLMTUNE_TEST_SEED reproduces a run); outputs are poisoned with NaN before every GPU call.
// Skipped (not failed) where no GPU is visible or CUDA is not built.

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "glmtune/ops/embedding.h"
#include "glmtune/tensor/tensor.h"
#include "support/cuda_test_support.h"
#ifdef GLMTUNE_WITH_CUDA
#include "glmtune/ops/cuda/embedding.h"
#endif

using namespace glmtune;
using namespace glmtune::test;

namespace {

// Token ids: half from a handful of hot rows (hundreds of tokens each), half spread over the
// vocabulary, and the padding id sprinkled in.
Tensor make_ids(int64_t n, int64_t vocab, int64_t padding, uint64_t stream, DType dtype) {
  std::mt19937_64 gen = seeded_engine(stream);
  std::vector<int64_t> ids(static_cast<size_t>(n));
  for (auto& v : ids) {
    const uint64_t r = gen() % 100;
    if (r < 50)
      v = int64_t(gen() % 5);
    else if (r < 53)
      v = padding;
    else
      v = int64_t(gen() % uint64_t(vocab));
  }
  Tensor t = Tensor::from_vector(ids, {n});
  return dtype == DType::i64 ? t : t.to(dtype);
}

#ifdef GLMTUNE_WITH_CUDA
void check_case(int64_t vocab, int64_t dim, int64_t n, DType id_dtype, uint64_t stream) {
  const std::string what = "V=" + std::to_string(vocab) + " D=" + std::to_string(dim) +
                           " T=" + std::to_string(n) + " ids " + std::string(dtype_name(id_dtype));
  const int64_t padding = 7;
  const Tensor table = random_cpu({vocab, dim}, DType::bf16, stream);
  const Tensor ids = make_ids(n, vocab, padding, stream + 1, id_dtype);
  const Tensor table_g = table.to(kGpu);

  // Forward: an exact copy of the rows, from CPU ids and from device ids.
  const Tensor ref = ops::embedding_forward(f32(table), ids);
  for (bool ids_on_gpu : {false, true}) {
    Tensor out = Tensor::empty({n, dim}, DType::bf16, kGpu);
    out.fill_(NAN);
    cuda::embedding_forward_out(out, table_g, ids_on_gpu ? ids.to(kGpu) : ids);
    EXPECT_TRUE(bit_identical(f32(out), ref))
        << ctx("forward is not an exact gather, " + what + (ids_on_gpu ? " (device ids)" : ""));
  }

  // Backward into f32: CPU sums in token order, the GPU in its fixed order.
  const Tensor dout = random_cpu({n, dim}, DType::bf16, stream + 2);
  const Tensor d0 = random_cpu({vocab, dim}, DType::f32, stream + 3, 4.0);
  Tensor want = d0.clone();
  ops::embedding_backward(f32(table), ids, f32(dout), padding, want);
  const cuda::EmbeddingGradPlan plan = cuda::make_embedding_grad_plan(ids, vocab, padding, kGpu);
  Tensor dt = d0.to(kGpu);
  cuda::embedding_backward(plan, dout.to(kGpu), dt);
  EXPECT_CLOSE(dt, want, 1e-5, "dtable f32, " + what);
  // Padding row and untouched rows keep their exact start values.
  const Tensor got = dt.to(Device::cpu());
  std::vector<bool> touched(size_t(vocab), false);
  {
    const Tensor ic = ids.to(DType::i64);
    for (int64_t t = 0; t < n; ++t) touched[size_t(ic.data<int64_t>()[t])] = true;
  }
  touched[size_t(padding)] = false;
  int64_t changed_untouched = 0;
  for (int64_t v = 0; v < vocab; ++v) {
    if (touched[size_t(v)]) continue;
    changed_untouched += std::memcmp(got.data<float>() + v * dim, d0.data<float>() + v * dim,
                                     size_t(dim) * sizeof(float)) != 0;
  }
  EXPECT_EQ(changed_untouched, 0) << ctx("rows without tokens (or the padding row) changed, " +
                                         what);
  // Rerun: bit-identical.
  Tensor dt2 = d0.to(kGpu);
  cuda::embedding_backward(plan, dout.to(kGpu), dt2);
  EXPECT_TRUE(bit_identical(dt, dt2)) << ctx("backward rerun, " + what);
  // Plan from device ids: the same plan, the same bits.
  const cuda::EmbeddingGradPlan plan_g =
      cuda::make_embedding_grad_plan(ids.to(kGpu), vocab, padding, kGpu);
  Tensor dt3 = d0.to(kGpu);
  cuda::embedding_backward(plan_g, dout.to(kGpu), dt3);
  EXPECT_TRUE(bit_identical(dt, dt3)) << ctx("plan from device ids, " + what);

  // bf16 table gradient: one rounding of start + sum per row.
  const Tensor b0 = random_cpu({vocab, dim}, DType::bf16, stream + 4, 4.0);
  Tensor wantb = f32(b0);
  ops::embedding_backward(f32(table), ids, f32(dout), padding, wantb);
  Tensor db = b0.to(kGpu);
  cuda::embedding_backward(plan, dout.to(kGpu), db);
  EXPECT_CLOSE(db, wantb, 1e-2, "dtable bf16, " + what);
}
#endif

}  // namespace

TEST(CudaOpsEmbedding, MatchesCpu) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  check_case(1000, 264, 3000, DType::i64, 1);  // 16-byte path, hot rows with ~300 tokens
  check_case(300, 100, 777, DType::i32, 11);   // D % 8 != 0: scalar path, int32 ids
#endif
}

TEST(CudaOpsEmbedding, NoPaddingAndEmptyPlans) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  // Without padding_idx every occurrence counts, the padding id too.
  const int64_t vocab = 64, dim = 32, n = 500;
  const Tensor ids = make_ids(n, vocab, 7, 21, DType::i64);
  const Tensor dout = random_cpu({n, dim}, DType::bf16, 22);
  const Tensor table = random_cpu({vocab, dim}, DType::bf16, 23);
  Tensor want = Tensor::zeros({vocab, dim}, DType::f32);
  ops::embedding_backward(f32(table), ids, f32(dout), std::nullopt, want);
  Tensor dt = Tensor::zeros({vocab, dim}, DType::f32, kGpu);
  cuda::embedding_backward(cuda::make_embedding_grad_plan(ids, vocab, std::nullopt, kGpu),
                           dout.to(kGpu), dt);
  EXPECT_CLOSE(dt, want, 1e-5, "no padding");
  // Only padding tokens: nothing to add.
  const Tensor pads = Tensor::full({10}, 7.0, DType::i64);
  const cuda::EmbeddingGradPlan empty = cuda::make_embedding_grad_plan(pads, vocab, 7, kGpu);
  EXPECT_EQ(empty.rows.numel(), 0);
  Tensor untouched = Tensor::full({vocab, dim}, 3.0, DType::f32, kGpu);
  cuda::embedding_backward(empty, random_cpu({10, dim}, DType::bf16, 24).to(kGpu), untouched);
  for (double v : untouched.to_doubles()) ASSERT_EQ(v, 3.0);
#endif
}

TEST(CudaOpsEmbedding, BadIdsAreErrors) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  const Tensor table = random_cpu({50, 16}, DType::bf16, 31).to(kGpu);
  const Tensor bad = Tensor::from_vector(std::vector<int64_t>{1, 2, 50, 3, -1}, {5});
  try {
    cuda::embedding_forward(table, bad.to(kGpu));
    FAIL() << "id 50 of a 50-row table was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("token id 50 at position 2"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(cuda::make_embedding_grad_plan(bad, 50, std::nullopt, kGpu), Error);
  // The device stays usable after the failed call.
  const Tensor ok = Tensor::from_vector(std::vector<int32_t>{0, 49}, {2});
  const Tensor rows = cuda::embedding_forward(table, ok);
  EXPECT_TRUE(bit_identical(rows.select(0, 1), table.select(0, 49)));
#endif
}

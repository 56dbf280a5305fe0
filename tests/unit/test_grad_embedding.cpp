// Token embedding forward (gather) and backward (scatter-add, padding row excluded): the
// reference's nn.Embedding(padding_idx) values and gradients (fixtures from
// tools/golden/grads_dsa_moe.py), float64 finite differences on fresh random inputs, accumulation
// and id validation.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <vector>

#include "glmtune/ops/embedding.h"
#include "support/test_support.h"

using namespace glmtune;
using namespace glmtune::test;

namespace {

constexpr const char* kGolden = "grads_dsa_moe";
constexpr RelErr rel_err{};

}  // namespace

TEST(GradEmbedding, MatchesReference) {
  const io::SafetensorsFile f = open_golden(kGolden);
  const nlohmann::json meta = golden_metadata(f);
  const int64_t pad = meta["lm"]["pad_id"];
  const Tensor table = f.tensor("emb.weight"), ids = f.tensor("emb.ids");
  // The pad row is not zero in the fixture, and the forward still returns it.
  const std::vector<double> pad_row = table.select(0, pad).contiguous().to_doubles();
  ASSERT_TRUE(std::any_of(pad_row.begin(), pad_row.end(), [](double v) { return v != 0; }));
  EXPECT_EQ(ops::embedding_forward(table, ids).to_doubles(), f.tensor("emb.out").to_doubles());
  // int32 ids give the same rows.
  EXPECT_EQ(ops::embedding_forward(table, ids.to(DType::i32)).to_doubles(),
            f.tensor("emb.out").to_doubles());

  Tensor grad;
  ops::embedding_backward(table, ids, f.tensor("emb.dy"), pad, grad);
  EXPECT_LE(rel_err(grad, f.tensor("emb.grad")), 1e-6);
  for (double v : grad.select(0, pad).contiguous().to_doubles()) EXPECT_EQ(v, 0.0);
}

TEST(GradEmbedding, FiniteDifferencesFloat64) {
  SCOPED_TRACE(seed_note());
  const int64_t vocab = 11, dim = 5, pad = 4;
  std::mt19937_64 gen(test_seed());
  // A [3, 6] id tensor with repeats and the pad id twice.
  std::vector<int64_t> idv(18);
  for (int64_t& v : idv) v = int64_t(gen() % vocab);
  idv[1] = idv[7] = pad;
  idv[3] = idv[10] = idv[15] = (pad + 1) % vocab;
  const Tensor ids = Tensor::from_vector(idv, {3, 6});
  Tensor table = random_normal({vocab, dim}, 1);
  const Tensor dy = random_normal({3, 6, dim}, 1000);
  const Tensor out = ops::embedding_forward(table, ids);
  ASSERT_EQ(out.shape(), (Shape{3, 6, dim}));
  Tensor grad;
  ops::embedding_backward(table, ids, dy, pad, grad);
  const Tensor fd_table =
      finite_differences(table, [&] { return dot(dy, ops::embedding_forward(table, ids)); });
  for (int64_t v = 0; v < vocab; ++v)
    for (int64_t c = 0; c < dim; ++c) {
      const double fd = fd_table.item({v, c});
      if (v == pad) {
        // padding_idx semantics: the forward reads the pad row, yet it gets no gradient.
        EXPECT_NE(fd, 0.0);
        EXPECT_EQ(grad.item({v, c}), 0.0);
      } else {
        EXPECT_NEAR(grad.item({v, c}), fd, 1e-8) << "row " << v << " column " << c;
      }
    }
  // Without a padding row every row follows the finite differences.
  Tensor all;
  ops::embedding_backward(table, ids, dy, std::nullopt, all);
  for (int64_t c = 0; c < dim; ++c) {
    double want = 0;
    for (int64_t t = 0; t < 18; ++t)
      if (idv[size_t(t)] == pad) want += dy.item({t / 6, t % 6, c});
    EXPECT_NEAR(all.item({pad, c}), want, 1e-12);
  }
}

TEST(GradEmbedding, AccumulatesAndValidates) {
  SCOPED_TRACE(seed_note());
  const Tensor table = random_normal({6, 3}, 7, DType::f32);
  const Tensor ids = Tensor::from_vector(std::vector<int32_t>{0, 5, 5, 2}, {4});
  const Tensor dy = random_normal({4, 3}, 8, DType::f32);
  Tensor once, twice;
  ops::embedding_backward(table, ids, dy, std::nullopt, once);
  ops::embedding_backward(table, ids, dy, std::nullopt, twice);
  ops::embedding_backward(table, ids, dy, std::nullopt, twice);
  const std::vector<double> a = once.to_doubles(), b = twice.to_doubles();
  for (size_t i = 0; i < a.size(); ++i) EXPECT_FLOAT_EQ(float(b[i]), float(2 * a[i]));
  for (int64_t c = 0; c < 3; ++c)
    EXPECT_FLOAT_EQ(float(once.item({5, c})), float(dy.item({1, c}) + dy.item({2, c})));

  // Ids outside the vocabulary are the user's data problem: a glmtune::Error, both ways.
  const Tensor bad = Tensor::from_vector(std::vector<int64_t>{0, 6}, {2});
  EXPECT_THROW(ops::embedding_forward(table, bad), Error);
  Tensor g;
  EXPECT_THROW(
      ops::embedding_backward(table, bad, random_normal({2, 3}, 9, DType::f32), std::nullopt, g),
      Error);
  const Tensor negative = Tensor::from_vector(std::vector<int64_t>{-1}, {1});
  EXPECT_THROW(ops::embedding_forward(table, negative), Error);
}

// A row's gradient sums every token of its id: for a frequent token that is a long sum, which an
// f32 running sum would get wrong by ~sqrt(n) ulps (~200 ulps here). Summed in double and rounded
// once, the f32 result is within one rounding of the exact sum (the terms are the f32 dy values
// themselves, positive, so the exact sum is their double sum up to n·2^-53 relative).
TEST(GradEmbedding, LongTokenSumsAreRoundedOnce) {
  SCOPED_TRACE(seed_note());
  const int64_t vocab = 7, dim = 3, n = int64_t(1) << 20;
  std::vector<int64_t> idv(static_cast<size_t>(n));
  for (int64_t t = 0; t < n; ++t) idv[size_t(t)] = t % 3 == 0 ? 2 : 5;
  const Tensor ids = Tensor::from_vector(idv, {n});
  const Tensor table = random_normal({vocab, dim}, 1, DType::f32);
  const Tensor dy = random_uniform({n, dim}, 2, DType::f32, 0.5, 1.5);
  Tensor grad;
  ops::embedding_backward(table, ids, dy, std::nullopt, grad);
  std::vector<double> want(size_t(vocab * dim), 0.0);
  const float* d = dy.data<float>();
  for (int64_t t = 0; t < n; ++t)
    for (int64_t c = 0; c < dim; ++c)
      want[size_t(idv[size_t(t)] * dim + c)] += double(d[t * dim + c]);
  const double u = std::ldexp(1.0, -24);
  for (int64_t v = 0; v < vocab; ++v)
    for (int64_t c = 0; c < dim; ++c) {
      const double w = want[size_t(v * dim + c)];
      EXPECT_LE(std::abs(grad.item({v, c}) - w), 1.01 * u * w) << "row " << v << " column " << c;
    }
}

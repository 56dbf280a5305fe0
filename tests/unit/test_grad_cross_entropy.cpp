// Token cross-entropy and the fused lm_head + cross-entropy over row chunks: the reference's
// ForCausalLMLoss value and autograd gradients, with the token mean and with an external
// denominator (fixtures from tools/golden/grads_dsa_moe.py), float64 finite differences on fresh
// random inputs, chunk-size invariance, ignored rows, and label validation.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "glmtune/ops/cross_entropy.h"
#include "glmtune/ops/linear.h"
#include "support/test_support.h"

using namespace glmtune;
using namespace glmtune::test;

namespace {

constexpr const char* kGolden = "grads_dsa_moe";
constexpr RelErr rel_err{};

// Random labels in [0, V) with every `ignore_every`-th row ignored.
Tensor random_labels(int64_t rows, int64_t vocab, int64_t ignore_every) {
  std::mt19937_64 gen(test_seed() + 17);
  std::vector<int64_t> v(static_cast<size_t>(rows));
  for (int64_t i = 0; i < rows; ++i)
    v[size_t(i)] = i % ignore_every == 1 ? ops::kIgnoreIndex : int64_t(gen() % vocab);
  return Tensor::from_vector(v, {rows});
}

}  // namespace

TEST(GradCrossEntropy, MatchesReference) {
  const io::SafetensorsFile f = open_golden(kGolden);
  const nlohmann::json meta = golden_metadata(f);
  const Tensor hidden = f.tensor("lm.hidden"), weight = f.tensor("lm.weight");
  // The reference shifts the labels itself: target of row s is labels[s + 1], the last row has
  // none. glmtune's op takes the aligned targets (the packer aligns them per document).
  const Tensor labels = f.tensor("lm.labels");
  const int64_t rows = labels.size(0);
  std::vector<int64_t> shifted(size_t(rows), ops::kIgnoreIndex);
  for (int64_t s = 0; s + 1 < rows; ++s) shifted[size_t(s)] = int64_t(labels.item({s + 1}));
  const Tensor targets = Tensor::from_vector(shifted, {rows});
  for (const auto& [tag, denominator] :
       {std::pair{std::string("mean"), 0.0},
        std::pair{std::string("sum"), meta["lm"]["num_items_in_batch"].get<double>()}}) {
    SCOPED_TRACE(tag);
    const double ref_loss = f.tensor("lm." + tag + ".loss").item({0});
    for (int64_t chunk : {int64_t(1), int64_t(4), int64_t(256)}) {
      SCOPED_TRACE("chunk " + std::to_string(chunk));
      ops::CrossEntropyOptions opts;
      opts.denominator = denominator;
      opts.chunk_rows = chunk;
      Tensor dh, dw;
      const ops::CrossEntropyResult r =
          ops::lm_head_cross_entropy(hidden, weight, targets, opts, &dh, &dw);
      EXPECT_NEAR(r.loss, ref_loss, 1e-5);
      EXPECT_LE(rel_err(dh, f.tensor("lm." + tag + ".dhidden")), 1e-4);
      EXPECT_LE(rel_err(dw, f.tensor("lm." + tag + ".dweight")), 1e-4);
    }
    // The unfused path on materialised logits agrees.
    ops::CrossEntropyOptions opts;
    opts.denominator = denominator;
    const Tensor logits = ops::linear(hidden, weight);
    EXPECT_NEAR(ops::cross_entropy_forward(logits, targets, opts).loss, ref_loss, 1e-5);
  }
}

TEST(GradCrossEntropy, FiniteDifferencesFloat64) {
  SCOPED_TRACE(seed_note());
  const int64_t rows = 7, vocab = 9, dim = 4;
  const Tensor labels = random_labels(rows, vocab, 3);
  ops::CrossEntropyOptions opts;
  opts.denominator = 11;  // as if the step's other micro-packs held more label tokens
  opts.grad_scale = 0.3;  // e.g. a loss factor
  opts.chunk_rows = 2;

  Tensor logits = random_normal({rows, vocab}, 1, 2.0);
  const Tensor dlogits = ops::cross_entropy_backward(logits, labels, opts);
  const auto loss = [&] {
    return opts.grad_scale * ops::cross_entropy_forward(logits, labels, opts).loss;
  };
  EXPECT_LE(rel_err(dlogits, finite_differences(logits, loss)), 1e-7);
  for (int64_t r = 1; r < rows; r += 3)
    for (int64_t v = 0; v < vocab; ++v) EXPECT_EQ(dlogits.item({r, v}), 0.0);

  Tensor hidden = random_normal({rows, dim}, 1000);
  Tensor weight = random_normal({vocab, dim}, 2000);
  Tensor dh, dw;
  ops::lm_head_cross_entropy(hidden, weight, labels, opts, &dh, &dw);
  const auto fused_loss = [&] {
    return opts.grad_scale * ops::lm_head_cross_entropy(hidden, weight, labels, opts).loss;
  };
  EXPECT_LE(rel_err(dh, finite_differences(hidden, fused_loss)), 1e-7);
  EXPECT_LE(rel_err(dw, finite_differences(weight, fused_loss)), 1e-7);
  for (int64_t r = 1; r < rows; r += 3)
    for (int64_t c = 0; c < dim; ++c) EXPECT_EQ(dh.item({r, c}), 0.0);
}

TEST(GradCrossEntropy, ChunksDoNotChangeTheResult) {
  SCOPED_TRACE(seed_note());
  const int64_t rows = 37, vocab = 50, dim = 12;
  const Tensor labels = random_labels(rows, vocab, 4);
  const Tensor hidden = random_normal({rows, dim}, 1), weight = random_normal({vocab, dim}, 2);
  // The unfused reference: logits, their gradient, then the two GEMMs by hand.
  const Tensor logits = ops::linear(hidden, weight);
  const ops::CrossEntropyResult full = ops::cross_entropy_forward(logits, labels);
  const Tensor dz = ops::cross_entropy_backward(logits, labels);
  Tensor dh_ref = Tensor::zeros({rows, dim}, DType::f64);
  Tensor dw_ref = Tensor::zeros({vocab, dim}, DType::f64);
  ops::gemm<double>(false, false, rows, dim, vocab, 1.0, dz.data<double>(), vocab,
                    weight.data<double>(), dim, 0.0, dh_ref.data<double>(), dim);
  ops::gemm<double>(true, false, vocab, dim, rows, 1.0, dz.data<double>(), vocab,
                    hidden.data<double>(), dim, 0.0, dw_ref.data<double>(), dim);
  const std::vector<double> lv = labels.to_doubles();
  EXPECT_EQ(full.n_tokens, std::count_if(lv.begin(), lv.end(), [](double v) { return v >= 0; }));
  EXPECT_LT(full.n_tokens, rows);
  for (int64_t chunk : {int64_t(1), int64_t(5), int64_t(16), int64_t(1000)}) {
    SCOPED_TRACE("chunk " + std::to_string(chunk));
    ops::CrossEntropyOptions opts;
    opts.chunk_rows = chunk;
    // dweight accumulates: start from a non-zero buffer.
    Tensor dh, dw = Tensor::full({vocab, dim}, 0.5, DType::f64);
    const ops::CrossEntropyResult r =
        ops::lm_head_cross_entropy(hidden, weight, labels, opts, &dh, &dw);
    EXPECT_NEAR(r.loss, full.loss, 1e-12);
    EXPECT_EQ(r.n_tokens, full.n_tokens);
    EXPECT_EQ(r.denominator, double(full.n_tokens));
    EXPECT_LE(rel_err(dh, dh_ref), 1e-12);
    for (int64_t i = 0; i < vocab; ++i)
      for (int64_t c = 0; c < dim; ++c)
        EXPECT_NEAR(dw.item({i, c}) - 0.5, dw_ref.item({i, c}), 1e-12);
    // Forward only gives the same loss.
    EXPECT_NEAR(ops::lm_head_cross_entropy(hidden, weight, labels, opts).loss, full.loss, 1e-12);
  }
  // The f32 path (the reference's fp32 logits) agrees with f64.
  ops::CrossEntropyOptions opts;
  opts.chunk_rows = 8;
  Tensor dh32, dw32;
  const ops::CrossEntropyResult r32 = ops::lm_head_cross_entropy(
      hidden.to(DType::f32), weight.to(DType::f32), labels, opts, &dh32, &dw32);
  EXPECT_NEAR(r32.loss, full.loss, 1e-5);
  EXPECT_LE(rel_err(dh32, dh_ref), 1e-5);
  EXPECT_LE(rel_err(dw32, dw_ref), 1e-5);
}

TEST(GradCrossEntropy, NothingToLearnGivesZeroNotNaN) {
  SCOPED_TRACE(seed_note());
  const Tensor hidden = random_normal({4, 3}, 1), weight = random_normal({5, 3}, 2);
  const Tensor labels = Tensor::from_vector(std::vector<int64_t>(4, ops::kIgnoreIndex), {4});
  for (double denominator : {0.0, 9.0}) {
    ops::CrossEntropyOptions opts;
    opts.denominator = denominator;
    Tensor dh, dw;
    const ops::CrossEntropyResult r =
        ops::lm_head_cross_entropy(hidden, weight, labels, opts, &dh, &dw);
    EXPECT_EQ(r.loss, 0.0);
    EXPECT_EQ(r.n_tokens, 0);
    for (double v : dh.to_doubles()) EXPECT_EQ(v, 0.0);
    for (double v : dw.to_doubles()) EXPECT_EQ(v, 0.0);
    for (double v :
         ops::cross_entropy_backward(ops::linear(hidden, weight), labels, opts).to_doubles())
      EXPECT_EQ(v, 0.0);
  }
}

TEST(GradCrossEntropy, RejectsLabelsOutsideTheVocabulary) {
  const Tensor logits = Tensor::zeros({3, 4}, DType::f32);
  for (int64_t bad : {int64_t(4), int64_t(-1), int64_t(-101)}) {
    const Tensor labels = Tensor::from_vector(std::vector<int64_t>{0, bad, 2}, {3});
    EXPECT_THROW(ops::cross_entropy_forward(logits, labels), Error) << bad;
    EXPECT_THROW(ops::cross_entropy_backward(logits, labels), Error) << bad;
  }
  // int32 labels work.
  const Tensor ok = Tensor::from_vector(std::vector<int32_t>{0, -100, 3}, {3});
  const ops::CrossEntropyResult r = ops::cross_entropy_forward(logits, ok);
  EXPECT_EQ(r.n_tokens, 2);
  EXPECT_NEAR(r.loss, std::log(4.0), 1e-6);
}

// Sparse NoPE MLA: parity with the transformers reference (fixtures from
// tools/golden/ops_dsa_moe.py, eager attention), sparse vs dense masked attention on fresh random
// inputs, document independence of a pack, and the DSA mixer's index plumbing.

#include <gtest/gtest.h>

#include <cmath>
#include <set>
#include <string>
#include <vector>

#include "glmtune/ops/mla.h"
#include "support/dsa_moe.h"
#include "support/test_support.h"

using namespace glmtune;
using namespace glmtune::test;

namespace {

constexpr const char* kGolden = "dsa_moe";
constexpr RelErr rel_err{};

}  // namespace

TEST(OpsMla, MatchesReference) {
  const io::SafetensorsFile f = open_golden(kGolden);
  for (const GoldenDsaMoeConfig& c : kGoldenDsaMoeConfigs) {
    SCOPED_TRACE("config " + c.name);
    const ops::DsaParams params = golden_dsa_params(f, c.name);
    EXPECT_EQ(params.mla.o_proj.bias.defined(), c.name == "a");  // attention_bias on in "a" only
    const Tensor x = f.tensor(c.name + ".x"), cu = f.tensor(c.name + ".cu_seqlens");
    const Tensor ref = f.tensor(c.name + ".attn_out");
    const Tensor ref_idx = f.tensor(c.name + ".indices");

    // MLA alone, fed the reference's own selection.
    const ops::MlaOutput mla = ops::mla_forward(c.mla, params.mla, x, ref_idx, cu);
    EXPECT_LE(rel_err(mla.proj.q_resid, f.tensor(c.name + ".q_resid")), 1e-4);
    EXPECT_LE(rel_err(mla.y, ref), 1e-4);

    // The whole mixer, selecting with its own indexer.
    const ops::DsaOutput dsa = ops::dsa_forward(c.mla, c.indexer, params, x, cu);
    EXPECT_LE(rel_err(dsa.y, ref), 1e-4);
    ASSERT_EQ(dsa.indices.shape(), ref_idx.shape());
    for (int64_t r = 0; r < x.size(0); ++r)
      EXPECT_EQ(row_set(dsa.indices, r), row_set(ref_idx, r)) << "row " << r;

    const ops::DsaOutput dsa64 =
        ops::dsa_forward(c.mla, c.indexer, to_f64(params), x.to(DType::f64), cu);
    EXPECT_LE(rel_err(dsa64.y, ref), 1e-4);
  }
}

TEST(OpsMla, SparseAttentionEqualsDenseMaskedAttention) {
  SCOPED_TRACE(seed_note());
  const std::vector<int32_t> lens = {9, 1, 0, 23, 14};
  const int64_t total = 47, heads = 3, dqk = 7, dv = 5;
  // Arbitrary selections inside each document: not causal, with duplicates, −1 holes and one
  // row that selects nothing at all.
  const int64_t width = 12;
  std::vector<int32_t> idx = random_selections(lens, width);
  for (int64_t w = 0; w < width; ++w) idx[size_t(30 * width + w)] = -1;
  const Tensor indices = Tensor::from_vector(idx, {total, width});
  const Tensor cu = cu_seqlens(lens);
  for (DType dt : {DType::f64, DType::f32}) {
    SCOPED_TRACE(std::string(dtype_name(dt)));
    const Tensor q = random_normal({total, heads, dqk}, 1, 1.0, dt);
    const Tensor k = random_normal({total, heads, dqk}, 100000, 1.0, dt);
    const Tensor v = random_normal({total, heads, dv}, 200000, 1.0, dt);
    const double scale = 1 / std::sqrt(double(dqk));
    const Tensor sparse = ops::sparse_attention(q, k, v, indices, cu, scale);
    const Tensor dense = ops::dense_masked_attention(q, k, v, indices, cu, scale);
    EXPECT_LE(rel_err(sparse, dense), dt == DType::f64 ? 1e-12 : 1e-5);
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t c = 0; c < dv; ++c) EXPECT_EQ(sparse.item({30, h, c}), 0.0);

    // A key outside a row's selection has no influence on that row.
    Tensor v2 = v.clone();
    const int64_t row = 20, victim = [&] {
      const std::set<int64_t> seen = row_set(indices, row);
      for (int64_t j = 10; j < 33; ++j)
        if (!seen.count(j)) return j;
      return int64_t(-1);
    }();
    ASSERT_GE(victim, 0);
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t c = 0; c < dv; ++c) v2.set_item({victim, h, c}, 1e3);
    const Tensor sparse2 = ops::sparse_attention(q, k, v2, indices, cu, scale);
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t c = 0; c < dv; ++c)
        EXPECT_EQ(sparse2.item({row, h, c}), sparse.item({row, h, c}));
  }
}

TEST(OpsMla, DuplicateIndicesCountOnce) {
  SCOPED_TRACE(seed_note());
  const Tensor q = random_normal({6, 2, 4}, 1), k = random_normal({6, 2, 4}, 2);
  const Tensor v = random_normal({6, 2, 3}, 3);
  const Tensor once = Tensor::from_vector(std::vector<int32_t>(6 * 4, -1), {6, 4});
  Tensor a = once.clone(), b = once.clone();
  for (int64_t r = 0; r < 6; ++r) {
    a.set_item({r, 0}, double(r));
    a.set_item({r, 1}, double(r / 2));
    b.set_item({r, 0}, double(r / 2));
    b.set_item({r, 1}, double(r));
    b.set_item({r, 2}, double(r));
    b.set_item({r, 3}, double(r / 2));
  }
  const Tensor cu = cu_seqlens({6});
  EXPECT_LE(rel_err(ops::sparse_attention(q, k, v, b, cu, 0.5),
                    ops::sparse_attention(q, k, v, a, cu, 0.5)),
            1e-15);
}

TEST(OpsMla, DocumentsOfAPackAreIndependent) {
  SCOPED_TRACE(seed_note());
  const ops::MlaConfig mc{3, 10, 8, 6, 5, 1e-5};
  const ops::IndexerConfig ic{2, 6, 4, 8, true};
  const int64_t dim = 14;
  const ops::DsaParams p = random_dsa_params(mc, ic, dim, /*bias=*/true, 1);
  const std::vector<int32_t> lens = {13, 2, 0, 30, 4};
  const int64_t total = total_tokens(lens);
  const Tensor x = random_normal({total, dim}, 777777);
  const ops::DsaOutput packed = ops::dsa_forward(mc, ic, p, x, cu_seqlens(lens));
  int64_t start = 0;
  for (int32_t len : lens) {
    if (len > 0) {
      const ops::DsaOutput alone =
          ops::dsa_forward(mc, ic, p, x.narrow(0, start, len), cu_seqlens({len}));
      EXPECT_LE(rel_err(packed.y.narrow(0, start, len), alone.y), 1e-12) << "document at " << start;
      for (int64_t s = 0; s < len; ++s) {
        std::set<int64_t> shifted;
        for (int64_t j : row_set(alone.indices, s)) shifted.insert(j + start);
        EXPECT_EQ(row_set(packed.indices, start + s), shifted);
      }
    }
    start += len;
  }
}

TEST(OpsMla, RejectsIndicesOutsideTheDocument) {
  const Tensor q = random_normal({5, 1, 2}, 1), v = random_normal({5, 1, 2}, 2);
  Tensor idx = Tensor::from_vector(std::vector<int32_t>(5 * 2, -1), {5, 2});
  idx.set_item({3, 1}, 1.0);  // token 3 is in document [2, 5): token 1 belongs to the first one
  EXPECT_THROW(ops::sparse_attention(q, q, v, idx, cu_seqlens({2, 3}), 1.0), InternalError);
  idx.set_item({3, 1}, 5.0);  // past the pack
  EXPECT_THROW(ops::sparse_attention(q, q, v, idx, cu_seqlens({2, 3}), 1.0), InternalError);
}

TEST(OpsMla, SharedLayerReusesThePreviousSelection) {
  SCOPED_TRACE(seed_note());
  const ops::MlaConfig mc{2, 8, 6, 4, 4, 1e-5};
  const ops::IndexerConfig ic{2, 4, 2, 4, true};
  const int64_t dim = 8, tokens = 11;
  ops::DsaParams p = random_dsa_params(mc, ic, dim, false, 5);
  const Tensor x = random_normal({tokens, dim}, 6);
  const Tensor cu = cu_seqlens({tokens});
  const ops::DsaOutput full = ops::dsa_forward(mc, ic, p, x, cu);
  p.indexer = ops::IndexerParams{};
  EXPECT_THROW(ops::dsa_forward(mc, ic, p, x, cu), Error);
  // Reverse the selection order of every row: the result is a set function of the indices.
  Tensor reversed = full.indices.clone();
  const int64_t w = reversed.size(1);
  for (int64_t r = 0; r < tokens; ++r)
    for (int64_t c = 0; c < w; ++c) reversed.set_item({r, c}, full.indices.item({r, w - 1 - c}));
  const ops::DsaOutput shared = ops::dsa_forward(mc, ic, p, x, cu, reversed);
  EXPECT_LE(rel_err(shared.y, full.y), 1e-14);
  EXPECT_EQ(shared.indices.to_doubles(), reversed.to_doubles());
}

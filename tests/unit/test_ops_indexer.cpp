// KPool DSA indexer: parity with the transformers reference (fixtures from
// tools/golden/ops_dsa_moe.py; selections compared as sets), document independence in a pack,
// the structure of a selection (causal, complete pools, tail) and a brute-force score oracle.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <string>
#include <vector>

#include "glmtune/ops/indexer.h"
#include "support/dsa_moe.h"
#include "support/test_support.h"

using namespace glmtune;
using namespace glmtune::test;

namespace {

constexpr const char* kGolden = "dsa_moe";

// Random f64 parameters drawn away from the init values (ape 0, gate 1, LayerNorm 1/0).
ops::IndexerParams random_params(const ops::IndexerConfig& c, int64_t dim, int64_t rank,
                                 uint64_t offset) {
  const int64_t id = c.head_dim, ih = c.n_heads;
  ops::IndexerParams p;
  p.wq_b.weight = random_normal({ih * id, rank}, offset, 1 / std::sqrt(double(rank)));
  p.wk.weight = random_normal({id, dim}, offset + 10000, 1 / std::sqrt(double(dim)));
  p.k_norm_weight = random_normal({id}, offset + 20000, 0.2);
  p.k_norm_bias = random_normal({id}, offset + 30000, 0.2);
  for (int64_t d = 0; d < id; ++d) p.k_norm_weight.set_item({d}, 1 + p.k_norm_weight.item({d}));
  p.weights_proj.weight = random_normal({ih, dim}, offset + 40000, 1 / std::sqrt(double(dim)));
  p.kpool_ape = random_normal({c.kpool, id}, offset + 50000, 0.5);
  p.kpool_gate = random_normal({id, dim}, offset + 60000, 1 / std::sqrt(double(dim)));
  return p;
}

void expect_same_sets(const Tensor& got, const Tensor& ref) {
  ASSERT_EQ(got.shape(), ref.shape());
  for (int64_t r = 0; r < ref.size(0); ++r)
    EXPECT_EQ(row_set(got, r), row_set(ref, r)) << "row " << r;
}

}  // namespace

TEST(OpsIndexer, MatchesReference) {
  const io::SafetensorsFile f = open_golden(kGolden);
  for (const GoldenDsaMoeConfig& c : kGoldenDsaMoeConfigs) {
    const std::string& name = c.name;
    const ops::IndexerConfig& cfg = c.indexer;
    SCOPED_TRACE("config " + name);
    const ops::IndexerParams params = golden_indexer_params(f, name);
    const Tensor x = f.tensor(name + ".x"), q_resid = f.tensor(name + ".q_resid");
    const Tensor cu = f.tensor(name + ".cu_seqlens");
    const Tensor ref = f.tensor(name + ".indices");
    EXPECT_EQ(ref.size(1), ops::indexer_width(cfg));
    expect_same_sets(ops::indexer_forward(cfg, params, x, q_resid, cu), ref);
    expect_same_sets(
        ops::indexer_forward(cfg, to_f64(params), x.to(DType::f64), q_resid.to(DType::f64), cu),
        ref);
  }
}

TEST(OpsIndexer, MatchesReferenceWithoutTail) {
  const io::SafetensorsFile f = open_golden(kGolden);
  const ops::IndexerConfig cfg{3, 8, 2, 6, /*always_select_tail=*/false};
  const Tensor ref = f.tensor("b.indices_notail");
  EXPECT_EQ(ref.size(1), ops::indexer_width(cfg));
  expect_same_sets(ops::indexer_forward(cfg, golden_indexer_params(f, "b"), f.tensor("b.x"),
                                        f.tensor("b.q_resid"), f.tensor("b.cu_seqlens")),
                   ref);
}

TEST(OpsIndexer, DocumentsOfAPackAreIndependent) {
  SCOPED_TRACE(seed_note());
  const ops::IndexerConfig cfg{3, 8, 4, 8, true};
  const int64_t dim = 16, rank = 12;
  const ops::IndexerParams p = random_params(cfg, dim, rank, 1);
  // Includes an empty document and documents shorter than one pool.
  const std::vector<int32_t> lens = {5, 0, 19, 1, 26, 3};
  const int64_t total = total_tokens(lens);
  const Tensor x = random_normal({total, dim}, 100000);
  const Tensor q = random_normal({total, rank}, 200000);
  const Tensor packed = ops::indexer_forward(cfg, p, x, q, cu_seqlens(lens));
  int64_t start = 0;
  for (int32_t len : lens) {
    const Tensor alone = ops::indexer_forward(cfg, p, x.narrow(0, start, len),
                                              q.narrow(0, start, len), cu_seqlens({len}));
    for (int64_t s = 0; s < len; ++s) {
      std::set<int64_t> shifted;
      for (int64_t j : row_set(alone, s)) shifted.insert(j + start);
      EXPECT_EQ(row_set(packed, start + s), shifted) << "document at " << start << " row " << s;
    }
    start += len;
  }
}

TEST(OpsIndexer, SelectionIsCausalPooledAndKeepsTheTail) {
  SCOPED_TRACE(seed_note());
  for (const ops::IndexerConfig& cfg :
       {ops::IndexerConfig{2, 8, 4, 8, true}, ops::IndexerConfig{2, 8, 3, 12, true},
        ops::IndexerConfig{2, 8, 4, 8, false}, ops::IndexerConfig{2, 8, 1, 5, true}}) {
    SCOPED_TRACE("pool " + std::to_string(cfg.kpool) + " topk " + std::to_string(cfg.topk) +
                 (cfg.always_select_tail ? " tail" : " no tail"));
    const int64_t dim = 10, rank = 6, len = 41, start = 7;
    const ops::IndexerParams p = random_params(cfg, dim, rank, 300);
    // A leading document shifts the one under test, so local and global positions differ.
    const Tensor x = random_normal({start + len, dim}, 400000);
    const Tensor q = random_normal({start + len, rank}, 500000);
    const Tensor idx =
        ops::indexer_forward(cfg, p, x, q, cu_seqlens({int32_t(start), int32_t(len)}));
    const int64_t pool = cfg.kpool, n_pools = len / pool;
    const int64_t select_k = std::min(cfg.topk / pool, n_pools);
    const bool tail = cfg.always_select_tail && pool > 1;
    bool dropped = false;
    for (int64_t s = 0; s < len; ++s) {
      const std::set<int64_t> got = row_set(idx, start + s);
      const int64_t cand = (s + 1) / pool;
      std::set<int64_t> pools, tail_tokens;
      for (int64_t j : got) {
        const int64_t local = j - start;
        ASSERT_TRUE(local >= 0 && local <= s) << "row " << s << " sees " << local;
        if (local < cand * pool)
          pools.insert(local / pool);
        else
          tail_tokens.insert(local);
      }
      // Chosen pools are whole: all P tokens present.
      for (int64_t pl : pools)
        for (int64_t j = 0; j < pool; ++j) EXPECT_TRUE(got.count(start + pl * pool + j)) << s;
      EXPECT_EQ(int64_t(pools.size()), std::min(select_k, cand)) << "row " << s;
      std::set<int64_t> expect_tail;
      if (tail)
        for (int64_t t = cand * pool; t <= s; ++t) expect_tail.insert(t);
      EXPECT_EQ(tail_tokens, expect_tail) << "row " << s;
      dropped |= cand > select_k;
      // The layout: chosen pools first, then the tail slots, then −1.
      for (int64_t w = 0; w < idx.size(1); ++w) {
        const int64_t v = int64_t(idx.item({start + s, w}));
        if (w < int64_t(pools.size()) * pool) {
          EXPECT_GE(v, 0);
        } else if (tail && w >= select_k * pool &&
                   w < select_k * pool + int64_t(expect_tail.size())) {
          EXPECT_EQ(v, start + cand * pool + (w - select_k * pool));
        } else {
          EXPECT_EQ(v, -1) << "row " << s << " slot " << w;
        }
      }
    }
    EXPECT_TRUE(dropped) << "the test document is too short to exercise the top-k";
  }
}

TEST(OpsIndexer, ChoosesTheBestPoolsOfABruteForceScore) {
  SCOPED_TRACE(seed_note());
  const ops::IndexerConfig cfg{3, 6, 3, 9, true};
  const int64_t dim = 9, rank = 7, len = 40, ih = cfg.n_heads, id = cfg.head_dim, pool = cfg.kpool;
  const ops::IndexerParams p = random_params(cfg, dim, rank, 700);
  const Tensor x = random_normal({len, dim}, 800000);
  const Tensor qr = random_normal({len, rank}, 900000);
  const Tensor idx = ops::indexer_forward(cfg, p, x, qr, cu_seqlens({int32_t(len)}));

  // Per-token quantities written out from the formulas of indexer.h, in plain loops.
  auto dot_row = [](const Tensor& a, int64_t ra, const Tensor& w, int64_t rw, int64_t n) {
    double s = 0;
    for (int64_t c = 0; c < n; ++c) s += a.item({ra, c}) * w.item({rw, c});
    return s;
  };
  std::vector<std::vector<double>> k(len, std::vector<double>(id)), g = k;
  for (int64_t t = 0; t < len; ++t) {
    double mean = 0, var = 0;
    for (int64_t d = 0; d < id; ++d) {
      k[t][d] = dot_row(x, t, p.wk.weight, d, dim);
      g[t][d] = dot_row(x, t, p.kpool_gate, d, dim);
      mean += k[t][d] / double(id);
    }
    for (int64_t d = 0; d < id; ++d) var += (k[t][d] - mean) * (k[t][d] - mean) / double(id);
    for (int64_t d = 0; d < id; ++d)
      k[t][d] = (k[t][d] - mean) / std::sqrt(var + 1e-6) * p.k_norm_weight.item({d}) +
                p.k_norm_bias.item({d});
  }
  const int64_t n_pools = len / pool;
  std::vector<std::vector<double>> kbar(n_pools, std::vector<double>(id, 0.0));
  for (int64_t pl = 0; pl < n_pools; ++pl)
    for (int64_t d = 0; d < id; ++d) {
      double z = 0;
      for (int64_t j = 0; j < pool; ++j)
        z += std::exp(g[pl * pool + j][d] + p.kpool_ape.item({j, d}));
      for (int64_t j = 0; j < pool; ++j)
        kbar[pl][d] +=
            std::exp(g[pl * pool + j][d] + p.kpool_ape.item({j, d})) / z * k[pl * pool + j][d];
    }
  const int64_t select_k = std::min(cfg.topk / pool, n_pools);
  int64_t checked = 0;
  for (int64_t s = 0; s < len; ++s) {
    const int64_t cand = (s + 1) / pool;
    std::vector<std::pair<double, int64_t>> score;
    for (int64_t pl = 0; pl < cand; ++pl) {
      double total = 0;
      for (int64_t h = 0; h < ih; ++h) {
        double qk = 0;
        for (int64_t d = 0; d < id; ++d)
          qk += dot_row(qr, s, p.wq_b.weight, h * id + d, rank) * kbar[pl][d];
        total += dot_row(x, s, p.weights_proj.weight, h, dim) / std::sqrt(double(ih)) *
                 std::max(qk / std::sqrt(double(id)), 0.0);
      }
      score.push_back({total, pl});
    }
    std::sort(score.rbegin(), score.rend());
    const int64_t chosen = std::min(select_k, cand);
    // Exact ties (several pools whose every head is cut by the relu) make the order arbitrary.
    if (chosen < cand && score[chosen - 1].first - score[chosen].first < 1e-9) continue;
    std::set<int64_t> expect;
    for (int64_t i = 0; i < chosen; ++i)
      for (int64_t j = 0; j < pool; ++j) expect.insert(score[i].second * pool + j);
    for (int64_t t = cand * pool; t <= s; ++t) expect.insert(t);
    EXPECT_EQ(row_set(idx, s), expect) << "row " << s;
    checked += chosen < cand;
  }
  EXPECT_GT(checked, 0) << "no row needed a real top-k choice";
}

TEST(OpsIndexer, ReadsInt64OffsetsAndRejectsMalformedOnes) {
  SCOPED_TRACE(seed_note());
  const ops::IndexerConfig cfg{2, 4, 2, 4, true};
  const int64_t dim = 6, rank = 5;
  const ops::IndexerParams p = random_params(cfg, dim, rank, 40);
  const Tensor x = random_normal({9, dim}, 41), q = random_normal({9, rank}, 42);
  const Tensor by32 = ops::indexer_forward(cfg, p, x, q, cu_seqlens({4, 5}));
  const Tensor cu64 = Tensor::from_vector(std::vector<int64_t>{0, 4, 9}, {3});
  EXPECT_EQ(ops::indexer_forward(cfg, p, x, q, cu64).to_doubles(), by32.to_doubles());
  for (const std::vector<int32_t>& bad :
       {std::vector<int32_t>{0, 4, 8}, std::vector<int32_t>{1, 4, 9},
        std::vector<int32_t>{0, 5, 4, 9}}) {
    const Tensor cu = Tensor::from_vector(bad, {int64_t(bad.size())});
    EXPECT_THROW(ops::indexer_forward(cfg, p, x, q, cu), Error);
  }
}

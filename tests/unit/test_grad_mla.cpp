// Backward of the sparse NoPE MLA / DSA mixer: float64 central finite differences of the attention
// core (random selections with duplicates, holes and an empty row) and of the whole mixer on packs
// where the indexer drops keys, no gradient through the indexer, and the reference's autograd
// gradients (fixtures from tools/golden/grads_dsa_moe.py).

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "glmtune/ops/mla.h"
#include "support/dsa_moe.h"
#include "support/test_support.h"

using namespace glmtune;
using namespace glmtune::test;

namespace {

constexpr const char* kGolden = "grads_dsa_moe";
constexpr RelErr rel_err{};

// The fields of two parameter structs side by side, from their list (ops/linear.h), named as
// released under `self_attn.` (MLA) or `self_attn.indexer.`.
struct Field {
  std::string name;
  Tensor* a;
  Tensor* b;
};
template <typename Params, typename Zip>
std::vector<Field> fields(Params& a, Params& b, Zip zip) {
  std::vector<Field> out;
  zip(a, b, [&](const std::string& name, Tensor& x, Tensor& y) { out.push_back({name, &x, &y}); });
  return out;
}
std::vector<Field> mla_fields(ops::MlaParams& a, ops::MlaParams& b) {
  return fields(a, b, zip_mla);
}
std::vector<Field> indexer_fields(ops::IndexerParams& p) { return fields(p, p, zip_indexer); }

void expect_indexer_untouched(const ops::DsaParams& grads) {
  ops::IndexerParams g = grads.indexer;
  for (const Field& f : indexer_fields(g))
    EXPECT_FALSE(f.a->defined()) << "indexer " << f.name << " got a gradient";
}

}  // namespace

TEST(GradMla, AttentionCoreFiniteDifferences) {
  SCOPED_TRACE(seed_note());
  const std::vector<int32_t> lens = {7, 1, 0, 12};
  const int64_t total = 20, heads = 2, dqk = 3, dv = 4, width = 6;
  // Arbitrary selections inside each document: not causal, with duplicates, −1 holes, and one
  // row (token 10) that selects nothing.
  std::vector<int32_t> idx = random_selections(lens, width);
  for (int64_t w = 0; w < width; ++w) idx[size_t(10 * width + w)] = -1;
  idx[size_t(12 * width)] = idx[size_t(12 * width + 1)] = 13;  // a guaranteed duplicate
  const Tensor indices = Tensor::from_vector(idx, {total, width});
  const Tensor cu = cu_seqlens(lens);
  const double scale = 0.7;
  Tensor q = random_normal({total, heads, dqk}, 1);
  Tensor k = random_normal({total, heads, dqk}, 100000);
  Tensor v = random_normal({total, heads, dv}, 200000);
  const Tensor dout = random_normal({total, heads, dv}, 300000);
  const ops::AttentionGrads g = ops::sparse_attention_backward(q, k, v, indices, cu, scale, dout);
  const auto loss = [&] { return dot(dout, ops::sparse_attention(q, k, v, indices, cu, scale)); };
  EXPECT_LE(fd_rel_err(q, g.q, loss), 1e-6);
  EXPECT_LE(fd_rel_err(k, g.k, loss), 1e-6);
  EXPECT_LE(fd_rel_err(v, g.v, loss), 1e-6);
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t c = 0; c < dqk; ++c) EXPECT_EQ(g.q.item({10, h, c}), 0.0);

  // The f32 instantiation computes the same gradients.
  const ops::AttentionGrads g32 =
      ops::sparse_attention_backward(q.to(DType::f32), k.to(DType::f32), v.to(DType::f32), indices,
                                     cu, scale, dout.to(DType::f32));
  EXPECT_LE(rel_err(g32.q, g.q), 1e-5);
  EXPECT_LE(rel_err(g32.k, g.k), 1e-5);
  EXPECT_LE(rel_err(g32.v, g.v), 1e-5);

  // Entries outside the query's document are rejected, as in the forward.
  Tensor bad = indices.clone();
  bad.set_item({0, 0}, 9.0);  // token 0 lives in [0, 7)
  EXPECT_THROW(ops::sparse_attention_backward(q, k, v, bad, cu, scale, dout), InternalError);
}

TEST(GradMla, DuplicateEntriesCountOnce) {
  SCOPED_TRACE(seed_note());
  const Tensor q = random_normal({6, 2, 4}, 1), k = random_normal({6, 2, 4}, 2);
  const Tensor v = random_normal({6, 2, 3}, 3), dout = random_normal({6, 2, 3}, 4);
  Tensor once = Tensor::from_vector(std::vector<int32_t>(6 * 4, -1), {6, 4});
  Tensor twice = once.clone();
  for (int64_t r = 0; r < 6; ++r) {
    once.set_item({r, 0}, double(r));
    once.set_item({r, 1}, double(r / 2));
    twice.set_item({r, 0}, double(r / 2));
    twice.set_item({r, 1}, double(r));
    twice.set_item({r, 2}, double(r));
    twice.set_item({r, 3}, double(r / 2));
  }
  const Tensor cu = cu_seqlens({6});
  const ops::AttentionGrads a = ops::sparse_attention_backward(q, k, v, once, cu, 0.5, dout);
  const ops::AttentionGrads b = ops::sparse_attention_backward(q, k, v, twice, cu, 0.5, dout);
  EXPECT_LE(rel_err(b.q, a.q), 1e-15);
  EXPECT_LE(rel_err(b.k, a.k), 1e-15);
  EXPECT_LE(rel_err(b.v, a.v), 1e-15);
}

TEST(GradMla, MixerFiniteDifferencesOnPacksThatDropKeys) {
  SCOPED_TRACE(seed_note());
  const ops::MlaConfig mc{2, 6, 5, 3, 4, 1e-5};
  const ops::IndexerConfig ic{2, 4, 2, 4, true};  // a query sees at most 4 + 1 keys
  const int64_t dim = 8;
  const std::vector<int32_t> lens = {5, 11, 9};
  const int64_t total = 25;
  const Tensor cu = cu_seqlens(lens);
  for (bool bias : {true, false}) {
    SCOPED_TRACE(bias ? "attention_bias" : "no bias");
    ops::DsaParams p = random_dsa_params(mc, ic, dim, bias, bias ? 1 : 100000);
    Tensor x = random_normal({total, dim}, 5000000);
    const Tensor dy = random_normal({total, dim}, 6000000);
    ops::MlaContext ctx;
    const ops::DsaOutput dsa = ops::dsa_forward(mc, ic, p, x, cu, Tensor(), ctx);
    EXPECT_EQ(rel_err(dsa.y, ops::dsa_forward(mc, ic, p, x, cu).y), 0.0);
    const Tensor indices = dsa.indices;
    // The pack must exercise the sparse case: some query sees fewer keys than precede it.
    bool drops = false;
    int64_t start = 0;
    for (int32_t len : lens) {
      for (int64_t s = 0; s < len; ++s)
        drops |= int64_t(row_set(indices, start + s).size()) < s + 1;
      start += len;
    }
    ASSERT_TRUE(drops);

    ops::DsaParams grads;
    const Tensor dx = ops::dsa_backward(mc, p, ctx, dy, grads);
    expect_indexer_untouched(grads);
    for (const Field& f : mla_fields(grads.mla, p.mla))
      EXPECT_EQ(f.a->defined(), f.b->defined()) << f.name;

    // Selection held fixed: the function the backward differentiates.
    const auto loss = [&] { return dot(dy, ops::mla_forward(mc, p.mla, x, indices, cu).y); };
    EXPECT_LE(fd_rel_err(x, dx, loss), 1e-6);
    for (const Field& f : mla_fields(p.mla, grads.mla)) {
      if (!f.a->defined()) continue;
      SCOPED_TRACE(f.name);
      EXPECT_LE(fd_rel_err(*f.a, *f.b, loss), 1e-6);
    }

    // The live mixer, indexer included, has the same derivative in x wherever a perturbation
    // leaves the selection alone: the indexer adds nothing, although it reads x and q_resid.
    Tensor live_indices;
    const auto live_loss = [&] {
      const ops::DsaOutput o = ops::dsa_forward(mc, ic, p, x, cu);
      live_indices = o.indices;
      return dot(dy, o.y);
    };
    const auto same_selection = [&] { return live_indices.to_doubles() == indices.to_doubles(); };
    const Tensor fd = finite_differences(x, live_loss, same_selection);
    const std::vector<double> fdv = fd.to_doubles(), dxv = dx.to_doubles();
    int64_t checked = 0;
    double diff = 0, ref = 0;
    for (size_t i = 0; i < fdv.size(); ++i) {
      ref = std::max(ref, std::abs(dxv[i]));
      if (std::isnan(fdv[i])) continue;
      ++checked;
      diff = std::max(diff, std::abs(fdv[i] - dxv[i]));
    }
    EXPECT_GE(checked, int64_t(fdv.size()) * 9 / 10);
    EXPECT_LE(diff / ref, 1e-6);
    // The indexer's own parameters: the loss is flat in them between selection changes.
    int64_t flat = 0, total_entries = 0;
    for (const Field& field : indexer_fields(p.indexer)) {
      if (!field.a->defined()) continue;  // the adapter fields
      const std::string& name = field.name;
      const std::vector<double> f =
          finite_differences(*field.a, live_loss, same_selection).to_doubles();
      total_entries += int64_t(f.size());
      for (double v : f) {
        if (std::isnan(v)) continue;
        ++flat;
        EXPECT_EQ(v, 0.0) << "indexer " << name;
      }
    }
    EXPECT_GE(flat, total_entries * 9 / 10);
  }
}

TEST(GradMla, MatchesReferenceGradients) {
  const io::SafetensorsFile f = open_golden(kGolden);
  const nlohmann::json meta = golden_metadata(f);
  for (const std::string c : {"a", "b"}) {
    SCOPED_TRACE("config " + c);
    const nlohmann::json& jc = meta["configs"][c];
    const ops::MlaConfig mc{jc["num_attention_heads"], jc["q_lora_rank"], jc["kv_lora_rank"],
                            jc["qk_nope_head_dim"],    jc["v_head_dim"],  jc["rms_norm_eps"]};
    const ops::IndexerConfig ic{jc["index_n_heads"], jc["index_head_dim"], jc["index_kpool"],
                                jc["index_topk"], true};
    const ops::DsaParams params = golden_dsa_params(f, c);
    EXPECT_EQ(params.mla.o_proj.bias.defined(), bool(jc["attention_bias"]));

    const Tensor x = f.tensor(c + ".x"), cu = f.tensor(c + ".cu_seqlens");
    ops::MlaContext ctx;
    const ops::DsaOutput out = ops::dsa_forward(mc, ic, params, x, cu, Tensor(), ctx);
    EXPECT_LE(rel_err(out.y, f.tensor(c + ".attn_out")), 1e-4);
    const Tensor ref_idx = f.tensor(c + ".indices");
    for (int64_t r = 0; r < x.size(0); ++r)
      ASSERT_EQ(row_set(out.indices, r), row_set(ref_idx, r)) << "row " << r;

    ops::DsaParams grads;
    const Tensor dx = ops::dsa_backward(mc, params, ctx, f.tensor(c + ".attn_dy"), grads);
    EXPECT_LE(rel_err(dx, f.tensor(c + ".attn_dx")), 1e-4);
    // The reference gives gradients to exactly the MLA parameters present, never the indexer's.
    std::set<std::string> ours;
    for (const Field& g : mla_fields(grads.mla, grads.mla)) {
      if (!g.a->defined()) continue;
      ours.insert(g.name);
      SCOPED_TRACE(g.name);
      EXPECT_LE(rel_err(*g.a, f.tensor(c + ".attn_grad." + g.name)), 1e-4);
    }
    EXPECT_EQ(ours, meta[c + ".attn_grads"].get<std::set<std::string>>());
    expect_indexer_untouched(grads);
  }
}

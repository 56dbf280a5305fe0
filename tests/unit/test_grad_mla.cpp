// Backward of the sparse NoPE MLA / DSA mixer: float64 central finite differences of the attention
// core (random selections with duplicates, holes and an empty row) and of the whole mixer on packs
// where the indexer drops keys, no gradient through the indexer, and the reference's autograd
// gradients (fixtures from tools/golden/grads_dsa_moe.py).

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "glmtune/io/safetensors.h"
#include "glmtune/ops/mla.h"
#include "glmtune/tensor/rng.h"

using namespace glmtune;

namespace {

const std::string kGolden =
    std::string(GLMTUNE_SOURCE_DIR) + "/tests/golden/ops/grads_dsa_moe.safetensors";

uint64_t test_seed() {
  static const uint64_t seed = std::random_device{}();
  return seed;
}

// max |a − b| / max |b|: the parity measure of SPEC.md §7.
double rel_err(const Tensor& a, const Tensor& b) {
  EXPECT_EQ(a.shape(), b.shape());
  const std::vector<double> x = a.to_doubles(), y = b.to_doubles();
  double diff = 0, ref = 0;
  for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
    diff = std::max(diff, std::abs(x[i] - y[i]));
    ref = std::max(ref, std::abs(y[i]));
  }
  return ref > 0 ? diff / ref : diff;
}

Tensor random_normal(const Shape& shape, uint64_t offset, double std = 1, DType dt = DType::f64) {
  Tensor t = Tensor::empty(shape, dt);
  fill_normal(t, test_seed(), offset, 0.0, std);
  return t;
}

double dot(const Tensor& a, const Tensor& b) {
  const std::vector<double> x = a.to_doubles(), y = b.to_doubles();
  double s = 0;
  for (size_t i = 0; i < x.size(); ++i) s += x[i] * y[i];
  return s;
}

// Central differences of `loss` at every entry of `t` (contiguous f64, perturbed in place).
// `valid(i)` (optional) is asked after both evaluations of entry i; entries it rejects are NaN.
Tensor finite_differences(Tensor& t, const std::function<double()>& loss,
                          const std::function<bool()>& valid = nullptr, double h = 1e-6) {
  double* p = t.data<double>();
  Tensor fd = Tensor::empty(t.shape(), DType::f64);
  double* f = fd.data<double>();
  for (int64_t i = 0; i < t.numel(); ++i) {
    const double v = p[i];
    bool ok = true;
    p[i] = v + h;
    const double up = loss();
    if (valid) ok &= valid();
    p[i] = v - h;
    const double down = loss();
    if (valid) ok &= valid();
    p[i] = v;
    f[i] = ok ? (up - down) / (2 * h) : NAN;
  }
  return fd;
}

double fd_rel_err(Tensor& t, const Tensor& grad, const std::function<double()>& loss) {
  EXPECT_TRUE(grad.defined());
  if (!grad.defined()) return INFINITY;
  return rel_err(grad, finite_differences(t, loss));
}

Tensor cu_seqlens(const std::vector<int32_t>& lens) {
  std::vector<int32_t> cu(lens.size() + 1, 0);
  std::partial_sum(lens.begin(), lens.end(), cu.begin() + 1);
  return Tensor::from_vector(cu, {int64_t(cu.size())});
}

std::set<int64_t> row_set(const Tensor& idx, int64_t r) {
  std::set<int64_t> s;
  for (int64_t k = 0; k < idx.size(1); ++k)
    if (idx.item({r, k}) >= 0) s.insert(int64_t(idx.item({r, k})));
  return s;
}

// Every MLA parameter with its released name (under `self_attn.`).
const std::vector<std::pair<std::string, Tensor ops::MlaParams::*>> kMlaFields = {
    {"q_a_proj.weight", &ops::MlaParams::q_a_proj},
    {"q_a_proj.bias", &ops::MlaParams::q_a_proj_bias},
    {"q_a_layernorm.weight", &ops::MlaParams::q_a_layernorm},
    {"q_b_proj.weight", &ops::MlaParams::q_b_proj},
    {"kv_a_proj_with_mqa.weight", &ops::MlaParams::kv_a_proj_with_mqa},
    {"kv_a_proj_with_mqa.bias", &ops::MlaParams::kv_a_proj_with_mqa_bias},
    {"kv_a_layernorm.weight", &ops::MlaParams::kv_a_layernorm},
    {"kv_b_proj.weight", &ops::MlaParams::kv_b_proj},
    {"o_proj.weight", &ops::MlaParams::o_proj},
    {"o_proj.bias", &ops::MlaParams::o_proj_bias},
};

const std::vector<std::pair<std::string, Tensor ops::IndexerParams::*>> kIndexerFields = {
    {"wq_b.weight", &ops::IndexerParams::wq_b},
    {"wk.weight", &ops::IndexerParams::wk},
    {"k_norm.weight", &ops::IndexerParams::k_norm_weight},
    {"k_norm.bias", &ops::IndexerParams::k_norm_bias},
    {"weights_proj.weight", &ops::IndexerParams::weights_proj},
    {"index_kpool_compress_ape", &ops::IndexerParams::kpool_ape},
    {"index_kpool_compress_gate", &ops::IndexerParams::kpool_gate},
};

ops::DsaParams random_params(const ops::MlaConfig& m, const ops::IndexerConfig& ic, int64_t dim,
                             bool bias, uint64_t offset) {
  const int64_t nh = m.n_heads, rq = m.q_lora_rank, rkv = m.kv_lora_rank;
  const int64_t dn = m.qk_nope_head_dim, dv = m.v_head_dim;
  auto w = [&](const Shape& s, uint64_t o) {
    return random_normal(s, offset + o, 1 / std::sqrt(double(s.back())));
  };
  // Norm weights near 1 but not 1, so that a missing weight factor shows.
  auto norm = [&](int64_t n, uint64_t o) {
    Tensor t = random_normal({n}, offset + o, 0.2);
    for (int64_t i = 0; i < n; ++i) t.set_item({i}, 1 + t.item({i}));
    return t;
  };
  ops::DsaParams d;
  d.mla.q_a_proj = w({rq, dim}, 0);
  d.mla.q_a_layernorm = norm(rq, 1000);
  d.mla.q_b_proj = w({nh * dn, rq}, 2000);
  d.mla.kv_a_proj_with_mqa = w({rkv, dim}, 3000);
  d.mla.kv_a_layernorm = norm(rkv, 4000);
  d.mla.kv_b_proj = w({nh * (dn + dv), rkv}, 5000);
  d.mla.o_proj = w({dim, nh * dv}, 6000);
  if (bias) {
    d.mla.q_a_proj_bias = random_normal({rq}, offset + 7000, 0.2);
    d.mla.kv_a_proj_with_mqa_bias = random_normal({rkv}, offset + 8000, 0.2);
    d.mla.o_proj_bias = random_normal({dim}, offset + 9000, 0.2);
  }
  const int64_t id = ic.head_dim, ih = ic.n_heads;
  d.indexer.wq_b = w({ih * id, rq}, 10000);
  d.indexer.wk = w({id, dim}, 11000);
  d.indexer.k_norm_weight = norm(id, 12000);
  d.indexer.k_norm_bias = random_normal({id}, offset + 13000, 0.2);
  d.indexer.weights_proj = w({ih, dim}, 14000);
  d.indexer.kpool_ape = random_normal({ic.kpool, id}, offset + 15000, 0.5);
  d.indexer.kpool_gate = w({id, dim}, 16000);
  return d;
}

void expect_indexer_untouched(const ops::DsaParams& grads) {
  for (const auto& [name, field] : kIndexerFields)
    EXPECT_FALSE((grads.indexer.*field).defined()) << "indexer " << name << " got a gradient";
}

}  // namespace

TEST(GradMla, AttentionCoreFiniteDifferences) {
  SCOPED_TRACE("seed " + std::to_string(test_seed()));
  const std::vector<int32_t> lens = {7, 1, 0, 12};
  const int64_t total = 20, heads = 2, dqk = 3, dv = 4, width = 6;
  std::mt19937_64 gen(test_seed());
  // Arbitrary selections inside each document: not causal, with duplicates, −1 holes, and one
  // row (token 10) that selects nothing.
  std::vector<int32_t> idx(size_t(total * width), -1);
  int64_t start = 0;
  for (int32_t len : lens) {
    for (int64_t s = 0; s < len; ++s)
      for (int64_t w = 0; w < width; ++w)
        if (gen() % 4 != 0) idx[size_t((start + s) * width + w)] = int32_t(start + gen() % len);
    start += len;
  }
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
  SCOPED_TRACE("seed " + std::to_string(test_seed()));
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
  SCOPED_TRACE("seed " + std::to_string(test_seed()));
  const ops::MlaConfig mc{2, 6, 5, 3, 4, 1e-5};
  const ops::IndexerConfig ic{2, 4, 2, 4, true};  // a query sees at most 4 + 1 keys
  const int64_t dim = 8;
  const std::vector<int32_t> lens = {5, 11, 9};
  const int64_t total = 25;
  const Tensor cu = cu_seqlens(lens);
  for (bool bias : {true, false}) {
    SCOPED_TRACE(bias ? "attention_bias" : "no bias");
    ops::DsaParams p = random_params(mc, ic, dim, bias, bias ? 1 : 100000);
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
    for (const auto& [name, field] : kMlaFields)
      EXPECT_EQ((grads.mla.*field).defined(), (p.mla.*field).defined()) << name;

    // Selection held fixed: the function the backward differentiates.
    const auto loss = [&] { return dot(dy, ops::mla_forward(mc, p.mla, x, indices, cu).y); };
    EXPECT_LE(fd_rel_err(x, dx, loss), 1e-6);
    for (const auto& [name, field] : kMlaFields) {
      if (!(p.mla.*field).defined()) continue;
      SCOPED_TRACE(name);
      EXPECT_LE(fd_rel_err(p.mla.*field, grads.mla.*field, loss), 1e-6);
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
    for (const auto& [name, field] : kIndexerFields) {
      const std::vector<double> f =
          finite_differences(p.indexer.*field, live_loss, same_selection).to_doubles();
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
  const io::SafetensorsFile f = io::SafetensorsFile::open(kGolden);
  const nlohmann::json meta = nlohmann::json::parse(f.metadata().at("fixture"));
  for (const std::string c : {"a", "b"}) {
    SCOPED_TRACE("config " + c);
    const nlohmann::json& jc = meta["configs"][c];
    const ops::MlaConfig mc{jc["num_attention_heads"], jc["q_lora_rank"], jc["kv_lora_rank"],
                            jc["qk_nope_head_dim"],    jc["v_head_dim"],  jc["rms_norm_eps"]};
    const ops::IndexerConfig ic{jc["index_n_heads"], jc["index_head_dim"], jc["index_kpool"],
                                jc["index_topk"], true};
    const std::string p = c + ".attn.";
    ops::DsaParams params;
    for (const auto& [name, field] : kMlaFields)
      if (f.contains(p + name)) params.mla.*field = f.tensor(p + name);
    for (const auto& [name, field] : kIndexerFields)
      params.indexer.*field = f.tensor(p + "indexer." + name);
    EXPECT_EQ(params.mla.o_proj_bias.defined(), bool(jc["attention_bias"]));

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
    for (const auto& [name, field] : kMlaFields) {
      if (!(grads.mla.*field).defined()) continue;
      ours.insert(name);
      SCOPED_TRACE(name);
      EXPECT_LE(rel_err(grads.mla.*field, f.tensor(c + ".attn_grad." + name)), 1e-4);
    }
    EXPECT_EQ(ours, meta[c + ".attn_grads"].get<std::set<std::string>>());
    expect_indexer_untouched(grads);
  }
}

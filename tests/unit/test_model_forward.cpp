// The whole text model forward: packed multi-document parity with transformers 5.17.0 (golden
// fixtures from tools/golden/model_forward.py and tools/golden/model_forward_geometry2.py),
// pack/document independence, padding, MTP against a direct composition, the loss helpers and
// `glmtune eval`.

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <set>

#include "glmtune/base/error.h"
#include "glmtune/data/tokenizer.h"
#include "glmtune/io/checkpoint.h"
#include "glmtune/io/safetensors.h"
#include "glmtune/model/init.h"
#include "glmtune/model/loss.h"
#include "glmtune/model/param_store.h"
#include "glmtune/model/text/model.h"
#include "glmtune/ops/cross_entropy.h"
#include "glmtune/ops/linear.h"
#include "glmtune/ops/mhc.h"
#include "glmtune/ops/mla.h"
#include "glmtune/ops/moe.h"
#include "support/cli.h"
#include "support/temp_dir.h"

using namespace glmtune;
using namespace glmtune::model;
using namespace glmtune::model::text;
namespace fs = std::filesystem;

namespace {

using glmtune::test::TempDir;

const fs::path kSource = GLMTUNE_SOURCE_DIR;
const fs::path kGolden = kSource / "tests" / "golden" / "model" / "tiny_forward.safetensors";

uint64_t test_seed() {
  static const uint64_t seed = std::random_device{}();
  return seed;
}

Tensor i32(const std::vector<int32_t>& v) { return Tensor::from_vector(v, {int64_t(v.size())}); }

std::vector<int32_t> ints(const Tensor& t) {
  const Tensor c = t.contiguous();
  return std::vector<int32_t>(c.data<int32_t>(), c.data<int32_t>() + c.numel());
}

// max |a − ref| / max |ref|, the relative error of docs/testing.md, "Parity measures".
double rel_err(const Tensor& a, const Tensor& ref) {
  const std::vector<double> x = a.to_doubles(), y = ref.to_doubles();
  EXPECT_EQ(x.size(), y.size());
  double diff = 0, scale = 0;
  for (size_t i = 0; i < std::min(x.size(), y.size()); ++i) {
    diff = std::max(diff, std::abs(x[i] - y[i]));
    scale = std::max(scale, std::abs(y[i]));
  }
  return scale > 0 ? diff / scale : diff;
}

Tensor rows(const Tensor& t, int64_t start, int64_t end) { return t.slice(0, start, end); }

// The reference-derived model of the golden fixture, built once: the tiny preset with the
// fixture's init overrides, written with the fixture's seed, the fixture's redrawn parameters put
// into the store.
struct GoldenEnv {
  TempDir dir{"golden"};
  io::SafetensorsFile golden = io::SafetensorsFile::open(kGolden);
  ModelConfig config = ModelConfig::preset("tiny");
  std::unique_ptr<ParamStore> store;
  std::unique_ptr<TextModel> f32, f64;
  uint64_t init_seed = 0;

  GoldenEnv() {
    const auto meta = nlohmann::json::parse(golden.metadata().at("fixture"));
    EXPECT_EQ(meta.at("preset").get<std::string>(), "tiny");
    for (const auto& item : meta.at("init_sets")) {
      const std::string s = item.get<std::string>();
      const size_t eq = s.find('=');
      config.set(s.substr(0, eq), s.substr(eq + 1));
    }
    init_seed = meta.at("init_seed").get<uint64_t>();
    InitOptions options;
    options.seed = init_seed;
    write_random_checkpoint(config, dir.path() / "ck", options);
    const io::CheckpointReader reader = io::CheckpointReader::open(dir.path() / "ck");
    store = std::make_unique<ParamStore>(ParamStore::load(reader, config));
    int replaced = 0;
    for (const std::string& name : golden.names()) {
      if (!name.starts_with("param.")) continue;
      const std::string param = name.substr(6);
      EXPECT_TRUE(store->contains(param)) << param;
      if (!store->contains(param)) continue;
      EXPECT_EQ(store->get(param).shape(), golden.tensor(name).shape()) << param;
      store->get(param) = golden.tensor(name).clone();
      ++replaced;
    }
    EXPECT_GT(replaced, 30);
    f32 = std::make_unique<TextModel>(*store);
    f64 = std::make_unique<TextModel>(*store, TextModelOptions{DType::f64});
  }
};

GoldenEnv& env() {
  static GoldenEnv e;
  return e;
}

// Random token ids of `lengths` documents, avoiding the padding id (its embedding row is zero).
std::vector<int32_t> random_ids(std::mt19937_64& rng, const std::vector<int64_t>& lengths,
                                const TextConfig& c) {
  std::uniform_int_distribution<int32_t> tok(0, int32_t(c.vocab_size) - 1);
  std::vector<int32_t> ids;
  for (int64_t n : lengths)
    for (int64_t i = 0; i < n; ++i) {
      int32_t t = tok(rng);
      while (t == c.pad_token_id) t = tok(rng);
      ids.push_back(t);
    }
  return ids;
}

std::vector<int32_t> offsets(const std::vector<int64_t>& lengths) {
  std::vector<int32_t> cu = {0};
  for (int64_t n : lengths) cu.push_back(cu.back() + int32_t(n));
  return cu;
}

std::vector<std::set<int32_t>> row_sets(const Tensor& indices) {
  const Tensor c = indices.contiguous();
  std::vector<std::set<int32_t>> out(size_t(c.size(0)));
  const int32_t* p = c.data<int32_t>();
  for (int64_t r = 0; r < c.size(0); ++r)
    for (int64_t j = 0; j < c.size(1); ++j)
      if (p[r * c.size(1) + j] >= 0) out[r].insert(p[r * c.size(1) + j]);
  return out;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Parity with the reference.

TEST(ModelForward, PackedForwardMatchesReferencePerDocument) {
  GoldenEnv& e = env();
  const Tensor ids = e.golden.tensor("input_ids");
  const Tensor cu = e.golden.tensor("cu_seqlens");
  const Tensor labels = next_token_labels(ids, cu, e.golden.tensor("trained"));
  EXPECT_EQ(ints(labels), ints(e.golden.tensor("labels")));

  ForwardOptions opt;
  opt.save = SavePolicy::all;
  const ForwardOutput out = e.f32->forward({ids, cu, Tensor(), labels}, opt);
  const double logits_err = rel_err(out.logits, e.golden.tensor("logits"));
  EXPECT_LE(logits_err, 1e-4);
  EXPECT_LE(rel_err(out.hidden, e.golden.tensor("hidden")), 1e-4);
  const ForwardContext& ctx = *out.context;
  // A layer's output is the next layer's input.
  EXPECT_LE(rel_err(ctx.layers[1].streams_in, e.golden.tensor("layer0_out")), 1e-4);
  EXPECT_LE(rel_err(ctx.layers[4].streams_in, e.golden.tensor("layer3_out")), 1e-4);
  EXPECT_EQ(row_sets(ctx.layers[3].indices), row_sets(e.golden.tensor("layer3_indices")));

  const Tensor counts = e.golden.tensor("expert_counts");
  ASSERT_EQ(int64_t(out.expert_counts.size()), counts.size(0));
  EXPECT_EQ(out.moe_layers, (std::vector<int64_t>{1, 2, 3, 4}));
  for (size_t j = 0; j < out.expert_counts.size(); ++j)
    EXPECT_EQ(out.expert_counts[j].to_doubles(), counts.select(0, int64_t(j)).to_doubles())
        << "MoE layer " << out.moe_layers[j];

  const double ref_loss = e.golden.tensor("loss").item({0});
  ASSERT_TRUE(out.lm.has_value());
  EXPECT_NEAR(out.loss(), ref_loss, 1e-5);
  const std::vector<double> targets = e.golden.tensor("doc_targets").to_doubles();
  EXPECT_EQ(out.lm->count, int64_t(std::accumulate(targets.begin(), targets.end(), 0.0)));
  std::printf("golden: logits rel err %.3g, loss %.8f (reference %.8f)\n", logits_err, out.loss(),
              ref_loss);

  // The chunked loss (no [T, V] logits) gives the same value.
  ForwardOptions chunked;
  chunked.logits = false;
  chunked.loss_chunk_rows = 7;
  const ForwardOutput c2 = e.f32->forward({ids, cu, Tensor(), labels}, chunked);
  EXPECT_FALSE(c2.logits.defined());
  EXPECT_EQ(c2.lm->count, out.lm->count);
  EXPECT_NEAR(c2.loss(), out.loss(), 1e-6);
}

TEST(ModelForward, DocumentsOfTheGoldenPackAloneMatchTheReference) {
  GoldenEnv& e = env();
  const std::vector<int32_t> ids = ints(e.golden.tensor("input_ids"));
  const std::vector<int32_t> cu = ints(e.golden.tensor("cu_seqlens"));
  const Tensor logits = e.golden.tensor("logits");
  for (size_t d = 0; d + 1 < cu.size(); ++d) {
    std::vector<int32_t> doc(ids.begin() + cu[d], ids.begin() + cu[d + 1]);
    const ForwardOutput out = e.f32->forward({i32(doc), i32({0, int32_t(doc.size())})});
    EXPECT_LE(rel_err(out.logits, rows(logits, cu[d], cu[d + 1])), 1e-4) << "document " << d;
  }
}

// ---------------------------------------------------------------------------------------------
// Packing semantics (f64, where selections have no near-ties between two runs).

TEST(ModelForward, PackEqualsEachDocumentAlone) {
  GoldenEnv& e = env();
  const uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  std::vector<int64_t> lengths = {1, 2, 5, 12, 31, 66};
  std::shuffle(lengths.begin(), lengths.end(), rng);
  const std::vector<int32_t> ids = random_ids(rng, lengths, e.config.text());
  const std::vector<int32_t> cu = offsets(lengths);
  const Tensor labels = next_token_labels(i32(ids), i32(cu));
  ForwardOptions opt;
  opt.mtp_logits = true;
  const ForwardOutput pack = e.f64->forward({i32(ids), i32(cu), Tensor(), labels}, opt);
  double lm_sum = 0, mtp_sum = 0;
  std::vector<std::vector<double>> counts(pack.expert_counts.size());
  std::vector<double> mtp_counts;
  for (size_t d = 0; d < lengths.size(); ++d) {
    std::vector<int32_t> doc(ids.begin() + cu[d], ids.begin() + cu[d + 1]);
    const Tensor dcu = i32({0, int32_t(doc.size())});
    const ForwardOutput alone =
        e.f64->forward({i32(doc), dcu, Tensor(), next_token_labels(i32(doc), dcu)}, opt);
    SCOPED_TRACE("document of " + std::to_string(doc.size()) + " tokens");
    EXPECT_LE(rel_err(rows(pack.logits, cu[d], cu[d + 1]), alone.logits), 1e-10);
    EXPECT_LE(rel_err(rows(pack.hidden, cu[d], cu[d + 1]), alone.hidden), 1e-10);
    EXPECT_LE(rel_err(rows(pack.mtp->logits[0], cu[d], cu[d + 1]), alone.mtp->logits[0]), 1e-10);
    lm_sum += alone.lm->sum;
    mtp_sum += alone.mtp->ce[0].sum;
    for (size_t j = 0; j < counts.size(); ++j) {
      const std::vector<double> c = alone.expert_counts[j].to_doubles();
      counts[j].resize(c.size(), 0.0);
      for (size_t x = 0; x < c.size(); ++x) counts[j][x] += c[x];
    }
    const std::vector<double> mc = alone.mtp->expert_counts[0].to_doubles();
    mtp_counts.resize(mc.size(), 0.0);
    for (size_t x = 0; x < mc.size(); ++x) mtp_counts[x] += mc[x];
  }
  EXPECT_NEAR(pack.lm->sum, lm_sum, 1e-9 * std::abs(lm_sum));
  EXPECT_NEAR(pack.mtp->ce[0].sum, mtp_sum, 1e-9 * std::abs(mtp_sum));
  for (size_t j = 0; j < counts.size(); ++j)
    EXPECT_EQ(pack.expert_counts[j].to_doubles(), counts[j]) << "MoE layer " << j;
  EXPECT_EQ(pack.mtp->expert_counts[0].to_doubles(), mtp_counts);
}

TEST(ModelForward, TrailingPaddingDocumentChangesNothing) {
  GoldenEnv& e = env();
  const uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed + 1);
  const std::vector<int64_t> lengths = {20, 9, 41};
  std::vector<int32_t> ids = random_ids(rng, lengths, e.config.text());
  const std::vector<int32_t> cu = offsets(lengths);
  const Tensor labels = next_token_labels(i32(ids), i32(cu));
  const ForwardOutput plain = e.f64->forward({i32(ids), i32(cu), Tensor(), labels});

  const int32_t pad_len = 13;
  std::vector<int32_t> padded = ids;
  padded.insert(padded.end(), pad_len, int32_t(e.config.text().pad_token_id));
  std::vector<int32_t> pcu = cu;
  pcu.push_back(pcu.back() + pad_len);
  std::vector<int32_t> trained(padded.size(), 1);
  std::fill(trained.end() - pad_len, trained.end(), 0);
  const Tensor plabels = next_token_labels(i32(padded), i32(pcu), i32(trained));
  PackInput in{i32(padded), i32(pcu), Tensor(), plabels, pad_len};
  const ForwardOutput out = e.f64->forward(in);

  const int64_t n = int64_t(ids.size());
  EXPECT_LE(rel_err(rows(out.logits, 0, n), plain.logits), 1e-10);
  EXPECT_EQ(out.lm->count, plain.lm->count);
  EXPECT_NEAR(out.lm->sum, plain.lm->sum, 1e-9 * std::abs(plain.lm->sum));
  EXPECT_NEAR(out.mtp->loss, plain.mtp->loss, 1e-10);
  const int64_t k = e.config.text().num_experts_per_tok;
  for (size_t j = 0; j < out.expert_counts.size(); ++j) {
    EXPECT_EQ(out.expert_counts[j].to_doubles(), plain.expert_counts[j].to_doubles());
    const std::vector<double> c = out.expert_counts[j].to_doubles();
    EXPECT_EQ(std::accumulate(c.begin(), c.end(), 0.0), double(n * k));
  }
  EXPECT_EQ(out.mtp->expert_counts[0].to_doubles(), plain.mtp->expert_counts[0].to_doubles());

  // Without being told, the padding rows count like any other.
  in.padding_tokens = 0;
  const ForwardOutput counted = e.f64->forward(in);
  const std::vector<double> c = counted.expert_counts[0].to_doubles();
  EXPECT_EQ(std::accumulate(c.begin(), c.end(), 0.0), double((n + pad_len) * k));
}

TEST(ModelForward, SuppliedEmbeddingsReplaceTheLookup) {
  GoldenEnv& e = env();
  std::mt19937_64 rng(test_seed() + 2);
  SCOPED_TRACE("seed " + std::to_string(test_seed()));
  const std::vector<int64_t> lengths = {7, 18};
  const std::vector<int32_t> ids = random_ids(rng, lengths, e.config.text());
  const std::vector<int32_t> cu = offsets(lengths);
  ForwardOptions opt;
  opt.mtp = false;
  const ForwardOutput a = e.f64->forward({i32(ids), i32(cu)}, opt);
  // The looked-up embeddings, passed in f32 (converted back exactly: the table holds bf16 values).
  const Tensor emb = e.f64->embed(i32(ids)).to(DType::f32);
  const ForwardOutput b = e.f64->forward({i32(ids), i32(cu), emb}, opt);
  EXPECT_LE(rel_err(b.logits, a.logits), 1e-14);
}

// ---------------------------------------------------------------------------------------------
// MTP.

namespace {

// Direct f64 composition of MTP (docs/model/text_model.md, "MTP") for one document alone, written
// with plain loops
// around the module-level ops: returns the per-depth head-norm outputs and logits, and the CE sum
// and count of each depth.
struct DirectMtp {
  std::vector<std::vector<double>> hidden;  // per depth, [n·D]
  std::vector<std::vector<double>> logits;  // per depth, [n·V]
  std::vector<double> ce_sum;
  std::vector<int64_t> ce_count;
};

std::vector<double> values(const Tensor& t) { return t.to_doubles(); }

void rmsnorm_rows(std::vector<double>& x, const std::vector<double>& w, int64_t n, int64_t dim,
                  double eps) {
  for (int64_t i = 0; i < n; ++i) {
    double ss = 0;
    for (int64_t d = 0; d < dim; ++d) ss += x[i * dim + d] * x[i * dim + d];
    const double r = 1.0 / std::sqrt(ss / double(dim) + eps);
    for (int64_t d = 0; d < dim; ++d) x[i * dim + d] = w[d] * (x[i * dim + d] * r);
  }
}

Tensor as_tensor(const std::vector<double>& v, int64_t n, int64_t dim) {
  return Tensor::from_vector(v, {n, dim});
}

DirectMtp direct_mtp(const TextModel& model, const std::vector<int32_t>& doc,
                     const std::vector<int32_t>& trained, const Tensor& main_hidden,
                     int64_t depths) {
  const TextConfig& c = model.text();
  const TextWeights& w = model.weights();
  const MtpWeights& m = *w.mtp;
  const int64_t n = int64_t(doc.size()), dim = c.hidden_size, vocab = c.vocab_size;
  const std::vector<double> table = values(w.embed_tokens), head = values(w.lm_head.weight);
  const std::vector<double> eh = values(m.eh_proj.weight);
  DirectMtp out;
  std::vector<double> h = values(main_hidden);
  for (int64_t k = 1; k <= depths; ++k) {
    // Embedding of token i + k of this document, or of id 0 past its end.
    std::vector<double> e(size_t(n * dim));
    for (int64_t i = 0; i < n; ++i) {
      const int64_t id = i + k < n ? doc[i + k] : 0;
      for (int64_t d = 0; d < dim; ++d) e[i * dim + d] = table[id * dim + d];
    }
    std::vector<double> hn = h;
    rmsnorm_rows(e, values(m.enorm), n, dim, c.rms_norm_eps);
    rmsnorm_rows(hn, values(m.hnorm), n, dim, c.rms_norm_eps);
    std::vector<double> x(size_t(n * dim), 0.0);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t o = 0; o < dim; ++o) {
        double s = 0;
        for (int64_t d = 0; d < dim; ++d) s += eh[o * 2 * dim + d] * e[i * dim + d];
        for (int64_t d = 0; d < dim; ++d) s += eh[o * 2 * dim + dim + d] * hn[i * dim + d];
        x[i * dim + o] = s;
      }
    std::vector<double> u = x;
    rmsnorm_rows(u, values(m.input_layernorm), n, dim, c.rms_norm_eps);
    const OpConfigs& cfg = model.op_configs();
    const Tensor cu = i32({0, int32_t(n)});
    const std::vector<double> y =
        values(ops::dsa_forward(cfg.mla, cfg.indexer, m.dsa, as_tensor(u, n, dim), cu).y);
    std::vector<double> a(size_t(n * dim));
    for (size_t i = 0; i < a.size(); ++i) a[i] = x[i] + y[i];
    std::vector<double> v = a;
    rmsnorm_rows(v, values(m.post_attention_layernorm), n, dim, c.rms_norm_eps);
    const std::vector<double> z = values(ops::moe_forward(cfg.moe, m.moe, as_tensor(v, n, dim)).y);
    std::vector<double> b(size_t(n * dim));
    for (size_t i = 0; i < b.size(); ++i) b[i] = a[i] + z[i];
    rmsnorm_rows(b, values(m.shared_head_norm), n, dim, c.rms_norm_eps);
    std::vector<double> logits(size_t(n * vocab));
    for (int64_t i = 0; i < n; ++i)
      for (int64_t t = 0; t < vocab; ++t) {
        double s = 0;
        for (int64_t d = 0; d < dim; ++d) s += head[t * dim + d] * b[i * dim + d];
        logits[i * vocab + t] = s;
      }
    // Target of position i at depth k: token i + k + 1 of the document, when trained.
    double sum = 0;
    int64_t count = 0;
    for (int64_t i = 0; i + k + 1 < n; ++i) {
      if (!trained[i + k + 1]) continue;
      double mx = -INFINITY, se = 0;
      for (int64_t t = 0; t < vocab; ++t) mx = std::max(mx, logits[i * vocab + t]);
      for (int64_t t = 0; t < vocab; ++t) se += std::exp(logits[i * vocab + t] - mx);
      sum += mx + std::log(se) - logits[i * vocab + doc[i + k + 1]];
      ++count;
    }
    out.hidden.push_back(b);
    out.logits.push_back(std::move(logits));
    out.ce_sum.push_back(sum);
    out.ce_count.push_back(count);
    h = std::move(b);
  }
  return out;
}

double rel_err(const std::vector<double>& a, const std::vector<double>& ref) {
  double diff = 0, scale = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    diff = std::max(diff, std::abs(a[i] - ref[i]));
    scale = std::max(scale, std::abs(ref[i]));
  }
  return scale > 0 ? diff / scale : diff;
}

// Moves the MTP layer's constant-initialised parameters (norm weights, indexer ape / gate /
// k_norm, correction bias) away from their init values, so that a mix-up between them shows.
void perturb_mtp(TextModel& model, std::mt19937_64& rng) {
  const std::string p = layer_prefix(model.text().num_hidden_layers);
  std::normal_distribution<double> n01(0.0, 1.0);
  for (auto& [name, t] : model.weights().named) {
    if (!name.starts_with(p)) continue;
    const bool ape_or_gate =
        name.ends_with("index_kpool_compress_ape") || name.ends_with("index_kpool_compress_gate");
    if (t.dim() != 1 && !ape_or_gate) continue;
    double* v = t.data<double>();
    const double scale = name.ends_with("e_score_correction_bias") ? 0.05 : 0.3;
    for (int64_t i = 0; i < t.numel(); ++i) v[i] += scale * n01(rng);
  }
}

}  // namespace

TEST(Mtp, MatchesDirectCompositionPerDocument) {
  GoldenEnv& e = env();
  const uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed + 3);
  TextModel model(*e.store, TextModelOptions{DType::f64});
  ASSERT_TRUE(model.has_mtp());
  perturb_mtp(model, rng);
  const std::vector<int64_t> lengths = {3, 1, 27, 58};
  const std::vector<int32_t> ids = random_ids(rng, lengths, model.text());
  const std::vector<int32_t> cu = offsets(lengths);
  std::vector<int32_t> trained(ids.size(), 1);
  std::bernoulli_distribution drop(0.25);
  for (auto& t : trained) t = drop(rng) ? 0 : 1;
  const Tensor labels = next_token_labels(i32(ids), i32(cu), i32(trained));
  ForwardOptions opt;
  opt.mtp_depths = 2;
  opt.mtp_logits = true;
  const ForwardOutput out = model.forward({i32(ids), i32(cu), Tensor(), labels}, opt);
  ASSERT_TRUE(out.mtp.has_value());
  ASSERT_EQ(out.mtp->hidden.size(), 2u);
  std::vector<double> sum(2, 0.0);
  std::vector<int64_t> count(2, 0);
  for (size_t d = 0; d < lengths.size(); ++d) {
    SCOPED_TRACE("document " + std::to_string(d));
    const std::vector<int32_t> doc(ids.begin() + cu[d], ids.begin() + cu[d + 1]);
    const std::vector<int32_t> tr(trained.begin() + cu[d], trained.begin() + cu[d + 1]);
    const DirectMtp ref = direct_mtp(model, doc, tr, rows(out.hidden, cu[d], cu[d + 1]), 2);
    for (int k = 0; k < 2; ++k) {
      EXPECT_LE(rel_err(values(rows(out.mtp->hidden[k], cu[d], cu[d + 1])), ref.hidden[k]), 1e-10)
          << "depth " << k + 1;
      EXPECT_LE(rel_err(values(rows(out.mtp->logits[k], cu[d], cu[d + 1])), ref.logits[k]), 1e-10)
          << "depth " << k + 1;
      sum[k] += ref.ce_sum[k];
      count[k] += ref.ce_count[k];
    }
  }
  for (int k = 0; k < 2; ++k) {
    EXPECT_EQ(out.mtp->ce[k].count, count[k]) << "depth " << k + 1;
    EXPECT_NEAR(out.mtp->ce[k].sum, sum[k], 1e-9 * sum[k]) << "depth " << k + 1;
  }
  const double expected = 0.1 * (sum[0] / count[0] + sum[1] / count[1]) / 2;
  EXPECT_NEAR(out.mtp->loss, expected, 1e-10);
}

TEST(Mtp, FollowsTheSeedAlignment) {
  GoldenEnv& e = env();
  const uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed + 4);
  const TextModel& model = *e.f64;
  const std::vector<int64_t> lengths = {6, 15, 30};
  std::vector<int32_t> ids = random_ids(rng, lengths, model.text());
  const std::vector<int32_t> cu = offsets(lengths);
  const std::vector<int64_t> bounds(cu.begin(), cu.end());
  const int64_t dim = model.text().hidden_size;

  // Future embeddings: token i + 1 of the same document, token id 0 at a document's last position.
  const Tensor fut = model.future_embeddings(i32(ids), Tensor(), bounds, 1);
  const Tensor table = model.weights().embed_tokens;
  for (size_t d = 0; d + 1 < cu.size(); ++d)
    for (int32_t i = cu[d]; i < cu[d + 1]; ++i) {
      const int64_t id = i + 1 < cu[d + 1] ? ids[i + 1] : 0;
      EXPECT_EQ(fut.select(0, i).to_doubles(), table.select(0, id).to_doubles()) << "row " << i;
    }
  // Supplied embeddings: the next row of the same document, a zero vector past its end.
  const Tensor supplied = model.embed(i32(ids));
  const Tensor sfut = model.future_embeddings(Tensor(), supplied, bounds, 1);
  for (size_t d = 0; d + 1 < cu.size(); ++d) {
    const int32_t last = cu[d + 1] - 1;
    EXPECT_EQ(sfut.select(0, last).to_doubles(), std::vector<double>(size_t(dim), 0.0));
    EXPECT_EQ(sfut.select(0, cu[d]).to_doubles(), supplied.select(0, cu[d] + 1).to_doubles());
  }

  // Targets: t_{i+2} of the same document.
  const Tensor labels = next_token_labels(i32(ids), i32(cu));
  const std::vector<int32_t> mtp_labels = ints(shift_labels(labels, i32(cu), 1));
  for (size_t d = 0; d + 1 < cu.size(); ++d)
    for (int32_t i = cu[d]; i < cu[d + 1]; ++i)
      EXPECT_EQ(mtp_labels[i], i + 2 < cu[d + 1] ? ids[i + 2] : kIgnoreLabel) << "row " << i;

  // Changing token j of document 1 changes MTP outputs only at positions >= j - 1 of that document
  // (position j - 1 mixes in E[t_j]).
  ForwardOptions opt;
  opt.mtp_logits = true;
  const ForwardOutput base = model.forward({i32(ids), i32(cu), Tensor(), labels}, opt);
  const int32_t j = cu[1] + 7;
  std::vector<int32_t> changed = ids;
  changed[j] = ids[j] == 5 ? 6 : 5;
  const ForwardOutput after = model.forward({i32(changed), i32(cu)}, opt);
  const Tensor& a = base.mtp->logits[0];
  const Tensor& b = after.mtp->logits[0];
  EXPECT_LE(rel_err(rows(b, 0, j - 1), rows(a, 0, j - 1)), 1e-13);
  EXPECT_GT(rel_err(rows(b, j - 1, j), rows(a, j - 1, j)), 1e-6);
  EXPECT_LE(rel_err(rows(b, cu[2], cu[3]), rows(a, cu[2], cu[3])), 1e-13);
  // The main logits at j - 1 do not see token j; the MTP logits do.
  EXPECT_LE(rel_err(rows(after.logits, j - 1, j), rows(base.logits, j - 1, j)), 1e-13);

  // mtp_loss = scale × mean CE, the scale a knob.
  EXPECT_NEAR(base.mtp->loss, 0.1 * base.mtp->ce[0].mean(), 1e-12);
  ForwardOptions scaled = opt;
  scaled.mtp_loss_scale = 0.3;
  const ForwardOutput s = model.forward({i32(ids), i32(cu), Tensor(), labels}, scaled);
  EXPECT_NEAR(s.mtp->loss, 3 * base.mtp->loss, 1e-12);
  // Without labels there is no loss, but MTP still runs (its routing feeds the bias update).
  EXPECT_TRUE(after.mtp->ce.empty());
  EXPECT_EQ(after.mtp->expert_counts.size(), 1u);
  ForwardOptions off = opt;
  off.mtp = false;
  EXPECT_FALSE(model.forward({i32(ids), i32(cu)}, off).mtp.has_value());
}

// ---------------------------------------------------------------------------------------------
// Saved context and indexer schedules.

TEST(ModelForward, KeepEverythingContextIsConsistent) {
  GoldenEnv& e = env();
  std::mt19937_64 rng(test_seed() + 5);
  SCOPED_TRACE("seed " + std::to_string(test_seed()));
  const std::vector<int64_t> lengths = {9, 23};
  const std::vector<int32_t> ids = random_ids(rng, lengths, e.config.text());
  const std::vector<int32_t> cu = offsets(lengths);
  ForwardOptions opt;
  opt.save = SavePolicy::all;
  const ForwardOutput out =
      e.f64->forward({i32(ids), i32(cu), Tensor(), next_token_labels(i32(ids), i32(cu))}, opt);
  const ForwardContext& ctx = *out.context;
  const TextConfig& c = e.config.text();
  ASSERT_EQ(int64_t(ctx.layers.size()), c.num_hidden_layers);
  const int64_t T = int64_t(ids.size());
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const LayerContext& lc = ctx.layers[size_t(l)];
    EXPECT_EQ(lc.streams_in.shape(), (Shape{T, c.hc_mult, c.hidden_size}));
    EXPECT_EQ(lc.attn_in.shape(), (Shape{T, c.hidden_size}));
    EXPECT_EQ(lc.attn_hc_saved.pre.shape(), (Shape{T, c.hc_mult}));
    EXPECT_EQ(lc.kda.q.defined(), c.layer_types[l] == AttnKind::kda);
    EXPECT_EQ(lc.indices.defined(), c.layer_types[l] == AttnKind::dsa);
    EXPECT_EQ(lc.routing.indices.defined(), c.mlp_layer_types[l] == MlpKind::sparse);
    // The saved pieces rebuild the layer's output: the next layer's input (or the final streams).
    const Tensor next = ops::mhc_post(lc.streams_mid, lc.ffn_out, lc.ffn_hc.post, lc.ffn_hc.comb);
    const Tensor& saved =
        l + 1 < c.num_hidden_layers ? ctx.layers[size_t(l + 1)].streams_in : ctx.final_streams;
    EXPECT_EQ(next.to_doubles(), saved.to_doubles()) << "layer " << l;
    const Tensor mid = ops::mhc_post(lc.streams_in, lc.attn_out, lc.attn_hc.post, lc.attn_hc.comb);
    EXPECT_EQ(mid.to_doubles(), lc.streams_mid.to_doubles()) << "layer " << l;
  }
  EXPECT_EQ(ctx.final_normed.shape(), (Shape{T, c.hidden_size}));
  ASSERT_EQ(ctx.mtp.size(), 1u);
  EXPECT_EQ(ctx.mtp[0].out_normed.to_doubles(), out.mtp->hidden[0].to_doubles());
  EXPECT_EQ(ctx.mtp_labels.size(), 1u);
  // The saved head input reproduces the logits and, through the saved labels, the loss.
  const Tensor logits = ops::linear(ctx.final_normed, e.f64->weights().lm_head.weight);
  EXPECT_EQ(logits.to_doubles(), out.logits.to_doubles());
  const std::vector<int32_t> lab = ints(ctx.labels);
  const int64_t V = c.vocab_size;
  double sum = 0;
  for (int64_t i = 0; i < T; ++i) {
    if (lab[i] == kIgnoreLabel) continue;
    double mx = -INFINITY, se = 0;
    for (int64_t v = 0; v < V; ++v) mx = std::max(mx, logits.item({i, v}));
    for (int64_t v = 0; v < V; ++v) se += std::exp(logits.item({i, v}) - mx);
    sum += mx + std::log(se) - logits.item({i, lab[i]});
  }
  EXPECT_NEAR(sum, out.lm->sum, 1e-9 * std::abs(sum));
}

TEST(ModelForward, SharedIndexerLayerReusesThePreviousSelection) {
  TempDir dir("shared");
  ModelConfig config = ModelConfig::preset("tiny");
  config.set("text_config.layer_types",
             R"(["linear_attention","linear_attention","linear_attention",)"
             R"("deepseek_sparse_attention","deepseek_sparse_attention"])");
  config.set("text_config.indexer_types", R"(["full","full","full","full","shared"])");
  InitOptions options;
  options.seed = test_seed();
  write_random_checkpoint(config, dir.path() / "ck", options);
  const io::CheckpointReader reader = io::CheckpointReader::open(dir.path() / "ck");
  const TextModel model(ParamStore::load(reader, config), TextModelOptions{DType::f64});
  std::mt19937_64 rng(test_seed() + 6);
  const std::vector<int64_t> lengths = {25, 14};
  const std::vector<int32_t> ids = random_ids(rng, lengths, config.text());
  ForwardOptions opt;
  opt.save = SavePolicy::all;
  const ForwardOutput out = model.forward({i32(ids), i32(offsets(lengths))}, opt);
  EXPECT_EQ(ints(out.context->layers[4].indices), ints(out.context->layers[3].indices));

  // A shared layer after a KDA layer has nothing to reuse; the reference raises at run time, the
  // config refuses it up front (the model relies on that).
  ModelConfig bad = ModelConfig::preset("tiny");
  EXPECT_THROW(bad.set("text_config.indexer_types", R"(["full","full","full","shared","full"])"),
               Error);
}

TEST(ModelForward, RejectsBadInput) {
  GoldenEnv& e = env();
  const int32_t V = int32_t(e.config.text().vocab_size);
  EXPECT_THROW(e.f32->forward({i32({1, 2, V}), i32({0, 3})}), Error);
  EXPECT_THROW(e.f32->forward({i32({1, 2, 3}), i32({0, 2})}), Error);
  EXPECT_THROW(e.f32->forward({i32({1, 2, 3}), i32({0, 3}), Tensor(), i32({5, V + 1, -100})}),
               Error);
  EXPECT_THROW(e.f32->forward({i32({}), i32({0})}), Error);
}

// ---------------------------------------------------------------------------------------------
// Loss helpers.

TEST(Loss, NextTokenLabelsStayInsideDocuments) {
  std::mt19937_64 rng(test_seed() + 7);
  SCOPED_TRACE("seed " + std::to_string(test_seed()));
  const std::vector<int64_t> lengths = {1, 4, 0, 9};
  std::vector<int32_t> ids;
  std::vector<int32_t> trained;
  for (int64_t n : lengths)
    for (int64_t i = 0; i < n; ++i) {
      ids.push_back(int32_t(rng() % 1000) + 1);
      trained.push_back(int32_t(rng() % 3 != 0));
    }
  const std::vector<int32_t> cu = offsets(lengths);
  const std::vector<int32_t> all = ints(next_token_labels(i32(ids), i32(cu)));
  const std::vector<int32_t> masked = ints(next_token_labels(i32(ids), i32(cu), i32(trained)));
  for (size_t d = 0; d + 1 < cu.size(); ++d)
    for (int32_t i = cu[d]; i < cu[d + 1]; ++i) {
      const bool has_next = i + 1 < cu[d + 1];
      EXPECT_EQ(all[i], has_next ? ids[i + 1] : kIgnoreLabel) << i;
      EXPECT_EQ(masked[i], has_next && trained[i + 1] ? ids[i + 1] : kIgnoreLabel) << i;
    }
  const std::vector<int32_t> two = ints(shift_labels(i32(all), i32(cu), 2));
  for (size_t d = 0; d + 1 < cu.size(); ++d)
    for (int32_t i = cu[d]; i < cu[d + 1]; ++i)
      EXPECT_EQ(two[i], i + 2 < cu[d + 1] ? all[i + 2] : kIgnoreLabel) << i;
  EXPECT_THROW(next_token_labels(i32(ids), i32({0, 3, 2, int32_t(ids.size())})), Error);
}

// ---------------------------------------------------------------------------------------------
// `glmtune eval`.

namespace {

using glmtune::test::CliResult;
CliResult run(const std::string& args) { return glmtune::test::run_glmtune(args); }

}  // namespace

TEST(EvalCli, LossEqualsTheInProcessForward) {
  TempDir dir("eval");
  const ModelConfig config = ModelConfig::preset("tiny");
  const fs::path tok = kSource / "examples" / "tiny" / "tokenizer";
  InitOptions options;
  options.seed = test_seed();
  options.extra_files = {{tok / "tokenizer.json", "tokenizer.json"},
                         {tok / "tokenizer_config.json", "tokenizer_config.json"}};
  const fs::path ck = dir.path() / "ck";
  write_random_checkpoint(config, ck, options);

  const std::string text = "Sorted, 18 43 3 1 becomes 1 3 18 43.";
  const CliResult r = run("eval --model " + ck.string() + " --text '" + text + "' --json");
  ASSERT_EQ(r.code, 0) << r.out;
  const auto j = nlohmann::json::parse(r.out);

  const data::Tokenizer tokenizer = data::Tokenizer::from_file((tok / "tokenizer.json").string());
  std::vector<int32_t> ids = tokenizer.encode(text);
  ids.push_back(tokenizer.require_id("<|endoftext|>"));
  const Tensor cu = i32({0, int32_t(ids.size())});
  const io::CheckpointReader reader = io::CheckpointReader::open(ck);
  const TextModel model(ParamStore::load(reader, config));
  const ForwardOutput out =
      model.forward({i32(ids), cu, Tensor(), next_token_labels(i32(ids), cu)});
  EXPECT_EQ(j.at("input_tokens").get<int64_t>(), int64_t(ids.size()));
  EXPECT_EQ(j.at("tokens").get<int64_t>(), int64_t(ids.size()) - 1);
  EXPECT_NEAR(j.at("loss").get<double>(), out.loss(), 1e-6);
  EXPECT_NEAR(j.at("perplexity").get<double>(), std::exp(out.loss()), 1e-3);
  EXPECT_NEAR(j.at("mtp_loss").get<double>(), out.mtp->loss, 1e-6);
  EXPECT_GT(j.at("tokens_per_second").get<double>(), 0.0);

  // JSONL data in packs, and the human-readable summary.
  const fs::path data = kSource / "examples" / "tiny" / "data" / "chat.jsonl";
  const CliResult d = run("eval --model " + ck.string() + " --data " + data.string() +
                          " --pack-length 256 --max-packs 2 --json");
  ASSERT_EQ(d.code, 0) << d.out;
  const auto dj = nlohmann::json::parse(d.out);
  EXPECT_EQ(dj.at("packs").get<int64_t>(), 2);
  EXPECT_EQ(dj.at("slots").get<int64_t>(), 512);
  EXPECT_GT(dj.at("tokens").get<int64_t>(), 0);
  EXPECT_EQ(int64_t(dj.at("per_sample").size()), dj.at("samples").get<int64_t>());
  EXPECT_TRUE(std::isfinite(dj.at("loss").get<double>()));
  const CliResult h = run("eval --model " + ck.string() + " --text 'hello there' --no-mtp");
  ASSERT_EQ(h.code, 0) << h.out;
  EXPECT_NE(h.out.find("perplexity"), std::string::npos) << h.out;
  EXPECT_EQ(h.out.find("mtp_loss"), std::string::npos) << h.out;
}

TEST(EvalCli, ExplainsWhatIsMissing) {
  TempDir dir("eval_missing");
  InitOptions options;
  options.seed = test_seed();
  const fs::path ck = dir.path() / "ck";
  write_random_checkpoint(ModelConfig::preset("tiny"), ck, options);
  const CliResult r = run("eval --model " + ck.string() + " --text hello");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("tokenizer.json"), std::string::npos) << r.out;
  const CliResult n = run("eval --model " + ck.string());
  EXPECT_NE(n.code, 0);
  EXPECT_NE(n.out.find("--data"), std::string::npos) << n.out;
}

// ---------------------------------------------------------------------------------------------
// Second geometry, several seeds (tools/golden/model_forward_geometry2.py): indexer pool 2, a
// "shared" indexer layer, attention biases, group-limited routing, 3 KDA heads, and documents of
// 3 .. 200 tokens packed together.

namespace {

std::vector<fs::path> geometry2_fixtures() {
  std::vector<fs::path> out;
  for (const auto& entry : fs::directory_iterator(kGolden.parent_path()))
    if (entry.path().filename().string().starts_with("tiny_forward_geometry2_seed"))
      out.push_back(entry.path());
  std::sort(out.begin(), out.end());
  return out;
}

// The fixture's model: its preset and init overrides, its seed, its redrawn parameters.
std::unique_ptr<TextModel> fixture_model(const io::SafetensorsFile& golden, const fs::path& dir,
                                         ModelConfig& config) {
  const auto meta = nlohmann::json::parse(golden.metadata().at("fixture"));
  config = ModelConfig::preset(meta.at("preset").get<std::string>());
  for (const auto& item : meta.at("init_sets")) {
    const std::string s = item.get<std::string>();
    const size_t eq = s.find('=');
    config.set(s.substr(0, eq), s.substr(eq + 1));
  }
  InitOptions options;
  options.seed = meta.at("init_seed").get<uint64_t>();
  write_random_checkpoint(config, dir, options);
  const io::CheckpointReader reader = io::CheckpointReader::open(dir);
  ParamStore store = ParamStore::load(reader, config);
  int replaced = 0;
  for (const std::string& name : golden.names()) {
    if (!name.starts_with("param.")) continue;
    const std::string param = name.substr(6);
    EXPECT_TRUE(store.contains(param)) << param;
    if (!store.contains(param)) continue;
    EXPECT_EQ(store.get(param).shape(), golden.tensor(name).shape()) << param;
    store.get(param) = golden.tensor(name).clone();
    ++replaced;
  }
  EXPECT_GT(replaced, 30);
  return std::make_unique<TextModel>(store);
}

// Hugging Face labels (unshifted, per document) -> the aligned targets the forward takes.
std::vector<int32_t> aligned_labels(const std::vector<int32_t>& hf,
                                    const std::vector<int32_t>& cu) {
  std::vector<int32_t> out(hf.size(), kIgnoreLabel);
  for (size_t d = 0; d + 1 < cu.size(); ++d)
    for (int32_t i = cu[d]; i + 1 < cu[d + 1]; ++i) out[i] = hf[i + 1];
  return out;
}

// Rows `rows` of t (first dimension), flattened.
std::vector<double> gather(const Tensor& t, const std::vector<int64_t>& rows) {
  std::vector<double> out;
  for (int64_t r : rows) {
    const std::vector<double> v = t.select(0, r).to_doubles();
    out.insert(out.end(), v.begin(), v.end());
  }
  return out;
}

}  // namespace

TEST(ModelForwardGeometry2, MatchesReferenceOnEveryCase) {
  const std::vector<fs::path> fixtures = geometry2_fixtures();
  ASSERT_GE(fixtures.size(), 2u) << "run tools/golden/model_forward_geometry2.py";
  for (const fs::path& file : fixtures) {
    SCOPED_TRACE(file.filename().string());
    TempDir dir("g2");
    const io::SafetensorsFile golden = io::SafetensorsFile::open(file);
    ModelConfig config;
    const std::unique_ptr<TextModel> model = fixture_model(golden, dir.path() / "ck", config);
    const TextConfig& c = config.text();
    const std::vector<int32_t> ids = ints(golden.tensor("input_ids"));
    const std::vector<int32_t> cu = ints(golden.tensor("cu_seqlens"));
    const Tensor labels = i32(aligned_labels(ints(golden.tensor("labels_hf")), cu));
    ForwardOptions opt;
    opt.save = SavePolicy::all;
    opt.mtp = false;  // the reference has no MTP module
    const ForwardOutput out = model->forward({i32(ids), i32(cu), Tensor(), labels}, opt);
    const ForwardContext& ctx = *out.context;

    const double logits_err = rel_err(out.logits, golden.tensor("logits"));
    EXPECT_LE(logits_err, 1e-4);
    EXPECT_NEAR(out.loss(), golden.tensor("loss").item({0}), 1e-5);
    // Each document's loss from its own rows.
    const std::vector<double> doc_loss = golden.tensor("doc_loss").to_doubles();
    const std::vector<double> doc_targets = golden.tensor("doc_targets").to_doubles();
    for (size_t d = 0; d + 1 < cu.size(); ++d) {
      const auto ce = ops::cross_entropy_forward(rows(out.logits, cu[d], cu[d + 1]).contiguous(),
                                                 rows(labels, cu[d], cu[d + 1]).contiguous());
      EXPECT_EQ(double(ce.n_tokens), doc_targets[d]) << "document " << d;
      if (ce.n_tokens > 0) EXPECT_NEAR(ce.loss, doc_loss[d], 1e-5) << "document " << d;
    }
    // The mHC streams after every layer, at the kept rows.
    const Tensor kept = golden.tensor("stream_rows");
    std::vector<int64_t> stream_rows;
    for (double r : kept.to_doubles()) stream_rows.push_back(int64_t(r));
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
      const Tensor& after =
          l + 1 < c.num_hidden_layers ? ctx.layers[size_t(l + 1)].streams_in : ctx.final_streams;
      const std::vector<double> ref = golden.tensor(fmt::format("layer{}_streams", l)).to_doubles();
      EXPECT_LE(rel_err(gather(after, stream_rows), ref), 1e-4) << "layer " << l;
    }
    // Selections as sets, the shared layer's included (it reuses its predecessor's).
    int dsa = 0;
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
      if (c.layer_types[l] != AttnKind::dsa) continue;
      ++dsa;
      EXPECT_EQ(row_sets(ctx.layers[size_t(l)].indices),
                row_sets(golden.tensor(fmt::format("layer{}_indices", l))))
          << "layer " << l;
    }
    EXPECT_EQ(dsa, 3);
    std::printf("%s: logits rel err %.3g, loss %.8f (reference %.8f)\n", file.filename().c_str(),
                logits_err, out.loss(), golden.tensor("loss").item({0}));

    // The recurrent KDA core gives every KDA layer the same output as the chunked one (documents
    // of 63 .. 200 tokens cross the 64-token chunks).
    OpConfigs recurrent = model->op_configs();
    recurrent.kda.core = ops::KdaCore::recurrent;
    const Tensor cu_t = i32(cu);
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
      const LayerWeights& w = model->weights().layers[size_t(l)];
      if (w.attn != AttnKind::kda) continue;
      IndexerCarry carry_a, carry_b;
      Tensor counts_a, counts_b;
      const Tensor& in = ctx.layers[size_t(l)].streams_in;
      const Tensor a = decoder_layer_forward(model->op_configs(), c, w, in, cu_t, in.size(0),
                                             carry_a, &counts_a, nullptr);
      const Tensor b =
          decoder_layer_forward(recurrent, c, w, in, cu_t, in.size(0), carry_b, &counts_b, nullptr);
      EXPECT_LE(rel_err(b, a), 1e-5) << "KDA layer " << l;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// `glmtune eval` on pre-tokenised {"input_ids", "labels"} lines.

namespace {

// A random tiny checkpoint (no tokenizer: pre-tokenised data does not need one) and JSONL lines of
// documents with Hugging Face labels, some masked, one line without labels.
struct PretokenisedCase {
  TempDir dir{"eval_ids"};
  ModelConfig config = ModelConfig::preset("tiny");
  fs::path ck = dir.path() / "ck";
  fs::path data = dir.path() / "data.jsonl";
  std::vector<std::vector<int32_t>> ids, labels;

  PretokenisedCase() {
    InitOptions options;
    options.seed = test_seed();
    write_random_checkpoint(config, ck, options);
    std::mt19937_64 rng(test_seed() + 8);
    const std::vector<int64_t> lengths = {1, 3, 17, 64, 65, 9, 130};
    std::ofstream f(data);
    for (size_t d = 0; d < lengths.size(); ++d) {
      ids.push_back(random_ids(rng, {lengths[d]}, config.text()));
      labels.push_back(ids.back());
      nlohmann::json line = {{"input_ids", ids.back()}};
      if (d != 2) {
        for (size_t i = 0; i < labels.back().size(); ++i)
          if (rng() % 4 == 0) labels.back()[i] = kIgnoreLabel;
        line["labels"] = labels.back();
      }
      f << line.dump() << "\n";
      if (d == 3) f << "\n";  // blank lines are skipped
    }
  }
};

}  // namespace

TEST(EvalCli, PretokenisedSamplesPackedEqualEachAlone) {
  PretokenisedCase p;
  SCOPED_TRACE("seed " + std::to_string(test_seed()));
  const fs::path packed_logits = p.dir.path() / "packed.safetensors";
  const fs::path alone_logits = p.dir.path() / "alone.safetensors";
  // --pack-length 1: every document gets a pack of its own; 4096: all share one forward.
  const CliResult packed =
      run("eval --model " + p.ck.string() + " --data " + p.data.string() +
          " --pack-length 4096 --json --dump-logits " + packed_logits.string());
  ASSERT_EQ(packed.code, 0) << packed.out;
  const CliResult alone = run("eval --model " + p.ck.string() + " --data " + p.data.string() +
                              " --pack-length 1 --json --dump-logits " + alone_logits.string());
  ASSERT_EQ(alone.code, 0) << alone.out;
  const auto pj = nlohmann::json::parse(packed.out), aj = nlohmann::json::parse(alone.out);
  EXPECT_EQ(pj.at("packs").get<int64_t>(), 1);
  EXPECT_EQ(aj.at("packs").get<int64_t>(), int64_t(p.ids.size()));
  ASSERT_EQ(pj.at("per_sample").size(), p.ids.size());
  ASSERT_EQ(aj.at("per_sample").size(), p.ids.size());
  EXPECT_NEAR(pj.at("loss").get<double>(), aj.at("loss").get<double>(), 1e-6);
  EXPECT_NEAR(pj.at("mtp_loss").get<double>(), aj.at("mtp_loss").get<double>(), 1e-6);
  EXPECT_EQ(pj.at("tokens"), aj.at("tokens"));

  // The in-process forward of each document alone, with the HF labels shifted inside it.
  const io::CheckpointReader reader = io::CheckpointReader::open(p.ck);
  const TextModel model(ParamStore::load(reader, p.config));
  const io::SafetensorsFile pl = io::SafetensorsFile::open(packed_logits);
  const io::SafetensorsFile al = io::SafetensorsFile::open(alone_logits);
  EXPECT_EQ(pl.size(), p.ids.size());
  double sum = 0;
  int64_t count = 0;
  for (size_t d = 0; d < p.ids.size(); ++d) {
    SCOPED_TRACE("sample " + std::to_string(d));
    const auto& ps = pj.at("per_sample")[d];
    const auto& as = aj.at("per_sample")[d];
    EXPECT_EQ(ps.at("tokens"), as.at("tokens"));
    const int32_t n = int32_t(p.ids[d].size());
    const Tensor cu = i32({0, n});
    const Tensor lab = i32(aligned_labels(p.labels[d], {0, n}));
    const ForwardOutput out = model.forward({i32(p.ids[d]), cu, Tensor(), lab});
    EXPECT_EQ(ps.at("tokens").get<int64_t>(), out.lm->count);
    sum += out.lm->sum;
    count += out.lm->count;
    if (out.lm->count > 0) {
      EXPECT_NEAR(ps.at("loss").get<double>(), as.at("loss").get<double>(), 1e-6);
      EXPECT_NEAR(ps.at("loss").get<double>(), out.loss(), 1e-6);
    } else {
      EXPECT_TRUE(ps.at("loss").is_null());  // a 1-token document predicts nothing
    }
    const std::string name = "logits." + std::to_string(d);
    const Tensor a = pl.tensor(name), b = al.tensor(name);
    EXPECT_EQ(a.dtype(), DType::f32);
    EXPECT_EQ(a.shape(), (Shape{n, p.config.text().vocab_size}));
    EXPECT_LE(rel_err(a, b), 1e-6);
    EXPECT_LE(rel_err(a, out.logits), 1e-6);
  }
  // The loss is the mean over all label tokens, not a mean of the samples' means.
  EXPECT_EQ(pj.at("tokens").get<int64_t>(), count);
  EXPECT_NEAR(pj.at("loss").get<double>(), sum / double(count), 1e-6);

  // Without --dump-logits the loss comes from the chunked head: the same numbers.
  const CliResult plain = run("eval --model " + p.ck.string() + " --data " + p.data.string() +
                              " --json --loss-chunk 5");
  ASSERT_EQ(plain.code, 0) << plain.out;
  EXPECT_NEAR(nlohmann::json::parse(plain.out).at("loss").get<double>(),
              pj.at("loss").get<double>(), 1e-6);
}

TEST(EvalCli, BadPretokenisedLinesNameFileAndLine) {
  TempDir dir("eval_bad");
  InitOptions options;
  options.seed = test_seed();
  const ModelConfig config = ModelConfig::preset("tiny");
  const fs::path ck = dir.path() / "ck";
  write_random_checkpoint(config, ck, options);
  const int64_t V = config.text().vocab_size;
  const std::string good = R"({"input_ids": [5, 6, 7]})";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"input_ids": [5, 6)", "not valid JSON"},
      {R"({"input_ids": [5, )" + std::to_string(V) + "]}", "outside the model's vocabulary"},
      {R"({"input_ids": [5, -1]})", "outside the model's vocabulary"},
      {R"({"input_ids": [5, 6], "labels": [5]})", "1 labels for 2 input ids"},
      {R"({"input_ids": [5, 6], "labels": [5, -7]})", "not -100"},
      {R"({"input_ids": [5, 6.5]})", "not an integer"},
      {R"({"input_ids": []})", "empty"},
      {R"({"text": "hello"})", "no \"input_ids\""},
  };
  for (size_t k = 0; k < cases.size(); ++k) {
    SCOPED_TRACE(cases[k].first);
    const fs::path data = dir.path() / ("bad" + std::to_string(k) + ".jsonl");
    std::ofstream(data) << good << "\n\n" << cases[k].first << "\n" << good << "\n";
    const CliResult r = run("eval --model " + ck.string() + " --data " + data.string());
    EXPECT_NE(r.code, 0) << r.out;
    EXPECT_NE(r.out.find(data.string() + ":3"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find(cases[k].second), std::string::npos) << r.out;
  }
  // A failed run leaves no logits file behind.
  const fs::path data = dir.path() / "bad_tail.jsonl";
  std::ofstream(data) << good << "\n"
                      << R"({"input_ids": [1]})"
                      << "\n";
  const fs::path out = dir.path() / "logits.safetensors";
  const CliResult r = run("eval --model " + ck.string() + " --data " + data.string() +
                          " --pack-length 1 --dump-logits " + out.string());
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(fs::exists(out));
  std::ofstream(data) << R"({"input_ids": [1]})"
                      << "\n";
  fs::remove(out);
  const CliResult none = run("eval --model " + ck.string() + " --data " + data.string() +
                             " --dump-logits " + out.string());
  EXPECT_NE(none.code, 0);
  EXPECT_NE(none.out.find("no token carries a loss"), std::string::npos) << none.out;
  EXPECT_FALSE(fs::exists(out));
  for (const auto& e : fs::directory_iterator(dir.path()))
    EXPECT_EQ(e.path().filename().string().find(".tmp."), std::string::npos) << e.path();
}
